// Shared helpers for the GPT-2 kernels. Compiled with NVRTC at run time: no system headers.
// Weights are `float` or bf16 stored as `unsigned short`; activations and logits are f32; the KV
// cache is f32 with f32 weights and fp16 with bf16 weights (`KvOf`).
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

// The grid asks L2 for `bytes` from `p` (another kernel's weights, due next), a 128-byte line
// a thread at a time over every thread of the grid; nothing when p is null.
__device__ __forceinline__ void grid_prefetch_l2(const void* p, long long bytes) {
    if (p == nullptr) return;
    int block = (blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x;
    int threads = gridDim.x * gridDim.y * gridDim.z * blockDim.x;
    prefetch_l2(p, (size_t)bytes, block * blockDim.x + threadIdx.x, threads);
}

__device__ __forceinline__ float bf16_to_f32(bf16_t v) { return __uint_as_float(((u32)v) << 16); }
// f32 -> bf16 bits, round to nearest even (finite values).
__device__ __forceinline__ bf16_t f32_to_bf16_bits(float v) {
    u32 bits = __float_as_uint(v);
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (bf16_t)(bits >> 16);
}

// The KV cache's element for weights W: f32 with f32 weights; fp16 bits with bf16 weights, half
// the bytes the attention reads (11 significant bits; values are clamped to fp16's range,
// which GPT-2's keys and values are far inside).
struct kv16_t {
    unsigned short bits;
};
template <typename W> struct KvOf { typedef float T; };
template <> struct KvOf<bf16_t> { typedef kv16_t T; };
__device__ __forceinline__ unsigned short f32_to_f16_bits(float v) {
    v = fminf(fmaxf(v, -65504.0f), 65504.0f);
    unsigned short r;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(v));
    return r;
}
__device__ __forceinline__ float f16_bits_to_f32(unsigned short h) {
    float r;
    asm("cvt.f32.f16 %0, %1;" : "=f"(r) : "h"(h));
    return r;
}
__device__ __forceinline__ float kv_get(const float* p) { return *p; }
__device__ __forceinline__ float kv_get(const kv16_t* p) { return f16_bits_to_f32(p->bits); }
__device__ __forceinline__ void kv_put(float* p, float v) { *p = v; }
__device__ __forceinline__ void kv_put(kv16_t* p, float v) { p->bits = f32_to_f16_bits(v); }
// v as a cache of this element keeps it.
__device__ __forceinline__ float kv_kept(const float*, float v) { return v; }
__device__ __forceinline__ float kv_kept(const kv16_t*, float v) { return f16_bits_to_f32(f32_to_f16_bits(v)); }
// The two fp16 elements of a 32-bit word (the lower address in the low half) as f32.
__device__ __forceinline__ float2 f16x2_to_f32(u32 w) {
    return make_float2(f16_bits_to_f32((unsigned short)(w & 0xffffu)), f16_bits_to_f32((unsigned short)(w >> 16)));
}
// Eight fp16 (16 bytes, the lower address in u.x's low half) as f32.
__device__ __forceinline__ void f16x8_to_f32(uint4 u, float out[8]) {
    u32 words[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        float2 v = f16x2_to_f32(words[i]);
        out[2 * i] = v.x;
        out[2 * i + 1] = v.y;
    }
}
// Eight consecutive elements (16-byte aligned) as f32: one 16-byte load (fp16; f32: `load8`'s two).
__device__ __forceinline__ void kv_get8(const kv16_t* p, float out[8]) {
    f16x8_to_f32(*reinterpret_cast<const uint4*>(p), out);
}
// Two consecutive elements (8-byte aligned f32, 4-byte aligned fp16) as f32.
__device__ __forceinline__ float2 kv_get2(const float* p) { return *reinterpret_cast<const float2*>(p); }
__device__ __forceinline__ float2 kv_get2(const kv16_t* p) { return f16x2_to_f32(*reinterpret_cast<const u32*>(p)); }
// Four consecutive elements (16-byte aligned f32, 8-byte aligned fp16) as f32.
__device__ __forceinline__ float4 kv_get4(const float* p) { return *reinterpret_cast<const float4*>(p); }
__device__ __forceinline__ float4 kv_get4(const kv16_t* p) {
    uint2 u = *reinterpret_cast<const uint2*>(p);
    float2 a = f16x2_to_f32(u.x), b = f16x2_to_f32(u.y);
    return make_float4(a.x, a.y, b.x, b.y);
}
// Four f32 into four consecutive elements (aligned as kv_get4's).
__device__ __forceinline__ void kv_put4(float* p, float4 v) { *reinterpret_cast<float4*>(p) = v; }
__device__ __forceinline__ void kv_put4(kv16_t* p, float4 v) {
    u32 lo = (u32)f32_to_f16_bits(v.x) | ((u32)f32_to_f16_bits(v.y) << 16);
    u32 hi = (u32)f32_to_f16_bits(v.z) | ((u32)f32_to_f16_bits(v.w) << 16);
    *reinterpret_cast<uint2*>(p) = make_uint2(lo, hi);
}

// Eight weights from 16 bytes (bf16) or two 16-byte loads (f32), as f32.
__device__ __forceinline__ void load8(const float* w, float out[8]) {
    float4 a = *reinterpret_cast<const float4*>(w);
    float4 b = *reinterpret_cast<const float4*>(w + 4);
    out[0] = a.x; out[1] = a.y; out[2] = a.z; out[3] = a.w;
    out[4] = b.x; out[5] = b.y; out[6] = b.z; out[7] = b.w;
}
__device__ __forceinline__ void kv_get8(const float* p, float out[8]) { load8(p, out); }
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
// Four weights kept as stored (two registers for bf16) until `widen4` makes them floats.
template <typename W> struct Stored4 { using T = float4; };
template <> struct Stored4<bf16_t> { using T = uint2; };
template <typename W> __device__ __forceinline__ typename Stored4<W>::T fetch4(const W* w) {
    return *reinterpret_cast<const typename Stored4<W>::T*>(w);
}
__device__ __forceinline__ float4 widen4(float4 v) { return v; }
__device__ __forceinline__ float4 widen4(uint2 v) {
    return make_float4(__uint_as_float(v.x << 16), __uint_as_float(v.x & 0xffff0000u), __uint_as_float(v.y << 16),
                       __uint_as_float(v.y & 0xffff0000u));
}
__device__ __forceinline__ float4 load4(const bf16_t* w) { return widen4(fetch4(w)); }
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

// acc plus four key elements times the query's, in the order every decode score sums them.
__device__ __forceinline__ float key_dot4(float acc, float4 k, const float* q) {
    return acc + (k.x * q[0] + k.y * q[1] + k.z * q[2] + k.w * q[3]);
}
// The first dimension of group i (8 dimensions each) of the key that thread `part` of a
// position's `parts` scores: groups part, part + parts, ..., so that the threads of a position
// read its row side by side, in whole 32-byte sectors (fp16). Every decode score takes its
// dimensions in this order (`partial_dot`, `batch_attention_h64`).
__device__ __forceinline__ int key_group(int part, int parts, int i) { return 8 * (part + i * parts); }

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

// A generic pointer into shared memory as a shared-window address.
__device__ __forceinline__ u32 smem_addr(const void* p) {
    u32 addr;
    asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(addr) : "l"(p));
    return addr;
}
// 16 bytes global -> shared without passing through registers; zeros when !valid.
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(smem_addr(dst)), "l"(src),
                 "r"(valid ? 16 : 0)
                 : "memory");
#endif
}
__device__ __forceinline__ void cp_async_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.commit_group;" ::: "memory");
#endif
}
// Wait until at most N committed groups of this thread are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
#endif
}

// The input vector of a matrix-vector product into shared `xs[0..k)`, LayerNorm-ed when ln_w
// is given. Without a LayerNorm, x goes straight into shared memory (cp.async, sm_80+: no
// registers held), XL 16-byte pieces per thread: k <= blockDim * 4 * XL (checked on the
// host). With one, k <= blockDim * 4 * LNL and the row passes through registers; its weights
// are loaded before the wait for the previous kernel (PDL), as they do not depend on it. Every
// global load is issued before any is used: a plain strided loop would wait one round trip
// per iteration. `after_wait` runs once the wait is over and x's loads are issued: a caller
// issues its first weight loads there, so they are in flight while x is staged and
// normalised. Ends with a block barrier.
struct NoHook {
    __device__ __forceinline__ void operator()() const {}
};
template <int XL, int LNL, typename W, typename Hook = NoHook>
__device__ __forceinline__ void stage_x(float* xs, const float* x, int k, const W* ln_w, const W* ln_b,
                                        float* scratch, Hook after_wait = Hook()) {
    // Thread t owns x[i..i+4] for i = (u * blockDim + t) * 4.
    if (ln_w == nullptr) {
        pdl_wait();
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
#pragma unroll
        for (int u = 0; u < XL; u++) {
            int i = (u * blockDim.x + threadIdx.x) * 4;
            if (i < k) cp_async16(xs + i, x + i, true);
        }
        cp_async_commit();
        after_wait();
        cp_async_wait<0>();
#else
        float4 staged[XL];
#pragma unroll
        for (int u = 0; u < XL; u++) {
            int i = (u * blockDim.x + threadIdx.x) * 4;
            if (i < k) staged[u] = *reinterpret_cast<const float4*>(x + i);
        }
        after_wait();
#pragma unroll
        for (int u = 0; u < XL; u++) {
            int i = (u * blockDim.x + threadIdx.x) * 4;
            if (i < k) *reinterpret_cast<float4*>(xs + i) = staged[u];
        }
#endif
        __syncthreads();
        return;
    }
    // kept as stored (bf16: half the registers) until used
    typename Stored4<W>::T ln_wv[LNL], ln_bv[LNL];
#pragma unroll
    for (int u = 0; u < LNL; u++) {
        int i = (u * blockDim.x + threadIdx.x) * 4;
        if (i < k) {
            ln_wv[u] = fetch4(ln_w + i);
            ln_bv[u] = fetch4(ln_b + i);
        }
    }
    pdl_wait();
    float4 staged[LNL];
#pragma unroll
    for (int u = 0; u < LNL; u++) {
        int i = (u * blockDim.x + threadIdx.x) * 4;
        if (i < k) staged[u] = *reinterpret_cast<const float4*>(x + i);
    }
    after_wait();
    float s = 0.0f;
#pragma unroll
    for (int u = 0; u < LNL; u++)
        if ((u * blockDim.x + threadIdx.x) * 4 < k) s += staged[u].x + staged[u].y + staged[u].z + staged[u].w;
    float mean = block_sum(s, scratch) / k;
    float v = 0.0f;
#pragma unroll
    for (int u = 0; u < LNL; u++) {
        if ((u * blockDim.x + threadIdx.x) * 4 < k) {
            float a = staged[u].x - mean, b = staged[u].y - mean, c2 = staged[u].z - mean, d = staged[u].w - mean;
            v += a * a + b * b + c2 * c2 + d * d;
        }
    }
    float rstd = rsqrtf(block_sum(v, scratch) / k + 1e-5f);
#pragma unroll
    for (int u = 0; u < LNL; u++) {
        int i = (u * blockDim.x + threadIdx.x) * 4;
        if (i < k) {
            float4 g = widen4(ln_wv[u]), b = widen4(ln_bv[u]), y;
            y.x = (staged[u].x - mean) * rstd * g.x + b.x;
            y.y = (staged[u].y - mean) * rstd * g.y + b.y;
            y.z = (staged[u].z - mean) * rstd * g.z + b.z;
            y.w = (staged[u].w - mean) * rstd * g.w + b.w;
            *reinterpret_cast<float4*>(xs + i) = y;
        }
    }
    __syncthreads();
}

// Eight weights as loaded (16 bytes of bf16, or 32 of f32), widened to f32 only when used:
// bf16 weights in flight then take half the registers.
template <typename W>
struct Packed8;
template <>
struct Packed8<bf16_t> {
    uint4 v;
    __device__ __forceinline__ void load(const bf16_t* w) { v = *reinterpret_cast<const uint4*>(w); }
    __device__ __forceinline__ float get(int j) const {
        u32 word = j < 2 ? v.x : j < 4 ? v.y : j < 6 ? v.z : v.w;
        return __uint_as_float((j & 1) ? (word & 0xffff0000u) : (word << 16));
    }
};
template <>
struct Packed8<float> {
    float4 a, b;
    __device__ __forceinline__ void load(const float* w) {
        a = *reinterpret_cast<const float4*>(w);
        b = *reinterpret_cast<const float4*>(w + 4);
    }
    __device__ __forceinline__ float get(int j) const {
        const float4& q = j < 4 ? a : b;
        int e = j & 3;
        return e == 0 ? q.x : e == 1 ? q.y : e == 2 ? q.z : q.w;
    }
};

#define MV_UNROLL 4
// One lane's U 16-byte loads of each of R weight rows, from element `base` on (those
// past k are not loaded), and their products with xs added into acc[r] (partial sums per
// lane: the caller reduces over the warp).
template <int R, typename W, int U = MV_UNROLL>
struct RowLoads {
    Packed8<W> wv[U][R];
    __device__ __forceinline__ void load(const W* const rows[R], int base, int k) {
#pragma unroll
        for (int u = 0; u < U; u++) {
            int i = base + u * 32 * 8;
            if (i < k) {
#pragma unroll
                for (int r = 0; r < R; r++) wv[u][r].load(rows[r] + i);
            }
        }
    }
    __device__ __forceinline__ void fma(float acc[R], const float* xs, int base, int k) const {
#pragma unroll
        for (int u = 0; u < U; u++) {
            int i = base + u * 32 * 8;
            if (i < k) {
#pragma unroll
                for (int j = 0; j < 8; j++) {
                    float xv = xs[i + j];
#pragma unroll
                    for (int r = 0; r < R; r++) acc[r] += wv[u][r].get(j) * xv;
                }
            }
        }
    }
};

// acc[r] += (row r of W) . xs over k (a multiple of 8), one warp, partial sums per lane (the
// caller reduces over the warp), with the lane's first loads (from element lane * 8) already
// issued into `first`. Each lane issues U 16-byte loads per row before using any, so R * U
// loads are in flight at once.
template <int R, typename W, int U>
__device__ __forceinline__ void dot_rows_from(float acc[R], const RowLoads<R, W, U>& first, const W* const rows[R],
                                              const float* xs, int k, int lane) {
    int base = lane * 8;
    first.fma(acc, xs, base, k);
    for (base += 32 * 8 * U; base < k; base += 32 * 8 * U) {
        RowLoads<R, W, U> next;
        next.load(rows, base, k);
        next.fma(acc, xs, base, k);
    }
}

// Thread-block clusters (sm_90+): this block's rank, a barrier over the cluster that orders
// shared-memory writes before it (release) against reads after it (acquire), and loads and
// stores into a peer block's shared memory (distributed shared memory).
__device__ __forceinline__ u32 cluster_rank() {
    u32 r = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
#endif
    return r;
}
// The number of blocks in this block's cluster.
__device__ __forceinline__ u32 cluster_blocks() {
    u32 n = 1;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("mov.u32 %0, %%cluster_nctarank;" : "=r"(n));
#endif
    return n;
}
// A cluster barrier split in two: arrive early, wait just before the first access to another
// block's shared memory (a block may write into a peer's only once every block of the cluster
// has started; compute-sanitizer's racecheck reports the writes otherwise).
__device__ __forceinline__ void cluster_arrive_relaxed() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
#endif
}
__device__ __forceinline__ void cluster_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.wait.aligned;" ::: "memory");
#endif
}
__device__ __forceinline__ void cluster_sync() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
#endif
}
// The address of `p` (this block's shared memory) in block `rank`'s shared memory.
__device__ __forceinline__ u32 peer_addr(const void* p, u32 rank) {
    u32 out = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(out) : "r"(smem_addr(p)), "r"(rank));
#endif
    return out;
}
__device__ __forceinline__ void peer_store(u32 addr, float v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("st.shared::cluster.f32 [%0], %1;" ::"r"(addr), "f"(v) : "memory");
#endif
}
__device__ __forceinline__ float peer_load(u32 addr) {
    float v = 0.0f;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(addr) : "memory");
#endif
    return v;
}
__device__ __forceinline__ double peer_load_f64(u32 addr) {
    double v = 0.0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("ld.shared::cluster.f64 %0, [%1];" : "=d"(v) : "r"(addr) : "memory");
#endif
    return v;
}
__device__ __forceinline__ int peer_load_s32(u32 addr) {
    int v = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("ld.shared::cluster.s32 %0, [%1];" : "=r"(v) : "r"(addr) : "memory");
#endif
    return v;
}

// What a matrix product does with each output value (bias already added), the modes EPI_STORE
// (out[o] = v), EPI_GELU (out[o] = gelu(v)), EPI_RESIDUAL (out[o] += v) and EPI_QKV (q -> out[o];
// k, v -> the KV cache at the row's position): defined by the host (host/src/cuda/ops/mod.rs,
// `Epilogue`) and handed to NVRTC as -D defines.

// Write output column `o` of a row at absolute position `pos`. For EPI_QKV, `out` is the q
// buffer (row stride c), k_cache/v_cache are [n_ctx, c].
template <typename KV>
__device__ __forceinline__ void epilogue(int mode, float v, float* out_row, int o, int c, int pos, KV* k_cache,
                                         KV* v_cache) {
    switch (mode) {
        case EPI_STORE: out_row[o] = v; break;
        case EPI_GELU: out_row[o] = gelu_tanh(v); break;
        case EPI_RESIDUAL: out_row[o] += v; break;
        default:
            if (o < c) out_row[o] = v;
            else if (o < 2 * c) kv_put(k_cache + (size_t)pos * c + (o - c), v);
            else kv_put(v_cache + (size_t)pos * c + (o - 2 * c), v);
    }
}
