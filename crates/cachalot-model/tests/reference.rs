//! The forward pass against references computed by transformers 5.24.0 (`DeepseekV3ForCausalLM`,
//! float32, on exactly the dequantized weights) for the tiny models in `fixtures/v3/`, generated
//! by `tools/reference/make_fixtures.py`. Also: cache/batching invariants that must hold exactly
//! in exact arithmetic (prefill-then-decode = full prefill; packed batch = each sequence alone;
//! naive = absorbed MLA; FP8 native = dequantized at load).

use std::path::PathBuf;

use cachalot_kernels::f32_to_bf16;
use cachalot_model::batch::{Batch, BlockAllocator, KvCache, LogitsWanted};
use cachalot_model::eval::{self, BLOCK_SIZE};
use cachalot_model::tokenizer::Tokenizer;
use cachalot_model::{AttentionPath, DeepseekV3, Fp8Mode, KvCacheDtype, LoadOptions};
use serde_json::Value;

mod common;
use common::{check_logprobs, floats, ids, max_abs_diff, mtp_logprobs, mtp_rows};

const MODELS: [&str; 3] = ["r1_tiny", "kimi_tiny", "v3_noq_tiny"];

fn fixture_dir(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../fixtures/v3")
        .join(name)
}

fn reference(name: &str) -> Value {
    let p = fixture_dir(name).join("reference.json");
    serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap()
}

fn load(name: &str) -> DeepseekV3 {
    DeepseekV3::load(&fixture_dir(name), LoadOptions::default()).unwrap()
}

fn load_with_mtp() -> DeepseekV3 {
    let opts = LoadOptions {
        fp8: Fp8Mode::Native,
        load_mtp: true,
        ..Default::default()
    };
    DeepseekV3::load(&fixture_dir("r1_tiny"), opts).unwrap()
}

#[test]
fn logprobs_match_transformers() {
    for name in MODELS {
        let m = load(name);
        let r = reference(name);
        for (i, seq) in r["sequences"].as_array().unwrap().iter().enumerate() {
            let toks = ids(&seq["token_ids"]);
            let got = eval::next_token_logprobs(&m, &toks, 512).unwrap();
            check_logprobs(
                &format!("{name} sequence {i}"),
                &got,
                &floats(&seq["logprobs"]),
            );
        }
    }
}

#[test]
fn text_tokenization_and_logprobs_match() {
    for name in MODELS {
        let dir = fixture_dir(name);
        let r = reference(name);
        let text_path = dir.join(r["text"]["file"].as_str().unwrap());
        let text = std::fs::read_to_string(text_path).unwrap();
        let toks = Tokenizer::from_dir(&dir).unwrap().encode(&text).unwrap();
        assert_eq!(toks, ids(&r["text"]["token_ids"]), "{name}: tokenization");
        let m = load(name);
        let got = eval::next_token_logprobs(&m, &toks, 64).unwrap();
        check_logprobs(
            &format!("{name} text"),
            &got,
            &floats(&r["text"]["logprobs"]),
        );
    }
}

#[test]
fn greedy_continuations_match() {
    for name in MODELS {
        let m = load(name);
        let r = reference(name);
        for g in r["greedy"].as_array().unwrap() {
            let want = ids(&g["continuation"]);
            let got = eval::greedy(&m, &ids(&g["prompt"]), want.len()).unwrap();
            assert_eq!(got, want, "{name}: greedy continuation");
        }
    }
}

/// Decoding token by token (absorbed MLA over the cache) equals one full-sequence prefill.
#[test]
fn prefill_then_decode_equals_full_prefill() {
    for name in MODELS {
        let m = load(name);
        let toks = ids(&reference(name)["sequences"][2]["token_ids"]);
        let full = eval::next_token_logprobs(&m, &toks, 4096).unwrap();
        let stepwise = eval::next_token_logprobs(&m, &toks, 1).unwrap();
        let chunked = eval::next_token_logprobs(&m, &toks, 7).unwrap();
        assert!(max_abs_diff(&full, &stepwise) < 1e-4, "{name}: stepwise");
        assert!(max_abs_diff(&full, &chunked) < 1e-4, "{name}: chunked");
    }
}

#[test]
fn naive_and_absorbed_attention_agree() {
    for name in MODELS {
        let mut m = load(name);
        let toks = ids(&reference(name)["sequences"][1]["token_ids"]);
        m.attention_path = AttentionPath::Naive;
        let a = eval::next_token_logprobs(&m, &toks, 4096).unwrap();
        m.attention_path = AttentionPath::Absorbed;
        let b = eval::next_token_logprobs(&m, &toks, 4096).unwrap();
        assert!(max_abs_diff(&a, &b) < 1e-4, "{name}");
    }
}

/// Contexts longer than one attention chunk (128 positions): the absorbed path merges the
/// chunks' partial softmaxes, and still agrees with the naive path's single softmax.
#[test]
fn absorbed_attention_over_several_chunks_agrees_with_naive() {
    for name in MODELS {
        let mut m = load(name);
        let r = reference(name);
        let mut toks: Vec<u32> = Vec::new();
        while toks.len() < 300 {
            for s in r["sequences"].as_array().unwrap() {
                toks.extend(ids(&s["token_ids"]));
            }
        }
        toks.truncate(300);
        m.attention_path = AttentionPath::Naive;
        let a = eval::next_token_logprobs(&m, &toks, 4096).unwrap();
        m.attention_path = AttentionPath::Absorbed;
        let b = eval::next_token_logprobs(&m, &toks, 4096).unwrap();
        assert_eq!(a.len(), 299);
        let worst = max_abs_diff(&a, &b);
        assert!(worst < 1e-4, "{name}: {worst}");
    }
}

/// Sequences of different lengths, packed into one batch (prefills and decodes mixed, on
/// interleaved non-contiguous cache blocks), give the logits each gives alone.
#[test]
fn packed_batch_equals_each_sequence_alone() {
    let name = "r1_tiny";
    let m = load(name);
    let seqs: Vec<Vec<u32>> = reference(name)["sequences"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| ids(&s["token_ids"]))
        .collect();
    let (packed, alone) = packed_and_alone(&m, &seqs);
    for (i, (g, a)) in packed.iter().zip(&alone).enumerate() {
        let d = max_abs_diff(g, a);
        assert!(d < 1e-4, "sequence {i}: packed vs alone differ by {d}");
    }
}

#[test]
fn fp8_native_equals_dequantized_at_load() {
    let name = "r1_tiny";
    let native = load(name);
    let f32m = DeepseekV3::load(
        &fixture_dir(name),
        LoadOptions {
            fp8: Fp8Mode::DequantizeF32,
            load_mtp: false,
            ..Default::default()
        },
    )
    .unwrap();
    assert!(f32m.weight_bytes() > 3 * native.weight_bytes() / 2);
    let toks = ids(&reference(name)["sequences"][1]["token_ids"]);
    let a = eval::next_token_logprobs(&native, &toks, 4096).unwrap();
    let b = eval::next_token_logprobs(&f32m, &toks, 4096).unwrap();
    assert!(max_abs_diff(&a, &b) < 1e-4);
}

#[test]
fn mtp_layer_loads_apart() {
    let m = load_with_mtp();
    assert_eq!(m.mtp_layers().len(), 1);
    assert_eq!(m.cache_spec().layers, m.config().num_hidden_layers + 1);
    assert_eq!(BLOCK_SIZE, 128);
}

/// The MTP layer against transformers' `MtpModel` (the `mtp` entry of r1_tiny's reference):
/// row i feeds token i+1 with the main model's hidden state at position i.
#[test]
fn mtp_layer_matches_transformers() {
    let m = load_with_mtp();
    let r = reference("r1_tiny");
    let mtp = &r["mtp"];
    let toks = ids(&mtp["token_ids"]);
    let n = toks.len();
    let vocab = m.config().vocab_size;
    let logits = mtp_rows(&m, &toks);
    let rows: Vec<&[f32]> = logits.chunks_exact(vocab).collect();
    assert_eq!(rows.len(), n - 1);
    let want = floats(&mtp["logprobs"]);
    let got = mtp_logprobs(&logits, vocab, &toks);
    check_logprobs("r1_tiny mtp", &got, &want);
    let argmax = ids(&mtp["argmax"]);
    let margins = floats(&mtp["margins"]);
    for (i, row) in rows.iter().enumerate() {
        if margins[i] > 1e-3 {
            assert_eq!(cachalot_kernels::argmax(row) as u32, argmax[i], "row {i}");
        }
    }
    let d = max_abs_diff(rows[n - 2], &floats(&mtp["last_logits"]));
    assert!(d < 1e-3, "last logits differ by {d}");
}

/// MTP speculative decoding emits exactly the plain greedy tokens, for 1–3 chained drafts.
#[test]
fn greedy_with_mtp_equals_greedy() {
    let m = load_with_mtp();
    let r = reference("r1_tiny");
    for g in r["greedy"].as_array().unwrap() {
        let prompt = ids(&g["prompt"]);
        let want = ids(&g["continuation"]);
        for next_n in 1..=3 {
            let (got, stats) = eval::greedy_mtp(&m, &prompt, want.len(), next_n).unwrap();
            assert_eq!(got, want, "next_n {next_n}");
            assert_eq!(stats.drafted, (stats.main_steps - 1) * next_n);
            assert!(stats.accepted + stats.main_steps >= want.len());
        }
    }
}

/// Drafts from a perfect oracle with every third draft corrupted, so that steps accept 0..n
/// drafts: the output is still exactly greedy, and accepted drafts save main-model steps.
#[test]
fn speculative_accept_and_reject_paths_keep_greedy_output() {
    struct Oracle {
        truth: Vec<u32>,
        calls: usize,
    }
    impl eval::Drafter for Oracle {
        fn draft(&mut self, c: eval::DraftContext) -> cachalot_model::Result<Vec<u32>> {
            let n = c.seq.len();
            self.calls += 1;
            Ok((0..c.n)
                .map(|i| {
                    let t = self.truth.get(n + i).copied().unwrap_or(2);
                    if (self.calls + i) % 3 == 2 {
                        (t + 1) % 512
                    } else {
                        t
                    }
                })
                .collect())
        }
    }
    let m = load("r1_tiny");
    let r = reference("r1_tiny");
    let g = &r["greedy"][1];
    let prompt = ids(&g["prompt"]);
    let want = ids(&g["continuation"]);
    let truth: Vec<u32> = prompt.iter().chain(&want).copied().collect();
    for next_n in 1..=3 {
        let mut oracle = Oracle {
            truth: truth.clone(),
            calls: 0,
        };
        let (got, stats) =
            eval::speculative_greedy(&m, &prompt, want.len(), next_n, &mut oracle).unwrap();
        assert_eq!(got, want, "next_n {next_n}");
        assert!(
            stats.accepted > 0 && stats.accepted < stats.drafted,
            "{stats:?}"
        );
        assert!(stats.main_steps < want.len(), "{stats:?}");
    }
}

/// `bf16_dot` (bf16 weights times bf16-rounded activations, `Matrix::to_bf16_dot`) still matches
/// transformers' f32 forward within the same tolerance on every fixture, changes the logits of
/// the models that hold bf16 weights, and keeps the bytes read per token.
#[test]
fn bf16_dot_stays_within_the_reference_tolerance() {
    for name in MODELS {
        let opts = LoadOptions {
            bf16_dot: true,
            ..Default::default()
        };
        let m = DeepseekV3::load(&fixture_dir(name), opts).unwrap();
        let plain = load(name);
        let r = reference(name);
        let mut changed = false;
        for (i, seq) in r["sequences"].as_array().unwrap().iter().enumerate() {
            let toks = ids(&seq["token_ids"]);
            let got = eval::next_token_logprobs(&m, &toks, 512).unwrap();
            let base = eval::next_token_logprobs(&plain, &toks, 512).unwrap();
            changed |= got != base;
            check_logprobs(
                &format!("{name} sequence {i} with bf16_dot"),
                &got,
                &floats(&seq["logprobs"]),
            );
        }
        assert!(
            changed,
            "{name}: bf16_dot changed no logit (its bf16 weights were not used)"
        );
        assert_eq!(m.decode_bytes_per_token(), plain.decode_bytes_per_token());
    }
}

fn load_bf16_cache(name: &str) -> DeepseekV3 {
    let mut m = load(name);
    m.set_kv_cache_dtype(KvCacheDtype::Bf16);
    m
}

/// C16 (`set_kv_cache_dtype(Bf16)`): the cache holds, bit for bit, the bf16 rounding of the
/// latents the f32 cache holds (layer 0's depend on nothing the cache changes), in half the
/// bytes; logits change, and each sequence's mean NLL stays within 0.5% of the f32 cache's.
#[test]
fn bf16_latent_cache_holds_the_rounded_latents() {
    for name in MODELS {
        let plain = load(name);
        let m = load_bf16_cache(name);
        let r = reference(name);
        let toks = ids(&r["sequences"][2]["token_ids"]);
        let run = |m: &DeepseekV3| {
            let mut cache = KvCache::new(m.cache_spec(), 4, toks.len().div_ceil(4));
            let mut alloc = BlockAllocator::new(cache.num_blocks());
            let mut table = Vec::new();
            alloc.ensure(&mut table, toks.len(), 4).unwrap();
            let mut b = Batch::default();
            b.push_seq(&toks, 0, table, LogitsWanted::None);
            m.forward(&b, &mut cache, false).unwrap();
            cache
        };
        let (c32, c16) = (run(&plain), run(&m));
        assert_eq!(c16.bytes() * 2, c32.bytes(), "{name}: bytes");
        let want: Vec<u16> = c32.layer(0).iter().map(|&v| f32_to_bf16(v)).collect();
        assert_eq!(
            c16.layer_bf16(0),
            &want[..],
            "{name}: layer 0's cached latents"
        );
        assert!(c16.layer(0).is_empty());

        let mut changed = false;
        for (i, seq) in r["sequences"].as_array().unwrap().iter().enumerate() {
            let toks = ids(&seq["token_ids"]);
            let got = eval::next_token_logprobs(&m, &toks, 512).unwrap();
            let exact = eval::next_token_logprobs(&plain, &toks, 512).unwrap();
            changed |= got != exact;
            // These random-weight models swing single tokens' logprobs by up to ~0.7 when
            // their latents are rounded to bf16 (0.01-0.7 measured); their mean NLL moves by at
            // most 0.16%. (The shipped, trained model: `shipped_model.rs`.)
            let (nll, _) = eval::nll_ppl(&got);
            let (nll_exact, _) = eval::nll_ppl(&exact);
            let rel = ((nll - nll_exact) / nll_exact).abs();
            assert!(
                rel < 5e-3,
                "{name} sequence {i}: mean NLL {nll} vs {nll_exact}"
            );
        }
        assert!(changed, "{name}: the bf16 cache changed no logit");
    }
}

/// With a bf16 cache every attention form reads the same rounded latents (the step's own
/// tokens too, rounded where they are made), so one form gives the same bits whatever the
/// chunking: token by token, in chunks of 7 or in one prefill, naive or absorbed alike. Across
/// the forms the arithmetic differs (the naive form up-projects the latents in f32, the absorbed
/// one attends in BF16 × BF16 with bf16 queries and probabilities): on these chaotic
/// random-weight fixtures single logprobs move by up to ~0.5 and the mean NLL by ~0.1%,
/// bounded here at 0.5%. A packed batch equals each sequence alone.
#[test]
fn bf16_latent_cache_keeps_the_cache_invariants() {
    let close = |what: &str, a: &[f32], b: &[f32]| {
        let (na, nb) = (eval::nll_ppl(a).0, eval::nll_ppl(b).0);
        assert!(
            ((na - nb) / nb).abs() < 5e-3,
            "{what}: mean NLL {na} vs {nb}"
        );
    };
    for name in MODELS {
        let mut m = load_bf16_cache(name);
        let r = reference(name);
        let toks = ids(&r["sequences"][2]["token_ids"]);
        let mut by_form = Vec::new();
        for path in [AttentionPath::Naive, AttentionPath::Absorbed] {
            m.attention_path = path;
            let full = eval::next_token_logprobs(&m, &toks, 4096).unwrap();
            for chunk in [1, 7] {
                let got = eval::next_token_logprobs(&m, &toks, chunk).unwrap();
                assert_eq!(
                    got, full,
                    "{name} {path:?}: chunks of {chunk} vs one prefill"
                );
            }
            by_form.push(full);
        }
        assert_ne!(
            by_form[0], by_form[1],
            "{name}: the forms' arithmetic differs"
        );
        close(
            &format!("{name}: naive vs absorbed"),
            &by_form[0],
            &by_form[1],
        );
        m.attention_path = AttentionPath::Auto;
        let auto = eval::next_token_logprobs(&m, &toks, 7).unwrap();
        close(&format!("{name}: auto"), &auto, &by_form[0]);

        let mut long: Vec<u32> = Vec::new();
        while long.len() < 300 {
            for s in r["sequences"].as_array().unwrap() {
                long.extend(ids(&s["token_ids"]));
            }
        }
        long.truncate(300);
        m.attention_path = AttentionPath::Naive;
        let a = eval::next_token_logprobs(&m, &long, 4096).unwrap();
        m.attention_path = AttentionPath::Absorbed;
        let b = eval::next_token_logprobs(&m, &long, 4096).unwrap();
        close(&format!("{name}: 300 positions"), &a, &b);
    }

    // Packed: two sequences, prefill then 3-token steps, on interleaved blocks, each form
    // alike (one form throughout: prefills and 3-token steps would otherwise take different
    // ones): the same bits as each sequence alone.
    for path in [AttentionPath::Naive, AttentionPath::Absorbed] {
        packed_equals_alone_bf16(path);
    }
}

fn packed_equals_alone_bf16(path: AttentionPath) {
    let mut m = load_bf16_cache("r1_tiny");
    m.attention_path = path;
    let r = reference("r1_tiny");
    let seqs: Vec<Vec<u32>> = (0..2)
        .map(|i| ids(&r["sequences"][i]["token_ids"]))
        .collect();
    let (packed, alone) = packed_and_alone(&m, &seqs);
    for (i, (g, a)) in packed.iter().zip(&alone).enumerate() {
        assert_eq!(g, a, "{path:?}: sequence {i}: packed vs alone");
    }
}

/// Every sequence's logits (all positions) run alone in one prefill, and packed: one step
/// prefilling all but the last 3 tokens of each, then one with the rest, 3 tokens each, on
/// blocks of 4 allocated across the sequences in turn. Returns (packed, alone).
fn packed_and_alone(m: &DeepseekV3, seqs: &[Vec<u32>]) -> (Vec<Vec<f32>>, Vec<Vec<f32>>) {
    let vocab = m.config().vocab_size;
    let alone: Vec<Vec<f32>> = seqs
        .iter()
        .map(|s| {
            let mut cache = KvCache::new(m.cache_spec(), 4, s.len().div_ceil(4));
            let mut alloc = BlockAllocator::new(cache.num_blocks());
            let mut table = Vec::new();
            alloc.ensure(&mut table, s.len(), 4).unwrap();
            let mut b = Batch::default();
            b.push_seq(s, 0, table, LogitsWanted::All);
            m.forward(&b, &mut cache, false).unwrap().logits
        })
        .collect();
    let blocks: usize = seqs.iter().map(|s| s.len().div_ceil(4)).sum();
    let mut cache = KvCache::new(m.cache_spec(), 4, blocks);
    let mut alloc = BlockAllocator::new(blocks);
    let mut tables: Vec<Vec<u32>> = vec![Vec::new(); seqs.len()];
    for n in (4..)
        .step_by(4)
        .take_while(|&n| seqs.iter().any(|s| n < s.len() + 4))
    {
        for (s, t) in seqs.iter().zip(tables.iter_mut()) {
            if n < s.len() + 4 {
                alloc.ensure(t, n.min(s.len()), 4).unwrap();
            }
        }
    }
    let split: Vec<usize> = seqs.iter().map(|s| s.len().saturating_sub(3)).collect();
    let mut got: Vec<Vec<f32>> = vec![Vec::new(); seqs.len()];
    for step in 0..2 {
        let mut b = Batch::default();
        let spans: Vec<(usize, usize)> = (0..seqs.len())
            .map(|i| match step {
                0 => (0, split[i]),
                _ => (split[i], seqs[i].len()),
            })
            .collect();
        for (i, &(lo, hi)) in spans.iter().enumerate() {
            b.push_seq(&seqs[i][lo..hi], lo, tables[i].clone(), LogitsWanted::All);
        }
        let out = m.forward(&b, &mut cache, false).unwrap();
        let mut off = 0;
        for (i, &(lo, hi)) in spans.iter().enumerate() {
            got[i].extend_from_slice(&out.logits[off * vocab..(off + hi - lo) * vocab]);
            off += hi - lo;
        }
    }
    (got, alone)
}

/// A prompt's positions get the bits of its whole prefill however it is split into steps
/// (chunked prefill, or a prefix cache's blocks followed by the rest), over an f32 and a bf16
/// cache: prompt positions (`Batch::mark_prefill`) always take the naive path, and are
/// attended in f32.
#[test]
fn a_prompt_split_anywhere_gives_its_whole_prefill_bits() {
    for name in MODELS {
        for dtype in [KvCacheDtype::F32, KvCacheDtype::Bf16] {
            let mut m = DeepseekV3::load(&fixture_dir(name), LoadOptions::default()).unwrap();
            m.set_kv_cache_dtype(dtype);
            let vocab = m.config().vocab_size;
            let prompt: Vec<u32> = (0..37u32).map(|i| (i * 37 + 11) % vocab as u32).collect();
            let run = |cuts: &[usize]| -> Vec<u32> {
                let mut cache = KvCache::new(m.cache_spec(), 4, 16);
                let mut alloc = BlockAllocator::new(16);
                let mut table = Vec::new();
                alloc.ensure(&mut table, prompt.len(), 4).unwrap();
                let mut bits = Vec::new();
                let mut start = 0;
                for &end in cuts.iter().chain([&prompt.len()]) {
                    let mut b = Batch::default();
                    b.push_seq(&prompt[start..end], start, table.clone(), LogitsWanted::All);
                    b.mark_prefill();
                    let out = m.forward(&b, &mut cache, false).unwrap();
                    bits.extend(out.logits.iter().map(|x| x.to_bits()));
                    start = end;
                }
                bits
            };
            let whole = run(&[]);
            for cuts in [&[28][..], &[13, 16], &[1, 2, 3, 36], &[32]] {
                assert!(
                    run(cuts) == whole,
                    "{name} {dtype:?}: split at {cuts:?} differs from the whole prefill"
                );
            }
        }
    }
}

/// The MTP layer's rows of prompt positions, marked as prompt (as the engine's catch-up marks
/// them), give the same bits however they are cut into forwards: a prefix cache shares rows a
/// request computed in other chunks than the sharer would have (f32 and bf16 caches).
#[test]
fn mtp_prompt_rows_split_anywhere_give_their_whole_bits() {
    for dtype in [KvCacheDtype::F32, KvCacheDtype::Bf16] {
        let mut m = DeepseekV3::load(
            &fixture_dir("r1_tiny"),
            LoadOptions {
                load_mtp: true,
                ..Default::default()
            },
        )
        .unwrap();
        m.set_kv_cache_dtype(dtype);
        let vocab = m.config().vocab_size;
        let prompt: Vec<u32> = (0..38u32).map(|i| (i * 41 + 7) % vocab as u32).collect();
        let n = prompt.len() - 1;
        let mut cache = KvCache::new(m.cache_spec(), 4, 16);
        let mut alloc = BlockAllocator::new(16);
        let mut table = Vec::new();
        alloc.ensure(&mut table, prompt.len(), 4).unwrap();
        let mut b = Batch::default();
        b.push_seq(&prompt, 0, table.clone(), LogitsWanted::None);
        b.mark_prefill();
        let hidden = m.forward(&b, &mut cache, true).unwrap().hidden.unwrap();
        let h = hidden.len() / prompt.len();
        // MTP rows 0..n pair the hidden state at i with token i + 1; each run writes them all
        // again from the first (a chunk reads only rows before its end).
        let mut run = |cuts: &[usize]| -> Vec<u32> {
            let c = &mut cache;
            let mut bits = Vec::new();
            let mut start = 0;
            for &end in cuts.iter().chain([&n]) {
                let mut b = Batch::default();
                b.push_seq(
                    &prompt[start + 1..end + 1],
                    start,
                    table.clone(),
                    LogitsWanted::All,
                );
                b.mark_prefill();
                let out = m
                    .mtp_forward(0, &b, &hidden[start * h..end * h], c, false)
                    .unwrap();
                bits.extend(out.logits.iter().map(|x| x.to_bits()));
                start = end;
            }
            bits
        };
        let whole = run(&[]);
        for cuts in [&[30][..], &[5, 6], &[1, 2, 3, 35], &[16]] {
            assert!(
                run(cuts) == whole,
                "{dtype:?}: MTP rows split at {cuts:?} differ from the whole catch-up"
            );
        }
    }
}

/// Generated positions computed together (a recompute after preemption, an MTP verification)
/// give the bits their one-token decode steps gave, over an f32 and a bf16 cache: generated
/// positions (`Batch::mark_generated`) always take the absorbed path.
#[test]
fn generated_positions_recomputed_together_give_their_decode_bits() {
    for name in MODELS {
        for dtype in [KvCacheDtype::F32, KvCacheDtype::Bf16] {
            let mut m = DeepseekV3::load(&fixture_dir(name), LoadOptions::default()).unwrap();
            m.set_kv_cache_dtype(dtype);
            let vocab = m.config().vocab_size;
            // A short prompt and many generated tokens: the cost rule alone would take the naive
            // path for them together.
            let prompt: Vec<u32> = (0..3u32).map(|i| (i * 29 + 5) % vocab as u32).collect();
            let generated: Vec<u32> = (0..30u32).map(|i| (i * 13 + 3) % vocab as u32).collect();
            let fresh = || {
                let mut cache = KvCache::new(m.cache_spec(), 4, 16);
                let mut alloc = BlockAllocator::new(16);
                let mut table = Vec::new();
                alloc.ensure(&mut table, 40, 4).unwrap();
                let mut b = Batch::default();
                b.push_seq(&prompt, 0, table.clone(), LogitsWanted::None);
                b.mark_prefill();
                m.forward(&b, &mut cache, false).unwrap();
                (cache, table)
            };
            let bits = |x: Vec<f32>| x.iter().map(|v| v.to_bits()).collect::<Vec<u32>>();
            // One token a step.
            let (mut cache, table) = fresh();
            let mut steps = Vec::new();
            for (i, &t) in generated.iter().enumerate() {
                let mut b = Batch::default();
                b.push_seq(&[t], prompt.len() + i, table.clone(), LogitsWanted::Last);
                b.mark_generated();
                steps.extend(bits(m.forward(&b, &mut cache, false).unwrap().logits));
            }
            // All of them in one chunk, and in two.
            for cuts in [&[][..], &[12]] {
                let (mut cache, table) = fresh();
                let mut together = Vec::new();
                let mut start = 0;
                for &end in cuts.iter().chain([&generated.len()]) {
                    let mut b = Batch::default();
                    b.push_seq(
                        &generated[start..end],
                        prompt.len() + start,
                        table.clone(),
                        LogitsWanted::All,
                    );
                    b.mark_generated();
                    together.extend(bits(m.forward(&b, &mut cache, false).unwrap().logits));
                    start = end;
                }
                assert!(
                    together == steps,
                    "{name} {dtype:?}: generated positions cut at {cuts:?} differ from their \
                     decode steps"
                );
            }
        }
    }
}
