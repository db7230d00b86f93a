//! Tensor parallelism for DeepSeek-V3/R1/Kimi-K2 (spec `deepseek-v3-r1-kimi-k2.md` §2.4, the
//! seed's attention TP and moe_tp): each rank of a group of `ranks` holds
//! - the attention's heads `[rank·N/ranks, (rank+1)·N/ranks)`: their rows of `q_b_proj` (or
//!   `q_proj`) and `kv_b_proj`, and their columns of `o_proj`; `q_a_proj`,
//!   `kv_a_proj_with_mqa` and the latent norms stay whole, so the latent KV cache (shared by
//!   all heads under MLA) is the same on every rank;
//! - a share of every MLP's intermediate features — dense layers, routed and shared experts:
//!   rows of `gate_proj`/`up_proj`, columns of `down_proj`;
//! - a share of the vocabulary's rows of the embedding (a lookup fills this rank's tokens and
//!   is added over the ranks: exact) and of `lm_head` (the logits are gathered); the routers
//!   and the norms whole.
//!
//! With an expert shard of the same group (`--parallel tensor-expert`), the routed experts are
//! held whole, each on one rank (`crate::expert_parallel`'s split), and a rank sums the outputs
//! of the active experts it holds; that partial sum joins the layer's reduce.
//!
//! A layer's attention output and its MLP (or MoE) output are each a partial sum on every rank;
//! [`reduce`] adds them in rank order, so every rank holds the same bits afterwards and the
//! ranks stay in lockstep (the same routing, the same logits, the same samples). The result
//! differs from one process only by the order of that final addition.

use std::ops::Range;

use cachalot_comm::Communicator;

use cachalot_kernels::Matrix;

use crate::config::DeepseekV3Config;
use crate::error::{ModelError, Result};

/// The share of every split Linear this process holds under tensor parallelism (rank `rank` of
/// `ranks`; default: one rank holding everything).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TensorShard {
    pub rank: usize,
    pub ranks: usize,
}

impl Default for TensorShard {
    fn default() -> Self {
        TensorShard { rank: 0, ranks: 1 }
    }
}

impl TensorShard {
    /// This rank's part of `len` features split evenly (`len` divides by `ranks`).
    pub fn part(&self, len: usize) -> Range<usize> {
        let n = len / self.ranks;
        self.rank * n..(self.rank + 1) * n
    }

    /// This rank's part of `len` rows split as evenly as they go (the vocabulary, which need
    /// not divide by the ranks): `[rank·len/ranks, (rank+1)·len/ranks)`.
    pub fn share(&self, len: usize) -> Range<usize> {
        self.rank * len / self.ranks..(self.rank + 1) * len / self.ranks
    }

    /// The shard exists and splits the heads and every MLP's intermediate features evenly
    /// (`experts_whole`: the routed experts are held whole, so only the shared experts' are
    /// cut).
    pub(crate) fn validate(&self, cfg: &DeepseekV3Config, experts_whole: bool) -> Result<()> {
        let mut sizes = vec![
            ("num_attention_heads", cfg.num_attention_heads),
            ("intermediate_size", cfg.intermediate_size),
        ];
        if cfg.n_routed_experts.unwrap_or(0) > 0 {
            if !experts_whole {
                sizes.push(("moe_intermediate_size", cfg.moe_intermediate_size));
            }
            if cfg.n_shared_experts > 0 {
                sizes.push((
                    "moe_intermediate_size × n_shared_experts",
                    cfg.moe_intermediate_size * cfg.n_shared_experts,
                ));
            }
        }
        self.check_sizes(&sizes)
    }

    /// The shard exists and every `(config field, size)` divides by the ranks.
    pub(crate) fn check_sizes(&self, sizes: &[(&str, usize)]) -> Result<()> {
        if self.ranks == 0 || self.rank >= self.ranks {
            return Err(ModelError::Options(format!(
                "tensor shard: rank {} of {} ranks does not exist (ranks count from 0)",
                self.rank, self.ranks
            )));
        }
        if self.ranks == 1 {
            return Ok(());
        }
        for &(field, v) in sizes {
            if !v.is_multiple_of(self.ranks) {
                return Err(ModelError::Options(format!(
                    "tensor parallelism over {} ranks needs config.json's {field} ({v}) to \
                     divide by the ranks; use a number of ranks that divides it, or \
                     --parallel data (or expert, where n_routed_experts divides by the ranks)",
                    self.ranks
                )));
            }
        }
        Ok(())
    }

    /// `comm` is this shard's group (its rank and size), for a model's `set_communicator`.
    pub(crate) fn check_group(&self, comm: &dyn Communicator) -> Result<()> {
        if comm.rank() != self.rank || comm.world_size() != self.ranks {
            return Err(ModelError::Options(format!(
                "the communicator is rank {} of {}, the model holds the tensor shard of rank {} \
                 of {}",
                comm.rank(),
                comm.world_size(),
                self.rank,
                self.ranks
            )));
        }
        Ok(())
    }
}

/// Which part of a Linear a rank keeps (tensor parallelism).
#[derive(Clone)]
pub(crate) enum Cut {
    Whole,
    /// These output rows (column parallel: q_b/q, kv_b, gate, up).
    Rows(Range<usize>),
    /// These input columns (row parallel: o_proj, down).
    Cols(Range<usize>),
}

impl Cut {
    pub(crate) fn apply(self, m: Matrix, name: &str, shard: TensorShard) -> Result<Matrix> {
        let cut = match self {
            Cut::Rows(r) if r != (0..m.rows()) => m.slice_rows(r),
            Cut::Cols(c) if c != (0..m.cols()) => m.slice_cols(c),
            _ => return Ok(m),
        };
        cut.map_err(|e| {
            ModelError::Options(format!(
                "tensor `{name}`: rank {} of {} (tensor parallelism) cannot hold its share: {e}; \
                 use a number of ranks that cuts it there, or --parallel data (or expert, \
                 where n_routed_experts divides by the ranks)",
                shard.rank, shard.ranks
            ))
        })
    }
}

/// Adds every rank's partial `buf` in rank order (the same bits on every rank). `step` is a
/// digest of the batch being run: ranks that run different batches fail naming the rank
/// instead of adding unrelated values.
pub(crate) fn reduce(
    comm: Option<&dyn Communicator>,
    shard: TensorShard,
    step: u64,
    buf: &mut [f32],
) -> Result<()> {
    let parts = exchange(comm, shard, step, buf)?;
    if let Some((r, part)) = parts
        .iter()
        .enumerate()
        .find(|(_, p)| p.len() != 8 + buf.len() * 4)
    {
        return Err(ModelError::Options(format!(
            "tensor parallelism: rank {r} sent {} values, rank {} holds {}",
            (part.len() - 8) / 4,
            shard.rank,
            buf.len()
        )));
    }
    buf.fill(0.0);
    for part in &parts {
        for (o, b) in buf.iter_mut().zip(part[8..].chunks_exact(4)) {
            *o += f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        }
    }
    Ok(())
}

/// Every rank's `values`, each part opening with the batch digest `step`, checked.
fn exchange(
    comm: Option<&dyn Communicator>,
    shard: TensorShard,
    step: u64,
    values: &[f32],
) -> Result<Vec<Vec<u8>>> {
    let comm = comm.ok_or_else(|| {
        ModelError::Options(format!(
            "this model holds the tensor shard of rank {} of {} (tensor parallelism) and needs \
             the group's communicator (set_communicator) to run",
            shard.rank, shard.ranks
        ))
    })?;
    let mut bytes = Vec::with_capacity(8 + values.len() * 4);
    bytes.extend_from_slice(&step.to_le_bytes());
    for v in values {
        bytes.extend_from_slice(&v.to_le_bytes());
    }
    let parts = comm
        .all_gather(&bytes)
        .map_err(|e| ModelError::Options(format!("tensor parallelism: {e}")))?;
    for (r, part) in parts.iter().enumerate() {
        if part.get(..8) != Some(&step.to_le_bytes()[..]) || (part.len() - 8) % 4 != 0 {
            return Err(ModelError::Options(format!(
                "tensor parallelism: rank {r} ran a different batch from rank {} (every rank \
                 must run the same config, options, checkpoint and requests)",
                shard.rank
            )));
        }
    }
    Ok(parts)
}

/// Rows of `n` values, each split over the ranks by columns ([`TensorShard::share`]; `mine`
/// is this rank's `[rows, its share]`): the whole rows, `[rows, Σ shares]`, on every rank.
pub(crate) fn gather_columns(
    comm: Option<&dyn Communicator>,
    shard: TensorShard,
    step: u64,
    mine: &[f32],
    rows: usize,
) -> Result<Vec<f32>> {
    let parts = exchange(comm, shard, step, mine)?;
    let widths: Vec<usize> = parts
        .iter()
        .map(|p| (p.len() - 8) / 4 / rows.max(1))
        .collect();
    let total: usize = widths.iter().sum();
    let mut out = vec![0.0f32; rows * total];
    let mut at = 0;
    for (part, &w) in parts.iter().zip(&widths) {
        for (r, row) in part[8..].chunks_exact(4 * w.max(1)).take(rows).enumerate() {
            for (o, b) in out[r * total + at..r * total + at + w]
                .iter_mut()
                .zip(row.chunks_exact(4))
            {
                *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        at += w;
    }
    Ok(out)
}

/// Under tensor parallelism, a digest of `batch` (and of which forward runs it: 0 the main
/// model, 1 + j MTP layer j) that every rank's partial sums carry; 0 otherwise.
pub(crate) fn batch_digest(shard: TensorShard, batch: &crate::batch::Batch, which: u32) -> u64 {
    if shard.ranks > 1 {
        let mut tokens = batch.tokens.clone();
        tokens.push(which);
        step_digest(&tokens, &batch.positions)
    } else {
        0
    }
}

/// An embedding table holding the vocabulary rows `share` (all of them in one process; a
/// tensor-parallel rank's share otherwise).
pub(crate) struct VocabRows {
    pub table: Matrix,
    pub share: Range<usize>,
}

impl VocabRows {
    /// The embedding rows of `tokens` (`[tokens, width]`): each rank fills the rows of its
    /// share and the ranks' rows are added (exact: one rank holds each token). `step`: the
    /// batch's digest ([`batch_digest`]).
    pub(crate) fn lookup(
        &self,
        comm: Option<&dyn Communicator>,
        shard: TensorShard,
        step: u64,
        tokens: &[u32],
    ) -> Result<Vec<f32>> {
        let _t = crate::profile::Timer::start(crate::profile::Phase::Embed);
        let width = self.table.cols();
        let mut rows = vec![0.0f32; tokens.len() * width];
        for (row, &tok) in rows.chunks_exact_mut(width).zip(tokens) {
            let tok = tok as usize;
            if self.share.contains(&tok) {
                self.table.row_to_f32(tok - self.share.start, row);
            }
        }
        if shard.ranks > 1 {
            reduce(comm, shard, step, &mut rows)?;
        }
        Ok(rows)
    }
}

/// FNV-1a over a batch's tokens and positions: the same on ranks that run the same batch.
pub(crate) fn step_digest(tokens: &[u32], positions: &[usize]) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for v in tokens
        .iter()
        .map(|&t| t as u64)
        .chain(positions.iter().map(|&p| p as u64 | 1 << 63))
    {
        for b in v.to_le_bytes() {
            h = (h ^ b as u64).wrapping_mul(0x0100_0000_01b3);
        }
    }
    h
}

/// Whether `ranks`-way tensor parallelism can split the model of `dir` (by its config.json;
/// `experts_whole`: the routed experts are held whole, `--parallel tensor-expert`): the check
/// every rank's load makes, for a command to say it once before it starts the ranks.
pub fn check_model_split(dir: &std::path::Path, ranks: usize, experts_whole: bool) -> Result<()> {
    let shard = TensorShard { rank: 0, ranks };
    match crate::config_v4::detect_family(dir)? {
        crate::config_v4::ModelFamily::DeepseekV3 => {
            shard.validate(&DeepseekV3Config::from_dir(dir)?, experts_whole)
        }
        crate::config_v4::ModelFamily::DeepseekV4 => {
            // `DeepseekV4::load_from`'s split: whole output groups of heads, every expert's
            // (or, with the experts whole, the shared expert's) intermediate features.
            let c = crate::config_v4::DeepseekV4Config::from_dir(dir)?;
            shard.check_sizes(&[
                ("num_attention_heads", c.num_attention_heads),
                ("o_groups", c.o_groups),
                ("moe_intermediate_size", c.moe_intermediate_size),
            ])
        }
    }
}
