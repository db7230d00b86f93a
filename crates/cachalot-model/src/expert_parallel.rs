//! Expert parallelism (spec `deepseek-v3-r1-kimi-k2.md` §2.4, the seed's expert split with
//! moe_tp = 1): which routed experts a rank holds, and the exchange of a MoE layer's routed
//! outputs between the ranks, shared by DeepSeek-V3/R1/Kimi-K2 and V4. Every rank routes all
//! tokens (the same result everywhere), computes its own experts' outputs, and `gather`s the
//! others'; each rank then sums all experts in id order, so logits are the one-process bits.

use cachalot_comm::Communicator;

use crate::error::{ModelError, Result};

/// Which routed experts a process holds under expert parallelism: rank `rank` of `ranks` keeps
/// experts `[rank·E/ranks, (rank+1)·E/ranks)` of every MoE layer (the seed's split with
/// moe_tp = 1, spec §2.4; `E` must divide by `ranks`). Attention, dense layers, shared experts,
/// embedding and head stay on every rank; a MoE layer's routed outputs are gathered from their
/// owners (`set_communicator` of the model) and summed in expert order, so every rank gets the
/// one-process bits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExpertShard {
    pub rank: usize,
    pub ranks: usize,
}

impl Default for ExpertShard {
    fn default() -> Self {
        ExpertShard { rank: 0, ranks: 1 }
    }
}

impl ExpertShard {
    /// The rank holding routed expert `expert` of `experts` (`experts` divides by `ranks`).
    pub fn owner(&self, expert: usize, experts: usize) -> usize {
        expert / (experts / self.ranks).max(1)
    }

    pub fn owns(&self, expert: usize, experts: usize) -> bool {
        self.owner(expert, experts) == self.rank
    }

    /// The shard exists and splits `experts` routed experts evenly.
    pub(crate) fn validate(&self, experts: usize) -> Result<()> {
        if self.ranks == 0 || self.rank >= self.ranks {
            return Err(ModelError::Options(format!(
                "expert shard: rank {} of {} ranks does not exist (ranks count from 0)",
                self.rank, self.ranks
            )));
        }
        if self.ranks > 1 && !experts.is_multiple_of(self.ranks) {
            return Err(ModelError::Options(format!(
                "expert parallelism over {} ranks needs n_routed_experts ({experts}) to divide \
                 by the ranks; use a number of ranks that divides {experts}",
                self.ranks
            )));
        }
        Ok(())
    }

    /// `comm` is this shard's group (its rank and size), for a model's `set_communicator`.
    pub(crate) fn check_group(&self, comm: &dyn Communicator) -> Result<()> {
        if comm.rank() != self.rank || comm.world_size() != self.ranks {
            return Err(ModelError::Options(format!(
                "the communicator is rank {} of {}, the model holds the experts of rank {} of {}",
                comm.rank(),
                comm.world_size(),
                self.rank,
                self.ranks
            )));
        }
        Ok(())
    }
}

/// Expert parallelism: every rank's outputs of its own active experts (`mine`, in id order)
/// to every rank; returns the outputs of all `active` experts in id order. Each rank knows
/// what the others computed (the routing is the same everywhere), so the parts carry only
/// the values.
pub(crate) fn gather(
    comm: Option<&dyn Communicator>,
    shard: ExpertShard,
    h: usize,
    active: &[usize],
    assigned: &[Vec<(usize, f32)>],
    experts: usize,
    mine: Vec<Vec<f32>>,
) -> Result<Vec<Vec<f32>>> {
    let comm = comm.ok_or_else(|| {
        ModelError::Options(format!(
            "this model holds the routed experts of rank {} of {} (expert parallelism) and \
                 needs the group's communicator (set_communicator) to run",
            shard.rank, shard.ranks
        ))
    })?;
    // Every part opens with a digest of the routing (active experts and their token
    // counts): ranks that stepped different batches fail here instead of mixing outputs.
    let digest = routing_digest(active, assigned);
    let mut bytes = Vec::with_capacity(8 + mine.iter().map(|y| y.len() * 4).sum::<usize>());
    bytes.extend_from_slice(&digest.to_le_bytes());
    for y in &mine {
        for v in y {
            bytes.extend_from_slice(&v.to_le_bytes());
        }
    }
    let parts = comm
        .all_gather(&bytes)
        .map_err(|e| ModelError::Options(format!("expert parallelism: {e}")))?;
    for (r, part) in parts.iter().enumerate() {
        if part.get(..8) != Some(&digest.to_le_bytes()[..]) {
            return Err(ModelError::Options(format!(
                "expert parallelism: rank {r} routed this layer's tokens differently from \
                     rank {} (the ranks ran different batches or weights; every rank must run \
                     the same config, options, checkpoint and requests)",
                shard.rank
            )));
        }
    }
    let mut offsets = vec![8usize; parts.len()];
    let mut out = Vec::with_capacity(active.len());
    for &id in active {
        let r = shard.owner(id, experts);
        let n = assigned[id].len() * h * 4;
        let part = parts.get(r).map(Vec::as_slice).unwrap_or(&[]);
        let Some(raw) = part.get(offsets[r]..offsets[r] + n) else {
            return Err(ModelError::Options(format!(
                "expert parallelism: rank {r} sent {} bytes, fewer than its experts' outputs \
                     need (the ranks' routing disagrees: every rank must run the same batch)",
                part.len()
            )));
        };
        offsets[r] += n;
        out.push(
            raw.chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
        );
    }
    if let Some((r, part)) = parts
        .iter()
        .enumerate()
        .find(|(r, p)| p.len() != offsets[*r])
    {
        return Err(ModelError::Options(format!(
            "expert parallelism: rank {r} sent {} bytes, its experts' outputs are {}",
            part.len(),
            offsets[r]
        )));
    }
    Ok(out)
}

/// FNV-1a over the routing: each active expert's id, its tokens and their weights' bits (the
/// same on every rank that routed the same tokens with the same bits).
fn routing_digest(active: &[usize], assigned: &[Vec<(usize, f32)>]) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    let mut add = |v: u64| {
        for b in v.to_le_bytes() {
            h = (h ^ b as u64).wrapping_mul(0x0100_0000_01b3);
        }
    };
    for &id in active {
        add(id as u64);
        for &(t, w) in &assigned[id] {
            add(t as u64);
            add(w.to_bits() as u64);
        }
    }
    h
}
