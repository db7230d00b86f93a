//! Whole-sequence helpers on top of the forward pass: next-token log-probabilities (perplexity)
//! and greedy continuation. They drive the model the way the engine will: prefill in chunks
//! into a paged cache, then one token per step.

use cachalot_kernels as k;

use crate::batch::{Batch, BlockAllocator, CacheSpec, KvCache, LogitsWanted};
use crate::deepseek_v3::DeepseekV3;
use crate::deepseek_v4::DeepseekV4;
use crate::error::{ModelError, Result};

/// What the whole-sequence helpers need of a model family (DeepSeek-V3 and V4 both run a packed
/// [`Batch`] through a paged [`KvCache`]).
pub trait CausalLm {
    fn cache_spec(&self) -> CacheSpec;
    fn vocab_size(&self) -> usize;
    /// Logits of `batch.logits_indices`, row after row.
    fn logits(&self, batch: &Batch, cache: &mut KvCache) -> Result<Vec<f32>>;
}

impl CausalLm for DeepseekV3 {
    fn cache_spec(&self) -> CacheSpec {
        DeepseekV3::cache_spec(self)
    }
    fn vocab_size(&self) -> usize {
        self.config().vocab_size
    }
    fn logits(&self, batch: &Batch, cache: &mut KvCache) -> Result<Vec<f32>> {
        Ok(self.forward(batch, cache, false)?.logits)
    }
}

impl CausalLm for DeepseekV4 {
    fn cache_spec(&self) -> CacheSpec {
        DeepseekV4::cache_spec(self)
    }
    fn vocab_size(&self) -> usize {
        self.config().vocab_size
    }
    fn logits(&self, batch: &Batch, cache: &mut KvCache) -> Result<Vec<f32>> {
        Ok(self.forward(batch, cache, false)?.logits)
    }
}

/// Cache block size used by these helpers (the seed system's is 128).
pub const BLOCK_SIZE: usize = 128;

fn cache_for<M: CausalLm + ?Sized>(model: &M, tokens: usize) -> (KvCache, BlockAllocator) {
    let blocks = tokens.div_ceil(BLOCK_SIZE).max(1);
    (
        KvCache::new(model.cache_spec(), BLOCK_SIZE, blocks),
        BlockAllocator::new(blocks),
    )
}

/// Log-probability of each next token: `out[i] = log p(tokens[i+1] | tokens[..=i])`, computed
/// with prefill chunks of at most `chunk` tokens.
pub fn next_token_logprobs<M: CausalLm + ?Sized>(
    model: &M,
    tokens: &[u32],
    chunk: usize,
) -> Result<Vec<f32>> {
    if tokens.len() < 2 {
        return Err(ModelError::Batch(format!(
            "perplexity needs at least 2 tokens, got {}",
            tokens.len()
        )));
    }
    let chunk = chunk.max(1);
    let vocab = model.vocab_size();
    if let Some((i, &t)) = tokens
        .iter()
        .enumerate()
        .find(|&(_, &t)| t as usize >= vocab)
    {
        return Err(ModelError::Options(format!(
            "token {i} is id {t}, outside the model's vocabulary (0..{})",
            vocab - 1
        )));
    }
    let (mut cache, mut alloc) = cache_for(model, tokens.len());
    let mut table = Vec::new();
    let mut out = Vec::with_capacity(tokens.len() - 1);
    let mut start = 0;
    while start < tokens.len() - 1 {
        let end = (start + chunk).min(tokens.len() - 1);
        alloc.ensure(&mut table, end, BLOCK_SIZE)?;
        let mut batch = Batch::default();
        batch.push_seq(&tokens[start..end], start, table.clone(), LogitsWanted::All);
        batch.mark_prefill();
        let logits = model.logits(&batch, &mut cache)?;
        if let Some(i) = logits.iter().position(|x| x.is_nan()) {
            return Err(ModelError::NonFinite(format!(
                "the model produced NaN logits (position {}): the checkpoint holds non-finite \
                 weights or the config's numbers do not fit it",
                start + i / vocab
            )));
        }
        for (j, row) in logits.chunks_exact(vocab).enumerate() {
            out.push(k::log_softmax_at(row, tokens[start + j + 1] as usize));
        }
        start = end;
    }
    Ok(out)
}

/// Mean negative log-likelihood and perplexity of a list of log-probabilities.
pub fn nll_ppl(logprobs: &[f32]) -> (f64, f64) {
    let nll = -logprobs.iter().map(|&x| x as f64).sum::<f64>() / logprobs.len().max(1) as f64;
    (nll, nll.exp())
}

/// Greedy continuation of `prompt` by `n_new` tokens (prefill once, then one token per step;
/// no stop tokens).
pub fn greedy<M: CausalLm + ?Sized>(model: &M, prompt: &[u32], n_new: usize) -> Result<Vec<u32>> {
    if prompt.is_empty() {
        return Err(ModelError::Options("the prompt is empty".into()));
    }
    let (mut cache, mut alloc) = cache_for(model, prompt.len() + n_new);
    let mut table = Vec::new();
    let mut out = Vec::with_capacity(n_new);
    let mut step_tokens = prompt.to_vec();
    let mut pos = 0;
    while out.len() < n_new {
        alloc.ensure(&mut table, pos + step_tokens.len(), BLOCK_SIZE)?;
        let mut batch = Batch::default();
        batch.push_seq(&step_tokens, pos, table.clone(), LogitsWanted::Last);
        if pos == 0 {
            batch.mark_prefill();
        } else {
            batch.mark_generated();
        }
        let logits = model.logits(&batch, &mut cache)?;
        let next = k::argmax(&logits) as u32;
        pos += step_tokens.len();
        out.push(next);
        step_tokens = vec![next];
    }
    Ok(out)
}

/// Counts of a speculative run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MtpStats {
    /// Main-model forward passes (the prefill included).
    pub main_steps: usize,
    pub drafted: usize,
    pub accepted: usize,
}

impl MtpStats {
    pub fn acceptance_rate(&self) -> f64 {
        self.accepted as f64 / self.drafted.max(1) as f64
    }
}

/// What a drafter sees after each main step of [`speculative_greedy`].
pub struct DraftContext<'a> {
    pub model: &'a DeepseekV3,
    pub cache: &'a mut KvCache,
    pub alloc: &'a mut BlockAllocator,
    pub table: &'a mut Vec<u32>,
    /// The whole sequence so far; its last token was just emitted and is not yet in the cache.
    pub seq: &'a [u32],
    /// Positions `first..first + rows` were run by the main model in this step and their next
    /// tokens are known (`seq[first + 1..=first + rows]`); `hidden` holds their final-normed
    /// hidden states, `[rows, hidden_size]`.
    pub first: usize,
    pub hidden: &'a [f32],
    /// How many drafts to propose for the positions after `seq`.
    pub n: usize,
}

/// Proposes draft tokens for speculative decoding.
pub trait Drafter {
    fn draft(&mut self, ctx: DraftContext) -> Result<Vec<u32>>;
}

/// Drafts with MTP layer 0 (spec §3.8): catches up on the positions the main model just ran
/// (row j pairs `seq[j + 1]` with the main hidden state at j, overwriting by position whatever
/// earlier chained drafts wrote there), drafts from the last row, then chains the module on its
/// own drafts and hidden states.
pub struct MtpDrafter;

impl Drafter for MtpDrafter {
    fn draft(&mut self, c: DraftContext) -> Result<Vec<u32>> {
        let h = c.model.config().hidden_size;
        let rows = c.hidden.len() / h;
        let mut batch = Batch::default();
        batch.push_seq(
            &c.seq[c.first + 1..c.first + rows + 1],
            c.first,
            c.table.clone(),
            LogitsWanted::Last,
        );
        let out = c.model.mtp_forward(0, &batch, c.hidden, c.cache, true)?;
        let mut drafts = vec![k::argmax(&out.logits) as u32];
        let mut prev = out.hidden.expect("asked for hidden states")[(rows - 1) * h..].to_vec();
        let last_pos = c.first + rows - 1;
        for step in 1..c.n {
            let pos = last_pos + step;
            c.alloc.ensure(c.table, pos + 1, BLOCK_SIZE)?;
            let mut b = Batch::default();
            b.push_seq(
                &[drafts[step - 1]],
                pos,
                c.table.clone(),
                LogitsWanted::Last,
            );
            let r = c.model.mtp_forward(0, &b, &prev, c.cache, true)?;
            drafts.push(k::argmax(&r.logits) as u32);
            prev = r.hidden.expect("asked for hidden states");
        }
        Ok(drafts)
    }
}

/// Greedy continuation with MTP speculative decoding, `next_n` chained drafts per step.
pub fn greedy_mtp(
    model: &DeepseekV3,
    prompt: &[u32],
    n_new: usize,
    next_n: usize,
) -> Result<(Vec<u32>, MtpStats)> {
    speculative_greedy(model, prompt, n_new, next_n, &mut MtpDrafter)
}

/// Greedy continuation with speculative decoding. Each main step verifies `[last, d_1..d_n]`
/// in one forward, accepts the longest prefix of drafts that match its own argmax, and emits
/// `a + 1` tokens; then the drafter proposes the next drafts. The output equals [`greedy`]'s:
/// every emitted token is a main-model argmax.
pub fn speculative_greedy(
    model: &DeepseekV3,
    prompt: &[u32],
    n_new: usize,
    next_n: usize,
    drafter: &mut dyn Drafter,
) -> Result<(Vec<u32>, MtpStats)> {
    if prompt.is_empty() {
        return Err(ModelError::Options("the prompt is empty".into()));
    }
    if next_n == 0 {
        return Ok((greedy(model, prompt, n_new)?, MtpStats::default()));
    }
    let vocab = model.config().vocab_size;
    let h = model.config().hidden_size;
    let (mut cache, mut alloc) = cache_for(model, prompt.len() + n_new + next_n + 1);
    let mut table = Vec::new();
    let mut stats = MtpStats::default();
    let mut seq: Vec<u32> = prompt.to_vec();
    let mut out: Vec<u32> = Vec::with_capacity(n_new + next_n);
    // Main input of the step: its first position and tokens (the last drafts.len() are drafts).
    let mut start = 0usize;
    let mut inputs: Vec<u32> = prompt.to_vec();
    let mut drafts: Vec<u32> = Vec::new();
    while out.len() < n_new {
        alloc.ensure(&mut table, start + inputs.len(), BLOCK_SIZE)?;
        let mut batch = Batch::default();
        batch.push_seq(&inputs, start, table.clone(), LogitsWanted::All);
        if start == 0 {
            batch.mark_prefill();
        } else {
            batch.mark_generated();
        }
        let fwd = model.forward(&batch, &mut cache, true)?;
        stats.main_steps += 1;
        let argmax: Vec<u32> = fwd
            .logits
            .chunks_exact(vocab)
            .map(|row| k::argmax(row) as u32)
            .collect();
        let known = inputs.len() - drafts.len();
        let mut accepted = 0;
        while accepted < drafts.len() && drafts[accepted] == argmax[known - 1 + accepted] {
            accepted += 1;
        }
        stats.drafted += drafts.len();
        stats.accepted += accepted;
        let emitted = &argmax[known - 1..known + accepted];
        // Positions start..start+valid now have a known next token.
        let valid = known + accepted;
        seq.truncate(start + known);
        seq.extend_from_slice(&inputs[known..valid]);
        seq.extend_from_slice(&emitted[accepted..]);
        out.extend_from_slice(emitted);
        if out.len() >= n_new {
            break;
        }
        let hidden = fwd.hidden.expect("asked for hidden states");
        drafts = drafter.draft(DraftContext {
            model,
            cache: &mut cache,
            alloc: &mut alloc,
            table: &mut table,
            seq: &seq,
            first: start,
            hidden: &hidden[..valid * h],
            n: next_n,
        })?;
        drafts.truncate(next_n);
        start += valid;
        inputs = std::iter::once(seq[seq.len() - 1])
            .chain(drafts.iter().copied())
            .collect();
    }
    out.truncate(n_new);
    Ok((out, stats))
}

/// C8 calibration (spec §3.4, §5.4): prefills `tokens` (chunks of at most `chunk`) into an f32
/// latent cache and returns, per main layer, the largest |c_kv| cached — the values the C8
/// cache would store. `scale = absmax / 127` then maps the largest calibration value to ±127.
pub fn latent_absmax(model: &DeepseekV3, tokens: &[u32], chunk: usize) -> Result<Vec<f32>> {
    if tokens.is_empty() {
        return Err(ModelError::Batch(
            "calibration needs at least one token".into(),
        ));
    }
    let spec = model.cache_spec();
    if spec.int8_width > 0 {
        return Err(ModelError::Options(
            "this model already stores its latent cache in int8 (C8); calibrate the FP8, BF16 or \
             W8A8C16 model instead"
                .into(),
        ));
    }
    if spec.float != crate::batch::KvCacheDtype::F32 {
        return Err(ModelError::Batch(
            "calibration reads the exact latents: load the model with an f32 latent cache (the \
             default, not --kv-cache-dtype bf16)"
                .into(),
        ));
    }
    let (mut cache, mut alloc) = cache_for(model, tokens.len());
    let mut table = Vec::new();
    let chunk = chunk.max(1);
    let mut start = 0;
    while start < tokens.len() {
        let end = (start + chunk).min(tokens.len());
        alloc.ensure(&mut table, end, BLOCK_SIZE)?;
        let mut batch = Batch::default();
        batch.push_seq(
            &tokens[start..end],
            start,
            table.clone(),
            LogitsWanted::None,
        );
        batch.mark_prefill();
        model.forward(&batch, &mut cache, false)?;
        start = end;
    }
    let kvr = model.config().kv_lora_rank;
    let layers = model.config().num_hidden_layers;
    (0..layers)
        .map(|li| {
            let layer = cache.layer(li);
            let mut max = 0.0f32;
            for (pos, token) in tokens.iter().enumerate() {
                let slot = crate::batch::slot_of(&table, pos, BLOCK_SIZE);
                for v in &layer[slot * spec.width..slot * spec.width + kvr] {
                    // (`max` would pass over a NaN: the scale would leave that position out.)
                    if !v.is_finite() {
                        return Err(ModelError::NonFinite(format!(
                            "layer {li}: the latent of position {pos} (token {token}) holds {v}: the \
                             model's weights are likely broken (check them with \
                             --check-tensors)"
                        )));
                    }
                    max = max.max(v.abs());
                }
            }
            Ok(max)
        })
        .collect()
}

/// Log-probabilities over consecutive, non-overlapping windows of `window` tokens, each its own
/// causal context from position 0 (how models are scored past their training context); every
/// token but a window's first is scored. `window = 0` means one context over everything.
pub fn windowed_logprobs<M: CausalLm + ?Sized>(
    model: &M,
    tokens: &[u32],
    window: usize,
    chunk: usize,
) -> Result<Vec<f32>> {
    if window == 1 {
        return Err(ModelError::Batch(
            "a window of 1 token scores nothing (each window's first token has no context); \
             give at least 2, or 0 for one context"
                .into(),
        ));
    }
    if window == 0 || window >= tokens.len() {
        return next_token_logprobs(model, tokens, chunk);
    }
    let mut out = Vec::with_capacity(tokens.len());
    for w in tokens.chunks(window) {
        if w.len() >= 2 {
            out.extend(next_token_logprobs(model, w, chunk)?);
        }
    }
    Ok(out)
}
