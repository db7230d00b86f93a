//! Prompts of an offline run (spec `executor.md` §2.3): `default` (`default_prompt.json`),
//! `LongBench` and `InfiniteBench` from local files, the seed's summarisation wrapper for the
//! long-context sets, the chat template, and right-truncation to `input_truncated_len`.

use std::path::{Path, PathBuf};

use cachalot_model::tokenizer::{ChatTemplate, Message, Tokenizer};

#[derive(Debug, thiserror::Error)]
pub enum DatasetError {
    #[error("{path}: {why}")]
    File { path: PathBuf, why: String },
    #[error("{0}")]
    Missing(String),
    /// A setting the data cannot be prepared with (names the key and what would fix it).
    #[error("{0}")]
    Setting(String),
    #[error(transparent)]
    Model(#[from] cachalot_model::ModelError),
}

/// The seed's LongBench subsets (`data_utils.py`), then the 13 English `_e` ones.
pub const LONGBENCH_SUBSETS: &[&str] = &[
    "narrativeqa",
    "qasper",
    "multifieldqa_en",
    "multifieldqa_zh",
    "hotpotqa",
    "2wikimqa",
    "musique",
    "dureader",
    "gov_report",
    "qmsum",
    "multi_news",
    "vcsum",
    "trec",
    "triviaqa",
    "samsum",
    "lsht",
    "passage_count",
    "passage_retrieval_en",
    "passage_retrieval_zh",
    "lcc",
    "repobench-p",
];
pub const LONGBENCH_E_SUBSETS: &[&str] = &[
    "qasper",
    "multifieldqa_en",
    "hotpotqa",
    "2wikimqa",
    "gov_report",
    "multi_news",
    "trec",
    "triviaqa",
    "samsum",
    "passage_count",
    "passage_retrieval_en",
    "lcc",
    "repobench-p",
];

pub const SUMMARY_PREFIX: &str =
    "Please read a part of the book below, and then give me the summary.\n[start of the book]\n";

pub fn summary_suffix(max_new_tokens: usize) -> String {
    format!(
        "[end of the book]\n\nNow you have read it. Please summarize it for me. First, tell me \
         the title and the author, and then tell the story in {max_new_tokens} words.\n\n "
    )
}

/// Prompts as loaded, plus notes for the run log (skipped subsets).
pub struct Loaded {
    pub prompts: Vec<String>,
    pub notes: Vec<String>,
}

/// Loads the prompts of `dataset` under `base` (the `dataset_path`, or `dataset/`).
pub fn load(dataset: &str, base: &Path) -> Result<Loaded, DatasetError> {
    match dataset {
        "default" => Ok(Loaded {
            prompts: default_prompts(&base.join("default_prompt.json"))?,
            notes: Vec::new(),
        }),
        "LongBench" => longbench(&base.join("LongBench")),
        "InfiniteBench" => {
            let path = base.join("InfiniteBench").join("longbook_qa_eng.jsonl");
            if !path.is_file() {
                return Err(DatasetError::Missing(format!(
                    "InfiniteBench: {} is missing; put longbook_qa_eng.jsonl of the \
                     InfiniteBench data set (xinrongzhang2022/InfiniteBench) there, or point \
                     data_config.dataset_path at the directory holding InfiniteBench/",
                    path.display()
                )));
            }
            Ok(Loaded {
                prompts: contexts(&path)?,
                notes: Vec::new(),
            })
        }
        other => Err(DatasetError::Missing(format!(
            "unknown dataset {other:?}; use default, LongBench or InfiniteBench"
        ))),
    }
}

/// `{"text": "…"}` or `{"text": ["…", …]}`.
pub fn default_prompts(path: &Path) -> Result<Vec<String>, DatasetError> {
    let err = |why: String| DatasetError::File {
        path: path.to_path_buf(),
        why,
    };
    let text = std::fs::read_to_string(path).map_err(|e| {
        err(format!(
            "cannot read the default prompts ({e}); it holds {{\"text\": \"…\"}} or \
             {{\"text\": [\"…\", …]}} — see dataset/default_prompt.json in the repository"
        ))
    })?;
    let v: serde_json::Value =
        from_json(strip_bom(&text)).map_err(|e| err(format!("not valid JSON: {e}")))?;
    let prompts: Vec<String> = match v.get("text") {
        Some(serde_json::Value::String(s)) => vec![s.clone()],
        Some(serde_json::Value::Array(a)) => a
            .iter()
            .enumerate()
            .map(|(i, x)| {
                x.as_str()
                    .map(str::to_string)
                    .ok_or_else(|| err(format!("text[{i}] is not a string")))
            })
            .collect::<Result<_, _>>()?,
        _ => {
            return Err(err(
                "expected an object with \"text\": a string or a list of strings".into(),
            ))
        }
    };
    if prompts.is_empty() {
        return Err(err("\"text\" is an empty list".into()));
    }
    Ok(prompts)
}

fn longbench(dir: &Path) -> Result<Loaded, DatasetError> {
    let mut prompts = Vec::new();
    let mut missing = Vec::new();
    let names = LONGBENCH_SUBSETS
        .iter()
        .map(|s| s.to_string())
        .chain(LONGBENCH_E_SUBSETS.iter().map(|s| format!("{s}_e")));
    for name in names {
        let file = format!("{name}.jsonl");
        match [dir.join(&file), dir.join("data").join(&file)]
            .into_iter()
            .find(|p| p.is_file())
        {
            Some(p) => prompts.extend(contexts(&p)?),
            None => missing.push(name),
        }
    }
    if prompts.is_empty() {
        return Err(DatasetError::Missing(format!(
            "LongBench: no subset found in {}; unpack THUDM/LongBench's data.zip there (files \
             like {0}/data/narrativeqa.jsonl or {0}/narrativeqa.jsonl), or point \
             data_config.dataset_path at the directory holding LongBench/",
            dir.display()
        )));
    }
    let notes = if missing.is_empty() {
        Vec::new()
    } else {
        vec![format!(
            "LongBench: {} of {} subsets not found in {} and skipped: {}",
            missing.len(),
            LONGBENCH_SUBSETS.len() + LONGBENCH_E_SUBSETS.len(),
            dir.display(),
            missing.join(", ")
        )]
    };
    Ok(Loaded { prompts, notes })
}

/// The `context` field of every record of a JSON-lines file, or of a file holding one JSON
/// array of records (Hugging Face's `json` loader, which the seed uses, reads both).
fn contexts(path: &Path) -> Result<Vec<String>, DatasetError> {
    let text = std::fs::read_to_string(path).map_err(|e| DatasetError::File {
        path: path.to_path_buf(),
        why: e.to_string(),
    })?;
    let text = strip_bom(&text);
    let err = |why: String| DatasetError::File {
        path: path.to_path_buf(),
        why,
    };
    let context = |v: &serde_json::Value, at: &str| match v.get("context").and_then(|c| c.as_str())
    {
        Some(c) => Ok(c.to_string()),
        None => Err(err(format!("{at}: no string field \"context\""))),
    };
    let mut out = Vec::new();
    if text.trim_start().starts_with('[') {
        let v: Vec<serde_json::Value> = from_json(text).map_err(|e| {
            err(format!(
                "not a valid JSON array of records: {e}; the file holds one JSON object per \
                 line, or one array of objects, each with a \"context\" string"
            ))
        })?;
        for (i, record) in v.iter().enumerate() {
            out.push(context(record, &format!("record {i}"))?);
        }
    } else {
        for (i, line) in text.lines().enumerate() {
            if line.trim().is_empty() {
                continue;
            }
            let v: serde_json::Value =
                from_json(line).map_err(|e| err(format!("line {}: not valid JSON: {e}", i + 1)))?;
            out.push(context(&v, &format!("line {}", i + 1))?);
        }
    }
    if out.is_empty() {
        return Err(DatasetError::File {
            path: path.to_path_buf(),
            why: "no records (every line is blank); each line is one JSON object with a \
                  \"context\" string"
                .into(),
        });
    }
    Ok(out)
}

/// A prompt ready for the engine: the text sent (after wrapping and templating) and its ids.
#[derive(Clone, Debug, PartialEq)]
pub struct Prepared {
    /// The user message before the chat template: the prompt, or for the long-context sets
    /// the summarisation wrapper around the context as kept.
    pub user: String,
    pub text: String,
    pub ids: Vec<u32>,
    /// Tokens cut off by `input_truncated_len`.
    pub truncated: usize,
}

/// Turns prompts into token ids the seed's way: (for the long-context sets) the context cut to
/// fit the summarisation wrapper, every prompt a user message through the chat template when
/// there is one, then right-truncation to `max_len` tokens.
pub struct PromptBuilder<'a> {
    pub tokenizer: &'a Tokenizer,
    pub template: Option<&'a ChatTemplate>,
    pub max_len: usize,
}

impl PromptBuilder<'_> {
    fn render(&self, user: &str) -> Result<String, DatasetError> {
        Ok(match self.template {
            Some(t) => t.render(&[Message::new("user", user)], true)?,
            None => user.to_string(),
        })
    }

    /// Ids of a rendered prompt: a chat template writes its own BOS; raw text gets the one the
    /// tokenizer puts before a text (`add_bos_token`), as transformers' `tokenizer()` does.
    fn ids(&self, text: &str) -> Result<Vec<u32>, DatasetError> {
        let mut ids = Vec::new();
        if self.template.is_none() {
            ids.extend(self.tokenizer.prompt_bos_id());
        }
        ids.extend(self.tokenizer.encode(text)?);
        Ok(ids)
    }

    pub fn prepare(&self, prompt: &str) -> Result<Prepared, DatasetError> {
        let text = self.render(prompt)?;
        let mut ids = self.ids(&text)?;
        let truncated = ids.len().saturating_sub(self.max_len);
        ids.truncate(self.max_len);
        // A cut prompt's text is what its ids say (the generation prompt may be gone).
        let text = if truncated > 0 {
            self.tokenizer.decode(&ids)?
        } else {
            text
        };
        Ok(Prepared {
            user: prompt.to_string(),
            text,
            ids,
            truncated,
        })
    }

    /// The summarisation wrapper around a long context (LongBench, InfiniteBench).
    pub fn prepare_summary(
        &self,
        context: &str,
        max_new_tokens: usize,
    ) -> Result<Prepared, DatasetError> {
        let suffix = summary_suffix(max_new_tokens);
        let wrapper = self
            .ids(&self.render(&format!("{SUMMARY_PREFIX}{suffix}"))?)?
            .len();
        // The seed cuts the context's ids as `tokenizer()` returns them, BOS included
        // (`ids[:input_max_len - system_prompt_len]`), so that BOS takes one of the context's
        // places.
        let bos = usize::from(self.tokenizer.prompt_bos_id().is_some());
        if wrapper + bos >= self.max_len {
            // The context would be dropped whole and the prompt's end (the generation
            // prompt) cut off.
            return Err(DatasetError::Setting(format!(
                "data_config.input_truncated_len {} leaves no room for the context: the \
                 summarisation instruction and chat template take {wrapper} tokens{}; give at \
                 least {}",
                self.max_len,
                if bos > 0 {
                    " and the context's BOS one (the seed counts it)"
                } else {
                    ""
                },
                wrapper + bos + 1
            )));
        }
        let ctx = self.tokenizer.encode(context)?;
        let mut keep = self.max_len - wrapper - bos;
        loop {
            let k = keep.min(ctx.len());
            // Decoded with special tokens skipped, as the seed does: a control token's text in
            // the data (an end-of-sentence, a role marker) does not reach the model as one.
            let plain: Vec<u32> = ctx[..k]
                .iter()
                .copied()
                .filter(|&id| !self.tokenizer.skipped_in_text(id))
                .collect();
            let kept = self.tokenizer.decode(&plain)?;
            let mut p = self.prepare(&format!("{SUMMARY_PREFIX}{kept}{suffix}"))?;
            if p.truncated == 0 || k == 0 {
                // Tokens cut off: the context's, and any the final truncation took.
                p.truncated += ctx.len() - k;
                return Ok(p);
            }
            // The cut context re-tokenized beside the wrapper took more tokens than apart (a
            // character split at the cut, a merge across the join), and the seed's final
            // right-truncation would cut the generation prompt at the end: cut the context
            // further instead, so the prompt always ends as the template ends it.
            keep = k.saturating_sub(p.truncated);
        }
    }
}

/// JSON text parsed as Python's `json` module reads it in one respect: a `\uD800`–`\uDFFF`
/// escape without its other half (text cut inside an emoji, common in scraped corpora), which
/// JSON parsers refuse and Python keeps, becomes U+FFFD (a lone half is no character: it could
/// not be tokenized).
fn from_json<T: serde::de::DeserializeOwned>(text: &str) -> serde_json::Result<T> {
    serde_json::from_str(text).or_else(|e| match lone_surrogates_replaced(text) {
        Some(fixed) => serde_json::from_str(&fixed),
        None => Err(e),
    })
}

/// `text` with each lone surrogate escape written as `\ufffd`; None when it has none.
fn lone_surrogates_replaced(text: &str) -> Option<String> {
    let b = text.as_bytes();
    let code = |at: usize| -> Option<u32> {
        let hex = b.get(at..at + 6)?;
        if hex[0] != b'\\' || hex[1] != b'u' {
            return None;
        }
        u32::from_str_radix(std::str::from_utf8(&hex[2..]).ok()?, 16).ok()
    };
    let mut out = String::with_capacity(text.len());
    let (mut i, mut from, mut changed) = (0, 0, false);
    while i < b.len() {
        if b[i] != b'\\' {
            i += 1;
            continue;
        }
        match code(i) {
            Some(0xD800..=0xDBFF)
                if code(i + 6).is_some_and(|lo| (0xDC00..=0xDFFF).contains(&lo)) =>
            {
                i += 12
            }
            Some(0xD800..=0xDFFF) => {
                out.push_str(&text[from..i]);
                out.push_str("\\ufffd");
                i += 6;
                from = i;
                changed = true;
            }
            // Any other escape: its two characters (an escaped backslash is not an escape's
            // start).
            _ => i += 2,
        }
    }
    changed.then(|| {
        out.push_str(&text[from..]);
        out
    })
}

/// `text` without a leading UTF-8 byte-order mark (Windows editors write one; JSON forbids it,
/// Python's `json.load` of a file opened as `utf-8-sig` skips it).
fn strip_bom(text: &str) -> &str {
    text.strip_prefix('\u{feff}').unwrap_or(text)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Lone surrogate escapes read as U+FFFD (Python's json keeps them); pairs, escaped
    /// backslashes before a `u` and other escapes stay.
    #[test]
    fn lone_surrogates_read_as_replacement_characters() {
        let v: serde_json::Value =
            from_json(r#"{"text": ["\ud83d lone", "\ud83d\ude00 pair", "\\ud83d", "\udc00\n"]}"#)
                .unwrap();
        assert_eq!(
            v["text"],
            serde_json::json!(["\u{fffd} lone", "\u{1f600} pair", "\\ud83d", "\u{fffd}\n"])
        );
        assert!(lone_surrogates_replaced(r#"{"a": "\ud83d\ude00"}"#).is_none());
        assert!(from_json::<serde_json::Value>("{").is_err());
    }

    #[test]
    fn default_prompts_take_a_string_or_a_list() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("default_prompt.json");
        std::fs::write(&p, r#"{"text": "one"}"#).unwrap();
        assert_eq!(default_prompts(&p).unwrap(), vec!["one"]);
        std::fs::write(&p, r#"{"text": ["a", "b"]}"#).unwrap();
        assert_eq!(default_prompts(&p).unwrap(), vec!["a", "b"]);
        std::fs::write(&p, r#"{"text": [1]}"#).unwrap();
        assert!(default_prompts(&p)
            .unwrap_err()
            .to_string()
            .contains("text[0] is not a string"));
        std::fs::write(&p, r#"{"txt": "x"}"#).unwrap();
        assert!(default_prompts(&p).is_err());
        // A byte-order mark (Windows editors) is skipped, in JSON and JSON-lines files.
        std::fs::write(&p, "\u{feff}{\"text\": \"one\"}").unwrap();
        assert_eq!(default_prompts(&p).unwrap(), vec!["one"]);
        let ib = d.path().join("InfiniteBench");
        std::fs::create_dir_all(&ib).unwrap();
        std::fs::write(
            ib.join("longbook_qa_eng.jsonl"),
            "\u{feff}{\"context\": \"c\", \"input\": \"q\", \"answer\": [\"a\"]}\n",
        )
        .unwrap();
        assert!(load("InfiniteBench", d.path()).is_ok());
    }

    #[test]
    fn missing_datasets_say_where_to_put_them() {
        let d = tempfile::tempdir().unwrap();
        let e = load("default", d.path()).err().unwrap().to_string();
        assert!(e.contains("default_prompt.json"), "{e}");
        let e = load("LongBench", d.path()).err().unwrap().to_string();
        assert!(e.contains("LongBench/data/narrativeqa.jsonl"), "{e}");
        let e = load("InfiniteBench", d.path()).err().unwrap().to_string();
        assert!(e.contains("InfiniteBench/longbook_qa_eng.jsonl"), "{e}");
    }

    #[test]
    fn a_truncation_length_below_the_summary_wrapper_is_named() {
        let dir = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../../assets/cachalot-tiny-r1");
        let tokenizer = Tokenizer::from_dir(&dir).unwrap();
        let template = tokenizer.chat_template().unwrap();
        let b = |max_len| PromptBuilder {
            tokenizer: &tokenizer,
            template: template.as_ref(),
            max_len,
        };
        let e = b(16)
            .prepare_summary("a long context", 32)
            .err()
            .unwrap()
            .to_string();
        assert!(
            e.contains("data_config.input_truncated_len 16") && e.contains("give at least"),
            "{e}"
        );
        assert!(b(4096).prepare_summary("a long context", 32).is_ok());
        // A prompt cut at its end: its text is what its ids say (the generation prompt gone),
        // whole when not cut.
        let whole = b(4096).prepare("Why do whales sing?").unwrap();
        assert_eq!(whole.truncated, 0);
        let cut = b(5).prepare("Why do whales sing?").unwrap();
        assert_eq!(cut.ids, whole.ids[..5]);
        assert_eq!(cut.text, tokenizer.decode(&cut.ids).unwrap());
        assert!(whole.text.starts_with(&cut.text) && whole.text.len() > cut.text.len());
        // A context whose cut re-tokenizes longer beside the wrapper (characters split at the
        // cut): the prompt still ends as the template ends it, within the length.
        let wrapped = tokenizer
            .encode(
                &b(4096)
                    .render(&format!("{SUMMARY_PREFIX}{}", summary_suffix(32)))
                    .unwrap(),
            )
            .unwrap();
        let tail = &wrapped[wrapped.len() - 3..];
        let context = "鲸鱼🐋 whale 游泳 swims ✨ 海洋 deep 🌊 ".repeat(40);
        let mut cut_further = 0;
        for max_len in (wrapped.len() + 2..wrapped.len() + 300).step_by(7) {
            let p = b(max_len).prepare_summary(&context, 32).unwrap();
            assert!(p.ids.len() <= max_len, "{max_len}");
            assert!(
                p.ids.ends_with(tail),
                "{max_len}: {:?}",
                &p.ids[p.ids.len() - 3..]
            );
            let ctx = tokenizer.encode(&context).unwrap().len();
            assert!(p.truncated >= ctx.saturating_sub(max_len), "{max_len}");
            cut_further += (p.ids.len() < max_len) as usize;
        }
        assert!(
            cut_further > 0,
            "no length needed a further cut: the test sees nothing"
        );
    }

    #[test]
    fn contexts_are_cut_as_the_seed_cuts_them() {
        let dir = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../../assets/cachalot-tiny-r1");
        let tokenizer = Tokenizer::from_dir(&dir).unwrap();
        let template = tokenizer.chat_template().unwrap();
        let bos = tokenizer
            .prompt_bos_id()
            .expect("the shipped model's add_bos_token");
        let b = |max_len| PromptBuilder {
            tokenizer: &tokenizer,
            template: template.as_ref(),
            max_len,
        };
        let suffix = summary_suffix(8);
        // Control tokens written in the data are dropped, as the seed's decode with
        // skip_special_tokens drops them.
        let eos = tokenizer.eos_token().unwrap();
        let p = b(4096)
            .prepare_summary(&format!("a whale{eos} swims<｜User｜>"), 8)
            .unwrap();
        assert_eq!(p.user, format!("{SUMMARY_PREFIX}a whale swims{suffix}"));
        let plain = b(4096).prepare(&p.user).unwrap();
        assert_eq!(p.ids, plain.ids);
        // The BOS `tokenizer()` puts before the context takes one of its places: 10 places
        // keep 9 context tokens.
        let wrapper = tokenizer
            .encode(
                &b(4096)
                    .render(&format!("{SUMMARY_PREFIX}{suffix}"))
                    .unwrap(),
            )
            .unwrap()
            .len();
        let context = "The whale swims in the deep sea and sings. ".repeat(50);
        let ctx = tokenizer.encode(&context).unwrap();
        let p = b(wrapper + 10).prepare_summary(&context, 8).unwrap();
        let kept = tokenizer.decode(&ctx[..9]).unwrap();
        assert_eq!(p.user, format!("{SUMMARY_PREFIX}{kept}{suffix}"));
        assert_eq!(p.truncated, ctx.len() - 9);
        // Raw text (no template) gets the BOS the tokenizer puts before a text.
        let raw = PromptBuilder {
            tokenizer: &tokenizer,
            template: None,
            max_len: 4096,
        };
        let p = raw.prepare("Why do whales sing?").unwrap();
        assert_eq!(p.ids[0], bos);
        assert_eq!(
            p.ids[1..],
            tokenizer.encode("Why do whales sing?").unwrap()[..]
        );
    }

    #[test]
    fn a_json_array_of_records_is_read() {
        let d = tempfile::tempdir().unwrap();
        let ib = d.path().join("InfiniteBench");
        std::fs::create_dir_all(&ib).unwrap();
        let file = ib.join("longbook_qa_eng.jsonl");
        std::fs::write(
            &file,
            r#" [{"context": "c1", "input": "q"}, {"context": "c2"}]"#,
        )
        .unwrap();
        assert_eq!(
            load("InfiniteBench", d.path()).unwrap().prompts,
            ["c1", "c2"]
        );
        std::fs::write(&file, r#"[{"context": "c1"}, {"input": "q"}]"#).unwrap();
        let e = load("InfiniteBench", d.path()).err().unwrap().to_string();
        assert!(e.contains("record 1: no string field \"context\""), "{e}");
        std::fs::write(&file, r#"[{"context": "c1"}"#).unwrap();
        let e = load("InfiniteBench", d.path()).err().unwrap().to_string();
        assert!(e.contains("not a valid JSON array of records"), "{e}");
    }

    #[test]
    fn a_data_file_without_records_is_named() {
        let d = tempfile::tempdir().unwrap();
        let ib = d.path().join("InfiniteBench");
        std::fs::create_dir_all(&ib).unwrap();
        std::fs::write(ib.join("longbook_qa_eng.jsonl"), "\n  \n").unwrap();
        let e = load("InfiniteBench", d.path()).err().unwrap().to_string();
        assert!(
            e.contains("longbook_qa_eng.jsonl") && e.contains("no records"),
            "{e}"
        );
        let lb = d.path().join("LongBench");
        std::fs::create_dir_all(&lb).unwrap();
        std::fs::write(lb.join("trec.jsonl"), "").unwrap();
        let e = load("LongBench", d.path()).err().unwrap().to_string();
        assert!(e.contains("trec.jsonl") && e.contains("no records"), "{e}");
    }

    #[test]
    fn longbench_reads_present_subsets_and_notes_the_rest() {
        let d = tempfile::tempdir().unwrap();
        let lb = d.path().join("LongBench/data");
        std::fs::create_dir_all(&lb).unwrap();
        std::fs::write(
            lb.join("qasper.jsonl"),
            "{\"context\": \"c1\", \"input\": \"q\"}\n{\"context\": \"c2\"}\n",
        )
        .unwrap();
        std::fs::write(lb.join("trec_e.jsonl"), "{\"context\": \"c3\"}\n").unwrap();
        let l = load("LongBench", d.path()).unwrap();
        assert_eq!(l.prompts, vec!["c1", "c2", "c3"]);
        assert!(
            l.notes[0].starts_with("LongBench: 32 of 34 subsets"),
            "{:?}",
            l.notes
        );
        let ib = d.path().join("InfiniteBench");
        std::fs::create_dir_all(&ib).unwrap();
        std::fs::write(
            ib.join("longbook_qa_eng.jsonl"),
            "{\"context\": \"book\"}\n",
        )
        .unwrap();
        assert_eq!(
            load("InfiniteBench", d.path()).unwrap().prompts,
            vec!["book"]
        );
    }
}
