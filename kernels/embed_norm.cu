// Token + position embedding, and LayerNorm over rows.
#include "common.cuh"

// x[t, :] = wte[tokens[t], :] + wpe[start + t, :]. `start` is read from device memory
// (`pos_ptr`) when `start < 0`, so a captured decode graph serves every position. Also clears
// the LM head's argmax key (`best`) for the step it begins. With `feed` (one row: a decode step
// run ahead of its guest), the token is the argmax of the step before, read from its key in
// `best` before the clear (row 0 when no row set one, as the host reads it), at the position
// after the one in `pos_ptr`; both go back to tokens[0] and *pos_ptr for the step's later
// kernels.
template <typename W>
__device__ void embed_impl(float* x, int* tokens, const W* wte, const W* wpe, int c, int start, int* pos_ptr,
                           unsigned long long* best, int feed, int vocab) {
    __shared__ int fed[2];
    pdl_launch_dependents();
    pdl_wait();
    int t = blockIdx.x;
    if (feed) {
        if (threadIdx.x == 0) {
            unsigned long long key = *best;
            u32 row = key == 0ull ? 0u : 0xffffffffu - (u32)key;
            fed[0] = row < (u32)vocab ? (int)row : 0;
            fed[1] = *pos_ptr + 1;
        }
        __syncthreads();
    }
    // (thread 0 read the key above before it clears it here)
    if (t == 0 && threadIdx.x == 0) *best = 0ull;
    int pos = feed ? fed[1] : (start < 0 ? *pos_ptr : start) + t;
    int tok = feed ? fed[0] : tokens[t];
    for (int i = threadIdx.x; i < c; i += blockDim.x)
        x[(size_t)t * c + i] = load1(wte + (size_t)tok * c + i) + load1(wpe + (size_t)pos * c + i);
    if (feed && threadIdx.x == 0) {
        tokens[0] = tok;
        *pos_ptr = pos;
    }
}
extern "C" __global__ void embed_f32(float* x, int* tokens, const float* wte, const float* wpe, int c, int start,
                                     int* pos_ptr, unsigned long long* best, int feed, int vocab) {
    embed_impl(x, tokens, wte, wpe, c, start, pos_ptr, best, feed, vocab);
}
extern "C" __global__ void embed_bf16(float* x, int* tokens, const bf16_t* wte, const bf16_t* wpe, int c,
                                      int start, int* pos_ptr, unsigned long long* best, int feed, int vocab) {
    embed_impl(x, tokens, wte, wpe, c, start, pos_ptr, best, feed, vocab);
}

// out[r, :] = LayerNorm(x[r, :]) * w + b, eps 1e-5, one warp per row, shuffle reductions.
// With `pre_bias`, first x[r, :] += pre_bias (written back: the bias of the matrix product
// that just accumulated into x). `out` is f32, or bf16 when `out_bf16` (the input of a
// tensor-core GEMM). Rows of up to LN_MAX4 * 128 values (C % 4 == 0) are held in registers,
// all loads issued at once; other widths take the loop below.
#define LN_MAX4 16
__device__ __forceinline__ void ln_store(void* out, size_t at, float4 y, int out_bf16) {
    if (out_bf16) {
        u32 lo = (u32)f32_to_bf16_bits(y.x) | ((u32)f32_to_bf16_bits(y.y) << 16);
        u32 hi = (u32)f32_to_bf16_bits(y.z) | ((u32)f32_to_bf16_bits(y.w) << 16);
        *reinterpret_cast<uint2*>(static_cast<bf16_t*>(out) + at) = make_uint2(lo, hi);
    } else {
        *reinterpret_cast<float4*>(static_cast<float*>(out) + at) = y;
    }
}
template <typename W>
__device__ void layernorm_impl(void* out, float* in, const W* w, const W* b, const W* pre_bias, int c,
                               int out_bf16, int rows) {
    pdl_launch_dependents();
    int lane = threadIdx.x & 31;
    int r = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (r >= rows) {
        pdl_wait();
        return;
    }
    float* x = in + (size_t)r * c;
    size_t row = (size_t)r * c;
    if (c % 4 == 0 && c <= LN_MAX4 * 128) {
        int n4 = c / 4;
        // the weights do not depend on the kernel before: fetched while it finishes
        typename Stored4<W>::T g[LN_MAX4], bw[LN_MAX4];
#pragma unroll
        for (int j = 0; j < LN_MAX4; j++) {
            int i = lane + 32 * j;
            if (i < n4) {
                g[j] = fetch4(w + 4 * i);
                bw[j] = fetch4(b + 4 * i);
            }
        }
        pdl_wait();
        float4 v[LN_MAX4];
        float s = 0.0f;
#pragma unroll
        for (int j = 0; j < LN_MAX4; j++) {
            int i = lane + 32 * j;
            if (i < n4) v[j] = reinterpret_cast<const float4*>(x)[i];
        }
#pragma unroll
        for (int j = 0; j < LN_MAX4; j++) {
            int i = lane + 32 * j;
            if (i < n4) {
                if (pre_bias != nullptr) {
                    float4 p = load4(pre_bias + 4 * i);
                    v[j].x += p.x; v[j].y += p.y; v[j].z += p.z; v[j].w += p.w;
                    reinterpret_cast<float4*>(x)[i] = v[j];
                }
                s += v[j].x + v[j].y + v[j].z + v[j].w;
            }
        }
        float mean = warp_sum(s) / c;
        float var = 0.0f;
#pragma unroll
        for (int j = 0; j < LN_MAX4; j++) {
            if (lane + 32 * j < n4) {
                float a = v[j].x - mean, bb = v[j].y - mean, cc = v[j].z - mean, d = v[j].w - mean;
                var += a * a + bb * bb + cc * cc + d * d;
            }
        }
        float rstd = rsqrtf(warp_sum(var) / c + 1e-5f);
#pragma unroll
        for (int j = 0; j < LN_MAX4; j++) {
            int i = lane + 32 * j;
            if (i < n4) {
                float4 gj = widen4(g[j]), bj = widen4(bw[j]);
                float4 y = make_float4((v[j].x - mean) * rstd * gj.x + bj.x, (v[j].y - mean) * rstd * gj.y + bj.y,
                                       (v[j].z - mean) * rstd * gj.z + bj.z, (v[j].w - mean) * rstd * gj.w + bj.w);
                ln_store(out, row + 4 * i, y, out_bf16);
            }
        }
        return;
    }
    pdl_wait();
    float s = 0.0f;
    for (int i = lane; i < c; i += 32) {
        float v = x[i];
        if (pre_bias != nullptr) {
            v += load1(pre_bias + i);
            x[i] = v;
        }
        s += v;
    }
    float mean = warp_sum(s) / c;
    float var = 0.0f;
    for (int i = lane; i < c; i += 32) { float d = x[i] - mean; var += d * d; }
    float rstd = rsqrtf(warp_sum(var) / c + 1e-5f);
    for (int i = lane; i < c; i += 32) {
        float y = (x[i] - mean) * rstd * load1(w + i) + load1(b + i);
        if (out_bf16) static_cast<bf16_t*>(out)[row + i] = f32_to_bf16_bits(y);
        else static_cast<float*>(out)[row + i] = y;
    }
}
extern "C" __global__ void layernorm_f32(void* out, float* in, const float* w, const float* b,
                                         const float* pre_bias, int c, int out_bf16, int rows) {
    layernorm_impl(out, in, w, b, pre_bias, c, out_bf16, rows);
}
extern "C" __global__ void layernorm_bf16(void* out, float* in, const bf16_t* w, const bf16_t* b,
                                          const bf16_t* pre_bias, int c, int out_bf16, int rows) {
    layernorm_impl(out, in, w, b, pre_bias, c, out_bf16, rows);
}

// x[r, :] += bias for `rows` rows (a bias left pending after the last matrix product).
template <typename W>
__device__ void add_bias_impl(float* x, const W* bias, int rows, int c) {
    pdl_launch_dependents();
    pdl_wait();
    size_t total = (size_t)rows * c;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (size_t)gridDim.x * blockDim.x)
        x[i] += load1(bias + i % c);
}
extern "C" __global__ void add_bias_f32(float* x, const float* bias, int rows, int c) {
    add_bias_impl(x, bias, rows, c);
}
extern "C" __global__ void add_bias_bf16(float* x, const bf16_t* bias, int rows, int c) {
    add_bias_impl(x, bias, rows, c);
}
