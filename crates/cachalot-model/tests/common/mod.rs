//! Helpers shared by this crate's integration tests: reading reference JSON and comparing
//! log-probabilities with the tolerances the issues set (per token 0.02, mean NLL 0.2%).
#![allow(dead_code)]

use std::path::Path;

use cachalot_model::eval;
use safetensors::tensor::{Dtype, TensorView};
use safetensors::SafeTensors;
use serde_json::Value;

pub fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

pub fn floats(v: &Value) -> Vec<f32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap() as f32)
        .collect()
}

pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

pub fn check_logprobs(what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let worst = max_abs_diff(got, want);
    assert!(
        worst <= 0.02,
        "{what}: worst per-token logprob diff {worst}"
    );
    let (nll_got, _) = eval::nll_ppl(got);
    let (nll_want, _) = eval::nll_ppl(want);
    let rel = ((nll_got - nll_want) / nll_want).abs();
    assert!(rel <= 0.002, "{what}: mean NLL {nll_got} vs {nll_want}");
}

/// Logits of MTP layer 0 over `toks` as transformers' `MtpModel` lays the rows out: row i feeds
/// token i+1 with the main model's final hidden state at position i (so it predicts token i+2).
/// Returns `[toks.len() - 1, vocab]`.
pub fn mtp_rows(m: &cachalot_model::DeepseekV3, toks: &[u32]) -> Vec<f32> {
    use cachalot_model::batch::{Batch, BlockAllocator, KvCache, LogitsWanted};
    let n = toks.len();
    let h = m.config().hidden_size;
    let mut cache = KvCache::new(m.cache_spec(), 16, n.div_ceil(16));
    let mut alloc = BlockAllocator::new(cache.num_blocks());
    let mut table = Vec::new();
    alloc.ensure(&mut table, n, 16).unwrap();
    let mut b = Batch::default();
    b.push_seq(toks, 0, table.clone(), LogitsWanted::None);
    let hidden = m.forward(&b, &mut cache, true).unwrap().hidden.unwrap();
    let mut b = Batch::default();
    b.push_seq(&toks[1..], 0, table, LogitsWanted::All);
    m.mtp_forward(0, &b, &hidden[..(n - 1) * h], &mut cache, false)
        .unwrap()
        .logits
}

/// `log p(toks[i + 2])` of each MTP row but the last.
pub fn mtp_logprobs(rows: &[f32], vocab: usize, toks: &[u32]) -> Vec<f32> {
    rows.chunks_exact(vocab)
        .zip(&toks[2..])
        .map(|(row, &t)| cachalot_kernels::log_softmax_at(row, t as usize))
        .collect()
}

/// A temporary copy of a fixture directory (for tests that break or convert it).
pub fn copy_dir(src: &Path) -> tempfile::TempDir {
    let tmp = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(src).unwrap() {
        let p = entry.unwrap().path();
        std::fs::copy(&p, tmp.path().join(p.file_name().unwrap())).unwrap();
    }
    tmp
}

pub fn index(dir: &Path) -> Value {
    serde_json::from_str(
        &std::fs::read_to_string(dir.join("model.safetensors.index.json")).unwrap(),
    )
    .unwrap()
}

pub fn shard_of(dir: &Path, tensor: &str) -> String {
    index(dir)["weight_map"][tensor]
        .as_str()
        .unwrap()
        .to_string()
}

/// Rewrites the shard holding `tensor` through `edit` (which gets the tensor list) and keeps the
/// index in step.
pub fn rewrite(
    dir: &Path,
    shard: &str,
    edit: impl FnOnce(&mut Vec<(String, Dtype, Vec<usize>, Vec<u8>)>),
) {
    let path = dir.join(shard);
    let bytes = std::fs::read(&path).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = st
        .tensors()
        .into_iter()
        .map(|(n, t)| (n, t.dtype(), t.shape().to_vec(), t.data().to_vec()))
        .collect();
    edit(&mut tensors);
    let views: Vec<(String, TensorView)> = tensors
        .iter()
        .map(|(n, d, s, b)| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    let out = safetensors::serialize(views, None).unwrap();
    std::fs::write(&path, out).unwrap();
    let mut idx = index(dir);
    let map = idx["weight_map"].as_object_mut().unwrap();
    map.retain(|_, f| f.as_str() != Some(shard));
    for (n, ..) in &tensors {
        map.insert(n.clone(), Value::from(shard));
    }
    std::fs::write(dir.join("model.safetensors.index.json"), idx.to_string()).unwrap();
}

/// Logits of two packed sequences, one row per token: a prefill, the MTP layer over it (when
/// loaded: row i pairs token i + 1 with the hidden state at position i), then one decode token
/// each. The parallel tests compare ranks with one process on it.
pub fn packed_run(m: &cachalot_model::DeepseekV3) -> Vec<f32> {
    let seqs: [Vec<u32>; 2] = [
        (0..37).map(|i| (i * 7 + 3) % 500).collect(),
        (0..21).map(|i| (i * 13 + 5) % 500).collect(),
    ];
    packed_run_of(m, &seqs)
}

/// [`packed_run`] over the prompts `seqs` (each at least 2 tokens, together at most 80).
pub fn packed_run_of(m: &cachalot_model::DeepseekV3, seqs: &[Vec<u32>]) -> Vec<f32> {
    use cachalot_model::batch::{Batch, BlockAllocator, KvCache, LogitsWanted};
    let blocks = 24;
    let mut cache = KvCache::new(m.cache_spec(), 4, blocks);
    let mut alloc = BlockAllocator::new(blocks);
    let mut tables = vec![Vec::new(); seqs.len()];
    let mut b = Batch::default();
    for (s, t) in seqs.iter().zip(tables.iter_mut()) {
        alloc.ensure(t, s.len() + 1, 4).unwrap();
        b.push_seq(s, 0, t.clone(), LogitsWanted::All);
        // Prompts, as the engine marks them.
        b.mark_prefill();
    }
    let out = m.forward(&b, &mut cache, true).unwrap();
    let mut logits = out.logits;
    let hidden = out.hidden.unwrap();
    if !m.mtp_layers().is_empty() {
        let mut mb = Batch::default();
        let mut prev = Vec::new();
        let h = m.config().hidden_size;
        let mut off = 0;
        for (s, t) in seqs.iter().zip(&tables) {
            let n = s.len() - 1;
            mb.push_seq(&s[1..], 0, t.clone(), LogitsWanted::All);
            prev.extend_from_slice(&hidden[off * h..(off + n) * h]);
            off += s.len();
        }
        let mtp = m.mtp_forward(0, &mb, &prev, &mut cache, false).unwrap();
        logits.extend(mtp.logits);
    }
    let mut d = Batch::default();
    for (s, t) in seqs.iter().zip(&tables) {
        d.push_seq(&[s[0]], s.len(), t.clone(), LogitsWanted::All);
    }
    logits.extend(m.forward(&d, &mut cache, false).unwrap().logits);
    logits
}

pub fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// One prefill of `seq` (alone, logits of its last token), for the checks that need a forward
/// to run or fail.
pub fn forward_once(m: &cachalot_model::DeepseekV3, seq: &[u32]) -> cachalot_model::Result<()> {
    use cachalot_model::batch::{Batch, BlockAllocator, KvCache, LogitsWanted};
    let blocks = seq.len().div_ceil(4);
    let mut cache = KvCache::new(m.cache_spec(), 4, blocks);
    let mut alloc = BlockAllocator::new(blocks);
    let mut table = Vec::new();
    alloc.ensure(&mut table, seq.len(), 4).unwrap();
    let mut b = Batch::default();
    b.push_seq(seq, 0, table, LogitsWanted::Last);
    m.forward(&b, &mut cache, false).map(|_| ())
}

/// Two ranks, each with the model `load(rank)` gives, run different prompts of the same length:
/// each rank's error.
pub fn different_batches_on_two_ranks(
    load: impl Fn(usize) -> cachalot_model::DeepseekV3 + Sync,
) -> Vec<String> {
    cachalot_comm::run_local_group(2, |comm| {
        let rank = comm.rank();
        let mut m = load(rank);
        m.set_communicator(comm).unwrap();
        let seq: &[u32] = if rank == 0 {
            &[1, 2, 3, 4, 5, 6]
        } else {
            &[5, 6, 7, 8, 9, 10]
        };
        forward_once(&m, seq).unwrap_err().to_string()
    })
    .unwrap()
}

/// A cache of 16-position blocks for one sequence of `len` tokens of `spec`'s model, and the
/// sequence's block table.
pub fn one_sequence_cache(
    spec: cachalot_model::CacheSpec,
    len: usize,
) -> (cachalot_model::KvCache, Vec<u32>) {
    let bs = 16;
    let blocks = len.div_ceil(bs) + 1;
    let cache = cachalot_model::KvCache::new(spec, bs, blocks);
    let mut alloc = cachalot_model::BlockAllocator::new(blocks);
    let mut table = Vec::new();
    alloc.ensure(&mut table, len, bs).unwrap();
    (cache, table)
}
