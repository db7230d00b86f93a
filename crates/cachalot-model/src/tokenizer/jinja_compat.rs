//! What Jinja2 and Python give a chat template that `minijinja` (with `minijinja-contrib`'s
//! `pycompat`) does not: more `str` methods (`rsplit`, `partition`, `rpartition`,
//! `removeprefix`, `removesuffix`, `index`, `rindex`, `ljust`, `rjust`, `center`, `zfill`,
//! `swapcase`, `casefold`, `isdecimal`, `istitle`, `title`), `list.index`, and Jinja2's filters
//! `center`, `wordcount`, `truncate`, `striptags`, `wordwrap`, `filesizeformat` and `escape`/`e`
//! (markupsafe's entities).
//!
//! `transformers` renders templates in Jinja2's sandbox, where a string is a Python `str`
//! with all its methods, so a model's template may call any of them; each here follows
//! CPython's (or Jinja2's) definition, and the tests check renderings that Jinja2 produced.
//! Not covered: the `%` operator on strings (minijinja's parser gives it integer meaning only),
//! `urlize`, `xmlattr`, `random`; a loop over a string has no `loop.length` (nor `last`,
//! `revindex`), and tuples (`partition`'s, `dictsort`'s) print as lists.

use minijinja::value::{from_args, Kwargs, ValueKind};
use minijinja::{Environment, Error, ErrorKind, State, Value};

/// Adds the filters, the method callback and the Python-style output of values to `env`.
pub(crate) fn install(env: &mut Environment<'static>) {
    env.set_unknown_method_callback(unknown_method);
    env.set_formatter(|out, state, value| match value.kind() {
        ValueKind::Undefined | ValueKind::String => minijinja::escape_formatter(out, state, value),
        _ => {
            let mut s = String::new();
            python_str(value, &mut s);
            out.write_str(&s).map_err(Error::from)
        }
    });
    env.add_filter("center", |s: String, width: Option<i64>| {
        center(&s, width.unwrap_or(80), ' ')
    });
    env.add_filter("wordcount", |s: String| wordcount(&s));
    env.add_filter("truncate", truncate);
    env.add_filter("striptags", |s: String| striptags(&s));
    env.add_filter("wordwrap", wordwrap);
    env.add_filter("filesizeformat", filesizeformat);
    env.add_filter("int", int_filter);
    env.add_filter("float", float_filter);
    env.add_filter("escape", escape_filter);
    env.add_filter("e", escape_filter);
    // Jinja2's tests on Python values: a `str` or `dict` is a sequence (it has a length and
    // items), and `None` is not iterable (minijinja answers both the other way).
    env.add_test("sequence", |v: Value| {
        matches!(
            v.kind(),
            ValueKind::String | ValueKind::Bytes | ValueKind::Seq | ValueKind::Map
        )
    });
    env.add_test("iterable", |v: Value| {
        matches!(
            v.kind(),
            ValueKind::String
                | ValueKind::Bytes
                | ValueKind::Seq
                | ValueKind::Map
                | ValueKind::Iterable
                | ValueKind::Undefined
        )
    });
}

/// Jinja2's `int(default=0, base=10)`: a number truncated, a string read as an integer (in
/// `base`, surrounding whitespace and `_` allowed) or else as a float, anything else (or what
/// does not read) the default.
fn int_filter(
    value: Value,
    default: Option<Value>,
    base: Option<u32>,
    kwargs: Kwargs,
) -> Result<Value, Error> {
    let default = match default {
        Some(d) => d,
        None => kwargs
            .get::<Option<Value>>("default")?
            .unwrap_or(Value::from(0)),
    };
    let base = match base {
        Some(b) => b,
        None => kwargs.get::<Option<u32>>("base")?.unwrap_or(10),
    };
    kwargs.assert_all_used()?;
    Ok(int_of(value, default, base))
}

fn int_of(value: Value, default: Value, base: u32) -> Value {
    match value.kind() {
        ValueKind::Bool => Value::from(value.is_true() as i64),
        ValueKind::Number => match i64::try_from(value.clone()) {
            Ok(n) => Value::from(n),
            Err(_) => f64::try_from(value)
                .ok()
                .filter(|f| f.is_finite() && f.abs() < 9.2e18)
                .map_or(default, |f| Value::from(f.trunc() as i64)),
        },
        ValueKind::String => {
            let s = value.as_str().unwrap_or("").trim().replace('_', "");
            let digits = match base {
                16 => s.trim_start_matches("0x").trim_start_matches("0X"),
                8 => s.trim_start_matches("0o").trim_start_matches("0O"),
                2 => s.trim_start_matches("0b").trim_start_matches("0B"),
                _ => s.as_str(),
            };
            if let Ok(n) = i64::from_str_radix(digits, base.clamp(2, 36)) {
                return Value::from(n);
            }
            if base == 10 {
                if let Ok(f) = s.parse::<f64>() {
                    if f.is_finite() && f.abs() < 9.2e18 {
                        return Value::from(f.trunc() as i64);
                    }
                }
            }
            default
        }
        _ => default,
    }
}

/// Jinja2's `float(default=0.0)`: a number as it is, a string read as a float, anything else
/// (or what does not read) the default.
fn float_filter(value: Value, default: Option<Value>, kwargs: Kwargs) -> Result<Value, Error> {
    let default = match default {
        Some(d) => d,
        None => kwargs
            .get::<Option<Value>>("default")?
            .unwrap_or(Value::from(0.0)),
    };
    kwargs.assert_all_used()?;
    Ok(match value.kind() {
        ValueKind::Bool => Value::from(value.is_true() as i64 as f64),
        ValueKind::Number => f64::try_from(value).map_or(default, Value::from),
        ValueKind::String => value
            .as_str()
            .unwrap_or("")
            .trim()
            .replace('_', "")
            .parse::<f64>()
            .map_or(default, Value::from),
        _ => default,
    })
}

fn value_error(msg: impl Into<String>) -> Error {
    Error::new(ErrorKind::InvalidOperation, msg.into())
}

/// What Jinja2's `{{ value }}` writes, Python's `str(value)`: `True`, `False`, `None`, floats
/// as Python prints them, lists and dicts with their items' `repr` (`['a', 1]`,
/// `{'k': 'v'}`). minijinja itself writes `true`, `none` and JSON-like containers, so a
/// template that prints a flag or a tool's arguments given as a dict would render differently
/// from transformers.
fn python_str(v: &Value, out: &mut String) {
    match v.kind() {
        ValueKind::String => out.push_str(v.as_str().unwrap_or_default()),
        _ => python_repr(v, out),
    }
}

fn python_repr(v: &Value, out: &mut String) {
    match v.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("None"),
        ValueKind::Bool => out.push_str(if v.is_true() { "True" } else { "False" }),
        ValueKind::String => python_str_repr(v.as_str().unwrap_or_default(), out),
        ValueKind::Number => match f64::try_from(v.clone()) {
            Ok(f) if is_float(v) => out.push_str(&python_float(f)),
            _ => out.push_str(&v.to_string()),
        },
        ValueKind::Seq => {
            out.push('[');
            if let Ok(items) = v.try_iter() {
                for (i, item) in items.enumerate() {
                    if i > 0 {
                        out.push_str(", ");
                    }
                    python_repr(&item, out);
                }
            }
            out.push(']');
        }
        ValueKind::Map => {
            out.push('{');
            if let Ok(keys) = v.try_iter() {
                for (i, k) in keys.enumerate() {
                    if i > 0 {
                        out.push_str(", ");
                    }
                    python_repr(&k, out);
                    out.push_str(": ");
                    python_repr(&v.get_item(&k).unwrap_or_default(), out);
                }
            }
            out.push('}');
        }
        _ => out.push_str(&v.to_string()),
    }
}

/// Whether a number value holds a float (minijinja's Display writes `1.0` for those).
fn is_float(v: &Value) -> bool {
    let s = v.to_string();
    s.contains(['.', 'e', 'E']) || s.contains("inf") || s.contains("NaN")
}

/// Python's `repr(float)`: the shortest digits that round-trip, `.0` on integral values,
/// exponent form (`1e-05`, `1e+16`) outside [1e-4, 1e16).
fn python_float(f: f64) -> String {
    if f.is_nan() {
        return "nan".into();
    }
    if f.is_infinite() {
        return if f > 0.0 { "inf".into() } else { "-inf".into() };
    }
    let a = f.abs();
    if a != 0.0 && !(1e-4..1e16).contains(&a) {
        // Rust's `{:e}` gives the shortest round-trip mantissa: `1e-5`, `1.5e16`.
        let e = format!("{f:e}");
        let (mant, exp) = e.split_once('e').unwrap_or((&e, "0"));
        let exp: i32 = exp.parse().unwrap_or(0);
        let sign = if exp < 0 { '-' } else { '+' };
        return format!("{mant}e{sign}{:02}", exp.abs());
    }
    let s = format!("{f}");
    if s.contains('.') {
        s
    } else {
        format!("{s}.0")
    }
}

/// Python's `repr(str)`: single quotes unless the text has a single quote and no double one;
/// backslash, the quote, `\t`, `\n`, `\r` and non-printable characters escaped.
fn python_str_repr(s: &str, out: &mut String) {
    let q = if s.contains('\'') && !s.contains('"') {
        '"'
    } else {
        '\''
    };
    out.push(q);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\t' => out.push_str("\\t"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            c if c == q => {
                out.push('\\');
                out.push(c);
            }
            c if !printable(c) => {
                let n = c as u32;
                if n < 0x100 {
                    out.push_str(&format!("\\x{n:02x}"));
                } else if n < 0x10000 {
                    out.push_str(&format!("\\u{n:04x}"));
                } else {
                    out.push_str(&format!("\\U{n:08x}"));
                }
            }
            c => out.push(c),
        }
    }
    out.push(q);
}

/// Python's `str.isprintable` for one character, for the characters templates meet: controls,
/// the Latin-1 non-printables, and the common format and separator characters.
fn printable(c: char) -> bool {
    !matches!(c as u32,
        0..=0x1f | 0x7f..=0xa0 | 0xad | 0x2000..=0x200f | 0x2028..=0x202f | 0x205f..=0x2064
        | 0x3000 | 0xfeff | 0xfff9..=0xfffb | 0xe000..=0xf8ff)
}

/// Python methods on strings and lists beyond `pycompat`'s, then `pycompat`'s.
fn unknown_method(
    state: &mut State,
    value: &Value,
    method: &str,
    args: &[Value],
) -> Result<Value, Error> {
    if let Some(s) = value.as_str() {
        if let Some(v) = string_method(s, method, args)? {
            return Ok(v);
        }
    } else if value.kind() == ValueKind::Seq && method == "index" {
        let (what,): (Value,) = from_args(args)?;
        let pos = value.try_iter()?.position(|v| v == what);
        return pos
            .map(Value::from)
            .ok_or_else(|| value_error(format!("{what} is not in list")));
    }
    minijinja_contrib::pycompat::unknown_method_callback(state, value, method, args)
}

/// The char index of byte offset `b` in `s` (Python's indices count characters).
fn char_index(s: &str, b: usize) -> i64 {
    s[..b].chars().count() as i64
}

fn fill_char(fill: Option<String>) -> Result<char, Error> {
    match fill {
        None => Ok(' '),
        Some(f) => {
            let mut it = f.chars();
            match (it.next(), it.next()) {
                (Some(c), None) => Ok(c),
                _ => Err(value_error(
                    "The fill character must be exactly one character long",
                )),
            }
        }
    }
}

fn string_method(s: &str, method: &str, args: &[Value]) -> Result<Option<Value>, Error> {
    let v = match method {
        "rsplit" => {
            let (sep, maxsplit): (Option<String>, Option<i64>) = from_args(args)?;
            Value::from(rsplit(s, sep.as_deref(), maxsplit.unwrap_or(-1))?)
        }
        "partition" | "rpartition" => {
            let (sep,): (String,) = from_args(args)?;
            if sep.is_empty() {
                return Err(value_error("empty separator"));
            }
            let found = if method == "partition" {
                s.find(&sep)
            } else {
                s.rfind(&sep)
            };
            let parts = match found {
                Some(i) => [&s[..i], sep.as_str(), &s[i + sep.len()..]],
                None if method == "partition" => [s, "", ""],
                None => ["", "", s],
            };
            Value::from(parts.iter().map(|p| Value::from(*p)).collect::<Vec<_>>())
        }
        "removeprefix" => {
            let (p,): (String,) = from_args(args)?;
            Value::from(s.strip_prefix(p.as_str()).unwrap_or(s))
        }
        "removesuffix" => {
            let (p,): (String,) = from_args(args)?;
            Value::from(s.strip_suffix(p.as_str()).unwrap_or(s))
        }
        "index" | "rindex" => {
            let (what,): (String,) = from_args(args)?;
            let found = if method == "index" {
                s.find(&what)
            } else {
                s.rfind(&what)
            };
            match found {
                Some(b) => Value::from(char_index(s, b)),
                None => return Err(value_error("substring not found")),
            }
        }
        "ljust" | "rjust" | "center" => {
            let (width, fill): (i64, Option<String>) = from_args(args)?;
            let c = fill_char(fill)?;
            let n = s.chars().count() as i64;
            let pad = (width - n).max(0) as usize;
            let padding = |k: usize| std::iter::repeat_n(c, k).collect::<String>();
            Value::from(match method {
                "ljust" => format!("{s}{}", padding(pad)),
                "rjust" => format!("{}{s}", padding(pad)),
                _ => center(s, width, c),
            })
        }
        "zfill" => {
            let (width,): (i64,) = from_args(args)?;
            let n = s.chars().count() as i64;
            let pad = (width - n).max(0) as usize;
            let zeros = "0".repeat(pad);
            Value::from(match s.chars().next() {
                Some(sign @ ('+' | '-')) => format!("{sign}{zeros}{}", &s[1..]),
                _ => format!("{zeros}{s}"),
            })
        }
        "swapcase" => {
            let () = from_args(args)?;
            Value::from(
                s.chars()
                    .flat_map(|c| -> Vec<char> {
                        if c.is_uppercase() {
                            c.to_lowercase().collect()
                        } else if c.is_lowercase() {
                            c.to_uppercase().collect()
                        } else {
                            vec![c]
                        }
                    })
                    .collect::<String>(),
            )
        }
        "casefold" => {
            let () = from_args(args)?;
            // Python's casefold is lower() plus a few full foldings (ß -> ss is the one that
            // matters in practice).
            Value::from(s.to_lowercase().replace('ß', "ss"))
        }
        "isdecimal" => {
            let () = from_args(args)?;
            Value::from(!s.is_empty() && s.chars().all(|c| c.is_ascii_digit()))
        }
        "istitle" => {
            let () = from_args(args)?;
            Value::from(istitle(s))
        }
        "title" => {
            let () = from_args(args)?;
            Value::from(python_title(s))
        }
        _ => return Ok(None),
    };
    Ok(Some(v))
}

/// CPython's `str.rsplit(sep, maxsplit)`.
fn rsplit(s: &str, sep: Option<&str>, maxsplit: i64) -> Result<Vec<Value>, Error> {
    let limit = if maxsplit < 0 {
        usize::MAX
    } else {
        maxsplit as usize
    };
    let mut parts: Vec<&str> = Vec::new();
    match sep {
        Some("") => return Err(value_error("empty separator")),
        Some(sep) => {
            let mut rest = s;
            while parts.len() < limit {
                match rest.rfind(sep) {
                    Some(i) => {
                        parts.push(&rest[i + sep.len()..]);
                        rest = &rest[..i];
                    }
                    None => break,
                }
            }
            parts.push(rest);
        }
        None => {
            // Runs of whitespace separate; leading and trailing whitespace give no parts.
            let mut rest = s.trim_end();
            while !rest.is_empty() {
                if parts.len() == limit {
                    parts.push(rest);
                    break;
                }
                match rest.rfind(char::is_whitespace) {
                    Some(i) => {
                        let ws_len = rest[i..].chars().next().map_or(1, char::len_utf8);
                        parts.push(&rest[i + ws_len..]);
                        rest = rest[..i].trim_end();
                    }
                    None => {
                        parts.push(rest);
                        rest = "";
                    }
                }
            }
        }
    }
    parts.reverse();
    Ok(parts.into_iter().map(Value::from).collect())
}

/// CPython's `str.center`: the odd pad goes left when the width is odd.
fn center(s: &str, width: i64, c: char) -> String {
    let n = s.chars().count() as i64;
    if width <= n {
        return s.to_string();
    }
    let marg = width - n;
    let left = marg / 2 + (marg & width & 1);
    let right = marg - left;
    let pad = |k: i64| std::iter::repeat_n(c, k as usize).collect::<String>();
    format!("{}{s}{}", pad(left), pad(right))
}

/// Python's `str.title()`: a cased character after a cased one is lowercased, any other is
/// uppercased (so `o'neil` is `O'Neil`, unlike Jinja2's `title` filter, which starts words at
/// whitespace and brackets only).
fn python_title(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut prev_cased = false;
    for c in s.chars() {
        if prev_cased {
            out.extend(c.to_lowercase());
        } else {
            title_case(c, &mut out);
        }
        prev_cased = c.is_uppercase() || c.is_lowercase() || is_titlecase(c);
    }
    out
}

/// Unicode's titlecase letters (category Lt): the digraphs and Greek letters with a
/// prosgegrammeni.
fn is_titlecase(c: char) -> bool {
    matches!(c, 'ǅ' | 'ǈ' | 'ǋ' | 'ǲ' | 'ᾈ'..='ᾏ' | 'ᾘ'..='ᾟ' | 'ᾨ'..='ᾯ' | 'ᾼ' | 'ῌ' | 'ῼ')
}

/// A character's titlecase mapping (CPython's `str.title` of a word's first letter): the
/// uppercase one except where Unicode's titlecase differs (ß, the Latin digraphs and
/// ligatures, Greek letters with a prosgegrammeni).
fn title_case(c: char, out: &mut String) {
    let special = match c {
        'ß' => "Ss",
        'Ǆ' | 'ǅ' | 'ǆ' => "ǅ",
        'Ǉ' | 'ǈ' | 'ǉ' => "ǈ",
        'Ǌ' | 'ǋ' | 'ǌ' => "ǋ",
        'Ǳ' | 'ǲ' | 'ǳ' => "ǲ",
        'ﬀ' => "Ff",
        'ﬁ' => "Fi",
        'ﬂ' => "Fl",
        'ﬃ' => "Ffi",
        'ﬄ' => "Ffl",
        'ﬅ' | 'ﬆ' => "St",
        _ => "",
    };
    if !special.is_empty() {
        out.push_str(special);
        return;
    }
    let greek = match c {
        'ᾀ'..='ᾇ' | 'ᾐ'..='ᾗ' | 'ᾠ'..='ᾧ' => char::from_u32(c as u32 + 8),
        'ᾈ'..='ᾏ' | 'ᾘ'..='ᾟ' | 'ᾨ'..='ᾯ' | 'ᾼ' | 'ῌ' | 'ῼ' => Some(c),
        'ᾳ' => Some('ᾼ'),
        'ῃ' => Some('ῌ'),
        'ῳ' => Some('ῼ'),
        _ => None,
    };
    match greek {
        Some(t) => out.push(t),
        None => out.extend(c.to_uppercase()),
    }
}

/// Jinja2's `escape` (markupsafe's): `&`, `<`, `>`, `'` and `"` as `&amp;`, `&lt;`, `&gt;`,
/// `&#39;` and `&#34;`; a value already safe is left as it is.
fn escape_filter(v: Value) -> Value {
    if v.is_safe() {
        return v;
    }
    let text = match v.as_str() {
        Some(t) => t.to_string(),
        None => {
            let mut t = String::new();
            python_str(&v, &mut t);
            t
        }
    };
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '\'' => out.push_str("&#39;"),
            '"' => out.push_str("&#34;"),
            c => out.push(c),
        }
    }
    Value::from_safe_string(out)
}

fn istitle(s: &str) -> bool {
    let (mut cased, mut prev_cased) = (false, false);
    for c in s.chars() {
        if c.is_uppercase() {
            if prev_cased {
                return false;
            }
            prev_cased = true;
            cased = true;
        } else if c.is_lowercase() {
            if !prev_cased {
                return false;
            }
            prev_cased = true;
            cased = true;
        } else {
            prev_cased = false;
        }
    }
    cased
}

/// Jinja2's `wordcount`: the runs of word characters (`\w+`).
fn wordcount(s: &str) -> usize {
    let word = |c: char| c.is_alphanumeric() || c == '_';
    let mut n = 0;
    let mut inside = false;
    for c in s.chars() {
        let w = word(c);
        if w && !inside {
            n += 1;
        }
        inside = w;
    }
    n
}

/// Jinja2's `truncate(s, length=255, killwords=False, end='...', leeway=5)`, arguments by
/// position or by name.
fn truncate(
    s: String,
    rest: minijinja::value::Rest<minijinja::value::ValueOrKwargs>,
) -> Result<String, Error> {
    // (Four more positional arguments and the keywords are more than a filter's signature
    // takes: the keywords, a last map marked as such, are split off by hand.)
    let all = rest.into_values();
    let keywords = all
        .split_last()
        .filter(|(last, _)| last.kind() == ValueKind::Map)
        .and_then(|(last, rest)| Some((rest, Kwargs::try_from(last.clone()).ok()?)));
    let (positional, args) = keywords.unwrap_or_else(|| {
        (
            all.as_slice(),
            Kwargs::from_iter(Vec::<(String, Value)>::new()),
        )
    });
    type Args = (Option<i64>, Option<bool>, Option<String>, Option<i64>);
    let (length, killwords, end, leeway): Args = from_args(positional)?;
    let length = args.get::<Option<i64>>("length")?.or(length).unwrap_or(255);
    let killwords = args
        .get::<Option<bool>>("killwords")?
        .or(killwords)
        .unwrap_or(false);
    let end = args
        .get::<Option<String>>("end")?
        .or(end)
        .unwrap_or_else(|| "...".into());
    let leeway = args.get::<Option<i64>>("leeway")?.or(leeway).unwrap_or(5);
    args.assert_all_used()?;
    truncate_with(&s, length, killwords, &end, leeway)
}

fn truncate_with(
    s: &str,
    length: i64,
    killwords: bool,
    end: &str,
    leeway: i64,
) -> Result<String, Error> {
    let end_len = end.chars().count() as i64;
    if length < end_len {
        return Err(value_error(format!(
            "expected length >= {end_len}, got {length}"
        )));
    }
    if leeway < 0 {
        return Err(value_error(format!("expected leeway >= 0, got {leeway}")));
    }
    if s.chars().count() as i64 <= length + leeway {
        return Ok(s.to_string());
    }
    let head: String = s.chars().take((length - end_len) as usize).collect();
    if killwords {
        return Ok(head + end);
    }
    let kept = match head.rfind(' ') {
        Some(i) => &head[..i],
        None => head.as_str(),
    };
    Ok(format!("{kept}{end}"))
}

/// markupsafe's `Markup.striptags`: comments, then tags, removed; whitespace runs collapsed to
/// one space; HTML entities unescaped (the numeric ones and the common named ones).
fn striptags(s: &str) -> String {
    let mut v = s.to_string();
    for (open, close) in [("<!--", "-->"), ("<", ">")] {
        while let Some(start) = v.find(open) {
            let Some(end) = v[start..].find(close).map(|e| start + e) else {
                break;
            };
            v.replace_range(start..end + close.len(), "");
        }
    }
    let collapsed = v.split_whitespace().collect::<Vec<_>>().join(" ");
    unescape_html(&collapsed)
}

fn unescape_html(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    while let Some(i) = rest.find('&') {
        out.push_str(&rest[..i]);
        rest = &rest[i..];
        let entity = rest[1..].find(';').map(|j| &rest[1..1 + j]);
        let decoded = entity.and_then(|e| {
            let c = if let Some(num) = e.strip_prefix('#') {
                let n = match num.strip_prefix(['x', 'X']) {
                    Some(hex) => u32::from_str_radix(hex, 16).ok()?,
                    None => num.parse().ok()?,
                };
                char::from_u32(n)?
            } else {
                match e {
                    "amp" => '&',
                    "lt" => '<',
                    "gt" => '>',
                    "quot" => '"',
                    "apos" => '\'',
                    "nbsp" => '\u{a0}',
                    _ => return None,
                }
            };
            Some((c, e.len() + 2))
        });
        match decoded {
            Some((c, len)) => {
                out.push(c);
                rest = &rest[len..];
            }
            None => {
                out.push('&');
                rest = &rest[1..];
            }
        }
    }
    out.push_str(rest);
    out
}

/// Jinja2's `wordwrap(s, width=79, break_long_words=True, wrapstring=None,
/// break_on_hyphens=True)`, for the common case: paragraphs split at newlines, words packed
/// greedily into lines of at most `width` characters, words longer than a line cut when
/// `break_long_words`. Hyphen breaking is not done (`break_on_hyphens`, by name only, is
/// accepted and ignored).
fn wordwrap(
    s: String,
    width: Option<i64>,
    break_long_words: Option<bool>,
    wrapstring: Option<String>,
    args: Kwargs,
) -> Result<String, Error> {
    let width = args.get::<Option<i64>>("width")?.or(width).unwrap_or(79);
    let break_long = args
        .get::<Option<bool>>("break_long_words")?
        .or(break_long_words)
        .unwrap_or(true);
    let wrapstring = args
        .get::<Option<String>>("wrapstring")?
        .or(wrapstring)
        .unwrap_or_else(|| "\n".into());
    let _: Option<bool> = args.get("break_on_hyphens")?;
    args.assert_all_used()?;
    if width <= 0 {
        return Err(value_error(format!("invalid width {width} (must be > 0)")));
    }
    let width = width as usize;
    let mut lines_out = Vec::new();
    for para in s.lines() {
        let mut lines: Vec<String> = Vec::new();
        let mut cur = String::new();
        for word in para.split_whitespace() {
            let mut word = word.to_string();
            loop {
                let cur_len = cur.chars().count();
                let wlen = word.chars().count();
                let need = if cur.is_empty() {
                    wlen
                } else {
                    cur_len + 1 + wlen
                };
                if need <= width {
                    if !cur.is_empty() {
                        cur.push(' ');
                    }
                    cur.push_str(&word);
                    break;
                }
                if !cur.is_empty() {
                    lines.push(std::mem::take(&mut cur));
                    continue;
                }
                if !break_long {
                    lines.push(word);
                    break;
                }
                let head: String = word.chars().take(width).collect();
                let tail: String = word.chars().skip(width).collect();
                lines.push(head);
                word = tail;
                if word.is_empty() {
                    break;
                }
            }
        }
        if !cur.is_empty() {
            lines.push(cur);
        }
        lines_out.push(lines.join(&wrapstring));
    }
    Ok(lines_out.join(&wrapstring))
}

/// Jinja2's `filesizeformat(value, binary=False)`.
fn filesizeformat(value: Value, binary: Option<bool>) -> Result<String, Error> {
    let bytes = f64::try_from(value.clone())
        .map_err(|_| value_error(format!("filesizeformat: {value} is not a number")))?;
    let binary = binary.unwrap_or(false);
    let base: f64 = if binary { 1024.0 } else { 1000.0 };
    let prefixes = if binary {
        ["KiB", "MiB", "GiB", "TiB", "PiB", "EiB", "ZiB", "YiB"]
    } else {
        ["kB", "MB", "GB", "TB", "PB", "EB", "ZB", "YB"]
    };
    if bytes == 1.0 {
        return Ok("1 Byte".into());
    }
    if bytes < base {
        return Ok(format!("{} Bytes", bytes as i64));
    }
    let mut unit = base;
    for (i, prefix) in prefixes.iter().enumerate() {
        unit = base.powi(i as i32 + 2);
        if bytes < unit {
            return Ok(format!("{:.1} {prefix}", base * bytes / unit));
        }
    }
    Ok(format!("{:.1} {}", base * bytes / unit, prefixes[7]))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn render(src: &str) -> String {
        let mut env = Environment::new();
        install(&mut env);
        env.render_str(src, ()).unwrap()
    }

    /// Jinja2's `int` and `float`: what does not read is the default (0, 0.0, or the one
    /// given, positionally or by name); `base` reads prefixed digits. Expected: Jinja2 3.1.
    #[test]
    fn int_and_float_take_jinja2s_defaults() {
        let src = "{{ 'abc'|int }} {{ ' 42 '|int }} {{ '12abc'|int }} {{ ''|int }} {{ none|int }} \
                   {{ 'x'|float }} {{ ''|float }} {{ true|int }} {{ '3.7'|int }} {{ '-2'|int }} \
                   {{ '1_000'|int }} {{ 7|float }} {{ 'abc'|int(default=5) }} {{ 'abc'|int(7) }} \
                   {{ '0b101'|int(base=2) }} {{ '0x1A'|int(0, 16) }} {{ 'x'|float(1.5) }}";
        assert_eq!(
            render(src),
            "0 42 0 0 0 0.0 0.0 1 3 -2 1000 7.0 5 7 5 26 1.5"
        );
    }

    /// Expected strings are Jinja2 3.1's renderings of the same sources (Python 3.12).
    #[test]
    fn string_methods_match_python() {
        let cases = [
            ("{{ 'a,b,c'.rsplit(',', 1) | join('|') }}", "a,b|c"),
            ("{{ '  a  b c '.rsplit() | join('|') }}", "a|b|c"),
            ("{{ '  a  b c '.rsplit(None, 1) | join('|') }}", "  a  b|c"),
            ("{{ 'a::b::c'.rsplit('::') | join('|') }}", "a|b|c"),
            ("{{ 'k=v=w'.partition('=') | join('|') }}", "k|=|v=w"),
            ("{{ 'k=v=w'.rpartition('=') | join('|') }}", "k=v|=|w"),
            ("{{ 'kvw'.partition('=') | join('|') }}", "kvw||"),
            ("{{ 'kvw'.rpartition('=') | join('|') }}", "||kvw"),
            ("{{ '<think>x'.removeprefix('<think>') }}", "x"),
            ("{{ 'x</think>'.removesuffix('</think>') }}", "x"),
            ("{{ 'h\u{e9}llo'.index('l') }} {{ 'h\u{e9}llo'.rindex('l') }}", "2 3"),
            ("[{{ 'ab'.ljust(5, '.') }}][{{ 'ab'.rjust(5) }}]", "[ab...][   ab]"),
            ("[{{ 'ab'.center(5, '*') }}][{{ 'abc'.center(6) }}]", "[**ab*][ abc  ]"),
            ("{{ '-42'.zfill(6) }} {{ '7'.zfill(3) }}", "-00042 007"),
            ("{{ 'HeLLo'.swapcase() }} {{ 'Stra\u{df}e'.casefold() }}", "hEllO strasse"),
            (
                "{% if 'Hello World'.istitle() %}y{% endif %}{% if not 'Hello world'.istitle() %}n{% endif %}",
                "yn",
            ),
            ("{% if '123'.isdecimal() and not ''.isdecimal() %}ok{% endif %}", "ok"),
            ("{{ 'a,b'.title() }} {{ \"o'neil 3rd\".title() }}", "A,B O'Neil 3Rd"),
            (
                "{{ 'ßa'.title() }} {{ 'ǆemal'.title() }} {{ 'ﬁne'.title() }} {{ 'ǅA'.title() }}",
                "Ssa ǅemal Fine ǅa",
            ),
            ("{{ ['a', 'b', 'c'].index('b') }}", "1"),
            // pycompat's methods still answer.
            ("{{ 'a b'.split() | join('|') }} {{ ' x '.strip() }}", "a|b x"),
        ];
        for (src, want) in cases {
            assert_eq!(render(src), want, "{src}");
        }
    }

    #[test]
    fn filters_match_jinja2() {
        let cases = [
            ("[{{ 'ab' | center(6) }}]", "[  ab  ]"),
            (
                "{{ \"<a href='x'>&\\\"</a>\" | e }} {{ 'x' | escape | e }} {{ 3 | e }}",
                "&lt;a href=&#39;x&#39;&gt;&amp;&#34;&lt;/a&gt; x 3",
            ),
            ("{{ 'one, two-three  four_five' | wordcount }}", "4"),
            (
                "{{ 'foo bar baz qux' | truncate(9) }}|{{ 'foo bar baz qux' | truncate(9, leeway=0) }}",
                "foo...|foo...",
            ),
            (
                "{{ 'foo bar baz qux' | truncate(9, true, leeway=0) }}|{{ 'foo bar baz qux' | truncate(11, end=' >>', leeway=0) }}",
                "foo ba...|foo bar >>",
            ),
            ("{{ 'hello' | truncate(3, true, '..', 0) }}", "h.."),
            (
                "{{ 'a' is sequence }}|{{ {'a': 1} is sequence }}|{{ [1] is sequence }}|{{ 3 is sequence }}|{{ none is sequence }}",
                "True|True|True|False|False",
            ),
            (
                "{{ 'a' is iterable }}|{{ {'a': 1} is iterable }}|{{ none is iterable }}|{{ 3 is iterable }}|{{ nothing is iterable }}",
                "True|True|False|False|True",
            ),
            (
                "{{ '<p>a  <b>b</b>\n<!-- c --> &amp; &#65;</p>' | striptags }}",
                "a b & A",
            ),
            (
                "{{ 'the quick brown fox jumps' | wordwrap(10) }}",
                "the quick\nbrown fox\njumps",
            ),
            (
                "{{ 1 | filesizeformat }}|{{ 300 | filesizeformat }}|{{ 1500000 | filesizeformat }}|{{ 2048 | filesizeformat(true) }}",
                "1 Byte|300 Bytes|1.5 MB|2.0 KiB",
            ),
        ];
        for (src, want) in cases {
            assert_eq!(render(src), want, "{src}");
        }
    }

    #[test]
    fn values_print_as_python_prints_them() {
        let cases = [
            ("{{ true }} {{ false }} {{ none }}", "True False None"),
            (
                "{{ 3 }} {{ 2.5 }} {{ 1.0 }} {{ 0.00001 }} {{ 1e16 }}",
                "3 2.5 1.0 1e-05 1e+16",
            ),
            (
                "{{ ['a', 1, true, none, 'it\\'s'] }}",
                "['a', 1, True, None, \"it's\"]",
            ),
            (
                "{{ {'city': 'Paris', 'n': 2, 'tags': ['x']} }}",
                "{'city': 'Paris', 'n': 2, 'tags': ['x']}",
            ),
            ("{{ ['a\\nb\\\\'] }}", "['a\\nb\\\\']"),
            ("{{ 'plain' }}{{ undefined_name }}", "plain"),
        ];
        for (src, want) in cases {
            assert_eq!(render(src), want, "{src}");
        }
    }

    #[test]
    fn bad_arguments_are_errors_not_panics() {
        let mut env = Environment::new();
        install(&mut env);
        for src in [
            "{{ 'a'.partition('') }}",
            "{{ 'a'.rsplit('') }}",
            "{{ 'a'.index('z') }}",
            "{{ [1].index(2) }}",
            "{{ 'a'.ljust(3, 'xy') }}",
            "{{ 'abcdef' | truncate(2) }}",
            "{{ 'abc' | wordwrap(0) }}",
            "{{ 'x' | filesizeformat }}",
        ] {
            assert!(env.render_str(src, ()).is_err(), "{src}");
        }
    }
}
