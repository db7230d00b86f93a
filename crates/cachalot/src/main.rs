//! The cachalot command line: `run` (offline runs from YAML), `perplexity`, `tokenize`,
//! `generate`, `chat`, `bench`, `serve` (an OpenAI-compatible server; prefill or decode role),
//! `router` (in front of prefill and decode servers), `convert`, `convert-config` and
//! `calibrate` (see README.md).

/// `eprintln!` as one write: ranks and servers that share a stderr pipe never cut into each
/// other's lines (`eprintln!` on the unbuffered stderr writes a line in pieces).
macro_rules! say {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let mut line = format!($($arg)*);
        line.push('\n');
        let _ = std::io::stderr().lock().write_all(line.as_bytes());
    }};
}

mod bench;
mod http_front;
mod quant;
mod router;
mod run;
mod serve;
mod serve_metrics;
mod term;
mod text;

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use cachalot_model::eval;
use cachalot_model::tokenizer::Tokenizer;
use cachalot_model::{
    detect_family, AttentionPath, DeepseekV3, DeepseekV4, Fp8Mode, KvCacheDtype, LoadOptions,
    ModelFamily, V4LoadOptions,
};
use clap::{Parser, Subcommand, ValueEnum};

#[derive(Parser)]
#[command(name = "cachalot", version, about = "DeepSeek-family inference on CPU")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum Fp8Arg {
    /// Multiply FP8 weights natively (1 byte per weight).
    Native,
    /// Dequantize FP8 weights to f32 at load.
    F32,
}

/// `--kv-cache-dtype`: how the latent KV cache stores its values.
#[derive(Clone, Copy, Debug, ValueEnum)]
enum KvDtypeArg {
    /// bf16 for the DeepSeek-V3 family (the seed's C16; vLLM's `auto` and llama.cpp's f16
    /// cache are 16-bit too), f32 for DeepSeek-V4 (exact; bf16 halves its cache too).
    Auto,
    F32,
    Bf16,
    /// DeepSeek-V4 only (compact layout): compressed entries and indexer keys as e4m3 with
    /// power-of-two block scales (the seed's fp8 cache), the rings in bf16.
    Fp8,
}

impl KvDtypeArg {
    /// The dtype asked for; None for `auto` (the model family decides).
    fn chosen(self) -> Option<KvCacheDtype> {
        match self {
            KvDtypeArg::Auto => None,
            KvDtypeArg::F32 => Some(KvCacheDtype::F32),
            KvDtypeArg::Bf16 => Some(KvCacheDtype::Bf16),
            KvDtypeArg::Fp8 => Some(KvCacheDtype::Fp8),
        }
    }
}

/// `--prefix-caching`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, ValueEnum)]
pub(crate) enum PrefixCachingArg {
    /// On where it runs exactly: DeepSeek-V3/R1/Kimi-K2 without a C8 (int8) cache, and
    /// DeepSeek-V4; not under force_eplb.
    #[default]
    Auto,
    On,
    Off,
}

impl PrefixCachingArg {
    /// What [`cachalot_engine::Engine::set_prefix_caching`] takes.
    pub(crate) fn chosen(self) -> Option<bool> {
        match self {
            PrefixCachingArg::Auto => None,
            PrefixCachingArg::On => Some(true),
            PrefixCachingArg::Off => Some(false),
        }
    }
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum AttnArg {
    Auto,
    Naive,
    Absorbed,
}

#[derive(clap::Args, Clone, Debug)]
struct ModelArgs {
    /// Hugging Face model directory (config.json, safetensors, tokenizer.json or
    /// tiktoken.model). Without it, the small model shipped in assets/cachalot-tiny-r1.
    #[arg(long)]
    model: Option<PathBuf>,
    /// How FP8 weights are held.
    #[arg(long, value_enum, default_value = "native")]
    fp8: Fp8Arg,
    /// MLA form: chosen per step by cost, or forced.
    #[arg(long, value_enum, default_value = "auto")]
    attention: AttnArg,
    /// Hold the output head (lm_head) in int8 with int8 activations (W8A8, one scale per row),
    /// as llama.cpp's Q8_0 files do, instead of the checkpoint's bf16: half the head's bytes
    /// per token, logits rounded accordingly.
    #[arg(long)]
    int8_head: bool,
    /// Multiply bf16 weights as BF16 x BF16, activations rounded to bf16 (AVX-512 `vdpbf16ps`
    /// where the CPU has it), as llama.cpp does with BF16 weights; routers (and V4's indexer)
    /// keep f32 activations. Default: f32 activations, exact products.
    #[arg(long)]
    bf16_dot: bool,
    /// How the KV cache stores its values: bf16 (C16, as the seed: half the memory per cached
    /// token, each value rounded to bf16 when made; DeepSeek-V4's rings too), f32 (exact) or,
    /// for DeepSeek-V4's compact cache, fp8 (compressed entries in e4m3, the seed's fp8 cache).
    /// `auto`: bf16 for the DeepSeek-V3 family, f32 for DeepSeek-V4.
    #[arg(long, value_enum, default_value = "auto")]
    kv_cache_dtype: KvDtypeArg,
    /// DeepSeek-V4's cache layout: compact (compressed entries in the paged pool, the 128-token
    /// window and the compressor inputs in per-sequence rings: bounded memory per sequence) or
    /// full (every position's state in the pool, ~14.5 KiB per token and layer for Flash: what
    /// prefix caching can share).
    #[arg(long, default_value = "compact")]
    v4_cache: cachalot_model::V4CacheMode,
    /// Read every tensor of the checkpoint before running and refuse a NaN or infinity (a NaN
    /// FP8 code or E8M0 scale), naming the tensor, as llama.cpp's --check-tensors (the whole
    /// checkpoint is read at start).
    #[arg(long)]
    check_tensors: bool,
    /// Only the first N decoder layers (a YAML's `custom_params.num_hidden_layers`; DeepSeek-V3
    /// family).
    #[arg(skip)]
    max_layers: Option<usize>,
    /// The routed experts this process holds (expert parallelism over ranks).
    #[arg(skip)]
    expert_shard: cachalot_model::ExpertShard,
    /// The heads and intermediate features this process holds (tensor parallelism over ranks).
    #[arg(skip)]
    tensor_shard: cachalot_model::TensorShard,
}

#[derive(clap::Args)]
#[group(required = true, multiple = false)]
struct InputArgs {
    /// Text file, tokenized with the model's tokenizer as --prompt is (perplexity: no special
    /// tokens added; generate: the BOS token first where the tokenizer config asks for it).
    #[arg(long)]
    file: Option<PathBuf>,
    /// Comma-separated token ids (spaces around them allowed).
    #[arg(long, value_delimiter = ',', value_parser = token_id)]
    token_ids: Option<Vec<u32>>,
    /// Text given on the command line.
    #[arg(long, allow_hyphen_values = true)]
    prompt: Option<String>,
}

/// One id of `--token-ids` (spaces around it allowed, as `tokenize --decode` takes them).
fn token_id(s: &str) -> std::result::Result<u32, String> {
    s.trim()
        .parse::<u32>()
        .map_err(|e| format!("{s:?} is not a token id ({e}); give ids as 1,2,3"))
}

#[derive(Subcommand)]
enum Command {
    /// Offline run of a YAML config (the seed's schema): a dataset through the engine, figures
    /// to res/<run-id>/. No arguments: configs/default.yaml.
    Run(run::RunArgs),
    /// Log-probability of each next token, mean NLL and perplexity.
    Perplexity {
        #[command(flatten)]
        model: ModelArgs,
        #[command(flatten)]
        input: InputArgs,
        /// Prefill chunk size in tokens.
        #[arg(long, default_value_t = 512)]
        chunk: usize,
        /// Score in consecutive windows of this many tokens, each its own context (0: one
        /// context over the whole input).
        #[arg(long, default_value_t = 0)]
        window: usize,
        /// Print one JSON object: {"n_tokens", "n_scored", "logprobs", "nll", "ppl"}.
        #[arg(long)]
        json: bool,
        /// Threads (default: all cores).
        #[arg(long)]
        threads: Option<usize>,
    },
    /// Token ids of a text (`--text`), or the text of token ids (`--decode`).
    Tokenize(text::TokenizeArgs),
    /// Continue a prompt (or answer it as a chat turn with `--chat`), streaming the text.
    Generate(text::GenerateArgs),
    /// Interactive chat on stdin/stdout: /reset, /system TEXT, /exit; Ctrl-C stops an answer.
    Chat(text::ChatArgs),
    /// Convert a checkpoint (FP8 as DeepSeek ships it, BF16, or Kimi-K2-Thinking's int4): V3/R1/Kimi
    /// to bfloat16, w8a8c16 or w8a8c8 (--quant-mode);
    /// DeepSeek-V4 to bfloat16, w8a8-int, w4a8-int, w4a8-mx or w4a8-mx-hif (--quant-type).
    Convert(quant::ConvertArgs),
    /// Rewrite a DeepSeek-V4 config.json's quantization_config in place (the seed's
    /// convert_config.py); the first rewrite keeps the original as config.json.orig.
    ConvertConfig(quant::ConvertConfigArgs),
    /// C8 latent-cache scales: run a text through a model and record each layer's c_kv range.
    Calibrate(quant::CalibrateArgs),
    /// Prefill and decode throughput (batch 1 and N), TTFT, TPOT, peak RSS, weight bytes per
    /// token, memory bandwidth (`--membw`); or MTP speculative decoding (`--mtp N`).
    Bench(bench::BenchArgs),
    /// OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, /v1/models,
    /// /health), continuously batched, streamed with "stream": true; `--role prefill|decode`
    /// for prefill/decode disaggregation behind `cachalot router`.
    Serve(serve::ServeArgs),
    /// The front of a prefill/decode-disaggregated deployment: sends each request to a prefill
    /// and a decode server (`cachalot serve --role prefill|decode`) and answers with the decode
    /// server's response.
    Router(router::RouterArgs),
}

/// The small model shipped with the project, used when no `--model` is given.
pub const DEFAULT_MODEL: &str = "assets/cachalot-tiny-r1";

/// The model directory: `--model`, else the shipped small model (looked up from the working
/// directory, then from the source tree this binary was built from).
/// [`model_dir`], its tensors' values checked first under `--check-tensors`.
fn checked_model_dir(args: &ModelArgs) -> Result<PathBuf> {
    let dir = model_dir(args)?;
    if args.check_tensors {
        cachalot_model::checkpoint::Checkpoint::open(&dir)?.check_values()?;
    }
    Ok(dir)
}

fn model_dir(args: &ModelArgs) -> Result<PathBuf> {
    if let Some(dir) = &args.model {
        return Ok(dir.clone());
    }
    let candidates = [
        PathBuf::from(DEFAULT_MODEL),
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../..")
            .join(DEFAULT_MODEL),
    ];
    match candidates.iter().find(|d| d.join("config.json").is_file()) {
        // The second candidate shown without its `crates/cachalot/../..`.
        Some(d) => Ok(d.canonicalize().unwrap_or_else(|_| d.clone())),
        None => bail!(
            "no --model given and the shipped small model ({DEFAULT_MODEL}) was not found from \
             here; run from the repository root or pass --model DIR"
        ),
    }
}

fn load(args: &ModelArgs) -> Result<DeepseekV3> {
    load_model(args, false)
}

/// The model, with its MTP layer when `load_mtp` (an error when it has none).
fn load_model(args: &ModelArgs, load_mtp: bool) -> Result<DeepseekV3> {
    let opts = LoadOptions {
        fp8: match args.fp8 {
            Fp8Arg::Native => Fp8Mode::Native,
            Fp8Arg::F32 => Fp8Mode::DequantizeF32,
        },
        load_mtp,
        bf16_dot: args.bf16_dot,
        max_layers: args.max_layers,
        expert_shard: args.expert_shard,
        tensor_shard: args.tensor_shard,
    };
    let dir = checked_model_dir(args)?;
    if args.v4_cache == cachalot_model::V4CacheMode::Full {
        bail!(
            "--v4-cache full: {} is a DeepSeek-V3/R1/Kimi-K2 model, whose cache has one layout \
             (the option is DeepSeek-V4's); drop it",
            dir.display()
        );
    }
    let mut model = DeepseekV3::load(&dir, opts)?;
    if load_mtp && model.mtp_layers().is_empty() {
        bail!(
            "{}: the checkpoint has no MTP layer (num_nextn_predict_layers = 0); --mtp (or a \
             YAML's model_config.next_n) needs one: leave MTP off for this model",
            dir.display()
        );
    }
    model.attention_path = match args.attention {
        AttnArg::Auto => AttentionPath::Auto,
        AttnArg::Naive => AttentionPath::Naive,
        AttnArg::Absorbed => AttentionPath::Absorbed,
    };
    if args.int8_head {
        model.quantize_head_int8();
    }
    let dtype = args.kv_cache_dtype.chosen().unwrap_or(KvCacheDtype::Bf16);
    if dtype == KvCacheDtype::Fp8 {
        bail!("{}", cachalot_run::offline::fp8_cache_refusal());
    }
    model.set_kv_cache_dtype(dtype);
    Ok(model)
}

/// The DeepSeek-V4 model of `args` (with its MTP blocks when `load_mtp`).
fn load_v4(args: &ModelArgs, load_mtp: bool) -> Result<DeepseekV4> {
    let dir = checked_model_dir(args)?;
    // Options of the DeepSeek-V3 family's model that V4's does not have: refused, not ignored.
    let v3_only = [
        (
            matches!(args.fp8, Fp8Arg::F32),
            "--fp8 f32",
            "its weights run as stored",
        ),
        (
            !matches!(args.attention, AttnArg::Auto),
            "--attention",
            "its attention has one form",
        ),
    ];
    if let Some((_, flag, why)) = v3_only.iter().find(|(given, _, _)| *given) {
        bail!(
            "{flag}: {} is a DeepSeek-V4 model ({why}; the option is the DeepSeek-V3 family's); \
             drop it",
            dir.display()
        );
    }
    let mut m = DeepseekV4::load(
        &dir,
        V4LoadOptions {
            load_mtp,
            bf16_dot: args.bf16_dot,
            expert_shard: args.expert_shard,
            tensor_shard: args.tensor_shard,
        },
    )?;
    if args.int8_head {
        m.quantize_head_int8();
    }
    m.set_cache_mode(args.v4_cache);
    m.set_kv_cache_dtype(args.kv_cache_dtype.chosen().unwrap_or(KvCacheDtype::F32));
    Ok(m)
}

/// A text file for --file: UTF-8, or an error saying where it is not.
fn read_text_file(f: &Path) -> Result<String> {
    // `-` is stdin, as the usual tools read it.
    let bytes = if f.as_os_str() == "-" {
        let mut b = Vec::new();
        std::io::Read::read_to_end(&mut std::io::stdin(), &mut b).context("cannot read stdin")?;
        b
    } else {
        std::fs::read(f).with_context(|| format!("cannot read {}", f.display()))?
    };
    String::from_utf8(bytes).map_err(|e| {
        anyhow::anyhow!(
            "{}: not UTF-8 text (invalid byte 0x{:02X} at offset {}); convert it to UTF-8 \
             (e.g. iconv -f LATIN1 -t UTF-8)",
            f.display(),
            e.as_bytes()[e.utf8_error().valid_up_to()],
            e.utf8_error().valid_up_to()
        )
    })
}

impl InputArgs {
    /// Where the text comes from, for messages.
    fn describe(&self) -> String {
        match (&self.file, &self.token_ids) {
            (Some(f), _) => f.display().to_string(),
            (None, Some(_)) => "--token-ids".to_string(),
            (None, None) => "--prompt".to_string(),
        }
    }
}

fn tokens(input: &InputArgs, model_dir: &Path) -> Result<Vec<u32>> {
    if let Some(ids) = &input.token_ids {
        return Ok(ids.clone());
    }
    let text = match (&input.file, &input.prompt) {
        (Some(f), _) => read_text_file(f)?,
        (None, Some(p)) => p.clone(),
        (None, None) => bail!("give --file, --prompt or --token-ids"),
    };
    let tok = Tokenizer::from_dir(model_dir)
        .map_err(|e| anyhow::anyhow!("{e} (or give the prompt as --token-ids)"))?;
    Ok(tok.encode(&text)?)
}

/// The text a panic was raised with (`panic!`'s formatted message or a literal; empty for
/// another payload).
pub(crate) fn panic_text(payload: &(dyn std::any::Any + Send)) -> &str {
    payload
        .downcast_ref::<String>()
        .map(String::as_str)
        .or_else(|| payload.downcast_ref::<&str>().copied())
        .unwrap_or("")
}

/// What `print!`/`println!` panic with when stdout cannot be written (a closed pipe, a full
/// disk).
const STDOUT_FAILED: &str = "failed printing to stdout";

/// The output could not be written: an error chain holding an I/O error of stdout.
fn output_error(e: &anyhow::Error) -> Option<&std::io::Error> {
    e.chain()
        .find_map(|c| c.downcast_ref::<std::io::Error>())
        .filter(|_| e.chain().any(|c| c.to_string().starts_with(OUTPUT_FAILED)))
}

/// The context of an error writing a command's output to stdout.
pub(crate) const OUTPUT_FAILED: &str = "cannot write the output";

/// Exits as a process killed by SIGPIPE reports (the reader of its output left: `| head`),
/// without a word, as C tools do.
fn exit_broken_pipe() -> ! {
    std::process::exit(128 + libc::SIGPIPE);
}

fn main() {
    tune_allocator();
    // A failed print to stdout (the reader left, the disk is full) is an error said in one
    // line below, not a panic's message and backtrace.
    let previous = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        if !panic_text(info.payload()).starts_with(STDOUT_FAILED) {
            previous(info);
        }
    }));
    // A panic is caught here too, so that under MPI it aborts the job like an error (a
    // launcher that does not end a job on a rank's failed exit would leave the others waiting).
    let result = std::panic::catch_unwind(run);
    match &result {
        Ok(Err(e)) => match output_error(e) {
            Some(io) if io.kind() == std::io::ErrorKind::BrokenPipe => exit_broken_pipe(),
            _ => match std::env::var(run::SPAWNED_RANK) {
                Ok(r) => say!("error: rank {r}: {e:#}"),
                Err(_) => say!("error: {e:#}"),
            },
        },
        Err(payload) => {
            let msg = panic_text(payload.as_ref());
            match msg.strip_prefix(STDOUT_FAILED) {
                Some(_) if msg.contains("Broken pipe") => exit_broken_pipe(),
                Some(why) => {
                    say!(
                        "error: {OUTPUT_FAILED}: {}",
                        why.trim_start_matches(':').trim()
                    );
                    cachalot_engine::comm::mpi_finish(false);
                    std::process::exit(1);
                }
                None => say!("error: cachalot panicked (the message is above)"),
            }
        }
        Ok(Ok(())) => {}
    }
    let ok = matches!(result, Ok(Ok(())));
    // Under MPI: finalize, or abort the job so no rank waits for this one.
    cachalot_engine::comm::mpi_finish(ok);
    if !ok {
        std::process::exit(if result.is_err() { 101 } else { 1 });
    }
}

/// glibc malloc keeps freed memory below 32 MiB per allocation and 128 MiB per heap top instead
/// of handing it back to the kernel. Its defaults adapt the mmap threshold, but the pool
/// worker's arena (the command runs on one) trims its heap after each step, so every decode
/// step faulted its buffers back in and the kernel zeroed them: ~10% of BF16 decode time on
/// the 1 B model in `clear_page_erms` (perf, docs/PERF.md). Buffers above 32 MiB (conversion
/// shards, weights read into memory) are still mapped and unmapped, so peak memory is bounded
/// as before.
fn tune_allocator() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only sets allocator parameters; called before any other thread exists.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 128 << 20);
    }
}

fn run() -> Result<()> {
    let mut cli = Cli::parse();
    match &mut cli.command {
        Command::Run(a) => a.group.join_mpi()?,
        Command::Serve(a) => a.group_mut().join_mpi()?,
        // Other commands run in one process: copies of them under a launcher of several ranks
        // would each do the whole job (and write the same files).
        _ => {
            if let Some(n) = cachalot_engine::comm::mpi_launch().filter(|&n| n != Some(1)) {
                let n = n.map_or("several".to_string(), |n| n.to_string());
                bail!(
                    "an MPI launcher started this process as one of {n} ranks, but only `run` \
                     and `serve` run over ranks; start this command on its own (or with \
                     mpirun -n 1)"
                );
            }
        }
    }
    let threads = match &cli.command {
        Command::Run(a) => a.group.threads_per_rank(),
        Command::Serve(a) => a.threads_per_rank(),
        Command::Bench(a) => a.threads,
        Command::Perplexity { threads, .. } => *threads,
        Command::Generate(a) => a.threads,
        Command::Chat(a) => a.threads,
        Command::Convert(a) => a.threads,
        Command::Calibrate(a) => a.threads,
        _ => None,
    };
    let mut pool = rayon::ThreadPoolBuilder::new().stack_size(WORKER_STACK);
    if let Some(n) = threads {
        if n == 0 {
            bail!("--threads 0: give at least one thread");
        }
        if n > MAX_THREADS {
            bail!("--threads {n} is out of range: give 1 to {MAX_THREADS}");
        }
        // More threads than cores only share them: every parallel region then waits for its
        // slowest, descheduled thread.
        if let Ok(cores) = std::thread::available_parallelism() {
            if n > cores.get() {
                say!(
                    "warning: --threads {n} is more than the {cores} cores this process may \
                     run on; threads then share cores and every step waits for the slowest \
                     (leave --threads out to use all cores)"
                );
            }
        }
        pool = pool.num_threads(n);
    }
    pool.build_global().with_context(|| match threads {
        Some(n) => format!("cannot start {n} threads (--threads)"),
        None => "cannot start the thread pool".to_string(),
    })?;
    // The whole command runs on a pool worker: the model's many small parallel products (a
    // decode step has dozens) then fork and join inside the pool. Driven from the main thread
    // instead, each one would wake a sleeping worker with a futex and block until it is done —
    // at batch 1 on the small model that was ~40% of the time in the kernel's scheduler.
    rayon::scope(|_| dispatch(cli))
}

/// The most threads `--threads` asks for (each worker reserves a 16 MiB stack).
const MAX_THREADS: usize = 4096;

/// Stack of the pool's workers (the command runs on one of them): as large as a main thread's.
const WORKER_STACK: usize = 16 << 20;

fn dispatch(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Perplexity {
            model,
            input,
            chunk,
            window,
            json,
            ..
        } => {
            if chunk == 0 {
                bail!("--chunk 0: give a prefill chunk of at least 1 token (512 by default)");
            }
            if window == 1 {
                bail!(
                    "--window 1: a window's first token has no context, so a window of 1 scores \
                     nothing; give at least 2 (or 0 for one context)"
                );
            }
            let dir = model_dir(&model)?;
            let ids = tokens(&input, &dir)?;
            if ids.len() < 2 {
                bail!(
                    "{}: the text is {} token{} (no BOS is added), and perplexity scores each \
                     token after the first: give a text of at least 2 tokens",
                    input.describe(),
                    ids.len(),
                    if ids.len() == 1 { "" } else { "s" }
                );
            }
            // One window (or the whole text) must fit the model's positions.
            let fits = |max: usize| -> Result<()> {
                let span = if window == 0 {
                    ids.len()
                } else {
                    window.min(ids.len())
                };
                if span > max {
                    bail!(
                        "{span} tokens in one context exceed the model's max_position_embeddings \
                         {max} (config.json); score in windows with --window {max} or less"
                    );
                }
                Ok(())
            };
            let lp = match detect_family(&dir)? {
                ModelFamily::DeepseekV3 => {
                    let m = load(&model)?;
                    fits(m.config().max_position_embeddings)?;
                    eval::windowed_logprobs(&m, &ids, window, chunk)?
                }
                ModelFamily::DeepseekV4 => {
                    let m = load_v4(&model, false)?;
                    fits(m.config().max_position_embeddings)?;
                    eval::windowed_logprobs(&m, &ids, window, chunk)?
                }
            };
            let (nll, ppl) = eval::nll_ppl(&lp);
            // (Each window's first token has no context, so it is not scored.)
            if json {
                let v = serde_json::json!({"n_tokens": ids.len(), "n_scored": lp.len(),
                                           "logprobs": lp, "nll": nll, "ppl": ppl});
                println!("{v}");
            } else {
                println!(
                    "tokens: {} ({} scored: each window's first has no context)\nmean NLL: \
                     {nll:.6}\nperplexity: {ppl:.4}",
                    ids.len(),
                    lp.len()
                );
            }
        }
        Command::Run(args) => run::run(&args)?,
        Command::Tokenize(args) => text::tokenize(&args)?,
        Command::Generate(args) => text::generate(&args)?,
        Command::Chat(args) => text::chat(&args)?,
        Command::Convert(args) => quant::run_convert(&args)?,
        Command::ConvertConfig(args) => quant::run_convert_config(&args)?,
        Command::Calibrate(args) => quant::run_calibrate(&args)?,
        Command::Bench(args) => bench::run(args)?,
        Command::Serve(args) => serve::serve(&args)?,
        Command::Router(args) => router::router(&args)?,
    }
    Ok(())
}
