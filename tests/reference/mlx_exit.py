"""Ouro's exit gate by mlx-lm's own code: the checkpoint loaded by `mlx_lm.utils.load_model`,
every pass's gate from its `OuroModel._forward_ut_steps`, the exit distribution from its
`_compute_exit_distribution` and each token's exit pass from its `_threshold_exit`, called on
marker states (state i at pass i) so that the state it picks is the pass it chose. Compared
with the `gate_exit` spex reports on every committed token.

usage: python3 mlx_exit.py DIR PROMPT EVENTS.jsonl...
       (each EVENTS: `spex generate --json --policy baseline --kv-cache f32 --exit-threshold T`
       on DIR and PROMPT; needs mlx[cpu] from PyPI and an mlx-lm whose models/ouro.py exists)
"""
import json
import sys
from pathlib import Path

import mlx.core as mx
from mlx_lm.utils import load_model
from tokenizers import Tokenizer


def read_events(path):
    """The run's threshold, its output ids and the gate exit pass spex gave each position."""
    threshold, tokens, exits = None, [], {}
    for line in open(path):
        event = json.loads(line)
        if event["event"] == "prefill":
            threshold = event["exit_threshold"]
        elif event["event"] == "step":
            for c in event["committed"]:
                exits[c["pos"]] = c.get("gate_exit")
        elif event["event"] == "finished":
            tokens = event["tokens"]
    return threshold, tokens, exits


def mlx_exits(model, ids, threshold):
    """mlx-lm's exit pass (from 1) for the token after each position, and its cumulative exit
    probabilities there."""
    inner = model.model
    hs, gates = inner._forward_ut_steps(mx.array([ids]))
    pdf = inner._compute_exit_distribution(gates)
    markers = [mx.full(hs[0].shape[:2] + (1,), float(i)) for i in range(len(hs))]
    chosen = inner._threshold_exit(markers, pdf, threshold)
    cumulative = mx.cumsum(pdf, axis=-1)
    return [int(v) + 1 for v in chosen[0, :, 0].tolist()], cumulative[0].tolist()


def main():
    d, prompt, runs = Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
    model, _ = load_model(d)
    prompt_ids = Tokenizer.from_file(str(d / "tokenizer.json")).encode(
        prompt, add_special_tokens=False).ids
    report = []
    for events in runs:
        threshold, tokens, exits = read_events(events)
        ids = prompt_ids + tokens
        passes, cumulative = mlx_exits(model, ids, threshold)
        agree, differ, near = 0, [], 0
        for pos, spex_pass in sorted(exits.items()):
            if spex_pass is None:
                continue
            mlx_pass = passes[pos - 1]
            # A cumulative probability within 1e-5 of the threshold is a tie the two forwards'
            # rounding may settle either way.
            tie = any(abs(c - threshold) < 1e-5 for c in cumulative[pos - 1][:-1])
            near += tie
            if spex_pass == mlx_pass:
                agree += 1
            elif not tie:
                differ.append((pos, spex_pass, mlx_pass))
        report.append({"events": events, "threshold": threshold, "compared": agree + len(differ),
                       "agree": agree, "near_ties": near, "differ": differ,
                       "exit_passes": sorted({p for p in exits.values() if p})})
    print(json.dumps(report))
    sys.exit(1 if any(r["differ"] for r in report) else 0)


if __name__ == "__main__":
    main()
