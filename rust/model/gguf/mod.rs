//! GGUF model files (llama.cpp's format): the header, the metadata, the tensor table, and the
//! tensors themselves, memory-mapped and left in their stored (often quantized) block format.
//!
//! Layout (little-endian): magic `GGUF`, version (2 or 3), tensor count, metadata count; the
//! metadata (key string, value type, value); the tensor infos (name, dims innermost first, ggml
//! type, offset into the data section); padding to `general.alignment` (32 by default); the data.
//! A model may be split over files named `<name>-00001-of-0000N.gguf`, each with its own header
//! and tensors, the metadata of the model in the first.
//!
//! Every header field is input: counts and lengths are checked against what is left of the file
//! before anything is allocated, and every error names the file and the key or tensor.

pub mod config;
pub mod tokenizer;

use std::collections::{BTreeMap, BTreeSet};
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use memmap2::Mmap;

use crate::error::{Result, StrataError};
use crate::model::kernels::cpu::quant::QuantType;
use crate::model::weights::{DType, Tensor};

/// One metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    U64(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    String(String),
    Array(Vec<Value>),
}

impl Value {
    fn type_name(&self) -> &'static str {
        match self {
            Value::U8(_) => "uint8",
            Value::I8(_) => "int8",
            Value::U16(_) => "uint16",
            Value::I16(_) => "int16",
            Value::U32(_) => "uint32",
            Value::I32(_) => "int32",
            Value::U64(_) => "uint64",
            Value::I64(_) => "int64",
            Value::F32(_) => "float32",
            Value::F64(_) => "float64",
            Value::Bool(_) => "bool",
            Value::String(_) => "string",
            Value::Array(_) => "array",
        }
    }

    /// An integer value of any width, if it is one.
    fn as_i128(&self) -> Option<i128> {
        Some(match *self {
            Value::U8(v) => v.into(),
            Value::I8(v) => v.into(),
            Value::U16(v) => v.into(),
            Value::I16(v) => v.into(),
            Value::U32(v) => v.into(),
            Value::I32(v) => v.into(),
            Value::U64(v) => v.into(),
            Value::I64(v) => v.into(),
            _ => return None,
        })
    }

    fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F32(v) => Some(v.into()),
            Value::F64(v) => Some(v),
            _ => self.as_i128().map(|v| v as f64),
        }
    }
}

/// The metadata of a model (its first file), with getters that name the file and the key in
/// every error.
pub struct Metadata {
    path: PathBuf,
    values: BTreeMap<String, Value>,
}

impl Metadata {
    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn err(&self, key: &str, reason: impl std::fmt::Display) -> StrataError {
        StrataError::model_load(&self.path, format!("{key}: {reason}"))
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.values.get(key)
    }

    pub fn contains(&self, key: &str) -> bool {
        self.values.contains_key(key)
    }

    fn expected(&self, key: &str, what: &str, v: &Value) -> StrataError {
        self.err(key, format!("expected {what}, found {}", v.type_name()))
    }

    pub fn str_opt(&self, key: &str) -> Result<Option<&str>> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(v) => Err(self.expected(key, "a string", v)),
        }
    }

    pub fn str(&self, key: &str) -> Result<&str> {
        self.str_opt(key)?.ok_or_else(|| self.err(key, "missing"))
    }

    pub fn usize_opt(&self, key: &str) -> Result<Option<usize>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => match v.as_i128() {
                Some(i) => usize::try_from(i)
                    .map(Some)
                    .map_err(|_| self.err(key, format!("{i} is not a size"))),
                None => Err(self.expected(key, "an integer", v)),
            },
        }
    }

    pub fn usize(&self, key: &str) -> Result<usize> {
        self.usize_opt(key)?.ok_or_else(|| self.err(key, "missing"))
    }

    pub fn f64_opt(&self, key: &str) -> Result<Option<f64>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_f64()
                .map(Some)
                .ok_or_else(|| self.expected(key, "a number", v)),
        }
    }

    pub fn bool_opt(&self, key: &str) -> Result<Option<bool>> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(v) => Err(self.expected(key, "a bool", v)),
        }
    }

    pub fn u32_opt(&self, key: &str) -> Result<Option<u32>> {
        match self.usize_opt(key)? {
            None => Ok(None),
            Some(v) => u32::try_from(v)
                .map(Some)
                .map_err(|_| self.err(key, format!("{v} does not fit in 32 bits"))),
        }
    }

    fn array(&self, key: &str) -> Result<Option<&[Value]>> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Array(a)) => Ok(Some(a)),
            Some(v) => Err(self.expected(key, "an array", v)),
        }
    }

    pub fn strings_opt(&self, key: &str) -> Result<Option<Vec<String>>> {
        let Some(a) = self.array(key)? else {
            return Ok(None);
        };
        a.iter()
            .enumerate()
            .map(|(i, v)| match v {
                Value::String(s) => Ok(s.clone()),
                v => Err(self.expected(&format!("{key}[{i}]"), "a string", v)),
            })
            .collect::<Result<_>>()
            .map(Some)
    }

    pub fn f32s_opt(&self, key: &str) -> Result<Option<Vec<f32>>> {
        let Some(a) = self.array(key)? else {
            return Ok(None);
        };
        a.iter()
            .enumerate()
            .map(|(i, v)| {
                v.as_f64()
                    .map(|f| f as f32)
                    .ok_or_else(|| self.expected(&format!("{key}[{i}]"), "a number", v))
            })
            .collect::<Result<_>>()
            .map(Some)
    }

    pub fn i32s_opt(&self, key: &str) -> Result<Option<Vec<i32>>> {
        let Some(a) = self.array(key)? else {
            return Ok(None);
        };
        a.iter()
            .enumerate()
            .map(|(i, v)| {
                v.as_i128()
                    .and_then(|x| i32::try_from(x).ok())
                    .ok_or_else(|| self.expected(&format!("{key}[{i}]"), "an int32", v))
            })
            .collect::<Result<_>>()
            .map(Some)
    }

    /// A per-layer integer that files store either once or as one entry per layer: `None` when
    /// absent; an error when the entries differ (models with uneven layers are not supported).
    pub fn uniform_usize_opt(&self, key: &str) -> Result<Option<usize>> {
        let Some(Value::Array(a)) = self.get(key) else {
            return self.usize_opt(key);
        };
        let mut first = None;
        for (i, v) in a.iter().enumerate() {
            let n = v
                .as_i128()
                .and_then(|x| usize::try_from(x).ok())
                .ok_or_else(|| self.expected(&format!("{key}[{i}]"), "a size", v))?;
            match first {
                None => first = Some(n),
                Some(f) if f != n => {
                    return Err(self.err(
                        key,
                        format!("differs between layers ({f} and {n}); not supported"),
                    ))
                }
                Some(_) => {}
            }
        }
        Ok(first)
    }
}

/// The stored type of one tensor (ggml's `ggml_type`, by its GGUF name in messages).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TensorType {
    F32,
    F16,
    Bf16,
    Quant(QuantType),
}

impl TensorType {
    fn from_ggml_id(id: u32) -> Option<TensorType> {
        match id {
            0 => Some(TensorType::F32),
            1 => Some(TensorType::F16),
            30 => Some(TensorType::Bf16),
            _ => QuantType::from_ggml_id(id).map(TensorType::Quant),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            TensorType::F32 => "F32",
            TensorType::F16 => "F16",
            TensorType::Bf16 => "BF16",
            TensorType::Quant(q) => q.name(),
        }
    }

    pub fn dtype(self) -> DType {
        match self {
            TensorType::F32 => DType::F32,
            TensorType::F16 => DType::F16,
            TensorType::Bf16 => DType::Bf16,
            TensorType::Quant(q) => DType::Quant(q),
        }
    }

    /// Bytes of a row of `cols` elements; `None` when `cols` is not a whole number of blocks.
    fn row_bytes(self, cols: usize) -> Option<usize> {
        match self {
            TensorType::F32 => cols.checked_mul(4),
            TensorType::F16 | TensorType::Bf16 => cols.checked_mul(2),
            TensorType::Quant(q) => q.row_bytes(cols),
        }
    }
}

/// ggml type ids that are real formats strata-rs does not read, named in the error.
fn unsupported_type_name(id: u32) -> Option<&'static str> {
    Some(match id {
        16 => "IQ2_XXS",
        17 => "IQ2_XS",
        18 => "IQ3_XXS",
        19 => "IQ1_S",
        21 => "IQ3_S",
        22 => "IQ2_S",
        24 => "I8",
        25 => "I16",
        26 => "I32",
        27 => "I64",
        28 => "F64",
        29 => "IQ1_M",
        34 => "TQ1_0",
        35 => "TQ2_0",
        39 => "MXFP4",
        _ => return None,
    })
}

/// Where one tensor lives.
#[derive(Clone, Debug)]
pub struct TensorInfo {
    /// `[rows, cols]` order (outermost first): GGUF stores the innermost dimension first.
    pub shape: Vec<usize>,
    pub ty: TensorType,
    file: usize,
    start: usize,
    len: usize,
}

/// A GGUF model: its files mapped, the metadata of the first, the tensors of all.
pub struct GgufModel {
    paths: Vec<PathBuf>,
    maps: Vec<Arc<Mmap>>,
    pub metadata: Metadata,
    tensors: BTreeMap<String, TensorInfo>,
    used: std::cell::RefCell<BTreeSet<String>>,
}

/// The largest header counts accepted before checking them against the file: a count past
/// these is a corrupt header, and must not drive an allocation.
const MAX_DIMS: u32 = 4;

impl GgufModel {
    /// Opens `path`, and the other files of its split set when its name says it has some.
    pub fn open(path: &Path) -> Result<GgufModel> {
        let mut model = GgufModel {
            paths: Vec::new(),
            maps: Vec::new(),
            metadata: Metadata {
                path: path.to_path_buf(),
                values: BTreeMap::new(),
            },
            tensors: BTreeMap::new(),
            used: Default::default(),
        };
        let first = model.add_file(path)?;
        model.metadata.values = first;
        let split_count = model.metadata.usize_opt("split.count")?.unwrap_or(1);
        if split_count > 1 {
            let Some(paths) = split_paths(path, split_count) else {
                return Err(model.metadata.err(
                    "split.count",
                    format!(
                        "{split_count} files, but the file name is not <name>-00001-of-{split_count:05}.gguf"
                    ),
                ));
            };
            for (i, p) in paths.iter().enumerate().skip(1) {
                let meta = model.add_file(p)?;
                let no = meta.get("split.no").and_then(Value::as_i128);
                if no != Some(i as i128) {
                    return Err(StrataError::model_load(
                        p,
                        format!("split.no: expected {i}, found {no:?}"),
                    ));
                }
            }
        }
        if let Some(expected) = model.metadata.usize_opt("split.tensors.count")? {
            if expected != model.tensors.len() {
                return Err(model.metadata.err(
                    "split.tensors.count",
                    format!(
                        "{expected} tensors, but the files hold {}",
                        model.tensors.len()
                    ),
                ));
            }
        }
        Ok(model)
    }

    /// The model's files (the first one first).
    pub fn paths(&self) -> &[PathBuf] {
        &self.paths
    }

    pub fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    pub fn info(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.get(name)
    }

    pub fn tensor_names(&self) -> impl Iterator<Item = &String> {
        self.tensors.keys()
    }

    /// The tensor `name`, checked against `shape` (`[rows, cols]`, outermost first). Errors name
    /// the file and the tensor.
    pub fn get(&self, name: &str, shape: &[usize]) -> Result<Tensor> {
        let info = self.tensors.get(name).ok_or_else(|| {
            StrataError::model_load(&self.paths[0], format!("missing tensor {name}"))
        })?;
        let path = &self.paths[info.file];
        if info.shape != shape {
            return Err(StrataError::model_load(
                path,
                format!("tensor {name}: shape {:?}, expected {shape:?}", info.shape),
            ));
        }
        self.used.borrow_mut().insert(name.to_string());
        Ok(Tensor::from_map(
            self.maps[info.file].clone(),
            info.ty.dtype(),
            info.shape.clone(),
            info.start,
            info.len,
        ))
    }

    /// Marks a tensor the loader reads of its own accord (or knowingly skips) as used.
    pub fn ignore(&self, name: &str) {
        self.used.borrow_mut().insert(name.to_string());
    }

    /// Every tensor of the files must have been read: an extra one means another architecture.
    pub fn check_all_used(&self) -> Result<()> {
        let used = self.used.borrow();
        if let Some((name, info)) = self.tensors.iter().find(|(n, _)| !used.contains(*n)) {
            return Err(StrataError::model_load(
                &self.paths[info.file],
                format!("unexpected tensor {name} (not part of this model's architecture)"),
            ));
        }
        Ok(())
    }

    /// Maps one file, reads its header and adds its tensors; returns its metadata.
    fn add_file(&mut self, path: &Path) -> Result<BTreeMap<String, Value>> {
        let err = |d: String| StrataError::model_load(path, d);
        let file = File::open(path).map_err(|e| err(format!("cannot open: {e}")))?;
        // SAFETY: the map is read-only; a model file changed underneath a running engine is
        // outside what any inference engine can defend against.
        let map = unsafe { Mmap::map(&file) }.map_err(|e| err(format!("cannot map: {e}")))?;
        crate::model::huge_pages::advise_map(&map);
        let mut r = Reader {
            buf: &map,
            pos: 0,
            path,
        };
        let magic = r.bytes(4, "magic")?;
        if magic != b"GGUF" {
            return Err(err(format!(
                "not a GGUF file (magic {:?}, expected \"GGUF\")",
                String::from_utf8_lossy(magic)
            )));
        }
        let version = r.u32("version")?;
        if !(2..=3).contains(&version) {
            return Err(err(format!(
                "version: GGUF version {version} is not supported (supported: 2, 3)"
            )));
        }
        let n_tensors = r.u64("tensor_count")?;
        let n_kv = r.u64("metadata_kv_count")?;
        let mut values = BTreeMap::new();
        for i in 0..n_kv {
            let key = r.string(&format!("metadata key #{i}"))?;
            let ty = r.u32(&key)?;
            let v = r.value(&key, ty, 0)?;
            if values.insert(key.clone(), v).is_some() {
                return Err(err(format!("{key}: appears twice")));
            }
        }
        let alignment = match values.get("general.alignment") {
            None => 32,
            Some(Value::U32(a)) if *a > 0 && a.is_power_of_two() => *a as usize,
            Some(v) => {
                return Err(err(format!(
                    "general.alignment: expected a power of two (uint32), found {v:?}"
                )))
            }
        };
        let file_idx = self.maps.len();
        let mut infos = Vec::new();
        for i in 0..n_tensors {
            let name = r.string(&format!("tensor info #{i}"))?;
            let n_dims = r.u32(&format!("tensor {name}: n_dims"))?;
            if n_dims == 0 || n_dims > MAX_DIMS {
                return Err(err(format!(
                    "tensor {name}: {n_dims} dimensions (supported: 1..={MAX_DIMS})"
                )));
            }
            let mut dims = Vec::with_capacity(n_dims as usize);
            for _ in 0..n_dims {
                let d = r.u64(&format!("tensor {name}: dims"))?;
                dims.push(
                    usize::try_from(d)
                        .map_err(|_| err(format!("tensor {name}: dimension {d} is too large")))?,
                );
            }
            let type_id = r.u32(&format!("tensor {name}: type"))?;
            let ty = TensorType::from_ggml_id(type_id).ok_or_else(|| {
                err(match unsupported_type_name(type_id) {
                    Some(t) => format!("tensor {name}: type {t} is not supported"),
                    None => format!("tensor {name}: unknown type id {type_id}"),
                })
            })?;
            let offset = r.u64(&format!("tensor {name}: offset"))?;
            infos.push((name, dims, ty, offset));
        }
        let data_start = r.pos.div_ceil(alignment) * alignment;
        if data_start > map.len() {
            return Err(err(format!(
                "truncated file: the data section starts at byte {data_start} but the file has {} bytes",
                map.len()
            )));
        }
        let data_len = (map.len() - data_start) as u64;
        for (name, dims, ty, offset) in infos {
            let terr = |d: String| err(format!("tensor {name}: {d}"));
            if offset % alignment as u64 != 0 {
                return Err(terr(format!(
                    "offset {offset} is not a multiple of the alignment {alignment}"
                )));
            }
            let cols = dims[0];
            let rows = dims[1..]
                .iter()
                .try_fold(1usize, |a, &d| a.checked_mul(d))
                .ok_or_else(|| terr(format!("dims {dims:?} are too large")))?;
            let row_bytes = ty.row_bytes(cols).ok_or_else(|| {
                terr(format!(
                    "{} rows of {cols} elements are not whole blocks of {}",
                    ty.name(),
                    match ty {
                        TensorType::Quant(q) => q.block_elems(),
                        _ => 1,
                    }
                ))
            })?;
            let len = row_bytes
                .checked_mul(rows)
                .ok_or_else(|| terr(format!("dims {dims:?} are too large")))?;
            if offset
                .checked_add(len as u64)
                .is_none_or(|end| end > data_len)
            {
                return Err(terr(format!(
                    "truncated file: the tensor ends at byte {} of the data section but it has {data_len} bytes",
                    offset as u128 + len as u128
                )));
            }
            let shape: Vec<usize> = dims.iter().rev().copied().collect();
            let info = TensorInfo {
                shape,
                ty,
                file: file_idx,
                start: data_start + offset as usize,
                len,
            };
            if self.tensors.insert(name.clone(), info).is_some() {
                return Err(terr("appears twice".into()));
            }
        }
        self.paths.push(path.to_path_buf());
        self.maps.push(Arc::new(map));
        Ok(values)
    }
}

/// The files of a split set, from the name of its first (`<name>-00001-of-0000N.gguf`).
fn split_paths(first: &Path, count: usize) -> Option<Vec<PathBuf>> {
    let name = first.file_name()?.to_str()?;
    let stem = name.strip_suffix(".gguf")?;
    let suffix = format!("-00001-of-{count:05}");
    let base = stem.strip_suffix(&suffix)?;
    Some(
        (1..=count)
            .map(|i| first.with_file_name(format!("{base}-{i:05}-of-{count:05}.gguf")))
            .collect(),
    )
}

/// The files of the split set `first` begins (read from its name), or `first` alone.
pub fn split_set(first: &Path) -> Vec<PathBuf> {
    let count = first
        .file_name()
        .and_then(|n| n.to_str())
        .and_then(|n| n.strip_suffix(".gguf"))
        .and_then(|stem| stem.rsplit_once("-of-"))
        .and_then(|(_, n)| n.parse::<usize>().ok())
        .filter(|&n| n > 1);
    count
        .and_then(|n| split_paths(first, n))
        .unwrap_or_else(|| vec![first.to_path_buf()])
}

/// Whether `path`'s name marks it as one file of a split set other than the first.
pub fn is_later_split_file(path: &Path) -> bool {
    let Some(name) = path.file_name().and_then(|n| n.to_str()) else {
        return false;
    };
    let Some(stem) = name.strip_suffix(".gguf") else {
        return false;
    };
    let parts: Vec<&str> = stem.rsplitn(4, '-').collect();
    // "<base>-0000K-of-0000N": parts = [N, "of", K, base].
    parts.len() == 4
        && parts[1] == "of"
        && parts[0].len() == 5
        && parts[2].len() == 5
        && parts[0].bytes().all(|b| b.is_ascii_digit())
        && parts[2].bytes().all(|b| b.is_ascii_digit())
        && parts[2] != "00001"
}

/// A cursor over a file's header; every read is bounds-checked and names what it was reading.
struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
    path: &'a Path,
}

/// Deepest nesting of arrays accepted (GGUF files use one level).
const MAX_ARRAY_DEPTH: usize = 2;

impl<'a> Reader<'a> {
    fn truncated(&self, what: &str) -> StrataError {
        StrataError::model_load(
            self.path,
            format!(
                "truncated file: {what} runs past the end ({} bytes)",
                self.buf.len()
            ),
        )
    }

    fn bytes(&mut self, n: usize, what: &str) -> Result<&'a [u8]> {
        if n > self.buf.len() - self.pos {
            return Err(self.truncated(what));
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N]> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.bytes(N, what)?);
        Ok(a)
    }

    fn u32(&mut self, what: &str) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &str) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    fn string(&mut self, what: &str) -> Result<String> {
        let len = self.u64(what)?;
        let len = usize::try_from(len).map_err(|_| self.truncated(what))?;
        let b = self.bytes(len, what)?;
        String::from_utf8(b.to_vec()).map_err(|_| {
            StrataError::model_load(self.path, format!("{what}: a string is not valid UTF-8"))
        })
    }

    fn value(&mut self, key: &str, ty: u32, depth: usize) -> Result<Value> {
        Ok(match ty {
            0 => Value::U8(self.array::<1>(key)?[0]),
            1 => Value::I8(self.array::<1>(key)?[0] as i8),
            2 => Value::U16(u16::from_le_bytes(self.array(key)?)),
            3 => Value::I16(i16::from_le_bytes(self.array(key)?)),
            4 => Value::U32(self.u32(key)?),
            5 => Value::I32(i32::from_le_bytes(self.array(key)?)),
            6 => Value::F32(f32::from_le_bytes(self.array(key)?)),
            7 => match self.array::<1>(key)?[0] {
                0 => Value::Bool(false),
                1 => Value::Bool(true),
                b => {
                    return Err(StrataError::model_load(
                        self.path,
                        format!("{key}: bool byte {b} is neither 0 nor 1"),
                    ))
                }
            },
            8 => Value::String(self.string(key)?),
            9 => {
                if depth >= MAX_ARRAY_DEPTH {
                    return Err(StrataError::model_load(
                        self.path,
                        format!("{key}: arrays nested deeper than {MAX_ARRAY_DEPTH}"),
                    ));
                }
                let item_ty = self.u32(key)?;
                let count = self.u64(key)?;
                // Every item takes at least one byte: a count past the bytes left is corrupt,
                // and must not size an allocation.
                if count > (self.buf.len() - self.pos) as u64 {
                    return Err(self.truncated(key));
                }
                let mut items = Vec::with_capacity(count as usize);
                for _ in 0..count {
                    items.push(self.value(key, item_ty, depth + 1)?);
                }
                Value::Array(items)
            }
            10 => Value::U64(self.u64(key)?),
            11 => Value::I64(i64::from_le_bytes(self.array(key)?)),
            12 => Value::F64(f64::from_le_bytes(self.array(key)?)),
            other => {
                return Err(StrataError::model_load(
                    self.path,
                    format!("{key}: unknown metadata value type {other}"),
                ))
            }
        })
    }
}

#[cfg(test)]
mod tests;
