//! Every shipped config parses; broken configs give every problem at once, in words a person can
//! act on (compared as text, snapshot-style).

use std::path::{Path, PathBuf};

use cachalot_run::config::{RunConfig, SECTIONS};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn yaml_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            yaml_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "yaml") {
            out.push(p);
        }
    }
}

#[test]
fn every_shipped_config_parses() {
    let mut files = Vec::new();
    yaml_files(&root().join("configs"), &mut files);
    assert!(files.len() >= 20, "{files:?}");
    for f in &files {
        let c = RunConfig::from_file(f).unwrap_or_else(|e| panic!("{e}"));
        assert!(
            c.model_config.model_path.starts_with("models/")
                || c.model_config.model_path.starts_with("assets/")
                || c.model_config.model_path.starts_with("fixtures/"),
            "{}: model_path {}",
            f.display(),
            c.model_config.model_path
        );
    }
}

#[test]
fn seed_configs_keep_their_values() {
    let c =
        RunConfig::from_file(&root().join("configs/deepseek_r1/decode_r1_rank_16_16ep_a8w8.yaml"))
            .unwrap();
    assert_eq!(c.model_config.model_name, "deepseek_r1");
    assert_eq!(c.model_config.exe_mode, "npugraph_ex");
    assert_eq!(c.model_config.custom_params["moe_chunk_max_len"], 65536);
    assert_eq!(c.data_config.dataset, "LongBench");
    assert_eq!(c.parallel_config.world_size, 16);
    assert_eq!(c.parallel_config.embed_tp_size, 16);
    assert_eq!(c.scheduler_config.batch_size, 64);
    assert_eq!(c.batch_size_per_dp_rank(), 4);
    assert_eq!(c.max_prefill_tokens(), 256);
}

fn err(yaml: &str) -> String {
    RunConfig::from_yaml(yaml, Path::new("broken.yaml"))
        .unwrap_err()
        .to_string()
}

#[test]
fn all_schema_problems_are_reported_at_once() {
    let yaml = "\
model_config:
  model_name: deepseek_r1
  exe_mod: eager
  with_ckpt: yes please
data_config:
  dataset: LongBench
  top_p: 1.5
  temperature: hot
parallel_config:
  world_size: 0
schedular_config:
  batch_size: 4
";
    let want = "\
broken.yaml: 6 problems in the run config
  line 3: model_config.exe_mod: unknown key; did you mean `exe_mode`? valid keys: model_name, model_path, output_path, dtype, with_ckpt, next_n, platform_version, exe_mode, enable_cache_compile, enable_static_kernel, enable_dynamic_graph, force_eplb, enable_profiler, enable_weight_nz, enable_hadamard, hadamard_weight_path, custom_params
  line 4: model_config.with_ckpt: expected true or false, got the string \"yes please\"
  line 7: data_config.top_p: 1.5 is out of range: must be in [0, 1]
  line 8: data_config.temperature: expected a number, got the string \"hot\"
  line 10: parallel_config.world_size: 0 is out of range: must be >= 1
  line 11: schedular_config: unknown section; did you mean `scheduler_config`? valid sections: model_config, data_config, parallel_config, scheduler_config";
    assert_eq!(err(yaml), want);
}

#[test]
fn contradictory_sizes_are_reported_at_once() {
    let yaml = "\
model_config:
  exe_mode: eager
  enable_static_kernel: true
  next_n: 4
parallel_config:
  world_size: 16
  attn_tp_size: 3
  moe_tp_size: 32
  cp_size: 16
scheduler_config:
  batch_size: 6
";
    let want = "\
broken.yaml: 5 problems in the run config
  line 3: model_config.enable_static_kernel: only valid with exe_mode npugraph_ex (exe_mode is eager)
  line 4: model_config.next_n: 4 draft tokens; the DeepSeek models allow 0..=3
  line 7: parallel_config.attn_tp_size: 3 does not divide world_size 16
  line 8: parallel_config.moe_tp_size: 32 does not divide world_size 16
  line 9: parallel_config.cp_size: context parallelism needs cp_size == world_size (16) and attn_tp_size == 1 (got cp_size 16, attn_tp_size 3)
";
    assert_eq!(err(yaml), want.trim_end());
}

#[test]
fn batch_must_split_over_data_parallel_ranks() {
    let yaml = "parallel_config:\n  world_size: 16\nscheduler_config:\n  batch_size: 20\n";
    assert_eq!(
        err(yaml),
        "broken.yaml: 1 problem in the run config\n  line 4: scheduler_config.batch_size: 20 is not a multiple of the attention data-parallel size 16 (world_size 16 / attn_tp_size 1)"
    );
}

#[test]
fn unknown_model_and_syntax_errors() {
    assert_eq!(
        err("model_config:\n  model_name: deepseek_r2\n"),
        "broken.yaml: 1 problem in the run config\n  line 2: model_config.model_name: expected one of deepseek_r1, deepseek_v3, kimi_k2, kimi_k2_thinking, deepseek_v4, got the string \"deepseek_r2\""
    );
    let e = err("model_config: [\n");
    assert!(e.starts_with("broken.yaml: not valid YAML: "), "{e}");
    assert!(e.contains("line 1"), "{e}");
    assert_eq!(
        err("- a\n- b\n"),
        "broken.yaml: 1 problem in the run config\n  (top level): expected a mapping of sections (model_config, data_config, parallel_config, scheduler_config), got a list"
    );
}

#[test]
fn config_doc_covers_every_key() {
    let doc = std::fs::read_to_string(root().join("docs/CONFIG.md")).unwrap();
    for (section, keys) in SECTIONS {
        assert!(
            doc.contains(&format!("`{section}`")),
            "docs/CONFIG.md lacks section {section}"
        );
        for k in keys.iter() {
            assert!(
                doc.contains(&format!("| `{}` |", k.name)),
                "docs/CONFIG.md lacks {section}.{}",
                k.name
            );
        }
    }
}

#[test]
fn sizes_past_any_real_run_are_out_of_range() {
    // Values that would overflow derived sizes or ask for terabytes; the seed (a 64-bit value)
    // is not bounded.
    let yaml = "\
data_config:
  input_truncated_len: 4611686018427387904
  num_requests: 100000000000
  seed: 9223372036854775807
  temperature: 1.0e+300
scheduler_config:
  batch_size: 1000000000000
  block_size: 1000000
  max_new_tokens: 100000000
";
    let want = "\
broken.yaml: 6 problems in the run config
  line 2: data_config.input_truncated_len: 4611686018427387904 is out of range: must be at most 16777216
  line 3: data_config.num_requests: 100000000000 is out of range: must be at most 16777216
  line 5: data_config.temperature: 1e300 is out of range: must be >= 0 and at most 3.4028235e38 (a 32-bit float)
  line 7: scheduler_config.batch_size: 1000000000000 is out of range: must be at most 65536
  line 8: scheduler_config.block_size: 1000000 is out of range: must be at most 4096
  line 9: scheduler_config.max_new_tokens: 100000000 is out of range: must be at most 16777216";
    assert_eq!(err(yaml), want);
}

#[test]
fn seed_values_the_seed_accepts_parse() {
    // top_p 0 (greedy in the seed), platform_version null (detect), a negative seed (none fixed).
    let c = RunConfig::from_yaml(
        "model_config:\n  platform_version: null\ndata_config:\n  temperature: 0.7\n  top_p: 0\n  seed: -1\n",
        Path::new("seed.yaml"),
    )
    .unwrap();
    assert_eq!(c.data_config.top_p, 0.0);
    assert_eq!(c.data_config.seed, None);
    assert_eq!(c.model_config.platform_version, None);
    // A schema error does not hide the cross-key checks, and values differing in case get a hint.
    let e = err("model_config:\n  exe_mod: eager\nparallel_config:\n  world_size: 8\n  attn_tp_size: 3\ndata_config:\n  dataset: longbench\n");
    assert!(e.contains("3 problems"), "{e}");
    assert!(
        e.contains("line 5: parallel_config.attn_tp_size: 3 does not divide"),
        "{e}"
    );
    assert!(e.contains("did you mean `LongBench`?"), "{e}");
}
