//! The scalar constraints of structured output ([`crate::json_schema`]): a string's `pattern`
//! as a DFA over its bytes, and a number's bounds (`minimum`, `maximum`, `exclusiveMinimum`,
//! `exclusiveMaximum`) checked on every prefix, so that a value being written can always still
//! end inside them.
//!
//! JSON Schema's `pattern` is an ECMA-262 regular expression that matches anywhere in the
//! string (it is not anchored; `^` and `$` anchor it). It is compiled here with Rust's regex
//! syntax (`regex-automata`) after rewriting what the two read differently (`\d`, `\w`, `\b`
//! are ASCII in ECMA-262, `.` leaves out every line terminator, classes do not nest:
//! [`ecma_to_rust`]); look-around and backreferences are refused by the compiler, and the
//! error names the pattern. Compiling walks the automaton once (liveness over predecessor
//! lists); with `minLength`/`maxLength` beside it, the exact numbers of characters a match
//! can still take from each state are tabulated ([`lengths`]), so a string never reaches a
//! point where no allowed length is left (a gap between the fewest and the most included).

use std::collections::HashMap;

use regex_automata::dfa::{dense, Automaton, StartKind};
use regex_automata::util::primitives::StateID;
use regex_automata::util::start;
use regex_automata::{Anchored, MatchKind};

/// DFA states a pattern may take before it is refused as too large.
const MAX_PATTERN_STATES: usize = 20_000;
/// Steps the length table of a pattern with lengths may take (node visits) before the pair is
/// refused as too costly to hold.
const MAX_LENGTH_WORK: usize = 40_000_000;

/// A byte's place in UTF-8 from `cont` continuation bytes due: the bytes due after it and
/// whether it starts a character; None if it cannot come here.
pub(crate) fn utf8_step(cont: u8, b: u8) -> Option<(u8, bool)> {
    match (cont, b) {
        (0, 0x00..=0x7f) => Some((0, true)),
        (0, 0xc2..=0xdf) => Some((1, true)),
        (0, 0xe0..=0xef) => Some((2, true)),
        (0, 0xf0..=0xf4) => Some((3, true)),
        (1..=3, 0x80..=0xbf) => Some((cont - 1, false)),
        _ => None,
    }
}

/// An ECMA-262 pattern in Rust's regex syntax where the two read the same text differently:
/// `\d`, `\w`, `\b` are ASCII in ECMA-262 (Unicode in Rust); `.` leaves out every line
/// terminator (`\r`, U+2028, U+2029 too); inside a class `\b` is a backspace, and `[`, `&&`,
/// `--`, `~~` are literal (Rust nests classes and has set operators there); `[^]` is any
/// character and `[]` none.
fn ecma_to_rust(pattern: &str) -> String {
    const DIGIT: &str = "0-9";
    const WORD: &str = "0-9A-Za-z_";
    let mut out = String::with_capacity(pattern.len() + 16);
    let mut chars = pattern.chars().peekable();
    let mut class = false;
    // The last character written inside a class (for `--`, `&&`, `~~`).
    let mut last: Option<char> = None;
    while let Some(c) = chars.next() {
        if c == '\\' {
            let Some(e) = chars.next() else {
                out.push('\\');
                break;
            };
            match (e, class) {
                ('d', false) => out.push_str(&format!("[{DIGIT}]")),
                ('D', false) => out.push_str(&format!("[^{DIGIT}]")),
                ('w', false) => out.push_str(&format!("[{WORD}]")),
                ('W', false) => out.push_str(&format!("[^{WORD}]")),
                ('b', false) => out.push_str("(?-u:\\b)"),
                ('B', false) => out.push_str("(?-u:\\B)"),
                ('d', true) => out.push_str(&format!("[{DIGIT}]")),
                ('D', true) => out.push_str(&format!("[^{DIGIT}]")),
                ('w', true) => out.push_str(&format!("[{WORD}]")),
                ('W', true) => out.push_str(&format!("[^{WORD}]")),
                ('b', true) => out.push_str("\\x08"),
                _ => {
                    out.push('\\');
                    out.push(e);
                }
            }
            last = None;
            continue;
        }
        if class {
            match c {
                ']' => class = false,
                '[' => out.push('\\'),
                '&' | '~' | '-' if last == Some(c) => out.push('\\'),
                _ => {}
            }
            out.push(c);
            last = Some(c);
            continue;
        }
        match c {
            '[' => {
                let negated = chars.peek() == Some(&'^');
                if negated {
                    chars.next();
                }
                if chars.peek() == Some(&']') {
                    chars.next();
                    out.push_str(if negated { "(?s:.)" } else { "[a&&b]" });
                    continue;
                }
                out.push_str(if negated { "[^" } else { "[" });
                class = true;
                last = None;
            }
            '.' => out.push_str("[^\\n\\r\\x{2028}\\x{2029}]"),
            _ => out.push(c),
        }
    }
    out
}

/// A compiled `pattern`: the DFA of `(?s:.)*(?:PATTERN)(?s:.)*` over a string's UTF-8 bytes
/// (unescaped), anchored at the string's start, the states from which a match at the string's
/// end is still reachable (a byte that leaves them is refused), and, with a string length
/// asked for (`minLength`/`maxLength`), the lengths a match can still take from each state.
pub(crate) struct Pattern {
    source: String,
    dfa: dense::DFA<Vec<u32>>,
    start: StateID,
    /// The number of each state reachable from the start.
    index: HashMap<StateID, u32>,
    live: Vec<bool>,
    min_len: usize,
    max_len: usize,
    /// Per node (state number × 4 + UTF-8 continuation bytes still due): the numbers of
    /// characters a match at the end can still take, as sorted inclusive runs; with no
    /// `maxLength` the last value (`minLength`) stands for "that many or more". None without
    /// lengths.
    ways: Option<Vec<Vec<(u32, u32)>>>,
}

impl std::fmt::Debug for Pattern {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Pattern({:?}, {} states)", self.source, self.live.len())
    }
}

impl Pattern {
    /// `at`: where the pattern is in the schema, for the error; `min_len`/`max_len`: the
    /// string's lengths in characters (0 and `usize::MAX` when the schema gives none).
    pub(crate) fn compile(
        pattern: &str,
        at: &str,
        min_len: usize,
        max_len: usize,
    ) -> Result<Pattern, String> {
        let dfa = dense::Builder::new()
            .configure(
                dense::Config::new()
                    .match_kind(MatchKind::All)
                    .start_kind(StartKind::Anchored)
                    .dfa_size_limit(Some(16 << 20))
                    .determinize_size_limit(Some(16 << 20)),
            )
            .build(&format!("(?s:.)*(?:{})(?s:.)*", ecma_to_rust(pattern)))
            .map_err(|e| {
                format!(
                    "{at}: the pattern {pattern:?} cannot be enforced ({e}); structured output \
                     takes the regular expressions common to ECMA-262 and Rust's regex syntax, \
                     without look-around or backreferences"
                )
            })?;
        let start = dfa
            .start_state(&start::Config::new().anchored(Anchored::Yes))
            .map_err(|e| format!("{at}: the pattern {pattern:?}: {e}"))?;
        // Every state reachable from the start, and its successors as runs of bytes.
        let mut index: HashMap<StateID, u32> = HashMap::from([(start, 0)]);
        let mut states = vec![start];
        let mut runs: Vec<Vec<(u8, u8, u32)>> = Vec::new();
        let mut i = 0;
        while i < states.len() {
            let s = states[i];
            let mut out: Vec<(u8, u8, u32)> = Vec::new();
            for b in 0..=255u8 {
                let t = dfa.next_state(s, b);
                if dfa.is_dead_state(t) || dfa.is_quit_state(t) {
                    continue;
                }
                let j = *index.entry(t).or_insert_with(|| {
                    states.push(t);
                    (states.len() - 1) as u32
                });
                match out.last_mut() {
                    Some((_, hi, k)) if *k == j && *hi as usize + 1 == b as usize => *hi = b,
                    _ => out.push((b, b, j)),
                }
            }
            runs.push(out);
            if states.len() > MAX_PATTERN_STATES {
                return Err(format!(
                    "{at}: the pattern {pattern:?} needs more than {MAX_PATTERN_STATES} \
                     automaton states; simplify it"
                ));
            }
            i += 1;
        }
        // Live: a match at the end is reachable (backwards from the accepting states, over
        // predecessor lists).
        let mut preds: Vec<Vec<u32>> = vec![Vec::new(); states.len()];
        for (k, out) in runs.iter().enumerate() {
            for &(_, _, j) in out {
                if preds[j as usize].last() != Some(&(k as u32)) {
                    preds[j as usize].push(k as u32);
                }
            }
        }
        let mut live: Vec<bool> = states
            .iter()
            .map(|&s| dfa.is_match_state(dfa.next_eoi_state(s)))
            .collect();
        let mut work: Vec<u32> = (0..states.len() as u32)
            .filter(|&k| live[k as usize])
            .collect();
        while let Some(j) = work.pop() {
            for &k in &preds[j as usize] {
                if !live[k as usize] {
                    live[k as usize] = true;
                    work.push(k);
                }
            }
        }
        if !live[0] {
            return Err(format!("{at}: the pattern {pattern:?} matches no string"));
        }
        let accepting: Vec<bool> = states
            .iter()
            .map(|&s| dfa.is_match_state(dfa.next_eoi_state(s)))
            .collect();
        let ways = if min_len > 0 || max_len < usize::MAX {
            let ways = lengths(&runs, &live, &accepting, min_len, max_len).ok_or_else(|| {
                format!(
                    "{at}: the pattern {pattern:?} with minLength {min_len} and maxLength \
                     {} is too costly to hold (the lengths its matches take would need more \
                     than {MAX_LENGTH_WORK} steps to tabulate); lower maxLength or simplify \
                     the pattern",
                    if max_len == usize::MAX {
                        "unset".to_string()
                    } else {
                        max_len.to_string()
                    }
                )
            })?;
            Some(ways)
        } else {
            None
        };
        let p = Pattern {
            source: pattern.to_string(),
            dfa,
            start,
            index,
            live,
            min_len,
            max_len,
            ways,
        };
        if !p.fits(start, 0, 0) {
            return Err(format!(
                "{at}: the pattern {pattern:?} matches no string of minLength {min_len} to \
                 maxLength {max_len}"
            ));
        }
        Ok(p)
    }

    /// From state `s` with `cont` continuation bytes due and `chars` characters written, a
    /// match can still end with a length in `[min_len, max_len]` (always true without lengths).
    pub(crate) fn fits(&self, s: StateID, cont: u8, chars: usize) -> bool {
        let Some(ways) = &self.ways else {
            return true;
        };
        let Some(&i) = self.index.get(&s) else {
            return false;
        };
        if chars > self.max_len {
            return false;
        }
        let need = self.min_len.saturating_sub(chars) as u64;
        let room = match self.max_len {
            usize::MAX => u64::MAX,
            m => (m - chars) as u64,
        };
        ways[i as usize * 4 + cont as usize]
            .iter()
            .any(|&(a, b)| a as u64 <= room && b as u64 >= need)
    }

    pub(crate) fn start(&self) -> StateID {
        self.start
    }

    /// The state after the string's byte `b`, None if no match could follow.
    pub(crate) fn next(&self, s: StateID, b: u8) -> Option<StateID> {
        let t = self.dfa.next_state(s, b);
        self.index
            .get(&t)
            .is_some_and(|&i| self.live[i as usize])
            .then_some(t)
    }

    /// The string may end in state `s`.
    pub(crate) fn accepts_end(&self, s: StateID) -> bool {
        self.dfa.is_match_state(self.dfa.next_eoi_state(s))
    }

    /// The whole of `text` matches (lengths aside).
    pub(crate) fn matches(&self, text: &[u8]) -> bool {
        text.iter()
            .try_fold(self.start, |st, &b| self.next(st, b))
            .is_some_and(|st| self.accepts_end(st))
    }

    /// Some string matches both patterns (a search over pairs of states; past `budget` pairs
    /// the answer is yes, as if they met).
    pub(crate) fn overlaps(&self, other: &Pattern, budget: usize) -> bool {
        let mut seen = std::collections::HashSet::new();
        let mut todo = vec![(self.start, other.start)];
        seen.insert((self.start, other.start));
        while let Some((a, b)) = todo.pop() {
            if self.accepts_end(a) && other.accepts_end(b) {
                return true;
            }
            for c in 0..=255u8 {
                if let (Some(x), Some(y)) = (self.next(a, c), other.next(b, c)) {
                    if seen.insert((x, y)) {
                        if seen.len() > budget {
                            return true;
                        }
                        todo.push((x, y));
                    }
                }
            }
        }
        false
    }
}

/// The numbers of characters a match can still take from each node (state × 4 + continuation
/// bytes due), up to `max_len` (or `min_len`, standing for "that many or more", without a
/// maximum), as sorted runs; None when that costs more than [`MAX_LENGTH_WORK`] steps.
///
/// A character costs 1 at its first byte, continuation bytes 0. F(k), the nodes with a way of
/// exactly k characters to a match at the end, is built from F(k-1) over predecessor lists:
/// the lead-byte predecessors of F(k-1), then those reaching them by continuation bytes.
/// Once F(k) = F(k-1) it stays so for every later k, and the runs are closed at the cap.
fn lengths(
    runs: &[Vec<(u8, u8, u32)>],
    live: &[bool],
    accepting: &[bool],
    min_len: usize,
    max_len: usize,
) -> Option<Vec<Vec<(u32, u32)>>> {
    let nodes = runs.len() * 4;
    let open = max_len == usize::MAX;
    let cap = if open { min_len } else { max_len };
    let cap = u32::try_from(cap).ok()?;
    // Predecessors over a lead byte (from continuation 0, cost 1) and over a continuation
    // byte (cost 0).
    const LEADS: [(u8, u8, u8); 4] = [
        (0x00, 0x7f, 0),
        (0xc2, 0xdf, 1),
        (0xe0, 0xef, 2),
        (0xf0, 0xf4, 3),
    ];
    let mut pred1: Vec<Vec<u32>> = vec![Vec::new(); nodes];
    let mut pred0: Vec<Vec<u32>> = vec![Vec::new(); nodes];
    for (i, out) in runs.iter().enumerate() {
        for &(lo, hi, j) in out {
            let j = j as usize;
            if !live[j] {
                continue;
            }
            for (a, b, c) in LEADS {
                if lo.max(a) <= hi.min(b) {
                    pred1[j * 4 + c as usize].push(i as u32 * 4);
                }
            }
            if lo.max(0x80) <= hi.min(0xbf) {
                for c in 1..4 {
                    pred0[j * 4 + c - 1].push((i * 4 + c) as u32);
                }
            }
        }
    }
    for p in pred1.iter_mut().chain(pred0.iter_mut()) {
        p.sort_unstable();
        p.dedup();
    }
    let mut work = 0usize;
    let mut ways: Vec<Vec<(u32, u32)>> = vec![Vec::new(); nodes];
    // The k at which a node last joined a frontier.
    let mut mark = vec![u32::MAX; nodes];
    let mut frontier: Vec<u32> = Vec::new();
    for (i, &a) in accepting.iter().enumerate() {
        if a && live[i] {
            frontier.push(i as u32 * 4);
            mark[i * 4] = 0;
        }
    }
    // Adds the continuation-byte predecessors of the frontier (and theirs), then returns the
    // work done.
    let close = |frontier: &mut Vec<u32>, mark: &mut [u32], k: u32, also_leads: bool| {
        let mut done = 0usize;
        let mut i = 0;
        while i < frontier.len() {
            let n = frontier[i] as usize;
            let lead: &[u32] = if also_leads { &pred1[n] } else { &[] };
            for &p in pred0[n].iter().chain(lead) {
                done += 1;
                if mark[p as usize] != k {
                    mark[p as usize] = k;
                    frontier.push(p);
                }
            }
            i += 1;
        }
        done
    };
    work += close(&mut frontier, &mut mark, 0, open && cap == 0);
    let record = |ways: &mut [Vec<(u32, u32)>], frontier: &[u32], k: u32, to: u32| {
        for &n in frontier {
            let w = &mut ways[n as usize];
            match w.last_mut() {
                Some((_, end)) if *end + 1 == k => *end = to,
                _ => w.push((k, to)),
            }
        }
    };
    frontier.sort_unstable();
    record(&mut ways, &frontier, 0, 0);
    for k in 1..=cap {
        if frontier.is_empty() {
            break;
        }
        let mut next: Vec<u32> = Vec::new();
        for &n in &frontier {
            for &p in &pred1[n as usize] {
                work += 1;
                if mark[p as usize] != k {
                    mark[p as usize] = k;
                    next.push(p);
                }
            }
        }
        // With no maximum the cap stands for "that many or more": every way on from there.
        work += close(&mut next, &mut mark, k, open && k == cap);
        next.sort_unstable();
        if work > MAX_LENGTH_WORK {
            return None;
        }
        if next == frontier {
            // Stationary: the same nodes at every later k.
            record(&mut ways, &next, k, cap);
            break;
        }
        record(&mut ways, &next, k, k);
        frontier = next;
    }
    Some(ways)
}

/// Integer digits of a number written under bounds or a step (below 2^53, where floats are
/// exact integers).
pub(crate) const MAX_INT_DIGITS: usize = 15;

/// The magnitudes numbers under bounds or a step are written below (10^15).
pub(crate) const MAX_WRITTEN: f64 = 1e15;

/// A number's bounds: `lo` ≤ (or <, `lo_excl`) the value ≤ (or <, `hi_excl`) `hi`; infinite
/// where the schema gives none.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Bounds {
    pub lo: f64,
    pub lo_excl: bool,
    pub hi: f64,
    pub hi_excl: bool,
    /// `multipleOf` (0: none): the value is a multiple of it. A whole step makes the value an
    /// integer; a fractional one is `step_units / 10^step_digits` exactly (its decimal text),
    /// and its multiples are written with at most `step_digits` fraction digits.
    pub step: f64,
    pub step_units: u64,
    pub step_digits: u32,
}

impl Bounds {
    pub(crate) const NONE: Bounds = Bounds {
        lo: f64::NEG_INFINITY,
        lo_excl: false,
        hi: f64::INFINITY,
        hi_excl: false,
        step: 0.0,
        step_units: 0,
        step_digits: 0,
    };

    /// A whole `multipleOf` step (`m` ≥ 1, an integer).
    pub(crate) fn with_whole_step(self, m: f64) -> Bounds {
        Bounds {
            step: m,
            step_units: m as u64,
            step_digits: 0,
            ..self
        }
    }

    /// The step is a fraction (0.01, 2.5, ...).
    pub(crate) fn fractional_step(&self) -> bool {
        self.step_digits > 0
    }

    /// A number value (its JSON text) is inside the bounds, on a multiple of the step (exactly
    /// from its digits where it has no exponent).
    pub(crate) fn holds_number(&self, text: &str) -> bool {
        // (Integer digits beyond those written under bounds: an enum's value, compared as a
        // double.)
        let int_digits = text
            .trim_start_matches('-')
            .bytes()
            .take_while(u8::is_ascii_digit)
            .count();
        if text.bytes().any(|c| c == b'e' || c == b'E') || int_digits > self.max_int_digits() {
            let v: f64 = text.parse().unwrap_or(f64::NAN);
            return if self.fractional_step() {
                let q = v * 10f64.powi(self.step_digits as i32) / self.step_units as f64;
                (q - q.round()).abs() < 1e-9 && Bounds { step: 0.0, ..*self }.holds(v)
            } else {
                self.holds(v)
            };
        }
        self.viable(text.as_bytes(), false, true)
    }

    pub(crate) fn is_none(&self) -> bool {
        *self == Bounds::NONE
    }

    pub(crate) fn holds(&self, v: f64) -> bool {
        (if self.lo_excl {
            v > self.lo
        } else {
            v >= self.lo
        }) && (if self.hi_excl {
            v < self.hi
        } else {
            v <= self.hi
        }) && (self.step == 0.0 || v % self.step == 0.0)
    }

    /// Some number is inside the bounds (on a multiple of a fractional step).
    pub(crate) fn has_value(&self) -> bool {
        let top = 10f64.powi(self.max_int_digits() as i32);
        self.meets(-top, top, true)
    }

    /// Some number of any size is inside the bounds (on a multiple of a fractional step): where
    /// [`Bounds::has_value`] is false but this true, the bounds' values all lie beyond what is
    /// written.
    pub(crate) fn has_value_anywhere(&self) -> bool {
        self.meets(f64::NEG_INFINITY, f64::INFINITY, false)
    }

    /// Integer digits written under these bounds: MAX_INT_DIGITS, less a decimal step's
    /// decimals (the value scaled by 10^decimals stays below 2^53).
    pub(crate) fn max_int_digits(&self) -> usize {
        MAX_INT_DIGITS.saturating_sub(self.step_digits as usize)
    }

    /// Some value of `[a, b)` (`b_open`) or `[a, b]` is inside the bounds.
    fn meets(&self, a: f64, b: f64, b_open: bool) -> bool {
        if a > b || (a == b && b_open) {
            return false;
        }
        // The interval's lowest point inside [lo, ...) and its highest inside (..., hi].
        let above_lo = if self.lo_excl || b_open {
            b > self.lo
        } else {
            b >= self.lo
        };
        let below_hi = if self.hi_excl {
            a < self.hi
        } else {
            a <= self.hi
        };
        if !(above_lo && below_hi) {
            return false;
        }
        if !self.fractional_step() {
            return true;
        }
        // Some multiple of the step in the interval and the bounds: the ends, scaled by
        // 10^step_digits (exact for the decimal prefixes written here), and the first multiple
        // of step_units from the low end.
        let (lo, lo_strict) = match a.partial_cmp(&self.lo) {
            Some(std::cmp::Ordering::Greater) => (a, false),
            Some(std::cmp::Ordering::Equal) => (a, self.lo_excl),
            _ => (self.lo, self.lo_excl),
        };
        let (hi, hi_strict) = match b.partial_cmp(&self.hi) {
            Some(std::cmp::Ordering::Less) => (b, b_open),
            Some(std::cmp::Ordering::Equal) => (b, b_open || self.hi_excl),
            _ => (self.hi, self.hi_excl),
        };
        if lo == f64::NEG_INFINITY || hi == f64::INFINITY {
            return true;
        }
        let scale = 10f64.powi(self.step_digits as i32);
        let snap = |x: f64| {
            let r = x.round();
            if (x - r).abs() <= 1e-7 * x.abs().max(1.0) {
                r
            } else {
                x
            }
        };
        let (l, h) = (snap(lo * scale), snap(hi * scale));
        let p = self.step_units as f64;
        let mut m = (l / p).ceil();
        if lo_strict && m * p == l {
            m += 1.0;
        }
        let x = m * p;
        x < h || (x == h && !hi_strict)
    }

    /// Some integer of `[a, b]` (integral ends) is inside the bounds (a multiple of `step`
    /// when there is one).
    pub(crate) fn meets_int(&self, a: f64, b: f64) -> bool {
        let lo = if self.lo_excl {
            self.lo.floor() + 1.0
        } else {
            self.lo.ceil()
        };
        let hi = if self.hi_excl {
            self.hi.ceil() - 1.0
        } else {
            self.hi.floor()
        };
        let (a, b) = (a.max(lo), b.min(hi));
        if self.step > 0.0 {
            (a / self.step).ceil() * self.step <= b
        } else {
            a <= b
        }
    }

    /// A number written so far (`text`: JSON number bytes without exponent) can still end
    /// inside the bounds; `integer`: only integers may follow. `complete`: it ends here, so
    /// its own value must be inside.
    pub(crate) fn viable(&self, text: &[u8], integer: bool, complete: bool) -> bool {
        let neg = text.first() == Some(&b'-');
        let body = if neg { &text[1..] } else { text };
        // At most MAX_INT_DIGITS digits before the point: past them a float no longer tells
        // one integer from the next, and the intervals below would close up.
        let int_digits = body.iter().take_while(|c| c.is_ascii_digit()).count();
        let max_int = self.max_int_digits();
        if int_digits > max_int {
            return false;
        }
        if complete {
            let v = std::str::from_utf8(text)
                .ok()
                .and_then(|t| t.parse::<f64>().ok())
                .unwrap_or(f64::NAN);
            if self.step > 0.0 {
                // The remainder from the digits themselves (a float loses them past 2^53), the
                // value scaled by 10^step_digits: at most that many fraction digits.
                let step = self.step_units.max(1) as u128;
                let (int_part, frac) = match body.iter().position(|&c| c == b'.') {
                    Some(d) => (&body[..d], &body[d + 1..]),
                    None => (body, &[][..]),
                };
                if frac.len() > self.step_digits as usize {
                    return false;
                }
                let pad = self.step_digits as usize - frac.len();
                let digits = int_part
                    .iter()
                    .chain(frac)
                    .copied()
                    .chain(std::iter::repeat_n(b'0', pad));
                let mut rem = Some(0u128);
                for c in digits {
                    rem = rem.and_then(|r| {
                        c.is_ascii_digit()
                            .then(|| (r * 10 + (c - b'0') as u128) % step)
                    });
                }
                let unstepped = Bounds { step: 0.0, ..*self };
                return rem == Some(0) && unstepped.holds(v);
            }
            return self.holds(v);
        }
        // The magnitudes reachable from `body` as intervals [a, b) (b_open) or [a, b].
        let (int_part, frac) = match body.iter().position(|&c| c == b'.') {
            Some(d) => (&body[..d], Some(&body[d + 1..])),
            None => (body, None),
        };
        // A fractional step's multiples have at most its digits after the point.
        if frac.is_some_and(|f| f.len() > self.step_digits as usize) && self.fractional_step() {
            return false;
        }
        // Check one magnitude interval, mapped through the sign.
        let check = |a: f64, b: f64, b_open: bool| -> bool {
            if integer {
                let (lo, hi) = if b_open { (a, b - 1.0) } else { (a, b) };
                if neg {
                    self.meets_int(-hi, -lo)
                } else {
                    self.meets_int(lo, hi)
                }
            } else if neg {
                // -[a, b) = (-b, -a]: some value there inside the bounds.
                let flipped = Bounds {
                    lo: -self.hi,
                    lo_excl: self.hi_excl,
                    hi: -self.lo,
                    hi_excl: self.lo_excl,
                    ..*self
                };
                flipped.meets(a, b, b_open)
            } else {
                self.meets(a, b, b_open)
            }
        };
        match frac {
            Some(f) => {
                // v ≤ value < v + 10^-k, the upper end read from its own digits (0.2 + 0.1 in
                // floats is above 0.3, which would let "0.2" through under a minimum of 0.3).
                let v = value_of(int_part, f);
                check(v, value_above(int_part, f), true)
            }
            None if int_part.is_empty() => {
                // "-" alone: any magnitude written.
                check(0.0, 10f64.powi(max_int as i32), true)
            }
            None if int_part == b"0" => {
                if integer {
                    check(0.0, 0.0, false)
                } else {
                    check(0.0, 1.0, true)
                }
            }
            None => {
                let i = value_of(int_part, b"");
                // More integer digits: [i·10^j, (i+1)·10^j) for j ≥ 0 (a fraction may follow).
                let mut scale = 1.0f64;
                // Up to MAX_INT_DIGITS digits in all.
                for _ in 0..=max_int - int_digits {
                    let a = i * scale;
                    if !a.is_finite() {
                        break;
                    }
                    if check(a, (i + 1.0) * scale, true) {
                        return true;
                    }
                    scale *= 10.0;
                }
                false
            }
        }
    }
}

/// `int.frac` plus one unit of its last digit, as a magnitude (read from the digits, so as
/// exact as a float can be).
fn value_above(int: &[u8], frac: &[u8]) -> f64 {
    let mut digits: Vec<u8> = int.iter().chain(frac).copied().collect();
    let mut i = digits.len();
    loop {
        if i == 0 {
            digits.insert(0, b'1');
            break;
        }
        i -= 1;
        if digits[i] == b'9' {
            digits[i] = b'0';
        } else {
            digits[i] += 1;
            break;
        }
    }
    let point = digits.len() - frac.len();
    value_of(&digits[..point], &digits[point..])
}

/// `int.frac` as a magnitude.
fn value_of(int: &[u8], frac: &[u8]) -> f64 {
    let mut t = String::from_utf8_lossy(int).into_owned();
    if t.is_empty() {
        t.push('0');
    }
    if !frac.is_empty() {
        t.push('.');
        t.push_str(&String::from_utf8_lossy(frac));
    }
    t.parse().unwrap_or(f64::NAN)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn feed(p: &Pattern, s: &str) -> Option<StateID> {
        s.bytes().try_fold(p.start(), |st, b| p.next(st, b))
    }

    #[test]
    fn patterns_match_anywhere_and_refuse_dead_prefixes() {
        let p = Pattern::compile("^[a-z]+-[0-9]{3}$", "#", 0, usize::MAX).unwrap();
        let st = feed(&p, "abc-12").unwrap();
        assert!(!p.accepts_end(st));
        assert!(p.accepts_end(feed(&p, "abc-123").unwrap()));
        assert!(feed(&p, "abc-1234").is_none());
        assert!(feed(&p, "1").is_none());
        // Unanchored: a match anywhere.
        let p = Pattern::compile("cat", "#", 0, usize::MAX).unwrap();
        assert!(!p.accepts_end(feed(&p, "a ca").unwrap()));
        assert!(p.accepts_end(feed(&p, "a cat sat").unwrap()));
        // Multi-byte UTF-8, byte by byte.
        let p = Pattern::compile("^é+$", "#", 0, usize::MAX).unwrap();
        assert!(p.accepts_end(feed(&p, "éé").unwrap()));
        assert!(feed(&p, "e").is_none());
        // Refused with the pattern named.
        let e = Pattern::compile("(?=a)b", "#/properties/x", 0, usize::MAX).unwrap_err();
        assert!(e.contains("#/properties/x") && e.contains("(?=a)b"), "{e}");
        let e = Pattern::compile("^a$b", "#", 0, usize::MAX).unwrap_err();
        assert!(e.contains("matches no string"), "{e}");
    }

    #[test]
    fn bounds_keep_every_prefix_completable() {
        let b = Bounds {
            lo: 10.0,
            lo_excl: false,
            hi: 250.0,
            hi_excl: false,
            ..Bounds::NONE
        };
        let ok = |t: &str, int: bool| b.viable(t.as_bytes(), int, false);
        let end = |t: &str| b.viable(t.as_bytes(), true, true);
        assert!(ok("1", true)); // 10..19, 100..199
        assert!(ok("2", true));
        assert!(ok("25", true)); // 25, 250
        assert!(ok("3", true)); // 30..39
        assert!(!ok("0", true));
        assert!(!ok("-", true));
        assert!(ok("26", true)); // 26 itself
        assert!(!ok("260", true));
        assert!(ok("250", true));
        assert!(!ok("2500", true));
        assert!(end("10") && end("250") && !end("9") && !end("251"));
        // Fractions: 250.0 but not 250.5.
        assert!(ok("250.", false) && ok("250.0", false) && !ok("250.5", false));
        assert!(!ok("9.", false));
        // Exclusive bounds and negatives.
        let n = Bounds {
            lo: -5.0,
            lo_excl: true,
            hi: 0.0,
            hi_excl: true,
            ..Bounds::NONE
        };
        let ok = |t: &str, int: bool| n.viable(t.as_bytes(), int, false);
        assert!(ok("-", true) && ok("-4", true) && !ok("-5", true) && !ok("0", true));
        assert!(ok("-4.", false) && ok("-0.", false) && ok("-0.5", false));
        assert!(!n.viable(b"-5", false, true) && n.viable(b"-4.9", false, true));
        assert!(!ok("-5.", false));
        assert!(ok("-4.99", false));
    }
}
