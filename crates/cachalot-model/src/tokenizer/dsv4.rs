//! DeepSeek-V4's chat format: the prompt encoder, its tokenizer-wrapper options, and the parser of
//! a completion (spec `deepseek-v4.md` §5 "Tokenizer and prompt encoding", checked as §6 item 6).
//!
//! V4 ships no Jinja chat template; DeepSeek's `encoding_dsv4.py` ([ENC]) defines the format in
//! code, and this module restates it in Rust. The fixed prompt texts (the tools section, the
//! response-format header, the maximum-reasoning-effort preamble) are DeepSeek's own words,
//! reproduced byte for byte. `tests/dsv4.rs` compares every rendering with the seed's encoder
//! (fixtures/text/dsv4_cases.json, made by tools/text/make_dsv4_fixtures.py).
//!
//! Where [ENC] would crash or silently accept nonsense, this module returns a [`Dsv4Error`]
//! instead; where it renders a value, so does this module. Deliberate differences:
//! - Unknown roles and invalid `task` names are errors even where [ENC] would skip them
//!   (a message dropped by drop_thinking, a transition that is not written).
//! - A `tool` message with `"content": null` renders as an empty result (Python writes `None`).
//! - Content that is a list of parts is accepted only in `tool` messages, as in [ENC]; elsewhere
//!   it is an error rather than Python's `str(list)`.
//! - The completion parser rejects a tool-call block that is cut off (no closing
//!   `</｜DSML｜invoke>` / `</｜DSML｜tool_calls>`), which [ENC]'s parser lets through.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use super::chat::python_json;

pub const BOS: &str = "<｜begin▁of▁sentence｜>";
pub const EOS: &str = "<｜end▁of▁sentence｜>";
pub const THINK_START: &str = "<think>";
pub const THINK_END: &str = "</think>";
/// The tool-markup token; it has no angle brackets of its own (`<｜DSML｜invoke ...>`).
pub const DSML: &str = "｜DSML｜";
pub const USER: &str = "<｜User｜>";
pub const ASSISTANT: &str = "<｜Assistant｜>";
pub const LATEST_REMINDER: &str = "<｜latest_reminder｜>";

/// Every special-token string the format writes, with the ids of DeepSeek-V4's tokenizer
/// (spec §5).
pub const SPECIAL_TOKENS: [(&str, u32); 14] = [
    (BOS, 0),
    (EOS, 1),
    (USER, 128803),
    (ASSISTANT, 128804),
    (THINK_START, 128821),
    (THINK_END, 128822),
    (DSML, 128825),
    (LATEST_REMINDER, 128828),
    ("<｜action｜>", 128829),
    ("<｜query｜>", 128830),
    ("<｜authority｜>", 128831),
    ("<｜domain｜>", 128832),
    ("<｜title｜>", 128836),
    ("<｜read_url｜>", 128845),
];

/// Written right after BOS in thinking mode with maximum reasoning effort ([ENC]
/// `REASONING_EFFORT_MAX`).
pub const REASONING_EFFORT_MAX: &str = "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n\
You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root cause, rigorously stress-testing your logic against all potential paths, edge cases, and adversarial scenarios.\n\
Explicitly write out your entire deliberation process, documenting every intermediate step, considered alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n";

/// [ENC] `TOOLS_TEMPLATE` with its tokens filled in, up to where the tool schemas go.
const TOOLS_HEAD: &str = "## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a \"<｜DSML｜tool_calls>\" block like the following:

<｜DSML｜tool_calls>
<｜DSML｜invoke name=\"$TOOL_NAME\">
<｜DSML｜parameter name=\"$PARAMETER_NAME\" string=\"true|false\">$PARAMETER_VALUE</｜DSML｜parameter>
...
</｜DSML｜invoke>
<｜DSML｜invoke name=\"$TOOL_NAME2\">
...
</｜DSML｜invoke>
</｜DSML｜tool_calls>

String parameters should be specified as is and set `string=\"true\"`. For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set `string=\"false\"`.

If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning inside <think>...</think> BEFORE any tool calls or final response.

Otherwise, output directly after </think> with tool calls or final response.

### Available Tool Schemas

";

/// The rest of `TOOLS_TEMPLATE`, after the schemas.
const TOOLS_TAIL: &str =
    "\n\nYou MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n";

/// [ENC] `response_format_template`, before the schema JSON.
const RESPONSE_FORMAT_HEAD: &str =
    "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n";

/// Opens the tool-call block of an assistant turn (and ends its content when parsing).
const TOOL_CALLS_START: &str = "\n\n<｜DSML｜tool_calls";
const TOOL_CALLS_END: &str = "</｜DSML｜tool_calls>";
const INVOKE_START: &str = "<｜DSML｜invoke";
const INVOKE_END: &str = "</｜DSML｜invoke";
/// What closes a tool-call block after an invoke's `</｜DSML｜invoke`.
pub(crate) const CLOSE_AFTER_INVOKE: &str = ">\n</｜DSML｜tool_calls>";
const PARAMETER_START: &str = "<｜DSML｜parameter";
/// What a parameter's value runs up to ([ENC] reads to this, then expects `>` and a newline).
const PARAMETER_END: &str = "/｜DSML｜parameter";

/// One message, OpenAI-style, with V4's extra fields. Deserialises from the JSON a chat API
/// receives; unknown fields (such as `name`) are ignored.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct V4Message {
    /// `system`, `user`, `developer`, `assistant`, `tool` or `latest_reminder`.
    pub role: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub content: Option<Content>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCall>>,
    /// For `tool` messages: the id of the call this answers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    /// OpenAI-style tool definitions (`{"type": "function", "function": {...}}`), rendered on
    /// `system` and `developer` messages.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tools: Option<Vec<Value>>,
    /// A JSON schema the answer must follow (`system` and `developer` messages).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub response_format: Option<Value>,
    /// A quick-instruction task: `action`, `query`, `authority`, `domain`, `title`, `read_url`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub task: Option<String>,
    /// An assistant turn left open (no EOS), to be continued by the model.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub wo_eos: bool,
}

impl V4Message {
    pub fn new(role: &str, content: impl Into<String>) -> V4Message {
        V4Message {
            role: role.to_string(),
            content: Some(Content::Text(content.into())),
            ..V4Message::default()
        }
    }

    /// An assistant turn as the parser returns it.
    pub fn assistant(content: &str, reasoning: &str, tool_calls: Vec<ToolCall>) -> V4Message {
        V4Message {
            role: "assistant".into(),
            content: Some(Content::Text(content.into())),
            reasoning_content: Some(reasoning.into()),
            tool_calls: Some(tool_calls),
            ..V4Message::default()
        }
    }
}

/// Message content: text, or (in `tool` messages) a list of parts.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Parts(Vec<ContentPart>),
}

/// One part of a list content. Parts other than `text` render as `[Unsupported <type>]`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ContentPart {
    #[serde(rename = "type", default)]
    pub kind: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub text: Option<String>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ToolCall {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    #[serde(rename = "type", default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
    pub function: FunctionCall,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FunctionCall {
    pub name: String,
    /// A JSON object as a string (OpenAI's form). A string that is not JSON, or a non-string
    /// value, is passed as a single parameter named `arguments`, as [ENC] does.
    pub arguments: Value,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
}

impl ToolCall {
    pub fn function(name: &str, arguments: impl Into<String>) -> ToolCall {
        ToolCall {
            id: None,
            kind: Some("function".into()),
            function: FunctionCall {
                name: name.into(),
                arguments: Value::String(arguments.into()),
                id: None,
            },
        }
    }
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ThinkingMode {
    #[default]
    Chat,
    Thinking,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReasoningEffort {
    High,
    Max,
}

/// The arguments of [ENC] `encode_messages` (without `context`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EncodeOptions {
    pub thinking_mode: ThinkingMode,
    /// Drop the reasoning of assistant turns (and the developer messages) before the last
    /// user/developer message, in thinking mode. Forced off when any message carries tools.
    pub drop_thinking: bool,
    pub add_bos: bool,
    pub reasoning_effort: Option<ReasoningEffort>,
}

impl Default for EncodeOptions {
    fn default() -> Self {
        EncodeOptions {
            thinking_mode: ThinkingMode::Chat,
            drop_thinking: true,
            add_bos: true,
            reasoning_effort: None,
        }
    }
}

impl EncodeOptions {
    /// The options the tokenizer wrapper (`tokenizer.py` of [ENC]'s folder) derives from
    /// `apply_chat_template`'s keyword arguments: `thinking` or `enable_thinking` select thinking
    /// mode; `reasoning_effort` "none" forces chat mode, "max"/"xhigh" mean max, any other string
    /// high, a non-string nothing; `drop_thinking` defaults to true. Values count as Python
    /// truth values.
    pub fn from_kwargs(kwargs: &Map<String, Value>) -> EncodeOptions {
        let flag = |k: &str| kwargs.get(k).is_some_and(truthy);
        let mut thinking_mode = if flag("thinking") || flag("enable_thinking") {
            ThinkingMode::Thinking
        } else {
            ThinkingMode::Chat
        };
        let reasoning_effort = match kwargs.get("reasoning_effort") {
            Some(Value::String(s)) if s == "none" => {
                thinking_mode = ThinkingMode::Chat;
                None
            }
            Some(Value::String(s)) if s == "max" || s == "xhigh" => Some(ReasoningEffort::Max),
            Some(Value::String(_)) => Some(ReasoningEffort::High),
            _ => None,
        };
        EncodeOptions {
            thinking_mode,
            drop_thinking: kwargs.get("drop_thinking").is_none_or(truthy),
            add_bos: true,
            reasoning_effort,
        }
    }
}

/// Python's truth value of a JSON value.
fn truthy(v: &Value) -> bool {
    match v {
        Value::Null => false,
        Value::Bool(b) => *b,
        Value::Number(n) => n.as_f64() != Some(0.0),
        Value::String(s) => !s.is_empty(),
        Value::Array(a) => !a.is_empty(),
        Value::Object(o) => !o.is_empty(),
    }
}

/// Why a conversation cannot be encoded. `index` is the message's position in the list given.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Dsv4Error {
    #[error("messages[{index}]: unknown role `{role}` (DeepSeek-V4 knows system, user, developer, assistant, tool, latest_reminder)")]
    UnknownRole { index: usize, role: String },
    #[error("messages[{index}]: unknown task `{task}` (valid: action, query, authority, domain, title, read_url)")]
    InvalidTask { index: usize, task: String },
    #[error("messages[{index}]: a developer message needs non-empty text content")]
    EmptyDeveloper { index: usize },
    #[error("messages[{index}]: the content of a `{role}` message must be a string (lists of parts are only rendered in tool results)")]
    ContentNotText { index: usize, role: String },
    #[error("messages[{index}].tools[{tool}]: no `function` object (tools are OpenAI-style: {{\"type\": \"function\", \"function\": {{\"name\": ...}}}})")]
    ToolWithoutFunction { index: usize, tool: usize },
    #[error("messages[{index}].tool_calls[{call}] (`{name}`): the arguments are JSON but not an object; DeepSeek-V4 writes one parameter per key")]
    ArgumentsNotObject {
        index: usize,
        call: usize,
        name: String,
    },
    #[error("invalid chat request: {0}")]
    Request(String),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Role {
    System,
    User,
    Developer,
    Assistant,
    LatestReminder,
}

const TASKS: [&str; 6] = [
    "action",
    "query",
    "authority",
    "domain",
    "title",
    "read_url",
];

/// A message after [ENC]'s pre-processing: tool messages folded into user turns.
struct Turn<'a> {
    role: Role,
    /// Position in the caller's list (of the first message merged into it).
    index: usize,
    content: Option<&'a Content>,
    /// User turns: text blocks and tool results, joined with a blank line.
    blocks: Vec<Block<'a>>,
    reasoning: Option<&'a str>,
    tool_calls: &'a [ToolCall],
    tools: &'a [Value],
    response_format: Option<&'a Value>,
    task: Option<&'static str>,
    wo_eos: bool,
}

enum Block<'a> {
    Text(&'a str),
    ToolResult { id: &'a str, content: String },
}

impl Turn<'_> {
    fn text(&self) -> Result<&str, Dsv4Error> {
        match self.content {
            None => Ok(""),
            Some(Content::Text(s)) => Ok(s),
            Some(Content::Parts(_)) => Err(Dsv4Error::ContentNotText {
                index: self.index,
                role: role_name(self.role).into(),
            }),
        }
    }
}

fn role_name(r: Role) -> &'static str {
    match r {
        Role::System => "system",
        Role::User => "user",
        Role::Developer => "developer",
        Role::Assistant => "assistant",
        Role::LatestReminder => "latest_reminder",
    }
}

fn parse_task(index: usize, task: &Option<String>) -> Result<Option<&'static str>, Dsv4Error> {
    match task {
        None => Ok(None),
        Some(t) => TASKS
            .iter()
            .find(|v| **v == t.as_str())
            .map(|v| Some(*v))
            .ok_or_else(|| Dsv4Error::InvalidTask {
                index,
                task: t.clone(),
            }),
    }
}

/// A tool result's text: a string as is; a list of parts joined with a blank line, non-text
/// parts as `[Unsupported <type>]`.
fn tool_result_text(content: Option<&Content>) -> String {
    match content {
        None => String::new(),
        Some(Content::Text(s)) => s.clone(),
        Some(Content::Parts(parts)) => parts
            .iter()
            .map(|p| match p.kind.as_deref() {
                Some("text") => p.text.clone().unwrap_or_default(),
                other => format!("[Unsupported {}]", other.unwrap_or("None")),
            })
            .collect::<Vec<_>>()
            .join("\n\n"),
    }
}

/// [ENC] `merge_tool_messages`: each tool message becomes a tool-result block of a user turn,
/// joining the user turn before it; a user message joins the user turn before it too, unless
/// that one carries a task (and then loses its own task, as in [ENC]).
fn merge(messages: &[V4Message]) -> Result<Vec<Turn<'_>>, Dsv4Error> {
    let mut turns: Vec<Turn> = Vec::new();
    for (index, m) in messages.iter().enumerate() {
        let base = |role| Turn {
            role,
            index,
            content: m.content.as_ref(),
            blocks: Vec::new(),
            reasoning: m.reasoning_content.as_deref(),
            tool_calls: m.tool_calls.as_deref().unwrap_or(&[]),
            tools: m.tools.as_deref().unwrap_or(&[]),
            response_format: m.response_format.as_ref(),
            task: None,
            wo_eos: m.wo_eos,
        };
        let last_is_user = turns.last().is_some_and(|t| t.role == Role::User);
        match m.role.as_str() {
            "tool" => {
                let block = Block::ToolResult {
                    id: m.tool_call_id.as_deref().unwrap_or(""),
                    content: tool_result_text(m.content.as_ref()),
                };
                match turns.last_mut() {
                    Some(t) if last_is_user => t.blocks.push(block),
                    _ => {
                        let turn = Turn {
                            blocks: vec![block],
                            ..user_only(base(Role::User))
                        };
                        turns.push(turn);
                    }
                }
            }
            "user" => {
                let text = match &m.content {
                    None => "",
                    Some(Content::Text(s)) => s.as_str(),
                    Some(Content::Parts(_)) => {
                        return Err(Dsv4Error::ContentNotText {
                            index,
                            role: "user".into(),
                        })
                    }
                };
                match turns.last_mut() {
                    Some(t) if last_is_user && t.task.is_none() => t.blocks.push(Block::Text(text)),
                    _ => {
                        let task = parse_task(index, &m.task)?;
                        turns.push(Turn {
                            blocks: vec![Block::Text(text)],
                            task,
                            ..user_only(base(Role::User))
                        })
                    }
                }
            }
            other => {
                let role = match other {
                    "system" => Role::System,
                    "developer" => Role::Developer,
                    "assistant" => Role::Assistant,
                    "latest_reminder" => Role::LatestReminder,
                    _ => {
                        return Err(Dsv4Error::UnknownRole {
                            index,
                            role: other.into(),
                        })
                    }
                };
                turns.push(Turn {
                    task: parse_task(index, &m.task)?,
                    ..base(role)
                });
            }
        }
    }
    Ok(turns)
}

/// A user turn keeps only its blocks, task and `wo_eos` ([ENC] rebuilds user messages).
fn user_only(t: Turn<'_>) -> Turn<'_> {
    Turn {
        reasoning: None,
        tool_calls: &[],
        tools: &[],
        response_format: None,
        ..t
    }
}

/// The id a tool call is answered by: its own `id`, else `function.id`.
fn call_id(c: &ToolCall) -> &str {
    match c.id.as_deref() {
        Some(id) if !id.is_empty() => id,
        _ => c.function.id.as_deref().unwrap_or(""),
    }
}

/// [ENC] `sort_tool_results_by_call_order`: the tool results of a user turn, in the order of the
/// calls of the latest assistant turn with calls (unknown ids count as position 0; the sort is
/// stable), in the slots tool results held.
fn sort_tool_results(turns: &mut [Turn<'_>]) {
    let mut order: Vec<(&str, usize)> = Vec::new();
    for t in turns.iter_mut() {
        if t.role == Role::Assistant && !t.tool_calls.is_empty() {
            order.clear();
            for (i, c) in t.tool_calls.iter().enumerate() {
                let id = call_id(c);
                if !id.is_empty() {
                    // A repeated id keeps its last position, as a Python dict would.
                    order.retain(|(k, _)| *k != id);
                    order.push((id, i));
                }
            }
        } else if t.role == Role::User {
            let slots: Vec<usize> = (0..t.blocks.len())
                .filter(|&i| matches!(t.blocks[i], Block::ToolResult { .. }))
                .collect();
            if slots.len() < 2 || order.is_empty() {
                continue;
            }
            let rank = |b: &Block| match b {
                Block::ToolResult { id, .. } => {
                    order.iter().find(|(k, _)| k == id).map_or(0, |(_, i)| *i)
                }
                Block::Text(_) => 0,
            };
            let mut results: Vec<Block> = Vec::with_capacity(slots.len());
            for &s in slots.iter().rev() {
                results.push(t.blocks.remove(s));
            }
            results.reverse();
            results.sort_by_key(|b| rank(b));
            for (&s, b) in slots.iter().zip(results) {
                t.blocks.insert(s, b);
            }
        }
    }
}

fn last_user_index(turns: &[Turn<'_>]) -> Option<usize> {
    turns
        .iter()
        .rposition(|t| matches!(t.role, Role::User | Role::Developer))
}

/// [ENC] `encode_messages`: the prompt text of a conversation.
pub fn encode_messages(messages: &[V4Message], opts: &EncodeOptions) -> Result<String, Dsv4Error> {
    encode_messages_with_context(&[], messages, opts)
}

/// [ENC]'s `encode_messages(messages, context=…)`: the text that continues the already-encoded
/// `context` with `messages` (no BOS after a context; a multi-turn client encodes each new turn
/// alone and appends it). The whole conversation decides what is rendered (tool results sorted
/// by the calls before them, the last user message for dropped thinking), as [ENC] does: each
/// part is merged on its own, and with dropped thinking the rendered tail is the whole
/// conversation's turns past as many as the context keeps on its own.
pub fn encode_messages_with_context(
    context: &[V4Message],
    messages: &[V4Message],
    opts: &EncodeOptions,
) -> Result<String, Dsv4Error> {
    let mut turns = merge(context)?;
    let context_turns = turns.len();
    turns.extend(merge(messages)?.into_iter().map(|mut t| {
        t.index += context.len();
        t
    }));
    sort_tool_results(&mut turns);
    let drop_thinking = opts.drop_thinking && !turns.iter().any(|t| !t.tools.is_empty());
    let thinking = opts.thinking_mode == ThinkingMode::Thinking;
    let mut skip = context_turns;
    if thinking && drop_thinking {
        skip = kept_after_dropping(&turns[..context_turns]);
        turns = drop_thinking_turns(turns);
    }
    let mut prompt = String::new();
    if opts.add_bos && context.is_empty() {
        prompt.push_str(BOS);
    }
    let r = Renderer {
        turns: &turns,
        last_user: last_user_index(&turns),
        thinking,
        drop_thinking,
    };
    for i in skip..turns.len() {
        if i == 0 && thinking && opts.reasoning_effort == Some(ReasoningEffort::Max) {
            prompt.push_str(REASONING_EFFORT_MAX);
        }
        r.message(i, &mut prompt)?;
        r.transition(i, &mut prompt);
    }
    Ok(prompt)
}

/// Thinking mode's dropping: before the last user/developer turn, assistants lose their
/// reasoning and developer turns are removed.
fn drop_thinking_turns(turns: Vec<Turn<'_>>) -> Vec<Turn<'_>> {
    let Some(last) = last_user_index(&turns) else {
        return turns;
    };
    let mut kept = Vec::with_capacity(turns.len());
    for (i, mut t) in turns.into_iter().enumerate() {
        match t.role {
            _ if i >= last => kept.push(t),
            Role::User | Role::System | Role::LatestReminder => kept.push(t),
            Role::Assistant => {
                t.reasoning = None;
                kept.push(t);
            }
            Role::Developer => {}
        }
    }
    kept
}

/// How many of `turns` [`drop_thinking_turns`] keeps (judged by their own last user turn).
fn kept_after_dropping(turns: &[Turn<'_>]) -> usize {
    match last_user_index(turns) {
        None => turns.len(),
        Some(last) => turns
            .iter()
            .enumerate()
            .filter(|(i, t)| *i >= last || t.role != Role::Developer)
            .count(),
    }
}

/// The tokenizer wrapper's `apply_chat_template(conversation, tools, tokenize=False, **kwargs)`:
/// `tools`, when non-empty, go on a system message put first; `kwargs` as in
/// [`EncodeOptions::from_kwargs`]. Tokenise the result with `add_special_tokens = false`
/// ([`super::Tokenizer::encode`] does).
pub fn apply_chat_template(
    messages: &[V4Message],
    tools: Option<&[Value]>,
    kwargs: &Map<String, Value>,
) -> Result<String, Dsv4Error> {
    let opts = EncodeOptions::from_kwargs(kwargs);
    match tools {
        Some(tools) if !tools.is_empty() => {
            let mut all = Vec::with_capacity(messages.len() + 1);
            all.push(V4Message {
                role: "system".into(),
                tools: Some(tools.to_vec()),
                ..V4Message::default()
            });
            all.extend_from_slice(messages);
            encode_messages(&all, &opts)
        }
        _ => encode_messages(messages, &opts),
    }
}

/// [`apply_chat_template`] on JSON: `messages` a list of OpenAI-style messages, `tools` a list of
/// tool definitions.
pub fn apply_chat_template_json(
    messages: &Value,
    tools: Option<&Value>,
    kwargs: &Map<String, Value>,
) -> Result<String, Dsv4Error> {
    let list = messages
        .as_array()
        .ok_or_else(|| Dsv4Error::Request("`messages` must be a list".into()))?;
    let mut parsed = Vec::with_capacity(list.len());
    for (i, m) in list.iter().enumerate() {
        parsed.push(
            V4Message::deserialize(m)
                .map_err(|e| Dsv4Error::Request(format!("messages[{i}]: {e}")))?,
        );
    }
    let tools = match tools {
        None | Some(Value::Null) => None,
        Some(Value::Array(t)) => Some(t.as_slice()),
        Some(_) => return Err(Dsv4Error::Request("`tools` must be a list".into())),
    };
    apply_chat_template(&parsed, tools, kwargs)
}

struct Renderer<'t, 'a> {
    turns: &'t [Turn<'a>],
    last_user: Option<usize>,
    thinking: bool,
    drop_thinking: bool,
}

impl Renderer<'_, '_> {
    /// Whether message `i` comes after the last user/developer message (`i > last_user_idx` in
    /// [ENC], with -1 when there is none).
    fn after_last_user(&self, i: usize) -> bool {
        self.last_user.is_none_or(|l| i > l)
    }

    fn message(&self, i: usize, out: &mut String) -> Result<(), Dsv4Error> {
        let t = &self.turns[i];
        let tools = tool_functions(t)?;
        match t.role {
            Role::System => {
                out.push_str(t.text()?);
                self.tools_and_format(t, &tools, out);
            }
            Role::Developer => {
                let text = t.text()?;
                if text.is_empty() {
                    return Err(Dsv4Error::EmptyDeveloper { index: t.index });
                }
                out.push_str(USER);
                out.push_str(text);
                self.tools_and_format(t, &tools, out);
            }
            Role::User => {
                out.push_str(USER);
                for (k, b) in t.blocks.iter().enumerate() {
                    if k > 0 {
                        out.push_str("\n\n");
                    }
                    match b {
                        Block::Text(s) => out.push_str(s),
                        Block::ToolResult { content, .. } => {
                            out.push_str("<tool_result>");
                            out.push_str(content);
                            out.push_str("</tool_result>");
                        }
                    }
                }
            }
            Role::LatestReminder => {
                out.push_str(LATEST_REMINDER);
                out.push_str(t.text()?);
            }
            Role::Assistant => {
                let prev_has_task = i > 0 && self.turns[i - 1].task.is_some();
                if self.thinking
                    && !prev_has_task
                    && (!self.drop_thinking || self.after_last_user(i))
                {
                    out.push_str(t.reasoning.unwrap_or(""));
                    out.push_str(THINK_END);
                }
                out.push_str(t.text()?);
                if !t.tool_calls.is_empty() {
                    tool_calls_block(t, out)?;
                }
                if !t.wo_eos {
                    out.push_str(EOS);
                }
            }
        }
        Ok(())
    }

    fn tools_and_format(&self, t: &Turn<'_>, tools: &[&Value], out: &mut String) {
        if !tools.is_empty() {
            out.push_str("\n\n");
            out.push_str(TOOLS_HEAD);
            let schemas: Vec<String> = tools.iter().map(|f| python_json(f)).collect();
            out.push_str(&schemas.join("\n"));
            out.push_str(TOOLS_TAIL);
        }
        if let Some(rf) = t.response_format.filter(|v| truthy(v)) {
            out.push_str("\n\n");
            out.push_str(RESPONSE_FORMAT_HEAD);
            out.push_str(&python_json(rf));
        }
    }

    /// What follows message `i` when the model is to answer it (or it opens a task).
    fn transition(&self, i: usize, out: &mut String) {
        if let Some(next) = self.turns.get(i + 1) {
            if !matches!(next.role, Role::Assistant | Role::LatestReminder) {
                return;
            }
        }
        let t = &self.turns[i];
        match t.task {
            Some("action") => {
                out.push_str(ASSISTANT);
                out.push_str(if self.thinking {
                    THINK_START
                } else {
                    THINK_END
                });
                out.push_str("<｜action｜>");
            }
            Some(task) => {
                out.push_str("<｜");
                out.push_str(task);
                out.push_str("｜>");
            }
            None if matches!(t.role, Role::User | Role::Developer) => {
                out.push_str(ASSISTANT);
                let open =
                    self.thinking && (!self.drop_thinking || self.last_user.is_none_or(|l| i >= l));
                out.push_str(if open { THINK_START } else { THINK_END });
            }
            None => {}
        }
    }
}

/// The `function` objects of a message's tools.
fn tool_functions<'a>(t: &Turn<'a>) -> Result<Vec<&'a Value>, Dsv4Error> {
    t.tools
        .iter()
        .enumerate()
        .map(|(k, tool)| {
            tool.get("function").ok_or(Dsv4Error::ToolWithoutFunction {
                index: t.index,
                tool: k,
            })
        })
        .collect()
}

/// `\n\n<｜DSML｜tool_calls>\n` + invokes + `\n</｜DSML｜tool_calls>`.
fn tool_calls_block(t: &Turn<'_>, out: &mut String) -> Result<(), Dsv4Error> {
    out.push_str("\n\n<｜DSML｜tool_calls>\n");
    for (k, c) in t.tool_calls.iter().enumerate() {
        if k > 0 {
            out.push('\n');
        }
        let args = match &c.function.arguments {
            Value::String(s) => match serde_json::from_str::<Value>(s) {
                Ok(v) => v,
                Err(_) => single_argument(c.function.arguments.clone()),
            },
            other => single_argument(other.clone()),
        };
        let Value::Object(args) = args else {
            return Err(Dsv4Error::ArgumentsNotObject {
                index: t.index,
                call: k,
                name: c.function.name.clone(),
            });
        };
        out.push_str("<｜DSML｜invoke name=\"");
        out.push_str(&c.function.name);
        out.push_str("\">\n");
        for (j, (key, v)) in args.iter().enumerate() {
            if j > 0 {
                out.push('\n');
            }
            let (is_str, value) = match v {
                Value::String(s) => ("true", s.clone()),
                other => ("false", python_json(other)),
            };
            out.push_str(&format!(
                "<｜DSML｜parameter name=\"{key}\" string=\"{is_str}\">{value}</｜DSML｜parameter>"
            ));
        }
        out.push_str("\n</｜DSML｜invoke>");
    }
    out.push_str("\n</｜DSML｜tool_calls>");
    Ok(())
}

/// Arguments that are not a JSON object string become one parameter named `arguments`.
fn single_argument(v: Value) -> Value {
    let mut m = Map::new();
    m.insert("arguments".into(), v);
    Value::Object(m)
}

/// Why a completion is not a well-formed DeepSeek-V4 assistant turn.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum CompletionError {
    #[error("the reasoning is not closed: no `</think>` before the answer")]
    MissingThinkEnd,
    #[error("the answer does not end with `<｜end▁of▁sentence｜>`")]
    MissingEos,
    #[error("unexpected text after the end of the turn: {0:?}")]
    TrailingText(String),
    #[error("malformed tool-call block: {0}")]
    ToolCallFormat(String),
    #[error("parameter `{param}` given twice in the call of `{tool}`")]
    DuplicateParameter { tool: String, param: String },
    #[error("special token `{0}` inside the reasoning or the answer")]
    SpecialTokenInContent(&'static str),
}

/// The next of `stops` in `text` from `at`: (text before it, which stop, position after it);
/// with no stop, the rest of the text.
fn read_until<'t>(
    text: &'t str,
    at: usize,
    stops: &[&'static str],
) -> (&'t str, Option<&'static str>, usize) {
    let found = stops
        .iter()
        .filter_map(|s| text[at..].find(s).map(|p| (at + p, *s)))
        .min_by_key(|(p, _)| *p);
    match found {
        Some((p, s)) => (&text[at..p], Some(s), p + s.len()),
        None => (&text[at..], None, text.len()),
    }
}

/// `s` with one final `\n` removed where the pattern's `$` may match before it (Python's `$`
/// matches at the end and before a final newline), tried in that order.
fn ends<'s>(s: &'s str, suffix: &str) -> Option<&'s str> {
    s.strip_suffix(suffix)
        .or_else(|| s.strip_suffix('\n')?.strip_suffix(suffix))
}

/// [ENC] `parse_message_from_completion_text`: the model's text for one assistant turn
/// (starting after the prompt's `<｜Assistant｜><think>` or `</think>`), as reasoning (thinking
/// mode: up to `</think>`), content (up to EOS or the tool-call block) and tool calls with their
/// arguments as a JSON object string. The text must end with EOS unless it ends with tool calls.
pub fn parse_completion(text: &str, mode: ThinkingMode) -> Result<V4Message, CompletionError> {
    let mut at = 0;
    let mut reasoning = "";
    if mode == ThinkingMode::Thinking {
        let (r, stop, next) = read_until(text, at, &[THINK_END, TOOL_CALLS_START]);
        if stop != Some(THINK_END) {
            return Err(CompletionError::MissingThinkEnd);
        }
        reasoning = r;
        at = next;
    }
    let (content, stop, next) = read_until(text, at, &[EOS, TOOL_CALLS_START]);
    at = next;
    let mut calls = Vec::new();
    match stop {
        Some(TOOL_CALLS_START) => {
            at = parse_tool_calls(text, at, &mut calls)?;
            let (rest, _, next) = read_until(text, at, &[EOS]);
            if !rest.is_empty() {
                return Err(CompletionError::TrailingText(rest.into()));
            }
            at = next;
        }
        Some(_) => {}
        None => return Err(CompletionError::MissingEos),
    }
    if at != text.len() {
        return Err(CompletionError::TrailingText(text[at..].into()));
    }
    for tok in [BOS, EOS, THINK_START, THINK_END, DSML] {
        if content.contains(tok) || reasoning.contains(tok) {
            return Err(CompletionError::SpecialTokenInContent(tok));
        }
    }
    Ok(V4Message::assistant(content, reasoning, calls))
}

/// The answer part of a completion as the engine streams it (after the reasoning; stop tokens
/// such as EOS are not in the text, though a final EOS is accepted): the content up to the
/// tool-call block and the calls (`tool_calls::ToolCallFormat::DeepseekV4`). Stricter than
/// nothing, looser than [`parse_completion`]: no EOS needed, whitespace allowed after the block.
pub fn parse_answer(text: &str) -> Result<(String, Vec<ToolCall>), CompletionError> {
    let (content, stop, mut at) = read_until(text, 0, &[EOS, TOOL_CALLS_START]);
    let mut calls = Vec::new();
    if stop == Some(TOOL_CALLS_START) {
        at = parse_tool_calls(text, at, &mut calls)?;
        let (rest, _, next) = read_until(text, at, &[EOS]);
        if !rest.trim().is_empty() {
            return Err(CompletionError::TrailingText(rest.into()));
        }
        at = next;
    }
    if !text[at..].trim().is_empty() {
        return Err(CompletionError::TrailingText(text[at..].into()));
    }
    for tok in [BOS, EOS, THINK_START, THINK_END, DSML] {
        if content.contains(tok) {
            return Err(CompletionError::SpecialTokenInContent(tok));
        }
    }
    Ok((content.to_string(), calls))
}

/// The invokes after `\n\n<｜DSML｜tool_calls`, through `</｜DSML｜tool_calls>`; returns the
/// position after it.
fn parse_tool_calls(
    text: &str,
    mut at: usize,
    calls: &mut Vec<ToolCall>,
) -> Result<usize, CompletionError> {
    let fmt = |m: String| CompletionError::ToolCallFormat(m);
    loop {
        let (between, stop, next) = read_until(text, at, &[INVOKE_START, TOOL_CALLS_END]);
        if between != ">\n" {
            return Err(fmt(format!(
                "expected `>` and a newline before the next invoke, got {between:?}"
            )));
        }
        at = next;
        match stop {
            Some(TOOL_CALLS_END) => return Ok(at),
            Some(_) => {}
            None => {
                return Err(fmt(
                    "the block is not closed by `</｜DSML｜tool_calls>`".into()
                ))
            }
        }
        let (head, mut stop, next) = read_until(text, at, &[PARAMETER_START, INVOKE_END]);
        at = next;
        let name = invoke_name(head).ok_or_else(|| {
            fmt(format!(
                "invoke without `name=\"...\">` and a newline: {head:?}"
            ))
        })?;
        let mut args: Vec<(String, String)> = Vec::new();
        while stop == Some(PARAMETER_START) {
            let (param, _, next) = read_until(text, at, &[PARAMETER_END]);
            at = next;
            let (key, is_str, value) = parse_parameter(param)
                .ok_or_else(|| fmt(format!("malformed parameter {param:?}")))?;
            if args.iter().any(|(k, _)| k == key) {
                return Err(CompletionError::DuplicateParameter {
                    tool: name.into(),
                    param: key.into(),
                });
            }
            args.push((key.to_string(), value_json(is_str, value)));
            let (between, s, next) = read_until(text, at, &[PARAMETER_START, INVOKE_END]);
            if between != ">\n" {
                return Err(fmt(format!(
                    "expected `>` and a newline after a parameter, got {between:?}"
                )));
            }
            at = next;
            stop = s;
        }
        if stop != Some(INVOKE_END) {
            return Err(fmt(format!("the invoke of `{name}` is not closed")));
        }
        let fields: Vec<String> = args
            .iter()
            .map(|(k, v)| format!("{}: {v}", python_json(&Value::String(k.clone()))))
            .collect();
        calls.push(ToolCall::function(
            name,
            format!("{{{}}}", fields.join(", ")),
        ));
    }
}

/// The name of an invoke from its head (the text between `<｜DSML｜invoke` and its first
/// parameter or its end): ` name="NAME">` and a newline.
fn invoke_name(head: &str) -> Option<&str> {
    name_attr(head).and_then(|r| ends(r, "\">\n"))
}

/// An invoke head's text after its `name="`.
fn name_attr(head: &str) -> Option<&str> {
    head.trim_start().strip_prefix("name=\"")
}

/// A parameter's value as its arguments' JSON holds it: a string as a JSON string, any other
/// value as the model wrote it.
fn value_json(is_str: bool, value: &str) -> String {
    if is_str {
        python_json(&Value::String(value.into()))
    } else {
        value.to_string()
    }
}

/// ` name="K" string="true|false">V<` (the text before `/｜DSML｜parameter`) as (K, is a
/// string, V). The name ends at the first `" string="true">` or `" string="false">`; the value
/// runs to the final `<`.
fn parse_parameter(p: &str) -> Option<(&str, bool, &str)> {
    let (key, is_str, at) = parameter_head(p)?;
    Some((key, is_str, ends(&p[at..], "<")?))
}

/// The name and kind of a parameter from its text so far (` name="K" string="true|false">`),
/// and where its value begins; None until the head is whole.
fn parameter_head(p: &str) -> Option<(&str, bool, usize)> {
    let rest = p.strip_prefix(" name=\"")?;
    let t = rest.find("\" string=\"true\">").map(|i| (i, true));
    let f = rest.find("\" string=\"false\">").map(|i| (i, false));
    let (i, is_str) = match (t, f) {
        (Some(a), Some(b)) => {
            if a.0 < b.0 {
                a
            } else {
                b
            }
        }
        (a, b) => a.or(b)?,
    };
    let flag_len = if is_str { 16 } else { 17 };
    Some((&rest[..i], is_str, p.len() - rest.len() + i + flag_len))
}

/// Where the tool-call block of a growing answer (the reasoning removed) begins, just after
/// its opening `\n\n<｜DSML｜tool_calls`, as [`parse_answer`] finds it: None while there is
/// none (or the answer ended before one).
pub(crate) fn tool_block_start(text: &str) -> Option<usize> {
    match read_until(text, 0, &[EOS, TOOL_CALLS_START]) {
        (_, Some(TOOL_CALLS_START), next) => Some(next),
        _ => None,
    }
}

/// What ends an answer's content, or may be the start of its tool-call block
/// (`ToolCallFormat::settled_content`): the block's opening, any other DSML tag, EOS.
pub(crate) const CONTENT_GUARDS: [&str; 3] = [TOOL_CALLS_START, "<｜DSML｜", EOS];

/// An invoke of a growing tool-call block as far as it is written ([`partial_invokes`]).
#[derive(Debug, PartialEq)]
pub(crate) struct PartialInvoke<'t> {
    pub name: &'t str,
    /// The start of the JSON text [`parse_answer`] makes of its parameters once it is whole.
    pub arguments: String,
    /// Its `</｜DSML｜invoke` has come.
    pub closed: bool,
}

/// The invokes of a growing tool-call block from `at` (where the block opens, or where a closed
/// invoke ended), each once its name is whole, with the JSON of its parameters so far: whole
/// parameters as [`parse_answer`] writes them, then the one being written (its name once whole,
/// then its value, a string's escaped character by character, less any text that may still be
/// its closing tag). Returns them and the position after the last closed one. Lenient about
/// what lies between tags: where the block is malformed, [`parse_answer`] says so at the end.
pub(crate) fn partial_invokes(text: &str, mut at: usize) -> (Vec<PartialInvoke<'_>>, usize) {
    let mut out = Vec::new();
    loop {
        let (_, Some(INVOKE_START), body) = read_until(text, at, &[INVOKE_START, TOOL_CALLS_END])
        else {
            return (out, at);
        };
        let (head, mut stop, mut p) = read_until(text, body, &[PARAMETER_START, INVOKE_END]);
        let name = match stop {
            Some(_) => invoke_name(head),
            // The name is whole once its quote and `>` are written, with no more than the
            // start of the next tag after them (the whole head decides otherwise).
            None => name_attr(head)
                .and_then(|r| r.find("\">").map(|e| (&r[..e], &r[e + 2..])))
                .filter(|(_, rest)| {
                    ["\n<｜DSML｜parameter", "\n</｜DSML｜invoke"]
                        .iter()
                        .any(|t| t.starts_with(rest))
                })
                .map(|(name, _)| name),
        };
        let Some(name) = name else {
            return (out, at);
        };
        if stop.is_none() {
            out.push(PartialInvoke {
                name,
                arguments: "{".into(),
                closed: false,
            });
            return (out, at);
        }
        let mut arguments = String::from("{");
        let mut fields = 0;
        let mut closed = false;
        let mut field = |arguments: &mut String, key: &str| {
            if fields > 0 {
                arguments.push_str(", ");
            }
            fields += 1;
            arguments.push_str(&python_json(&Value::String(key.into())));
            arguments.push_str(": ");
        };
        loop {
            if stop == Some(INVOKE_END) {
                arguments.push('}');
                closed = true;
                break;
            }
            let (param, end, next) = read_until(text, p, &[PARAMETER_END]);
            if end.is_some() {
                let Some((key, is_str, value)) = parse_parameter(param) else {
                    break;
                };
                field(&mut arguments, key);
                arguments.push_str(&value_json(is_str, value));
                (_, stop, p) = read_until(text, next, &[PARAMETER_START, INVOKE_END]);
                if stop.is_none() {
                    break;
                }
                continue;
            }
            // The parameter being written: its value so far, up to a `<` that a slash or a
            // newline follows or may follow (where its closing tag may begin: a value that
            // holds one, as `</b>`, comes whole when the parameter closes; one cut off there
            // never shows the tag's remains).
            if let Some((key, is_str, v)) = parameter_head(param) {
                let value = &param[v..];
                let held = value
                    .match_indices('<')
                    .map(|(i, _)| i)
                    .find(|&i| matches!(value.as_bytes().get(i + 1), None | Some(b'/' | b'\n')))
                    .unwrap_or(value.len());
                let value = &value[..held];
                field(&mut arguments, key);
                let json = value_json(is_str, value);
                // (A string still being written: without its closing quote.)
                arguments.push_str(if is_str {
                    &json[..json.len() - 1]
                } else {
                    &json
                });
            }
            break;
        }
        out.push(PartialInvoke {
            name,
            arguments,
            closed,
        });
        if !closed {
            return (out, at);
        }
        at = p;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flag_lengths_match_their_text() {
        assert_eq!("\" string=\"true\">".len(), 16);
        assert_eq!("\" string=\"false\">".len(), 17);
    }

    #[test]
    fn parameters_split_like_the_reference_regex() {
        assert_eq!(
            parse_parameter(" name=\"a\" string=\"true\">x<y<"),
            Some(("a", true, "x<y"))
        );
        assert_eq!(
            parse_parameter(" name=\"a\" string=\"false\">[1]<\n"),
            Some(("a", false, "[1]"))
        );
        assert_eq!(parse_parameter(" name=\"a\" string=\"maybe\">x<"), None);
        assert_eq!(parse_parameter("name=\"a\" string=\"true\">x<"), None);
        assert_eq!(parse_parameter(" name=\"a\" string=\"true\">x"), None);
    }

    #[test]
    fn kwargs_map_like_the_wrapper() {
        let kw = |v: Value| v.as_object().unwrap().clone();
        let o = EncodeOptions::from_kwargs(&kw(serde_json::json!({})));
        assert_eq!(o, EncodeOptions::default());
        let o = EncodeOptions::from_kwargs(&kw(
            serde_json::json!({"enable_thinking": true, "reasoning_effort": "xhigh", "drop_thinking": false}),
        ));
        assert_eq!(o.thinking_mode, ThinkingMode::Thinking);
        assert_eq!(o.reasoning_effort, Some(ReasoningEffort::Max));
        assert!(!o.drop_thinking);
        let o = EncodeOptions::from_kwargs(&kw(
            serde_json::json!({"thinking": 1, "reasoning_effort": "none"}),
        ));
        assert_eq!(o.thinking_mode, ThinkingMode::Chat);
        assert_eq!(o.reasoning_effort, None);
        let o = EncodeOptions::from_kwargs(&kw(
            serde_json::json!({"thinking": "", "reasoning_effort": "low"}),
        ));
        assert_eq!(o.thinking_mode, ThinkingMode::Chat);
        assert_eq!(o.reasoning_effort, Some(ReasoningEffort::High));
    }
}
