//! `cachalot router`: the front of a prefill/decode-disaggregated deployment (spec
//! `executor.md` §5.4 "Router", §5.5): clients talk to it as to one OpenAI server; for each
//! completion it picks a room (`bootstrap_room`, random unless the request gives one), a prefill
//! server (room mod #prefill) and a decode server (room mod #decode), fills in the prefill
//! server's `bootstrap_host` and `bootstrap_port` (its KV port, read from its `/health`), posts
//! the request to both at once and answers with the decode server's response (streamed through
//! as it comes). The prefill server's answer is read and dropped; if it fails, the decode server
//! reports why. `GET /health` asks the servers' (ok, degraded, or 503 when no prefill or no decode server
//! answers), `GET /v1/models` is the first decode server's.
//!
//! The backends are `cachalot serve --role prefill` and `--role decode` servers; the router
//! speaks HTTP/1.1 to them, one connection per request, and relays the body as it comes
//! (de-chunked, re-chunked for the client), keep-alive chunks of slow whole answers included, so
//! a client that leaves is noticed and its request aborted on the decode server.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde_json::{json, Value};

#[derive(clap::Args)]
pub struct RouterArgs {
    /// A prefill server (`cachalot serve --role prefill`), as http://HOST:PORT; repeat for more.
    #[arg(long, required = true)]
    prefill: Vec<String>,
    /// A decode server (`cachalot serve --role decode`), as http://HOST:PORT; repeat for more.
    #[arg(long, required = true)]
    decode: Vec<String>,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port to listen on (0: any free port; the chosen one is printed).
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// How long to wait at start for every server to answer /health.
    #[arg(long, default_value_t = 600)]
    wait_s: u64,
    /// How long one request may take, from its arrival to the last byte of its answer; one
    /// that takes longer is answered 504 (or, once its answer has begun, ends with an error
    /// event or object) and aborted on its servers.
    #[arg(long, default_value_t = 1800, value_parser = clap::value_parser!(u64).range(1..))]
    timeout_s: u64,
    /// On SIGTERM the router refuses new requests (503) and gives those in flight up to this
    /// many seconds to finish before it exits, as `serve` does.
    #[arg(long, default_value_t = 30)]
    drain_timeout_s: u64,
}

/// A prefill server: where it answers HTTP and where decode servers fetch its KV (its KV port,
/// read again from its `/health` every [`KV_PORT_REFRESH`]: a prefill server restarted with
/// another `--kv-port` is followed).
struct Prefill {
    addr: String,
    host: String,
    kv_port: std::sync::atomic::AtomicU16,
}

impl Prefill {
    fn kv_port(&self) -> u16 {
        self.kv_port.load(std::sync::atomic::Ordering::Relaxed)
    }
}

/// How often the router reads each prefill server's KV port again.
const KV_PORT_REFRESH: Duration = Duration::from_secs(1);

/// The KV port a prefill server's parsed `/health` names.
fn kv_port_of(health: &Value) -> Option<u16> {
    health["kv_port"]
        .as_u64()
        .and_then(|p| u16::try_from(p).ok())
}

/// One `/health` of `addr` within `wait`: its status and body.
fn health(addr: &str, wait: Duration) -> std::io::Result<(u16, String)> {
    let (status, _, mut r) = exchange(addr, "GET", "/health", None, wait)?;
    let mut body = String::new();
    r.read_to_string(&mut body)?;
    Ok((status, body))
}

/// A server's `/health` body, parsed, when it says the server runs in `role`.
fn in_role(body: &str, role: &str) -> Option<Value> {
    serde_json::from_str::<Value>(body)
        .ok()
        .filter(|v| v["disaggregation_mode"] == role)
}

/// How long the router's /health waits for each server's.
const HEALTH_WAIT: Duration = Duration::from_secs(2);

struct Router {
    prefill: Vec<Prefill>,
    decode: Vec<String>,
    timeout: Duration,
    /// The rooms of requests in flight: a second request naming one of them is refused here,
    /// before it could take the first one's KV from the prefill server.
    rooms: Rooms,
}

/// The rooms of requests in flight.
type Rooms = std::sync::Arc<std::sync::Mutex<std::collections::HashSet<u64>>>;

/// A room of [`Router::rooms`], given back when the last of its holders drops it: the request's
/// handler, its prefill thread and the thread that drops its KV (a room freed before its
/// prefill has answered could be taken by a new request, whose KV a late drop would destroy).
struct RoomHeld(Rooms, u64);

impl Drop for RoomHeld {
    fn drop(&mut self) {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&self.1);
    }
}

/// `http://host:port[/v1]` or `host:port` → `host:port`.
fn host_port(url: &str) -> Result<String> {
    let rest = url
        .strip_prefix("http://")
        .unwrap_or(url)
        .trim_end_matches('/');
    let rest = rest.strip_suffix("/v1").unwrap_or(rest);
    if url.starts_with("https://") || rest.contains('/') || !rest.contains(':') {
        bail!("{url}: give a server as http://HOST:PORT");
    }
    Ok(rest.to_string())
}

/// A backend's answer body: its bytes as they come (a chunked body de-chunked, one chunk per
/// read at most, so streamed events pass at once).
type Body = Box<dyn Read + Send>;

/// Why the router itself ended an exchange with a backend (carried inside the `io::Error`).
#[derive(Debug)]
enum Cut {
    /// The exchange's time ran out (`--timeout-s` for a request).
    Deadline(Duration),
    /// The router's SIGTERM drain ended its grace with the request unfinished.
    Drain,
}

impl std::fmt::Display for Cut {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Cut::Deadline(d) => write!(f, "no complete answer within {} s", d.as_secs_f64()),
            Cut::Drain => f.write_str(crate::term::DRAIN_CUT),
        }
    }
}

impl std::error::Error for Cut {}

/// The [`Cut`] inside an I/O error, if the router made it.
fn cut_of(e: &std::io::Error) -> Option<&Cut> {
    e.get_ref().and_then(|i| i.downcast_ref::<Cut>())
}

/// How often a wait on a backend looks at the clock and the drain.
const SLICE: Duration = Duration::from_millis(200);

/// A backend connection whose reads end at a deadline, or when the router's drain cuts its
/// requests (read in short slices, so both are seen within [`SLICE`]).
struct Timed {
    conn: TcpStream,
    deadline: Instant,
    limit: Duration,
}

impl Read for Timed {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        loop {
            if crate::term::drain_cut() {
                return Err(std::io::Error::other(Cut::Drain));
            }
            let left = self.deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    Cut::Deadline(self.limit),
                ));
            }
            self.conn.set_read_timeout(Some(left.min(SLICE)))?;
            match self.conn.read(buf) {
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock
                            | std::io::ErrorKind::TimedOut
                            | std::io::ErrorKind::Interrupted
                    ) => {}
                r => return r,
            }
        }
    }
}

/// One HTTP/1.1 exchange on its own connection, all of it (connecting, the answer's head and
/// its body) within `timeout` of the call: the status, the content type and a reader of the
/// body. (HTTP/1.1, so a server answering a whole request slowly writes its keep-alive
/// chunks, which the relay passes on: a client that left is noticed by the write, and the
/// dropped connection tells the server.)
fn exchange(
    addr: &str,
    method: &str,
    path: &str,
    body: Option<&[u8]>,
    timeout: Duration,
) -> std::io::Result<(u16, String, Body)> {
    let deadline = Instant::now() + timeout;
    let left = || {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                Cut::Deadline(timeout),
            ))
        } else {
            Ok(left)
        }
    };
    // Connecting is bounded too (an unreachable host would hold SYN retries for minutes).
    let mut last = std::io::Error::new(std::io::ErrorKind::NotFound, "no address");
    let mut conn = None;
    // (A name that does not resolve is a server not reached.)
    let addrs = std::net::ToSocketAddrs::to_socket_addrs(addr)
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::NotFound, e))?;
    for a in addrs {
        match TcpStream::connect_timeout(&a, left()?) {
            Ok(c) => {
                conn = Some(c);
                break;
            }
            Err(e) => last = e,
        }
    }
    let mut s = conn.ok_or(last)?;
    s.set_write_timeout(Some(left()?))?;
    let _ = s.set_nodelay(true);
    let body = body.unwrap_or_default();
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    // A backend that does not take the request within the time left: the deadline's cut.
    s.write_all(head.as_bytes())
        .and_then(|_| s.write_all(body))
        .map_err(|e| match e.kind() {
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => {
                std::io::Error::new(std::io::ErrorKind::TimedOut, Cut::Deadline(timeout))
            }
            _ => e,
        })?;
    let mut r = BufReader::new(Timed {
        conn: s,
        deadline,
        limit: timeout,
    });
    let mut line = String::new();
    r.read_line(&mut line)?;
    let status = line
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| {
            std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                if line.is_empty() {
                    "closed the connection without an answer (did it stop or restart?)".to_string()
                } else {
                    format!("not an HTTP answer: {line:?}")
                },
            )
        })?;
    let mut content_type = "application/json".to_string();
    let (mut chunked, mut length) = (false, None);
    loop {
        line.clear();
        if r.read_line(&mut line)? == 0 || line.trim().is_empty() {
            break;
        }
        if let Some((k, v)) = line.split_once(':') {
            let (k, v) = (k.trim(), v.trim());
            if k.eq_ignore_ascii_case("content-type") {
                content_type = v.to_string();
            } else if k.eq_ignore_ascii_case("transfer-encoding") {
                chunked = v.eq_ignore_ascii_case("chunked");
            } else if k.eq_ignore_ascii_case("content-length") {
                length = v.parse::<u64>().ok();
            }
        }
    }
    let body: Body = match (chunked, length) {
        (true, _) => Box::new(Chunked {
            inner: r,
            left: 0,
            done: false,
        }),
        (false, Some(n)) => Box::new(r.take(n)),
        (false, None) => Box::new(r),
    };
    Ok((status, content_type, body))
}

/// A chunked body, de-chunked.
struct Chunked<R> {
    inner: R,
    /// Bytes left in the current chunk.
    left: usize,
    done: bool,
}

impl<R: BufRead> Read for Chunked<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let cut =
            |what: &str| std::io::Error::new(std::io::ErrorKind::UnexpectedEof, what.to_string());
        if self.done || buf.is_empty() {
            return Ok(0);
        }
        if self.left == 0 {
            let mut line = String::new();
            if self.inner.read_line(&mut line)? == 0 {
                return Err(cut("the chunked body ended before its last chunk"));
            }
            let size = line.trim().split(';').next().unwrap_or("").trim();
            let size = usize::from_str_radix(size, 16).map_err(|_| {
                std::io::Error::new(
                    std::io::ErrorKind::InvalidData,
                    format!("not a chunk size: {line:?}"),
                )
            })?;
            if size == 0 {
                self.done = true;
                return Ok(0);
            }
            self.left = size;
        }
        let want = buf.len().min(self.left);
        let n = self.inner.read(&mut buf[..want])?;
        if n == 0 {
            return Err(cut("the chunked body ended inside a chunk"));
        }
        self.left -= n;
        if self.left == 0 {
            let mut crlf = [0u8; 2];
            self.inner.read_exact(&mut crlf)?;
        }
        Ok(n)
    }
}

/// A prefill server's KV port, from its /health, waiting for it to come up.
fn prefill_info(addr: &str, wait: Duration) -> Result<u16> {
    let v = wait_for_role(addr, "prefill", wait)?;
    kv_port_of(&v).with_context(|| format!("{addr}'s /health names no kv_port: {v}"))
}

/// The parsed `/health` of the server at `addr` once it answers (up to `wait`), checked to be
/// `cachalot serve --role ROLE`'s.
fn wait_for_role(addr: &str, role: &str, wait: Duration) -> Result<Value> {
    let start = Instant::now();
    loop {
        match health(addr, Duration::from_secs(10)) {
            Ok((200, body)) => {
                return in_role(&body, role).with_context(|| {
                    format!(
                        "{addr} is not a {role} server (its /health says {body}): start it with \
                         `cachalot serve --role {role}`"
                    )
                });
            }
            _ if start.elapsed() < wait => std::thread::sleep(Duration::from_millis(200)),
            Ok((status, body)) => bail!("{addr}/health answered {status}: {body}"),
            Err(e) => bail!("{addr} did not answer /health within {wait:?}: {e}"),
        }
    }
}

pub fn router(args: &RouterArgs) -> Result<()> {
    let wait = Duration::from_secs(args.wait_s);
    let mut prefill = Vec::new();
    for url in &args.prefill {
        let addr = host_port(url).context("--prefill")?;
        let kv_port = prefill_info(&addr, wait)?;
        let host = addr.rsplit_once(':').map_or("", |h| h.0).to_string();
        prefill.push(Prefill {
            addr,
            host,
            kv_port: kv_port.into(),
        });
    }
    let mut decode = Vec::new();
    for url in &args.decode {
        let addr = host_port(url).context("--decode")?;
        wait_for_role(&addr, "decode", wait)?;
        decode.push(addr);
    }
    // Servers of different models (or served names) are most likely a mistake: requests
    // naming a model would get 404s from one side, and the decode server could not use the
    // prefill server's KV. Said, not refused: one model may sit in differently named places.
    let served = |addr: &str| -> Option<Vec<String>> {
        let (_, _, mut r) = exchange(addr, "GET", "/v1/models", None, HEALTH_WAIT).ok()?;
        let mut body = String::new();
        r.read_to_string(&mut body).ok()?;
        let v: Value = serde_json::from_str(&body).ok()?;
        Some(
            v["data"]
                .as_array()?
                .iter()
                .filter_map(|m| m["id"].as_str().map(str::to_string))
                .collect(),
        )
    };
    let names: Vec<(&str, Option<Vec<String>>)> = prefill
        .iter()
        .map(|p| p.addr.as_str())
        .chain(decode.iter().map(String::as_str))
        .map(|a| (a, served(a)))
        .collect();
    if let Some((first, Some(want))) = names.first() {
        for (addr, got) in &names[1..] {
            if got.as_ref().is_some_and(|g| g != want) {
                say!(
                    "cachalot router: warning: {addr} serves {:?} and {first} serves {want:?}: \
                     start every server with the same --model and --served-model-name",
                    got.as_deref().unwrap_or_default()
                );
            }
        }
    }
    let server = crate::http_front::bind(&args.host, args.port)
        .map_err(|e| anyhow::anyhow!("cannot listen on {}:{}: {e}", args.host, args.port))?;
    let addr = server.addr.to_string();
    say!(
        "cachalot router: {} prefill and {} decode servers, listening on http://{addr}/v1",
        prefill.len(),
        decode.len()
    );
    let router = std::sync::Arc::new(Router {
        prefill,
        decode,
        timeout: Duration::from_secs(args.timeout_s),
        rooms: Default::default(),
    });
    // Each prefill server's KV port, followed (a server restarted with another one).
    {
        let router = router.clone();
        std::thread::spawn(move || loop {
            std::thread::sleep(KV_PORT_REFRESH);
            for p in &router.prefill {
                if let Ok((200, body)) = health(&p.addr, HEALTH_WAIT) {
                    let port = in_role(&body, "prefill").and_then(|v| kv_port_of(&v));
                    if let Some(port) = port {
                        if port != p.kv_port() {
                            say!(
                                "cachalot router: prefill server {}'s KV port is now {port}",
                                p.addr
                            );
                            p.kv_port.store(port, std::sync::atomic::Ordering::Relaxed);
                        }
                    }
                }
            }
        });
    }
    // SIGTERM: requests in flight finish (up to --drain-timeout-s), new ones get 503.
    crate::term::drain_on_sigterm(Duration::from_secs(args.drain_timeout_s), true)?;
    server.serve(
        "router",
        std::sync::Arc::new(move |request| route(request, &router)),
    );
    Ok(())
}

/// What ends a routed request first.
enum Outcome {
    /// The decode server's answer (its head; the body follows), or why there is none.
    Decode(std::io::Result<(u16, String, Body)>),
    /// The prefill server refused the request: its status, content type and body.
    Prefill(u16, String, Vec<u8>),
    /// The prefill server could not be reached or did not answer.
    PrefillLost(std::io::Error),
}

/// The status and message a client gets for a backend (`who`, "decode server HOST:PORT") that
/// gave no answer: 504 when the request's `--timeout-s` ran out, the drain's 503 when the
/// router's SIGTERM grace ended, 503 when the server could not be reached (refused, no such
/// host, no connection in time), 502 when it was reached and then failed.
fn lost(who: &str, e: &std::io::Error, timeout: Duration) -> (u16, String) {
    match cut_of(e) {
        Some(Cut::Drain) => (503, crate::term::DRAIN_CUT.to_string()),
        Some(Cut::Deadline(_)) => (
            504,
            format!(
                "the request took longer than the router's --timeout-s ({} s) ({who} had not \
                 finished); it was aborted",
                timeout.as_secs()
            ),
        ),
        // Not reached (down, or no such host): unavailable; reached and then failed: a bad
        // gateway.
        None if matches!(
            e.kind(),
            std::io::ErrorKind::ConnectionRefused
                | std::io::ErrorKind::NotFound
                | std::io::ErrorKind::HostUnreachable
                | std::io::ErrorKind::NetworkUnreachable
                | std::io::ErrorKind::AddrNotAvailable
                | std::io::ErrorKind::TimedOut
        ) =>
        {
            (503, format!("{who}: {e}"))
        }
        None => (502, format!("{who}: {e}")),
    }
}

/// The router's own error answer, in the servers' form: a 400 is an `invalid_request_error`
/// naming its field (`param`), a 404 a `not_found_error`, the rest `server_error`s.
fn error(request: tiny_http::Request, status: u16, message: &str) {
    error_in(request, status, None, message)
}

fn error_in(request: tiny_http::Request, status: u16, param: Option<&str>, message: &str) {
    let kind = match status {
        400 | 405 | 413 => "invalid_request_error",
        404 => "not_found_error",
        _ => "server_error",
    };
    let body = json!({"error": {"message": message, "type": kind, "param": param,
                                "code": status}});
    let header =
        tiny_http::Header::from_bytes("Content-Type", "application/json").expect("a valid header");
    let _ = request.respond(
        tiny_http::Response::from_string(body.to_string())
            .with_status_code(status)
            .with_header(header)
            .with_header(crate::serve::cors()),
    );
}

/// A room number: random (63 bits, as the seed's), from the clock and std's hasher keys.
fn random_room() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    h.finish() >> 1
}

fn route(mut request: tiny_http::Request, router: &Router) {
    let method = request.method().as_str().to_ascii_uppercase();
    let path = request.url().split('?').next().unwrap_or("").to_string();
    // Draining after SIGTERM, as `serve` does (its /health says so).
    if crate::term::terminating() {
        if path == "/health" {
            let header = tiny_http::Header::from_bytes("Content-Type", "application/json")
                .expect("a valid header");
            let _ = request.respond(
                tiny_http::Response::from_string(json!({"status": "draining"}).to_string())
                    .with_status_code(503)
                    .with_header(header)
                    .with_header(crate::serve::cors()),
            );
            return;
        }
        error(
            request,
            503,
            "the router is shutting down (SIGTERM); send the request to another router",
        );
        return;
    }
    let _flight = crate::term::InFlight::enter();
    match (method.as_str(), path.as_str()) {
        ("GET" | "HEAD", "/health") => {
            // Each server's own /health, asked at once (2 s each at most): "ok" when all
            // answer, "degraded" when some do not, 503 when no prefill or no decode server
            // does (no request can be served).
            // (A server restarted in another role, as a server of its own, is not one this
            // router can use.)
            let up = |addr: &str, role: &str| {
                health(addr, HEALTH_WAIT)
                    .is_ok_and(|(status, body)| status == 200 && in_role(&body, role).is_some())
            };
            let (pre_up, dec_up) = std::thread::scope(|sc| {
                let pre: Vec<_> = router
                    .prefill
                    .iter()
                    .map(|p| sc.spawn(|| up(&p.addr, "prefill")))
                    .collect();
                let dec: Vec<_> = router
                    .decode
                    .iter()
                    .map(|d| sc.spawn(|| up(d, "decode")))
                    .collect();
                let join = |v: Vec<std::thread::ScopedJoinHandle<'_, bool>>| {
                    v.into_iter()
                        .map(|h| h.join().unwrap_or(false))
                        .collect::<Vec<bool>>()
                };
                (join(pre), join(dec))
            });
            let serving = pre_up.iter().any(|&u| u) && dec_up.iter().any(|&u| u);
            let all = pre_up.iter().chain(&dec_up).all(|&u| u);
            let (status, word) = match (serving, all) {
                (true, true) => (200, "ok"),
                (true, false) => (200, "degraded"),
                (false, _) => (503, "unavailable"),
            };
            let body = json!({"status": word,
                "prefill": router.prefill.iter().zip(&pre_up)
                    .map(|(p, u)| json!({"addr": p.addr, "kv_port": p.kv_port(), "healthy": u}))
                    .collect::<Vec<_>>(),
                "decode": router.decode.iter().zip(&dec_up)
                    .map(|(d, u)| json!({"addr": d, "healthy": u}))
                    .collect::<Vec<_>>()});
            let header = tiny_http::Header::from_bytes("Content-Type", "application/json")
                .expect("a valid header");
            let _ = request.respond(
                tiny_http::Response::from_string(body.to_string())
                    .with_status_code(status)
                    .with_header(header)
                    .with_header(crate::serve::cors()),
            );
        }
        // Browsers' CORS preflights, answered as the servers answer them.
        ("OPTIONS", _) => crate::serve::preflight(request),
        ("GET", p) if p == "/v1/models" || p.starts_with("/v1/models/") => {
            match exchange(&router.decode[0], "GET", &path, None, router.timeout) {
                Ok((status, ct, body)) => {
                    relay(request, status, &ct, body, router.timeout);
                }
                Err(e) => {
                    let who = format!("decode server {}", router.decode[0]);
                    let (status, m) = lost(&who, &e, router.timeout);
                    error(request, status, &m)
                }
            }
        }
        ("POST", "/v1/completions" | "/v1/chat/completions") => {
            let mut bytes = Vec::new();
            if let Err(e) = request.as_reader().read_to_end(&mut bytes) {
                return error(request, 400, &format!("cannot read the request body: {e}"));
            }
            let mut body: Value = match serde_json::from_slice(&bytes) {
                Ok(v @ Value::Object(_)) => v,
                Ok(_) => return error(request, 400, "the body must be a JSON object"),
                Err(e) => {
                    return error(
                        request,
                        400,
                        &format!("the body is not JSON: {e} (it must be a JSON object)"),
                    )
                }
            };
            let room = match body.get("bootstrap_room") {
                None | Some(Value::Null) => random_room(),
                Some(v) => match v.as_u64() {
                    Some(r) => r,
                    None => {
                        return error_in(
                            request,
                            400,
                            Some("bootstrap_room"),
                            &format!("bootstrap_room: expected a non-negative integer, got {v}"),
                        )
                    }
                },
            };
            // One request per room at a time: a second one would take the first one's KV.
            if !router
                .rooms
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .insert(room)
            {
                return error_in(
                    request,
                    400,
                    Some("bootstrap_room"),
                    &format!(
                        "bootstrap_room: {room} is in use by another request in flight (give \
                         each request its own room, or leave it out for a random one)"
                    ),
                );
            }
            let held = std::sync::Arc::new(RoomHeld(router.rooms.clone(), room));
            let p = &router.prefill[(room % router.prefill.len() as u64) as usize];
            let d = &router.decode[(room % router.decode.len() as u64) as usize];
            let kv_port = p.kv_port();
            body["bootstrap_room"] = room.into();
            body["bootstrap_host"] = p.host.clone().into();
            body["bootstrap_port"] = kv_port.into();
            let payload = body.to_string().into_bytes();
            // The room's KV is dropped on the prefill server once the decode side has not taken
            // the request (refused, unreachable, failed, or its client left): at once (which
            // aborts a prefill queued or under way there: its KV would go nowhere, as the seed
            // prefills only what a decode server asked for), and again once the prefill has
            // answered (a drop that came before the prefill server opened the room).
            let release = std::sync::Arc::new(Release {
                state: std::sync::Mutex::new((false, false, None)),
                at: format!("{}:{kv_port}", bracket(&p.host)),
                room,
                held: held.clone(),
            });
            // Both posts at once; the client gets the decode server's answer, unless the
            // prefill server refuses or fails first (then its answer: the decode server would
            // only wait for KV that is not coming).
            let (tx, rx) = std::sync::mpsc::channel();
            {
                let (tx, addr, timeout) = (tx.clone(), p.addr.clone(), router.timeout);
                let (sent, path, release) = (payload.clone(), path.clone(), release.clone());
                std::thread::spawn(move || {
                    // A drain waits for this side too (and for the drop it may send).
                    let _flight = crate::term::InFlight::enter();
                    let outcome = match exchange(&addr, "POST", &path, Some(&sent), timeout) {
                        Ok((200, _, mut r)) => {
                            let _ = r.read_to_end(&mut Vec::new());
                            None
                        }
                        Ok((status, ct, mut r)) => {
                            let mut answer = Vec::new();
                            let _ = r.read_to_end(&mut answer);
                            Some(Outcome::Prefill(status, ct, answer))
                        }
                        Err(e) => {
                            say!("cachalot router: room {room}: prefill server {addr}: {e}");
                            Some(Outcome::PrefillLost(e))
                        }
                    };
                    // A prefill that answered, or whose answer was lost (it may hold KV), has
                    // its room dropped if the decode side did not take it; one the prefill
                    // server refused kept nothing (and the room may be another's).
                    if !matches!(outcome, Some(Outcome::Prefill(..))) {
                        release.prefilled();
                    }
                    if let Some(outcome) = outcome {
                        let _ = tx.send(outcome);
                    }
                });
            }
            {
                let (d, timeout, path) = (d.clone(), router.timeout, path.clone());
                std::thread::spawn(move || {
                    let got = exchange(&d, "POST", &path, Some(&payload), timeout);
                    let _ = tx.send(Outcome::Decode(got));
                });
            }
            match rx.recv() {
                Ok(Outcome::Decode(Ok((400, ct, mut r)))) => {
                    release.not_taken();
                    let mut answer = Vec::new();
                    let _ = r.read_to_end(&mut answer);
                    match misrouted(&format!("decode server {d}"), &answer) {
                        Some(m) => error(request, 502, &m),
                        None => {
                            relay(request, 400, &ct, answer.as_slice(), router.timeout);
                        }
                    }
                }
                Ok(Outcome::Decode(Ok((status, ct, r)))) => {
                    if !relay(request, status, &ct, r, router.timeout) || status != 200 {
                        release.not_taken();
                    }
                }
                Ok(Outcome::Decode(Err(e))) => {
                    release.not_taken();
                    let (status, m) = lost(&format!("decode server {d}"), &e, router.timeout);
                    error(request, status, &m)
                }
                Ok(Outcome::PrefillLost(e)) => {
                    let who = format!("prefill server {}", p.addr);
                    let (status, m) = lost(&who, &e, router.timeout);
                    error(request, status, &m)
                }
                Ok(Outcome::Prefill(status, ct, answer)) => {
                    let who = format!("prefill server {}", p.addr);
                    match misrouted(&who, &answer).filter(|_| status == 400) {
                        Some(m) => error(request, 502, &m),
                        None => {
                            relay(request, status, &ct, answer.as_slice(), router.timeout);
                        }
                    }
                }
                Err(_) => error(request, 500, "the router lost both servers' answers"),
            }
        }
        (_, "/health" | "/v1/models" | "/v1/completions" | "/v1/chat/completions") => error(
            request,
            405,
            &format!("{method} {path}: not a method of this path (see the router's paths: GET /health, GET /v1/models, POST /v1/completions, POST /v1/chat/completions)"),
        ),
        _ => error(
            request,
            404,
            &format!(
                "{method} {path}: the router has GET /health, GET /v1/models, POST \
                 /v1/completions and POST /v1/chat/completions"
            ),
        ),
    }
}

/// A backend's 400 (`answer`) over the bootstrap fields the router adds: the server (`who`) is
/// not in its role (restarted without it), and the client, which sent no such field, gets a
/// 502 naming the server rather than a 400.
fn misrouted(who: &str, answer: &[u8]) -> Option<String> {
    let v: Value = serde_json::from_slice(answer).ok()?;
    let param = v["error"]["param"].as_str()?;
    param.starts_with("bootstrap_").then(|| {
        format!(
            "{who} refused the router's {param} ({}): restart it in its role",
            v["error"]["message"].as_str().unwrap_or("")
        )
    })
}

/// `host` as the host part of HOST:PORT (an IPv6 address in brackets).
pub(crate) fn bracket(host: &str) -> String {
    if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]")
    } else {
        host.to_string()
    }
}

/// A routed request's prefilled KV, dropped on its prefill server ([`crate::serve::KV_DROP`])
/// when the decode side will not fetch it, rather than held for the prefill server's
/// `--kv-timeout-s` (and its drain); a prefill still under way is aborted.
struct Release {
    /// (the prefill answered, the decode side did not take the request, the drop sent before
    /// the prefill answered: true once it found the room)
    state: std::sync::Mutex<(bool, bool, Option<std::thread::JoinHandle<bool>>)>,
    /// The prefill server's KV port, HOST:PORT.
    at: String,
    room: u64,
    /// The room, held until the drop is sent.
    held: std::sync::Arc<RoomHeld>,
}

impl Release {
    /// The prefill answered: a request the decode side did not take has its KV dropped now,
    /// unless the drop sent before found the room (and aborted its prefill there).
    fn prefilled(&self) {
        let early = {
            let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
            s.0 = true;
            if !s.1 {
                return;
            }
            s.2.take()
        };
        if !early.is_some_and(|h| h.join().unwrap_or(false)) {
            self.send_drop();
        }
    }

    /// The decode side did not take the request: its KV, or the prefill under way, is dropped
    /// at once.
    fn not_taken(&self) {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if s.1 {
            return;
        }
        s.1 = true;
        let h = self.send_drop();
        if !s.0 {
            s.2 = Some(h);
        }
    }

    /// Sends the drop in the background; its thread answers whether it found the room.
    fn send_drop(&self) -> std::thread::JoinHandle<bool> {
        let (at, room, _held) = (self.at.clone(), self.room, self.held.clone());
        std::thread::spawn(move || {
            let _held = _held;
            let _flight = crate::term::InFlight::enter();
            drop_kv(&at, room).unwrap_or_else(|e| {
                say!(
                    "cachalot router: room {room}: could not tell the prefill server's KV \
                     port {at} to drop the KV its decode server did not take: {e}"
                );
                false
            })
        })
    }
}

/// Tells the prefill server's KV port `at` to drop `room`'s KV; whether it held the room (its
/// KV, or a prefill under way, which it aborts).
fn drop_kv(at: &str, room: u64) -> std::io::Result<bool> {
    let mut conn = crate::serve::connect_within(at, Duration::from_secs(5))?;
    let mut hello = [0u8; 8];
    conn.read_exact(&mut hello)?;
    if &hello != crate::serve::KV_HELLO {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            "not a prefill server's KV port",
        ));
    }
    let mut ask = crate::serve::KV_DROP.to_vec();
    ask.extend_from_slice(&room.to_le_bytes());
    conn.write_all(&ask)?;
    let mut ack = [0u8; 1];
    conn.read_exact(&mut ack)?;
    if ack[0] == crate::serve::KV_DROP_NONE {
        return Ok(false);
    }
    if ack[0] != 0 {
        let mut why = String::new();
        let _ = conn.take(1 << 16).read_to_string(&mut why);
        return Err(std::io::Error::other(format!(
            "it refused (an older cachalot that knows no CKV-DROP?): {}",
            why.get(4..).unwrap_or("").trim()
        )));
    }
    Ok(true)
}

/// Sends a backend's answer on to the client as it arrives: chunked to HTTP/1.1 clients (one
/// chunk per read, so streamed events pass at once), to the connection's end otherwise. True
/// when the whole answer reached the client.
fn relay(
    request: tiny_http::Request,
    status: u16,
    content_type: &str,
    mut body: impl Read,
    timeout: Duration,
) -> bool {
    let v = request.http_version();
    let chunked = (v.0, v.1) >= (1, 1);
    let reason = tiny_http::StatusCode(status).default_reason_phrase();
    let mut w = request.into_writer();
    let head = if chunked {
        format!(
            "HTTP/1.1 {status} {reason}\r\nContent-Type: {content_type}\r\n\
             Access-Control-Allow-Origin: *\r\nTransfer-Encoding: chunked\r\n\r\n"
        )
    } else {
        format!(
            "HTTP/1.0 {status} {reason}\r\nContent-Type: {content_type}\r\n\
             Access-Control-Allow-Origin: *\r\nConnection: close\r\n\r\n"
        )
    };
    if w.write_all(head.as_bytes()).is_err() {
        return false;
    }
    let mut buf = vec![0u8; 64 << 10];
    loop {
        let n = match body.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            // The backend failed mid-answer: the answer ends with why (an error event, or the
            // error object as the rest of a whole answer, as `serve` ends a failed one) and
            // the body is closed, so the client is not left waiting on a kept-alive connection.
            // The router's own cuts (its --timeout-s, its drain's end) say so, as `serve`
            // answers a request its drain cut.
            Err(e) => {
                let (code, message) = lost("the decode server (mid-answer)", &e, timeout);
                let err = serde_json::json!({"error": {
                    "message": message, "type": "server_error", "param": null, "code": code}});
                let tail = if content_type.starts_with("text/event-stream") {
                    format!("data: {err}\n\ndata: [DONE]\n\n")
                } else {
                    err.to_string()
                };
                let _ = if chunked {
                    write!(w, "{:x}\r\n{tail}\r\n0\r\n\r\n", tail.len())
                } else {
                    w.write_all(tail.as_bytes())
                }
                .and_then(|_| w.flush());
                return false;
            }
        };
        let ok = if chunked {
            write!(w, "{n:x}\r\n")
                .and_then(|_| w.write_all(&buf[..n]))
                .and_then(|_| w.write_all(b"\r\n"))
        } else {
            w.write_all(&buf[..n])
        };
        if ok.and_then(|_| w.flush()).is_err() {
            // The client left: dropping the backend's connection tells the decode server.
            return false;
        }
    }
    if chunked {
        return w.write_all(b"0\r\n\r\n").and_then(|_| w.flush()).is_ok();
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunked_bodies_are_dechunked_a_chunk_at_a_time() {
        let wire = b"5\r\nhello\r\n1;ext=1\r\n \r\nB\r\nworld again\r\n0\r\n\r\n";
        let mut r = Chunked {
            inner: BufReader::new(&wire[..]),
            left: 0,
            done: false,
        };
        let mut buf = [0u8; 64];
        let mut pieces = Vec::new();
        loop {
            let n = r.read(&mut buf).unwrap();
            if n == 0 {
                break;
            }
            pieces.push(String::from_utf8(buf[..n].to_vec()).unwrap());
        }
        assert_eq!(pieces, ["hello", " ", "world again"]);
        // Cut short, or not chunked at all: an error, not a clean end.
        for bad in [&b"5\r\nhel"[..], b"5\r\nhello\r\n", b"zz\r\n"] {
            let mut r = Chunked {
                inner: BufReader::new(bad),
                left: 0,
                done: false,
            };
            let mut all = Vec::new();
            assert!(r.read_to_end(&mut all).is_err(), "{bad:?}");
        }
    }
}
