//! The engine core: requests come in through [`Engine::add_request`], each [`Engine::step`]
//! schedules work, packs it into one [`Batch`], runs the model once, samples a token for every
//! request whose step ended its known tokens, applies stop rules, and finished requests come out
//! of [`Engine::take_finished`]. The offline `run` feeds a dataset through it; the online
//! server will feed HTTP requests through the same calls.

use std::collections::HashMap;
use std::time::Instant;

use cachalot_model::batch::{Batch, CacheSpec, KvCache, LogitsWanted};
use cachalot_model::tokenizer::Tokenizer;
use cachalot_model::{DeepseekV3, DeepseekV4};

use crate::generate::{FinishReason, StopConditions, TextStream};
use crate::kv_pool::KvBlockManager;
use crate::metrics::{EngineStats, RequestTiming};
use crate::sampler::{Sampler, SamplingParams};
use crate::scheduler::{AdmissionError, Scheduler, SchedulerConfig};
use crate::EngineError;

/// What the engine needs of a model family: forward a packed batch through a paged cache and
/// return the logits of `batch.logits_indices`, row after row.
pub trait Model {
    fn forward(&self, batch: &Batch, cache: &mut KvCache) -> Result<Vec<f32>, EngineError>;
    fn cache_spec(&self) -> CacheSpec;
    fn vocab_size(&self) -> usize;
}

impl Model for DeepseekV3 {
    fn forward(&self, batch: &Batch, cache: &mut KvCache) -> Result<Vec<f32>, EngineError> {
        Ok(DeepseekV3::forward(self, batch, cache, false)?.logits)
    }
    fn cache_spec(&self) -> CacheSpec {
        DeepseekV3::cache_spec(self)
    }
    fn vocab_size(&self) -> usize {
        self.config().vocab_size
    }
}

impl Model for DeepseekV4 {
    fn forward(&self, batch: &Batch, cache: &mut KvCache) -> Result<Vec<f32>, EngineError> {
        Ok(DeepseekV4::forward(self, batch, cache, false)?.logits)
    }
    fn cache_spec(&self) -> CacheSpec {
        DeepseekV4::cache_spec(self)
    }
    fn vocab_size(&self) -> usize {
        self.config().vocab_size
    }
}

impl<T: Model + ?Sized> Model for &T {
    fn forward(&self, batch: &Batch, cache: &mut KvCache) -> Result<Vec<f32>, EngineError> {
        (**self).forward(batch, cache)
    }
    fn cache_spec(&self) -> CacheSpec {
        (**self).cache_spec()
    }
    fn vocab_size(&self) -> usize {
        (**self).vocab_size()
    }
}

/// Bytes one cache block takes over all of a model's cache layers (int8 c_kv under C8).
pub fn kv_bytes_per_block(spec: CacheSpec, block_size: usize) -> u64 {
    (spec.bytes_per_token() * block_size) as u64
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EngineConfig {
    pub block_size: usize,
    /// Blocks in the pool, the null block included.
    pub num_blocks: usize,
    pub batch_size: usize,
    pub max_prefill_tokens: usize,
}

#[derive(Clone, Debug)]
pub struct Request {
    pub prompt: Vec<u32>,
    pub params: SamplingParams,
    pub stop: StopConditions,
    /// The seed system's fixed-length benchmark mode: generate exactly `max_new_tokens`,
    /// whatever EOS says; the text (and `valid_tokens`) end at the first stop token.
    pub ignore_eos: bool,
}

#[derive(Clone, Debug)]
pub struct RequestOutput {
    pub id: u64,
    pub prompt: Vec<u32>,
    /// Every generated token (the stop token included when one ended the answer).
    pub tokens: Vec<u32>,
    /// Generated tokens up to and including the first stop token (all of them when none).
    pub valid_tokens: usize,
    /// The answer's text (before any stop string; empty without a tokenizer).
    pub text: String,
    pub finish: FinishReason,
    pub timing: RequestTiming,
}

/// What one step did.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StepReport {
    pub seqs: usize,
    pub prefill_tokens: usize,
    pub decode_tokens: usize,
    pub sampled: usize,
    pub preempted: usize,
    pub finished: usize,
    pub forward_s: f64,
    pub kv_used_blocks: usize,
}

struct Live<'t> {
    tokens: Vec<u32>,
    prompt_len: usize,
    sampler: Sampler,
    stop: StopConditions,
    ignore_eos: bool,
    /// Output length at the first stop token (fixed-length mode keeps going past it).
    eos_at: Option<usize>,
    stream: Option<TextStream<'t>>,
    text: String,
    arrival: Instant,
    first_scheduled: Option<Instant>,
    first_token: Option<Instant>,
    last_token: Option<Instant>,
}

pub struct Engine<'t, M: Model> {
    model: M,
    tokenizer: Option<&'t Tokenizer>,
    cache: KvCache,
    scheduler: Scheduler,
    live: HashMap<u64, Live<'t>>,
    finished: Vec<RequestOutput>,
    next_id: u64,
    stats: EngineStats,
}

impl<'t, M: Model> Engine<'t, M> {
    /// An engine over `model`; with a tokenizer, stop strings are checked and text is kept.
    pub fn new(
        model: M,
        tokenizer: Option<&'t Tokenizer>,
        cfg: EngineConfig,
    ) -> Result<Self, EngineError> {
        if cfg.block_size == 0 || cfg.batch_size == 0 || cfg.max_prefill_tokens == 0 {
            return Err(EngineError::Request(format!(
                "block_size, batch_size and max_prefill_tokens must be positive: {cfg:?}"
            )));
        }
        if cfg.num_blocks < 2 {
            return Err(EngineError::Request(format!(
                "the KV pool needs at least 2 blocks (the null block and one more), got {}",
                cfg.num_blocks
            )));
        }
        let cache = KvCache::new(model.cache_spec(), cfg.block_size, cfg.num_blocks);
        let scheduler = Scheduler::new(
            SchedulerConfig {
                batch_size: cfg.batch_size,
                max_prefill_tokens: cfg.max_prefill_tokens,
            },
            KvBlockManager::new(cfg.num_blocks, cfg.block_size),
        );
        let stats = EngineStats {
            kv_capacity_blocks: cfg.num_blocks - 1,
            kv_block_size: cfg.block_size,
            ..Default::default()
        };
        Ok(Engine {
            model,
            tokenizer,
            cache,
            scheduler,
            live: HashMap::new(),
            finished: Vec::new(),
            next_id: 0,
            stats,
        })
    }

    pub fn model(&self) -> &M {
        &self.model
    }
    pub fn stats(&self) -> &EngineStats {
        &self.stats
    }
    pub fn scheduler(&self) -> &Scheduler {
        &self.scheduler
    }
    pub fn cache_bytes(&self) -> usize {
        self.cache.bytes()
    }
    pub fn has_unfinished(&self) -> bool {
        self.scheduler.has_unfinished()
    }

    /// Queues a request; its id comes back with its output.
    pub fn add_request(&mut self, req: Request) -> Result<u64, EngineError> {
        let vocab = self.model.vocab_size();
        if let Some(&t) = req.prompt.iter().find(|&&t| t as usize >= vocab) {
            return Err(EngineError::Request(format!(
                "prompt token {t} is outside the vocabulary of {vocab}"
            )));
        }
        if req.stop.max_new_tokens == 0 {
            return Err(EngineError::Request(
                "max_new_tokens must be at least 1".into(),
            ));
        }
        let sampler = Sampler::new(req.params, &req.prompt)?;
        let id = self.next_id;
        self.scheduler
            .add(
                id,
                req.prompt.len(),
                req.prompt.len() + req.stop.max_new_tokens,
            )
            .map_err(|e: AdmissionError| EngineError::Request(e.to_string()))?;
        self.next_id += 1;
        let stream = self
            .tokenizer
            .map(|t| TextStream::new(t, &req.stop.stop_strings));
        self.live.insert(
            id,
            Live {
                prompt_len: req.prompt.len(),
                tokens: req.prompt,
                sampler,
                stop: req.stop,
                ignore_eos: req.ignore_eos,
                eos_at: None,
                stream,
                text: String::new(),
                arrival: Instant::now(),
                first_scheduled: None,
                first_token: None,
                last_token: None,
            },
        );
        Ok(id)
    }

    /// Stops a request now; its output (finish reason `Cancelled`) comes out of
    /// [`Engine::take_finished`]. Unknown or finished ids are ignored.
    pub fn abort(&mut self, id: u64) {
        if self.live.contains_key(&id) {
            self.retire(id, FinishReason::Cancelled);
        }
    }

    /// Requests finished since the last call, in the order they finished.
    pub fn take_finished(&mut self) -> Vec<RequestOutput> {
        std::mem::take(&mut self.finished)
    }

    /// Runs one step. A step with nothing to do (no request) returns an empty report.
    pub fn step(&mut self) -> Result<StepReport, EngineError> {
        let plan = self.scheduler.schedule();
        let mut report = StepReport {
            preempted: plan.preempted.len(),
            ..Default::default()
        };
        self.stats.preemptions += plan.preempted.len();
        if plan.is_empty() {
            debug_assert!(!self.scheduler.has_unfinished(), "the scheduler stalled");
            return Ok(report);
        }
        let now = Instant::now();
        let mut batch = Batch::default();
        for it in &plan.items {
            let live = self
                .live
                .get_mut(&it.id)
                .expect("scheduled requests are live");
            live.first_scheduled.get_or_insert(now);
            let want = if it.sample {
                LogitsWanted::Last
            } else {
                LogitsWanted::None
            };
            batch.push_seq(
                &live.tokens[it.start..it.start + it.len],
                it.start,
                self.scheduler.block_table(it.id).to_vec(),
                want,
            );
            if it.decode {
                report.decode_tokens += it.len;
            } else {
                report.prefill_tokens += it.len;
            }
        }
        report.seqs = plan.items.len();
        let t0 = Instant::now();
        let logits = self.model.forward(&batch, &mut self.cache)?;
        report.forward_s = t0.elapsed().as_secs_f64();
        let vocab = self.model.vocab_size();
        let sampled_at = Instant::now();
        let mut rows = logits.chunks_exact(vocab);
        for it in plan.items.iter().filter(|it| it.sample) {
            let row = rows.next().ok_or_else(|| {
                EngineError::Request("the model returned fewer logits rows than asked".into())
            })?;
            report.sampled += 1;
            if let Some(reason) = self.push_token(it.id, row, sampled_at)? {
                self.retire(it.id, reason);
                report.finished += 1;
            } else {
                self.scheduler.append_token(it.id);
            }
        }
        report.kv_used_blocks = self.scheduler.kv().pool().num_used();
        let s = &mut self.stats;
        s.steps += 1;
        s.prefill_tokens += report.prefill_tokens;
        s.decode_tokens += report.decode_tokens;
        s.sampled_tokens += report.sampled;
        s.forward_s += report.forward_s;
        if report.prefill_tokens > 0 {
            s.prefill_step_s += report.forward_s;
        } else {
            s.decode_step_s += report.forward_s;
            s.decode_steps += 1;
        }
        s.kv_peak_blocks = self.scheduler.kv().peak_used();
        Ok(report)
    }

    /// Samples and records one token; returns why the request ends, if it does.
    fn push_token(
        &mut self,
        id: u64,
        logits: &[f32],
        at: Instant,
    ) -> Result<Option<FinishReason>, EngineError> {
        let live = self.live.get_mut(&id).expect("live");
        let token = live.sampler.sample(logits);
        live.sampler.accept(token);
        live.tokens.push(token);
        live.first_token.get_or_insert(at);
        live.last_token = Some(at);
        let n_out = live.tokens.len() - live.prompt_len;
        let mut finish = None;
        if live.eos_at.is_none() && live.stop.stop_token_ids.contains(&token) {
            live.eos_at = Some(n_out);
            if !live.ignore_eos {
                finish = Some(FinishReason::StopToken(token));
            }
        } else if live.eos_at.is_none() {
            if let Some(stream) = live.stream.as_mut() {
                let (piece, hit) = stream.push(token)?;
                live.text.push_str(&piece);
                if let Some(hit) = hit {
                    live.eos_at = Some(n_out);
                    if !live.ignore_eos {
                        finish = Some(FinishReason::StopString(hit));
                    }
                }
            }
        }
        if finish.is_none() && n_out >= live.stop.max_new_tokens {
            finish = Some(FinishReason::Length);
        }
        Ok(finish)
    }

    /// Moves a request out of the scheduler (freeing its blocks) into the finished list.
    fn retire(&mut self, id: u64, finish: FinishReason) {
        let preemptions = self.scheduler.num_preemptions(id);
        self.scheduler.finish(id);
        let Some(mut live) = self.live.remove(&id) else {
            return;
        };
        if !matches!(finish, FinishReason::StopString(_)) && live.eos_at.is_none() {
            if let Some(stream) = live.stream.as_mut() {
                if let Ok((piece, _)) = stream.finish() {
                    live.text.push_str(&piece);
                }
            }
        }
        let end = Instant::now();
        let since = |t: Option<Instant>| t.map_or(0.0, |t| (t - live.arrival).as_secs_f64());
        let output = live.tokens.split_off(live.prompt_len);
        let n_out = output.len();
        let tpot_s = match (live.first_token, live.last_token) {
            (Some(a), Some(b)) if n_out > 1 => Some((b - a).as_secs_f64() / (n_out - 1) as f64),
            _ => None,
        };
        let timing = RequestTiming {
            prompt_tokens: live.prompt_len,
            output_tokens: n_out,
            queue_s: since(live.first_scheduled),
            ttft_s: since(live.first_token),
            tpot_s,
            e2e_s: (end - live.arrival).as_secs_f64(),
            preemptions,
        };
        self.finished.push(RequestOutput {
            id,
            prompt: live.tokens,
            valid_tokens: live.eos_at.unwrap_or(n_out),
            tokens: output,
            text: live.text,
            finish,
            timing,
        });
    }

    /// Steps until every queued request has finished; `on_step` sees each step's report.
    pub fn run_to_completion(
        &mut self,
        mut on_step: impl FnMut(&StepReport, &[RequestOutput]),
    ) -> Result<Vec<RequestOutput>, EngineError> {
        let mut all = Vec::new();
        while self.has_unfinished() {
            let r = self.step()?;
            let done = self.take_finished();
            on_step(&r, &done);
            all.extend(done);
        }
        all.extend(self.take_finished());
        Ok(all)
    }
}
