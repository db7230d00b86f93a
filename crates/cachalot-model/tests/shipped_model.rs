//! The shipped small model (`assets/cachalot-tiny-r1`, trained by `tools/train/`) against the
//! references transformers 5.24.0 computed on it (`reference.json`, written by
//! `tools/train/evaluate.py`): per-token log-probabilities, the recorded held-out perplexity,
//! greedy samples, the MTP head, and speculative decoding's acceptance.

use std::path::PathBuf;

use cachalot_model::eval;
use cachalot_model::tokenizer::Tokenizer;
use cachalot_model::{DeepseekV3, Fp8Mode, LoadOptions};
use serde_json::Value;

mod common;
use common::{check_logprobs as check, floats, ids, mtp_logprobs, mtp_rows};

fn dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../assets/cachalot-tiny-r1")
}

fn reference() -> Value {
    serde_json::from_str(&std::fs::read_to_string(dir().join("reference.json")).unwrap()).unwrap()
}

fn model(load_mtp: bool) -> DeepseekV3 {
    let opts = LoadOptions {
        fp8: Fp8Mode::Native,
        load_mtp,
        ..Default::default()
    };
    DeepseekV3::load(&dir(), opts).unwrap()
}

#[test]
fn eval_text_logprobs_and_recorded_perplexity() {
    let m = model(false);
    let r = reference();
    let text = std::fs::read_to_string(dir().join("eval.txt")).unwrap();
    let toks = Tokenizer::from_dir(&dir()).unwrap().encode(&text).unwrap();
    let first = ids(&r["text"]["token_ids"]);
    assert_eq!(toks[..first.len()], first[..], "tokenization of eval.txt");
    let got = eval::next_token_logprobs(&m, &first, 128).unwrap();
    check("first window", &got, &floats(&r["text"]["logprobs"]));

    // The whole file, scored as the reference did: 512-token windows.
    let e = &r["eval"];
    assert_eq!(toks.len() as u64, e["tokens"].as_u64().unwrap());
    let window = e["window"].as_u64().unwrap() as usize;
    let lp = eval::windowed_logprobs(&m, &toks, window, 512).unwrap();
    assert_eq!(lp.len() as u64, e["scored_tokens"].as_u64().unwrap());
    let (nll, ppl) = eval::nll_ppl(&lp);
    let want = e["nll"].as_f64().unwrap();
    assert!(
        ((nll - want) / want).abs() <= 0.002,
        "nll {nll} vs {want} (ppl {ppl})"
    );
}

#[test]
fn greedy_samples_match_up_to_near_ties() {
    let m = model(false);
    for g in reference()["greedy"].as_array().unwrap() {
        let want = ids(&g["continuation"]);
        let margins = floats(&g["margins"]);
        let got = eval::greedy(&m, &ids(&g["prompt_ids"]), want.len()).unwrap();
        // Compare up to the first step whose top-1/top-2 margin is within rounding.
        let n = margins.iter().position(|&x| x < 1e-3).unwrap_or(want.len());
        assert!(n >= 16, "too few comparable steps: {n}");
        assert_eq!(got[..n], want[..n]);
    }
}

#[test]
fn mtp_head_matches_and_speculation_is_accepted() {
    let m = model(true);
    let r = reference();
    let toks = ids(&r["text"]["token_ids"]);
    let mtp = &r["mtp"];
    let vocab = m.config().vocab_size;
    let got = mtp_logprobs(&mtp_rows(&m, &toks), vocab, &toks);
    check("mtp", &got, &floats(&mtp["logprobs"]));

    // Speculative decoding emits the plain greedy tokens and accepts a real share of drafts.
    let g = &r["greedy"][0];
    let prompt = ids(&g["prompt_ids"]);
    let plain = eval::greedy(&m, &prompt, 48).unwrap();
    let (spec, stats) = eval::greedy_mtp(&m, &prompt, 48, 1).unwrap();
    assert_eq!(spec, plain);
    assert!(stats.acceptance_rate() > 0.3, "{stats:?}");
}

/// `quantize_head_int8` (`--int8-head`): lm_head becomes W8A8, its decode bytes halve, and the
/// log-probabilities stay within 0.05 of the bf16 head's (measured: +0.006% perplexity on the
/// whole eval.txt, docs/PERF.md) — int8 per-row rounding of a 256-wide head is that small.
#[test]
fn int8_head_halves_the_head_and_keeps_the_logprobs() {
    let plain = model(false);
    let mut q = model(false);
    q.quantize_head_int8();
    let (v, h) = (plain.config().vocab_size, plain.config().hidden_size);
    assert_eq!(
        plain.decode_bytes_per_token() - q.decode_bytes_per_token(),
        v * h * 2 - (v * h + 4 * v),
        "bf16 head → int8 + one f32 scale per row"
    );
    let r = reference();
    let first = ids(&r["text"]["token_ids"]);
    let a = eval::next_token_logprobs(&plain, &first, 128).unwrap();
    let b = eval::next_token_logprobs(&q, &first, 128).unwrap();
    let worst = a
        .iter()
        .zip(&b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0f32, f32::max);
    assert!(worst > 0.0, "the int8 head changed nothing");
    assert!(worst < 0.05, "int8 head moved a log-prob by {worst}");
}

/// `--kv-cache-dtype bf16` on the trained model: half the cache bytes per token, and the
/// eval text's log-probabilities near the f32 cache's, in chunks of 32 so most attention reads
/// come back from the cache, attended in BF16 × BF16 (measured on these 511 tokens: worst
/// per-token Δ 0.030, mean NLL Δ 0.00015 of 4.61; perplexity over the whole eval.txt in
/// docs/PERF.md).
#[test]
fn bf16_latent_cache_halves_the_cache_and_keeps_the_logprobs() {
    let plain = model(false);
    let mut m = model(false);
    m.set_kv_cache_dtype(cachalot_model::KvCacheDtype::Bf16);
    assert_eq!(
        m.cache_spec().bytes_per_token() * 2,
        plain.cache_spec().bytes_per_token()
    );
    let first = ids(&reference()["text"]["token_ids"]);
    let a = eval::next_token_logprobs(&plain, &first, 32).unwrap();
    let b = eval::next_token_logprobs(&m, &first, 32).unwrap();
    let worst = a
        .iter()
        .zip(&b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0f32, f32::max);
    let (nll_a, _) = eval::nll_ppl(&a);
    let (nll_b, _) = eval::nll_ppl(&b);
    assert!(worst > 0.0, "the bf16 cache changed nothing");
    assert!(worst < 0.25, "the bf16 cache moved a log-prob by {worst}");
    assert!((nll_a - nll_b).abs() < 3e-3, "mean NLL {nll_b} vs {nll_a}");
}
