//! Tokenizers of model directories. DeepSeek-V3/R1 ship `tokenizer.json` (Hugging Face
//! byte-level BPE), read with the `tokenizers` crate (spec `deepseek-v3-r1-kimi-k2.md` §7.1).

use std::path::Path;

use crate::error::{ModelError, Result};

pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
}

impl Tokenizer {
    pub fn from_dir(dir: &Path) -> Result<Tokenizer> {
        let path = dir.join("tokenizer.json");
        if !path.exists() {
            return Err(ModelError::Tokenizer(format!(
                "{}: not found; text input needs the model's tokenizer.json (or pass token ids)",
                path.display()
            )));
        }
        let inner = tokenizers::Tokenizer::from_file(&path)
            .map_err(|e| ModelError::Tokenizer(format!("{}: {e}", path.display())))?;
        Ok(Tokenizer { inner })
    }

    /// Token ids of `text`, without added special tokens.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .encode(text, false)
            .map_err(|e| ModelError::Tokenizer(format!("encoding failed: {e}")))?;
        Ok(enc.get_ids().to_vec())
    }

    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.inner
            .decode(ids, false)
            .map_err(|e| ModelError::Tokenizer(format!("decoding failed: {e}")))
    }
}
