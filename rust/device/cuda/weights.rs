//! A model's tensors on one GPU of the layer split: the matrices in their file's dtype, the 1-D
//! tensors (norms, biases) as the f32 copies the CPU model made at load, the RoPE table.
//!
//! Device `d` of a split holds its own layers, the embedding when it is the first device, the
//! final norm and the head when it is the last (a tied head is a second copy of the embedding
//! when the two ends are on different devices): what `Model::stage_weight_bytes` accounts.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream};

use super::blas::DeviceMatrix;
use super::kernels::{CudaKernelError, DeviceRopeTable};
use crate::model::weights::Tensor;
use crate::model::Model;

fn upload_error(what: String) -> impl FnOnce(cudarc::driver::DriverError) -> CudaKernelError {
    move |source| CudaKernelError::Driver { what, source }
}

/// A weight matrix copied to the device as stored.
fn matrix(
    stream: &Arc<CudaStream>,
    t: &Tensor,
    what: &str,
) -> Result<DeviceMatrix, CudaKernelError> {
    // The engine interleaves for the CPU only; the device kernels read ggml's rows.
    assert!(
        !t.is_interleaved(),
        "{what}: interleaved blocks reached the GPU upload"
    );
    let data = stream
        .clone_htod(t.bytes())
        .map_err(upload_error(format!("copying {what} to the device")))?;
    Ok(DeviceMatrix {
        data,
        dtype: t.dtype,
        rows: t.shape[0],
        cols: t.shape.get(1).copied().unwrap_or(1),
    })
}

fn vector(
    stream: &Arc<CudaStream>,
    v: &[f32],
    what: &str,
) -> Result<CudaSlice<f32>, CudaKernelError> {
    stream
        .clone_htod(v)
        .map_err(upload_error(format!("copying {what} to the device")))
}

fn optional(
    stream: &Arc<CudaStream>,
    v: &Option<Vec<f32>>,
    what: &str,
) -> Result<Option<CudaSlice<f32>>, CudaKernelError> {
    v.as_deref().map(|v| vector(stream, v, what)).transpose()
}

/// One transformer layer on the device.
pub struct LayerOnDevice {
    pub attn_norm: CudaSlice<f32>,
    pub q_proj: DeviceMatrix,
    pub k_proj: DeviceMatrix,
    pub v_proj: DeviceMatrix,
    pub o_proj: DeviceMatrix,
    pub q_bias: Option<CudaSlice<f32>>,
    pub k_bias: Option<CudaSlice<f32>>,
    pub v_bias: Option<CudaSlice<f32>>,
    pub o_bias: Option<CudaSlice<f32>>,
    pub q_norm: Option<CudaSlice<f32>>,
    pub k_norm: Option<CudaSlice<f32>>,
    pub mlp_norm: CudaSlice<f32>,
    pub gate_proj: DeviceMatrix,
    pub up_proj: DeviceMatrix,
    pub down_proj: DeviceMatrix,
}

/// What one device of the split holds of the model.
pub struct StageWeights {
    /// The first device's: the token embedding.
    pub embed: Option<DeviceMatrix>,
    /// This device's layers, in order (layer `layers.start + i` of the model is `layers[i]`).
    pub layers: Vec<LayerOnDevice>,
    pub first_layer: usize,
    /// The last device's: the final norm and the LM head (`None` on the last device too when
    /// the model ties the head to the embedding and this device holds that: see [`Self::head`]).
    pub norm: Option<CudaSlice<f32>>,
    pub lm_head: Option<DeviceMatrix>,
    /// Every device rotates its own layers' q and k.
    pub rope: DeviceRopeTable,
}

impl StageWeights {
    /// Copies the tensors of `layers` (and the ends, per `first` and `last`) to the device.
    pub fn upload(
        stream: &Arc<CudaStream>,
        model: &Model,
        layers: std::ops::Range<usize>,
        first: bool,
        last: bool,
    ) -> Result<StageWeights, CudaKernelError> {
        let first_layer = layers.start;
        let mut on_device = Vec::with_capacity(layers.len());
        for i in layers {
            let l = &model.layers[i];
            let name = |t: &str| format!("layer {i}'s {t}");
            // The runner refuses mixture-of-experts models before any upload.
            let mlp = l.dense_mlp().ok_or_else(|| {
                CudaKernelError::Shape(format!("layer {i} has experts; the CUDA backend does not"))
            })?;
            on_device.push(LayerOnDevice {
                attn_norm: vector(stream, &l.attn_norm, &name("input norm"))?,
                q_proj: matrix(stream, &l.q_proj, &name("q_proj"))?,
                k_proj: matrix(stream, &l.k_proj, &name("k_proj"))?,
                v_proj: matrix(stream, &l.v_proj, &name("v_proj"))?,
                o_proj: matrix(stream, &l.o_proj, &name("o_proj"))?,
                q_bias: optional(stream, &l.q_bias, &name("q bias"))?,
                k_bias: optional(stream, &l.k_bias, &name("k bias"))?,
                v_bias: optional(stream, &l.v_bias, &name("v bias"))?,
                o_bias: optional(stream, &l.o_bias, &name("o bias"))?,
                q_norm: optional(stream, &l.q_norm, &name("q norm"))?,
                k_norm: optional(stream, &l.k_norm, &name("k norm"))?,
                mlp_norm: vector(stream, &l.mlp_norm, &name("post-attention norm"))?,
                gate_proj: matrix(stream, &mlp.gate_proj, &name("gate_proj"))?,
                up_proj: matrix(stream, &mlp.up_proj, &name("up_proj"))?,
                down_proj: matrix(stream, &mlp.down_proj, &name("down_proj"))?,
            });
        }
        let embed = first
            .then(|| matrix(stream, &model.embed, "the token embedding"))
            .transpose()?;
        let tied_here = model.config.tie_word_embeddings && first;
        let norm = last
            .then(|| vector(stream, &model.norm, "the final norm"))
            .transpose()?;
        let lm_head = (last && !tied_here)
            .then(|| matrix(stream, &model.lm_head, "the LM head"))
            .transpose()?;
        Ok(StageWeights {
            embed,
            layers: on_device,
            first_layer,
            norm,
            lm_head,
            rope: DeviceRopeTable::upload(stream, &model.rope)?,
        })
    }

    /// The LM head: its own matrix, or the embedding a tied model shares with it.
    pub fn head(&self) -> Option<&DeviceMatrix> {
        self.lm_head.as_ref().or(self.embed.as_ref())
    }
}
