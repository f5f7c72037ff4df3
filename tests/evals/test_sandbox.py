"""Hostile generated code, each contained by the sandbox and scored as a failure; the harness unharmed.

Real bubblewrap, real rlimits, the real scoring path (evals.code.score_solution on a HumanEval-shaped
problem). Each hostile sample is checked for being *contained* (its effect did not happen outside),
not only for failing.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from pathlib import Path

import pytest

from evals.code import score_solution
from evals.data import CodeProblem
from evals.sandbox import Limits, run_python

PROBLEM = CodeProblem("Test/0", 'def inc(x):\n    """Return x + 1."""\n', "inc", "    return x + 1\n",
                      test="def check(candidate):\n    assert candidate(1) == 2\n    assert candidate(-1) == 0\n")
FAST = Limits(wall_s=8.0, cpu_s=5, memory_mb=512, processes=16)


def _reply(body: str) -> str:
    return f"```python\n{body}\ndef inc(x):\n    return x + 1\n```"


@pytest.fixture
def sentinel(tmp_path: Path) -> Path:
    p = tmp_path / "harness-file.txt"
    p.write_text("untouched")
    os.chmod(tmp_path, 0o777)   # even a world-writable harness folder must stay out of reach
    return p


def _harness_intact(sentinel: Path) -> None:
    assert sentinel.read_text() == "untouched"
    assert os.getpid() > 0 and Path(f"/proc/{os.getpid()}").is_dir()
    assert run_python("print(6 * 7)", FAST).stdout.strip() == "42"   # the sandbox still works afterwards


def test_a_correct_solution_passes_and_a_wrong_one_fails():
    assert score_solution(PROBLEM, _reply(""), FAST).base is True
    assert score_solution(PROBLEM, "```python\ndef inc(x):\n    return x\n```", FAST).base is False


def test_an_early_clean_exit_or_a_printed_token_does_not_pass():
    assert score_solution(PROBLEM, _reply("import os\nos._exit(0)"), FAST).base is False
    assert score_solution(PROBLEM, _reply("import sys\nprint('PASS')\nsys.exit(0)"), FAST).base is False


def test_fork_bomb_is_contained(sentinel):
    t0 = time.perf_counter()
    out = score_solution(PROBLEM, _reply("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n"
                                         "        pass"), FAST)
    assert out.base is False
    assert time.perf_counter() - t0 < FAST.wall_s + 10
    _harness_intact(sentinel)


def test_network_access_is_refused(sentinel):
    # a listener on the host's loopback: the sandbox must not reach it (own network namespace)
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    srv.settimeout(0.5)
    port = srv.getsockname()[1]
    hits = []

    def accept():
        try:
            hits.append(srv.accept())
        except OSError:
            pass

    th = threading.Thread(target=accept)
    th.start()
    body = (f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
            "s.sendall(b'x')\n")
    out = score_solution(PROBLEM, _reply(body), FAST)
    th.join()
    srv.close()
    assert out.base is False and "Error" in out.detail
    assert hits == []
    _harness_intact(sentinel)


def test_writing_outside_the_temp_dir_is_refused(sentinel):
    body = (f"open({str(sentinel)!r}, 'w').write('pwned')\n")
    out = score_solution(PROBLEM, _reply(body), FAST)
    assert out.base is False
    repo_file = Path(__file__).resolve()
    before = repo_file.read_bytes()
    out2 = score_solution(PROBLEM, _reply(f"open({str(repo_file)!r}, 'a').write('# appended')\n"), FAST)
    assert out2.base is False
    assert repo_file.read_bytes() == before
    out3 = run_python("open('/usr/ds41-pwned', 'w').write('x')", FAST)
    assert out3.status == "failed" and not Path("/usr/ds41-pwned").exists()
    _harness_intact(sentinel)


def test_writing_inside_the_temp_dir_works_and_is_bounded():
    ok = run_python("open('scratch.txt', 'w').write('x' * 1000)\nprint(len(open('scratch.txt').read()))", FAST)
    assert ok.status == "ok" and ok.stdout.strip() == "1000"
    big = run_python("open('big', 'wb').write(b'x' * (64 * 1024 * 1024))", FAST)
    assert big.status == "failed"


def test_infinite_loop_is_stopped(sentinel):
    t0 = time.perf_counter()
    out = score_solution(PROBLEM, _reply("while True:\n    pass"), Limits(wall_s=4.0, cpu_s=3))
    assert out.base is False
    assert time.perf_counter() - t0 < 4.0 + 5
    _harness_intact(sentinel)


def test_memory_hog_is_stopped(sentinel):
    out = score_solution(PROBLEM, _reply("x = bytearray(4 * 1024 ** 3)"), FAST)
    assert out.base is False and "MemoryError" in out.detail
    _harness_intact(sentinel)


def test_killing_the_parent_and_the_harness_is_contained(sentinel):
    # Inside its PID namespace the parent is the sandbox's own init (SIGKILL from inside is ignored) and
    # the harness's pid names no process; the solution then returns nothing, so its tests fail.
    me = os.getpid()
    reply = ("```python\nimport os, signal\n\ndef inc(x):\n"
             f"    for pid in (os.getppid(), {me}, 1):\n"
             "        try:\n            os.kill(pid, signal.SIGKILL)\n        except OSError:\n            pass\n"
             "    os.killpg(0, signal.SIGKILL)\n```")
    out = score_solution(PROBLEM, reply, FAST)
    assert out.base is False
    _harness_intact(sentinel)
