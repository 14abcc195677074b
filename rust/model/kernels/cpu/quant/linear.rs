//! The linear-layer kernel on quantized weights: `y = x · Wᵀ (+ bias)`, the weights read in
//! their ggml block format straight from the memory map.
//!
//! **Arithmetic.** The activation rows are quantized to 8 bits once per call ([`activation`]:
//! one scale per 32 values for the 32-weight types, per 256 for the K-quants and IQ4_XS). For
//! each weight block `b` of row `r` and token `t`, the integer part is exact: `i1` = the sum of
//! weight integers times activation integers (with the block's sub-block scales and offsets
//! folded in, all integers), and for the types with a minimum `i2` = the minimums times the
//! activation sums. Then one fixed float step per block, in block order:
//!
//! ```text
//! acc = 0; for each block b: acc = acc + ((d_w * d_x) * f32(i1) [+ (m_w * d_x) * f32(i2)])
//! y = acc [+ bias]
//! ```
//!
//! (separate multiplies and adds, never fused). Integer sums do not depend on their order and
//! every path follows this float sequence per output, so **every instruction set gives the same
//! bits as the scalar reference**, and a token's output row is the same whatever the number of
//! tokens, the tiling, the task split or the thread count (batch invariance).
//!
//! **Paths.** AVX-512 VNNI ([`super::avx512`]), AVX2 ([`super::avx2`]) and scalar, chosen at run
//! time per call; a type an instruction set has no kernel for takes the scalar path (same bits).
//! Interleaved matrices ([`super::interleave`]) take [`super::avx512_x16`],
//! [`super::avx512_x16_b32`], [`super::avx2_x16`] or [`super::avx2_x16_b32`] where the
//! instruction set has a kernel for the type ([`super::interleave::supported`]), else the
//! scalar path.
//! Output rows are split into rayon tasks; a group of products of the same input
//! ([`linear_quant_group`]) is one parallel loop over all their row chunks.
//!
//! [`activation`]: super::activation

use super::activation::{Act, ActBuf, ActFormat};
#[cfg(target_arch = "x86_64")]
use super::avx2_x16::Dot;
use super::{unpack, QuantType, Unpacked};
use crate::model::kernels::cpu::SendPtr;
use rayon::prelude::*;

/// A `[rows, cols]` quantized weight matrix: `rows` rows of `ty.row_bytes(cols)`, in ggml's
/// row-major layout or interleaved by groups of 16 rows.
#[derive(Clone, Copy, Debug)]
pub struct QuantMatRef<'a> {
    pub ty: QuantType,
    pub layout: Layout,
    pub data: &'a [u8],
    pub rows: usize,
    pub cols: usize,
}

/// How a quantized matrix's blocks are ordered.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    /// ggml's: row after row, each a run of blocks (what GGUF files hold).
    Rows,
    /// [`super::interleave`]'s: groups of 16 rows, block by block (Q4_0, Q4_1, Q5_0, Q5_1,
    /// Q8_0, Q4_K, Q5_K, Q6_K).
    Interleaved,
}

impl QuantMatRef<'_> {
    /// Bytes per row (panics unless `cols` is whole blocks: checked in `check_shapes`).
    fn row_bytes(&self) -> usize {
        self.ty.row_bytes(self.cols).expect("whole blocks")
    }

    /// Block `b` of row `r` in ggml's layout: a view (row-major), or rebuilt into `buf`.
    #[inline]
    fn block<'b>(&'b self, r: usize, b: usize, buf: &'b mut [u8; 256]) -> &'b [u8] {
        let bb = self.ty.block_bytes();
        match self.layout {
            Layout::Rows => {
                let at = r * self.row_bytes() + b * bb;
                &self.data[at..at + bb]
            }
            Layout::Interleaved => {
                super::interleave::block_of(self.ty, self.data, self.cols, r, b, &mut buf[..bb]);
                &buf[..bb]
            }
        }
    }
}

/// The quantized activation rows, allocated once at model load.
pub struct QuantScratch {
    b32: ActBuf,
    k256: ActBuf,
    threads: usize,
}

impl QuantScratch {
    /// `threads`: threads of the pool that runs the forward; `max_tokens`, `max_cols`: the
    /// largest `n` and `w.cols` of the calls. Larger calls still work: more tokens are done in
    /// chunks of `max_tokens`; longer rows in chunks of fewer tokens (at least one row must
    /// fit, `cols <= max_tokens * max_cols`).
    pub fn new(threads: usize, max_tokens: usize, max_cols: usize) -> Self {
        let (t, c) = (max_tokens.max(1), max_cols.max(1));
        QuantScratch {
            b32: ActBuf::new(ActFormat::B32, t, c),
            k256: ActBuf::new(ActFormat::K256, t, c),
            threads: threads.max(1),
        }
    }

    /// Bytes the buffers hold (for the device's memory accounting).
    pub fn bytes(&self) -> usize {
        self.b32.bytes() + self.k256.bytes()
    }
}

/// One product of a [`linear_quant_group`] call: `y = x · wᵀ (+ bias)`, `y` being `[n, w.rows]`.
pub struct QuantOut<'w, 'y> {
    pub w: QuantMatRef<'w>,
    pub bias: Option<&'w [f32]>,
    pub y: &'y mut [f32],
}

/// Most products in one [`linear_quant_group`] call.
pub const GROUP_MAX: usize = 4;

/// `y[t*rows + r] = dot(x[t], w[r]) (+ bias[r])` for `t in 0..n`; `x` is `[n, cols]` row-major,
/// `y` is `[n, rows]` and is overwritten. Allocates nothing.
pub fn linear_quant(
    x: &[f32],
    n: usize,
    w: QuantMatRef,
    bias: Option<&[f32]>,
    y: &mut [f32],
    scratch: &mut QuantScratch,
) {
    linear_quant_group(x, n, &mut [QuantOut { w, bias, y }], scratch);
}

/// Several products of the same `x` (q, k and v; gate and up), possibly of different types:
/// `x` is quantized once per activation format, and all the products' row chunks go to the
/// threads as one parallel loop (one fork and join per group, which matters at decode). Each
/// output is what [`linear_quant`] computes for it, to the bit.
pub fn linear_quant_group(x: &[f32], n: usize, outs: &mut [QuantOut], scratch: &mut QuantScratch) {
    linear_group_with(Isa::detect(), x, n, outs, scratch);
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) enum Isa {
    #[cfg(target_arch = "x86_64")]
    Avx512Vnni,
    /// AVX2 whose 32-weight interleaved kernel sums its dot products with AVX-VNNI.
    #[cfg(target_arch = "x86_64")]
    AvxVnni,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    /// `AvxVnni`'s kernels through the EVEX form of `vpdpbusd` (AVX-512 VNNI on 256-bit
    /// vectors): how the tests run that arithmetic on a CPU without AVX-VNNI.
    #[cfg(all(test, target_arch = "x86_64"))]
    AvxVnniEvex,
    Scalar,
}

impl Isa {
    pub(super) fn detect() -> Isa {
        #[cfg(target_arch = "x86_64")]
        {
            let cpu = super::super::isa::cpu();
            if cpu.avx512_vnni {
                return Isa::Avx512Vnni;
            }
            if cpu.avx_vnni {
                return Isa::AvxVnni;
            }
            if cpu.avx2 {
                return Isa::Avx2;
            }
        }
        Isa::Scalar
    }

    /// Every path this CPU can run (the tests run each).
    #[cfg(test)]
    pub(super) fn available() -> Vec<Isa> {
        #[cfg_attr(not(target_arch = "x86_64"), allow(unused_mut))]
        let mut v = vec![Isa::Scalar];
        #[cfg(target_arch = "x86_64")]
        {
            let cpu = super::super::isa::cpu();
            if cpu.avx2 {
                v.push(Isa::Avx2);
            }
            if cpu.avx_vnni {
                v.push(Isa::AvxVnni);
            }
            if cpu.avx2 && cpu.avx512_vnni {
                v.push(Isa::AvxVnniEvex);
            }
            if Isa::detect() == Isa::Avx512Vnni {
                v.push(Isa::Avx512Vnni);
            }
        }
        v
    }
}

/// Panics (a caller bug, never input) unless the shapes agree.
fn check_shapes(x: &[f32], n: usize, w: &QuantMatRef, bias: Option<&[f32]>, y: &[f32]) {
    let rb = w.ty.row_bytes(w.cols).unwrap_or_else(|| {
        panic!(
            "linear_quant: {} rows of {} columns are not whole blocks",
            w.ty.name(),
            w.cols
        )
    });
    assert_eq!(x.len(), n * w.cols, "linear_quant: x is not [n, cols]");
    assert_eq!(y.len(), n * w.rows, "linear_quant: y is not [n, rows]");
    let rows = match w.layout {
        Layout::Rows => w.rows,
        Layout::Interleaved => {
            assert!(
                super::interleave::has_layout(w.ty),
                "linear_quant: {} has no interleaved layout",
                w.ty.name()
            );
            w.rows.next_multiple_of(super::interleave::GROUP)
        }
    };
    assert_eq!(
        w.data.len(),
        rb * rows,
        "linear_quant: weight data is not [rows, row_bytes]"
    );
    if let Some(b) = bias {
        assert_eq!(b.len(), w.rows, "linear_quant: bias is not [rows]");
    }
}

pub(super) fn linear_group_with(
    isa: Isa,
    x: &[f32],
    n: usize,
    outs: &mut [QuantOut],
    scratch: &mut QuantScratch,
) {
    assert!(
        outs.len() <= GROUP_MAX,
        "linear_quant_group: more than {GROUP_MAX} products"
    );
    let Some(k) = outs.first().map(|o| o.w.cols) else {
        return;
    };
    for o in outs.iter() {
        assert_eq!(
            o.w.cols, k,
            "linear_quant_group: products of different cols"
        );
        check_shapes(x, n, &o.w, o.bias, o.y);
    }
    if n == 0 {
        return;
    }
    let need = |fmt: ActFormat| outs.iter().any(|o| format_of(o.w.ty) == fmt);
    let (use32, use256) = (need(ActFormat::B32), need(ActFormat::K256));
    // Tokens per chunk: as many as both buffers hold.
    let mut chunk = n;
    let fits =
        |c: usize| (!use32 || scratch.b32.fits(c, k)) && (!use256 || scratch.k256.fits(c, k));
    while chunk > 0 && !fits(chunk) {
        chunk = if chunk > 64 { chunk / 2 } else { chunk - 1 };
    }
    assert!(chunk > 0, "QuantScratch too small for rows of {k} columns");
    let mut t0 = 0;
    while t0 < n {
        let tn = chunk.min(n - t0);
        let xs = &x[t0 * k..(t0 + tn) * k];
        let a32 = use32.then(|| scratch.b32.quantize(xs, tn, k));
        let a256 = use256.then(|| scratch.k256.quantize(xs, tn, k));
        run_products(isa, outs, t0, a32.as_ref(), a256.as_ref(), scratch.threads);
        t0 += tn;
    }
}

fn format_of(ty: QuantType) -> ActFormat {
    if ty.is_k() {
        ActFormat::K256
    } else {
        ActFormat::B32
    }
}

/// One product as its tasks see it: weights, bias, output pointer (at the chunk's first token).
type Job<'w> = (QuantMatRef<'w>, Option<&'w [f32]>, SendPtr);

/// Tokens `t0 .. t0 + act.n` of every product, as one parallel loop over row chunks.
fn run_products(
    isa: Isa,
    outs: &mut [QuantOut],
    t0: usize,
    a32: Option<&Act>,
    a256: Option<&Act>,
    threads: usize,
) {
    let n = a32.or(a256).map_or(0, |a| a.n);
    let total_bytes: usize = outs.iter().map(|o| o.w.data.len()).sum();
    let mut jobs: [Option<Job>; GROUP_MAX] = [None; GROUP_MAX];
    let mut first_task = [0usize; GROUP_MAX + 1];
    let mut rpts = [0usize; GROUP_MAX];
    for (i, o) in outs.iter_mut().enumerate() {
        let m = o.w.rows;
        rpts[i] = rows_per_task(m, o.w.row_bytes(), total_bytes, n, threads);
        // SAFETY: t0 < n_total, so t0 * m is inside y.
        let y = SendPtr(unsafe { o.y.as_mut_ptr().add(t0 * m) });
        jobs[i] = Some((o.w, o.bias, y));
        first_task[i + 1] = first_task[i] + m.div_ceil(rpts[i]);
    }
    let products = outs.len();
    let work = |ti: usize| {
        let i = (0..products).rfind(|&i| first_task[i] <= ti).unwrap_or(0);
        let Some((w, bias, yp)) = jobs[i] else {
            return;
        };
        let act = if w.ty.is_k() { a256 } else { a32 }.expect("quantized for this format");
        let r0 = (ti - first_task[i]) * rpts[i];
        let r1 = (r0 + rpts[i]).min(w.rows);
        let out = Out {
            y: yp.get(),
            m: w.rows,
            bias,
        };
        // SAFETY: shapes were checked; rows r0..r1 of every token's output of product i belong
        // to this task alone.
        unsafe { rows_dispatch(isa, &w, r0, r1, act, out) };
    };
    let tasks = first_task[products];
    if tasks == 1 {
        work(0);
    } else {
        (0..tasks).into_par_iter().for_each(work);
    }
}

/// Output rows per task: a multiple of 16 (the widest register tile), about 1/8 of a thread's
/// share of the group's bytes for decode (few, long streams keep the prefetchers busy, and the
/// tail stays short), at least ~32 KiB of weights per task (scheduling is noise then).
fn rows_per_task(m: usize, row_bytes: usize, total: usize, n: usize, threads: usize) -> usize {
    let threads = threads.max(rayon::current_num_threads()).max(1);
    let per_task = if n <= 32 {
        (total / (8 * threads)).max(32 * 1024)
    } else {
        // Compute bound: smaller tasks balance better, and each is long anyway.
        (total / (16 * threads)).max(8 * 1024)
    };
    per_task
        .div_ceil(row_bytes.max(1))
        .clamp(16, m.max(16))
        .next_multiple_of(16)
}

/// Where a block of results goes: output row `r` of token `t` is `y[t*m + r]`, plus `bias[r]`.
#[derive(Clone, Copy)]
pub(super) struct Out<'a> {
    pub y: *mut f32,
    pub m: usize,
    pub bias: Option<&'a [f32]>,
}

impl Out<'_> {
    /// Stores `acc (+ bias[r])` as output row `r` of token `t`.
    ///
    /// # Safety
    /// The element lies inside `y` and belongs to the calling task.
    #[inline(always)]
    pub unsafe fn put(self, t: usize, r: usize, acc: f32) {
        let v = match self.bias {
            Some(b) => acc + b[r],
            None => acc,
        };
        *self.at(t, r) = v;
    }

    /// Where output row `r` of token `t` goes.
    ///
    /// # Safety
    /// As [`Out::put`].
    #[inline(always)]
    pub unsafe fn at(self, t: usize, r: usize) -> *mut f32 {
        self.y.add(t * self.m + r)
    }
}

/// Rows `r0..r1` of `w` for all `act.n` tokens (an interleaved `w`: `r0` a multiple of 16).
///
/// # Safety
/// Rows `r0..r1` of every token's output lie inside `out` and belong to the caller; the CPU
/// supports `isa`.
pub(super) unsafe fn rows_dispatch(
    isa: Isa,
    w: &QuantMatRef,
    r0: usize,
    r1: usize,
    act: &Act,
    out: Out,
) {
    if w.layout == Layout::Interleaved {
        // A type the path has no interleaved kernel for is read block by block, rebuilt.
        if !super::interleave::supported(w.ty, isa) {
            rows_scalar(w, r0, r1, act, out);
            return;
        }
        match isa {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512Vnni => match w.ty {
                QuantType::Q4_K | QuantType::Q5_K | QuantType::Q6_K => {
                    super::avx512_x16::rows(w, r0, r1, act, out)
                }
                _ => super::avx512_x16_b32::rows(w, r0, r1, act, out),
            },
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => avx2_interleaved(w, r0, r1, act, out, Dot::Maddubs),
            #[cfg(target_arch = "x86_64")]
            Isa::AvxVnni => avx2_interleaved(w, r0, r1, act, out, Dot::AvxVnni),
            #[cfg(all(test, target_arch = "x86_64"))]
            Isa::AvxVnniEvex => avx2_interleaved(w, r0, r1, act, out, Dot::Avx512VnniYmm),
            Isa::Scalar => rows_scalar(w, r0, r1, act, out),
        }
        return;
    }
    let done = match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512Vnni => super::avx512::rows(w, r0, r1, act, out),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 | Isa::AvxVnni => super::avx2::rows(w, r0, r1, act, out),
        #[cfg(all(test, target_arch = "x86_64"))]
        Isa::AvxVnniEvex => super::avx2::rows(w, r0, r1, act, out),
        Isa::Scalar => false,
    };
    if !done {
        rows_scalar(w, r0, r1, act, out);
    }
}

/// The AVX2 kernels on the interleaved layout, their dot products summed by `dot`.
///
/// # Safety
/// As [`rows_dispatch`], and the CPU has what `dot` needs.
#[cfg(target_arch = "x86_64")]
unsafe fn avx2_interleaved(w: &QuantMatRef, r0: usize, r1: usize, act: &Act, out: Out, dot: Dot) {
    match w.ty {
        QuantType::Q4_K | QuantType::Q5_K | QuantType::Q6_K => {
            super::avx2_x16::rows(w, r0, r1, act, out, dot)
        }
        _ => super::avx2_x16_b32::rows(w, r0, r1, act, out, dot),
    }
}

/// The float step of one block (see the module doc): every path computes exactly this.
#[inline(always)]
pub(super) fn step(acc: f32, dw: f32, mw: f32, dx: f32, i1: i32, i2: i32, has_min: bool) -> f32 {
    let p = (dw * dx) * i1 as f32;
    let p = if has_min {
        p + (mw * dx) * i2 as f32
    } else {
        p
    };
    acc + p
}

/// The integer parts `(i1, i2)` of one weight block (unpacked) against token `t`'s block `b`.
#[inline]
pub(super) fn int_dot(u: &Unpacked, act: &Act, t: usize, b: usize) -> (i32, i32) {
    let xq = act.block_qs(t, b);
    match act.fmt {
        ActFormat::B32 => {
            let i1 = u.q[..32]
                .iter()
                .zip(xq)
                .map(|(&q, &x)| q as i32 * x as i32)
                .sum();
            (i1, act.sums[act.at(t, b)])
        }
        ActFormat::K256 => {
            let bs = act.block_bsums(t, b);
            let (mut i1, mut i2) = (0i32, 0i32);
            for s in 0..16 {
                let dot: i32 = u.q[16 * s..16 * s + 16]
                    .iter()
                    .zip(&xq[16 * s..16 * s + 16])
                    .map(|(&q, &x)| q as i32 * x as i32)
                    .sum();
                i1 += u.sc[s] as i32 * dot;
                i2 += u.mn[s] as i32 * bs[s] as i32;
            }
            (i1, i2)
        }
    }
}

/// The portable path: each block unpacked once per row and tile of up to 16 tokens.
///
/// # Safety
/// As [`rows_dispatch`].
pub(super) unsafe fn rows_scalar(w: &QuantMatRef, r0: usize, r1: usize, act: &Act, out: Out) {
    let ty = w.ty;
    let has_min = ty.has_min();
    let nb = w.cols / ty.block_elems();
    let mut u = Unpacked::new();
    let mut buf = [0u8; 256];
    for r in r0..r1 {
        for t0 in (0..act.n).step_by(16) {
            let tn = (act.n - t0).min(16);
            let mut acc = [0f32; 16];
            for b in 0..nb {
                unpack(ty, w.block(r, b, &mut buf), &mut u);
                for (t, a) in acc.iter_mut().enumerate().take(tn) {
                    let (i1, i2) = int_dot(&u, act, t0 + t, b);
                    let dx = act.d[act.at(t0 + t, b)];
                    *a = step(*a, u.d, u.m, dx, i1, i2, has_min);
                }
            }
            for (t, &a) in acc.iter().enumerate().take(tn) {
                out.put(t0 + t, r, a);
            }
        }
    }
}

/// Row `r` of `w`, dequantized into `out` (`w.cols` values), whatever the layout.
pub fn dequantized_row(w: &QuantMatRef, r: usize, out: &mut [f32]) {
    let be = w.ty.block_elems();
    let mut buf = [0u8; 256];
    for (b, o) in out.chunks_exact_mut(be).enumerate() {
        super::dequantize_row(w.ty, w.block(r, b, &mut buf), o);
    }
}

/// Plain reference: the weights dequantized, f64 dot products with the f32 activations.
pub fn reference(x: &[f32], n: usize, w: QuantMatRef, bias: Option<&[f32]>, y: &mut [f32]) {
    let (m, k) = (w.rows, w.cols);
    let mut row = vec![0f32; k];
    for r in 0..m {
        dequantized_row(&w, r, &mut row);
        for t in 0..n {
            let mut s = bias.map_or(0.0, |b| b[r] as f64);
            for c in 0..k {
                s += x[t * k + c] as f64 * row[c] as f64;
            }
            y[t * m + r] = s as f32;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::quantize_row;
    use super::*;
    use crate::model::kernels::cpu::test_rng::{thread_pools, Rng};

    fn bits(y: &[f32]) -> Vec<u32> {
        y.iter().map(|v| v.to_bits()).collect()
    }

    /// A random `[m, k]` matrix of `ty`, quantized from Gaussian-like values.
    fn matrix(ty: QuantType, m: usize, k: usize, rng: &mut Rng) -> Vec<u8> {
        let rb = ty.row_bytes(k).unwrap();
        let mut data = vec![0u8; m * rb];
        for r in 0..m {
            let x: Vec<f32> = (0..k)
                .map(|_| (rng.signed() + rng.signed() + rng.signed()) * 0.1)
                .collect();
            quantize_row(ty, &x, &mut data[r * rb..(r + 1) * rb]);
        }
        data
    }

    /// The error the 8-bit activations allow: per block, half a step of the activation scale
    /// times the block's sum of |w| (the weights exact), summed; plus f32 rounding.
    fn check(x: &[f32], n: usize, w: QuantMatRef, bias: Option<&[f32]>, got: &[f32]) {
        let (m, k) = (w.rows, w.cols);
        let mut want = vec![0f32; n * m];
        reference(x, n, w, bias, &mut want);
        let rb = w.row_bytes();
        let be = if w.ty.is_k() { 256 } else { 32 };
        let mut row = vec![0f32; k];
        for r in 0..m {
            super::super::dequantize_row(w.ty, &w.data[r * rb..(r + 1) * rb], &mut row);
            for t in 0..n {
                let xr = &x[t * k..(t + 1) * k];
                let mut tol = 0f64;
                let mut mag = 0f64;
                for (xb, wb) in xr.chunks(be).zip(row.chunks(be)) {
                    let amax = xb.iter().fold(0f32, |a, v| a.max(v.abs())) as f64;
                    let sw: f64 = wb.iter().map(|v| v.abs() as f64).sum();
                    tol += 0.5 * amax / 127.0 * sw;
                    mag += xb
                        .iter()
                        .zip(wb)
                        .map(|(a, b)| (a * b).abs() as f64)
                        .sum::<f64>();
                }
                let tol = tol * 1.01 + 1e-5 * mag + 1e-6;
                let (g, e) = (got[t * m + r] as f64, want[t * m + r] as f64);
                assert!(
                    (g - e).abs() <= tol,
                    "{:?} n={n} m={m} k={k} t={t} r={r}: got {g}, want {e}, tol {tol}",
                    w.ty
                );
            }
        }
    }

    fn run(isa: Isa, x: &[f32], n: usize, w: QuantMatRef, bias: Option<&[f32]>) -> Vec<f32> {
        let mut y = vec![f32::NAN; n * w.rows];
        let mut scratch = QuantScratch::new(2, n.max(1), w.cols);
        linear_group_with(
            isa,
            x,
            n,
            &mut [QuantOut { w, bias, y: &mut y }],
            &mut scratch,
        );
        y
    }

    /// Every type, every path this CPU has: within the activation-quantization tolerance of
    /// the dequantized f64 reference, and every path equal to the scalar one to the bit.
    #[test]
    fn linear_quant_all_types_and_paths() {
        let mut rng = Rng(17);
        for ty in QuantType::ALL {
            let k = if ty.is_k() { 512 } else { 96 };
            for &(n, m) in &[(1usize, 37usize), (3, 20), (7, 33), (18, 5)] {
                let data = matrix(ty, m, k, &mut rng);
                let w = QuantMatRef {
                    ty,
                    layout: Layout::Rows,
                    data: &data,
                    rows: m,
                    cols: k,
                };
                let x: Vec<f32> = rng.vec(n * k);
                let bias = rng.vec(m);
                let bias = (n % 2 == 1).then_some(&bias[..]);
                let scalar = run(Isa::Scalar, &x, n, w, bias);
                check(&x, n, w, bias, &scalar);
                for isa in Isa::available() {
                    let y = run(isa, &x, n, w, bias);
                    assert_eq!(bits(&y), bits(&scalar), "{ty:?} {isa:?} n={n} m={m}");
                }
            }
        }
    }

    /// The interleaved layout, on every path this CPU has, gives the row-major scalar path's
    /// bits: every token count (1..4 token tiles and their remainders), row counts that are not
    /// whole groups, with and without bias, on 1 and 2 threads.
    #[test]
    fn interleaved_equals_rows_to_the_bit() {
        use super::super::interleave::{interleave, interleaved_len};
        let mut rng = Rng(31);
        let pools = thread_pools(&[1, 2]);
        for ty in [
            QuantType::Q4_0,
            QuantType::Q4_1,
            QuantType::Q5_0,
            QuantType::Q5_1,
            QuantType::Q8_0,
            QuantType::Q4_K,
            QuantType::Q5_K,
            QuantType::Q6_K,
        ] {
            for &(n, m, k) in &[
                (1usize, 37usize, 768usize),
                (2, 16, 256),
                (3, 20, 512),
                (4, 48, 256),
                (7, 33, 768),
                (18, 5, 256),
                (100, 64, 512),
                (1, 16, 32),
                (5, 19, 96),
                (6, 40, 160),
                (9, 27, 128),
            ] {
                if !k.is_multiple_of(ty.block_elems()) {
                    continue;
                }
                let data = matrix(ty, m, k, &mut rng);
                let rows = QuantMatRef {
                    ty,
                    layout: Layout::Rows,
                    data: &data,
                    rows: m,
                    cols: k,
                };
                let mut inter = vec![0u8; interleaved_len(ty, m, k).unwrap()];
                interleave(ty, &data, m, k, &mut inter);
                let w = QuantMatRef {
                    layout: Layout::Interleaved,
                    data: &inter,
                    ..rows
                };
                let x = rng.vec(n * k);
                let bias = rng.vec(m);
                let bias = (n % 2 == 0).then_some(&bias[..]);
                let want = run(Isa::Scalar, &x, n, rows, bias);
                for isa in Isa::available() {
                    for pool in &pools {
                        let got = pool.install(|| run(isa, &x, n, w, bias));
                        assert_eq!(
                            bits(&got),
                            bits(&want),
                            "{ty:?} {isa:?} n={n} m={m} k={k} threads={}",
                            pool.current_num_threads()
                        );
                    }
                }
                let mut row = vec![0f32; k];
                let mut want_row = vec![0f32; k];
                for r in [0, m / 2, m - 1] {
                    dequantized_row(&w, r, &mut row);
                    dequantized_row(&rows, r, &mut want_row);
                    assert_eq!(bits(&row), bits(&want_row), "{ty:?} row {r}");
                }
            }
        }
    }

    /// The largest integer sums the kernels can meet: every level at its maximum (every byte
    /// 0xFF, the f16 scales 1.0) against activations all at +127 or all at -127. A path whose
    /// narrow (i16) sums could overflow gives other bits than the scalar path's here.
    #[test]
    fn interleaved_extreme_sums_equal_the_scalar_path() {
        use super::super::interleave::{has_layout, interleave, interleaved_len};
        let one = half::f16::from_f32(1.0).to_le_bytes();
        let (m, k, n) = (32usize, 512usize, 5usize);
        for ty in QuantType::ALL.into_iter().filter(|&t| has_layout(t)) {
            let bb = ty.block_bytes();
            let mut block = vec![0xFFu8; bb];
            let f16_fields: &[usize] = match ty {
                QuantType::Q4_K | QuantType::Q5_K => &[0, 2],
                QuantType::Q6_K => &[208],
                QuantType::Q4_1 | QuantType::Q5_1 => &[0, 2],
                _ => &[0],
            };
            for &f in f16_fields {
                block[f..f + 2].copy_from_slice(&one);
            }
            let data: Vec<u8> = block.repeat(m * k / ty.block_elems());
            let rows = QuantMatRef {
                ty,
                layout: Layout::Rows,
                data: &data,
                rows: m,
                cols: k,
            };
            let mut inter = vec![0u8; interleaved_len(ty, m, k).unwrap()];
            interleave(ty, &data, m, k, &mut inter);
            let w = QuantMatRef {
                layout: Layout::Interleaved,
                data: &inter,
                ..rows
            };
            for sign in [1.0f32, -1.0] {
                let x = vec![sign; n * k];
                let want = run(Isa::Scalar, &x, n, rows, None);
                check(&x, n, rows, None, &want);
                for isa in Isa::available() {
                    let got = run(isa, &x, n, w, None);
                    assert_eq!(bits(&got), bits(&want), "{ty:?} {isa:?} x = {sign}");
                }
            }
        }
    }

    /// A token's output row is bitwise the same whatever else shares the call: n = 1 (decode)
    /// against the same row inside n = 2, 7, 33 and 100, at several places, on 1 and 2 threads,
    /// every path, with and without bias; and through a scratch of 8 tokens (chunked calls).
    #[test]
    fn linear_quant_rows_are_batch_invariant() {
        let mut rng = Rng(23);
        let pools = thread_pools(&[1, 2]);
        for ty in QuantType::ALL {
            let k = if ty.is_k() { 768 } else { 160 };
            let m = 41;
            let data = matrix(ty, m, k, &mut rng);
            let w = QuantMatRef {
                ty,
                layout: Layout::Rows,
                data: &data,
                rows: m,
                cols: k,
            };
            let target = rng.vec(k);
            let bias = rng.vec(m);
            for isa in Isa::available() {
                for bias in [None, Some(&bias[..])] {
                    let alone = run(isa, &target, 1, w, bias);
                    for &n in &[2usize, 7, 33, 100] {
                        for at in [0, n / 2, n - 1] {
                            let mut x = rng.vec(n * k);
                            x[at * k..(at + 1) * k].copy_from_slice(&target);
                            for (pi, pool) in pools.iter().enumerate() {
                                let mut y = vec![f32::NAN; n * m];
                                let cap = if pi == 0 { n } else { 8 };
                                let mut scratch = QuantScratch::new(2, cap, k);
                                pool.install(|| {
                                    linear_group_with(
                                        isa,
                                        &x,
                                        n,
                                        &mut [QuantOut { w, bias, y: &mut y }],
                                        &mut scratch,
                                    )
                                });
                                assert_eq!(
                                    bits(&y[at * m..(at + 1) * m]),
                                    bits(&alone),
                                    "{ty:?} {isa:?} n={n} at={at} threads={}",
                                    pool.current_num_threads()
                                );
                            }
                        }
                    }
                }
            }
        }
    }

    /// A group of products of different types (Q4_K_M mixes Q4_K and Q6_K; a 32-weight type
    /// too, so both activation formats are in one call) equals each product alone, to the bit;
    /// an empty group is a no-op.
    #[test]
    fn linear_quant_group_equals_separate_products() {
        let mut rng = Rng(29);
        let k = 512;
        let specs = [
            (QuantType::Q4_K, 45usize),
            (QuantType::Q6_K, 16),
            (QuantType::Q8_0, 7),
            (QuantType::Q4_1, 30),
        ];
        let datas: Vec<Vec<u8>> = specs
            .iter()
            .map(|&(t, m)| matrix(t, m, k, &mut rng))
            .collect();
        let biases: Vec<Vec<f32>> = specs.iter().map(|&(_, m)| rng.vec(m)).collect();
        let mats: Vec<QuantMatRef> = specs
            .iter()
            .zip(&datas)
            .map(|(&(ty, m), d)| QuantMatRef {
                ty,
                layout: Layout::Rows,
                data: d,
                rows: m,
                cols: k,
            })
            .collect();
        let mut scratch = QuantScratch::new(2, 40, k);
        linear_quant_group(&[], 0, &mut [], &mut scratch);
        for isa in Isa::available() {
            for &n in &[1usize, 3, 40] {
                let x = rng.vec(n * k);
                let bias = |i: usize| i.is_multiple_of(2).then_some(&biases[i][..]);
                let alone: Vec<Vec<f32>> = (0..specs.len())
                    .map(|i| run(isa, &x, n, mats[i], bias(i)))
                    .collect();
                let mut ys: Vec<Vec<f32>> =
                    specs.iter().map(|&(_, m)| vec![f32::NAN; n * m]).collect();
                let mut outs: Vec<QuantOut> = ys
                    .iter_mut()
                    .enumerate()
                    .map(|(i, y)| QuantOut {
                        w: mats[i],
                        bias: bias(i),
                        y,
                    })
                    .collect();
                linear_group_with(isa, &x, n, &mut outs, &mut scratch);
                for i in 0..specs.len() {
                    assert_eq!(bits(&ys[i]), bits(&alone[i]), "{isa:?} product {i} n={n}");
                }
            }
        }
    }
}

/// Speed checks (not run by default):
/// `CARGO_PROFILE_DEV_OPT_LEVEL=3 cargo test --lib -- --ignored --nocapture timing_quant`.
#[cfg(test)]
mod timing {
    use super::*;
    use crate::model::kernels::cpu::test_rng::best_of;
    use std::time::Instant;

    /// Plain parallel read of the same bytes (the bandwidth ceiling).
    fn read_all(w: &[u8]) -> u64 {
        w.par_chunks(1 << 16)
            .map(|c| {
                let mut acc = [0u64; 8];
                for ch in c.chunks_exact(64) {
                    for l in 0..8 {
                        acc[l] = acc[l].wrapping_add(u64::from_le_bytes(
                            ch[8 * l..8 * l + 8].try_into().unwrap(),
                        ));
                    }
                }
                acc.iter().fold(0u64, |a, &v| a.wrapping_add(v))
            })
            .reduce(|| 0, |a, b| a.wrapping_add(b))
    }

    #[test]
    #[ignore]
    fn timing_quant() {
        let threads = rayon::current_num_threads();
        let isa = std::env::var("QUANT_ISA").map_or(Isa::detect(), |v| match v.as_str() {
            "scalar" => Isa::Scalar,
            #[cfg(target_arch = "x86_64")]
            "avx2" => Isa::Avx2,
            #[cfg(target_arch = "x86_64")]
            "avx_vnni" => Isa::AvxVnni,
            #[cfg(target_arch = "x86_64")]
            "avx_vnni_evex" => Isa::AvxVnniEvex,
            _ => Isa::detect(),
        });
        assert!(
            Isa::available().contains(&isa),
            "this CPU cannot run {isa:?}"
        );
        println!("{isa:?}, {threads} threads");
        // QUANT_ONE="Q4_K n m k reps [copies]": one configuration only (for `perf stat`);
        // with `copies`, that many distinct matrices in turn, so the weights come from DRAM as
        // in a whole model (the mean over all calls then, not the best).
        if let Ok(one) = std::env::var("QUANT_ONE") {
            let f: Vec<&str> = one.split_whitespace().collect();
            let ty = QuantType::from_name(f[0]).unwrap();
            let [n, m, k, reps] = [1, 2, 3, 4].map(|i| f[i].parse::<usize>().unwrap());
            let copies = f.get(5).map_or(1, |c| c.parse::<usize>().unwrap());
            let rb = ty.row_bytes(k).unwrap();
            let mut row = vec![0u8; rb];
            let xs: Vec<f32> = (0..k)
                .map(|i| ((i * 7919) % 2001) as f32 / 1000.0 - 1.0)
                .collect();
            super::super::quantize_row(ty, &xs, &mut row);
            let mut data: Vec<u8> = (0..m * copies).flat_map(|_| row.iter().copied()).collect();
            // QUANT_LAYOUT=interleaved: the matrices interleaved (m a multiple of 16).
            let layout = match std::env::var("QUANT_LAYOUT").as_deref() {
                Ok("interleaved") => {
                    let mut out = vec![0u8; data.len()];
                    for (src, dst) in data.chunks(m * rb).zip(out.chunks_mut(m * rb)) {
                        super::super::interleave::interleave(ty, src, m, k, dst);
                    }
                    data = out;
                    Layout::Interleaved
                }
                _ => Layout::Rows,
            };
            println!("{layout:?}");
            let mat = |c: usize| QuantMatRef {
                ty,
                layout,
                data: &data[c * m * rb..(c + 1) * m * rb],
                rows: m,
                cols: k,
            };
            let x: Vec<f32> = (0..n * k)
                .map(|i| ((i * 31) % 997) as f32 / 500.0 - 1.0)
                .collect();
            let mut y = vec![0f32; n * m];
            let mut scratch = QuantScratch::new(threads, n, k);
            let mut run = |c: usize| {
                linear_group_with(
                    isa,
                    &x,
                    n,
                    &mut [QuantOut {
                        w: mat(c),
                        bias: None,
                        y: &mut y,
                    }],
                    &mut scratch,
                )
            };
            let (t, tr) = if copies == 1 {
                let t = best_of(reps, || run(0));
                (
                    t,
                    best_of(reps, || {
                        std::hint::black_box(read_all(&data));
                    }),
                )
            } else {
                let t0 = Instant::now();
                for i in 0..reps * copies {
                    run(i % copies);
                }
                let t = t0.elapsed().as_secs_f64() / (reps * copies) as f64;
                let t0 = Instant::now();
                for _ in 0..reps {
                    std::hint::black_box(read_all(&data));
                }
                (t, t0.elapsed().as_secs_f64() / (reps * copies) as f64)
            };
            println!(
                "{one}: {} {:.1} us, {:.1} GMAC/s, {:.1} GB/s of weights (plain read {:.1} GB/s)",
                if copies == 1 { "best" } else { "mean" },
                t * 1e6,
                (n * m * k) as f64 / t / 1e9,
                (m * rb) as f64 / t / 1e9,
                (m * rb) as f64 / tr / 1e9
            );
            return;
        }
        for ty in [
            QuantType::Q4_K,
            QuantType::Q6_K,
            QuantType::Q8_0,
            QuantType::Q4_1,
            QuantType::Q4_0,
            QuantType::Q5_K,
        ] {
            for &(m, k) in &[(2048usize, 2048usize), (8192, 2048)] {
                let rb = ty.row_bytes(k).unwrap();
                // Valid blocks with varied bytes: one quantized row, repeated with noise
                // in the integer bytes (the f16 scales stay finite).
                let mut row = vec![0u8; rb];
                let xs: Vec<f32> = (0..k)
                    .map(|i| ((i * 7919) % 2001) as f32 / 1000.0 - 1.0)
                    .collect();
                super::super::quantize_row(ty, &xs, &mut row);
                let data: Vec<u8> = (0..m).flat_map(|_| row.iter().copied()).collect();
                let w = QuantMatRef {
                    ty,
                    layout: Layout::Rows,
                    data: &data,
                    rows: m,
                    cols: k,
                };
                let x: Vec<f32> = (0..512 * k)
                    .map(|i| ((i * 31) % 997) as f32 / 500.0 - 1.0)
                    .collect();
                let mut y = vec![0f32; 512 * m];
                let mut scratch = QuantScratch::new(threads, 512, k);
                let mut run = |n: usize| {
                    linear_group_with(
                        isa,
                        &x[..n * k],
                        n,
                        &mut [QuantOut {
                            w,
                            bias: None,
                            y: &mut y[..n * m],
                        }],
                        &mut scratch,
                    )
                };
                let (mut t1, mut tr) = (f64::INFINITY, f64::INFINITY);
                for _ in 0..5 {
                    t1 = t1.min(best_of(20, || run(1)));
                    tr = tr.min(best_of(20, || {
                        std::hint::black_box(read_all(&data));
                    }));
                }
                let t8 = best_of(5, || run(8));
                let t512 = best_of(2, || run(512));
                let gb = |t: f64| data.len() as f64 / t / 1e9;
                let gmac = |n: usize, t: f64| (n * m * k) as f64 / t / 1e9;
                println!(
                    "{:5} [{m},{k}] n=1 {:7.1} us {:5.1} GB/s (read {:5.1} GB/s) | n=8 {:7.1} us \
                     {:5.1} GMAC/s | n=512 {:7.2} ms {:6.1} GMAC/s",
                    ty.name(),
                    t1 * 1e6,
                    gb(t1),
                    gb(tr),
                    t8 * 1e6,
                    gmac(8, t8),
                    t512 * 1e3,
                    gmac(512, t512)
                );
            }
        }
    }
}
