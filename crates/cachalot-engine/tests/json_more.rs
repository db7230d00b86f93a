//! JSON mode after a lead with more allowed after each object (`Request::json_more`: a forced
//! "required" tool call's answer may hold several calls): a stand-in model that wants to write
//! a given answer writes it where the grammar allows it, ends where the section's end is
//! written or a stop token comes after an object, and is held to the texts and the JSON
//! elsewhere. The shipped model's tokenizer gives the token bytes (its R1 markup tokens).

use std::path::PathBuf;

use cachalot_engine::generate::FinishReason;
use cachalot_engine::{
    Engine, EngineConfig, EngineError, JsonLead, Model, Request, SamplingParams, StopConditions,
};
use cachalot_model::batch::{Batch, CacheSpec, KvCache};
use cachalot_model::tokenizer::Tokenizer;

/// A model whose next token after position p is `wants[p + 1]` (a strong preference; every
/// other token equal), whatever it has seen.
struct Scripted {
    wants: Vec<u32>,
    vocab: usize,
}

impl Model for Scripted {
    fn forward(&self, batch: &Batch, _cache: &mut KvCache) -> Result<Vec<f32>, EngineError> {
        let mut out = vec![0.0f32; batch.logits_indices.len() * self.vocab];
        for (r, &i) in batch.logits_indices.iter().enumerate() {
            if let Some(&t) = self.wants.get(batch.positions[i] + 1) {
                out[r * self.vocab + t as usize] = 10.0;
            }
        }
        Ok(out)
    }
    fn cache_spec(&self) -> CacheSpec {
        CacheSpec {
            layers: 1,
            width: 1,
            int8_width: 0,
            float: cachalot_model::KvCacheDtype::F32,
            seq_state_width: 0,
        }
    }
    fn vocab_size(&self) -> usize {
        self.vocab
    }
}

const END: &str = "\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>";

fn lead(name: &str, between: bool) -> JsonLead {
    let text = if between {
        format!("\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\n```json\n")
    } else {
        format!("{name}\n```json\n")
    };
    JsonLead {
        text,
        schema: None,
        then_json: true,
        ends: false,
    }
}

/// The answer the engine lets a model that wants `answer` write (the prompt's one token
/// before it), and why it ended.
fn run(tok: &Tokenizer, answer: &str, more: bool) -> (String, FinishReason) {
    run_ids(tok, tok.encode(answer).unwrap(), more)
}

/// [`run`] of a model that wants the tokens `answer`.
fn run_ids(tok: &Tokenizer, answer: Vec<u32>, more: bool) -> (String, FinishReason) {
    let eos = tok.eos_token_id().unwrap();
    let mut wants = vec![0u32];
    wants.extend(answer);
    let model = Scripted {
        wants,
        vocab: tok.vocab_size(),
    };
    let mut next: Vec<JsonLead> = ["get_weather", "get_time"]
        .iter()
        .map(|n| lead(n, true))
        .collect();
    next.push(JsonLead {
        text: END.into(),
        schema: None,
        then_json: false,
        ends: true,
    });
    let req = Request {
        prompt: vec![0],
        params: SamplingParams::greedy(),
        stop: StopConditions {
            max_new_tokens: 120,
            stop_token_ids: vec![eos],
            ..Default::default()
        },
        ignore_eos: false,
        logprobs: None,
        prompt_logprobs: None,
        json_object: true,
        json_after: None,
        json_lead: vec![lead("get_weather", false), lead("get_time", false)],
        json_more: if more { vec![next] } else { Vec::new() },
        json_schema: None,
        dsml: false,
        special_text: Default::default(),
        waited_s: 0.0,
    };
    let cfg = EngineConfig {
        block_size: 16,
        num_blocks: 32,
        batch_size: 1,
        max_prefill_tokens: 64,
    };
    let mut engine = Engine::new(&model, Some(tok), cfg).unwrap();
    engine.add_request(req).unwrap();
    let out = engine.run_to_completion(|_, _| {}).unwrap().remove(0);
    (out.text, out.finish)
}

#[test]
fn several_calls_after_a_lead() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../assets/cachalot-tiny-r1");
    let tok = Tokenizer::from_dir(&dir).unwrap();
    let eos = tok.eos_token_id().unwrap();
    let first = "get_weather\n```json\n{\"city\": \"Paris\"}";
    let second = format!("{}{{\"utc\": true}}", lead("get_time", true).text);
    // Two calls, then the section's end: written whole, and the answer ends there.
    let two = format!("{first}{second}{END}");
    let (text, finish) = run(&tok, &format!("{two}<｜end▁of▁sentence｜>"), true);
    assert_eq!(text, two);
    assert_eq!(finish, FinishReason::StopString(String::new()));
    // A stop token right after an object ends the answer there.
    let (text, finish) = run(&tok, &format!("{first}<｜end▁of▁sentence｜>"), true);
    assert_eq!(text, first);
    assert_eq!(finish, FinishReason::StopToken(eos));
    // Without more: only a stop token may follow the object (what the model wants next is
    // held back; the best allowed token is the stop).
    let (text, finish) = run(&tok, &two, false);
    assert_eq!(text, first);
    assert_eq!(finish, FinishReason::StopToken(eos));
    // Text after the object that begins neither another call nor the end is not written:
    // the answer keeps to the texts (all else equal, greedy takes the lowest id allowed: the
    // stop token).
    let (text, finish) = run(&tok, &format!("{first} and more"), true);
    assert_eq!(text, first);
    assert_eq!(finish, FinishReason::StopToken(eos));
}

/// A model that wants a string holding bytes that are no UTF-8 (a lone continuation byte, a
/// character cut by the closing quote) does not get them: JSON text is UTF-8 (RFC 8259 §8.1).
#[test]
fn strings_hold_only_whole_utf8_characters() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../assets/cachalot-tiny-r1");
    let tok = Tokenizer::from_dir(&dir).unwrap();
    let byte = |b: u8| {
        (0..tok.vocab_size() as u32)
            .find(|&t| tok.token_bytes(t) == [b])
            .unwrap_or_else(|| panic!("no token of the byte {b:#x}"))
    };
    let lead = "get_weather\n```json\n{\"city\": \"";
    for tail in [vec![0x8b, b'"', b'}'], vec![0xe4, 0xb8, b'"', b'}']] {
        let mut ids = tok.encode(lead).unwrap();
        ids.extend(tail.iter().map(|&b| byte(b)));
        let (text, _) = run_ids(&tok, ids, false);
        assert!(!text.contains('\u{fffd}'), "{tail:x?}: {text:?}");
        assert!(text.starts_with(lead), "{text:?}");
    }
}
