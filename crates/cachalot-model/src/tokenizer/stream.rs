//! Streaming detokenization: tokens come one at a time, text goes out only when it is complete
//! UTF-8. A byte-level BPE token can hold part of a character (an emoji is often 2-4 tokens);
//! decoding it alone gives U+FFFD. We keep a window of recent ids and emit the difference between
//! the window's text with and without the newest tokens once that text no longer ends in U+FFFD
//! (the prefix/read-offset scheme of Hugging Face's text-generation-inference).

use super::Tokenizer;
use crate::error::Result;

/// A UTF-8 character is at most 4 bytes and every token holds at least one, so a U+FFFD still
/// pending after this many tokens is in the text for real and is emitted.
const MAX_PENDING: usize = 4;

pub struct StreamDecoder<'t> {
    tokenizer: &'t Tokenizer,
    ids: Vec<u32>,
    /// Start of the window decoded for context (byte-level decoders need the previous token to
    /// get spaces and merges right).
    prefix: usize,
    /// End of what has been emitted.
    read: usize,
}

impl<'t> StreamDecoder<'t> {
    pub fn new(tokenizer: &'t Tokenizer) -> Self {
        StreamDecoder {
            tokenizer,
            ids: Vec::new(),
            prefix: 0,
            read: 0,
        }
    }

    /// Adds one token; returns the text it completes (possibly empty).
    pub fn push(&mut self, id: u32) -> Result<String> {
        self.ids.push(id);
        let before = self.tokenizer.decode(&self.ids[self.prefix..self.read])?;
        let now = self.tokenizer.decode(&self.ids[self.prefix..])?;
        let pending = self.ids.len() - self.read;
        if now.len() > before.len()
            && now.is_char_boundary(before.len())
            && (!now.ends_with('\u{fffd}') || pending >= MAX_PENDING)
        {
            let out = now[before.len()..].to_string();
            self.prefix = self.read;
            self.read = self.ids.len();
            Ok(out)
        } else {
            Ok(String::new())
        }
    }

    /// The text still held back (an incomplete character at the end of the stream, shown as
    /// U+FFFD), and resets nothing: call once at the end.
    pub fn finish(&mut self) -> Result<String> {
        if self.read == self.ids.len() {
            return Ok(String::new());
        }
        let before = self.tokenizer.decode(&self.ids[self.prefix..self.read])?;
        let now = self.tokenizer.decode(&self.ids[self.prefix..])?;
        self.prefix = self.read;
        self.read = self.ids.len();
        Ok(now.get(before.len()..).unwrap_or("").to_string())
    }

    /// All ids pushed so far.
    pub fn ids(&self) -> &[u32] {
        &self.ids
    }
}
