//! Rotary position embedding with YaRN, as DeepSeek-V3/Kimi-K2 use it.
//!
//! Spec: `shared/specs/deepseek-v3-r1-kimi-k2.md` §3.2 (YaRN constants, correction range, ramp,
//! pair convention) and §8 (transformers' `_compute_yarn_parameters`, which we follow: frequencies
//! in f32, angles `f32(pos)·inv_freq` in f32, cos/sin scaled by the amplitude factor). The
//! checkpoint's rope dims are interleaved pairs; the output is de-interleaved (the layout of
//! transformers with `rope_interleave = true`), applied identically to q and k, so scores match.

use crate::config::{yarn_get_mscale, DeepseekV3Config};

#[derive(Clone, Debug)]
pub struct Rope {
    inv_freq: Vec<f32>,
    /// cos/sin amplitude (1.0 for DeepSeek's `mscale = mscale_all_dim = 1`).
    amplitude: f32,
    interleaved: bool,
}

impl Rope {
    pub fn new(cfg: &DeepseekV3Config) -> Rope {
        let dim = cfg.qk_rope_head_dim;
        let half = dim / 2;
        let base = cfg.rope_theta;
        // pos_freqs = base ** (arange(0, dim, 2).float() / dim), in f32 like torch.
        let pos_freqs: Vec<f32> = (0..half)
            .map(|i| (base as f32).powf((2 * i) as f32 / dim as f32))
            .collect();
        let (inv_freq, amplitude) = match &cfg.rope_scaling {
            None => (pos_freqs.iter().map(|p| 1.0 / p).collect(), 1.0),
            Some(y) => {
                let factor = y.factor;
                let amplitude = match y.attention_factor {
                    Some(a) => a,
                    None => match (y.mscale, y.mscale_all_dim) {
                        (Some(m), Some(all)) if m != 0.0 && all != 0.0 => {
                            yarn_get_mscale(factor, m) / yarn_get_mscale(factor, all)
                        }
                        _ => yarn_get_mscale(factor, 1.0),
                    },
                };
                let correction_dim = |rotations: f64| {
                    dim as f64
                        * (y.original_max_position_embeddings as f64
                            / (rotations * 2.0 * std::f64::consts::PI))
                            .ln()
                        / (2.0 * base.ln())
                };
                let mut low = correction_dim(y.beta_fast);
                let mut high = correction_dim(y.beta_slow);
                if y.truncate {
                    low = low.floor();
                    high = high.ceil();
                }
                let low = low.max(0.0);
                let mut high = high.min(dim as f64 - 1.0);
                if low == high {
                    high += 0.001;
                }
                let inv_freq = pos_freqs
                    .iter()
                    .enumerate()
                    .map(|(i, &p)| {
                        let extrapolation = 1.0 / p;
                        let interpolation = 1.0 / (factor as f32 * p);
                        let ramp = (((i as f64 - low) / (high - low)) as f32).clamp(0.0, 1.0);
                        let extrapolation_factor = 1.0 - ramp;
                        interpolation * (1.0 - extrapolation_factor)
                            + extrapolation * extrapolation_factor
                    })
                    .collect();
                (inv_freq, amplitude as f32)
            }
        };
        Rope {
            inv_freq,
            amplitude,
            interleaved: cfg.rope_interleave,
        }
    }

    pub fn inv_freq(&self) -> &[f32] {
        &self.inv_freq
    }

    /// cos and sin (each `dim/2`) for one position.
    pub fn cos_sin(&self, position: usize, cos: &mut [f32], sin: &mut [f32]) {
        let p = position as f32;
        for ((c, s), &f) in cos.iter_mut().zip(sin.iter_mut()).zip(&self.inv_freq) {
            let angle = p * f;
            *c = angle.cos() * self.amplitude;
            *s = angle.sin() * self.amplitude;
        }
    }

    /// Rotates every `dim`-wide vector in `x` (e.g. the rope parts of all heads of one token,
    /// gathered with `stride`) in place for `position`.
    pub fn apply(&self, x: &mut [f32], cos: &[f32], sin: &[f32]) {
        if self.interleaved {
            cachalot_kernels::rope_deinterleave_in_place(x, cos, sin);
        } else {
            // rotate_half convention: pairs are (x[i], x[i + d/2]).
            let half = cos.len();
            for i in 0..half {
                let (a, b) = (x[i], x[i + half]);
                x[i] = a * cos[i] - b * sin[i];
                x[i + half] = b * cos[i] + a * sin[i];
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    fn cfg(extra: serde_json::Value) -> DeepseekV3Config {
        let mut v = serde_json::json!({
            "model_type": "deepseek_v3", "vocab_size": 16, "hidden_size": 8,
            "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 1,
            "kv_lora_rank": 4, "qk_nope_head_dim": 4, "qk_rope_head_dim": 64, "v_head_dim": 4,
        });
        for (k, val) in extra.as_object().unwrap() {
            v[k] = val.clone();
        }
        DeepseekV3Config::from_json_str(&v.to_string(), Path::new("config.json")).unwrap()
    }

    /// Spec §1.2: R1's correction range is (10.47, 22.51) → low 10, high 23; dims below 10 keep
    /// their frequency, dims from 23 on are divided by the factor.
    #[test]
    fn r1_yarn_ramp() {
        let c = cfg(
            serde_json::json!({"rope_theta": 10000, "rope_scaling": {"type": "yarn",
            "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
            "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}}),
        );
        let r = Rope::new(&c);
        let base = |i: usize| 1.0 / 10000f32.powf(2.0 * i as f32 / 64.0);
        for i in 0..10 {
            assert!((r.inv_freq()[i] - base(i)).abs() <= 1e-7 * base(i).max(1.0));
        }
        for i in 23..32 {
            assert!((r.inv_freq()[i] - base(i) / 40.0).abs() <= 1e-6 * base(i));
        }
        assert_eq!(r.amplitude, 1.0);
        // In the ramp, strictly between the two.
        assert!(r.inv_freq()[16] < base(16) && r.inv_freq()[16] > base(16) / 40.0);
    }

    #[test]
    fn rotation_preserves_norm_and_pairs() {
        let c = cfg(serde_json::json!({}));
        let r = Rope::new(&c);
        let mut cos = vec![0.0; 32];
        let mut sin = vec![0.0; 32];
        r.cos_sin(7, &mut cos, &mut sin);
        let x: Vec<f32> = (0..64).map(|i| (i as f32 * 0.37).sin()).collect();
        let mut y = x.clone();
        r.apply(&mut y, &cos, &sin);
        let n0: f32 = x.iter().map(|v| v * v).sum();
        let n1: f32 = y.iter().map(|v| v * v).sum();
        assert!((n0 - n1).abs() < 1e-4);
        // pair i = (x[2i], x[2i+1]) lands at (y[i], y[32+i])
        let i = 5;
        assert!((y[i] - (x[2 * i] * cos[i] - x[2 * i + 1] * sin[i])).abs() < 1e-6);
        assert!((y[32 + i] - (x[2 * i + 1] * cos[i] + x[2 * i] * sin[i])).abs() < 1e-6);
    }
}
