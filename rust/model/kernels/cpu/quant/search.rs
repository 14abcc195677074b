//! Scale searches for the quantizers: the range of a block is a poor scale once the levels are
//! few (4 .. 64), so each search tries a grid of candidate scales, fits the best scale (and
//! minimum) to each candidate's levels by weighted least squares, and keeps the fit with the
//! smallest weighted error. The same idea as ggml's `make_qkx2_quants` / `make_qx_quants`.

use super::round_f;

/// Sums kept in 8 independent lanes, added together at the end. A single running sum is a chain
/// of dependent adds (its latency, not the arithmetic, bounded the quantizers); lanes let the
/// compiler vectorize. The blocks searched are 16 or 32 values, whole lanes.
#[derive(Clone, Copy, Default)]
struct Lanes([f32; 8]);

impl Lanes {
    fn total(self) -> f32 {
        let a = self.0;
        ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7]))
    }
}

/// For each value of `x` (with its weight), in lanes of 8: `f(x, w)` summed into `N` sums.
#[inline(always)]
fn lane_sums<const N: usize>(x: &[f32], w: &[f32], f: impl Fn(f32, f32) -> [f32; N]) -> [f32; N] {
    debug_assert!(x.len().is_multiple_of(8) && x.len() == w.len());
    let mut acc = [Lanes::default(); N];
    for (xc, wc) in x.chunks_exact(8).zip(w.chunks_exact(8)) {
        for l in 0..8 {
            let v = f(xc[l], wc[l]);
            for (a, t) in acc.iter_mut().zip(v) {
                a.0[l] += t;
            }
        }
    }
    acc.map(Lanes::total)
}

/// `x ≈ scale * q - min` with `q` in `0..=nmax`, `min >= 0` (ggml's asymmetric K-quant form):
/// returns `(scale, min)`, minimising `sum w (scale q - min - x)^2` over the candidates.
pub(super) fn fit_affine(x: &[f32], w: &[f32], nmax: i32) -> (f32, f32) {
    let lo = x.iter().fold(0f32, |a, &v| a.min(v));
    let hi = x.iter().fold(f32::NEG_INFINITY, |a, &v| a.max(v));
    if hi <= lo || hi.is_nan() {
        return (0.0, -lo);
    }
    let [sw, swx] = lane_sums(x, w, |v, wi| [wi, wi * v]);
    let error = |scale: f32, off: f32, iscale: f32| -> f32 {
        let [e2] = lane_sums(x, w, |v, wi| {
            let q = round_f(iscale * (v - off)).clamp(0.0, nmax as f32);
            let e = scale * q + off - v;
            [wi * e * e]
        });
        e2
    };
    // The plain range fit first: scale = (hi - lo) / nmax, offset lo.
    let mut best_scale = (hi - lo) / nmax as f32;
    let mut best_off = lo;
    let mut best_err = error(best_scale, best_off, 1.0 / best_scale);
    // Candidate inverse scales stretching the range over nmax - 1 .. nmax + 1 levels.
    for step in 0..=20 {
        let iscale = (nmax as f32 - 1.0 + 0.1 * step as f32) / (hi - lo);
        let [sl, sll, slx] = lane_sums(x, w, |v, wi| {
            let q = round_f(iscale * (v - lo)).clamp(0.0, nmax as f32);
            [wi * q, wi * q * q, wi * q * v]
        });
        // Normal equations of min over (scale, off) of sum w (scale q + off - x)^2.
        let det = sw * sll - sl * sl;
        if det <= 0.0 {
            continue;
        }
        let mut scale = (sw * slx - sl * swx) / det;
        let mut off = (sll * swx - sl * slx) / det;
        if off > 0.0 {
            // The format's offset is never positive: refit the scale alone.
            off = 0.0;
            scale = slx / sll;
        }
        if scale <= 0.0 || scale.is_nan() {
            continue;
        }
        let err = error(scale, off, 1.0 / scale);
        if err < best_err {
            (best_scale, best_off, best_err) = (scale, off, err);
        }
    }
    (best_scale, -best_off)
}

/// `x ≈ scale * q` with `q` in `-nmax..=nmax - 1`: returns `scale` (negative when the value of
/// largest magnitude is positive, so that it lands on the extra level `-nmax`), maximising the
/// least-squares gain `(sum w q x)^2 / sum w q^2` over the candidates.
pub(super) fn fit_symmetric(x: &[f32], w: &[f32], nmax: i32) -> f32 {
    let max = x
        .iter()
        .fold(0f32, |a, &v| if v.abs() > a.abs() { v } else { a });
    if max == 0.0 {
        return 0.0;
    }
    let mut best_gain = 0f32;
    let mut best_scale = -max / nmax as f32;
    for step in -9..=9 {
        let iscale = -(nmax as f32 + 0.1 * step as f32) / max;
        let [sqx, sqq] = lane_sums(x, w, |v, wi| {
            let q = round_f(iscale * v).clamp(-nmax as f32, (nmax - 1) as f32);
            [wi * q * v, wi * q * q]
        });
        if sqq > 0.0 && sqx * sqx > best_gain * sqq {
            best_gain = sqx * sqx / sqq;
            best_scale = sqx / sqq;
        }
    }
    best_scale
}

/// Index of the entry of the ascending `table` nearest to `v`.
pub(super) fn nearest_level(table: &[i8; 16], v: f32) -> usize {
    let mut best = 0;
    let mut dist = f32::INFINITY;
    for (i, &t) in table.iter().enumerate() {
        let e = (t as f32 - v).abs();
        if e < dist {
            (best, dist) = (i, e);
        }
    }
    best
}

/// `x ≈ scale * table[i]` for a non-uniform level table (IQ4): returns the scale that
/// minimises `sum w (scale table[i] - x)^2`, each `i` the level nearest `x / scale`, over
/// candidate scales around the one that maps the largest magnitude to the table's end.
pub(super) fn fit_table(x: &[f32], w: &[f32], table: &[i8; 16]) -> f32 {
    let max = x
        .iter()
        .fold(0f32, |a, &v| if v.abs() > a.abs() { v } else { a });
    if max == 0.0 {
        return 0.0;
    }
    let end = table[0] as f32;
    let mut best_gain = 0f32;
    let mut best_scale = max / end;
    for step in -7..=7 {
        let iscale = (end + step as f32) / max;
        let (mut sqx, mut sqq) = (0f32, 0f32);
        for (&v, &wi) in x.iter().zip(w) {
            let q = table[nearest_level(table, iscale * v)] as f32;
            sqx += wi * q * v;
            sqq += wi * q * q;
        }
        if sqq > 0.0 && sqx * sqx > best_gain * sqq {
            best_gain = sqx * sqx / sqq;
            best_scale = sqx / sqq;
        }
    }
    best_scale
}
