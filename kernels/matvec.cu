// Batch-1 matrix-vector products for decode: y = W x + b with W [n, k] row-major, x [k].
// Memory-bound: each warp streams whole weight rows with 16-byte loads, two rows in flight;
// x sits in shared memory. Optional fused LayerNorm of x in the prologue (every block
// normalises the k-vector itself: k <= 4 * 1600 floats, cheap next to the weights) and a
// fused epilogue (bias, GELU, residual add, or the QKV scatter into the KV cache).
#include "common.cuh"

// MV_WARPS and MV_ROWS_PER_WARP are defined by the host (host/src/cuda/ops/matvec.rs) and handed
// to NVRTC as -D defines.

// With `best` (the LM head), also the argmax of the outputs: each block folds its rows into one
// key (order-preserving bits of the value above the complement of the row, so the largest
// value wins and, among equal values, the first row; NaN never wins) and raises *best to it
// with atomicMax. *best must be 0 before the launch (the step's embedding kernel clears it);
// the host reads the row back from the key (see `argmax_row`).
__device__ __forceinline__ unsigned long long argmax_key(float v, int row) {
    if (v != v) return 0ull;
    u32 u = __float_as_uint(v);
    u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
    return ((unsigned long long)u << 32) | (0xffffffffu - (u32)row);
}

// With `pf`, the grid first asks L2 for `pf_bytes` from there (the next kernel's weights, which
// do not depend on anything this step computes): they stream in while this kernel runs, and
// the next one finds them in L2.
template <typename W>
__device__ void matvec_impl(float* out, const float* x, const W* w, const W* bias, int n, int k,
                            const W* ln_w, const W* ln_b, int mode, int c, const int* pos_ptr,
                            void* k_cache_p, void* v_cache_p, unsigned long long* best, const void* pf,
                            long long pf_bytes) {
    typedef typename KvOf<W>::T KV;
    KV* k_cache = static_cast<KV*>(k_cache_p);
    KV* v_cache = static_cast<KV*>(v_cache_p);
    extern __shared__ __align__(16) float xs[];
    __shared__ float scratch[32];
    __shared__ unsigned long long block_best[MV_WARPS];
    pdl_launch_dependents();
    grid_prefetch_l2(pf, pf_bytes);
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
    // x: k <= 128 * 4 * 16 = 8192 (checked on the host); LayerNorm: k <= 2048. The weights'
    // first loads go out as soon as the previous kernel is done, beside x's (not before the
    // wait: blocks waiting early would hold SM slots the previous kernel's blocks need).
    RowLoads<MV_ROWS_PER_WARP, W> first;
    stage_x<16, 4>(xs, x, k, ln_w, ln_b, scratch, [&] { first.load(rows, lane * 8, k); });
    dot_rows_from<MV_ROWS_PER_WARP>(acc, first, rows, xs, k, lane);
    int pos = pos_ptr != nullptr ? *pos_ptr : 0;
    unsigned long long key = 0ull;
#pragma unroll
    for (int r = 0; r < MV_ROWS_PER_WARP; r++) {
        float v = warp_sum(acc[r]);
        int row = row0 + r;
        if (lane == 0 && row < n) {
            if (bias != nullptr) v += load1(bias + row);
            epilogue(mode, v, out, row, c, pos, k_cache, v_cache);
            key = max(key, argmax_key(v, row));
        }
    }
    if (best == nullptr) return;
    if (lane == 0) block_best[warp] = key;
    __syncthreads();
    if (threadIdx.x == 0) {
#pragma unroll
        for (int i = 1; i < MV_WARPS; i++) key = max(key, block_best[i]);
        // most blocks see a larger key already there and skip the atomic
        if (key > *reinterpret_cast<volatile unsigned long long*>(best)) atomicMax(best, key);
    }
}

#define MATVEC(NAME, W)                                                                                 \
    extern "C" __global__ void __launch_bounds__(MV_WARPS * 32)                                         \
        NAME(float* out, const float* x, const W* w, const W* bias, int n, int k, const W* ln_w,        \
             const W* ln_b, int mode, int c, const int* pos_ptr, void* k_cache, void* v_cache,          \
             unsigned long long* best, const void* pf, long long pf_bytes) {                            \
        matvec_impl(out, x, w, bias, n, k, ln_w, ln_b, mode, c, pos_ptr, k_cache, v_cache, best, pf,    \
                    pf_bytes);                                                                         \
    }
MATVEC(matvec_f32, float)
MATVEC(matvec_bf16, bf16_t)

