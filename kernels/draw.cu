// The sampled draw where the logits are: the rule of `host/src/engine/draw.rs` (its
// specification and the CPU side), steps 1-3, for a session's last logits (`draw_token`) or
// the rows of a batched pass (`batch_draw`); the host finishes the rare row whose draws all
// fell outside the nucleus. DRAW_THREADS, MAX_DRAWS and BATCH_RULE_WORDS are defined by the host.
#include "common.cuh"

__device__ __forceinline__ unsigned long long draw_mix(unsigned long long z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

// Draw k's uniform in [0, 1) for `position` (`uniform` in draw.rs).
__device__ __forceinline__ double draw_uniform(unsigned long long seed, unsigned long long position, int k) {
    unsigned long long counter = position * 64ull + (unsigned long long)k + 1ull;
    unsigned long long bits = draw_mix(draw_mix(seed) + counter * 0x9e3779b97f4a7c15ull);
    return (double)(bits >> 11) * (1.0 / 9007199254740992.0);
}

// A token's weight; below `floor` (min-p's, -inf without it) it weighs 0.
__device__ __forceinline__ double draw_weight(float l, float m, double inv_t, float floor) {
    return l != l || l < floor ? 0.0 : exp(((double)l - (double)m) * inv_t);
}

// A block-wide reduction of `v` by `op` over DRAW_THREADS threads (`identity` its neutral
// value); every thread gets the result. `scratch` holds one value a warp; the trailing barrier
// lets the next reduction reuse it. (The float maximum is `block_max` in common.cuh.)
struct DrawAdd {
    __device__ double operator()(double a, double b) const { return a + b; }
};
struct DrawMin {
    __device__ int operator()(int a, int b) const { return min(a, b); }
};
template <typename T, typename Op>
__device__ __forceinline__ T draw_block_reduce(T v, T* scratch, T identity, Op op) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, off));
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    T all = identity;
    for (int w = 0; w < DRAW_THREADS / 32; w++) all = op(all, scratch[w]);
    __syncthreads();
    return all;
}

// f32's estimate of `draw_weight`, for deciding where its error cannot matter: the exponent
// formed in f64 and rounded (relative error 2^-24 of at most ~104 where the weight is not
// below f32's range), expf within 2 ulp. Each weight is then within 7e-6 of the f64 one
// relatively, or 1.2e-38 absolutely where it underflows. (expf's 2 ulp is NVIDIA's tested bound;
// the margin below leaves room for ten times more.)
__device__ __forceinline__ float draw_weight_f32(float l, float m, double inv_t, float floor) {
    return l != l || l < floor ? 0.0f : expf((float)(((double)l - (double)m) * inv_t));
}
// How far an f32 estimate of a sum of weights may be from the f64 sum, as a share of the total
// (which is at least 1: the largest logit weighs exactly 1): the weights' 7e-6 plus a thread's
// f32 sum of up to DRAW_WALK terms, with margin to spare.
#define DRAW_FILTER_MARGIN 1e-4
// Tokens a thread's chunk may hold for its walk to go through shared memory (GPT-2: 50).
#define DRAW_WALK 128
static_assert(7e-6 + DRAW_WALK * 6e-8 < DRAW_FILTER_MARGIN / 4, "the estimate stays well inside the margin");

// Step 2 within the chunk [lo, hi), `weight(i)` giving id i's weight, from the cumulative
// weight `before` at its start: the first id whose cumulative weight passes `target` into
// `picked`, or the chunk's last weighted id when rounding leaves the target past them all (the
// CPU's `pick` takes the overall last; a target this close to a chunk's end is a rounding apart
// anyway). Out of line: it runs once a draw, by one thread.
template <typename Weight>
__device__ __noinline__ void draw_walk(Weight weight, int lo, int hi, double before, double target, int& picked) {
    double cumulative = before;
    int pick = -1;
    for (int i = lo; i < hi; i++) {
        double wi = weight(i);
        if (wi > 0.0) {
            pick = i;
            cumulative += wi;
            if (cumulative > target) break;
        }
    }
    if (pick >= 0) picked = pick;
}

// The blocks that draw one row: a thread-block cluster of them on sm_90 (the launch's cluster
// shape), one block elsewhere. Each block publishes its part of a reduction in its shared
// memory, and after a barrier every block reads all parts in rank order, so every block
// gets the same bits (a row of one block reads its own part: the one-block result).
struct DrawRow {
    u32 rank, blocks;
    __device__ DrawRow() : rank(cluster_rank()), blocks(cluster_blocks()) {}
    // Every thread of the row's blocks; orders shared and global memory before it against
    // after it.
    __device__ void sync() const {
        if (blocks > 1)
            cluster_sync();
        else
            __syncthreads();
    }
    // Block r's part in `slot` (this block's own without a cluster load).
    __device__ float part(const float* slot, u32 r) const { return r == rank ? *slot : peer_load(peer_addr(slot, r)); }
    __device__ double part(const double* slot, u32 r) const {
        return r == rank ? *slot : peer_load_f64(peer_addr(slot, r));
    }
    __device__ int part(const int* slot, u32 r) const { return r == rank ? *slot : peer_load_s32(peer_addr(slot, r)); }
    // The sum of every block's `*slot` in rank order, and of those before this block's.
    __device__ double sum(const double* slot, double* before) const {
        double all = 0.0;
        for (u32 r = 0; r < blocks; r++) {
            if (r == rank) *before = all;
            all += part(slot, r);
        }
        return all;
    }
};

// The token `rule` (4 words: 1 / temperature and top_p as f64 bits, the seed, the position
// drawn for) draws from the `v` logits at `l`, for every thread of the row's blocks (which
// must all call it); -1 when MAX_DRAWS draws fell outside the nucleus. Each thread of the row
// weighs a contiguous chunk of ids, so the cumulative weight in id order is a scan over the
// threads' chunks: thread t's range of it is [incl[t - 1], incl[t]) (plus the blocks' before
// it), and one weighted thread's range holds a draw's target (or, past every range by
// rounding, none: then the last weighted id). That chunk is weighed by warp 0 of its block
// into shared memory and walked in order by one lane (the sums and order of its own thread's
// walk, in a few loads' time instead of a chain of them).
//
// `floor_offset` is min-p's `T * ln(min_p)` (f32, computed by the host as the rule does), -inf
// without min-p: a token below the largest logit plus it weighs 0.
__device__ int draw_row(const float* l, int v, const unsigned long long* rule, float floor_offset = -INFINITY) {
    __shared__ double incl[DRAW_THREADS];
    __shared__ double dscratch[DRAW_THREADS / 32];
    __shared__ float fscratch[DRAW_THREADS / 32];
    __shared__ int iscratch[DRAW_THREADS / 32];
    __shared__ int picked, holder;
    __shared__ double walk[DRAW_WALK];
    // each block's parts, one slot per exchange so that none is written while a peer may
    // still read it
    __shared__ float part_max;
    __shared__ int part_first, part_last;
    __shared__ double part_total;
    __shared__ int part_pick[MAX_DRAWS];
    __shared__ double part_approx[MAX_DRAWS], part_before[MAX_DRAWS];
    const DrawRow row;
    int t = threadIdx.x, threads = (int)row.blocks * DRAW_THREADS, g = (int)row.rank * DRAW_THREADS + t;
    int token = -1;
    float m = -INFINITY;
    for (int i = g; i < v; i += threads) m = fmaxf(m, l[i]);  // fmaxf skips NaN
    m = block_max(m, fscratch);
    if (t == 0) part_max = m;
    row.sync();
    for (u32 r = 0; r < row.blocks; r++) m = fmaxf(m, row.part(&part_max, r));
    if (!(m > -INFINITY && m < INFINITY)) {
        // greedy: the first +inf, or 0 when nothing is above -inf
        int first = 0x7fffffff;
        if (m == INFINITY)
            for (int i = g; i < v; i += threads)
                if (l[i] == m) first = min(first, i);
        first = draw_block_reduce(first, iscratch, 0x7fffffff, DrawMin());
        if (t == 0) part_first = first;
        row.sync();
        for (u32 r = 0; r < row.blocks; r++) first = min(first, row.part(&part_first, r));
        token = m == INFINITY ? first : 0;
    } else {
        // (f32 as the rule computes it: a rounded sum, never fused)
        float floor = __fadd_rn(m, floor_offset);
        double it = __longlong_as_double((long long)rule[0]), p = __longlong_as_double((long long)rule[1]);
        unsigned long long seed = rule[2], position = rule[3];
        int per = (v + threads - 1) / threads;
        int lo = min(g * per, v), hi = min(lo + per, v);
        double chunk = 0.0;
        for (int i = lo; i < hi; i++) chunk += draw_weight(l[i], m, it, floor);
        // inclusive scan of the chunk sums: within the warp, over the warps' totals, then
        // over the blocks' totals
        int warp = t >> 5, lane = t & 31;
        double scan = chunk;
#pragma unroll
        for (int off = 1; off < 32; off <<= 1) {
            double up = __shfl_up_sync(0xffffffffu, scan, off);
            if (lane >= off) scan += up;
        }
        if (lane == 31) dscratch[warp] = scan;
        __syncthreads();
        double warps_before = 0.0;
        for (int w = 0; w < warp; w++) warps_before += dscratch[w];
        incl[t] = warps_before + scan;
        // the last id weighing anything, for a target that rounding leaves past every one
        int last = -1;
        for (int i = hi - 1; i >= lo; i--)
            if (draw_weight(l[i], m, it, floor) > 0.0) {
                last = i;
                break;
            }
        last = -draw_block_reduce(-last, iscratch, 0x7fffffff, DrawMin());
        if (t == 0) {
            part_total = incl[DRAW_THREADS - 1];
            part_last = last;
        }
        row.sync();
        double blocks_before = 0.0;
        double total = row.sum(&part_total, &blocks_before);
        for (u32 r = 0; r < row.blocks; r++) last = max(last, row.part(&part_last, r));
        double before_chunk = blocks_before + (t == 0 ? 0.0 : incl[t - 1]);
        double after_chunk = blocks_before + incl[t];
        for (int k = 0; k < MAX_DRAWS; k++) {
            double target = draw_uniform(seed, position, k) * total;
            if (t == 0) {
                picked = -1;
                holder = -1;
            }
            __syncthreads();
            // (a chunk weighing nothing can hold the target only by the scan's rounding; its
            // walk would pick nothing)
            if (before_chunk <= target && target < after_chunk && chunk > 0.0) holder = t;
            __syncthreads();
            int h = holder;
            if (h >= 0) {
                int h_lo = min(((int)row.rank * DRAW_THREADS + h) * per, v), h_hi = min(h_lo + per, v);
                bool shared_walk = h_hi - h_lo <= DRAW_WALK;
                if (shared_walk && warp == 0) {
                    for (int i = h_lo + lane; i < h_hi; i += 32) walk[i - h_lo] = draw_weight(l[i], m, it, floor);
                    __syncwarp();
                    if (lane == 0) {
                        auto staged = [&](int i) { return walk[i - h_lo]; };
                        double h_before = blocks_before + (h == 0 ? 0.0 : incl[h - 1]);
                        draw_walk(staged, h_lo, h_hi, h_before, target, picked);
                    }
                } else if (!shared_walk && t == h) {
                    // a chunk past DRAW_WALK: its own thread weighs it as it walks
                    auto weighed = [&](int i) { return draw_weight(l[i], m, it, floor); };
                    draw_walk(weighed, lo, hi, before_chunk, target, picked);
                }
            }
            __syncthreads();
            if (t == 0) part_pick[k] = picked;
            row.sync();
            int x = last;
            for (u32 r = 0; r < row.blocks; r++) {
                int pick = row.part(&part_pick[k], r);
                if (pick >= 0) x = pick;
            }
            if (p >= 1.0) {
                token = x;
                break;
            }
            float lx = l[x];
            // Whether the tokens more likely than x weigh less than p of the total, decided
            // from f32 weights where their error bound leaves no doubt, else from the f64
            // weights: the same answer either way, without an f64 exponential a token in the
            // usual case.
            double bound = p * total;
            if (per <= DRAW_WALK) {  // a thread's f32 sum of at most DRAW_WALK weights
                float rough = 0.0f;
                for (int j = g; j < v; j += threads) {
                    float lj = l[j];
                    if (lj > lx || (lj == lx && j < x)) rough += draw_weight_f32(lj, m, it, floor);
                }
                double approx = draw_block_reduce((double)rough, dscratch, 0.0, DrawAdd());
                if (t == 0) part_approx[k] = approx;
                row.sync();
                double unused;
                approx = row.sum(&part_approx[k], &unused);
                double margin = DRAW_FILTER_MARGIN * total;
                if (approx < bound - margin) {
                    token = x;
                    break;
                }
                if (approx > bound + margin) continue;
            }
            double before = 0.0;
            for (int j = g; j < v; j += threads) {
                float lj = l[j];
                if (lj > lx || (lj == lx && j < x)) before += draw_weight(lj, m, it, floor);
            }
            before = draw_block_reduce(before, dscratch, 0.0, DrawAdd());
            if (t == 0) part_before[k] = before;
            row.sync();
            double unused;
            if (row.sum(&part_before[k], &unused) < bound) {
                token = x;
                break;
            }
        }
    }
    // no block leaves while another may still read its parts
    row.sync();
    return token;
}

// The row a block draws: its cluster's place in the grid (one cluster a row).
__device__ __forceinline__ int drawn_row() { return blockIdx.x / cluster_blocks(); }
// Whether this thread writes the row's result: the first of its first block.
__device__ __forceinline__ bool draw_writer() { return threadIdx.x == 0 && cluster_rank() == 0; }

// One row a cluster (or block): out[row] = the token rules[4 * row ..] draws from
// logits[row * stride ..] (`v` of them), -1 when undecided (see `draw_row`).
extern "C" __global__ void __launch_bounds__(DRAW_THREADS)
    draw_token(const float* logits, long long stride, int v, const unsigned long long* rules, int* out) {
    pdl_wait();
    int row = drawn_row();
    int token = draw_row(logits + (size_t)row * (size_t)stride, v, rules + 4 * row);
    if (draw_writer()) out[row] = token;
}

// A request's processing of one token's logit (`host/src/engine/processing.rs`, one edit a
// distinct token id, made by the host): x = the id, y its steps (low byte) and the times the
// token was generated (above it), z the bias's bits, w the penalty's bits (its `count *
// frequency + presence`, rounded as the host rounds it).
#define EDIT_BIAS 1u        // add the bias
#define EDIT_REPETITION 2u  // in the sequence: divided by the repetition penalty above 0, else multiplied
#define EDIT_PENALTY 4u     // generated: less the penalty

// A row run ahead whose token was fed on the GPU: its edits are the sequence's before that
// token, and the token's own edit follows here (`Edits::after` on the host): in the sequence,
// and with penalties generated once more. token < 0: none.
struct Follow {
    int token;
    bool penalties;
    float presence, frequency;
};

// Elements from..n - 1 of `src` into `dst` by `threads` threads (this one is `g`), COPY_ROUNDS
// loads in flight a thread, all issued before their stores.
#define COPY_ROUNDS 8
template <typename T>
__device__ void copy_rounds(T* __restrict__ dst, const T* __restrict__ src, int from, int n, int g, int threads) {
    for (int i = from + g; i < n; i += COPY_ROUNDS * threads) {
        T held[COPY_ROUNDS];
#pragma unroll
        for (int u = 0; u < COPY_ROUNDS; u++)
            if (i + u * threads < n) held[u] = src[i + u * threads];
#pragma unroll
        for (int u = 0; u < COPY_ROUNDS; u++)
            if (i + u * threads < n) dst[i + u * threads] = held[u];
    }
}
// `n` floats from `src` to `dst` by `threads` threads (this one is `g`), 16 bytes a load where
// both are aligned: a loop of one load and one store a step waits out each load's latency in
// turn, ~200 of them for a row of GPT-2's logits.
__device__ void copy_row(float* __restrict__ dst, const float* __restrict__ src, int n, int g, int threads) {
    int done = 0;
    if (((reinterpret_cast<size_t>(dst) | reinterpret_cast<size_t>(src)) & 15) == 0) {
        copy_rounds(reinterpret_cast<float4*>(dst), reinterpret_cast<const float4*>(src), 0, n / 4, g, threads);
        done = n / 4 * 4;
    }
    copy_rounds(dst, src, done, n, g, threads);
}

// `logits` copied to `scratch` (`v` floats) with each edit's token replaced by its processed
// value (the edits' ids are distinct, so the threads never share one), then the followed
// token's, for every thread of the row's blocks; returns `scratch`. The logits the guest
// reads stay as they are. Each step is the host's f32 operation, rounded alone (never fused),
// so the processed values are its bits. Out of line: inlined into `batch_draw`, its copy's
// loads in flight and the draw's values took more than the 64 registers a thread of 1,024
// has, and CUDA 13's ptxas spilled some.
__device__ __noinline__ const float* process_row(const float* logits, float* scratch, int v, const uint4* edits,
                                                int n_edits, float repetition, Follow follow) {
    const DrawRow row;
    int threads = (int)row.blocks * DRAW_THREADS, g = (int)row.rank * DRAW_THREADS + threadIdx.x;
    copy_row(scratch, logits, v, g, threads);
    row.sync();
    for (int e = g; e < n_edits; e += threads) {
        uint4 edit = edits[e];
        if (edit.x >= (unsigned)v) continue;
        float l = logits[edit.x];
        if (edit.y & EDIT_BIAS) l = __fadd_rn(l, __uint_as_float(edit.z));
        if (edit.y & EDIT_REPETITION) l = l > 0.0f ? __fdiv_rn(l, repetition) : __fmul_rn(l, repetition);
        if (edit.y & EDIT_PENALTY) l = __fsub_rn(l, __uint_as_float(edit.w));
        scratch[edit.x] = l;
    }
    row.sync();
    if (follow.token < 0 || follow.token >= v) return scratch;
    if (row.rank == 0) {
        // the token's edit before it, if it has one (ids distinct: one writer at most)
        __shared__ int before;
        if (threadIdx.x == 0) before = -1;
        __syncthreads();
        for (int e = threadIdx.x; e < n_edits; e += DRAW_THREADS)
            if (edits[e].x == (unsigned)follow.token) before = e;
        __syncthreads();
        if (threadIdx.x == 0) {
            uint4 edit = before >= 0 ? edits[before] : make_uint4((unsigned)follow.token, 0u, 0u, 0u);
            float l = logits[follow.token];
            if (edit.y & EDIT_BIAS) l = __fadd_rn(l, __uint_as_float(edit.z));
            if (repetition != 1.0f) l = l > 0.0f ? __fdiv_rn(l, repetition) : __fmul_rn(l, repetition);
            if (follow.penalties) {
                float generated = (float)((edit.y >> 8) + 1u);
                l = __fsub_rn(l, __fadd_rn(__fmul_rn(generated, follow.frequency), follow.presence));
            }
            scratch[follow.token] = l;
        }
    }
    row.sync();
    return scratch;
}

// The batched pass's draws, a cluster (or block) a row: for each row whose rule is set
// (rules[BATCH_RULE_WORDS * row] != 0: the 4 words of `draw_row`, then min-p's floor offset
// (low half) and the repetition penalty (high half) as f32 bits, then the device address of
// the row's edits (its context's, kept on the GPU), then the presence and frequency penalties
// (low, high) as f32 bits, then flags (bit 0 the edits follow the row's token (`tokens[row]`,
// fed on the GPU), bit 1 the penalties are set) with the count of the edits above them, then
// the first of the row's changes to its edits in `changes` (low half) and their count (high
// half)) and whose logits were kept (dst[row] != 0, its context's last row), keys[row]
// becomes the drawn token's key in place of the argmax key `batch_logits` left (the low word
// the complement of the token, as `argmax_key`; an undecided row names token v, past the
// vocabulary, which the host draws again and `batch_feed` never feeds). A change is two
// uint4: its slot (x) among the edits, then the edit; the row's blocks write its changes
// first (a slot past the count is left alone). A row with edits is drawn from a processed
// copy in its row of `scratch` (`scratch_ld` floats a row: the LM head's product rows, which
// `batch_logits` has read by now), as `draw_processed`. BATCH_RULE_WORDS is defined by the
// host.
extern "C" __global__ void __launch_bounds__(DRAW_THREADS)
    batch_draw(const unsigned long long* dst, const unsigned long long* rules, unsigned long long* keys, int v,
               float* scratch, long long scratch_ld, const uint4* changes, const int* tokens) {
    pdl_wait();
    int row = drawn_row();
    const unsigned long long* rule = rules + BATCH_RULE_WORDS * row;
    if (rule[0] == 0ull || dst[row] == 0ull) return;
    const float* l = reinterpret_cast<const float*>(dst[row]);
    float floor_offset = __uint_as_float((u32)rule[4]), repetition = __uint_as_float((u32)(rule[4] >> 32));
    uint4* edits = reinterpret_cast<uint4*>(rule[5]);
    int count = (int)(u32)(rule[7] >> 32);
    int first = (int)(u32)rule[8], changed = (int)(u32)(rule[8] >> 32);
    Follow follow = {(rule[7] & 1ull) ? tokens[row] : -1, (rule[7] & 2ull) != 0ull, __uint_as_float((u32)rule[6]),
                     __uint_as_float((u32)(rule[6] >> 32))};
    if (changed > 0) {
        const DrawRow blocks;
        int threads = (int)blocks.blocks * DRAW_THREADS, g = (int)blocks.rank * DRAW_THREADS + threadIdx.x;
        for (int i = g; i < changed; i += threads) {
            uint4 at = changes[2 * (size_t)(first + i)];
            if (at.x < (unsigned)count) edits[at.x] = changes[2 * (size_t)(first + i) + 1];
        }
        __threadfence();
        blocks.sync();
    }
    if (count > 0 || follow.token >= 0)
        l = process_row(l, scratch + (size_t)row * (size_t)scratch_ld, v, edits, count, repetition, follow);
    int token = draw_row(l, v, rule, floor_offset);
    if (token < 0) token = v;
    if (draw_writer()) keys[row] = (1ull << 32) | (unsigned long long)(0xffffffffu - (u32)token);
}

// The draw of one row's logits after its request's processing (`draw_token` with bias,
// penalties and min-p), from the processed copy in `scratch`.
extern "C" __global__ void __launch_bounds__(DRAW_THREADS)
    draw_processed(const float* logits, float* scratch, int v, const unsigned long long* rule, const uint4* edits,
                   int n_edits, float repetition, float floor_offset, int* out) {
    pdl_wait();
    const Follow none = {-1, false, 0.0f, 0.0f};
    int token = draw_row(process_row(logits, scratch, v, edits, n_edits, repetition, none), v, rule, floor_offset);
    if (draw_writer()) out[0] = token;
}
