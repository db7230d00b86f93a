//! `cachalot run`: an offline run from a YAML config (`--config FILE`, or the seed's
//! `--model NAME --yaml FILE` resolving `configs/NAME/FILE`; no arguments: configs/default.yaml).

use std::io::IsTerminal;
use std::path::PathBuf;

use anyhow::{anyhow, bail, Result};
use cachalot_model::Fp8Mode;
use cachalot_run::config::RunConfig;
use cachalot_run::offline::{self, RunOptions};

#[derive(clap::Args)]
pub struct RunArgs {
    /// The YAML run config.
    #[arg(long, conflicts_with_all = ["model", "yaml"])]
    config: Option<PathBuf>,
    /// With --yaml: the model's directory under configs/ (the seed's `--model`).
    #[arg(long, requires = "yaml")]
    model: Option<String>,
    /// With --model: the file under configs/NAME/ (the seed's `--yaml`).
    #[arg(long, requires = "model")]
    yaml: Option<PathBuf>,
    /// Directory of run results.
    #[arg(long, default_value = "res")]
    res_dir: PathBuf,
    /// KV pool size in blocks (null block included), instead of the config's sizing.
    #[arg(long)]
    kv_blocks: Option<usize>,
    /// Requests in the run (overrides data_config.num_requests).
    #[arg(long)]
    num_requests: Option<usize>,
    /// Chat template instead of the model's: a tokenizer_config.json or a Jinja file.
    #[arg(long)]
    chat_template: Option<PathBuf>,
    /// Threads (default: all cores).
    #[arg(long)]
    pub threads: Option<usize>,
    /// No progress bar.
    #[arg(long)]
    quiet: bool,
    /// Print summary.json instead of the table.
    #[arg(long)]
    json: bool,
    /// MTP speculative decoding with N (1-3) drafts per step, 0 to turn it off (overrides
    /// model_config.next_n).
    #[arg(long, value_name = "N")]
    mtp: Option<usize>,
    /// Hold the output head (lm_head) in int8 with int8 activations, as llama.cpp's Q8_0 files
    /// do, instead of the checkpoint's bf16 (recorded as int8_head in summary.json).
    #[arg(long)]
    int8_head: bool,
    /// Multiply bf16 weights as BF16 x BF16, activations rounded to bf16 (AVX-512 `vdpbf16ps`
    /// where the CPU has it), as llama.cpp does (recorded as bf16_dot in summary.json).
    #[arg(long)]
    bf16_dot: bool,
}

fn config_path(args: &RunArgs) -> Result<PathBuf> {
    let path = match (&args.config, &args.model, &args.yaml) {
        (Some(c), _, _) => c.clone(),
        (None, Some(m), Some(y)) => {
            let dir = PathBuf::from("configs").join(m);
            if !dir.is_dir() {
                let known: Vec<String> = std::fs::read_dir("configs")
                    .map(|rd| {
                        rd.filter_map(|e| e.ok())
                            .filter(|e| e.path().is_dir())
                            .map(|e| e.file_name().to_string_lossy().into_owned())
                            .collect()
                    })
                    .unwrap_or_default();
                bail!(
                    "--model {m}: no directory {} (models with configs: {})",
                    dir.display(),
                    if known.is_empty() {
                        "none; run from the repository root".into()
                    } else {
                        known.join(", ")
                    }
                );
            }
            dir.join(y)
        }
        _ => PathBuf::from("configs/default.yaml"),
    };
    if !path.is_file() {
        bail!("{}: no such config file", path.display());
    }
    Ok(path)
}

pub fn run(args: &RunArgs) -> Result<()> {
    let path = config_path(args)?;
    let mut cfg = RunConfig::from_file(&path)?;
    if let Some(n) = args.mtp {
        if n > 3 {
            bail!("--mtp {n}: the DeepSeek models take 0 to 3 draft tokens per step");
        }
        cfg.model_config.next_n = n;
    }
    let opts = RunOptions {
        config_path: path,
        res_dir: args.res_dir.clone(),
        kv_blocks: args.kv_blocks,
        num_requests: args.num_requests,
        chat_template: args.chat_template.clone(),
        progress: !args.quiet && std::io::stderr().is_terminal(),
        fp8: Fp8Mode::Native,
        int8_head: args.int8_head,
        bf16_dot: args.bf16_dot,
    };
    let result = offline::run(&cfg, &opts).map_err(|e| anyhow!("{e}"))?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&result.summary)?);
    } else {
        print!("{}", offline::summary_table(&result.summary));
        println!("results in {}", result.dir.display());
    }
    Ok(())
}
