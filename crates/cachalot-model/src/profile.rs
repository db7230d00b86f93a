//! Where a forward pass's time goes, by phase (`cachalot run --profile`, `cachalot bench
//! --profile`): wall time summed over every call of each phase in this process, for finding
//! what to make faster (docs/PERF.md). Off by default; when off a phase costs one relaxed
//! atomic load and no clock read.
//!
//! The phases of a DeepSeek-V3/R1/Kimi-K2 forward (spec `deepseek-v3-r1-kimi-k2.md` §3) nest
//! under [`Phase::Step`] (one engine step, scheduling and sampling included): per layer the
//! attention's parts ([`Phase::AttnProj`] … [`Phase::AttnOut`]), the dense MLP or the MoE block,
//! then the head. A DeepSeek-V4 forward reports its attention, FFN and head as
//! [`Phase::Attention`], [`Phase::Moe`] and [`Phase::Head`]. Times are wall time of the thread
//! that runs the phase (the parallel regions inside it included), so the phases of one step
//! add up to at most its wall time; the rest of [`Phase::Step`] is the engine's own work.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Instant;

/// A timed part of a step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// One engine step (`Engine::step`): everything below plus scheduling, sampling and stop
    /// rules.
    Step,
    /// Embedding lookups.
    Embed,
    /// The query and latent projections (q_a or q, kv_a, the q_a norm, q_b).
    AttnProj,
    /// The latents' norm and rope, the queries' rope, and the cache writes.
    AttnLatents,
    /// Absorbed attention, 1: `W_UKᵀ q` per head.
    AttnAbsorb,
    /// Absorbed attention, 2: the queries in vector lanes, scores, softmax and weighted sums
    /// over the latent cache, the chunks' merge; naive attention (long prefill chunks) whole.
    AttnCore,
    /// Absorbed attention, 3: `W_UV ō` per head.
    AttnUv,
    /// The output projection (o_proj).
    AttnOut,
    /// A V4 layer's attention (compressors and indexer included).
    Attention,
    /// A dense layer's MLP.
    Dense,
    /// A MoE block: router, routing, routed and shared experts, the weighted sum.
    Moe,
    /// The final norm and lm_head (an MTP layer's shared head included).
    Head,
    /// Tensor parallelism: adding the ranks' partial attention and MLP outputs (waiting for
    /// the slowest rank included).
    Reduce,
}

impl Phase {
    pub const ALL: [Phase; 13] = [
        Phase::Step,
        Phase::Embed,
        Phase::AttnProj,
        Phase::AttnLatents,
        Phase::AttnAbsorb,
        Phase::AttnCore,
        Phase::AttnUv,
        Phase::AttnOut,
        Phase::Attention,
        Phase::Dense,
        Phase::Moe,
        Phase::Head,
        Phase::Reduce,
    ];

    /// The name in reports (`profile.json`, the bench's JSON).
    pub fn name(self) -> &'static str {
        match self {
            Phase::Step => "step",
            Phase::Embed => "embed",
            Phase::AttnProj => "attn_proj",
            Phase::AttnLatents => "attn_latents",
            Phase::AttnAbsorb => "attn_absorb_uk",
            Phase::AttnCore => "attn_core",
            Phase::AttnUv => "attn_uv",
            Phase::AttnOut => "attn_out",
            Phase::Attention => "attention_v4",
            Phase::Dense => "dense_mlp",
            Phase::Moe => "moe",
            Phase::Head => "head",
            Phase::Reduce => "tp_reduce",
        }
    }

    /// Its slot in the totals: [`Phase::ALL`] lists the phases in declaration order.
    fn index(self) -> usize {
        self as usize
    }
}

const N: usize = Phase::ALL.len();

static ENABLED: AtomicBool = AtomicBool::new(false);
static NANOS: [AtomicU64; N] = [const { AtomicU64::new(0) }; N];
static CALLS: [AtomicU64; N] = [const { AtomicU64::new(0) }; N];

/// Turns timing on or off for the whole process.
pub fn set_enabled(on: bool) {
    ENABLED.store(on, Ordering::Relaxed);
}

pub fn enabled() -> bool {
    ENABLED.load(Ordering::Relaxed)
}

/// Zeroes every phase's totals.
pub fn reset() {
    for (n, c) in NANOS.iter().zip(&CALLS) {
        n.store(0, Ordering::Relaxed);
        c.store(0, Ordering::Relaxed);
    }
}

/// Times one phase from [`Timer::start`] until it is dropped (nothing when profiling is off).
#[must_use = "a timer measures until it is dropped"]
pub struct Timer(Option<(Phase, Instant)>);

impl Timer {
    pub fn start(phase: Phase) -> Timer {
        Timer(enabled().then(|| (phase, Instant::now())))
    }
}

impl Drop for Timer {
    fn drop(&mut self) {
        if let Some((phase, t0)) = self.0 {
            let i = phase.index();
            NANOS[i].fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
            CALLS[i].fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// One phase's totals since the last [`reset`] (`calls`: how many times its timer ran).
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct PhaseTotal {
    pub phase: String,
    pub seconds: f64,
    pub calls: u64,
}

/// The totals of every phase that ran, in [`Phase::ALL`]'s order.
pub fn snapshot() -> Vec<PhaseTotal> {
    Phase::ALL
        .iter()
        .map(|&p| PhaseTotal {
            phase: p.name().to_string(),
            seconds: NANOS[p.index()].load(Ordering::Relaxed) as f64 / 1e9,
            calls: CALLS[p.index()].load(Ordering::Relaxed),
        })
        .filter(|t| t.calls > 0)
        .collect()
}

/// Runs `f` with timing on (when `on`) from zeroed totals, and returns its result with the
/// phases it timed.
pub fn profiled<R>(on: bool, f: impl FnOnce() -> R) -> (R, Vec<PhaseTotal>) {
    reset();
    set_enabled(on);
    let r = f();
    set_enabled(false);
    (r, snapshot())
}

/// A table of [`snapshot`]: seconds, calls, and each phase's share of the steps' time (of the
/// phases' sum when no step was timed).
pub fn table(totals: &[PhaseTotal]) -> String {
    let step = totals
        .iter()
        .find(|t| t.phase == Phase::Step.name())
        .map(|t| t.seconds);
    let base = step.unwrap_or_else(|| totals.iter().map(|t| t.seconds).sum());
    let mut s = String::from("phase             seconds      calls   share\n");
    for t in totals {
        let share = if base > 0.0 { t.seconds / base } else { 0.0 };
        s += &format!(
            "{:<16} {:>8.3} {:>10} {:>6.1}%\n",
            t.phase,
            t.seconds,
            t.calls,
            share * 100.0
        );
    }
    if let Some(step) = step {
        let inner: f64 = totals
            .iter()
            .filter(|t| t.phase != Phase::Step.name())
            .map(|t| t.seconds)
            .sum();
        let rest = (step - inner).max(0.0);
        s += &format!(
            "{:<16} {:>8.3} {:>10} {:>6.1}%\n",
            "(step, rest)",
            rest,
            "",
            if step > 0.0 { rest / step * 100.0 } else { 0.0 }
        );
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    // The only test that turns timing on. While it is on, forwards of other tests running at
    // the same time may add to the totals too, so counts are checked as lower bounds.
    #[test]
    fn timers_count_only_when_enabled_and_reset_clears() {
        assert!(Phase::ALL.iter().enumerate().all(|(i, p)| p.index() == i));
        set_enabled(false);
        reset();
        drop(Timer::start(Phase::Moe));
        assert!(snapshot().is_empty(), "a disabled timer recorded");
        set_enabled(true);
        {
            let _step = Timer::start(Phase::Step);
            let _moe = Timer::start(Phase::Moe);
            std::thread::sleep(std::time::Duration::from_millis(2));
        }
        drop(Timer::start(Phase::Moe));
        set_enabled(false);
        let s = snapshot();
        let moe = s.iter().find(|t| t.phase == "moe").expect("moe timed");
        let step = s.iter().find(|t| t.phase == "step").expect("step timed");
        assert!(moe.calls >= 2 && step.calls >= 1, "{s:?}");
        assert!(moe.seconds >= 0.002 && step.seconds >= 0.002, "{s:?}");
        let t = table(&s);
        assert!(t.contains("moe") && t.contains("(step, rest)"), "{t}");
    }
}
