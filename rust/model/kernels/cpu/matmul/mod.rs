//! The linear-layer kernel: `y = x · Wᵀ (+ bias)` for every projection of the model.
//!
//! **Batch invariance.** Every output element is computed with one fixed arithmetic per
//! instruction set, whatever the number of tokens `n`, the tiling, the task split or the thread
//! count: a dot product of weight row `r` and token row `t` accumulated in `L` f32 lanes
//! (lane `l` sums the products of columns `c ≡ l (mod L)` in increasing `c`, one FMA each), then
//! reduced by a fixed tree ([`x86`]'s `hsum512` / `hsum256`; the scalar path sums its 8 lanes in
//! order), then the bias added. So a token's output row is bitwise the same whether it is
//! computed alone (decode), in a prefill chunk of any size, or next to any other rows.
//!
//! Two drivers share that arithmetic:
//! - **Stream** (`n <= SMALL_N_MAX` tokens): memory-bandwidth bound. Output rows are split into
//!   coarse rayon tasks; every weight row is streamed from memory once, widened to f32 in
//!   registers and dotted against all `n` input rows. On AVX-512, 4-row x 4-token register
//!   tiles; for 5..=16 tokens and rows of at most 768 columns, 3-row x 8-token tiles, which
//!   widen each weight vector once per 8 tokens (faster at n = 8: docs/benchmarks.md, "Figures
//!   behind code comments").
//! - **Panels** (larger `n`): compute bound. Weights are widened (bf16/f16) or copied (f32) one
//!   panel of rows at a time into a 64-byte aligned per-task f32 scratch panel (allocated once in
//!   [`MatmulScratch`]; widening is exact, so the arithmetic is unchanged), which stays in L2
//!   while a block of tokens passes it. On AVX-512 the register tile is 4 rows x 6 tokens; each
//!   token tile is copied to an aligned buffer and stays in L1 while the panel's row groups
//!   stream past it, in column passes of 768 for long rows (the accumulators parked between
//!   passes: the same FMAs in the same order); on AVX2 the same driver with a 3-row x 4-token
//!   tile (`panel_avx2_f32`). How it compares with the convert-panel + `gemm` path it replaced:
//!   docs/benchmarks.md, "Figures behind code comments".
//!
//! Explicit AVX-512 / AVX2+FMA kernels with a portable scalar fallback, selected at run time.

use super::matmul_bf16dot::{linear_bf16dot, Bf16Out, Bf16Scratch};
use super::quant::linear::{
    dequantized_row, linear_quant, linear_quant_group, Layout, QuantMatRef, QuantOut, QuantScratch,
};
use super::SendPtr;
use super::{MatRef, WeightData};
use rayon::prelude::*;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Up to this many tokens use the stream driver, above it the panel driver (same arithmetic:
/// this is a speed choice only): the two are even at n = 16, and the panel driver is ahead from
/// n = 32 (docs/benchmarks.md, "Figures behind code comments").
pub const SMALL_N_MAX: usize = 32;

/// f32 bytes per panel (at most): a panel stays in L2 while a block of tokens passes it.
const PANEL_BYTES: usize = 1 << 20;
/// f32 bytes of one block of token rows swept over a panel.
const TOKEN_BLOCK_BYTES: usize = 1 << 20;

/// Per-task f32 panels for the panel driver, allocated once at model load.
pub struct MatmulScratch {
    /// The quantized kernels' buffers (activations quantized to 8 bits).
    quant: QuantScratch,
    /// The activation rows rounded to bf16, for bf16 weights on a CPU with bf16 dot products
    /// (empty unless enabled).
    bf16: Bf16Scratch,
    /// One panel of `panel_len` floats (from a 64-byte boundary on) per pool thread.
    panels: Vec<Vec<f32>>,
    panel_len: usize,
    max_cols: usize,
}

impl MatmulScratch {
    /// `threads`: threads of the pool that runs the forward; `max_cols`: the largest `w.cols`
    /// of any matrix that will go through [`linear`] (bf16/f16 matrices with more columns take
    /// the stream driver, f32 ones the panel driver on the unaligned weights: slower, same
    /// bits).
    /// `max_tokens`: the most rows of `x` a quantized matrix will see in one call.
    pub fn new(threads: usize, max_cols: usize, max_tokens: usize) -> Self {
        Self::with_panel_rows(threads, max_cols, max_tokens, panel_rows(max_cols))
    }

    fn with_panel_rows(
        threads: usize,
        max_cols: usize,
        max_tokens: usize,
        panel_rows: usize,
    ) -> Self {
        let threads = threads.max(1);
        let panel_len = panel_rows.max(1) * max_cols;
        Self {
            quant: QuantScratch::new(threads, max_tokens, max_cols),
            bf16: Bf16Scratch::disabled(),
            // 15 floats of slack so that each panel can start on a 64-byte boundary.
            panels: (0..threads).map(|_| vec![0.0; panel_len + 15]).collect(),
            panel_len,
            max_cols,
        }
    }

    /// bf16 weights take the bf16 dot products from now on (when the CPU has them, see
    /// [`super::matmul_bf16dot`]; its buffer for `max_tokens` rows is allocated here).
    pub fn enable_bf16_dot(&mut self, max_tokens: usize) {
        self.bf16 = Bf16Scratch::new(max_tokens, self.max_cols);
    }

    /// Bytes the panels hold (for the device's memory accounting).
    pub fn bytes(&self) -> usize {
        self.panels.iter().map(|p| p.capacity()).sum::<usize>() * std::mem::size_of::<f32>()
            + self.quant.bytes()
            + self.bf16.bytes()
    }
}

/// The 64-byte aligned `len` floats of a scratch panel.
fn aligned(panel: &mut [f32], len: usize) -> &mut [f32] {
    let off = panel.as_ptr().align_offset(64);
    &mut panel[off..off + len]
}

/// Rows per panel for `k` columns: the byte budget, a multiple of 16 in 16..=256.
fn panel_rows(k: usize) -> usize {
    (PANEL_BYTES / (4 * k.max(1))).clamp(16, 256) / 16 * 16
}

/// `y[t*m + r] = sum_c x[t*k + c] * w[r, c] (+ bias[r])` for `t in 0..n`, `m = w.rows`,
/// `k = w.cols`. `x` is `[n, k]` row-major, `y` is `[n, m]` row-major and is overwritten.
/// Each output element's bits depend only on its own row of `x`, row of `w` and bias (see the
/// module doc), never on `n`, the other rows or the thread count.
pub fn linear(
    x: &[f32],
    n: usize,
    w: MatRef,
    bias: Option<&[f32]>,
    y: &mut [f32],
    scratch: &mut MatmulScratch,
) {
    if let Some(w) = quant_matrix(w) {
        linear_quant(x, n, w, bias, y, &mut scratch.quant);
        return;
    }
    if matches!(w.data, WeightData::Bf16(_)) && scratch.bf16.serves(w.cols) {
        linear_bf16dot(x, n, &mut [Bf16Out { w, bias, y }], &mut scratch.bf16);
        return;
    }
    let isa = Isa::detect();
    linear_with(isa, x, n, w, bias, y, scratch);
}

/// One product of a [`linear_group`] call: `y = x · wᵀ (+ bias)`, `y` being `[n, w.rows]`.
pub struct LinearOut<'w, 'y> {
    pub w: MatRef<'w>,
    pub bias: Option<&'w [f32]>,
    pub y: &'y mut [f32],
}

/// Most products in one [`linear_group`] call.
pub const GROUP_MAX: usize = 4;

/// Several products of the same input (`q`, `k` and `v`; `gate` and `up`): each output as
/// [`linear`] computes it, to the bit. For a few tokens (the stream driver), all the products'
/// row chunks go to the threads as one parallel loop: one fork and join per group instead of
/// one per matrix, which is most of a small matrix's time at decode.
pub fn linear_group(x: &[f32], n: usize, outs: &mut [LinearOut], scratch: &mut MatmulScratch) {
    assert!(
        outs.len() <= GROUP_MAX,
        "linear_group: more than {GROUP_MAX} products"
    );
    if !outs.is_empty() && outs.iter().all(|o| quant_matrix(o.w).is_some()) {
        quant_group(x, n, outs, &mut scratch.quant);
        return;
    }
    let k = outs.first().map_or(0, |o| o.w.cols);
    if !outs.is_empty()
        && scratch.bf16.serves(k)
        && outs
            .iter()
            .all(|o| matches!(o.w.data, WeightData::Bf16(_)) && o.w.cols == k)
    {
        bf16_group(x, n, outs, &mut scratch.bf16);
        return;
    }
    let streamed = n > 0 && n <= SMALL_N_MAX && k > 0 && outs.iter().all(|o| o.w.cols == k);
    if !streamed {
        for o in outs.iter_mut() {
            linear(x, n, o.w, o.bias, o.y, scratch);
        }
        return;
    }
    // Task chunks sized for the group's total rows, so that the threads stay balanced across it.
    let total_rows: usize = outs.iter().map(|o| o.w.rows).sum();
    let rpt = rows_per_task(total_rows, k, elem_bytes(outs[0].w.data));
    // What the tasks need of each product, copied out: the tasks write through `y`'s pointer,
    // so they must not hold a reference to the `&mut` slice itself.
    let mut jobs: [Option<GroupJob>; GROUP_MAX] = [None; GROUP_MAX];
    let mut first_task = [0usize; GROUP_MAX + 1];
    for (i, o) in outs.iter_mut().enumerate() {
        check_shapes(x, n, o.w, o.bias, o.y);
        let isa = Isa::detect();
        jobs[i] = Some((isa, o.w, o.bias, SendPtr(o.y.as_mut_ptr())));
        first_task[i + 1] = first_task[i] + o.w.rows.div_ceil(rpt);
    }
    let products = outs.len();
    let work = |ti: usize| {
        let i = (0..products).rfind(|&i| first_task[i] <= ti).unwrap_or(0);
        let Some((isa, w, bias, yp)) = jobs[i] else {
            return;
        };
        let r0 = (ti - first_task[i]) * rpt;
        let r1 = (r0 + rpt).min(w.rows);
        let out = Out {
            y: yp.get(),
            m: w.rows,
            bias,
        };
        // SAFETY: shapes were checked above; rows r0..r1 of every token's output of product i
        // belong to this task alone.
        unsafe { rows_dispatch(isa, w.data, k, r0, r1, x, n, out, Tile::Stream) }
    };
    (0..first_task[products]).into_par_iter().for_each(work);
}

/// A group of quantized products, handed to [`linear_quant_group`] (an array on the stack: the
/// forward pass allocates nothing).
fn quant_group(x: &[f32], n: usize, outs: &mut [LinearOut], scratch: &mut QuantScratch) {
    fn quant<'w, 'y>(o: &'y mut LinearOut<'w, '_>) -> QuantOut<'w, 'y> {
        QuantOut {
            w: quant_matrix(o.w).expect("quant_group takes quantized products only"),
            bias: o.bias,
            y: &mut *o.y,
        }
    }
    match outs {
        [a] => linear_quant_group(x, n, &mut [quant(a)], scratch),
        [a, b] => linear_quant_group(x, n, &mut [quant(a), quant(b)], scratch),
        [a, b, c] => linear_quant_group(x, n, &mut [quant(a), quant(b), quant(c)], scratch),
        [a, b, c, d] => {
            linear_quant_group(x, n, &mut [quant(a), quant(b), quant(c), quant(d)], scratch)
        }
        _ => unreachable!("linear_group: 1..={GROUP_MAX} products"),
    }
}

/// A group of bf16 products, handed to [`linear_bf16dot`] (on the stack, as [`quant_group`]).
fn bf16_group(x: &[f32], n: usize, outs: &mut [LinearOut], scratch: &mut Bf16Scratch) {
    fn out<'w, 'y>(o: &'y mut LinearOut<'w, '_>) -> Bf16Out<'w, 'y> {
        Bf16Out {
            w: o.w,
            bias: o.bias,
            y: &mut *o.y,
        }
    }
    match outs {
        [a] => linear_bf16dot(x, n, &mut [out(a)], scratch),
        [a, b] => linear_bf16dot(x, n, &mut [out(a), out(b)], scratch),
        [a, b, c] => linear_bf16dot(x, n, &mut [out(a), out(b), out(c)], scratch),
        [a, b, c, d] => linear_bf16dot(x, n, &mut [out(a), out(b), out(c), out(d)], scratch),
        _ => unreachable!("linear_group: 1..={GROUP_MAX} products"),
    }
}

/// A quantized matrix as the `quant` kernels take it (`None` for a float one).
fn quant_matrix(w: MatRef) -> Option<QuantMatRef> {
    let (ty, layout, data) = match w.data {
        WeightData::Quant(ty, d) => (ty, Layout::Rows, d),
        WeightData::Interleaved(ty, d) => (ty, Layout::Interleaved, d),
        _ => return None,
    };
    Some(QuantMatRef {
        ty,
        layout,
        data,
        rows: w.rows,
        cols: w.cols,
    })
}

/// One product of a group as its tasks see it: ISA, weights, bias, output pointer.
type GroupJob<'w> = (Isa, MatRef<'w>, Option<&'w [f32]>, SendPtr);

/// Panics (a caller bug, never input) unless `x` is `[n, k]`, `y` is `[n, m]`, the weight data
/// holds `[m, k]` and the bias `[m]`.
fn check_shapes(x: &[f32], n: usize, w: MatRef, bias: Option<&[f32]>, y: &[f32]) {
    let (m, k) = (w.rows, w.cols);
    assert_eq!(x.len(), n * k, "linear: x is not [n, k]");
    assert_eq!(y.len(), n * m, "linear: y is not [n, m]");
    let (wlen, want) = match w.data {
        WeightData::F32(d) => (d.len(), m * k),
        WeightData::F16(d) => (d.len(), m * k),
        WeightData::Bf16(d) => (d.len(), m * k),
        WeightData::Quant(q, d) => (d.len(), m * q.row_bytes(k).unwrap_or(usize::MAX)),
        WeightData::Interleaved(q, d) => (
            d.len(),
            super::quant::interleave::interleaved_len(q, m, k).unwrap_or(usize::MAX),
        ),
    };
    assert_eq!(wlen, want, "linear: weight data is not [rows, cols]");
    if let Some(b) = bias {
        assert_eq!(b.len(), m, "linear: bias is not [rows]");
    }
}

fn linear_with(
    isa: Isa,
    x: &[f32],
    n: usize,
    w: MatRef,
    bias: Option<&[f32]>,
    y: &mut [f32],
    scratch: &mut MatmulScratch,
) {
    let (m, k) = (w.rows, w.cols);
    check_shapes(x, n, w, bias, y);
    if n == 0 || m == 0 {
        return;
    }
    if k == 0 {
        for t in 0..n {
            for r in 0..m {
                y[t * m + r] = bias.map_or(0.0, |b| b[r]);
            }
        }
        return;
    }
    if n <= SMALL_N_MAX {
        linear_stream(isa, x, n, w, bias, y);
        return;
    }
    // A scratch sized for smaller matrices is a caller bug; stay correct (just slower).
    let fits = matches!(w.data, WeightData::F32(_)) || k <= scratch.max_cols;
    debug_assert!(fits, "MatmulScratch too small for k = {k}");
    if fits {
        linear_panels(isa, x, n, w, bias, y, scratch);
    } else {
        linear_stream(isa, x, n, w, bias, y);
    }
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Isa {
    #[cfg(target_arch = "x86_64")]
    Avx512,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    Scalar,
}

impl Isa {
    /// The ISA of every call on this CPU. Both drivers of one call use the same one (the panel
    /// driver too, although it reads widened f32), so the arithmetic is one per CPU.
    fn detect() -> Isa {
        #[cfg(target_arch = "x86_64")]
        {
            let cpu = super::isa::cpu();
            if cpu.avx512 {
                return Isa::Avx512;
            }
            if cpu.avx2 {
                return Isa::Avx2;
            }
        }
        Isa::Scalar
    }
}

/// Output rows per rayon task: at least ~64 KiB of weights (so scheduling overhead is noise)
/// and, for big matrices, about 1/16 of a thread's share (few, long streams keep the hardware
/// prefetchers busy); but at least ~4 tasks per thread so both cores stay busy to the end.
fn rows_per_task(m: usize, k: usize, elem_bytes: usize) -> usize {
    let row_bytes = (k * elem_bytes).max(1);
    let threads = rayon::current_num_threads().max(1);
    let total = row_bytes * m;
    let want_bytes = (64 * 1024).max(total / (16 * threads));
    let want = want_bytes.div_ceil(row_bytes).max(4);
    let cap = m.div_ceil(4 * threads).max(4);
    want.min(cap).div_ceil(4) * 4
}

/// Bytes of one weight element as stored.
fn elem_bytes(data: WeightData) -> usize {
    match data {
        WeightData::F32(_) => 4,
        WeightData::F16(_) | WeightData::Bf16(_) => 2,
        WeightData::Quant(..) | WeightData::Interleaved(..) => {
            unreachable!("quantized weights take quant::linear")
        }
    }
}

/// Stream driver: parallel over coarse chunks of output rows, each weight row read once.
fn linear_stream(isa: Isa, x: &[f32], n: usize, w: MatRef, bias: Option<&[f32]>, y: &mut [f32]) {
    let (m, k) = (w.rows, w.cols);
    let rpt = rows_per_task(m, k, elem_bytes(w.data));
    let tasks = m.div_ceil(rpt);
    let yp = SendPtr(y.as_mut_ptr());
    let work = |ti: usize| {
        let r0 = ti * rpt;
        let r1 = (r0 + rpt).min(m);
        let out = Out {
            y: yp.get(),
            m,
            bias,
        };
        // SAFETY: shapes were checked in `linear`; rows r0..r1 of every token's output belong
        // to this task alone.
        unsafe { rows_dispatch(isa, w.data, k, r0, r1, x, n, out, Tile::Stream) }
    };
    if tasks == 1 {
        work(0);
    } else {
        (0..tasks).into_par_iter().for_each(work);
    }
}

/// How a row driver walks its block (a speed choice: the arithmetic is the same).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Tile {
    /// Few tokens, weights streamed from memory once: rows outer, tokens inner.
    Stream,
    /// Many tokens over a cached f32 panel: tokens outer, rows inner (AVX-512: 4 rows x 6
    /// tokens, long rows in column passes).
    Panel,
}

/// Computes output rows `r0..r1` (rows of `data`) for all `n` tokens of `x` into `out`.
///
/// # Safety
/// `x` has `n*k` elements, `data` has at least `r1*k`, `r1` rows of every token's output lie
/// inside `out` and belong to the caller, and the CPU supports `isa`.
#[allow(clippy::too_many_arguments)]
unsafe fn rows_dispatch(
    isa: Isa,
    data: WeightData,
    k: usize,
    r0: usize,
    r1: usize,
    x: &[f32],
    n: usize,
    out: Out,
    tile: Tile,
) {
    debug_assert!(x.len() >= n * k);
    #[cfg(not(target_arch = "x86_64"))]
    let _ = tile;
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => {
            let xp = x.as_ptr();
            match data {
                WeightData::F32(d) if tile == Tile::Panel => {
                    debug_assert!(d.len() >= r1 * k);
                    let out = out.offset(0, r0);
                    x86::panel_avx512_f32(d.as_ptr().add(r0 * k), k, r1 - r0, xp, n, out)
                }
                WeightData::F32(d) => {
                    debug_assert!(d.len() >= r1 * k);
                    x86::rows_avx512_f32(d.as_ptr(), k, r0, r1, xp, n, out)
                }
                WeightData::F16(d) => {
                    debug_assert!(d.len() >= r1 * k);
                    x86::rows_avx512_f16(d.as_ptr().cast(), k, r0, r1, xp, n, out)
                }
                WeightData::Bf16(d) => {
                    debug_assert!(d.len() >= r1 * k);
                    x86::rows_avx512_bf16(d.as_ptr().cast(), k, r0, r1, xp, n, out)
                }
                WeightData::Quant(..) | WeightData::Interleaved(..) => {
                    unreachable!("quantized weights take quant::linear")
                }
            }
        }
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => match data {
            WeightData::F32(d) if tile == Tile::Panel => {
                debug_assert!(d.len() >= r1 * k);
                let out = out.offset(0, r0);
                x86::panel_avx2_f32(d.as_ptr().add(r0 * k), k, r1 - r0, x.as_ptr(), n, out)
            }
            WeightData::F32(d) => {
                debug_assert!(d.len() >= r1 * k);
                x86::rows_avx2_f32(d.as_ptr(), k, r0, r1, x.as_ptr(), n, out)
            }
            WeightData::F16(d) => {
                debug_assert!(d.len() >= r1 * k);
                x86::rows_avx2_f16(d.as_ptr().cast(), k, r0, r1, x.as_ptr(), n, out)
            }
            WeightData::Bf16(d) => {
                debug_assert!(d.len() >= r1 * k);
                x86::rows_avx2_bf16(d.as_ptr().cast(), k, r0, r1, x.as_ptr(), n, out)
            }
            WeightData::Quant(..) | WeightData::Interleaved(..) => {
                unreachable!("quantized weights take quant::linear")
            }
        },
        Isa::Scalar => match data {
            WeightData::F32(d) => rows_scalar(d, |v| v, k, r0, r1, x, n, out),
            WeightData::F16(d) => rows_scalar(d, |v| v.to_f32(), k, r0, r1, x, n, out),
            WeightData::Bf16(d) => rows_scalar(d, |v| v.to_f32(), k, r0, r1, x, n, out),
            WeightData::Quant(..) | WeightData::Interleaved(..) => {
                unreachable!("quantized weights take quant::linear")
            }
        },
    }
}

/// Where a block of results goes: output row `r` of token `t` is `y[t*m + r]`, plus `bias[r]`.
#[derive(Clone, Copy)]
struct Out<'a> {
    y: *mut f32,
    m: usize,
    bias: Option<&'a [f32]>,
}

impl Out<'_> {
    /// Stores `o[t][r]` as output row `r0 + r` of token `t0 + t`.
    ///
    /// # Safety
    /// The block lies inside `y` and belongs to the calling task.
    #[inline(always)]
    unsafe fn store<const R: usize, const T: usize>(self, o: &[[f32; R]; T], t0: usize, r0: usize) {
        for (t, row) in o.iter().enumerate() {
            for (r, &v) in row.iter().enumerate() {
                let b = self.bias.map_or(0.0, |b| b[r0 + r]);
                *self.y.add((t0 + t) * self.m + r0 + r) = v + b;
            }
        }
    }

    /// The same destination seen from output row `r0` and token `t0` on.
    ///
    /// # Safety
    /// The result stays inside `y`.
    unsafe fn offset(self, t0: usize, r0: usize) -> Self {
        Out {
            y: self.y.add(t0 * self.m + r0),
            m: self.m,
            bias: self.bias.map(|b| &b[r0..]),
        }
    }
}

/// Portable fallback: 8 independent partial sums per dot (lane `l` takes columns
/// `c ≡ l (mod 8)` of the 8-aligned body), summed in lane order, then the tail in order.
#[allow(clippy::too_many_arguments)]
unsafe fn rows_scalar<E: Copy>(
    w: &[E],
    cvt: impl Fn(E) -> f32,
    k: usize,
    r0: usize,
    r1: usize,
    x: &[f32],
    n: usize,
    out: Out,
) {
    for r in r0..r1 {
        let wr = &w[r * k..(r + 1) * k];
        for t in 0..n {
            let xr = &x[t * k..(t + 1) * k];
            let mut acc = [0f32; 8];
            let mut wc = wr.chunks_exact(8);
            let mut xc = xr.chunks_exact(8);
            for (a, b) in (&mut wc).zip(&mut xc) {
                for l in 0..8 {
                    acc[l] += cvt(a[l]) * b[l];
                }
            }
            let mut s = 0f32;
            for a in acc {
                s += a;
            }
            for (a, b) in wc.remainder().iter().zip(xc.remainder()) {
                s += cvt(*a) * b;
            }
            out.store(&[[s]], t, r);
        }
    }
}
#[cfg(target_arch = "x86_64")]
mod x86;

/// Widens bf16/f16 rows to f32 (`dst.len()` elements); exact, so the panel driver computes what
/// the stream driver computes from the raw weights.
fn convert_rows(data: WeightData, start: usize, dst: &mut [f32]) {
    let len = dst.len();
    match data {
        WeightData::F32(d) => dst.copy_from_slice(&d[start..start + len]),
        WeightData::Bf16(d) => {
            let src = &d[start..start + len];
            #[cfg(target_arch = "x86_64")]
            if Isa::detect() == Isa::Avx512 {
                // SAFETY: AVX-512 F/BW/VL were detected; lengths are equal.
                unsafe { x86::bf16_to_f32_avx512(src, dst) };
                return;
            }
            // Plain shift: auto-vectorises without feature detection.
            for (o, v) in dst.iter_mut().zip(src) {
                *o = f32::from_bits((v.to_bits() as u32) << 16);
            }
        }
        WeightData::F16(d) => {
            let src = &d[start..start + len];
            #[cfg(target_arch = "x86_64")]
            if Isa::detect() == Isa::Avx512 {
                // SAFETY: AVX-512 F/BW/VL were detected; lengths are equal.
                unsafe { x86::f16_to_f32_avx512(src, dst) };
                return;
            }
            // half's slice conversion uses F16C itself when the CPU has it.
            use half::slice::HalfFloatSliceExt;
            src.convert_to_f32_slice(dst);
        }
        WeightData::Quant(..) | WeightData::Interleaved(..) => {
            unreachable!("quantized weights take quant::linear")
        }
    }
}

/// Panel driver (many tokens).
///
/// The matrix is cut into panels of at most `panel_rows(k)` rows, as many as a multiple of the
/// thread count, and the tokens into blocks of `TOKEN_BLOCK_BYTES`; a work item is one (token
/// block, panel) pair: the panel is widened (or copied) into the task's aligned scratch panel,
/// and the block's tokens pass it.
///
/// Instead of locating a panel through `rayon::current_thread_index()`, we start exactly one
/// task per scratch panel; each task owns its panel (a disjoint `&mut`) and pulls panel indices
/// from a shared atomic counter until the matrix is done. This is safe whatever pool we run in
/// (more or fewer threads than `threads`, or no pool at all), needs no Mutex, and still balances
/// load dynamically.
fn linear_panels(
    isa: Isa,
    x: &[f32],
    n: usize,
    w: MatRef,
    bias: Option<&[f32]>,
    y: &mut [f32],
    scratch: &mut MatmulScratch,
) {
    let (m, k) = (w.rows, w.cols);
    // f32 weights too are copied into the (aligned) scratch panels when they fit: the mapped
    // weights are not 64-byte aligned, and split loads would halve the L1 bandwidth.
    let in_place = k > scratch.max_cols;
    let cap = if in_place {
        panel_rows(k)
    } else {
        panel_rows(k).min(scratch.panel_len / k).max(1)
    };
    // As few panels as fit, but a multiple of the thread count, of equal height (a multiple of
    // 4 rows, the register tile's): every thread gets the same work.
    let threads = rayon::current_num_threads().max(1);
    let npanels = m.div_ceil(cap).next_multiple_of(threads);
    let prows = m.div_ceil(npanels).next_multiple_of(4).min(cap);
    let npanels = m.div_ceil(prows);
    // Tokens per block: the byte budget, a multiple of the 6-token tile.
    let nb = (TOKEN_BLOCK_BYTES / (4 * k)).max(6) / 6 * 6;
    let nblocks = n.div_ceil(nb);
    // Work items in block-major order: the threads share one block of tokens at a time.
    let items = nblocks * npanels;
    let next = AtomicUsize::new(0);
    let yp = SendPtr(y.as_mut_ptr());
    let data = w.data;
    let scratch_len = scratch.panel_len;
    let task = |panel: &mut [f32]| loop {
        let i = next.fetch_add(1, Ordering::Relaxed);
        if i >= items {
            break;
        }
        let (b, p) = (i / npanels, i % npanels);
        let r0 = p * prows;
        let rows = prows.min(m - r0);
        let buf: &[f32] = match data {
            WeightData::F32(d) if in_place => &d[r0 * k..(r0 + rows) * k],
            _ => {
                let buf = &mut aligned(panel, scratch_len)[..rows * k];
                convert_rows(data, r0 * k, buf);
                buf
            }
        };
        let t0 = b * nb;
        let tn = nb.min(n - t0);
        let out = Out {
            y: yp.get(),
            m,
            bias,
        };
        // SAFETY: shapes were checked in `linear_with`; output rows r0..r0 + rows of tokens
        // t0..t0 + tn lie inside y and belong to this work item alone; `buf` holds `rows`
        // rows of k.
        unsafe {
            rows_dispatch(
                isa,
                WeightData::F32(buf),
                k,
                0,
                rows,
                &x[t0 * k..(t0 + tn) * k],
                tn,
                out.offset(t0, r0),
                Tile::Panel,
            )
        };
    };
    let tasks = items.min(threads);
    if in_place {
        (0..tasks).into_par_iter().for_each(|_| task(&mut []));
    } else {
        let tasks = tasks.min(scratch.panels.len());
        scratch.panels[..tasks]
            .par_iter_mut()
            .for_each(|panel| task(panel));
    }
}

/// Plain reference: f64 accumulation, one element at a time.
pub fn reference(x: &[f32], n: usize, w: MatRef, bias: Option<&[f32]>, y: &mut [f32]) {
    let (m, k) = (w.rows, w.cols);
    let dequantized: Vec<f32> = match quant_matrix(w) {
        Some(q) if k > 0 => {
            let mut out = vec![0.0; m * k];
            for (r, row) in out.chunks_exact_mut(k).enumerate() {
                dequantized_row(&q, r, row);
            }
            out
        }
        _ => Vec::new(),
    };
    let get = |i: usize| -> f64 {
        match w.data {
            WeightData::F32(d) => d[i] as f64,
            WeightData::F16(d) => d[i].to_f64(),
            WeightData::Bf16(d) => d[i].to_f64(),
            WeightData::Quant(..) | WeightData::Interleaved(..) => dequantized[i] as f64,
        }
    };
    for t in 0..n {
        for r in 0..m {
            let mut s = bias.map_or(0.0, |b| b[r] as f64);
            for c in 0..k {
                s += x[t * k + c] as f64 * get(r * k + c);
            }
            y[t * m + r] = s as f32;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::{bf16, f16};

    use crate::model::kernels::cpu::test_rng::{thread_pools, Rng};

    /// Tolerance: 1e-4 relative to sum |x*w| (the scale of rounding in any summation order).
    fn check(x: &[f32], n: usize, w: MatRef, bias: Option<&[f32]>, got: &[f32]) {
        let (m, k) = (w.rows, w.cols);
        let mut want = vec![0.0; n * m];
        reference(x, n, w, bias, &mut want);
        let absw = |i: usize| -> f64 {
            match w.data {
                WeightData::F32(d) => d[i].abs() as f64,
                WeightData::F16(d) => d[i].to_f64().abs(),
                WeightData::Bf16(d) => d[i].to_f64().abs(),
                WeightData::Quant(..) | WeightData::Interleaved(..) => {
                    unreachable!("the tests here use element types")
                }
            }
        };
        for t in 0..n {
            for r in 0..m {
                let scale: f64 = (0..k)
                    .map(|c| (x[t * k + c] as f64).abs() * absw(r * k + c))
                    .sum::<f64>()
                    + 1e-3;
                let (g, e) = (got[t * m + r] as f64, want[t * m + r] as f64);
                assert!(
                    (g - e).abs() <= 1e-4 * scale,
                    "n={n} m={m} k={k} t={t} r={r}: got {g}, want {e}"
                );
            }
        }
    }

    fn run_all(n: usize, m: usize, k: usize, with_bias: bool, seed: u64) {
        let mut rng = Rng(seed);
        let x = rng.vec(n * k);
        let wf = rng.vec(m * k);
        let bias = rng.vec(m);
        let bias = with_bias.then_some(&bias[..]);
        let wh: Vec<f16> = wf.iter().map(|&v| f16::from_f32(v)).collect();
        let wb: Vec<bf16> = wf.iter().map(|&v| bf16::from_f32(v)).collect();
        // Small panels so multi-panel splitting is exercised at test sizes.
        let mut scratch = MatmulScratch::with_panel_rows(rayon::current_num_threads(), k, 1, 16);
        for data in [
            WeightData::F32(&wf),
            WeightData::F16(&wh),
            WeightData::Bf16(&wb),
        ] {
            let w = MatRef {
                data,
                rows: m,
                cols: k,
            };
            let mut y = vec![f32::NAN; n * m];
            linear(&x, n, w, bias, &mut y, &mut scratch);
            check(&x, n, w, bias, &y);
            // Every ISA path this CPU has, including the ones dispatch would not pick, through
            // both drivers whatever n is: each is accurate, and the two agree to the bit.
            for isa in available_isas() {
                let mut y2 = vec![f32::NAN; n * m];
                linear_stream(isa, &x, n, w, bias, &mut y2);
                check(&x, n, w, bias, &y2);
                let mut y3 = vec![f32::NAN; n * m];
                linear_panels(isa, &x, n, w, bias, &mut y3, &mut scratch);
                check(&x, n, w, bias, &y3);
                assert_eq!(
                    bits(&y2),
                    bits(&y3),
                    "{isa:?}: stream and panel drivers differ"
                );
            }
        }
    }

    fn bits(y: &[f32]) -> Vec<u32> {
        y.iter().map(|v| v.to_bits()).collect()
    }

    fn available_isas() -> Vec<Isa> {
        #[cfg_attr(not(target_arch = "x86_64"), allow(unused_mut))]
        let mut v = vec![Isa::Scalar];
        #[cfg(target_arch = "x86_64")]
        {
            if super::super::isa::cpu().avx2 {
                v.push(Isa::Avx2);
            }
            if Isa::detect() == Isa::Avx512 {
                v.push(Isa::Avx512);
            }
        }
        v
    }

    #[test]
    fn odd_shapes_all_dtypes() {
        for (i, &n) in [1usize, 3, 8, 33, 130].iter().enumerate() {
            run_all(n, 45, 67, i % 2 == 0, 1 + i as u64);
            run_all(n, 45, 67, i % 2 == 1, 100 + i as u64);
        }
    }

    #[test]
    fn aligned_and_multi_panel_shapes() {
        run_all(1, 203, 128, true, 7);
        run_all(5, 130, 96, false, 8);
        run_all(20, 150, 33, true, 9);
        run_all(2, 7, 16, false, 10);
        run_all(4, 3, 1, true, 11);
    }

    #[test]
    fn single_panel_scratch_and_empty() {
        let mut rng = Rng(3);
        let (n, m, k) = (20, 9, 40);
        let x = rng.vec(n * k);
        let wb: Vec<bf16> = rng.vec(m * k).into_iter().map(bf16::from_f32).collect();
        let w = MatRef {
            data: WeightData::Bf16(&wb),
            rows: m,
            cols: k,
        };
        let mut y = vec![0.0; n * m];
        // n == 0 is a no-op.
        linear(&[], 0, w, None, &mut [], &mut MatmulScratch::new(1, k, 1));
        let mut scratch = MatmulScratch::new(1, k, 1);
        linear(&x, n, w, None, &mut y, &mut scratch);
        check(&x, n, w, None, &y);
        // More tasks than panels would need, odd panel height.
        let mut y2 = vec![0.0; n * m];
        linear_panels(
            Isa::detect(),
            &x,
            n,
            w,
            None,
            &mut y2,
            &mut MatmulScratch::with_panel_rows(3, k, 1, 7),
        );
        check(&x, n, w, None, &y2);
    }

    /// With the bf16 dot products enabled, `linear` and `linear_group` on bf16 weights give
    /// `linear_bf16dot`'s bits (rounded activations: they differ from the f32 path's); f32
    /// weights keep the f32 path.
    #[test]
    fn enabled_bf16_dot_takes_bf16_weights() {
        use crate::model::kernels::cpu::matmul_bf16dot::{
            self, linear_bf16dot, Bf16Out, Bf16Scratch,
        };
        if !matmul_bf16dot::available() {
            return;
        }
        let mut rng = Rng(9);
        let (n, m, k) = (5, 21, 96);
        let x = rng.vec(n * k);
        let wf = rng.vec(m * k);
        let wb: Vec<bf16> = wf.iter().map(|&v| bf16::from_f32(v)).collect();
        let w = MatRef {
            data: WeightData::Bf16(&wb),
            rows: m,
            cols: k,
        };
        let mut want = vec![0f32; n * m];
        let mut bs = Bf16Scratch::new(n, k);
        linear_bf16dot(
            &x,
            n,
            &mut [Bf16Out {
                w,
                bias: None,
                y: &mut want,
            }],
            &mut bs,
        );
        let mut f32_path = vec![0f32; n * m];
        linear(
            &x,
            n,
            w,
            None,
            &mut f32_path,
            &mut MatmulScratch::new(2, k, n),
        );
        assert_ne!(bits(&f32_path), bits(&want), "the two arithmetics differ");
        let mut scratch = MatmulScratch::new(2, k, n);
        scratch.enable_bf16_dot(n);
        let mut y = vec![0f32; n * m];
        linear(&x, n, w, None, &mut y, &mut scratch);
        assert_eq!(bits(&y), bits(&want));
        let (mut y1, mut y2) = (vec![0f32; n * m], vec![0f32; n * m]);
        linear_group(
            &x,
            n,
            &mut [
                LinearOut {
                    w,
                    bias: None,
                    y: &mut y1,
                },
                LinearOut {
                    w,
                    bias: None,
                    y: &mut y2,
                },
            ],
            &mut scratch,
        );
        assert_eq!(bits(&y1), bits(&want));
        assert_eq!(bits(&y2), bits(&want));
        let wf32 = MatRef {
            data: WeightData::F32(&wf),
            rows: m,
            cols: k,
        };
        let (mut a, mut b) = (vec![0f32; n * m], vec![0f32; n * m]);
        linear(&x, n, wf32, None, &mut a, &mut scratch);
        linear(&x, n, wf32, None, &mut b, &mut MatmulScratch::new(2, k, n));
        assert_eq!(bits(&a), bits(&b));
    }

    /// The 16-at-once reduction adds the same lane pairs as the one-accumulator tree.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn reduction_trees_agree() {
        use std::arch::x86_64::*;
        if Isa::detect() != Isa::Avx512 {
            return;
        }
        let mut rng = Rng(5);
        for _ in 0..100 {
            // Mixed magnitudes, so that a different order of additions would show.
            let vals: Vec<f32> = (0..256)
                .map(|i| rng.signed() * [1.0, 1e-4, 3e3, 1e7][i % 4])
                .collect();
            // SAFETY: AVX-512 was detected; every load reads 16 of the 256 values.
            unsafe {
                let v: [__m512; 16] =
                    std::array::from_fn(|i| _mm512_loadu_ps(vals[16 * i..].as_ptr()));
                let mut lanes = [0f32; 16];
                _mm512_storeu_ps(lanes.as_mut_ptr(), x86::hsum512_x16(&v));
                for (i, vi) in v.iter().enumerate() {
                    let one = x86::hsum512(*vi);
                    assert_eq!(lanes[4 * (i % 4) + i / 4].to_bits(), one.to_bits(), "{i}");
                }
            }
        }
    }

    /// A token's output row is bitwise the same whatever else shares the call: n = 1 (decode),
    /// 5, 8, 9, 16 (the stream driver's 8-token tiles when k <= 768), 32 (the last
    /// stream-driver size), 33, 64, 65 and 300 (panel driver; at 300, two token blocks), at
    /// varying places among random neighbours, on 1 to 3 threads; every dtype, every ISA this
    /// CPU has, with and without bias. k = 1100 has a masked (AVX-512) and a scalar (AVX2) tail
    /// and takes two column passes; k = 700 takes the 8-token tiles (also with a tail); m = 45
    /// ends in single-row blocks of both row-group sizes (4 and 3).
    #[test]
    fn linear_rows_are_batch_invariant() {
        for k in [1100, 700] {
            rows_are_batch_invariant(45, k);
        }
    }

    fn rows_are_batch_invariant(m: usize, k: usize) {
        let mut rng = Rng(21 + k as u64);
        let target = rng.vec(k);
        let wf = rng.vec(m * k);
        let bias = rng.vec(m);
        let wh: Vec<f16> = wf.iter().map(|&v| f16::from_f32(v)).collect();
        let wb: Vec<bf16> = wf.iter().map(|&v| bf16::from_f32(v)).collect();
        let pools = thread_pools(&[1, 2, 3]);
        for data in [
            WeightData::F32(&wf),
            WeightData::F16(&wh),
            WeightData::Bf16(&wb),
        ] {
            let w = MatRef {
                data,
                rows: m,
                cols: k,
            };
            for isa in available_isas() {
                for with_bias in [false, true] {
                    let bias = with_bias.then_some(&bias[..]);
                    let mut alone = vec![f32::NAN; m];
                    let mut scratch = MatmulScratch::with_panel_rows(3, k, 1, 16);
                    linear_with(isa, &target, 1, w, bias, &mut alone, &mut scratch);
                    check(&target, 1, w, bias, &alone);
                    // 1 and 2 tokens: one row at a time (AVX2: 1); 3 and 4: 4-row groups; 5
                    // to 16: the wide tiles; past them the panels.
                    for (i, &n) in [1usize, 2, 3, 4, 5, 8, 9, 16, 32, 33, 64, 65, 300]
                        .iter()
                        .enumerate()
                    {
                        for at in [0, n / 2, n - 1, (7 * i + 3) % n] {
                            let mut x = rng.vec(n * k);
                            x[at * k..(at + 1) * k].copy_from_slice(&target);
                            for pool in &pools {
                                let mut y = vec![f32::NAN; n * m];
                                pool.install(|| {
                                    linear_with(isa, &x, n, w, bias, &mut y, &mut scratch)
                                });
                                assert_eq!(
                                    bits(&y[at * m..(at + 1) * m]),
                                    bits(&alone),
                                    "{isa:?} {data:?}: n={n}, token at {at}, {} threads",
                                    pool.current_num_threads()
                                );
                            }
                        }
                    }
                }
            }
        }
    }

    /// A group's outputs equal, to the bit, each product computed alone by `linear`: products
    /// of different heights (one ending in single-row blocks), with and without bias, every
    /// dtype, at decode and stream sizes (one parallel loop over the group) and past them
    /// (one call per product), on 1 to 3 threads. An empty group is a no-op.
    #[test]
    fn linear_group_equals_separate_products() {
        let k = 96;
        let heights = [45usize, 16, 7, 130];
        let mut rng = Rng(33);
        let wf: Vec<Vec<f32>> = heights.iter().map(|&m| rng.vec(m * k)).collect();
        let biases: Vec<Vec<f32>> = heights.iter().map(|&m| rng.vec(m)).collect();
        let wh: Vec<Vec<f16>> = wf
            .iter()
            .map(|w| w.iter().map(|&v| f16::from_f32(v)).collect())
            .collect();
        let wb: Vec<Vec<bf16>> = wf
            .iter()
            .map(|w| w.iter().map(|&v| bf16::from_f32(v)).collect())
            .collect();
        let pools = thread_pools(&[1, 2, 3]);
        let mut scratch = MatmulScratch::with_panel_rows(3, k, 1, 16);
        linear_group(&[], 0, &mut [], &mut scratch);
        for dtype in 0..3 {
            let mats: Vec<MatRef> = (0..heights.len())
                .map(|i| MatRef {
                    data: match dtype {
                        0 => WeightData::F32(&wf[i]),
                        1 => WeightData::F16(&wh[i]),
                        _ => WeightData::Bf16(&wb[i]),
                    },
                    rows: heights[i],
                    cols: k,
                })
                .collect();
            for products in 1..=GROUP_MAX {
                for &n in &[1usize, 3, 8, 16, 32, 40] {
                    let x = rng.vec(n * k);
                    let bias = |i: usize| i.is_multiple_of(2).then_some(&biases[i][..]);
                    let alone: Vec<Vec<f32>> = (0..products)
                        .map(|i| {
                            let mut y = vec![f32::NAN; n * heights[i]];
                            linear(&x, n, mats[i], bias(i), &mut y, &mut scratch);
                            check(&x, n, mats[i], bias(i), &y);
                            y
                        })
                        .collect();
                    for pool in &pools {
                        let mut ys: Vec<Vec<f32>> = (0..products)
                            .map(|i| vec![f32::NAN; n * heights[i]])
                            .collect();
                        let mut outs: Vec<LinearOut> = ys
                            .iter_mut()
                            .enumerate()
                            .map(|(i, y)| LinearOut {
                                w: mats[i],
                                bias: bias(i),
                                y,
                            })
                            .collect();
                        pool.install(|| linear_group(&x, n, &mut outs, &mut scratch));
                        for i in 0..products {
                            assert_eq!(
                                bits(&ys[i]),
                                bits(&alone[i]),
                                "dtype {dtype}: product {i} of {products}, n={n}, {} threads",
                                pool.current_num_threads()
                            );
                        }
                    }
                }
            }
        }
    }
}

/// Speed checks (not run by default): `cargo test --release -- --ignored --nocapture timing`.
#[cfg(test)]
mod timing {
    use super::*;
    use crate::model::kernels::cpu::test_rng::best_of;
    use half::bf16;
    use std::time::Instant;

    #[test]
    #[ignore]
    fn timing_linear() {
        let threads = rayon::current_num_threads();
        for &(m, k, reps) in &[
            (49152usize, 576usize, 40),
            (1536, 576, 300),
            (576, 1536, 300),
        ] {
            let w: Vec<bf16> = (0..m * k)
                .map(|i| bf16::from_f32((i % 17) as f32 * 0.01))
                .collect();
            let mat = MatRef {
                data: WeightData::Bf16(&w),
                rows: m,
                cols: k,
            };
            let x = vec![0.5f32; 64 * k];
            let mut y = vec![0.0f32; 64 * m];
            let mut scratch = MatmulScratch::new(threads, k, 512);
            for &n in &[1usize, 2, 4, 8, 12, 16, 24, 32, 64] {
                if m > 10000 && n > 1 {
                    break;
                }
                let isa = Isa::detect();
                let ts = best_of(reps, || {
                    linear_stream(isa, &x[..n * k], n, mat, None, &mut y[..n * m])
                });
                let tp = best_of(reps, || {
                    linear_panels(
                        isa,
                        &x[..n * k],
                        n,
                        mat,
                        None,
                        &mut y[..n * m],
                        &mut scratch,
                    )
                });
                println!(
                    "bf16 [{m},{k}] n={n:2}: stream {:8.1} us ({:5.1} GB/s)  panels {:8.1} us",
                    ts * 1e6,
                    (m * k * 2) as f64 / ts / 1e9,
                    tp * 1e6
                );
            }
        }
    }

    /// Stream vs panel driver (bf16 and f32 weights) across token counts, on the pool's threads.
    #[test]
    #[ignore]
    fn timing_prefill() {
        let threads = rayon::current_num_threads();
        let isa = Isa::detect();
        for &(m, k) in &[
            (1536usize, 576usize),
            (576, 1536),
            (8192, 2048),
            (2048, 8192),
        ] {
            let wf: Vec<f32> = (0..m * k).map(|i| (i % 17) as f32 * 0.01).collect();
            let w: Vec<bf16> = wf.iter().map(|&v| bf16::from_f32(v)).collect();
            let mat = MatRef {
                data: WeightData::Bf16(&w),
                rows: m,
                cols: k,
            };
            let matf = MatRef {
                data: WeightData::F32(&wf),
                rows: m,
                cols: k,
            };
            let x = vec![0.5f32; 512 * k];
            let mut y = vec![0.0f32; 512 * m];
            let mut scratch = MatmulScratch::new(threads, k, 512);
            for &n in &[16usize, 32, 48, 64, 128, 512] {
                let (xs, ys) = (&x[..n * k], &mut y[..n * m]);
                let ts = best_of(20, || linear_stream(isa, xs, n, mat, None, ys));
                let tp = best_of(20, || {
                    linear_panels(isa, xs, n, mat, None, ys, &mut scratch)
                });
                let tf = best_of(20, || {
                    linear_panels(isa, xs, n, matf, None, ys, &mut scratch)
                });
                let gf = |t: f64| (2 * n * m * k) as f64 / t / 1e9;
                println!(
                    "[{m},{k}] n={n:3}: bf16 stream {:6.3} ms ({:5.1} GF/s) bf16 panels {:6.3} ms \
                     ({:5.1}) f32 panels {:6.3} ms ({:5.1})",
                    ts * 1e3,
                    gf(ts),
                    tp * 1e3,
                    gf(tp),
                    tf * 1e3,
                    gf(tf)
                );
            }
        }
    }

    /// Plain parallel read of the same bytes (the bandwidth ceiling), interleaved with the
    /// kernel so both see the same machine load.
    fn read_all(w: &[u16]) -> u64 {
        w.par_chunks(1 << 16)
            .map(|c| {
                let mut acc = [0u32; 32];
                let mut it = c.chunks_exact(32);
                for ch in &mut it {
                    for l in 0..32 {
                        acc[l] = acc[l].wrapping_add(ch[l] as u32);
                    }
                }
                acc.iter().map(|&v| v as u64).sum::<u64>()
            })
            .sum()
    }

    /// A decode step's float-weight products from memory (`copies` distinct matrices in turn,
    /// 512 MiB in all): the stream driver (f32 inputs) against the bf16-dot kernel, which
    /// reads its rows the same way (on a CPU with bf16 dot products).
    /// `TIMING_SHAPE="m k n"` (default 8192 2048 1); `TIMING_AVX2=1` forces the AVX2 driver.
    #[test]
    #[ignore]
    fn timing_decode_from_memory() {
        use crate::model::kernels::cpu::matmul_bf16dot::{
            available, linear_bf16dot, Bf16Out, Bf16Scratch,
        };
        if !available() {
            return;
        }
        let shape: Vec<usize> = std::env::var("TIMING_SHAPE")
            .unwrap_or_else(|_| "8192 2048 1".into())
            .split_whitespace()
            .map(|v| v.parse().expect("TIMING_SHAPE: m k n"))
            .collect();
        let (m, k, n) = (shape[0], shape[1], shape[2]);
        let isa = match std::env::var_os("TIMING_AVX2") {
            #[cfg(target_arch = "x86_64")]
            Some(_) => Isa::Avx2,
            _ => Isa::detect(),
        };
        let copies = ((512 << 20) / (m * k * 2)).max(1);
        let w: Vec<bf16> = (0..m * k * copies)
            .map(|i| bf16::from_f32((i % 17) as f32 * 0.01))
            .collect();
        let x = vec![0.5f32; k * n];
        let mut y = vec![0f32; m * n];
        let mut scratch = Bf16Scratch::new(n, k);
        let mat = |c: usize| MatRef {
            data: WeightData::Bf16(&w[c * m * k..(c + 1) * m * k]),
            rows: m,
            cols: k,
        };
        let gb = |t: f64| (m * k * 2) as f64 / t / 1e9;
        for _ in 0..3 {
            let t0 = Instant::now();
            for i in 0..4 * copies {
                linear_stream(isa, &x, n, mat(i % copies), None, &mut y);
            }
            let ts = t0.elapsed().as_secs_f64() / (4 * copies) as f64;
            let t0 = Instant::now();
            for i in 0..4 * copies {
                let w = mat(i % copies);
                let out = Bf16Out {
                    w,
                    bias: None,
                    y: &mut y,
                };
                linear_bf16dot(&x, n, &mut [out], &mut scratch);
            }
            let td = t0.elapsed().as_secs_f64() / (4 * copies) as f64;
            println!(
                "{isa:?} [{m},{k}] n={n}: f32 inputs {:.1} GB/s, bf16 dot {:.1} GB/s",
                gb(ts),
                gb(td)
            );
        }
    }

    #[test]
    #[ignore]
    fn timing_decode_vs_read() {
        for &(m, k) in &[(49152usize, 576usize), (1536, 576), (576, 1536)] {
            let w: Vec<bf16> = (0..m * k)
                .map(|i| bf16::from_f32((i % 17) as f32 * 0.01))
                .collect();
            let raw: Vec<u16> = w.iter().map(|v| v.to_bits()).collect();
            let mat = MatRef {
                data: WeightData::Bf16(&w),
                rows: m,
                cols: k,
            };
            let x = vec![0.5f32; k];
            let mut y = vec![0.0f32; m];
            let (mut tk, mut tr) = (f64::INFINITY, f64::INFINITY);
            let reps = if m > 10000 { 10 } else { 100 };
            for _ in 0..10 {
                tk = tk.min(best_of(reps, || {
                    linear_stream(Isa::detect(), &x, 1, mat, None, &mut y)
                }));
                tr = tr.min(best_of(reps, || {
                    std::hint::black_box(read_all(&raw));
                }));
            }
            let gb = |t: f64| (m * k * 2) as f64 / t / 1e9;
            println!(
                "n=1 bf16 [{m},{k}]: kernel {:7.1} us {:5.1} GB/s | plain read {:7.1} us {:5.1} GB/s",
                tk * 1e6,
                gb(tk),
                tr * 1e6,
                gb(tr)
            );
        }
    }
}
