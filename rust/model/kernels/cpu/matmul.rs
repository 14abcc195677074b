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
//!   tile (`panel_avx2_f32`). On SmolLM-135M shapes (bf16, n = 512, one thread
//!   of the 2-core Sapphire Rapids box) it runs at about 0.9-1.0x the speed of the convert-panel
//!   + `gemm` path it replaced, and faster at n <= 128.
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
mod x86 {
    use super::Out;
    use std::arch::x86_64::*;

    // ---- AVX-512: 16 lanes; weights widened to f32 in registers. ----

    /// The fixed reduction tree of a 16-lane accumulator: lanes `i + (i+8)`, then `i + (i+4)`,
    /// then `i + (i+2)`, then `0 + 1`. Written out (not `_mm512_reduce_add_ps`, whose order
    /// the compiler may choose) so that every kernel reduces identically.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    #[inline]
    pub(super) unsafe fn hsum512(v: __m512) -> f32 {
        let lo = _mm512_castps512_ps256(v);
        let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v)));
        let s8 = _mm256_add_ps(lo, hi);
        let s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps::<1>(s8));
        let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
        let s1 = _mm_add_ss(s2, _mm_movehdup_ps(s2));
        _mm_cvtss_f32(s1)
    }

    /// `hsum512` of 16 accumulators at once, with the same tree for each (every level adds
    /// the same lane pairs; only the packing differs): lane `4j + p` of the result is the sum
    /// of `v[4p + j]`. 30 shuffles and 15 adds instead of 16 x (4 shuffles + 4 adds).
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    #[inline]
    pub(super) unsafe fn hsum512_x16(v: &[__m512; 16]) -> __m512 {
        // Lanes i + (i+8): l1[j] = [v[2j] | v[2j+1]], 8 lanes each.
        let mut l1 = [_mm512_setzero_ps(); 8];
        for (j, o) in l1.iter_mut().enumerate() {
            let (a, b) = (v[2 * j], v[2 * j + 1]);
            *o = _mm512_add_ps(
                _mm512_shuffle_f32x4::<0x44>(a, b),
                _mm512_shuffle_f32x4::<0xEE>(a, b),
            );
        }
        // Lanes i + (i+4): l2[j] = [v[4j] | .. | v[4j+3]], 4 lanes each.
        let mut l2 = [_mm512_setzero_ps(); 4];
        for (j, o) in l2.iter_mut().enumerate() {
            let (a, b) = (l1[2 * j], l1[2 * j + 1]);
            *o = _mm512_add_ps(
                _mm512_shuffle_f32x4::<0x88>(a, b),
                _mm512_shuffle_f32x4::<0xDD>(a, b),
            );
        }
        // Lanes i + (i+2), within 128-bit lanes: l3[j] lane q = [v[8j+q] x2 | v[8j+4+q] x2].
        let mut l3 = [_mm512_setzero_ps(); 2];
        for (j, o) in l3.iter_mut().enumerate() {
            let (a, b) = (l2[2 * j], l2[2 * j + 1]);
            *o = _mm512_add_ps(
                _mm512_shuffle_ps::<0x44>(a, b),
                _mm512_shuffle_ps::<0xEE>(a, b),
            );
        }
        // Lanes 0 + 1: lane q = [v[q], v[4+q], v[8+q], v[12+q]].
        let (a, b) = (l3[0], l3[1]);
        _mm512_add_ps(
            _mm512_shuffle_ps::<0x88>(a, b),
            _mm512_shuffle_ps::<0xDD>(a, b),
        )
    }

    /// The sums of an R x T block of accumulators (`acc[t][r]`), each by the `hsum512` tree:
    /// sixteen at a time through `hsum512_x16` (fewer than 4 one by one).
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    #[inline]
    unsafe fn reduce<const R: usize, const T: usize>(acc: &[[__m512; R]; T]) -> [[f32; R]; T] {
        let mut o = [[0f32; R]; T];
        let total = R * T;
        if total < 4 {
            for t in 0..T {
                for r in 0..R {
                    o[t][r] = hsum512(acc[t][r]);
                }
            }
            return o;
        }
        let mut i0 = 0;
        while i0 < total {
            let cnt = (total - i0).min(16);
            // Accumulator i (token i / R, row i % R) goes in as v[q], q = i - i0 = 4p + j,
            // and comes out in lane 4j + p.
            let mut v = [_mm512_setzero_ps(); 16];
            for (q, vq) in v.iter_mut().enumerate().take(cnt) {
                let i = i0 + q;
                *vq = acc[i / R][i % R];
            }
            let mut lanes = [0f32; 16];
            _mm512_storeu_ps(lanes.as_mut_ptr(), hsum512_x16(&v));
            for q in 0..cnt {
                let i = i0 + q;
                o[i / R][i % R] = lanes[4 * (q % 4) + q / 4];
            }
            i0 += 16;
        }
        o
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    #[inline]
    unsafe fn l512_bf16(p: *const u16) -> __m512 {
        // bf16 is the top half of an f32: zero-extend to 32 bits and shift left by 16.
        let h = _mm256_loadu_si256(p.cast());
        _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
    }
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    #[inline]
    unsafe fn l512m_bf16(p: *const u16, m: __mmask16) -> __m512 {
        let h = _mm256_maskz_loadu_epi16(m, p.cast());
        _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
    }
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    #[inline]
    unsafe fn l512_f16(p: *const u16) -> __m512 {
        _mm512_cvtph_ps(_mm256_loadu_si256(p.cast()))
    }
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    #[inline]
    unsafe fn l512m_f16(p: *const u16, m: __mmask16) -> __m512 {
        _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p.cast()))
    }
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    #[inline]
    unsafe fn l512_f32(p: *const f32) -> __m512 {
        _mm512_loadu_ps(p)
    }
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    #[inline]
    unsafe fn l512m_f32(p: *const f32, m: __mmask16) -> __m512 {
        _mm512_maskz_loadu_ps(m, p)
    }

    /// Generates, for one weight element type: the column loop of an R x T block (R weight
    /// rows x T tokens, one 16-lane accumulator each), the whole-row block, and the stream
    /// driver around it.
    macro_rules! avx512_rows {
        ($rows:ident, $steps:ident, $block:ident, $elem:ty, $ld:ident, $ldm:ident) => {
            /// `acc[t][r] +=` columns `0..len` of weight row `r` (`w + r*wk`) times token row
            /// `t` (`x + t*xk`): lane `l` takes the columns `c ≡ l (mod 16)` in order, one FMA
            /// each; past the last multiple of 16, one masked step (lanes past `len` add
            /// 0 * 0). The pointers may start at any multiple of 16 columns into the rows:
            /// this continues the same per-lane sums.
            #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
            #[inline]
            unsafe fn $steps<const R: usize, const T: usize, const PF: bool>(
                w: *const $elem,
                wk: usize,
                x: *const f32,
                xk: usize,
                acc: &mut [[__m512; R]; T],
                len: usize,
            ) {
                let mut c = 0;
                while c + 16 <= len {
                    let mut wv = [_mm512_setzero_ps(); R];
                    for (r, v) in wv.iter_mut().enumerate() {
                        *v = $ld(w.add(r * wk + c));
                        // Rows are short (~1 KiB) streams, too short for the hardware
                        // prefetcher to ramp up: fetch the next row group's line explicitly.
                        if PF {
                            _mm_prefetch::<_MM_HINT_T0>(w.wrapping_add((R + r) * wk + c).cast());
                        }
                    }
                    for (t, a) in acc.iter_mut().enumerate() {
                        let xv = _mm512_loadu_ps(x.add(t * xk + c));
                        for r in 0..R {
                            a[r] = _mm512_fmadd_ps(wv[r], xv, a[r]);
                        }
                    }
                    c += 16;
                }
                if c < len {
                    let mask = ((1u32 << (len - c)) - 1) as __mmask16;
                    let mut wv = [_mm512_setzero_ps(); R];
                    for (r, v) in wv.iter_mut().enumerate() {
                        *v = $ldm(w.add(r * wk + c), mask);
                    }
                    for (t, a) in acc.iter_mut().enumerate() {
                        let xv = _mm512_maskz_loadu_ps(mask, x.add(t * xk + c));
                        for r in 0..R {
                            a[r] = _mm512_fmadd_ps(wv[r], xv, a[r]);
                        }
                    }
                }
            }

            /// The R x T dot products of whole rows, reduced.
            #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
            #[inline]
            unsafe fn $block<const R: usize, const T: usize>(
                w: *const $elem,
                k: usize,
                x: *const f32,
            ) -> [[f32; R]; T] {
                let mut acc = [[_mm512_setzero_ps(); R]; T];
                $steps::<R, T, true>(w, k, x, k, &mut acc, k);
                reduce(&acc)
            }

            /// Stream driver: rows `r0..r1` for all `n` tokens, each group of weight rows read
            /// from memory once. Up to 4 tokens: groups of 4 rows (4x4 accumulators + 4 weight
            /// vectors fit in 32 zmm). More tokens: groups of 3 rows against tiles of up to 8
            /// tokens (24 accumulators), so that a weight vector is widened once per 8 tokens,
            /// not once per 4 (widening takes a shuffle-port uop that the FMAs also need).
            #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
            pub(super) unsafe fn $rows(
                w: *const $elem,
                k: usize,
                r0: usize,
                r1: usize,
                x: *const f32,
                n: usize,
                out: Out,
            ) {
                // One R-row group against token tiles of up to T tokens (T <= 8).
                macro_rules! group {
                    ($R:literal, $T:literal, $wr:expr, $r:expr) => {{
                        let mut t = 0;
                        while t < n {
                            let xt = x.add(t * k);
                            let tt = (n - t).min($T);
                            match tt {
                                1 => out.store(&$block::<$R, 1>($wr, k, xt), t, $r),
                                2 => out.store(&$block::<$R, 2>($wr, k, xt), t, $r),
                                3 => out.store(&$block::<$R, 3>($wr, k, xt), t, $r),
                                4 => out.store(&$block::<$R, 4>($wr, k, xt), t, $r),
                                5 => out.store(&$block::<$R, 5>($wr, k, xt), t, $r),
                                6 => out.store(&$block::<$R, 6>($wr, k, xt), t, $r),
                                7 => out.store(&$block::<$R, 7>($wr, k, xt), t, $r),
                                _ => out.store(&$block::<$R, 8>($wr, k, xt), t, $r),
                            }
                            t += tt;
                        }
                    }};
                }
                // 8-token tiles while 8 token rows stay in L1 beside the weights (k <= 768:
                // 24 KiB); past that the x traffic of 3-row groups outweighs what they save.
                let wide = n > 4 && n <= 16 && k <= WIDE_TILE_MAX_K;
                let mut r = r0;
                while r < r1 {
                    let wr = w.add(r * k);
                    let left = r1 - r;
                    if wide && left >= 3 {
                        group!(3, 8, wr, r);
                        r += 3;
                    } else if wide {
                        group!(1, 8, wr, r);
                        r += 1;
                    } else if left >= 4 {
                        group!(4, 4, wr, r);
                        r += 4;
                    } else {
                        group!(1, 4, wr, r);
                        r += 1;
                    }
                }
            }
        };
    }

    avx512_rows!(
        rows_avx512_bf16,
        steps512_bf16,
        blk512_bf16,
        u16,
        l512_bf16,
        l512m_bf16
    );
    avx512_rows!(
        rows_avx512_f16,
        steps512_f16,
        blk512_f16,
        u16,
        l512_f16,
        l512m_f16
    );
    avx512_rows!(
        rows_avx512_f32,
        steps512_f32,
        blk512_f32,
        f32,
        l512_f32,
        l512m_f32
    );

    /// Longest rows for which the stream driver uses 3-row x 8-token tiles (see `$rows`).
    const WIDE_TILE_MAX_K: usize = 768;

    /// The panel driver's register tile: PANEL_R weight rows x PANEL_T tokens.
    const PANEL_R: usize = 4;
    const PANEL_T: usize = 6;
    /// Columns per pass of the panel driver: with 4 weight rows and 6 token rows of this many
    /// f32 in flight (30 KiB), a token tile stays in L1 from one row group to the next.
    const PANEL_COLS: usize = 768;
    /// Rows whose accumulators are parked between column passes.
    const PARK_ROWS: usize = 256;

    /// One R x T tile over columns `c0..c1`: weight rows `w + r*k`, the tile's token rows
    /// (columns `c0..c1` only) at `xt + t*xk`. Starts from zero (`first`) or from the parked
    /// accumulators in `slot`; ends by parking them again, or (`last`) by reducing and storing.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    #[inline]
    #[allow(clippy::too_many_arguments)]
    unsafe fn pass_f32<const R: usize, const T: usize>(
        w: *const f32,
        k: usize,
        (xt, xk): (*const f32, usize),
        slot: &mut [__m512; PANEL_R * PANEL_T],
        (c0, c1): (usize, usize),
        (first, last): (bool, bool),
        out: Out,
        (t, r): (usize, usize),
    ) {
        let mut acc = [[_mm512_setzero_ps(); R]; T];
        if !first {
            for (tt, a) in acc.iter_mut().enumerate() {
                for (rr, v) in a.iter_mut().enumerate() {
                    *v = slot[tt * R + rr];
                }
            }
        }
        // The panel is in L2 and read in order: no software prefetch.
        steps512_f32::<R, T, false>(w.add(c0), k, xt, xk, &mut acc, c1 - c0);
        if last {
            out.store(&reduce(&acc), t, r);
        } else {
            for (tt, a) in acc.iter().enumerate() {
                for (rr, v) in a.iter().enumerate() {
                    slot[tt * R + rr] = *v;
                }
            }
        }
    }

    /// `pass_f32::<R, tt>(args)` for a run-time `tt` in `1..=PANEL_T`.
    macro_rules! pass_tt {
        ($r:literal, $tt:expr, $args:tt, [$($t:literal),*]) => {
            match $tt {
                $($t => pass_f32::<$r, $t> $args,)*
                _ => unreachable!(),
            }
        };
    }

    /// Panel driver: rows `0..rows` of a cached f32 panel for all `n` tokens, in tiles of
    /// PANEL_R rows x up to PANEL_T tokens; each token tile stays in L1 while the row groups
    /// of the (L2-resident) panel pass it. Rows longer than `PANEL_COLS` go in several column
    /// passes, the accumulators parked in between: the same FMAs in the same order, so the
    /// same bits as the stream driver.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    pub(super) unsafe fn panel_avx512_f32(
        w: *const f32,
        k: usize,
        rows: usize,
        x: *const f32,
        n: usize,
        out: Out,
    ) {
        let passes = k.div_ceil(PANEL_COLS);
        let kc = k.div_ceil(passes).next_multiple_of(16);
        let sub = if passes == 1 { rows } else { PARK_ROWS };
        // Parked accumulators, one slot per group of PANEL_R rows and per single row after
        // them; one pass parks nothing (a single slot, never read), so only then is the
        // 100 KiB store set up.
        let mut one = [[_mm512_setzero_ps(); PANEL_R * PANEL_T]; 1];
        let mut all;
        let park: &mut [[__m512; PANEL_R * PANEL_T]] = if passes == 1 {
            &mut one
        } else {
            all = [[_mm512_setzero_ps(); PANEL_R * PANEL_T]; PARK_ROWS / PANEL_R + PANEL_R];
            &mut all
        };
        // The token tile's columns of one pass, 64-byte aligned (row stride kc, a multiple of
        // 16): activation rows are not, and split loads would halve the L1 bandwidth.
        let mut xbuf = XTile([0.0; PANEL_T * PANEL_COLS]);
        let mut s0 = 0;
        while s0 < rows {
            let s1 = (s0 + sub).min(rows);
            let mut t = 0;
            while t < n {
                let tt = (n - t).min(PANEL_T);
                let mut c0 = 0;
                while c0 < k {
                    let c1 = (c0 + kc).min(k);
                    for j in 0..tt {
                        let src = std::slice::from_raw_parts(x.add((t + j) * k + c0), c1 - c0);
                        xbuf.0[j * kc..j * kc + (c1 - c0)].copy_from_slice(src);
                    }
                    let xt = (xbuf.0.as_ptr(), kc);
                    let fl = (c0 == 0, c1 == k);
                    let mut r = s0;
                    let mut g = 0;
                    while r < s1 {
                        let full = s1 - r >= PANEL_R;
                        let wr = w.add(r * k);
                        let slot = &mut park[if passes == 1 { 0 } else { g }];
                        let c = (c0, c1);
                        if full {
                            pass_tt!(
                                4,
                                tt,
                                (wr, k, xt, slot, c, fl, out, (t, r)),
                                [1, 2, 3, 4, 5, 6]
                            );
                        } else {
                            pass_tt!(
                                1,
                                tt,
                                (wr, k, xt, slot, c, fl, out, (t, r)),
                                [1, 2, 3, 4, 5, 6]
                            );
                        }
                        r += if full { PANEL_R } else { 1 };
                        g += 1;
                    }
                    c0 = c1;
                }
                t += tt;
            }
            s0 = s1;
        }
    }

    #[repr(C, align(64))]
    struct XTile([f32; PANEL_T * PANEL_COLS]);

    // ---- AVX2 + FMA: 8 lanes, scalar tail. ----

    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn l256_bf16(p: *const u16) -> __m256 {
        let h = _mm_loadu_si128(p.cast());
        _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
    }
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn l256_f16(p: *const u16) -> __m256 {
        _mm256_cvtph_ps(_mm_loadu_si128(p.cast()))
    }
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn l256_f32(p: *const f32) -> __m256 {
        _mm256_loadu_ps(p)
    }
    #[inline(always)]
    fn s_bf16(v: u16) -> f32 {
        f32::from_bits((v as u32) << 16)
    }
    #[inline(always)]
    fn s_f16(v: u16) -> f32 {
        half::f16::from_bits(v).to_f32()
    }
    #[inline(always)]
    fn s_f32(v: f32) -> f32 {
        v
    }

    /// The fixed reduction tree of an 8-lane accumulator: `i + (i+4)`, `i + (i+2)`, `0 + 1`.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn hsum256(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_movehdup_ps(s));
        _mm_cvtss_f32(s)
    }

    macro_rules! avx2_rows {
        ($rows:ident, $block:ident, $elem:ty, $ld:ident, $sc:ident) => {
            #[target_feature(enable = "avx2,fma,f16c")]
            #[inline]
            unsafe fn $block<const R: usize, const T: usize>(
                w: *const $elem,
                k: usize,
                x: *const f32,
            ) -> [[f32; R]; T] {
                let mut acc = [[_mm256_setzero_ps(); R]; T];
                let mut c = 0;
                while c + 8 <= k {
                    let mut wv = [_mm256_setzero_ps(); R];
                    for (r, v) in wv.iter_mut().enumerate() {
                        *v = $ld(w.add(r * k + c));
                        // Next row group's line: see the AVX-512 kernel.
                        _mm_prefetch::<_MM_HINT_T0>(w.wrapping_add((R + r) * k + c).cast());
                    }
                    for (t, a) in acc.iter_mut().enumerate() {
                        let xv = _mm256_loadu_ps(x.add(t * k + c));
                        for r in 0..R {
                            a[r] = _mm256_fmadd_ps(wv[r], xv, a[r]);
                        }
                    }
                    c += 8;
                }
                let mut o = [[0f32; R]; T];
                for t in 0..T {
                    for r in 0..R {
                        let mut s = hsum256(acc[t][r]);
                        for cc in c..k {
                            s += $sc(*w.add(r * k + cc)) * *x.add(t * k + cc);
                        }
                        o[t][r] = s;
                    }
                }
                o
            }

            /// Rows `r0..r1` for all `n` tokens, in blocks of 3 rows x up to 4 tokens: 12
            /// accumulators, 3 weight vectors and the token's vector fill the 16 ymm registers,
            /// and each weight vector loaded serves 4 tokens (a 4x2 block's served 2, which left
            /// the FMAs waiting on loads). Every output's arithmetic is the block's whatever its
            /// shape (lane-strided FMA chains, `hsum256`, the scalar tail), so the tiling does
            /// not change a bit.
            #[target_feature(enable = "avx2,fma,f16c")]
            pub(super) unsafe fn $rows(
                w: *const $elem,
                k: usize,
                r0: usize,
                r1: usize,
                x: *const f32,
                n: usize,
                out: Out,
            ) {
                let mut r = r0;
                while r < r1 {
                    let three = r1 - r >= 3;
                    let wr = w.add(r * k);
                    let mut t = 0;
                    while t < n {
                        let xt = x.add(t * k);
                        let tt = (n - t).min(4);
                        match (three, tt) {
                            (true, 1) => out.store(&$block::<3, 1>(wr, k, xt), t, r),
                            (true, 2) => out.store(&$block::<3, 2>(wr, k, xt), t, r),
                            (true, 3) => out.store(&$block::<3, 3>(wr, k, xt), t, r),
                            (true, _) => out.store(&$block::<3, 4>(wr, k, xt), t, r),
                            (false, 1) => out.store(&$block::<1, 1>(wr, k, xt), t, r),
                            (false, 2) => out.store(&$block::<1, 2>(wr, k, xt), t, r),
                            (false, 3) => out.store(&$block::<1, 3>(wr, k, xt), t, r),
                            (false, _) => out.store(&$block::<1, 4>(wr, k, xt), t, r),
                        }
                        t += tt;
                    }
                    r += if three { 3 } else { 1 };
                }
            }
        };
    }

    avx2_rows!(rows_avx2_bf16, blk256_bf16, u16, l256_bf16, s_bf16);
    avx2_rows!(rows_avx2_f16, blk256_f16, u16, l256_f16, s_f16);
    avx2_rows!(rows_avx2_f32, blk256_f32, f32, l256_f32, s_f32);

    /// The AVX2 panel driver's register tile (as the stream driver's widest: 12 accumulators,
    /// 3 weight vectors and a token vector fill the 16 ymm registers).
    const PANEL2_R: usize = 3;
    const PANEL2_T: usize = 4;
    /// Columns per pass: 3 weight rows and 4 token rows of this many f32 (21 KiB) stay in L1.
    const PANEL2_COLS: usize = 768;
    /// Rows whose accumulators are parked between column passes (whole 3-row groups).
    const PARK2_ROWS: usize = 255;

    /// `acc[t][r] +=` columns `0..len` (a multiple of 8) of weight row `r` (`w + r*wk`)
    /// times token row `t` (`x + t*xk`): lane `l` takes the columns `c ≡ l (mod 8)` in order,
    /// one FMA each, as `blk256_*`; starting at a multiple of 8 columns into the rows, this
    /// continues the same per-lane sums.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn steps256_f32<const R: usize, const T: usize>(
        w: *const f32,
        wk: usize,
        x: *const f32,
        xk: usize,
        acc: &mut [[__m256; R]; T],
        len: usize,
    ) {
        let mut c = 0;
        while c + 8 <= len {
            let mut wv = [_mm256_setzero_ps(); R];
            for (r, v) in wv.iter_mut().enumerate() {
                *v = _mm256_loadu_ps(w.add(r * wk + c));
            }
            for (t, a) in acc.iter_mut().enumerate() {
                let xv = _mm256_load_ps(x.add(t * xk + c));
                for r in 0..R {
                    a[r] = _mm256_fmadd_ps(wv[r], xv, a[r]);
                }
            }
            c += 8;
        }
    }

    /// One R x T tile over columns `c0..c1` (as `pass_f32`): from zero (`first`) or the
    /// parked accumulators; parks them again, or (`last`) reduces by `hsum256`, adds the
    /// columns past the last multiple of 8 in order (`blk256_*`'s tail) and stores.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    #[allow(clippy::too_many_arguments)]
    unsafe fn pass256_f32<const R: usize, const T: usize>(
        w: *const f32,
        k: usize,
        (xt, xk): (*const f32, usize),
        slot: &mut [__m256; PANEL2_R * PANEL2_T],
        (c0, c1): (usize, usize),
        (first, last): (bool, bool),
        out: Out,
        (t, r): (usize, usize),
    ) {
        let mut acc = [[_mm256_setzero_ps(); R]; T];
        if !first {
            for (tt, a) in acc.iter_mut().enumerate() {
                for (rr, v) in a.iter_mut().enumerate() {
                    *v = slot[tt * R + rr];
                }
            }
        }
        let len = (c1 - c0) / 8 * 8;
        steps256_f32::<R, T>(w.add(c0), k, xt, xk, &mut acc, len);
        if last {
            let mut o = [[0f32; R]; T];
            for (tt, row) in o.iter_mut().enumerate() {
                for (rr, v) in row.iter_mut().enumerate() {
                    let mut s = hsum256(acc[tt][rr]);
                    for cc in c0 + len..c1 {
                        s += *w.add(rr * k + cc) * *xt.add(tt * xk + cc - c0);
                    }
                    *v = s;
                }
            }
            out.store(&o, t, r);
        } else {
            for (tt, a) in acc.iter().enumerate() {
                for (rr, v) in a.iter().enumerate() {
                    slot[tt * R + rr] = *v;
                }
            }
        }
    }

    /// `pass256_f32::<R, tt>(args)` for a run-time `tt` in `1..=PANEL2_T`.
    macro_rules! pass256_tt {
        ($r:literal, $tt:expr, $args:tt) => {
            match $tt {
                1 => pass256_f32::<$r, 1> $args,
                2 => pass256_f32::<$r, 2> $args,
                3 => pass256_f32::<$r, 3> $args,
                4 => pass256_f32::<$r, 4> $args,
                _ => unreachable!(),
            }
        };
    }

    /// The AVX2 panel driver, as `panel_avx512_f32`: rows `0..rows` of a cached f32 panel for
    /// all `n` tokens in tiles of 3 rows x up to 4 tokens, each token tile (one column pass of
    /// it, copied to an aligned buffer) staying in L1 while the panel's row groups pass it.
    /// The whole-row blocks read 3 weight rows and 4 token rows of `k` columns at once, more
    /// than L1 holds at the model's widths, so every load came from L2. The same FMAs in the
    /// same order, so the same bits as `rows_avx2_*`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn panel_avx2_f32(
        w: *const f32,
        k: usize,
        rows: usize,
        x: *const f32,
        n: usize,
        out: Out,
    ) {
        let passes = k.div_ceil(PANEL2_COLS);
        let kc = k.div_ceil(passes).next_multiple_of(8);
        let sub = if passes == 1 { rows } else { PARK2_ROWS };
        let mut one = [[_mm256_setzero_ps(); PANEL2_R * PANEL2_T]; 1];
        let mut all;
        let park: &mut [[__m256; PANEL2_R * PANEL2_T]] = if passes == 1 {
            &mut one
        } else {
            all = [[_mm256_setzero_ps(); PANEL2_R * PANEL2_T]; PARK2_ROWS / PANEL2_R + PANEL2_R];
            &mut all
        };
        let mut xbuf = XTile2([0.0; PANEL2_T * PANEL2_COLS]);
        let mut s0 = 0;
        while s0 < rows {
            let s1 = (s0 + sub).min(rows);
            let mut t = 0;
            while t < n {
                let tt = (n - t).min(PANEL2_T);
                let mut c0 = 0;
                while c0 < k {
                    let c1 = (c0 + kc).min(k);
                    for j in 0..tt {
                        let src = std::slice::from_raw_parts(x.add((t + j) * k + c0), c1 - c0);
                        xbuf.0[j * kc..j * kc + (c1 - c0)].copy_from_slice(src);
                    }
                    let xt = (xbuf.0.as_ptr(), kc);
                    let fl = (c0 == 0, c1 == k);
                    let mut r = s0;
                    let mut g = 0;
                    while r < s1 {
                        let full = s1 - r >= PANEL2_R;
                        let wr = w.add(r * k);
                        let slot = &mut park[if passes == 1 { 0 } else { g }];
                        let c = (c0, c1);
                        if full {
                            pass256_tt!(3, tt, (wr, k, xt, slot, c, fl, out, (t, r)));
                        } else {
                            pass256_tt!(1, tt, (wr, k, xt, slot, c, fl, out, (t, r)));
                        }
                        r += if full { PANEL2_R } else { 1 };
                        g += 1;
                    }
                    c0 = c1;
                }
                t += tt;
            }
            s0 = s1;
        }
    }

    #[repr(C, align(32))]
    struct XTile2([f32; PANEL2_T * PANEL2_COLS]);

    /// Widens `dst.len()` bf16 values to f32, 16 per step.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    pub(super) unsafe fn bf16_to_f32_avx512(src: &[half::bf16], dst: &mut [f32]) {
        let n = dst.len().min(src.len());
        let (s, d) = (src.as_ptr() as *const u16, dst.as_mut_ptr());
        let mut i = 0;
        while i + 16 <= n {
            _mm512_storeu_ps(d.add(i), l512_bf16(s.add(i)));
            i += 16;
        }
        if i < n {
            let mask = ((1u32 << (n - i)) - 1) as __mmask16;
            _mm512_mask_storeu_ps(d.add(i), mask, l512m_bf16(s.add(i), mask));
        }
    }

    /// Converts `dst.len()` f16 values to f32 with F16C (16 per step on AVX-512).
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    pub(super) unsafe fn f16_to_f32_avx512(src: &[half::f16], dst: &mut [f32]) {
        let n = dst.len().min(src.len());
        let (s, d) = (src.as_ptr() as *const u16, dst.as_mut_ptr());
        let mut i = 0;
        while i + 16 <= n {
            _mm512_storeu_ps(d.add(i), l512_f16(s.add(i)));
            i += 16;
        }
        if i < n {
            let mask = ((1u32 << (n - i)) - 1) as __mmask16;
            _mm512_mask_storeu_ps(d.add(i), mask, l512m_f16(s.add(i), mask));
        }
    }
}

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
                .map(|i| rng.next() * [1.0, 1e-4, 3e3, 1e7][i % 4])
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
                    for (i, &n) in [1usize, 5, 8, 9, 16, 32, 33, 64, 65, 300]
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
    use half::bf16;
    use std::time::Instant;

    /// Best of `reps` runs: robust to other processes on a shared machine.
    fn best(reps: usize, mut f: impl FnMut()) -> f64 {
        f();
        (0..reps)
            .map(|_| {
                let t = Instant::now();
                f();
                t.elapsed().as_secs_f64()
            })
            .fold(f64::INFINITY, f64::min)
    }

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
                let ts = best(reps, || {
                    linear_stream(isa, &x[..n * k], n, mat, None, &mut y[..n * m])
                });
                let tp = best(reps, || {
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
                let ts = best(20, || linear_stream(isa, xs, n, mat, None, ys));
                let tp = best(20, || {
                    linear_panels(isa, xs, n, mat, None, ys, &mut scratch)
                });
                let tf = best(20, || {
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
                tk = tk.min(best(reps, || {
                    linear_stream(Isa::detect(), &x, 1, mat, None, &mut y)
                }));
                tr = tr.min(best(reps, || {
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
