"""Verdict integrity II (issue 35, part C): what generated code sends back and writes is bounded in time and
in total, not only in size per item.

* answer decoding: a solution that writes a set of hash-colliding ints (multiples of 2**61 - 1 all hash to 0)
  to the answer channel made the harness build that set in quadratic time, outside the sandbox's deadline
  (120,000 ints: 121 s of harness CPU). A set, frozenset or dict with more than `plain.MAX_SAME_HASH` elements
  of one hash value is refused before it is built, in linear time;
* the sandbox's writes: only single files were capped (RLIMIT_FSIZE), so many files wrote 640 MB in 4 s onto
  the host's disk. The writable place is now a tmpfs of `Limits.disk_mb` in all.

All through the real scoring path and real bubblewrap.
"""

from __future__ import annotations

import textwrap
import time

import pytest

from evals import data, plain
from evals.code import score_solution
from evals.sandbox import Limits, run_python
from tests.reliability.test_verdict_integrity_evals import FAST, TINY

M61 = 2**61 - 1          # ints k * M61 all hash to 0


@pytest.fixture(scope="module")
def add_problem():
    ds = data.load_plus("humaneval+", TINY, expect_count=8)
    return next(p for p in ds.problems if p.entry_point == "add")


# ------------------------------------------------------------------------------------------------ decoding
FLOODS = {
    "set of ints": {"set": [k * M61 for k in range(20_000)]},
    "frozenset of ints": {"frozenset": [k * M61 for k in range(20_000)]},
    "dict keys": {"dict": [[k * M61, 0] for k in range(20_000)]},
    "set of 1-tuples": {"set": [{"tuple": [k * M61]} for k in range(20_000)]},
    "ints and floats alike": {"set": [2.0 ** (61 * k) for k in range(17)] + [1 + k * M61 for k in range(20_000)]},
    "nested in a list": [1, {"set": [k * M61 for k in range(20_000)]}],
}


@pytest.mark.parametrize("name", sorted(FLOODS))
def test_a_hash_flooding_collection_is_refused_in_linear_time(name):
    payload = FLOODS[name]
    t0 = time.process_time()
    with pytest.raises(plain.NotPlain, match="share one hash value"):
        plain.decode(payload)
    assert time.process_time() - t0 < 0.5


def test_honest_collections_still_decode():
    big = plain.decode({"set": list(range(200_000))})
    assert big == set(range(200_000))
    assert plain.decode({"set": [-1, -2]}) == {-1, -2}                  # a real collision: hash(-1) == hash(-2)
    few = [k * M61 for k in range(plain.MAX_SAME_HASH)]                 # a few alike: allowed
    assert plain.decode({"frozenset": few}) == frozenset(few)
    assert plain.decode({"dict": [[{"tuple": [1, "a"]}, [1]], ["k", None]]}) == {(1, "a"): [1], "k": None}
    with pytest.raises(plain.NotPlain, match="unhashable"):
        plain.decode({"set": [[1]]})


def test_a_solution_writing_a_colliding_set_to_the_answer_channel_costs_the_harness_no_time(add_problem):
    """The issue's attack, end to end: 120,000 colliding ints as the answer line (3 MB, under the output cap)."""
    attack = textwrap.dedent("""\
        def add(a, b):
            import __main__, time
            m = 2**61 - 1
            line = '{"ok":{"set":[' + ",".join(str(k * m) for k in range(120000)) + ']}}\\n'
            __main__._to_harness.write(line.encode())
            time.sleep(60)
        """)
    t0 = time.process_time()
    got = score_solution(add_problem, f"```python\n{attack}```", FAST)
    harness_cpu = time.process_time() - t0
    assert got.base is False and "share one hash value" in got.detail, got
    assert harness_cpu < 10.0, f"the harness spent {harness_cpu:.1f} s of CPU decoding one answer"


# ------------------------------------------------------------------------------------------------ writes
def test_the_sandbox_cannot_write_more_than_its_disk_cap_in_many_files():
    limits = Limits(wall_s=20.0, cpu_s=10, memory_mb=512, processes=16, file_mb=16, disk_mb=32)
    src = textwrap.dedent("""\
        import errno
        total, err = 0, None
        chunk = b"x" * (1 << 20)
        try:
            for i in range(64):                       # 64 files of 10 MiB: 640 MiB asked, each under file_mb
                with open(f"/tmp/f{i}" if i % 2 else f"f{i}", "wb") as f:
                    for _ in range(10):
                        f.write(chunk)
                        f.flush()
                        total += len(chunk)
        except OSError as e:
            err = errno.errorcode.get(e.errno)
        print(total >> 20, err)
        """)
    t0 = time.monotonic()
    out = run_python(src, limits)
    assert out.status == "ok", out.stderr
    written_mib, err = out.stdout.split()
    assert err == "ENOSPC" and int(written_mib) <= limits.disk_mb, out.stdout
    assert time.monotonic() - t0 < limits.wall_s


def test_the_program_and_its_files_are_read_only_and_the_rest_is_writable():
    out = run_python(textwrap.dedent("""\
        import errno, os, tempfile
        try:
            open("main.py", "w")
        except OSError as e:
            print("main.py", errno.errorcode.get(e.errno))
        d = tempfile.mkdtemp()
        with open(os.path.join(d, "x"), "w") as f:
            f.write("ok")
        print(open(os.path.join(d, "x")).read(), os.path.realpath("/tmp"))
        """), FAST)
    assert out.status == "ok", out.stderr
    assert out.stdout.split() == ["main.py", "EROFS", "ok", "/sandbox"]
