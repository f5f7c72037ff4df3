"""Code suites: the model's reply → a program → run in the sandbox → passed / failed.

HumanEval: the problem's prompt (imports, helpers, the signature), then the model's solution, then the
official ``check(candidate)`` tests. EvalPlus (HumanEval+, MBPP+): the solution is called on every
``base_input`` and then every ``plus_input``, each output compared with the canonical solution's
(``atol`` for floats), as evalplus judges. *base* passes when every base input matches, *plus* when the
base and the plus inputs all do.

The driver prints a per-run nonce (read from stdin before the solution runs) only after the last test:
a solution that exits early with status 0, or prints PASS itself, does not pass.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from evals.data import CodeProblem
from evals.sandbox import Limits, Outcome, nonce, run_python

CODE_INSTRUCTION = ("Please provide a self-contained Python script that solves the following problem in a "
                    "markdown code block:\n```python\n{prompt}\n```")

_BLOCK = re.compile(r"```[ \t]*(?:python|py|Python)?[ \t]*\n(.*?)(?:```|\Z)", re.S)


def solution_code(problem: CodeProblem, reply: str) -> str:
    """The code of a reply: the first fenced block that defines the entry point, else the first fenced
    block, else the whole reply. A body without the ``def`` continues the prompt (completion style)."""
    blocks = _BLOCK.findall(reply)
    defining = [b for b in blocks if re.search(rf"^\s*def\s+{re.escape(problem.entry_point)}\s*\(", b, re.M)]
    code = defining[0] if defining else (blocks[0] if blocks else reply)
    if not re.search(rf"^\s*def\s+{re.escape(problem.entry_point)}\s*\(", code, re.M):
        return problem.prompt + code
    return code


_DRIVER_HEAD = """\
import sys as _sys
_ds41_nonce = _sys.stdin.readline().strip()
"""

_PLUS_DRIVER = """
import copy as _copy, json as _json, math as _math
_ds41_sol_ns = {{}}
exec(compile({canonical!r}, "canonical.py", "exec"), _ds41_sol_ns)
_ds41_ref = _ds41_sol_ns[{entry!r}]
_ds41_cases = _json.loads({cases!r})
_ds41_atol = {atol!r}

def _ds41_same(a, b):
    if isinstance(a, float) or isinstance(b, float):
        if isinstance(a, (int, float)) and isinstance(b, (int, float)):
            if _math.isnan(a) and _math.isnan(b):
                return True
            return abs(a - b) <= max(_ds41_atol, 1e-6 * max(abs(a), abs(b)))
        return False
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_ds41_same(x, y) for x, y in zip(a, b))
    return a == b

_ds41_cand = {entry}
for _ds41_i, _ds41_args in enumerate(_ds41_cases[{first}:{last}]):
    _want = _ds41_ref(*_copy.deepcopy(_ds41_args))
    _got = _ds41_cand(*_copy.deepcopy(_ds41_args))
    if not _ds41_same(_got, _want):
        raise AssertionError(f"input {{_ds41_i}}: got {{_got!r:.200}}, expected {{_want!r:.200}}")
"""


def _program(problem: CodeProblem, code: str, which: str) -> str:
    if not problem.has_plus:
        return (_DRIVER_HEAD + problem.prompt + "\n" + code + "\n\n" + problem.test +
                f"\ncheck({problem.entry_point})\nprint(_ds41_nonce)\n")
    cases = list(problem.base_input) + (list(problem.plus_input) if which == "plus" else [])
    first = len(problem.base_input) if which == "plus" else 0
    driver = _PLUS_DRIVER.format(canonical=problem.prompt + problem.canonical_solution, entry=problem.entry_point,
                                 cases=json.dumps(cases), atol=problem.atol, first=first, last=len(cases))
    return _DRIVER_HEAD + problem.prompt + "\n" + code + "\n" + driver + "\nprint(_ds41_nonce)\n"


@dataclass(frozen=True)
class CodeOutcome:
    base: bool
    plus: bool | None           # None: the suite has no plus tests
    detail: str                 # why it failed (last stderr line, timeout), empty when it passed


def _passed(out: Outcome, token: str) -> bool:
    return out.status == "ok" and out.stdout.strip().splitlines()[-1:] == [token]


def _why(out: Outcome) -> str:
    if out.status == "timeout":
        return f"timeout after {out.wall_s:.1f}s"
    lines = [ln for ln in out.stderr.strip().splitlines() if ln.strip()]
    return (lines[-1] if lines else f"exit {out.returncode}, no pass token")[:300]


def score_solution(problem: CodeProblem, reply: str, limits: Limits = Limits()) -> CodeOutcome:
    code = solution_code(problem, reply)
    token = nonce()
    base = run_python(_program(problem, code, "base"), limits, stdin=token + "\n")
    base_ok = _passed(base, token)
    if not problem.has_plus:
        return CodeOutcome(base_ok, None, "" if base_ok else _why(base))
    if not base_ok or not problem.plus_input:
        return CodeOutcome(base_ok, base_ok, "" if base_ok else _why(base))
    token = nonce()
    plus = run_python(_program(problem, code, "plus"), limits, stdin=token + "\n")
    plus_ok = _passed(plus, token)
    return CodeOutcome(True, plus_ok, "" if plus_ok else "plus: " + _why(plus))
