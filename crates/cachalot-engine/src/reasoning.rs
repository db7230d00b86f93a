//! Splits streamed text into reasoning (`<think>…</think>`, as R1 and Kimi-K2-Thinking write
//! it) and answer, piece by piece, even when a marker arrives split over several pieces.

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Segment {
    Reasoning(String),
    Answer(String),
}

pub const THINK_OPEN: &str = "<think>";
pub const THINK_CLOSE: &str = "</think>";

pub struct ReasoningSplitter {
    in_reasoning: bool,
    held: String,
    /// A marker that also ends the reasoning and begins the answer, itself kept in the answer
    /// (Kimi-K2-Thinking may open its tool-call section without closing `<think>`, as vLLM's
    /// `kimi_k2` reasoning parser reads it).
    section: &'static [&'static str],
}

impl ReasoningSplitter {
    /// `starts_in_reasoning`: the prompt already opened the block (R1's generation prompt ends
    /// with `<think>\n`).
    pub fn new(starts_in_reasoning: bool) -> Self {
        ReasoningSplitter {
            in_reasoning: starts_in_reasoning,
            held: String::new(),
            section: &[],
        }
    }

    /// Reasoning also ends where one of `markers` begins (a tool-call section, in any of its
    /// spellings), the marker kept in the answer for the tool-call parser.
    pub fn ending_at(mut self, markers: &'static [&'static str]) -> Self {
        self.section = markers;
        self
    }

    /// Whether a prompt leaves the model inside a reasoning block.
    pub fn prompt_opens_reasoning(prompt: &str) -> bool {
        match (prompt.rfind(THINK_OPEN), prompt.rfind(THINK_CLOSE)) {
            (Some(o), Some(c)) => o > c,
            (Some(_), None) => true,
            _ => false,
        }
    }

    pub fn in_reasoning(&self) -> bool {
        self.in_reasoning
    }

    /// Adds text; returns the segments that are certain now (markers themselves are dropped).
    pub fn push(&mut self, text: &str) -> Vec<Segment> {
        self.held.push_str(text);
        let mut out = Vec::new();
        loop {
            let marker = if self.in_reasoning {
                THINK_CLOSE
            } else {
                THINK_OPEN
            };
            let section: &[&str] = if self.in_reasoning { self.section } else { &[] };
            // A tool-call section opened inside the reasoning ends it there (the marker stays).
            let close = self.held.find(marker);
            let first = section
                .iter()
                .filter(|m| !m.is_empty())
                .filter_map(|m| self.held.find(m))
                .min();
            if let Some(at) = first.filter(|&at| close.is_none_or(|c| at < c)) {
                let before: String = self.held[..at].to_string();
                self.emit(before, &mut out);
                self.held.drain(..at);
                self.in_reasoning = false;
                continue;
            }
            if let Some(at) = close {
                let before: String = self.held[..at].to_string();
                self.emit(before, &mut out);
                self.held.drain(..at + marker.len());
                self.in_reasoning = !self.in_reasoning;
                continue;
            }
            // Hold back a tail that may be the start of a marker.
            let cut = self
                .held
                .char_indices()
                .map(|(i, _)| i)
                .find(|&i| {
                    let tail = &self.held[i..];
                    marker.starts_with(tail) || section.iter().any(|m| m.starts_with(tail))
                })
                .unwrap_or(self.held.len());
            let ready: String = self.held.drain(..cut).collect();
            self.emit(ready, &mut out);
            return out;
        }
    }

    /// A whole generated `text` as (reasoning, answer), given the `prompt` it continued (which
    /// may have opened the reasoning block itself, as R1's generation prompt does).
    pub fn split(prompt: &str, text: &str) -> (String, String) {
        ReasoningSplitter::new(Self::prompt_opens_reasoning(prompt)).split_whole(text)
    }

    /// [`ReasoningSplitter::split`], with reasoning also ending where `section` begins
    /// ([`ReasoningSplitter::ending_at`]).
    pub fn split_at(
        prompt: &str,
        text: &str,
        section: &'static [&'static str],
    ) -> (String, String) {
        ReasoningSplitter::new(Self::prompt_opens_reasoning(prompt))
            .ending_at(section)
            .split_whole(text)
    }

    /// A whole `text` through this splitter, as (reasoning, answer).
    pub fn split_whole(mut self, text: &str) -> (String, String) {
        let mut segs = self.push(text);
        segs.extend(self.finish());
        join(segs)
    }

    /// The rest, at the end of the stream.
    pub fn finish(&mut self) -> Vec<Segment> {
        let mut out = Vec::new();
        let rest = std::mem::take(&mut self.held);
        self.emit(rest, &mut out);
        out
    }

    fn emit(&self, text: String, out: &mut Vec<Segment>) {
        if text.is_empty() {
            return;
        }
        out.push(if self.in_reasoning {
            Segment::Reasoning(text)
        } else {
            Segment::Answer(text)
        });
    }
}

/// Segments joined as (reasoning, answer).
fn join(segs: Vec<Segment>) -> (String, String) {
    let (mut reasoning, mut answer) = (String::new(), String::new());
    for seg in segs {
        match seg {
            Segment::Reasoning(t) => reasoning.push_str(&t),
            Segment::Answer(t) => answer.push_str(&t),
        }
    }
    (reasoning, answer)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn split(start: bool, pieces: &[&str]) -> (String, String) {
        let mut s = ReasoningSplitter::new(start);
        let mut segs = Vec::new();
        for p in pieces {
            segs.extend(s.push(p));
        }
        segs.extend(s.finish());
        join(segs)
    }

    #[test]
    fn whole_texts_split_after_their_prompt() {
        assert_eq!(
            ReasoningSplitter::split("<｜Assistant｜><think>\n", "r</think>\n\na"),
            ("r".to_string(), "\n\na".to_string())
        );
        assert_eq!(
            ReasoningSplitter::split("Q:", "<think>r</think>a"),
            ("r".to_string(), "a".to_string())
        );
        assert_eq!(
            ReasoningSplitter::split("Q:", "plain"),
            (String::new(), "plain".to_string())
        );
    }

    #[test]
    fn markers_split_over_pieces_are_found() {
        assert_eq!(
            split(true, &["\nI think", " so.</th", "ink>\n\nYes", "."]),
            ("\nI think so.".to_string(), "\n\nYes.".to_string())
        );
        assert_eq!(
            split(false, &["<thi", "nk>r</think>a < b"]),
            ("r".to_string(), "a < b".to_string())
        );
        assert_eq!(
            split(false, &["plain <th"]),
            (String::new(), "plain <th".to_string())
        );
    }

    /// Kimi-K2-Thinking may open its tool calls inside `<think>`: reasoning ends there, the
    /// section stays in the answer (also when the marker comes in pieces), and a `</think>`
    /// before it still ends the reasoning first.
    #[test]
    fn a_tool_section_ends_the_reasoning() {
        const S: &str = "<|tool_calls_section_begin|>";
        let run = |pieces: &[&str]| {
            let mut s = ReasoningSplitter::new(true).ending_at(&[S, "<|tool_call_section_begin|>"]);
            let mut segs = Vec::new();
            for p in pieces {
                segs.extend(s.push(p));
            }
            segs.extend(s.finish());
            join(segs)
        };
        let call = format!("{S}<|tool_call_begin|>functions.a:0");
        assert_eq!(run(&["r", &call]), ("r".to_string(), call.clone()));
        assert_eq!(
            run(&["r<|tool_calls_sec", "tion_begin|>x"]),
            ("r".to_string(), format!("{S}x"))
        );
        assert_eq!(
            run(&["r</think>a", &call]),
            ("r".to_string(), format!("a{call}"))
        );
        assert_eq!(
            ReasoningSplitter::split_at("<think>", &format!("r{call}"), &[S]),
            ("r".to_string(), call.clone())
        );
        // The singular spelling too.
        assert_eq!(
            run(&["r<|tool_call_section_begin|>x"]),
            ("r".to_string(), "<|tool_call_section_begin|>x".to_string())
        );
        // Without the marker set, the section is reasoning text.
        assert_eq!(
            split(true, &["r", &call]),
            (format!("r{call}"), String::new())
        );
    }

    #[test]
    fn prompt_state() {
        assert!(ReasoningSplitter::prompt_opens_reasoning(
            "<｜Assistant｜><think>\n"
        ));
        assert!(!ReasoningSplitter::prompt_opens_reasoning(
            "<think>x</think>y"
        ));
        assert!(!ReasoningSplitter::prompt_opens_reasoning("hello"));
    }
}
