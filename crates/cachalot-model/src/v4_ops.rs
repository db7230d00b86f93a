//! The pure maths of the DeepSeek-V4 forward pass, one function per rule of the spec, so each can
//! be tested on its own (spec `shared/specs/deepseek-v4.md` §6 invariants 7–14).
//!
//! - §4.1 weight formats: [`e8m0_to_f32`], [`E2M1_VALUES`], [`decode_mxfp4`].
//! - §2.3 mHC: [`hc_split_sinkhorn`], [`hc_collapse`], [`hc_expand`], [`hc_head_weights`].
//! - §2.5 RoPE: [`V4Rope`] (two tables, interleaved pairs on the last R dims, inverse).
//! - §2.6 attention with a sink: [`attend_with_sink`].
//! - §2.7 compressor pooling: [`pool_compressed`]; §2.8 Hadamard: [`hadamard_in_place`].
//! - §2.9 MoE: [`route_v4`], [`swiglu_clamped`].
//! - §2.12 [REF]'s quantisation sims (optional): [`fp8_round_trip`], [`fp4_round_trip`].
//!
//! All arithmetic is f32 (the reference fixtures are float32; [REF]'s bf16 roundings are not
//! reproduced, see docs/ARCHITECTURE.md).

use cachalot_kernels as k;

use crate::config_v4::{ScoringFunc, V4Yarn};
use crate::deepseek_v3::top_indices;

/// F8_E8M0 scale byte → 2^(b−127) (the kernels' table); 255 is NaN → `None`.
pub fn e8m0_to_f32(b: u8) -> Option<f32> {
    (b != 255).then(|| k::mx::e8m0_to_f32(b))
}

/// e2m1 (FP4) nibble → value: s|ee|m, codes 0..7 = 0, .5, 1, 1.5, 2, 3, 4, 6; 8..15 negated.
pub use cachalot_kernels::mx::E2M1_VALUES;

/// MXFP4 `[rows, cols]` from packed bytes `[rows, cols/2]` (column 2j in the low nibble of byte
/// j, 2j+1 in the high one) and E8M0 scales `[rows, cols/32]`, row-major into `out` (the
/// kernels' row dequantization). Errors on a NaN (255) scale with its (row, group).
pub fn decode_mxfp4(
    packed: &[u8],
    scales: &[u8],
    rows: usize,
    cols: usize,
    out: &mut [f32],
) -> Result<(), (usize, usize)> {
    let groups = cols / 32;
    for r in 0..rows {
        let srow = &scales[r * groups..(r + 1) * groups];
        if let Some(g) = srow.iter().position(|&b| b == 255) {
            return Err((r, g));
        }
        k::mx::dequantize_mxfp4_row(
            &packed[r * cols / 2..(r + 1) * cols / 2],
            srow,
            &mut out[r * cols..(r + 1) * cols],
        );
    }
    Ok(())
}

/// mHC pre/post/comb from the 24 mixes of one token (spec §2.3 steps 3–4): `m` is already
/// multiplied by the RMS factor r. Returns (pre [hc], post [hc], comb [hc·hc] row-major, row j =
/// source stream, column k = destination).
pub fn hc_split_sinkhorn(
    m: &[f32],
    scale: &[f32],
    base: &[f32],
    hc: usize,
    iters: usize,
    eps: f32,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let sig = |x: f32| 1.0 / (1.0 + (-x).exp());
    let pre: Vec<f32> = (0..hc)
        .map(|i| sig(m[i] * scale[0] + base[i]) + eps)
        .collect();
    let post: Vec<f32> = (0..hc)
        .map(|i| 2.0 * sig(m[hc + i] * scale[1] + base[hc + i]))
        .collect();
    let mut c: Vec<f32> = (0..hc * hc)
        .map(|i| m[2 * hc + i] * scale[2] + base[2 * hc + i])
        .collect();
    for row in c.chunks_exact_mut(hc) {
        k::softmax_in_place(row);
        for v in row.iter_mut() {
            *v += eps;
        }
    }
    let col_norm = |c: &mut [f32]| {
        for kk in 0..hc {
            let s: f32 = (0..hc).map(|j| c[j * hc + kk]).sum::<f32>() + eps;
            for j in 0..hc {
                c[j * hc + kk] /= s;
            }
        }
    };
    col_norm(&mut c);
    for _ in 1..iters {
        for row in c.chunks_exact_mut(hc) {
            let s: f32 = row.iter().sum::<f32>() + eps;
            for v in row.iter_mut() {
                *v /= s;
            }
        }
        col_norm(&mut c);
    }
    (pre, post, c)
}

/// `y = Σ_i pre_i · X_i` over the hc streams of one token (`x`: [hc, D]).
pub fn hc_collapse(pre: &[f32], x: &[f32], out: &mut [f32]) {
    out.fill(0.0);
    let d = out.len();
    for (i, &p) in pre.iter().enumerate() {
        k::axpy(p, &x[i * d..(i + 1) * d], out);
    }
}

/// `X'_k = post_k · f + Σ_j comb[j][k] · X_j` (spec §2.3 hc_post) for one token, in place.
pub fn hc_expand(f: &[f32], x: &mut [f32], post: &[f32], comb: &[f32]) {
    let d = f.len();
    let hc = post.len();
    let old = x.to_vec();
    for kk in 0..hc {
        let dst = &mut x[kk * d..(kk + 1) * d];
        for (o, &v) in dst.iter_mut().zip(f) {
            *o = post[kk] * v;
        }
        for j in 0..hc {
            k::axpy(comb[j * hc + kk], &old[j * d..(j + 1) * d], dst);
        }
    }
}

/// hc_head weights of one token: `pre_i = sigmoid(m_i·s + base_i) + eps` (no Sinkhorn).
pub fn hc_head_weights(m: &[f32], scale: f32, base: &[f32], eps: f32) -> Vec<f32> {
    m.iter()
        .zip(base)
        .map(|(&mi, &b)| 1.0 / (1.0 + (-(mi * scale + b)).exp()) + eps)
        .collect()
}

/// `1 / sqrt(mean(x²) + eps)` over a token's flattened streams (spec §2.3 step 1).
pub fn rms_factor(x: &[f32], eps: f32) -> f32 {
    1.0 / (k::dot(x, x) / x.len() as f32 + eps).sqrt()
}

/// RoPE of V4 (spec §2.5): `dim`/2 frequencies in f32, angle `f32(p)·f_i` in f32, interleaved
/// pairs `(v[2i], v[2i+1])` of the rope slice rotated by e^{±iθ}.
#[derive(Clone, Debug)]
pub struct V4Rope {
    pub inv_freq: Vec<f32>,
}

impl V4Rope {
    /// Window-only layers: base θ, no YaRN.
    pub fn plain(theta: f64, dim: usize) -> V4Rope {
        V4Rope {
            inv_freq: (0..dim / 2)
                .map(|i| 1.0 / (theta as f32).powf((2 * i) as f32 / dim as f32))
                .collect(),
        }
    }

    /// Compressed layers: base `compress_rope_theta`, YaRN ramp as [REF] `precompute_freqs_cis`
    /// (floor/ceil correction range, no mscale).
    pub fn yarn(theta: f64, dim: usize, y: Option<&V4Yarn>) -> V4Rope {
        let mut r = V4Rope::plain(theta, dim);
        let Some(y) = y else { return r };
        let corr = |rot: f64| {
            dim as f64
                * (y.original_max_position_embeddings as f64 / (rot * 2.0 * std::f64::consts::PI))
                    .ln()
                / (2.0 * theta.ln())
        };
        let low = corr(y.beta_fast).floor().max(0.0);
        let mut high = corr(y.beta_slow).ceil().min(dim as f64 - 1.0);
        if low == high {
            high += 0.001;
        }
        let factor = y.factor as f32;
        for (i, f) in r.inv_freq.iter_mut().enumerate() {
            let ramp = ((i as f32 - low as f32) / (high as f32 - low as f32)).clamp(0.0, 1.0);
            let smooth = 1.0 - ramp;
            *f = *f / factor * (1.0 - smooth) + *f * smooth;
        }
        r
    }

    pub fn half(&self) -> usize {
        self.inv_freq.len()
    }

    pub fn cos_sin(&self, pos: usize, cos: &mut [f32], sin: &mut [f32]) {
        let p = pos as f32;
        for ((c, s), &f) in cos.iter_mut().zip(sin.iter_mut()).zip(&self.inv_freq) {
            let a = p * f;
            *c = a.cos();
            *s = a.sin();
        }
    }

    /// Rotates the interleaved pairs of `x` (the rope slice, 2·half long) by e^{iθ}, or by e^{−iθ}
    /// when `inverse`.
    pub fn apply(x: &mut [f32], cos: &[f32], sin: &[f32], inverse: bool) {
        for (i, pair) in x.chunks_exact_mut(2).enumerate() {
            let (c, s) = (cos[i], if inverse { -sin[i] } else { sin[i] });
            let (a, b) = (pair[0], pair[1]);
            pair[0] = a * c - b * s;
            pair[1] = a * s + b * c;
        }
    }
}

/// x ← x·H_n/√n with the Sylvester Hadamard matrix in natural order (n a power of two).
pub fn hadamard_in_place(x: &mut [f32]) {
    let n = x.len();
    debug_assert!(n.is_power_of_two());
    let mut h = 1;
    while h < n {
        for i in (0..n).step_by(2 * h) {
            for j in i..i + h {
                let (a, b) = (x[j], x[j + h]);
                x[j] = a + b;
                x[j + h] = a - b;
            }
        }
        h *= 2;
    }
    k::scale_in_place(x, 1.0 / (n as f32).sqrt());
}

/// Attention of one query head over `keys` (K = V) with a sink logit (spec §2.6):
/// `o = Σ_j e^{s_j−m} k_j / (Σ_j e^{s_j−m} + e^{sink−m})`, `s_j = scale·q·k_j`, m = max_j s_j.
/// With no keys the output is 0. `scores` is scratch.
pub fn attend_with_sink(
    q: &[f32],
    keys: &[&[f32]],
    sink: f32,
    scale: f32,
    scores: &mut Vec<f32>,
    out: &mut [f32],
) {
    out.fill(0.0);
    if keys.is_empty() {
        return;
    }
    scores.clear();
    scores.extend(keys.iter().map(|kj| scale * k::dot(q, kj)));
    let m = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut denom = 0.0f32;
    for s in scores.iter_mut() {
        *s = (*s - m).exp();
        denom += *s;
    }
    denom += (sink - m).exp();
    let inv = 1.0 / denom;
    for (kj, &w) in keys.iter().zip(scores.iter()) {
        k::axpy(w * inv, kj, out);
    }
}

/// Gated pooling of one compressed entry (spec §2.7): per channel c, a softmax over the
/// candidates' gate scores `z[c]` weights their values `a[c]`. Each candidate is `(a, z)`, both
/// `out.len()` long (the caller has already picked the overlap halves and added the ape).
pub fn pool_compressed(cands: &[(&[f32], &[f32])], out: &mut [f32]) {
    for (c, o) in out.iter_mut().enumerate() {
        let m = cands
            .iter()
            .map(|(_, z)| z[c])
            .fold(f32::NEG_INFINITY, f32::max);
        let mut den = 0.0f32;
        let mut num = 0.0f32;
        for (a, z) in cands {
            let w = (z[c] - m).exp();
            den += w;
            num += w * a[c];
        }
        *o = num / den;
    }
}

/// Router score of one logit (spec §2.9; softmax is handled over the whole row in [`route_v4`]).
fn score(l: f32, f: ScoringFunc) -> f32 {
    match f {
        // torch softplus: threshold 20. ln(1 + e^l) through f64's `ln_1p`: glibc's f32
        // `log1pf` gives other bits on aarch64 than on x86-64 (its f64 `log1p`, `expf` do not),
        // and a model's outputs should not depend on the CPU (`tools/cross_aarch64.sh`).
        ScoringFunc::SqrtSoftplus => {
            let sp = if l > 20.0 {
                l
            } else {
                (l.exp() as f64).ln_1p() as f32
            };
            sp.sqrt()
        }
        ScoringFunc::Sigmoid => 1.0 / (1.0 + (-l).exp()),
        ScoringFunc::Softmax => l,
    }
}

/// V4 routing (spec §2.9, [REF] `Gate`): scores from the logits; experts = `hash` (tid2eid row)
/// or the top-k of score + bias (ties to the lower index, no groups); weights = the unbiased
/// scores of the chosen experts, renormalised unless the scoring is softmax, times `route_scale`.
pub fn route_v4(
    logits: &[f32],
    bias: Option<&[f32]>,
    hash: Option<&[u32]>,
    top_k: usize,
    scoring: ScoringFunc,
    route_scale: f32,
) -> (Vec<usize>, Vec<f32>) {
    let mut scores: Vec<f32> = logits.iter().map(|&l| score(l, scoring)).collect();
    if scoring == ScoringFunc::Softmax {
        k::softmax_in_place(&mut scores);
    }
    let ids: Vec<usize> = match hash {
        Some(h) => h.iter().map(|&e| e as usize).collect(),
        None => match bias {
            Some(b) => {
                let biased: Vec<f32> = scores.iter().zip(b).map(|(s, b)| s + b).collect();
                top_indices(&biased, top_k)
            }
            None => top_indices(&scores, top_k),
        },
    };
    let mut w: Vec<f32> = ids.iter().map(|&i| scores[i]).collect();
    if scoring != ScoringFunc::Softmax {
        let s: f32 = w.iter().sum();
        for v in &mut w {
            *v /= s;
        }
    }
    for v in &mut w {
        *v *= route_scale;
    }
    (ids, w)
}

/// `silu(min(g, limit)) · clamp(u, ±limit)` (spec §2.9; `limit` 0 = no clamp) into `out`.
pub fn swiglu_clamped(g: &mut [f32], u: &mut [f32], limit: f32, out: &mut [f32]) {
    if limit > 0.0 {
        for v in g.iter_mut() {
            *v = v.min(limit);
        }
        for v in u.iter_mut() {
            *v = v.clamp(-limit, limit);
        }
    }
    k::silu_mul(g, u, out);
}

/// 2^ceil(log2 v) for a positive normal f32, from its bits (exponent − 127, plus 1 if any
/// mantissa bit is set), as [REF]'s ue8m0 scales (spec §2.12).
fn pow2_ceil(v: f32) -> f32 {
    let bits = v.to_bits();
    let e = ((bits >> 23) & 0xFF) as i32 - 127 + i32::from(bits & 0x7F_FFFF != 0);
    2f32.powi(e)
}

/// [REF] `act_quant` round trip with ue8m0 scales (spec §2.12): per block of `block` values,
/// `s = 2^ceil(log2(max(amax, 1e-4) · f32(1/448)))`, `x ← e4m3_RNE(clamp(x/s, ±448)) · s`.
pub fn fp8_round_trip(x: &mut [f32], block: usize) {
    for b in x.chunks_mut(block) {
        let amax = b.iter().fold(0.0f32, |m, v| m.max(v.abs())).max(1e-4);
        let s = pow2_ceil(amax * (1.0f32 / 448.0));
        for v in b.iter_mut() {
            let q = k::fp8::f32_to_e4m3((*v / s).clamp(-448.0, 448.0));
            *v = k::fp8::e4m3_to_f32(q) * s;
        }
    }
}

/// The fp8 cache's encoding of a compressed entry and its indexer key (spec §2.12 and §3: the
/// seed's fp8 cache keeps an entry's nope dims as e4m3 with one ue8m0 scale per 64 values and
/// its RoPE dims in bf16). Entry: `nope` e4m3 codes, `⌈nope/64⌉` scale bytes, `rope` bf16
/// values (little-endian); indexer key: `index` e4m3 codes, `⌈index/32⌉` scale bytes. A scale
/// byte `b` means `2^(b−127)`. The nope scales follow [REF]'s `act_quant` rule
/// ([`fp8_round_trip`] with block 64), so with the quantisation sims on an entry is stored with
/// no loss; an indexer key after [REF]'s FP4 round trip (block 32) is e2m1 × 2^k, which e4m3
/// × a per-32 power of two holds exactly too.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fp8Codec {
    pub nope: usize,
    pub rope: usize,
    pub index: usize,
}

/// Values per scale of the nope dims and of an indexer key.
const FP8_NOPE_BLOCK: usize = 64;
const FP8_KEY_BLOCK: usize = 32;

impl Fp8Codec {
    /// Bytes of an encoded entry.
    pub fn entry_bytes(&self) -> usize {
        self.nope + self.nope.div_ceil(FP8_NOPE_BLOCK) + 2 * self.rope
    }

    /// Bytes of an encoded indexer key.
    pub fn key_bytes(&self) -> usize {
        self.index + self.index.div_ceil(FP8_KEY_BLOCK)
    }

    /// Encodes `entry` (`nope + rope` values) into `out` ([`Fp8Codec::entry_bytes`]).
    pub fn encode_entry(&self, entry: &[f32], out: &mut [i8]) {
        let (codes, rest) = out.split_at_mut(self.nope);
        let (scales, rope) = rest.split_at_mut(self.nope.div_ceil(FP8_NOPE_BLOCK));
        fp8_encode_blocks(&entry[..self.nope], FP8_NOPE_BLOCK, 1e-4, codes, scales);
        for (d, &x) in rope
            .chunks_exact_mut(2)
            .zip(&entry[self.nope..self.nope + self.rope])
        {
            let b = k::f32_to_bf16(x).to_le_bytes();
            d[0] = b[0] as i8;
            d[1] = b[1] as i8;
        }
    }

    /// Decodes an entry encoded by [`Fp8Codec::encode_entry`] into `out` (`nope + rope`).
    pub fn decode_entry(&self, bytes: &[i8], out: &mut [f32]) {
        let (codes, rest) = bytes.split_at(self.nope);
        let (scales, rope) = rest.split_at(self.nope.div_ceil(FP8_NOPE_BLOCK));
        fp8_decode_blocks(codes, scales, FP8_NOPE_BLOCK, &mut out[..self.nope]);
        for (d, b) in out[self.nope..self.nope + self.rope]
            .iter_mut()
            .zip(rope.chunks_exact(2))
        {
            *d = k::bf16_to_f32(u16::from_le_bytes([b[0] as u8, b[1] as u8]));
        }
    }

    /// Encodes an indexer key (`index` values) into `out` ([`Fp8Codec::key_bytes`]).
    pub fn encode_key(&self, key: &[f32], out: &mut [i8]) {
        let (codes, scales) = out.split_at_mut(self.index);
        // The floor keeps the scale a normal power of two (ue8m0 byte ≥ 1).
        fp8_encode_blocks(key, FP8_KEY_BLOCK, 448.0 * f32::MIN_POSITIVE, codes, scales);
    }

    /// Decodes an indexer key encoded by [`Fp8Codec::encode_key`] into `out`.
    pub fn decode_key(&self, bytes: &[i8], out: &mut [f32]) {
        let (codes, scales) = bytes.split_at(self.index);
        fp8_decode_blocks(codes, scales, FP8_KEY_BLOCK, out);
    }

    /// What the cache will give back for `entry`, in place (decode of encode).
    pub fn round_trip_entry(&self, entry: &mut [f32]) {
        let mut b = vec![0i8; self.entry_bytes()];
        self.encode_entry(entry, &mut b);
        self.decode_entry(&b, entry);
    }

    /// What the cache will give back for an indexer key, in place.
    pub fn round_trip_key(&self, key: &mut [f32]) {
        let mut b = vec![0i8; self.key_bytes()];
        self.encode_key(key, &mut b);
        self.decode_key(&b, key);
    }
}

/// Per block of `block` values: `s = 2^ceil(log2(max(amax, floor)/448))` (as [`fp8_round_trip`]
/// computes it), the e4m3 code of `clamp(v/s, ±448)` (ties to even) and the scale's ue8m0 byte.
fn fp8_encode_blocks(x: &[f32], block: usize, floor: f32, codes: &mut [i8], scales: &mut [i8]) {
    for ((b, c), sc) in x
        .chunks(block)
        .zip(codes.chunks_mut(block))
        .zip(scales.iter_mut())
    {
        let amax = b.iter().fold(0.0f32, |m, v| m.max(v.abs())).max(floor);
        let s = pow2_ceil(amax * (1.0f32 / 448.0));
        let e = ((s.to_bits() >> 23) & 0xFF) as u8;
        *sc = e as i8;
        let inv = 1.0 / s;
        for (d, &v) in c.iter_mut().zip(b) {
            *d = k::fp8::f32_to_e4m3((v * inv).clamp(-448.0, 448.0)) as i8;
        }
    }
}

/// The values of blocks encoded by [`fp8_encode_blocks`].
fn fp8_decode_blocks(codes: &[i8], scales: &[i8], block: usize, out: &mut [f32]) {
    let table = k::fp8::e4m3_table();
    for ((o, c), &sc) in out.chunks_mut(block).zip(codes.chunks(block)).zip(scales) {
        let s = f32::from_bits(u32::from(sc as u8) << 23);
        for (d, &q) in o.iter_mut().zip(c) {
            *d = table[q as u8 as usize] * s;
        }
    }
}

/// e2m1 value nearest to `v` (|v| ≤ 6), ties to the even code.
pub fn e2m1_round(v: f32) -> f32 {
    let a = v.abs();
    let mut best = 0usize;
    for (i, &g) in E2M1_VALUES[..8].iter().enumerate().skip(1) {
        let (d, db) = ((g - a).abs(), (E2M1_VALUES[best] - a).abs());
        if d < db || (d == db && i % 2 == 0) {
            best = i;
        }
    }
    E2M1_VALUES[best].copysign(v)
}

/// [REF] FP4 round trip (spec §2.12): per block of `block` values, `a = max(amax, 6·2^−126)`,
/// `s = 2^ceil(log2(a/6))`, `x ← e2m1_RNE(clamp(x/s, ±6)) · s`.
pub fn fp4_round_trip(x: &mut [f32], block: usize) {
    for b in x.chunks_mut(block) {
        let amax = b
            .iter()
            .fold(0.0f32, |m, v| m.max(v.abs()))
            .max(6.0 * f32::MIN_POSITIVE);
        let s = pow2_ceil(amax / 6.0);
        for v in b.iter_mut() {
            *v = e2m1_round((*v / s).clamp(-6.0, 6.0)) * s;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lcg(seed: &mut u64) -> f32 {
        *seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((*seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }

    fn rand_vec(n: usize, seed: &mut u64, amp: f32) -> Vec<f32> {
        (0..n).map(|_| lcg(seed) * amp).collect()
    }

    #[test]
    fn e8m0_and_e2m1_tables_are_exact() {
        for b in 0u8..=254 {
            let v = e8m0_to_f32(b).unwrap();
            assert_eq!(v as f64, 2f64.powi(b as i32 - 127), "e8m0 {b}");
        }
        assert!(e8m0_to_f32(255).is_none());
        for n in 0..16u8 {
            let s = if n & 8 != 0 { -1.0 } else { 1.0 };
            let e = (n >> 1) & 3;
            let m = (n & 1) as f32;
            let v = if e == 0 {
                s * m * 0.5
            } else {
                s * (1.0 + m / 2.0) * 2f32.powi(e as i32 - 1)
            };
            assert_eq!(E2M1_VALUES[n as usize], v, "e2m1 {n}");
            assert_eq!(E2M1_VALUES[n as usize].is_sign_negative(), n & 8 != 0);
        }
    }

    #[test]
    fn mxfp4_nibble_order_and_scales() {
        // Row 0: column 0 = low nibble of byte 0 (code 3 = 1.5), column 1 = high nibble (code
        // 0xA = −1.0); group 0 scale 2^1, group 1 scale 2^-2.
        let rows = 2;
        let cols = 64;
        let mut packed = vec![0u8; rows * cols / 2];
        packed[0] = 0xA3;
        packed[16] = 0x07; // column 32 = 6.0
        packed[32 + 31] = 0xF0; // row 1, column 63 = −6.0
        let scales = [128u8, 125, 127, 127];
        let mut out = vec![f32::NAN; rows * cols];
        decode_mxfp4(&packed, &scales, rows, cols, &mut out).unwrap();
        assert_eq!(out[0], 3.0);
        assert_eq!(out[1], -2.0);
        assert_eq!(out[32], 6.0 * 0.25);
        assert_eq!(out[cols + 63], -6.0);
        assert_eq!(out[2], 0.0);
        let bad = [255u8, 127, 127, 127];
        assert_eq!(
            decode_mxfp4(&packed, &bad, rows, cols, &mut out),
            Err((0, 0))
        );
    }

    #[test]
    fn sinkhorn_is_doubly_stochastic_and_in_range() {
        let mut seed = 7;
        for _ in 0..20 {
            // Mixing logits of a few units, as trained models produce; very peaked logits
            // converge more slowly (rows are then only approximately normalised after 20
            // iterations, while columns are always normalised last).
            let m = rand_vec(24, &mut seed, 1.0);
            let base = rand_vec(24, &mut seed, 1.0);
            let scale = rand_vec(3, &mut seed, 1.0);
            let (pre, post, comb) = hc_split_sinkhorn(&m, &scale, &base, 4, 20, 1e-6);
            for j in 0..4 {
                let row: f32 = comb[j * 4..j * 4 + 4].iter().sum();
                let col: f32 = (0..4).map(|r| comb[r * 4 + j]).sum();
                assert!((row - 1.0).abs() < 1e-5, "row {row}");
                assert!((col - 1.0).abs() < 1e-5, "col {col}");
            }
            assert!(pre.iter().all(|&p| p > 1e-6 && p <= 1.0 + 1e-6));
            assert!(post.iter().all(|&p| p > 0.0 && p < 2.0));
        }
    }

    #[test]
    fn hc_expand_uses_comb_rows_as_sources() {
        // comb[j][k]: source j → destination k. A permutation-like comb moves stream 0 to 1.
        let d = 3;
        let mut x = vec![1.0, 1.0, 1.0, 2.0, 2.0, 2.0];
        let comb = [0.0, 1.0, 1.0, 0.0];
        hc_expand(&[10.0, 20.0, 30.0], &mut x, &[0.5, 0.0], &comb);
        assert_eq!(&x[..d], &[7.0, 12.0, 17.0]);
        assert_eq!(&x[d..], &[1.0, 1.0, 1.0]);
    }

    #[test]
    fn rope_tables_and_inverse() {
        let y = V4Yarn {
            factor: 16.0,
            original_max_position_embeddings: 65536,
            beta_fast: 32.0,
            beta_slow: 1.0,
        };
        let plain = V4Rope::plain(160000.0, 64);
        let yarn = V4Rope::yarn(160000.0, 64, Some(&y));
        assert_eq!(yarn.half(), 32);
        for i in 0..32 {
            if i <= 15 {
                assert_eq!(yarn.inv_freq[i], plain.inv_freq[i], "{i}");
            }
            if i >= 25 {
                let want = plain.inv_freq[i] / 16.0;
                assert!((yarn.inv_freq[i] - want).abs() <= want * 1e-6, "{i}");
            }
        }
        let win = V4Rope::yarn(10000.0, 64, None);
        assert_eq!(win.inv_freq, V4Rope::plain(10000.0, 64).inv_freq);
        assert!((win.inv_freq[1] - 10000f32.powf(-2.0 / 64.0)).abs() < 1e-7);
        let mut seed = 3;
        let x = rand_vec(64, &mut seed, 1.0);
        let mut v = x.clone();
        let (mut c, mut s) = (vec![0.0; 32], vec![0.0; 32]);
        yarn.cos_sin(12345, &mut c, &mut s);
        V4Rope::apply(&mut v, &c, &s, false);
        assert!(v.iter().zip(&x).any(|(a, b)| (a - b).abs() > 1e-3));
        V4Rope::apply(&mut v, &c, &s, true);
        for (a, b) in v.iter().zip(&x) {
            assert!((a - b).abs() < 1e-5);
        }
        // Relative: q(p)·k(p') depends on p − p' only.
        let q = rand_vec(64, &mut seed, 1.0);
        let kk = rand_vec(64, &mut seed, 1.0);
        let dotp = |pq: usize, pk: usize| {
            let (mut c, mut s) = (vec![0.0; 32], vec![0.0; 32]);
            let (mut a, mut b) = (q.clone(), kk.clone());
            yarn.cos_sin(pq, &mut c, &mut s);
            V4Rope::apply(&mut a, &c, &s, false);
            yarn.cos_sin(pk, &mut c, &mut s);
            V4Rope::apply(&mut b, &c, &s, false);
            k::dot(&a, &b)
        };
        assert!((dotp(10, 3) - dotp(110, 103)).abs() < 1e-4);
    }

    #[test]
    fn hadamard_is_orthonormal_sylvester() {
        let mut e1 = vec![0.0f32; 8];
        e1[1] = 1.0;
        hadamard_in_place(&mut e1);
        let s = 1.0 / 8f32.sqrt();
        assert_eq!(e1, vec![s, -s, s, -s, s, -s, s, -s]);
        let mut seed = 5;
        let a = rand_vec(128, &mut seed, 1.0);
        let b = rand_vec(128, &mut seed, 1.0);
        let (mut ha, mut hb) = (a.clone(), b.clone());
        hadamard_in_place(&mut ha);
        hadamard_in_place(&mut hb);
        assert!((k::dot(&a, &b) - k::dot(&ha, &hb)).abs() < 1e-4);
    }

    #[test]
    fn sparse_attention_equals_dense_with_sink_column() {
        let mut seed = 11;
        let d = 16;
        let q = rand_vec(d, &mut seed, 1.0);
        let keys: Vec<Vec<f32>> = (0..9).map(|_| rand_vec(d, &mut seed, 1.0)).collect();
        let refs: Vec<&[f32]> = keys.iter().map(Vec::as_slice).collect();
        let sink = 0.7;
        let scale = 0.25;
        let mut out = vec![0.0; d];
        let mut sc = Vec::new();
        attend_with_sink(&q, &refs, sink, scale, &mut sc, &mut out);
        // Dense: softmax over [scores..., sink] with the sink's value = 0.
        let mut logits: Vec<f32> = keys.iter().map(|kj| scale * k::dot(&q, kj)).collect();
        logits.push(sink);
        k::softmax_in_place(&mut logits);
        let mut dense = vec![0.0; d];
        for (kj, &p) in keys.iter().zip(&logits) {
            k::axpy(p, kj, &mut dense);
        }
        for (a, b) in out.iter().zip(&dense) {
            assert!((a - b).abs() < 1e-6);
        }
        // Order does not matter.
        let mut rev = refs.clone();
        rev.reverse();
        let mut out2 = vec![0.0; d];
        attend_with_sink(&q, &rev, sink, scale, &mut sc, &mut out2);
        for (a, b) in out.iter().zip(&out2) {
            assert!((a - b).abs() < 1e-6);
        }
        // sink → −∞: plain softmax.
        attend_with_sink(&q, &refs, f32::NEG_INFINITY, scale, &mut sc, &mut out2);
        let mut p: Vec<f32> = keys.iter().map(|kj| scale * k::dot(&q, kj)).collect();
        k::softmax_in_place(&mut p);
        let mut plain = vec![0.0; d];
        for (kj, &w) in keys.iter().zip(&p) {
            k::axpy(w, kj, &mut plain);
        }
        for (a, b) in out2.iter().zip(&plain) {
            assert!((a - b).abs() < 1e-6);
        }
    }

    /// [REF]'s decode-time compressor state machine (spec §3.3 step 2), written independently
    /// of the position-addressable pooling: rows 0..r−1 previous block, r..2r−1 current (overlap);
    /// −∞ score init; shift after emission.
    fn ref_state_machine(a: &[Vec<f32>], z: &[Vec<f32>], r: usize, d: usize) -> Vec<Vec<f32>> {
        let overlap = r == 4;
        let coff = if overlap { 2 } else { 1 };
        let rows = coff * r;
        let mut kv = vec![vec![0.0f32; coff * d]; rows];
        let mut sc = vec![vec![f32::NEG_INFINITY; coff * d]; rows];
        let mut entries = Vec::new();
        for p in 0..a.len() {
            let row = if overlap { r + p % r } else { p % r };
            kv[row] = a[p].clone();
            sc[row] = z[p].clone();
            if (p + 1) % r == 0 {
                let mut e = vec![0.0f32; d];
                for c in 0..d {
                    let cands: Vec<(f32, f32)> = if overlap {
                        (0..r)
                            .map(|i| (kv[i][c], sc[i][c]))
                            .chain((r..2 * r).map(|i| (kv[i][d + c], sc[i][d + c])))
                            .collect()
                    } else {
                        (0..r).map(|i| (kv[i][c], sc[i][c])).collect()
                    };
                    let m = cands.iter().map(|x| x.1).fold(f32::NEG_INFINITY, f32::max);
                    let den: f32 = cands.iter().map(|x| (x.1 - m).exp()).sum();
                    e[c] = cands.iter().map(|x| (x.1 - m).exp() / den * x.0).sum();
                }
                entries.push(e);
                if overlap {
                    for i in 0..r {
                        kv[i] = kv[r + i].clone();
                        sc[i] = sc[r + i].clone();
                    }
                }
            }
        }
        entries
    }

    /// The engine's rule: entry j pools block j's tokens (second half with overlap) and, with
    /// overlap and j > 0, block j−1's first halves, read by position.
    fn by_position(a: &[Vec<f32>], z: &[Vec<f32>], r: usize, d: usize) -> Vec<Vec<f32>> {
        let overlap = r == 4;
        let n = a.len() / r;
        (0..n)
            .map(|j| {
                let mut cands: Vec<(&[f32], &[f32])> = Vec::new();
                if overlap && j > 0 {
                    for p in (j - 1) * r..j * r {
                        cands.push((&a[p][..d], &z[p][..d]));
                    }
                }
                let off = if overlap { d } else { 0 };
                for p in j * r..(j + 1) * r {
                    cands.push((&a[p][off..off + d], &z[p][off..off + d]));
                }
                let mut e = vec![0.0; d];
                pool_compressed(&cands, &mut e);
                e
            })
            .collect()
    }

    #[test]
    fn compressor_by_position_equals_reference_state_machine() {
        for r in [4usize, 128] {
            let d = 8;
            let coff = if r == 4 { 2 } else { 1 };
            for n in [1usize, 2, 3, 4, 7, 8, 130, 257] {
                let mut seed = (n * 31 + r) as u64;
                let a: Vec<Vec<f32>> = (0..n).map(|_| rand_vec(coff * d, &mut seed, 2.0)).collect();
                let z: Vec<Vec<f32>> = (0..n).map(|_| rand_vec(coff * d, &mut seed, 3.0)).collect();
                let want = ref_state_machine(&a, &z, r, d);
                let got = by_position(&a, &z, r, d);
                assert_eq!(got.len(), n / r, "r {r} n {n}");
                assert_eq!(want.len(), got.len());
                for (g, w) in got.iter().zip(&want) {
                    for (x, y) in g.iter().zip(w) {
                        assert!(
                            (x - y).abs() <= 1e-6 * (1.0 + y.abs()),
                            "r {r} n {n}: {x} {y}"
                        );
                    }
                }
            }
        }
        // Entry 0 with overlap ignores the "previous" half entirely.
        let d = 2;
        let mut a: Vec<Vec<f32>> = (0..4).map(|i| vec![100.0, 100.0, i as f32, 1.0]).collect();
        let z: Vec<Vec<f32>> = (0..4).map(|_| vec![50.0, 50.0, 0.0, 0.0]).collect();
        let e = by_position(&a, &z, 4, d);
        assert_eq!(e[0], vec![1.5, 1.0]);
        a[0][0] = -1e9;
        assert_eq!(by_position(&a, &z, 4, d)[0], vec![1.5, 1.0]);
    }

    #[test]
    fn routing_hash_bias_and_weights() {
        let logits = [0.3, -1.0, 2.0, 0.5, 25.0, -30.0];
        let bias = [0.0, 10.0, 0.0, 0.0, 0.0, 0.0];
        let (ids, w) = route_v4(
            &logits,
            Some(&bias),
            None,
            2,
            ScoringFunc::SqrtSoftplus,
            1.5,
        );
        assert_eq!(ids, vec![1, 4]); // the bias selects expert 1 …
        let s = |l: f32| l.exp().ln_1p().sqrt();
        let (s1, s4) = (s(-1.0), 25f32.sqrt()); // … but the weight comes from the raw score
        assert!((w[0] - 1.5 * s1 / (s1 + s4)).abs() < 1e-6);
        assert!((w.iter().sum::<f32>() - 1.5).abs() < 1e-6);
        let (ids, w) = route_v4(
            &logits,
            None,
            Some(&[5, 0]),
            2,
            ScoringFunc::SqrtSoftplus,
            2.5,
        );
        assert_eq!(ids, vec![5, 0]);
        assert!((w.iter().sum::<f32>() - 2.5).abs() < 1e-6);
    }

    #[test]
    fn swiglu_clamp_is_asymmetric() {
        let mut g = vec![12.0, -50.0, 3.0];
        let mut u = vec![20.0, -20.0, 5.0];
        let mut out = vec![0.0; 3];
        swiglu_clamped(&mut g, &mut u, 10.0, &mut out);
        assert_eq!(g, vec![10.0, -50.0, 3.0]);
        assert_eq!(u, vec![10.0, -10.0, 5.0]);
        let silu = |x: f32| x / (1.0 + (-x).exp());
        assert!((out[0] - silu(10.0) * 10.0).abs() < 1e-4);
        assert!((out[1] - silu(-50.0) * -10.0).abs() < 1e-6);
        let mut g = vec![12.0];
        let mut u = vec![20.0];
        swiglu_clamped(&mut g, &mut u, 0.0, &mut out[..1]);
        assert_eq!((g[0], u[0]), (12.0, 20.0));
    }
    #[test]
    fn fp8_round_trip_matches_ref_act_quant() {
        // amax 1.0: s = 2^ceil(log2(1/448)) = 2^-8; 0.3 / 2^-8 = 76.8 → e4m3 (step 8 in
        // [64, 128)) 80 → 80·2^-8 = 0.3125.
        let mut x = vec![1.0, 0.3, -0.001, 0.0];
        fp8_round_trip(&mut x, 4);
        assert_eq!(x[0], 1.0);
        assert_eq!(x[1], 0.3125);
        assert_eq!(x[3], 0.0);
        // -0.001 / 2^-8 = -0.256 → e4m3 step 2^-5 in [0.25, 0.5): -0.25 → ×2^-8.
        assert_eq!(x[2], -0.25 / 256.0);
        // Idempotent, and every block's values are e4m3 codes times one power of two.
        let mut seed = 9;
        let mut y = rand_vec(300, &mut seed, 3.0);
        fp8_round_trip(&mut y, 128);
        let z = y.clone();
        fp8_round_trip(&mut y, 128);
        assert_eq!(y, z);
        // Tiny blocks use the 1e-4 floor: s = 2^ceil(log2(1e-4/448)) = 2^-22, and 1e-9/s =
        // 0.0042 rounds to the e4m3 subnormal 2·2^-9.
        let mut t = vec![1e-9f32, 0.0];
        fp8_round_trip(&mut t, 2);
        assert_eq!(t[0], 2f32.powi(-30));
    }

    #[test]
    fn fp8_cache_codec_is_refs_round_trip_and_keeps_sim_values_exactly() {
        let c = Fp8Codec {
            nope: 448,
            rope: 64,
            index: 128,
        };
        assert_eq!((c.entry_bytes(), c.key_bytes()), (448 + 7 + 128, 128 + 4));
        let mut seed = 5;
        for amp in [1e-6f32, 0.01, 1.0, 30.0, 1e4] {
            let mut e = rand_vec(512, &mut seed, amp);
            // A block of zeros and a block far smaller than the rest.
            e[64..128].iter_mut().for_each(|v| *v = 0.0);
            e[128..192].iter_mut().for_each(|v| *v *= 1e-9);
            let mut want = e.clone();
            fp8_round_trip(&mut want[..448], 64);
            want[448..].iter_mut().for_each(|v| *v = k::bf16_round(*v));
            let mut got = e.clone();
            c.round_trip_entry(&mut got);
            assert_eq!(got, want, "amp {amp}");
            // Stored values come back unchanged (the CP scratch and the cache agree).
            let mut again = got.clone();
            c.round_trip_entry(&mut again);
            assert_eq!(again, got);
            // Indexer keys after [REF]'s FP4 round trip are kept exactly; others within e4m3.
            let mut key = rand_vec(128, &mut seed, amp);
            key[32..64].iter_mut().for_each(|v| *v *= 1e-12);
            let mut sim = key.clone();
            fp4_round_trip(&mut sim, 32);
            let mut kept = sim.clone();
            c.round_trip_key(&mut kept);
            assert_eq!(kept, sim, "amp {amp}");
            let mut q = key.clone();
            c.round_trip_key(&mut q);
            for (blk, (a, b)) in key.chunks(32).zip(q.chunks(32)).enumerate() {
                let amax = a.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                for (x, y) in a.iter().zip(b) {
                    // e4m3: 3 mantissa bits (half a step: 1/16 relative), or the subnormal step.
                    assert!(
                        (x - y).abs() <= x.abs() / 16.0 + amax / 448.0 * 2f32.powi(-8),
                        "block {blk}: {x} vs {y}"
                    );
                }
            }
        }
        // The byte layout: codes, then one scale byte per block, then bf16 rope.
        let mut e = vec![0.0f32; 512];
        e[0] = 1.0;
        e[448] = 1.5;
        let mut b = vec![0i8; c.entry_bytes()];
        c.encode_entry(&e, &mut b);
        // amax 1: s = 2^-8 (byte 119), 1/s = 256 → e4m3 0x78 (2^8).
        assert_eq!((b[0] as u8, b[448] as u8), (0x78, 119));
        assert_eq!(
            u16::from_le_bytes([b[455] as u8, b[456] as u8]),
            k::f32_to_bf16(1.5)
        );
    }

    #[test]
    fn fp4_round_trip_grid_and_ties() {
        assert_eq!(e2m1_round(0.25), 0.0);
        assert_eq!(e2m1_round(0.75), 1.0);
        assert_eq!(e2m1_round(1.25), 1.0);
        assert_eq!(e2m1_round(1.75), 2.0);
        assert_eq!(e2m1_round(2.5), 2.0);
        assert_eq!(e2m1_round(3.5), 4.0);
        assert_eq!(e2m1_round(5.0), 4.0);
        assert_eq!(e2m1_round(-5.1), -6.0);
        // amax 3: s = 2^ceil(log2(0.5)) = 0.5; 3/0.5 = 6; 1.1/0.5 = 2.2 → 2 → 1.0.
        let mut x = vec![3.0, 1.1, -0.2, 0.0];
        fp4_round_trip(&mut x, 4);
        assert_eq!(x, vec![3.0, 1.0, -0.25, 0.0]);
        let mut seed = 4;
        let mut y = rand_vec(128, &mut seed, 2.0);
        fp4_round_trip(&mut y, 32);
        let z = y.clone();
        fp4_round_trip(&mut y, 32);
        assert_eq!(y, z);
    }
}
