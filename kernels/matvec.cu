// Batch-1 matrix-vector products for decode: y = W x + b with W [n, k] row-major, x [k].
// Memory-bound: each warp streams whole weight rows with 16-byte loads, two rows in flight;
// x sits in shared memory. Optional fused LayerNorm of x in the prologue (every block
// normalises the k-vector itself: k <= 4 * 1600 floats, cheap next to the weights) and a
// fused epilogue (bias, GELU, residual add, or the QKV scatter into the KV cache).
#include "common.cuh"

#define MV_WARPS 4
#define MV_ROWS_PER_WARP 2
#define MV_UNROLL 4
// float4 loads of x per thread: k <= 128 * 4 * MV_X_LOADS = 8192 (checked on the host)
#define MV_X_LOADS 16
// with a fused LayerNorm: k <= 128 * 4 * MV_LN_LOADS = 2048
#define MV_LN_LOADS 4

template <typename W>
__device__ void matvec_impl(float* out, const float* x, const W* w, const W* bias, int n, int k,
                            const W* ln_w, const W* ln_b, int mode, int c, const int* pos_ptr,
                            float* k_cache, float* v_cache) {
    extern __shared__ __align__(16) float xs[];
    __shared__ float scratch[32];
    pdl_launch_dependents();
    // Thread t owns x[i..i+4] for i = (u * blockDim + t) * 4. Every global load (LayerNorm
    // weights first: they do not depend on the previous kernel) is issued before any is used:
    // a plain strided loop would wait one round trip per iteration.
    float ln_wv[MV_LN_LOADS][4], ln_bv[MV_LN_LOADS][4];
    if (ln_w != nullptr) {
#pragma unroll
        for (int u = 0; u < MV_LN_LOADS; u++) {
            int i = (u * blockDim.x + threadIdx.x) * 4;
            if (i < k) {
#pragma unroll
                for (int e = 0; e < 4; e++) { ln_wv[u][e] = load1(ln_w + i + e); ln_bv[u][e] = load1(ln_b + i + e); }
            }
        }
    }
    pdl_wait();
    float4 staged[MV_X_LOADS];
#pragma unroll
    for (int u = 0; u < MV_X_LOADS; u++) {
        int i = (u * blockDim.x + threadIdx.x) * 4;
        if (i < k) staged[u] = *reinterpret_cast<const float4*>(x + i);
    }
    if (ln_w != nullptr) {
        // LayerNorm from registers (k <= 128 * 4 * MV_LN_LOADS when it is fused)
        float s = 0.0f;
#pragma unroll
        for (int u = 0; u < MV_LN_LOADS; u++)
            if ((u * blockDim.x + threadIdx.x) * 4 < k) s += staged[u].x + staged[u].y + staged[u].z + staged[u].w;
        float mean = block_sum(s, scratch) / k;
        float v = 0.0f;
#pragma unroll
        for (int u = 0; u < MV_LN_LOADS; u++) {
            if ((u * blockDim.x + threadIdx.x) * 4 < k) {
                float a = staged[u].x - mean, b = staged[u].y - mean, c2 = staged[u].z - mean, d = staged[u].w - mean;
                v += a * a + b * b + c2 * c2 + d * d;
            }
        }
        float rstd = rsqrtf(block_sum(v, scratch) / k + 1e-5f);
#pragma unroll
        for (int u = 0; u < MV_LN_LOADS; u++) {
            staged[u].x = (staged[u].x - mean) * rstd * ln_wv[u][0] + ln_bv[u][0];
            staged[u].y = (staged[u].y - mean) * rstd * ln_wv[u][1] + ln_bv[u][1];
            staged[u].z = (staged[u].z - mean) * rstd * ln_wv[u][2] + ln_bv[u][2];
            staged[u].w = (staged[u].w - mean) * rstd * ln_wv[u][3] + ln_bv[u][3];
        }
    }
#pragma unroll
    for (int u = 0; u < MV_X_LOADS; u++) {
        int i = (u * blockDim.x + threadIdx.x) * 4;
        if (i < k) *reinterpret_cast<float4*>(xs + i) = staged[u];
    }
    __syncthreads();
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int row0 = (blockIdx.x * MV_WARPS + warp) * MV_ROWS_PER_WARP;
    float acc[MV_ROWS_PER_WARP];
    const W* rows[MV_ROWS_PER_WARP];
#pragma unroll
    for (int r = 0; r < MV_ROWS_PER_WARP; r++) {
        acc[r] = 0.0f;
        // rows past n read the last row (valid memory) and are not stored
        rows[r] = w + (size_t)min(row0 + r, n - 1) * k;
    }
    // k is a multiple of 8 for every GPT-2 shape (checked on the host). Each lane issues
    // MV_UNROLL 16-byte loads per row before using any, so several are in flight at once.
    for (int base = lane * 8; base < k; base += 32 * 8 * MV_UNROLL) {
        float wv[MV_UNROLL][MV_ROWS_PER_WARP][8];
#pragma unroll
        for (int u = 0; u < MV_UNROLL; u++) {
            int i = base + u * 32 * 8;
            if (i < k) {
#pragma unroll
                for (int r = 0; r < MV_ROWS_PER_WARP; r++) load8(rows[r] + i, wv[u][r]);
            }
        }
#pragma unroll
        for (int u = 0; u < MV_UNROLL; u++) {
            int i = base + u * 32 * 8;
            if (i < k) {
#pragma unroll
                for (int j = 0; j < 8; j++) {
                    float xv = xs[i + j];
#pragma unroll
                    for (int r = 0; r < MV_ROWS_PER_WARP; r++) acc[r] += wv[u][r][j] * xv;
                }
            }
        }
    }
    int pos = pos_ptr != nullptr ? *pos_ptr : 0;
#pragma unroll
    for (int r = 0; r < MV_ROWS_PER_WARP; r++) {
        float v = warp_sum(acc[r]);
        int row = row0 + r;
        if (lane == 0 && row < n) {
            if (bias != nullptr) v += load1(bias + row);
            epilogue(mode, v, out, row, c, pos, k_cache, v_cache);
        }
    }
}

#define MATVEC(NAME, W)                                                                                 \
    extern "C" __global__ void __launch_bounds__(MV_WARPS * 32)                                         \
        NAME(float* out, const float* x, const W* w, const W* bias, int n, int k, const W* ln_w,        \
             const W* ln_b, int mode, int c, const int* pos_ptr, float* k_cache, float* v_cache) {     \
        matvec_impl(out, x, w, bias, n, k, ln_w, ln_b, mode, c, pos_ptr, k_cache, v_cache);             \
    }
MATVEC(matvec_f32, float)
MATVEC(matvec_bf16, bf16_t)

// The index of the largest logit (first index on ties; NaN never wins), one block.
extern "C" __global__ void argmax_f32(int* out, const float* logits, int n) {
    __shared__ float best_v[32];
    __shared__ int best_i[32];
    pdl_launch_dependents();
    pdl_wait();
    float v = -INFINITY;
    int idx = 0x7fffffff;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        float x = logits[i];
        if (x > v) { v = x; idx = i; }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        float ov = __shfl_xor_sync(0xffffffffu, v, o);
        int oi = __shfl_xor_sync(0xffffffffu, idx, o);
        if (ov > v || (ov == v && oi < idx)) { v = ov; idx = oi; }
    }
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) { best_v[warp] = v; best_i[warp] = idx; }
    __syncthreads();
    if (warp == 0) {
        int warps = blockDim.x >> 5;
        v = lane < warps ? best_v[lane] : -INFINITY;
        idx = lane < warps ? best_i[lane] : 0x7fffffff;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            float ov = __shfl_xor_sync(0xffffffffu, v, o);
            int oi = __shfl_xor_sync(0xffffffffu, idx, o);
            if (ov > v || (ov == v && oi < idx)) { v = ov; idx = oi; }
        }
        if (lane == 0) *out = idx == 0x7fffffff ? 0 : idx;
    }
}
