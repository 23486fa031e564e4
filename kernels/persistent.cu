// The decode step of one sequence as one persistent kernel (sm_90): the layers' products, the
// attention and the LM head run as phases of one grid of one block per SM, with a counter in
// global memory between phases instead of kernel boundaries.
//
// Each block owns a fixed share of every product's rows. Its loader warp streams those rows,
// in the order the phases use them, through a ring of shared-memory slots with bulk copies
// (cp.async.bulk, completing on an mbarrier per slot), refilling a slot as soon as the block's
// compute warps release it. The weights depend on nothing the step computes, so the copies run
// ahead across phase boundaries: while the grid waits at the counter, the next phases' weights
// are already arriving. The compute warps stage the phase's input vector (LayerNorm-ed where
// the phase has one) from L2, take the rows slot by slot, and write the phase's outputs.
//
// Phases of a layer: QKV (LayerNorm 1, the product, q out, k and v into the cache at the
// position), attention (blocks take (head, span of positions) items and write partial sums),
// projection (the items' partials combined into the attention output, the product, residual
// add), FC (LayerNorm 2, the product, GELU), FC projection (residual add). Then the LM head
// (final LayerNorm) with its argmax key, as `matvec.cu`'s.
//
// PD_WARPS (compute warps a block; one loader warp more) and PD_MAX_SPLITS (a head's
// attention items at most, <= 32) come from the host (host/src/cuda/ops/persistent.rs) as -D
// defines, as do the argument layout's users there.

#define PD_THREADS (PD_WARPS * 32)
#define PD_MAX_SLOTS 32

// One layer's pointers, in the order the host writes them (`LAYER_POINTERS`).
struct PdLayer {
    const void* ln1_w;
    const void* ln1_b;
    const void* qkv_w;
    const void* qkv_b;
    const void* proj_w;
    const void* proj_b;
    const void* ln2_w;
    const void* ln2_b;
    const void* fc_w;
    const void* fc_b;
    const void* fcp_w;
    const void* fcp_b;
    void* k_cache;
    void* v_cache;
};

// The step's arguments, laid out as the host's `PdArgs` (#[repr(C)]).
struct PdArgs {
    const PdLayer* layers;  // [n_layer]
    const void* wte;        // the LM head [vocab, c]
    const void* lnf_w;
    const void* lnf_b;
    float* x;             // the residual stream [c] (the embedding's output)
    float* q;             // [c]
    float* fc;            // [4c]
    float* partials;      // [n_head * max_splits * (hd + 2)]
    float* logits;        // [vocab]
    unsigned long long* best;  // the argmax key, cleared by the embedding kernel
    const int* pos_ptr;   // the position (ids[0])
    unsigned int* counter;  // phases done times blocks; zeroed before the launch
    unsigned long long* trace;  // null, or [phases][PD_TRACE] (see `pd_trace`)
    int n_layer, c, n_head, vocab;
    int slot_bytes, slots, max_splits, xs_floats, vals_floats;
};

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
__device__ __forceinline__ void mbar_init(unsigned long long* bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(unsigned long long* bar) {
    asm volatile("{ .reg .b64 s; mbarrier.arrive.shared::cta.b64 s, [%0]; }" ::"r"(smem_addr(bar)) : "memory");
}
__device__ __forceinline__ void mbar_expect(unsigned long long* bar, u32 bytes) {
    asm volatile("{ .reg .b64 s; mbarrier.arrive.expect_tx.shared::cta.b64 s, [%0], %1; }" ::"r"(smem_addr(bar)),
                 "r"(bytes)
                 : "memory");
}
__device__ __forceinline__ void mbar_wait(unsigned long long* bar, u32 parity) {
    u32 done = 0;
    while (!done) {
        asm volatile(
            "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
            : "=r"(done)
            : "r"(smem_addr(bar)), "r"(parity)
            : "memory");
    }
}
// `bytes` (a multiple of 16, both addresses 16-byte aligned) global -> shared, counted on `bar`.
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, u32 bytes, unsigned long long* bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                     smem_addr(dst)),
                 "l"(src), "r"(bytes), "r"(smem_addr(bar))
                 : "memory");
}
// Loads through L2 only: what other blocks wrote during this kernel is not in this SM's L1.
__device__ __forceinline__ float4 ldcg4(const float* p) {
    float4 v;
    asm volatile("ld.global.cg.v4.f32 {%0, %1, %2, %3}, [%4];" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "l"(p));
    return v;
}
__device__ __forceinline__ float ldcg1(const float* p) {
    float v;
    asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p));
    return v;
}
__device__ __forceinline__ uint4 ldcg_u4(const void* p) {
    uint4 v;
    asm volatile("ld.global.cg.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}
// Eight cached keys or values (16-byte aligned) as f32, read through L2.
__device__ __forceinline__ void pd_kv8(const kv16_t* p, float out[8]) { f16x8_to_f32(ldcg_u4(p), out); }
__device__ __forceinline__ void pd_kv8(const float* p, float out[8]) {
    float4 a = ldcg4(p), b = ldcg4(p + 4);
    out[0] = a.x; out[1] = a.y; out[2] = a.z; out[3] = a.w;
    out[4] = b.x; out[5] = b.y; out[6] = b.z; out[7] = b.w;
}
__device__ __forceinline__ float4 pd_kv4(const kv16_t* p) {
    uint2 u;
    asm volatile("ld.global.cg.v2.u32 {%0, %1}, [%2];" : "=r"(u.x), "=r"(u.y) : "l"(p));
    float2 a = f16x2_to_f32(u.x), b = f16x2_to_f32(u.y);
    return make_float4(a.x, a.y, b.x, b.y);
}
__device__ __forceinline__ float4 pd_kv4(const float* p) { return ldcg4(p); }

// A barrier over the compute warps alone (the loader warp never joins).
__device__ __forceinline__ void pd_sync() { asm volatile("bar.sync 1, %0;" ::"n"(PD_THREADS) : "memory"); }
__device__ __forceinline__ float pd_sum(float v, float* red) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_sum(v);
    pd_sync();
    if (lane == 0) red[warp] = v;
    pd_sync();
    return warp_sum(lane < PD_WARPS ? red[lane] : 0.0f);
}
__device__ __forceinline__ float pd_max(float v, float* red) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_max(v);
    pd_sync();
    if (lane == 0) red[warp] = v;
    pd_sync();
    return warp_max(lane < PD_WARPS ? red[lane] : -INFINITY);
}

// The grid's phases: a block's outputs of a phase are written before it counts the phase done
// (release); a block starts the next phase once the count has every block's (acquire), one
// thread a block polling. (A flag a block, each polled by its own thread, was slower.) A wait
// past two seconds traps rather than hang the GPU: a trap ends the whole CUDA context, every
// session on this GPU with it, so it is there for a bug, not as flow control.
__device__ __forceinline__ void grid_arrive(unsigned int* counter) {
    pd_sync();
    if (threadIdx.x == 0) {
        __threadfence();
        asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(counter) : "memory");
    }
}
__device__ __forceinline__ void grid_wait(const unsigned int* counter, unsigned int target) {
    if (threadIdx.x == 0) {
        unsigned long long start, now;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
        for (;;) {
            unsigned int seen;
            asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(seen) : "l"(counter) : "memory");
            if (seen >= target) break;
            asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
            if (now - start > 2000000000ull) __trap();
        }
    }
    pd_sync();
}
__device__ __forceinline__ unsigned long long pd_now() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
// With a trace buffer, for each phase (ns, the GPU's global timer): when block 0 started it
// (its wait over), had its input staged (the attention: its scores), had its products done
// (the attention: its weighted values), finished it; and when the last block finished it.
#define PD_TRACE 5
enum { PD_START, PD_STAGED, PD_COMPUTED, PD_DONE, PD_LAST };
__device__ __forceinline__ void pd_trace(const PdArgs& a, unsigned int phase, int what) {
    if (a.trace == nullptr || threadIdx.x != 0) return;
    unsigned long long t = pd_now();
    if (what == PD_LAST) atomicMax(a.trace + phase * PD_TRACE + PD_LAST, t);
    else if (blockIdx.x == 0) a.trace[phase * PD_TRACE + what] = t;
}

// This block's share [r0, r1) of n rows.
__device__ __forceinline__ int2 pd_rows(int n) {
    long long g = gridDim.x, b = blockIdx.x;
    return make_int2((int)(b * n / g), (int)((b + 1) * n / g));
}

// Rows of `row_bytes` a slot takes (the host makes a slot hold at least the longest row).
__device__ __forceinline__ int pd_per_slot(const PdArgs& a, int row_bytes) {
    return max(1, a.slot_bytes / row_bytes);
}

// The loader: every product's rows of this block, phase after phase, through the ring.
template <typename W>
__device__ void pd_load(const PdArgs& a, unsigned char* ring, unsigned long long* full, unsigned long long* empty) {
    if ((threadIdx.x & 31) != 0) return;
    int c = a.c, seq = 0;
    auto stream = [&](const void* w, int n, int k) {
        int2 r = pd_rows(n);
        int row_bytes = k * (int)sizeof(W), per = pd_per_slot(a, row_bytes);
        for (int row = r.x; row < r.y; row += per, seq++) {
            int rows = min(per, r.y - row), slot = seq % a.slots, round = seq / a.slots;
            if (round > 0) mbar_wait(&empty[slot], (round - 1) & 1);
            u32 bytes = (u32)(rows * row_bytes);
            mbar_expect(&full[slot], bytes);
            bulk_copy(ring + (size_t)slot * a.slot_bytes, static_cast<const char*>(w) + (size_t)row * row_bytes,
                      bytes, &full[slot]);
        }
    };
    for (int l = 0; l < a.n_layer; l++) {
        const PdLayer& L = a.layers[l];
        stream(L.qkv_w, 3 * c, c);
        stream(L.proj_w, c, c);
        stream(L.fc_w, 4 * c, c);
        stream(L.fcp_w, c, 4 * c);
    }
    stream(a.wte, a.vocab, c);
}

// Segments a row of k is split into when the block's rows of a product come `rows` at a time:
// enough (row, segment) items for every warp where the rows are fewer, segments a multiple of
// 256 elements (a warp's step). The host's `product_values` mirrors it.
__device__ __forceinline__ int pd_seg_len(int rows, int k) {
    int segs = max(1, PD_WARPS / max(1, rows));
    return (((k + segs - 1) / segs) + 255) / 256 * 256;
}

// The compute warps' side of the ring: the block's rows of one product against xs[0..k), then
// `epi(row, value)` for each, every row at once after the last slot; the value is the sum plus
// `bias` where given, and `resid`'s element plus that where given. Each
// (row, segment) item is a warp's, its sum kept in `vals`; one thread a row adds its segments
// in order, so the result does not depend on which warp took which item.
template <typename W, typename Epi>
__device__ void pd_product(const PdArgs& a, int n, int k, int& seq, const float* xs, const unsigned char* ring,
                           unsigned long long* full, unsigned long long* empty, float* vals, const W* bias,
                           const float* resid, unsigned int phase, Epi epi) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int2 r = pd_rows(n);
    // the epilogue's inputs, asked for now: they are there when the last slot is done
    int mine = r.x + threadIdx.x;
    float my_bias = bias != nullptr && mine < r.y ? load1(bias + mine) : 0.0f;
    float my_resid = resid != nullptr && mine < r.y ? ldcg1(resid + mine) : 0.0f;
    int row_bytes = k * (int)sizeof(W), per = pd_per_slot(a, row_bytes);
    int seg_len = pd_seg_len(min(per, r.y - r.x), k), segs = (k + seg_len - 1) / seg_len;
    if ((r.y - r.x) * segs > a.vals_floats) __trap();  // the host sized vals for every product
    for (int row = r.x; row < r.y; row += per, seq++) {
        int rows = min(per, r.y - row), slot = seq % a.slots;
        mbar_wait(&full[slot], (seq / a.slots) & 1);
        const W* w = reinterpret_cast<const W*>(ring + (size_t)slot * a.slot_bytes);
        float* out = vals + (row - r.x) * segs;
        for (int item = warp; item < rows * segs; item += PD_WARPS) {
            int i = item / segs, s = item % segs;
            const W* wr = w + (size_t)i * k;
            int end = min(k, (s + 1) * seg_len);
            float acc = 0.0f;
            for (int e = s * seg_len + lane * 8; e < end; e += 256) {
                float wv[8];
                load8(wr + e, wv);
                float4 x0 = *reinterpret_cast<const float4*>(xs + e);
                float4 x1 = *reinterpret_cast<const float4*>(xs + e + 4);
                acc += wv[0] * x0.x + wv[1] * x0.y + wv[2] * x0.z + wv[3] * x0.w;
                acc += wv[4] * x1.x + wv[5] * x1.y + wv[6] * x1.z + wv[7] * x1.w;
            }
            acc = warp_sum(acc);
            if (lane == 0) out[item] = acc;
        }
        __syncwarp();
        if (lane == 0) mbar_arrive(&empty[slot]);
    }
    pd_sync();
    pd_trace(a, phase, PD_COMPUTED);
    for (int t = threadIdx.x; t < r.y - r.x; t += PD_THREADS) {
        float v = 0.0f;
        for (int s = 0; s < segs; s++) v += vals[t * segs + s];
        bool first = t == (int)threadIdx.x;
        if (bias != nullptr) v += first ? my_bias : load1(bias + r.x + t);
        if (resid != nullptr) v = (first ? my_resid : ldcg1(resid + r.x + t)) + v;
        epi(r.x + t, v);
    }
}

// xs[0..k) = LayerNorm(x) (k <= 4 * PD_THREADS) or x, read through L2.
template <typename W>
__device__ void pd_stage(float* xs, const float* x, int k, const W* ln_w, const W* ln_b, float* red) {
    int t = threadIdx.x;
    if (ln_w == nullptr) {
        for (int i = t * 4; i < k; i += PD_THREADS * 4) *reinterpret_cast<float4*>(xs + i) = ldcg4(x + i);
        pd_sync();
        return;
    }
    int i = t * 4;
    bool mine = i < k;
    // the LayerNorm's weights asked for with x: one round trip
    float4 g = make_float4(0.0f, 0.0f, 0.0f, 0.0f), b = g;
    if (mine) {
        g = load4(ln_w + i);
        b = load4(ln_b + i);
    }
    float4 v = mine ? ldcg4(x + i) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    float mean = pd_sum(v.x + v.y + v.z + v.w, red) / k;
    float4 d = make_float4(v.x - mean, v.y - mean, v.z - mean, v.w - mean);
    float var = pd_sum(mine ? d.x * d.x + d.y * d.y + d.z * d.z + d.w * d.w : 0.0f, red) / k;
    float rstd = rsqrtf(var + 1e-5f);
    if (mine) {
        *reinterpret_cast<float4*>(xs + i) =
            make_float4(d.x * rstd * g.x + b.x, d.y * rstd * g.y + b.y, d.z * rstd * g.z + b.z, d.w * rstd * g.w + b.w);
    }
    pd_sync();
}

// Splits of the positions a head's attention takes at length `len` (the attention and the
// projection phases agree on it).
__device__ __forceinline__ int pd_splits(int len, int max_splits) { return max(1, min(max_splits, (len + 63) / 64)); }

// Attention items (head, span of positions), one block an item: the scores' max, their
// exponentials' sum, and the unnormalised weighted values into the item's partial row.
template <typename KV>
__device__ void pd_attention(const PdArgs& a, const KV* k_cache, const KV* v_cache, int pos, float* xs, float* red,
                             unsigned int phase) {
    int c = a.c, hd = c / a.n_head, len = pos + 1;
    int splits = pd_splits(len, a.max_splits), span = (len + splits - 1) / splits;
    // xs: q [hd], the scores [span], then the groups' weighted values [4 * PD_THREADS]
    float* qs = xs;
    float* scores = xs + hd;
    float* accs = scores + ((span + 3) & ~3);  // 16-byte aligned
    float scale = rsqrtf((float)hd);
    for (int item = blockIdx.x; item < a.n_head * splits; item += gridDim.x) {
        int h = item / splits, s = item % splits;
        int first = s * span, count = max(0, min(len, first + span) - first);
        for (int d = threadIdx.x; d < hd; d += PD_THREADS) qs[d] = ldcg1(a.q + h * hd + d);
        pd_sync();
        // 4 threads a position, each hd/4 dimensions (hd a multiple of 32)
        int quarter = threadIdx.x & 3, dims = hd / 4;
        float m = -INFINITY;
        for (int j0 = 0; j0 < count; j0 += PD_THREADS / 4) {
            int j = j0 + (threadIdx.x >> 2);
            float sc = 0.0f;
            if (j < count) {
                const KV* kr = k_cache + (size_t)(first + j) * c + h * hd + quarter * dims;
                for (int e = 0; e < dims; e += 8) {
                    float kv[8];
                    pd_kv8(kr + e, kv);
#pragma unroll
                    for (int u = 0; u < 8; u++) sc += kv[u] * qs[quarter * dims + e + u];
                }
            }
            sc += __shfl_xor_sync(0xffffffffu, sc, 1);
            sc += __shfl_xor_sync(0xffffffffu, sc, 2);
            if (j < count) {
                sc *= scale;
                if (quarter == 0) scores[j] = sc;
                m = fmaxf(m, sc);
            }
        }
        m = pd_max(m, red);
        float sum = 0.0f;
        for (int j = threadIdx.x; j < count; j += PD_THREADS) {
            float e = __expf(scores[j] - m);
            scores[j] = e;
            sum += e;
        }
        sum = pd_sum(sum, red);  // (its barriers order the scores for every thread)
        pd_trace(a, phase, PD_STAGED);
        // weighted values: thread (d4, grp) takes dimensions 4*d4.. of positions grp, grp + groups, ...
        int quads = hd / 4, groups = PD_THREADS / quads;
        int d4 = threadIdx.x % quads, grp = threadIdx.x / quads;
        float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll 4
        for (int j = grp; j < count; j += groups) {
            float4 v = pd_kv4(v_cache + (size_t)(first + j) * c + h * hd + 4 * d4);
            float p = scores[j];
            acc.x += p * v.x; acc.y += p * v.y; acc.z += p * v.z; acc.w += p * v.w;
        }
        *reinterpret_cast<float4*>(accs + grp * hd + 4 * d4) = acc;
        pd_sync();
        pd_trace(a, phase, PD_COMPUTED);
        float* part = a.partials + (size_t)item * (hd + 2);
        for (int d = threadIdx.x; d < hd; d += PD_THREADS) {
            float t = 0.0f;
            for (int g = 0; g < groups; g++) t += accs[g * hd + d];
            part[2 + d] = t;
        }
        if (threadIdx.x == 0) {
            part[0] = m;
            part[1] = sum;
        }
        pd_sync();
    }
}

// This block's attention items' cached keys and values (the positions before `pos`, written
// by earlier steps) asked of L2 ahead of the phase.
template <typename KV>
__device__ void pd_attention_prefetch(const PdArgs& a, const KV* k_cache, const KV* v_cache, int pos) {
    int c = a.c, hd = c / a.n_head, len = pos + 1;
    int splits = pd_splits(len, a.max_splits), span = (len + splits - 1) / splits;
    int lines = (hd * (int)sizeof(KV) + 127) / 128;
    for (int item = blockIdx.x; item < a.n_head * splits; item += gridDim.x) {
        int h = item / splits, s = item % splits;
        int first = s * span, count = max(0, min(pos, first + span) - first);
        for (int i = threadIdx.x; i < 2 * count * lines; i += PD_THREADS) {
            int j = i / (2 * lines), part = i % (2 * lines);
            const KV* row = (part < lines ? k_cache : v_cache) + (size_t)(first + j) * c + h * hd;
            prefetch_l2(reinterpret_cast<const char*>(row) + (part % lines) * 128, 1, 0, 1);
        }
    }
}

// The attention output: each head's items' partials combined, into xs[0..c). A warp a head:
// its lanes read the items' max and sum at once, then each lane its dimensions of every
// item's values, all loaded before the sums, which run in item order (the same sums as one
// thread an element taking the items in turn).
__device__ void pd_combine(const PdArgs& a, int pos, float* xs) {
    int c = a.c, hd = c / a.n_head, lane = threadIdx.x & 31;
    int splits = pd_splits(pos + 1, a.max_splits);
    for (int h = threadIdx.x >> 5; h < a.n_head; h += PD_WARPS) {
        const float* part = a.partials + (size_t)h * splits * (hd + 2);
        const float* mine = part + (size_t)lane * (hd + 2);
        float m = lane < splits ? ldcg1(mine) : -INFINITY;
        float l = lane < splits ? ldcg1(mine + 1) : 0.0f;
        float mx = m;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
        float f = __expf(m - mx);  // 0 for an item without positions, and past the items
        for (int d = lane; d < hd; d += 32) {  // (hd a multiple of 32)
            float v[PD_MAX_SPLITS];
#pragma unroll
            for (int s = 0; s < PD_MAX_SPLITS; s++) v[s] = s < splits ? ldcg1(part + (size_t)s * (hd + 2) + 2 + d) : 0.0f;
            float num = 0.0f, den = 0.0f;
#pragma unroll
            for (int s = 0; s < PD_MAX_SPLITS; s++) {
                float fs = __shfl_sync(0xffffffffu, f, s), ls = __shfl_sync(0xffffffffu, l, s);
                if (s < splits) {
                    den += fs * ls;
                    num += fs * v[s];
                }
            }
            xs[h * hd + d] = num / den;
        }
    }
    pd_sync();
}

template <typename W>
__device__ void pd_compute(const PdArgs& a, unsigned char* ring, float* xs, unsigned long long* full,
                           unsigned long long* empty, float* red, float* vals,
                           unsigned long long* block_best) {
    typedef typename KvOf<W>::T KV;
    int c = a.c, pos = *a.pos_ptr, seq = 0;
    unsigned int phase = 0;
    pd_trace(a, phase, PD_START);
    auto next_phase = [&] {
        pd_trace(a, phase, PD_DONE);
        grid_arrive(a.counter);
        pd_trace(a, phase, PD_LAST);
        phase++;
        grid_wait(a.counter, phase * gridDim.x);
        pd_trace(a, phase, PD_START);
    };
    auto staged = [&] { pd_trace(a, phase, PD_STAGED); };
    for (int l = 0; l < a.n_layer; l++) {
        const PdLayer& L = a.layers[l];
        const W* qkv_b = static_cast<const W*>(L.qkv_b);
        KV* k_cache = static_cast<KV*>(L.k_cache);
        KV* v_cache = static_cast<KV*>(L.v_cache);
        // QKV: q out, the new key and value into the cache (as the cache keeps them)
        pd_attention_prefetch<KV>(a, k_cache, v_cache, pos);
        pd_stage(xs, a.x, c, static_cast<const W*>(L.ln1_w), static_cast<const W*>(L.ln1_b), red);
        staged();
        pd_product<W>(a, 3 * c, c, seq, xs, ring, full, empty, vals, qkv_b, nullptr, phase, [&](int o, float v) {
            if (o < c) a.q[o] = v;
            else if (o < 2 * c) kv_put(k_cache + (size_t)pos * c + (o - c), v);
            else kv_put(v_cache + (size_t)pos * c + (o - 2 * c), v);
        });
        next_phase();
        pd_attention<KV>(a, k_cache, v_cache, pos, xs, red, phase);
        next_phase();
        // projection: x += W h + b
        pd_combine(a, pos, xs);
        staged();
        const W* proj_b = static_cast<const W*>(L.proj_b);
        pd_product<W>(a, c, c, seq, xs, ring, full, empty, vals, proj_b, a.x, phase,
                      [&](int o, float v) { a.x[o] = v; });
        next_phase();
        // FC: gelu(W LN(x) + b)
        pd_stage(xs, a.x, c, static_cast<const W*>(L.ln2_w), static_cast<const W*>(L.ln2_b), red);
        staged();
        const W* fc_b = static_cast<const W*>(L.fc_b);
        pd_product<W>(a, 4 * c, c, seq, xs, ring, full, empty, vals, fc_b, nullptr, phase,
                      [&](int o, float v) { a.fc[o] = gelu_tanh(v); });
        next_phase();
        // FC projection: x += W fc + b
        pd_stage<W>(xs, a.fc, 4 * c, nullptr, nullptr, red);
        staged();
        const W* fcp_b = static_cast<const W*>(L.fcp_b);
        pd_product<W>(a, c, 4 * c, seq, xs, ring, full, empty, vals, fcp_b, a.x, phase,
                      [&](int o, float v) { a.x[o] = v; });
        next_phase();
    }
    // the LM head and its argmax key
    pd_stage(xs, a.x, c, static_cast<const W*>(a.lnf_w), static_cast<const W*>(a.lnf_b), red);
    staged();
    if (threadIdx.x == 0) *block_best = 0ull;
    pd_sync();
    unsigned long long key = 0ull;
    pd_product<W>(a, a.vocab, c, seq, xs, ring, full, empty, vals, static_cast<const W*>(nullptr), nullptr, phase,
                  [&](int o, float v) {
        a.logits[o] = v;
        key = max(key, argmax_key(v, o));
    });
    if (key != 0ull) atomicMax(block_best, key);
    pd_sync();
    pd_trace(a, phase, PD_DONE);
    pd_trace(a, phase, PD_LAST);
    if (threadIdx.x == 0 && *block_best > *reinterpret_cast<volatile unsigned long long*>(a.best))
        atomicMax(a.best, *block_best);
}
#endif

template <typename W>
__device__ void persistent_decode_impl(const PdArgs& a) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    extern __shared__ __align__(128) unsigned char pd_smem[];
    __shared__ __align__(8) unsigned long long full[PD_MAX_SLOTS], empty[PD_MAX_SLOTS];
    __shared__ float red[32];
    __shared__ unsigned long long block_best;
    unsigned char* ring = pd_smem;
    float* xs = reinterpret_cast<float*>(pd_smem + (size_t)a.slots * a.slot_bytes);
    float* vals = xs + a.xs_floats;
    if (threadIdx.x == 0) {
        for (int i = 0; i < a.slots; i++) {
            mbar_init(&full[i], 1);
            mbar_init(&empty[i], PD_WARPS);
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    if ((int)(threadIdx.x >> 5) == PD_WARPS) pd_load<W>(a, ring, full, empty);
    else pd_compute<W>(a, ring, xs, full, empty, red, vals, &block_best);
#endif
}

#define PERSISTENT_DECODE(NAME, W)                                                                \
    extern "C" __global__ void __launch_bounds__(PD_THREADS + 32, 1) NAME(const __grid_constant__ PdArgs a) { \
        persistent_decode_impl<W>(a);                                                             \
    }
PERSISTENT_DECODE(persistent_decode_f32, float)
PERSISTENT_DECODE(persistent_decode_bf16, bf16_t)
