"""Two independent fp32 implementations of DeepSeek-V4 on the tiny checkpoint: the DeepSeek oracle's V4 mode
(oracle/dsv41, the reference's math with its quantisation emulation) against transformers' DeepseekV4ForCausalLM
loaded by oracle/hf_dsv4.py. Per position class, max and mean |Δ logprob| of the actual token and mean KL
(oracle ‖ transformers) over the full vocabulary; then the same with the oracle's quantisation emulations
switched off one family at a time (monkeypatched here, for this measurement only), so every difference is
attributed to a named module:

* ``act``   — activation QDQ8 per 128 channels into every FP8 / FP4 GEMM (``Numerics.qlinear``)
* ``kv``    — fp8 KV: QDQ8 of the 448 nope dims per 64 of window and compressed KV (``compressor_v4.qdq8_nope``)
* ``index`` — indexer q / k: Hadamard rotation + QDQ4 per 32 (``compressor_v4.rotate_activation`` / ``qdq4p``)

    .venv/bin/python benchmarks/dsv4_oracle_vs_transformers.py --checkpoint DIR --tokens 400 \
        [--variants full,-act,-kv,-index,none] [--out benchmarks/results/dsv4_oracle_vs_transformers.json]

Position classes (t = position of the distribution, predicting token t + 1; ratio-4 layers see compressed
entry w once (w + 1)·4 <= t + 1, ratio-128 layers once (w + 1)·128 <= t + 1, window 128):
``no-compressed`` t < 3; ``csa-only`` 3 <= t < 127; ``csa+hca`` 127 <= t < 2047 (beyond the window from 128);
``indexer-topk`` t >= 2047 (more than 512 ratio-4 entries: the indexer's top-512 decides).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from pathlib import Path

import numpy as np
import torch

CLASSES = (("no-compressed", 0, 3), ("csa-only", 3, 127), ("csa+hca", 127, 2047), ("indexer-topk", 2047, 10**9))


@contextlib.contextmanager
def emulation_off(families: set[str]):
    """Switch the oracle's quantisation emulations in `families` to the identity for the duration."""
    from oracle.dsv41 import attention_v4, compressor_v4, numerics

    saved = []

    def patch(obj, name, value):
        saved.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)

    if "act" in families:
        patch(numerics.Numerics, "qlinear", lambda self, x, w, block=32, gemm_block=None, fmt="ue8m0":
              numerics.mm(x, w))
    if "kv" in families:
        ident = lambda x, *a, **k: x  # noqa: E731
        patch(compressor_v4, "qdq8_nope", ident)
        patch(attention_v4, "qdq8_nope", ident)
    if "index" in families:
        patch(compressor_v4, "qdq4p", lambda x, *a, **k: x)
        patch(compressor_v4, "rotate_activation", lambda x, num: x)
    try:
        yield
    finally:
        for obj, name, value in reversed(saved):
            setattr(obj, name, value)


def logprobs(logits: torch.Tensor, chunk: int = 256) -> torch.Tensor:
    out = torch.empty_like(logits)
    for a in range(0, logits.shape[0], chunk):
        out[a:a + chunk] = torch.log_softmax(logits[a:a + chunk].double(), -1).float()
    return out


def compare(lp_o: torch.Tensor, lp_t: torch.Tensor, ids: torch.Tensor) -> dict:
    n = lp_o.shape[0] - 1
    actual = ids[1:n + 1]
    d = (lp_o[:n].gather(1, actual[:, None]) - lp_t[:n].gather(1, actual[:, None]))[:, 0].double().abs().numpy()
    kl = np.empty(n)
    top1 = np.empty(n, dtype=bool)
    for a in range(0, n, 256):
        p, q = lp_o[a:min(n, a + 256)].double(), lp_t[a:min(n, a + 256)].double()
        kl[a:a + p.shape[0]] = (p.exp() * (p - q)).sum(-1).numpy()
        top1[a:a + p.shape[0]] = (p.argmax(-1) == q.argmax(-1)).numpy()
    rows = {}
    for name, lo, hi in CLASSES:
        sel = slice(lo, min(hi, n))
        if lo >= n:
            continue
        rows[name] = {"positions": int(len(d[sel])), "max_abs_dlogprob": float(d[sel].max()),
                      "mean_abs_dlogprob": float(d[sel].mean()), "mean_kl": float(kl[sel].mean()),
                      "top1_agree": float(top1[sel].mean())}
    rows["all"] = {"positions": n, "max_abs_dlogprob": float(d.max()), "mean_abs_dlogprob": float(d.mean()),
                   "mean_kl": float(kl.mean()), "top1_agree": float(top1.mean())}
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--checkpoint", type=Path, required=True)
    ap.add_argument("--tokens", type=int, default=400)
    ap.add_argument("--variants", default="full,-act,-kv,-index,none")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/dsv4_oracle_vs_transformers.json"))
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)

    from core.atomic import write_json_atomic
    from oracle.dsv41.checkpoint import Checkpoint
    from oracle.dsv41.model import Model
    from oracle.dsv41.runner import full_weights
    from oracle.hf_dsv4 import load_official_v4

    cfg = json.loads((a.checkpoint / "config.json").read_text())
    ids = torch.randint(0, cfg["vocab_size"], (a.tokens,), generator=torch.Generator().manual_seed(a.seed))
    t0 = time.perf_counter()
    model, _, _ = load_official_v4(a.checkpoint, threads=a.threads)
    with torch.inference_mode():
        lp_t = logprobs(model(input_ids=ids[None], use_cache=False).logits[0].float())
    t_tf = time.perf_counter() - t0
    del model
    ck = Checkpoint(a.checkpoint)
    weights = full_weights(ck)
    results = {"checkpoint": str(a.checkpoint), "tokens": a.tokens, "seed": a.seed, "threads": a.threads,
               "transformers_s": round(t_tf, 1), "variants": {}}
    off_of = {"full": set(), "-act": {"act"}, "-kv": {"kv"}, "-index": {"index"}, "none": {"act", "kv", "index"}}
    for v in a.variants.split(","):
        t1 = time.perf_counter()
        with emulation_off(off_of[v]), torch.inference_mode():
            m = Model(ck.model_config, weights, None, precision="fp32")
            lp_o = logprobs(m.forward(ids[None], m.new_state(1)).logits[0].float())
        results["variants"][v] = {"emulation_off": sorted(off_of[v]), "seconds": round(time.perf_counter() - t1, 1),
                                  "classes": compare(lp_o, lp_t, ids)}
        a.out.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(a.out, results)  # after every variant: a long run keeps what it measured
        print(v, json.dumps(results["variants"][v]["classes"]["all"]), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
