#!/usr/bin/env python3
"""The PyTorch eager peer of `spex bench` (issue: GPU for real, item 4).

An Ouro forward written from the format's description alone (spex's `engine::format` docs), in plain PyTorch ops at batch 1: the
prompt in one prefill, then greedy decoding with a KV cache per (pass, layer), every token
through all R passes (ordinary decoding, no speculation). It times the decode and prints one
JSON line: tokens, tokens per second, peak GPU memory and, with --bandwidth, the device's
measured copy bandwidth.

    python3 tests/reference/torch_peer.py CHECKPOINT --device cuda --dtype bf16 \
        (--prompt-ids 11,12,13 | --prompt TEXT) --max-tokens 128 [--bandwidth]

It reads safetensors itself (the format is a JSON header and raw little-endian tensors), so
it needs only torch (and `tokenizers` for --prompt). On the shipped model in f32 its greedy tokens equal `spex generate`'s
(.ci/gpu-bench checks that on the device).
"""

import argparse
import json
import os
import struct
import sys
import time

import torch

DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}
FILE_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


def read_safetensors(path, dtype, device):
    """Every tensor of one .safetensors file, converted to `dtype` on `device`."""
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
        data = f.read()
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        start, end = meta["data_offsets"]
        raw = bytearray(data[start:end])
        t = torch.frombuffer(raw, dtype=FILE_DTYPES[meta["dtype"]]).reshape(meta["shape"])
        out[name] = t.to(device=device, dtype=dtype)
    return out


def load(directory, dtype, device):
    with open(os.path.join(directory, "config.json")) as f:
        cfg = json.load(f)
    weights = {}
    for name in sorted(os.listdir(directory)):
        if name.endswith(".safetensors"):
            weights.update(read_safetensors(os.path.join(directory, name), dtype, device))
    if "lm_head.weight" not in weights:
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
    return cfg, weights


class Ouro:
    """The forward pass of `engine::format` over one weight dict; caches live outside."""

    def __init__(self, cfg, w, device):
        self.cfg, self.w = cfg, w
        self.K, self.R = cfg["num_hidden_layers"], cfg["total_ut_steps"]
        self.heads = cfg["num_attention_heads"]
        self.kv_heads = cfg.get("num_key_value_heads") or self.heads
        self.head_dim = cfg.get("head_dim") or cfg["hidden_size"] // self.heads
        self.eps = cfg["rms_norm_eps"]
        half = self.head_dim // 2
        inv = 1.0 / (cfg["rope_theta"] ** (torch.arange(half, dtype=torch.float64) / half))
        self.inv_freq = inv.to(device)

    def norm(self, x, name):
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.w[name].float()).to(x.dtype)

    def rope(self, x, positions):
        # x: [heads, t, d]; rotate-half ("NeoX") layout.
        angles = positions.to(torch.float64)[:, None] * self.inv_freq[None, :]
        cos = torch.cat([angles.cos(), angles.cos()], -1).to(x.dtype)
        sin = torch.cat([angles.sin(), angles.sin()], -1).to(x.dtype)
        half = self.head_dim // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
        return x * cos + rotated * sin

    def attention(self, a, prefix, positions, cache):
        t = a.shape[0]
        lin = lambda n, x: x @ self.w[f"{prefix}.self_attn.{n}.weight"].T  # noqa: E731
        q = lin("q_proj", a).view(t, self.heads, self.head_dim).transpose(0, 1)
        k = lin("k_proj", a).view(t, self.kv_heads, self.head_dim).transpose(0, 1)
        v = lin("v_proj", a).view(t, self.kv_heads, self.head_dim).transpose(0, 1)
        q, k = self.rope(q, positions), self.rope(k, positions)
        if cache:
            k, v = torch.cat([cache[0], k], 1), torch.cat([cache[1], v], 1)
        cache[:] = [k, v]
        group = self.heads // self.kv_heads
        k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
        scores = (q @ k.transpose(1, 2)) / self.head_dim**0.5
        past = k.shape[1] - t
        mask = torch.ones(t, k.shape[1], dtype=torch.bool, device=a.device).tril(past)
        scores = scores.masked_fill(~mask, float("-inf"))
        out = torch.softmax(scores.float(), -1).to(v.dtype) @ v
        return lin("o_proj", out.transpose(0, 1).reshape(t, -1))

    def forward(self, ids, positions, caches):
        """Pass-R logits of the last position; `caches[pass * K + i]` is [k, v] or []."""
        h = self.w["model.embed_tokens.weight"][ids]
        for p in range(self.R):
            for i in range(self.K):
                pre = f"model.layers.{i}"
                a = self.norm(h, f"{pre}.input_layernorm.weight")
                a = self.attention(a, pre, positions, caches[p * self.K + i])
                h = h + self.norm(a, f"{pre}.input_layernorm_2.weight")
                m = self.norm(h, f"{pre}.post_attention_layernorm.weight")
                mlp = lambda n, x: x @ self.w[f"{pre}.mlp.{n}.weight"].T  # noqa: E731
                m = mlp("down_proj", torch.nn.functional.silu(mlp("gate_proj", m)) * mlp("up_proj", m))
                h = h + self.norm(m, f"{pre}.post_attention_layernorm_2.weight")
            h = self.norm(h, "model.norm.weight")
        return (h[-1:] @ self.w["lm_head.weight"].T).float()


def sync(device):
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def bandwidth_gb_per_s(device):
    """Device-to-device copy of 1 GiB, bytes read plus written, best of 5."""
    src = torch.empty(1 << 28, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        sync(device)
        t = time.perf_counter()
        dst.copy_(src)
        sync(device)
        best = min(best, time.perf_counter() - t)
    return 2 * src.numel() * 4 / best / 1e9


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("checkpoint")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", choices=DTYPES, default="bf16")
    prompt = ap.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt-ids", help="comma-separated token ids")
    prompt.add_argument("--prompt", help="text, encoded with the checkpoint's tokenizer.json")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--bandwidth", action="store_true")
    args = ap.parse_args()
    device, dtype = args.device, DTYPES[args.dtype]
    torch.set_grad_enabled(False)
    cfg, w = load(args.checkpoint, dtype, device)
    model = Ouro(cfg, w, device)
    if args.prompt is not None:
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(os.path.join(args.checkpoint, "tokenizer.json"))
        prompt_ids = tokenizer.encode(args.prompt).ids
    else:
        prompt_ids = [int(x) for x in args.prompt_ids.split(",")]
    ids = torch.tensor(prompt_ids, device=device)
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    caches = [[] for _ in range(model.K * model.R)]
    logits = model.forward(ids, torch.arange(len(ids), device=device), caches)
    tokens = [int(logits.argmax())]
    sync(device)
    start = time.perf_counter()
    while len(tokens) < args.max_tokens:
        pos = len(ids) + len(tokens) - 1
        step = torch.tensor([tokens[-1]], device=device)
        logits = model.forward(step, torch.tensor([pos], device=device), caches)
        tokens.append(int(logits.argmax()))
    sync(device)
    seconds = time.perf_counter() - start
    report = {
        "peer": "pytorch eager",
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu",
        "dtype": args.dtype,
        "tokens": tokens,
        "decode_seconds": seconds,
        "tokens_per_sec": (len(tokens) - 1) / seconds,
    }
    if device.startswith("cuda"):
        report["peak_gpu_memory_bytes"] = torch.cuda.max_memory_allocated()
    if args.bandwidth:
        report["bandwidth_gb_per_s"] = bandwidth_gb_per_s(device)
    json.dump(report, sys.stdout)
    print()


if __name__ == "__main__":
    main()
