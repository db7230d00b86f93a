//! The engine core: requests come in through [`Engine::add_request`], each [`Engine::step`]
//! schedules work, packs it into one [`Batch`], runs the model once, samples a token for every
//! request whose step ended its known tokens, applies stop rules, and finished requests come out
//! of [`Engine::take_finished`]. The offline `run` feeds a dataset through it; the online
//! server will feed HTTP requests through the same calls.
//!
//! MTP speculative decoding ([`Engine::enable_mtp`]; spec `executor.md` §2.8,
//! `deepseek-v3-r1-kimi-k2.md` §3.8). Each step of a decoding request then verifies up to
//! `next_n` draft tokens:
//! 1. after scheduling, the MTP layer catches up, in one batched forward over all requests, on
//!    every position the main model ran in the previous step whose next token is now known
//!    (row at position i pairs token i+1 with the main hidden state at i, writing the MTP
//!    layer's own cache at i); each decoding request's last row gives draft 1;
//! 2. drafts 2..n chain the MTP layer on its own draft and hidden state (one batched forward per
//!    draft, only the requests that get that many);
//! 3. one main forward over the whole batch, every decoding request contributing
//!    `[last token, draft 1..k]` with logits for each, prefill chunks beside them;
//! 4. per request, drafts are verified in order ([`Sampler::verify`]: a draft is accepted when
//!    it is the token the main model's logits give at its position, greedy or drawn with that
//!    position's random number, as the seed does) and the first rejection ends them; the
//!    emitted tokens are the accepted drafts plus one token from the main model (correction or
//!    bonus), stop rules applied token by token — the tokens plain decoding gives;
//! 5. the scheduler counts the accepted drafts' KV as computed and takes back blocks held only
//!    for rejected ones ([`Scheduler::accept_drafts`]); their KV (main and MTP layers) beyond
//!    the computed length is never read before it is overwritten.
//!
//! A prompt's rows whose next token is a prompt token do not wait for step 1: the MTP layer runs
//! them in the step that computed them, after the main forward and before its sampling (as the
//! seed runs the MTP layer over a prompt in its prefill), so their time is the prompt's (TTFT),
//! not the first decoded token's; only the prompt's last row, whose next token is the one that
//! step samples, waits for the next step (where it gives draft 1).
//!
//! Requests in one batch accept different numbers of drafts; prefill (chunked), preemption and
//! plain decoding go on beside them unchanged. The [`Model`] trait stays family-agnostic: the
//! MTP methods have defaults meaning "no MTP layer".

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::time::Instant;

use cachalot_model::batch::{Batch, CacheSpec, KvCache, LogitsWanted};
use cachalot_model::tokenizer::Tokenizer;
use cachalot_model::{DeepseekV3, DeepseekV4, V4CacheMode};

use crate::dsml_args::{holds_marker, DsmlSpec, DsmlState};
use crate::generate::{FinishReason, SpecialText, StopConditions, TextStream};
use crate::json_mode::JsonState;
use crate::json_schema::{Schema, SchemaState};
use crate::kv_pool::KvBlockManager;
use crate::metrics::{EngineStats, RequestTiming};
use crate::sampler::{Sampler, SamplingParams};
use crate::scheduler::{AdmissionError, Scheduled, Scheduler, SchedulerConfig};
use crate::transfer::{KvSnapshot, MtpRows};
use crate::EngineError;

fn no_mtp() -> EngineError {
    EngineError::Request("this model has no MTP layer: it cannot run speculative decoding".into())
}

/// Logits of the wanted rows and the hidden state of every token of a forward.
pub struct HiddenForward {
    /// `[batch.logits_indices.len(), vocab_size]`.
    pub logits: Vec<f32>,
    /// `[batch.num_tokens(), width]`: what an MTP layer takes as `prev_hidden` (V3: the hidden
    /// state, width `hidden_size`; V4: the `hc_mult` residual streams, width `hc_mult·hidden_size`).
    pub hidden: Vec<f32>,
}

/// What the engine needs of a model family: forward a packed batch through a paged cache and
/// return the logits of `batch.logits_indices`, row after row. A family with MTP (draft)
/// layers also implements the three optional methods; the defaults say it has none.
pub trait Model {
    fn forward(&self, batch: &Batch, cache: &mut KvCache) -> Result<Vec<f32>, EngineError>;
    /// Everything the cache pool must hold, MTP layers' caches included.
    fn cache_spec(&self) -> CacheSpec;
    fn vocab_size(&self) -> usize;
    /// Positions the model was made for (`max_position_embeddings`): a request's prompt and
    /// output together stay within it, as vLLM's `max_model_len`.
    fn max_positions(&self) -> usize {
        usize::MAX
    }
    /// MTP layers loaded (0: no speculative decoding).
    fn num_mtp_layers(&self) -> usize {
        0
    }
    /// Floats per token of the hidden state an MTP layer takes ([`HiddenForward::hidden`]'s
    /// width; 0 without MTP layers).
    fn mtp_hidden_width(&self) -> usize {
        0
    }
    /// [`Model::forward`], also returning every token's hidden state for the MTP layer.
    fn forward_with_hidden(
        &self,
        _batch: &Batch,
        _cache: &mut KvCache,
    ) -> Result<HiddenForward, EngineError> {
        Err(no_mtp())
    }
    /// One step of MTP layer `index`: row i takes `batch.tokens[i]` (the token after
    /// position `batch.positions[i]`) and row i of `prev_hidden` (the hidden state at that
    /// position, from [`Model::forward_with_hidden`] or a previous MTP step), writes the MTP
    /// layer's cache at that position and predicts the token two places after it.
    fn mtp_forward(
        &self,
        _index: usize,
        _batch: &Batch,
        _prev_hidden: &[f32],
        _cache: &mut KvCache,
    ) -> Result<HiddenForward, EngineError> {
        Err(no_mtp())
    }
    /// Called after every step by each rank of a group whose MoE layers dispatch tokens
    /// between ranks with their own batches (data-parallel attention, expert-parallel MoE),
    /// a rank without work too: serves the other ranks' tokens until every rank's step is
    /// over, and returns whether any rank has more work (`more`: this rank's). Callers step
    /// until it returns false. A model without such a group returns `more`.
    fn end_step(&self, more: bool) -> Result<bool, EngineError> {
        Ok(more)
    }
    /// A prompt's KV up to a block boundary, once computed, can serve any later request with
    /// the same first tokens (prefix caching): true where each position's main-model cache
    /// entry depends only on the tokens up to it (the MTP layer's rows also take the next token:
    /// the engine keys blocks with it). A family whose cache holds state that is not the tokens'
    /// own (a running state outside the cache), or whose positions' bits depend on how a prompt
    /// is cut, says false.
    fn supports_prefix_caching(&self) -> bool {
        false
    }
    /// Why [`Model::supports_prefix_caching`] is false (for the refusal of an explicit ask).
    fn why_no_prefix_caching(&self) -> String {
        "this model's cache cannot be shared between requests (prefix caching)".into()
    }
    /// A prompt's bits depend on where it is cut into chunks (a C8 cache: a chunk attends to
    /// its own rows un-quantized and to earlier chunks' as int8), so the scheduler cuts every
    /// prompt at the same places, whatever else runs ([`SchedulerConfig::fixed_chunks`]).
    fn prompt_bits_depend_on_chunks(&self) -> bool {
        false
    }
    /// A generated position's cache entries have the bits a prefill of the same tokens writes
    /// (no path that depends on whether a position is a prompt's), so prefix caching may share
    /// blocks of generated tokens too (a second turn that repeats the first exchange).
    fn generated_rows_are_prefill_rows(&self) -> bool {
        false
    }
    /// Whether the cache can be paged in blocks of `block_size` positions (an error saying
    /// what would fit otherwise).
    fn check_block_size(&self, _block_size: usize) -> Result<(), EngineError> {
        Ok(())
    }
    /// Tokens each routed expert took since load, per MoE layer (its key; MTP layers after
    /// the main ones), as this process routed them; empty for a model without routed experts.
    fn expert_load(&self) -> Vec<(u32, Vec<u64>)> {
        Vec::new()
    }
    /// Per MoE layer: the routed (token, expert) pairs this process computed for dispatched
    /// tokens (data-parallel attention with expert parallelism); empty otherwise.
    fn expert_served(&self) -> Vec<(u32, u64)> {
        Vec::new()
    }
}

impl Model for DeepseekV3 {
    fn forward(&self, batch: &Batch, cache: &mut KvCache) -> Result<Vec<f32>, EngineError> {
        Ok(DeepseekV3::forward(self, batch, cache, false)?.logits)
    }
    fn expert_load(&self) -> Vec<(u32, Vec<u64>)> {
        DeepseekV3::expert_load(self)
    }
    fn expert_served(&self) -> Vec<(u32, u64)> {
        DeepseekV3::expert_served(self)
    }
    fn cache_spec(&self) -> CacheSpec {
        DeepseekV3::cache_spec(self)
    }
    fn vocab_size(&self) -> usize {
        self.config().vocab_size
    }
    fn max_positions(&self) -> usize {
        self.config().max_position_embeddings
    }
    fn num_mtp_layers(&self) -> usize {
        self.mtp_layers().len()
    }
    fn mtp_hidden_width(&self) -> usize {
        self.config().hidden_size
    }
    fn forward_with_hidden(
        &self,
        batch: &Batch,
        cache: &mut KvCache,
    ) -> Result<HiddenForward, EngineError> {
        let out = DeepseekV3::forward(self, batch, cache, true)?;
        Ok(HiddenForward {
            logits: out.logits,
            hidden: out.hidden.expect("asked for hidden states"),
        })
    }
    fn mtp_forward(
        &self,
        index: usize,
        batch: &Batch,
        prev_hidden: &[f32],
        cache: &mut KvCache,
    ) -> Result<HiddenForward, EngineError> {
        let out = DeepseekV3::mtp_forward(self, index, batch, prev_hidden, cache, true)?;
        Ok(HiddenForward {
            logits: out.logits,
            hidden: out.hidden.expect("asked for hidden states"),
        })
    }
    fn end_step(&self, more: bool) -> Result<bool, EngineError> {
        Ok(DeepseekV3::end_step(self, more)?)
    }
    fn supports_prefix_caching(&self) -> bool {
        // C8: a prompt's naive attention reads its own rows un-quantized but cached rows as
        // int8, so a prompt cut after cached blocks would not get its whole prefill's bits.
        // force_eplb: a token's experts depend on its place in the step.
        self.cache_spec().int8_width == 0 && !self.forces_eplb()
    }
    fn prompt_bits_depend_on_chunks(&self) -> bool {
        // C8: the naive path attends to the step's own latents un-quantized (spec
        // `deepseek-v3-r1-kimi-k2.md` §3.4: the seed's prefill only stores int8).
        self.cache_spec().int8_width > 0
    }
    fn why_no_prefix_caching(&self) -> String {
        if self.forces_eplb() {
            FORCE_EPLB_NO_PREFIX.into()
        } else {
            "prefix caching does not run over a C8 (int8) latent cache: it is read quantized \
             where a prompt's own rows are not, so a prompt cut after shared blocks would not get \
             its own prefill's bits"
                .into()
        }
    }
}

/// Why prefix caching does not run under force_eplb (either family).
const FORCE_EPLB_NO_PREFIX: &str =
    "prefix caching does not run under force_eplb (a token's experts depend on its place in the \
     step)";

/// V4's hidden state per token is the last block's `hc_mult` residual streams (`[hc, D]`,
/// before the hc_head collapse), which is what its MTP block takes (spec `deepseek-v4.md` §2.11).
impl Model for DeepseekV4 {
    /// Every piece of a position's state (window K, compressor inputs, the compressed entry
    /// and indexer key of a block it ends) sits at its own slot and depends only on the tokens
    /// up to it, and a position's bits do not depend on how a prompt is cut into steps (not
    /// under force_eplb, where a token's experts depend on its place in the step).
    /// In the compact layout ([`V4CacheMode`]) the window and compressor inputs live in
    /// per-sequence rings, which blocks cannot share: no prefix caching there.
    fn supports_prefix_caching(&self) -> bool {
        !self.forces_eplb() && self.cache_mode() == V4CacheMode::Full
    }
    fn why_no_prefix_caching(&self) -> String {
        if self.forces_eplb() {
            FORCE_EPLB_NO_PREFIX.into()
        } else {
            "prefix caching does not run on DeepSeek-V4's compact cache (its window is kept in \
             per-sequence rings): --v4-cache full puts every position's state in shareable \
             blocks"
                .into()
        }
    }
    /// Decode and verify steps compute a position as a prefill chunk does (no MLA-style path
    /// rule): generated blocks are shared too.
    fn generated_rows_are_prefill_rows(&self) -> bool {
        self.supports_prefix_caching()
    }
    fn check_block_size(&self, block_size: usize) -> Result<(), EngineError> {
        Ok(DeepseekV4::check_block_size(self, block_size)?)
    }
    fn expert_load(&self) -> Vec<(u32, Vec<u64>)> {
        DeepseekV4::expert_load(self)
    }
    fn expert_served(&self) -> Vec<(u32, u64)> {
        DeepseekV4::expert_served(self)
    }
    fn forward(&self, batch: &Batch, cache: &mut KvCache) -> Result<Vec<f32>, EngineError> {
        Ok(DeepseekV4::forward(self, batch, cache, false)?.logits)
    }
    fn cache_spec(&self) -> CacheSpec {
        DeepseekV4::cache_spec(self)
    }
    fn vocab_size(&self) -> usize {
        self.config().vocab_size
    }
    fn max_positions(&self) -> usize {
        self.config().max_position_embeddings
    }
    fn num_mtp_layers(&self) -> usize {
        DeepseekV4::num_mtp_layers(self)
    }
    fn mtp_hidden_width(&self) -> usize {
        self.config().hc_mult * self.config().hidden_size
    }
    fn forward_with_hidden(
        &self,
        batch: &Batch,
        cache: &mut KvCache,
    ) -> Result<HiddenForward, EngineError> {
        let out = DeepseekV4::forward(self, batch, cache, true)?;
        Ok(HiddenForward {
            logits: out.logits,
            hidden: out.hidden.expect("asked for hidden states"),
        })
    }
    fn mtp_forward(
        &self,
        index: usize,
        batch: &Batch,
        prev_hidden: &[f32],
        cache: &mut KvCache,
    ) -> Result<HiddenForward, EngineError> {
        let out = DeepseekV4::mtp_forward(self, index, batch, prev_hidden, cache, true)?;
        Ok(HiddenForward {
            logits: out.logits,
            hidden: out.hidden.expect("asked for hidden states"),
        })
    }
    fn end_step(&self, more: bool) -> Result<bool, EngineError> {
        Ok(DeepseekV4::end_step(self, more)?)
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
    fn max_positions(&self) -> usize {
        (**self).max_positions()
    }
    fn num_mtp_layers(&self) -> usize {
        (**self).num_mtp_layers()
    }
    fn mtp_hidden_width(&self) -> usize {
        (**self).mtp_hidden_width()
    }
    fn forward_with_hidden(
        &self,
        batch: &Batch,
        cache: &mut KvCache,
    ) -> Result<HiddenForward, EngineError> {
        (**self).forward_with_hidden(batch, cache)
    }
    fn mtp_forward(
        &self,
        index: usize,
        batch: &Batch,
        prev_hidden: &[f32],
        cache: &mut KvCache,
    ) -> Result<HiddenForward, EngineError> {
        (**self).mtp_forward(index, batch, prev_hidden, cache)
    }
    fn end_step(&self, more: bool) -> Result<bool, EngineError> {
        (**self).end_step(more)
    }
    fn supports_prefix_caching(&self) -> bool {
        (**self).supports_prefix_caching()
    }
    fn why_no_prefix_caching(&self) -> String {
        (**self).why_no_prefix_caching()
    }
    fn prompt_bits_depend_on_chunks(&self) -> bool {
        (**self).prompt_bits_depend_on_chunks()
    }
    fn generated_rows_are_prefill_rows(&self) -> bool {
        (**self).generated_rows_are_prefill_rows()
    }
    fn check_block_size(&self, block_size: usize) -> Result<(), EngineError> {
        (**self).check_block_size(block_size)
    }
    fn expert_load(&self) -> Vec<(u32, Vec<u64>)> {
        (**self).expert_load()
    }
    fn expert_served(&self) -> Vec<(u32, u64)> {
        (**self).expert_served()
    }
}

/// JSON mode's mask of one row of logits: tokens whose bytes keep the answer one JSON object
/// keep their logit, the others get −∞; stop tokens only once the object is complete (and then
/// nothing else).
fn json_mask(
    row: &[f32],
    state: &Grammar,
    stop: &[u32],
    bytes: &[Vec<u8>],
    specials: &HashMap<u32, Vec<u8>>,
    (string_safe, value_safe): (&[bool], &[bool]),
) -> Vec<f32> {
    let complete = state.is_complete();
    let string_safe = match state {
        Grammar::Dsml(_) => value_safe,
        _ => string_safe,
    };
    // A complete value that can go on (a top-level number): a stop token or more of it.
    let done = complete && !state.can_continue();
    let in_string = state.in_plain_string();
    row.iter()
        .enumerate()
        .map(|(t, &x)| {
            let ok = if stop.contains(&(t as u32)) {
                complete
            } else if done {
                false
            } else if in_string && string_safe.get(t) == Some(&true) {
                true
            } else {
                let b = state.token_bytes(t as u32, bytes, specials);
                !b.is_empty() && state.clone().feed_all(b)
            };
            if ok {
                x
            } else {
                f32::NEG_INFINITY
            }
        })
        .collect()
}

/// NaN logits mean broken weights (a NaN in a norm, the embedding, the head or a router spreads
/// to every logit): sampling would silently pick token 0 or skip the NaN ids, so it is an error.
pub(crate) fn check_logits(logits: &[f32], what: &str) -> Result<(), EngineError> {
    if logits.iter().any(|x| x.is_nan()) {
        return Err(EngineError::Request(format!(
            "{what} produced NaN logits: the checkpoint holds non-finite weights (a NaN in a \
             norm, the embedding, lm_head, a router or FP8 codes 0x7F/0xFF) or the config's \
             numbers do not fit it; check the checkpoint"
        )));
    }
    Ok(())
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

#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct Request {
    pub prompt: Vec<u32>,
    pub params: SamplingParams,
    pub stop: StopConditions,
    /// The seed system's fixed-length benchmark mode: generate exactly `max_new_tokens`,
    /// whatever EOS says; the text (and `valid_tokens`) end at the first stop token.
    pub ignore_eos: bool,
    /// Record each generated token's log-probability with this many of the most likely
    /// alternatives ([`RequestOutput::logprobs`]); None: none.
    pub logprobs: Option<usize>,
    /// Record each prompt token's log-probability (given the tokens before it) with this many
    /// alternatives ([`RequestOutput::prompt_logprobs`], from the second token on); None: none.
    #[serde(default)]
    pub prompt_logprobs: Option<usize>,
    /// JSON mode: every token is drawn among those that keep the answer one JSON object
    /// ([`crate::json_mode`]); once it is complete, only a stop token may follow.
    #[serde(default)]
    pub json_object: bool,
    /// JSON mode starts once the answer's text holds this (e.g. `</think>`: a reasoning model
    /// thinks freely, then answers in JSON); None: from the first token.
    #[serde(default)]
    pub json_after: Option<String>,
    /// JSON mode after a lead: the answer opens with one of these texts (every token drawn
    /// among those that keep it a prefix of one, as a forced tool call's function name and
    /// the markup before its arguments), then it is one JSON object, under the lead's own
    /// schema when it has one (the tool's parameters). Empty: no lead (with `json_after`
    /// given, this is not used).
    #[serde(default)]
    pub json_lead: Vec<JsonLead>,
    /// After each JSON object that followed a lead (a forced call's arguments): the texts that
    /// may come next, as leads: another call's markup up to its arguments (`then_json`) or the
    /// call section's end ([`JsonLead::ends`]); a stop token may also end it there. Entry k
    /// follows the (k + 1)-th object, the last entry every later one; an empty entry (or none):
    /// the answer ends once its object completes, as without this.
    #[serde(default)]
    pub json_more: Vec<Vec<JsonLead>>,
    /// Structured output: with `json_object`, the JSON value must be one this JSON Schema
    /// accepts ([`crate::json_schema`]; any JSON value type, not only an object). Checked
    /// (compiled) when the request is added; a keyword it cannot enforce is refused by name.
    #[serde(default)]
    pub json_schema: Option<serde_json::Value>,
    /// With `json_object`: the answer (after its lead, where it has leads) is not JSON but
    /// DeepSeek-V4's DSML parameters closing a tool call, held to `json_schema` (or the lead's
    /// schema) as the tool's `parameters` ([`crate::dsml_args`]; a schema it cannot hold:
    /// any parameters).
    #[serde(default)]
    pub dsml: bool,
    /// Which special tokens the answer's text shows ([`SpecialText::keep`]: all).
    #[serde(default)]
    pub special_text: SpecialText,
    /// Seconds the request waited before it reached this engine (a decode server's fetch of
    /// its prefilled KV): its TTFT, queueing and end-to-end times count from then.
    #[serde(default)]
    pub waited_s: f64,
}

/// One of [`Request::json_lead`]'s texts, and the schema of the JSON after it (None: any
/// object).
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct JsonLead {
    pub text: String,
    pub schema: Option<serde_json::Value>,
    /// False: the text after the lead is free; only the lead is held. True: JSON follows (or
    /// DSML parameters, with [`Request::dsml`]).
    #[serde(default = "yes")]
    pub then_json: bool,
    /// The answer ends with this text (as a stop; `then_json` is not read).
    #[serde(default)]
    pub ends: bool,
}

fn yes() -> bool {
    true
}

/// What JSON mode holds an answer to, compiled: any JSON object, a value under a schema, or
/// DSML parameters under a tool's (`Request::dsml`).
#[derive(Clone, Debug)]
enum Spec {
    Object,
    Schema(Arc<Schema>),
    /// DSML parameters; `true`: complete once the invoke closes (more calls may follow).
    Dsml(Arc<DsmlSpec>, bool),
}

impl Spec {
    /// A request's (or a lead's) schema, as JSON or as DSML parameters.
    fn compile(schema: Option<&serde_json::Value>, dsml: bool) -> Result<Spec, String> {
        match (schema, dsml) {
            (Some(s), false) => Schema::compile(s).map(Spec::Schema),
            (None, false) => Ok(Spec::Object),
            // A tool's parameters DSML cannot hold: any parameters, in DSML's form.
            (Some(s), true) => Ok(Spec::Dsml(
                DsmlSpec::compile(s).unwrap_or_else(|_| DsmlSpec::lenient(s)),
                false,
            )),
            (None, true) => Ok(Spec::Dsml(DsmlSpec::any(), false)),
        }
    }
}

/// Where an answer stands in JSON mode's grammar ([`Spec`]).
#[derive(Clone, Debug)]
enum Grammar {
    Object(JsonState),
    Schema(SchemaState),
    Dsml(DsmlState),
}

impl Grammar {
    fn new(spec: &Spec) -> Grammar {
        match spec {
            Spec::Schema(s) => Grammar::Schema(SchemaState::new(s.clone())),
            Spec::Object => Grammar::Object(JsonState::new()),
            Spec::Dsml(s, false) => Grammar::Dsml(DsmlState::new(s.clone())),
            Spec::Dsml(s, true) => Grammar::Dsml(DsmlState::new(s.clone()).ending_at_invoke()),
        }
    }

    fn feed_all(&mut self, bytes: &[u8]) -> bool {
        match self {
            Grammar::Object(s) => s.feed_all(bytes),
            Grammar::Schema(s) => s.feed_all(bytes),
            Grammar::Dsml(s) => s.feed_all(bytes),
        }
    }

    fn is_complete(&self) -> bool {
        match self {
            Grammar::Object(s) => s.is_complete(),
            Grammar::Schema(s) => s.is_complete(),
            Grammar::Dsml(s) => s.is_complete(),
        }
    }

    /// Where any token free of `"`, `\` and control bytes fits without a check (in DSML,
    /// free of `<` and 0xEF too: [`DsmlState::in_plain_value`]).
    fn in_plain_string(&self) -> bool {
        match self {
            Grammar::Object(s) => s.in_plain_string(),
            Grammar::Schema(s) => s.in_plain_string(),
            Grammar::Dsml(s) => s.in_plain_value(),
        }
    }

    /// Complete, yet more bytes could extend it (a top-level number; JSON mode's object is
    /// done once closed, and DSML once the call block is).
    fn can_continue(&self) -> bool {
        match self {
            Grammar::Object(_) | Grammar::Dsml(_) => false,
            Grammar::Schema(s) => s.can_continue(),
        }
    }

    /// Token `t`'s bytes for this grammar: DSML's markup may be special tokens, taken by their
    /// text (those that hold `｜DSML｜`; no other special token, such as `<think>`, goes in a
    /// value); JSON takes no special token.
    fn token_bytes<'a>(
        &self,
        t: u32,
        bytes: &'a [Vec<u8>],
        specials: &'a HashMap<u32, Vec<u8>>,
    ) -> &'a [u8] {
        match (self, specials.get(&t)) {
            (Grammar::Dsml(_), Some(s)) if holds_marker(s) => s,
            _ => bytes.get(t as usize).map_or(&[][..], Vec::as_slice),
        }
    }
}

/// What follows one of a [`Lead`]'s texts.
#[derive(Clone, Debug)]
enum After {
    /// Free text.
    Free,
    /// JSON (or DSML parameters) under this spec.
    Json(Spec),
    /// Nothing: the answer ends.
    End,
}

/// A lead's text written whole ([`Lead::push`]).
#[derive(Debug)]
enum LeadDone {
    Free,
    /// The grammar of what follows, the bytes after the lead fed up to where it completes
    /// ([`feed_to_end`]: the bytes after that are second, not fed).
    Json(Box<Grammar>, Option<Vec<u8>>),
    End,
}

/// Feeds `b` to `g` up to the byte with which it completes (a closed object) and returns the
/// bytes after that, not fed; None (all fed) where it does not complete.
fn feed_to_end(g: &mut Grammar, b: &[u8]) -> Option<Vec<u8>> {
    for (i, x) in b.iter().enumerate() {
        g.feed_all(std::slice::from_ref(x));
        if g.is_complete() && !g.can_continue() {
            return Some(b[i + 1..].to_vec());
        }
    }
    None
}

/// A request's DSML mode for its leads: (DSML parameters, more calls may follow them).
fn dsml_mode(req: &Request) -> (bool, bool) {
    (req.dsml, req.dsml && !req.json_more.is_empty())
}

/// The leads that may follow a lead's `objects`-th object ([`Request::json_more`]; None: only
/// a stop token).
fn next_leads(more: &[Vec<JsonLead>], objects: usize) -> Option<Vec<JsonLead>> {
    more.get(objects.min(more.len().saturating_sub(1)))
        .filter(|m| !m.is_empty())
        .cloned()
}

/// JSON mode's lead ([`Request::json_lead`], [`Request::json_more`]): the texts the answer may
/// continue with, and what it has written of one so far (a prefix of at least one).
#[derive(Clone, Debug)]
struct Lead {
    options: Vec<Vec<u8>>,
    /// What each option holds the text after it to.
    then: Vec<After>,
    /// Where each option holds a special token's text (tool-call markers): written by that
    /// token alone, not spelled out in ordinary tokens (which the model's tokenizer would never
    /// give it).
    spans: Vec<Vec<(usize, usize)>>,
    written: Vec<u8>,
    /// A stop token may end the answer before anything of the lead is written (after a
    /// forced call's arguments, instead of another call).
    stop_ok: bool,
}

impl Lead {
    /// The request's leads with their schemas compiled (`Engine::compile_spec` checked
    /// them: one that does not compile is any object here). `more`: other calls may follow
    /// each (DSML parameters then end with their invoke).
    fn new(
        leads: &[JsonLead],
        (dsml, more): (bool, bool),
        specials: &HashMap<u32, Vec<u8>>,
    ) -> Lead {
        let spans = leads
            .iter()
            .map(|l| {
                let text = l.text.as_bytes();
                let mut spans: Vec<(usize, usize)> = specials
                    .values()
                    .filter(|s| s.len() > 1)
                    .flat_map(|s| {
                        (0..text.len().saturating_sub(s.len() - 1))
                            .filter(|&i| text[i..].starts_with(s))
                            .map(|i| (i, i + s.len()))
                    })
                    .collect();
                spans.sort_unstable();
                spans
            })
            .collect();
        Lead {
            spans,
            options: leads.iter().map(|l| l.text.as_bytes().to_vec()).collect(),
            then: leads
                .iter()
                .map(|l| match (l.ends, l.then_json) {
                    (true, _) => After::End,
                    (false, true) => After::Json(
                        match Spec::compile(l.schema.as_ref(), dsml).unwrap_or(Spec::Object) {
                            Spec::Dsml(s, _) => Spec::Dsml(s, more),
                            other => other,
                        },
                    ),
                    (false, false) => After::Free,
                })
                .collect(),
            written: Vec::new(),
            stop_ok: false,
        }
    }

    /// Token bytes `b` (of a special token: `special`) keep the answer on a lead, or finish
    /// one and begin the JSON object.
    fn allows(&self, b: &[u8], special: bool) -> bool {
        let (w, end) = (self.written.len(), self.written.len() + b.len());
        !b.is_empty()
            && self.options.iter().enumerate().any(|(i, o)| {
                let Some(rest) = o.strip_prefix(self.written.as_slice()) else {
                    return false;
                };
                // A special token's text in the lead is that token's: a special token writes
                // one whole, and no other token writes any part of one.
                let covered = end.min(o.len());
                let ok_spans = self.spans[i]
                    .iter()
                    .filter(|&&(s, e)| s < covered && e > w)
                    .all(|&span| special && span == (w, end));
                if !ok_spans {
                    false
                } else if rest.starts_with(b) {
                    true
                } else if b.starts_with(rest) {
                    match &self.then[i] {
                        After::Free => true,
                        After::Json(s) => Grammar::new(s).feed_all(&b[rest.len()..]),
                        After::End => false,
                    }
                } else {
                    false
                }
            })
    }

    /// Takes a token's bytes; once a lead is complete, what follows it (a JSON grammar with
    /// the bytes after the lead fed).
    fn push(&mut self, b: &[u8]) -> Option<LeadDone> {
        self.written.extend_from_slice(b);
        let (i, o) = self
            .options
            .iter()
            .enumerate()
            .filter(|(_, o)| self.written.starts_with(o))
            .max_by_key(|(_, o)| o.len())?;
        Some(match &self.then[i] {
            After::Free => LeadDone::Free,
            After::End => LeadDone::End,
            After::Json(spec) => {
                let mut g = Grammar::new(spec);
                let rest = feed_to_end(&mut g, &self.written[o.len()..]);
                LeadDone::Json(Box::new(g), rest)
            }
        })
    }
}

/// A lead's mask of one row of logits ([`Lead::allows`]; special tokens by their text, which a
/// lead may hold; stop tokens never).
fn lead_mask(
    row: &[f32],
    lead: &Lead,
    bytes: &[Vec<u8>],
    specials: &HashMap<u32, Vec<u8>>,
    stop: &[u32],
) -> Vec<f32> {
    row.iter()
        .enumerate()
        .map(|(t, &x)| {
            let t = t as u32;
            let stop_ok = lead.stop_ok && lead.written.is_empty();
            if (stop_ok && stop.contains(&t))
                || (!stop.contains(&t) && {
                    let (b, special) = lead_bytes(t, bytes, specials);
                    lead.allows(b, special)
                })
            {
                x
            } else {
                f32::NEG_INFINITY
            }
        })
        .collect()
}

/// Token `t`'s bytes for a lead: a special token's text, any other token's bytes; and whether
/// it is a special token.
fn lead_bytes<'a>(
    t: u32,
    bytes: &'a [Vec<u8>],
    specials: &'a HashMap<u32, Vec<u8>>,
) -> (&'a [u8], bool) {
    match specials.get(&t) {
        Some(text) => (text, true),
        None => (bytes.get(t as usize).map_or(&[][..], Vec::as_slice), false),
    }
}

/// A generated token's log-probability under the model (the log-softmax of its raw logits,
/// before temperature, penalties and truncation, as vLLM and OpenAI report it; in JSON mode too,
/// where vLLM reports the masked distribution), with the `top`
/// most likely tokens and theirs, most likely first. An impossible token's is `f32::MIN`.
/// `rank`: how many tokens are at least as likely as `token` (itself included: the most likely
/// has rank 1; vLLM's `rank`, ties counted ahead), the vocabulary's size for an impossible one.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct TokenLogprob {
    pub token: u32,
    pub logprob: f32,
    pub top: Vec<(u32, f32)>,
    #[serde(default)]
    pub rank: u32,
}

impl TokenLogprob {
    /// `token`'s entry from one row of logits, with the `top` most likely tokens (ties to the
    /// lower id). NaN logits count as impossible.
    pub fn from_logits(logits: &[f32], token: u32, top: usize) -> TokenLogprob {
        let max = logits
            .iter()
            .copied()
            .filter(|x| !x.is_nan())
            .fold(f32::NEG_INFINITY, f32::max);
        let lse = if max.is_finite() {
            let sum: f64 = logits
                .iter()
                .filter(|x| !x.is_nan())
                .map(|&x| ((x - max) as f64).exp())
                .sum();
            max + sum.ln() as f32
        } else {
            max
        };
        // An impossible token gets f32::MIN, not −∞ (as the seed reports it: JSON has no −∞).
        let lp = |t: u32| match logits.get(t as usize) {
            Some(&x) if !x.is_nan() && (x - lse).is_finite() => x - lse,
            _ => f32::MIN,
        };
        // The `top` best in one pass, kept sorted (most likely first, ties to the lower id): k
        // is small, the vocabulary large.
        let k = top.min(logits.len());
        let key = |i: usize| {
            let x = logits[i];
            if x.is_nan() {
                f32::NEG_INFINITY
            } else {
                x
            }
        };
        let mut best: Vec<u32> = Vec::with_capacity(k + 1);
        if k > 0 {
            for i in 0..logits.len() {
                let x = key(i);
                if best.len() == k && x <= key(best[k - 1] as usize) {
                    continue;
                }
                let at = best.partition_point(|&b| key(b as usize) >= x);
                best.insert(at, i as u32);
                best.truncate(k);
            }
        }
        // (An impossible token, −∞ or NaN, is last: the vocabulary's size.)
        let rank = match logits.get(token as usize) {
            Some(&x) if !x.is_nan() && x != f32::NEG_INFINITY => {
                logits.iter().filter(|&&y| y >= x).count()
            }
            _ => logits.len(),
        };
        TokenLogprob {
            token,
            logprob: lp(token),
            top: best.into_iter().map(|t| (t, lp(t))).collect(),
            rank: rank as u32,
        }
    }
}

#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
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
    /// MTP drafts verified for this request, and how many were accepted.
    pub drafted: usize,
    pub accepted_drafts: usize,
    /// Per generated token, its log-probability (when the request asked for them).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub logprobs: Vec<TokenLogprob>,
    /// Per prompt token from the second on, its log-probability given those before it (when
    /// the request asked for them).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub prompt_logprobs: Vec<TokenLogprob>,
    /// The prompt's KV and first token, for a request added with
    /// [`Engine::add_request_for_transfer`] that ended with a token sampled.
    #[serde(skip)]
    pub kv: Option<Box<KvSnapshot>>,
}

/// What one step did.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StepReport {
    pub seqs: usize,
    pub prefill_tokens: usize,
    /// Known generated tokens forwarded (one per decoding request).
    pub decode_tokens: usize,
    /// Tokens emitted (accepted drafts included).
    pub sampled: usize,
    /// Draft tokens verified, and how many of them were accepted.
    pub drafted: usize,
    pub accepted: usize,
    pub preempted: usize,
    pub finished: usize,
    /// Main-model forward time.
    pub forward_s: f64,
    /// MTP forward time (drafting and catching up).
    pub draft_s: f64,
    /// The part of `draft_s` spent catching the MTP layer up on prompt positions (its pass over
    /// a prompt, which the seed runs in prefill): counted as prefill time, not decode.
    pub draft_prompt_s: f64,
    pub kv_used_blocks: usize,
}

/// Hidden states of positions `first..first + rows` waiting for the MTP catch-up.
struct Pending {
    first: usize,
    rows: usize,
    hidden: Vec<f32>,
}

/// A draft token (the MTP layer's most probable after the request's processing).
struct Draft {
    token: u32,
}

struct Live<'t> {
    tokens: Vec<u32>,
    prompt_len: usize,
    sampler: Sampler,
    stop: StopConditions,
    ignore_eos: bool,
    /// Output length at the first stop token (fixed-length mode keeps going past it).
    eos_at: Option<usize>,
    /// Why the text ended at `eos_at` (under `ignore_eos` the request goes on to its length:
    /// the seed's offline runs then report this, "stop", as the finish).
    stopped: Option<FinishReason>,
    stream: Option<TextStream<'t>>,
    text: String,
    arrival: Instant,
    first_scheduled: Option<Instant>,
    first_token: Option<Instant>,
    last_token: Option<Instant>,
    /// MTP catch-up due: the main model's hidden states of positions `first..first + rows`,
    /// whose next tokens are known but whose MTP rows have not run.
    mtp_pending: Option<Pending>,
    drafted: usize,
    accepted: usize,
    /// Prompt tokens taken from the prefix cache at its first admission (None: not admitted).
    cached_tokens: Option<usize>,
    /// Alternatives per token to record, and the records (`Request::logprobs`).
    top_logprobs: Option<usize>,
    logprobs: Vec<TokenLogprob>,
    /// The same for the prompt's tokens (`Request::prompt_logprobs`): entry i is token i + 1's.
    top_prompt_logprobs: Option<usize>,
    prompt_logprobs: Vec<TokenLogprob>,
    /// JSON mode: where the answer stands in the grammar.
    json: Option<Grammar>,
    /// Structured output's compiled schema (`Request::json_schema`, `Request::dsml`), for the
    /// grammar made when JSON mode starts.
    schema: Spec,
    /// JSON mode waiting for this text before it starts.
    json_after: Option<String>,
    /// JSON mode after a lead, while it is being written.
    lead: Option<Lead>,
    /// What may follow each object after a lead ([`Request::json_more`]), and how many have
    /// completed.
    json_more: Vec<Vec<JsonLead>>,
    objects: usize,
    dsml: bool,
}

/// Which cache state slot each running request holds, for a model whose cache keeps a state
/// per sequence ([`CacheSpec::seq_state_width`]: DeepSeek-V4's compact rings). A request takes
/// a slot when it is first stepped and gives it back when it is preempted (its state is
/// recomputed from position 0) or retires.
#[derive(Default)]
struct StateSlots {
    on: bool,
    of: HashMap<u64, u32>,
    free: Vec<u32>,
    next: u32,
}

impl StateSlots {
    /// The slot of running request `id`, given one if it has none.
    fn get(&mut self, id: u64, scheduler: &Scheduler) -> u32 {
        if let Some(&s) = self.of.get(&id) {
            return s;
        }
        if self.free.is_empty() {
            // Slots of requests no longer running (a path that did not give one back).
            let gone: Vec<u64> = self
                .of
                .keys()
                .copied()
                .filter(|&i| scheduler.phase(i) != Some(crate::scheduler::Phase::Running))
                .collect();
            for i in gone {
                self.release(i);
            }
        }
        let s = self.free.pop().unwrap_or_else(|| {
            self.next += 1;
            self.next - 1
        });
        self.of.insert(id, s);
        s
    }

    /// Gives the last sequence pushed on `batch` request `id`'s slot (nothing without a
    /// per-sequence state).
    fn name(&mut self, batch: &mut Batch, id: u64, scheduler: &Scheduler) {
        if self.on {
            batch.set_state_slot(self.get(id, scheduler));
        }
    }

    fn release(&mut self, id: u64) {
        if let Some(s) = self.of.remove(&id) {
            self.free.push(s);
        }
    }
}

pub struct Engine<'t, M: Model> {
    model: M,
    tokenizer: Option<&'t Tokenizer>,
    cache: KvCache,
    /// Per-sequence cache state slots (used only when the cache has a state).
    slots: StateSlots,
    scheduler: Scheduler,
    live: HashMap<u64, Live<'t>>,
    finished: Vec<RequestOutput>,
    next_id: u64,
    stats: EngineStats,
    /// Draft tokens per step (0: no speculative decoding).
    next_n: usize,
    /// Requests whose prompt's KV leaves with their output ([`Engine::add_request_for_transfer`]).
    exporting: HashSet<u64>,
    /// Prefilled requests waiting for a batch slot and blocks, with their KV rows per layer
    /// ([`Engine::add_prefilled`]), oldest first.
    imports: VecDeque<(u64, Vec<Vec<u8>>)>,
    /// Every token's bytes, for JSON mode (made when a request first asks for it; empty for
    /// special tokens, which JSON text never holds), and which of them any plain string takes.
    token_bytes: Option<Vec<Vec<u8>>>,
    string_safe: Vec<bool>,
    /// Which tokens a DSML value's plain string takes (`string_safe`, without `<` or 0xEF).
    value_safe: Vec<bool>,
    /// The special tokens' texts (their `token_bytes` are empty: JSON never takes them), for
    /// a JSON lead that holds one (Kimi-K2's `<|tool_call_argument_begin|>`).
    special_bytes: HashMap<u32, Vec<u8>>,
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
        model.check_block_size(cfg.block_size)?;
        let mut cache = KvCache::try_new(model.cache_spec(), cfg.block_size, cfg.num_blocks)
            .map_err(EngineError::Request)?;
        // Every running request's state slot, up front (a batch holds at most batch_size).
        cache.reserve_seq_slots(cfg.batch_size);
        let slots = StateSlots {
            on: model.cache_spec().seq_state_width > 0,
            ..Default::default()
        };
        let scheduler = Scheduler::new(
            SchedulerConfig {
                batch_size: cfg.batch_size,
                max_prefill_tokens: cfg.max_prefill_tokens,
                fixed_chunks: model.prompt_bits_depend_on_chunks(),
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
            slots,
            scheduler,
            live: HashMap::new(),
            finished: Vec::new(),
            next_id: 0,
            stats,
            next_n: 0,
            exporting: HashSet::new(),
            imports: VecDeque::new(),
            token_bytes: None,
            string_safe: Vec::new(),
            value_safe: Vec::new(),
            special_bytes: HashMap::new(),
        })
    }

    /// Turns on MTP speculative decoding with `next_n` (1..=3) chained drafts per step, through
    /// MTP layer 0. The model must have its MTP layer loaded (its cache in `cache_spec`). Call
    /// before adding requests.
    pub fn enable_mtp(&mut self, next_n: usize) -> Result<(), EngineError> {
        if !(1..=3).contains(&next_n) {
            return Err(EngineError::Request(format!(
                "next_n {next_n}: MTP speculative decoding takes 1 to 3 draft tokens per step"
            )));
        }
        if self.model.num_mtp_layers() == 0 {
            return Err(EngineError::Request(
                "next_n > 0 needs the model's MTP layer: the checkpoint has none \
                 (num_nextn_predict_layers = 0 in its config.json), or it was not loaded: set \
                 next_n to 0 (--mtp 0) for this model"
                    .into(),
            ));
        }
        if self.scheduler.has_unfinished() {
            return Err(EngineError::Request(
                "enable MTP before adding requests".into(),
            ));
        }
        self.next_n = next_n;
        self.scheduler.set_lookahead(next_n);
        self.match_prefix_lookahead();
        self.stats.mtp_next_n = next_n;
        Ok(())
    }

    /// Turns on prefix caching (vLLM's automatic prefix caching; [`crate::kv_pool`]): a
    /// request's prompt blocks already computed for an earlier request are shared instead of
    /// computed again (outputs unchanged: the shared KV is what the prompt's own prefill would
    /// have written, as a chunked prefill reads it). With MTP a block is shared only with
    /// requests whose token after it is the same (the MTP layer's cache row of its last position
    /// pairs the hidden state there with that token), once its MTP rows are written. Not for a
    /// model whose cache does not support it (a C8 cache). Requests that score
    /// their prompt (echo) compute every position. Call before adding requests.
    pub fn enable_prefix_caching(&mut self) -> Result<(), EngineError> {
        if !self.model.supports_prefix_caching() {
            return Err(EngineError::Request(self.model.why_no_prefix_caching()));
        }
        if self.scheduler.has_unfinished() {
            return Err(EngineError::Request(
                "enable prefix caching before adding requests".into(),
            ));
        }
        self.scheduler.enable_prefix_caching();
        self.scheduler
            .set_share_generated(self.model.generated_rows_are_prefill_rows());
        self.match_prefix_lookahead();
        self.stats.prefix_caching = true;
        Ok(())
    }

    /// With MTP, a shared block's cache rows depend on the token after it (module docs).
    fn match_prefix_lookahead(&mut self) {
        let n = usize::from(self.next_n > 0 && self.scheduler.kv().prefix_caching());
        self.scheduler.set_prefix_lookahead(n);
    }

    /// `--prefix-caching`: `Some(true)` turns it on (an error where it cannot run),
    /// `Some(false)` leaves it off, `None` turns it on where it can (a family and cache that
    /// support it). Returns whether it is on.
    pub fn set_prefix_caching(&mut self, want: Option<bool>) -> Result<bool, EngineError> {
        match want {
            Some(false) => Ok(false),
            Some(true) => self.enable_prefix_caching().map(|()| true),
            None if self.model.supports_prefix_caching() => {
                self.enable_prefix_caching().map(|()| true)
            }
            None => Ok(false),
        }
    }

    /// Draft tokens per step (0 when speculative decoding is off).
    pub fn next_n(&self) -> usize {
        self.next_n
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
        self.scheduler.has_unfinished() || !self.imports.is_empty()
    }

    /// [`Model::end_step`] with this engine's work: the group's step barrier for ranks whose
    /// MoE layers dispatch tokens between their own batches. Call it after every step, and
    /// (without work) in place of one, until it returns false on every rank.
    pub fn end_step(&self) -> Result<bool, EngineError> {
        self.model.end_step(self.has_unfinished())
    }

    /// Stamps `at` as the arrival of every request not yet scheduled: a batch run adds its
    /// requests, waits for its other ranks, and only then starts the clock, so that waiting is
    /// nobody's queueing time or TTFT.
    pub fn restamp_arrivals(&mut self, at: Instant) {
        for live in self.live.values_mut() {
            if live.first_scheduled.is_none() {
                live.arrival = at;
            }
        }
    }

    /// Queues a request; its id comes back with its output.
    pub fn add_request(&mut self, mut req: Request) -> Result<u64, EngineError> {
        let max_len = self.check_request(&mut req)?;
        let id = self.next_id;
        let sampler = Sampler::new(req.params.clone(), &req.prompt)?;
        // A prompt to be scored runs every position.
        let reuse = req.prompt_logprobs.is_none();
        self.scheduler
            .add_prompt(id, &req.prompt, max_len, reuse)
            .map_err(|e: AdmissionError| EngineError::Request(e.to_string()))?;
        self.next_id += 1;
        self.insert_live(id, req, sampler);
        Ok(id)
    }

    /// [`Engine::add_request`] for the prefill side of a disaggregated server (spec
    /// `executor.md` §5.7): when the request ends with a token sampled, its output carries the
    /// prompt's KV, that token, the sampler's stream and any MTP rows due
    /// ([`RequestOutput::kv`]) for [`Engine::add_prefilled`] on another engine. Give it
    /// `max_new_tokens` 1, as the seed's prefill instances run.
    pub fn add_request_for_transfer(&mut self, req: Request) -> Result<u64, EngineError> {
        let id = self.add_request(req)?;
        self.exporting.insert(id);
        Ok(id)
    }

    /// Continues a request another engine prefilled (the decode side of spec `executor.md`
    /// §5.8): `kv` is that engine's [`RequestOutput::kv`] for the same prompt. The request
    /// starts with the transferred first token; it joins the running batch with the KV written
    /// into its own blocks as soon as a batch slot and the blocks are free (until then it
    /// waits, before any request that has to be prefilled here), and decodes from there with
    /// this request's sampling and stop rules.
    pub fn add_prefilled(&mut self, mut req: Request, kv: KvSnapshot) -> Result<u64, EngineError> {
        let refuse = |m: String| Err(EngineError::Request(m));
        kv.check()
            .map_err(|e| EngineError::Request(e.to_string()))?;
        if self.next_n > 0 && kv.mtp.is_none() {
            return refuse(
                "this engine drafts with MTP but the prefill side ran without it: start both \
                 sides with the same --mtp"
                    .into(),
            );
        }
        if self.next_n == 0 && kv.mtp.is_some() {
            return refuse(
                "the prefill side drafts with MTP (its --mtp) but this engine runs without it: \
                 start both sides with the same --mtp"
                    .into(),
            );
        }
        let spec = self.cache.spec();
        if kv.spec != spec {
            return refuse(format!(
                "the transferred KV's cache differs from this server's ({}): run the prefill \
                 and decode sides with the same model, --kv-cache-dtype, --v4-cache and --mtp \
                 (an MTP layer has a cache of its own), and the same layers \
                 (custom_params.num_hidden_layers)",
                spec_differences(&kv.spec, &spec)
            ));
        }
        // An unseeded request whose prefill side drew its seed (a server over several ranks
        // draws one for all of them): the sampler's state comes with the KV either way.
        if req.params.seed.is_none() {
            req.params.seed = kv.params.seed;
        }
        if kv.prompt != req.prompt || kv.params != req.params {
            // Sampling alone differing may be the servers' defaults for what the request left
            // out.
            let defaults = if kv.prompt == req.prompt {
                ", or the two servers' defaults for sampling fields the request leaves out \
                 differ (serve --generation-config, the model's generation_config.json)"
            } else {
                ""
            };
            let what = if kv.prompt != req.prompt {
                let at = kv.prompt.iter().zip(&req.prompt).position(|(a, b)| a != b);
                let how = match at {
                    Some(i) => format!("they differ from token {i} on"),
                    None => "one is the start of the other".into(),
                };
                format!(
                    "a prompt of {} tokens, this request's has {} ({how})",
                    kv.prompt.len(),
                    req.prompt.len()
                )
            } else {
                format!(
                    "a request sampled with {}",
                    params_differences(&kv.params, &req.params)
                )
            };
            return refuse(format!(
                "the transferred KV is of {what}: it belongs to another request (give each \
                 request its own bootstrap_room), or the two sides render and tokenize requests \
                 differently (run the same model, tokenizer and chat template on both){defaults}"
            ));
        }
        if let (true, Some(m)) = (self.next_n > 0, &kv.mtp) {
            let width = self.model.mtp_hidden_width();
            if m.hidden.len() != m.rows * width {
                return refuse(format!(
                    "the transferred MTP rows hold {} floats for {} positions; this model's \
                     hidden state is {width} wide: the two sides run different models",
                    m.hidden.len(),
                    m.rows
                ));
            }
        }
        if (kv.first_token as usize) >= self.model.vocab_size() {
            return refuse(format!(
                "the transferred first token {} is outside the vocabulary",
                kv.first_token
            ));
        }
        let max_len = self.check_request(&mut req)?;
        // The prompt was scored (if at all) where it was prefilled: its log-probabilities come
        // with the KV.
        let scored = req.prompt_logprobs.take().is_some();
        if scored && kv.prompt_logprobs.len() + 1 != kv.prompt.len() {
            return refuse(
                "the request asks for the prompt's log-probabilities (echo) but the prefill \
                 side did not record them: send the prefill server the same request"
                    .into(),
            );
        }
        // JSON mode from the first token: the prefill side must have masked that token too.
        if req.json_object && req.json_after.is_none() {
            let bytes = self.token_bytes.as_deref().unwrap_or_default();
            let spec = self.compile_spec(&req)?;
            let fits = if req.json_lead.is_empty() {
                let g = Grammar::new(&spec);
                let b = g.token_bytes(kv.first_token, bytes, &self.special_bytes);
                !b.is_empty() && g.clone().feed_all(b)
            } else {
                let (b, special) = lead_bytes(kv.first_token, bytes, &self.special_bytes);
                Lead::new(&req.json_lead, dsml_mode(&req), &self.special_bytes).allows(b, special)
            };
            if !fits {
                return refuse(format!(
                    "the transferred first token {} does not begin a JSON object: the prefill \
                     side did not run JSON mode (send it the same request)",
                    kv.first_token
                ));
            }
        }
        let mut sampler = Sampler::new(req.params.clone(), &req.prompt)?;
        sampler.set_rng_state(kv.rng);
        let prompt_len = req.prompt.len();
        // Refuse now what could never run (the scheduler's own check, as placing it will).
        let id = self.next_id;
        self.scheduler
            .check_new(id, max_len.max(prompt_len + 1))
            .map_err(|e| EngineError::Request(e.to_string()))?;
        self.next_id += 1;
        self.insert_live(id, req, sampler);
        let now = Instant::now();
        if let Some(live) = self.live.get_mut(&id) {
            live.first_scheduled = Some(now);
            if scored {
                live.prompt_logprobs = kv.prompt_logprobs;
            }
            if live.top_logprobs.is_some() {
                match kv.first_logprob {
                    Some(lp) => live.logprobs.push(lp),
                    None => {
                        self.live.remove(&id);
                        return refuse(
                            "the request asks for logprobs but the prefill side did not record \
                             its first token's: send the prefill server the same request"
                                .into(),
                        );
                    }
                }
            }
            if self.next_n > 0 {
                live.mtp_pending = kv.mtp.map(|m| Pending {
                    first: m.first,
                    rows: m.rows,
                    hidden: m.hidden,
                });
            }
        }
        let pushed = self.push_token(id, kv.first_token, now);
        if pushed.is_ok() {
            self.stats.transferred_tokens += 1;
        }
        match pushed {
            Ok(Some(reason)) => {
                self.retire(id, reason, Instant::now());
                return Ok(id);
            }
            Ok(None) => {}
            Err(e) => {
                self.live.remove(&id);
                return Err(e);
            }
        }
        self.imports.push_back((id, kv.layers));
        self.place_imports();
        Ok(id)
    }

    /// Moves waiting prefilled requests into the running batch, oldest first, while slots and
    /// blocks allow, writing their KV into their blocks. One the scheduler refuses outright
    /// (never the case after [`Engine::add_prefilled`]'s checks) ends as cancelled.
    fn place_imports(&mut self) {
        while let Some((id, _)) = self.imports.front() {
            let id = *id;
            let live = &self.live[&id];
            let (prompt_len, num_tokens) = (live.prompt_len, live.tokens.len());
            let max_len = prompt_len + live.stop.max_new_tokens;
            let placed = match self
                .scheduler
                .add_computed(id, prompt_len, num_tokens, max_len)
            {
                Ok(p) => p,
                Err(_) => {
                    self.retire(id, FinishReason::Cancelled, Instant::now());
                    continue;
                }
            };
            if !placed {
                break;
            }
            let (_, layers) = self.imports.pop_front().expect("the front");
            let table = self.scheduler.block_table(id).to_vec();
            let state = self.cache.spec().layer_state_bytes();
            let slot = self
                .slots
                .on
                .then(|| self.slots.get(id, &self.scheduler) as usize);
            for (l, rows) in layers.iter().enumerate() {
                let (rows, st) = rows.split_at(rows.len() - state);
                self.cache.write_rows(l, &table, rows);
                if let Some(slot) = slot {
                    self.cache.write_state(l, slot, st);
                }
            }
        }
    }

    /// What JSON mode holds the answer to, compiled (any object without a schema).
    fn compile_spec(&self, req: &Request) -> Result<Spec, EngineError> {
        for lead in req.json_lead.iter().chain(req.json_more.iter().flatten()) {
            Spec::compile(lead.schema.as_ref(), req.dsml).map_err(|e| {
                EngineError::Request(format!("the schema after {:?}: {e}", lead.text))
            })?;
        }
        let schema = req.json_schema.as_ref().filter(|_| req.json_object);
        Spec::compile(schema, req.dsml)
            .map_err(|e| EngineError::Request(format!("json_schema: {e}")))
    }

    /// The checks of a new request; caps its output at the model's positions and returns the
    /// most tokens it may reach.
    fn check_request(&mut self, req: &mut Request) -> Result<usize, EngineError> {
        let vocab = self.model.vocab_size();
        self.compile_spec(req)?;
        if req.json_object && self.token_bytes.is_none() {
            let Some(tok) = self.tokenizer else {
                return Err(EngineError::Request(
                    "JSON mode needs the model's tokenizer (the engine was made without one)"
                        .into(),
                ));
            };
            let bytes: Vec<Vec<u8>> = (0..vocab as u32)
                .map(|t| {
                    if tok.is_special(t) {
                        Vec::new()
                    } else {
                        tok.token_bytes(t)
                    }
                })
                .collect();
            self.special_bytes = (0..vocab as u32)
                .filter(|&t| tok.is_special(t))
                .filter_map(|t| tok.id_to_token(t).map(|s| (t, s.into_bytes())))
                .collect();
            // (Whole UTF-8 characters only: a token of part of one is checked byte by byte.)
            self.string_safe = bytes
                .iter()
                .map(|b| {
                    !b.is_empty()
                        && b.iter().all(|&c| c >= 0x20 && c != b'"' && c != b'\\')
                        && std::str::from_utf8(b).is_ok()
                })
                .collect();
            // DSML values: no `<` (a closing marker's start) nor 0xEF (`｜`'s first byte).
            self.value_safe = self
                .string_safe
                .iter()
                .zip(&bytes)
                .map(|(&safe, b)| safe && !b.iter().any(|&c| c == b'<' || c == 0xEF))
                .collect();
            self.token_bytes = Some(bytes);
        }
        if req.json_after.as_deref() == Some("") {
            req.json_after = None;
        }
        let max_positions = self.model.max_positions();
        if req.prompt.len() >= max_positions {
            return Err(EngineError::Request(format!(
                "the prompt has {} tokens; the model takes at most {max_positions} positions \
                 (max_position_embeddings) and this leaves none to generate: shorten the prompt \
                 (e.g. input_truncated_len)",
                req.prompt.len()
            )));
        }
        // Output stops (finish reason length) where the model's positions end.
        req.stop.max_new_tokens = req
            .stop
            .max_new_tokens
            .min(max_positions - req.prompt.len());
        if let Some(&t) = req.prompt.iter().find(|&&t| t as usize >= vocab) {
            return Err(EngineError::Request(format!(
                "prompt token {t} is outside the vocabulary of {vocab} (config.json vocab_size; \
                 a prompt's ids come from the tokenizer, or were given as ids: is the tokenizer \
                 (tokenizer.json or tiktoken.model) this model's, or are the ids?)"
            )));
        }
        if req.stop.max_new_tokens == 0 {
            return Err(EngineError::Request(
                "max_new_tokens must be at least 1".into(),
            ));
        }
        req.prompt
            .len()
            .checked_add(req.stop.max_new_tokens)
            .ok_or_else(|| {
                EngineError::Request(format!(
                    "max_new_tokens {} is out of range",
                    req.stop.max_new_tokens
                ))
            })
    }

    fn insert_live(&mut self, id: u64, req: Request, sampler: Sampler) {
        // (Compiled in `check_request` already: it cannot fail here.)
        let schema = self.compile_spec(&req).unwrap_or(Spec::Object);
        let dsml = dsml_mode(&req);
        let stream = self
            .tokenizer
            .map(|t| TextStream::new(t, &req.stop.stop_strings, &req.special_text));
        self.live.insert(
            id,
            Live {
                prompt_len: req.prompt.len(),
                tokens: req.prompt,
                sampler,
                stop: req.stop,
                ignore_eos: req.ignore_eos,
                eos_at: None,
                stopped: None,
                stream,
                text: String::new(),
                arrival: std::time::Duration::try_from_secs_f64(req.waited_s)
                    .ok()
                    .and_then(|w| Instant::now().checked_sub(w))
                    .unwrap_or_else(Instant::now),
                first_scheduled: None,
                first_token: None,
                last_token: None,
                mtp_pending: None,
                drafted: 0,
                accepted: 0,
                cached_tokens: None,
                top_logprobs: req.logprobs,
                logprobs: Vec::new(),
                top_prompt_logprobs: req.prompt_logprobs,
                prompt_logprobs: Vec::new(),
                json: (req.json_object && req.json_after.is_none() && req.json_lead.is_empty())
                    .then(|| Grammar::new(&schema)),
                schema,
                lead: (req.json_object && req.json_after.is_none() && !req.json_lead.is_empty())
                    .then(|| Lead::new(&req.json_lead, dsml, &self.special_bytes)),
                json_more: if req.json_object
                    && req.json_after.is_none()
                    && !req.json_lead.is_empty()
                {
                    req.json_more
                } else {
                    Vec::new()
                },
                objects: 0,
                dsml: req.dsml,
                json_after: req.json_after.filter(|_| req.json_object),
            },
        );
    }

    /// Stops a request now; its output (finish reason `Cancelled`) comes out of
    /// [`Engine::take_finished`]. Unknown or finished ids are ignored.
    pub fn abort(&mut self, id: u64) {
        if self.live.contains_key(&id) {
            self.retire(id, FinishReason::Cancelled, Instant::now());
        }
    }

    /// The text a live request has produced so far (it only grows; `None` once finished or
    /// without a tokenizer it is empty).
    pub fn text_so_far(&self, id: u64) -> Option<&str> {
        self.live.get(&id).map(|l| l.text.as_str())
    }

    /// How many tokens a live request has generated so far (None once finished).
    pub fn generated_so_far(&self, id: u64) -> Option<usize> {
        self.live
            .get(&id)
            .map(|l| l.tokens.len().saturating_sub(l.prompt_len))
    }

    /// The log-probabilities a live request has recorded so far (None once finished).
    pub fn logprobs_so_far(&self, id: u64) -> Option<&[TokenLogprob]> {
        self.live.get(&id).map(|l| l.logprobs.as_slice())
    }

    /// Requests finished since the last call, in the order they finished.
    pub fn take_finished(&mut self) -> Vec<RequestOutput> {
        std::mem::take(&mut self.finished)
    }

    /// Runs one step. A step with nothing to do (no request) returns an empty report. After a
    /// step that fails, no block computed before it is shared any more (prefix caching).
    pub fn step(&mut self) -> Result<StepReport, EngineError> {
        let r = self.step_inner();
        if r.is_err() {
            self.scheduler.poison_prefix_cache();
        }
        r
    }

    fn step_inner(&mut self) -> Result<StepReport, EngineError> {
        let _profile = cachalot_model::profile::Timer::start(cachalot_model::profile::Phase::Step);
        // The step's many short parallel regions find the other workers awake.
        let _warm = cachalot_kernels::KeepWarm::new();
        self.place_imports();
        let plan = self.scheduler.schedule();
        let mut report = StepReport {
            preempted: plan.preempted.len(),
            ..Default::default()
        };
        self.stats.preemptions += plan.preempted.len();
        for id in &plan.preempted {
            // Its KV is dropped; the recompute produces the hidden states again.
            if let Some(live) = self.live.get_mut(id) {
                live.mtp_pending = None;
            }
            self.slots.release(*id);
        }
        if plan.is_empty() {
            debug_assert!(!self.scheduler.has_unfinished(), "the scheduler stalled");
            return Ok(report);
        }
        let spec = self.next_n > 0;
        let drafts = if spec {
            let t0 = Instant::now();
            let (d, prompt_share) = self.propose(&plan.items)?;
            report.draft_s = t0.elapsed().as_secs_f64();
            report.draft_prompt_s = report.draft_s * prompt_share;
            d
        } else {
            Vec::new()
        };
        let now = Instant::now();
        let mut batch = Batch::default();
        let mut tokens = Vec::new();
        for (n, it) in plan.items.iter().enumerate() {
            let live = self
                .live
                .get_mut(&it.id)
                .expect("scheduled requests are live");
            live.first_scheduled.get_or_insert(now);
            // The first admission only: a request preempted and admitted again takes back its
            // own blocks, which is recomputation saved, not a prompt shared (the figures are the
            // per-request `cached_tokens` summed).
            if it.admitted && self.stats.prefix_caching && live.cached_tokens.is_none() {
                live.cached_tokens = Some(it.cached);
                self.stats.prefix_cached_tokens += it.cached.min(live.prompt_len);
                if live.top_prompt_logprobs.is_none() {
                    self.stats.prefix_query_tokens += live.prompt_len;
                }
            }
            let ds = drafts.get(n).map_or(&[][..], Vec::as_slice);
            let want = if !ds.is_empty() || Self::prompt_rows(live, it) > 0 {
                LogitsWanted::All
            } else if it.sample {
                LogitsWanted::Last
            } else {
                LogitsWanted::None
            };
            tokens.clear();
            tokens.extend_from_slice(&live.tokens[it.start..it.start + it.len]);
            tokens.extend(ds.iter().map(|d| d.token));
            batch.push_seq(
                &tokens,
                it.start,
                self.scheduler.block_table(it.id).to_vec(),
                want,
            );
            self.slots.name(&mut batch, it.id, &self.scheduler);
            // Prompt or generated positions (the scheduler never mixes them in one item): each
            // kind computed one way, so chunking, prefix caching and recompute leave bits alone.
            if it.start + it.len <= live.prompt_len {
                batch.mark_prefill();
            } else if it.start >= live.prompt_len {
                batch.mark_generated();
            }
            if it.decode {
                report.decode_tokens += it.len;
            } else {
                report.prefill_tokens += it.len;
            }
            report.drafted += ds.len();
        }
        report.seqs = plan.items.len();
        let t0 = Instant::now();
        let (logits, hidden) = if spec {
            let out = self.model.forward_with_hidden(&batch, &mut self.cache)?;
            (out.logits, Some(out.hidden))
        } else {
            (self.model.forward(&batch, &mut self.cache)?, None)
        };
        report.forward_s = t0.elapsed().as_secs_f64();
        check_logits(&logits, "the model")?;
        // Prompt chunks: their rows' MTP pass now, before sampling (module docs); their hidden
        // states are kept here rather than after sampling (a chunk has no drafts, so every row
        // of it is valid).
        let mut kept_early = Vec::new();
        // Prompt chunks of answers no draft follows: their hidden states are not kept at all.
        let mut no_mtp = Vec::new();
        if let Some(h) = &hidden {
            let lookahead = self.scheduler.kv().prefix_lookahead() > 0;
            for (n, it) in plan.items.iter().enumerate() {
                let Some(live) = self.live.get(&it.id) else {
                    continue;
                };
                if it.decode || it.start + it.len > live.prompt_len {
                    continue;
                }
                // (Not for an answer of one token or none that nothing shares or exports: no
                // draft follows it.)
                let drafts_follow =
                    live.stop.max_new_tokens > 1 || lookahead || self.exporting.contains(&it.id);
                if !drafts_follow {
                    no_mtp.push(it.id);
                    continue;
                }
                self.keep_hidden(it.id, it.start, it.len, &batch, n, h);
                kept_early.push(it.id);
            }
            if !kept_early.is_empty() {
                let t = Instant::now();
                self.prompt_catch_up(&kept_early)?;
                let spent = t.elapsed().as_secs_f64();
                report.draft_s += spent;
                report.draft_prompt_s += spent;
            }
        }
        let vocab = self.model.vocab_size();
        let mut rows = logits.chunks_exact(vocab);
        // Requests that end this step, retired after the loop.
        let mut ended: Vec<(u64, FinishReason)> = Vec::new();
        let short =
            || EngineError::Request("the model returned fewer logits rows than asked".into());
        for (n, it) in plan.items.iter().enumerate() {
            let ds = drafts.get(n).map_or(&[][..], Vec::as_slice);
            // Rows of this item's tokens whose KV (and hidden state) is now valid.
            let mut valid = it.len;
            let mut finished = false;
            // Why the request ends, if it does (it retires once its hidden states are kept).
            let mut ends = None;
            // A prompt chunk whose prompt log-probabilities are wanted: every row but the
            // sampled one scores the prompt token after it.
            let live = self.live.get_mut(&it.id).expect("live");
            if Self::prompt_rows(live, it) > 0 {
                let k = live.top_prompt_logprobs.unwrap_or(0);
                let scored = it.len - usize::from(it.sample);
                for (j, row) in rows.by_ref().take(scored).enumerate() {
                    let next = it.start + j + 1;
                    if next < live.prompt_len && next == live.prompt_logprobs.len() + 1 {
                        let t = live.tokens[next];
                        live.prompt_logprobs
                            .push(TokenLogprob::from_logits(row, t, k));
                    }
                }
            }
            if it.sample {
                self.stats.sample_steps += 1;
                let mut accepted = 0;
                let mut done = false;
                if let Some(live) = self.live.get_mut(&it.id) {
                    live.drafted += ds.len();
                }
                for (j, row) in rows.by_ref().take(ds.len() + 1).enumerate() {
                    if done {
                        continue;
                    }
                    let live = self.live.get_mut(&it.id).expect("live");
                    // JSON mode: only tokens that keep the answer one JSON object.
                    let bytes = self.token_bytes.as_deref().unwrap_or_default();
                    let masked = match (&live.json, &live.lead) {
                        (Some(state), _) => {
                            let stop = &live.stop.stop_token_ids;
                            Some(json_mask(
                                row,
                                state,
                                stop,
                                bytes,
                                &self.special_bytes,
                                (&self.string_safe, &self.value_safe),
                            ))
                        }
                        (None, Some(lead)) => Some(lead_mask(
                            row,
                            lead,
                            bytes,
                            &self.special_bytes,
                            &live.stop.stop_token_ids,
                        )),
                        (None, None) => None,
                    };
                    // min_tokens: no stop token before that many generated tokens.
                    let generated = live.tokens.len() - live.prompt_len;
                    let stops = &live.stop.stop_token_ids;
                    // Where nothing but a stop token may follow (a JSON answer complete), it
                    // yields: the answer ends as it would without it.
                    let masked =
                        if generated < live.sampler.params().min_tokens && !stops.is_empty() {
                            let mut r = masked.as_deref().unwrap_or(row).to_vec();
                            for &t in stops {
                                if let Some(x) = r.get_mut(t as usize) {
                                    *x = f32::NEG_INFINITY;
                                }
                            }
                            if r.iter().any(|x| x.is_finite()) {
                                Some(r)
                            } else {
                                masked
                            }
                        } else {
                            masked
                        };
                    let raw = row;
                    // The request's own masks (allowed_token_ids, bad_words) on top: what they
                    // leave is what may be drawn.
                    let own_masked = live.sampler.has_masks().then(|| {
                        let mut r = masked.as_deref().unwrap_or(row).to_vec();
                        live.sampler.apply_masks(&mut r);
                        r
                    });
                    let masked = own_masked.or(masked);
                    let row = masked.as_deref().unwrap_or(row);
                    if masked.is_some() && !row.iter().any(|x| x.is_finite()) {
                        // No token continues it (nor may it stop): it ends here.
                        ends = Some(FinishReason::Length);
                        report.finished += 1;
                        finished = true;
                        done = true;
                        continue;
                    }
                    let (token, ok) = match ds.get(j) {
                        Some(d) => live.sampler.verify(d.token, row),
                        None => (live.sampler.sample(row), false),
                    };
                    if let Some(k) = live.top_logprobs {
                        live.logprobs.push(TokenLogprob::from_logits(raw, token, k));
                    }
                    report.sampled += 1;
                    if ok {
                        accepted += 1;
                        live.accepted += 1;
                    }
                    // (Timed once drawn: a token exists after its sampling, which TTFT counts.)
                    if let Some(reason) = self.push_token(it.id, token, Instant::now())? {
                        ends = Some(reason);
                        report.finished += 1;
                        finished = true;
                        done = true;
                    } else if !ok {
                        done = true;
                    }
                }
                if !done {
                    return Err(short());
                }
                if !ds.is_empty() {
                    report.accepted += accepted;
                    self.stats.verify_steps += 1;
                }
                valid += accepted;
                if !finished && it.drafts > 0 {
                    self.scheduler.accept_drafts(it.id, accepted);
                }
                // The step's tokens, also of a request that ends (its last block's key may
                // take the token after it, prefix caching with MTP).
                let known = self.scheduler.num_known_tokens(it.id);
                self.scheduler
                    .append_token_ids(it.id, &self.live[&it.id].tokens[known..]);
            }
            // A request that ends keeps them only to hand them over with its KV, or for the
            // MTP catch-up of its last prompt rows as it retires (prefix caching).
            let keep = !finished
                || self.exporting.contains(&it.id)
                || self.scheduler.kv().prefix_lookahead() > 0;
            let keep = keep && !kept_early.contains(&it.id) && !no_mtp.contains(&it.id);
            if let (Some(h), true) = (&hidden, keep) {
                self.keep_hidden(it.id, it.start, valid, &batch, n, h);
            }
            if let Some(reason) = ends {
                ended.push((it.id, reason));
            }
        }
        // Requests that end retire together, after one MTP catch-up of the prompt rows they
        // would otherwise leave unshared (their answers ended before it: it is not their time).
        let ended_at = Instant::now();
        let catch_up: Vec<u64> = ended
            .iter()
            .filter(|(_, r)| *r != FinishReason::Cancelled)
            .map(|&(id, _)| id)
            .collect();
        self.catch_up_prompt_rows(&catch_up)?;
        for (id, reason) in ended {
            self.retire(id, reason, ended_at);
        }
        report.kv_used_blocks = self.scheduler.kv().pool().num_used();
        let s = &mut self.stats;
        s.steps += 1;
        s.prefill_tokens += report.prefill_tokens;
        s.decode_tokens += report.decode_tokens;
        s.sampled_tokens += report.sampled;
        s.drafted += report.drafted;
        s.accepted_drafts += report.accepted;
        s.forward_s += report.forward_s;
        s.draft_s += report.draft_s - report.draft_prompt_s;
        let step_s = report.forward_s + report.draft_s;
        if report.prefill_tokens > 0 {
            s.prefill_step_s += step_s;
        } else {
            // The MTP pass over a prompt belongs to its prefill (module docs).
            s.prefill_step_s += report.draft_prompt_s;
            s.decode_step_s += step_s - report.draft_prompt_s;
            s.decode_steps += 1;
            s.decode_sampled += report.sampled;
        }
        s.kv_peak_blocks = self.scheduler.kv().peak_used();
        Ok(report)
    }

    /// How many prompt tokens after `it`'s positions still want their log-probability scored
    /// by this step (0 for decode steps and requests that did not ask).
    fn prompt_rows(live: &Live, it: &Scheduled) -> usize {
        if it.decode || live.top_prompt_logprobs.is_none() {
            return 0;
        }
        let done = live.prompt_logprobs.len() + 1;
        let end = (it.start + it.len).min(live.prompt_len);
        end.saturating_sub(done.max(it.start + 1))
    }

    /// Keeps the hidden states of the first `valid` tokens of item `n` of `batch` (request
    /// `id`, starting at position `start`) for the next step's MTP catch-up.
    fn keep_hidden(
        &mut self,
        id: u64,
        start: usize,
        valid: usize,
        batch: &Batch,
        n: usize,
        hidden: &[f32],
    ) {
        let Some(live) = self.live.get_mut(&id) else {
            return;
        };
        if valid == 0 {
            return;
        }
        let h = hidden.len() / batch.num_tokens().max(1);
        let rows = &hidden[batch.seq_starts[n] * h..(batch.seq_starts[n] + valid) * h];
        match &mut live.mtp_pending {
            Some(p) if p.first + p.rows == start => {
                p.hidden.extend_from_slice(rows);
                p.rows += valid;
            }
            slot => {
                *slot = Some(Pending {
                    first: start,
                    rows: valid,
                    hidden: rows.to_vec(),
                })
            }
        }
    }

    /// Steps 1–2 of speculative decoding (module docs): the MTP catch-up of every running
    /// request with hidden states pending, then the drafts of the scheduled decode items
    /// (`drafts` slots each), as one list per plan item; with it, the share of the work that
    /// was prompt positions (catch-up rows of the prompt over all rows forwarded).
    fn propose(&mut self, items: &[Scheduled]) -> Result<(Vec<Vec<Draft>>, f64), EngineError> {
        let mut out: Vec<Vec<Draft>> = items.iter().map(|_| Vec::new()).collect();
        // Which plan item (with drafts) each request is.
        let mut item_of: HashMap<u64, usize> = HashMap::new();
        for (n, it) in items.iter().enumerate() {
            if it.drafts > 0 {
                item_of.insert(it.id, n);
            }
        }
        let mut ids: Vec<u64> = self
            .live
            .iter()
            // Not prefilled requests still waiting for their blocks.
            .filter(|(id, l)| {
                l.mtp_pending.is_some()
                    && self.scheduler.phase(**id) == Some(crate::scheduler::Phase::Running)
            })
            .map(|(&id, _)| id)
            .collect();
        if ids.is_empty() {
            return Ok((out, 0.0));
        }
        ids.sort_unstable();
        let (mut prompt_rows, mut rows) = (0usize, 0usize);
        let mut batch = Batch::default();
        let mut prev = Vec::new();
        // (plan item, request, sequence in the batch) of each logits row, in order.
        let mut drafting: Vec<(usize, u64, usize)> = Vec::new();
        // (request, first position, end) of each catch-up, for the scheduler once it ran.
        let mut caught: Vec<(u64, usize, usize)> = Vec::with_capacity(ids.len());
        for (s, &id) in ids.iter().enumerate() {
            let live = self.live.get_mut(&id).expect("listed");
            let mut p = live.mtp_pending.take().expect("listed");
            // Rows of prompt positions and of generated ones run apart, each kind one way (as
            // the main model's positions do), so a row's bits do not depend on how the
            // catch-ups were cut (a prefix cache shares them): rows spanning the prompt's end
            // run the prompt's now and the rest next step.
            let pl = live.prompt_len;
            if p.first < pl && p.first + p.rows > pl {
                let k = pl - p.first;
                let h = p.hidden.len() / p.rows;
                live.mtp_pending = Some(Pending {
                    first: pl,
                    rows: p.rows - k,
                    hidden: p.hidden.split_off(k * h),
                });
                p.rows = k;
            }
            rows += p.rows;
            // A prompt's last row alone (its other rows ran in their own steps) gives draft 1:
            // decode work, not the prompt's, computed as a generated position is (the absorbed
            // path: no up-projection of the whole context for one row); it is always alone
            // here, so always computed this way.
            let last_row_alone = p.first + 1 == pl && p.rows == 1;
            if !last_row_alone {
                prompt_rows += live.prompt_len.saturating_sub(p.first).min(p.rows);
            }
            let n = item_of.get(&id).copied();
            // Draft only when the rows end right before the item's known token.
            let want = match n {
                Some(n) if p.first + p.rows == items[n].start => {
                    drafting.push((n, id, s));
                    LogitsWanted::Last
                }
                _ => LogitsWanted::None,
            };
            batch.push_seq(
                &live.tokens[p.first + 1..p.first + p.rows + 1],
                p.first,
                self.scheduler.block_table(id).to_vec(),
                want,
            );
            self.slots.name(&mut batch, id, &self.scheduler);
            if p.first < pl && !last_row_alone {
                batch.mark_prefill();
            } else {
                batch.mark_generated();
            }
            prev.extend_from_slice(&p.hidden);
            caught.push((id, p.first, p.first + p.rows));
        }
        let r = self.model.mtp_forward(0, &batch, &prev, &mut self.cache)?;
        check_logits(&r.logits, "the MTP layer")?;
        for (id, first, end) in caught {
            self.scheduler.mtp_computed(id, first, end);
        }
        let vocab = self.model.vocab_size();
        let h = prev.len() / batch.num_tokens();
        // Chain state per drafting request: (plan item, request, last hidden row).
        let mut chain: Vec<(usize, u64, Vec<f32>)> = Vec::with_capacity(drafting.len());
        for (k, &(n, id, s)) in drafting.iter().enumerate() {
            let last = batch.seq_starts[s + 1] - 1;
            let live = self.live.get_mut(&id).expect("live");
            let token = live.sampler.propose(&r.logits[k * vocab..(k + 1) * vocab]);
            out[n].push(Draft { token });
            chain.push((n, id, r.hidden[last * h..(last + 1) * h].to_vec()));
        }
        let most = drafting
            .iter()
            .map(|&(n, _, _)| items[n].drafts)
            .max()
            .unwrap_or(0);
        for j in 2..=most {
            chain.retain(|&(n, _, _)| items[n].drafts >= j);
            let mut b = Batch::default();
            let mut prev = Vec::with_capacity(chain.len() * h);
            for (n, id, hid) in &chain {
                let it = &items[*n];
                b.push_seq(
                    &[out[*n][j - 2].token],
                    it.start + j - 2,
                    self.scheduler.block_table(*id).to_vec(),
                    LogitsWanted::Last,
                );
                self.slots.name(&mut b, *id, &self.scheduler);
                b.mark_generated();
                prev.extend_from_slice(hid);
            }
            rows += chain.len();
            let r = self.model.mtp_forward(0, &b, &prev, &mut self.cache)?;
            check_logits(&r.logits, "the MTP layer")?;
            for (k, (n, id, hid)) in chain.iter_mut().enumerate() {
                let live = self.live.get_mut(id).expect("live");
                let token = live.sampler.propose(&r.logits[k * vocab..(k + 1) * vocab]);
                out[*n].push(Draft { token });
                hid.copy_from_slice(&r.hidden[k * h..(k + 1) * h]);
            }
        }
        Ok((out, prompt_rows as f64 / rows.max(1) as f64))
    }

    /// Records one generated token; returns why the request ends, if it does.
    fn push_token(
        &mut self,
        id: u64,
        token: u32,
        at: Instant,
    ) -> Result<Option<FinishReason>, EngineError> {
        let live = self.live.get_mut(&id).expect("live");
        live.sampler.accept(token);
        live.tokens.push(token);
        let mut json_done = false;
        // A lead's object completed with more allowed after it: the next lead, and the bytes
        // of the token after the object's end.
        let mut more = None;
        let gated = live.json.is_none() && live.json_after.is_some();
        if let Some(state) = live.json.as_mut() {
            if !live.stop.stop_token_ids.contains(&token) {
                let bytes = self.token_bytes.as_deref().unwrap_or_default();
                let b = state.token_bytes(token, bytes, &self.special_bytes);
                // (What may follow is looked up only once the object closes.)
                if let Some(rest) = feed_to_end(state, b) {
                    match next_leads(&live.json_more, live.objects) {
                        Some(next) => more = Some((next, rest)),
                        None => {
                            state.feed_all(&rest);
                        }
                    }
                }
                // Complete, with no stop token to end it: it ends now (as a stop).
                json_done = more.is_none()
                    && state.is_complete()
                    && !state.can_continue()
                    && live.stop.stop_token_ids.is_empty();
            }
        }
        live.first_token.get_or_insert(at);
        live.last_token = Some(at);
        let n_out = live.tokens.len() - live.prompt_len;
        let mut finish = None;
        if live.eos_at.is_none() && live.stop.stop_token_ids.contains(&token) {
            live.eos_at = Some(n_out);
            live.stopped = Some(FinishReason::StopToken(token));
            if !live.ignore_eos {
                finish = Some(FinishReason::StopToken(token));
                // vLLM's `include_stop_str_in_output` keeps the stop token's text too (none
                // for a special token whose text is skipped).
                if live.stop.include_stop_str {
                    if let Some(stream) = live.stream.as_mut() {
                        stream.set_stop_armed(false);
                        let (piece, _) = stream.push(token)?;
                        live.text.push_str(&piece);
                    }
                }
            }
        } else if live.eos_at.is_none() {
            if let Some(stream) = live.stream.as_mut() {
                // vLLM's rule: the text of the first min_tokens tokens is not searched.
                stream.set_stop_armed(n_out > live.sampler.params().min_tokens);
                let (piece, hit) = stream.push(token)?;
                live.text.push_str(&piece);
                if let Some(hit) = hit {
                    if live.stop.include_stop_str {
                        live.text.push_str(&hit);
                    }
                    live.eos_at = Some(n_out);
                    live.stopped = Some(FinishReason::StopString(hit.clone()));
                    if !live.ignore_eos {
                        finish = Some(FinishReason::StopString(hit));
                    }
                }
            }
        }
        // JSON mode after a lead: it starts within the token that completes the lead.
        if let Some(lead) = live.lead.as_mut() {
            let bytes = self.token_bytes.as_deref().unwrap_or_default();
            match lead.push(lead_bytes(token, bytes, &self.special_bytes).0) {
                None => {}
                Some(LeadDone::Free) => live.lead = None,
                Some(LeadDone::Json(mut g, rest)) => {
                    // (The token may close the object too, as `{}` does.)
                    if let Some(rest) = rest {
                        match next_leads(&live.json_more, live.objects) {
                            Some(next) => more = Some((next, rest)),
                            None => {
                                g.feed_all(&rest);
                                json_done =
                                    !g.can_continue() && live.stop.stop_token_ids.is_empty();
                            }
                        }
                    }
                    (live.json, live.lead) = (Some(*g), None);
                }
                Some(LeadDone::End) => {
                    live.lead = None;
                    if finish.is_none() {
                        finish = Some(FinishReason::StopString(String::new()));
                    }
                }
            }
        }
        // The object after a lead is complete and more may follow: the next lead (what the
        // token wrote after the object starts it, where it begins one of its texts; else it
        // stays the object's trailing whitespace).
        if let Some((next, rest)) = more {
            let more = live.dsml && !live.json_more.is_empty();
            let mut lead = Lead::new(&next, (live.dsml, more), &self.special_bytes);
            lead.stop_ok = true;
            if !rest.is_empty() && lead.options.iter().any(|o| o.starts_with(&rest)) {
                lead.written = rest;
            }
            live.objects += 1;
            (live.json, live.lead) = (None, Some(lead));
        }
        // JSON mode after a gate: it starts with the token after the one that completed it.
        if gated
            && live
                .json_after
                .as_ref()
                .is_some_and(|g| live.text.contains(g.as_str()))
        {
            live.json = Some(Grammar::new(&live.schema));
            live.json_after = None;
        }
        if finish.is_none() && json_done {
            finish = Some(FinishReason::StopString(String::new()));
        }
        if finish.is_none() && n_out >= live.stop.max_new_tokens {
            finish = Some(FinishReason::Length);
        }
        Ok(finish)
    }

    /// The MTP pass over the prompt rows `ids` have pending whose next token is a prompt token
    /// (all but a prompt's last row), in one batched forward; what stays pending is the rest.
    fn prompt_catch_up(&mut self, ids: &[u64]) -> Result<(), EngineError> {
        // Row r pairs token r + 1 with the hidden state at r: prompt tokens up to prompt_len - 1.
        let caught = self.mtp_catch_up(ids, |live, p| {
            (p.first + p.rows).min(live.prompt_len.saturating_sub(1))
        })?;
        for (id, first, end) in caught {
            let live = self.live.get_mut(&id).expect("caught");
            let p = live.mtp_pending.as_mut().expect("caught");
            let h = p.hidden.len() / p.rows;
            let done = end - first;
            if done == p.rows {
                live.mtp_pending = None;
            } else {
                p.hidden.drain(..done * h);
                p.first = end;
                p.rows -= done;
            }
        }
        Ok(())
    }

    /// One batched MTP forward over the pending rows of `ids` from their first to `end_of`'s
    /// position (exclusive; requests with nothing there are left out), marked as prompt rows,
    /// without logits: the (request, first, end) of each range run.
    fn mtp_catch_up(
        &mut self,
        ids: &[u64],
        end_of: impl Fn(&Live, &Pending) -> usize,
    ) -> Result<Vec<(u64, usize, usize)>, EngineError> {
        if ids.is_empty() || self.next_n == 0 {
            return Ok(Vec::new());
        }
        let mut batch = Batch::default();
        let mut prev = Vec::new();
        let mut caught = Vec::new();
        for &id in ids {
            let Some(live) = self.live.get(&id) else {
                continue;
            };
            let Some(p) = &live.mtp_pending else {
                continue;
            };
            let end = end_of(live, p);
            if p.first >= end || live.tokens.len() <= end {
                continue;
            }
            let h = p.hidden.len() / p.rows;
            batch.push_seq(
                &live.tokens[p.first + 1..end + 1],
                p.first,
                self.scheduler.block_table(id).to_vec(),
                LogitsWanted::None,
            );
            self.slots.name(&mut batch, id, &self.scheduler);
            batch.mark_prefill();
            prev.extend_from_slice(&p.hidden[..(end - p.first) * h]);
            caught.push((id, p.first, end));
        }
        if caught.is_empty() {
            return Ok(caught);
        }
        self.model.mtp_forward(0, &batch, &prev, &mut self.cache)?;
        for &(id, first, end) in &caught {
            self.scheduler.mtp_computed(id, first, end);
        }
        Ok(caught)
    }

    /// With MTP and prefix caching: requests that end before the MTP catch-up of their last
    /// prompt rows (a prefill server's requests, which export them; answers of one token) run
    /// it now, in one forward, up to their last whole prompt block (or, where generated blocks
    /// are shared, their last whole block of computed positions), so those blocks can be
    /// shared too (its time counts as prefill). Call before they retire.
    fn catch_up_prompt_rows(&mut self, ids: &[u64]) -> Result<(), EngineError> {
        if self.scheduler.kv().prefix_lookahead() == 0 {
            return Ok(());
        }
        let t0 = Instant::now();
        let bs = self.scheduler.kv().block_size();
        let shares_generated = self.scheduler.shares_generated();
        // Up to the last whole block that may be offered: of the prompt, or where generated
        // blocks are shared, of the positions computed (the last token is never fed).
        let caught = self.mtp_catch_up(ids, |live, p| {
            let offered = if shares_generated {
                live.tokens.len() - 1
            } else {
                live.prompt_len
            };
            (p.first + p.rows).min(offered / bs * bs)
        })?;
        if !caught.is_empty() {
            self.stats.prefill_step_s += t0.elapsed().as_secs_f64();
        }
        Ok(())
    }

    /// Moves a request out of the scheduler (freeing its blocks) into the finished list; `end`
    /// is when its answer ended.
    fn retire(&mut self, id: u64, finish: FinishReason, end: Instant) {
        let preemptions = self.scheduler.num_preemptions(id);
        let kv = if self.exporting.remove(&id) && finish != FinishReason::Cancelled {
            self.snapshot(id)
        } else {
            None
        };
        self.scheduler.finish(id);
        self.slots.release(id);
        self.imports.retain(|(i, _)| *i != id);
        let Some(mut live) = self.live.remove(&id) else {
            return;
        };
        // What the stream still holds is output (a tail that could have started a stop string,
        // or an unfinished character) unless a stop string ended the text. After an EOS the
        // stream got no more tokens, so this is the text up to the EOS.
        // (A stop string's held-back tail is the stop string's start, not output.)
        if !matches!(live.stopped, Some(FinishReason::StopString(_))) {
            if let Some(stream) = live.stream.as_mut() {
                if let Ok((piece, _)) = stream.finish() {
                    live.text.push_str(&piece);
                }
            }
        }
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
            cached_tokens: live.cached_tokens.unwrap_or(0),
        };
        // Under ignore_eos a request whose text ended at a stop goes on to its length; its
        // finish is that stop, as the seed's offline runs report it (its text and
        // valid_tokens end there).
        let finish = match (finish, live.stopped.take()) {
            (FinishReason::Length, Some(stop)) => stop,
            (finish, _) => finish,
        };
        self.finished.push(RequestOutput {
            id,
            prompt: live.tokens,
            valid_tokens: live.eos_at.unwrap_or(n_out),
            tokens: output,
            text: live.text,
            finish,
            timing,
            drafted: live.drafted,
            accepted_drafts: live.accepted,
            logprobs: live.logprobs,
            prompt_logprobs: live.prompt_logprobs,
            kv,
        });
    }

    /// What [`Engine::add_prefilled`] needs to continue request `id` elsewhere: the KV of its
    /// prompt and its first token; None unless exactly those are known and computed.
    fn snapshot(&self, id: u64) -> Option<Box<KvSnapshot>> {
        let live = self.live.get(&id)?;
        let n = live.prompt_len;
        if live.tokens.len() != n + 1 || self.scheduler.num_computed(id) != n {
            return None;
        }
        let table = self.scheduler.block_table(id);
        let slot = if self.slots.on {
            Some(*self.slots.of.get(&id)? as usize)
        } else {
            None
        };
        let layers = (0..self.cache.spec().layers)
            .map(|l| {
                let mut rows = Vec::new();
                self.cache.read_rows(l, table, n, &mut rows);
                if let Some(slot) = slot {
                    self.cache.read_state(l, slot, &mut rows);
                }
                rows
            })
            .collect();
        let mtp = if self.next_n > 0 {
            match &live.mtp_pending {
                Some(p) if p.first + p.rows == n => Some(MtpRows {
                    first: p.first,
                    rows: p.rows,
                    hidden: p.hidden.clone(),
                }),
                _ => return None,
            }
        } else {
            None
        };
        Some(Box::new(KvSnapshot {
            spec: self.cache.spec(),
            prompt: live.tokens[..n].to_vec(),
            params: live.sampler.params().clone(),
            first_token: live.tokens[n],
            first_logprob: live.logprobs.first().cloned(),
            prompt_logprobs: live.prompt_logprobs.clone(),
            layers,
            mtp,
            rng: live.sampler.rng_state(),
        }))
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

/// The fields in which two caches differ, in words ("the float part in bf16 there, f32 here").
fn spec_differences(there: &CacheSpec, here: &CacheSpec) -> String {
    let mut d = Vec::new();
    if there.float != here.float {
        d.push(format!(
            "values in {} there (the prefill server's --kv-cache-dtype), {} here",
            there.float.name(),
            here.float.name()
        ));
    }
    for (a, b, what) in [
        (there.layers, here.layers, "cache layers"),
        (there.width, here.width, "values per token and layer"),
        (
            there.int8_width,
            here.int8_width,
            "of them int8 (a C8 cache)",
        ),
        (
            there.seq_state_width,
            here.seq_state_width,
            "values of per-sequence state (DeepSeek-V4's --v4-cache)",
        ),
    ] {
        if a != b {
            d.push(format!("{a} {what} there, {b} here"));
        }
    }
    d.join("; ")
}

/// The sampling fields in which the prefill side's request differs from this one's.
fn params_differences(there: &SamplingParams, here: &SamplingParams) -> String {
    let (a, b) = (
        serde_json::to_value(there).unwrap_or_default(),
        serde_json::to_value(here).unwrap_or_default(),
    );
    let (Some(a), Some(b)) = (a.as_object(), b.as_object()) else {
        return "other sampling".into();
    };
    let mut keys: Vec<&String> = a.keys().chain(b.keys()).collect();
    keys.sort();
    keys.dedup();
    // (f32 fields as the request gave them: 0.6, not 0.6000000238418579.)
    let show = |v: Option<&serde_json::Value>| match v.and_then(serde_json::Value::as_f64) {
        Some(x) if v.is_some_and(|v| v.is_f64()) => format!("{}", x as f32),
        _ => v.map_or("none".to_string(), |v| v.to_string()),
    };
    let d: Vec<String> = keys
        .into_iter()
        .filter(|k| a.get(*k) != b.get(*k))
        .map(|k| format!("{k} {} there, {} here", show(a.get(k)), show(b.get(k))))
        .collect();
    if d.is_empty() {
        "other sampling".into()
    } else {
        d.join(", ")
    }
}

#[cfg(test)]
mod tests {
    use super::{
        lead_mask, next_leads, params_differences, After, Grammar, JsonLead, Lead, LeadDone, Spec,
        TokenLogprob,
    };
    use crate::dsml_args::DsmlSpec;
    use std::collections::HashMap;

    #[test]
    fn logprobs_are_the_log_softmax_with_the_most_likely_first() {
        let logits = [1.0f32, 3.0, f32::NAN, 3.0, -2.0, f32::NEG_INFINITY];
        let lse = logits
            .iter()
            .filter(|x| x.is_finite())
            .map(|&x| (x as f64).exp())
            .sum::<f64>()
            .ln();
        let e = TokenLogprob::from_logits(&logits, 4, 3);
        assert!((e.logprob as f64 - (-2.0 - lse)).abs() < 1e-6, "{e:?}");
        // Ties to the lower id; NaN and −∞ last, as impossible.
        let ids: Vec<u32> = e.top.iter().map(|t| t.0).collect();
        assert_eq!(ids, vec![1, 3, 0]);
        assert!((e.top[0].1 as f64 - (3.0 - lse)).abs() < 1e-6);
        let all = TokenLogprob::from_logits(&logits, 2, 10);
        assert_eq!(all.logprob, f32::MIN);
        assert_eq!(all.top.len(), 6);
        assert_eq!(all.top[5].1, f32::MIN);
        let total: f64 = all.top.iter().map(|t| (t.1 as f64).exp()).sum();
        assert!((total - 1.0).abs() < 1e-6, "{total}");
        assert!(TokenLogprob::from_logits(&logits, 1, 0).top.is_empty());
        // Ranks count the tokens at least as likely (ties ahead); an impossible token's is
        // the vocabulary's size.
        let ranks: Vec<u32> = [1u32, 3, 0, 4, 5, 2]
            .iter()
            .map(|&t| TokenLogprob::from_logits(&logits, t, 0).rank)
            .collect();
        assert_eq!(ranks, vec![2, 2, 3, 4, 6, 6]);
    }

    /// A JSON lead keeps the answer on one of its texts, lets a token finish one and begin
    /// the object, takes special tokens by their text, and hands over the JSON's start.
    #[test]
    fn a_json_lead_keeps_to_its_texts() {
        let mut lead = Lead {
            then: vec![After::Json(Spec::Object), After::Json(Spec::Object)],
            options: vec![
                b"get_time\n```json\n".to_vec(),
                b"get_weather\n```json\n".to_vec(),
            ],
            spans: vec![Vec::new(); 2],
            written: Vec::new(),
            stop_ok: false,
        };
        assert!(lead.allows(b"get", false));
        assert!(lead.allows(b"get_weather\n```json\n{", false));
        assert!(!lead.allows(b"set", false));
        assert!(!lead.allows(b"", false));
        assert!(lead.push(b"get_").is_none());
        assert!(lead.allows(b"time", false));
        assert!(!lead.allows(b"tim e", false));
        assert!(lead.push(b"weather\n```").is_none());
        // Finishing the lead inside a token: what follows must begin a JSON object.
        assert!(lead.allows(b"json\n{\"", false));
        assert!(!lead.allows(b"json\nx", false));
        let Some(LeadDone::Json(mut json, None)) = lead.push(b"json\n{\"") else {
            panic!("the lead is complete");
        };
        assert!(json.feed_all(b"k\": 1}") && json.is_complete());
        // A lead with free text after it (DeepSeek-V4's DSML parameters).
        let mut free = Lead {
            then: vec![After::Free],
            options: vec![b"f\">\n".to_vec()],
            spans: vec![Vec::new()],
            written: Vec::new(),
            stop_ok: false,
        };
        assert!(free.allows(b"f\">\n<x", false));
        assert!(!free.allows(b"g", false));
        assert!(matches!(free.push(b"f\">\n<x"), Some(LeadDone::Free)));
        // After a call's arguments: another call or the section's end, which ends the answer
        // (nothing may follow it in the token that writes it).
        let more_leads = || {
            vec![
                JsonLead {
                    text: "]\n[get\n".into(),
                    schema: None,
                    then_json: true,
                    ends: false,
                },
                JsonLead {
                    text: "]]".into(),
                    schema: None,
                    then_json: false,
                    ends: true,
                },
            ]
        };
        let mut more = Lead::new(&more_leads(), (false, false), &HashMap::new());
        assert!(
            more.allows(b"]", false)
                && more.allows(b"]]", false)
                && more.allows(b"]\n[get\n{", false)
        );
        assert!(!more.allows(b"]]x", false) && !more.allows(b"]\n[get\nx", false));
        assert!(more.push(b"]").is_none());
        assert!(matches!(more.push(b"]"), Some(LeadDone::End)));
        // A token that ends a lead and closes its object too (`{}`): the grammar complete, the
        // bytes after the object handed back (for the next lead), not fed.
        let mut both = Lead::new(&more_leads()[..1], (false, false), &HashMap::new());
        let Some(LeadDone::Json(json, Some(rest))) = both.push(b"]\n[get\n{} ") else {
            panic!("the lead and its object are complete");
        };
        assert!(json.is_complete() && rest == b" ");
        assert_eq!(next_leads(&[], 0), None);
        let list = vec![more_leads(), Vec::new()];
        assert_eq!(next_leads(&list, 0).map(|l| l.len()), Some(2));
        assert_eq!(next_leads(&list, 1), None);
        assert_eq!(next_leads(&list, 7), None);
        let specials: HashMap<u32, Vec<u8>> = [(7, b"<|arg|>".to_vec())].into();
        let mut bytes = vec![b"a".to_vec(); 8];
        // (An ordinary token that spells the special token's start.)
        bytes[6] = b"<|".to_vec();
        let lead_of = |text: &str| JsonLead {
            text: text.into(),
            schema: None,
            then_json: true,
            ends: false,
        };
        let mut lead = Lead::new(&[lead_of("a<|arg|>")], (false, false), &specials);
        assert_eq!(lead.spans, vec![vec![(1, 8)]]);
        lead.written = b"a".to_vec();
        lead.stop_ok = true;
        let row = vec![0.0f32; 8];
        let masked = lead_mask(&row, &lead, &bytes, &specials, &[]);
        assert!(masked[7].is_finite());
        assert!(masked[..7].iter().all(|x| x.is_infinite()));
        // Without the span (a tokenizer that does not mark it special) the spelling is taken.
        let plain = Lead::new(&[lead_of("a<|arg|>")], (false, false), &HashMap::new());
        assert!(plain.allows(b"a<|", false) && lead.allows(b"<|arg|>", true));
        assert!(
            !Lead::new(&[lead_of("a<|arg|>")], (false, false), &specials).allows(b"a<|", false)
        );
        assert!(lead_mask(&row, &lead, &bytes, &specials, &[7])[7].is_infinite());
        // A stop token where it may end the answer instead: only before the lead is begun.
        assert!(lead_mask(&row, &lead, &bytes, &specials, &[3])[3].is_infinite());
        lead.written.clear();
        assert!(lead_mask(&row, &lead, &bytes, &specials, &[3])[3].is_finite());
    }

    /// Differing sampling is said field by field, f32 values as written.
    #[test]
    fn sampling_differences_are_named_as_written() {
        let here = crate::SamplingParams {
            temperature: 0.6,
            top_p: 0.95,
            ..crate::SamplingParams::greedy()
        };
        let there = crate::SamplingParams {
            temperature: 1.0,
            ..crate::SamplingParams::greedy()
        };
        assert_eq!(
            params_differences(&there, &here),
            "temperature 1 there, 0.6 here, top_p 1 there, 0.95 here"
        );
    }

    /// DSML takes the special tokens that hold its marker by their text, and no other special
    /// token (`<think>` never goes into a value); JSON takes none.
    #[test]
    fn dsml_takes_only_its_markup_specials() {
        let bytes = vec![b"a".to_vec(), Vec::new(), Vec::new()];
        let specials: HashMap<u32, Vec<u8>> = [
            (1, b"<think>".to_vec()),
            (2, "<\u{ff5c}DSML\u{ff5c}".as_bytes().to_vec()),
        ]
        .into();
        let dsml = Grammar::new(&Spec::Dsml(DsmlSpec::any(), false));
        assert_eq!(dsml.token_bytes(0, &bytes, &specials), b"a");
        assert!(dsml.token_bytes(1, &bytes, &specials).is_empty());
        assert_eq!(dsml.token_bytes(2, &bytes, &specials), &specials[&2][..]);
        assert!(dsml
            .clone()
            .feed_all(dsml.token_bytes(2, &bytes, &specials)));
        let json = Grammar::new(&Spec::Object);
        assert!(json.token_bytes(2, &bytes, &specials).is_empty());
    }
}
