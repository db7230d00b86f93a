//! The parallel runtime's collectives: the [`Communicator`] trait the engine and the model call
//! for anything that crosses ranks, a single-process backend where every collective is the
//! identity ([`SingleProcess`]), a TCP backend for several processes on one or more hosts
//! ([`TcpComm`]), and a shared-memory one for the processes of one host (`ShmComm`, Linux). With the cargo feature `mpi`, an MPI one for processes started by `mpirun` (`mpi.rs`).
//!
//! Spec: `executor.md` §1 (parallel sizes: `world_size`, data-parallel request shards) and §3
//! (offline runs report tokens/s per rank); `deepseek-v3-r1-kimi-k2.md` §2.4 (the expert split).
//! What runs over it today: data-parallel offline runs (`cachalot run --ranks N`), each rank
//! serving its shard of the requests and rank 0 gathering the outputs and figures, and
//! expert-parallel ones (`--parallel expert`), where the model gathers each MoE layer's routed
//! outputs from the ranks that hold the experts, and tensor-parallel ones (`--parallel tensor`),
//! where each layer's partial attention and MLP outputs are added over the ranks. Ranks on one
//! host move onto shared memory ([`share_memory`], `shm.rs`). Its own crate (below the model,
//! which calls it; the engine re-exports it as `cachalot_engine::comm`).
//!
//! TcpComm is a star through rank 0: every collective sends each rank's part to rank 0, which
//! combines the parts in rank order (so a sum is the same bits on every rank and in every run)
//! and sends the result back. With three ranks or more the other ranks also link every pair
//! directly when they can (`TcpComm::link_pairs`); gathers and all-to-alls then send each
//! part once, straight to its rank (a sum still adds the parts in rank order on every rank). Frames are a little-endian u64 length and the bytes; a rank opens
//! with a greeting (a magic word, its rank, the world size it was given), and connections that
//! do not greet so are dropped. A rank that disconnects, or sends a frame that does not fit the
//! collective, fails the collective on every rank: rank 0 sends the others an error frame that
//! names it.

#[cfg(target_os = "linux")]
mod shm;
#[cfg(target_os = "linux")]
pub use shm::{share_memory, ShmComm};

/// Shared memory is Linux-only here: elsewhere the group stays on TCP.
#[cfg(not(target_os = "linux"))]
pub fn share_memory(tcp: TcpComm, _want: bool) -> CommResult<Arc<dyn Communicator>> {
    Ok(Arc::new(tcp))
}

#[cfg(feature = "mpi")]
pub mod mpi;

/// Whether an MPI launcher started this process (`mpirun`/`mpiexec` of Open MPI or MPICH, or a
/// PMI/PMIx launcher such as Slurm's `srun`), with the world size it gave when it says one.
pub fn mpi_launch() -> Option<Option<usize>> {
    let size = |var: &str| std::env::var(var).ok().and_then(|v| v.trim().parse().ok());
    for var in ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE"] {
        if std::env::var_os(var).is_some() {
            return Some(size(var));
        }
    }
    std::env::var_os("PMIX_RANK").map(|_| None)
}

/// Joins the MPI job this process belongs to: the world group and the number of its ranks on
/// this host. Without the `mpi` feature, an error that says how to get it.
pub fn mpi_world() -> CommResult<(Arc<dyn Communicator>, usize)> {
    #[cfg(feature = "mpi")]
    {
        let w = mpi::world()?;
        let host = w.host_ranks();
        Ok((w, host))
    }
    #[cfg(not(feature = "mpi"))]
    Err(CommError(
        "this cachalot was built without MPI: build it with `cargo build --release --features \
         mpi` (needs an MPI, e.g. Debian's libopenmpi-dev and openmpi-bin), or start the ranks \
         with --ranks N on one host or --rank R --world-size N --master HOST:PORT on several"
            .into(),
    ))
}

/// Ends MPI where [`mpi_world`] joined it (`mpi::finish`: `MPI_Finalize` when `ok`, else
/// `MPI_Abort`); nothing otherwise.
pub fn mpi_finish(ok: bool) {
    #[cfg(feature = "mpi")]
    mpi::finish(ok);
    #[cfg(not(feature = "mpi"))]
    let _ = ok;
}

use std::io::{BufReader, BufWriter, Read, Write};
use std::net::{TcpListener, TcpStream, ToSocketAddrs};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A communication error: names the rank or address and what went wrong.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct CommError(pub String);

pub type CommResult<T> = Result<T, CommError>;

/// Collectives over the ranks of one parallel group. Every rank must call the same collectives
/// in the same order (as with MPI).
pub trait Communicator: Send + Sync {
    /// This process's rank, 0..world_size.
    fn rank(&self) -> usize;
    /// Ranks in the group.
    fn world_size(&self) -> usize;
    /// How the ranks reach each other, for logs: "none" (one process), "tcp", "shared memory".
    fn transport(&self) -> &'static str {
        "none"
    }
    /// Every rank's bytes, in rank order, on every rank.
    fn all_gather(&self, mine: &[u8]) -> CommResult<Vec<Vec<u8>>>;
    /// Element-wise sum over ranks, added in rank order (the same bits on every rank).
    fn all_reduce_sum(&self, buf: &mut [f32]) -> CommResult<()> {
        let parts = self.all_gather(&f32_bytes(buf))?;
        let mut sum: Option<Vec<f32>> = None;
        for (r, p) in parts.iter().enumerate() {
            let v = bytes_f32(p).ok_or_else(|| {
                CommError(format!(
                    "all_reduce_sum: rank {r} sent {} bytes, expected {} (4 per value)",
                    p.len(),
                    buf.len() * 4
                ))
            })?;
            if v.len() != buf.len() {
                return Err(CommError(format!(
                    "all_reduce_sum: rank {r} sent {} values, this rank {}",
                    v.len(),
                    buf.len()
                )));
            }
            match &mut sum {
                None => sum = Some(v),
                Some(s) => s.iter_mut().zip(&v).for_each(|(a, b)| *a += b),
            }
        }
        if let Some(s) = sum {
            buf.copy_from_slice(&s);
        }
        Ok(())
    }
    /// Rank `root`'s bytes on every rank.
    fn broadcast(&self, root: usize, mine: &[u8]) -> CommResult<Vec<u8>> {
        let n = self.world_size();
        if root >= n {
            return Err(CommError(format!(
                "broadcast: root {root} is outside 0..{n}"
            )));
        }
        let mine = if self.rank() == root { mine } else { &[] };
        Ok(self.all_gather(mine)?.swap_remove(root))
    }
    /// Whether the ranks this one is connected to are still there, without waiting or
    /// exchanging anything: for ranks that work apart for a long time (data-parallel runs),
    /// so that one whose peer failed stops then, not at the next collective. Ok where the
    /// transport cannot tell (MPI aborts the job itself).
    fn check_peers(&self) -> CommResult<()> {
        Ok(())
    }
    /// Returns when every rank has called it.
    fn barrier(&self) -> CommResult<()> {
        self.all_gather(&[]).map(|_| ())
    }
    /// Personalised exchange: `parts[s]` goes to rank `s`; returns what each rank sent this
    /// one, in rank order (MPI's `Alltoallv`). `parts` has one entry per rank (this rank's own
    /// comes back to it). The default rides on [`Communicator::all_gather`] (every rank
    /// receives every part and keeps its own); a transport with point-to-point links can send
    /// each part only where it goes.
    fn all_to_all(&self, parts: &[Vec<u8>]) -> CommResult<Vec<Vec<u8>>> {
        let n = self.world_size();
        check_parts(parts, n)?;
        let me = self.rank();
        let gathered = self.all_gather(&pack(parts))?;
        gathered
            .iter()
            .enumerate()
            .map(|(r, blob)| {
                let mut theirs = unpack_parts(blob, n).ok_or_else(|| {
                    CommError(format!(
                        "all_to_all: rank {r} sent a malformed frame of {} bytes (not {n} parts)",
                        blob.len()
                    ))
                })?;
                Ok(theirs.swap_remove(me))
            })
            .collect()
    }
}

/// An all-to-all's parts must be one per rank of a group of `n`.
pub(crate) fn check_parts(parts: &[Vec<u8>], n: usize) -> CommResult<()> {
    if parts.len() == n {
        Ok(())
    } else {
        Err(CommError(format!(
            "all_to_all: {} parts for a group of {n} ranks (one per rank)",
            parts.len()
        )))
    }
}

/// Part `which` of a [`pack`]ed frame of `expect` parts (`None` unless the frame is well formed
/// up to it), read without copying the others.
pub(crate) fn packed_part(b: &[u8], expect: usize, which: usize) -> Option<&[u8]> {
    let word = |at: usize| -> Option<usize> {
        let w = u64::from_le_bytes(b.get(at..at.checked_add(8)?)?.try_into().ok()?);
        usize::try_from(w).ok()
    };
    if word(0)? != expect || which >= expect {
        return None;
    }
    let mut at = 8usize;
    for i in 0..=which {
        let len = word(at)?;
        at += 8;
        let end = at.checked_add(len)?;
        if i == which {
            return b.get(at..end);
        }
        at = end;
    }
    None
}

/// The parts of a [`pack`]ed frame, `None` unless it holds exactly `expect` well-formed parts.
fn unpack_parts(b: &[u8], expect: usize) -> Option<Vec<Vec<u8>>> {
    let word = |at: usize| -> Option<usize> {
        let w = u64::from_le_bytes(b.get(at..at.checked_add(8)?)?.try_into().ok()?);
        usize::try_from(w).ok()
    };
    if word(0)? != expect {
        return None;
    }
    let mut at = 8usize;
    let mut parts = Vec::with_capacity(expect);
    for _ in 0..expect {
        let len = word(at)?;
        at += 8;
        let end = at.checked_add(len)?;
        parts.push(b.get(at..end)?.to_vec());
        at = end;
    }
    (at == b.len()).then_some(parts)
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn bytes_f32(b: &[u8]) -> Option<Vec<f32>> {
    if !b.len().is_multiple_of(4) {
        return None;
    }
    Some(
        b.chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
    )
}

/// One process, one rank: every collective returns this rank's own data.
#[derive(Clone, Copy, Debug, Default)]
pub struct SingleProcess;

impl Communicator for SingleProcess {
    fn rank(&self) -> usize {
        0
    }
    fn world_size(&self) -> usize {
        1
    }
    fn all_gather(&self, mine: &[u8]) -> CommResult<Vec<Vec<u8>>> {
        Ok(vec![mine.to_vec()])
    }
    fn all_reduce_sum(&self, _buf: &mut [f32]) -> CommResult<()> {
        Ok(())
    }
}

/// Where and how the ranks of a [`TcpComm`] group meet.
#[derive(Clone, Debug)]
pub struct TcpRendezvous {
    pub rank: usize,
    pub world_size: usize,
    /// Rank 0 listens here (`host:port`); the others connect to it.
    pub master: String,
    /// How long rank 0 waits for everyone, and the others retry connecting.
    pub timeout: Duration,
}

/// Parts up to this size go out without a writer thread (they fit a socket's send buffer, so
/// writing them all before reading cannot stall).
const SMALL_PART: usize = 8 << 10;

/// Largest frame accepted (a corrupt length must not allocate without bound).
const MAX_FRAME: u64 = 1 << 36;

/// First word of a rank's greeting (then its rank and the world size it was given).
const HELLO: u64 = u64::from_le_bytes(*b"cachalot");

/// A gathered frame starting with this count carries rank 0's error message instead.
const FAILED: u64 = u64::MAX;

struct Peer {
    rank: usize,
    reader: BufReader<TcpStream>,
    writer: BufWriter<TcpStream>,
}

/// The TCP backend (see the module documentation).
pub struct TcpComm {
    rank: usize,
    world_size: usize,
    /// Rank 0: one connection per other rank, in rank order. Others: the one to rank 0.
    peers: Mutex<Vec<Peer>>,
    /// Ranks other than 0: a direct connection to every other rank but 0, by rank (None for
    /// itself and rank 0), when the group could link every pair ([`TcpComm::link_pairs`]);
    /// empty otherwise. Held while `peers` is.
    links: Mutex<Vec<Option<Peer>>>,
}

impl TcpComm {
    /// Joins the group: rank 0 binds `master` and accepts the other ranks; they connect
    /// (retrying until the timeout, so the ranks may start in any order).
    pub fn connect(rv: &TcpRendezvous) -> CommResult<TcpComm> {
        check_ranks(rv.rank, rv.world_size)?;
        if rv.rank == 0 {
            let listener = TcpListener::bind(&rv.master).map_err(|e| {
                CommError(format!(
                    "rank 0: cannot listen on {} ({e}); give a free host:port with --master",
                    rv.master
                ))
            })?;
            Self::accept(listener, rv.world_size, rv.timeout)
        } else {
            let deadline = Instant::now() + rv.timeout;
            let stream = loop {
                let addrs: Vec<_> = rv
                    .master
                    .to_socket_addrs()
                    .map_err(|e| {
                        CommError(format!("rank {}: bad master {:?}: {e}", rv.rank, rv.master))
                    })?
                    .collect();
                let left = deadline.saturating_duration_since(Instant::now());
                // The first address that connects, else the last address's error (connection
                // refused, unreachable, ...).
                let mut tried = Err(std::io::Error::new(
                    std::io::ErrorKind::NotFound,
                    "the name resolves to no address",
                ));
                for a in &addrs {
                    tried = TcpStream::connect_timeout(a, left.max(Duration::from_millis(10)));
                    if tried.is_ok() {
                        break;
                    }
                }
                match tried {
                    Ok(s) => break s,
                    Err(e) if Instant::now() >= deadline => {
                        return Err(CommError(format!(
                            "rank {}: could not reach rank 0 at {} within {:?} ({e})",
                            rv.rank, rv.master, rv.timeout
                        )))
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(50)),
                }
            };
            let mut peer = peer(stream, 0)?;
            let hello = [HELLO, rv.rank as u64, rv.world_size as u64]
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect::<Vec<u8>>();
            send(&mut peer, &hello)?;
            // Rank 0 answers the greeting: a program at --master that accepts connections but
            // is not rank 0 (another service, a hung process) is named instead of waited on
            // forever.
            let left = deadline
                .saturating_duration_since(Instant::now())
                .max(Duration::from_secs(1));
            let asked = Instant::now();
            let not_rank0 = |why: String| {
                let waited = asked.elapsed();
                let what = if waited + Duration::from_secs(1) < left {
                    // Closed early: rank 0 turns away a rank it refuses.
                    "rank 0 closes the connection of a rank it refuses (another world size, a \
                     rank number already taken, another config: its log says which)"
                        .to_string()
                } else {
                    format!(
                        "no answer in {} s: check --master and that the program there is \
                         cachalot's rank 0",
                        left.as_secs()
                    )
                };
                CommError(format!(
                    "rank {}: {} accepted the connection but did not answer as cachalot rank 0 \
                     ({why}); {what}",
                    rv.rank, rv.master
                ))
            };
            let stream = peer.reader.get_ref();
            stream
                .set_read_timeout(Some(left))
                .map_err(|e| not_rank0(e.to_string()))?;
            let ack = recv(&mut peer).map_err(|e| not_rank0(e.0))?;
            if ack != ack_bytes(rv.rank) {
                return Err(not_rank0(format!("it sent {} other bytes", ack.len())));
            }
            peer.reader
                .get_ref()
                .set_read_timeout(None)
                .map_err(|e| not_rank0(e.to_string()))?;
            let comm = TcpComm {
                rank: rv.rank,
                world_size: rv.world_size,
                peers: Mutex::new(vec![peer]),
                links: Mutex::new(Vec::new()),
            };
            comm.link_pairs(rv.timeout)?;
            Ok(comm)
        }
    }

    /// Rank 0 of a group whose listener is already bound (a launcher binds port 0 and hands the
    /// chosen port to the ranks it starts).
    pub fn accept(
        listener: TcpListener,
        world_size: usize,
        timeout: Duration,
    ) -> CommResult<TcpComm> {
        Self::accept_checked(listener, world_size, timeout, &mut || None)
    }

    /// [`TcpComm::accept`], giving up as soon as `failed` says why (a launcher checks that the
    /// ranks it started are still alive).
    pub fn accept_checked(
        listener: TcpListener,
        world_size: usize,
        timeout: Duration,
        failed: &mut dyn FnMut() -> Option<String>,
    ) -> CommResult<TcpComm> {
        check_ranks(0, world_size)?;
        let addr = listener
            .local_addr()
            .map_or("?".to_string(), |a| a.to_string());
        listener
            .set_nonblocking(true)
            .map_err(|e| CommError(format!("rank 0: listener on {addr}: {e}")))?;
        let deadline = Instant::now() + timeout;
        let mut slots: Vec<Option<Peer>> = (0..world_size).map(|_| None).collect();
        let mut joined = 1;
        while joined < world_size {
            match listener.accept() {
                Ok((stream, from)) => {
                    // A connection that is not a rank (a port probe, a stray client) is
                    // dropped; a rank with another idea of the group is an error.
                    let left = deadline.saturating_duration_since(Instant::now());
                    let Some((mut p, r, n)) = greeting(
                        stream,
                        left.clamp(Duration::from_secs(1), Duration::from_secs(5)),
                    ) else {
                        continue;
                    };
                    if n != world_size || r == 0 || r >= world_size {
                        return Err(CommError(format!(
                            "rank 0: {from} says it is rank {r} of {n}; this group has \
                             world size {world_size} (ranks 1..{world_size} connect)"
                        )));
                    }
                    if slots[r].is_some() {
                        return Err(CommError(format!(
                            "rank 0: two processes claim rank {r} (the second from {from})"
                        )));
                    }
                    p.rank = r;
                    // The answer the rank waits for (see `connect`).
                    send(&mut p, &ack_bytes(r))?;
                    slots[r] = Some(p);
                    joined += 1;
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    if let Some(why) = failed() {
                        return Err(CommError(format!("rank 0: {why}")));
                    }
                    if Instant::now() >= deadline {
                        let missing: Vec<usize> =
                            (1..world_size).filter(|&r| slots[r].is_none()).collect();
                        return Err(CommError(format!(
                            "rank 0: ranks {missing:?} did not connect to {addr} within \
                             {timeout:?}"
                        )));
                    }
                    std::thread::sleep(Duration::from_millis(10));
                }
                Err(e) => return Err(CommError(format!("rank 0: accept on {addr}: {e}"))),
            }
        }
        let comm = TcpComm {
            rank: 0,
            world_size,
            peers: Mutex::new(slots.into_iter().flatten().collect()),
            links: Mutex::new(Vec::new()),
        };
        comm.link_pairs(timeout)?;
        Ok(comm)
    }

    /// Connects every pair of ranks other than 0 directly (rank 0 is linked to all already),
    /// so an all-to-all or a gather moves each part once, straight to its rank, instead of
    /// through rank 0. Collective. Each rank but 0 listens on the address it reaches rank 0
    /// from (port chosen by the system), the addresses are gathered, each rank connects to the
    /// lower ones and accepts the higher ones; when any rank cannot, the group keeps the star
    /// (every rank agrees through one more gather).
    /// `CACHALOT_TCP_LINKS=0` (on every rank) keeps the star, for networks where ranks other
    /// than 0 cannot reach each other.
    fn link_pairs(&self, timeout: Duration) -> CommResult<()> {
        let (me, n) = (self.rank, self.world_size);
        if n <= 2 || std::env::var("CACHALOT_TCP_LINKS").is_ok_and(|v| v == "0") {
            return Ok(());
        }
        let listener = (me != 0)
            .then(|| {
                let peers = self.peers.lock().unwrap_or_else(|e| e.into_inner());
                let ip = peers[0].writer.get_ref().local_addr().ok()?.ip();
                TcpListener::bind((ip, 0)).ok()
            })
            .flatten();
        let mine = listener
            .as_ref()
            .and_then(|l| l.local_addr().ok())
            .map_or(String::new(), |a| a.to_string());
        let addrs = self.all_gather(mine.as_bytes())?;
        let addrs: Vec<String> = addrs
            .iter()
            .map(|a| String::from_utf8_lossy(a).into_owned())
            .collect();
        let mut links: Vec<Option<Peer>> = (0..n).map(|_| None).collect();
        let ok = me == 0
            || (1..n).filter(|&r| r != me).all(|r| !addrs[r].is_empty()) && {
                let deadline = Instant::now() + timeout;
                let hello: Vec<u8> = [HELLO, me as u64, n as u64]
                    .iter()
                    .flat_map(|v| v.to_le_bytes())
                    .collect();
                // Lower ranks (their listeners exist: the connection waits in their backlog).
                let connected = (1..me).all(|r| {
                    let Ok(stream) = TcpStream::connect_timeout(
                        &match addrs[r].parse() {
                            Ok(a) => a,
                            Err(_) => return false,
                        },
                        timeout,
                    ) else {
                        return false;
                    };
                    let Ok(mut p) = peer(stream, r) else {
                        return false;
                    };
                    let sent = send(&mut p, &hello).is_ok();
                    links[r] = Some(p);
                    sent
                });
                // Higher ranks.
                let accepted = connected
                    && listener.as_ref().is_some_and(|l| {
                        let _ = l.set_nonblocking(true);
                        let mut left = n - 1 - me;
                        while left > 0 {
                            match l.accept() {
                                Ok((stream, _)) => {
                                    let wait = deadline.saturating_duration_since(Instant::now());
                                    let Some((mut p, r, w)) =
                                        greeting(stream, wait.max(Duration::from_secs(1)))
                                    else {
                                        continue;
                                    };
                                    if w != n || r <= me || r >= n || links[r].is_some() {
                                        return false;
                                    }
                                    p.rank = r;
                                    links[r] = Some(p);
                                    left -= 1;
                                }
                                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                                    if Instant::now() >= deadline {
                                        return false;
                                    }
                                    std::thread::sleep(Duration::from_millis(2));
                                }
                                Err(_) => return false,
                            }
                        }
                        true
                    });
                accepted
            };
        let all_ok = self.all_gather(&[ok as u8])?.iter().all(|v| v == &[1]);
        if all_ok && me != 0 {
            *self.links.lock().unwrap_or_else(|e| e.into_inner()) = links;
        }
        // Rank 0 marks the mesh with an empty placeholder list of the right length.
        if all_ok && me == 0 {
            *self.links.lock().unwrap_or_else(|e| e.into_inner()) = (0..n).map(|_| None).collect();
        }
        Ok(())
    }

    /// Every pair of ranks is linked directly (all-to-alls and gathers skip rank 0).
    pub fn pairwise(&self) -> bool {
        self.links.lock().unwrap_or_else(|e| e.into_inner()).len() == self.world_size
    }

    /// Every other rank's connection (`peers` for rank 0 and to rank 0, `links` for the rest),
    /// by rank; None without pairwise links.
    fn direct<'a>(
        &self,
        peers: &'a mut [Peer],
        links: &'a mut [Option<Peer>],
    ) -> Option<Vec<&'a mut Peer>> {
        if links.len() != self.world_size {
            return None;
        }
        let mut out: Vec<&mut Peer> = Vec::with_capacity(self.world_size - 1);
        if self.rank == 0 {
            out.extend(peers.iter_mut());
        } else {
            out.push(&mut peers[0]);
            out.extend(links.iter_mut().flatten());
        }
        out.sort_by_key(|p| p.rank);
        Some(out)
    }

    /// Sends `part(s)` to each other rank `s` over the pairwise links while reading what each
    /// sends this rank (a thread writes, so large parts cannot fill both directions' buffers
    /// and stall): every rank's bytes, in rank order, `mine` at this rank's place.
    fn exchange_direct<'b>(
        &self,
        mut conns: Vec<&mut Peer>,
        mine: Vec<u8>,
        part: &(dyn Fn(usize) -> &'b [u8] + Sync),
    ) -> CommResult<Vec<Vec<u8>>> {
        // Parts that fit a socket's buffer are written first, then read, on this thread.
        if conns.iter().all(|p| part(p.rank).len() <= SMALL_PART) {
            let mut got: Vec<Vec<u8>> = vec![Vec::new(); self.world_size];
            for p in conns.iter_mut() {
                write_frame(&mut p.writer, p.rank, part(p.rank))?;
            }
            for p in conns {
                got[p.rank] = read_frame(&mut p.reader, p.rank)?;
            }
            got[self.rank] = mine;
            return Ok(got);
        }
        let mut writers = Vec::with_capacity(conns.len());
        let mut readers = Vec::with_capacity(conns.len());
        for p in conns {
            let Peer {
                rank,
                reader,
                writer,
            } = p;
            writers.push((*rank, writer));
            readers.push((*rank, reader));
        }
        std::thread::scope(|sc| {
            let sending = sc.spawn(move || -> CommResult<()> {
                for (r, w) in writers {
                    write_frame(w, r, part(r))?;
                }
                Ok(())
            });
            let mut got: Vec<Vec<u8>> = vec![Vec::new(); self.world_size];
            got[self.rank] = mine;
            let mut failed = None;
            for (r, rd) in readers {
                match read_frame(rd, r) {
                    Ok(b) => got[r] = b,
                    Err(e) => {
                        failed = Some(e);
                        break;
                    }
                }
            }
            let sent = sending
                .join()
                .unwrap_or_else(|_| Err(CommError("a sending thread panicked".into())));
            match (failed, sent) {
                (Some(e), _) | (None, Err(e)) => Err(e),
                (None, Ok(())) => Ok(got),
            }
        })
    }
}

/// A group of `n` ranks over loopback TCP inside this process (tests and benchmarks of the
/// parallel paths): every rank's communicator, in rank order.
pub fn local_group(n: usize, timeout: Duration) -> CommResult<Vec<TcpComm>> {
    let listener = TcpListener::bind("127.0.0.1:0")
        .map_err(|e| CommError(format!("local group: cannot listen on loopback: {e}")))?;
    let master = listener
        .local_addr()
        .map_err(|e| CommError(format!("local group: {e}")))?
        .to_string();
    let others: Vec<_> = (1..n)
        .map(|rank| {
            let rv = TcpRendezvous {
                rank,
                world_size: n,
                master: master.clone(),
                timeout,
            };
            std::thread::spawn(move || TcpComm::connect(&rv))
        })
        .collect();
    let mut all = vec![TcpComm::accept(listener, n, timeout)?];
    for h in others {
        all.push(
            h.join()
                .map_err(|_| CommError("local group: a rank's connect panicked".into()))??,
        );
    }
    Ok(all)
}

/// Runs `f` on every rank of a [`local_group`] of `n`, each on its own thread; the results in
/// rank order (a rank's panic is raised here).
pub fn run_local_group<T: Send>(
    n: usize,
    f: impl Fn(Arc<dyn Communicator>) -> T + Sync,
) -> CommResult<Vec<T>> {
    let comms = local_group(n, Duration::from_secs(30))?;
    Ok(std::thread::scope(|s| {
        let f = &f;
        let hs: Vec<_> = comms
            .into_iter()
            .map(|c| s.spawn(move || f(Arc::new(c))))
            .collect();
        hs.into_iter()
            .map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
            .collect()
    }))
}

fn ack_bytes(r: usize) -> Vec<u8> {
    [HELLO, r as u64]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect()
}

/// Reads a rank's greeting (within `timeout`): its socket, rank and world size; None when the
/// peer is not a cachalot rank.
fn greeting(stream: TcpStream, timeout: Duration) -> Option<(Peer, usize, usize)> {
    stream.set_nonblocking(false).ok()?;
    stream.set_read_timeout(Some(timeout)).ok()?;
    let mut p = peer(stream, usize::MAX).ok()?;
    let hello = recv(&mut p).ok()?;
    let words: Vec<u64> = hello
        .chunks_exact(8)
        .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")))
        .collect();
    let (r, n) = match words[..] {
        [HELLO, r, n] if hello.len() == 24 => (r as usize, n as usize),
        _ => return None,
    };
    p.reader.get_ref().set_read_timeout(None).ok()?;
    Some((p, r, n))
}

/// TCP keepalive on a rank's socket (Linux): a peer whose host dies or drops off the network
/// is detected after about 90 s of silence (30 s idle, then 6 probes 10 s apart) and unsent
/// data times out after 120 s, so a collective fails naming the rank instead of blocking
/// forever. Waiting on a live but slow rank (a long run's final gather) is not limited.
#[cfg(target_os = "linux")]
fn keepalive(stream: &TcpStream) {
    use std::os::fd::AsRawFd;
    let fd = stream.as_raw_fd();
    let set = |level: libc::c_int, name: libc::c_int, v: libc::c_int| {
        // SAFETY: `fd` is this stream's open socket; the option value is a live c_int of the
        // size passed. A failure leaves the default (no keepalive), which is not an error.
        unsafe {
            libc::setsockopt(
                fd,
                level,
                name,
                (&v as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            );
        }
    };
    set(libc::SOL_SOCKET, libc::SO_KEEPALIVE, 1);
    set(libc::IPPROTO_TCP, libc::TCP_KEEPIDLE, 30);
    set(libc::IPPROTO_TCP, libc::TCP_KEEPINTVL, 10);
    set(libc::IPPROTO_TCP, libc::TCP_KEEPCNT, 6);
    set(libc::IPPROTO_TCP, libc::TCP_USER_TIMEOUT, 120_000);
}

#[cfg(not(target_os = "linux"))]
fn keepalive(_stream: &TcpStream) {}

fn check_ranks(rank: usize, world_size: usize) -> CommResult<()> {
    if world_size == 0 {
        return Err(CommError(
            "world size 0: a group has at least one rank (--world-size N, N >= 1)".into(),
        ));
    }
    if rank >= world_size {
        return Err(CommError(format!(
            "rank {rank} of world size {world_size}: the rank must be in 0..world_size"
        )));
    }
    Ok(())
}

fn peer(stream: TcpStream, rank: usize) -> CommResult<Peer> {
    let _ = stream.set_nodelay(true);
    keepalive(&stream);
    let clone = stream
        .try_clone()
        .map_err(|e| CommError(format!("socket to rank {rank}: {e}")))?;
    Ok(Peer {
        rank,
        reader: BufReader::new(clone),
        writer: BufWriter::new(stream),
    })
}

fn send(p: &mut Peer, bytes: &[u8]) -> CommResult<()> {
    write_frame(&mut p.writer, p.rank, bytes)
}

fn recv(p: &mut Peer) -> CommResult<Vec<u8>> {
    read_frame(&mut p.reader, p.rank)
}

/// One frame to rank `r`: its length (u64) and its bytes.
fn write_frame(w: &mut BufWriter<TcpStream>, r: usize, bytes: &[u8]) -> CommResult<()> {
    let err = |e: std::io::Error| CommError(format!("sending to rank {r}: {e}"));
    w.write_all(&(bytes.len() as u64).to_le_bytes())
        .map_err(err)?;
    w.write_all(bytes).map_err(err)?;
    w.flush().map_err(err)
}

/// One frame from rank `r`.
fn read_frame(rd: &mut BufReader<TcpStream>, r: usize) -> CommResult<Vec<u8>> {
    let err = |e: std::io::Error| {
        if e.kind() == std::io::ErrorKind::UnexpectedEof {
            CommError(format!(
                "rank {r} closed the connection (it exited or failed; see its log)"
            ))
        } else {
            CommError(format!("receiving from rank {r}: {e}"))
        }
    };
    let mut len = [0u8; 8];
    rd.read_exact(&mut len).map_err(err)?;
    let len = u64::from_le_bytes(len);
    if len > MAX_FRAME {
        return Err(CommError(format!(
            "rank {r} sent a frame of {len} bytes (corrupt stream?)"
        )));
    }
    let mut buf = vec![0u8; len as usize];
    rd.read_exact(&mut buf).map_err(err)?;
    Ok(buf)
}

/// Concatenated parts: a u64 count, then each part as a u64 length and its bytes.
pub(crate) fn pack(parts: &[Vec<u8>]) -> Vec<u8> {
    let mut out = (parts.len() as u64).to_le_bytes().to_vec();
    for p in parts {
        out.extend_from_slice(&(p.len() as u64).to_le_bytes());
        out.extend_from_slice(p);
    }
    out
}

fn unpack(b: &[u8], expect: usize) -> CommResult<Vec<Vec<u8>>> {
    let bad = || CommError("rank 0 sent a malformed gathered frame".to_string());
    let word = |at: usize| -> CommResult<u64> {
        b.get(at..at + 8)
            .map(|s| u64::from_le_bytes(s.try_into().expect("8 bytes")))
            .ok_or_else(bad)
    };
    let n = word(0)?;
    if n == FAILED {
        return Err(CommError(String::from_utf8_lossy(&b[8..]).into_owned()));
    }
    if n != expect as u64 {
        return Err(bad());
    }
    let mut at = 8usize;
    let mut parts = Vec::with_capacity(expect);
    for _ in 0..expect {
        let len = usize::try_from(word(at)?).map_err(|_| bad())?;
        at += 8;
        let end = at.checked_add(len).ok_or_else(bad)?;
        parts.push(b.get(at..end).ok_or_else(bad)?.to_vec());
        at = end;
    }
    Ok(parts)
}

impl Communicator for TcpComm {
    fn rank(&self) -> usize {
        self.rank
    }
    /// A peer's connection that reads as closed (or reset) without blocking: the rank ended.
    /// (Between collectives nothing is in flight; bytes waiting mean the rank is there.)
    fn check_peers(&self) -> CommResult<()> {
        let peers = self.peers.lock().unwrap_or_else(|e| e.into_inner());
        let links = self.links.lock().unwrap_or_else(|e| e.into_inner());
        for p in peers.iter().chain(links.iter().flatten()) {
            let s = p.reader.get_ref();
            let gone = |why: String| {
                CommError(format!(
                    "rank {} {why} (it exited or failed; see its log)",
                    p.rank
                ))
            };
            if !p.reader.buffer().is_empty() {
                continue;
            }
            s.set_nonblocking(true)
                .map_err(|e| gone(format!("cannot be checked: {e}")))?;
            let mut b = [0u8; 1];
            let seen = s.peek(&mut b);
            // (Left non-blocking, the next collective would fail on it.)
            s.set_nonblocking(false)
                .map_err(|e| gone(format!("cannot be checked: {e}")))?;
            match seen {
                Ok(0) => return Err(gone("closed its connection".into())),
                Ok(_) => {}
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::Interrupted
                    ) => {}
                Err(e) => return Err(gone(format!("lost its connection: {e}"))),
            }
        }
        Ok(())
    }
    fn transport(&self) -> &'static str {
        "tcp"
    }
    fn world_size(&self) -> usize {
        self.world_size
    }
    fn all_gather(&self, mine: &[u8]) -> CommResult<Vec<Vec<u8>>> {
        let mut peers = self.peers.lock().unwrap_or_else(|e| e.into_inner());
        let mut links = self.links.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(conns) = self.direct(&mut peers, &mut links) {
            return self.exchange_direct(conns, mine.to_vec(), &|_| mine);
        }
        if self.rank == 0 {
            let parts = collect_at_root(&mut peers, mine.to_vec())?;
            let packed = pack(&parts);
            for p in peers.iter_mut() {
                send(p, &packed)?;
            }
            Ok(parts)
        } else {
            let root = &mut peers[0];
            send(root, mine)?;
            unpack(&recv(root)?, self.world_size)
        }
    }
    /// Through rank 0, which forwards to each rank only the parts addressed to it.
    fn all_to_all(&self, parts: &[Vec<u8>]) -> CommResult<Vec<Vec<u8>>> {
        let n = self.world_size;
        check_parts(parts, n)?;
        let mut peers = self.peers.lock().unwrap_or_else(|e| e.into_inner());
        let mut links = self.links.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(conns) = self.direct(&mut peers, &mut links) {
            return self.exchange_direct(conns, parts[self.rank].clone(), &|r| &parts[r]);
        }
        if self.rank == 0 {
            let frames = collect_at_root(&mut peers, pack(parts))?;
            // Every rank's parts, by sender; a malformed one fails the group.
            let mut by_sender = Vec::with_capacity(n);
            for (r, f) in frames.iter().enumerate() {
                match unpack_parts(f, n) {
                    Some(p) => by_sender.push(p),
                    None => {
                        let e = CommError(format!(
                            "all_to_all: rank {r} sent a malformed frame of {} bytes",
                            f.len()
                        ));
                        fail_peers(&mut peers, &e);
                        return Err(e);
                    }
                }
            }
            for (s, p) in peers.iter_mut().enumerate() {
                let to_s: Vec<Vec<u8>> = by_sender
                    .iter_mut()
                    .map(|q| std::mem::take(&mut q[s + 1]))
                    .collect();
                send(p, &pack(&to_s))?;
            }
            Ok(by_sender
                .iter_mut()
                .map(|q| std::mem::take(&mut q[0]))
                .collect())
        } else {
            let root = &mut peers[0];
            send(root, &pack(parts))?;
            unpack(&recv(root)?, n)
        }
    }
}

/// Rank 0's side of a gather: its own part and every other rank's, in rank order. A rank that
/// fails makes rank 0 tell the others which one before it returns the error.
fn collect_at_root(peers: &mut [Peer], mine: Vec<u8>) -> CommResult<Vec<Vec<u8>>> {
    let mut parts = vec![mine];
    for i in 0..peers.len() {
        match recv(&mut peers[i]) {
            Ok(b) => parts.push(b),
            Err(e) => {
                fail_peers(peers, &e);
                return Err(e);
            }
        }
    }
    Ok(parts)
}

/// Rank 0 tells the ranks still there which one failed, not just that rank 0 left.
fn fail_peers(peers: &mut [Peer], e: &CommError) {
    let mut frame = FAILED.to_le_bytes().to_vec();
    frame.extend_from_slice(format!("rank 0 reports: {e}").as_bytes());
    for p in peers.iter_mut() {
        let _ = send(p, &frame);
    }
}

#[cfg(test)]
mod tests {

    #[cfg(target_os = "linux")]
    #[test]
    fn rank_sockets_keep_alive() {
        use std::os::fd::AsRawFd;
        let comms = group(2);
        let get = |fd: i32, level: libc::c_int, name: libc::c_int| {
            let mut v: libc::c_int = -1;
            let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
            // SAFETY: a live socket and an out-value of the size given.
            let rc = unsafe {
                libc::getsockopt(
                    fd,
                    level,
                    name,
                    (&mut v as *mut libc::c_int).cast(),
                    &mut len,
                )
            };
            assert_eq!(rc, 0);
            v
        };
        let fd = comms[1].peers.lock().unwrap()[0]
            .writer
            .get_ref()
            .as_raw_fd();
        assert_eq!(get(fd, libc::SOL_SOCKET, libc::SO_KEEPALIVE), 1);
        assert_eq!(get(fd, libc::IPPROTO_TCP, libc::TCP_KEEPIDLE), 30);
    }

    use super::*;

    /// A TcpComm group of `n` ranks on threads of this process (rank 0 on port 0).
    fn group(n: usize) -> Vec<TcpComm> {
        local_group(n, Duration::from_secs(10)).unwrap()
    }

    #[test]
    fn single_process_collectives_are_the_identity() {
        let c = SingleProcess;
        assert_eq!(c.all_gather(b"abc").unwrap(), vec![b"abc".to_vec()]);
        let mut v = [1.5f32, -2.0];
        c.all_reduce_sum(&mut v).unwrap();
        assert_eq!(v, [1.5, -2.0]);
        assert_eq!(c.broadcast(0, b"x").unwrap(), b"x".to_vec());
        assert!(c.broadcast(1, b"x").is_err());
        c.barrier().unwrap();
    }

    /// Every rank's checks of the collectives' contract, each rank on its own thread.
    fn check_collectives(comms: Vec<Arc<dyn Communicator>>) {
        let n = comms.len();
        let handles: Vec<_> = comms
            .into_iter()
            .map(|c| {
                std::thread::spawn(move || {
                    let r = c.rank();
                    // Parts of different lengths, an empty one included.
                    let mine = vec![r as u8; r * 3];
                    let all = c.all_gather(&mine).unwrap();
                    let want: Vec<Vec<u8>> = (0..n).map(|q| vec![q as u8; q * 3]).collect();
                    assert_eq!(all, want, "rank {r}");
                    // Sum in rank order: 0.1 + 1e8 - 1e8 + 0.3 differs from other orders.
                    let vals = [0.1f32, 1e8, -1e8, 0.3];
                    let mut v = vec![vals[r % 4], r as f32];
                    c.all_reduce_sum(&mut v).unwrap();
                    let mut s = 0.0f32;
                    for q in 0..n {
                        s += vals[q % 4];
                    }
                    assert_eq!(v[0].to_bits(), s.to_bits(), "rank {r}");
                    assert_eq!(v[1], (n * (n - 1) / 2) as f32);
                    let b = c.broadcast(n - 1, &[7, r as u8]).unwrap();
                    assert_eq!(b, vec![7, (n - 1) as u8]);
                    c.barrier().unwrap();
                    // All-to-all: rank r sends rank s `s + 1` copies of `r * 16 + s` (its own
                    // part included); a wrong part count is refused on the caller.
                    let parts: Vec<Vec<u8>> =
                        (0..n).map(|s| vec![(r * 16 + s) as u8; s + 1]).collect();
                    let got = c.all_to_all(&parts).unwrap();
                    let want: Vec<Vec<u8>> =
                        (0..n).map(|q| vec![(q * 16 + r) as u8; r + 1]).collect();
                    assert_eq!(got, want, "rank {r}");
                    let err = c.all_to_all(&parts[..n - 1]).unwrap_err().to_string();
                    assert!(err.contains("parts for a group of"), "{err}");
                    // Many calls in a row (slots are reused every other call), sizes changing,
                    // and parts larger than a shared-memory slot (several calls each, ranks
                    // needing different numbers of them); the bytes vary along a part.
                    let big = |q: usize| if q == 1 { 9 << 20 } else { 5 << 20 };
                    let pat = |seed: usize, len: usize| -> Vec<u8> {
                        (0..len).map(|k| (seed + k / 4099) as u8).collect()
                    };
                    for i in 0..300usize {
                        let len = if (i == 150 || i == 151) && r <= 1 {
                            big(r)
                        } else {
                            (i * 7 + r) % 50
                        };
                        if i % 3 == 1 {
                            // All-to-all between the gathers (call 151: rank 1's frame over a
                            // slot); part r -> s holds `i + r + s`, `len + s` bytes long.
                            let parts: Vec<Vec<u8>> =
                                (0..n).map(|s| pat(i + r + s, len + s)).collect();
                            let got = c.all_to_all(&parts).unwrap();
                            for (q, part) in got.iter().enumerate() {
                                let qlen = if i == 151 && q <= 1 {
                                    big(q)
                                } else {
                                    (i * 7 + q) % 50
                                };
                                assert_eq!(part.len(), qlen + r, "call {i}, rank {r}, from {q}");
                                assert!(*part == pat(i + q + r, qlen + r), "call {i}, from {q}");
                            }
                            continue;
                        }
                        let mine = pat(i + r, len);
                        let all = c.all_gather(&mine).unwrap();
                        for (q, part) in all.iter().enumerate() {
                            let len = if i == 150 && q <= 1 {
                                big(q)
                            } else {
                                (i * 7 + q) % 50
                            };
                            assert_eq!(part.len(), len, "call {i}, rank {r}, part {q}");
                            assert!(*part == pat(i + q, len), "call {i}, rank {r}, part {q}");
                        }
                    }
                })
            })
            .collect();
        for h in handles {
            h.join().unwrap();
        }
    }

    /// A local group moved onto shared memory (each rank's `share_memory` on its own thread).
    #[cfg(target_os = "linux")]
    fn shm_group(n: usize) -> Vec<Arc<dyn Communicator>> {
        let hs: Vec<_> = group(n)
            .into_iter()
            .map(|c| std::thread::spawn(move || share_memory(c, true).unwrap()))
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    }

    #[test]
    fn tcp_group_gathers_reduces_and_broadcasts_in_rank_order() {
        let tcp = group(4);
        // Four ranks link every pair (gathers and all-to-alls go straight to each rank).
        assert!(tcp.iter().all(TcpComm::pairwise));
        let comms = tcp
            .into_iter()
            .map(|c| Arc::new(c) as Arc<dyn Communicator>)
            .collect();
        check_collectives(comms);
    }

    /// A rank whose peer left sees it without a collective; while the peers are there (bytes
    /// waiting or not) nothing is said, and the connections still carry collectives after.
    #[test]
    fn peers_that_leave_are_noticed_between_collectives() {
        let mut g = group(3);
        for c in &g {
            c.check_peers().unwrap();
        }
        let last = g.pop().unwrap();
        drop(last);
        // Rank 0 holds a connection to rank 2; rank 1 a direct link to it.
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        for c in &g {
            let e = loop {
                match c.check_peers() {
                    Err(e) => break e,
                    Ok(()) if std::time::Instant::now() < deadline => {
                        std::thread::sleep(Duration::from_millis(10))
                    }
                    Ok(()) => panic!("rank {} did not notice rank 2 leave", c.rank()),
                }
            };
            assert!(e.0.contains("rank 2"), "{e:?}");
        }
        let g = group(2);
        let hs: Vec<_> = g
            .into_iter()
            .map(|c| {
                std::thread::spawn(move || {
                    c.check_peers().unwrap();
                    c.barrier().unwrap();
                    c.check_peers().unwrap();
                    assert_eq!(
                        c.all_gather(&[c.rank() as u8]).unwrap(),
                        vec![vec![0], vec![1]]
                    );
                })
            })
            .collect();
        hs.into_iter().for_each(|h| h.join().unwrap());
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn shared_memory_group_gathers_reduces_and_broadcasts_in_rank_order() {
        for n in [2, 3] {
            let comms = shm_group(n);
            assert!(comms.iter().all(|c| c.transport() == "shared memory"));
            check_collectives(comms);
        }
        // A rank that does not ask for shared memory keeps the whole group on TCP (which
        // answers the same).
        let hs: Vec<_> = group(2)
            .into_iter()
            .map(|c| std::thread::spawn(move || share_memory(c, false).unwrap()))
            .collect();
        let comms: Vec<_> = hs.into_iter().map(|h| h.join().unwrap()).collect();
        assert!(comms.iter().all(|c| c.transport() == "tcp"));
        check_collectives(comms);
        // The file is gone once the group is made.
        let left = std::fs::read_dir("/dev/shm")
            .unwrap()
            .filter_map(|e| e.ok())
            .filter(|e| {
                e.file_name()
                    .to_string_lossy()
                    .starts_with(&format!("cachalot-comm-{}-", std::process::id()))
            })
            .count();
        assert_eq!(left, 0);
    }

    /// Rank 1 of a two-rank group in a child process (started by the test below with
    /// CACHALOT_TEST_MASTER set): one collective, then the process ends without leaving the
    /// group (as a crash would).
    #[cfg(target_os = "linux")]
    #[test]
    #[ignore = "run by a_rank_process_that_dies_fails_a_shared_memory_group"]
    fn shared_memory_rank_that_dies() {
        let Ok(master) = std::env::var("CACHALOT_TEST_MASTER") else {
            return;
        };
        let rv = TcpRendezvous {
            rank: 1,
            world_size: 2,
            master,
            timeout: Duration::from_secs(10),
        };
        let c = share_memory(TcpComm::connect(&rv).unwrap(), true).unwrap();
        assert_eq!(c.transport(), "shared memory");
        c.all_gather(b"1").unwrap();
        std::process::exit(3);
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn a_rank_process_that_dies_fails_a_shared_memory_group() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let master = listener.local_addr().unwrap().to_string();
        let mut child = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "tests::shared_memory_rank_that_dies",
                "--ignored",
            ])
            .env("CACHALOT_TEST_MASTER", &master)
            .stdout(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let tcp = TcpComm::accept(listener, 2, Duration::from_secs(30)).unwrap();
        let c = share_memory(tcp, true).unwrap();
        assert_eq!(c.transport(), "shared memory");
        assert_eq!(
            c.all_gather(b"0").unwrap(),
            vec![b"0".to_vec(), b"1".to_vec()]
        );
        let t = Instant::now();
        let err = c.all_gather(b"0").unwrap_err().to_string();
        assert!(err.contains("rank 1") && err.contains("exited"), "{err}");
        assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
        assert_eq!(child.wait().unwrap().code(), Some(3));
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn a_rank_that_leaves_a_shared_memory_group_fails_the_collective_with_its_name() {
        let mut comms = shm_group(3);
        drop(comms.pop());
        let c1 = comms.pop().unwrap();
        let h = std::thread::spawn(move || c1.all_gather(b"1").map(|_| ()));
        let err = comms[0].all_gather(b"0").unwrap_err().to_string();
        assert!(err.contains("rank 2 left the group"), "{err}");
        let err1 = h.join().unwrap().unwrap_err().to_string();
        assert!(err1.contains("rank 2 left the group"), "{err1}");
    }

    #[test]
    fn a_rank_that_leaves_fails_the_collective_with_its_name() {
        let mut comms = group(3);
        let c2 = comms.pop().unwrap();
        drop(c2);
        let c1 = comms.pop().unwrap();
        let h = std::thread::spawn(move || c1.all_gather(b"1"));
        let err = comms[0].all_gather(b"0").unwrap_err().to_string();
        assert!(err.contains("rank 2 closed the connection"), "{err}");
        // Rank 1 hears from rank 0 which rank failed.
        let err1 = h.join().unwrap().unwrap_err().to_string();
        assert!(err1.contains("rank 2 closed the connection"), "{err1}");
        drop(comms);
    }

    #[test]
    fn rendezvous_errors_name_the_problem() {
        let bad = TcpRendezvous {
            rank: 3,
            world_size: 2,
            master: "127.0.0.1:0".into(),
            timeout: Duration::from_millis(100),
        };
        let e = TcpComm::connect(&bad).err().unwrap().to_string();
        assert!(e.contains("rank 3 of world size 2"), "{e}");
        // Nobody listens: a clear timeout naming the address.
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let lonely = TcpRendezvous {
            rank: 1,
            world_size: 2,
            master: format!("127.0.0.1:{port}"),
            timeout: Duration::from_millis(200),
        };
        let e = TcpComm::connect(&lonely).err().unwrap().to_string();
        assert!(e.contains("could not reach rank 0"), "{e}");
        // Rank 0 waiting for a rank that never comes.
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let e = TcpComm::accept(listener, 2, Duration::from_millis(200))
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("ranks [1] did not connect"), "{e}");
        // Something else listens at --master, accepts and says nothing: named, not waited on.
        let silent = TcpListener::bind("127.0.0.1:0").unwrap();
        let at = silent.local_addr().unwrap().to_string();
        // (Holds the connection far longer than the rendezvous; left running when the test ends.)
        std::thread::spawn(move || {
            let c = silent.accept();
            std::thread::sleep(Duration::from_secs(60));
            drop(c);
        });
        let t0 = Instant::now();
        let e = TcpComm::connect(&TcpRendezvous {
            rank: 1,
            world_size: 2,
            master: at,
            timeout: Duration::from_millis(1500),
        })
        .err()
        .unwrap()
        .to_string();
        assert!(e.contains("did not answer as cachalot rank 0"), "{e}");
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "waited on the silent peer, not the rendezvous"
        );
    }

    #[test]
    fn connections_that_are_not_ranks_are_dropped() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let master = listener.local_addr().unwrap().to_string();
        // A silent client and one that sends junk, then the real rank.
        let silent = TcpStream::connect(&master).unwrap();
        let mut junk = TcpStream::connect(&master).unwrap();
        junk.write_all(&[3, 0, 0, 0, 0, 0, 0, 0, 1, 2, 3]).unwrap();
        let rv = TcpRendezvous {
            rank: 1,
            world_size: 2,
            master,
            timeout: Duration::from_secs(10),
        };
        let h = std::thread::spawn(move || TcpComm::connect(&rv).unwrap());
        drop(silent);
        let root = TcpComm::accept(listener, 2, Duration::from_secs(10)).unwrap();
        let one = h.join().unwrap();
        let h = std::thread::spawn(move || one.all_gather(b"b").unwrap());
        assert_eq!(
            root.all_gather(b"a").unwrap(),
            vec![b"a".to_vec(), b"b".to_vec()]
        );
        h.join().unwrap();
    }
}
