"""Subprocess of the SIGKILL-resume tests: a fork server for one oracle.

    python -m tests.reliability.oracle_driver hf
    python -m tests.reliability.oracle_driver dsv41 CHECKPOINT_DIR PANEL_JSON

It imports torch and the oracle once (1 thread, no thread pool started, so forking is safe; for ``hf`` it also
loads the fp32 SmolLM2 model), prints ``loaded``, then for every stdin line ``run WORK OUT SPILL`` forks a
child that scores the panel resumably in WORK — ``hf``: ``score_panel_hf(checkpoint_dir=WORK)`` on
``helpers.smol_subset()``; ``dsv41``: the layer-streamed ``run_panel(..., WORK, spill=SPILL)`` — and saves the
record to OUT. It prints ``child PID`` at once and ``exit PID CODE`` when the child ends (0 finished, -9
SIGKILL). Each child is a separate process the test SIGKILLs; a trial then costs the scoring only, not the
seconds of imports and model load.
"""

from __future__ import annotations

import os
import sys


def _hf_job():
    from oracle.hf import score_panel_hf
    from tests.reliability.helpers import RESUME_TOP_K, smol_oracle, smol_subset

    panel, orc = smol_subset(), smol_oracle()

    def job(work: str, out: str, spill: str) -> None:
        score_panel_hf(orc.model_dir, panel, top_k=RESUME_TOP_K, oracle=orc, checkpoint_dir=work).save(out)
    return job


def _dsv41_job(ckpt: str, panel_json: str):
    import torch

    from oracle.dsv41.checkpoint import Checkpoint
    from oracle.dsv41.runner import run_panel
    from panels import encoded_from_json
    from tests.reliability.helpers import dsv41_options

    torch.set_num_threads(1)
    panel = encoded_from_json(panel_json)

    def job(work: str, out: str, spill: str) -> None:
        run_panel(Checkpoint(ckpt), panel, work, dsv41_options(spill)).save(out)
    return job


def main(argv: list[str]) -> None:
    job = _hf_job() if argv[1] == "hf" else _dsv41_job(argv[2], argv[3])
    print("loaded", flush=True)
    for line in sys.stdin:
        cmd, work, out, spill = line.split()
        assert cmd == "run", line
        pid = os.fork()
        if pid == 0:  # child: score, save, leave without running the parent's atexit handlers
            code = 1
            try:
                job(work, out, spill)
                code = 0
            finally:
                os._exit(code)
        print(f"child {pid}", flush=True)
        _, status = os.waitpid(pid, 0)
        print(f"exit {pid} {os.waitstatus_to_exitcode(status)}", flush=True)


if __name__ == "__main__":
    main(sys.argv)
