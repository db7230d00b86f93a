//! Tokenizers of model directories (spec `deepseek-v3-r1-kimi-k2.md` §7). The directory decides
//! which: `tokenizer.json` (Hugging Face byte-level BPE, DeepSeek-V3/R1) through the `tokenizers`
//! crate, else `tiktoken.model` (Kimi-K2) through [`tiktoken::TiktokenBpe`]. `tokenizer_config.json`,
//! where present, gives the BOS/EOS names, Kimi's special-token names and the chat template.
//! A directory whose `config.json` says `model_type: deepseek_v4` gets DeepSeek-V4's encoder
//! ([`dsv4`], spec `deepseek-v4.md` §5) as its chat template.

pub mod chat;
pub mod dsv4;
mod jinja_compat;
mod stream;
pub mod tiktoken;
pub mod tool_calls;

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};

use crate::error::{ModelError, Result};

pub use chat::{ChatTemplate, Message};
pub use stream::StreamDecoder;
pub use tiktoken::TiktokenBpe;
pub use tool_calls::{CallsCursor, ParsedAnswer, PartialCall, ToolCallError, ToolCallFormat};

enum Backend {
    HuggingFace(Box<tokenizers::Tokenizer>),
    Tiktoken(Box<TiktokenBpe>),
}

pub struct Tokenizer {
    backend: Backend,
    dir: PathBuf,
    /// `tokenizer_config.json`, or an empty object when the file is absent.
    config: serde_json::Value,
    /// `model_type` of the directory's `config.json`, if there is one.
    model_type: Option<String>,
    /// The ids whose text decoding with `skip_special_tokens` leaves out
    /// ([`Tokenizer::skipped_in_text`]).
    text_skips: HashSet<u32>,
}

/// Which file a tokenizer was read from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TokenizerKind {
    /// `tokenizer.json` (Hugging Face `tokenizers`).
    HuggingFace,
    /// `tiktoken.model` (Kimi-K2).
    Tiktoken,
}

/// A special-token entry of `tokenizer_config.json`: a string, or `{"content": ...}`
/// (transformers' serialised `AddedToken`).
fn token_content(v: &serde_json::Value) -> Option<String> {
    match v {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Object(o) => o.get("content")?.as_str().map(str::to_string),
        _ => None,
    }
}

/// The ids of [`Tokenizer::skipped_in_text`].
fn text_skips(backend: &Backend, config: &serde_json::Value) -> HashSet<u32> {
    match backend {
        Backend::HuggingFace(t) => t
            .get_added_tokens_decoder()
            .into_iter()
            .filter(|(_, token)| token.special)
            .map(|(id, _)| id)
            .collect(),
        Backend::Tiktoken(t) => {
            let named = [
                "bos_token",
                "eos_token",
                "unk_token",
                "sep_token",
                "pad_token",
                "cls_token",
                "mask_token",
            ]
            .iter()
            .filter_map(|f| config.get(*f));
            // A list of tokens, or (transformers 5's multimodal form) names to tokens.
            let extra = ["additional_special_tokens", "extra_special_tokens"]
                .iter()
                .filter_map(|f| config.get(*f))
                .flat_map(|v| match v {
                    serde_json::Value::Array(a) => a.iter().collect::<Vec<_>>(),
                    serde_json::Value::Object(o) => o.values().collect(),
                    _ => Vec::new(),
                });
            named
                .chain(extra)
                .filter_map(token_content)
                .filter_map(|name| t.token_to_id(&name))
                .collect()
        }
    }
}

/// `model_type` of `dir/config.json` (`None` without the file or the field).
fn model_type(dir: &Path) -> Result<Option<String>> {
    let path = dir.join("config.json");
    if !path.exists() {
        return Ok(None);
    }
    let text = std::fs::read_to_string(&path).map_err(|source| ModelError::Io {
        path: path.clone(),
        error: source,
    })?;
    let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| ModelError::Json {
        path: path.clone(),
        message: e.to_string(),
    })?;
    Ok(v.get("model_type")
        .and_then(|t| t.as_str())
        .map(str::to_string))
}

impl Tokenizer {
    pub fn from_dir(dir: &Path) -> Result<Tokenizer> {
        let config_path = dir.join("tokenizer_config.json");
        let config = if config_path.exists() {
            let text = std::fs::read_to_string(&config_path).map_err(|source| ModelError::Io {
                path: config_path.clone(),
                error: source,
            })?;
            serde_json::from_str(&text).map_err(|e| ModelError::Json {
                path: config_path.clone(),
                message: e.to_string(),
            })?
        } else {
            serde_json::json!({})
        };
        let hf = dir.join("tokenizer.json");
        let tt = dir.join("tiktoken.model");
        let backend = if hf.exists() {
            let inner = tokenizers::Tokenizer::from_file(&hf)
                .map_err(|e| ModelError::Tokenizer(format!("{}: {e}", hf.display())))?;
            Backend::HuggingFace(Box::new(inner))
        } else if tt.exists() {
            let mut added = HashMap::new();
            if let Some(map) = config
                .get("added_tokens_decoder")
                .and_then(|v| v.as_object())
            {
                for (id, entry) in map {
                    let id: u32 = id.parse().map_err(|_| ModelError::Config {
                        path: config_path.clone(),
                        field: format!("added_tokens_decoder.{id}"),
                        message: "the key is not a token id".into(),
                    })?;
                    let name = token_content(entry).ok_or_else(|| ModelError::Config {
                        path: config_path.clone(),
                        field: format!("added_tokens_decoder.{id}"),
                        message: "no `content` string".into(),
                    })?;
                    if name.is_empty() {
                        // An empty name would match everywhere in the text (no progress).
                        return Err(ModelError::Config {
                            path: config_path.clone(),
                            field: format!("added_tokens_decoder.{id}.content"),
                            message: "a special token's name is empty; give it its text (e.g. \"<|im_end|>\") \
                                      or remove the entry"
                                .into(),
                        });
                    }
                    added.insert(id, name);
                }
            }
            Backend::Tiktoken(Box::new(TiktokenBpe::load(&tt, &added)?))
        } else if !dir.is_dir() {
            return Err(ModelError::Tokenizer(format!(
                "{}: {}; give the model's directory (config.json, the safetensors shards and \
                 the tokenizer)",
                dir.display(),
                if dir.exists() {
                    "is not a directory"
                } else {
                    "no such directory"
                }
            )));
        } else {
            return Err(ModelError::Tokenizer(format!(
                "{}: neither tokenizer.json nor tiktoken.model is there; text needs the \
                 model's tokenizer: copy its files from the model's release (tokenizer.json \
                 and tokenizer_config.json, or Kimi's tiktoken.model)",
                dir.display()
            )));
        };
        let text_skips = text_skips(&backend, &config);
        Ok(Tokenizer {
            backend,
            text_skips,
            dir: dir.to_path_buf(),
            config,
            model_type: model_type(dir)?,
        })
    }

    pub fn kind(&self) -> TokenizerKind {
        match self.backend {
            Backend::HuggingFace(_) => TokenizerKind::HuggingFace,
            Backend::Tiktoken(_) => TokenizerKind::Tiktoken,
        }
    }

    /// Token ids of `text`, without added BOS/EOS; special-token strings in the text become
    /// their single ids (as HF `tokenizers` does for added tokens, and tiktoken with
    /// `allowed_special="all"`).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        match &self.backend {
            Backend::HuggingFace(t) => {
                let enc = t
                    .encode(text, false)
                    .map_err(|e| ModelError::Tokenizer(format!("encoding failed: {e}")))?;
                Ok(enc.get_ids().to_vec())
            }
            Backend::Tiktoken(t) => Ok(t.encode(text)),
        }
    }

    /// Text of `ids`, special tokens included as their names. Bytes that do not form complete
    /// UTF-8 become U+FFFD.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        match &self.backend {
            Backend::HuggingFace(t) => t
                .decode(ids, false)
                .map_err(|e| ModelError::Tokenizer(format!("decoding failed: {e}"))),
            Backend::Tiktoken(t) => Ok(String::from_utf8_lossy(&t.decode_bytes(ids)?).into_owned()),
        }
    }

    /// A special or added control token (`<｜User｜>`, `<|im_end|>`, `</think>` where it is
    /// special...): one that decoding with special tokens skipped leaves out.
    pub fn is_special(&self, id: u32) -> bool {
        match &self.backend {
            Backend::HuggingFace(t) => t.decode(&[id], true).map(|s| s.is_empty()).unwrap_or(false),
            Backend::Tiktoken(t) => t.is_special(id),
        }
    }

    /// Whether decoding with special tokens skipped (transformers' and vLLM's
    /// `skip_special_tokens=True`, the seed's offline decode) leaves this token's text out:
    /// for `tokenizer.json`, its added tokens marked `special`; for Kimi's `tiktoken.model`
    /// (a Python tokenizer in transformers), its `all_special_ids`: the tokens
    /// `tokenizer_config.json` names as `bos_token`, `eos_token`, `unk_token`, `sep_token`,
    /// `pad_token`, `cls_token`, `mask_token` and in `additional_special_tokens` (or
    /// `extra_special_tokens`); Kimi's tool-call markers and `<think>` are not among them.
    pub fn skipped_in_text(&self, id: u32) -> bool {
        self.text_skips.contains(&id)
    }

    /// The bytes of one token's text (a token of a byte-level BPE may hold part of a
    /// character, which [`Tokenizer::decode`] shows as U+FFFD): tiktoken's bytes as they are;
    /// for Hugging Face tokenizers, the decoded text's bytes, or where that is a partial
    /// character, the bytes the token's name spells in GPT-2's byte-level alphabet (as
    /// DeepSeek's tokenizers use).
    pub fn token_bytes(&self, id: u32) -> Vec<u8> {
        if let Backend::Tiktoken(t) = &self.backend {
            if let Ok(b) = t.decode_bytes(&[id]) {
                return b;
            }
        }
        let text = self.decode(&[id]).unwrap_or_default();
        if !text.contains('\u{fffd}') {
            return text.into_bytes();
        }
        // GPT-2's alphabet: printable bytes stand for themselves, the others (0-32, 127-160,
        // 173) for 256, 257, ... in order.
        let direct = |b: u32| (33..=126).contains(&b) || (161..=172).contains(&b) || b >= 174;
        let byte_of = |c: char| -> Option<u8> {
            let c = c as u32;
            if c < 256 && direct(c) {
                return Some(c as u8);
            }
            let n = c.checked_sub(256)?;
            (0u32..256)
                .filter(|&b| !direct(b))
                .nth(n as usize)
                .map(|b| b as u8)
        };
        self.id_to_token(id)
            .and_then(|name| name.chars().map(byte_of).collect::<Option<Vec<u8>>>())
            .unwrap_or_else(|| text.into_bytes())
    }

    /// An incremental decoder that only hands out complete UTF-8 text.
    pub fn stream_decoder(&self) -> StreamDecoder<'_> {
        StreamDecoder::new(self)
    }

    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        match &self.backend {
            Backend::HuggingFace(t) => t.token_to_id(token),
            Backend::Tiktoken(t) => t.token_to_id(token),
        }
    }

    pub fn id_to_token(&self, id: u32) -> Option<String> {
        match &self.backend {
            Backend::HuggingFace(t) => t.id_to_token(id),
            Backend::Tiktoken(t) => t.id_to_token(id),
        }
    }

    /// Vocabulary size including added and reserved special tokens.
    pub fn vocab_size(&self) -> usize {
        match &self.backend {
            Backend::HuggingFace(t) => t.get_vocab_size(true),
            Backend::Tiktoken(t) => t.vocab_size(),
        }
    }

    /// A special token named in `tokenizer_config.json` (`bos_token`, `eos_token`, ...).
    pub fn config_token(&self, field: &str) -> Option<String> {
        self.config.get(field).and_then(token_content)
    }

    pub fn bos_token(&self) -> Option<String> {
        self.config_token("bos_token")
    }

    /// The BOS id to put before a plain-text prompt: when `tokenizer_config.json` says
    /// `add_bos_token: true` (as DeepSeek-R1's does), none when it says false; without the
    /// flag, the token `tokenizer.json`'s post-processor puts before a text, if it does (as
    /// transformers encodes with special tokens: a Llama-3-style template). Chat templates
    /// write their own BOS.
    pub fn prompt_bos_id(&self) -> Option<u32> {
        match self.config.get("add_bos_token").and_then(|v| v.as_bool()) {
            Some(true) => self.bos_token().and_then(|t| self.token_to_id(&t)),
            Some(false) => None,
            None => self.post_processor_prefix(),
        }
    }

    /// The one id a `tokenizer.json` post-processor adds before a text (compared with and
    /// without special tokens on a sample), if it adds exactly one there.
    fn post_processor_prefix(&self) -> Option<u32> {
        let Backend::HuggingFace(t) = &self.backend else {
            return None;
        };
        let sample = "a";
        let with = t.encode(sample, true).ok()?;
        let plain = t.encode(sample, false).ok()?;
        let (with, plain) = (with.get_ids(), plain.get_ids());
        (with.len() > plain.len() && with[1..].starts_with(plain)).then(|| with[0])
    }

    pub fn eos_token(&self) -> Option<String> {
        self.config_token("eos_token")
    }

    pub fn eos_token_id(&self) -> Option<u32> {
        self.eos_token().and_then(|t| self.token_to_id(&t))
    }

    /// A chat template given as a file (`--chat-template`): a `tokenizer_config.json` brings its
    /// own special tokens; a bare Jinja file gets this tokenizer's (`bos_token`, `eos_token`,
    /// `pad_token`, `unk_token`), as the same template inside the model's config would.
    pub fn chat_template_from_file(&self, path: &Path) -> Result<ChatTemplate> {
        let t = self.template_file(path)?;
        // A template given on the command line that cannot parse is said now, not at every
        // request.
        t.check_syntax()?;
        Ok(t)
    }

    /// [`ChatTemplate::from_file`] with this tokenizer's ways: its tool sorting, and for a bare
    /// Jinja file its special tokens.
    fn template_file(&self, path: &Path) -> Result<ChatTemplate> {
        let mut t = ChatTemplate::from_file(path)?;
        t.set_sort_tools(self.sorts_tools());
        if path.extension().is_none_or(|e| e != "json") {
            for field in ["bos_token", "eos_token", "pad_token", "unk_token"] {
                if let Some(v) = self.config_token(field) {
                    t.set_special_token(field, v);
                }
            }
        }
        Ok(t)
    }

    /// The model's chat template: its `chat_template.jinja` (where transformers 5 saves it,
    /// and which it prefers), else `tokenizer_config.json`'s, if it has one; for a DeepSeek-V4
    /// model (`model_type: deepseek_v4` in `config.json`), V4's encoder, which ships no
    /// template.
    pub fn chat_template(&self) -> Result<Option<ChatTemplate>> {
        if self.model_type.as_deref() == Some("deepseek_v4") {
            return Ok(Some(ChatTemplate::deepseek_v4(
                self.dir.join("config.json"),
            )));
        }
        let jinja = self.dir.join("chat_template.jinja");
        if jinja.is_file() {
            return self.template_file(&jinja).map(Some);
        }
        let path = self.dir.join("tokenizer_config.json");
        let mut t = ChatTemplate::from_config_value(&self.config, &path)?;
        if let Some(t) = t.as_mut() {
            t.set_sort_tools(self.sorts_tools());
        }
        Ok(t)
    }

    /// Kimi's tiktoken tokenizer (`tokenization_kimi.py`) sorts the keys of a chat's tools
    /// before its template sees them.
    fn sorts_tools(&self) -> bool {
        matches!(self.backend, Backend::Tiktoken(_))
    }
}
