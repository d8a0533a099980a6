"""Where pass 1 disagrees with pass R: top-1 agreement of every pass's readout with the last
pass's on held-out text, broken down by how sure pass R is (its top-1 probability) and by pass
1's own logit margin (best over runner-up, the quantity `dual`'s gate reads), and every pass's
cross-entropy against the next token. Independent of spex: numpy forward from ouro_numpy.py.

usage: python3 agreement.py DIR TEXT_FILE... [--windows N]   (N windows of 256 tokens, default 12)
   e.g. python3 tests/reference/agreement.py assets/models/shakespeare-r4k6 \\
        assets/corpus/shakespeare/macbeth_gut.txt assets/corpus/shakespeare/twelfth_night_gut.txt
"""
import json
import sys

import numpy as np
from safetensors.numpy import load_file
from tokenizers import Tokenizer

from ouro_numpy import lm_head, pass_states

WINDOW = 256


def log_sum_exp(logits):
    top = logits.max(-1)
    return top + np.log(np.exp(logits - top[:, None]).sum(-1))


def main():
    args = sys.argv[1:]
    windows = 12
    if "--windows" in args:
        i = args.index("--windows")
        windows = int(args[i + 1])
        del args[i : i + 2]
    d, files = args[0], args[1:]
    cfg = json.load(open(f"{d}/config.json"))
    w = {k: v.astype(np.float32) for k, v in load_file(f"{d}/model.safetensors").items()}
    ids = Tokenizer.from_file(f"{d}/tokenizer.json").encode(
        "".join(open(f).read() for f in files), add_special_tokens=False
    ).ids
    head = lm_head(w)
    agree, sure, margin1, top2, nll = [], [], [], [], []
    for s in range(0, len(ids) - WINDOW - 1, (len(ids) - WINDOW - 1) // windows)[:windows]:
        logits = [h @ head.T for h in pass_states(cfg, w, ids[s : s + WINDOW])]
        last = logits[-1].argmax(-1)
        nxt = np.array(ids[s + 1 : s + WINDOW + 1])
        nll.append(np.stack([log_sum_exp(l) - l[np.arange(WINDOW), nxt] for l in logits]))
        agree.append(np.stack([l.argmax(-1) == last for l in logits]))
        p = np.exp(logits[-1] - logits[-1].max(-1, keepdims=True))
        sure.append(p.max(-1) / p.sum(-1))
        ranked = np.argsort(-logits[0], -1)[:, :2]
        top2.append((ranked == last[:, None]).any(-1))
        best2 = np.sort(logits[0], -1)[:, -2:]
        margin1.append(best2[:, 1] - best2[:, 0])
    agree, sure = np.concatenate(agree, 1), np.concatenate(sure)
    margin1, top2 = np.concatenate(margin1), np.concatenate(top2)
    print(f"{agree.shape[1]} positions; agreement with pass {len(agree)}, pass 1..R: "
          + " ".join(f"{a:.1%}" for a in agree.mean(1))
          + f"; pass R's token in pass 1's top 2: {top2.mean():.1%}")
    nll = np.concatenate(nll, 1)
    print("cross-entropy (nats/token), pass 1..R: " + " ".join(f"{x:.3f}" for x in nll.mean(1)))
    print("pass R top-1 probability   share  pass-1 agreement")
    for lo, hi in [(0, .1), (.1, .2), (.2, .3), (.3, .5), (.5, .8), (.8, 1.01)]:
        m = (sure >= lo) & (sure < hi)
        print(f"  [{lo:.1f}, {min(hi, 1):.1f})              {m.mean():6.1%}  {agree[0][m].mean():6.1%}")
    print("pass-1 margin (logits)     share  pass-1 agreement  in pass 1's top 2")
    for lo, hi in [(0, .25), (.25, .5), (.5, 1), (1, 2), (2, np.inf)]:
        m = (margin1 >= lo) & (margin1 < hi)
        print(f"  [{lo:.2f}, {hi:.2f})             {m.mean():6.1%}  {agree[0][m].mean():6.1%}"
              f"            {top2[m].mean():6.1%}")


if __name__ == "__main__":
    main()
