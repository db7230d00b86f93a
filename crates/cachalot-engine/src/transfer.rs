//! A prefilled request in transit between engines: prefill/decode disaggregation (spec
//! `executor.md` §5: a prefill instance computes a prompt's KV and its first token, a decode
//! instance continues from them).
//!
//! [`KvSnapshot`] is what moves: the prompt, the first sampled token, the KV rows of every
//! prompt position in every cache layer (MTP layers' included), the sampler's random stream
//! (so seeded sampling continues as if the request had never moved) and, under MTP, the main
//! model's hidden states the MTP layer has not caught up on yet. [`crate::Engine`] makes one
//! ([`crate::Engine::add_request_for_transfer`]) and takes one
//! ([`crate::Engine::add_prefilled`]).
//!
//! The seed writes the KV straight into the decode side's blocks (its transfer engine's RDMA
//! write, §5.6) and sends MTP draft tokens in a 64-byte metadata slot. Here the rows travel in
//! position order over any byte stream ([`KvSnapshot::write_to`], [`KvSnapshot::read_from`]) and
//! the decode engine writes them into blocks it allocates itself, so the two sides may use
//! different block sizes; the MTP layer's catch-up on the prompt's last chunk runs on the decode
//! side, which then drafts as an engine that prefilled the prompt itself would.
//!
//! Wire format (little-endian): the magic `CACHALOT-KV1`, a u64 header length, a JSON header
//! (cache spec, prompt, first token and its log-probability, the prompt's log-probabilities when
//! the request scores it (`echo`), row bytes per layer, MTP rows, random stream), then each
//! layer's rows and the MTP hidden states as f32. A header without `prompt_logprobs` (an older
//! sender) reads as none.

use std::io::{Read, Write};

use cachalot_model::batch::{CacheSpec, KvCacheDtype};
use serde_json::{json, Value};

use crate::engine::TokenLogprob;
use crate::sampler::{RngState, SamplingParams};

const MAGIC: &[u8; 12] = b"CACHALOT-KV1";

/// The main model's hidden states of positions `first..first + rows` (`width` floats each),
/// whose MTP-layer rows the receiving engine still has to compute.
#[derive(Clone, Debug, PartialEq)]
pub struct MtpRows {
    pub first: usize,
    pub rows: usize,
    pub hidden: Vec<f32>,
}

/// A prefilled request's state (module docs).
#[derive(Clone, PartialEq)]
pub struct KvSnapshot {
    pub spec: CacheSpec,
    pub prompt: Vec<u32>,
    /// The request's sampling parameters (the receiving side checks it continues the same
    /// request).
    pub params: SamplingParams,
    pub first_token: u32,
    /// The first token's log-probability, when the request asked for them.
    pub first_logprob: Option<TokenLogprob>,
    /// The prompt's log-probabilities (token i + 1's at i), when the request asked for them
    /// (`Request::prompt_logprobs`: completions' `echo`); empty otherwise.
    pub prompt_logprobs: Vec<TokenLogprob>,
    /// Per cache layer, the rows of positions `0..prompt.len()` as
    /// [`cachalot_model::batch::KvCache::read_rows`] lays them out.
    pub layers: Vec<Vec<u8>>,
    pub mtp: Option<MtpRows>,
    pub rng: RngState,
}

impl std::fmt::Debug for KvSnapshot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvSnapshot")
            .field("spec", &self.spec)
            .field("prompt_len", &self.prompt.len())
            .field("first_token", &self.first_token)
            .field("bytes", &self.bytes())
            .field("mtp_rows", &self.mtp.as_ref().map(|m| m.rows))
            .finish()
    }
}

#[derive(Debug, thiserror::Error)]
pub enum TransferError {
    #[error("KV transfer: {0}")]
    Io(#[from] std::io::Error),
    #[error("KV transfer: {0}")]
    Format(String),
}

fn bad(msg: impl Into<String>) -> TransferError {
    TransferError::Format(msg.into())
}

/// Bytes one position takes in one layer of a cache of `spec`.
pub fn row_bytes(spec: &CacheSpec) -> usize {
    spec.int8_width + spec.float_width() * spec.float.bytes()
}

/// Bytes one layer of a snapshot of `n` positions holds: the rows, then the sequence's state
/// slot when the cache has one ([`CacheSpec::seq_state_width`]).
pub fn layer_bytes(spec: &CacheSpec, n: usize) -> u64 {
    (n as u64)
        .saturating_mul(row_bytes(spec) as u64)
        .saturating_add(spec.layer_state_bytes() as u64)
}

impl KvSnapshot {
    /// Bytes of KV rows and hidden states carried.
    pub fn bytes(&self) -> usize {
        self.layers.iter().map(Vec::len).sum::<usize>()
            + self.mtp.as_ref().map_or(0, |m| m.hidden.len() * 4)
    }

    /// Checks that the rows fit the spec and the prompt.
    pub fn check(&self) -> Result<(), TransferError> {
        let n = self.prompt.len();
        if n == 0 {
            return Err(bad("the prompt is empty"));
        }
        if self.layers.len() != self.spec.layers {
            return Err(bad(format!(
                "{} layers of rows for a cache of {} layers",
                self.layers.len(),
                self.spec.layers
            )));
        }
        let want = layer_bytes(&self.spec, n);
        if let Some((l, rows)) = self
            .layers
            .iter()
            .enumerate()
            .find(|(_, r)| r.len() as u64 != want)
        {
            return Err(bad(format!(
                "layer {l} holds {} bytes; {n} positions of {} bytes and a state of {} need \
                 {want}",
                rows.len(),
                row_bytes(&self.spec),
                self.spec.layer_state_bytes() as u64
            )));
        }
        if let Some(m) = &self.mtp {
            if m.rows == 0
                || m.first.checked_add(m.rows) != Some(n)
                || m.hidden.is_empty()
                || m.hidden.len() % m.rows != 0
            {
                return Err(bad(format!(
                    "MTP rows {}..{} ({} floats) do not end at the prompt's end ({n})",
                    m.first,
                    m.first.saturating_add(m.rows),
                    m.hidden.len()
                )));
            }
        }
        Ok(())
    }

    /// Writes the snapshot (module docs' wire format).
    pub fn write_to(&self, w: &mut impl Write) -> Result<(), TransferError> {
        let spec = &self.spec;
        let header = json!({
            "spec": {"layers": spec.layers, "width": spec.width, "int8_width": spec.int8_width,
                     "float": spec.float.name(), "seq_state_width": spec.seq_state_width},
            "prompt": self.prompt,
            "params": self.params,
            "first_token": self.first_token,
            "first_logprob": self.first_logprob,
            "prompt_logprobs": self.prompt_logprobs,
            "layer_bytes": self.layers.iter().map(Vec::len).collect::<Vec<_>>(),
            "mtp": self.mtp.as_ref().map(|m| json!({"first": m.first, "rows": m.rows,
                                                    "floats": m.hidden.len()})),
            "rng": {"seed": self.rng.seed.to_vec(), "stream": self.rng.stream,
                    "word_pos": self.rng.word_pos.to_string()},
        })
        .to_string();
        w.write_all(MAGIC)?;
        w.write_all(&(header.len() as u64).to_le_bytes())?;
        w.write_all(header.as_bytes())?;
        for l in &self.layers {
            w.write_all(l)?;
        }
        if let Some(m) = &self.mtp {
            let mut buf = Vec::with_capacity(m.hidden.len() * 4);
            for v in &m.hidden {
                buf.extend_from_slice(&v.to_le_bytes());
            }
            w.write_all(&buf)?;
        }
        w.flush()?;
        Ok(())
    }

    /// Reads a snapshot written by [`KvSnapshot::write_to`], refusing one of more than
    /// `max_bytes` of rows.
    pub fn read_from(r: &mut impl Read, max_bytes: u64) -> Result<KvSnapshot, TransferError> {
        let mut magic = [0u8; 12];
        r.read_exact(&mut magic)?;
        if &magic != MAGIC {
            return Err(bad(format!(
                "the stream does not start with {:?}: not a cachalot KV snapshot (or another \
                 version)",
                String::from_utf8_lossy(MAGIC)
            )));
        }
        let mut len = [0u8; 8];
        r.read_exact(&mut len)?;
        let len = u64::from_le_bytes(len);
        if len > 64 << 20 {
            return Err(bad(format!("a header of {len} bytes")));
        }
        let mut header = vec![0u8; len as usize];
        r.read_exact(&mut header)?;
        let h: Value = serde_json::from_slice(&header)
            .map_err(|e| bad(format!("the header is not JSON: {e}")))?;
        let num = |v: &Value, key: &str| -> Result<u64, TransferError> {
            v.get(key)
                .and_then(Value::as_u64)
                .ok_or_else(|| bad(format!("the header has no number {key:?}")))
        };
        let s = h.get("spec").ok_or_else(|| bad("the header has no spec"))?;
        let float: KvCacheDtype = s
            .get("float")
            .and_then(Value::as_str)
            .ok_or_else(|| bad("the spec has no float dtype"))?
            .parse()
            .map_err(bad)?;
        let spec = CacheSpec {
            layers: num(s, "layers")? as usize,
            width: num(s, "width")? as usize,
            int8_width: num(s, "int8_width")? as usize,
            float,
            // An older sender's spec has none.
            seq_state_width: match s.get("seq_state_width") {
                None => 0,
                Some(_) => num(s, "seq_state_width")? as usize,
            },
        };
        if spec.int8_width > spec.width {
            return Err(bad("int8_width exceeds width"));
        }
        let ids = |key: &str| -> Result<Vec<u32>, TransferError> {
            h.get(key)
                .and_then(Value::as_array)
                .ok_or_else(|| bad(format!("the header has no list {key:?}")))?
                .iter()
                .map(|v| {
                    v.as_u64()
                        .filter(|&x| x <= u32::MAX as u64)
                        .map(|x| x as u32)
                        .ok_or_else(|| bad(format!("{key}: {v} is not a token id")))
                })
                .collect()
        };
        let prompt = ids("prompt")?;
        let first_token = u32::try_from(num(&h, "first_token")?)
            .map_err(|_| bad("first_token is not a token id"))?;
        let params: SamplingParams = h
            .get("params")
            .cloned()
            .ok_or_else(|| bad("the header has no params"))
            .and_then(|v| serde_json::from_value(v).map_err(|e| bad(format!("params: {e}"))))?;
        let first_logprob = match h.get("first_logprob") {
            None | Some(Value::Null) => None,
            Some(v) => Some(
                serde_json::from_value::<TokenLogprob>(v.clone())
                    .map_err(|e| bad(format!("first_logprob: {e}")))?,
            ),
        };
        let prompt_logprobs: Vec<TokenLogprob> = match h.get("prompt_logprobs") {
            None | Some(Value::Null) => Vec::new(),
            Some(v) => serde_json::from_value(v.clone())
                .map_err(|e| bad(format!("prompt_logprobs: {e}")))?,
        };
        if prompt_logprobs.len() >= prompt.len().max(1) {
            return Err(bad(format!(
                "{} prompt log-probabilities for a prompt of {} tokens",
                prompt_logprobs.len(),
                prompt.len()
            )));
        }
        let layer_bytes: Vec<u64> = h
            .get("layer_bytes")
            .and_then(Value::as_array)
            .ok_or_else(|| bad("the header has no layer_bytes"))?
            .iter()
            .map(|v| {
                v.as_u64()
                    .ok_or_else(|| bad("layer_bytes holds a non-number"))
            })
            .collect::<Result<_, _>>()?;
        let mtp_head = match h.get("mtp") {
            None | Some(Value::Null) => None,
            Some(m) => Some((
                num(m, "first")? as usize,
                num(m, "rows")? as usize,
                num(m, "floats")?,
            )),
        };
        // Sizes that do not fit the prompt are refused before anything is allocated.
        let want = self::layer_bytes(&spec, prompt.len());
        if layer_bytes.len() != spec.layers || layer_bytes.iter().any(|&b| b != want) {
            return Err(bad(format!(
                "the header promises rows of {:?} bytes for {} layers; {} positions of {} bytes \
                 and a state of {} need {want} per layer",
                layer_bytes,
                spec.layers,
                prompt.len(),
                row_bytes(&spec),
                spec.layer_state_bytes() as u64
            )));
        }
        let total = layer_bytes
            .iter()
            .try_fold(0u64, |a, &b| a.checked_add(b))
            .and_then(|t| t.checked_add(mtp_head.map_or(0, |m| m.2.saturating_mul(4))))
            .ok_or_else(|| bad("sizes overflow"))?;
        if total > max_bytes {
            return Err(bad(format!(
                "the snapshot holds {total} bytes, over the {max_bytes} this side takes"
            )));
        }
        let rng = h.get("rng").ok_or_else(|| bad("the header has no rng"))?;
        let seed: Vec<u8> = rng
            .get("seed")
            .and_then(Value::as_array)
            .map(|a| {
                a.iter()
                    .filter_map(|v| v.as_u64().filter(|&x| x < 256).map(|x| x as u8))
                    .collect()
            })
            .unwrap_or_default();
        let seed: [u8; 32] = seed
            .try_into()
            .map_err(|_| bad("rng.seed is not 32 bytes"))?;
        let word_pos: u128 = rng
            .get("word_pos")
            .and_then(Value::as_str)
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| bad("rng.word_pos is not a number"))?;
        let rng = RngState {
            seed,
            stream: num(rng, "stream")?,
            word_pos,
        };
        let mut layers = Vec::with_capacity(layer_bytes.len());
        for &b in &layer_bytes {
            let mut v = vec![0u8; b as usize];
            r.read_exact(&mut v)?;
            layers.push(v);
        }
        let mtp = match mtp_head {
            None => None,
            Some((first, rows, floats)) => {
                let mut raw = vec![0u8; floats as usize * 4];
                r.read_exact(&mut raw)?;
                let hidden = raw
                    .chunks_exact(4)
                    .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                    .collect();
                Some(MtpRows {
                    first,
                    rows,
                    hidden,
                })
            }
        };
        let snap = KvSnapshot {
            spec,
            prompt,
            params,
            first_token,
            first_logprob,
            prompt_logprobs,
            layers,
            mtp,
            rng,
        };
        snap.check()?;
        Ok(snap)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn snapshot(float: KvCacheDtype, int8_width: usize, mtp: bool) -> KvSnapshot {
        let spec = CacheSpec {
            layers: 3,
            width: 6,
            int8_width,
            float,
            seq_state_width: 0,
        };
        let n = 5;
        let layers = (0..3)
            .map(|l| {
                (0..n * row_bytes(&spec))
                    .map(|i| (i * 7 + l) as u8)
                    .collect()
            })
            .collect();
        KvSnapshot {
            spec,
            prompt: vec![1, 2, 3, 4, 5],
            params: SamplingParams {
                temperature: 0.7,
                seed: Some(3),
                ..SamplingParams::greedy()
            },
            first_token: 9,
            first_logprob: mtp.then(|| TokenLogprob {
                token: 9,
                logprob: -0.75,
                top: vec![(9, -0.75), (2, -1.5)],
                rank: 1,
            }),
            prompt_logprobs: if mtp {
                (2..6)
                    .map(|t| TokenLogprob {
                        token: t,
                        logprob: -(t as f32) / 4.0,
                        top: vec![(t, -(t as f32) / 4.0)],
                        rank: 1,
                    })
                    .collect()
            } else {
                Vec::new()
            },
            layers,
            mtp: mtp.then(|| MtpRows {
                first: 3,
                rows: 2,
                hidden: vec![0.5, -1.25, 3.0, 7.5],
            }),
            rng: RngState {
                seed: [3; 32],
                stream: 7,
                word_pos: 1 << 70,
            },
        }
    }

    #[test]
    fn a_snapshot_survives_the_wire() {
        for (float, int8, mtp) in [
            (KvCacheDtype::F32, 0, false),
            (KvCacheDtype::Bf16, 0, true),
            (KvCacheDtype::Bf16, 4, true),
        ] {
            let s = snapshot(float, int8, mtp);
            let mut buf = Vec::new();
            s.write_to(&mut buf).unwrap();
            let back = KvSnapshot::read_from(&mut buf.as_slice(), u64::MAX).unwrap();
            assert_eq!(back, s);
        }
    }

    #[test]
    fn broken_streams_are_refused_with_a_reason() {
        let s = snapshot(KvCacheDtype::Bf16, 0, true);
        let mut buf = Vec::new();
        s.write_to(&mut buf).unwrap();
        // Cut short.
        let e = KvSnapshot::read_from(&mut &buf[..buf.len() - 3], u64::MAX).unwrap_err();
        assert!(e.to_string().contains("fill whole buffer"), "{e}");
        // Another stream.
        let e = KvSnapshot::read_from(&mut &b"HTTP/1.1 200 OK\r\n\r\n"[..], u64::MAX).unwrap_err();
        assert!(e.to_string().contains("not a cachalot KV snapshot"), "{e}");
        // Over the limit.
        let e = KvSnapshot::read_from(&mut buf.as_slice(), 100).unwrap_err();
        assert!(e.to_string().contains("over the 100"), "{e}");
        // Rows that do not fit the prompt.
        let mut short = s.clone();
        short.layers[1].pop();
        let mut buf = Vec::new();
        short.write_to(&mut buf).unwrap();
        let e = KvSnapshot::read_from(&mut buf.as_slice(), u64::MAX).unwrap_err();
        assert!(e.to_string().contains("[60, 59, 60]"), "{e}");
        // MTP rows that end elsewhere, or none at all.
        let mut off = s.clone();
        off.mtp.as_mut().unwrap().first = 2;
        assert!(off.check().unwrap_err().to_string().contains("MTP rows"));
        off.mtp.as_mut().unwrap().first = usize::MAX;
        assert!(off.check().is_err());
        off.mtp.as_mut().unwrap().first = 3;
        off.mtp.as_mut().unwrap().hidden.clear();
        assert!(off.check().is_err());
    }
}
