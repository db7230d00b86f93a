//! Prefill/decode disaggregation in the engine (spec `executor.md` §5): a prompt prefilled by
//! one engine ([`Engine::add_request_for_transfer`]) and continued by another
//! ([`Engine::add_prefilled`], its KV carried through the wire format) gives the tokens one
//! engine gives, greedy and seeded sampling, with and without MTP, though the decode engine
//! uses another block size, a smaller batch and (greedy) a pool too small for every request at
//! once.

use std::path::PathBuf;

use cachalot_engine::{
    Engine, EngineConfig, KvSnapshot, Request, RequestOutput, SamplingParams, StopConditions,
};
use cachalot_model::tokenizer::Tokenizer;
use cachalot_model::{DeepseekV3, Fp8Mode, KvCacheDtype, LoadOptions};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn load(dtype: KvCacheDtype) -> DeepseekV3 {
    let mut m = DeepseekV3::load(
        &root().join("assets/cachalot-tiny-r1"),
        LoadOptions {
            fp8: Fp8Mode::Native,
            load_mtp: true,
            ..Default::default()
        },
    )
    .unwrap();
    m.set_kv_cache_dtype(dtype);
    m
}

fn request(prompt: &[u32], params: &SamplingParams, n: usize) -> Request {
    Request {
        prompt: prompt.to_vec(),
        params: params.clone(),
        stop: StopConditions {
            max_new_tokens: n,
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
    }
}

fn engine(m: &DeepseekV3, cfg: EngineConfig, next_n: usize) -> Engine<'static, &DeepseekV3> {
    let mut e = Engine::new(m, None, cfg).unwrap();
    if next_n > 0 {
        e.enable_mtp(next_n).unwrap();
    }
    e
}

fn finish(mut e: Engine<'_, &DeepseekV3>) -> Vec<RequestOutput> {
    let mut outs = e.run_to_completion(|_, _| {}).unwrap();
    assert_eq!(e.scheduler().kv().pool().num_used(), 0, "blocks leaked");
    e.scheduler().check_invariants().unwrap();
    outs.sort_by_key(|o| o.id);
    outs
}

/// `kv` written in the wire format and read back.
fn through_wire(kv: &KvSnapshot) -> KvSnapshot {
    let mut wire = Vec::new();
    kv.write_to(&mut wire).unwrap();
    KvSnapshot::read_from(&mut wire.as_slice(), u64::MAX).unwrap()
}

const PREFILL: EngineConfig = EngineConfig {
    block_size: 16,
    num_blocks: 64,
    batch_size: 4,
    max_prefill_tokens: 32,
};

/// The decode side: other blocks, room for only a few requests at once.
const DECODE: EngineConfig = EngineConfig {
    block_size: 8,
    num_blocks: 24,
    batch_size: 3,
    max_prefill_tokens: 64,
};

#[test]
fn prefill_here_decode_there_equals_one_engine() {
    let dir = root().join("assets/cachalot-tiny-r1");
    let tok = Tokenizer::from_dir(&dir).unwrap();
    let text = std::fs::read_to_string(dir.join("eval.txt")).unwrap();
    let ids = tok.encode(&text).unwrap();
    let lens = [40, 7, 90, 23, 3, 61];
    let prompts: Vec<Vec<u32>> = lens
        .iter()
        .enumerate()
        .map(|(i, &n)| ids[i * 300..i * 300 + n].to_vec())
        .collect();
    let n_new = 20;
    let sampled = SamplingParams {
        temperature: 0.8,
        top_p: 0.95,
        seed: Some(7),
        ..SamplingParams::greedy()
    };
    for dtype in [KvCacheDtype::F32, KvCacheDtype::Bf16] {
        let m = load(dtype);
        for next_n in [0, 2] {
            for params in [SamplingParams::greedy(), sampled.clone()] {
                let what = format!("{dtype:?}, next_n {next_n}, {params:?}");
                let mut one = engine(&m, PREFILL, next_n);
                for p in &prompts {
                    one.add_request(request(p, &params, n_new)).unwrap();
                }
                let want = finish(one);

                let mut pre = engine(&m, PREFILL, next_n);
                for p in &prompts {
                    pre.add_request_for_transfer(request(p, &params, 1))
                        .unwrap();
                }
                let firsts = finish(pre);
                // Under sampling with MTP, a request drafts fewer tokens when the pool is short
                // of slots, and so draws from its random stream in another order (the same law,
                // other tokens): the sampled runs get a pool that always has the slots.
                let cfg = if params.is_greedy() {
                    DECODE
                } else {
                    EngineConfig {
                        num_blocks: 64,
                        ..DECODE
                    }
                };
                let mut dec = engine(&m, cfg, next_n);
                for (p, out) in prompts.iter().zip(&firsts) {
                    let kv = out.kv.as_ref().expect("a snapshot");
                    assert_eq!(kv.prompt, *p);
                    assert_eq!(kv.mtp.is_some(), next_n > 0, "{what}");
                    // Time spent fetching the KV before the engine counts in the figures.
                    let mut r = request(p, &params, n_new);
                    r.waited_s = 3.0;
                    dec.add_prefilled(r, through_wire(kv)).unwrap();
                }
                // Not every request fits the decode pool at once: some wait.
                assert!(dec.scheduler().num_running() < prompts.len(), "{what}");
                let got = finish(dec);
                assert_eq!(got.len(), want.len());
                for (a, b) in want.iter().zip(&got) {
                    assert_eq!(a.tokens, b.tokens, "{what}: prompt of {}", a.prompt.len());
                    assert_eq!(b.tokens[0], firsts[b.id as usize].tokens[0]);
                    let t = &b.timing;
                    assert!(
                        t.ttft_s >= 3.0 && t.e2e_s >= 3.0 && t.queue_s >= 3.0,
                        "{what}: {t:?}"
                    );
                }
                if next_n > 0 {
                    let drafted: usize = got.iter().map(|o| o.drafted).sum();
                    assert!(drafted > 0, "{what}: the decode side never drafted");
                }
            }
        }
    }
}

#[test]
fn mismatched_sides_are_refused_with_the_reason() {
    let m = load(KvCacheDtype::Bf16);
    let params = SamplingParams::greedy();
    let prompt = [5u32, 9, 11, 40, 2];
    let mut pre = engine(&m, PREFILL, 0);
    pre.add_request_for_transfer(request(&prompt, &params, 1))
        .unwrap();
    let kv = *finish(pre).remove(0).kv.unwrap();

    // Another prompt.
    let mut dec = engine(&m, DECODE, 0);
    let e = dec
        .add_prefilled(request(&[5, 9, 11], &params, 4), kv.clone())
        .unwrap_err();
    assert!(
        e.to_string()
            .contains("a prompt of 5 tokens, this request's has 3"),
        "{e}"
    );
    // Another request's KV (other sampling): the room was reused.
    let mut other = request(&prompt, &params, 4);
    other.params.temperature = 0.5;
    let e = dec.add_prefilled(other, kv.clone()).unwrap_err();
    assert!(e.to_string().contains("bootstrap_room"), "{e}");
    // The differing field is named with both values.
    assert!(e.to_string().contains("temperature"), "{e}");
    assert!(e.to_string().contains("0.5 here"), "{e}");
    // A seed the prefill side drew for an unseeded request (a server over several ranks
    // does) is taken; another seed is another request's.
    let mut pre = engine(&m, PREFILL, 0);
    let mut seeded = request(&prompt, &params, 1);
    seeded.params.seed = Some(99);
    pre.add_request_for_transfer(seeded).unwrap();
    let drawn = *finish(pre).remove(0).kv.unwrap();
    dec.add_prefilled(request(&prompt, &params, 4), drawn.clone())
        .unwrap();
    let mut other = request(&prompt, &params, 4);
    other.params.seed = Some(98);
    let e = dec.add_prefilled(other, drawn).unwrap_err();
    assert!(e.to_string().contains("bootstrap_room"), "{e}");
    // Another cache dtype.
    let f32_model = load(KvCacheDtype::F32);
    let mut dec = engine(&f32_model, DECODE, 0);
    let e = dec
        .add_prefilled(request(&prompt, &params, 4), kv.clone())
        .unwrap_err();
    assert!(e.to_string().contains("--kv-cache-dtype"), "{e}");
    assert!(
        e.to_string().contains("values in bf16 there") && e.to_string().contains("f32 here"),
        "{e}"
    );
    // MTP here, not there.
    let mut dec = engine(&m, DECODE, 1);
    let e = dec
        .add_prefilled(request(&prompt, &params, 4), kv.clone())
        .unwrap_err();
    assert!(e.to_string().contains("--mtp"), "{e}");
    // MTP rows of another width (another model).
    let mut pre = engine(&m, PREFILL, 1);
    pre.add_request_for_transfer(request(&prompt, &params, 1))
        .unwrap();
    let mut wide = *finish(pre).remove(0).kv.unwrap();
    let mtp = wide.mtp.as_mut().unwrap();
    let width = mtp.hidden.len() / mtp.rows;
    mtp.hidden.truncate(mtp.rows * (width - 1));
    let mut dec = engine(&m, DECODE, 1);
    let e = dec
        .add_prefilled(request(&prompt, &params, 4), wide)
        .unwrap_err();
    assert!(e.to_string().contains("wide"), "{e}");
    assert!(!dec.has_unfinished());
    // A request that can never fit this pool.
    let mut dec = engine(&m, DECODE, 0);
    let e = dec
        .add_prefilled(request(&prompt, &params, 1000), kv.clone())
        .unwrap_err();
    assert!(e.to_string().contains("pool holds"), "{e}");
    assert!(!dec.has_unfinished());
    // A first token that ends the request finishes it at once, without blocks.
    let mut stop = request(&prompt, &params, 4);
    stop.ignore_eos = false;
    stop.stop.stop_token_ids = vec![kv.first_token];
    let id = dec.add_prefilled(stop, kv.clone()).unwrap();
    let done = dec.take_finished();
    assert_eq!(done.len(), 1);
    assert_eq!(done[0].id, id);
    assert_eq!(done[0].tokens, vec![kv.first_token]);
    assert_eq!(dec.scheduler().kv().pool().num_used(), 0);
    // An aborted import frees nothing it did not take and leaves nothing behind.
    let mut dec = engine(
        &m,
        EngineConfig {
            batch_size: 1,
            ..DECODE
        },
        0,
    );
    let a = dec
        .add_prefilled(request(&prompt, &params, 4), kv.clone())
        .unwrap();
    let b = dec
        .add_prefilled(request(&prompt, &params, 4), kv.clone())
        .unwrap();
    assert_eq!(dec.scheduler().num_running(), 1);
    dec.abort(b);
    dec.abort(a);
    assert!(!dec.has_unfinished());
    assert_eq!(dec.scheduler().kv().pool().num_used(), 0);
    // A cancelled request leaves no snapshot.
    let mut pre = engine(&m, PREFILL, 0);
    let id = pre
        .add_request_for_transfer(request(&prompt, &params, 1))
        .unwrap();
    pre.abort(id);
    assert!(pre.take_finished()[0].kv.is_none());
}

/// Log-probabilities: greedy tokens are their row's most likely; a prefill/decode split and MTP
/// give the ones one engine gives (within float noise: verification scores several tokens in
/// one forward).
#[test]
fn logprobs_survive_the_split_and_mtp() {
    let m = load(KvCacheDtype::Bf16);
    let params = SamplingParams::greedy();
    let prompts: Vec<Vec<u32>> = vec![vec![5, 9, 11, 40, 2, 300, 301], vec![77, 78, 79]];
    let with_lp = |p: &[u32], n: usize| {
        let mut r = request(p, &params, n);
        r.logprobs = Some(4);
        r
    };
    let mut one = engine(&m, PREFILL, 0);
    for p in &prompts {
        one.add_request(with_lp(p, 12)).unwrap();
    }
    let want = finish(one);
    for o in &want {
        assert_eq!(o.logprobs.len(), o.tokens.len());
        for (lp, &t) in o.logprobs.iter().zip(&o.tokens) {
            assert_eq!(lp.token, t);
            assert_eq!(lp.top.len(), 4);
            assert_eq!(lp.top[0].0, t, "greedy takes the most likely");
            assert_eq!(lp.top[0].1, lp.logprob);
            assert!(lp.top.windows(2).all(|w| w[0].1 >= w[1].1) && lp.logprob <= 0.0);
        }
    }
    let close = |a: &RequestOutput, b: &RequestOutput, what: &str| {
        assert_eq!(a.tokens, b.tokens, "{what}");
        for (x, y) in a.logprobs.iter().zip(&b.logprobs) {
            assert!((x.logprob - y.logprob).abs() < 2e-3, "{what}: {x:?} {y:?}");
        }
        assert_eq!(a.logprobs.len(), b.logprobs.len(), "{what}");
    };
    for next_n in [0, 1] {
        let mut pre = engine(&m, PREFILL, next_n);
        for p in &prompts {
            pre.add_request_for_transfer(with_lp(p, 1)).unwrap();
        }
        let firsts = finish(pre);
        let mut dec = engine(&m, DECODE, next_n);
        for (p, out) in prompts.iter().zip(&firsts) {
            let kv = *out.kv.clone().unwrap();
            assert!(kv.first_logprob.is_some());
            dec.add_prefilled(with_lp(p, 12), kv).unwrap();
        }
        for (a, b) in want.iter().zip(&finish(dec)) {
            close(a, b, &format!("split, next_n {next_n}"));
        }
    }
    // Asking the decode side for logprobs the prefill side did not record is refused.
    let mut pre = engine(&m, PREFILL, 0);
    pre.add_request_for_transfer(request(&prompts[0], &params, 1))
        .unwrap();
    let kv = *finish(pre).remove(0).kv.unwrap();
    let mut dec = engine(&m, DECODE, 0);
    let e = dec.add_prefilled(with_lp(&prompts[0], 4), kv).unwrap_err();
    assert!(e.to_string().contains("logprobs"), "{e}");
    assert!(!dec.has_unfinished());

    // The prompt's log-probabilities (echo) are computed on the prefill side and travel with
    // the KV: the decode side's output carries them, bit for bit; a decode side that asks for
    // them from a prefill that did not record them is refused.
    let echo = |p: &[u32], n: usize| {
        let mut r = with_lp(p, n);
        r.prompt_logprobs = Some(2);
        r
    };
    let mut pre = engine(&m, PREFILL, 0);
    for p in &prompts {
        pre.add_request_for_transfer(echo(p, 1)).unwrap();
    }
    let firsts = finish(pre);
    let mut dec = engine(&m, DECODE, 0);
    for (p, out) in prompts.iter().zip(&firsts) {
        let kv = *out.kv.clone().unwrap();
        assert_eq!(kv.prompt_logprobs.len() + 1, p.len());
        assert_eq!(kv.prompt_logprobs, out.prompt_logprobs);
        dec.add_prefilled(echo(p, 12), kv).unwrap();
    }
    for ((a, b), first) in want.iter().zip(&finish(dec)).zip(&firsts) {
        close(a, b, "split with echo");
        assert_eq!(b.prompt_logprobs, first.prompt_logprobs);
        assert_eq!(b.prompt_logprobs.len() + 1, b.prompt.len());
    }
    let mut pre = engine(&m, PREFILL, 0);
    pre.add_request_for_transfer(with_lp(&prompts[0], 1))
        .unwrap();
    let kv = *finish(pre).remove(0).kv.unwrap();
    let mut dec = engine(&m, DECODE, 0);
    let e = dec.add_prefilled(echo(&prompts[0], 4), kv).unwrap_err();
    assert!(e.to_string().contains("echo"), "{e}");
    assert!(!dec.has_unfinished());
}

/// Prompt log-probabilities (completions' `echo`): each prompt token's given those before it,
/// the same with the prompt prefilled in chunks and with the request preempted and recomputed
/// as the library's token-by-token scoring (`eval::next_token_logprobs`).
#[test]
fn prompt_logprobs_match_one_forward() {
    let m = load(KvCacheDtype::F32);
    let dir = root().join("assets/cachalot-tiny-r1");
    let tok = Tokenizer::from_dir(&dir).unwrap();
    let text = std::fs::read_to_string(dir.join("eval.txt")).unwrap();
    let ids = tok.encode(&text).unwrap();
    let prompts: Vec<Vec<u32>> = (0..4)
        .map(|i| ids[i * 200..i * 200 + 90].to_vec())
        .collect();
    let want: Vec<Vec<f32>> = prompts
        .iter()
        .map(|p| cachalot_model::eval::next_token_logprobs(&m, p, 0).unwrap())
        .collect();
    // Chunks of 32 with room for two requests at once, then a pool so tight that requests are
    // preempted and recomputed.
    for cfg in [
        PREFILL,
        EngineConfig {
            block_size: 8,
            num_blocks: 20,
            batch_size: 4,
            max_prefill_tokens: 32,
        },
    ] {
        let mut e = engine(&m, cfg, 0);
        for p in &prompts {
            let mut r = request(p, &SamplingParams::greedy(), 8);
            r.prompt_logprobs = Some(2);
            e.add_request(r).unwrap();
        }
        let outs = finish(e);
        for (o, w) in outs.iter().zip(&want) {
            assert_eq!(o.prompt_logprobs.len(), o.prompt.len() - 1);
            for (i, lp) in o.prompt_logprobs.iter().enumerate() {
                assert_eq!(lp.token, o.prompt[i + 1]);
                assert!(
                    (lp.logprob - w[i]).abs() < 1e-4,
                    "{cfg:?} token {i}: {lp:?} {}",
                    w[i]
                );
                assert_eq!(lp.top.len(), 2);
            }
        }
    }
}

/// JSON mode: greedy and sampled answers, with and without MTP drafts, are one JSON object
/// when they stop, and a JSON object's beginning when cut by the length limit.
#[test]
fn json_mode_answers_are_json_objects() {
    use cachalot_engine::generate::FinishReason;
    use cachalot_engine::json_mode::JsonState;
    let m = load(KvCacheDtype::Bf16);
    let dir = root().join("assets/cachalot-tiny-r1");
    let tok = Tokenizer::from_dir(&dir).unwrap();
    let eos = tok.eos_token_id().unwrap();
    let prompts = ["Give me a JSON object:", "The weather", "{"];
    let mut stopped = 0;
    for next_n in [0, 2] {
        for temperature in [0.0, 1.0] {
            let mut e = Engine::new(&m, Some(&tok), PREFILL).unwrap();
            if next_n > 0 {
                e.enable_mtp(next_n).unwrap();
            }
            for (i, p) in prompts.iter().enumerate() {
                let mut r = request(&tok.encode(p).unwrap(), &SamplingParams::greedy(), 60);
                r.params.temperature = temperature;
                r.params.seed = Some(i as u64);
                r.ignore_eos = false;
                r.stop.stop_token_ids = vec![eos];
                r.json_object = true;
                e.add_request(r).unwrap();
            }
            for o in finish(e) {
                let what = format!("next_n {next_n}, t {temperature}: {:?}", o.text);
                match o.finish {
                    FinishReason::StopToken(_) => {
                        stopped += 1;
                        let v: serde_json::Value = serde_json::from_str(&o.text).expect(&what);
                        assert!(v.is_object(), "{what}");
                    }
                    _ => {
                        let mut s = JsonState::new();
                        assert!(s.feed_all(o.text.as_bytes()), "{what}");
                    }
                }
            }
        }
    }
    eprintln!("{stopped} of 12 answers closed their object and stopped");
    // Gated (a reasoning model's `</think>`): free text up to the gate, JSON after it.
    let prompt = tok.encode("The weather").unwrap();
    let mut e = Engine::new(&m, Some(&tok), PREFILL).unwrap();
    e.add_request(request(&prompt, &SamplingParams::greedy(), 1))
        .unwrap();
    let gate = finish(e).remove(0).text;
    assert!(!gate.is_empty());
    let mut e = Engine::new(&m, Some(&tok), PREFILL).unwrap();
    let mut r = request(&prompt, &SamplingParams::greedy(), 30);
    r.json_object = true;
    r.json_after = Some(gate.clone());
    e.add_request(r).unwrap();
    let text = finish(e).remove(0).text;
    let rest = text
        .strip_prefix(gate.as_str())
        .expect("the free part first");
    let mut s = JsonState::new();
    assert!(s.feed_all(rest.as_bytes()), "{text:?}");
    assert!(rest.trim_start().starts_with('{'), "{text:?}");
    // A decode side in JSON mode refuses a first token the prefill side did not mask.
    let prompt = tok.encode("The weather").unwrap();
    let mut pre = Engine::new(&m, Some(&tok), PREFILL).unwrap();
    pre.add_request_for_transfer(request(&prompt, &SamplingParams::greedy(), 1))
        .unwrap();
    let kv = *finish(pre).remove(0).kv.unwrap();
    let mut dec = Engine::new(&m, Some(&tok), DECODE).unwrap();
    let mut r = request(&prompt, &SamplingParams::greedy(), 8);
    r.json_object = true;
    let e = dec.add_prefilled(r.clone(), kv).unwrap_err();
    assert!(e.to_string().contains("JSON"), "{e}");
    // With JSON mode on both sides the split gives one engine's answer.
    let mut pre = Engine::new(&m, Some(&tok), PREFILL).unwrap();
    let mut first = r.clone();
    first.stop.max_new_tokens = 1;
    pre.add_request_for_transfer(first).unwrap();
    let kv = *finish(pre).remove(0).kv.unwrap();
    let mut dec = Engine::new(&m, Some(&tok), DECODE).unwrap();
    dec.add_prefilled(r.clone(), kv).unwrap();
    let split = finish(dec).remove(0).tokens;
    let mut one = Engine::new(&m, Some(&tok), PREFILL).unwrap();
    one.add_request(r).unwrap();
    assert_eq!(finish(one).remove(0).tokens, split);
    // Without a tokenizer the engine cannot mask tokens: refused.
    let mut e = Engine::new(&m, None, PREFILL).unwrap();
    let mut r = request(&[5, 6, 7], &SamplingParams::greedy(), 4);
    r.json_object = true;
    assert!(e
        .add_request(r)
        .unwrap_err()
        .to_string()
        .contains("tokenizer"));
}

/// DeepSeek-V4's compact cache (`V4CacheMode::Compact`): a snapshot carries each layer's rows
/// and then the request's state slot (its window and compressor-input rings), and the decode
/// engine writes that slot into one of its own (slots handed on as requests finish), so the
/// tokens are one engine's; prompts past the ring sizes (144 window positions), with MTP; f32
/// and bf16 caches (a bf16 state slot travels as bf16).
#[test]
fn v4_compact_cache_prefill_here_decode_there_equals_one_engine() {
    use cachalot_model::KvCacheDtype;
    for (fixture, dtype) in [
        ("flash_tiny", KvCacheDtype::F32),
        ("pro_tiny", KvCacheDtype::F32),
        ("flash_tiny", KvCacheDtype::Bf16),
        ("pro_tiny", KvCacheDtype::Fp8),
    ] {
        let mut m = cachalot_model::DeepseekV4::load(
            &root().join("fixtures/v4").join(fixture),
            cachalot_model::V4LoadOptions {
                load_mtp: true,
                ..Default::default()
            },
        )
        .unwrap();
        m.set_kv_cache_dtype(dtype);
        assert_eq!(m.cache_mode(), cachalot_model::V4CacheMode::Compact);
        let vocab = m.config().vocab_size as u32;
        let prompts: Vec<Vec<u32>> = [150usize, 7, 131, 40, 200]
            .iter()
            .enumerate()
            .map(|(i, &n)| {
                (0..n as u32)
                    .map(|t| (t * 31 + i as u32 * 7 + 3) % vocab)
                    .collect()
            })
            .collect();
        let n_new = 12;
        let params = SamplingParams::greedy();
        for next_n in [0, 2] {
            let what = format!("{fixture}, {}, next_n {next_n}", dtype.name());
            let new = |cfg: EngineConfig| {
                let mut e = Engine::new(&m, None, cfg).unwrap();
                if next_n > 0 {
                    e.enable_mtp(next_n).unwrap();
                }
                e
            };
            let done = |mut e: Engine<'_, &cachalot_model::DeepseekV4>| {
                let mut outs = e.run_to_completion(|_, _| {}).unwrap();
                assert_eq!(e.scheduler().kv().pool().num_used(), 0, "blocks leaked");
                outs.sort_by_key(|o| o.id);
                outs
            };
            let cfg = EngineConfig {
                num_blocks: 128,
                ..PREFILL
            };
            let mut one = new(cfg);
            for p in &prompts {
                one.add_request(request(p, &params, n_new)).unwrap();
            }
            let want = done(one);
            let mut pre = new(cfg);
            for p in &prompts {
                pre.add_request_for_transfer(request(p, &params, 1))
                    .unwrap();
            }
            let firsts = done(pre);
            let mut dec = new(EngineConfig {
                block_size: 8,
                num_blocks: 96,
                batch_size: 2,
                max_prefill_tokens: 64,
            });
            for (p, out) in prompts.iter().zip(&firsts) {
                let kv = out.kv.as_ref().expect("a snapshot");
                assert!(kv.spec.seq_state_width > 0, "{what}");
                dec.add_prefilled(request(p, &params, n_new), through_wire(kv))
                    .unwrap();
            }
            assert!(dec.scheduler().num_running() < prompts.len(), "{what}");
            let got = done(dec);
            for (a, b) in want.iter().zip(&got) {
                assert_eq!(a.tokens, b.tokens, "{what}: prompt of {}", a.prompt.len());
            }
        }
    }
}
