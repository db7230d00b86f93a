//! `cachalot serve`: an OpenAI-compatible HTTP server over the engine's step loop (the loop
//! `cachalot run` drives offline), as vLLM's `vllm serve` and llama.cpp's `llama-server` give.
//!
//! Endpoints: `GET /health`, `GET /metrics` and `GET /stats` ([`crate::serve_metrics`]),
//! `GET /v1/models`, `POST /v1/completions` (one prompt or a list) and
//! `POST /v1/chat/completions`, each answer whole or streamed as server-sent events
//! (`"stream": true`, ending in `data: [DONE]`; `stream_options.include_usage` adds a usage
//! chunk), with `n` choices per prompt, log-probabilities (`logprobs`, `top_logprobs`),
//! completions' `echo` (the prompt scored), JSON mode (`response_format` `json_object`) and
//! forced tool calls (`tool_choice` `required` or a named function). Requests are batched continuously: each HTTP
//! request is a thread that renders and tokenizes its prompt and hands it to the engine thread
//! (one job per choice), which admits it at the next step (up to `--batch-size` sequences,
//! prefills packed under `--max-prefill-tokens`, paged KV blocks, MTP drafts with `--mtp N`)
//! and sends its text back piece by piece. A client that goes away has its request aborted
//! (its blocks freed) at the next piece that cannot be written: a streamed answer writes every
//! piece; a whole answer that takes over `--keepalive-ms` (2 s) starts its 200 response and
//! writes a space that often (JSON allows leading whitespace), so it is watched too (an error
//! after that comes as the body of the started response). `max_model_len` (in `/v1/models`) is
//! the model's positions within the KV pool. Executor spec §2 (the online mode's request flow).
//!
//! Several ranks (`--ranks N`, or `--rank/--world-size/--master` across hosts): rank 0 answers
//! HTTP and all ranks run [`ranked_loop`] in lockstep, the seed's DP-leader loop (spec §5.5):
//! data parallel (each request on the least busy rank), expert parallel (the routed experts
//! split over the ranks, every request stepped on all of them) or tensor parallel (the heads and
//! intermediate features split, every request stepped on all of them).
//!
//! Prefill/decode disaggregation (spec `executor.md` §5): `--role prefill` and `--role decode`
//! split the work over two servers (on one host or two) with `cachalot router` in front, which
//! sends each request to one of each with the same `bootstrap_room` (and the prefill server's
//! `bootstrap_host`/`bootstrap_port`), as the seed's router does. The prefill server computes the
//! prompt's KV and first token and keeps them for the room
//! ([`cachalot_engine::Engine::add_request_for_transfer`]); the decode server's request thread
//! fetches them over TCP from the prefill server's `--kv-port` (a [`KvSnapshot`] on the wire)
//! and hands them to its engine ([`cachalot_engine::Engine::add_prefilled`]), which decodes and
//! answers (whole or streamed). A request of several choices (`n`, several prompts) has one
//! prefill per choice on the prefill server (its own seed and first token) and one KV per choice
//! in its room, fetched together; `echo` scores the prompt on the prefill server, and its
//! log-probabilities travel with the KV. A failed prefill reaches the decode side as its error; a KV
//! not fetched within `--kv-timeout-s` is dropped (a late fetch is told so).
//!
//! Chat answers of templates that write `<think>` (R1, Kimi-K2-Thinking, V4's thinking mode)
//! split it into `reasoning_content` (as vLLM's reasoning parsers do) and read the model's tool
//! calls into `tool_calls` when the request gives `tools`; with tools and streaming, content
//! streams up to where tool-call markup begins or may begin, then each call as it is written
//! (id and name once the name is whole, then its arguments piece by piece:
//! [`ToolCallFormat::partial_calls`], as vLLM's tool parsers stream them; DeepSeek-V4's DSML
//! parameters as the JSON text they become), reasoning as it comes. Bad requests get
//! HTTP 400 with `{"error": {"message", "type", "param"}}` naming the field.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Condvar, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{bail, Result};
use cachalot_engine::reasoning::{THINK_CLOSE, THINK_OPEN};
use cachalot_engine::{
    Engine, EngineConfig, FinishReason, JsonLead, KvSnapshot, Model, ReasoningSplitter, Request,
    RequestOutput, SamplingParams, Segment, SpecialText, StopConditions, TokenLogprob,
};
use cachalot_model::tokenizer::{ChatTemplate, Tokenizer, ToolCallFormat};
use cachalot_model::{detect_family, ModelFamily};
use serde_json::{json, Map, Value};

use crate::serve_metrics::Metrics;
use crate::{load_model, load_v4, model_dir, ModelArgs};
use cachalot_engine::comm::Communicator;
use cachalot_model::{ExpertShard, TensorShard};
use cachalot_run::offline::Parallel;

#[derive(clap::Args)]
pub struct ServeArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// A YAML config of the seed's (e.g. its online prefill.yaml / decode.yaml): the model
    /// (`model_path`), `batch_size` (per DP rank), `max_prefill_tokens`, `block_size`,
    /// `mem_fraction_static` (the KV pool's share of free memory), `next_n` (MTP), `dtype`
    /// (float32: an f32 cache under `--kv-cache-dtype auto`) and
    /// `custom_params.num_hidden_layers`. Options given here win over it.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port to listen on (0: any free port; the chosen one is printed) [default: the seed's,
    /// 8000; 8001 for the prefill role, 8100 for decode].
    #[arg(long)]
    port: Option<u16>,
    /// The model's name in requests and answers (default: the model directory's name).
    #[arg(long)]
    served_model_name: Option<String>,
    /// Sequences decoded together at most [default: 16, or the YAML's].
    #[arg(long,
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=4096))]
    batch_size: Option<usize>,
    /// Prompt tokens prefilled in one step at most (longer prompts are split into chunks)
    /// [default: 2048, or the YAML's].
    #[arg(long, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    max_prefill_tokens: Option<usize>,
    /// Tokens per KV block [default: 128, or the YAML's].
    #[arg(long,
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=65536))]
    block_size: Option<usize>,
    /// KV blocks in the pool (default: enough for `--batch-size` sequences of the model's
    /// whole context, within half the memory available, or the YAML's mem_fraction_static).
    #[arg(long)]
    kv_blocks: Option<usize>,
    /// MTP speculative decoding with N (1-3) drafts per step, 0 for none [default: 0, or the
    /// YAML's next_n].
    #[arg(long, value_name = "N")]
    mtp: Option<usize>,
    /// Prefix caching (vLLM's automatic prefix caching): a prompt's first whole KV blocks
    /// already computed for an earlier request (a shared system prompt, the earlier turns of a
    /// conversation) are shared instead of computed again; outputs are unchanged. `auto`: on
    /// for DeepSeek-V3/R1/Kimi-K2 without a C8 cache and for DeepSeek-V4 under `--v4-cache
    /// full` (its compact cache, the default, cannot share blocks), not under force_eplb.
    /// Answers report
    /// `usage.prompt_tokens_details.cached_tokens`.
    #[arg(long, value_enum, default_value = "auto")]
    prefix_caching: crate::PrefixCachingArg,
    #[command(flatten)]
    placement: crate::run::PlacementArgs,
    /// Chat template (a tokenizer_config.json or a Jinja file) instead of the model's.
    #[arg(long)]
    chat_template: Option<PathBuf>,
    /// Default sampling of requests that leave it out (vLLM's `--generation-config`): `auto`
    /// reads the model directory's generation_config.json (`temperature`, `top_k`, `top_p`,
    /// `min_p`, `repetition_penalty`, and `max_new_tokens` as the default `max_tokens`), a
    /// directory reads its generation_config.json, `vllm` uses none (temperature 1, no
    /// top-k/top-p/min-p).
    #[arg(long, default_value = "auto", value_name = "auto|vllm|DIR")]
    generation_config: String,
    /// A whole (not streamed) answer that takes longer than this starts its response and
    /// writes a space this often, so a client that left is noticed and its request aborted.
    #[arg(long, default_value_t = 2000,
          value_parser = clap::builder::RangedU64ValueParser::<u64>::new().range(10..))]
    keepalive_ms: u64,
    /// On SIGTERM the server refuses new requests (503) and gives those in flight (and, on a
    /// prefill server, KV its decode servers have yet to fetch) up to this many seconds to
    /// finish before it exits (0 when all finished, 143 otherwise).
    #[arg(long, default_value_t = 30.0)]
    drain_timeout_s: f64,
    /// This server's part in prefill/decode disaggregation: `both` (the whole request here),
    /// `prefill` (prefill, then hand the KV to a decode server), `decode` (take the KV from a
    /// prefill server, then decode). Put `cachalot router` in front of prefill and decode
    /// servers.
    #[arg(long, value_enum, default_value = "both")]
    role: Role,
    /// Prefill role: the port decode servers fetch prefilled KV from (0: any free port; the
    /// chosen one is printed and reported by /health).
    #[arg(long, default_value_t = 18800)]
    kv_port: u16,
    /// Prefill role: how long a prefilled KV waits to be fetched before it is dropped. Decode
    /// role: how long to wait for a prefill server's KV.
    #[arg(long, default_value_t = 600,
          value_parser = clap::builder::RangedU64ValueParser::<u64>::new().range(1..))]
    kv_timeout_s: u64,
    /// Several processes behind this server: rank 0 answers HTTP; with --parallel data each
    /// rank runs its own requests (the least busy rank takes the next), with expert (tensor)
    /// the ranks step every request together, holding the routed experts (the heads and
    /// intermediate features) between them.
    #[command(flatten)]
    group: crate::run::GroupArgs,
}

impl ServeArgs {
    /// The ranks' options (joined to an MPI job before the thread pool starts).
    pub fn group_mut(&mut self) -> &mut crate::run::GroupArgs {
        &mut self.group
    }

    /// Threads of this process's pool: --threads, or the cores shared out among --ranks.
    pub fn threads_per_rank(&self) -> Option<usize> {
        self.group.threads_per_rank()
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Role {
    Both,
    Prefill,
    Decode,
}

impl Role {
    /// The seed's name for it (`disaggregation_mode`).
    fn mode(self) -> &'static str {
        match self {
            Role::Both => "none",
            Role::Prefill => "prefill",
            Role::Decode => "decode",
        }
    }
}

/// What a request learns when the engine thread has ended (a rank of the group failed or
/// left, a step failed): the server is stopping.
const ENGINE_STOPPED: &str =
    "the engine has stopped (a rank failed or left, or a step failed: the server's log says \
     which); the server is stopping";

/// Request bodies above this are refused (413).
const MAX_BODY_BYTES: u64 = 64 << 20;

/// What a request thread gets back from the engine thread.
enum Event {
    /// New text of the answer, the log-probabilities of the tokens generated since the last
    /// event (when the request asked for them), and how many tokens it has generated so far.
    Text(String, Vec<TokenLogprob>, usize),
    /// The request ended.
    Done(Box<RequestOutput>),
    /// It could not be served: the engine refused it (400) or a step failed (500).
    Failed(u16, String),
}

struct Job {
    request: Request,
    /// Where its events go, tagged with its choice (of the HTTP request's `n`).
    events: mpsc::Sender<(usize, Event)>,
    choice: usize,
    kind: JobKind,
    /// Set once the HTTP side has stopped waiting for it ([`ClientGone`]): the engine aborts
    /// it at its next step, queued or running, with or without new text to send.
    gone: Arc<AtomicBool>,
}

/// Sets its flag when dropped: held by a request's HTTP handler, so however the handler ends
/// (answered, or its client gone at a failed write) the engine learns it no longer waits.
struct ClientGone(Arc<AtomicBool>);

impl Drop for ClientGone {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

enum JobKind {
    /// The whole request here.
    Whole,
    /// Prefill role: prefill, then leave the KV for `room`'s decode server.
    Export(u64),
    /// Decode role: continue from a prefill server's KV.
    Import(Box<KvSnapshot>),
}

/// The prefill role's prefilled KV, by `bootstrap_room`, until a decode server takes it: one KV
/// per choice of the request (`n` choices of each prompt, in order), handed over together.
struct Rooms {
    map: Mutex<HashMap<u64, (Instant, RoomState)>>,
    changed: Condvar,
    timeout: Duration,
}

enum RoomState {
    /// The choices' KVs so far (`None`: still prefilling), and the request's flag that aborts
    /// its prefills ([`Job::gone`]) when the room is dropped before they are done.
    Prefilling(Vec<Option<Box<KvSnapshot>>>, Option<Arc<AtomicBool>>),
    /// Every choice's KV, in choice order.
    Ready(Vec<KvSnapshot>),
    Failed(String),
    /// Its KV was taken or dropped: a late or second fetch learns why at once.
    Gone(String),
}

impl Rooms {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, (Instant, RoomState)>> {
        self.map.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Rooms whose KV waits for its decode server (a drain waits for them too).
    fn held(&self) -> usize {
        let mut map = self.lock();
        self.purge(&mut map);
        map.values()
            .filter(|(_, s)| matches!(s, RoomState::Ready(_)))
            .count()
    }

    /// Drops KV that has waited longer than the timeout (a decode server that never came),
    /// leaving a note for as long again; forgets older notes and stale rooms.
    fn purge(&self, map: &mut HashMap<u64, (Instant, RoomState)>) {
        let timeout = self.timeout;
        for (t, state) in map.values_mut() {
            if t.elapsed() >= timeout && matches!(state, RoomState::Ready(_)) {
                *state = RoomState::Gone(format!(
                    "its KV waited {} s (--kv-timeout-s) for a decode server and was dropped",
                    timeout.as_secs()
                ));
                *t = Instant::now();
            }
        }
        map.retain(|_, (t, _)| t.elapsed() < timeout);
    }

    /// The prefills of a request's `choices` start for `room` (`gone` aborts them); refused if
    /// the room is in use.
    fn open(&self, room: u64, choices: usize, gone: Option<Arc<AtomicBool>>) -> Result<(), String> {
        let mut map = self.lock();
        self.purge(&mut map);
        if let Some((_, state)) = map.get(&room) {
            if !matches!(state, RoomState::Gone(_)) {
                return Err(format!("{room} is in use by another request"));
            }
        }
        let slots = (0..choices.max(1)).map(|_| None).collect();
        map.insert(room, (Instant::now(), RoomState::Prefilling(slots, gone)));
        Ok(())
    }

    /// Choice `choice` of `room` is prefilled; the room is ready once every choice is. (A room
    /// that failed meanwhile stays failed.)
    fn ready(&self, room: u64, choice: usize, kv: Box<KvSnapshot>) {
        let mut map = self.lock();
        self.purge(&mut map);
        let Some((t, state)) = map.get_mut(&room) else {
            return;
        };
        let RoomState::Prefilling(slots, _) = state else {
            return;
        };
        match slots.get_mut(choice) {
            Some(slot) => *slot = Some(kv),
            None => {
                *state = RoomState::Failed(format!(
                    "the prefill server: choice {choice} of a request of {} choices",
                    slots.len()
                ));
                *t = Instant::now();
                drop(map);
                self.changed.notify_all();
                return;
            }
        }
        if slots.iter().all(Option::is_some) {
            let kvs = std::mem::take(slots)
                .into_iter()
                .flatten()
                .map(|k| *k)
                .collect();
            *state = RoomState::Ready(kvs);
            *t = Instant::now();
        }
        drop(map);
        self.changed.notify_all();
    }

    /// Drops `room`'s KV, or the prefill under way for it, because its decode server will not
    /// fetch it (a router's [`KV_DROP`]); true when there was something to drop.
    fn release(&self, room: u64) -> bool {
        let mut map = self.lock();
        self.purge(&mut map);
        let Some((t, state)) = map.get_mut(&room) else {
            return false;
        };
        if !matches!(state, RoomState::Prefilling(..) | RoomState::Ready(_)) {
            return false;
        }
        // Prefills still under way (queued or running) are aborted: their KV would go nowhere.
        if let RoomState::Prefilling(_, Some(gone)) = state {
            gone.store(true, Ordering::Relaxed);
        }
        *state = RoomState::Gone(format!(
            "bootstrap_room {room}'s KV was dropped: the router found its decode server had \
             refused the request, could not be reached or failed, or its client had left"
        ));
        *t = Instant::now();
        drop(map);
        self.changed.notify_all();
        true
    }

    fn set(&self, room: u64, state: RoomState) {
        let mut map = self.lock();
        self.purge(&mut map);
        map.insert(room, (Instant::now(), state));
        drop(map);
        self.changed.notify_all();
    }

    /// Waits (up to the timeout) for `room`'s KVs (every choice's) or failure, and takes them;
    /// with a `fingerprint` ([`prompts_fingerprint`]) only if they are that request's.
    fn take(&self, room: u64, fingerprint: Option<u64>) -> Result<Vec<KvSnapshot>, String> {
        let deadline = Instant::now() + self.timeout;
        let mut map = self.lock();
        self.purge(&mut map);
        loop {
            match map.get(&room) {
                Some((_, RoomState::Ready(kvs)))
                    if fingerprint.is_some_and(|f| {
                        f != prompts_fingerprint(kvs.iter().map(|k| k.prompt.as_slice()))
                    }) =>
                {
                    return Err(format!(
                        "bootstrap_room {room} holds the KV of another request (its prompts \
                         differ): two requests named the same room (give each its own), or the \
                         prefill and decode servers run different models or tokenizers (start \
                         both with the same --model)"
                    ));
                }
                Some((_, RoomState::Ready(_))) => {
                    let gone = RoomState::Gone(format!(
                        "bootstrap_room {room}'s KV was taken by another request naming the same \
                         room (give each request its own room)"
                    ));
                    return match map.insert(room, (Instant::now(), gone)) {
                        Some((_, RoomState::Ready(kv))) => Ok(kv),
                        _ => Err(format!("bootstrap_room {room} vanished")),
                    };
                }
                Some((_, RoomState::Failed(m))) => {
                    let m = m.clone();
                    map.remove(&room);
                    return Err(m);
                }
                Some((_, RoomState::Gone(m))) => return Err(m.clone()),
                _ => {}
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(format!(
                    "no prefill of bootstrap_room {room} finished within {} s (--kv-timeout-s)",
                    self.timeout.as_secs()
                ));
            }
            map = self
                .changed
                .wait_timeout(map, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }
}

/// A bound on work in flight: at most `limit` holders at once, others wait their turn.
struct Permits {
    held: Mutex<usize>,
    freed: Condvar,
    limit: usize,
}

/// One place taken from [`Permits`], given back when dropped.
struct Permit<'a>(&'a Permits);

impl Permits {
    /// A place, waiting at most `wait` for one.
    fn take(&self, wait: Duration) -> Option<Permit<'_>> {
        let deadline = Instant::now() + wait;
        let mut held = self.held.lock().unwrap_or_else(|e| e.into_inner());
        while *held >= self.limit {
            let left = deadline.checked_duration_since(Instant::now())?;
            held = self
                .freed
                .wait_timeout(held, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        *held += 1;
        Some(Permit(self))
    }
}

impl Drop for Permit<'_> {
    fn drop(&mut self) {
        *self.0.held.lock().unwrap_or_else(|e| e.into_inner()) -= 1;
        self.0.freed.notify_one();
    }
}

/// Where a disaggregated request's KV comes from or goes to (the seed's bootstrap fields).
struct Bootstrap {
    room: u64,
    host: String,
    port: u16,
}

/// What every request thread reads.
struct Shared {
    name: String,
    tokenizer: Arc<Tokenizer>,
    template: Option<ChatTemplate>,
    /// Why there is no template, for the chat endpoint's error.
    template_error: String,
    eos: Vec<u32>,
    im_end: Option<u32>,
    tool_format: Option<ToolCallFormat>,
    max_positions: usize,
    /// The model's vocabulary (its embedding's rows): the ids a request may name (a tokenizer's
    /// ids may have gaps, so its count is not the bound).
    vocab: usize,
    /// `--generation-config`: sampling of requests that leave it out.
    defaults: SamplingDefaults,
    /// `--keepalive-ms`.
    keepalive: std::time::Duration,
    jobs: mpsc::Sender<Job>,
    role: Role,
    /// Prefill role: the KV waiting for decode servers, and the port they fetch it from.
    rooms: Option<Arc<Rooms>>,
    kv_port: Option<u16>,
    /// Decode role: how long to wait for a prefill's KV, and the most bytes one may hold.
    kv_timeout: Duration,
    kv_max_bytes: u64,
    /// The figures of `/metrics` and `/stats`.
    metrics: Arc<Metrics>,
    /// Decode role: requests whose KV is fetched or held at once (twice the batch, as the
    /// seed's metadata slots bound its transfers), so waiting KV cannot fill the memory.
    transfers: Permits,
}

/// Sampling a request gets for the fields it leaves out (vLLM's `--generation-config auto`:
/// the model's generation_config.json, as its authors recommend; vLLM reads the same keys).
#[derive(Clone, Debug, Default, PartialEq)]
struct SamplingDefaults {
    temperature: Option<f64>,
    top_k: Option<usize>,
    top_p: Option<f64>,
    min_p: Option<f64>,
    repetition_penalty: Option<f64>,
    /// `max_new_tokens`: the default `max_tokens` (a request's own may be larger).
    max_tokens: Option<usize>,
    /// The file read, for the log.
    source: String,
}

impl SamplingDefaults {
    /// `auto`: the model directory's generation_config.json; `vllm`: none; else a directory
    /// (or the file itself) to read it from. A missing file under `auto` gives none; a value
    /// out of range is warned about and left out (the model still serves).
    fn read(choice: &str, model_dir: &Path) -> Result<SamplingDefaults> {
        let path = match choice {
            "vllm" => return Ok(SamplingDefaults::default()),
            "auto" => {
                let p = model_dir.join("generation_config.json");
                if !p.exists() {
                    return Ok(SamplingDefaults::default());
                }
                p
            }
            other => {
                let p = PathBuf::from(other);
                let p = if p.is_dir() {
                    p.join("generation_config.json")
                } else {
                    p
                };
                if !p.is_file() {
                    anyhow::bail!(
                        "--generation-config {other}: no {} (give auto, vllm, or a directory \
                         holding a generation_config.json)",
                        p.display()
                    );
                }
                p
            }
        };
        let text = std::fs::read_to_string(&path)
            .map_err(|e| anyhow::anyhow!("cannot read {}: {e}", path.display()))?;
        let v: Value = match serde_json::from_str(&text) {
            Ok(v) => v,
            // (Its EOS is warned about already, where the stop tokens are read.)
            Err(_) if choice == "auto" => return Ok(SamplingDefaults::default()),
            Err(e) => anyhow::bail!("{} is not valid JSON: {e}", path.display()),
        };
        let mut d = SamplingDefaults {
            source: path.display().to_string(),
            ..SamplingDefaults::default()
        };
        // `above`: the value must be above `lo` (top_p, repetition_penalty), not only at it.
        let num = |key: &str, lo: f64, hi: f64, above: bool| -> Option<f64> {
            let x = v.get(key).filter(|x| !x.is_null())?;
            match x.as_f64() {
                Some(f) if (lo..=hi).contains(&f) && !(above && f == lo) => Some(f),
                _ => {
                    let from = if above { "above" } else { "from" };
                    say!(
                        "warning: {}: {key} {x} is not a number {from} {lo} to {hi}; requests \
                         that leave {key} out get the usual default",
                        path.display()
                    );
                    None
                }
            }
        };
        d.temperature = num("temperature", 0.0, 100.0, false);
        d.top_p = num("top_p", 0.0, 1.0, true);
        d.min_p = num("min_p", 0.0, 1.0, false);
        d.repetition_penalty = num("repetition_penalty", 0.0, 100.0, true);
        let int = |key: &str| -> Option<usize> {
            let x = v.get(key).filter(|x| !x.is_null())?;
            match x.as_i64() {
                // transformers' and vLLM's "off".
                Some(k) if k <= 0 && key == "top_k" => Some(0),
                Some(k) if k > 0 => Some(k as usize),
                _ => {
                    say!(
                        "warning: {}: {key} {x} is not a positive integer; requests that \
                         leave it out get the usual default",
                        path.display()
                    );
                    None
                }
            }
        };
        d.top_k = int("top_k");
        d.max_tokens = int("max_new_tokens");
        Ok(d)
    }

    fn is_empty(&self) -> bool {
        SamplingDefaults {
            source: String::new(),
            ..self.clone()
        } == SamplingDefaults::default()
    }

    /// `temperature 0.6, top_p 0.95` for the log.
    fn describe(&self) -> String {
        let mut parts = Vec::new();
        let mut put = |k: &str, v: Option<String>| {
            if let Some(v) = v {
                parts.push(format!("{k} {v}"));
            }
        };
        put("temperature", self.temperature.map(|x| x.to_string()));
        put("top_k", self.top_k.map(|x| x.to_string()));
        put("top_p", self.top_p.map(|x| x.to_string()));
        put("min_p", self.min_p.map(|x| x.to_string()));
        put(
            "repetition_penalty",
            self.repetition_penalty.map(|x| x.to_string()),
        );
        put("max_tokens", self.max_tokens.map(|x| x.to_string()));
        parts.join(", ")
    }
}

/// The server's sizes: the options, else the YAML's, else the defaults.
struct Settings {
    model: ModelArgs,
    batch_size: usize,
    max_prefill_tokens: usize,
    block_size: usize,
    kv_blocks: Option<usize>,
    /// Share of the available memory the KV pool may take.
    kv_fraction: f64,
    mtp: usize,
    /// `Engine::set_prefix_caching`.
    prefix_caching: Option<bool>,
    /// How the ranks share the work (--parallel, or the YAML's parallel_config).
    parallel: cachalot_run::offline::Parallel,
    /// A decode server (`--role decode`): its requests come with their prompts' KV, so prefix
    /// caching does not run there.
    decode: bool,
}

fn settings(args: &ServeArgs) -> Result<Settings> {
    let mut model = args.model.clone();
    let mut s = Settings {
        model: args.model.clone(),
        batch_size: 16,
        max_prefill_tokens: 2048,
        block_size: 128,
        kv_blocks: args.kv_blocks,
        kv_fraction: 0.5,
        mtp: 0,
        prefix_caching: args.prefix_caching.chosen(),
        parallel: args
            .group
            .layout(&cachalot_run::config::ParallelConfig::default())?,
        decode: args.role == Role::Decode,
    };
    if let Some(path) = &args.config {
        let cfg =
            cachalot_run::config::RunConfig::from_file(path).map_err(|e| anyhow::anyhow!("{e}"))?;
        let m = &cfg.model_config;
        if model.model.is_none() {
            let dir = PathBuf::from(&m.model_path);
            if !dir.join("config.json").is_file() {
                bail!(
                    "{}: model_config.model_path {:?} has no config.json (put the model's Hugging \
                     Face directory there, fix model_path, or give --model DIR)",
                    path.display(),
                    m.model_path
                );
            }
            model.model = Some(dir);
        }
        if matches!(model.kv_cache_dtype, crate::KvDtypeArg::Auto)
            && m.dtype.eq_ignore_ascii_case("float32")
        {
            model.kv_cache_dtype = crate::KvDtypeArg::F32;
        }
        // As `run`: the seed's Ascend 950 keeps DeepSeek-V4's (compact) cache in fp8.
        if matches!(model.kv_cache_dtype, crate::KvDtypeArg::Auto)
            && m.platform_version.as_deref() == Some("950")
            && model.v4_cache == cachalot_model::V4CacheMode::Compact
            && model
                .model
                .as_deref()
                .is_some_and(|d| detect_family(d).ok() == Some(ModelFamily::DeepseekV4))
        {
            model.kv_cache_dtype = crate::KvDtypeArg::Fp8;
        }
        if let Some(v) = m.custom_params.get("num_hidden_layers") {
            let n = v.as_u64().filter(|&n| n >= 1).ok_or_else(|| {
                anyhow::anyhow!(
                    "{}: model_config.custom_params.num_hidden_layers: expected a positive \
                     integer, got {v}",
                    path.display()
                )
            })?;
            model.max_layers = Some(n as usize);
        }
        let p = &cfg.parallel_config;
        s.parallel = args.group.layout(p)?;
        // (Said once, by rank 0.)
        if p.world_size > 1
            && p.world_size != args.group.size()
            && args.group.rank.unwrap_or(0) == 0
        {
            let ranks = args.group.size();
            if ranks > 1 {
                // Ranks were asked for, another number than the YAML's.
                say!(
                    "cachalot serve: {}: world_size {} recorded, not applied: this server runs \
                     {ranks} ranks (--ranks / --world-size), each taking one DP group's batch \
                     ({}); --parallel chooses their layout",
                    path.display(),
                    p.world_size,
                    cfg.batch_size_per_dp_rank()
                );
            } else {
                say!(
                    "cachalot serve: {}: world_size {} — this server takes one DP group's batch \
                     ({}) and starts no ranks of its own: give --ranks N (or --rank, \
                     --world-size, --master) and --parallel for several",
                    path.display(),
                    p.world_size,
                    cfg.batch_size_per_dp_rank()
                );
            }
        }
        s.batch_size = cfg.batch_size_per_dp_rank().max(1);
        s.max_prefill_tokens = cfg.max_prefill_tokens().max(1);
        s.block_size = cfg.scheduler_config.block_size;
        s.kv_fraction = cfg.scheduler_config.mem_fraction_static;
        s.mtp = m.next_n;
    }
    s.model = model;
    s.batch_size = args.batch_size.unwrap_or(s.batch_size);
    s.max_prefill_tokens = args.max_prefill_tokens.unwrap_or(s.max_prefill_tokens);
    s.block_size = args.block_size.unwrap_or(s.block_size);
    s.mtp = args.mtp.unwrap_or(s.mtp);
    if s.mtp > 3 {
        bail!("--mtp {}: give 1 to 3 draft tokens (0: off)", s.mtp);
    }
    Ok(s)
}

pub fn serve(args: &ServeArgs) -> Result<()> {
    let set = settings(args)?;
    if let Some(n) = args
        .group
        .ranks
        .filter(|n| !(1..=crate::run::MAX_RANKS).contains(n))
    {
        bail!(
            "--ranks {n} is out of range: give 1 to {}",
            crate::run::MAX_RANKS
        );
    }
    let (comm, children) = crate::run::connect_ranks(&args.group, false)?;
    let result = serve_rank(args, set, comm.clone());
    drop(comm);
    let bad = crate::run::end_ranks(children, result.is_err());
    result?;
    if let Some((r, st)) = bad {
        bail!("rank {r} failed ({st}); its error is above");
    }
    // A drain stopped the group: the status it asks for (143 when the grace cut requests).
    if let Some(code) = crate::term::drain_stop().filter(|&c| c != 0) {
        std::process::exit(code);
    }
    Ok(())
}

/// This process's part of the server: rank 0 answers HTTP and drives the engine loop (alone,
/// or with the other ranks in lockstep, [`ranked_loop`]); the other ranks run their engines.
/// Every rank of a group must serve with the same settings (one with another expert placement,
/// cache or sizes would compute other answers, or fail at its first step): each rank's are
/// compared with rank 0's at start, every rank learning the verdict, and a difference is
/// refused naming the setting and the rank.
fn agree_with_rank_0(comm: &dyn Communicator, fields: &[(&str, String)]) -> Result<()> {
    // (FNV-1a: the same on every build, whatever toolchain made each rank's.)
    let digest = |v: &str| {
        v.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
        })
    };
    let mine: Vec<u8> = fields
        .iter()
        .flat_map(|(_, v)| digest(v).to_le_bytes())
        .collect();
    let all = comm.all_gather(&mine)?;
    for (r, theirs) in all.iter().enumerate().skip(1) {
        if let Some(i) = (0..fields.len()).find(|&i| {
            let at = |b: &Vec<u8>| b.get(i * 8..(i + 1) * 8).map(<[u8]>::to_vec);
            at(theirs) != at(&all[0])
        }) {
            bail!(
                "rank {r}: {} differs from rank 0's; every rank must serve the same checkpoint \
                 with the same options",
                fields[i].0
            );
        }
    }
    Ok(())
}

fn serve_rank(args: &ServeArgs, mut set: Settings, comm: Arc<dyn Communicator>) -> Result<()> {
    let (rank, world) = (comm.rank(), comm.world_size());
    if !(args.drain_timeout_s >= 0.0 && args.drain_timeout_s.is_finite()) {
        bail!(
            "--drain-timeout-s {}: give the seconds requests in flight get after SIGTERM (0 or \
             more)",
            args.drain_timeout_s
        );
    }
    // SIGTERM drains rank 0's requests; the other ranks go when rank 0 leaves the group.
    crate::term::drain_on_sigterm(
        std::time::Duration::from_secs_f64(args.drain_timeout_s),
        rank == 0,
    )?;
    // Expert or tensor parallel: one model over the ranks, which step every request together
    // (`expert` names that lockstep below).
    let p = set.parallel;
    let tensor = world > 1 && matches!(p, Parallel::Tensor | Parallel::TensorExpert);
    let experts_split = world > 1 && matches!(p, Parallel::Expert | Parallel::TensorExpert);
    let expert = tensor || experts_split;
    // Data parallel, the MoE layers dispatching tokens to the experts' ranks.
    let dispatch = world > 1 && matches!(p, Parallel::DataExpert | Parallel::Context);
    let context = world > 1 && p == Parallel::Context;
    if tensor {
        set.model.tensor_shard = TensorShard { rank, ranks: world };
    }
    let placement = args.placement.load(p, world)?;
    if experts_split {
        set.model.expert_shard = ExpertShard {
            rank,
            ranks: world,
            dispatch: false,
            context: false,
            placement,
        };
    }
    if dispatch {
        set.model.expert_shard = ExpertShard {
            rank,
            ranks: world,
            dispatch: true,
            context,
            placement,
        };
    }
    // Ranks of this host share its memory for their KV pools.
    set.kv_fraction /= args.group.host_ranks() as f64;
    let dir = model_dir(&set.model)?;
    if world > 1 {
        // (Paths may differ between hosts; the checkpoint is known by its config.json.)
        let mut options = set.model.clone();
        options.model = None;
        options.check_tensors = false;
        options.expert_shard = ExpertShard::default();
        options.tensor_shard = TensorShard::default();
        // The checkpoint's config.json as JSON (without the path it was saved from), and the
        // tokenizer's files, which make each rank's stop checks and JSON masks.
        let config = std::fs::read(dir.join("config.json"))
            .ok()
            .and_then(|b| serde_json::from_slice::<Map<String, Value>>(&b).ok())
            .map(|mut c| {
                c.remove("_name_or_path");
                Value::Object(c).to_string()
            })
            .unwrap_or_default();
        let tokenizer: String = [
            "tokenizer.json",
            "tiktoken.model",
            "tokenizer_config.json",
            "chat_template.jinja",
        ]
        .iter()
        .map(|f| {
            String::from_utf8_lossy(&std::fs::read(dir.join(f)).unwrap_or_default()).into_owned()
        })
        .collect();
        agree_with_rank_0(
            &*comm,
            &[
                ("--role", args.role.mode().to_string()),
                ("--parallel", p.name().to_string()),
                (
                    "the expert placement (--expert-placement, --redundant-experts)",
                    format!("{placement:?}"),
                ),
                ("--mtp", set.mtp.to_string()),
                ("--prefix-caching", format!("{:?}", set.prefix_caching)),
                ("--block-size", set.block_size.to_string()),
                ("--batch-size", set.batch_size.to_string()),
                ("--max-prefill-tokens", set.max_prefill_tokens.to_string()),
                (
                    "the model options (--fp8, --attention, --int8-head, --bf16-dot, \
                     --kv-cache-dtype, --v4-cache, --max-layers)",
                    format!("{options:?}"),
                ),
                ("the model's config.json", config),
                ("the model's tokenizer files", tokenizer),
            ],
        )?;
    }
    let tokenizer = Arc::new(Tokenizer::from_dir(&dir)?);
    let family = detect_family(&dir)?;
    let tool_format = ToolCallFormat::for_tokenizer(&tokenizer, family == ModelFamily::DeepseekV4);
    let (template, template_error) = match &args.chat_template {
        Some(f) => (Some(tokenizer.chat_template_from_file(f)?), String::new()),
        None => match tokenizer.chat_template()? {
            // A template that does not parse is said at the start, and chat requests are
            // answered with why (not blamed on their messages).
            Some(t) => match t.check_syntax() {
                Ok(()) => (Some(t), String::new()),
                Err(e) => {
                    let why = format!(
                        "{}: the model's chat_template cannot be used ({e}); fix it, or start \
                         the server with --chat-template FILE",
                        dir.display()
                    );
                    say!("cachalot serve: warning: {why}");
                    (None, why)
                }
            },
            None => (
                None,
                format!(
                    "{}: no chat template (chat_template.jinja, or chat_template in \
                     tokenizer_config.json); start the server with --chat-template FILE",
                    dir.display()
                ),
            ),
        },
    };
    let defaults = SamplingDefaults::read(&args.generation_config, &dir)?;
    if rank == 0 && !defaults.is_empty() {
        say!(
            "cachalot serve: default sampling from {}: {} (requests' own values win; \
             --generation-config vllm turns this off)",
            defaults.source,
            defaults.describe()
        );
    }
    let name = args.served_model_name.clone().unwrap_or_else(|| {
        dir.file_name()
            .map_or("model".into(), |n| n.to_string_lossy().into_owned())
    });
    let port = args.port.unwrap_or(match args.role {
        Role::Both => 8000,
        Role::Prefill => 8001,
        Role::Decode => 8100,
    });
    let server =
        match rank {
            0 => Some(crate::http_front::bind(&args.host, port).map_err(|e| {
                anyhow::anyhow!("cannot listen on {}:{port}: {e} (--port)", args.host)
            })?),
            _ => None,
        };
    let (jobs, job_rx) = mpsc::channel();
    let kv_timeout = Duration::from_secs(args.kv_timeout_s);
    // The prefill role's KV port, bound before the model loads so a taken port fails fast.
    if args.role == Role::Prefill && port != 0 && args.kv_port == port {
        anyhow::bail!(
            "--kv-port {port} is the server's own --port: give the KV transfers another port"
        );
    }
    let kv_listener = match args.role {
        Role::Prefill if rank == 0 => Some(
            TcpListener::bind((args.host.as_str(), args.kv_port)).map_err(|e| {
                anyhow::anyhow!(
                    "cannot listen for KV transfers on {}:{} (--kv-port): {e}",
                    args.host,
                    args.kv_port
                )
            })?,
        ),
        _ => None,
    };
    let rooms = kv_listener.as_ref().map(|_| {
        Arc::new(Rooms {
            map: Mutex::new(HashMap::new()),
            changed: Condvar::new(),
            timeout: kv_timeout,
        })
    });
    if let Some(rooms) = &rooms {
        // A drain lets decode servers fetch the KV they are owed.
        let rooms = rooms.clone();
        crate::term::drain_waits_for(move || rooms.held());
    }
    let kv_port = match &kv_listener {
        Some(l) => Some(l.local_addr()?.port()),
        None => None,
    };
    let metrics = Arc::new(Metrics::new(world));
    let launch =
        |eos: &[u32], max_positions: usize, vocab: usize, num_blocks: usize, kv_max_bytes: u64| {
            let Some(server) = server else {
                return;
            };
            // What one sequence can hold (vLLM's max_model_len): the model's positions, within the
            // KV pool.
            let max_positions = max_positions.min((num_blocks - 1) * set.block_size);
            let shared = Arc::new(Shared {
                name: name.clone(),
                tokenizer: tokenizer.clone(),
                template,
                template_error,
                eos: StopConditions::eos_ids(eos, Some(&tokenizer), &dir),
                im_end: tokenizer.token_to_id("<|im_end|>"),
                tool_format,
                max_positions,
                vocab,
                defaults: defaults.clone(),
                keepalive: std::time::Duration::from_millis(args.keepalive_ms),
                jobs,
                role: args.role,
                rooms: rooms.clone(),
                kv_port,
                kv_timeout,
                kv_max_bytes,
                transfers: Permits {
                    held: Mutex::new(0),
                    freed: Condvar::new(),
                    limit: 2 * set.batch_size,
                },
                metrics: metrics.clone(),
            });
            let addr = server.addr.to_string();
            if let (Some(l), Some(r), Some(p)) = (kv_listener, rooms.clone(), kv_port) {
                say!(
                    "cachalot serve: prefill role, decode servers fetch KV from {}:{p}",
                    crate::router::bracket(&args.host)
                );
                std::thread::spawn(move || serve_kv(l, r));
            }
            let ranks = match world {
                1 => String::new(),
                n if tensor && experts_split => format!(
                    ", {n} ranks (tensor and expert parallel, {})",
                    comm.transport()
                ),
                n if tensor => format!(", {n} ranks (tensor parallel, {})", comm.transport()),
                n if expert => format!(", {n} ranks (expert parallel, {})", comm.transport()),
                n if context => format!(
                    ", {n} ranks (data parallel, experts split, prefill context parallel, {})",
                    comm.transport()
                ),
                n if dispatch => format!(
                    ", {n} ranks (data parallel, experts split, {})",
                    comm.transport()
                ),
                n => format!(", {n} ranks (data parallel, {})", comm.transport()),
            };
            say!(
                "cachalot serve: {name} ({}), role {}{ranks}, max_model_len {max_positions}, \
             listening on http://{addr}/v1",
                dir.display(),
                match args.role {
                    Role::Both => "both (prefill and decode; disaggregation_mode none)",
                    other => other.mode(),
                }
            );
            std::thread::spawn(move || {
                server.serve("serve", Arc::new(move |request| handle(request, &shared)));
            });
        };
    // Sizes the pool, starts the HTTP side, then runs the engine on this thread.
    let run = |m: &(dyn Model + Sync), eos: &[u32]| -> Result<()> {
        let blocks = pool_blocks(&m, &set)?;
        // Ranks share requests (data) or step them together (expert): every rank's pool is the
        // smallest any rank can hold, so a request one rank takes fits every rank.
        let blocks = if world > 1 {
            let parts = comm.all_gather(&(blocks as u64).to_le_bytes())?;
            parts
                .iter()
                .filter_map(|p| p.as_slice().try_into().ok().map(u64::from_le_bytes))
                .fold(blocks as u64, u64::min) as usize
        } else {
            blocks
        };
        // A transferred prompt's KV fits the pool; its MTP hidden states come with it.
        let per_block = cachalot_engine::engine::kv_bytes_per_block(m.cache_spec(), set.block_size);
        let positions = m.max_positions().min(blocks * set.block_size) as u64;
        let kv_max_bytes = per_block * blocks as u64
            + positions * 4 * m.mtp_hidden_width() as u64
            + m.cache_spec().seq_state_bytes() as u64;
        launch(eos, m.max_positions(), m.vocab_size(), blocks, kv_max_bytes);
        if world > 1 {
            let jobs = (rank == 0).then_some(job_rx);
            let group = RankGroup {
                comm: &*comm,
                expert,
                dispatch,
                rooms: rooms.clone(),
                kv_max_bytes,
            };
            ranked_loop(m, &tokenizer, &set, blocks, jobs, group, &metrics)
        } else {
            engine_loop(m, &tokenizer, &set, blocks, job_rx, rooms.clone(), &metrics)
        }
    };
    match family {
        ModelFamily::DeepseekV3 => {
            let mut m = load_model(&set.model, set.mtp > 0)?;
            if expert || dispatch {
                m.set_communicator(comm.clone())?;
            }
            run(&m, &m.config().eos_token_ids)
        }
        ModelFamily::DeepseekV4 => {
            let mut m = load_v4(&set.model, set.mtp > 0)?;
            if expert || dispatch {
                m.set_communicator(comm.clone())?;
            }
            run(&m, &m.config().eos_token_ids)
        }
    }
}

/// KV blocks in the pool: `--kv-blocks`, or enough for `--batch-size` sequences of the model's
/// whole context within half the memory available (the YAML's `mem_fraction_static`).
fn pool_blocks<M: Model>(model: &M, set: &Settings) -> Result<usize> {
    // Before the server listens (its engine starts later, on its own thread).
    if set.block_size as i64 > cachalot_run::config::MAX_BLOCK_SIZE {
        bail!(
            "--block-size {}: at most {} positions a block (as the YAML's block_size)",
            set.block_size,
            cachalot_run::config::MAX_BLOCK_SIZE
        );
    }
    model.check_block_size(set.block_size)?;
    if set.prefix_caching == Some(true) && !model.supports_prefix_caching() {
        bail!("--prefix-caching on: {}", model.why_no_prefix_caching());
    }
    let per_block = cachalot_engine::engine::kv_bytes_per_block(model.cache_spec(), set.block_size);
    let per_seq = model.max_positions().div_ceil(set.block_size);
    // A state slot per running sequence (DeepSeek-V4's compact rings) comes out of the budget.
    let state = (model.cache_spec().seq_state_bytes() * set.batch_size) as u64;
    let num_blocks = match set.kv_blocks {
        Some(n) => n,
        None => {
            let cap =
                cachalot_run::offline::blocks_in_memory_share(set.kv_fraction, state, per_block)
                    .map_err(|b| {
                        anyhow::anyhow!(
                        "mem_fraction_static {} (of the memory available) leaves {b} bytes for \
                         the KV pool, less than the 2 blocks of {per_block} bytes it needs at \
                         least: raise it, lower the block size, or give the pool's size with \
                         --kv-blocks",
                        set.kv_fraction
                    )
                    })?;
            (per_seq * set.batch_size + 1).min(cap.unwrap_or(usize::MAX))
        }
    };
    if num_blocks < 2 {
        bail!(
            "--kv-blocks {num_blocks}: the pool needs at least 2 blocks (the reserved null block \
             and one more)"
        );
    }
    Ok(num_blocks)
}

/// Answers a request a drain's end cut ([`crate::term::DRAIN_CUT`], a 503).
fn answer_cut(events: &mpsc::Sender<(usize, Event)>, choice: usize) {
    let _ = events.send((choice, Event::Failed(503, crate::term::DRAIN_CUT.into())));
}

/// The engine's step loop: admits requests as they come, steps while any is unfinished, and
/// sends each request its new text after every step. Returns when the HTTP side is gone.
fn engine_loop<M: Model>(
    model: M,
    tokenizer: &Tokenizer,
    args: &Settings,
    num_blocks: usize,
    jobs: mpsc::Receiver<Job>,
    rooms: Option<Arc<Rooms>>,
    metrics: &Metrics,
) -> Result<()> {
    let mut engine = serving_engine(model, tokenizer, args, num_blocks, metrics)?;
    say!(
        "cachalot serve: KV pool of {num_blocks} blocks of {} tokens ({:.1} MB), batch {}, \
         max {} prefill tokens a step{}",
        args.block_size,
        engine.cache_bytes() as f64 / 1e6,
        args.batch_size,
        args.max_prefill_tokens,
        if args.mtp > 0 {
            format!(
                ", MTP with {} draft{}",
                args.mtp,
                if args.mtp == 1 { "" } else { "s" }
            )
        } else {
            String::new()
        }
    );
    // Per live request: where its events go, how many bytes of its text and how many
    // log-probabilities were sent, and (prefill role) the room its KV goes to.
    struct Sink {
        events: mpsc::Sender<(usize, Event)>,
        choice: usize,
        sent: usize,
        sent_logprobs: usize,
        room: Option<u64>,
        gone: Arc<AtomicBool>,
    }
    type Live = HashMap<u64, Sink>;
    let mut live: Live = HashMap::new();
    let rooms = rooms.as_deref();
    // Prefill role: a request that ends without KV leaves its room the reason.
    let fail_room = |room: Option<u64>, why: String| {
        if let (Some(rooms), Some(room)) = (rooms, room) {
            rooms.set(
                room,
                RoomState::Failed(format!("the prefill server: {why}")),
            );
        }
    };
    let admit = |engine: &mut Engine<M>, live: &mut Live, job: Job| {
        // A transferred KV this engine cannot take means the two servers do not match: a
        // server error, not the client's.
        let (added, room, status) = match job.kind {
            JobKind::Whole => (engine.add_request(job.request), None, 400),
            JobKind::Export(room) => (
                engine.add_request_for_transfer(job.request),
                Some(room),
                400,
            ),
            // The prefill server's KV does not fit this request: what upstream gave is unusable.
            JobKind::Import(kv) => (engine.add_prefilled(job.request, *kv), None, 502),
        };
        match added {
            Ok(id) => {
                live.insert(
                    id,
                    Sink {
                        events: job.events,
                        choice: job.choice,
                        sent: 0,
                        sent_logprobs: 0,
                        room,
                        gone: job.gone,
                    },
                );
            }
            Err(e) => {
                let message = match (&e, status) {
                    (cachalot_engine::EngineError::Request(m), 502) => {
                        format!("the prefill server's KV cannot serve this request: {m}")
                    }
                    _ => e.to_string(),
                };
                fail_room(room, message.clone());
                let _ = job
                    .events
                    .send((job.choice, Event::Failed(status, message)));
            }
        }
    };
    loop {
        // A drain's grace ended: what is left (running, queued, or not yet taken) is answered
        // 503, before the process exits.
        if crate::term::drain_cut() {
            while let Ok(job) = jobs.try_recv() {
                answer_cut(&job.events, job.choice);
            }
            for (id, sink) in live.drain() {
                engine.abort(id);
                fail_room(sink.room, crate::term::DRAIN_CUT.into());
                answer_cut(&sink.events, sink.choice);
            }
            let _ = engine.take_finished();
            std::thread::sleep(Duration::from_millis(20));
            continue;
        }
        // A request that arrives with its first token (a decode server's) has that token's
        // text sent before the next step, not with the step's token.
        let mut imported = false;
        if !engine.has_unfinished() {
            match jobs.recv() {
                Ok(job) => {
                    imported |= matches!(job.kind, JobKind::Import(_));
                    admit(&mut engine, &mut live, job)
                }
                Err(_) => return Ok(()),
            }
        }
        while let Ok(job) = jobs.try_recv() {
            imported |= matches!(job.kind, JobKind::Import(_));
            admit(&mut engine, &mut live, job);
        }
        // (A request can also end as it is admitted: a transferred first token that stops
        // it. Its output goes out below without a step.)
        if engine.has_unfinished() && !imported {
            if let Err(e) = engine.step() {
                say!("cachalot serve: a step failed: {e}");
                for (id, sink) in live.drain() {
                    engine.abort(id);
                    fail_room(sink.room, format!("the step failed: {e}"));
                    let _ = sink.events.send((
                        sink.choice,
                        Event::Failed(500, format!("the step failed: {e}")),
                    ));
                }
                for out in engine.take_finished() {
                    metrics.record(&out);
                }
                metrics.gauges(engine_gauges(&engine));
                continue;
            }
        }
        let mut gone = Vec::new();
        for (id, sink) in live.iter_mut() {
            // A client that left while its request waited (queued, or a long prefill) is
            // noticed here, not only when new text fails to reach it.
            if sink.gone.load(Ordering::Relaxed) {
                gone.push(*id);
                continue;
            }
            let Some(text) = engine.text_so_far(*id) else {
                continue;
            };
            // The text only grows, so `sent` is a char boundary; `get` keeps a surprise from
            // panicking the engine thread.
            let lps = engine.logprobs_so_far(*id).unwrap_or_default();
            let count = engine.generated_so_far(*id).unwrap_or_default();
            if let Some(news) = unsent(text, lps, sink.sent, sink.sent_logprobs) {
                if sink
                    .events
                    .send((sink.choice, Event::Text(news.0, news.1, count)))
                    .is_err()
                {
                    gone.push(*id);
                } else {
                    (sink.sent, sink.sent_logprobs) = (text.len(), lps.len());
                }
            }
        }
        for id in gone {
            say!("cachalot serve: request {id}: the client went away; aborted");
            engine.abort(id);
            if let Some(sink) = live.remove(&id) {
                fail_room(
                    sink.room,
                    "its request was aborted (the client went away)".into(),
                );
            }
        }
        metrics.gauges(engine_gauges(&engine));
        for mut out in engine.take_finished() {
            metrics.record(&out);
            let Some(Sink {
                events,
                choice,
                sent,
                sent_logprobs,
                room,
                ..
            }) = live.remove(&out.id)
            else {
                continue;
            };
            if let (Some(rooms), Some(room)) = (rooms, room) {
                match out.kv.take() {
                    Some(kv) => rooms.ready(room, choice, kv),
                    None => fail_room(
                        Some(room),
                        format!("the prefill ended without a token ({})", finish_word(&out)),
                    ),
                }
            }
            if let Some(rest) = unsent(&out.text, &out.logprobs, sent, sent_logprobs) {
                let _ = events.send((choice, Event::Text(rest.0, rest.1, out.tokens.len())));
            }
            let _ = events.send((choice, Event::Done(Box::new(out))));
        }
    }
}

/// What rank 0 tells every rank before a step of [`ranked_loop`]: the requests that arrived
/// (by key, with the rank that runs them: all ranks under expert parallelism), the requests to
/// abort, or that the server is stopping.
#[derive(Default, serde::Serialize, serde::Deserialize)]
struct Command {
    admit: Vec<(u64, u32, Request, Transfer)>,
    abort: Vec<u64>,
    stop: bool,
}

/// How a request of [`Command::admit`] comes (the prefill and decode roles, [`JobKind`]).
#[derive(serde::Serialize, serde::Deserialize)]
enum Transfer {
    /// The whole request.
    Whole,
    /// Prefill role: its KV is reported for its room.
    Export,
    /// Decode role: continued from the prefill server's KV, the command's blob of this index
    /// (`KvSnapshot::write_to`'s bytes).
    Import(usize),
}

/// A command or report with binary blobs after it (transferred KV, which JSON would bloat): a
/// u64 length, the JSON, then each blob as a u64 length and its bytes.
fn pack_frame<T: serde::Serialize>(value: &T, blobs: &[Vec<u8>]) -> Result<Vec<u8>> {
    let json = serde_json::to_vec(value)?;
    let mut out = Vec::with_capacity(16 + json.len() + blobs.iter().map(Vec::len).sum::<usize>());
    out.extend_from_slice(&(json.len() as u64).to_le_bytes());
    out.extend_from_slice(&json);
    for b in blobs {
        out.extend_from_slice(&(b.len() as u64).to_le_bytes());
        out.extend_from_slice(b);
    }
    Ok(out)
}

/// [`pack_frame`]'s value and blobs.
fn unpack_frame<T: serde::de::DeserializeOwned>(bytes: &[u8]) -> Result<(T, Vec<&[u8]>)> {
    let mut parts = Vec::new();
    let mut rest = bytes;
    while !rest.is_empty() {
        let truncated = || anyhow::anyhow!("a truncated frame");
        let len = rest
            .get(..8)
            .map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")))
            .and_then(|l| usize::try_from(l).ok())
            .ok_or_else(truncated)?;
        let part = rest
            .get(8..8usize.saturating_add(len))
            .ok_or_else(truncated)?;
        parts.push(part);
        rest = &rest[8 + len..];
    }
    let mut parts = parts.into_iter();
    let json = parts
        .next()
        .ok_or_else(|| anyhow::anyhow!("an empty frame"))?;
    Ok((serde_json::from_slice(json)?, parts.collect()))
}

/// What each rank tells rank 0 after the step: new text (and log-probabilities) of its
/// requests, those that finished or were refused, and whether it has work left.
#[derive(Default, serde::Serialize, serde::Deserialize)]
struct Report {
    /// Per request: new text, log-probabilities, tokens generated so far.
    text: Vec<(u64, String, Vec<TokenLogprob>, usize)>,
    done: Vec<(u64, RequestOutput)>,
    /// Prefill role: the KV of finished requests, as the report's blob of this index.
    kv: Vec<(u64, usize)>,
    failed: Vec<(u64, u16, String)>,
    live: usize,
    unfinished: bool,
    /// The rank's engine: requests running and waiting, KV blocks used and held
    /// ([`engine_gauges`]).
    gauges: [usize; 5],
}

/// The ranks a server runs over, and whether they split the model (expert or tensor
/// parallel: every rank steps every request) or the requests.
struct RankGroup<'a> {
    comm: &'a dyn Communicator,
    expert: bool,
    /// Data-parallel ranks whose MoE layers dispatch tokens to each other's experts: every
    /// rank ends each step together ([`Engine::end_step`]), stepped or not.
    dispatch: bool,
    /// Rank 0 of a prefill server: where finished prefills leave their KV.
    rooms: Option<Arc<Rooms>>,
    /// The largest transferred KV a rank reads.
    kv_max_bytes: u64,
}

/// How often an idle group of ranks checks that every rank is still there.
const HEARTBEAT: Duration = Duration::from_secs(5);

/// A random seed for a request that gave none: every rank that samples it must draw the same
/// tokens, so rank 0 draws the seed for all of them.
fn random_seed() -> u64 {
    use std::hash::BuildHasher;
    std::collections::hash_map::RandomState::new().hash_one(std::process::id())
}

/// The engine loop of a server over several ranks (`--ranks`, `--rank`), run by every rank in
/// lockstep, the seed's DP-leader loop in miniature (spec `executor.md` §5.5 ③-⑤): rank 0
/// broadcasts the requests that arrived and the aborts ([`Command`]); each rank adds those it
/// runs (data parallel: the least busy rank's; expert parallel: all, in the same order, so the
/// ranks step the same batches and their MoE layers gather each other's experts) and steps; the
/// ranks' [`Report`]s are gathered on rank 0, which sends each request's events to its HTTP
/// thread. When nothing is running anywhere, rank 0 waits for a request and the others wait in
/// the broadcast. A rank that fails or leaves ends the group (the server stops with its error).
fn ranked_loop<M: Model>(
    model: M,
    tokenizer: &Tokenizer,
    set: &Settings,
    num_blocks: usize,
    jobs: Option<mpsc::Receiver<Job>>,
    group: RankGroup<'_>,
    metrics: &Metrics,
) -> Result<()> {
    let RankGroup {
        comm,
        expert,
        dispatch,
        rooms,
        kv_max_bytes,
    } = group;
    let rooms = rooms.as_deref();
    // Prefill role: a request that ends without KV leaves its room the reason.
    let fail_room = |room: Option<u64>, why: &str| {
        if let (Some(rooms), Some(room)) = (rooms, room) {
            rooms.set(
                room,
                RoomState::Failed(format!("the prefill server: {why}")),
            );
        }
    };
    // Rank 0: the room and choice of each prefill-role request.
    let mut room_of: HashMap<u64, (u64, usize)> = HashMap::new();
    let (rank, world) = (comm.rank(), comm.world_size());
    let mut engine = serving_engine(model, tokenizer, set, num_blocks, metrics)?;
    say!(
        "cachalot serve: rank {rank} of {world}: KV pool of {num_blocks} blocks of {} tokens \
         ({:.1} MB), batch {}",
        set.block_size,
        engine.cache_bytes() as f64 / 1e6,
        set.batch_size
    );
    // Only one rank reports a request: its own (data) or rank 0 (expert: all run it alike).
    let reporting = !expert || rank == 0;
    // This rank's requests: key → (engine id, text bytes and log-probabilities reported).
    let mut mine: HashMap<u64, (u64, usize, usize)> = HashMap::new();
    let mut key_of: HashMap<u64, u64> = HashMap::new();
    // Rank 0: where each request's events go, live requests per rank, aborts to send, and
    // whether any rank has work left.
    #[allow(clippy::type_complexity)]
    let mut sinks: HashMap<u64, (mpsc::Sender<(usize, Event)>, usize, Arc<AtomicBool>)> =
        HashMap::new();
    // Rank 0: each request's log-probabilities so far, for its output.
    let mut logprobs: HashMap<u64, Vec<TokenLogprob>> = HashMap::new();
    let mut load = vec![0usize; world];
    let mut aborts = Vec::new();
    let mut busy = false;
    let mut next_key = 0u64;
    // Whether the last turn skipped its step for transferred requests.
    let mut skipped = false;
    if jobs.is_some() {
        // A SIGTERM drain stops the group from here (`crate::term::drain_stop`).
        crate::term::leads_group();
    }
    loop {
        let mut cmd = Command::default();
        let mut blobs = Vec::new();
        if let Some(jobs) = &jobs {
            let mut incoming = Vec::new();
            if !busy && aborts.is_empty() {
                // Idle: wait for a request, but step (an empty command) every few seconds so
                // a rank that died is noticed and the server stops instead of looking healthy;
                // a drain that finished stops the group.
                let heartbeat = Instant::now() + HEARTBEAT;
                while crate::term::drain_stop().is_none() {
                    let wait = heartbeat.saturating_duration_since(Instant::now());
                    match jobs.recv_timeout(wait.min(Duration::from_millis(50))) {
                        Ok(job) => {
                            incoming.push(job);
                            break;
                        }
                        Err(mpsc::RecvTimeoutError::Timeout) if wait.is_zero() => break,
                        Err(mpsc::RecvTimeoutError::Timeout) => {}
                        Err(mpsc::RecvTimeoutError::Disconnected) => {
                            cmd.stop = true;
                            break;
                        }
                    }
                }
            }
            // After a drain (its grace over, or nothing left), every rank stops.
            cmd.stop |= crate::term::drain_stop().is_some();
            incoming.extend(jobs.try_iter());
            for job in incoming {
                let key = next_key;
                next_key += 1;
                let target = if expert {
                    0
                } else {
                    (0..world).min_by_key(|&r| load[r]).unwrap_or(0)
                };
                load[target] += 1;
                let mut request = job.request;
                // (A transferred request keeps its own: the prefill server's seed and
                // sampler state come with its KV.)
                if !matches!(job.kind, JobKind::Import(_)) {
                    request.params.seed = request.params.seed.or_else(|| Some(random_seed()));
                }
                let transfer = match job.kind {
                    JobKind::Whole => Transfer::Whole,
                    JobKind::Export(room) => {
                        room_of.insert(key, (room, job.choice));
                        Transfer::Export
                    }
                    JobKind::Import(kv) => {
                        let mut b = Vec::new();
                        kv.write_to(&mut b)
                            .map_err(|e| anyhow::anyhow!("rank 0: a transferred KV: {e}"))?;
                        blobs.push(b);
                        Transfer::Import(blobs.len() - 1)
                    }
                };
                sinks.insert(key, (job.events, job.choice, job.gone));
                cmd.admit.push((key, target as u32, request, transfer));
            }
            // Requests whose client left (their handler has returned, or their new text found
            // no one): aborted on every rank.
            let left: Vec<u64> = sinks
                .iter()
                .filter(|(_, (_, _, gone))| gone.load(Ordering::Relaxed))
                .map(|(&key, _)| key)
                .collect();
            for key in left {
                say!("cachalot serve: request {key}: the client went away; aborted");
                sinks.remove(&key);
                logprobs.remove(&key);
                fail_room(
                    room_of.remove(&key).map(|r| r.0),
                    "its request was aborted (the client went away)",
                );
                aborts.push(key);
            }
            cmd.abort = std::mem::take(&mut aborts);
        }
        let bytes = pack_frame(&cmd, &blobs)
            .map_err(|e| anyhow::anyhow!("rank {rank}: the step's command: {e}"))?;
        let received = comm.broadcast(0, &bytes)?;
        let (cmd, blobs): (Command, _) = unpack_frame(&received)
            .map_err(|e| anyhow::anyhow!("rank {rank}: rank 0's command: {e}"))?;
        if cmd.stop {
            // A drain whose grace ended: what is left is answered 503 (not "a rank failed").
            if crate::term::drain_cut() {
                for (_, (tx, choice, _)) in sinks.drain() {
                    answer_cut(&tx, choice);
                }
                if let Some(jobs) = &jobs {
                    while let Ok(job) = jobs.try_recv() {
                        answer_cut(&job.events, job.choice);
                    }
                }
            }
            return Ok(());
        }
        let mut report = Report::default();
        let mut report_blobs = Vec::new();
        // A request that arrives with its first token (a decode server's) has that token's
        // text reported before the next step, not with the step's token, as one process does:
        // every rank skips this step alike (they all read the same command).
        // (At most one turn in a row: transfers arriving steadily do not hold the running
        // requests back; `skipped` follows the commands, so it is the same on every rank.)
        let imported = !skipped
            && cmd
                .admit
                .iter()
                .any(|(_, _, _, t)| matches!(t, Transfer::Import(_)));
        skipped = imported;
        for (key, target, request, transfer) in cmd.admit {
            if !expert && target as usize != rank {
                continue;
            }
            // A transferred KV this engine cannot take means the two servers do not match: a
            // server error (500), not the client's.
            let added = match transfer {
                Transfer::Whole => engine
                    .add_request(request)
                    .map_err(|e| (400, e.to_string())),
                Transfer::Export => engine
                    .add_request_for_transfer(request)
                    .map_err(|e| (400, e.to_string())),
                Transfer::Import(i) => blobs
                    .get(i)
                    .ok_or_else(|| (500, format!("rank 0 sent no KV blob {i}")))
                    .and_then(|b| {
                        KvSnapshot::read_from(&mut &b[..], kv_max_bytes)
                            .map_err(|e| (500, e.to_string()))
                    })
                    .and_then(|kv| {
                        engine
                            .add_prefilled(request, kv)
                            .map_err(|e| (500, e.to_string()))
                    }),
            };
            match added {
                Ok(id) => {
                    mine.insert(key, (id, 0, 0));
                    key_of.insert(id, key);
                }
                Err((status, e)) if reporting => report.failed.push((key, status, e)),
                Err(_) => {}
            }
        }
        for key in cmd.abort {
            if let Some(&(id, _, _)) = mine.get(&key) {
                engine.abort(id);
            }
        }
        if engine.has_unfinished() && !imported {
            if let Err(e) = engine.step() {
                if expert {
                    // The ranks' steps are one computation: this one cannot go on alone.
                    bail!("rank {rank}: a step failed: {e}");
                }
                say!("cachalot serve: rank {rank}: a step failed: {e}");
                for (key, (id, _, _)) in mine.drain() {
                    engine.abort(id);
                    report
                        .failed
                        .push((key, 500, format!("the step failed: {e}")));
                }
                key_of.clear();
                engine.take_finished();
            }
        }
        // Dispatched experts: every rank ends the step together, serving the others' MoE
        // tokens meanwhile (a rank whose step failed above too). The group goes on whatever
        // the answer: rank 0's next command decides.
        if dispatch {
            engine
                .end_step()
                .map_err(|e| anyhow::anyhow!("rank {rank}: the group's step: {e}"))?;
        }
        if reporting {
            for (&key, (id, sent, sent_lps)) in mine.iter_mut() {
                let text = engine.text_so_far(*id).unwrap_or_default();
                let lps = engine.logprobs_so_far(*id).unwrap_or_default();
                let count = engine.generated_so_far(*id).unwrap_or_default();
                if let Some((new, new_lps)) = unsent(text, lps, *sent, *sent_lps) {
                    report.text.push((key, new, new_lps, count));
                    (*sent, *sent_lps) = (text.len(), lps.len());
                }
            }
        }
        for out in engine.take_finished() {
            let Some(key) = key_of.remove(&out.id) else {
                continue;
            };
            let Some((_, sent, sent_lps)) = mine.remove(&key) else {
                continue;
            };
            if reporting {
                let mut out = out;
                if let Some((rest, rest_lps)) = unsent(&out.text, &out.logprobs, sent, sent_lps) {
                    report.text.push((key, rest, rest_lps, out.tokens.len()));
                }
                if let Some(kv) = out.kv.take() {
                    let mut b = Vec::new();
                    kv.write_to(&mut b)
                        .map_err(|e| anyhow::anyhow!("rank {rank}: a prefilled KV: {e}"))?;
                    report_blobs.push(b);
                    report.kv.push((key, report_blobs.len() - 1));
                }
                // Rank 0 has the prompt, and the log-probabilities went out piece by piece.
                out.prompt = Vec::new();
                out.logprobs = Vec::new();
                report.done.push((key, out));
            }
        }
        report.live = mine.len();
        report.unfinished = engine.has_unfinished();
        report.gauges = engine_gauges(&engine);
        let bytes = pack_frame(&report, &report_blobs)
            .map_err(|e| anyhow::anyhow!("rank {rank}: the step's report: {e}"))?;
        let parts = comm.all_gather(&bytes)?;
        if rank != 0 {
            continue;
        }
        busy = false;
        // Gauges: the ranks' engines together (data), or rank 0's (expert: all run the same).
        let mut gauges = [0usize; 5];
        for (r, part) in parts.iter().enumerate() {
            let (rep, kv_blobs): (Report, _) = unpack_frame(part)
                .map_err(|e| anyhow::anyhow!("rank 0: rank {r}'s report: {e}"))?;
            // Prefill role: each finished prefill's KV goes to its room.
            for (key, i) in rep.kv {
                let (Some(rooms), Some(&(room, choice))) = (rooms, room_of.get(&key)) else {
                    continue;
                };
                match kv_blobs
                    .get(i)
                    .ok_or_else(|| format!("rank {r} sent no KV blob {i}"))
                    .and_then(|b| {
                        KvSnapshot::read_from(&mut &b[..], kv_max_bytes).map_err(|e| e.to_string())
                    }) {
                    Ok(kv) => rooms.ready(room, choice, Box::new(kv)),
                    Err(e) => fail_room(Some(room), &e),
                }
                room_of.remove(&key);
            }
            busy |= rep.unfinished;
            load[r] = rep.live;
            if !expert || r == 0 {
                gauges.iter_mut().zip(rep.gauges).for_each(|(a, b)| *a += b);
            }
            for (key, text, lps, count) in rep.text {
                if !lps.is_empty() {
                    logprobs.entry(key).or_default().extend_from_slice(&lps);
                }
                if let Some((tx, choice, gone)) = sinks.get(&key) {
                    if tx.send((*choice, Event::Text(text, lps, count))).is_err() {
                        // Aborted with the others whose client left, before the next step.
                        gone.store(true, Ordering::Relaxed);
                    }
                }
            }
            for (key, mut out) in rep.done {
                // A prefill that ended without KV (its KV, when it had some, went above).
                fail_room(
                    room_of.remove(&key).map(|r| r.0),
                    &format!("the prefill ended without a token ({})", finish_word(&out)),
                );
                out.logprobs = logprobs.remove(&key).unwrap_or_default();
                metrics.record(&out);
                if let Some((tx, choice, _)) = sinks.remove(&key) {
                    let _ = tx.send((choice, Event::Done(Box::new(out))));
                }
            }
            for (key, status, message) in rep.failed {
                logprobs.remove(&key);
                fail_room(room_of.remove(&key).map(|r| r.0), &message);
                if let Some((tx, choice, _)) = sinks.remove(&key) {
                    let _ = tx.send((choice, Event::Failed(status, message)));
                }
            }
        }
        metrics.gauges(gauges);
    }
}

/// The engine of a server (or of one of its ranks) with its settings.
fn serving_engine<'t, M: Model>(
    model: M,
    tokenizer: &'t Tokenizer,
    set: &Settings,
    num_blocks: usize,
    metrics: &Metrics,
) -> Result<Engine<'t, M>> {
    let cfg = EngineConfig {
        block_size: set.block_size,
        num_blocks,
        batch_size: set.batch_size,
        max_prefill_tokens: set.max_prefill_tokens,
    };
    let mut engine = Engine::new(model, Some(tokenizer), cfg)?;
    if set.mtp > 0 {
        engine.enable_mtp(set.mtp)?;
    }
    let on = engine
        .set_prefix_caching(set.prefix_caching)
        .map_err(|e| anyhow::anyhow!("--prefix-caching on: {e}"))?;
    metrics.set_prefix_caching(on && !set.decode);
    Ok(engine)
}

/// An engine's gauges for `/metrics`: requests running and waiting, KV blocks used and held,
/// tokens generated so far.
fn engine_gauges<M: Model>(engine: &Engine<M>) -> [usize; 5] {
    let sched = engine.scheduler();
    [
        sched.num_running(),
        sched.num_waiting(),
        sched.kv().pool().num_used(),
        sched.kv().pool().capacity(),
        // (A decode server's requests begin with their transferred first tokens: generated
        // tokens, as vLLM's decode instance counts every token of its answers.)
        engine.stats().sampled_tokens + engine.stats().transferred_tokens,
    ]
}

/// What of a request's text and log-probabilities has not gone out yet, after the first `sent`
/// bytes and `sent_lps` entries; None when nothing has. (The text only grows, so `sent` is a
/// char boundary; `get` keeps a surprise from panicking the engine thread.)
fn unsent(
    text: &str,
    lps: &[TokenLogprob],
    sent: usize,
    sent_lps: usize,
) -> Option<(String, Vec<TokenLogprob>)> {
    let new = text.get(sent..).unwrap_or_default();
    let new_lps = lps.get(sent_lps..).unwrap_or_default();
    (!new.is_empty() || !new_lps.is_empty()).then(|| (new.to_string(), new_lps.to_vec()))
}

/// An HTTP error answer: status and OpenAI's error object.
#[derive(Debug)]
struct ApiError {
    status: u16,
    message: String,
    param: Option<&'static str>,
}

impl ApiError {
    /// An error that is not about one field.
    fn new(status: u16, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            message: message.into(),
            param: None,
        }
    }
    fn bad(param: &'static str, message: impl Into<String>) -> ApiError {
        ApiError {
            status: 400,
            message: format!("{param}: {}", message.into()),
            param: Some(param),
        }
    }
    fn body(&self) -> Value {
        let kind = match self.status {
            400 | 405 | 413 => "invalid_request_error",
            404 => "not_found_error",
            _ => "server_error",
        };
        json!({"error": {"message": self.message, "type": kind, "param": self.param,
                         "code": self.status}})
    }
}

fn respond_json(request: tiny_http::Request, status: u16, body: &Value) {
    let header =
        tiny_http::Header::from_bytes("Content-Type", "application/json").expect("a valid header");
    let response = tiny_http::Response::from_string(body.to_string())
        .with_status_code(status)
        .with_header(header)
        .with_header(cors());
    let _ = request.respond(response);
}

/// Any origin may call the API from a browser, as vLLM's default CORS (`--allowed-origins
/// '["*"]'`, no credentials): every answer says so.
pub(crate) fn cors() -> tiny_http::Header {
    tiny_http::Header::from_bytes("Access-Control-Allow-Origin", "*").expect("a valid header")
}

/// The answer to a browser's CORS preflight (`OPTIONS` with `Access-Control-Request-Method`):
/// any origin, these methods, the headers it asks for.
pub(crate) fn preflight(request: tiny_http::Request) {
    let asked = request
        .headers()
        .iter()
        .find(|h| h.field.equiv("Access-Control-Request-Headers"))
        .map(|h| h.value.as_str().to_string())
        .unwrap_or_default();
    let mut response = tiny_http::Response::from_string("OK")
        .with_status_code(200)
        .with_header(cors());
    let mut headers = vec![
        (
            "Access-Control-Allow-Methods",
            "DELETE, GET, HEAD, OPTIONS, PATCH, POST, PUT".to_string(),
        ),
        ("Access-Control-Max-Age", "600".to_string()),
    ];
    if !asked.is_empty() {
        headers.push(("Access-Control-Allow-Headers", asked));
    }
    for (k, v) in headers {
        if let Ok(h) = tiny_http::Header::from_bytes(k, v.as_bytes()) {
            response = response.with_header(h);
        }
    }
    let _ = request.respond(response);
}

/// Answers 413 to a request announcing a body over the limit, whatever its path, before
/// reading any of it. tiny_http 0.12 discards an unread body by allocating a buffer of the
/// announced length (`EqualReader`'s drop): within the memory available that is an ordinary
/// answer (the buffer is virtual until bytes arrive, and the connection closes after it). An
/// absurd `Content-Length` would abort the process there, so that answer goes out through
/// `upgrade` (status, headers, then the error body, unframed: a client reads it to the
/// connection's end) and the request's stream is never dropped: the server leaks that one
/// connection (a thread and a socket) rather than die.
fn refuse_oversized(request: tiny_http::Request, announced: usize) {
    let error = ApiError::new(
        413,
        format!(
            "the request announces a body of {announced} bytes (Content-Length), over the \
             {} MiB limit",
            MAX_BODY_BYTES >> 20
        ),
    );
    let available = cachalot_run::offline::mem_available().unwrap_or(1 << 30);
    if announced as u64 <= available {
        let close = tiny_http::Header::from_bytes("Connection", "close").expect("a valid header");
        let json =
            tiny_http::Header::from_bytes("Content-Type", "application/json").expect("a header");
        let response = tiny_http::Response::from_string(error.body().to_string())
            .with_status_code(413)
            .with_header(json)
            .with_header(close);
        let _ = request.respond(response);
        return;
    }
    let header =
        tiny_http::Header::from_bytes("Content-Type", "application/json").expect("a valid header");
    // (tiny_http writes no body and no Content-Length in an upgrade: the error follows the
    // headers unframed.)
    let response = tiny_http::Response::empty(413).with_header(header);
    let mut stream = request.upgrade("close", response);
    let _ = stream.write_all(error.body().to_string().as_bytes());
    let _ = stream.flush();
    std::mem::forget(stream);
}

/// A URL path segment with its `%XX` escapes decoded (an id's `/` may come as `%2F`); an
/// escape that is not one, or bytes that are not UTF-8, stay as they are.
fn percent_decoded(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let hex = |c: u8| (c as char).to_digit(16);
        match (
            b[i],
            b.get(i + 1).copied().and_then(hex),
            b.get(i + 2).copied().and_then(hex),
        ) {
            (b'%', Some(h), Some(l)) => {
                out.push((h * 16 + l) as u8);
                i += 3;
            }
            (c, _, _) => {
                out.push(c);
                i += 1;
            }
        }
    }
    String::from_utf8(out).unwrap_or_else(|_| s.to_string())
}

/// The served model as `/v1/models` lists it.
fn model_card(shared: &Shared) -> Value {
    json!({"id": shared.name, "object": "model", "created": now(), "owned_by": "cachalot",
           "max_model_len": shared.max_positions})
}

fn handle(mut request: tiny_http::Request, shared: &Shared) {
    if let Some(n) = request.body_length().filter(|&n| n as u64 > MAX_BODY_BYTES) {
        refuse_oversized(request, n);
        return;
    }
    let method = request.method().as_str().to_ascii_uppercase();
    let mut path = request.url().split('?').next().unwrap_or("").to_string();
    // `/v1/models/` is `/v1/models`.
    while path.len() > 1 && path.ends_with('/') {
        path.pop();
    }
    // HEAD is GET without the body (tiny_http leaves the body out of a HEAD's answer).
    let method = if method == "HEAD" {
        "GET".to_string()
    } else {
        method
    };
    // Draining after SIGTERM: what runs finishes, nothing new starts (a load balancer's
    // health check sees it go).
    if crate::term::terminating() {
        let body = if path == "/health" {
            json!({"status": "draining"})
        } else {
            ApiError::new(
                503,
                "the server is shutting down (SIGTERM); send the request to another server",
            )
            .body()
        };
        respond_json(request, 503, &body);
        return;
    }
    let _flight = crate::term::InFlight::enter();
    let result = match (method.as_str(), path.as_str()) {
        ("OPTIONS", _) => {
            preflight(request);
            return;
        }
        ("GET", "/version") => {
            respond_json(request, 200, &json!({"version": env!("CARGO_PKG_VERSION")}));
            return;
        }
        // SageMaker's health check, which vLLM answers as /health.
        ("GET", "/ping") | ("POST", "/ping") => {
            respond_json(request, 200, &json!({}));
            return;
        }
        ("GET", "/health") => {
            let body = json!({"status": "ok", "disaggregation_mode": shared.role.mode(),
                              "kv_port": shared.kv_port});
            respond_json(request, 200, &body);
            return;
        }
        ("GET", "/metrics") => {
            let header = tiny_http::Header::from_bytes(
                "Content-Type",
                "text/plain; version=0.0.4; charset=utf-8",
            )
            .expect("a valid header");
            let body = shared.metrics.render(&shared.name);
            let _ = request.respond(
                tiny_http::Response::from_string(body)
                    .with_header(header)
                    .with_header(cors()),
            );
            return;
        }
        ("GET", "/stats") => {
            let body = json!({"status": "running", "pending_requests": shared.metrics.pending(),
                              "num_workers": shared.metrics.ranks()});
            respond_json(request, 200, &body);
            return;
        }
        ("GET", "/v1/models") => {
            let body = json!({"object": "list", "data": [model_card(shared)]});
            respond_json(request, 200, &body);
            return;
        }
        // One model by its id (OpenAI's `models.retrieve`; an id may hold '/').
        ("GET", p) if p.starts_with("/v1/models/") => {
            let id = percent_decoded(&p["/v1/models/".len()..]);
            if id == shared.name {
                respond_json(request, 200, &model_card(shared));
            } else {
                let e = ApiError {
                    status: 404,
                    message: format!(
                        "the model `{id}` does not exist; this server serves `{}`",
                        shared.name
                    ),
                    param: Some("model"),
                };
                respond_json(request, 404, &e.body());
            }
            return;
        }
        ("POST", "/tokenize") | ("POST", "/detokenize") => {
            let answer = read_body(&mut request).and_then(|body| {
                if path == "/tokenize" {
                    tokenize(shared, &body)
                } else {
                    detokenize(shared, &body)
                }
            });
            match answer {
                Ok(body) => respond_json(request, 200, &body),
                Err(e) => respond_json(request, e.status, &e.body()),
            }
            return;
        }
        ("POST", "/v1/completions") | ("POST", "/v1/chat/completions") => {
            read_body(&mut request).and_then(|body| {
                let boot = bootstrap(shared, &body)?;
                let room = boot.as_ref().map(|b| b.room);
                match prepare(shared, &body, path.ends_with("chat/completions")) {
                    Ok(call) => Ok((call, boot)),
                    Err(e) => {
                        // A decode server that refuses takes the room's KV off the prefill
                        // server's hands (in the background), so it is not kept until it expires.
                        if let (Role::Decode, Some(b)) = (shared.role, boot) {
                            let (timeout, max) = (shared.kv_timeout, shared.kv_max_bytes);
                            std::thread::spawn(move || {
                                let _ = fetch_kv(&b, None, timeout, max, &|| false);
                            });
                            return Err(e);
                        }
                        // The decode server waiting on this room learns why at once.
                        if let (Some(rooms), Some(room)) = (&shared.rooms, room) {
                            if rooms.open(room, 1, None).is_ok() {
                                rooms.set(
                                    room,
                                    RoomState::Failed(format!(
                                        "the prefill server refused the request: {}",
                                        e.message
                                    )),
                                );
                            }
                        }
                        Err(e)
                    }
                }
            })
        }
        (
            _,
            "/health"
            | "/version"
            | "/metrics"
            | "/stats"
            | "/v1/models"
            | "/v1/completions"
            | "/v1/chat/completions"
            | "/tokenize"
            | "/detokenize",
        ) => {
            let allow = match path.as_str() {
                "/health" | "/version" | "/metrics" | "/stats" | "/v1/models" => "GET, HEAD",
                _ => "POST",
            };
            let e = ApiError::new(
                405,
                format!("{method} {path}: method not allowed (this endpoint takes {allow})"),
            );
            let headers = [
                ("Content-Type", "application/json"),
                ("Allow", allow),
                ("Access-Control-Allow-Origin", "*"),
            ];
            let mut response =
                tiny_http::Response::from_string(e.body().to_string()).with_status_code(405);
            for (k, v) in headers {
                response = response
                    .with_header(tiny_http::Header::from_bytes(k, v).expect("a valid header"));
            }
            let _ = request.respond(response);
            return;
        }
        _ => Err(ApiError {
            status: 404,
            message: format!(
                "{path}: no such endpoint (this server has /health, /ping, /version, \
                 /metrics, /stats, /v1/models, /v1/completions, /v1/chat/completions, \
                 /tokenize and /detokenize)"
            ),
            param: None,
        }),
    };
    match result {
        Ok((call, boot)) => run_call(request, shared, call, boot),
        Err(e) => respond_json(request, e.status, &e.body()),
    }
}

/// vLLM's `POST /tokenize`: `{"prompt": text, "add_special_tokens": bool}` (the prompt's ids
/// as a completion request would have them: BOS first where the tokenizer config adds it,
/// unless `add_special_tokens` is false) or `{"messages": [...], "add_generation_prompt":
/// bool, "chat_template_kwargs": {...}, "tools": [...], "tool_choice": ...}` (the chat
/// template's rendering, as a chat request's prompt; `add_special_tokens` defaults to false
/// there, as in vLLM, and true puts a BOS before it); answers `{"count", "max_model_len",
/// "tokens"}`.
fn tokenize(shared: &Shared, body: &Value) -> Result<Value, ApiError> {
    let tok = &shared.tokenizer;
    check_model(shared, body)?;
    let chat = field(body, "messages").is_some();
    let special = add_special(body, chat)?;
    let tokens: Vec<u32> = match (field(body, "prompt"), field(body, "messages")) {
        (Some(Value::String(s)), None) => encode_with_bos(tok, s, special, "prompt")?,
        (None, Some(messages)) => {
            let (template, kwargs) = chat_setup(shared, body, messages)?;
            let (generation, continued) = prompt_ending(body)?;
            // As the chat endpoint (`tool_choice: "none"` too: the tools are shown).
            let tools = field(body, "tools");
            if let Some(problem) = tools.and_then(crate::text::tools_problem) {
                return Err(ApiError::bad("tools", problem));
            }
            let messages = &flatten_text_parts(messages, template);
            // A forced call's start is part of the prompt (as the chat endpoint writes it).
            let text = match read_tool_choice(body, tools)?.0 {
                Some(_) if continued => return Err(forced_with_continued()),
                Some(name) => {
                    forced_call(
                        shared.tool_format,
                        template,
                        messages,
                        tools,
                        &kwargs,
                        &name,
                    )?
                    .prompt
                }
                None => render_chat(template, messages, generation, continued, tools, &kwargs)?,
            };
            encode_with_bos(tok, &text, special, "messages")?
        }
        (Some(Value::String(_)), Some(_)) => {
            return Err(ApiError::bad(
                "messages",
                "give a prompt or messages, not both",
            ))
        }
        (Some(v), _) => {
            return Err(ApiError::bad(
                "prompt",
                format!("expected a string, got {v}"),
            ))
        }
        (None, None) => {
            return Err(ApiError::bad(
                "prompt",
                "required: a prompt (string) or messages (a chat)",
            ))
        }
    };
    Ok(json!({"count": tokens.len(), "max_model_len": shared.max_positions, "tokens": tokens}))
}

/// A forced tool call cannot continue a final message.
fn forced_with_continued() -> ApiError {
    ApiError::bad(
        "continue_final_message",
        "cannot be combined with a forced tool call (tool_choice)",
    )
}

/// A request's `tool_choice`: the forced call (Some(None) for any tool, "required";
/// Some(Some(name)) for a named one) and whether the answer is read for calls ("none": not).
fn read_tool_choice(
    body: &Value,
    tools: Option<&Value>,
) -> Result<(Option<Option<String>>, bool), ApiError> {
    let mut forced: Option<Option<String>> = None;
    let mut reads_calls = true;
    match field(body, "tool_choice") {
        None => {}
        Some(Value::String(c)) if c == "auto" => {}
        // As vLLM by default: the tools are shown to the model, its answer is not read for
        // calls.
        Some(Value::String(c)) if c == "none" => reads_calls = false,
        Some(Value::String(c)) if c == "required" => forced = Some(None),
        Some(Value::Object(o))
            if o.get("type").and_then(Value::as_str).unwrap_or("function") == "function"
                && o.get("function")
                    .and_then(|f| f.get("name"))
                    .is_some_and(Value::is_string) =>
        {
            let name = o["function"]["name"]
                .as_str()
                .unwrap_or_default()
                .to_string();
            let known = tools.and_then(Value::as_array).is_some_and(|ts| {
                ts.iter()
                    .any(|t| t["function"]["name"].as_str() == Some(name.as_str()))
            });
            if !known {
                return Err(ApiError::bad(
                    "tool_choice",
                    format!("{name:?} is not one of the request's tools"),
                ));
            }
            forced = Some(Some(name));
        }
        Some(v) => {
            return Err(ApiError::bad(
                "tool_choice",
                format!(
                    "{v}: expected \"auto\", \"none\", \"required\" or {{\"type\": \
                     \"function\", \"function\": {{\"name\": ...}}}}"
                ),
            ))
        }
    }
    if forced.is_some() && tools.and_then(Value::as_array).is_none_or(|t| t.is_empty()) {
        return Err(ApiError::bad(
            "tool_choice",
            "a forced call needs the request's tools",
        ));
    }
    Ok((forced, reads_calls))
}

/// `text`'s ids, after the tokenizer config's BOS when `bos` (errors name `param`).
fn encode_with_bos(
    tok: &Tokenizer,
    text: &str,
    bos: bool,
    param: &'static str,
) -> Result<Vec<u32>, ApiError> {
    let mut v: Vec<u32> = if bos {
        tok.prompt_bos_id().into_iter().collect()
    } else {
        Vec::new()
    };
    v.extend(
        tok.encode(text)
            .map_err(|e| ApiError::bad(param, e.to_string()))?,
    );
    Ok(v)
}

/// vLLM's `add_special_tokens`: whether the tokenizer's own special tokens (its BOS) go before
/// the prompt's text. Default true for a completion's text, false for a chat, whose template
/// writes them (true there puts a BOS before the rendering, as vLLM does).
fn add_special(body: &Value, chat: bool) -> Result<bool, ApiError> {
    match field(body, "add_special_tokens") {
        None => Ok(!chat),
        Some(Value::Bool(b)) => Ok(*b),
        Some(v) => Err(ApiError::bad(
            "add_special_tokens",
            format!("expected true or false, got {v}"),
        )),
    }
}

/// A request's `model`, when given, must be this server's (404 otherwise, as OpenAI's; 400 for
/// one that is not a name).
fn check_model(shared: &Shared, body: &Value) -> Result<(), ApiError> {
    match field(body, "model") {
        Some(m) if !m.is_string() => Err(ApiError::bad(
            "model",
            format!("expected a model name (a string), got {m}"),
        )),
        Some(m) if m.as_str() != Some(shared.name.as_str()) => Err(ApiError {
            status: 404,
            message: format!("model {m}: this server serves {:?}", shared.name),
            param: Some("model"),
        }),
        _ => Ok(()),
    }
}

/// A chat request's checked messages, the server's template and the request's
/// `chat_template_kwargs`.
fn chat_setup<'s>(
    shared: &'s Shared,
    body: &Value,
    messages: &Value,
) -> Result<(&'s ChatTemplate, Map<String, Value>), ApiError> {
    check_messages(messages)?;
    let Some(template) = &shared.template else {
        return Err(ApiError::bad("messages", shared.template_error.clone()));
    };
    let mut kwargs = match field(body, "chat_template_kwargs") {
        None => Map::new(),
        Some(Value::Object(o)) => o.clone(),
        Some(v) => {
            return Err(ApiError::bad(
                "chat_template_kwargs",
                format!("expected an object, got {v}"),
            ))
        }
    };
    // OpenAI's `reasoning_effort` reaches the template (DeepSeek-V4's encoder reads it: `max`
    // writes its preamble, `none` turns thinking off) unless chat_template_kwargs gives one.
    match field(body, "reasoning_effort") {
        None | Some(Value::Null) => {}
        Some(v @ Value::String(_)) => {
            kwargs
                .entry("reasoning_effort")
                .or_insert_with(|| v.clone());
        }
        Some(v) => {
            return Err(ApiError::bad(
                "reasoning_effort",
                format!("expected a string such as \"high\", got {v}"),
            ))
        }
    }
    Ok((template, kwargs))
}

/// vLLM's `POST /detokenize`: `{"tokens": [ids]}` → `{"prompt": text}` (special tokens
/// included, as their text).
fn detokenize(shared: &Shared, body: &Value) -> Result<Value, ApiError> {
    check_model(shared, body)?;
    let tok = &shared.tokenizer;
    let vocab = tok.vocab_size();
    let Some(Value::Array(a)) = field(body, "tokens") else {
        return Err(ApiError::bad("tokens", "required: a list of token ids"));
    };
    let ids = a
        .iter()
        .map(|v| match whole_number(v) {
            // (Ids need not be dense: a tokenizer may number its special tokens past a gap.)
            Some(x) if x <= u32::MAX as u64 && tok.id_to_token(x as u32).is_some() => Ok(x as u32),
            _ => Err(ApiError::bad(
                "tokens",
                format!("{v} is not a token id of the vocabulary ({vocab} ids)"),
            )),
        })
        .collect::<Result<Vec<u32>, _>>()?;
    let text = tok
        .decode(&ids)
        .map_err(|e| ApiError::bad("tokens", e.to_string()))?;
    Ok(json!({"prompt": text}))
}

/// The bootstrap fields the role needs: the prefill role a `bootstrap_room`, the decode role
/// also the prefill server's `bootstrap_host` and `bootstrap_port` (its `--kv-port`); `cachalot
/// router` fills them in. None for the whole-request role, which refuses them.
fn bootstrap(shared: &Shared, body: &Value) -> Result<Option<Bootstrap>, ApiError> {
    if shared.role == Role::Both {
        // A request meant for a decode server (a router's, whose decode server was replaced
        // by one of its own): answered here, its prefilled KV would wait on the prefill
        // server unfetched; refused, the router drops it.
        return match ["bootstrap_room", "bootstrap_host", "bootstrap_port"]
            .into_iter()
            .find(|k| field(body, k).is_some())
        {
            Some(k) => Err(ApiError::bad(
                k,
                "this server serves requests whole (started without --role): bootstrap fields \
                 are for the prefill and decode servers behind `cachalot router` (`cachalot \
                 serve --role prefill` or `--role decode`)",
            )),
            None => Ok(None),
        };
    }
    let hint = "send requests through `cachalot router`, which fills in the bootstrap fields";
    let room = match field(body, "bootstrap_room") {
        Some(v) => v.as_u64().ok_or_else(|| {
            ApiError::bad(
                "bootstrap_room",
                format!("expected a non-negative integer, got {v}"),
            )
        })?,
        None => {
            return Err(ApiError::bad(
                "bootstrap_room",
                format!("required by a {} server: {hint}", shared.role.mode()),
            ))
        }
    };
    if shared.role == Role::Prefill {
        return Ok(Some(Bootstrap {
            room,
            host: String::new(),
            port: 0,
        }));
    }
    let host = match field(body, "bootstrap_host") {
        // `host:port` (one colon; an IPv6 address has several): the port goes on its own.
        Some(Value::String(h)) if h.matches(':').count() == 1 && !h.starts_with('[') => {
            return Err(ApiError::bad(
                "bootstrap_host",
                format!(
                    "{h:?} holds a port: give the prefill server's host alone, and its \
                     --kv-port in bootstrap_port"
                ),
            ))
        }
        Some(Value::String(h)) if !h.is_empty() => h.clone(),
        Some(v) => {
            return Err(ApiError::bad(
                "bootstrap_host",
                format!("expected the prefill server's host name, got {v}"),
            ))
        }
        None => {
            return Err(ApiError::bad(
                "bootstrap_host",
                format!("required by a decode server: {hint}"),
            ))
        }
    };
    let port = match field(body, "bootstrap_port") {
        Some(v) => v
            .as_u64()
            .filter(|&p| (1..=65535).contains(&p))
            .map(|p| p as u16)
            .ok_or_else(|| {
                ApiError::bad(
                    "bootstrap_port",
                    format!("expected the prefill server's --kv-port, got {v}"),
                )
            })?,
        None => {
            return Err(ApiError::bad(
                "bootstrap_port",
                format!("required by a decode server: {hint}"),
            ))
        }
    };
    Ok(Some(Bootstrap { room, host, port }))
}

/// What a decode server sends on a prefill server's KV port: this, then the room (u64 LE). The
/// answer: status 0, the number of choices (u32 LE) and each choice's snapshot; or status 1 and
/// why not. (Version 2: version 1 answered one snapshot.)
const KV_GET: &[u8; 8] = b"CKV-GET2";

/// [`KV_GET`] with the fingerprint of the request's prompts after the room (u64 LE,
/// [`prompts_fingerprint`]): a room holding another request's KV (two requests that named the
/// same room) answers why without giving it away, so it stays for its own request.
const KV_GET_CHECKED: &[u8; 8] = b"CKV-GET3";

/// FNV-1a over the choices' prompts in order (each prompt's token ids, then its length): what a
/// decode server's request and the prefill server's KV of the same request both give.
fn prompts_fingerprint<'a>(prompts: impl Iterator<Item = &'a [u32]>) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut eat = |b: &[u8]| {
        for &x in b {
            h = (h ^ u64::from(x)).wrapping_mul(0x0000_0100_0000_01b3);
        }
    };
    for p in prompts {
        for t in p {
            eat(&t.to_le_bytes());
        }
        eat(&(p.len() as u64).to_le_bytes());
    }
    h
}

/// What a router sends on a prefill server's KV port when the decode server of a room refused
/// its request, could not be reached or failed: this, then the room (u64 LE). The prefill
/// server drops the room's KV (or aborts the prefill under way) at once rather than hold it
/// for `--kv-timeout-s`, and answers one byte: 0, or [`KV_DROP_NONE`] where the room held
/// nothing (the router then drops it again once the prefill has answered).
pub(crate) const KV_DROP: &[u8; 8] = b"CKV-DROP";

/// The answer to [`KV_DROP`] where the room held nothing to drop (not yet opened, or gone).
pub(crate) const KV_DROP_NONE: u8 = 2;

/// What a prefill server's KV port writes first on every connection, so that a decode server
/// pointed at another port (an HTTP port, say) learns it at once rather than after its wait.
pub(crate) const KV_HELLO: &[u8; 8] = b"CKV-PORT";

/// A decode server still waiting for a prefill's KV when its drain's grace is this close to
/// its end answers 503 (rather than leave the client an empty reply when the process exits).
const DRAIN_ANSWER_MARGIN: Duration = Duration::from_millis(1500);

/// How long a decode server waits for [`KV_HELLO`] after connecting.
const KV_HELLO_WAIT: Duration = Duration::from_secs(10);

/// The prefill role's KV port: each connection names a room, waits for its prefills and gets
/// their KVs (status byte 0, the number of choices as a u32, then a snapshot per choice) or why
/// there are none (1, a u32 length, the text).
fn serve_kv(listener: TcpListener, rooms: Arc<Rooms>) {
    for conn in listener.incoming() {
        let Ok(mut conn) = conn else { continue };
        let rooms = rooms.clone();
        std::thread::spawn(move || {
            let _ = conn.set_read_timeout(Some(Duration::from_secs(30)));
            if conn.write_all(KV_HELLO).is_err() {
                return;
            }
            let mut ask = [0u8; 16];
            let read = conn.read_exact(&mut ask);
            if read.is_ok() && &ask[..8] == KV_DROP {
                let room = u64::from_le_bytes(ask[8..].try_into().expect("8 bytes"));
                let released = rooms.release(room);
                if released {
                    say!(
                        "cachalot serve: bootstrap_room {room}: its decode server did not take \
                         the request or its client left (the router says); its KV is dropped"
                    );
                }
                let _ = conn.write_all(&[if released { 0 } else { KV_DROP_NONE }]);
                return;
            }
            let checked = read.is_ok() && &ask[..8] == KV_GET_CHECKED;
            if read.is_err() || (&ask[..8] != KV_GET && !checked) {
                let _ = send_kv_error(
                    &mut conn,
                    "not a KV request (expected CKV-GET3 or CKV-GET2 + room; is the decode \
                     server the same version of cachalot?)",
                );
                return;
            }
            let mut fingerprint = None;
            if checked {
                let mut f = [0u8; 8];
                if conn.read_exact(&mut f).is_err() {
                    return;
                }
                fingerprint = Some(u64::from_le_bytes(f));
            }
            let room = u64::from_le_bytes(ask[8..].try_into().expect("8 bytes"));
            let mut w = std::io::BufWriter::with_capacity(1 << 20, &mut conn);
            let sent = match rooms.take(room, fingerprint) {
                Ok(kvs) => (|| -> anyhow::Result<()> {
                    w.write_all(&[0])?;
                    w.write_all(&(kvs.len() as u32).to_le_bytes())?;
                    for kv in &kvs {
                        kv.write_to(&mut w)?;
                    }
                    Ok(w.flush()?)
                })(),
                Err(m) => send_kv_error(&mut w, &m).map_err(anyhow::Error::from),
            };
            if let Err(e) = sent {
                say!("cachalot serve: KV of bootstrap_room {room} not delivered: {e}");
            }
        });
    }
}

/// A connection to HOST:PORT `at` whose connecting, reads and writes each wait at most `wait`.
pub(crate) fn connect_within(at: &str, wait: Duration) -> std::io::Result<TcpStream> {
    let addr = std::net::ToSocketAddrs::to_socket_addrs(at)?
        .next()
        .ok_or_else(|| std::io::Error::from(std::io::ErrorKind::NotFound))?;
    let conn = TcpStream::connect_timeout(&addr, wait)?;
    conn.set_read_timeout(Some(wait))?;
    conn.set_write_timeout(Some(wait))?;
    Ok(conn)
}

/// Whether `at` answers an HTTP request within a couple of seconds (an HTTP port given where
/// a KV port was meant).
fn answers_http(at: &str) -> bool {
    let probe = || -> std::io::Result<bool> {
        let mut conn = connect_within(at, Duration::from_secs(2))?;
        conn.write_all(b"GET /health HTTP/1.0\r\n\r\n")?;
        let mut head = [0u8; 5];
        conn.read_exact(&mut head)?;
        Ok(&head == b"HTTP/")
    };
    probe().unwrap_or(false)
}

fn send_kv_error(w: &mut impl Write, message: &str) -> std::io::Result<()> {
    w.write_all(&[1])?;
    w.write_all(&(message.len() as u32).to_le_bytes())?;
    w.write_all(message.as_bytes())?;
    w.flush()
}

/// The decode role: fetches `boot.room`'s prefilled KVs (one per choice, in order) from the
/// prefill server, waiting up to `timeout` for them (`--kv-timeout-s`); `give_up` is asked
/// about twice a second while it waits (the server is draining and its grace is ending) and
/// ends the wait with [`FetchError::GaveUp`].
fn fetch_kv(
    boot: &Bootstrap,
    fingerprint: Option<u64>,
    timeout: Duration,
    max_bytes: u64,
    give_up: &dyn Fn() -> bool,
) -> Result<Vec<KvSnapshot>, FetchError> {
    // An IPv6 address goes in brackets before the port.
    let at = if boot.host.contains(':') && !boot.host.starts_with('[') {
        format!("[{}]:{}", boot.host, boot.port)
    } else {
        format!("{}:{}", boot.host, boot.port)
    };
    let fail = |e: &dyn std::fmt::Display| {
        FetchError::Failed(format!(
            "the KV of bootstrap_room {} from the prefill server at {at}: {e}",
            boot.room
        ))
    };
    let io = |e: std::io::Error| match e.kind() {
        std::io::ErrorKind::UnexpectedEof
        | std::io::ErrorKind::ConnectionReset
        | std::io::ErrorKind::ConnectionAborted
        | std::io::ErrorKind::BrokenPipe => fail(&format!(
            "the prefill server closed the connection before sending it (did it stop?): {e}"
        )),
        _ => fail(&e),
    };
    let mut conn = TcpStream::connect(&at).map_err(|e| fail(&e))?;
    let _ = conn.set_nodelay(true);
    // A KV port greets first; anything else is said now. An HTTP port answers nothing until
    // it has a request's head: a port silent for a second is asked an HTTP question (a
    // prefill server too busy to greet at once still has the rest of the wait).
    let not_kv = |what: String| {
        fail(&format!(
            "{what}: this is not a prefill server's KV port (its HTTP port?); bootstrap_port is \
             the prefill server's --kv-port, which its /health shows as kv_port"
        ))
    };
    let _ = conn.set_read_timeout(Some(Duration::from_secs(1)));
    let mut hello = [0u8; 8];
    let mut first = [0u8; 1];
    let early = match conn.read(&mut first) {
        Ok(1) => Ok(1),
        Ok(_) => Err(std::io::Error::from(std::io::ErrorKind::UnexpectedEof)),
        Err(e) if waited_out(&e) => {
            if answers_http(&at) {
                return Err(not_kv("it answers HTTP".into()));
            }
            let _ = conn.set_read_timeout(Some(KV_HELLO_WAIT));
            Ok(0)
        }
        Err(e) => Err(e),
    };
    let got = early.and_then(|n| {
        hello[..n].copy_from_slice(&first[..n]);
        conn.read_exact(&mut hello[n..])
    });
    match got {
        Ok(()) if &hello == KV_HELLO => {}
        Ok(()) => {
            return Err(not_kv(format!(
                "it answered {:?}",
                String::from_utf8_lossy(&hello)
            )))
        }
        Err(e) if waited_out(&e) => {
            return Err(fail(&format!(
                "the port took the connection but sent nothing within {} s, and answers no \
                 HTTP either: the prefill server is stopped (SIGSTOP, a debugger) or too loaded \
                 to answer (or the port is another program's)",
                KV_HELLO_WAIT.as_secs() + 1
            )));
        }
        Err(e) => return Err(io(e)),
    }
    let mut ask = match fingerprint {
        Some(_) => KV_GET_CHECKED.to_vec(),
        None => KV_GET.to_vec(),
    };
    ask.extend_from_slice(&boot.room.to_le_bytes());
    if let Some(f) = fingerprint {
        ask.extend_from_slice(&f.to_le_bytes());
    }
    conn.write_all(&ask).map_err(io)?;
    // Wait for the first byte in short slices, to notice a drain's end.
    let deadline = std::time::Instant::now() + timeout;
    let slice = Duration::from_millis(500);
    let mut status = [0u8; 1];
    loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        if left.is_zero() {
            return Err(fail(&format!(
                "no answer within {} s (this server's --kv-timeout-s): the prefill server has \
                 not prefilled the room (was the request sent to it, with the same \
                 bootstrap_room?)",
                timeout.as_secs()
            )));
        }
        if give_up() {
            return Err(FetchError::GaveUp);
        }
        let _ = conn.set_read_timeout(Some(left.min(slice)));
        match conn.read(&mut status) {
            Ok(1) => break,
            Ok(_) => return Err(io(std::io::Error::from(std::io::ErrorKind::UnexpectedEof))),
            Err(e) if waited_out(&e) || e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(io(e)),
        }
    }
    // The rest comes at once: a stalled transfer ends after a while.
    let _ = conn.set_read_timeout(Some(Duration::from_secs(60)));
    let mut r = std::io::BufReader::with_capacity(1 << 20, conn);
    match status[0] {
        0 => {}
        1 => {
            let mut len = [0u8; 4];
            r.read_exact(&mut len).map_err(io)?;
            let mut msg = Vec::new();
            r.take(u32::from_le_bytes(len).min(1 << 20) as u64)
                .read_to_end(&mut msg)
                .map_err(io)?;
            return Err(FetchError::Failed(
                String::from_utf8_lossy(&msg).into_owned(),
            ));
        }
        other => return Err(fail(&format!("an answer that starts with byte {other}"))),
    }
    let mut count = [0u8; 4];
    r.read_exact(&mut count).map_err(io)?;
    let count = u32::from_le_bytes(count) as usize;
    if count == 0 || count > MAX_CHOICES_TOTAL {
        return Err(fail(&format!(
            "{count} choices (expected 1 to {MAX_CHOICES_TOTAL})"
        )));
    }
    (0..count)
        .map(|_| KvSnapshot::read_from(&mut r, max_bytes).map_err(|e| fail(&e)))
        .collect()
}

/// A read that ended at its socket's timeout (Linux says WouldBlock, others TimedOut).
fn waited_out(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
    )
}

/// Why a decode server has no KV for a request.
#[derive(Debug)]
enum FetchError {
    /// The prefill server refused, or the transfer failed (a 502).
    Failed(String),
    /// The server is draining and its grace ends before the KV came (a 503).
    GaveUp,
}

fn read_body(request: &mut tiny_http::Request) -> Result<Value, ApiError> {
    let mut bytes = Vec::new();
    request
        .as_reader()
        .take(MAX_BODY_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| ApiError::new(400, format!("cannot read the request body: {e}")))?;
    if bytes.len() as u64 > MAX_BODY_BYTES {
        return Err(ApiError::new(
            413,
            format!("the request body is over {} MiB", MAX_BODY_BYTES >> 20),
        ));
    }
    let v: Value = serde_json::from_slice(&bytes).map_err(|e| {
        // serde_json names a lone UTF-16 surrogate (`"\ud800"`, which Python's json writes
        // for a str holding one) as a broken escape: said plainly.
        let surrogate = e.to_string().contains("hex escape")
            && bytes.windows(4).any(|w| {
                w[..2] == *b"\\u"
                    && w[2].eq_ignore_ascii_case(&b'd')
                    && matches!(w[3].to_ascii_lowercase(), b'8'..=b'9' | b'a'..=b'f')
            });
        ApiError::new(
            400,
            format!(
                "the body is not valid JSON: {e}{}",
                if surrogate {
                    " (a \\uD800-\\uDFFF escape must be half of a surrogate pair: a lone \
                     surrogate is not text; send the text as UTF-8)"
                } else {
                    ""
                }
            ),
        )
    })?;
    if !v.is_object() {
        return Err(ApiError::new(400, "the body must be a JSON object"));
    }
    Ok(v)
}

impl Call {
    /// Choices over all prompts.
    fn choices(&self) -> usize {
        self.prompts.len() * self.n
    }

    /// Prompt tokens of the request, each prompt counted once.
    fn prompt_tokens(&self) -> usize {
        self.prompts.iter().map(|p| p.0.len()).sum()
    }
}

/// A request read and checked, ready for the engine.
struct Call {
    chat: bool,
    /// A forced tool call's start, written into the prompt: the answer is read as this plus
    /// what the model writes after it.
    forced_prefix: String,
    /// A forced call whose arguments are held to one JSON object: the call's closing markup,
    /// which the answer gets after the object (the model may write nothing but a stop token
    /// there).
    forced_suffix: String,
    /// Choices (`n`): the request runs that many times, each sampling on its own.
    n: usize,
    /// Alternatives per token to report log-probabilities of (None: no log-probabilities).
    logprobs: Option<usize>,
    /// vLLM's `prompt_logprobs`: alternatives per prompt token to report (None: not asked).
    prompt_logprobs: Option<usize>,
    /// Completions' `echo`: the prompt goes before the answer, with its log-probabilities when
    /// asked; `score_only` (echo with `max_tokens: 0`): the prompt alone, nothing generated.
    echo: bool,
    score_only: bool,
    stream: bool,
    include_usage: bool,
    /// vLLM's `stream_options.continuous_usage_stats` (with `include_usage`): every chunk
    /// carries its choice's usage so far.
    continuous_usage: bool,
    /// vLLM's `ignore_eos`: the EOS stops the answer only where `stop_token_ids` lists it.
    eos_ignored: bool,
    /// A chat answer's role (vLLM's: the assistant's, or with `add_generation_prompt: false`
    /// the final message's).
    response_role: String,
    /// A chat's `echo`: the final message's text (when its role is the answer's), which goes
    /// before the answer's content.
    echo_text: String,
    /// vLLM's `return_tokens_as_token_ids`: log-probabilities name tokens `token_id:ID`.
    token_ids: bool,
    /// Every prompt (completions take a list; each gets `n` choices, prompt i's being choices
    /// `i·n..(i+1)·n`) with its text as given (what `echo` repeats; chat: the rendered prompt).
    prompts: Vec<(Vec<u32>, String)>,
    /// The rendered chat prompt (to know whether it opens a reasoning block).
    prompt_text: String,
    /// `continue_final_message`: the prompt ends inside the final message (in its reasoning,
    /// where that is all it has).
    continued: bool,
    tools: bool,
    /// `parallel_tool_calls: false`: the answer's first tool call only (vLLM's reading: later
    /// ones are dropped; a "required" answer is held to one).
    one_call: bool,
    request: Request,
}

fn field<'a>(body: &'a Value, key: &str) -> Option<&'a Value> {
    body.get(key).filter(|v| !v.is_null())
}

fn number(body: &Value, key: &'static str, lo: f64, hi: f64) -> Result<Option<f64>, ApiError> {
    match field(body, key) {
        None => Ok(None),
        Some(v) => match v.as_f64() {
            Some(x) if (lo..=hi).contains(&x) => Ok(Some(x)),
            _ => Err(ApiError::bad(
                key,
                format!("expected a number from {lo} to {hi}, got {v}"),
            )),
        },
    }
}

fn count(body: &Value, key: &'static str) -> Result<Option<usize>, ApiError> {
    match field(body, key) {
        None => Ok(None),
        // As vLLM's request models read an integer (pydantic's lax mode): a whole number
        // written as a float (5.0) or as a string of digits ("5") is that integer.
        Some(v) => match whole_number(v) {
            Some(x) => Ok(Some(x as usize)),
            None => Err(ApiError::bad(
                key,
                format!("expected a non-negative integer, got {v}"),
            )),
        },
    }
}

/// An integer as vLLM's request models read one ([`whole_number`], or negative: `-1`, `-1.0`,
/// `"-1"`).
fn integer(v: &Value) -> Option<i64> {
    match v {
        Value::Number(n) => n.as_i64().or_else(|| {
            n.as_f64()
                .filter(|f| f.fract() == 0.0 && f.abs() <= 9_007_199_254_740_992.0)
                .map(|f| f as i64)
        }),
        Value::String(s) => {
            let digits = s.strip_prefix('-').unwrap_or(s);
            if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
                return None;
            }
            s.parse().ok()
        }
        _ => None,
    }
}

/// A non-negative integer as JSON gives one: an integer, a float without a fraction (up to
/// 2^53, where floats are still exact), or a string of decimal digits.
fn whole_number(v: &Value) -> Option<u64> {
    match v {
        Value::Number(n) => n.as_u64().or_else(|| {
            n.as_f64()
                .filter(|f| *f >= 0.0 && f.fract() == 0.0 && *f <= 9_007_199_254_740_992.0)
                .map(|f| f as u64)
        }),
        Value::String(s) if !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()) => {
            s.parse().ok()
        }
        _ => None,
    }
}

fn flag(body: &Value, key: &'static str) -> Result<bool, ApiError> {
    match field(body, key) {
        None => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(v) => Err(ApiError::bad(
            key,
            format!("expected true or false, got {v}"),
        )),
    }
}

/// `x` as an f32, a positive `x` below f32's range as its least positive normal value rather
/// than 0 (vLLM takes a positive double such as 1e-300 where 0 is refused).
fn positive_f32(x: f64) -> f32 {
    let f = x as f32;
    if x > 0.0 && f < f32::MIN_POSITIVE {
        f32::MIN_POSITIVE
    } else {
        f
    }
}

/// vLLM's `allowed_token_ids`: a non-empty list of token ids, the only ones the answer may
/// take (sorted, without repeats).
fn allowed_token_ids(body: &Value, vocab: usize) -> Result<Vec<u32>, ApiError> {
    let Some(v) = field(body, "allowed_token_ids") else {
        return Ok(Vec::new());
    };
    let bad = |why: String| ApiError::bad("allowed_token_ids", why);
    let a = v
        .as_array()
        .ok_or_else(|| bad(format!("expected a list of token ids, got {v}")))?;
    if a.is_empty() {
        return Err(bad(
            "an empty list leaves no token to write: leave it out".into()
        ));
    }
    let mut ids = a
        .iter()
        .map(|t| match whole_number(t) {
            Some(id) if (id as usize) < vocab => Ok(id as u32),
            _ => Err(bad(format!(
                "{t} is not a token id of this model's vocabulary of {vocab}"
            ))),
        })
        .collect::<Result<Vec<u32>, _>>()?;
    ids.sort_unstable();
    ids.dedup();
    Ok(ids)
}

/// vLLM's `bad_words`: each word as the token sequences it is written with, as vLLM tokenizes
/// it: the word (leading whitespace dropped) alone, and after a space where that spelling starts
/// with another token and has as many tokens.
fn bad_words(tok: &Tokenizer, body: &Value) -> Result<Vec<Vec<u32>>, ApiError> {
    let Some(v) = field(body, "bad_words") else {
        return Ok(Vec::new());
    };
    let bad = |why: String| ApiError::bad("bad_words", why);
    let words = match v {
        Value::String(w) => vec![w.as_str()],
        Value::Array(a) => a
            .iter()
            .map(|w| {
                w.as_str()
                    .ok_or_else(|| bad(format!("{w} is not a string")))
            })
            .collect::<Result<_, _>>()?,
        _ => return Err(bad(format!("expected a list of strings, got {v}"))),
    };
    let mut out: Vec<Vec<u32>> = Vec::new();
    for w in words {
        let w = w.trim_start();
        let plain = encode_with_bos(tok, w, false, "bad_words")?;
        if plain.is_empty() {
            return Err(bad(format!("{w:?} has no tokens: give words to keep out")));
        }
        let spaced = encode_with_bos(tok, &format!(" {w}"), false, "bad_words")?;
        let keep_spaced = spaced.first() != plain.first() && spaced.len() == plain.len();
        out.push(plain);
        if keep_spaced {
            out.push(spaced);
        }
    }
    Ok(out)
}

/// OpenAI's `logit_bias`: an object from token ids (its keys, decimal strings) to a bias from
/// −100 to 100 added to that token's logit; sorted by id, each id once.
fn logit_bias(body: &Value, vocab: usize) -> Result<Vec<(u32, f32)>, ApiError> {
    let Some(v) = field(body, "logit_bias") else {
        return Ok(Vec::new());
    };
    let Some(map) = v.as_object() else {
        return Err(ApiError::bad(
            "logit_bias",
            format!("expected an object from token ids to biases, got {v}"),
        ));
    };
    let mut out = Vec::with_capacity(map.len());
    for (key, bias) in map {
        let id = match key.trim().parse::<u64>() {
            Ok(id) if (id as usize) < vocab => id as u32,
            Ok(id) => {
                return Err(ApiError::bad(
                    "logit_bias",
                    format!("token id {id} is out of the vocabulary ({vocab} ids)"),
                ))
            }
            Err(_) => {
                return Err(ApiError::bad(
                    "logit_bias",
                    format!("key {key:?} is not a token id"),
                ))
            }
        };
        match bias.as_f64() {
            Some(b) if (-100.0..=100.0).contains(&b) => out.push((id, b as f32)),
            _ => {
                return Err(ApiError::bad(
                    "logit_bias",
                    format!("token {id}: expected a bias from -100 to 100, got {bias}"),
                ))
            }
        }
    }
    out.sort_unstable_by_key(|&(id, _)| id);
    if let Some(w) = out.windows(2).find(|w| w[0].0 == w[1].0) {
        return Err(ApiError::bad(
            "logit_bias",
            format!("token id {} is given twice", w[0].0),
        ));
    }
    Ok(out)
}

/// Fields of a completion or chat request this server reads, or knows from OpenAI's API and
/// leaves unused (`user`, `metadata`, ...); any other is logged as ignored, as vLLM logs
/// them (a misspelt `max_tokns` is not an error, but is said).
const KNOWN_FIELDS: [&str; 64] = [
    "model",
    "prompt",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "n",
    "stream",
    "stream_options",
    "stop",
    "stop_token_ids",
    "seed",
    "logprobs",
    "top_logprobs",
    "echo",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "ignore_eos",
    "min_tokens",
    "response_format",
    "tools",
    "tool_choice",
    "chat_template_kwargs",
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "skip_special_tokens",
    "include_stop_str_in_output",
    "return_tokens_as_token_ids",
    "prompt_logprobs",
    "allowed_token_ids",
    "bad_words",
    "truncate_prompt_tokens",
    "use_beam_search",
    "length_penalty",
    "chat_template",
    "guided_json",
    "structured_outputs",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "bootstrap_host",
    "bootstrap_port",
    "bootstrap_room",
    "best_of",
    "suffix",
    "user",
    "metadata",
    "store",
    "service_tier",
    "parallel_tool_calls",
    "modalities",
    "audio",
    "prediction",
    "reasoning_effort",
    "web_search_options",
    "functions",
    "function_call",
    "guided_whitespace_pattern",
];

/// vLLM's `guided_json`, `structured_outputs: {"json" | "json_object"}` on top of
/// `response_format`'s (`json_object`, `json_schema`): the JSON mode and schema they ask for.
/// Their regex, choice and grammar forms are refused by name.
fn vllm_structured_outputs(
    body: &Value,
    json_object: bool,
    json_schema: Option<Value>,
) -> Result<(bool, Option<Value>), ApiError> {
    for key in ["guided_regex", "guided_choice", "guided_grammar"] {
        if field(body, key).is_some() {
            return Err(ApiError::bad(
                key,
                "not supported: structured output here is JSON (response_format, guided_json)",
            ));
        }
    }
    if field(body, "guided_whitespace_pattern").is_some() {
        return Err(ApiError::bad(
            "guided_whitespace_pattern",
            "not supported: structured output allows JSON's whitespace, in runs of at most 64 \
             bytes inside a value and 2 around it",
        ));
    }
    // OpenAI's deprecated function calling: a call it asks for would not be forced, nor its
    // functions shown to the model.
    for key in ["functions", "function_call"] {
        if field(body, key).is_some() {
            return Err(ApiError::bad(
                key,
                "the deprecated function-calling fields are not read: send `tools` \
                 ([{\"type\": \"function\", \"function\": {...}}]) and `tool_choice`",
            ));
        }
    }
    let schema_of = |key: &'static str, v: &Value| -> Result<Value, ApiError> {
        let schema = match v {
            Value::String(t) => serde_json::from_str(t)
                .map_err(|e| ApiError::bad(key, format!("not a JSON schema: {e}")))?,
            other => other.clone(),
        };
        cachalot_engine::json_schema::Schema::compile(&schema)
            .map_err(|e| ApiError::bad(key, e.to_string()))?;
        Ok(schema)
    };
    let asked = match (
        field(body, "guided_json"),
        field(body, "structured_outputs"),
    ) {
        (None, None) => return Ok((json_object, json_schema)),
        (Some(_), Some(_)) => {
            return Err(ApiError::bad(
                "guided_json",
                "give guided_json or structured_outputs, not both",
            ))
        }
        (Some(v), None) => Some(schema_of("guided_json", v)?),
        (None, Some(so)) => {
            let Some(o) = so.as_object() else {
                return Err(ApiError::bad(
                    "structured_outputs",
                    format!("expected an object such as {{\"json\": {{...}}}}, got {so}"),
                ));
            };
            if let Some(k) = o
                .keys()
                .find(|k| !matches!(k.as_str(), "json" | "json_object"))
            {
                return Err(ApiError::bad(
                    "structured_outputs",
                    format!(
                        "{k} is not supported: structured output here is JSON (json, json_object)"
                    ),
                ));
            }
            match (o.get("json"), o.get("json_object")) {
                (Some(v), None) => Some(schema_of("structured_outputs", v)?),
                (None, Some(Value::Bool(true))) => None,
                _ => {
                    return Err(ApiError::bad(
                        "structured_outputs",
                        "expected {\"json\": SCHEMA} or {\"json_object\": true}",
                    ))
                }
            }
        }
    };
    if json_object {
        return Err(ApiError::bad(
            "response_format",
            "give response_format or guided_json/structured_outputs, not both",
        ));
    }
    Ok((true, asked))
}

/// Reads a completion or chat request: its prompt (tokenized), sampling and stop fields.
fn prepare(shared: &Shared, body: &Value, chat: bool) -> Result<Call, ApiError> {
    check_model(shared, body)?;
    let defaults = &shared.defaults;
    if let Some(obj) = body.as_object() {
        let mut ignored: Vec<String> = obj
            .keys()
            .filter(|k| !KNOWN_FIELDS.contains(&k.as_str()))
            .cloned()
            .collect();
        if let Some(Value::Object(o)) = obj.get("stream_options") {
            ignored.extend(
                o.keys()
                    .filter(|k| *k != "include_usage" && *k != "continuous_usage_stats")
                    .map(|k| format!("stream_options.{k}")),
            );
        }
        if !ignored.is_empty() {
            say!(
                "cachalot serve: request fields ignored (not read by this server): {}",
                ignored.join(", ")
            );
        }
    }
    for (key, unsupported) in [
        ("best_of", "best_of is not supported"),
        ("suffix", "suffix is not supported"),
        ("use_beam_search", "beam search is not supported"),
        (
            "chat_template",
            "a request's own chat template is not accepted (as vLLM without \
             --trust-request-chat-template): start the server with --chat-template FILE",
        ),
    ] {
        match field(body, key) {
            // What clients send when they do not use the feature.
            None | Some(Value::Bool(false)) => {}
            Some(Value::Number(n)) if n.as_u64() == Some(0) && key == "suffix" => {}
            Some(Value::String(t)) if t.is_empty() => {}
            Some(v) if key == "best_of" && whole_number(v) == Some(1) => {}
            Some(_) => return Err(ApiError::bad(key, unsupported)),
        }
    }
    let mut json_schema = None;
    let json_object = match field(body, "response_format") {
        None => false,
        Some(f) => match f.get("type").and_then(Value::as_str) {
            Some("text") => false,
            Some("json_object") => true,
            Some("json_schema") => {
                // {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}
                let schema = f
                    .get("json_schema")
                    .and_then(|j| j.get("schema"))
                    .ok_or_else(|| {
                        ApiError::bad(
                            "response_format",
                            "json_schema: expected {\"type\": \"json_schema\", \"json_schema\": \
                             {\"name\": ..., \"schema\": {...}}}",
                        )
                    })?;
                cachalot_engine::json_schema::Schema::compile(schema).map_err(|e| {
                    ApiError::bad("response_format", format!("json_schema.schema: {e}"))
                })?;
                json_schema = Some(schema.clone());
                true
            }
            _ => {
                return Err(ApiError::bad(
                    "response_format",
                    format!(
                        "expected {{\"type\": \"text\"}}, {{\"type\": \"json_object\"}} or \
                         {{\"type\": \"json_schema\", ...}}, got {f}"
                    ),
                ))
            }
        },
    };
    // vLLM's structured-output extensions: `guided_json` (a schema, or its JSON text) and
    // `structured_outputs` (`json`, `json_object`) are this JSON mode; the grammars it has and
    // this server has not are refused by name rather than left unenforced.
    let (json_object, json_schema) = vllm_structured_outputs(body, json_object, json_schema)?;
    let logprobs = read_logprobs(body, chat)?;
    let echo = flag(body, "echo")?;
    let stream = flag(body, "stream")?;
    // vLLM's `prompt_logprobs`: each prompt token's log-probability given those before it,
    // with that many alternatives; not streamed (as vLLM refuses it there).
    let prompt_logprobs = match field(body, "prompt_logprobs") {
        None | Some(Value::Bool(false)) => None,
        Some(v) => match whole_number(v) {
            Some(k) if k <= MAX_TOP_LOGPROBS => Some(k as usize),
            _ => {
                return Err(ApiError::bad(
                    "prompt_logprobs",
                    format!("expected an integer from 0 to {MAX_TOP_LOGPROBS}, got {v}"),
                ))
            }
        },
    };
    // (vLLM refuses a positive count with a stream, and takes 0 there without writing any.)
    let prompt_logprobs = match prompt_logprobs {
        Some(0) if stream => None,
        Some(_) if stream => {
            return Err(ApiError::bad(
                "prompt_logprobs",
                "not available with \"stream\": true (as in vLLM): drop one of them",
            ))
        }
        k => k,
    };
    // A chat's `echo` (vLLM's) repeats the final message's text before the answer; the rest
    // of this function reads `echo` as completions'.
    let chat_echo = echo && chat;
    let echo = echo && !chat;
    if echo && stream {
        return Err(ApiError::bad(
            "echo",
            "echoed answers come whole here: drop \"stream\"",
        ));
    }
    let n = match count(body, "n")? {
        None => 1,
        Some(n) if (1..=MAX_CHOICES).contains(&n) => n,
        Some(n) => {
            return Err(ApiError::bad(
                "n",
                format!("{n}: give 1 to {MAX_CHOICES} choices"),
            ))
        }
    };
    // (best_of 1, all that is taken, must still cover the choices, as vLLM checks.)
    if n > 1 && field(body, "best_of").is_some_and(|b| whole_number(b) == Some(1)) {
        return Err(ApiError::bad(
            "best_of",
            format!("best_of 1 is less than n {n}: best_of must be at least n"),
        ));
    }
    let tok = &shared.tokenizer;
    let tools = field(body, "tools");
    if let Some(t) = tools {
        if !chat {
            return Err(ApiError::bad("tools", "tools are for /v1/chat/completions"));
        }
        if let Some(problem) = crate::text::tools_problem(t) {
            return Err(ApiError::bad("tools", problem));
        }
    }
    let (forced, reads_calls) = read_tool_choice(body, tools)?;
    // OpenAI's default: the model may call several tools in one answer.
    let one_call = match field(body, "parallel_tool_calls") {
        None | Some(Value::Bool(true)) => false,
        Some(Value::Bool(false)) => true,
        Some(v) => {
            return Err(ApiError::bad(
                "parallel_tool_calls",
                format!("expected true or false, got {v}"),
            ))
        }
    };
    if forced.is_some() && json_object {
        // (The field the request gave: OpenAI's, or vLLM's own.)
        let given = ["response_format", "guided_json", "structured_outputs"]
            .into_iter()
            .find(|k| field(body, k).is_some())
            .unwrap_or("response_format");
        return Err(ApiError::bad(
            given,
            "JSON mode and a forced tool call do not go together (the call's own markup is not \
             JSON): drop one",
        ));
    }
    // As OpenAI and vLLM: a tool choice other than "none" needs tools to choose from.
    if chat && reads_calls && field(body, "tool_choice").is_some() && tools.is_none() {
        return Err(ApiError::bad(
            "tool_choice",
            "tool_choice needs the request's tools (give tools, or leave tool_choice out)",
        ));
    }
    let mut forced_prefix = String::new();
    let mut forced_suffix = String::new();
    // A forced call's arguments are one JSON object, after one of these leads when the model
    // writes the function's name first.
    let mut forced_json: Option<ForcedJson> = None;
    let mut continues = false;
    let mut response_role = "assistant".to_string();
    let mut echo_text = String::new();
    let mut prompts: Vec<(Vec<u32>, String)> = if chat {
        let Some(messages) = field(body, "messages") else {
            return Err(ApiError::bad(
                "messages",
                "required: a list of {\"role\", \"content\"}",
            ));
        };
        let (template, kwargs) = chat_setup(shared, body, messages)?;
        let messages = &flatten_text_parts(messages, template);
        let (generation, continued) = prompt_ending(body)?;
        continues = continued;
        // vLLM's answer role: the assistant's after the template's opening of its turn, else
        // the final message's (whose text `echo` repeats when the roles agree).
        let last = messages.as_array().and_then(|m| m.last());
        if !generation {
            if let Some(r) = last.and_then(|m| m.get("role")).and_then(Value::as_str) {
                response_role = r.to_string();
            }
        }
        if chat_echo
            && last.and_then(|m| m.get("role")).and_then(Value::as_str) == Some(&response_role)
        {
            echo_text = last.map_or(String::new(), message_text);
        }
        if continued && forced.is_some() {
            return Err(forced_with_continued());
        }
        let text = match &forced {
            None => render_chat(template, messages, generation, continued, tools, &kwargs)?,
            Some(name) => {
                let f = forced_call(shared.tool_format, template, messages, tools, &kwargs, name)?;
                forced_prefix = f.prefix;
                if let Some(mut j) = f.json {
                    forced_suffix = j.suffix.clone();
                    if one_call {
                        j.more.clear();
                    }
                    forced_json = Some(j);
                }
                f.prompt
            }
        };
        let ids = encode_with_bos(tok, &text, add_special(body, true)?, "messages")?;
        vec![(ids, text)]
    } else {
        completion_prompts(tok, body, add_special(body, false)?)?
    };
    // vLLM's `truncate_prompt_tokens`: a longer prompt keeps its last k tokens (-1: the
    // model's context).
    if let Some(v) = field(body, "truncate_prompt_tokens") {
        let k = match (integer(v), whole_number(v)) {
            (Some(-1), _) => shared.max_positions,
            (_, Some(k)) if (1..=shared.max_positions as u64).contains(&k) => k as usize,
            _ => {
                return Err(ApiError::bad(
                    "truncate_prompt_tokens",
                    format!(
                        "expected 1 to the model's context of {} tokens, or -1 (the context), \
                         got {v}",
                        shared.max_positions
                    ),
                ))
            }
        };
        for (ids, text) in prompts.iter_mut() {
            if ids.len() > k {
                ids.drain(..ids.len() - k);
                *text = tok.decode(ids).unwrap_or_default();
            }
        }
    }
    let vocab = shared.vocab;
    // (A chat prompt's ids come from the template and the tokenizer.)
    let param = if chat { "messages" } else { "prompt" };
    for (prompt, _) in &prompts {
        if prompt.is_empty() {
            return Err(ApiError::bad(param, "the prompt has no tokens"));
        }
        if let Some(bad) = prompt.iter().find(|&&t| t as usize >= vocab) {
            return Err(ApiError::bad(
                param,
                format!(
                    "token id {bad} is out of the model's vocabulary ({vocab} ids){}",
                    if chat {
                        ": the chat template's tokens are not this model's (is the tokenizer \
                         the model's?)"
                    } else {
                        ""
                    }
                ),
            ));
        }
    }
    if prompts.len() * n > MAX_CHOICES_TOTAL {
        return Err(ApiError::bad(
            "prompt",
            format!(
                "{} prompts × n {n}: at most {MAX_CHOICES_TOTAL} choices per request",
                prompts.len()
            ),
        ));
    }
    // The longest prompt bounds what every choice may generate.
    let prompt = prompts
        .iter()
        .map(|p| &p.0)
        .max_by_key(|p| p.len())
        .expect("at least one prompt");
    let room = shared.max_positions.saturating_sub(prompt.len());
    if room == 0 {
        return Err(ApiError::bad(
            if chat { "messages" } else { "prompt" },
            format!(
                "the prompt has {} tokens; the model's context is {} positions, and a \
                 request takes one past its prompt (the token it samples; echo with max_tokens \
                 0 too, which samples one and drops it)",
                prompt.len(),
                shared.max_positions
            ),
        ));
    }
    let max_key = if field(body, "max_completion_tokens").is_some() {
        "max_completion_tokens"
    } else {
        "max_tokens"
    };
    // Echo with no tokens asked scores the prompt: one token is generated and dropped.
    let score_only = echo && count(body, max_key)? == Some(0);
    let max_new = match count(body, max_key)? {
        Some(0) if score_only => 1,
        Some(0) => {
            return Err(ApiError::bad(
                max_key,
                if chat {
                    "must be at least 1"
                } else {
                    "must be at least 1 (0 only with echo, to score the prompt)"
                },
            ))
        }
        // A prefill server samples the first token only; the decode server checks the rest.
        Some(_) | None if shared.role == Role::Prefill => 1,
        Some(n) if n > room => {
            return Err(ApiError::bad(
                max_key,
                format!(
                    "{n}: the prompt's {} tokens leave room for {room} in the model's context \
                     of {} positions",
                    prompt.len(),
                    shared.max_positions
                ),
            ))
        }
        Some(n) => n,
        // OpenAI's default for completions; a chat answer may take the rest of the context;
        // either within generation_config.json's max_new_tokens.
        None if !chat => 16.min(room).min(defaults.max_tokens.unwrap_or(usize::MAX)),
        None => room.min(defaults.max_tokens.unwrap_or(usize::MAX)),
    };

    let params = SamplingParams {
        temperature: number(body, "temperature", 0.0, 100.0)?
            .or(defaults.temperature)
            .unwrap_or(1.0) as f32,
        top_k: match field(body, "top_k") {
            None => defaults.top_k.unwrap_or(0),
            Some(v) if integer(v) == Some(-1) => 0,
            Some(v) => whole_number(v).map(|k| k as usize).ok_or_else(|| {
                ApiError::bad(
                    "top_k",
                    format!("expected a non-negative integer or -1 (off), got {v}"),
                )
            })?,
        },
        top_p: positive_f32(
            number(body, "top_p", 0.0, 1.0)?
                .or(defaults.top_p)
                .unwrap_or(1.0),
        ),
        min_p: number(body, "min_p", 0.0, 1.0)?
            .or(defaults.min_p)
            .unwrap_or(0.0) as f32,
        repetition_penalty: match number(body, "repetition_penalty", 0.0, f32::MAX as f64)?
            .or(defaults.repetition_penalty)
        {
            Some(p) if p <= 0.0 => {
                return Err(ApiError::bad(
                    "repetition_penalty",
                    format!("{p}: must be above 0 (1 = off)"),
                ))
            }
            p => positive_f32(p.unwrap_or(1.0)),
        },
        presence_penalty: number(body, "presence_penalty", -2.0, 2.0)?.unwrap_or(0.0) as f32,
        frequency_penalty: number(body, "frequency_penalty", -2.0, 2.0)?.unwrap_or(0.0) as f32,
        seed: match field(body, "seed") {
            None => None,
            Some(v) => Some(integer(v).map(|s| s as u64).ok_or_else(|| {
                let why = if v.is_number() {
                    "expected an integer from -2^63 to 2^63 - 1"
                } else {
                    "expected an integer"
                };
                ApiError::bad("seed", format!("{why}, got {v}"))
            })?),
        },
        logit_bias: logit_bias(body, vocab)?,
        min_tokens: match count(body, "min_tokens")? {
            // (A prefill server samples one token; the decode server checks the answer's.)
            Some(n) if n > max_new && shared.role != Role::Prefill => {
                return Err(ApiError::bad(
                    "min_tokens",
                    format!("{n} is more than the {max_new} tokens the answer may take"),
                ))
            }
            n => n.unwrap_or(0),
        },
        // vLLM's filter order.
        min_p_first: true,
        allowed_tokens: allowed_token_ids(body, vocab)?,
        bad_words: bad_words(tok, body)?,
    };
    if params.top_p == 0.0 {
        return Err(ApiError::bad("top_p", "must be above 0"));
    }
    let stop_strings = match field(body, "stop") {
        None => Vec::new(),
        Some(Value::String(s)) if s.is_empty() => {
            return Err(ApiError::bad(
                "stop",
                "an empty string stops nowhere: leave stop out, or give the text to stop at",
            ))
        }
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) => a
            .iter()
            .map(|s| {
                s.as_str()
                    .filter(|s| !s.is_empty())
                    .map(str::to_string)
                    .ok_or_else(|| ApiError::bad("stop", format!("{s} is not a non-empty string")))
            })
            .collect::<Result<_, _>>()?,
        Some(v) => {
            return Err(ApiError::bad(
                "stop",
                format!("expected a string or a list, got {v}"),
            ))
        }
    };
    let ignore_eos = flag(body, "ignore_eos")?;
    let mut stop_ids = if ignore_eos {
        Vec::new()
    } else {
        shared.eos.clone()
    };
    if chat && !ignore_eos {
        stop_ids.extend(shared.im_end);
    }
    let extra = match field(body, "stop_token_ids") {
        None => &[][..],
        Some(Value::Array(a)) => a.as_slice(),
        Some(v) => {
            return Err(ApiError::bad(
                "stop_token_ids",
                format!("expected a list of token ids, got {v}"),
            ))
        }
    };
    {
        for v in extra {
            match whole_number(v) {
                Some(id) if (id as usize) < vocab => stop_ids.push(id as u32),
                _ => {
                    return Err(ApiError::bad(
                        "stop_token_ids",
                        format!("{v} is not a token id"),
                    ))
                }
            }
        }
    }
    // vLLM's `skip_special_tokens` (default true): special tokens the model writes are not in
    // the answer's text, except the markers the reasoning and tool-call parsers read (which
    // take them out themselves).
    let skip_special = match field(body, "skip_special_tokens") {
        None => true,
        Some(_) => flag(body, "skip_special_tokens")?,
    };
    let has_tools =
        reads_calls && tools.is_some_and(|t| t.as_array().is_some_and(|a| !a.is_empty()));
    let special_text = if !skip_special {
        SpecialText::keep()
    } else if chat {
        let format = shared.tool_format.filter(|_| has_tools);
        SpecialText::skip_except(ToolCallFormat::parser_tokens(format, &shared.tokenizer))
    } else {
        SpecialText::skip_except(Vec::new())
    };
    let (include_usage, continuous_usage) = match field(body, "stream_options") {
        None => (false, false),
        // As vLLM.
        Some(_) if !stream => {
            return Err(ApiError::bad(
                "stream_options",
                "stream options can only be given with \"stream\": true",
            ))
        }
        // (Its other keys are logged with the request's other ignored fields.) vLLM sends
        // continuous usage only with `include_usage`.
        Some(o @ Value::Object(_)) => {
            let read = |key: &'static str| {
                flag(o, key)
                    .map_err(|e| ApiError::bad("stream_options", format!("{key}: {}", e.message)))
            };
            // vLLM's default: stream options given include the usage unless they say not.
            let usage = o.get("include_usage").is_none_or(Value::is_null) || read("include_usage")?;
            (usage, usage && read("continuous_usage_stats")?)
        }
        Some(v) => {
            return Err(ApiError::bad(
                "stream_options",
                format!("expected an object such as {{\"include_usage\": true}}, got {v}"),
            ))
        }
    };
    Ok(Call {
        chat,
        forced_prefix,
        forced_suffix,
        n,
        logprobs,
        prompt_logprobs,
        echo,
        score_only,
        stream,
        include_usage,
        continuous_usage,
        eos_ignored: ignore_eos,
        response_role,
        echo_text,
        token_ids: flag(body, "return_tokens_as_token_ids")?,
        tools: has_tools,
        one_call,
        request: Request {
            prompt: prompts[0].0.clone(),
            params,
            stop: StopConditions {
                max_new_tokens: max_new,
                stop_token_ids: stop_ids,
                stop_strings,
                include_stop_str: flag(body, "include_stop_str_in_output")?,
            },
            // vLLM's `ignore_eos` drops the EOS from the stop tokens (done above); stop
            // strings and `stop_token_ids` still end the answer, so this is not the engine's
            // fixed-length mode.
            ignore_eos: false,
            logprobs,
            // Echo's and `prompt_logprobs`' alternatives: the more of the two (each answer
            // takes its own count).
            prompt_logprobs: if echo { logprobs } else { None }.max(prompt_logprobs),
            json_object: json_object || forced_json.is_some(),
            // A reasoning model's answer is JSON once its thinking ends (as vLLM's guided
            // decoding starts after the reasoning parser's end marker); a forced call's
            // arguments once the model has written the name (or at once when it is given).
            json_after: match forced_json {
                Some(_) => None,
                None => (json_object
                    && chat
                    && reasoning_start(shared, &prompts[0].1, continues) == Some(true))
                .then(|| THINK_CLOSE.to_string()),
            },
            // "required": the model picks the function: its answer opens with one of the
            // tools' names and the markup before the arguments.
            json_schema: match &forced_json {
                Some(j) => j.schema.clone(),
                None => json_schema,
            },
            dsml: forced_json.as_ref().is_some_and(|j| j.dsml),
            json_more: forced_json
                .as_ref()
                .map(|j| j.more.clone())
                .unwrap_or_default(),
            json_lead: forced_json.map(|j| j.leads).unwrap_or_default(),
            special_text,
            waited_s: 0.0,
        },
        prompt_text: prompts[0].1.clone(),
        continued: continues,
        prompts,
    })
}

/// Why a tool's `parameters` is a broken schema (as OpenAI and vLLM refuse it), not merely one
/// structured output cannot hold (which leaves a forced call's arguments any object): its
/// top-level type is not an object, or somewhere in it a `type` names no JSON type, or a lower
/// bound passes its upper one (`minimum`/`maximum` and their exclusive forms, `minLength`,
/// `minItems`, `minProperties`).
fn broken_parameters(p: &Value) -> Option<String> {
    const TYPES: [&str; 7] = [
        "object", "array", "string", "number", "integer", "boolean", "null",
    ];
    /// A `type`'s names (a name or a list of them); None when it is neither.
    fn type_names(t: &Value) -> Option<Vec<&str>> {
        match t {
            Value::String(s) => Some(vec![s.as_str()]),
            Value::Array(a) => a.iter().map(Value::as_str).collect(),
            _ => None,
        }
    }
    if let Some(t) = p.get("type") {
        match type_names(t) {
            Some(ts) if ts.contains(&"object") => {}
            _ => {
                return Some(format!(
                    "type {t}: a call's arguments are a JSON object, which this schema does \
                     not describe"
                ))
            }
        }
    }
    fn walk(v: &Value, at: &str, depth: usize, out: &mut Option<String>) {
        let Some(o) = v.as_object() else {
            return;
        };
        if out.is_some() || depth > 64 {
            return;
        }
        if let Some(t) = o.get("type") {
            match type_names(t) {
                Some(n) if n.iter().all(|x| TYPES.contains(x)) => {}
                _ => {
                    *out = Some(format!("{at}/type: {t} names no JSON type"));
                    return;
                }
            }
        }
        let num = |k: &str| o.get(k).and_then(Value::as_f64);
        let lo = num("minimum").into_iter().chain(num("exclusiveMinimum"));
        let hi = num("maximum").into_iter().chain(num("exclusiveMaximum"));
        let (lo, hi) = (
            lo.fold(f64::NEG_INFINITY, f64::max),
            hi.fold(f64::INFINITY, f64::min),
        );
        let exclusive = num("exclusiveMinimum").is_some_and(|x| x == lo)
            || num("exclusiveMaximum").is_some_and(|x| x == hi);
        if lo > hi || (lo == hi && exclusive) {
            *out = Some(format!(
                "{at}: no number lies between its lower and upper bounds"
            ));
            return;
        }
        for (a, b) in [
            ("minLength", "maxLength"),
            ("minItems", "maxItems"),
            ("minProperties", "maxProperties"),
        ] {
            if let (Some(x), Some(y)) = (num(a), num(b)) {
                if x > y {
                    *out = Some(format!("{at}: {a} {x} is above {b} {y}"));
                    return;
                }
            }
        }
        // Into what every value must meet: not the branches of a union (one may be
        // unsatisfiable while another holds), `not`, or definitions no reference may use.
        for (k, sub) in o {
            match (k.as_str(), sub) {
                ("properties" | "patternProperties", Value::Object(m)) => {
                    for (name, s) in m {
                        walk(s, &format!("{at}/{k}/{name}"), depth + 1, out);
                    }
                }
                ("allOf" | "prefixItems" | "items", Value::Array(a)) => {
                    for (i, s) in a.iter().enumerate() {
                        walk(s, &format!("{at}/{k}/{i}"), depth + 1, out);
                    }
                }
                (
                    "items"
                    | "additionalItems"
                    | "additionalProperties"
                    | "propertyNames"
                    | "contains",
                    s,
                ) => {
                    walk(s, &format!("{at}/{k}"), depth + 1, out);
                }
                _ => {}
            }
        }
    }
    let mut out = None;
    walk(p, "#", 0, &mut out);
    out
}

/// Stand-ins for a forced call's name and arguments, where the prompt is cut (and for a second
/// call's arguments, where "required" lets the model write more calls).
const FORCED_NAME: &str = "CACHALOT_FORCED_NAME_5d1e";
const FORCED_ARGUMENTS: &str = "CACHALOT_FORCED_ARGUMENTS_5d1e";
const SECOND_ARGUMENTS: &str = "CACHALOT_SECOND_ARGUMENTS_5d1e";

/// The most calls of a "required" answer in a format that numbers its calls (Kimi-K2's
/// `functions.NAME:INDEX`: each call's markup is its own lead); other formats take any number.
const MAX_NUMBERED_CALLS: usize = 16;

/// The prompt of a forced tool call (`tool_choice` "required", or a named function) and the
/// start of the answer it writes for the model: the conversation's generation prompt (without a
/// reasoning block it would open), then the call as the template itself renders an assistant's
/// tool call, cut where the model's own part begins (the arguments, or for "required" the
/// name). The call's text is taken from the template's rendering of a one-question conversation
/// with that call, so it does not depend on how the template joins turns; whatever the format
/// (R1's fenced JSON, V3.1's, Kimi-K2's `functions.NAME:INDEX`), the model continues the call its
/// template writes, and the answer parses as usual.
fn forced_call(
    format: Option<ToolCallFormat>,
    template: &ChatTemplate,
    messages: &Value,
    tools: Option<&Value>,
    kwargs: &Map<String, Value>,
    name: &Option<String>,
) -> Result<ForcedCall, ApiError> {
    let unsupported = |why: &str| {
        ApiError::bad(
            "tool_choice",
            format!("forced tool calls are not available for this model's template: {why}"),
        )
    };
    let format = format.ok_or_else(|| unsupported("its tool-call format"))?;
    // DeepSeek-V4 writes the arguments as DSML parameters, not JSON: the model's part begins
    // where the first parameter would, and the parameters are held to the tool's schema as
    // DSML (`cachalot_engine::dsml_args`) through the closing markup.
    let v4 = format == ToolCallFormat::DeepseekV4;
    // A forced call's arguments are held to its tool's parameters: a schema using a keyword
    // structured output does not support leaves them any object (README), but a broken one
    // (contradictory bounds, an unknown type, a schema that does not describe an object) is
    // the request's error, as in vLLM and OpenAI.
    for (i, t) in tools
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .enumerate()
    {
        let f = &t["function"];
        if name.as_ref().is_some_and(|n| f["name"] != n.as_str()) {
            continue;
        }
        let Some(p) = f.get("parameters").filter(|p| p.is_object()) else {
            continue;
        };
        if let Some(e) = broken_parameters(p) {
            return Err(ApiError::bad(
                "tools",
                format!("tools[{i}].function.parameters: {e}"),
            ));
        }
    }
    let dsml_param = format!("<{}parameter", cachalot_model::tokenizer::dsv4::DSML);
    let args_start = |f: &str| -> Option<usize> {
        let at = f.find(FORCED_ARGUMENTS)?;
        if v4 {
            f[..at].rfind(&dsml_param)
        } else {
            Some(at)
        }
    };
    let section_begin = if v4 {
        format!("\n\n<{}tool_calls>", cachalot_model::tokenizer::dsv4::DSML)
    } else {
        format.section_begin().to_string()
    };
    let render = |m: &Value, generation: bool| {
        template
            .render_json(m, generation, tools, kwargs)
            .map_err(|e| ApiError::bad("messages", format!("the chat template failed: {e}")))
    };
    // Kimi-K2 numbers calls over the conversation (`functions.NAME:INDEX`).
    let earlier: usize = messages
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|m| m.get("tool_calls").and_then(Value::as_array))
        .map(Vec::len)
        .sum();
    // The one-question conversation with a call of `name` (its arguments the stand-in),
    // rendered.
    let render_call = |name: &str| {
        let id = if name == FORCED_NAME {
            FORCED_NAME.to_string()
        } else {
            format!("functions.{name}:{earlier}")
        };
        let call = json!([{"role": "user", "content": "?"},
            {"role": "assistant", "content": null, "tool_calls": [{
                "id": id, "type": "function",
                "function": {"name": name, "arguments": FORCED_ARGUMENTS}}]}]);
        render(&call, false)
    };
    let full = render_call(name.as_deref().unwrap_or(FORCED_NAME))?;
    let cut = [full.find(FORCED_NAME), args_start(&full)]
        .into_iter()
        .flatten()
        .min()
        .ok_or_else(|| unsupported("it does not render an assistant's tool calls"))?;
    // (A template that quotes the arguments: the model writes the quote too.)
    let cut = if full[..cut].ends_with('"') {
        cut - 1
    } else {
        cut
    };
    // (The last marker before the call: a tools block in the system prompt may show one.)
    let start = full[..cut]
        .rfind(&section_begin)
        .ok_or_else(|| unsupported("its tool calls do not open with the format's marker"))?;
    // What the template writes in an assistant's turn before the section (Kimi-K2-Thinking's
    // empty `<think></think>`) goes into the prompt before the call: the text from where the
    // generation prompt of the one-question conversation ends, when the call's rendering
    // continues it. (It is not part of the answer's prefix, so not of its content.)
    let lead_start = if v4 {
        start
    } else {
        render(&json!([{"role": "user", "content": "?"}]), true)
            .ok()
            .filter(|g| full.starts_with(g.as_str()) && g.len() <= start)
            .map_or(start, |g| g.len())
    };
    let lead = &full[lead_start..start];
    let call_text = &full[start..cut];
    let mut prompt = render(messages, true)?;
    let kept = prompt.trim_end().len();
    if prompt[..kept].ends_with(THINK_OPEN) {
        if v4 {
            // V4's encoder writes a thinking-mode call as `<think>{reasoning}</think>` and the
            // DSML block: here with no reasoning.
            prompt.truncate(kept);
            prompt.push_str(THINK_CLOSE);
        } else {
            prompt.truncate(kept - THINK_OPEN.len());
        }
    }
    prompt.push_str(lead);
    prompt.push_str(call_text);
    // The arguments as a JSON object, unless the template writes them as a string: for
    // "required", what the model writes before them for each tool (as the template renders a
    // call of it: R1's name and fence, Kimi-K2's `functions.NAME:INDEX` and marker), and the
    // markup from them to the section's end.
    let json = args_start(&full).and_then(|args_at| {
        if full[..args_at].ends_with('"') {
            return None;
        }
        let suffix = if v4 {
            // (Where more calls may follow the first; a single call's grammar closes the
            // block itself.)
            format!("\n</{}tool_calls>", cachalot_model::tokenizer::dsv4::DSML)
        } else {
            let after = &full[args_at + FORCED_ARGUMENTS.len()..];
            let (end_at, end) = format
                .section_ends()
                .iter()
                .filter_map(|m| after.find(m).map(|i| (i, m.len())))
                .min()?;
            after[..end_at + end].to_string()
        };
        // A tool's parameters, when structured output can hold the arguments to them (else
        // any object).
        let tool_list: Vec<&Value> = tools
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .collect();
        let parameters = |n: &str| {
            tool_list
                .iter()
                .find(|t| t["function"]["name"] == n)
                // A function without `parameters` takes none (OpenAI's reading; vLLM's
                // forced calls hold it to the same empty object).
                .map(|t| {
                    t["function"].get("parameters").cloned().unwrap_or_else(|| {
                        json!({"type": "object", "properties": {},
                                   "additionalProperties": false})
                    })
                })
                .map(|p| {
                    // Arguments are an object: `{}` or a schema without a type says so.
                    let mut p = p;
                    if let Some(o) = p.as_object_mut() {
                        if !["type", "anyOf", "oneOf", "$ref", "enum", "const"]
                            .iter()
                            .any(|k| o.contains_key(*k))
                        {
                            o.insert("type".into(), "object".into());
                        }
                    }
                    p
                })
                .filter(|p| {
                    if v4 {
                        cachalot_engine::dsml_args::DsmlSpec::compile(p).is_ok()
                    } else {
                        cachalot_engine::json_schema::Schema::compile(p)
                            .is_ok_and(|s| s.takes_only_objects())
                    }
                })
        };
        let (leads, schema) = match name {
            Some(n) => (Vec::new(), parameters(n)),
            None => (
                tool_list
                    .iter()
                    .filter_map(|t| t["function"]["name"].as_str())
                    .map(|n| {
                        let f = render_call(n).ok()?;
                        let args_at = args_start(&f)?;
                        let text = (f.get(..cut) == Some(&full[..cut]))
                            .then(|| f.get(cut..args_at).map(str::to_string))
                            .flatten()
                            .filter(|lead| !lead.is_empty())?;
                        Some(JsonLead {
                            text,
                            schema: parameters(n),
                            then_json: true,
                            ends: false,
                        })
                    })
                    .collect::<Option<Vec<JsonLead>>>()?,
                None,
            ),
        };
        // "required": after each call's arguments the model writes another call or closes the
        // section, as vLLM's `required` lets it. What comes between the k-th call's arguments
        // and the next's is taken from the template's rendering of a turn with k + 1 calls
        // (templates number them by the turn's loop or by the calls' ids). `lean`: rendered
        // without the tools (their block, often every schema as JSON, is the bulk of a
        // rendering and is made once per tool and call), where that gives the same markup.
        let between_in = |k: usize, n: &str, lean: bool| -> Option<String> {
            let call = |id: String, name: &str, args: &str| {
                json!({"id": id, "type": "function",
                       "function": {"name": name, "arguments": args}})
            };
            let mut calls: Vec<Value> = (0..k)
                .map(|i| {
                    let id = format!("functions.{FORCED_NAME}:{}", earlier + i);
                    call(id, FORCED_NAME, FORCED_ARGUMENTS)
                })
                .collect();
            calls.push(call(
                format!("functions.{n}:{}", earlier + k),
                n,
                SECOND_ARGUMENTS,
            ));
            let turn = json!([{"role": "user", "content": "?"},
                {"role": "assistant", "content": null, "tool_calls": calls}]);
            let f = if lean {
                template.render_json(&turn, false, None, kwargs).ok()?
            } else {
                render(&turn, false).ok()?
            };
            let from = f.rfind(FORCED_ARGUMENTS)? + FORCED_ARGUMENTS.len();
            let text = f.get(from..f.find(SECOND_ARGUMENTS)?)?;
            (text.contains(n) && !text.contains(FORCED_NAME) && !text.ends_with('"'))
                .then(|| text.to_string())
        };
        let first = tool_list
            .iter()
            .find_map(|t| t["function"]["name"].as_str())
            .unwrap_or_default();
        let lean = name.is_none()
            && between_in(1, first, true).is_some_and(|t| Some(t) == between_in(1, first, false));
        let between = |k: usize, n: &str| between_in(k, n, lean);
        let next_call = |k: usize| -> Option<Vec<JsonLead>> {
            let mut e = tool_list
                .iter()
                .filter_map(|t| t["function"]["name"].as_str())
                .map(|n| {
                    Some(JsonLead {
                        text: between(k, n)?,
                        schema: parameters(n),
                        then_json: true,
                        ends: false,
                    })
                })
                .collect::<Option<Vec<JsonLead>>>()?;
            e.push(JsonLead {
                text: suffix.clone(),
                schema: None,
                then_json: false,
                ends: true,
            });
            Some(e)
        };
        // DeepSeek-V4's DSML: after a call's `</｜DSML｜invoke>`, another invoke of any tool
        // or the block's close (the encoder's markup between a turn's calls).
        let dsml = cachalot_model::tokenizer::dsv4::DSML;
        let v4_next = || -> Vec<JsonLead> {
            tool_list
                .iter()
                .filter_map(|t| t["function"]["name"].as_str())
                .map(|n| JsonLead {
                    text: format!("\n<{dsml}invoke name=\"{n}\">\n"),
                    schema: parameters(n),
                    then_json: true,
                    ends: false,
                })
                .chain([JsonLead {
                    text: suffix.clone(),
                    schema: None,
                    then_json: false,
                    ends: true,
                }])
                .collect()
        };
        let more = if name.is_some() || suffix.is_empty() {
            Vec::new()
        } else if v4 {
            vec![v4_next()]
        } else {
            match (next_call(1), next_call(2)) {
                (Some(a), Some(b)) if a == b => vec![a],
                // The markup numbers the calls: each call's own, up to a bound, then the end.
                (Some(a), Some(b)) => [a, b]
                    .into_iter()
                    .chain((3..MAX_NUMBERED_CALLS).map_while(next_call))
                    .chain([Vec::new()])
                    .collect(),
                _ => Vec::new(),
            }
        };
        Some(ForcedJson {
            leads,
            more,
            schema,
            suffix,
            dsml: v4,
        })
    });
    Ok(ForcedCall {
        prompt,
        prefix: call_text.to_string(),
        json,
    })
}

/// A forced tool call's prompt and the answer's start ([`forced_call`]).
#[derive(Debug)]
struct ForcedCall {
    prompt: String,
    prefix: String,
    /// The arguments held to one JSON object (None when the template quotes the arguments:
    /// the model writes them as a JSON string).
    json: Option<ForcedJson>,
}

/// How a forced call's arguments are held ([`ForcedCall::json`]).
#[derive(Debug, PartialEq)]
struct ForcedJson {
    /// "required": the texts one of which the model writes first (a tool's name and what
    /// precedes the arguments), each with its tool's parameters; empty: JSON from the first
    /// token.
    leads: Vec<JsonLead>,
    /// "required": what may follow each call's arguments ([`Request::json_more`]).
    more: Vec<Vec<JsonLead>>,
    /// A named call: its tool's parameters (None: any object).
    schema: Option<Value>,
    /// The call's closing markup, appended once the object completes.
    suffix: String,
    /// The arguments are DeepSeek-V4's DSML parameters, not JSON (`Request::dsml`): the
    /// grammar holds them through the closing markup.
    dsml: bool,
}

/// The most choices (`n`) one request may ask for.
const MAX_CHOICES: usize = 64;

/// The most choices over all of a request's prompts.
const MAX_CHOICES_TOTAL: usize = 1024;

/// The most alternatives per token a request may ask for (vLLM's default `max_logprobs`).
const MAX_TOP_LOGPROBS: u64 = 20;

/// How many alternatives per token the request wants log-probabilities of: completions'
/// `logprobs: N`, chat's `logprobs: true` with `top_logprobs: N`; None for none.
fn read_logprobs(body: &Value, chat: bool) -> Result<Option<usize>, ApiError> {
    let top = |key: &'static str, v: &Value| -> Result<usize, ApiError> {
        match whole_number(v) {
            Some(n) if n <= MAX_TOP_LOGPROBS => Ok(n as usize),
            _ => Err(ApiError::bad(
                key,
                format!("expected an integer from 0 to {MAX_TOP_LOGPROBS}, got {v}"),
            )),
        }
    };
    if !chat {
        if field(body, "top_logprobs").is_some() {
            return Err(ApiError::bad(
                "top_logprobs",
                "a chat field: completions take \"logprobs\": N",
            ));
        }
        return match field(body, "logprobs") {
            None | Some(Value::Bool(false)) => Ok(None),
            Some(v) => top("logprobs", v).map(Some),
        };
    }
    let on = flag(body, "logprobs")?;
    match (on, field(body, "top_logprobs")) {
        (false, None) => Ok(None),
        (false, Some(v)) if whole_number(v) == Some(0) => Ok(None),
        (false, Some(_)) => Err(ApiError::bad("top_logprobs", "needs \"logprobs\": true")),
        (true, None) => Ok(Some(0)),
        (true, Some(v)) => top("top_logprobs", v).map(Some),
    }
}

/// A token's text as log-probabilities show it (U+FFFD where it holds part of a character).
fn token_text(tok: &Tokenizer, id: u32) -> String {
    tok.decode(&[id]).unwrap_or_default()
}

/// A token as log-probabilities name it: its text, or with vLLM's `return_tokens_as_token_ids`
/// `token_id:ID` (for tokens whose text is not a whole character, or is not unique).
fn token_label(tok: &Tokenizer, id: u32, as_ids: bool) -> String {
    if as_ids {
        format!("token_id:{id}")
    } else {
        token_text(tok, id)
    }
}

/// Completions' `logprobs` object for some tokens; `offset` is the answer's length in characters
/// before them (their `text_offset`s follow from it), and is advanced past them. `as_ids`:
/// tokens named by [`token_label`]'s ids.
fn completion_logprobs(
    tok: &Tokenizer,
    as_ids: bool,
    lps: &[TokenLogprob],
    offset: &mut usize,
) -> Value {
    let (mut tokens, mut values, mut tops, mut offsets) = (vec![], vec![], vec![], vec![]);
    for lp in lps {
        let t = token_text(tok, lp.token);
        offsets.push(*offset);
        *offset += t.chars().count();
        tokens.push(token_label(tok, lp.token, as_ids));
        values.push(lp.logprob);
        // The token itself first, then its `logprobs` most likely alternatives (OpenAI's
        // up-to-N+1 entries, as vLLM gives them; `logprobs: 0` gives the token alone).
        let top: Map<String, Value> = std::iter::once((lp.token, lp.logprob))
            .chain(lp.top.iter().copied())
            .map(|(id, v)| (token_label(tok, id, as_ids), json!(v)))
            .fold(Map::new(), |mut m, (k, v)| {
                m.entry(k).or_insert(v);
                m
            });
        tops.push(Value::Object(top));
    }
    json!({"tokens": tokens, "token_logprobs": values, "top_logprobs": tops,
           "text_offset": offsets})
}

/// A completion choice with `echo`: the prompt's text before the answer's (the answer dropped
/// when only the prompt is scored), and with `logprobs` the prompt's tokens first, the first one
/// without a log-probability (nothing comes before it).
fn echoed(shared: &Shared, call: &Call, out: &RequestOutput, text: &str, index: usize) -> Value {
    let tok = &shared.tokenizer;
    let (prompt, prompt_text) = &call.prompts[index / call.n];
    let (text, finish, gen): (String, &str, &[TokenLogprob]) = if call.score_only {
        (prompt_text.clone(), "length", &[])
    } else {
        (
            format!("{prompt_text}{text}"),
            finish_word(out),
            &out.logprobs,
        )
    };
    let logprobs = match (call.logprobs, prompt.first()) {
        (Some(_), Some(&first)) => {
            let t0 = token_text(tok, first);
            // A BOS the tokenizer added is not in the echoed text: it takes no characters.
            let mut offset = if prompt_text.starts_with(&t0) {
                t0.chars().count()
            } else {
                0
            };
            // The prompt's entries may hold more alternatives (for `prompt_logprobs`).
            let k = call.logprobs.unwrap_or(0);
            let all: Vec<TokenLogprob> = out
                .prompt_logprobs
                .iter()
                .map(|lp| TokenLogprob {
                    top: lp.top.iter().take(k).copied().collect(),
                    ..lp.clone()
                })
                .chain(gen.iter().cloned())
                .collect();
            let mut lp = completion_logprobs(tok, call.token_ids, &all, &mut offset);
            let put = |lp: &mut Value, key: &str, v: Value| {
                if let Some(a) = lp[key].as_array_mut() {
                    a.insert(0, v);
                }
            };
            put(
                &mut lp,
                "tokens",
                token_label(tok, first, call.token_ids).into(),
            );
            put(&mut lp, "token_logprobs", Value::Null);
            put(&mut lp, "top_logprobs", Value::Null);
            put(&mut lp, "text_offset", 0.into());
            lp
        }
        _ => Value::Null,
    };
    json!({"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish,
           "stop_reason": if call.score_only { Value::Null } else { stop_reason(shared, call, out) }})
}

/// vLLM's `prompt_logprobs` of a prompt: null for its first token (nothing comes before it),
/// then per token an object keyed by token id holding the token's own entry and its `k` most
/// likely alternatives' (`logprob`, `rank`: 1 for the most likely, and `decoded_token`), the
/// token's first.
fn prompt_logprobs_json(tok: &Tokenizer, lps: &[TokenLogprob], k: usize) -> Value {
    // (Text whatever `return_tokens_as_token_ids` says: vLLM applies it to `logprobs` only.)
    let entry = |id: u32, logprob: f32, rank: u32| {
        let text = token_text(tok, id);
        json!({"logprob": logprob, "rank": rank, "decoded_token": text})
    };
    let rows = lps.iter().map(|lp| {
        let mut m = Map::new();
        m.insert(lp.token.to_string(), entry(lp.token, lp.logprob, lp.rank));
        for (i, &(id, v)) in lp.top.iter().take(k).enumerate() {
            m.insert(id.to_string(), entry(id, v, i as u32 + 1));
        }
        Value::Object(m)
    });
    std::iter::once(Value::Null).chain(rows).collect()
}

/// Chat's `logprobs` object for some tokens.
fn chat_logprobs(tok: &Tokenizer, as_ids: bool, lps: &[TokenLogprob]) -> Value {
    let entry = |id: u32, v: f32| {
        let (token, bytes) = if as_ids {
            let label = token_label(tok, id, true);
            let bytes = label.clone().into_bytes();
            (label, json!(bytes))
        } else {
            (token_text(tok, id), json!(tok.token_bytes(id)))
        };
        json!({"token": token, "logprob": v, "bytes": bytes})
    };
    let content: Vec<Value> = lps
        .iter()
        .map(|lp| {
            let mut e = entry(lp.token, lp.logprob);
            e["top_logprobs"] = lp.top.iter().map(|&(id, v)| entry(id, v)).collect();
            e
        })
        .collect();
    json!({"content": content})
}

/// `prompt`: a string, a list of token ids, or a list of either (several prompts), each with
/// its text as given (or the text of its ids).
fn completion_prompts(
    tok: &Tokenizer,
    body: &Value,
    bos: bool,
) -> Result<Vec<(Vec<u32>, String)>, ApiError> {
    let ids = |a: &[Value]| -> Result<Vec<u32>, ApiError> {
        a.iter()
            .map(|v| {
                // (A whole number written as a float, `1.0`, is one, as vLLM's lax reading
                // takes it; a string of digits in a list is a text prompt there.)
                v.is_number()
                    .then(|| whole_number(v))
                    .flatten()
                    .filter(|&x| x <= u32::MAX as u64)
                    .map(|x| x as u32)
                    .ok_or_else(|| ApiError::bad("prompt", format!("{v} is not a token id")))
            })
            .collect()
    };
    let text = |s: &str| -> Result<(Vec<u32>, String), ApiError> {
        Ok((encode_with_bos(tok, s, bos, "prompt")?, s.to_string()))
    };
    let with_text = |v: Vec<u32>| {
        let t = tok.decode(&v).unwrap_or_default();
        (v, t)
    };
    match field(body, "prompt") {
        None => Err(ApiError::bad(
            "prompt",
            "required: a string or a list of token ids",
        )),
        Some(Value::String(s)) => Ok(vec![text(s)?]),
        Some(Value::Array(a)) if !a.is_empty() && a.iter().all(Value::is_number) => {
            Ok(vec![with_text(ids(a)?)])
        }
        Some(Value::Array(a)) if !a.is_empty() => a
            .iter()
            .map(|p| match p {
                Value::String(s) => text(s),
                Value::Array(inner) => ids(inner).map(with_text),
                v => Err(ApiError::bad("prompt", format!("{v} is not a prompt"))),
            })
            .collect(),
        Some(v) => Err(ApiError::bad(
            "prompt",
            format!("expected a string, a list of token ids, or a list of those, got {v}"),
        )),
    }
}

fn check_messages(messages: &Value) -> Result<(), ApiError> {
    let Some(list) = messages.as_array() else {
        return Err(ApiError::bad("messages", "expected a list"));
    };
    if list.is_empty() {
        return Err(ApiError::bad("messages", "the list is empty"));
    }
    // OpenAI's roles, and DeepSeek-V4's latest_reminder.
    const ROLES: [&str; 7] = [
        "system",
        "developer",
        "user",
        "assistant",
        "tool",
        "function",
        "latest_reminder",
    ];
    for (i, m) in list.iter().enumerate() {
        let role = m.get("role").and_then(Value::as_str);
        let Some(role) = role.filter(|_| m.is_object()) else {
            return Err(ApiError::bad(
                "messages",
                format!("message {i} has no \"role\" (each is {{\"role\", \"content\"}})"),
            ));
        };
        if !ROLES.contains(&role) {
            return Err(ApiError::bad(
                "messages",
                format!(
                    "messages[{i}].role: unknown role {role:?}; use system, developer, user, \
                     assistant or tool"
                ),
            ));
        }
        // A history call's arguments are a JSON text, as OpenAI's and vLLM's request models
        // take them (an object would reach templates as something else: V4's encoder makes it
        // one parameter named `arguments`).
        let calls = m.get("tool_calls").and_then(Value::as_array);
        for (k, c) in calls.into_iter().flatten().enumerate() {
            if let Some(a) = c.get("function").and_then(|f| f.get("arguments")) {
                if !a.is_string() {
                    return Err(ApiError::bad(
                        "messages",
                        format!(
                            "messages[{i}].tool_calls[{k}].function.arguments: expected the \
                             arguments as a JSON string (e.g. \"{{\\\"city\\\": \\\"Paris\\\"}}\"), got {a}"
                        ),
                    ));
                }
            }
        }
        // Content may be absent where OpenAI allows it (an assistant's tool calls, a tool's or
        // function's empty result); a tool result's parts are the template's to render (DeepSeek-
        // V4's encoder writes other parts as unsupported); an assistant may hold refusals.
        let may_be_empty = matches!(role, "assistant" | "tool" | "function");
        match m.get("content") {
            None | Some(Value::Null) if may_be_empty => {}
            None | Some(Value::Null) => {
                return Err(ApiError::bad(
                    "messages",
                    format!("messages[{i}].content: a {role} message needs its content"),
                ))
            }
            Some(Value::String(_)) => {}
            Some(Value::Array(_)) if role == "tool" => {}
            Some(Value::Array(parts)) => {
                for (j, p) in parts.iter().enumerate() {
                    // (A bare string is a text part, as vLLM reads it.)
                    if p.is_string() {
                        continue;
                    }
                    let kind = p.get("type").and_then(Value::as_str);
                    let field = if kind == Some("refusal") && role == "assistant" {
                        "refusal"
                    } else {
                        "text"
                    };
                    let text_kind = matches!(kind, Some("text" | "input_text" | "output_text"));
                    if (!text_kind && field == "text")
                        || !p.get(field).is_some_and(Value::is_string)
                    {
                        return Err(ApiError::bad(
                            "messages",
                            format!(
                                "messages[{i}].content[{j}]: only text parts \
                                 ({{\"type\": \"text\", \"text\": \"...\"}}) are taken (the \
                                 models served read text), got {p}"
                            ),
                        ));
                    }
                }
            }
            Some(other) => {
                return Err(ApiError::bad(
                    "messages",
                    format!(
                        "messages[{i}].content: expected a string or a list of text parts, got \
                         {other}"
                    ),
                ))
            }
        }
    }
    Ok(())
}

/// OpenAI's content parts (`[{"type": "text", "text": ...}, ...]`) joined into one string with
/// newlines, as vLLM does for templates that expect a string (R1's concatenates `content`);
/// kept as a list for templates that walk the parts themselves (`for part in
/// message['content']`, as Kimi-K2's) and, in `tool` messages, for DeepSeek-V4's encoder (which
/// renders a tool result's parts; its other messages take a string). Parts other than text are
/// left as they are (the template decides).
fn flatten_text_parts(messages: &Value, template: &ChatTemplate) -> Value {
    let src = template.source();
    let v4 = template.is_deepseek_v4();
    let walks_parts = [
        "in message['content']",
        "in message.content",
        "in message[\"content\"]",
    ]
    .iter()
    .any(|p| src.contains(p))
        || walks_content_variable(src);
    let mut messages = messages.clone();
    // OpenAI's `developer` role is its `system` role: a template that does not name it gets
    // `system` (R1's renders only that; it would drop the message). DeepSeek-V4's encoder (no
    // template source) renders `developer` turns of its own.
    let knows_developer = v4 || src.contains("developer");
    // A tool's or function's empty result (null content) is an empty string to the templates,
    // which concatenate content.
    for m in messages.as_array_mut().into_iter().flatten() {
        alias_reasoning(m);
        if !knows_developer && m.get("role").and_then(Value::as_str) == Some("developer") {
            m["role"] = "system".into();
        }
        // `tool_calls: null` or `[]` is no calls (clients serialize an assistant message's
        // fields whole): left out, as vLLM drops a null, rather than a present key a template
        // tests for (R1's renders a broken call section).
        if m.get("tool_calls")
            .is_some_and(|c| c.is_null() || c.as_array().is_some_and(Vec::is_empty))
        {
            m.as_object_mut().map(|o| o.remove("tool_calls"));
        }
        let role = m.get("role").and_then(Value::as_str);
        let empty = m.get("content").is_none_or(Value::is_null);
        // So is an assistant turn's null content without calls (vLLM renders it as ""; R1's
        // template would test `'</think>' in content` on the null). With calls it stays null,
        // which templates test for.
        let calls = m
            .get("tool_calls")
            .and_then(Value::as_array)
            .is_some_and(|c| !c.is_empty());
        let blank = match role {
            Some("tool" | "function") => empty,
            Some("assistant") => !calls && empty,
            _ => false,
        };
        if blank {
            m["content"] = "".into();
        } else if calls && m.get("content").is_none() {
            // Content left out beside calls is the null templates test for (not undefined).
            m["content"] = Value::Null;
        }
        // Text parts as vLLM takes them: a bare string, or the Responses API's
        // `input_text`/`output_text`, is a text part.
        if let Some(parts) = m.get_mut("content").and_then(Value::as_array_mut) {
            for p in parts.iter_mut() {
                let text = match p {
                    Value::String(t) => Some(t.clone()),
                    _ if matches!(
                        p.get("type").and_then(Value::as_str),
                        Some("input_text" | "output_text")
                    ) =>
                    {
                        p.get("text").and_then(Value::as_str).map(str::to_string)
                    }
                    _ => None,
                };
                if let Some(t) = text {
                    *p = json!({"type": "text", "text": t});
                }
            }
        }
    }
    if walks_parts && !v4 {
        return messages;
    }
    for m in messages.as_array_mut().into_iter().flatten() {
        if v4 && m.get("role").and_then(Value::as_str) == Some("tool") {
            continue;
        }
        let Some(parts) = m.get("content").and_then(Value::as_array) else {
            continue;
        };
        // Text parts, and an assistant's refusals, are their strings.
        let texts: Option<Vec<&str>> = parts
            .iter()
            .map(|p| match p.get("type").and_then(Value::as_str) {
                Some("text") => p.get("text").and_then(Value::as_str),
                Some("refusal") => p.get("refusal").and_then(Value::as_str),
                _ => None,
            })
            .collect();
        if let Some(texts) = texts {
            m["content"] = texts.join("\n").into();
        }
    }
    messages
}

/// The names a message's reasoning goes by (transformers' `_REASONING_FIELDS`).
const REASONING_FIELDS: [&str; 3] = ["reasoning_content", "thinking", "reasoning"];

/// As transformers (5.x) reads a message: its reasoning, under whichever of
/// [`REASONING_FIELDS`] comes first, is also its `reasoning_content` (what DeepSeek's and
/// Kimi's templates read) and, unless given, its `thinking` (gpt-oss templates').
fn alias_reasoning(m: &mut Value) {
    let Some(o) = m.as_object_mut() else {
        return;
    };
    let Some(r) = REASONING_FIELDS
        .iter()
        .find_map(|k| o.get(*k).filter(|v| !v.is_null()).cloned())
    else {
        return;
    };
    if o.get("thinking").is_none_or(Value::is_null) {
        o.insert("thinking".into(), r.clone());
    }
    o.insert("reasoning_content".into(), r);
}

/// A message's text as vLLM's `echo` repeats it: its content, text parts joined by newlines.
fn message_text(m: &Value) -> String {
    match m.get("content") {
        Some(Value::String(t)) => t.clone(),
        Some(Value::Array(parts)) => parts
            .iter()
            .filter_map(|p| p.as_str().or_else(|| p.get("text").and_then(Value::as_str)))
            .collect::<Vec<_>>()
            .join("\n"),
        _ => String::new(),
    }
}

/// How a chat prompt ends: `add_generation_prompt` (default true: the template's opening of
/// the assistant's turn) and `continue_final_message` (default false: the prompt ends inside
/// the final message, for the model to continue it; the two exclude each other, as in vLLM).
fn prompt_ending(body: &Value) -> Result<(bool, bool), ApiError> {
    let flag = |key: &'static str, default: bool| {
        match field(body, key) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(v) => Err(ApiError::bad(
                key,
                format!("expected true or false, got {v}"),
            )),
        }
        .map(|v| v.unwrap_or(default))
    };
    let continued = flag("continue_final_message", false)?;
    let generation = match field(body, "add_generation_prompt") {
        Some(Value::Bool(true)) if continued => {
            return Err(ApiError::bad(
                "continue_final_message",
                "cannot be combined with add_generation_prompt: true (give one of the two)",
            ))
        }
        _ => flag("add_generation_prompt", !continued)?,
    };
    Ok((generation, continued))
}

/// A chat's prompt: the messages through the template, ending with its opening of the
/// assistant's turn (`generation`), or inside the final message (`continued`).
fn render_chat(
    template: &ChatTemplate,
    messages: &Value,
    generation: bool,
    continued: bool,
    tools: Option<&Value>,
    kwargs: &Map<String, Value>,
) -> Result<String, ApiError> {
    let failed = |e: cachalot_model::ModelError| {
        ApiError::bad("messages", format!("the chat template failed: {e}"))
    };
    if continued {
        // A final message of reasoning alone continues its reasoning where the template
        // renders it, else (R1's drops it) its empty content, as transformers continues it.
        let last = messages.as_array().and_then(|a| a.last());
        let blank = match last.and_then(|m| m.get("content")) {
            Some(Value::String(t)) => t.trim().is_empty(),
            Some(Value::Array(parts)) => !parts.iter().any(|p| p.get("text").is_some()),
            _ => true,
        };
        let tries: &[bool] = if blank { &[true, false] } else { &[false] };
        for &reasoning in tries {
            let Some(tagged) = tag_final(messages, reasoning) else {
                continue;
            };
            // (A template that fails on the marked messages is judged on the plain ones.)
            let Ok(text) = template.render_json(&tagged, generation, tools, kwargs) else {
                continue;
            };
            if let Some(cut) = cut_at_tag(&text) {
                return Ok(cut);
            }
        }
    }
    let text = template
        .render_json(messages, generation, tools, kwargs)
        .map_err(failed)?;
    if !continued {
        return Ok(text);
    }
    let earlier = render_earlier(template, messages, tools, kwargs);
    continue_final(text, messages, earlier)
}

/// transformers' (5.x) marker for `continue_final_message`: written after the final message's
/// text, the rendered prompt is cut where it appears.
const CONTINUE_TAG: &str = "CONTINUE_FINAL_MESSAGE_TAG ";

/// The messages with [`CONTINUE_TAG`] after the final message's text: its content (a list's
/// last text part; none or null is the empty text, as vLLM passes it), or with `reasoning` its
/// reasoning (every name it goes by). None: nothing to mark there.
fn tag_final(messages: &Value, reasoning: bool) -> Option<Value> {
    let mut tagged = messages.clone();
    let last = tagged.as_array_mut()?.last_mut()?.as_object_mut()?;
    if reasoning {
        let names: Vec<&str> = REASONING_FIELDS
            .iter()
            .copied()
            .filter(|k| {
                last.get(*k)
                    .and_then(Value::as_str)
                    .is_some_and(|r| !r.is_empty())
            })
            .collect();
        for k in &names {
            if let Some(Value::String(r)) = last.get_mut(*k) {
                r.push_str(CONTINUE_TAG);
            }
        }
        return (!names.is_empty()).then_some(tagged);
    }
    match last.get_mut("content") {
        Some(Value::String(t)) => t.push_str(CONTINUE_TAG),
        Some(Value::Array(parts)) => {
            let text = parts.iter_mut().rev().find_map(|p| p.get_mut("text"))?;
            *text = format!("{}{CONTINUE_TAG}", text.as_str()?).into();
        }
        None | Some(Value::Null) => {
            last.insert("content".into(), CONTINUE_TAG.into());
        }
        Some(_) => return None,
    }
    Some(tagged)
}

/// A prompt rendered from [`tag_final`]'s messages cut at the (last) tag, as transformers cuts
/// it: where the template kept the tag's space, right before it; where it trimmed, the text
/// before it trimmed too. None: the template dropped the tag.
fn cut_at_tag(text: &str) -> Option<String> {
    let at = text.rfind(CONTINUE_TAG.trim_end())?;
    Some(if text[at..].starts_with(CONTINUE_TAG) {
        text[..at].to_string()
    } else {
        text[..at].trim_end().to_string()
    })
}

/// transformers' `continue_final_message`: the rendered prompt cut right after the final
/// message's text (its end-of-turn markers gone), where the template drops [`CONTINUE_TAG`].
/// The text is looked for after the rendering of the messages before it (`earlier`, when that is a prefix of the prompt): its first
/// occurrence there, so that markup after it that happens to contain the same letters (`hi`
/// in a `</think>` the template adds) is not taken for it; else, as transformers does, its
/// last occurrence, as it is, else trimmed. A final message with no text but reasoning (an
/// assistant's `reasoning_content`) is continued inside the reasoning.
fn continue_final(
    text: String,
    messages: &Value,
    earlier: Option<String>,
) -> Result<String, ApiError> {
    let last = messages.as_array().and_then(|a| a.last());
    let text_of = |key: &str| match last.and_then(|m| m.get(key)) {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(parts)) => parts
            .last()
            .and_then(|p| p.get("text"))
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_string(),
        _ => String::new(),
    };
    let mut content = text_of("content");
    if content.trim().is_empty() {
        content = text_of("reasoning_content");
    }
    if content.is_empty() {
        return Ok(text);
    }
    let from = earlier
        .filter(|e| text.starts_with(e.as_str()))
        .map_or(0, |e| e.len());
    for needle in [content.as_str(), content.trim()] {
        if needle.is_empty() {
            continue;
        }
        if let Some(i) = text[from..].find(needle) {
            return Ok(text[..from + i + needle.len()].to_string());
        }
    }
    for needle in [content.as_str(), content.trim()] {
        if let Some(i) = text.rfind(needle).filter(|_| !needle.is_empty()) {
            return Ok(text[..i + needle.len()].to_string());
        }
    }
    Err(ApiError::bad(
        "continue_final_message",
        "the final message's text is not in the prompt the chat template rendered, so it \
         cannot be continued",
    ))
}

/// The rendering of every message but the last (no generation prompt), where the template
/// renders it: where [`continue_final`] looks for the final message's text from.
fn render_earlier(
    template: &ChatTemplate,
    messages: &Value,
    tools: Option<&Value>,
    kwargs: &Map<String, Value>,
) -> Option<String> {
    let a = messages.as_array()?;
    let earlier = Value::Array(a[..a.len().checked_sub(1)?].to_vec());
    template.render_json(&earlier, false, tools, kwargs).ok()
}

/// Whether a template loops over a variable it set from a message's content, as Kimi-K2-
/// Thinking's macro does (`{%- set c = msg.get('content') -%}` … `{%- for content in c -%}`).
fn walks_content_variable(src: &str) -> bool {
    let ident = |s: &str| {
        s.chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect::<String>()
    };
    let mut names = Vec::new();
    for (i, _) in src.match_indices("set ") {
        let rest = &src[i + 4..];
        let name = ident(rest.trim_start());
        let after = rest.trim_start()[name.len()..].trim_start();
        let Some(expr) = after.strip_prefix('=') else {
            continue;
        };
        let expr = expr.split("%}").next().unwrap_or("");
        if !name.is_empty() && expr.contains("content") && !expr.contains('+') {
            names.push(name);
        }
    }
    // `for x in c`, not a test such as `'</think>' in content` (R1's).
    names.iter().any(|n| {
        src.match_indices(&format!(" in {n}")).any(|(i, m)| {
            let next = src[i + m.len()..].chars().next();
            let whole = !next
                .is_some_and(|c| c.is_ascii_alphanumeric() || c == '_' || c == '.' || c == '[');
            let tag = src[..i].rfind("{%").map_or("", |t| &src[t + 2..i]);
            whole
                && tag
                    .trim_start_matches(['-', '+'])
                    .trim_start()
                    .starts_with("for ")
        })
    })
}

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn finish_word(out: &RequestOutput) -> &'static str {
    match out.finish {
        FinishReason::Cancelled => "abort",
        ref f => f.as_str(),
    }
}

/// vLLM's `stop_reason`: the stop string or the requested stop token that ended the choice;
/// null for the model's EOS, a length or any other end.
fn stop_reason(shared: &Shared, call: &Call, out: &RequestOutput) -> Value {
    match &out.finish {
        // (Under `ignore_eos` every stop token is one the request listed, the EOS too.)
        FinishReason::StopToken(t)
            if call.eos_ignored || (!shared.eos.contains(t) && shared.im_end != Some(*t)) =>
        {
            json!(t)
        }
        FinishReason::StopString(s) if !s.is_empty() => json!(s),
        _ => Value::Null,
    }
}

/// Usage of a request: its prompt once, the tokens of all its choices; with
/// `prompt_tokens_details.cached_tokens` the prompt tokens whose KV came from the prefix cache
/// (each choice is prefilled on its own: their share, averaged over the choices).
fn usage(prompt: usize, outs: &[Box<RequestOutput>]) -> Value {
    let completion: usize = outs.iter().map(|o| o.tokens.len()).sum();
    let prompts: usize = outs.iter().map(|o| o.timing.prompt_tokens).sum();
    let cached: usize = outs.iter().map(|o| o.timing.cached_tokens).sum();
    let cached = (cached as f64 * prompt as f64 / prompts.max(1) as f64).round() as usize;
    json!({"prompt_tokens": prompt, "completion_tokens": completion,
           "total_tokens": prompt + completion,
           "prompt_tokens_details": {"cached_tokens": cached.min(prompt)}})
}

/// Sends the request to the engine (`n` times for `n` choices) and answers it, whole or
/// streamed.
fn run_call(request: tiny_http::Request, shared: &Shared, mut call: Call, boot: Option<Bootstrap>) {
    let received = std::time::Instant::now();
    // Random, as vLLM's (a uuid's 32 hex digits): unique across restarts and servers.
    let id = format!(
        "{}-{}{}",
        if call.chat { "chatcmpl" } else { "cmpl" },
        unique_tag(),
        unique_tag()
    );
    let (tx, rx) = mpsc::channel();
    // Dropped when this handler returns: the engine then aborts what is left of the request.
    let left = ClientGone(Arc::new(AtomicBool::new(false)));
    // Held (decode role) until the answer is done.
    let mut _permit = None;
    // One job kind per choice (a prefill or decode server's request: one KV per choice).
    let kinds: Vec<JobKind> = match (shared.role, boot) {
        (Role::Prefill, Some(b)) => {
            let rooms = shared.rooms.as_ref().expect("the prefill role has rooms");
            if let Err(m) = rooms.open(b.room, call.choices(), Some(left.0.clone())) {
                let e = ApiError::bad("bootstrap_room", m);
                return respond_json(request, 400, &e.body());
            }
            // Each choice's prefill computes the prompt and samples its first token; the
            // decode server does the rest under the request's own limits.
            call.request.stop.max_new_tokens = 1;
            (0..call.choices())
                .map(|_| JobKind::Export(b.room))
                .collect()
        }
        (Role::Decode, Some(b)) => {
            // Waiting longer than the prefill server keeps the KV would only fetch nothing.
            _permit = shared.transfers.take(shared.kv_timeout / 2);
            if _permit.is_none() {
                let e = ApiError::new(
                    503,
                    format!(
                        "the decode server is busy: {} transfers held for {} s; retry later",
                        shared.transfers.limit,
                        shared.kv_timeout.as_secs() / 2
                    ),
                );
                return respond_json(request, 503, &e.body());
            }
            // A draining server answers what waits for KV before its grace ends.
            let give_up = || crate::term::drain_ending(DRAIN_ANSWER_MARGIN);
            // Waiting for its KV, the request counts as waiting (/metrics, /stats).
            let fetched = {
                let _waiting = shared.metrics.fetching();
                // (Only this request's KV: its choices' prompts, as the prefill server has them.)
                let fingerprint = prompts_fingerprint(
                    (0..call.choices()).map(|c| call.prompts[c / call.n].0.as_slice()),
                );
                fetch_kv(
                    &b,
                    Some(fingerprint),
                    shared.kv_timeout,
                    shared.kv_max_bytes,
                    &give_up,
                )
            };
            // Its TTFT and latencies count the fetch (the prefill included).
            call.request.waited_s = received.elapsed().as_secs_f64();
            match fetched {
                Ok(kvs) if kvs.len() == call.choices() => kvs
                    .into_iter()
                    .map(|kv| JobKind::Import(Box::new(kv)))
                    .collect(),
                Ok(kvs) => {
                    let e = ApiError::new(
                        502,
                        format!(
                            "the prefill server prefilled {} choices of bootstrap_room {} for a \
                             request of {} (prompts × n): send the same request to both servers",
                            kvs.len(),
                            b.room,
                            call.choices()
                        ),
                    );
                    return respond_json(request, 502, &e.body());
                }
                Err(FetchError::Failed(m)) => {
                    let e = ApiError::new(502, m);
                    return respond_json(request, 502, &e.body());
                }
                Err(FetchError::GaveUp) => {
                    let e = ApiError::new(
                        503,
                        format!(
                            "the decode server is shutting down (SIGTERM) and the KV of \
                             bootstrap_room {} has not come: send the request again to another \
                             decode server",
                            b.room
                        ),
                    );
                    return respond_json(request, 503, &e.body());
                }
            }
        }
        _ => (0..call.choices()).map(|_| JobKind::Whole).collect(),
    };
    for (choice, kind) in kinds.into_iter().enumerate() {
        // Each choice samples on its own: a seeded request's choice i of a prompt continues
        // from seed + i.
        let mut req = call.request.clone();
        req.prompt = call.prompts[choice / call.n].0.clone();
        req.params.seed = req
            .params
            .seed
            .map(|s| s.wrapping_add((choice % call.n) as u64));
        // A prompt's log-probabilities are the same for each of its choices: scored once (by
        // its first), the others prefilled as usual (prefix cache included); echo scores each.
        if !call.echo && choice % call.n != 0 {
            req.prompt_logprobs = None;
        }
        let job = Job {
            request: req,
            events: tx.clone(),
            choice,
            kind,
            gone: left.0.clone(),
        };
        if let Err(mpsc::SendError(job)) = shared.jobs.send(job) {
            if let (JobKind::Export(room), Some(rooms)) = (job.kind, &shared.rooms) {
                rooms.set(
                    room,
                    RoomState::Failed("the prefill server's engine has stopped".into()),
                );
            }
            let e = ApiError::new(500, ENGINE_STOPPED);
            return respond_json(request, 500, &e.body());
        }
    }
    drop(tx);
    let created = now();
    if call.stream {
        stream(request, shared, &call, &id, created, rx);
        return;
    }
    // A whole answer that takes long: once the request is running, the 200 head goes out with a
    // chunked body, and a space (JSON allows it before the value) every `keepalive`, so a client
    // that went away is noticed at a failed write and its request aborted (dropping `rx`).
    let v = request.http_version();
    let chunked = (v.0, v.1) >= (1, 1);
    let mut request = Some(request);
    let mut writer: Option<Box<dyn Write + Send>> = None;
    let mut texts = vec![String::new(); call.choices()];
    let mut outs: Vec<Option<Box<RequestOutput>>> = (0..call.choices()).map(|_| None).collect();
    let mut last = std::time::Instant::now();
    // Spaces only once the answer has begun: while the request waits in the queue (or its
    // prompt is computed) nothing is written, so a client's own read timeout still fires there
    // as with vLLM, and a drain can still answer it 503; a client that leaves meanwhile is
    // noticed once the spaces start (the engine then aborts it).
    let mut begun = false;
    while outs.iter().any(Option::is_none) {
        match rx.recv_timeout(shared.keepalive) {
            Ok((i, Event::Text(t, _, _))) => {
                begun = true;
                texts[i].push_str(&t)
            }
            Ok((i, Event::Done(out))) => outs[i] = Some(out),
            Ok((_, Event::Failed(status, message))) => {
                let e = ApiError::new(status, message);
                return fail(request, writer, status, &e);
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                let e = ApiError::new(500, ENGINE_STOPPED);
                return fail(request, writer, 500, &e);
            }
        }
        if chunked && begun && last.elapsed() >= shared.keepalive {
            last = std::time::Instant::now();
            if let Some(r) = request.take() {
                let mut w = r.into_writer();
                let head = "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n\
                            Access-Control-Allow-Origin: *\r\n\
                            Transfer-Encoding: chunked\r\n\r\n";
                if w.write_all(head.as_bytes()).is_err() || !write_body(&mut w, b" ", true) {
                    return;
                }
                writer = Some(w);
            } else if let Some(w) = writer.as_mut() {
                if !write_body(w, b" ", true) {
                    return;
                }
            }
        }
    }
    let outs: Vec<Box<RequestOutput>> = outs.into_iter().flatten().collect();
    let mut choices = Vec::with_capacity(call.choices());
    for (i, (out, text)) in outs.iter().zip(texts).enumerate() {
        let mut finish = finish_word(out);
        choices.push(if call.chat {
            let split = splitter(shared, &call);
            let reasons = split.is_some();
            let (reasoning, answer) = match split {
                None => (String::new(), text),
                Some(sp) => sp.split_whole(&text),
            };
            let mut message = json!({"role": call.response_role});
            set_answer(&mut message, shared, &call, &answer, &mut finish);
            // vLLM's reasoning parsers give no content (null) when nothing follows the
            // reasoning.
            if reasons && message["content"].as_str() == Some("") {
                message["content"] = Value::Null;
            }
            if !call.echo_text.is_empty() {
                let content = message["content"].as_str().unwrap_or_default();
                message["content"] = format!("{}{content}", call.echo_text).into();
            }
            if !reasoning.is_empty() {
                message["reasoning_content"] = reasoning.into();
            }
            let logprobs = match call.logprobs {
                Some(_) => chat_logprobs(&shared.tokenizer, call.token_ids, &out.logprobs),
                None => Value::Null,
            };
            json!({"index": i, "message": message, "logprobs": logprobs, "finish_reason": finish,
                   "stop_reason": stop_reason(shared, &call, out)})
        } else if call.echo {
            echoed(shared, &call, out, &text, i)
        } else {
            let logprobs = match call.logprobs {
                Some(_) => {
                    completion_logprobs(&shared.tokenizer, call.token_ids, &out.logprobs, &mut 0)
                }
                None => Value::Null,
            };
            json!({"index": i, "text": text, "logprobs": logprobs, "finish_reason": finish,
                   "stop_reason": stop_reason(shared, &call, out)})
        });
        // vLLM gives a completion's per choice, a chat's once for the response.
        if let (Some(k), false) = (call.prompt_logprobs, call.chat) {
            // (Scored by the prompt's first choice.)
            let first = &outs[i - i % call.n];
            choices[i]["prompt_logprobs"] =
                prompt_logprobs_json(&shared.tokenizer, &first.prompt_logprobs, k);
        }
    }
    let object = if call.chat {
        "chat.completion"
    } else {
        "text_completion"
    };
    let mut usage = usage(call.prompt_tokens(), &outs);
    if call.score_only {
        usage["completion_tokens"] = 0.into();
        usage["total_tokens"] = call.prompt_tokens().into();
    }
    let mut body = json!({"id": id, "object": object, "created": created, "model": shared.name,
                          "choices": choices, "usage": usage});
    if let (Some(k), true, Some(out)) = (call.prompt_logprobs, call.chat, outs.first()) {
        body["prompt_logprobs"] = prompt_logprobs_json(&shared.tokenizer, &out.prompt_logprobs, k);
    }
    match (request, writer) {
        (Some(r), _) => respond_json(r, 200, &body),
        (None, Some(w)) => end_body(w, body.to_string().as_bytes()),
        _ => {}
    }
}

/// An error for a whole answer: a response if none was started, else the error object as the
/// rest of the started (200) body.
fn fail(
    request: Option<tiny_http::Request>,
    writer: Option<Box<dyn Write + Send>>,
    status: u16,
    e: &ApiError,
) {
    match (request, writer) {
        (Some(r), _) => respond_json(r, status, &e.body()),
        (None, Some(w)) => end_body(w, e.body().to_string().as_bytes()),
        _ => {}
    }
}

/// The last chunk of a started chunked body with `data`, then the empty one that ends it.
fn end_body(mut w: Box<dyn Write + Send>, data: &[u8]) {
    if write_body(&mut w, data, true) {
        write_body(&mut w, b"", true);
    }
}

/// Writes `data` as one chunk of a chunked body (the empty one ends it) or as is, and flushes;
/// false once the client is gone.
fn write_body(w: &mut Box<dyn Write + Send>, data: &[u8], chunked: bool) -> bool {
    let r = if chunked {
        write!(w, "{:x}\r\n", data.len())
            .and_then(|_| w.write_all(data))
            .and_then(|_| w.write_all(b"\r\n"))
    } else {
        w.write_all(data)
    };
    r.and_then(|_| w.flush()).is_ok()
}

/// 16 hex digits that differ from call to call (and from process to process).
fn unique_tag() -> String {
    static COUNT: AtomicU64 = AtomicU64::new(0);
    let n = COUNT.fetch_add(1, Ordering::Relaxed);
    let h = std::hash::BuildHasher::hash_one(
        &std::collections::hash_map::RandomState::new(),
        (n, std::process::id(), std::time::SystemTime::now()),
    );
    format!("{h:016x}")
}

/// The answer's `content`, with `tool_calls` read from it when the request gave tools.
fn set_answer(message: &mut Value, shared: &Shared, call: &Call, answer: &str, finish: &mut &str) {
    // A forced call's JSON arguments that completed (a stop) get the call's closing markup.
    // (Only where it then reads as a call: a stop string that cut the arguments short leaves the
    // text as the model wrote it.)
    let mut answer = format!("{}{answer}", call.forced_prefix);
    let mut parsed = None;
    // (A "required" answer that closed its calls itself has it already.)
    // (Cut off by the length limit just as the object closed, the call is whole too.)
    if matches!(*finish, "stop" | "length")
        && !call.forced_suffix.is_empty()
        && !answer.ends_with(&call.forced_suffix)
    {
        let closed = format!("{answer}{}", call.forced_suffix);
        if let Some(Ok(p)) = shared.tool_format.map(|f| f.parse(&closed)) {
            if !p.tool_calls.is_empty() {
                (answer, parsed) = (closed, Some(Ok(p)));
            }
        }
    }
    message["content"] = answer.as_str().into();
    if !call.tools {
        return;
    }
    let parsed = parsed.or_else(|| shared.tool_format.map(|f| f.parse(&answer)));
    // Cut off by the length limit inside a later call, the calls it closed are the answer's
    // (its finish reason stays "length").
    let (parsed, cut) = match parsed {
        Some(Err(e)) if *finish == "length" => {
            match shared
                .tool_format
                .and_then(|f| f.parse_closed_calls(&answer))
            {
                Some(p) => (Some(Ok(p)), true),
                None => (Some(Err(e)), false),
            }
        }
        p => (p, false),
    };
    match parsed {
        Some(Ok(p)) if !p.tool_calls.is_empty() => {
            message["content"] = if p.content.is_empty() {
                Value::Null
            } else {
                p.content.into()
            };
            let mut calls = p.tool_calls;
            if call.one_call {
                calls.truncate(1);
            }
            // Ids the model does not write (DeepSeek's formats number the calls from 0) are
            // made unique, as vLLM's random ones are: a conversation's later turns have calls
            // too, and clients match results to calls by id. (Kimi-K2's `functions.NAME:INDEX`
            // are the model's own, counted over the conversation.)
            if shared.tool_format != Some(ToolCallFormat::KimiK2) {
                let tag = unique_tag();
                for (i, c) in calls.iter_mut().enumerate() {
                    c.id = Some(format!("call_{tag}{i}"));
                }
            }
            message["tool_calls"] = json!(calls);
            if !cut {
                *finish = "tool_calls";
            }
        }
        Some(Err(e)) => {
            let mut why = e.to_string();
            // A call cut off by the token limit reads as malformed markup: the limit is what
            // to change.
            if *finish == "length" {
                why.push_str(
                    " (the answer was cut off at its length limit, max_tokens or the model's \
                     context: give it more room)",
                );
            }
            message["tool_call_error"] = why.into();
        }
        _ => {}
    }
}

/// The splitter of a chat answer's reasoning from its text, for templates that write `<think>`
/// (R1, Kimi-K2-Thinking; V4's encoder in thinking mode), as vLLM's reasoning parsers; it starts
/// inside the block when the generation prompt ends by opening one. None for other templates,
/// whose answers are all text.
fn splitter(shared: &Shared, call: &Call) -> Option<ReasoningSplitter> {
    reasoning_start(shared, &call.prompt_text, call.continued).map(|inside| {
        ReasoningSplitter::new(inside).ending_at(
            shared
                .tool_format
                .map_or(&[][..], ToolCallFormat::ends_reasoning),
        )
    })
}

/// Whether a chat answer is split into reasoning and content ([`splitter`]): None when not,
/// else whether it starts inside the reasoning.
fn reasoning_start(shared: &Shared, prompt: &str, continued: bool) -> Option<bool> {
    let template = shared.template.as_ref()?;
    if !template.is_deepseek_v4() && !template.source().contains(THINK_OPEN) {
        return None;
    }
    let prompt = prompt.trim_end();
    // Thinking turned off (the prompt closes the block, as V4's chat mode and R1-style
    // templates with thinking disabled do): the answer is all content, a `<think>` in it
    // included (as vLLM's parsers leave it with thinking off).
    if prompt.ends_with(THINK_CLOSE) {
        return None;
    }
    // A continued final message whose reasoning is all it has ends inside that reasoning:
    // the block it opened is not closed.
    let inside = prompt.ends_with(THINK_OPEN)
        || (continued
            && prompt
                .rfind(THINK_OPEN)
                .is_some_and(|o| prompt.rfind(THINK_CLOSE).is_none_or(|c| c < o)));
    Some(inside)
}

/// Server-sent events: one chunk per piece of text (each with its choice's `index`), each
/// choice's finish, usage if asked, `[DONE]`.
fn stream(
    request: tiny_http::Request,
    shared: &Shared,
    call: &Call,
    id: &str,
    created: u64,
    rx: mpsc::Receiver<(usize, Event)>,
) {
    // HTTP/1.1: chunked transfer encoding, one chunk per event, so the client sees each event
    // as it is written and the end of the answer at the last (empty) chunk, with the connection
    // kept for its next request. HTTP/1.0 has no chunks: the body ends when the connection
    // closes.
    let v = request.http_version();
    let chunked = (v.0, v.1) >= (1, 1);
    let mut w = request.into_writer();
    let head = if chunked {
        "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n\
         Access-Control-Allow-Origin: *\r\nTransfer-Encoding: chunked\r\n\r\n"
    } else {
        "HTTP/1.0 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n\
         Access-Control-Allow-Origin: *\r\nConnection: close\r\n\r\n"
    };
    let write_chunk =
        |w: &mut Box<dyn Write + Send>, data: &[u8]| -> bool { write_body(w, data, chunked) };
    let object = if call.chat {
        "chat.completion.chunk"
    } else {
        "text_completion"
    };
    // vLLM's `continuous_usage_stats`: every chunk carries its choice's usage so far.
    let generated: Vec<std::cell::Cell<usize>> = (0..call.choices()).map(|_| 0.into()).collect();
    let chunk = |choice: Value| -> Value {
        let mut c = json!({"id": id, "object": object, "created": created,
                           "model": shared.name, "choices": [choice]});
        if call.continuous_usage {
            let i = c["choices"][0]["index"].as_u64().unwrap_or(0) as usize;
            let prompt = call.prompts.get(i / call.n).map_or(0, |p| p.0.len());
            let done = generated.get(i).map_or(0, std::cell::Cell::get);
            c["usage"] = json!({"prompt_tokens": prompt, "completion_tokens": done,
                                "total_tokens": prompt + done});
        } else if call.include_usage {
            // OpenAI's: with include_usage, the chunks before the usage chunk carry a null one.
            c["usage"] = Value::Null;
        }
        c
    };
    let send = |w: &mut Box<dyn Write + Send>, v: &Value| -> bool {
        write_chunk(w, format!("data: {v}\n\n").as_bytes())
    };
    if w.write_all(head.as_bytes()).is_err() {
        return;
    }
    if call.chat {
        for i in 0..call.choices() {
            let c = json!({"index": i, "delta": {"role": call.response_role, "content": ""},
                           "finish_reason": null});
            if !send(&mut w, &chunk(c)) {
                return;
            }
            // A chat's `echo`: the final message's text first (as vLLM streams it).
            if !call.echo_text.is_empty() {
                let c = json!({"index": i, "delta": {"content": call.echo_text},
                               "finish_reason": null});
                if !send(&mut w, &chunk(c)) {
                    return;
                }
            }
        }
    }
    /// Per choice: its reasoning splitter, the answer held back for tool calls, the answer's
    /// length in characters (logprobs' text offsets), and its output once done.
    struct Choice {
        splitter: Option<ReasoningSplitter>,
        held: Held,
        offset: usize,
        out: Option<Box<RequestOutput>>,
    }
    /// A tool-using answer's text, of which the first `streamed` bytes went out as content
    /// (text before any tool-call markup: [`ToolCallFormat::settled_content`]); `blocked` once
    /// the markup has begun; the calls streamed so far (each one's id and the bytes of its
    /// arguments sent: [`ToolCallFormat::partial_calls`]) and the tag of the ids made for them.
    #[derive(Default)]
    struct Held {
        text: String,
        streamed: usize,
        blocked: bool,
        calls: Vec<(String, usize)>,
        tag: String,
        cursor: cachalot_model::tokenizer::CallsCursor,
    }
    // The `tool_calls` deltas of a tool-using answer's calls so far, as vLLM's tool parsers
    // stream them: a call's id, type and name (with its arguments so far) once its name is
    // whole, then each new piece of its arguments.
    let call_deltas = |held: &mut Held| -> Vec<Value> {
        let Some(format) = shared.tool_format else {
            return Vec::new();
        };
        if !held.blocked && call.forced_prefix.is_empty() {
            return Vec::new();
        }
        let answer: std::borrow::Cow<str> = if call.forced_prefix.is_empty() {
            held.text.as_str().into()
        } else {
            format!("{}{}", call.forced_prefix, held.text).into()
        };
        let mut out = Vec::new();
        let first = held.cursor.closed;
        let calls = format.partial_calls(&answer, &mut held.cursor);
        for (k, c) in calls.into_iter().enumerate().map(|(j, c)| (first + j, c)) {
            if call.one_call && k > 0 {
                break;
            }
            match held.calls.get_mut(k) {
                None => {
                    if held.tag.is_empty() {
                        held.tag = unique_tag();
                    }
                    let id =
                        c.id.map_or_else(|| format!("call_{}{k}", held.tag), str::to_string);
                    out.push(
                        json!({"tool_calls": [{"index": k, "id": id, "type": "function",
                        "function": {"name": c.name, "arguments": c.arguments}}]}),
                    );
                    held.calls.push((id, c.arguments.len()));
                }
                Some((_, sent)) => {
                    if let Some(new) = c.arguments.get(*sent..).filter(|n| !n.is_empty()) {
                        out.push(json!({"tool_calls": [{"index": k,
                            "function": {"arguments": new}}]}));
                        *sent = c.arguments.len();
                    }
                }
            }
        }
        out
    };
    let mut choices: Vec<Choice> = (0..call.choices())
        .map(|_| Choice {
            splitter: splitter(shared, call),
            held: Held::default(),
            offset: 0,
            out: None,
        })
        .collect();
    // Content before the tool-call markup streams as it comes (as vLLM's tool parsers let it),
    // except under a forced call, whose answer is the call.
    let streams_content = call.forced_prefix.is_empty();
    // The tokens' log-probabilities go with the first chunk of their event (a chunk of their own
    // when the event's text is held back). With tools, the answer is held back and sent with its
    // parsed calls at the end.
    let emit = |w: &mut Box<dyn Write + Send>,
                i: usize,
                segs: Vec<Segment>,
                held: &mut Held,
                lps: &[TokenLogprob]|
     -> bool {
        let mut logprobs = match (call.logprobs, lps.is_empty()) {
            (Some(_), false) => Some(chat_logprobs(&shared.tokenizer, call.token_ids, lps)),
            _ => None,
        };
        for s in segs {
            let deltas = match s {
                Segment::Reasoning(r) if !r.is_empty() => vec![json!({"reasoning_content": r})],
                Segment::Answer(a) if !a.is_empty() => {
                    if call.tools {
                        held.text.push_str(&a);
                        let mut deltas = Vec::new();
                        let settled = shared
                            .tool_format
                            .filter(|_| streams_content && !held.blocked)
                            .map(|f| f.settled_content(&held.text, held.streamed));
                        if let Some((end, blocked)) = settled {
                            held.blocked = blocked;
                            if end > held.streamed {
                                let ready = held.text[held.streamed..end].to_string();
                                held.streamed = end;
                                deltas.push(json!({"content": ready}));
                            }
                        }
                        deltas.extend(call_deltas(held));
                        deltas
                    } else {
                        vec![json!({"content": a})]
                    }
                }
                _ => continue,
            };
            for delta in deltas {
                let mut c = json!({"index": i, "delta": delta, "finish_reason": null});
                if let Some(l) = logprobs.take() {
                    c["logprobs"] = l;
                }
                if !send(w, &chunk(c)) {
                    return false;
                }
            }
        }
        match logprobs {
            Some(l) => send(
                w,
                &chunk(json!({"index": i, "delta": {}, "logprobs": l, "finish_reason": null})),
            ),
            None => true,
        }
    };
    // Each choice's end: what its splitter still holds, its tool calls, its finish reason.
    let finish = |w: &mut Box<dyn Write + Send>, i: usize, ch: &mut Choice| -> bool {
        let out = ch.out.as_ref().expect("a finished choice");
        let mut finish = finish_word(out);
        if !call.chat {
            return send(
                w,
                &chunk(
                    json!({"index": i, "text": "", "logprobs": null, "finish_reason": finish,
                              "stop_reason": stop_reason(shared, call, out)}),
                ),
            );
        }
        let rest = ch
            .splitter
            .as_mut()
            .map_or(Vec::new(), ReasoningSplitter::finish);
        if !emit(w, i, rest, &mut ch.held, &[]) {
            return false;
        }
        if call.tools {
            let mut message = json!({});
            set_answer(&mut message, shared, call, &ch.held.text, &mut finish);
            // A call that went out as it was written and that the whole answer does not hold
            // (the length limit cut it after the calls before it closed): the error says so.
            let whole = message["tool_calls"].as_array().map_or(0, Vec::len);
            if whole > 0 && ch.held.calls.len() > whole {
                message["tool_call_error"] = format!(
                    "tool call {whole} was cut off at the answer's length limit (max_tokens or \
                     the model's context: give it more room); the calls before it are whole"
                )
                .into();
            }
            // The content that went out already is not sent again.
            let sent = &ch.held.text[..ch.held.streamed];
            // (The parsed content begins with the text before any markup.)
            if let Some(rest) = message["content"]
                .as_str()
                .and_then(|c| c.strip_prefix(sent))
                .filter(|_| !sent.is_empty())
            {
                message["content"] = rest.to_string().into();
            }
            // Calls went out as they were written but the whole answer does not read (cut off,
            // arguments that are not JSON): the error says so, and the markup is not sent
            // again as content (as vLLM's streamed calls stand once sent).
            if !ch.held.calls.is_empty() && message.get("tool_calls").is_none() {
                message.as_object_mut().map(|o| o.remove("content"));
            }
            // Calls that went out as they were written get what they still lack (the end of
            // their arguments, as parsed whole); the others come whole.
            if let Some(calls) = message.get_mut("tool_calls").and_then(Value::as_array_mut) {
                let mut rest = Vec::new();
                for (k, c) in calls.iter_mut().enumerate() {
                    let Some((_, sent)) = ch.held.calls.get(k) else {
                        c["index"] = k.into();
                        rest.push(c.take());
                        continue;
                    };
                    let args = c["function"]["arguments"].as_str().unwrap_or("");
                    if let Some(new) = args.get(*sent..).filter(|n| !n.is_empty()) {
                        rest.push(json!({"index": k, "function": {"arguments": new}}));
                    }
                }
                *calls = rest;
            }
            if message["tool_calls"]
                .as_array()
                .is_some_and(|c| c.is_empty())
            {
                message.as_object_mut().map(|o| o.remove("tool_calls"));
            }
            if message["content"].as_str().is_some_and(str::is_empty) {
                message.as_object_mut().map(|o| o.remove("content"));
            }
            if !message.as_object().is_some_and(Map::is_empty)
                && !send(
                    w,
                    &chunk(json!({"index": i, "delta": message, "finish_reason": null})),
                )
            {
                return false;
            }
        }
        let why = stop_reason(shared, call, ch.out.as_ref().expect("a finished choice"));
        send(
            w,
            &chunk(json!({"index": i, "delta": {}, "finish_reason": finish, "stop_reason": why})),
        )
    };
    while choices.iter().any(|c| c.out.is_none()) {
        let got = loop {
            match rx.recv_timeout(shared.keepalive) {
                Ok(ev) => break Ok(ev),
                // Nothing to send for a while (queued, a long prefill): an SSE comment, which
                // clients skip, so a client that left is noticed at a failed write and its
                // request aborted rather than run for nobody.
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    if !write_chunk(&mut w, b": keep-alive\n\n") {
                        return;
                    }
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => break Err(mpsc::RecvError),
            }
        };
        let ok = match got {
            Ok((i, Event::Text(t, lps, count))) => {
                generated[i].set(count);
                let ch = &mut choices[i];
                if call.chat {
                    let segs = match &mut ch.splitter {
                        Some(sp) => sp.push(&t),
                        None => vec![Segment::Answer(t)],
                    };
                    emit(&mut w, i, segs, &mut ch.held, &lps)
                } else {
                    let logprobs = match call.logprobs {
                        Some(_) => completion_logprobs(
                            &shared.tokenizer,
                            call.token_ids,
                            &lps,
                            &mut ch.offset,
                        ),
                        None => Value::Null,
                    };
                    send(
                        &mut w,
                        &chunk(
                            json!({"index": i, "text": t, "logprobs": logprobs, "finish_reason": null}),
                        ),
                    )
                }
            }
            Ok((i, Event::Done(out))) => {
                generated[i].set(out.tokens.len());
                choices[i].out = Some(out);
                finish(&mut w, i, &mut choices[i])
            }
            // A failed request's stream ends with an error event, then `[DONE]`, as vLLM's.
            Ok((_, Event::Failed(status, message))) => {
                let e = ApiError::new(status, message);
                if send(&mut w, &e.body()) && write_chunk(&mut w, b"data: [DONE]\n\n") {
                    write_chunk(&mut w, b"");
                }
                return;
            }
            // The engine is gone (a rank failed or left): the stream ends with why, as
            // vLLM's does with an error event, not cut off.
            Err(_) => {
                let e = ApiError::new(500, ENGINE_STOPPED);
                if send(&mut w, &e.body()) && write_chunk(&mut w, b"data: [DONE]\n\n") {
                    write_chunk(&mut w, b"");
                }
                return;
            }
        };
        if !ok {
            // The client is gone: dropping `rx` makes the engine abort the requests.
            return;
        }
    }
    if call.include_usage {
        let outs: Vec<Box<RequestOutput>> = choices.into_iter().filter_map(|c| c.out).collect();
        let v = json!({"id": id, "object": object, "created": created, "model": shared.name,
                       "choices": [], "usage": usage(call.prompt_tokens(), &outs)});
        if !send(&mut w, &v) {
            return;
        }
    }
    if write_chunk(&mut w, b"data: [DONE]\n\n") {
        write_chunk(&mut w, b"");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fetch under way when its room is dropped learns it at once, and the drop aborts the
    /// prefill still under way.
    #[test]
    fn a_dropped_room_aborts_its_prefill() {
        let rooms = Arc::new(Rooms {
            map: Mutex::new(HashMap::new()),
            changed: Condvar::new(),
            timeout: Duration::from_secs(20),
        });
        let gone = Arc::new(AtomicBool::new(false));
        rooms.open(7, 1, Some(gone.clone())).unwrap();
        let early = {
            let r = rooms.clone();
            std::thread::spawn(move || r.take(7, None))
        };
        std::thread::sleep(Duration::from_millis(100));
        assert!(rooms.release(7));
        assert!(gone.load(Ordering::Relaxed), "the prefill is aborted");
        let e = early.join().unwrap().unwrap_err();
        assert!(e.contains("was dropped"), "{e}");
        // Nothing left to drop: said so (the router then drops it again after the prefill).
        assert!(!rooms.release(7) && !rooms.release(8));
    }

    /// The names of the calls an answer parses to.
    fn call_names(format: ToolCallFormat, answer: &str) -> Vec<String> {
        let parsed = format.parse(answer).unwrap();
        parsed
            .tool_calls
            .into_iter()
            .map(|c| c.function.name)
            .collect()
    }

    /// A loop over a variable set from a message's content walks its parts (Kimi-K2-Thinking's
    /// macro); a containment test on one (R1's `'</think>' in content`) does not.
    #[test]
    fn templates_that_walk_content_through_a_variable() {
        let k2 = "{%- macro render_content(msg) -%}{%- set c = msg.get('content') -%}\
                  {%- if c is string -%}{{ c }}{%- else -%}{%- for content in c -%}\
                  {{ content['text'] }}{%- endfor -%}{%- endif -%}{%- endmacro -%}";
        assert!(walks_content_variable(k2));
        let r1 = "{% set content = message['content'] %}{% if '</think>' in content %}\
                  {% set content = content.split('</think>')[-1] %}{% endif %}{{ content }}";
        assert!(!walks_content_variable(r1));
        assert!(!walks_content_variable(
            "{% for m in messages %}{{ m.content }}{% endfor %}"
        ));
    }

    /// Kimi-K2's template: for "required" a forced call's prompt ends where the function's name
    /// goes, and each lead completes `functions.NAME:INDEX` with the argument marker; a named
    /// call's prompt ends at its arguments; both close with the call's and section's markers.
    #[test]
    fn forced_calls_in_kimi_k2s_format() {
        let dir =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/text/kimi_style");
        let tok = Tokenizer::from_dir(&dir).unwrap();
        let format = ToolCallFormat::for_tokenizer(&tok, false);
        assert_eq!(format, Some(ToolCallFormat::KimiK2));
        let template = tok.chat_template().unwrap().unwrap();
        let messages = json!([{"role": "user", "content": "Weather in Paris?"}]);
        let weather = json!({"type": "object", "properties": {"city": {"type": "string"}},
                             "required": ["city"]});
        // (A keyword structured output cannot hold: the arguments are any object.)
        let time = json!({"type": "object", "properties": {"tz": {"if": {"type": "null"}}}});
        let tools = json!([
            {"type": "function", "function": {"name": "get_weather", "parameters": weather}},
            {"type": "function", "function": {"name": "get_time", "parameters": time}}]);
        let kwargs = Map::new();
        let any = forced_call(format, &template, &messages, Some(&tools), &kwargs, &None).unwrap();
        let ForcedJson {
            leads,
            suffix,
            more,
            ..
        } = any.json.expect("JSON arguments");
        // More calls may follow, each numbered on (up to a bound, then only the end).
        assert_eq!(more.len(), MAX_NUMBERED_CALLS);
        assert!(more.last().unwrap().is_empty());
        for (k, next) in more[..MAX_NUMBERED_CALLS - 1].iter().enumerate() {
            assert_eq!(next.len(), 3);
            assert_eq!(
                next[1].text,
                format!(
                    "<|tool_call_end|><|tool_call_begin|>functions.get_time:{}\
                     <|tool_call_argument_begin|>",
                    k + 1
                )
            );
            assert_eq!(next[0].schema.as_ref(), Some(&weather));
            assert!(next[2].ends && next[2].text == suffix);
        }
        let two = format!(
            "{}{}{{\"city\": \"Paris\"}}{}{{}}{suffix}",
            any.prefix, leads[0].text, more[0][1].text
        );
        assert_eq!(
            call_names(ToolCallFormat::KimiK2, &two),
            ["get_weather", "get_time"]
        );
        let calls: Vec<String> = leads
            .iter()
            .map(|l| format!("{}{}", any.prefix, l.text))
            .collect();
        for (call, name) in calls.iter().zip(["get_weather", "get_time"]) {
            let want = format!("<|tool_call_begin|>functions.{name}:0<|tool_call_argument_begin|>");
            assert!(call.ends_with(&want), "{call}");
        }
        assert_eq!(suffix, "<|tool_call_end|><|tool_calls_section_end|>");
        assert_eq!(leads[0].schema.as_ref(), Some(&weather));
        assert_eq!(leads[1].schema, None);
        // A lead, JSON arguments and the suffix parse as the call.
        let answer = format!(
            "{}{}{{\"city\": \"Paris\"}}{suffix}",
            any.prefix, leads[0].text
        );
        let parsed = ToolCallFormat::KimiK2.parse(&answer).unwrap();
        assert_eq!(parsed.tool_calls[0].function.name, "get_weather");
        let named = Some("get_time".to_string());
        let one = forced_call(format, &template, &messages, Some(&tools), &kwargs, &named).unwrap();
        assert!(
            one.prefix
                .ends_with("functions.get_time:0<|tool_call_argument_begin|>"),
            "{}",
            one.prefix
        );
        assert_eq!(
            one.json,
            Some(ForcedJson {
                leads: Vec::new(),
                more: Vec::new(),
                schema: None,
                suffix: suffix.clone(),
                dsml: false,
            })
        );
        let named = Some("get_weather".to_string());
        let w = forced_call(format, &template, &messages, Some(&tools), &kwargs, &named).unwrap();
        assert_eq!(w.json.unwrap().schema, Some(weather));
        // Kimi-K2-Thinking's template writes an empty `<think></think>` before an assistant's
        // calls: the forced call is written so too.
        let thinking = ChatTemplate::new(
            "{%- for m in messages -%}\
             {%- if m.role == 'user' -%}<|im_user|>user<|im_middle|>{{ m.content }}<|im_end|>\
             {%- else -%}<|im_assistant|>assistant<|im_middle|><think></think>\
             {{- m.content or '' -}}\
             {%- if m.tool_calls -%}<|tool_calls_section_begin|>\
             {%- for tc in m.tool_calls -%}<|tool_call_begin|>{{ tc.id }}\
             <|tool_call_argument_begin|>{{ tc.function.arguments }}<|tool_call_end|>\
             {%- endfor -%}<|tool_calls_section_end|>{%- endif -%}<|im_end|>\
             {%- endif -%}{%- endfor -%}\
             {%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}",
            "k2_thinking.jinja",
        );
        let t = forced_call(format, &thinking, &messages, Some(&tools), &kwargs, &named).unwrap();
        assert!(
            t.prefix.starts_with("<|tool_calls_section_begin|>")
                && t.prefix
                    .ends_with("functions.get_weather:0<|tool_call_argument_begin|>"),
            "{}",
            t.prefix
        );
        // The empty think block is in the prompt, not in the answer's prefix (so not in its
        // content).
        assert!(
            t.prompt.ends_with(&format!(
                "<|im_assistant|>assistant<|im_middle|><think></think>{}",
                t.prefix
            )),
            "{}",
            t.prompt
        );
        // Broken parameters are refused, others (held or not) are taken.
        for (p, broken) in [
            (
                json!({"type": "object", "properties": {"n": {"type": "integer", "minimum": 5,
                       "maximum": 3}}}),
                true,
            ),
            (json!({"type": "string"}), true),
            (
                json!({"type": "object", "properties": {"a": {"type": "foo"}}}),
                true,
            ),
            (
                json!({"properties": {"a": {"type": "array", "minItems": 3, "maxItems": 1}}}),
                true,
            ),
            (
                json!({"type": "object", "properties": {"a": {"exclusiveMinimum": 1,
                       "maximum": 1}}}),
                true,
            ),
            (
                json!({"type": "object", "patternProperties": {"^a": {}, "^b": {}, "^c": {},
                       "^d": {}, "^e": {}}}),
                false,
            ),
            (
                json!({"type": ["object", "null"],
                       "properties": {"a": {"dependentRequired": {}}}}),
                false,
            ),
            (json!({}), false),
            (
                json!({"type": "object", "properties": {"t": {"type": "array",
                       "items": [{"type": "integer", "minimum": 5, "maximum": 1}]}}}),
                true,
            ),
            (
                json!({"type": "object", "properties": {"a": {"type": "array",
                       "contains": {"type": "integr"}}}}),
                true,
            ),
            // A union with one satisfiable branch, or a `not` of nothing, is no broken schema.
            (
                json!({"type": "object", "properties": {"a": {"anyOf": [
                       {"type": "integer", "minimum": 5, "maximum": 3}, {"type": "string"}]}}}),
                false,
            ),
            (
                json!({"type": "object", "properties": {"a": {"not": {"minimum": 5,
                       "maximum": 3}}}}),
                false,
            ),
        ] {
            assert_eq!(broken_parameters(&p).is_some(), broken, "{p}");
        }
    }

    /// DeepSeek-R1's template: after a "required" call's arguments the model may write another
    /// call (the same markup after every call: one entry) or close the section; a named call
    /// gets one.
    #[test]
    fn required_calls_in_r1s_format_may_be_several() {
        let dir =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../assets/cachalot-tiny-r1");
        let tok = Tokenizer::from_dir(&dir).unwrap();
        let format = ToolCallFormat::for_tokenizer(&tok, false);
        let template = tok.chat_template().unwrap().unwrap();
        let messages = json!([{"role": "user", "content": "Weather in Paris and Rome?"}]);
        let tools = json!([
            {"type": "function", "function": {"name": "get_weather", "parameters":
                {"type": "object", "properties": {"city": {"type": "string"}}}}},
            {"type": "function", "function": {"name": "get_time"}}]);
        let kwargs = Map::new();
        let any = forced_call(format, &template, &messages, Some(&tools), &kwargs, &None).unwrap();
        let j = any.json.expect("JSON arguments");
        assert_eq!(j.more.len(), 1, "{:?}", j.more);
        let next = &j.more[0];
        assert_eq!(
            next[0].text,
            "\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
        );
        assert_eq!(next[0].schema, j.leads[0].schema);
        assert!(next[0].then_json && !next[0].ends);
        assert!(next[2].ends && next[2].text == j.suffix);
        let answer = format!(
            "{}{}{{\"city\": \"Paris\"}}{}{{\"city\": \"Rome\"}}{}{{}}{}",
            any.prefix, j.leads[0].text, next[0].text, next[1].text, j.suffix
        );
        let parsed = format.unwrap().parse(&answer).unwrap();
        let calls: Vec<(&str, Option<&str>)> = parsed
            .tool_calls
            .iter()
            .map(|c| (c.function.name.as_str(), c.function.arguments.as_str()))
            .collect();
        assert_eq!(
            calls,
            [
                ("get_weather", Some("{\"city\": \"Paris\"}")),
                ("get_weather", Some("{\"city\": \"Rome\"}")),
                ("get_time", Some("{}"))
            ]
        );
        let named = Some("get_time".to_string());
        let one = forced_call(format, &template, &messages, Some(&tools), &kwargs, &named).unwrap();
        assert!(one.json.unwrap().more.is_empty());
    }

    /// DeepSeek-V4's DSML: a forced call's prompt ends where the model names the function
    /// ("required": each lead is a tool's name up to its first parameter, with its tool's
    /// parameters after it) or writes its first parameter (a named call); the parameters are
    /// held as DSML (`dsml`); the answer parses as the call.
    #[test]
    fn forced_calls_in_deepseek_v4s_dsml() {
        let dir =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/v4/flash_tiny");
        let tok = Tokenizer::from_dir(&dir).unwrap();
        let format = ToolCallFormat::for_tokenizer(&tok, true);
        let template = tok.chat_template().unwrap().unwrap();
        let messages = json!([{"role": "user", "content": "Weather in Paris?"}]);
        let tools = json!([
            {"type": "function", "function": {"name": "get_weather", "parameters":
                {"type": "object", "properties": {"city": {"type": "string"}}}}},
            {"type": "function", "function": {"name": "get_time", "parameters": {}}}]);
        let kwargs = Map::new();
        let any = forced_call(format, &template, &messages, Some(&tools), &kwargs, &None).unwrap();
        let j = any.json.expect("the name is held");
        let d = cachalot_model::tokenizer::dsv4::DSML;
        assert!(j.dsml && j.suffix == format!("\n</{d}tool_calls>"));
        assert!(j.leads.iter().all(|l| l.then_json));
        assert_eq!(
            j.leads[0].schema,
            Some(tools[0]["function"]["parameters"].clone())
        );
        assert_eq!(j.leads[1].schema, Some(json!({"type": "object"})));
        let answer = format!(
            "{}{}<{d}parameter name=\"city\" string=\"true\">Paris</{d}parameter>\n</{d}invoke>\n</{d}tool_calls>",
            any.prefix,
            j.leads[0].text,
            d = cachalot_model::tokenizer::dsv4::DSML
        );
        let parsed = ToolCallFormat::DeepseekV4.parse(&answer).unwrap();
        assert_eq!(parsed.tool_calls[0].function.name, "get_weather");
        // "required" may go on with more calls, each an invoke of one of the tools, or close
        // the block: the answer then parses as every call.
        assert_eq!(j.more.len(), 1);
        let next = &j.more[0];
        assert_eq!(next.len(), 3);
        assert_eq!(next[1].text, format!("\n<{d}invoke name=\"get_time\">\n"));
        assert!(next[1].then_json && next[2].ends && next[2].text == j.suffix);
        let two = format!(
            "{}{}<{d}parameter name=\"city\" string=\"true\">Paris</{d}parameter>\n</{d}invoke>{}</{d}invoke>{}",
            any.prefix, j.leads[0].text, next[1].text, next[2].text
        );
        assert_eq!(
            call_names(ToolCallFormat::DeepseekV4, &two),
            ["get_weather", "get_time"]
        );
        let named = Some("get_time".to_string());
        let one = forced_call(format, &template, &messages, Some(&tools), &kwargs, &named).unwrap();
        let j = one.json.expect("the parameters are held");
        assert!(j.dsml && j.leads.is_empty() && j.more.is_empty());
        assert_eq!(j.schema, Some(json!({"type": "object"})));
        assert!(
            one.prefix.ends_with("name=\"get_time\">\n"),
            "{:?}",
            one.prefix
        );
        // A function without `parameters` takes none: its arguments are `{}`.
        let ping = json!([{"type": "function", "function": {"name": "ping"}}]);
        let named = Some("ping".to_string());
        let f = forced_call(format, &template, &messages, Some(&ping), &kwargs, &named).unwrap();
        assert_eq!(
            f.json.unwrap().schema,
            Some(json!({"type": "object", "properties": {}, "additionalProperties": false}))
        );
    }

    /// continue_final_message cuts at a marker after the final text, as transformers 5 does:
    /// a text the markup also spells (ChatML's `a` in `assistant`), an empty one, a trimming
    /// template, and a final message of reasoning alone (under any of its names) continued
    /// inside its reasoning.
    #[test]
    fn a_continued_message_is_cut_after_its_text() {
        let chatml = ChatTemplate::new(
            "{% for m in messages %}<|im_start|>{{ m.role }}\n\
             {% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}\
             {{ m.content | trim }}<|im_end|>\n{% endfor %}",
            "chatml.jinja",
        );
        let kwargs = Map::new();
        let cut = |content: Value, extra: Value| {
            let mut last = json!({"role": "assistant", "content": content});
            for (k, v) in extra.as_object().unwrap() {
                last[k] = v.clone();
            }
            let m = flatten_text_parts(&json!([{"role": "user", "content": "hi"}, last]), &chatml);
            render_chat(&chatml, &m, false, true, None, &kwargs).unwrap()
        };
        let head = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n";
        // (Trimmed with the marker's space, the text before an empty one is trimmed too, as
        // transformers does.)
        assert_eq!(cut(json!(""), json!({})), head.trim_end());
        for (content, want) in [("a", "a"), ("as\n", "as"), ("I am", "I am")] {
            assert_eq!(
                cut(json!(content), json!({})),
                format!("{head}{want}"),
                "{content:?}"
            );
        }
        assert_eq!(
            cut(
                json!([{"type": "text", "text": "x"}, {"type": "text", "text": "y"}]),
                json!({})
            ),
            format!("{head}x\ny")
        );
        for name in ["reasoning", "thinking", "reasoning_content"] {
            assert_eq!(
                cut(json!(""), json!({name: "Let me"})),
                format!("{head}<think>Let me"),
                "{name}"
            );
        }
        // transformers' order: `thinking` before `reasoning`.
        let mut m = json!({"role": "assistant", "reasoning": "R", "thinking": "T"});
        alias_reasoning(&mut m);
        assert_eq!(
            (&m["reasoning_content"], &m["thinking"]),
            (&json!("T"), &json!("T"))
        );
        let mut m = json!({"role": "assistant", "reasoning": "R"});
        alias_reasoning(&mut m);
        assert_eq!(
            (&m["reasoning_content"], &m["thinking"]),
            (&json!("R"), &json!("R"))
        );
    }
}
