//! Per-request sampling: penalties, temperature, top-k, top-p, min-p and a seeded RNG.
//!
//! Order of operations on one step's logits (Hugging Face `generate`'s processor order):
//! 0. vLLM's `allowed_token_ids` and `bad_words` set the logits of the tokens they rule out
//!    to −∞; then `logit_bias` (OpenAI, vLLM): each listed token's bias is added to its raw
//!    logit (−100 all but bans a token, +100 all but forces it);
//! 1. penalties on the biased logits —
//!    - `repetition_penalty` r (CTRL; HF `RepetitionPenaltyLogitsProcessor`, vLLM): every token
//!      seen in the prompt or the output so far has its logit divided by r if positive,
//!      multiplied by r if not;
//!    - `presence_penalty` p and `frequency_penalty` f (OpenAI, vLLM): a token generated c > 0
//!      times so far has `p + c·f` subtracted (output tokens only, not the prompt);
//! 2. temperature 0 means greedy: the arg-max of the penalised logits (lowest id on ties);
//!    otherwise logits are divided by the temperature and soft-maxed;
//! 3. top-k keeps the k most probable tokens (0 = off);
//! 4. top-p keeps the smallest most-probable prefix whose mass reaches p (1 = off);
//! 5. min-p keeps tokens whose probability is at least `min_p` × the top probability (0 = off;
//!    with `min_p_first`, vLLM's order, it comes before top-k and top-p instead, and top-p's
//!    mass is counted over its survivors);
//! 6. one draw from the renormalised survivors with the request's own ChaCha8 RNG.
//!
//! Randomness: the draw for a request's k-th generated token takes word k of the request's
//! ChaCha8 stream (`set_word_pos(k)`), so a token's draw does not depend on what was drawn
//! before it, nor on how the steps that produced it were cut (drafts, batches, preemption).
//!
//! Speculative decoding ([`Sampler::verify`]), as the seed system does (spec `executor.md`
//! §2.8): drafts are the MTP layer's most probable tokens (after steps 0–5 on its logits), and a
//! draft is accepted when it equals the token plain sampling draws from p at its position (with
//! that position's word); the emitted token is that draw whether the draft is accepted or not.
//! Every emitted token is therefore the token the request would have drawn without MTP: a
//! seeded request gives the same tokens with or without MTP, whatever its drafts, its batch or
//! the pool's size, and the output law is the main model's. (Rejection sampling with drafts
//! drawn from q — Leviathan et al. 2023 — accepts more often when p is spread out, min(p, q)
//! summed against p(argmax q), but its emitted tokens depend on the drafts, so a seeded run
//! would change with the pool's size, whose pressure cuts drafts.) Under greedy (temperature 0)
//! both rules are exact match with the main model's argmax, no random number drawn.
//!
//! Each request owns its [`Sampler`], so one batch can mix settings, and a seed makes a run
//! reproducible (ChaCha8's stream is fixed by its seed across platforms and releases).

use std::collections::HashMap;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum SamplingError {
    #[error("sampling parameter `{name}` = {value}: {why}")]
    BadParam {
        name: &'static str,
        value: f64,
        why: &'static str,
    },
}

#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct SamplingParams {
    /// 0 = greedy.
    pub temperature: f32,
    /// 0 = off.
    pub top_k: usize,
    /// 1 = off.
    pub top_p: f32,
    /// 0 = off.
    pub min_p: f32,
    /// 1 = off.
    pub repetition_penalty: f32,
    /// 0 = off.
    pub presence_penalty: f32,
    /// 0 = off.
    pub frequency_penalty: f32,
    /// None: seeded from the OS.
    pub seed: Option<u64>,
    /// (token id, bias) added to the logits before anything else; empty = off. Ids past the
    /// vocabulary are ignored here (the server refuses them).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub logit_bias: Vec<(u32, f32)>,
    /// vLLM's `min_tokens`: before this many generated tokens no stop token is drawn (the
    /// engine masks them) and no stop string ends the answer. 0 = off.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub min_tokens: usize,
    /// vLLM's filter order (its V1 sampler: min-p, an argmax-invariant processor, before top-k
    /// and top-p): top-p's mass is counted over the tokens min-p keeps. False: Hugging Face's
    /// order (top-k, top-p, then min-p), as steps 3-5 say. Only a request with both min-p and
    /// top-p sees the difference.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub min_p_first: bool,
    /// vLLM's `allowed_token_ids`: only these tokens may be drawn (sorted; empty = all).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub allowed_tokens: Vec<u32>,
    /// vLLM's `bad_words`, as token sequences: a sequence's last token may not be drawn where
    /// the output so far ends with the tokens before it (a one-token word never).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub bad_words: Vec<Vec<u32>>,
}

fn is_zero(n: &usize) -> bool {
    *n == 0
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seed: None,
            logit_bias: Vec::new(),
            min_tokens: 0,
            min_p_first: false,
            allowed_tokens: Vec::new(),
            bad_words: Vec::new(),
        }
    }
}

impl SamplingParams {
    pub fn greedy() -> Self {
        SamplingParams {
            temperature: 0.0,
            ..Default::default()
        }
    }

    pub fn validate(&self) -> Result<(), SamplingError> {
        let bad = |name, value: f32, why| {
            Err(SamplingError::BadParam {
                name,
                // (As the f32 reads, not its widened binary value: -0.1, not -0.10000000149…)
                value: value.to_string().parse().unwrap_or(value as f64),
                why,
            })
        };
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            return bad("temperature", self.temperature, "must be >= 0 (0 = greedy)");
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return bad("top_p", self.top_p, "must be in (0, 1]");
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return bad("min_p", self.min_p, "must be in [0, 1]");
        }
        if !(self.repetition_penalty > 0.0 && self.repetition_penalty.is_finite()) {
            return bad("repetition_penalty", self.repetition_penalty, "must be > 0");
        }
        if !self.presence_penalty.is_finite() {
            return bad("presence_penalty", self.presence_penalty, "must be finite");
        }
        if !self.frequency_penalty.is_finite() {
            return bad(
                "frequency_penalty",
                self.frequency_penalty,
                "must be finite",
            );
        }
        if let Some(&(_, b)) = self
            .logit_bias
            .iter()
            .find(|(_, b)| !(-100.0..=100.0).contains(b))
        {
            return bad("logit_bias", b, "each bias must be from -100 to 100");
        }
        Ok(())
    }

    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }
}

/// Where a sampler's random stream stands, so that a request moved to another engine (a KV
/// transfer from a prefill server to a decode server) draws there what it would have drawn here.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RngState {
    pub seed: [u8; 32],
    pub stream: u64,
    pub word_pos: u128,
}

pub struct Sampler {
    params: SamplingParams,
    rng: ChaCha8Rng,
    /// Tokens generated so far ([`Sampler::accept`]): the next draw takes this word of the
    /// stream.
    generated: u64,
    /// Tokens of the prompt (for the repetition penalty).
    prompt_tokens: Vec<u32>,
    /// How often each token has been generated.
    output_counts: HashMap<u32, u32>,
    /// The generated tokens in order (kept only for `bad_words`).
    output: Vec<u32>,
}

impl Sampler {
    pub fn new(params: SamplingParams, prompt: &[u32]) -> Result<Sampler, SamplingError> {
        params.validate()?;
        let rng = match params.seed {
            Some(s) => ChaCha8Rng::seed_from_u64(s),
            None => ChaCha8Rng::from_os_rng(),
        };
        let mut prompt_tokens = prompt.to_vec();
        prompt_tokens.sort_unstable();
        prompt_tokens.dedup();
        Ok(Sampler {
            params,
            rng,
            generated: 0,
            prompt_tokens,
            output_counts: HashMap::new(),
            output: Vec::new(),
        })
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Where the random stream stands.
    pub fn rng_state(&self) -> RngState {
        RngState {
            seed: self.rng.get_seed(),
            stream: self.rng.get_stream(),
            word_pos: self.rng.get_word_pos(),
        }
    }

    /// Continues the random stream from `state` (taken with [`Sampler::rng_state`]).
    pub fn set_rng_state(&mut self, state: RngState) {
        let mut rng = ChaCha8Rng::from_seed(state.seed);
        rng.set_stream(state.stream);
        rng.set_word_pos(state.word_pos);
        self.rng = rng;
    }

    /// Records a generated token (for the penalties).
    pub fn accept(&mut self, token: u32) {
        *self.output_counts.entry(token).or_insert(0) += 1;
        self.generated += 1;
        if !self.params.bad_words.is_empty() {
            self.output.push(token);
        }
    }

    /// Whether the request rules tokens out itself (`allowed_tokens`, `bad_words`).
    pub fn has_masks(&self) -> bool {
        !self.params.allowed_tokens.is_empty() || !self.params.bad_words.is_empty()
    }

    /// Step 0's masks alone: the logits of the tokens `allowed_tokens` and `bad_words` rule
    /// out set to −∞, in place.
    pub fn apply_masks(&self, logits: &mut [f32]) {
        let p = &self.params;
        if !p.allowed_tokens.is_empty() {
            let keep: Vec<(usize, f32)> = p
                .allowed_tokens
                .iter()
                .filter_map(|&t| logits.get(t as usize).map(|&x| (t as usize, x)))
                .collect();
            logits.fill(f32::NEG_INFINITY);
            for (t, x) in keep {
                logits[t] = x;
            }
        }
        for word in &p.bad_words {
            let Some((&last, before)) = word.split_last() else {
                continue;
            };
            if self.output.ends_with(before) {
                if let Some(l) = logits.get_mut(last as usize) {
                    *l = f32::NEG_INFINITY;
                }
            }
        }
    }

    /// Steps 0 and 1: the allowed tokens and bad words (the others' logits −∞), the logit
    /// bias, then the penalties, in place.
    pub fn apply_penalties(&self, logits: &mut [f32]) {
        let p = &self.params;
        self.apply_masks(logits);
        for &(t, b) in &p.logit_bias {
            if let Some(l) = logits.get_mut(t as usize) {
                *l += b;
            }
        }
        if p.repetition_penalty != 1.0 {
            let r = p.repetition_penalty;
            let seen = self.prompt_tokens.iter().copied().chain(
                self.output_counts
                    .keys()
                    .copied()
                    .filter(|t| self.prompt_tokens.binary_search(t).is_err()),
            );
            for t in seen {
                if let Some(l) = logits.get_mut(t as usize) {
                    *l = if *l > 0.0 { *l / r } else { *l * r };
                }
            }
        }
        if p.presence_penalty != 0.0 || p.frequency_penalty != 0.0 {
            for (&t, &c) in &self.output_counts {
                if let Some(l) = logits.get_mut(t as usize) {
                    *l -= p.presence_penalty + c as f32 * p.frequency_penalty;
                }
            }
        }
    }

    /// Steps 2-5: the distribution a token is drawn from, as (token, probability) pairs in
    /// decreasing probability, renormalised. Greedy gives one pair with probability 1.
    pub fn candidates(&self, logits: &[f32]) -> Vec<(u32, f32)> {
        let p = &self.params;
        let plain = p.logit_bias.is_empty()
            && p.allowed_tokens.is_empty()
            && p.bad_words.is_empty()
            && p.repetition_penalty == 1.0
            && p.presence_penalty == 0.0
            && p.frequency_penalty == 0.0;
        if p.is_greedy() && plain {
            // Nothing to change in the logits: no copy.
            return vec![(argmax(logits) as u32, 1.0)];
        }
        let mut l = logits.to_vec();
        self.apply_penalties(&mut l);
        if p.is_greedy() {
            let best = argmax(&l);
            return vec![(best as u32, 1.0)];
        }
        // Sort by logit, decreasing; ties to the lower id. NaN logits never survive.
        let mut order = sorted_by_logit(&l, p.top_k);
        if order.is_empty() {
            return vec![(argmax(&l) as u32, 1.0)];
        }
        let max = l[order[0] as usize] / p.temperature;
        let mut probs: Vec<f32> = order
            .iter()
            .map(|&i| (l[i as usize] / p.temperature - max).exp())
            .collect();
        let total: f32 = probs.iter().sum();
        if !total.is_finite() || total <= 0.0 {
            // A temperature so small that logit / temperature overflows (inf − inf = NaN): the
            // distribution is the greedy one.
            return vec![(order[0], 1.0)];
        }
        probs.iter_mut().for_each(|x| *x /= total);
        // Tokens of probability 0 (masked to −∞, as JSON mode does, or far below the others)
        // are never drawn, not even by the last-candidate fallback of a rounding shortfall.
        let mut keep = probs.iter().take_while(|&&x| x > 0.0).count().max(1);
        let min_p_keep = |keep: usize| {
            let threshold = p.min_p * probs[0];
            keep.min(probs.iter().take_while(|&&x| x >= threshold).count().max(1))
        };
        if p.min_p > 0.0 && p.min_p_first {
            keep = min_p_keep(keep);
        }
        if p.top_p < 1.0 {
            // (vLLM's order: the mass of min-p's survivors, renormalised.)
            let mass: f32 = if p.min_p_first {
                probs[..keep].iter().sum()
            } else {
                1.0
            };
            let mut cum = 0.0f32;
            for (i, &x) in probs[..keep].iter().enumerate() {
                cum += x / mass;
                if cum >= p.top_p {
                    keep = i + 1;
                    break;
                }
            }
        }
        if p.min_p > 0.0 && !p.min_p_first {
            let threshold = p.min_p * probs[0];
            keep = keep.min(probs.iter().take_while(|&&x| x >= threshold).count().max(1));
        }
        order.truncate(keep);
        probs.truncate(keep);
        let total: f32 = probs.iter().sum();
        order
            .into_iter()
            .zip(probs.into_iter().map(|x| x / total))
            .collect()
    }

    /// A draft from the MTP layer's logits: the most probable token after this request's
    /// bias and penalties (steps 0–1; the filters keep the most probable), no randomness used.
    pub fn propose(&self, logits: &[f32]) -> u32 {
        let mut l = logits.to_vec();
        self.apply_penalties(&mut l);
        argmax(&l) as u32
    }

    /// Draws the next token from one step's logits (does not [`accept`](Self::accept) it).
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        let cands = self.candidates(logits);
        self.draw(&cands)
    }

    /// One draw from a renormalised candidate list for the next token (a single candidate
    /// uses no randomness): the stream's word at the number of tokens generated so far.
    pub fn draw(&mut self, cands: &[(u32, f32)]) -> u32 {
        if cands.len() == 1 {
            return cands[0].0;
        }
        self.rng.set_word_pos(self.generated as u128);
        let u: f32 = self.rng.random();
        let mut cum = 0.0f32;
        for &(t, pr) in cands {
            cum += pr;
            if u < cum {
                return t;
            }
        }
        cands.last().expect("non-empty").0
    }

    /// Speculative verification of one draft (module docs): `logits` are the main model's at
    /// the draft's position. Returns the token plain sampling draws there and whether it is
    /// the draft (accepted); a rejection ends the step's drafts.
    pub fn verify(&mut self, draft: u32, logits: &[f32]) -> (u32, bool) {
        let t = self.sample(logits);
        (t, t == draft)
    }
}

/// The order-preserving key of a logit for an ascending sort that puts larger logits first:
/// the bits of `x` made monotone (sign flipped for positives, all bits for negatives), then
/// inverted; −0 is keyed as +0, as the two compare equal.
fn descending_key(x: f32) -> u32 {
    let b = if x == 0.0 { 0 } else { x.to_bits() };
    let monotone = if b >> 31 == 0 { b | 0x8000_0000 } else { !b };
    !monotone
}

/// The ids of the non-NaN `logits`, largest first, ties to the lower id; with `top_k` > 0 only
/// that many. The order [`sorted_by_logit_reference`] defines, from (key, id) pairs sorted
/// directly (a least-significant-digit radix sort for large vocabularies, whose passes are
/// stable, so equal keys keep their ids' ascending order) instead of comparisons that look the
/// logits up: ~5× faster on a 4096-token vocabulary, more on DeepSeek's 129 280.
fn sorted_by_logit(logits: &[f32], top_k: usize) -> Vec<u32> {
    let mut keyed: Vec<(u32, u32)> = logits
        .iter()
        .enumerate()
        .filter(|(_, x)| !x.is_nan())
        .map(|(i, &x)| (descending_key(x), i as u32))
        .collect();
    let cut = top_k > 0 && top_k < keyed.len();
    if cut {
        keyed.select_nth_unstable(top_k - 1);
        keyed.truncate(top_k);
    }
    const RADIX_FROM: usize = 1 << 14;
    if cut || keyed.len() < RADIX_FROM {
        keyed.sort_unstable();
    } else {
        // The ids ascend as built; four stable byte passes keep that order among equal keys.
        let mut tmp = vec![(0u32, 0u32); keyed.len()];
        for shift in [0u32, 8, 16, 24] {
            let mut count = [0usize; 257];
            for &(k, _) in &keyed {
                count[((k >> shift) & 0xff) as usize + 1] += 1;
            }
            for i in 1..257 {
                count[i] += count[i - 1];
            }
            for &e in &keyed {
                let d = ((e.0 >> shift) & 0xff) as usize;
                tmp[count[d]] = e;
                count[d] += 1;
            }
            std::mem::swap(&mut keyed, &mut tmp);
        }
    }
    keyed.into_iter().map(|(_, id)| id).collect()
}

/// The definition of [`sorted_by_logit`]'s order: a comparison sort on the logits.
#[cfg(test)]
fn sorted_by_logit_reference(l: &[f32], top_k: usize) -> Vec<u32> {
    let mut order: Vec<u32> = (0..l.len() as u32)
        .filter(|&i| !l[i as usize].is_nan())
        .collect();
    let by_logit = |a: &u32, b: &u32| {
        l[*b as usize]
            .partial_cmp(&l[*a as usize])
            .unwrap_or(std::cmp::Ordering::Equal)
            .then(a.cmp(b))
    };
    if top_k > 0 && top_k < order.len() {
        order.select_nth_unstable_by(top_k - 1, by_logit);
        order.truncate(top_k);
    }
    order.sort_unstable_by(by_logit);
    order
}

/// Index of the largest value, lowest index on ties (NaN never wins).
/// The first index of the largest value (NaN never wins; 0 when nothing beats −∞): the
/// largest value over 16 lanes (which the compiler turns into vector maxima), then the first
/// index holding it. Equals [`argmax_scalar`].
fn argmax(x: &[f32]) -> usize {
    let mut lanes = [f32::NEG_INFINITY; 16];
    let chunks = x.chunks_exact(16);
    let tail = chunks.remainder();
    for c in chunks {
        for (m, &v) in lanes.iter_mut().zip(c) {
            *m = if v > *m { v } else { *m };
        }
    }
    let top = lanes
        .iter()
        .chain(tail)
        .fold(f32::NEG_INFINITY, |m, &v| if v > m { v } else { m });
    if top == f32::NEG_INFINITY {
        return 0;
    }
    x.iter().position(|&v| v == top).unwrap_or(0)
}

/// The definition [`argmax`] follows: one pass, the first strictly larger value wins.
#[cfg(test)]
fn argmax_scalar(x: &[f32]) -> usize {
    let mut best = 0;
    let mut best_v = f32::NEG_INFINITY;
    for (i, &v) in x.iter().enumerate() {
        if v > best_v {
            best = i;
            best_v = v;
        }
    }
    best
}

#[cfg(test)]
mod tests {

    /// The two-pass argmax equals the one-pass definition on vectors with ties, NaNs and
    /// infinities, of every length around the 16-lane chunks.
    #[test]
    fn argmax_equals_the_one_pass_definition() {
        let mut seed = 0x9E37_79B9_7F4A_7C15u64;
        let mut next = || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        let pick = [
            f32::NAN,
            f32::NEG_INFINITY,
            f32::INFINITY,
            0.0,
            -0.0,
            1.0,
            2.0,
            -3.0,
        ];
        for len in 0..70 {
            for _ in 0..200 {
                let x: Vec<f32> = (0..len)
                    .map(|_| match next() % 4 {
                        0 => pick[(next() % pick.len() as u64) as usize],
                        _ => ((next() % 7) as f32) - 3.0,
                    })
                    .collect();
                assert_eq!(super::argmax(&x), super::argmax_scalar(&x), "{x:?}");
            }
        }
    }

    #[test]
    fn a_vanishing_temperature_samples_greedily() {
        let logits = [0.5f32, 3.0, -1.0, 2.5];
        for t in [1e-40f32, 1e-30, f32::MIN_POSITIVE] {
            let params = SamplingParams {
                temperature: t,
                seed: Some(1),
                ..SamplingParams::greedy()
            };
            let mut s = Sampler::new(params, &[0]).unwrap();
            let c = s.candidates(&logits);
            assert_eq!(c[0], (1, 1.0), "temperature {t}");
            assert!(
                c.iter().all(|&(_, p)| p.is_finite()),
                "temperature {t}: {c:?}"
            );
            for _ in 0..20 {
                assert_eq!(s.sample(&logits), 1, "temperature {t}");
            }
        }
    }

    use super::*;

    /// A fixed distribution over 10 tokens: logits ln(p) for p ∝ [30, 20, 15, 10, 8, 7, 5, 3, 1, 1].
    fn logits() -> Vec<f32> {
        [30.0f32, 20.0, 15.0, 10.0, 8.0, 7.0, 5.0, 3.0, 1.0, 1.0]
            .iter()
            .map(|x| (x / 100.0).ln())
            .collect()
    }

    fn draw(params: SamplingParams, n: usize) -> Vec<usize> {
        let mut s = Sampler::new(params, &[]).unwrap();
        let l = logits();
        let mut counts = vec![0; l.len()];
        // Each draw is the next generated token's (a token's draw is keyed by its position).
        for _ in 0..n {
            let t = s.sample(&l);
            s.accept(t);
            counts[t as usize] += 1;
        }
        counts
    }

    fn seeded(seed: u64) -> SamplingParams {
        SamplingParams {
            seed: Some(seed),
            ..Default::default()
        }
    }

    /// vLLM's allowed_token_ids keep the draw among them (sampled too); bad words ban a
    /// word's last token only where the output ends with the tokens before it.
    #[test]
    fn allowed_tokens_and_bad_words_rule_tokens_out() {
        let l = logits();
        let allowed = SamplingParams {
            allowed_tokens: vec![4, 7],
            ..SamplingParams::greedy()
        };
        assert_eq!(
            Sampler::new(allowed.clone(), &[]).unwrap().candidates(&l)[0].0,
            4
        );
        let mut s = Sampler::new(
            SamplingParams {
                temperature: 1.0,
                seed: Some(3),
                ..allowed
            },
            &[],
        )
        .unwrap();
        for _ in 0..50 {
            let t = s.sample(&l);
            assert!(t == 4 || t == 7, "{t}");
            s.accept(t);
        }
        let mut s = Sampler::new(
            SamplingParams {
                bad_words: vec![vec![0], vec![5, 1]],
                ..SamplingParams::greedy()
            },
            &[],
        )
        .unwrap();
        // Token 0 never; token 1 (the next best) except right after 5.
        assert_eq!(s.candidates(&l)[0].0, 1);
        s.accept(5);
        assert_eq!(s.candidates(&l)[0].0, 2);
        s.accept(2);
        assert_eq!(s.candidates(&l)[0].0, 1);
    }

    proptest::proptest! {
        /// The keyed (and radix) sort gives the comparison sort's order: logits with many ties,
        /// ±0, infinities and NaN, vocabularies on both sides of the radix threshold, with and
        /// without top-k.
        #[test]
        fn sorted_by_logit_matches_the_comparison_sort(
            values in proptest::collection::vec(0u8..40, 1..200),
            big in proptest::bool::ANY,
            top_k in 0usize..50,
        ) {
            let pick = |v: u8| match v {
                0 => f32::NAN,
                1 => f32::INFINITY,
                2 => f32::NEG_INFINITY,
                3 => -0.0,
                4 => 0.0,
                v => (v as f32 - 20.0) * 0.37,
            };
            let n = if big { 20_000 } else { values.len() };
            let at = |i: usize| values[i % values.len()] ^ ((i / values.len()) as u8 % 7);
            let l: Vec<f32> = (0..n).map(|i| pick(at(i))).collect();
            let want = sorted_by_logit_reference(&l, top_k);
            proptest::prop_assert_eq!(sorted_by_logit(&l, top_k), want);
        }
    }

    /// The bias is added to the raw logits: it moves the greedy choice, −100 all but bans the
    /// top token, a bias of ln 2 doubles a token's odds against the rest, and out-of-range
    /// biases are refused by name.
    #[test]
    fn logit_bias_shifts_the_logits_before_anything_else() {
        let l = logits();
        let greedy = |bias: Vec<(u32, f32)>| {
            let params = SamplingParams {
                logit_bias: bias,
                ..SamplingParams::greedy()
            };
            Sampler::new(params, &[]).unwrap().candidates(&l)[0].0
        };
        assert_eq!(greedy(vec![]), 0);
        assert_eq!(greedy(vec![(0, -100.0)]), 1);
        assert_eq!(greedy(vec![(9, 100.0)]), 9);
        // Ids past the vocabulary do nothing here (the server refuses them).
        assert_eq!(greedy(vec![(10_000, 100.0)]), 0);
        let params = SamplingParams {
            logit_bias: vec![(9, std::f32::consts::LN_2)],
            ..Default::default()
        };
        let c = Sampler::new(params, &[]).unwrap().candidates(&l);
        let p = |t: u32| c.iter().find(|x| x.0 == t).unwrap().1 as f64;
        // p ∝ [30, …, 1, 2]: token 9 now has 2 of 101 parts, token 8 still 1.
        assert!((p(9) - 2.0 / 101.0).abs() < 1e-6, "{}", p(9));
        assert!((p(8) - 1.0 / 101.0).abs() < 1e-6, "{}", p(8));
        // Before the repetition penalty: a biased logit of a seen token is then penalised.
        let params = SamplingParams {
            logit_bias: vec![(1, 10.0)],
            repetition_penalty: 100.0,
            ..SamplingParams::greedy()
        };
        let s = Sampler::new(params, &[1]).unwrap();
        let mut biased = l.clone();
        s.apply_penalties(&mut biased);
        assert_eq!(biased[1], (l[1] + 10.0) / 100.0);
        for bad in [100.5f32, -101.0, f32::NAN] {
            let params = SamplingParams {
                logit_bias: vec![(3, bad)],
                ..SamplingParams::greedy()
            };
            let err = Sampler::new(params, &[]).err().expect("refused");
            assert!(err.to_string().contains("logit_bias"), "{err}");
        }
    }

    #[test]
    fn a_seed_reproduces_a_run_and_another_seed_differs() {
        let run = |seed| {
            let mut s = Sampler::new(seeded(seed), &[]).unwrap();
            (0..200)
                .map(|_| {
                    let t = s.sample(&logits());
                    s.accept(t);
                    t
                })
                .collect::<Vec<_>>()
        };
        assert_eq!(run(7), run(7));
        assert_ne!(run(7), run(8));
    }

    #[test]
    fn plain_sampling_follows_the_distribution() {
        let n = 20_000;
        let counts = draw(seeded(1), n);
        // Token 0 has p = 0.30: 6000 expected, sd ≈ 65.
        assert!((counts[0] as f64 - 6000.0).abs() < 400.0, "{counts:?}");
        assert!(counts[9] > 0);
    }

    #[test]
    fn top_k_never_leaves_its_set() {
        let counts = draw(
            SamplingParams {
                top_k: 3,
                ..seeded(2)
            },
            5000,
        );
        assert!(counts[3..].iter().all(|&c| c == 0), "{counts:?}");
        assert!(counts[..3].iter().all(|&c| c > 0), "{counts:?}");
    }

    #[test]
    fn top_p_never_leaves_its_set() {
        // Cumulative: 0.30, 0.50, 0.65, 0.75 -> top_p 0.7 keeps 4 tokens.
        let counts = draw(
            SamplingParams {
                top_p: 0.7,
                ..seeded(3)
            },
            5000,
        );
        assert!(counts[4..].iter().all(|&c| c == 0), "{counts:?}");
        assert!(counts[..4].iter().all(|&c| c > 0), "{counts:?}");
    }

    #[test]
    fn min_p_never_leaves_its_set() {
        // Threshold 0.3 × 0.30 = 0.09: keeps p >= 0.09, tokens 0..=3.
        let counts = draw(
            SamplingParams {
                min_p: 0.3,
                ..seeded(4)
            },
            5000,
        );
        assert!(counts[4..].iter().all(|&c| c == 0), "{counts:?}");
        assert!(counts[..4].iter().all(|&c| c > 0), "{counts:?}");
    }

    /// min-p with top-p: Hugging Face's order counts top-p's mass over the whole distribution,
    /// vLLM's (`min_p_first`) over min-p's survivors, renormalised.
    #[test]
    fn min_p_first_counts_top_p_over_its_survivors() {
        let logits: Vec<f32> = [0.4f32, 0.2, 0.15, 0.1, 0.08, 0.07]
            .iter()
            .map(|p| p.ln())
            .collect();
        let kept = |min_p_first: bool| -> Vec<u32> {
            let s = Sampler::new(
                SamplingParams {
                    min_p: 0.3,
                    top_p: 0.7,
                    min_p_first,
                    ..seeded(1)
                },
                &[],
            )
            .unwrap();
            s.candidates(&logits).into_iter().map(|(t, _)| t).collect()
        };
        // Threshold 0.3 × 0.4 = 0.12 keeps tokens 0..=2 (mass 0.75).
        assert_eq!(kept(false), [0, 1, 2]);
        // Renormalised: 0.533, 0.267 reach 0.7.
        assert_eq!(kept(true), [0, 1]);
    }

    #[test]
    fn low_temperature_sharpens_and_zero_is_greedy() {
        let counts = draw(
            SamplingParams {
                temperature: 0.1,
                ..seeded(5)
            },
            2000,
        );
        assert!(counts[0] > 1900, "{counts:?}");
        let counts = draw(SamplingParams::greedy(), 100);
        assert_eq!(counts[0], 100);
    }

    #[test]
    fn renormalised_candidates_sum_to_one() {
        let s = Sampler::new(
            SamplingParams {
                top_k: 5,
                top_p: 0.9,
                ..seeded(0)
            },
            &[],
        )
        .unwrap();
        let c = s.candidates(&logits());
        // top-p sees the top-k survivors renormalised (mass 0.83): cumulative 0.36, 0.60,
        // 0.78, 0.90 -> four tokens.
        assert_eq!(c.iter().map(|x| x.0).collect::<Vec<_>>(), vec![0, 1, 2, 3]);
        assert!((c.iter().map(|x| x.1).sum::<f32>() - 1.0).abs() < 1e-6);
    }

    #[test]
    fn repetition_penalty_divides_positive_and_multiplies_negative_logits() {
        let mut s = Sampler::new(
            SamplingParams {
                repetition_penalty: 2.0,
                ..seeded(0)
            },
            &[0, 1],
        )
        .unwrap();
        s.accept(2);
        let mut l = vec![4.0, -4.0, 3.0, 5.0];
        s.apply_penalties(&mut l);
        assert_eq!(l, vec![2.0, -8.0, 1.5, 5.0]);
    }

    #[test]
    fn presence_and_frequency_penalties_subtract_per_output_token() {
        let mut s = Sampler::new(
            SamplingParams {
                presence_penalty: 0.5,
                frequency_penalty: 0.25,
                ..seeded(0)
            },
            &[3],
        )
        .unwrap();
        s.accept(1);
        s.accept(1);
        s.accept(2);
        let mut l = vec![1.0; 4];
        s.apply_penalties(&mut l);
        // Token 1: 1 - (0.5 + 2·0.25); token 2: 1 - (0.5 + 0.25); the prompt token 3 untouched.
        assert_eq!(l, vec![1.0, 0.0, 0.25, 1.0]);
    }

    fn greedy_with_frequency_penalty() -> Sampler {
        Sampler::new(
            SamplingParams {
                frequency_penalty: 10.0,
                ..SamplingParams::greedy()
            },
            &[],
        )
        .unwrap()
    }

    #[test]
    fn penalties_change_the_greedy_choice() {
        let mut s = greedy_with_frequency_penalty();
        let l = logits();
        assert_eq!(s.sample(&l), 0);
        s.accept(0);
        assert_eq!(s.sample(&l), 1);
    }

    /// Verification emits the token plain sampling draws at that position, whatever the
    /// draft: two samplers of one seed, one verifying arbitrary drafts, one sampling, emit the
    /// same tokens; a draft is accepted exactly when it is that token. A token's draw does not
    /// depend on draws made before it (a draft sampler's draws in between change nothing).
    #[test]
    fn verification_emits_the_plain_draw() {
        let l = logits();
        let mut plain = Sampler::new(seeded(13), &[]).unwrap();
        let mut spec = Sampler::new(seeded(13), &[]).unwrap();
        let mut other = Sampler::new(seeded(99), &[]).unwrap();
        let (mut accepted, mut rejected) = (0, 0);
        for i in 0..2000u32 {
            let want = plain.sample(&l);
            plain.accept(want);
            let draft = if i % 3 == 0 { other.sample(&l) } else { i % 10 };
            // Extra draws on the verifying sampler's stream (a discarded draft chain).
            let _ = spec.sample(&l);
            let (t, ok) = spec.verify(draft, &l);
            spec.accept(t);
            assert_eq!(t, want, "token {i}");
            assert_eq!(ok, draft == want);
            if ok {
                accepted += 1;
            } else {
                rejected += 1;
            }
        }
        assert!(accepted > 100 && rejected > 100, "{accepted} {rejected}");
    }

    #[test]
    fn greedy_verification_is_exact_match_and_draws_nothing() {
        let mut s = Sampler::new(SamplingParams::greedy(), &[]).unwrap();
        let l = logits();
        assert_eq!(s.verify(0, &l), (0, true));
        assert_eq!(s.verify(3, &l), (0, false));
        // Penalties move the argmax, and verification sees them.
        let mut s = greedy_with_frequency_penalty();
        s.accept(0);
        assert_eq!(s.verify(0, &l), (1, false));
    }

    #[test]
    fn bad_params_are_named() {
        let e = Sampler::new(
            SamplingParams {
                top_p: 0.0,
                ..Default::default()
            },
            &[],
        )
        .err()
        .unwrap();
        assert!(e.to_string().contains("top_p"), "{e}");
        assert!(SamplingParams {
            temperature: -1.0,
            ..Default::default()
        }
        .validate()
        .is_err());
    }
}
