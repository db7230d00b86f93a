//! Offline runs end to end on the tiny fixture model: the files under res/<run-id>/, and greedy
//! outputs of a batched run (mixed prompt lengths, chunked prefill, a tight KV pool) equal to
//! each request run alone.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use cachalot_model::Fp8Mode;
use cachalot_run::config::RunConfig;
use cachalot_run::offline::{run, Parallel, RunOptions};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn config(batch: usize, budget: usize, dataset_dir: &Path) -> RunConfig {
    let yaml = format!(
        "model_config:\n  model_name: deepseek_r1\n  model_path: {}\n\
         data_config:\n  dataset: default\n  dataset_path: {}\n  input_truncated_len: 48\n  num_requests: 12\n\
         scheduler_config:\n  block_size: 8\n  batch_size: {batch}\n  max_new_tokens: 12\n  max_prefill_tokens: {budget}\n",
        root().join("fixtures/v3/r1_tiny").display(),
        dataset_dir.display(),
    );
    RunConfig::from_yaml(&yaml, Path::new("test.yaml")).unwrap()
}

fn opts(res: &Path, kv_blocks: Option<usize>) -> RunOptions {
    RunOptions {
        config_path: PathBuf::from("test.yaml"),
        res_dir: res.to_path_buf(),
        kv_blocks,
        num_requests: None,
        chat_template: Some(root().join("fixtures/text/r1_style/tokenizer_config.json")),
        progress: false,
        fp8: Fp8Mode::Native,
        int8_head: false,
        bf16_dot: false,
        kv_cache_dtype: None,
        prefix_caching: None,
        v4_cache: Default::default(),
        host_ranks: 1,
        parallel: Parallel::Data,
        expert_placement: None,
        redundant_experts: 0,
        check_tensors: false,
        mtp_option: false,
    }
}

/// `run_ranked` on `n` ranks of a TCP group on threads of this process: every rank's result,
/// in rank order.
fn run_group<T: Send>(
    n: usize,
    rank_run: impl Fn(Arc<dyn cachalot_engine::comm::Communicator>) -> T + Sync,
) -> Vec<T> {
    cachalot_engine::comm::run_local_group(n, rank_run).unwrap()
}

#[test]
fn batched_run_equals_one_at_a_time_and_writes_results() {
    let tmp = tempfile::tempdir().unwrap();
    let data = root().join("dataset");
    let alone = run(&config(1, 4096, &data), &opts(tmp.path(), None)).unwrap();
    // Batch 6, 20-token prefill budget (prompts are 25..48 tokens: every one is chunked), and
    // a pool too small for all six at once: preemption and recompute happen.
    let batched = run(&config(6, 20, &data), &opts(tmp.path(), Some(30))).unwrap();
    assert!(batched.summary.preemptions > 0, "{:?}", batched.summary);
    assert_eq!(alone.outputs.len(), 12);
    for (a, b) in alone.outputs.iter().zip(&batched.outputs) {
        assert_eq!(a.prompt, b.prompt);
        assert_eq!(a.tokens, b.tokens, "request {}", a.id);
    }

    let dir = &batched.dir;
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("summary.json")).unwrap()).unwrap();
    for key in [
        "throughput",
        "ttft_s",
        "tpot_s",
        "kv_peak_blocks",
        "requests",
    ] {
        assert!(summary.get(key).is_some(), "summary.json lacks {key}");
    }
    assert!(
        summary["throughput"]["output_tok_s_per_rank"]
            .as_f64()
            .unwrap()
            > 0.0
    );
    assert!(summary["tpot_s"]["p99"].as_f64().unwrap() > 0.0);
    // `--kv-cache-dtype auto`: the seed's 16-bit cache for this family.
    assert_eq!(summary["kv_cache_dtype"], "bf16");
    assert_eq!(summary["kv_cache_c8"], false);
    let lines: Vec<serde_json::Value> = std::fs::read_to_string(dir.join("requests.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 12);
    assert!(lines[0]["prompt_text"]
        .as_str()
        .unwrap()
        .contains("<｜User｜>"));
    assert!(lines[0]["timing"]["ttft_s"].as_f64().unwrap() > 0.0);
    let log = std::fs::read_to_string(dir.join("run.log")).unwrap();
    assert!(log.contains("preempted"), "{log}");
    assert_ne!(alone.dir, batched.dir);
}

#[test]
fn a_missing_model_or_dataset_says_what_to_do() {
    let tmp = tempfile::tempdir().unwrap();
    let mut cfg = config(2, 64, tmp.path());
    let e = run(&cfg, &opts(tmp.path(), None))
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("default_prompt.json"), "{e}");
    cfg.model_config.model_path = "assets/cachalot-tiny-r1-missing".into();
    let e = run(&cfg, &opts(tmp.path(), None))
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains("no config.json there") && e.contains("repository root"),
        "{e}"
    );
}

/// `model_config.next_n` runs MTP speculative decoding in the engine: the same greedy outputs
/// as without it (batched, chunked, preempting), and the MTP figures in summary.json.
#[test]
fn next_n_runs_speculative_decoding_with_the_same_outputs() {
    let tmp = tempfile::tempdir().unwrap();
    let data = root().join("dataset");
    let plain = run(&config(6, 20, &data), &opts(tmp.path(), Some(30))).unwrap();
    for next_n in [1, 3] {
        let mut cfg = config(6, 20, &data);
        cfg.model_config.next_n = next_n;
        let spec = run(&cfg, &opts(tmp.path(), Some(30))).unwrap();
        for (a, b) in plain.outputs.iter().zip(&spec.outputs) {
            assert_eq!(a.tokens, b.tokens, "next_n {next_n}: request {}", a.id);
        }
        let summary: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(spec.dir.join("summary.json")).unwrap())
                .unwrap();
        let m = &summary["mtp"];
        assert_eq!(m["next_n"], next_n);
        assert!(m["drafted"].as_u64().unwrap() > 0, "{m}");
        for key in [
            "acceptance_rate",
            "mean_accepted_length",
            "tokens_per_main_step",
        ] {
            assert!(m[key].as_f64().is_some(), "summary.json mtp lacks {key}");
        }
        assert!(offline_table_mentions_mtp(&spec.summary));
    }
    assert!(plain.summary.mtp.is_none());
}

fn offline_table_mentions_mtp(s: &cachalot_run::offline::Summary) -> bool {
    cachalot_run::offline::summary_table(s).contains("MTP")
}

fn v4_config(model_name: &str, batch: usize, budget: usize, next_n: usize) -> RunConfig {
    let yaml = format!(
        "model_config:\n  model_name: {model_name}\n  model_path: {}\n  next_n: {next_n}\n\
         data_config:\n  dataset: default\n  dataset_path: {}\n  input_truncated_len: 96\n  num_requests: 6\n\
         scheduler_config:\n  block_size: 8\n  batch_size: {batch}\n  max_new_tokens: 140\n  max_prefill_tokens: {budget}\n",
        root().join("fixtures/v4/flash_tiny").display(),
        root().join("dataset").display(),
    );
    RunConfig::from_yaml(&yaml, Path::new("v4.yaml")).unwrap()
}

/// A DeepSeek-V4 checkpoint runs through the same engine: a batched run with chunked prefill
/// (past the 128-token window and several compressed blocks), with and without MTP drafts,
/// equals each request alone.
#[test]
fn v4_batched_run_equals_one_at_a_time() {
    let tmp = tempfile::tempdir().unwrap();
    let mut o = opts(tmp.path(), None);
    o.chat_template = None;
    let alone = run(&v4_config("deepseek_v4", 1, 4096, 0), &o).unwrap();
    let batched = run(&v4_config("deepseek_v4", 4, 24, 0), &o).unwrap();
    // V4's MTP block drafts through the same engine path (its hidden state is the 4 streams).
    let mtp = run(&v4_config("deepseek_v4", 4, 24, 2), &o).unwrap();
    assert!(mtp.summary.mtp.is_some());
    // `--kv-cache-dtype auto` keeps V4's cache in f32, the only dtype it has.
    assert_eq!(alone.summary.kv_cache_dtype, "f32");
    assert_eq!(alone.outputs.len(), 6);
    for ((a, b), c) in alone.outputs.iter().zip(&batched.outputs).zip(&mtp.outputs) {
        assert_eq!(a.tokens, c.tokens, "request {} with MTP", a.id);
        assert!(
            a.prompt.len() + a.tokens.len() > 128,
            "request {} stays in the window",
            a.id
        );
        assert_eq!(a.tokens, b.tokens, "request {}", a.id);
    }
}

#[test]
fn v4_model_name_must_match_the_checkpoint() {
    let tmp = tempfile::tempdir().unwrap();
    let mut o = opts(tmp.path(), None);
    o.chat_template = None;
    let err = run(&v4_config("deepseek_r1", 1, 4096, 0), &o)
        .err()
        .unwrap()
        .to_string();
    assert!(
        err.contains("model_config.model_name") && err.contains("deepseek_v4"),
        "{err}"
    );
    // Without a model_name the checkpoint's family runs.
    let mut unnamed = v4_config("deepseek_v4", 1, 4096, 0);
    unnamed.model_config.model_name = RunConfig::default().model_config.model_name;
    unnamed.data_config.num_requests = Some(1);
    unnamed.scheduler_config.max_new_tokens = 2;
    assert_eq!(run(&unnamed, &o).unwrap().outputs.len(), 1);
}

/// `force_eplb: true` (the seed's balanced-routing benchmark mode) runs, is recorded in the
/// summary, and really replaces the routing: the fixture's greedy outputs change, while a
/// second run gives the same outputs (the assignment is deterministic).
#[test]
fn force_eplb_replaces_the_routing_deterministically() {
    let tmp = tempfile::tempdir().unwrap();
    let data = root().join("dataset");
    let plain_cfg = config(4, 4096, &data);
    let mut eplb_cfg = plain_cfg.clone();
    eplb_cfg.model_config.force_eplb = true;
    let plain = run(&plain_cfg, &opts(tmp.path(), None)).unwrap();
    let eplb = run(&eplb_cfg, &opts(tmp.path(), None)).unwrap();
    let again = run(&eplb_cfg, &opts(tmp.path(), None)).unwrap();
    assert!(eplb.summary.force_eplb && !plain.summary.force_eplb);
    let changed = plain
        .outputs
        .iter()
        .zip(&eplb.outputs)
        .filter(|(a, b)| a.tokens != b.tokens)
        .count();
    assert!(changed > 0, "force_eplb left every output unchanged");
    for (a, b) in eplb.outputs.iter().zip(&again.outputs) {
        assert_eq!(a.tokens, b.tokens, "request {}", a.id);
    }
    let log = std::fs::read_to_string(eplb.dir.join("run.log")).unwrap();
    assert!(log.contains("force_eplb"), "{log}");

    // DeepSeek-V4 (hash-routed layers included) takes the same switch.
    let mut o = opts(tmp.path(), None);
    o.chat_template = None;
    let mut v4 = v4_config("deepseek_v4", 2, 4096, 0);
    v4.data_config.num_requests = Some(2);
    v4.scheduler_config.max_new_tokens = 8;
    let v4_plain = run(&v4, &o).unwrap();
    v4.model_config.force_eplb = true;
    let v4_eplb = run(&v4, &o).unwrap();
    assert!(v4_eplb.summary.force_eplb);
    assert!(
        v4_plain
            .outputs
            .iter()
            .zip(&v4_eplb.outputs)
            .any(|(a, b)| a.tokens != b.tokens),
        "force_eplb left V4's outputs unchanged"
    );
}

/// `with_ckpt: false` (the seed's dummy loader): random weights of the config's shapes, in the
/// format its quantization_config names (FP8 here; W8A8 with a C8 cache below), MTP layer
/// included; the run works, says so, and leaves no temporary checkpoint behind.
#[test]
fn with_ckpt_false_runs_random_weights_of_the_configs_shapes() {
    let tmp = tempfile::tempdir().unwrap();
    let data = root().join("dataset");
    let mut cfg = config(4, 4096, &data);
    cfg.data_config.num_requests = Some(4);
    cfg.model_config.next_n = 1;
    let real = run(&cfg, &opts(tmp.path(), None)).unwrap();
    cfg.model_config.with_ckpt = false;
    let dummy = run(&cfg, &opts(tmp.path(), None)).unwrap();
    assert!(!dummy.summary.with_ckpt && real.summary.with_ckpt);
    assert!(
        dummy.summary.mtp.is_some(),
        "the random checkpoint has the MTP layer"
    );
    assert!(
        real.outputs
            .iter()
            .zip(&dummy.outputs)
            .any(|(a, b)| a.tokens != b.tokens),
        "random weights gave the trained outputs"
    );
    let log = std::fs::read_to_string(dummy.dir.join("run.log")).unwrap();
    let line = log
        .lines()
        .find(|l| l.contains("with_ckpt: false"))
        .unwrap_or_else(|| panic!("{log}"));
    let dir = line
        .split(" in ")
        .nth(1)
        .unwrap()
        .split(' ')
        .next()
        .unwrap();
    assert!(!Path::new(dir).exists(), "{dir} left behind");

    // A W8A8C8 model directory (the converter's output): the random weights go through the
    // same conversion, C8 scales included.
    let conv = tmp.path().join("w8a8c8");
    cachalot_convert::convert(&cachalot_convert::ConvertOptions {
        input: root().join("fixtures/v3/r1_tiny"),
        output: conv.clone(),
        mode: cachalot_convert::QuantMode::W8A8C8,
        c8_scales: Some(root().join("fixtures/v3/converted/c8_scales_r1_tiny.json")),
        quant_param_path: None,
        force: false,
        progress: false,
    })
    .unwrap();
    let mut cfg = config(2, 4096, &data);
    cfg.data_config.num_requests = Some(2);
    cfg.model_config.model_path = conv.display().to_string();
    cfg.model_config.with_ckpt = false;
    let c8 = run(&cfg, &opts(tmp.path(), None)).unwrap();
    let log = std::fs::read_to_string(c8.dir.join("run.log")).unwrap();
    assert!(log.contains("random w8a8c8 weights"), "{log}");
    assert_eq!(c8.outputs.len(), 2);
    // A C8 cache is read quantized where a prompt's own rows are not: prefix caching stays off
    // under `auto` and is refused by name when asked for.
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(c8.dir.join("summary.json")).unwrap())
            .unwrap();
    assert!(summary["prefix_cache"].is_null(), "{summary}");
    // The latents are int8: said so, beside the rope keys' dtype.
    assert_eq!(summary["kv_cache_c8"], true, "{summary}");
    let mut on = opts(tmp.path(), None);
    on.prefix_caching = Some(true);
    let e = match run(&cfg, &on) {
        Ok(_) => panic!("prefix caching ran over a C8 cache"),
        Err(e) => e.to_string(),
    };
    assert!(e.contains("C8"), "{e}");
    // Under C8 a prompt's bits depend on where it is cut into chunks (its own rows are read
    // un-quantized, earlier chunks' as int8): every prompt is cut at the same places whatever
    // runs beside it, so a request's output does not depend on its batch.
    let by_batch = |batch: usize| {
        let mut c = cfg.clone();
        c.scheduler_config.batch_size = batch;
        c.scheduler_config.max_prefill_tokens = 7;
        c.data_config.num_requests = Some(6);
        let r = run(&c, &opts(tmp.path(), None)).unwrap();
        let mut out: Vec<(u64, Vec<u32>)> =
            r.outputs.iter().map(|o| (o.id, o.tokens.clone())).collect();
        out.sort();
        out
    };
    assert_eq!(by_batch(1), by_batch(4));

    // A Kimi-K2-Thinking-style directory (compressed-tensors pack-quantized int4 experts): the
    // random weights are written in that layout and loaded as such, not converted.
    let k2t = tmp.path().join("k2_thinking");
    std::fs::create_dir_all(&k2t).unwrap();
    let src = root().join("fixtures/v3/r1_tiny");
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(src.join(f), k2t.join(f)).unwrap();
    }
    let mut c: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    c["quantization_config"] = serde_json::json!({
        "quant_method": "compressed-tensors", "format": "pack-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": null,
            "weights": {"num_bits": 4, "type": "int", "symmetric": true, "strategy": "group",
                        "group_size": 32, "dynamic": false}}},
        "ignore": ["lm_head", "re:.*self_attn.*"]
    });
    std::fs::write(k2t.join("config.json"), c.to_string()).unwrap();
    let mut cfg = config(2, 4096, &data);
    cfg.data_config.num_requests = Some(2);
    cfg.model_config.model_path = k2t.display().to_string();
    cfg.model_config.with_ckpt = false;
    let int4 = run(&cfg, &opts(tmp.path(), None)).unwrap();
    let log = std::fs::read_to_string(int4.dir.join("run.log")).unwrap();
    assert!(log.contains("random w4a16 weights"), "{log}");
    assert_eq!(int4.outputs.len(), 2);
}

/// DeepSeek-V4 with `with_ckpt: false`: the seed's rule (force_eplb required) is enforced, and
/// with it the run works on random weights of the config's shapes (MTP block included).
#[test]
fn with_ckpt_false_on_v4_needs_force_eplb_and_runs() {
    let tmp = tempfile::tempdir().unwrap();
    let mut o = opts(tmp.path(), None);
    o.chat_template = None;
    let mut cfg = v4_config("deepseek_v4", 2, 4096, 1);
    cfg.data_config.num_requests = Some(2);
    cfg.scheduler_config.max_new_tokens = 8;
    cfg.model_config.with_ckpt = false;
    let err = run(&cfg, &o).err().unwrap().to_string();
    assert!(
        err.contains("with_ckpt: false") && err.contains("force_eplb: true"),
        "{err}"
    );
    cfg.model_config.force_eplb = true;
    let r = run(&cfg, &o).unwrap();
    assert!(!r.summary.with_ckpt && r.summary.force_eplb);
    assert!(r.summary.mtp.is_some());
    assert_eq!(r.outputs.len(), 2);
    let log = std::fs::read_to_string(r.dir.join("run.log")).unwrap();
    assert!(log.contains("random fp8 weights"), "{log}");
}

/// Data parallel over three ranks (a TCP group on threads of this process): rank 0's files hold
/// every request, each sampled (temperature 0.8, a seed) exactly as in a one-process run.
#[test]
fn data_parallel_ranks_give_the_one_process_outputs() {
    use cachalot_run::offline::run_ranked;

    let tmp = tempfile::tempdir().unwrap();
    let data = root().join("dataset");
    let yaml = format!(
        "model_config:\n  model_name: deepseek_r1\n  model_path: {}\n\
         data_config:\n  dataset: default\n  dataset_path: {}\n  input_truncated_len: 48\n  num_requests: 11\n\
         \x20 temperature: 0.8\n  seed: 7\n\
         scheduler_config:\n  block_size: 8\n  batch_size: 3\n  max_new_tokens: 10\n  max_prefill_tokens: 64\n",
        root().join("fixtures/v3/r1_tiny").display(),
        data.display(),
    );
    let cfg = RunConfig::from_yaml(&yaml, Path::new("test.yaml")).unwrap();
    let one = run(&cfg, &opts(tmp.path(), None)).unwrap();

    let n = 3;
    let res = tmp.path().to_path_buf();
    let (cfg0, res0) = (cfg.clone(), res.clone());
    let mut results = run_group(n, move |comm| {
        run_ranked(&cfg0, &opts(&res0, None), comm).unwrap()
    });
    let shares = results.split_off(1);
    let all = results.pop().unwrap();

    assert_eq!(all.summary.ranks, n);
    assert_eq!(all.outputs.len(), 11);
    for (a, b) in one.outputs.iter().zip(&all.outputs) {
        assert_eq!(a.id, b.id);
        assert_eq!(a.prompt, b.prompt, "request {}", a.id);
        assert_eq!(a.tokens, b.tokens, "request {}", a.id);
    }
    // Rank r served requests r, r + 3, ...; the per-rank figures add up to the run's.
    for (r, share) in shares.iter().enumerate() {
        let ids: Vec<u64> = share.outputs.iter().map(|o| o.id).collect();
        let want: Vec<u64> = (r as u64 + 1..11).step_by(n).collect();
        assert_eq!(ids, want, "rank {}", r + 1);
        assert_eq!(share.dir, all.dir);
    }
    let per = &all.summary.per_rank;
    assert_eq!(
        per.iter().map(|p| p.requests).collect::<Vec<_>>(),
        [4, 4, 3]
    );
    assert_eq!(
        per.iter().map(|p| p.output_tokens).sum::<usize>(),
        all.summary.output_tokens
    );
    assert_eq!(
        per.iter().map(|p| p.prompt_tokens).sum::<usize>(),
        one.summary.prompt_tokens
    );
    assert_eq!(all.summary.prompt_tokens, one.summary.prompt_tokens);
    // Rank 0 wrote the run's files; the others only their logs.
    let lines = std::fs::read_to_string(all.dir.join("requests.jsonl")).unwrap();
    assert_eq!(lines.lines().count(), 11);
    for f in ["run.log", "run.rank1.log", "run.rank2.log", "summary.json"] {
        assert!(all.dir.join(f).is_file(), "{f}");
    }
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(all.dir.join("summary.json")).unwrap())
            .unwrap();
    assert_eq!(summary["ranks"], 3);
    assert_eq!(summary["per_rank"].as_array().unwrap().len(), 3);
}

/// The YAML's batch_size is the batch over all ranks (the seed's): one that does not divide by
/// the ranks is an error on every rank, before any rank waits for another.
#[test]
fn a_global_batch_that_does_not_divide_by_the_ranks_is_named() {
    use cachalot_engine::comm::{TcpComm, TcpRendezvous};
    use cachalot_run::offline::run_ranked;
    use std::time::Duration;

    let tmp = tempfile::tempdir().unwrap();
    let cfg = config(3, 64, &root().join("dataset"));
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let master = listener.local_addr().unwrap().to_string();
    let res = tmp.path().to_path_buf();
    let (cfg1, res1) = (cfg.clone(), res.clone());
    let other = std::thread::spawn(move || {
        let comm = TcpComm::connect(&TcpRendezvous {
            rank: 1,
            world_size: 2,
            master,
            timeout: Duration::from_secs(30),
        })
        .unwrap();
        run_ranked(&cfg1, &opts(&res1, None), Arc::new(comm)).map(|_| ())
    });
    let comm = TcpComm::accept(listener, 2, Duration::from_secs(30)).unwrap();
    // Rank 0's sockets close (the Arc drops) before rank 1 is awaited: a regression fails,
    // never hangs.
    let mine = run_ranked(&cfg, &opts(&res, None), Arc::new(comm)).map(|_| ());
    for r in [mine, other.join().unwrap()] {
        let e = r.unwrap_err().to_string();
        assert!(e.contains("scheduler_config.batch_size 3"), "{e}");
    }
}

/// Expert parallel over two ranks (a TCP group on threads of this process): each rank holds
/// half of the routed experts, both run every request, and the outputs (sampled, temperature
/// 0.8, with MTP drafts) equal a one-process run's token for token.
#[test]
fn expert_parallel_ranks_give_the_one_process_outputs() {
    use cachalot_run::offline::run_ranked;

    let tmp = tempfile::tempdir().unwrap();
    let data = root().join("dataset");
    let yaml = format!(
        "model_config:\n  model_name: deepseek_r1\n  model_path: {}\n  next_n: 1\n\
         data_config:\n  dataset: default\n  dataset_path: {}\n  input_truncated_len: 48\n  num_requests: 7\n\
         \x20 temperature: 0.8\n  seed: 3\n\
         scheduler_config:\n  block_size: 8\n  batch_size: 4\n  max_new_tokens: 10\n  max_prefill_tokens: 40\n",
        root().join("fixtures/v3/r1_tiny").display(),
        data.display(),
    );
    let cfg = RunConfig::from_yaml(&yaml, Path::new("test.yaml")).unwrap();
    let one = run(&cfg, &opts(tmp.path(), None)).unwrap();

    let res = tmp.path().to_path_buf();
    let cfg0 = cfg.clone();
    let mut results = run_group(2, move |comm| {
        let o = RunOptions {
            parallel: Parallel::Expert,
            ..opts(&res, None)
        };
        run_ranked(&cfg0, &o, comm).unwrap()
    });
    let rank1 = results.pop().unwrap();
    let all = results.pop().unwrap();

    assert_eq!(all.summary.ranks, 2);
    for outs in [&all.outputs, &rank1.outputs] {
        assert_eq!(outs.len(), 7);
        for (a, b) in one.outputs.iter().zip(outs.iter()) {
            assert_eq!(a.id, b.id);
            assert_eq!(a.tokens, b.tokens, "request {}", a.id);
        }
    }
    assert_eq!(all.summary.output_tokens, one.summary.output_tokens);
    assert_eq!(all.summary.parallel, Parallel::Expert);
    let log = std::fs::read_to_string(all.dir.join("run.rank1.log")).unwrap();
    assert!(log.contains("expert parallel"), "{log}");
    assert!(log.contains("MB of weights held on this rank"), "{log}");
}

/// Expert-parallel ranks sampling without a seed still sample the same tokens (rank 0 draws the
/// seed for all): the ranks' outputs agree and the run completes.
#[test]
fn expert_parallel_sampling_without_a_seed_stays_in_step() {
    use cachalot_run::offline::run_ranked;

    let tmp = tempfile::tempdir().unwrap();
    let yaml = format!(
        "model_config:\n  model_name: deepseek_r1\n  model_path: {}\n\
         data_config:\n  dataset: default\n  dataset_path: {}\n  input_truncated_len: 48\n  num_requests: 5\n\
         \x20 temperature: 1.0\n\
         scheduler_config:\n  block_size: 8\n  batch_size: 3\n  max_new_tokens: 12\n",
        root().join("fixtures/v3/r1_tiny").display(),
        root().join("dataset").display(),
    );
    let cfg = RunConfig::from_yaml(&yaml, Path::new("test.yaml")).unwrap();
    let res = tmp.path().to_path_buf();
    let mut results = run_group(2, move |comm| {
        let o = RunOptions {
            parallel: Parallel::Expert,
            ..opts(&res, None)
        };
        run_ranked(&cfg, &o, comm).unwrap()
    });
    let rank1 = results.pop().unwrap();
    let all = results.pop().unwrap();
    assert_eq!(all.outputs.len(), 5);
    for (a, b) in all.outputs.iter().zip(&rank1.outputs) {
        assert_eq!(a.tokens, b.tokens, "request {}", a.id);
    }
}

/// `with_ckpt: false` under expert parallelism: each rank writes only its routed experts (the
/// values depend only on the tensor's name), and the outputs equal one process's on the whole
/// random checkpoint.
#[test]
fn expert_parallel_random_weights_hold_only_the_ranks_experts() {
    use cachalot_run::offline::run_ranked;

    let tmp = tempfile::tempdir().unwrap();
    let mut cfg = config(4, 64, &root().join("dataset"));
    cfg.data_config.num_requests = Some(4);
    cfg.model_config.with_ckpt = false;
    let one = run(&cfg, &opts(tmp.path(), None)).unwrap();
    let res = tmp.path().to_path_buf();
    let cfg0 = cfg.clone();
    let mut results = run_group(2, move |comm| {
        let o = RunOptions {
            parallel: Parallel::Expert,
            ..opts(&res, None)
        };
        run_ranked(&cfg0, &o, comm).unwrap()
    });
    let all = results.remove(0);
    for (a, b) in one.outputs.iter().zip(&all.outputs) {
        assert_eq!(a.tokens, b.tokens, "request {}", a.id);
    }
    let mb = |log: &str| -> f64 {
        let line = log
            .lines()
            .find(|l| l.contains("with_ckpt: false"))
            .unwrap_or_else(|| panic!("{log}"));
        let (_, rest) = line.split_once(" weights (").unwrap();
        rest.split(' ').next().unwrap().parse().unwrap()
    };
    let whole = mb(&std::fs::read_to_string(one.dir.join("run.log")).unwrap());
    let share = mb(&std::fs::read_to_string(all.dir.join("run.rank1.log")).unwrap());
    assert!(
        share < whole,
        "rank 1 wrote {share} MB, the whole model is {whole} MB"
    );
}

/// DeepSeek-V4 under expert parallelism (flash_tiny's 8 experts over 2 ranks, MTP drafts
/// included): the outputs of a one-process run.
#[test]
fn v4_expert_parallel_ranks_give_the_one_process_outputs() {
    use cachalot_run::offline::run_ranked;

    let tmp = tempfile::tempdir().unwrap();
    let mut o = opts(tmp.path(), None);
    o.chat_template = None;
    let mut cfg = v4_config("deepseek_v4", 4, 24, 1);
    cfg.scheduler_config.max_new_tokens = 20;
    let one = run(&cfg, &o).unwrap();
    let res = tmp.path().to_path_buf();
    let mut results = run_group(2, move |comm| {
        let mut o = RunOptions {
            parallel: Parallel::Expert,
            ..opts(&res, None)
        };
        o.chat_template = None;
        run_ranked(&cfg, &o, comm).unwrap()
    });
    let all = results.remove(0);
    assert_eq!(all.outputs.len(), 6);
    for (a, b) in one.outputs.iter().zip(&all.outputs) {
        assert_eq!(a.tokens, b.tokens, "request {}", a.id);
    }
}

/// Prompt and output stay within `max_position_embeddings` (vLLM's max_model_len): output stops
/// there with finish reason length, MTP drafts included; a prompt that fills it is an error.
#[test]
fn output_stops_at_the_models_last_position() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("short");
    std::fs::create_dir_all(&model).unwrap();
    let src = root().join("fixtures/v3/r1_tiny");
    for e in std::fs::read_dir(&src).unwrap() {
        let p = e.unwrap().path();
        std::fs::copy(&p, model.join(p.file_name().unwrap())).unwrap();
    }
    let p = model.join("config.json");
    let mut c: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    c["max_position_embeddings"] = 40.into();
    std::fs::write(&p, c.to_string()).unwrap();
    let data = root().join("dataset");
    for next_n in [0, 2] {
        let mut cfg = config(4, 4096, &data);
        cfg.model_config.model_path = model.display().to_string();
        cfg.model_config.next_n = next_n;
        cfg.data_config.num_requests = Some(4);
        cfg.data_config.input_truncated_len = 16;
        cfg.data_config.ignore_eos = true;
        cfg.scheduler_config.max_new_tokens = 100;
        let r = run(&cfg, &opts(tmp.path(), None)).unwrap();
        for o in &r.outputs {
            assert_eq!(o.prompt.len() + o.tokens.len(), 40, "next_n {next_n}");
        }
    }
    // Every templated default prompt is longer than 8 tokens: refused before any step.
    c["max_position_embeddings"] = 8.into();
    std::fs::write(&p, c.to_string()).unwrap();
    let mut cfg = config(1, 4096, &data);
    cfg.model_config.model_path = model.display().to_string();
    cfg.data_config.num_requests = Some(1);
    match run(&cfg, &opts(tmp.path(), None)) {
        Ok(_) => panic!("a prompt past max_position_embeddings ran"),
        Err(e) => assert!(e.to_string().contains("max_position_embeddings"), "{e}"),
    }
}

/// A missing dataset is named before anything is loaded or written: no results directory.
#[test]
fn a_missing_dataset_fails_before_the_run_directory() {
    let tmp = tempfile::tempdir().unwrap();
    let res = tmp.path().join("res");
    let mut cfg = config(2, 4096, &tmp.path().join("no-such-dataset"));
    cfg.data_config.dataset = "LongBench".into();
    match run(&cfg, &opts(&res, None)) {
        Ok(_) => panic!("a run without its dataset succeeded"),
        Err(e) => assert!(e.to_string().contains("LongBench"), "{e}"),
    }
    assert!(
        !res.exists() || std::fs::read_dir(&res).unwrap().next().is_none(),
        "a results directory was made"
    );
}

/// `model_config.dtype: float32` asks for the f32 cache when the CLI leaves it to `auto`; an
/// explicit choice wins over the YAML.
#[test]
fn the_yaml_dtype_picks_the_cache_dtype_under_auto() {
    let tmp = tempfile::tempdir().unwrap();
    let data = root().join("dataset");
    let mut cfg = config(2, 4096, &data);
    cfg.data_config.num_requests = Some(2);
    cfg.model_config.dtype = "float32".into();
    let r = run(&cfg, &opts(tmp.path(), None)).unwrap();
    assert_eq!(r.summary.kv_cache_dtype, "f32");
    let mut o = opts(tmp.path(), None);
    o.kv_cache_dtype = Some(cachalot_model::KvCacheDtype::Bf16);
    let r = run(&cfg, &o).unwrap();
    assert_eq!(r.summary.kv_cache_dtype, "bf16");
}

/// The seed's `custom_params.num_hidden_layers` (reduced-layer testing) runs only the first
/// layers: the outputs are those of the model loaded with that many layers.
#[test]
fn custom_params_num_hidden_layers_cuts_the_model() {
    let tmp = tempfile::tempdir().unwrap();
    let data = root().join("dataset");
    let mut cfg = config(2, 4096, &data);
    cfg.data_config.num_requests = Some(2);
    cfg.data_config.ignore_eos = true;
    cfg.model_config
        .custom_params
        .insert("num_hidden_layers".into(), 1.into());
    cfg.model_config
        .custom_params
        .insert("enable_mla_prolog".into(), true.into());
    let r = run(&cfg, &opts(tmp.path(), None)).unwrap();
    let mut m = cachalot_model::DeepseekV3::load(
        &root().join("fixtures/v3/r1_tiny"),
        cachalot_model::LoadOptions {
            max_layers: Some(1),
            ..Default::default()
        },
    )
    .unwrap();
    // The run's cache is the default (auto: bf16 for this family).
    m.set_kv_cache_dtype(cachalot_model::KvCacheDtype::Bf16);
    assert_eq!(m.config().num_hidden_layers, 1);
    for o in &r.outputs {
        let want = cachalot_model::eval::greedy(&m, &o.prompt, cfg.scheduler_config.max_new_tokens)
            .unwrap();
        assert_eq!(o.tokens, want);
    }
    let log = std::fs::read_to_string(r.dir.join("run.log")).unwrap();
    assert!(log.contains("only the first 1 decoder layers run"), "{log}");
    assert!(log.contains("custom_params.enable_mla_prolog"), "{log}");
    cfg.model_config
        .custom_params
        .insert("num_hidden_layers".into(), 0.into());
    match run(&cfg, &opts(tmp.path(), None)) {
        Ok(_) => panic!("num_hidden_layers 0 ran"),
        Err(e) => assert!(e.to_string().contains("num_hidden_layers"), "{e}"),
    }
}

/// A bare Jinja `--chat-template` gets the model's special tokens (`bos_token` here), as the
/// same template inside tokenizer_config.json would.
#[test]
fn a_jinja_chat_template_file_gets_the_special_tokens() {
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path().join("t.jinja");
    std::fs::write(
        &t,
        "{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}",
    )
    .unwrap();
    let mut cfg = config(1, 4096, &root().join("dataset"));
    cfg.data_config.num_requests = Some(1);
    let mut o = opts(tmp.path(), None);
    o.chat_template = Some(t);
    let r = run(&cfg, &o).unwrap();
    let bos = cachalot_model::DeepseekV3Config::from_dir(&root().join("fixtures/v3/r1_tiny"))
        .unwrap()
        .bos_token_id
        .unwrap();
    assert_eq!(r.outputs[0].prompt[0], bos);
}

/// Data-parallel ranks that loaded different checkpoints (paths may differ between hosts, so
/// the path is not compared) are stopped, naming what differs on every rank, instead of mixing
/// two models' outputs in one run.
#[test]
fn ranks_with_different_checkpoints_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let res = tmp.path().to_path_buf();
    let data = root().join("dataset");
    let results = run_group(2, move |comm| {
        let mut cfg = config(2, 4096, &data);
        cfg.data_config.num_requests = Some(2);
        if comm.rank() == 1 {
            cfg.model_config.model_path =
                root().join("fixtures/v3/kimi_tiny").display().to_string();
        }
        cachalot_run::offline::run_ranked(&cfg, &opts(&res, None), comm).map_err(|e| e.to_string())
    });
    // Both ranks, rank 0 included, say which rank refused and why.
    for r in &results {
        let e = r.as_ref().map(|_| ()).unwrap_err();
        assert!(e.contains("rank 1: the model's config.json differs"), "{e}");
    }
    // A YAML that differs names its key.
    let data = root().join("dataset");
    let res = tmp.path().to_path_buf();
    let results = run_group(2, move |comm| {
        let mut cfg = config(2, 4096, &data);
        cfg.data_config.num_requests = Some(2);
        if comm.rank() == 1 {
            cfg.scheduler_config.max_new_tokens += 1;
        }
        cachalot_run::offline::run_ranked(&cfg, &opts(&res, None), comm).map_err(|e| e.to_string())
    });
    for r in &results {
        let e = r.as_ref().map(|_| ()).unwrap_err();
        assert!(
            e.contains("rank 1: the YAML's scheduler_config.max_new_tokens"),
            "{e}"
        );
    }
}

/// A data-parallel rank whose peer died keeps its finished requests: they are written to
/// `requests.rank{r}.partial.jsonl` and the error says where (never lost work).
#[test]
fn a_rank_keeps_its_finished_requests_when_gathering_fails() {
    use cachalot_engine::comm::{CommError, CommResult, Communicator};
    /// Rank 0 of two whose peer answers every collective like rank 0 until the end-of-run
    /// gather of reports, where it is gone.
    struct PeerDiesAtTheEnd;
    impl Communicator for PeerDiesAtTheEnd {
        fn rank(&self) -> usize {
            0
        }
        fn world_size(&self) -> usize {
            2
        }
        fn all_gather(&self, mine: &[u8]) -> CommResult<Vec<Vec<u8>>> {
            if mine.starts_with(b"{\"outputs\"") {
                return Err(CommError("rank 1 closed the connection".into()));
            }
            Ok(vec![mine.to_vec(), mine.to_vec()])
        }
    }
    let tmp = tempfile::tempdir().unwrap();
    let mut cfg = config(2, 4096, &root().join("dataset"));
    cfg.data_config.num_requests = Some(4);
    let e = match cachalot_run::offline::run_ranked(
        &cfg,
        &opts(tmp.path(), None),
        Arc::new(PeerDiesAtTheEnd),
    ) {
        Ok(_) => panic!("the run succeeded without its peer"),
        Err(e) => e.to_string(),
    };
    assert!(
        e.contains("rank 1 closed the connection") && e.contains("partial"),
        "{e}"
    );
    let run_dir = std::fs::read_dir(tmp.path())
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path();
    let saved = std::fs::read_to_string(run_dir.join("requests.rank0.partial.jsonl")).unwrap();
    let ids: Vec<u64> = saved
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["id"]
                .as_u64()
                .unwrap()
        })
        .collect();
    assert_eq!(ids, [0, 2], "rank 0 serves requests 0 and 2");
}
