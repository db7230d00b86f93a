//! Expert parallelism (`LoadOptions::expert_shard` + `DeepseekV3::set_communicator`): ranks that
//! each hold a share of the routed experts give, on every rank, the logits of the one-process
//! model bit for bit (a packed prefill and a batched step; MTP included), and hold only their
//! share of the expert weights.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use cachalot_comm::{TcpComm, TcpRendezvous};
use cachalot_model::batch::{Batch, BlockAllocator, KvCache, LogitsWanted};
use cachalot_model::{DeepseekV3, ExpertShard, LoadOptions};

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

/// Logits (as bits) of two packed sequences, a prefill then one token each, and of the MTP
/// layer over the prefill's hidden states.
fn run(m: &DeepseekV3) -> Vec<u32> {
    let seqs: [Vec<u32>; 2] = [
        (0..37).map(|i| (i * 7 + 3) % 500).collect(),
        (0..21).map(|i| (i * 13 + 5) % 500).collect(),
    ];
    let blocks = 24;
    let mut cache = KvCache::new(m.cache_spec(), 4, blocks);
    let mut alloc = BlockAllocator::new(blocks);
    let mut tables = vec![Vec::new(), Vec::new()];
    let mut b = Batch::default();
    for (s, t) in seqs.iter().zip(tables.iter_mut()) {
        alloc.ensure(t, s.len() + 1, 4).unwrap();
        b.push_seq(s, 0, t.clone(), LogitsWanted::All);
    }
    let out = m.forward(&b, &mut cache, true).unwrap();
    let mut bits: Vec<u32> = out.logits.iter().map(|v| v.to_bits()).collect();
    let hidden = out.hidden.unwrap();
    // MTP over the prefill: row i pairs token i + 1 with the hidden state at position i.
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
    bits.extend(mtp.logits.iter().map(|v| v.to_bits()));
    let mut d = Batch::default();
    for (s, t) in seqs.iter().zip(&tables) {
        d.push_seq(&[s[0]], s.len(), t.clone(), LogitsWanted::All);
    }
    let out = m.forward(&d, &mut cache, false).unwrap();
    bits.extend(out.logits.iter().map(|v| v.to_bits()));
    bits
}

#[test]
fn expert_shards_give_the_one_process_logits() {
    let one = load(ExpertShard::default());
    let want = run(&one);
    let full_bytes = one.weight_bytes();
    let n = 2;
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let master = listener.local_addr().unwrap().to_string();
    let other = std::thread::spawn(move || {
        let comm = TcpComm::connect(&TcpRendezvous {
            rank: 1,
            world_size: n,
            master,
            timeout: Duration::from_secs(30),
        })
        .unwrap();
        let mut m = load(ExpertShard { rank: 1, ranks: n });
        m.set_communicator(Arc::new(comm)).unwrap();
        (run(&m), m.weight_bytes())
    });
    let comm = TcpComm::accept(listener, n, Duration::from_secs(30)).unwrap();
    let mut m = load(ExpertShard { rank: 0, ranks: n });
    m.set_communicator(Arc::new(comm)).unwrap();
    let (got0, bytes0) = (run(&m), m.weight_bytes());
    let (got1, bytes1) = other.join().unwrap();
    assert!(got0 == want, "rank 0's logits differ from one process's");
    assert!(got1 == want, "rank 1's logits differ from one process's");
    // Each rank holds half of the routed experts: less than the whole model.
    assert!(
        bytes0 < full_bytes && bytes1 < full_bytes,
        "{bytes0} {bytes1} {full_bytes}"
    );
    assert_eq!(bytes0, bytes1);
}

#[test]
fn a_shard_without_its_group_or_with_experts_that_do_not_divide_is_named() {
    let m = load(ExpertShard { rank: 0, ranks: 2 });
    let seq: Vec<u32> = (1..9).collect();
    let mut cache = KvCache::new(m.cache_spec(), 4, 4);
    let mut alloc = BlockAllocator::new(4);
    let mut table = Vec::new();
    alloc.ensure(&mut table, seq.len(), 4).unwrap();
    let mut b = Batch::default();
    b.push_seq(&seq, 0, table, LogitsWanted::Last);
    let e = m.forward(&b, &mut cache, false).err().unwrap().to_string();
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
    let forward = |m: &DeepseekV3, seq: &[u32]| {
        let mut cache = KvCache::new(m.cache_spec(), 4, 8);
        let mut alloc = BlockAllocator::new(8);
        let mut table = Vec::new();
        alloc.ensure(&mut table, seq.len(), 4).unwrap();
        let mut b = Batch::default();
        b.push_seq(seq, 0, table, LogitsWanted::Last);
        m.forward(&b, &mut cache, false).map(|_| ())
    };
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let master = listener.local_addr().unwrap().to_string();
    let other = std::thread::spawn(move || {
        let comm = TcpComm::connect(&TcpRendezvous {
            rank: 1,
            world_size: 2,
            master,
            timeout: Duration::from_secs(30),
        })
        .unwrap();
        let mut m = load(ExpertShard { rank: 1, ranks: 2 });
        m.set_communicator(Arc::new(comm)).unwrap();
        forward(&m, &[5, 6, 7, 8, 9, 10])
    });
    let comm = TcpComm::accept(listener, 2, Duration::from_secs(30)).unwrap();
    let mut m = load(ExpertShard { rank: 0, ranks: 2 });
    m.set_communicator(Arc::new(comm)).unwrap();
    let mine = forward(&m, &[1, 2, 3, 4, 5, 6]);
    drop(m);
    for r in [mine, other.join().unwrap()] {
        let e = r.unwrap_err().to_string();
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
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let master = listener.local_addr().unwrap().to_string();
    let dir1 = dir.clone();
    let other = std::thread::spawn(move || {
        let comm = TcpComm::connect(&TcpRendezvous {
            rank: 1,
            world_size: 2,
            master,
            timeout: Duration::from_secs(30),
        })
        .unwrap();
        let opts = V4LoadOptions {
            expert_shard: ExpertShard { rank: 1, ranks: 2 },
            ..Default::default()
        };
        let mut m = DeepseekV4::load(&dir1, opts).unwrap();
        m.set_communicator(Arc::new(comm)).unwrap();
        run(&m)
    });
    let comm = TcpComm::accept(listener, 2, Duration::from_secs(30)).unwrap();
    let mut m = load(ExpertShard { rank: 0, ranks: 2 });
    m.set_communicator(Arc::new(comm)).unwrap();
    let got0 = run(&m);
    let got1 = other.join().unwrap();
    assert!(got0 == want, "rank 0's logits differ from one process's");
    assert!(got1 == want, "rank 1's logits differ from one process's");
}
