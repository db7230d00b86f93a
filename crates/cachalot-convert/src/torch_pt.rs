//! Reading the dictionaries of tensors that `torch.save` writes (`.pt` / `.pth`), for the
//! seed's quantisation-parameter files (spec `deepseek-v4.md` §4.3: `quant_params_{L}.pt`
//! with `<layer>.clip_factor_min/max`).
//!
//! The format (PyTorch ≥ 1.6, "zip" serialization): an uncompressed zip archive holding
//! `<archive>/data.pkl` — a pickle (protocol 2) of the saved object in which every tensor is
//! `torch._utils._rebuild_tensor_v2(storage, offset, size, stride, requires_grad, hooks)` and
//! each storage a persistent id `('storage', torch.<Dtype>Storage, key, location, numel)` —
//! and `<archive>/data/<key>`, each storage's raw little-endian bytes (`<archive>/byteorder`
//! says `little` when present).
//!
//! Only what such a file needs is implemented: a small pickle machine over the opcodes of
//! protocols 2–4 that builds plain values (None, bools, ints, floats, strings, tuples, lists,
//! dicts), tensors of the float dtypes (f64, f32, f16, bf16) with any size/stride/offset, and
//! `collections.OrderedDict`. Anything else (other classes, compressed entries, legacy
//! non-zip files) is an error naming the file and what was found. Nothing is executed.

use std::collections::HashMap;
use std::path::Path;

use cachalot_kernels::{bf16_to_f32, f16_to_f32};

/// A value of a loaded `.pt` file.
#[derive(Clone, Debug, PartialEq)]
pub enum PtValue {
    None,
    Bool(bool),
    Int(i64),
    Float(f64),
    Str(String),
    Tuple(Vec<PtValue>),
    List(Vec<PtValue>),
    /// Keys in file order (dicts and OrderedDicts alike).
    Dict(Vec<(PtValue, PtValue)>),
    Tensor(PtTensor),
}

/// A tensor's values in row-major order, widened to f64 (exact for every float dtype read).
#[derive(Clone, Debug, PartialEq)]
pub struct PtTensor {
    /// "float64", "float32", "float16" or "bfloat16".
    pub dtype: &'static str,
    pub shape: Vec<usize>,
    pub values: Vec<f64>,
}

/// The unpickler's objects: values plus what only exists while unpickling.
#[derive(Clone, Debug)]
enum Obj {
    None,
    Bool(bool),
    Int(i64),
    Float(f64),
    Str(String),
    Tuple(Vec<Obj>),
    List(Vec<Obj>),
    Dict(Vec<(Obj, Obj)>),
    Tensor(PtTensor),
    Mark,
    Global(String, String),
    Storage { dtype: &'static str, key: String },
}

impl Obj {
    fn into_value(self) -> Result<PtValue, String> {
        Ok(match self {
            Obj::None => PtValue::None,
            Obj::Bool(b) => PtValue::Bool(b),
            Obj::Int(v) => PtValue::Int(v),
            Obj::Float(v) => PtValue::Float(v),
            Obj::Str(v) => PtValue::Str(v),
            Obj::Tuple(v) => PtValue::Tuple(
                v.into_iter()
                    .map(Obj::into_value)
                    .collect::<Result<_, _>>()?,
            ),
            Obj::List(v) => PtValue::List(
                v.into_iter()
                    .map(Obj::into_value)
                    .collect::<Result<_, _>>()?,
            ),
            Obj::Dict(v) => PtValue::Dict(
                v.into_iter()
                    .map(|(k, v)| Ok((k.into_value()?, v.into_value()?)))
                    .collect::<Result<_, String>>()?,
            ),
            Obj::Tensor(t) => PtValue::Tensor(t),
            Obj::Global(m, n) => return Err(format!("the file holds the class {m}.{n} itself")),
            Obj::Mark | Obj::Storage { .. } => {
                return Err("the file holds a bare storage or an unterminated MARK".into())
            }
        })
    }

    fn as_usize_list(&self, what: &str) -> Result<Vec<usize>, String> {
        match self {
            Obj::Tuple(v) | Obj::List(v) => v
                .iter()
                .map(|o| match o {
                    Obj::Int(i) if *i >= 0 => Ok(*i as usize),
                    other => Err(format!("tensor {what} holds {other:?}")),
                })
                .collect(),
            other => Err(format!("tensor {what} is {other:?}")),
        }
    }
}

/// Reads a `torch.save`d file. Errors name `path`.
pub fn load_pt(path: &Path) -> Result<PtValue, String> {
    let bytes = std::fs::read(path).map_err(|e| format!("{}: cannot read: {e}", path.display()))?;
    load_pt_bytes(&bytes).map_err(|e| format!("{}: {e}", path.display()))
}

/// [`load_pt`] on the file's bytes.
pub fn load_pt_bytes(bytes: &[u8]) -> Result<PtValue, String> {
    let entries = zip_entries(bytes)?;
    let (pkl_name, pkl) = entries
        .iter()
        .find(|(n, _)| n.ends_with("/data.pkl") || n == "data.pkl")
        .ok_or("no data.pkl in the archive: not a torch.save file (PyTorch >= 1.6 format)")?;
    let prefix = &pkl_name[..pkl_name.len() - "data.pkl".len()];
    if let Some((_, order)) = entries
        .iter()
        .find(|(n, _)| *n == format!("{prefix}byteorder"))
    {
        if *order != b"little" {
            return Err(format!(
                "byteorder is {:?}; only little-endian files are read",
                String::from_utf8_lossy(order)
            ));
        }
    }
    let data: HashMap<&str, &[u8]> = entries
        .iter()
        .filter_map(|(n, b)| {
            n.strip_prefix(prefix)?
                .strip_prefix("data/")
                .map(|k| (k, *b))
        })
        .collect();
    Unpickler {
        data: &data,
        memo: HashMap::new(),
        stack: Vec::new(),
        objects: 0,
        data_bytes: 0,
    }
    .run(pkl)?
    .into_value()
}

/// The stored (uncompressed) entries of a zip archive: (name, bytes).
fn zip_entries(b: &[u8]) -> Result<Vec<(String, &[u8])>, String> {
    let u16_at = |o: usize| -> Result<u16, String> {
        b.get(o..o.saturating_add(2))
            .map(|s| u16::from_le_bytes([s[0], s[1]]))
            .ok_or_else(|| "truncated zip archive".to_string())
    };
    let u32_at = |o: usize| -> Result<u32, String> {
        b.get(o..o.saturating_add(4))
            .map(|s| u32::from_le_bytes([s[0], s[1], s[2], s[3]]))
            .ok_or_else(|| "truncated zip archive".to_string())
    };
    // End of central directory: the last "PK\x05\x06" (a comment may follow it).
    let eocd = (0..b.len().saturating_sub(21))
        .rev()
        .find(|&i| b[i..i + 4] == [0x50, 0x4b, 0x05, 0x06]);
    let Some(eocd) = eocd else {
        // The legacy format (`_use_new_zipfile_serialization=False`, PyTorch < 1.6) is a bare
        // pickle stream: its first byte is the pickle PROTO opcode.
        return Err(if b.first() == Some(&0x80) {
            "a torch.save file in the legacy (non-zip) format, which is not read: save it again \
             in the zip format (`torch.save(torch.load(F), F)` with PyTorch >= 1.6)"
                .to_string()
        } else {
            "not a zip archive (no end-of-central-directory record): not a torch.save file"
                .to_string()
        });
    };
    let mut count = u16_at(eocd + 10)? as u64;
    let mut cd = u32_at(eocd + 16)? as u64;
    if count == 0xFFFF || cd == 0xFFFF_FFFF {
        // Zip64: the locator precedes the EOCD and points at the zip64 EOCD record.
        let loc = eocd
            .checked_sub(20)
            .filter(|&l| u32_at(l).ok() == Some(0x0706_4b50))
            .ok_or("zip64 archive without its locator")?;
        let rec = u64_at(b, loc + 8)? as usize;
        if u32_at(rec)? != 0x0606_4b50 {
            return Err("bad zip64 end-of-central-directory record".into());
        }
        count = u64_at(b, rec + 32)?;
        cd = u64_at(b, rec + 48)?;
    }
    let mut out = Vec::new();
    let mut p = cd as usize;
    for _ in 0..count {
        if u32_at(p)? != 0x0201_4b50 {
            return Err("bad zip central directory entry".into());
        }
        let method = u16_at(p + 10)?;
        let crc = u32_at(p + 16)?;
        let mut csize = u32_at(p + 20)? as u64;
        let mut usize_ = u32_at(p + 24)? as u64;
        let name_len = u16_at(p + 28)? as usize;
        let extra_len = u16_at(p + 30)? as usize;
        let comment_len = u16_at(p + 32)? as usize;
        let mut local = u32_at(p + 42)? as u64;
        let name = String::from_utf8_lossy(
            b.get(p + 46..p + 46 + name_len)
                .ok_or("truncated zip archive")?,
        )
        .into_owned();
        // Zip64 extra field: the 64-bit sizes/offset, in order, for the fields set to all ones.
        let extra = b
            .get(p + 46 + name_len..p + 46 + name_len + extra_len)
            .ok_or("truncated zip archive")?;
        let mut e = 0;
        while e + 4 <= extra.len() {
            let id = u16::from_le_bytes([extra[e], extra[e + 1]]);
            let len = u16::from_le_bytes([extra[e + 2], extra[e + 3]]) as usize;
            if id == 1 {
                let mut q = e + 4;
                for field in [&mut usize_, &mut csize] {
                    if *field == 0xFFFF_FFFF {
                        *field = u64_at(extra, q)?;
                        q += 8;
                    }
                }
                if local == 0xFFFF_FFFF {
                    local = u64_at(extra, q)?;
                }
            }
            e += 4 + len;
        }
        if method != 0 {
            return Err(format!(
                "zip entry {name} is compressed (method {method}); torch.save stores entries \
                 uncompressed — re-save the file with torch.save"
            ));
        }
        let l = local as usize;
        if u32_at(l)? != 0x0403_4b50 {
            return Err(format!("zip entry {name}: bad local header"));
        }
        let start = l + 30 + u16_at(l + 26)? as usize + u16_at(l + 28)? as usize;
        let data = b
            .get(start..start.saturating_add(csize as usize))
            .ok_or_else(|| format!("zip entry {name} runs past the end of the file"))?;
        // The stored bytes must be those the archive was written with (Python's
        // `zipfile.testzip` checks the same): a damaged scale file is said, not converted.
        let got = crc32(data);
        if got != crc {
            return Err(format!(
                "zip entry {name} is damaged: its CRC-32 is {got:08x}, the archive says \
                 {crc:08x}; copy or download the file again"
            ));
        }
        out.push((name, data));
        p += 46 + name_len + extra_len + comment_len;
    }
    Ok(out)
}

/// CRC-32 (IEEE 802.3, zip's), bytewise through a 256-entry table.
pub fn crc32(data: &[u8]) -> u32 {
    static TABLE: std::sync::OnceLock<[u32; 256]> = std::sync::OnceLock::new();
    let table = TABLE.get_or_init(|| {
        let mut t = [0u32; 256];
        for (i, e) in t.iter_mut().enumerate() {
            let mut c = i as u32;
            for _ in 0..8 {
                c = if c & 1 != 0 {
                    0xEDB8_8320 ^ (c >> 1)
                } else {
                    c >> 1
                };
            }
            *e = c;
        }
        t
    });
    !data.iter().fold(!0u32, |c, &b| {
        table[((c ^ b as u32) & 0xFF) as usize] ^ (c >> 8)
    })
}

fn u64_at(b: &[u8], o: usize) -> Result<u64, String> {
    b.get(o..o.saturating_add(8))
        .map(|s| u64::from_le_bytes(s.try_into().unwrap()))
        .ok_or_else(|| "truncated zip archive".to_string())
}

/// Bounds on what a pickle may decode to. The memo lets a few bytes copy a large object again
/// and again (each BINGET clones it), so a tiny malformed file could otherwise exhaust memory
/// (exponentially); deep nesting would exhaust the stack when the result is converted or
/// dropped. A file of quantisation parameters is far below all three.
const MAX_OBJECTS: usize = 4_000_000;
/// Bytes of decoded tensor values (8 per element) and strings.
const MAX_DATA_BYTES: usize = 2 << 30;
/// Nesting of tuples, lists and dicts (a dict of tensors, counted with their arguments, is 4).
const MAX_DEPTH: usize = 100;

/// Objects, and their payload bytes, in a decoded object (its nodes, recursively).
fn weight(o: &Obj) -> (usize, usize) {
    let sum = |items: &mut dyn Iterator<Item = &Obj>| {
        items.fold((1usize, 0usize), |(n, b), x| {
            let (xn, xb) = weight(x);
            (n.saturating_add(xn), b.saturating_add(xb))
        })
    };
    match o {
        Obj::Str(s) => (1, s.len()),
        Obj::Tensor(t) => (1, t.values.len().saturating_mul(8)),
        Obj::Global(m, n) => (1, m.len() + n.len()),
        Obj::Storage { key, .. } => (1, key.len()),
        Obj::Tuple(v) | Obj::List(v) => sum(&mut v.iter()),
        Obj::Dict(v) => sum(&mut v.iter().flat_map(|(k, v)| [k, v])),
        Obj::None | Obj::Bool(_) | Obj::Int(_) | Obj::Float(_) | Obj::Mark => (1, 0),
    }
}

struct Unpickler<'a> {
    data: &'a HashMap<&'a str, &'a [u8]>,
    /// Memoized objects with their nesting depths.
    memo: HashMap<u64, (Obj, usize)>,
    /// The stack, each object with its nesting depth (1 for a scalar or an empty container).
    stack: Vec<(Obj, usize)>,
    /// Objects and payload bytes decoded so far, copies included.
    objects: usize,
    data_bytes: usize,
}

impl Unpickler<'_> {
    /// Counts `objects` new objects holding `bytes` payload bytes against the bounds.
    fn charge(&mut self, objects: usize, bytes: usize) -> Result<(), String> {
        self.objects = self.objects.saturating_add(objects);
        self.data_bytes = self.data_bytes.saturating_add(bytes);
        if self.objects > MAX_OBJECTS {
            return Err(format!(
                "pickle too large or malformed: more than {MAX_OBJECTS} objects"
            ));
        }
        if self.data_bytes > MAX_DATA_BYTES {
            return Err(format!(
                "pickle too large or malformed: more than {MAX_DATA_BYTES} bytes of tensor \
                 values and strings"
            ));
        }
        Ok(())
    }

    /// Pushes a newly built object (its children, if any, were counted when they were built).
    fn push(&mut self, o: Obj, depth: usize) -> Result<(), String> {
        check_depth(depth)?;
        let bytes = match &o {
            Obj::Str(s) => s.len(),
            _ => 0,
        };
        self.charge(1, bytes)?;
        self.stack.push((o, depth));
        Ok(())
    }

    fn pop(&mut self) -> Result<Obj, String> {
        self.pop_depth().map(|(o, _)| o)
    }

    fn pop_depth(&mut self) -> Result<(Obj, usize), String> {
        self.stack
            .pop()
            .ok_or_else(|| "pickle stack underflow".to_string())
    }

    /// Items above the topmost mark (the mark removed), and their greatest depth (0 if none).
    fn pop_to_mark(&mut self) -> Result<(Vec<Obj>, usize), String> {
        let m = self
            .stack
            .iter()
            .rposition(|(i, _)| matches!(i, Obj::Mark))
            .ok_or("pickle MARK missing")?;
        let items = self.stack.split_off(m + 1);
        self.stack.pop();
        Ok(unzip_depths(items))
    }

    fn run(mut self, p: &[u8]) -> Result<Obj, String> {
        let mut i = 0;
        let take = |i: &mut usize, n: usize| -> Result<&[u8], String> {
            let end = i.checked_add(n).ok_or("truncated pickle")?;
            let s = p.get(*i..end).ok_or("truncated pickle")?;
            *i = end;
            Ok(s)
        };
        let line = |i: &mut usize| -> Result<String, String> {
            let rest = p.get(*i..).ok_or("truncated pickle")?;
            let end = rest
                .iter()
                .position(|&c| c == b'\n')
                .ok_or("truncated pickle")?;
            let s = String::from_utf8_lossy(&rest[..end]).into_owned();
            *i += end + 1;
            Ok(s)
        };
        loop {
            let op = *p.get(i).ok_or("pickle ends without STOP")?;
            i += 1;
            match op {
                0x80 => i += 1,            // PROTO
                0x95 => i += 8,            // FRAME
                b'.' => return self.pop(), // STOP
                b'(' => self.push(Obj::Mark, 1)?,
                b'N' => self.push(Obj::None, 1)?,
                0x88 => self.push(Obj::Bool(true), 1)?,
                0x89 => self.push(Obj::Bool(false), 1)?,
                b'J' => {
                    let v = i32::from_le_bytes(take(&mut i, 4)?.try_into().unwrap());
                    self.push(Obj::Int(v as i64), 1)?;
                }
                b'K' => {
                    let v = take(&mut i, 1)?[0];
                    self.push(Obj::Int(v as i64), 1)?;
                }
                b'M' => {
                    let v = u16::from_le_bytes(take(&mut i, 2)?.try_into().unwrap());
                    self.push(Obj::Int(v as i64), 1)?;
                }
                0x8a => {
                    // LONG1: little-endian two's complement of n bytes.
                    let n = take(&mut i, 1)?[0] as usize;
                    let b = take(&mut i, n)?;
                    if n > 8 {
                        return Err(format!("integer of {n} bytes is too large"));
                    }
                    let mut v: i64 = 0;
                    for (k, &byte) in b.iter().enumerate() {
                        v |= (byte as i64) << (8 * k);
                    }
                    if n > 0 && n < 8 && b[n - 1] & 0x80 != 0 {
                        v -= 1i64 << (8 * n);
                    }
                    self.push(Obj::Int(v), 1)?;
                }
                b'G' => {
                    let v = f64::from_be_bytes(take(&mut i, 8)?.try_into().unwrap());
                    self.push(Obj::Float(v), 1)?;
                }
                b'X' | 0x8c | 0x8d | b'T' | b'U' => {
                    let n = match op {
                        b'X' | b'T' => {
                            u32::from_le_bytes(take(&mut i, 4)?.try_into().unwrap()) as usize
                        }
                        0x8d => u64::from_le_bytes(take(&mut i, 8)?.try_into().unwrap()) as usize,
                        _ => take(&mut i, 1)?[0] as usize,
                    };
                    let s = String::from_utf8_lossy(take(&mut i, n)?).into_owned();
                    self.push(Obj::Str(s), 1)?;
                }
                b'c' => {
                    let module = line(&mut i)?;
                    let name = line(&mut i)?;
                    self.push(Obj::Global(module, name), 1)?;
                }
                0x93 => {
                    // STACK_GLOBAL
                    let name = self.pop()?;
                    let module = self.pop()?;
                    match (module, name) {
                        (Obj::Str(m), Obj::Str(n)) => self.push(Obj::Global(m, n), 1)?,
                        other => return Err(format!("STACK_GLOBAL of {other:?}")),
                    }
                }
                b')' => self.push(Obj::Tuple(vec![]), 1)?,
                b't' => {
                    let (items, d) = self.pop_to_mark()?;
                    self.push(Obj::Tuple(items), d + 1)?;
                }
                0x85..=0x87 => {
                    let n = (op - 0x84) as usize;
                    if self.stack.len() < n {
                        return Err("pickle stack underflow".into());
                    }
                    let (items, d) = unzip_depths(self.stack.split_off(self.stack.len() - n));
                    self.push(Obj::Tuple(items), d + 1)?;
                }
                b']' => self.push(Obj::List(vec![]), 1)?,
                b'}' => self.push(Obj::Dict(vec![]), 1)?,
                b'a' | b'e' => {
                    let (new, d) = if op == b'a' {
                        let (o, d) = self.pop_depth()?;
                        (vec![o], d)
                    } else {
                        self.pop_to_mark()?
                    };
                    match self.stack.last_mut() {
                        Some((Obj::List(l), depth)) => {
                            l.extend(new);
                            *depth = (*depth).max(d + 1);
                            check_depth(*depth)?;
                        }
                        _ => return Err("APPEND to something that is not a list".into()),
                    }
                }
                b's' | b'u' => {
                    let (items, d) = if op == b's' {
                        let (v, dv) = self.pop_depth()?;
                        let (k, dk) = self.pop_depth()?;
                        (vec![k, v], dk.max(dv))
                    } else {
                        self.pop_to_mark()?
                    };
                    if items.len() % 2 != 0 {
                        return Err("SETITEMS with an odd number of items".into());
                    }
                    match self.stack.last_mut() {
                        Some((Obj::Dict(dict), depth)) => {
                            let mut it = items.into_iter();
                            while let (Some(k), Some(v)) = (it.next(), it.next()) {
                                dict.push((k, v));
                            }
                            *depth = (*depth).max(d + 1);
                            check_depth(*depth)?;
                        }
                        _ => return Err("SETITEM on something that is not a dict".into()),
                    }
                }
                b'q' | b'r' | 0x94 => {
                    let key = match op {
                        b'q' => take(&mut i, 1)?[0] as u64,
                        b'r' => u32::from_le_bytes(take(&mut i, 4)?.try_into().unwrap()) as u64,
                        _ => self.memo.len() as u64,
                    };
                    let top = self.stack.last().ok_or("MEMOIZE of an empty stack")?;
                    let (n, b) = weight(&top.0);
                    let top = top.clone();
                    self.charge(n, b)?;
                    self.memo.insert(key, top);
                }
                b'h' | b'j' => {
                    let key = if op == b'h' {
                        take(&mut i, 1)?[0] as u64
                    } else {
                        u32::from_le_bytes(take(&mut i, 4)?.try_into().unwrap()) as u64
                    };
                    let v = self
                        .memo
                        .get(&key)
                        .ok_or_else(|| format!("pickle memo {key} missing"))?;
                    let (n, b) = weight(&v.0);
                    let v = v.clone();
                    self.charge(n, b)?;
                    self.stack.push(v);
                }
                b'Q' => {
                    let pid = self.pop()?;
                    let item = storage(pid)?;
                    self.push(item, 1)?;
                }
                b'R' | 0x81 => {
                    let (args, d) = self.pop_depth()?;
                    let callable = self.pop()?;
                    let v = self.reduce(callable, args)?;
                    // Counted as deep as its arguments (at least 1), a bound on what it holds.
                    self.push(v, d.max(1))?;
                }
                b'b' => {
                    // BUILD: an OrderedDict's or a tensor's extra state, ignored.
                    self.pop()?;
                }
                other => {
                    return Err(format!(
                        "pickle opcode {other:#04x} at byte {} is not supported in a tensor file",
                        i - 1
                    ))
                }
            }
        }
    }

    fn reduce(&mut self, callable: Obj, args: Obj) -> Result<Obj, String> {
        let Obj::Global(module, name) = callable else {
            return Err(format!("REDUCE of {callable:?}"));
        };
        let Obj::Tuple(a) = args else {
            return Err(format!("{module}.{name} called with {args:?}"));
        };
        match (module.as_str(), name.as_str()) {
            ("collections", "OrderedDict") if a.is_empty() => Ok(Obj::Dict(vec![])),
            ("torch._utils", "_rebuild_parameter") => a
                .into_iter()
                .next()
                .ok_or_else(|| "_rebuild_parameter without data".to_string()),
            ("torch._utils", "_rebuild_tensor_v2") | ("torch._utils", "_rebuild_tensor") => {
                let (Some(Obj::Storage { dtype, key }), Some(Obj::Int(offset))) =
                    (a.first(), a.get(1))
                else {
                    return Err(format!("{name} with arguments {a:?}"));
                };
                let shape = a
                    .get(2)
                    .ok_or("tensor without size")?
                    .as_usize_list("size")?;
                let stride = a
                    .get(3)
                    .ok_or("tensor without stride")?
                    .as_usize_list("stride")?;
                if shape.len() != stride.len() || *offset < 0 {
                    return Err(format!(
                        "tensor of size {shape:?}, stride {stride:?}, offset {offset}"
                    ));
                }
                let bytes = self
                    .data
                    .get(key.as_str())
                    .ok_or_else(|| format!("storage data/{key} is missing from the archive"))?;
                let values = gather(bytes, dtype, *offset as usize, &shape, &stride)
                    .map_err(|e| format!("storage data/{key}: {e}"))?;
                self.charge(0, values.len().saturating_mul(8))?;
                Ok(Obj::Tensor(PtTensor {
                    dtype,
                    shape,
                    values,
                }))
            }
            _ => Err(format!(
                "the file holds a {module}.{name} object; only tensors, numbers, strings and \
                 dicts are read"
            )),
        }
    }
}

fn check_depth(depth: usize) -> Result<(), String> {
    if depth > MAX_DEPTH {
        return Err(format!(
            "pickle too large or malformed: objects nested more than {MAX_DEPTH} deep"
        ));
    }
    Ok(())
}

/// Objects without their depths, and their greatest depth (0 if none).
fn unzip_depths(items: Vec<(Obj, usize)>) -> (Vec<Obj>, usize) {
    let depth = items.iter().map(|(_, d)| *d).max().unwrap_or(0);
    (items.into_iter().map(|(o, _)| o).collect(), depth)
}

/// `('storage', torch.<Dtype>Storage, key, location, numel)`.
fn storage(pid: Obj) -> Result<Obj, String> {
    let Obj::Tuple(t) = &pid else {
        return Err(format!("persistent id {pid:?} is not a storage tuple"));
    };
    let (Some(Obj::Str(kind)), Some(Obj::Global(_, ty)), Some(Obj::Str(key))) =
        (t.first(), t.get(1), t.get(2))
    else {
        return Err(format!("persistent id {pid:?} is not a storage tuple"));
    };
    if kind != "storage" {
        return Err(format!("persistent id of kind {kind:?}"));
    }
    let dtype = match ty.as_str() {
        "DoubleStorage" => "float64",
        "FloatStorage" => "float32",
        "HalfStorage" => "float16",
        "BFloat16Storage" => "bfloat16",
        other => {
            return Err(format!(
                "a {other} tensor; only float64/float32/float16/bfloat16 tensors are read"
            ))
        }
    };
    Ok(Obj::Storage {
        dtype,
        key: key.clone(),
    })
}

/// The elements of a strided view of a storage, row-major, as f64.
fn gather(
    bytes: &[u8],
    dtype: &str,
    offset: usize,
    shape: &[usize],
    stride: &[usize],
) -> Result<Vec<f64>, String> {
    let size = match dtype {
        "float64" => 8,
        "float32" => 4,
        _ => 2,
    };
    let numel = bytes.len() / size;
    let read = |e: usize| -> f64 {
        let b = &bytes[e * size..(e + 1) * size];
        match dtype {
            "float64" => f64::from_le_bytes(b.try_into().unwrap()),
            "float32" => f32::from_le_bytes(b.try_into().unwrap()) as f64,
            "float16" => f16_to_f32(u16::from_le_bytes([b[0], b[1]])) as f64,
            _ => bf16_to_f32(u16::from_le_bytes([b[0], b[1]])) as f64,
        }
    };
    let view = || format!("the view (offset {offset}, size {shape:?}, stride {stride:?})");
    // Checked throughout: a bogus size or stride must not wrap into a "valid" view.
    let count = shape
        .iter()
        .try_fold(1usize, |n, &d| n.checked_mul(d))
        .ok_or_else(|| format!("{}: its element count overflows", view()))?;
    if count == 0 {
        return Ok(vec![]);
    }
    // A view may repeat elements (stride 0) but never holds more than its storage: that
    // bounds what a file can make us allocate by the file's size.
    if count > numel {
        return Err(format!(
            "tensor view of {count} elements exceeds its storage of {numel}: {} is corrupt",
            view()
        ));
    }
    let last = shape
        .iter()
        .zip(stride)
        .try_fold(offset, |acc, (&n, &s)| {
            (n - 1).checked_mul(s)?.checked_add(acc)
        })
        .ok_or_else(|| format!("{}: its last element's index overflows", view()))?;
    if last >= numel {
        return Err(format!(
            "{} reaches element {last} of a storage of {numel}",
            view()
        ));
    }
    let mut out = Vec::with_capacity(count);
    let mut idx = vec![0usize; shape.len()];
    for _ in 0..count {
        let e = offset + idx.iter().zip(stride).map(|(&i, &s)| i * s).sum::<usize>();
        out.push(read(e));
        for d in (0..shape.len()).rev() {
            idx[d] += 1;
            if idx[d] < shape[d] {
                break;
            }
            idx[d] = 0;
        }
    }
    Ok(out)
}
