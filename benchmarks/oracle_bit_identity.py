"""Oracle bit identity across a refactor: capture every output of the DeepSeek oracle once, compare later.

    python benchmarks/oracle_bit_identity.py capture OUT_DIR [--ckpts DIR]   # before and after a change
    python benchmarks/oracle_bit_identity.py compare BEFORE_DIR AFTER_DIR    # torch.equal per tensor

`capture` runs, for the tiny V4.1 checkpoint (oracle.dsv41.tiny, §20.1) and the tiny V4 checkpoint
(oracle.dsv41.tiny_v4), in fp32 and reference-bf16:
  - the in-memory `Model.forward`: a batch-2 prefill then decode steps (every position's logits), plus the
    DSpark drafts of V4.1 (draft logits and confidences) and the DSpark taps;
  - the layer-streamed runner (`run_panel`) on a two-sequence panel: the record's arrays;
and, once, the runner exactly as `ds41gates.pipeline.ensure_reference` calls it on the `dsv4-ci` panel
(fp32, one thread) over the cached tiny DeepSeek-V4 checkpoint. Each group goes to one safetensors file.

The checkpoints are written once into --ckpts (default /tmp/i30/ckpts) and reused, so that a change to the
writers cannot hide as a change to the oracle: only the oracle's code differs between two captures.
Run it from the checkout under test (the `oracle` package it imports is the one measured).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

PRECISIONS = ("fp32", "reference-bf16")
PANEL_LENGTHS = (140, 9)  # past the V4 window 16 and one ratio-128 entry; a short one with a remainder
RECORD_ARRAYS = ("seq_offsets", "token_ids", "scored", "pos_seq", "pos_index", "topk_ids", "topk_logprobs",
                 "actual_logprob", "actual_rank", "logsumexp", "full_logprobs", "ambiguous")


def _ckpt(ckpts: Path, arch: str) -> Path:
    """The tiny checkpoint of `arch`, written on first use."""
    out = ckpts / arch
    if out.exists():
        return out
    if arch == "v41":
        from oracle.dsv41.tiny import write_tiny_checkpoint
        return write_tiny_checkpoint(out, seed=0)
    from oracle.dsv41.tiny_v4 import write_tiny_v4_checkpoint
    return write_tiny_v4_checkpoint(out, seed=1, overrides={"vocab_size": 512, "sliding_window": 16})


def _ids(n: int, seed: int, vocab: int, b: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (b, n), generator=torch.Generator().manual_seed(seed))


def _in_memory(ck_dir: Path, precision: str) -> dict[str, torch.Tensor]:
    from oracle.dsv41.checkpoint import Checkpoint
    from oracle.dsv41.model import Model
    from oracle.dsv41.runner import engram_token_map, full_weights

    ck = Checkpoint(ck_dir)
    cfg = ck.model_config
    w = full_weights(ck)
    for S in range(cfg.n_mtp_layers):  # the DSpark stages (full_weights holds the backbone only)
        w.update({f"mtp.{S}.{k}": v for k, v in ck.load_mtp(S).items()})
    out: dict[str, torch.Tensor] = {}
    for index_k in ("upstream", "intended"):
        m = Model(cfg, w, engram_token_map(ck), precision=precision, index_k=index_k)
        ids = _ids(150, 7, cfg.vocab_size, b=2)
        st = m.new_state(2)
        o = m.forward(ids[:, :130], st)
        tag = f"{index_k}"
        out[f"{tag}.prefill.logits"] = o.logits
        if o.main_hidden is not None:
            out[f"{tag}.prefill.main_hidden"] = o.main_hidden
        tok = o.logits[:, -1].argmax(-1)
        if m.mtp is not None:
            assert m.mtp.forward_spec(tok, o.main_hidden, 0, st) is None
        for p in range(130, 150):
            o = m.forward(ids[:, p:p + 1], st)
            out[f"{tag}.decode{p}.logits"] = o.logits
            if m.mtp is not None:
                d = m.mtp.forward_spec(ids[:, p], o.main_hidden, p, st)
                out[f"{tag}.draft{p}.logits"] = d.logits
                out[f"{tag}.draft{p}.confidence"] = d.confidence
                out[f"{tag}.draft{p}.ids"] = d.ids
        # a second, one-pass prefill of the whole batch: its last positions are the decode's
        out[f"{tag}.onepass.logits"] = m.forward(ids, m.new_state(2)).logits
    return out


def _record_tensors(rec, prefix: str) -> dict[str, torch.Tensor]:
    """The record's columnar arrays (the provenance holds timings, so it is left out)."""
    out = {}
    for name in RECORD_ARRAYS:
        v = getattr(rec, name, None)
        if v is not None:
            out[f"{prefix}.{name}"] = torch.from_numpy(v.copy())
    return out


def _streamed(ck_dir: Path, precision: str, work: Path) -> dict[str, torch.Tensor]:
    from oracle.dsv41.checkpoint import Checkpoint
    from oracle.dsv41.runner import RunOptions, run_panel
    from panels import encoded_from_json

    g = torch.Generator().manual_seed(0)
    seqs = [{"seq_id": f"q{i}", "domain": "chat", "token_ids": torch.randint(0, 512, (n,), generator=g).tolist()}
            for i, n in enumerate(PANEL_LENGTHS)]
    p = work / "panel.json"
    p.write_text(json.dumps({"panel_name": "bit-identity", "panel_version": "1", "sequences": seqs}))
    rec = run_panel(Checkpoint(ck_dir), encoded_from_json(p), work / f"run-{precision}",
                    RunOptions(precision=precision, threads=1, top_k=16, full_logprobs=True, progress=False))
    return _record_tensors(rec, "streamed")


def _dsv4_ci(work: Path) -> dict[str, torch.Tensor]:
    """The runner as ensure_reference calls it for the vllm-cpu-dsv4 profile."""
    from ds41gates.pipeline import ORACLE_TOP_K
    from engine.target import resolve_gate_target
    from oracle.dsv41.checkpoint import Checkpoint
    from oracle.dsv41.runner import RunOptions, run_panel

    target = resolve_gate_target("vllm-cpu-dsv4")
    encoded, model_dir, oracle = target.encoded, target.model_dir, target.oracle
    assert oracle == "deepseek", oracle
    rec = run_panel(Checkpoint(model_dir), encoded, work / "dsv4-ci",
                    RunOptions(precision="fp32", threads=1, top_k=ORACLE_TOP_K, progress=False))
    print(f"dsv4-ci: {len(encoded.sequences)} sequences over {model_dir}", file=sys.stderr)
    return _record_tensors(rec, "dsv4-ci")


def capture(out_dir: Path, ckpts: Path, skip_ci: bool) -> None:
    import oracle

    print(f"oracle package: {oracle.__file__}", file=sys.stderr)
    out_dir.mkdir(parents=True, exist_ok=True)
    ckpts.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for arch in ("v41", "v4"):
            ck_dir = _ckpt(ckpts, arch)
            for precision in PRECISIONS:
                work = Path(tmp) / f"{arch}-{precision}"
                work.mkdir()
                tensors = {f"model.{k}": v.contiguous() for k, v in _in_memory(ck_dir, precision).items()}
                tensors.update(_streamed(ck_dir, precision, work))
                save_file(tensors, str(out_dir / f"{arch}-{precision}.safetensors"))
                print(f"{arch} {precision}: {len(tensors)} tensors", file=sys.stderr)
        if not skip_ci:
            save_file(_dsv4_ci(Path(tmp)), str(out_dir / "dsv4-ci-fp32.safetensors"))


def compare(before: Path, after: Path) -> int:
    names = sorted(p.name for p in before.glob("*.safetensors"))
    if names != sorted(p.name for p in after.glob("*.safetensors")):
        print(f"different file sets: {names} vs {sorted(p.name for p in after.glob('*.safetensors'))}")
        return 1
    n_tensors = n_elements = n_diff = 0
    for name in names:
        a, b = load_file(str(before / name)), load_file(str(after / name))
        if set(a) != set(b):
            print(f"{name}: tensor names differ: {sorted(set(a) ^ set(b))[:5]}")
            return 1
        diff = [k for k in a if not torch.equal(a[k], b[k])]
        n_tensors += len(a)
        n_elements += sum(v.numel() for v in a.values())
        n_diff += len(diff)
        print(f"{name}: {len(a)} tensors, {sum(v.numel() for v in a.values())} elements, {len(diff)} differ"
              + (f" (first: {diff[:3]})" if diff else ""))
    print(f"total: {n_tensors} tensors, {n_elements} elements compared, {n_diff} differ")
    return 1 if n_diff else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("capture")
    c.add_argument("out_dir", type=Path)
    c.add_argument("--ckpts", type=Path, default=Path("/tmp/i30/ckpts"))
    c.add_argument("--skip-ci", action="store_true", help="leave out the dsv4-ci panel run")
    k = sub.add_parser("compare")
    k.add_argument("before", type=Path)
    k.add_argument("after", type=Path)
    a = ap.parse_args(argv)
    if a.cmd == "capture":
        capture(a.out_dir, a.ckpts, a.skip_ci)
        return 0
    return compare(a.before, a.after)


if __name__ == "__main__":
    sys.exit(main())
