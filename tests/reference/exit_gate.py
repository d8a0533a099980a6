"""Ouro's exit gate, independently: the numpy forward (`ouro_numpy.py`) gives every pass's normed
state, the gate gives lambda = sigmoid(w . h + b), and mlx-lm's rules (`ouro.py`:
`_compute_exit_distribution`, `_threshold_exit`) give each token's exit pass. Compared with the
lambda that `spex generate --json --policy baseline` reports for every row, and with the exit
pass mlx-lm's rule takes from spex's lambdas.

usage: python3 exit_gate.py DIR PROMPT EVENTS.jsonl   (EVENTS: spex generate --json output;
       needs numpy, safetensors, tokenizers from PyPI)
"""
import json
import sys

import numpy as np
from safetensors.numpy import load_file
from tokenizers import Tokenizer

from ouro_numpy import pass_states


def exit_distribution(lambdas):
    """mlx-lm's `_compute_exit_distribution` for one token: lambdas[r] after pass r + 1."""
    pdf, remaining = [], 1.0
    for lam in lambdas[:-1]:
        pdf.append(lam * remaining)
        remaining *= 1.0 - lam
    pdf.append(remaining)
    return pdf


def threshold_exit(lambdas, threshold):
    """mlx-lm's `_threshold_exit` for one token: the first pass (from 1) whose cumulative
    exit probability reaches `threshold`, else R."""
    reached = np.cumsum(exit_distribution(lambdas)) >= threshold
    return int(np.argmax(reached)) + 1 if reached.any() else len(lambdas)


def main():
    d, prompt, events = sys.argv[1], sys.argv[2], sys.argv[3]
    cfg = json.load(open(f"{d}/config.json"))
    w = {k: v.astype(np.float64) for k, v in load_file(f"{d}/model.safetensors").items()}
    ids = Tokenizer.from_file(f"{d}/tokenizer.json").encode(prompt, add_special_tokens=False).ids
    spex = {}
    for line in open(events):
        event = json.loads(line)
        if event["event"] == "step":
            for row in event["rows"]:
                spex[(row["pos"], row["pass"])] = row["exit_probability"]
        if event["event"] == "finished":
            ids = ids + event["tokens"]
    gw, gb = w["model.early_exit_gate.weight"][0], w["model.early_exit_gate.bias"][0]
    states = list(pass_states(cfg, w, ids))
    ref = {(pos, p + 1): 1 / (1 + np.exp(-(h[pos] @ gw + gb)))
           for p, h in enumerate(states) for pos in range(len(ids))}
    worst = max(abs(spex[k] - ref[k]) for k in spex)
    passes = cfg["total_ut_steps"]
    tokens = sorted({pos for pos, _ in spex})
    agree, total = 0, 0
    for threshold in (0.3, 0.5, 0.7, 0.9):
        for pos in tokens:
            a = threshold_exit([spex[(pos, p)] for p in range(1, passes + 1)], threshold)
            b = threshold_exit([ref[(pos, p)] for p in range(1, passes + 1)], threshold)
            agree, total = agree + (a == b), total + 1
    print(json.dumps({"rows": len(spex), "max_abs_lambda_diff": worst,
                      "exit_pass_agree": agree, "exit_pass_compared": total}))


if __name__ == "__main__":
    main()
