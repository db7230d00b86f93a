//! `force_eplb` ("perfect EPLB"): the seed's benchmark mode that replaces the router's top-k
//! expert ids with a synthetic, perfectly balanced assignment while the routing weights still
//! come from the real gate. The outputs are numerically meaningless; it exists to measure
//! throughput under balanced expert load. Spec: `executor.md` §4.6 and
//! `deepseek-v3-r1-kimi-k2.md` §3.9.
//!
//! The ids of a step's `tokens × top_k` slots (slot `j = t·top_k + k`):
//! - prefill: `id[j] = (j + global_rank) mod E`;
//! - decode (`moe_tp = 1`): `offset = tokens·top_k·rank + rank + j`, `col = offset mod ep`,
//!   `row = (offset div ep) mod (E/ep)`, `id = row + col·(E/ep)` — round-robin across the EP
//!   ranks' expert ranges.
//!
//! On one process (rank 0, `ep = 1`) both reduce to `j mod E`. The seed builds the decode ids
//! once for its static decode batch; here a step's ids are built for the tokens it has, and a
//! step counts as decode when every sequence in it contributes one token (`Batch::is_decode`).
//!
//! [`ExpertLoad`] counts the tokens each routed expert of each MoE layer takes, what expert load
//! balancing works from (vLLM's EPLB records the same per step); [`balancedness`] is vLLM's
//! figure for it: the mean over the maximum of the tokens each expert-parallel rank's experts
//! take.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::error::{ModelError, Result};

/// Tokens routed to each expert of each MoE layer (by the layer's checkpoint index, MTP layers
/// after the main ones) since the model was loaded: every routed (token, expert) pair of every
/// forward this process ran, its own tokens only when tokens are dispatched to other ranks.
pub struct ExpertLoad {
    experts: usize,
    counts: Vec<AtomicU64>,
    /// Per layer: the routed (token, expert) pairs this process computed for tokens other
    /// ranks (or it) dispatched to it (dispatched expert parallelism).
    served: Vec<AtomicU64>,
}

impl ExpertLoad {
    /// Counters for layers `0..layers` of `experts` routed experts each.
    pub fn new(layers: usize, experts: usize) -> ExpertLoad {
        ExpertLoad {
            experts,
            counts: (0..layers * experts).map(|_| AtomicU64::new(0)).collect(),
            served: (0..layers).map(|_| AtomicU64::new(0)).collect(),
        }
    }

    /// Adds `n` dispatched tokens this process computed for an expert of layer `key`.
    pub fn record_served(&self, key: u32, n: usize) {
        if let Some(c) = self.served.get(key as usize) {
            c.fetch_add(n as u64, Ordering::Relaxed);
        }
    }

    /// Per layer that served any dispatched token: its key and the pairs computed here.
    pub fn served_snapshot(&self) -> Vec<(u32, u64)> {
        self.served
            .iter()
            .enumerate()
            .map(|(k, c)| (k as u32, c.load(Ordering::Relaxed)))
            .filter(|&(_, n)| n > 0)
            .collect()
    }

    /// Adds a step's routing of layer `key` (per expert, its (token, weight) pairs).
    pub fn record(&self, key: u32, assigned: &[Vec<(usize, f32)>]) {
        let base = key as usize * self.experts;
        for (id, pairs) in assigned.iter().enumerate().take(self.experts) {
            if !pairs.is_empty() {
                if let Some(c) = self.counts.get(base + id) {
                    c.fetch_add(pairs.len() as u64, Ordering::Relaxed);
                }
            }
        }
    }

    /// Per layer that routed any token: its key and every expert's count.
    pub fn snapshot(&self) -> Vec<(u32, Vec<u64>)> {
        if self.experts == 0 {
            return Vec::new();
        }
        self.counts
            .chunks(self.experts)
            .enumerate()
            .map(|(key, c)| {
                let v: Vec<u64> = c.iter().map(|a| a.load(Ordering::Relaxed)).collect();
                (key as u32, v)
            })
            .filter(|(_, v)| v.iter().any(|&n| n > 0))
            .collect()
    }
}

/// vLLM's EPLB "balancedness" of one layer's expert counts over `ranks` expert-parallel ranks,
/// expert `e` on rank `owner(e)` ([`crate::ExpertShard::owner`]): the mean over the maximum of
/// the ranks' token counts; 1 is perfect, 1/ranks all on one rank. 1 for a layer without
/// tokens.
pub fn balancedness(counts: &[u64], ranks: usize, owner: impl Fn(usize) -> usize) -> f64 {
    let ranks = ranks.max(1);
    let mut loads = vec![0u64; ranks];
    for (e, &c) in counts.iter().enumerate() {
        loads[owner(e).min(ranks - 1)] += c;
    }
    balancedness_of(&loads)
}

/// The balancedness of the ranks' token counts: their mean over their maximum (1: even, also
/// when no rank took a token).
pub fn balancedness_of(loads: &[u64]) -> f64 {
    let ranks = loads.len().max(1);
    let max = loads.iter().copied().max().unwrap_or(0);
    if max == 0 {
        return 1.0;
    }
    loads.iter().sum::<u64>() as f64 / ranks as f64 / max as f64
}

/// Where this process sits in expert parallelism, for the balanced assignment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BalancedRouting {
    /// The process's global rank.
    rank: usize,
    /// Expert-parallel size (`ep_size`): ranks sharing the routed experts.
    ep_size: usize,
    num_experts: usize,
}

impl BalancedRouting {
    /// The assignment for `num_experts` routed experts on `rank` of `ep_size` expert-parallel
    /// ranks. `num_experts` must be a positive multiple of `ep_size`.
    pub fn new(rank: usize, ep_size: usize, num_experts: usize) -> Result<BalancedRouting> {
        if num_experts == 0 {
            return Err(ModelError::Options(
                "force_eplb: this model has no routed experts; set force_eplb: false".into(),
            ));
        }
        if ep_size == 0 || !num_experts.is_multiple_of(ep_size) {
            return Err(ModelError::Options(format!(
                "force_eplb: {num_experts} routed experts cannot be spread evenly over an \
                 expert-parallel size of {ep_size}; use an ep_size that divides the expert count"
            )));
        }
        Ok(BalancedRouting {
            rank,
            ep_size,
            num_experts,
        })
    }

    /// One process holding every expert (rank 0, `ep_size` 1).
    pub fn single_process(num_experts: usize) -> Result<BalancedRouting> {
        BalancedRouting::new(0, 1, num_experts)
    }

    pub fn num_experts(&self) -> usize {
        self.num_experts
    }

    /// Errors unless a model with `model_experts` routed experts can take this assignment.
    pub fn check_model(&self, model_experts: usize) -> Result<()> {
        if model_experts == 0 {
            return Err(ModelError::Options(
                "force_eplb: this model has no routed experts; set force_eplb: false".into(),
            ));
        }
        if self.num_experts != model_experts {
            return Err(ModelError::Options(format!(
                "force_eplb: the balanced assignment is for {} experts, the model has \
                 {model_experts}",
                self.num_experts
            )));
        }
        Ok(())
    }

    /// The expert of slot `j` of a step with `tokens` tokens of `top_k` slots each.
    pub fn expert(&self, j: usize, tokens: usize, top_k: usize, decode: bool) -> usize {
        let e = self.num_experts;
        if !decode {
            return (j + self.rank) % e;
        }
        let per_rank = e / self.ep_size;
        let offset = tokens * top_k * self.rank + self.rank + j;
        let col = offset % self.ep_size;
        let row = (offset / self.ep_size) % per_rank;
        row + col * per_rank
    }

    /// Replaces `ids` (`[tokens, top_k]` row-major) by the balanced assignment.
    pub fn assign(&self, ids: &mut [usize], top_k: usize, decode: bool) {
        let tokens = ids.len() / top_k.max(1);
        for (j, id) in ids.iter_mut().enumerate() {
            *id = self.expert(j, tokens, top_k, decode);
        }
    }
}

/// A step's routing grouped by expert: `ids`/`ws` are the router's `[tokens, top_k]` choices
/// and weights; with `balanced` (force_eplb) the ids are replaced first (the weights stay the
/// gate's). Returns, per expert, its `(token, weight)` pairs in token order.
pub fn by_expert(
    ids: &mut [usize],
    ws: &[f32],
    top_k: usize,
    num_experts: usize,
    balanced: Option<&BalancedRouting>,
    decode: bool,
) -> Vec<Vec<(usize, f32)>> {
    if let Some(b) = balanced {
        b.assign(ids, top_k, decode);
    }
    let mut assigned: Vec<Vec<(usize, f32)>> = vec![Vec::new(); num_experts];
    for (j, (&id, &w)) in ids.iter().zip(ws).enumerate() {
        assigned[id].push((j / top_k, w));
    }
    assigned
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expert_load_counts_routed_pairs_and_balancedness_is_mean_over_max() {
        let load = ExpertLoad::new(3, 4);
        // Layer 1: expert 0 takes tokens 0 and 1, expert 3 token 0.
        let a = vec![vec![(0, 0.5), (1, 0.5)], vec![], vec![], vec![(0, 0.5)]];
        load.record(1, &a);
        load.record(1, &a);
        // An out-of-range key is ignored, not a panic.
        load.record(7, &a);
        assert_eq!(load.snapshot(), vec![(1, vec![4, 0, 0, 2])]);
        // Two ranks: experts 0-1 (4 tokens) and 2-3 (2): mean 3 over max 4.
        assert_eq!(balancedness(&[4, 0, 0, 2], 2, |e| e / 2), 0.75);
        assert_eq!(balancedness(&[4, 0, 0, 2], 1, |_| 0), 1.0);
        assert_eq!(balancedness(&[1, 1, 1, 1], 4, |e| e), 1.0);
        assert_eq!(balancedness(&[8, 0, 0, 0], 4, |e| e), 0.25);
        assert_eq!(balancedness(&[0, 0], 2, |e| e), 1.0);
    }

    #[test]
    fn one_process_is_round_robin_over_slots() {
        let r = BalancedRouting::single_process(16).unwrap();
        let mut ids = vec![0usize; 5 * 3];
        for decode in [false, true] {
            r.assign(&mut ids, 3, decode);
            let want: Vec<usize> = (0..15).map(|j| j % 16).collect();
            assert_eq!(ids, want, "decode {decode}");
        }
    }

    #[test]
    fn prefill_shifts_by_the_global_rank() {
        let r = BalancedRouting::new(3, 4, 8).unwrap();
        let ids: Vec<usize> = (0..6).map(|j| r.expert(j, 3, 2, false)).collect();
        assert_eq!(ids, vec![3, 4, 5, 6, 7, 0]);
    }

    #[test]
    fn decode_round_robins_over_ep_ranks() {
        // E = 8, ep = 4 (2 experts per rank), rank 1, 2 tokens × top-2:
        // offset = 2·2·1 + 1 + j = 5 + j → (col, row) = (offset mod 4, (offset div 4) mod 2).
        let r = BalancedRouting::new(1, 4, 8).unwrap();
        let ids: Vec<usize> = (0..4).map(|j| r.expert(j, 2, 2, true)).collect();
        // offsets 5, 6, 7, 8 → cols 1, 2, 3, 0; rows 1, 1, 1, 0 → ids 1+2, 1+4, 1+6, 0.
        assert_eq!(ids, vec![3, 5, 7, 0]);
        // Every rank's experts get the same number of slots over a full cycle.
        let mut per_rank = [0usize; 4];
        for j in 0..64 {
            per_rank[r.expert(j, 8, 8, true) / 2] += 1;
        }
        assert_eq!(per_rank, [16; 4]);
    }

    #[test]
    fn by_expert_keeps_the_gate_weights_and_token_order() {
        let mut ids = vec![3, 1, 1, 0];
        let ws = [0.5, 0.25, 0.75, 0.125];
        let plain = by_expert(&mut ids.clone(), &ws, 2, 4, None, false);
        assert_eq!(plain[1], vec![(0, 0.25), (1, 0.75)]);
        assert_eq!(plain[3], vec![(0, 0.5)]);
        let r = BalancedRouting::single_process(4).unwrap();
        let balanced = by_expert(&mut ids, &ws, 2, 4, Some(&r), true);
        assert_eq!(ids, vec![0, 1, 2, 3]);
        let want: Vec<Vec<(usize, f32)>> = vec![
            vec![(0, 0.5)],
            vec![(0, 0.25)],
            vec![(1, 0.75)],
            vec![(1, 0.125)],
        ];
        assert_eq!(balanced, want);
    }

    #[test]
    fn uneven_expert_split_is_an_error() {
        let err = BalancedRouting::new(0, 3, 8).unwrap_err().to_string();
        assert!(
            err.contains("force_eplb") && err.contains("ep_size"),
            "{err}"
        );
    }
}
