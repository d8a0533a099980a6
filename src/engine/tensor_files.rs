//! Reads the tensors of `*.safetensors` files one at a time with plain file reads, as a
//! `VarBuilder` backend. candle's memory-mapped backend leaves every page of the file
//! resident until the map is dropped, so loading a model on the CPU peaked at twice its size
//! (measured: 11.5 GB for Ouro-1.4B's shape in f32); reading tensor by tensor peaks at the
//! model plus one tensor. `checkpoint.rs` is its only user.

use std::collections::HashMap;
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use candle_core::{DType, Device, Shape, Tensor};
use candle_nn::var_builder::SimpleBackend;
use safetensors::tensor::{Metadata, TensorInfo};

use super::error::{EngineError, Result};

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
}

impl TensorFiles {
    /// Opens every file and reads its header; a file that is not safetensors, or whose
    /// tensors point past its end, is an error naming it.
    pub fn open(paths: &[PathBuf]) -> Result<Self> {
        let shards = paths.iter().map(|p| open_shard(p)).collect::<Result<_>>()?;
        Ok(Self { shards })
    }

    fn find(&self, name: &str) -> Option<(&Shard, &TensorInfo)> {
        self.shards
            .iter()
            .find_map(|s| s.tensors.get(name).map(|info| (s, info)))
    }

    /// The tensor as stored (its file dtype), on `device`.
    fn read(&self, name: &str, device: &Device) -> candle_core::Result<Tensor> {
        let (shard, info) =
            self.find(name)
                .ok_or_else(|| candle_core::Error::CannotFindTensor {
                    path: name.to_string(),
                })?;
        let dtype = DType::try_from(info.dtype)?;
        let (start, end) = info.data_offsets;
        let mut bytes = vec![0u8; end - start];
        {
            let mut file = shard
                .file
                .lock()
                .map_err(|_| candle_core::Error::Msg("a tensor read panicked".into()))?;
            file.seek(SeekFrom::Start(shard.data_start + start as u64))?;
            file.read_exact(&mut bytes)?;
        }
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

impl SimpleBackend for TensorFiles {
    fn get(
        &self,
        shape: Shape,
        name: &str,
        _: candle_nn::Init,
        dtype: DType,
        device: &Device,
    ) -> candle_core::Result<Tensor> {
        let tensor = self.read(name, device)?;
        if tensor.shape() != &shape {
            return Err(candle_core::Error::UnexpectedShape {
                msg: format!("shape mismatch for {name}"),
                expected: shape,
                got: tensor.shape().clone(),
            });
        }
        tensor.to_dtype(dtype)
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

impl std::fmt::Debug for TensorFiles {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let paths: Vec<&Path> = self.shards.iter().map(|s| s.path.as_path()).collect();
        f.debug_struct("TensorFiles")
            .field("files", &paths)
            .finish()
    }
}
