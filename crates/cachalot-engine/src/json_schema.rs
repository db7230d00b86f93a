//! Structured output (OpenAI's `response_format: {"type": "json_schema"}`): an incremental
//! recognizer of one JSON value that a JSON Schema accepts, byte by byte, for the same masking
//! as JSON mode ([`crate::json_mode`], whose whitespace and nesting bounds it keeps).
//!
//! The schema is compiled once ([`Schema::compile`]) into nodes; the keywords that shape the
//! grammar are honoured: `type` (one or a list), `properties`, `required` (a required name
//! that is not listed is a property under `additionalProperties`' rule),
//! `additionalProperties` (false, true or a schema; not said, false where the schema lists its
//! properties and nothing else opens it, as vLLM's xgrammar and OpenAI read a Pydantic model's
//! schema, true otherwise), `patternProperties` (up to
//! four; a key takes the schemas of every pattern it matches, merged as an `allOf`, and a
//! listed property's own; a closed object's other keys are written only while a pattern can
//! still match, without escapes), `propertyNames` (a `pattern`, lengths, `enum`/`const`:
//! listed properties it refuses are left out, other keys meet it as they are written),
//! `minProperties` and
//! `maxProperties` (every key counts; once only the required keys not yet written fit under
//! the maximum, only those can start), `items`, `prefixItems` (and
//! draft 7's `items` list with `additionalItems`; `items: false` closes a tuple), `minItems`,
//! `maxItems`, `uniqueItems` (over enum values, booleans, null and strings without a
//! `maxLength` or `pattern`: a value written is not offered again, a repeated string cannot
//! close), `enum` and `const` (of strings, numbers, booleans and null), `not` of a type or of
//! values (taken out of an enum, or out of booleans and null), `anyOf`/`oneOf`
//! (a value's first byte picks the branches of its type; where several take it, as in a union
//! of object models, each is followed until its branch refuses a byte: [`SchemaState`]; oneOf
//! is read as anyOf), `allOf` (one schema is that schema; several, or constraints beside it,
//! are merged into one schema keyword by keyword: [`intersect`]), `$ref` into `$defs` or
//! `definitions` (recursion included; constraints beside it are merged with its target as an
//! `allOf`), a string's `minLength`, `maxLength` and `pattern` and a
//! number's `minimum`, `maximum`, `exclusiveMinimum`, `exclusiveMaximum` and `multipleOf` (a
//! whole step makes the number an integer; a decimal one such as 0.01 or 2.5 is read exactly
//! from its text and its multiples are written with at most its decimals)
//! ([`crate::json_constraints`]: every prefix can still end inside them; numbers under bounds
//! are written without exponents and with at most 15 integer digits, less a decimal step's
//! decimals, strings under a pattern without `\u` escapes). Annotations
//! (`title`, `description`, `default`, `examples`, `format`, ...) are ignored. Any other
//! keyword (`if`/`then`, `not` of anything but a type or of enum values
//! over an enum, booleans or null, ...) and any
//! `allOf` that cannot be written as one schema (two different `pattern`s, two unions) is
//! refused by name at compile time rather than silently not enforced. An object's keys are
//! written at most once; a closed object takes only its properties, and it can only close once
//! its required ones are there.
//!
//! The keywords' meaning is JSON Schema 2020-12's (draft 7's tuple form and boolean
//! exclusive bounds are read too), as OpenAI's `response_format` and vLLM take it.

use std::sync::Arc;

use serde_json::Value;

use crate::json_constraints::{Bounds, Pattern};
use crate::json_mode::{
    number_byte, string_byte, Num, StrLex, MAX_DEPTH, MAX_EDGE_WHITESPACE, MAX_WHITESPACE,
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
/// `patternProperties` patterns of one object (each set of them that a key may match gets
/// its merged node).
const MAX_PATTERN_PROPERTIES: usize = 4;
/// The longest key remembered in an open object (longer ones are "other" keys).
const MAX_KEY: usize = 256;

/// Keywords that only annotate.
const ANNOTATIONS: [&str; 13] = [
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
    // OpenAPI's hint for unions of objects (Pydantic writes it); every branch is followed.
    "discriminator",
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
    /// `patternProperties`' patterns (matched anywhere in a key, as `pattern` is), and per set
    /// of them (a bit each) the node of a key that matches exactly those (the intersection of
    /// their schemas); index 0 unused.
    pattern_props: Vec<Arc<Pattern>>,
    pattern_nodes: Vec<usize>,
    /// `propertyNames`: what every key's text must match (a pattern with its lengths), and
    /// its fewest characters.
    names: Option<Arc<Pattern>>,
    names_min: usize,
    /// propertyNames is given (with `names` None: no other key meets it), the whole of it
    /// (`names_full`, for listed properties), and its `enum`/`const` names.
    names_on: bool,
    names_full: Option<Arc<Pattern>>,
    names_listed: Option<Vec<String>>,
    /// `minProperties`/`maxProperties`: how many keys the object has.
    min_props: usize,
    max_props: usize,
    /// The node of the items after `prefix` (`items`, or draft 7's `additionalItems` after a
    /// list of `items`; `items: false` is `max_items` at the prefix's length).
    items: usize,
    /// `prefixItems` (draft 7: `items` as a list): the nodes of the first items, in order.
    prefix: Vec<usize>,
    /// `uniqueItems`: no item equals another (items of finitely many values, or strings free
    /// to grow: compile refuses other item schemas).
    unique: bool,
    min_items: usize,
    max_items: usize,
    /// The allowed values' compact JSON texts.
    enumv: Option<Vec<Vec<u8>>>,
    /// A string's length in characters (an escape is one).
    min_len: usize,
    max_len: usize,
    /// A string's `pattern`.
    pattern: Option<Arc<Pattern>>,
    /// A number's bounds (exponents are not written under bounds).
    bounds: Bounds,
    /// `anyOf`/`oneOf`: the branches' nodes (the others fields unused) and the types each
    /// takes (its enum's values' types, or its own); a value goes to those whose types take
    /// its first byte.
    alts: Vec<usize>,
    alt_types: Vec<u8>,
}

impl Node {
    /// The types of the values it takes.
    fn value_types(&self) -> u8 {
        match &self.enumv {
            Some(vs) => vs
                .iter()
                .filter_map(|t| serde_json::from_slice::<Value>(t).ok())
                .fold(0, |acc, v| acc | types_of_value(&v)),
            None => self.types,
        }
    }
}

impl Node {
    /// A key name meets `propertyNames` (or there is none).
    fn name_ok(&self, name: &str) -> bool {
        if !self.names_on {
            return true;
        }
        match (&self.names_listed, &self.names_full) {
            (Some(listed), _) => listed.iter().any(|l| l == name),
            (None, Some(full)) => name_allowed(full, self.names_min, name),
            (None, None) => true,
        }
    }

    /// The node of the item at `index` of an array.
    fn item_at(&self, index: usize) -> usize {
        self.prefix.get(index).copied().unwrap_or(self.items)
    }

    /// Its strings are constrained beyond JSON's own rules.
    fn constrains_strings(&self) -> bool {
        self.min_len > 0 || self.max_len < usize::MAX || self.pattern.is_some()
    }
}

/// A compiled JSON Schema (module docs): node 0 is the root, node 1 accepts anything.
#[derive(Debug)]
pub struct Schema {
    nodes: Vec<Node>,
    /// Per node: a value of it may be read several ways at once (a union whose branches take
    /// the same first byte, here or in a branch that is a union itself).
    forks: Vec<bool>,
}

fn any_node() -> Node {
    Node {
        types: ALL,
        props: Vec::new(),
        required: 0,
        additional: Some(1),
        pattern_props: Vec::new(),
        pattern_nodes: Vec::new(),
        names: None,
        names_min: 0,
        names_on: false,
        names_full: None,
        names_listed: None,
        min_props: 0,
        max_props: usize::MAX,
        items: 1,
        prefix: Vec::new(),
        unique: false,
        min_items: 0,
        max_items: usize::MAX,
        enumv: None,
        min_len: 0,
        max_len: usize::MAX,
        pattern: None,
        bounds: Bounds::NONE,
        alts: Vec::new(),
        alt_types: Vec::new(),
    }
}

/// Schemas compiled lately, by their text, with what compiling gave: a request's schema is
/// checked where it arrives (the server, the engine's checks) and used again when it is
/// scheduled and by each lead, and a pattern's automaton can take a while to build.
const RECENT_SCHEMAS: usize = 16;
type Compiled = Result<Arc<Schema>, String>;
static RECENT: std::sync::Mutex<Vec<(String, Compiled)>> = std::sync::Mutex::new(Vec::new());

impl Schema {
    /// Compiles `schema` (once for a recent one: [`RECENT_SCHEMAS`]); the error names the
    /// keyword (and where) that cannot be enforced.
    pub fn compile(schema: &Value) -> Result<Arc<Schema>, String> {
        let key = schema.to_string();
        let mut recent = RECENT.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(i) = recent.iter().position(|(k, _)| *k == key) {
            let hit = recent.remove(i);
            let out = hit.1.clone();
            recent.push(hit);
            return out;
        }
        drop(recent);
        let out = Schema::compile_new(schema);
        let mut recent = RECENT.lock().unwrap_or_else(|e| e.into_inner());
        if recent.len() >= RECENT_SCHEMAS {
            let _ = recent.remove(0);
        }
        recent.push((key, out.clone()));
        out
    }

    fn compile_new(schema: &Value) -> Result<Arc<Schema>, String> {
        let mut c = Compiler {
            root: schema,
            nodes: vec![any_node(), any_node()],
            refs: Vec::new(),
            pending: Vec::new(),
            aliases: Vec::new(),
        };
        let n = c.node(schema, "#", 0)?;
        // References to references: each takes its target's node (a chain that comes back to
        // itself holds no schema).
        for _ in 0..=c.aliases.len() {
            for &(a, t, _) in &c.aliases {
                c.nodes[a] = c.nodes[t].clone();
            }
        }
        for (a, _, r) in &c.aliases {
            let mut at = *a;
            for _ in 0..=c.aliases.len() {
                match c.aliases.iter().find(|(x, _, _)| *x == at) {
                    Some(&(_, t, _)) if t == *a => {
                        return Err(format!("{r}: the $ref refers to itself without a schema"))
                    }
                    Some(&(_, t, _)) => at = t,
                    None => break,
                }
            }
        }
        c.nodes[0] = c.nodes[n].clone();
        // Every branch is compiled now (recursive ones included): their types, for dispatch.
        for i in 0..c.nodes.len() {
            let types = c.nodes[i]
                .alts
                .iter()
                .map(|&a| c.nodes[a].value_types())
                .collect();
            c.nodes[i].alt_types = types;
        }
        // A branch that is itself a union dispatches again: a chain of unions that comes back
        // to one never reaches a value.
        for i in 0..c.nodes.len() {
            let mut seen = vec![i];
            let mut todo: Vec<usize> = c.nodes[i].alts.clone();
            while let Some(a) = todo.pop() {
                if c.nodes[a].alts.is_empty() {
                    continue;
                }
                if seen.contains(&a) {
                    return Err(
                        "#: an anyOf/oneOf refers to itself without a value between".to_string()
                    );
                }
                seen.push(a);
                todo.extend(c.nodes[a].alts.iter().copied());
            }
        }
        // A value read more ways at once than a state follows would lose branches: refused.
        for (i, n) in c.nodes.iter().enumerate() {
            if n.alts.is_empty() {
                continue;
            }
            for first in [OBJ, ARR, STR, INT | NUM, BOOL, NULL] {
                let ways = alike_ways(&c.nodes, i, first);
                if ways > MAX_PATHS {
                    return Err(format!(
                        "an anyOf/oneOf has {ways} branches (through nested unions) whose values \
                         start alike; structured output follows at most {MAX_PATHS} at once"
                    ));
                }
            }
        }
        let mut forks: Vec<bool> = c
            .nodes
            .iter()
            .map(|n| {
                let mut seen = 0u8;
                n.alt_types.iter().any(|&t| {
                    // Integers and numbers start alike.
                    let t = if t & (INT | NUM) != 0 {
                        t | INT | NUM
                    } else {
                        t
                    };
                    let clash = seen & t != 0;
                    seen |= t;
                    clash
                })
            })
            .collect();
        // Through branches that are unions (compile refused cycles of those).
        for _ in 0..c.nodes.len() {
            let mut changed = false;
            for i in 0..c.nodes.len() {
                if !forks[i] && c.nodes[i].alts.iter().any(|&a| forks[a]) {
                    forks[i] = true;
                    changed = true;
                }
            }
            if !changed {
                break;
            }
        }
        Ok(Arc::new(Schema {
            nodes: c.nodes,
            forks,
        }))
    }
}

impl Schema {
    /// Its values are objects only (what a tool's arguments must be).
    pub fn takes_only_objects(&self) -> bool {
        let root = &self.nodes[0];
        let types = if root.alts.is_empty() {
            root.value_types()
        } else {
            root.alt_types.iter().fold(0, |a, t| a | t)
        };
        types == OBJ
    }
}

struct Compiler<'a> {
    root: &'a Value,
    nodes: Vec<Node>,
    /// `$ref` targets compiled (or being compiled) and their nodes.
    refs: Vec<(String, usize)>,
    /// `$ref` nodes reserved and not yet compiled (a recursive reference meets them).
    pending: Vec<usize>,
    /// `(node, target, ref)`: every `$ref`'s node and its target's; the node takes the
    /// target's compiled node again once everything is compiled (a target that was a pending
    /// reference itself held a placeholder).
    aliases: Vec<(usize, usize, String)>,
}

impl Compiler<'_> {
    fn pending(&self, n: usize) -> bool {
        self.pending.contains(&n)
    }

    fn node(&mut self, s: &Value, at: &str, depth: usize) -> Result<usize, String> {
        if depth > MAX_DEPTH {
            return Err(format!(
                "{}: the schema nests deeper than {MAX_DEPTH}",
                short_path(at)
            ));
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
            let target = ref_target(self.root, r).ok_or_else(|| {
                format!("{at}/$ref: {r:?} does not point at a schema in this document (`#`, or `#/$defs/NAME`)")
            })?;
            // Constraints beside a reference (2020-12 allows them): both hold, as an allOf
            // (before the reference's compiled node is reused, which holds the target only).
            if obj.keys().any(|k| {
                !ANNOTATIONS.contains(&k.as_str())
                    && !matches!(k.as_str(), "$ref" | "$defs" | "definitions")
            }) {
                let mut beside = obj.clone();
                beside.remove("$ref");
                let mut both = serde_json::Map::new();
                both.insert(
                    "allOf".to_string(),
                    Value::Array(vec![
                        serde_json::json!({ "$ref": r }),
                        Value::Object(beside),
                    ]),
                );
                let merged = merge_all_of(self.root, &both, at, depth)?;
                return self.node(&merged, at, depth + 1);
            }
            if let Some(&(_, n)) = self.refs.iter().find(|(k, _)| k == r) {
                return Ok(n);
            }
            // Reserved before compiling, so a recursive reference finds it.
            let n = self.nodes.len();
            self.nodes.push(any_node());
            self.refs.push((r.to_string(), n));
            self.pending.push(n);
            let t = self.node(target, r, depth + 1)?;
            // (A target that is itself a reference still being compiled is copied again at
            // the end.)
            self.aliases.push((n, t, r.to_string()));
            self.nodes[n] = self.nodes[t].clone();
            self.pending.retain(|&p| p != n);
            return Ok(n);
        }
        if let Some(all) = obj.get("allOf") {
            let members = all
                .as_array()
                .filter(|a| !a.is_empty())
                .ok_or_else(|| format!("{at}/allOf: not a non-empty list"))?;
            let beside = obj.keys().any(|k| {
                !ANNOTATIONS.contains(&k.as_str())
                    && !matches!(k.as_str(), "allOf" | "$defs" | "definitions")
            });
            // One schema in allOf is that schema (Pydantic writes a described reference so);
            // a reference stays one, so recursion through it is followed.
            if let ([only], false) = (members.as_slice(), beside) {
                return self.node(only, &format!("{at}/allOf/0"), depth + 1);
            }
            let merged = merge_all_of(self.root, obj, at, depth)?;
            return self.node(&merged, at, depth + 1);
        }
        for k in obj.keys() {
            let known = matches!(
                k.as_str(),
                "type"
                    | "properties"
                    | "required"
                    | "additionalProperties"
                    | "patternProperties"
                    | "propertyNames"
                    | "items"
                    | "prefixItems"
                    | "additionalItems"
                    | "uniqueItems"
                    | "not"
                    | "minProperties"
                    | "maxProperties"
                    | "minItems"
                    | "maxItems"
                    | "minLength"
                    | "maxLength"
                    | "pattern"
                    | "minimum"
                    | "maximum"
                    | "exclusiveMinimum"
                    | "exclusiveMaximum"
                    | "multipleOf"
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
                     type, properties, required, additionalProperties, patternProperties, propertyNames, items, prefixItems, uniqueItems, minProperties, maxProperties, not (of a type, or of enum values \
                     over an enum, booleans or null), minItems, \
                     maxItems, minLength, maxLength, pattern, minimum, maximum, \
                     exclusiveMinimum, exclusiveMaximum, multipleOf, enum, const, anyOf, oneOf, allOf, $ref/$defs)"
                ));
            }
        }
        if obj.contains_key("anyOf") && obj.contains_key("oneOf") {
            return Err(format!(
                "{at}: anyOf and oneOf together are not supported in structured output"
            ));
        }
        if let Some(alts) = obj.get("anyOf").or_else(|| obj.get("oneOf")) {
            return self.union(obj, alts, at, depth);
        }
        let mut node = any_node();
        node.types = match obj.get("type") {
            None if obj.contains_key("properties") || obj.contains_key("patternProperties") => OBJ,
            None if obj.contains_key("items") || obj.contains_key("prefixItems") => ARR,
            None => ALL,
            Some(t) => types_of(t)
                .filter(|&t| t != 0)
                .ok_or_else(|| format!("{at}/type: {t} is not a JSON type (or list of them)"))?,
        };
        // `not`: of a type (the types left), or of values (taken out of an enum, or out of
        // booleans and null); other negations are refused.
        let mut excluded: Vec<Value> = Vec::new();
        match obj.get("not") {
            None | Some(Value::Bool(false)) => {}
            Some(Value::Object(o)) => {
                let keys: Vec<&str> = o
                    .keys()
                    .map(String::as_str)
                    .filter(|k| !ANNOTATIONS.contains(k))
                    .collect();
                match keys.as_slice() {
                    ["type"] => {
                        let t = types_of(&o["type"]).ok_or_else(|| {
                            format!("{at}/not/type: {} is not a JSON type", o["type"])
                        })?;
                        if t & (INT | NUM) == INT && node.types & NUM != 0 {
                            return Err(format!(
                                "{at}/not: a number that is not an integer is not supported in \
                                 structured output (3.0 is an integer too)"
                            ));
                        }
                        node.types &= !t;
                    }
                    ["enum"] | ["const"] => {
                        excluded = match (o.get("enum"), o.get("const")) {
                            (Some(Value::Array(vs)), _) => vs.clone(),
                            (None, Some(v)) => vec![v.clone()],
                            _ => return Err(format!("{at}/not/enum: not a list")),
                        };
                    }
                    _ => {
                        return Err(format!(
                            "{at}/not: `not` of {keys:?} is not supported in structured output \
                             (`not` of a type, or of enum/const values, is)"
                        ))
                    }
                }
            }
            Some(other) => {
                return Err(format!(
                    "{at}/not: {other} leaves no value (or is not a schema)"
                ))
            }
        }
        if node.types == 0 {
            return Err(format!("{at}: `not` leaves no type"));
        }
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
        if !excluded.is_empty() {
            let same = same_value;
            let texts = match node.enumv.take() {
                Some(texts) => texts,
                None if node.types & !(BOOL | NULL) == 0 => {
                    let mut lits = Vec::new();
                    if node.types & BOOL != 0 {
                        lits.extend([b"true".to_vec(), b"false".to_vec()]);
                    }
                    if node.types & NULL != 0 {
                        lits.push(b"null".to_vec());
                    }
                    lits
                }
                None => {
                    return Err(format!(
                        "{at}/not: `not` of values is supported over an enum, booleans or null \
                         in structured output"
                    ))
                }
            };
            let kept: Vec<Vec<u8>> = texts
                .into_iter()
                .filter(|t| {
                    serde_json::from_slice::<Value>(t)
                        .is_ok_and(|v| !excluded.iter().any(|x| same(x, &v)))
                })
                .collect();
            if kept.is_empty() {
                return Err(format!("{at}: `not` excludes every value"));
            }
            node.enumv = Some(kept);
        }
        // patternProperties: a key matching patterns takes all their schemas (and a listed
        // property's own); a key matching none takes additionalProperties'.
        let mut pattern_schemas: Vec<&Value> = Vec::new();
        if let Some(pp) = obj.get("patternProperties") {
            let pp = pp
                .as_object()
                .ok_or_else(|| format!("{at}/patternProperties: not an object"))?;
            if pp.len() > MAX_PATTERN_PROPERTIES {
                return Err(format!(
                    "{at}/patternProperties: {} patterns; structured output takes at most \
                     {MAX_PATTERN_PROPERTIES}",
                    pp.len()
                ));
            }
            for (pat, sch) in pp {
                let here = format!("{at}/patternProperties/{pat}");
                let compiled = Pattern::compile(pat, &here, 0, usize::MAX)?;
                node.pattern_props.push(Arc::new(compiled));
                pattern_schemas.push(sch);
            }
            // Which patterns some key matches together (pairwise; a set with two patterns
            // that never meet is never matched as a whole).
            let k = pp.len();
            let names: Vec<&String> = pp.keys().collect();
            let meet: Vec<Vec<bool>> = (0..k)
                .map(|i| {
                    (0..k)
                        .map(|j| {
                            i == j
                                || node.pattern_props[i].overlaps(&node.pattern_props[j], 200_000)
                        })
                        .collect()
                })
                .collect();
            node.pattern_nodes = vec![usize::MAX; 1 << k];
            for mask in 1..1usize << k {
                let idx: Vec<usize> = (0..k).filter(|i| mask & (1 << i) != 0).collect();
                if idx.iter().any(|&i| idx.iter().any(|&j| !meet[i][j])) {
                    continue;
                }
                let here = format!("{at}/patternProperties/{}", names[idx[0]]);
                node.pattern_nodes[mask] = match idx.as_slice() {
                    [one] => self.node(pattern_schemas[*one], &here, depth + 1)?,
                    _ => {
                        let chosen: Vec<Value> =
                            idx.iter().map(|&i| pattern_schemas[i].clone()).collect();
                        let all = serde_json::json!({ "allOf": chosen });
                        let empty = serde_json::Map::new();
                        let merged = merge_all_of(
                            self.root,
                            all.as_object().unwrap_or(&empty),
                            &here,
                            depth,
                        )
                        .map_err(|e| {
                            let which: Vec<&str> = idx.iter().map(|&i| names[i].as_str()).collect();
                            format!(
                                "{at}/patternProperties: a key can match {which:?} at \
                                         once and would take all their schemas, which cannot be \
                                         merged ({e})"
                            )
                        })?;
                        self.node(&merged, &here, depth + 1)?
                    }
                };
            }
        }
        // propertyNames: a `pattern`, `minLength`/`maxLength`, `enum`/`const` of strings.
        if let Some(pn) = obj.get("propertyNames") {
            let here = format!("{at}/propertyNames");
            let o = match pn {
                Value::Bool(true) => None,
                Value::Object(o) => Some(o),
                other => {
                    return Err(format!(
                        "{here}: {other} is not supported in structured output (a schema of \
                         pattern, minLength, maxLength, enum or const is)"
                    ))
                }
            };
            if let Some(o) = o {
                if let Some(k) = o.keys().find(|k| {
                    !ANNOTATIONS.contains(&k.as_str())
                        && !matches!(
                            k.as_str(),
                            "type" | "pattern" | "minLength" | "maxLength" | "enum" | "const"
                        )
                }) {
                    return Err(format!(
                        "{here}: `{k}` is not supported in structured output (pattern, \
                         minLength, maxLength, enum and const are)"
                    ));
                }
                if o.get("type").is_some_and(|t| t != "string") {
                    return Err(format!("{here}/type: keys are strings"));
                }
                let len = |k: &str| count_of(o, &here, k);
                let (min, max) = (
                    len("minLength")?.unwrap_or(0),
                    len("maxLength")?.unwrap_or(usize::MAX),
                );
                let values: Option<Vec<&str>> = match (o.get("enum"), o.get("const")) {
                    (Some(Value::Array(vs)), _) => {
                        Some(vs.iter().filter_map(Value::as_str).collect())
                    }
                    (None, Some(v)) => Some(v.as_str().into_iter().collect()),
                    (Some(_), _) => return Err(format!("{here}/enum: not a list")),
                    (None, None) => None,
                };
                let pattern = match o.get("pattern") {
                    Some(p) => Some(
                        p.as_str()
                            .ok_or_else(|| format!("{here}/pattern: {p} is not a string"))?,
                    ),
                    None => None,
                };
                let full = Arc::new(Pattern::compile(pattern.unwrap_or(""), &here, min, max)?);
                // Names listed: those the pattern and lengths take. Other keys (those that are
                // not listed properties: a listed one is written as itself) then take the rest,
                // so that a key started as another never comes to a listed name.
                // In a closed object with patternProperties, another key must meet both; a
                // list of names is cut to those a pattern matches, a pattern of names is refused.
                let closed = obj.get("additionalProperties") == Some(&Value::Bool(false));
                let by_pattern =
                    |v: &str| node.pattern_props.iter().any(|p| p.matches(v.as_bytes()));
                if closed && !node.pattern_props.is_empty() && values.is_none() {
                    return Err(format!(
                        "{here}: a pattern of names beside patternProperties in a closed object \
                         is not supported in structured output (list the names with enum)"
                    ));
                }
                let others = match &values {
                    None => Some(full.clone()),
                    Some(vs) => {
                        let kept: Vec<&str> = vs
                            .iter()
                            .copied()
                            .filter(|v| name_allowed(&full, min, v))
                            .collect();
                        if kept.is_empty() {
                            return Err(format!("{here}: no key name is allowed"));
                        }
                        node.names_listed = Some(kept.iter().map(|v| v.to_string()).collect());
                        let listed: Vec<&String> = obj
                            .get("properties")
                            .and_then(Value::as_object)
                            .into_iter()
                            .flat_map(|p| p.keys())
                            .collect();
                        let rest: Vec<String> = kept
                            .iter()
                            .filter(|v| !listed.iter().any(|l| l.as_str() == **v))
                            .filter(|v| !closed || by_pattern(v))
                            .map(|v| ecma_escape(v))
                            .collect();
                        if rest.is_empty() {
                            None
                        } else {
                            Some(Arc::new(Pattern::compile(
                                &format!("^(?:{})$", rest.join("|")),
                                &here,
                                0,
                                usize::MAX,
                            )?))
                        }
                    }
                };
                node.names_full = Some(full);
                node.names = others;
                node.names_on = true;
                node.names_min = min;
            }
        }
        // The patterns a name matches, as bits.
        let matching = |node: &Node, name: &[u8]| -> usize {
            node.pattern_props
                .iter()
                .enumerate()
                .filter(|(_, p)| p.matches(name))
                .fold(0, |m, (i, _)| m | 1 << i)
        };
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
                // A property propertyNames refuses cannot be written.
                {
                    if !node.name_ok(k) {
                        if obj
                            .get("required")
                            .and_then(Value::as_array)
                            .is_some_and(|r| r.iter().any(|x| x == k.as_str()))
                        {
                            return Err(format!(
                                "{at}/required: {k:?} is a name propertyNames refuses"
                            ));
                        }
                        continue;
                    }
                }
                if k.len() > MAX_KEY {
                    return Err(format!(
                        "{at}/properties: a name of {} bytes; structured output takes names of \
                         at most {MAX_KEY}",
                        k.len()
                    ));
                }
                let here = format!("{at}/properties/{k}");
                let mask = matching(&node, k.as_bytes());
                let n = if mask == 0 {
                    self.node(v, &here, depth + 1)?
                } else {
                    let mut all = vec![v.clone()];
                    all.extend(
                        (0..pattern_schemas.len())
                            .filter(|i| mask & (1 << i) != 0)
                            .map(|i| pattern_schemas[i].clone()),
                    );
                    let all = serde_json::json!({ "allOf": all });
                    let merged = merge_all_of(
                        self.root,
                        all.as_object().unwrap_or(&serde_json::Map::new()),
                        &here,
                        depth,
                    )?;
                    self.node(&merged, &here, depth + 1)?
                };
                node.props.push((k.as_bytes().to_vec(), n));
            }
        }
        node.additional = match obj.get("additionalProperties") {
            // Not said, where the schema lists its properties and nothing else opens it: only
            // those (as vLLM's default backend, xgrammar in strict mode, and OpenAI read such a
            // schema: a Pydantic model's schema does not write `additionalProperties`).
            None if closed_by_default(obj) => None,
            None | Some(Value::Bool(true)) => Some(1),
            Some(Value::Bool(false)) => None,
            Some(s) => Some(self.node(s, &format!("{at}/additionalProperties"), depth + 1)?),
        };
        if let Some(r) = obj.get("required") {
            let r = r
                .as_array()
                .ok_or_else(|| format!("{at}/required: not a list"))?;
            for name in r {
                let name = name
                    .as_str()
                    .ok_or_else(|| format!("{at}/required: {name} is not a string"))?;
                let i = match node.props.iter().position(|(k, _)| k == name.as_bytes()) {
                    Some(i) => i,
                    // Required but not listed: a property under additionalProperties' rule.
                    None => {
                        if !node.name_ok(name) {
                            return Err(format!(
                                "{at}/required: {name:?} is a name propertyNames refuses"
                            ));
                        }
                        let mask = matching(&node, name.as_bytes());
                        let rule = if mask != 0 {
                            Some(node.pattern_nodes[mask])
                        } else {
                            node.additional
                        };
                        let Some(rule) = rule else {
                            return Err(format!(
                                "{at}/required: {name:?} is not one of the schema's properties \
                                 and additionalProperties is false: no object has it"
                            ));
                        };
                        if node.props.len() >= MAX_PROPERTIES || name.len() > MAX_KEY {
                            return Err(format!(
                                "{at}/required: {name:?} is one property too many for \
                                 structured output (at most {MAX_PROPERTIES}, names of at most \
                                 {MAX_KEY} bytes)"
                            ));
                        }
                        node.props.push((name.as_bytes().to_vec(), rule));
                        node.props.len() - 1
                    }
                };
                node.required |= 1 << i;
            }
        }
        // A tuple: `prefixItems` and the rest under `items` (2020-12), or `items` as a list
        // and the rest under `additionalItems` (draft 7).
        let (prefix, rest) = match (obj.get("prefixItems"), obj.get("items")) {
            (Some(p), rest) => (Some(("prefixItems", p)), rest.map(|r| ("items", r))),
            (None, Some(p @ Value::Array(_))) => (
                Some(("items", p)),
                obj.get("additionalItems").map(|r| ("additionalItems", r)),
            ),
            (None, rest) => (None, rest.map(|r| ("items", r))),
        };
        if let Some((key, p)) = prefix {
            let p = p
                .as_array()
                .ok_or_else(|| format!("{at}/{key}: not a list of schemas"))?;
            for (i, s) in p.iter().enumerate() {
                let n = self.node(s, &format!("{at}/{key}/{i}"), depth + 1)?;
                node.prefix.push(n);
            }
        }
        let mut closed = false;
        match rest {
            Some((_, Value::Bool(false))) => closed = true,
            Some((key, items)) => {
                node.items = self.node(items, &format!("{at}/{key}"), depth + 1)?
            }
            None => {}
        }
        let count = |k: &str| count_of(obj, at, k);
        node.min_props = count("minProperties")?.unwrap_or(0);
        node.max_props = count("maxProperties")?.unwrap_or(usize::MAX);
        let required = node.required.count_ones() as usize;
        if node.min_props > node.max_props || required > node.max_props {
            return Err(format!(
                "{at}: maxProperties {} leaves no object (minProperties {}, {required} required)",
                node.max_props, node.min_props
            ));
        }
        if node.additional.is_none()
            && node.pattern_props.is_empty()
            && node.min_props > node.props.len()
        {
            return Err(format!(
                "{at}: minProperties {} is above the {} properties a closed object can have",
                node.min_props,
                node.props.len()
            ));
        }
        node.min_items = count("minItems")?.unwrap_or(0);
        node.max_items = count("maxItems")?.unwrap_or(usize::MAX);
        if node.min_items > node.max_items {
            return Err(format!("{at}: minItems is above maxItems"));
        }
        match obj.get("uniqueItems") {
            None | Some(Value::Bool(false)) => {}
            Some(Value::Bool(true)) => {
                let distinct = self.distinct_items(&node, at)?;
                if node.min_items > distinct {
                    return Err(format!(
                        "{at}: minItems {} unique items, but the items take only {distinct} \
                         values",
                        node.min_items
                    ));
                }
                node.unique = true;
            }
            Some(v) => return Err(format!("{at}/uniqueItems: {v} is not a boolean")),
        }
        if closed {
            node.max_items = node.max_items.min(node.prefix.len());
            if node.min_items > node.max_items {
                return Err(format!(
                    "{at}: minItems {} is above the {} items that prefixItems (with items \
                     false) allow",
                    node.min_items,
                    node.prefix.len()
                ));
            }
        }
        node.min_len = count("minLength")?.unwrap_or(0);
        node.max_len = count("maxLength")?.unwrap_or(usize::MAX);
        if node.min_len > node.max_len {
            return Err(format!("{at}: minLength is above maxLength"));
        }
        if let Some(p) = obj.get("pattern") {
            let p = p
                .as_str()
                .ok_or_else(|| format!("{at}/pattern: {p} is not a string"))?;
            let pat = Pattern::compile(p, &format!("{at}/pattern"), node.min_len, node.max_len)?;
            node.pattern = Some(Arc::new(pat));
        }
        node.bounds = bounds_of(obj, at)?;
        // Integers on a fractional step (units / 10^d) are the multiples of
        // units / gcd(units, 10^d): a whole step.
        if node.bounds.fractional_step() && node.types & (INT | NUM) == INT {
            let (mut g, mut h) = (node.bounds.step_units, 10u64.pow(node.bounds.step_digits));
            while h != 0 {
                (g, h) = (h, g % h);
            }
            let whole = node.bounds.step_units / g;
            node.bounds = node.bounds.with_whole_step(whole as f64);
        }
        // Multiples of a whole step are integers: a number is written as one.
        if node.bounds.step > 0.0 && !node.bounds.fractional_step() && node.types & NUM != 0 {
            node.types = (node.types & !NUM) | INT;
        }
        // Numbers on a decimal step (or under bounds) with no value inside the bounds below
        // 10^15, where they are written: no number.
        let digits = node.bounds.max_int_digits();
        let beyond = |what: &str| {
            format!(
                "{at}: every {what} inside the bounds is 10^{digits} or more in magnitude, \
                 beyond what structured output writes under these bounds (at most {digits} \
                 integer digits)"
            )
        };
        // (An enum's values are written as they are: its numbers are checked one by one
        // below.)
        let listed = node.enumv.is_some();
        if !node.bounds.is_none() && node.types & NUM != 0 && !node.bounds.has_value() {
            // Values exist, only not where they are written: said, not a type dropped.
            if node.bounds.has_value_anywhere() && !listed {
                return Err(beyond("number"));
            }
            node.types &= !(NUM | INT);
            if node.types == 0 {
                return Err(format!(
                    "{at}: no number (a multiple of multipleOf, when given) lies inside the \
                     bounds below 10^15 in magnitude, where structured output writes numbers \
                     under bounds"
                ));
            }
        }
        // Integers only, and no integer inside the bounds (below 10^15 under bounds): no value.
        let (lo_w, hi_w) = if node.bounds.is_none() {
            (f64::NEG_INFINITY, f64::INFINITY)
        } else {
            (
                -crate::json_constraints::MAX_WRITTEN + 1.0,
                crate::json_constraints::MAX_WRITTEN - 1.0,
            )
        };
        if node.types & (INT | NUM) == INT && !node.bounds.meets_int(lo_w, hi_w) {
            if node.bounds.meets_int(f64::NEG_INFINITY, f64::INFINITY) && !listed {
                return Err(beyond("integer"));
            }
            node.types &= !INT;
            if node.types == 0 {
                return Err(format!(
                    "{at}: no integer lies inside the bounds (a multiple of multipleOf, when \
                     given)"
                ));
            }
        }
        // Enum values beside string or number constraints: those that meet them.
        if let Some(texts) = node.enumv.take() {
            let kept: Vec<Vec<u8>> = texts
                .into_iter()
                .filter(|t| match serde_json::from_slice::<Value>(t) {
                    Ok(Value::String(v)) => {
                        let chars = v.chars().count();
                        chars >= node.min_len
                            && chars <= node.max_len
                            && node
                                .pattern
                                .as_ref()
                                .is_none_or(|p| p.matches(v.as_bytes()))
                    }
                    Ok(Value::Number(v)) => node.bounds.holds_number(&v.to_string()),
                    _ => true,
                })
                .collect();
            if kept.is_empty() {
                return Err(format!(
                    "{at}: no enum value meets the schema's other constraints"
                ));
            }
            node.enumv = Some(kept);
        }
        let n = self.nodes.len();
        self.nodes.push(node);
        Ok(n)
    }

    /// How many different items an array of `node` with `uniqueItems` can hold
    /// (`usize::MAX` for strings); the item schemas where that is not followed exactly are
    /// refused: unions, numbers, objects, arrays, strings under a pattern or a maxLength (a
    /// repeated item could be written up to a point where it cannot become another), and
    /// `prefixItems`.
    fn distinct_items(&self, node: &Node, at: &str) -> Result<usize, String> {
        if !node.prefix.is_empty() {
            return Err(format!(
                "{at}: uniqueItems beside prefixItems is not supported in structured output"
            ));
        }
        let n = &self.nodes[node.items];
        let refuse = |what: &str| {
            Err(format!(
                "{at}: uniqueItems over {what} is not supported in structured output (it holds \
                 for items that are enum values, booleans, null, or strings without a \
                 maxLength or pattern)"
            ))
        };
        if node.items == 1 || self.pending(node.items) || !n.alts.is_empty() {
            return refuse("items of any schema, a union or a recursive reference");
        }
        if let Some(values) = &n.enumv {
            // Values, not texts: 1 and 1.0 are one number.
            let mut distinct: Vec<Value> = Vec::new();
            for t in values {
                let v: Value = serde_json::from_slice(t).unwrap_or(Value::Null);
                if !distinct.iter().any(|d| same_value(d, &v)) {
                    distinct.push(v);
                }
            }
            return Ok(distinct.len());
        }
        if n.types & (INT | NUM | OBJ | ARR) != 0 {
            return refuse("numbers, objects or arrays");
        }
        if n.types & STR != 0 {
            if n.pattern.is_some() || n.max_len < usize::MAX {
                return refuse("strings under a pattern or maxLength");
            }
            return Ok(usize::MAX);
        }
        Ok(usize::from(n.types & BOOL != 0) * 2 + usize::from(n.types & NULL != 0))
    }

    /// `anyOf`/`oneOf`: one node whose types are the union; a value follows every branch its
    /// first byte fits ([`SchemaState`]).
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
        // The branches stay nodes of their own (a recursive `$ref` among them is compiled
        // later); a value goes to the branches its first byte's type picks.
        let mut merged = any_node();
        merged.types = 0;
        let mut numeric: Vec<(usize, u8)> = Vec::new();
        for (i, a) in alts.iter().enumerate() {
            let n = self.node(a, &format!("{at}/anyOf/{i}"), depth + 1)?;
            let types = if self.pending(n) {
                declared_types(self.root, a, 0, &mut Vec::new())
            } else {
                self.nodes[n].value_types()
            };
            // Numbers: an integer branch beside a number branch is the number branch, when
            // neither bounds them.
            let num = types & (INT | NUM);
            if num != 0 {
                numeric.push((n, types));
            }
            merged.types |= types;
            merged.alts.push(n);
        }
        if numeric.len() > 1 && obj.contains_key("oneOf") {
            // An integer is a number too: it would match both branches, which oneOf forbids.
            return Err(format!(
                "{at}/oneOf: an integer branch beside a number branch matches integers twice \
                 (not supported); use anyOf"
            ));
        }
        if numeric.len() > 1 {
            let plain = numeric.iter().all(|&(n, t)| {
                let b = &self.nodes[n];
                !self.pending(n) && t & !(INT | NUM) == 0 && b.enumv.is_none() && b.bounds.is_none()
            });
            if plain && numeric.iter().any(|&(_, t)| t & NUM != 0) {
                // The number branch takes numbers (the integer one would only repeat it).
                merged
                    .alts
                    .retain(|n| numeric.iter().all(|&(m, t)| m != *n || t & NUM != 0));
            }
        }
        let n = self.nodes.len();
        self.nodes.push(merged);
        Ok(n)
    }
}

/// The count keyword `k` of a schema (`minItems`, `maxLength`, ...), if given.
fn count_of(
    obj: &serde_json::Map<String, Value>,
    at: &str,
    k: &str,
) -> Result<Option<usize>, String> {
    obj.get(k)
        .map(|v| {
            v.as_u64()
                .map(|n| n as usize)
                .ok_or_else(|| format!("{at}/{k}: {v} is not a count"))
        })
        .transpose()
}

/// `text` as an ECMA-262 pattern that matches it literally.
fn ecma_escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len() * 2);
    for c in text.chars() {
        if "^$\\.*+?()[]{}|/-".contains(c) {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

/// A whole key name meets propertyNames (its pattern, lengths included).
fn name_allowed(p: &Pattern, min_chars: usize, name: &str) -> bool {
    let mut st = Some(p.start());
    let mut chars = 0;
    let mut cont = 0u8;
    for &b in name.as_bytes() {
        let Some((c, starts)) = crate::json_constraints::utf8_step(cont, b) else {
            return false;
        };
        cont = c;
        chars += usize::from(starts);
        st = st
            .and_then(|s| p.next(s, b))
            .filter(|&s| p.fits(s, cont, chars));
    }
    chars >= min_chars && st.is_some_and(|s| p.accepts_end(s))
}

/// A schema path for an error: its start and end where it is long (a recursion repeats it).
fn short_path(at: &str) -> String {
    let chars: Vec<char> = at.chars().collect();
    if chars.len() <= 160 {
        return at.to_string();
    }
    let head: String = chars[..60].iter().collect();
    let tail: String = chars[chars.len() - 60..].iter().collect();
    format!("{head}…{tail}")
}

/// An object schema without `additionalProperties` that takes only its listed properties: it
/// has `properties` (an empty listing too: a Pydantic model without fields, OpenAI's function
/// of no arguments, takes `{}`), names no key rule of another kind (`patternProperties`,
/// `propertyNames`), and its `required` names and `minProperties` fit the listed ones.
pub(crate) fn closed_by_default(obj: &serde_json::Map<String, Value>) -> bool {
    let Some(props) = obj.get("properties").and_then(Value::as_object) else {
        return false;
    };
    let required_listed = obj
        .get("required")
        .and_then(Value::as_array)
        .is_none_or(|r| {
            r.iter()
                .all(|n| n.as_str().is_some_and(|n| props.contains_key(n)))
        });
    let min_fits = obj
        .get("minProperties")
        .and_then(Value::as_u64)
        .is_none_or(|m| m as usize <= props.len());
    !obj.contains_key("patternProperties")
        && !obj.contains_key("propertyNames")
        && required_listed
        && min_fits
}

/// The schema a `$ref` names within the document: `#` (the root: a recursive schema), or a
/// JSON pointer after `#` (`#/$defs/Node`, `#/definitions/a~1b` for key `a/b`, `~0` for `~`;
/// into `properties` too).
fn ref_target<'a>(root: &'a Value, r: &str) -> Option<&'a Value> {
    let pointer = r.strip_prefix('#')?;
    root.pointer(pointer)
        .filter(|t| t.is_object() || t.is_boolean())
}

/// `allOf` (with any constraints beside it) as one schema: the members' constraints
/// intersected keyword by keyword ([`intersect`]), each `$ref` member read as its target.
fn merge_all_of(
    root: &Value,
    obj: &serde_json::Map<String, Value>,
    at: &str,
    depth: usize,
) -> Result<Value, String> {
    if depth > MAX_DEPTH {
        return Err(format!(
            "{}: allOf nests deeper than {MAX_DEPTH}",
            short_path(at)
        ));
    }
    let mut out: serde_json::Map<String, Value> = obj
        .iter()
        .filter(|(k, _)| !matches!(k.as_str(), "allOf" | "$defs" | "definitions"))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    let members = obj
        .get("allOf")
        .and_then(Value::as_array)
        .into_iter()
        .flatten();
    for (i, m) in members.enumerate() {
        let here = format!("{at}/allOf/{i}");
        let m = flatten(root, m, &here, depth + 1)?;
        let m = match m {
            Value::Bool(true) => continue,
            Value::Object(m) => m,
            Value::Bool(false) => {
                return Err(format!("{here}: the schema `false` accepts nothing"))
            }
            other => {
                return Err(format!(
                    "{here}: a schema is an object or a boolean, not {other}"
                ))
            }
        };
        out = intersect(root, &out, &m, &here, depth + 1)?;
    }
    Ok(Value::Object(out))
}

/// A schema as the constraints it stands for: a `$ref` (with annotations only beside it) read
/// as its target, an `allOf` merged.
fn flatten(root: &Value, s: &Value, at: &str, depth: usize) -> Result<Value, String> {
    if depth > MAX_DEPTH {
        return Err(format!(
            "{}: allOf nests deeper than {MAX_DEPTH} (a $ref through allOf or with constraints \
             beside it back to itself?)",
            short_path(at)
        ));
    }
    let Some(o) = s.as_object() else {
        return Ok(s.clone());
    };
    if let Some(r) = o.get("$ref").and_then(Value::as_str) {
        if o.keys()
            .all(|k| ANNOTATIONS.contains(&k.as_str()) || k == "$ref")
        {
            let target = ref_target(root, r).ok_or_else(|| {
                format!("{at}/$ref: {r:?} does not point at a schema in this document (`#`, or `#/$defs/NAME`)")
            })?;
            return flatten(root, target, r, depth + 1);
        }
    }
    if o.contains_key("allOf") {
        return merge_all_of(root, o, at, depth + 1);
    }
    Ok(s.clone())
}

/// Two schemas (objects, `true` or `false`) as one that takes what both take.
fn intersect_schemas(
    root: &Value,
    x: &Value,
    y: &Value,
    at: &str,
    depth: usize,
) -> Result<Value, String> {
    if x == y {
        return Ok(x.clone());
    }
    let (x, y) = (flatten(root, x, at, depth)?, flatten(root, y, at, depth)?);
    Ok(match (&x, &y) {
        (Value::Bool(true), s) | (s, Value::Bool(true)) => s.clone(),
        (Value::Bool(false), _) | (_, Value::Bool(false)) => Value::Bool(false),
        (Value::Object(a), Value::Object(b)) => Value::Object(intersect(root, a, b, at, depth)?),
        _ => return Err(format!("{at}: a schema is an object or a boolean")),
    })
}

/// The schema that takes exactly what both `a` and `b` take, keyword by keyword: bounds
/// tighten, `type`s and `enum`s intersect, `required` lists join, properties and item
/// schemas intersect, and a closed object (`additionalProperties` false or a schema) holds the
/// other's properties to its rule. Where that cannot be written as one schema here (two
/// different `pattern`s, two unions, ...) the keyword is refused by name.
fn intersect(
    root: &Value,
    a: &serde_json::Map<String, Value>,
    b: &serde_json::Map<String, Value>,
    at: &str,
    depth: usize,
) -> Result<serde_json::Map<String, Value>, String> {
    if depth > MAX_DEPTH {
        return Err(format!(
            "{}: allOf nests deeper than {MAX_DEPTH}",
            short_path(at)
        ));
    }
    let sub = |x: &Value, y: &Value, k: &str| {
        intersect_schemas(root, x, y, &format!("{at}/{k}"), depth + 1)
    };
    // A union on one side: each branch meets the other side.
    for (u, other) in [(a, b), (b, a)] {
        let Some((key, alts)) = ["anyOf", "oneOf"]
            .iter()
            .find_map(|k| Some((*k, u.get(*k)?.as_array()?)))
        else {
            continue;
        };
        if other.contains_key("anyOf") || other.contains_key("oneOf") {
            return Err(format!(
                "{at}: allOf of two anyOf/oneOf unions is not supported in structured output"
            ));
        }
        let rest: serde_json::Map<String, Value> = u
            .iter()
            .filter(|(k, _)| k.as_str() != key)
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        let base = intersect(root, &rest, other, at, depth + 1)?;
        // A branch that cannot meet the other side (two types with nothing in common, ...)
        // is left out; if none can, the first one's reason is the error.
        let mut branches = Vec::new();
        let mut first_error = None;
        for (i, alt) in alts.iter().enumerate() {
            match sub(&Value::Object(base.clone()), alt, &format!("{key}/{i}")) {
                Ok(Value::Bool(false)) => {}
                Ok(m) => branches.push(m),
                Err(e) => {
                    first_error.get_or_insert(e);
                }
            }
        }
        if branches.is_empty() {
            return Err(first_error.unwrap_or_else(|| {
                format!("{at}: no branch of {key} meets allOf's other members")
            }));
        }
        let mut out = serde_json::Map::new();
        out.insert(key.to_string(), Value::Array(branches));
        return Ok(out);
    }
    // Arrays where either side is a tuple: position by position (a position past a tuple
    // takes its `items`), since `items` only covers the positions after its own schema's
    // prefix.
    let tuple = |m: &serde_json::Map<String, Value>| {
        m.contains_key("prefixItems") || m.get("items").is_some_and(Value::is_array)
    };
    let arrayish = |m: &serde_json::Map<String, Value>| {
        ["prefixItems", "items", "additionalItems"]
            .iter()
            .any(|k| m.contains_key(*k))
    };
    let (a_own, b_own);
    let (a, b) = if (tuple(a) || tuple(b)) && arrayish(a) && arrayish(b) {
        let (pa, ra) = tuple_parts(a);
        let (pb, rb) = tuple_parts(b);
        let mut prefix = Vec::new();
        let mut closed = false;
        for i in 0..pa.len().max(pb.len()) {
            let x = pa.get(i).unwrap_or(&ra);
            let y = pb.get(i).unwrap_or(&rb);
            let m = sub(x, y, &format!("prefixItems/{i}"))?;
            if m == Value::Bool(false) {
                // Nothing fits here: the array ends before it.
                closed = true;
                break;
            }
            prefix.push(m);
        }
        let rest = if closed {
            Value::Bool(false)
        } else {
            sub(&ra, &rb, "items")?
        };
        let strip = |m: &serde_json::Map<String, Value>| -> serde_json::Map<String, Value> {
            m.iter()
                .filter(|(k, _)| !matches!(k.as_str(), "prefixItems" | "items" | "additionalItems"))
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect()
        };
        let mut a2 = strip(a);
        if !prefix.is_empty() {
            a2.insert("prefixItems".to_string(), Value::Array(prefix));
        }
        if rest != Value::Bool(true) {
            a2.insert("items".to_string(), rest);
        }
        a_own = a2;
        b_own = strip(b);
        (&a_own, &b_own)
    } else {
        (a, b)
    };
    let mut out = a.clone();
    for (k, vb) in b {
        let Some(va) = a.get(k) else {
            out.insert(k.clone(), vb.clone());
            continue;
        };
        if va == vb {
            continue;
        }
        let num = |v: &Value| v.as_f64();
        let merged = match k.as_str() {
            key if ANNOTATIONS.contains(&key) => va.clone(),
            "$defs" | "definitions" => va.clone(),
            "type" => {
                let (ta, tb) = (types_of(va), types_of(vb));
                let (Some(ta), Some(tb)) = (ta, tb) else {
                    return Err(format!(
                        "{at}/type: {va} or {vb} is not a JSON type (or list of them)"
                    ));
                };
                let t = ta & tb;
                if t == 0 {
                    return Err(format!(
                        "{at}: allOf asks for types {va} and {vb} at once: no value has both"
                    ));
                }
                type_names(t)
            }
            "required" => {
                let mut names = va.as_array().cloned().unwrap_or_default();
                for n in vb.as_array().into_iter().flatten() {
                    if !names.contains(n) {
                        names.push(n.clone());
                    }
                }
                Value::Array(names)
            }
            "properties" => {
                let (Some(pa), Some(pb)) = (va.as_object(), vb.as_object()) else {
                    return Err(format!("{at}/properties: not an object"));
                };
                let mut p = pa.clone();
                for (name, sb) in pb {
                    let m = match pa.get(name) {
                        Some(sa) => sub(sa, sb, &format!("properties/{name}"))?,
                        None => sb.clone(),
                    };
                    p.insert(name.clone(), m);
                }
                Value::Object(p)
            }
            "items" | "additionalProperties" | "additionalItems" => sub(va, vb, k)?,
            "minItems" | "minLength" | "minimum" | "exclusiveMinimum"
                if num(va).is_some() && num(vb).is_some() =>
            {
                if num(va) >= num(vb) {
                    va.clone()
                } else {
                    vb.clone()
                }
            }
            "maxItems" | "maxLength" | "maximum" | "exclusiveMaximum"
                if num(va).is_some() && num(vb).is_some() =>
            {
                if num(va) <= num(vb) {
                    va.clone()
                } else {
                    vb.clone()
                }
            }
            "enum" => {
                let (Some(ea), Some(eb)) = (va.as_array(), vb.as_array()) else {
                    return Err(format!("{at}/enum: not a list"));
                };
                let both: Vec<Value> = ea.iter().filter(|v| eb.contains(v)).cloned().collect();
                if both.is_empty() {
                    return Err(format!("{at}: allOf's enums have no value in common"));
                }
                Value::Array(both)
            }
            "const" => {
                return Err(format!(
                    "{at}: allOf asks for const {va} and const {vb} at once"
                ))
            }
            "multipleOf" => match (va.as_u64(), vb.as_u64()) {
                (Some(x), Some(y)) if x > 0 && y > 0 => {
                    let (mut g, mut h) = (x, y);
                    while h != 0 {
                        (g, h) = (h, g % h);
                    }
                    Value::from((x / g).saturating_mul(y))
                }
                _ => {
                    return Err(format!(
                        "{at}/multipleOf: allOf of multipleOf {va} and {vb} is not supported in \
                         structured output (whole numbers are)"
                    ))
                }
            },
            _ => {
                return Err(format!(
                    "{at}: allOf gives `{k}` two different values ({va} and {vb}); structured \
                     output cannot merge those (write the schema as one)"
                ))
            }
        };
        out.insert(k.clone(), merged);
    }
    // const beside enum: the const, if the enum has it.
    if let (Some(c), Some(e)) = (out.get("const"), out.get("enum").and_then(Value::as_array)) {
        if !e.contains(c) {
            return Err(format!("{at}: allOf's const {c} is not in its enum"));
        }
        out.remove("enum");
    }
    // A closed object holds the other side's other properties to its rule.
    let empty = serde_json::Map::new();
    for (side, other) in [(a, b), (b, a)] {
        let Some(rule) = other.get("additionalProperties") else {
            continue;
        };
        if *rule == Value::Bool(true) {
            continue;
        }
        let listed = other
            .get("properties")
            .and_then(Value::as_object)
            .unwrap_or(&empty);
        let names: Vec<String> = side
            .get("properties")
            .and_then(Value::as_object)
            .into_iter()
            .flat_map(|p| p.keys())
            .filter(|n| !listed.contains_key(*n))
            .cloned()
            .collect();
        for name in names {
            let Some(Value::Object(props)) = out.get_mut("properties") else {
                break;
            };
            let Some(current) = props.get(&name).cloned() else {
                continue;
            };
            let m = sub(&current, rule, &format!("properties/{name}"))?;
            if m == Value::Bool(false) {
                props.remove(&name);
                let required = out
                    .get("required")
                    .and_then(Value::as_array)
                    .is_some_and(|r| r.iter().any(|x| x.as_str() == Some(name.as_str())));
                if required {
                    return Err(format!(
                        "{at}: allOf requires property {name:?}, which another member's \
                         additionalProperties forbids"
                    ));
                }
            } else {
                props.insert(name, m);
            }
        }
    }
    Ok(out)
}

/// An array schema's positions: the tuple's schemas (`prefixItems`, or draft 7's `items`
/// list) and the schema of every item after them (`items`, or `additionalItems`; `true`
/// where none is given).
fn tuple_parts(m: &serde_json::Map<String, Value>) -> (Vec<Value>, Value) {
    let any = Value::Bool(true);
    match (m.get("prefixItems"), m.get("items")) {
        (Some(p), rest) => (
            p.as_array().cloned().unwrap_or_default(),
            rest.cloned().unwrap_or(any),
        ),
        (None, Some(Value::Array(p))) => {
            (p.clone(), m.get("additionalItems").cloned().unwrap_or(any))
        }
        (None, rest) => (Vec::new(), rest.cloned().unwrap_or(any)),
    }
}

/// A `type` value for a set of type bits.
fn type_names(t: u8) -> Value {
    let mut names = Vec::new();
    for (bit, name) in [
        (STR, "string"),
        (BOOL, "boolean"),
        (NULL, "null"),
        (OBJ, "object"),
        (ARR, "array"),
    ] {
        if t & bit != 0 {
            names.push(name);
        }
    }
    if t & NUM != 0 {
        names.push("number");
    } else if t & INT != 0 {
        names.push("integer");
    }
    match names.as_slice() {
        [one] => Value::from(*one),
        _ => Value::from(names),
    }
}

/// The types a schema's values can have, read from the schema itself (for a `$ref` whose node
/// is still being compiled): `type`, an enum's values, `properties`/`items`, the branches of
/// `anyOf`/`oneOf`, what a `$ref` points at; any type where it says nothing.
/// `seen`: the references followed so far (each is followed once: its types are already in the
/// union being built).
fn declared_types(root: &Value, s: &Value, depth: usize, seen: &mut Vec<String>) -> u8 {
    let Some(o) = s.as_object() else {
        return ALL;
    };
    if depth > MAX_DEPTH {
        return ALL;
    }
    if let Some(r) = o.get("$ref").and_then(Value::as_str) {
        if seen.iter().any(|x| x == r) {
            return 0;
        }
        seen.push(r.to_string());
        let target = ref_target(root, r);
        return target.map_or(ALL, |t| declared_types(root, t, depth + 1, seen));
    }
    if let Some(all) = o.get("allOf").and_then(Value::as_array) {
        // What every member (and the type beside them) allows.
        let beside = o.get("type").and_then(types_of).unwrap_or(ALL);
        return all.iter().fold(beside, |acc, m| {
            acc & declared_types(root, m, depth + 1, seen)
        });
    }
    if let Some(alts) = o
        .get("anyOf")
        .or_else(|| o.get("oneOf"))
        .and_then(Value::as_array)
    {
        return alts
            .iter()
            .fold(0, |acc, a| acc | declared_types(root, a, depth + 1, seen));
    }
    if let Some(t) = o.get("type").and_then(types_of) {
        return t;
    }
    match (o.get("enum"), o.get("const")) {
        (Some(Value::Array(vs)), _) => return vs.iter().fold(0, |acc, v| acc | types_of_value(v)),
        (None, Some(v)) => return types_of_value(v),
        _ => {}
    }
    if o.contains_key("properties") {
        OBJ
    } else if o.contains_key("items") || o.contains_key("prefixItems") {
        ARR
    } else {
        ALL
    }
}

/// `minimum`, `maximum` and the exclusive ones (numbers, or, as draft 4 wrote them, booleans
/// that make `minimum`/`maximum` exclusive).
fn bounds_of(obj: &serde_json::Map<String, Value>, at: &str) -> Result<Bounds, String> {
    let num = |k: &str| -> Result<Option<f64>, String> {
        obj.get(k)
            .filter(|v| !v.is_boolean())
            .map(|v| {
                v.as_f64()
                    .filter(|x| x.is_finite())
                    .ok_or_else(|| format!("{at}/{k}: {v} is not a number"))
            })
            .transpose()
    };
    let flag = |k: &str| obj.get(k).and_then(Value::as_bool).unwrap_or(false);
    let mut b = Bounds::NONE;
    if let Some(v) = num("minimum")? {
        (b.lo, b.lo_excl) = (v, flag("exclusiveMinimum"));
    }
    if let Some(v) = num("exclusiveMinimum")? {
        if v >= b.lo {
            (b.lo, b.lo_excl) = (v, true);
        }
    }
    if let Some(v) = num("maximum")? {
        (b.hi, b.hi_excl) = (v, flag("exclusiveMaximum"));
    }
    if let Some(v) = num("exclusiveMaximum")? {
        if v <= b.hi {
            (b.hi, b.hi_excl) = (v, true);
        }
    }
    if b.lo > b.hi || (b.lo == b.hi && (b.lo_excl || b.hi_excl)) {
        return Err(format!(
            "{at}: the bounds (minimum {}, maximum {}) leave no number",
            b.lo, b.hi
        ));
    }
    if let Some(m) = num("multipleOf")? {
        if m >= 1.0 && m.fract() == 0.0 && m <= 9.0e15 {
            // A whole step: its multiples are integers, written without a fraction.
            b = b.with_whole_step(m);
        } else {
            // A fractional step, read exactly from its decimal text: units / 10^digits.
            let (units, digits) = decimal_step(&obj["multipleOf"]).ok_or_else(|| {
                format!(
                    "{at}/multipleOf: {} is not supported in structured output (a positive \
                     step of at most 15 significant digits and 12 decimals is)",
                    obj["multipleOf"]
                )
            })?;
            b.step = m;
            b.step_units = units;
            b.step_digits = digits;
        }
    }
    Ok(b)
}

/// A positive decimal as `units / 10^digits` from its JSON text (`0.01` → (1, 2), `2.5` →
/// (25, 1), `1e-3` → (1, 3)); None where it takes over 15 significant digits or 12 decimals.
fn decimal_step(v: &Value) -> Option<(u64, u32)> {
    let text = v.to_string();
    let (mantissa, exp) = match text.find(['e', 'E']) {
        Some(i) => (&text[..i], text[i + 1..].parse::<i32>().ok()?),
        None => (text.as_str(), 0),
    };
    if mantissa.starts_with('-') {
        return None;
    }
    let (int, frac) = mantissa.split_once('.').unwrap_or((mantissa, ""));
    let frac = frac.trim_end_matches('0');
    let digits: String = format!("{int}{frac}");
    let digits = digits.trim_start_matches('0');
    if digits.is_empty() || digits.len() > 15 || !digits.bytes().all(|c| c.is_ascii_digit()) {
        return None;
    }
    let mut units: u64 = digits.parse().ok()?;
    let mut scale = frac.len() as i32 - exp;
    while scale < 0 {
        units = units.checked_mul(10)?;
        scale += 1;
    }
    if scale > 12 || units > 9_000_000_000_000_000 {
        return None;
    }
    Some((units, scale as u32))
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

/// Equal as JSON values (numbers by value: 1 and 1.0 are one number).
fn same_value(a: &Value, b: &Value) -> bool {
    a == b || matches!((a.as_f64(), b.as_f64()), (Some(x), Some(y)) if x == y)
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
        /// Keys written, a repeated one once (it is one property: the last one wins).
        keys: usize,
        /// Under minProperties or maxProperties: the other keys written, each once.
        others: Vec<Vec<u8>>,
        /// The node of the value after the key just read.
        value: usize,
    },
    Arr {
        node: usize,
        next: Next,
        count: usize,
        /// Under `uniqueItems`: the items written so far.
        uniq: Option<Box<Uniq>>,
    },
}

/// The items of an array under `uniqueItems`: each one's compact JSON text (a string's with
/// its escapes decoded and written again), and the raw text of a string item being written.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
struct Uniq {
    used: Vec<Vec<u8>>,
    cur: Vec<u8>,
}

/// The items a unique array holds so far (`None`: not under uniqueItems).
struct UsedItems<'a>(Option<&'a Vec<Vec<u8>>>);

impl UsedItems<'_> {
    fn contains(&self, text: &[u8]) -> bool {
        self.0.is_some_and(|u| u.iter().any(|t| t == text))
    }

    /// Not under uniqueItems at all.
    fn is_empty_set(&self) -> bool {
        self.0.is_none()
    }
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
    /// A string of `node`: `chars` characters so far, `re` its pattern's state.
    /// `cont`: UTF-8 continuation bytes still due (tracked when the string is constrained).
    Str {
        lex: StrLex,
        node: usize,
        chars: usize,
        re: Option<regex_automata::util::primitives::StateID>,
        cont: u8,
    },
    /// An object's key so far: `buf` the text it stands for (escapes decoded); `code` the
    /// code point of a `\u` escape being read; `other`: it is no property's name.
    Key {
        buf: Vec<u8>,
        lex: StrLex,
        code: u32,
        other: bool,
        /// Per `patternProperties` pattern, its state over the key so far (None: it cannot
        /// match any more).
        pats: Vec<Option<regex_automata::util::primitives::StateID>>,
        /// propertyNames' state over the key so far (None: the key can no longer meet it,
        /// or there is no propertyNames).
        nst: Option<regex_automata::util::primitives::StateID>,
    },
    /// A number of `node` (`text`: its bytes so far, kept under bounds).
    Num {
        n: Num,
        integer: bool,
        node: usize,
        text: Vec<u8>,
    },
    Lit(&'static [u8]),
    /// An enum value's text so far, against `node`'s values.
    Enum {
        node: usize,
        buf: Vec<u8>,
    },
}

/// The most readings of the text so far a [`SchemaState`] follows at once (branches of
/// unions whose values start alike); readings beyond it are dropped, which only narrows what
/// may be written.
const MAX_PATHS: usize = 32;

/// Where a JSON value under a [`Schema`] stands (module docs): every reading of the text so far
/// that is still open. A union (`anyOf`/`oneOf`) whose branches take the same first byte (two
/// object models, a string enum beside a string pattern) is followed down each of them, and a
/// reading ends when its branch refuses a byte.
#[derive(Clone, Debug)]
pub struct SchemaState {
    /// The first reading, and any others (kept apart so one reading costs no list).
    path: Path,
    more: Vec<Path>,
}

impl SchemaState {
    pub fn new(schema: Arc<Schema>) -> SchemaState {
        SchemaState {
            more: Vec::new(),
            path: Path::new(schema),
        }
    }

    fn paths(&self) -> impl Iterator<Item = &Path> {
        std::iter::once(&self.path).chain(&self.more)
    }

    /// In a string whose bytes are free (not an enum's, not a key), on every reading: any byte
    /// but `"`, `\` and control bytes is accepted without changing the state.
    pub fn in_plain_string(&self) -> bool {
        self.paths().all(Path::in_plain_string)
    }

    /// One value has been written (only whitespace may follow), on some reading.
    pub fn is_complete(&self) -> bool {
        self.paths().any(Path::is_complete)
    }

    /// A complete value that more bytes could still extend (a top-level number, an enum value
    /// that is a prefix of a longer one, or another reading still open).
    pub fn can_continue(&self) -> bool {
        self.paths().any(|p| !p.is_complete() || p.can_continue())
    }

    /// Feeds every byte; false (the state then undefined) as soon as one does not fit.
    pub fn feed_all(&mut self, bytes: &[u8]) -> bool {
        bytes.iter().all(|&b| self.feed(b))
    }

    /// The next byte; false if no reading takes it.
    #[inline]
    pub fn feed(&mut self, b: u8) -> bool {
        // One reading that cannot fork at this byte: in place.
        if self.more.is_empty() && !self.path.may_fork(b) {
            return self.path.feed(b);
        }
        if !self.paths().any(|p| p.may_fork(b)) {
            // Several readings, none forking here: each in place.
            let first = self.path.feed(b);
            self.more.retain_mut(|p| p.feed(b));
            if !first {
                if self.more.is_empty() {
                    return false;
                }
                self.path = self.more.remove(0);
            }
            return true;
        }
        self.feed_readings(b)
    }

    /// [`SchemaState::feed`] down every reading, forking at ambiguous union starts.
    #[inline(never)]
    fn feed_readings(&mut self, b: u8) -> bool {
        let mut paths = std::mem::take(&mut self.more);
        let blank = Path::new(self.path.schema.clone());
        paths.insert(0, std::mem::replace(&mut self.path, blank));
        let mut out: Vec<Path> = Vec::with_capacity(paths.len());
        for mut p in paths {
            // A union can only start where no scalar is open: keep the state to read again
            // down the other branches.
            let Some(before) = p.may_fork(b).then(|| p.clone()) else {
                if p.feed(b) {
                    push_path(&mut out, p);
                }
                continue;
            };
            p.choices = Some(Box::default());
            let ok = p.feed(b);
            // Other readings in the order of their branches (the first branches kept when
            // there are too many).
            let mut todo: std::collections::VecDeque<Vec<usize>> =
                p.choices.take().map(|c| c.forks.into()).unwrap_or_default();
            if ok {
                push_path(&mut out, p);
            }
            while let Some(force) = todo.pop_front() {
                let mut q = before.clone();
                q.choices = Some(Box::new(Choices {
                    force,
                    ..Choices::default()
                }));
                let ok = q.feed(b);
                if let Some(c) = q.choices.take() {
                    for f in c.forks.into_iter().rev() {
                        todo.push_front(f);
                    }
                }
                if ok {
                    push_path(&mut out, q);
                }
            }
        }
        out.truncate(MAX_PATHS);
        if out.is_empty() {
            return false;
        }
        self.path = out.remove(0);
        self.more = out;
        true
    }
}

/// The readings a value of `node` starting with a byte of type `first` opens: its branches of
/// that type, counted through branches that are unions themselves (compile refuses cycles of
/// those before asking).
fn alike_ways(nodes: &[Node], node: usize, first: u8) -> usize {
    let n = &nodes[node];
    if n.alts.is_empty() {
        return usize::from(n.value_types() & first != 0);
    }
    n.alts
        .iter()
        .zip(&n.alt_types)
        .filter(|(_, &t)| t & first != 0)
        .map(|(&a, _)| alike_ways(nodes, a, first))
        .fold(0usize, usize::saturating_add)
}

/// Adds a reading unless an equal one is already there.
fn push_path(out: &mut Vec<Path>, p: Path) {
    if !out.iter().any(|o| o.same(&p)) {
        out.push(p);
    }
}

/// One reading of the text under a [`Schema`].
#[derive(Clone, Debug)]
struct Path {
    schema: Arc<Schema>,
    stack: Vec<Frame>,
    scalar: Scalar,
    started: bool,
    done: bool,
    spaces: usize,
    /// While a byte is fed to a schema whose unions fork: the choices at its ambiguous
    /// union starts.
    choices: Option<Box<Choices>>,
}

/// The choices of one byte among union branches that take it alike.
#[derive(Clone, Debug, Default)]
struct Choices {
    /// Branches to take at the byte's ambiguous starts, in order (a reading down another
    /// branch than the first).
    force: Vec<usize>,
    /// The branches taken so far at this byte.
    made: Vec<usize>,
    /// The choices this byte left open: the forced choices of each other reading.
    forks: Vec<Vec<usize>>,
}

impl Path {
    /// Before the value's first byte.
    fn new(schema: Arc<Schema>) -> Path {
        Path {
            schema,
            stack: Vec::new(),
            scalar: Scalar::None,
            started: false,
            done: false,
            spaces: 0,
            choices: None,
        }
    }

    /// `b` may start a value read several ways ([`Schema::forks`]).
    #[inline]
    fn may_fork(&self, b: u8) -> bool {
        if !matches!(self.scalar, Scalar::None)
            || !matches!(
                b,
                b'{' | b'[' | b'"' | b'-' | b'0'..=b'9' | b't' | b'f' | b'n'
            )
        {
            return false;
        }
        let forks = &self.schema.forks;
        if !self.started {
            return forks[0];
        }
        match self.stack.last() {
            Some(Frame::Obj {
                next: Next::Value,
                value,
                ..
            }) => forks[*value],
            Some(Frame::Arr {
                node,
                next: Next::FirstOrEnd | Next::Item,
                count,
                ..
            }) => forks[self.schema.nodes[*node].item_at(*count)],
            _ => false,
        }
    }

    fn same(&self, o: &Path) -> bool {
        self.stack == o.stack
            && self.scalar == o.scalar
            && self.started == o.started
            && self.done == o.done
            && self.spaces == o.spaces
    }

    fn in_plain_string(&self) -> bool {
        match self.scalar {
            Scalar::Str { lex, node, .. } if lex.plain() => {
                !self.schema.nodes[node].constrains_strings() && self.used_items().is_empty_set()
            }
            _ => false,
        }
    }

    /// One value has been written (only whitespace may follow). A number at the top level is
    /// complete when it could end.
    fn is_complete(&self) -> bool {
        match &self.scalar {
            Scalar::Num {
                n,
                integer,
                node,
                text,
            } => {
                let b = &self.schema.nodes[*node].bounds;
                self.stack.is_empty()
                    && n.complete()
                    && (b.is_none() || b.viable(text, *integer, true))
            }
            Scalar::Enum { node, buf } => {
                self.stack.is_empty() && self.enum_values(*node).iter().any(|v| v == buf)
            }
            Scalar::None => self.done,
            _ => false,
        }
    }

    /// A complete value that more bytes could still extend (a top-level number, or an enum
    /// value that is a prefix of a longer one): a stop token may end it here, or it may go on.
    fn can_continue(&self) -> bool {
        match &self.scalar {
            Scalar::Num { .. } => self.stack.is_empty(),
            Scalar::Enum { node, buf } => {
                self.stack.is_empty()
                    && self
                        .enum_values(*node)
                        .iter()
                        .any(|v| v.len() > buf.len() && v.starts_with(buf))
            }
            _ => false,
        }
    }

    fn enum_values(&self, node: usize) -> &[Vec<u8>] {
        self.schema.nodes[node].enumv.as_deref().unwrap_or(&[])
    }

    fn feed(&mut self, b: u8) -> bool {
        match &mut self.scalar {
            Scalar::Str {
                lex,
                node,
                chars,
                re,
                cont,
            } => {
                let (lex, node, mut chars, mut re, mut cont) = (*lex, *node, *chars, *re, *cont);
                let schema = self.schema.clone();
                let nd = &schema.nodes[node];
                match string_byte(b, lex) {
                    Some(Some(lex2)) => {
                        if nd.constrains_strings() {
                            let plain = !lex.escape && lex.hex == 0;
                            // A character starts at a raw lead byte (raw bytes must walk
                            // UTF-8, so each character counts once) or at a backslash, but
                            // not the backslash of a surrogate pair's low half.
                            let starts = if plain && b != b'\\' {
                                match crate::json_constraints::utf8_step(cont, b) {
                                    Some((next, starts)) => {
                                        cont = next;
                                        starts
                                    }
                                    None => return false,
                                }
                            } else if plain {
                                if cont > 0 {
                                    return false;
                                }
                                !lex.high
                            } else {
                                false
                            };
                            if starts {
                                if chars >= nd.max_len {
                                    return false;
                                }
                                chars += 1;
                            }
                            if let (Some(p), Some(st)) = (&nd.pattern, re) {
                                // The pattern sees the string's characters: an escape's
                                // character once it is known (`\u` escapes are not written
                                // under a pattern).
                                // A backslash only when some escaped character can follow.
                                if plain && b == b'\\' {
                                    let escapable = [b'"', b'\\', b'/', b'\n', b'\t', b'\r', 8, 12];
                                    if !escapable.iter().any(|&c| {
                                        p.next(st, c).is_some_and(|t| p.fits(t, 0, chars))
                                    }) {
                                        return false;
                                    }
                                }
                                let c = match (lex.escape, lex.hex) {
                                    (false, 0) if b != b'\\' => Some(b),
                                    (false, 0) => None,
                                    (true, _) => match b {
                                        b'u' => return false,
                                        b'n' => Some(b'\n'),
                                        b't' => Some(b'\t'),
                                        b'r' => Some(b'\r'),
                                        b'b' => Some(0x08),
                                        b'f' => Some(0x0c),
                                        other => Some(other),
                                    },
                                    _ => None,
                                };
                                if let Some(c) = c {
                                    // An escape is one ASCII character (`cont` stays 0).
                                    match p.next(st, c) {
                                        Some(next) if p.fits(next, cont, chars) => re = Some(next),
                                        _ => return false,
                                    }
                                }
                            }
                        }
                        self.scalar = Scalar::Str {
                            lex: lex2,
                            node,
                            chars,
                            re,
                            cont,
                        };
                        if let Some(u) = self.uniq_mut() {
                            u.cur.push(b);
                        }
                    }
                    Some(None) => {
                        if chars < nd.min_len || cont > 0 {
                            return false;
                        }
                        if let (Some(p), Some(st)) = (&nd.pattern, re) {
                            if !p.accepts_end(st) {
                                return false;
                            }
                        }
                        // Under uniqueItems: the string as a value, unless written before
                        // (the writer goes on with more characters instead).
                        if let Some(u) = self.uniq_mut() {
                            let mut quoted = Vec::with_capacity(u.cur.len() + 2);
                            quoted.push(b'"');
                            quoted.extend_from_slice(&u.cur);
                            quoted.push(b'"');
                            let text = serde_json::from_slice::<String>(&quoted)
                                .ok()
                                .and_then(|v| serde_json::to_vec(&v).ok())
                                .unwrap_or(quoted);
                            if u.used.contains(&text) {
                                return false;
                            }
                            u.used.push(text);
                        }
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
            Scalar::Num {
                n,
                integer,
                node,
                text,
            } => {
                let (n, integer, node) = (*n, *integer, *node);
                let bounds = self.schema.nodes[node].bounds;
                let bounded = !bounds.is_none();
                let next = number_byte(n, b)
                    .filter(|next| !integer || matches!(next, Num::Zero | Num::Int))
                    .filter(|next| !bounded || !matches!(next, Num::E | Num::ESign | Num::Exp));
                if let Some(next) = next {
                    if bounded {
                        text.push(b);
                        if !bounds.viable(text, integer, false) {
                            text.pop();
                            return false;
                        }
                    }
                    if let Scalar::Num { n, .. } = &mut self.scalar {
                        *n = next;
                    }
                    return true;
                }
                if !n.complete() || (bounded && !bounds.viable(text, integer, true)) {
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
                // (Under uniqueItems, the values not yet written.)
                let used = self.used_items();
                let open = |v: &&Vec<u8>| !used.contains(v);
                if values.iter().filter(open).any(|v| v.starts_with(&ext)) {
                    // A string value ends at its closing quote: nothing can follow inside it.
                    if ext.len() > 1
                        && ext[0] == b'"'
                        && values.iter().filter(open).any(|v| *v == ext)
                    {
                        self.scalar = Scalar::None;
                        self.item_written(node, ext);
                        self.value_done();
                    } else {
                        self.scalar = Scalar::Enum { node, buf: ext };
                    }
                    return true;
                }
                ext.pop();
                if !values.iter().filter(open).any(|v| *v == ext) {
                    return false;
                }
                // The value ended; the byte belongs to what follows it.
                self.scalar = Scalar::None;
                self.item_written(node, ext);
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
                node,
                next,
                seen,
                keys,
                ..
            } => {
                let n = &self.schema.nodes[node];
                let unseen_props = n.props.len() > seen.count_ones() as usize;
                // Under maxProperties: once the keys left are the required ones, only those.
                let missing = (n.required & !seen).count_ones() as usize;
                // Other keys: any propertyNames leaves some.
                let others = !n.names_on || n.names.is_some();
                let more = if keys.saturating_add(missing) >= n.max_props {
                    missing > 0
                } else {
                    (others && (n.additional.is_some() || !n.pattern_props.is_empty()))
                        || unseen_props
                };
                match (next, b) {
                    (Next::FirstOrEnd | Next::CommaOrEnd, b'}') => {
                        if n.required & !seen != 0 || keys < n.min_props {
                            return false;
                        }
                        self.stack.pop();
                        self.value_done();
                        true
                    }
                    (Next::FirstOrEnd | Next::Item, b'"') if more => {
                        let pats = n.pattern_props.iter().map(|p| Some(p.start())).collect();
                        let nst = n.names.as_ref().map(|p| p.start());
                        self.set_next(Next::Colon);
                        self.scalar = Scalar::Key {
                            buf: Vec::new(),
                            lex: StrLex::default(),
                            code: 0,
                            other: false,
                            pats,
                            nst,
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
            Frame::Arr {
                node, next, count, ..
            } => {
                let n = &self.schema.nodes[node];
                // The next item's node (`count` items are written).
                let (min, max, items) = (n.min_items, n.max_items, n.item_at(count));
                match (next, b) {
                    (Next::FirstOrEnd | Next::CommaOrEnd, b']') if count >= min => {
                        self.stack.pop();
                        self.value_done();
                        true
                    }
                    (Next::CommaOrEnd, b',')
                        if count < max
                            && self.can_start(items, self.stack.len())
                            && self.unused_item_left(items) =>
                    {
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

    /// The array this scalar is an item of, when it holds its items unique.
    fn uniq_mut(&mut self) -> Option<&mut Uniq> {
        match self.stack.last_mut() {
            Some(Frame::Arr { uniq: Some(u), .. }) => Some(u),
            _ => None,
        }
    }

    /// The items written so far of the array this scalar is an item of, under uniqueItems.
    fn used_items(&self) -> UsedItems<'_> {
        match self.stack.last() {
            Some(Frame::Arr { uniq: Some(u), .. }) => UsedItems(Some(&u.used)),
            _ => UsedItems(None),
        }
    }

    /// An enum value was written as an item (of a unique array, which records it).
    /// With it, every other value of `node`'s enum equal to it (1 and 1.0) counts as written.
    fn item_written(&mut self, node: usize, text: Vec<u8>) {
        let schema = self.schema.clone();
        if let Some(u) = self.uniq_mut() {
            let v: Option<Value> = serde_json::from_slice(&text).ok();
            if let (Some(v), Some(values)) = (v, &schema.nodes[node].enumv) {
                for t in values {
                    let equal =
                        serde_json::from_slice::<Value>(t).is_ok_and(|w| same_value(&v, &w));
                    if equal && *t != text {
                        u.used.push(t.clone());
                    }
                }
            }
            u.used.push(text);
        }
    }

    /// Under uniqueItems some value of `items` is not yet written (strings always have one).
    fn unused_item_left(&self, items: usize) -> bool {
        let UsedItems(Some(used)) = self.used_items() else {
            return true;
        };
        let n = &self.schema.nodes[items];
        match &n.enumv {
            Some(values) => values.iter().any(|v| !used.contains(v)),
            None => {
                n.types & STR != 0
                    || (n.types & BOOL != 0
                        && !(used.contains(&b"true".to_vec()) && used.contains(&b"false".to_vec())))
                    || (n.types & NULL != 0 && !used.contains(&b"null".to_vec()))
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
        let schema = self.schema.clone();
        let n = &schema.nodes[node];
        if !n.alts.is_empty() {
            // The branch whose types take this first byte; where several do, this reading takes
            // the forced one or the first, and the others are left to other readings.
            let want = match b {
                b'{' => OBJ,
                b'[' => ARR,
                b'"' => STR,
                b'-' | b'0'..=b'9' => INT | NUM,
                b't' | b'f' => BOOL,
                b'n' => NULL,
                _ => return false,
            };
            let fits: Vec<usize> = n
                .alts
                .iter()
                .zip(&n.alt_types)
                .filter(|(_, &t)| t & want != 0)
                .map(|(&a, _)| a)
                .collect();
            let alt = match fits.len() {
                0 => return false,
                1 => fits[0],
                _ => {
                    // (Without choices to record the schema never forks: the first.)
                    let Some(c) = self.choices.as_deref_mut() else {
                        return self.start_value(b, fits[0]);
                    };
                    let pick = match c.force.get(c.made.len()) {
                        Some(&f) if fits.contains(&f) => f,
                        Some(_) => return false,
                        None => {
                            for &other in &fits[1..] {
                                let mut seq = c.made.clone();
                                seq.push(other);
                                c.forks.push(seq);
                            }
                            fits[0]
                        }
                    };
                    c.made.push(pick);
                    pick
                }
            };
            return self.start_value(b, alt);
        }
        if let Some(values) = &n.enumv {
            let used = self.used_items();
            if !values
                .iter()
                .any(|v| v.first() == Some(&b) && !used.contains(v))
            {
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
                    keys: 0,
                    others: Vec::new(),
                    value: 1,
                });
                true
            }
            b'[' if t & ARR != 0 => {
                self.stack.push(Frame::Arr {
                    node,
                    next: Next::FirstOrEnd,
                    count: 0,
                    uniq: n.unique.then(Box::default),
                });
                true
            }
            b'"' if t & STR != 0 => {
                if let Some(u) = self.uniq_mut() {
                    u.cur.clear();
                }
                self.scalar = Scalar::Str {
                    lex: StrLex::default(),
                    node,
                    chars: 0,
                    re: n.pattern.as_ref().map(|p| p.start()),
                    cont: 0,
                };
                true
            }
            b'-' | b'0'..=b'9' if t & (INT | NUM) != 0 => {
                let integer = t & NUM == 0;
                if !n.bounds.is_none() && !n.bounds.viable(&[b], integer, false) {
                    return false;
                }
                let num = match b {
                    b'-' => Num::Minus,
                    b'0' => Num::Zero,
                    _ => Num::Int,
                };
                self.scalar = Scalar::Num {
                    n: num,
                    integer,
                    node,
                    text: if n.bounds.is_none() {
                        Vec::new()
                    } else {
                        vec![b]
                    },
                };
                true
            }
            b't' if t & BOOL != 0 && !self.used_items().contains(b"true") => {
                // A literal once begun is that literal: an item from here.
                if let Some(u) = self.uniq_mut() {
                    u.used.push(b"true".to_vec());
                }
                self.scalar = Scalar::Lit(b"rue");
                true
            }
            b'f' if t & BOOL != 0 && !self.used_items().contains(b"false") => {
                // A literal once begun is that literal: an item from here.
                if let Some(u) = self.uniq_mut() {
                    u.used.push(b"false".to_vec());
                }
                self.scalar = Scalar::Lit(b"alse");
                true
            }
            b'n' if t & NULL != 0 && !self.used_items().contains(b"null") => {
                // A literal once begun is that literal: an item from here.
                if let Some(u) = self.uniq_mut() {
                    u.used.push(b"null".to_vec());
                }
                self.scalar = Scalar::Lit(b"ull");
                true
            }
            _ => false,
        }
    }

    /// A value of `node` can begin inside `depth` open containers (containers stop at the
    /// nesting limit).
    fn can_start(&self, node: usize, depth: usize) -> bool {
        let n = &self.schema.nodes[node];
        let types = if n.alts.is_empty() {
            n.value_types()
        } else {
            n.alt_types.iter().fold(0, |a, t| a | t)
        };
        depth < MAX_DEPTH || types & !(OBJ | ARR) != 0
    }

    /// A value ended: at the top level the answer is complete.
    fn value_done(&mut self) {
        if self.stack.is_empty() {
            self.done = true;
        }
    }

    /// A byte of an object's key. The key is matched against the properties as the text it
    /// stands for (escapes decoded), so `"\u0061"` is property `a`.
    fn key_byte(&mut self, b: u8) -> bool {
        let Some(Frame::Obj {
            node, seen, keys, ..
        }) = self.stack.last().cloned()
        else {
            return false;
        };
        let schema = self.schema.clone();
        let n = &schema.nodes[node];
        // Under maxProperties, with only room for the required keys not yet written: those
        // (the others count as written, and no other key is taken).
        let tight = keys.saturating_add((n.required & !seen).count_ones() as usize) >= n.max_props;
        let (seen, other_node) = if tight {
            (seen | !n.required, None)
        } else {
            (seen, n.additional)
        };
        // patternProperties: a key no property starts with may go on while a pattern can still
        // match it (written without escapes; up to MAX_KEY bytes, past which no pattern is
        // followed and the key is refused).
        let patterns = !tight && !n.pattern_props.is_empty();
        // Keys are counted (min/maxProperties): other keys are told apart by their text, so
        // they are written without `\u` escapes and up to MAX_KEY bytes.
        let counting = n.min_props > 0 || n.max_props < usize::MAX;
        // propertyNames: other keys must meet it (written without escapes); listed properties
        // that do not were left out at compile time.
        let named = n.names_on;
        let Scalar::Key {
            buf,
            lex,
            code,
            other,
            pats,
            nst,
        } = &mut self.scalar
        else {
            return false;
        };
        // The unseen properties the key so far is a prefix of.
        let open = |buf: &[u8]| -> Vec<&[u8]> { open_props(n, seen, buf) };
        let plain = lex.plain();
        if plain && b == b'"' {
            // The key ends: a property not yet written, or (open objects) another key.
            let prop = (!*other)
                .then(|| n.props.iter().position(|(p, _)| p == buf))
                .flatten();
            let name = (prop.is_none() && counting).then(|| buf.clone());
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
                None if named
                    && !n.names.as_ref().is_some_and(|p| {
                        nst.is_some_and(|s| p.accepts_end(s))
                            && String::from_utf8_lossy(buf).chars().count() >= n.names_min
                    }) =>
                {
                    return false
                }
                None => {
                    // The patterns the whole key matches.
                    let mask = if patterns {
                        pats.iter()
                            .zip(&n.pattern_props)
                            .enumerate()
                            .filter(|(_, (st, p))| st.is_some_and(|st| p.accepts_end(st)))
                            .fold(0usize, |m, (i, _)| m | 1 << i)
                    } else {
                        0
                    };
                    match (mask, other_node) {
                        (0, Some(a)) => a,
                        (0, None) => return false,
                        (m, _) => match n.pattern_nodes[m] {
                            // (Patterns that never meet: not matched together.)
                            usize::MAX => return false,
                            v => v,
                        },
                    }
                }
            };
            if let Some(Frame::Obj { keys, others, .. }) = self.stack.last_mut() {
                match name {
                    Some(name) if others.contains(&name) => {}
                    Some(name) => {
                        others.push(name);
                        *keys += 1;
                    }
                    None => *keys += 1,
                }
            }
            // At the nesting limit a key whose value must be an object or array could take
            // no value.
            if !self.can_start(value, self.stack.len()) {
                return false;
            }
            if let Some(Frame::Obj { value: v, .. }) = self.stack.last_mut() {
                *v = value;
            }
            self.scalar = Scalar::None;
            return true;
        }
        let Some(Some(l2)) = string_byte(b, *lex) else {
            return false;
        };
        let additional = other_node.is_some();
        if *other {
            *lex = l2;
            return additional;
        }
        let at = buf.len();
        if lex.hex > 0 {
            // A `\u` escape's hex digit: the code point so far, and the range it can still be.
            *code = *code * 16 + (b as char).to_digit(16).unwrap_or(0);
            *lex = l2;
            if l2.hex > 0 {
                let lo = *code << (4 * l2.hex as u32);
                let hi = lo + (1 << (4 * l2.hex as u32)) - 1;
                return (additional && !counting && !named)
                    || open(buf).iter().any(|p| {
                        std::str::from_utf8(&p[at..])
                            .ok()
                            .and_then(|t| t.chars().next())
                            .is_some_and(|c| (lo..=hi).contains(&(c as u32)))
                    });
            }
            match char::from_u32(std::mem::take(code)) {
                Some(c) => {
                    let mut utf8 = [0u8; 4];
                    buf.extend_from_slice(c.encode_utf8(&mut utf8).as_bytes());
                }
                // Half of a surrogate pair: no property's name (they are written raw), and no
                // pattern's key.
                None => {
                    *other = true;
                    pats.iter_mut().for_each(|p| *p = None);
                }
            }
        } else if lex.escape {
            *lex = l2;
            match b {
                b'u' => {
                    return (additional && !counting && !named)
                        || open(buf).iter().any(|p| p.len() > at)
                }
                b'b' => buf.push(8),
                b'f' => buf.push(12),
                b'n' => buf.push(b'\n'),
                b'r' => buf.push(b'\r'),
                b't' => buf.push(b'\t'),
                other => buf.push(other),
            }
        } else if b == b'\\' {
            *lex = l2;
            return (additional && !named) || open(buf).iter().any(|p| p.len() > at);
        } else {
            buf.push(b);
        }
        if let Some(p) = &n.names {
            // Characters and continuation bytes due, from the key so far.
            let (mut chars, mut cont) = (0usize, 0u8);
            for &c in buf.iter() {
                match crate::json_constraints::utf8_step(cont, c) {
                    Some((next, starts)) => {
                        cont = next;
                        chars += usize::from(starts);
                    }
                    None => cont = 0,
                }
            }
            for &c in &buf[at..] {
                *nst = nst.and_then(|s| p.next(s, c));
            }
            *nst = nst.filter(|&s| p.fits(s, cont, chars));
        }
        if patterns {
            for (st, p) in pats.iter_mut().zip(&n.pattern_props) {
                for &c in &buf[at..] {
                    *st = st.and_then(|s| p.next(s, c));
                }
            }
        }
        if buf.len() > MAX_KEY {
            // Longer than any property's name (compile refuses longer ones), and than the keys
            // patterns are followed over.
            *other = true;
            return additional && !patterns && !counting && !named;
        }
        let others_ok = additional || (patterns && pats.iter().any(Option::is_some));
        !open(buf).is_empty() || (others_ok && (!named || nst.is_some()))
    }
}

/// The names of `n`'s properties not in `seen` that begin with `buf`.
fn open_props<'a>(n: &'a Node, seen: u64, buf: &[u8]) -> Vec<&'a [u8]> {
    n.props
        .iter()
        .enumerate()
        .filter(|(i, (p, _))| seen & (1 << i) == 0 && p.starts_with(buf))
        .map(|(_, (p, _))| p.as_slice())
        .collect()
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

    /// `pattern`, `minLength`/`maxLength` and number bounds hold every value written, and
    /// a random walk over the allowed bytes never reaches a state without a way on.
    #[test]
    fn string_and_number_constraints_are_held() {
        let schema = json!({
            "type": "object",
            "properties": {
                "id": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}$"},
                "n": {"type": "integer", "minimum": 1, "maximum": 12},
                "x": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
                "name": {"type": "string", "minLength": 2, "maxLength": 4},
                "neg": {"type": "integer", "maximum": -10},
                "tag": {"type": "string", "pattern": "cat"}
            },
            "required": ["id", "n", "x", "name"],
            "additionalProperties": false
        });
        let good =
            r#"{"id": "AB12", "n": 12, "x": 0.5, "name": "a\"c", "neg": -10, "tag": "a cat"}"#;
        assert_eq!(accepts(&schema, good), (true, true));
        for bad in [
            r#"{"id": "AB1""#,
            r#"{"id": "ab"#,
            r#"{"id": "AB123"#,
            r#"{"id": "AB12", "n": 13"#,
            r#"{"id": "AB12", "n": 0"#,
            r#"{"id": "AB12", "n": -"#,
            r#"{"id": "AB12", "n": 1.5"#,
            r#"{"id": "AB12", "n": 1, "x": 1.5"#,
            r#"{"id": "AB12", "n": 1, "x": 0,"#,
            r#"{"id": "AB12", "n": 1, "x": 1e"#,
            r#"{"id": "AB12", "n": 1, "x": 1, "name": "a""#,
            r#"{"id": "AB12", "n": 1, "x": 1, "name": "abcde"#,
            r#"{"id": "AB12", "n": 1, "x": 1, "name": "ab", "neg": -9,"#,
            r#"{"id": "AB12", "n": 1, "x": 1, "name": "ab", "tag": "ca""#,
            r#"{"id": "A\u0042"#,
        ] {
            let (ok, _) = accepts(&schema, bad);
            assert!(!ok, "accepted {bad}");
        }
        // The same prefixes one byte shorter are accepted (each refusal is at its last byte).
        assert!(accepts(&schema, r#"{"id": "AB12", "n": 1"#).0);
        assert!(accepts(&schema, r#"{"id": "AB12", "n": 1, "x": 1."#).0);
        // A string under constraints is not a plain one (every token is checked there).
        let mut st = SchemaState::new(Schema::compile(&schema).unwrap());
        assert!(st.feed_all(br#"{"id": ""#));
        assert!(!st.in_plain_string());
        // Random walks: at every step some byte is allowed, or the value is complete.
        // ("tag", unanchored, would make walks wait for "cat" in random text.)
        let mut walk_schema = schema.clone();
        walk_schema["properties"]
            .as_object_mut()
            .unwrap()
            .remove("tag");
        let completed = random_walks(&walk_schema, 300, 400, 0x9e37_79b9_7f4a_7c15, |v| {
            let id = v["id"].as_str().unwrap();
            assert!(id.len() == 4 && id.as_bytes()[..2].iter().all(u8::is_ascii_uppercase));
            let n = v["n"].as_i64().unwrap();
            assert!((1..=12).contains(&n), "{n}");
            let x = v["x"].as_f64().unwrap();
            assert!(x > 0.0 && x <= 1.0, "{x}");
            let len = v["name"].as_str().unwrap().chars().count();
            assert!((2..=4).contains(&len), "{len}");
        });
        assert!(completed >= 100, "{completed} of 300 walks completed");
    }

    /// `walks` random walks of up to `steps` bytes under `schema`, each byte drawn among the
    /// allowed printable ones (now and then a closing one, so walks end): at every step some
    /// byte is allowed or the value is complete. A walk ends at a complete value (one that
    /// could go on, half the time), which must parse and pass `check`. Returns how many did.
    fn random_walks(
        schema: &Value,
        walks: usize,
        steps: usize,
        seed: u64,
        mut check: impl FnMut(&Value),
    ) -> usize {
        let compiled = Schema::compile(schema).unwrap_or_else(|e| panic!("{schema}: {e}"));
        let alphabet: Vec<u8> = (0x20..0x7f).collect();
        let mut seed = seed | 1;
        let mut rand = |n: usize| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            (seed % n as u64) as usize
        };
        let mut completed = 0;
        for walk in 0..walks {
            let mut st = SchemaState::new(compiled.clone());
            let mut text = Vec::new();
            for _ in 0..steps {
                let allowed: Vec<u8> = alphabet
                    .iter()
                    .copied()
                    .filter(|&b| st.clone().feed(b))
                    .collect();
                if allowed.is_empty() {
                    assert!(
                        st.is_complete(),
                        "{schema}, walk {walk}: stuck after {:?}",
                        String::from_utf8_lossy(&text)
                    );
                    break;
                }
                let closing: Vec<u8> = allowed
                    .iter()
                    .copied()
                    .filter(|b| b"\"}],".contains(b))
                    .collect();
                let b = if !closing.is_empty() && rand(3) == 0 {
                    closing[rand(closing.len())]
                } else {
                    allowed[rand(allowed.len())]
                };
                assert!(st.feed(b));
                text.push(b);
                if st.is_complete() && (!st.can_continue() || rand(2) == 0) {
                    let v: Value = serde_json::from_slice(&text).unwrap_or_else(|e| {
                        panic!("{schema}: {e}: {:?}", String::from_utf8_lossy(&text))
                    });
                    check(&v);
                    completed += 1;
                    break;
                }
            }
        }
        completed
    }

    /// Random walks over the allowed bytes, for schemas using every supported keyword: at
    /// every step some byte is allowed or the value is complete, and a completed value parses.
    #[test]
    fn no_schema_leads_to_a_dead_end() {
        let schemas = [
            json!({"enum": [1, 10, -2.5, "a", "ab", true, null]}),
            json!({"type": "number", "enum": [0, 0.5, 12]}),
            json!({"const": "x\"y"}),
            json!({"type": "integer"}),
            json!({"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 3}),
            json!({"type": "array", "maxItems": 0}),
            json!({"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 1, "maxItems": 1}),
            json!({"type": "object", "properties": {"a": {"type": "boolean"}, "b": {"type": "null"}},
                   "required": ["a", "b"], "additionalProperties": false}),
            json!({"type": "object", "properties": {"a": {"type": "boolean"}},
                   "additionalProperties": false}),
            json!({"type": "object", "properties": {}, "additionalProperties": false}),
            json!({"type": "object", "properties": {"k": {"type": "integer"}},
                   "additionalProperties": {"type": "string", "maxLength": 3}}),
            json!({"anyOf": [{"type": "string", "pattern": "^x+$"}, {"type": "integer",
                   "minimum": -3, "maximum": 3}, {"type": "null"},
                   {"type": "array", "items": {"type": "boolean"}, "maxItems": 2}]}),
            json!({"$defs": {"node": {"type": "object", "properties": {
                      "v": {"type": "integer", "minimum": 0, "maximum": 99},
                      "next": {"anyOf": [{"$ref": "#/$defs/node"}, {"type": "null"}]}},
                   "required": ["v", "next"], "additionalProperties": false}},
                   "$ref": "#/$defs/node"}),
            json!({"type": ["string", "number"], "minLength": 1, "maximum": 0.5,
                   "exclusiveMinimum": -0.5}),
            json!({"anyOf": [{"enum": ["a", "b"]}, {"type": "integer"}, {"const": true}]}),
            json!({"type": "object", "properties": {"a": {"type": "integer"}},
                   "additionalProperties": {"type": "integer", "maximum": 5}}),
            json!({"type": "object", "properties": {"\"q": {"type": "null"}, "é": {"type": "null"}},
                   "additionalProperties": false}),
            json!({"type": "string", "pattern": "^(ab|c+)$", "minLength": 2, "maxLength": 4}),
        ];
        // Literal["a", "b"] | int | True: a branch each, by the first byte.
        let lit = &schemas[14];
        assert_eq!(accepts(lit, r#""b""#), (true, true));
        assert_eq!(accepts(lit, "-12"), (true, true));
        assert_eq!(accepts(lit, "true"), (true, true));
        assert!(!accepts(lit, r#""c"#).0 && !accepts(lit, "false").0 && !accepts(lit, "1.5").0);
        // A recursive Optional: each level holds another or null.
        let list = &schemas[12];
        assert_eq!(
            accepts(list, r#"{"v": 1, "next": {"v": 2, "next": null}}"#),
            (true, true)
        );
        assert!(!accepts(list, r#"{"v": 1, "next": {"v": 100"#).0);
        for (i, schema) in schemas.iter().enumerate() {
            let seed = 0x2545_f491_4f6c_dd1d + i as u64;
            let completed = random_walks(schema, 150, 300, seed, |_| {});
            assert!(completed > 0, "{schema}: no walk completed");
        }
    }

    /// Unions whose branches start alike (Pydantic's `Union[Cat, Dog]`, a string enum beside a
    /// pattern, integer ranges) are followed down every branch; `allOf` of one schema (how
    /// Pydantic describes a reference) is that schema.
    #[test]
    fn unions_of_alike_branches_and_single_allof() {
        let pets = json!({
            "$defs": {
                "Cat": {"type": "object", "properties": {"kind": {"const": "cat"},
                        "lives": {"type": "integer", "minimum": 1, "maximum": 9}},
                        "required": ["kind", "lives"], "additionalProperties": false},
                "Dog": {"type": "object", "properties": {"kind": {"const": "dog"},
                        "good": {"type": "boolean"}},
                        "required": ["kind", "good"], "additionalProperties": false}
            },
            "type": "object",
            "properties": {
                "pet": {"oneOf": [{"$ref": "#/$defs/Cat"}, {"$ref": "#/$defs/Dog"}],
                        "discriminator": {"propertyName": "kind"}},
                "owner": {"allOf": [{"$ref": "#/$defs/Dog"}], "description": "the owner's dog"}
            },
            "required": ["pet"],
            "additionalProperties": false
        });
        assert_eq!(
            accepts(&pets, r#"{"pet": {"kind": "cat", "lives": 9}}"#),
            (true, true)
        );
        assert_eq!(
            accepts(&pets, r#"{"pet": {"kind": "dog", "good": true}}"#),
            (true, true)
        );
        assert!(!accepts(&pets, r#"{"pet": {"kind": "cat", "good""#).0);
        assert!(!accepts(&pets, r#"{"pet": {"kind": "cow""#).0);
        assert!(!accepts(&pets, r#"{"pet": {"kind": "cat", "lives": 10"#).0);
        assert_eq!(
            accepts(
                &pets,
                r#"{"pet": {"kind": "dog", "good": false}, "owner": {"kind": "dog", "good": true}}"#
            ),
            (true, true)
        );
        assert!(
            !accepts(
                &pets,
                r#"{"pet": {"kind": "dog", "good": false}, "owner": {"kind": "c"#
            )
            .0
        );
        let strings = json!({"type": "array", "maxItems": 3, "items": {"anyOf": [
            {"enum": ["x", "yy"]}, {"type": "string", "pattern": "^z+$", "maxLength": 2}]}});
        assert_eq!(accepts(&strings, r#"["x", "zz", "yy"]"#), (true, true));
        assert!(!accepts(&strings, r#"["zzz"#).0 && !accepts(&strings, r#"["y""#).0);
        let ranges = json!({"anyOf": [{"type": "integer", "minimum": 0, "maximum": 5},
                                       {"type": "integer", "minimum": 100, "maximum": 105}]});
        assert!(accepts(&ranges, "3").1 && accepts(&ranges, "104").1);
        assert!(
            !accepts(&ranges, "6").1 && !accepts(&ranges, "99").1 && !accepts(&ranges, "5 0").0
        );
        // multipleOf (whole steps): every prefix can still end on a multiple inside the
        // bounds; numbers are written as integers; no multiple inside the bounds is refused.
        let fives = json!({"type": "number", "multipleOf": 5, "minimum": 11, "maximum": 42});
        assert!(accepts(&fives, "15").1 && accepts(&fives, "40").1 && !accepts(&fives, "41").1);
        // "1" → 15, "2" → 20, 25, "3" → 30, 35, "4" → 40; "5" → nothing in 11..=42.
        for p in ["1", "2", "3", "4"] {
            assert!(accepts(&fives, p).0 && !accepts(&fives, p).1, "{p}");
        }
        assert!(!accepts(&fives, "15.").0 && !accepts(&fives, "5").0 && !accepts(&fives, "-").0);
        let e = Schema::compile(&json!({"type": "integer", "multipleOf": 7, "minimum": 8,
                                        "maximum": 13}))
        .unwrap_err();
        assert!(e.contains("no integer"), "{e}");
        // Fractional steps: at most the step's decimals, on a multiple, inside the bounds.
        let cents = json!({"type": "number", "multipleOf": 0.01, "minimum": 0, "maximum": 10});
        for good in ["0", "0.07", "9.99", "10", "3.1", "10.00"] {
            assert_eq!(accepts(&cents, good), (true, true), "{good}");
        }
        for bad in ["0.001", "10.01", "-0.01", "11", "1e"] {
            assert!(!accepts(&cents, bad).1, "{bad}");
        }
        let halves = json!({"multipleOf": 2.5, "exclusiveMinimum": -5, "maximum": 7});
        for good in ["-2.5", "0", "2.5", "5", "5.0", "7.5e0"] {
            let want = good != "7.5e0";
            assert_eq!(accepts(&halves, good).1, want, "{good}");
        }
        for bad in ["-5", "1", "2.6", "7.5", "2.55"] {
            assert!(!accepts(&halves, bad).1, "{bad}");
        }
        // "7" can only go on to 7.x (above 7) or 7x: no multiple of 2.5 inside the bounds.
        assert!(!accepts(&halves, "7").0);
        // Integers on a fractional step: the whole step it implies (0.4 → 2).
        let ints = json!({"type": "integer", "multipleOf": 0.4});
        assert!(accepts(&ints, "4").1 && !accepts(&ints, "3").1);
        // Enum values are held to the step from their digits.
        let e = json!({"enum": [0.3, 0.35, 1], "multipleOf": 0.1});
        assert!(accepts(&e, "0.3").1 && accepts(&e, "1").1 && !accepts(&e, "0.35").0);
        assert!(Schema::compile(&json!({"multipleOf": 1e-20}))
            .unwrap_err()
            .contains("multipleOf"));
        let completed = random_walks(&cents, 200, 40, 11, |v| {
            let t = v.to_string();
            let x = v.as_f64().unwrap();
            assert!((0.0..=10.0).contains(&x), "{t}");
            assert!(t.split('.').nth(1).is_none_or(|f| f.len() <= 2), "{t}");
        });
        assert!(completed > 20, "{completed}");
        let any_sign = json!({"type": "array", "items": {"type": "integer", "multipleOf": 3,
                              "minimum": -1_000_000, "maximum": 1_000_000}});
        assert!(accepts(&any_sign, "[-9, 0, 12]").1 && !accepts(&any_sign, "[-10]").1);
        for schema in [&fives, &any_sign] {
            let completed = random_walks(schema, 100, 60, 5, |v| {
                // (`-0` reads as a float.)
                let ns: Vec<f64> = match v {
                    Value::Array(a) => a.iter().map(|x| x.as_f64().unwrap()).collect(),
                    x => vec![x.as_f64().unwrap()],
                };
                for n in ns {
                    assert!(n % if v.is_array() { 3.0 } else { 5.0 } == 0.0, "{v}");
                }
            });
            assert!(completed > 0, "{schema}: no walk completed");
        }
        // More alike branches than a state follows at once: refused, not silently narrowed.
        let many: Vec<Value> = (0..33)
            .map(|i| json!({"type": "object", "properties": {format!("k{i}"): {"type": "null"}}}))
            .collect();
        let e = Schema::compile(&json!({"anyOf": many})).unwrap_err();
        assert!(
            e.contains("33 branches") && e.contains("start alike"),
            "{e}"
        );
        assert!(Schema::compile(&json!({"anyOf": many[..32]})).is_ok());
        for schema in [&pets, &strings, &ranges] {
            let completed = random_walks(schema, 100, 200, 11, |v| {
                if let Some(pet) = v.get("pet") {
                    let kind = pet["kind"].as_str().unwrap();
                    let keys: Vec<&str> = pet
                        .as_object()
                        .unwrap()
                        .keys()
                        .map(|k| k.as_str())
                        .collect();
                    match kind {
                        "cat" => assert!(keys.contains(&"lives") && !keys.contains(&"good"), "{v}"),
                        _ => assert!(keys.contains(&"good") && !keys.contains(&"lives"), "{v}"),
                    }
                }
                if let Some(n) = v.as_i64() {
                    assert!((0..=5).contains(&n) || (100..=105).contains(&n), "{v}");
                }
            });
            assert!(completed > 0, "{schema}: no walk completed");
        }
    }

    /// A second review's cases: lengths a pattern cannot reach between its fewest and most
    /// (a gap), long patterns, ECMA-262's ASCII classes, surrogate pairs counted once, raw
    /// bytes that must walk UTF-8 so that each character counts.
    #[test]
    fn pattern_lengths_classes_and_characters_count_exactly() {
        // Matches take 3 or 8 characters: with lengths 3..=7, "123" may not go on to "-".
        let phone = json!({"type": "string", "pattern": "^(\\d{3}|\\d{3}-\\d{4})$",
                           "minLength": 3, "maxLength": 7});
        assert_eq!(accepts(&phone, r#""123""#), (true, true));
        assert!(!accepts(&phone, r#""123-"#).0);
        let e = Schema::compile(
            &json!({"type": "string", "pattern": "^(\\d{3}|\\d{3}-\\d{4})$",
                                        "minLength": 5, "maxLength": 7}),
        )
        .unwrap_err();
        assert!(e.contains("matches no string"), "{e}");
        // Exactly 4 or 7 a's, between 2 and 6: only 4.
        let gaps = json!({"type": "string", "pattern": "^(a|aaaa|aaaaaaa)$", "minLength": 2,
                          "maxLength": 6});
        assert!(!accepts(&gaps, r#""a""#).0);
        assert_eq!(accepts(&gaps, r#""aaaa""#), (true, true));
        assert!(!accepts(&gaps, r#""aaaaa"#).0);
        for schema in [&phone, &gaps] {
            let completed = random_walks(schema, 60, 40, 7, |v| {
                let n = v.as_str().unwrap().chars().count();
                assert!((3..=7).contains(&n) || (2..=6).contains(&n), "{v}");
            });
            assert!(completed > 0);
        }
        // A long pattern compiles in linear time (the review's 19 000-state case), lengths too.
        let long = json!({"type": "string", "pattern": "^[ -~]{19000}$", "maxLength": 19000});
        let compiled = Schema::compile(&long).unwrap();
        let mut st = SchemaState::new(compiled);
        let refuses = |st: &SchemaState, b: u8| !st.clone().feed(b);
        assert!(st.feed(b'"') && st.feed_all(&[b'x'; 18999]) && refuses(&st, b'"'));
        assert!(st.feed(b'y') && refuses(&st, b'z') && st.feed(b'"') && st.is_complete());
        // ECMA-262: \d and \w are ASCII, `.` leaves out line terminators.
        let digits = json!({"type": "string", "pattern": "^\\d+$"});
        assert_eq!(accepts(&digits, r#""42""#), (true, true));
        assert!(!accepts(&digits, "\"\u{0663}").0);
        let word = json!({"type": "string", "pattern": "^\\w+$"});
        assert!(accepts(&word, r#""a_1""#).1 && !accepts(&word, "\"é").0);
        let dot = json!({"type": "string", "pattern": "^a.b$"});
        assert!(accepts(&dot, r#""a-b""#).1 && !accepts(&dot, r#""a\rb""#).0);
        assert!(
            accepts(
                &json!({"type": "string", "pattern": "^[\\d-]+$"}),
                r#""1-2""#
            )
            .1
        );
        // A surrogate pair is one character; a lone half is refused.
        let one = json!({"type": "string", "maxLength": 1});
        assert_eq!(accepts(&one, r#""\ud83d\ude00""#), (true, true));
        assert!(!accepts(&one, r#""\ud83d""#).0);
        assert!(!accepts(&one, r#""\udc00"#).0);
        assert!(!accepts(&one, r#""\ud83d\u00"#).0);
        assert!(!accepts(&one, r#""ab"#).0);
        // Raw bytes walk UTF-8: "é" is one character, a stray continuation byte none.
        let mut st = SchemaState::new(Schema::compile(&one).unwrap());
        assert!(st.feed(b'"') && st.feed_all("é".as_bytes()) && !st.feed(b'a'));
        let mut st = SchemaState::new(Schema::compile(&one).unwrap());
        assert!(st.feed(b'"') && refuses(&st, 0xA9) && st.feed(0xC3) && refuses(&st, b'"'));
        let two = json!({"type": "string", "minLength": 2});
        let mut st = SchemaState::new(Schema::compile(&two).unwrap());
        assert!(st.feed(b'"') && st.feed_all("é".as_bytes()) && !st.feed(b'"'));
    }

    /// The cases of a review: self-reference without a value, reference chains, escaped
    /// keys, schemas that leave no value, enums beside constraints, top-level numbers.
    #[test]
    fn references_escapes_and_empty_schemas_are_handled() {
        let refuse = |schema: Value, why: &str| {
            let e = Schema::compile(&schema).unwrap_err();
            assert!(e.contains(why), "{schema}: {e}");
        };
        refuse(
            json!({"$defs": {"A": {"anyOf": [{"$ref": "#/$defs/A"}]}}, "$ref": "#/$defs/A"}),
            "refers to itself",
        );
        refuse(
            json!({"$defs": {"A": {"$ref": "#/$defs/B"}, "B": {"$ref": "#/$defs/A"}},
                   "$ref": "#/$defs/A"}),
            "refers to itself",
        );
        refuse(json!({"type": []}), "type");
        refuse(
            json!({"type": "integer", "minimum": 0.5, "maximum": 0.7}),
            "no integer",
        );
        refuse(
            json!({"type": "string", "pattern": "^abc$", "maxLength": 2}),
            "matches no string",
        );
        refuse(
            json!({"properties": {"a".repeat(300): {"type": "null"}}}),
            "at most 256",
        );
        // Constraints beside a reference hold with it.
        let capped = json!({"$defs": {"A": {"type": "integer", "minimum": 0}}, "$ref": "#/$defs/A",
                            "maximum": 3});
        assert_eq!(accepts(&capped, "3"), (true, true));
        assert!(!accepts(&capped, "4").1 && !accepts(&capped, "-1").0);
        refuse(
            json!({"anyOf": [{"type": "string"}], "oneOf": [{"type": "null"}]}),
            "anyOf and oneOf",
        );
        refuse(
            json!({"oneOf": [{"type": "integer"}, {"type": "number"}]}),
            "oneOf",
        );
        refuse(
            json!({"enum": ["abc"], "maxLength": 2}),
            "no enum value meets",
        );
        // Two references to one union: compiled in time (each reference is followed once).
        let t = std::time::Instant::now();
        let _ = Schema::compile(&json!({"$defs": {"A": {"anyOf": [{"$ref": "#/$defs/A"},
            {"$ref": "#/$defs/A"}]}}, "$ref": "#/$defs/A"}));
        assert!(t.elapsed().as_secs() < 5);
        // A reference to a reference takes its schema.
        let chain = json!({"$defs": {
            "A": {"type": "object", "properties": {"b": {"$ref": "#/$defs/B"}},
                  "additionalProperties": false},
            "B": {"$ref": "#/$defs/A"}}, "$ref": "#/$defs/A"});
        assert!(!accepts(&chain, r#"{"b": 5"#).0);
        assert_eq!(accepts(&chain, r#"{"b": {"b": {}}}"#), (true, true));
        // `#` is the root (a recursive schema); pointers unescape `~1` and `~0`.
        let tree = json!({"type": "object", "properties": {"v": {"type": "integer"},
                          "kids": {"type": "array", "items": {"$ref": "#"}, "maxItems": 2}},
                          "required": ["v"], "additionalProperties": false});
        assert_eq!(
            accepts(&tree, r#"{"v": 1, "kids": [{"v": 2, "kids": []}]}"#),
            (true, true)
        );
        assert!(!accepts(&tree, r#"{"v": 1, "kids": [{"w"#).0);
        let slash = json!({"$defs": {"a/b": {"type": "null"}, "c~d": {"type": "boolean"}},
                           "type": "array", "prefixItems": [{"$ref": "#/$defs/a~1b"},
                           {"$ref": "#/$defs/c~0d"}], "items": false});
        assert_eq!(accepts(&slash, "[null, true]"), (true, true));
        assert!(!accepts(&slash, "[true").0);
        refuse(
            json!({"$ref": "#/$defs/a~1b"}),
            "does not point at a schema",
        );
        // Escaped keys are the properties they spell.
        let s = json!({"properties": {"a": {"type": "integer"}, "q\"x": {"type": "null"}},
                       "required": ["a"], "additionalProperties": false});
        assert_eq!(accepts(&s, r#"{"\u0061": 1}"#), (true, true));
        assert!(!accepts(&s, r#"{"\u0061": "x""#).0);
        assert!(!accepts(&s, r#"{"\u0062"#).0);
        assert_eq!(accepts(&s, r#"{"a": 1, "q\"x": null}"#), (true, true));
        assert!(!accepts(&s, r#"{"a": 1, "\u0061"#).0);
        // A pattern whose short branch would leave minLength unmet.
        let p = json!({"type": "string", "pattern": "^(a|bbb)$", "minLength": 2});
        assert!(!accepts(&p, r#""a"#).0);
        assert_eq!(accepts(&p, r#""bbb""#), (true, true));
        // Enum values that break the constraints are dropped; integers only where bounded.
        let e = json!({"enum": ["abc", "ab", 7, 2], "maxLength": 2, "maximum": 5});
        assert_eq!(accepts(&e, r#""ab""#), (true, true));
        assert!(!accepts(&e, r#""abc"#).0 && !accepts(&e, "7").0);
        // A top-level number is complete and can still go on.
        let mut n = SchemaState::new(Schema::compile(&json!({"type": "integer"})).unwrap());
        assert!(n.feed_all(b"4") && n.is_complete() && n.can_continue());
        assert!(n.feed_all(b"2 ") && n.is_complete() && !n.can_continue());
        // Tool arguments: objects only.
        assert!(Schema::compile(&json!({"type": "object"}))
            .unwrap()
            .takes_only_objects());
        assert!(!Schema::compile(&json!({})).unwrap().takes_only_objects());
    }

    #[test]
    fn keywords_that_cannot_be_enforced_are_named() {
        for (schema, word) in [
            (json!({"type": "string", "pattern": "(?=a)b"}), "pattern"),
            (
                json!({"type": "object", "properties": {"a": {"multipleOf": 1e-30}}}),
                "multipleOf",
            ),
            (json!({"minimum": 3, "maximum": 2}), "leave no number"),
            (json!({"minLength": 3, "maxLength": 2}), "minLength"),
            (json!({"not": {"pattern": "^a"}}), "`not` of"),
            (
                json!({"type": "string", "not": {"const": "a"}}),
                "`not` of values",
            ),
            (
                json!({"type": "number", "not": {"type": "integer"}}),
                "not an integer",
            ),
            (
                json!({"type": "null", "not": {"type": "null"}}),
                "leaves no type",
            ),
            (
                json!({"allOf": [{"pattern": "^a"}, {"pattern": "b$"}]}),
                "`pattern`",
            ),
            (
                json!({"allOf": [{"type": "string"}, {"type": "integer"}]}),
                "no value has both",
            ),
            (
                json!({"allOf": [{"anyOf": [{"type": "string"}]}, {"oneOf": [{"type": "null"}]}]}),
                "two anyOf/oneOf",
            ),
            (
                json!({"$defs": {"A": {"allOf": [{"$ref": "#/$defs/A"}, {"type": "object"}]}},
                       "$ref": "#/$defs/A"}),
                "allOf nests deeper",
            ),
            (
                json!({"type": "array", "prefixItems": [{}, {}], "items": false, "minItems": 3}),
                "prefixItems",
            ),
            (
                json!({"properties": {"a": {}}, "required": ["b"], "additionalProperties": false}),
                "\"b\" is not one of the schema's properties",
            ),
            (json!({"$ref": "#/$defs/missing"}), "$ref"),
            (json!({"type": "strings"}), "type"),
            // Values that exist only beyond what is written are said, not a type dropped.
            (
                json!({"type": ["integer", "null"], "minimum": 1e16}),
                "every integer inside the bounds is 10^15 or more",
            ),
            (
                json!({"type": "integer", "minimum": 1e16}),
                "every integer inside the bounds is 10^15 or more",
            ),
            (
                json!({"type": ["number", "null"], "maximum": -1e16}),
                "every number inside the bounds is 10^15 or more",
            ),
        ] {
            let e = Schema::compile(&schema).unwrap_err();
            assert!(e.contains(word), "{e}");
        }
    }

    /// Tuples: `prefixItems` (and draft 7's `items` list with `additionalItems`) hold each
    /// position to its schema; `items: false` closes the array after them.
    #[test]
    fn tuples_hold_each_position() {
        let pair = json!({"type": "array", "prefixItems": [{"type": "integer"},
            {"type": "string", "maxLength": 2}], "items": false});
        for good in ["[]", "[1]", r#"[1, "ab"]"#, r#"[ -3 ,"" ]"#] {
            assert_eq!(accepts(&pair, good), (true, true), "{good}");
        }
        for bad in [r#"["a""#, "[1, 2", r#"[1, "abc"#, r#"[1, "a","#, "[1.5"] {
            assert!(!accepts(&pair, bad).0, "{bad}");
        }
        let at_least = json!({"prefixItems": [{"type": "integer"}, {"type": "string"}],
            "minItems": 2, "items": {"type": "boolean"}});
        assert!(!accepts(&at_least, "[1]").0);
        assert_eq!(accepts(&at_least, r#"[1, "x", true, false]"#), (true, true));
        assert!(!accepts(&at_least, r#"[1, "x", 3"#).0);
        let draft7 = json!({"type": "array", "items": [{"const": "a"}, {"type": "null"}],
            "additionalItems": {"type": "integer"}});
        assert_eq!(accepts(&draft7, r#"["a", null, 1, 2]"#), (true, true));
        assert!(!accepts(&draft7, r#"["a", null, "b""#).0);
        assert!(!accepts(&draft7, r#"["b"#).0);
        assert_eq!(accepts(&json!({"items": false}), "[]"), (true, true));
        assert!(!accepts(&json!({"items": false}), "[1").0);
        // Random walks: every finished value has the tuple's shape.
        let shape = json!({"type": "array", "prefixItems": [{"type": "integer"},
            {"enum": ["x", "yy"]}, {"type": "array", "prefixItems": [{"type": "boolean"}]}],
            "items": {"type": "null"}, "maxItems": 5});
        let done = random_walks(&shape, 200, 200, 0x1234_5678_9abc_def1, |v| {
            let a = v.as_array().unwrap();
            assert!(a.len() <= 5);
            if let Some(x) = a.first() {
                // (serde reads `-0` as a float.)
                assert!(x.as_f64().is_some_and(|x| x.fract() == 0.0), "{v}");
            }
            if let Some(x) = a.get(1) {
                assert!(x == "x" || x == "yy", "{v}");
            }
            if let Some(x) = a.get(2) {
                assert!(
                    x.as_array().unwrap().first().is_none_or(Value::is_boolean),
                    "{v}"
                );
            }
            assert!(a.iter().skip(3).all(Value::is_null), "{v}");
        });
        assert!(done > 50, "{done}");
    }

    /// Cases a differential test against Python's `jsonschema` found (each once accepted an
    /// invalid text or left the writer with no byte to take).
    #[test]
    fn differential_findings_stay_fixed() {
        // allOf of a tuple and another member's items: position by position.
        let t = json!({"allOf": [{"prefixItems": [{"type": "number"}]},
                                 {"items": {"type": "integer", "minimum": 0}}]});
        assert_eq!(accepts(&t, "[3, 4]"), (true, true));
        assert!(!accepts(&t, "[1.5").0 && !accepts(&t, "[-1").0 && !accepts(&t, "[3, -1").0);
        let closed = json!({"allOf": [{"items": false}, {"prefixItems": [{"type": "integer"}]}]});
        assert_eq!(accepts(&closed, "[]"), (true, true));
        assert!(!accepts(&closed, "[1").0);
        let clash = json!({"$defs": {"T": {"type": "array", "prefixItems": [{"type": "string"}]}},
                           "$ref": "#/$defs/T", "items": {"type": "integer"}});
        assert!(Schema::compile(&clash).is_err() || !accepts(&clash, r#"["a"]"#).1);
        // Constraints beside a $ref whose target was compiled before.
        let again = json!({"$defs": {"t": {"type": "object"}}, "type": "object", "properties": {
            "x": {"$ref": "#/$defs/t"}, "y": {"$ref": "#/$defs/t", "maxProperties": 1}}});
        assert!(!accepts(&again, r#"{"y": {"a": 1, "b""#).0);
        let five = json!({"$defs": {"n": {"type": "integer"}}, "type": "array",
            "prefixItems": [{"$ref": "#/$defs/n"}, {"$ref": "#/$defs/n", "minimum": 5}]});
        assert!(!accepts(&five, "[1, 1]").1 && accepts(&five, "[1, 5]").1);
        // A repeated key is one property.
        let two = json!({"type": "object", "minProperties": 2});
        assert!(!accepts(&two, r#"{"a": 1, "a": 2}"#).1);
        assert_eq!(accepts(&two, r#"{"a": 1, "b": 2}"#), (true, true));
        // uniqueItems: 1 and 1.0 are one value.
        assert!(
            Schema::compile(&json!({"type": "array", "items": {"enum": [1, 1.0]},
            "uniqueItems": true, "minItems": 2}))
            .is_err()
        );
        let nums = json!({"items": {"enum": [1, 1.0, 2]}, "uniqueItems": true});
        assert!(!accepts(&nums, "[1, 1.0").0 && accepts(&nums, "[1.0, 2]").1);
        // Decimal prefixes read exactly: "0.2" cannot reach a minimum of 0.3.
        for (schema, stuck) in [
            (json!({"type": "number", "minimum": 0.3}), "0.2"),
            (json!({"type": "number", "exclusiveMinimum": 3.3}), "3.2"),
            (json!({"type": "number", "maximum": -0.3}), "-0.2"),
            (
                json!({"type": "number", "multipleOf": 0.1, "minimum": 0.25, "maximum": 0.3}),
                "0.2",
            ),
        ] {
            assert!(!accepts(&schema, stuck).0, "{schema}: {stuck}");
            let done = random_walks(&schema, 60, 30, 17, |_| {});
            assert!(done > 0, "{schema}");
        }
        assert_eq!(
            accepts(
                &json!({"multipleOf": 0.1, "minimum": 0.25, "maximum": 0.3}),
                "0.3"
            ),
            (true, true)
        );
        // No multiple of a decimal step inside the bounds: refused.
        let e = Schema::compile(&json!({"type": "number", "multipleOf": 0.5, "minimum": 0.1,
            "maximum": 0.4}))
        .unwrap_err();
        assert!(e.contains("no number"), "{e}");
    }

    /// `patternProperties`: a key matching patterns takes their schemas (with a listed
    /// property's own); a closed object takes only keys some pattern can still match.
    #[test]
    fn pattern_properties_hold_their_keys() {
        let counts = json!({"type": "object", "patternProperties": {"^n_": {"type": "integer"},
            "^[a-m].*_s$": {"type": "string"}}, "additionalProperties": false});
        assert_eq!(accepts(&counts, r#"{"n_a": 1, "b_s": "x"}"#), (true, true));
        assert!(!accepts(&counts, r#"{"n_a": "x""#).0);
        assert!(
            !accepts(&counts, r#"{"x"#).0,
            "no pattern can match a key starting x"
        );
        assert!(
            accepts(&counts, r#"{"by_"#).0,
            "the second pattern can still match"
        );
        assert!(
            !accepts(&counts, r#"{"by_": 1"#).0,
            "the key matched no pattern"
        );
        // Both patterns: both schemas (an integer that is a string: nothing; here a number
        // under both bounds).
        let both = json!({"patternProperties": {"^a": {"type": "number", "minimum": 0},
            "z$": {"maximum": 5}}, "additionalProperties": {"type": "null"}});
        assert_eq!(
            accepts(&both, r#"{"az": 5, "ab": 9, "q": null}"#),
            (true, true)
        );
        assert!(!accepts(&both, r#"{"az": 6"#).1 && !accepts(&both, r#"{"q": 1"#).0);
        // A listed property matching a pattern takes both schemas.
        let listed = json!({"properties": {"n_max": {"maximum": 3}},
            "patternProperties": {"^n_": {"type": "integer"}}});
        assert_eq!(accepts(&listed, r#"{"n_max": 3}"#), (true, true));
        assert!(!accepts(&listed, r#"{"n_max": 4"#).1 && !accepts(&listed, r#"{"n_max": 1."#).0);
        // Keys are matched as the text they spell.
        assert_eq!(accepts(&both, r#"{"\u0061": 1}"#), (true, true));
        assert!(
            Schema::compile(&json!({"patternProperties": {"(?=a)": {}}}))
                .unwrap_err()
                .contains("patternProperties")
        );
        // Patterns that meet in some key with schemas that cannot be merged: refused, naming
        // them; patterns that never meet may disagree.
        let e = Schema::compile(&json!({"patternProperties": {"^a": {"type": "integer"},
            "b$": {"type": "string"}}}))
        .unwrap_err();
        assert!(e.contains("^a") && e.contains("b$"), "{e}");
        let apart = json!({"patternProperties": {"^a": {"type": "integer"},
            "^b": {"type": "string"}}, "additionalProperties": false});
        assert_eq!(accepts(&apart, r#"{"ax": 1, "bx": "y"}"#), (true, true));
        assert!(!accepts(&apart, r#"{"ax": "y""#).0);
        let done = random_walks(&counts, 200, 150, 0xabcd_0000_1111_2222, |v| {
            for (k, x) in v.as_object().unwrap() {
                let (n, s) = (
                    k.starts_with("n_"),
                    k.ends_with("_s")
                        && k.as_bytes()[0].is_ascii_lowercase()
                        && k.as_bytes()[0] <= b'm',
                );
                assert!(n || s, "{v}");
                assert!(!n || x.as_f64().is_some_and(|f| f.fract() == 0.0), "{v}");
                assert!(!s || x.is_string(), "{v}");
            }
        });
        assert!(done > 20, "{done}");
    }

    /// `propertyNames`: every key meets it (listed properties that cannot are left out).
    #[test]
    fn property_names_hold_every_key() {
        let snake = json!({"type": "object", "propertyNames": {"pattern": "^[a-z_]+$",
            "maxLength": 4}, "properties": {"ok": {"type": "integer"}, "Bad": {}}});
        assert_eq!(accepts(&snake, r#"{"ok": 1, "ab_c": true}"#), (true, true));
        assert!(!accepts(&snake, r#"{"A"#).0 && !accepts(&snake, r#"{"B"#).0);
        assert!(!accepts(&snake, r#"{"abcde"#).0 && !accepts(&snake, r#"{"a-"#).0);
        let listed = json!({"propertyNames": {"enum": ["x", "y.z"]},
            "additionalProperties": {"type": "null"}});
        assert_eq!(
            accepts(&listed, r#"{"y.z": null, "x": null}"#),
            (true, true)
        );
        assert!(!accepts(&listed, r#"{"yaz"#).0 && !accepts(&listed, r#"{"x2"#).0);
        assert!(!accepts(&listed, r#"{"y": null"#).0);
        let short = json!({"propertyNames": {"minLength": 2}});
        assert!(!accepts(&short, r#"{"a": 1"#).0 && accepts(&short, r#"{"ab": 1}"#).1);
        assert!(
            Schema::compile(&json!({"propertyNames": {"pattern": "^a"}, "required": ["b"]}))
                .unwrap_err()
                .contains("propertyNames")
        );
        let done = random_walks(&snake, 200, 120, 0x5151_0000_2222_3333, |v| {
            for k in v.as_object().unwrap().keys() {
                assert!(
                    k.len() <= 4 && k.bytes().all(|c| c.is_ascii_lowercase() || c == b'_'),
                    "{v}"
                );
            }
        });
        assert!(done > 20, "{done}");
    }

    /// `not` of a type takes that type away; `not` of values takes them out of an enum, or out
    /// of booleans and null.
    #[test]
    fn negations_of_types_and_values() {
        let not_null = json!({"not": {"type": "null"}});
        assert_eq!(accepts(&not_null, r#"{"a": null}"#), (true, true));
        assert!(!accepts(&not_null, "n").0);
        let e = json!({"enum": ["a", "b", 1, 2.0], "not": {"enum": ["b", 2]}});
        assert_eq!(accepts(&e, r#""a""#), (true, true));
        assert!(!accepts(&e, r#""b"#).0 && !accepts(&e, "2.0").1);
        assert_eq!(accepts(&e, "1"), (true, true));
        let t = json!({"type": ["boolean", "null"], "not": {"const": false}});
        assert!(accepts(&t, "true").1 && accepts(&t, "null").1 && !accepts(&t, "f").0);
        assert_eq!(accepts(&json!({"not": false}), "3"), (true, true));
    }

    /// Enum and const numbers beyond the digits written under bounds are taken as they are,
    /// compared with the bounds as doubles.
    #[test]
    fn big_enum_values_meet_their_bounds() {
        let c = json!({"type": "integer", "const": 10000000000000000u64, "minimum": 1});
        assert_eq!(accepts(&c, "10000000000000000"), (true, true));
        let e = json!({"enum": [1e16, "x"], "minimum": 1e16});
        assert_eq!(accepts(&e, r#""x""#), (true, true));
        let e = json!({"type": "integer", "enum": [10000000000000000u64, 5], "minimum": 6});
        assert_eq!(accepts(&e, "10000000000000000"), (true, true));
        assert!(!accepts(&e, "5").0);
    }

    /// An object schema that lists its properties and says nothing of others takes only those
    /// (a Pydantic model's schema, as vLLM's xgrammar and OpenAI read it); one that says
    /// `additionalProperties: true`, or has no `properties`, or requires an unlisted key, stays
    /// open.
    #[test]
    fn listed_properties_close_an_object_by_default() {
        let person = json!({"type": "object", "properties": {"name": {"type": "string"},
                            "age": {"type": "integer"}}, "required": ["name", "age"],
                            "title": "Person"});
        assert!(!accepts(&person, r#"{"x"#).0);
        assert_eq!(accepts(&person, r#"{"name": "a", "age": 3}"#), (true, true));
        assert!(!accepts(&person, r#"{"name": "a", "age": 3, "z"#).0);
        let mut open = person.clone();
        open["additionalProperties"] = true.into();
        assert_eq!(
            accepts(&open, r#"{"x": 1, "name": "a", "age": 3}"#),
            (true, true)
        );
        let any = json!({"type": "object"});
        assert_eq!(accepts(&any, r#"{"x": 1}"#), (true, true));
        let unlisted = json!({"properties": {"a": {}}, "required": ["b"]});
        assert_eq!(accepts(&unlisted, r#"{"b": 1}"#), (true, true));
        // An empty listing (a model without fields, a function of no arguments) takes `{}`.
        let none = json!({"type": "object", "properties": {}});
        assert_eq!(accepts(&none, "{}"), (true, true));
        assert!(!accepts(&none, r#"{""#).0);
    }

    /// `minProperties`/`maxProperties` count every key; once only the required keys not yet
    /// written fit under the maximum, only those can be started.
    #[test]
    fn property_counts_are_held() {
        let some = json!({"type": "object", "minProperties": 1});
        assert!(!accepts(&some, "{}").1);
        assert_eq!(accepts(&some, r#"{"a": 1}"#), (true, true));
        let two = json!({"maxProperties": 2, "additionalProperties": {"type": "integer"}});
        assert_eq!(accepts(&two, r#"{"a": 1, "b": 2}"#), (true, true));
        assert!(!accepts(&two, r#"{"a": 1, "b": 2,"#).0);
        let id = json!({"properties": {"id": {"type": "integer"}, "tag": {}}, "required": ["id"],
                        "maxProperties": 2, "additionalProperties": true});
        assert_eq!(accepts(&id, r#"{"x": 1, "id": 2}"#), (true, true));
        assert!(accepts(&id, r#"{"x": 1, "i"#).0);
        assert!(!accepts(&id, r#"{"x": 1, "y"#).0);
        assert!(!accepts(&id, r#"{"x": 1, "t"#).0);
        assert_eq!(accepts(&id, r#"{"tag": 1, "id": 2}"#), (true, true));
        let refuse = |schema: Value, why: &str| {
            let e = Schema::compile(&schema).unwrap_err();
            assert!(e.contains(why), "{schema}: {e}");
        };
        refuse(
            json!({"properties": {"a": {}}, "additionalProperties": false, "minProperties": 2}),
            "closed object",
        );
        refuse(
            json!({"properties": {"a": {}, "b": {}}, "required": ["a", "b"], "maxProperties": 1}),
            "leaves no object",
        );
        let bounded = json!({"type": "object", "properties": {"k": {"type": "boolean"}},
            "required": ["k"], "additionalProperties": {"type": "null"}, "minProperties": 2,
            "maxProperties": 3});
        let done = random_walks(&bounded, 200, 120, 0xfeed_beef_0000_0003, |v| {
            let o = v.as_object().unwrap();
            assert!(o.len() <= 3 && o["k"].is_boolean(), "{v}");
        });
        assert!(done > 20, "{done}");
    }

    /// `uniqueItems`: an enum value, boolean or null is not offered again once written; a
    /// string item that repeats one (escapes read) cannot close, and the writer goes on.
    #[test]
    fn unique_items_are_not_repeated() {
        let set = json!({"type": "array", "items": {"enum": ["a", "b", "c", 1, 12]},
            "uniqueItems": true});
        assert_eq!(accepts(&set, r#"["a", 1, "b", 12]"#), (true, true));
        assert!(!accepts(&set, r#"["a", "a"#).0);
        assert!(!accepts(&set, r#"[1, 1]"#).0);
        assert!(accepts(&set, r#"[1, 12"#).0);
        assert!(!accepts(&set, r#"["a", "b", "c", 1, 12,"#).0);
        assert_eq!(accepts(&set, r#"["a", "b", "c", 1, 12]"#), (true, true));
        let flags = json!({"items": {"type": ["boolean", "null"]}, "uniqueItems": true});
        assert_eq!(accepts(&flags, "[true, null, false]"), (true, true));
        assert!(!accepts(&flags, "[true, t").0 && !accepts(&flags, "[null, n").0);
        assert!(!accepts(&flags, "[true, false, null,").0);
        let words = json!({"type": "array", "items": {"type": "string", "minLength": 1},
            "uniqueItems": true});
        assert_eq!(accepts(&words, r#"["x", "xy", "y"]"#), (true, true));
        assert!(!accepts(&words, r#"["x", "x""#).0);
        assert!(!accepts(&words, r#"["x", "\u0078""#).0);
        assert!(accepts(&words, r#"["x", "x\n"#).0);
        // A string item under uniqueItems is checked byte by byte.
        let mut st = SchemaState::new(Schema::compile(&words).unwrap());
        assert!(st.feed_all(br#"["a"#) && !st.in_plain_string());
        // Nested arrays each keep their own items; `false` is no constraint.
        let nested = json!({"type": "array", "items": {"type": "array",
            "items": {"type": "boolean"}, "uniqueItems": true}});
        assert_eq!(accepts(&nested, "[[true, false], [true]]"), (true, true));
        let not_unique = json!({"items": {"type": "integer"}, "uniqueItems": false});
        assert_eq!(accepts(&not_unique, "[1, 1]"), (true, true));
        // Random walks never repeat an item and never get stuck.
        for schema in [&set, &flags, &words] {
            let done = random_walks(schema, 150, 120, 0x5eed_0000_0000_0007, |v| {
                let a = v.as_array().unwrap();
                for (i, x) in a.iter().enumerate() {
                    assert!(!a[..i].contains(x), "{v}");
                }
            });
            assert!(done > 20, "{schema}: {done}");
        }
        let refuse = |schema: Value, why: &str| {
            let e = Schema::compile(&schema).unwrap_err();
            assert!(e.contains(why), "{schema}: {e}");
        };
        refuse(
            json!({"items": {"type": "integer"}, "uniqueItems": true}),
            "uniqueItems over numbers",
        );
        refuse(
            json!({"type": "array", "uniqueItems": true}),
            "uniqueItems over items of any",
        );
        refuse(
            json!({"items": {"type": "string", "maxLength": 3}, "uniqueItems": true}),
            "maxLength",
        );
        refuse(
            json!({"items": {"enum": ["a", "b"]}, "uniqueItems": true, "minItems": 3}),
            "only 2 values",
        );
        refuse(
            json!({"items": {"enum": [1]}, "uniqueItems": "yes"}),
            "not a boolean",
        );
    }

    /// `allOf` of several schemas (and constraints beside it) is their intersection: objects
    /// extended through `$ref`, bounds tightened, enums and types intersected, a closed member
    /// holding the others' properties to its rule, a union meeting the other members.
    #[test]
    fn all_of_is_the_intersection() {
        let extended = json!({
            "$defs": {"Base": {"type": "object", "properties": {"a": {"type": "string"}},
                               "required": ["a"]}},
            "allOf": [{"$ref": "#/$defs/Base"},
                      {"properties": {"b": {"type": "integer"}}, "required": ["b"]}],
            "description": "a Base with b"
        });
        assert_eq!(accepts(&extended, r#"{"a": "x", "b": 1}"#), (true, true));
        // (Its listed properties only: the merged schema lists them and says nothing else.)
        assert!(!accepts(&extended, r#"{"b": 1, "a": "x", "c""#).0);
        assert!(!accepts(&extended, r#"{"a": "x"}"#).1);
        assert!(!accepts(&extended, r#"{"b": 1}"#).1);
        assert!(!accepts(&extended, r#"{"a": 1"#).0);
        // A closed member: the other member's property cannot be written.
        let closed = json!({"allOf": [
            {"properties": {"a": {"type": "string"}}, "additionalProperties": false},
            {"properties": {"b": {"type": "integer"}, "a": {"maxLength": 1}}}]});
        assert_eq!(accepts(&closed, r#"{"a": "x"}"#), (true, true));
        assert!(!accepts(&closed, r#"{"b""#).0);
        assert!(!accepts(&closed, r#"{"a": "xy"#).0);
        // additionalProperties as a schema holds the other member's extra property.
        let typed = json!({"allOf": [
            {"properties": {"a": {}}, "additionalProperties": {"type": "integer"}},
            {"properties": {"b": {}}}]});
        assert_eq!(accepts(&typed, r#"{"a": "s", "b": 2}"#), (true, true));
        assert!(!accepts(&typed, r#"{"b": "s""#).0);
        // Numbers: bounds tighten, integer wins over number, steps combine (6 = lcm(2, 3)).
        let n = json!({"allOf": [{"type": "number", "minimum": 0, "multipleOf": 2},
            {"type": "integer", "maximum": 20}, {"multipleOf": 3}, {"exclusiveMaximum": 18}]});
        for good in ["0", "6", "12"] {
            assert_eq!(accepts(&n, good), (true, true), "{good}");
        }
        for bad in ["4", "18", "-6", "3", "1.5"] {
            assert!(!accepts(&n, bad).1, "{bad}");
        }
        // Enums intersect; a const must be in the other member's enum.
        let e = json!({"allOf": [{"enum": ["a", "b", "c"]}, {"enum": ["c", "b", "z"]}]});
        assert_eq!(accepts(&e, r#""b""#), (true, true));
        assert!(!accepts(&e, r#""a"#).0);
        let c = json!({"allOf": [{"enum": ["a", "b"]}, {"const": "b"}]});
        assert_eq!(accepts(&c, r#""b""#), (true, true));
        assert!(!accepts(&c, r#""a"#).0);
        // A union on one side: each branch meets the rest; a branch that cannot is left out.
        let u = json!({"allOf": [{"anyOf": [{"type": "string"}, {"type": "integer"}]},
            {"type": "integer", "minimum": 5}]});
        assert_eq!(accepts(&u, "7"), (true, true));
        assert!(!accepts(&u, "3").1 && !accepts(&u, r#""s"#).0);
        // Siblings of allOf are members too; allOf nested in a member is merged.
        let s = json!({"type": "string", "maxLength": 3,
            "allOf": [{"allOf": [{"minLength": 2}, {"pattern": "^a"}]}]});
        assert_eq!(accepts(&s, r#""ab""#), (true, true));
        assert!(!accepts(&s, r#""a""#).0 && !accepts(&s, r#""abcd"#).0 && !accepts(&s, r#""b"#).0);
        // A required name without a listed property: any value (or additionalProperties').
        let r = json!({"type": "object", "required": ["id"],
            "additionalProperties": {"type": "integer"}});
        assert_eq!(accepts(&r, r#"{"id": 3}"#), (true, true));
        assert!(!accepts(&r, "{}").1 && !accepts(&r, r#"{"id": "x"#).0);
        // Random walks over a merged closed object: both required properties, both members'
        // constraints, nothing else.
        let merged = json!({"allOf": [
            {"properties": {"a": {"type": "string"}, "b": {"type": "integer"}}, "required": ["a"]},
            {"properties": {"a": {"maxLength": 3}, "b": {"minimum": 0}}, "required": ["b"],
             "additionalProperties": false}]});
        let done = random_walks(&merged, 150, 300, 0x0bad_cafe_f00d_0001, |v| {
            let o = v.as_object().unwrap();
            assert_eq!(o.len(), 2, "{v}");
            assert!(v["a"].as_str().unwrap().chars().count() <= 3, "{v}");
            assert!(v["b"].as_f64().unwrap() >= 0.0, "{v}");
        });
        assert!(done > 20, "{done}");
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
