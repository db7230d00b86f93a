//! The server's figures: `GET /metrics` in Prometheus' text format, under vLLM's metric names
//! with the `cachalot:` prefix (requests running and waiting, KV cache use, prompt and
//! generated tokens, finished requests by reason, and histograms of time to first token, time
//! per output token, queueing and end-to-end latency), and `GET /stats` as the seed's online
//! servers answer it (spec `executor.md` §5.4: status, pending requests, workers).
//!
//! The engine thread records each finished request ([`Metrics::record`]) and sets the gauges
//! after each step ([`Metrics::gauges`]); HTTP threads read them.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::Mutex;

use cachalot_engine::{FinishReason, RequestOutput};

/// Bucket bounds in seconds. vLLM's, with finer ones below where a CPU server of a small model
/// lands (sub-millisecond steps).
const TTFT_BOUNDS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];
const TPOT_BOUNDS: &[f64] = &[
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
];
const LATENCY_BOUNDS: &[f64] = &[
    0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
    60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
];

struct Histogram {
    bounds: &'static [f64],
    /// Observations at or below each bound (not cumulative; summed when written).
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Histogram {
        Histogram {
            bounds,
            counts: vec![0; bounds.len()],
            sum: 0.0,
            count: 0,
        }
    }

    fn observe(&mut self, v: f64) {
        if !v.is_finite() {
            return;
        }
        if let Some(i) = self.bounds.iter().position(|&b| v <= b) {
            self.counts[i] += 1;
        }
        self.sum += v;
        self.count += 1;
    }

    fn write(&self, out: &mut String, name: &str, help: &str, labels: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        let mut cum = 0;
        for (b, c) in self.bounds.iter().zip(&self.counts) {
            cum += c;
            let _ = writeln!(out, "{name}_bucket{{{labels},le=\"{b}\"}} {cum}");
        }
        let _ = writeln!(out, "{name}_bucket{{{labels},le=\"+Inf\"}} {}", self.count);
        let _ = writeln!(out, "{name}_sum{{{labels}}} {}", self.sum);
        let _ = writeln!(out, "{name}_count{{{labels}}} {}", self.count);
    }
}

struct Inner {
    running: usize,
    waiting: usize,
    kv_used_blocks: usize,
    kv_capacity_blocks: usize,
    prompt_tokens: u64,
    generation_tokens: u64,
    preemptions: u64,
    cached_tokens: u64,
    draft_tokens: u64,
    accepted_tokens: u64,
    finished: BTreeMap<&'static str, u64>,
    ttft: Histogram,
    tpot: Histogram,
    queue: Histogram,
    e2e: Histogram,
}

pub struct Metrics {
    inner: Mutex<Inner>,
    ranks: usize,
    /// Requests a decode server is fetching the prefilled KV of (waiting, not in the engine).
    fetching: std::sync::atomic::AtomicUsize,
    /// Prefix caching runs here: prompt tokens are looked up in it (vLLM counts queries only
    /// then).
    prefix_caching: std::sync::atomic::AtomicBool,
}

/// Counts a request as waiting for its KV while it lives ([`Metrics::fetching`]).
pub struct Fetching<'m>(&'m std::sync::atomic::AtomicUsize);

impl Drop for Fetching<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
    }
}

impl Metrics {
    /// Whether prefix caching runs on this server (its prompt tokens are then queries).
    pub fn set_prefix_caching(&self, on: bool) {
        self.prefix_caching
            .store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// Figures of a server over `ranks` processes.
    pub fn new(ranks: usize) -> Metrics {
        Metrics {
            inner: Mutex::new(Inner {
                running: 0,
                waiting: 0,
                kv_used_blocks: 0,
                kv_capacity_blocks: 0,
                prompt_tokens: 0,
                generation_tokens: 0,
                preemptions: 0,
                cached_tokens: 0,
                draft_tokens: 0,
                accepted_tokens: 0,
                finished: BTreeMap::new(),
                ttft: Histogram::new(TTFT_BOUNDS),
                tpot: Histogram::new(TPOT_BOUNDS),
                queue: Histogram::new(LATENCY_BOUNDS),
                e2e: Histogram::new(LATENCY_BOUNDS),
            }),
            ranks,
            fetching: std::sync::atomic::AtomicUsize::new(0),
            prefix_caching: std::sync::atomic::AtomicBool::new(false),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A request waiting for its prefilled KV until the guard drops: counted with the waiting.
    pub fn fetching(&self) -> Fetching<'_> {
        self.fetching
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Fetching(&self.fetching)
    }

    fn fetching_now(&self) -> usize {
        self.fetching.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// A finished request (aborted ones count under `abort`, without latencies).
    pub fn record(&self, out: &RequestOutput) {
        let mut m = self.lock();
        let reason = match out.finish {
            FinishReason::Cancelled => "abort",
            ref f => f.as_str(),
        };
        *m.finished.entry(reason).or_insert(0) += 1;
        let t = &out.timing;
        m.prompt_tokens += t.prompt_tokens as u64;
        m.preemptions += t.preemptions as u64;
        m.cached_tokens += t.cached_tokens as u64;
        m.draft_tokens += out.drafted as u64;
        m.accepted_tokens += out.accepted_drafts as u64;
        if out.finish == FinishReason::Cancelled || t.output_tokens == 0 {
            return;
        }
        m.ttft.observe(t.ttft_s);
        if let Some(tpot) = t.tpot_s {
            m.tpot.observe(tpot);
        }
        m.queue.observe(t.queue_s);
        m.e2e.observe(t.e2e_s);
    }

    /// Requests running and waiting, the KV pool's blocks used and held, and the tokens the
    /// engines have generated so far (counted as each step samples them, as vLLM's counter,
    /// not when their request ends), after a step.
    pub fn gauges(&self, [running, waiting, kv_used, kv_capacity, generated]: [usize; 5]) {
        let mut m = self.lock();
        m.generation_tokens = m.generation_tokens.max(generated as u64);
        m.running = running;
        m.waiting = waiting;
        m.kv_used_blocks = kv_used;
        m.kv_capacity_blocks = kv_capacity;
    }

    /// Requests in the engine (running or waiting), and those fetching their prefilled KV.
    pub fn pending(&self) -> usize {
        let m = self.lock();
        m.running + m.waiting + self.fetching_now()
    }

    pub fn ranks(&self) -> usize {
        self.ranks
    }

    /// The Prometheus text exposition of every figure, labelled with the model's name.
    pub fn render(&self, model: &str) -> String {
        let m = self.lock();
        let labels = format!("model_name=\"{}\"", model.replace(['\\', '"', '\n'], "_"));
        let mut out = String::new();
        let mut gauge = |name: &str, help: &str, kind: &str, v: f64| {
            let _ = writeln!(
                out,
                "# HELP cachalot:{name} {help}\n# TYPE cachalot:{name} {kind}\n\
                 cachalot:{name}{{{labels}}} {v}"
            );
        };
        gauge(
            "num_requests_running",
            "Requests in the running batch.",
            "gauge",
            m.running as f64,
        );
        gauge(
            "num_requests_waiting",
            "Requests waiting for a batch slot or KV blocks (on a decode server, also for \
             their prefilled KV).",
            "gauge",
            (m.waiting + self.fetching_now()) as f64,
        );
        let usage = if m.kv_capacity_blocks == 0 {
            0.0
        } else {
            m.kv_used_blocks as f64 / m.kv_capacity_blocks as f64
        };
        gauge(
            "kv_cache_usage_perc",
            "Share of the KV cache blocks in use (1 = full).",
            "gauge",
            usage,
        );
        gauge(
            "prompt_tokens_total",
            "Prompt tokens of finished requests.",
            "counter",
            m.prompt_tokens as f64,
        );
        gauge(
            "generation_tokens_total",
            "Tokens generated by finished requests.",
            "counter",
            m.generation_tokens as f64,
        );
        let queried = self
            .prefix_caching
            .load(std::sync::atomic::Ordering::Relaxed);
        gauge(
            "prefix_cache_queries_total",
            "Prompt tokens of finished requests looked up in the prefix cache (0 where it does \
             not run).",
            "counter",
            if queried { m.prompt_tokens as f64 } else { 0.0 },
        );
        gauge(
            "prefix_cache_hits_total",
            "Prompt tokens of finished requests whose KV came from the prefix cache.",
            "counter",
            m.cached_tokens as f64,
        );
        gauge(
            "spec_decode_num_draft_tokens_total",
            "MTP draft tokens verified for finished requests (vLLM's spec_decode_num_draft_tokens).",
            "counter",
            m.draft_tokens as f64,
        );
        gauge(
            "spec_decode_num_accepted_tokens_total",
            "MTP draft tokens accepted for finished requests (their share of the drafts is the \
             acceptance rate).",
            "counter",
            m.accepted_tokens as f64,
        );
        gauge(
            "num_preemptions_total",
            "Times a request's KV was dropped and recomputed.",
            "counter",
            m.preemptions as f64,
        );
        let _ = writeln!(
            out,
            "# HELP cachalot:request_success_total Finished requests by finish reason.\n\
             # TYPE cachalot:request_success_total counter"
        );
        for (reason, n) in &m.finished {
            let _ = writeln!(
                out,
                "cachalot:request_success_total{{{labels},finished_reason=\"{reason}\"}} {n}"
            );
        }
        m.ttft.write(
            &mut out,
            "cachalot:time_to_first_token_seconds",
            "Arrival to first generated token.",
            &labels,
        );
        m.tpot.write(
            &mut out,
            "cachalot:time_per_output_token_seconds",
            "Mean time between generated tokens after the first, per request.",
            &labels,
        );
        m.queue.write(
            &mut out,
            "cachalot:request_queue_time_seconds",
            "Arrival to the first step that computed any of the request's tokens.",
            &labels,
        );
        m.e2e.write(
            &mut out,
            "cachalot:e2e_request_latency_seconds",
            "Arrival to finish.",
            &labels,
        );
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cachalot_engine::metrics::RequestTiming;

    fn out(finish: FinishReason, output_tokens: usize, ttft: f64) -> RequestOutput {
        RequestOutput {
            id: 0,
            prompt: vec![1, 2, 3],
            tokens: vec![5; output_tokens],
            valid_tokens: output_tokens,
            text: String::new(),
            finish,
            timing: RequestTiming {
                prompt_tokens: 3,
                output_tokens,
                queue_s: 0.001,
                ttft_s: ttft,
                tpot_s: Some(0.002),
                e2e_s: 0.05,
                preemptions: 1,
                cached_tokens: 0,
            },
            drafted: 3,
            accepted_drafts: 2,
            logprobs: Vec::new(),
            prompt_logprobs: Vec::new(),
            kv: None,
        }
    }

    #[test]
    fn counters_gauges_and_cumulative_buckets() {
        let m = Metrics::new(1);
        m.record(&out(FinishReason::Length, 4, 0.003));
        m.record(&out(FinishReason::Length, 2, 0.3));
        m.record(&out(FinishReason::Cancelled, 1, 9.0));
        m.gauges([2, 1, 3, 12, 7]);
        let text = m.render("tiny");
        let line = |p: &str| {
            text.lines()
                .find(|l| l.starts_with(p))
                .unwrap_or_else(|| panic!("{p}: {text}"))
                .rsplit(' ')
                .next()
                .unwrap()
                .to_string()
        };
        assert_eq!(line("cachalot:num_requests_running{"), "2");
        assert_eq!(line("cachalot:kv_cache_usage_perc{"), "0.25");
        assert_eq!(line("cachalot:prompt_tokens_total{"), "9");
        assert_eq!(line("cachalot:generation_tokens_total{"), "7");
        assert_eq!(line("cachalot:spec_decode_num_draft_tokens_total{"), "9");
        assert_eq!(line("cachalot:spec_decode_num_accepted_tokens_total{"), "6");
        assert_eq!(
            line("cachalot:request_success_total{model_name=\"tiny\",finished_reason=\"length\"}"),
            "2"
        );
        assert_eq!(
            line("cachalot:request_success_total{model_name=\"tiny\",finished_reason=\"abort\"}"),
            "1"
        );
        // Cumulative: 1 at 5 ms, both by 0.5 s; the aborted one is not timed.
        let b = |le: &str| {
            line(&format!(
                "cachalot:time_to_first_token_seconds_bucket{{model_name=\"tiny\",le=\"{le}\"}}"
            ))
        };
        assert_eq!(
            (b("0.001"), b("0.005"), b("0.5"), b("+Inf")),
            ("0".into(), "1".into(), "2".into(), "2".into())
        );
        assert_eq!(m.pending(), 3);
        // A request fetching its KV counts as waiting while it does.
        let waiting = |m: &Metrics| {
            m.render("tiny")
                .lines()
                .find(|l| l.starts_with("cachalot:num_requests_waiting{"))
                .and_then(|l| l.rsplit(' ').next())
                .map(str::to_string)
        };
        let before = waiting(&m);
        {
            let _f = m.fetching();
            assert_eq!(m.pending(), 4);
            assert_ne!(waiting(&m), before);
        }
        assert_eq!(m.pending(), 3);
        assert_eq!(waiting(&m), before);
    }
}
