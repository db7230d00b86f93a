//! Helpers shared by this crate's integration tests: reading reference JSON and comparing
//! log-probabilities with the tolerances the issues set (per token 0.02, mean NLL 0.2%).
#![allow(dead_code)]

use cachalot_model::eval;
use serde_json::Value;

pub fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

pub fn floats(v: &Value) -> Vec<f32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap() as f32)
        .collect()
}

pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

pub fn check_logprobs(what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let worst = max_abs_diff(got, want);
    assert!(
        worst <= 0.02,
        "{what}: worst per-token logprob diff {worst}"
    );
    let (nll_got, _) = eval::nll_ppl(got);
    let (nll_want, _) = eval::nll_ppl(want);
    let rel = ((nll_got - nll_want) / nll_want).abs();
    assert!(rel <= 0.002, "{what}: mean NLL {nll_got} vs {nll_want}");
}

/// Logits of MTP layer 0 over `toks` as transformers' `MtpModel` lays the rows out: row i feeds
/// token i+1 with the main model's final hidden state at position i (so it predicts token i+2).
/// Returns `[toks.len() - 1, vocab]`.
pub fn mtp_rows(m: &cachalot_model::DeepseekV3, toks: &[u32]) -> Vec<f32> {
    use cachalot_model::batch::{Batch, BlockAllocator, KvCache, LogitsWanted};
    let n = toks.len();
    let h = m.config().hidden_size;
    let mut cache = KvCache::new(m.cache_spec(), 16, n.div_ceil(16));
    let mut alloc = BlockAllocator::new(cache.num_blocks());
    let mut table = Vec::new();
    alloc.ensure(&mut table, n, 16).unwrap();
    let mut b = Batch::default();
    b.push_seq(toks, 0, table.clone(), LogitsWanted::None);
    let hidden = m.forward(&b, &mut cache, true).unwrap().hidden.unwrap();
    let mut b = Batch::default();
    b.push_seq(&toks[1..], 0, table, LogitsWanted::All);
    m.mtp_forward(0, &b, &hidden[..(n - 1) * h], &mut cache, false)
        .unwrap()
        .logits
}

/// `log p(toks[i + 2])` of each MTP row but the last.
pub fn mtp_logprobs(rows: &[f32], vocab: usize, toks: &[u32]) -> Vec<f32> {
    rows.chunks_exact(vocab)
        .zip(&toks[2..])
        .map(|(row, &t)| cachalot_kernels::log_softmax_at(row, t as usize))
        .collect()
}
