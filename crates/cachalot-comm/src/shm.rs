//! Collectives through shared memory for ranks on one host ([`ShmComm`], Linux): the same
//! `all_gather` contract as [`TcpComm`] (every rank's bytes, in rank order, on every rank), at
//! a few microseconds instead of the ~60 µs a loopback TCP round trip through rank 0 costs on
//! a small VM — which tensor parallelism pays twice a layer.
//!
//! Layout: one file in `/dev/shm`, mapped by every rank and unlinked once all have mapped it
//! (nothing is left behind); its size is reserved when it is made, so a `/dev/shm` too small
//! for the group leaves it on TCP instead of failing later. Each rank owns two slots (double buffering by call parity); a
//! slot is a header (a 32-bit call number, the payload length) and [`SLOT_BYTES`] of payload.
//! A collective writes this rank's payload into its slot for the call's parity, publishes the
//! call number (release), wakes waiters (futex), and waits until every rank has published the
//! same call (acquire): spinning for [`SPIN`], then sleeping on the futex. A rank reuses a slot
//! two calls later, after every rank has published the call in between — which each does only
//! once it has read all slots of the call before — so no slot is overwritten while read.
//! A payload larger than a slot (prefill-sized activations) goes in slot-sized chunks, one call
//! each, as many calls as the longest payload of the collective needs.
//!
//! A rank that exits is noticed within [`LIVENESS`] (its pid is gone) and fails the collective
//! on the others with its name, as with TCP. The group chooses this transport only when every
//! rank asked for it ([`share_memory`]) and every rank could map the file and see the others'
//! processes; otherwise it keeps TCP.

use std::fs::OpenOptions;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::{check_parts, CommError, CommResult, Communicator, TcpComm};

/// Payload bytes per slot: a decode step's activations fit many times over (16 tokens × 7168
/// f32 are 459 KB); larger payloads take several calls. A group of N ranks holds 2·N slots of
/// memory.
pub const SLOT_BYTES: usize = 4 << 20;
const HEADER: usize = 64;
/// The file's own header: a token that proves a rank mapped the file rank 0 made.
const FILE_HEADER: usize = 64;
/// How long a waiting rank spins before it sleeps on the futex.
pub const SPIN: Duration = Duration::from_micros(100);
/// How often a sleeping rank checks that the ranks it waits for still exist.
pub const LIVENESS: Duration = Duration::from_millis(100);

/// A group whose ranks share memory (see the module doc); built by [`share_memory`].
pub struct ShmComm {
    tcp: TcpComm,
    map: memmap2::MmapRaw,
    /// The call counter; held for the whole collective (collectives are sequential).
    /// The call counter (never wraps; its low 32 bits are published, its parity picks the
    /// slot); held for the whole collective (collectives are sequential).
    calls: Mutex<u64>,
    /// Every rank's process: its pid and start time (so a pid reused, or one of another pid
    /// namespace, is not taken for the rank).
    procs: Vec<(i32, u64)>,
}

struct Slot<'a> {
    seq: &'a AtomicU32,
    len: &'a AtomicU64,
    /// Set (in both of a rank's slots) when the rank leaves the group.
    closed: &'a AtomicU32,
    data: *mut u8,
}

impl ShmComm {
    fn slot(&self, rank: usize, parity: usize) -> Slot<'_> {
        let offset = FILE_HEADER + (rank * 2 + parity) * (HEADER + SLOT_BYTES);
        debug_assert!(offset + HEADER + SLOT_BYTES <= self.map.len());
        // SAFETY: the offset is inside the mapping (sized for every rank's two slots), 64-byte
        // aligned (page-aligned base, HEADER and SLOT_BYTES multiples of 64), and the header
        // words are only accessed atomically by every rank.
        unsafe {
            let base = self.map.as_mut_ptr().add(offset);
            Slot {
                seq: &*(base as *const AtomicU32),
                len: &*(base.add(8) as *const AtomicU64),
                closed: &*(base.add(16) as *const AtomicU32),
                data: base.add(HEADER),
            }
        }
    }

    /// Waits until rank `r` has published `call` in its slot of `parity`.
    fn wait(&self, r: usize, parity: usize, call: u32) -> CommResult<()> {
        let slot = self.slot(r, parity);
        let seq = slot.seq;
        let start = Instant::now();
        let mut checked = start;
        loop {
            let v = seq.load(Ordering::Acquire);
            if v == call {
                return Ok(());
            }
            // (A rank that published this call and then left is not a failure: `seq` is
            // read again after the sign that it left.)
            if slot.closed.load(Ordering::Acquire) != 0 && seq.load(Ordering::Acquire) != call {
                return Err(CommError(format!(
                    "rank {r} left the group (it failed or finished; see its log)"
                )));
            }
            if start.elapsed() < SPIN {
                std::hint::spin_loop();
                continue;
            }
            futex_wait(seq, v, LIVENESS);
            if checked.elapsed() >= LIVENESS {
                checked = Instant::now();
                let (pid, started) = self.procs[r];
                if !alive(pid, started) && seq.load(Ordering::Acquire) != call {
                    return Err(CommError(format!(
                        "rank {r} (process {pid}) exited (it failed or was killed; see its log)"
                    )));
                }
            }
        }
    }
}

impl Drop for ShmComm {
    fn drop(&mut self) {
        // Ranks waiting for this one's next call fail at once instead of waiting for the exit.
        for parity in 0..2 {
            let s = self.slot(self.rank(), parity);
            s.closed.store(1, Ordering::Release);
            futex_wake(s.seq);
        }
    }
}

impl Communicator for ShmComm {
    fn rank(&self) -> usize {
        self.tcp.rank()
    }
    fn world_size(&self) -> usize {
        self.tcp.world_size()
    }
    fn transport(&self) -> &'static str {
        "shared memory"
    }
    fn check_peers(&self) -> CommResult<()> {
        self.tcp.check_peers()
    }
    fn all_gather(&self, mine: &[u8]) -> CommResult<Vec<Vec<u8>>> {
        self.exchange(mine, |_, b| Ok(b.to_vec()))
    }
    /// Each rank publishes its packed parts; each reads only its own part of the others'.
    fn all_to_all(&self, parts: &[Vec<u8>]) -> CommResult<Vec<Vec<u8>>> {
        let (me, n) = (self.rank(), self.world_size());
        check_parts(parts, n)?;
        let read = |r: usize, b: &[u8]| {
            crate::packed_part(b, n, me)
                .map(<[u8]>::to_vec)
                .ok_or_else(|| {
                    CommError(format!(
                        "all_to_all: rank {r} published a malformed frame of {} bytes",
                        b.len()
                    ))
                })
        };
        self.exchange(&crate::pack(parts), read)
    }
}

impl ShmComm {
    /// One collective through the slots: publishes `mine`, waits for every rank's, and reads
    /// each with `read(rank, its bytes)` (this rank's own too). A payload larger than a slot
    /// goes in slot-sized chunks, one call each: every rank publishes its total length with
    /// its first chunk, and all take as many calls as the longest payload needs (a rank whose
    /// bytes are all sent publishes empty chunks meanwhile).
    fn exchange<T>(
        &self,
        mine: &[u8],
        read: impl Fn(usize, &[u8]) -> CommResult<T>,
    ) -> CommResult<Vec<T>> {
        let mut calls = self.calls.lock().unwrap_or_else(|e| e.into_inner());
        let (rank, n) = (self.rank(), self.world_size());
        let chunk = |total: usize, round: usize| -> std::ops::Range<usize> {
            (round * SLOT_BYTES).min(total)..((round + 1) * SLOT_BYTES).min(total)
        };
        let mut totals: Vec<usize> = Vec::new();
        let mut rounds = 1;
        let mut round = 0;
        // Bytes of the others, when they span more than one call.
        let mut gathered: Vec<Vec<u8>> = vec![Vec::new(); n];
        let mut parity = 0;
        while round < rounds {
            *calls += 1;
            let call = *calls as u32;
            parity = (*calls & 1) as usize;
            let me = self.slot(rank, parity);
            let part = &mine[chunk(mine.len(), round)];
            // SAFETY: this rank owns its slot, and no rank reads it until the call number
            // below is published (see the module doc for why no one reads it still).
            unsafe { std::ptr::copy_nonoverlapping(part.as_ptr(), me.data, part.len()) };
            me.len.store(mine.len() as u64, Ordering::Relaxed);
            me.seq.store(call, Ordering::Release);
            futex_wake(me.seq);
            for r in (0..n).filter(|&r| r != rank) {
                self.wait(r, parity, call)?;
            }
            if round == 0 {
                totals = (0..n)
                    .map(|r| self.slot(r, parity).len.load(Ordering::Relaxed) as usize)
                    .collect();
                rounds = totals
                    .iter()
                    .map(|&t| t.div_ceil(SLOT_BYTES))
                    .max()
                    .unwrap_or(1)
                    .max(1);
                if rounds == 1 {
                    break;
                }
                for r in (0..n).filter(|&r| r != rank) {
                    gathered[r].reserve_exact(totals[r]);
                }
            }
            for r in (0..n).filter(|&r| r != rank) {
                let range = chunk(totals[r], round);
                // SAFETY: rank r published this slot for this call (acquire above) and will
                // not write it again before this rank publishes its next call.
                let bytes =
                    unsafe { std::slice::from_raw_parts(self.slot(r, parity).data, range.len()) };
                gathered[r].extend_from_slice(bytes);
            }
            round += 1;
        }
        (0..n)
            .map(|r| {
                if r == rank {
                    return read(r, mine);
                }
                if rounds > 1 {
                    return read(r, &gathered[r]);
                }
                let len = totals[r].min(SLOT_BYTES);
                // SAFETY: as above, for the one call.
                let bytes = unsafe { std::slice::from_raw_parts(self.slot(r, parity).data, len) };
                read(r, bytes)
            })
            .collect()
    }
}

/// Moves `tcp`'s group onto shared memory when every rank asks for it (`want`) and can reach
/// the others' memory (same host); otherwise the group stays on TCP. Collective: every rank of
/// the group calls it. Errors only when the TCP group itself fails.
pub fn share_memory(tcp: TcpComm, want: bool) -> CommResult<Arc<dyn Communicator>> {
    let (rank, n) = (tcp.rank(), tcp.world_size());
    if n == 1 {
        return Ok(Arc::new(tcp));
    }
    let size = FILE_HEADER + n * 2 * (HEADER + SLOT_BYTES);
    let token: u64 = {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        t ^ ((std::process::id() as u64) << 32) | 1
    };
    // Rank 0 makes the file and names it (an empty name: it could not, or did not want to).
    let made: Option<(PathBuf, memmap2::MmapRaw)> = if rank == 0 && want {
        let path = PathBuf::from(format!(
            "/dev/shm/cachalot-comm-{}-{token:x}",
            std::process::id()
        ));
        let map = create(&path, size, token).ok();
        if map.is_none() {
            let _ = std::fs::remove_file(&path);
        }
        map.map(|m| (path, m))
    } else {
        None
    };
    let mut announce = Vec::new();
    if let Some((path, _)) = &made {
        announce.extend_from_slice(&token.to_le_bytes());
        announce.extend_from_slice(path.to_string_lossy().as_bytes());
    }
    // Rank 0 unlinks the file however setup ends (every rank has mapped it or given up by the
    // vote below; an error before then leaves no file behind either).
    struct Unlink(Option<PathBuf>);
    impl Drop for Unlink {
        fn drop(&mut self) {
            if let Some(p) = &self.0 {
                let _ = std::fs::remove_file(p);
            }
        }
    }
    let _unlink = Unlink(made.as_ref().map(|(p, _)| p.clone()));
    let announced = tcp.broadcast(0, &announce)?;
    let map = match made {
        Some((_, m)) => Some(m),
        None if want && announced.len() > 8 => {
            let token = u64::from_le_bytes(announced[..8].try_into().expect("8 bytes"));
            let path = PathBuf::from(String::from_utf8_lossy(&announced[8..]).into_owned());
            open(&path, size, token).ok()
        }
        None => None,
    };
    // Every rank's pid and start time, or zeros when it cannot take part.
    let me = std::process::id() as i32;
    let mine = match (&map, start_time(me)) {
        (Some(_), Some(t)) => (me, t),
        _ => (0, 0),
    };
    let mut bytes = mine.0.to_le_bytes().to_vec();
    bytes.extend_from_slice(&mine.1.to_le_bytes());
    let procs: Vec<(i32, u64)> = tcp
        .all_gather(&bytes)?
        .iter()
        .map(|b| match (b.get(..4), b.get(4..12)) {
            (Some(p), Some(t)) => (
                i32::from_le_bytes(p.try_into().expect("4 bytes")),
                u64::from_le_bytes(t.try_into().expect("8 bytes")),
            ),
            _ => (0, 0),
        })
        .collect();
    // Every rank's process is visible from here as itself (same host, same pid namespace).
    let sees_all = map.is_some() && procs.iter().all(|&(p, t)| p > 0 && alive(p, t));
    let votes = tcp.all_gather(&[sees_all as u8])?;
    match map {
        Some(map) if votes.iter().all(|v| v.as_slice() == [1]) => Ok(Arc::new(ShmComm {
            tcp,
            map,
            calls: Mutex::new(0),
            procs,
        })),
        _ => Ok(Arc::new(tcp)),
    }
}

fn create(path: &PathBuf, size: usize, token: u64) -> std::io::Result<memmap2::MmapRaw> {
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .open(path)?;
    // Reserved up front: a tmpfs too small for the group fails here, not with SIGBUS when a
    // slot is first written.
    // SAFETY: a valid descriptor of a regular file opened for writing.
    let r = unsafe {
        libc::posix_fallocate(std::os::fd::AsRawFd::as_raw_fd(&f), 0, size as libc::off_t)
    };
    if r != 0 {
        return Err(std::io::Error::from_raw_os_error(r));
    }
    let map = memmap2::MmapRaw::map_raw(&f)?;
    // SAFETY: the mapping is at least FILE_HEADER bytes and page-aligned.
    unsafe { (*(map.as_mut_ptr() as *const AtomicU64)).store(token, Ordering::Release) };
    Ok(map)
}

fn open(path: &PathBuf, size: usize, token: u64) -> std::io::Result<memmap2::MmapRaw> {
    let f = OpenOptions::new().read(true).write(true).open(path)?;
    if f.metadata()?.len() != size as u64 {
        return Err(std::io::Error::other("not the group's size"));
    }
    let map = memmap2::MmapRaw::map_raw(&f)?;
    // SAFETY: as in `create`.
    let seen = unsafe { (*(map.as_mut_ptr() as *const AtomicU64)).load(Ordering::Acquire) };
    if seen != token {
        return Err(std::io::Error::other("not the group's file"));
    }
    Ok(map)
}

/// Process `pid`'s start time (field 22 of `/proc/PID/stat`, clock ticks since boot).
fn start_time(pid: i32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // "pid (comm) S ppid ...": fields from the state on, after the last ')'.
    let (_, rest) = stat.rsplit_once(')')?;
    rest.split_whitespace().nth(19)?.parse().ok()
}

/// Process `pid`, started at `started`, is still running: not gone, not a zombie (a rank
/// that died stays one until its parent — often rank 0, the launcher — reaps it), and not
/// another process that took its pid (or a process of another pid namespace).
fn alive(pid: i32, started: u64) -> bool {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return false;
    };
    let Some((_, rest)) = stat.rsplit_once(')') else {
        return false;
    };
    let mut fields = rest.split_whitespace();
    let state = fields.next();
    let time = fields.nth(18).and_then(|t| t.parse::<u64>().ok());
    !matches!(state, Some("Z" | "X")) && time == Some(started)
}

/// Sleeps while `word` holds `expected`, at most `timeout` (spurious wake-ups are fine: the
/// caller checks again).
fn futex_wait(word: &AtomicU32, expected: u32, timeout: Duration) {
    let ts = libc::timespec {
        tv_sec: timeout.as_secs() as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: FUTEX_WAIT on a valid, aligned 32-bit word of a shared mapping; the kernel only
    // reads it. (Not FUTEX_PRIVATE: other processes wake it.)
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT,
            expected,
            &ts as *const libc::timespec,
            std::ptr::null::<u32>(),
            0,
        );
    }
}

fn futex_wake(word: &AtomicU32) {
    // SAFETY: FUTEX_WAKE on a valid, aligned 32-bit word; it only wakes waiters.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAKE,
            i32::MAX,
            std::ptr::null::<libc::timespec>(),
            std::ptr::null::<u32>(),
            0,
        );
    }
}
