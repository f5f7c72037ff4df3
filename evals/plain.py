"""Plain values as JSON, strict both ways: the only thing that crosses out of a sandbox running generated code.

A *plain value* is built only from the exact builtin types ``None, bool, int, float, str`` and the containers
``list, tuple, set, frozenset, dict`` of plain values (subclasses are not plain: an ``int`` subclass whose
``__eq__`` is always True is refused, not trusted). On the wire:

* ``None``, ``bool``, ``int``, ``str``, finite ``float`` and ``list``: JSON's own (a float keeps its ``.0`` /
  exponent, so ``1`` and ``1.0`` stay an int and a float);
* every other value is a JSON object with exactly one key naming its type: ``{"tuple": [...]}``,
  ``{"set": [...]}``, ``{"frozenset": [...]}``, ``{"dict": [[key, value], ...]}``, ``{"float": "nan" | "inf" |
  "-inf"}``, and ``{"int": "0x..."}`` for an int of more than `BIG_INT_BITS` bits (hexadecimal converts in linear
  time and is not subject to Python's 4300-digit limit on decimal conversion, which a big factorial passes).

Decoding refuses anything else: JSON's ``NaN`` / ``Infinity`` constants, duplicate keys, an object that is not
one of the tags, an unhashable set element or dict key, nesting deeper than `MAX_DEPTH`, a line that is not
UTF-8. It rebuilds values from builtin types only, so comparing decoded values (``==`` in the harness) runs
no code of the program that produced them.

The module is standard library only and is copied as text into every sandbox (`SOURCE`), so the drivers there
and the harness here speak exactly one format.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

MAX_DEPTH = 100
BIG_INT_BITS = 10_000           # about 3,000 decimal digits; larger ints cross as hexadecimal
_TAGS = ("tuple", "set", "frozenset", "dict", "float", "int")
_HEX = re.compile(r"-?0x[0-9a-f]+")


class NotPlain(ValueError):
    """A value (or a line) that is not a plain value in the format above."""


def encode(value, depth=0):
    """A plain value → its JSON-ready form; anything else raises `NotPlain` naming the type."""
    t = type(value)
    if t is int and value.bit_length() > BIG_INT_BITS:
        return {"int": hex(value)}
    if value is None or t is bool or t is int or t is str:
        return value
    if t is float:
        if math.isfinite(value):
            return value
        return {"float": "nan" if value != value else ("inf" if value > 0 else "-inf")}
    if depth >= MAX_DEPTH:
        raise NotPlain(f"nested deeper than {MAX_DEPTH} levels")
    if t is list:
        return [encode(v, depth + 1) for v in value]
    if t is tuple:
        return {"tuple": [encode(v, depth + 1) for v in value]}
    if t is set or t is frozenset:
        return {t.__name__: [encode(v, depth + 1) for v in value]}
    if t is dict:
        return {"dict": [[encode(k, depth + 1), encode(v, depth + 1)] for k, v in value.items()]}
    raise NotPlain(f"a {t.__module__}.{t.__qualname__} is not a plain value")


def decode(obj, depth=0):
    """The JSON-ready form → the plain value (builtin types only); anything else raises `NotPlain`."""
    t = type(obj)
    if obj is None or t is bool or t is int or t is str:
        return obj
    if t is float:
        if not math.isfinite(obj):
            raise NotPlain("a non-finite float outside its tag")
        return obj
    if depth >= MAX_DEPTH:
        raise NotPlain(f"nested deeper than {MAX_DEPTH} levels")
    if t is list:
        return [decode(v, depth + 1) for v in obj]
    if t is not dict or len(obj) != 1:
        raise NotPlain(f"not a plain value: {type(obj).__name__} {str(obj)[:60]}")
    (tag, payload), = obj.items()
    if tag == "int":
        if type(payload) is not str or not _HEX.fullmatch(payload):
            raise NotPlain("int tag without a hexadecimal string")
        return int(payload, 16)
    if tag == "float":
        if payload not in ("nan", "inf", "-inf"):
            raise NotPlain(f"float tag with {str(payload)[:20]!r}")
        return float(payload)
    if tag not in _TAGS or type(payload) is not list:
        raise NotPlain(f"unknown tag {str(tag)[:40]!r} or its payload is not a list")
    try:
        if tag == "tuple":
            return tuple(decode(v, depth + 1) for v in payload)
        if tag == "set":
            return {decode(v, depth + 1) for v in payload}
        if tag == "frozenset":
            return frozenset(decode(v, depth + 1) for v in payload)
        pairs = []
        for pair in payload:
            if type(pair) is not list or len(pair) != 2:
                raise NotPlain("a dict entry must be a [key, value] pair")
            pairs.append((decode(pair[0], depth + 1), decode(pair[1], depth + 1)))
        return dict(pairs)
    except TypeError as e:      # an unhashable set element or dict key
        raise NotPlain(f"{tag}: {e}") from None


def _no_constant(name):
    raise NotPlain(f"JSON constant {name} is not allowed")


def _no_duplicates(pairs):
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        raise NotPlain("duplicate key in a JSON object")
    return dict(pairs)


def loads(line):
    """One line (bytes or str) → its JSON document, strictly (no NaN, no duplicate keys, UTF-8 only). The
    document is an envelope (a dict of message fields); its values are decoded with `decode`."""
    try:
        if isinstance(line, bytes):
            line = line.decode("utf-8")
        return json.loads(line, parse_constant=_no_constant, object_pairs_hook=_no_duplicates)
    except NotPlain:
        raise
    except (ValueError, RecursionError) as e:   # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise NotPlain(f"not one JSON document: {str(e)[:120]}") from None


def dumps(doc):
    """An envelope → one line of ASCII JSON (no newline inside, so one line is one message)."""
    try:
        return json.dumps(doc, allow_nan=False, ensure_ascii=True, separators=(",", ":"))
    except (ValueError, RecursionError) as e:   # e.g. an int too long to print (sys.get_int_max_str_digits)
        raise NotPlain(str(e)[:120]) from None


try:
    SOURCE = Path(__file__).read_text(encoding="utf-8")
except NameError:       # exec'd from its own text inside a sandbox: no __file__, and no need for SOURCE
    SOURCE = ""
