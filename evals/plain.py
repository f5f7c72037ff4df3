"""Plain values as JSON, strict both ways: the only thing that crosses out of a sandbox running generated code.

A *plain value* is built from ``None, bool, int, float, complex, str, bytes`` and the containers ``list, tuple,
set, frozenset, dict`` of plain values. A subclass of one of these crosses as the builtin value it holds, read
with the base type's own methods (``int.__add__(v, 0)``, ``list.__iter__``, ``dict.items`` …), so none of its
own methods run and nothing of it survives the trip: an ``int`` subclass whose ``__eq__`` is always True crosses
as the plain int it wraps, a ``Counter`` as a dict, a namedtuple as a tuple. Any other type is not plain. On the
wire:

* ``None``, ``bool``, ``int``, ``str``, finite ``float`` and ``list``: JSON's own (a float keeps its ``.0`` /
  exponent, so ``1`` and ``1.0`` stay an int and a float);
* every other value is a JSON object with exactly one key naming its type: ``{"tuple": [...]}``,
  ``{"set": [...]}``, ``{"frozenset": [...]}``, ``{"dict": [[key, value], ...]}``, ``{"float": "nan" | "inf" |
  "-inf"}``, ``{"complex": [re, im]}``, ``{"bytes": "<hex>"}`` (a bytearray crosses as bytes), and
  ``{"int": "0x..."}`` for an int of more than `BIG_INT_BITS` bits (hexadecimal converts in linear time and is
  not subject to Python's 4300-digit limit on decimal conversion, which a big factorial passes).

Decoding refuses anything else: JSON's ``NaN`` / ``Infinity`` constants, duplicate keys, an object that is not
one of the tags, an unhashable set element or dict key, more than `MAX_SAME_HASH` set elements or dict keys
with one hash value, nesting deeper than `MAX_DEPTH`, a line that is not UTF-8. The hash rule bounds the time
as well as the size of a decode: ints that differ by multiples of 2**61 - 1 (and floats, tuples of them) all
hash alike, and building a set of n of them takes time quadratic in n (120,000 took two minutes of the
harness's CPU, outside the sandbox's deadline); a set an honest program returns has no such pile-up.
Decoding rebuilds values from builtin types only, so comparing decoded values (``==`` in the harness) runs
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
MAX_SAME_HASH = 32              # set elements / dict keys sharing one hash value (see the module docstring)
BIG_INT_BITS = 10_000           # about 3,000 decimal digits; larger ints cross as hexadecimal
_TAGS = ("tuple", "set", "frozenset", "dict", "float", "int", "bytes", "complex")
_HEX = re.compile(r"-?0x[0-9a-f]+")
_HEXBYTES = re.compile(r"(?:[0-9a-f]{2})*")


class NotPlain(ValueError):
    """A value (or a line) that is not a plain value in the format above."""


def encode(value, depth=0):
    """A plain value → its JSON-ready form; anything else raises `NotPlain` naming the type."""
    t = type(value)
    if value is None or t is bool:
        return value
    if issubclass(t, int):
        v = value if t is int else int.__add__(value, 0)
        return {"int": hex(v)} if v.bit_length() > BIG_INT_BITS else v
    if issubclass(t, float):
        v = value if t is float else float.__mul__(value, 1.0)
        if math.isfinite(v):
            return v
        return {"float": "nan" if v != v else ("inf" if v > 0 else "-inf")}
    if issubclass(t, str):
        return value if t is str else str.__str__(value)
    if issubclass(t, complex):
        return {"complex": [encode(complex.real.__get__(value)), encode(complex.imag.__get__(value))]}
    if issubclass(t, (bytes, bytearray)):
        return {"bytes": (bytes.hex if issubclass(t, bytes) else bytearray.hex)(value)}
    if depth >= MAX_DEPTH:
        raise NotPlain(f"nested deeper than {MAX_DEPTH} levels")
    if issubclass(t, list):
        return [encode(v, depth + 1) for v in list.__iter__(value)]
    if issubclass(t, tuple):
        return {"tuple": [encode(v, depth + 1) for v in tuple.__iter__(value)]}
    if issubclass(t, frozenset):
        return {"frozenset": [encode(v, depth + 1) for v in frozenset.__iter__(value)]}
    if issubclass(t, set):
        return {"set": [encode(v, depth + 1) for v in set.__iter__(value)]}
    if issubclass(t, dict):
        return {"dict": [[encode(k, depth + 1), encode(v, depth + 1)] for k, v in dict.items(value)]}
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
    if tag == "bytes":
        if type(payload) is not str or not _HEXBYTES.fullmatch(payload):
            raise NotPlain("bytes tag without an even-length hexadecimal string")
        return bytes.fromhex(payload)
    if tag == "complex":
        if type(payload) is not list or len(payload) != 2:
            raise NotPlain("complex tag without [re, im]")
        re_, im = decode(payload[0], depth + 1), decode(payload[1], depth + 1)
        if type(re_) is not float or type(im) is not float:
            raise NotPlain("complex parts must be floats")
        return complex(re_, im)
    if tag == "float":
        if payload not in ("nan", "inf", "-inf"):
            raise NotPlain(f"float tag with {str(payload)[:20]!r}")
        return float(payload)
    if tag not in _TAGS or type(payload) is not list:
        raise NotPlain(f"unknown tag {str(tag)[:40]!r} or its payload is not a list")
    if tag == "tuple":
        return tuple(decode(v, depth + 1) for v in payload)
    if tag in ("set", "frozenset"):
        items = [decode(v, depth + 1) for v in payload]
        _no_hash_pile_up(tag, items)
        return set(items) if tag == "set" else frozenset(items)
    pairs = []
    for pair in payload:
        if type(pair) is not list or len(pair) != 2:
            raise NotPlain("a dict entry must be a [key, value] pair")
        pairs.append((decode(pair[0], depth + 1), decode(pair[1], depth + 1)))
    _no_hash_pile_up(tag, [k for k, _ in pairs])
    return dict(pairs)


def _no_hash_pile_up(tag, keys):
    """`NotPlain` for an unhashable key, or for more than MAX_SAME_HASH keys with one hash value, before any
    set or dict is built of them: counting by hash value is linear (the counts' own keys, hash values, hash
    to themselves and so are all distinct)."""
    counts = {}
    for k in keys:
        try:
            h = hash(k)
        except TypeError as e:
            raise NotPlain(f"{tag}: {e}") from None
        n = counts.get(h, 0) + 1
        if n > MAX_SAME_HASH:
            raise NotPlain(f"{tag}: more than {MAX_SAME_HASH} elements share one hash value (a hash-flooding "
                           "collection: decoding it would take quadratic time)")
        counts[h] = n


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
