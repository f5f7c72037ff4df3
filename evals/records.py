"""Eval results as records: per-problem outcomes plus the provenance every record carries.

One JSON file per (suite, engine) run, format ``ds41-eval/1``, written atomically. Provenance is the
record format's own :class:`core.records.Provenance`: ``panel_*`` name the suite's data (its source and
sha256), ``tokenizer_hash`` the tokenizer + chat format that built the prompts, ``source`` the engine.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from core.atomic import write_json_atomic
from core.errors import UserError
from core.records import Provenance, RecordError

FORMAT = "ds41-eval/1"
CODE_SUITES = ("humaneval", "humaneval+", "mbpp+")
SUITES = CODE_SUITES + ("ifeval",)


class EvalRecordError(UserError):
    """An eval record is unreadable, of another format, or not comparable with another."""


@dataclass(frozen=True)
class ProblemResult:
    id: str
    n_tokens: int
    finish: str | None
    base: bool | None = None            # code suites
    plus: bool | None = None            # EvalPlus suites
    strict: tuple[bool, ...] = ()       # IFEval, per instruction
    loose: tuple[bool, ...] = ()
    detail: str = ""

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["strict"], d["loose"] = list(self.strict), list(self.loose)
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "ProblemResult":
        return cls(d["id"], int(d["n_tokens"]), d.get("finish"), d.get("base"), d.get("plus"),
                   tuple(d.get("strict", ())), tuple(d.get("loose", ())), d.get("detail", ""))


@dataclass
class EvalRecord:
    suite: str
    provenance: Provenance
    problems: list[ProblemResult] = field(default_factory=list)

    def scores(self) -> dict[str, float]:
        from evals.stats import rate

        p = self.problems
        if self.suite in CODE_SUITES:
            out = {"pass@1 base": rate([r.base for r in p])}
            if self.suite != "humaneval":
                out["pass@1 plus"] = rate([r.plus for r in p])
            return out
        return {"prompt strict": rate([all(r.strict) for r in p]),
                "instruction strict": rate([x for r in p for x in r.strict]),
                "prompt loose": rate([all(r.loose) for r in p]),
                "instruction loose": rate([x for r in p for x in r.loose])}

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, "suite": self.suite, "provenance": json.loads(self.provenance.to_json()),
                "scores": self.scores(), "problems": [r.to_json() for r in self.problems]}

    def save(self, path: str | os.PathLike) -> None:
        from core.redact import redact_data

        write_json_atomic(path, redact_data(self.to_json()))   # the engine URL may carry user:password@

    @classmethod
    def load(cls, path: str | os.PathLike) -> "EvalRecord":
        p = Path(path)
        try:
            data = json.loads(p.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise EvalRecordError(f"{p}: not a readable eval record ({e})") from None
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise EvalRecordError(f"{p}: format {data.get('format') if isinstance(data, dict) else None!r}, "
                                  f"expected {FORMAT!r}")
        if data.get("suite") not in SUITES:
            raise EvalRecordError(f"{p}: unknown suite {data.get('suite')!r}")
        try:
            prov = Provenance.from_json(json.dumps(data["provenance"]), where=str(p))
            probs = [ProblemResult.from_json(d) for d in data["problems"]]
        except (KeyError, TypeError, ValueError, RecordError) as e:
            raise EvalRecordError(f"{p}: malformed eval record ({e})") from None
        return cls(data["suite"], prov, probs)
