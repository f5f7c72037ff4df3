"""EvalPlus's output comparison, computed in the harness on plain values (evals/plain.py), never inside the
process that produced them.

What EvalPlus judges (its ``unsafe_execute``, as of the HumanEvalPlus v0.1.10 / MbppPlus v0.2.0 releases),
restated here for decoded builtin values:

1. ``out == expected`` (exact; ``1 == 1.0`` and ``True == 1`` as in Python);
2. special oracles: MBPP ``are_equivalent`` passes whatever it returns, ``sum_div`` also when it returns 0,
   ``surface_Area`` also within ``atol`` of the rounded pyramid area, ``digit_distance_nums`` also when it equals
   the zero-padded digit distance, eight tasks compare ``set(out) == set(expected)``, and three whose outputs
   are ``re.Match`` objects compare only "is not None" (that reduction happens where the value lives: the
   server driver in the sandbox, `NOT_NONE_TASKS`); HumanEval ``find_zero`` passes when
   ``|poly(xs, out)| <= atol``;
3. when the expected output is a float, or a non-empty list / tuple of floats, and the problem's ``atol`` is 0,
   ``atol`` becomes 1e-6;
4. when not exact and ``atol != 0``: the types must be equal, sequences of the same length, and every element
   within ``atol + 1e-7 * |expected|`` (numpy's ``allclose``: same shape, NaN never close, an infinity only to
   itself).

One difference, on purpose: EvalPlus's step 3 changes ``atol`` for every later input of the problem once one
expected value is a float; here each input is judged on its own.
"""

from __future__ import annotations

import math
from typing import Any

MBPP_NOT_NONE_TASKS = ("check_str", "text_match_three", "text_starta_endb")
MBPP_SET_EQ_TASKS = ("similar_elements", "find_char_long", "common_in_nested_lists", "extract_singly",
                     "larg_nnum", "intersection_array", "find_dissimilar", "Diff")
RTOL = 1e-7                     # numpy.allclose's default, which EvalPlus passes explicitly
FLOAT_ATOL = 1e-6               # EvalPlus's atol for float outputs of problems that give none


def suite_of(task_id: str) -> str:
    return "mbpp" if task_id.startswith("Mbpp/") else "humaneval" if task_id.startswith("HumanEval/") else ""


def reduction(task_id: str, entry_point: str, canonical: bool) -> str | None:
    """How the sandbox's server reduces an output before it crosses (None: it sends the value itself)."""
    if suite_of(task_id) == "mbpp" and entry_point in MBPP_NOT_NONE_TASKS:
        return "is_not_none" if canonical else "bool_or_not_none"
    return None


def _number(x: Any) -> bool:
    return type(x) in (int, float, bool)


def _is_floats(x: Any) -> bool:
    if type(x) is float:
        return True
    return type(x) in (list, tuple) and len(x) > 0 and all(type(v) is float for v in x)


def _close(out: Any, exp: Any, atol: float) -> bool:
    """numpy.allclose(out, exp, rtol=1e-7, atol=atol) for nested lists / tuples of numbers, without numpy's
    broadcasting (EvalPlus checks the lengths first; a ragged or non-numeric value fails)."""
    if type(exp) in (list, tuple):
        return (type(out) in (list, tuple) and len(out) == len(exp)
                and all(_close(o, e, atol) for o, e in zip(out, exp)))
    if not (_number(out) and _number(exp)):
        return False
    o, e = float(out), float(exp)
    if math.isnan(o) or math.isnan(e):
        return False
    if math.isinf(o) or math.isinf(e):
        return o == e
    return abs(o - e) <= atol + RTOL * abs(e)


def _poly(xs: Any, x: Any) -> float:
    return sum(c * math.pow(x, i) for i, c in enumerate(xs))


def _surface_area(base_edge: Any, height: Any) -> int:
    slant = math.sqrt((base_edge / 2) ** 2 + height ** 2)
    return round(base_edge ** 2 + 2 * base_edge * slant)


def _digit_distance(a: Any, b: Any) -> int:
    sa, sb = str(a), str(b)
    n = max(len(sa), len(sb))
    return sum(abs(int(x) - int(y)) for x, y in zip(sa.zfill(n), sb.zfill(n)))


def same_output(task_id: str, entry_point: str, inp: list, out: Any, exp: Any, atol: float) -> bool:
    """Does ``out`` (the candidate's decoded output for ``inp``) pass against ``exp`` (the canonical solution's)?
    Both are plain values decoded in this process; nothing of the candidate's code runs here."""
    try:
        return _same(task_id, entry_point, inp, out, exp, atol)
    except (TypeError, ValueError, OverflowError, ArithmeticError, RecursionError):
        return False        # EvalPlus: any exception while judging is a failure of that input


def _same(task_id: str, entry_point: str, inp: list, out: Any, exp: Any, atol: float) -> bool:
    exact = out == exp
    suite = suite_of(task_id)
    if suite == "mbpp":
        if entry_point == "are_equivalent":
            exact = True
        elif entry_point == "sum_div":
            exact = exact or out == 0
        elif entry_point == "surface_Area":
            exact = exact or (_number(out) and abs(out - _surface_area(*inp)) <= atol)
        elif entry_point == "digit_distance_nums":
            exact = exact or out == _digit_distance(*inp)
        elif entry_point in MBPP_SET_EQ_TASKS:
            exact = type(out) in (list, tuple, set, frozenset, dict, str) and set(out) == set(exp)
    elif suite == "humaneval" and entry_point == "find_zero":
        return _number(out) and abs(_poly(inp[0], out)) <= atol
    if atol == 0 and _is_floats(exp):
        atol = FLOAT_ATOL
    if not exact and atol != 0:
        return type(out) is type(exp) and _close(out, exp, atol)
    return bool(exact)
