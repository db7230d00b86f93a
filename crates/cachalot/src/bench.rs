//! `cachalot bench`: prefill and decode throughput of one model (batch 1 and batch N), TTFT,
//! TPOT, peak RSS, weight bytes read per decoded token, and a memory-bandwidth probe that turns
//! each decode figure into a fraction of what the memory could deliver; plus the MTP comparison.
//!
//! What the figures mean (docs/PERF.md quotes them):
//! - Prefill: one forward over the whole prompt of one sequence; `prefill_tok_s` = prompt
//!   tokens / that time; TTFT = that time plus picking the first token.
//! - Decode (batch 1): `gen_len` steps of one token after the prompt; `decode_tok_s` = steps /
//!   their total time, `tpot_ms` = the median step. Batch N: N sequences (each with its own
//!   prompt, prefilled first, untimed), then `gen_len` steps of N tokens; tokens/s counts all N.
//! - Bytes per decoded token: from the model's matrices as stored — attention, dense/shared
//!   MLPs, router, lm_head, one embedding row and, per MoE layer, the k routed experts the token
//!   selects (exact at batch 1: k distinct experts). For a batch-N step the routed part is the
//!   *expected* number of distinct experts among N·k uniform draws, E·(1 − (1 − k/E)^N) (an
//!   estimate: real routing is not uniform).
//! - Bandwidth: `--membw` (or every model bench, afterwards): all threads stream-read a buffer
//!   far larger than the last-level cache (1 GiB by default) several times; the median pass in
//!   GB/s. Fraction of bandwidth = (bytes per step / step time) / bandwidth, i.e. the floor time
//!   (bytes / bandwidth) over the measured time.
//! - Peak RSS: `VmHWM` of /proc/self/status, read before the bandwidth probe allocates.
//!
//! Before timing, a warm-up (a short prefill and two decode steps on a scratch cache) faults in
//! the mmap'd weights, as llama.cpp's `llama-bench` does with its warm-up run.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Result};
use cachalot_model::batch::{Batch, BlockAllocator, KvCache, LogitsWanted};
use cachalot_model::eval::{CausalLm, BLOCK_SIZE};
use cachalot_model::profile::{self, Phase, Timer};
use cachalot_model::tokenizer::Tokenizer;
use cachalot_model::{detect_family, DeepseekV3, ModelFamily};
use serde_json::json;

use crate::{load, load_model, load_v4, model_dir, Fp8Arg, ModelArgs};

#[derive(clap::Args)]
pub struct BenchArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Time a random-weight model of this shape instead of --model: a preset (v3-1b, v3-tiny,
    /// v4-1b, v4-tiny) or a DeepSeek-V3 or V4 config.json. Written to a temporary directory,
    /// removed afterwards.
    #[arg(long, conflicts_with = "model")]
    random_weights: Option<String>,
    /// How the random model is held: fp8 (as DeepSeek ships it: FP8 blocks, V4 with MXFP4
    /// experts); w4a16 (V3 shapes as Kimi-K2-Thinking ships them: int4 routed experts,
    /// compressed-tensors pack-quantized, group 32, bf16 elsewhere); or made by the converter
    /// as `cachalot convert` would: bfloat16 or w8a8c16 (V3), w8a8-int, w4a8-int, w4a8-mx or
    /// w4a8-mx-hif (V4). Default fp8.
    #[arg(long, requires = "random_weights")]
    random_quant: Option<String>,
    /// Where the random model is written (default: the system temporary directory).
    #[arg(long, requires = "random_weights")]
    random_dir: Option<PathBuf>,
    /// Keep the random model's directory after the bench (its path is printed), to bench it
    /// again with --model.
    #[arg(long, requires = "random_weights")]
    keep_random: bool,
    /// Prompt length (random token ids).
    #[arg(long, default_value_t = 128)]
    prompt_len: usize,
    /// Decode steps after the prompt's first token (with --mtp: tokens generated, the one the
    /// prefill samples included).
    #[arg(long, alias = "decode-len", default_value_t = 32)]
    gen_len: usize,
    /// Also time decode with this many sequences per step (batch 1 is always timed). With
    /// --mtp: requests decoded at once through the engine (consecutive slices of the prompt file).
    #[arg(long, default_value_t = 1)]
    batch: usize,
    /// With --mtp: alternating runs of each kind (medians are reported; default 5). The plain
    /// benchmark times one run (its decode figure is the median of its steps) and refuses it.
    #[arg(long)]
    runs: Option<usize>,
    /// Threads (default: all cores).
    #[arg(long)]
    pub threads: Option<usize>,
    /// Print one JSON object instead of text.
    #[arg(long)]
    json: bool,
    /// Run only the memory-bandwidth probe (without --model / --random-weights; a bench of a
    /// DeepSeek-V3-family model runs it after timing the model).
    #[arg(long)]
    membw: bool,
    /// Size of the bandwidth probe's buffer in MiB.
    #[arg(long, default_value_t = 1024)]
    membw_mib: usize,
    /// Passes of the bandwidth probe (the median is reported).
    #[arg(long, default_value_t = 7)]
    membw_passes: usize,
    /// Benchmark MTP speculative decoding with this many chained drafts per step against
    /// plain greedy decode (same prompt, alternating runs).
    #[arg(long, default_value_t = 0)]
    mtp: usize,
    /// With --mtp: take the prompts from the start of this text file (MTP acceptance needs
    /// real text; the plain benchmark times random ids and refuses it).
    #[arg(long)]
    prompt_file: Option<PathBuf>,
    /// Time the phases of the decode steps (attention's parts, dense MLP, MoE, head) and
    /// report them per phase as `decode_profile` (batch 1) and `batch_decode_profile`
    /// (a DeepSeek-V4 model: `decode_profile`, its attention, MoE and head).
    #[arg(long)]
    profile: bool,
}

/// The options' ranges, named before anything is loaded or allocated.
fn check_args(a: &BenchArgs) -> Result<()> {
    for (flag, v, lo, hi) in [
        ("--prompt-len", a.prompt_len, 1, 1 << 24),
        ("--gen-len (--decode-len)", a.gen_len, 1, 1 << 24),
        ("--batch", a.batch, 1, 1 << 16),
        ("--runs", a.runs.unwrap_or(1), 1, 10_000),
        ("--membw-mib", a.membw_mib, 1, 1 << 20),
        ("--membw-passes", a.membw_passes, 1, 10_000),
    ] {
        if !(lo..=hi).contains(&v) {
            bail!("{flag} {v} is out of range: give {lo} to {hi}");
        }
    }
    if a.mtp > 3 {
        bail!("--mtp {}: give 1 to 3 draft tokens (0: off)", a.mtp);
    }
    // (clap's `requires` is not checked where --model, which --random-weights conflicts with,
    // is given.)
    if a.random_weights.is_none() {
        for (flag, given) in [
            ("--random-quant", a.random_quant.is_some()),
            ("--random-dir", a.random_dir.is_some()),
            ("--keep-random", a.keep_random),
        ] {
            if given {
                bail!(
                    "{flag} is for a random model (--random-weights SHAPE); a --model \
                     directory is timed as it is stored (`cachalot convert` makes other formats)"
                );
            }
        }
    }
    if a.mtp > 0 && a.random_weights.is_some() {
        // (Said before a random model is written: it has no MTP layer and no tokenizer.)
        bail!(
            "--mtp times MTP on a trained checkpoint (--model DIR with an MTP layer and \
             --prompt-file TEXT): acceptance on random weights means nothing; drop \
             --random-weights"
        );
    }
    if let Some(mib) = cachalot_run::offline::mem_available().map(|b| (b >> 20) as usize) {
        if a.membw_mib > mib / 2 {
            bail!(
                "--membw-mib {}: more than half of the {mib} MiB of memory available; give less",
                a.membw_mib
            );
        }
    }
    Ok(())
}

/// How the random model was held (None when the bench timed --model).
fn random_quant(a: &BenchArgs) -> Option<&str> {
    a.random_weights
        .as_ref()
        .map(|_| a.random_quant.as_deref().unwrap_or("fp8"))
}

/// Prompt and generation fit the model's positions.
fn check_positions(prompt_len: usize, gen_len: usize, max_positions: usize) -> Result<()> {
    if prompt_len + gen_len > max_positions {
        bail!(
            "--prompt-len {prompt_len} plus --gen-len (--decode-len) {gen_len} exceed the \
             model's max_position_embeddings {max_positions} (config.json)"
        );
    }
    Ok(())
}

pub fn run(mut args: BenchArgs) -> Result<()> {
    check_args(&args)?;
    if args.membw && (args.model.model.is_some() || args.random_weights.is_some()) {
        bail!(
            "--membw runs the bandwidth probe alone; a model bench (--model or --random-weights) \
             runs the probe after timing the model anyway: drop --membw \
             (or the model, for the probe alone)"
        );
    }
    if args.membw {
        // The probe alone: options of the model bench would be dropped without a word.
        for (flag, given) in [
            ("--mtp", args.mtp > 0),
            ("--prompt-file", args.prompt_file.is_some()),
            ("--profile", args.profile),
            ("--runs", args.runs.is_some()),
            ("--batch", args.batch != 1),
            ("--prompt-len", args.prompt_len != 128),
            ("--gen-len", args.gen_len != 32),
            ("--int8-head", args.model.int8_head),
            ("--bf16-dot", args.model.bf16_dot),
            ("--check-tensors", args.model.check_tensors),
            ("--fp8", !matches!(args.model.fp8, Fp8Arg::Native)),
            (
                "--attention",
                !matches!(args.model.attention, crate::AttnArg::Auto),
            ),
            (
                "--kv-cache-dtype",
                !matches!(args.model.kv_cache_dtype, crate::KvDtypeArg::Auto),
            ),
            ("--v4-cache", args.model.v4_cache != Default::default()),
        ] {
            if given {
                bail!(
                    "{flag} times a model: give --model DIR or --random-weights SHAPE (the model \
                     bench runs the bandwidth probe too), or drop {flag} to run the probe alone"
                );
            }
        }
        let bw = membw(args.membw_mib, args.membw_passes);
        if args.json {
            println!("{}", serde_json::to_string_pretty(&bw.to_json())?);
        } else {
            println!("{}", bw.text());
        }
        return Ok(());
    }
    // Keeps the random model's directory alive until the bench ends.
    let random = match &args.random_weights {
        Some(spec) => {
            // Ctrl-C or SIGTERM removes the random model being written or timed.
            crate::term::on_interrupt(|| {
                cachalot_run::offline::on_interrupt();
            })?;
            let t = Instant::now();
            let mut r = cachalot_run::random_model::build(
                spec,
                args.random_quant.as_deref().unwrap_or("fp8"),
                args.random_dir.as_deref(),
            )?;
            if args.keep_random {
                r.keep();
                say!("keeping the random model: --model {}", r.dir.display());
            }
            say!(
                "random {} model ({}) written to {} in {:.1} s",
                r.shape,
                r.quant,
                r.dir.display(),
                t.elapsed().as_secs_f64()
            );
            args.model.model = Some(r.dir.clone());
            // The peak RSS reported is the bench's, not the writing's: Linux resets VmHWM to
            // the present RSS on this write.
            let _ = std::fs::write("/proc/self/clear_refs", "5");
            Some(r)
        }
        None => None,
    };
    if args.mtp == 0 {
        if let Some(r) = args.runs {
            bail!(
                "--runs {r} is for --mtp N (alternating runs of plain and speculative decode); \
                 the plain benchmark times one run, its decode figure the median of its steps: \
                 run it again for more rounds"
            );
        }
    } else {
        for (flag, given) in [("--profile", args.profile), ("--membw", args.membw)] {
            if given {
                bail!(
                    "{flag} is for the plain benchmark; --mtp times the engine's runs without it"
                );
            }
        }
    }
    if let (Some(f), 0) = (&args.prompt_file, args.mtp) {
        bail!(
            "--prompt-file {}: the text is for --mtp N (draft acceptance needs real text); the \
             plain benchmark times random ids, which a step runs at the same speed — drop \
             --prompt-file or add --mtp",
            f.display()
        );
    }
    if args.mtp > 0 {
        let b = MtpBench {
            prompt_len: args.prompt_len,
            decode_len: args.gen_len,
            next_n: args.mtp,
            batch: args.batch,
            runs: args.runs.unwrap_or(5),
            json: args.json,
        };
        return bench_mtp(&args.model, args.prompt_file.as_deref(), &b);
    }
    if detect_family(&model_dir(&args.model)?)? == ModelFamily::DeepseekV4 {
        return bench_v4(&args);
    }
    let report = bench(&args)?;
    drop(random);
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print_text(&report);
    }
    Ok(())
}

/// Result of the bandwidth probe.
pub struct Bandwidth {
    pub median_gb_s: f64,
    pub best_gb_s: f64,
    pub mib: usize,
    pub passes: usize,
    pub threads: usize,
}

impl Bandwidth {
    fn to_json(&self) -> serde_json::Value {
        json!({"membw_gb_s": self.median_gb_s, "membw_best_gb_s": self.best_gb_s,
               "membw_mib": self.mib, "membw_passes": self.passes, "threads": self.threads})
    }
    fn text(&self) -> String {
        format!(
            "memory read bandwidth: {:.2} GB/s median, {:.2} best ({} passes over {} MiB, {} threads)",
            self.median_gb_s, self.best_gb_s, self.passes, self.mib, self.threads
        )
    }
}

/// A note for a weight-read rate above the probe's: the weights came from the CPU's caches.
fn in_cache(fraction: f64) -> &'static str {
    if fraction > 1.0 {
        " (above the probe's rate: the weights are read from the CPU's caches, not memory)"
    } else {
        ""
    }
}

/// Streaming read bandwidth, all threads: each pass sums a buffer of `mib` MiB (far larger than
/// any last-level cache) in 256 KiB chunks spread over the rayon pool; the median of `passes`.
pub fn membw(mib: usize, passes: usize) -> Bandwidth {
    use rayon::prelude::*;
    let n = mib.max(1) * (1 << 20) / 4;
    let buf: Vec<f32> = (0..n).into_par_iter().map(|i| (i % 7) as f32).collect();
    let mut rates = Vec::with_capacity(passes.max(1));
    for _ in 0..passes.max(1) {
        let t = Instant::now();
        // dot(c, c) reads each element once (both arguments are the same memory).
        let s: f32 = buf
            .par_chunks(1 << 16)
            .map(|c| cachalot_kernels::dot(c, c))
            .sum();
        let dt = t.elapsed().as_secs_f64();
        std::hint::black_box(s);
        rates.push((n * 4) as f64 / dt / 1e9);
    }
    let best = rates.iter().copied().fold(0.0, f64::max);
    Bandwidth {
        median_gb_s: median(&mut rates),
        best_gb_s: best,
        mib: mib.max(1),
        passes: passes.max(1),
        threads: rayon::current_num_threads(),
    }
}

fn median(v: &mut [f64]) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    let m = v.len() / 2;
    if v.len() % 2 == 1 {
        v[m]
    } else {
        (v[m - 1] + v[m]) / 2.0
    }
}

/// Peak resident set size of this process (`VmHWM`), in bytes; None where /proc is missing.
pub fn peak_rss_bytes() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = s.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// A deterministic pseudo-random prompt (LCG), avoiding special ids 0 and 1.
fn random_prompt(len: usize, vocab: usize, seed: u64) -> Vec<u32> {
    let mut state = 0x2545_f491_4f6c_dd1du64 ^ seed.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    (0..len.max(1))
        .map(|_| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            2 + ((state >> 33) as usize % (vocab.max(3) - 2)) as u32
        })
        .collect()
}

/// Expected distinct experts among `n` tokens each choosing `k` of `e` uniformly.
fn expected_distinct_experts(e: usize, k: usize, n: usize) -> f64 {
    if e == 0 {
        return 0.0;
    }
    e as f64 * (1.0 - (1.0 - k as f64 / e as f64).powi(n as i32))
}

/// One sequence per entry of `prompts`, all in one cache.
struct Seqs {
    cache: KvCache,
    tables: Vec<Vec<u32>>,
}

fn new_seqs(m: &DeepseekV3, n: usize, total: usize) -> Result<Seqs> {
    let per = total.div_ceil(BLOCK_SIZE);
    let mut alloc = BlockAllocator::new(per * n);
    let mut tables = Vec::with_capacity(n);
    for _ in 0..n {
        let mut t = Vec::new();
        alloc.ensure(&mut t, total, BLOCK_SIZE)?;
        tables.push(t);
    }
    Ok(Seqs {
        cache: bench_cache(m.cache_spec(), per * n, n, total)?,
        tables,
    })
}

/// A KV cache of `blocks` blocks for `seqs` sequences of `positions` positions, or an error
/// naming the options that size it when it would not fit in the memory available (or cannot
/// be allocated).
fn bench_cache(
    spec: cachalot_model::batch::CacheSpec,
    blocks: usize,
    seqs: usize,
    positions: usize,
) -> Result<KvCache> {
    let bytes = (spec.bytes_per_token() as u128) * (BLOCK_SIZE * blocks) as u128;
    let too_big = |why: String| {
        anyhow::anyhow!(
            "the KV cache of --batch {seqs} × {positions} positions (--prompt-len plus \
             --gen-len) needs {:.2} GiB: {why}; give a smaller --batch, --prompt-len or --gen-len",
            bytes as f64 / (1u64 << 30) as f64
        )
    };
    if let Some(avail) = cachalot_run::offline::mem_available() {
        if bytes > avail as u128 {
            return Err(too_big(format!(
                "more than the {:.2} GiB of memory available",
                avail as f64 / (1u64 << 30) as f64
            )));
        }
    }
    KvCache::try_new(spec, BLOCK_SIZE, blocks).map_err(too_big)
}

fn prefill(m: &DeepseekV3, s: &mut Seqs, i: usize, prompt: &[u32]) -> Result<u32> {
    let _warm = cachalot_kernels::KeepWarm::new();
    let mut b = Batch::default();
    b.push_seq(prompt, 0, s.tables[i].clone(), LogitsWanted::Last);
    b.mark_prefill();
    let out = m.forward(&b, &mut s.cache, false)?;
    Ok(cachalot_kernels::argmax(&out.logits) as u32)
}

/// One decode step of every sequence; returns the next tokens.
fn decode_step(m: &DeepseekV3, s: &mut Seqs, next: &[u32], pos: usize) -> Result<Vec<u32>> {
    // As `Engine::step`: the step's parallel regions find the other workers awake.
    let _warm = cachalot_kernels::KeepWarm::new();
    let mut b = Batch::default();
    for (i, &t) in next.iter().enumerate() {
        b.push_seq(&[t], pos, s.tables[i].clone(), LogitsWanted::Last);
    }
    let out = m.forward(&b, &mut s.cache, false)?;
    let v = m.config().vocab_size;
    Ok(out
        .logits
        .chunks(v)
        .map(|l| cachalot_kernels::argmax(l) as u32)
        .collect())
}

struct Decode {
    tok_s: f64,
    tpot_ms: f64,
}

/// `gen_len` steps of all sequences in `s`, starting at position `pos`.
fn time_decode(
    m: &DeepseekV3,
    s: &mut Seqs,
    mut next: Vec<u32>,
    pos: usize,
    gen_len: usize,
) -> Result<Decode> {
    let mut steps = Vec::with_capacity(gen_len);
    for i in 0..gen_len {
        let t = Instant::now();
        let step = Timer::start(Phase::Step);
        next = decode_step(m, s, &next, pos + i)?;
        drop(step);
        steps.push(t.elapsed().as_secs_f64());
    }
    let total: f64 = steps.iter().sum();
    let n = s.tables.len();
    Ok(Decode {
        tok_s: if gen_len > 0 {
            (gen_len * n) as f64 / total
        } else {
            0.0
        },
        tpot_ms: median(&mut steps) * 1e3,
    })
}

fn bench(args: &BenchArgs) -> Result<serde_json::Value> {
    let dir = model_dir(&args.model)?;
    let t0 = Instant::now();
    let m = load(&args.model)?;
    let load_s = t0.elapsed().as_secs_f64();
    let cfg = m.config().clone();
    let v = cfg.vocab_size;
    let (p_len, g_len, n) = (args.prompt_len, args.gen_len, args.batch);
    check_positions(p_len, g_len, cfg.max_position_embeddings)?;

    // Warm-up: fault the mmap'd weights in (a short prefill routes to most experts).
    {
        let warm = random_prompt(p_len.min(64), v, 99);
        let mut s = new_seqs(&m, 1, warm.len() + 2)?;
        let first = prefill(&m, &mut s, 0, &warm)?;
        time_decode(&m, &mut s, vec![first], warm.len(), 2)?;
    }

    // Batch 1: prefill (TTFT) then decode.
    let prompt = random_prompt(p_len, v, 0);
    let mut s = new_seqs(&m, 1, p_len + g_len)?;
    let t = Instant::now();
    let first = prefill(&m, &mut s, 0, &prompt)?;
    let ttft_s = t.elapsed().as_secs_f64();
    let (d1, profile_b1) = profile::profiled(args.profile, || {
        time_decode(&m, &mut s, vec![first], p_len, g_len)
    });
    let d1 = d1?;
    let kv_bytes_b1 = s.cache.bytes();
    drop(s);

    // Batch N.
    let dn = if n > 1 {
        let mut s = new_seqs(&m, n, p_len + g_len)?;
        let mut next = Vec::with_capacity(n);
        for i in 0..n {
            next.push(prefill(
                &m,
                &mut s,
                i,
                &random_prompt(p_len, v, i as u64 + 1),
            )?);
        }
        let timed = profile::profiled(args.profile, || time_decode(&m, &mut s, next, p_len, g_len));
        Some((timed, s.cache.bytes()))
    } else {
        None
    };
    let (dn, profile_bn, kv_bytes_bn) = match dn {
        Some(((d, p), bytes)) => (Some(d?), p, bytes),
        None => (None, Vec::new(), 0),
    };
    let peak_rss = peak_rss_bytes();

    let bytes_b1 = m.decode_bytes_per_token();
    let (per_expert, moe_layers) = m.routed_expert_bytes();
    let e = cfg.n_routed_experts.unwrap_or(0);
    let k = cfg.num_experts_per_tok;
    let bytes_step_n = bytes_b1 as f64
        + moe_layers as f64
            * per_expert as f64
            * (expected_distinct_experts(e, k, n) - k.min(e) as f64);
    let kv_dtype = m.cache_spec().float.name();
    // A W8A8C8 checkpoint's latents are int8 (the dtype then names the rope keys').
    let kv_c8 = m.cache_spec().int8_width > 0;
    drop(m);

    let bw = membw(args.membw_mib, args.membw_passes);
    let frac = |bytes: f64, step_ms: f64| bytes / (step_ms / 1e3) / 1e9 / bw.median_gb_s;
    let params = cfg.parameter_counts();
    let mut out = json!({
        "model": dir.display().to_string(),
        "random_weights": args.random_weights,
        "random_quant": random_quant(args),
        "fp8": match args.model.fp8 { Fp8Arg::Native => "native", Fp8Arg::F32 => "f32" },
        "int8_head": args.model.int8_head,
        "bf16_dot": args.model.bf16_dot,
        "kv_cache_dtype": kv_dtype,
        "kv_cache_c8": kv_c8,
        "threads": rayon::current_num_threads(),
        "kernels": cachalot_kernels::kernel_isa(),
        "params_total": params.total,
        "params_active": params.active,
        "load_s": load_s,
        "prompt_len": p_len,
        "gen_len": g_len,
        "prefill_s": ttft_s,
        "prefill_tok_s": p_len as f64 / ttft_s,
        "ttft_ms": ttft_s * 1e3,
        "decode_tok_s": d1.tok_s,
        "tpot_ms": d1.tpot_ms,
        "decode_bytes_per_token": bytes_b1,
        "decode_bytes_per_token_basis": "exact: attention, dense/shared MLPs, router, lm_head, \
            one embedding row and the k experts the token selects per MoE layer",
        "decode_weight_gb_s": bytes_b1 as f64 / (d1.tpot_ms / 1e3) / 1e9,
        "decode_fraction_of_membw": frac(bytes_b1 as f64, d1.tpot_ms),
        "kv_cache_bytes": kv_bytes_b1,
        "peak_rss_bytes": peak_rss,
        "membw_gb_s": bw.median_gb_s,
        "membw_best_gb_s": bw.best_gb_s,
        "membw_passes": bw.passes,
        "membw_mib": bw.mib,
    });
    if let (true, Some(o)) = (args.profile, out.as_object_mut()) {
        o.insert("decode_profile".into(), json!(profile_b1));
        if n > 1 {
            o.insert("batch_decode_profile".into(), json!(profile_bn));
        }
    }
    if let (Some(d), Some(o)) = (dn, out.as_object_mut()) {
        o.insert("batch".into(), json!(n));
        o.insert("batch_decode_tok_s".into(), json!(d.tok_s));
        o.insert("batch_step_ms".into(), json!(d.tpot_ms));
        o.insert("batch_kv_cache_bytes".into(), json!(kv_bytes_bn));
        o.insert("batch_step_bytes_expected".into(), json!(bytes_step_n));
        o.insert(
            "batch_step_bytes_basis".into(),
            json!("expected: as batch 1, with E(1-(1-k/E)^N) distinct routed experts per MoE layer (uniform routing)"),
        );
        o.insert(
            "batch_fraction_of_membw".into(),
            json!(frac(bytes_step_n, d.tpot_ms)),
        );
    }
    Ok(out)
}

fn print_text(r: &serde_json::Value) {
    let f = |k: &str| r.get(k).and_then(|v| v.as_f64()).unwrap_or(f64::NAN);
    println!("model: {}", r["model"].as_str().unwrap_or("?"));
    println!(
        "parameters: {:.3} B total, {:.3} B active; {} threads ({}); load {:.1} s; KV cache {}",
        f("params_total") / 1e9,
        f("params_active") / 1e9,
        r["threads"],
        r["kernels"].as_str().unwrap_or("?"),
        f("load_s"),
        match (
            r["kv_cache_dtype"].as_str().unwrap_or("f32"),
            r["kv_cache_c8"].as_bool()
        ) {
            (d, Some(true)) => format!("int8 latents (C8), rope keys {d}"),
            (d, _) => d.to_string(),
        }
    );
    println!(
        "prefill {} tokens: {:.1} tok/s, TTFT {:.1} ms",
        r["prompt_len"],
        f("prefill_tok_s"),
        f("ttft_ms")
    );
    println!(
        "decode batch 1 ({} steps): {:.2} tok/s, TPOT {:.2} ms (median step), {:.1} MB weights/token, \
         {:.2} GB/s = {:.0}% of memory bandwidth{}",
        r["gen_len"],
        f("decode_tok_s"),
        f("tpot_ms"),
        f("decode_bytes_per_token") / 1e6,
        f("decode_weight_gb_s"),
        100.0 * f("decode_fraction_of_membw"),
        in_cache(f("decode_fraction_of_membw"))
    );
    if r.get("batch").is_some() {
        println!(
            "decode batch {}: {:.2} tok/s, {:.2} ms per step (median), ~{:.1} MB weights/step (expected), \
             {:.0}% of memory bandwidth{}",
            r["batch"],
            f("batch_decode_tok_s"),
            f("batch_step_ms"),
            f("batch_step_bytes_expected") / 1e6,
            100.0 * f("batch_fraction_of_membw"),
            in_cache(f("batch_fraction_of_membw"))
        );
    }
    println!(
        "peak RSS: {:.0} MB; memory read bandwidth: {:.2} GB/s median ({:.2} best) of {} passes over {} MiB",
        f("peak_rss_bytes") / 1e6,
        f("membw_gb_s"),
        f("membw_best_gb_s"),
        r["membw_passes"],
        r["membw_mib"]
    );
    for (key, title) in [
        ("decode_profile", "decode batch 1"),
        ("batch_decode_profile", "decode batch N"),
    ] {
        let totals = r
            .get(key)
            .and_then(|v| serde_json::from_value::<Vec<profile::PhaseTotal>>(v.clone()).ok());
        if let Some(totals) = totals {
            print!("{title}, by phase:\n{}", profile::table(&totals));
        }
    }
}

/// Prefill `prompt` then greedy-decode `decode_len` tokens: (prefill seconds, per-step decode
/// seconds, cache bytes).
fn time_prefill_decode<M: CausalLm>(
    m: &M,
    prompt: &[u32],
    decode_len: usize,
) -> Result<(f64, Vec<f64>, usize)> {
    let total = prompt.len() + decode_len;
    let blocks = total.div_ceil(BLOCK_SIZE);
    let mut cache = bench_cache(m.cache_spec(), blocks, 1, total)?;
    let mut alloc = BlockAllocator::new(blocks);
    let mut table = Vec::new();
    alloc.ensure(&mut table, total, BLOCK_SIZE)?;
    let mut batch = Batch::default();
    batch.push_seq(prompt, 0, table.clone(), LogitsWanted::Last);
    batch.mark_prefill();
    let t = Instant::now();
    let logits = m.logits(&batch, &mut cache)?;
    let prefill_s = t.elapsed().as_secs_f64();
    // A profile (`--profile`) holds the decode steps' phases only.
    profile::reset();
    let mut next = cachalot_kernels::argmax(&logits) as u32;
    let mut step_times = Vec::with_capacity(decode_len);
    for i in 0..decode_len {
        let mut b = Batch::default();
        b.push_seq(&[next], prompt.len() + i, table.clone(), LogitsWanted::Last);
        let t = Instant::now();
        let step = Timer::start(Phase::Step);
        let logits = m.logits(&b, &mut cache)?;
        drop(step);
        step_times.push(t.elapsed().as_secs_f64());
        next = cachalot_kernels::argmax(&logits) as u32;
    }
    Ok((prefill_s, step_times, cache.bytes()))
}

/// `n` sequences of random `prompt_len`-token prompts, each prefilled alone, then greedy-decoded
/// together for `decode_len` steps, each sequence in state slot i (DeepSeek-V4's compact
/// cache): (decode tok/s over the sequences, mean step ms).
fn time_batch_decode<M: CausalLm>(
    m: &M,
    n: usize,
    prompt_len: usize,
    decode_len: usize,
) -> Result<(f64, f64)> {
    let total = prompt_len + decode_len;
    let per = total.div_ceil(BLOCK_SIZE);
    let mut cache = bench_cache(m.cache_spec(), per * n, n, total)?;
    let mut alloc = BlockAllocator::new(per * n);
    let mut tables = Vec::with_capacity(n);
    let mut next = Vec::with_capacity(n);
    for i in 0..n {
        let mut t = Vec::new();
        alloc.ensure(&mut t, total, BLOCK_SIZE)?;
        let mut b = Batch::default();
        b.push_seq(
            &random_prompt(prompt_len, m.vocab_size(), i as u64 + 1),
            0,
            t.clone(),
            LogitsWanted::Last,
        );
        b.set_state_slot(i as u32);
        b.mark_prefill();
        next.push(cachalot_kernels::argmax(&m.logits(&b, &mut cache)?) as u32);
        tables.push(t);
    }
    let v = m.vocab_size();
    let t = Instant::now();
    for step in 0..decode_len {
        let _warm = cachalot_kernels::KeepWarm::new();
        let mut b = Batch::default();
        for (i, &tok) in next.iter().enumerate() {
            b.push_seq(
                &[tok],
                prompt_len + step,
                tables[i].clone(),
                LogitsWanted::Last,
            );
            b.set_state_slot(i as u32);
        }
        let logits = m.logits(&b, &mut cache)?;
        next = logits
            .chunks(v)
            .map(|l| cachalot_kernels::argmax(l) as u32)
            .collect();
    }
    let s = t.elapsed().as_secs_f64();
    let steps = decode_len.max(1) as f64;
    Ok(((n * decode_len) as f64 / s, s / steps * 1e3))
}

/// `bench` for a DeepSeek-V4 model directory: load, prefill and decode timings (batch 1, and
/// batch `batch` when it is more than 1).
fn bench_v4(b: &BenchArgs) -> Result<()> {
    let (args, prompt_len, decode_len, batch, prof, json) = (
        &b.model,
        b.prompt_len,
        b.gen_len,
        b.batch,
        b.profile,
        b.json,
    );
    let dir = model_dir(args)?;
    let t0 = Instant::now();
    let m = load_v4(args, false)?;
    let load_s = t0.elapsed().as_secs_f64();
    check_positions(prompt_len, decode_len, m.config().max_position_embeddings)?;
    let prompt = random_prompt(prompt_len, m.config().vocab_size, 0);
    // A warm-up first, as for the DeepSeek-V3 family (module docs).
    let warm = random_prompt(prompt_len.min(64), m.config().vocab_size, 99);
    time_prefill_decode(&m, &warm, 2)?;
    let (timed, decode_profile) =
        profile::profiled(prof, || time_prefill_decode(&m, &prompt, decode_len));
    let (prefill_s, step_times, kv_bytes) = timed?;
    let decode_s: f64 = step_times.iter().sum();
    let mut v = serde_json::json!({
        "model": dir.display().to_string(),
        "family": "deepseek_v4",
        "random_weights": b.random_weights,
        "random_quant": random_quant(b),
        "threads": rayon::current_num_threads(),
        "kernels": cachalot_kernels::kernel_isa(),
        "decode_bytes_per_token": m.decode_bytes_per_token(),
        "load_s": load_s,
        "prompt_len": prompt.len(),
        "prefill_s": prefill_s,
        "prefill_tok_s": prompt.len() as f64 / prefill_s,
        "ttft_ms": prefill_s * 1e3,
        // (`gen_len` as DeepSeek-V3's report names it; `decode_len` kept for earlier readers.)
        "gen_len": decode_len,
        "decode_len": decode_len,
        "tpot_ms": decode_s / decode_len.max(1) as f64 * 1e3,
        "decode_tok_s": if decode_len > 0 { decode_len as f64 / decode_s } else { 0.0 },
        "kv_cache_bytes": kv_bytes,
        "kv_cache_dtype": m.cache_spec().float.name(),
        "v4_cache": args.v4_cache.name(),
        "int8_head": args.int8_head,
        "bf16_dot": args.bf16_dot,
    });
    if let (true, Some(o)) = (prof, v.as_object_mut()) {
        o.insert("decode_profile".into(), serde_json::json!(decode_profile));
    }
    if batch > 1 {
        let (tok_s, step_ms) = time_batch_decode(&m, batch, prompt.len(), decode_len)?;
        if let Some(o) = v.as_object_mut() {
            o.insert("batch".into(), serde_json::json!(batch));
            o.insert("batch_decode_tok_s".into(), serde_json::json!(tok_s));
            o.insert("batch_step_ms".into(), serde_json::json!(step_ms));
        }
    }
    // (Peak RSS before the probe allocates; the probe with the weights unmapped.)
    let peak_rss = peak_rss_bytes();
    let bytes = m.decode_bytes_per_token() as f64;
    drop(m);
    let bw = membw(b.membw_mib, b.membw_passes);
    let tpot_s = decode_s / decode_len.max(1) as f64;
    if let Some(o) = v.as_object_mut() {
        o.insert("peak_rss_bytes".into(), serde_json::json!(peak_rss));
        if decode_len > 0 {
            o.insert(
                "decode_weight_gb_s".into(),
                serde_json::json!(bytes / tpot_s / 1e9),
            );
            o.insert(
                "decode_fraction_of_membw".into(),
                serde_json::json!(bytes / tpot_s / 1e9 / bw.median_gb_s),
            );
        }
        for (k, x) in bw.to_json().as_object().into_iter().flatten() {
            if k != "threads" {
                o.insert(k.clone(), x.clone());
            }
        }
    }
    print_report(&v, json)
}

/// `v` as pretty JSON (`--json`), or one `key: value` line per figure.
fn print_report(v: &serde_json::Value, json: bool) -> Result<()> {
    if json {
        println!("{}", serde_json::to_string_pretty(v)?);
        return Ok(());
    }
    if let Some(o) = v.as_object() {
        for (k, x) in o {
            match x {
                serde_json::Value::Number(n) if n.is_f64() => {
                    println!("{k}: {:.4}", n.as_f64().unwrap_or(f64::NAN))
                }
                serde_json::Value::String(t) => println!("{k}: {t}"),
                other => println!("{k}: {other}"),
            }
        }
    }
    Ok(())
}

/// Settings of `bench --mtp`.
struct MtpBench {
    prompt_len: usize,
    decode_len: usize,
    next_n: usize,
    batch: usize,
    runs: usize,
    json: bool,
}

/// Plain greedy decode vs MTP speculative decode through the engine, `batch` requests at once
/// (consecutive slices of the prompt file): alternating runs of each, medians reported, with
/// the acceptance figures of the speculative runs; the outputs must be equal. `speedup` is the
/// ratio of whole runs (prefill included), `decode_speedup` that of the decode steps alone (the
/// MTP layer's pass over the prompt counted as prefill, as the seed runs it).
fn bench_mtp(args: &ModelArgs, prompt_file: Option<&Path>, b: &MtpBench) -> Result<()> {
    for (flag, v) in [("--batch", b.batch), ("--runs", b.runs)] {
        if v == 0 {
            bail!("{flag} 0: give at least 1");
        }
    }
    if prompt_file.is_none() {
        bail!("--mtp needs --prompt-file TEXT (acceptance on random ids means nothing)");
    }
    let dir = model_dir(args)?;
    match detect_family(&dir)? {
        ModelFamily::DeepseekV3 => {
            let m = load_model(args, true)?;
            let max = m.config().max_position_embeddings;
            bench_mtp_with(&m, &dir, max, prompt_file, b)
        }
        ModelFamily::DeepseekV4 => {
            let m = load_v4(args, true)?;
            if m.num_mtp_layers() == 0 {
                bail!(
                    "{}: the checkpoint has no MTP block (num_nextn_predict_layers = 0); --mtp \
                     needs one",
                    dir.display()
                );
            }
            let max = m.config().max_position_embeddings;
            bench_mtp_with(&m, &dir, max, prompt_file, b)
        }
    }
}

fn bench_mtp_with<M: cachalot_engine::Model>(
    m: &M,
    dir: &Path,
    max_positions: usize,
    prompt_file: Option<&Path>,
    b: &MtpBench,
) -> Result<()> {
    use cachalot_engine::metrics::EngineStats;
    use cachalot_engine::{Engine, EngineConfig, Request, SamplingParams, StopConditions};
    // A verify step writes up to next_n draft positions past the last kept token.
    if b.prompt_len.max(1) + b.decode_len + b.next_n > max_positions {
        bail!(
            "--prompt-len {} plus --decode-len {} plus the {} draft positions of --mtp {} exceed \
             the model's max_position_embeddings {max_positions} (config.json)",
            b.prompt_len.max(1),
            b.decode_len,
            b.next_n,
            b.next_n
        );
    }
    let ids = match prompt_file {
        Some(f) => {
            let text = crate::read_text_file(f)?;
            Tokenizer::from_dir(dir)?.encode(&text)?
        }
        None => bail!("--mtp needs --prompt-file TEXT (acceptance on random ids means nothing)"),
    };
    let len = b.prompt_len.max(1);
    if ids.len() < len * b.batch {
        bail!(
            "--prompt-file has {} tokens; --batch {} prompts of {len} need {}",
            ids.len(),
            b.batch,
            len * b.batch
        );
    }
    let prompts: Vec<&[u32]> = ids.chunks_exact(len).take(b.batch).collect();
    let total = len + b.decode_len + b.next_n + 1;
    let cfg = EngineConfig {
        block_size: BLOCK_SIZE,
        num_blocks: total.div_ceil(BLOCK_SIZE) * b.batch + 1,
        batch_size: b.batch,
        max_prefill_tokens: len * b.batch,
    };
    let run = |next_n: usize| -> Result<(f64, Vec<Vec<u32>>, EngineStats)> {
        let mut engine = Engine::new(m, None, cfg)?;
        if next_n > 0 {
            engine.enable_mtp(next_n)?;
        }
        for p in &prompts {
            engine.add_request(Request {
                prompt: p.to_vec(),
                params: SamplingParams::greedy(),
                stop: StopConditions {
                    max_new_tokens: b.decode_len,
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
            })?;
        }
        let t = Instant::now();
        // main runs every command on a pool worker, so the step loop's parallel products fork
        // and join inside the pool.
        let mut outs = engine.run_to_completion(|_, _| {})?;
        let s = t.elapsed().as_secs_f64();
        outs.sort_by_key(|o| o.id);
        Ok((
            s,
            outs.into_iter().map(|o| o.tokens).collect(),
            engine.stats().clone(),
        ))
    };
    let (mut plain_s, mut spec_s) = (Vec::new(), Vec::new());
    // Decode time alone (steps without prefill; the MTP layer's pass over the prompt counts
    // as prefill, as in the seed), per run.
    let mut decode_ratio = Vec::new();
    let (mut plain_step, mut spec_step, mut draft_step) = (Vec::new(), Vec::new(), Vec::new());
    let mut stats = EngineStats::default();
    for _ in 0..b.runs {
        let (p, a, ps) = run(0)?;
        let (s, c, st) = run(b.next_n)?;
        if a != c {
            bail!("speculative output differs from greedy output; this is a bug");
        }
        plain_s.push(p);
        spec_s.push(s);
        let per = |x: f64, n: usize| x / n.max(1) as f64 * 1e3;
        if ps.decode_steps > 0 && st.decode_steps > 0 && st.decode_step_s > 0.0 {
            decode_ratio.push(ps.decode_step_s / st.decode_step_s);
        }
        if ps.decode_steps > 0 && st.decode_steps > 0 {
            plain_step.push(per(ps.decode_step_s, ps.decode_steps));
            spec_step.push(per(st.decode_step_s, st.decode_steps));
        }
        draft_step.push(per(st.draft_s, st.steps));
        stats = st;
    }
    let (p, s) = (median(&mut plain_s), median(&mut spec_s));
    let tokens = (b.decode_len * b.batch) as f64;
    let v = serde_json::json!({
        "model": dir.display().to_string(),
        "mtp": b.next_n,
        "batch": b.batch,
        "prompt_len": len,
        "decode_len": b.decode_len,
        "runs": b.runs,
        "plain_tok_s": tokens / p,
        "mtp_tok_s": tokens / s,
        "speedup": p / s,
        // (null when no step decoded: --decode-len 1)
        "decode_speedup": (!decode_ratio.is_empty()).then(|| median(&mut decode_ratio)),
        "drafted": stats.drafted,
        "accepted": stats.accepted_drafts,
        "acceptance_rate": stats.acceptance_rate(),
        "mean_accepted_length": stats.mean_accepted_length(),
        "tokens_per_main_step": stats.tokens_per_main_step(),
        "plain_decode_step_ms": (!plain_step.is_empty()).then(|| median(&mut plain_step)),
        "mtp_decode_step_ms": (!spec_step.is_empty()).then(|| median(&mut spec_step)),
        "mtp_draft_ms_per_step": median(&mut draft_step),
        "threads": rayon::current_num_threads(),
        "kernels": cachalot_kernels::kernel_isa(),
        "kv_cache_dtype": m.cache_spec().float.name(),
    });
    print_report(&v, b.json)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_odd_even_empty() {
        assert_eq!(median(&mut [3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&mut [4.0, 1.0, 2.0, 3.0]), 2.5);
        assert_eq!(median(&mut []), 0.0);
    }

    #[test]
    fn distinct_experts_expectation() {
        assert!((expected_distinct_experts(64, 6, 1) - 6.0).abs() < 1e-9);
        let e16 = expected_distinct_experts(64, 6, 16);
        assert!(e16 > 6.0 && e16 < 64.0);
        assert!((expected_distinct_experts(64, 64, 3) - 64.0).abs() < 1e-9);
    }

    #[test]
    fn peak_rss_is_read() {
        let r = peak_rss_bytes().expect("VmHWM in /proc/self/status");
        assert!(r > 1 << 20, "{r}");
    }

    #[test]
    fn membw_probe_reports_positive_rates() {
        let b = membw(8, 3);
        assert!(b.median_gb_s > 0.0 && b.best_gb_s >= b.median_gb_s);
        assert_eq!(b.passes, 3);
    }
}
