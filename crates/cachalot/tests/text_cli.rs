//! End-to-end tests of the text commands on the tiny R1-shaped fixture model.

use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Output, Stdio};

use cachalot_model::tokenizer::Tokenizer;
use serde_json::Value;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn r1_tiny() -> String {
    root().join("fixtures/v3/r1_tiny").display().to_string()
}

fn r1_template() -> String {
    root()
        .join("fixtures/text/r1_style/tokenizer_config.json")
        .display()
        .to_string()
}

/// `chat` on the R1 fixture with its template, `stdin` typed in: its standard output.
fn r1_chat(max_new_tokens: &str, json_out: bool, stdin: &str) -> String {
    let (model, template) = (r1_tiny(), r1_template());
    let mut args = vec![
        "chat",
        "--model",
        &model,
        "--chat-template",
        &template,
        "--max-new-tokens",
        max_new_tokens,
    ];
    if json_out {
        args.push("--json");
    }
    ok(cachalot(&args, Some(stdin)))
}

fn cachalot(args: &[&str], stdin: Option<&str>) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_cachalot"))
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    {
        let mut input = child.stdin.take().unwrap();
        if let Some(s) = stdin {
            input.write_all(s.as_bytes()).unwrap();
        }
    }
    child.wait_with_output().unwrap()
}

fn ok(out: Output) -> String {
    assert!(
        out.status.success(),
        "failed: {}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

fn json(s: &str) -> Value {
    serde_json::from_str(s.trim()).unwrap_or_else(|e| panic!("{e}: {s}"))
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

#[test]
fn tokenize_encodes_and_decodes() {
    let text = "The sperm whale 🐋 dives, 123 metres.";
    let out = ok(cachalot(
        &["tokenize", "--model", &r1_tiny(), "--text", text, "--json"],
        None,
    ));
    let got = ids(&json(&out)["ids"]);
    let tok = Tokenizer::from_dir(&root().join("fixtures/v3/r1_tiny")).unwrap();
    assert_eq!(got, tok.encode(text).unwrap());
    let list: Vec<String> = got.iter().map(u32::to_string).collect();
    let plain = ok(cachalot(
        &["tokenize", "--model", &r1_tiny(), "--text", text],
        None,
    ));
    assert_eq!(plain.trim_end(), list.join(","));
    let back = ok(cachalot(
        &[
            "tokenize",
            "--model",
            &r1_tiny(),
            "--decode",
            &list.join(","),
        ],
        None,
    ));
    assert_eq!(back, format!("{text}\n"));
    // An empty list is empty text; a word that is not an id is named.
    let empty = ok(cachalot(
        &["tokenize", "--model", &r1_tiny(), "--decode", ""],
        None,
    ));
    assert_eq!(empty, "\n");
    let out = cachalot(
        &["tokenize", "--model", &r1_tiny(), "--decode", "5,x"],
        None,
    );
    assert!(String::from_utf8_lossy(&out.stderr).contains("\"x\" is not a token id"));
}

#[test]
fn tokenize_reads_a_tiktoken_model() {
    let dir = root()
        .join("fixtures/text/kimi_style")
        .display()
        .to_string();
    let out = ok(cachalot(
        &[
            "tokenize",
            "--model",
            &dir,
            "--text",
            "<|im_user|>hi",
            "--json",
        ],
        None,
    ));
    let got = ids(&json(&out)["ids"]);
    let tok = Tokenizer::from_dir(&root().join("fixtures/text/kimi_style")).unwrap();
    assert_eq!(got[0], tok.token_to_id("<|im_user|>").unwrap());
    assert_eq!(got, tok.encode("<|im_user|>hi").unwrap());
}

#[test]
fn generate_streams_the_same_text_as_the_json_decode() {
    let base = [
        "generate",
        "--model",
        &r1_tiny(),
        "--prompt",
        "The sperm whale",
        "--max-new-tokens",
        "24",
        "--temperature",
        "0.9",
        "--top-p",
        "0.95",
        "--seed",
        "11",
    ];
    let streamed = ok(cachalot(&base, None));
    let mut with_json = base.to_vec();
    with_json.push("--json");
    let j = json(&ok(cachalot(&with_json, None)));
    let text = j["text"].as_str().unwrap();
    // (Into a pipe, the text alone: no newline after it.)
    assert_eq!(streamed, text);
    // The text is the decode of the generated ids (less a final stop token).
    let tok = Tokenizer::from_dir(&root().join("fixtures/v3/r1_tiny")).unwrap();
    let mut out = ids(&j["output_ids"]);
    if j["finish_reason"] == "stop" {
        out.pop();
    }
    assert_eq!(tok.decode(&out).unwrap(), text);
    // Same seed, same output; the tokens/s line goes to stderr.
    let again = cachalot(&base, None);
    assert!(String::from_utf8_lossy(&again.stderr).contains("tokens/s"));
    assert_eq!(ok(again), streamed);
}

/// `generate --chat --json` gives the reasoning apart, as serve's `reasoning_content` (the
/// shipped model's template opens `<think>`).
#[test]
fn chat_json_keeps_the_reasoning() {
    let j = json(&ok(cachalot(
        &[
            "generate",
            "--chat",
            "--prompt",
            "Hi",
            "--max-new-tokens",
            "12",
            "--json",
        ],
        None,
    )));
    let text = j["text"].as_str().unwrap();
    let want = text.split("</think>").next().unwrap();
    assert_eq!(j["reasoning_content"].as_str(), Some(want), "{j}");
}

#[test]
fn greedy_generate_matches_the_library_and_max_tokens_still_works() {
    let out = json(&ok(cachalot(
        &[
            "generate",
            "--model",
            &r1_tiny(),
            "--token-ids",
            "5,6,7,8",
            "--max-tokens",
            "6",
            "--ignore-eos",
            "--json",
        ],
        None,
    )));
    let mut m = cachalot_model::DeepseekV3::load(
        &root().join("fixtures/v3/r1_tiny"),
        cachalot_model::LoadOptions::default(),
    )
    .unwrap();
    // The CLI's default cache (`--kv-cache-dtype auto`) is bf16 for this family.
    m.set_kv_cache_dtype(cachalot_model::KvCacheDtype::Bf16);
    let want = cachalot_model::eval::greedy(&m, &[5, 6, 7, 8], 6).unwrap();
    assert_eq!(ids(&out["output_ids"]), want);
}

#[test]
fn chat_keeps_history_and_obeys_commands_on_stdin() {
    let out = r1_chat(
        "6",
        true,
        "hello\n/systematic typo\n/system\tBe brief.\n/sytem typo\nsecond question\n/reset\n//third\n/exit\nnever read\n",
    );
    let turns: Vec<Value> = out.lines().map(json).collect();
    assert_eq!(turns.len(), 3, "{out}");
    let p: Vec<&str> = turns
        .iter()
        .map(|t| t["prompt"].as_str().unwrap())
        .collect();
    assert_eq!(
        p[0],
        "<｜begin▁of▁sentence｜><｜User｜>hello<｜Assistant｜><think>\n"
    );
    let first_answer = turns[0]["text"].as_str().unwrap();
    assert!(p[1].starts_with("<｜begin▁of▁sentence｜>Be brief.<｜User｜>hello<｜Assistant｜>"));
    // An answer still in its reasoning keeps none of it in the history (a vLLM client's
    // content is null there); a finished one keeps its answer.
    match first_answer.split_once("</think>") {
        Some((_, answer)) => assert!(p[1].contains(answer.trim()), "{}", p[1]),
        None => assert!(
            p[1].contains("<｜User｜>hello<｜Assistant｜><｜end▁of▁sentence｜>"),
            "{}",
            p[1]
        ),
    }
    assert!(p[1].ends_with("<｜User｜>second question<｜Assistant｜><think>\n"));
    // (`/system` takes its text after any whitespace, a tab here.) Unknown commands
    // (/systematic, /sytem) are refused, not sent; "//" escapes a leading "/".
    assert_eq!(
        p[2],
        "<｜begin▁of▁sentence｜>Be brief.<｜User｜>/third<｜Assistant｜><think>\n"
    );
    // Plain text mode prints one answer per line.
    let text = r1_chat("4", false, "a\nb\n");
    assert!(text.ends_with('\n'));
}

#[test]
fn generate_chat_renders_the_template() {
    let out = json(&ok(cachalot(
        &[
            "generate",
            "--model",
            &r1_tiny(),
            "--chat",
            "--system",
            "Sys",
            "--prompt",
            "Hi",
            "--chat-template",
            &r1_template(),
            "--max-new-tokens",
            "3",
            "--json",
        ],
        None,
    )));
    let tok = Tokenizer::from_dir(&root().join("fixtures/v3/r1_tiny")).unwrap();
    let want = tok
        .encode("<｜begin▁of▁sentence｜>Sys<｜User｜>Hi<｜Assistant｜><think>\n")
        .unwrap();
    assert_eq!(ids(&out["prompt_ids"]), want);
}

#[test]
fn without_a_model_the_commands_use_the_shipped_small_model() {
    let out = cachalot(
        &[
            "perplexity",
            "--prompt",
            "The best way to be happy is to be",
            "--json",
        ],
        None,
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(v["ppl"].as_f64().unwrap() > 1.0);
    let out = cachalot(
        &["generate", "--prompt", "Love is", "--max-new-tokens", "8"],
        None,
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!String::from_utf8_lossy(&out.stdout).trim().is_empty());
}

#[test]
fn a_missing_chat_template_is_named() {
    let out = cachalot(
        &[
            "generate",
            "--model",
            &r1_tiny(),
            "--chat",
            "--prompt",
            "hi",
        ],
        None,
    );
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("chat_template") && err.contains("--chat-template"),
        "{err}"
    );
}

/// `generate --mtp N` (speculative decoding through the engine) gives the same greedy tokens
/// and text as plain `generate`, on the shipped small model (which has an MTP layer); the same
/// text streams as in `--json`; `chat --mtp` answers as plain `chat`; a model without an MTP
/// layer is refused by name.
#[test]
fn generate_with_mtp_equals_plain_greedy() {
    let base = [
        "generate",
        "--prompt",
        "The best way to",
        "--max-new-tokens",
        "40",
    ];
    let plain = json(&ok(cachalot(&[&base[..], &["--json"]].concat(), None)));
    for n in ["1", "3"] {
        let spec = json(&ok(cachalot(
            &[&base[..], &["--json", "--mtp", n]].concat(),
            None,
        )));
        assert_eq!(
            ids(&plain["output_ids"]),
            ids(&spec["output_ids"]),
            "--mtp {n}"
        );
        assert_eq!(plain["text"], spec["text"], "--mtp {n}");
        let streamed = ok(cachalot(&[&base[..], &["--mtp", n]].concat(), None));
        assert_eq!(
            streamed.trim_end(),
            spec["text"].as_str().unwrap().trim_end(),
            "--mtp {n}"
        );
    }
    let chat = |extra: &[&str]| {
        let args = [&["chat", "--max-new-tokens", "20", "--json"][..], extra].concat();
        json(&ok(cachalot(&args, Some("Hello there\n/exit\n"))))
    };
    assert_eq!(chat(&[]), chat(&["--mtp", "2"]), "chat --mtp 2");
    let out = cachalot(
        &[
            "generate",
            "--model",
            &root().join("fixtures/v3/kimi_tiny").display().to_string(),
            "--token-ids",
            "5,6",
            "--mtp",
            "1",
        ],
        None,
    );
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("no MTP layer"), "{err}");
}

/// A DeepSeek-V4 directory is recognised from its config.json: `generate` reproduces the
/// reference greedy continuation and `perplexity` the reference NLL of the text.
#[test]
fn v4_model_directories_run_generate_and_perplexity() {
    let dir = root().join("fixtures/v4/flash_tiny");
    let r: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap())
            .unwrap();
    let d = dir.display().to_string();
    let out = json(&ok(cachalot(
        &[
            "generate",
            "--model",
            &d,
            "--token-ids",
            "0",
            "--max-new-tokens",
            "32",
            "--temperature",
            "0",
            "--ignore-eos",
            "--json",
        ],
        None,
    )));
    assert_eq!(
        ids(&out["output_ids"]),
        ids(&r["greedy"][0]["continuation"])
    );
    let text = root().join("fixtures/v4/text.txt").display().to_string();
    let out = json(&ok(cachalot(
        &["perplexity", "--model", &d, "--file", &text, "--json"],
        None,
    )));
    let nll = out["nll"].as_f64().unwrap();
    let want = r["text"]["nll"].as_f64().unwrap();
    assert!((nll - want).abs() < 1e-4, "nll {nll} vs {want}");
    // chat renders with V4's encoder (chat mode: the prompt ends in `<｜Assistant｜></think>`).
    let out = json(&ok(cachalot(
        &[
            "chat",
            "--model",
            &d,
            "--max-new-tokens",
            "6",
            "--ignore-eos",
            "--json",
        ],
        Some("Hi\n"),
    )));
    let prompt = out["prompt"].as_str().unwrap();
    assert!(
        prompt.ends_with("<｜User｜>Hi<｜Assistant｜></think>"),
        "{prompt}"
    );
    assert_eq!(ids(&out["output_ids"]).len(), 6);
}

/// `--kv-cache-dtype bf16`: `run` records it and its cache takes half the bytes for the same
/// blocks; on a V4 directory too (whose default is f32), which also takes fp8.
#[test]
fn kv_cache_dtype_bf16_halves_the_cache() {
    let tmp = tempfile::tempdir().unwrap();
    let res = tmp.path().display().to_string();
    // `run --config CONFIG` from the repository root; its summary.json.
    let run_config = |config: &str, dtype: &str| {
        let out = Command::new(env!("CARGO_BIN_EXE_cachalot"))
            .args([
                "run",
                "--config",
                config,
                "--num-requests",
                "4",
                "--kv-blocks",
                "40",
                "--res-dir",
                &res,
                "--json",
                "--quiet",
                "--kv-cache-dtype",
                dtype,
            ])
            .current_dir(root())
            .output()
            .unwrap();
        json(&ok(out))
    };
    let run = |dtype: &str| run_config("configs/tiny/r1_tiny.yaml", dtype);
    let run_v4 = |dtype: &str| run_config("configs/tiny/v4_flash_tiny.yaml", dtype);
    let (a, b, auto) = (run("f32"), run("bf16"), run("auto"));
    assert_eq!(a["kv_cache_dtype"], "f32");
    assert_eq!(b["kv_cache_dtype"], "bf16");
    // The default, auto, is the seed's 16-bit cache for this family.
    assert_eq!(auto["kv_cache_dtype"], "bf16");
    assert_eq!(auto["output_tokens"], b["output_tokens"]);
    assert_eq!(a["kv_capacity_blocks"], b["kv_capacity_blocks"]);
    assert_eq!(
        a["kv_cache_bytes"].as_u64().unwrap(),
        2 * b["kv_cache_bytes"].as_u64().unwrap()
    );
    assert_eq!(b["output_tokens"], a["output_tokens"]);

    // bench reports it, with the cache's bytes.
    let bench = |model: &str, dtype: &str| {
        json(&ok(cachalot(
            &[
                "bench",
                "--model",
                model,
                "--prompt-len",
                "8",
                "--gen-len",
                "4",
                "--membw-mib",
                "16",
                "--membw-passes",
                "1",
                "--json",
                "--kv-cache-dtype",
                dtype,
            ],
            None,
        )))
    };
    let (a, b) = (bench(&r1_tiny(), "f32"), bench(&r1_tiny(), "bf16"));
    assert_eq!(a["kv_cache_dtype"], "f32");
    assert_eq!(b["kv_cache_dtype"], "bf16");
    assert_eq!(
        a["kv_cache_bytes"].as_u64().unwrap(),
        2 * b["kv_cache_bytes"].as_u64().unwrap()
    );

    // DeepSeek-V4: f32 by default (exact against its reference), bf16 when asked: half the
    // bytes, and generate runs with it.
    let d = root().join("fixtures/v4/flash_tiny").display().to_string();
    let generate = |dtype: &str| {
        let args = ["generate", "--model", &d, "--token-ids", "0"];
        ok(cachalot(
            &[&args[..], &["--kv-cache-dtype", dtype]].concat(),
            None,
        ))
    };
    generate("bf16");
    let (auto, half) = (bench(&d, "auto"), bench(&d, "bf16"));
    assert_eq!(auto["kv_cache_dtype"], "f32");
    assert_eq!(half["kv_cache_dtype"], "bf16");
    assert_eq!(
        auto["kv_cache_bytes"].as_u64().unwrap(),
        2 * half["kv_cache_bytes"].as_u64().unwrap()
    );

    // fp8 (V4's compact cache only): entries in e4m3, the rings as bf16's; generate and an
    // offline run take it. The V3 family and V4's full layout refuse it, saying what to use.
    let eighth = bench(&d, "fp8");
    assert_eq!(eighth["kv_cache_dtype"], "fp8");
    assert!(
        eighth["kv_cache_bytes"].as_u64().unwrap() < half["kv_cache_bytes"].as_u64().unwrap(),
        "{eighth}"
    );
    generate("fp8");
    let r = run_v4("fp8");
    assert_eq!(r["kv_cache_dtype"], "fp8");
    assert!(r["output_tokens"].as_u64().unwrap() > 0, "{r}");
    // The seed's Ascend 950 keeps V4's cache in fp8: so does `auto` for a YAML naming it.
    let yaml = std::fs::read_to_string(root().join("configs/tiny/v4_flash_tiny.yaml")).unwrap();
    let on_950 = tmp.path().join("v4_950.yaml");
    let model_path = root().join("fixtures/v4/flash_tiny").display().to_string();
    std::fs::write(
        &on_950,
        yaml.replace(
            "  model_path: \"fixtures/v4/flash_tiny\"",
            &format!("  model_path: {model_path:?}\n  platform_version: \"950\""),
        ),
    )
    .unwrap();
    assert_eq!(
        run_config(on_950.to_str().unwrap(), "auto")["kv_cache_dtype"],
        "fp8"
    );
    let refused = |args: &[&str], want: &str| {
        let out = Command::new(env!("CARGO_BIN_EXE_cachalot"))
            .args(args)
            .current_dir(root())
            .output()
            .unwrap();
        let e = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && e.contains(want), "{args:?}: {e}");
    };
    refused(
        &[
            "generate",
            "--model",
            &r1_tiny(),
            "--token-ids",
            "0",
            "--kv-cache-dtype",
            "fp8",
        ],
        "--quant-mode w8a8c8",
    );
    refused(
        &[
            "run",
            "--config",
            "configs/tiny/r1_tiny.yaml",
            "--num-requests",
            "1",
            "--res-dir",
            &res,
            "--quiet",
            "--kv-cache-dtype",
            "fp8",
        ],
        "is DeepSeek-V4's cache",
    );
    refused(
        &[
            "generate",
            "--model",
            &d,
            "--token-ids",
            "0",
            "--kv-cache-dtype",
            "fp8",
            "--v4-cache",
            "full",
        ],
        "--v4-cache compact",
    );
}

/// `run --profile` writes every phase of the V3 forward it ran to profile.json, nested within
/// the steps' time, and prints the table; `bench --profile` reports the decode steps' phases.
#[test]
fn run_and_bench_profile_the_phases_of_their_steps() {
    let tmp = tempfile::tempdir().unwrap();
    let res = tmp.path().display().to_string();
    let args = [
        "run",
        "--config",
        "configs/tiny/r1_tiny.yaml",
        "--num-requests",
        "4",
        "--res-dir",
        &res,
        "--json",
        "--quiet",
        "--profile",
    ];
    let in_root = |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_cachalot"))
            .args(args)
            .current_dir(root())
            .output()
            .unwrap()
    };
    let out = in_root(&args);
    let table = String::from_utf8_lossy(&out.stderr).to_string();
    let summary = json(&ok(out));
    let dir = PathBuf::from(&res).join(summary["run_id"].as_str().unwrap());
    let prof = json(&std::fs::read_to_string(dir.join("profile.json")).unwrap());
    let secs = |name: &str| -> f64 {
        prof.as_array()
            .unwrap()
            .iter()
            .find(|t| t["phase"] == name)
            .unwrap_or_else(|| panic!("no {name} in {prof}"))["seconds"]
            .as_f64()
            .unwrap()
    };
    let step = secs("step");
    let inner: f64 = [
        "embed",
        "attn_proj",
        "attn_latents",
        "attn_absorb_uk",
        "attn_core",
        "attn_uv",
        "attn_out",
        "dense_mlp",
        "moe",
        "head",
    ]
    .iter()
    .map(|p| secs(p))
    .sum();
    assert!(
        inner > 0.0 && inner <= step,
        "phases {inner} s within steps {step} s"
    );
    assert!(table.contains("(step, rest)"), "{table}");
    // Without --profile nothing is written.
    let mut plain: Vec<&str> = args.to_vec();
    plain.pop();
    let summary = json(&ok(in_root(&plain)));
    let dir = PathBuf::from(&res).join(summary["run_id"].as_str().unwrap());
    assert!(!dir.join("profile.json").exists());

    let bench = json(&ok(cachalot(
        &[
            "bench",
            "--model",
            &r1_tiny(),
            "--prompt-len",
            "8",
            "--gen-len",
            "4",
            "--batch",
            "2",
            "--membw-mib",
            "8",
            "--membw-passes",
            "1",
            "--profile",
            "--json",
        ],
        None,
    )));
    for key in ["decode_profile", "batch_decode_profile"] {
        let phases = bench[key]
            .as_array()
            .unwrap_or_else(|| panic!("{key}: {bench}"));
        let step = phases.iter().find(|t| t["phase"] == "step").unwrap();
        assert_eq!(step["calls"], 4, "{key}");
        assert!(phases.iter().any(|t| t["phase"] == "moe"), "{key}");
    }
    // A DeepSeek-V4 directory: its attention, MoE and head, decode steps only.
    let v4 = root().join("fixtures/v4/flash_tiny").display().to_string();
    let bench = json(&ok(cachalot(
        &[
            "bench",
            "--model",
            &v4,
            "--prompt-len",
            "8",
            "--gen-len",
            "3",
            "--batch",
            "3",
            "--profile",
            "--json",
        ],
        None,
    )));
    // Three sequences decoded together (each in its own state slot of the compact cache).
    assert_eq!(bench["batch"], 3, "{bench}");
    assert!(
        bench["batch_decode_tok_s"].as_f64().unwrap() > 0.0,
        "{bench}"
    );
    let phases = bench["decode_profile"].as_array().unwrap();
    let calls = |name: &str| {
        phases
            .iter()
            .find(|t| t["phase"] == name)
            .unwrap_or_else(|| panic!("no {name}: {bench}"))["calls"]
            .as_u64()
            .unwrap()
    };
    assert_eq!(calls("step"), 3);
    assert_eq!(calls("head"), 3);
    assert!(calls("attention_v4") >= 3 && calls("moe") >= 3);
}

/// `cachalot run --ranks 2` starts a second process, and rank 0's files hold every request with
/// the one-process outputs: data, expert, tensor, tensor-expert and data-expert parallel.
/// `--ranks 2 --parallel LAYOUT` and `rest`.
fn two_ranks<'a>(layout: &'a str, rest: &[&'a str]) -> Vec<&'a str> {
    [&["--ranks", "2", "--parallel", layout][..], rest].concat()
}

#[test]
fn run_with_two_ranks_equals_one_process() {
    let tmp = tempfile::tempdir().unwrap();
    let res = tmp.path().display().to_string();
    // A run of `config` with `extra` options: its summary and stderr.
    let run_raw = |config: &str, extra: &[&str]| -> (Value, String) {
        let mut args = vec![
            "run",
            "--config",
            config,
            "--num-requests",
            "5",
            "--res-dir",
            &res,
            "--json",
            "--quiet",
        ];
        args.extend_from_slice(extra);
        let out = Command::new(env!("CARGO_BIN_EXE_cachalot"))
            .args(&args)
            .current_dir(root())
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr).into_owned();
        (json(&ok(out)), err)
    };
    // Its summary and requests.
    // Every run: no request's time from arrival to its end is longer than the run (the ranks'
    // wait for each other before the clock starts is nobody's queueing), and the partial file
    // of finished requests is gone once requests.jsonl is written.
    let run_config = |config: &str, extra: &[&str]| -> (Value, Vec<Value>) {
        let summary = run_raw(config, extra).0;
        let dir = PathBuf::from(&res).join(summary["run_id"].as_str().unwrap());
        let reqs: Vec<Value> = std::fs::read_to_string(dir.join("requests.jsonl"))
            .unwrap()
            .lines()
            .map(json)
            .collect();
        let wall = summary["wall_s"].as_f64().unwrap();
        for r in &reqs {
            let e2e = r["timing"]["e2e_s"].as_f64().unwrap();
            assert!(
                e2e <= wall,
                "{extra:?}: e2e {e2e} s past the run's {wall} s"
            );
        }
        let left: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.contains("partial"))
            .collect();
        assert!(
            left.is_empty(),
            "{extra:?}: {left:?} left in {}",
            dir.display()
        );
        (summary, reqs)
    };
    let run = |extra: &[&str]| run_config("configs/tiny/r1_tiny.yaml", extra);
    let (s1, one) = run(&[]);
    // Data parallel over TCP (`--transport tcp`); expert and tensor below over shared memory.
    let (s2, two) = run(&["--ranks", "2", "--transport", "tcp"]);
    assert_eq!(s1["ranks"], 1);
    assert_eq!(s2["ranks"], 2);
    assert_eq!(
        (&s1["transport"], &s2["transport"]),
        (&"none".into(), &"tcp".into())
    );
    assert_eq!(s2["per_rank"][0]["requests"], 3);
    assert_eq!(s2["per_rank"][1]["requests"], 2);
    assert_eq!(one.len(), 5);
    assert_eq!(two.len(), 5);
    for (a, b) in one.iter().zip(&two) {
        assert_eq!(a["id"], b["id"]);
        assert_eq!(ids(&a["output_ids"]), ids(&b["output_ids"]));
    }
    // Expert parallel: both ranks run every request, each with half of the routed experts.
    let (s3, three) = run(&["--ranks", "2", "--parallel", "expert"]);
    assert_eq!(s3["ranks"], 2);
    assert_eq!(three.len(), 5);
    for (a, b) in one.iter().zip(&three) {
        assert_eq!(a["id"], b["id"]);
        assert_eq!(ids(&a["output_ids"]), ids(&b["output_ids"]));
    }
    // Tensor parallel: both ranks run every request, each with half of every layer's heads
    // and intermediate features; the one-process outputs (only the order of the partial sums'
    // final addition differs).
    let (s4, four) = run(&["--ranks", "2", "--parallel", "tensor"]);
    assert_eq!(s4["ranks"], 2);
    assert_eq!(s4["parallel"], "tensor");
    assert_eq!(four.len(), 5);
    for (a, b) in one.iter().zip(&four) {
        assert_eq!(a["id"], b["id"]);
        assert_eq!(ids(&a["output_ids"]), ids(&b["output_ids"]));
    }
    // Tensor parallel with the routed experts split whole (tensor-expert).
    let (s5, five) = run(&["--ranks", "2", "--parallel", "tensor-expert"]);
    assert_eq!(s5["parallel"], "tensor-expert");
    for (a, b) in one.iter().zip(&five) {
        assert_eq!(ids(&a["output_ids"]), ids(&b["output_ids"]));
    }
    // Data parallel with the routed experts split (data-expert): each rank runs its own
    // requests (3 and 2: rank 1 serves rank 0's MoE tokens after its own are done).
    let (s6, six) = run(&["--ranks", "2", "--parallel", "data-expert"]);
    assert_eq!(s6["parallel"], "data-expert");
    assert_eq!(s6["per_rank"][0]["requests"], 3);
    assert_eq!(s6["per_rank"][1]["requests"], 2);
    for (a, b) in one.iter().zip(&six) {
        assert_eq!(a["id"], b["id"]);
        assert_eq!(ids(&a["output_ids"]), ids(&b["output_ids"]));
    }
    // Every layout routes the same tokens to the same experts: summary.json's expert_load
    // (data-parallel ranks' counts summed on rank 0), with the balancedness of the layout's
    // expert-parallel ranks.
    let load = &s1["expert_load"];
    assert!(load["tokens"]["1"].as_array().unwrap().len() > 1, "{load}");
    for (s, ep) in [(&s2, 1), (&s3, 2), (&s4, 1), (&s5, 2), (&s6, 2)] {
        assert_eq!(
            s["expert_load"]["tokens"], load["tokens"],
            "{}",
            s["parallel"]
        );
        assert_eq!(s["expert_load"]["ep_ranks"], ep, "{}", s["parallel"]);
    }
    let bal = s6["expert_load"]["balancedness_min"].as_f64().unwrap();
    assert!((0.5..=1.0).contains(&bal), "{bal}");
    assert_eq!(load["balancedness_mean"], 1.0);
    // Expert load balancing: the experts placed by the one-process run's loads give the same
    // outputs, at least as evenly spread.
    let loads = tmp.path().join("loads.json");
    std::fs::write(&loads, s1.to_string()).unwrap();
    let loads = loads.to_str().unwrap();
    for layout in ["data-expert", "expert"] {
        let (sp, placed) = run(&[
            "--ranks",
            "2",
            "--parallel",
            layout,
            "--expert-placement",
            loads,
        ]);
        for (a, b) in one.iter().zip(&placed) {
            assert_eq!(ids(&a["output_ids"]), ids(&b["output_ids"]), "{layout}");
        }
        assert_eq!(sp["expert_load"]["tokens"], load["tokens"]);
        let placed_bal = sp["expert_load"]["balancedness_min"].as_f64().unwrap();
        assert!(placed_bal >= bal, "{layout}: {placed_bal} against {bal}");
    }
    // A placement naming a layer the model does not route is noted in the log.
    let mut odd = s1.clone();
    let first = odd["expert_load"]["tokens"]["1"].clone();
    odd["expert_load"]["tokens"]["99"] = first;
    let odd_file = tmp.path().join("odd.json");
    std::fs::write(&odd_file, odd.to_string()).unwrap();
    let (so, _) = run(&two_ranks(
        "data-expert",
        &["--expert-placement", odd_file.to_str().unwrap()],
    ));
    let log = std::fs::read_to_string(
        PathBuf::from(&res)
            .join(so["run_id"].as_str().unwrap())
            .join("run.log"),
    )
    .unwrap();
    assert!(log.contains("places layers [99]"), "{log}");
    // Redundant copies of the busiest experts (data-expert): the same outputs, the copies
    // recorded, and the balance that of the tokens each rank computed.
    let (sr, redundant) = run(&two_ranks(
        "data-expert",
        &["--expert-placement", loads, "--redundant-experts", "2"],
    ));
    for (a, b) in one.iter().zip(&redundant) {
        assert_eq!(ids(&a["output_ids"]), ids(&b["output_ids"]));
    }
    assert_eq!(sr["expert_load"]["redundant_experts"], 2);
    assert_eq!(sr["expert_load"]["tokens"], load["tokens"]);
    let bal_r = sr["expert_load"]["balancedness_min"].as_f64().unwrap();
    assert!((0.5..=1.0).contains(&bal_r), "{bal_r}");
    // Ranks given different placements are refused before any step, each naming it.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let master = format!("127.0.0.1:{port}");
    let rank = |r: &str, extra: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_cachalot"))
            .args(["run", "--config", "configs/tiny/r1_tiny.yaml"])
            .args(["--num-requests", "2", "--res-dir", &res, "--quiet"])
            .args(["--rank", r, "--world-size", "2", "--master", &master])
            .args(["--parallel", "data-expert", "--threads", "1"])
            .args(extra)
            .current_dir(root())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap()
    };
    let ranks = [rank("0", &["--expert-placement", loads]), rank("1", &[])];
    for r in ranks {
        let out = r.wait_with_output().unwrap();
        let e = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && e.contains("rank 1: the expert placement"),
            "{e}"
        );
    }
    // Without expert-parallel ranks, or from a file without loads, it is refused by name.
    let refused = |extra: &[&str], want: &str| {
        let out = Command::new(env!("CARGO_BIN_EXE_cachalot"))
            .args([
                "run",
                "--config",
                "configs/tiny/r1_tiny.yaml",
                "--num-requests",
                "1",
            ])
            .args(["--res-dir", &res, "--quiet"])
            .args(extra)
            .current_dir(root())
            .output()
            .unwrap();
        let e = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && e.contains(want), "{extra:?}: {e}");
    };
    refused(&["--expert-placement", loads], "expert-parallel ranks");
    let config = root().join("configs/tiny/r1_tiny.yaml");
    let config = config.to_str().unwrap();
    refused(
        &[
            "--ranks",
            "2",
            "--parallel",
            "expert",
            "--expert-placement",
            config,
        ],
        "--expert-placement",
    );
    // Copies serve dispatched tokens only, need the loads, and must fill the ranks evenly.
    refused(
        &two_ranks(
            "expert",
            &["--expert-placement", loads, "--redundant-experts", "2"],
        ),
        "data-expert or context",
    );
    refused(
        &two_ranks("data-expert", &["--redundant-experts", "2"]),
        "--expert-placement",
    );
    refused(
        &two_ranks(
            "data-expert",
            &["--expert-placement", loads, "--redundant-experts", "1"],
        ),
        "multiple of the ranks",
    );
    // Prefill context parallelism (context): every prompt computed by both ranks (each takes
    // two of its four pieces), decoded by its own rank as under data-expert; MTP too.
    let (s8, eight) = run(&["--ranks", "2", "--parallel", "context", "--mtp", "1"]);
    assert_eq!(s8["parallel"], "context");
    assert_eq!(s8["per_rank"][0]["requests"], 3);
    for (a, b) in one.iter().zip(&eight) {
        assert_eq!(a["id"], b["id"]);
        assert_eq!(ids(&a["output_ids"]), ids(&b["output_ids"]));
    }
    // DeepSeek-V4 over two tensor-parallel ranks (heads, output groups, expert features and
    // vocabulary split): the one-process outputs, MTP drafts included.
    let v4 = |extra: &[&str]| -> Vec<Value> {
        let config = "configs/tiny/v4_flash_tiny.yaml";
        let with_mtp = [&["--mtp", "1"], extra].concat();
        let reqs = run_config(config, &with_mtp).1;
        reqs.iter().map(|r| r["output_ids"].clone()).collect()
    };
    let v4_one = v4(&[]);
    assert_eq!(v4_one, v4(&["--ranks", "2", "--parallel", "tensor"]));
    // DeepSeek-V4 under prefill context parallelism (the seed's `128cp` layout): every prompt's
    // window rows and compressor inputs gathered over both ranks; the one-process outputs.
    assert_eq!(v4_one, v4(&["--ranks", "2", "--parallel", "context"]));
    // Without --parallel, a config whose world_size is the group's names the layout: the
    // seed's attn_tp_size 1 with moe_tp_size 1 is data-expert.
    let yaml = tmp.path().join("ep2.yaml");
    let text = std::fs::read_to_string(root().join("configs/tiny/r1_tiny.yaml")).unwrap();
    // A run over two ranks of r1_tiny with `parallel_config` (YAML lines): summary, stderr.
    let with_sizes = |sizes: &str| -> (Value, String) {
        std::fs::write(&yaml, format!("{text}\nparallel_config:\n{sizes}")).unwrap();
        run_raw(yaml.to_str().unwrap(), &["--ranks", "2"])
    };
    let (s7, err) = with_sizes("  world_size: 2\n  lmhead_tp_size: 2\n");
    assert_eq!(s7["parallel"], "data-expert", "{err}");
    assert!(err.contains("runs as --parallel data-expert"), "{err}");
    assert!(err.contains("lmhead_tp_size 2 held whole"), "{err}");
    // cp_size equal to world_size: context parallel.
    let (s9, err) = with_sizes("  world_size: 2\n  cp_size: 2\n");
    assert_eq!(s9["parallel"], "context", "{err}");
    assert!(err.contains("runs as --parallel context"), "{err}");
    let bad = cachalot(&["run", "--ranks", "0"], None);
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("--ranks 0"));
}

/// `mpirun -n 2 cachalot run` (the `mpi` feature): the processes join the MPI job as ranks 0
/// and 1 and give `--ranks 2`'s outputs (data-expert and tensor parallel, MTP on); `--ranks`
/// under the launcher is refused by name.
#[cfg(feature = "mpi")]
#[test]
fn run_under_mpirun_equals_ranks_over_shared_memory() {
    let tmp = tempfile::tempdir().unwrap();
    let res = tmp.path().display().to_string();
    let mpirun = |args: &[&str]| -> Output {
        cachalot_engine::comm::mpi::test_launcher(2, 300)
            .arg(env!("CARGO_BIN_EXE_cachalot"))
            .args(args)
            .current_dir(root())
            .output()
            .unwrap()
    };
    // The requests of a run of r1_tiny with `extra` options (`launch`: under mpirun).
    let run = |launch: bool, extra: &[&str]| -> (Value, Vec<Value>) {
        let mut args = vec![
            "run",
            "--config",
            "configs/tiny/r1_tiny.yaml",
            "--num-requests",
            "5",
            "--res-dir",
            &res,
            "--json",
            "--quiet",
            "--mtp",
            "1",
        ];
        args.extend_from_slice(extra);
        let out = if launch {
            mpirun(&args)
        } else {
            Command::new(env!("CARGO_BIN_EXE_cachalot"))
                .args(&args)
                .current_dir(root())
                .output()
                .unwrap()
        };
        let summary = json(&ok(out));
        let dir = PathBuf::from(&res).join(summary["run_id"].as_str().unwrap());
        let log = std::fs::read_to_string(dir.join("run.log")).unwrap();
        if launch {
            assert!(log.contains("exchange data over mpi"), "{log}");
        }
        let reqs = std::fs::read_to_string(dir.join("requests.jsonl"))
            .unwrap()
            .lines()
            .map(json)
            .collect();
        (summary, reqs)
    };
    for parallel in ["data-expert", "tensor"] {
        let (s1, shm) = run(false, &["--ranks", "2", "--parallel", parallel]);
        let (s2, mpi) = run(true, &["--parallel", parallel]);
        assert_eq!((&s1["ranks"], &s2["ranks"]), (&2.into(), &2.into()));
        assert_eq!(s2["parallel"], parallel);
        assert_eq!(
            (&s1["transport"], &s2["transport"]),
            (&"shared memory".into(), &"mpi".into())
        );
        assert_eq!(s1["per_rank"][0]["requests"], s2["per_rank"][0]["requests"]);
        assert_eq!(shm.len(), 5);
        assert_eq!(mpi.len(), 5);
        for (a, b) in shm.iter().zip(&mpi) {
            assert_eq!(a["id"], b["id"]);
            assert_eq!(ids(&a["output_ids"]), ids(&b["output_ids"]), "{parallel}");
        }
        assert!(s2["mtp"]["accepted"].as_u64().is_some(), "{s2}");
        assert_eq!(s1["mtp"]["accepted"], s2["mtp"]["accepted"], "{parallel}");
    }
    // What a launch refused by name wrote to stderr.
    let refused = |args: &[&str]| -> String {
        let out = mpirun(args);
        assert!(!out.status.success(), "{args:?} ran");
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let err = refused(&[
        "run",
        "--config",
        "configs/tiny/r1_tiny.yaml",
        "--ranks",
        "2",
    ]);
    assert!(err.contains("--ranks 2 under an MPI launcher"), "{err}");
    // A one-process command under a launcher of two ranks is refused, not run twice.
    let err = refused(&[
        "generate",
        "--model",
        "fixtures/v3/r1_tiny",
        "--prompt",
        "x",
    ]);
    assert!(
        err.contains("only `run` and `serve` run over ranks"),
        "{err}"
    );
}

#[test]
fn generate_past_the_models_positions_is_named() {
    for max_new in ["18446744073709551615", "100000000"] {
        let out = cachalot(
            &[
                "generate",
                "--model",
                &r1_tiny(),
                "--prompt",
                "The sperm whale",
                "--max-new-tokens",
                max_new,
            ],
            None,
        );
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{max_new}: {err}");
        assert!(
            err.contains(&format!("--max-new-tokens {max_new}"))
                && err.contains("max_position_embeddings"),
            "{max_new}: {err}"
        );
        assert!(!err.contains("panicked"), "{err}");
    }
}

#[test]
fn chat_template_kwargs_reach_the_template() {
    let dir = tempfile::tempdir().unwrap();
    let tmpl = dir.path().join("t.jinja");
    std::fs::write(
        &tmpl,
        "{% for m in messages %}{{ m.content }}{% endfor %}\
         {% if enable_thinking is defined and not enable_thinking %}A:{% else %}T:{% endif %}",
    )
    .unwrap();
    let tok = Tokenizer::from_dir(&root().join("fixtures/v3/r1_tiny")).unwrap();
    let model = r1_tiny();
    let prompt = |kwargs: Option<&str>| {
        let t = tmpl.display().to_string();
        let mut args = vec![
            "generate",
            "--model",
            &model,
            "--chat",
            "--prompt",
            "Hi",
            "--chat-template",
            &t,
            "--max-new-tokens",
            "1",
            "--json",
        ];
        args.extend(kwargs.iter().flat_map(|k| ["--chat-template-kwargs", *k]));
        let out = json(&ok(cachalot(&args, None)));
        tok.decode(&ids(&out["prompt_ids"])).unwrap()
    };
    assert!(prompt(None).ends_with("HiT:"), "{}", prompt(None));
    assert!(prompt(Some(r#"{"enable_thinking": false}"#)).ends_with("HiA:"));
    assert!(prompt(Some(r#"{"enable_thinking": true}"#)).ends_with("HiT:"));
    // Not an object: named.
    let out = cachalot(
        &[
            "generate",
            "--model",
            &r1_tiny(),
            "--chat",
            "--prompt",
            "Hi",
            "--chat-template-kwargs",
            "[1]",
        ],
        None,
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("--chat-template-kwargs [1]") && err.contains("a list"),
        "{err}"
    );
}

#[test]
fn out_of_range_arguments_are_named_not_panicked_on() {
    let calibrate_to = |out: &'static str| {
        vec![
            "calibrate",
            "--model",
            "assets/cachalot-tiny-r1",
            "--file",
            "assets/cachalot-tiny-r1/eval.txt",
            "--out",
            out,
        ]
    };
    for (args, want) in [
        (
            vec![
                "perplexity",
                "--model",
                &r1_tiny(),
                "--token-ids",
                "5,99999",
            ],
            "id 99999, outside the model's vocabulary",
        ),
        (
            vec!["perplexity", "--token-ids", "5,6,7", "--window", "1"],
            "--window 1",
        ),
        (
            vec!["tokenize", "--decode", "99999999"],
            "--decode: id 99999999",
        ),
        (vec!["bench", "--batch", "0"], "--batch 0 is out of range"),
        // Options that would be dropped without a word are refused by name.
        (
            vec!["bench", "--membw", "--model", "assets/cachalot-tiny-r1"],
            "--membw runs the bandwidth probe alone",
        ),
        (
            vec![
                "perplexity",
                "--model",
                "fixtures/v4/flash_tiny",
                "--fp8",
                "f32",
                "--token-ids",
                "1,2",
            ],
            "--fp8 f32: fixtures/v4/flash_tiny is a DeepSeek-V4 model",
        ),
        (
            vec!["bench", "--membw", "--fp8", "f32"],
            "--fp8 times a model",
        ),
        (
            vec![
                "serve",
                "--role",
                "prefill",
                "--port",
                "32555",
                "--kv-port",
                "32555",
            ],
            "--kv-port 32555 is the server's own --port",
        ),
        (
            vec![
                "bench",
                "--model",
                "assets/cachalot-tiny-r1",
                "--random-quant",
                "w4a16",
            ],
            "--random-quant is for a random model",
        ),
        (
            vec!["bench", "--membw", "--membw-mib", "8796093022208"],
            "--membw-mib 8796093022208 is out of range",
        ),
        (
            vec!["bench", "--prompt-len", "5000"],
            "exceed the model's max_position_embeddings",
        ),
        // A cache past the memory is refused, naming the options that size it (was a panic).
        (
            vec![
                "bench",
                "--prompt-len",
                "4000",
                "--gen-len",
                "8",
                "--batch",
                "65536",
            ],
            "give a smaller --batch, --prompt-len or --gen-len",
        ),
        (vec!["bench", "--runs", "3"], "--runs 3 is for --mtp N"),
        // Said once, before any rank starts (each rank said it).
        (
            vec![
                "run",
                "--ranks",
                "3",
                "--parallel",
                "expert",
                "--num-requests",
                "2",
            ],
            "--parallel expert: expert parallelism over 3 ranks needs n_routed_experts (16)",
        ),
        (
            vec![
                "run",
                "--rank",
                "0",
                "--world-size",
                "2",
                "--master",
                "127.0.0.1:1",
                "--host-ranks",
                "3",
            ],
            "--host-ranks 3: the ranks of this group on this host are 1 to --world-size 2",
        ),
        (
            vec![
                "run",
                "--rank",
                "0",
                "--world-size",
                "0",
                "--master",
                "127.0.0.1:1",
            ],
            "a group has at least one rank",
        ),
        (
            vec!["generate", "--prompt", "x", "--v4-cache", "full"],
            "is a DeepSeek-V3/R1/Kimi-K2 model",
        ),
        (
            vec![
                "bench",
                "--mtp",
                "1",
                "--prompt-file",
                "assets/cachalot-tiny-r1/eval.txt",
                "--profile",
            ],
            "--profile is for the plain benchmark",
        ),
        (
            vec![
                "bench",
                "--mtp",
                "3",
                "--prompt-file",
                "assets/cachalot-tiny-r1/eval.txt",
                "--prompt-len",
                "32",
                "--decode-len",
                "4063",
            ],
            "--decode-len 4063 plus the 3 draft positions of --mtp 3",
        ),
        (
            vec!["run", "--num-requests", "0"],
            "--num-requests 0 is out of range",
        ),
        // The server's sampling limits hold on the command line too.
        (
            vec!["generate", "--prompt", "x", "--temperature", "1e30"],
            "outside 0 to 100",
        ),
        (
            vec!["generate", "--prompt", "x", "--temperature", "-1"],
            "outside 0 to 100",
        ),
        (vec!["generate", "--prompt", "x", "--stop", ""], "--stop"),
        (
            vec!["generate", "--prompt", "x", "--presence-penalty", "3"],
            "outside -2 to 2",
        ),
        (
            vec!["generate", "--prompt", "x", "--frequency-penalty=-2.5"],
            "outside -2 to 2",
        ),
        (
            vec!["generate", "--prompt", "x", "--top-k", "1.5"],
            "0 or -1: off",
        ),
        // Where calibrate's scales go is checked before its run.
        (calibrate_to("assets"), "--out assets: a directory"),
        (
            calibrate_to("no/such/dir/scales.json"),
            "cannot write in no/such/dir",
        ),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_cachalot"))
            .args(&args)
            .current_dir(root())
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{args:?}: {err}");
        assert!(err.contains(want), "{args:?}: {err}");
    }
}

#[test]
fn tools_reach_the_template_and_bad_tool_files_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let tmpl = dir.path().join("t.jinja");
    std::fs::write(
        &tmpl,
        "{% for m in messages %}{{ m.content }}{% endfor %}\
         {% if tools %}[{% for t in tools %}{{ t.function.name }};{% endfor %}]{% endif %}",
    )
    .unwrap();
    let tools = dir.path().join("tools.json");
    std::fs::write(
        &tools,
        r#"[{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
            {"type": "function", "function": {"name": "get_time"}}]"#,
    )
    .unwrap();
    let tok = Tokenizer::from_dir(&root().join("fixtures/v3/r1_tiny")).unwrap();
    let (model, t, tf) = (
        r1_tiny(),
        tmpl.display().to_string(),
        tools.display().to_string(),
    );
    let base = [
        "generate",
        "--model",
        &model,
        "--chat",
        "--prompt",
        "Hi",
        "--chat-template",
        &t,
        "--max-new-tokens",
        "2",
        "--json",
    ];
    let out = json(&ok(cachalot(
        &[&base[..], &["--tools", &tf]].concat(),
        None,
    )));
    let prompt = tok.decode(&ids(&out["prompt_ids"])).unwrap();
    assert!(prompt.ends_with("Hi[get_weather;get_time;]"), "{prompt}");
    // The answer's text (no reasoning here) comes back as `content`; no calls, no error.
    assert_eq!(out["content"], out["text"]);
    assert!(out.get("tool_calls").is_none() && out.get("tool_call_error").is_none());
    let without = json(&ok(cachalot(&base, None)));
    assert!(tok
        .decode(&ids(&without["prompt_ids"]))
        .unwrap()
        .ends_with("Hi"));

    for (body, want) in [
        ("{\"tools\": []}", "expected a JSON list"),
        (
            "[{\"type\": \"function\", \"function\": {}}]",
            "tool 0 has no function name",
        ),
        (
            "[{\"function\": {\"name\": \"f\"}}, 3]",
            "tool 1 has no function name",
        ),
        (
            "[{\"type\": \"code\", \"function\": {\"name\": \"f\"}}]",
            "tool 0 has type \"code\"",
        ),
        ("[", "not valid JSON"),
    ] {
        std::fs::write(&tools, body).unwrap();
        let out = cachalot(&[&base[..], &["--tools", &tf]].concat(), None);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{body}");
        assert!(err.contains(&tf) && err.contains(want), "{body}: {err}");
    }
    // --tools is a chat option.
    let out = cachalot(
        &[
            "generate", "--model", &model, "--prompt", "Hi", "--tools", &tf,
        ],
        None,
    );
    assert!(!out.status.success());
}

#[test]
fn chat_tool_results_need_a_pending_call() {
    let out = r1_chat("2", true, "/tool 21 C\n/toolbox\n//toolbox\n");
    // `/tool` with no call waiting is refused; `/toolbox` is an unknown command (refused, not
    // sent); `//toolbox` sends the message "/toolbox".
    let turns: Vec<Value> = out.lines().map(json).collect();
    assert_eq!(turns.len(), 1, "{out}");
    assert!(turns[0]["prompt"].as_str().unwrap().contains("/toolbox"));
}

#[test]
fn v4_chat_history_keeps_reasoning_apart() {
    // DeepSeek-V4's encoder takes an assistant turn's reasoning as its own field: in thinking
    // mode the earlier turn's reasoning is dropped from the next prompt, not rendered as answer.
    let model = root().join("fixtures/v4/flash_tiny").display().to_string();
    let run = |kwargs: &str| -> Vec<Value> {
        let out = ok(cachalot(
            &[
                "chat",
                "--model",
                &model,
                "--max-new-tokens",
                "4",
                "--json",
                "--chat-template-kwargs",
                kwargs,
            ],
            Some("hi\nthere\n"),
        ));
        out.lines().map(json).collect()
    };
    let chat = run("{}");
    let first = chat[0]["content"].as_str().unwrap();
    assert_eq!(first, chat[0]["text"].as_str().unwrap());
    let p2 = chat[1]["prompt"].as_str().unwrap();
    assert!(
        p2.contains(&format!(
            "<｜Assistant｜></think>{first}<｜end▁of▁sentence｜>"
        )),
        "{p2}"
    );
    let think = run(r#"{"thinking": true}"#);
    let text = think[0]["text"].as_str().unwrap();
    let p2 = think[1]["prompt"].as_str().unwrap();
    if !text.contains("</think>") {
        // All of the first turn was reasoning: nothing of it stays.
        assert_eq!(think[0]["content"], "");
        assert!(!p2.contains(text), "{p2}");
    }
}

/// `convert` refuses an input the loader would refuse (here: an unexpected layer) before writing
/// anything, naming the tensor; one missing only MTP layers converts.
#[test]
fn convert_checks_that_the_input_loads() {
    let tmp = tempfile::tempdir().unwrap();
    let input = tmp.path().join("in");
    std::fs::create_dir_all(&input).unwrap();
    for e in std::fs::read_dir(root().join("fixtures/v3/r1_tiny")).unwrap() {
        let p = e.unwrap().path();
        std::fs::copy(&p, input.join(p.file_name().unwrap())).unwrap();
    }
    // Say the config has one layer fewer: the checkpoint's last layer is then unexpected.
    let cfg_path = input.join("config.json");
    let mut c: Value = serde_json::from_str(&std::fs::read_to_string(&cfg_path).unwrap()).unwrap();
    let layers = c["num_hidden_layers"].as_u64().unwrap();
    c["num_hidden_layers"] = (layers - 1).into();
    c["num_nextn_predict_layers"] = 0.into();
    std::fs::write(&cfg_path, c.to_string()).unwrap();
    let out = tmp.path().join("out");
    let convert_from = |input: &std::path::Path| {
        cachalot(
            &[
                "convert",
                "--input",
                input.to_str().unwrap(),
                "--output",
                out.to_str().unwrap(),
                "--quant-mode",
                "w8a8c16",
            ],
            None,
        )
    };
    let convert = || convert_from(&input);
    let o = convert();
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("does not load") && err.contains("model.layers."),
        "{err}"
    );
    assert!(!out.exists());
    // A directory without config.json is said so.
    let o = convert_from(tmp.path());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("has no config.json"), "{err}");
    // A checkpoint without (some of) its MTP layers, as many re-uploads are: the main model
    // converts, with a note, and the output runs.
    c["num_hidden_layers"] = layers.into();
    c["num_nextn_predict_layers"] = 2.into();
    std::fs::write(&cfg_path, c.to_string()).unwrap();
    let o = convert();
    let text =
        String::from_utf8_lossy(&o.stdout).into_owned() + &String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{text}");
    assert!(text.contains("without its MTP layers"), "{text}");
    assert!(out.join("config.json").is_file());
    // `num_nextn_predict_layers: 0` over a checkpoint that holds its MTP layer (a common way
    // to drop MTP): the layer is not loaded, with a note, as transformers skips it.
    c["num_nextn_predict_layers"] = 0.into();
    std::fs::write(&cfg_path, c.to_string()).unwrap();
    let o = cachalot(
        &[
            "perplexity",
            "--model",
            input.to_str().unwrap(),
            "--token-ids",
            "5,6,7,8",
        ],
        None,
    );
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(
        err.contains(&format!("model.layers.{layers} (an MTP layer")),
        "{err}"
    );
}

/// `custom_params.num_hidden_layers` beyond the checkpoint's layers, or a key one typo from it,
/// is refused naming it; a `max_new_tokens` past the model's positions sizes the KV pool for
/// the positions (requests stop there), not for the YAML's length; `--check-tensors` refuses
/// a NaN weight by name.
#[test]
fn run_checks_custom_params_and_sizes_the_pool_by_the_models_positions() {
    let tmp = tempfile::tempdir().unwrap();
    let res = tmp.path().display().to_string();
    let yaml = tmp.path().join("c.yaml");
    let model = root().join("fixtures/v3/r1_tiny").display().to_string();
    let run = |body: &str| {
        std::fs::write(
            &yaml,
            format!(
                "model_config:\n  model_name: \"deepseek_r1\"\n  model_path: {model:?}\n{body}"
            ),
        )
        .unwrap();
        Command::new(env!("CARGO_BIN_EXE_cachalot"))
            .args([
                "run",
                "--config",
                yaml.to_str().unwrap(),
                "--num-requests",
                "1",
            ])
            .args(["--res-dir", &res, "--json", "--quiet"])
            .current_dir(root())
            .output()
            .unwrap()
    };
    for (params, want) in [
        ("num_hiden_layers: 2", "did you mean `num_hidden_layers`"),
        ("num_hidden_layers: 99", "exceeds the checkpoint's 3 layers"),
    ] {
        let out = run(&format!("  custom_params:\n    {params}\n"));
        let e = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && e.contains(want), "{params}: {e}");
    }
    // What only the checkpoint shows is said all at once, with lines, before a results
    // directory is made: drafts without an MTP layer (r1_tiny has none) and too many layers.
    // (v3_noq_tiny has no MTP layer.)
    let noq = root().join("fixtures/v3/v3_noq_tiny").display().to_string();
    let wrong = tmp.path().join("wrong.yaml");
    std::fs::write(
        &wrong,
        format!(
            "model_config:\n  model_name: deepseek_v4\n  model_path: {noq:?}\n  next_n: 2\n  \
             custom_params:\n    num_hidden_layers: 99\n"
        ),
    )
    .unwrap();
    // The file `wrong` run: its output and stderr.
    let run_wrong = || {
        let out = Command::new(env!("CARGO_BIN_EXE_cachalot"))
            .args([
                "run",
                "--config",
                wrong.to_str().unwrap(),
                "--res-dir",
                &res,
            ])
            .current_dir(root())
            .output()
            .unwrap();
        let e = String::from_utf8_lossy(&out.stderr).into_owned();
        (out, e)
    };
    let (out, e) = run_wrong();
    assert!(!out.status.success(), "{e}");
    for want in [
        "3 problems",
        "line 2: model_config.model_name: \"deepseek_v4\" does not match",
        "line 4: model_config.next_n: 2 draft tokens need the model's MTP layer",
        "line 6: model_config.custom_params.num_hidden_layers: 99 exceeds",
    ] {
        assert!(e.contains(want), "{want}: {e}");
    }
    assert_eq!(std::fs::read_dir(tmp.path()).unwrap().count(), 2, "{e}");
    // So is a prompt that fills the model's positions (a copy of r1_tiny with 8 of them).
    let short = tmp.path().join("short_model");
    std::fs::create_dir(&short).unwrap();
    for e in std::fs::read_dir(root().join("fixtures/v3/r1_tiny")).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), short.join(e.file_name())).unwrap();
    }
    let mut c: Value =
        serde_json::from_str(&std::fs::read_to_string(short.join("config.json")).unwrap()).unwrap();
    c["max_position_embeddings"] = 8.into();
    std::fs::write(short.join("config.json"), c.to_string()).unwrap();
    std::fs::write(
        &wrong,
        format!(
            "model_config:\n  model_path: {:?}\n",
            short.display().to_string()
        ),
    )
    .unwrap();
    let (out, e) = run_wrong();
    assert!(
        !out.status.success()
            && e.contains("request 0 (prompt 0 of the default dataset): the prompt has ")
            && e.contains("the model takes at most 8 positions"),
        "{e}"
    );
    assert_eq!(std::fs::read_dir(tmp.path()).unwrap().count(), 3, "{e}");
    // An NPU switch is noted, not refused.
    ok(run("  custom_params:\n    enable_multi_streams: true\n"));
    // --check-tensors reads every tensor first: the shipped model passes; a copy whose
    // embedding holds a NaN is refused naming the tensor (without the flag it would run).
    let checked = |model: &str| {
        let args = ["generate", "--model", model, "--token-ids", "0"];
        cachalot(
            &[&args[..], &["--max-new-tokens", "2", "--check-tensors"]].concat(),
            None,
        )
    };
    ok(checked(
        root().join("assets/cachalot-tiny-r1").to_str().unwrap(),
    ));
    let copy = tmp.path().join("nan_model");
    std::fs::create_dir(&copy).unwrap();
    let src = root().join("assets/cachalot-tiny-r1");
    for e in std::fs::read_dir(&src).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), copy.join(e.file_name())).unwrap();
    }
    let index: Value = serde_json::from_str(
        &std::fs::read_to_string(copy.join("model.safetensors.index.json")).unwrap(),
    )
    .unwrap();
    let name = "model.embed_tokens.weight";
    let shard = copy.join(index["weight_map"][name].as_str().unwrap());
    let mut bytes = std::fs::read(&shard).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let at = 8 + n + header[name]["data_offsets"][0].as_u64().unwrap() as usize;
    bytes[at..at + 2].copy_from_slice(&0x7FC0u16.to_le_bytes());
    std::fs::write(&shard, bytes).unwrap();
    let out = checked(copy.to_str().unwrap());
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && e.contains(name) && e.contains("element 0"),
        "{e}"
    );
    let huge = "scheduler_config:\n  batch_size: 2\n  block_size: 16\n  max_new_tokens: 16777216\n";
    let s = json(&ok(run(huge)));
    // 8192 positions: 512 blocks a sequence, 2 sequences (block 0, reserved, not counted).
    assert_eq!(s["kv_capacity_blocks"], 2 * 512, "{s}");
}

/// A run stopped by Ctrl-C (SIGINT) keeps the requests it finished: they are written to
/// requests.rank0.partial.jsonl as they finish, and the process says where, exiting 130.
#[test]
fn an_interrupted_run_keeps_its_finished_requests() {
    let tmp = tempfile::tempdir().unwrap();
    let res = tmp.path().join("res");
    let yaml = tmp.path().join("long.yaml");
    let model = root().join("assets/cachalot-tiny-r1").display().to_string();
    let dataset = root().join("dataset").display().to_string();
    std::fs::write(
        &yaml,
        format!(
            "model_config:\n  model_name: \"deepseek_r1\"\n  model_path: {model:?}\n\
             data_config:\n  dataset: \"default\"\n  dataset_path: {dataset:?}\n  \
             num_requests: 256\n  ignore_eos: true\n\
             scheduler_config:\n  batch_size: 2\n  max_new_tokens: 2000\n"
        ),
    )
    .unwrap();
    let child = Command::new(env!("CARGO_BIN_EXE_cachalot"))
        .args(["run", "--config", yaml.to_str().unwrap(), "--quiet"])
        .args(["--res-dir", res.to_str().unwrap()])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Wait for the first finished request on disk (the run takes minutes to finish them all).
    let partial = || -> Option<PathBuf> {
        let dir = std::fs::read_dir(&res).ok()?.next()?.ok()?.path();
        let p = dir.join("requests.rank0.partial.jsonl");
        let text = std::fs::read_to_string(&p).ok()?;
        text.ends_with('\n').then_some(p)
    };
    let start = std::time::Instant::now();
    let file = loop {
        if let Some(p) = partial() {
            break p;
        }
        assert!(
            start.elapsed().as_secs() < 300,
            "no request finished in 300 s"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    // SAFETY: kill(2) on our own child's pid.
    unsafe {
        libc::kill(child.id() as libc::pid_t, libc::SIGINT);
    }
    let out = child.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(130));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("requests.rank0.partial.jsonl"), "{err}");
    let lines: Vec<Value> = std::fs::read_to_string(&file)
        .unwrap()
        .lines()
        .map(json)
        .collect();
    assert!(!lines.is_empty() && lines.len() < 256);
    for l in &lines {
        assert_eq!(l["output_ids"].as_array().unwrap().len(), 2000, "{l}");
        assert!(l["id"].as_u64().unwrap() < 256);
    }
}

/// A chat template that refuses a later turn (`raise_exception`) refuses that turn only: the
/// session goes on, `/reset` included; a bench prompt file without --mtp and a one-token
/// perplexity text are refused by name.
#[test]
fn a_turn_the_template_refuses_leaves_the_chat_running() {
    let tmp = tempfile::tempdir().unwrap();
    let template = tmp.path().join("one.jinja");
    std::fs::write(
        &template,
        "{% for m in messages %}{% if loop.index0 > 0 %}{{ raise_exception('only one message \
         allowed') }}{% endif %}{{ m.content }}{% endfor %}",
    )
    .unwrap();
    let model = root().join("assets/cachalot-tiny-r1");
    let model = model.to_str().unwrap();
    let out = cachalot(
        &[
            "chat",
            "--model",
            model,
            "--chat-template",
            template.to_str().unwrap(),
            "--max-new-tokens",
            "2",
        ],
        Some("Hi\nagain\n/reset\nthird\n"),
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("only one message allowed"), "{err}");
    let text = tmp.path().join("one.txt");
    std::fs::write(&text, "x").unwrap();
    let text = text.to_str().unwrap();
    let out = cachalot(&["perplexity", "--model", model, "--file", text], None);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains(text) && err.contains("at least 2"),
        "{err}"
    );
    let out = cachalot(
        &[
            "bench",
            "--model",
            model,
            "--prompt-file",
            text,
            "--prompt-len",
            "4",
        ],
        None,
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("--mtp"), "{err}");
}

/// A bench of random weights stopped by SIGTERM removes them (exit 143, as a process killed
/// by the signal reports).
#[test]
fn an_interrupted_random_bench_removes_its_model() {
    let tmp = tempfile::tempdir().unwrap();
    let child = Command::new(env!("CARGO_BIN_EXE_cachalot"))
        .args(["bench", "--threads", "1", "--random-weights"])
        .arg(root().join("assets/cachalot-tiny-r1/config.json"))
        .arg("--random-dir")
        .arg(tmp.path())
        .args(["--prompt-len", "4000", "--gen-len", "90"])
        .current_dir(root())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Once the model is written (its config.json is the last file), stop the bench.
    let start = std::time::Instant::now();
    let written = || -> bool {
        std::fs::read_dir(tmp.path())
            .ok()
            .and_then(|mut d| d.next())
            .and_then(|e| e.ok())
            .is_some_and(|e| e.path().join("fp8/config.json").is_file())
    };
    while !written() {
        assert!(start.elapsed().as_secs() < 120, "no random model in 120 s");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    // SAFETY: kill(2) on our own child's pid.
    unsafe {
        libc::kill(child.id() as libc::pid_t, libc::SIGTERM);
    }
    let out = child.wait_with_output().unwrap();
    assert_eq!(
        out.status.code(),
        Some(143),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let left: Vec<_> = std::fs::read_dir(tmp.path()).unwrap().collect();
    assert!(left.is_empty(), "{left:?}");
}

/// Output that cannot be written is an error said in one line (exit 1), not a panic; a reader
/// that leaves (`| head`) ends the command as SIGPIPE does (exit 141, nothing said), a
/// generation included.
#[test]
fn unwritable_output_is_an_error_not_a_panic() {
    for args in [
        vec!["tokenize", "--text", "hello", "--json"],
        vec!["perplexity", "--prompt", "hello world"],
        vec!["generate", "--prompt", "hi", "--max-new-tokens", "3"],
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_cachalot"))
            .args(&args)
            .current_dir(root())
            .stdout(std::fs::File::create("/dev/full").unwrap())
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
        assert!(
            err.contains("cannot write the output") && !err.contains("panicked"),
            "{args:?}: {err}"
        );
    }
    for args in [
        vec![
            "generate",
            "--prompt",
            "hi",
            "--max-new-tokens",
            "3000",
            "--ignore-eos",
        ],
        vec!["tokenize", "--text", &"whale ".repeat(20_000), "--json"],
    ] {
        let mut child = Command::new(env!("CARGO_BIN_EXE_cachalot"))
            .args(&args)
            .current_dir(root())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        // The reader leaves at once.
        drop(child.stdout.take());
        let out = child.wait_with_output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(141), "{}: {err}", args[0]);
        assert!(!err.contains("panicked"), "{err}");
    }
}

/// A generation_config.json that is not JSON is said (its EOS would be lost without a word);
/// the model runs without it, as transformers and vLLM run it.
#[test]
fn a_broken_generation_config_is_said() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = copy_of_r1_tiny(tmp.path());
    // Generates two tokens with `generation_config.json` holding `text`: its stderr.
    let stderr_with = |text: &str| {
        std::fs::write(dir.join("generation_config.json"), text).unwrap();
        let out = Command::new(env!("CARGO_BIN_EXE_cachalot"))
            .args([
                "generate",
                "--prompt",
                "hi",
                "--max-new-tokens",
                "2",
                "--model",
            ])
            .arg(&dir)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(out.status.success(), "{err}");
        err
    };
    let err = stderr_with("{bad");
    assert!(
        err.contains("generation_config.json is not valid JSON"),
        "{err}"
    );
    // An EOS that is not a token id is said too.
    let err = stderr_with(r#"{"eos_token_id": [1, "x"]}"#);
    assert!(
        err.contains(r#"eos_token_id "x" is not a token id"#),
        "{err}"
    );
}

/// A copy of the r1_tiny fixture in `under/m`, to change its files.
fn copy_of_r1_tiny(under: &std::path::Path) -> PathBuf {
    let dir = under.join("m");
    std::fs::create_dir_all(&dir).unwrap();
    for e in std::fs::read_dir(r1_tiny()).unwrap() {
        let p = e.unwrap().path();
        std::fs::copy(&p, dir.join(p.file_name().unwrap())).unwrap();
    }
    dir
}

/// Without `--max-new-tokens` a long prompt gets what the context leaves (256 at most); a
/// given value that does not fit is refused; `--stop` without a tokenizer is refused.
#[test]
fn the_default_output_length_fits_the_context() {
    let dir = tempfile::tempdir().unwrap();
    let m = copy_of_r1_tiny(dir.path());
    let cfg = m.join("config.json");
    let mut c: Value = serde_json::from_str(&std::fs::read_to_string(&cfg).unwrap()).unwrap();
    c["max_position_embeddings"] = 32.into();
    std::fs::write(&cfg, c.to_string()).unwrap();
    let prompt: Vec<String> = (10..30).map(|i| i.to_string()).collect();
    let prompt = prompt.join(",");
    let m = m.display().to_string();
    let out = json(&ok(cachalot(
        &[
            "generate",
            "--model",
            &m,
            "--token-ids",
            &prompt,
            "--ignore-eos",
            "--json",
        ],
        None,
    )));
    assert_eq!(ids(&out["output_ids"]).len(), 12, "{out}");
    assert_eq!(out["finish_reason"], "length");
    let e = cachalot(
        &[
            "generate",
            "--model",
            &m,
            "--token-ids",
            &prompt,
            "--max-new-tokens",
            "13",
        ],
        None,
    );
    let err = String::from_utf8_lossy(&e.stderr);
    assert!(
        !e.status.success() && err.contains("give at most 12"),
        "{err}"
    );
    let v4 = root().join("fixtures/v4/tiny").display().to_string();
    let e = cachalot(
        &[
            "generate",
            "--model",
            &v4,
            "--token-ids",
            "1,2,3",
            "--stop",
            "x",
        ],
        None,
    );
    let err = String::from_utf8_lossy(&e.stderr);
    assert!(
        !e.status.success() && err.contains("--stop needs the model's tokenizer"),
        "{err}"
    );
}
