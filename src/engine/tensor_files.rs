//! Reads the tensors of `*.safetensors` files one at a time with plain file reads, as a
//! `VarBuilder` backend. candle's memory-mapped backend leaves every page of the file
//! resident until the map is dropped, so loading a model on the CPU peaked at twice its size;
//! reading tensor by tensor peaks at the model plus one tensor. `checkpoint.rs` is its only
//! user.

use std::collections::HashMap;
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use candle_core::{DType, Device, Shape, Tensor};
use candle_nn::var_builder::SimpleBackend;
use safetensors::tensor::{Metadata, TensorInfo};

use super::error::{EngineError, Result};
use super::kernels::AffineKind;
use super::memory::{Arena, ArenaElement};
use super::mlx::{self, Stored};

/// Headers beyond this are not a plausible safetensors file (the format caps them at 100 MB).
const MAX_HEADER_BYTES: u64 = 100_000_000;

struct Shard {
    path: PathBuf,
    file: Mutex<File>,
    /// Where the tensor data starts: after the 8-byte length and the JSON header.
    data_start: u64,
    tensors: HashMap<String, TensorInfo>,
}

/// The tensors of one checkpoint's safetensors files, read on demand.
pub struct TensorFiles {
    shards: Vec<Shard>,
    /// The checkpoint's mlx quantization, where it has one: the kind of each packed matrix.
    quantization: Option<mlx::Quantization>,
}

impl TensorFiles {
    /// Opens every file and reads its header; a file that is not safetensors, or whose
    /// tensors point past its end, is an error naming it.
    pub fn open(paths: &[PathBuf]) -> Result<Self> {
        let shards = paths.iter().map(|p| open_shard(p)).collect::<Result<_>>()?;
        Ok(Self {
            shards,
            quantization: None,
        })
    }

    /// The same files, their packed matrices read as `quantization` says.
    pub fn with_quantization(self, quantization: Option<mlx::Quantization>) -> Self {
        Self {
            quantization,
            ..self
        }
    }

    fn find(&self, name: &str) -> Option<(&Shard, &TensorInfo)> {
        self.shards
            .iter()
            .find_map(|s| s.tensors.get(name).map(|info| (s, info)))
    }

    /// Reads the tensors `specs` (name and shape) into one host arena of `T`, each straight
    /// from its file where it is stored as `T` (one copy, no tensor in between), else read and
    /// converted; `progress(bytes)` after each. The arena's views, by name.
    pub fn read_into_arena<T: ArenaElement>(
        &self,
        specs: &[(String, Shape)],
        progress: &mut dyn FnMut(u64),
    ) -> candle_core::Result<HashMap<String, Tensor>> {
        let shapes: Vec<Shape> = specs.iter().map(|(_, shape)| shape.clone()).collect();
        let mut arena = Arena::<T>::new(&shapes)?;
        for (i, (name, shape)) in specs.iter().enumerate() {
            let slot = arena.slot_mut(i);
            if !self.read_stored_into(name, shape, T::DTYPE, bytemuck::cast_slice_mut(slot))? {
                let data = self.get(
                    shape.clone(),
                    name,
                    candle_nn::Init::Const(0.0),
                    T::DTYPE,
                    &Device::Cpu,
                )?;
                slot.copy_from_slice(&data.flatten_all()?.to_vec1::<T>()?);
            }
            progress(std::mem::size_of_val(slot) as u64);
        }
        let views = arena.finish(&Device::Cpu)?;
        Ok(specs
            .iter()
            .map(|(name, _)| name.clone())
            .zip(views)
            .collect())
    }

    /// Reads tensor `name`'s bytes straight into `dst` where it is stored as `dtype` (true),
    /// else reads nothing (false: the caller converts); an error if it is missing or its shape
    /// is not `shape`.
    fn read_stored_into(
        &self,
        name: &str,
        shape: &Shape,
        dtype: DType,
        dst: &mut [u8],
    ) -> candle_core::Result<bool> {
        let Some((shard, info)) = self.find(name) else {
            return Err(candle_core::Error::CannotFindTensor {
                path: name.to_string(),
            });
        };
        if weight_dtype(info.dtype).is_none() {
            return Ok(false); // `read` names the type.
        }
        if info.shape != shape.dims() {
            return Err(candle_core::Error::UnexpectedShape {
                msg: format!("shape mismatch for {name}"),
                expected: shape.clone(),
                got: info.shape.clone().into(),
            });
        }
        let (start, end) = info.data_offsets;
        if DType::try_from(info.dtype).ok() != Some(dtype) || end - start != dst.len() {
            return Ok(false);
        }
        let mut file = shard
            .file
            .lock()
            .map_err(|_| candle_core::Error::Msg("a tensor read panicked".into()))?;
        file.seek(SeekFrom::Start(shard.data_start + start as u64))?;
        file.read_exact(dst)?;
        Ok(true)
    }

    /// Tensor `name`'s bytes as stored, and its table entry.
    fn read_bytes(&self, name: &str) -> candle_core::Result<(Vec<u8>, &TensorInfo)> {
        let (shard, info) =
            self.find(name)
                .ok_or_else(|| candle_core::Error::CannotFindTensor {
                    path: name.to_string(),
                })?;
        let (start, end) = info.data_offsets;
        let mut bytes = vec![0u8; end - start];
        let mut file = shard
            .file
            .lock()
            .map_err(|_| candle_core::Error::Msg("a tensor read panicked".into()))?;
        file.seek(SeekFrom::Start(shard.data_start + start as u64))?;
        file.read_exact(&mut bytes)?;
        Ok((bytes, info))
    }

    /// Whether the files store weight `name` as mlx's packed words with scales beside them.
    pub fn is_quantized(&self, name: &str) -> bool {
        mlx::companions(name).is_some_and(|(scales, _)| self.find(&scales).is_some())
    }

    /// Weight `name` where the files store it as mlx's three tensors (`engine::mlx`): the
    /// packed words, scales and biases, checked to agree with config.json's kind for it
    /// (`None` where it has no scales).
    pub fn read_quantized(&self, name: &str) -> candle_core::Result<Option<(Stored, AffineKind)>> {
        let Some((scales, biases)) = mlx::companions(name).filter(|_| self.is_quantized(name))
        else {
            return Ok(None);
        };
        let bad = |why: String| candle_core::Error::Msg(format!("tensor {name}: {why}"));
        let kind = (self.quantization.as_ref())
            .map(|q| q.kind_of(name))
            .ok_or_else(|| {
                bad("packed beside scales, but config.json has no `quantization`".into())
            })?;
        let (packed, info) = self.read_bytes(name)?;
        let (rows, words) = match (info.dtype, info.shape.as_slice()) {
            (safetensors::Dtype::U32, &[rows, words]) => (rows, words),
            (dtype, shape) => {
                return Err(bad(format!(
                    "{dtype:?} {shape:?}: mlx stores a quantized matrix as 2-d uint32 words"
                )));
            }
        };
        let inner = words * 32 / kind.bits() as usize;
        if inner == 0 || !inner.is_multiple_of(kind.group()) {
            return Err(bad(format!(
                "{words} words a row are {inner} weights of {} bits: no whole groups of {} \
                 (config.json's `quantization`)",
                kind.bits(),
                kind.group()
            )));
        }
        let float = |n: &str| -> candle_core::Result<Vec<f32>> {
            let t = self.read(n, &Device::Cpu)?;
            if t.dims() != [rows, inner / kind.group()] {
                return Err(bad(format!(
                    "{n} is {:?}, expected [{rows}, {}] for {}",
                    t.dims(),
                    inner / kind.group(),
                    kind.name()
                )));
            }
            t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()
        };
        let stored = Stored {
            packed,
            scales: float(&scales)?,
            biases: float(&biases)?,
            rows,
            inner,
        };
        stored.check(kind).map_err(bad)?;
        Ok(Some((stored, kind)))
    }

    /// Reads the quantized matrices among `specs` into one host arena of blocks
    /// (`mlx::blocks_shape`), each checked to have its spec's dense shape; the arena's views,
    /// by name.
    pub fn read_affine_into_arena(
        &self,
        specs: &[(String, Shape)],
        progress: &mut dyn FnMut(u64),
    ) -> candle_core::Result<HashMap<String, Tensor>> {
        let mut read = Vec::new();
        for (name, shape) in specs {
            let Some((stored, kind)) = self.read_quantized(name)? else {
                continue;
            };
            if shape.dims() != [stored.rows, stored.inner] {
                return Err(candle_core::Error::UnexpectedShape {
                    msg: format!("shape mismatch for {name}"),
                    expected: shape.clone(),
                    got: (stored.rows, stored.inner).into(),
                });
            }
            read.push((name.clone(), stored, kind));
        }
        let shapes: Vec<Shape> = (read.iter())
            .map(|(_, s, kind)| mlx::blocks_shape(*kind, s.rows, s.inner))
            .collect();
        let mut arena = Arena::<u8>::new(&shapes)?;
        let mut blocks = Vec::new();
        for (i, (_, stored, kind)) in read.iter().enumerate() {
            blocks.clear();
            stored.blocks(*kind, &mut blocks);
            arena.slot_mut(i).copy_from_slice(&blocks);
            progress(blocks.len() as u64);
        }
        let views = arena.finish(&Device::Cpu)?;
        Ok(read
            .into_iter()
            .map(|(name, _, _)| name)
            .zip(views)
            .collect())
    }

    /// Every tensor's name, in no particular order.
    pub fn names(&self) -> Vec<String> {
        (self.shards.iter())
            .flat_map(|s| s.tensors.keys().cloned())
            .collect()
    }

    /// The tensor as stored (its file dtype), on `device`; an mlx-quantized matrix
    /// dequantized to f32.
    pub fn read(&self, name: &str, device: &Device) -> candle_core::Result<Tensor> {
        if let Some((stored, kind)) = self.read_quantized(name)? {
            return mlx::dequantize(&stored, kind, device);
        }
        let (bytes, info) = self.read_bytes(name)?;
        let dtype = weight_dtype(info.dtype).ok_or_else(|| {
            candle_core::Error::Msg(format!(
                "{name} is stored as {:?}, a type spex cannot read as weights (f32, bf16 and \
                 f16 are read)",
                info.dtype
            ))
        })?;
        Tensor::from_raw_buffer(&bytes, dtype, &info.shape, &Device::Cpu)?.to_device(device)
    }
}

fn open_shard(path: &Path) -> Result<Shard> {
    let bad =
        |why: String| EngineError::file(path, format!("not a readable safetensors file: {why}"));
    let mut file = File::open(path).map_err(|e| EngineError::file(path, e))?;
    let file_len = file
        .metadata()
        .map_err(|e| EngineError::file(path, e))?
        .len();
    let mut len = [0u8; 8];
    file.read_exact(&mut len)
        .map_err(|_| bad(format!("{file_len} bytes, shorter than the header length")))?;
    let header_len = u64::from_le_bytes(len);
    if header_len > MAX_HEADER_BYTES || 8 + header_len > file_len {
        return Err(bad(format!(
            "header length {header_len} in a {file_len}-byte file"
        )));
    }
    let mut header = vec![0u8; header_len as usize];
    file.read_exact(&mut header)
        .map_err(|e| bad(e.to_string()))?;
    let metadata: Metadata = serde_json::from_slice(&header).map_err(|e| bad(e.to_string()))?;
    let data_start = 8 + header_len;
    let data_len = file_len - data_start;
    let tensors: HashMap<String, TensorInfo> = metadata
        .tensors()
        .into_iter()
        .map(|(name, info)| (name, info.clone()))
        .collect();
    if let Some((name, info)) = tensors
        .iter()
        .find(|(_, i)| i.data_offsets.0 > i.data_offsets.1 || i.data_offsets.1 as u64 > data_len)
    {
        return Err(bad(format!(
            "tensor {name} ends at byte {} of {data_len} (truncated?)",
            info.data_offsets.1
        )));
    }
    Ok(Shard {
        path: path.to_path_buf(),
        file: Mutex::new(file),
        data_start,
        tensors,
    })
}

/// `tensor` if it has `shape`, else candle's shape error naming tensor `name` (what every
/// `VarBuilder` backend here answers for a wrong shape).
pub(crate) fn expect_shape(
    tensor: Tensor,
    shape: Shape,
    name: &str,
) -> candle_core::Result<Tensor> {
    if tensor.shape() != &shape {
        return Err(candle_core::Error::UnexpectedShape {
            msg: format!("shape mismatch for {name}"),
            expected: shape,
            got: tensor.shape().clone(),
        });
    }
    Ok(tensor)
}

impl SimpleBackend for TensorFiles {
    fn get(
        &self,
        shape: Shape,
        name: &str,
        _: candle_nn::Init,
        dtype: DType,
        device: &Device,
    ) -> candle_core::Result<Tensor> {
        expect_shape(self.read(name, device)?, shape, name)?.to_dtype(dtype)
    }

    fn get_unchecked(
        &self,
        name: &str,
        dtype: DType,
        device: &Device,
    ) -> candle_core::Result<Tensor> {
        self.read(name, device)?.to_dtype(dtype)
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.find(name).is_some()
    }
}

/// A `VarBuilder` backend that serves some tensors from memory (the host's weight arena, read
/// by [`TensorFiles::read_into_arena`]) and the rest from the files.
pub struct Preloaded {
    pub files: TensorFiles,
    pub tensors: HashMap<String, Tensor>,
}

impl SimpleBackend for Preloaded {
    fn get(
        &self,
        shape: Shape,
        name: &str,
        init: candle_nn::Init,
        dtype: DType,
        device: &Device,
    ) -> candle_core::Result<Tensor> {
        match self.tensors.get(name) {
            // Quantized blocks, as they are (`read_affine_into_arena` checked the shape).
            Some(tensor) if tensor.dtype() == DType::U8 => Ok(tensor.clone()),
            // Read with this shape into the arena (`read_stored_into` checked it).
            Some(tensor) if tensor.shape() == &shape => tensor.to_dtype(dtype),
            _ => self.files.get(shape, name, init, dtype, device),
        }
    }

    fn get_unchecked(
        &self,
        name: &str,
        dtype: DType,
        device: &Device,
    ) -> candle_core::Result<Tensor> {
        match self.tensors.get(name) {
            Some(tensor) => tensor.to_dtype(dtype),
            None => self.files.get_unchecked(name, dtype, device),
        }
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.tensors.contains_key(name) || self.files.contains_tensor(name)
    }
}

impl std::fmt::Debug for TensorFiles {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let paths: Vec<&Path> = self.shards.iter().map(|s| s.path.as_path()).collect();
        f.debug_struct("TensorFiles")
            .field("files", &paths)
            .finish()
    }
}

/// The candle type of a weight stored as `dtype`: the float types checkpoints hold. An
/// integer or 8-bit float tensor would be read as numbers it does not mean.
fn weight_dtype(dtype: safetensors::Dtype) -> Option<DType> {
    match DType::try_from(dtype).ok()? {
        d @ (DType::F32 | DType::BF16 | DType::F16) => Some(d),
        _ => None,
    }
}
