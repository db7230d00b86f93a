//! Tokenizers and chat templates against references computed by Hugging Face `tokenizers`,
//! `tiktoken` and `transformers`' `apply_chat_template` (fixtures/text, built by
//! tools/text/make_text_fixtures.py).

use std::path::PathBuf;

use cachalot_model::tokenizer::{ChatTemplate, Message, Tokenizer, TokenizerKind, ToolCallFormat};
use serde_json::Value;

mod common;
use common::ids;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn text_fixture(name: &str) -> PathBuf {
    root().join("fixtures/text").join(name)
}

fn cases() -> Value {
    let s = std::fs::read_to_string(text_fixture("tokenizer_cases.json")).unwrap();
    serde_json::from_str(&s).unwrap()
}

fn check_tokenizer(tok: &Tokenizer, ids_field: &str, decoded_field: &str) {
    let all = cases();
    let cases = all["cases"].as_array().unwrap();
    assert!(cases.len() >= 200, "{} cases", cases.len());
    let mut failures = Vec::new();
    for case in cases {
        let text = case["text"].as_str().unwrap();
        let want = ids(&case[ids_field]);
        let got = tok.encode(text).unwrap();
        if got != want {
            failures.push(format!("{text:?}: got {got:?}, want {want:?}"));
            continue;
        }
        let decoded = tok.decode(&got).unwrap();
        assert_eq!(
            decoded,
            case[decoded_field].as_str().unwrap(),
            "decode of {text:?}"
        );
        // Streaming: the pieces add up to the full decode, and none holds half a character.
        let mut stream = tok.stream_decoder();
        let mut streamed = String::new();
        for &id in &got {
            let piece = stream.push(id).unwrap();
            assert!(
                !piece.contains('\u{fffd}') || decoded.contains('\u{fffd}'),
                "{text:?}: streamed piece {piece:?} holds a broken character"
            );
            streamed.push_str(&piece);
        }
        streamed.push_str(&stream.finish().unwrap());
        assert_eq!(streamed, decoded, "streamed decode of {text:?}");
    }
    assert!(
        failures.is_empty(),
        "{} of {} differ:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
}

#[test]
fn tokenizer_json_matches_hf_tokenizers() {
    let tok = Tokenizer::from_dir(&text_fixture("r1_style")).unwrap();
    assert_eq!(tok.kind(), TokenizerKind::HuggingFace);
    check_tokenizer(&tok, "hf_ids", "hf_decoded");
}

#[test]
fn tiktoken_model_matches_tiktoken() {
    let tok = Tokenizer::from_dir(&text_fixture("kimi_style")).unwrap();
    assert_eq!(tok.kind(), TokenizerKind::Tiktoken);
    check_tokenizer(&tok, "tiktoken_ids", "tiktoken_decoded");
}

#[test]
fn kimi_specials_follow_added_tokens_decoder() {
    let tok = Tokenizer::from_dir(&text_fixture("kimi_style")).unwrap();
    let n = cases()["kimi_num_base_tokens"].as_u64().unwrap() as u32;
    assert_eq!(tok.vocab_size(), n as usize + 256);
    assert_eq!(tok.token_to_id("[BOS]"), Some(n));
    assert_eq!(tok.token_to_id("<|im_end|>"), Some(n + 2));
    assert_eq!(tok.token_to_id("<|im_middle|>"), Some(n + 17));
    assert_eq!(tok.token_to_id("[PAD]"), Some(n + 255));
    // An id without a name in the config is `<|reserved_token_{id}|>`.
    let name = format!("<|reserved_token_{}|>", n + 5);
    assert_eq!(tok.token_to_id(&name), Some(n + 5));
    assert_eq!(tok.id_to_token(n + 5).as_deref(), Some(name.as_str()));
    assert_eq!(tok.eos_token_id(), Some(n + 1));
    // An id past the tokenizer (a model's embedding may have more rows) decodes to nothing,
    // as Hugging Face `tokenizers` skips it.
    assert_eq!(tok.decode(&[n + 256]).unwrap(), "");
    assert_eq!(
        tok.decode(&[65, n + 256, 66]).unwrap(),
        tok.decode(&[65, 66]).unwrap()
    );
}

/// `skip_special_tokens=True` leaves out: for `tokenizer.json`, the added tokens marked
/// `special` (read here from the file itself); for Kimi's tiktoken tokenizer, transformers'
/// `all_special_ids` (the named tokens and `additional_special_tokens` of
/// `tokenizer_config.json`), which leave its tool-call markers, `<think>` and the media tokens
/// in the text.
#[test]
fn skipped_special_tokens_are_transformers_ones() {
    let tok = Tokenizer::from_dir(&text_fixture("r1_style")).unwrap();
    let json: Value = serde_json::from_str(
        &std::fs::read_to_string(text_fixture("r1_style/tokenizer.json")).unwrap(),
    )
    .unwrap();
    let mut want: Vec<u32> = json["added_tokens"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|t| t["special"] == true)
        .map(|t| t["id"].as_u64().unwrap() as u32)
        .collect();
    want.sort();
    let got: Vec<u32> = (0..tok.vocab_size() as u32)
        .filter(|&id| tok.skipped_in_text(id))
        .collect();
    assert_eq!(got, want);
    let think = tok.token_to_id("<think>").unwrap();
    assert!(
        !tok.skipped_in_text(think),
        "r1_style's <think> is not special"
    );

    let kimi = Tokenizer::from_dir(&text_fixture("kimi_style")).unwrap();
    let named = [
        "[BOS]",
        "[EOS]",
        "[UNK]",
        "[PAD]",
        "<|im_end|>",
        "<|im_user|>",
        "<|im_assistant|>",
        "<|start_header_id|>",
        "<|end_header_id|>",
        "[EOT]",
        "<|im_system|>",
        "<|im_middle|>",
    ];
    let mut want: Vec<u32> = named.iter().map(|n| kimi.token_to_id(n).unwrap()).collect();
    want.sort();
    let got: Vec<u32> = (0..kimi.vocab_size() as u32)
        .filter(|&id| kimi.skipped_in_text(id))
        .collect();
    assert_eq!(got, want);
    for kept in [
        "<|tool_calls_section_begin|>",
        "<|tool_call_begin|>",
        "<think>",
        "</think>",
    ] {
        assert!(
            !kimi.skipped_in_text(kimi.token_to_id(kept).unwrap()),
            "{kept}"
        );
    }
    // The markers a server keeps for its parsers.
    let keep = ToolCallFormat::parser_tokens(Some(ToolCallFormat::KimiK2), &kimi);
    for m in [
        "<think>",
        "</think>",
        "<|tool_call_begin|>",
        "<|tool_calls_section_end|>",
    ] {
        assert!(keep.contains(&kimi.token_to_id(m).unwrap()), "{m}");
    }
    let keep = ToolCallFormat::parser_tokens(None, &tok);
    assert_eq!(keep, vec![think, tok.token_to_id("</think>").unwrap()]);
}

#[test]
fn r1_style_specials() {
    let tok = Tokenizer::from_dir(&text_fixture("r1_style")).unwrap();
    assert_eq!(tok.token_to_id("<｜begin▁of▁sentence｜>"), Some(0));
    assert_eq!(tok.eos_token_id(), Some(1));
    assert!(tok.token_to_id("<think>").is_some());
}

#[test]
fn chat_templates_match_transformers() {
    let s = std::fs::read_to_string(text_fixture("chat_cases.json")).unwrap();
    let cases: Vec<Value> = serde_json::from_str(&s).unwrap();
    assert!(cases.len() >= 20);
    let r1 = Tokenizer::from_dir(&text_fixture("r1_style")).unwrap();
    let kimi = Tokenizer::from_dir(&text_fixture("kimi_style")).unwrap();
    let r1_t = r1
        .chat_template()
        .unwrap()
        .expect("r1_style has a template");
    let kimi_t = kimi
        .chat_template()
        .unwrap()
        .expect("kimi_style has a template");
    for case in &cases {
        let t = match case["template"].as_str().unwrap() {
            "r1_style" => &r1_t,
            "kimi_style" => &kimi_t,
            other => panic!("unknown template {other}"),
        };
        let tools = case.get("tools").filter(|t| !t.is_null());
        let got = t
            .render_json(
                &case["messages"],
                case["add_generation_prompt"].as_bool().unwrap(),
                tools,
                &serde_json::Map::new(),
            )
            .unwrap();
        assert_eq!(got, case["expected"].as_str().unwrap(), "case {case}");
    }
}

/// Every assistant turn with tool calls in the rendered fixtures parses back to the calls it was
/// rendered from: what the model is trained to write, we read (R1 and Kimi-K2 templates).
#[test]
fn tool_calls_rendered_by_the_templates_parse_back() {
    let s = std::fs::read_to_string(text_fixture("chat_cases.json")).unwrap();
    let cases: Vec<Value> = serde_json::from_str(&s).unwrap();
    let mut checked = 0;
    for name in ["r1_style", "kimi_style"] {
        let tok = Tokenizer::from_dir(&text_fixture(name)).unwrap();
        let t = tok.chat_template().unwrap().unwrap();
        let format = ToolCallFormat::for_tokenizer(&tok, false).expect("tool tokens");
        let header = match format {
            ToolCallFormat::DeepseekV3 => "<｜Assistant｜>",
            _ => "<|im_assistant|>assistant<|im_middle|>",
        };
        for case in cases.iter().filter(|c| c["template"] == name) {
            let msgs = case["messages"].as_array().unwrap();
            for (i, m) in msgs.iter().enumerate() {
                let Some(calls) = m.get("tool_calls").and_then(Value::as_array) else {
                    continue;
                };
                let upto = Value::Array(msgs[..=i].to_vec());
                let tools = case.get("tools").filter(|t| !t.is_null());
                let text = t
                    .render_json(&upto, false, tools, &serde_json::Map::new())
                    .unwrap();
                let turn = &text[text.rfind(header).unwrap() + header.len()..];
                let parsed = format
                    .parse(turn)
                    .unwrap_or_else(|e| panic!("{name}: {turn:?}: {e}"));
                assert_eq!(parsed.content, m["content"].as_str().unwrap_or(""));
                assert_eq!(parsed.tool_calls.len(), calls.len());
                for (j, (got, want)) in parsed.tool_calls.iter().zip(calls).enumerate() {
                    assert_eq!(got.function.name, want["function"]["name"]);
                    assert_eq!(got.function.arguments, want["function"]["arguments"]);
                    if format == ToolCallFormat::KimiK2 {
                        let id = format!(
                            "functions.{}:{j}",
                            want["function"]["name"].as_str().unwrap()
                        );
                        assert_eq!(got.id.as_deref(), Some(id.as_str()));
                    }
                }
                checked += 1;
            }
        }
    }
    assert!(checked >= 4, "{checked}");
}

#[test]
fn plain_messages_render_like_json_ones() {
    let tok = Tokenizer::from_dir(&text_fixture("r1_style")).unwrap();
    let t = tok.chat_template().unwrap().unwrap();
    let got = t
        .render(
            &[
                Message::new("system", "S"),
                Message::new("user", "Q"),
                Message::new("assistant", "<think>r</think>A"),
                Message::new("user", "Q2"),
            ],
            true,
        )
        .unwrap();
    assert_eq!(
        got,
        "<｜begin▁of▁sentence｜>S<｜User｜>Q<｜Assistant｜>A<｜end▁of▁sentence｜><｜User｜>Q2<｜Assistant｜><think>\n"
    );
}

#[test]
fn chat_template_from_file_reads_a_config() {
    let t = ChatTemplate::from_file(&text_fixture("r1_style/tokenizer_config.json")).unwrap();
    let got = t.render(&[Message::new("user", "hi")], true).unwrap();
    assert_eq!(
        got,
        "<｜begin▁of▁sentence｜><｜User｜>hi<｜Assistant｜><think>\n"
    );
}

#[test]
fn a_directory_without_a_tokenizer_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let e = Tokenizer::from_dir(dir.path()).err().unwrap().to_string();
    assert!(
        e.contains("tokenizer.json") && e.contains("tiktoken.model"),
        "{e}"
    );
}

#[test]
fn an_empty_special_token_name_is_named() {
    // An empty name would match at every offset of the text: encoding would never advance.
    let dir = tempfile::tempdir().unwrap();
    let src = text_fixture("kimi_style");
    for entry in std::fs::read_dir(&src).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), dir.path().join(entry.file_name())).unwrap();
    }
    let path = dir.path().join("tokenizer_config.json");
    let mut config: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let added = config["added_tokens_decoder"].as_object_mut().unwrap();
    let id = added.keys().next().unwrap().clone();
    added.get_mut(&id).unwrap()["content"] = Value::from("");
    std::fs::write(&path, serde_json::to_string(&config).unwrap()).unwrap();
    let err = Tokenizer::from_dir(dir.path())
        .err()
        .expect("an error")
        .to_string();
    assert!(
        err.contains(&format!("added_tokens_decoder.{id}.content")) && err.contains("empty"),
        "{err}"
    );
}

/// Streamed pieces add up to the decode of all ids for any id sequence, including broken
/// UTF-8: byte tokens of characters shuffled, so invalid bytes, split characters and invalid
/// bytes right before a split character (`80 | F0 9F 90 | 80`, which once stalled the stream
/// for good) all occur.
#[test]
fn streaming_equals_full_decode_on_broken_utf8() {
    for name in ["r1_style", "kimi_style"] {
        let tok = Tokenizer::from_dir(&text_fixture(name)).unwrap();
        let pool = tok.encode("🐀 whale 抹茶 é ß 👩‍👩‍👧 ok\n").unwrap();
        // The rat as its byte tokens, after its own last (continuation) byte.
        let rat = tok.encode("🐀").unwrap();
        let mut seqs = vec![[&rat[rat.len() - 1..], &rat[..], &rat[..]].concat()];
        let mut state = 0x9E37_79B9_7F4A_7C15u64;
        for _ in 0..300 {
            let len = 1 + (state % 24) as usize;
            let seq: Vec<u32> = (0..len)
                .map(|_| {
                    state = state
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    pool[(state >> 33) as usize % pool.len()]
                })
                .collect();
            seqs.push(seq);
        }
        for seq in seqs {
            let want = tok.decode(&seq).unwrap();
            let mut s = tok.stream_decoder();
            let mut got = String::new();
            for &id in &seq {
                got.push_str(&s.push(id).unwrap());
            }
            got.push_str(&s.finish().unwrap());
            assert_eq!(got, want, "{name}: {seq:?}");
        }
    }
}

/// A token's bytes (chat log-probabilities' `bytes`): for both tokenizer kinds, the bytes of
/// the tokens of a text concatenate to the text's UTF-8, even where a token holds part of a
/// character (decoding it alone gives U+FFFD).
#[test]
fn token_bytes_rebuild_the_text() {
    for name in ["r1_style", "kimi_style"] {
        let tok = Tokenizer::from_dir(&text_fixture(name)).unwrap();
        for text in ["héllo wörld 中文字符 🐳🐋 ok", "a\tb\n  c", "€100 → ∞"] {
            let ids = tok.encode(text).unwrap();
            let bytes: Vec<u8> = ids.iter().flat_map(|&id| tok.token_bytes(id)).collect();
            assert_eq!(String::from_utf8(bytes).unwrap(), text, "{name}: {ids:?}");
        }
    }
}

/// A plain prompt's BOS: `add_bos_token` when tokenizer_config.json sets it; without the flag,
/// what tokenizer.json's post-processor puts first (transformers' encoding with special
/// tokens); none from a tokenizer without either.
#[test]
fn prompt_bos_follows_the_flag_else_the_post_processor() {
    let shipped = root().join("assets/cachalot-tiny-r1");
    let tok = Tokenizer::from_dir(&shipped).unwrap();
    let bos = tok.bos_token().and_then(|t| tok.token_to_id(&t));
    assert!(bos.is_some());
    assert_eq!(tok.prompt_bos_id(), bos);
    let tmp = tempfile::tempdir().unwrap();
    for f in ["tokenizer.json", "config.json"] {
        std::fs::copy(shipped.join(f), tmp.path().join(f)).unwrap();
    }
    let mut cfg: Value = serde_json::from_str(
        &std::fs::read_to_string(shipped.join("tokenizer_config.json")).unwrap(),
    )
    .unwrap();
    for (flag, want) in [(None, bos), (Some(false), None), (Some(true), bos)] {
        match flag {
            None => {
                cfg.as_object_mut().unwrap().remove("add_bos_token");
            }
            Some(b) => cfg["add_bos_token"] = b.into(),
        }
        std::fs::write(tmp.path().join("tokenizer_config.json"), cfg.to_string()).unwrap();
        let t = Tokenizer::from_dir(tmp.path()).unwrap();
        assert_eq!(t.prompt_bos_id(), want, "add_bos_token {flag:?}");
    }
    let r1 = Tokenizer::from_dir(&root().join("fixtures/v3/r1_tiny")).unwrap();
    assert_eq!(r1.prompt_bos_id(), None);
}

/// A model directory's `chat_template.jinja` (transformers 5's) is its template, before
/// `tokenizer_config.json`'s, with the config's special tokens.
#[test]
fn a_chat_template_jinja_file_is_the_models_template() {
    let shipped = root().join("assets/cachalot-tiny-r1");
    let tmp = tempfile::tempdir().unwrap();
    for f in ["tokenizer.json", "config.json", "tokenizer_config.json"] {
        std::fs::copy(shipped.join(f), tmp.path().join(f)).unwrap();
    }
    std::fs::write(
        tmp.path().join("chat_template.jinja"),
        "J:{{ bos_token }}{{ messages[0]['content'] }}",
    )
    .unwrap();
    let messages: Value = serde_json::from_str(r#"[{"role":"user","content":"hi"}]"#).unwrap();
    let t = Tokenizer::from_dir(tmp.path()).unwrap();
    let bos = t.bos_token().unwrap();
    let text = t
        .chat_template()
        .unwrap()
        .unwrap()
        .render_json(&messages, true, None, &serde_json::Map::new())
        .unwrap();
    assert_eq!(text, format!("J:{bos}hi"));
}

/// Kimi's tokenizer sorts the tools' keys at every level before its template renders them
/// (`tokenization_kimi.py`: `deep_sort_dict`), so the declaration does not follow the
/// request's order; DeepSeek's templates see the tools as given.
#[test]
fn kimi_sorts_the_tools_keys() {
    let tools: Value = serde_json::from_str(
        r#"[{"type":"function","function":{"name":"f","parameters":{"type":"object","properties":{"b":{"type":"string"},"a":{"type":"integer"}}}}}]"#,
    )
    .unwrap();
    let messages: Value = serde_json::from_str(r#"[{"role":"user","content":"w?"}]"#).unwrap();
    let kimi = Tokenizer::from_dir(&text_fixture("kimi_style")).unwrap();
    let text = kimi
        .chat_template()
        .unwrap()
        .unwrap()
        .render_json(&messages, true, Some(&tools), &serde_json::Map::new())
        .unwrap();
    assert!(
        text.contains(
            r#"[{"function":{"name":"f","parameters":{"properties":{"a":{"type":"integer"},"b":{"type":"string"}},"type":"object"}},"type":"function"}]"#
        ),
        "{text}"
    );
    let from_file = kimi
        .chat_template_from_file(&text_fixture("kimi_style").join("tokenizer_config.json"))
        .unwrap()
        .render_json(&messages, true, Some(&tools), &serde_json::Map::new())
        .unwrap();
    assert_eq!(from_file, text);
}
