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
        let vocab = one.config().vocab_size;
        for (r, (logits, bytes)) in got.iter().enumerate() {
            assert_eq!(
                bits(logits),
                bits(&got[0].0),
                "{name_n}: rank {r}'s logits differ from rank 0's"
            );
            assert!(*bytes < one.weight_bytes(), "{name_n}: rank {r}");
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
                    "{name_n}: rank {r}, row {row}: logits differ by {diff} (max {scale})"
                );
            }
        }
    }
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
