//! Decode steps as CUDA graphs: [`DecodeCapture`] is the [`GraphBackend`] the runner lends the
//! graph cache to capture a single GPU's `embed + layers + head` for a padded batch, and
//! [`CapturedStep`] is what it keeps (the graph and the device memory it took). When a step
//! replays a graph and when it runs uncaptured is the runner's (`runner/mod.rs`).

use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::{CudaGraph, DriverError};

use super::stage::CudaStage;
use crate::device::cuda::kernels::CudaKernelError;
use crate::device::cuda::kv::CudaKvPart;
use crate::device::graphs::{CaptureError, GraphBackend};
use crate::device::memory_pool::{Purpose, Reservation};
use crate::model::config::ModelConfig;

/// The decode step of one GPU as a [`GraphBackend`]: captures `embed + layers + head` for a
/// padded batch, reading the plan buffers (already uploaded for this step), the weights and the
/// K/V part.
pub struct DecodeCapture<'a> {
    pub(super) stage: &'a mut CudaStage,
    pub(super) part: &'a mut CudaKvPart,
    pub(super) config: &'a ModelConfig,
}

impl DecodeCapture<'_> {
    /// Everything a decode step of `padded` rows enqueues.
    fn enqueue(&mut self, padded: usize) -> std::result::Result<(), CudaKernelError> {
        let c = self.config;
        self.stage.embed(c, padded)?;
        self.stage.layers(c, padded, self.part)?;
        self.stage.head_rows(c, padded, 0, padded)
    }
}

fn capture_error(e: impl std::fmt::Debug) -> CaptureError {
    let message = format!("{e:?}");
    // The driver's CUDA_ERROR_OUT_OF_MEMORY, or cuBLAS's CUBLAS_STATUS_ALLOC_FAILED from a
    // product inside the capture: both are memory the cache can free by dropping graphs.
    if message.contains("OUT_OF_MEMORY") || message.contains("ALLOC_FAILED") {
        CaptureError::OutOfMemory(message)
    } else {
        CaptureError::Other(message)
    }
}

impl GraphBackend for DecodeCapture<'_> {
    type Graph = CapturedStep;

    fn capture(&mut self, padded: usize) -> std::result::Result<CapturedStep, CaptureError> {
        if padded > self.stage.logit_rows() {
            return Err(CaptureError::Other(format!(
                "{padded} rows exceed the {} rows of the logits buffer",
                self.stage.logit_rows()
            )));
        }
        let stream = self.stage.device.stream.clone();
        // A first run uncaptured: cuBLAS picks and loads its kernels outside the capture (the
        // plan is this step's, so the run writes the K/V the replay writes again).
        self.enqueue(padded).map_err(capture_error)?;
        stream.synchronize().map_err(capture_error)?;
        let (free_before, _) = self
            .stage
            .device
            .memory_info()
            .map_err(CaptureError::Other)?;
        stream
            .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(capture_error)?;
        let enqueued = self.enqueue(padded);
        // The capture ends whatever happened, or the stream stays in capture mode.
        let ended = stream.end_capture(CUgraphInstantiate_flags(0));
        enqueued.map_err(capture_error)?;
        let graph = ended
            .map_err(capture_error)?
            .ok_or_else(|| CaptureError::Other("the capture was invalidated".into()))?;
        graph.upload().map_err(capture_error)?;
        stream.synchronize().map_err(capture_error)?;
        let (free_after, _) = self
            .stage
            .device
            .memory_info()
            .map_err(CaptureError::Other)?;
        let bytes = free_before.saturating_sub(free_after) as u64;
        // Accounted in the device's pool as `graphs` for as long as the graph lives; a pool
        // without room is out of memory, as the cache understands it (it frees graphs, retries).
        let memory = self
            .stage
            .device
            .memory
            .reserve(Purpose::Graphs, bytes)
            .map_err(|r| CaptureError::OutOfMemory(r.to_string()))?;
        Ok(CapturedStep {
            graph,
            bytes,
            _memory: memory,
        })
    }

    fn bytes(&self, graph: &CapturedStep) -> u64 {
        graph.bytes
    }
}

/// A captured decode step and the device memory it took (free memory before its capture minus
/// after its upload).
pub struct CapturedStep {
    graph: CudaGraph,
    bytes: u64,
    /// The pool's `graphs` bytes, released with the graph.
    _memory: Reservation,
}

// SAFETY: CUDA graph objects are not internally synchronized, but may be used from any thread
// when calls on them are serialized. A CapturedStep is made and replayed by the engine thread
// only (the runner that holds the cache moves to that thread once, before its first step).
unsafe impl Send for CapturedStep {}

impl CapturedStep {
    pub(super) fn launch(&self) -> std::result::Result<(), DriverError> {
        self.graph.launch()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Out of memory from the driver or from cuBLAS inside a capture is memory the graph cache
    /// can free; anything else is a failed capture.
    #[test]
    fn capture_errors_are_classified_by_cause() {
        for oom in [
            "DriverError(CUDA_ERROR_OUT_OF_MEMORY, \"out of memory\")",
            "Shape(\"cublasGemmEx: CUBLAS_STATUS_ALLOC_FAILED\")",
        ] {
            assert!(
                matches!(capture_error(oom), CaptureError::OutOfMemory(_)),
                "{oom}"
            );
        }
        let other = "DriverError(CUDA_ERROR_ILLEGAL_ADDRESS, \"an illegal memory access\")";
        assert!(
            matches!(capture_error(other), CaptureError::Other(_)),
            "{other}"
        );
    }
}
