//! The CUDA kernels: their `.cu` sources (one file per kernel in `kernels/`, embedded in the
//! library) and their launch wrappers ([`CudaKernels`]).
//!
//! Every kernel has a CPU twin in `rust/model/kernels/cpu/` (`rust/kv/blocks.rs` for the K/V
//! write, `rust/engine/sampler.rs` for argmax), takes f32 activations as the CPU path does, and
//! reads weights and K/V in their stored dtype. `gpu_tests.rs` compares each with its twin on
//! random inputs. Matrix products are not here: they will go through cuBLAS.
//!
//! The wrappers check shapes on the host, because a kernel indexes its buffers unchecked; what
//! only the device can see (a token id, a position, a block id inside a device buffer) the kernels
//! check themselves and answer with NaN (or, for the K/V write, no write) instead of an
//! out-of-bounds access. The caller validates those too (the CPU forward pass already does).

use std::sync::Arc;

use cudarc::driver::{
    CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, CudaView, CudaViewMut,
    DeviceRepr, DriverError, LaunchConfig, PushKernelArg,
};
use cudarc::nvrtc::Ptx;
use half::{bf16, f16};

use super::nvrtc::{CompileOptions, ImageKind, KernelBuildError, KernelCache, Program, Target};
use crate::model::kernels::cpu::attention::AttnRow;
use crate::model::kernels::cpu::rope::RopeTable;

/// The header every kernel includes: `(include name, contents)`.
pub const COMMON_HEADER: (&str, &str) = ("strata_common.cuh", include_str!("kernels/common.cuh"));
const HEADERS: &[(&str, &str)] = &[COMMON_HEADER];

/// One `.cu` file and the `extern "C"` kernels it defines.
#[derive(Clone, Copy, Debug)]
pub struct KernelSource {
    pub file: &'static str,
    pub source: &'static str,
    pub functions: &'static [&'static str],
}

impl KernelSource {
    pub fn program(&self) -> Program<'static> {
        Program {
            name: self.file,
            source: self.source,
            headers: HEADERS,
        }
    }
}

macro_rules! kernel_source {
    ($file:literal, [$($function:literal),+ $(,)?]) => {
        KernelSource {
            file: $file,
            source: include_str!(concat!("kernels/", $file)),
            functions: &[$($function),+],
        }
    };
}

/// Every kernel source.
pub const SOURCES: &[KernelSource] = &[
    kernel_source!(
        "rmsnorm.cu",
        ["rmsnorm_f32", "rmsnorm_inplace_f32", "rmsnorm_rows_f32"]
    ),
    kernel_source!("rope.cu", ["rope_f32"]),
    kernel_source!("swiglu.cu", ["silu_mul_f32"]),
    kernel_source!(
        "embedding.cu",
        ["embedding_f32", "embedding_f16", "embedding_bf16"]
    ),
    kernel_source!("residual.cu", ["add_inplace_f32"]),
    kernel_source!("kv_write.cu", ["kv_write_f32", "kv_write_f16"]),
    kernel_source!(
        "attention.cu",
        ["paged_attention_f32", "paged_attention_f16"]
    ),
    kernel_source!("argmax.cu", ["argmax_f32"]),
    kernel_source!("cast.cu", ["cast_f32_to_bf16", "cast_f32_to_f16"]),
    kernel_source!("bias.cu", ["add_bias_f32"]),
];

/// Threads per block of the row kernels (a multiple of 32: `block_sum` uses full-warp shuffles).
const ROW_THREADS: u32 = 256;
/// Threads per block of the element-wise kernels, and the most blocks they launch (they loop).
const ELEMENTWISE_THREADS: u32 = 256;
const ELEMENTWISE_MAX_BLOCKS: u32 = 65_536;
/// attention.cu's ATTN_WARPS * 32 and ATTN_MAX_HEAD_DIM.
const ATTENTION_THREADS: u32 = 128;
pub const ATTENTION_MAX_HEAD_DIM: usize = 256;
/// The largest grid y dimension (attention's query heads).
const MAX_GRID_Y: usize = 65_535;
/// kv_write.cu's SLOT_SKIP: a padded row, not written.
pub const SLOT_SKIP: u32 = u32::MAX;

#[derive(Debug, thiserror::Error)]
pub enum CudaKernelError {
    #[error(transparent)]
    Build(#[from] KernelBuildError),
    #[error("{what}: {source:?}")]
    Driver { what: String, source: DriverError },
    #[error("{0}")]
    Shape(String),
}

fn driver(what: &str) -> impl FnOnce(DriverError) -> CudaKernelError + '_ {
    move |source| CudaKernelError::Driver {
        what: what.to_string(),
        source,
    }
}

fn shape(ok: bool, why: impl FnOnce() -> String) -> Result<(), CudaKernelError> {
    if ok {
        Ok(())
    } else {
        Err(CudaKernelError::Shape(why()))
    }
}

fn to_u32(what: &str, n: usize) -> Result<u32, CudaKernelError> {
    u32::try_from(n).map_err(|_| CudaKernelError::Shape(format!("{what} = {n} exceeds u32")))
}

/// Where one layer's K/V blocks lie in a cache buffer (layouts in `kernels/kv_write.cu`):
/// `num_blocks` blocks, block `b`'s K at `k_offset + b * block_stride` elements and its V at
/// `v_offset + b * block_stride`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvLayout {
    pub block_size: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub num_blocks: usize,
    /// Elements from one block's K (or V) to the next block's.
    pub block_stride: usize,
    pub k_offset: usize,
    pub v_offset: usize,
}

impl KvLayout {
    /// The CPU pool's layout of one layer: its K array (`num_blocks` blocks), then its V array.
    pub fn per_layer(
        block_size: usize,
        kv_heads: usize,
        head_dim: usize,
        num_blocks: usize,
    ) -> Self {
        let elems = block_size * kv_heads * head_dim;
        KvLayout {
            block_size,
            kv_heads,
            head_dim,
            num_blocks,
            block_stride: elems,
            k_offset: 0,
            v_offset: num_blocks * elems,
        }
    }

    /// Layer `layer` of the engine's device pool, whose blocks are contiguous: each block holds
    /// `layers` layers, each its K then its V (the layout of a block's bytes in the host and
    /// disk tiers, `BlockPool::read_block_part`).
    pub fn block_major(
        block_size: usize,
        kv_heads: usize,
        head_dim: usize,
        num_blocks: usize,
        layers: usize,
        layer: usize,
    ) -> Self {
        let elems = block_size * kv_heads * head_dim;
        KvLayout {
            block_size,
            kv_heads,
            head_dim,
            num_blocks,
            block_stride: layers * 2 * elems,
            k_offset: layer * 2 * elems,
            v_offset: layer * 2 * elems + elems,
        }
    }

    /// Elements of one block's K (or V) in one layer.
    pub fn block_elems(&self) -> usize {
        self.block_size * self.kv_heads * self.head_dim
    }

    /// Checks that a cache buffer of `len` elements holds every block of this layout.
    fn check_cache(&self, len: usize, what: &str) -> Result<(), CudaKernelError> {
        let per_block = self.block_elems();
        shape(per_block > 0 && self.block_stride >= per_block, || {
            format!(
                "{what}: block stride {} under a block of {per_block}",
                self.block_stride
            )
        })?;
        let need = match self.num_blocks {
            0 => Some(0),
            n => (n - 1)
                .checked_mul(self.block_stride)
                .and_then(|e| e.checked_add(self.k_offset.max(self.v_offset)))
                .and_then(|e| e.checked_add(per_block)),
        };
        shape(need.is_some_and(|need| len >= need), || {
            format!("{what}: a cache of {len} elements cannot hold {self:?}")
        })
    }

    /// The kernels' u64 arguments: k_offset, v_offset, block_stride.
    fn offsets(&self) -> [u64; 3] {
        [
            self.k_offset as u64,
            self.v_offset as u64,
            self.block_stride as u64,
        ]
    }
}

/// A weight dtype an embedding table can have on the device.
pub trait TableElem: DeviceRepr {
    fn embedding(k: &CudaKernels) -> &CudaFunction;
}
impl TableElem for f32 {
    fn embedding(k: &CudaKernels) -> &CudaFunction {
        &k.embedding_f32
    }
}
impl TableElem for f16 {
    fn embedding(k: &CudaKernels) -> &CudaFunction {
        &k.embedding_f16
    }
}
impl TableElem for bf16 {
    fn embedding(k: &CudaKernels) -> &CudaFunction {
        &k.embedding_bf16
    }
}

/// A K/V cache element type (f32 for f32 models, f16 otherwise, as on the CPU).
pub trait KvElem: DeviceRepr {
    fn kv_write(k: &CudaKernels) -> &CudaFunction;
    fn attention(k: &CudaKernels) -> &CudaFunction;
}
impl KvElem for f32 {
    fn kv_write(k: &CudaKernels) -> &CudaFunction {
        &k.kv_write_f32
    }
    fn attention(k: &CudaKernels) -> &CudaFunction {
        &k.paged_attention_f32
    }
}
impl KvElem for f16 {
    fn kv_write(k: &CudaKernels) -> &CudaFunction {
        &k.kv_write_f16
    }
    fn attention(k: &CudaKernels) -> &CudaFunction {
        &k.paged_attention_f16
    }
}

/// A half-precision type activations are cast to for a matrix product with weights of that type.
pub trait HalfElem: DeviceRepr {
    fn cast(k: &CudaKernels) -> &CudaFunction;
}
impl HalfElem for bf16 {
    fn cast(k: &CudaKernels) -> &CudaFunction {
        &k.cast_f32_to_bf16
    }
}
impl HalfElem for f16 {
    fn cast(k: &CudaKernels) -> &CudaFunction {
        &k.cast_f32_to_f16
    }
}

/// A RoPE table on the device: `[max_positions, half]` cos and sin, copied from the CPU's.
pub struct DeviceRopeTable {
    pub cos: CudaSlice<f32>,
    pub sin: CudaSlice<f32>,
    pub half: usize,
    pub max_positions: usize,
}

impl DeviceRopeTable {
    pub fn upload(stream: &Arc<CudaStream>, table: &RopeTable) -> Result<Self, CudaKernelError> {
        // The kernel rotates whole heads; Phi's partial rotation has no kernel here yet.
        if table.rotary_dim() != table.head_dim() {
            return Err(CudaKernelError::Shape(format!(
                "partial rotary embeddings ({} of {} dimensions a head) are not supported on \
                 CUDA yet",
                table.rotary_dim(),
                table.head_dim()
            )));
        }
        Ok(DeviceRopeTable {
            cos: stream
                .clone_htod(table.cos())
                .map_err(driver("copying the RoPE cos table"))?,
            sin: stream
                .clone_htod(table.sin())
                .map_err(driver("copying the RoPE sin table"))?,
            half: table.half(),
            max_positions: table.max_positions(),
        })
    }

    /// Device bytes of both tables.
    pub fn bytes(&self) -> usize {
        (self.cos.len() + self.sin.len()) * std::mem::size_of::<f32>()
    }
}

/// The CPU's attention rows as the kernel reads them: `(pos, table_start, table_len)` per row.
pub fn attention_rows(rows: &[AttnRow]) -> Vec<u32> {
    rows.iter()
        .flat_map(|r| [r.pos, r.table_start, r.table_len])
        .collect()
}

/// Every kernel, compiled for one device and loaded into its context.
pub struct CudaKernels {
    /// Kept so the functions stay valid.
    _modules: Vec<Arc<CudaModule>>,
    rmsnorm_f32: CudaFunction,
    rmsnorm_inplace_f32: CudaFunction,
    rmsnorm_rows_f32: CudaFunction,
    rope_f32: CudaFunction,
    silu_mul_f32: CudaFunction,
    embedding_f32: CudaFunction,
    embedding_f16: CudaFunction,
    embedding_bf16: CudaFunction,
    add_inplace_f32: CudaFunction,
    kv_write_f32: CudaFunction,
    kv_write_f16: CudaFunction,
    paged_attention_f32: CudaFunction,
    paged_attention_f16: CudaFunction,
    argmax_f32: CudaFunction,
    cast_f32_to_bf16: CudaFunction,
    cast_f32_to_f16: CudaFunction,
    add_bias_f32: CudaFunction,
}

impl CudaKernels {
    /// Compiles (or reads from `cache`) every kernel as a CUBIN for the context's device, and
    /// loads them.
    pub fn load(ctx: &Arc<CudaContext>, cache: &KernelCache) -> Result<Self, CudaKernelError> {
        let (major, minor) = ctx
            .compute_capability()
            .map_err(driver("reading the compute capability"))?;
        let target = Target::cubin(major as u32, minor as u32);
        let mut modules = Vec::with_capacity(SOURCES.len());
        let mut functions = std::collections::HashMap::new();
        for source in SOURCES {
            let compiled = cache.compile(&source.program(), target, &CompileOptions::default())?;
            let bytes = compiled.image.bytes;
            let image = match compiled.image.kind {
                ImageKind::Cubin => Ptx::from_binary(bytes),
                ImageKind::Ptx => {
                    // cudarc turns PTX text into a C string and panics on a NUL inside.
                    let text = String::from_utf8(bytes)
                        .ok()
                        .filter(|t| !t.contains('\0'))
                        .ok_or_else(|| {
                            CudaKernelError::Shape(format!("{}: the PTX is not text", source.file))
                        })?;
                    Ptx::from_src(text)
                }
            };
            let what = format!("loading {} ({target})", source.file);
            let module = ctx.load_module(image).map_err(driver(&what))?;
            for &name in source.functions {
                let what = format!("finding {name} in {}", source.file);
                functions.insert(name, module.load_function(name).map_err(driver(&what))?);
            }
            modules.push(module);
        }
        let mut take = |name: &str| {
            functions
                .remove(name)
                .ok_or_else(|| CudaKernelError::Shape(format!("no kernel source defines {name}")))
        };
        Ok(CudaKernels {
            rmsnorm_f32: take("rmsnorm_f32")?,
            rmsnorm_inplace_f32: take("rmsnorm_inplace_f32")?,
            rmsnorm_rows_f32: take("rmsnorm_rows_f32")?,
            rope_f32: take("rope_f32")?,
            silu_mul_f32: take("silu_mul_f32")?,
            embedding_f32: take("embedding_f32")?,
            embedding_f16: take("embedding_f16")?,
            embedding_bf16: take("embedding_bf16")?,
            add_inplace_f32: take("add_inplace_f32")?,
            kv_write_f32: take("kv_write_f32")?,
            kv_write_f16: take("kv_write_f16")?,
            paged_attention_f32: take("paged_attention_f32")?,
            paged_attention_f16: take("paged_attention_f16")?,
            argmax_f32: take("argmax_f32")?,
            cast_f32_to_bf16: take("cast_f32_to_bf16")?,
            cast_f32_to_f16: take("cast_f32_to_f16")?,
            add_bias_f32: take("add_bias_f32")?,
            _modules: modules,
        })
    }

    /// `out = rmsnorm(x) * w` per row of `w.len()` (CPU: `rmsnorm::rmsnorm`).
    pub fn rmsnorm(
        &self,
        stream: &CudaStream,
        x: &CudaView<f32>,
        w: &CudaView<f32>,
        eps: f32,
        out: &mut CudaViewMut<f32>,
    ) -> Result<(), CudaKernelError> {
        let d = w.len();
        shape(
            d > 0 && x.len().is_multiple_of(d) && out.len() == x.len(),
            || {
                format!(
                    "rmsnorm: x {} and out {} are not rows of w {d}",
                    x.len(),
                    out.len()
                )
            },
        )?;
        let (rows, d) = (
            to_u32("rmsnorm rows", x.len() / d)?,
            to_u32("rmsnorm d", d)?,
        );
        if rows == 0 {
            return Ok(());
        }
        let mut launch = stream.launch_builder(&self.rmsnorm_f32);
        launch.arg(x).arg(w).arg(out).arg(&rows).arg(&d).arg(&eps);
        // SAFETY: the arguments match rmsnorm_f32's signature, and x and out hold rows * d.
        unsafe { launch.launch(row_config(rows)) }.map_err(driver("rmsnorm_f32"))?;
        Ok(())
    }

    /// In-place RMSNorm per row of `w.len()` (CPU: `rmsnorm::rmsnorm_inplace`).
    pub fn rmsnorm_inplace(
        &self,
        stream: &CudaStream,
        x: &mut CudaViewMut<f32>,
        w: &CudaView<f32>,
        eps: f32,
    ) -> Result<(), CudaKernelError> {
        let d = w.len();
        shape(d > 0 && x.len().is_multiple_of(d), || {
            format!("rmsnorm_inplace: x {} is not rows of w {d}", x.len())
        })?;
        let (rows, d) = (
            to_u32("rmsnorm_inplace rows", x.len() / d)?,
            to_u32("rmsnorm_inplace d", d)?,
        );
        if rows == 0 {
            return Ok(());
        }
        let mut launch = stream.launch_builder(&self.rmsnorm_inplace_f32);
        launch.arg(x).arg(w).arg(&rows).arg(&d).arg(&eps);
        // SAFETY: the arguments match rmsnorm_inplace_f32's signature; x holds rows * d.
        unsafe { launch.launch(row_config(rows)) }.map_err(driver("rmsnorm_inplace_f32"))?;
        Ok(())
    }

    /// `out[r] = rmsnorm(x[index[r]]) * w`: the final norm of the rows that want logits (CPU:
    /// the norm of `picked` rows in `Model::logits`). `x` is `[x_rows, w.len()]`.
    pub fn rmsnorm_rows(
        &self,
        stream: &CudaStream,
        x: &CudaView<f32>,
        w: &CudaView<f32>,
        index: &CudaView<u32>,
        eps: f32,
        out: &mut CudaViewMut<f32>,
    ) -> Result<(), CudaKernelError> {
        let d = w.len();
        shape(
            d > 0 && x.len().is_multiple_of(d) && out.len() == index.len() * d,
            || {
                format!(
                    "rmsnorm_rows: x {} and out {} are not rows of w {d} ({} picked)",
                    x.len(),
                    out.len(),
                    index.len()
                )
            },
        )?;
        let (rows, x_rows, d) = (
            to_u32("rmsnorm_rows rows", index.len())?,
            to_u32("rmsnorm_rows x rows", x.len() / d)?,
            to_u32("rmsnorm_rows d", d)?,
        );
        if rows == 0 {
            return Ok(());
        }
        let mut launch = stream.launch_builder(&self.rmsnorm_rows_f32);
        launch
            .arg(x)
            .arg(w)
            .arg(index)
            .arg(out)
            .arg(&rows)
            .arg(&x_rows)
            .arg(&d)
            .arg(&eps);
        // SAFETY: the arguments match rmsnorm_rows_f32's signature; x holds x_rows * d (the
        // kernel checks each index against x_rows), out rows * d.
        unsafe { launch.launch(row_config(rows)) }.map_err(driver("rmsnorm_rows_f32"))?;
        Ok(())
    }

    /// `out = x` rounded to `T` (bf16 or f16), nearest even: a matrix product's input for
    /// half-precision weights.
    pub fn cast<T: HalfElem>(
        &self,
        stream: &CudaStream,
        x: &CudaView<f32>,
        out: &mut CudaViewMut<T>,
    ) -> Result<(), CudaKernelError> {
        shape(x.len() == out.len(), || {
            format!("cast: x {} and out {} differ", x.len(), out.len())
        })?;
        let n = x.len() as u64;
        if n == 0 {
            return Ok(());
        }
        let mut launch = stream.launch_builder(T::cast(self));
        launch.arg(x).arg(out).arg(&n);
        // SAFETY: the arguments match cast_f32_to_<dtype>'s signature; both hold n elements.
        unsafe { launch.launch(elementwise_config(n)) }.map_err(driver("cast"))?;
        Ok(())
    }

    /// `y[r] += bias` for every row of `y` (`[rows, bias.len()]`).
    pub fn add_bias(
        &self,
        stream: &CudaStream,
        y: &mut CudaViewMut<f32>,
        bias: &CudaView<f32>,
    ) -> Result<(), CudaKernelError> {
        let cols = bias.len();
        shape(cols > 0 && y.len().is_multiple_of(cols), || {
            format!("add_bias: y {} is not rows of bias {cols}", y.len())
        })?;
        let n = y.len() as u64;
        let cols = to_u32("add_bias cols", cols)?;
        if n == 0 {
            return Ok(());
        }
        let mut launch = stream.launch_builder(&self.add_bias_f32);
        launch.arg(y).arg(bias).arg(&n).arg(&cols);
        // SAFETY: the arguments match add_bias_f32's signature; y holds n = rows * cols.
        unsafe { launch.launch(elementwise_config(n)) }.map_err(driver("add_bias_f32"))?;
        Ok(())
    }

    /// Rotates `x` (`[rows, n_heads * head_dim]`) in place, row `t` at `positions[t]` (CPU:
    /// `RopeTable::apply` per row).
    pub fn rope(
        &self,
        stream: &CudaStream,
        x: &mut CudaViewMut<f32>,
        n_heads: usize,
        positions: &CudaView<u32>,
        table: &DeviceRopeTable,
    ) -> Result<(), CudaKernelError> {
        let row_len = n_heads * 2 * table.half;
        let rows = positions.len();
        shape(x.len() == rows * row_len, || {
            format!(
                "rope: x {} is not {rows} rows of {n_heads} heads of {}",
                x.len(),
                2 * table.half
            )
        })?;
        shape(
            table.cos.len() == table.max_positions * table.half
                && table.sin.len() == table.cos.len(),
            || "rope: the table's size is not max_positions * half".to_string(),
        )?;
        let rows = to_u32("rope rows", rows)?;
        let (n_heads, half, max_positions) = (
            to_u32("rope n_heads", n_heads)?,
            to_u32("rope half", table.half)?,
            to_u32("rope max_positions", table.max_positions)?,
        );
        if rows == 0 || row_len == 0 {
            return Ok(());
        }
        let mut launch = stream.launch_builder(&self.rope_f32);
        launch
            .arg(x)
            .arg(&table.cos)
            .arg(&table.sin)
            .arg(positions)
            .arg(&rows)
            .arg(&n_heads)
            .arg(&half)
            .arg(&max_positions);
        // SAFETY: the arguments match rope_f32's signature; x holds rows * n_heads * 2 * half,
        // the tables max_positions * half, and the kernel checks each position against it.
        unsafe { launch.launch(row_config(rows)) }.map_err(driver("rope_f32"))?;
        Ok(())
    }

    /// `gate = silu(gate) * up` (CPU: `swiglu::silu_mul`).
    pub fn silu_mul(
        &self,
        stream: &CudaStream,
        gate: &mut CudaViewMut<f32>,
        up: &CudaView<f32>,
    ) -> Result<(), CudaKernelError> {
        shape(gate.len() == up.len(), || {
            format!("silu_mul: gate {} and up {} differ", gate.len(), up.len())
        })?;
        let n = gate.len() as u64;
        if n == 0 {
            return Ok(());
        }
        let mut launch = stream.launch_builder(&self.silu_mul_f32);
        launch.arg(gate).arg(up).arg(&n);
        // SAFETY: the arguments match silu_mul_f32's signature; both hold n elements.
        unsafe { launch.launch(elementwise_config(n)) }.map_err(driver("silu_mul_f32"))?;
        Ok(())
    }

    /// `x += y` (CPU: the residual adds of the forward pass).
    pub fn add_inplace(
        &self,
        stream: &CudaStream,
        x: &mut CudaViewMut<f32>,
        y: &CudaView<f32>,
    ) -> Result<(), CudaKernelError> {
        shape(x.len() == y.len(), || {
            format!("add_inplace: x {} and y {} differ", x.len(), y.len())
        })?;
        let n = x.len() as u64;
        if n == 0 {
            return Ok(());
        }
        let mut launch = stream.launch_builder(&self.add_inplace_f32);
        launch.arg(x).arg(y).arg(&n);
        // SAFETY: the arguments match add_inplace_f32's signature; both hold n elements.
        unsafe { launch.launch(elementwise_config(n)) }.map_err(driver("add_inplace_f32"))?;
        Ok(())
    }

    /// `out[t]` = row `tokens[t]` of the `[vocab, hidden]` table, widened to f32 (CPU:
    /// `embedding::embed` per token).
    pub fn embedding<T: TableElem>(
        &self,
        stream: &CudaStream,
        table: &CudaView<T>,
        vocab: usize,
        tokens: &CudaView<u32>,
        out: &mut CudaViewMut<f32>,
    ) -> Result<(), CudaKernelError> {
        shape(vocab > 0 && table.len().is_multiple_of(vocab), || {
            format!("embedding: table {} is not {vocab} rows", table.len())
        })?;
        let hidden = table.len() / vocab;
        shape(out.len() == tokens.len() * hidden, || {
            format!(
                "embedding: out {} is not {} rows of {hidden}",
                out.len(),
                tokens.len()
            )
        })?;
        let rows = to_u32("embedding rows", tokens.len())?;
        let (hidden, vocab) = (
            to_u32("embedding hidden", hidden)?,
            to_u32("embedding vocab", vocab)?,
        );
        if rows == 0 || hidden == 0 {
            return Ok(());
        }
        let mut launch = stream.launch_builder(T::embedding(self));
        launch
            .arg(table)
            .arg(tokens)
            .arg(out)
            .arg(&rows)
            .arg(&hidden)
            .arg(&vocab);
        // SAFETY: the arguments match embedding_<dtype>'s signature; the table holds vocab *
        // hidden (the kernel checks each token against vocab), out rows * hidden.
        unsafe { launch.launch(row_config(rows)) }.map_err(driver("embedding"))?;
        Ok(())
    }

    /// Writes row `t` of `k` and `v` (`[rows, kv_heads * head_dim]`) into cache slot `slots[t]`
    /// of the layer `layout` places in `cache` (CPU: `BlockPool::write` per row); a slot of
    /// [`SLOT_SKIP`] is not written.
    pub fn kv_write<T: KvElem>(
        &self,
        stream: &CudaStream,
        k: &CudaView<f32>,
        v: &CudaView<f32>,
        slots: &CudaView<u32>,
        layout: KvLayout,
        cache: &mut CudaViewMut<T>,
    ) -> Result<(), CudaKernelError> {
        let width = layout.kv_heads * layout.head_dim;
        let rows = slots.len();
        shape(k.len() == rows * width && v.len() == k.len(), || {
            format!(
                "kv_write: k {} and v {} are not {rows} rows of {width}",
                k.len(),
                v.len()
            )
        })?;
        layout.check_cache(cache.len(), "kv_write")?;
        let rows = to_u32("kv_write rows", rows)?;
        let args = [
            to_u32("kv_write kv_heads", layout.kv_heads)?,
            to_u32("kv_write head_dim", layout.head_dim)?,
            to_u32("kv_write block_size", layout.block_size)?,
            to_u32("kv_write num_blocks", layout.num_blocks)?,
        ];
        let offsets = layout.offsets();
        if rows == 0 || width == 0 {
            return Ok(());
        }
        let mut launch = stream.launch_builder(T::kv_write(self));
        launch
            .arg(k)
            .arg(v)
            .arg(cache)
            .arg(&offsets[0])
            .arg(&offsets[1])
            .arg(&offsets[2])
            .arg(slots)
            .arg(&rows)
            .arg(&args[0])
            .arg(&args[1])
            .arg(&args[2])
            .arg(&args[3]);
        // SAFETY: the arguments match kv_write_<dtype>'s signature; k and v hold rows * width,
        // the cache every block of the layout (check_cache), and the kernel skips slots past
        // num_blocks.
        unsafe { launch.launch(row_config(rows)) }.map_err(driver("kv_write"))?;
        Ok(())
    }

    /// Paged GQA attention for every row over the layer `layout` places in `cache` (CPU:
    /// `attention::paged_attention`). `rows` is [`attention_rows`] of the CPU's `AttnRow`s; `q`
    /// and `out` are `[rows, n_heads * head_dim]`; `window` is the sliding window, if any.
    #[allow(clippy::too_many_arguments)]
    pub fn paged_attention<T: KvElem>(
        &self,
        stream: &CudaStream,
        q: &CudaView<f32>,
        rows: &CudaView<u32>,
        tables: &CudaView<u32>,
        cache: &CudaView<T>,
        layout: KvLayout,
        n_heads: usize,
        scale: f32,
        window: Option<usize>,
        out: &mut CudaViewMut<f32>,
    ) -> Result<(), CudaKernelError> {
        let KvLayout {
            kv_heads, head_dim, ..
        } = layout;
        shape(
            kv_heads > 0 && n_heads.is_multiple_of(kv_heads) && n_heads <= MAX_GRID_Y,
            || format!("attention: {n_heads} query heads over {kv_heads} K/V heads"),
        )?;
        shape(head_dim > 0 && head_dim <= ATTENTION_MAX_HEAD_DIM, || {
            format!("attention: head_dim {head_dim} is not in 1..={ATTENTION_MAX_HEAD_DIM}")
        })?;
        shape(rows.len().is_multiple_of(3), || {
            "attention: rows is not (pos, table_start, table_len) triples".to_string()
        })?;
        let n_rows = rows.len() / 3;
        shape(
            q.len() == n_rows * n_heads * head_dim && out.len() == q.len(),
            || {
                format!(
                    "attention: q {} and out {} are not {n_rows} rows of {n_heads} x {head_dim}",
                    q.len(),
                    out.len()
                )
            },
        )?;
        layout.check_cache(cache.len(), "attention")?;
        let window = match window {
            None => 0,
            Some(0) => return Err(CudaKernelError::Shape("attention: window 0".into())),
            Some(w) => to_u32("attention window", w)?,
        };
        let n_rows = to_u32("attention rows", n_rows)?;
        let dims = [
            to_u32("attention tables", tables.len())?,
            to_u32("attention n_heads", n_heads)?,
            to_u32("attention kv_heads", kv_heads)?,
            to_u32("attention head_dim", head_dim)?,
            to_u32("attention block_size", layout.block_size)?,
            to_u32("attention num_blocks", layout.num_blocks)?,
        ];
        let offsets = layout.offsets();
        if n_rows == 0 {
            return Ok(());
        }
        let mut launch = stream.launch_builder(T::attention(self));
        launch
            .arg(q)
            .arg(rows)
            .arg(tables)
            .arg(&dims[0])
            .arg(cache)
            .arg(&offsets[0])
            .arg(&offsets[1])
            .arg(&offsets[2])
            .arg(out)
            .arg(&n_rows)
            .arg(&dims[1])
            .arg(&dims[2])
            .arg(&dims[3])
            .arg(&dims[4])
            .arg(&dims[5])
            .arg(&scale)
            .arg(&window);
        let config = LaunchConfig {
            grid_dim: (n_rows, dims[1], 1),
            block_dim: (ATTENTION_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the arguments match paged_attention_<dtype>'s signature; q and out hold
        // n_rows * n_heads * head_dim, the cache every block of the layout (check_cache); the
        // kernel checks each row's table range, position and block ids against tables_len and
        // num_blocks.
        unsafe { launch.launch(config) }.map_err(driver("paged_attention"))?;
        Ok(())
    }
}

impl CudaKernels {
    /// `out[t]` = the index of row `t`'s largest logit, the first on ties, NaN never (CPU: the
    /// greedy sampler's `argmax` in `rust/engine/sampler.rs`).
    pub fn argmax(
        &self,
        stream: &CudaStream,
        logits: &CudaView<f32>,
        vocab: usize,
        out: &mut CudaViewMut<u32>,
    ) -> Result<(), CudaKernelError> {
        shape(vocab > 0 && logits.len() == out.len() * vocab, || {
            format!(
                "argmax: logits {} are not {} rows of {vocab}",
                logits.len(),
                out.len()
            )
        })?;
        let rows = to_u32("argmax rows", out.len())?;
        let vocab = to_u32("argmax vocab", vocab)?;
        if rows == 0 {
            return Ok(());
        }
        let mut launch = stream.launch_builder(&self.argmax_f32);
        launch.arg(logits).arg(out).arg(&rows).arg(&vocab);
        // SAFETY: the arguments match argmax_f32's signature; logits hold rows * vocab, out rows.
        unsafe { launch.launch(row_config(rows)) }.map_err(driver("argmax_f32"))?;
        Ok(())
    }
}

/// One block of [`ROW_THREADS`] per row.
fn row_config(rows: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (rows, 1, 1),
        block_dim: (ROW_THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Enough blocks for `n` elements, at most [`ELEMENTWISE_MAX_BLOCKS`] (the kernels loop).
fn elementwise_config(n: u64) -> LaunchConfig {
    let blocks = n
        .div_ceil(ELEMENTWISE_THREADS as u64)
        .clamp(1, ELEMENTWISE_MAX_BLOCKS as u64) as u32;
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (ELEMENTWISE_THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::cuda::nvrtc::Origin;
    use crate::device::cuda::test_support::nvrtc_or_skip;

    /// Every kernel compiles for A100 (sm_80) and H100 (sm_90), as CUBIN and as PTX, with every
    /// warning an error and ptxas warning on register spills; the PTX defines exactly the
    /// functions the wrappers look up.
    #[test]
    fn every_kernel_compiles_for_sm80_and_sm90_without_warnings() {
        if nvrtc_or_skip("every_kernel_compiles_for_sm80_and_sm90_without_warnings").is_none() {
            return;
        }
        let dir = tempfile::tempdir().expect("a temp dir");
        let cache = KernelCache::at(dir.path());
        let strict = CompileOptions { strict: true };
        for source in SOURCES {
            for target in [
                Target::cubin(8, 0),
                Target::cubin(9, 0),
                Target::ptx(8, 0),
                Target::ptx(9, 0),
            ] {
                let compiled = cache
                    .compile(&source.program(), target, &strict)
                    .unwrap_or_else(|e| panic!("{}: {e}", source.file));
                assert_eq!(compiled.origin, Origin::Nvrtc);
                assert_eq!(compiled.log, "", "{} for {target}", source.file);
                assert!(!compiled.image.bytes.is_empty());
                if target.kind == ImageKind::Ptx {
                    let ptx = String::from_utf8(compiled.image.bytes).expect("PTX is text");
                    let entries: Vec<&str> = ptx
                        .lines()
                        .filter_map(|l| l.trim().strip_prefix(".visible .entry "))
                        .map(|l| l.split('(').next().unwrap_or(l).trim())
                        .collect();
                    let mut want = source.functions.to_vec();
                    want.sort();
                    let mut got = entries.clone();
                    got.sort();
                    assert_eq!(got, want, "{} for {target}", source.file);
                    assert!(ptx.contains(&format!(
                        ".target sm_{}{}",
                        target.arch.major, target.arch.minor
                    )));
                } else {
                    // An ELF image, holding each kernel's name.
                    assert_eq!(&compiled.image.bytes[..4], b"\x7fELF");
                    for name in source.functions {
                        let needle = name.as_bytes();
                        assert!(
                            compiled
                                .image
                                .bytes
                                .windows(needle.len())
                                .any(|w| w == needle),
                            "{name} not in the {target} image of {}",
                            source.file
                        );
                    }
                }
            }
        }
        assert_eq!(cache.nvrtc_compiles(), SOURCES.len() * 4);
    }

    /// Every `.cu` file of `kernels/` is a source (a file left out of `SOURCES` is never
    /// compiled, and its wrapper fails only on a GPU, at load).
    #[test]
    fn every_cu_file_is_a_source() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("rust/device/cuda/kernels");
        let mut files: Vec<String> = std::fs::read_dir(&dir)
            .expect("the kernels folder")
            .filter_map(|e| e.ok()?.file_name().into_string().ok())
            .filter(|name| name.ends_with(".cu"))
            .collect();
        files.sort();
        let mut sources: Vec<String> = SOURCES.iter().map(|s| s.file.to_string()).collect();
        sources.sort();
        assert_eq!(files, sources);
    }

    #[test]
    fn every_function_has_a_source_once() {
        let mut all: Vec<&str> = SOURCES
            .iter()
            .flat_map(|s| s.functions.iter().copied())
            .collect();
        let n = all.len();
        all.sort();
        all.dedup();
        assert_eq!(all.len(), n, "a function name appears in two sources");
        for source in SOURCES {
            for name in source.functions {
                assert!(
                    source.source.contains(&format!("void {name}("))
                        || source.source.contains(&format!("    {name}(")),
                    "{name} is not defined in {}",
                    source.file
                );
            }
        }
    }
}
