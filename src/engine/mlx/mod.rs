//! mlx-community's quantized checkpoints: a checkpoint directory whose `config.json` has a
//! `quantization` block (`{"group_size": 64, "bits": 4, "mode": "affine", "<module>": {…}}`,
//! as mlx-lm's `quantize_model` writes it) and whose quantized matrices are three tensors:
//! `X.weight` (`uint32`, `bits`-bit integers packed from the low bits up), `X.scales` and
//! `X.biases` (one a group of `group_size` weights, in the model's float type); the weight is
//! `scale·q + bias` (`kernels::affine`).
//!
//! Reading: each matrix's bits and group size come from the block's entry for its module, else
//! its default (mlx-lm quantizes Ouro's exit gate at 8 bits whatever the rest; the shapes alone
//! cannot tell 4 bits in groups of 64 from 8 in groups of 32), and its tensors' shapes are
//! checked against them. For the host kernels the matrices are read into the weight arena as
//! blocks (`TensorFiles::read_affine_into_arena`); anything else (another device, the exit
//! gate, a matrix the kernels do not stream) is dequantized ([`dequantize`]). Writing (`spex quantize --type
//! mlx-4bit`): [`quantize_rows`] and `write`.

use std::collections::HashMap;

use candle_core::{DType, Device, Shape, Tensor};
use serde_json::Value;

use super::kernels::{AffineKind, affine_weight, pack_affine as pack, unpack_affine as unpack};

pub mod write;

/// config.json's key for the block.
pub const QUANTIZATION: &str = "quantization";

/// The module path mlx-lm's Ouro quantizes at 8 bits whatever the file's bits (its
/// `quant_predicate`).
pub const EXIT_GATE_MODULE: &str = "model.early_exit_gate";

/// The kind a `{group_size, bits, mode}` object names, or the field at fault and why.
fn kind_of(
    object: &serde_json::Map<String, Value>,
    at: &str,
) -> Result<AffineKind, (String, String)> {
    let field = |key: &str| format!("{at}.{key}");
    if let Some(mode) = object.get("mode")
        && mode.as_str() != Some("affine")
    {
        return Err((
            field("mode"),
            format!("{mode} is not a mode spex reads (\"affine\")"),
        ));
    }
    let number = |key: &str| {
        (object.get(key).and_then(Value::as_u64))
            .ok_or_else(|| (field(key), "missing or not a whole number".to_string()))
    };
    let (bits, group) = (number("bits")?, number("group_size")?);
    let known = |list: &[String]| list.join(", ");
    if !AffineKind::BITS.iter().any(|&b| u64::from(b) == bits) {
        let list: Vec<String> = AffineKind::BITS.iter().map(u32::to_string).collect();
        return Err((
            field("bits"),
            format!("{bits} is not a width spex reads ({})", known(&list)),
        ));
    }
    if !AffineKind::GROUP_SIZES.iter().any(|&g| g as u64 == group) {
        let list: Vec<String> = AffineKind::GROUP_SIZES
            .iter()
            .map(usize::to_string)
            .collect();
        return Err((
            field("group_size"),
            format!("{group} is not a group size spex reads ({})", known(&list)),
        ));
    }
    AffineKind::new(bits as u32, group as usize)
        .ok_or_else(|| (field("bits"), "not a kind spex reads".to_string()))
}

/// config.json's `quantization` block: the file's kind and each module's own, where mlx-lm
/// recorded one (`false`: left dense).
#[derive(Debug, Clone, PartialEq)]
pub struct Quantization {
    /// The kind of every quantized module without an entry of its own.
    pub kind: AffineKind,
    /// Modules with an entry of their own, by path (`model.early_exit_gate`).
    pub modules: HashMap<String, Option<AffineKind>>,
}

impl Quantization {
    /// Parses the block, every per-module entry checked too. An error is the field
    /// (`quantization.bits`) and why.
    pub fn parse(block: &Value) -> Result<Self, (String, String)> {
        let object = block
            .as_object()
            .ok_or_else(|| (QUANTIZATION.to_string(), "expected an object".to_string()))?;
        let kind = kind_of(object, QUANTIZATION)?;
        let mut modules = HashMap::new();
        for (key, value) in object {
            let entry = match value {
                Value::Object(entry) => Some(kind_of(entry, &format!("{QUANTIZATION}.{key}"))?),
                Value::Bool(true) => Some(kind),
                Value::Bool(false) => None,
                _ if ["bits", "group_size", "mode"].contains(&key.as_str()) => continue,
                _ => {
                    return Err((
                        format!("{QUANTIZATION}.{key}"),
                        "expected an object or a boolean".to_string(),
                    ));
                }
            };
            modules.insert(key.clone(), entry);
        }
        Ok(Self { kind, modules })
    }

    /// The kind of weight `name` (`X.weight`, module `X`) where it is quantized.
    pub fn kind_of(&self, name: &str) -> AffineKind {
        let module = name.strip_suffix(".weight").unwrap_or(name);
        self.modules
            .get(module)
            .copied()
            .flatten()
            .unwrap_or(self.kind)
    }

    /// The block as mlx-lm writes it.
    pub fn to_json(&self) -> Value {
        let entry = |k: AffineKind| serde_json::json!({"group_size": k.group(), "bits": k.bits(), "mode": "affine"});
        let mut block = entry(self.kind);
        if let Some(map) = block.as_object_mut() {
            let mut modules: Vec<_> = self.modules.iter().collect();
            modules.sort_by(|a, b| a.0.cmp(b.0));
            for (module, kind) in modules {
                map.insert(module.clone(), kind.map_or(Value::Bool(false), entry));
            }
        }
        block
    }
}

/// The names of weight `name`'s scales and biases (`X.weight` → `X.scales`, `X.biases`).
pub fn companions(name: &str) -> Option<(String, String)> {
    let stem = name.strip_suffix(".weight")?;
    Some((format!("{stem}.scales"), format!("{stem}.biases")))
}

/// A quantized matrix's three tensors, read: packed words `[rows, inner·bits/32]`, and scales
/// and biases `[rows, groups]` widened to f32.
pub struct Stored {
    /// The packed integers, as little-endian bytes.
    pub packed: Vec<u8>,
    /// One scale a group, row-major.
    pub scales: Vec<f32>,
    /// One bias a group.
    pub biases: Vec<f32>,
    /// Rows.
    pub rows: usize,
    /// Weights a row.
    pub inner: usize,
}

impl Stored {
    /// Checks that its tensors hold `rows` rows of `inner` weights of `kind`; an error says
    /// why not.
    pub fn check(&self, kind: AffineKind) -> Result<(), String> {
        let groups = self.rows * self.inner / kind.group();
        let packed = self.rows * self.inner / kind.group() * kind.packed_bytes();
        if !self.inner.is_multiple_of(kind.group())
            || self.scales.len() != groups
            || self.biases.len() != groups
            || self.packed.len() != packed
        {
            return Err(format!(
                "{} packed bytes, {} scales and {} biases for {} rows are not {} weights a row \
                 in {} (config.json's `quantization`)",
                self.packed.len(),
                self.scales.len(),
                self.biases.len(),
                self.rows,
                self.inner,
                kind.name()
            ));
        }
        Ok(())
    }

    /// Its blocks in the kernels' layout, row after row: each group's scale and bias, then
    /// its packed bytes as mlx packs them (the kernels' order too).
    pub fn blocks(&self, kind: AffineKind, out: &mut Vec<u8>) {
        let packed = self.packed.chunks_exact(kind.packed_bytes());
        for ((&s, &b), bytes) in self.scales.iter().zip(&self.biases).zip(packed) {
            out.extend_from_slice(&s.to_le_bytes());
            out.extend_from_slice(&b.to_le_bytes());
            out.extend_from_slice(bytes);
        }
    }

    /// Its weights, dequantized by the kernels' one rule (`kernels::affine_weight`).
    pub fn dequantize(&self, kind: AffineKind) -> Vec<f32> {
        let packed = kind.packed_bytes();
        let mut q = vec![0u8; kind.group()];
        let mut out = Vec::with_capacity(self.rows * self.inner);
        for (i, (&s, &b)) in self.scales.iter().zip(&self.biases).enumerate() {
            unpack(kind, &self.packed[i * packed..(i + 1) * packed], &mut q);
            out.extend(q.iter().map(|&q| affine_weight(s, q, b)));
        }
        out
    }
}

/// `rows` rows of `w` quantized to `kind` by an affine min–max rule: per group, the scale
/// spans its minimum to its maximum in `2^bits − 1` steps and the bias is the minimum, both
/// rounded to `scale_dtype` first so that the integers are chosen against the values stored.
/// (mlx's own `quantize` also keeps zero exact; any affine rule reads back alike.)
/// The packed bytes, scales and biases (as f32 of `scale_dtype`'s values).
pub fn quantize_rows(
    w: &[f32],
    kind: AffineKind,
    scale_dtype: DType,
) -> (Vec<u8>, Vec<f32>, Vec<f32>) {
    let top = ((1u32 << kind.bits()) - 1) as f32;
    let round = |v: f32| match scale_dtype {
        DType::BF16 => half::bf16::from_f32(v).to_f32(),
        DType::F16 => half::f16::from_f32(v).to_f32(),
        _ => v,
    };
    let (mut packed, mut scales, mut biases) = (Vec::new(), Vec::new(), Vec::new());
    let mut q = vec![0u8; kind.group()];
    for group in w.chunks_exact(kind.group()) {
        let lo = group.iter().copied().fold(f32::INFINITY, f32::min);
        let hi = group.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let scale = round(((hi - lo) / top).max(1e-7));
        let bias = round(lo);
        for (q, &v) in q.iter_mut().zip(group) {
            *q = ((v - bias) / scale).round().clamp(0.0, top) as u8;
        }
        pack(kind, &q, &mut packed);
        scales.push(scale);
        biases.push(bias);
    }
    (packed, scales, biases)
}

/// The matrix dequantized to an f32 tensor `[rows, inner]` on `device`.
pub fn dequantize(
    stored: &Stored,
    kind: AffineKind,
    device: &Device,
) -> candle_core::Result<Tensor> {
    Tensor::from_vec(stored.dequantize(kind), (stored.rows, stored.inner), device)
}

/// The host tensor of `stored`'s blocks: `[rows, groups, ·, ·]` of `U8`
/// ([`AffineKind::dims`]).
pub fn blocks_shape(kind: AffineKind, rows: usize, inner: usize) -> Shape {
    let [a, b] = kind.dims();
    Shape::from((rows, inner / kind.group(), a, b))
}
