//! `cachalot convert` (FP8 → BF16 / W8A8C16 / W8A8C8, spec §5) and `cachalot calibrate` (the C8
//! latent-cache scales). Kept apart from the other commands; `main.rs` only dispatches here.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use cachalot_convert::{convert, ConvertOptions, QuantMode};

#[derive(clap::Args)]
pub struct ConvertArgs {
    /// FP8 Hugging Face checkpoint directory (the seed's --input_fp8_hf_path).
    #[arg(long, alias = "input_fp8_hf_path")]
    input: PathBuf,
    /// Output directory (the seed's --output_hf_path); written to a temporary directory beside
    /// it and renamed into place at the end.
    #[arg(long, alias = "output_hf_path")]
    output: PathBuf,
    /// bfloat16, w8a8c16 or w8a8c8 (the seed's --quant_mode).
    #[arg(long, alias = "quant_mode")]
    quant_mode: String,
    /// W8A8C8: per-layer latent-cache scales from `cachalot calibrate`.
    #[arg(long, alias = "c8_scales")]
    c8_scales: Option<PathBuf>,
    /// Replace a non-empty output directory.
    #[arg(long)]
    force: bool,
}

pub fn run_convert(args: &ConvertArgs) -> Result<()> {
    let Some(mode) = QuantMode::parse(&args.quant_mode) else {
        bail!(
            "--quant-mode `{}` is not one of bfloat16, w8a8c16, w8a8c8",
            args.quant_mode
        );
    };
    let opts = ConvertOptions {
        input: args.input.clone(),
        output: args.output.clone(),
        mode,
        c8_scales: args.c8_scales.clone(),
        force: args.force,
        progress: true,
    };
    let r = convert(&opts)?;
    eprintln!(
        "converted {} shards, {} tensors ({} int8 weights, {} bf16 weights) into {} in {:.2} s \
         ({:.2} GB/s of input)",
        r.shards,
        r.tensors_written,
        r.int8_weights,
        r.bf16_weights,
        args.output.display(),
        r.seconds,
        r.input_bytes as f64 / r.seconds / 1e9
    );
    Ok(())
}

#[derive(clap::Args)]
pub struct CalibrateArgs {
    /// Model directory to calibrate (FP8, BF16 or W8A8C16; the model whose latents C8 will hold).
    #[arg(long)]
    model: PathBuf,
    /// Calibration text, tokenized with the model's tokenizer (no special tokens added).
    #[arg(long)]
    file: PathBuf,
    /// Where to write the scales (JSON, read by `convert --c8-scales`).
    #[arg(long)]
    out: PathBuf,
    /// Prefill chunk size in tokens.
    #[arg(long, default_value_t = 512)]
    chunk: usize,
}

/// The calibration method, written into the scales file.
const C8_METHOD: &str = "per layer: absmax = max |c_kv| over every calibration token (c_kv after \
    kv_a_layernorm, exactly what the latent cache stores); ckv_scale = absmax / 127, so the \
    largest calibration value maps to ±127 and larger ones saturate; MTP layers (not run during \
    calibration) take the largest main-layer scale";

pub fn run_calibrate(args: &CalibrateArgs) -> Result<()> {
    use cachalot_model::tokenizer::Tokenizer;
    use cachalot_model::{eval, DeepseekV3, LoadOptions};

    let text = std::fs::read_to_string(&args.file)
        .with_context(|| format!("cannot read {}", args.file.display()))?;
    let ids = Tokenizer::from_dir(&args.model)?.encode(&text)?;
    let model = DeepseekV3::load(&args.model, LoadOptions::default())?;
    let absmax = eval::latent_absmax(&model, &ids, args.chunk)?;
    if let Some(i) = absmax.iter().position(|&a| !(a.is_finite() && a > 0.0)) {
        bail!(
            "layer {i}: the latent range over {} tokens is {}; use a longer text",
            ids.len(),
            absmax[i]
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
    std::fs::write(&args.out, serde_json::to_string_pretty(&v)? + "\n")
        .with_context(|| format!("cannot write {}", args.out.display()))?;
    eprintln!(
        "{} layers calibrated on {} tokens; scales written to {}",
        scales.len(),
        ids.len(),
        args.out.display()
    );
    Ok(())
}
