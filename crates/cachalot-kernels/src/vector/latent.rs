//! The latent-attention kernels (`dot_rows_lanes` for `dot_rows_many`, `axpy_rows_many`)
//! written once for any f32 vector width: `latent_kernels!` expands them inside `avx2.rs` (8
//! lanes), `avx512.rs` (16 lanes) and `neon.rs` (4 lanes). Neither sum depends on the width, so
//! every level gives the scalar twin's bits:
//!
//! - `dot_rows_many` holds heads in lanes: the queries transposed to column-major
//!   ([`super::HeadLanes`]), a tile of R latent rows × LANES heads keeps R accumulators, and
//!   each column broadcasts one value of each row into an FMA with the heads' query values, so
//!   every (row, head) sum is one FMA chain over the columns in order (`scalar::dot_rows_many`).
//! - `axpy_rows_many` runs tiles of up to 8 rows × 2 heads over passes of 4·LANES columns (eight
//!   independent FMA chains, one per head and column chunk), then single chunks and a scalar tail;
//!   each chunk of the two output rows is loaded and stored once per tile, and every output
//!   element gets `y = fma(p, x, y)` for its rows in order (the bits of `axpy_rows` row by row).
//!
//! Tile sizes are constants so tiles live in registers (a tile indexed by runtime counts went
//! through the stack: 36 → 58-64 GFMA/s for the AVX-512 axpy when this was fixed).
//! Spec: `deepseek-v3-r1-kimi-k2.md` §3.4 (absorbed MLA decode: MQA over the latent cache).

/// Expands `dot_rows_many` and `axpy_rows_many` (and their tiles) for one vector type. Arguments:
/// the target features, the vector type, its lanes, then its zero, unaligned load and store,
/// FMA (`a·b + c`) and broadcast intrinsics.
macro_rules! latent_kernels {
    ($feat:literal, $v:ty, $lanes:literal, $zero:ident, $load:ident, $store:ident, $fma:ident,
     $set1:ident) => {
        /// `scalar::dot_rows_many` with heads in lanes (`vector::latent`), from the queries
        /// column-major with `hp` lanes per column (`HeadLanes`).
        ///
        /// # Safety
        /// The CPU has this module's features; `qt` holds `d·hp` values with `hp` a multiple
        /// of LANES, every `ls[s]` has `d` values, and `out.len() == ls.len() · H` with H ≤ hp.
        #[target_feature(enable = $feat)]
        pub unsafe fn dot_rows_lanes(
            qt: &[f32],
            hp: usize,
            d: usize,
            ls: &[&[f32]],
            out: &mut [f32],
        ) {
            let n = ls.len();
            if n == 0 {
                return;
            }
            let heads = out.len() / n;
            // Every row asked into L2 up front, the next tile's into L1 as each tile starts:
            // scattered over the paged cache, the rows are not seen coming by the hardware
            // prefetcher, and the first tiles would wait on them. Three alternating rounds:
            // `attn_core` of the small model's batch-16 decode at 64-576 positions 0.72 /
            // 0.54 / 0.52 → 0.61 / 0.44 / 0.45 s, the 1 B W8A8 model's at 512 0.114 / 0.122
            // / 0.113 → 0.106 / 0.113 / 0.113 s. Hints only.
            crate::vector::prefetch_rows::<{ crate::vector::PREFETCH_L2 }, _>(ls, 0..n);
            let mut hb = 0;
            while hb < heads {
                let mut s0 = 0;
                crate::vector::prefetch_rows::<{ crate::vector::PREFETCH_L1 }, _>(ls, 0..8);
                while s0 + 8 <= n {
                    // The next tile's rows (scattered over the paged cache, so the hardware
                    // prefetcher does not see them coming) load while this tile computes.
                    crate::vector::prefetch_rows::<{ crate::vector::PREFETCH_L1 }, _>(
                        ls,
                        s0 + 8..s0 + 16,
                    );
                    dot_heads_tile::<8>(qt, hp, hb, d, ls, s0, out);
                    s0 += 8;
                }
                if s0 + 4 <= n {
                    dot_heads_tile::<4>(qt, hp, hb, d, ls, s0, out);
                    s0 += 4;
                }
                while s0 < n {
                    dot_heads_tile::<1>(qt, hp, hb, d, ls, s0, out);
                    s0 += 1;
                }
                hb += $lanes;
            }
        }

        /// Rows s0..s0+R against heads hb..hb+LANES (those below H written).
        #[inline]
        #[allow(clippy::needless_range_loop)] // parallel indexing of const-size tiles
        #[target_feature(enable = $feat)]
        unsafe fn dot_heads_tile<const R: usize>(
            qt: &[f32],
            hp: usize,
            hb: usize,
            d: usize,
            ls: &[&[f32]],
            s0: usize,
            out: &mut [f32],
        ) {
            let heads = out.len() / ls.len();
            let mut lp = [std::ptr::null::<f32>(); R];
            for r in 0..R {
                lp[r] = ls[s0 + r].as_ptr();
            }
            let pq = qt.as_ptr().add(hb);
            let mut acc: [$v; R] = [$zero(); R];
            for c in 0..d {
                let qv = $load(pq.add(c * hp));
                for r in 0..R {
                    acc[r] = $fma(qv, $set1(*lp[r].add(c)), acc[r]);
                }
            }
            let nh = (heads - hb).min($lanes);
            let mut tmp = [0.0f32; $lanes];
            for r in 0..R {
                $store(tmp.as_mut_ptr(), acc[r]);
                let o = (s0 + r) * heads + hb;
                out[o..o + nh].copy_from_slice(&tmp[..nh]);
            }
        }

        /// `scalar::axpy_rows_many` in tiles of up to 8 rows × 2 heads (`vector::latent`).
        ///
        /// # Safety
        /// The CPU has this module's features; every `xs[s]` has `d = y.len() / H` values and
        /// `p.len() == xs.len() · H`.
        #[target_feature(enable = $feat)]
        pub unsafe fn axpy_rows_many(p: &[f32], xs: &[&[f32]], y: &mut [f32]) {
            let n = xs.len();
            if n == 0 {
                return;
            }
            let heads = p.len() / n;
            let mut s0 = 0;
            while s0 < n {
                let ns = match n - s0 {
                    8.. => 8,
                    4..=7 => 4,
                    _ => 1,
                };
                let mut h0 = 0;
                while h0 + 2 <= heads {
                    match ns {
                        8 => axpy_tile::<8, 2>(p, xs, y, s0, h0),
                        4 => axpy_tile::<4, 2>(p, xs, y, s0, h0),
                        _ => axpy_tile::<1, 2>(p, xs, y, s0, h0),
                    }
                    h0 += 2;
                }
                if h0 < heads {
                    match ns {
                        8 => axpy_tile::<8, 1>(p, xs, y, s0, h0),
                        4 => axpy_tile::<4, 1>(p, xs, y, s0, h0),
                        _ => axpy_tile::<1, 1>(p, xs, y, s0, h0),
                    }
                }
                s0 += ns;
            }
        }

        /// Rows s0..s0+NS into heads h0..h0+NH, every column.
        #[inline]
        #[allow(clippy::needless_range_loop)] // parallel indexing of const-size tiles
        #[target_feature(enable = $feat)]
        unsafe fn axpy_tile<const NS: usize, const NH: usize>(
            p: &[f32],
            xs: &[&[f32]],
            y: &mut [f32],
            s0: usize,
            h0: usize,
        ) {
            let heads = p.len() / xs.len();
            let d = y.len() / heads;
            let py = y.as_mut_ptr();
            let mut xp = [std::ptr::null::<f32>(); NS];
            let mut a = [[0.0f32; NH]; NS];
            for r in 0..NS {
                xp[r] = xs[s0 + r].as_ptr();
                for k in 0..NH {
                    a[r][k] = p[(s0 + r) * heads + h0 + k];
                }
            }
            let mut yp = [std::ptr::null_mut::<f32>(); NH];
            for k in 0..NH {
                yp[k] = py.add((h0 + k) * d);
            }
            // Passes of `U` chunks; U = 4 first (eight chains), then U = 1.
            let mut c = 0;
            c = axpy_pass::<NS, NH, 4>(&a, &xp, &yp, c, d);
            c = axpy_pass::<NS, NH, 1>(&a, &xp, &yp, c, d);
            while c < d {
                for k in 0..NH {
                    let mut v = *yp[k].add(c);
                    for r in 0..NS {
                        v = a[r][k].mul_add(*xp[r].add(c), v);
                    }
                    *yp[k].add(c) = v;
                }
                c += 1;
            }
        }

        /// Columns from `c` in passes of U chunks of LANES while a whole pass fits; returns
        /// the first column not done.
        #[inline]
        #[allow(clippy::needless_range_loop)] // parallel indexing of const-size tiles
        #[target_feature(enable = $feat)]
        unsafe fn axpy_pass<const NS: usize, const NH: usize, const U: usize>(
            a: &[[f32; NH]; NS],
            xp: &[*const f32; NS],
            yp: &[*mut f32; NH],
            mut c: usize,
            d: usize,
        ) -> usize {
            while c + U * $lanes <= d {
                let mut yv: [[$v; U]; NH] = [[$zero(); U]; NH];
                for k in 0..NH {
                    for u in 0..U {
                        yv[k][u] = $load(yp[k].add(c + $lanes * u));
                    }
                }
                for r in 0..NS {
                    let mut xv: [$v; U] = [$zero(); U];
                    for u in 0..U {
                        xv[u] = $load(xp[r].add(c + $lanes * u));
                    }
                    for k in 0..NH {
                        let v = $set1(a[r][k]);
                        for u in 0..U {
                            yv[k][u] = $fma(v, xv[u], yv[k][u]);
                        }
                    }
                }
                for k in 0..NH {
                    for u in 0..U {
                        $store(yp[k].add(c + $lanes * u), yv[k][u]);
                    }
                }
                c += U * $lanes;
            }
            c
        }
    };
}

pub(crate) use latent_kernels;
