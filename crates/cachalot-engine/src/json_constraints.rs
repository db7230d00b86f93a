//! The scalar constraints of structured output ([`crate::json_schema`]): a string's `pattern`
//! as a DFA over its bytes, and a number's bounds (`minimum`, `maximum`, `exclusiveMinimum`,
//! `exclusiveMaximum`) checked on every prefix, so that a value being written can always still
//! end inside them.
//!
//! JSON Schema's `pattern` is an ECMA-262 regular expression that matches anywhere in the
//! string (it is not anchored; `^` and `$` anchor it). It is compiled here with Rust's regex
//! syntax (`regex-automata`), which agrees with ECMA-262 on the common subset (classes, `\d`,
//! `\w`, `\s`, quantifiers, groups, alternation, anchors); look-around and backreferences are
//! refused by the compiler, and the error names the pattern.

use std::collections::HashMap;

use regex_automata::dfa::{dense, Automaton, StartKind};
use regex_automata::util::primitives::StateID;
use regex_automata::util::start;
use regex_automata::{Anchored, MatchKind};

/// DFA states a pattern may take before it is refused as too large.
const MAX_PATTERN_STATES: usize = 20_000;
/// Patterns up to this many states get their distances in characters measured (for lengths).
const MAX_MEASURED_STATES: usize = 2_000;

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

/// For every (state, continuation bytes due) pair: the fewest and most characters to a match
/// at the end (characters cost 1 at their first byte). Pairs from which no match is reachable
/// are left out.
fn char_distances(
    dfa: &dense::DFA<Vec<u32>>,
    states: &[StateID],
) -> HashMap<(StateID, u8), (u32, u32)> {
    let index: HashMap<StateID, usize> = states.iter().enumerate().map(|(i, &s)| (s, i)).collect();
    let nodes = states.len() * 4;
    let id = |s: usize, c: u8| s * 4 + c as usize;
    // Edges (to, cost) of each node.
    let mut edges: Vec<Vec<(usize, u32)>> = vec![Vec::new(); nodes];
    for (i, &s) in states.iter().enumerate() {
        for c in 0..4u8 {
            for b in 0..=255u8 {
                let Some((c2, starts)) = utf8_step(c, b) else {
                    continue;
                };
                let t = dfa.next_state(s, b);
                if let Some(&j) = index.get(&t) {
                    edges[id(i, c)].push((id(j, c2), starts as u32));
                }
            }
        }
    }
    let accept: Vec<bool> = (0..nodes)
        .map(|n| n % 4 == 0 && dfa.is_match_state(dfa.next_eoi_state(states[n / 4])))
        .collect();
    // Fewest: Bellman-Ford style relaxation over 0/1 costs (few nodes).
    let mut min = vec![u32::MAX; nodes];
    for (n, &a) in accept.iter().enumerate() {
        if a {
            min[n] = 0;
        }
    }
    let mut changed = true;
    while changed {
        changed = false;
        for n in 0..nodes {
            for &(t, w) in &edges[n] {
                if min[t] != u32::MAX && min[t] + w < min[n] {
                    min[n] = min[t] + w;
                    changed = true;
                }
            }
        }
    }
    // Most: unbounded where a cycle through a character lies on a way to a match; else the
    // longest way. Over the nodes that can reach a match, by strongly connected components
    // (Kosaraju): a component with an inner character edge is such a cycle.
    let useful = |n: usize| min[n] != u32::MAX;
    let mut order = Vec::with_capacity(nodes);
    let mut visited = vec![false; nodes];
    for root in (0..nodes).filter(|&n| useful(n)) {
        if visited[root] {
            continue;
        }
        visited[root] = true;
        let mut stack = vec![(root, 0usize)];
        while let Some(&mut (n, ref mut i)) = stack.last_mut() {
            if let Some(&(t, _)) = edges[n].get(*i) {
                *i += 1;
                if useful(t) && !visited[t] {
                    visited[t] = true;
                    stack.push((t, 0));
                }
            } else {
                order.push(n);
                stack.pop();
            }
        }
    }
    let mut back: Vec<Vec<usize>> = vec![Vec::new(); nodes];
    for n in (0..nodes).filter(|&n| useful(n)) {
        for &(t, _) in &edges[n] {
            if useful(t) {
                back[t].push(n);
            }
        }
    }
    let mut comp = vec![usize::MAX; nodes];
    let mut comps = 0;
    for &root in order.iter().rev() {
        if comp[root] != usize::MAX {
            continue;
        }
        comp[root] = comps;
        let mut stack = vec![root];
        while let Some(n) = stack.pop() {
            for &f in &back[n] {
                if comp[f] == usize::MAX {
                    comp[f] = comps;
                    stack.push(f);
                }
            }
        }
        comps += 1;
    }
    // Components come out sources first: the longest way to a match is settled from the last.
    let mut members: Vec<Vec<usize>> = vec![Vec::new(); comps];
    for n in (0..nodes).filter(|&n| useful(n)) {
        members[comp[n]].push(n);
    }
    let mut max = vec![0u32; nodes];
    for c in (0..comps).rev() {
        let cyclic = members[c].iter().any(|&n| {
            edges[n]
                .iter()
                .any(|&(t, w)| w == 1 && useful(t) && comp[t] == c)
        });
        // Within a component without a character cycle, ways cost nothing (continuation
        // bytes only): every member shares the best way out.
        let mut best = 0u32;
        for &n in &members[c] {
            for &(t, w) in &edges[n] {
                if useful(t) && comp[t] != c {
                    best = best.max(max[t].saturating_add(w));
                }
            }
        }
        for &n in &members[c] {
            max[n] = if cyclic { u32::MAX } else { best };
        }
    }
    (0..nodes)
        .filter(|&n| min[n] != u32::MAX)
        .map(|n| ((states[n / 4], (n % 4) as u8), (min[n], max[n])))
        .collect()
}

/// A compiled `pattern`: the DFA of `(?s:.)*(?:PATTERN)(?s:.)*` over a string's UTF-8 bytes
/// (unescaped), anchored at the string's start, and the states from which a match at the
/// string's end is still reachable (a byte that leaves them is refused).
pub(crate) struct Pattern {
    source: String,
    dfa: dense::DFA<Vec<u32>>,
    start: StateID,
    live: HashMap<StateID, bool>,
    /// Per state and UTF-8 continuation bytes still due (0-3): the fewest and the most
    /// characters a match at the end still needs (`u32::MAX`: unbounded); empty when the
    /// automaton is too large to measure (lengths are then checked at the end only).
    reach: HashMap<(StateID, u8), (u32, u32)>,
}

impl std::fmt::Debug for Pattern {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Pattern({:?}, {} states)", self.source, self.live.len())
    }
}

impl Pattern {
    /// `at`: where the pattern is in the schema, for the error.
    pub(crate) fn compile(pattern: &str, at: &str) -> Result<Pattern, String> {
        let dfa = dense::Builder::new()
            .configure(
                dense::Config::new()
                    .match_kind(MatchKind::All)
                    .start_kind(StartKind::Anchored)
                    .dfa_size_limit(Some(16 << 20))
                    .determinize_size_limit(Some(16 << 20)),
            )
            .build(&format!("(?s:.)*(?:{pattern})(?s:.)*"))
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
        // Every state reachable from the start, and its successors.
        let mut index: HashMap<StateID, usize> = HashMap::from([(start, 0)]);
        let mut states = vec![start];
        let mut edges: Vec<Vec<usize>> = Vec::new();
        let mut i = 0;
        while i < states.len() {
            let s = states[i];
            let mut next = Vec::new();
            for b in 0..=255u8 {
                let t = dfa.next_state(s, b);
                if dfa.is_dead_state(t) || dfa.is_quit_state(t) {
                    continue;
                }
                let j = *index.entry(t).or_insert_with(|| {
                    states.push(t);
                    states.len() - 1
                });
                next.push(j);
            }
            edges.push(next);
            if states.len() > MAX_PATTERN_STATES {
                return Err(format!(
                    "{at}: the pattern {pattern:?} needs more than {MAX_PATTERN_STATES} \
                     automaton states; simplify it"
                ));
            }
            i += 1;
        }
        // Live: a match at the end is reachable (reverse reachability from the accepting ones).
        let mut live: Vec<bool> = states
            .iter()
            .map(|&s| dfa.is_match_state(dfa.next_eoi_state(s)))
            .collect();
        let mut changed = true;
        while changed {
            changed = false;
            for (k, next) in edges.iter().enumerate() {
                if !live[k] && next.iter().any(|&j| live[j]) {
                    live[k] = true;
                    changed = true;
                }
            }
        }
        if !live[0] {
            return Err(format!("{at}: the pattern {pattern:?} matches no string"));
        }
        let reach = if states.len() <= MAX_MEASURED_STATES {
            char_distances(&dfa, &states)
        } else {
            HashMap::new()
        };
        let live = states.iter().zip(live).map(|(&s, l)| (s, l)).collect();
        Ok(Pattern {
            source: pattern.to_string(),
            dfa,
            start,
            live,
            reach,
        })
    }

    /// Characters a match still needs from `s` with `cont` continuation bytes due: (fewest,
    /// most); None when not measured.
    pub(crate) fn reach(&self, s: StateID, cont: u8) -> Option<(u32, u32)> {
        self.reach.get(&(s, cont)).copied()
    }

    /// From state `s` with `cont` continuation bytes due and `chars` characters written, a
    /// match can still end with a length in `[min_len, max_len]` (when measured; else true).
    pub(crate) fn fits(
        &self,
        s: StateID,
        cont: u8,
        chars: usize,
        min_len: usize,
        max_len: usize,
    ) -> bool {
        if self.reach.is_empty() {
            return true;
        }
        match self.reach(s, cont) {
            Some((fewest, most)) => {
                let room = max_len.saturating_sub(chars);
                let need = min_len.saturating_sub(chars);
                (fewest as usize) <= room && (most == u32::MAX || most as usize >= need)
            }
            None => false,
        }
    }

    pub(crate) fn start(&self) -> StateID {
        self.start
    }

    /// The state after the string's byte `b`, None if no match could follow.
    pub(crate) fn next(&self, s: StateID, b: u8) -> Option<StateID> {
        let t = self.dfa.next_state(s, b);
        (self.live.get(&t) == Some(&true)).then_some(t)
    }

    /// The string may end in state `s`.
    pub(crate) fn accepts_end(&self, s: StateID) -> bool {
        self.dfa.is_match_state(self.dfa.next_eoi_state(s))
    }
}

/// A number's bounds: `lo` ≤ (or <, `lo_excl`) the value ≤ (or <, `hi_excl`) `hi`; infinite
/// where the schema gives none.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Bounds {
    pub lo: f64,
    pub lo_excl: bool,
    pub hi: f64,
    pub hi_excl: bool,
}

impl Bounds {
    pub(crate) const NONE: Bounds = Bounds {
        lo: f64::NEG_INFINITY,
        lo_excl: false,
        hi: f64::INFINITY,
        hi_excl: false,
    };

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
        })
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
        above_lo && below_hi
    }

    /// Some integer of `[a, b]` (integral ends) is inside the bounds.
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
        a.max(lo) <= b.min(hi)
    }

    /// A number written so far (`text`: JSON number bytes without exponent) can still end
    /// inside the bounds; `integer`: only integers may follow. `complete`: it ends here, so
    /// its own value must be inside.
    pub(crate) fn viable(&self, text: &[u8], integer: bool, complete: bool) -> bool {
        let neg = text.first() == Some(&b'-');
        let body = if neg { &text[1..] } else { text };
        if complete {
            let v = std::str::from_utf8(text)
                .ok()
                .and_then(|t| t.parse::<f64>().ok())
                .unwrap_or(f64::NAN);
            return self.holds(v);
        }
        // The magnitudes reachable from `body` as intervals [a, b) (b_open) or [a, b].
        let (int_part, frac) = match body.iter().position(|&c| c == b'.') {
            Some(d) => (&body[..d], Some(&body[d + 1..])),
            None => (body, None),
        };
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
                };
                flipped.meets(a, b, b_open)
            } else {
                self.meets(a, b, b_open)
            }
        };
        match frac {
            Some(f) => {
                // v ≤ value < v + 10^-k
                let v = value_of(int_part, f);
                let step = 10f64.powi(-(f.len() as i32));
                check(v, v + step, true)
            }
            None if int_part.is_empty() => {
                // "-" alone: any magnitude.
                check(0.0, f64::INFINITY, false)
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
                for _ in 0..=330 {
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
        let p = Pattern::compile("^[a-z]+-[0-9]{3}$", "#").unwrap();
        let st = feed(&p, "abc-12").unwrap();
        assert!(!p.accepts_end(st));
        assert!(p.accepts_end(feed(&p, "abc-123").unwrap()));
        assert!(feed(&p, "abc-1234").is_none());
        assert!(feed(&p, "1").is_none());
        // Unanchored: a match anywhere.
        let p = Pattern::compile("cat", "#").unwrap();
        assert!(!p.accepts_end(feed(&p, "a ca").unwrap()));
        assert!(p.accepts_end(feed(&p, "a cat sat").unwrap()));
        // Multi-byte UTF-8, byte by byte.
        let p = Pattern::compile("^é+$", "#").unwrap();
        assert!(p.accepts_end(feed(&p, "éé").unwrap()));
        assert!(feed(&p, "e").is_none());
        // Refused with the pattern named.
        let e = Pattern::compile("(?=a)b", "#/properties/x").unwrap_err();
        assert!(e.contains("#/properties/x") && e.contains("(?=a)b"), "{e}");
        let e = Pattern::compile("^a$b", "#").unwrap_err();
        assert!(e.contains("matches no string"), "{e}");
    }

    #[test]
    fn bounds_keep_every_prefix_completable() {
        let b = Bounds {
            lo: 10.0,
            lo_excl: false,
            hi: 250.0,
            hi_excl: false,
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
        };
        let ok = |t: &str, int: bool| n.viable(t.as_bytes(), int, false);
        assert!(ok("-", true) && ok("-4", true) && !ok("-5", true) && !ok("0", true));
        assert!(ok("-4.", false) && ok("-0.", false) && ok("-0.5", false));
        assert!(!n.viable(b"-5", false, true) && n.viable(b"-4.9", false, true));
        assert!(!ok("-5.", false));
        assert!(ok("-4.99", false));
    }
}
