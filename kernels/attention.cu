// Causal attention over the KV cache (f32, [n_ctx, C] per layer, head h at columns h*hd..).
//
// Decode (one query) is split across blocks (flash-decoding): block (h, chunk) scores its
// ATT_CHUNK positions, keeps its max, sum of exponentials and weighted sum of values; a second
// kernel combines the chunks. The position comes from device memory so a captured graph
// serves every step; chunks past the sequence write an empty partial.
// Prefill: one block per (head, query row), scores in shared memory.
#include "common.cuh"

#define ATT_CHUNK 64
#define MAX_HD 128

// partial layout per (h, chunk): [max, sum, out[hd]]
extern "C" __global__ void attention_decode_partial(float* partial, const float* q, const float* k_cache,
                                                    const float* v_cache, const int* pos_ptr, int c, int hd,
                                                    int max_chunks) {
    __shared__ float qs[MAX_HD];
    __shared__ float p[ATT_CHUNK];
    __shared__ float scratch[32];
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
    // one thread per position
    float s = -INFINITY;
    if (threadIdx.x < count) {
        const float* kr = k_cache + (size_t)(first + threadIdx.x) * c + h * hd;
        float acc = 0.0f;
        for (int d = 0; d < hd; d += 4) {
            float4 kv = *reinterpret_cast<const float4*>(kr + d);
            acc += kv.x * qs[d] + kv.y * qs[d + 1] + kv.z * qs[d + 2] + kv.w * qs[d + 3];
        }
        s = acc * scale;
    }
    float m = block_max(s, scratch);
    float e = threadIdx.x < count ? __expf(s - m) : 0.0f;
    if (threadIdx.x < ATT_CHUNK) p[threadIdx.x] = e;
    float sum = block_sum(e, scratch);
    __syncthreads();
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        float acc = 0.0f;
        for (int j = 0; j < count; j++) acc += p[j] * v_cache[(size_t)(first + j) * c + h * hd + d];
        part[2 + d] = acc;
    }
    if (threadIdx.x == 0) { part[0] = m; part[1] = sum; }
}

extern "C" __global__ void attention_decode_combine(float* out, const float* partial, const int* pos_ptr, int hd,
                                                    int max_chunks) {
    int h = blockIdx.x;
    int chunks = (*pos_ptr + 1 + ATT_CHUNK - 1) / ATT_CHUNK;
    const float* base = partial + (size_t)h * max_chunks * (hd + 2);
    float m = -INFINITY;
    for (int i = 0; i < chunks; i++) m = fmaxf(m, base[(size_t)i * (hd + 2)]);
    float denom = 0.0f;
    for (int i = 0; i < chunks; i++) denom += base[(size_t)i * (hd + 2) + 1] * __expf(base[(size_t)i * (hd + 2)] - m);
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        float acc = 0.0f;
        for (int i = 0; i < chunks; i++) {
            const float* part = base + (size_t)i * (hd + 2);
            acc += part[2 + d] * __expf(part[0] - m);
        }
        out[h * hd + d] = acc / denom;
    }
}

// Prefill: q rows in qkv [rows, 3C] (q = first C columns), row t at position start + t.
// Grid (n_head, rows); dynamic shared memory holds start + rows scores.
extern "C" __global__ void attention_prefill(float* out, const float* qkv, const float* k_cache,
                                             const float* v_cache, int start, int c, int hd) {
    extern __shared__ float scores[];
    __shared__ float qs[MAX_HD];
    __shared__ float scratch[32];
    int h = blockIdx.x, t = blockIdx.y;
    int len = start + t + 1;
    float scale = rsqrtf((float)hd);
    for (int d = threadIdx.x; d < hd; d += blockDim.x) qs[d] = qkv[(size_t)t * 3 * c + h * hd + d];
    __syncthreads();
    float m = -INFINITY;
    for (int j = threadIdx.x; j < len; j += blockDim.x) {
        const float* kr = k_cache + (size_t)j * c + h * hd;
        float acc = 0.0f;
        for (int d = 0; d < hd; d += 4) {
            float4 kv = *reinterpret_cast<const float4*>(kr + d);
            acc += kv.x * qs[d] + kv.y * qs[d + 1] + kv.z * qs[d + 2] + kv.w * qs[d + 3];
        }
        scores[j] = acc * scale;
        m = fmaxf(m, acc * scale);
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
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        float acc = 0.0f;
        for (int j = 0; j < len; j++) acc += scores[j] * v_cache[(size_t)j * c + h * hd + d];
        out[(size_t)t * c + h * hd + d] = acc / sum;
    }
}
