// Matrix-matrix products for prefill: Y[t, :] = W X[t, :] + b for T rows at once, W [n, k].
// A plain shared-memory tiled kernel (64x64 tile, 4x4 outputs per thread, f32 math), with the
// same epilogues as the matrix-vector kernels; row t sits at absolute position start + t.
#include "common.cuh"

// TILE is defined by the host (host/src/cuda/ops/matmul.rs) and handed to NVRTC as -D TILE.
#define TK 16

template <typename W>
__device__ void matmul_impl(float* out, const float* x, const W* w, const W* bias, int rows, int n, int k,
                            int mode, int c, int start, void* k_cache_p, void* v_cache_p, int out_stride) {
    typedef typename KvOf<W>::T KV;
    KV* k_cache = static_cast<KV*>(k_cache_p);
    KV* v_cache = static_cast<KV*>(v_cache_p);
    __shared__ float xs[TK][TILE + 1];
    __shared__ float ws[TK][TILE + 1];
    pdl_launch_dependents();
    pdl_wait();
    int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
    int row_base = blockIdx.y * TILE, col_base = blockIdx.x * TILE;
    float acc[4][4] = {};
    for (int k0 = 0; k0 < k; k0 += TK) {
        for (int i = threadIdx.x; i < TILE * TK; i += 256) {
            int r = i / TK, kk = i % TK;
            int gr = row_base + r, gc = col_base + r, gk = k0 + kk;
            xs[kk][r] = (gr < rows && gk < k) ? x[(size_t)gr * k + gk] : 0.0f;
            ws[kk][r] = (gc < n && gk < k) ? load1(w + (size_t)gc * k + gk) : 0.0f;
        }
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < TK; kk++) {
            float a[4], b[4];
#pragma unroll
            for (int i = 0; i < 4; i++) { a[i] = xs[kk][ty * 4 + i]; b[i] = ws[kk][tx * 4 + i]; }
#pragma unroll
            for (int i = 0; i < 4; i++)
#pragma unroll
                for (int j = 0; j < 4; j++) acc[i][j] += a[i] * b[j];
        }
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < 4; i++) {
        int r = row_base + ty * 4 + i;
        if (r >= rows) continue;
#pragma unroll
        for (int j = 0; j < 4; j++) {
            int col = col_base + tx * 4 + j;
            if (col >= n) continue;
            float v = acc[i][j] + (bias != nullptr ? load1(bias + col) : 0.0f);
            epilogue(mode, v, out + (size_t)r * out_stride, col, c, start + r, k_cache, v_cache);
        }
    }
}

#define MATMUL(NAME, W)                                                                                \
    extern "C" __global__ void __launch_bounds__(256)                                                  \
        NAME(float* out, const float* x, const W* w, const W* bias, int rows, int n, int k, int mode,  \
             int c, int start, void* k_cache, void* v_cache, int out_stride) {                         \
        matmul_impl(out, x, w, bias, rows, n, k, mode, c, start, k_cache, v_cache, out_stride);        \
    }
MATMUL(matmul_f32, float)
MATMUL(matmul_bf16, bf16_t)

// After a library GEMM wrote tmp[r, :] = W x_r (f32), apply bias and the epilogue. With
// `out_bf16` (EPI_STORE and EPI_GELU only) the result is stored as bf16: the next GEMM's input.
// Grid (column groups, rows): four columns per thread when n and out_stride allow it.
template <typename W>
__device__ void gemm_epilogue_impl(void* out_ptr, const float* tmp, const W* bias, int rows, int n, int mode,
                                   int c, int start, void* k_cache_p, void* v_cache_p, int out_stride,
                                   int out_bf16) {
    typedef typename KvOf<W>::T KV;
    KV* k_cache = static_cast<KV*>(k_cache_p);
    KV* v_cache = static_cast<KV*>(v_cache_p);
    pdl_launch_dependents();
    pdl_wait();
    int vec = (n % 4 == 0 && out_stride % 4 == 0 && c % 4 == 0) ? 4 : 1;
    int r = blockIdx.y;
    for (int col = (blockIdx.x * blockDim.x + threadIdx.x) * vec; col < n; col += gridDim.x * blockDim.x * vec) {
        float v[4];
        if (vec == 4) {
            float4 q = *reinterpret_cast<const float4*>(tmp + (size_t)r * n + col);
            v[0] = q.x; v[1] = q.y; v[2] = q.z; v[3] = q.w;
        } else {
            v[0] = tmp[(size_t)r * n + col];
        }
        for (int e = 0; e < vec; e++) {
            if (bias != nullptr) v[e] += load1(bias + col + e);
            if (mode == EPI_GELU) v[e] = gelu_tanh(v[e]);
        }
        if (out_bf16) {
            bf16_t* o = static_cast<bf16_t*>(out_ptr) + (size_t)r * out_stride + col;
            if (vec == 4) {
                u32 lo = (u32)f32_to_bf16_bits(v[0]) | ((u32)f32_to_bf16_bits(v[1]) << 16);
                u32 hi = (u32)f32_to_bf16_bits(v[2]) | ((u32)f32_to_bf16_bits(v[3]) << 16);
                *reinterpret_cast<uint2*>(o) = make_uint2(lo, hi);
            } else {
                o[0] = f32_to_bf16_bits(v[0]);
            }
            continue;
        }
        // for EPI_QKV, the key or value cache row at the position (f32 or fp16)
        if (mode == EPI_QKV && col >= c) {
            KV* cache = (col < 2 * c ? k_cache : v_cache) + (size_t)(start + r) * c + (col < 2 * c ? col - c : col - 2 * c);
            if (vec == 4) kv_put4(cache, make_float4(v[0], v[1], v[2], v[3]));
            else kv_put(cache, v[0]);
            continue;
        }
        // f32: a row of out
        float* o = static_cast<float*>(out_ptr) + (size_t)r * out_stride + col;
        if (mode == EPI_RESIDUAL) {
            for (int e = 0; e < vec; e++) v[e] += o[e];
        }
        if (vec == 4) *reinterpret_cast<float4*>(o) = make_float4(v[0], v[1], v[2], v[3]);
        else o[0] = v[0];
    }
}
extern "C" __global__ void gemm_epilogue_f32(void* out, const float* tmp, const float* bias, int rows, int n,
                                             int mode, int c, int start, void* k_cache, void* v_cache,
                                             int out_stride, int out_bf16) {
    gemm_epilogue_impl(out, tmp, bias, rows, n, mode, c, start, k_cache, v_cache, out_stride, out_bf16);
}
extern "C" __global__ void gemm_epilogue_bf16(void* out, const float* tmp, const bf16_t* bias, int rows, int n,
                                              int mode, int c, int start, void* k_cache, void* v_cache,
                                              int out_stride, int out_bf16) {
    gemm_epilogue_impl(out, tmp, bias, rows, n, mode, c, start, k_cache, v_cache, out_stride, out_bf16);
}
// f32 -> bf16 (round to nearest even), for tensor-core GEMM inputs.
extern "C" __global__ void f32_to_bf16(bf16_t* out, const float* in, int n) {
    pdl_launch_dependents();
    pdl_wait();
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
        out[i] = f32_to_bf16_bits(in[i]);
}
