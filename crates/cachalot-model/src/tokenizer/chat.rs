//! Chat templates: the Jinja `chat_template` of `tokenizer_config.json`, rendered with
//! `minijinja` the way `transformers`' `apply_chat_template` renders it (trim_blocks and
//! lstrip_blocks on, loop controls, Python string methods and Jinja2's filters (`minijinja`'s,
//! `pycompat`'s and [`super::jinja_compat`]'s), `raise_exception`, a Python-style
//! `tojson`, `strftime_now`, and the special tokens of the config as variables).
//!
//! DeepSeek-V4 has no Jinja template: [`ChatTemplate::deepseek_v4`] renders with its encoder in
//! code ([`super::dsv4`], spec `deepseek-v4.md` §5) behind the same interface.

use std::path::{Path, PathBuf};

use minijinja::value::Kwargs;
use minijinja::{Environment, Error, ErrorKind, Value};
use serde::{Deserialize, Serialize};

use crate::error::{ModelError, Result};

/// One chat turn. Richer turns (tool calls) can be passed to [`ChatTemplate::render_json`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Message {
    pub role: String,
    pub content: String,
}

impl Message {
    pub fn new(role: &str, content: impl Into<String>) -> Message {
        Message {
            role: role.to_string(),
            content: content.into(),
        }
    }
}

pub struct ChatTemplate {
    source: String,
    /// Where the template came from, for error messages.
    origin: PathBuf,
    /// `bos_token`, `eos_token`, `pad_token`, `unk_token` as given in the config.
    special_tokens: Vec<(&'static str, String)>,
    /// Render with DeepSeek-V4's encoder instead of `source` (which is then empty).
    deepseek_v4: bool,
    /// Sort the keys of `tools` (every level) before rendering, as Kimi's tokenizer
    /// (`tokenization_kimi.py`'s `apply_chat_template`, `deep_sort_dict`) does: its tool
    /// declaration lists them in key order, whatever order the request gave.
    sort_tools: bool,
    /// A named-template list's `tool_use` template, which transformers renders instead of
    /// `default` when the request has tools.
    tool_source: Option<String>,
}

const SPECIAL_TOKEN_FIELDS: [&str; 4] = ["bos_token", "eos_token", "pad_token", "unk_token"];

impl ChatTemplate {
    /// A template from its source text; `origin` names the file in errors.
    pub fn new(source: impl Into<String>, origin: impl Into<PathBuf>) -> ChatTemplate {
        ChatTemplate {
            source: without_generation_tags(source.into()),
            origin: origin.into(),
            special_tokens: Vec::new(),
            deepseek_v4: false,
            sort_tools: false,
            tool_source: None,
        }
    }

    /// DeepSeek-V4's prompt format ([`super::dsv4::apply_chat_template`]); `origin` (the model's
    /// `config.json`) names it in errors. `render_json`'s `extra` holds the wrapper's keyword
    /// arguments (`enable_thinking`/`thinking`, `reasoning_effort`, `drop_thinking`), and
    /// `add_generation_prompt` is ignored: like DeepSeek's wrapper, the encoder always ends a
    /// conversation whose last message is from the user with `<｜Assistant｜>` and `<think>` or
    /// `</think>`.
    pub fn deepseek_v4(origin: impl Into<PathBuf>) -> ChatTemplate {
        ChatTemplate {
            deepseek_v4: true,
            ..ChatTemplate::new(String::new(), origin)
        }
    }

    /// Whether this renders with DeepSeek-V4's encoder rather than Jinja.
    pub fn is_deepseek_v4(&self) -> bool {
        self.deepseek_v4
    }

    /// The `chat_template` field of a parsed `tokenizer_config.json` (`None` if it has none).
    /// A list of named templates (`[{"name": "default", "template": ...}]`) picks `default`,
    /// and `tool_use` where a request has tools (as transformers picks them).
    pub fn from_config_value(config: &serde_json::Value, path: &Path) -> Result<Option<Self>> {
        let named = |name: &str| {
            config
                .get("chat_template")?
                .as_array()?
                .iter()
                .find(|t| t.get("name").and_then(|n| n.as_str()) == Some(name))
                .and_then(|t| t.get("template")?.as_str())
                .map(str::to_string)
        };
        let source = match config.get("chat_template") {
            None | Some(serde_json::Value::Null) => return Ok(None),
            Some(serde_json::Value::String(s)) => s.clone(),
            Some(serde_json::Value::Array(list)) => list
                .iter()
                .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
                .and_then(|t| t.get("template")?.as_str())
                .map(str::to_string)
                .ok_or_else(|| ModelError::Config {
                    path: path.to_path_buf(),
                    field: "chat_template".into(),
                    message: "a list of templates without one named `default`".into(),
                })?,
            Some(_) => {
                return Err(ModelError::Config {
                    path: path.to_path_buf(),
                    field: "chat_template".into(),
                    message: "expected a string".into(),
                })
            }
        };
        if source.trim().is_empty() {
            return Err(ModelError::Config {
                path: path.to_path_buf(),
                field: "chat_template".into(),
                message: "is empty; give the model's template, or remove the key to send \
                          prompts as raw text"
                    .into(),
            });
        }
        let mut t = ChatTemplate::new(source, path);
        t.tool_source = named("tool_use").map(without_generation_tags);
        for field in SPECIAL_TOKEN_FIELDS {
            if let Some(v) = config.get(field).and_then(super::token_content) {
                t.special_tokens.push((field, v));
            }
        }
        Ok(Some(t))
    }

    /// A template file: a `tokenizer_config.json` (its `chat_template`), or Jinja source.
    pub fn from_file(path: &Path) -> Result<ChatTemplate> {
        let text = std::fs::read_to_string(path).map_err(|source| ModelError::Io {
            path: path.to_path_buf(),
            error: source,
        })?;
        if path.extension().is_some_and(|e| e == "json") {
            let v: serde_json::Value =
                serde_json::from_str(&text).map_err(|e| ModelError::Json {
                    path: path.to_path_buf(),
                    message: e.to_string(),
                })?;
            return ChatTemplate::from_config_value(&v, path)?.ok_or_else(|| ModelError::Config {
                path: path.to_path_buf(),
                field: "chat_template".into(),
                message: "missing".into(),
            });
        }
        if text.trim().is_empty() {
            return Err(ModelError::Config {
                path: path.to_path_buf(),
                field: "(template)".into(),
                message: "the template file is empty".into(),
            });
        }
        // A chat template renders the conversation; one that never reads `messages` would
        // turn every prompt into the same text (a wrong file given as the template).
        if !text.contains("messages") {
            return Err(ModelError::Config {
                path: path.to_path_buf(),
                field: "(template)".into(),
                message: "never reads `messages`, so it is not a chat template; give a Jinja \
                          chat template or a tokenizer_config.json with `chat_template`"
                    .into(),
            });
        }
        Ok(ChatTemplate::new(text, path))
    }

    /// Render `tools` with their keys sorted at every level (Kimi's tokenizer does).
    pub fn set_sort_tools(&mut self, sort: bool) {
        self.sort_tools = sort;
    }

    /// Sets (or replaces) a special-token variable such as `bos_token`.
    pub fn set_special_token(&mut self, field: &'static str, value: impl Into<String>) {
        self.special_tokens.retain(|(f, _)| *f != field);
        self.special_tokens.push((field, value.into()));
    }

    pub fn source(&self) -> &str {
        &self.source
    }

    /// Renders a conversation of plain messages.
    pub fn render(&self, messages: &[Message], add_generation_prompt: bool) -> Result<String> {
        let messages = serde_json::to_value(messages).expect("messages serialise");
        self.render_json(
            &messages,
            add_generation_prompt,
            None,
            &serde_json::Map::new(),
        )
    }

    /// The template parses (as minijinja reads Jinja); the error names the line.
    pub fn check_syntax(&self) -> Result<()> {
        if self.deepseek_v4 {
            return Ok(());
        }
        environment()
            .template_from_str(&self.source)
            .map(drop)
            .map_err(|e| {
                let line = e
                    .line()
                    .map(|l| format!(" (template line {l})"))
                    .unwrap_or_default();
                ModelError::Tokenizer(format!(
                    "chat template of {}{line}: {}; the template is not valid Jinja for minijinja",
                    self.origin.display(),
                    e.detail().unwrap_or(&e.kind().to_string())
                ))
            })
    }

    /// Renders a conversation given as JSON (OpenAI-style messages, with tool calls if any),
    /// with optional `tools` and extra template variables (such as `enable_thinking`).
    pub fn render_json(
        &self,
        messages: &serde_json::Value,
        add_generation_prompt: bool,
        tools: Option<&serde_json::Value>,
        extra: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<String> {
        if self.deepseek_v4 {
            return super::dsv4::apply_chat_template_json(messages, tools, extra).map_err(|e| {
                ModelError::Tokenizer(format!(
                    "DeepSeek-V4 chat encoding (model {}): {e}",
                    self.origin.display()
                ))
            });
        }
        let env = environment();
        let fail = |e: Error| {
            let line = e
                .line()
                .map(|l| format!(" (template line {l})"))
                .unwrap_or_default();
            let mut msg = format!(
                "chat template of {}{line}: {}",
                self.origin.display(),
                e.detail().unwrap_or(&e.kind().to_string())
            );
            if e.kind() == ErrorKind::SyntaxError {
                msg.push_str("; the template is not valid Jinja for minijinja");
            }
            ModelError::Tokenizer(msg)
        };
        let has_tools = tools.is_some_and(|t| t.as_array().is_none_or(|a| !a.is_empty()));
        let source = match &self.tool_source {
            Some(t) if has_tools => t,
            _ => &self.source,
        };
        let template = env.template_from_str(source).map_err(fail)?;
        let mut ctx = serde_json::Map::new();
        for (k, v) in extra {
            ctx.insert(k.clone(), v.clone());
        }
        ctx.insert("messages".into(), messages.clone());
        ctx.insert(
            "add_generation_prompt".into(),
            serde_json::Value::Bool(add_generation_prompt),
        );
        // transformers passes `tools` and `documents` always, None when absent (a template's
        // `tools is not none` must read so).
        let tools = match tools {
            Some(t) if self.sort_tools => deep_sorted(t),
            Some(t) => t.clone(),
            None => serde_json::Value::Null,
        };
        ctx.insert("tools".into(), tools);
        ctx.entry("documents").or_insert(serde_json::Value::Null);
        for (field, value) in &self.special_tokens {
            ctx.insert(field.to_string(), serde_json::Value::String(value.clone()));
        }
        template
            .render(Value::from(minijinja::value::Serde(&ctx)))
            .map_err(fail)
    }
}

/// `v` with every object's keys in sorted order (Python's `sorted(d.items())`: by code point,
/// which is UTF-8 byte order).
fn deep_sorted(v: &serde_json::Value) -> serde_json::Value {
    match v {
        serde_json::Value::Object(m) => {
            let mut keys: Vec<&String> = m.keys().collect();
            keys.sort();
            serde_json::Value::Object(
                keys.into_iter()
                    .map(|k| (k.clone(), deep_sorted(&m[k])))
                    .collect(),
            )
        }
        serde_json::Value::Array(a) => {
            serde_json::Value::Array(a.iter().map(deep_sorted).collect())
        }
        other => other.clone(),
    }
}

/// The environment `transformers` renders chat templates in (`_compile_jinja_template`).
/// transformers' `{% generation %}…{% endgeneration %}` block only marks the assistant's
/// tokens for `return_assistant_tokens_mask`; rendering, it is transparent. Jinja (minijinja)
/// has no such tag, so it becomes an always-true `if` block with the same whitespace control.
fn without_generation_tags(source: String) -> String {
    if !source.contains("generation") {
        return source;
    }
    let re =
        fancy_regex::Regex::new(r"\{%(-?)\s*(end)?generation\s*(-?)%\}").expect("a valid pattern");
    re.replace_all(&source, |c: &fancy_regex::Captures<str>| {
        let (open, close) = (&c[1], &c[3]);
        if c.get(2).is_some() {
            format!("{{%{open} endif {close}%}}")
        } else {
            format!("{{%{open} if true {close}%}}")
        }
    })
    .into_owned()
}

fn environment() -> Environment<'static> {
    let mut env = Environment::new();
    env.set_syntax(
        minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .expect("default delimiters are valid"),
    );
    super::jinja_compat::install(&mut env);
    env.add_function(
        "raise_exception",
        |msg: String| -> std::result::Result<Value, Error> {
            Err(Error::new(ErrorKind::InvalidOperation, msg))
        },
    );
    env.add_function("strftime_now", |fmt: String| -> String {
        strftime_utc(&fmt, now_unix())
    });
    env.add_filter("tojson", tojson);
    env
}

/// The widest `tojson` indent a template may ask for (templates use 2 or 4; a huge one would
/// make the rendered prompt exhaust memory).
const MAX_TOJSON_INDENT: usize = 64;

/// transformers' `tojson`: `json.dumps(x, ensure_ascii=False, indent=indent,
/// separators=separators, sort_keys=sort_keys)`, keys in insertion order.
fn tojson(value: Value, kwargs: Kwargs) -> std::result::Result<Value, Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let separators: Option<Vec<String>> = kwargs.get("separators")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    kwargs.assert_all_used()?;
    if let Some(n) = indent.filter(|&n| n > MAX_TOJSON_INDENT) {
        return Err(Error::new(
            ErrorKind::InvalidOperation,
            format!("tojson indent {n} is too large (at most {MAX_TOJSON_INDENT})"),
        ));
    }
    let (item_sep, key_sep) = match separators.as_deref() {
        Some([a, b]) => (a.clone(), b.clone()),
        Some(_) => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                "tojson: separators must be a pair",
            ))
        }
        None if indent.is_some() => (",".to_string(), ": ".to_string()),
        None => (", ".to_string(), ": ".to_string()),
    };
    let json = serde_json::to_value(&value)
        .map_err(|e| Error::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
    let mut out = String::new();
    let style = PyJson {
        indent,
        item_sep: &item_sep,
        key_sep: &key_sep,
        sort_keys: sort_keys.unwrap_or(false),
        ensure_ascii: ensure_ascii.unwrap_or(false),
    };
    style.write(&json, 0, &mut out);
    Ok(Value::from_safe_string(out))
}

/// Python's `json.dumps` layout.
struct PyJson<'a> {
    indent: Option<usize>,
    item_sep: &'a str,
    key_sep: &'a str,
    sort_keys: bool,
    ensure_ascii: bool,
}

impl PyJson<'_> {
    fn newline(&self, depth: usize, out: &mut String) {
        if let Some(n) = self.indent {
            out.push('\n');
            out.push_str(&" ".repeat(n * depth));
        }
    }

    fn string(&self, s: &str, out: &mut String) {
        let quoted = serde_json::to_string(s).expect("strings serialise");
        if self.ensure_ascii {
            for c in quoted.chars() {
                if c.is_ascii() {
                    out.push(c);
                } else {
                    let mut buf = [0u16; 2];
                    for unit in c.encode_utf16(&mut buf) {
                        out.push_str(&format!("\\u{unit:04x}"));
                    }
                }
            }
        } else {
            out.push_str(&quoted);
        }
    }

    fn write(&self, v: &serde_json::Value, depth: usize, out: &mut String) {
        use serde_json::Value as J;
        // With an indent, Python puts the newline right after the item separator, so the
        // separator's trailing space is dropped (json.dumps strips it: ',' not ', ').
        let item_sep = if self.indent.is_some() {
            self.item_sep.trim_end()
        } else {
            self.item_sep
        };
        match v {
            J::Null => out.push_str("null"),
            J::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
            J::Number(n) => match n.as_f64() {
                Some(f) if n.is_f64() => out.push_str(&python_float_repr(f)),
                _ => out.push_str(&n.to_string()),
            },
            J::String(s) => self.string(s, out),
            J::Array(items) => {
                if items.is_empty() {
                    out.push_str("[]");
                    return;
                }
                out.push('[');
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        out.push_str(item_sep);
                    }
                    self.newline(depth + 1, out);
                    self.write(item, depth + 1, out);
                }
                self.newline(depth, out);
                out.push(']');
            }
            J::Object(map) => {
                if map.is_empty() {
                    out.push_str("{}");
                    return;
                }
                let mut entries: Vec<(&String, &J)> = map.iter().collect();
                if self.sort_keys {
                    entries.sort_by(|a, b| a.0.cmp(b.0));
                }
                out.push('{');
                for (i, (k, item)) in entries.into_iter().enumerate() {
                    if i > 0 {
                        out.push_str(item_sep);
                    }
                    self.newline(depth + 1, out);
                    self.string(k, out);
                    out.push_str(self.key_sep);
                    self.write(item, depth + 1, out);
                }
                self.newline(depth, out);
                out.push('}');
            }
        }
    }
}

/// `json.dumps(value, ensure_ascii=False)` with Python's default separators (`", "`, `": "`),
/// keys in insertion order: the JSON that DeepSeek-V4's encoder writes (`to_json`).
pub(crate) fn python_json(value: &serde_json::Value) -> String {
    let mut out = String::new();
    PyJson {
        indent: None,
        item_sep: ", ",
        key_sep: ": ",
        sort_keys: false,
        ensure_ascii: false,
    }
    .write(value, 0, &mut out);
    out
}

/// Python's `repr(float)` (which `json.dumps` uses): the shortest round-trip digits, written
/// positionally when the decimal exponent is in -4..16 (always with a fractional part, `1000.0`),
/// else as `d.ddde+XX` with at least two exponent digits (`1e+20`, `1.5e-07`).
fn python_float_repr(f: f64) -> String {
    if !f.is_finite() {
        // json.dumps writes these (allow_nan=True); JSON input cannot hold them anyway.
        return if f.is_nan() {
            "NaN".into()
        } else if f > 0.0 {
            "Infinity".into()
        } else {
            "-Infinity".into()
        };
    }
    // Rust's `{:e}` gives the shortest round-trip digits: "-1.2345e-7", "1e20".
    let sci = format!("{:e}", f.abs());
    let (mantissa, exp) = sci.split_once('e').expect("{:e} always has an exponent");
    let exp: i32 = exp.parse().expect("{:e} exponent is an integer");
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    let sign = if f.is_sign_negative() { "-" } else { "" };
    if (-4..16).contains(&exp) {
        let body = if exp >= 0 {
            let int_len = exp as usize + 1;
            if digits.len() > int_len {
                format!("{}.{}", &digits[..int_len], &digits[int_len..])
            } else {
                format!("{digits}{}.0", "0".repeat(int_len - digits.len()))
            }
        } else {
            format!("0.{}{digits}", "0".repeat((-exp - 1) as usize))
        };
        format!("{sign}{body}")
    } else {
        let exp_sign = if exp < 0 { '-' } else { '+' };
        format!("{sign}{mantissa}e{exp_sign}{:02}", exp.abs())
    }
}

fn now_unix() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64)
}

/// `time.strftime` for the directives chat templates use (`%Y %m %d %H %M %S %b %B %a %A %y %j
/// %%`), in UTC; other directives are kept as written.
fn strftime_utc(fmt: &str, unix: i64) -> String {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] = [
        "Thursday",
        "Friday",
        "Saturday",
        "Sunday",
        "Monday",
        "Tuesday",
        "Wednesday",
    ];
    let days = unix.div_euclid(86_400);
    let secs = unix.rem_euclid(86_400);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    let leap = (year % 4 == 0 && year % 100 != 0) || year % 400 == 0;
    const CUM: [i64; 12] = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
    let yday = CUM[(month - 1) as usize] + day + i64::from(leap && month > 2);
    let weekday = DAYS[days.rem_euclid(7) as usize];
    let month_name = MONTHS[(month - 1) as usize];
    let mut out = String::new();
    let mut chars = fmt.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('Y') => out.push_str(&year.to_string()),
            Some('y') => out.push_str(&format!("{:02}", year % 100)),
            Some('m') => out.push_str(&format!("{month:02}")),
            Some('d') => out.push_str(&format!("{day:02}")),
            Some('j') => out.push_str(&format!("{yday:03}")),
            Some('H') => out.push_str(&format!("{:02}", secs / 3600)),
            Some('M') => out.push_str(&format!("{:02}", secs / 60 % 60)),
            Some('S') => out.push_str(&format!("{:02}", secs % 60)),
            Some('b') => out.push_str(&month_name[..3]),
            Some('B') => out.push_str(month_name),
            Some('a') => out.push_str(&weekday[..3]),
            Some('A') => out.push_str(weekday),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strftime_known_dates() {
        assert_eq!(strftime_utc("%Y-%m-%d %H:%M:%S", 0), "1970-01-01 00:00:00");
        // 2024-02-29 12:34:56 UTC, a Thursday, day 60.
        assert_eq!(
            strftime_utc("%d %b %Y %A %j %%", 1_709_210_096),
            "29 Feb 2024 Thursday 060 %"
        );
    }

    /// A named-template list renders `tool_use` for a request with tools, `default` else.
    #[test]
    fn a_tool_use_template_serves_requests_with_tools() {
        let cfg = serde_json::json!({"chat_template": [
            {"name": "default", "template": "D:{{ messages[0].content }}"},
            {"name": "tool_use", "template": "T:{{ messages[0].content }}"}]});
        let t = ChatTemplate::from_config_value(&cfg, Path::new("x.json"))
            .unwrap()
            .unwrap();
        let m = serde_json::json!([{"role": "user", "content": "hey"}]);
        let tools = serde_json::json!([{"type": "function", "function": {"name": "f"}}]);
        let none = serde_json::Map::new();
        assert_eq!(t.render_json(&m, true, None, &none).unwrap(), "D:hey");
        assert_eq!(
            t.render_json(&m, true, Some(&tools), &none).unwrap(),
            "T:hey"
        );
    }

    /// As transformers passes them: `tools` and `documents` defined, none when not given.
    #[test]
    fn absent_tools_and_documents_are_none() {
        let t = ChatTemplate::new(
            "{% if tools is not none %}T{% else %}N{% endif %}{{ documents is none }}\
             {{ documents is defined }}",
            "t.jinja",
        );
        let msgs = serde_json::json!([{"role": "user", "content": "hi"}]);
        let none = t
            .render_json(&msgs, true, None, &Default::default())
            .unwrap();
        assert_eq!(none, "NTrueTrue");
        let tools = serde_json::json!([{"type": "function", "function": {"name": "f"}}]);
        let some = t
            .render_json(&msgs, true, Some(&tools), &Default::default())
            .unwrap();
        assert_eq!(some, "TTrueTrue");
    }

    #[test]
    fn generation_blocks_render_their_content() {
        // transformers' assistant-mask tag, with and without whitespace control.
        let t = ChatTemplate::new(
            "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}[{{ m.content }}]\
             {% endgeneration %}{% else %}{{ m.content }} {%- generation -%}  {%- endgeneration %}\
             {% endif %}{% endfor %}",
            "t.jinja",
        );
        let out = t
            .render(
                &[Message::new("user", "hi"), Message::new("assistant", "yo")],
                false,
            )
            .unwrap();
        assert_eq!(out, "hi[yo]");
        assert!(!t.source().contains("generation"));
    }

    #[test]
    fn a_failing_template_names_its_file() {
        let t = ChatTemplate::new(
            "{{ raise_exception('roles must alternate') }}",
            "/models/x/tokenizer_config.json",
        );
        let e = t.render(&[Message::new("user", "hi")], true).unwrap_err();
        let s = e.to_string();
        assert!(s.contains("/models/x/tokenizer_config.json"), "{s}");
        assert!(s.contains("roles must alternate"), "{s}");
        let bad = ChatTemplate::new("{% for x in %}", "t.jinja");
        let s = bad.render(&[], false).unwrap_err().to_string();
        assert!(s.contains("t.jinja") && s.contains("line 1"), "{s}");
    }

    #[test]
    fn floats_print_like_python_repr() {
        // Expected strings are Python's repr(float) of the same values.
        let cases = [
            (0.1, "0.1"),
            (1.0, "1.0"),
            (-0.0, "-0.0"),
            (1000.0, "1000.0"),
            (1e16, "1e+16"),
            (2.5e15, "2500000000000000.0"),
            (1.5e-5, "1.5e-05"),
            (0.0001, "0.0001"),
            (1e-7, "1e-07"),
            (-1.25e100, "-1.25e+100"),
            (123456789.125, "123456789.125"),
            (5e-324, "5e-324"),
        ];
        for (f, want) in cases {
            assert_eq!(python_float_repr(f), want, "{f:e}");
        }
        let v = serde_json::json!({"a": [1, 2.0, "x\n"], "b": {"c": null, "d": 1e20}});
        assert_eq!(
            python_json(&v),
            "{\"a\": [1, 2.0, \"x\\n\"], \"b\": {\"c\": null, \"d\": 1e+20}}"
        );
    }

    #[test]
    fn tojson_matches_python_layouts() {
        let t = ChatTemplate::new(
            "{{ x | tojson }}|{{ x | tojson(separators=(',', ':')) }}|{{ x | tojson(indent=2) }}",
            "t",
        );
        let mut extra = serde_json::Map::new();
        extra.insert("x".into(), serde_json::json!({"b": [1, "é<"], "a": {}}));
        let s = t
            .render_json(&serde_json::json!([]), false, None, &extra)
            .unwrap();
        assert_eq!(
            s,
            "{\"b\": [1, \"é<\"], \"a\": {}}|{\"b\":[1,\"é<\"],\"a\":{}}|{\n  \"b\": [\n    1,\n    \"é<\"\n  ],\n  \"a\": {}\n}"
        );
    }

    #[test]
    fn a_huge_tojson_indent_is_an_error_not_an_allocation() {
        let t = ChatTemplate::new("{{ x | tojson(indent=18446744073709551615) }}", "t");
        let mut extra = serde_json::Map::new();
        extra.insert("x".into(), serde_json::json!({"b": [1]}));
        let e = t
            .render_json(&serde_json::json!([]), false, None, &extra)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("tojson indent") && e.contains("at most 64"),
            "{e}"
        );
    }
}
