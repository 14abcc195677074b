//! One GPU's part of the engine's K/V pool: every block's K and V for the device's layers, in
//! device memory, block-major (a block's part is one contiguous range, each of its layers' K
//! then V: `KvLayout::block_major`), so that it has the bytes the host and disk tiers keep and a
//! tier move is one copy per block.
//!
//! Moves run on a copy stream of their own, created on the first move (counted), ordered after
//! the compute stream's work with an event, and waited for before they return: a block read out
//! is in host memory on return, a block written in is on the device before the prefill that reads
//! it is enqueued. They go through a pinned host buffer of one block's part when one could be had
//! at load (allocated only when the RAM gate admitted it), else straight from and to pageable
//! memory (slower: the driver stages those copies itself). A driver error fails the move, never
//! the engine: the mover skips it and the prompt is recomputed.

use std::any::Any;
use std::cell::RefCell;
use std::sync::{Arc, OnceLock};

use cudarc::driver::{CudaContext, CudaSlice, CudaStream, CudaView, PinnedHostSlice};

use super::kernels::KvLayout;
use crate::kv::blocks::{DeviceKv, KvDtype};

pub struct CudaKvPart {
    device: String,
    ctx: Arc<CudaContext>,
    compute: Arc<CudaStream>,
    copy: OnceLock<Arc<CudaStream>>,
    data: CudaSlice<u8>,
    part_bytes: usize,
    num_blocks: usize,
    layers: usize,
    block_size: usize,
    kv_heads: usize,
    head_dim: usize,
    kv_dtype: KvDtype,
    /// One block's part of pinned host memory; `None`: moves use pageable memory.
    staging: RefCell<Option<PinnedHostSlice<u8>>>,
}

/// What a device part is made of.
#[derive(Clone, Copy, Debug)]
pub struct KvPartShape {
    pub num_blocks: usize,
    pub layers: usize,
    pub block_size: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub kv_dtype: KvDtype,
}

impl KvPartShape {
    /// Bytes of one block's part: every layer's K and V.
    pub fn part_bytes(&self) -> usize {
        self.layers * 2 * self.block_size * self.kv_heads * self.kv_dtype.row_bytes(self.head_dim)
    }
}

impl CudaKvPart {
    /// Allocates the part (zeroed) on `stream`'s device. `pinned` asks for the pinned staging
    /// buffer (the caller's RAM gate admitted its bytes); a failure to pin only logs and leaves
    /// moves on pageable memory.
    pub fn new(
        device: &str,
        stream: &Arc<CudaStream>,
        shape: KvPartShape,
        pinned: bool,
    ) -> Result<CudaKvPart, String> {
        let part_bytes = shape.part_bytes();
        let bytes = part_bytes.checked_mul(shape.num_blocks).ok_or_else(|| {
            format!(
                "{device}: a K/V pool of {} blocks overflows",
                shape.num_blocks
            )
        })?;
        let data = stream.alloc_zeros::<u8>(bytes).map_err(|e| {
            format!(
                "{device}: allocating the K/V pool ({} MiB): {e:?}",
                bytes >> 20
            )
        })?;
        let ctx = stream.context().clone();
        let staging = if pinned {
            // Not write-combined: the CPU reads it back after every copy out.
            // SAFETY: the bytes are written by a copy before they are read.
            match unsafe { ctx.alloc_pinned_with_flags::<u8>(part_bytes, 0) } {
                Ok(p) => Some(p),
                Err(e) => {
                    log::warn!(target: "strata_rs.cache", "{device}: no pinned staging buffer ({part_bytes} bytes: {e:?}); tier moves use pageable memory");
                    None
                }
            }
        } else {
            None
        };
        Ok(CudaKvPart {
            device: device.to_string(),
            ctx,
            compute: stream.clone(),
            copy: OnceLock::new(),
            data,
            part_bytes,
            num_blocks: shape.num_blocks,
            layers: shape.layers,
            block_size: shape.block_size,
            kv_heads: shape.kv_heads,
            head_dim: shape.head_dim,
            kv_dtype: shape.kv_dtype,
            staging: RefCell::new(staging),
        })
    }

    /// The whole part, for the forward pass's kernels.
    pub fn data(&self) -> &CudaSlice<u8> {
        &self.data
    }

    pub fn data_mut(&mut self) -> &mut CudaSlice<u8> {
        &mut self.data
    }

    pub fn kv_dtype(&self) -> KvDtype {
        self.kv_dtype
    }

    /// Where local layer `layer` (0 for the device's first) lies in the part, in elements.
    pub fn layout(&self, layer: usize) -> KvLayout {
        KvLayout::block_major(
            self.block_size,
            self.kv_heads,
            self.head_dim,
            self.num_blocks,
            self.layers,
            layer,
        )
    }

    /// Whether moves go through pinned memory.
    pub fn has_pinned_staging(&self) -> bool {
        self.staging.borrow().is_some()
    }

    /// The copy stream, made now on the first move, after the compute stream's work so far.
    fn copy_stream(&self) -> Result<&Arc<CudaStream>, String> {
        let copy = match self.copy.get() {
            Some(s) => s,
            None => {
                let s = self
                    .ctx
                    .new_stream()
                    .map_err(|e| format!("{}: creating the copy stream: {e:?}", self.device))?;
                self.copy.get_or_init(|| s)
            }
        };
        let event = self
            .ctx
            .new_event(None)
            .map_err(|e| format!("{}: creating an event: {e:?}", self.device))?;
        event
            .record(&self.compute)
            .and_then(|()| copy.wait(&event))
            .map_err(|e| format!("{}: ordering a copy after compute: {e:?}", self.device))?;
        Ok(copy)
    }

    fn block(&self, block: u32, len: usize) -> Result<CudaView<'_, u8>, String> {
        let b = block as usize;
        if b >= self.num_blocks || len != self.part_bytes {
            return Err(format!(
                "{}: block {b} of {} with {len} bytes for a part of {}",
                self.device, self.num_blocks, self.part_bytes
            ));
        }
        Ok(self
            .data
            .slice(b * self.part_bytes..(b + 1) * self.part_bytes))
    }
}

impl DeviceKv for CudaKvPart {
    fn read_part(&self, block: u32, out: &mut [u8]) -> Result<(), String> {
        let src = self.block(block, out.len())?;
        let copy = self.copy_stream()?;
        let failed = |e| format!("{}: copying block {block} out: {e:?}", self.device);
        let mut staging = self.staging.borrow_mut();
        match staging.as_mut() {
            Some(pinned) => {
                copy.memcpy_dtoh(&src, pinned).map_err(failed)?;
                // The buffer's own event is not recorded with event tracking off (see
                // device.rs), so its accessors would not wait: the stream is waited for here.
                copy.synchronize().map_err(failed)?;
                out.copy_from_slice(pinned.as_slice().map_err(failed)?);
            }
            None => {
                copy.memcpy_dtoh(&src, out).map_err(failed)?;
                copy.synchronize().map_err(failed)?;
            }
        }
        Ok(())
    }

    fn write_part(&mut self, block: u32, data: &[u8]) -> Result<(), String> {
        // Checked like a read, then written through a view of the same range.
        self.block(block, data.len())?;
        let b = block as usize;
        let copy = self.copy_stream()?.clone();
        let failed = |e| format!("{}: copying block {block} in: {e:?}", self.device);
        let mut dst = self
            .data
            .slice_mut(b * self.part_bytes..(b + 1) * self.part_bytes);
        let mut staging = self.staging.borrow_mut();
        match staging.as_mut() {
            Some(pinned) => {
                // Free: every move waits for its copy before it returns.
                pinned.as_mut_slice().map_err(failed)?.copy_from_slice(data);
                copy.memcpy_htod(pinned, &mut dst).map_err(failed)?;
            }
            None => copy.memcpy_htod(data, &mut dst).map_err(failed)?,
        }
        // On the device before anything reads it; the staging buffer free for the next block.
        copy.synchronize().map_err(failed)
    }

    fn bytes(&self) -> usize {
        self.data.len()
    }

    /// 0 before the first move, then 1.
    fn copy_streams(&self) -> usize {
        usize::from(self.copy.get().is_some())
    }

    fn as_any(&self) -> &dyn Any {
        self
    }

    fn as_any_mut(&mut self) -> &mut dyn Any {
        self
    }
}
