//! Tensor parallelism (`LoadOptions::tensor_shard` + `DeepseekV3::set_communicator`): ranks that
//! each hold a share of the heads and of every MLP's intermediate features give, on every rank,
//! the same logits bit for bit, and the one-process logits up to the order of the final
//! addition (a packed prefill, MTP, and a batched decode step); each holds less than the whole
//! model. Checked with the q LoRA (r1_tiny: FP8 blocks cut inside, 40-feature experts split in
//! 20s and 10s) and with a direct q_proj (v3_noq_tiny), over 2 and 4 ranks.

use std::path::{Path, PathBuf};

mod common;

use cachalot_comm::run_local_group;
use cachalot_model::{DeepseekV3, ExpertShard, LoadOptions, TensorShard};
use common::{bits, different_batches_on_two_ranks, forward_once, packed_run};

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../fixtures/v3")
        .join(name)
}

fn load(dir: &Path, shard: TensorShard) -> DeepseekV3 {
    load_with(dir, shard, false)
}

/// With `experts`, the routed experts are split too (expert parallelism over the same ranks).
fn load_with(dir: &Path, shard: TensorShard, experts: bool) -> DeepseekV3 {
    let opts = LoadOptions {
        load_mtp: true,
        tensor_shard: shard,
        expert_shard: if experts {
            ExpertShard {
                rank: shard.rank,
                ranks: shard.ranks,
                dispatch: false,
                context: false,
                placement: None,
            }
        } else {
            ExpertShard::default()
        },
        ..Default::default()
    };
    DeepseekV3::load(dir, opts).unwrap()
}

#[test]
fn tensor_shards_give_the_one_process_logits() {
    for (name, n, experts) in [
        ("r1_tiny", 2, false),
        ("r1_tiny", 4, false),
        ("v3_noq_tiny", 2, false),
        ("r1_tiny", 2, true),
        ("r1_tiny", 4, true),
    ] {
        let name_n = format!(
            "{name} over {n}{}",
            if experts { " with experts" } else { "" }
        );
        let dir = fixture(name);
        let one = load(&dir, TensorShard::default());
        let want = packed_run(&one);
        let got = run_local_group(n, |comm| {
            let mut m = load_with(
                &dir,
                TensorShard {
                    rank: comm.rank(),
                    ranks: n,
                },
                experts,
            );
            m.set_communicator(comm).unwrap();
            (packed_run(&m), m.weight_bytes())
        })
        .unwrap();
        check_ranks(
            &name_n,
            &got,
            &want,
            one.config().vocab_size,
            one.weight_bytes(),
        );
    }
}

/// Every rank's `(logits, weight bytes)`: the same bits on every rank, within 1e-4 (of each
/// row's largest logit) of one process's `want`, and less than its `whole` bytes of weights.
fn check_ranks(name: &str, got: &[(Vec<f32>, usize)], want: &[f32], vocab: usize, whole: usize) {
    for (r, (logits, bytes)) in got.iter().enumerate() {
        assert_eq!(
            bits(logits),
            bits(&got[0].0),
            "{name}: rank {r}'s logits differ from rank 0's"
        );
        assert!(*bytes < whole, "{name}: rank {r}");
        assert_eq!(logits.len(), want.len());
        for (row, (a, b)) in logits
            .chunks_exact(vocab)
            .zip(want.chunks_exact(vocab))
            .enumerate()
        {
            let scale = b.iter().fold(1.0f32, |m, v| m.max(v.abs()));
            let diff = a
                .iter()
                .zip(b)
                .fold(0.0f32, |m, (x, y)| m.max((x - y).abs()));
            assert!(
                diff <= 1e-4 * scale,
                "{name}: rank {r}, row {row}: logits differ by {diff} (max {scale})"
            );
        }
    }
}

/// DeepSeek-V4 (flash_tiny: FP8 blocks cut inside, MXFP4 experts split at 32 features; pro_tiny)
/// over 2 ranks, with and without the routed experts split whole: a chunked prefill, the MTP
/// block over it and a decode token give every rank the same logits, within 1e-4 of one
/// process's.
#[test]
fn v4_tensor_shards_give_the_one_process_logits() {
    use cachalot_model::batch::{Batch, LogitsWanted};
    use cachalot_model::{DeepseekV4, V4LoadOptions};

    let run = |m: &DeepseekV4| -> Vec<f32> {
        let toks: Vec<u32> = (0..100).map(|i| (i * 37 + 11) % 500).collect();
        let (mut cache, table) = common::one_sequence_cache(m.cache_spec(), toks.len());
        let mut logits = Vec::new();
        let mut hidden = Vec::new();
        for (lo, hi) in [(0, 60), (60, 99)] {
            let mut b = Batch::default();
            b.push_seq(&toks[lo..hi], lo, table.clone(), LogitsWanted::All);
            let out = m.forward(&b, &mut cache, true).unwrap();
            logits.extend(out.logits);
            hidden.extend(out.hidden.unwrap());
        }
        let width = hidden.len() / 99;
        let mut b = Batch::default();
        b.push_seq(&toks[1..99], 0, table.clone(), LogitsWanted::All);
        let mtp = m
            .mtp_forward(0, &b, &hidden[..98 * width], &mut cache, false)
            .unwrap();
        logits.extend(mtp.logits);
        let mut b = Batch::default();
        b.push_seq(&toks[99..100], 99, table, LogitsWanted::All);
        logits.extend(m.forward(&b, &mut cache, false).unwrap().logits);
        logits
    };
    for (name, experts) in [
        ("flash_tiny", false),
        ("flash_tiny", true),
        ("pro_tiny", false),
    ] {
        let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../../fixtures/v4")
            .join(name);
        let load = |t: TensorShard| {
            let opts = V4LoadOptions {
                load_mtp: true,
                tensor_shard: t,
                expert_shard: if experts {
                    ExpertShard {
                        rank: t.rank,
                        ranks: t.ranks,
                        dispatch: false,
                        context: false,
                        placement: None,
                    }
                } else {
                    ExpertShard::default()
                },
                ..Default::default()
            };
            DeepseekV4::load(&dir, opts).unwrap()
        };
        let one = load(TensorShard::default());
        let want = run(&one);
        let got = run_local_group(2, |comm| {
            let mut m = load(TensorShard {
                rank: comm.rank(),
                ranks: 2,
            });
            m.set_communicator(comm).unwrap();
            (run(&m), m.weight_bytes())
        })
        .unwrap();
        let name = format!("{name}{}", if experts { " with experts" } else { "" });
        check_ranks(
            &name,
            &got,
            &want,
            one.config().vocab_size,
            one.weight_bytes(),
        );
    }
    // 4 heads in 2 output groups: 4 ranks cannot split the groups.
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/v4/flash_tiny");
    let opts = V4LoadOptions {
        tensor_shard: TensorShard { rank: 0, ranks: 4 },
        ..Default::default()
    };
    let e = DeepseekV4::load(&dir, opts).err().unwrap().to_string();
    assert!(e.contains("o_groups (2)") && e.contains("4 ranks"), "{e}");
}

#[test]
fn shards_that_do_not_divide_or_lack_their_group_are_named() {
    let dir = fixture("r1_tiny");
    // 4 heads, 320 and 40 intermediate features: 3 ranks cannot split them.
    let opts = LoadOptions {
        tensor_shard: TensorShard { rank: 0, ranks: 3 },
        ..Default::default()
    };
    let e = DeepseekV3::load(&dir, opts).err().unwrap().to_string();
    assert!(
        e.contains("num_attention_heads (4)") && e.contains("3 ranks"),
        "{e}"
    );
    let opts = LoadOptions {
        tensor_shard: TensorShard { rank: 2, ranks: 2 },
        ..Default::default()
    };
    let e = DeepseekV3::load(&dir, opts).err().unwrap().to_string();
    assert!(e.contains("rank 2 of 2"), "{e}");
    let opts = LoadOptions {
        tensor_shard: TensorShard { rank: 0, ranks: 2 },
        expert_shard: ExpertShard {
            rank: 1,
            ranks: 2,
            dispatch: false,
            context: false,
            placement: None,
        },
        ..Default::default()
    };
    let e = DeepseekV3::load(&dir, opts).err().unwrap().to_string();
    assert!(e.contains("one group"), "{e}");
    // A shard without its communicator says what it needs.
    let m = load(&dir, TensorShard { rank: 0, ranks: 2 });
    let e = forward_once(&m, &(1..9).collect::<Vec<u32>>())
        .unwrap_err()
        .to_string();
    assert!(e.contains("set_communicator"), "{e}");
}

#[test]
fn ranks_that_run_different_batches_fail_instead_of_mixing_outputs() {
    let dir = fixture("r1_tiny");
    for e in different_batches_on_two_ranks(|rank| load(&dir, TensorShard { rank, ranks: 2 })) {
        assert!(e.contains("ran a different batch"), "{e}");
    }
}
