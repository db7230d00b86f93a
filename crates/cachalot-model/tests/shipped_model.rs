//! The shipped small model (`assets/cachalot-tiny-r1`, trained by `tools/train/`) against the
//! references transformers 5.24.0 computed on it (`reference.json`, written by
//! `tools/train/evaluate.py`): per-token log-probabilities, the recorded held-out perplexity,
//! greedy samples, the MTP head, and speculative decoding's acceptance.

use std::path::PathBuf;

use cachalot_model::eval;
use cachalot_model::tokenizer::Tokenizer;
use cachalot_model::{DeepseekV3, Fp8Mode, LoadOptions};
use serde_json::Value;

fn dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../assets/cachalot-tiny-r1")
}

fn reference() -> Value {
    serde_json::from_str(&std::fs::read_to_string(dir().join("reference.json")).unwrap()).unwrap()
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

fn floats(v: &Value) -> Vec<f32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap() as f32)
        .collect()
}

fn model(load_mtp: bool) -> DeepseekV3 {
    let opts = LoadOptions {
        fp8: Fp8Mode::Native,
        load_mtp,
    };
    DeepseekV3::load(&dir(), opts).unwrap()
}

fn check(what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}");
    let worst = got
        .iter()
        .zip(want)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f32::max);
    assert!(worst <= 0.02, "{what}: worst per-token diff {worst}");
    let (a, _) = eval::nll_ppl(got);
    let (b, _) = eval::nll_ppl(want);
    assert!(((a - b) / b).abs() <= 0.002, "{what}: mean NLL {a} vs {b}");
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
    // Row i: token i+1 with the main hidden state at i; predicts token i+2.
    use cachalot_model::batch::{Batch, BlockAllocator, KvCache, LogitsWanted};
    let n = toks.len();
    let h = m.config().hidden_size;
    let vocab = m.config().vocab_size;
    let mut cache = KvCache::new(m.cache_spec(), 128, n.div_ceil(128));
    let mut alloc = BlockAllocator::new(cache.num_blocks());
    let mut table = Vec::new();
    alloc.ensure(&mut table, n, 128).unwrap();
    let mut b = Batch::default();
    b.push_seq(&toks, 0, table.clone(), LogitsWanted::None);
    let hidden = m.forward(&b, &mut cache, true).unwrap().hidden.unwrap();
    let mut b = Batch::default();
    b.push_seq(&toks[1..], 0, table, LogitsWanted::All);
    let out = m
        .mtp_forward(0, &b, &hidden[..(n - 1) * h], &mut cache, false)
        .unwrap();
    let got: Vec<f32> = (0..n - 2)
        .map(|i| {
            cachalot_kernels::log_softmax_at(
                &out.logits[i * vocab..(i + 1) * vocab],
                toks[i + 2] as usize,
            )
        })
        .collect();
    check("mtp", &got, &floats(&mtp["logprobs"]));

    // Speculative decoding emits the plain greedy tokens and accepts a real share of drafts.
    let g = &r["greedy"][0];
    let prompt = ids(&g["prompt_ids"]);
    let plain = eval::greedy(&m, &prompt, 48).unwrap();
    let (spec, stats) = eval::greedy_mtp(&m, &prompt, 48, 1).unwrap();
    assert_eq!(spec, plain);
    assert!(stats.acceptance_rate() > 0.3, "{stats:?}");
}
