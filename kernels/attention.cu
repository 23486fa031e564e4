// Causal attention over the KV cache (f32, [n_ctx, C] per layer, head h at columns h*hd..).
//
// Decode (one query) is split across blocks (flash-decoding): block (h, chunk) scores its
// ATT_CHUNK positions, keeps its max, sum of exponentials and weighted sum of values; a second
// kernel combines the chunks. The position comes from device memory so a captured graph
// serves every step; chunks past the sequence write an empty partial.
// Prefill: one block per (head, query row), scores in shared memory.
#include "common.cuh"

#define ATT_CHUNK 32
#define ATT_THREADS 128
#define MAX_HD 128

// Score of one cached position against q (in shared memory): the `parts` threads of a
// position each take hd/parts dimensions, all loads issued before the sums.
__device__ __forceinline__ float partial_dot(const float* kr, const float* qs, int hd, int part, int parts) {
    float acc = 0.0f;
    int span = hd / parts;
#pragma unroll 8
    for (int d = part * span; d < (part + 1) * span; d += 4) {
        float4 kv = *reinterpret_cast<const float4*>(kr + d);
        acc += kv.x * qs[d] + kv.y * qs[d + 1] + kv.z * qs[d + 2] + kv.w * qs[d + 3];
    }
    return acc;
}

// partial layout per (h, chunk): [max, sum, out[hd]]
// Block (h, chunk) of ATT_THREADS threads: 4 threads per position score ATT_CHUNK positions;
// then threads split over (dimension, quarter of the positions) for the weighted values.
extern "C" __global__ void __launch_bounds__(ATT_THREADS)
    attention_decode_partial(float* partial, const float* q, const float* k_cache, const float* v_cache,
                             const int* pos_ptr, int c, int hd, int max_chunks) {
    __shared__ float qs[MAX_HD];
    __shared__ float p[ATT_CHUNK];
    __shared__ float acc_s[4][MAX_HD];
    __shared__ float scratch[32];
    pdl_launch_dependents();
    pdl_wait();
    int h = blockIdx.x, chunk = blockIdx.y;
    int len = *pos_ptr + 1;
    int first = chunk * ATT_CHUNK;
    float* part = partial + ((size_t)h * max_chunks + chunk) * (hd + 2);
    if (first >= len) {
        if (threadIdx.x == 0) { part[0] = -INFINITY; part[1] = 0.0f; }
        return;
    }
    int count = min(ATT_CHUNK, len - first);
    float scale = rsqrtf((float)hd);
    for (int d = threadIdx.x; d < hd; d += blockDim.x) qs[d] = q[h * hd + d];
    __syncthreads();
    int j = threadIdx.x >> 2, quarter = threadIdx.x & 3;
    float s = 0.0f;
    if (j < count) s = partial_dot(k_cache + (size_t)(first + j) * c + h * hd, qs, hd, quarter, 4);
    s += __shfl_xor_sync(0xffffffffu, s, 1);
    s += __shfl_xor_sync(0xffffffffu, s, 2);
    s = j < count ? s * scale : -INFINITY;
    float m = block_max(s, scratch);
    float e = j < count ? __expf(s - m) : 0.0f;
    if (quarter == 0 && j < ATT_CHUNK) p[j] = e;
    float sum = block_sum(quarter == 0 ? e : 0.0f, scratch);
    __syncthreads();
    // weighted values: thread (d, g) sums positions g, g+4, ...
    for (int idx = threadIdx.x; idx < 4 * hd; idx += blockDim.x) {
        int d = idx % hd, g = idx / hd;
        float acc = 0.0f;
#pragma unroll 8
        for (int jj = g; jj < count; jj += 4) acc += p[jj] * v_cache[(size_t)(first + jj) * c + h * hd + d];
        acc_s[g][d] = acc;
    }
    __syncthreads();
    for (int d = threadIdx.x; d < hd; d += blockDim.x)
        part[2 + d] = acc_s[0][d] + acc_s[1][d] + acc_s[2][d] + acc_s[3][d];
    if (threadIdx.x == 0) { part[0] = m; part[1] = sum; }
}

// One block per head: rescale each chunk by exp(m_chunk - M) and normalise.
extern "C" __global__ void __launch_bounds__(ATT_THREADS)
    attention_decode_combine(float* out, const float* partial, const int* pos_ptr, int hd, int max_chunks) {
    extern __shared__ float weights[];  // [max_chunks]
    __shared__ float scratch[32];
    pdl_launch_dependents();
    pdl_wait();
    int h = blockIdx.x;
    int chunks = (*pos_ptr + 1 + ATT_CHUNK - 1) / ATT_CHUNK;
    const float* base = partial + (size_t)h * max_chunks * (hd + 2);
    float m = -INFINITY;
    for (int i = threadIdx.x; i < chunks; i += blockDim.x) m = fmaxf(m, base[(size_t)i * (hd + 2)]);
    m = block_max(m, scratch);
    float denom = 0.0f;
    for (int i = threadIdx.x; i < chunks; i += blockDim.x) {
        float w = __expf(base[(size_t)i * (hd + 2)] - m);
        weights[i] = w;
        denom += w * base[(size_t)i * (hd + 2) + 1];
    }
    denom = block_sum(denom, scratch);
    __syncthreads();
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        float acc = 0.0f;
#pragma unroll 8
        for (int i = 0; i < chunks; i++) acc += base[(size_t)i * (hd + 2) + 2 + d] * weights[i];
        out[h * hd + d] = acc / denom;
    }
}

// Prefill: q rows in qkv [rows, 3C] (q = first C columns), row t at position start + t.
// Grid (n_head, rows), ATT_THREADS threads; dynamic shared memory holds start + rows scores.
extern "C" __global__ void __launch_bounds__(ATT_THREADS)
    attention_prefill(float* out, const float* qkv, const float* k_cache, const float* v_cache, int start, int c,
                      int hd) {
    extern __shared__ float scores[];
    __shared__ float qs[MAX_HD];
    __shared__ float acc_s[4][MAX_HD];
    __shared__ float scratch[32];
    pdl_launch_dependents();
    pdl_wait();
    int h = blockIdx.x, t = blockIdx.y;
    int len = start + t + 1;
    float scale = rsqrtf((float)hd);
    for (int d = threadIdx.x; d < hd; d += blockDim.x) qs[d] = qkv[(size_t)t * 3 * c + h * hd + d];
    __syncthreads();
    // 4 threads per position, blockDim/4 positions per round
    float m = -INFINITY;
    int quarter = threadIdx.x & 3;
    for (int j0 = 0; j0 < len; j0 += blockDim.x / 4) {
        int j = j0 + (threadIdx.x >> 2);
        float s = 0.0f;
        if (j < len) s = partial_dot(k_cache + (size_t)j * c + h * hd, qs, hd, quarter, 4);
        s += __shfl_xor_sync(0xffffffffu, s, 1);
        s += __shfl_xor_sync(0xffffffffu, s, 2);
        if (j < len) {
            if (quarter == 0) scores[j] = s * scale;
            m = fmaxf(m, s * scale);
        }
    }
    m = block_max(m, scratch);
    float sum = 0.0f;
    for (int j = threadIdx.x; j < len; j += blockDim.x) {
        float e = __expf(scores[j] - m);
        scores[j] = e;
        sum += e;
    }
    sum = block_sum(sum, scratch);
    __syncthreads();
    for (int idx = threadIdx.x; idx < 4 * hd; idx += blockDim.x) {
        int d = idx % hd, g = idx / hd;
        float acc = 0.0f;
#pragma unroll 8
        for (int j = g; j < len; j += 4) acc += scores[j] * v_cache[(size_t)j * c + h * hd + d];
        acc_s[g][d] = acc;
    }
    __syncthreads();
    for (int d = threadIdx.x; d < hd; d += blockDim.x)
        out[(size_t)t * c + h * hd + d] = (acc_s[0][d] + acc_s[1][d] + acc_s[2][d] + acc_s[3][d]) / sum;
}

// Prefill, tiled (flash-attention style, CUDA cores): block (h, q-tile) of 128 threads holds
// 32 queries; key/value tiles of 32 positions pass through shared memory once per q-tile, with
// an online softmax. Thread t owns query t/4 and, of each key tile, keys (t%4) + 4m for scores
// and the contiguous dimensions (t%4) * hd/4 .. for the output; shared memory is read 16 bytes
// at a time. Needs hd <= 64 and hd % 16 == 0.
#define FA_Q 32
#define FA_K 32
#define FA_HD 64
extern "C" __global__ void __launch_bounds__(128)
    attention_prefill_tiled(float* out, const float* qkv, const float* k_cache, const float* v_cache, int start,
                            int rows, int c, int hd) {
    __shared__ __align__(16) float qs[FA_Q][FA_HD + 4];
    __shared__ __align__(16) float ks[FA_K][FA_HD + 4];
    __shared__ __align__(16) float vs[FA_K][FA_HD];
    __shared__ float ps[FA_Q][FA_K + 1];
    pdl_launch_dependents();
    pdl_wait();
    int h = blockIdx.x, q0 = blockIdx.y * FA_Q;
    int tid = threadIdx.x, q = tid >> 2, part = tid & 3;
    float scale = rsqrtf((float)hd);
    int quads = hd / 4;  // float4 per row
    for (int idx = tid; idx < FA_Q * quads; idx += blockDim.x) {
        int r = idx / quads, d = (idx % quads) * 4;
        float4 v = q0 + r < rows ? *reinterpret_cast<const float4*>(qkv + (size_t)(q0 + r) * 3 * c + h * hd + d)
                                 : make_float4(0.f, 0.f, 0.f, 0.f);
        v.x *= scale; v.y *= scale; v.z *= scale; v.w *= scale;
        *reinterpret_cast<float4*>(&qs[r][d]) = v;
    }
    __syncthreads();
    float4 qr[FA_HD / 4];  // this thread's query row
#pragma unroll
    for (int i = 0; i < FA_HD / 4; i++)
        qr[i] = i < quads ? *reinterpret_cast<const float4*>(&qs[q][4 * i]) : make_float4(0.f, 0.f, 0.f, 0.f);
    int qpos = start + q0 + q;
    int dims4 = quads / 4;  // output float4 per thread (hd/16)
    int d0 = part * (hd / 4);
    float4 acc[FA_HD / 16];
#pragma unroll
    for (int i = 0; i < FA_HD / 16; i++) acc[i] = make_float4(0.f, 0.f, 0.f, 0.f);
    float m = -INFINITY, l = 0.0f;
    int keys = min(start + q0 + FA_Q, start + rows);  // keys 0..keys-1 are visible to some query
    for (int k0 = 0; k0 < keys; k0 += FA_K) {
        // Issue every load of the tile before storing any: at most 4 float4 each of K and V.
        float4 kreg[4], vreg[4];
#pragma unroll
        for (int u = 0; u < 4; u++) {
            int idx = u * 128 + tid, r = idx / quads, d = (idx % quads) * 4;
            bool in = idx < FA_K * quads && k0 + r < keys;
            size_t at = (size_t)(k0 + r) * c + h * hd + d;
            kreg[u] = in ? *reinterpret_cast<const float4*>(k_cache + at) : make_float4(0.f, 0.f, 0.f, 0.f);
            vreg[u] = in ? *reinterpret_cast<const float4*>(v_cache + at) : make_float4(0.f, 0.f, 0.f, 0.f);
        }
        __syncthreads();
#pragma unroll
        for (int u = 0; u < 4; u++) {
            int idx = u * 128 + tid, r = idx / quads, d = (idx % quads) * 4;
            if (idx < FA_K * quads) {
                *reinterpret_cast<float4*>(&ks[r][d]) = kreg[u];
                *reinterpret_cast<float4*>(&vs[r][d]) = vreg[u];
            }
        }
        __syncthreads();
        float s[FA_K / 4];
        float tile_max = -INFINITY;
#pragma unroll
        for (int mm = 0; mm < FA_K / 4; mm++) {
            int j = part + 4 * mm;
            float dot = 0.0f;
#pragma unroll
            for (int i = 0; i < FA_HD / 4; i++) {
                if (i < quads) {
                    float4 kv = *reinterpret_cast<const float4*>(&ks[j][4 * i]);
                    dot += qr[i].x * kv.x + qr[i].y * kv.y + qr[i].z * kv.z + qr[i].w * kv.w;
                }
            }
            s[mm] = (k0 + j <= qpos && k0 + j < keys) ? dot : -INFINITY;
            tile_max = fmaxf(tile_max, s[mm]);
        }
        tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
        tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 2));
        float m_new = fmaxf(m, tile_max);
        float corr = m_new == -INFINITY ? 1.0f : __expf(m - m_new);
        float psum = 0.0f;
#pragma unroll
        for (int mm = 0; mm < FA_K / 4; mm++) {
            float p = s[mm] == -INFINITY ? 0.0f : __expf(s[mm] - m_new);
            ps[q][part + 4 * mm] = p;
            psum += p;
        }
        psum += __shfl_xor_sync(0xffffffffu, psum, 1);
        psum += __shfl_xor_sync(0xffffffffu, psum, 2);
        l = l * corr + psum;
        m = m_new;
        __syncwarp();
#pragma unroll
        for (int i = 0; i < FA_HD / 16; i++) {
            acc[i].x *= corr; acc[i].y *= corr; acc[i].z *= corr; acc[i].w *= corr;
        }
#pragma unroll 4
        for (int j = 0; j < FA_K; j++) {
            float p = ps[q][j];
#pragma unroll
            for (int i = 0; i < FA_HD / 16; i++) {
                if (i < dims4) {
                    float4 vv = *reinterpret_cast<const float4*>(&vs[j][d0 + 4 * i]);
                    acc[i].x += p * vv.x; acc[i].y += p * vv.y; acc[i].z += p * vv.z; acc[i].w += p * vv.w;
                }
            }
        }
    }
    if (q0 + q < rows) {
        float inv = 1.0f / l;
#pragma unroll
        for (int i = 0; i < FA_HD / 16; i++) {
            if (i < dims4) {
                float4 o = make_float4(acc[i].x * inv, acc[i].y * inv, acc[i].z * inv, acc[i].w * inv);
                *reinterpret_cast<float4*>(out + (size_t)(q0 + q) * c + h * hd + d0 + 4 * i) = o;
            }
        }
    }
}
