//! `cachalot convert` (V3/R1/Kimi FP8 → BF16 / W8A8C16 / W8A8C8, spec
//! `deepseek-v3-r1-kimi-k2.md` §5; DeepSeek-V4 → bfloat16 / w8a8-int / w4a8-int / w4a8-mx /
//! w4a8-mx-hif, `deepseek-v4.md` §4.2), `cachalot convert-config` (V4 §1.2) and `cachalot
//! calibrate` (the C8 latent-cache scales). Kept apart from the other commands; `main.rs` only
//! dispatches here.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use cachalot_convert::{convert, ConvertOptions, QuantMode};

#[derive(clap::Args)]
pub struct ConvertArgs {
    /// The Hugging Face checkpoint directory (the seed's --input_fp8_hf_path): FP8 as DeepSeek
    /// ships it, BF16, or Kimi-K2-Thinking's int4 (pack-quantized); DeepSeek-V4 FP8 + MXFP4.
    #[arg(long, alias = "input_fp8_hf_path")]
    input: PathBuf,
    /// Output directory (the seed's --output_hf_path); written to a temporary directory beside
    /// it and renamed into place at the end (inside it where it is a mount point or its parent
    /// cannot be written).
    #[arg(long, alias = "output_hf_path")]
    output: PathBuf,
    /// DeepSeek-V3/R1/Kimi: bfloat16, w8a8c16 or w8a8c8 (the seed's --quant_mode).
    #[arg(long, alias = "quant_mode", conflicts_with = "quant_type")]
    quant_mode: Option<String>,
    /// DeepSeek-V4: bfloat16, w8a8-int, w4a8-int, w4a8-mx or w4a8-mx-hif (the seed's
    /// --quant_type).
    #[arg(long, alias = "quant_type")]
    quant_type: Option<String>,
    /// DeepSeek-V4 clip factors: the seed's --quant_param_path directory of
    /// quant_params_{L}.pt files (torch.save'd dicts of <layer>.clip_factor_min/max), applied
    /// to the INT8/INT4 layers that have them before quantisation. For DeepSeek-V3/R1/Kimi
    /// W8A8C8, the seed's directory of quant_parameters_{L}.pth C8 scales (as --c8-scales).
    #[arg(long, alias = "quant_param_path")]
    quant_param_path: Option<PathBuf>,
    /// W8A8C8: per-layer latent-cache scales, a file from `cachalot calibrate` or the seed's
    /// directory of quant_parameters_{L}.pth files.
    #[arg(long, alias = "c8_scales")]
    c8_scales: Option<PathBuf>,
    /// Replace a non-empty output directory.
    #[arg(long)]
    force: bool,
    /// Threads (default: all cores).
    #[arg(long)]
    pub threads: Option<usize>,
}

pub fn run_convert(args: &ConvertArgs) -> Result<()> {
    let mode = match (&args.quant_mode, &args.quant_type) {
        (Some(m), None) => match QuantMode::parse(m) {
            Some(mode @ (QuantMode::Bfloat16 | QuantMode::W8A8C16 | QuantMode::W8A8C8)) => mode,
            _ => bail!("--quant-mode `{m}` is not one of bfloat16, w8a8c16, w8a8c8"),
        },
        (None, Some(t)) => match QuantMode::parse(t) {
            Some(
                mode @ (QuantMode::Bfloat16
                | QuantMode::W8A8Int
                | QuantMode::W4A8Int
                | QuantMode::W4A8Mx
                | QuantMode::W4A8MxHif),
            ) => mode,
            _ => bail!(
                "--quant-type `{t}` is not one of bfloat16, w8a8-int, w4a8-int, w4a8-mx, \
                 w4a8-mx-hif"
            ),
        },
        _ => bail!(
            "give --quant-mode (DeepSeek-V3/R1/Kimi: bfloat16, w8a8c16, w8a8c8) or --quant-type \
             (DeepSeek-V4: bfloat16, w8a8-int, w4a8-int, w4a8-mx, w4a8-mx-hif)"
        ),
    };
    let opts = ConvertOptions {
        input: args.input.clone(),
        output: args.output.clone(),
        mode,
        c8_scales: args.c8_scales.clone(),
        quant_param_path: args.quant_param_path.clone(),
        force: args.force,
        progress: true,
    };
    if opts.quant_param_path.is_some() && matches!(mode, QuantMode::W4A8Mx | QuantMode::W4A8MxHif) {
        say!(
            "note: --quant-param-path: clip factors clamp the INT8/INT4 layers; {} has none, so \
             they are not used",
            mode.name()
        );
    }
    let mtp_note = check_input_loads(&args.input)?;
    // Ctrl-C or SIGTERM: the partial output goes with the process unless it holds whole
    // shards, which the same command then resumes from (the old output, if any, is untouched
    // until a conversion completes).
    crate::term::on_interrupt(|| match cachalot_convert::remove_partial_output() {
        Some((p, None)) => eprintln!(
            "convert: interrupted; removed the partial output {}",
            p.display()
        ),
        Some((p, Some(n))) => eprintln!(
            "convert: interrupted; {} written so far kept in {}: the same command goes on \
             from there (delete it to start over)",
            cachalot_convert::shards_word(n),
            p.display()
        ),
        // Stopped while the finished output was put in place: it is, whole.
        None => {
            if let Some(out) = cachalot_convert::placed_output() {
                eprintln!(
                    "convert: interrupted as the converted model was put in place; it is \
                     complete in {}",
                    out.display()
                )
            }
        }
    })?;
    let r = convert(&opts).map_err(|e| match &mtp_note {
        // What the loader said about the MTP layers is likely the same damage.
        Some(n) => anyhow::Error::new(e).context(format!("(before converting: {n})")),
        None => anyhow::Error::new(e),
    })?;
    if let Some(n) = &mtp_note {
        say!("note: {n}; the output runs, but not with --mtp");
    }
    for note in &r.notes {
        say!("note: {note}");
    }
    let mut kinds = format!(
        "{} int8 weights, {} bf16 weights",
        r.int8_weights, r.bf16_weights
    );
    for (n, what) in [
        (r.int4_weights, "int4"),
        (r.mx_weights, "mxfp8/mxfp4"),
        (r.hif8_weights, "hif8"),
    ] {
        if n > 0 {
            kinds.push_str(&format!(", {n} {what} weights"));
        }
    }
    // (A resumed run's rate would count shards an earlier run wrote.)
    let rate = match r.resumed {
        0 => format!(
            "{:.2} GB/s of input; ",
            r.input_bytes as f64 / r.seconds / 1e9
        ),
        n => format!(
            "{} of them written by the interrupted run; ",
            cachalot_convert::shards_word(n)
        ),
    };
    say!(
        "converted {} shards, {} tensors ({kinds}) into {} in {:.2} s ({rate}{:.3} GB in, \
         {:.3} GB out)",
        r.shards,
        r.tensors_written,
        args.output.display(),
        r.seconds,
        r.input_bytes as f64 / 1e9,
        r.output_bytes as f64 / 1e9
    );
    Ok(())
}

/// The converter checks the tensors it converts; the loader also checks what the model needs
/// (every tensor present, none extra, shapes from config.json, MTP layers included). A checkpoint
/// it would refuse is refused now, before the conversion, not when the output is loaded. (The
/// load maps the shards and reads only small tensors.) A checkpoint that loads only without its
/// MTP layers converts; what is wrong with them is returned, for a note once it has.
fn check_input_loads(dir: &std::path::Path) -> Result<Option<String>> {
    use cachalot_model::{detect_family, DeepseekV3, DeepseekV4, LoadOptions, ModelFamily};
    let problem = if !dir.exists() {
        Some("no such directory")
    } else if !dir.is_dir() {
        Some("is not a directory")
    } else if !dir.join("config.json").is_file() {
        Some("has no config.json")
    } else {
        None
    };
    if let Some(problem) = problem {
        anyhow::bail!(
            "--input {}: {problem}; give the directory of the checkpoint to convert (its \
             config.json and safetensors shards)",
            dir.display(),
        );
    }
    let load = |mtp: bool| -> cachalot_model::Result<()> {
        match detect_family(dir)? {
            ModelFamily::DeepseekV3 => DeepseekV3::load(
                dir,
                LoadOptions {
                    load_mtp: mtp,
                    ..LoadOptions::default()
                },
            )
            .map(drop),
            ModelFamily::DeepseekV4 => DeepseekV4::load(
                dir,
                cachalot_model::V4LoadOptions {
                    load_mtp: mtp,
                    ..Default::default()
                },
            )
            .map(drop),
        }
    };
    let Err(with_mtp) = load(true) else {
        return Ok(None);
    };
    // Many re-uploads leave out the MTP layers: the main model converts (and runs) without
    // them; only --mtp needs them.
    if load(false).is_ok() {
        return Ok(Some(format!(
            "{} loads without its MTP layers ({with_mtp})",
            dir.display()
        )));
    }
    Err(anyhow::Error::new(with_mtp)).with_context(|| {
        format!(
            "the input checkpoint {} does not load as its config.json describes it, so its \
             conversion would not either; fix the input first",
            dir.display()
        )
    })
}

#[derive(clap::Args)]
pub struct ConvertConfigArgs {
    /// DeepSeek-V4 checkpoint directory whose config.json is rewritten in place.
    dir: PathBuf,
    /// Describe the HiF8 variant (ignore list = the two heads, channel/tensor group_0).
    #[arg(long)]
    hif: bool,
}

pub fn run_convert_config(args: &ConvertConfigArgs) -> Result<()> {
    match cachalot_convert::convert_config(&args.dir, args.hif)? {
        cachalot_convert::ConfigRewrite::Rewritten { orig } => say!(
            "rewrote quantization_config of {} (the first description is in {})",
            args.dir.join("config.json").display(),
            orig.display()
        ),
        cachalot_convert::ConfigRewrite::AlreadyDone => say!(
            "{} already describes the checkpoint so; nothing written",
            args.dir.join("config.json").display()
        ),
    }
    Ok(())
}

#[derive(clap::Args)]
pub struct CalibrateArgs {
    /// Model directory to calibrate (FP8, BF16, int4 or W8A8C16; the model whose latents C8
    /// will hold).
    #[arg(long)]
    model: PathBuf,
    /// Calibration text, tokenized with the model's tokenizer (no special tokens added).
    #[arg(long)]
    file: PathBuf,
    /// Where to write the scales (JSON, read by `convert --c8-scales`; `-`: standard output).
    #[arg(long)]
    out: PathBuf,
    /// Prefill chunk size in tokens.
    #[arg(long, default_value_t = 512)]
    chunk: usize,
    /// Read every tensor first and refuse a NaN or infinity (naming the tensor), as the other
    /// commands' option.
    #[arg(long)]
    check_tensors: bool,
    /// Threads (default: all cores).
    #[arg(long)]
    pub threads: Option<usize>,
}

/// The calibration method, written into the scales file.
const C8_METHOD: &str = "per layer: absmax = max |c_kv| over every calibration token (c_kv after \
    kv_a_layernorm, exactly what the latent cache stores); ckv_scale = absmax / 127, so the \
    largest calibration value maps to ±127 and larger ones saturate; MTP layers (not run during \
    calibration) take the largest main-layer scale";

pub fn run_calibrate(args: &CalibrateArgs) -> Result<()> {
    use cachalot_model::tokenizer::Tokenizer;
    use cachalot_model::{eval, DeepseekV3, LoadOptions};

    if cachalot_model::detect_family(&args.model)? == cachalot_model::ModelFamily::DeepseekV4 {
        bail!(
            "{}: calibrate makes the C8 latent-cache scales of DeepSeek-V3/R1/Kimi-K2's w8a8c8; \
             a DeepSeek-V4 checkpoint has no such cache (its converter takes the seed's clip factors \
             with --quant-param-path instead)",
            args.model.display()
        );
    }
    if args.chunk == 0 {
        bail!("--chunk 0: give a prefill chunk of at least 1 token (512 by default)");
    }
    // Where the scales go is checked before the run (a long prefill on a large model).
    if args.out.as_os_str() != "-" {
        let out = args.out.display();
        if args.out.is_dir() {
            bail!("--out {out}: a directory; give the path of the scales' JSON file");
        }
        if args.out.exists() {
            // (Opened for writing, not truncated: a device such as /dev/stdout too.)
            std::fs::OpenOptions::new()
                .write(true)
                .open(&args.out)
                .with_context(|| format!("--out {out}: cannot write it"))?;
        } else {
            let parent = args
                .out
                .parent()
                .filter(|p| !p.as_os_str().is_empty())
                .unwrap_or(std::path::Path::new("."));
            let probe = parent.join(format!(".cachalot-calibrate-{}", std::process::id()));
            std::fs::write(&probe, b"")
                .and_then(|()| std::fs::remove_file(&probe))
                .with_context(|| format!("--out {out}: cannot write in {}", parent.display()))?;
        }
    }
    let text = crate::read_text_file(&args.file)?;
    let ids = Tokenizer::from_dir(&args.model)?.encode(&text)?;
    // A handful of tokens gives scales that saturate on real text.
    const FEW: usize = 64;
    if ids.is_empty() {
        bail!(
            "{}: the text has no tokens; give a calibration text (a few thousand tokens of the \
             kind the model will serve)",
            args.file.display()
        );
    }
    if args.check_tensors {
        cachalot_model::checkpoint::Checkpoint::open(&args.model)?.check_values()?;
    }
    let model = DeepseekV3::load(&args.model, LoadOptions::default())?;
    let max = model.config().max_position_embeddings;
    if ids.len() > max {
        bail!(
            "{}: {} tokens exceed the model's max_position_embeddings {max} (config.json), and \
             calibration runs the text as one context; give a text of at most {max} tokens",
            args.file.display(),
            ids.len()
        );
    }
    let absmax = eval::latent_absmax(&model, &ids, args.chunk)?;
    if let Some(i) = absmax.iter().position(|&a| !(a.is_finite() && a > 0.0)) {
        bail!(
            "layer {i}: the latent range over {} tokens is {}; use a longer text",
            ids.len(),
            absmax[i]
        );
    }
    if ids.len() < FEW {
        say!(
            "note: {} holds only {} tokens; scales from so little text saturate on real inputs \
             (a few thousand tokens of the kind the model will serve are better)",
            args.file.display(),
            ids.len()
        );
    }
    let mut scales: Vec<f32> = absmax.iter().map(|a| a / 127.0).collect();
    let widest = scales.iter().copied().fold(0.0f32, f32::max);
    scales.extend(std::iter::repeat_n(
        widest,
        model.config().num_nextn_predict_layers,
    ));
    let v = serde_json::json!({
        "format": "cachalot-c8-scales",
        "method": C8_METHOD,
        "model": args.model.display().to_string(),
        "text": args.file.display().to_string(),
        "n_tokens": ids.len(),
        "absmax": absmax,
        "ckv_scale": scales,
    });
    let text = serde_json::to_string_pretty(&v)? + "\n";
    // `-`: standard output, as `--file -` reads standard input.
    let to = if args.out.as_os_str() == "-" {
        use std::io::Write;
        std::io::stdout()
            .lock()
            .write_all(text.as_bytes())
            .context("cannot write the scales to standard output")?;
        "standard output".to_string()
    } else {
        std::fs::write(&args.out, text)
            .with_context(|| format!("cannot write {}", args.out.display()))?;
        args.out.display().to_string()
    };
    say!(
        "{} layers calibrated on {} tokens; scales written to {to}",
        scales.len(),
        ids.len()
    );
    Ok(())
}
