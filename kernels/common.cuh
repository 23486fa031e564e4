// Shared helpers for the GPT-2 kernels. Compiled with NVRTC at run time: no system headers.
// Weights are `float` or bf16 stored as `unsigned short`; activations, KV cache and logits are f32.
#pragma once

#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif

typedef unsigned short bf16_t;
typedef unsigned int u32;

// Programmatic dependent launch (Hopper+): a kernel launched with programmatic stream
// serialization may start while the previous one finishes. It lets its own dependents start
// early (`launch_dependents`), may prefetch weights (immutable), and must `wait` before reading
// activations or writing anything. Both are no-ops without PDL or before sm_90.
__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
// Ask L2 for `bytes` starting at `p`, one 128-byte line per thread step.
__device__ __forceinline__ void prefetch_l2(const void* p, size_t bytes, int thread, int threads) {
    const char* c = static_cast<const char*>(p);
    for (size_t off = (size_t)thread * 128; off < bytes; off += (size_t)threads * 128)
        asm volatile("prefetch.global.L2 [%0];" ::"l"(c + off));
}

__device__ __forceinline__ float bf16_to_f32(bf16_t v) { return __uint_as_float(((u32)v) << 16); }
// f32 -> bf16 bits, round to nearest even (finite values).
__device__ __forceinline__ bf16_t f32_to_bf16_bits(float v) {
    u32 bits = __float_as_uint(v);
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (bf16_t)(bits >> 16);
}

// Eight weights from 16 bytes (bf16) or two 16-byte loads (f32), as f32.
__device__ __forceinline__ void load8(const float* w, float out[8]) {
    float4 a = *reinterpret_cast<const float4*>(w);
    float4 b = *reinterpret_cast<const float4*>(w + 4);
    out[0] = a.x; out[1] = a.y; out[2] = a.z; out[3] = a.w;
    out[4] = b.x; out[5] = b.y; out[6] = b.z; out[7] = b.w;
}
__device__ __forceinline__ void load8(const bf16_t* w, float out[8]) {
    uint4 v = *reinterpret_cast<const uint4*>(w);
    u32 words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        out[2 * i] = __uint_as_float(words[i] << 16);
        out[2 * i + 1] = __uint_as_float(words[i] & 0xffff0000u);
    }
}
// Four weights (16-byte aligned f32, 8-byte aligned bf16) as f32.
__device__ __forceinline__ float4 load4(const float* w) { return *reinterpret_cast<const float4*>(w); }
__device__ __forceinline__ float4 load4(const bf16_t* w) {
    uint2 v = *reinterpret_cast<const uint2*>(w);
    return make_float4(__uint_as_float(v.x << 16), __uint_as_float(v.x & 0xffff0000u), __uint_as_float(v.y << 16),
                       __uint_as_float(v.y & 0xffff0000u));
}
__device__ __forceinline__ float load1(const float* w) { return *w; }
__device__ __forceinline__ float load1(const bf16_t* w) { return bf16_to_f32(*w); }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum over the block; every thread gets the result. `scratch` holds 32 floats.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < warps ? scratch[lane] : 0.0f;
    return warp_sum(v);
}
__device__ __forceinline__ float block_max(float v, float* scratch) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < warps ? scratch[lane] : -INFINITY;
    return warp_max(v);
}

__device__ __forceinline__ float gelu_tanh(float x) {
    const float k = 0.7978845608028654f;  // sqrt(2/pi)
    return 0.5f * x * (1.0f + tanhf(k * (x + 0.044715f * x * x * x)));
}

// What a matrix product does with each output value (bias already added).
enum Epilogue {
    EPI_STORE = 0,     // out[o] = v
    EPI_GELU = 1,      // out[o] = gelu(v)
    EPI_RESIDUAL = 2,  // out[o] += v
    EPI_QKV = 3,       // q -> out[o]; k, v -> the KV cache at the row's position
};

// Write output column `o` of a row at absolute position `pos`. For EPI_QKV, `out` is the q
// buffer (row stride c), k_cache/v_cache are [n_ctx, c].
__device__ __forceinline__ void epilogue(int mode, float v, float* out_row, int o, int c, int pos,
                                         float* k_cache, float* v_cache) {
    switch (mode) {
        case EPI_STORE: out_row[o] = v; break;
        case EPI_GELU: out_row[o] = gelu_tanh(v); break;
        case EPI_RESIDUAL: out_row[o] += v; break;
        default:
            if (o < c) out_row[o] = v;
            else if (o < 2 * c) k_cache[(size_t)pos * c + (o - c)] = v;
            else v_cache[(size_t)pos * c + (o - 2 * c)] = v;
    }
}
