#!/usr/bin/env python3
"""The table .ci/gpu-bench writes, from the JSON reports in OUT_DIR.

    python3 .ci/gpu-table.py OUT_DIR

Per (model, dtype): baseline and policy tok/s, speedup, step(1 row) and step(R rows) in ms
(medians over the prompts), ceiling, peak GPU memory, the PyTorch peer's tok/s; then the
bandwidth limit of a baseline token on Ouro-1.4B's shape (weight bytes read per token ÷ the
measured copy bandwidth) and the shipped model's GPU-against-CPU check.
"""

import json
import os
import statistics
import sys

BYTES = {"bf16": 2, "f16": 2, "f32": 4}


def load(out, name):
    path = os.path.join(out, name)
    if not os.path.exists(path) or os.path.getsize(path) == 0:
        return None
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError:
        return None


def peak_mib(out, name):
    path = os.path.join(out, name)
    if not os.path.exists(path):
        return "—"
    with open(path) as f:
        used = [int(x) for x in f.read().split() if x.strip().isdigit()]
    return f"{max(used)} MiB" if used else "—"


def step_ms(report, key):
    values = [p["step_times"][key] for p in report["prompts"] if p.get("step_times")]
    return f"{statistics.median(values) / 1000:.2f}" if values else "—"


def exit_status(out, stem):
    """The exit status .ci/gpu-bench kept for the bench whose memory log is mem-STEM.log."""
    path = os.path.join(out, f"mem-{stem}.log.rc")
    return open(path).read().strip() if os.path.exists(path) else None


def why_missing(rc):
    """Why a bench left no report, from its exit status (None: it never ran)."""
    return {None: "not run", "124": "stopped at the time budget"}.get(rc, f"exit {rc}")


def rows(out, label, stem, dtype, peer):
    report = load(out, f"spex-{stem}-{dtype}.json")
    rc = exit_status(out, f"{stem}-{dtype}")
    if report is None:
        return [f"| {label} | {dtype} | ({why_missing(rc)}) |"]
    lines = []
    for p in report["overall"]["policies"]:
        same = "identical" if p["identical"] else f"differs (exit {rc})"
        peer_tps = f"{peer['tokens_per_sec']:.1f}" if peer else "—"
        lines.append(
            f"| {label} | {dtype} | {p['baseline_tokens_per_sec']:.1f} | {p['policy']} | "
            f"{p['tokens_per_sec']:.1f} | {p['speedup']:.2f}× | "
            f"{step_ms(report, 'one_row_us')} | {step_ms(report, 'full_us')} | "
            f"{report['overall']['ceiling']:.2f}× | {peak_mib(out, f'mem-{stem}-{dtype}.log')} | "
            f"{peer_tps} | {same} |"
        )
    return lines


def weight_bytes_per_token(cfg, dtype):
    """A baseline token reads the K layers' weights R times and the head once."""
    h, i, k = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    heads = cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads") or heads
    d = cfg.get("head_dim") or h // heads
    layer = h * heads * d * 2 + h * kv * d * 2 + 3 * h * i + 4 * h
    head = cfg["vocab_size"] * h
    return (cfg["total_ut_steps"] * k * layer + head) * BYTES[dtype]


def main():
    out = sys.argv[1]
    cfg = load(out, "ouro-config.json")
    gpu = open(os.path.join(out, "gpu.txt")).read().strip() if os.path.exists(
        os.path.join(out, "gpu.txt")) else "cpu (dry run)"
    print(f"GPU: {gpu}\n")
    print("| model | dtype | baseline tok/s | policy | policy tok/s | speedup | step 1 row (ms) "
          "| step R rows (ms) | ceiling | peak GPU memory | PyTorch eager tok/s | output |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for dtype in ["bf16", "f32"]:
        peer = load(out, f"peer-ouro-{dtype}.json")
        for line in rows(out, "Ouro-1.4B shape (random)", "ouro", dtype, peer):
            print(line)
    for dtype in ["f32", "bf16"]:
        peer = load(out, "peer-shipped-f32.json") if dtype == "f32" else None
        for line in rows(out, "shakespeare-r4k6-sync", "shipped", dtype, peer):
            print(line)
    print()
    for dtype in ["bf16", "f32"]:
        peer, spex = load(out, f"peer-ouro-{dtype}.json"), load(out, f"spex-ouro-{dtype}.json")
        if not cfg or not peer or not spex or "bandwidth_gb_per_s" not in peer:
            continue
        per_token = weight_bytes_per_token(cfg, dtype)
        limit = peer["bandwidth_gb_per_s"] * 1e9 / per_token
        base = spex["overall"]["policies"][0]["baseline_tokens_per_sec"]
        print(f"- Ouro-1.4B shape, {dtype}: {per_token / 1e9:.2f} GB of weights per baseline "
              f"token; copy bandwidth {peer['bandwidth_gb_per_s']:.0f} GB/s → limit "
              f"{limit:.1f} tok/s; spex's baseline {base:.1f} tok/s = {100 * base / limit:.0f} % "
              f"of it; the PyTorch peer {peer['tokens_per_sec']:.1f} tok/s.")
    for n in range(3):
        for dtype in ["f32", "bf16"]:
            report = load(out, f"spex-shape{n}-{dtype}.json")
            if report is None:
                rc = exit_status(out, f"shape{n}-{dtype}")
                if rc is not None:
                    print(f"- Random shape {n}, {dtype}: {why_missing(rc)}.")
                continue
            counts, margins = {}, {}
            for prompt in report["prompts"]:
                for p in prompt["policies"]:
                    same, total = counts.get(p["policy"], (0, 0))
                    counts[p["policy"]] = (same + (p["comparison"] == "identical"), total + 1)
                    if p["comparison"] != "identical":
                        margin = p["comparison"]["differs"]["margin"]
                        margins[p["policy"]] = max(margins.get(p["policy"], 0.0), margin)
            same = ", ".join(f"{name} {s}/{t}" for name, (s, t) in counts.items())
            # Where a lane differs, the baseline's logit margin there (top-1 minus top-2): a
            # bf16 near-tie that rows computed together may round the other way.
            worst = "".join(f"; {name} differs where the margin is at most {m:.3g}"
                            for name, m in margins.items())
            print(f"- Random shape {n} ({report['layers']} layers, {report['passes']} passes), "
                  f"{dtype}, prompts identical to baseline: {same}{worst}.")
    for name, what in [("exact", "first prompts, before the exactness part"),
                       ("shipped", "every prompt")]:
        check = load(out, f"{name}-gpu-vs-cpu.json")
        if check:
            print(f"- The shipped model in f32, GPU against CPU greedy text ({what}): "
                  f"identical {check['same']}/{check['prompts']}.")
    peer, spex = load(out, "peer-shipped-f32.json"), load(out, "spex-shipped-f32-tokens.json")
    if peer and spex:
        same = "equal" if peer["tokens"] == spex.get("tokens") else "NOT equal"
        print(f"- The PyTorch peer's greedy tokens on the shipped model (f32) are {same} to spex's.")
    timings = os.path.join(out, "timings.txt")
    if os.path.exists(timings):
        with open(timings) as f:
            parts = [line.strip() for line in f if line.strip()]
        if parts:
            print(f"- Parts, in the order run: {'; '.join(parts)}.")


if __name__ == "__main__":
    main()
