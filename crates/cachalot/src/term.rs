//! Ctrl-C and SIGTERM for the commands that leave partial work behind (`run`, `convert`): both
//! run the command's cleanup and exit as a process killed by the signal reports (130 for
//! SIGINT, 143 for SIGTERM). Ctrl-C goes through `ctrlc` (on its own thread); SIGTERM (`kill`,
//! `timeout`, `docker stop`) sets a flag that a watcher thread turns into the same cleanup.
//! ctrlc's `termination` feature would route SIGTERM to every ctrlc handler, `chat`'s too,
//! which only cancels the answer being written. `serve` drains on SIGTERM instead
//! ([`drain_on_sigterm`]).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use anyhow::{Context, Result};

static TERM: AtomicBool = AtomicBool::new(false);

extern "C" fn on_term(_sig: libc::c_int) {
    TERM.store(true, Ordering::SeqCst);
}

/// Runs `cleanup` on Ctrl-C or SIGTERM, then exits 130 or 143.
pub fn on_interrupt(cleanup: impl Fn() + Send + Sync + 'static) -> Result<()> {
    let cleanup = Arc::new(cleanup);
    let on_int = cleanup.clone();
    ctrlc::set_handler(move || {
        on_int();
        std::process::exit(130);
    })
    .context("cannot install the Ctrl-C handler")?;
    install_term()?;
    std::thread::spawn(move || loop {
        if TERM.load(Ordering::SeqCst) {
            cleanup();
            std::process::exit(143);
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    });
    Ok(())
}

/// Points SIGTERM at [`on_term`] (which sets [`TERM`]).
fn install_term() -> Result<()> {
    // SAFETY: the handler only stores to an atomic, which is async-signal-safe.
    let previous = unsafe {
        libc::signal(
            libc::SIGTERM,
            on_term as extern "C" fn(libc::c_int) as libc::sighandler_t,
        )
    };
    if previous == libc::SIG_ERR {
        anyhow::bail!("cannot install the SIGTERM handler");
    }
    Ok(())
}

/// Whether SIGTERM has arrived (after [`drain_on_sigterm`]).
pub fn terminating() -> bool {
    TERM.load(Ordering::SeqCst)
}

/// Requests a server is handling ([`InFlight`]); a drain waits for them.
static IN_FLIGHT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Counts one request as in flight while it lives.
pub struct InFlight;

impl InFlight {
    pub fn enter() -> InFlight {
        IN_FLIGHT.fetch_add(1, Ordering::SeqCst);
        InFlight
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        IN_FLIGHT.fetch_sub(1, Ordering::SeqCst);
    }
}

/// What else a drain waits for besides requests in flight (a prefill server's KV that its
/// decode server has not fetched yet): a count, 0 when nothing is held.
static HELD: std::sync::OnceLock<Box<dyn Fn() -> usize + Send + Sync>> = std::sync::OnceLock::new();

/// Makes a drain also wait (within its grace) until `held()` is 0.
pub fn drain_waits_for(held: impl Fn() -> usize + Send + Sync + 'static) {
    let _ = HELD.set(Box::new(held));
}

/// Rank 0 of a group of ranks: a drain stops the group through its engine loop
/// ([`drain_stop`]) instead of leaving the other ranks to find rank 0 gone.
static LEADS_GROUP: AtomicBool = AtomicBool::new(false);

/// Marks this process as rank 0 of a group whose engine loop polls [`drain_stop`].
pub fn leads_group() {
    LEADS_GROUP.store(true, Ordering::SeqCst);
}

/// The exit status a finished drain asks for (none before).
static STOP: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(-1);

/// After a drain: the status the server exits with (0 when every request finished, 143 when
/// the grace cut some); the engine loop of a group stops its ranks when it is set.
pub fn drain_stop() -> Option<i32> {
    let code = STOP.load(Ordering::SeqCst);
    (code >= 0).then_some(code)
}

/// When a drain's grace ends (set when the drain starts).
static DRAIN_DEADLINE: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();

/// Whether a drain is under way and its grace ends within `margin`: what a request still
/// waiting (a decode server's fetch of KV) checks to answer before the server exits.
pub fn drain_ending(margin: std::time::Duration) -> bool {
    DRAIN_DEADLINE
        .get()
        .is_some_and(|d| std::time::Instant::now() + margin >= *d)
}

/// A server's graceful stop: after SIGTERM, [`terminating`] is true (new requests are refused
/// by the caller), and once no request is [`InFlight`] and nothing [`drain_waits_for`] is
/// held, or `grace` has passed, the server exits (0 when everything finished, 143 when the
/// grace cut some): at once when it runs alone; as rank 0 of a group ([`leads_group`]), its
/// engine loop first stops the other ranks ([`drain_stop`]), the command exiting with the
/// status once they have. `leader: false` (a rank other than 0) only notes the signal: rank
/// 0's stop ends the group.
pub fn drain_on_sigterm(grace: std::time::Duration, leader: bool) -> Result<()> {
    let in_flight = || IN_FLIGHT.load(Ordering::SeqCst);
    let held = || HELD.get().map_or(0, |f| f());
    install_term()?;
    if !leader {
        return Ok(());
    }
    std::thread::spawn(move || {
        while !terminating() {
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        let (n, h) = (in_flight(), held());
        let kv = if h > 0 {
            format!(" and {h} prefilled KV awaiting their decode servers")
        } else {
            String::new()
        };
        say!(
            "cachalot: SIGTERM: refusing new requests; {n} in flight{kv} get up to {:.0} s to \
             finish",
            grace.as_secs_f64()
        );
        let start = std::time::Instant::now();
        let _ = DRAIN_DEADLINE.set(start + grace);
        let code = loop {
            let (n, h) = (in_flight(), held());
            if n == 0 && h == 0 {
                say!("cachalot: drained; exiting");
                break 0;
            }
            if start.elapsed() >= grace {
                let kv = if HELD.get().is_some() {
                    format!(", {h} prefilled KV not fetched")
                } else {
                    String::new()
                };
                say!("cachalot: {n} requests still running{kv} after the grace; exiting");
                break 143;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        };
        STOP.store(code, Ordering::SeqCst);
        if code != 0 && !LEADS_GROUP.load(Ordering::SeqCst) {
            // The engine loop answers what is left with a 503 ([`DRAIN_CUT`]): a moment for
            // the handlers to write it before the process goes.
            let until = std::time::Instant::now() + CUT_ANSWER_WAIT;
            while in_flight() > 0 && std::time::Instant::now() < until {
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
        }
        if LEADS_GROUP.load(Ordering::SeqCst) {
            // The engine loop stops the group and the command exits; a group that does not
            // stop in time is left as before.
            std::thread::sleep(GROUP_STOP_WAIT);
            say!("cachalot: the other ranks did not stop; exiting");
        }
        std::process::exit(code);
    });
    Ok(())
}

/// How long a server whose drain's grace ended waits for its handlers to answer the requests
/// cut ([`DRAIN_CUT`]) before it exits.
const CUT_ANSWER_WAIT: std::time::Duration = std::time::Duration::from_secs(1);

/// What a request still unfinished when a drain's grace ends is answered (a 503).
pub const DRAIN_CUT: &str = "the server is shutting down (SIGTERM) and its drain grace \
     (--drain-timeout-s) ended before this request finished; send it again to another server";

/// Whether a drain's grace ended with requests unfinished: the engine loops then answer them
/// [`DRAIN_CUT`].
pub fn drain_cut() -> bool {
    drain_stop().is_some_and(|c| c != 0)
}

/// How long rank 0 waits for its group to stop after a drain.
const GROUP_STOP_WAIT: std::time::Duration = std::time::Duration::from_secs(15);
