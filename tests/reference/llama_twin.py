"""A llama-architecture GGUF that streams what a looped model streams: its K shared layers
unrolled R times into K·R distinct layers of the same shape (random weights), with the looped
GGUF's tokenizer (its tokens padded to the vocabulary as llama.cpp's converter pads them). A
token through it reads the weight bytes a token through the looped model reads, so llama.cpp's
`llama-bench` on it, quantized by its own `llama-quantize`, is llama.cpp's rate at the looped
model's per-pass shape on the same machine (upstream llama.cpp reads `ouro` files too, but
the llama.cpp that PyPI's llama-cpp-python vendors predates it). By hand:

    python3 llama_twin.py LOOPED.gguf OUT-F16.gguf
    llama-quantize OUT-F16.gguf OUT-Q4_K_M.gguf Q4_K_M
    llama-bench -m OUT-Q4_K_M.gguf -p 0 -n 16 -t 2

(needs gguf and numpy)
"""
import sys

import numpy as np
from gguf import GGUFReader, GGUFWriter, GGMLQuantizationType, TokenType


def field(reader, key):
    f = reader.fields[key]
    if len(f.types) > 1:
        return [f.parts[i] for i in f.data]
    value = f.parts[f.data[0]]
    return bytes(value).decode() if f.types[0].name == "STRING" else value[0]


def main(source, out):
    r = GGUFReader(source)
    arch = field(r, "general.architecture")
    k = lambda name: field(r, f"{arch}.{name}")
    layers, loops = int(k("block_count")), int(k("num_loops"))
    hidden, ffn = int(k("embedding_length")), int(k("feed_forward_length"))
    heads, kv_heads = int(k("attention.head_count")), int(k("attention.head_count_kv"))
    head_dim = int(k("attention.key_length"))
    vocab = int(k("vocab_size"))
    w = GGUFWriter(out, "llama")
    w.add_name("looped twin")
    w.add_block_count(layers * loops)
    w.add_context_length(int(k("context_length")))
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(float(k("rope.freq_base")))
    w.add_layer_norm_rms_eps(float(k("attention.layer_norm_rms_epsilon")))
    w.add_file_type(1)
    tokens = [bytes(t).decode() for t in field(r, "tokenizer.ggml.tokens")]
    types = [int(t[0]) for t in field(r, "tokenizer.ggml.token_type")]
    tokens += [f"[PAD{i}]" for i in range(len(tokens), vocab)]
    types += [TokenType.UNUSED] * (vocab - len(types))
    w.add_tokenizer_model(field(r, "tokenizer.ggml.model"))
    w.add_tokenizer_pre(field(r, "tokenizer.ggml.pre"))
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges([bytes(m).decode() for m in field(r, "tokenizer.ggml.merges")])
    w.add_bos_token_id(int(field(r, "tokenizer.ggml.bos_token_id")))
    w.add_eos_token_id(int(field(r, "tokenizer.ggml.eos_token_id")))
    w.add_add_bos_token(False)

    shapes = [("token_embd.weight", (vocab, hidden)), ("output_norm.weight", (hidden,)),
              ("output.weight", (vocab, hidden))]
    for i in range(layers * loops):
        b = f"blk.{i}"
        shapes += [(f"{b}.attn_norm.weight", (hidden,)), (f"{b}.ffn_norm.weight", (hidden,)),
                   (f"{b}.attn_q.weight", (heads * head_dim, hidden)),
                   (f"{b}.attn_k.weight", (kv_heads * head_dim, hidden)),
                   (f"{b}.attn_v.weight", (kv_heads * head_dim, hidden)),
                   (f"{b}.attn_output.weight", (hidden, heads * head_dim)),
                   (f"{b}.ffn_gate.weight", (ffn, hidden)), (f"{b}.ffn_up.weight", (ffn, hidden)),
                   (f"{b}.ffn_down.weight", (hidden, ffn))]
    dtype = lambda shape: np.float32 if len(shape) == 1 else np.float16
    for name, shape in shapes:
        nbytes = int(np.prod(shape)) * np.dtype(dtype(shape)).itemsize
        raw = GGMLQuantizationType.F32 if len(shape) == 1 else GGMLQuantizationType.F16
        w.add_tensor_info(name, shape, np.dtype(dtype(shape)), nbytes, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(1)
    for name, shape in shapes:
        if len(shape) == 1:
            data = np.ones(shape, np.float32)
        else:
            data = (rng.standard_normal(shape, np.float32) * 0.02).astype(np.float16)
        w.write_tensor_data(data)
    w.close()
    print(f"{out}: llama, {layers * loops} layers ({layers} x {loops}), hidden {hidden}, vocab {vocab}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
