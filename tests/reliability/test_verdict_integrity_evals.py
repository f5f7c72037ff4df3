"""Verdict integrity of the code evals (issue 27, parts 1 and 4): untrusted code never decides its own verdict,
the sandbox sees no secret of the harness, and its output is read with a cap.

Each attack is a *wrong* solution (HumanEval-shaped ``inc`` and the EvalPlus-shaped ``add`` of
tests/data/evals/tinyplus.jsonl) wrapped in a trick that made the old checker report a pass: printing the
pass token (a global of the program under test), exiting 0 from ``sys.excepthook`` / ``atexit``, returning an
object whose ``__eq__`` is always True. All run through the real scoring path (real bubblewrap).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from core.records import Provenance
from evals import data
from evals.code import score_solution
from evals.data import CodeProblem, Dataset
from evals.records import EvalRecord, ProblemResult
from evals.run import GenerationStore, score
from evals.sandbox import Limits, run_python

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "tests" / "data" / "evals" / "tinyplus.jsonl"
FAST = Limits(wall_s=10.0, cpu_s=5, memory_mb=512, processes=16)

INC = CodeProblem("Test/inc", 'def inc(x):\n    """Return x + 1."""\n', "inc", "    return x + 1\n",
                  test="def check(candidate):\n    assert candidate(1) == 2\n    assert candidate(-1) == 0\n")
WRONG_INC = "def inc(x):\n    return x\n"
WRONG_ADD = "def add(a, b):\n    return a - b\n"

# the old program's pass token was the global `_ds41_nonce`; an attack that finds no such global prints PASS
TOKEN = "globals().get('_ds41_nonce', 'PASS')"
ATTACKS = {
    "print_token_and_exit_0": f"import os\nprint({TOKEN}, flush=True)\nos._exit(0)\n",
    "excepthook_prints_token_exits_0": textwrap.dedent(f"""\
        import os, sys
        _tok = {TOKEN}
        def _hook(*exc):
            print(_tok, flush=True)
            os._exit(0)
        sys.excepthook = _hook
        """),
    "atexit_prints_token_exits_0": textwrap.dedent(f"""\
        import atexit, os
        _tok = {TOKEN}
        atexit.register(lambda: (print(_tok, flush=True), os._exit(0)))
        """),
    "sys_exit_0_at_import": "import sys\nsys.exit(0)\n",
    "os_exit_0_at_import": "import os\nos._exit(0)\n",
    # forge any line protocol on every descriptor it can reach, then leave cleanly
    "forge_protocol_on_every_fd": textwrap.dedent("""\
        import os
        for _fd in range(0, 64):
            for _line in (b'{"done": true}\\n', b'{"ok": 2}\\n', b'PASS\\n', b'{"ok": 5}\\n'):
                try:
                    os.write(_fd, _line)
                except OSError:
                    pass
        os._exit(0)
        """),
}

ALWAYS_EQUAL = {
    "eq_always_true": textwrap.dedent("""\
        class _Eq:
            def __eq__(self, other):
                return True
            def __ne__(self, other):
                return False
            __hash__ = object.__hash__
        _VALUE = _Eq()
        """),
    "int_subclass_eq_always_true": textwrap.dedent("""\
        class _Eq(int):
            def __eq__(self, other):
                return True
            def __ne__(self, other):
                return False
            __hash__ = int.__hash__
        _VALUE = _Eq(0)
        """),
}


def _block(code: str) -> str:
    return f"```python\n{code}```"


@pytest.fixture(scope="module")
def add_problem() -> CodeProblem:
    ds = data.load_plus("humaneval+", TINY, expect_count=8)
    return next(p for p in ds.problems if p.entry_point == "add")


# ---------------------------------------------------------------------------------------------- a correct one passes
def test_correct_solutions_still_pass(add_problem):
    assert score_solution(INC, _block("def inc(x):\n    return x + 1\n"), FAST).base is True
    got = score_solution(add_problem, _block("def add(a, b):\n    return a + b\n"), FAST)
    assert (got.base, got.plus) == (True, True), got.detail
    # a chatty correct solution (prints while it works, reads stdin, has a __main__ block) still passes
    chatty = ("import sys\nprint('thinking...')\nsys.stderr.write('debug\\n')\nsys.stdin.read()\n"
              "def inc(x):\n    print('called with', x)\n    return x + 1\n"
              "if __name__ == '__main__':\n    print(inc(input()))\n")
    assert score_solution(INC, _block(chatty), FAST).base is True


# ------------------------------------------------------------------------------------------ (a), (b): exits and tokens
@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_exit_and_token_tricks_do_not_pass_humaneval(attack):
    got = score_solution(INC, _block(ATTACKS[attack] + WRONG_INC), FAST)
    assert got.base is False, f"{attack}: a wrong solution scored base=True"
    assert got.detail


@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_exit_and_token_tricks_do_not_pass_evalplus(attack, add_problem):
    got = score_solution(add_problem, _block(ATTACKS[attack] + WRONG_ADD), FAST)
    assert (got.base, got.plus) == (False, False), f"{attack}: a wrong solution scored {got}"


def test_a_hook_in_the_solution_cannot_turn_a_later_failure_into_a_pass():
    # the solution is right on the first test and wrong on the second; the hook fires after the failure
    body = ATTACKS["excepthook_prints_token_exits_0"] + "def inc(x):\n    return 2 if x == 1 else 7\n"
    assert score_solution(INC, _block(body), FAST).base is False


# ------------------------------------------------------------------------------------------ (c): always-equal objects
@pytest.mark.parametrize("kind", sorted(ALWAYS_EQUAL))
def test_an_always_equal_object_does_not_pass_humaneval(kind):
    got = score_solution(INC, _block(ALWAYS_EQUAL[kind] + "def inc(x):\n    return _VALUE\n"), FAST)
    assert got.base is False, f"{kind}: scored base=True"


@pytest.mark.parametrize("kind", sorted(ALWAYS_EQUAL))
def test_an_always_equal_object_does_not_pass_evalplus_base_or_plus(kind, add_problem):
    got = score_solution(add_problem, _block(ALWAYS_EQUAL[kind] + "def add(a, b):\n    return _VALUE\n"), FAST)
    assert (got.base, got.plus) == (False, False), f"{kind}: scored {got}"


def test_patching_the_comparison_inside_the_sandbox_changes_nothing(add_problem):
    # whatever the candidate does to builtins and json in its own process, the verdict is not computed there
    body = textwrap.dedent("""\
        import builtins, json, math
        builtins.isinstance = lambda *a: True
        builtins.abs = lambda x: 0
        math.isclose = lambda *a, **k: True
        json.dumps = lambda *a, **k: '{"ok": 5}'
        """) + WRONG_ADD
    got = score_solution(add_problem, _block(body), FAST)
    assert (got.base, got.plus) == (False, False)


def test_non_plain_return_values_fail(add_problem):
    for ret in ("(x for x in [a + b])", "object()", "lambda: a + b", "float(a + b) if False else {a + b}"):
        got = score_solution(add_problem, _block(f"def add(a, b):\n    return {ret}\n"), FAST)
        assert got.base is False, ret


# ---------------------------------------------------------------------------------------------- (d): output flood
FLOOD_MB = 64


def test_output_over_the_cap_is_cut_marked_and_the_process_killed():
    src = ("import os, sys\nchunk = 'x' * (1 << 20)\n"
           f"for _ in range({FLOOD_MB}):\n    sys.stdout.write(chunk)\nsys.stdout.flush()\n"
           "os.write(2, b'e' * (1 << 20))\n")
    t0 = time.perf_counter()
    out = run_python(src, FAST)
    wall = time.perf_counter() - t0
    cap = FAST.output_mb * (1 << 20)
    assert out.status != "ok"
    assert out.truncated
    assert len(out.stdout) <= cap + 200 and "truncated" in out.stdout
    assert wall < FAST.wall_s


def test_flooding_solutions_fail_and_the_harness_stays_small(add_problem):
    flood = f"import sys\nfor _ in range({FLOOD_MB}):\n    sys.stdout.write('y' * (1 << 20))\n"
    # a correct solution that floods: killed at the cap, no answers, a failure
    assert score_solution(INC, _block(flood + "def inc(x):\n    return x + 1\n"), FAST).base is False
    got = score_solution(add_problem, _block(flood.replace("sys.stdout", "sys.stderr") + WRONG_ADD), FAST)
    assert got.base is False
    # the harness's own memory: a 384 MiB flood read by a fresh interpreter running the real run_python
    probe = textwrap.dedent("""\
        import resource, sys
        from evals.sandbox import Limits, run_python
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        out = run_python("import os\\nb = b'z' * (1 << 20)\\nfor _ in range(384):\\n    os.write(1, b)\\n",
                         Limits(wall_s=30.0, cpu_s=20, memory_mb=512, processes=16))
        after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        print(before, after, len(out.stdout), out.status)
        """)
    res = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    before_kb, after_kb, n_out, _status = res.stdout.split()
    grew_mb = (int(after_kb) - int(before_kb)) / 1024
    assert grew_mb < 64, f"harness peak RSS grew {grew_mb:.0f} MiB reading a 384 MiB flood"
    assert int(n_out) <= FAST.output_mb * (1 << 20) + 200


# ---------------------------------------------------------------------------------------------- secrets
CANARY_KEY = "canary-xyz-ds41-engine-key-0001"
CANARY_HF = "hf_canary_token_0002"
CANARY_PLAIN = "canary-plain-value-0003"     # a variable whose name does not look secret: not passed either

READ_ENV = textwrap.dedent("""\
    import os
    seen = []
    for path in ['/proc/1/environ', '/proc/self/environ'] + [f'/proc/{p}/environ' for p in os.listdir('/proc')
                                                             if p.isdigit()]:
        try:
            seen.append(path + ' ' + open(path, 'rb').read().decode('latin-1').replace('\\0', ' '))
        except OSError as e:
            seen.append(path + ' ' + type(e).__name__)
    seen.append('os.environ ' + repr(dict(os.environ)))
    """)


@pytest.fixture
def canaries(monkeypatch):
    monkeypatch.setenv("DS41_ENGINE_API_KEY", CANARY_KEY)
    monkeypatch.setenv("HF_TOKEN", CANARY_HF)
    monkeypatch.setenv("DS41_CANARY_PLAIN", CANARY_PLAIN)


def test_the_sandbox_sees_no_harness_environment(canaries):
    out = run_python(READ_ENV + "print('\\n'.join(seen))\nimport json\nprint(json.dumps(dict(os.environ)))\n", FAST)
    assert out.status == "ok", out.stderr
    assert "/proc/1/environ" in out.stdout
    for c in (CANARY_KEY, CANARY_HF, CANARY_PLAIN):
        assert c not in out.stdout
    env = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(env) <= {"PATH", "HOME", "PWD", "LANG", "PYTHONDONTWRITEBYTECODE", "LC_CTYPE"}, env


def test_a_secret_never_reaches_a_saved_eval_record(canaries, tmp_path):
    # the solution raises with whatever secret it can find: the record's detail must not carry it
    leak = READ_ENV + "raise RuntimeError(' | '.join(s for s in seen if 'canary' in s or 'KEY' in s) or 'nothing')\n"
    ds = Dataset("humaneval", "test", "ab", (INC,))
    gens = {"Test/inc": {"id": "Test/inc", "completion_ids": [1, 2, 3], "finish": "stop",
                         "reply": _block(leak + WRONG_INC)}}
    results = score(ds, gens, progress=False)
    assert results[0].base is False
    # and a detail that does hold a key (from anywhere) is redacted when the record is written
    results.append(ProblemResult("Test/x", 3, "stop", base=False, detail=f"boom {CANARY_KEY} and {CANARY_HF}"))
    prov = Provenance(side="engine", panel_name="humaneval", panel_version="x", panel_hash="sha256:ab",
                      tokenizer_hash="t", source={"url": "http://u:pw-canary-0004@h:1", "note": CANARY_KEY})
    path = tmp_path / "humaneval.eval.json"
    EvalRecord("humaneval", prov, results).save(path)
    text = path.read_text()
    for c in (CANARY_KEY, CANARY_HF, "pw-canary-0004"):
        assert c not in text
    assert "<redacted>" in text
    back = EvalRecord.load(path)
    assert back.problems[1].detail == "boom <redacted> and <redacted>"


def test_a_secret_never_reaches_the_generations_file(canaries, tmp_path):
    path = tmp_path / "humaneval.generations.jsonl"
    store = GenerationStore(path, {"suite": "humaneval", "engine": {"model": "m"}})
    store.add({"id": "Test/inc", "reply": f"my key is {CANARY_KEY}", "completion_ids": [1]})
    assert CANARY_KEY not in path.read_text()
    again = GenerationStore(path, {"suite": "humaneval", "engine": {"model": "m"}})
    assert again.done["Test/inc"]["reply"] == "my key is <redacted>"   # what the file holds
    # this run's memory keeps the reply as given: scoring never reads the redacted copy (issue 35)
    assert store.done["Test/inc"]["reply"] == f"my key is {CANARY_KEY}"


# ---------------------------------------------------------------------------------------------- the harness's side
def test_plain_json_round_trips_builtin_values_and_refuses_the_rest():
    from evals import plain

    values = [None, True, 0, -7, 2 ** 100, 3 ** 40_000, -(7 ** 9_000), 1.0, -0.5, float("inf"), float("-inf"),
              "é\u2028\ud800", b"\x00\xff", 1.5 - 2j, [1, [2.5]], (1, "a"), {1, 2}, frozenset({"x"}),
              {"k": (1,), 2: [None]}, [], (), {}]
    for v in values:
        back = plain.decode(plain.loads(plain.dumps({"ok": plain.encode(v)}))["ok"])
        assert back == v and type(back) is type(v)
    nan = plain.decode(plain.loads(plain.dumps({"ok": plain.encode(float("nan"))}))["ok"])
    assert nan != nan
    for bad in (object(), (x for x in ()), True.__class__, [1, object()], range(3), {1: iter([])}):
        with pytest.raises(plain.NotPlain):
            plain.encode(bad)
    # a subclass crosses as the builtin value it holds, read with the base type's methods (none of its own run)
    import collections

    class Rigged(int):
        def __eq__(self, other):
            return True
        __hash__ = int.__hash__

        def __add__(self, other):
            return 99

    class RiggedList(list):
        def __iter__(self):
            return iter([99])

    for sub, want in ((Rigged(3), 3), (RiggedList([1, 2]), [1, 2]), (collections.Counter("aab"), {"a": 2, "b": 1}),
                      (collections.namedtuple("P", "x y")(1, 2), (1, 2)), (bytearray(b"\x00a"), b"\x00a")):
        back = plain.decode(plain.encode(sub))
        assert back == want and type(back) is type(want), sub
    for line in (b'{"ok": NaN}', b'{"ok": 1, "ok": 2}', b'{"ok": {"tuple": [1], "set": []}}', b"\xff",
                 b'{"ok": 1} {"ok": 2}', b"[" * 100_000):
        with pytest.raises(plain.NotPlain):
            msg = plain.loads(line)
            plain.decode(msg["ok"])
    for obj in ({"int": "12"}, {"int": "0x1g"}, {"bytes": "abc"}, {"complex": [1, 2]}, {"complex": [1.0]},
                {"list": [1]}, {"set": [[1]]}, {"dict": [[[1], 2]]}, {"float": "1.5"}, {"tuple": 3}):
        with pytest.raises(plain.NotPlain):
            plain.decode(obj)


def test_evalplus_semantics_in_the_harness():
    from evals.verdict import same_output

    he, mb = "HumanEval/99", "Mbpp/99"
    assert same_output(he, "f", [], 3, 3, 0) and same_output(he, "f", [], 3.0, 3, 0)   # Python's == as EvalPlus
    assert not same_output(he, "f", [], "3", 3, 0) and not same_output(he, "f", [], [3], (3,), 0)
    # floats: atol 1e-6 by default, type must match when not exact, rtol 1e-7
    assert same_output(he, "f", [], 0.1 + 0.2, 0.3, 0) and not same_output(he, "f", [], 0.3 + 1e-5, 0.3, 0)
    assert same_output(he, "f", [], [1.0, 2.0000001], [1.0, 2.0], 0)
    assert not same_output(he, "f", [], (1.0, 2.0000001), [1.0, 2.0], 0)
    assert not same_output(he, "f", [], [1.0], [1.0, 2.0], 0)
    assert not same_output(he, "f", [], float("nan"), float("nan"), 1e-6)
    assert same_output(he, "f", [], 1e9 + 50, 1e9, 0) and not same_output(he, "f", [], 1e9 + 500, 1e9, 0)
    # special oracles
    xs = [-6, 11, -6, 1]                                    # roots 1, 2, 3: any root passes find_zero
    assert same_output(he, "find_zero", [xs], 2.0, 1.0, 1e-6) and not same_output(he, "find_zero", [xs], 1.5, 1.0, 1e-6)
    assert not same_output(he, "find_zero", [xs], "1.0", 1.0, 1e-6)
    assert same_output(mb, "sum_div", [7], 0, 8, 0) and not same_output(he, "sum_div", [7], 0, 8, 0)
    assert same_output(mb, "similar_elements", [], (4, 5), (5, 4), 0)
    assert same_output(mb, "are_equivalent", [], False, True, 0)
    assert same_output(mb, "surface_Area", [3, 4], 35, 30, 0.5)   # round(9 + 6 * sqrt(18.25)) = 35
    assert not same_output(mb, "surface_Area", [3, 4], 36, 30, 0.5)
    assert same_output(mb, "digit_distance_nums", [123, 256], 7, 9, 0)


def test_big_ints_cross_both_ways():
    # 3 ** 30000 has 14,314 digits: past Python's 4,300-digit limit on decimal conversion
    big = CodeProblem("Big/0", "def big(n):\n    pass\n", "big", "    return 3 ** n\n",
                      base_input=([30000], [5]), plus_input=([40000],))
    right, wrong = _block("def big(n):\n    return 3 ** n\n"), _block("def big(n):\n    return 3 ** n + 1\n")
    assert (score_solution(big, right, FAST).base, score_solution(big, right, FAST).plus) == (True, True)
    assert score_solution(big, wrong, FAST).base is False
    he = CodeProblem("Test/big", "def big(n):\n    pass\n", "big", "    return 3 ** n\n",
                     test="def check(candidate):\n    assert candidate(30000) == 3 ** 30000\n")
    assert score_solution(he, right, FAST).base is True and score_solution(he, wrong, FAST).base is False


def test_a_solution_that_never_reads_cannot_block_the_harness():
    # it sleeps at import (no CPU, so RLIMIT_CPU never fires) while the harness writes an input far larger
    # than a pipe's buffer: the wall deadline still ends it
    big_input = CodeProblem("Big/1", "def total(xs):\n    pass\n", "total", "    return sum(xs)\n",
                            base_input=([list(range(200_000))],))
    t0 = time.perf_counter()
    got = score_solution(big_input, _block("import time\ntime.sleep(3600)\ndef total(xs):\n    return sum(xs)\n"),
                         Limits(wall_s=4.0, cpu_s=3, memory_mb=512, processes=16))
    assert got.base is False and "timeout" in got.detail
    assert time.perf_counter() - t0 < 4.0 + 10
