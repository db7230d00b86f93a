//! Per-request timings and run figures (spec `executor.md` §2.9, §6.10): TTFT, TPOT, output
//! tokens per request; throughput, TPOT mean/p50/p99, prefill tokens/s and KV usage per run.

use serde::{Deserialize, Serialize};

/// Times of one request, in seconds from its arrival (`add_request`).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct RequestTiming {
    pub prompt_tokens: usize,
    pub output_tokens: usize,
    /// Arrival to the first step that computed any of its tokens.
    pub queue_s: f64,
    /// Arrival to the first generated token.
    pub ttft_s: f64,
    /// Mean time between generated tokens after the first (None with one token).
    pub tpot_s: Option<f64>,
    /// Arrival to finish.
    pub e2e_s: f64,
    /// Times its KV was dropped and recomputed because the pool was full.
    pub preemptions: usize,
    /// Prompt tokens whose KV came from the prefix cache at its first admission (not computed
    /// for it; OpenAI's `usage.prompt_tokens_details.cached_tokens`).
    #[serde(default)]
    pub cached_tokens: usize,
}

/// Counters of the engine's steps.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct EngineStats {
    pub steps: usize,
    /// Prompt and recompute tokens forwarded.
    pub prefill_tokens: usize,
    /// Generated tokens forwarded (one per decoding request per step).
    pub decode_tokens: usize,
    /// Tokens emitted (with MTP: accepted drafts and the token after them).
    pub sampled_tokens: usize,
    /// First tokens that came with a transferred KV ([`crate::Engine::add_prefilled`]): a
    /// decode server's requests emit them without sampling them.
    #[serde(default)]
    pub transferred_tokens: usize,
    /// Request-steps that emitted tokens (one per request per main forward that sampled it).
    pub sample_steps: usize,
    /// Tokens emitted in pure decode steps.
    pub decode_sampled: usize,
    /// MTP speculative decoding: drafts per step (0 = off), drafts verified, drafts accepted,
    /// request-steps that verified drafts, and time in the MTP layer's forwards.
    pub mtp_next_n: usize,
    pub drafted: usize,
    pub accepted_drafts: usize,
    pub verify_steps: usize,
    pub draft_s: f64,
    /// Time in the model's forward pass, all steps.
    pub forward_s: f64,
    /// Main forward plus MTP time of steps that carried prefill work (mixed steps included).
    pub prefill_step_s: f64,
    /// Main forward plus MTP time of pure decode steps.
    pub decode_step_s: f64,
    pub decode_steps: usize,
    pub preemptions: usize,
    /// Most KV blocks held at once, and the pool's usable blocks.
    pub kv_peak_blocks: usize,
    pub kv_capacity_blocks: usize,
    pub kv_block_size: usize,
    /// Prefix caching on; prompt tokens of admitted requests that may take cached blocks (first
    /// admissions and recomputes; not prompts being scored) and how many came from the cache.
    #[serde(default)]
    pub prefix_caching: bool,
    #[serde(default)]
    pub prefix_query_tokens: usize,
    #[serde(default)]
    pub prefix_cached_tokens: usize,
}

impl EngineStats {
    /// Accepted drafts over drafts verified.
    pub fn acceptance_rate(&self) -> f64 {
        self.accepted_drafts as f64 / self.drafted.max(1) as f64
    }
    /// Tokens emitted per verification: accepted drafts plus the main model's token (1 when
    /// nothing was verified: every step emitted its one token).
    pub fn mean_accepted_length(&self) -> f64 {
        if self.verify_steps == 0 {
            return 1.0;
        }
        (self.accepted_drafts + self.verify_steps) as f64 / self.verify_steps as f64
    }
    /// Tokens emitted per main-model forward of a request (prefill sampling steps included, as
    /// the seed counts them): 1 without speculation.
    pub fn tokens_per_main_step(&self) -> f64 {
        self.sampled_tokens as f64 / self.sample_steps.max(1) as f64
    }
}

/// Mean, median and 99th percentile of a list, the percentiles interpolated between the two
/// nearest ranks as numpy's `percentile` and `median` (what vLLM's benchmarks report); zeros when
/// it is empty.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct Distribution {
    pub mean: f64,
    pub p50: f64,
    pub p99: f64,
    pub max: f64,
}

impl Distribution {
    pub fn of(values: &[f64]) -> Distribution {
        if values.is_empty() {
            return Distribution::default();
        }
        let mut v = values.to_vec();
        v.sort_by(f64::total_cmp);
        let rank = |q: f64| {
            let at = q * (v.len() - 1) as f64;
            let (lo, hi) = (at.floor() as usize, at.ceil() as usize);
            v[lo] + (v[hi] - v[lo]) * (at - lo as f64)
        };
        Distribution {
            mean: v.iter().sum::<f64>() / v.len() as f64,
            p50: rank(0.5),
            p99: rank(0.99),
            max: v[v.len() - 1],
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_as_numpy() {
        let d = Distribution::of(&(1..=100).map(f64::from).collect::<Vec<_>>());
        assert_eq!((d.p50, d.max), (50.5, 100.0));
        assert!((d.p99 - 99.01).abs() < 1e-12, "{}", d.p99);
        assert_eq!(d.mean, 50.5);
        // numpy.percentile([4, 1, 2], [50, 99]): 2.0, 3.96.
        let d = Distribution::of(&[4.0, 1.0, 2.0]);
        assert_eq!(d.p50, 2.0);
        assert!((d.p99 - 3.96).abs() < 1e-12, "{}", d.p99);
        assert_eq!(Distribution::of(&[3.0]).p99, 3.0);
        assert_eq!(Distribution::of(&[]), Distribution::default());
    }
}
