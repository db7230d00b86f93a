//! Kimi-K2's tokenizer: `tiktoken.model` (one base64 token and its rank per line) with byte-level
//! BPE by rank merging, Kimi's 8-alternative pre-tokenizer regex, and 256 reserved special ids
//! after the ranks, named from `tokenizer_config.json` `added_tokens_decoder` or
//! `<|reserved_token_{id}|>` (spec `deepseek-v3-r1-kimi-k2.md` §7.2; Moonshot's
//! `tokenization_kimi.py`, which drives the `tiktoken` library).

use std::collections::HashMap;
use std::path::Path;

use base64::Engine;
use fancy_regex::Regex;

use crate::error::{ModelError, Result};

/// `pat_str` of `tokenization_kimi.py`, alternatives in order (spec §7.2). Alternative 7 needs
/// the negative lookahead, hence `fancy-regex` (as the `tiktoken` library itself uses).
pub const KIMI_PATTERN: &str = concat!(
    r"[\p{Han}]+",
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"|\p{N}{1,3}",
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"|\s*[\r\n]+",
    r"|\s+(?!\S)",
    r"|\s+",
);

/// Reserved special ids after the mergeable ranks.
pub const NUM_RESERVED_SPECIAL: u32 = 256;
/// `tokenization_kimi.py` encodes text in pieces of at most this many characters...
const MAX_CHARS_PER_PIECE: usize = 400_000;
/// ...each split further at runs longer than this of whitespace or of non-whitespace.
const MAX_RUN: usize = 25_000;

pub struct TiktokenBpe {
    ranks: HashMap<Vec<u8>, u32>,
    /// Bytes of each rank (ranks are dense: 0..n).
    tokens: Vec<Vec<u8>>,
    /// Special token strings and their ids, longest first (so a longer name wins a tie).
    specials: Vec<(String, u32)>,
    special_names: HashMap<u32, String>,
    pattern: Regex,
}

impl TiktokenBpe {
    /// Loads `tiktoken.model`; `added` maps special ids to names (from `added_tokens_decoder`).
    pub fn load(path: &Path, added: &HashMap<u32, String>) -> Result<TiktokenBpe> {
        let text = std::fs::read_to_string(path).map_err(|source| ModelError::Io {
            path: path.to_path_buf(),
            error: source,
        })?;
        let mut ranks = HashMap::new();
        let mut pairs = Vec::new();
        for (i, line) in text.lines().enumerate() {
            if line.trim().is_empty() {
                continue;
            }
            let bad = |what: &str| {
                ModelError::Tokenizer(format!(
                    "{}:{}: {what}; expected `<base64 token> <rank>`",
                    path.display(),
                    i + 1
                ))
            };
            let (b64, rank) = line.split_once(' ').ok_or_else(|| bad("no space"))?;
            let bytes = base64::engine::general_purpose::STANDARD
                .decode(b64)
                .map_err(|e| bad(&format!("bad base64 ({e})")))?;
            let rank: u32 = rank
                .trim()
                .parse()
                .map_err(|_| bad(&format!("bad rank `{rank}`")))?;
            if ranks.insert(bytes.clone(), rank).is_some() {
                return Err(bad("duplicate token"));
            }
            pairs.push((rank, bytes));
        }
        pairs.sort();
        if pairs.iter().enumerate().any(|(i, (r, _))| *r as usize != i) {
            return Err(ModelError::Tokenizer(format!(
                "{}: ranks are not 0..{} without gaps",
                path.display(),
                pairs.len()
            )));
        }
        let tokens: Vec<Vec<u8>> = pairs.into_iter().map(|(_, b)| b).collect();
        if let Some(b) = (0..=255u8).find(|b| !ranks.contains_key(&vec![*b])) {
            return Err(ModelError::Tokenizer(format!(
                "{}: byte {b:#04x} has no rank; a byte-level BPE needs all 256 single bytes",
                path.display()
            )));
        }
        let base = tokens.len() as u32;
        let mut special_names = HashMap::new();
        for id in base..base + NUM_RESERVED_SPECIAL {
            let name = added
                .get(&id)
                .cloned()
                .unwrap_or_else(|| format!("<|reserved_token_{id}|>"));
            special_names.insert(id, name);
        }
        let mut specials: Vec<(String, u32)> =
            special_names.iter().map(|(i, n)| (n.clone(), *i)).collect();
        specials.sort_by(|a, b| b.0.len().cmp(&a.0.len()).then(a.1.cmp(&b.1)));
        let pattern = Regex::new(KIMI_PATTERN)
            .map_err(|e| ModelError::Tokenizer(format!("Kimi pre-tokenizer regex: {e}")))?;
        Ok(TiktokenBpe {
            ranks,
            tokens,
            specials,
            special_names,
            pattern,
        })
    }

    /// Number of mergeable ranks (the first special id).
    pub fn num_base_tokens(&self) -> u32 {
        self.tokens.len() as u32
    }

    pub fn vocab_size(&self) -> usize {
        self.tokens.len() + NUM_RESERVED_SPECIAL as usize
    }

    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.specials
            .iter()
            .find(|(n, _)| n == token)
            .map(|(_, i)| *i)
            .or_else(|| self.ranks.get(token.as_bytes()).copied())
    }

    pub fn id_to_token(&self, id: u32) -> Option<String> {
        if let Some(n) = self.special_names.get(&id) {
            return Some(n.clone());
        }
        self.tokens
            .get(id as usize)
            .map(|b| String::from_utf8_lossy(b).into_owned())
    }

    pub fn is_special(&self, id: u32) -> bool {
        self.special_names.contains_key(&id)
    }

    /// Token ids of `text`, special-token strings recognised as single ids (tiktoken's
    /// `allowed_special="all"`), split into pieces as `tokenization_kimi.py` does.
    pub fn encode(&self, text: &str) -> Vec<u32> {
        let mut out = Vec::new();
        for piece in char_chunks(text, MAX_CHARS_PER_PIECE) {
            for run in split_long_runs(piece, MAX_RUN) {
                self.encode_with_specials(run, &mut out);
            }
        }
        out
    }

    fn encode_with_specials(&self, text: &str, out: &mut Vec<u32>) {
        let mut rest = text;
        while !rest.is_empty() {
            match self.next_special(rest) {
                Some((at, name_len, id)) => {
                    self.encode_ordinary(&rest[..at], out);
                    out.push(id);
                    rest = &rest[at + name_len..];
                }
                None => {
                    self.encode_ordinary(rest, out);
                    break;
                }
            }
        }
    }

    /// The leftmost special-token string in `text`: (byte offset, length, id).
    fn next_special(&self, text: &str) -> Option<(usize, usize, u32)> {
        let mut best: Option<(usize, usize, u32)> = None;
        for (name, id) in &self.specials {
            if let Some(at) = text.find(name.as_str()) {
                if best.is_none_or(|(b, _, _)| at < b) {
                    best = Some((at, name.len(), *id));
                }
            }
        }
        best
    }

    fn encode_ordinary(&self, text: &str, out: &mut Vec<u32>) {
        for m in self.pattern.find_iter(text) {
            // The pattern has no construct that can fail at run time on valid UTF-8 other than
            // the backtrack limit; on that, fall back to encoding the rest as one piece.
            let piece = match m {
                Ok(m) => m.as_str(),
                Err(_) => text,
            };
            self.encode_piece(piece.as_bytes(), out);
        }
    }

    fn encode_piece(&self, piece: &[u8], out: &mut Vec<u32>) {
        if let Some(&r) = self.ranks.get(piece) {
            out.push(r);
            return;
        }
        // tiktoken's byte_pair_merge: repeatedly merge the adjacent pair whose concatenation has
        // the lowest rank (leftmost on ties) until no adjacent pair is a token. The pairs wait in
        // a min-heap on (rank, start); a merge changes only its two neighbouring pairs, which
        // are pushed anew, and entries of pairs that no longer exist are skipped when popped:
        // the same merges in the same order in O(n log n) instead of a rescan of every pair
        // after each merge (a 25,000-character piece took minutes).
        use std::cmp::Reverse;
        use std::collections::BinaryHeap;
        const NONE: usize = usize::MAX;
        let n = piece.len();
        let rank = |a: usize, b: usize| self.ranks.get(&piece[a..b]).copied();
        // Parts by their start byte: `next[s]` is the next part's start (n after the last),
        // `prev[s]` the previous part's (NONE before the first).
        let mut next: Vec<usize> = (1..=n).collect();
        let mut prev: Vec<usize> = (0..n).map(|i| if i == 0 { NONE } else { i - 1 }).collect();
        let mut alive = vec![true; n];
        let mut heap = BinaryHeap::new();
        for i in 0..n.saturating_sub(1) {
            if let Some(r) = rank(i, i + 2) {
                heap.push(Reverse((r, i, i + 1, i + 2)));
            }
        }
        while let Some(Reverse((_, s, m, e))) = heap.pop() {
            if !(alive[s] && next[s] == m && alive[m] && next[m] == e) {
                continue;
            }
            alive[m] = false;
            next[s] = e;
            if e < n {
                prev[e] = s;
                if let Some(r) = rank(s, next[e]) {
                    heap.push(Reverse((r, s, e, next[e])));
                }
            }
            if prev[s] != NONE {
                let p = prev[s];
                if let Some(r) = rank(p, e) {
                    heap.push(Reverse((r, p, s, e)));
                }
            }
        }
        let mut i = 0;
        while i < n {
            out.push(self.ranks[&piece[i..next[i]]]);
            i = next[i];
        }
    }

    /// Bytes of `ids` (specials as their names). An id the tokenizer does not have (a model's
    /// embedding can have more rows than its tokenizer has tokens) gives no bytes, as Hugging
    /// Face `tokenizers` skips it.
    pub fn decode_bytes(&self, ids: &[u32]) -> Result<Vec<u8>> {
        let mut out = Vec::new();
        for &id in ids {
            if let Some(b) = self.tokens.get(id as usize) {
                out.extend_from_slice(b);
            } else if let Some(n) = self.special_names.get(&id) {
                out.extend_from_slice(n.as_bytes());
            }
        }
        Ok(out)
    }
}

/// Pieces of at most `n` characters.
fn char_chunks(text: &str, n: usize) -> impl Iterator<Item = &str> {
    let mut rest = text;
    std::iter::from_fn(move || {
        if rest.is_empty() {
            return None;
        }
        let end = rest.char_indices().nth(n).map_or(rest.len(), |(i, _)| i);
        let (head, tail) = rest.split_at(end);
        rest = tail;
        Some(head)
    })
}

/// Python's `str.isspace` (White_Space plus the information separators U+001C..U+001F).
fn py_isspace(c: char) -> bool {
    c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c)
}

/// `_split_whitespaces_or_nonwhitespaces` of `tokenization_kimi.py`: cut wherever a run of
/// whitespace or of non-whitespace characters would grow longer than `max_len`.
fn split_long_runs(s: &str, max_len: usize) -> Vec<&str> {
    let mut out = Vec::new();
    let mut current_len = 0usize;
    let mut current_is_space = false;
    let mut start = 0;
    for (i, c) in s.char_indices() {
        let is_space = py_isspace(c);
        if current_is_space ^ is_space {
            current_len = 1;
            current_is_space = is_space;
        } else {
            current_len += 1;
            if current_len > max_len {
                out.push(&s[start..i]);
                start = i;
                current_len = 1;
            }
        }
    }
    out.push(&s[start..]);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_runs_are_cut_at_the_limit() {
        let s = format!("ab{}cd", " ".repeat(7));
        let parts = split_long_runs(&s, 3);
        assert_eq!(parts.concat(), s);
        // As `tokenization_kimi.py`: a run is cut only where it grows past the limit.
        assert_eq!(parts, vec!["ab   ", "   ", " cd"]);
        assert_eq!(split_long_runs("", 3), vec![""]);
    }

    /// The merge loop of tiktoken as first written (rescan every pair after each merge): the
    /// reference the heap version must agree with.
    fn naive_merge(bpe: &TiktokenBpe, piece: &[u8]) -> Vec<u32> {
        let mut bounds: Vec<usize> = (0..=piece.len()).collect();
        loop {
            let mut best: Option<(u32, usize)> = None;
            for i in 0..bounds.len().saturating_sub(2) {
                if let Some(&r) = bpe.ranks.get(&piece[bounds[i]..bounds[i + 2]]) {
                    if best.is_none_or(|(br, _)| r < br) {
                        best = Some((r, i));
                    }
                }
            }
            match best {
                Some((_, i)) => {
                    bounds.remove(i + 1);
                }
                None => break,
            }
        }
        bounds
            .windows(2)
            .map(|w| bpe.ranks[&piece[w[0]..w[1]]])
            .collect()
    }

    #[test]
    fn heap_merge_equals_the_rescanning_merge() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../fixtures/text/kimi_style/tiktoken.model");
        let bpe = TiktokenBpe::load(&path, &HashMap::new()).unwrap();
        // Pieces glued from the vocabulary's own tokens (so merges happen at every level) and
        // from raw bytes, of lengths up to a few hundred bytes.
        let mut state = 0x2545_F491_4F6C_DD1Du64;
        let mut rnd = |m: usize| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state % m as u64) as usize
        };
        for _ in 0..400 {
            let mut piece = Vec::new();
            for _ in 0..1 + rnd(40) {
                if rnd(4) == 0 {
                    piece.push(rnd(256) as u8);
                } else {
                    piece.extend_from_slice(&bpe.tokens[rnd(bpe.tokens.len())]);
                }
            }
            let mut got = Vec::new();
            bpe.encode_piece(&piece, &mut got);
            assert_eq!(got, naive_merge(&bpe, &piece), "{piece:?}");
        }
    }

    #[test]
    fn char_chunks_respect_char_boundaries() {
        let s = "鲸🐋ab";
        let parts: Vec<&str> = char_chunks(s, 1).collect();
        assert_eq!(parts, vec!["鲸", "🐋", "a", "b"]);
    }

    #[test]
    fn kimi_pattern_compiles() {
        let re = Regex::new(KIMI_PATTERN).unwrap();
        let pieces: Vec<&str> = re
            .find_iter("Hello 世界 it's  123456\n\n")
            .map(|m| m.unwrap().as_str())
            .collect();
        assert_eq!(
            pieces,
            vec!["Hello", " ", "世界", " it's", " ", " ", "123", "456", "\n\n"]
        );
    }
}
