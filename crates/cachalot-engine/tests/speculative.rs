//! MTP speculative decoding in the engine (spec `executor.md` §2.8,
//! `deepseek-v3-r1-kimi-k2.md` §3.8):
//! - greedy output with MTP equals greedy output without it, token for token, on the fixture
//!   model with an MTP layer and on the shipped small model, for next_n = 1, 2, 3, in batches
//!   with mixed prompt lengths, chunked prefill and (tight pool) preemption;
//! - with sampling, the distribution of the generated tokens is the main model's (a toy Markov
//!   model whose MTP layer proposes from a different law; chi-square bound derived below), and
//!   a seeded request's tokens are those it draws without MTP, whatever the drafts and pool.

use std::collections::HashMap;
mod common;

use std::path::PathBuf;

use cachalot_engine::engine::HiddenForward;
use cachalot_engine::{
    Engine, EngineConfig, EngineError, Model, Request, RequestOutput, Sampler, SamplingParams,
    StopConditions,
};
use cachalot_model::batch::{Batch, CacheSpec, KvCache};
use cachalot_model::tokenizer::Tokenizer;
use cachalot_model::{DeepseekV3, Fp8Mode, LoadOptions};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn load(dir: &str) -> DeepseekV3 {
    DeepseekV3::load(
        &root().join(dir),
        LoadOptions {
            fp8: Fp8Mode::Native,
            load_mtp: true,
            ..Default::default()
        },
    )
    .unwrap()
}

fn run(
    model: &DeepseekV3,
    cfg: EngineConfig,
    next_n: usize,
    prompts: &[Vec<u32>],
    n_new: usize,
) -> (Vec<RequestOutput>, cachalot_engine::metrics::EngineStats) {
    run_with(model, cfg, next_n, prompts, n_new, |_| {
        SamplingParams::greedy()
    })
}

/// [`run`] for any model, request i sampled with `params(i)`.
fn run_with<M: Model>(
    model: &M,
    cfg: EngineConfig,
    next_n: usize,
    prompts: &[Vec<u32>],
    n_new: usize,
    params: impl Fn(usize) -> SamplingParams,
) -> (Vec<RequestOutput>, cachalot_engine::metrics::EngineStats) {
    let mut engine = Engine::new(model, None, cfg).unwrap();
    if next_n > 0 {
        engine.enable_mtp(next_n).unwrap();
    }
    for (i, p) in prompts.iter().enumerate() {
        engine
            .add_request(Request {
                prompt: p.clone(),
                params: params(i),
                stop: StopConditions {
                    max_new_tokens: n_new,
                    ..Default::default()
                },
                ignore_eos: true,
                logprobs: None,
                prompt_logprobs: None,
                json_object: false,
                json_after: None,
                json_lead: Vec::new(),
                json_more: Vec::new(),
                json_schema: None,
                dsml: false,
                special_text: Default::default(),
                waited_s: 0.0,
            })
            .unwrap();
    }
    let mut outs = engine.run_to_completion(|_, _| {}).unwrap();
    assert_eq!(
        engine.scheduler().kv().pool().num_used(),
        0,
        "blocks leaked"
    );
    engine.scheduler().check_invariants().unwrap();
    outs.sort_by_key(|o| o.id);
    (outs, engine.stats().clone())
}

/// Greedy with next_n = 1, 2, 3 equals greedy without, per request, in one batched run. Without
/// preemption, each request also drafts and accepts exactly what it does alone (batch 1, whole
/// prompt in one chunk): the MTP layer's cache is as consistent batched and chunked as alone.
fn mtp_equals_plain(model: &DeepseekV3, cfg: EngineConfig, prompts: &[Vec<u32>], n_new: usize) {
    let (plain, plain_stats) = run(model, cfg, 0, prompts, n_new);
    assert_eq!(plain_stats.drafted, 0);
    let alone_cfg = EngineConfig {
        batch_size: 1,
        num_blocks: 512,
        max_prefill_tokens: 4096,
        ..cfg
    };
    for next_n in 1..=3 {
        let (spec, stats) = run(model, cfg, next_n, prompts, n_new);
        if stats.preemptions == 0 {
            let (alone, _) = run(model, alone_cfg, next_n, prompts, n_new);
            for (a, b) in alone.iter().zip(&spec) {
                assert_eq!(
                    (a.drafted, a.accepted_drafts),
                    (b.drafted, b.accepted_drafts),
                    "next_n {next_n}: request {} drafts differently batched",
                    a.id
                );
            }
        }
        for (a, b) in plain.iter().zip(&spec) {
            assert_eq!(
                a.tokens,
                b.tokens,
                "next_n {next_n}: request {} (prompt of {}) differs",
                a.id,
                a.prompt.len()
            );
            assert_eq!(b.tokens.len(), n_new);
        }
        assert!(
            stats.drafted > 0,
            "next_n {next_n}: nothing drafted {stats:?}"
        );
        assert!(stats.verify_steps > 0 && stats.accepted_drafts <= stats.drafted);
        assert_eq!(stats.sampled_tokens, prompts.len() * n_new);
        assert!(
            stats.tokens_per_main_step() >= 1.0,
            "next_n {next_n}: {stats:?}"
        );
        eprintln!(
            "next_n {next_n}: acceptance {:.2} ({}/{}), {:.2} tokens per main step, {} steps \
             (plain {}), {} preemptions",
            stats.acceptance_rate(),
            stats.accepted_drafts,
            stats.drafted,
            stats.tokens_per_main_step(),
            stats.steps,
            plain_stats.steps,
            stats.preemptions
        );
    }
}

#[test]
fn fixture_greedy_with_mtp_equals_without_in_batches_with_chunked_prefill() {
    let m = load("fixtures/v3/r1_tiny");
    let ps = common::prompts(&[3, 41, 9, 17, 1, 30, 6, 12], m.config().vocab_size);
    let cfg = EngineConfig {
        block_size: 4,
        num_blocks: 128,
        batch_size: 4,
        max_prefill_tokens: 16,
    };
    mtp_equals_plain(&m, cfg, &ps, 12);
}

#[test]
fn fixture_greedy_with_mtp_equals_without_under_preemption() {
    let m = load("fixtures/v3/r1_tiny");
    let ps = common::prompts(&[3, 41, 9, 17, 1, 30, 6, 12], m.config().vocab_size);
    // 20 usable blocks of 4: the 41-token prompt alone takes 13 with its output.
    let cfg = EngineConfig {
        block_size: 4,
        num_blocks: 21,
        batch_size: 8,
        max_prefill_tokens: 16,
    };
    let (_, plain) = run(&m, cfg, 0, &ps, 10);
    assert!(plain.preemptions > 0, "the pool is not tight enough");
    mtp_equals_plain(&m, cfg, &ps, 10);
}

/// The shipped small model drafts real text well: requests in one batch accept different
/// numbers of drafts, and the output still equals plain greedy.
#[test]
fn small_model_greedy_with_mtp_equals_without_and_accepts_drafts() {
    let dir = "assets/cachalot-tiny-r1";
    let m = load(dir);
    let tok = Tokenizer::from_dir(&root().join(dir)).unwrap();
    let text = std::fs::read_to_string(root().join(dir).join("eval.txt")).unwrap();
    let ids = tok.encode(&text).unwrap();
    // Six prompts of mixed lengths from different places of the text.
    let lens = [40, 7, 90, 23, 3, 61];
    let ps: Vec<Vec<u32>> = lens
        .iter()
        .enumerate()
        .map(|(i, &n)| ids[i * 300..i * 300 + n].to_vec())
        .collect();
    let cfg = EngineConfig {
        block_size: 16,
        num_blocks: 64,
        batch_size: 4,
        max_prefill_tokens: 32,
    };
    mtp_equals_plain(&m, cfg, &ps, 24);
    // A tight pool: preemption and recompute with MTP (10 usable blocks of 16 tokens).
    let tight = EngineConfig {
        num_blocks: 11,
        batch_size: 6,
        ..cfg
    };
    let (_, plain) = run(&m, tight, 0, &ps, 24);
    assert!(plain.preemptions > 0, "the pool is not tight enough");
    mtp_equals_plain(&m, tight, &ps, 24);
    // Acceptance on real text, and the per-request acceptance differs within a batch.
    let mut engine = Engine::new(&m, None, cfg).unwrap();
    engine.enable_mtp(2).unwrap();
    for p in &ps {
        engine
            .add_request(Request {
                prompt: p.clone(),
                params: SamplingParams::greedy(),
                stop: StopConditions {
                    max_new_tokens: 24,
                    ..Default::default()
                },
                ignore_eos: true,
                logprobs: None,
                prompt_logprobs: None,
                json_object: false,
                json_after: None,
                json_lead: Vec::new(),
                json_more: Vec::new(),
                json_schema: None,
                dsml: false,
                special_text: Default::default(),
                waited_s: 0.0,
            })
            .unwrap();
    }
    let mut mixed = false;
    while engine.has_unfinished() {
        let r = engine.step().unwrap();
        engine.scheduler().check_invariants().unwrap();
        // A step where some drafts were accepted and some rejected across >1 decoding request.
        if r.decode_tokens > 1 && r.accepted > 0 && r.accepted < r.drafted {
            mixed = true;
        }
        engine.take_finished();
    }
    let s = engine.stats();
    assert!(
        s.acceptance_rate() > 0.3,
        "acceptance {:.2} on real text",
        s.acceptance_rate()
    );
    assert!(mixed, "no step mixed accepting and rejecting requests");
}

// ---- Sampling: the output law is the main model's ----

const V: usize = 4;

/// A toy model: the next token's logits depend only on the current token (a Markov chain
/// `main`); the "MTP layer" proposes the token after next from a different law `draft`, so
/// drafts are often wrong and verification has work to do. Hidden states are one-hot
/// tokens.
struct Markov {
    main: [[f32; V]; V],
    draft: [[f32; V]; V],
}

impl Markov {
    fn rows(&self, table: &[[f32; V]; V], batch: &Batch) -> Vec<f32> {
        batch
            .logits_indices
            .iter()
            .flat_map(|&i| table[batch.tokens[i] as usize].map(f32::ln))
            .collect()
    }
    fn one_hot(batch: &Batch) -> Vec<f32> {
        batch
            .tokens
            .iter()
            .flat_map(|&t| (0..V).map(move |j| (j == t as usize) as u8 as f32))
            .collect()
    }
}

impl Model for Markov {
    fn forward(&self, batch: &Batch, _cache: &mut KvCache) -> Result<Vec<f32>, EngineError> {
        Ok(self.rows(&self.main, batch))
    }
    fn cache_spec(&self) -> CacheSpec {
        CacheSpec {
            layers: 2,
            width: 1,
            int8_width: 0,
            float: cachalot_model::KvCacheDtype::F32,
            seq_state_width: 0,
        }
    }
    fn vocab_size(&self) -> usize {
        V
    }
    fn num_mtp_layers(&self) -> usize {
        1
    }
    fn forward_with_hidden(
        &self,
        batch: &Batch,
        _cache: &mut KvCache,
    ) -> Result<HiddenForward, EngineError> {
        Ok(HiddenForward {
            logits: self.rows(&self.main, batch),
            hidden: Self::one_hot(batch),
        })
    }
    fn mtp_forward(
        &self,
        _index: usize,
        batch: &Batch,
        prev_hidden: &[f32],
        _cache: &mut KvCache,
    ) -> Result<HiddenForward, EngineError> {
        assert_eq!(prev_hidden.len(), batch.num_tokens() * V);
        Ok(HiddenForward {
            logits: self.rows(&self.draft, batch),
            hidden: Self::one_hot(batch),
        })
    }
}

/// A chain whose MTP layer proposes from a law far from the main model's (drafts often
/// rejected).
fn wrong_drafts() -> Markov {
    Markov {
        main: [
            [0.40, 0.30, 0.20, 0.10],
            [0.10, 0.20, 0.30, 0.40],
            [0.25, 0.25, 0.35, 0.15],
            [0.30, 0.10, 0.10, 0.50],
        ],
        draft: [
            [0.10, 0.10, 0.10, 0.70],
            [0.70, 0.10, 0.10, 0.10],
            [0.25, 0.25, 0.25, 0.25],
            [0.05, 0.80, 0.10, 0.05],
        ],
    }
}

/// Generates 3 tokens after the prompt `[0]` for `n` requests (seeds 0..n) with next_n = 2;
/// returns the counts of each 3-token continuation and the engine's figures.
fn sample_triples(
    model: &Markov,
    params: &SamplingParams,
    n: usize,
) -> (
    HashMap<[u32; 3], usize>,
    cachalot_engine::metrics::EngineStats,
) {
    let cfg = EngineConfig {
        block_size: 4,
        num_blocks: 4 * 64 + 1,
        batch_size: 64,
        max_prefill_tokens: 64,
    };
    let mut engine = Engine::new(model, None, cfg).unwrap();
    engine.enable_mtp(2).unwrap();
    let mut counts = HashMap::new();
    let mut queued = 0;
    while queued < n || engine.has_unfinished() {
        while queued < n && engine.scheduler().num_waiting() < 64 {
            engine
                .add_request(Request {
                    prompt: vec![0],
                    params: SamplingParams {
                        seed: Some(queued as u64),
                        ..params.clone()
                    },
                    stop: StopConditions {
                        max_new_tokens: 3,
                        ..Default::default()
                    },
                    ignore_eos: true,
                    logprobs: None,
                    prompt_logprobs: None,
                    json_object: false,
                    json_after: None,
                    json_lead: Vec::new(),
                    json_more: Vec::new(),
                    json_schema: None,
                    dsml: false,
                    special_text: Default::default(),
                    waited_s: 0.0,
                })
                .unwrap();
            queued += 1;
        }
        engine.step().unwrap();
        for o in engine.take_finished() {
            let t: [u32; 3] = o.tokens.as_slice().try_into().unwrap();
            *counts.entry(t).or_insert(0) += 1;
        }
    }
    (counts, engine.stats().clone())
}

/// 40 000 requests sample 3 tokens each through speculative decoding (drafts from a wrong law,
/// verified against the token drawn from the main model's processed distribution). The 64 continuations
/// must follow the exact law of plain sampling: the product of the main model's processed
/// (temperature, top-p, top-k) distributions. Pearson's chi-square over the cells with
/// expected count ≥ 5 (k cells, k − 1 degrees of freedom); the bound is the 1 − 1e-4 quantile
/// of chi-square(k − 1) (`chi2_quantile_1e4`), so a correct
/// implementation fails it once in 10 000 seeds; the seeds are fixed, so the test is
/// deterministic. The same counts tested against the draft law instead give a chi-square in
/// the thousands (checked: the test has the power to see a wrong law).
#[test]
fn sampling_with_mtp_keeps_the_main_distribution() {
    let model = wrong_drafts();
    for params in [
        SamplingParams {
            temperature: 1.0,
            ..Default::default()
        },
        SamplingParams {
            temperature: 0.7,
            top_k: 3,
            top_p: 0.9,
            ..Default::default()
        },
    ] {
        let n = 40_000;
        let (counts, stats) = sample_triples(&model, &params, n);
        assert!(stats.drafted > 0 && stats.accepted_drafts > 0);
        assert!(stats.accepted_drafts < stats.drafted, "nothing rejected");
        // The exact law: the processed distribution of each row (no penalties: state-free).
        let law = |table: &[[f32; V]; V]| {
            let s = Sampler::new(params.clone(), &[]).unwrap();
            let rows: Vec<Vec<f64>> = table
                .iter()
                .map(|r| {
                    let mut p = vec![0.0; V];
                    for (t, x) in s.candidates(&r.map(f32::ln)) {
                        p[t as usize] = x as f64;
                    }
                    p
                })
                .collect();
            rows
        };
        let p = law(&model.main);
        let q = law(&model.draft);
        let chi2 = |rows: &[Vec<f64>]| {
            let (mut x2, mut cells) = (0.0, 0);
            for a in 0..V {
                for b in 0..V {
                    for c in 0..V {
                        let e = rows[0][a] * rows[a][b] * rows[b][c] * n as f64;
                        let o = *counts.get(&[a as u32, b as u32, c as u32]).unwrap_or(&0) as f64;
                        if e >= 5.0 {
                            x2 += (o - e).powi(2) / e;
                            cells += 1;
                        }
                    }
                }
            }
            (x2, cells)
        };
        let (x2, cells) = chi2(&p);
        let bound = chi2_quantile_1e4(cells - 1);
        eprintln!(
            "{params:?}: chi2 {x2:.1} over {cells} cells (bound {bound:.1}), acceptance {:.2}",
            stats.acceptance_rate()
        );
        assert!(x2 < bound, "chi2 {x2:.1} >= {bound:.1} over {cells} cells");
        // Power: the drafter's law (a plainly different law over the same cells) is rejected.
        let mixed: Vec<Vec<f64>> = (0..V).map(|a| q[a].clone()).collect();
        let (x2_wrong, _) = chi2(&mixed);
        assert!(x2_wrong > 10.0 * bound, "{x2_wrong}");
        // Tokens outside the processed support never appear.
        for (t, &c) in &counts {
            let e = p[0][t[0] as usize]
                * p[t[0] as usize][t[1] as usize]
                * p[t[1] as usize][t[2] as usize];
            assert!(
                e > 0.0 || c == 0,
                "{t:?} appeared {c} times outside the support"
            );
        }
    }
}

/// The 1 − 1e-4 quantile of chi-square with `df` degrees of freedom by the Wilson–Hilferty
/// cube-root normal approximation, slightly above the exact quantile here (44.6 for 15 vs
/// exact 44.26, 75.1 for 35 vs exact 74.93).
fn chi2_quantile_1e4(df: usize) -> f64 {
    let k = df as f64;
    let z = 3.719; // the standard normal's 1 - 1e-4 quantile
    let a = 2.0 / (9.0 * k);
    k * (1.0 - a + z * a.sqrt()).powi(3)
}

/// NaN logits (broken weights) stop the engine with an error naming the cause, from the main
/// model and from the MTP layer, instead of sampling token 0.
#[test]
fn nan_logits_are_an_error() {
    let ok = [[0.25f32; V]; V];
    let mut bad = ok;
    for row in &mut bad {
        row[2] = f32::NAN;
    }
    for (main, draft, what) in [(bad, ok, "the model"), (ok, bad, "the MTP layer")] {
        let model = Markov { main, draft };
        let cfg = EngineConfig {
            block_size: 4,
            num_blocks: 16,
            batch_size: 1,
            max_prefill_tokens: 16,
        };
        let mut engine = Engine::new(&model, None, cfg).unwrap();
        engine.enable_mtp(1).unwrap();
        engine
            .add_request(Request {
                prompt: vec![1, 1],
                params: SamplingParams::greedy(),
                stop: StopConditions {
                    max_new_tokens: 4,
                    ..Default::default()
                },
                ignore_eos: true,
                logprobs: None,
                prompt_logprobs: None,
                json_object: false,
                json_after: None,
                json_lead: Vec::new(),
                json_more: Vec::new(),
                json_schema: None,
                dsml: false,
                special_text: Default::default(),
                waited_s: 0.0,
            })
            .unwrap();
        let e = engine.run_to_completion(|_, _| {}).unwrap_err().to_string();
        assert!(e.contains(what) && e.contains("NaN"), "{what}: {e}");
    }
    // The one-sequence loop (`generate`, `chat`) too.
    let model = Markov {
        main: bad,
        draft: ok,
    };
    let stop = StopConditions {
        max_new_tokens: 4,
        ..Default::default()
    };
    let e = cachalot_engine::generate::generate(
        &model,
        None,
        &[1, 1],
        SamplingParams::greedy(),
        &stop,
        None,
        &mut |_| {},
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("NaN"), "{e}");
}

/// Each request's tokens (by request id) for `n` seeded requests after the prompt `[0]`,
/// `n_new` tokens each, with `next_n` drafts and a pool of `num_blocks` blocks of 4.
fn seeded_tokens(
    model: &Markov,
    params: &SamplingParams,
    next_n: usize,
    num_blocks: usize,
    n: usize,
    n_new: usize,
) -> (Vec<Vec<u32>>, cachalot_engine::metrics::EngineStats) {
    let cfg = EngineConfig {
        block_size: 4,
        num_blocks,
        batch_size: 8,
        max_prefill_tokens: 64,
    };
    let (outs, stats) = run_with(model, cfg, next_n, &vec![vec![0]; n], n_new, |i| {
        SamplingParams {
            seed: Some(1000 + i as u64),
            ..params.clone()
        }
    });
    (outs.into_iter().map(|o| o.tokens).collect(), stats)
}

/// A seeded request draws the same tokens with MTP as without it, whatever its drafts (here
/// from a wrong law), their number (1 or 3) and the pool's size (a tight pool cuts drafts and
/// preempts): each token takes its own position's random number, and verification emits the
/// token plain sampling draws (the seed's rule).
#[test]
fn seeded_sampling_gives_the_same_tokens_with_or_without_mtp() {
    let model = wrong_drafts();
    let params = SamplingParams {
        temperature: 0.8,
        top_k: 3,
        ..Default::default()
    };
    let (n, n_new) = (24, 20);
    let (plain, _) = seeded_tokens(&model, &params, 0, 8 * 8 + 1, n, n_new);
    for (next_n, blocks) in [(1, 8 * 8 + 1), (3, 8 * 8 + 1), (3, 12), (2, 9)] {
        let (spec, stats) = seeded_tokens(&model, &params, next_n, blocks, n, n_new);
        assert!(stats.drafted > 0, "next_n {next_n}, {blocks} blocks");
        assert!(stats.accepted_drafts > 0 && stats.accepted_drafts < stats.drafted);
        if blocks < 20 {
            assert!(stats.preemptions > 0, "{blocks} blocks never preempted");
        }
        assert_eq!(spec, plain, "next_n {next_n}, {blocks} blocks");
    }
}
