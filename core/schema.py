"""Config schemas as models: the base every TOML file's schema derives from, and the one way a file becomes one.

Each TOML file the project reads (profiles, bands, gate sizes, the kernel and flag registries, nightly configs) is a
pydantic model deriving from `StrictModel` (or a pydantic dataclass configured with `STRICT`, where code relies on
`dataclasses.replace`): an unknown key is refused (a typo is never silently ignored), the result is frozen, and
scalars are strict (TOML has real types: `"1"` is not `1`, `1` is not `true`). A TOML array is kept as a tuple
(`Seq[str]`), so a parsed config can be hashed and shared.

`read_model` reads the file through core/tomlfile.read_toml (the one TOML reader) and `parse_model` validates a
table already parsed; both turn pydantic's `ValidationError` into ONE line of the caller's `UserError` subclass,
naming the file and the dotted key path of the first problem::

    engine/profiles/x.toml: gate.oracle: unknown oracle 'foo' (known: deepseek, transformers)

A validator that raises `ValueError("...")` gives the text after the key path as is, so cross-field rules stay in
the model (`model_validator`) and still read as the house's one-line errors. A schema whose files have established
messages words its own problems (`explain`, a classmethod: the text after the file's name).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, TypeVar

import pydantic
from pydantic import BaseModel, ConfigDict, Field

from core.errors import UserError
from core.tomlfile import read_toml

M = TypeVar("M")
T = TypeVar("T")

# the config of a schema written as a pydantic dataclass (``@pydantic.dataclasses.dataclass(frozen=True,
# config=STRICT)``): unknown keys refused; its scalars say strict themselves (pydantic's StrictStr, StrictInt, ...),
# since a strict dataclass would refuse the very table it is read from
STRICT = ConfigDict(extra="forbid")

# a TOML array: any array in, a tuple out (strict mode would refuse the list tomllib gives)
Seq = Annotated[tuple[T, ...], Field(strict=False)]


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a table, as a schema's own wording sees it: where (``loc``, the key path), pydantic's
    error ``kind``, the ``value`` found there, the house's default ``text`` for it, and for unknown keys (kind
    ``extra_forbidden``, ``loc`` then the table holding them) every ``unknown`` key of that table and the ``known``
    ones."""

    loc: tuple[int | str, ...]
    kind: str
    value: Any
    text: str
    unknown: tuple[str, ...] = ()
    known: tuple[str, ...] = ()


class StrictModel(BaseModel):
    """The base of every config schema: unknown keys refused, frozen, strict scalars."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    @classmethod
    def explain(cls, problem: Problem, data: Any) -> str | None:
        """The schema's own one-line wording of ``problem`` in the table ``data`` (without the file's name), where
        a file's established messages differ from the house default; None: the default (``key: text``)."""
        return None


# pydantic's wording for the plain shape errors, in the house's words (what the key must be)
_SHAPES = {
    "missing": "is required",
    "string_type": "must be a string",
    "int_type": "must be an integer",
    "int_from_float": "must be an integer",
    "float_type": "must be a number",
    "bool_type": "must be true or false",
    "dict_type": "must be a table",
    "model_type": "must be a table",
    "model_attributes_type": "must be a table",
    "dataclass_type": "must be a table",
    "list_type": "must be an array",
    "tuple_type": "must be an array",
    "string_too_short": "must not be empty",
    "too_short": "must not be empty",
}
# prefixes pydantic puts before the text of a validator's own exception
_RAISED_PREFIXES = ("Value error, ", "Assertion failed, ")


def key_path(loc: Sequence[int | str]) -> str:
    """A pydantic location as the dotted key a person finds in the file: ``gate.oracle``, ``args[2]``."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def _fields(cls: Any) -> Mapping[str, Any] | None:
    """The declared fields of a schema class (a BaseModel or a pydantic dataclass); None for anything else."""
    if isinstance(cls, type) and issubclass(cls, BaseModel):
        return cls.model_fields
    if isinstance(cls, type) and dataclasses.is_dataclass(cls):
        return getattr(cls, "__pydantic_fields__", None)
    return None


def _model_at(model: Any, loc: Sequence[int | str]) -> Any:
    """The model class whose table sits at ``loc`` inside ``model``, through nested models, tables of models
    (``dict[str, M]``) and arrays of them (None where the path leaves models)."""
    current: Any = model
    for part in loc:
        while typing.get_origin(current) is Annotated:
            current = typing.get_args(current)[0]
        origin, args = typing.get_origin(current), typing.get_args(current)
        fields = _fields(current)
        if fields is not None and isinstance(part, str):
            info = fields.get(part)
            current = info.annotation if info is not None else None
        elif origin in (dict, Mapping) and len(args) == 2:
            current = args[1]
        elif origin in (tuple, list) and args and isinstance(part, int):
            current = args[0]
        else:
            return None
    while typing.get_origin(current) is Annotated:
        current = typing.get_args(current)[0]
    return current if _fields(current) is not None else None


def value_at(data: Any, loc: Sequence[int | str]) -> Any:
    """The value at a key path in a parsed table (None where the path does not lead)."""
    for part in loc:
        try:
            data = data[part]
        except (KeyError, IndexError, TypeError):
            return None
    return data


def _default_text(kind: str, msg: str, value: Any) -> str:
    if kind in _SHAPES:
        return _SHAPES[kind] + ("" if kind == "missing" else f", got {value!r:.60}")
    for prefix in _RAISED_PREFIXES:
        if msg.startswith(prefix):
            return msg[len(prefix):]
    return msg


def problems_of(model: Any, exc: pydantic.ValidationError) -> list[Problem]:
    """A ValidationError's problems, the unknown keys of one table gathered into one problem and put first: a
    misspelled key is both unknown and (as the key meant) missing, and the unknown one says what to fix."""
    out: list[Problem] = []
    unknown_at: dict[tuple[int | str, ...], list[str]] = {}
    for detail in exc.errors(include_url=False):
        loc = tuple(detail.get("loc", ()))
        kind = str(detail.get("type", ""))
        if kind == "unexpected_keyword_argument":   # a dataclass's word for an unknown key
            kind = "extra_forbidden"
        if kind == "extra_forbidden":
            table = loc[:-1]
            if table not in unknown_at:
                unknown_at[table] = []
                out.append(Problem(table, kind, None, ""))
            unknown_at[table].append(str(loc[-1]))
            continue
        value = detail.get("input")
        out.append(Problem(loc, kind, value, _default_text(kind, str(detail.get("msg", "")), value)))
    done = []
    for problem in out:
        if problem.kind == "extra_forbidden":
            owner = _model_at(model, problem.loc)
            known = tuple(sorted(_fields(owner) or ()))
            keys = unknown_at[problem.loc]
            text = f"unknown key(s) {keys}" + (f"; known: {list(known)}" if known else "")
            problem = Problem(problem.loc, problem.kind, None, text, tuple(keys), known)
        done.append(problem)
    return sorted(done, key=lambda problem: problem.kind != "extra_forbidden")


def describe(model: Any, problem: Problem, data: Any) -> str:
    """One problem as the line after the file's name: the schema's own wording (``explain``), else
    ``: key: text``. The schema's text is joined with ``: `` unless it starts with a space (`` [gate]: ...``)."""
    explain = getattr(model, "explain", None)
    own = explain(problem, data) if explain is not None else None
    if own is None:
        path = key_path(problem.loc)
        own = f"{path}: {problem.text}" if path else problem.text
    own = own.split("\n")[0]
    return own if own.startswith(" ") else f": {own}"


@functools.cache
def _adapter(model: Any) -> pydantic.TypeAdapter:
    return pydantic.TypeAdapter(model)


def parse_model(model: type[M], data: Any, where: str, error: type[UserError]) -> M:
    """Validate ``data`` (a parsed TOML table) as ``model``; a bad table raises ``error`` as one line,
    ``<where>: <key path>: <what is wrong>`` (the first problem; how many more follow, if any)."""
    try:
        return _adapter(model).validate_python(data)
    except pydantic.ValidationError as exc:
        problems = problems_of(model, exc)
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise error(f"{where}{describe(model, problems[0], data)}{more}") from None


def read_model(model: type[M], path: str | os.PathLike, what: str, error: type[UserError]) -> M:
    """Read the TOML file ``path`` (``what`` it is meant to be, for the message) into ``model``."""
    return parse_model(model, read_toml(path, what, error), str(path), error)
