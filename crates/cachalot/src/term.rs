//! Ctrl-C and SIGTERM for the commands that leave partial work behind (`run`, `convert`): both
//! run the command's cleanup and exit as a process killed by the signal reports (130 for
//! SIGINT, 143 for SIGTERM). Ctrl-C goes through `ctrlc` (on its own thread); SIGTERM (`kill`,
//! `timeout`, `docker stop`) sets a flag that a watcher thread turns into the same cleanup.
//! ctrlc's `termination` feature would route SIGTERM to every ctrlc handler, `chat`'s too,
//! which only cancels the answer being written.

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
    std::thread::spawn(move || loop {
        if TERM.load(Ordering::SeqCst) {
            cleanup();
            std::process::exit(143);
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    });
    Ok(())
}
