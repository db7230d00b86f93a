//! Text commands: `tokenize`, `generate` (streamed, sampled, optionally as a chat turn) and the
//! interactive `chat`.

use std::io::{BufRead, IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use cachalot_engine::Model;
use cachalot_engine::{
    FinishReason, Generation, ReasoningSplitter, SamplingParams, Segment, StopConditions,
};
use cachalot_model::tokenizer::{ChatTemplate, Message, ParsedAnswer, Tokenizer, ToolCallFormat};
use cachalot_model::{detect_family, DeepseekV3, ModelFamily};

use crate::{load_model, load_v4, model_dir, tokens, InputArgs, ModelArgs};

#[derive(clap::Args)]
#[command(group(clap::ArgGroup::new("input").required(true).args(["text", "file", "decode"])))]
pub struct TokenizeArgs {
    /// Model directory (only its tokenizer.json or tiktoken.model and tokenizer_config.json are read).
    #[arg(long)]
    model: Option<PathBuf>,
    /// Text to encode (special-token strings in it become their ids; no BOS is added).
    #[arg(long, allow_hyphen_values = true)]
    text: Option<String>,
    /// Text to encode from a file (`-`: stdin), for text too long for an argument.
    #[arg(long)]
    file: Option<PathBuf>,
    /// Comma-separated token ids to decode (an empty list decodes to empty text).
    #[arg(long, value_parser = parse_id_list)]
    decode: Option<IdList>,
    /// `{"ids": [...]}` (or `{"text": ...}` with --decode).
    #[arg(long)]
    json: bool,
}

/// `--temperature`: a number from 0 to 100 (the server's range; 0 is greedy).
fn temperature_arg(s: &str) -> Result<f32, String> {
    let t: f32 = s.parse().map_err(|_| format!("`{s}` is not a number"))?;
    if (0.0..=100.0).contains(&t) {
        Ok(t)
    } else {
        Err(format!("{t} is outside 0 to 100 (0 is greedy)"))
    }
}

/// `--presence-penalty`, `--frequency-penalty`: a number from -2 to 2 (the server's range,
/// OpenAI's and vLLM's).
fn penalty_arg(s: &str) -> Result<f32, String> {
    let p: f32 = s.parse().map_err(|_| format!("`{s}` is not a number"))?;
    if (-2.0..=2.0).contains(&p) {
        Ok(p)
    } else {
        Err(format!("{p} is outside -2 to 2 (0 is off)"))
    }
}

/// `--top-k`: K, or 0 or a negative number for off (vLLM's -1, llama.cpp's `<= 0`).
fn top_k_arg(s: &str) -> Result<usize, String> {
    let k: i64 = s
        .parse()
        .map_err(|_| format!("`{s}` is not a whole number (0 or -1: off)"))?;
    Ok(usize::try_from(k).unwrap_or(0))
}

#[derive(clap::Args)]
pub struct SamplingArgs {
    /// Tokens to generate at most (at least 1) [default: 256, or what the model's context
    /// leaves after the prompt when that is less].
    #[arg(long, visible_alias = "max-tokens",
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    max_new_tokens: Option<usize>,
    /// 0 (the default) is greedy; DeepSeek recommends 0.6 for R1. At most 100 (as the
    /// server's). Applied before --top-k, --top-p and --min-p, as vLLM and transformers do
    /// (llama.cpp's default chain applies it after them).
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true,
          value_parser = temperature_arg)]
    temperature: f32,
    /// Nucleus sampling mass (1 = off).
    #[arg(long, default_value_t = 1.0, allow_negative_numbers = true)]
    top_p: f32,
    /// Keep the K most probable tokens (0 or -1 = off).
    #[arg(long, default_value_t = 0, allow_negative_numbers = true, value_parser = top_k_arg)]
    top_k: usize,
    /// Keep tokens with probability >= min_p × the top one (0 = off).
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    min_p: f32,
    /// CTRL repetition penalty over prompt and output tokens (1 = off).
    #[arg(long, default_value_t = 1.0, allow_negative_numbers = true)]
    repetition_penalty: f32,
    /// Subtracted from the logit of every token already generated (0 = off; -2 to 2, as the
    /// server's).
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true,
          value_parser = penalty_arg)]
    presence_penalty: f32,
    /// Subtracted once per earlier occurrence in the output (0 = off; -2 to 2, as the
    /// server's).
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true,
          value_parser = penalty_arg)]
    frequency_penalty: f32,
    /// Seed of the sampler (same seed, same output).
    #[arg(long)]
    seed: Option<u64>,
    /// Extra stop string (repeatable, not empty); the text ends before it.
    #[arg(long, allow_hyphen_values = true,
          value_parser = clap::builder::NonEmptyStringValueParser::new())]
    stop: Vec<String>,
    /// Keep going past EOS (for benchmarks).
    #[arg(long)]
    ignore_eos: bool,
    /// MTP speculative decoding with N (1-3) drafts per step (the model's MTP layer; same
    /// tokens under greedy, same distribution under sampling).
    #[arg(long, value_name = "N", default_value_t = 0)]
    mtp: usize,
}

impl SamplingArgs {
    /// The model of `args`, with its MTP layer when `--mtp` asks for it.
    fn load(&self, args: &ModelArgs) -> Result<DeepseekV3> {
        if self.mtp > 3 {
            bail!("--mtp {}: give 1 to 3 draft tokens (0: off)", self.mtp);
        }
        load_model(args, self.mtp > 0)
    }

    /// One answer: plain decoding, or MTP speculative decoding with `--mtp`.
    fn generate<M: Model>(
        &self,
        m: &M,
        tok: Option<&Tokenizer>,
        prompt: &[u32],
        stop: &StopConditions,
        cancel: Option<&AtomicBool>,
        on_text: &mut dyn FnMut(&str),
    ) -> Result<Generation, cachalot_engine::EngineError> {
        if self.mtp > 0 {
            cachalot_engine::generate_mtp(
                m,
                tok,
                prompt,
                self.params(),
                stop,
                self.mtp,
                cancel,
                on_text,
            )
        } else {
            cachalot_engine::generate(m, tok, prompt, self.params(), stop, cancel, on_text)
        }
    }

    fn params(&self) -> SamplingParams {
        SamplingParams {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            repetition_penalty: self.repetition_penalty,
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
            seed: self.seed,
            logit_bias: Vec::new(),
            min_tokens: 0,
            min_p_first: false,
            ..Default::default()
        }
    }
}

#[derive(clap::Args)]
pub struct GenerateArgs {
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    input: InputArgs,
    #[command(flatten)]
    sampling: SamplingArgs,
    /// Render the prompt as a user turn with the model's chat template.
    #[arg(long)]
    chat: bool,
    /// System prompt (with --chat).
    #[arg(long, requires = "chat", allow_hyphen_values = true)]
    system: Option<String>,
    /// Chat template to use instead of the model's (with --chat): a tokenizer_config.json or a
    /// Jinja file.
    #[arg(long, requires = "chat")]
    chat_template: Option<PathBuf>,
    /// Extra chat-template variables, a JSON object: '{"enable_thinking": false}' (Kimi-K2-Thinking
    /// and other Jinja templates that read it), '{"thinking": true}' (DeepSeek-V4's thinking mode).
    #[arg(long, value_name = "JSON", requires = "chat")]
    chat_template_kwargs: Option<String>,
    /// Tools the model may call (with --chat): a JSON file holding a list of OpenAI tool
    /// definitions (`[{"type": "function", "function": {"name": ..., "parameters": ...}}]`),
    /// rendered by the chat template. The calls the model writes are listed after the answer
    /// (and in --json as `tool_calls`).
    #[arg(long, value_name = "FILE", requires = "chat")]
    tools: Option<PathBuf>,
    /// Do not print the reasoning (`<think>…</think>`), only the answer.
    #[arg(long)]
    hide_reasoning: bool,
    /// Print one JSON object at the end instead of streaming text.
    #[arg(long)]
    json: bool,
    /// Threads (default: all cores).
    #[arg(long)]
    pub threads: Option<usize>,
}

#[derive(clap::Args)]
pub struct ChatArgs {
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    sampling: SamplingArgs,
    /// System prompt of the conversation (change it with /system TEXT).
    #[arg(long, allow_hyphen_values = true)]
    system: Option<String>,
    /// Chat template to use instead of the model's: a tokenizer_config.json or a Jinja file.
    #[arg(long)]
    chat_template: Option<PathBuf>,
    /// Extra chat-template variables, a JSON object: '{"enable_thinking": false}' (Kimi-K2-Thinking
    /// and other Jinja templates that read it), '{"thinking": true}' (DeepSeek-V4's thinking mode).
    #[arg(long, value_name = "JSON")]
    chat_template_kwargs: Option<String>,
    /// Tools the model may call: a JSON file holding a list of OpenAI tool definitions
    /// (`[{"type": "function", "function": {"name": ..., "parameters": ...}}]`). When the model
    /// calls them, answer each call with /tool RESULT.
    #[arg(long, value_name = "FILE")]
    tools: Option<PathBuf>,
    /// Do not print the reasoning (`<think>…</think>`), only the answer.
    #[arg(long)]
    hide_reasoning: bool,
    /// One JSON object per turn ({"prompt", "text", "output_ids", "finish_reason", "content",
    /// and "tool_calls" or "tool_call_error" when the model called tools}) instead of text.
    #[arg(long)]
    json: bool,
    /// Threads (default: all cores).
    #[arg(long)]
    pub threads: Option<usize>,
}

/// `--decode`'s ids.
#[derive(Clone, Debug)]
pub struct IdList(Vec<u32>);

fn parse_id_list(s: &str) -> std::result::Result<IdList, String> {
    if s.trim().is_empty() {
        return Ok(IdList(Vec::new()));
    }
    s.split(',')
        .map(|t| {
            t.trim()
                .parse::<u32>()
                .map_err(|e| format!("{t:?} is not a token id ({e}); give ids as 1,2,3"))
        })
        .collect::<std::result::Result<Vec<u32>, String>>()
        .map(IdList)
}

pub fn tokenize(args: &TokenizeArgs) -> Result<()> {
    let dir = match &args.model {
        Some(d) => d.clone(),
        None => model_dir(&ModelArgs::none())?,
    };
    let tok = Tokenizer::from_dir(&dir)?;
    if let Some(IdList(ids)) = &args.decode {
        // Ids need not be contiguous (added tokens can sit far above the base vocabulary).
        if let Some(&bad) = ids.iter().find(|&&t| tok.id_to_token(t).is_none()) {
            bail!(
                "--decode: id {bad} is not a token of this tokenizer (it has {} tokens; ids \
                 above its base vocabulary can be added tokens, with gaps between)",
                tok.vocab_size()
            );
        }
        let text = tok.decode(ids)?;
        if args.json {
            println!("{}", serde_json::json!({ "text": text }));
        } else {
            println!("{text}");
        }
    } else {
        let text = match &args.file {
            Some(f) => crate::read_text_file(f)?,
            None => args.text.clone().unwrap_or_default(),
        };
        let ids = tok.encode(&text)?;
        if args.json {
            println!("{}", serde_json::json!({ "ids": ids }));
        } else {
            let s: Vec<String> = ids.iter().map(u32::to_string).collect();
            println!("{}", s.join(","));
        }
    }
    Ok(())
}

impl ModelArgs {
    fn none() -> ModelArgs {
        ModelArgs {
            model: None,
            fp8: crate::Fp8Arg::Native,
            attention: crate::AttnArg::Auto,
            int8_head: false,
            bf16_dot: false,
            kv_cache_dtype: crate::KvDtypeArg::Auto,
            v4_cache: Default::default(),
            check_tensors: false,
            max_layers: None,
            expert_shard: Default::default(),
            tensor_shard: Default::default(),
        }
    }
}

fn chat_template(tok: &Tokenizer, dir: &Path, file: Option<&Path>) -> Result<ChatTemplate> {
    if let Some(f) = file {
        return Ok(tok.chat_template_from_file(f)?);
    }
    tok.chat_template()?.with_context(|| {
        format!(
            "{}: no chat template (chat_template.jinja, or chat_template in tokenizer_config.json); pass --chat-template FILE",
            dir.display()
        )
    })
}

/// `--chat-template-kwargs`: a JSON object of extra template variables (empty without it).
fn template_kwargs(arg: Option<&str>) -> Result<serde_json::Map<String, serde_json::Value>> {
    let Some(text) = arg else {
        return Ok(serde_json::Map::new());
    };
    match serde_json::from_str::<serde_json::Value>(text) {
        Ok(serde_json::Value::Object(map)) => Ok(map),
        Ok(other) => bail!(
            "--chat-template-kwargs {text}: expected a JSON object such as \
             '{{\"enable_thinking\": false}}', got {}",
            match other {
                serde_json::Value::Array(_) => "a list",
                serde_json::Value::String(_) => "a string",
                serde_json::Value::Number(_) => "a number",
                serde_json::Value::Bool(_) => "a boolean",
                _ => "null",
            }
        ),
        Err(e) => bail!("--chat-template-kwargs {text}: not valid JSON ({e})"),
    }
}

/// A conversation through the chat template, with the generation prompt and `kwargs`.
fn render(
    t: &ChatTemplate,
    msgs: &[serde_json::Value],
    tools: Option<&serde_json::Value>,
    kwargs: &serde_json::Map<String, serde_json::Value>,
) -> Result<String> {
    let msgs = serde_json::Value::Array(msgs.to_vec());
    Ok(t.render_json(&msgs, true, tools, kwargs)?)
}

/// `--tools` with a chat template that does not render them (the shipped model's, as R1's
/// first release) would be dropped without a word: said once.
fn warn_if_tools_unshown(
    t: &ChatTemplate,
    tools: Option<&serde_json::Value>,
    kwargs: &serde_json::Map<String, serde_json::Value>,
) {
    let Some(tools) = tools else { return };
    let msgs = [turn("user", "x")];
    if let (Ok(with), Ok(without)) = (
        render(t, &msgs, Some(tools), kwargs),
        render(t, &msgs, None, kwargs),
    ) {
        if with == without {
            eprintln!(
                "warning: --tools: this chat template does not render tools (its prompt is the \
                 same without them), so the model is not shown them; give a template that does \
                 with --chat-template"
            );
        }
    }
}

/// A plain `{"role", "content"}` turn.
fn turn(role: &str, content: impl Into<String>) -> serde_json::Value {
    serde_json::to_value(Message::new(role, content)).expect("a message serializes")
}

/// `--tools FILE`: a JSON list of OpenAI tool definitions, each `{"type": "function",
/// "function": {"name": NAME, ...}}` with a non-empty name.
fn read_tools(path: Option<&Path>) -> Result<Option<serde_json::Value>> {
    let Some(path) = path else { return Ok(None) };
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("--tools: cannot read {}", path.display()))?;
    let v: serde_json::Value = serde_json::from_str(&text)
        .with_context(|| format!("--tools {}: not valid JSON", path.display()))?;
    if let Some(problem) = tools_problem(&v) {
        bail!("--tools {}: {problem}", path.display());
    }
    Ok(Some(v))
}

/// What is wrong with a list of OpenAI tool definitions (`--tools`, a server request's
/// `tools`): each is `{"type": "function", "function": {"name": NAME, ...}}` with a non-empty
/// name. None when nothing is.
pub(crate) fn tools_problem(v: &serde_json::Value) -> Option<String> {
    let Some(list) = v.as_array() else {
        return Some(
            "expected a JSON list of tool definitions \
             ([{\"type\": \"function\", \"function\": {\"name\": ...}}])"
                .into(),
        );
    };
    for (i, t) in list.iter().enumerate() {
        let name = t
            .get("function")
            .and_then(|f| f.get("name"))
            .and_then(serde_json::Value::as_str);
        if !t.is_object() || name.is_none_or(str::is_empty) {
            return Some(format!(
                "tool {i} has no function name (each tool is \
                 {{\"type\": \"function\", \"function\": {{\"name\": ..., \"parameters\": ...}}}})"
            ));
        }
        if let Some(kind) = t.get("type").filter(|k| *k != "function") {
            return Some(format!(
                "tool {i} has type {kind}; only \"function\" tools exist"
            ));
        }
        // A name is written into the template's call markup, which whitespace or control
        // characters would break (R1's name line, Kimi-K2's `functions.NAME:INDEX`).
        let name = name.unwrap_or_default();
        if name.chars().any(|c| c.is_whitespace() || c.is_control()) {
            return Some(format!(
                "tool {i}'s function name {name:?} holds whitespace or control characters; \
                 use letters, digits, '_' and '-'"
            ));
        }
        // (So would special-token markup: DeepSeek's `<｜…｜>`, Kimi-K2's `<|…|>`.)
        if ["<|", "|>", "\u{ff5c}"].iter().any(|m| name.contains(m)) {
            return Some(format!(
                "tool {i}'s function name {name:?} holds special-token markup, which would \
                 break the call's markup; use letters, digits, '_' and '-'"
            ));
        }
        if let Some(p) = t["function"].get("parameters").filter(|p| !p.is_null()) {
            if !p.is_object() && !p.is_boolean() {
                return Some(format!(
                    "tool {i}'s parameters are {p}, not a JSON Schema (an object such as \
                     {{\"type\": \"object\", \"properties\": {{...}}}})"
                ));
            }
        }
    }
    None
}

/// The tool calls in an answer: the parsed answer, or why its tool-call section is malformed
/// (saying so when the answer ended at its token limit, `finish`). None when the model's
/// tokenizer has no tool-call format.
fn tool_calls_of(
    format: Option<ToolCallFormat>,
    answer: &str,
    finish: &FinishReason,
) -> Option<std::result::Result<ParsedAnswer, String>> {
    format.map(|f| {
        let cut = *finish == FinishReason::Length;
        f.parse_ended(answer, cut).map_err(|e| {
            let mut why = e.to_string();
            if cut {
                why.push_str(
                    " (the answer was cut off at its length limit, --max-new-tokens or the \
                     model's context: give it more room)",
                );
            }
            why
        })
    })
}

/// Adds a turn's answer fields to its JSON object `v`: `reasoning_content` where the model
/// reasoned (as serve's), `content` and `tool_calls`, or `tool_call_error`.
fn add_tool_fields(
    v: &mut serde_json::Value,
    parsed: &Option<std::result::Result<ParsedAnswer, String>>,
    (reasoning, answer): (&str, &str),
) {
    let Some(o) = v.as_object_mut() else { return };
    if !reasoning.is_empty() {
        o.insert("reasoning_content".into(), reasoning.into());
    }
    match parsed {
        Some(Ok(p)) if !p.tool_calls.is_empty() => {
            o.insert("content".into(), p.content.clone().into());
            o.insert("tool_calls".into(), serde_json::json!(p.tool_calls));
        }
        Some(Err(e)) => {
            o.insert("content".into(), answer.into());
            o.insert("tool_call_error".into(), e.clone().into());
        }
        _ => {
            o.insert("content".into(), answer.into());
        }
    }
}

/// Lists the calls on stderr after a streamed answer (or says why they could not be read).
fn report_tool_calls(parsed: &Option<std::result::Result<ParsedAnswer, String>>) {
    match parsed {
        Some(Ok(p)) => {
            for c in &p.tool_calls {
                let args = match &c.function.arguments {
                    serde_json::Value::String(s) => s.clone(),
                    other => other.to_string(),
                };
                say!(
                    "[tool call {}] {} {args}",
                    c.id.as_deref().unwrap_or("?"),
                    c.function.name
                );
            }
        }
        Some(Err(e)) => say!("[the tool calls could not be read: {e}]"),
        None => {}
    }
}

/// The prompt plus `--max-new-tokens` fit the model's positions (`max_position_embeddings`):
/// the KV cache is sized for them before the first step.
/// The most tokens to generate after `prompt` tokens: `--max-new-tokens` if given (refused
/// where it does not fit in the model's positions), else 256 within what the context leaves
/// (as llama.cpp fills its context, and vLLM's default is the rest of it).
fn check_length(prompt: usize, max_new: Option<usize>, max_positions: usize) -> Result<usize> {
    const DEFAULT_MAX_NEW: usize = 256;
    if prompt >= max_positions {
        bail!(
            "the prompt ({prompt} tokens) leaves no room in the model's max_position_embeddings \
             {max_positions} (config.json): shorten it by at least {} tokens",
            prompt + 1 - max_positions
        );
    }
    let Some(max_new) = max_new else {
        return Ok(DEFAULT_MAX_NEW.min(max_positions - prompt));
    };
    if prompt.saturating_add(max_new) > max_positions {
        bail!(
            "--max-new-tokens {max_new}: the prompt ({prompt} tokens) plus the output would \
             exceed the model's max_position_embeddings {max_positions} (config.json); give at \
             most {}",
            max_positions.saturating_sub(prompt)
        );
    }
    Ok(max_new)
}

/// Stop ids: the model's EOS set, plus the end-of-turn tokens of the chat formats we know
/// (R1's EOS is its end of turn; Kimi-K2 ends a turn with `<|im_end|>`).
fn stop_conditions(
    config_eos: &[u32],
    tok: Option<&Tokenizer>,
    dir: &Path,
    s: &SamplingArgs,
    max_new_tokens: usize,
    chat: bool,
) -> StopConditions {
    let mut ids = if s.ignore_eos {
        Vec::new()
    } else {
        StopConditions::eos_ids(config_eos, tok, dir)
    };
    if chat && !s.ignore_eos {
        if let Some(t) = tok {
            ids.extend(t.token_to_id("<|im_end|>"));
        }
    }
    StopConditions {
        max_new_tokens,
        stop_token_ids: ids,
        stop_strings: s.stop.clone(),
        include_stop_str: false,
    }
}

/// Prints streamed text; reasoning is dimmed on a terminal, hidden with `--hide-reasoning`, and
/// otherwise passed through unchanged (so piped output is exactly the generated text).
struct Printer {
    splitter: Option<ReasoningSplitter>,
    terminal: bool,
    hide: bool,
    dimmed: bool,
    /// The first error writing stdout.
    failed: Option<std::io::Error>,
    /// A newline after the answer (chat's turns, a terminal's prompt); `generate` into a pipe
    /// or file writes the text alone.
    newline: bool,
}

impl Printer {
    /// `sections`: markers that end the reasoning as `</think>` does (a Kimi-K2-Thinking
    /// tool-call section), so the calls are not taken for reasoning.
    fn new(prompt_text: &str, hide: bool, sections: &'static [&'static str]) -> Printer {
        let terminal = std::io::stdout().is_terminal();
        let starts = ReasoningSplitter::prompt_opens_reasoning(prompt_text);
        Printer {
            splitter: (terminal || hide)
                .then(|| ReasoningSplitter::new(starts).ending_at(sections)),
            terminal,
            hide,
            dimmed: false,
            failed: None,
            newline: true,
        }
    }

    /// Prints `text`; false once stdout cannot be written (the reader left, the disk is full):
    /// the caller stops generating, and [`Printer::result`] says why.
    fn print(&mut self, text: &str) -> bool {
        if self.failed.is_some() {
            return false;
        }
        let mut out = std::io::stdout().lock();
        let written = match self.splitter.as_mut() {
            None => out.write_all(text.as_bytes()),
            Some(sp) => {
                let segs = sp.push(text);
                Self::write_segments(&mut out, segs, self.terminal, self.hide, &mut self.dimmed)
            }
        }
        .and_then(|_| out.flush());
        if let Err(e) = written {
            self.failed = Some(e);
        }
        self.failed.is_none()
    }

    fn finish(&mut self) {
        if self.failed.is_some() {
            return;
        }
        let mut out = std::io::stdout().lock();
        let mut written = Ok(());
        if let Some(sp) = self.splitter.as_mut() {
            let segs = sp.finish();
            written =
                Self::write_segments(&mut out, segs, self.terminal, self.hide, &mut self.dimmed);
        }
        if self.dimmed {
            written = written.and_then(|_| out.write_all(b"\x1b[0m"));
            self.dimmed = false;
        }
        let newline: &[u8] = if self.newline { b"\n" } else { b"" };
        if let Err(e) = written
            .and_then(|_| out.write_all(newline))
            .and_then(|_| out.flush())
        {
            self.failed = Some(e);
        }
    }

    /// Whether everything printed reached stdout.
    fn result(&mut self) -> Result<()> {
        match self.failed.take() {
            Some(e) => Err(anyhow::Error::new(e).context(crate::OUTPUT_FAILED)),
            None => Ok(()),
        }
    }

    fn write_segments(
        out: &mut impl Write,
        segs: Vec<Segment>,
        terminal: bool,
        hide: bool,
        dimmed: &mut bool,
    ) -> std::io::Result<()> {
        for seg in segs {
            match seg {
                Segment::Reasoning(t) if !hide => {
                    if terminal && !*dimmed {
                        out.write_all(b"\x1b[2m")?;
                        *dimmed = true;
                    }
                    out.write_all(t.as_bytes())?;
                }
                Segment::Reasoning(_) => {}
                Segment::Answer(t) => {
                    if *dimmed {
                        out.write_all(b"\x1b[0m")?;
                        *dimmed = false;
                    }
                    out.write_all(t.as_bytes())?;
                }
            }
        }
        Ok(())
    }
}

fn report(g: &Generation) {
    let n = g.tokens.len();
    // (The first token comes from the prefill: with one token there was no decode step.)
    let decode = if n > 1 && g.decode_s > 0.0 {
        format!("decode {:.2} tokens/s", (n - 1) as f64 / g.decode_s)
    } else {
        "no decode step".to_string()
    };
    say!(
        "[{n} token{}; prefill {:.1} ms; {decode}; finish: {}]",
        if n == 1 { "" } else { "s" },
        g.prefill_s * 1e3,
        finish_word(&g.finish)
    );
}

fn finish_word(f: &FinishReason) -> &'static str {
    f.as_str()
}

pub fn generate(args: &GenerateArgs) -> Result<()> {
    let dir = model_dir(&args.model)?;
    // Token ids in, ids out work without a tokenizer; a tokenizer that is there but broken
    // still gets a warning (its EOS ids and the text output are lost).
    let tok = match Tokenizer::from_dir(&dir) {
        Ok(t) => Some(t),
        Err(e) => {
            let absent =
                !dir.join("tokenizer.json").exists() && !dir.join("tiktoken.model").exists();
            if !absent && args.input.token_ids.is_some() {
                say!("warning: the tokenizer cannot be used ({e}); output is ids only");
            }
            None
        }
    };
    if tok.is_none() && !args.sampling.stop.is_empty() {
        bail!(
            "{}: --stop needs the model's tokenizer (stop strings are matched in the text; \
             without a tokenizer there is none): drop --stop, or add the tokenizer",
            dir.display()
        );
    }
    let (prompt_ids, prompt_text) = if args.chat {
        let Some(tok) = tok.as_ref() else {
            // Why it could not be loaded (a broken tokenizer_config.json, say), not only that.
            let why = Tokenizer::from_dir(&dir)
                .err()
                .map_or(String::new(), |e| format!(": {e}"));
            bail!("{}: --chat needs the model's tokenizer{why}", dir.display());
        };
        let user = match (&args.input.prompt, &args.input.file) {
            (Some(p), _) => p.clone(),
            (None, Some(f)) => crate::read_text_file(f)?,
            _ => bail!("--chat needs --prompt or --file"),
        };
        let mut msgs = Vec::new();
        if let Some(s) = &args.system {
            msgs.push(turn("system", s.clone()));
        }
        msgs.push(turn("user", user));
        let kwargs = template_kwargs(args.chat_template_kwargs.as_deref())?;
        let tools = read_tools(args.tools.as_deref())?;
        let t = chat_template(tok, &dir, args.chat_template.as_deref())?;
        warn_if_tools_unshown(&t, tools.as_ref(), &kwargs);
        let text = render(&t, &msgs, tools.as_ref(), &kwargs)?;
        (tok.encode(&text)?, text)
    } else {
        let mut ids = tokens(&args.input, &dir)?;
        if args.input.token_ids.is_none() {
            if let Some(bos) = tok.as_ref().and_then(|t| t.prompt_bos_id()) {
                if ids.first() != Some(&bos) {
                    ids.insert(0, bos);
                }
            }
        }
        let text = match (&tok, &args.input.token_ids) {
            (Some(t), Some(ids)) => t.decode(ids).unwrap_or_default(),
            _ => args.input.prompt.clone().unwrap_or_default(),
        };
        (ids, text)
    };
    let family = detect_family(&dir)?;
    let ctx = GenerateInput {
        args,
        dir: &dir,
        tok: tok.as_ref(),
        prompt_ids: &prompt_ids,
        prompt_text: &prompt_text,
        tool_format: tok
            .as_ref()
            .and_then(|t| ToolCallFormat::for_tokenizer(t, family == ModelFamily::DeepseekV4)),
    };
    match family {
        ModelFamily::DeepseekV3 => {
            let m = args.sampling.load(&args.model)?;
            let c = m.config();
            generate_with(&m, &c.eos_token_ids, c.max_position_embeddings, &ctx)
        }
        ModelFamily::DeepseekV4 => {
            let m = load_v4(&args.model, args.sampling.mtp > 0)?;
            let c = m.config();
            generate_with(&m, &c.eos_token_ids, c.max_position_embeddings, &ctx)
        }
    }
}

/// What `generate` has prepared before loading the model.
struct GenerateInput<'a> {
    args: &'a GenerateArgs,
    dir: &'a Path,
    tok: Option<&'a Tokenizer>,
    prompt_ids: &'a [u32],
    prompt_text: &'a str,
    /// How the model writes tool calls (None without a tokenizer or tool tokens).
    tool_format: Option<ToolCallFormat>,
}

/// The rest of `generate` once the model is loaded (any family the engine runs).
fn generate_with<M: Model>(
    m: &M,
    config_eos: &[u32],
    max_positions: usize,
    ctx: &GenerateInput,
) -> Result<()> {
    let GenerateInput {
        args,
        dir,
        tok,
        prompt_ids,
        prompt_text,
        tool_format,
    } = *ctx;
    // Where reasoning also ends (a Kimi-K2-Thinking tool-call section).
    let sections = tool_format.map_or(&[][..], ToolCallFormat::ends_reasoning);
    let max_new = check_length(
        prompt_ids.len(),
        args.sampling.max_new_tokens,
        max_positions,
    )?;
    let stop = stop_conditions(config_eos, tok, dir, &args.sampling, max_new, args.chat);
    if args.json {
        let g = args
            .sampling
            .generate(m, tok, prompt_ids, &stop, None, &mut |_| {})?;
        let text = tok.map(|_| g.text.clone());
        let mut v = serde_json::json!({
            "prompt_ids": prompt_ids,
            "output_ids": g.tokens,
            "text": text,
            "finish_reason": finish_word(&g.finish),
            "prefill_s": g.prefill_s,
            "decode_s": g.decode_s,
        });
        if tok.is_some() {
            let (reasoning, answer) = ReasoningSplitter::split_at(prompt_text, &g.text, sections);
            add_tool_fields(
                &mut v,
                &tool_calls_of(tool_format, &answer, &g.finish),
                (&reasoning, &answer),
            );
        }
        println!("{v}");
        return Ok(());
    }
    let mut printer = Printer::new(prompt_text, args.hide_reasoning, sections);
    // (Into a pipe or file the output is the answer's text, byte for byte.)
    printer.newline = printer.terminal;
    // A reader that left (or a full disk) ends the generation.
    let stop_writing = AtomicBool::new(false);
    let g = args
        .sampling
        .generate(m, tok, prompt_ids, &stop, Some(&stop_writing), &mut |t| {
            if !printer.print(t) {
                stop_writing.store(true, Ordering::SeqCst);
            }
        })?;
    if tok.is_none() {
        let s: Vec<String> = g.tokens.iter().map(u32::to_string).collect();
        printer.print(&s.join(","));
    }
    printer.finish();
    printer.result()?;
    if args.chat || args.tools.is_some() {
        report_tool_calls(&tool_calls_of(
            tool_format,
            &ReasoningSplitter::split_at(prompt_text, &g.text, sections).1,
            &g.finish,
        ));
    }
    report(&g);
    Ok(())
}

pub fn chat(args: &ChatArgs) -> Result<()> {
    let dir = model_dir(&args.model)?;
    let tok = Tokenizer::from_dir(&dir)?;
    let kwargs = template_kwargs(args.chat_template_kwargs.as_deref())?;
    let template = chat_template(&tok, &dir, args.chat_template.as_deref())?;
    let tools = read_tools(args.tools.as_deref())?;
    warn_if_tools_unshown(&template, tools.as_ref(), &kwargs);
    let family = detect_family(&dir)?;
    let tool_format = ToolCallFormat::for_tokenizer(&tok, family == ModelFamily::DeepseekV4);
    // Where reasoning also ends (a Kimi-K2-Thinking tool-call section).
    let sections = tool_format.map_or(&[][..], ToolCallFormat::ends_reasoning);
    let (v3, v4);
    let (m, eos, max_positions): (&(dyn Model + Sync), &[u32], usize) = match family {
        ModelFamily::DeepseekV3 => {
            v3 = args.sampling.load(&args.model)?;
            let c = v3.config();
            (&v3, &c.eos_token_ids, c.max_position_embeddings)
        }
        ModelFamily::DeepseekV4 => {
            v4 = load_v4(&args.model, args.sampling.mtp > 0)?;
            let c = v4.config();
            (&v4, &c.eos_token_ids, c.max_position_embeddings)
        }
    };
    // (Each turn's own limit is set when the turn's prompt is known.)
    let mut stop = stop_conditions(eos, Some(&tok), &dir, &args.sampling, 0, true);

    // Ctrl-C stops the answer being written; at the prompt it leaves.
    let cancel = Arc::new(AtomicBool::new(false));
    let generating = Arc::new(AtomicBool::new(false));
    {
        let (cancel, generating) = (cancel.clone(), generating.clone());
        ctrlc::set_handler(move || {
            if generating.load(Ordering::SeqCst) {
                cancel.store(true, Ordering::SeqCst);
            } else {
                std::process::exit(130);
            }
        })
        .context("cannot install the Ctrl-C handler")?;
    }

    let interactive = std::io::stdin().is_terminal();
    if interactive {
        say!("cachalot chat: /reset clears the history, /system TEXT sets the system prompt, /tool RESULT answers a tool call, /exit leaves; Ctrl-C stops an answer.");
    }
    let mut system = args.system.clone();
    let mut history: Vec<serde_json::Value> = Vec::new();
    // The ids of the model's tool calls still waiting for a /tool result, in order.
    let mut pending: std::collections::VecDeque<String> = std::collections::VecDeque::new();
    let stdin = std::io::stdin();
    // Lines as bytes: one that is not UTF-8 is decoded lossily with a warning, not the end
    // of the conversation.
    let mut lines = stdin.lock().split(b'\n').map(|r| {
        r.map(|bytes| match String::from_utf8(bytes) {
            Ok(s) => s,
            Err(e) => {
                say!("warning: that line is not UTF-8; invalid bytes read as U+FFFD");
                String::from_utf8_lossy(e.as_bytes()).into_owned()
            }
        })
    });
    loop {
        if interactive {
            eprint!("> ");
            let _ = std::io::stderr().flush();
        }
        let Some(line) = lines.next() else { break };
        let line = line.context("cannot read stdin")?;
        let input = line.trim_end_matches(['\r', '\n']);
        if input.trim().is_empty() {
            continue;
        }
        // (Whitespace around a bare command is not something after it.)
        if matches!(input.trim(), "/exit" | "/quit") {
            break;
        }
        if input.trim() == "/reset" {
            history.clear();
            pending.clear();
            if interactive {
                say!("(history cleared)");
            }
            continue;
        }
        // `/system`, then any whitespace (a tab too) and the prompt.
        let system_arg = input
            .strip_prefix("/system")
            .filter(|rest| rest.is_empty() || rest.starts_with(char::is_whitespace));
        if let Some(rest) = system_arg {
            let rest = rest.trim();
            system = (!rest.is_empty()).then(|| rest.to_string());
            if interactive {
                say!(
                    "(system prompt {})",
                    if system.is_some() { "set" } else { "cleared" }
                );
            }
            continue;
        }
        // How many messages this input added (a refused turn takes them back).
        let tool_result = (input == "/tool")
            .then_some("")
            .or_else(|| input.strip_prefix("/tool "));
        // An unknown /command is a typo, not a message for the model ("//" sends a line that
        // starts with "/").
        let command = input.split_whitespace().next().unwrap_or("");
        if matches!(command, "/reset" | "/exit" | "/quit") {
            say!("error: {command} takes nothing after it (got {input:?})");
            continue;
        }
        if tool_result.is_none()
            && command.starts_with('/')
            && !command.starts_with("//")
            && command.len() > 1
        {
            say!(
                "error: unknown command {command}; commands: /reset, /system TEXT, /tool RESULT, \
                 /exit (start a message with // to send a line beginning with /)"
            );
            continue;
        }
        let input = input
            .strip_prefix('/')
            .filter(|r| r.starts_with('/'))
            .unwrap_or(input);
        let added = if let Some(result) = tool_result {
            let Some(id) = pending.pop_front() else {
                say!("error: no tool call is waiting for a result");
                continue;
            };
            history.push(serde_json::json!({
                "role": "tool",
                "tool_call_id": id,
                "content": result,
            }));
            if !pending.is_empty() {
                if interactive {
                    say!("({} more tool result(s) to give)", pending.len());
                }
                continue;
            }
            0
        } else {
            if !pending.is_empty() {
                say!(
                    "error: the model called {} tool(s); give each result with /tool RESULT \
                     (or /reset)",
                    pending.len()
                );
                continue;
            }
            history.push(turn("user", input));
            1
        };
        let mut msgs = Vec::new();
        if let Some(s) = &system {
            msgs.push(turn("system", s.clone()));
        }
        msgs.extend(history.iter().cloned());
        // A template that refuses this history (e.g. `raise_exception` on a second turn), or a
        // prompt too long, refuses the turn; the session goes on.
        let checked = render(&template, &msgs, tools.as_ref(), &kwargs).and_then(|text| {
            let ids = tok.encode(&text)?;
            let max_new = check_length(ids.len(), args.sampling.max_new_tokens, max_positions)?;
            Ok((text, ids, max_new))
        });
        let (prompt_text, prompt_ids, max_new) = match checked {
            Ok(p) => p,
            Err(e) => {
                // The turn is refused; the conversation goes on without it. A refused turn after
                // the last tool result gives the results back: they wait for /tool again.
                say!("error: {e:#} (/reset clears the history)");
                history.truncate(history.len() - added);
                if added == 0 {
                    while history.last().is_some_and(|m| m["role"] == "tool") {
                        let m = history.pop().expect("a last message");
                        if let Some(id) = m["tool_call_id"].as_str() {
                            pending.push_front(id.to_string());
                        }
                    }
                }
                continue;
            }
        };
        stop.max_new_tokens = max_new;
        cancel.store(false, Ordering::SeqCst);
        generating.store(true, Ordering::SeqCst);
        let mut printer =
            (!args.json).then(|| Printer::new(&prompt_text, args.hide_reasoning, sections));
        let result = args.sampling.generate(
            &m,
            Some(&tok),
            &prompt_ids,
            &stop,
            Some(&cancel),
            &mut |t| {
                if let Some(p) = printer.as_mut() {
                    if !p.print(t) {
                        // Stdout is gone: the answer stops, and so does the chat (below).
                        cancel.store(true, Ordering::SeqCst);
                    }
                }
            },
        );
        generating.store(false, Ordering::SeqCst);
        let g = result?;
        let (reasoning, answer) = ReasoningSplitter::split_at(&prompt_text, &g.text, sections);
        let parsed = tool_calls_of(tool_format, &answer, &g.finish);
        match printer.as_mut() {
            Some(p) => {
                p.finish();
                p.result()?;
                report_tool_calls(&parsed);
                if interactive {
                    report(&g);
                }
            }
            None => {
                let mut v = serde_json::json!({
                    "prompt": prompt_text,
                    "text": g.text,
                    "output_ids": g.tokens,
                    "finish_reason": finish_word(&g.finish),
                });
                add_tool_fields(&mut v, &parsed, (&reasoning, &answer));
                println!("{v}");
            }
        }
        if let Some(Ok(p)) = &parsed {
            if !p.tool_calls.is_empty() {
                // The history keeps the calls as the template renders them; each waits for its
                // result.
                pending = p.tool_calls.iter().filter_map(|c| c.id.clone()).collect();
                // The reasoning goes along: V4 keeps it in tool-use turns, Kimi-K2-Thinking's
                // template renders it for the turns after the last user message, R1's ignores it.
                history.push(serde_json::json!({
                    "role": "assistant",
                    "content": p.content,
                    "reasoning_content": reasoning,
                    "tool_calls": p.tool_calls,
                }));
                if interactive {
                    say!("(give each tool's result with /tool RESULT)");
                }
                continue;
            }
        }
        // The template decides what of the answer the history keeps (R1 drops the reasoning);
        // the generation prompt's own opening (`<think>\n`) is part of the answer's text.
        // V4's encoder takes the reasoning as its own field.
        if family == ModelFamily::DeepseekV4 {
            history.push(serde_json::json!({
                "role": "assistant",
                "content": answer,
                "reasoning_content": reasoning,
            }));
            continue;
        }
        let opened = ReasoningSplitter::prompt_opens_reasoning(&prompt_text);
        let content = if opened && g.text.contains("</think>") {
            format!("<think>\n{}", g.text)
        } else if opened {
            // Still reasoning when it ended (cut off, cancelled): no answer, as a vLLM
            // client's history holds it (the reasoning parser's content is null).
            answer.clone()
        } else {
            g.text.clone()
        };
        history.push(turn("assistant", content));
    }
    Ok(())
}
