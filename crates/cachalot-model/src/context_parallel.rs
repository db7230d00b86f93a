//! Prefill context parallelism, the parts both model families share (executor spec §4.5; the
//! models' own parts are `DeepseekV3::forward_cp` and `DeepseekV4::forward_cp`).
//!
//! Under `ExpertShard::context` every rank's prompts (sequences of a batch that start at
//! position 0 with more than one token) are computed by all ranks: a prompt of length L is cut
//! into 2·ranks pieces of ⌈L / 2·ranks⌉ tokens and rank r computes pieces r and
//! 2·ranks − 1 − r (zigzag, so the causal work is even). The first round of such a forward
//! sends every rank the prompts of every other ([`plan_payload`], [`parse_prompts`]); at every
//! layer the ranks' rows of each prompt are gathered ([`gather_rows`]) so each piece sees every
//! position before it; at the end each prompt's hidden rows go back to the rank that owns it
//! ([`send_rows_home`], [`own_rows`]), which keeps its KV and decodes it.

use cachalot_comm::Communicator;

use crate::batch::{Batch, LogitsWanted};
use crate::error::{ModelError, Result};
use crate::expert_parallel::{ExpertShard, ServeExpert};
use crate::profile::{Phase, Timer};

/// A context-parallel failure, named as such.
pub(crate) fn cp_err(m: String) -> ModelError {
    ModelError::Options(format!("context parallelism: {m}"))
}

/// A prompt of some rank's batch: its rank, its sequence there, its tokens.
pub(crate) struct CpPrompt {
    pub owner: usize,
    pub seq: usize,
    pub tokens: Vec<u32>,
}

/// Whether sequence `s` of `b` is a prompt computed by every rank: it starts at position 0 and
/// has more than one token.
pub(crate) fn is_prompt(b: &Batch, s: usize) -> bool {
    let r = b.seq_starts[s]..b.seq_starts[s + 1];
    r.len() > 1 && b.positions[r.start] == 0
}

/// This rank's plan: its prompts (count, then per prompt its sequence, length and tokens).
pub(crate) fn plan_payload(b: &Batch) -> Vec<u8> {
    let mine: Vec<usize> = (0..b.num_seqs()).filter(|&s| is_prompt(b, s)).collect();
    let mut payload = Vec::new();
    payload.extend_from_slice(&(mine.len() as u32).to_le_bytes());
    for &s in &mine {
        let r = b.seq_starts[s]..b.seq_starts[s + 1];
        payload.extend_from_slice(&(s as u32).to_le_bytes());
        payload.extend_from_slice(&(r.len() as u32).to_le_bytes());
        for &t in &b.tokens[r] {
            payload.extend_from_slice(&t.to_le_bytes());
        }
    }
    payload
}

/// Every rank's prompts from the plan payloads, in rank order; checks that this rank's
/// batch (`own`) kept all of its prompts.
pub(crate) fn parse_prompts(
    plans: &[Vec<u8>],
    rank: usize,
    own: Option<&Batch>,
) -> Result<Vec<CpPrompt>> {
    let mut out = Vec::new();
    for (owner, b) in plans.iter().enumerate() {
        if b.is_empty() {
            continue;
        }
        let bad = || {
            cp_err(format!(
                "rank {owner} sent a malformed plan of {} bytes",
                b.len()
            ))
        };
        let u = |at: usize| -> Result<usize> {
            b.get(at..at + 4)
                .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]) as usize)
                .ok_or_else(bad)
        };
        let count = u(0)?;
        let mut at = 4;
        for _ in 0..count {
            let (seq, len) = (u(at)?, u(at + 4)?);
            at += 8;
            let tokens = (0..len)
                .map(|i| u(at + 4 * i).map(|t| t as u32))
                .collect::<Result<Vec<u32>>>()?;
            at += 4 * len;
            out.push(CpPrompt { owner, seq, tokens });
        }
        if at != b.len() {
            return Err(bad());
        }
    }
    if let Some(b) = own {
        let mine = out.iter().filter(|p| p.owner == rank).count();
        if mine != (0..b.num_seqs()).filter(|&s| is_prompt(b, s)).count() {
            return Err(cp_err("the plans lost this rank's prompts".into()));
        }
    }
    Ok(out)
}

/// Every rank's prompts of this forward: from `given` (a rank joining from `end_step`), or from
/// the plan round that sends this rank's batch `own`'s prompts to every rank (serving the
/// others' MoE rounds meanwhile with `serve`).
pub(crate) fn prompts_of_step(
    comm: &dyn Communicator,
    shard: ExpertShard,
    h: usize,
    experts: usize,
    own: Option<&Batch>,
    given: Option<Vec<Vec<u8>>>,
    serve: &ServeExpert<'_>,
) -> Result<Vec<CpPrompt>> {
    let plans = match given {
        Some(p) => p,
        None => {
            let b = own.ok_or_else(|| cp_err("a forward without a batch or plans".into()))?;
            crate::expert_parallel::plan_round(
                Some(comm),
                shard,
                h,
                experts,
                &plan_payload(b),
                serve,
            )?
        }
    };
    parse_prompts(&plans, shard.rank, own)
}

/// Rank `rank`'s pieces `[start, end)` of a prompt of `len` tokens split over `ranks`: pieces
/// `rank` and `2·ranks − 1 − rank` of ⌈len / 2·ranks⌉ tokens (empty ones left out).
pub(crate) fn cp_pieces(len: usize, rank: usize, ranks: usize) -> Vec<(usize, usize)> {
    let piece = len.div_ceil(2 * ranks);
    [rank, 2 * ranks - 1 - rank]
        .into_iter()
        .map(|k| ((k * piece).min(len), ((k + 1) * piece).min(len)))
        .filter(|(a, e)| a < e)
        .collect()
}

/// The sequences of `b` that are not prompts, in order, with their kinds and state slots:
/// what a rank runs by itself in a context-parallel step.
pub(crate) fn local_part(b: &Batch) -> Batch {
    let mut local = Batch::default();
    for s in (0..b.num_seqs()).filter(|&s| !is_prompt(b, s)) {
        let r = b.seq_starts[s]..b.seq_starts[s + 1];
        local.push_seq(
            &b.tokens[r.clone()],
            b.positions[r.start],
            b.block_tables[s].clone(),
            LogitsWanted::None,
        );
        local.mark(b.kind(s));
        local.set_state_slot(b.state_slot(s) as u32);
    }
    local
}

/// Every prompt's rows, gathered ([`gather_rows`]): one buffer, prompt after prompt in plan
/// order, each prompt's rows in position order.
pub(crate) struct Gathered {
    pub data: Vec<f32>,
    /// Prompt j's rows are rows `starts[j]..starts[j + 1]`.
    starts: Vec<usize>,
    width: usize,
}

impl Gathered {
    /// How many prompts.
    pub fn prompts(&self) -> usize {
        self.starts.len() - 1
    }

    /// Prompt `j`'s rows (`[len, width]`).
    pub fn prompt(&self, j: usize) -> &[f32] {
        &self.data[self.starts[j] * self.width..self.starts[j + 1] * self.width]
    }
}

/// Every prompt's rows of `width` values in position order, gathered from every rank's rows of
/// its pieces (`rows`: this rank's, prompt by prompt in plan order, piece by piece). `bf16`:
/// every value is a bf16 value already, so each travels in 2 bytes instead of 4.
pub(crate) fn gather_rows(
    comm: &dyn Communicator,
    prompts: &[CpPrompt],
    rows: &[f32],
    width: usize,
    bf16: bool,
    what: &str,
) -> Result<Gathered> {
    let _t = Timer::start(Phase::Reduce);
    let ranks = comm.world_size();
    let vb = if bf16 { 2 } else { 4 };
    let mut bytes = Vec::with_capacity(rows.len() * vb);
    for v in rows {
        if bf16 {
            bytes.extend_from_slice(&((v.to_bits() >> 16) as u16).to_le_bytes());
        } else {
            bytes.extend_from_slice(&v.to_le_bytes());
        }
    }
    let all = comm
        .all_gather(&bytes)
        .map_err(|e| cp_err(format!("gathering the {what}: {e}")))?;
    drop(bytes);
    let mut starts = vec![0usize];
    for p in prompts {
        starts.push(starts.last().copied().unwrap_or(0) + p.tokens.len());
    }
    let mut data = vec![0.0f32; starts.last().copied().unwrap_or(0) * width];
    for (r, part) in all.iter().enumerate() {
        let mut at = 0;
        for (j, p) in prompts.iter().enumerate() {
            for (a, e) in cp_pieces(p.tokens.len(), r, ranks) {
                let n = (e - a) * width;
                let src = part
                    .get(at * vb..(at + n) * vb)
                    .ok_or_else(|| cp_err(format!("rank {r} sent fewer {what} than its pieces")))?;
                let dst = (starts[j] + a) * width;
                for (o, c) in data[dst..dst + n].iter_mut().zip(src.chunks_exact(vb)) {
                    *o = if bf16 {
                        f32::from_bits((u16::from_le_bytes([c[0], c[1]]) as u32) << 16)
                    } else {
                        f32::from_le_bytes([c[0], c[1], c[2], c[3]])
                    };
                }
                at += n;
            }
        }
        if at * vb != part.len() {
            return Err(cp_err(format!("rank {r} sent more {what} than its pieces")));
        }
    }
    Ok(Gathered {
        data,
        starts,
        width,
    })
}

/// Sends each prompt's rows of `width` values (this rank's pieces; `seg_of[q]` the prompt of
/// this rank's q-th piece sequence, whose rows start at `rows_at[q]` in `rows`) to the prompt's
/// rank; returns what every rank sent here.
pub(crate) fn send_rows_home(
    comm: &dyn Communicator,
    prompts: &[CpPrompt],
    seg_of: &[usize],
    rows_at: &[usize],
    rows: &[f32],
    width: usize,
) -> Result<Vec<Vec<u8>>> {
    let (rank, ranks) = (comm.rank(), comm.world_size());
    let mut parts: Vec<Vec<u8>> = vec![Vec::new(); ranks];
    for (q, &j) in seg_of.iter().enumerate() {
        let mut row = rows_at[q];
        for (a, e) in cp_pieces(prompts[j].tokens.len(), rank, ranks) {
            let part = &mut parts[prompts[j].owner];
            part.extend_from_slice(&(j as u32).to_le_bytes());
            part.extend_from_slice(&(a as u32).to_le_bytes());
            part.extend_from_slice(&((e - a) as u32).to_le_bytes());
            for v in &rows[row * width..(row + e - a) * width] {
                part.extend_from_slice(&v.to_le_bytes());
            }
            row += e - a;
        }
    }
    comm.all_to_all(&parts)
        .map_err(|e| cp_err(format!("returning the prompts' hidden rows: {e}")))
}

/// This rank's batch `b`'s rows in its own order (`width` values a token): its other
/// sequences' from `rows` (where they come first, in order, as [`local_part`] lists them),
/// its prompts' from what the ranks sent back ([`send_rows_home`]); checks every row of its
/// prompts came.
pub(crate) fn own_rows(
    back: &[Vec<u8>],
    prompts: &[CpPrompt],
    rank: usize,
    b: &Batch,
    width: usize,
    rows: &[f32],
) -> Result<Vec<f32>> {
    let w = width;
    let mut out = vec![0.0f32; b.num_tokens() * w];
    let mut at = 0;
    for s in (0..b.num_seqs()).filter(|&s| !is_prompt(b, s)) {
        let r = b.seq_starts[s]..b.seq_starts[s + 1];
        out[r.start * w..r.end * w].copy_from_slice(&rows[at * w..(at + r.len()) * w]);
        at += r.len();
    }
    let mut filled = 0usize;
    for (r, msg) in back.iter().enumerate() {
        let bad = || cp_err(format!("rank {r} sent back malformed hidden rows"));
        let mut at = 0;
        while at < msg.len() {
            let u = |o: usize| -> Result<usize> {
                msg.get(at + o..at + o + 4)
                    .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]) as usize)
                    .ok_or_else(bad)
            };
            let (j, start, n) = (u(0)?, u(4)?, u(8)?);
            let p = prompts.get(j).filter(|p| p.owner == rank).ok_or_else(bad)?;
            if start + n > p.tokens.len() {
                return Err(bad());
            }
            let src = msg.get(at + 12..at + 12 + n * width * 4).ok_or_else(bad)?;
            let base = (b.seq_starts[p.seq] + start) * width;
            for (o, c) in out[base..base + n * width]
                .iter_mut()
                .zip(src.chunks_exact(4))
            {
                *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
            filled += n;
            at += 12 + n * width * 4;
        }
    }
    let want: usize = prompts
        .iter()
        .filter(|p| p.owner == rank)
        .map(|p| p.tokens.len())
        .sum();
    if filled != want {
        return Err(cp_err(format!(
            "{filled} of this rank's {want} prompt rows came back"
        )));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_cover_each_prompt_once() {
        for ranks in 1..6 {
            for len in 2..50 {
                let mut seen = vec![0u32; len];
                for r in 0..ranks {
                    for (a, e) in cp_pieces(len, r, ranks) {
                        for v in &mut seen[a..e] {
                            *v += 1;
                        }
                    }
                }
                assert!(seen.iter().all(|&v| v == 1), "len {len}, {ranks} ranks");
            }
        }
    }

    #[test]
    fn plans_round_trip_and_malformed_ones_are_named() {
        let mut b = Batch::default();
        b.push_seq(&[5, 6, 7], 0, vec![1], LogitsWanted::Last);
        b.push_seq(&[9], 4, vec![2], LogitsWanted::Last);
        b.push_seq(&[1, 2], 0, vec![3], LogitsWanted::Last);
        let plan = plan_payload(&b);
        let got = parse_prompts(&[Vec::new(), plan.clone()], 1, Some(&b)).unwrap();
        assert_eq!(got.len(), 2);
        assert_eq!(
            (got[0].owner, got[0].seq, &got[0].tokens[..]),
            (1, 0, &[5, 6, 7][..])
        );
        assert_eq!((got[1].seq, &got[1].tokens[..]), (2, &[1, 2][..]));
        let e = parse_prompts(&[plan[..plan.len() - 2].to_vec()], 0, None)
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("rank 0 sent a malformed plan"), "{e}");
        // A plan without this rank's prompts is refused.
        let e = parse_prompts(&[Vec::new(), Vec::new()], 1, Some(&b))
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("lost this rank's prompts"), "{e}");
        let local = local_part(&b);
        assert_eq!(local.tokens, vec![9]);
        assert_eq!(local.state_slot(0), 1);
    }
}
