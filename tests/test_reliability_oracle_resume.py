"""Reliability: the oracle SIGKILLed at 10 random points resumes to a bit-identical reference, 10 times out of 10.

Runs on oracle/hf.py's per-sequence checkpoints (``score_panel_hf(checkpoint_dir=...)``) over a 6-sequence
SmolLM2 subset of the default panel. The DeepSeek-V4.1 layer-streamed runner (oracle/dsv41/runner.py) does
not exist yet; its version of this test is pending (docs/RELIABILITY.md).

Each trial: a fresh checkpoint folder; a forked oracle process (tests/reliability/oracle_driver.py) scores the
subset and is SIGKILLed at a uniformly random time within one full run's duration; then the panel is scored
again on that folder (resuming) and must equal the clean, uninterrupted record bit for bit: every array,
dtype and provenance field except the wall time, the resumed-sequence count and the git-commit suffix.
"""

from __future__ import annotations

import dataclasses
import os
import random
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from ds41gates.records import Record
from tests.reliability.helpers import REPO, RESUME_TOP_K, gate_session_env, smol_oracle, smol_reference, smol_subset

TRIALS = 10
ARRAYS = ("seq_offsets", "token_ids", "scored", "pos_seq", "pos_index", "topk_ids", "topk_logprobs",
          "actual_logprob", "actual_rank", "logsumexp", "full_logprobs", "ambiguous")


def assert_bit_identical(a: Record, b: Record, what: str) -> None:
    for name in ARRAYS:
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None), (what, name)
        if x is not None:
            assert x.dtype == y.dtype and x.shape == y.shape, (what, name, x.dtype, y.dtype, x.shape, y.shape)
            assert x.tobytes() == y.tobytes(), (what, name)       # bitwise, NaN/-inf and signed zeros included
    assert (a.k, a.seq_ids, a.domains) == (b.k, b.seq_ids, b.domains), what

    def stable(p):
        extra = {k: v for k, v in p.extra.items() if k not in ("seconds", "resumed_sequences")}
        # the commit suffix of code_version is left out: other work may commit while this test runs
        return dataclasses.replace(p, created="", extra=extra, code_version=p.code_version.split("+g")[0])
    assert stable(a.provenance) == stable(b.provenance), what


class _Driver:
    def __init__(self):
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.reliability.oracle_driver"], cwd=str(REPO),
                                     env=gate_session_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, text=True, start_new_session=True)
        assert self._line() == "loaded"

    def _line(self) -> str:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"oracle driver ended (rc {self.proc.poll()})")
        return line.strip()

    def run(self, ckpt, out, kill_after_s: float | None = None) -> tuple[int, float]:
        """Score in a forked child; SIGKILL it ``kill_after_s`` after it started. Returns (exit code, seconds)."""
        self.proc.stdin.write(f"run {ckpt} {out}\n")
        self.proc.stdin.flush()
        word, pid = self._line().split()
        assert word == "child"
        t0 = time.monotonic()
        if kill_after_s is not None:
            time.sleep(kill_after_s)
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
        word, got, code = self._line().split()
        assert (word, got) == ("exit", pid)
        return int(code), time.monotonic() - t0

    def close(self):
        self.proc.stdin.close()
        self.proc.wait(30)


@pytest.mark.timeout(900)
def test_sigkill_at_10_random_points_resumes_bit_identical(tmp_path):
    from oracle.hf import score_panel_hf

    clean = smol_reference(RESUME_TOP_K)                 # in this process, no checkpoints
    orc, panel = smol_oracle(), smol_subset()
    seed = int.from_bytes(os.urandom(4), "little")
    rng = random.Random(seed)
    drv = _Driver()
    try:
        # calibration: an uninterrupted forked run equals the in-process record, and gives the window
        code, full_s = drv.run(tmp_path / "calib", tmp_path / "calib.safetensors")
        assert code == 0
        assert_bit_identical(Record.load(tmp_path / "calib.safetensors"), clean, "uninterrupted subprocess run")
        trials = []
        for t in range(TRIALS):
            ckpt = tmp_path / f"trial{t}"
            point = rng.uniform(0.0, full_s)
            code, _ = drv.run(ckpt, tmp_path / f"trial{t}.safetensors", kill_after_s=point)
            done_before = len(list(ckpt.glob("*.safetensors"))) if ckpt.exists() else 0
            resumed = score_panel_hf(orc.model_dir, panel, top_k=RESUME_TOP_K, oracle=orc, checkpoint_dir=ckpt)
            assert resumed.provenance.extra["resumed_sequences"] == done_before
            assert_bit_identical(resumed, clean, f"trial {t} (seed {seed}, kill at {point:.2f} s of {full_s:.2f})")
            trials.append((round(point, 2), code, done_before))
    finally:
        drv.close()
    print(f"\nseed {seed}; full run {full_s:.2f} s; (kill point s, child exit, checkpoints kept): {trials}")
    assert sum(1 for _, code, _ in trials if code == -signal.SIGKILL) >= TRIALS // 2, trials  # really killed
    assert len({n for *_, n in trials}) >= 2, trials                       # at different stages


def test_corrupt_checkpoint_is_recomputed_not_fatal(tmp_path):
    """A truncated per-sequence checkpoint (a crash during a write, a full disk) is recomputed."""
    from oracle.hf import score_panel_hf

    clean = smol_reference(RESUME_TOP_K)
    orc, panel = smol_oracle(), smol_subset()
    sub = dataclasses.replace(panel, sequences=panel.sequences[:2])
    first = score_panel_hf(orc.model_dir, sub, top_k=RESUME_TOP_K, oracle=orc, checkpoint_dir=tmp_path)
    files = sorted(tmp_path.glob("*.safetensors"))
    assert len(files) == 2
    files[0].write_bytes(files[0].read_bytes()[:-100])                     # truncated
    files[1].write_bytes(b"\0" * 7)                                         # not even a header
    again = score_panel_hf(orc.model_dir, sub, top_k=RESUME_TOP_K, oracle=orc, checkpoint_dir=tmp_path)
    assert again.provenance.extra["resumed_sequences"] == 0
    assert_bit_identical(again, first, "recomputed after corrupt checkpoints")
    n = int(clean.seq_offsets[2])
    assert again.token_ids.tobytes() == clean.token_ids[:n].tobytes()
