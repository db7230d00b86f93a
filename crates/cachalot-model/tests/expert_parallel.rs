//! Expert parallelism (`LoadOptions::expert_shard` + `DeepseekV3::set_communicator`): ranks that
//! each hold a share of the routed experts give, on every rank, the logits of the one-process
//! model bit for bit (a packed prefill and a batched step; MTP included), and hold only their
//! share of the expert weights.

use std::path::PathBuf;

mod common;

use cachalot_comm::run_local_group;
use cachalot_model::batch::{Batch, BlockAllocator, KvCache, LogitsWanted};
use cachalot_model::{DeepseekV3, ExpertShard, LoadOptions};
use common::{bits, different_batches_on_two_ranks, forward_once, packed_run};

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

#[test]
fn a_shard_without_its_group_or_with_experts_that_do_not_divide_is_named() {
    let m = load(ExpertShard { rank: 0, ranks: 2 });
    let e = forward_once(&m, &(1..9).collect::<Vec<u32>>())
        .unwrap_err()
        .to_string();
    assert!(e.contains("set_communicator"), "{e}");
    // r1_tiny has 16 routed experts: 3 ranks cannot split them evenly.
    let opts = LoadOptions {
        expert_shard: ExpertShard { rank: 0, ranks: 3 },
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
    for e in different_batches_on_two_ranks(|rank| load(ExpertShard { rank, ranks: 2 })) {
        assert!(e.contains("routed this layer's tokens differently"), "{e}");
    }
    // A shard that does not exist is named at load.
    let opts = LoadOptions {
        expert_shard: ExpertShard { rank: 2, ranks: 2 },
        ..Default::default()
    };
    let e = DeepseekV3::load(&r1_tiny(), opts)
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("rank 2 of 2"), "{e}");
}

/// DeepSeek-V4 (flash_tiny, 8 routed experts over 2 ranks): prefill in two chunks then a
/// decode token, the same logits bit for bit on both ranks as in one process.
#[test]
fn v4_expert_shards_give_the_one_process_logits() {
    use cachalot_model::{DeepseekV4, V4LoadOptions};

    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/v4/flash_tiny");
    let load = |shard: ExpertShard| {
        let opts = V4LoadOptions {
            expert_shard: shard,
            ..Default::default()
        };
        DeepseekV4::load(&dir, opts).unwrap()
    };
    let run = |m: &DeepseekV4| -> Vec<u32> {
        let toks: Vec<u32> = (0..150).map(|i| (i * 37 + 11) % 200).collect();
        let bs = 16;
        let blocks = toks.len().div_ceil(bs) + 1;
        let mut cache = KvCache::new(m.cache_spec(), bs, blocks);
        let mut alloc = BlockAllocator::new(blocks);
        let mut table = Vec::new();
        alloc.ensure(&mut table, toks.len(), bs).unwrap();
        let mut bits = Vec::new();
        for (lo, hi) in [(0, 90), (90, 149), (149, 150)] {
            let mut b = Batch::default();
            b.push_seq(&toks[lo..hi], lo, table.clone(), LogitsWanted::All);
            let out = m.forward(&b, &mut cache, false).unwrap();
            bits.extend(out.logits.iter().map(|v| v.to_bits()));
        }
        bits
    };
    let want = run(&load(ExpertShard::default()));
    let got = run_local_group(2, |comm| {
        let mut m = load(ExpertShard {
            rank: comm.rank(),
            ranks: 2,
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
