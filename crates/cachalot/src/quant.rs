//! `cachalot convert` (FP8 → BF16 / W8A8C16 / W8A8C8, spec §5) and `cachalot calibrate` (the C8
//! latent-cache scales). Kept apart from the other commands; `main.rs` only dispatches here.

use std::path::PathBuf;

use anyhow::{bail, Result};
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
