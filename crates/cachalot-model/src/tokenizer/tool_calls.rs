//! Tool calls in generated text: the answer a model wrote, split into its content and the
//! function calls it asked for, in OpenAI's shape (`{"id", "type": "function", "function":
//! {"name", "arguments"}}`, arguments a JSON text).
//!
//! The formats are the ones the models' chat templates write for an assistant turn with
//! `tool_calls` (spec `deepseek-v3-r1-kimi-k2.md` §7.1 and §7.2, `deepseek-v4.md` §5), so what a
//! template renders parses back to the same calls (`tests/text.rs` checks that on the rendered
//! fixtures):
//! - DeepSeek-V3 / R1: `<｜tool▁calls▁begin｜>`, then per call `<｜tool▁call▁begin｜>function
//!   <｜tool▁sep｜>NAME` + "\n```json\n" + ARGUMENTS + "\n```" + `<｜tool▁call▁end｜>` (calls
//!   separated by newlines), then `<｜tool▁calls▁end｜>`. DeepSeek-V3.1's later form,
//!   `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGUMENTS<｜tool▁call▁end｜>`, is read too: a call
//!   whose head (before `<｜tool▁sep｜>`) is not `function` is that form.
//! - Kimi-K2: `<|tool_calls_section_begin|>`, then per call `<|tool_call_begin|>functions.NAME:
//!   INDEX<|tool_call_argument_begin|>ARGUMENTS<|tool_call_end|>`, then
//!   `<|tool_calls_section_end|>`. The call's id is `functions.NAME:INDEX` (what Kimi's template
//!   expects back as `tool_call_id`).
//! - DeepSeek-V4: the DSML block (`\n\n<｜DSML｜tool_calls>` …), read by
//!   [`super::dsv4::parse_answer`].
//!
//! The text is the answer only (the reasoning removed) as the engine streams it: stop tokens
//! (EOS, `<|im_end|>`) are not in it; a trailing one is accepted anyway, and so is a section
//! whose closing marker never came (the model stopped after its last complete call, as vLLM
//! accepts). A call that is cut off (the output hit its token limit), arguments that are not a
//! JSON object (V4's included), or text after the section are errors that say which call and
//! what is wrong: the caller keeps the raw text then (vLLM's parsers do the same: no tool calls,
//! the text as content).

use std::borrow::Cow;

use serde_json::Value;

use super::dsv4::{self, FunctionCall, ToolCall};
use super::Tokenizer;

const V3_CALLS_BEGIN: &str = "<｜tool▁calls▁begin｜>";
const V3_CALLS_END: &str = "<｜tool▁calls▁end｜>";
const V3_CALL_BEGIN: &str = "<｜tool▁call▁begin｜>";
const V3_CALL_END: &str = "<｜tool▁call▁end｜>";
const V3_SEP: &str = "<｜tool▁sep｜>";
const V3_EOS: &str = "<｜end▁of▁sentence｜>";
/// What every marker of DeepSeek-V3's tool-call markup begins with.
const V3_MARKUP_START: &str = "<｜tool▁call";

const KIMI_SECTION_BEGIN: &str = "<|tool_calls_section_begin|>";
const KIMI_SECTION_END: &str = "<|tool_calls_section_end|>";
/// The singular spelling some Kimi-K2 outputs use (vLLM's parser accepts both).
const KIMI_SECTION_BEGIN_1: &str = "<|tool_call_section_begin|>";
const KIMI_SECTION_END_1: &str = "<|tool_call_section_end|>";
const KIMI_CALL_BEGIN: &str = "<|tool_call_begin|>";
const KIMI_ARGS_BEGIN: &str = "<|tool_call_argument_begin|>";
const KIMI_CALL_END: &str = "<|tool_call_end|>";
const KIMI_END_MARKERS: [&str; 2] = ["<|im_end|>", "[EOS]"];
/// What every marker of Kimi-K2's tool-call markup begins with.
const KIMI_MARKUP_START: &str = "<|tool_call";

/// The tool-call markup a model family writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ToolCallFormat {
    /// DeepSeek-V3, R1 (and V3.1's variant of the call).
    DeepseekV3,
    /// Kimi-K2 (Instruct and Thinking).
    KimiK2,
    /// DeepSeek-V4's DSML.
    DeepseekV4,
}

/// An answer split into its text and its tool calls.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ParsedAnswer {
    /// The text before the tool calls (all of it when there are none).
    pub content: String,
    pub tool_calls: Vec<ToolCall>,
}

/// A tool call as far as a growing answer has written it ([`ToolCallFormat::partial_calls`]):
/// its name once whole, and the part of its arguments no later text can change (slices of the
/// answer).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PartialCall<'a> {
    /// The model's own id for the call (Kimi-K2's `functions.NAME:INDEX`); None in DeepSeek's
    /// formats.
    pub id: Option<&'a str>,
    pub name: &'a str,
    /// The arguments' text so far: always the start of what [`ToolCallFormat::parse`] reads
    /// as the call's arguments once the call is complete (a slice of the answer, or for
    /// DeepSeek-V4 the JSON made of its DSML parameters so far).
    pub arguments: Cow<'a, str>,
    /// The call's closing marker has come.
    pub closed: bool,
}

/// Where [`ToolCallFormat::partial_calls`] left off in a growing answer: the byte after the
/// last closed call (None before the section was found), so the next look starts there.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CallsCursor {
    at: Option<usize>,
    /// Calls closed before `at`.
    pub closed: usize,
}

/// Why the tool-call section of an answer could not be read.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ToolCallError {
    #[error("the tool-call section ends inside a call: no `{0}`")]
    Unclosed(&'static str),
    #[error("the tool-call section holds no call")]
    Empty,
    #[error("tool call {index}: {what}")]
    Call { index: usize, what: String },
    #[error("unexpected text after the tool-call section: {0:?}")]
    TrailingText(String),
    #[error("{0}")]
    Dsml(String),
}

impl ToolCallFormat {
    /// The format of a model whose tokenizer is `tok`: by the tool tokens its vocabulary holds
    /// (`v4`: the model is DeepSeek-V4, whose tokenizer carries V3's tokens too). None when the
    /// vocabulary has neither family's tokens.
    pub fn for_tokenizer(tok: &Tokenizer, v4: bool) -> Option<ToolCallFormat> {
        if v4 {
            Some(ToolCallFormat::DeepseekV4)
        } else if tok.token_to_id(V3_CALLS_BEGIN).is_some() {
            Some(ToolCallFormat::DeepseekV3)
        } else if tok.token_to_id(KIMI_SECTION_BEGIN).is_some() {
            Some(ToolCallFormat::KimiK2)
        } else {
            None
        }
    }

    /// Whether an answer has any of the format's tool-call markup (a section, a call, or for V4
    /// any DSML), well-formed or not: where [`ToolCallFormat::parse`] has something to say.
    pub fn mentions_tool_calls(self, answer: &str) -> bool {
        match self {
            ToolCallFormat::DeepseekV3 => answer.contains(V3_MARKUP_START),
            ToolCallFormat::KimiK2 => answer.contains(KIMI_MARKUP_START),
            ToolCallFormat::DeepseekV4 => answer.contains(dsv4::DSML),
        }
    }

    /// How much of a growing answer's text is content that no tool call or end marker can
    /// still change, from `from` on (a position already found safe): the text up to the first
    /// place where a tool-call marker or end marker begins or may begin (a partial one at the
    /// end), and whether a whole marker was found there (the rest stays held).
    pub fn settled_content(self, text: &str, from: usize) -> (usize, bool) {
        let guards: &[&str] = match self {
            ToolCallFormat::DeepseekV3 => &[V3_MARKUP_START, V3_EOS],
            ToolCallFormat::KimiK2 => {
                &[KIMI_MARKUP_START, KIMI_END_MARKERS[0], KIMI_END_MARKERS[1]]
            }
            ToolCallFormat::DeepseekV4 => &dsv4::CONTENT_GUARDS,
        };
        let from = from.min(text.len());
        for (i, _) in text[from..].char_indices() {
            let tail = &text[from + i..];
            if guards.iter().any(|g| tail.starts_with(g)) {
                return (from + i, true);
            }
            if guards.iter().any(|g| g.starts_with(tail)) {
                return (from + i, false);
            }
        }
        (text.len(), false)
    }

    /// Every marker of the format's tool-call markup (the strings that are tokens of their
    /// own in the models' vocabularies).
    pub fn markers(self) -> &'static [&'static str] {
        match self {
            ToolCallFormat::DeepseekV3 => &[
                V3_CALLS_BEGIN,
                V3_CALLS_END,
                V3_CALL_BEGIN,
                V3_CALL_END,
                V3_SEP,
            ],
            ToolCallFormat::KimiK2 => &[
                KIMI_SECTION_BEGIN,
                KIMI_SECTION_END,
                KIMI_SECTION_BEGIN_1,
                KIMI_SECTION_END_1,
                KIMI_CALL_BEGIN,
                KIMI_ARGS_BEGIN,
                KIMI_CALL_END,
            ],
            ToolCallFormat::DeepseekV4 => &[dsv4::DSML],
        }
    }

    /// The ids of [`ToolCallFormat::markers`] that are single tokens of `tok`, with `<think>`
    /// and `</think>`: the special tokens a text must keep for its tool calls and reasoning to
    /// be read (skipped otherwise with `skip_special_tokens`, where a tokenizer marks them
    /// special).
    pub fn parser_tokens(format: Option<ToolCallFormat>, tok: &Tokenizer) -> Vec<u32> {
        let tools = format.map(ToolCallFormat::markers).unwrap_or(&[]);
        [dsv4::THINK_START, dsv4::THINK_END]
            .iter()
            .chain(tools)
            .filter_map(|m| tok.token_to_id(m))
            .collect()
    }

    /// The marker that opens the format's tool-call section.
    /// The marker that ends a reasoning block as `</think>` does, when the format's model may
    /// open its tool calls inside one: Kimi-K2-Thinking (vLLM's `kimi_k2` reasoning parser
    /// ends the reasoning at its tool-call section).
    pub fn ends_reasoning(self) -> &'static [&'static str] {
        match self {
            ToolCallFormat::KimiK2 => &[KIMI_SECTION_BEGIN, KIMI_SECTION_BEGIN_1],
            _ => &[],
        }
    }

    pub fn section_begin(self) -> &'static str {
        match self {
            ToolCallFormat::DeepseekV3 => V3_CALLS_BEGIN,
            ToolCallFormat::KimiK2 => KIMI_SECTION_BEGIN,
            ToolCallFormat::DeepseekV4 => dsv4::DSML,
        }
    }

    /// The markers that close the format's tool-call section (Kimi-K2 has two spellings; V4's
    /// DSML has none of this kind).
    pub fn section_ends(self) -> &'static [&'static str] {
        match self {
            ToolCallFormat::DeepseekV3 => &[V3_CALLS_END],
            ToolCallFormat::KimiK2 => &[KIMI_SECTION_END, KIMI_SECTION_END_1],
            ToolCallFormat::DeepseekV4 => &[],
        }
    }

    /// The calls a growing answer (the reasoning removed) has begun since `cursor` (start
    /// with the default), in order: each whose name is whole, with its arguments so far, for
    /// streaming them as vLLM's tool parsers do (OpenAI's `tool_calls` deltas); the first is
    /// call number `cursor.closed`, and the cursor moves past the calls that closed (so a long
    /// answer is not read again from its start at every token). Text that may still turn out
    /// to be markup or trimmed whitespace (a partial closing marker or fence, trailing spaces)
    /// is held back, so each call's arguments only grow and end as [`ToolCallFormat::parse`]
    /// reads them when the answer parses (DeepSeek-V4's DSML parameters as the JSON text the
    /// parser makes of them).
    pub fn partial_calls<'a>(
        self,
        answer: &'a str,
        cursor: &mut CallsCursor,
    ) -> Vec<PartialCall<'a>> {
        let m = match self {
            ToolCallFormat::DeepseekV3 => &V3_MARKUP,
            ToolCallFormat::KimiK2 => &KIMI_MARKUP,
            ToolCallFormat::DeepseekV4 => return partial_dsml(answer, cursor),
        };
        let start = match cursor.at {
            Some(at) => at,
            None => match m.find_section(answer) {
                Some((start, begin_len)) => start + begin_len,
                None => return Vec::new(),
            },
        };
        cursor.at = Some(start);
        let mut rest = answer.get(start..).unwrap_or("");
        let mut calls = Vec::new();
        loop {
            rest = rest.trim_start();
            let Some(r) = rest.strip_prefix(m.call_begin) else {
                return calls;
            };
            match r.find(m.call_end) {
                Some(end) => {
                    let Some(mut c) = self.partial_body(&r[..end], true) else {
                        return calls;
                    };
                    c.closed = true;
                    calls.push(c);
                    rest = &r[end + m.call_end.len()..];
                    cursor.at = Some(answer.len() - rest.len());
                    cursor.closed += 1;
                }
                None => {
                    // The body so far, less a partial closing marker at its end.
                    let held = (1..m.call_end.len())
                        .rev()
                        .filter(|&k| m.call_end.is_char_boundary(k))
                        .find(|&k| r.ends_with(&m.call_end[..k]))
                        .unwrap_or(0);
                    calls.extend(self.partial_body(&r[..r.len() - held], false));
                    return calls;
                }
            }
        }
    }

    /// A call's body (between its markers; `whole`: the closing marker came) as far as it
    /// reads: None until its name is whole.
    fn partial_body(self, body: &str, whole: bool) -> Option<PartialCall<'_>> {
        // Arguments not yet closed end where trimming or a closing fence could still cut them.
        let settle = |args, fenced| Cow::Borrowed(settle_arguments(args, fenced, whole));
        match self {
            ToolCallFormat::DeepseekV3 => {
                let (head, tail) = body.split_once(V3_SEP)?;
                if head.trim() == "function" {
                    let (name, r) = tail.split_once('\n')?;
                    let r = r.trim_start();
                    let arguments = match r.strip_prefix("```json") {
                        Some(a) => settle(a, true),
                        // The fence's opening is still coming.
                        None if "```json".starts_with(r) => Cow::Borrowed(""),
                        None => return None,
                    };
                    Some(PartialCall {
                        id: None,
                        name: name.trim(),
                        arguments,
                        closed: false,
                    })
                } else {
                    Some(PartialCall {
                        id: None,
                        name: head.trim(),
                        arguments: settle(tail, false),
                        closed: false,
                    })
                }
            }
            ToolCallFormat::KimiK2 => {
                let (id, args) = body.split_once(KIMI_ARGS_BEGIN)?;
                let id = id.trim();
                let base = id.strip_prefix("functions.").unwrap_or(id);
                let name = match base.rsplit_once(':') {
                    Some((n, i)) if i.bytes().all(|b| b.is_ascii_digit()) => n,
                    _ => base,
                };
                Some(PartialCall {
                    id: Some(id),
                    name,
                    arguments: settle(args, false),
                    closed: false,
                })
            }
            ToolCallFormat::DeepseekV4 => None,
        }
    }

    /// [`ToolCallFormat::parse`] of a finished answer; `cut_off`: it ended at its length limit,
    /// and then a section that does not read gives the calls it had closed before the one the
    /// limit cut ([`ToolCallFormat::parse_closed_calls`]), when it closed any.
    pub fn parse_ended(self, answer: &str, cut_off: bool) -> Result<ParsedAnswer, ToolCallError> {
        self.parse(answer).or_else(|e| {
            cut_off
                .then(|| self.parse_closed_calls(answer))
                .flatten()
                .ok_or(e)
        })
    }

    /// The calls an answer had closed before it was cut off inside a later one (its length
    /// limit): the answer up to the end of its last closed call, the section closed as the
    /// format closes it, parsed. None when no call closed or what closed does not parse. (vLLM's
    /// V3 and Kimi-K2 parsers likewise return the calls they find whole.)
    pub fn parse_closed_calls(self, answer: &str) -> Option<ParsedAnswer> {
        let mut cursor = CallsCursor::default();
        self.partial_calls(answer, &mut cursor);
        let at = cursor.at.filter(|_| cursor.closed > 0)?;
        let mut closed = answer[..at].to_string();
        if self == ToolCallFormat::DeepseekV4 {
            // (The position is after a closed invoke's `</｜DSML｜invoke`.)
            closed.push_str(dsv4::CLOSE_AFTER_INVOKE);
        }
        self.parse(&closed)
            .ok()
            .filter(|p| p.tool_calls.len() == cursor.closed)
    }

    /// Splits an answer (the reasoning removed) into content and tool calls.
    pub fn parse(self, answer: &str) -> Result<ParsedAnswer, ToolCallError> {
        match self {
            ToolCallFormat::DeepseekV3 => parse_v3(answer),
            ToolCallFormat::KimiK2 => parse_kimi(answer),
            ToolCallFormat::DeepseekV4 => {
                let (content, tool_calls) =
                    dsv4::parse_answer(answer).map_err(|e| ToolCallError::Dsml(e.to_string()))?;
                let mut calls = Vec::with_capacity(tool_calls.len());
                for (i, mut c) in tool_calls.into_iter().enumerate() {
                    // Non-string parameters are kept as the model wrote them: check they are JSON.
                    if let Value::String(args) = &c.function.arguments {
                        check_arguments(i, args).map_err(|e| match e {
                            ToolCallError::Call { index, what } => ToolCallError::Call {
                                index,
                                what: format!("`{}`: {what}", c.function.name),
                            },
                            other => other,
                        })?;
                    }
                    c.id.get_or_insert_with(|| format!("call_{i}"));
                    calls.push(c);
                }
                let tool_calls = calls;
                Ok(ParsedAnswer {
                    content,
                    tool_calls,
                })
            }
        }
    }
}

/// A call's arguments as far as they are settled: trimmed as the parser trims them, without
/// the closing fence (`fenced`, V3's), or before `whole` (the call closed) without what
/// trimming or a closing fence could still cut.
fn settle_arguments(args: &str, fenced: bool, whole: bool) -> &str {
    let args = args.trim_start();
    if whole {
        let a = args.trim_end();
        let a = if fenced {
            a.strip_suffix("```").unwrap_or(a)
        } else {
            a
        };
        return a.trim();
    }
    let a = args.trim_end();
    if fenced {
        a.trim_end_matches('`').trim_end()
    } else {
        a
    }
}

/// A call in OpenAI's shape.
fn call(id: String, name: &str, arguments: &str) -> ToolCall {
    ToolCall {
        id: Some(id),
        kind: Some("function".into()),
        function: FunctionCall {
            name: name.into(),
            arguments: Value::String(arguments.into()),
            id: None,
        },
    }
}

/// `arguments` is a JSON object (OpenAI's `arguments` is one, as text).
fn check_arguments(index: usize, arguments: &str) -> Result<(), ToolCallError> {
    // (Read without holding the numbers: `9e999` is JSON, as Python's `json.loads` takes it,
    // though no double holds it.)
    match serde_json::from_str::<serde::de::IgnoredAny>(arguments) {
        Ok(_) if arguments.trim_start().starts_with('{') => Ok(()),
        Ok(_) => Err(ToolCallError::Call {
            index,
            what: format!("the arguments are not a JSON object: {arguments:?}"),
        }),
        Err(e) => Err(ToolCallError::Call {
            index,
            what: format!("the arguments are not valid JSON ({e}): {arguments:?}"),
        }),
    }
}

/// What follows a section's end may only be whitespace and the given end markers.
fn check_tail(rest: &str, markers: &[&str]) -> Result<(), ToolCallError> {
    let mut rest = rest.trim();
    while let Some(m) = markers.iter().find(|m| rest.starts_with(**m)) {
        rest = rest[m.len()..].trim_start();
    }
    if rest.is_empty() {
        Ok(())
    } else {
        Err(ToolCallError::TrailingText(rest.into()))
    }
}

/// One format's markup: the section's and each call's delimiters, what may follow the section
/// (end-of-turn markers), and how a call's body (between its delimiters) reads.
struct Markup {
    /// Spellings of the section's opening and closing markers (the first is the canonical one).
    section_begin: &'static [&'static str],
    section_end: &'static [&'static str],
    call_begin: &'static str,
    call_end: &'static str,
    end_markers: &'static [&'static str],
    call: fn(usize, &str) -> Result<ToolCall, ToolCallError>,
}

impl Markup {
    /// Where the first tool-call section of `answer` begins, and its opening marker's length.
    fn find_section(&self, answer: &str) -> Option<(usize, usize)> {
        self.section_begin
            .iter()
            .filter_map(|b| answer.find(b).map(|at| (at, b.len())))
            .min()
    }
}

const V3_MARKUP: Markup = Markup {
    section_begin: &[V3_CALLS_BEGIN],
    section_end: &[V3_CALLS_END],
    call_begin: V3_CALL_BEGIN,
    call_end: V3_CALL_END,
    end_markers: &[V3_EOS],
    call: v3_call,
};

const KIMI_MARKUP: Markup = Markup {
    section_begin: &[KIMI_SECTION_BEGIN, KIMI_SECTION_BEGIN_1],
    section_end: &[KIMI_SECTION_END, KIMI_SECTION_END_1],
    call_begin: KIMI_CALL_BEGIN,
    call_end: KIMI_CALL_END,
    end_markers: &KIMI_END_MARKERS,
    call: kimi_call,
};

/// [`ToolCallFormat::partial_calls`] for DeepSeek-V4's DSML ([`dsv4::partial_invokes`]).
fn partial_dsml<'a>(answer: &'a str, cursor: &mut CallsCursor) -> Vec<PartialCall<'a>> {
    let Some(start) = cursor.at.or_else(|| dsv4::tool_block_start(answer)) else {
        return Vec::new();
    };
    let (invokes, at) = dsv4::partial_invokes(answer, start);
    cursor.at = Some(at);
    cursor.closed += invokes.iter().filter(|i| i.closed).count();
    invokes
        .into_iter()
        .map(|i| PartialCall {
            id: None,
            name: i.name,
            arguments: Cow::Owned(i.arguments),
            closed: i.closed,
        })
        .collect()
}

fn parse_v3(answer: &str) -> Result<ParsedAnswer, ToolCallError> {
    parse_section(&V3_MARKUP, answer)
}

fn parse_kimi(answer: &str) -> Result<ParsedAnswer, ToolCallError> {
    parse_section(&KIMI_MARKUP, answer)
}

fn parse_section(m: &Markup, answer: &str) -> Result<ParsedAnswer, ToolCallError> {
    let Some((start, begin_len)) = m.find_section(answer) else {
        let mut content = answer;
        while let Some(e) = m.end_markers.iter().find(|e| content.ends_with(**e)) {
            content = &content[..content.len() - e.len()];
        }
        return Ok(ParsedAnswer {
            content: content.into(),
            tool_calls: Vec::new(),
        });
    };
    let content = answer[..start].to_string();
    let mut rest = &answer[start + begin_len..];
    let mut calls = Vec::new();
    loop {
        rest = rest.trim_start();
        if let Some(end) = m.section_end.iter().find(|e| rest.starts_with(**e)) {
            check_tail(&rest[end.len()..], m.end_markers)?;
            break;
        }
        // No closing marker: the model stopped (its end-of-turn token is not in the text, or is
        // the rest) after its last complete call.
        let stopped = rest.is_empty() || check_tail(rest, m.end_markers).is_ok();
        if stopped && !calls.is_empty() {
            break;
        }
        let index = calls.len();
        let Some(r) = rest.strip_prefix(m.call_begin) else {
            if stopped {
                return Err(ToolCallError::Empty);
            }
            return Err(ToolCallError::Call {
                index,
                what: format!(
                    "expected `{}` or `{}`, got {rest:?}",
                    m.call_begin, m.section_end[0]
                ),
            });
        };
        let Some(end) = r.find(m.call_end) else {
            return Err(ToolCallError::Unclosed(m.call_end));
        };
        calls.push((m.call)(index, &r[..end])?);
        rest = &r[end + m.call_end.len()..];
    }
    Ok(ParsedAnswer {
        content,
        tool_calls: calls,
    })
}

/// `function<sep>NAME\n```json\nARGS\n```` (V3/R1) or `NAME<sep>ARGS` (V3.1).
fn v3_call(index: usize, body: &str) -> Result<ToolCall, ToolCallError> {
    let Some((head, tail)) = body.split_once(V3_SEP) else {
        return Err(ToolCallError::Call {
            index,
            what: format!("no `{V3_SEP}` between the name and the arguments: {body:?}"),
        });
    };
    // The fenced form is R1/V3's, whose head is the call's type; V3.1 puts the name there.
    let (name, args) = if head.trim() == "function" {
        let fenced = tail.split_once('\n').and_then(|(name, r)| {
            let args = r.trim_start().strip_prefix("```json")?;
            let args = args.trim_end().strip_suffix("```")?;
            Some((name, args))
        });
        match fenced {
            Some((name, args)) => (name.trim(), args.trim()),
            None => {
                return Err(ToolCallError::Call {
                    index,
                    what: format!(
                        "after `function{V3_SEP}`, expected the name on its own line and the \
                         arguments in a closed ```json fence: {tail:?}"
                    ),
                })
            }
        }
    } else {
        (head.trim(), tail.trim())
    };
    if name.is_empty() {
        return Err(ToolCallError::Call {
            index,
            what: "the function name is empty".into(),
        });
    }
    check_arguments(index, args)?;
    Ok(call(format!("call_{index}"), name, args))
}

/// `functions.NAME:INDEX<|tool_call_argument_begin|>ARGS`; the id is `functions.NAME:INDEX`.
fn kimi_call(index: usize, body: &str) -> Result<ToolCall, ToolCallError> {
    let Some((id, args)) = body.split_once(KIMI_ARGS_BEGIN) else {
        return Err(ToolCallError::Call {
            index,
            what: format!("no `{KIMI_ARGS_BEGIN}` after the call's id: {body:?}"),
        });
    };
    let (id, args) = (id.trim(), args.trim());
    // The name is between the namespace and the last colon.
    let base = id.strip_prefix("functions.").unwrap_or(id);
    let name = match base.rsplit_once(':') {
        Some((n, i)) if i.bytes().all(|b| b.is_ascii_digit()) => n,
        _ => base,
    };
    if name.is_empty() {
        return Err(ToolCallError::Call {
            index,
            what: format!("no function name in the call id {id:?}"),
        });
    }
    check_arguments(index, args)?;
    Ok(call(id.to_string(), name, args))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(p: &ParsedAnswer) -> Vec<(String, String, String)> {
        p.tool_calls
            .iter()
            .map(|c| {
                (
                    c.id.clone().unwrap_or_default(),
                    c.function.name.clone(),
                    c.function.arguments.as_str().unwrap_or("").to_string(),
                )
            })
            .collect()
    }

    const V3_TWO_CALLS: &str = "Let me look.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function\
        <｜tool▁sep｜>get_weather\n```json\n{\"city\": \"Paris `x`\"}  \n```<｜tool▁call▁end｜>\n\
        <｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{\"tz\": \"UTC\"} \
        <｜tool▁call▁end｜><｜tool▁calls▁end｜>";
    // DeepSeek-V4: a string value holding `<`, quotes, a newline and non-ASCII, a value
    // that is JSON text, a call without parameters.
    const V4_TWO_CALLS: &str =
        "Let me check <b>.\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"get_weather\">\n\
                  <｜DSML｜parameter name=\"city\" string=\"true\">Paris <b> \"x\"\n é<\
                  /｜DSML｜parameter>\n<｜DSML｜parameter name=\"days\" string=\"false\">[1, 2]<\
                  /｜DSML｜parameter>\n</｜DSML｜invoke>\n<｜DSML｜invoke name=\"get_time\">\n\
                  </｜DSML｜invoke>\n</｜DSML｜tool_calls>";

    /// Cut off anywhere after its first call closed, an answer's closed calls are what the
    /// whole answer's parse reads for them; before, there are none.
    #[test]
    fn a_cut_answer_keeps_the_calls_it_closed() {
        let kimi = "Sure.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0\
                    <|tool_call_argument_begin|>{\"city\": \"Rome\"}<|tool_call_end|>\
                    <|tool_call_begin|>functions.get_time:1<|tool_call_argument_begin|>{}\
                    <|tool_call_end|><|tool_calls_section_end|>";
        for (format, answer, first_end) in [
            (ToolCallFormat::DeepseekV3, V3_TWO_CALLS, V3_CALL_END),
            (ToolCallFormat::KimiK2, kimi, KIMI_CALL_END),
            (
                ToolCallFormat::DeepseekV4,
                V4_TWO_CALLS,
                "</｜DSML｜invoke>",
            ),
        ] {
            let whole = format.parse(answer).unwrap();
            assert_eq!(whole.tool_calls.len(), 2);
            let closed_at = answer.find(first_end).unwrap() + first_end.len();
            let last_closed_at = answer.rfind(first_end).unwrap() + first_end.len();
            for (cut, _) in answer.char_indices() {
                let got = format.parse_closed_calls(&answer[..cut]);
                // (V4's invoke is closed once `</｜DSML｜invoke` is written, before its `>`.)
                let early = usize::from(format == ToolCallFormat::DeepseekV4);
                let closed = cut + early >= closed_at;
                let Some(got) = got else {
                    assert!(!closed, "{format:?} {cut}: {:?}", &answer[..cut]);
                    continue;
                };
                assert!(closed, "{format:?} {cut}");
                assert_eq!(got.content, whole.content, "{format:?} {cut}");
                let n = 1 + usize::from(cut + early >= last_closed_at);
                assert_eq!(got.tool_calls.len(), n, "{format:?} {cut}");
                assert_eq!(names(&got), names(&whole)[..n], "{format:?} {cut}");
                // A finished answer gets them only when its length limit cut it.
                let text = &answer[..cut];
                if format.parse(text).is_err() {
                    assert_eq!(format.parse_ended(text, true), Ok(got), "{format:?} {cut}");
                    assert!(format.parse_ended(text, false).is_err(), "{format:?} {cut}");
                }
            }
        }
    }

    /// Fed piece by piece, the calls' names and arguments only grow, and once the answer is
    /// whole they are what the parser reads (V3's fenced and V3.1's forms, Kimi-K2's).
    #[test]
    fn partial_calls_grow_into_the_parsed_calls() {
        let v3 = V3_TWO_CALLS;
        let kimi = "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0\
                    <|tool_call_argument_begin|>{\"city\": \"Rome\"}<|tool_call_end|>\
                    <|tool_calls_section_end|>";
        let v4 = V4_TWO_CALLS;
        for (format, answer) in [
            (ToolCallFormat::DeepseekV3, v3),
            (ToolCallFormat::KimiK2, kimi),
            (ToolCallFormat::DeepseekV4, v4),
        ] {
            let parsed = format.parse(answer).unwrap();
            let mut seen: Vec<PartialCall> = Vec::new();
            let cuts: Vec<usize> = answer
                .char_indices()
                .map(|(i, _)| i)
                .chain([answer.len()])
                .collect();
            // Read from the start each time, and resumed from where the last look left off:
            // the same calls.
            let mut cursor = CallsCursor::default();
            let mut done: Vec<PartialCall> = Vec::new();
            for &cut in &cuts {
                let now = format.partial_calls(&answer[..cut], &mut CallsCursor::default());
                let before = cursor.closed;
                let resumed = format.partial_calls(&answer[..cut], &mut cursor);
                done.truncate(before);
                done.extend(resumed);
                assert_eq!(done, now, "{cut}");
                assert!(now.len() >= seen.len(), "{cut}: {now:?} after {seen:?}");
                for (old, new) in seen.iter().zip(&now) {
                    assert_eq!(old.name, new.name, "{cut}");
                    assert!(
                        new.arguments.starts_with(&*old.arguments),
                        "{cut}: {:?} then {:?}",
                        old.arguments,
                        new.arguments
                    );
                }
                for (c, p) in now.iter().zip(&parsed.tool_calls) {
                    assert_eq!(c.name, p.function.name, "{cut}");
                    let whole = p.function.arguments.as_str().unwrap();
                    assert!(whole.starts_with(&*c.arguments), "{cut}: {c:?}");
                }
                seen = now;
            }
            assert_eq!(seen.len(), parsed.tool_calls.len());
            for (c, p) in seen.iter().zip(&parsed.tool_calls) {
                assert!(c.closed);
                assert_eq!(Some(&*c.arguments), p.function.arguments.as_str());
                if format == ToolCallFormat::KimiK2 {
                    assert_eq!(c.id, p.id.as_deref());
                }
            }
        }
        // A `<` is held until it cannot be the value's closing tag.
        let upto = |end: &str| {
            let cut = v4.find(end).unwrap() + end.len();
            let calls =
                ToolCallFormat::DeepseekV4.partial_calls(&v4[..cut], &mut CallsCursor::default());
            calls[0].arguments.to_string()
        };
        // The name as soon as it is closed; a value cut inside its closing tag (a partial
        // character read as U+FFFD at the end) never shows the tag's remains.
        assert_eq!(upto("name=\"get_weather\">"), "{");
        let cut = "\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"f\">\n<｜DSML｜parameter \
                   name=\"d\" string=\"false\">8\t</b> <\n</｜DSML\u{fffd}";
        let c = ToolCallFormat::DeepseekV4.partial_calls(cut, &mut CallsCursor::default());
        assert_eq!((c[0].name, &*c[0].arguments), ("f", "{\"d\": 8\t"));
        assert_eq!(upto("Paris <"), "{\"city\": \"Paris ");
        assert_eq!(upto("Paris <b"), "{\"city\": \"Paris <b");
        assert_eq!(upto("é<"), "{\"city\": \"Paris <b> \\\"x\\\"\\n é");
        assert_eq!(
            upto("string=\"false\">[1"),
            "{\"city\": \"Paris <b> \\\"x\\\"\\n é\", \"days\": [1"
        );
        let v4_calls = ToolCallFormat::DeepseekV4.parse(v4).unwrap().tool_calls;
        assert_eq!(
            v4_calls[0].function.arguments.as_str(),
            Some("{\"city\": \"Paris <b> \\\"x\\\"\\n é\", \"days\": [1, 2]}")
        );
        assert_eq!(v4_calls[1].function.arguments.as_str(), Some("{}"));
    }

    /// Content settles up to where markup begins or may begin, and always agrees with what
    /// the parser makes the content of the whole answer.
    #[test]
    fn content_settles_before_the_markup() {
        let v3 = ToolCallFormat::DeepseekV3;
        assert_eq!(v3.settled_content("Let me look.", 0), (12, false));
        assert_eq!(v3.settled_content("Let me <｜tool", 0), (7, false));
        assert_eq!(
            v3.settled_content("Look<｜tool▁calls▁begin｜>x", 2),
            (4, true)
        );
        assert_eq!(v3.settled_content("a<｜end▁of▁sentence｜>", 0), (1, true));
        let kimi = ToolCallFormat::KimiK2;
        assert_eq!(kimi.settled_content("Hi [EO", 0), (3, false));
        assert_eq!(
            kimi.settled_content("Hi <|tool_call_section_begin|>", 0),
            (3, true)
        );
        let v4 = ToolCallFormat::DeepseekV4;
        assert_eq!(v4.settled_content("Hi\n", 0), (2, false));
        assert_eq!(
            v4.settled_content("Hi\n\n<｜DSML｜tool_calls>", 1),
            (2, true)
        );
        assert_eq!(v4.settled_content("Hi <｜DSML｜invoke", 0), (3, true));
        // Piece by piece, the settled text is always a prefix of the parsed content.
        let v3_answer =
            "Let me look.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>\
                      f\n```json\n{}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>";
        let v4_answer = "Let me <look>.\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"f\">\n\
                         </｜DSML｜invoke>\n</｜DSML｜tool_calls>";
        for (format, answer) in [(v3, v3_answer), (v4, v4_answer)] {
            let content = format.parse(answer).unwrap().content;
            let mut settled = 0;
            for (i, _) in answer.char_indices().skip(1) {
                settled = format.settled_content(&answer[..i], settled).0;
                assert!(content.starts_with(&answer[..settled]), "{i}");
            }
            assert_eq!(&answer[..settled], content);
        }
    }

    #[test]
    fn v3_calls_in_r1_form_and_v31_form() {
        let text = "Let me look.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{\"city\": \"Paris\"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n{}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>";
        let p = ToolCallFormat::DeepseekV3.parse(text).unwrap();
        assert_eq!(p.content, "Let me look.");
        assert_eq!(
            names(&p),
            vec![
                (
                    "call_0".into(),
                    "get_weather".into(),
                    "{\"city\": \"Paris\"}".into()
                ),
                ("call_1".into(), "get_time".into(), "{}".into()),
            ]
        );
        let v31 = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>search<｜tool▁sep｜>{\"q\": \"x\"}<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜>";
        let p = ToolCallFormat::DeepseekV3.parse(v31).unwrap();
        assert_eq!(p.content, "");
        assert_eq!(
            names(&p),
            vec![("call_0".into(), "search".into(), "{\"q\": \"x\"}".into())]
        );
    }

    #[test]
    fn plain_answers_have_no_calls() {
        for f in [
            ToolCallFormat::DeepseekV3,
            ToolCallFormat::KimiK2,
            ToolCallFormat::DeepseekV4,
        ] {
            let p = f.parse("Just text, {\"a\": 1}.").unwrap();
            assert_eq!(p.content, "Just text, {\"a\": 1}.");
            assert!(p.tool_calls.is_empty());
        }
        assert_eq!(
            ToolCallFormat::KimiK2
                .parse("hi<|im_end|>")
                .unwrap()
                .content,
            "hi"
        );
    }

    #[test]
    fn kimi_calls_keep_their_ids() {
        let text = "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{\"city\":\"Paris\"}<|tool_call_end|><|tool_call_begin|>functions.web.search:1<|tool_call_argument_begin|>{\"q\":\"a:b\"}<|tool_call_end|><|tool_calls_section_end|>";
        let p = ToolCallFormat::KimiK2.parse(text).unwrap();
        assert_eq!(
            names(&p),
            vec![
                (
                    "functions.get_weather:0".into(),
                    "get_weather".into(),
                    "{\"city\":\"Paris\"}".into()
                ),
                (
                    "functions.web.search:1".into(),
                    "web.search".into(),
                    "{\"q\":\"a:b\"}".into()
                ),
            ]
        );
    }

    #[test]
    fn malformed_sections_are_named() {
        let v3 = ToolCallFormat::DeepseekV3;
        let cut =
            "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n{\"a\"";
        assert_eq!(
            v3.parse(cut).unwrap_err(),
            ToolCallError::Unclosed(V3_CALL_END)
        );
        // The model stopped after its last call without closing the section: the calls stand.
        let unclosed =
            "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{}<｜tool▁call▁end｜>\n";
        assert_eq!(v3.parse(unclosed).unwrap().tool_calls.len(), 1);
        let eos = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{}<｜tool▁call▁end｜><｜end▁of▁sentence｜>";
        assert_eq!(v3.parse(eos).unwrap().tool_calls.len(), 1);
        // A number no double holds is still JSON (its text is passed on as written).
        let huge = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{\"x\": 9e999, \"y\": [-1e-999]}<｜tool▁call▁end｜><｜tool▁calls▁end｜>";
        let calls = v3.parse(huge).unwrap().tool_calls;
        assert_eq!(
            calls[0].function.arguments,
            "{\"x\": 9e999, \"y\": [-1e-999]}"
        );
        let not_object = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>[1]<｜tool▁call▁end｜><｜tool▁calls▁end｜>";
        assert!(v3
            .parse(not_object)
            .unwrap_err()
            .to_string()
            .contains("not a JSON object"));
        assert_eq!(
            v3.parse("a<｜tool▁calls▁begin｜>").unwrap_err(),
            ToolCallError::Empty
        );
        // A V3.1 call is never read as the fenced form (its head is a name, not `function`).
        let v31 = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>run<｜tool▁sep｜>{\"code\": \"x\"}\n```json\n{}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>";
        assert!(v3
            .parse(v31)
            .unwrap_err()
            .to_string()
            .contains("not valid JSON"));
        let bad = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁call▁begin｜>g<｜tool▁sep｜>{oops}<｜tool▁call▁end｜><｜tool▁calls▁end｜>";
        let e = v3.parse(bad).unwrap_err().to_string();
        assert!(
            e.starts_with("tool call 1: the arguments are not valid JSON"),
            "{e}"
        );
        let fence = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>";
        assert!(v3
            .parse(fence)
            .unwrap_err()
            .to_string()
            .contains("closed ```json fence"));
        // Whitespace and CRLF around the fence are the model's to choose.
        let loose = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\r\n```json\r\n{\"a\": 1}\r\n```\n<｜tool▁call▁end｜><｜tool▁calls▁end｜>";
        assert_eq!(
            names(&v3.parse(loose).unwrap()),
            vec![("call_0".into(), "f".into(), "{\"a\": 1}".into())]
        );
        let list = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>[1]<｜tool▁call▁end｜><｜tool▁calls▁end｜>";
        assert!(v3
            .parse(list)
            .unwrap_err()
            .to_string()
            .contains("not a JSON object"));
        let trailing = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>and more";
        assert_eq!(
            v3.parse(trailing).unwrap_err(),
            ToolCallError::TrailingText("and more".into())
        );
        let no_sep = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f {}<｜tool▁call▁end｜><｜tool▁calls▁end｜>";
        assert!(v3
            .parse(no_sep)
            .unwrap_err()
            .to_string()
            .contains("tool call 0: no `<｜tool▁sep｜>`"));

        let kimi = ToolCallFormat::KimiK2;
        let cut = "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{\"a\"";
        assert_eq!(
            kimi.parse(cut).unwrap_err(),
            ToolCallError::Unclosed(KIMI_CALL_END)
        );
        let stopped = "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{}<|tool_call_end|><|im_end|>";
        assert_eq!(kimi.parse(stopped).unwrap().tool_calls.len(), 1);
        let no_name = "<|tool_calls_section_begin|><|tool_call_begin|>functions.:0<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|>";
        assert!(kimi
            .parse(no_name)
            .unwrap_err()
            .to_string()
            .contains("no function name"));
        let stray = "<|tool_calls_section_begin|>hello<|tool_calls_section_end|>";
        assert!(kimi
            .parse(stray)
            .unwrap_err()
            .to_string()
            .starts_with("tool call 0: expected"));
    }

    #[test]
    fn kimi_variants() {
        let kimi = ToolCallFormat::KimiK2;
        // The singular section marker, an id without namespace, an empty index.
        let text = "<|tool_call_section_begin|><|tool_call_begin|>lookup:3<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_call_begin|>functions.f:<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_call_section_end|>";
        let p = kimi.parse(text).unwrap();
        assert_eq!(
            names(&p),
            vec![
                ("lookup:3".into(), "lookup".into(), "{}".into()),
                ("functions.f:".into(), "f".into(), "{}".into()),
            ]
        );
    }

    #[test]
    fn markup_is_noticed_even_when_malformed() {
        assert!(ToolCallFormat::DeepseekV3.mentions_tool_calls("x<｜tool▁call▁begin｜>"));
        assert!(ToolCallFormat::KimiK2.mentions_tool_calls("<|tool_call_begin|>"));
        assert!(ToolCallFormat::DeepseekV4.mentions_tool_calls("\n<｜DSML｜tool_calls>"));
        assert!(!ToolCallFormat::DeepseekV4.mentions_tool_calls("plain"));
    }

    #[test]
    fn v4_dsml_calls_get_ids() {
        let text = "Checking.\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"get_weather\">\n<｜DSML｜parameter name=\"city\" string=\"true\">Paris</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>";
        let p = ToolCallFormat::DeepseekV4.parse(text).unwrap();
        assert_eq!(p.content, "Checking.");
        assert_eq!(
            names(&p),
            vec![(
                "call_0".into(),
                "get_weather".into(),
                "{\"city\": \"Paris\"}".into()
            )]
        );
        let cut = "Checking.\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"get_weather\">\n";
        assert!(ToolCallFormat::DeepseekV4.parse(cut).is_err());
        // A non-string parameter is kept as written, so it must be JSON.
        let bad = "\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"f\">\n<｜DSML｜parameter name=\"n\" string=\"false\">abc</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>";
        let e = ToolCallFormat::DeepseekV4
            .parse(bad)
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("tool call 0: `f`: the arguments are not valid JSON"),
            "{e}"
        );
    }
}
