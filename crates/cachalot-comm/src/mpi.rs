//! The MPI backend: [`MpiComm`], the [`Communicator`] over `MPI_COMM_WORLD` of a process started
//! by `mpirun`/`mpiexec` (or a batch system's launcher), with the cargo feature `mpi`.
//!
//! Spec: `executor.md` §1 (the parallel sizes a YAML names, over `world_size` ranks on one or
//! more hosts); DESIGN.md, "Ranks" (multi-rank is a backend of the communicator trait). What
//! MPI brings over [`crate::TcpComm`]: the launchers of clusters (host files, Slurm) start the
//! ranks, and the library's own transports carry the bytes (shared memory between the ranks of
//! a host, InfiniBand/RoCE RDMA where the MPI build has it).
//!
//! Rust does not name MPI's handles (pointers in Open MPI, integers in MPICH): it calls the
//! plain C functions of `mpi/shim.c`, which `build.rs` compiles against the installed `mpi.h`.
//! The world communicator returns errors rather than aborting (`MPI_ERRORS_RETURN`); each one
//! comes back as a [`CommError`] with MPI's text. Calls are serialized by a lock
//! (`MPI_THREAD_SERIALIZED`: the command runs on a pool worker, not on the thread that started
//! MPI).
//!
//! The collectives carry bytes in rank order as the other backends do, so a run gives the same
//! bits over MPI as over TCP or shared memory: `all_reduce_sum` keeps the trait's default
//! (gather, then add in rank order on every rank) instead of `MPI_Allreduce`, whose order of
//! addition MPI leaves open. MPI counts are C `int`s: payloads are exchanged in rounds of at most
//! `i32::MAX / world_size` bytes per rank and pair, so any size goes through.
//!
//! A process that fails must not leave the others waiting in a collective: [`finish`] ends MPI
//! with `MPI_Finalize` after a command that succeeded and with `MPI_Abort` (which ends every
//! rank of the job) after one that failed.

use std::ffi::{c_char, c_int, c_void};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use crate::{check_parts, CommError, CommResult, Communicator};

mod ffi {
    use std::ffi::{c_char, c_int, c_void};
    extern "C" {
        pub fn cachalot_mpi_init(
            rank: *mut c_int,
            size: *mut c_int,
            host_ranks: *mut c_int,
            provided: *mut c_int,
            already: *mut c_int,
        ) -> c_int;
        pub fn cachalot_mpi_thread_serialized() -> c_int;
        pub fn cachalot_mpi_test(done: *mut c_int) -> c_int;
        pub fn cachalot_mpi_iallgather(
            mine: *const c_void,
            bytes: c_int,
            all: *mut c_void,
        ) -> c_int;
        pub fn cachalot_mpi_iallgatherv(
            mine: *const c_void,
            bytes: c_int,
            all: *mut c_void,
            counts: *const c_int,
            displs: *const c_int,
        ) -> c_int;
        pub fn cachalot_mpi_ialltoallv(
            send: *const c_void,
            scounts: *const c_int,
            sdispls: *const c_int,
            recv: *mut c_void,
            rcounts: *const c_int,
            rdispls: *const c_int,
        ) -> c_int;
        pub fn cachalot_mpi_ibcast(buf: *mut c_void, bytes: c_int, root: c_int) -> c_int;
        pub fn cachalot_mpi_ibarrier() -> c_int;
        pub fn cachalot_mpi_error_string(code: c_int, buf: *mut c_char, len: *mut c_int) -> c_int;
        pub fn cachalot_mpi_max_error_string() -> c_int;
        pub fn cachalot_mpi_finalize() -> c_int;
        pub fn cachalot_mpi_abort(code: c_int) -> c_int;
    }
}

/// MPI's words for an error code.
fn error_text(code: c_int) -> String {
    // SAFETY: the buffer holds MPI_MAX_ERROR_STRING bytes, as MPI_Error_string requires.
    unsafe {
        let cap = ffi::cachalot_mpi_max_error_string().max(1) as usize;
        let mut buf = vec![0u8; cap + 1];
        let mut len: c_int = 0;
        if ffi::cachalot_mpi_error_string(code, buf.as_mut_ptr() as *mut c_char, &mut len) != 0 {
            return format!("MPI error {code}");
        }
        buf.truncate((len.max(0) as usize).min(cap));
        String::from_utf8_lossy(&buf).into_owned()
    }
}

fn check(rc: c_int, what: &str) -> CommResult<()> {
    if rc == 0 {
        Ok(())
    } else {
        Err(CommError(format!(
            "MPI {what} failed: {} (error {rc})",
            error_text(rc)
        )))
    }
}

/// How long a wait polls without pause before it starts to sleep between polls, unless
/// `CACHALOT_MPI_SPIN_US` says otherwise. On one host 200 µs keeps a step's collectives as
/// fast as blocking calls; where ranks share cores with the kernel's network work (several
/// ranks per core, or Open MPI's TCP transport on a small machine) a shorter spin frees them
/// sooner (docs/PERF.md).
const SPIN: Duration = Duration::from_micros(200);

/// [`SPIN`], or `CACHALOT_MPI_SPIN_US` microseconds.
fn spin() -> Duration {
    static SPIN_US: OnceLock<Duration> = OnceLock::new();
    *SPIN_US.get_or_init(|| {
        std::env::var("CACHALOT_MPI_SPIN_US")
            .ok()
            .and_then(|v| v.trim().parse::<u64>().ok())
            .map_or(SPIN, Duration::from_micros)
    })
}

/// The longest sleep between polls while a wait is young: MPI moves a transfer along only
/// inside its calls (Open MPI's TCP transport needs several rounds of them per collective), so
/// a step's collectives are polled often, yet the core is left to the kernel's network work
/// and the other processes on it.
const SHORT_NAP: Duration = Duration::from_micros(50);

/// After this long a wait is an idle one (a server's rank waiting for requests)...
const IDLE_AFTER: Duration = Duration::from_millis(10);

/// ... and sleeps up to this long between polls.
const IDLE_NAP: Duration = Duration::from_millis(1);

/// Starts a nonblocking operation (`start` returns MPI's code) and waits for it: polls
/// `MPI_Test` for [`spin`], then sleeps between polls, 10 µs doubling up to [`SHORT_NAP`], and
/// past [`IDLE_AFTER`] up to [`IDLE_NAP`]. The buffers `start` names must outlive the call
/// (they are the caller's locals).
fn run_op(what: &str, start: impl FnOnce() -> c_int) -> CommResult<()> {
    check(start(), what)?;
    let t0 = Instant::now();
    let mut nap = Duration::from_micros(10);
    loop {
        let mut done: c_int = 0;
        // SAFETY: tests the request the shim keeps for the operation just started.
        check(unsafe { ffi::cachalot_mpi_test(&mut done) }, what)?;
        if done != 0 {
            return Ok(());
        }
        let waited = t0.elapsed();
        if waited < spin() {
            std::hint::spin_loop();
        } else {
            std::thread::sleep(nap);
            let cap = if waited < IDLE_AFTER {
                SHORT_NAP
            } else {
                IDLE_NAP
            };
            nap = (nap * 2).min(cap);
        }
    }
}

/// A byte count as MPI's `int` (the rounds keep every count within it).
fn count(n: usize) -> c_int {
    c_int::try_from(n).expect("a round's counts stay within i32::MAX")
}

/// Prefix sums of `counts` (MPI's displacements), and their total.
fn displacements(counts: &[c_int]) -> (Vec<c_int>, usize) {
    let mut at = 0usize;
    let displs = counts
        .iter()
        .map(|&c| {
            let d = at;
            at += c as usize;
            count(d)
        })
        .collect();
    (displs, at)
}

/// The bytes of `len` that go in round `round` of rounds of `chunk` bytes.
fn piece(len: usize, chunk: usize, round: usize) -> std::ops::Range<usize> {
    let start = (round * chunk).min(len);
    start..(start + chunk).min(len)
}

/// A send buffer's address for MPI. An empty slice's is a dangling 0x1, which Open MPI reads as
/// `MPI_IN_PLACE`: empty buffers point at a static byte instead.
fn send_ptr(b: &[u8]) -> *const c_void {
    static NOTHING: [u8; 1] = [0];
    if b.is_empty() {
        NOTHING.as_ptr() as *const c_void
    } else {
        b.as_ptr() as *const c_void
    }
}

/// A receive buffer of `total` bytes, allocated even when empty (see [`send_ptr`]).
fn recv_buf(total: usize) -> Vec<u8> {
    let mut v = Vec::with_capacity(total.max(1));
    v.resize(total, 0);
    v
}

/// Appends each rank's piece of a round's buffer (laid out by `counts` and `displs`) to its
/// output.
fn append_pieces(out: &mut [Vec<u8>], buf: &[u8], counts: &[c_int], displs: &[c_int]) {
    for ((o, &c), &d) in out.iter_mut().zip(counts).zip(displs) {
        o.extend_from_slice(&buf[d as usize..d as usize + c as usize]);
    }
}

/// The rounds of `chunk` bytes that the longest of `lens` takes (every rank runs as many).
fn most_rounds(lens: &[usize], chunk: usize) -> usize {
    lens.iter()
        .map(|&l| rounds_for(l, chunk))
        .max()
        .unwrap_or(0)
}

/// Each of `lens`'s bytes in round `round`, as MPI's counts.
fn round_counts(lens: &[usize], chunk: usize, round: usize) -> Vec<c_int> {
    lens.iter()
        .map(|&l| count(piece(l, chunk, round).len()))
        .collect()
}

/// Rounds of `chunk` bytes that `len` bytes take.
fn rounds_for(len: usize, chunk: usize) -> usize {
    len.div_ceil(chunk)
}

/// The world group of an MPI job (see the module documentation).
pub struct MpiComm {
    rank: usize,
    world_size: usize,
    host_ranks: usize,
    /// Serializes the MPI calls (MPI_THREAD_SERIALIZED).
    lock: Mutex<()>,
    /// Most bytes per rank (and per pair, for all-to-all) in one MPI call.
    chunk: AtomicUsize,
}

/// The MPI world this process joined (started once; a second call returns the same group).
static WORLD: OnceLock<Result<Arc<MpiComm>, String>> = OnceLock::new();

/// Starts MPI (once per process) and returns the world group.
pub fn world() -> CommResult<Arc<MpiComm>> {
    WORLD
        .get_or_init(|| {
            let (mut rank, mut size, mut host, mut provided, mut already) = (0, 0, 0, 0, 0);
            // SAFETY: the shim only writes the five integers it is given.
            let rc = unsafe {
                ffi::cachalot_mpi_init(&mut rank, &mut size, &mut host, &mut provided, &mut already)
            };
            check(rc, "start (MPI_Init_thread)").map_err(|e| e.0)?;
            // SAFETY: returns a constant.
            let needed = unsafe { ffi::cachalot_mpi_thread_serialized() };
            if provided < needed {
                // SAFETY: MPI was started above; no call is pending.
                unsafe { ffi::cachalot_mpi_finalize() };
                return Err(format!(
                    "MPI provides thread level {provided}, below MPI_THREAD_SERIALIZED \
                     ({needed}) that cachalot needs (its collectives run on pool threads): use \
                     an MPI built with thread support"
                ));
            }
            let world_size = usize::try_from(size).unwrap_or(0).max(1);
            Ok(Arc::new(MpiComm {
                rank: usize::try_from(rank).unwrap_or(0),
                world_size,
                host_ranks: usize::try_from(host).unwrap_or(1).max(1),
                lock: Mutex::new(()),
                chunk: AtomicUsize::new(default_chunk(world_size)),
            }))
        })
        .clone()
        .map_err(CommError)
}

/// Bytes per rank in one call, so that a call's total stays within MPI's `int` counts.
fn default_chunk(world_size: usize) -> usize {
    (i32::MAX as usize / world_size.max(1)).max(1)
}

/// Ends MPI if this process joined it through [`world`]: `MPI_Finalize` after a command that succeeded,
/// `MPI_Abort` (every rank of the job ends) after one that failed, so no rank waits forever
/// for one that left. Does nothing in a process without MPI.
pub fn finish(ok: bool) {
    if let Some(Ok(_)) = WORLD.get() {
        // SAFETY: MPI was started by `world`; both calls take no pointers.
        unsafe {
            if ok {
                ffi::cachalot_mpi_finalize();
            } else {
                ffi::cachalot_mpi_abort(1);
            }
        }
    }
}

impl MpiComm {
    /// Ranks of the job on this host (MPI_COMM_TYPE_SHARED): they share its cores and memory.
    pub fn host_ranks(&self) -> usize {
        self.host_ranks
    }

    /// Caps the bytes per rank (and per pair) that one MPI call carries: tests use small caps
    /// to run the rounds that only payloads over 2 GiB / world_size need otherwise. Every rank
    /// must set the same cap.
    #[doc(hidden)]
    pub fn set_round_bytes(&self, bytes: usize) {
        let cap = default_chunk(self.world_size);
        self.chunk.store(bytes.clamp(1, cap), Ordering::Relaxed);
    }

    fn chunk(&self) -> usize {
        self.chunk.load(Ordering::Relaxed)
    }

    fn locked(&self) -> std::sync::MutexGuard<'_, ()> {
        self.lock.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// `words` (the same count on every rank) from every rank, in rank order, one after the
    /// other (the lock held).
    fn gather_words(&self, words: &[u64], what: &str) -> CommResult<Vec<u64>> {
        let mut all = vec![0u64; words.len() * self.world_size];
        let bytes = count(words.len() * 8);
        // SAFETY: `words` holds `bytes` bytes; `all` holds that many per rank.
        run_op(what, || unsafe {
            ffi::cachalot_mpi_iallgather(
                words.as_ptr() as *const c_void,
                bytes,
                all.as_mut_ptr() as *mut c_void,
            )
        })?;
        Ok(all)
    }
}

fn to_usize(w: u64, what: &str, rank: usize) -> CommResult<usize> {
    usize::try_from(w).map_err(|_| {
        CommError(format!(
            "MPI {what}: rank {rank} announced {w} bytes, more than this host can address"
        ))
    })
}

impl Communicator for MpiComm {
    fn rank(&self) -> usize {
        self.rank
    }
    fn world_size(&self) -> usize {
        self.world_size
    }
    fn transport(&self) -> &'static str {
        "mpi"
    }

    fn all_gather(&self, mine: &[u8]) -> CommResult<Vec<Vec<u8>>> {
        let _g = self.locked();
        let lens = self
            .gather_words(&[mine.len() as u64], "all-gather of sizes")?
            .into_iter()
            .enumerate()
            .map(|(r, w)| to_usize(w, "all-gather", r))
            .collect::<CommResult<Vec<usize>>>()?;
        let chunk = self.chunk();
        let rounds = most_rounds(&lens, chunk);
        let mut out: Vec<Vec<u8>> = lens.iter().map(|&l| Vec::with_capacity(l)).collect();
        for round in 0..rounds {
            let counts = round_counts(&lens, chunk, round);
            let (displs, total) = displacements(&counts);
            let mut buf = recv_buf(total);
            let part = &mine[piece(mine.len(), chunk, round)];
            // SAFETY: `part` holds counts[rank] bytes; `buf` holds the sum of `counts`, laid out
            // by `displs`; both arrays have world_size entries.
            run_op("all-gather", || unsafe {
                ffi::cachalot_mpi_iallgatherv(
                    send_ptr(part),
                    count(part.len()),
                    buf.as_mut_ptr() as *mut c_void,
                    counts.as_ptr(),
                    displs.as_ptr(),
                )
            })?;
            append_pieces(&mut out, &buf, &counts, &displs);
        }
        Ok(out)
    }

    fn all_to_all(&self, parts: &[Vec<u8>]) -> CommResult<Vec<Vec<u8>>> {
        let n = self.world_size;
        check_parts(parts, n)?;
        let _g = self.locked();
        // Every rank's sizes for every rank (row s: what rank s sends to each): this rank's
        // column is what it receives, and the largest entry sets the rounds on every rank.
        let sizes: Vec<u64> = parts.iter().map(|p| p.len() as u64).collect();
        let all = self
            .gather_words(&sizes, "all-to-all of sizes")?
            .into_iter()
            .enumerate()
            .map(|(i, w)| to_usize(w, "all-to-all", i / n))
            .collect::<CommResult<Vec<usize>>>()?;
        let recv_lens: Vec<usize> = (0..n).map(|s| all[s * n + self.rank]).collect();
        let chunk = self.chunk();
        let rounds = most_rounds(&all, chunk);
        let mut out: Vec<Vec<u8>> = recv_lens.iter().map(|&l| Vec::with_capacity(l)).collect();
        for round in 0..rounds {
            let pieces: Vec<&[u8]> = parts
                .iter()
                .map(|p| &p[piece(p.len(), chunk, round)])
                .collect();
            let scounts: Vec<c_int> = pieces.iter().map(|p| count(p.len())).collect();
            let (sdispls, _) = displacements(&scounts);
            let send = pieces.concat();
            let rcounts = round_counts(&recv_lens, chunk, round);
            let (rdispls, total) = displacements(&rcounts);
            let mut recv = recv_buf(total);
            // SAFETY: `send` and `recv` hold the sums of their counts, laid out by their
            // displacements; every array has world_size entries.
            run_op("all-to-all", || unsafe {
                ffi::cachalot_mpi_ialltoallv(
                    send_ptr(&send),
                    scounts.as_ptr(),
                    sdispls.as_ptr(),
                    recv.as_mut_ptr() as *mut c_void,
                    rcounts.as_ptr(),
                    rdispls.as_ptr(),
                )
            })?;
            append_pieces(&mut out, &recv, &rcounts, &rdispls);
        }
        Ok(out)
    }

    fn broadcast(&self, root: usize, mine: &[u8]) -> CommResult<Vec<u8>> {
        let n = self.world_size;
        if root >= n {
            return Err(CommError(format!(
                "broadcast: root {root} is outside 0..{n}"
            )));
        }
        let _g = self.locked();
        let mut len = mine.len() as u64;
        // SAFETY: 8 bytes from the root into `len` on every rank.
        run_op("broadcast of the size", || unsafe {
            ffi::cachalot_mpi_ibcast(&mut len as *mut u64 as *mut c_void, 8, count(root))
        })?;
        let len = to_usize(len, "broadcast", root)?;
        let mut buf = if self.rank == root {
            mine.to_vec()
        } else {
            vec![0u8; len]
        };
        let chunk = self.chunk();
        for round in 0..rounds_for(len, chunk) {
            let r = piece(len, chunk, round);
            let part = &mut buf[r];
            // SAFETY: every rank passes the same count into a buffer that long.
            run_op("broadcast", || unsafe {
                ffi::cachalot_mpi_ibcast(
                    part.as_mut_ptr() as *mut c_void,
                    count(part.len()),
                    count(root),
                )
            })?;
        }
        Ok(buf)
    }

    fn barrier(&self) -> CommResult<()> {
        let _g = self.locked();
        // SAFETY: takes no arguments.
        run_op("barrier", || unsafe { ffi::cachalot_mpi_ibarrier() })
    }
}

/// `mpirun -n N` for tests, with what CI containers need: Open MPI's run-as-root and
/// oversubscription (ranks beyond the cores), no single-copy shared memory (containers without
/// ptrace refuse it), and a time limit (MPICH's Hydra takes it from the environment). Add the
/// program and its arguments. `CACHALOT_MPIRUN` names another launcher (the one of the MPI
/// that `CACHALOT_MPICC` built against, e.g. `mpirun.mpich`).
#[doc(hidden)]
pub fn test_launcher(ranks: usize, timeout_s: u32) -> std::process::Command {
    let mpirun = std::env::var("CACHALOT_MPIRUN").unwrap_or_else(|_| "mpirun".into());
    let version = std::process::Command::new(&mpirun)
        .arg("--version")
        .output()
        .unwrap_or_else(|e| {
            panic!("the `mpi` feature's tests need {mpirun} (Debian: openmpi-bin): {e}")
        });
    let mut cmd = std::process::Command::new(&mpirun);
    if String::from_utf8_lossy(&version.stdout).contains("Open MPI") {
        cmd.env("OMPI_MCA_btl_vader_single_copy_mechanism", "none")
            .args(["--allow-run-as-root", "--oversubscribe", "--timeout"])
            .arg(timeout_s.to_string());
    } else {
        cmd.env("MPIEXEC_TIMEOUT", timeout_s.to_string());
    }
    cmd.arg("-n").arg(ranks.to_string());
    cmd
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounds_cover_every_byte_once() {
        for len in [0usize, 1, 6, 7, 8, 20, 21] {
            let chunk = 7;
            let mut seen = Vec::new();
            for round in 0..rounds_for(len, chunk) {
                let r = piece(len, chunk, round);
                assert!(!r.is_empty() && r.len() <= chunk, "{len}: {r:?}");
                seen.extend(r);
            }
            assert_eq!(seen, (0..len).collect::<Vec<_>>());
            // Past the last round a piece is empty (a rank with less to send joins with 0).
            assert!(piece(len, chunk, rounds_for(len, chunk)).is_empty());
        }
        let (d, total) = displacements(&[3, 0, 5]);
        assert_eq!((d, total), (vec![0, 3, 3], 8));
        assert_eq!(default_chunk(3), i32::MAX as usize / 3);
    }

    /// The collectives over three MPI ranks: the test starts itself under `mpirun` (Open MPI's
    /// or MPICH's), each copy runs [`child`], and every rank must end well.
    #[test]
    fn collectives_over_three_mpi_ranks() {
        if std::env::var_os("CACHALOT_MPI_CHILD").is_some() {
            return child();
        }
        let exe = std::env::current_exe().unwrap();
        let mut cmd = test_launcher(3, 120);
        let out = cmd
            .env("CACHALOT_MPI_CHILD", "1")
            .arg(exe)
            .args([
                "--exact",
                "mpi::tests::collectives_over_three_mpi_ranks",
                "--test-threads",
                "1",
                "--nocapture",
            ])
            .output()
            .unwrap();
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(out.status.success(), "{text}");
        for r in 0..3 {
            assert!(
                text.contains(&format!("mpi rank {r} of 3: collectives ok")),
                "{text}"
            );
        }
    }

    /// One rank's part of the test above.
    fn child() {
        let comm = world().unwrap();
        let (me, n) = (comm.rank(), comm.world_size());
        assert_eq!(n, 3);
        assert_eq!(comm.transport(), "mpi");
        assert!(comm.host_ranks() >= 1 && comm.host_ranks() <= n);
        // Rank r's bytes: r * 7 + i, 10 * r + 3 of them (rank-dependent lengths, one empty
        // when r is 0 for the zero-length case below).
        let bytes =
            |r: usize, len: usize| -> Vec<u8> { (0..len).map(|i| (r * 7 + i) as u8).collect() };
        for cap in [usize::MAX, 7, 1] {
            comm.set_round_bytes(cap);
            let mine = bytes(me, 10 * me + 3);
            let all = comm.all_gather(&mine).unwrap();
            for (r, got) in all.iter().enumerate() {
                assert_eq!(got, &bytes(r, 10 * r + 3), "all_gather cap {cap} from {r}");
            }
            // Nothing from anyone.
            assert!(comm.all_gather(&[]).unwrap().iter().all(|v| v.is_empty()));
            // Part for rank d from rank s: s * 3 + d bytes of s * 7 + d + i.
            let part = |s: usize, d: usize| -> Vec<u8> {
                (0..s * 3 + d * 5).map(|i| (s * 7 + d + i) as u8).collect()
            };
            let parts: Vec<Vec<u8>> = (0..n).map(|d| part(me, d)).collect();
            let got = comm.all_to_all(&parts).unwrap();
            for (s, p) in got.iter().enumerate() {
                assert_eq!(p, &part(s, me), "all_to_all cap {cap} from {s}");
            }
            assert!(comm.all_to_all(&parts[..2]).is_err());
            for root in 0..n {
                let got = comm.broadcast(root, &bytes(me, 17)).unwrap();
                assert_eq!(got, bytes(root, 17), "broadcast cap {cap} from {root}");
            }
            assert!(comm.broadcast(n, &[]).is_err());
            // The sum adds in rank order, as the other backends do.
            let mut v: Vec<f32> = (0..5).map(|i| (me * 10 + i) as f32 + 0.1).collect();
            comm.all_reduce_sum(&mut v).unwrap();
            let want: Vec<f32> = (0..5)
                .map(|i| {
                    (0..n).fold(None, |acc: Option<f32>, r| {
                        let x = (r * 10 + i) as f32 + 0.1;
                        Some(acc.map_or(x, |a| a + x))
                    })
                })
                .map(Option::unwrap)
                .collect();
            assert_eq!(v, want, "all_reduce_sum cap {cap}");
            comm.barrier().unwrap();
        }
        // A second start returns the same group.
        assert!(Arc::ptr_eq(&comm, &world().unwrap()));
        println!("mpi rank {me} of {n}: collectives ok");
        finish(true);
    }
}
