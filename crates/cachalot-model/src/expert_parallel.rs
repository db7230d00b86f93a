//! Expert parallelism (spec `deepseek-v3-r1-kimi-k2.md` §2.4, the seed's expert split with
//! moe_tp = 1): which routed experts a rank holds, and the exchange of a MoE layer's routed
//! outputs between the ranks, shared by DeepSeek-V3/R1/Kimi-K2 and V4. Every rank routes all
//! tokens (the same result everywhere), computes its own experts' outputs, and `gather`s the
//! others'; each rank then sums all experts in id order, so logits are the one-process bits.
//!
//! With data-parallel attention ([`ExpertShard::dispatch`], executor spec §4.3 "MoE EP": the
//! seed's decode dispatch/combine and prefill "double routing") each rank routes only its own
//! tokens and [`dispatch_round`] sends their rows to the experts' owners and the outputs back.
//! The seed pads every rank's collectives to a common count (§4.3, "padding rule"); here a rank
//! whose step is over keeps serving the others' rounds ([`end_step`]) until all are over.

use std::ops::Range;

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
    /// Data-parallel attention (the seed's `attn_tp_size: 1` with `moe_tp_size: 1`, vLLM's
    /// data parallelism with `--enable-expert-parallel`): each rank runs its own batch, and a
    /// MoE layer sends each token's rows to the ranks holding its experts and takes the outputs
    /// back ([`dispatch_round`]); the ranks step together, a rank without work serving the
    /// others. Without it (false) every rank runs the same batch and gathers the outputs.
    pub dispatch: bool,
    /// Prefill context parallelism on top of `dispatch` (the seed's `cp_size` = `world_size`
    /// with `attn_tp_size: 1`, executor spec §4.5): every prompt that starts in a step (at
    /// position 0) is computed by all ranks, each taking two of its 2·ranks segments (zigzag),
    /// with every layer's latent rows (DeepSeek-V4: window rows and compressor inputs)
    /// gathered so that each segment attends to all before it;
    /// the request's own rank keeps its KV and decodes it.
    pub context: bool,
    /// Which rank holds each expert, from measured loads ([`ExpertPlacement`]); None: the
    /// contiguous equal shares above. A placement lives as long as the process (it is leaked
    /// once, [`ExpertPlacement::leak`], so that the shard stays a plain value).
    pub placement: Option<&'static ExpertPlacement>,
}

/// Expert load balancing by placement (DeepSeek's EPLB and vLLM's `--enable-eplb`, static):
/// each MoE layer's routed experts go to the ranks so that the ranks' token counts, measured on
/// an earlier run (`expert_load` in its summary.json), are as even as a greedy packing makes
/// them. With `redundant` extra copies (vLLM's `num_redundant_experts`, DeepSeek EPLB's
/// replicas) the busiest experts are held by several ranks (each copy on a different rank, every
/// rank holding `(E + redundant) / ranks` experts of each placed layer), and a token dispatched
/// to such an expert goes to one copy, each copy taking a share ([`ExpertPlacement::split`]). Every rank must use the same
/// placement (the same file and count); outputs are those of any other split (a token's experts
/// and their sums do not depend on where they run; the products give the same bits for any
/// number of tokens).
#[derive(Debug, PartialEq, Eq)]
pub struct ExpertPlacement {
    ranks: usize,
    experts: usize,
    redundant: usize,
    /// Per layer key: each expert's ranks, its primary first (one rank without redundant
    /// copies); empty for a layer the loads do not cover (contiguous shares there, no copies).
    holders: Vec<Vec<Vec<u16>>>,
}

/// Whether `ranks`-way expert parallelism can split the routed experts of the model in `dir`
/// (by its config.json): the check every rank's load makes, for a command to say it once before
/// it starts the ranks.
pub fn check_expert_split(dir: &std::path::Path, ranks: usize) -> Result<()> {
    let experts = match crate::config_v4::detect_family(dir)? {
        crate::config_v4::ModelFamily::DeepseekV3 => {
            crate::config::DeepseekV3Config::from_dir(dir)?
                .n_routed_experts
                .unwrap_or(0)
        }
        crate::config_v4::ModelFamily::DeepseekV4 => {
            crate::config_v4::DeepseekV4Config::from_dir(dir)?.n_routed_experts
        }
    };
    if experts == 0 {
        // A dense model: the loads say what they refuse.
        return Ok(());
    }
    ExpertShard {
        rank: 0,
        ranks,
        ..ExpertShard::default()
    }
    .validate(experts)
}

impl ExpertPlacement {
    /// The placement of `experts` routed experts per layer over `ranks` ranks for the measured
    /// `loads` (per layer key, each expert's tokens), with `redundant` extra copies per layer.
    pub fn from_loads(
        loads: &[(u32, Vec<u64>)],
        experts: usize,
        ranks: usize,
        redundant: usize,
    ) -> std::result::Result<ExpertPlacement, String> {
        if ranks == 0 || ranks > u16::MAX as usize || !experts.is_multiple_of(ranks) {
            return Err(format!(
                "{experts} experts do not split evenly over {ranks} ranks"
            ));
        }
        let mut holders: Vec<Vec<Vec<u16>>> = Vec::new();
        for (key, counts) in loads {
            if counts.len() != experts {
                return Err(format!(
                    "layer {key} has loads for {} experts, the model {experts}",
                    counts.len()
                ));
            }
            let k = *key as usize;
            if k >= MAX_PLACED_LAYERS {
                return Err(format!(
                    "layer key {key} is beyond any model's layers (at most {MAX_PLACED_LAYERS})"
                ));
            }
            if holders.len() <= k {
                holders.resize(k + 1, Vec::new());
            }
            holders[k] = place_layer_with(counts, ranks, redundant)?;
        }
        Ok(ExpertPlacement {
            ranks,
            experts,
            redundant,
            holders,
        })
    }

    /// The placement for the loads in `path`: a run's summary.json (its `expert_load`), or
    /// that object, or a bare `{"tokens": {"<layer>": [<tokens per expert>], ...}}`; with
    /// `redundant` extra copies of the busiest experts per layer (`--redundant-experts`).
    pub fn from_file(
        path: &std::path::Path,
        ranks: usize,
        redundant: usize,
    ) -> Result<ExpertPlacement> {
        let bad = |why: String| {
            ModelError::Options(format!(
                "{} (--expert-placement): {why}; give a summary.json of an earlier run of this \
                 model (its expert_load)",
                path.display()
            ))
        };
        let text =
            std::fs::read_to_string(path).map_err(|e| bad(format!("cannot read it: {e}")))?;
        let v: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| bad(format!("not JSON: {e}")))?;
        let obj = v.get("expert_load").unwrap_or(&v);
        let tokens = obj
            .get("tokens")
            .and_then(serde_json::Value::as_object)
            .ok_or_else(|| bad("no expert_load.tokens object".into()))?;
        let mut loads = Vec::new();
        for (k, c) in tokens {
            let key: u32 = k
                .parse()
                .map_err(|_| bad(format!("layer key {k:?} is not a layer index")))?;
            let counts: Option<Vec<u64>> = c
                .as_array()
                .map(|a| a.iter().map(serde_json::Value::as_u64).collect())
                .unwrap_or(None);
            let counts =
                counts.ok_or_else(|| bad(format!("layer {k}: expected a list of token counts")))?;
            loads.push((key, counts));
        }
        // The experts per layer: the count most layers give (a damaged layer is the odd one).
        let mut sizes: Vec<usize> = loads.iter().map(|(_, c)| c.len()).collect();
        sizes.sort_unstable();
        let experts = sizes
            .chunk_by(|a, b| a == b)
            .max_by_key(|run| run.len())
            .map_or(0, |run| run[0]);
        if experts == 0 {
            return Err(bad("no layer with expert counts".into()));
        }
        if let Some((key, c)) = loads.iter().find(|(_, c)| c.len() != experts) {
            return Err(bad(format!(
                "layer {key} has loads for {} experts, the other layers {experts}",
                c.len()
            )));
        }
        // Expert parallelism splits the experts evenly first (a layer the loads do not cover
        // keeps contiguous shares); copies come on top of that.
        if ranks > 1 && !experts.is_multiple_of(ranks) {
            return Err(ModelError::Options(format!(
                "{} (--expert-placement): its loads are of {experts} routed experts per layer, \
                 which do not split evenly over {ranks} ranks; expert parallelism needs a number \
                 of ranks that divides the model's experts (redundant copies do not change that)",
                path.display()
            )));
        }
        // The number of copies is the option's, not the file's.
        place_layer_with(&vec![0; experts], ranks, redundant).map_err(|why| {
            ModelError::Options(format!(
                "--redundant-experts {redundant}: {why}; give a multiple of {ranks}, at most {}",
                experts * ranks.saturating_sub(1)
            ))
        })?;
        ExpertPlacement::from_loads(&loads, experts, ranks, redundant).map_err(bad)
    }

    /// The primary rank of expert `expert` of layer `key`; None where the loads do not cover
    /// the layer.
    pub fn owner(&self, key: u32, expert: usize) -> Option<usize> {
        self.holders(key, expert).map(|h| h[0] as usize)
    }

    /// Every rank holding expert `expert` of layer `key`, its primary first; None where the
    /// loads do not cover the layer.
    pub fn holders(&self, key: u32, expert: usize) -> Option<&[u16]> {
        self.holders
            .get(key as usize)
            .and_then(|o| o.get(expert))
            .map(Vec::as_slice)
            .filter(|h| !h.is_empty())
    }

    /// Where rank `src`'s `n` tokens for expert `expert` of layer `key` are computed: each
    /// copy takes a contiguous share of them (in token order: share c of the k copies is
    /// tokens `[c·n/k, (c+1)·n/k)`, computed by copy (c + src) mod k, so that the ranks' odd
    /// tokens fall on different copies); empty shares are left out. None where the loads do
    /// not cover the layer.
    pub fn split(
        &self,
        key: u32,
        expert: usize,
        src: usize,
        n: usize,
    ) -> Option<Vec<(usize, Range<usize>)>> {
        let h = self.holders(key, expert)?;
        let k = h.len();
        Some(
            (0..k)
                .map(|c| (h[(c + src) % k] as usize, c * n / k..(c + 1) * n / k))
                .filter(|(_, r)| !r.is_empty())
                .collect(),
        )
    }

    pub fn ranks(&self) -> usize {
        self.ranks
    }

    /// Extra expert copies per placed layer (`--redundant-experts`).
    pub fn redundant(&self) -> usize {
        self.redundant
    }

    /// Layers the loads placed (the others keep contiguous shares).
    pub fn layers_placed(&self) -> usize {
        self.holders.iter().filter(|o| !o.is_empty()).count()
    }

    /// The keys of the layers the loads placed.
    pub fn placed_keys(&self) -> Vec<u32> {
        (0..self.holders.len() as u32)
            .filter(|&k| !self.holders[k as usize].is_empty())
            .collect()
    }

    pub fn experts(&self) -> usize {
        self.experts
    }

    /// For the life of the process (an [`ExpertShard`] is a plain value).
    pub fn leak(self) -> &'static ExpertPlacement {
        Box::leak(Box::new(self))
    }
}

/// Layer keys a placement may name (DeepSeek-V3 has 62 with its MTP layer).
const MAX_PLACED_LAYERS: usize = 4096;

/// One layer's placement without copies ([`place_layer_with`] with none): each expert's rank.
pub fn place_layer(loads: &[u64], ranks: usize) -> Vec<u16> {
    place_layer_with(loads, ranks, 0)
        .expect("the experts split evenly")
        .into_iter()
        .map(|h| h[0])
        .collect()
}

/// One layer's placement with `redundant` extra copies: first each copy goes to the expert
/// with the most tokens per copy (ties to the lowest id; at most one copy per rank), as
/// DeepSeek EPLB's `replicate_experts`; then the experts, by decreasing tokens per copy (ties
/// by id), each put their copies on the ranks with the fewest tokens so far among those with
/// room (`(E + redundant) / ranks` experts each; ties to the lowest rank), the greedy "longest
/// processing time" packing, a copy counting for its share of the expert's tokens. Where that
/// leaves an expert fewer ranks with room than it has copies, the packing starts again taking
/// the experts with the most copies first, each on the ranks with the most room (which always
/// fits). Returns each expert's ranks, its primary first.
pub fn place_layer_with(
    loads: &[u64],
    ranks: usize,
    redundant: usize,
) -> std::result::Result<Vec<Vec<u16>>, String> {
    let n = loads.len();
    if ranks == 0 || n == 0 || !(n + redundant).is_multiple_of(ranks) {
        return Err(format!(
            "{n} experts and {redundant} redundant copies do not split evenly over {ranks} \
             ranks (experts + redundant copies must be a multiple of the ranks)"
        ));
    }
    if redundant > n * (ranks - 1) {
        return Err(format!(
            "{redundant} redundant copies of {n} experts over {ranks} ranks: at most \
             {} (one copy of each expert per rank)",
            n * (ranks - 1)
        ));
    }
    let slots = (n + redundant) / ranks;
    // Tokens per copy, compared exactly: a/ca against b/cb.
    let per_copy = |a: usize, ca: usize, b: usize, cb: usize| {
        (loads[a] as u128 * cb as u128).cmp(&(loads[b] as u128 * ca as u128))
    };
    let mut copies = vec![1usize; n];
    for _ in 0..redundant {
        let e = (0..n)
            .filter(|&e| copies[e] < ranks)
            .max_by(|&a, &b| per_copy(a, copies[a], b, copies[b]).then(b.cmp(&a)))
            .expect("a copy fits: checked above");
        copies[e] += 1;
    }
    let pack = |order: &[usize], by_room: bool| -> Option<Vec<Vec<u16>>> {
        let mut sum = vec![0f64; ranks];
        let mut held = vec![0usize; ranks];
        let mut holders = vec![Vec::new(); n];
        for &e in order {
            let mut cand: Vec<usize> = (0..ranks).filter(|&r| held[r] < slots).collect();
            if cand.len() < copies[e] {
                return None;
            }
            cand.sort_by(|&a, &b| {
                let room = if by_room {
                    held[a].cmp(&held[b])
                } else {
                    std::cmp::Ordering::Equal
                };
                room.then(sum[a].total_cmp(&sum[b])).then(a.cmp(&b))
            });
            for &r in &cand[..copies[e]] {
                holders[e].push(r as u16);
                held[r] += 1;
                sum[r] += loads[e] as f64 / copies[e] as f64;
            }
        }
        Some(holders)
    };
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by(|&a, &b| per_copy(b, copies[b], a, copies[a]).then(a.cmp(&b)));
    if let Some(h) = pack(&order, false) {
        return Ok(h);
    }
    order.sort_by(|&a, &b| {
        copies[b]
            .cmp(&copies[a])
            .then(per_copy(b, copies[b], a, copies[a]))
            .then(a.cmp(&b))
    });
    pack(&order, true).ok_or_else(|| {
        format!("{redundant} redundant copies of {n} experts do not fit {ranks} ranks")
    })
}

impl Default for ExpertShard {
    fn default() -> Self {
        ExpertShard {
            rank: 0,
            ranks: 1,
            dispatch: false,
            context: false,
            placement: None,
        }
    }
}

impl ExpertShard {
    /// The rank holding routed expert `expert` of `experts` in MoE layer `key` (the layer's
    /// index, MTP layers after the main ones): the placement's (its primary copy), or the
    /// contiguous shares (`experts` divides by `ranks`).
    pub fn owner(&self, key: u32, expert: usize, experts: usize) -> usize {
        self.placement
            .and_then(|p| p.owner(key, expert))
            .unwrap_or(expert / (experts / self.ranks).max(1))
    }

    /// This rank holds the expert's primary copy (it computes the expert where every rank
    /// runs the same tokens and gathers the outputs).
    pub fn owns(&self, key: u32, expert: usize, experts: usize) -> bool {
        self.owner(key, expert, experts) == self.rank
    }

    /// This rank holds a copy of the expert (loads its weights; serves dispatched tokens).
    pub fn holds(&self, key: u32, expert: usize, experts: usize) -> bool {
        match self.placement.and_then(|p| p.holders(key, expert)) {
            Some(h) => h.iter().any(|&r| r as usize == self.rank),
            None => self.owns(key, expert, experts),
        }
    }

    /// Where this rank's `n` tokens for the expert are computed ([`ExpertPlacement::split`]):
    /// (rank, share of the tokens) pairs, one pair without redundant copies.
    pub fn split(
        &self,
        key: u32,
        expert: usize,
        experts: usize,
        n: usize,
    ) -> Vec<(usize, Range<usize>)> {
        self.placement
            .and_then(|p| p.split(key, expert, self.rank, n))
            .unwrap_or_else(|| vec![(self.owner(key, expert, experts), 0..n)])
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
        if let Some(p) = self.placement {
            if p.ranks != self.ranks || p.experts != experts {
                let what = if p.experts != experts {
                    format!(
                        "holds the loads of {} routed experts per layer; this model has \
                         {experts}: give the summary.json of a run of this model",
                        p.experts
                    )
                } else {
                    format!(
                        "was placed over {} ranks; this group has {}: make the placement for \
                         as many ranks",
                        p.ranks, self.ranks
                    )
                };
                return Err(ModelError::Options(format!(
                    "the expert placement (--expert-placement) {what}"
                )));
            }
            if p.redundant > 0 && !self.dispatch {
                return Err(ModelError::Options(format!(
                    "--redundant-experts {}: redundant expert copies serve dispatched tokens \
                     (--parallel data-expert or context); where every rank runs the same tokens \
                     (--parallel expert, tensor-expert) give none",
                    p.redundant
                )));
            }
        }
        if self.context && !self.dispatch {
            return Err(ModelError::Options(
                "prefill context parallelism runs on data-parallel attention with dispatched \
                 experts (dispatch with context)"
                    .into(),
            ));
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
#[allow(clippy::too_many_arguments)]
pub(crate) fn gather(
    comm: Option<&dyn Communicator>,
    shard: ExpertShard,
    key: u32,
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
        let r = shard.owner(key, id, experts);
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

/// `compute(key, id, rows, weights, n)`: routed expert `id` of the MoE layer whose checkpoint
/// index is `key`, over `n` rows another rank (or this one) dispatched here.
pub(crate) type ServeExpert<'a> =
    dyn Fn(u32, usize, &[f32], &[f32], usize) -> Result<Vec<f32>> + Sync + 'a;

/// The expert a dispatched round asks for: `experts` of the MoE layer `key` (None: no such
/// layer here), expert `id` of them (None where another rank holds it).
pub(crate) fn served_expert<T>(experts: Option<&[Option<T>]>, key: u32, id: usize) -> Result<&T> {
    let experts = experts.ok_or_else(|| {
        ModelError::Options(format!(
            "expert dispatch: a rank sent tokens for MoE layer {key}, which this rank has not \
             loaded (every rank must load the same layers, MTP included)"
        ))
    })?;
    experts.get(id).and_then(Option::as_ref).ok_or_else(|| {
        ModelError::Options(format!(
            "expert dispatch: a rank sent tokens for expert {id} of layer {key}, which this \
             rank does not hold"
        ))
    })
}

/// What a rank brings to one round of dispatched expert parallelism (data-parallel attention,
/// [`ExpertShard::dispatch`]): a MoE layer of its own batch, or the end of its step.
pub(crate) enum Turn<'a> {
    /// MoE layer `key` of this rank's batch: the layer's input rows `x` (`h` floats per
    /// token), its active experts in id order and each expert's (token, weight) pairs.
    Layer {
        key: u32,
        x: &'a [f32],
        active: &'a [usize],
        assigned: &'a [Vec<(usize, f32)>],
    },
    /// This rank's step is over; `more`: it has work for another step.
    Done { more: bool },
    /// This rank begins a forward under prefill context parallelism
    /// ([`ExpertShard::context`]) and tells every rank its prompts (`payload`); it serves
    /// the others' rounds meanwhile, as a finished rank does.
    Plan { payload: &'a [u8] },
}

/// What a round gave this rank.
enum Outcome {
    /// For [`Turn::Layer`]: the outputs of its active experts, in id order (`n × h` each).
    Outputs(Vec<Vec<f32>>),
    /// For [`Turn::Done`] while some rank was still in its step (this rank served it).
    Served,
    /// For [`Turn::Done`] when every rank's step was over: whether any rank has more work.
    AllDone { more: bool },
    /// A round without layers in which some rank began a forward ([`Turn::Plan`]): every
    /// rank's plan payload (empty for ranks whose step is over), in rank order.
    Plan(Vec<Vec<u8>>),
}

/// One expert's job from one rank: `n` tokens of layer `key`, rows `idx` of the rank's
/// `table` (its tokens' hidden states, each sent once whatever number of this rank's
/// experts it goes to).
struct Job<'a> {
    src: usize,
    key: u32,
    id: usize,
    n: usize,
    ws: Vec<f32>,
    idx: Vec<usize>,
    table: &'a [u8],
}

const TURN_LAYER: u8 = 1;
const TURN_DONE: u8 = 2;
const TURN_PLAN: u8 = 3;

/// One round of dispatched expert parallelism (the seed's attention-DP ranks with experts split
/// over all of them, `attn_tp_size: 1, moe_tp_size: 1`): each rank sends every other rank the
/// rows of its tokens routed to that rank's experts (with the routing weights), every rank runs
/// its experts over all the rows it received, and the outputs go back to their tokens' ranks
/// (two [`Communicator::all_to_all`]s). `compute(key, id, rows, weights, n)` is expert `id` of
/// MoE layer `key` over `n` rows. A rank whose step is over ([`Turn::Done`]) still serves the
/// others' tokens, so ranks with different batches (or none) step together; the rows of each
/// expert are computed together whatever rank they came from.
fn dispatch_round(
    comm: Option<&dyn Communicator>,
    shard: ExpertShard,
    h: usize,
    experts: usize,
    turn: Turn<'_>,
    compute: &ServeExpert<'_>,
) -> Result<Outcome> {
    use rayon::prelude::*;
    let comm = comm.ok_or_else(|| {
        ModelError::Options(format!(
            "this model dispatches tokens to the routed experts of {} ranks (data-parallel \
             attention with expert parallelism) and needs the group's communicator \
             (set_communicator) to run",
            shard.ranks
        ))
    })?;
    let err = |m: String| ModelError::Options(format!("expert dispatch: {m}"));
    let ranks = shard.ranks;
    // Dispatch: to each rank, this rank's turn and the rows of its experts.
    let mut parts: Vec<Vec<u8>> = vec![Vec::new(); ranks];
    match &turn {
        Turn::Layer {
            key,
            x,
            active,
            assigned,
        } => {
            // Each active expert's tokens by the rank that computes them (a share each for
            // an expert with redundant copies).
            let splits: Vec<Vec<(usize, Range<usize>)>> = active
                .iter()
                .map(|&id| shard.split(*key, id, experts, assigned[id].len()))
                .collect();
            // To rank s: the rows of the tokens any of its experts takes (each once), then per
            // expert its id, its tokens' places among those rows and their weights.
            for (s, part) in parts.iter_mut().enumerate() {
                let mine: Vec<(usize, &[(usize, f32)])> = active
                    .iter()
                    .zip(&splits)
                    .flat_map(|(&id, split)| {
                        split
                            .iter()
                            .filter(move |(r, _)| *r == s)
                            .map(move |(_, range)| (id, &assigned[id][range.clone()]))
                    })
                    .collect();
                let mut tokens: Vec<usize> = mine
                    .iter()
                    .flat_map(|(_, pairs)| pairs.iter().map(|&(t, _)| t))
                    .collect();
                tokens.sort_unstable();
                tokens.dedup();
                part.push(TURN_LAYER);
                part.extend_from_slice(&key.to_le_bytes());
                part.extend_from_slice(&(tokens.len() as u32).to_le_bytes());
                part.extend_from_slice(&(mine.len() as u32).to_le_bytes());
                for &t in &tokens {
                    for v in &x[t * h..(t + 1) * h] {
                        part.extend_from_slice(&v.to_le_bytes());
                    }
                }
                for (id, pairs) in mine {
                    part.extend_from_slice(&(id as u32).to_le_bytes());
                    part.extend_from_slice(&(pairs.len() as u32).to_le_bytes());
                    for &(t, _) in pairs {
                        let i = tokens.binary_search(&t).expect("every token is listed");
                        part.extend_from_slice(&(i as u32).to_le_bytes());
                    }
                    for &(_, w) in pairs {
                        part.extend_from_slice(&w.to_le_bytes());
                    }
                }
            }
        }
        Turn::Done { more } => {
            for part in &mut parts {
                part.extend_from_slice(&[TURN_DONE, *more as u8]);
            }
        }
        Turn::Plan { payload } => {
            for part in &mut parts {
                part.push(TURN_PLAN);
                part.extend_from_slice(payload);
            }
        }
    }
    let received = comm.all_to_all(&parts).map_err(|e| err(e.to_string()))?;
    drop(parts);
    // Every rank sees every turn, so all agree whether outputs go back (a second exchange).
    let any_layer = received.iter().any(|b| b.first() == Some(&TURN_LAYER));
    // What each rank asked of this one, computed: the replies, and whether any rank has work
    // left.
    let served = (|| -> Result<(Vec<Vec<u8>>, bool)> {
        let mut jobs: Vec<Job> = Vec::new();
        let mut any_more = false;
        for (src, b) in received.iter().enumerate() {
            let bad = || {
                err(format!(
                    "rank {src} sent a malformed request of {} bytes (the ranks run different \
                     builds or models)",
                    b.len()
                ))
            };
            let u32_at = |at: usize| -> Result<u32> {
                b.get(at..at + 4)
                    .map(|s| u32::from_le_bytes(s.try_into().expect("4 bytes")))
                    .ok_or_else(bad)
            };
            match b.first() {
                Some(&TURN_DONE) if b.len() == 2 => any_more |= b[1] != 0,
                Some(&TURN_PLAN) => {}
                Some(&TURN_LAYER) => {
                    let key = u32_at(1)?;
                    let n_rows = u32_at(5)? as usize;
                    let count = u32_at(9)? as usize;
                    let table = b.get(13..13 + n_rows * h * 4).ok_or_else(bad)?;
                    let mut at = 13 + n_rows * h * 4;
                    for _ in 0..count {
                        let id = u32_at(at)? as usize;
                        let n = u32_at(at + 4)? as usize;
                        at += 8;
                        if id >= experts || !shard.holds(key, id, experts) {
                            return Err(err(format!(
                                "rank {src} sent tokens for expert {id}, which rank {} does not \
                                 hold (the ranks split the experts differently)",
                                shard.rank
                            )));
                        }
                        let idx = (0..n)
                            .map(|j| {
                                let i = u32_at(at + 4 * j)? as usize;
                                if i < n_rows {
                                    Ok(i)
                                } else {
                                    Err(bad())
                                }
                            })
                            .collect::<Result<Vec<usize>>>()?;
                        at += n * 4;
                        let wb = b.get(at..at + n * 4).ok_or_else(bad)?;
                        let ws = wb
                            .chunks_exact(4)
                            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                            .collect();
                        at += n * 4;
                        jobs.push(Job {
                            src,
                            key,
                            id,
                            n,
                            ws,
                            idx,
                            table,
                        });
                    }
                    if at != b.len() {
                        return Err(bad());
                    }
                }
                _ => return Err(bad()),
            }
        }
        if !any_layer {
            // Every rank's step is over: nothing to compute, nothing to send back.
            return Ok((Vec::new(), any_more));
        }
        // Each (layer, expert) over the rows of every rank that sent it some, in rank order.
        let mut groups: Vec<(u32, usize, Vec<usize>)> = Vec::new();
        let mut order: Vec<usize> = (0..jobs.len()).collect();
        order.sort_by_key(|&j| (jobs[j].key, jobs[j].id, jobs[j].src));
        for j in order {
            match groups.last_mut() {
                Some((k, id, members)) if *k == jobs[j].key && *id == jobs[j].id => members.push(j),
                _ => groups.push((jobs[j].key, jobs[j].id, vec![j])),
            }
        }
        let run = |(key, id, members): &(u32, usize, Vec<usize>)| -> Result<Vec<f32>> {
            let n: usize = members.iter().map(|&j| jobs[j].n).sum();
            let mut xs = Vec::with_capacity(n * h);
            let mut ws = Vec::with_capacity(n);
            for &j in members {
                for &i in &jobs[j].idx {
                    xs.extend(
                        jobs[j].table[i * h * 4..(i + 1) * h * 4]
                            .chunks_exact(4)
                            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])),
                    );
                }
                ws.extend_from_slice(&jobs[j].ws);
            }
            compute(*key, *id, &xs, &ws, n)
        };
        // Many experts: each on one thread (one fork/join); few: each with parallel products.
        let outs: Vec<Vec<f32>> = if groups.len() >= 2 * rayon::current_num_threads() {
            groups
                .par_iter()
                .map(|g| cachalot_kernels::serial(|| run(g)))
                .collect::<Result<_>>()?
        } else {
            groups.iter().map(run).collect::<Result<_>>()?
        };
        // Combine: each job's outputs back to its rank, in the order it sent them.
        let mut slices: Vec<Option<&[f32]>> = vec![None; jobs.len()];
        for ((_, _, members), y) in groups.iter().zip(&outs) {
            let mut at = 0;
            for &j in members {
                slices[j] = Some(&y[at * h..(at + jobs[j].n) * h]);
                at += jobs[j].n;
            }
        }
        // Each reply opens with this rank's status (0: served).
        let mut replies: Vec<Vec<u8>> = vec![vec![0u8]; ranks];
        for (j, job) in jobs.iter().enumerate() {
            let y = slices[j].expect("every job is in a group");
            let reply = &mut replies[job.src];
            for v in y {
                reply.extend_from_slice(&v.to_le_bytes());
            }
        }
        Ok((replies, any_more))
    })();
    if !any_layer {
        let plans = received.iter().any(|b| b.first() == Some(&TURN_PLAN));
        return served.map(|(_, more)| {
            if plans {
                Outcome::Plan(
                    received
                        .iter()
                        .map(|b| match b.split_first() {
                            Some((&TURN_PLAN, rest)) => rest.to_vec(),
                            _ => Vec::new(),
                        })
                        .collect(),
                )
            } else {
                Outcome::AllDone { more }
            }
        });
    }
    // A rank that cannot serve still takes part in the second exchange, saying so to every
    // rank: all of them fail this round together (none goes on to a collective the others
    // are not in).
    let (replies, failed) = match served {
        Ok((replies, _)) => (replies, None),
        Err(e) => (vec![vec![1u8]; ranks], Some(e)),
    };
    let mut back = comm.all_to_all(&replies).map_err(|e| err(e.to_string()))?;
    if let Some(e) = failed {
        return Err(e);
    }
    if let Some(s) = (0..ranks).find(|&s| back[s].first() != Some(&0)) {
        return Err(err(format!(
            "rank {s} could not serve its experts this round (its log says why)"
        )));
    }
    for b in &mut back {
        b.remove(0);
    }
    match turn {
        Turn::Done { .. } | Turn::Plan { .. } => Ok(Outcome::Served),
        Turn::Layer {
            key,
            active,
            assigned,
            ..
        } => {
            let mut offsets = vec![0usize; ranks];
            let mut out = Vec::with_capacity(active.len());
            for &id in active {
                // The shares in token order, each from the rank that computed it.
                let mut y = Vec::with_capacity(assigned[id].len() * h);
                for (s, range) in shard.split(key, id, experts, assigned[id].len()) {
                    let n = range.len() * h * 4;
                    let raw = back[s].get(offsets[s]..offsets[s] + n).ok_or_else(|| {
                        err(format!(
                            "rank {s} sent back {} bytes, fewer than its experts' outputs need",
                            back[s].len()
                        ))
                    })?;
                    offsets[s] += n;
                    y.extend(
                        raw.chunks_exact(4)
                            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
                    );
                }
                out.push(y);
            }
            if let Some(s) = (0..ranks).find(|&s| back[s].len() != offsets[s]) {
                return Err(err(format!(
                    "rank {s} sent back {} bytes, its experts' outputs are {}",
                    back[s].len(),
                    offsets[s]
                )));
            }
            Ok(Outcome::Outputs(out))
        }
    }
}

/// A MoE layer's round ([`dispatch_round`] with a [`Turn::Layer`]): the outputs of the
/// layer's active experts, in id order.
pub(crate) fn dispatch_layer(
    comm: Option<&dyn Communicator>,
    shard: ExpertShard,
    h: usize,
    experts: usize,
    turn: Turn<'_>,
    compute: &ServeExpert<'_>,
) -> Result<Vec<Vec<f32>>> {
    match dispatch_round(comm, shard, h, experts, turn, compute)? {
        Outcome::Outputs(ys) => Ok(ys),
        _ => Err(ModelError::Options(
            "expert dispatch: a layer's round returned no outputs".into(),
        )),
    }
}

/// The end of a rank's step under dispatched expert parallelism: serves the other ranks'
/// tokens ([`dispatch_round`] with [`Turn::Done`]) until every rank's step is over; returns
/// whether any rank has more work (`more` is this rank's). Every rank calls it once per step,
/// a rank without work too, until it returns false on all of them (the same round everywhere).
/// `on_plan`: under prefill context parallelism, another rank began a forward with these plans
/// ([`Outcome::Plan`]); this rank takes its part of it.
pub(crate) fn end_step(
    comm: Option<&dyn Communicator>,
    shard: ExpertShard,
    h: usize,
    experts: usize,
    more: bool,
    compute: &ServeExpert<'_>,
    on_plan: &dyn Fn(Vec<Vec<u8>>) -> Result<()>,
) -> Result<bool> {
    loop {
        match dispatch_round(comm, shard, h, experts, Turn::Done { more }, compute)? {
            Outcome::AllDone { more } => return Ok(more),
            Outcome::Served => continue,
            Outcome::Plan(plans) => on_plan(plans)?,
            Outcome::Outputs(_) => {
                return Err(ModelError::Options(
                    "expert dispatch: a finished step's round returned outputs".into(),
                ))
            }
        }
    }
}

/// The first round of a forward under prefill context parallelism ([`ExpertShard::context`]):
/// sends every rank this rank's `payload` (its prompts) and serves the others' MoE rounds until
/// a round in which every rank either begins a forward too or has finished its step; returns
/// every rank's payload, in rank order (empty for finished ranks).
pub(crate) fn plan_round(
    comm: Option<&dyn Communicator>,
    shard: ExpertShard,
    h: usize,
    experts: usize,
    payload: &[u8],
    compute: &ServeExpert<'_>,
) -> Result<Vec<Vec<u8>>> {
    loop {
        match dispatch_round(comm, shard, h, experts, Turn::Plan { payload }, compute)? {
            Outcome::Plan(plans) => return Ok(plans),
            Outcome::Served => continue,
            _ => {
                return Err(ModelError::Options(
                    "expert dispatch: a plan round ended without the plans".into(),
                ))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// Every placement gives each rank E/ranks experts, each expert one rank, and is never
    /// less even than the contiguous shares by more than the greedy bound (the busiest rank at
    /// most the mean plus one expert's load); a skewed load is spread.
    #[test]
    fn placements_hold_equal_counts_and_even_the_load() {
        let mut seed = 11u64;
        let mut next = || {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            seed >> 33
        };
        for case in 0..200 {
            let ranks = [1usize, 2, 3, 4, 8][case % 5];
            let experts = ranks * (1 + (next() % 8) as usize);
            let loads: Vec<u64> = (0..experts).map(|_| next() % 1000).collect();
            let owner = place_layer(&loads, ranks);
            let mut held = vec![0usize; ranks];
            let mut sum = vec![0u64; ranks];
            for (e, &r) in owner.iter().enumerate() {
                held[r as usize] += 1;
                sum[r as usize] += loads[e];
            }
            assert!(held.iter().all(|&h| h == experts / ranks), "{held:?}");
            let mean = loads.iter().sum::<u64>() as f64 / ranks as f64;
            let top = *loads.iter().max().unwrap() as f64;
            let busiest = *sum.iter().max().unwrap() as f64;
            assert!(busiest <= mean + top, "case {case}: {sum:?} {loads:?}");
        }
        // Experts 0 and 1 take most tokens: contiguous shares put both on rank 0.
        let loads = [900u64, 800, 10, 10, 10, 10, 10, 10];
        let owner = place_layer(&loads, 2);
        // Greedy by load: 900 to rank 0, then rank 1 (the lighter) fills with 800 and three
        // tens before rank 0 takes the rest.
        assert_eq!(owner, [0, 1, 1, 1, 1, 0, 0, 0]);
        let by = |o: &[u16]| crate::eplb::balancedness(&loads, 2, |e| o[e] as usize);
        // 930 and 830 tokens against 1720 and 40.
        assert!(by(&owner) > 0.94 && crate::eplb::balancedness(&loads, 2, |e| e / 4) < 0.52);
        // Placement by layer key; layers without loads keep contiguous shares.
        let p = ExpertPlacement::from_loads(&[(3, loads.to_vec())], 8, 2, 0).unwrap();
        let shard = ExpertShard {
            rank: 1,
            ranks: 2,
            placement: Some(p.leak()),
            ..Default::default()
        };
        assert_eq!(shard.owner(3, 1, 8), owner[1] as usize);
        assert_eq!((shard.owner(2, 1, 8), shard.owner(2, 7, 8)), (0, 1));
        assert!(shard.validate(8).is_ok());
        let e = shard.validate(16).unwrap_err().to_string();
        assert!(e.contains("--expert-placement"), "{e}");
        assert!(ExpertPlacement::from_loads(&[(0, vec![1, 2, 3])], 3, 2, 0).is_err());
        // A layer key from a damaged file is refused, not allocated for.
        assert!(ExpertPlacement::from_loads(&[(u32::MAX, vec![1, 2])], 2, 2, 0).is_err());
    }

    /// With redundant copies every rank holds (E + R)/ranks experts of a placed layer, each
    /// expert's copies sit on different ranks, the copies go to the busiest experts (tokens per
    /// copy), and a token's share of an expert is computed by one of its copies; infeasible
    /// counts are refused with the reason.
    #[test]
    fn redundant_copies_fill_every_rank_on_distinct_ranks() {
        let mut seed = 5u64;
        let mut next = || {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            seed >> 33
        };
        for case in 0..400 {
            let ranks = [2usize, 3, 4, 8][case % 4];
            let experts = ranks * (1 + (next() % 6) as usize);
            // Any multiple of the ranks up to one copy of each expert on every rank.
            let most = experts * (ranks - 1) / ranks;
            let redundant = ranks * (next() as usize % (most + 1));
            let loads: Vec<u64> = (0..experts)
                .map(|e| {
                    if e % 5 == 0 {
                        next() % 10_000
                    } else {
                        next() % 100
                    }
                })
                .collect();
            let holders = place_layer_with(&loads, ranks, redundant).unwrap();
            let mut held = vec![0usize; ranks];
            for h in &holders {
                assert!(!h.is_empty());
                let mut d = h.clone();
                d.sort_unstable();
                d.dedup();
                assert_eq!(d.len(), h.len(), "case {case}: copies on one rank {h:?}");
                for &r in h {
                    held[r as usize] += 1;
                }
            }
            assert!(
                held.iter().all(|&n| n == (experts + redundant) / ranks),
                "case {case}: {held:?}"
            );
            // A copy never goes to an expert with fewer tokens per copy than one left single.
            let per = |e: usize| loads[e] as f64 / holders[e].len() as f64;
            for a in 0..experts {
                for b in 0..experts {
                    if holders[a].len() > 1 && holders[b].len() == 1 {
                        assert!(
                            loads[a] as f64 / (holders[a].len() - 1) as f64 >= per(b),
                            "case {case}: {a} copied before {b}"
                        );
                    }
                }
            }
        }
        assert!(place_layer_with(&[1, 2, 3, 4], 2, 1)
            .unwrap_err()
            .contains("multiple of the ranks"));
        assert!(place_layer_with(&[1, 2], 2, 4)
            .unwrap_err()
            .contains("one copy of each expert per rank"));
        // Shares: in token order, each to a different copy, together all of the tokens.
        let loads = [900u64, 10, 10, 10];
        let p = ExpertPlacement::from_loads(&[(2, loads.to_vec())], 4, 2, 2).unwrap();
        assert_eq!(p.holders(2, 0).unwrap().len(), 2);
        assert_eq!(p.holders(5, 0), None);
        for src in 0..2 {
            for n in 0..6 {
                let split = p.split(2, 0, src, n).unwrap();
                let mut at = 0;
                for (r, range) in &split {
                    assert_eq!(range.start, at);
                    at = range.end;
                    assert!(p.holders(2, 0).unwrap().contains(&(*r as u16)));
                }
                assert_eq!(at, n);
                // Expert 3 (the fewest tokens, the last id) has no copy.
                let one = p.split(2, 3, src, n).unwrap();
                assert!(one.len() <= 1 && one.iter().all(|(_, r)| r.len() == n));
            }
            // The two ranks' odd token goes to different copies.
            assert_ne!(
                p.split(2, 0, 0, 1).unwrap()[0].0,
                p.split(2, 0, 1, 1).unwrap()[0].0
            );
        }
        // Copies serve dispatched tokens only.
        let gathered = ExpertShard {
            rank: 0,
            ranks: 2,
            placement: Some(p.leak()),
            ..Default::default()
        };
        let e = gathered.validate(4).unwrap_err().to_string();
        assert!(e.contains("--redundant-experts"), "{e}");
        assert!(ExpertShard {
            dispatch: true,
            ..gathered
        }
        .validate(4)
        .is_ok());
    }

    /// Runs `f(shard, comm)` on `ranks` in-process ranks of dispatched experts (placed by
    /// `placement`), each on its own thread; their results in rank order.
    fn on_ranks<T: Send>(
        ranks: usize,
        placement: Option<&'static ExpertPlacement>,
        f: impl Fn(ExpertShard, &dyn Communicator) -> T + Sync,
    ) -> Vec<T> {
        let comms = cachalot_comm::local_group(ranks, Duration::from_secs(20)).unwrap();
        let f = &f;
        std::thread::scope(|scope| {
            let handles: Vec<_> = comms
                .iter()
                .enumerate()
                .map(|(rank, comm)| {
                    scope.spawn(move || {
                        let shard = ExpertShard {
                            rank,
                            ranks,
                            dispatch: true,
                            context: false,
                            placement,
                        };
                        f(shard, comm)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    /// Dispatched tokens of an expert with copies are computed in shares on its copies' ranks
    /// and come back in token order: every rank gets each expert's outputs as if one rank had
    /// computed them, and the copies' ranks each serve a share.
    #[test]
    fn dispatch_to_copies_returns_outputs_in_token_order() {
        let (ranks, h, experts, key) = (3usize, 2usize, 3usize, 4u32);
        // Expert 0 takes most tokens: copies on every rank (3 + 6 = 9 = 3 ranks × 3).
        let loads = vec![(key, vec![1000u64, 10, 10])];
        let p = ExpertPlacement::from_loads(&loads, experts, ranks, 6)
            .unwrap()
            .leak();
        assert_eq!(p.holders(key, 0).unwrap().len(), 3);
        let served = on_ranks(ranks, Some(p), |shard, comm| {
            let rank = shard.rank;
            let served = std::sync::atomic::AtomicUsize::new(0);
            // Expert id's output: each row times (id + 1).
            let compute = |k: u32, id: usize, x: &[f32], _w: &[f32], n: usize| {
                assert_eq!(k, key);
                assert!(shard.holds(k, id, experts), "rank {rank} expert {id}");
                served.fetch_add(n, std::sync::atomic::Ordering::Relaxed);
                Ok(x.iter().map(|v| v * (id + 1) as f32).collect())
            };
            // Rank r: 4 + r tokens, all to expert 0, even ones to expert 2 too.
            let t_count = 4 + rank;
            let x: Vec<f32> = (0..t_count * h).map(|i| (rank * 100 + i) as f32).collect();
            let assigned = vec![
                (0..t_count).map(|t| (t, 1.0f32)).collect::<Vec<_>>(),
                Vec::new(),
                (0..t_count).step_by(2).map(|t| (t, 0.5f32)).collect(),
            ];
            let turn = Turn::Layer {
                key,
                x: &x,
                active: &[0, 2],
                assigned: &assigned,
            };
            let ys = dispatch_layer(Some(comm), shard, h, experts, turn, &compute).unwrap();
            end_step(Some(comm), shard, h, experts, false, &compute, &|_| Ok(())).unwrap();
            for (y, id) in ys.iter().zip([0usize, 2]) {
                let want: Vec<f32> = assigned[id]
                    .iter()
                    .flat_map(|&(t, _)| x[t * h..(t + 1) * h].to_vec())
                    .map(|v| v * (id + 1) as f32)
                    .collect();
                assert_eq!(y, &want, "rank {rank} expert {id}");
            }
            served.load(std::sync::atomic::Ordering::Relaxed)
        });
        // 15 tokens of expert 0 over three copies, 8 of expert 2 on one rank.
        assert_eq!(served.iter().sum::<usize>(), 15 + 2 + 3 + 3);
        assert!(served.iter().all(|&n| n >= 4), "{served:?}");
    }

    /// A rank that fails to serve a round (here its expert errs) still takes part in the
    /// round's second exchange and says so: every rank reports an error for that round — the
    /// one that asked it, the one that failed, and one that was only serving (its step over) —
    /// and their next collective pairs up as it should.
    #[test]
    fn a_failed_round_fails_every_rank_in_step() {
        let (h, experts) = (2usize, 3usize);
        let results = on_ranks(3, None, |shard, comm| {
            let rank = shard.rank;
            let compute = |_key: u32, _id: usize, _x: &[f32], _w: &[f32], _n: usize| {
                Err(ModelError::Options(format!("rank {rank}'s expert failed")))
            };
            let got = if rank == 0 {
                // One token for expert 1, which rank 1 holds.
                let x = [1.0f32, 2.0];
                let assigned = vec![Vec::new(), vec![(0usize, 1.0f32)], Vec::new()];
                let turn = Turn::Layer {
                    key: 3,
                    x: &x,
                    active: &[1],
                    assigned: &assigned,
                };
                dispatch_layer(Some(comm), shard, h, experts, turn, &compute).map(|_| ())
            } else {
                end_step(Some(comm), shard, h, experts, false, &compute, &|_| Ok(())).map(|_| ())
            };
            let after = comm.all_gather(&[rank as u8 + 10]).unwrap();
            (got, after)
        });
        for (rank, (got, after)) in results.into_iter().enumerate() {
            let e = got.unwrap_err().to_string();
            let want = if rank == 1 {
                "rank 1's expert failed"
            } else {
                "rank 1 could not serve its experts"
            };
            assert!(e.contains(want), "rank {rank}: {e}");
            assert_eq!(
                after,
                vec![vec![10u8], vec![11u8], vec![12u8]],
                "rank {rank}"
            );
        }
    }
}
