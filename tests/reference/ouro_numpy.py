"""An independent Ouro forward pass in numpy, written from the format's description alone (spex's `engine::format` docs), to check that a
checkpoint directory is a standard Ouro checkpoint: greedy-decodes a prompt with full recompute
(no KV cache) and prints the token ids. Compare with
`spex generate --model DIR --policy baseline --json` (the finished event's tokens).

usage: python3 ouro_numpy.py DIR PROMPT N   (needs numpy, safetensors, tokenizers from PyPI)
"""
import json
import sys

import numpy as np
from safetensors.numpy import load_file
from tokenizers import Tokenizer


def rms(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def rope(x, theta):  # x: [heads, T, d], rotate-half layout
    t, d = x.shape[1], x.shape[2]
    inv = 1.0 / theta ** (np.arange(0, d, 2, dtype=np.float64) / d)
    ang = np.arange(t)[:, None] * inv[None, :]
    cos, sin = np.cos(ang), np.sin(ang)
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


def pass_states(cfg, w, ids):
    """The normed hidden state `[T, hidden]` after every pass, one per pass (a generator)."""
    h = w["model.embed_tokens.weight"][ids].astype(np.float64)
    heads, kvh, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    eps, t = cfg["rms_norm_eps"], len(ids)
    mask = np.triu(np.full((t, t), -np.inf), 1)
    for _ in range(cfg["total_ut_steps"]):
        for i in range(cfg["num_hidden_layers"]):
            p = f"model.layers.{i}."
            a = rms(h, w[p + "input_layernorm.weight"], eps)
            q = (a @ w[p + "self_attn.q_proj.weight"].T).reshape(t, heads, hd).transpose(1, 0, 2)
            k = (a @ w[p + "self_attn.k_proj.weight"].T).reshape(t, kvh, hd).transpose(1, 0, 2)
            v = (a @ w[p + "self_attn.v_proj.weight"].T).reshape(t, kvh, hd).transpose(1, 0, 2)
            q, k = rope(q, cfg["rope_theta"]), rope(k, cfg["rope_theta"])
            k, v = np.repeat(k, heads // kvh, 0), np.repeat(v, heads // kvh, 0)
            s = q @ k.transpose(0, 2, 1) / np.sqrt(hd) + mask
            s = np.exp(s - s.max(-1, keepdims=True))
            s /= s.sum(-1, keepdims=True)
            o = (s @ v).transpose(1, 0, 2).reshape(t, heads * hd) @ w[p + "self_attn.o_proj.weight"].T
            h = h + rms(o, w[p + "input_layernorm_2.weight"], eps)
            m = rms(h, w[p + "post_attention_layernorm.weight"], eps)
            g = m @ w[p + "mlp.gate_proj.weight"].T
            m = (g / (1 + np.exp(-g)) * (m @ w[p + "mlp.up_proj.weight"].T)) @ w[p + "mlp.down_proj.weight"].T
            h = h + rms(m, w[p + "post_attention_layernorm_2.weight"], eps)
        h = rms(h, w["model.norm.weight"], eps)
        yield h


def lm_head(w):
    return w.get("lm_head.weight", w["model.embed_tokens.weight"])


def forward(cfg, w, ids):
    """The last position's logits after the last pass."""
    *_, h = pass_states(cfg, w, ids)
    return h[-1] @ lm_head(w).T


def main():
    d, prompt, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    cfg = json.load(open(f"{d}/config.json"))
    assert cfg["model_type"] == "ouro"
    w = {k: v.astype(np.float64) for k, v in load_file(f"{d}/model.safetensors").items()}
    ids = Tokenizer.from_file(f"{d}/tokenizer.json").encode(prompt, add_special_tokens=False).ids
    out = []
    for _ in range(n):
        logits = forward(cfg, w, ids)
        out.append(int(np.argmax(logits)))
        ids = ids + [out[-1]]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
