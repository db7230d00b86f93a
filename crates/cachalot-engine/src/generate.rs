//! One request, start to end: prefill the prompt, then sample one token per step until a stop
//! token, a stop string, `max_new_tokens` or cancellation, streaming complete UTF-8 text as it
//! comes. The step loop and scheduler that batch many requests will drive the same pieces
//! ([`Sampler`], [`TextStream`]) per sequence.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use cachalot_model::batch::{Batch, BlockAllocator, KvCache, LogitsWanted};
use cachalot_model::eval::BLOCK_SIZE;
use cachalot_model::tokenizer::{StreamDecoder, Tokenizer};
use cachalot_model::DeepseekV3;

use crate::engine::Model;
use crate::sampler::{Sampler, SamplingParams};
use crate::EngineError;

#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct StopConditions {
    pub max_new_tokens: usize,
    /// Tokens that end the answer (EOS and friends); they are kept in the ids, not in the text.
    pub stop_token_ids: Vec<u32>,
    /// Strings that end the answer; the text stops before them.
    pub stop_strings: Vec<String>,
    /// vLLM's `include_stop_str_in_output`: the stop string, or the stop token's text, that
    /// ended the answer is in its text (at its end).
    #[serde(default)]
    pub include_stop_str: bool,
}

impl StopConditions {
    /// The stop set of spec §7: `config.json`'s `eos_token_id` (one or a list), the
    /// tokenizer's EOS, and `generation_config.json`'s `eos_token_id` where the directory has one.
    pub fn model_eos(
        model: &DeepseekV3,
        tokenizer: Option<&Tokenizer>,
        model_dir: &std::path::Path,
    ) -> Vec<u32> {
        Self::eos_ids(&model.config().eos_token_ids, tokenizer, model_dir)
    }

    /// [`StopConditions::model_eos`] from the config's EOS ids (any model family).
    pub fn eos_ids(
        config_eos: &[u32],
        tokenizer: Option<&Tokenizer>,
        model_dir: &std::path::Path,
    ) -> Vec<u32> {
        let mut ids = config_eos.to_vec();
        if let Some(id) = tokenizer.and_then(|t| t.eos_token_id()) {
            ids.push(id);
        }
        let path = model_dir.join("generation_config.json");
        if let Ok(text) = std::fs::read_to_string(&path) {
            match serde_json::from_str::<serde_json::Value>(&text) {
                Ok(v) => {
                    let id = |x: &serde_json::Value| {
                        x.as_u64()
                            .filter(|&i| i <= u32::MAX as u64)
                            .map(|i| i as u32)
                    };
                    let (found, bad): (Vec<_>, Vec<_>) = match v.get("eos_token_id") {
                        None | Some(serde_json::Value::Null) => (vec![], vec![]),
                        Some(serde_json::Value::Array(a)) => {
                            a.iter().partition(|x| id(x).is_some())
                        }
                        Some(x) => std::slice::from_ref(x)
                            .iter()
                            .partition(|x| id(x).is_some()),
                    };
                    ids.extend(found.into_iter().filter_map(id));
                    // As a broken file: the model runs, the loss of a stop token said.
                    if !bad.is_empty() {
                        eprintln!(
                            "warning: {}: eos_token_id {} is not a token id; it is not used",
                            path.display(),
                            bad.iter()
                                .map(|x| x.to_string())
                                .collect::<Vec<_>>()
                                .join(", ")
                        );
                    }
                }
                // As transformers and vLLM, the model runs without it; said, so that a lost
                // stop token is not a surprise.
                Err(e) => eprintln!(
                    "warning: {} is not valid JSON ({e}); its eos_token_id is not used",
                    path.display()
                ),
            }
        }
        ids.sort_unstable();
        ids.dedup();
        ids
    }
}

#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub enum FinishReason {
    /// A stop token (EOS or a requested stop id) was generated.
    StopToken(u32),
    /// A stop string appeared in the text.
    StopString(String),
    /// `max_new_tokens` reached.
    Length,
    /// The caller's cancel flag was raised.
    Cancelled,
}

impl FinishReason {
    /// OpenAI's `finish_reason` word.
    pub fn as_str(&self) -> &'static str {
        match self {
            FinishReason::StopToken(_) | FinishReason::StopString(_) => "stop",
            FinishReason::Length => "length",
            FinishReason::Cancelled => "cancelled",
        }
    }
}

#[derive(Clone, Debug)]
pub struct Generation {
    /// Generated ids, the stop token included when one ended the answer.
    pub tokens: Vec<u32>,
    /// The streamed text, exactly the concatenation of what `on_text` received.
    pub text: String,
    pub finish: FinishReason,
    pub prefill_s: f64,
    pub decode_s: f64,
}

/// Which special tokens an answer's text shows (vLLM's `skip_special_tokens`).
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SpecialText {
    /// Leave out the text of the tokens [`Tokenizer::skipped_in_text`] names (as decoding
    /// with `skip_special_tokens=True`: the answer's text is the decode of its other ids).
    /// False (the default): every token's text, special tokens as their names.
    pub skip: bool,
    /// With `skip`: special tokens kept all the same (the markers a server's parsers read,
    /// such as `<think>` and `</think>`, which they then take out themselves).
    #[serde(default)]
    pub except: Vec<u32>,
}

impl SpecialText {
    /// Every token's text.
    pub fn keep() -> SpecialText {
        SpecialText::default()
    }

    /// Special tokens left out, those of `except` kept.
    pub fn skip_except(except: Vec<u32>) -> SpecialText {
        SpecialText { skip: true, except }
    }
}

/// Detokenizes a stream of tokens into complete UTF-8 text, holding back any tail that could
/// still become a stop string, and cutting the text before a stop string when one appears.
pub struct TextStream<'t> {
    tokenizer: &'t Tokenizer,
    special: SpecialText,
    decoder: StreamDecoder<'t>,
    stop_strings: Vec<String>,
    held: String,
    /// Stop strings end the text (false before `min_tokens`: a stop string there is text).
    armed: bool,
    /// Where in `held` the text searched for stop strings begins to count: a match must end
    /// past it (text from before arming is held back only as the start of a stop string that
    /// ends after it).
    fresh_from: usize,
}

impl<'t> TextStream<'t> {
    pub fn new(tokenizer: &'t Tokenizer, stop_strings: &[String], special: &SpecialText) -> Self {
        TextStream {
            tokenizer,
            special: special.clone(),
            decoder: tokenizer.stream_decoder(),
            stop_strings: stop_strings
                .iter()
                .filter(|s| !s.is_empty())
                .cloned()
                .collect(),
            held: String::new(),
            armed: true,
            fresh_from: 0,
        }
    }

    /// Whether stop strings end the text from the next token on (vLLM's `min_tokens`: while
    /// disarmed a stop string is text; once armed, a stop string counts if it ends in text
    /// pushed since, including one that began before: vLLM searches back a stop string's
    /// length less one from where the check starts).
    pub fn set_stop_armed(&mut self, armed: bool) {
        if armed && !self.armed {
            self.fresh_from = self.held.len();
        }
        self.armed = armed;
    }

    /// Adds a token; returns the text that can be shown now and, if a stop string appeared,
    /// which one (the text returned then ends right before it).
    pub fn push(&mut self, id: u32) -> cachalot_model::Result<(String, Option<String>)> {
        if self.special.skip
            && self.tokenizer.skipped_in_text(id)
            && !self.special.except.contains(&id)
        {
            // Not in the text at all: the decoder's window never sees it, as a decode of the
            // other ids.
            return Ok((String::new(), None));
        }
        let piece = self.decoder.push(id)?;
        Ok(self.release(&piece))
    }

    /// Everything still held back, at the end of the stream.
    pub fn finish(&mut self) -> cachalot_model::Result<(String, Option<String>)> {
        let piece = self.decoder.finish()?;
        let (mut out, stop) = self.release(&piece);
        if stop.is_none() {
            out.push_str(&std::mem::take(&mut self.held));
        }
        Ok((out, stop))
    }

    fn release(&mut self, piece: &str) -> (String, Option<String>) {
        self.held.push_str(piece);
        if self.stop_strings.is_empty() {
            return (std::mem::take(&mut self.held), None);
        }
        if self.armed {
            let fresh = self.fresh_from;
            let first = self
                .stop_strings
                .iter()
                .filter_map(|s| {
                    self.held
                        .match_indices(s.as_str())
                        .find(|(at, _)| at + s.len() > fresh)
                        .map(|(at, _)| (at, s))
                })
                .min_by_key(|(at, _)| *at);
            if let Some((at, s)) = first {
                let s = s.clone();
                let out = self.held[..at].to_string();
                self.held.clear();
                self.fresh_from = 0;
                return (out, Some(s));
            }
        }
        // Keep the longest tail that is a prefix of some stop string.
        let cut = self
            .held
            .char_indices()
            .map(|(i, _)| i)
            .find(|&i| {
                let tail = &self.held[i..];
                self.stop_strings.iter().any(|s| s.starts_with(tail))
            })
            .unwrap_or(self.held.len());
        let out = self.held[..cut].to_string();
        self.held.drain(..cut);
        self.fresh_from = self.fresh_from.saturating_sub(cut);
        (out, None)
    }
}

/// Generates a continuation of `prompt`. `on_text` receives each piece of complete text as it
/// is decoded (nothing when `tokenizer` is `None`: then stop strings are not checked either).
pub fn generate<M: Model + ?Sized>(
    model: &M,
    tokenizer: Option<&Tokenizer>,
    prompt: &[u32],
    params: SamplingParams,
    stop: &StopConditions,
    cancel: Option<&AtomicBool>,
    on_text: &mut dyn FnMut(&str),
) -> Result<Generation, EngineError> {
    if prompt.is_empty() {
        return Err(EngineError::Request("the prompt is empty".into()));
    }
    let vocab = model.vocab_size();
    let mut sampler = Sampler::new(params, prompt)?;
    let total = checked_total(prompt.len(), stop.max_new_tokens, 0)?;
    let blocks = total.div_ceil(BLOCK_SIZE).max(1);
    let mut cache = KvCache::new(model.cache_spec(), BLOCK_SIZE, blocks);
    let mut alloc = BlockAllocator::new(blocks);
    let mut table = Vec::new();
    let mut stream =
        tokenizer.map(|t| TextStream::new(t, &stop.stop_strings, &SpecialText::keep()));

    let mut tokens = Vec::with_capacity(stop.max_new_tokens.min(1 << 16));
    let mut text = String::new();
    let mut emit = |s: &str, text: &mut String| {
        if !s.is_empty() {
            on_text(s);
            text.push_str(s);
        }
    };
    let mut step_tokens = prompt.to_vec();
    let mut pos = 0;
    let (mut prefill_s, mut decode_s) = (0.0, 0.0);
    let mut finish = FinishReason::Length;
    while tokens.len() < stop.max_new_tokens {
        if cancel.is_some_and(|c| c.load(Ordering::Relaxed)) {
            finish = FinishReason::Cancelled;
            break;
        }
        let t0 = Instant::now();
        alloc.ensure(&mut table, pos + step_tokens.len(), BLOCK_SIZE)?;
        let mut batch = Batch::default();
        batch.push_seq(&step_tokens, pos, table.clone(), LogitsWanted::Last);
        if pos == 0 {
            batch.mark_prefill();
        } else {
            batch.mark_generated();
        }
        let out = Model::forward(model, &batch, &mut cache)?;
        let logits = &out[out.len() - vocab..];
        crate::engine::check_logits(logits, "the model")?;
        let next = sampler.sample(logits);
        let dt = t0.elapsed().as_secs_f64();
        if pos == 0 {
            prefill_s = dt;
        } else {
            decode_s += dt;
        }
        sampler.accept(next);
        pos += step_tokens.len();
        tokens.push(next);
        step_tokens = vec![next];
        if stop.stop_token_ids.contains(&next) {
            finish = FinishReason::StopToken(next);
            break;
        }
        if let Some(s) = stream.as_mut() {
            let (piece, hit) = s.push(next)?;
            emit(&piece, &mut text);
            if let Some(hit) = hit {
                finish = FinishReason::StopString(hit);
                break;
            }
        }
    }
    if !matches!(finish, FinishReason::StopString(_)) {
        if let Some(s) = stream.as_mut() {
            let (piece, _) = s.finish()?;
            emit(&piece, &mut text);
        }
    }
    Ok(Generation {
        tokens,
        text,
        finish,
        prefill_s,
        decode_s,
    })
}

/// [`generate`] with MTP speculative decoding (`next_n` drafts per step; spec `executor.md`
/// §2.8), run as one request through the [`Engine`](crate::Engine) (batch 1): the same tokens
/// under greedy, the same distribution under sampling. The model must have its MTP layer
/// loaded. `on_text` receives the text as it grows, a step (up to `next_n + 1` tokens) at a
/// time.
#[allow(clippy::too_many_arguments)]
pub fn generate_mtp<M: crate::Model>(
    model: M,
    tokenizer: Option<&Tokenizer>,
    prompt: &[u32],
    params: SamplingParams,
    stop: &StopConditions,
    next_n: usize,
    cancel: Option<&AtomicBool>,
    on_text: &mut dyn FnMut(&str),
) -> Result<Generation, EngineError> {
    if prompt.is_empty() {
        return Err(EngineError::Request("the prompt is empty".into()));
    }
    let total = checked_total(prompt.len(), stop.max_new_tokens, next_n + 1)?;
    let cfg = crate::EngineConfig {
        block_size: BLOCK_SIZE,
        num_blocks: total.div_ceil(BLOCK_SIZE) + 1,
        batch_size: 1,
        max_prefill_tokens: prompt.len(),
    };
    let mut engine = crate::Engine::new(model, tokenizer, cfg)?;
    engine.enable_mtp(next_n)?;
    let id = engine.add_request(crate::Request {
        prompt: prompt.to_vec(),
        params,
        stop: stop.clone(),
        ignore_eos: false,
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
    })?;
    let t0 = Instant::now();
    let mut prefill_s = None;
    let mut shown = 0;
    loop {
        if cancel.is_some_and(|c| c.load(Ordering::Relaxed)) {
            engine.abort(id);
        } else {
            engine.step()?;
        }
        let prefill = *prefill_s.get_or_insert_with(|| t0.elapsed().as_secs_f64());
        if let Some(text) = engine.text_so_far(id) {
            if text.len() > shown {
                on_text(&text[shown..]);
                shown = text.len();
            }
        }
        if let Some(out) = engine.take_finished().pop() {
            if out.text.len() > shown {
                on_text(&out.text[shown..]);
            }
            return Ok(Generation {
                tokens: out.tokens,
                text: out.text,
                finish: out.finish,
                prefill_s: prefill,
                decode_s: t0.elapsed().as_secs_f64() - prefill,
            });
        }
    }
}

/// Positions a generation may take: prompt + `max_new_tokens` (+ `extra`), named when it does
/// not fit `usize` or `MAX_SEQUENCE`.
fn checked_total(prompt: usize, max_new: usize, extra: usize) -> Result<usize, EngineError> {
    prompt
        .checked_add(max_new)
        .and_then(|t| t.checked_add(extra))
        .filter(|&t| t <= MAX_SEQUENCE)
        .ok_or_else(|| {
            EngineError::Request(format!(
                "max_new_tokens {max_new} is out of range: prompt + output must be at most \
                 {MAX_SEQUENCE} positions"
            ))
        })
}

/// The longest sequence `generate` sizes a KV cache for (2^24 positions: far beyond any
/// model's context, small enough that the cache size is computed without overflow).
pub const MAX_SEQUENCE: usize = 1 << 24;

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    fn r1_style() -> Tokenizer {
        let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/text/r1_style");
        Tokenizer::from_dir(&dir).unwrap()
    }

    fn run(tok: &Tokenizer, text: &str, stops: &[&str]) -> (String, Option<String>, Vec<String>) {
        let stops: Vec<String> = stops.iter().map(|s| s.to_string()).collect();
        let mut s = TextStream::new(tok, &stops, &SpecialText::keep());
        let mut out = String::new();
        let mut pieces = Vec::new();
        for id in tok.encode(text).unwrap() {
            let (p, hit) = s.push(id).unwrap();
            out.push_str(&p);
            pieces.push(p);
            if hit.is_some() {
                return (out, hit, pieces);
            }
        }
        let (p, hit) = s.finish().unwrap();
        out.push_str(&p);
        (out, hit, pieces)
    }

    /// With special tokens skipped, the streamed text is the decode of the other ids (what
    /// `decode(ids, skip_special_tokens=True)` gives), stop strings included; the exceptions
    /// stay. Random sequences of text and special ids.
    #[test]
    fn skipping_special_tokens_streams_the_decode_of_the_others() {
        use rand::{Rng, SeedableRng};
        let tok = r1_style();
        let specials: Vec<u32> = (0..tok.vocab_size() as u32)
            .filter(|&i| tok.skipped_in_text(i))
            .collect();
        assert!(specials.len() >= 3, "{specials:?}");
        let text = tok
            .encode("The whale 🐋 dives STOP deep — naïve café")
            .unwrap();
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
        for case in 0..200 {
            let mut ids = Vec::new();
            for &t in &text {
                while rng.random_bool(0.3) {
                    ids.push(specials[rng.random_range(0..specials.len())]);
                }
                ids.push(t);
            }
            let except: Vec<u32> = if case % 2 == 0 {
                vec![]
            } else {
                vec![specials[1]]
            };
            let kept: Vec<u32> = ids
                .iter()
                .copied()
                .filter(|i| !specials.contains(i) || except.contains(i))
                .collect();
            let stops = if case % 4 < 2 {
                vec![]
            } else {
                vec!["STOP".to_string()]
            };
            let mut s = TextStream::new(&tok, &stops, &SpecialText::skip_except(except));
            let mut out = String::new();
            let mut hit = None;
            for &id in &ids {
                let (p, h) = s.push(id).unwrap();
                out.push_str(&p);
                if h.is_some() {
                    hit = h;
                    break;
                }
            }
            if hit.is_none() {
                out.push_str(&s.finish().unwrap().0);
            }
            let whole = tok.decode(&kept).unwrap();
            let want = match stops.first().and_then(|stop| whole.find(stop.as_str())) {
                Some(at) => whole[..at].to_string(),
                None => whole,
            };
            assert_eq!(out, want, "case {case}: {ids:?}");
        }
    }

    #[test]
    fn stop_strings_cut_the_text_before_them() {
        let tok = r1_style();
        let (out, hit, _) = run(&tok, "The whale dives. STOP here", &["STOP"]);
        assert_eq!(out, "The whale dives. ");
        assert_eq!(hit.as_deref(), Some("STOP"));
        let (out, hit, _) = run(&tok, "no stop in this 🐋 text", &["STOP", "\n\n"]);
        assert_eq!(out, "no stop in this 🐋 text");
        assert_eq!(hit, None);
    }

    /// Disarmed (before `min_tokens`), a stop string is text; armed again, later text is
    /// searched.
    #[test]
    fn a_disarmed_stream_lets_stop_strings_through() {
        let tok = r1_style();
        let ids = tok.encode("STOP one STOP two").unwrap();
        let stops = vec!["STOP".to_string()];
        // Armed from the first token after "STOP one" (the first STOP wholly before it).
        let arm = (0..ids.len())
            .find(|&i| tok.decode(&ids[..i]).unwrap().len() >= "STOP one".len())
            .unwrap();
        let mut s = TextStream::new(&tok, &stops, &SpecialText::keep());
        s.set_stop_armed(false);
        let mut out = String::new();
        let mut hit = None;
        for (i, &id) in ids.iter().enumerate() {
            s.set_stop_armed(i >= arm);
            let (p, h) = s.push(id).unwrap();
            out.push_str(&p);
            if h.is_some() {
                hit = h;
                break;
            }
        }
        assert!(out.starts_with("STOP one "), "{out:?}");
        assert!(!out.contains("two"), "{out:?}");
        assert_eq!(hit.as_deref(), Some("STOP"));
    }

    /// A stop string that begins in text from before arming and ends after it counts (as in
    /// vLLM, which searches back a stop string's length less one); one wholly before does not,
    /// even when the same string occurs again later.
    #[test]
    fn a_stop_string_straddling_the_arming_point_counts() {
        let tok = r1_style();
        let stops = vec!["STOP".to_string(), "xyz".to_string()];
        // Push `text` one character at a time, armed from character `arm` on.
        let run = |text: &str, arm: usize| -> (String, Option<String>) {
            let ids: Vec<u32> = text
                .chars()
                .map(|c| {
                    let id = tok.encode(&c.to_string()).unwrap();
                    assert_eq!(id.len(), 1, "{c:?}");
                    id[0]
                })
                .collect();
            let mut s = TextStream::new(&tok, &stops, &SpecialText::keep());
            let mut out = String::new();
            for (i, &id) in ids.iter().enumerate() {
                s.set_stop_armed(i >= arm);
                let (p, h) = s.push(id).unwrap();
                out.push_str(&p);
                if h.is_some() {
                    return (out, h);
                }
            }
            let (p, h) = s.finish().unwrap();
            out.push_str(&p);
            (out, h)
        };
        // "ab STOP": armed at the P (index 6), inside the stop string: it counts.
        assert_eq!(run("ab STOP more", 6), ("ab ".into(), Some("STOP".into())));
        // Armed just after it: the stop string is text, and so is the rest.
        assert_eq!(run("ab STOP more", 7), ("ab STOP more".into(), None));
        // A second occurrence after arming counts; the first stays text.
        assert_eq!(
            run("STOP a STOP b", 5),
            ("STOP a ".into(), Some("STOP".into()))
        );
        // The earliest stop string that ends after arming wins.
        assert_eq!(run("q xyzSTOP", 4), ("q ".into(), Some("xyz".into())));
        assert_eq!(run("q xyzSTOP", 5), ("q xyz".into(), Some("STOP".into())));
        // Armed from the start: as before.
        assert_eq!(run("ab STOP", 0), ("ab ".into(), Some("STOP".into())));
    }

    #[test]
    fn a_possible_stop_prefix_is_held_back_then_released() {
        let tok = r1_style();
        let (out, hit, pieces) = run(&tok, "abc ST and more", &["STOP"]);
        assert_eq!(out, "abc ST and more");
        assert_eq!(hit, None);
        assert!(pieces.iter().all(|p| !p.ends_with(" S")), "{pieces:?}");
    }

    #[test]
    fn output_lengths_past_any_context_are_named() {
        assert_eq!(checked_total(10, 20, 2).unwrap(), 32);
        for max_new in [usize::MAX, usize::MAX - 5, MAX_SEQUENCE] {
            let e = checked_total(10, max_new, 2).unwrap_err().to_string();
            assert!(
                e.contains("max_new_tokens") && e.contains("out of range"),
                "{e}"
            );
        }
    }
}
