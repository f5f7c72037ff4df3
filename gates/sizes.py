"""The gate sizes (gates.md §4–§9) as a typed model: gates/config.toml, and a sizes file laid over it.

gates/config.toml holds every key (the CI sizes on the 2-core vLLM CPU rig); a sizes file over it
(gates/config-production.toml, a profile's own gates/config-<profile>.toml, DS41_GATES_CONFIG) gives only the keys
it changes, table by table, and each must be of the kind the schema declares (a count an integer >= 0, a tolerance a
finite number >= 0, ...). Gates read attributes (``gate_config.needles.lengths``), never string paths into a dict,
so a renamed size is an AttributeError in a test rather than a KeyError halfway through a gate run.
"""

from __future__ import annotations

import os
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any

from pydantic import Field

from core.errors import UserError
from core.schema import Problem, Seq, StrictModel, parse_model, value_at
from core.tomlfile import read_toml

CONFIG = Path(__file__).resolve().parent / "config.toml"

Count = Annotated[int, Field(ge=0)]
Amount = Annotated[float, Field(ge=0, allow_inf_nan=False)]   # a tolerance, a factor, a ratio
Floors = Annotated[tuple[Amount, Amount], Field(strict=False)]  # [mean, worst]


class GateSizesError(UserError):
    """A gate sizes file is missing, malformed, names an unknown table or key, or gives a value of the wrong kind."""


class SelfConsistencySizes(StrictModel):
    prompts_per_domain: Count
    domains: Seq[str]
    max_tokens: Count
    k: Count
    spread_factor: Amount
    floor_mean: Amount
    floor_worst: Amount
    floors: dict[str, Floors]   # per profile (or profile+flag) [mean, worst], replacing the two above
    top1_decided_min: Amount
    min_positions: Count


class BatchSizes(StrictModel):
    subjects: Seq[str]
    max_tokens: Count
    k: Count
    copies: Seq[Count]
    companion_lengths: Seq[Count]
    mid_decode_after: Count
    mid_decode_companion_tokens: Count


class PrefixSizes(StrictModel):
    max_tokens: Count
    k: Count
    boundaries: Seq[Count]
    extra_lengths: Seq[Count]
    kinds: Seq[str]
    passes: Count
    eviction_pass: bool
    kl_tol_floor: Amount
    spread_factor: Amount
    fail_window: Count


class NeedleSizes(StrictModel):
    lengths: Seq[Count]
    depths: Seq[Amount]
    answer_prefix: str
    report_only_lengths: Seq[Count]
    max_tokens: Count
    seed: Count
    burst_copies: Count
    gate_found: bool


class SpecDecSizes(StrictModel):
    speculative_config: str
    num_speculative_tokens: Count
    domains: Seq[str]
    prompts_per_domain: Count
    max_tokens: Count
    k: Count
    strict: bool


class BenchSizes(StrictModel):
    decode_classes: Seq[str]
    prompts_per_class: Count
    max_tokens: Count
    reps: Count
    warmup_tokens: Count
    prefill_lengths: Seq[Count]
    prefill_reps: Count
    streams: Seq[Count]
    stream_max_tokens: Count
    regression_ratio: Amount


class LongContextSizes(StrictModel):
    ci_lengths: Seq[Count]
    long_lengths: Seq[Count]
    kl_lengths: Seq[Count]
    long_kl_lengths: Seq[Count]
    kl_domains: Seq[str]
    max_tokens: Count
    k: Count


class EvalSizes(StrictModel):
    suites: Seq[str]
    humaneval_limit: Count
    ifeval_limit: Count
    max_tokens: Count
    concurrency: Count
    alpha: Amount


def _must_be(annotation: Any) -> str:
    """What a value of this declared type must be, in the words of the gate sizes' messages."""
    if typing.get_origin(annotation) is Annotated:
        annotation = typing.get_args(annotation)[0]
    if annotation is bool:
        return "true or false"
    if annotation is int:
        return "an integer >= 0"
    if annotation is float:
        return "a finite number >= 0"
    if annotation is str:
        return "a string"
    if typing.get_origin(annotation) is tuple:
        item = typing.get_args(annotation)[0]
        return "a list of strings" if item is str else "a list of numbers >= 0"
    return "a table of [mean, worst] pairs of numbers >= 0"   # the one table of tables: floors


class GateSizes(StrictModel):
    """Every gate's sizes: one table per gate, every key given (the merged gates/config.toml and its override)."""

    selfconsistency: SelfConsistencySizes
    batch: BatchSizes
    prefix: PrefixSizes
    needles: NeedleSizes
    specdec: SpecDecSizes
    bench: BenchSizes
    long_context: LongContextSizes
    evals: EvalSizes

    @classmethod
    def explain(cls, problem: Problem, data: Any) -> str | None:
        # the sizes files' own wording: `[table] key = value: must be <kind>`, a whole array shown as written
        if problem.kind == "extra_forbidden":
            if len(problem.loc) == 0:
                return f"unknown gate table [{problem.unknown[0]}]; known: {sorted(cls.model_fields)}"
            return f"[{problem.loc[0]}]: unknown keys {list(problem.unknown)}; allowed: {list(problem.known)}"
        table = problem.loc[0] if problem.loc else None
        if table not in cls.model_fields:
            return None
        if len(problem.loc) == 1:
            return f"[{table}] must be a table, got {problem.value!r:.60}"
        key = problem.loc[1]
        field = cls.model_fields[table].annotation.model_fields.get(key)   # type: ignore[union-attr]
        if field is None or (problem.kind == "missing" and len(problem.loc) == 2):
            return None   # a key the base file lacks: the default wording names it
        return f"[{table}] {key} = {value_at(data, problem.loc[:2])!r:.60}: must be {_must_be(field.annotation)}"

    def for_json(self, table: str) -> dict[str, Any]:
        """One table as the plain JSON a gate's evidence records (lists, not tuples)."""
        return getattr(self, table).model_dump(mode="json")


def _laid_over(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """``over``'s tables replace ``base``'s keys one by one (a table that is not a table replaces it whole, and
    the schema then says so)."""
    merged = {name: dict(table) if isinstance(table, dict) else table for name, table in base.items()}
    for name, table in over.items():
        if isinstance(table, dict) and isinstance(merged.get(name), dict):
            merged[name] = {**merged[name], **table}
        else:
            merged[name] = table
    return merged


def load_gate_sizes(override: str | os.PathLike | None = None, base: Path = CONFIG) -> GateSizes:
    """gates/config.toml with ``override`` (a sizes file) laid over it; a bad file is a GateSizesError naming it."""
    ci = read_toml(base, "gate sizes file", GateSizesError)
    sizes = parse_model(GateSizes, ci, str(base), GateSizesError)
    if not override:
        return sizes
    extra = read_toml(override, "gate sizes file", GateSizesError)
    return parse_model(GateSizes, _laid_over(ci, extra), str(override), GateSizesError)
