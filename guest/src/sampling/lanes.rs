//! The sampler's passes over the logits, four f32 lanes at a time.
//!
//! Built for wasm32 with `simd128` (the workspace's `.cargo/config.toml` turns it on) a lane
//! group is a wasm `v128`; anywhere else it is a plain array (with SSE2's float-to-int
//! truncation on x86-64, which compilers do not vectorize from a cast). Both run the same
//! IEEE-754 operations lane by lane (no fused multiply-add, no relaxed SIMD, every sum reduced
//! in one fixed order), so each pass returns bit-identical results on every platform and a
//! seeded sampler draws the same tokens natively and in wasm. Per-token helpers (`scaled_one`,
//! `exp2_one`, `bound_one`) run the very same lane code on a splat, so a value recomputed for
//! one token equals the one its pass saw.
//!
//! Weights are powers of two: `y = (logit - max) * log2(e) / T` and `w = 2^y`, so the largest
//! logit weighs exactly 1. Each pass handles 16 or 64 logits per loop trip, written out
//! (wasmtime checks its epoch at every loop head, which costs the loop's vector registers a
//! spill).

pub use imp::F4;
use imp::M4;

/// Logits per block of [`max`]'s block maxima and of [`bound_blocks`].
pub const BLOCK: usize = 64;
/// Below `2^FLOOR` (the smallest normal f32) a weight is 0.
pub const FLOOR: f32 = -126.0;
/// `exp2(y) >= BOUND_LOW * exp2_bound(y)` for every `y >= FLOOR` (the bound is at most 6.2%
/// above the weight; 0.94 leaves room for rounding in sums).
pub const BOUND_LOW: f64 = 0.94;

/// Adding 1.5 * 2^23 rounds an f32 in [-2^22, 2^22] to an integer (ties to even) whose value
/// sits in the low mantissa bits.
const MAGIC: f32 = 12_582_912.0;
/// The bits of MAGIC: `bits(n + MAGIC) - MAGIC_BITS == n`.
const MAGIC_BITS: u32 = 0x4B40_0000;
/// `bits(n + MAGIC) - POW2_BIAS == n + 127`, the exponent field of `2^n`.
const POW2_BIAS: u32 = MAGIC_BITS - 127;
/// `2^f ~ 1 + f * (C1 + f * (C2 + f * (C3 + f * (C4 + f * C5))))` on [-0.5, 0.5], C1 = ln 2
/// and the others fitted here for relative error (minimax by iterated reweighting): below
/// 1.1e-7, 1.9e-7 once evaluated in f32.
const C1: f32 = std::f32::consts::LN_2;
const C2: f32 = 0.240_222_81;
const C3: f32 = 0.055_505_585;
const C4: f32 = 0.009_669_697;
const C5: f32 = 0.001_330_062_7;
/// `2^23`: `y * 2^23` in f32 is exact, and as integer bits of an f32 its integer part is the
/// exponent field and its fraction the mantissa.
const TWO_23: f32 = 8_388_608.0;
/// The bits of 1.0 (`127 << 23`) and 128 units more: `y * 2^23 + BOUND_BIAS`, truncated to an
/// integer and read as the bits of an f32, is `2^n * (1 + f + 2^-16)` for `y = n + f`,
/// `0 <= f < 1`: the chord of the convex `2^y` between integers (at most 6.15% above it),
/// plus room for the rounding of the sum (at most 32 units) and for the polynomial's error.
const BOUND_BIAS: f32 = 1_065_353_344.0;

#[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
mod imp {
    use super::{MAGIC_BITS, POW2_BIAS};
    use core::arch::wasm32::*;

    /// Four f32 lanes.
    #[derive(Clone, Copy)]
    pub struct F4(v128);
    /// Four lane conditions.
    #[derive(Clone, Copy)]
    pub struct M4(v128);

    impl F4 {
        #[inline(always)]
        pub fn splat(x: f32) -> Self {
            Self(f32x4_splat(x))
        }
        #[inline(always)]
        pub fn load(a: &[f32; 4]) -> Self {
            // SAFETY: `a` is 16 readable bytes, and `v128_load` needs no alignment.
            Self(unsafe { v128_load(a.as_ptr().cast()) })
        }
        #[inline(always)]
        pub fn store(self, out: &mut [f32; 4]) {
            // SAFETY: `out` is 16 writable bytes, and `v128_store` needs no alignment.
            unsafe { v128_store(out.as_mut_ptr().cast(), self.0) }
        }
        #[inline(always)]
        pub fn add(self, o: Self) -> Self {
            Self(f32x4_add(self.0, o.0))
        }
        #[inline(always)]
        pub fn sub(self, o: Self) -> Self {
            Self(f32x4_sub(self.0, o.0))
        }
        #[inline(always)]
        pub fn mul(self, o: Self) -> Self {
            Self(f32x4_mul(self.0, o.0))
        }
        /// `if self < o { o } else { self }`: a NaN in `o` never replaces `self`.
        #[inline(always)]
        pub fn max_keep(self, o: Self) -> Self {
            Self(f32x4_pmax(self.0, o.0))
        }
        /// `if o < self { o } else { self }`: a NaN in `o` never replaces `self`.
        #[inline(always)]
        pub fn min_keep(self, o: Self) -> Self {
            Self(f32x4_pmin(self.0, o.0))
        }
        #[inline(always)]
        pub fn ge(self, o: Self) -> M4 {
            M4(f32x4_ge(self.0, o.0))
        }
        /// The lanes where `m` holds, +0.0 elsewhere.
        #[inline(always)]
        pub fn and(self, m: M4) -> Self {
            Self(v128_and(self.0, m.0))
        }
        /// The lanes where `m` does not hold, +0.0 elsewhere.
        #[inline(always)]
        pub fn and_not(self, m: M4) -> Self {
            Self(v128_andnot(self.0, m.0))
        }
        /// `2^n` from `n + MAGIC` (the exponent field built from the low mantissa bits).
        #[inline(always)]
        pub fn pow2_of_magic(self) -> Self {
            Self(i32x4_shl(i32x4_sub(self.0, u32x4_splat(POW2_BIAS)), 23))
        }
        /// The lanes (positive, below 2^31) truncated to integers, read as the bits of f32s.
        #[inline(always)]
        pub fn trunc_bits(self) -> Self {
            Self(i32x4_trunc_sat_f32x4(self.0))
        }
        /// The integers `n` of lanes holding `n + MAGIC`.
        #[inline(always)]
        pub fn store_index(self, out: &mut [u32; 4]) {
            let n = i32x4_sub(self.0, u32x4_splat(MAGIC_BITS));
            // SAFETY: `out` is 16 writable bytes, and `v128_store` needs no alignment.
            unsafe { v128_store(out.as_mut_ptr().cast(), n) }
        }
        #[inline(always)]
        pub fn lanes(self) -> [f32; 4] {
            [
                f32x4_extract_lane::<0>(self.0),
                f32x4_extract_lane::<1>(self.0),
                f32x4_extract_lane::<2>(self.0),
                f32x4_extract_lane::<3>(self.0),
            ]
        }
    }

    /// `base, base + 1, base + 2, base + 3`.
    #[inline(always)]
    pub fn iota(out: &mut [u32; 4], base: u32) {
        let v = i32x4_add(u32x4(0, 1, 2, 3), u32x4_splat(base));
        // SAFETY: `out` is 16 writable bytes, and `v128_store` needs no alignment.
        unsafe { v128_store(out.as_mut_ptr().cast(), v) }
    }

    /// For each 4-bit mask, the byte shuffle that moves the selected lanes to the front.
    static COMPACT: [[u8; 16]; 16] = {
        let mut table = [[0u8; 16]; 16];
        let mut mask = 0;
        while mask < 16 {
            let (mut to, mut lane) = (0, 0);
            while lane < 4 {
                if mask & (1 << lane) != 0 {
                    let mut byte = 0;
                    while byte < 4 {
                        table[mask][4 * to + byte] = (4 * lane + byte) as u8;
                        byte += 1;
                    }
                    to += 1;
                }
                lane += 1;
            }
            mask += 1;
        }
        table
    };

    #[inline(always)]
    fn compact_v128(v: v128, bits: u32, out: *mut v128) {
        let shuffle = &COMPACT[(bits & 15) as usize];
        // SAFETY: `shuffle` is 16 readable bytes; the callers' `out` 16 writable ones.
        unsafe {
            let s = v128_load(shuffle.as_ptr().cast());
            v128_store(out, i8x16_swizzle(v, s));
        }
    }

    /// The lanes of `v` selected by the four bits of `bits`, moved to the front of `out` (the
    /// lanes after them are unspecified).
    #[inline(always)]
    pub fn compact(v: F4, bits: u32, out: &mut [f32; 4]) {
        compact_v128(v.0, bits, out.as_mut_ptr().cast());
    }

    /// [`compact`] of `base, base + 1, base + 2, base + 3`.
    #[inline(always)]
    pub fn compact_iota(base: u32, bits: u32, out: &mut [u32; 4]) {
        let v = i32x4_add(u32x4(0, 1, 2, 3), u32x4_splat(base));
        compact_v128(v, bits, out.as_mut_ptr().cast());
    }

    impl M4 {
        /// Bit `i` set where lane `i` holds.
        #[inline(always)]
        pub fn bits(self) -> u32 {
            u32::from(i32x4_bitmask(self.0))
        }
        /// Where `a` holds `b`.
        #[inline(always)]
        pub fn eq_index(a: &[u32; 4], b: u32) -> Self {
            // SAFETY: `a` is 16 readable bytes, and `v128_load` needs no alignment.
            Self(i32x4_eq(
                unsafe { v128_load(a.as_ptr().cast()) },
                u32x4_splat(b),
            ))
        }
    }
}

#[cfg(not(all(target_arch = "wasm32", target_feature = "simd128")))]
mod imp {
    use super::{MAGIC_BITS, POW2_BIAS};
    use std::array::from_fn;

    /// Four f32 lanes.
    #[derive(Clone, Copy)]
    pub struct F4([f32; 4]);
    /// Four lane conditions: all bits set where one holds (as in wasm, and so that the
    /// compiler can keep these in vector registers too).
    #[derive(Clone, Copy)]
    pub struct M4([u32; 4]);

    impl F4 {
        #[inline(always)]
        pub fn splat(x: f32) -> Self {
            Self([x; 4])
        }
        #[inline(always)]
        pub fn load(a: &[f32; 4]) -> Self {
            Self(*a)
        }
        #[inline(always)]
        pub fn store(self, out: &mut [f32; 4]) {
            *out = self.0;
        }
        #[inline(always)]
        pub fn add(self, o: Self) -> Self {
            Self(from_fn(|i| self.0[i] + o.0[i]))
        }
        #[inline(always)]
        pub fn sub(self, o: Self) -> Self {
            Self(from_fn(|i| self.0[i] - o.0[i]))
        }
        #[inline(always)]
        pub fn mul(self, o: Self) -> Self {
            Self(from_fn(|i| self.0[i] * o.0[i]))
        }
        /// `if self < o { o } else { self }`: a NaN in `o` never replaces `self`.
        #[inline(always)]
        pub fn max_keep(self, o: Self) -> Self {
            Self(from_fn(|i| {
                if self.0[i] < o.0[i] {
                    o.0[i]
                } else {
                    self.0[i]
                }
            }))
        }
        /// `if o < self { o } else { self }`: a NaN in `o` never replaces `self`.
        #[inline(always)]
        pub fn min_keep(self, o: Self) -> Self {
            Self(from_fn(|i| {
                if o.0[i] < self.0[i] {
                    o.0[i]
                } else {
                    self.0[i]
                }
            }))
        }
        #[inline(always)]
        pub fn ge(self, o: Self) -> M4 {
            M4(from_fn(|i| {
                0u32.wrapping_sub(u32::from(self.0[i] >= o.0[i]))
            }))
        }
        /// The lanes where `m` holds, +0.0 elsewhere.
        #[inline(always)]
        pub fn and(self, m: M4) -> Self {
            Self(from_fn(|i| f32::from_bits(self.0[i].to_bits() & m.0[i])))
        }
        /// The lanes where `m` does not hold, +0.0 elsewhere.
        #[inline(always)]
        pub fn and_not(self, m: M4) -> Self {
            Self(from_fn(|i| f32::from_bits(self.0[i].to_bits() & !m.0[i])))
        }
        /// `2^n` from `n + MAGIC` (the exponent field built from the low mantissa bits).
        #[inline(always)]
        pub fn pow2_of_magic(self) -> Self {
            Self(from_fn(|i| {
                f32::from_bits(self.0[i].to_bits().wrapping_sub(POW2_BIAS) << 23)
            }))
        }
        /// The lanes (positive, below 2^31) truncated to integers, read as the bits of f32s.
        #[inline(always)]
        pub fn trunc_bits(self) -> Self {
            // `as` saturates, which compilers do one lane at a time; SSE2 (always there on
            // x86-64) truncates four at once, the same for lanes in range.
            #[cfg(target_arch = "x86_64")]
            {
                use std::arch::x86_64::*;
                let mut out = [0.0f32; 4];
                // SAFETY: 16 bytes read from and written to four f32s; no alignment needed.
                unsafe {
                    let v = _mm_cvttps_epi32(_mm_loadu_ps(self.0.as_ptr()));
                    _mm_storeu_ps(out.as_mut_ptr(), _mm_castsi128_ps(v));
                }
                Self(out)
            }
            #[cfg(not(target_arch = "x86_64"))]
            Self(from_fn(|i| f32::from_bits(self.0[i] as i32 as u32)))
        }
        /// The integers `n` of lanes holding `n + MAGIC`.
        #[inline(always)]
        pub fn store_index(self, out: &mut [u32; 4]) {
            *out = from_fn(|i| self.0[i].to_bits().wrapping_sub(MAGIC_BITS));
        }
        #[inline(always)]
        pub fn lanes(self) -> [f32; 4] {
            self.0
        }
    }

    /// `base, base + 1, base + 2, base + 3`.
    #[inline(always)]
    pub fn iota(out: &mut [u32; 4], base: u32) {
        *out = from_fn(|i| base.wrapping_add(i as u32));
    }

    /// The lanes of `v` selected by the four bits of `bits`, moved to the front of `out` (the
    /// lanes after them are unspecified).
    #[inline(always)]
    pub fn compact(v: F4, bits: u32, out: &mut [f32; 4]) {
        let mut to = 0;
        for lane in 0..4 {
            if bits & (1 << lane) != 0 {
                out[to] = v.0[lane];
                to += 1;
            }
        }
    }

    /// [`compact`] of `base, base + 1, base + 2, base + 3`.
    #[inline(always)]
    pub fn compact_iota(base: u32, bits: u32, out: &mut [u32; 4]) {
        let mut to = 0;
        for lane in 0..4 {
            if bits & (1 << lane) != 0 {
                out[to] = base.wrapping_add(lane as u32);
                to += 1;
            }
        }
    }

    impl M4 {
        /// Bit `i` set where lane `i` holds.
        #[inline(always)]
        pub fn bits(self) -> u32 {
            (self.0[0] >> 31)
                | (self.0[1] >> 31) << 1
                | (self.0[2] >> 31) << 2
                | (self.0[3] >> 31) << 3
        }
        /// Where `a` holds `b`.
        #[inline(always)]
        pub fn eq_index(a: &[u32; 4], b: u32) -> Self {
            Self(from_fn(|i| 0u32.wrapping_sub(u32::from(a[i] == b))))
        }
    }
}

impl F4 {
    /// `(l0 + l1) + (l2 + l3)`.
    #[inline(always)]
    pub fn sum(self) -> f32 {
        let l = self.lanes();
        (l[0] + l[1]) + (l[2] + l[3])
    }
    /// The largest lane, NaN ignored (-inf if all are NaN).
    #[inline(always)]
    pub fn max(self) -> f32 {
        let l = self.lanes();
        let keep = |a: f32, b: f32| if a < b { b } else { a };
        keep(
            keep(keep(f32::NEG_INFINITY, l[0]), l[1]),
            keep(keep(f32::NEG_INFINITY, l[2]), l[3]),
        )
    }
    /// The smallest lane, NaN ignored (+inf if all are NaN).
    #[inline(always)]
    pub fn min(self) -> f32 {
        let l = self.lanes();
        let keep = |a: f32, b: f32| if b < a { b } else { a };
        keep(
            keep(keep(f32::INFINITY, l[0]), l[1]),
            keep(keep(f32::INFINITY, l[2]), l[3]),
        )
    }
}

/// `max` and `a` (log2(e) / T) as lanes.
#[derive(Clone, Copy)]
pub struct Scale {
    m: F4,
    a: F4,
    /// `a * 2^23`.
    a23: F4,
}

impl Scale {
    pub fn new(max: f32, a: f32) -> Self {
        Self {
            m: F4::splat(max),
            a: F4::splat(a),
            a23: F4::splat(a * TWO_23),
        }
    }
    /// `y * 2^23` (exactly `y` scaled, barring subnormals: scaling by a power of two commutes
    /// with rounding).
    #[inline(always)]
    pub fn y23(&self, l: F4) -> F4 {
        l.sub(self.m).mul(self.a23)
    }
    /// `y = (l - max) * a`: the log2 of the weight relative to the largest logit.
    #[inline(always)]
    pub fn y(&self, l: F4) -> F4 {
        l.sub(self.m).mul(self.a)
    }
}

/// `y` clamped to FLOOR (NaN too), split as `y = n + f`: returns `(f, 2^n)`.
#[inline(always)]
fn split(y: F4) -> (F4, F4) {
    let yc = F4::splat(FLOOR).max_keep(y);
    let t = yc.add(F4::splat(MAGIC));
    let n = t.sub(F4::splat(MAGIC));
    (yc.sub(n), t.pow2_of_magic())
}

/// `2^y` for `y <= 0`; 0 below FLOOR and for NaN.
#[inline(always)]
pub fn exp2(y: F4) -> F4 {
    let (f, scale) = split(y);
    let mut p = F4::splat(C5).mul(f).add(F4::splat(C4));
    p = p.mul(f).add(F4::splat(C3));
    p = p.mul(f).add(F4::splat(C2));
    p = p.mul(f).add(F4::splat(C1));
    p = p.mul(f).add(F4::splat(1.0));
    p.mul(scale).and(y.ge(F4::splat(FLOOR)))
}

/// An upper bound of [`exp2`] from `y * 2^23` (at most 6.2% above it), much cheaper: the bits
/// of a float built from the integer part of a sum (see BOUND_BIAS). Below FLOOR and for NaN
/// it is the bound at FLOOR (`2^-126`).
#[inline(always)]
pub fn exp2_bound(y23: F4) -> F4 {
    F4::splat(FLOOR * TWO_23)
        .max_keep(y23)
        .add(F4::splat(BOUND_BIAS))
        .trunc_bits()
}

/// [`Scale::y`] of one logit (the same lane arithmetic).
#[inline]
pub fn scaled_one(s: &Scale, l: f32) -> f32 {
    s.y(F4::splat(l)).lanes()[0]
}

/// [`exp2`] of one value (the same lane arithmetic).
#[inline]
pub fn exp2_one(y: f32) -> f32 {
    exp2(F4::splat(y)).lanes()[0]
}

/// [`exp2_bound`] of one value `y` (the same lane arithmetic).
#[inline]
pub fn bound_one(y: f32) -> f32 {
    exp2_bound(F4::splat(y * TWO_23)).lanes()[0]
}

/// The four lane groups of 16 logits.
#[inline(always)]
fn quads(c: &[f32; 16]) -> (F4, F4, F4, F4) {
    let (q, _) = c.as_chunks::<4>();
    (
        F4::load(&q[0]),
        F4::load(&q[1]),
        F4::load(&q[2]),
        F4::load(&q[3]),
    )
}

/// The four groups of 16 in a block.
#[inline(always)]
fn sixteens(b: &[f32; BLOCK]) -> (&[f32; 16], &[f32; 16], &[f32; 16], &[f32; 16]) {
    let (c, _) = b.as_chunks::<16>();
    (&c[0], &c[1], &c[2], &c[3])
}

/// Lane-wise maximum of 16 logits (NaN ignored, -inf if none).
#[inline(always)]
fn max16(c: &[f32; 16]) -> F4 {
    let (a, b, c, d) = quads(c);
    let neg = F4::splat(f32::NEG_INFINITY);
    neg.max_keep(a)
        .max_keep(b)
        .max_keep(neg.max_keep(c).max_keep(d))
}

/// Lane-wise sum of `f` over 16 logits: `(f0 + f1) + (f2 + f3)`.
#[inline(always)]
fn sum16(c: &[f32; 16], f: impl Fn(F4) -> F4) -> F4 {
    let (a, b, c, d) = quads(c);
    f(a).add(f(b)).add(f(c).add(f(d)))
}

/// Lane-wise sum of `f` over a block: `(s0 + s1) + (s2 + s3)` of the sixteens.
#[inline(always)]
fn sum64(b: &[f32; BLOCK], f: impl Fn(F4) -> F4 + Copy) -> F4 {
    let (c0, c1, c2, c3) = sixteens(b);
    sum16(c0, f)
        .add(sum16(c1, f))
        .add(sum16(c2, f).add(sum16(c3, f)))
}

/// Candidate buffers being filled by index (`Vec::push` in wasm stores the length to memory
/// each time), four lanes at a time with the selected ones moved to the front (no branch per
/// token: which tokens are selected is as good as random). The vectors only grow, with room
/// for four lanes past the last token: filling them first would cost a pass.
struct Gather<'a> {
    ids: &'a mut [u32],
    ls: &'a mut [f32],
    len: usize,
}

impl<'a> Gather<'a> {
    fn new(n: usize, ids: &'a mut Vec<u32>, ls: &'a mut Vec<f32>) -> Self {
        if ids.len() < n + 4 {
            ids.resize(n + 4, 0);
        }
        if ls.len() < n + 4 {
            ls.resize(n + 4, 0.0);
        }
        Self {
            ids: &mut ids[..n + 4],
            ls: &mut ls[..n + 4],
            len: 0,
        }
    }

    /// The lanes of `v` (tokens `base..base + 4`) selected by the four bits of `bits`.
    #[inline(always)]
    fn quad(&mut self, v: F4, bits: u32, base: usize) {
        let at = self.len;
        let ids = self
            .ids
            .get_mut(at..)
            .and_then(|s| s.first_chunk_mut::<4>());
        let ls = self.ls.get_mut(at..).and_then(|s| s.first_chunk_mut::<4>());
        if let (Some(ids), Some(ls)) = (ids, ls) {
            imp::compact(v, bits, ls);
            imp::compact_iota(base as u32, bits, ids);
            self.len = at + bits.count_ones() as usize;
        }
    }

    /// The tokens selected by bit `j` of `bits` among the 16 from `base`.
    #[inline(always)]
    fn sixteen(&mut self, bits: u32, base: usize, c: &[f32; 16]) {
        let at = self.len;
        if bits == 0xFFFF {
            // All of them (flat logits: every block).
            let ids = self
                .ids
                .get_mut(at..)
                .and_then(|s| s.first_chunk_mut::<16>());
            let ls = self
                .ls
                .get_mut(at..)
                .and_then(|s| s.first_chunk_mut::<16>());
            if let (Some(ids), Some(ls)) = (ids, ls) {
                let (q, _) = ids.as_chunks_mut::<4>();
                let base = base as u32;
                imp::iota(&mut q[0], base);
                imp::iota(&mut q[1], base + 4);
                imp::iota(&mut q[2], base + 8);
                imp::iota(&mut q[3], base + 12);
                let (q, _) = ls.as_chunks_mut::<4>();
                let (a, b, cc, d) = quads(c);
                a.store(&mut q[0]);
                b.store(&mut q[1]);
                cc.store(&mut q[2]);
                d.store(&mut q[3]);
                self.len = at + 16;
            }
            return;
        }
        let (a, b, cc, d) = quads(c);
        self.quad(a, bits & 15, base);
        self.quad(b, bits >> 4 & 15, base + 4);
        self.quad(cc, bits >> 8 & 15, base + 8);
        self.quad(d, bits >> 12 & 15, base + 12);
    }

    fn one(&mut self, id: usize, l: f32) {
        let at = self.len;
        if let (Some(i), Some(x)) = (self.ids.get_mut(at), self.ls.get_mut(at)) {
            *i = id as u32;
            *x = l;
            self.len = at + 1;
        }
    }
}

/// Bits of the lanes where `m` holds, 16 logits at a time.
#[inline(always)]
fn bits16(m: (M4, M4, M4, M4)) -> u32 {
    m.0.bits() | m.1.bits() << 4 | m.2.bits() << 8 | m.3.bits() << 12
}

/// The largest logit (NaN ignored; -inf if there is no number); with `block_max`, the largest
/// of each [`BLOCK`] into it.
pub fn max(logits: &[f32], mut block_max: Option<&mut Vec<f32>>) -> f32 {
    let (blocks, tail) = logits.as_chunks::<BLOCK>();
    if let Some(out) = block_max.as_deref_mut() {
        out.resize(logits.len().div_ceil(BLOCK), f32::NEG_INFINITY);
    }
    let mut max = f32::NEG_INFINITY;
    for (k, b) in blocks.iter().enumerate() {
        let (c0, c1, c2, c3) = sixteens(b);
        let hi = max16(c0)
            .max_keep(max16(c1))
            .max_keep(max16(c2).max_keep(max16(c3)))
            .max();
        if let Some(o) = block_max.as_deref_mut().and_then(|out| out.get_mut(k)) {
            *o = hi;
        }
        if max < hi {
            max = hi;
        }
    }
    if !tail.is_empty() {
        let hi = tail
            .iter()
            .fold(f32::NEG_INFINITY, |a, &b| if a < b { b } else { a });
        if let Some(o) = block_max.and_then(|out| out.get_mut(blocks.len())) {
            *o = hi;
        }
        if max < hi {
            max = hi;
        }
    }
    max
}

/// For each [`BLOCK`], the sum of [`exp2_bound`] over its logits into `out`; returns their
/// total. NaN logits count at the bound of FLOOR.
pub fn bound_blocks(logits: &[f32], s: &Scale, out: &mut Vec<f64>) -> f64 {
    let (blocks, tail) = logits.as_chunks::<BLOCK>();
    out.resize(logits.len().div_ceil(BLOCK), 0.0);
    let mut total = 0.0f64;
    let s = *s;
    for (b, o) in blocks.iter().zip(out.iter_mut()) {
        let sum = f64::from(sum64(b, |l| exp2_bound(s.y23(l))).sum());
        *o = sum;
        total += sum;
    }
    if let Some(o) = out.get_mut(blocks.len()) {
        let sum: f32 = tail.iter().map(|&l| bound_one(scaled_one(&s, l))).sum();
        *o = f64::from(sum);
        total += f64::from(sum);
    }
    total
}

/// The tokens whose logit is at least `threshold` (-inf: every token but NaN), in id order,
/// into the first entries of `ids` and `ls`; returns how many.
pub fn gather_at_least(
    logits: &[f32],
    threshold: f32,
    ids: &mut Vec<u32>,
    ls: &mut Vec<f32>,
) -> usize {
    let mut g = Gather::new(logits.len(), ids, ls);
    let t = F4::splat(threshold);
    let (chunks, tail) = logits.as_chunks::<16>();
    for (k, c) in chunks.iter().enumerate() {
        let (a, b, cc, d) = quads(c);
        let bits = bits16((a.ge(t), b.ge(t), cc.ge(t), d.ge(t)));
        if bits != 0 {
            g.sixteen(bits, k * 16, c);
        }
    }
    let base = chunks.len() * 16;
    for (j, &l) in tail.iter().enumerate() {
        if l >= threshold {
            g.one(base + j, l);
        }
    }
    g.len
}

/// The bound of the tokens with `y * 2^23` below `t` among 16 from `base`; gathers the
/// others.
#[inline(always)]
fn gather16(g: &mut Gather, c: &[f32; 16], base: usize, s: &Scale, t: F4) -> F4 {
    let (a, b, cc, d) = quads(c);
    let y = (s.y23(a), s.y23(b), s.y23(cc), s.y23(d));
    let m = (y.0.ge(t), y.1.ge(t), y.2.ge(t), y.3.ge(t));
    let bits = bits16(m);
    if bits != 0 {
        g.sixteen(bits, base, c);
    }
    exp2_bound(y.0)
        .and_not(m.0)
        .add(exp2_bound(y.1).and_not(m.1))
        .add(
            exp2_bound(y.2)
                .and_not(m.2)
                .add(exp2_bound(y.3).and_not(m.3)),
        )
}

/// The tokens with `y >= tau` (ids and logits, in id order) into the first entries of `ids`
/// and `ls`; returns how many, and the sum of [`exp2_bound`] over the others (NaN counting at
/// the bound of FLOOR).
pub fn gather_scaled(
    logits: &[f32],
    s: &Scale,
    tau: f32,
    ids: &mut Vec<u32>,
    ls: &mut Vec<f32>,
) -> (usize, f64) {
    let mut g = Gather::new(logits.len(), ids, ls);
    let t = F4::splat(tau * TWO_23);
    let (blocks, tail) = logits.as_chunks::<BLOCK>();
    let mut rest = 0.0f64;
    for (k, b) in blocks.iter().enumerate() {
        let (c0, c1, c2, c3) = sixteens(b);
        let base = k * BLOCK;
        let below = gather16(&mut g, c0, base, s, t)
            .add(gather16(&mut g, c1, base + 16, s, t))
            .add(gather16(&mut g, c2, base + 32, s, t).add(gather16(&mut g, c3, base + 48, s, t)));
        rest += f64::from(below.sum());
    }
    let base = blocks.len() * BLOCK;
    let (chunks, tail) = tail.as_chunks::<16>();
    for (k, c) in chunks.iter().enumerate() {
        rest += f64::from(gather16(&mut g, c, base + k * 16, s, t).sum());
    }
    let base = base + chunks.len() * 16;
    let mut tail_rest = 0.0f32;
    for (j, &l) in tail.iter().enumerate() {
        let y = scaled_one(s, l);
        if y >= tau {
            g.one(base + j, l);
        } else {
            tail_rest += bound_one(y);
        }
    }
    (g.len, rest + f64::from(tail_rest))
}

/// Histogram buckets of the weights: `round(min(-y * per_unit, last))`, bucket 0 holding the
/// largest.
#[derive(Debug, Clone, Copy)]
pub struct Buckets {
    pub per_unit: f32,
    pub last: u32,
}

/// The weights [`exp2`] of `ls` into `ws[..ls.len()]` (and, given `buckets`, their histogram
/// buckets into `index[..ls.len()]`); returns their sum. The vectors keep any greater length.
pub fn weights(
    ls: &[f32],
    s: &Scale,
    ws: &mut Vec<f32>,
    buckets: Option<Buckets>,
    index: &mut Vec<u32>,
) -> f64 {
    // The buffers only grow: filling entries to overwrite them would cost a pass.
    let n = ls.len();
    if ws.len() < n {
        ws.resize(n, 0.0);
    }
    let ws = &mut ws[..n];
    match buckets {
        Some(b) => {
            if index.len() < n {
                index.resize(n, 0);
            }
            weigh::<true>(ls, s, ws, b, &mut index[..n])
        }
        None => weigh::<false>(
            ls,
            s,
            ws,
            Buckets {
                per_unit: 0.0,
                last: 0,
            },
            &mut [],
        ),
    }
}

#[inline(always)]
fn weigh<const BUCKETS: bool>(
    ls: &[f32],
    s: &Scale,
    ws: &mut [f32],
    b: Buckets,
    index: &mut [u32],
) -> f64 {
    let (p, top, magic) = (
        F4::splat(-b.per_unit),
        F4::splat(b.last as f32),
        F4::splat(MAGIC),
    );
    let bucket = |y: F4| top.min_keep(y.mul(p)).add(magic);
    let (chunks, tail) = ls.as_chunks::<16>();
    let (out, out_tail) = ws.as_chunks_mut::<16>();
    let (idx, idx_tail) = index.as_chunks_mut::<16>();
    let mut idx = idx.iter_mut();
    let mut total = 0.0f64;
    for (c, o) in chunks.iter().zip(out) {
        let (a, b, cc, d) = quads(c);
        let y = (s.y(a), s.y(b), s.y(cc), s.y(d));
        let w = (exp2(y.0), exp2(y.1), exp2(y.2), exp2(y.3));
        let (o, _) = o.as_chunks_mut::<4>();
        w.0.store(&mut o[0]);
        w.1.store(&mut o[1]);
        w.2.store(&mut o[2]);
        w.3.store(&mut o[3]);
        total += f64::from(w.0.add(w.1).add(w.2.add(w.3)).sum());
        if BUCKETS {
            if let Some(i) = idx.next() {
                let (i, _) = i.as_chunks_mut::<4>();
                bucket(y.0).store_index(&mut i[0]);
                bucket(y.1).store_index(&mut i[1]);
                bucket(y.2).store_index(&mut i[2]);
                bucket(y.3).store_index(&mut i[3]);
            }
        }
    }
    let mut tail_sum = 0.0f32;
    for (j, (&l, o)) in tail.iter().zip(out_tail).enumerate() {
        let y = scaled_one(s, l);
        *o = exp2_one(y);
        tail_sum += *o;
        if BUCKETS {
            if let Some(i) = idx_tail.get_mut(j) {
                let mut one = [0; 4];
                bucket(F4::splat(y)).store_index(&mut one);
                *i = one[0];
            }
        }
    }
    total + f64::from(tail_sum)
}

/// Call `f` with each position of `index` that holds `b`, in order, until it returns true.
pub fn members(index: &[u32], b: u32, mut f: impl FnMut(usize) -> bool) {
    let (chunks, tail) = index.as_chunks::<16>();
    for (k, c) in chunks.iter().enumerate() {
        let (q, _) = c.as_chunks::<4>();
        let mut bits = bits16((
            M4::eq_index(&q[0], b),
            M4::eq_index(&q[1], b),
            M4::eq_index(&q[2], b),
            M4::eq_index(&q[3], b),
        ));
        while bits != 0 {
            if f(k * 16 + bits.trailing_zeros() as usize) {
                return;
            }
            bits &= bits - 1;
        }
    }
    let base = chunks.len() * 16;
    for (j, &x) in tail.iter().enumerate() {
        if x == b && f(base + j) {
            return;
        }
    }
}

/// The sum of [`exp2`] over the logits with `y < tau`.
pub fn weight_below(logits: &[f32], s: &Scale, tau: f32) -> f64 {
    let t = F4::splat(tau);
    let (blocks, tail) = logits.as_chunks::<BLOCK>();
    let s = *s;
    let mut total = 0.0f64;
    for b in blocks {
        let sum = sum64(b, |l| {
            let y = s.y(l);
            exp2(y).and_not(y.ge(t))
        });
        total += f64::from(sum.sum());
    }
    let tail_sum: f32 = tail
        .iter()
        .map(|&l| scaled_one(&s, l))
        .filter(|&y| y < tau) // NaN weighs 0 either way
        .map(exp2_one)
        .sum();
    total + f64::from(tail_sum)
}

/// The smallest of `values` (NaN ignored, +inf if none).
pub fn min(values: &[f32]) -> f32 {
    let (chunks, tail) = values.as_chunks::<16>();
    let mut best = f32::INFINITY;
    for c in chunks {
        let (a, b, cc, d) = quads(c);
        let pos = F4::splat(f32::INFINITY);
        let m = pos
            .min_keep(a)
            .min_keep(b)
            .min_keep(pos.min_keep(cc).min_keep(d))
            .min();
        if m < best {
            best = m;
        }
    }
    tail.iter().fold(best, |a, &b| if b < a { b } else { a })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lcg(seed: u64) -> impl FnMut() -> f32 {
        let mut x = seed;
        move || {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (x >> 40) as f32 / (1u64 << 24) as f32
        }
    }

    #[test]
    fn exp2_is_accurate_and_the_bound_stays_above_it() {
        let mut worst = 0.0f64;
        let mut check = |y: f32| {
            let e = exp2_one(y) as f64;
            let want = (y as f64).exp2();
            worst = worst.max((e - want).abs() / want);
            let b = bound_one(y) as f64;
            assert!(b >= e, "bound {b} below weight {e} at y = {y}");
            assert!(e >= BOUND_LOW * b, "bound {b} too far above {e} at y = {y}");
        };
        // Every STEP-th f32 from FLOOR up to 0 (an exhaustive run, STEP = 1, passed too),
        // then a random spread and the edges of the split.
        const STEP: u32 = 4099;
        let mut bits = FLOOR.to_bits();
        while bits > (-0.0f32).to_bits() {
            check(f32::from_bits(bits));
            bits = bits.saturating_sub(STEP);
        }
        let mut r = lcg(1);
        for _ in 0..200_000 {
            check(-126.0 * r());
        }
        for y in [FLOOR, -125.5, -125.49, -1.5, -0.5, -0.0, 0.0] {
            check(y);
        }
        assert!(worst < 3e-7, "exp2 relative error {worst}");
        assert_eq!(exp2_one(0.0), 1.0);
        assert_eq!(exp2_one(-0.0), 1.0);
        assert_eq!(exp2_one(-3.0), 0.125);
        for y in [-126.5, -1000.0, f32::NEG_INFINITY, f32::NAN] {
            assert_eq!(exp2_one(y), 0.0, "{y}");
            assert!(bound_one(y) > 0.0);
        }
    }

    #[test]
    fn passes_agree_with_their_one_token_definitions() {
        let mut r = lcg(7);
        for n in [0usize, 1, 15, 16, 17, 63, 64, 65, 200, 1000, 50_257] {
            let mut logits: Vec<f32> = (0..n).map(|_| r() * 20.0 - 10.0).collect();
            if n > 10 {
                logits[3] = f32::NAN;
                logits[n - 2] = f32::NEG_INFINITY;
            }
            let mut maxima = Vec::new();
            let m = max(&logits, Some(&mut maxima));
            assert_eq!(max(&logits, None), m);
            let want = logits
                .iter()
                .fold(f32::NEG_INFINITY, |a, &b| if a < b { b } else { a });
            assert_eq!(m, want);
            let want = logits
                .iter()
                .fold(f32::INFINITY, |a, &b| if b < a { b } else { a });
            assert_eq!(min(&logits), want);
            assert_eq!(maxima.len(), n.div_ceil(BLOCK));
            for (b, &bm) in maxima.iter().enumerate() {
                let end = (b * BLOCK + BLOCK).min(n);
                let want = logits[b * BLOCK..end]
                    .iter()
                    .fold(f32::NEG_INFINITY, |a, &b| if a < b { b } else { a });
                assert_eq!(bm, want);
            }
            let s = Scale::new(if n == 0 { 0.0 } else { m }, 1.3);
            let ys: Vec<f32> = logits.iter().map(|&l| scaled_one(&s, l)).collect();

            let mut sums = Vec::new();
            let total = bound_blocks(&logits, &s, &mut sums);
            let seq: f64 = ys.iter().map(|&y| bound_one(y) as f64).sum();
            assert!(
                (total - seq).abs() <= 1e-5 * seq.max(1e-30),
                "{total} {seq}"
            );
            assert_eq!(sums.len(), n.div_ceil(BLOCK));

            let (mut ids, mut ls) = (Vec::new(), Vec::new());
            let count = gather_at_least(&logits, 2.5, &mut ids, &mut ls);
            let want: Vec<u32> = (0..n as u32)
                .filter(|&i| logits[i as usize] >= 2.5)
                .collect();
            assert_eq!(ids[..count], want);
            assert!(ids[..count]
                .iter()
                .zip(&ls)
                .all(|(&i, &l)| logits[i as usize] == l));
            let count = gather_at_least(&logits, f32::NEG_INFINITY, &mut ids, &mut ls);
            assert_eq!(count, logits.iter().filter(|l| !l.is_nan()).count());

            let tau = -6.0;
            let (count, rest) = gather_scaled(&logits, &s, tau, &mut ids, &mut ls);
            let want: Vec<u32> = (0..n as u32).filter(|&i| ys[i as usize] >= tau).collect();
            assert_eq!(ids[..count], want);
            let want_rest: f64 = ys
                .iter()
                .filter(|&&y| y.is_nan() || y < tau)
                .map(|&y| bound_one(y) as f64)
                .sum();
            assert!((rest - want_rest).abs() <= 1e-5 * want_rest.max(1e-30));
            let ls = &ls[..count];

            let (mut ws, mut index) = (Vec::new(), Vec::new());
            let b = Buckets {
                per_unit: 100.0 / 6.0,
                last: 99,
            };
            let total = weights(ls, &s, &mut ws, Some(b), &mut index);
            for ((&l, &w), &i) in ls.iter().zip(&ws).zip(&index) {
                let y = scaled_one(&s, l);
                assert_eq!(w.to_bits(), exp2_one(y).to_bits());
                assert_eq!(i, (-y * b.per_unit).min(99.0).round_ties_even() as u32);
            }
            for bucket in [0, 7, 99] {
                let mut found = Vec::new();
                members(&index, bucket, |i| {
                    found.push(i);
                    false
                });
                let want: Vec<usize> = (0..index.len()).filter(|&i| index[i] == bucket).collect();
                assert_eq!(found, want);
            }
            let total_alone = weights(ls, &s, &mut ws, None, &mut index);
            assert_eq!(total, total_alone);
            let seq: f64 = ws.iter().map(|&w| w as f64).sum();
            assert!((total - seq).abs() <= 1e-5 * seq.max(1e-30));

            let below = weight_below(&logits, &s, tau);
            let want: f64 = ys
                .iter()
                .filter(|&&y| y < tau)
                .map(|&y| exp2_one(y) as f64)
                .sum();
            assert!((below - want).abs() <= 1e-5 * want.max(1e-30));
        }
    }
}
