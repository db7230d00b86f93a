//! `cachalot serve` end to end on the shipped small model: the OpenAI endpoints over real HTTP,
//! whole and streamed answers, concurrent requests batched by the engine, and errors that name
//! the field; prefill and decode servers behind `cachalot router` answer as one server.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};

use serde_json::{json, Value};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// A server on a free port; killed when dropped.
struct Server {
    child: Child,
    addr: String,
    /// What it wrote to stderr after its address.
    log: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
    /// Ended with SIGTERM (mpirun passes it to the ranks; SIGKILL would leave them behind).
    terminate: bool,
}

impl Drop for Server {
    fn drop(&mut self) {
        if self.terminate {
            // SAFETY: signals our own child.
            unsafe { libc::kill(self.child.id() as libc::pid_t, libc::SIGTERM) };
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
            while std::time::Instant::now() < deadline {
                if let Ok(Some(_)) = self.child.try_wait() {
                    return;
                }
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start(extra: &[&str]) -> Server {
    start_command("serve", extra)
}

/// `cachalot router` in front of a prefill and a decode server.
fn start_router(pre: &Server, dec: &Server) -> Server {
    let (p, d) = (
        format!("http://{}", pre.addr),
        format!("http://{}", dec.addr),
    );
    start_command("router", &["--prefill", &p, "--decode", &d])
}

/// `cachalot COMMAND --port 0 EXTRA…` (a server or the router), once it listens.
fn start_command(command: &str, extra: &[&str]) -> Server {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_cachalot"));
    cmd.args([command, "--port", "0"]).args(extra);
    spawn_server(cmd, false)
}

/// Starts `cmd` (a server that prints its address on stderr) and waits until it listens.
fn spawn_server(mut cmd: Command, terminate: bool) -> Server {
    let mut child = cmd
        .current_dir(root())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    // Every line is kept, those before the address too (ranks under a launcher print theirs
    // in any order).
    let mut early = Vec::new();
    let addr = loop {
        let line = lines
            .next()
            .expect("the server printed its address")
            .unwrap();
        if let Some(rest) = line.split("listening on http://").nth(1) {
            break rest.trim_end_matches("/v1").to_string();
        }
        early.push(line);
    };
    // Keep reading stderr so the server never blocks on a full pipe.
    let log = std::sync::Arc::new(std::sync::Mutex::new(early));
    let sink = log.clone();
    std::thread::spawn(move || {
        for l in lines.map_while(Result::ok) {
            sink.lock().unwrap().push(l);
        }
    });
    Server {
        child,
        addr,
        log,
        terminate,
    }
}

/// Starts a long completion at `addr` (whole or streamed), leaves after 300 ms, and waits until
/// `watched` (the server that runs it) has logged `aborts` aborted requests in all.
fn leave_a_long_request(addr: &str, stream: bool, watched: &Server, aborts: usize) {
    let body = json!({"prompt": "The whale", "max_tokens": 4000, "ignore_eos": true,
                      "stream": stream})
    .to_string();
    let mut s = TcpStream::connect(addr).unwrap();
    write!(
        s,
        "POST /v1/completions HTTP/1.1\r\nHost: {addr}\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    std::thread::sleep(std::time::Duration::from_millis(300));
    drop(s);
    let t = std::time::Instant::now();
    let seen = loop {
        let n = watched
            .log
            .lock()
            .unwrap()
            .iter()
            .filter(|l| l.contains("the client went away; aborted"))
            .count();
        if n == aborts || t.elapsed().as_secs() > 30 {
            break n;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    assert_eq!(seen, aborts, "stream {stream}: {:?}", watched.log);
}

/// One HTTP/1.1 exchange: the status and the body (chunked bodies decoded).
fn http(addr: &str, method: &str, path: &str, body: &str) -> (u16, String) {
    let mut s = TcpStream::connect(addr).unwrap();
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut r = BufReader::new(s);
    let mut status_line = String::new();
    r.read_line(&mut status_line).unwrap();
    let status: u16 = status_line
        .split_whitespace()
        .nth(1)
        .unwrap()
        .parse()
        .unwrap();
    let mut chunked = false;
    let mut length = None;
    loop {
        let mut h = String::new();
        r.read_line(&mut h).unwrap();
        let h = h.trim_end();
        if h.is_empty() {
            break;
        }
        let lower = h.to_ascii_lowercase();
        chunked |= lower == "transfer-encoding: chunked";
        if let Some(v) = lower.strip_prefix("content-length: ") {
            length = Some(v.parse::<usize>().unwrap());
        }
    }
    let mut out = Vec::new();
    if chunked {
        loop {
            let mut size = String::new();
            r.read_line(&mut size).unwrap();
            let n = usize::from_str_radix(size.trim(), 16).unwrap();
            let mut chunk = vec![0u8; n + 2];
            r.read_exact(&mut chunk).unwrap();
            if n == 0 {
                break;
            }
            out.extend_from_slice(&chunk[..n]);
        }
    } else if let Some(n) = length {
        out.resize(n, 0);
        r.read_exact(&mut out).unwrap();
    } else {
        r.read_to_end(&mut out).unwrap();
    }
    (status, String::from_utf8(out).unwrap())
}

fn post(addr: &str, path: &str, body: &Value) -> (u16, Value) {
    let (status, text) = http(addr, "POST", path, &body.to_string());
    (
        status,
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}")),
    )
}

/// The `data:` events of a streamed answer, `[DONE]` last.
fn events(addr: &str, path: &str, body: &Value) -> Vec<String> {
    let (status, text) = http(addr, "POST", path, &body.to_string());
    assert_eq!(status, 200, "{text}");
    // Comments (`: keep-alive`, sent while nothing else is) are skipped, as SSE clients do.
    let ev: Vec<String> = text
        .split("\n\n")
        .filter(|e| !e.is_empty() && !e.starts_with(':'))
        .map(|e| {
            e.strip_prefix("data: ")
                .expect("an SSE data line")
                .to_string()
        })
        .collect();
    assert_eq!(ev.last().map(String::as_str), Some("[DONE]"), "{text}");
    ev
}

#[test]
fn serve_answers_openai_requests_whole_streamed_and_concurrently() {
    let server = start(&["--batch-size", "4", "--kv-blocks", "64"]);
    let addr = server.addr.as_str();

    assert_eq!(http(addr, "GET", "/health", "").0, 200);
    let (status, models) = http(addr, "GET", "/v1/models", "");
    assert_eq!(status, 200);
    let models: Value = serde_json::from_str(&models).unwrap();
    assert_eq!(models["data"][0]["id"], "cachalot-tiny-r1");
    // One model by its id (OpenAI's models.retrieve).
    let (status, one) = http(addr, "GET", "/v1/models/cachalot-tiny-r1", "");
    assert_eq!(status, 200, "{one}");
    let one: Value = serde_json::from_str(&one).unwrap();
    assert_eq!(one, models["data"][0]);
    let (status, same) = http(addr, "GET", "/v1/models/cachalot%2Dtiny-r1", "");
    assert_eq!(status, 200, "{same}");
    let (status, e) = http(addr, "GET", "/v1/models/org/other", "");
    assert_eq!(status, 404, "{e}");
    assert!(e.contains("`org/other` does not exist"), "{e}");
    // An assistant turn with null content and no calls renders as an empty one (vLLM's).
    let (status, v) = post(
        addr,
        "/v1/chat/completions",
        &json!({"max_tokens": 2, "messages": [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": null}, {"role": "user", "content": "x"}]}),
    );
    assert_eq!(status, 200, "{v}");

    // Greedy from token ids equals the library's greedy run with the server's cache (bf16).
    let prompt: Vec<u32> = vec![0, 400, 401, 402, 403, 404];
    let completion = |prompt: &[u32], n: usize| {
        json!({"model": "cachalot-tiny-r1", "prompt": prompt, "max_tokens": n,
               "temperature": 0, "ignore_eos": true})
    };
    let (status, whole) = post(addr, "/v1/completions", &completion(&prompt, 12));
    assert_eq!(status, 200, "{whole}");
    assert_eq!(whole["object"], "text_completion");
    assert_eq!(whole["usage"]["prompt_tokens"], 6);
    assert_eq!(whole["usage"]["completion_tokens"], 12);
    assert_eq!(whole["choices"][0]["finish_reason"], "length");
    let dir = root().join("assets/cachalot-tiny-r1");
    let mut m = cachalot_model::DeepseekV3::load(&dir, Default::default()).unwrap();
    m.set_kv_cache_dtype(cachalot_model::KvCacheDtype::Bf16);
    let want = cachalot_model::eval::greedy(&m, &prompt, 12).unwrap();
    let tok = cachalot_model::tokenizer::Tokenizer::from_dir(&dir).unwrap();
    assert_eq!(
        whole["choices"][0]["text"].as_str().unwrap(),
        tok.decode(&want).unwrap()
    );

    // Streamed: the pieces make the same text; the finish and the usage chunk come last.
    let mut body = completion(&prompt, 12);
    body["stream"] = true.into();
    body["stream_options"] = json!({"include_usage": true});
    let ev = events(addr, "/v1/completions", &body);
    let chunks: Vec<Value> = ev[..ev.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    let text: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["text"].as_str())
        .collect();
    assert_eq!(text, whole["choices"][0]["text"].as_str().unwrap());
    assert!(chunks.len() > 3, "one chunk per piece of text");
    let finish = &chunks[chunks.len() - 2];
    assert_eq!(finish["choices"][0]["finish_reason"], "length");
    assert_eq!(chunks.last().unwrap()["usage"]["completion_tokens"], 12);
    // (OpenAI's: the chunks before it carry a null usage.)
    assert!(chunks[..chunks.len() - 1]
        .iter()
        .all(|c| c.get("usage") == Some(&Value::Null)));
    // Stream options given without include_usage include it (vLLM's default).
    let mut opts = body.clone();
    opts["stream_options"] = json!({});
    let ev = events(addr, "/v1/completions", &opts);
    let last: Value = serde_json::from_str(&ev[ev.len() - 2]).unwrap();
    assert_eq!(last["usage"]["completion_tokens"], 12, "{last}");
    // vLLM's continuous_usage_stats: every chunk carries the usage so far, which only grows
    // and ends at the whole answer's.
    body["stream_options"] = json!({"include_usage": true, "continuous_usage_stats": true});
    let ev = events(addr, "/v1/completions", &body);
    let counts: Vec<u64> = ev[..ev.len() - 2]
        .iter()
        .map(|e| {
            let c: Value = serde_json::from_str(e).unwrap();
            let u = &c["usage"];
            assert_eq!(u["prompt_tokens"], prompt.len(), "{c}");
            assert_eq!(
                u["total_tokens"],
                u["prompt_tokens"].as_u64().unwrap() + u["completion_tokens"].as_u64().unwrap(),
                "{c}"
            );
            u["completion_tokens"].as_u64().unwrap()
        })
        .collect();
    assert!(
        counts.windows(2).all(|w| w[0] <= w[1]) && counts[0] >= 1,
        "{counts:?}"
    );
    assert_eq!(counts.last(), Some(&12), "{counts:?}");

    // Four requests at once (batched by the engine) answer as each alone.
    let prompts: Vec<Vec<u32>> = (0..4u32)
        .map(|i| (0..(3 + 5 * i)).map(|j| 300 + 17 * i + j).collect())
        .collect();
    let alone: Vec<Value> = prompts
        .iter()
        .map(|p| post(addr, "/v1/completions", &completion(p, 10)).1)
        .collect();
    let together: Vec<Value> = std::thread::scope(|s| {
        let handles: Vec<_> = prompts
            .iter()
            .map(|p| s.spawn(move || post(addr, "/v1/completions", &completion(p, 10)).1))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (a, b) in alone.iter().zip(&together) {
        assert_eq!(a["choices"][0]["text"], b["choices"][0]["text"]);
    }

    // Chat: the template renders the prompt; R1's reasoning is apart; streamed deltas agree.
    let chat = json!({"messages": [{"role": "user", "content": "Tell me about whales."}],
                      "max_tokens": 24, "temperature": 0});
    let (status, whole) = post(addr, "/v1/chat/completions", &chat);
    assert_eq!(status, 200, "{whole}");
    assert_eq!(whole["object"], "chat.completion");
    let msg = &whole["choices"][0]["message"];
    assert_eq!(msg["role"], "assistant");
    let mut body = chat.clone();
    body["stream"] = true.into();
    let ev = events(addr, "/v1/chat/completions", &body);
    let (mut reasoning, mut content) = (String::new(), String::new());
    for e in &ev[..ev.len() - 1] {
        let c: Value = serde_json::from_str(e).unwrap();
        assert_eq!(c["object"], "chat.completion.chunk");
        let d = &c["choices"][0]["delta"];
        reasoning.push_str(d["reasoning_content"].as_str().unwrap_or_default());
        content.push_str(d["content"].as_str().unwrap_or_default());
    }
    assert_eq!(
        reasoning,
        msg["reasoning_content"].as_str().unwrap_or_default()
    );
    assert_eq!(content, msg["content"].as_str().unwrap_or_default());
    assert!(!(reasoning + &content).is_empty());
    // OpenAI's content parts reach R1's string template as one string.
    let parts = json!({"messages": [{"role": "user",
                                     "content": [{"type": "text", "text": "Tell me about whales."}]}],
                       "max_tokens": 24, "temperature": 0});
    let (status, p) = post(addr, "/v1/chat/completions", &parts);
    assert_eq!(status, 200, "{p}");
    assert_eq!(p["choices"][0]["message"], whole["choices"][0]["message"]);

    // Errors name the field, with OpenAI's error object.
    for (body, param) in [
        (json!({"prompt": "x", "temperature": "hot"}), "temperature"),
        (json!({"prompt": "x", "suffix": "y"}), "suffix"),
        (
            json!({"prompt": "x", "max_tokens": 1_000_000}),
            "max_tokens",
        ),
        (json!({"max_tokens": 4}), "prompt"),
        (json!({"prompt": [1, 2, 99999999]}), "prompt"),
        (json!({"prompt": "x", "stop": [1]}), "stop"),
        (
            json!({"prompt": "x", "stop_token_ids": 5}),
            "stop_token_ids",
        ),
        (
            json!({"prompt": "x", "stream_options": true}),
            "stream_options",
        ),
    ] {
        let (status, e) = post(addr, "/v1/completions", &body);
        assert_eq!(status, 400, "{body}: {e}");
        assert_eq!(e["error"]["param"], param, "{e}");
        assert_eq!(e["error"]["type"], "invalid_request_error");
    }
    let (status, e) = post(
        addr,
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "hi"}], "tool_choice": "required"}),
    );
    assert_eq!(
        (status, e["error"]["param"].as_str()),
        (400, Some("tool_choice"))
    );
    // Fields clients send when they do not use a feature are accepted.
    let (status, e) = post(
        addr,
        "/v1/completions",
        &json!({"prompt": "x", "max_tokens": 2, "logit_bias": {}, "suffix": "", "logprobs": null}),
    );
    assert_eq!(status, 200, "{e}");
    let (status, e) = post(addr, "/v1/chat/completions", &json!({"messages": "hi"}));
    assert_eq!(
        (status, e["error"]["param"].as_str()),
        (400, Some("messages"))
    );
    let (status, e) = post(
        addr,
        "/v1/completions",
        &json!({"prompt": "x", "model": "gpt-4"}),
    );
    assert_eq!((status, e["error"]["param"].as_str()), (404, Some("model")));
    let (status, text) = http(addr, "POST", "/v1/completions", "{not json");
    assert_eq!(status, 400);
    assert!(text.contains("not valid JSON"), "{text}");
    let (status, text) = http(addr, "POST", "/v1/completions", r#"{"prompt": "a\ud800b"}"#);
    assert_eq!(status, 400);
    assert!(text.contains("surrogate"), "{text}");
    assert_eq!(http(addr, "GET", "/v1/nothing", "").0, 404);
    assert_eq!(http(addr, "GET", "/v1/completions", "").0, 405);
    // A 405 says what the endpoint takes (its Allow header too); HEAD answers as GET without
    // a body; a trailing slash names the same endpoint.
    let mut raw = TcpStream::connect(addr).unwrap();
    write!(
        raw,
        "DELETE /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut answer = String::new();
    raw.read_to_string(&mut answer).unwrap();
    assert!(answer.starts_with("HTTP/1.1 405"), "{answer}");
    assert!(answer.contains("Allow: GET, HEAD"), "{answer}");
    assert!(answer.contains("invalid_request_error"), "{answer}");
    let mut raw = TcpStream::connect(addr).unwrap();
    write!(
        raw,
        "HEAD /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut answer = String::new();
    raw.read_to_string(&mut answer).unwrap();
    assert!(
        answer.starts_with("HTTP/1.1 200") && answer.ends_with("\r\n\r\n"),
        "{answer}"
    );
    assert_eq!(http(addr, "GET", "/v1/models/", "").0, 200);

    // The server still answers after all that.
    let (status, again) = post(addr, "/v1/completions", &completion(&prompt, 12));
    assert_eq!(status, 200);
    assert_eq!(again["choices"][0]["text"], whole_text(&tok, &want));

    // logit_bias (token ids as keys): +100 on one token makes greedy decoding write only it,
    // −100 on greedy's first token makes the answer start otherwise.
    let the = tok.encode(" the").unwrap();
    assert_eq!(the.len(), 1, "{the:?}");
    let mut body = completion(&prompt, 4);
    body["logit_bias"] = json!({ the[0].to_string(): 100 });
    let (status, forced) = post(addr, "/v1/completions", &body);
    assert_eq!(status, 200, "{forced}");
    assert_eq!(forced["choices"][0]["text"], " the the the the");
    // A special token the model writes is not in the text unless `skip_special_tokens` is
    // false (vLLM's default and field).
    let user = tok.token_to_id("<｜User｜>").unwrap();
    assert!(tok.skipped_in_text(user));
    let mut body = completion(&prompt, 3);
    body["logit_bias"] = json!({ user.to_string(): 100 });
    let (status, skipped) = post(addr, "/v1/completions", &body);
    assert_eq!(status, 200, "{skipped}");
    assert_eq!(skipped["choices"][0]["text"], "");
    assert_eq!(skipped["usage"]["completion_tokens"], 3);
    body["skip_special_tokens"] = false.into();
    let (status, kept) = post(addr, "/v1/completions", &body);
    assert_eq!(status, 200, "{kept}");
    assert_eq!(kept["choices"][0]["text"], "<｜User｜>".repeat(3));
    body["skip_special_tokens"] = "no".into();
    let (status, e) = post(addr, "/v1/completions", &body);
    assert_eq!(status, 400, "{e}");
    assert_eq!(e["error"]["param"], "skip_special_tokens", "{e}");
    let mut body = completion(&prompt, 12);
    body["logit_bias"] = json!({ want[0].to_string(): -100.0, "5": 0 });
    body["logprobs"] = 1.into();
    let (status, banned) = post(addr, "/v1/completions", &body);
    assert_eq!(status, 200, "{banned}");
    assert_eq!(banned["usage"]["completion_tokens"], 12);
    let first = banned["choices"][0]["logprobs"]["tokens"][0]
        .as_str()
        .unwrap();
    assert_ne!(first, tok.decode(&want[..1]).unwrap(), "{banned}");
    for bias in [
        json!({"x": 1}),
        json!({"99999999": 1}),
        json!({"5": 1, "05": 1}),
        json!({"5": 101}),
        json!({"5": "big"}),
        json!([5]),
    ] {
        let mut body = completion(&prompt, 2);
        body["logit_bias"] = bias.clone();
        let (status, e) = post(addr, "/v1/completions", &body);
        assert_eq!(status, 400, "{bias}: {e}");
        assert_eq!(e["error"]["param"], "logit_bias", "{e}");
    }

    // min_tokens (vLLM): greedy's first token as a stop token ends the answer at once, but
    // not before min_tokens tokens; a stop string at the answer's start is text before then.
    let mut body = completion(&prompt, 12);
    body["ignore_eos"] = false.into();
    body["stop_token_ids"] = json!([want[0]]);
    let (status, a) = post(addr, "/v1/completions", &body);
    assert_eq!(status, 200, "{a}");
    assert_eq!(a["usage"]["completion_tokens"], 1, "{a}");
    body["min_tokens"] = 5.into();
    body["logprobs"] = 1.into();
    let (status, a) = post(addr, "/v1/completions", &body);
    assert_eq!(status, 200, "{a}");
    let first = tok.decode(&want[..1]).unwrap();
    let tokens = a["choices"][0]["logprobs"]["tokens"].as_array().unwrap();
    assert!(tokens.len() >= 5, "{a}");
    assert!(
        tokens[..5].iter().all(|t| t.as_str() != Some(&first)),
        "{a}"
    );
    let start = tok.decode(&want[..2]).unwrap();
    let mut body = completion(&prompt, 12);
    body["ignore_eos"] = false.into();
    body["stop"] = json!([start.clone()]);
    // The answer's text and finish reason with `min_tokens` (None: without).
    let answer = |min_tokens: Option<u64>| -> (String, Value) {
        let mut b = body.clone();
        if let Some(m) = min_tokens {
            b["min_tokens"] = m.into();
        }
        let (status, a) = post(addr, "/v1/completions", &b);
        assert_eq!(status, 200, "{a}");
        let c = &a["choices"][0];
        (
            c["text"].as_str().unwrap().to_string(),
            c["finish_reason"].clone(),
        )
    };
    assert_eq!(answer(None), (String::new(), "stop".into()));
    // vLLM's include_stop_str_in_output: the stop string ends the text, whole and streamed.
    let mut inc = body.clone();
    inc["include_stop_str_in_output"] = true.into();
    let (status, a) = post(addr, "/v1/completions", &inc);
    assert_eq!(status, 200, "{a}");
    assert_eq!(a["choices"][0]["text"], start.as_str(), "{a}");
    assert_eq!(a["choices"][0]["finish_reason"], "stop", "{a}");
    inc["stream"] = true.into();
    let streamed: String = events(addr, "/v1/completions", &inc)
        .iter()
        .filter_map(|e| serde_json::from_str::<Value>(e).ok())
        .map(|v| v["choices"][0]["text"].as_str().unwrap_or("").to_string())
        .collect();
    assert_eq!(streamed, start);
    assert!(answer(Some(4)).0.starts_with(&start));
    // The stop string spans tokens 1-2: with min_tokens 1 it ends after the first token's
    // text and counts (vLLM searches back from where its check starts); with 2 it is text.
    assert_eq!(answer(Some(1)), (String::new(), "stop".into()));
    let (text, _) = answer(Some(2));
    assert!(
        text.starts_with(&start) && text.len() > start.len(),
        "{text:?}"
    );
    body["min_tokens"] = 13.into();
    let (status, e) = post(addr, "/v1/completions", &body);
    assert_eq!(
        (status, e["error"]["param"].as_str()),
        (400, Some("min_tokens")),
        "{e}"
    );

    // vLLM's /tokenize and /detokenize: the ids a completion or chat request would have.
    let text = "Once upon a time";
    let (status, t) = post(addr, "/tokenize", &json!({"prompt": text}));
    assert_eq!(status, 200, "{t}");
    let ids: Vec<u32> = serde_json::from_value(t["tokens"].clone()).unwrap();
    let mut want_ids: Vec<u32> = tok.prompt_bos_id().into_iter().collect();
    want_ids.extend(tok.encode(text).unwrap());
    assert_eq!(ids, want_ids);
    assert_eq!(t["count"], ids.len());
    assert_eq!(t["max_model_len"], models["data"][0]["max_model_len"]);
    let (_, bare) = post(
        addr,
        "/tokenize",
        &json!({"prompt": text, "add_special_tokens": false}),
    );
    assert_eq!(bare["tokens"], json!(tok.encode(text).unwrap()));
    let (status, d) = post(addr, "/detokenize", &json!({"tokens": bare["tokens"]}));
    assert_eq!((status, d["prompt"].as_str()), (200, Some(text)), "{d}");
    let messages = json!([{"role": "user", "content": "Tell me about whales."}]);
    let (status, chat) = post(
        addr,
        "/v1/chat/completions",
        &json!({"messages": messages, "max_tokens": 2}),
    );
    assert_eq!(status, 200, "{chat}");
    let (_, t) = post(addr, "/tokenize", &json!({"messages": messages}));
    assert_eq!(t["count"], chat["usage"]["prompt_tokens"], "{t}");
    // continue_final_message: the prompt ends inside the final (assistant) message, its
    // end-of-turn markers cut, for the model to continue; not with add_generation_prompt.
    let partial = json!([{"role": "user", "content": "Name a whale."},
                         {"role": "assistant", "content": "The blue"}]);
    let (status, t) = post(
        addr,
        "/tokenize",
        &json!({"messages": partial, "continue_final_message": true}),
    );
    assert_eq!(status, 200, "{t}");
    let (_, d) = post(addr, "/detokenize", &json!({"tokens": t["tokens"]}));
    assert!(d["prompt"].as_str().unwrap().ends_with("The blue"), "{d}");
    // Where the final text also spells part of the template's own markup (`A` in
    // `<｜Assistant｜>`), or is empty, the prompt is cut after the message, as transformers
    // cuts it (a marker after the text).
    // A null content beside calls, or an empty one beside reasoning R1's template does not
    // render, is continued as the empty text it is to vLLM.
    let call =
        json!([{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]);
    for (last, end) in [
        (json!({"content": "A"}), "<｜Assistant｜>A"),
        (json!({"content": ""}), "<｜Assistant｜>"),
        (json!({"content": "hi"}), "<｜Assistant｜>hi"),
        (
            json!({"content": null, "tool_calls": call}),
            "<｜Assistant｜>",
        ),
        (
            json!({"content": "", "reasoning_content": "abc"}),
            "<｜Assistant｜>",
        ),
    ] {
        let mut a = json!({"role": "assistant"});
        for (k, v) in last.as_object().unwrap() {
            a[k] = v.clone();
        }
        let content = last.clone();
        let m = json!([{"role": "user", "content": "hi"}, a]);
        let (status, t) = post(
            addr,
            "/tokenize",
            &json!({"messages": m, "continue_final_message": true, "add_generation_prompt": false}),
        );
        assert_eq!(status, 200, "{t}");
        let (_, d) = post(addr, "/detokenize", &json!({"tokens": t["tokens"]}));
        assert!(
            d["prompt"]
                .as_str()
                .unwrap()
                .ends_with(&format!("<｜User｜>hi{end}")),
            "{content:?}: {d}"
        );
    }
    // An assistant's calls without a content key render (as vLLM passes them); a bare string
    // or an `input_text` part is a text part.
    for m in [
        json!([{"role": "user", "content": "Hi"}, {"role": "assistant", "tool_calls": call},
               {"role": "tool", "tool_call_id": "c1", "content": "r"}]),
        json!([{"role": "user", "content": ["Hi", {"type": "input_text", "text": "there"}]},
               {"role": "assistant"}, {"role": "user", "content": "x"}]),
    ] {
        let (status, t) = post(addr, "/tokenize", &json!({"messages": m}));
        assert_eq!(status, 200, "{m}: {t}");
    }
    // `tool_calls: null` or `[]` is an assistant turn without calls (clients serialize the
    // whole message), and a `developer` message is a system message to a template that knows
    // no developer role (R1's).
    let plain = json!([{"role": "user", "content": "Hi"},
                       {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "x"}]);
    let (_, want) = post(addr, "/tokenize", &json!({"messages": plain}));
    for calls in [Value::Null, json!([])] {
        let mut m = plain.clone();
        m[1]["tool_calls"] = calls;
        let (_, t) = post(addr, "/tokenize", &json!({"messages": m}));
        assert_eq!(t["tokens"], want["tokens"], "{m}");
    }
    let as_system = |role: &str| {
        let m = json!([{"role": role, "content": "Be brief."}, {"role": "user", "content": "Hi"}]);
        post(addr, "/tokenize", &json!({"messages": m})).1["tokens"].clone()
    };
    assert_eq!(as_system("developer"), as_system("system"));
    let (status, e) = post(
        addr,
        "/v1/chat/completions",
        &json!({"messages": plain, "tool_choice": "auto"}),
    );
    assert_eq!(
        (status, e["error"]["param"].as_str()),
        (400, Some("tool_choice"))
    );
    // A history call's arguments must be a JSON text, as OpenAI's.
    let object_args = json!([{"role": "user", "content": "q"},
        {"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
            "function": {"name": "f", "arguments": {"a": 1}}}]},
        {"role": "user", "content": "x"}]);
    let (status, e) = post(
        addr,
        "/v1/chat/completions",
        &json!({"messages": object_args, "max_tokens": 1}),
    );
    assert_eq!(status, 400, "{e}");
    let m = e["error"]["message"].as_str().unwrap();
    assert!(
        m.contains("messages[1].tool_calls[0].function.arguments"),
        "{m}"
    );
    // A whole number as a float or a string of digits is that number (vLLM's lax reading);
    // a fraction is not.
    for (max, ok) in [(json!(2.0), true), (json!("2"), true), (json!(2.5), false)] {
        let (status, c) = post(
            addr,
            "/v1/completions",
            &json!({"prompt": "Hi", "max_tokens": max, "ignore_eos": true}),
        );
        if ok {
            assert_eq!(
                (status, &c["usage"]["completion_tokens"]),
                (200, &json!(2)),
                "{c}"
            );
        } else {
            assert_eq!(
                (status, c["error"]["param"].as_str()),
                (400, Some("max_tokens"))
            );
        }
    }
    // So is every other integer field (with its negative forms where it takes one).
    for (extra, ok) in [
        (json!({"logprobs": 2.0}), true),
        (json!({"logprobs": "2"}), true),
        (json!({"logprobs": 2.5}), false),
        (json!({"top_k": "-1"}), true),
        (json!({"top_k": 3.0}), true),
        (json!({"top_k": "-2"}), false),
        (json!({"seed": "-7"}), true),
        (json!({"seed": 7.0}), true),
        (json!({"seed": "x"}), false),
        (json!({"prompt_logprobs": "1"}), true),
        (json!({"truncate_prompt_tokens": -1.0}), true),
        (json!({"stop_token_ids": ["1"]}), true),
        (json!({"stop_token_ids": [1.5]}), false),
    ] {
        let mut body = json!({"prompt": "Hi", "max_tokens": 2, "ignore_eos": true});
        body.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        let (status, c) = post(addr, "/v1/completions", &body);
        assert_eq!(status == 200, ok, "{extra}: {c}");
    }
    let (status, c) = post(
        addr,
        "/v1/chat/completions",
        &json!({"messages": partial, "continue_final_message": true,
                "add_generation_prompt": false, "max_tokens": 3, "temperature": 0}),
    );
    assert_eq!(
        (status, &c["usage"]["prompt_tokens"]),
        (200, &t["count"]),
        "{c}"
    );
    let (status, e) = post(
        addr,
        "/v1/chat/completions",
        &json!({"messages": partial, "continue_final_message": true,
                "add_generation_prompt": true}),
    );
    assert_eq!(
        (status, e["error"]["param"].as_str()),
        (400, Some("continue_final_message")),
        "{e}"
    );
    for (path, body, param) in [
        ("/tokenize", json!({}), "prompt"),
        ("/tokenize", json!({"prompt": 5}), "prompt"),
        (
            "/tokenize",
            json!({"prompt": "x", "messages": messages}),
            "messages",
        ),
        ("/detokenize", json!({"tokens": [99999999]}), "tokens"),
        ("/detokenize", json!({"tokens": "x"}), "tokens"),
        // An unknown role, content that is not text (or missing outside an assistant
        // message) are refused, not dropped or passed to the template.
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "wizard", "content": "hi"}]}),
            "messages",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}),
            "messages",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": 5}]}),
            "messages",
        ),
        (
            "/tokenize",
            json!({"messages": [{"role": "user", "content": null}]}),
            "messages",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "repetition_penalty": 0}),
            "repetition_penalty",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "stop": ""}),
            "stop",
        ),
        // Bootstrap fields are for a decode server: one serving requests whole refuses them
        // (a router's prefilled KV would wait for it in vain).
        (
            "/v1/completions",
            json!({"prompt": "Hi", "bootstrap_room": 5}),
            "bootstrap_room",
        ),
        // A `model` that is not a name is the request's error (400), not another model (404).
        (
            "/v1/completions",
            json!({"prompt": "Hi", "model": 5}),
            "model",
        ),
    ] {
        let (status, e) = post(addr, path, &body);
        assert_eq!(
            (status, e["error"]["param"].as_str()),
            (400, Some(param)),
            "{path} {body}: {e}"
        );
    }
    assert_eq!(http(addr, "GET", "/tokenize", "").0, 405);
}

fn whole_text(tok: &cachalot_model::tokenizer::Tokenizer, ids: &[u32]) -> String {
    tok.decode(ids).unwrap()
}

/// The context a request may take is the model's positions within the KV pool: a chat request
/// without `max_tokens` gets the rest of it, and `/v1/models` says how much that is.
#[test]
fn serve_bounds_the_context_by_the_kv_pool() {
    let server = start(&[
        "--batch-size",
        "4",
        "--kv-blocks",
        "3",
        "--block-size",
        "16",
    ]);
    let addr = server.addr.as_str();
    let (_, models) = http(addr, "GET", "/v1/models", "");
    let models: Value = serde_json::from_str(&models).unwrap();
    assert_eq!(models["data"][0]["max_model_len"], 32);
    let chat = json!({"messages": [{"role": "user", "content": "Hi"}], "temperature": 0,
                      "ignore_eos": true});
    let (status, r) = post(addr, "/v1/chat/completions", &chat);
    assert_eq!(status, 200, "{r}");
    assert_eq!(r["usage"]["total_tokens"], 32, "{r}");
    assert_eq!(r["choices"][0]["finish_reason"], "length");
    let (status, e) = post(
        addr,
        "/v1/completions",
        &json!({"prompt": "x", "max_tokens": 40}),
    );
    assert_eq!(
        (status, e["error"]["param"].as_str()),
        (400, Some("max_tokens"))
    );
    // A request announcing a body over the limit (any path) gets a 413 before any of it is
    // read, framed (a Content-Length, the connection closed after it) where the announced
    // length could be allocated; an absurd one (tiny_http would allocate it to discard the
    // body) gets it unframed; the server lives on.
    for (path, announced) in [
        ("/v1/completions", "100000000"),
        ("/health", "100000000000"),
    ] {
        let mut s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(std::time::Duration::from_secs(20)))
            .unwrap();
        write!(
            s,
            "POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
             Content-Length: {announced}\r\n\r\n{{}}"
        )
        .unwrap();
        let mut got = Vec::new();
        let mut buf = [0u8; 4096];
        while !String::from_utf8_lossy(&got).contains("limit\"") {
            let n = s.read(&mut buf).unwrap();
            assert!(n > 0, "{}", String::from_utf8_lossy(&got));
            got.extend_from_slice(&buf[..n]);
        }
        let text = String::from_utf8_lossy(&got).to_ascii_lowercase();
        let (head, body) = text.split_once("\r\n\r\n").unwrap();
        assert!(head.starts_with("http/1.1 413"), "{text}");
        assert!(body.contains(announced), "{text}");
        let framed = head.contains("\r\ncontent-length:");
        assert_eq!(framed, announced.len() < 11, "{path}: {text}");
        assert_eq!(http(addr, "GET", "/health", "").0, 200);
    }
    // Messages OpenAI clients send that carry no text: an assistant's refusal, a tool's or
    // function's empty result; accepted.
    let history = json!([
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": [{"type": "refusal", "refusal": "No."}]},
        {"role": "assistant", "content": null,
         "tool_calls": [{"id": "c1", "type": "function",
                         "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": null},
        {"role": "function", "name": "f", "content": null},
        {"role": "user", "content": "Again?"}]);
    let (status, t) = post(addr, "/tokenize", &json!({"messages": history}));
    assert_eq!(status, 200, "{t}");
    // A field the server does not read is answered as without it, and logged (as vLLM does).
    let (status, r) = post(
        addr,
        "/v1/completions",
        &json!({"prompt": "x", "max_tokns": 2}),
    );
    assert_eq!(status, 200, "{r}");
    let logged = || {
        let log = server.log.lock().unwrap();
        log.iter()
            .any(|l| l.contains("fields ignored") && l.contains("max_tokns"))
    };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while !logged() && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    assert!(logged(), "{:?}", server.log.lock().unwrap());
}

/// A client that leaves before its answer is done has its request aborted, whole or streamed
/// (one sequence at a time here, so a request left running would hold the only slot).
#[test]
fn serve_aborts_requests_whose_client_left() {
    // Spaces every 50 ms: the departed client is noticed long before the 4000 tokens are done.
    let server = start(&[
        "--batch-size",
        "1",
        "--kv-blocks",
        "40",
        "--keepalive-ms",
        "50",
    ]);
    let addr = server.addr.as_str();
    for stream in [false, true] {
        leave_a_long_request(addr, stream, &server, usize::from(stream) + 1);
    }
    // A streamed request whose client leaves while it waits behind another is aborted while
    // it waits (keep-alive comments find the closed connection), not once it runs: the other
    // is still running when the abort is logged.
    let holder = {
        let addr = addr.to_string();
        std::thread::spawn(move || {
            post(
                &addr,
                "/v1/completions",
                &json!({"prompt": "The whale", "max_tokens": 4000, "ignore_eos": true}),
            )
        })
    };
    let running = || {
        let (_, metrics) = http(addr, "GET", "/metrics", "");
        metrics
            .lines()
            .any(|l| l.starts_with("cachalot:num_requests_running") && !l.ends_with(" 0"))
    };
    let t = std::time::Instant::now();
    while !running() {
        assert!(t.elapsed().as_secs() < 60, "the request never ran");
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    leave_a_long_request(addr, true, &server, 3);
    assert!(
        running(),
        "the queued request was not aborted while it waited"
    );
    assert_eq!(holder.join().unwrap().0, 200);
    // The slot is free again: a short request is answered.
    let (status, r) = post(
        addr,
        "/v1/completions",
        &json!({"prompt": "x", "max_tokens": 2}),
    );
    assert_eq!(status, 200, "{r}");
}

/// The first non-empty text of a streamed completion's events.
fn first_piece(ev: &[String]) -> String {
    ev.iter()
        .filter_map(|e| serde_json::from_str::<Value>(e).ok())
        .map(|v| v["choices"][0]["text"].as_str().unwrap_or("").to_string())
        .find(|t| !t.is_empty())
        .unwrap()
}

/// A server's `generation_tokens_total` from `/metrics`.
fn generated_total(addr: &str) -> f64 {
    let (_, m) = http(addr, "GET", "/metrics", "");
    m.lines()
        .find(|l| l.starts_with("cachalot:generation_tokens_total{"))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("{m}"))
}

/// Prefill and decode servers over several ranks each (the seed's disaggregated deployment):
/// a tensor-parallel prefill server and a data-parallel decode server, then an expert-parallel
/// decode server, behind the router, answer as one server; concurrent requests spread over
/// the decode ranks.
#[test]
fn prefill_and_decode_servers_over_ranks_answer_as_one_server() {
    let one = start(&["--kv-blocks", "64"]);
    let pre = start(&[
        "--role",
        "prefill",
        "--kv-port",
        "0",
        "--kv-blocks",
        "64",
        "--ranks",
        "2",
        "--parallel",
        "tensor",
    ]);
    let greedy = json!({"prompt": "The meaning of life is", "max_tokens": 16,
                        "temperature": 0, "ignore_eos": true});
    let sampled = json!({"prompt": "Once upon a time", "max_tokens": 16, "temperature": 0.8,
                         "seed": 3, "ignore_eos": true});
    let prompts = [
        "A",
        "In the beginning",
        "Knowledge is",
        "The sea",
        "My friend",
    ];
    let text_of = |v: &Value| v["choices"][0]["text"].as_str().unwrap().to_string();
    let want: Vec<String> = prompts
        .iter()
        .map(|p| {
            let mut b = greedy.clone();
            b["prompt"] = (*p).into();
            text_of(&post(&one.addr, "/v1/completions", &b).1)
        })
        .collect();
    for parallel in ["data", "expert"] {
        let dec = start(&[
            "--role",
            "decode",
            "--kv-blocks",
            "64",
            "--ranks",
            "2",
            "--parallel",
            parallel,
        ]);
        let router = start_router(&pre, &dec);
        let r = router.addr.as_str();
        // The decode server counts every generated token, the prefilled first one too (as
        // vLLM's decode instance counts its answers' tokens).
        let (status, v) = post(r, "/v1/completions", &greedy);
        assert_eq!(status, 200, "{v}");
        let t = std::time::Instant::now();
        while generated_total(&dec.addr) != 16.0 && t.elapsed().as_secs() < 5 {
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        assert_eq!(generated_total(&dec.addr), 16.0, "{parallel}");
        // Streamed, the first piece is the prefilled token's alone, as one server streams it.
        let mut stream = greedy.clone();
        stream["stream"] = true.into();
        assert_eq!(
            first_piece(&events(r, "/v1/completions", &stream)),
            first_piece(&events(&one.addr, "/v1/completions", &stream)),
            "{parallel}"
        );
        for body in [&greedy, &sampled] {
            let (s1, a) = post(&one.addr, "/v1/completions", body);
            let (s2, b) = post(r, "/v1/completions", body);
            assert_eq!((s1, s2), (200, 200), "{parallel}: {a} {b}");
            assert_eq!(text_of(&a), text_of(&b), "{parallel}: {body}");
        }
        // Two choices over the ranks: each choice's KV through the room, decoded on its rank.
        let mut two = sampled.clone();
        two["n"] = 2.into();
        let (s1, a) = post(&one.addr, "/v1/completions", &two);
        let (s2, b) = post(r, "/v1/completions", &two);
        assert_eq!((s1, s2), (200, 200), "{parallel}: {a} {b}");
        for i in 0..2 {
            assert_eq!(
                a["choices"][i]["text"], b["choices"][i]["text"],
                "{parallel}: choice {i}"
            );
        }
        let got: Vec<String> = std::thread::scope(|s| {
            let hs: Vec<_> = prompts
                .iter()
                .map(|p| {
                    let mut b = greedy.clone();
                    b["prompt"] = (*p).into();
                    s.spawn(move || {
                        let (status, v) = post(r, "/v1/completions", &b);
                        assert_eq!(status, 200, "{v}");
                        text_of(&v)
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert_eq!(got, want, "{parallel}");
    }
}

/// Prefill/decode disaggregation (executor spec §5): a prefill server and a decode server (other
/// block size) behind the router answer greedy, seeded-sampling, chat, streamed and concurrent
/// requests as one server does; what goes wrong says where.
#[test]
fn prefill_and_decode_servers_behind_the_router_answer_as_one_server() {
    let one = start(&["--kv-blocks", "64"]);
    // The prefill server's pool holds 128 positions (8 blocks of 16), the decode server's more.
    let pre = start(&[
        "--role",
        "prefill",
        "--kv-port",
        "0",
        "--block-size",
        "16",
        "--kv-blocks",
        "9",
    ]);
    let dec = start(&["--role", "decode", "--kv-blocks", "64", "--batch-size", "3"]);
    let kv_port = {
        let (status, h) = http(&pre.addr, "GET", "/health", "");
        assert_eq!(status, 200);
        let h: Value = serde_json::from_str(&h).unwrap();
        assert_eq!(h["disaggregation_mode"], "prefill");
        h["kv_port"].as_u64().unwrap()
    };
    let router = start_router(&pre, &dec);
    // CORS as the servers': preflights answered, relayed answers marked.
    let r = &router.addr;
    let pre_flight = head_of(
        r,
        &format!(
            "OPTIONS /v1/completions HTTP/1.1\r\nHost: {r}\r\nOrigin: http://x\r\n\
             Access-Control-Request-Method: POST\r\nConnection: close\r\n\r\n"
        ),
    );
    assert!(
        pre_flight.starts_with("http/1.1 200")
            && pre_flight.contains("access-control-allow-origin: *"),
        "{pre_flight}"
    );
    let models = head_of(
        r,
        &format!("GET /v1/models HTTP/1.1\r\nHost: {r}\r\nConnection: close\r\n\r\n"),
    );
    assert!(
        models.contains("access-control-allow-origin: *"),
        "{models}"
    );
    let r = router.addr.as_str();
    let (status, card) = http(r, "GET", "/v1/models/cachalot-tiny-r1", "");
    assert_eq!(status, 200, "{card}");
    let text_of = |v: &Value| v["choices"][0]["text"].as_str().unwrap().to_string();

    let greedy = json!({"prompt": "The meaning of life is", "max_tokens": 24,
                        "temperature": 0, "ignore_eos": true});
    let sampled = json!({"prompt": "Once upon a time", "max_tokens": 24, "temperature": 0.8,
                         "top_p": 0.95, "seed": 11, "ignore_eos": true});
    for body in [&greedy, &sampled] {
        let (s1, a) = post(&one.addr, "/v1/completions", body);
        let (s2, b) = post(r, "/v1/completions", body);
        assert_eq!((s1, s2), (200, 200), "{a} {b}");
        assert_eq!(text_of(&a), text_of(&b), "{body}");
        assert_eq!(a["usage"], b["usage"]);
    }
    // `n` choices and several prompts: each choice prefilled on the prefill server and decoded
    // on the decode server (its KV one of the room's), as one server answers them.
    for body in [
        json!({"prompt": "Once upon a time", "max_tokens": 10, "temperature": 0.9,
               "seed": 40, "n": 3, "ignore_eos": true}),
        json!({"prompt": ["Once upon a time", [400, 401, 402]], "max_tokens": 6,
               "temperature": 0.9, "seed": 2, "n": 2, "ignore_eos": true, "logprobs": 1}),
    ] {
        let (s1, a) = post(&one.addr, "/v1/completions", &body);
        let (s2, b) = post(r, "/v1/completions", &body);
        assert_eq!((s1, s2), (200, 200), "{a} {b}");
        assert_eq!(a["choices"], b["choices"], "{body}");
        assert_eq!(a["usage"], b["usage"], "{body}");
    }
    let chat = json!({"messages": [{"role": "user", "content": "Tell me a story."}],
                      "max_tokens": 20, "temperature": 0.7, "seed": 5});
    let (s1, a) = post(&one.addr, "/v1/chat/completions", &chat);
    let (s2, b) = post(r, "/v1/chat/completions", &chat);
    assert_eq!((s1, s2), (200, 200), "{a} {b}");
    assert_eq!(a["choices"][0]["message"], b["choices"][0]["message"]);

    // Streamed through the router: the pieces make the whole answer.
    let mut stream = greedy.clone();
    stream["stream"] = true.into();
    let ev = events(r, "/v1/completions", &stream);
    let pieces: String = ev[..ev.len() - 1]
        .iter()
        .map(|e| {
            let v: Value = serde_json::from_str(e).unwrap();
            v["choices"][0]["text"].as_str().unwrap_or("").to_string()
        })
        .collect();
    let (_, whole) = post(&one.addr, "/v1/completions", &greedy);
    assert_eq!(pieces, text_of(&whole));
    // The first piece is the prefilled token's alone (sent before the first decode step), as
    // one server streams it.
    let one_ev = events(&one.addr, "/v1/completions", &stream);
    assert_eq!(first_piece(&ev), first_piece(&one_ev));

    // Concurrent requests (more than the decode batch) each get their own answer.
    let prompts = [
        "A",
        "In the beginning",
        "Knowledge is",
        "The sea",
        "My friend",
    ];
    let want: Vec<String> = prompts
        .iter()
        .map(|p| {
            let mut b = greedy.clone();
            b["prompt"] = (*p).into();
            text_of(&post(&one.addr, "/v1/completions", &b).1)
        })
        .collect();
    let got: Vec<String> = std::thread::scope(|s| {
        let hs: Vec<_> = prompts
            .iter()
            .map(|p| {
                let mut b = greedy.clone();
                b["prompt"] = (*p).into();
                s.spawn(move || text_of(&post(r, "/v1/completions", &b).1))
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(got, want);

    // A prompt the prefill server refuses (over its 128 positions): the client learns why,
    // from the prefill server's 400 or the decode server's 502 quoting it, whichever comes
    // first.
    let long = json!({"prompt": vec![400u32; 200], "max_tokens": 4});
    let (status, e) = post(r, "/v1/completions", &long);
    assert!(status == 400 || status == 502, "{status} {e}");
    let m = e["error"]["message"].as_str().unwrap();
    assert!(m.contains("context is 128 positions"), "{m}");
    // The prefill server checks only what it does (the prompt and one token): a prompt near
    // its limit with a long answer is the decode server's to take.
    let near = json!({"prompt": vec![400u32; 100], "max_tokens": 50, "temperature": 0,
                      "ignore_eos": true});
    let (s1, a) = post(&one.addr, "/v1/completions", &near);
    let (s2, b) = post(r, "/v1/completions", &near);
    assert_eq!((s1, s2), (200, 200), "{a} {b}");
    assert_eq!(text_of(&a), text_of(&b));
    // An answer that ends at its first token (the one the prefill server sampled) comes back
    // though the decode server has nothing else to do.
    for body in [
        json!({"prompt": "The meaning of life is", "max_tokens": 1, "temperature": 0}),
        json!({"prompt": "The meaning of life is", "max_tokens": 5, "temperature": 0,
               "stop_token_ids": [first_token(&one.addr)]}),
    ] {
        let (s1, a) = post(&one.addr, "/v1/completions", &body);
        let (s2, b) = post(r, "/v1/completions", &body);
        assert_eq!((s1, s2), (200, 200), "{a} {b}");
        assert_eq!(a["choices"][0], b["choices"][0]);
        assert_eq!(b["usage"]["completion_tokens"], 1);
    }
    // The decode server alone: the bootstrap fields are required, and a prefill server that is
    // not there is named.
    let (status, e) = post(&dec.addr, "/v1/completions", &greedy);
    assert_eq!(
        (status, e["error"]["param"].as_str()),
        (400, Some("bootstrap_room"))
    );
    let mut lost = greedy.clone();
    lost["bootstrap_room"] = 7.into();
    lost["bootstrap_host"] = "127.0.0.1".into();
    lost["bootstrap_port"] = 1.into();
    let (status, e) = post(&dec.addr, "/v1/completions", &lost);
    assert_eq!(status, 502, "{e}");
    assert!(
        e["error"]["message"]
            .as_str()
            .unwrap()
            .contains("127.0.0.1:1"),
        "{e}"
    );
    // A room in use is refused by the prefill server.
    let mut twice = greedy.clone();
    twice["bootstrap_room"] = 99.into();
    twice["bootstrap_host"] = "127.0.0.1".into();
    twice["bootstrap_port"] = kv_port.into();
    let (status, _) = post(&pre.addr, "/v1/completions", &twice);
    assert_eq!(status, 200);
    let (status, e) = post(&pre.addr, "/v1/completions", &twice);
    assert_eq!(
        (status, e["error"]["param"].as_str()),
        (400, Some("bootstrap_room"))
    );
    // The decode server then takes room 99's KV and answers as one server.
    let (status, b) = post(&dec.addr, "/v1/completions", &twice);
    assert_eq!(status, 200, "{b}");
    assert_eq!(text_of(&b), text_of(&whole));
    // A second fetch of the room learns at once that its KV was taken.
    let t0 = std::time::Instant::now();
    let (status, e) = post(&dec.addr, "/v1/completions", &twice);
    assert_eq!(status, 502, "{e}");
    assert!(
        e["error"]["message"].as_str().unwrap().contains("taken"),
        "{e}"
    );
    assert!(t0.elapsed() < std::time::Duration::from_secs(10));

    // Prefix caching on the prefill server (on by default): requests sharing a prompt's first
    // blocks take them from its cache, and the answers are still one server's.
    let doc = "Whales sing long songs that travel far through the cold sea, and every song \
               changes a little from one year to the next.";
    let before = prefix_hits(&pre.addr);
    for q in [" Why?", " How far?", " Why?"] {
        let body = json!({"prompt": format!("{doc}{q}"), "max_tokens": 8, "temperature": 0});
        let (s1, a) = post(&one.addr, "/v1/completions", &body);
        let (s2, b) = post(r, "/v1/completions", &body);
        assert_eq!((s1, s2), (200, 200), "{a} {b}");
        assert_eq!(text_of(&a), text_of(&b), "{body}");
    }
    assert!(
        prefix_hits(&pre.addr) >= before + 32,
        "{}",
        prefix_hits(&pre.addr)
    );
    // The prompts are looked up on the prefill server; the decode server, where prefix caching
    // does not run, counts no queries.
    assert!(counter(&pre.addr, "prefix_cache_queries_total") > 0);
    assert_eq!(counter(&dec.addr, "prefix_cache_queries_total"), 0);
}

/// A server's `cachalot:prefix_cache_hits_total` (prompt tokens taken from its prefix cache).
fn prefix_hits(addr: &str) -> u64 {
    counter(addr, "prefix_cache_hits_total")
}

/// A server's `cachalot:NAME` counter.
fn counter(addr: &str, name: &str) -> u64 {
    let (_, m) = http(addr, "GET", "/metrics", "");
    m.lines()
        .find(|l| l.starts_with(&format!("cachalot:{name}{{")))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse::<f64>().ok())
        .unwrap_or_else(|| panic!("no {name} in {m}")) as u64
}

/// The seed's way: each side from its YAML (configs/tiny/pd: next_n 1 on both, the prefill
/// side's batch 8 and max_new_tokens 1), behind the router; greedy answers equal one server's.
#[test]
fn prefill_and_decode_servers_from_the_seed_yamls() {
    let one = start(&["--kv-blocks", "64"]);
    let pre = start(&[
        "--config",
        "configs/tiny/pd/prefill.yaml",
        "--role",
        "prefill",
        "--kv-port",
        "0",
        "--kv-blocks",
        "64",
    ]);
    let dec = start(&[
        "--config",
        "configs/tiny/pd/decode.yaml",
        "--role",
        "decode",
        "--kv-blocks",
        "64",
    ]);
    let router = start_command(
        "router",
        &[
            "--prefill",
            &pre.addr,
            "--decode",
            &format!("http://{}/v1", dec.addr),
        ],
    );
    for prompt in ["The meaning of life is", "Once upon a time"] {
        let body = json!({"prompt": prompt, "max_tokens": 32, "temperature": 0,
                          "ignore_eos": true});
        let (s1, a) = post(&one.addr, "/v1/completions", &body);
        let (s2, b) = post(&router.addr, "/v1/completions", &body);
        assert_eq!((s1, s2), (200, 200), "{a} {b}");
        assert_eq!(a["choices"][0]["text"], b["choices"][0]["text"]);
    }
    // The YAML's next_n reached both sides: the decode log says MTP is on.
    let (status, h) = http(&router.addr, "GET", "/health", "");
    assert_eq!(status, 200, "{h}");
    let log = dec.log.lock().unwrap().join("\n");
    assert!(log.contains("MTP"), "{log}");
    // With MTP the prefill server's prefix cache still shares a prompt's blocks of 128 (its
    // requests end after one token: the MTP catch-up of their last prompt rows runs as they
    // retire), and the answers stay one server's.
    let doc: String = std::fs::read_to_string(root().join("assets/cachalot-tiny-r1/eval.txt"))
        .unwrap()
        .chars()
        .take(1500)
        .collect();
    let before = prefix_hits(&pre.addr);
    for q in ["\nWho?", "\nWhere?"] {
        let body = json!({"prompt": format!("{doc}{q}"), "max_tokens": 8, "temperature": 0});
        let (s1, a) = post(&one.addr, "/v1/completions", &body);
        let (s2, b) = post(&router.addr, "/v1/completions", &body);
        assert_eq!((s1, s2), (200, 200), "{a} {b}");
        assert_eq!(a["choices"][0]["text"], b["choices"][0]["text"]);
    }
    assert!(
        prefix_hits(&pre.addr) >= before + 128,
        "{}",
        prefix_hits(&pre.addr)
    );
}

/// Log-probabilities: completions' `logprobs: N` and chat's `logprobs`/`top_logprobs`, whole and
/// streamed, and through a prefill/decode split.
#[test]
fn serve_reports_logprobs() {
    let server = start(&["--kv-blocks", "64"]);
    let addr = server.addr.as_str();
    let body = json!({"prompt": "Once upon a time", "max_tokens": 12, "temperature": 0,
                      "ignore_eos": true, "logprobs": 3});
    let (status, whole) = post(addr, "/v1/completions", &body);
    assert_eq!(status, 200, "{whole}");
    let lp = &whole["choices"][0]["logprobs"];
    let tokens: Vec<&str> = lp["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_str().unwrap())
        .collect();
    assert_eq!(tokens.len(), 12);
    assert_eq!(
        tokens.concat(),
        whole["choices"][0]["text"].as_str().unwrap()
    );
    let mut offset = 0;
    for i in 0..12 {
        let v = lp["token_logprobs"][i].as_f64().unwrap();
        let top = lp["top_logprobs"][i].as_object().unwrap();
        assert!(top.len() <= 3 && !top.is_empty());
        // Greedy: the chosen token is the most likely one.
        let best = top
            .values()
            .map(|x| x.as_f64().unwrap())
            .fold(f64::MIN, f64::max);
        assert_eq!(v, best, "{lp}");
        assert!(v <= 0.0);
        assert_eq!(lp["text_offset"][i].as_u64().unwrap() as usize, offset);
        offset += tokens[i].chars().count();
    }
    // Streamed: the chunks' logprobs make the whole answer's.
    let mut stream = body.clone();
    stream["stream"] = true.into();
    let ev = events(addr, "/v1/completions", &stream);
    let mut streamed = Vec::new();
    for e in &ev[..ev.len() - 1] {
        let v: Value = serde_json::from_str(e).unwrap();
        if let Some(a) = v["choices"][0]["logprobs"]["token_logprobs"].as_array() {
            streamed.extend(a.iter().map(|x| x.as_f64().unwrap()));
        }
    }
    let want: Vec<f64> = lp["token_logprobs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect();
    assert_eq!(streamed, want);

    // Chat: one entry per token, with bytes and the asked number of alternatives.
    let chat = json!({"messages": [{"role": "user", "content": "Tell me a story."}],
                      "max_tokens": 8, "temperature": 0, "logprobs": true, "top_logprobs": 2});
    let (status, c) = post(addr, "/v1/chat/completions", &chat);
    assert_eq!(status, 200, "{c}");
    let content = c["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert_eq!(
        content.len(),
        c["usage"]["completion_tokens"].as_u64().unwrap() as usize
    );
    let mut bytes = Vec::new();
    for e in content {
        assert_eq!(e["top_logprobs"].as_array().unwrap().len(), 2);
        assert_eq!(e["top_logprobs"][0]["logprob"], e["logprob"]);
        bytes.extend(
            e["bytes"]
                .as_array()
                .unwrap()
                .iter()
                .map(|b| b.as_u64().unwrap() as u8),
        );
    }
    let m = &c["choices"][0]["message"];
    let text = format!(
        "{}{}",
        m["reasoning_content"].as_str().unwrap_or(""),
        m["content"].as_str().unwrap_or("")
    );
    let all = String::from_utf8(bytes).unwrap();
    assert!(all.contains(text.trim()), "{all:?} vs {text:?}");
    // Bad values name their field.
    for (b, param) in [
        (json!({"prompt": "x", "logprobs": 21}), "logprobs"),
        (json!({"prompt": "x", "top_logprobs": 2}), "top_logprobs"),
    ] {
        let (status, e) = post(addr, "/v1/completions", &b);
        assert_eq!(
            (status, e["error"]["param"].as_str()),
            (400, Some(param)),
            "{e}"
        );
    }
    let (status, e) = post(
        addr,
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}),
    );
    assert_eq!(
        (status, e["error"]["param"].as_str()),
        (400, Some("top_logprobs"))
    );

    // Echo: the prompt scored (max_tokens 0), or repeated before the answer.
    let ids: Vec<u32> = vec![400, 401, 402, 403, 404, 405];
    let (status, e) = post(
        addr,
        "/v1/completions",
        &json!({"prompt": ids, "max_tokens": 0, "echo": true, "logprobs": 1}),
    );
    assert_eq!(status, 200, "{e}");
    let l = &e["choices"][0]["logprobs"];
    assert_eq!(l["tokens"].as_array().unwrap().len(), 6);
    assert!(l["token_logprobs"][0].is_null() && l["top_logprobs"][0].is_null());
    assert!((1..6).all(|i| l["token_logprobs"][i].as_f64().unwrap() < 0.0));
    assert_eq!(e["usage"]["completion_tokens"], 0);
    // vLLM's `prompt_logprobs`: the same values as echo's, keyed by id, the token's own entry
    // first with its rank, then its alternatives ranked 1..k; a chat's once per response.
    let (status, p) = post(
        addr,
        "/v1/completions",
        &json!({"prompt": ids, "max_tokens": 1, "prompt_logprobs": 2, "n": 2,
                "temperature": 0}),
    );
    assert_eq!(status, 200, "{p}");
    for c in 0..2 {
        let rows = p["choices"][c]["prompt_logprobs"].as_array().unwrap();
        assert_eq!(rows.len(), 6, "{p}");
        assert!(rows[0].is_null());
        for i in 1..6 {
            let row = rows[i].as_object().unwrap();
            let (first, own) = row.iter().next().unwrap();
            assert_eq!(first, &ids[i].to_string(), "{p}");
            let lp = own["logprob"].as_f64().unwrap();
            assert!(
                (lp - l["token_logprobs"][i].as_f64().unwrap()).abs() < 1e-5,
                "{p}"
            );
            let alts: Vec<&Value> = row
                .values()
                .filter(|e| e["rank"].as_u64() <= Some(2))
                .collect();
            assert!(alts.len() >= 2, "{p}");
            let best = alts
                .iter()
                .map(|e| e["logprob"].as_f64().unwrap())
                .fold(f64::MIN, f64::max);
            let rank = own["rank"].as_u64().unwrap();
            assert!(rank >= 1 && (rank == 1) == (lp >= best), "{p}");
            assert!(row.len() == 2 + usize::from(rank > 2), "{p}");
        }
    }
    let (status, p) = post(
        addr,
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1,
                "prompt_logprobs": 0}),
    );
    assert_eq!(status, 200, "{p}");
    assert_eq!(
        p["prompt_logprobs"].as_array().map(Vec::len),
        p["usage"]["prompt_tokens"].as_u64().map(|n| n as usize),
        "{p}"
    );
    // A text prompt: its tokens' offsets point into the echoed text (the BOS the tokenizer
    // adds takes no characters).
    let (_, e) = post(
        addr,
        "/v1/completions",
        &json!({"prompt": "Once upon a time", "max_tokens": 0, "echo": true, "logprobs": 0}),
    );
    let text = e["choices"][0]["text"].as_str().unwrap();
    assert_eq!(text, "Once upon a time");
    let l = &e["choices"][0]["logprobs"];
    let toks = l["tokens"].as_array().unwrap();
    for (i, t) in toks.iter().enumerate().skip(1) {
        let at = l["text_offset"][i].as_u64().unwrap() as usize;
        assert!(text[at..].starts_with(t.as_str().unwrap()), "{l}");
    }
    let (status, e) = post(
        addr,
        "/v1/completions",
        &json!({"prompt": "Once upon a time", "max_tokens": 3, "echo": true, "temperature": 0,
                "ignore_eos": true}),
    );
    assert_eq!(status, 200, "{e}");
    let echoed = e["choices"][0]["text"].as_str().unwrap();
    let (_, plain) = post(
        addr,
        "/v1/completions",
        &json!({"prompt": "Once upon a time", "max_tokens": 3, "temperature": 0,
                "ignore_eos": true}),
    );
    assert_eq!(
        echoed,
        format!(
            "Once upon a time{}",
            plain["choices"][0]["text"].as_str().unwrap()
        )
    );
    for (path, b) in [
        (
            "/v1/completions",
            json!({"prompt": "x", "echo": true, "stream": true}),
        ),
        ("/v1/completions", json!({"prompt": "x", "max_tokens": 0})),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "x"}], "echo": true,
                   "max_tokens": 0}),
        ),
    ] {
        let (status, e) = post(addr, path, &b);
        assert_eq!(status, 400, "{b}: {e}");
    }
    // A chat's echo (vLLM's): the final message's text before the answer when its role is the
    // answer's (the assistant's, or without a generation prompt the final message's), whole
    // and streamed; a user's message under a generation prompt is not repeated.
    let continued = json!({"messages": [{"role": "user", "content": "Hi"},
                                        {"role": "assistant", "content": "Well, "}],
                           "continue_final_message": true, "add_generation_prompt": false,
                           "max_tokens": 4, "temperature": 0});
    let (_, plain) = post(addr, "/v1/chat/completions", &continued);
    let mut echo = continued.clone();
    echo["echo"] = true.into();
    let (status, e) = post(addr, "/v1/chat/completions", &echo);
    assert_eq!(status, 200, "{e}");
    let answer = plain["choices"][0]["message"]["content"].as_str().unwrap();
    assert_eq!(
        e["choices"][0]["message"]["content"].as_str(),
        Some(format!("Well, {answer}").as_str()),
        "{e}"
    );
    echo["stream"] = true.into();
    let streamed: String = events(addr, "/v1/chat/completions", &echo)
        .iter()
        .filter_map(|ev| serde_json::from_str::<Value>(ev).ok())
        .filter_map(|c| {
            c["choices"][0]["delta"]["content"]
                .as_str()
                .map(String::from)
        })
        .collect();
    assert_eq!(streamed, format!("Well, {answer}"));
    let user = json!({"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"},
                                                               {"type": "text", "text": "you"}]}],
                      "max_tokens": 2, "temperature": 0, "echo": true});
    let (_, e) = post(addr, "/v1/chat/completions", &user);
    assert_eq!(e["choices"][0]["message"]["role"], "assistant", "{e}");
    assert!(
        !e["choices"][0]["message"]["content"]
            .as_str()
            .unwrap_or("")
            .starts_with("Hi"),
        "{e}"
    );
    let mut own = user.clone();
    own["add_generation_prompt"] = false.into();
    let (_, e) = post(addr, "/v1/chat/completions", &own);
    assert_eq!(e["choices"][0]["message"]["role"], "user", "{e}");
    assert!(
        e["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .starts_with("Hi\nyou"),
        "{e}"
    );

    // Through a prefill/decode split: the same tokens and log-probabilities.
    let pre = start(&["--role", "prefill", "--kv-port", "0", "--kv-blocks", "64"]);
    let dec = start(&["--role", "decode", "--kv-blocks", "64"]);
    let router = start_command("router", &["--prefill", &pre.addr, "--decode", &dec.addr]);
    // Two choices: each prefilled and decoded on its own, as one server gives them.
    let mut two = body.clone();
    two["n"] = 2.into();
    let (status, split_two) = post(&router.addr, "/v1/completions", &two);
    assert_eq!(status, 200, "{split_two}");
    let (_, one_two) = post(addr, "/v1/completions", &two);
    assert_eq!(split_two["choices"], one_two["choices"]);
    // Echo, and echo alone (`max_tokens: 0`): the prompt is scored on the prefill server, its
    // log-probabilities travel with the KV, and the answer is one server's.
    for extra in [
        json!({"echo": true}),
        json!({"echo": true, "max_tokens": 0}),
    ] {
        let mut echo = body.clone();
        for (k, v) in extra.as_object().unwrap() {
            echo[k] = v.clone();
        }
        let (status, split_echo) = post(&router.addr, "/v1/completions", &echo);
        assert_eq!(status, 200, "{split_echo}");
        let (_, one_echo) = post(addr, "/v1/completions", &echo);
        assert_eq!(split_echo["choices"], one_echo["choices"], "{echo}");
        assert_eq!(split_echo["usage"], one_echo["usage"], "{echo}");
    }
    let (status, split) = post(&router.addr, "/v1/completions", &body);
    assert_eq!(status, 200, "{split}");
    let slp = &split["choices"][0]["logprobs"];
    assert_eq!(slp["tokens"], lp["tokens"]);
    for i in 0..12 {
        let (a, b) = (
            lp["token_logprobs"][i].as_f64().unwrap(),
            slp["token_logprobs"][i].as_f64().unwrap(),
        );
        assert!((a - b).abs() < 1e-3, "{a} {b}");
    }
}

/// `n` choices: each samples on its own (choice i of a seeded request is the one-choice request
/// with seed + i), streamed chunks carry their choice's index, usage counts them all.
#[test]
fn serve_gives_n_choices() {
    let server = start(&["--kv-blocks", "64", "--batch-size", "2"]);
    let addr = server.addr.as_str();
    let body = |n: u64, seed: u64| {
        json!({"prompt": "Once upon a time", "max_tokens": 10, "temperature": 0.9,
               "seed": seed, "n": n, "ignore_eos": true})
    };
    let (status, three) = post(addr, "/v1/completions", &body(3, 40));
    assert_eq!(status, 200, "{three}");
    let choices = three["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 3);
    for (i, c) in choices.iter().enumerate() {
        assert_eq!(c["index"], i);
        let (_, one) = post(addr, "/v1/completions", &body(1, 40 + i as u64));
        assert_eq!(c["text"], one["choices"][0]["text"], "choice {i}");
    }
    assert_eq!(three["usage"]["completion_tokens"], 30);
    let (_, one) = post(addr, "/v1/completions", &body(1, 40));
    assert_eq!(
        three["usage"]["prompt_tokens"],
        one["usage"]["prompt_tokens"]
    );
    // Streamed chat, two choices: each index's deltas make that choice's whole message.
    let chat = json!({"messages": [{"role": "user", "content": "Tell me a story."}],
                      "max_tokens": 8, "temperature": 0.9, "seed": 3, "n": 2});
    let (_, whole) = post(addr, "/v1/chat/completions", &chat);
    let mut streamed = chat.clone();
    streamed["stream"] = true.into();
    streamed["stream_options"] = json!({"include_usage": true});
    let ev = events(addr, "/v1/chat/completions", &streamed);
    let mut texts = [String::new(), String::new()];
    let mut finishes = 0;
    for e in &ev[..ev.len() - 1] {
        let v: Value = serde_json::from_str(e).unwrap();
        if let Some(c) = v["choices"].as_array().and_then(|a| a.first()) {
            let i = c["index"].as_u64().unwrap() as usize;
            for k in ["reasoning_content", "content"] {
                texts[i].push_str(c["delta"][k].as_str().unwrap_or(""));
            }
            finishes += c["finish_reason"].is_string() as usize;
        } else {
            assert_eq!(v["usage"], whole["usage"]);
        }
    }
    assert_eq!(finishes, 2);
    for (i, t) in texts.iter().enumerate() {
        let m = &whole["choices"][i]["message"];
        let want = format!(
            "{}{}",
            m["reasoning_content"].as_str().unwrap_or(""),
            m["content"].as_str().unwrap_or("")
        );
        assert_eq!(t, &want, "choice {i}");
    }
    let (status, e) = post(addr, "/v1/completions", &body(65, 1));
    assert_eq!((status, e["error"]["param"].as_str()), (400, Some("n")));
    // Several prompts (texts or token ids), n each: prompt i's choices are i·n..(i+1)·n.
    let prompts = json!(["Once upon a time", [400, 401, 402], "The sea"]);
    let (status, many) = post(
        addr,
        "/v1/completions",
        &json!({"prompt": prompts, "max_tokens": 6, "temperature": 0.9, "seed": 2, "n": 2,
                "ignore_eos": true, "echo": true}),
    );
    assert_eq!(status, 200, "{many}");
    let choices = many["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 6);
    let mut prompt_tokens = 0;
    for (i, c) in choices.iter().enumerate() {
        assert_eq!(c["index"], i);
        let p = &prompts[i / 2];
        let (_, one) = post(
            addr,
            "/v1/completions",
            &json!({"prompt": p, "max_tokens": 6, "temperature": 0.9, "seed": 2 + (i % 2),
                    "ignore_eos": true, "echo": true}),
        );
        assert_eq!(c["text"], one["choices"][0]["text"], "choice {i}");
        if i % 2 == 0 {
            prompt_tokens += one["usage"]["prompt_tokens"].as_u64().unwrap();
        }
    }
    assert_eq!(many["usage"]["prompt_tokens"], prompt_tokens);
    assert_eq!(many["usage"]["completion_tokens"], 36);
    let (status, e) = post(
        addr,
        "/v1/completions",
        &json!({"prompt": [], "max_tokens": 2}),
    );
    assert_eq!(
        (status, e["error"]["param"].as_str()),
        (400, Some("prompt"))
    );
    // The figures: every finished choice counted, its tokens, its latencies.
    let (status, text) = http(addr, "GET", "/metrics", "");
    assert_eq!(status, 200);
    let value = |prefix: &str| -> f64 {
        text.lines()
            .find(|l| l.starts_with(prefix))
            .unwrap_or_else(|| panic!("{prefix}: {text}"))
            .rsplit(' ')
            .next()
            .unwrap()
            .parse()
            .unwrap()
    };
    let reason = "finished_reason=\"length\"";
    let lengths = value(&format!(
        "cachalot:request_success_total{{model_name=\"cachalot-tiny-r1\",{reason}}}"
    ));
    assert!(lengths >= 16.0, "{text}");
    assert!(value("cachalot:generation_tokens_total{") >= 66.0);
    assert_eq!(
        value("cachalot:time_to_first_token_seconds_count{"),
        value("cachalot:e2e_request_latency_seconds_count{")
    );
    assert_eq!(value("cachalot:num_requests_running{"), 0.0);
    let (status, stats) = http(addr, "GET", "/stats", "");
    assert_eq!(status, 200);
    let stats: Value = serde_json::from_str(&stats).unwrap();
    assert_eq!(
        (stats["status"].as_str(), stats["pending_requests"].as_u64()),
        (Some("running"), Some(0))
    );
}

/// The greedy first token of "The meaning of life is" on a server.
fn first_token(addr: &str) -> u64 {
    let tok =
        cachalot_model::tokenizer::Tokenizer::from_dir(&root().join("assets/cachalot-tiny-r1"))
            .unwrap();
    let body = json!({"prompt": "The meaning of life is", "max_tokens": 1, "temperature": 0});
    let (_, a) = post(addr, "/v1/completions", &body);
    let text = a["choices"][0]["text"].as_str().unwrap();
    tok.encode(text).unwrap()[0] as u64
}

/// One server over two ranks (`--ranks 2`), data parallel (each rank runs its own requests),
/// expert parallel (the ranks hold half the routed experts each and step every request
/// together) and tensor parallel (half the heads and intermediate features each): the answers
/// of one process, whole and streamed, concurrent, with `n` and unseeded sampling.
#[test]
fn serve_over_two_ranks_answers_as_one_process() {
    let one = start(&["--kv-blocks", "64"]);
    let bodies = [
        json!({"prompt": "The meaning of life is", "max_tokens": 16, "temperature": 0,
               "ignore_eos": true}),
        json!({"prompt": "Once upon a time", "max_tokens": 16, "temperature": 0.8,
               "seed": 9, "n": 2, "ignore_eos": true, "logprobs": 1}),
        json!({"messages": [{"role": "user", "content": "Tell me a story."}],
               "max_tokens": 12, "temperature": 0.7, "seed": 4}),
    ];
    let path = |b: &Value| {
        if b.get("messages").is_some() {
            "/v1/chat/completions"
        } else {
            "/v1/completions"
        }
    };
    let want: Vec<Value> = bodies
        .iter()
        .map(|b| post(&one.addr, path(b), b).1["choices"].clone())
        .collect();
    // Expert placement from loads that differ from the contiguous halves (experts 0-3 hot in
    // every MoE layer): the same answers.
    let dir = tempfile::tempdir().unwrap();
    let loads = dir.path().join("loads.json");
    let hot: Vec<u64> = (0..16).map(|e| if e < 4 { 100 } else { 1 }).collect();
    let tokens = json!({"1": hot, "2": hot, "3": hot, "4": hot});
    std::fs::write(
        &loads,
        json!({"expert_load": {"tokens": tokens}}).to_string(),
    )
    .unwrap();
    let loads = loads.to_str().unwrap();
    for (parallel, placement) in [
        ("data", None),
        ("expert", None),
        ("tensor", None),
        ("tensor-expert", None),
        ("data-expert", None),
        ("context", None),
        ("data-expert", Some(loads)),
    ] {
        let mut args = vec!["--kv-blocks", "64", "--ranks", "2", "--parallel", parallel];
        if let Some(f) = placement {
            args.extend(["--expert-placement", f]);
        }
        let group = start(&args);
        let g = group.addr.as_str();
        // Concurrent: each answer is its own.
        let got: Vec<Value> = std::thread::scope(|s| {
            let hs: Vec<_> = bodies
                .iter()
                .map(|b| s.spawn(move || post(g, path(b), b)))
                .collect();
            hs.into_iter()
                .map(|h| {
                    let (status, v) = h.join().unwrap();
                    assert_eq!(status, 200, "{parallel}: {v}");
                    v["choices"].clone()
                })
                .collect()
        });
        for (a, b) in want.iter().zip(&got) {
            let strip = |v: &Value| {
                let mut v = v.clone();
                for c in v.as_array_mut().unwrap() {
                    c.as_object_mut().unwrap().remove("logprobs");
                }
                v
            };
            assert_eq!(strip(a), strip(b), "{parallel}");
        }
        // Streamed.
        let mut stream = bodies[0].clone();
        stream["stream"] = true.into();
        let ev = events(g, "/v1/completions", &stream);
        let text: String = ev[..ev.len() - 1]
            .iter()
            .map(|e| {
                let v: Value = serde_json::from_str(e).unwrap();
                v["choices"][0]["text"].as_str().unwrap_or("").to_string()
            })
            .collect();
        assert_eq!(text, want[0][0]["text"].as_str().unwrap(), "{parallel}");
        // Unseeded sampling: the ranks agree on the tokens (rank 0 draws the seed).
        let free = json!({"prompt": "The sea", "max_tokens": 20, "temperature": 1.0,
                          "ignore_eos": true});
        let (status, v) = post(g, "/v1/completions", &free);
        assert_eq!(status, 200, "{parallel}: {v}");
        assert_eq!(v["usage"]["completion_tokens"], 20);
    }
}

/// `mpirun -n 2 cachalot serve` (the `mpi` feature): rank 0 answers HTTP, the ranks step over
/// MPI, and the answers (greedy, seeded sampling with `n`, streamed) are one process's.
#[cfg(feature = "mpi")]
#[test]
fn serve_under_mpirun_answers_as_one_process() {
    let one = start(&["--kv-blocks", "64"]);
    let bodies = [
        json!({"prompt": "The meaning of life is", "max_tokens": 16, "temperature": 0,
               "ignore_eos": true}),
        json!({"prompt": "Once upon a time", "max_tokens": 16, "temperature": 0.8,
               "seed": 9, "n": 2, "ignore_eos": true}),
    ];
    let want: Vec<Value> = bodies
        .iter()
        .map(|b| post(&one.addr, "/v1/completions", b).1["choices"].clone())
        .collect();
    let mut cmd = cachalot_engine::comm::mpi::test_launcher(2, 300);
    cmd.args([env!("CARGO_BIN_EXE_cachalot"), "serve", "--port", "0"])
        .args(["--kv-blocks", "64", "--parallel", "data-expert"]);
    let group = spawn_server(cmd, true);
    for (b, w) in bodies.iter().zip(&want) {
        let (status, v) = post(&group.addr, "/v1/completions", b);
        assert_eq!(status, 200, "{v}");
        assert_eq!(&v["choices"], w, "{b}");
    }
    let mut stream = bodies[0].clone();
    stream["stream"] = true.into();
    let ev = events(&group.addr, "/v1/completions", &stream);
    let text: String = ev[..ev.len() - 1]
        .iter()
        .map(|e| {
            let v: Value = serde_json::from_str(e).unwrap();
            v["choices"][0]["text"].as_str().unwrap_or("").to_string()
        })
        .collect();
    assert_eq!(text, want[0][0]["text"].as_str().unwrap());
    // Rank 1's lines come through the launcher's forwarding, which may lag rank 0's.
    let t0 = std::time::Instant::now();
    loop {
        let log = group.log.lock().unwrap().join("\n");
        if log.contains("rank 1 of 2") {
            break;
        }
        assert!(t0.elapsed().as_secs() < 30, "{log}");
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
}

/// With `tools` (`tool_choice` "auto"), a streamed answer's content before any tool-call
/// markup goes out as it comes, and adds up to the whole answer's content.
#[test]
fn serve_streams_content_beside_tools() {
    let server = start(&["--kv-blocks", "64"]);
    let addr = server.addr.as_str();
    let tools = json!([{"type": "function", "function": {"name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]);
    // The answer continues a final message, so it is content, not reasoning.
    let mut body = json!({"messages": [{"role": "user", "content": "Tell me about whales."},
                                       {"role": "assistant", "content": "Whales are"}],
                          "continue_final_message": true, "add_generation_prompt": false,
                          "tools": tools, "max_tokens": 24, "temperature": 0,
                          "ignore_eos": true});
    let (status, whole) = post(addr, "/v1/chat/completions", &body);
    assert_eq!(status, 200, "{whole}");
    let want = whole["choices"][0]["message"]["content"].as_str().unwrap();
    body["stream"] = true.into();
    let ev = events(addr, "/v1/chat/completions", &body);
    let pieces: Vec<String> = ev[..ev.len() - 1]
        .iter()
        .filter_map(|e| {
            let v: Value = serde_json::from_str(e).unwrap();
            v["choices"][0]["delta"]["content"]
                .as_str()
                .filter(|c| !c.is_empty())
                .map(str::to_string)
        })
        .collect();
    assert_eq!(pieces.concat(), want);
    assert!(pieces.len() > 3, "the content was held: {pieces:?}");
}

/// A streamed chat answer's message put together as OpenAI's client does (content and
/// reasoning joined, each tool call's pieces joined by `index`), its finish reason, and how many
/// deltas carried tool-call arguments.
fn accumulate(events: &[String]) -> (Value, String, usize) {
    let mut message = json!({"content": "", "tool_calls": []});
    let (mut finish, mut pieces) = (String::new(), 0);
    for e in events.iter().filter(|e| *e != "[DONE]") {
        let v: Value = serde_json::from_str(e).unwrap();
        let Some(choice) = v["choices"].get(0) else {
            continue;
        };
        if let Some(f) = choice["finish_reason"].as_str() {
            finish = f.to_string();
        }
        let d = &choice["delta"];
        if let Some(t) = d["content"].as_str() {
            let c = message["content"].as_str().unwrap().to_string() + t;
            message["content"] = c.into();
        }
        for c in d["tool_calls"].as_array().into_iter().flatten() {
            let k = c["index"].as_u64().unwrap() as usize;
            let calls = message["tool_calls"].as_array_mut().unwrap();
            if k == calls.len() {
                assert!(
                    c["id"].is_string() && c["function"]["name"].is_string(),
                    "{c}"
                );
                calls.push(json!({"id": c["id"], "type": "function",
                                  "function": {"name": c["function"]["name"], "arguments": ""}}));
            }
            assert!(
                k < calls.len(),
                "call {k} came before the ones before it: {c}"
            );
            if let Some(a) = c["function"]["arguments"].as_str() {
                let all = calls[k]["function"]["arguments"]
                    .as_str()
                    .unwrap()
                    .to_string()
                    + a;
                calls[k]["function"]["arguments"] = all.into();
                pieces += usize::from(!a.is_empty());
            }
        }
    }
    (message, finish, pieces)
}

/// Forced tool calls (`tool_choice` "required" or a named function): the template's own
/// rendering of the call is written into the prompt up to where the model's part begins, and
/// the answer is read from there (the small model writes no valid JSON, so the raw answer comes
/// back with the reason; a model that does gets `tool_calls`).
#[test]
fn serve_forces_tool_calls() {
    let server = start(&["--kv-blocks", "64"]);
    let addr = server.addr.as_str();
    let tools = json!([{"type": "function", "function": {"name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}},
        {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]);
    let ask = |choice: Value| {
        json!({"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": tools,
               "tool_choice": choice, "max_tokens": 24, "temperature": 0})
    };
    for (choice, starts) in [
        (
            json!({"type": "function", "function": {"name": "get_time"}}),
            "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n",
        ),
        (
            json!("required"),
            "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>",
        ),
    ] {
        let (status, v) = post(addr, "/v1/chat/completions", &ask(choice.clone()));
        assert_eq!(status, 200, "{v}");
        let m = &v["choices"][0]["message"];
        match m["tool_calls"].as_array() {
            Some(calls) => {
                assert_eq!(v["choices"][0]["finish_reason"], "tool_calls");
                if choice.is_object() {
                    assert_eq!(calls[0]["function"]["name"], "get_time");
                }
                // The arguments are held to one JSON object.
                let args = calls[0]["function"]["arguments"].as_str().unwrap();
                assert!(
                    serde_json::from_str::<Value>(args).is_ok_and(|a| a.is_object()),
                    "{args}"
                );
            }
            None => {
                // Only cut off: the name is one of the tools', the arguments a JSON object's
                // start.
                assert!(
                    choice.is_string(),
                    "a named call always completes here: {v}"
                );
                assert_eq!(v["choices"][0]["finish_reason"], "length");
                let content = m["content"].as_str().unwrap();
                assert!(content.starts_with(starts), "{content:?}");
                let rest = &content[starts.len()..];
                let args = ["get_weather\n```json\n", "get_time\n```json\n"]
                    .iter()
                    .find_map(|lead| rest.strip_prefix(lead))
                    .unwrap_or_else(|| panic!("{content:?}"));
                assert!(args.trim_start().starts_with('{'), "{content:?}");
                // The error names the request's own limit.
                let why = m["tool_call_error"].as_str().unwrap();
                assert!(
                    why.contains("max_tokens") && !why.contains("max_new_tokens"),
                    "{why}"
                );
            }
        }
    }
    // Tools whose parameters structured output can hold: the arguments follow them.
    let strict = json!([
        {"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}},
            "required": ["city"], "additionalProperties": false}}},
        {"type": "function", "function": {"name": "get_time", "parameters": {
            "type": "object", "properties": {"utc": {"type": "boolean"}},
            "required": ["utc"], "additionalProperties": false}}}]);
    for choice in [
        json!({"type": "function", "function": {"name": "get_weather"}}),
        json!("required"),
    ] {
        // (One call: the small model, greedy, would go on calling until max_tokens.)
        let body = json!({"messages": [{"role": "user", "content": "Weather in Paris?"}],
                          "tools": strict, "tool_choice": choice, "max_tokens": 200,
                          "temperature": 0, "parallel_tool_calls": false});
        let (status, v) = post(addr, "/v1/chat/completions", &body);
        assert_eq!(status, 200, "{v}");
        // Streamed, the call comes as it is written (its name, then its arguments piece by
        // piece, as vLLM's tool parsers stream them) and adds up to the whole answer's call.
        let mut streamed = body.clone();
        streamed["stream"] = true.into();
        let (message, finish, pieces) =
            accumulate(&events(addr, "/v1/chat/completions", &streamed));
        assert_eq!(finish, "tool_calls");
        let whole = &v["choices"][0]["message"]["tool_calls"];
        assert_eq!(message["tool_calls"][0]["function"], whole[0]["function"]);
        assert!(message["tool_calls"][0]["id"].is_string(), "{message}");
        assert!(pieces > 2, "the arguments came in {pieces} deltas");
        let call = &v["choices"][0]["message"]["tool_calls"][0]["function"];
        let args: Value = serde_json::from_str(call["arguments"].as_str().unwrap()).unwrap();
        match call["name"].as_str().unwrap() {
            "get_weather" => assert!(
                args == json!({"city": "Paris"}) || args == json!({"city": "Rome"}),
                "{args}"
            ),
            "get_time" => assert!(
                args["utc"].is_boolean() && args.as_object().unwrap().len() == 1,
                "{args}"
            ),
            other => panic!("{other}"),
        }
    }
    // "required" lets the model write several calls (OpenAI's `parallel_tool_calls` default):
    // each is held to its tool's parameters, and the answer ends where the model closes the
    // section (or max_tokens cuts it: the calls it closed then come back, with the finish
    // reason "length", or the raw text as content when none closed).
    let body = json!({"messages": [{"role": "user", "content": "Weather in Paris and Rome?"}],
                      "tools": strict, "tool_choice": "required", "max_tokens": 800,
                      "temperature": 1.0, "seed": 3, "n": 8});
    let (status, v) = post(addr, "/v1/chat/completions", &body);
    assert_eq!(status, 200, "{v}");
    let (mut most, mut cut) = (0, 0);
    for c in v["choices"].as_array().unwrap() {
        let Some(calls) = c["message"]["tool_calls"].as_array() else {
            assert_eq!(c["finish_reason"], "length", "{c}");
            continue;
        };
        if c["finish_reason"] == "length" {
            cut += 1;
        } else {
            assert_eq!(c["finish_reason"], "tool_calls", "{c}");
        }
        most = most.max(calls.len());
        for call in calls {
            let args: Value =
                serde_json::from_str(call["function"]["arguments"].as_str().unwrap()).unwrap();
            match call["function"]["name"].as_str().unwrap() {
                "get_weather" => assert!(args["city"] == "Paris" || args["city"] == "Rome"),
                "get_time" => assert!(args["utc"].is_boolean()),
                other => panic!("{other}"),
            }
        }
    }
    assert!(most >= 2, "no answer made two calls: {v}");
    // (With this seed some answers go on calling until max_tokens cuts a call.)
    assert!(cut > 0, "no answer was cut after a closed call: {v}");
    // Streamed, such an answer has sent the cut call's pieces too: its end says the call is
    // not one (tool_call_error), where the whole answer leaves it out.
    let mut streamed = body.clone();
    streamed["stream"] = true.into();
    let mut sent_calls = [0usize; 8];
    let mut errors = [false; 8];
    for e in events(addr, "/v1/chat/completions", &streamed)
        .iter()
        .filter(|e| *e != "[DONE]")
    {
        let e: Value = serde_json::from_str(e).unwrap();
        for c in e["choices"].as_array().into_iter().flatten() {
            let i = c["index"].as_u64().unwrap() as usize;
            for t in c["delta"]["tool_calls"].as_array().into_iter().flatten() {
                sent_calls[i] = sent_calls[i].max(t["index"].as_u64().unwrap() as usize + 1);
            }
            errors[i] |= c["delta"]["tool_call_error"].is_string();
        }
    }
    for (i, c) in v["choices"].as_array().unwrap().iter().enumerate() {
        let whole = c["message"]["tool_calls"].as_array().map_or(0, Vec::len);
        if whole > 0 {
            assert!(sent_calls[i] >= whole, "{i}: {c}");
            assert_eq!(errors[i], sent_calls[i] > whole, "choice {i}: {c}");
        }
    }
    // `parallel_tool_calls: false` holds it to one; it is a boolean.
    let (status, v) = post(
        addr,
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "x"}], "tools": strict,
                "tool_choice": "required", "parallel_tool_calls": "no"}),
    );
    assert_eq!(
        (status, v["error"]["param"].as_str()),
        (400, Some("parallel_tool_calls"))
    );
    // After a tool round (call, result) and after a later user turn, the call still opens.
    let rounds = [
        json!([{"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": null, "tool_calls": [{"id": "c0",
                 "type": "function",
                 "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
               {"role": "tool", "tool_call_id": "c0", "content": "sunny"}]),
        json!([{"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": null, "tool_calls": [{"id": "c0",
                 "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
               {"role": "tool", "tool_call_id": "c0", "content": "sunny"},
               {"role": "assistant", "content": "It is sunny."},
               {"role": "user", "content": "And the time?"}]),
    ];
    for messages in rounds {
        let body = json!({"messages": messages, "tools": tools, "tool_choice": "required",
                          "max_tokens": 8, "temperature": 0});
        let (status, v) = post(addr, "/v1/chat/completions", &body);
        assert_eq!(status, 200, "{v}");
        let m = &v["choices"][0]["message"];
        if m["tool_calls"].is_null() {
            let content = m["content"].as_str().unwrap();
            assert!(content.starts_with("<｜tool▁calls▁begin｜>"), "{content:?}");
        }
    }
    for (choice, why) in [
        (
            json!({"type": "function", "function": {"name": "nope"}}),
            "not one of",
        ),
        (json!("sometimes"), "expected"),
    ] {
        let (status, e) = post(addr, "/v1/chat/completions", &ask(choice));
        assert_eq!(
            (status, e["error"]["param"].as_str()),
            (400, Some("tool_choice"))
        );
        assert!(e["error"]["message"].as_str().unwrap().contains(why), "{e}");
    }
    // A forced call's broken parameters are the request's error (as vLLM's and OpenAI's), not
    // left unenforced; so are names that would break the call markup and parameters that are
    // no schema.
    let with_tool = |name: &str, parameters: Value, choice: Value| {
        json!({"messages": [{"role": "user", "content": "x"}], "max_tokens": 4,
               "tools": [{"type": "function", "function": {"name": name,
                          "parameters": parameters}}],
               "tool_choice": choice})
    };
    let named = json!({"type": "function", "function": {"name": "f"}});
    for (body, why) in [
        (
            with_tool(
                "f",
                json!({"type": "object", "properties": {"n": {"type": "integer",
                       "minimum": 5, "maximum": 3}}, "required": ["n"]}),
                named.clone(),
            ),
            "tools[0].function.parameters",
        ),
        (
            with_tool("f", json!({"type": "string"}), json!("required")),
            "tools[0].function.parameters",
        ),
        (
            with_tool("f", json!({"type": "foo"}), named.clone()),
            "tools[0].function.parameters",
        ),
        (
            with_tool("a b", json!({}), json!("auto")),
            "whitespace or control",
        ),
        (
            with_tool("a<|tool_call_argument_begin|>b", json!({}), json!("auto")),
            "special-token markup",
        ),
        (
            with_tool(
                "a<\u{ff5c}tool\u{2581}sep\u{ff5c}>b",
                json!({}),
                json!("auto"),
            ),
            "special-token markup",
        ),
        (
            with_tool("f", json!("object"), json!("auto")),
            "not a JSON Schema",
        ),
    ] {
        let (status, e) = post(addr, "/v1/chat/completions", &body);
        assert_eq!(
            (status, e["error"]["param"].as_str()),
            (400, Some("tools")),
            "{e}"
        );
        assert!(e["error"]["message"].as_str().unwrap().contains(why), "{e}");
    }
    // A keyword structured output does not support leaves the arguments any object (README).
    let (status, v) = post(
        addr,
        "/v1/chat/completions",
        &with_tool(
            "f",
            json!({"type": "object", "properties": {"n": {"type": "integer"}},
                   "dependentRequired": {"n": ["m"]}}),
            named,
        ),
    );
    assert_eq!(status, 200, "{v}");
    let (status, e) = post(
        addr,
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}),
    );
    assert_eq!(
        (status, e["error"]["param"].as_str()),
        (400, Some("tool_choice"))
    );
}

/// JSON mode (`response_format: {"type": "json_object"}`): the answer is a JSON object, or the
/// beginning of one when the length limit cuts it; schemas are refused by name.
/// DeepSeek-V4 (DSML): a forced "required" call opens with one of the tools' names, whatever
/// the model would write; a named call opens with its own; the parameters are held to the
/// tool's schema through the closing markup, so the answer is one call whose arguments the
/// schema accepts.
#[test]
fn serve_forces_tool_calls_in_dsml() {
    let server = start(&["--model", "fixtures/v4/flash_tiny", "--kv-blocks", "64"]);
    // OpenAI's content parts are one string to DeepSeek-V4's encoder (as to the others):
    // the same prompt as the joined text.
    let ids = |content: Value| {
        let m = json!([{"role": "system", "content": content.clone()},
                       {"role": "user", "content": content}]);
        let (status, t) = post(&server.addr, "/tokenize", &json!({"messages": m}));
        assert_eq!(status, 200, "{t}");
        t["tokens"].clone()
    };
    assert_eq!(
        ids(json!([{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}])),
        ids(json!("Hi\nthere"))
    );
    let tok =
        cachalot_model::tokenizer::Tokenizer::from_dir(&root().join("fixtures/v4/flash_tiny"))
            .unwrap();
    let tokenize = |body: Value| -> Vec<u32> {
        let (status, t) = post(&server.addr, "/tokenize", &body);
        assert_eq!(status, 200, "{t}");
        serde_json::from_value(t["tokens"].clone()).unwrap()
    };
    let hi = json!([{"role": "user", "content": "hi"}]);
    // DeepSeek-V4's encoder has a developer turn of its own (a user turn's opening; a system
    // message's text joins the prompt's start): it is not made a system message.
    let as_role = |role: &str| {
        tokenize(json!({"messages": [{"role": "system", "content": "S"},
                                     {"role": role, "content": "DEV"},
                                     {"role": "user", "content": "u"}]}))
    };
    assert_eq!(
        as_role("developer"),
        tokenize(
            json!({"prompt": "<｜begin▁of▁sentence｜>S<｜User｜>DEV<｜User｜>u<｜Assistant｜></think>",
                        "add_special_tokens": false})
        )
    );
    // OpenAI's top-level reasoning_effort reaches the encoder as the kwarg does.
    let max = tokenize(json!({"messages": hi, "reasoning_effort": "max",
                              "chat_template_kwargs": {"thinking": true}}));
    assert_eq!(
        max,
        tokenize(json!({"messages": hi,
                        "chat_template_kwargs": {"thinking": true, "reasoning_effort": "max"}}))
    );
    let thinking = tokenize(json!({"messages": hi, "chat_template_kwargs": {"thinking": true}}));
    assert!(max.len() > thinking.len() + 10, "{max:?}");
    // continue_final_message continues the final message's text, not the letters `hi` in
    // the `</think>` the encoder writes after it.
    let cont = tokenize(json!({"messages": hi, "continue_final_message": true,
                               "add_generation_prompt": false}));
    assert!(
        tok.decode(&cont).unwrap().ends_with("hi"),
        "{:?}",
        tok.decode(&cont)
    );
    let weather = json!({"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 6},
        "days": {"type": "integer", "minimum": 1, "maximum": 3},
        "units": {"enum": ["metric", "imperial"]}},
        "required": ["city", "days"], "additionalProperties": false});
    let tools = json!([
        {"type": "function", "function": {"name": "get_weather", "parameters": weather}},
        {"type": "function", "function": {"name": "get_time", "parameters":
            {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 4}},
             "required": ["zone"], "additionalProperties": false}}}]);
    let schema = |name: &str| {
        let t = tools.as_array().unwrap().iter();
        t.clone().find(|t| t["function"]["name"] == name).unwrap()["function"]["parameters"].clone()
    };
    // A call is one of `names`, its arguments held to its tool's schema.
    let check_call = |call: &Value, names: &[&str]| {
        let name = call["name"].as_str().unwrap();
        assert!(names.contains(&name), "{name}: {call}");
        let args: Value = serde_json::from_str(call["arguments"].as_str().unwrap()).unwrap();
        let props = schema(name)["properties"].clone();
        let o = args.as_object().unwrap();
        for req in schema(name)["required"].as_array().unwrap() {
            assert!(o.contains_key(req.as_str().unwrap()), "{args}");
        }
        for (k, v) in o {
            let p = &props[k];
            assert!(p.is_object(), "{k} is not a parameter of {name}: {args}");
            match p["type"].as_str() {
                Some("string") => assert!(
                    v.as_str().unwrap().chars().count() as u64 <= p["maxLength"].as_u64().unwrap()
                ),
                Some("integer") => assert!((1..=3).contains(&v.as_i64().unwrap())),
                _ => assert!(p["enum"].as_array().unwrap().contains(v)),
            }
        }
    };
    let mut calls = 0;
    let mut call_ids: Vec<String> = Vec::new();
    for (choice, names) in [
        (json!("required"), vec!["get_weather", "get_time"]),
        (
            json!({"type": "function", "function": {"name": "get_time"}}),
            vec!["get_time"],
        ),
        (
            json!({"type": "function", "function": {"name": "get_weather"}}),
            vec!["get_weather"],
        ),
    ] {
        for seed in 0..3 {
            let body = json!({"messages": [{"role": "user", "content": "Weather in Paris?"}],
                              "tools": tools, "tool_choice": choice, "max_tokens": 400,
                              "temperature": 0.8, "seed": seed});
            let (status, v) = post(&server.addr, "/v1/chat/completions", &body);
            assert_eq!(status, 200, "{v}");
            let choice = &v["choices"][0];
            let m = &choice["message"];
            if choice["finish_reason"] == "length" {
                continue;
            }
            assert_eq!(choice["finish_reason"], "tool_calls", "{v}");
            let id = m["tool_calls"][0]["id"].as_str().unwrap().to_string();
            // Unique over the answers (clients match results to calls by id).
            assert!(id.starts_with("call_") && !call_ids.contains(&id), "{id}");
            call_ids.push(id);
            // ("required" may write several calls, each held to its tool's schema; a named
            // call is one.)
            let all = m["tool_calls"].as_array().expect("calls");
            assert!(all.len() == 1 || names.len() > 1, "{v}");
            for c in all {
                check_call(&c["function"], &names);
            }
            calls += 1;
            // Streamed, the same calls come as they are written: each name first, then its
            // parameters as pieces of the same JSON text.
            let mut body = body.clone();
            body["stream"] = true.into();
            let (streamed, finish, pieces) =
                accumulate(&events(&server.addr, "/v1/chat/completions", &body));
            assert_eq!(finish, "tool_calls");
            let functions = |calls: &Value| -> Vec<Value> {
                calls
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|c| c["function"].clone())
                    .collect()
            };
            assert_eq!(
                functions(&streamed["tool_calls"]),
                functions(&m["tool_calls"]),
                "{streamed}"
            );
            if all[0]["function"]["arguments"] != "{}" {
                assert!(pieces > 2, "{pieces} pieces: {streamed}");
            }
        }
    }
    assert!(calls >= 6, "{calls} of 9 answers were whole calls");
    // "required" lets the model write several calls, as vLLM's: an invoke of any tool after
    // each, each held to its tool's schema, until it closes the block.
    let body = json!({"messages": [{"role": "user", "content": "Weather in Paris and Rome?"}],
                      "tools": tools, "tool_choice": "required", "max_tokens": 400,
                      "temperature": 1.5, "seed": 3, "n": 8});
    let (status, v) = post(&server.addr, "/v1/chat/completions", &body);
    assert_eq!(status, 200, "{v}");
    let mut most = 0;
    for c in v["choices"].as_array().unwrap() {
        assert_eq!(c["finish_reason"], "tool_calls", "{c}");
        let all = c["message"]["tool_calls"].as_array().unwrap();
        for call in all {
            check_call(&call["function"], &["get_weather", "get_time"]);
        }
        most = most.max(all.len());
    }
    assert!(most >= 2, "no answer made two calls: {v}");
    // /tokenize counts a forced call's start as the answer's prompt does.
    let q = json!([{"role": "user", "content": "u"}]);
    let shown = tokenize(json!({"messages": q, "tools": tools})).len();
    for choice in [
        json!("required"),
        json!({"type": "function", "function": {"name": "get_time"}}),
    ] {
        let n = tokenize(json!({"messages": q, "tools": tools, "tool_choice": choice})).len();
        let (status, v) = post(
            &server.addr,
            "/v1/chat/completions",
            &json!({"messages": q, "tools": tools, "tool_choice": choice, "max_tokens": 1}),
        );
        assert_eq!(status, 200, "{v}");
        assert_eq!(v["usage"]["prompt_tokens"], n, "{choice}");
        assert!(n > shown, "{choice}");
    }
    // In thinking mode a forced call follows an empty reasoning block, as the encoder writes
    // a thinking-mode call: `<think></think>` and the DSML block.
    let q = json!([{"role": "user", "content": "Weather in Paris?"}]);
    // tool_choice "none" shows the tools as "auto" does (vLLM's default); only the answer is
    // not read for calls.
    let with =
        |choice: &str| tokenize(json!({"messages": q, "tools": tools, "tool_choice": choice}));
    assert_eq!(with("none"), with("auto"));
    assert_ne!(with("none"), tokenize(json!({"messages": q})));
    let prompt = tokenize(json!({"messages": q, "tools": tools,
                                 "chat_template_kwargs": {"thinking": true}}));
    let kwargs = json!({"thinking": true});
    let text = tok
        .chat_template()
        .unwrap()
        .unwrap()
        .render_json(&q, true, Some(&tools), kwargs.as_object().unwrap())
        .unwrap();
    assert!(text.ends_with("<think>"), "{text:?}");
    let d = cachalot_model::tokenizer::dsv4::DSML;
    let forced = format!("{text}</think>\n\n<{d}tool_calls>\n<{d}invoke name=\"get_time\">\n");
    // (The served prompt is /tokenize's with the forced start: the same BOS.)
    let want = prompt.len() - tok.encode(&text).unwrap().len() + tok.encode(&forced).unwrap().len();
    let body = json!({"messages": q, "tools": tools, "max_tokens": 1,
                      "chat_template_kwargs": {"thinking": true},
                      "tool_choice": {"type": "function", "function": {"name": "get_time"}}});
    let (status, v) = post(&server.addr, "/v1/chat/completions", &body);
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["usage"]["prompt_tokens"], want, "{v}");
}

#[test]
fn serve_json_mode() {
    let server = start(&["--kv-blocks", "64"]);
    let addr = server.addr.as_str();
    for seed in 0..3 {
        let body = json!({"prompt": "Here is the data:", "max_tokens": 40, "temperature": 0.8,
                          "seed": seed, "response_format": {"type": "json_object"}});
        let (status, v) = post(addr, "/v1/completions", &body);
        assert_eq!(status, 200, "{v}");
        let text = v["choices"][0]["text"].as_str().unwrap();
        assert!(text.trim_start().starts_with('{'), "{text:?}");
        if v["choices"][0]["finish_reason"] == "stop" {
            let o: Value = serde_json::from_str(text).unwrap();
            assert!(o.is_object());
        }
    }
    // min_tokens yields where only a stop token may follow (the value closed): the same
    // answer and finish as without it.
    let schema = json!({"type": "boolean"});
    for seed in 0..2 {
        let body = json!({"prompt": "The whale", "max_tokens": 60, "temperature": 0.8,
            "seed": seed, "response_format": {"type": "json_schema",
            "json_schema": {"name": "answer", "schema": schema}}});
        let (_, a) = post(addr, "/v1/completions", &body);
        let mut held = body.clone();
        held["min_tokens"] = 50.into();
        let (status, b) = post(addr, "/v1/completions", &held);
        assert_eq!(status, 200, "{b}");
        assert_eq!(a["choices"][0]["finish_reason"], "stop", "{a}");
        assert_eq!(a["choices"], b["choices"]);
        // vLLM's guided_json (the schema or its text) and structured_outputs ask the same.
        for extra in [
            json!({"guided_json": schema}),
            json!({"guided_json": schema.to_string()}),
            json!({"structured_outputs": {"json": schema}}),
        ] {
            let mut v = body.clone();
            v.as_object_mut().unwrap().remove("response_format");
            for (k, x) in extra.as_object().unwrap() {
                v[k] = x.clone();
            }
            let (status, c) = post(addr, "/v1/completions", &v);
            assert_eq!(status, 200, "{c}");
            assert_eq!(a["choices"], c["choices"], "{extra}");
        }
    }
    // What vLLM enforces and this server cannot is refused by name, not left unenforced.
    for (extra, param) in [
        (json!({"guided_regex": "[a-z]+"}), "guided_regex"),
        (json!({"guided_choice": ["a", "b"]}), "guided_choice"),
        (
            json!({"guided_whitespace_pattern": " ?"}),
            "guided_whitespace_pattern",
        ),
        (json!({"functions": [{"name": "f"}]}), "functions"),
        (json!({"function_call": {"name": "f"}}), "function_call"),
        (
            json!({"structured_outputs": {"regex": "x"}}),
            "structured_outputs",
        ),
        (json!({"guided_json": "{not json"}), "guided_json"),
        (
            json!({"guided_json": {"type": "object"}, "response_format": {"type": "json_object"}}),
            "response_format",
        ),
    ] {
        let mut v = json!({"prompt": "x", "max_tokens": 2});
        for (k, x) in extra.as_object().unwrap() {
            v[k] = x.clone();
        }
        let (status, e) = post(addr, "/v1/completions", &v);
        assert_eq!(status, 400, "{extra}: {e}");
        assert_eq!(e["error"]["param"], param, "{e}");
    }
    // Structured output: the answer is a value the schema accepts (or cut off by max_tokens).
    let schemas = [
        json!({"type": "array", "items": {"type": "boolean"}, "maxItems": 3}),
        json!({"type": "integer"}),
        json!({"type": "object", "properties": {"ok": {"type": "boolean"},
               "color": {"enum": ["red", "green"]}}, "required": ["ok", "color"],
               "additionalProperties": false}),
        json!({"type": "object", "properties": {
               "code": {"type": "string", "pattern": "^[a-z]{3}$"},
               "n": {"type": "integer", "minimum": 5, "maximum": 9},
               "w": {"type": "string", "maxLength": 2}},
               "required": ["code", "n", "w"], "additionalProperties": false}),
        // A tuple, a set of enum values, a decimal step, merged through allOf.
        json!({"allOf": [{"type": "object", "properties": {
               "pair": {"type": "array", "prefixItems": [{"type": "integer"},
                        {"type": "string", "maxLength": 5}], "items": false, "minItems": 2},
               "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]},
                        "uniqueItems": true, "minItems": 2}},
               "required": ["pair", "tags"]},
               {"properties": {"price": {"type": "number", "multipleOf": 0.25, "minimum": 0,
                "maximum": 100}, "pair": {}, "tags": {}}, "required": ["price"],
                "additionalProperties": false}]}),
    ];
    for (i, schema) in schemas.iter().enumerate() {
        let mut completed = 0;
        // Seeds until two answers complete within max_tokens (the small model may wander on;
        // whether it closes in time is chance, the schema's hold on every token is not).
        for seed in 0..8 {
            if completed == 2 {
                break;
            }
            let body = json!({"prompt": "The whale", "max_tokens": 300, "temperature": 0.8,
                "seed": seed, "response_format": {"type": "json_schema",
                "json_schema": {"name": "answer", "schema": schema}}});
            let (status, v) = post(addr, "/v1/completions", &body);
            assert_eq!(status, 200, "{v}");
            let text = v["choices"][0]["text"].as_str().unwrap();
            if v["choices"][0]["finish_reason"] != "stop" {
                continue;
            }
            completed += 1;
            let got: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{e}: {text:?}"));
            match i {
                0 => assert!(
                    got.as_array()
                        .is_some_and(|a| a.len() <= 3 && a.iter().all(Value::is_boolean)),
                    "{got}"
                ),
                // An integer's text (a top-level number may run past i64).
                1 => assert!(
                    got.is_number() && text.trim().bytes().all(|b| b == b'-' || b.is_ascii_digit()),
                    "{text:?}"
                ),
                4 => {
                    let pair = got["pair"].as_array().unwrap();
                    assert!(pair.len() == 2 && pair[0].is_number(), "{got}");
                    assert!(pair[1].as_str().unwrap().chars().count() <= 5, "{got}");
                    let tags = got["tags"].as_array().unwrap();
                    assert!(tags.len() >= 2, "{got}");
                    for (i, t) in tags.iter().enumerate() {
                        assert!(!tags[..i].contains(t), "{got}");
                    }
                    let price = got["price"].as_f64().unwrap();
                    assert!((0.0..=100.0).contains(&price) && (price * 4.0).fract() == 0.0);
                    assert_eq!(got.as_object().unwrap().len(), 3, "{got}");
                }
                3 => {
                    let code = got["code"].as_str().unwrap();
                    assert!(code.len() == 3 && code.bytes().all(|b| b.is_ascii_lowercase()));
                    assert!((5..=9).contains(&got["n"].as_i64().unwrap()), "{got}");
                    assert!(got["w"].as_str().unwrap().chars().count() <= 2, "{got}");
                }
                _ => {
                    assert!(got["ok"].is_boolean(), "{got}");
                    assert!(got["color"] == "red" || got["color"] == "green", "{got}");
                    assert_eq!(got.as_object().unwrap().len(), 2, "{got}");
                }
            }
        }
        assert!(completed > 0, "no answer under {schema} completed");
    }
    for (format, why) in [
        (json!({"type": "json_schema"}), "json_schema"),
        (
            json!({"type": "json_schema", "json_schema": {"name": "x",
                "schema": {"type": "number", "not": {"const": 0.5}}}}),
            "`not`",
        ),
    ] {
        let (status, e) = post(
            addr,
            "/v1/completions",
            &json!({"prompt": "x", "response_format": format}),
        );
        assert_eq!(
            (status, e["error"]["param"].as_str()),
            (400, Some("response_format"))
        );
        assert!(e["error"]["message"].as_str().unwrap().contains(why), "{e}");
    }
    // A forced tool call's markup is not JSON: the two are refused together.
    let tools = json!([{"type": "function", "function": {"name": "f", "parameters": {}}}]);
    let (status, e) = post(
        addr,
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "x"}], "tools": tools,
                "tool_choice": "required", "response_format": {"type": "json_object"}}),
    );
    assert_eq!(
        (status, e["error"]["param"].as_str()),
        (400, Some("response_format"))
    );
}

/// Through the router too, a client that leaves has its request aborted on the decode server,
/// whole or streamed (the router relays the decode server's keep-alive chunks, so its write to
/// the departed client fails and it drops the decode connection).
#[test]
fn the_router_passes_a_departed_client_on() {
    let pre = start(&["--role", "prefill", "--kv-port", "0", "--kv-blocks", "64"]);
    let dec = start(&[
        "--role",
        "decode",
        "--batch-size",
        "1",
        "--kv-blocks",
        "40",
        "--keepalive-ms",
        "50",
    ]);
    let router = start_command("router", &["--prefill", &pre.addr, "--decode", &dec.addr]);
    let addr = router.addr.as_str();
    for stream in [false, true] {
        leave_a_long_request(addr, stream, &dec, usize::from(stream) + 1);
    }
    // The decode server's only slot is free again.
    let (status, v) = post(
        addr,
        "/v1/completions",
        &json!({"prompt": "Hi", "max_tokens": 2}),
    );
    assert_eq!(status, 200, "{v}");
    // The router's /health asks its servers: all up is "ok"; with the prefill server gone no
    // request can be served (503), and it says which server is down.
    let (status, h) = http(addr, "GET", "/health", "");
    assert_eq!(status, 200, "{h}");
    let h: Value = serde_json::from_str(&h).unwrap();
    assert_eq!(h["status"], "ok", "{h}");
    assert_eq!(h["decode"][0]["healthy"], true, "{h}");
    drop(pre);
    let (status, h) = http(addr, "GET", "/health", "");
    assert_eq!(status, 503, "{h}");
    let h: Value = serde_json::from_str(&h).unwrap();
    assert_eq!(h["status"], "unavailable", "{h}");
    assert_eq!(h["prefill"][0]["healthy"], false, "{h}");
    assert_eq!(h["decode"][0]["healthy"], true, "{h}");
}

/// Prefix caching (on by default for this model): a repeated system prompt and a repeated
/// request take their first blocks from the cache, answer as a server without it does, and
/// say so in `usage.prompt_tokens_details.cached_tokens` and `/metrics`; a prompt to be
/// scored (echo) computes every position.
#[test]
fn serve_shares_cached_prefixes() {
    let system = "You are a careful assistant who answers questions about whales, their \
                  songs, their migrations and the ships that hunted them, in plain words.";
    let chat = |question: &str| {
        json!({"messages": [{"role": "system", "content": system},
                            {"role": "user", "content": question}],
               "max_tokens": 8, "temperature": 0})
    };
    let questions = ["Why do whales sing?", "Where do they go in winter?"];
    let mut answers: Vec<Vec<Value>> = Vec::new();
    // Off, on, and on with MTP drafts (blocks keyed with the token after them).
    for (mode, mtp) in [("off", "0"), ("auto", "0"), ("auto", "1")] {
        let server = start(&["--block-size", "16", "--prefix-caching", mode, "--mtp", mtp]);
        let addr = server.addr.as_str();
        let mut got = Vec::new();
        for q in questions.iter().chain(&questions[..1]) {
            let (status, r) = post(addr, "/v1/chat/completions", &chat(q));
            assert_eq!(status, 200, "{r}");
            got.push(r);
        }
        let cached: Vec<u64> = got
            .iter()
            .map(|r| {
                r["usage"]["prompt_tokens_details"]["cached_tokens"]
                    .as_u64()
                    .unwrap()
            })
            .collect();
        let prompt = got[2]["usage"]["prompt_tokens"].as_u64().unwrap();
        let queries = counter(addr, "prefix_cache_queries_total");
        if mode == "off" {
            assert_eq!(cached, [0, 0, 0]);
            assert_eq!(queries, 0);
        } else {
            let prompts: u64 = got
                .iter()
                .map(|r| r["usage"]["prompt_tokens"].as_u64().unwrap())
                .sum();
            assert_eq!(queries, prompts);
            // The first request finds nothing; the second its system prompt's whole blocks;
            // the repeat everything but the last block boundary before its final token.
            assert_eq!(cached[0], 0);
            assert!(cached[1] >= 16, "{cached:?}");
            assert_eq!(cached[2], (prompt - 1) / 16 * 16, "{cached:?}");
            assert_eq!(prefix_hits(addr), cached.iter().sum::<u64>());
            // Echo scores the whole prompt, cached or not.
            let (status, e) = post(
                addr,
                "/v1/completions",
                &json!({"prompt": system, "max_tokens": 0, "echo": true, "logprobs": 0}),
            );
            assert_eq!(status, 200, "{e}");
            let l = &e["choices"][0]["logprobs"]["token_logprobs"];
            let n = l.as_array().unwrap().len();
            assert!(
                n > 16 && (1..n).all(|i| l[i].as_f64().unwrap() < 0.0),
                "{e}"
            );
            assert_eq!(e["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
        }
        answers.push(got);
    }
    for on in &answers[1..] {
        for (i, (off, on)) in answers[0].iter().zip(on).enumerate() {
            assert_eq!(
                off["choices"][0]["message"], on["choices"][0]["message"],
                "answer {i}"
            );
        }
    }
    assert_eq!(
        answers[1][0]["choices"][0]["message"],
        answers[1][2]["choices"][0]["message"]
    );
    let m = &answers[1][0]["choices"][0]["message"];
    assert!(m.to_string().len() > 40, "an answer to compare: {m}");
}

/// DeepSeek-V4 behind the router: the prefill server's KV snapshot carries each request's
/// compact-cache state slot (its window and compressor rings), so the decode server answers a
/// prompt longer than the rings (and a short one) as one server does; with `--v4-cache full`
/// on both sides too. Sides with different layouts are refused by the decode server. A server
/// over two ranks with `--parallel context` (f32 and bf16 caches) answers as one process.
#[test]
fn v4_prefill_and_decode_servers_answer_as_one_server() {
    let model = ["--model", "fixtures/v4/flash_tiny", "--kv-blocks", "64"];
    let long: Vec<u32> = (0..180u32).map(|i| (i * 37 + 11) % 480 + 20).collect();
    let bodies = [
        json!({"prompt": long, "max_tokens": 12, "temperature": 0, "ignore_eos": true}),
        json!({"prompt": "The sea", "max_tokens": 8, "temperature": 0.8, "seed": 3,
               "ignore_eos": true}),
    ];
    for layout in ["compact", "full"] {
        let with = |extra: &[&str]| {
            let mut a: Vec<&str> = model.to_vec();
            a.extend(["--v4-cache", layout]);
            a.extend(extra);
            start(&a)
        };
        let one = with(&[]);
        let pre = with(&["--role", "prefill", "--kv-port", "0", "--block-size", "16"]);
        let dec = with(&["--role", "decode", "--batch-size", "2"]);
        let router = start_router(&pre, &dec);
        for body in &bodies {
            let (s1, a) = post(&one.addr, "/v1/completions", body);
            let (s2, b) = post(&router.addr, "/v1/completions", body);
            assert_eq!((s1, s2), (200, 200), "{layout}: {a} {b}");
            assert_eq!(a["choices"], b["choices"], "{layout}: {body}");
        }
    }
    // Sides with different layouts: the decode server refuses the snapshot, naming the option.
    let pre = start(&[
        "--model",
        "fixtures/v4/flash_tiny",
        "--role",
        "prefill",
        "--kv-port",
        "0",
    ]);
    let dec = start(&[
        "--model",
        "fixtures/v4/flash_tiny",
        "--role",
        "decode",
        "--v4-cache",
        "full",
    ]);
    let router = start_router(&pre, &dec);
    let (status, v) = post(&router.addr, "/v1/completions", &bodies[0]);
    assert_ne!(status, 200, "{v}");
    assert!(v.to_string().contains("--v4-cache"), "{v}");
    // One server over two ranks under prefill context parallelism (each prompt's pieces on
    // both ranks), in f32, bf16 and fp8: one process's answers.
    for dtype in ["f32", "bf16", "fp8"] {
        let with = |extra: &[&str]| {
            let mut a: Vec<&str> = model.to_vec();
            a.extend(["--kv-cache-dtype", dtype]);
            a.extend(extra);
            start(&a)
        };
        let one = with(&[]);
        let cp = with(&["--ranks", "2", "--parallel", "context"]);
        for body in &bodies {
            let (s1, a) = post(&one.addr, "/v1/completions", body);
            let (s2, b) = post(&cp.addr, "/v1/completions", body);
            assert_eq!((s1, s2), (200, 200), "{dtype}: {a} {b}");
            assert_eq!(a["choices"], b["choices"], "context, {dtype}: {body}");
        }
    }
}

/// Out of file descriptors (a low RLIMIT_NOFILE, idle connections holding them all), the
/// server stops accepting for a while and takes connections again once some close: it neither
/// exits nor stays deaf.
#[test]
fn running_out_of_file_descriptors_is_survived() {
    use std::os::unix::process::CommandExt;
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_cachalot"));
    cmd.args(["serve", "--port", "0", "--model", "assets/cachalot-tiny-r1"]);
    // SAFETY: only setrlimit between fork and exec.
    unsafe {
        cmd.pre_exec(|| {
            let r = libc::rlimit {
                rlim_cur: 200,
                rlim_max: 200,
            };
            libc::setrlimit(libc::RLIMIT_NOFILE, &r);
            Ok(())
        });
    }
    let mut server = spawn_server(cmd, false);
    let mut idle = Vec::new();
    for _ in 0..260 {
        match TcpStream::connect_timeout(
            &server.addr.parse().unwrap(),
            std::time::Duration::from_millis(500),
        ) {
            Ok(s) => idle.push(s),
            Err(_) => break,
        }
    }
    std::thread::sleep(std::time::Duration::from_millis(500));
    assert!(
        server.child.try_wait().unwrap().is_none(),
        "the server exited"
    );
    drop(idle);
    let t = std::time::Instant::now();
    loop {
        if let Ok(mut s) = TcpStream::connect(&server.addr) {
            s.set_read_timeout(Some(std::time::Duration::from_secs(5)))
                .unwrap();
            let _ = write!(
                s,
                "GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
            );
            let mut answer = String::new();
            if s.read_to_string(&mut answer).is_ok() && answer.starts_with("HTTP/1.1 200") {
                break;
            }
        }
        assert!(
            t.elapsed().as_secs() < 30,
            "the server never took connections again"
        );
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
    let (status, v) = post(
        &server.addr,
        "/v1/completions",
        &json!({"prompt": "The whale", "max_tokens": 4}),
    );
    assert_eq!(status, 200, "{v}");
}

/// Sends SIGTERM to a server (rank 0 of its group).
fn sigterm(server: &Server) {
    // SAFETY: signals our own child.
    unsafe { libc::kill(server.child.id() as libc::pid_t, libc::SIGTERM) };
}

/// The exit status of a server that must end by itself within `limit` seconds.
fn exit_within(server: &mut Server, limit: u64) -> Option<i32> {
    let t = std::time::Instant::now();
    loop {
        if let Some(st) = server.child.try_wait().unwrap() {
            return st.code();
        }
        assert!(t.elapsed().as_secs() < limit, "the server did not exit");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

/// SIGTERM drains: a request in flight finishes whole, new requests and the health check get
/// 503 meanwhile, and the server then exits 0 by itself; over two ranks, rank 0 stops the
/// other cleanly (no rank reports an error).
#[test]
fn sigterm_drains_requests_in_flight() {
    for ranks in [&[][..], &["--ranks", "2"]] {
        let mut args = vec!["--model", "assets/cachalot-tiny-r1"];
        args.extend(ranks);
        let mut server = start(&args);
        let addr = server.addr.clone();
        let long = std::thread::spawn(move || {
            post(
                &addr,
                "/v1/completions",
                &json!({"prompt": "The whale", "max_tokens": 1500, "ignore_eos": true}),
            )
        });
        // The long request is running once the server counts it.
        let t = std::time::Instant::now();
        loop {
            let (_, metrics) = http(&server.addr, "GET", "/metrics", "");
            if metrics
                .lines()
                .any(|l| l.starts_with("cachalot:num_requests_running") && !l.ends_with(" 0"))
            {
                break;
            }
            assert!(t.elapsed().as_secs() < 60, "the request never ran");
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        // Generated tokens are counted as they come, not when their request ends.
        loop {
            let (_, metrics) = http(&server.addr, "GET", "/metrics", "");
            let line = |p: &str| {
                metrics
                    .lines()
                    .find(|l| l.starts_with(p))
                    .and_then(|l| l.rsplit(' ').next())
                    .and_then(|v| v.parse::<f64>().ok())
                    .unwrap_or(0.0)
            };
            if line("cachalot:generation_tokens_total{") > 0.0 {
                assert_eq!(line("cachalot:request_success_total{"), 0.0, "{metrics}");
                break;
            }
            assert!(t.elapsed().as_secs() < 60, "no generated tokens counted");
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        sigterm(&server);
        std::thread::sleep(std::time::Duration::from_millis(200));
        let (status, v) = post(&server.addr, "/v1/completions", &json!({"prompt": "x"}));
        assert_eq!(status, 503, "{v}");
        assert!(v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("shutting down"));
        let (status, health) = http(&server.addr, "GET", "/health", "");
        assert_eq!(
            (status, health.contains("draining")),
            (503, true),
            "{health}"
        );
        let (status, v) = long.join().unwrap();
        assert_eq!(status, 200, "{v}");
        assert_eq!(v["usage"]["completion_tokens"], 1500, "{v}");
        assert_eq!(exit_within(&mut server, 60), Some(0), "{ranks:?}");
        let log = server.log.lock().unwrap().join("\n");
        assert!(log.contains("drained"), "{log}");
        assert!(
            !log.to_lowercase().contains("error") && !log.contains("failed"),
            "{ranks:?}: {log}"
        );
    }
}

/// A prefill server (`--drain-timeout-s DRAIN`) that has prefilled a request for room 5: the
/// server, its KV port and the request.
fn prefilled_room_5(drain: &str) -> (Server, u64, Value) {
    let pre = start(&[
        "--role",
        "prefill",
        "--kv-port",
        "0",
        "--drain-timeout-s",
        drain,
    ]);
    let kv_port = {
        let (_, h) = http(&pre.addr, "GET", "/health", "");
        let h: Value = serde_json::from_str(&h).unwrap();
        h["kv_port"].as_u64().unwrap()
    };
    let body = json!({"prompt": "The whale", "max_tokens": 8, "temperature": 0,
                      "bootstrap_room": 5, "bootstrap_host": "127.0.0.1",
                      "bootstrap_port": kv_port});
    let (status, v) = post(&pre.addr, "/v1/completions", &body);
    assert_eq!(status, 200, "{v}");
    (pre, kv_port, body)
}

/// A prefill server's drain waits for the KV its decode server has not fetched: it exits 0
/// once that is taken, and 143 when the grace ends first.
#[test]
fn prefill_drain_waits_for_held_kv() {
    for fetch in [true, false] {
        let (mut pre, _, body) = prefilled_room_5("4");
        sigterm(&pre);
        std::thread::sleep(std::time::Duration::from_millis(1000));
        assert!(
            pre.child.try_wait().unwrap().is_none(),
            "the prefill server left with KV still held"
        );
        if fetch {
            let dec = start(&["--role", "decode"]);
            let (status, v) = post(&dec.addr, "/v1/completions", &body);
            assert_eq!(
                (status, v["usage"]["completion_tokens"].as_u64()),
                (200, Some(8)),
                "{v}"
            );
        }
        let code = exit_within(&mut pre, 30);
        assert_eq!(code, Some(if fetch { 0 } else { 143 }));
        let log = pre.log.lock().unwrap().join("\n");
        assert!(log.contains("1 prefilled KV awaiting"), "{log}");
    }
}

/// A room whose decode server will not come (the router's `CKV-DROP`): its KV is dropped at
/// once, a late fetch learns why, and the prefill server's drain has nothing to wait for.
#[test]
fn a_dropped_room_frees_its_kv() {
    let (mut pre, kv_port, _) = prefilled_room_5("30");
    let ask = |verb: &[u8]| {
        let mut c = TcpStream::connect(("127.0.0.1", kv_port as u16)).unwrap();
        let mut hello = [0u8; 8];
        c.read_exact(&mut hello).unwrap();
        assert_eq!(&hello, b"CKV-PORT");
        c.write_all(verb).unwrap();
        c.write_all(&5u64.to_le_bytes()).unwrap();
        let mut answer = Vec::new();
        let _ = c.read_to_end(&mut answer);
        answer
    };
    assert_eq!(ask(b"CKV-DROP"), [0]);
    let late = ask(b"CKV-GET2");
    assert_eq!(late[0], 1, "{late:?}");
    let why = String::from_utf8_lossy(&late[5..]).to_string();
    assert!(why.contains("dropped") && why.contains("router"), "{why}");
    sigterm(&pre);
    assert_eq!(exit_within(&mut pre, 10), Some(0));
}

/// Two requests naming one room (without the router, which refuses that): the one whose
/// prompts differ from the prefilled KV's is told so and the KV stays for its own request.
#[test]
fn a_room_gives_its_kv_only_to_its_own_request() {
    let (_pre, _, body) = prefilled_room_5("30");
    let dec = start(&["--role", "decode", "--kv-timeout-s", "30"]);
    let mut other = body.clone();
    other["prompt"] = "Another whale".into();
    let (status, v) = post(&dec.addr, "/v1/completions", &other);
    assert_eq!(status, 502, "{v}");
    let m = v["error"]["message"].as_str().unwrap();
    assert!(m.contains("holds the KV of another request"), "{m}");
    let (status, v) = post(&dec.addr, "/v1/completions", &body);
    assert_eq!(
        (status, v["usage"]["completion_tokens"].as_u64()),
        (200, Some(8)),
        "{v}"
    );
}

/// A decode server's fetch of KV, against stand-ins for the prefill server's KV port: a port
/// that is not one (it answers something else) is said at once; a room that never comes ends
/// after `--kv-timeout-s`, said with that value; a drain whose grace ends while a request
/// waits answers it 503 (the client got an empty reply when the process left); a host given
/// with its port is refused by field.
#[test]
fn decode_server_fetch_failures_are_said() {
    use std::net::TcpListener;
    let mut server = start(&[
        "--model",
        "assets/cachalot-tiny-r1",
        "--role",
        "decode",
        "--kv-timeout-s",
        "2",
        "--drain-timeout-s",
        "3",
    ]);
    // An HTTP-like port: it answers at once with something that is not the greeting.
    let http_like = TcpListener::bind("127.0.0.1:0").unwrap();
    let http_port = http_like.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for mut c in http_like.incoming().map_while(Result::ok) {
            let _ = c.write_all(b"HTTP/1.1 400 Bad Request\r\n\r\n");
        }
    });
    // A KV port that greets and then never answers (a room no prefill server fills).
    let silent = TcpListener::bind("127.0.0.1:0").unwrap();
    let silent_port = silent.local_addr().unwrap().port();
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for mut c in silent.incoming().map_while(Result::ok) {
            let _ = c.write_all(b"CKV-PORT");
            held.push(c);
        }
    });
    let body = |port: u16, host: &str| {
        json!({"prompt": "The whale", "max_tokens": 4, "bootstrap_room": 7,
               "bootstrap_host": host, "bootstrap_port": port})
    };
    // A fetch from `port` that fails: the 502's message and the seconds it took.
    let failed = |port: u16| {
        let t = std::time::Instant::now();
        let (status, v) = post(&server.addr, "/v1/completions", &body(port, "127.0.0.1"));
        assert_eq!(status, 502, "{v}");
        let m = v["error"]["message"].as_str().unwrap().to_string();
        (m, t.elapsed().as_secs_f64())
    };
    let (m, took) = failed(http_port);
    assert!(m.contains("not a prefill server's KV port"), "{m}");
    assert!(took < 5.0, "{took}");

    let (m, waited) = failed(silent_port);
    assert!(m.contains("no answer within 2 s"), "{m}");
    assert!((1.5..10.0).contains(&waited), "{waited}");

    // An HTTP port (the server's own), which waits for a request before it says anything: it
    // is asked one after a second and said to be the wrong port.
    let own_port: u16 = server.addr.rsplit(':').next().unwrap().parse().unwrap();
    let (m, took) = failed(own_port);
    assert!(
        m.contains("answers HTTP") && m.contains("not a prefill server's KV port"),
        "{m}"
    );
    assert!(took < 6.0, "{took}");

    // A port that takes the connection and says nothing, not even to HTTP (a prefill server
    // stopped with SIGSTOP): said as that, not as a wrong port.
    let mute = TcpListener::bind("127.0.0.1:0").unwrap();
    let mute_port = mute.local_addr().unwrap().port();
    std::thread::spawn(move || {
        let held: Vec<_> = mute.incoming().map_while(Result::ok).collect();
        drop(held);
    });
    let (m, _) = failed(mute_port);
    assert!(
        m.contains("stopped") && !m.contains("not a prefill server's KV port"),
        "{m}"
    );

    let (status, v) = post(
        &server.addr,
        "/v1/completions",
        &body(silent_port, "127.0.0.1:18800"),
    );
    assert_eq!(status, 400, "{v}");
    assert_eq!(v["error"]["param"], "bootstrap_host", "{v}");

    // The drain's grace (3 s) ends before the KV timeout would (the server is restarted with
    // a longer one).
    drop(server);
    server = start(&[
        "--model",
        "assets/cachalot-tiny-r1",
        "--role",
        "decode",
        "--kv-timeout-s",
        "600",
        "--drain-timeout-s",
        "3",
    ]);
    let addr = server.addr.clone();
    let waiting =
        std::thread::spawn(move || post(&addr, "/v1/completions", &body(silent_port, "127.0.0.1")));
    std::thread::sleep(std::time::Duration::from_millis(500));
    sigterm(&server);
    let (status, v) = waiting.join().unwrap();
    assert_eq!(status, 503, "{v}");
    let m = v["error"]["message"].as_str().unwrap();
    assert!(
        m.contains("shutting down") && m.contains("bootstrap_room 7"),
        "{m}"
    );
    assert!(exit_within(&mut server, 30).is_some());
}

/// A template whose generation prompt closes the reasoning block (thinking turned off): the
/// answer is all content, a `<think>` the model writes included (as vLLM's parsers leave it
/// with thinking off); one that opens the block splits as before.
#[test]
fn a_closed_reasoning_block_leaves_the_answer_content() {
    let dir = tempfile::tempdir().unwrap();
    let template = |tail: &str| {
        let p = dir.path().join(format!("t{}.jinja", tail.len()));
        std::fs::write(
            &p,
            format!(
                "{{% for m in messages %}}<｜User｜>{{{{ m.content }}}}{{% endfor %}}\
                 {{% if add_generation_prompt %}}<｜Assistant｜>{tail}{{% endif %}}"
            ),
        )
        .unwrap();
        p.display().to_string()
    };
    let tok =
        cachalot_model::tokenizer::Tokenizer::from_dir(&root().join("assets/cachalot-tiny-r1"))
            .unwrap();
    let think = tok.token_to_id("<think>").unwrap();
    let body = json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3,
                      "temperature": 0, "logit_bias": {think.to_string(): 100}});
    for (tail, content, reasoning) in [
        (
            "<think>\n\n</think>\n\n",
            Some("<think><think><think>"),
            None,
        ),
        // Nothing after the reasoning: no content (null), as vLLM's parsers.
        ("<think>\n", None, Some("<think><think><think>")),
    ] {
        let server = start(&["--chat-template", &template(tail)]);
        let (status, v) = post(&server.addr, "/v1/chat/completions", &body);
        assert_eq!(status, 200, "{v}");
        let m = &v["choices"][0]["message"];
        assert_eq!(m["content"].as_str(), content, "{tail:?}: {v}");
        assert_eq!(m["reasoning_content"].as_str(), reasoning, "{tail:?}: {v}");
    }
}

/// The raw head of one exchange (status line and headers, lower-cased), for headers the other
/// helpers drop.
fn head_of(addr: &str, request: &str) -> String {
    let mut s = TcpStream::connect(addr).unwrap();
    s.write_all(request.as_bytes()).unwrap();
    let mut r = BufReader::new(s);
    let mut head = String::new();
    loop {
        let mut line = String::new();
        r.read_line(&mut line).unwrap();
        if line.trim_end().is_empty() {
            break;
        }
        head.push_str(&line.to_ascii_lowercase());
    }
    head
}

/// vLLM's request fields and answers beyond OpenAI's: `add_special_tokens`, the model's
/// generation_config.json as default sampling (`--generation-config`), the token itself among
/// completions' `top_logprobs`, `stop_reason`, `include_stop_str_in_output` with stop tokens,
/// `return_tokens_as_token_ids`, random ids, CORS, `/version` and `/ping`, and refusals of
/// what is not supported or not here (streamed `prompt_logprobs`, a request's `chat_template`,
/// `stream_options` without a stream).
#[test]
fn serve_takes_vllms_extra_fields() {
    let server = start(&["--threads", "1"]);
    let a = &server.addr;
    assert!(
        server
            .log
            .lock()
            .unwrap()
            .iter()
            .any(|l| l.contains("default sampling from")
                && l.contains("temperature 0.6, top_p 0.95")),
        "{:?}",
        server.log
    );
    // add_special_tokens: a completion's BOS only when true (the default); a chat's BOS (its
    // template writes one) again only when asked.
    let tokens = |body: Value| {
        let (status, v) = post(a, "/v1/completions", &body);
        assert_eq!(status, 200, "{v}");
        v["choices"][0]["logprobs"]["tokens"].clone()
    };
    let base = json!({"prompt": "Hi", "max_tokens": 0, "echo": true, "logprobs": 0});
    let with = tokens(base.clone());
    let mut off = base.clone();
    off["add_special_tokens"] = false.into();
    let without = tokens(off);
    assert_eq!(with.as_array().unwrap().len(), 3, "{with}");
    assert_eq!(without, json!(["H", "i"]));
    let mut bad = base.clone();
    bad["add_special_tokens"] = "no".into();
    let (status, v) = post(a, "/v1/completions", &bad);
    assert_eq!(
        (status, v["error"]["param"].as_str()),
        (400, Some("add_special_tokens"))
    );
    // vLLM's output controls: allowed_token_ids (the answer's tokens among them),
    // bad_words (a word's last token banned where the output ends with the rest; the word
    // alone and after a space), truncate_prompt_tokens (the prompt's last k tokens).
    let greedy = |extra: Value| {
        let mut b = json!({"prompt": "The best way to", "max_tokens": 6, "temperature": 0,
                           "ignore_eos": true, "logprobs": 0});
        for (k, v) in extra.as_object().unwrap() {
            b[k] = v.clone();
        }
        let (status, v) = post(a, "/v1/completions", &b);
        assert_eq!(status, 200, "{v}");
        v["choices"][0].clone()
    };
    let plain = greedy(json!({}));
    let plain_text = plain["text"].as_str().unwrap().to_string();
    let words: Vec<&str> = plain_text.split_whitespace().collect();
    let allowed = greedy(json!({"allowed_token_ids": [444, 456]}));
    let (_, ids) = post(
        a,
        "/tokenize",
        &json!({"prompt": allowed["text"], "add_special_tokens": false}),
    );
    assert!(
        ids["tokens"]
            .as_array()
            .unwrap()
            .iter()
            .all(|t| t == 444 || t == 456),
        "{allowed}"
    );
    let banned = words[1];
    let without = greedy(json!({"bad_words": [banned]}));
    let text = without["text"].as_str().unwrap();
    assert!(
        !text.split_whitespace().any(|w| w == banned),
        "{banned:?} in {text:?}"
    );
    assert!(
        text.starts_with(&format!(" {}", words[0])),
        "{text:?} vs {plain_text:?}"
    );
    let truncated = greedy(json!({"truncate_prompt_tokens": 2, "echo": true, "max_tokens": 1}));
    assert_eq!(
        truncated["logprobs"]["tokens"].as_array().unwrap().len(),
        3,
        "{truncated}"
    );
    // Masks that leave nothing (with min_tokens' or JSON mode's) end the answer there, no
    // token outside them written.
    for extra in [
        json!({"allowed_token_ids": [1], "min_tokens": 3, "ignore_eos": false}),
        json!({"allowed_token_ids": [444], "response_format": {"type": "json_object"}}),
    ] {
        let c = greedy(extra.clone());
        assert_eq!(
            (&c["text"], &c["finish_reason"]),
            (&json!(""), &json!("length")),
            "{extra}: {c}"
        );
        assert_eq!(c["logprobs"]["tokens"], json!([]), "{extra}: {c}");
    }
    // Under ignore_eos an EOS the request lists as a stop token is its stop_reason.
    let eos = greedy(json!({"stop_token_ids": [1], "logit_bias": {"1": 100}}));
    assert_eq!(
        (&eos["finish_reason"], &eos["stop_reason"]),
        (&json!("stop"), &json!(1)),
        "{eos}"
    );
    // A positive value below f32's range is taken, not read as 0.
    let tiny = greedy(json!({"repetition_penalty": 1e-300, "top_p": 1e-320, "temperature": 1}));
    assert!(tiny["text"].is_string(), "{tiny}");
    for (body, param) in [
        (
            json!({"prompt": "x", "use_beam_search": true}),
            "use_beam_search",
        ),
        (json!({"prompt": "x", "best_of": 1, "n": 2}), "best_of"),
        (
            json!({"prompt": "x", "allowed_token_ids": []}),
            "allowed_token_ids",
        ),
        (
            json!({"prompt": "x", "allowed_token_ids": [1 << 30]}),
            "allowed_token_ids",
        ),
        // (Ids are bounded by the model's vocabulary of 4096.)
        (json!({"prompt": [4096]}), "prompt"),
        (json!({"prompt": [1.5, 2]}), "prompt"),
        (
            json!({"prompt": "x", "allowed_token_ids": [4096]}),
            "allowed_token_ids",
        ),
        (json!({"prompt": "x", "bad_words": [" "]}), "bad_words"),
        (
            json!({"prompt": "x", "truncate_prompt_tokens": 0}),
            "truncate_prompt_tokens",
        ),
    ] {
        let (status, v) = post(a, "/v1/completions", &body);
        assert_eq!(
            (status, v["error"]["param"].as_str()),
            (400, Some(param)),
            "{body}: {v}"
        );
    }
    // Token ids written as whole floats are ids (vLLM's lax reading), alone or in a list.
    for prompt in [json!([400.0, 401]), json!([[400.0, 401], "x"])] {
        let (status, v) = post(
            a,
            "/v1/completions",
            &json!({"prompt": prompt, "max_tokens": 1, "temperature": 0}),
        );
        assert_eq!(status, 200, "{prompt}: {v}");
    }
    let chat = json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1,
                      "temperature": 0});
    let prompt_tokens = |body: &Value| {
        let (status, v) = post(a, "/v1/chat/completions", body);
        assert_eq!(status, 200, "{v}");
        v["usage"]["prompt_tokens"].as_u64().unwrap()
    };
    let mut doubled = chat.clone();
    doubled["add_special_tokens"] = true.into();
    assert_eq!(prompt_tokens(&doubled), prompt_tokens(&chat) + 1);

    // The generation config's temperature 0.6 and top_p 0.95 are the defaults.
    let text = |addr: &str, extra: Value| {
        let mut body = json!({"prompt": "The best way to", "max_tokens": 12, "seed": 5});
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        let (status, v) = post(addr, "/v1/completions", &body);
        assert_eq!(status, 200, "{v}");
        v["choices"][0]["text"].as_str().unwrap().to_string()
    };
    let recommended = text(a, json!({"temperature": 0.6, "top_p": 0.95}));
    // (Each field the request gives wins on its own: top_p stays 0.95 here unless given.)
    let plain = text(a, json!({"temperature": 1.0, "top_p": 1.0}));
    assert_ne!(text(a, json!({"temperature": 1.0})), plain);
    assert_ne!(recommended, plain);
    assert_eq!(text(a, json!({})), recommended);
    let vllm = start(&["--threads", "1", "--generation-config", "vllm"]);
    assert_eq!(text(&vllm.addr, json!({})), plain);
    drop(vllm);

    // top_logprobs of a completion hold the sampled token, then the N most likely.
    let (_, v) = post(
        a,
        "/v1/completions",
        &json!({"prompt": "The best way to", "max_tokens": 6, "temperature": 1.5, "seed": 7,
                "logprobs": 1}),
    );
    let lp = &v["choices"][0]["logprobs"];
    for (i, token) in lp["tokens"].as_array().unwrap().iter().enumerate() {
        let top = lp["top_logprobs"][i].as_object().unwrap();
        let first = top.keys().next().unwrap();
        assert_eq!(first.as_str(), token.as_str().unwrap(), "{lp}");
        assert!((1..=2).contains(&top.len()), "{lp}");
        assert_eq!(top[first], lp["token_logprobs"][i], "{lp}");
    }
    let (_, v) = post(
        a,
        "/v1/completions",
        &json!({"prompt": "The best way to", "max_tokens": 3, "temperature": 0,
                "logprobs": 0, "return_tokens_as_token_ids": true}),
    );
    let lp = &v["choices"][0]["logprobs"];
    let t0 = lp["tokens"][0].as_str().unwrap();
    assert!(t0.starts_with("token_id:"), "{lp}");
    assert_eq!(
        lp["top_logprobs"][0]
            .as_object()
            .unwrap()
            .keys()
            .collect::<Vec<_>>(),
        [t0]
    );

    // stop_reason; include_stop_str_in_output keeps a stop token's text.
    let greedy = json!({"prompt": "The best way to", "temperature": 0, "max_tokens": 8});
    let (_, v) = post(a, "/v1/completions", &greedy);
    let whole = v["choices"][0]["text"].as_str().unwrap().to_string();
    let tok =
        cachalot_model::tokenizer::Tokenizer::from_dir(&root().join("assets/cachalot-tiny-r1"))
            .unwrap();
    let ids = tok.encode(&whole).unwrap();
    let second = ids[1];
    let first_text = tok.decode(&ids[..1]).unwrap();
    let two_text = tok.decode(&ids[..2]).unwrap();
    for (include, expect) in [(false, &first_text), (true, &two_text)] {
        for stream in [false, true] {
            let mut body = greedy.clone();
            body["stop_token_ids"] = json!([second]);
            body["include_stop_str_in_output"] = include.into();
            let (got, reason) = if stream {
                body["stream"] = true.into();
                let evs = events(a, "/v1/completions", &body);
                let chunks: Vec<Value> = evs[..evs.len() - 1]
                    .iter()
                    .map(|e| serde_json::from_str(e).unwrap())
                    .collect();
                let text: String = chunks
                    .iter()
                    .map(|c| c["choices"][0]["text"].as_str().unwrap())
                    .collect();
                (
                    text,
                    chunks.last().unwrap()["choices"][0]["stop_reason"].clone(),
                )
            } else {
                let (_, v) = post(a, "/v1/completions", &body);
                (
                    v["choices"][0]["text"].as_str().unwrap().to_string(),
                    v["choices"][0]["stop_reason"].clone(),
                )
            };
            assert_eq!(&got, expect, "include {include}, stream {stream}");
            assert_eq!(reason, json!(second));
        }
    }
    let mut body = greedy.clone();
    body["stop"] = json!([two_text[first_text.len()..].to_string()]);
    let (_, v) = post(a, "/v1/completions", &body);
    assert_eq!(v["choices"][0]["stop_reason"], body["stop"][0], "{v}");
    let (_, v) = post(a, "/v1/completions", &greedy);
    assert_eq!(v["choices"][0]["stop_reason"], Value::Null, "{v}");

    // Ids are random.
    let id = |v: &Value| v["id"].as_str().unwrap().to_string();
    let (_, v1) = post(a, "/v1/completions", &greedy);
    let (_, v2) = post(a, "/v1/chat/completions", &chat);
    let (i1, i2) = (id(&v1), id(&v2));
    assert!(
        i1.starts_with("cmpl-") && i2.starts_with("chatcmpl-"),
        "{i1} {i2}"
    );
    let hex = |s: &str| s.len() == 32 && s.chars().all(|c| c.is_ascii_hexdigit());
    assert!(hex(&i1[5..]) && hex(&i2[9..]), "{i1} {i2}");

    // Refused by name.
    for (body, param) in [
        (
            json!({"prompt": "x", "prompt_logprobs": 1, "stream": true}),
            "prompt_logprobs",
        ),
        (
            json!({"prompt": "x", "prompt_logprobs": 21}),
            "prompt_logprobs",
        ),
        (
            json!({"prompt": "x", "stream_options": {"include_usage": true}}),
            "stream_options",
        ),
        (
            json!({"prompt": "x", "stream": true, "stream_options": {"include_usage": "yes"}}),
            "stream_options",
        ),
    ] {
        let (status, v) = post(a, "/v1/completions", &body);
        assert_eq!(
            (status, v["error"]["param"].as_str()),
            (400, Some(param)),
            "{v}"
        );
    }
    let mut own = chat.clone();
    own["chat_template"] = "{{ messages }}".into();
    let (status, v) = post(a, "/v1/chat/completions", &own);
    assert_eq!(
        (status, v["error"]["param"].as_str()),
        (400, Some("chat_template")),
        "{v}"
    );
    let (status, _) = post(a, "/detokenize", &json!({"tokens": [5], "model": "x"}));
    assert_eq!(status, 404);

    // /version, /ping, CORS.
    let (status, body) = http(a, "GET", "/version", "");
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("version"), "{body}");
    assert_eq!(http(a, "GET", "/ping", "").0, 200);
    let pre = head_of(
        a,
        &format!(
            "OPTIONS /v1/chat/completions HTTP/1.1\r\nHost: {a}\r\nOrigin: http://x\r\n\
             Access-Control-Request-Method: POST\r\nAccess-Control-Request-Headers: \
             content-type\r\nConnection: close\r\n\r\n"
        ),
    );
    assert!(pre.starts_with("http/1.1 200"), "{pre}");
    assert!(pre.contains("access-control-allow-origin: *"), "{pre}");
    assert!(
        pre.contains("access-control-allow-headers: content-type"),
        "{pre}"
    );
    let get = head_of(
        a,
        &format!(
            "GET /v1/models HTTP/1.1\r\nHost: {a}\r\nOrigin: http://x\r\nConnection: close\r\n\r\n"
        ),
    );
    assert!(get.contains("access-control-allow-origin: *"), "{get}");
}

/// DeepSeek-V4 in thinking mode: a final message with only reasoning, continued, goes on in
/// `reasoning_content` (the prompt ends inside the open block), streamed and whole.
#[test]
fn a_continued_reasoning_stays_reasoning() {
    let v4 = root().join("fixtures/v4/flash_tiny").display().to_string();
    let server = start(&["--model", &v4, "--threads", "1"]);
    let body = json!({"messages": [{"role": "user", "content": "Hi"},
                                   {"role": "assistant", "content": "",
                                    "reasoning_content": "Let me th"}],
                      "continue_final_message": true, "add_generation_prompt": false,
                      "chat_template_kwargs": {"thinking": true}, "max_tokens": 6,
                      "temperature": 0});
    let (status, v) = post(&server.addr, "/v1/chat/completions", &body);
    assert_eq!(status, 200, "{v}");
    let m = &v["choices"][0]["message"];
    let reasoning = m["reasoning_content"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert!(!reasoning.is_empty() && m["content"].is_null(), "{v}");
    let mut streamed = body.clone();
    streamed["stream"] = true.into();
    let evs = events(&server.addr, "/v1/chat/completions", &streamed);
    let mut got = String::new();
    for e in &evs[..evs.len() - 1] {
        let c: Value = serde_json::from_str(e).unwrap();
        let d = &c["choices"][0]["delta"];
        assert!(d["content"].as_str().is_none_or(str::is_empty), "{e}");
        got.push_str(d["reasoning_content"].as_str().unwrap_or(""));
    }
    assert_eq!(got, reasoning);
}

/// A stand-in for a server behind the router: answers `/health` with `health` and each POST
/// as `answer` says for its body (`None`: not a word), holding each connection open.
fn stand_in(
    health: impl Fn() -> Value + Send + Sync + 'static,
    answer: impl Fn(&Value) -> Option<Vec<u8>> + Send + Sync + 'static,
) -> String {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let (health, answer) = (std::sync::Arc::new(health), std::sync::Arc::new(answer));
    std::thread::spawn(move || {
        for conn in listener.incoming().map_while(Result::ok) {
            let (health, answer) = (health.clone(), answer.clone());
            std::thread::spawn(move || {
                let mut r = BufReader::new(conn.try_clone().unwrap());
                let mut line = String::new();
                if r.read_line(&mut line).is_err() {
                    return;
                }
                let mut length = 0;
                loop {
                    let mut h = String::new();
                    if r.read_line(&mut h).unwrap_or(0) == 0 || h.trim().is_empty() {
                        break;
                    }
                    if let Some(v) = h.to_ascii_lowercase().strip_prefix("content-length:") {
                        length = v.trim().parse().unwrap();
                    }
                }
                let mut body = vec![0u8; length];
                r.read_exact(&mut body).unwrap();
                let mut conn = conn;
                let reply = if line.starts_with("GET /health") {
                    let h = health().to_string();
                    Some(
                        format!(
                            "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n\
                             Content-Length: {}\r\n\r\n{h}",
                            h.len()
                        )
                        .into_bytes(),
                    )
                } else {
                    answer(&serde_json::from_slice(&body).unwrap())
                };
                // The connection is held open after the answer too (an answer that began
                // and stalls).
                if let Some(bytes) = reply {
                    let _ = conn.write_all(&bytes);
                }
                std::thread::sleep(std::time::Duration::from_secs(120));
            });
        }
    });
    addr
}

/// The router's own limits and errors, against stand-in servers: its 400s name their field as
/// the servers' do; `--timeout-s` bounds a whole request (504 before the answer begins, an
/// error event after), said in words; a decode server that refuses a request (or does not
/// answer in time) has the room's KV dropped on the prefill server's KV port at once; when
/// the router's drain grace ends, a request still waiting is answered 503.
#[test]
fn the_router_bounds_requests_and_frees_kv_nobody_takes() {
    use std::net::TcpListener;
    use std::sync::atomic::{AtomicU16, Ordering};
    // The prefill server's KV port (two: it is restarted with another): greets, and reports
    // each request it gets.
    let (got, drops) = std::sync::mpsc::channel::<(Vec<u8>, u64, u16)>();
    let kv_port = || {
        let kv = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = kv.local_addr().unwrap().port();
        let got = got.clone();
        std::thread::spawn(move || {
            for mut c in kv.incoming().map_while(Result::ok) {
                let _ = c.write_all(b"CKV-PORT");
                let mut ask = [0u8; 16];
                if c.read_exact(&mut ask).is_ok() {
                    let _ = c.write_all(&[0]);
                    let room = u64::from_le_bytes(ask[8..].try_into().unwrap());
                    let _ = got.send((ask[..8].to_vec(), room, port));
                }
            }
        });
        port
    };
    let (first_kv, second_kv) = (kv_port(), kv_port());
    let current_kv = std::sync::Arc::new(AtomicU16::new(first_kv));
    let now_kv = current_kv.clone();
    let pre = stand_in(
        move || {
            json!({"disaggregation_mode": "prefill",
                   "kv_port": now_kv.load(Ordering::Relaxed)})
        },
        |_| {
            let b = r#"{"choices":[]}"#;
            Some(
                format!(
                    "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n\
                     Content-Length: {}\r\n\r\n{b}",
                    b.len()
                )
                .into_bytes(),
            )
        },
    );
    // (Set: the decode server says it is a plain one.)
    let plain = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let is_plain = plain.clone();
    let dec = stand_in(
        move || {
            let role = if is_plain.load(Ordering::Relaxed) {
                "null"
            } else {
                "decode"
            };
            json!({"disaggregation_mode": role})
        },
        |body| {
            // A 400 with this error object.
            let bad = |e: Value| {
                let b = json!({ "error": e }).to_string();
                Some(
                    format!(
                        "HTTP/1.1 400 Bad Request\r\nContent-Type: application/json\r\n\
                         Content-Length: {}\r\n\r\n{b}",
                        b.len()
                    )
                    .into_bytes(),
                )
            };
            match body["prompt"].as_str().unwrap() {
                // A plain server's refusal of the fields the router adds.
                "plain" => bad(json!({"message": "whole", "type": "invalid_request_error",
                                      "param": "bootstrap_room"})),
                "refuse" => bad(json!({"message": "no", "type": "invalid_request_error"})),
                // An answer that begins and then stalls.
                "begin" => Some(
                    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\
                  Transfer-Encoding: chunked\r\n\r\n10\r\ndata: {\"x\": 1}\n\n\r\n"
                        .to_vec(),
                ),
                _ => None,
            }
        },
    );
    let mut router = start_command(
        "router",
        &[
            "--prefill",
            &pre,
            "--decode",
            &dec,
            "--timeout-s",
            "3",
            "--drain-timeout-s",
            "1",
        ],
    );
    let r = router.addr.clone();
    let (status, text) = http(&r, "POST", "/v1/completions", "{not json");
    let v: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(
        (status, &v["error"]["type"]),
        (400, &json!("invalid_request_error"))
    );
    let (status, v) = post(
        &r,
        "/v1/completions",
        &json!({"prompt": "x", "bootstrap_room": "seven"}),
    );
    assert_eq!(status, 400, "{v}");
    assert_eq!(v["error"]["param"], "bootstrap_room", "{v}");
    assert_eq!(v["error"]["type"], "invalid_request_error", "{v}");
    assert_eq!(http(&r, "POST", "/health", "").0, 405);
    assert_eq!(http(&r, "GET", "/v1/completions", "").0, 405);
    let next_drop = || {
        let (verb, room, port) = drops
            .recv_timeout(std::time::Duration::from_secs(10))
            .unwrap();
        assert_eq!(port, current_kv.load(Ordering::Relaxed));
        (verb, room)
    };

    // Refused by the decode server: its answer, and the room's KV dropped.
    let (status, v) = post(
        &r,
        "/v1/completions",
        &json!({"prompt": "refuse", "bootstrap_room": 41}),
    );
    assert_eq!((status, v["error"]["message"].as_str()), (400, Some("no")));
    assert_eq!(next_drop(), (b"CKV-DROP".to_vec(), 41));
    // Refused over the fields the router adds (a decode server restarted without its role):
    // a 502 naming the server, not a 400 over fields the client never sent; KV dropped.
    let (status, v) = post(
        &r,
        "/v1/completions",
        &json!({"prompt": "plain", "bootstrap_room": 45}),
    );
    let m = v["error"]["message"].as_str().unwrap();
    assert_eq!(status, 502, "{v}");
    assert!(
        m.contains(&format!(
            "decode server {dec} refused the router's bootstrap_room"
        )),
        "{m}"
    );
    assert_eq!(next_drop(), (b"CKV-DROP".to_vec(), 45));
    // Such a server is down in the router's /health.
    plain.store(true, Ordering::Relaxed);
    let (status, h) = http(&r, "GET", "/health", "");
    let h: Value = serde_json::from_str(&h).unwrap();
    assert_eq!(
        (status, &h["decode"][0]["healthy"]),
        (503, &json!(false)),
        "{h}"
    );
    plain.store(false, Ordering::Relaxed);

    // No answer within --timeout-s: 504, said in words, and the room's KV dropped.
    let t = std::time::Instant::now();
    let (status, v) = post(
        &r,
        "/v1/completions",
        &json!({"prompt": "stall", "bootstrap_room": 42}),
    );
    assert_eq!(status, 504, "{v}");
    let m = v["error"]["message"].as_str().unwrap();
    assert!(m.contains("--timeout-s (3 s)"), "{m}");
    assert!(
        (2.5..9.0).contains(&t.elapsed().as_secs_f64()),
        "{:?}",
        t.elapsed()
    );
    assert_eq!(next_drop(), (b"CKV-DROP".to_vec(), 42));

    // A room in flight is not given to a second request (which would take the first one's
    // KV): refused by name.
    let r2 = r.clone();
    let first = std::thread::spawn(move || {
        post(
            &r2,
            "/v1/completions",
            &json!({"prompt": "stall", "bootstrap_room": 50}),
        )
    });
    std::thread::sleep(std::time::Duration::from_millis(300));
    let (status, v) = post(
        &r,
        "/v1/completions",
        &json!({"prompt": "refuse", "bootstrap_room": 50}),
    );
    assert_eq!(
        (status, &v["error"]["param"]),
        (400, &json!("bootstrap_room")),
        "{v}"
    );
    assert_eq!(first.join().unwrap().0, 504);
    assert_eq!(next_drop(), (b"CKV-DROP".to_vec(), 50));

    // The prefill server comes back with another KV port: the router follows it.
    current_kv.store(second_kv, Ordering::Relaxed);
    let t = std::time::Instant::now();
    loop {
        let (_, h) = http(&r, "GET", "/health", "");
        let h: Value = serde_json::from_str(&h).unwrap();
        if h["prefill"][0]["kv_port"] == second_kv {
            break;
        }
        assert!(t.elapsed().as_secs() < 10, "{h}");
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    let (status, _) = post(
        &r,
        "/v1/completions",
        &json!({"prompt": "refuse", "bootstrap_room": 51}),
    );
    assert_eq!(status, 400);
    assert_eq!(next_drop(), (b"CKV-DROP".to_vec(), 51));

    // An answer that began: it ends with an error event.
    let (status, text) = http(
        &r,
        "POST",
        "/v1/completions",
        &json!({"prompt": "begin", "stream": true, "bootstrap_room": 43}).to_string(),
    );
    assert_eq!(status, 200, "{text}");
    // The error event, then `[DONE]` (as vLLM ends a failed stream).
    let mut ev = text.trim_end().rsplit("data: ");
    assert_eq!(ev.next(), Some("[DONE]"), "{text}");
    let last: Value = serde_json::from_str(ev.next().unwrap().trim_end()).unwrap();
    assert_eq!(last["error"]["code"], 504, "{text}: {last}");
    assert!(text.starts_with("data: {\"x\": 1}"), "{text}");
    assert_eq!(next_drop(), (b"CKV-DROP".to_vec(), 43));

    // SIGTERM with a request waiting: when the grace (1 s) ends it is answered 503.
    let waiting = std::thread::spawn(move || {
        let mut body = json!({"prompt": "stall", "bootstrap_room": 44});
        body["max_tokens"] = 1.into();
        post(&r, "/v1/completions", &body)
    });
    std::thread::sleep(std::time::Duration::from_millis(300));
    sigterm(&router);
    std::thread::sleep(std::time::Duration::from_millis(100));
    let (status, h) = http(&router.addr, "GET", "/health", "");
    assert_eq!((status, h.as_str()), (503, r#"{"status":"draining"}"#));
    let (status, v) = waiting.join().unwrap();
    assert_eq!(status, 503, "{v}");
    let m = v["error"]["message"].as_str().unwrap();
    assert!(m.contains("--drain-timeout-s"), "{m}");
    assert_eq!(exit_within(&mut router, 10), Some(143));
}
