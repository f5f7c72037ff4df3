"""Reliability: the oracle SIGKILLed at random points resumes to a bit-identical reference, every time.

* DeepSeek-V4.1 layer-streamed runner (oracle/dsv41/runner.py ``run_panel``, what ``ds41gate oracle run``
  runs) on the tiny checkpoint (write_tiny_checkpoint): 10 random kill points, 10 resumes. Its own tests
  (tests/oracle/test_dsv41_runner.py) kill at named points through a test hook; here the kill comes from outside at
  a uniformly random time, like a crash or an OOM kill, alternating RAM and disk spill.
* the generic HF oracle (oracle/hf.py ``score_panel_hf(checkpoint_dir=...)``, what ``ensure_reference``
  runs for the default SmolLM2 reference) on a 4-sequence SmolLM2 subset of the default panel: 5 random
  kill points (each trial costs ~2 forward passes of the real model on this 2-core box).

Each trial: a fresh work folder; a forked oracle process (tests/reliability/oracle_driver.py) scores the
panel and is SIGKILLed at a uniformly random time within one full run's duration; then the panel is scored
again on that folder (resuming) and must equal the clean, uninterrupted record bit for bit: every array,
dtype and provenance field except wall times, the resume counters and the git-commit suffix.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest

from core.records import Record
from tests.reliability.helpers import (
    REPO, RESUME_TOP_K, dsv41_options, dsv41_panel_json, gate_session_env, smol_oracle, smol_reference, smol_subset,
)

DSV41_TRIALS = 10
HF_TRIALS = 5
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
        extra = {k: v for k, v in p.extra.items() if k not in ("seconds", "resumed_sequences", "run")}
        # the commit suffix of code_version is left out: other work may commit while this test runs
        return dataclasses.replace(p, created="", extra=extra, code_version=p.code_version.split("+g")[0])
    assert stable(a.provenance) == stable(b.provenance), what


class _Driver:
    def __init__(self, *args: str):
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.reliability.oracle_driver", *args], cwd=str(REPO),
                                     env=gate_session_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, text=True, start_new_session=True)
        assert self._line() == "loaded"

    def _line(self) -> str:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"oracle driver ended (rc {self.proc.poll()})")
        return line.strip()

    def run(self, work, out, kill_after_s: float | None = None, spill: str = "ram") -> tuple[int, float]:
        """Score in a forked child; SIGKILL it ``kill_after_s`` after it started. Returns (exit code, seconds)."""
        self.proc.stdin.write(f"run {work} {out} {spill}\n")
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


def _kill_and_resume(drv: _Driver, tmp_path, trials: int, clean: Record, resume, spills=("ram",)):
    """The trial loop shared by both oracles; ``resume(work) -> (Record, done_before)``."""
    seed = int.from_bytes(os.urandom(4), "little")
    rng = random.Random(seed)
    # calibration: an uninterrupted forked run equals the in-process record, and gives the time window
    code, full_s = drv.run(tmp_path / "calib", tmp_path / "calib.safetensors")
    assert code == 0
    assert_bit_identical(Record.load(tmp_path / "calib.safetensors"), clean, "uninterrupted subprocess run")
    done = []
    for t in range(trials):
        work, point, spill = tmp_path / f"trial{t}", rng.uniform(0.0, full_s), spills[t % len(spills)]
        code, _ = drv.run(work, tmp_path / f"trial{t}.safetensors", kill_after_s=point, spill=spill)
        resumed, progress = resume(work)
        assert_bit_identical(resumed, clean, f"trial {t} (seed {seed}, {spill}, kill at {point:.2f} s of {full_s:.2f})")
        done.append((round(point, 2), spill, code, progress))
    print(f"\nseed {seed}; full run {full_s:.2f} s; (kill point s, spill, child exit, progress kept): {done}")
    assert sum(1 for *_, code, _ in done if code == -signal.SIGKILL) >= trials // 2, done   # really killed
    assert len({p for *_, p in done}) >= 2, done                                           # at different stages
    return done


@pytest.mark.timeout(600)
def test_dsv41_runner_sigkill_at_10_random_points_resumes_bit_identical(tmp_path):
    from oracle.dsv41.checkpoint import Checkpoint
    from oracle.dsv41.runner import MANIFEST, run_panel
    from panels import encoded_from_json
    from oracle.dsv41.tiny import write_tiny_checkpoint

    ckpt = write_tiny_checkpoint(tmp_path / "tiny", seed=0)
    panel_json = dsv41_panel_json(tmp_path / "panel.json")
    panel = encoded_from_json(panel_json)
    clean = run_panel(Checkpoint(ckpt), panel, tmp_path / "clean-work", dsv41_options())

    def resume(work):
        manifest = work / MANIFEST
        stages = json.loads(manifest.read_text())["stages_done"] if manifest.exists() else 0
        rec = run_panel(Checkpoint(ckpt), panel, work, dsv41_options())
        assert rec.provenance.extra["run"]["resumed_from_stage"] == stages
        return rec, stages

    drv = _Driver("dsv41", str(ckpt), str(panel_json))
    try:
        _kill_and_resume(drv, tmp_path, DSV41_TRIALS, clean, resume, spills=("ram", "disk"))
    finally:
        drv.close()


@pytest.mark.timeout(900)
def test_hf_oracle_sigkill_at_random_points_resumes_bit_identical(tmp_path):
    from oracle.hf import score_panel_hf

    clean = smol_reference(RESUME_TOP_K)                 # in this process, no checkpoints
    orc, panel = smol_oracle(), smol_subset()

    def resume(work):
        kept = len(list(work.glob("*.safetensors"))) if work.exists() else 0
        rec = score_panel_hf(orc.model_dir, panel, top_k=RESUME_TOP_K, oracle=orc, checkpoint_dir=work)
        assert rec.provenance.extra["resumed_sequences"] == kept
        return rec, kept

    drv = _Driver("hf")
    try:
        _kill_and_resume(drv, tmp_path, HF_TRIALS, clean, resume)
    finally:
        drv.close()


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
