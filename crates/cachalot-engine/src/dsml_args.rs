//! DeepSeek-V4's tool-call parameters (DSML) held to a tool's JSON Schema while decoding: the
//! grammar of a forced call's arguments where the model writes them as DSML rather than JSON
//! (`tokenizer::dsv4`; spec `deepseek-v4.md` §5, the encoder's `TOOLS_TEMPLATE`).
//!
//! After `<｜DSML｜invoke name="NAME">\n` the model writes zero or more parameters, each
//! `<｜DSML｜parameter name="K" string="true|false">V</｜DSML｜parameter>`, separated by
//! newlines, then `\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>` (`</｜DSML｜invoke>…` at once when
//! there are none). This recognizer takes those bytes one at a time, as [`crate::json_schema`]'s
//! does for JSON, so the engine can mask every token that would leave the grammar:
//!
//! - a parameter's name is one of the schema's `properties` not yet written, or, where
//!   `additionalProperties` is not false, another name under that schema, written as an
//!   identifier (ASCII letters, digits, `_`, `-`, `.`, `$`; at most [`MAX_EXTRA_NAME`] bytes:
//!   a model's invented name is not held to be valid UTF-8 otherwise);
//! - `string="true"`: the value is raw text, read as the JSON string the parser makes of it
//!   (`"` + text + `"`, escaped), which the property's schema must accept (so `string="true"` is
//!   offered only where the schema takes strings);
//! - `string="false"`: the value is JSON text the property's schema accepts;
//! - no value holds `｜DSML｜` (the parser reads a value up to the first closing marker);
//! - the invoke closes only once every `required` name is written.
//!
//! [`DsmlSpec::compile`] takes a tool's `parameters`: an object schema of `properties`,
//! `required` and `additionalProperties` (with `$defs`/`definitions` for their `$ref`s, and
//! annotations). A schema with other object keywords (`patternProperties`, `minProperties`,
//! …) is refused by name: the caller then holds the call to DSML's form with any parameters
//! ([`DsmlSpec::any`]). The parser that reads the answer back is `dsv4::parse_completion`.

use std::sync::Arc;

use serde_json::{json, Map, Value};

use crate::json_schema::{Schema, SchemaState};

/// Opens a parameter, up to its name.
const PARAM_OPEN: &[u8] = "<｜DSML｜parameter name=\"".as_bytes();
/// Closes a parameter's value.
const PARAM_CLOSE: &[u8] = "</｜DSML｜parameter>".as_bytes();
/// Closes the invoke and the call block.
const END: &[u8] = "</｜DSML｜invoke>\n</｜DSML｜tool_calls>".as_bytes();
/// Closes the invoke alone ([`DsmlState::ending_at_invoke`]: more calls may follow).
const INVOKE_END: &[u8] = "</｜DSML｜invoke>".as_bytes();
/// The marker no value may hold.
const DSML: &[u8] = cachalot_model::tokenizer::dsv4::DSML.as_bytes();

/// `bytes` hold the `｜DSML｜` marker.
pub(crate) fn holds_marker(bytes: &[u8]) -> bool {
    bytes.windows(DSML.len()).any(|w| w == DSML)
}

/// A listed property's name can be written between `name="` and `"`.
fn name_writable(name: &[u8]) -> bool {
    !name.contains(&b'"') && !holds_marker(name)
}
const FLAG_STR: &[u8] = b" string=\"true\">";
const FLAG_JSON: &[u8] = b" string=\"false\">";

/// The longest name of a parameter the schema does not list.
pub const MAX_EXTRA_NAME: usize = 64;

/// The most properties a schema may list (a bit each in [`DsmlState`]).
pub const MAX_PROPERTIES: usize = 128;

/// What a parameter's value may be.
#[derive(Debug)]
struct Prop {
    schema: Arc<Schema>,
    /// `string="true"` fits: the schema takes a string.
    as_str: bool,
    /// `string="false"` fits: the schema takes some JSON text (a quoted string included).
    as_json: bool,
}

impl Prop {
    fn new(schema: Arc<Schema>) -> Prop {
        let takes = |b: &[u8]| SchemaState::new(schema.clone()).feed_all(b);
        let as_str = takes(b"\"");
        // Every byte a JSON value can open with.
        let as_json = as_str || b"{[-0123456789tfn".iter().any(|&b| takes(&[b]));
        Prop {
            schema,
            as_str,
            as_json,
        }
    }
}

/// A tool's parameters, compiled for [`DsmlState`].
#[derive(Debug)]
pub struct DsmlSpec {
    /// The listed properties a value can be written for, in the schema's order.
    props: Vec<(Vec<u8>, Prop)>,
    /// The schema of other names (None: `additionalProperties: false`).
    extra: Option<Prop>,
    /// Required names that are not listed (written under `extra`).
    required_extra: Vec<Vec<u8>>,
    /// Which of `props` are required.
    required: Vec<bool>,
    /// Listed names no value can be written for (schema `false`): never taken as other names.
    forbidden: Vec<Vec<u8>>,
}

/// Keywords of a tool's `parameters` that [`DsmlSpec::compile`] reads or that do not constrain.
const KNOWN: &[&str] = &[
    "type",
    "properties",
    "required",
    "additionalProperties",
    "$defs",
    "definitions",
    "$schema",
    "$id",
    "$comment",
    "title",
    "description",
    "default",
    "examples",
];

impl DsmlSpec {
    /// Any parameters, each any JSON value (or any string).
    pub fn any() -> Arc<DsmlSpec> {
        DsmlSpec::lenient(&Value::Null)
    }

    /// For `parameters` that [`DsmlSpec::compile`] refuses: DSML's form with any values, the
    /// listed names (as the encoder writes them, whatever their bytes) or identifiers.
    pub fn lenient(parameters: &Value) -> Arc<DsmlSpec> {
        let any = Schema::compile(&json!({})).expect("the empty schema compiles");
        let props: Vec<(Vec<u8>, Prop)> = parameters
            .get("properties")
            .and_then(Value::as_object)
            .into_iter()
            .flatten()
            .map(|(n, _)| n.as_bytes())
            .filter(|n| name_writable(n))
            .take(MAX_PROPERTIES)
            .map(|n| (n.to_vec(), Prop::new(any.clone())))
            .collect();
        Arc::new(DsmlSpec {
            required: vec![false; props.len()],
            props,
            extra: Some(Prop::new(any)),
            required_extra: Vec::new(),
            forbidden: Vec::new(),
        })
    }

    /// A tool's `parameters` (module docs); an error names what is not taken.
    pub fn compile(parameters: &Value) -> Result<Arc<DsmlSpec>, String> {
        let o = match parameters {
            Value::Bool(true) => return Ok(DsmlSpec::any()),
            Value::Object(o) => o,
            other => return Err(format!("parameters must be an object schema, not {other}")),
        };
        if let Some(k) = o.keys().find(|k| !KNOWN.contains(&k.as_str())) {
            return Err(format!(
                "`{k}` is not held in DSML parameters (they take properties, required and \
                 additionalProperties)"
            ));
        }
        match o.get("type") {
            None => {}
            Some(Value::String(t)) if t == "object" => {}
            Some(Value::Array(ts)) if ts.iter().any(|t| t == "object") => {}
            Some(t) => return Err(format!("parameters of type {t}: DSML writes an object")),
        }
        // Each property's schema is compiled on its own, with the root's definitions for its
        // `$ref`s.
        let defs: Map<String, Value> = ["$defs", "definitions"]
            .iter()
            .filter_map(|k| o.get(*k).map(|v| (k.to_string(), v.clone())))
            .collect();
        let compile = |what: &str, s: &Value| -> Result<Option<Prop>, String> {
            let s = match s {
                Value::Bool(false) => return Ok(None),
                Value::Bool(true) => json!({}),
                Value::Object(m) => {
                    let mut m = m.clone();
                    for (k, v) in &defs {
                        m.entry(k.clone()).or_insert_with(|| v.clone());
                    }
                    Value::Object(m)
                }
                other => return Err(format!("{what}: {other} is not a schema")),
            };
            let schema = Schema::compile(&s).map_err(|e| format!("{what}: {e}"))?;
            let p = Prop::new(schema);
            Ok((p.as_str || p.as_json).then_some(p))
        };
        let mut props = Vec::new();
        let mut listed: Vec<&str> = Vec::new();
        let mut forbidden = Vec::new();
        match o.get("properties") {
            None => {}
            Some(Value::Object(ps)) => {
                for (name, s) in ps {
                    listed.push(name);
                    if !name_writable(name.as_bytes()) {
                        return Err(format!(
                            "property {name:?} cannot be written as a DSML name"
                        ));
                    }
                    match compile(&format!("property `{name}`"), s)? {
                        Some(p) => props.push((name.as_bytes().to_vec(), p)),
                        None => forbidden.push(name.as_bytes().to_vec()),
                    }
                }
            }
            Some(other) => return Err(format!("properties must be an object, not {other}")),
        }
        if props.len() > MAX_PROPERTIES {
            return Err(format!(
                "{} properties: DSML parameters are held for up to {MAX_PROPERTIES}",
                props.len()
            ));
        }
        let extra = match o.get("additionalProperties") {
            // Not said, where the parameters are listed: only those, as structured output
            // reads such a schema.
            None if crate::json_schema::closed_by_default(o) => None,
            None => compile("additionalProperties", &Value::Bool(true))?,
            Some(s) => compile("additionalProperties", s)?,
        };
        let mut required = vec![false; props.len()];
        let mut required_extra = Vec::new();
        for r in o
            .get("required")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            let r = r
                .as_str()
                .ok_or_else(|| format!("required lists {r}, not a name"))?;
            if let Some(i) = props.iter().position(|(n, _)| n == r.as_bytes()) {
                required[i] = true;
            } else if listed.contains(&r) || extra.is_none() || !extra_name_ok(r.as_bytes()) {
                return Err(format!("required parameter `{r}` can take no value"));
            } else {
                required_extra.push(r.as_bytes().to_vec());
            }
        }
        Ok(Arc::new(DsmlSpec {
            props,
            extra,
            required_extra,
            required,
            forbidden,
        }))
    }
}

/// A name the schema does not list: an identifier (module docs).
fn extra_name_ok(n: &[u8]) -> bool {
    !n.is_empty()
        && n.len() <= MAX_EXTRA_NAME
        && n.iter()
            .all(|&b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.' | b'$'))
}

/// Which parameter a value is being written for.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Which {
    Listed(usize),
    Extra(Vec<u8>),
}

#[derive(Clone, Debug)]
enum At {
    /// Markup: `n` bytes of the newline (after a parameter) and then of a parameter's opening
    /// (while `open`) or of the end (while `end`).
    Between {
        newline: bool,
        n: usize,
        open: bool,
        end: bool,
    },
    /// A parameter's name, as written so far.
    Name(Vec<u8>),
    /// ` string="true">` (while `raw`) or ` string="false">` (while `json`), `n` bytes written.
    Flag {
        which: Which,
        n: usize,
        raw: bool,
        json: bool,
    },
    /// A raw value (`string="true"`): the schema state of the JSON string so far (its opening
    /// quote fed), and the bytes written that may be the start of the closing marker.
    Raw {
        which: Which,
        state: SchemaState,
        pending: Vec<u8>,
    },
    /// A JSON value (`string="false"`).
    Json { which: Which, state: SchemaState },
    /// The closing marker after a complete JSON value, `n` bytes written.
    Close { which: Which, n: usize },
    /// The invoke and the block are closed.
    Done,
    /// A byte was refused: nothing follows (the state is not used after a refusal, but it must
    /// never read as complete).
    Dead,
}

/// Where a forced call's DSML parameters stand (module docs).
#[derive(Clone, Debug)]
pub struct DsmlState {
    spec: Arc<DsmlSpec>,
    /// Listed properties written, a bit each (cheap to clone: the engine clones the state for
    /// every token it checks).
    given: u128,
    /// Other names written.
    extra_given: Vec<Vec<u8>>,
    at: At,
    /// The last bytes of the current value (up to the marker's length, the newest last), to
    /// find `｜DSML｜` in it.
    recent: [u8; DSML.len()],
    /// What closes the parameters: the invoke and the block, or the invoke alone.
    end: &'static [u8],
}

impl DsmlState {
    pub fn new(spec: Arc<DsmlSpec>) -> DsmlState {
        DsmlState {
            given: 0,
            spec,
            extra_given: Vec::new(),
            at: At::Between {
                newline: false,
                n: 0,
                open: true,
                end: true,
            },
            recent: [0; DSML.len()],
            end: END,
        }
    }

    /// The grammar complete once the invoke closes (`</｜DSML｜invoke>`), for an answer that
    /// may go on with another call or close the block itself (a "required" answer's calls).
    pub fn ending_at_invoke(mut self) -> DsmlState {
        self.end = INVOKE_END;
        self
    }

    fn is_given(&self, i: usize) -> bool {
        self.given >> i & 1 == 1
    }

    /// Inside a value's string whose bytes are free: any bytes but `"`, `\`, control bytes,
    /// `<` and 0xEF (the first byte of `｜`) are taken without a check (the engine's shortcut,
    /// as JSON mode's `in_plain_string`).
    pub fn in_plain_value(&self) -> bool {
        // (After the first bytes of `｜`, a token of its last bytes could finish the marker.)
        let r = &self.recent;
        let partial = r[r.len() - 1] == 0xEF || r[r.len() - 2..] == [0xEF, 0xBD];
        !partial
            && match &self.at {
                At::Raw { state, pending, .. } => pending.is_empty() && state.in_plain_string(),
                At::Json { state, .. } => state.in_plain_string(),
                _ => false,
            }
    }

    /// The invoke and the call block are closed: only a stop token may follow.
    pub fn is_complete(&self) -> bool {
        matches!(self.at, At::Done)
    }

    /// Feeds every byte; false (the state then undefined) as soon as one does not fit.
    pub fn feed_all(&mut self, bytes: &[u8]) -> bool {
        bytes.iter().all(|&b| self.feed(b))
    }

    /// Another parameter can be written.
    fn param_may_open(&self) -> bool {
        (0..self.spec.props.len()).any(|i| !self.is_given(i)) || self.spec.extra.is_some()
    }

    /// Every required parameter is written.
    fn may_end(&self) -> bool {
        self.spec
            .required
            .iter()
            .enumerate()
            .all(|(i, r)| !r || self.is_given(i))
            && self
                .spec
                .required_extra
                .iter()
                .all(|r| self.extra_given.contains(r))
    }

    fn prop(&self, which: &Which) -> &Prop {
        match which {
            Which::Listed(i) => &self.spec.props[*i].1,
            Which::Extra(_) => self.spec.extra.as_ref().expect("extra names are allowed"),
        }
    }

    /// Takes a value byte: false where it completes `｜DSML｜`.
    fn value_byte(&mut self, b: u8) -> bool {
        self.recent.rotate_left(1);
        self.recent[DSML.len() - 1] = b;
        self.recent != DSML
    }

    /// Feeds value bytes of a raw string to its JSON string state, escaped as the parser
    /// writes them.
    fn raw_bytes(&mut self, state: &mut SchemaState, bytes: &[u8]) -> bool {
        for &b in bytes {
            if !self.value_byte(b) {
                return false;
            }
            let ok = match b {
                b'"' => state.feed_all(b"\\\""),
                b'\\' => state.feed_all(b"\\\\"),
                b'\n' => state.feed_all(b"\\n"),
                b'\r' => state.feed_all(b"\\r"),
                b'\t' => state.feed_all(b"\\t"),
                0x08 => state.feed_all(b"\\b"),
                0x0C => state.feed_all(b"\\f"),
                c if c < 0x20 => state.feed_all(format!("\\u{c:04x}").as_bytes()),
                c => state.feed(c),
            };
            if !ok {
                return false;
            }
        }
        true
    }

    /// A raw value's next byte: Some(true) where it closes the value, Some(false) where the
    /// value goes on, None where it is refused. `pending` holds the bytes that may begin the
    /// closing marker.
    fn raw_byte(&mut self, state: &mut SchemaState, pending: &mut Vec<u8>, b: u8) -> Option<bool> {
        // Text (the common case): one byte into the string.
        if pending.is_empty() && b != b'<' {
            return self.raw_bytes(state, &[b]).then_some(false);
        }
        pending.push(b);
        if !PARAM_CLOSE.starts_with(pending) {
            // Not the closing marker: the bytes before a new `<` are text.
            let keep = usize::from(b == b'<');
            let text: Vec<u8> = pending.drain(..pending.len() - keep).collect();
            if !self.raw_bytes(state, &text) {
                return None;
            }
            if pending.is_empty() {
                return Some(false);
            }
        }
        // The value may end at the marker: its string must be able to close there, or else the
        // bytes so far must be able to go on as text.
        let mut closed = state.clone();
        let closable = closed.feed(b'"') && closed.is_complete();
        if pending.len() == PARAM_CLOSE.len() {
            return closable.then_some(true);
        }
        (closable || self.clone().raw_bytes(&mut state.clone(), pending)).then_some(false)
    }

    fn finish_value(&mut self, which: Which) {
        match which {
            Which::Listed(i) => self.given |= 1 << i,
            Which::Extra(n) => self.extra_given.push(n),
        }
        self.recent = [0; DSML.len()];
        self.at = At::Between {
            newline: true,
            n: 0,
            open: true,
            end: true,
        };
    }

    /// The next byte; false if it leaves the grammar.
    pub fn feed(&mut self, b: u8) -> bool {
        let at = std::mem::replace(&mut self.at, At::Dead);
        match at {
            At::Between {
                newline,
                n,
                open,
                end,
            } => {
                // The encoder's call without parameters: a blank line before the end.
                if !newline && n == 0 && b == b'\n' && end && self.may_end() {
                    self.at = At::Between {
                        newline: true,
                        n: 1,
                        open: false,
                        end: true,
                    };
                    return true;
                }
                if newline && n == 0 {
                    self.at = At::Between {
                        newline,
                        n: 1,
                        open,
                        end,
                    };
                    return b == b'\n';
                }
                let k = n - usize::from(newline);
                let open = open && self.param_may_open() && PARAM_OPEN.get(k) == Some(&b);
                let end = end && self.may_end() && self.end.get(k) == Some(&b);
                if open && k + 1 == PARAM_OPEN.len() {
                    self.at = At::Name(Vec::new());
                } else if end && k + 1 == self.end.len() {
                    self.at = At::Done;
                } else if open || end {
                    self.at = At::Between {
                        newline,
                        n: n + 1,
                        open,
                        end,
                    };
                } else {
                    return false;
                }
                true
            }
            At::Name(mut name) => {
                if b == b'"' {
                    let listed = self.spec.props.iter().position(|(n, _)| *n == name);
                    let which = match listed {
                        Some(i) if !self.is_given(i) => Which::Listed(i),
                        Some(_) => return false,
                        None if self.spec.extra.is_some()
                            && extra_name_ok(&name)
                            && !self.extra_given.contains(&name)
                            && !self.spec.forbidden.contains(&name) =>
                        {
                            Which::Extra(name)
                        }
                        None => return false,
                    };
                    self.at = At::Flag {
                        which,
                        n: 0,
                        raw: true,
                        json: true,
                    };
                    return true;
                }
                name.push(b);
                let ok = self
                    .spec
                    .props
                    .iter()
                    .enumerate()
                    .any(|(i, (n, _))| !self.is_given(i) && n.starts_with(&name))
                    || self.spec.extra.is_some()
                        && extra_name_ok(&name)
                        // (At the longest length, the name must be one that can close.)
                        && (name.len() < MAX_EXTRA_NAME
                            || !self.extra_given.contains(&name)
                                && !self.spec.forbidden.contains(&name));
                self.at = At::Name(name);
                ok
            }
            At::Flag {
                which,
                n,
                raw,
                json,
            } => {
                let p = self.prop(&which);
                let s = raw && p.as_str && FLAG_STR.get(n) == Some(&b);
                let j = json && p.as_json && FLAG_JSON.get(n) == Some(&b);
                let schema = p.schema.clone();
                if s && n + 1 == FLAG_STR.len() {
                    let mut state = SchemaState::new(schema);
                    if !state.feed(b'"') {
                        return false;
                    }
                    self.at = At::Raw {
                        which,
                        state,
                        pending: Vec::new(),
                    };
                } else if j && n + 1 == FLAG_JSON.len() {
                    self.at = At::Json {
                        which,
                        state: SchemaState::new(schema),
                    };
                } else if s || j {
                    self.at = At::Flag {
                        which,
                        n: n + 1,
                        raw: s,
                        json: j,
                    };
                } else {
                    return false;
                }
                true
            }
            At::Raw {
                which,
                mut state,
                mut pending,
            } => match self.raw_byte(&mut state, &mut pending, b) {
                Some(true) => {
                    self.finish_value(which);
                    true
                }
                Some(false) => {
                    self.at = At::Raw {
                        which,
                        state,
                        pending,
                    };
                    true
                }
                None => false,
            },
            At::Json { which, mut state } => {
                if b == b'<' && state.is_complete() {
                    self.at = At::Close { which, n: 1 };
                    return true;
                }
                if !self.value_byte(b) || !state.feed(b) {
                    return false;
                }
                self.at = At::Json { which, state };
                true
            }
            At::Close { which, n } => {
                if PARAM_CLOSE.get(n) != Some(&b) {
                    return false;
                }
                if n + 1 == PARAM_CLOSE.len() {
                    self.finish_value(which);
                } else {
                    self.at = At::Close { which, n: n + 1 };
                }
                true
            }
            At::Done | At::Dead => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cachalot_model::tokenizer::dsv4::{self, EncodeOptions, ToolCall, V4Message};
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    /// The invoke's opening the forced prompt ends with.
    const HEAD: &str = "\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"f\">\n";

    /// The encoder's DSML for a call of `f` with `args`, after the invoke's opening.
    fn rendered(args: &Value) -> String {
        let msgs = [
            V4Message::new("user", "?"),
            V4Message::assistant("", "", vec![ToolCall::function("f", args.to_string())]),
        ];
        let text = dsv4::encode_messages(&msgs, &EncodeOptions::default()).unwrap();
        let from = text.find(HEAD).expect("the call's opening") + HEAD.len();
        let end = "</｜DSML｜tool_calls>";
        let to = text[from..].find(end).unwrap() + from + end.len();
        text[from..to].to_string()
    }

    fn state(schema: &Value) -> DsmlState {
        DsmlState::new(DsmlSpec::compile(schema).unwrap())
    }

    /// The arguments (JSON text) a complete answer parses to, checked against the whole
    /// schema.
    fn parsed_args(text: &str, schema: &Value) -> String {
        let (_, calls) = dsv4::parse_answer(&format!("{HEAD}{text}")).unwrap();
        assert_eq!(calls.len(), 1);
        let args = calls[0].function.arguments.as_str().unwrap().to_string();
        let mut whole = SchemaState::new(Schema::compile(schema).unwrap());
        assert!(
            whole.feed_all(args.as_bytes()) && whole.is_complete(),
            "{args} against {schema}"
        );
        args
    }

    fn weather() -> Value {
        json!({"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 12},
            "days": {"type": "integer", "minimum": 1, "maximum": 7},
            "units": {"enum": ["metric", "imperial"]},
            "when": {"anyOf": [{"type": "string"}, {"type": "null"}]},
            "tags": {"type": "array", "items": {"$ref": "#/$defs/tag"}, "maxItems": 3}},
            "required": ["city", "days"], "additionalProperties": false,
            "$defs": {"tag": {"type": "string", "maxLength": 5}}})
    }

    /// Ending at the invoke (more calls may follow): complete at `</｜DSML｜invoke>`, the
    /// block's close not taken; the required names are still needed first.
    #[test]
    fn a_grammar_ending_at_the_invoke() {
        let args = json!({"city": "Paris", "days": 3});
        let text = rendered(&args);
        let upto = text.find("</｜DSML｜invoke>").unwrap() + "</｜DSML｜invoke>".len();
        let mut st = state(&weather()).ending_at_invoke();
        assert!(st.feed_all(&text.as_bytes()[..upto]), "{text:?}");
        assert!(st.is_complete());
        assert!(!st.clone().feed(b'\n'));
        let mut early = state(&weather()).ending_at_invoke();
        assert!(!early.feed_all("</｜DSML｜invoke>".as_bytes()));
    }

    /// What the encoder writes for arguments the schema accepts is taken and complete, and
    /// parses back to those arguments.
    #[test]
    fn the_encoders_calls_are_taken() {
        let s = weather();
        for args in [
            json!({"city": "Paris", "days": 3}),
            json!({"days": 7, "city": "a \"q\"\nb\\x", "units": "imperial"}),
            json!({"city": "", "days": 1, "when": null, "tags": ["a", "bc"]}),
            json!({"city": "Zürich <b>", "days": 2, "when": "now"}),
        ] {
            let text = rendered(&args);
            let mut st = state(&s);
            assert!(st.feed_all(text.as_bytes()), "{text:?}");
            assert!(st.is_complete(), "{text:?}");
            assert!(!st.clone().feed(b'\n'));
            let back: Value = serde_json::from_str(&parsed_args(&text, &s)).unwrap();
            assert_eq!(back, args);
        }
        // No parameters: the encoder's blank line before the end, or the end at once.
        let free = json!({"type": "object", "properties": {"q": {"type": "string"}}});
        let bare = "</｜DSML｜invoke>\n</｜DSML｜tool_calls>";
        for text in [rendered(&json!({})), bare.to_string()] {
            let mut st = state(&free);
            assert!(st.feed_all(text.as_bytes()), "{text:?}");
            assert!(st.is_complete());
            assert_eq!(parsed_args(&text, &free), "{}");
        }
        assert!(rendered(&json!({})).starts_with('\n'));
        // Values that open with any digit.
        let digits = json!({"type": "object", "properties": {
            "n": {"type": "integer", "minimum": 2, "maximum": 6}, "e": {"enum": [4, 8]},
            "x": {"type": "number", "minimum": 2.5, "maximum": 3.5}},
            "required": ["n", "e", "x"]});
        let args = json!({"n": 5, "e": 8, "x": 3.25});
        let mut st = state(&digits);
        assert!(st.feed_all(rendered(&args).as_bytes()) && st.is_complete());
    }

    /// Whether `text` (after the invoke's opening) is refused somewhere.
    fn refused(schema: &Value, text: &str) -> bool {
        !state(schema).feed_all(text.as_bytes())
    }

    #[test]
    fn what_the_schema_refuses_is_refused() {
        let s = weather();
        let p = |k: &str, flag: &str, v: &str| {
            format!("<｜DSML｜parameter name=\"{k}\" string=\"{flag}\">{v}</｜DSML｜parameter>\n")
        };
        let end = "</｜DSML｜invoke>";
        // A name not listed, in a closed object.
        assert!(refused(&s, &p("town", "true", "x")));
        // An integer as a string, a string as JSON that is not a string.
        assert!(refused(&s, &p("days", "true", "3")));
        assert!(refused(&s, &p("city", "false", "3")));
        // A quoted string is JSON too.
        assert!(!refused(&s, &p("city", "false", "\"Paris\"")));
        // Out of range, too long, not in the enum.
        assert!(refused(&s, &p("days", "false", "8")));
        assert!(refused(&s, &p("city", "true", "abcdefghijklm")));
        assert!(refused(&s, &p("units", "true", "kelvin")));
        // The same parameter twice.
        assert!(refused(
            &s,
            &format!("{}{}", p("days", "false", "2"), p("days", "false", "3"))
        ));
        // The invoke cannot close before the required ones.
        assert!(refused(&s, &format!("{}{end}", p("days", "false", "2"))));
        assert!(!refused(
            &s,
            &format!("{}{}{end}", p("days", "false", "2"), p("city", "true", "x"))
        ));
        // No value holds the marker.
        assert!(refused(&s, &p("city", "true", "a｜DSML｜")));
        assert!(refused(&s, &p("tags", "false", "[\"｜DSML｜\"]")));
        // A `<` in a raw value is text unless the closing marker follows.
        assert!(!refused(&s, &p("city", "true", "a<b</x")));
        // Markup must be exact.
        assert!(refused(
            &s,
            "<｜DSML｜parameter name=\"city\" string=\"yes\">"
        ));
        assert!(refused(&s, "<｜DSML｜parax"));
        assert!(refused(&s, "\n"));
        // Other names where the object is open, each once, under additionalProperties.
        let open = json!({"type": "object", "properties": {"a": {"type": "integer"}},
                          "additionalProperties": {"type": "boolean"}});
        assert!(!refused(&open, &p("zeta", "false", "true")));
        assert!(refused(&open, &p("zeta", "false", "1")));
        assert!(refused(&open, &p("zeta", "true", "x")));
        assert!(refused(
            &open,
            &format!("{}{}", p("z", "false", "true"), p("z", "false", "true"))
        ));
        // A listed name no value fits is not another name either.
        let never = json!({"type": "object", "properties": {"a": false, "b": {}},
                           "additionalProperties": true});
        assert!(refused(&never, &p("a", "true", "x")));
        assert!(!refused(&never, &p("c", "true", "x")));
        // Listed parameters and nothing said of others: only those (as structured output).
        let listed = json!({"type": "object", "properties": {"a": {}, "b": {}}});
        assert!(refused(&listed, &p("c", "true", "x")));
        assert!(!refused(&listed, &p("b", "true", "x")));
        // A refused byte never leaves the state complete.
        let mut st = state(&s);
        assert!(!st.feed(b'x'));
        assert!(!st.is_complete());
        // An unlisted name of the longest length that was written already: no dead end.
        let long = "z".repeat(MAX_EXTRA_NAME);
        let mut st = state(&open);
        assert!(st.feed_all(p(&long, "false", "true").as_bytes()));
        assert!(st.feed_all(format!("<｜DSML｜parameter name=\"{}", &long[1..]).as_bytes()));
        assert!(!st.clone().feed(b'z'));
        // A required name the schema does not list.
        let req = json!({"type": "object", "required": ["q"]});
        assert!(refused(&req, end));
        assert!(!refused(&req, &format!("{}{end}", p("q", "true", "x"))));
    }

    /// The engine's shortcut inside values is off where a token of `｜`'s last bytes could
    /// finish the marker.
    #[test]
    fn the_plain_value_shortcut_stops_at_a_partial_marker() {
        let mut st = state(&json!({}));
        assert!(st.feed_all(b"<\xEF\xBD\x9CDSML\xEF\xBD\x9Cparameter name=\"q\" string=\"true\">a"));
        assert!(st.in_plain_value());
        assert!(st.feed_all("｜DSML".as_bytes()));
        assert!(st.in_plain_value());
        assert!(st.feed(0xEF));
        assert!(!st.in_plain_value());
        assert!(st.feed(0xBD));
        assert!(!st.in_plain_value());
        assert!(!st.clone().feed(0x9C));
    }

    /// Parameters [`DsmlSpec::compile`] refuses still take their listed names, whatever their
    /// bytes, with any values.
    #[test]
    fn lenient_parameters_keep_their_names() {
        let schema = json!({"type": "object", "minProperties": 1,
                            "properties": {"城市 name": {"type": "string"}}});
        assert!(DsmlSpec::compile(&schema).is_err());
        let mut st = DsmlState::new(DsmlSpec::lenient(&schema));
        let text = rendered(&json!({"城市 name": [1]}));
        assert!(st.feed_all(text.as_bytes()) && st.is_complete(), "{text:?}");
    }

    #[test]
    fn parameters_dsml_cannot_hold_are_refused_by_name() {
        for (schema, word) in [
            (
                json!({"type": "object", "patternProperties": {"^a": {}}}),
                "patternProperties",
            ),
            (
                json!({"type": "object", "minProperties": 1}),
                "minProperties",
            ),
            (json!({"type": "array"}), "type"),
            (
                json!({"type": "object", "properties": {"a": false}, "required": ["a"]}),
                "`a`",
            ),
            (
                json!({"type": "object", "properties": {"a": {"type": "strin"}}}),
                "`a`",
            ),
            (
                json!({"additionalProperties": false, "required": ["b"]}),
                "`b`",
            ),
        ] {
            let e = DsmlSpec::compile(&schema).unwrap_err();
            assert!(e.contains(word), "{schema}: {e}");
        }
        assert!(DsmlSpec::compile(&json!({})).is_ok());
        assert!(DsmlSpec::compile(&json!(true)).is_ok());
    }

    /// Random walks through the grammar: every prefix has a next byte (no dead ends), and
    /// every complete walk parses to arguments the whole schema accepts.
    #[test]
    fn random_walks_end_in_valid_calls() {
        let schemas = [
            weather(),
            json!({"type": "object", "properties": {"a": {"type": "boolean"},
                   "b": {"type": "number", "minimum": -2, "maximum": 2},
                   "c": {"type": "string", "minLength": 2, "maxLength": 4}},
                   "required": ["c"]}),
            json!({}),
        ];
        let alphabet: Vec<u8> = (0x20..0x7F).chain([b'\n']).collect();
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        let mut complete = 0;
        for i in 0..300 {
            let schema = &schemas[i % schemas.len()];
            let mut st = state(schema);
            let mut text = Vec::new();
            for _ in 0..600 {
                if st.is_complete() {
                    break;
                }
                // Markup and closing markers take their bytes as they come (any byte, UTF-8
                // included); values take ASCII, `<` often, so that they end.
                let in_value = matches!(st.at, At::Raw { .. } | At::Json { .. } | At::Name(_));
                let ok: Vec<u8> = (0..=255u8).filter(|&b| st.clone().feed(b)).collect();
                assert!(
                    !ok.is_empty(),
                    "dead end after {:?}",
                    String::from_utf8_lossy(&text)
                );
                let ascii: Vec<u8> = ok
                    .iter()
                    .copied()
                    .filter(|b| alphabet.contains(b))
                    .collect();
                let ok = if in_value && !ascii.is_empty() {
                    ascii
                } else {
                    ok
                };
                let b = if ok.contains(&b'<') && rng.random_bool(0.2) {
                    b'<'
                } else if ok.contains(&b'"') && rng.random_bool(0.1) {
                    b'"'
                } else {
                    ok[rng.random_range(0..ok.len())]
                };
                assert!(st.feed(b));
                text.push(b);
            }
            if st.is_complete() {
                complete += 1;
                parsed_args(std::str::from_utf8(&text).unwrap(), schema);
            }
        }
        assert!(complete > 50, "{complete} walks completed");
    }
}
