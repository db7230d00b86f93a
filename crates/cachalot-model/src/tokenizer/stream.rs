//! Streaming detokenization: tokens come one at a time, text goes out only when it is complete
//! UTF-8. A byte-level BPE token can hold part of a character (an emoji is often 2-4 tokens);
//! decoding it alone gives U+FFFD. We keep a window of recent ids (starting a little before the
//! text still to be emitted, so byte-level decoders see the context that gets spaces and merges
//! right) and emit the part of the window's text not yet emitted once it no longer ends in
//! U+FFFD (the prefix/read-offset scheme of Hugging Face's text-generation-inference).
//!
//! A U+FFFD that is still there after [`MAX_PENDING`] tokens may be a real one (an invalid byte
//! the model wrote) or the start of a character whose bytes are still coming (an invalid byte
//! followed by a split emoji: `80 F0 9F 90 | 80`). Only the last U+FFFD can still change into a
//! character — lossy UTF-8 decoding ends a broken sequence at the first byte that cannot continue
//! it — so everything before it goes out and it is held until a character follows it or the
//! stream ends. The concatenated pieces equal the decode of all ids.

use super::Tokenizer;
use crate::error::Result;

/// A UTF-8 character is at most 4 bytes and every token holds at least one, so after this many
/// tokens a U+FFFD that is not the text's last character is final.
const MAX_PENDING: usize = 4;

pub struct StreamDecoder<'t> {
    tokenizer: &'t Tokenizer,
    ids: Vec<u32>,
    /// Start of the window decoded for context.
    prefix: usize,
    /// Tokens whose text has gone out completely.
    read: usize,
    /// Bytes of the window's text (`decode(ids[prefix..])`) that have gone out or are the
    /// context before `read`.
    sent: usize,
}

impl<'t> StreamDecoder<'t> {
    pub fn new(tokenizer: &'t Tokenizer) -> Self {
        StreamDecoder {
            tokenizer,
            ids: Vec::new(),
            prefix: 0,
            read: 0,
            sent: 0,
        }
    }

    /// Adds one token; returns the text it completes (possibly empty).
    pub fn push(&mut self, id: u32) -> Result<String> {
        self.ids.push(id);
        let now = self.tokenizer.decode(&self.ids[self.prefix..])?;
        let Some(fresh) = now.get(self.sent..) else {
            // The window's text changed under what went out (a decoder whose text of earlier
            // tokens depends on later ones): hold, `finish` emits the rest.
            return Ok(String::new());
        };
        let pending = self.ids.len() - self.read;
        let take = match fresh.char_indices().next_back() {
            None => 0,
            Some((_, c)) if c != '\u{fffd}' => fresh.len(),
            // Everything but the last U+FFFD, which may still become a character.
            Some((last, _)) if pending >= MAX_PENDING => last,
            Some(_) => 0,
        };
        if take == 0 {
            return Ok(String::new());
        }
        let out = fresh[..take].to_string();
        if take == fresh.len() {
            // All out: the next window starts at the tokens just completed (their text is the
            // context the decoder needs; it does not go out again).
            self.prefix = self.read;
            self.read = self.ids.len();
            self.sent = self
                .tokenizer
                .decode(&self.ids[self.prefix..self.read])?
                .len();
        } else {
            self.sent += take;
        }
        Ok(out)
    }

    /// The text still held back (an incomplete character at the end of the stream, shown as
    /// U+FFFD): call once at the end.
    pub fn finish(&mut self) -> Result<String> {
        if self.read == self.ids.len() {
            return Ok(String::new());
        }
        let now = self.tokenizer.decode(&self.ids[self.prefix..])?;
        let rest = match now.get(self.sent..) {
            Some(r) => r.to_string(),
            // (See `push`.) The characters after the last boundary at or before `sent`.
            None => {
                let mut b = self.sent.min(now.len());
                while !now.is_char_boundary(b) {
                    b -= 1;
                }
                now[b..].to_string()
            }
        };
        self.prefix = self.read;
        self.read = self.ids.len();
        self.sent = 0;
        Ok(rest)
    }

    /// All ids pushed so far.
    pub fn ids(&self) -> &[u32] {
        &self.ids
    }
}
