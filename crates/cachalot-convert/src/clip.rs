//! DeepSeek-V4 clip factors (spec `deepseek-v4.md` §4.3 step 1; the seed's
//! `convert_model.py --quant_param_path DIR`): `DIR/quant_params_{L}.pt` for every layer
//! L in `0..num_hidden_layers` (each a `torch.save`d dict, merged in layer order), holding
//! `<layer>.clip_factor_min` / `<layer>.clip_factor_max` for some integer-quantised layers.
//! Before INT8 or INT4 quantisation such a weight W (bf16 `[N, K]`) is clamped per row:
//!
//!   lo = bf16(min_row(W) · fmin), hi = bf16(max_row(W) · fmax), W = clamp(W, lo, hi)
//!
//! which is the seed's `cur_min *= factor` on the bf16 row minima (in place) followed by
//! `torch.clamp`. The product is formed as PyTorch forms it for each kind of factor, checked
//! against torch in `tools/quant/v4_convert_reference.py`'s fixtures: an f32 or bf16 `[N, 1]`
//! tensor, a 0-dim tensor of any float dtype and a Python number multiply in f32 (the value
//! taken as f32) and round to bf16; an f64 `[N, 1]` tensor multiplies in f64 and rounds to f32,
//! then to bf16 (c10's double → bfloat16 conversion). Factors for layers that are not
//! integer-quantised are ignored, as the seed ignores them; MX types load the files (they must
//! exist) and do not clip.

use std::collections::HashMap;
use std::path::Path;

use cachalot_kernels::{bf16_to_f32, f32_to_bf16};

use crate::torch_pt::{load_pt, PtValue};
use crate::ConvertError;

/// One clip factor.
#[derive(Clone, Debug)]
pub(crate) enum Factor {
    /// Multiplied in f32: one value for every row, or one per row.
    F32(Vec<f32>),
    /// An f64 `[N, 1]` tensor: multiplied in f64.
    F64(Vec<f64>),
}

impl Factor {
    fn rows(&self) -> usize {
        match self {
            Factor::F32(v) => v.len(),
            Factor::F64(v) => v.len(),
        }
    }

    /// bf16(x · factor of row r).
    fn apply(&self, x_bf16: u16, r: usize) -> u16 {
        let x = bf16_to_f32(x_bf16);
        match self {
            Factor::F32(v) => f32_to_bf16(x * v[if v.len() == 1 { 0 } else { r }]),
            Factor::F64(v) => f32_to_bf16((x as f64 * v[r]) as f32),
        }
    }
}

/// The min and max factors of one layer, and the files they came from.
#[derive(Clone, Debug)]
pub(crate) struct Clip {
    pub min: Factor,
    pub max: Factor,
    pub files: [String; 2],
}

impl Clip {
    /// Clamps the bf16 rows `rows` (absolute indices `r0..`) in place.
    pub fn apply(&self, bf: &mut [u16], cols: usize, r0: usize) {
        for (i, row) in bf.chunks_exact_mut(cols).enumerate() {
            let r = r0 + i;
            let (mut lo, mut hi) = (row[0], row[0]);
            for &b in row.iter() {
                if bf16_to_f32(b) < bf16_to_f32(lo) {
                    lo = b;
                }
                if bf16_to_f32(b) > bf16_to_f32(hi) {
                    hi = b;
                }
            }
            let lo = bf16_to_f32(self.min.apply(lo, r));
            let hi = bf16_to_f32(self.max.apply(hi, r));
            for b in row.iter_mut() {
                // torch.clamp(x, min, max) = min(max(x, lo), hi)
                let v = bf16_to_f32(*b).max(lo).min(hi);
                *b = f32_to_bf16(v);
            }
        }
    }

    /// Checks the factors against a weight of `rows` rows (the error names the factor's file).
    pub fn check_rows(&self, rows: usize) -> Result<(), String> {
        for ((end, f), file) in [("min", &self.min), ("max", &self.max)]
            .into_iter()
            .zip(&self.files)
        {
            if f.rows() != 1 && f.rows() != rows {
                return Err(format!(
                    "clip_factor_{end} (from {file}) has {} values; the weight has {rows} rows \
                     (give one value or an [{rows}, 1] tensor)",
                    f.rows()
                ));
            }
        }
        Ok(())
    }
}

/// Loads `dir/quant_params_{L}.pt` for L in 0..num_layers: layer name (the weight name without
/// `.weight`) → its factors.
///
/// A factor scales a row's range: NaN would silently drop the clamp (f32::max/min skip a NaN
/// bound, where torch.clamp propagates it), zero would wipe the row and a negative one invert
/// it; each is an error naming the key.
fn check_factor(key: &str, factor: &Factor) -> Result<(), String> {
    let values: Vec<f64> = match factor {
        Factor::F32(v) => v.iter().map(|&x| x as f64).collect(),
        Factor::F64(v) => v.clone(),
    };
    match values
        .iter()
        .enumerate()
        .find(|(_, x)| !(x.is_finite() && **x > 0.0))
    {
        Some((i, x)) => Err(format!(
            "{key}{} is {x}; clip factors must be finite and positive",
            if values.len() > 1 {
                format!("[{i}]")
            } else {
                String::new()
            }
        )),
        None => Ok(()),
    }
}

pub(crate) fn load_clip_params(
    dir: &Path,
    num_layers: usize,
) -> Result<HashMap<String, Clip>, ConvertError> {
    let mut raw: HashMap<String, (String, Factor)> = HashMap::new();
    let mut order: Vec<String> = Vec::new();
    for layer in 0..num_layers {
        let file = dir.join(format!("quant_params_{layer}.pt"));
        let err = |why: String| ConvertError::Config {
            file: file.clone(),
            why,
        };
        if !file.is_file() {
            return Err(err(format!(
                "missing: --quant-param-path needs quant_params_L.pt for every layer L in \
                 0..{num_layers} (num_hidden_layers)"
            )));
        }
        let PtValue::Dict(items) = load_pt(&file).map_err(ConvertError::Usage)? else {
            return Err(err("holds no dict of clip factors".into()));
        };
        // The files are merged whatever their keys say (as the seed's dict.update), so a file
        // holding another layer's factors clips that layer, not its own: said, not refused.
        let mut others: Vec<&str> = Vec::new();
        for (k, _) in &items {
            let PtValue::Str(key) = k else { continue };
            let named = key
                .strip_prefix("layers.")
                .and_then(|r| r.split('.').next())
                .and_then(|n| n.parse::<usize>().ok());
            if named.is_some_and(|n| n != layer) && !others.contains(&key.as_str()) {
                others.push(key);
            }
        }
        if let Some(first) = others.first() {
            eprintln!(
                "convert: note: {} holds {} factor(s) of other layers than {layer} (first: \
                 {first}); they clip the layers their keys name (files are merged, as the \
                 seed's): is the file misnumbered?",
                file.display(),
                others.len()
            );
        }
        for (k, v) in items {
            let PtValue::Str(key) = k else {
                return Err(err(format!("has a non-string key {k:?}")));
            };
            let factor = match &v {
                PtValue::Float(x) => Factor::F32(vec![*x as f32]),
                PtValue::Int(x) => Factor::F32(vec![*x as f32]),
                PtValue::Tensor(t) => {
                    let n = t.values.len();
                    let per_row = t.shape.len() == 2 && t.shape[1] == 1;
                    if n == 1 && !per_row {
                        Factor::F32(vec![t.values[0] as f32])
                    } else if per_row && t.dtype == "float64" {
                        Factor::F64(t.values.clone())
                    } else if per_row {
                        Factor::F32(t.values.iter().map(|&x| x as f32).collect())
                    } else {
                        return Err(err(format!(
                            "{key} has shape {:?}; clip factors are one value or [N, 1] (an \
                             [N] tensor does not broadcast against the per-row minima)",
                            t.shape
                        )));
                    }
                }
                other => return Err(err(format!("{key} is {other:?}, not a number or tensor"))),
            };
            if !key.ends_with(".clip_factor_min") && !key.ends_with(".clip_factor_max") {
                continue;
            }
            check_factor(&key, &factor).map_err(err)?;
            if !raw.contains_key(&key) {
                order.push(key.clone());
            }
            // Later files override earlier ones (the seed's dict.update).
            raw.insert(key.clone(), (file.display().to_string(), factor));
        }
    }
    let mut out = HashMap::new();
    for key in order {
        let (layer, _) = key.rsplit_once(".clip_factor_").unwrap();
        if out.contains_key(layer) {
            continue;
        }
        let min = raw.get(&format!("{layer}.clip_factor_min"));
        let max = raw.get(&format!("{layer}.clip_factor_max"));
        match (min, max) {
            (Some((fa, a)), Some((fb, b))) => {
                out.insert(
                    layer.to_string(),
                    Clip {
                        min: a.clone(),
                        max: b.clone(),
                        files: [fa.clone(), fb.clone()],
                    },
                );
            }
            (Some((f, _)), None) | (None, Some((f, _))) => {
                return Err(ConvertError::Config {
                    file: f.into(),
                    why: format!(
                        "{layer} has only one of clip_factor_min / clip_factor_max; the seed \
                         needs both (it multiplies by the missing one and fails)"
                    ),
                })
            }
            (None, None) => unreachable!(),
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clip_factors_must_be_finite_and_positive() {
        let k = "layers.0.attn.wo_b.clip_factor_max";
        assert!(check_factor(k, &Factor::F32(vec![0.9])).is_ok());
        assert!(check_factor(k, &Factor::F64(vec![0.5, 1.0])).is_ok());
        for bad in [f32::NAN, 0.0, -0.5, f32::INFINITY] {
            let e = check_factor(k, &Factor::F32(vec![bad])).unwrap_err();
            assert!(e.contains(k) && e.contains("finite and positive"), "{e}");
        }
        let e = check_factor(k, &Factor::F64(vec![0.5, f64::NAN])).unwrap_err();
        assert!(e.contains(&format!("{k}[1] is NaN")), "{e}");
    }

    /// Factors that do not fit the weight's rows are named with the file they came from.
    #[test]
    fn a_factor_of_other_rows_names_its_file() {
        let c = Clip {
            min: Factor::F32(vec![0.9]),
            max: Factor::F32(vec![1.1; 4]),
            files: ["q/quant_params_0.pt".into(), "q/quant_params_1.pt".into()],
        };
        assert!(c.check_rows(4).is_ok());
        let e = c.check_rows(3).unwrap_err();
        assert!(
            e.contains("clip_factor_max (from q/quant_params_1.pt) has 4 values"),
            "{e}"
        );
    }
}
