"""Predicts how many steps SPEED and `dual` take, and their speedup, from a checkpoint's per-pass
readouts, before writing engine code. Greedy-decodes each prompt with `spex generate --policy
baseline`, reads out every pass at every generated position with an independent numpy forward
(ouro_numpy.py), then replays speculation.md §3 (and `dual`'s second candidate) step by step.
Step costs come from the command line (µs): a 1-row baseline step, and a speculative step as
`base + per_row · (rows − 1)`. On the shipped model it predicted the engine's step counts
exactly (1430 SPEED, 1260 dual over assets/prompts.txt at 128 tokens).

usage: python3 pipeline_sim.py DIR SPEX PROMPTS N T1_US STEP_US PER_ROW_US [MARGIN...]
   e.g. python3 tests/reference/pipeline_sim.py assets/models/shakespeare-r4k6 \\
        target/release/spex assets/prompts.txt 128 540 650 53 0.5 1.0 2.0
"""
import json
import subprocess
import sys

import numpy as np
from safetensors.numpy import load_file
from tokenizers import Tokenizer

from ouro_numpy import lm_head, pass_states


def readouts(cfg, w, ids):
    """Logits `[pass][position][vocab]` of the full-sequence forward."""
    head = lm_head(w)
    return [h @ head.T for h in pass_states(cfg, w, ids)]


def top2(logits):
    best, second = np.argsort(-logits)[:2]
    return int(best), int(second), float(logits[best] - logits[second])


def simulate(reads, passes, margin):
    """Steps and rows of one run. reads[k][r] = top2 of token k's readout after pass r + 1."""
    n = len(reads)
    gen = [reads[k - 1][passes - 1][0] for k in range(1, n)] if n > 1 else []
    gen = [None] + gen  # gen[k]: the k-th committed token (k ≥ 1)
    win = [dict(k=0, ok=True, tok=None, p=0, pending=False)]
    committed, steps, rows = 1, 0, 0

    def spawn(k, tok, parent_ok, pending=False):
        win.append(dict(k=k, ok=parent_ok and tok == gen[k], tok=tok, p=0, pending=pending))

    while committed < n:
        steps += 1
        rows += len(win)
        for e in win:
            e["p"] += 1
        i = 0
        while i < len(win) and win[i]["p"] > 0:
            e = win[i]
            p, k = e["p"], e["k"]
            kids = [j for j in range(i + 1, len(win)) if win[j]["k"] == k + 1]
            if not e["ok"]:
                if not kids and p < passes and k + 1 < n:
                    spawn(k + 1, -1, False)
                i += 1
                continue
            best, second, gap = reads[k][p - 1] if k + 1 < n else (None, None, 0.0)
            if len(kids) == 2:  # keep the candidate the readout agrees with, else the first
                drop = kids[0] if win[kids[1]]["tok"] == best else kids[1]
                del win[drop]
                win[i + 1]["pending"] = False
                kids = [i + 1]
            stop = bool(kids) and win[kids[0]]["tok"] != best
            if stop:
                del win[i + 1:]
                kids = []
            if p == passes:
                committed += 1
                if committed >= n:
                    break
                if not kids:
                    spawn(k + 1, best, True)
            elif not kids and k + 1 < n:
                spawn(k + 1, best, True)
                if margin is not None and p == 1 and gap < margin and second != best:
                    spawn(k + 1, second, True, pending=True)
            if stop:
                break
            i += 1
        win[:] = [e for e in win if e["p"] < passes]
    return steps, rows


def main():
    d, spex, prompts, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    t1, base, per_row = (float(x) for x in sys.argv[5:8])
    margins = [None] + [float(x) for x in sys.argv[8:]]
    cfg = json.load(open(f"{d}/config.json"))
    w = {k: v.astype(np.float64) for k, v in load_file(f"{d}/model.safetensors").items()}
    tok = Tokenizer.from_file(f"{d}/tokenizer.json")
    passes = cfg["total_ut_steps"]
    runs = []
    for prompt in open(prompts).read().splitlines():
        ids = tok.encode(prompt, add_special_tokens=False).ids
        out = subprocess.run([spex, "generate", "--model", d, "--policy", "baseline", "--json",
                              "--max-tokens", str(n), "--prompt", prompt],
                             capture_output=True, text=True, check=True).stdout.splitlines()
        gen = json.loads(out[-1])["tokens"]
        logits = readouts(cfg, w, ids + gen)
        # reads[k]: token k (k = 0 is the prefill's token) predicting token k + 1.
        reads = [[top2(logits[r][len(ids) + k]) for r in range(passes)] for k in range(len(gen))]
        runs.append(reads)
    for margin in margins:
        steps = rows = 0
        for reads in runs:
            s, r = simulate(reads, passes, margin)
            steps, rows = steps + s, rows + r
        tokens = sum(len(r) - 1 for r in runs)
        cost = steps * (base - per_row) + rows * per_row
        name = "speed" if margin is None else f"dual (margin {margin})"
        print(f"{name}: {steps} steps, {rows / steps:.2f} rows/step, "
              f"predicted speedup {tokens * passes * t1 / cost:.3f}x")


if __name__ == "__main__":
    main()
