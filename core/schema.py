"""Config schemas as models: the base every TOML file's schema derives from, and the one way a file becomes one.

Each TOML file the project reads (profiles, bands, gate sizes, the kernel and flag registries, nightly configs) is a
pydantic model deriving from `StrictModel`: an unknown key is refused (a typo is never silently ignored), the result
is frozen, and scalars are strict (TOML has real types: `"1"` is not `1`, `1` is not `true`). A TOML array is kept
as a tuple (`Seq[str]`), so a parsed config can be hashed and shared.

`read_model` reads the file through core/tomlfile.read_toml (the one TOML reader) and `parse_model` validates a
table already parsed; both turn pydantic's `ValidationError` into ONE line of the caller's `UserError` subclass,
naming the file and the dotted key path of the first problem::

    engine/profiles/x.toml: gate.oracle: unknown oracle 'foo' (known: deepseek, transformers)

A validator that raises `ValueError("...")` gives the text after the key path as is, so cross-field rules stay in
the model (`model_validator`) and still read as the house's one-line errors.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Annotated, Any, TypeVar

import pydantic
from pydantic import BaseModel, ConfigDict, Field

from core.errors import UserError
from core.tomlfile import read_toml

M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")

# a TOML array: any array in, a tuple out (strict mode would refuse the list tomllib gives)
Seq = Annotated[tuple[T, ...], Field(strict=False)]


class StrictModel(BaseModel):
    """The base of every config schema: unknown keys refused, frozen, strict scalars."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


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


def _model_at(model: type[BaseModel], loc: Sequence[int | str]) -> type[BaseModel] | None:
    """The model class whose table sits at ``loc`` inside ``model`` (None where the path leaves models)."""
    current: Any = model
    for part in loc:
        if not (isinstance(current, type) and issubclass(current, BaseModel)) or not isinstance(part, str):
            return None
        info = current.model_fields.get(part)
        if info is None:
            return None
        current = info.annotation
    return current if isinstance(current, type) and issubclass(current, BaseModel) else None


def describe_error(model: type[BaseModel], detail: Any) -> str:
    """One pydantic error (an item of ``ValidationError.errors()``) as ``key: what is wrong``."""
    loc = tuple(detail.get("loc", ()))
    kind = detail.get("type", "")
    msg = str(detail.get("msg", ""))
    if kind == "extra_forbidden":
        owner = _model_at(model, loc[:-1])
        known = f" (known: {', '.join(sorted(owner.model_fields))})" if owner is not None else ""
        text = f"unknown key{known}"
    elif kind in _SHAPES:
        text = _SHAPES[kind]
        if kind != "missing":
            text += f", got {detail.get('input')!r:.60}"
    else:
        for prefix in _RAISED_PREFIXES:
            if msg.startswith(prefix):
                msg = msg[len(prefix):]
                break
        text = msg
    path = key_path(loc)
    return f"{path}: {text}" if path else text


def parse_model(model: type[M], data: Any, where: str, error: type[UserError]) -> M:
    """Validate ``data`` (a parsed TOML table) as ``model``; a bad table raises ``error`` as one line,
    ``<where>: <key path>: <what is wrong>`` (the first problem; how many more follow, if any)."""
    try:
        return model.model_validate(data)
    except pydantic.ValidationError as exc:
        problems = exc.errors(include_url=False)
        first = describe_error(model, problems[0]).split("\n")[0]
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise error(f"{where}: {first}{more}") from None


def read_model(model: type[M], path: str | os.PathLike, what: str, error: type[UserError]) -> M:
    """Read the TOML file ``path`` (``what`` it is meant to be, for the message) into ``model``."""
    return parse_model(model, read_toml(path, what, error), str(path), error)
