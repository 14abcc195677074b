//! safetensors files (one, or shards named by model.safetensors.index.json), memory-mapped.
//!
//! Tensors stay in the file's dtype inside the map: the model holds views into it, never a copy.
//! The header is parsed here rather than by the `safetensors` crate so that every failure names
//! the file and the tensor (truncated data, bad dtype, shape mismatch).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use half::{bf16, f16};
use memmap2::Mmap;
use serde_json::Value;

use crate::error::{Result, StrataError};
use crate::model::huge_pages::OwnedBytes;
use crate::model::kernels::cpu::quant::{dequantize_row, quantize_row, QuantType};
use crate::model::kernels::cpu::{MatRef, WeightData};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DType {
    F32,
    F16,
    Bf16,
    /// A ggml block format (GGUF files): rows are runs of blocks, read in place.
    Quant(QuantType),
}

impl DType {
    /// Bytes of one element, for the element types (a block format has no element size).
    pub fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::Bf16 => 2,
            // A block's scale is an f16: blocks are 2-byte aligned at most.
            DType::Quant(_) => 2,
        }
    }

    /// Lowercase name: "f32", "bf16", "q4_k".
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::Bf16 => "bf16",
            DType::Quant(q) => q.lower_name(),
        }
    }

    /// Bytes of a row of `cols` elements (`None` for a block format when `cols` is not a whole
    /// number of blocks).
    pub fn row_bytes(self, cols: usize) -> Option<usize> {
        match self {
            DType::Quant(q) => q.row_bytes(cols),
            _ => cols.checked_mul(self.size()),
        }
    }
}

/// Where one tensor lives: which map, at which byte range.
#[derive(Clone, Debug)]
struct TensorEntry {
    file: usize,
    dtype: DType,
    shape: Vec<usize>,
    start: usize,
    end: usize,
}

pub struct SafetensorsFiles {
    paths: Vec<PathBuf>,
    maps: Vec<Arc<Mmap>>,
    tensors: BTreeMap<String, TensorEntry>,
    /// Tensors handed out so far; `check_all_used` reports the rest as extra.
    used: std::cell::RefCell<BTreeSet<String>>,
}

/// A tensor view into a map. `Arc` keeps the map alive as long as any view exists. A tensor
/// whose offset in the file is not aligned for its dtype (legal, rare) gets an aligned copy, and
/// a tensor quantized at load ([`Tensor::quantize`]) owns its blocks.
#[derive(Clone)]
pub struct Tensor {
    map: Arc<Mmap>,
    pub dtype: DType,
    pub shape: Vec<usize>,
    start: usize,
    len: usize,
    /// Owned bytes, used instead of the map's: an aligned copy when the file offset is not
    /// aligned for the dtype, the blocks of a tensor quantized at load, or interleaved ones.
    owned: Option<Arc<OwnedBytes>>,
    /// Whether the owned blocks are in the interleaved layout (`quant::interleave`).
    interleaved: bool,
}

impl Tensor {
    /// The stored bytes, in the file's dtype (a GPU backend uploads them as they are).
    pub fn bytes(&self) -> &[u8] {
        if let Some(owned) = &self.owned {
            return owned.bytes();
        }
        &self.map[self.start..self.start + self.len]
    }

    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    pub fn data(&self) -> WeightData<'_> {
        let b = self.bytes();
        let n = self.numel();
        // SAFETY: alignment was checked (or fixed by realigning) at load; length is numel * size;
        // every bit pattern is a valid f32/f16/bf16.
        unsafe {
            match self.dtype {
                DType::Quant(q) if self.interleaved => WeightData::Interleaved(q, b),
                DType::Quant(q) => WeightData::Quant(q, b),
                DType::F32 => {
                    WeightData::F32(std::slice::from_raw_parts(b.as_ptr() as *const f32, n))
                }
                DType::F16 => {
                    WeightData::F16(std::slice::from_raw_parts(b.as_ptr() as *const f16, n))
                }
                DType::Bf16 => {
                    WeightData::Bf16(std::slice::from_raw_parts(b.as_ptr() as *const bf16, n))
                }
            }
        }
    }

    pub fn matrix(&self) -> MatRef<'_> {
        MatRef {
            data: self.data(),
            rows: self.shape[0],
            cols: self.shape[1],
        }
    }

    /// An f32 copy, for the 1-D tensors (norm weights, biases): a negligible fraction of the bytes.
    pub fn to_f32_vec(&self) -> Vec<f32> {
        match self.data() {
            WeightData::F32(x) => x.to_vec(),
            WeightData::F16(x) => x.iter().map(|v| v.to_f32()).collect(),
            WeightData::Bf16(x) => x.iter().map(|v| v.to_f32()).collect(),
            WeightData::Interleaved(..) => unreachable!("to_f32_vec: a matrix, interleaved"),
            WeightData::Quant(q, bytes) => {
                let cols = *self.shape.last().unwrap_or(&0);
                let rows = self.numel() / cols.max(1);
                let mut out = vec![0.0; rows * cols];
                let row_bytes = bytes.len() / rows.max(1);
                for (dst, src) in out
                    .chunks_exact_mut(cols)
                    .zip(bytes.chunks_exact(row_bytes))
                {
                    dequantize_row(q, src, dst);
                }
                out
            }
        }
    }

    /// A `[n, rows, cols]` tensor as its n `[rows, cols]` matrices (a GGUF file's stacked
    /// experts): views of the same bytes, each part a whole number of rows.
    pub fn split_outer(&self) -> Vec<Tensor> {
        let n = self.shape[0];
        let part_len = self.len / n.max(1);
        (0..n)
            .map(|i| self.part(i * part_len, part_len, self.shape[1..].to_vec()))
            .collect()
    }

    /// A `[rows, cols]` matrix as consecutive runs of `rows[i]` rows (Phi-3's fused q/k/v and
    /// gate/up projections): views of the same bytes. The runs must add up to the rows.
    pub fn split_rows(&self, rows: &[usize]) -> Vec<Tensor> {
        assert_eq!(
            rows.iter().sum::<usize>(),
            self.shape[0],
            "split_rows: rows"
        );
        let row_bytes = self.len / self.shape[0].max(1);
        let mut start = 0;
        rows.iter()
            .map(|&r| {
                let part = self.part(start, r * row_bytes, vec![r, self.shape[1]]);
                start += r * row_bytes;
                part
            })
            .collect()
    }

    /// The `len` bytes from byte `offset` of this tensor as a tensor of `shape`.
    fn part(&self, offset: usize, len: usize, shape: Vec<usize>) -> Tensor {
        debug_assert!(!self.interleaved, "parts of an interleaved tensor");
        let (start, owned) = match &self.owned {
            None => (self.start + offset, None),
            // An owned (realigned) tensor: each part gets its own copy of its bytes.
            Some(_) => {
                let mut owned = OwnedBytes::zeroed(len);
                owned
                    .bytes_mut()
                    .copy_from_slice(&self.bytes()[offset..offset + len]);
                (0, Some(Arc::new(owned)))
            }
        };
        Tensor {
            map: self.map.clone(),
            dtype: self.dtype,
            shape,
            start,
            len,
            owned,
            interleaved: false,
        }
    }

    /// Whether the blocks are in the interleaved layout (only the CPU's kernels read it).
    pub fn is_interleaved(&self) -> bool {
        self.interleaved
    }

    pub fn byte_len(&self) -> usize {
        self.len
    }

    /// A view of `len` bytes of `map` from `start` (a GGUF tensor), realigned by a copy when the
    /// offset is not aligned for the dtype (the caller has checked the range and the size).
    pub(crate) fn from_map(
        map: Arc<Mmap>,
        dtype: DType,
        shape: Vec<usize>,
        start: usize,
        len: usize,
    ) -> Tensor {
        let owned = if !start.is_multiple_of(dtype.size()) {
            // The caller checked start..start + len.
            let mut owned = OwnedBytes::zeroed(len);
            owned.bytes_mut().copy_from_slice(&map[start..start + len]);
            Some(Arc::new(owned))
        } else {
            None
        };
        Tensor {
            map,
            dtype,
            shape,
            start,
            len,
            owned,
            interleaved: false,
        }
    }

    /// This `[rows, cols]` float matrix quantized row by row to `ty` (the same blocks as
    /// `strata_rs.quantize`), as a tensor that owns them; the source's pages are not read again.
    /// `cols` must be whole blocks of `ty` (the caller picks a type that fits).
    pub fn quantize(&self, ty: QuantType) -> Tensor {
        use rayon::prelude::*;
        let (rows, cols) = (self.shape[0], self.shape[1]);
        let row_bytes = ty.row_bytes(cols).expect("whole blocks");
        let mut owned = OwnedBytes::zeroed(rows * row_bytes);
        let out = owned.bytes_mut();
        let data = self.data();
        out.par_chunks_mut(row_bytes).enumerate().for_each_init(
            || vec![0f32; cols],
            |row, (r, dst)| {
                let src = r * cols..(r + 1) * cols;
                match data {
                    WeightData::F32(x) => row.copy_from_slice(&x[src]),
                    WeightData::F16(x) => row
                        .iter_mut()
                        .zip(&x[src])
                        .for_each(|(o, v)| *o = v.to_f32()),
                    WeightData::Bf16(x) => row
                        .iter_mut()
                        .zip(&x[src])
                        .for_each(|(o, v)| *o = v.to_f32()),
                    WeightData::Quant(..) | WeightData::Interleaved(..) => {
                        unreachable!("quantize: a quantized source")
                    }
                }
                quantize_row(ty, row, dst);
            },
        );
        Tensor {
            map: self.map.clone(),
            dtype: DType::Quant(ty),
            shape: self.shape.clone(),
            start: 0,
            len: rows * row_bytes,
            owned: Some(Arc::new(owned)),
            interleaved: false,
        }
    }

    /// This quantized `[rows, cols]` matrix in the interleaved layout (the same blocks, grouped
    /// by 16 rows for the x86 kernels), as a tensor that owns them; `None` when this CPU's
    /// kernels do not read its type interleaved or it already is.
    pub fn interleave(&self) -> Option<Tensor> {
        use crate::model::kernels::cpu::quant::interleave::{interleave, interleaved_len, wanted};
        let (DType::Quant(ty), &[rows, cols]) = (self.dtype, &self.shape[..]) else {
            return None;
        };
        if self.interleaved || !wanted(ty) || rows * cols == 0 {
            return None;
        }
        let len = interleaved_len(ty, rows, cols)?;
        let mut owned = OwnedBytes::zeroed(len);
        interleave(ty, self.bytes(), rows, cols, owned.bytes_mut());
        Some(Tensor {
            map: self.map.clone(),
            dtype: self.dtype,
            shape: self.shape.clone(),
            start: 0,
            len,
            owned: Some(Arc::new(owned)),
            interleaved: true,
        })
    }
}

impl SafetensorsFiles {
    /// Opens `model.safetensors`, or the shards listed by `model.safetensors.index.json`.
    pub fn open(dir: &Path) -> Result<SafetensorsFiles> {
        let index = dir.join("model.safetensors.index.json");
        let single = dir.join("model.safetensors");
        let paths = if index.exists() {
            shard_paths(dir, &index)?
        } else if single.exists() {
            vec![single]
        } else {
            return Err(StrataError::model_load(
                dir,
                "no model.safetensors or model.safetensors.index.json in the model folder",
            ));
        };
        let mut files = SafetensorsFiles {
            paths: Vec::new(),
            maps: Vec::new(),
            tensors: BTreeMap::new(),
            used: Default::default(),
        };
        for path in paths {
            files.add_file(path)?;
        }
        Ok(files)
    }

    fn add_file(&mut self, path: PathBuf) -> Result<()> {
        let err = |d: String| StrataError::model_load(&path, d);
        let file = File::open(&path).map_err(|e| err(format!("cannot open: {e}")))?;
        // SAFETY: the map is read-only; a model file changed underneath a running engine is
        // outside what any inference engine can defend against.
        let map = unsafe { Mmap::map(&file) }.map_err(|e| err(format!("cannot map: {e}")))?;
        crate::model::huge_pages::advise_map(&map);
        if map.len() < 8 {
            return Err(err(format!(
                "truncated file: {} bytes, no header",
                map.len()
            )));
        }
        let header_len = u64::from_le_bytes([
            map[0], map[1], map[2], map[3], map[4], map[5], map[6], map[7],
        ]) as usize;
        if header_len > map.len() - 8 {
            return Err(err(format!(
                "truncated file: header of {header_len} bytes but the file has {} bytes",
                map.len()
            )));
        }
        let header: HashMap<String, Value> = serde_json::from_slice(&map[8..8 + header_len])
            .map_err(|e| err(format!("invalid safetensors header: {e}")))?;
        let data_start = 8 + header_len;
        let data_len = map.len() - data_start;
        let file_idx = self.maps.len();
        for (name, info) in header {
            if name == "__metadata__" {
                continue;
            }
            let terr = |d: String| err(format!("tensor {name}: {d}"));
            let dtype = match info.get("dtype").and_then(Value::as_str) {
                Some("F32") => DType::F32,
                Some("F16") => DType::F16,
                Some("BF16") => DType::Bf16,
                Some(other) => {
                    return Err(terr(format!(
                        "unsupported dtype {other} (supported: F32, F16, BF16)"
                    )))
                }
                None => return Err(terr("missing dtype".into())),
            };
            let shape: Vec<usize> = info
                .get("shape")
                .and_then(Value::as_array)
                .and_then(|a| a.iter().map(|d| d.as_u64().map(|d| d as usize)).collect())
                .ok_or_else(|| terr("missing or invalid shape".into()))?;
            let offsets: Vec<usize> = info
                .get("data_offsets")
                .and_then(Value::as_array)
                .and_then(|a| a.iter().map(|d| d.as_u64().map(|d| d as usize)).collect())
                .filter(|o: &Vec<usize>| o.len() == 2 && o[0] <= o[1])
                .ok_or_else(|| terr("missing or invalid data_offsets".into()))?;
            // A header is input: a shape whose size overflows is an error, not a wrapped size.
            let bytes = shape
                .iter()
                .try_fold(dtype.size(), |acc, &d| acc.checked_mul(d))
                .ok_or_else(|| terr(format!("shape {shape:?} is too large")))?;
            if offsets[1] - offsets[0] != bytes {
                return Err(terr(format!(
                    "data_offsets span {} bytes but shape {:?} of {} needs {}",
                    offsets[1] - offsets[0],
                    shape,
                    dtype.name(),
                    bytes
                )));
            }
            if offsets[1] > data_len {
                return Err(terr(format!(
                    "truncated file: the tensor ends at byte {} of the data section but it has {} bytes",
                    offsets[1], data_len
                )));
            }
            let entry = TensorEntry {
                file: file_idx,
                dtype,
                shape,
                start: data_start + offsets[0],
                end: data_start + offsets[1],
            };
            if self.tensors.insert(name.clone(), entry).is_some() {
                return Err(err(format!("tensor {name} appears in more than one shard")));
            }
        }
        self.paths.push(path);
        self.maps.push(Arc::new(map));
        Ok(())
    }

    pub fn path_of(&self, name: &str) -> Option<&Path> {
        self.tensors.get(name).map(|e| self.paths[e.file].as_path())
    }

    /// The tensor `name`, checked against `shape`. Any error names the file and the tensor.
    pub fn get(&self, name: &str, shape: &[usize]) -> Result<Tensor> {
        let e = self.tensors.get(name).ok_or_else(|| {
            let where_ = self
                .paths
                .first()
                .map(|p| p.as_path())
                .unwrap_or(Path::new("."));
            StrataError::model_load(where_, format!("missing tensor {name}"))
        })?;
        if e.shape != shape {
            return Err(StrataError::model_load(
                &self.paths[e.file],
                format!("tensor {name}: shape {:?}, expected {:?}", e.shape, shape),
            ));
        }
        self.used.borrow_mut().insert(name.to_string());
        Ok(Tensor::from_map(
            self.maps[e.file].clone(),
            e.dtype,
            e.shape.clone(),
            e.start,
            e.end - e.start,
        ))
    }

    pub fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    /// Marks tensors that a loader reads of its own accord as known (e.g. rotary inv_freq buffers).
    pub fn ignore(&self, name: &str) {
        self.used.borrow_mut().insert(name.to_string());
    }

    pub fn names(&self) -> impl Iterator<Item = &String> {
        self.tensors.keys()
    }

    /// Every tensor in the files must have been read: an extra tensor means a different model.
    pub fn check_all_used(&self) -> Result<()> {
        let used = self.used.borrow();
        if let Some((name, e)) = self.tensors.iter().find(|(n, _)| !used.contains(*n)) {
            return Err(StrataError::model_load(
                &self.paths[e.file],
                format!("unexpected tensor {name} (not part of this model's architecture)"),
            ));
        }
        Ok(())
    }
}

fn shard_paths(dir: &Path, index: &Path) -> Result<Vec<PathBuf>> {
    let text = std::fs::read_to_string(index)
        .map_err(|e| StrataError::model_load(index, format!("cannot read: {e}")))?;
    let json: Value = serde_json::from_str(&text)
        .map_err(|e| StrataError::model_load(index, format!("invalid JSON: {e}")))?;
    let map = json
        .get("weight_map")
        .and_then(Value::as_object)
        .ok_or_else(|| StrataError::model_load(index, "weight_map: missing or not an object"))?;
    let mut names = BTreeSet::new();
    for (tensor, file) in map {
        let file = file.as_str().ok_or_else(|| {
            StrataError::model_load(index, format!("weight_map.{tensor}: expected a file name"))
        })?;
        // A shard name is a plain file name inside the folder, never a path out of it.
        if file.contains('/') || file.contains('\\') || file == ".." {
            return Err(StrataError::model_load(
                index,
                format!("weight_map.{tensor}: {file:?} is not a file name in the model folder"),
            ));
        }
        names.insert(file.to_string());
    }
    if names.is_empty() {
        return Err(StrataError::model_load(index, "weight_map: empty"));
    }
    Ok(names.into_iter().map(|n| dir.join(n)).collect())
}
