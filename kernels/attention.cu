// Causal attention over the KV cache ([n_ctx, C] per layer, head h at columns h*hd..; f32, or fp16
// with bf16 weights: `KvOf` in common.cuh; kernels without weights come as `_f32` and `_bf16`).
//
// Decode (one query) is split across blocks (flash-decoding): block (h, chunk) scores its
// ATT_CHUNK positions, keeps its max, sum of exponentials and weighted sum of values; a second
// kernel combines the chunks. The position comes from device memory so a captured graph
// serves every step; chunks past the sequence write an empty partial.
// Prefill: one block per (head, query row), scores in shared memory.
#include "common.cuh"

// ATT_CHUNK, ATT_THREADS, DA_MAX_CLUSTER, DA_THREADS, FA_Q, TC_Q, TC_THREADS and FA_SMEM are defined
// once by the host (host/src/cuda/ops/attention.rs) and handed to NVRTC as -D defines.

// scores[0..count) (shared memory) -> exp(score - m) in place; returns their sum over the block.
__device__ __forceinline__ float exp_in_place(float* scores, int count, float m, float* scratch) {
    float sum = 0.0f;
    for (int j = threadIdx.x; j < count; j += blockDim.x) {
        float e = __expf(scores[j] - m);
        scores[j] = e;
        sum += e;
    }
    return block_sum(sum, scratch);
}
#define MAX_HD 128

// Score of one cached position against q (in shared memory): the `parts` threads of a
// position each take hd/parts dimensions. Where hd is a multiple of 8 * parts, in `key_group`'s
// groups (a contiguous share each had every load instruction ask for part of each sector);
// otherwise hd/parts contiguous ones.
template <typename KV>
__device__ __forceinline__ float partial_dot(const KV* kr, const float* qs, int hd, int part, int parts) {
    float acc = 0.0f;
    if (hd == 64 && parts == 4) {
        // GPT-2's heads, two groups a thread: both loads before their sums (a loop over them
        // spilled in the plain prefill under CUDA 13's ptxas)
        int a = key_group(part, parts, 0), b = key_group(part, parts, 1);
        float k[8], l[8];
        kv_get8(kr + a, k);
        kv_get8(kr + b, l);
        acc = key_dot4(acc, make_float4(k[0], k[1], k[2], k[3]), qs + a);
        acc = key_dot4(acc, make_float4(k[4], k[5], k[6], k[7]), qs + a + 4);
        acc = key_dot4(acc, make_float4(l[0], l[1], l[2], l[3]), qs + b);
        return key_dot4(acc, make_float4(l[4], l[5], l[6], l[7]), qs + b + 4);
    }
    if (hd % (8 * parts) == 0) {
#pragma unroll 1
        for (int d = key_group(part, parts, 0); d < hd; d += key_group(0, parts, 1)) {
            float k[8];
            kv_get8(kr + d, k);
            acc = key_dot4(acc, make_float4(k[0], k[1], k[2], k[3]), qs + d);
            acc = key_dot4(acc, make_float4(k[4], k[5], k[6], k[7]), qs + d + 4);
        }
        return acc;
    }
    int span = hd / parts;
#pragma unroll 8
    for (int d = part * span; d < (part + 1) * span; d += 4) {
        acc = key_dot4(acc, kv_get4(kr + d), qs + d);
    }
    return acc;
}

// partial layout per (h, chunk): [max, sum, out[hd]]
// Block (h, chunk) of ATT_THREADS threads: 4 threads per position score ATT_CHUNK positions;
// then threads split over (dimension, quarter of the positions) for the weighted values.
template <typename KV>
__device__ void attention_decode_partial_impl(float* partial, const float* q, const KV* k_cache, const KV* v_cache,
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
        for (int jj = g; jj < count; jj += 4) acc += p[jj] * kv_get(v_cache + (size_t)(first + jj) * c + h * hd + d);
        acc_s[g][d] = acc;
    }
    __syncthreads();
    for (int d = threadIdx.x; d < hd; d += blockDim.x)
        part[2 + d] = acc_s[0][d] + acc_s[1][d] + acc_s[2][d] + acc_s[3][d];
    if (threadIdx.x == 0) { part[0] = m; part[1] = sum; }
}
#define ATTENTION_DECODE_PARTIAL(NAME, KV)                                                                  \
    extern "C" __global__ void __launch_bounds__(ATT_THREADS)                                               \
        NAME(float* partial, const float* q, const void* k_cache, const void* v_cache, const int* pos_ptr,  \
             int c, int hd, int max_chunks) {                                                              \
        attention_decode_partial_impl(partial, q, static_cast<const KV*>(k_cache),                         \
                                      static_cast<const KV*>(v_cache), pos_ptr, c, hd, max_chunks);        \
    }
ATTENTION_DECODE_PARTIAL(attention_decode_partial_f32, float)
ATTENTION_DECODE_PARTIAL(attention_decode_partial_bf16, kv16_t)

// One block per head: rescale each chunk by exp(m_chunk - M) and normalise.
extern "C" __global__ void __launch_bounds__(ATT_THREADS)
    attention_decode_combine(float* out, const float* partial, const int* pos_ptr, int hd, int max_chunks) {
    extern __shared__ float weights[];  // [max_chunks, padded to a multiple of 8]
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

// Decode with one kernel per layer for QKV and attention (sm_90+): one thread-block cluster
// of n = 2..DA_MAX_CLUSTER blocks per head (grid (n, n_head), up to DA_THREADS threads). Each block LayerNorms x, computes its share of the head's
// 3 * hd QKV rows (bias added) and stores them into every block's shared memory; the new key
// and value also go to the cache at `pos`. After a cluster barrier each block scores its share
// of the positions 0..pos (position `pos` from shared memory), and after a second barrier the
// blocks combine the shares through distributed shared memory, each writing hd / n
// dimensions of the head's output. Dynamic shared memory: c + ceil(capacity / n) floats.
// A warp's QKV rows go DA_ROWS at a time, DA_UNROLL 16-byte loads of each in flight (3: all of
// 124M's 768 at once, and two blocks an SM fit in 128 registers without spilling; the sums
// are in the same order for any unroll).
#define DA_ROWS 3
#define DA_UNROLL 3

template <typename W>
__device__ void decode_qkv_attention_impl(float* out, const float* x, const W* w, const W* bias, const W* ln_w,
                                          const W* ln_b, void* k_cache_p, void* v_cache_p, const int* pos_ptr,
                                          int c, int hd, const void* pf, long long pf_bytes) {
    typedef typename KvOf<W>::T KV;
    KV* k_cache = static_cast<KV*>(k_cache_p);
    KV* v_cache = static_cast<KV*>(v_cache_p);
    extern __shared__ __align__(16) float dyn[];
    __shared__ __align__(16) float qkv_s[3 * MAX_HD];
    __shared__ float part_s[MAX_HD + 2];  // this block's (max, sum of exponentials, weighted values)
    __shared__ __align__(16) float acc_s[4 * DA_THREADS];  // [groups][hd], groups = DA_THREADS / (hd / 4)
    __shared__ float scratch[32];
    pdl_launch_dependents();
    // the next kernel's weights into L2 while this one runs (see matvec.cu)
    grid_prefetch_l2(pf, pf_bytes);
    // every block of the cluster must have started before any writes into a peer's qkv_s
    cluster_arrive_relaxed();
    float* xs = dyn;
    float* scores = dyn + c;
    u32 rank = cluster_rank();
    int n = (int)cluster_blocks(), h = blockIdx.y;
    // this block's rows of the head's q | k | v (local row r -> output row (r / hd) * c + h * hd + r % hd)
    int rows = 3 * hd, per = (rows + n - 1) / n;
    int r0 = rank * per, r1 = min(rows, r0 + per);
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    // the weight rows of a warp's group of DA_ROWS from local row g (rows past r1 repeat the
    // last one and are not stored)
    const W* wr[DA_ROWS];
    int orow[DA_ROWS];
    auto group_rows = [&](int g) {
#pragma unroll
        for (int r = 0; r < DA_ROWS; r++) {
            int lr = min(g + r, r1 - 1);
            orow[r] = (lr / hd) * c + h * hd + lr % hd;
            wr[r] = w + (size_t)orow[r] * c;
        }
    };
    int g0 = r0 + warp * DA_ROWS;
    group_rows(g0);
    // the first group's weights load while x is normalised (after the wait, see matvec.cu)
    RowLoads<DA_ROWS, W, DA_UNROLL> first_rows;
    stage_x<4, 4>(xs, x, c, ln_w, ln_b, scratch, [&] {
        if (g0 < r1) first_rows.load(wr, lane * 8, c);
    });  // c <= 2048 with 128 threads
    int pos = *pos_ptr;

    // this block's share of the positions; their cached keys and values (all but pos, which
    // this kernel writes) are asked of L2 now, so that they are there once the QKV rows are
    int len = pos + 1, span = (len + n - 1) / n;
    int first = rank * span, count = max(0, min(len, first + span) - first);
    {
        int lines = (hd * (int)sizeof(KV) + 127) / 128, per_cache = count * lines;
        for (int i = threadIdx.x; i < 2 * per_cache; i += blockDim.x) {
            int j = (i % per_cache) / lines, p = first + j;
            const KV* row = (i < per_cache ? k_cache : v_cache) + (size_t)p * c + h * hd;
            if (p != pos) prefetch_l2(reinterpret_cast<const char*>(row) + (i % lines) * 128, 1, 0, 1);
        }
    }
    cluster_wait();
    // the group's rows: bias, the new key and value into the cache (as the cache keeps them,
    // as every other kernel reads them), and q | k | v into every block's shared memory
    auto store_group = [&](int g, const float acc[DA_ROWS]) {
#pragma unroll
        for (int r = 0; r < DA_ROWS; r++) {
            float v = warp_sum(acc[r]) + load1(bias + orow[r]);
            int lr = g + r;
            if (lr < r1) {
                if (lr >= hd) v = kv_kept(k_cache, v);
                if (lane < n) peer_store(peer_addr(qkv_s + lr, lane), v);
                if (lane == 0 && lr >= hd) {
                    KV* cache = lr < 2 * hd ? k_cache : v_cache;
                    kv_put(cache + (size_t)pos * c + h * hd + lr % hd, v);
                }
            }
        }
    };
    if (g0 < r1) {
        float acc[DA_ROWS] = {};
        dot_rows_from<DA_ROWS>(acc, first_rows, wr, xs, c, lane);
        store_group(g0, acc);
    }
    for (int g = g0 + warps * DA_ROWS; g < r1; g += warps * DA_ROWS) {
        float acc[DA_ROWS] = {};
        group_rows(g);
        RowLoads<DA_ROWS, W, DA_UNROLL> loads;
        loads.load(wr, lane * 8, c);
        dot_rows_from<DA_ROWS>(acc, loads, wr, xs, c, lane);
        store_group(g, acc);
    }
    cluster_sync();

    // scores of this block's positions [first, first + count), 4 threads per position
    float scale = rsqrtf((float)hd);
    float m = -INFINITY;
    int quarter = threadIdx.x & 3;
    for (int j0 = 0; j0 < count; j0 += blockDim.x / 4) {
        int j = j0 + (threadIdx.x >> 2);
        float s = 0.0f;
        if (j < count) {
            int p = first + j;
            s = p == pos ? partial_dot(qkv_s + hd, qkv_s, hd, quarter, 4)
                         : partial_dot(k_cache + (size_t)p * c + h * hd, qkv_s, hd, quarter, 4);
        }
        s += __shfl_xor_sync(0xffffffffu, s, 1);
        s += __shfl_xor_sync(0xffffffffu, s, 2);
        if (j < count) {
            s *= scale;
            if (quarter == 0) scores[j] = s;
            m = fmaxf(m, s);
        }
    }
    m = block_max(m, scratch);
    float sum = exp_in_place(scores, count, m, scratch);
    // weighted values: thread (d4, g) takes dimensions 4*d4.. of positions g, g + groups, ...
    int quads = hd / 4, groups = blockDim.x / quads;
    int d4 = threadIdx.x % quads, grp = threadIdx.x / quads;
    float4 a = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (grp < groups) {
#pragma unroll 4
        for (int j = grp; j < count; j += groups) {
            int p = first + j;
            float4 vv = p == pos ? *reinterpret_cast<const float4*>(qkv_s + 2 * hd + 4 * d4)
                                 : kv_get4(v_cache + (size_t)p * c + h * hd + 4 * d4);
            float pj = scores[j];
            a.x += pj * vv.x; a.y += pj * vv.y; a.z += pj * vv.z; a.w += pj * vv.w;
        }
        *reinterpret_cast<float4*>(acc_s + grp * hd + 4 * d4) = a;
    }
    __syncthreads();
    if (threadIdx.x < hd) {
        float t = 0.0f;
        for (int g = 0; g < groups; g++) t += acc_s[g * hd + threadIdx.x];
        part_s[2 + threadIdx.x] = t;
    }
    if (threadIdx.x == 0) { part_s[0] = m; part_s[1] = sum; }
    cluster_sync();

    // combine the blocks' shares: this block writes dimensions d with d % n == rank
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        if (d % n != (int)rank) continue;
        float ms[DA_MAX_CLUSTER], ss[DA_MAX_CLUSTER], vs[DA_MAX_CLUSTER];
#pragma unroll
        for (int i = 0; i < DA_MAX_CLUSTER; i++) {
            ms[i] = i < n ? peer_load(peer_addr(part_s, i)) : -INFINITY;
            ss[i] = i < n ? peer_load(peer_addr(part_s + 1, i)) : 0.0f;
            vs[i] = i < n ? peer_load(peer_addr(part_s + 2 + d, i)) : 0.0f;
        }
        float mx = -INFINITY;
#pragma unroll
        for (int i = 0; i < DA_MAX_CLUSTER; i++) mx = fmaxf(mx, ms[i]);
        float num = 0.0f, den = 0.0f;
#pragma unroll
        for (int i = 0; i < DA_MAX_CLUSTER; i++) {
            float f = __expf(ms[i] - mx);  // 0 for a block without positions (and past n)
            num += f * vs[i];
            den += f * ss[i];
        }
        out[h * hd + d] = num / den;
    }
    // no block leaves while a peer may still read its shared memory
    cluster_sync();
}

#define DECODE_QKV_ATTENTION(NAME, W, MIN_BLOCKS)                                                          \
    extern "C" __global__ void __launch_bounds__(DA_THREADS, MIN_BLOCKS)                                  \
        NAME(float* out, const float* x, const W* w, const W* bias, const W* ln_w, const W* ln_b,          \
             void* k_cache, void* v_cache, const int* pos_ptr, int c, int hd, const void* pf,              \
             long long pf_bytes) {                                                                         \
        decode_qkv_attention_impl(out, x, w, bias, ln_w, ln_b, k_cache, v_cache, pos_ptr, c, hd, pf,       \
                                  pf_bytes);                                                               \
    }
// bf16: two blocks an SM (<= 128 registers), so the 200 blocks of 1558M's 25 heads run in one wave
DECODE_QKV_ATTENTION(decode_qkv_attention_f32, float, 1)
DECODE_QKV_ATTENTION(decode_qkv_attention_bf16, bf16_t, 2)

// Prefill: q rows in qkv [rows, 3C] (q = first C columns), row t at position start + t.
// Grid (n_head, rows), ATT_THREADS threads; dynamic shared memory holds start + rows scores.
template <typename KV>
__device__ void attention_prefill_impl(float* out, const float* qkv, const KV* k_cache, const KV* v_cache, int start,
                                       int c, int hd) {
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
    float sum = exp_in_place(scores, len, m, scratch);
    __syncthreads();
    for (int idx = threadIdx.x; idx < 4 * hd; idx += blockDim.x) {
        int d = idx % hd, g = idx / hd;
        float acc = 0.0f;
#pragma unroll 8
        for (int j = g; j < len; j += 4) acc += scores[j] * kv_get(v_cache + (size_t)j * c + h * hd + d);
        acc_s[g][d] = acc;
    }
    __syncthreads();
    for (int d = threadIdx.x; d < hd; d += blockDim.x)
        out[(size_t)t * c + h * hd + d] = (acc_s[0][d] + acc_s[1][d] + acc_s[2][d] + acc_s[3][d]) / sum;
}
// (The blocks an SM in the launch bounds only keep CUDA 13's ptxas from holding the kernel to
// 32 registers and spilling.)
#define ATTENTION_PREFILL(NAME, KV)                                                                            \
    extern "C" __global__ void __launch_bounds__(ATT_THREADS, 4)                                               \
        NAME(float* out, const float* qkv, const void* k_cache, const void* v_cache, int start, int c, int hd) { \
        attention_prefill_impl(out, qkv, static_cast<const KV*>(k_cache), static_cast<const KV*>(v_cache), start, \
                               c, hd);                                                                         \
    }
ATTENTION_PREFILL(attention_prefill_f32, float)
ATTENTION_PREFILL(attention_prefill_bf16, kv16_t)

// Prefill, tiled (flash-attention style, CUDA cores): block (h, q-tile) of 128 threads holds
// 32 queries; key/value tiles of 32 positions pass through shared memory once per q-tile, with
// an online softmax. Thread t owns query t/4 and, of each key tile, keys (t%4) + 4m for scores
// and the contiguous dimensions (t%4) * hd/4 .. for the output; shared memory is read 16 bytes
// at a time. Needs hd <= 64 and hd % 16 == 0.
#define FA_K 32
#define FA_HD 64
template <typename KV>
__device__ void attention_prefill_tiled_impl(float* out, const float* qkv, const KV* k_cache, const KV* v_cache,
                                             int start, int rows, int c, int hd) {
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
            kreg[u] = in ? kv_get4(k_cache + at) : make_float4(0.f, 0.f, 0.f, 0.f);
            vreg[u] = in ? kv_get4(v_cache + at) : make_float4(0.f, 0.f, 0.f, 0.f);
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

#define ATTENTION_PREFILL_TILED(NAME, KV)                                                                     \
    extern "C" __global__ void __launch_bounds__(128)                                                          \
        NAME(float* out, const float* qkv, const void* k_cache, const void* v_cache, int start, int rows, int c, \
             int hd) {                                                                                        \
        attention_prefill_tiled_impl(out, qkv, static_cast<const KV*>(k_cache), static_cast<const KV*>(v_cache), \
                                     start, rows, c, hd);                                                     \
    }
ATTENTION_PREFILL_TILED(attention_prefill_tiled_f32, float)
ATTENTION_PREFILL_TILED(attention_prefill_tiled_bf16, kv16_t)

// Prefill on tensor cores (sm_80+, bf16 mode, hd == 64): flash attention with
// mma.sync.m16n8k16 (fp16 inputs, f32 accumulators). Block (h, q-tile) holds 64 queries in
// 8 warps: warp w of group g (w = warp % 4, g = warp / 4) owns query rows 16w..16w+15 and the
// key tiles of 64 positions with tile index % 2 == g, so a long row's keys are shared by two
// warps; the two partial softmaxes are merged at the end. Keys and values are read from the
// fp16 cache into shared memory (the next pair of tiles' loads are in
// flight during this pair's math). Each thread owns rows r and r+8 of its warp's 16 (the mma
// score and output fragments), so the online softmax needs only shuffles within a quad.
// fp16 rather than bf16 keeps 3 more mantissa bits in Q·K^T and P·V (values are clamped to
// the fp16 range: GPT-2's queries, keys and values are far inside it). Q is scaled by 1/8.
// The output is f32, or bf16 when `out_bf16` (the input of the projection GEMM). This one
// reads every key and value from the cache (prompts whose QKV product went through cuBLAS and
// the scatter pass); `attention_prefill_fresh` below reads the prompt's from the QKV rows.
#define TC_K 64
#define TC_HD 64
#define TC_LD (TC_HD + 8)  // shared row stride (144 bytes): 16-byte aligned rows, no bank conflicts
#define TC_LOG2E 1.44269504f  // the fp16 kernel's scores are already scaled by 1/8

__device__ __forceinline__ u32 pack_f16(float lo, float hi) {
    u32 r;
    lo = fminf(fmaxf(lo, -65504.0f), 65504.0f);
    hi = fminf(fmaxf(hi, -65504.0f), 65504.0f);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
#else
    r = 0;
#endif
    return r;
}
__device__ __forceinline__ u32 pack_bf16(float lo, float hi) {
    return (u32)f32_to_bf16_bits(lo) | ((u32)f32_to_bf16_bits(hi) << 16);
}

__device__ __forceinline__ void mma_f16_16816(float d[4], const u32 a[4], u32 b0, u32 b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

// Four 8x8 16-bit matrices from shared memory (lanes 8i..8i+7 give matrix i's rows),
// transposed or not.
__device__ __forceinline__ void ldmatrix_x4_trans(u32 r[4], const void* row) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(row)));
#endif
}
__device__ __forceinline__ void ldmatrix_x4(u32 r[4], const void* row) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(row)));
#endif
}

__device__ __forceinline__ void mma_bf16_16816(float d[4], const u32 a[4], u32 b0, u32 b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}
// Two floats as bf16x2, rounded to nearest even (lo in the low half).
__device__ __forceinline__ u32 pack_bf16_rn(float lo, float hi) {
    u32 r = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
#endif
    return r;
}
__device__ __forceinline__ float fast_exp2(float x) {
    float r;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
    return r;
}
// The mma and the fp16x2 / bf16x2 packing of the tensor-core attentions' operands.
template <bool BF16>
__device__ __forceinline__ void tc_mma(float d[4], const u32 a[4], u32 b0, u32 b1) {
    if (BF16) mma_bf16_16816(d, a, b0, b1);
    else mma_f16_16816(d, a, b0, b1);
}
template <bool BF16>
__device__ __forceinline__ u32 tc_pack(float lo, float hi) {
    return BF16 ? pack_bf16_rn(lo, hi) : pack_f16(lo, hi);
}

// One warp's 16 query rows (fragments `qf`) against the 64 keys kt..kt+63 held in shared
// memory (kt_s, vt_s: [key][dim]): S = Q K^T, masked to key <= qpos and key < keys, the online
// softmax update of (m, l, o), O += P V. Scores times `scale` are in base 2 (m stays unscaled).
template <bool BF16>
__device__ __forceinline__ void tc_tile(float o[8][4], float m[2], float l[2], const u32 qf[4][4],
                                        const unsigned short (*kt_s)[TC_LD], const unsigned short (*vt_s)[TC_LD],
                                        int kt, const int qpos[2], int keys, float scale) {
    int lane = threadIdx.x & 31, t = lane & 3, mi = lane >> 3, mr = lane & 7;
    float s[8][4];
#pragma unroll
    for (int j = 0; j < 8; j++) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
    // S = Q K^T: ldmatrix (not transposed) of K rows gives the B fragments of two key
    // blocks of 8 for one 16-dim step, or one key block for two steps.
#pragma unroll
    for (int kk = 0; kk < 4; kk += 2)
#pragma unroll
        for (int j = 0; j < 8; j++) {
            u32 b[4];
            ldmatrix_x4(b, &kt_s[j * 8 + mr][kk * 16 + mi * 8]);
            tc_mma<BF16>(s[j], qf[kk], b[0], b[1]);
            tc_mma<BF16>(s[j], qf[kk + 1], b[2], b[3]);
        }
#pragma unroll
    for (int rr = 0; rr < 2; rr++) {
        float mx = m[rr];
#pragma unroll
        for (int j = 0; j < 8; j++)
#pragma unroll
            for (int e = 0; e < 2; e++) {
                int key = kt + j * 8 + 2 * t + e;
                float v = (key <= qpos[rr] && key < keys) ? s[j][2 * rr + e] : -INFINITY;
                s[j][2 * rr + e] = v;
                mx = fmaxf(mx, v);
            }
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        // a row may see none of this tile's keys yet (group 1, a prefix before the prompt)
        float base = mx == -INFINITY ? 0.0f : mx * scale;
        float corr = fast_exp2(m[rr] * scale - base);
        m[rr] = mx;
        float sum = 0.0f;
#pragma unroll
        for (int j = 0; j < 8; j++)
#pragma unroll
            for (int e = 0; e < 2; e++) {
                float p = fast_exp2(fmaf(s[j][2 * rr + e], scale, -base));
                s[j][2 * rr + e] = p;
                sum += p;
            }
        l[rr] = l[rr] * corr + sum;
#pragma unroll
        for (int j = 0; j < 8; j++) {
            o[j][2 * rr] *= corr;
            o[j][2 * rr + 1] *= corr;
        }
    }
    u32 pf[4][4];
#pragma unroll
    for (int kk = 0; kk < 4; kk++) {
        pf[kk][0] = tc_pack<BF16>(s[2 * kk][0], s[2 * kk][1]);
        pf[kk][1] = tc_pack<BF16>(s[2 * kk][2], s[2 * kk][3]);
        pf[kk][2] = tc_pack<BF16>(s[2 * kk + 1][0], s[2 * kk + 1][1]);
        pf[kk][3] = tc_pack<BF16>(s[2 * kk + 1][2], s[2 * kk + 1][3]);
    }
#pragma unroll
    for (int kk = 0; kk < 4; kk++)
#pragma unroll
        for (int dp = 0; dp < 4; dp++) {
            u32 b[4];
            ldmatrix_x4_trans(b, &vt_s[kk * 16 + (mi & 1) * 8 + mr][dp * 16 + (mi >> 1) * 8]);
            tc_mma<BF16>(o[2 * dp], pf[kk], b[0], b[1]);
            tc_mma<BF16>(o[2 * dp + 1], pf[kk], b[2], b[3]);
        }
}

// Merge warp group 1's partial softmax into group 0's (same rows, same lane, through `part`:
// 4 * 32 * 36 floats of shared memory no warp still reads), then group 0 writes rows r0 and
// r0 + 8 of head h to `out` (f32, or bf16 when out_bf16). Called by every thread of the block.
__device__ __forceinline__ void tc_merge_store(float o[8][4], float m[2], float l[2], float* part_base, int r0,
                                               int rows, int c, int h, void* out, int out_bf16, float scale) {
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, t = lane & 3, group = warp >> 2;
    __syncthreads();
    float* part = part_base + (size_t)((warp & 3) * 32 + lane) * 36;
    if (group == 1) {
#pragma unroll
        for (int j = 0; j < 8; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) part[j * 4 + e] = o[j][e];
        part[32] = m[0]; part[33] = m[1]; part[34] = l[0]; part[35] = l[1];
    }
    __syncthreads();
    if (group == 1) return;
#pragma unroll
    for (int rr = 0; rr < 2; rr++) {
        float m1 = part[32 + rr], mx = fmaxf(m[rr], m1);
        float c0 = fast_exp2((m[rr] - mx) * scale), c1 = fast_exp2((m1 - mx) * scale);
        float sum = l[rr] * c0 + part[34 + rr] * c1;
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        sum += __shfl_xor_sync(0xffffffffu, sum, 2);
        int row = r0 + rr * 8;
        if (row >= rows) continue;
        float inv = 1.0f / sum;
        size_t at = (size_t)row * c + h * TC_HD + 2 * t;
#pragma unroll
        for (int j = 0; j < 8; j++) {
            float a = (o[j][2 * rr] * c0 + part[j * 4 + 2 * rr] * c1) * inv;
            float b = (o[j][2 * rr + 1] * c0 + part[j * 4 + 2 * rr + 1] * c1) * inv;
            if (out_bf16) *reinterpret_cast<u32*>(static_cast<bf16_t*>(out) + at + j * 8) = pack_bf16(a, b);
            else *reinterpret_cast<float2*>(static_cast<float*>(out) + at + j * 8) = make_float2(a, b);
        }
    }
}

// Rows k0..k0+127 of one head's keys and values from the fp16 cache (zeros past `keys`): 8
// float4 each per thread.
__device__ __forceinline__ void tc_load_tiles(float4 kr[8], float4 vr[8], const kv16_t* k_cache,
                                              const kv16_t* v_cache, int k0, int keys, int c, int h) {
#pragma unroll
    for (int i = 0; i < 8; i++) {
        int idx = i * TC_THREADS + threadIdx.x, p = k0 + (idx >> 4), d = (idx & 15) * 4;
        size_t at = (size_t)p * c + h * TC_HD + d;
        bool in = p < keys;
        kr[i] = in ? kv_get4(k_cache + at) : make_float4(0.f, 0.f, 0.f, 0.f);
        vr[i] = in ? kv_get4(v_cache + at) : make_float4(0.f, 0.f, 0.f, 0.f);
    }
}

// With `start_ptr`, the first position is read from device memory instead of `start`.
extern "C" __global__ void __launch_bounds__(TC_THREADS)
    attention_prefill_mma(void* out, const float* qkv, const kv16_t* k_cache, const kv16_t* v_cache, int start,
                          int rows, int c, int out_bf16, const int* start_ptr) {
    // [2 tiles][keys][dims] fp16; reused at the end for group 1's partial results
    __shared__ __align__(16) unsigned short ks[2][TC_K][TC_LD];
    __shared__ __align__(16) unsigned short vs[2][TC_K][TC_LD];
    pdl_launch_dependents();
    pdl_wait();
    if (start_ptr != nullptr) start = *start_ptr;
    int h = blockIdx.x;
    int q0 = (gridDim.y - 1 - blockIdx.y) * TC_Q;  // the longest rows first
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    int wq = warp & 3, group = warp >> 2;
    int r0 = q0 + wq * 16 + g;  // this thread's rows: r0 and r0 + 8
    u32 qf[4][4];
#pragma unroll
    for (int kk = 0; kk < 4; kk++)
#pragma unroll
        for (int half = 0; half < 2; half++)
#pragma unroll
            for (int rr = 0; rr < 2; rr++) {
                int row = r0 + rr * 8, col = kk * 16 + half * 8 + 2 * t;
                float2 v = row < rows ? *reinterpret_cast<const float2*>(qkv + (size_t)row * 3 * c + h * TC_HD + col)
                                      : make_float2(0.f, 0.f);
                qf[kk][half * 2 + rr] = pack_f16(v.x * 0.125f, v.y * 0.125f);
            }
    float o[8][4];
#pragma unroll
    for (int j = 0; j < 8; j++) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.0f;
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
    int qpos[2] = {start + r0, start + r0 + 8};
    int warp_last = start + q0 + wq * 16 + 15;  // the warp's last query position
    int keys = min(start + q0 + TC_Q, start + rows);
    float4 kr[8], vr[8];
    tc_load_tiles(kr, vr, k_cache, v_cache, 0, keys, c, h);
    for (int k0 = 0; k0 < keys; k0 += 2 * TC_K) {
        __syncthreads();
#pragma unroll
        for (int i = 0; i < 8; i++) {
            int idx = i * TC_THREADS + threadIdx.x, r = idx >> 4, d = (idx & 15) * 4;
            *reinterpret_cast<uint2*>(&ks[r >> 6][r & 63][d]) =
                make_uint2(pack_f16(kr[i].x, kr[i].y), pack_f16(kr[i].z, kr[i].w));
            *reinterpret_cast<uint2*>(&vs[r >> 6][r & 63][d]) =
                make_uint2(pack_f16(vr[i].x, vr[i].y), pack_f16(vr[i].z, vr[i].w));
        }
        __syncthreads();
        if (k0 + 2 * TC_K < keys)
            tc_load_tiles(kr, vr, k_cache, v_cache, k0 + 2 * TC_K, keys, c, h);
        int kt = k0 + group * TC_K;  // this warp's tile
        if (kt >= keys || kt > warp_last) continue;  // past the end, or all in the warp's future
        tc_tile<false>(o, m, l, qf, ks[group], vs[group], kt, qpos, keys, TC_LOG2E);
    }
    float* part = reinterpret_cast<float*>(&ks[0][0][0]);
    tc_merge_store(o, m, l, part, r0, rows, c, h, out, out_bf16, TC_LOG2E);
}

// Prefill on tensor cores from bf16 rows (sm_80+, bf16 mode, hd == 64): the prompt's queries,
// keys and values are read from the QKV product's bf16 rows ([rows, 3C], its bias added), the
// keys and values of a prefix before `start` from the fp16 cache (rounded to bf16 on the way),
// and the block's own 64 positions are appended to the cache (bf16 into fp16: exact in its range). Same
// layout as `attention_prefill_mma` (8 warps: 4 x 16 query rows, 2 groups of key tiles), but
// bf16 mma and no conversions: the prompt's tiles stream into shared memory with cp.async,
// double-buffered (128 keys a stage), so no registers hold loads in flight. Scores stay in
// natural units; the softmax folds log2(e)/8 into one FMA before exp2. Dynamic shared memory:
// FA_SMEM bytes.
#define FA_KEYS (2 * TC_K)
static_assert(FA_SMEM == 2 * 2 * FA_KEYS * TC_LD * 2, "FA_SMEM (ops/attention.rs) must hold two stages of keys and values");
#define FA_SCALE 0.18033688f  // log2(e) / sqrt(64)

// Eight bf16 (16 bytes) into the fp16 cache at `dst` (16-byte aligned; exact in fp16's range).
__device__ __forceinline__ void store_widened8(kv16_t* dst, uint4 v) {
    kv_put4(dst, make_float4(__uint_as_float(v.x << 16), __uint_as_float(v.x & 0xffff0000u),
                             __uint_as_float(v.y << 16), __uint_as_float(v.y & 0xffff0000u)));
    kv_put4(dst + 4, make_float4(__uint_as_float(v.z << 16), __uint_as_float(v.z & 0xffff0000u),
                                 __uint_as_float(v.w << 16), __uint_as_float(v.w & 0xffff0000u)));
}

// Keys and values k0..k0+FA_KEYS-1 of head h into stage `st`: the prompt's with cp.async, a
// prefix's from the fp16 cache (loaded, rounded to bf16, stored), zeros past `keys`. Commits one group.
__device__ __forceinline__ void fa_load_stage(unsigned short (*ks)[TC_LD], unsigned short (*vs)[TC_LD],
                                              const bf16_t* qkv, const kv16_t* k_cache, const kv16_t* v_cache,
                                              int start, int k0, int keys, int c, int h) {
#pragma unroll
    for (int i = 0; i < FA_KEYS * 8 / TC_THREADS; i++) {
        int idx = i * TC_THREADS + threadIdx.x, r = idx >> 3, d = (idx & 7) * 8, p = k0 + r;
        if (p >= start || p >= keys) {
            bool in = p < keys;
            const bf16_t* src = qkv + (size_t)(in ? p - start : 0) * 3 * c + c + h * TC_HD + d;
            cp_async16(&ks[r][d], src, in);
            cp_async16(&vs[r][d], src + c, in);
        } else {
            size_t at = (size_t)p * c + h * TC_HD + d;
            float4 ka = kv_get4(k_cache + at), kb = kv_get4(k_cache + at + 4);
            float4 va = kv_get4(v_cache + at), vb = kv_get4(v_cache + at + 4);
            *reinterpret_cast<uint4*>(&ks[r][d]) =
                make_uint4(pack_bf16_rn(ka.x, ka.y), pack_bf16_rn(ka.z, ka.w), pack_bf16_rn(kb.x, kb.y),
                           pack_bf16_rn(kb.z, kb.w));
            *reinterpret_cast<uint4*>(&vs[r][d]) =
                make_uint4(pack_bf16_rn(va.x, va.y), pack_bf16_rn(va.z, va.w), pack_bf16_rn(vb.x, vb.y),
                           pack_bf16_rn(vb.z, vb.w));
        }
    }
    cp_async_commit();
}

extern "C" __global__ void __launch_bounds__(TC_THREADS)
    attention_prefill_fresh(void* out, const bf16_t* qkv, kv16_t* k_cache, kv16_t* v_cache, int start, int rows,
                            int c, int out_bf16, const int* start_ptr) {
    extern __shared__ __align__(16) unsigned short fa_smem[];
    // [stage][key][dim] keys, then values
    auto ks = reinterpret_cast<unsigned short (*)[FA_KEYS][TC_LD]>(fa_smem);
    auto vs = reinterpret_cast<unsigned short (*)[FA_KEYS][TC_LD]>(fa_smem + 2 * FA_KEYS * TC_LD);
    pdl_launch_dependents();
    pdl_wait();
    if (start_ptr != nullptr) start = *start_ptr;
    int h = blockIdx.x;
    int q0 = (gridDim.y - 1 - blockIdx.y) * TC_Q;  // the longest rows first
    int keys = min(start + q0 + TC_Q, start + rows);
    int iters = (keys + FA_KEYS - 1) / FA_KEYS;
    fa_load_stage(ks[0], vs[0], qkv, k_cache, v_cache, start, 0, keys, c, h);
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    int wq = warp & 3, group = warp >> 2;
    int r0 = q0 + wq * 16 + g;  // this thread's rows: r0 and r0 + 8
    // the block's own positions into the cache (nobody else reads them from there)
    for (int i = threadIdx.x; i < TC_Q * 8; i += TC_THREADS) {
        int row = q0 + (i >> 3), d = (i & 7) * 8;
        if (row < rows) {
            const bf16_t* src = qkv + (size_t)row * 3 * c + c + h * TC_HD + d;
            size_t at = (size_t)(start + row) * c + h * TC_HD + d;
            store_widened8(k_cache + at, *reinterpret_cast<const uint4*>(src));
            store_widened8(v_cache + at, *reinterpret_cast<const uint4*>(src + c));
        }
    }
    u32 qf[4][4];
#pragma unroll
    for (int kk = 0; kk < 4; kk++)
#pragma unroll
        for (int half = 0; half < 2; half++)
#pragma unroll
            for (int rr = 0; rr < 2; rr++) {
                int row = r0 + rr * 8, col = kk * 16 + half * 8 + 2 * t;
                qf[kk][half * 2 + rr] =
                    row < rows ? *reinterpret_cast<const u32*>(qkv + (size_t)row * 3 * c + h * TC_HD + col) : 0u;
            }
    float o[8][4];
#pragma unroll
    for (int j = 0; j < 8; j++) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.0f;
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
    int qpos[2] = {start + r0, start + r0 + 8};
    int warp_last = start + q0 + wq * 16 + 15;  // the warp's last query position
    for (int it = 0; it < iters; it++) {
        int st = it & 1, k0 = it * FA_KEYS;
        if (it + 1 < iters) {
            fa_load_stage(ks[st ^ 1], vs[st ^ 1], qkv, k_cache, v_cache, start, k0 + FA_KEYS, keys, c, h);
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        int kt = k0 + group * TC_K;  // this warp's tile
        if (kt < keys && kt <= warp_last)
            tc_tile<true>(o, m, l, qf, &ks[st][group * TC_K], &vs[st][group * TC_K], kt, qpos, keys, FA_SCALE);
        __syncthreads();  // the stage is read by all before it is loaded again
    }
    tc_merge_store(o, m, l, reinterpret_cast<float*>(fa_smem), r0, rows, c, h, out, out_bf16, FA_SCALE);
}
