//! JSON mode (OpenAI's `response_format: {"type": "json_object"}`): an incremental recognizer
//! of one JSON object, byte by byte, so the engine can mask every token whose bytes would take
//! the answer out of the JSON grammar (RFC 8259) before it samples.
//!
//! [`JsonState::feed`] takes the next byte and says whether the text so far can still be the
//! start of one JSON object (optionally preceded and followed by a little whitespace);
//! [`JsonState::is_complete`] says whether it is one already. Runs of whitespace are capped at
//! [`MAX_WHITESPACE`] bytes inside the object and [`MAX_EDGE_WHITESPACE`] around it, and nesting
//! at [`MAX_DEPTH`], so a model cannot pad forever nor a request nest without bound. Bytes of 0x80 and
//! above are accepted inside strings where they walk UTF-8 (RFC 3629's well-formed sequences:
//! no lone continuation byte, overlong form or surrogate; tokens hold whole or partial
//! characters), as RFC 8259 §8.1 wants JSON text.

/// The longest run of whitespace between tokens of the grammar (room for pretty-printed
/// indentation; a run always ends at the next token, so the padding is bounded).
pub const MAX_WHITESPACE: usize = 64;

/// The longest run of whitespace before the object and after it.
pub const MAX_EDGE_WHITESPACE: usize = 2;

/// The deepest nesting of objects and arrays (serde_json's own parsing limit).
pub const MAX_DEPTH: usize = 128;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Container {
    /// Inside `{`: what comes next.
    Object(ObjNext),
    /// Inside `[`: what comes next.
    Array(ArrNext),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ObjNext {
    KeyOrEnd,
    Key,
    Colon,
    Value,
    CommaOrEnd,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ArrNext {
    ValueOrEnd,
    Value,
    CommaOrEnd,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Num {
    Minus,
    Zero,
    Int,
    Dot,
    Frac,
    E,
    ESign,
    Exp,
}

impl Num {
    /// The number may end here.
    pub(crate) fn complete(self) -> bool {
        matches!(self, Num::Zero | Num::Int | Num::Frac | Num::Exp)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Scalar {
    None,
    /// In a string, where its escapes stand.
    Str(StrLex),
    Num(Num),
    /// The rest of `true`, `false` or `null`.
    Lit(&'static [u8]),
}

/// Where a JSON object's text stands (module docs).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct JsonState {
    stack: Vec<Container>,
    scalar: Scalar,
    /// The top-level object has opened.
    started: bool,
    /// Whitespace bytes in the current run.
    spaces: usize,
}

impl Default for JsonState {
    fn default() -> Self {
        Self::new()
    }
}

impl JsonState {
    pub fn new() -> JsonState {
        JsonState {
            stack: Vec::new(),
            scalar: Scalar::None,
            started: false,
            spaces: 0,
        }
    }

    /// Inside a string, outside an escape: where any byte but `"`, `\` and control bytes is
    /// accepted without changing the state (JSON mode's fast path for such tokens).
    pub fn in_plain_string(&self) -> bool {
        self.scalar == Scalar::Str(StrLex::default())
    }

    /// One JSON object has been written (only whitespace may follow).
    pub fn is_complete(&self) -> bool {
        self.started && self.stack.is_empty() && self.scalar == Scalar::None
    }

    /// Feeds every byte; false (the state then undefined) as soon as one does not fit.
    pub fn feed_all(&mut self, bytes: &[u8]) -> bool {
        bytes.iter().all(|&b| self.feed(b))
    }

    /// The next byte; false if the text can no longer be one JSON object.
    pub fn feed(&mut self, b: u8) -> bool {
        match self.scalar {
            Scalar::Str(lex) => return self.string_byte(b, lex),
            Scalar::Lit(rest) => {
                if rest.first() != Some(&b) {
                    return false;
                }
                self.scalar = if rest.len() == 1 {
                    Scalar::None
                } else {
                    Scalar::Lit(&rest[1..])
                };
                if self.scalar == Scalar::None {
                    self.value_done();
                }
                return true;
            }
            Scalar::Num(n) => {
                if let Some(next) = number_byte(n, b) {
                    self.scalar = Scalar::Num(next);
                    return true;
                }
                if !n.complete() {
                    return false;
                }
                // The number ended; the byte belongs to what follows it.
                self.scalar = Scalar::None;
                self.value_done();
            }
            Scalar::None => {}
        }
        if matches!(b, b' ' | b'\t' | b'\n' | b'\r') {
            self.spaces += 1;
            // Before the object or after it no indentation is needed: a line break at most.
            let cap = if self.started && !self.stack.is_empty() {
                MAX_WHITESPACE
            } else {
                MAX_EDGE_WHITESPACE
            };
            return self.spaces <= cap;
        }
        self.spaces = 0;
        if !self.started {
            if b != b'{' {
                return false;
            }
            self.started = true;
            self.stack.push(Container::Object(ObjNext::KeyOrEnd));
            return true;
        }
        let Some(top) = self.stack.last().copied() else {
            // The object is complete: nothing but whitespace.
            return false;
        };
        match top {
            Container::Object(next) => match (next, b) {
                (ObjNext::KeyOrEnd, b'}') | (ObjNext::CommaOrEnd, b'}') => {
                    self.stack.pop();
                    self.value_done();
                    true
                }
                (ObjNext::KeyOrEnd | ObjNext::Key, b'"') => {
                    self.set_top(Container::Object(ObjNext::Colon));
                    self.scalar = Scalar::Str(StrLex::default());
                    true
                }
                (ObjNext::Colon, b':') => {
                    self.set_top(Container::Object(ObjNext::Value));
                    true
                }
                (ObjNext::CommaOrEnd, b',') => {
                    self.set_top(Container::Object(ObjNext::Key));
                    true
                }
                (ObjNext::Value, _) => {
                    self.set_top(Container::Object(ObjNext::CommaOrEnd));
                    self.start_value(b)
                }
                _ => false,
            },
            Container::Array(next) => match (next, b) {
                (ArrNext::ValueOrEnd | ArrNext::CommaOrEnd, b']') => {
                    self.stack.pop();
                    self.value_done();
                    true
                }
                (ArrNext::CommaOrEnd, b',') => {
                    self.set_top(Container::Array(ArrNext::Value));
                    true
                }
                (ArrNext::ValueOrEnd | ArrNext::Value, _) => {
                    self.set_top(Container::Array(ArrNext::CommaOrEnd));
                    self.start_value(b)
                }
                _ => false,
            },
        }
    }

    fn set_top(&mut self, c: Container) {
        if let Some(top) = self.stack.last_mut() {
            *top = c;
        }
    }

    /// A value begins with `b` (its container already expects what follows it).
    fn start_value(&mut self, b: u8) -> bool {
        if matches!(b, b'{' | b'[') && self.stack.len() >= MAX_DEPTH {
            return false;
        }
        match b {
            b'{' => self.stack.push(Container::Object(ObjNext::KeyOrEnd)),
            b'[' => self.stack.push(Container::Array(ArrNext::ValueOrEnd)),
            b'"' => self.scalar = Scalar::Str(StrLex::default()),
            b'-' => self.scalar = Scalar::Num(Num::Minus),
            b'0' => self.scalar = Scalar::Num(Num::Zero),
            b'1'..=b'9' => self.scalar = Scalar::Num(Num::Int),
            b't' => self.scalar = Scalar::Lit(b"rue"),
            b'f' => self.scalar = Scalar::Lit(b"alse"),
            b'n' => self.scalar = Scalar::Lit(b"ull"),
            _ => return false,
        }
        true
    }

    /// A value (or key) just ended: nothing to do, as its container moved on when it began;
    /// kept as the one place that would track values (e.g. for a schema).
    fn value_done(&mut self) {}

    fn string_byte(&mut self, b: u8, lex: StrLex) -> bool {
        match string_byte(b, lex) {
            Some(Some(lex)) => self.scalar = Scalar::Str(lex),
            Some(None) => {
                self.scalar = Scalar::None;
                self.value_done();
            }
            None => return false,
        }
        true
    }
}

/// Where a string's bytes stand in its escapes: `escape` after a backslash, `hex` digits of a
/// `\u` escape still due (`code` the digits so far), `high` while a high surrogate's `\u` escape
/// awaits its low half. RFC 8259 §7 writes a character beyond the BMP as a pair of `\u`
/// escapes; a lone half is no character (serde_json refuses it), so a lone half is refused and
/// a high half must be followed by a low one. `utf8`: continuation bytes of a raw multi-byte
/// character still due, the next one in `next` (RFC 3629's table).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct StrLex {
    pub escape: bool,
    pub hex: u8,
    code: u16,
    pub high: bool,
    utf8: u8,
    next: (u8, u8),
}

impl StrLex {
    /// Outside any escape, with no pair half pending.
    pub(crate) fn plain(self) -> bool {
        self == StrLex::default()
    }
}

/// A string's next state after `b`: `Some(Some(lex))` inside it, `Some(None)` when `b` closes
/// it, None when `b` cannot be in it (nor a `\u` digit that leaves no code point to finish).
pub(crate) fn string_byte(b: u8, s: StrLex) -> Option<Option<StrLex>> {
    if s.utf8 > 0 {
        if !(s.next.0..=s.next.1).contains(&b) {
            return None;
        }
        return Some(Some(match s.utf8 - 1 {
            0 => StrLex::default(),
            due => StrLex {
                utf8: due,
                next: (0x80, 0xbf),
                ..StrLex::default()
            },
        }));
    }
    if s.hex > 0 {
        let code = (s.code << 4) | (b as char).to_digit(16)? as u16;
        let hex = s.hex - 1;
        // The codes this escape can still end as must hold one that fits.
        let lo = (code as u32) << (4 * hex as u32);
        let hi = lo + (1u32 << (4 * hex as u32)) - 1;
        let low_half = |c: u32| (0xDC00..=0xDFFF).contains(&c);
        let fits = if s.high {
            lo <= 0xDFFF && hi >= 0xDC00
        } else {
            !(low_half(lo) && low_half(hi))
        };
        if !fits {
            return None;
        }
        if hex > 0 {
            return Some(Some(StrLex { code, hex, ..s }));
        }
        let high = !s.high && (0xD800..=0xDBFF).contains(&code);
        return Some(Some(StrLex {
            high,
            ..StrLex::default()
        }));
    }
    if s.escape {
        return match b {
            b'u' => Some(Some(StrLex {
                hex: 4,
                high: s.high,
                ..StrLex::default()
            })),
            _ if s.high => None,
            b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't' => Some(Some(StrLex::default())),
            _ => None,
        };
    }
    match b {
        b'\\' => Some(Some(StrLex {
            escape: true,
            high: s.high,
            ..StrLex::default()
        })),
        _ if s.high => None,
        b'"' => Some(None),
        0..=0x1f => None,
        0x20..=0x7f => Some(Some(StrLex::default())),
        // A multi-byte character's lead byte: the continuation bytes due, the first one's
        // range (no overlong forms, surrogates or code points past U+10FFFF).
        _ => {
            let (utf8, next) = match b {
                0xc2..=0xdf => (1, (0x80, 0xbf)),
                0xe0 => (2, (0xa0, 0xbf)),
                0xe1..=0xec | 0xee..=0xef => (2, (0x80, 0xbf)),
                0xed => (2, (0x80, 0x9f)),
                0xf0 => (3, (0x90, 0xbf)),
                0xf1..=0xf3 => (3, (0x80, 0xbf)),
                0xf4 => (3, (0x80, 0x8f)),
                _ => return None,
            };
            Some(Some(StrLex {
                utf8,
                next,
                ..StrLex::default()
            }))
        }
    }
}

/// The number's next phase after `b`, or None if `b` does not continue it.
pub(crate) fn number_byte(n: Num, b: u8) -> Option<Num> {
    Some(match (n, b) {
        (Num::Minus, b'0') => Num::Zero,
        (Num::Minus, b'1'..=b'9') => Num::Int,
        (Num::Int, b'0'..=b'9') => Num::Int,
        (Num::Zero | Num::Int, b'.') => Num::Dot,
        (Num::Dot | Num::Frac, b'0'..=b'9') => Num::Frac,
        (Num::Zero | Num::Int | Num::Frac, b'e' | b'E') => Num::E,
        (Num::E, b'+' | b'-') => Num::ESign,
        (Num::E | Num::ESign | Num::Exp, b'0'..=b'9') => Num::Exp,
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn accepts(text: &str) -> (bool, bool) {
        let mut s = JsonState::new();
        let ok = s.feed_all(text.as_bytes());
        (ok, ok && s.is_complete())
    }

    #[test]
    fn objects_are_recognised_and_everything_else_refused() {
        for good in [
            "{}",
            " {\"a\": 1}",
            "{\"a\":[1,2.5,-3e+2,true,false,null,{\"b\":\"x\\n\\u00e9\"}],\"c\":{}}\n",
            "{\"é\": \"中文\", \"n\": -0.0E-1}",
            "{\"a\": [ ], \"b\" : [[]]}",
            "{\n    \"a\": {\n        \"b\": [\n            1\n        ]\n    }\n}",
        ] {
            assert_eq!(accepts(good), (true, true), "{good}");
        }
        for prefix in [
            "{\"a\": [1, 2",
            "{\"a\": tr",
            "{\"a\": 1",
            "{\"a\": \"x\\u00",
        ] {
            assert_eq!(accepts(prefix), (true, false), "{prefix}");
        }
        for bad in [
            "[1]",
            "x",
            "{a: 1}",
            "{\"a\" 1}",
            "{\"a\": 01}",
            "{\"a\": 1.}",
            "{\"a\": tru }",
            "{\"a\": 1,}",
            "{\"a\": [1,]}",
            "{} {}",
            "{\"a\": \"\u{1}\"}",
            "{\"a\": \"\\x\"}",
        ] {
            assert!(!accepts(bad).0, "{bad}");
        }
        // Whitespace runs and nesting are bounded.
        let pad = format!("{{\"a\":{}1}}", " ".repeat(MAX_WHITESPACE + 1));
        assert!(!accepts(&pad).0);
        let deep = format!("{{\"a\":{}", "[".repeat(MAX_DEPTH));
        assert!(!accepts(&deep).0);
        let ok = format!("{{\"a\":{}", "[".repeat(MAX_DEPTH - 1));
        assert!(accepts(&ok).0);
        // A plain string takes any character but a quote, a backslash or a control byte.
        let mut s = JsonState::new();
        assert!(s.feed_all(b"{\"k\": \"ab") && s.in_plain_string());
        assert!(s.feed_all("é中\u{7f}".as_bytes()) && s.in_plain_string());
        // Within a character it is not plain (a quote cannot come there), after it it is.
        assert!(s.feed(0xe4) && !s.in_plain_string());
        assert!(!s.clone().feed(b'"'));
        assert!(s.feed_all(&[0xb8, 0xad]) && s.in_plain_string());
        assert!(s.feed(b'\\') && !s.in_plain_string());
        // Raw bytes must be well-formed UTF-8 (RFC 8259 §8.1): every valid character's bytes
        // are taken; a lone continuation byte, an overlong form, a surrogate, a code point past
        // U+10FFFF or a character cut by the closing quote are not.
        for c in [
            '\u{80}',
            '\u{7ff}',
            '\u{800}',
            '\u{d7ff}',
            '\u{e000}',
            '\u{ffff}',
            '\u{10000}',
            '\u{10ffff}',
        ] {
            assert_eq!(
                accepts(&format!("{{\"k\": \"{c}\"}}")),
                (true, true),
                "{c:?}"
            );
        }
        for bad in [
            &[0x8b][..],
            &[0xc0, 0x80],
            &[0xc1, 0xbf],
            &[0xe0, 0x80, 0x80],
            &[0xed, 0xa0, 0x80],
            &[0xf0, 0x80, 0x80, 0x80],
            &[0xf4, 0x90, 0x80, 0x80],
            &[0xf5, 0x80, 0x80, 0x80],
            &[0xe4, 0xb8, b'"'],
        ] {
            let mut s = JsonState::new();
            assert!(s.feed_all(b"{\"k\": \""));
            assert!(!s.feed_all(bad), "{bad:x?}");
        }
        // Surrogate pairs: whole pairs only (serde_json refuses a lone half).
        assert_eq!(accepts(r#"{"k": "\ud83d\ude00"}"#), (true, true));
        assert!(!accepts(r#"{"k": "\ud83d"}"#).0);
        assert!(!accepts(r#"{"k": "\ud83dx"#).0);
        assert!(!accepts(r#"{"k": "\udc00"#).0);
        assert!(!accepts(r#"{"k": "\ud83d\u00"#).0);
        assert!(!accepts(r#"{"k": "\udc"#).0);
        assert!(accepts(r#"{"k": "\ud"#).0);
    }

    /// Whatever serde_json writes as an object is accepted whole, and every prefix of it is
    /// accepted as a prefix.
    #[test]
    fn serde_json_objects_and_their_prefixes_are_accepted() {
        let values = prop::collection::vec(
            prop_oneof![
                any::<i64>().prop_map(serde_json::Value::from),
                any::<f64>()
                    .prop_filter("finite", |x| x.is_finite())
                    .prop_map(serde_json::Value::from),
                ".*".prop_map(serde_json::Value::from),
                any::<bool>().prop_map(serde_json::Value::from),
                Just(serde_json::Value::Null),
            ],
            0..6,
        );
        proptest!(|(keys in prop::collection::vec(".*", 0..6), vals in values, pretty in any::<bool>())| {
            let mut o = serde_json::Map::new();
            for (k, v) in keys.into_iter().zip(vals) {
                o.insert(k, serde_json::json!([v.clone(), {"x": v}]));
            }
            let v = serde_json::Value::Object(o);
            let text = if pretty { serde_json::to_string_pretty(&v).unwrap() } else { v.to_string() };
            let mut s = JsonState::new();
            for (i, &b) in text.as_bytes().iter().enumerate() {
                prop_assert!(s.feed(b), "byte {} of {}", i, text);
            }
            prop_assert!(s.is_complete(), "{}", text);
        });
    }
}
