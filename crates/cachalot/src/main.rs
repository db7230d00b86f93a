//! The cachalot command line: `run` (offline runs from YAML), `perplexity`, `tokenize`,
//! `generate`, `chat` and `bench` for now (`serve`, `convert` follow; see README.md).

mod quant;
mod run;
mod text;

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use cachalot_model::batch::{Batch, BlockAllocator, KvCache, LogitsWanted};
use cachalot_model::eval::{self, BLOCK_SIZE};
use cachalot_model::tokenizer::Tokenizer;
use cachalot_model::{AttentionPath, DeepseekV3, Fp8Mode, LoadOptions};
use clap::{Parser, Subcommand, ValueEnum};

#[derive(Parser)]
#[command(name = "cachalot", version, about = "DeepSeek-family inference on CPU")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, ValueEnum)]
enum Fp8Arg {
    /// Multiply FP8 weights natively (1 byte per weight).
    Native,
    /// Dequantize FP8 weights to f32 at load.
    F32,
}

#[derive(Clone, Copy, ValueEnum)]
enum AttnArg {
    Auto,
    Naive,
    Absorbed,
}

#[derive(clap::Args)]
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
}

#[derive(clap::Args)]
#[group(required = true, multiple = false)]
struct InputArgs {
    /// Text file, tokenized with the model's tokenizer.json (no special tokens added).
    #[arg(long)]
    file: Option<PathBuf>,
    /// Comma-separated token ids.
    #[arg(long, value_delimiter = ',')]
    token_ids: Option<Vec<u32>>,
    /// Text given on the command line.
    #[arg(long)]
    prompt: Option<String>,
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
        /// Print one JSON object: {"n_tokens", "logprobs", "nll", "ppl"}.
        #[arg(long)]
        json: bool,
    },
    /// Token ids of a text (`--text`), or the text of token ids (`--decode`).
    Tokenize(text::TokenizeArgs),
    /// Continue a prompt (or answer it as a chat turn with `--chat`), streaming the text.
    Generate(text::GenerateArgs),
    /// Interactive chat on stdin/stdout: /reset, /system TEXT, /exit; Ctrl-C stops an answer.
    Chat(text::ChatArgs),
    /// Convert an FP8 checkpoint: V3/R1/Kimi to bfloat16, w8a8c16 or w8a8c8 (--quant-mode);
    /// DeepSeek-V4 to bfloat16, w8a8-int, w4a8-int, w4a8-mx or w4a8-mx-hif (--quant-type).
    Convert(quant::ConvertArgs),
    /// Rewrite a DeepSeek-V4 config.json's quantization_config in place (the seed's
    /// convert_config.py).
    ConvertConfig(quant::ConvertConfigArgs),
    /// C8 latent-cache scales: run a text through a model and record each layer's c_kv range.
    Calibrate(quant::CalibrateArgs),
    /// Prefill and decode throughput on one model, as JSON.
    Bench {
        #[command(flatten)]
        model: ModelArgs,
        /// Prompt length (random token ids).
        #[arg(long, default_value_t = 128)]
        prompt_len: usize,
        /// Decode steps after the prompt.
        #[arg(long, default_value_t = 32)]
        decode_len: usize,
        /// Threads (default: all cores).
        #[arg(long)]
        threads: Option<usize>,
        /// Benchmark MTP speculative decoding with this many chained drafts per step against
        /// plain greedy decode (same prompt, alternating runs).
        #[arg(long, default_value_t = 0)]
        mtp: usize,
        /// Take the prompt from the start of this text file instead of random ids (MTP
        /// acceptance needs real text).
        #[arg(long)]
        prompt_file: Option<PathBuf>,
    },
}

/// The small model shipped with the project, used when no `--model` is given.
pub const DEFAULT_MODEL: &str = "assets/cachalot-tiny-r1";

/// The model directory: `--model`, else the shipped small model (looked up from the working
/// directory, then from the source tree this binary was built from).
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
        Some(d) => Ok(d.clone()),
        None => bail!(
            "no --model given and the shipped small model ({DEFAULT_MODEL}) was not found from \
             here; run from the repository root or pass --model DIR"
        ),
    }
}

fn load(args: &ModelArgs) -> Result<DeepseekV3> {
    let opts = LoadOptions {
        fp8: match args.fp8 {
            Fp8Arg::Native => Fp8Mode::Native,
            Fp8Arg::F32 => Fp8Mode::DequantizeF32,
        },
        load_mtp: false,
    };
    let mut model = DeepseekV3::load(&model_dir(args)?, opts)?;
    model.attention_path = match args.attention {
        AttnArg::Auto => AttentionPath::Auto,
        AttnArg::Naive => AttentionPath::Naive,
        AttnArg::Absorbed => AttentionPath::Absorbed,
    };
    Ok(model)
}

fn tokens(input: &InputArgs, model_dir: &Path) -> Result<Vec<u32>> {
    if let Some(ids) = &input.token_ids {
        return Ok(ids.clone());
    }
    let text = match (&input.file, &input.prompt) {
        (Some(f), _) => {
            std::fs::read_to_string(f).with_context(|| format!("cannot read {}", f.display()))?
        }
        (None, Some(p)) => p.clone(),
        (None, None) => bail!("give --file, --prompt or --token-ids"),
    };
    Ok(Tokenizer::from_dir(model_dir)?.encode(&text)?)
}

fn main() {
    if let Err(e) = run() {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

fn run() -> Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Command::Perplexity {
            model,
            input,
            chunk,
            window,
            json,
        } => {
            let ids = tokens(&input, &model_dir(&model)?)?;
            let m = load(&model)?;
            let lp = eval::windowed_logprobs(&m, &ids, window, chunk)?;
            let (nll, ppl) = eval::nll_ppl(&lp);
            if json {
                let v = serde_json::json!({"n_tokens": ids.len(), "logprobs": lp, "nll": nll, "ppl": ppl});
                println!("{v}");
            } else {
                println!(
                    "tokens: {}\nmean NLL: {nll:.6}\nperplexity: {ppl:.4}",
                    ids.len()
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
        Command::Bench {
            model,
            prompt_len,
            decode_len,
            threads,
            mtp,
            prompt_file,
        } => {
            if let Some(n) = threads {
                rayon::ThreadPoolBuilder::new()
                    .num_threads(n)
                    .build_global()?;
            }
            if mtp > 0 {
                bench_mtp(&model, prompt_file.as_deref(), prompt_len, decode_len, mtp)?;
            } else {
                bench(&model, prompt_len, decode_len)?;
            }
        }
    }
    Ok(())
}

fn bench(args: &ModelArgs, prompt_len: usize, decode_len: usize) -> Result<()> {
    let t0 = Instant::now();
    let m = load(args)?;
    let load_s = t0.elapsed().as_secs_f64();
    let cfg = m.config();
    // A deterministic pseudo-random prompt (LCG), avoiding special ids 0 and 1.
    let mut state = 0x2545_f491_4f6c_dd1du64;
    let prompt: Vec<u32> = (0..prompt_len.max(1))
        .map(|_| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            2 + ((state >> 33) as usize % (cfg.vocab_size - 2)) as u32
        })
        .collect();
    let total = prompt.len() + decode_len;
    let blocks = total.div_ceil(BLOCK_SIZE);
    let mut cache = KvCache::new(m.cache_spec(), BLOCK_SIZE, blocks);
    let mut alloc = BlockAllocator::new(blocks);
    let mut table = Vec::new();
    alloc.ensure(&mut table, total, BLOCK_SIZE)?;

    let mut batch = Batch::default();
    batch.push_seq(&prompt, 0, table.clone(), LogitsWanted::Last);
    let t = Instant::now();
    let out = m.forward(&batch, &mut cache, false)?;
    let prefill_s = t.elapsed().as_secs_f64();
    let mut next = cachalot_kernels::argmax(&out.logits) as u32;
    let mut step_times = Vec::with_capacity(decode_len);
    for i in 0..decode_len {
        let mut b = Batch::default();
        b.push_seq(&[next], prompt.len() + i, table.clone(), LogitsWanted::Last);
        let t = Instant::now();
        let out = m.forward(&b, &mut cache, false)?;
        step_times.push(t.elapsed().as_secs_f64());
        next = cachalot_kernels::argmax(&out.logits) as u32;
    }
    let decode_s: f64 = step_times.iter().sum();
    let bytes_per_token = m.decode_bytes_per_token();
    let tpot = decode_s / decode_len.max(1) as f64;
    let params = cfg.parameter_counts();
    let bandwidth = read_bandwidth_gb_s();
    let v = serde_json::json!({
        "model": model_dir(args)?.display().to_string(),
        "fp8": match args.fp8 { Fp8Arg::Native => "native", Fp8Arg::F32 => "f32" },
        "threads": rayon::current_num_threads(),
        "params_total": params.total,
        "params_active": params.active,
        "weight_bytes": m.weight_bytes(),
        "decode_bytes_per_token": bytes_per_token,
        "load_s": load_s,
        "prompt_len": prompt.len(),
        "prefill_s": prefill_s,
        "prefill_tok_s": prompt.len() as f64 / prefill_s,
        "ttft_ms": prefill_s * 1e3,
        "decode_len": decode_len,
        "tpot_ms": tpot * 1e3,
        "decode_tok_s": if decode_len > 0 { decode_len as f64 / decode_s } else { 0.0 },
        "decode_weight_gb_s": bytes_per_token as f64 / tpot / 1e9,
        "read_bandwidth_gb_s": bandwidth,
        "decode_fraction_of_bandwidth": bytes_per_token as f64 / tpot / 1e9 / bandwidth,
        "kv_cache_bytes": cache.bytes(),
    });
    println!("{}", serde_json::to_string_pretty(&v)?);
    Ok(())
}

/// Memory read bandwidth of this machine, all threads: the best of a few parallel passes over a
/// 1 GiB buffer (larger than any cache). Decode's floor is bytes-per-token over this.
fn read_bandwidth_gb_s() -> f64 {
    use rayon::prelude::*;
    let n = (1usize << 30) / 4;
    let buf: Vec<f32> = (0..n).into_par_iter().map(|i| (i % 7) as f32).collect();
    let mut best = 0.0f64;
    for _ in 0..3 {
        let t = Instant::now();
        let s: f32 = buf
            .par_chunks(1 << 16)
            .map(|c| cachalot_kernels::dot(c, c))
            .sum();
        let dt = t.elapsed().as_secs_f64();
        std::hint::black_box(s);
        best = best.max((n * 4) as f64 / dt / 1e9);
    }
    best
}

/// Plain greedy decode vs MTP speculative decode on one prompt: three alternating runs each,
/// medians reported, with the acceptance figures of the speculative runs.
fn bench_mtp(
    args: &ModelArgs,
    prompt_file: Option<&Path>,
    prompt_len: usize,
    decode_len: usize,
    next_n: usize,
) -> Result<()> {
    let dir = model_dir(args)?;
    let opts = LoadOptions {
        fp8: match args.fp8 {
            Fp8Arg::Native => Fp8Mode::Native,
            Fp8Arg::F32 => Fp8Mode::DequantizeF32,
        },
        load_mtp: true,
    };
    let m = DeepseekV3::load(&dir, opts)?;
    if m.mtp_layers().is_empty() {
        bail!(
            "{}: the checkpoint has no MTP layer (num_nextn_predict_layers = 0); --mtp needs one",
            dir.display()
        );
    }
    let mut prompt = match prompt_file {
        Some(f) => {
            let text = std::fs::read_to_string(f)
                .with_context(|| format!("cannot read {}", f.display()))?;
            Tokenizer::from_dir(&dir)?.encode(&text)?
        }
        None => bail!("--mtp needs --prompt-file TEXT (acceptance on random ids means nothing)"),
    };
    prompt.truncate(prompt_len.max(1));
    let mut plain_s = Vec::new();
    let mut spec_s = Vec::new();
    let mut stats = eval::MtpStats::default();
    for _ in 0..3 {
        let t = Instant::now();
        let a = eval::greedy(&m, &prompt, decode_len)?;
        plain_s.push(t.elapsed().as_secs_f64());
        let t = Instant::now();
        let (b, st) = eval::greedy_mtp(&m, &prompt, decode_len, next_n)?;
        spec_s.push(t.elapsed().as_secs_f64());
        if a != b {
            bail!("speculative output differs from greedy output; this is a bug");
        }
        stats = st;
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let (p, s) = (median(&mut plain_s), median(&mut spec_s));
    let v = serde_json::json!({
        "model": dir.display().to_string(),
        "mtp": next_n,
        "prompt_len": prompt.len(),
        "decode_len": decode_len,
        "plain_tok_s": decode_len as f64 / p,
        "mtp_tok_s": decode_len as f64 / s,
        "speedup": p / s,
        "drafted": stats.drafted,
        "accepted": stats.accepted,
        "acceptance_rate": stats.acceptance_rate(),
        "main_steps": stats.main_steps,
        "tokens_per_main_step": decode_len as f64 / stats.main_steps as f64,
    });
    println!("{}", serde_json::to_string_pretty(&v)?);
    Ok(())
}
