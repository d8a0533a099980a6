"""What `spex quantize` writes, read by an independent reader: llama.cpp's own `gguf` package
(gguf-py, from PyPI). Checks that the file is GGUF v3 with architecture `ouro` and the shape
keys of the source config.json, that every tensor of the source checkpoint (the exit gate
aside) is in it under llama.cpp's Ouro name with the type llama.cpp's `llama_tensor_get_type`
gives it, and that each Q8_0 or Q4_0 tensor's bytes equal gguf-py's own quantization of the
source tensor (its `attn_q`/`attn_k` rows permuted as llama.cpp's converter does), and its
dequantization lies within the block's rounding of the source. Vectors are F32 and equal.
The types: Q8_0 everywhere in a Q8_0 file (`general.file_type` 7); in a Q4_0 file (2) Q4_0,
the head Q6_K; in a Q4_K_M file (15) Q6_K for the head and for `attn_v` and `ffn_down` where
`use_more_bits`, else Q4_K; in a Q5_K_M file (17) the same with Q5_K for Q4_K; in a Q4_K_S
file (14) Q6_K for the head, Q5_K for the first four `attn_v` and the first eighth of the
`ffn_down`, else Q4_K. gguf-py's dequantization of a K-quant lies within two steps of its
sub-block's range of the source (a row in the wrong order, or a nibble or a fifth bit in the
wrong place, would be off by the whole range or half of it).

usage: python3 gguf_check.py CHECKPOINT_DIR FILE.gguf   (needs gguf, numpy, safetensors)
"""
import json
import sys

import numpy as np
from gguf import GGUFReader, GGMLQuantizationType, dequantize, quantize
from safetensors.numpy import load_file

NAMES = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
    "input_layernorm_2": "post_attention_norm", "post_attention_layernorm": "ffn_norm",
    "post_attention_layernorm_2": "post_ffw_norm",
}


def gguf_name(name):
    if name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if name == "model.norm.weight":
        return "output_norm.weight"
    if name == "lm_head.weight":
        return "output.weight"
    if name.startswith("model.early_exit_gate"):
        return None
    _, _, layer, rest = name.split(".", 3)
    return f"blk.{layer}.{NAMES[rest.removesuffix('.weight')]}.weight"


def permute(w, heads):
    """llama.cpp's `LlamaModel.permute`: rotate-half rows to interleaved pairs."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def use_more_bits(i, n):
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def want_type(target, file_type, config, inner):
    """llama.cpp's `llama_tensor_get_type` for LLAMA_FTYPE_MOSTLY_Q8_0, _Q4_0, _Q4_K_S, _Q4_K_M
    and _Q5_K_M: a row of no whole block falls back to Q8_0, and of no whole Q8_0 block to F32."""
    Q = GGMLQuantizationType
    tied = config.get("tie_word_embeddings", False)
    head = target == "output.weight" or (tied and target == "token_embd.weight")
    layers = config["num_hidden_layers"]
    layer = int(target.split(".")[1]) if target.startswith("blk.") else None
    v, down = target.endswith(".attn_v.weight"), target.endswith(".ffn_down.weight")
    if file_type == 7:
        kind = Q.Q8_0
    elif head:
        kind = Q.Q6_K
    elif file_type == 2:
        kind = Q.Q4_0
    elif file_type in (15, 17) and (v or down) and use_more_bits(layer, layers):
        kind = Q.Q6_K
    elif file_type == 14 and ((v and layer < 4) or (down and layer < layers // 8)):
        kind = Q.Q5_K
    else:
        kind = Q.Q5_K if file_type == 17 else Q.Q4_K
    block = 256 if kind in (Q.Q4_K, Q.Q5_K, Q.Q6_K) else 32
    return kind if inner % block == 0 else Q.Q8_0 if inner % 32 == 0 else Q.F32


def field(reader, key):
    f = reader.fields[key]
    value = f.parts[f.data[0]]
    return bytes(value).decode() if f.types[0].name == "STRING" else value[0]


def main(checkpoint, path):
    config = json.load(open(f"{checkpoint}/config.json"))
    source = load_file(f"{checkpoint}/model.safetensors")
    reader = GGUFReader(path)
    assert field(reader, "GGUF.version") == 3, "GGUF version"
    assert field(reader, "general.architecture") == "ouro"
    for key, want in [("ouro.embedding_length", "hidden_size"), ("ouro.block_count", "num_hidden_layers"),
                      ("ouro.num_loops", "total_ut_steps"), ("ouro.feed_forward_length", "intermediate_size"),
                      ("ouro.attention.head_count", "num_attention_heads")]:
        assert field(reader, key) == config[want], key
    tensors = {t.name: t for t in reader.tensors}
    file_type = field(reader, "general.file_type")
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    checked = 0
    for name, value in source.items():
        target = gguf_name(name)
        if target is None:
            continue
        t = tensors.pop(target)
        value = value.astype(np.float32)
        if ".attn_q." in target or ".attn_k." in target:
            value = permute(value, value.shape[0] // head_dim)
        Q = GGMLQuantizationType
        if value.ndim == 2:
            want = want_type(target, file_type, config, value.shape[1])
            assert t.tensor_type == want, (target, t.tensor_type, want)
        if t.tensor_type == Q.F32:
            got = np.asarray(t.data).reshape(value.shape)
            assert np.array_equal(got, value), target
        elif t.tensor_type in (Q.Q4_K, Q.Q5_K, Q.Q6_K):
            got = dequantize(t.data, t.tensor_type).reshape(value.shape)
            run = 16 if t.tensor_type == Q.Q6_K else 32
            v = value.reshape(-1, run)
            span = (v.max(1, keepdims=True) - np.minimum(v.min(1, keepdims=True), 0)) if run == 32 \
                else np.abs(v).max(1, keepdims=True) * 2
            step = span / {Q.Q4_K: 15, Q.Q5_K: 31, Q.Q6_K: 63}[t.tensor_type]
            err = np.abs(got - value).reshape(-1, run)
            assert (err <= 2 * step + 1e-30).all(), f"{target}: off by more than two steps"
        else:
            assert t.tensor_type in (Q.Q8_0, Q.Q4_0), (target, t.tensor_type)
            want = quantize(value, t.tensor_type)
            assert np.array_equal(np.asarray(t.data).reshape(want.shape), want), f"{target}: bytes differ from gguf-py's"
            got = dequantize(t.data, t.tensor_type).reshape(value.shape)
            levels = 127 if t.tensor_type == Q.Q8_0 else 8
            step = np.abs(value.reshape(-1, 32)).max(1, keepdims=True) / levels
            err = np.abs(got - value).reshape(-1, 32)
            # Half a step (Q4_0: a whole one, where the top value clamps from 8 to 7), and the
            # f16 scale's rounding (2^-11 of it) times up to `levels`.
            rounding = 0.5 if t.tensor_type == Q.Q8_0 else 1.0
            assert (err <= (rounding + levels / 2048) * step * 1.001 + 1e-30).all(), f"{target}: off by more than the block's rounding"
        checked += 1
    assert not tensors, f"tensors the checkpoint lacks: {sorted(tensors)}"
    what = {14: "lie within two steps of", 15: "lie within two steps of", 17: "lie within two steps of", 2: "equal gguf-py's Q4_0 (the head: within two steps) of"}.get(file_type, "equal gguf-py's Q8_0 of")
    print(f"{path}: {checked} tensors {what} {checkpoint}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
