"""Subprocess of the SIGKILL-resume test: ``python -m tests.reliability.oracle_driver``.

A fork server: it imports torch/transformers and loads the fp32 SmolLM2 oracle once (1 thread, no thread
pool started, so forking is safe), prints ``loaded``, then for every stdin line ``run CKPT_DIR OUT`` forks a
child that scores ``helpers.smol_subset()`` with per-sequence checkpoints in CKPT_DIR (resuming what is
there) and saves the record to OUT. It prints ``child PID`` at once and ``exit PID STATUS`` when the child
ends (STATUS as os.waitpid gives it: 0 = finished, 9 = SIGKILL). Each child is a separate process the test
SIGKILLs; the per-trial cost is then the scoring alone, not the ~10 s of imports and model load.
"""

from __future__ import annotations

import os
import sys


def main() -> None:
    from oracle.hf import score_panel_hf
    from tests.reliability.helpers import RESUME_TOP_K, smol_oracle, smol_subset

    panel = smol_subset()
    orc = smol_oracle()
    print("loaded", flush=True)
    for line in sys.stdin:
        cmd, ckpt, out = line.split()
        assert cmd == "run", line
        pid = os.fork()
        if pid == 0:  # child: score, save, leave without running the parent's atexit handlers
            code = 1
            try:
                rec = score_panel_hf(orc.model_dir, panel, top_k=RESUME_TOP_K, oracle=orc, checkpoint_dir=ckpt)
                rec.save(out)
                code = 0
            finally:
                os._exit(code)
        print(f"child {pid}", flush=True)
        _, status = os.waitpid(pid, 0)
        print(f"exit {pid} {os.waitstatus_to_exitcode(status)}", flush=True)


if __name__ == "__main__":
    main()
