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

/// A server's graceful stop: after SIGTERM, [`terminating`] is true (new requests are refused
/// by the caller), and once no request is [`InFlight`], or `grace` has passed, the process
/// exits (0 when every request finished, 143 when the grace cut some). `leader: false` (a rank other
/// than 0 of a group) only notes it: rank 0's exit ends the group.
pub fn drain_on_sigterm(grace: std::time::Duration, leader: bool) -> Result<()> {
    let in_flight = || IN_FLIGHT.load(Ordering::SeqCst);
    install_term()?;
    if !leader {
        return Ok(());
    }
    std::thread::spawn(move || {
        while !terminating() {
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        let n = in_flight();
        say!(
            "cachalot: SIGTERM: refusing new requests; {n} in flight get up to {:.0} s to finish",
            grace.as_secs_f64()
        );
        let start = std::time::Instant::now();
        loop {
            let n = in_flight();
            if n == 0 {
                say!("cachalot: drained; exiting");
                std::process::exit(0);
            }
            if start.elapsed() >= grace {
                say!("cachalot: {n} requests still running after the grace; exiting");
                std::process::exit(143);
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    });
    Ok(())
}
