"""Code suites: the model's reply → its code → run in the sandbox → a verdict computed here, outside it.

Untrusted code never decides its own verdict. The solution runs in a sandbox as a *function server*
(`_SERVER`): it is loaded as a module (``__name__`` is not ``"__main__"``), then answers calls of its entry
point read from stdin, one line each, with one line of plain-value JSON (evals/plain.py): the return value, the
name of the exception it raised, or "not a plain value". Its own prints go to stderr (capped, never read as an
answer); stdin is ``/dev/null`` to it. Anything but one valid answer per call — no answer, a crash, an exit
(from ``sys.excepthook``, ``atexit``, ``os._exit(0)``, anything), a timeout, output over the cap, a line that is
not plain JSON, a value that is not plain (an object whose ``__eq__`` is always True), an extra line — fails.
There is no pass token: nothing the solution can print, read or forge means "passed".

* HumanEval+, MBPP+ (EvalPlus): the harness sends every ``base_input`` (then every ``plus_input``) to the
  solution's server and compares each decoded answer with the canonical solution's output **in this process**
  (`evals.verdict.same_output`: EvalPlus's exact / ``atol`` / special-oracle semantics). The canonical outputs
  come from the canonical solution run the same way, in a sandbox of its own, once per problem (cached).
* HumanEval: the official ``check(candidate)`` runs in a second sandbox (`_TESTER`, the problem's prompt and
  test only), where ``candidate`` is a proxy: each call is relayed by the harness to the solution's server and
  the answer, checked here as plain JSON, relayed back. The solution cannot reach the tester's process, its
  output or its exit: passed means the tester said ``done`` after ``check`` returned, and exited 0.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
import time
from dataclasses import dataclass, replace
from typing import Any

from core.errors import UserError
from evals import plain
from evals.data import CodeProblem
from evals.sandbox import Limits, SandboxProcess
from evals.verdict import reduction, same_output

CODE_INSTRUCTION = ("Please provide a self-contained Python script that solves the following problem in a "
                    "markdown code block:\n```python\n{prompt}\n```")

_BLOCK = re.compile(r"```[ \t]*(?:python|py|Python)?[ \t]*\n(.*?)(?:```|\Z)", re.S)


class EvalCheckError(UserError):
    """A problem cannot be judged: its canonical solution fails or gives a value that is not plain (bad data)."""


def solution_code(problem: CodeProblem, reply: str) -> str:
    """The code of a reply: the first fenced block that defines the entry point, else the first fenced
    block, else the whole reply. A body without the ``def`` continues the prompt (completion style)."""
    blocks = _BLOCK.findall(reply)
    defining = [b for b in blocks if re.search(rf"^\s*def\s+{re.escape(problem.entry_point)}\s*\(", b, re.M)]
    code = defining[0] if defining else (blocks[0] if blocks else reply)
    if not re.search(rf"^\s*def\s+{re.escape(problem.entry_point)}\s*\(", code, re.M):
        return problem.prompt + code
    return code


# ---------------------------------------------------------------------------------------------- sandbox drivers
# Both drivers first move the channel to the harness off fds 0/1 (prints go to stderr, stdin reads /dev/null),
# then load evals/plain.py from its copy beside them.
_CHANNEL = '''\
import os, sys, json
_to_harness = os.fdopen(os.dup(1), "wb", buffering=0)
_from_harness = os.fdopen(os.dup(0), "rb")
os.dup2(2, 1)
_null = os.open(os.devnull, os.O_RDONLY)
os.dup2(_null, 0)
os.close(_null)
_plain = {"__name__": "ds41_plain"}
exec(compile(open("ds41_plain.py", encoding="utf-8").read(), "ds41_plain.py", "exec"), _plain)
_spec = json.loads(open("spec.json", encoding="utf-8").read())


def _send(doc):
    _to_harness.write(_plain["dumps"](doc).encode("ascii") + b"\\n")


def _short(exc):
    try:
        return str(exc)[:300]
    except BaseException:
        return "?"
'''

_SERVER = _CHANNEL + '''
_ns = {"__name__": "solution", "__builtins__": __builtins__}
try:
    exec(compile(open("solution.py", encoding="utf-8").read(), "solution.py", "exec"), _ns)
    _fn = _ns[_spec["entry_point"]]
except KeyError:
    sys.stderr.write("NameError: the solution defines no %r\\n" % _spec["entry_point"])
    os._exit(3)
except BaseException:
    import traceback
    traceback.print_exc()
    sys.stderr.flush()
    os._exit(3)
for _line in _from_harness:
    _call = _plain["loads"](_line)
    try:
        _out = _fn(*_plain["decode"](_call["args"]), **_plain["decode"](_call["kwargs"]))
        if _spec.get("reduce") == "is_not_none" or (_spec.get("reduce") == "bool_or_not_none"
                                                    and type(_out) is not bool):
            _out = _out is not None
        try:
            _doc = {"ok": _plain["encode"](_out)}
            _plain["dumps"](_doc)
        except BaseException as _e:
            _doc = {"not_plain": _short(_e)}
    except BaseException as _e:
        _doc = {"raised": type(_e).__name__[:100], "message": _short(_e)}
    _send(_doc)
'''

_TESTER = _CHANNEL + '''
import builtins


def _candidate(*args, **kwargs):
    _send({"call": {"args": _plain["encode"](list(args)), "kwargs": _plain["encode"](dict(kwargs))}})
    line = _from_harness.readline()
    if not line:
        os._exit(5)
    msg = _plain["loads"](line)
    if "ok" in msg:
        return _plain["decode"](msg["ok"])
    if "raised" in msg:
        exc = getattr(builtins, msg["raised"], None)
        if isinstance(exc, type) and issubclass(exc, Exception):
            try:
                err = exc(msg["message"])
            except BaseException:
                err = RuntimeError(msg["raised"] + ": " + msg["message"])
            raise err
        raise RuntimeError(msg["raised"] + ": " + msg["message"])
    raise TypeError("the solution returned a value that is not plain: " + msg["not_plain"])


_candidate.__name__ = _spec["entry_point"]
_ns = {"__name__": "__main__", "__builtins__": __builtins__}
exec(compile(open("prompt.py", encoding="utf-8").read(), "prompt.py", "exec"), _ns)
_ns[_spec["entry_point"]] = _candidate
exec(compile(open("test.py", encoding="utf-8").read(), "test.py", "exec"), _ns)
_ns["check"](_candidate)
_send({"done": True})
'''


@dataclass(frozen=True)
class CodeOutcome:
    base: bool
    plus: bool | None           # None: the suite has no plus tests
    detail: str                 # why it failed, empty when it passed


@dataclass(frozen=True)
class _Answer:
    kind: str                   # ok | raised | not_plain
    value: Any = None           # the decoded return value (ok)
    text: str = ""              # the exception (raised) or the reason (not_plain)


def _answer(line: bytes) -> _Answer:
    """One answer line of a solution's server, checked strictly; `plain.NotPlain` when it is anything else."""
    msg = plain.loads(line)
    if type(msg) is not dict or len(msg) not in (1, 2):
        raise plain.NotPlain("an answer must be one JSON object")
    if set(msg) == {"ok"}:
        return _Answer("ok", plain.decode(msg["ok"]))
    if set(msg) == {"raised", "message"} and type(msg["raised"]) is str and type(msg["message"]) is str:
        return _Answer("raised", text=f"{msg['raised'][:100]}: {msg['message'][:200]}".rstrip(": "))
    if set(msg) == {"not_plain"} and type(msg["not_plain"]) is str:
        return _Answer("not_plain", text=msg["not_plain"][:200])
    raise plain.NotPlain(f"unknown answer fields {sorted(msg)[:4]}")


def _relay(a: _Answer) -> bytes:
    """The checked answer, re-encoded by the harness, as the tester's proxy reads it."""
    if a.kind == "ok":
        doc = {"ok": plain.encode(a.value)}
    elif a.kind == "raised":
        name, _, message = a.text.partition(": ")
        doc = {"raised": name, "message": message}
    else:
        doc = {"not_plain": a.text}
    return plain.dumps(doc).encode("ascii") + b"\n"


def _server_files(problem: CodeProblem, source: str, reduce: str | None) -> dict[str, str]:
    return {"ds41_plain.py": plain.SOURCE, "solution.py": source,
            "spec.json": json.dumps({"entry_point": problem.entry_point, "reduce": reduce})}


def _call_line(args: list) -> bytes:
    return plain.dumps({"args": plain.encode(list(args)), "kwargs": plain.encode({})}).encode("ascii") + b"\n"


def _no_extra_output(server: SandboxProcess) -> str:
    """After the last call: stdin closed, the server must end without another line on its answer channel."""
    server.close_stdin()
    extra = server.read_line(deadline=time.monotonic() + 2.0)
    return "" if extra is None else "the solution wrote a line of its own on the answer channel"


def _serve(problem: CodeProblem, source: str, inputs: list, limits: Limits, reduce: str | None,
           judge=None) -> tuple[list[_Answer], str]:
    """Call the entry point of ``source`` (in a sandbox) on every input, in order → (answers, why it stopped
    early or ""). ``judge(i, answer)`` returning a reason stops at the first wrong answer."""
    answers: list[_Answer] = []
    with SandboxProcess(_SERVER, limits, _server_files(problem, source, reduce)) as server:
        for i, args in enumerate(inputs):
            if not server.send(_call_line(args)):
                server.check_bwrap()
                return answers, f"input {i}: {server.why()}"
            line = server.read_line()
            if line is None:
                server.check_bwrap()
                return answers, f"input {i}: {server.why()}"
            try:
                a = _answer(line)
            except plain.NotPlain as e:
                return answers, f"input {i}: the answer is not plain JSON ({e})"
            answers.append(a)
            why = judge(i, a) if judge else ""
            if why:
                return answers, why
        return answers, _no_extra_output(server)


# ---------------------------------------------------------------------------------------------- EvalPlus
_expected: dict[str, list] = {}
_expected_lock = threading.Lock()


def expected_outputs(problem: CodeProblem, limits: Limits = Limits()) -> list:
    """The canonical solution's outputs on base + plus inputs, computed in a sandbox of their own (once per
    problem and process). A canonical solution that fails is the data's fault: `EvalCheckError`."""
    key = hashlib.sha256(json.dumps([problem.task_id, problem.prompt, problem.canonical_solution,
                                     problem.base_input, problem.plus_input], sort_keys=True).encode()).hexdigest()
    with _expected_lock:
        if key in _expected:
            return _expected[key]
    inputs = list(problem.base_input) + list(problem.plus_input)
    roomy = replace(limits, wall_s=max(limits.wall_s, 60.0), cpu_s=max(limits.cpu_s, 50))
    answers, why = _serve(problem, problem.prompt + problem.canonical_solution, inputs, roomy,
                          reduction(problem.task_id, problem.entry_point, canonical=True))
    bad = next((i for i, a in enumerate(answers) if a.kind != "ok"), None)
    if why or bad is not None or len(answers) != len(inputs):
        reason = why or f"input {bad}: {answers[bad].kind} {answers[bad].text}"
        raise EvalCheckError(f"{problem.task_id}: the canonical solution cannot be judged against ({reason})")
    values = [a.value for a in answers]
    with _expected_lock:
        _expected[key] = values
    return values


def _judge_plus(problem: CodeProblem, code: str, inputs: list, expected: list, limits: Limits) -> str:
    """"" when the solution's output on every input passes against the expected one, else why not."""
    def judge(i: int, a: _Answer) -> str:
        if a.kind == "raised":
            return f"input {i}: raised {a.text}"
        if a.kind == "not_plain":
            return f"input {i}: returned a value that is not plain ({a.text})"
        if not same_output(problem.task_id, problem.entry_point, inputs[i], a.value, expected[i], problem.atol):
            return f"input {i}: got {_short(a.value)}, expected {_short(expected[i])}"
        return ""

    answers, why = _serve(problem, problem.prompt + "\n" + code, inputs, limits,
                          reduction(problem.task_id, problem.entry_point, canonical=False), judge)
    if why:
        return why
    return "" if len(answers) == len(inputs) else f"{len(answers)} answers for {len(inputs)} inputs"


def _short(v: Any) -> str:
    if type(v) is int and v.bit_length() > plain.BIG_INT_BITS:
        return f"<an int of {v.bit_length()} bits>"
    try:
        text = repr(v)          # builtin values only: runs none of the solution's code
    except ValueError:          # an int past the decimal-conversion limit inside a container
        return f"<a {type(v).__name__} holding a very large int>"
    return text if len(text) <= 120 else text[:117] + "..."


# ---------------------------------------------------------------------------------------------- HumanEval
def _judge_humaneval(problem: CodeProblem, code: str, limits: Limits) -> str:
    tester_files = {"ds41_plain.py": plain.SOURCE, "prompt.py": problem.prompt, "test.py": problem.test,
                    "spec.json": json.dumps({"entry_point": problem.entry_point})}
    with SandboxProcess(_TESTER, limits, tester_files) as tester, \
            SandboxProcess(_SERVER, limits, _server_files(problem, problem.prompt + "\n" + code, None)) as server:
        calls = 0
        while True:
            line = tester.read_line()
            if line is None:
                tester.check_bwrap()
                return tester.why()           # check() raised (an assertion), or a timeout
            try:
                msg = plain.loads(line)
            except plain.NotPlain as e:
                return f"test driver: {e}"
            if msg == {"done": True}:
                rc = tester.wait()
                if rc != 0:
                    return f"test driver exited {rc} after check()"
                return _no_extra_output(server)
            if type(msg) is not dict or set(msg) != {"call"}:
                return "test driver: unknown message"
            calls += 1
            call = msg["call"]
            req = plain.dumps({"args": call["args"], "kwargs": call["kwargs"]}).encode("ascii") + b"\n"
            if not server.send(req):
                server.check_bwrap()
                return f"call {calls}: {server.why()}"
            ans = server.read_line()
            if ans is None:
                server.check_bwrap()
                return f"call {calls}: {server.why()}"
            try:
                reply = _relay(_answer(ans))
            except plain.NotPlain as e:
                return f"call {calls}: the answer is not plain JSON ({e})"
            if not tester.send(reply):
                return f"call {calls}: test driver: {tester.why()}"


# ---------------------------------------------------------------------------------------------- scoring
def score_solution(problem: CodeProblem, reply: str, limits: Limits = Limits()) -> CodeOutcome:
    code = solution_code(problem, reply)
    if not problem.has_plus:
        why = _judge_humaneval(problem, code, limits)
        return CodeOutcome(not why, None, why)
    expected = expected_outputs(problem, limits)
    nb = len(problem.base_input)
    why = _judge_plus(problem, code, list(problem.base_input), expected[:nb], limits)
    if why or not problem.plus_input:
        return CodeOutcome(not why, not why, why)
    why = _judge_plus(problem, code, list(problem.plus_input), expected[nb:], limits)
    return CodeOutcome(True, not why, "plus: " + why if why else "")
