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
    extern __shared__ __align__(16) float xs[];
    __shared__ float scratch[32];
    pdl_launch_dependents();
    // x: k <= 128 * 4 * 16 = 8192 (checked on the host); LayerNorm: k <= 2048
    stage_x<16, 4>(xs, x, k, ln_w, ln_b, scratch);
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
    dot_rows<MV_ROWS_PER_WARP>(acc, rows, xs, k, lane);
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
