//! Expert parallelism (`LoadOptions::expert_shard` + `DeepseekV3::set_communicator`): ranks that
//! each hold a share of the routed experts give, on every rank, the logits of the one-process
//! model bit for bit (a packed prefill and a batched step; MTP included), and hold only their
//! share of the expert weights.

use std::path::PathBuf;

mod common;

use cachalot_comm::run_local_group;
use cachalot_model::batch::{Batch, LogitsWanted};
use cachalot_model::{DeepseekV3, ExpertShard, LoadOptions};
use common::{bits, different_batches_on_two_ranks, forward_once, packed_run, packed_run_of};

fn r1_tiny() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/v3/r1_tiny")
}

fn load(shard: ExpertShard) -> DeepseekV3 {
    let opts = LoadOptions {
        load_mtp: true,
        expert_shard: shard,
        ..Default::default()
    };
    DeepseekV3::load(&r1_tiny(), opts).unwrap()
}

#[test]
fn expert_shards_give_the_one_process_logits() {
    let one = load(ExpertShard::default());
    let want = bits(&packed_run(&one));
    let full_bytes = one.weight_bytes();
    let n = 2;
    let got = run_local_group(n, |comm| {
        let mut m = load(ExpertShard {
            rank: comm.rank(),
            ranks: n,
            dispatch: false,
            context: false,
            placement: None,
        });
        m.set_communicator(comm).unwrap();
        (bits(&packed_run(&m)), m.weight_bytes())
    })
    .unwrap();
    for (r, (logits, bytes)) in got.iter().enumerate() {
        assert!(
            *logits == want,
            "rank {r}'s logits differ from one process's"
        );
        // Each rank holds half of the routed experts: less than the whole model.
        assert!(*bytes < full_bytes, "rank {r}: {bytes} of {full_bytes}");
        assert_eq!(*bytes, got[0].1);
    }
}

/// Two ranks with their own batches: in a first step rank 0 runs `prompts(0)` and rank 1
/// `prompts(1)` (through `run`: prefill, MTP, decode), in a second step only rank 1 runs
/// `second` while rank 0 serves from `end_step`; each rank's logits (`run`'s bits) must be the
/// ones `one` (a one-process model) gives for its own batches alone, and every rank's
/// `end_step` returns together, true while any rank has work. `rank_model` loads a rank's model
/// over the group's communicator; `what` names the case in failures.
fn two_steps_give_each_rank_its_own_logits<M>(
    prompts: impl Fn(usize) -> Vec<Vec<u32>> + Sync,
    second: &[Vec<u32>],
    one: &M,
    rank_model: impl Fn(std::sync::Arc<dyn cachalot_comm::Communicator>) -> M + Sync,
    run: impl Fn(&M, &[Vec<u32>]) -> Vec<u32> + Sync,
    end_step: impl Fn(&M, bool) -> bool + Sync,
    what: &str,
) {
    let want: Vec<(Vec<u32>, Vec<u32>)> = (0..2)
        .map(|r| {
            let later = if r == 1 { run(one, second) } else { Vec::new() };
            (run(one, &prompts(r)), later)
        })
        .collect();
    let got = run_local_group(2, |comm| {
        let rank = comm.rank();
        let m = rank_model(comm);
        let first = run(&m, &prompts(rank));
        let more_1 = end_step(&m, rank == 1);
        let later = if rank == 1 {
            run(&m, second)
        } else {
            Vec::new()
        };
        let more_2 = end_step(&m, false);
        ((first, later), more_1, more_2)
    })
    .unwrap();
    for (r, (logits, more_1, more_2)) in got.into_iter().enumerate() {
        assert!(more_1, "rank {r}: rank 1 said it had more work");
        assert!(!more_2, "rank {r}: no rank has work after step 2");
        assert!(
            logits.0 == want[r].0,
            "rank {r}'s first-step logits differ from one process's ({what})"
        );
        assert!(
            logits.1 == want[r].1,
            "rank {r}'s second-step logits differ from one process's ({what})"
        );
    }
}

/// Two ranks with their own batches (`ExpertShard::dispatch`, and `context` as given): in a
/// first step rank 0 runs two prompts and rank 1 one (prefill with every row's logits, MTP
/// over the prompts, a decode step), in a second step only rank 1 runs (two prompts, one of
/// 3 tokens) while rank 0 serves from `end_step`; each rank gets the logits one process gives
/// for its own batches alone, bit for bit.
fn own_batches_give_the_one_process_logits(context: bool) {
    let prompts = |rank: usize| -> Vec<Vec<u32>> {
        if rank == 0 {
            vec![
                (0..37).map(|i| (i * 7 + 3) % 500).collect(),
                (0..21).map(|i| (i * 13 + 5) % 500).collect(),
            ]
        } else {
            vec![(0..9).map(|i| (i * 31 + 2) % 500).collect()]
        }
    };
    let second: Vec<Vec<u32>> = vec![
        (0..13).map(|i| (i * 3 + 40) % 500).collect(),
        (0..13).map(|i| (i * 3 + 41) % 500).collect(),
        (0..3).map(|i| (i * 5 + 1) % 500).collect(),
    ];
    two_steps_give_each_rank_its_own_logits(
        prompts,
        &second,
        &load(ExpertShard::default()),
        |comm: std::sync::Arc<dyn cachalot_comm::Communicator>| {
            let mut m = load(ExpertShard {
                rank: comm.rank(),
                ranks: 2,
                dispatch: true,
                context,
                placement: None,
            });
            m.set_communicator(comm).unwrap();
            m
        },
        |m: &DeepseekV3, seqs: &[Vec<u32>]| bits(&packed_run_of(m, seqs)),
        |m: &_, more| m.end_step(more).unwrap(),
        &format!("context {context}"),
    );
}

/// Prefill context parallelism (`ExpertShard::context`): every rank's prompts are split over
/// both ranks (each layer's latent rows gathered; a piece takes the attention path the whole
/// prompt would), the rest of a batch runs on its own rank, the decode step reads the KV the
/// gathered rows wrote, and in the second step rank 0 takes its pieces of rank 1's prompts
/// from `end_step`: the one-process logits bit for bit.
#[test]
fn context_parallel_prefill_gives_each_rank_its_own_one_process_logits() {
    own_batches_give_the_one_process_logits(true);
}

/// Context parallelism over four ranks with a bf16 latent cache, each attention path forced in
/// turn: prompts of 2 to 41 tokens (a short one leaves some ranks without a piece of it), a
/// rank with none, and each rank gets the one-process logits bit for bit.
#[test]
fn context_parallel_over_four_ranks_with_a_bf16_cache() {
    use cachalot_model::{AttentionPath, KvCacheDtype};
    let prompts = |rank: usize| -> Vec<Vec<u32>> {
        match rank {
            0 => vec![(0..41).map(|i| (i * 11 + 7) % 500).collect()],
            1 => vec![vec![4, 9], (0..6).map(|i| (i * 3 + 1) % 500).collect()],
            2 => Vec::new(),
            _ => vec![(0..17).map(|i| (i * 5 + 2) % 500).collect()],
        }
    };
    for path in [AttentionPath::Naive, AttentionPath::Absorbed] {
        let with = |shard: ExpertShard| {
            let mut m = load(shard);
            m.set_kv_cache_dtype(KvCacheDtype::Bf16);
            m.attention_path = path;
            m
        };
        let one = with(ExpertShard::default());
        let want: Vec<Vec<u32>> = (0..4)
            .map(|r| match prompts(r) {
                p if p.is_empty() => Vec::new(),
                p => bits(&packed_run_of(&one, &p)),
            })
            .collect();
        let got = run_local_group(4, |comm| {
            let rank = comm.rank();
            let mut m = with(ExpertShard {
                rank,
                ranks: 4,
                dispatch: true,
                context: true,
                placement: None,
            });
            m.set_communicator(comm).unwrap();
            let logits = match prompts(rank) {
                p if p.is_empty() => Vec::new(),
                p => bits(&packed_run_of(&m, &p)),
            };
            let more = m.end_step(false).unwrap();
            (logits, more)
        })
        .unwrap();
        for (r, (logits, more)) in got.into_iter().enumerate() {
            assert!(!more, "rank {r}");
            assert!(
                logits == want[r],
                "rank {r}, {path:?}: logits differ from one process's"
            );
        }
    }
}

/// Data-parallel attention with dispatched experts (`ExpertShard::dispatch`): each rank runs
/// its own batches and gets the logits one process gives for those batches alone.
#[test]
fn dispatched_experts_give_each_rank_its_own_one_process_logits() {
    own_batches_give_the_one_process_logits(false);
    // Tensor parallelism runs one batch over the ranks: it refuses dispatched experts.
    let opts = LoadOptions {
        expert_shard: ExpertShard {
            rank: 0,
            ranks: 2,
            dispatch: true,
            context: false,
            placement: None,
        },
        tensor_shard: cachalot_model::TensorShard { rank: 0, ranks: 2 },
        ..Default::default()
    };
    let e = DeepseekV3::load(&r1_tiny(), opts)
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("dispatched experts"), "{e}");
}

#[test]
fn a_shard_without_its_group_or_with_experts_that_do_not_divide_is_named() {
    let m = load(ExpertShard {
        rank: 0,
        ranks: 2,
        dispatch: false,
        context: false,
        placement: None,
    });
    let e = forward_once(&m, &(1..9).collect::<Vec<u32>>())
        .unwrap_err()
        .to_string();
    assert!(e.contains("set_communicator"), "{e}");
    // r1_tiny has 16 routed experts: 3 ranks cannot split them evenly.
    let opts = LoadOptions {
        expert_shard: ExpertShard {
            rank: 0,
            ranks: 3,
            dispatch: false,
            context: false,
            placement: None,
        },
        ..Default::default()
    };
    let e = DeepseekV3::load(&r1_tiny(), opts)
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains("n_routed_experts (16)") && e.contains("3 ranks"),
        "{e}"
    );
}

#[test]
fn ranks_that_run_different_batches_fail_instead_of_mixing_outputs() {
    for e in different_batches_on_two_ranks(|rank| {
        load(ExpertShard {
            rank,
            ranks: 2,
            dispatch: false,
            context: false,
            placement: None,
        })
    }) {
        assert!(e.contains("routed this layer's tokens differently"), "{e}");
    }
    // A shard that does not exist is named at load.
    let opts = LoadOptions {
        expert_shard: ExpertShard {
            rank: 2,
            ranks: 2,
            dispatch: false,
            context: false,
            placement: None,
        },
        ..Default::default()
    };
    let e = DeepseekV3::load(&r1_tiny(), opts)
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("rank 2 of 2"), "{e}");
}

fn load_v4(shard: ExpertShard) -> cachalot_model::DeepseekV4 {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/v4/flash_tiny");
    let opts = cachalot_model::V4LoadOptions {
        expert_shard: shard,
        ..Default::default()
    };
    cachalot_model::DeepseekV4::load(&dir, opts).unwrap()
}

/// The slices `steps` of `toks`, forwarded in order through one fresh cache (`after(i)` once
/// step i is done): every logit's bits.
fn v4_steps(
    m: &cachalot_model::DeepseekV4,
    toks: &[u32],
    steps: &[(usize, usize)],
    mut after: impl FnMut(usize),
) -> Vec<u32> {
    let (mut cache, table) = common::one_sequence_cache(m.cache_spec(), toks.len());
    let mut out_bits = Vec::new();
    for (i, &(lo, hi)) in steps.iter().enumerate() {
        let mut b = Batch::default();
        b.push_seq(&toks[lo..hi], lo, table.clone(), LogitsWanted::All);
        let out = m.forward(&b, &mut cache, false).unwrap();
        out_bits.extend(bits(&out.logits));
        after(i);
    }
    out_bits
}

/// DeepSeek-V4 (flash_tiny, 8 routed experts over 2 ranks): prefill in two chunks then a
/// decode token, the same logits bit for bit on both ranks as in one process.
#[test]
fn v4_expert_shards_give_the_one_process_logits() {
    let toks: Vec<u32> = (0..150).map(|i| (i * 37 + 11) % 200).collect();
    let run = |m: &cachalot_model::DeepseekV4| {
        v4_steps(m, &toks, &[(0, 90), (90, 149), (149, 150)], |_| {})
    };
    let want = run(&load_v4(ExpertShard::default()));
    let got = run_local_group(2, |comm| {
        let mut m = load_v4(ExpertShard {
            rank: comm.rank(),
            ranks: 2,
            dispatch: false,
            context: false,
            placement: None,
        });
        m.set_communicator(comm).unwrap();
        run(&m)
    })
    .unwrap();
    for (r, logits) in got.iter().enumerate() {
        assert!(
            *logits == want,
            "rank {r}'s logits differ from one process's"
        );
    }
}

/// DeepSeek-V4 with dispatched experts (data-parallel attention; hash-routed layers and the
/// weights applied inside the expert included): rank 0 prefills in two chunks and decodes,
/// rank 1 prefills other tokens in one step and then serves; each gets the one-process logits
/// of its own sequence.
#[test]
fn v4_dispatched_experts_give_each_rank_its_own_one_process_logits() {
    let work = |rank: usize| -> (Vec<u32>, Vec<(usize, usize)>) {
        if rank == 0 {
            (
                (0..150).map(|i| (i * 37 + 11) % 200).collect(),
                vec![(0, 90), (90, 149), (149, 150)],
            )
        } else {
            ((0..40).map(|i| (i * 17 + 5) % 200).collect(), vec![(0, 40)])
        }
    };
    let one = load_v4(ExpertShard::default());
    let want: Vec<Vec<u32>> = (0..2)
        .map(|r| {
            let (toks, steps) = work(r);
            v4_steps(&one, &toks, &steps, |_| {})
        })
        .collect();
    let got = run_local_group(2, |comm| {
        let rank = comm.rank();
        let mut m = load_v4(ExpertShard {
            rank,
            ranks: 2,
            dispatch: true,
            context: false,
            placement: None,
        });
        m.set_communicator(comm).unwrap();
        let (toks, steps) = work(rank);
        // After each step the group's end; then, done here, serve the other rank until no
        // rank has work.
        let mut group_more = true;
        let logits = v4_steps(&m, &toks, &steps, |i| {
            let mine = i + 1 < steps.len();
            group_more = m.end_step(mine).unwrap();
            assert!(group_more || !mine, "rank {rank} has work left");
        });
        while group_more {
            group_more = m.end_step(false).unwrap();
        }
        logits
    })
    .unwrap();
    for (r, logits) in got.iter().enumerate() {
        assert!(
            *logits == want[r],
            "rank {r}'s logits differ from one process's"
        );
    }
}

/// DeepSeek-V4 (with its MTP block) in the model's cache layout: the prompts `seqs`
/// packed in one prefill (every row's logits, the streams kept), the MTP block over the prompts,
/// then three decode steps of all sequences together: every logit's bits.
fn v4_packed_run_of(m: &cachalot_model::DeepseekV4, seqs: &[Vec<u32>]) -> Vec<u32> {
    use cachalot_model::BlockAllocator;
    let bs = 16;
    let decode = 3;
    let blocks: usize = seqs.iter().map(|s| (s.len() + decode).div_ceil(bs)).sum();
    let mut cache = cachalot_model::KvCache::new(m.cache_spec(), bs, blocks);
    let mut alloc = BlockAllocator::new(blocks);
    let mut tables = vec![Vec::new(); seqs.len()];
    let mut b = Batch::default();
    for (i, (s, t)) in seqs.iter().zip(tables.iter_mut()).enumerate() {
        alloc.ensure(t, s.len() + decode, bs).unwrap();
        b.push_seq(s, 0, t.clone(), LogitsWanted::All);
        b.mark_prefill();
        b.set_state_slot(i as u32);
    }
    let out = m.forward(&b, &mut cache, true).unwrap();
    let mut logits = out.logits;
    let streams = out.hidden.unwrap();
    let w = streams.len() / b.num_tokens();
    let mut mb = Batch::default();
    let mut prev = Vec::new();
    let mut off = 0;
    for (i, (s, t)) in seqs.iter().zip(&tables).enumerate() {
        mb.push_seq(&s[1..], 0, t.clone(), LogitsWanted::All);
        mb.set_state_slot(i as u32);
        prev.extend_from_slice(&streams[off * w..(off + s.len() - 1) * w]);
        off += s.len();
    }
    logits.extend(
        m.mtp_forward(0, &mb, &prev, &mut cache, false)
            .unwrap()
            .logits,
    );
    for k in 0..decode {
        let mut d = Batch::default();
        for (i, (s, t)) in seqs.iter().zip(&tables).enumerate() {
            d.push_seq(&[s[k]], s.len() + k, t.clone(), LogitsWanted::All);
            d.set_state_slot(i as u32);
        }
        logits.extend(m.forward(&d, &mut cache, false).unwrap().logits);
    }
    bits(&logits)
}

/// Prefill context parallelism on DeepSeek-V4 (`ExpertShard::context` with dispatched experts),
/// in both cache layouts: every rank's prompts are split over both ranks, each attention
/// layer's window rows and compressor inputs gathered (prompts longer than the window and than
/// a 128-token compressed block, entries of the ratio-4 layers chosen by the indexer),
/// the prompt's own rank writes its cache, then MTP over the prompts and decode steps read
/// it; in a second step rank 0 takes its pieces of rank 1's prompts from `end_step`. Each rank
/// gets the one-process logits of its own batches, bit for bit.
#[test]
fn v4_context_parallel_prefill_gives_each_rank_its_own_one_process_logits() {
    use cachalot_model::{KvCacheDtype, V4CacheMode};
    let prompts = |rank: usize| -> Vec<Vec<u32>> {
        if rank == 0 {
            vec![
                (0..261).map(|i| (i * 37 + 11) % 128).collect(),
                (0..37).map(|i| (i * 7 + 3) % 128).collect(),
            ]
        } else {
            vec![(0..9).map(|i| (i * 31 + 2) % 128).collect()]
        }
    };
    let second: Vec<Vec<u32>> = vec![
        (0..140).map(|i| (i * 3 + 40) % 128).collect(),
        (0..3).map(|i| (i * 5 + 1) % 128).collect(),
    ];
    let load = |fixture: &str, shard: ExpertShard, (mode, dtype): (V4CacheMode, KvCacheDtype)| {
        let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../../fixtures/v4")
            .join(fixture);
        let opts = cachalot_model::V4LoadOptions {
            load_mtp: true,
            expert_shard: shard,
            ..Default::default()
        };
        let mut m = cachalot_model::DeepseekV4::load(&dir, opts).unwrap();
        m.set_cache_mode(mode);
        m.set_kv_cache_dtype(dtype);
        m
    };
    // flash_tiny: a 128-token window, ratio-4 and ratio-128 layers; tiny: a window of 8 (shorter
    // than a piece), two hc streams, ratio-4 layers whose indexer picks 4 entries. A bf16 cache
    // sends the rows in 2 bytes a value.
    use cachalot_model::KvCacheDtype::{Bf16, Fp8, F32};
    for (fixture, mode) in [
        ("flash_tiny", (V4CacheMode::Compact, F32)),
        ("flash_tiny", (V4CacheMode::Full, F32)),
        ("flash_tiny", (V4CacheMode::Compact, Bf16)),
        ("flash_tiny", (V4CacheMode::Compact, Fp8)),
        ("tiny", (V4CacheMode::Compact, F32)),
    ] {
        two_steps_give_each_rank_its_own_logits(
            prompts,
            &second,
            &load(fixture, ExpertShard::default(), mode),
            |comm: std::sync::Arc<dyn cachalot_comm::Communicator>| {
                let mut m = load(
                    fixture,
                    ExpertShard {
                        rank: comm.rank(),
                        ranks: 2,
                        dispatch: true,
                        context: true,
                        placement: None,
                    },
                    mode,
                );
                m.set_communicator(comm).unwrap();
                m
            },
            v4_packed_run_of,
            |m: &_, more| m.end_step(more).unwrap(),
            &format!("{fixture}, {mode:?}"),
        );
    }
}
