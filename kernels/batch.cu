// One decode step of many contexts at once: row r of the step is one context's next token.
//
// Each row brings its own token, position and KV cache through a table the host uploads before
// the step (`tokens[r]`, `positions[r]`, the addresses `k_caches[r]` / `v_caches[r]` of its
// layer-0 cache, `[capacity, C]` per layer, `layer_off` elements apart, f32 or fp16 per `KvOf`); a padding row (the step
// rounded up to a captured graph's size) has position -1 and touches no cache and no output.
//
// The products go through cuBLAS over all rows, or in bf16 mode for steps of up to 64 rows
// (every step, and the LM head, when batch-invariant) through `batch_gemm_bf16_*` below. In
// bf16 mode their inputs are "split": each f32 activation
// v is stored as two bf16 rows, hi = bf16(v) in row r and lo = bf16(v - hi) in row rows + r, and
// the product's two result rows are summed (by the next kernel after cuBLAS, inside our kernel),
// so a batched step sees the activations to ~16 bits, as the one-row f32 decode kernels do,
// instead of bf16's 8.
#include "common.cuh"

// An activation into `out`: f32 `[rows, width]`, or split into bf16 hi/lo rows `[2 * rows, width]`.
__device__ __forceinline__ void store_act(void* out, int rows, int r, int col, int width, float v, int split) {
    if (split) {
        bf16_t hi = f32_to_bf16_bits(v);
        bf16_t* o = static_cast<bf16_t*>(out);
        o[(size_t)r * width + col] = hi;
        o[(size_t)(rows + r) * width + col] = f32_to_bf16_bits(v - bf16_to_f32(hi));
    } else {
        static_cast<float*>(out)[(size_t)r * width + col] = v;
    }
}
// Four activations from `col` (a multiple of 4) on, as `store_act` stores each: one 16-byte
// store (f32), or 8 bytes into the hi row and 8 into the lo row (split).
__device__ __forceinline__ void store_act4(void* out, int rows, int r, int col, int width, float4 v, int split) {
    if (split) {
        float e[4] = {v.x, v.y, v.z, v.w};
        u32 hi[2], lo[2];
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            bf16_t h0 = f32_to_bf16_bits(e[2 * j]), h1 = f32_to_bf16_bits(e[2 * j + 1]);
            hi[j] = (u32)h0 | ((u32)h1 << 16);
            lo[j] = (u32)f32_to_bf16_bits(e[2 * j] - bf16_to_f32(h0)) |
                    ((u32)f32_to_bf16_bits(e[2 * j + 1] - bf16_to_f32(h1)) << 16);
        }
        bf16_t* o = static_cast<bf16_t*>(out);
        *reinterpret_cast<uint2*>(o + (size_t)r * width + col) = make_uint2(hi[0], hi[1]);
        *reinterpret_cast<uint2*>(o + (size_t)(rows + r) * width + col) = make_uint2(lo[0], lo[1]);
    } else {
        *reinterpret_cast<float4*>(static_cast<float*>(out) + (size_t)r * width + col) = v;
    }
}
// A product's result for row r: its row, plus the lo row's when the input was split (cuBLAS's
// result; only the first lo_rows rows have one, the rows past them were multiplied as their hi
// halves alone), or summed over the planes of K slices (`batch_gemm`'s, the hi and lo rows
// already summed). `split_in` says which: bit 0 the split, the bits above lo_rows (split) or
// the planes (0: one, at most MAX_PLANES), each `rows` rows (twice that, split) of n. The
// planes' loads are all issued before the first sum, which is in plane order.
#define MAX_PLANES 8
__device__ __forceinline__ float product_value(const float* tmp, int rows, int r, int col, int n, int split_in) {
    int parts = max(1, split_in >> 1);
    const float* t = tmp + (size_t)r * n + col;
    if (split_in & 1) return 0.0f + t[0] + (r < (split_in >> 1) ? t[(size_t)rows * n] : 0.0f);
    size_t plane = (size_t)rows * n;
    float part[MAX_PLANES];
#pragma unroll
    for (int p = 0; p < MAX_PLANES; ++p) part[p] = p < parts ? t[p * plane] : 0.0f;
    float v = 0.0f;
#pragma unroll
    for (int p = 0; p < MAX_PLANES; ++p)
        if (p < parts) v += part[p];
    return v;
}
// `product_value` of the four columns from `col` (a multiple of 4) on, each summed as it sums
// one, from 16-byte loads.
__device__ __forceinline__ float4 product_value4(const float* tmp, int rows, int r, int col, int n, int split_in) {
    int parts = max(1, split_in >> 1);
    const float4* t = reinterpret_cast<const float4*>(tmp + (size_t)r * n + col);
    size_t plane = (size_t)rows * n / 4;
    if (split_in & 1) {
        float4 hi = t[0], lo = r < (split_in >> 1) ? t[plane] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        return make_float4(0.0f + hi.x + lo.x, 0.0f + hi.y + lo.y, 0.0f + hi.z + lo.z, 0.0f + hi.w + lo.w);
    }
    float4 part[MAX_PLANES];
#pragma unroll
    for (int p = 0; p < MAX_PLANES; ++p) part[p] = p < parts ? t[p * plane] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
    for (int p = 0; p < MAX_PLANES; ++p) {
        if (p < parts) {
            v.x += part[p].x;
            v.y += part[p].y;
            v.z += part[p].z;
            v.w += part[p].w;
        }
    }
    return v;
}

// The residual stream's update and the LayerNorm that follows it, one block per row: with
// `tmp`, x[r] += product + bias (a projection's result); without, x[r] = wte[tokens[r]] +
// wpe[positions[r]] (the embedding; zeros for a padding row; clears keys[r], the row's argmax
// key that the LM head raises). Then LayerNorm(x[r]) (eps 1e-5, two passes over the row held in
// registers, as `layernorm`) into `out` as a product input (f32, or split). The weights (bias,
// LayerNorm) are fetched before the wait on the previous kernel. A thread holds pieces of four
// elements (C % 8 == 0, checked on the host), so that a row takes a few 16-byte loads a thread
// rather than a predicated scalar load for every (element, plane) a thread could hold: the
// kernel's time is its instructions' latency, not its bytes.
// Pieces of a row a thread holds: C <= RN_PER * 4 * 256 (the host refuses n_embd > 2048).
#define RN_PER 2
template <typename W>
__device__ void batch_residual_norm_impl(float* x, const float* tmp, const W* bias, int split_in, const int* tokens,
                                         const int* positions, const W* wte, const W* wpe, const W* ln_w,
                                         const W* ln_b, void* out, int split_out, int rows, int c,
                                         unsigned long long* keys) {
    using S4 = typename Stored4<W>::T;
    __shared__ float scratch[32];
    pdl_launch_dependents();
    const int c4 = c / 4;
    S4 gain[RN_PER], shift[RN_PER], b[RN_PER];
#pragma unroll
    for (int u = 0; u < RN_PER; u++) {
        int i = threadIdx.x + u * blockDim.x;
        gain[u] = shift[u] = b[u] = S4{};
        if (i < c4) {
            gain[u] = fetch4(ln_w + 4 * i);
            shift[u] = fetch4(ln_b + 4 * i);
            if (tmp != nullptr) b[u] = fetch4(bias + 4 * i);
        }
    }
    pdl_wait();
    int r = blockIdx.x, pos = positions[r];
    float* xr = x + (size_t)r * c;
    float4 v[RN_PER];
#pragma unroll
    for (int u = 0; u < RN_PER; u++) v[u] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (tmp == nullptr) {
        if (threadIdx.x == 0) keys[r] = 0ull;
        const W* te = wte + (size_t)tokens[r] * c;
        const W* pe = wpe + (size_t)(pos < 0 ? 0 : pos) * c;
#pragma unroll
        for (int u = 0; u < RN_PER; u++) {
            int i = threadIdx.x + u * blockDim.x;
            if (i < c4 && pos >= 0) {
                float4 t = load4(te + 4 * i), p = load4(pe + 4 * i);
                v[u] = make_float4(t.x + p.x, t.y + p.y, t.z + p.z, t.w + p.w);
            }
        }
    } else {
#pragma unroll
        for (int u = 0; u < RN_PER; u++) {
            int i = threadIdx.x + u * blockDim.x;
            if (i < c4) {
                float4 old = *reinterpret_cast<const float4*>(xr + 4 * i);
                float4 p = product_value4(tmp, rows, r, 4 * i, c, split_in), bb = widen4(b[u]);
                v[u] = make_float4(old.x + (p.x + bb.x), old.y + (p.y + bb.y), old.z + (p.z + bb.z),
                                   old.w + (p.w + bb.w));
            }
        }
    }
    float s = 0.0f;
#pragma unroll
    for (int u = 0; u < RN_PER; u++) {
        int i = threadIdx.x + u * blockDim.x;
        if (i < c4) *reinterpret_cast<float4*>(xr + 4 * i) = v[u];
        s += (v[u].x + v[u].y) + (v[u].z + v[u].w);
    }
    float mean = block_sum(s, scratch) / c;
    float var = 0.0f;
#pragma unroll
    for (int u = 0; u < RN_PER; u++) {
        if (threadIdx.x + u * blockDim.x < c4) {
            float d0 = v[u].x - mean, d1 = v[u].y - mean, d2 = v[u].z - mean, d3 = v[u].w - mean;
            var += (d0 * d0 + d1 * d1) + (d2 * d2 + d3 * d3);
        }
    }
    float rstd = rsqrtf(block_sum(var, scratch) / c + 1e-5f);
#pragma unroll
    for (int u = 0; u < RN_PER; u++) {
        int i = threadIdx.x + u * blockDim.x;
        if (i < c4) {
            float4 g = widen4(gain[u]), h = widen4(shift[u]);
            float4 y = make_float4((v[u].x - mean) * rstd * g.x + h.x, (v[u].y - mean) * rstd * g.y + h.y,
                                   (v[u].z - mean) * rstd * g.z + h.z, (v[u].w - mean) * rstd * g.w + h.w);
            store_act4(out, rows, r, 4 * i, c, y, split_out);
        }
    }
}
#define BATCH_RESIDUAL_NORM(name, W)                                                                           \
    extern "C" __global__ void __launch_bounds__(256)                                                          \
        name(float* x, const float* tmp, const W* bias, int split_in, const int* tokens, const int* positions, \
             const W* wte, const W* wpe, const W* ln_w, const W* ln_b, void* out, int split_out, int rows,     \
             int c, unsigned long long* keys) {                                                                \
        batch_residual_norm_impl(x, tmp, bias, split_in, tokens, positions, wte, wpe, ln_w, ln_b, out,          \
                                 split_out, rows, c, keys);                                                     \
    }
BATCH_RESIDUAL_NORM(batch_residual_norm_f32, float)
BATCH_RESIDUAL_NORM(batch_residual_norm_bf16, bf16_t)

// After a product of width n over the rows (`tmp`, `[rows or 2 * rows, n]`): bias, then GELU
// (EPI_GELU) or not (EPI_STORE), into `out` as a product input. Grid (column blocks, rows).
// (Residual products go through `batch_residual_norm`, the QKV product through
// `batch_attention`.)
template <typename W>
__device__ void batch_epilogue_impl(void* out, const float* tmp, const W* bias, int rows, int n, int mode, int split_in,
                                    int split_out) {
    pdl_launch_dependents();
    pdl_wait();
    int r = blockIdx.y;
    for (int col = blockIdx.x * blockDim.x + threadIdx.x; col < n; col += gridDim.x * blockDim.x) {
        float v = product_value(tmp, rows, r, col, n, split_in) + load1(bias + col);
        store_act(out, rows, r, col, n, mode == EPI_GELU ? gelu_tanh(v) : v, split_out);
    }
}
extern "C" __global__ void batch_epilogue_f32(void* out, const float* tmp, const float* bias, int rows, int n,
                                              int mode, int split_in, int split_out) {
    batch_epilogue_impl(out, tmp, bias, rows, n, mode, split_in, split_out);
}
extern "C" __global__ void batch_epilogue_bf16(void* out, const float* tmp, const bf16_t* bias, int rows, int n,
                                               int mode, int split_in, int split_out) {
    batch_epilogue_impl(out, tmp, bias, rows, n, mode, split_in, split_out);
}

// The QKV product's epilogue and attention in one kernel. Block (h, s, r) takes head h of row
// r: its query (product rows of `tmp`, `[rows or 2 * rows, 3C]`, plus the bias), and the s-th of
// the row's spans of its positions 0..=positions[r] (`ba_row_spans`: one per `span_len`
// positions, at most gridDim.y; blocks past them do nothing); with `append`, the block whose span
// holds the row's own position first appends the row's key and value (head h) to the row's
// cache there (without, `batch_append_kv` did it for every row before: rows of one prompt read
// each other's keys). The
// span is scored in chunks of BA_CHUNK (one position a thread: few block-wide reductions), with
// a running max and sum. Thread (dimension pair, group g) sums the values of positions g, g +
// 4, ... of a chunk, one serial sum per dimension, its loads all issued ahead of the sums; the
// four groups meet at the end. Every sum is taken in the order the first version of this
// kernel took it (one position a thread, then a dimension a thread), so results are bitwise
// what they were: only the loads changed (16 bytes a key, 2 dimensions a value load).
// With one span the block writes the
// normalised output to `out` as a product input (f32, or split); with several it leaves
// [max, sum, out[hd]] for `batch_attention_combine`. A padding row touches no cache and
// gives zeros.
// Positions a block of the batched attention scores at once: one a thread.
#define BA_CHUNK ATT_THREADS
// acc plus eight key elements times the query's: two `key_dot4`s.
__device__ __forceinline__ float dot8(float acc, const float k[8], const float* q) {
    acc = key_dot4(acc, make_float4(k[0], k[1], k[2], k[3]), q);
    return key_dot4(acc, make_float4(k[4], k[5], k[6], k[7]), q + 4);
}
// The dot product of a cached key row (hd elements, 16-byte aligned) with the query in shared
// memory, summed as `partial_dot(kr, qs, hd, 0, 1)` sums it, from 16-byte loads.
template <typename KV>
__device__ __forceinline__ float key_dot(const KV* kr, const float* qs, int hd) {
    float acc = 0.0f;
#pragma unroll 4
    for (int d = 0; d < hd; d += 8) {
        float k[8];
        kv_get8(kr + d, k);
        acc = dot8(acc, k, qs + d);
    }
    return acc;
}
// The spans a row of `len` positions is cut into, in a grid of `grid`: one per `span_len`
// positions, at most `grid`. A function of the row alone once the grid has as many spans as the
// longest row asks for (or the most there are), which makes a row's attention the same whatever
// rows run beside it.
__device__ __forceinline__ int ba_row_spans(int len, int grid, int span_len) {
    return max(1, min(grid, (len + span_len - 1) / span_len));
}
// The span of its row's positions that block (head, span, row) of the batched attention
// takes: len (0 for a padding row), the row's spans, [first, end) and its partial results'
// place. A block past the row's spans does nothing; an empty span leaves what the combine or
// the next product reads (no positions, or zeros). Both return false.
__device__ __forceinline__ bool ba_span(int r, void* out, float* partial, const int* positions, int c, int hd,
                                        int rows, int split_out, int span_len, int& len, int& spans, int& first,
                                        int& end, float*& part) {
    int h = blockIdx.x, s = blockIdx.y, grid = gridDim.y;
    len = positions[r] + 1;
    spans = ba_row_spans(len, grid, span_len);
    if (s >= spans) return false;
    int span = ((len + spans - 1) / spans + ATT_CHUNK - 1) / ATT_CHUNK * ATT_CHUNK;
    first = s * span;
    end = min(len, first + span);
    part = partial + (((size_t)r * gridDim.x + h) * grid + s) * (hd + 2);
    if (first < end) return true;
    if (spans > 1) {
        if (threadIdx.x == 0) { part[0] = -INFINITY; part[1] = 0.0f; }
    } else {
        for (int d = threadIdx.x; d < hd; d += blockDim.x) store_act(out, rows, r, h * hd + d, c, 0.0f, split_out);
    }
    return false;
}
// The four groups' sums of each dimension (`acc_s`, groups `stride` floats apart), normalised
// into `out` (the row's one span), or left with the span's max and sum for the combine.
__device__ __forceinline__ void ba_finish(int r, const float* acc_s, int stride, float m_run, float sum_run,
                                          float* part, void* out, int c, int hd, int rows, int split_out, int spans) {
    int h = blockIdx.x;
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        float a = acc_s[d] + acc_s[stride + d] + acc_s[2 * stride + d] + acc_s[3 * stride + d];
        if (spans == 1) store_act(out, rows, r, h * hd + d, c, a / sum_run, split_out);
        else part[2 + d] = a;
    }
    if (spans > 1 && threadIdx.x == 0) { part[0] = m_run; part[1] = sum_run; }
}
// Thread j's probability of its position in the chunk (score sc, `in` the chunk) into p[j],
// against the running max and sum of the chunks before, both updated; returns the factor the
// sums of those chunks are rescaled by.
__device__ __forceinline__ float ba_softmax(float sc, bool in, float* p, float* scratch, float& m_run,
                                           float& sum_run) {
    float m = fmaxf(m_run, block_max(sc, scratch));
    float e = in ? __expf(sc - m) : 0.0f;
    p[threadIdx.x] = e;
    float sum = block_sum(e, scratch);
    float rescale = __expf(m_run - m);
    sum_run = sum_run * rescale + sum;
    m_run = m;
    return rescale;
}
template <typename W>
__device__ void batch_attention_impl(int r, void* out, float* partial, const float* tmp, const W* bias, int split_in,
                                     const int* positions, const unsigned long long* k_caches,
                                     const unsigned long long* v_caches, long long layer_off, int c, int hd,
                                     int rows, int split_out, int append, int span_len) {
    __shared__ float qs[MAX_HD];
    __shared__ float p[BA_CHUNK];
    __shared__ float acc_s[4][MAX_HD];
    __shared__ float scratch[32];
    int h = blockIdx.x, len, spans, first, end;
    float* part;
    if (!ba_span(r, out, partial, positions, c, hd, rows, split_out, span_len, len, spans, first, end, part)) return;
    typedef typename KvOf<W>::T KV;
    KV* kc = reinterpret_cast<KV*>(k_caches[r]) + layer_off + h * hd;
    KV* vc = reinterpret_cast<KV*>(v_caches[r]) + layer_off + h * hd;
    int n3 = 3 * c;
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        int col = h * hd + d;
        qs[d] = product_value(tmp, rows, r, col, n3, split_in) + load1(bias + col);
        if (append && end == len) {
            kv_put(kc + (size_t)(len - 1) * c + d,
                   product_value(tmp, rows, r, c + col, n3, split_in) + load1(bias + c + col));
            kv_put(vc + (size_t)(len - 1) * c + d,
                   product_value(tmp, rows, r, 2 * c + col, n3, split_in) + load1(bias + 2 * c + col));
        }
    }
    __syncthreads();
    float scale = rsqrtf((float)hd);
    int j = threadIdx.x;  // this thread's position of each chunk
    int pairs = hd / 2;
    float m_run = -INFINITY, sum_run = 0.0f;
    float2 acc[2] = {make_float2(0.0f, 0.0f), make_float2(0.0f, 0.0f)};  // per (pair, group) of this thread
    for (int base = first; base < end; base += BA_CHUNK) {
        int count = min(BA_CHUNK, end - base);
        float sc = j < count ? key_dot(kc + (size_t)(base + j) * c, qs, hd) * scale : -INFINITY;
        float rescale = ba_softmax(sc, j < count, p, scratch, m_run, sum_run);
        __syncthreads();
#pragma unroll
        for (int i = 0; i < 2; i++) {
            int idx = threadIdx.x + i * blockDim.x;
            if (idx < 4 * pairs) {
                int d = 2 * (idx % pairs), g = idx / pairs;
                float2 a = make_float2(0.0f, 0.0f);
#pragma unroll 16
                for (int jj = g; jj < count; jj += 4) {
                    float2 v = kv_get2(vc + (size_t)(base + jj) * c + d);
                    float pj = p[jj];
                    a.x += pj * v.x;
                    a.y += pj * v.y;
                }
                acc[i].x = acc[i].x * rescale + a.x;
                acc[i].y = acc[i].y * rescale + a.y;
            }
        }
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < 2; i++) {
        int idx = threadIdx.x + i * blockDim.x;
        if (idx < 4 * pairs) {
            int d = 2 * (idx % pairs), g = idx / pairs;
            acc_s[g][d] = acc[i].x;
            acc_s[g][d + 1] = acc[i].y;
        }
    }
    __syncthreads();
    ba_finish(r, &acc_s[0][0], sizeof(acc_s[0]) / sizeof(float), m_run, sum_run, part, out, c, hd, rows, split_out,
              spans);
}

// `batch_attention_impl` for 64-dimension heads over an fp16 cache (every GPT-2 in bf16), each
// of the block's warps running an online softmax of its own, so that no block-wide barrier
// stands between one piece of positions and the next: the span is cut into pieces of
// BW_PIECE positions and warp w takes pieces w, w + BW_WARPS, ... Four lanes score a
// position, 16 dimensions each in `key_group`'s groups, summed as the lone decode's
// `partial_dot` sums them (lanes 4g..4g + 3 take positions g, g + 8, g + 16, g + 24 of a
// piece), so that one load instruction reads half of each of 8 key rows in whole sectors.
// The warp's max and sum come from shuffles, then lane j
// sums dimensions 2j and 2j + 1 over the piece's values, staged in the warp's part of `vbuf`
// (cp.async, zeros past the span). A piece's keys are asked for as soon as the piece before
// has used its own, its values once the piece before has been summed. The warps' maxima,
// sums and values meet once, in warp order, at the end. The row's own position, which the
// block appends, is scored and summed from shared memory instead of read back. Which warp
// takes which position depends on the row and the block's warps alone, so the result does
// too. A block has BW_WARPS warps, or half as many where the host wants twice the blocks an
// SM (a pass of decodes alone whose blocks would not fit one wave of the whole ones; never
// batch-invariant); `vbuf` holds a piece a warp.
#define BA_HD 64
#define BW_PIECE 32
#define BW_WARPS (ATT_THREADS / 32)
#define BW_KEY_LANES 4                            // lanes that score one position
#define BW_GROUPS (32 / BW_KEY_LANES)             // positions a warp scores at once
#define BW_ROUNDS (BW_PIECE / BW_GROUPS)          // positions of a piece a lane group scores
#define BW_KEY_DIMS (BA_HD / BW_KEY_LANES)        // dimensions of a key a lane takes
static_assert(BW_PIECE == 32 && BA_HD == 2 * BW_PIECE, "a lane sums a dimension pair of the values");
static_assert(BW_KEY_DIMS == 16, "a lane takes two 16-byte pieces of a key row, as partial_dot(.., 4) cuts it");
// The dimension a lane's half (0: the first 8, 1: the last) of its 16 begins at.
#define BW_KEY_AT(q, half) key_group(q, BW_KEY_LANES, half)
static_assert(BA_VALUES_SMEM == BW_WARPS * BW_PIECE * BA_HD * 2, "the host sizes a piece of values a warp");
// Lane `lane`'s share of a piece's keys (first position `base`, `count` positions) into
// registers: in round i, dimensions 8q..8q + 7 and 32 + 8q..32 + 8q + 7 (q = lane % 4) of the
// piece's position 8i + lane / 4, where it has one to score (the row's own position is read
// from shared memory); a load instruction reads 64 whole bytes of each of 8 key rows.
__device__ __forceinline__ void ba_load_keys(uint4 kw[2 * BW_ROUNDS], const kv16_t* kc, int c, int base, int count,
                                             int own, int lane) {
    int g = lane / BW_KEY_LANES, q = lane % BW_KEY_LANES;
#pragma unroll
    for (int i = 0; i < BW_ROUNDS; i++) {
        int j = BW_GROUPS * i + g;
        if (j < count && base + j != own) {
            const kv16_t* row = kc + (size_t)(base + j) * c;
            kw[2 * i] = *reinterpret_cast<const uint4*>(row + BW_KEY_AT(q, 0));
            kw[2 * i + 1] = *reinterpret_cast<const uint4*>(row + BW_KEY_AT(q, 1));
        }
    }
}
// The values of positions base..base + count - 1 into the warp's `vbuf` (one row of 64 fp16
// each), zeros for the rest of the piece and for `own`, as one cp.async group of the lane.
__device__ __forceinline__ void bw_stage_values(u32 (*vbuf)[BA_HD / 2], const kv16_t* vc, int c, int base, int count,
                                                int own, int lane) {
#pragma unroll
    for (int u = 0; u < BW_PIECE * (BA_HD / 8) / 32; u++) {
        int i = lane + 32 * u, jj = i / (BA_HD / 8), ch = (i % (BA_HD / 8)) * 8;
        bool in = jj < count && base + jj != own;
        cp_async16(&vbuf[jj][ch / 2], vc + (in ? (size_t)(base + jj) * c + ch : 0), in);
    }
    cp_async_commit();
}
// `vbuf` ([BW_WARPS * BW_PIECE][BA_HD / 2] words) is in dynamic shared memory, which the
// tiles of `bt_attend` share.
__device__ void batch_attention_h64(int r, u32 (*vbuf)[BA_HD / 2], void* out, float* partial, const float* tmp,
                                    const bf16_t* bias, int split_in, const int* positions,
                                    const unsigned long long* k_caches, const unsigned long long* v_caches,
                                    long long layer_off, int c, int rows, int split_out, int append, int span_len) {
    __shared__ float qs[BA_HD];
    // the appended position as the cache keeps it: its key as the cache's fp16 bits (read as the
    // cached keys are), its value as f32
    __shared__ __align__(16) unsigned short own_k[BA_HD];
    __shared__ float own_v[BA_HD];
    __shared__ float warp_acc[BW_WARPS][BA_HD];
    __shared__ float warp_run[BW_WARPS][2];  // each warp's max and sum
    const int hd = BA_HD;
    int h = blockIdx.x, len, spans, first, end;
    float* part;
    if (!ba_span(r, out, partial, positions, c, hd, rows, split_out, span_len, len, spans, first, end, part)) return;
    kv16_t* kc = reinterpret_cast<kv16_t*>(k_caches[r]) + layer_off + h * hd;
    kv16_t* vc = reinterpret_cast<kv16_t*>(v_caches[r]) + layer_off + h * hd;
    int own = append && end == len ? len - 1 : -1;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    u32 (*wbuf)[BA_HD / 2] = vbuf + warp * BW_PIECE;
    int pieces = (end - first + BW_PIECE - 1) / BW_PIECE;
    // this warp's piece: its index, first position and positions (0 past the span)
    auto piece_at = [&](int piece, int& base, int& count) {
        base = first + piece * BW_PIECE;
        count = piece < pieces ? min(BW_PIECE, end - base) : 0;
    };
    int warps = blockDim.x >> 5, piece = warp, base, count;
    piece_at(piece, base, count);
    uint4 kw[2 * BW_ROUNDS];
    ba_load_keys(kw, kc, c, base, count, own, lane);
    if (count > 0) bw_stage_values(wbuf, vc, c, base, count, own, lane);
    int n3 = 3 * c;
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        int col = h * hd + d;
        qs[d] = product_value(tmp, rows, r, col, n3, split_in) + load1(bias + col);
        if (own >= 0) {
            float k = product_value(tmp, rows, r, c + col, n3, split_in) + load1(bias + c + col);
            float v = product_value(tmp, rows, r, 2 * c + col, n3, split_in) + load1(bias + 2 * c + col);
            kv_put(kc + (size_t)own * c + d, k);
            kv_put(vc + (size_t)own * c + d, v);
            own_k[d] = f32_to_f16_bits(k);
            own_v[d] = kv_kept(vc, v);
        }
    }
    __syncthreads();
    float scale = rsqrtf((float)hd);
    int d2 = 2 * lane;
    float m_run = -INFINITY, sum_run = 0.0f;
    float2 acc = make_float2(0.0f, 0.0f);
    int g = lane / BW_KEY_LANES, q = lane % BW_KEY_LANES;
    while (count > 0) {
        // round i: the lane's 16 dimensions of position 8i + g, summed over its four lanes
        float sc[BW_ROUNDS], m_piece = -INFINITY;
#pragma unroll
        for (int i = 0; i < BW_ROUNDS; i++) {
            int j = BW_GROUPS * i + g;
            // (the own key's words selected before one conversion: converting each way apart
            // spilled registers under CUDA 13's ptxas)
            uint4 lo = kw[2 * i], hi = kw[2 * i + 1];
            if (base + j == own) {
                lo = *reinterpret_cast<const uint4*>(own_k + BW_KEY_AT(q, 0));
                hi = *reinterpret_cast<const uint4*>(own_k + BW_KEY_AT(q, 1));
            }
            float k[BW_KEY_DIMS];
            f16x8_to_f32(lo, k);
            f16x8_to_f32(hi, k + 8);
            float dot = 0.0f;
#pragma unroll
            for (int t = 0; t < BW_KEY_DIMS; t += 4)
                dot = key_dot4(dot, make_float4(k[t], k[t + 1], k[t + 2], k[t + 3]),
                               qs + BW_KEY_AT(q, t / 8) + t % 8);
            dot += __shfl_xor_sync(0xffffffffu, dot, 1);
            dot += __shfl_xor_sync(0xffffffffu, dot, 2);
            sc[i] = j < count ? dot * scale : -INFINITY;
            m_piece = fmaxf(m_piece, sc[i]);
        }
        int next_base, next_count;
        piece_at(piece + warps, next_base, next_count);
        ba_load_keys(kw, kc, c, next_base, next_count, own, lane);
        // a group's four lanes hold the same scores: the piece's max and sum over the groups
#pragma unroll
        for (int o = BW_KEY_LANES; o < 32; o <<= 1) m_piece = fmaxf(m_piece, __shfl_xor_sync(0xffffffffu, m_piece, o));
        float m = fmaxf(m_run, m_piece);
        float p[BW_ROUNDS], p_sum = 0.0f;
#pragma unroll
        for (int i = 0; i < BW_ROUNDS; i++) {
            p[i] = BW_GROUPS * i + g < count ? __expf(sc[i] - m) : 0.0f;
            p_sum += p[i];
        }
#pragma unroll
        for (int o = BW_KEY_LANES; o < 32; o <<= 1) p_sum += __shfl_xor_sync(0xffffffffu, p_sum, o);
        float rescale = __expf(m_run - m);
        sum_run = sum_run * rescale + p_sum;
        m_run = m;
        cp_async_wait<0>();
        __syncwarp();
        // even and odd positions in two sums, so that each sum's chain is half as long
        float2 a0 = make_float2(0.0f, 0.0f), a1 = make_float2(0.0f, 0.0f);
        int own_j = own - base;
#pragma unroll
        for (int jj = 0; jj < BW_PIECE; jj += 2) {
            // position jj's weight is p[jj / BW_GROUPS] of the lanes of group jj % BW_GROUPS
            float p0 = __shfl_sync(0xffffffffu, p[jj / BW_GROUPS], BW_KEY_LANES * (jj % BW_GROUPS));
            float p1 = __shfl_sync(0xffffffffu, p[(jj + 1) / BW_GROUPS], BW_KEY_LANES * ((jj + 1) % BW_GROUPS));
            float2 v0 = jj == own_j ? make_float2(own_v[d2], own_v[d2 + 1]) : f16x2_to_f32(wbuf[jj][lane]);
            float2 v1 = jj + 1 == own_j ? make_float2(own_v[d2], own_v[d2 + 1]) : f16x2_to_f32(wbuf[jj + 1][lane]);
            a0.x += p0 * v0.x;
            a0.y += p0 * v0.y;
            a1.x += p1 * v1.x;
            a1.y += p1 * v1.y;
        }
        acc.x = acc.x * rescale + (a0.x + a1.x);
        acc.y = acc.y * rescale + (a0.y + a1.y);
        __syncwarp();  // every lane has read the piece's values before the next piece's land
        if (next_count > 0) bw_stage_values(wbuf, vc, c, next_base, next_count, own, lane);
        piece += warps;
        base = next_base;
        count = next_count;
    }
    warp_acc[warp][d2] = acc.x;
    warp_acc[warp][d2 + 1] = acc.y;
    if (lane == 0) {
        warp_run[warp][0] = m_run;
        warp_run[warp][1] = sum_run;
    }
    __syncthreads();
    // a warp without positions has max -inf and adds nothing; the first warp always has some
    float m = warp_run[0][0];
#pragma unroll
    for (int w = 1; w < BW_WARPS; w++)
        if (w < warps) m = fmaxf(m, warp_run[w][0]);
    float weight[BW_WARPS], sum = 0.0f;
#pragma unroll
    for (int w = 0; w < BW_WARPS; w++) {
        weight[w] = w >= warps || warp_run[w][0] == -INFINITY ? 0.0f : __expf(warp_run[w][0] - m);
        if (w < warps) sum += weight[w] * warp_run[w][1];
    }
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        float a = 0.0f;
#pragma unroll
        for (int w = 0; w < BW_WARPS; w++)
            if (w < warps) a += weight[w] * warp_acc[w][d];
        if (spans == 1) store_act(out, rows, r, h * hd + d, c, a / sum, split_out);
        else part[2 + d] = a;
    }
    if (spans > 1 && threadIdx.x == 0) {
        part[0] = m;
        part[1] = sum;
    }
}
// A prompt's rows in tiles (bf16 mode, fp16 cache, hd <= 64 and hd % 32 == 0): tile t is up
// to BT_Q rows of one context at consecutive positions (`tiles[2t]`: its first entry of
// `tile_rows`, `tiles[2t + 1]`: its rows, in position order), every key and value already in
// the cache (`batch_append_kv`). Flash attention on CUDA cores: the keys and values 0..the last
// row's position pass through shared memory in tiles of BT_K positions once for all of the
// tile's rows (cp.async, two stages: the next tile's loads in flight while this one is summed),
// with an online softmax. BT_TPQ threads own a query: thread i of them scores keys i, i +
// BT_TPQ, ... of each key tile and sums the dimensions i * hd / BT_TPQ.. of the output. Key
// tiles start at position 0 and a row's sums run over them in order, masked past its
// position, so a row's result does not depend on the rows beside it in its tile. Small tiles
// keep a block short (its rows' keys are read once a tile, not once a row, and the tiles of a
// pass run beside the decode rows' blocks). Dynamic shared memory: BT_SMEM (BT_Q and BT_SMEM
// come from the host), which `batch_attention_h64` shares for its values.
#define BT_K 32
#define BT_HD 64
#define BT_TPQ (ATT_THREADS / BT_Q)
#define BT_KPAD 8  // fp16 elements past each staged key row: rows 144 bytes apart (16-byte aligned for
                   // cp.async), at most 2-way bank conflicts on the 8-byte key reads
#define BT_STAGE (BT_K * (BT_HD + BT_KPAD) * 2 + BT_K * BT_HD * 2)
static_assert(ATT_THREADS % BT_Q == 0 && BT_TPQ <= 32 && (BT_TPQ & (BT_TPQ - 1)) == 0 && BT_K % BT_TPQ == 0,
              "a power of two of threads a query, within a warp");
static_assert(32 / BT_TPQ >= 2, "a thread sums a pair of dimensions or more of a 32-dimension head");
static_assert(BT_SMEM == BT_Q * (BT_HD + 4) * 4 + 2 * BT_STAGE + BT_Q * (BT_K + 1) * 4,
              "BT_SMEM (ops/batch.rs) must hold the queries, two stages of keys and values, the weights");
// Keys and values k0..k0 + BT_K - 1 of a head (`pieces` 16-byte pieces a row) into a stage,
// zeros past `keys`, as one cp.async group.
__device__ __forceinline__ void bt_stage(unsigned char* stage, const kv16_t* kc, const kv16_t* vc, int c, int k0,
                                         int keys, int pieces) {
    kv16_t (*ks)[BT_HD + BT_KPAD] = reinterpret_cast<kv16_t (*)[BT_HD + BT_KPAD]>(stage);
    kv16_t (*vs)[BT_HD] = reinterpret_cast<kv16_t (*)[BT_HD]>(stage + BT_K * (BT_HD + BT_KPAD) * 2);
    for (int idx = threadIdx.x; idx < BT_K * pieces; idx += blockDim.x) {
        int r = idx / pieces, off = (idx % pieces) * 8;
        bool in = k0 + r < keys;
        size_t at = in ? (size_t)(k0 + r) * c + off : 0;
        cp_async16(&ks[r][off], kc + at, in);
        cp_async16(&vs[r][off], vc + at, in);
    }
    cp_async_commit();
}
// The max (or sum) over the BT_TPQ threads of a query (aligned lanes of one warp).
__device__ __forceinline__ float bt_max(float v) {
#pragma unroll
    for (int o = 1; o < BT_TPQ; o <<= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
__device__ __forceinline__ float bt_sum(float v) {
#pragma unroll
    for (int o = 1; o < BT_TPQ; o <<= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
template <typename W>
__device__ void bt_attend(unsigned char* smem, int t, const int* tiles, const int* tile_rows, void* out,
                          const float* tmp, const W* bias, int split_in, const int* positions,
                          const unsigned long long* k_caches, const unsigned long long* v_caches, long long layer_off,
                          int c, int hd, int rows, int split_out) {
    const int KT = BT_K / BT_TPQ, DT = BT_HD / BT_TPQ;  // keys scored, dimensions summed a thread
    float (*qs)[BT_HD + 4] = reinterpret_cast<float (*)[BT_HD + 4]>(smem);
    unsigned char* stages = smem + BT_Q * (BT_HD + 4) * 4;
    float (*ps)[BT_K + 1] = reinterpret_cast<float (*)[BT_K + 1]>(stages + 2 * BT_STAGE);
    int first = tiles[2 * t], count = min(tiles[2 * t + 1], BT_Q);
    if (blockIdx.y != 0 || count <= 0) return;
    int h = blockIdx.x, tid = threadIdx.x, q = tid / BT_TPQ, part = tid % BT_TPQ;
    int row0 = tile_rows[first];
    const kv16_t* kc = reinterpret_cast<const kv16_t*>(k_caches[row0]) + layer_off + h * hd;
    const kv16_t* vc = reinterpret_cast<const kv16_t*>(v_caches[row0]) + layer_off + h * hd;
    int keys = positions[tile_rows[first + count - 1]] + 1;
    int pieces = hd / 8;
    bt_stage(stages, kc, vc, c, 0, keys, pieces);
    float scale = rsqrtf((float)hd);
    int n3 = 3 * c;
    for (int idx = tid; idx < BT_Q * hd; idx += blockDim.x) {
        int i = idx / hd, d = idx % hd, col = h * hd + d;
        qs[i][d] = i < count ? (product_value(tmp, rows, tile_rows[first + i], col, n3, split_in) + load1(bias + col)) *
                                   scale
                             : 0.0f;
    }
    int qpos = q < count ? positions[tile_rows[first + q]] : -1;
    int quads = hd / 4, dt = hd / BT_TPQ, d0 = part * dt;  // dt: 2 or 4 (hd 32 or 64)
    float2 acc[DT / 2];
#pragma unroll
    for (int i = 0; i < DT / 2; i++) acc[i] = make_float2(0.f, 0.f);
    float m = -INFINITY, l = 0.0f;
    for (int it = 0, k0 = 0; k0 < keys; it++, k0 += BT_K) {
        if (k0 + BT_K < keys) {
            bt_stage(stages + ((it + 1) & 1) * BT_STAGE, kc, vc, c, k0 + BT_K, keys, pieces);
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        unsigned char* stage = stages + (it & 1) * BT_STAGE;
        const kv16_t (*ks)[BT_HD + BT_KPAD] = reinterpret_cast<const kv16_t (*)[BT_HD + BT_KPAD]>(stage);
        const kv16_t (*vs)[BT_HD] = reinterpret_cast<const kv16_t (*)[BT_HD]>(stage + BT_K * (BT_HD + BT_KPAD) * 2);
        float s[KT];
        float tile_max = -INFINITY;
#pragma unroll
        for (int mm = 0; mm < KT; mm++) {
            int j = part + BT_TPQ * mm;
            float dot = 0.0f;
#pragma unroll
            for (int i = 0; i < BT_HD / 4; i++) {
                if (i < quads) {
                    float4 qv = *reinterpret_cast<const float4*>(&qs[q][4 * i]);
                    float4 kv = kv_get4(&ks[j][4 * i]);
                    dot += qv.x * kv.x + qv.y * kv.y + qv.z * kv.z + qv.w * kv.w;
                }
            }
            s[mm] = k0 + j <= qpos ? dot : -INFINITY;
            tile_max = fmaxf(tile_max, s[mm]);
        }
        float m_new = fmaxf(m, bt_max(tile_max));
        float corr = m_new == -INFINITY ? 1.0f : __expf(m - m_new);
        float psum = 0.0f;
#pragma unroll
        for (int mm = 0; mm < KT; mm++) {
            float p = s[mm] == -INFINITY ? 0.0f : __expf(s[mm] - m_new);
            ps[q][part + BT_TPQ * mm] = p;
            psum += p;
        }
        l = l * corr + bt_sum(psum);
        m = m_new;
        __syncwarp();
#pragma unroll
        for (int i = 0; i < DT / 2; i++) {
            acc[i].x *= corr;
            acc[i].y *= corr;
        }
#pragma unroll 8
        for (int j = 0; j < BT_K; j++) {
            float p = ps[q][j];
#pragma unroll
            for (int i = 0; i < DT / 2; i++) {
                if (2 * i < dt) {
                    float2 vv = kv_get2(&vs[j][d0 + 2 * i]);
                    acc[i].x += p * vv.x;
                    acc[i].y += p * vv.y;
                }
            }
        }
        __syncthreads();
    }
    if (q >= count) return;
    int r = tile_rows[first + q];
    float inv = 1.0f / l;
#pragma unroll
    for (int i = 0; i < DT / 2; i++) {
        if (2 * i < dt) {
            int col = h * hd + d0 + 2 * i;
            store_act(out, rows, r, col, c, acc[i].x * inv, split_out);
            store_act(out, rows, r, col + 1, c, acc[i].y * inv, split_out);
        }
    }
}

// The batched attention's entry points. Without `work`, block (h, s, r) takes span s of head
// h of row r. With it, block z takes work[z]: a row (>= 0) as above, tile -2 - work[z] of
// `tiles` (bf16 only; its rows have no block of their own), or nothing (-1); the host puts
// the tiles first, whose blocks run longest.
extern "C" __global__ void __launch_bounds__(ATT_THREADS)
    batch_attention_f32(void* out, float* partial, const float* tmp, const float* bias, int split_in,
                        const int* positions, const unsigned long long* k_caches, const unsigned long long* v_caches,
                        long long layer_off, int c, int hd, int rows, int split_out, int append, int span_len,
                        const int* work, const int* tiles, const int* tile_rows) {
    pdl_launch_dependents();
    pdl_wait();
    int r = work == nullptr ? (int)blockIdx.z : work[blockIdx.z];
    if (r < 0) return;
    batch_attention_impl(r, out, partial, tmp, bias, split_in, positions, k_caches, v_caches, layer_off, c, hd, rows,
                         split_out, append, span_len);
}
// Six blocks an SM (80 registers a thread): the 768 blocks of 64 rows of GPT-2 124M in one wave;
// twelve of half the warps, the host's choice where more rows take more than one wave.
extern "C" __global__ void __launch_bounds__(ATT_THREADS, 6)
    batch_attention_bf16(void* out, float* partial, const float* tmp, const bf16_t* bias, int split_in,
                         const int* positions, const unsigned long long* k_caches, const unsigned long long* v_caches,
                         long long layer_off, int c, int hd, int rows, int split_out, int append, int span_len,
                         const int* work, const int* tiles, const int* tile_rows) {
    extern __shared__ __align__(16) unsigned char ba_dynamic[];
    pdl_launch_dependents();
    pdl_wait();
    int r = work == nullptr ? (int)blockIdx.z : work[blockIdx.z];
    if (r < -1) {
        bt_attend(ba_dynamic, -2 - r, tiles, tile_rows, out, tmp, bias, split_in, positions, k_caches, v_caches,
                  layer_off, c, hd, rows, split_out);
        return;
    }
    if (r < 0) return;
    if (hd == BA_HD && (blockDim.x == BA_CHUNK || blockDim.x == BA_CHUNK / 2))
        batch_attention_h64(r, reinterpret_cast<u32 (*)[BA_HD / 2]>(ba_dynamic), out, partial, tmp, bias, split_in,
                            positions, k_caches, v_caches, layer_off, c, rows, split_out, append, span_len);
    else
        batch_attention_impl(r, out, partial, tmp, bias, split_in, positions, k_caches, v_caches, layer_off, c, hd,
                             rows, split_out, append, span_len);
}

// The keys and values of every row (the QKV product's rows of `tmp` plus the bias) into the rows'
// caches at their positions, before `batch_attention` (without append) reads them: a step that
// carries a prompt's rows has rows of one context that read each other's keys. Grid (column
// blocks, rows); a padding row writes nothing.
template <typename W>
__device__ void batch_append_kv_impl(const float* tmp, const W* bias, int split_in, const int* positions,
                                     const unsigned long long* k_caches, const unsigned long long* v_caches,
                                     long long layer_off, int c, int rows) {
    pdl_launch_dependents();
    pdl_wait();
    int r = blockIdx.y, pos = positions[r];
    if (pos < 0) return;
    typedef typename KvOf<W>::T KV;
    KV* kc = reinterpret_cast<KV*>(k_caches[r]) + layer_off + (size_t)pos * c;
    KV* vc = reinterpret_cast<KV*>(v_caches[r]) + layer_off + (size_t)pos * c;
    for (int col = blockIdx.x * blockDim.x + threadIdx.x; col < 2 * c; col += gridDim.x * blockDim.x) {
        float v = product_value(tmp, rows, r, c + col, 3 * c, split_in) + load1(bias + c + col);
        if (col < c) kv_put(kc + col, v);
        else kv_put(vc + col - c, v);
    }
}
extern "C" __global__ void batch_append_kv_f32(const float* tmp, const float* bias, int split_in,
                                               const int* positions, const unsigned long long* k_caches,
                                               const unsigned long long* v_caches, long long layer_off, int c,
                                               int rows) {
    batch_append_kv_impl(tmp, bias, split_in, positions, k_caches, v_caches, layer_off, c, rows);
}
extern "C" __global__ void batch_append_kv_bf16(const float* tmp, const bf16_t* bias, int split_in,
                                                const int* positions, const unsigned long long* k_caches,
                                                const unsigned long long* v_caches, long long layer_off, int c,
                                                int rows) {
    batch_append_kv_impl(tmp, bias, split_in, positions, k_caches, v_caches, layer_off, c, rows);
}

// Block (h, r): the row's spans (`ba_row_spans` of the grid's `splits`) rescaled by
// exp(max_span - max) and normalised, into `out` as a product input (f32, or split). A row of
// one span (a padding row too) was written by its attention block, and so was a row of a tile
// (`tiled[r]` != 0, when given).
extern "C" __global__ void __launch_bounds__(ATT_THREADS)
    batch_attention_combine(void* out, const float* partial, const int* positions, int hd, int c, int rows,
                            int splits, int split, int span_len, const int* tiled) {
    pdl_launch_dependents();
    pdl_wait();
    int h = blockIdx.x, r = blockIdx.y;
    if (tiled != nullptr && tiled[r] != 0) return;
    int spans = ba_row_spans(positions[r] + 1, splits, span_len);
    if (spans == 1) return;
    const float* base = partial + ((size_t)r * gridDim.x + h) * splits * (hd + 2);
    float m = -INFINITY;
    for (int s = 0; s < spans; s++) m = fmaxf(m, base[(size_t)s * (hd + 2)]);
    float denom = 0.0f;
    for (int s = 0; s < spans; s++) {
        float ms = base[(size_t)s * (hd + 2)];
        if (ms != -INFINITY) denom += __expf(ms - m) * base[(size_t)s * (hd + 2) + 1];
    }
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        float acc = 0.0f;
        for (int s = 0; s < spans; s++) {
            float ms = base[(size_t)s * (hd + 2)];
            if (ms != -INFINITY) acc += __expf(ms - m) * base[(size_t)s * (hd + 2) + 2 + d];
        }
        store_act(out, rows, r, h * hd + d, c, acc / denom, split);
    }
}

// The tokens of rows launched before the pass that picks them had ended: tokens[r] = the id of
// keys[feeds[r]] (the argmax key `batch_logits` left for that row of the pass before, still in
// `keys` until this pass's embedding clears them), for each row with 0 <= feeds[r] < max_rows.
// One thread a row, before the pass and after the one it reads.
extern "C" __global__ void __launch_bounds__(256)
    batch_feed(int* tokens, const int* feeds, const unsigned long long* keys, int rows, int max_rows, int v) {
    pdl_wait();
    int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= rows) return;
    int f = feeds[r];
    if (f < 0 || f >= max_rows) return;
    unsigned long long key = keys[f];
    u32 id = key == 0ull ? 0u : 0xffffffffu - (u32)key;
    tokens[r] = id < (u32)v ? (int)id : 0;
}

// The LM head's rows (`tmp`, `[rows or 2 * rows, ld]`, ld >= V) into each row's logits
// buffer (`dst[r]`, V floats), and their argmax into keys[r] (cleared by the embedding; see
// `argmax_key`). Grid (column blocks, rows); a padding row is skipped. A thread takes BL_PER
// columns (defined by the host), the grid's width apart, their loads all issued before the
// first store (a store may alias a later load, which would otherwise wait for it); each value
// is summed as `product_value` sums it.
extern "C" __global__ void __launch_bounds__(256, 4)
    batch_logits(const float* tmp, int rows, int split, int v, int ld, const int* positions,
                 const unsigned long long* dst, unsigned long long* keys) {
    pdl_launch_dependents();
    pdl_wait();
    int r = blockIdx.y;
    if (positions[r] < 0 || dst[r] == 0ull) return;  // padding, or a prompt row before its last
    float* o = reinterpret_cast<float*>(dst[r]);
    const float* hi_row = tmp + (size_t)r * ld;
    const float* lo_row = tmp + (size_t)(rows + r) * ld;
    int stride = gridDim.x * blockDim.x;
    unsigned long long best = 0ull;
    for (int first = blockIdx.x * blockDim.x + threadIdx.x; first < v; first += BL_PER * stride) {
        float hi[BL_PER], lo[BL_PER];
#pragma unroll
        for (int i = 0; i < BL_PER; i++) {
            int col = first + i * stride;
            hi[i] = col < v ? hi_row[col] : 0.0f;
            lo[i] = col < v && split ? lo_row[col] : 0.0f;
        }
#pragma unroll
        for (int i = 0; i < BL_PER; i++) {
            int col = first + i * stride;
            if (col >= v) break;
            float value = 0.0f;
            value += hi[i];
            if (split) value += lo[i];
            o[col] = value;
            unsigned long long key = argmax_key(value, col);
            best = key > best ? key : best;
        }
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
        unsigned long long other = __shfl_xor_sync(0xffffffffu, best, off);
        best = other > best ? other : best;
    }
    if ((threadIdx.x & 31) == 0 && best != 0ull) atomicMax(keys + r, best);
}

// The batched step's products in bf16 mode, on tensor cores: out[r, :] = (a[r] + a[rows + r]) x
// w^T, where `a` is a split input ([2 * rows, K] bf16, hi rows then lo rows, see `store_act`) and
// w is [N, K] as stored (one row per output). The hi and lo rows' products are summed here, so the
// next kernel reads one value per K slice where cuBLAS's result leaves it two.
//
// A block takes BG_STREAMS rows and 8 * WN columns; each of its 8 warps 8 rows, as a 16-row mma
// strip whose rows 0-7 are the rows' hi halves and 8-15 their lo halves, so each thread ends with
// a row's hi and lo partial sums in the same registers. K goes through shared memory in stages of
// BG_BK (cp.async, BG_STAGES - 1 in flight); the weights of the first stages are fetched before
// the wait on the previous kernel, as they do not depend on it.
//
// K is cut into `slices` slices of whole stages, and a row's result is the sum, in slice order,
// of its slices' sums: the same bits for a row whatever the other rows of the product, however
// many (the batched step's products are batch-invariant). The grid's x is (plane, row tile),
// row tiles next to each other; a block covers K / planes of K (planes is 1 or `slices`); the
// `_fold` kernels fold each slice's sum into a total as the slice ends, for several slices a
// block. Plane z goes to `out` (`[planes, rows, N]`), and the consumer adds the planes in order
// (`product_value`): the same additions either way, no atomics and no wait on other blocks.
#define BG_STREAMS 64
#define BG_BK 64
#define BG_STAGES 4
#define BG_THREADS 256

// A tile row in shared memory: BG_BK elements, 128 bytes, its 16-byte chunks swizzled: logical
// chunk c of tile row r sits at chunk c ^ (r & 7). The eight rows an ldmatrix phase reads at one
// chunk then lie in eight different bank groups, and a copy's 8 lanes fill one whole aligned
// 128-byte row (padded rows, 144 bytes apart, gave each copy 1.5x its sectors from L2 and 2.6x
// its shared-memory wavefronts under ncu).
typedef unsigned short bg_row_t[BG_BK];
__device__ __forceinline__ int bg_col(int row, int chunk) { return (chunk ^ (row & 7)) * 8; }

template <int WN, bool FOLD>
__device__ __forceinline__ void batch_gemm_impl(float* out, const bf16_t* a, const bf16_t* w, int rows, int n,
                                                int k, int slices) {
    constexpr int BN = 8 * WN;
    constexpr int CH = BG_BK / 8;                            // 16-byte pieces of a row's stage
    constexpr int A_PER = 2 * BG_STREAMS * CH / BG_THREADS;  // a thread's pieces of a stage
    constexpr int W_PER = BN * CH / BG_THREADS;
    static_assert(A_PER * BG_THREADS == 2 * BG_STREAMS * CH && W_PER * BG_THREADS == BN * CH,
                  "a stage's copies spread evenly over the threads");
    constexpr int ROW_STEP = BG_THREADS / CH;                // tile rows between a thread's pieces
    static_assert(ROW_STEP % 8 == 0, "a thread's pieces share their rows' swizzle");
    extern __shared__ __align__(16) unsigned char bg_smem[];
    bg_row_t* as = reinterpret_cast<bg_row_t*>(bg_smem);  // [BG_STAGES][2 * BG_STREAMS]
    bg_row_t* ws = as + BG_STAGES * 2 * BG_STREAMS;      // [BG_STAGES][BN]
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    // blockIdx.x: the plane, then the row tile (row tiles next to each other share weights)
    int row_tiles = (rows + BG_STREAMS - 1) / BG_STREAMS, z = blockIdx.x / row_tiles;
    int planes = gridDim.x / row_tiles, col0 = blockIdx.y * BN, s0 = (blockIdx.x % row_tiles) * BG_STREAMS;
    int span = k / planes, k0 = z * span, stages = span / BG_BK;
    int fold = k / slices / BG_BK;  // stages of one slice
    // A thread copies the same pieces at every stage: piece ch of tile rows r, r + ROW_STEP, ...
    // Tile row 16 * wp + q of the input holds row s0 + 8 * wp + (q & 7)'s hi half (q < 8) or
    // lo half, zeros past `rows`; the weights' tile row r is output column col0 + r.
    int ch = (threadIdx.x % CH) * 8, r0 = threadIdx.x / CH, sw = bg_col(r0, ch / 8);
    const bf16_t* w_src[W_PER];
#pragma unroll
    for (int u = 0; u < W_PER; ++u) w_src[u] = w + (size_t)(col0 + r0 + u * ROW_STEP) * k + k0 + ch;
    auto load_w = [&](int s) {
        bg_row_t* dst = ws + (s % BG_STAGES) * BN;
#pragma unroll
        for (int u = 0; u < W_PER; ++u)
            cp_async16(&dst[r0 + u * ROW_STEP][sw], w_src[u] + s * BG_BK, true);
    };
    pdl_launch_dependents();
    for (int s = 0; s < BG_STAGES - 1; ++s)
        if (s < stages) load_w(s);
    pdl_wait();
    const bf16_t* a_src[A_PER];
    bool a_ok[A_PER];
#pragma unroll
    for (int u = 0; u < A_PER; ++u) {
        int tr = r0 + u * ROW_STEP, q = tr & 15, row = s0 + 8 * (tr >> 4) + (q & 7);
        a_ok[u] = row < rows;
        a_src[u] = a + (size_t)(a_ok[u] ? (q < 8 ? row : rows + row) : 0) * k + k0 + ch;
    }
    auto load_a = [&](int s) {
        bg_row_t* dst = as + (s % BG_STAGES) * 2 * BG_STREAMS;
#pragma unroll
        for (int u = 0; u < A_PER; ++u) cp_async16(&dst[r0 + u * ROW_STEP][sw], a_src[u] + s * BG_BK, a_ok[u]);
    };
    for (int s = 0; s < BG_STAGES - 1; ++s) {
        if (s < stages) load_a(s);
        cp_async_commit();
    }
    // without FOLD a block's span is one slice (planes == slices, or one slice in all)
    float acc[WN][4], total[FOLD ? WN : 1][2];
#pragma unroll
    for (int j = 0; j < WN; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
#pragma unroll
    for (int j = 0; j < (FOLD ? WN : 1); ++j) total[j][0] = total[j][1] = 0.0f;
    for (int s = 0; s < stages; ++s) {
        // stage s has landed (BG_STAGES - 1 + s groups committed, at most BG_STAGES - 2 pending),
        // and every warp is done with stage s - 1, whose buffers the next load takes
        cp_async_wait<BG_STAGES - 2>();
        __syncthreads();
        int next = s + BG_STAGES - 1;
        if (next < stages) {
            load_w(next);
            load_a(next);
        }
        cp_async_commit();
        const bg_row_t* at = as + (s % BG_STAGES) * 2 * BG_STREAMS;
        const bg_row_t* wt = ws + (s % BG_STAGES) * BN;
#pragma unroll
        for (int kk = 0; kk < BG_BK; kk += 16) {
            u32 af[4];
            // the strip's rows 0-7 / 8-15, columns kk / kk + 8
            int ar = warp * 16 + (lane & 15);
            ldmatrix_x4(af, &at[ar][bg_col(ar, kk / 8 + (lane >> 4))]);
#pragma unroll
            for (int j = 0; j < WN; j += 2) {
                u32 bf[4];
                // outputs 8j..8j+7 then 8j+8..8j+15, each at k kk and kk + 8
                int br = j * 8 + (lane & 7) + ((lane >> 4) << 3);
                ldmatrix_x4(bf, &wt[br][bg_col(br, kk / 8 + ((lane >> 3) & 1))]);
                mma_bf16_16816(acc[j], af, bf[0], bf[1]);
                mma_bf16_16816(acc[j + 1], af, bf[2], bf[3]);
            }
        }
        if (FOLD && (s + 1) % fold == 0) {
            // a slice ends: its sum (hi and lo) joins the total, as the consumer adds planes
#pragma unroll
            for (int j = 0; j < (FOLD ? WN : 1); ++j) {
                total[j][0] += acc[j][0] + acc[j][2];
                total[j][1] += acc[j][1] + acc[j][3];
                acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
            }
        }
    }
    // thread (g, t) holds row s0 + 8 * warp + g: its hi sums in acc[j][0..1], its lo sums in
    // acc[j][2..3], folded into total[j][0..1], at columns 8j + 2t and 8j + 2t + 1
    int g = lane >> 2, t = lane & 3, row = s0 + warp * 8 + g;
    if (row >= rows) return;
    float* plane = out + (size_t)z * rows * n + (size_t)row * n + col0 + 2 * t;
#pragma unroll
    for (int j = 0; j < WN; ++j) {
        // one slice: 0 + (hi + lo), as a fold would give
        float2 v = FOLD ? make_float2(total[j][0], total[j][1])
                        : make_float2(acc[j][0] + acc[j][2], acc[j][1] + acc[j][3]);
        *reinterpret_cast<float2*>(plane + j * 8) = v;
    }
}

extern "C" __global__ void __launch_bounds__(BG_THREADS, 2)
    batch_gemm_bf16_n64(float* out, const bf16_t* a, const bf16_t* w, int rows, int n, int k, int slices) {
    batch_gemm_impl<8, false>(out, a, w, rows, n, k, slices);
}
extern "C" __global__ void __launch_bounds__(BG_THREADS, 2)
    batch_gemm_bf16_n32(float* out, const bf16_t* a, const bf16_t* w, int rows, int n, int k, int slices) {
    batch_gemm_impl<4, false>(out, a, w, rows, n, k, slices);
}
extern "C" __global__ void __launch_bounds__(BG_THREADS, 2)
    batch_gemm_bf16_n64_fold(float* out, const bf16_t* a, const bf16_t* w, int rows, int n, int k, int slices) {
    batch_gemm_impl<8, true>(out, a, w, rows, n, k, slices);
}
extern "C" __global__ void __launch_bounds__(BG_THREADS, 2)
    batch_gemm_bf16_n32_fold(float* out, const bf16_t* a, const bf16_t* w, int rows, int n, int k, int slices) {
    batch_gemm_impl<4, true>(out, a, w, rows, n, k, slices);
}
