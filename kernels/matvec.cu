// Batch-1 matrix-vector products for decode: y = W x + b with W [n, k] row-major, x [k].
// Memory-bound: each warp streams whole weight rows with 16-byte loads, two rows in flight;
// x sits in shared memory. Optional fused LayerNorm of x in the prologue (every block
// normalises the k-vector itself: k <= 4 * 1600 floats, cheap next to the weights) and a
// fused epilogue (bias, GELU, residual add, or the QKV scatter into the KV cache).
#include "common.cuh"

#define MV_WARPS 4
#define MV_ROWS_PER_WARP 2

template <typename W>
__device__ void matvec_impl(float* out, const float* x, const W* w, const W* bias, int n, int k,
                            const W* ln_w, const W* ln_b, int mode, int c, const int* pos_ptr,
                            float* k_cache, float* v_cache) {
    extern __shared__ float xs[];
    __shared__ float scratch[32];
    for (int i = threadIdx.x; i < k; i += blockDim.x) xs[i] = x[i];
    if (ln_w != nullptr) {
        __syncthreads();
        float s = 0.0f;
        for (int i = threadIdx.x; i < k; i += blockDim.x) s += xs[i];
        float mean = block_sum(s, scratch) / k;
        float v = 0.0f;
        for (int i = threadIdx.x; i < k; i += blockDim.x) { float d = xs[i] - mean; v += d * d; }
        float rstd = rsqrtf(block_sum(v, scratch) / k + 1e-5f);
        for (int i = threadIdx.x; i < k; i += blockDim.x)
            xs[i] = (xs[i] - mean) * rstd * load1(ln_w + i) + load1(ln_b + i);
    }
    __syncthreads();
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int row0 = (blockIdx.x * MV_WARPS + warp) * MV_ROWS_PER_WARP;
    float acc[MV_ROWS_PER_WARP];
#pragma unroll
    for (int r = 0; r < MV_ROWS_PER_WARP; r++) acc[r] = 0.0f;
    // k is a multiple of 8 for every GPT-2 shape (checked on the host).
    for (int i = lane * 8; i < k; i += 32 * 8) {
        float xv[8];
#pragma unroll
        for (int j = 0; j < 8; j++) xv[j] = xs[i + j];
#pragma unroll
        for (int r = 0; r < MV_ROWS_PER_WARP; r++) {
            int row = row0 + r;
            if (row < n) {
                float wv[8];
                load8(w + (size_t)row * k + i, wv);
#pragma unroll
                for (int j = 0; j < 8; j++) acc[r] += wv[j] * xv[j];
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
