// Token + position embedding, and LayerNorm over rows.
#include "common.cuh"

// x[t, :] = wte[tokens[t], :] + wpe[start + t, :]. `start` is read from device memory
// (`pos_ptr`) when `start < 0`, so a captured decode graph serves every position.
template <typename W>
__device__ void embed_impl(float* x, const int* tokens, const W* wte, const W* wpe, int c, int start,
                           const int* pos_ptr) {
    pdl_launch_dependents();
    pdl_wait();
    int t = blockIdx.x;
    int pos = (start < 0 ? *pos_ptr : start) + t;
    int tok = tokens[t];
    for (int i = threadIdx.x; i < c; i += blockDim.x)
        x[(size_t)t * c + i] = load1(wte + (size_t)tok * c + i) + load1(wpe + (size_t)pos * c + i);
}
extern "C" __global__ void embed_f32(float* x, const int* tokens, const float* wte, const float* wpe, int c,
                                     int start, const int* pos_ptr) {
    embed_impl(x, tokens, wte, wpe, c, start, pos_ptr);
}
extern "C" __global__ void embed_bf16(float* x, const int* tokens, const bf16_t* wte, const bf16_t* wpe, int c,
                                      int start, const int* pos_ptr) {
    embed_impl(x, tokens, wte, wpe, c, start, pos_ptr);
}

// out[r, :] = LayerNorm(in[r, :]) * w + b, eps 1e-5, one block per row.
template <typename W>
__device__ void layernorm_impl(float* out, const float* in, const W* w, const W* b, int c) {
    __shared__ float scratch[32];
    pdl_launch_dependents();
    pdl_wait();
    const float* x = in + (size_t)blockIdx.x * c;
    float s = 0.0f;
    for (int i = threadIdx.x; i < c; i += blockDim.x) s += x[i];
    float mean = block_sum(s, scratch) / c;
    float v = 0.0f;
    for (int i = threadIdx.x; i < c; i += blockDim.x) { float d = x[i] - mean; v += d * d; }
    float rstd = rsqrtf(block_sum(v, scratch) / c + 1e-5f);
    for (int i = threadIdx.x; i < c; i += blockDim.x)
        out[(size_t)blockIdx.x * c + i] = (x[i] - mean) * rstd * load1(w + i) + load1(b + i);
}
extern "C" __global__ void layernorm_f32(float* out, const float* in, const float* w, const float* b, int c) {
    layernorm_impl(out, in, w, b, c);
}
extern "C" __global__ void layernorm_bf16(float* out, const float* in, const bf16_t* w, const bf16_t* b, int c) {
    layernorm_impl(out, in, w, b, c);
}
