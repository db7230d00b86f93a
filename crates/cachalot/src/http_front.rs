//! The listening socket of `serve` and `router`, held here rather than inside tiny_http.
//!
//! tiny_http 0.12's acceptor thread ends at its first failed `accept`, and panics where it
//! cannot duplicate an accepted socket (both happen once the process is out of file
//! descriptors: EMFILE): the server then stopped taking connections, and the request
//! iterator's end made it exit 0 with nothing said. Here a failed acceptor (an error in the
//! queue, or a panic in tiny_http's code, which a panic hook turns into one line on stderr and a
//! flag) is replaced by a new one on the same socket after a pause (50 ms, doubling to 2 s
//! while failures repeat), and the old one's open connections go on being served from a thread
//! of their own. At start the soft
//! limit of open files is raised to the hard one (as Go's runtime and nginx do), so the common
//! default of 1024 does not cap a server at ~500 clients.

use std::net::{SocketAddr, TcpListener};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Set by the panic hook when a thread of tiny_http panics (its acceptor, out of descriptors).
static ACCEPTOR_DIED: AtomicBool = AtomicBool::new(false);

/// Routes panics raised in tiny_http's code to [`ACCEPTOR_DIED`] and one line on stderr;
/// others go to the hook that was there.
fn watch_tiny_http_panics() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if info
                .location()
                .is_some_and(|l| l.file().contains("tiny_http"))
            {
                ACCEPTOR_DIED.store(true, Ordering::SeqCst);
                let why = match crate::panic_text(info.payload()) {
                    "" => "a panic",
                    text => text,
                };
                say!("cachalot: the HTTP library's thread failed: {why}");
            } else {
                previous(info);
            }
        }));
    });
}

/// A bound HTTP listener.
pub struct Front {
    listener: TcpListener,
    pub addr: SocketAddr,
}

/// Binds `host:port` (port 0: any free port).
pub fn bind(host: &str, port: u16) -> std::io::Result<Front> {
    raise_open_files_limit();
    watch_tiny_http_panics();
    let listener = TcpListener::bind((host, port))?;
    let addr = listener.local_addr()?;
    Ok(Front { listener, addr })
}

/// The soft RLIMIT_NOFILE raised to the hard limit (each connection holds a socket; tiny_http
/// a second descriptor for it).
fn raise_open_files_limit() {
    // SAFETY: getrlimit/setrlimit on a local struct.
    unsafe {
        let mut r = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) == 0 && r.rlim_cur < r.rlim_max {
            r.rlim_cur = r.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &r);
        }
    }
}

const FIRST_PAUSE: Duration = Duration::from_millis(50);
const LONGEST_PAUSE: Duration = Duration::from_secs(2);

impl Front {
    /// Runs `handle` on a thread of its own for every request, for as long as the process
    /// lives (see the module documentation for failed acceptors). `what` names the server in
    /// the one line a failure prints.
    pub fn serve(self, what: &'static str, handle: Arc<dyn Fn(tiny_http::Request) + Send + Sync>) {
        let run = |h: &Arc<dyn Fn(tiny_http::Request) + Send + Sync>, rq: tiny_http::Request| {
            let h = h.clone();
            std::thread::spawn(move || h(rq));
        };
        let mut pause = FIRST_PAUSE;
        loop {
            let server = self
                .listener
                .try_clone()
                .map_err(|e| e.to_string())
                .and_then(|l| tiny_http::Server::from_listener(l, None).map_err(|e| e.to_string()));
            let server = match server {
                Ok(s) => s,
                Err(e) => {
                    say!("cachalot {what}: cannot accept connections ({e}); trying again");
                    std::thread::sleep(pause);
                    pause = (pause * 2).min(LONGEST_PAUSE);
                    continue;
                }
            };
            ACCEPTOR_DIED.store(false, Ordering::SeqCst);
            let mut served = false;
            let error = loop {
                match server.recv_timeout(Duration::from_millis(200)) {
                    Ok(Some(rq)) => {
                        served = true;
                        run(&handle, rq);
                    }
                    Ok(None) if ACCEPTOR_DIED.swap(false, Ordering::SeqCst) => {
                        break "its thread stopped".to_string()
                    }
                    Ok(None) => {}
                    Err(e) => break e.to_string(),
                }
            };
            if served {
                pause = FIRST_PAUSE;
            }
            say!(
                "cachalot {what}: accepting a connection failed ({error}); accepting again in \
                 {} ms (open connections are still served)",
                pause.as_millis()
            );
            // Requests still coming on this acceptor's open connections.
            let h = handle.clone();
            std::thread::spawn(move || loop {
                match server.recv() {
                    Ok(rq) => run(&h, rq),
                    Err(_) => std::thread::sleep(LONGEST_PAUSE),
                }
            });
            std::thread::sleep(pause);
            pause = (pause * 2).min(LONGEST_PAUSE);
        }
    }
}
