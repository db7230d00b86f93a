//! Whole-sequence helpers on top of the forward pass: next-token log-probabilities (perplexity)
//! and greedy continuation. They drive the model the way the engine will: prefill in chunks
//! into a paged cache, then one token per step.

use cachalot_kernels as k;

use crate::batch::{Batch, BlockAllocator, KvCache, LogitsWanted};
use crate::deepseek_v3::DeepseekV3;
use crate::error::{ModelError, Result};

/// Cache block size used by these helpers (the seed system's is 128).
pub const BLOCK_SIZE: usize = 128;

fn cache_for(model: &DeepseekV3, tokens: usize) -> (KvCache, BlockAllocator) {
    let blocks = tokens.div_ceil(BLOCK_SIZE).max(1);
    (
        KvCache::new(model.cache_spec(), BLOCK_SIZE, blocks),
        BlockAllocator::new(blocks),
    )
}

/// Log-probability of each next token: `out[i] = log p(tokens[i+1] | tokens[..=i])`, computed
/// with prefill chunks of at most `chunk` tokens.
pub fn next_token_logprobs(model: &DeepseekV3, tokens: &[u32], chunk: usize) -> Result<Vec<f32>> {
    if tokens.len() < 2 {
        return Err(ModelError::Batch(format!(
            "perplexity needs at least 2 tokens, got {}",
            tokens.len()
        )));
    }
    let chunk = chunk.max(1);
    let vocab = model.config().vocab_size;
    let (mut cache, mut alloc) = cache_for(model, tokens.len());
    let mut table = Vec::new();
    let mut out = Vec::with_capacity(tokens.len() - 1);
    let mut start = 0;
    while start < tokens.len() - 1 {
        let end = (start + chunk).min(tokens.len() - 1);
        alloc.ensure(&mut table, end, BLOCK_SIZE)?;
        let mut batch = Batch::default();
        batch.push_seq(&tokens[start..end], start, table.clone(), LogitsWanted::All);
        let fwd = model.forward(&batch, &mut cache, false)?;
        for (j, row) in fwd.logits.chunks_exact(vocab).enumerate() {
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
pub fn greedy(model: &DeepseekV3, prompt: &[u32], n_new: usize) -> Result<Vec<u32>> {
    if prompt.is_empty() {
        return Err(ModelError::Batch("the prompt is empty".into()));
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
        let fwd = model.forward(&batch, &mut cache, false)?;
        let next = k::argmax(&fwd.logits) as u32;
        pos += step_tokens.len();
        out.push(next);
        step_tokens = vec![next];
    }
    Ok(out)
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
        return Err(ModelError::Batch(
            "this model already stores its latent cache in int8 (C8); calibrate the FP8, BF16 or \
             W8A8C16 model instead"
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
        model.forward(&batch, &mut cache, false)?;
        start = end;
    }
    let kvr = model.config().kv_lora_rank;
    let layers = model.config().num_hidden_layers;
    Ok((0..layers)
        .map(|li| {
            let layer = cache.layer(li);
            (0..tokens.len())
                .map(|pos| {
                    let slot = crate::batch::slot_of(&table, pos, BLOCK_SIZE);
                    layer[slot * spec.width..slot * spec.width + kvr]
                        .iter()
                        .fold(0.0f32, |m, v| m.max(v.abs()))
                })
                .fold(0.0f32, f32::max)
        })
        .collect())
}
