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
use cachalot_model::tokenizer::{ChatTemplate, Message, Tokenizer};
use cachalot_model::{detect_family, DeepseekV3, ModelFamily};

use crate::{load_model, load_v4, model_dir, tokens, InputArgs, ModelArgs};

#[derive(clap::Args)]
pub struct TokenizeArgs {
    /// Model directory (only its tokenizer.json or tiktoken.model and tokenizer_config.json are read).
    #[arg(long)]
    model: Option<PathBuf>,
    /// Text to encode (special-token strings in it become their ids; no BOS is added).
    #[arg(long, conflicts_with = "decode", required_unless_present = "decode")]
    text: Option<String>,
    /// Comma-separated token ids to decode.
    #[arg(long, value_delimiter = ',')]
    decode: Option<Vec<u32>>,
    /// `{"ids": [...]}` (or `{"text": ...}` with --decode).
    #[arg(long)]
    json: bool,
}

#[derive(clap::Args)]
pub struct SamplingArgs {
    /// Tokens to generate at most (at least 1).
    #[arg(long, visible_alias = "max-tokens", default_value_t = 256,
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    max_new_tokens: usize,
    /// 0 (the default) is greedy; DeepSeek recommends 0.6 for R1.
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    /// Nucleus sampling mass (1 = off).
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    /// Keep the K most probable tokens (0 = off).
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    /// Keep tokens with probability >= min_p × the top one (0 = off).
    #[arg(long, default_value_t = 0.0)]
    min_p: f32,
    /// CTRL repetition penalty over prompt and output tokens (1 = off).
    #[arg(long, default_value_t = 1.0)]
    repetition_penalty: f32,
    /// Subtracted from the logit of every token already generated (0 = off).
    #[arg(long, default_value_t = 0.0)]
    presence_penalty: f32,
    /// Subtracted once per earlier occurrence in the output (0 = off).
    #[arg(long, default_value_t = 0.0)]
    frequency_penalty: f32,
    /// Seed of the sampler (same seed, same output).
    #[arg(long)]
    seed: Option<u64>,
    /// Extra stop string (repeatable); the text ends before it.
    #[arg(long)]
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
            bail!("--mtp {}: 1 to 3 draft tokens per step", self.mtp);
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
    #[arg(long, requires = "chat")]
    system: Option<String>,
    /// Chat template to use instead of the model's (with --chat): a tokenizer_config.json or a
    /// Jinja file.
    #[arg(long, requires = "chat")]
    chat_template: Option<PathBuf>,
    /// Extra chat-template variables, a JSON object: '{"enable_thinking": false}' (Kimi-K2-Thinking
    /// and other Jinja templates that read it), '{"thinking": true}' (DeepSeek-V4's thinking mode).
    #[arg(long, value_name = "JSON", requires = "chat")]
    chat_template_kwargs: Option<String>,
    /// Do not print the reasoning (`<think>…</think>`), only the answer.
    #[arg(long)]
    hide_reasoning: bool,
    /// Print one JSON object at the end instead of streaming text.
    #[arg(long)]
    json: bool,
}

#[derive(clap::Args)]
pub struct ChatArgs {
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    sampling: SamplingArgs,
    /// System prompt of the conversation (change it with /system TEXT).
    #[arg(long)]
    system: Option<String>,
    /// Chat template to use instead of the model's: a tokenizer_config.json or a Jinja file.
    #[arg(long)]
    chat_template: Option<PathBuf>,
    /// Extra chat-template variables, a JSON object: '{"enable_thinking": false}' (Kimi-K2-Thinking
    /// and other Jinja templates that read it), '{"thinking": true}' (DeepSeek-V4's thinking mode).
    #[arg(long, value_name = "JSON")]
    chat_template_kwargs: Option<String>,
    /// Do not print the reasoning (`<think>…</think>`), only the answer.
    #[arg(long)]
    hide_reasoning: bool,
    /// One JSON object per turn ({"prompt", "text", "output_ids", "finish_reason"}) instead of text.
    #[arg(long)]
    json: bool,
}

pub fn tokenize(args: &TokenizeArgs) -> Result<()> {
    let dir = match &args.model {
        Some(d) => d.clone(),
        None => model_dir(&ModelArgs::none())?,
    };
    let tok = Tokenizer::from_dir(&dir)?;
    if let Some(ids) = &args.decode {
        let vocab = tok.vocab_size();
        if let Some(&bad) = ids.iter().find(|&&t| t as usize >= vocab) {
            bail!(
                "--decode: id {bad} is outside the tokenizer's vocabulary (0..{})",
                vocab - 1
            );
        }
        let text = tok.decode(ids)?;
        if args.json {
            println!("{}", serde_json::json!({ "text": text }));
        } else {
            println!("{text}");
        }
    } else {
        let ids = tok.encode(args.text.as_deref().unwrap_or_default())?;
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
        }
    }
}

fn chat_template(tok: &Tokenizer, dir: &Path, file: Option<&Path>) -> Result<ChatTemplate> {
    if let Some(f) = file {
        let mut t = ChatTemplate::from_file(f)?;
        // A bare Jinja file gets the model's special tokens.
        if f.extension().is_none_or(|e| e != "json") {
            for field in ["bos_token", "eos_token"] {
                if let Some(v) = tok.config_token(field) {
                    t.set_special_token(field, v);
                }
            }
        }
        return Ok(t);
    }
    tok.chat_template()?.with_context(|| {
        format!(
            "{}: no chat_template in tokenizer_config.json; pass --chat-template FILE",
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
    msgs: &[Message],
    kwargs: &serde_json::Map<String, serde_json::Value>,
) -> Result<String> {
    let msgs = serde_json::to_value(msgs)?;
    Ok(t.render_json(&msgs, true, None, kwargs)?)
}

/// The prompt plus `--max-new-tokens` fit the model's positions (`max_position_embeddings`):
/// the KV cache is sized for them before the first step.
fn check_length(prompt: usize, max_new: usize, max_positions: usize) -> Result<()> {
    if prompt >= max_positions {
        bail!(
            "the prompt ({prompt} tokens) leaves no room in the model's max_position_embeddings \
             {max_positions} (config.json): shorten it by at least {} tokens",
            prompt + 1 - max_positions
        );
    }
    if prompt.saturating_add(max_new) > max_positions {
        bail!(
            "--max-new-tokens {max_new}: the prompt ({prompt} tokens) plus the output would \
             exceed the model's max_position_embeddings {max_positions} (config.json); give at \
             most {}",
            max_positions.saturating_sub(prompt)
        );
    }
    Ok(())
}

/// Stop ids: the model's EOS set, plus the end-of-turn tokens of the chat formats we know
/// (R1's EOS is its end of turn; Kimi-K2 ends a turn with `<|im_end|>`).
fn stop_conditions(
    config_eos: &[u32],
    tok: Option<&Tokenizer>,
    dir: &Path,
    s: &SamplingArgs,
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
        max_new_tokens: s.max_new_tokens,
        stop_token_ids: ids,
        stop_strings: s.stop.clone(),
    }
}

/// Prints streamed text; reasoning is dimmed on a terminal, hidden with `--hide-reasoning`, and
/// otherwise passed through unchanged (so piped output is exactly the generated text).
struct Printer {
    splitter: Option<ReasoningSplitter>,
    terminal: bool,
    hide: bool,
    dimmed: bool,
}

impl Printer {
    fn new(prompt_text: &str, hide: bool) -> Printer {
        let terminal = std::io::stdout().is_terminal();
        let starts = ReasoningSplitter::prompt_opens_reasoning(prompt_text);
        Printer {
            splitter: (terminal || hide).then(|| ReasoningSplitter::new(starts)),
            terminal,
            hide,
            dimmed: false,
        }
    }

    fn print(&mut self, text: &str) {
        let mut out = std::io::stdout().lock();
        match self.splitter.as_mut() {
            None => {
                let _ = out.write_all(text.as_bytes());
            }
            Some(sp) => {
                let segs = sp.push(text);
                Self::write_segments(&mut out, segs, self.terminal, self.hide, &mut self.dimmed);
            }
        }
        let _ = out.flush();
    }

    fn finish(&mut self) {
        let mut out = std::io::stdout().lock();
        if let Some(sp) = self.splitter.as_mut() {
            let segs = sp.finish();
            Self::write_segments(&mut out, segs, self.terminal, self.hide, &mut self.dimmed);
        }
        if self.dimmed {
            let _ = out.write_all(b"\x1b[0m");
            self.dimmed = false;
        }
        let _ = out.write_all(b"\n");
        let _ = out.flush();
    }

    fn write_segments(
        out: &mut impl Write,
        segs: Vec<Segment>,
        terminal: bool,
        hide: bool,
        dimmed: &mut bool,
    ) {
        for seg in segs {
            match seg {
                Segment::Reasoning(t) if !hide => {
                    if terminal && !*dimmed {
                        let _ = out.write_all(b"\x1b[2m");
                        *dimmed = true;
                    }
                    let _ = out.write_all(t.as_bytes());
                }
                Segment::Reasoning(_) => {}
                Segment::Answer(t) => {
                    if *dimmed {
                        let _ = out.write_all(b"\x1b[0m");
                        *dimmed = false;
                    }
                    let _ = out.write_all(t.as_bytes());
                }
            }
        }
    }
}

fn report(g: &Generation) {
    let n = g.tokens.len();
    let decode_tps = if n > 1 && g.decode_s > 0.0 {
        (n - 1) as f64 / g.decode_s
    } else {
        0.0
    };
    eprintln!(
        "[{n} tokens; prefill {:.1} ms; decode {decode_tps:.2} tokens/s; finish: {}]",
        g.prefill_s * 1e3,
        finish_word(&g.finish)
    );
}

fn finish_word(f: &FinishReason) -> &'static str {
    f.as_str()
}

pub fn generate(args: &GenerateArgs) -> Result<()> {
    let dir = model_dir(&args.model)?;
    let tok = Tokenizer::from_dir(&dir).ok();
    let (prompt_ids, prompt_text) = if args.chat {
        let tok = tok
            .as_ref()
            .with_context(|| format!("{}: --chat needs the model's tokenizer", dir.display()))?;
        let user = match (&args.input.prompt, &args.input.file) {
            (Some(p), _) => p.clone(),
            (None, Some(f)) => std::fs::read_to_string(f)
                .with_context(|| format!("cannot read {}", f.display()))?,
            _ => bail!("--chat needs --prompt or --file"),
        };
        let mut msgs = Vec::new();
        if let Some(s) = &args.system {
            msgs.push(Message::new("system", s.clone()));
        }
        msgs.push(Message::new("user", user));
        let kwargs = template_kwargs(args.chat_template_kwargs.as_deref())?;
        let t = chat_template(tok, &dir, args.chat_template.as_deref())?;
        let text = render(&t, &msgs, &kwargs)?;
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
    let ctx = GenerateInput {
        args,
        dir: &dir,
        tok: tok.as_ref(),
        prompt_ids: &prompt_ids,
        prompt_text: &prompt_text,
    };
    match detect_family(&dir)? {
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
    } = *ctx;
    check_length(
        prompt_ids.len(),
        args.sampling.max_new_tokens,
        max_positions,
    )?;
    let stop = stop_conditions(config_eos, tok, dir, &args.sampling, args.chat);
    if args.json {
        let g = args
            .sampling
            .generate(m, tok, prompt_ids, &stop, None, &mut |_| {})?;
        let text = tok.map(|_| g.text.clone());
        println!(
            "{}",
            serde_json::json!({
                "prompt_ids": prompt_ids,
                "output_ids": g.tokens,
                "text": text,
                "finish_reason": finish_word(&g.finish),
                "prefill_s": g.prefill_s,
                "decode_s": g.decode_s,
            })
        );
        return Ok(());
    }
    let mut printer = Printer::new(prompt_text, args.hide_reasoning);
    let g = args
        .sampling
        .generate(m, tok, prompt_ids, &stop, None, &mut |t| printer.print(t))?;
    if tok.is_none() {
        let s: Vec<String> = g.tokens.iter().map(u32::to_string).collect();
        print!("{}", s.join(","));
    }
    printer.finish();
    report(&g);
    Ok(())
}

pub fn chat(args: &ChatArgs) -> Result<()> {
    let dir = model_dir(&args.model)?;
    let tok = Tokenizer::from_dir(&dir)?;
    let kwargs = template_kwargs(args.chat_template_kwargs.as_deref())?;
    let template = chat_template(&tok, &dir, args.chat_template.as_deref())?;
    let (v3, v4);
    let (m, eos, max_positions): (&(dyn Model + Sync), &[u32], usize) = match detect_family(&dir)? {
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
    let stop = stop_conditions(eos, Some(&tok), &dir, &args.sampling, true);

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
        eprintln!("cachalot chat: /reset clears the history, /system TEXT sets the system prompt, /exit leaves; Ctrl-C stops an answer.");
    }
    let mut system = args.system.clone();
    let mut history: Vec<Message> = Vec::new();
    let stdin = std::io::stdin();
    let mut lines = stdin.lock().lines();
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
        if input == "/exit" || input == "/quit" {
            break;
        }
        if input == "/reset" {
            history.clear();
            if interactive {
                eprintln!("(history cleared)");
            }
            continue;
        }
        if let Some(rest) = input.strip_prefix("/system") {
            let rest = rest.trim();
            system = (!rest.is_empty()).then(|| rest.to_string());
            if interactive {
                eprintln!(
                    "(system prompt {})",
                    if system.is_some() { "set" } else { "cleared" }
                );
            }
            continue;
        }
        history.push(Message::new("user", input));
        let mut msgs = Vec::new();
        if let Some(s) = &system {
            msgs.push(Message::new("system", s.clone()));
        }
        msgs.extend(history.iter().cloned());
        let prompt_text = render(&template, &msgs, &kwargs)?;
        let prompt_ids = tok.encode(&prompt_text)?;
        if let Err(e) = check_length(
            prompt_ids.len(),
            args.sampling.max_new_tokens,
            max_positions,
        ) {
            // The turn is refused; the conversation goes on without it.
            eprintln!("error: {e:#} (/reset clears the history)");
            history.pop();
            continue;
        }
        cancel.store(false, Ordering::SeqCst);
        generating.store(true, Ordering::SeqCst);
        let mut printer = (!args.json).then(|| Printer::new(&prompt_text, args.hide_reasoning));
        let result = args.sampling.generate(
            &m,
            Some(&tok),
            &prompt_ids,
            &stop,
            Some(&cancel),
            &mut |t| {
                if let Some(p) = printer.as_mut() {
                    p.print(t)
                }
            },
        );
        generating.store(false, Ordering::SeqCst);
        let g = result?;
        match printer.as_mut() {
            Some(p) => {
                p.finish();
                if interactive {
                    report(&g);
                }
            }
            None => println!(
                "{}",
                serde_json::json!({
                    "prompt": prompt_text,
                    "text": g.text,
                    "output_ids": g.tokens,
                    "finish_reason": finish_word(&g.finish),
                })
            ),
        }
        // The template decides what of the answer the history keeps (R1 drops the reasoning);
        // the generation prompt's own opening (`<think>\n`) is part of the answer's text.
        let opened = ReasoningSplitter::prompt_opens_reasoning(&prompt_text);
        let content = if opened && g.text.contains("</think>") {
            format!("<think>\n{}", g.text)
        } else {
            g.text.clone()
        };
        history.push(Message::new("assistant", content));
    }
    Ok(())
}
