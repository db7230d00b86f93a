//! DeepSeek-V4's prompt encoder and completion parser against the seed's own encoder
//! (`encoding_dsv4.py` and its tokenizer wrapper, run by tools/text/make_dsv4_fixtures.py into
//! fixtures/text/dsv4_cases.json), byte for byte and id for id (spec `deepseek-v4.md` §5, §6
//! item 6), on the small V4-style tokenizer of fixtures/text/v4_style.

use std::path::PathBuf;

use cachalot_model::tokenizer::dsv4::{
    self, CompletionError, Content, Dsv4Error, EncodeOptions, ReasoningEffort, ThinkingMode,
    ToolCall, V4Message,
};
use cachalot_model::tokenizer::{ChatTemplate, Message, Tokenizer};
use serde_json::{Map, Value};

mod common;
use common::ids;

fn text_fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../fixtures/text")
        .join(name)
}

fn cases() -> Value {
    let s = std::fs::read_to_string(text_fixture("dsv4_cases.json")).unwrap();
    serde_json::from_str(&s).unwrap()
}

fn tokenizer() -> Tokenizer {
    Tokenizer::from_dir(&text_fixture("v4_style")).unwrap()
}

fn messages(v: &Value) -> Vec<V4Message> {
    serde_json::from_value(v.clone()).unwrap()
}

fn mode(v: &Value) -> ThinkingMode {
    match v.as_str().unwrap() {
        "chat" => ThinkingMode::Chat,
        "thinking" => ThinkingMode::Thinking,
        other => panic!("thinking_mode {other}"),
    }
}

fn options(case: &Value) -> EncodeOptions {
    EncodeOptions {
        thinking_mode: mode(&case["thinking_mode"]),
        drop_thinking: case["drop_thinking"].as_bool().unwrap(),
        add_bos: case["add_bos"].as_bool().unwrap(),
        reasoning_effort: match case["reasoning_effort"].as_str() {
            None => None,
            Some("high") => Some(ReasoningEffort::High),
            Some("max") => Some(ReasoningEffort::Max),
            Some(other) => panic!("reasoning_effort {other}"),
        },
    }
}

/// Each special-token string of the prompt is one id, and no id is added around it
/// (`add_special_tokens = false`).
fn check_special_tokens(name: &str, prompt: &str, got: &[u32]) {
    for (token, id) in dsv4::SPECIAL_TOKENS {
        let in_text = prompt.matches(token).count();
        let in_ids = got.iter().filter(|&&x| x == id).count();
        assert_eq!(
            in_text, in_ids,
            "{name}: {token} appears {in_text} times in the text, id {id} {in_ids} times"
        );
    }
}

#[test]
fn v4_dirs_get_the_v4_encoder_and_others_keep_jinja() {
    let tok = tokenizer();
    let t = tok.chat_template().unwrap().unwrap();
    assert!(t.is_deepseek_v4());
    let r1 = Tokenizer::from_dir(&text_fixture("r1_style")).unwrap();
    assert!(!r1.chat_template().unwrap().unwrap().is_deepseek_v4());
    for (token, id) in dsv4::SPECIAL_TOKENS {
        assert_eq!(tok.token_to_id(token), Some(id), "{token}");
    }
    // The plain-message interface: the generation prompt is V4's chat-mode opening.
    let s = t
        .render(
            &[Message::new("system", "S"), Message::new("user", "Hi")],
            true,
        )
        .unwrap();
    assert_eq!(
        s,
        "<｜begin▁of▁sentence｜>S<｜User｜>Hi<｜Assistant｜></think>"
    );
}

#[test]
fn wrapper_prompts_and_ids_match_the_seed() {
    let tok = tokenizer();
    let template = tok.chat_template().unwrap().unwrap();
    let all = cases();
    let list = all["wrapper"].as_array().unwrap();
    assert!(list.len() >= 15);
    for case in list {
        let name = case["name"].as_str().unwrap();
        let tools = case.get("tools").filter(|t| !t.is_null());
        let kwargs: Map<String, Value> = case["kwargs"].as_object().unwrap().clone();
        let got = template
            .render_json(&case["messages"], true, tools, &kwargs)
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        let want = case["prompt"].as_str().unwrap();
        assert_eq!(got, want, "{name}");
        let got_ids = tok.encode(&got).unwrap();
        assert_eq!(got_ids, ids(&case["ids"]), "{name}: token ids");
        check_special_tokens(name, &got, &got_ids);
        assert_eq!(got_ids[0], 0, "{name}: starts with BOS");
        assert_ne!(got_ids[1], 0, "{name}: a single BOS");
    }
}

#[test]
fn encode_messages_matches_the_seed() {
    let tok = tokenizer();
    let all = cases();
    let list = all["encode"].as_array().unwrap();
    assert!(list.len() >= 30);
    for case in list {
        let name = case["name"].as_str().unwrap();
        let got = dsv4::encode_messages(&messages(&case["messages"]), &options(case))
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(got, case["prompt"].as_str().unwrap(), "{name}");
        let got_ids = tok.encode(&got).unwrap();
        assert_eq!(got_ids, ids(&case["ids"]), "{name}: token ids");
        check_special_tokens(name, &got, &got_ids);
    }
}

#[test]
fn inputs_the_seed_rejects_are_errors() {
    let all = cases();
    let list = all["encode_errors"].as_array().unwrap();
    assert_eq!(list.len(), 5);
    for case in list {
        let name = case["name"].as_str().unwrap();
        let opts = EncodeOptions {
            thinking_mode: mode(&case["thinking_mode"]),
            ..EncodeOptions::default()
        };
        let err = dsv4::encode_messages(&messages(&case["messages"]), &opts).expect_err(name);
        let ok = match name {
            "invalid_task" => {
                err == Dsv4Error::InvalidTask {
                    index: 0,
                    task: "summarise".into(),
                }
            }
            "developer_empty" => err == Dsv4Error::EmptyDeveloper { index: 0 },
            "unknown_role" => {
                err == Dsv4Error::UnknownRole {
                    index: 0,
                    role: "narrator".into(),
                }
            }
            "arguments_not_an_object" => {
                err == Dsv4Error::ArgumentsNotObject {
                    index: 1,
                    call: 0,
                    name: "f".into(),
                }
            }
            "tool_without_function" => err == Dsv4Error::ToolWithoutFunction { index: 0, tool: 0 },
            other => panic!("no expectation for {other}"),
        };
        assert!(ok, "{name}: {err:?} (Python: {})", case["python_error"]);
        assert!(err.to_string().contains("messages["), "{name}: {err}");
    }
}

#[test]
fn template_errors_name_the_model_and_field() {
    let t = ChatTemplate::deepseek_v4("/models/v4/config.json");
    let msgs = serde_json::json!([{"role": "user", "content": 5}]);
    let e = t
        .render_json(&msgs, true, None, &Map::new())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("/models/v4/config.json") && e.contains("messages[0]"),
        "{e}"
    );
    let msgs = serde_json::json!([{"role": "user", "content": [{"type": "text", "text": "x"}]}]);
    let e = t
        .render_json(&msgs, true, None, &Map::new())
        .unwrap_err()
        .to_string();
    assert!(e.contains("must be a string"), "{e}");
    let e = t
        .render_json(&serde_json::json!({}), true, None, &Map::new())
        .unwrap_err()
        .to_string();
    assert!(e.contains("must be a list"), "{e}");
}

#[test]
fn completions_parse_like_the_seed() {
    let all = cases();
    let list = all["parse"].as_array().unwrap();
    assert!(list.len() >= 20);
    for case in list {
        let name = case["name"].as_str().unwrap();
        let text = case["text"].as_str().unwrap();
        let got = dsv4::parse_completion(text, mode(&case["thinking_mode"]));
        if case["result"].is_null() {
            let err = got.expect_err(name);
            let ok = match name {
                "err_missing_think_end" | "err_tool_calls_before_think_end" => {
                    err == CompletionError::MissingThinkEnd
                }
                "err_missing_eos" => err == CompletionError::MissingEos,
                "err_text_after_eos" | "err_text_after_tool_calls" => {
                    matches!(err, CompletionError::TrailingText(_))
                }
                "err_think_in_content" => err == CompletionError::SpecialTokenInContent("</think>"),
                "err_think_open_in_reasoning" => {
                    err == CompletionError::SpecialTokenInContent("<think>")
                }
                "err_bos_in_content" => err == CompletionError::SpecialTokenInContent(dsv4::BOS),
                "err_dsml_in_content" => err == CompletionError::SpecialTokenInContent(dsv4::DSML),
                "err_duplicate_parameter" => {
                    err == CompletionError::DuplicateParameter {
                        tool: "get_weather".into(),
                        param: "city".into(),
                    }
                }
                "err_bad_separator"
                | "err_bad_string_flag"
                | "err_bad_invoke_name"
                | "err_bad_after_parameter" => matches!(err, CompletionError::ToolCallFormat(_)),
                other => panic!("no expectation for {other}: {err:?}"),
            };
            assert!(ok, "{name}: {err:?} (Python: {})", case["python_error"]);
        } else {
            let got = got.unwrap_or_else(|e| panic!("{name}: {e}"));
            assert_eq!(
                serde_json::to_value(&got).unwrap(),
                case["result"],
                "{name}"
            );
        }
    }
}

/// The answer part of every well-formed completion (after the reasoning, without the EOS the
/// engine keeps out of the text) gives the content and calls the whole completion gives.
#[test]
fn answers_parse_like_completions() {
    use cachalot_model::tokenizer::ToolCallFormat;
    let all = cases();
    let mut with_calls = 0;
    for case in all["parse"].as_array().unwrap() {
        if case["result"].is_null() {
            continue;
        }
        let name = case["name"].as_str().unwrap();
        let text = case["text"].as_str().unwrap();
        let whole = dsv4::parse_completion(text, mode(&case["thinking_mode"])).unwrap();
        let answer = match mode(&case["thinking_mode"]) {
            ThinkingMode::Thinking => &text[text.find("</think>").unwrap() + "</think>".len()..],
            _ => text,
        };
        let answer = answer.strip_suffix(dsv4::EOS).unwrap_or(answer);
        let got = ToolCallFormat::DeepseekV4
            .parse(answer)
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        let content = match &whole.content {
            Some(dsv4::Content::Text(t)) => t.clone(),
            None => String::new(),
            other => panic!("{name}: {other:?}"),
        };
        assert_eq!(got.content, content, "{name}");
        let want = whole.tool_calls.unwrap_or_default();
        assert_eq!(got.tool_calls.len(), want.len(), "{name}");
        for (g, w) in got.tool_calls.iter().zip(&want) {
            assert_eq!(g.function, w.function, "{name}");
        }
        with_calls += usize::from(!want.is_empty());
    }
    assert!(with_calls >= 3, "{with_calls}");
}

/// Cut-off tool-call blocks, which the seed's parser lets through, are errors here.
#[test]
fn truncated_tool_calls_are_errors() {
    let full = "\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"f\">\n<｜DSML｜parameter name=\"a\" string=\"true\">x</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>";
    let ok = dsv4::parse_completion(full, ThinkingMode::Chat).unwrap();
    assert_eq!(
        ok.tool_calls.unwrap()[0].function.arguments,
        "{\"a\": \"x\"}"
    );
    for cut in [
        "\n\n<｜DSML｜tool_calls",
        "\n\n<｜DSML｜tool_calls>\n",
        "\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"f\">\n",
        "\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"f\">\n<｜DSML｜parameter name=\"a\" string=\"true\">x</｜DSML｜parameter>",
        "\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"f\">\n<｜DSML｜parameter name=\"a\" string=\"true\">x</｜DSML｜parameter>\n</｜DSML｜invoke",
        "\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"f\">\n<｜DSML｜parameter name=\"a\" string=\"true\">x</｜DSML｜parameter>\n</｜DSML｜invoke>\n",
    ] {
        let err = dsv4::parse_completion(cut, ThinkingMode::Chat).expect_err(cut);
        assert!(matches!(err, CompletionError::ToolCallFormat(_)), "{cut:?}: {err:?}");
    }
}

/// Rendering an assistant turn and parsing the model's part back gives the turn again
/// (arguments as the same JSON object).
#[test]
fn assistant_turns_round_trip() {
    let all = cases();
    let mut turns: Vec<V4Message> = Vec::new();
    for section in ["wrapper", "encode"] {
        for case in all[section].as_array().unwrap() {
            for m in messages(&case["messages"]) {
                if m.role == "assistant" && !m.wo_eos {
                    turns.push(m);
                }
            }
        }
    }
    turns.push(V4Message::assistant(
        "multi\n\nline <b> answer",
        "step 1\nstep 2",
        vec![ToolCall::function(
            "f",
            r#"{"s": "a \"q\" é", "n": -1.5e-9, "l": [true, null], "o": {"k": "<tag>"}}"#,
        )],
    ));
    assert!(turns.len() >= 15, "{} assistant turns", turns.len());
    let user = V4Message::new("user", "q");
    let mut checked = 0;
    for turn in &turns {
        // Turns with arguments that are not a JSON object do not come back as the same
        // arguments (they become one `arguments` parameter).
        let json_args = turn.tool_calls.iter().flatten().all(|c| {
            c.function
                .arguments
                .as_str()
                .and_then(|s| serde_json::from_str::<Value>(s).ok())
                .is_some_and(|v| v.is_object())
        });
        if !json_args {
            continue;
        }
        for mode in [ThinkingMode::Chat, ThinkingMode::Thinking] {
            let opts = EncodeOptions {
                thinking_mode: mode,
                drop_thinking: false,
                ..EncodeOptions::default()
            };
            let prefix = dsv4::encode_messages(std::slice::from_ref(&user), &opts).unwrap();
            let full = dsv4::encode_messages(&[user.clone(), turn.clone()], &opts).unwrap();
            let completion = full.strip_prefix(&prefix).expect("the prompt is a prefix");
            let back = dsv4::parse_completion(completion, mode)
                .unwrap_or_else(|e| panic!("{completion:?}: {e}"));
            let text = |c: &Option<Content>| match c {
                Some(Content::Text(s)) => s.clone(),
                None => String::new(),
                Some(Content::Parts(_)) => panic!("parts"),
            };
            assert_eq!(text(&back.content), text(&turn.content), "{completion:?}");
            let want_reasoning = match mode {
                ThinkingMode::Thinking => turn.reasoning_content.clone().unwrap_or_default(),
                ThinkingMode::Chat => String::new(),
            };
            assert_eq!(
                back.reasoning_content.unwrap(),
                want_reasoning,
                "{completion:?}"
            );
            let want: Vec<(String, Value)> = turn
                .tool_calls
                .iter()
                .flatten()
                .map(|c| {
                    let args = serde_json::from_str(c.function.arguments.as_str().unwrap());
                    (c.function.name.clone(), args.unwrap())
                })
                .collect();
            let got: Vec<(String, Value)> = back
                .tool_calls
                .unwrap()
                .iter()
                .map(|c| {
                    let args = c.function.arguments.as_str().unwrap();
                    (c.function.name.clone(), serde_json::from_str(args).unwrap())
                })
                .collect();
            assert_eq!(got, want, "{completion:?}");
            checked += 1;
        }
    }
    assert!(checked >= 20, "{checked} round trips");
}

fn random_cases() -> Value {
    let s = std::fs::read_to_string(text_fixture("dsv4_random_cases.json")).unwrap();
    serde_json::from_str(&s).unwrap()
}

/// Random conversations (every role, tool results out of call order, tasks, open turns, tools,
/// response formats) under random options render as the seed renders them.
#[test]
fn random_conversations_match_the_seed() {
    let all = random_cases();
    let list = all["conversations"].as_array().unwrap();
    assert!(list.len() >= 100);
    for (i, case) in list.iter().enumerate() {
        let got = dsv4::encode_messages(&messages(&case["messages"]), &options(case))
            .unwrap_or_else(|e| panic!("conversation {i}: {e}"));
        assert_eq!(
            got,
            case["prompt"].as_str().unwrap(),
            "conversation {i}: {}",
            case["messages"]
        );
    }
}

/// The random conversations cut at a random point: the tail encoded with the head as its
/// `context` renders as the seed renders it (no BOS after a context; tool results sorted and
/// thinking dropped by the whole conversation).
#[test]
fn random_conversations_continued_from_a_context_match_the_seed() {
    let all = random_cases();
    let conversations = all["conversations"].as_array().unwrap();
    let cases = all["context"].as_array().unwrap();
    assert!(cases.len() >= 80);
    let mut differs_from_whole = 0;
    for case in cases {
        let i = case["conversation"].as_u64().unwrap() as usize;
        let k = case["split"].as_u64().unwrap() as usize;
        let conv = &conversations[i];
        let all_messages = messages(&conv["messages"]);
        let (head, tail) = all_messages.split_at(k);
        let got = dsv4::encode_messages_with_context(head, tail, &options(conv));
        match (&case["python_error"], got) {
            (Value::Null, Ok(text)) => {
                assert_eq!(
                    text,
                    case["prompt"].as_str().unwrap(),
                    "conversation {i} cut at {k}"
                );
                // Where the whole prompt does not simply end with it, the context mattered.
                let whole = conv["prompt"].as_str().unwrap();
                if !whole.ends_with(&text) {
                    differs_from_whole += 1;
                }
            }
            (Value::Null, Err(e)) => panic!("conversation {i} cut at {k}: {e}"),
            (err, Ok(text)) => {
                panic!("conversation {i} cut at {k}: the seed raised {err}, got {text:?}")
            }
            (_, Err(_)) => {}
        }
    }
    // Dropped thinking and sorted results make some continuations differ from the whole
    // conversation's tail: the cases test the context's rules, not only concatenation.
    assert!(differs_from_whole > 0);
}

/// Rendered assistant turns, intact or randomly edited, parse (or fail) as the seed's parser
/// does, except that a tool-call block cut off at the end is an error here.
#[test]
fn random_completions_parse_like_the_seed() {
    let all = random_cases();
    let list = all["completions"].as_array().unwrap();
    assert!(list.len() >= 200);
    let (mut accepted, mut stricter) = (0, 0);
    for (i, case) in list.iter().enumerate() {
        let text = case["text"].as_str().unwrap();
        let got = dsv4::parse_completion(text, mode(&case["thinking_mode"]));
        match (got, case["result"].is_null()) {
            (Ok(m), false) => {
                assert_eq!(
                    serde_json::to_value(&m).unwrap(),
                    case["result"],
                    "completion {i}: {text:?}"
                );
                accepted += 1;
            }
            (Err(_), true) => {}
            (Err(e), false) => {
                // Only a block that does not end with `</｜DSML｜tool_calls>` (and EOS) may differ.
                let cut = !text
                    .trim_end_matches(dsv4::EOS)
                    .ends_with("</｜DSML｜tool_calls>");
                assert!(
                    cut && matches!(e, CompletionError::ToolCallFormat(_)),
                    "completion {i}: {text:?}: {e}"
                );
                stricter += 1;
            }
            (Ok(m), true) => panic!(
                "completion {i}: {text:?} parsed as {m:?}, the seed says {}",
                case["python_error"]
            ),
        }
    }
    assert!(accepted >= 60, "{accepted} accepted");
    assert!(stricter <= 10, "{stricter} cut-off blocks");
}
