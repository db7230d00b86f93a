//! Structured output (OpenAI's `response_format: {"type": "json_schema"}`): an incremental
//! recognizer of one JSON value that a JSON Schema accepts, byte by byte, for the same masking
//! as JSON mode ([`crate::json_mode`], whose whitespace and nesting bounds it keeps).
//!
//! The schema is compiled once ([`Schema::compile`]) into nodes; the keywords that shape the
//! grammar are honoured: `type` (one or a list), `properties`, `required`,
//! `additionalProperties` (true by default, false, or a schema), `items`, `minItems`,
//! `maxItems`, `enum` and `const` (of strings, numbers, booleans and null), `anyOf`/`oneOf`
//! whose branches differ in type (as `Optional[...]` writes them), and `$ref` into `$defs` or
//! `definitions` (recursion included). Annotations (`title`, `description`, `default`,
//! `examples`, `format`, ...) are ignored. Any other keyword (`pattern`, `minLength`,
//! `minimum`, `allOf`, ...) is refused by name at compile time rather than silently not
//! enforced. An object's keys are written at most once; a closed object takes only its
//! properties, and it can only close once its required ones are there.

use std::sync::Arc;

use serde_json::Value;

use crate::json_mode::{
    number_byte, string_byte, Num, MAX_DEPTH, MAX_EDGE_WHITESPACE, MAX_WHITESPACE,
};

const STR: u8 = 1;
const INT: u8 = 2;
const NUM: u8 = 4;
const BOOL: u8 = 8;
const NULL: u8 = 16;
const OBJ: u8 = 32;
const ARR: u8 = 64;
const ALL: u8 = 127;

/// Keys of an object a schema may list (a bit each in the recognizer).
const MAX_PROPERTIES: usize = 64;
/// The longest key remembered in an open object (longer ones are "other" keys).
const MAX_KEY: usize = 256;

/// Keywords that only annotate.
const ANNOTATIONS: [&str; 12] = [
    "title",
    "description",
    "default",
    "examples",
    "format",
    "$schema",
    "$id",
    "$comment",
    "deprecated",
    "readOnly",
    "writeOnly",
    "strict",
];

#[derive(Clone, Debug)]
struct Node {
    types: u8,
    /// Property names and their nodes.
    props: Vec<(Vec<u8>, usize)>,
    /// Bits of `props` that must be present.
    required: u64,
    /// The node of other keys; None: no others.
    additional: Option<usize>,
    items: usize,
    min_items: usize,
    max_items: usize,
    /// The allowed values' compact JSON texts.
    enumv: Option<Vec<Vec<u8>>>,
}

/// A compiled JSON Schema (module docs): node 0 is the root, node 1 accepts anything.
#[derive(Debug)]
pub struct Schema {
    nodes: Vec<Node>,
}

fn any_node() -> Node {
    Node {
        types: ALL,
        props: Vec::new(),
        required: 0,
        additional: Some(1),
        items: 1,
        min_items: 0,
        max_items: usize::MAX,
        enumv: None,
    }
}

impl Schema {
    /// Compiles `schema`; the error names the keyword (and where) that cannot be enforced.
    pub fn compile(schema: &Value) -> Result<Arc<Schema>, String> {
        let mut c = Compiler {
            root: schema,
            nodes: vec![any_node(), any_node()],
            refs: Vec::new(),
        };
        let n = c.node(schema, "#", 0)?;
        c.nodes[0] = c.nodes[n].clone();
        Ok(Arc::new(Schema { nodes: c.nodes }))
    }
}

struct Compiler<'a> {
    root: &'a Value,
    nodes: Vec<Node>,
    /// `$ref` targets compiled (or being compiled) and their nodes.
    refs: Vec<(String, usize)>,
}

impl Compiler<'_> {
    fn node(&mut self, s: &Value, at: &str, depth: usize) -> Result<usize, String> {
        if depth > MAX_DEPTH {
            return Err(format!("{at}: the schema nests deeper than {MAX_DEPTH}"));
        }
        let obj = match s {
            Value::Bool(true) => return Ok(1),
            Value::Bool(false) => return Err(format!("{at}: the schema `false` accepts nothing")),
            Value::Object(o) => o,
            other => {
                return Err(format!(
                    "{at}: a schema is an object or a boolean, not {other}"
                ))
            }
        };
        if let Some(r) = obj.get("$ref") {
            let r = r
                .as_str()
                .ok_or_else(|| format!("{at}/$ref: not a string"))?;
            if let Some(&(_, n)) = self.refs.iter().find(|(k, _)| k == r) {
                return Ok(n);
            }
            let target = r
                .strip_prefix("#/$defs/")
                .map(|k| ("$defs", k))
                .or_else(|| r.strip_prefix("#/definitions/").map(|k| ("definitions", k)))
                .and_then(|(section, k)| self.root.get(section)?.get(k))
                .ok_or_else(|| {
                    format!(
                        "{at}/$ref: {r:?} is not a schema under this schema's $defs or definitions"
                    )
                })?;
            // Reserved before compiling, so a recursive reference finds it.
            let n = self.nodes.len();
            self.nodes.push(any_node());
            self.refs.push((r.to_string(), n));
            let t = self.node(target, r, depth + 1)?;
            self.nodes[n] = self.nodes[t].clone();
            return Ok(n);
        }
        for k in obj.keys() {
            let known = matches!(
                k.as_str(),
                "type"
                    | "properties"
                    | "required"
                    | "additionalProperties"
                    | "items"
                    | "minItems"
                    | "maxItems"
                    | "enum"
                    | "const"
                    | "anyOf"
                    | "oneOf"
                    | "$defs"
                    | "definitions"
            ) || ANNOTATIONS.contains(&k.as_str());
            if !known {
                return Err(format!(
                    "{at}: the keyword `{k}` is not supported in structured output (supported: \
                     type, properties, required, additionalProperties, items, minItems, \
                     maxItems, enum, const, anyOf, oneOf, $ref/$defs)"
                ));
            }
        }
        if let Some(alts) = obj.get("anyOf").or_else(|| obj.get("oneOf")) {
            return self.union(obj, alts, at, depth);
        }
        let mut node = any_node();
        node.types = match obj.get("type") {
            None if obj.contains_key("properties") => OBJ,
            None if obj.contains_key("items") => ARR,
            None => ALL,
            Some(t) => types_of(t).ok_or_else(|| format!("{at}/type: {t} is not a JSON type"))?,
        };
        let values = match (obj.get("enum"), obj.get("const")) {
            (Some(Value::Array(vs)), _) => Some(vs.clone()),
            (Some(e), _) => return Err(format!("{at}/enum: {e} is not a list")),
            (None, Some(v)) => Some(vec![v.clone()]),
            (None, None) => None,
        };
        if let Some(vs) = values {
            let mut texts = Vec::new();
            for v in &vs {
                if v.is_object() || v.is_array() {
                    return Err(format!(
                        "{at}: enum and const values that are objects or arrays are not supported"
                    ));
                }
                if types_of_value(v) & node.types == 0 {
                    continue;
                }
                texts.push(v.to_string().into_bytes());
            }
            if texts.is_empty() {
                return Err(format!("{at}: no enum value has the schema's type"));
            }
            node.enumv = Some(texts);
        }
        if let Some(p) = obj.get("properties") {
            let p = p
                .as_object()
                .ok_or_else(|| format!("{at}/properties: not an object"))?;
            if p.len() > MAX_PROPERTIES {
                return Err(format!(
                    "{at}/properties: {} properties; structured output takes at most {MAX_PROPERTIES}",
                    p.len()
                ));
            }
            for (k, v) in p {
                if k.bytes().any(|b| b == b'"' || b == b'\\' || b < 0x20) {
                    return Err(format!(
                        "{at}/properties: the name {k:?} holds a quote, backslash or control \
                         character (not supported)"
                    ));
                }
                let n = self.node(v, &format!("{at}/properties/{k}"), depth + 1)?;
                node.props.push((k.as_bytes().to_vec(), n));
            }
        }
        if let Some(r) = obj.get("required") {
            let r = r
                .as_array()
                .ok_or_else(|| format!("{at}/required: not a list"))?;
            for name in r {
                let name = name
                    .as_str()
                    .ok_or_else(|| format!("{at}/required: {name} is not a string"))?;
                let i = node
                    .props
                    .iter()
                    .position(|(k, _)| k == name.as_bytes())
                    .ok_or_else(|| {
                        format!("{at}/required: {name:?} is not one of the schema's properties")
                    })?;
                node.required |= 1 << i;
            }
        }
        node.additional = match obj.get("additionalProperties") {
            None | Some(Value::Bool(true)) => Some(1),
            Some(Value::Bool(false)) => None,
            Some(s) => Some(self.node(s, &format!("{at}/additionalProperties"), depth + 1)?),
        };
        if let Some(items) = obj.get("items") {
            node.items = self.node(items, &format!("{at}/items"), depth + 1)?;
        }
        let count = |k: &str| -> Result<Option<usize>, String> {
            obj.get(k)
                .map(|v| {
                    v.as_u64()
                        .map(|n| n as usize)
                        .ok_or_else(|| format!("{at}/{k}: {v} is not a count"))
                })
                .transpose()
        };
        node.min_items = count("minItems")?.unwrap_or(0);
        node.max_items = count("maxItems")?.unwrap_or(usize::MAX);
        if node.min_items > node.max_items {
            return Err(format!("{at}: minItems is above maxItems"));
        }
        let n = self.nodes.len();
        self.nodes.push(node);
        Ok(n)
    }

    /// `anyOf`/`oneOf`: one node whose types are the union, when at most one branch takes
    /// objects, one arrays, and no two share a type (the branch is then known from the value's
    /// first byte).
    fn union(
        &mut self,
        obj: &serde_json::Map<String, Value>,
        alts: &Value,
        at: &str,
        depth: usize,
    ) -> Result<usize, String> {
        if obj.keys().any(|k| {
            !ANNOTATIONS.contains(&k.as_str())
                && !matches!(k.as_str(), "anyOf" | "oneOf" | "$defs" | "definitions")
        }) {
            return Err(format!(
                "{at}: anyOf/oneOf beside other constraints is not supported"
            ));
        }
        let alts = alts
            .as_array()
            .filter(|a| !a.is_empty())
            .ok_or_else(|| format!("{at}/anyOf: not a non-empty list"))?;
        let mut merged = any_node();
        merged.types = 0;
        for (i, a) in alts.iter().enumerate() {
            let n = self.node(a, &format!("{at}/anyOf/{i}"), depth + 1)?;
            let b = self.nodes[n].clone();
            // Numbers: an integer branch beside a number branch is the number branch.
            let types = if b.types & NUM != 0 {
                b.types | INT
            } else {
                b.types
            };
            let clash = merged.types & types & !(if merged.types & NUM != 0 { INT } else { 0 });
            if clash != 0 || b.enumv.is_some() && alts.len() > 1 {
                return Err(format!(
                    "{at}/anyOf: branches that share a type (or enums among several branches) \
                     are not supported"
                ));
            }
            merged.types |= types;
            if b.types & OBJ != 0 {
                merged.props = b.props;
                merged.required = b.required;
                merged.additional = b.additional;
            }
            if b.types & ARR != 0 {
                (merged.items, merged.min_items, merged.max_items) =
                    (b.items, b.min_items, b.max_items);
            }
            if alts.len() == 1 {
                merged.enumv = b.enumv;
            }
        }
        let n = self.nodes.len();
        self.nodes.push(merged);
        Ok(n)
    }
}

fn types_of(t: &Value) -> Option<u8> {
    let one = |s: &str| -> Option<u8> {
        Some(match s {
            "string" => STR,
            "integer" => INT,
            "number" => NUM | INT,
            "boolean" => BOOL,
            "null" => NULL,
            "object" => OBJ,
            "array" => ARR,
            _ => return None,
        })
    };
    match t {
        Value::String(s) => one(s),
        Value::Array(ts) => ts
            .iter()
            .try_fold(0u8, |acc, t| Some(acc | one(t.as_str()?)?)),
        _ => None,
    }
}

fn types_of_value(v: &Value) -> u8 {
    match v {
        Value::String(_) => STR,
        Value::Number(n) if n.is_i64() || n.is_u64() => INT | NUM,
        Value::Number(_) => NUM,
        Value::Bool(_) => BOOL,
        Value::Null => NULL,
        Value::Object(_) => OBJ,
        Value::Array(_) => ARR,
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Frame {
    Obj {
        node: usize,
        next: Next,
        /// Bits of the properties written.
        seen: u64,
        /// The node of the value after the key just read.
        value: usize,
    },
    Arr {
        node: usize,
        next: Next,
        count: usize,
    },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Next {
    /// Objects: a key or the end; arrays: a value or the end.
    FirstOrEnd,
    /// A key (objects) or a value (arrays) after a comma.
    Item,
    Colon,
    Value,
    CommaOrEnd,
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Scalar {
    None,
    Str {
        escape: bool,
        hex: u8,
    },
    /// An object's key so far (`escaped`: it held an escape, so it is no property's).
    Key {
        buf: Vec<u8>,
        escape: bool,
        hex: u8,
        escaped: bool,
    },
    Num {
        n: Num,
        integer: bool,
    },
    Lit(&'static [u8]),
    /// An enum value's text so far, against `node`'s values.
    Enum {
        node: usize,
        buf: Vec<u8>,
    },
}

/// Where a JSON value under a [`Schema`] stands (module docs).
#[derive(Clone, Debug)]
pub struct SchemaState {
    schema: Arc<Schema>,
    stack: Vec<Frame>,
    scalar: Scalar,
    started: bool,
    done: bool,
    spaces: usize,
}

impl SchemaState {
    pub fn new(schema: Arc<Schema>) -> SchemaState {
        SchemaState {
            schema,
            stack: Vec::new(),
            scalar: Scalar::None,
            started: false,
            done: false,
            spaces: 0,
        }
    }

    /// In a string whose bytes are free (not an enum's, not a key): any byte but `"`, `\` and
    /// control bytes is accepted without changing the state.
    pub fn in_plain_string(&self) -> bool {
        self.scalar
            == (Scalar::Str {
                escape: false,
                hex: 0,
            })
    }

    /// One value has been written (only whitespace may follow). A number at the top level is
    /// complete when it could end.
    pub fn is_complete(&self) -> bool {
        match &self.scalar {
            Scalar::Num { n, .. } => self.stack.is_empty() && n.complete(),
            Scalar::Enum { node, buf } => {
                self.stack.is_empty() && self.enum_values(*node).iter().any(|v| v == buf)
            }
            Scalar::None => self.done,
            _ => false,
        }
    }

    pub fn feed_all(&mut self, bytes: &[u8]) -> bool {
        bytes.iter().all(|&b| self.feed(b))
    }

    fn enum_values(&self, node: usize) -> &[Vec<u8>] {
        self.schema.nodes[node].enumv.as_deref().unwrap_or(&[])
    }

    pub fn feed(&mut self, b: u8) -> bool {
        match &mut self.scalar {
            Scalar::Str { escape, hex } => {
                let (e, h) = (*escape, *hex);
                match string_byte(b, e, h) {
                    Some(Some((e, h))) => self.scalar = Scalar::Str { escape: e, hex: h },
                    Some(None) => {
                        self.scalar = Scalar::None;
                        self.value_done();
                    }
                    None => return false,
                }
                return true;
            }
            Scalar::Key { .. } => return self.key_byte(b),
            Scalar::Lit(rest) => {
                let rest: &'static [u8] = rest;
                if rest.first() != Some(&b) {
                    return false;
                }
                let rest = &rest[1..];
                self.scalar = if rest.is_empty() {
                    Scalar::None
                } else {
                    Scalar::Lit(rest)
                };
                if self.scalar == Scalar::None {
                    self.value_done();
                }
                return true;
            }
            Scalar::Num { n, integer } => {
                let (n, integer) = (*n, *integer);
                let next = number_byte(n, b)
                    .filter(|next| !integer || matches!(next, Num::Zero | Num::Int));
                if let Some(next) = next {
                    self.scalar = Scalar::Num { n: next, integer };
                    return true;
                }
                if !n.complete() {
                    return false;
                }
                self.scalar = Scalar::None;
                self.value_done();
            }
            Scalar::Enum { node, buf } => {
                let node = *node;
                let mut ext = buf.clone();
                ext.push(b);
                let schema = self.schema.clone();
                let values = schema.nodes[node].enumv.as_deref().unwrap_or(&[]);
                if values.iter().any(|v| v.starts_with(&ext)) {
                    // A string value ends at its closing quote: nothing can follow inside it.
                    if ext.len() > 1 && ext[0] == b'"' && values.contains(&ext) {
                        self.scalar = Scalar::None;
                        self.value_done();
                    } else {
                        self.scalar = Scalar::Enum { node, buf: ext };
                    }
                    return true;
                }
                ext.pop();
                if !values.contains(&ext) {
                    return false;
                }
                // The value ended; the byte belongs to what follows it.
                self.scalar = Scalar::None;
                self.value_done();
            }
            Scalar::None => {}
        }
        if matches!(b, b' ' | b'\t' | b'\n' | b'\r') {
            self.spaces += 1;
            let cap = if self.started && !self.stack.is_empty() {
                MAX_WHITESPACE
            } else {
                MAX_EDGE_WHITESPACE
            };
            return self.spaces <= cap;
        }
        self.spaces = 0;
        if !self.started {
            self.started = true;
            return self.start_value(b, 0);
        }
        let Some(top) = self.stack.last().cloned() else {
            return false;
        };
        match top {
            Frame::Obj {
                node, next, seen, ..
            } => {
                let n = &self.schema.nodes[node];
                let unseen_props = n.props.len() > seen.count_ones() as usize;
                let more = n.additional.is_some() || unseen_props;
                match (next, b) {
                    (Next::FirstOrEnd | Next::CommaOrEnd, b'}') => {
                        if n.required & !seen != 0 {
                            return false;
                        }
                        self.stack.pop();
                        self.value_done();
                        true
                    }
                    (Next::FirstOrEnd | Next::Item, b'"') if more => {
                        self.set_next(Next::Colon);
                        self.scalar = Scalar::Key {
                            buf: Vec::new(),
                            escape: false,
                            hex: 0,
                            escaped: false,
                        };
                        true
                    }
                    (Next::Colon, b':') => {
                        self.set_next(Next::Value);
                        true
                    }
                    (Next::CommaOrEnd, b',') if more => {
                        self.set_next(Next::Item);
                        true
                    }
                    (Next::Value, _) => {
                        let Some(Frame::Obj { value, .. }) = self.stack.last() else {
                            return false;
                        };
                        let value = *value;
                        self.set_next(Next::CommaOrEnd);
                        self.start_value(b, value)
                    }
                    _ => false,
                }
            }
            Frame::Arr { node, next, count } => {
                let n = &self.schema.nodes[node];
                let (min, max, items) = (n.min_items, n.max_items, n.items);
                match (next, b) {
                    (Next::FirstOrEnd | Next::CommaOrEnd, b']') if count >= min => {
                        self.stack.pop();
                        self.value_done();
                        true
                    }
                    (Next::CommaOrEnd, b',') if count < max => {
                        self.set_next(Next::Item);
                        true
                    }
                    (Next::FirstOrEnd | Next::Item, _) if count < max => {
                        if let Some(Frame::Arr { next, count, .. }) = self.stack.last_mut() {
                            *next = Next::CommaOrEnd;
                            *count += 1;
                        }
                        self.start_value(b, items)
                    }
                    _ => false,
                }
            }
        }
    }

    fn set_next(&mut self, to: Next) {
        match self.stack.last_mut() {
            Some(Frame::Obj { next, .. }) | Some(Frame::Arr { next, .. }) => *next = to,
            None => {}
        }
    }

    /// A value of `node` begins with `b`.
    fn start_value(&mut self, b: u8, node: usize) -> bool {
        let n = &self.schema.nodes[node];
        if let Some(values) = &n.enumv {
            if !values.iter().any(|v| v.first() == Some(&b)) {
                return false;
            }
            self.scalar = Scalar::Enum { node, buf: vec![b] };
            return true;
        }
        let t = n.types;
        if matches!(b, b'{' | b'[') && self.stack.len() >= MAX_DEPTH {
            return false;
        }
        match b {
            b'{' if t & OBJ != 0 => {
                self.stack.push(Frame::Obj {
                    node,
                    next: Next::FirstOrEnd,
                    seen: 0,
                    value: 1,
                });
                true
            }
            b'[' if t & ARR != 0 => {
                self.stack.push(Frame::Arr {
                    node,
                    next: Next::FirstOrEnd,
                    count: 0,
                });
                true
            }
            b'"' if t & STR != 0 => {
                self.scalar = Scalar::Str {
                    escape: false,
                    hex: 0,
                };
                true
            }
            b'-' | b'0'..=b'9' if t & (INT | NUM) != 0 => {
                let n = match b {
                    b'-' => Num::Minus,
                    b'0' => Num::Zero,
                    _ => Num::Int,
                };
                self.scalar = Scalar::Num {
                    n,
                    integer: t & NUM == 0,
                };
                true
            }
            b't' if t & BOOL != 0 => {
                self.scalar = Scalar::Lit(b"rue");
                true
            }
            b'f' if t & BOOL != 0 => {
                self.scalar = Scalar::Lit(b"alse");
                true
            }
            b'n' if t & NULL != 0 => {
                self.scalar = Scalar::Lit(b"ull");
                true
            }
            _ => false,
        }
    }

    /// A value ended: at the top level the answer is complete.
    fn value_done(&mut self) {
        if self.stack.is_empty() {
            self.done = true;
        }
    }

    /// A byte of an object's key.
    fn key_byte(&mut self, b: u8) -> bool {
        let Some(Frame::Obj { node, seen, .. }) = self.stack.last().cloned() else {
            return false;
        };
        let n = &self.schema.nodes[node];
        let Scalar::Key {
            buf,
            escape,
            hex,
            escaped,
        } = &mut self.scalar
        else {
            return false;
        };
        let plain = !*escape && *hex == 0;
        if plain && b == b'"' {
            // The key ends: a property not yet written, or (open objects) another key.
            let prop = (!*escaped)
                .then(|| n.props.iter().position(|(p, _)| p == buf))
                .flatten();
            let value = match prop {
                Some(i) if seen & (1 << i) == 0 => {
                    let v = n.props[i].1;
                    if let Some(Frame::Obj { seen, .. }) = self.stack.last_mut() {
                        *seen |= 1 << i;
                    }
                    v
                }
                // Written already.
                Some(_) => return false,
                None => match n.additional {
                    Some(a) => a,
                    None => return false,
                },
            };
            if let Some(Frame::Obj { value: v, .. }) = self.stack.last_mut() {
                *v = value;
            }
            self.scalar = Scalar::None;
            return true;
        }
        match string_byte(b, *escape, *hex) {
            Some(Some((e, h))) => {
                *escaped |= e || h > 0 || *hex > 0;
                (*escape, *hex) = (e, h);
            }
            _ => return false,
        }
        if *escaped {
            // Not a property's name: an open object takes it.
            return n.additional.is_some();
        }
        if buf.len() < MAX_KEY {
            buf.push(b);
        }
        let buf = buf.clone();
        let on_prop = n
            .props
            .iter()
            .enumerate()
            .filter(|(i, _)| seen & (1 << i) == 0)
            .any(|(_, (p, _))| p.starts_with(&buf));
        on_prop || n.additional.is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn accepts(schema: &Value, text: &str) -> (bool, bool) {
        let mut s = SchemaState::new(Schema::compile(schema).unwrap());
        let ok = s.feed_all(text.as_bytes());
        (ok, ok && s.is_complete())
    }

    #[test]
    fn objects_follow_their_schema() {
        let schema = json!({
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "age": {"type": "integer"},
                "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
                "color": {"enum": ["red", "green", 3, null]},
                "ok": {"type": "boolean"},
                "nick": {"anyOf": [{"type": "string"}, {"type": "null"}]},
                "child": {"$ref": "#/$defs/node"}
            },
            "required": ["name", "age"],
            "additionalProperties": false,
            "$defs": {"node": {"type": "object", "properties": {
                "child": {"$ref": "#/$defs/node"}, "v": {"type": "number"}},
                "additionalProperties": false}}
        });
        for good in [
            r#"{"name": "x", "age": 3}"#,
            r#"{"age": -3, "name": "é", "tags": ["a", "b"], "color": 3, "ok": true}"#,
            r#"{"name": "x", "age": 0, "color": null, "nick": null}"#,
            r#"{"name": "x", "age": 0, "nick": "y", "child": {"child": {"v": 1.5e3}}}"#,
            r#"{"name":"x","age":1,"color":"green"}"#,
        ] {
            assert_eq!(accepts(&schema, good), (true, true), "{good}");
        }
        for prefix in [
            r#"{"name": "x""#,
            r#"{"name": "x", "age": 3"#,
            r#"{"age": 1, "col"#,
        ] {
            assert_eq!(accepts(&schema, prefix), (true, false), "{prefix}");
        }
        for bad in [
            r#"{"name": "x"}"#,
            r#"{"name": 1, "age": 3}"#,
            r#"{"name": "x", "age": 3.5}"#,
            r#"{"name": "x", "age": 3, "other": 1}"#,
            r#"{"name": "x", "name": "y", "age": 3}"#,
            r#"{"name": "x", "age": 3, "tags": ["c"]}"#,
            r#"{"name": "x", "age": 3, "tags": ["a", "a", "b"]}"#,
            r#"{"name": "x", "age": 3, "color": "blue"}"#,
            r#"{"name": "x", "age": 3, "color": 31}"#,
            r#"{"name": "x", "age": 3, "nick": 1}"#,
            r#"{"name": "x", "age": 3, "child": {"w": 1}}"#,
            r#"[1]"#,
        ] {
            let (ok, complete) = accepts(&schema, bad);
            assert!(!(ok && complete), "{bad}");
        }
        // Open objects take other keys, with the additional schema.
        let open = json!({"properties": {"a": {"type": "string"}},
                          "additionalProperties": {"type": "integer"}});
        assert_eq!(
            accepts(&open, r#"{"a": "x", "b": 1, "ab": 2}"#),
            (true, true)
        );
        assert!(!accepts(&open, r#"{"b": "x"}"#).0);
        // Top-level scalars and arrays.
        assert_eq!(accepts(&json!({"type": "integer"}), "42"), (true, true));
        assert_eq!(
            accepts(&json!({"type": "array", "minItems": 1}), "[]"),
            (false, false)
        );
        assert_eq!(
            accepts(&json!(true), r#"{"x": [1, {"y": null}]}"#),
            (true, true)
        );
    }

    #[test]
    fn keywords_that_cannot_be_enforced_are_named() {
        for (schema, word) in [
            (json!({"type": "string", "pattern": "a+"}), "pattern"),
            (
                json!({"type": "object", "properties": {"a": {"minimum": 1}}}),
                "minimum",
            ),
            (json!({"allOf": [{"type": "string"}]}), "allOf"),
            (json!({"$ref": "#/$defs/missing"}), "$ref"),
            (json!({"type": "strings"}), "type"),
            (
                json!({"anyOf": [{"type": "string"}, {"type": "string", "enum": ["a"]}]}),
                "anyOf",
            ),
        ] {
            let e = Schema::compile(&schema).unwrap_err();
            assert!(e.contains(word), "{e}");
        }
    }

    /// The schema a value has: its type, with every property required and no others, and an
    /// array's items those of its first element (the generated arrays hold one type).
    fn schema_of(v: &Value) -> Value {
        match v {
            Value::Object(o) => json!({
                "type": "object",
                "properties": o.iter().map(|(k, v)| (k.clone(), schema_of(v))).collect::<serde_json::Map<_, _>>(),
                "required": o.keys().collect::<Vec<_>>(),
                "additionalProperties": false
            }),
            Value::Array(a) => match a.first() {
                Some(x) => json!({"type": "array", "items": schema_of(x)}),
                None => json!({"type": "array"}),
            },
            Value::String(_) => json!({"type": "string"}),
            Value::Number(n) if n.is_i64() || n.is_u64() => json!({"type": "integer"}),
            Value::Number(_) => json!({"type": "number"}),
            Value::Bool(_) => json!({"type": "boolean"}),
            Value::Null => json!({"type": "null"}),
        }
    }

    /// Whatever serde_json writes is accepted byte by byte, complete at the end, under the
    /// schema `true` and under the value's own schema.
    #[test]
    fn serde_json_values_are_accepted_under_their_schema() {
        use proptest::prelude::*;
        let scalar = prop_oneof![
            any::<i64>().prop_map(Value::from),
            any::<f64>()
                .prop_filter("finite", |x| x.is_finite())
                .prop_map(Value::from),
            "[a-z ]{0,8}".prop_map(Value::from),
            any::<bool>().prop_map(Value::from),
            Just(Value::Null),
        ];
        let value = scalar.prop_recursive(3, 24, 4, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..4).prop_map(|v| {
                    // One type per array, as schema_of reads it from the first element.
                    let first = v.first().cloned();
                    Value::Array(
                        v.into_iter()
                            .filter(|x| Some(schema_of(x)) == first.as_ref().map(schema_of))
                            .collect(),
                    )
                }),
                prop::collection::btree_map("[a-z_]{1,6}", inner, 0..4)
                    .prop_map(|m| Value::Object(m.into_iter().collect())),
            ]
        });
        proptest!(|(v in value, pretty in any::<bool>())| {
            let text = if pretty { serde_json::to_string_pretty(&v).unwrap() } else { v.to_string() };
            for schema in [json!(true), schema_of(&v)] {
                let mut s = SchemaState::new(Schema::compile(&schema).unwrap());
                for (i, &b) in text.as_bytes().iter().enumerate() {
                    prop_assert!(s.feed(b), "byte {} of {} under {}", i, text, schema);
                }
                prop_assert!(s.is_complete(), "{} under {}", text, schema);
            }
        });
    }
}
