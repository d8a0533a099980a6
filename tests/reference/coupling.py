"""How often a pass-r proposal survives to pass R under sampling, by the two rules spex offers
(`policy::loopspec` and `engine::sampling`), on held-out text. For every position and pass r < R:
- rejection sampling (LoopSpec) accepts a proposal drawn from q_r with probability 1 - TV(q_r, p_R);
- seed-coupled (Gumbel-max) sampling keeps it when the shared-noise argmax over pass r's kept set
  equals pass R's; the coupling bound says that happens with probability >= (1 - TV)/(1 + TV).
q_r and p_R are softmax(l / T) restricted to what top-k / top-p keep of each, renormalised.
Independent of spex: numpy forward from ouro_numpy.py; the noise is numpy's, over --seeds draws.

usage: python3 coupling.py DIR TEXT_FILE... [--windows N] [--temperature T] [--top-p P] [--seeds S]
   e.g. python3 tests/reference/coupling.py assets/models/shakespeare-r4k6 \\
        assets/corpus/shakespeare/macbeth_gut.txt --temperature 1 --top-p 0.7
"""
import json
import sys

import numpy as np
from safetensors.numpy import load_file
from tokenizers import Tokenizer

from ouro_numpy import lm_head, pass_states

WINDOW = 256


def option(args, name, default, kind):
    if name in args:
        i = args.index(name)
        value = kind(args[i + 1])
        del args[i : i + 2]
        return value
    return default


def filtered(logits, t, top_p):
    """softmax(l / T) over the smallest most-likely set reaching top_p (all if None), per row."""
    z = logits / t
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    if top_p is not None:
        order = np.argsort(-p, -1, kind="stable")
        sorted_p = np.take_along_axis(p, order, -1)
        before = np.cumsum(sorted_p, -1) - sorted_p
        keep_sorted = before < top_p
        keep = np.zeros_like(keep_sorted)
        np.put_along_axis(keep, order, keep_sorted, -1)
        p = np.where(keep, p, 0.0)
        p /= p.sum(-1, keepdims=True)
    return p


def main():
    args = sys.argv[1:]
    windows = option(args, "--windows", 12, int)
    t = option(args, "--temperature", 1.0, float)
    top_p = option(args, "--top-p", None, float)
    seeds = option(args, "--seeds", 8, int)
    d, files = args[0], args[1:]
    cfg = json.load(open(f"{d}/config.json"))
    w = {k: v.astype(np.float32) for k, v in load_file(f"{d}/model.safetensors").items()}
    ids = Tokenizer.from_file(f"{d}/tokenizer.json").encode(
        "".join(open(f).read() for f in files), add_special_tokens=False
    ).ids
    head = lm_head(w)
    rng = np.random.default_rng(0)
    tv, coupled = [], []
    for s in range(0, len(ids) - WINDOW - 1, (len(ids) - WINDOW - 1) // windows)[:windows]:
        probs = [filtered(h @ head.T, t, top_p) for h in pass_states(cfg, w, ids[s : s + WINDOW])]
        last = probs[-1]
        tv.append(np.stack([0.5 * np.abs(q - last).sum(-1) for q in probs[:-1]]))
        same = np.zeros((len(probs) - 1, last.shape[0]))
        for _ in range(seeds):
            g = rng.gumbel(size=last.shape)
            # Gumbel-max over each pass's kept set: log q + G (the same G for every pass).
            choose = lambda q: np.where(q > 0, np.log(np.maximum(q, 1e-300)) + g, -np.inf).argmax(-1)
            final = choose(last)
            same += np.stack([choose(q) == final for q in probs[:-1]])
        coupled.append(same / seeds)
    tv, coupled = np.concatenate(tv, 1), np.concatenate(coupled, 1)
    rule = f"T {t}" + (f", top-p {top_p}" if top_p is not None else "")
    print(f"{tv.shape[1]} positions, {rule}, {seeds} noise draws per position")
    print("pass  mean TV  rejection 1-TV  coupled bound (1-TV)/(1+TV)  coupled measured")
    for r in range(tv.shape[0]):
        x = tv[r]
        print(f"  {r + 1}   {x.mean():7.3f}  {1 - x.mean():14.1%}  {((1 - x) / (1 + x)).mean():27.1%}"
              f"  {coupled[r].mean():16.1%}")


if __name__ == "__main__":
    main()
