"""The floor plan of docs/DESIGN.md, held against the code: every import points down, and no two
modules of the house import each other (directly or round a longer circle).

Imports are read from the source with `ast` (function-level imports included: a lazy import is still
an arrow), so the rule holds for code that is never executed in a test run too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# Lowest floor first. A package may import from packages on lower floors and from itself; nothing on
# its own floor or above. docs/DESIGN.md draws the same table.
FLOORS: list[tuple[str, ...]] = [
    ("core",),        # records, metrics, bands, verdicts, atomic writes, version
    ("panels",),      # panel data, encodings, needles, bench sets
    ("oracle",),      # the references: generic fp32 transformers oracle, the DeepSeek-V4.1 oracle
    ("engine",),      # the engine under test: client, adapters, launcher, kernels run in-process
    ("evals",),       # task evals: data, sandbox, IFEval checkers, generation through the engine, McNemar
    ("reports",),     # JSON / Markdown / HTML rendering of metrics
    ("nightly",),     # flag registry, flag A/B statistics, the nightly matrix and its history
    ("gates",),       # the gate suite behind `pytest -m gate`
    ("ds41gates",),   # wiring: CLI, pipeline, pytest plugin, demo
]
FLOOR_OF = {pkg: i for i, floor in enumerate(FLOORS) for pkg in floor}


def house_modules(root: Path = REPO) -> dict[str, Path]:
    """module name → file, for every Python file of the house's packages."""
    out = {}
    for pkg in FLOOR_OF:
        base = root / pkg
        if not base.is_dir():
            continue
        for path in sorted(base.rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


def imports_of(module: str, path: Path) -> list[tuple[str, int, tuple[str, ...]]]:
    """Each import statement of a module: the absolute module it names (relative imports resolved), its
    line, and the names taken from it (`from pkg import submodule` names a module too)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno, ()) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.append((target, node.lineno, tuple(alias.name for alias in node.names)))
    return found


def upward_imports(root: Path = REPO) -> list[str]:
    problems = []
    for module, path in house_modules(root).items():
        own = FLOOR_OF[module.split(".")[0]]
        for target, line, _ in imports_of(module, path):
            top = target.split(".")[0]
            if top in FLOOR_OF and top != module.split(".")[0] and FLOOR_OF[top] >= own:
                problems.append(f"{path.relative_to(root)}:{line}: {module.split('.')[0]} (floor {own}) "
                                f"imports {target} (floor {FLOOR_OF[top]})")
    return problems


def import_circles(root: Path = REPO) -> list[list[str]]:
    """Strongly connected groups of more than one module in the import graph (Tarjan)."""
    modules = house_modules(root)
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        edges = set()
        for target, _, names in imports_of(module, path):
            for imported in [f"{target}.{n}" for n in names] or [target]:
                # the longest known module that the imported name lies in
                name = imported
                while name and name not in modules:
                    name = name.rpartition(".")[0]
                # a package's own __init__ is above its submodules, not a dependency of theirs
                if name and name != module and not module.startswith(name + "."):
                    edges.add(name)
        graph[module] = edges
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                circles.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return circles


def test_every_import_points_down():
    assert upward_imports() == []


def test_no_import_circles():
    assert import_circles() == []


def test_the_core_imports_nothing_above_it_and_the_oracle_never_the_engine():
    # the two rules the design names first, spelled out so a failure reads as the rule it breaks
    problems = upward_imports()
    assert [p for p in problems if p.split(": ")[1].startswith("core ")] == []
    assert [p for p in problems if " oracle (floor" in p and "imports engine" in p] == []


def _write(root: Path, rel: str, text: str) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


@pytest.mark.parametrize("module, source, expected", [
    ("core/records.py", "from engine.client import EngineClient\n", "core (floor 0) imports engine.client"),
    ("oracle/hf.py", "def f():\n    from engine import endpoint\n", "oracle (floor 2) imports engine"),
    ("panels/store.py", "from core.records import Record\n", None),
    ("oracle/dsv41/model.py", "from ..hf import score\n", None),  # relative, inside its own package
    ("engine/client.py", "from reports.render import build_report\n", "engine (floor 3) imports reports.render"),
])
def test_the_rule_catches_a_forbidden_import(tmp_path, module, source, expected):
    _write(tmp_path, module, source)
    for pkg in ("core", "panels", "oracle", "oracle/dsv41", "engine", "reports"):
        _write(tmp_path, f"{pkg}/__init__.py", "")
    problems = upward_imports(tmp_path)
    if expected is None:
        assert problems == []
    else:
        assert len(problems) == 1 and expected in problems[0] and problems[0].startswith(module)


def test_the_circle_check_finds_a_circle(tmp_path):
    _write(tmp_path, "oracle/__init__.py", "")
    _write(tmp_path, "oracle/a.py", "from .b import B\n")
    _write(tmp_path, "oracle/b.py", "def f():\n    from oracle.a import A\n")
    _write(tmp_path, "oracle/c.py", "from oracle import a\n")
    assert import_circles(tmp_path) == [["oracle.a", "oracle.b"]]


# Inside a package the same rule holds between the rooms that issue 30 split out of one file: the profile schema and
# process supervision under the launcher, the launcher under the gate target that names its model providers; the
# tensor inventory and shard I/O under the architecture, the architecture under the checkpoint and the runner; the
# typed results on the ground floor's upper storey, above the atomic writes and redaction it uses; the config schemas'
# base beside them, above the one TOML reader (issue 38).
ROOMS: dict[str, list[tuple[str, ...]]] = {
    "engine": [("engine.profiles", "engine.supervise"), ("engine.launcher",), ("engine.target",)],
    "oracle.dsv41": [("oracle.dsv41.config",), ("oracle.dsv41.inventory", "oracle.dsv41.shard_io"),
                     ("oracle.dsv41.arch",), ("oracle.dsv41.checkpoint", "oracle.dsv41.workdir"),
                     ("oracle.dsv41.runner",)],
    "core": [("core.atomic", "core.errors", "core.redact", "core.tomlfile"),
             ("core.results", "core.records", "core.schema")],
}


def upward_room_imports(root: Path = REPO, rooms: dict[str, list[tuple[str, ...]]] = ROOMS) -> list[str]:
    modules = house_modules(root)
    problems = []
    for storeys in rooms.values():
        storey_of = {m: i for i, storey in enumerate(storeys) for m in storey}
        for module, own in storey_of.items():
            if module not in modules:
                problems.append(f"{module}: named in ROOMS but not in the house")
                continue
            for target, line, names in imports_of(module, modules[module]):
                for imported in [target] + [f"{target}.{n}" for n in names]:
                    if storey_of.get(imported, -1) > own:
                        problems.append(f"{modules[module].relative_to(root)}:{line}: {module} (storey {own}) "
                                        f"imports {imported} (storey {storey_of[imported]})")
    return problems


def test_the_split_rooms_import_only_downwards():
    assert upward_room_imports() == []


def test_the_room_rule_catches_an_upward_import(tmp_path):
    _write(tmp_path, "engine/__init__.py", "")
    _write(tmp_path, "engine/profiles.py", "def f():\n    from engine.launcher import EngineServer\n")
    _write(tmp_path, "engine/launcher.py", "from engine import profiles\n")
    problems = upward_room_imports(tmp_path, {"engine": [("engine.profiles",), ("engine.launcher",)]})
    assert len(problems) == 1 and problems[0].startswith("engine/profiles.py:2: engine.profiles (storey 0)")


def test_the_architecture_is_chosen_in_one_place():
    """`is_v4` branches were the DeepSeek-V4 seam; the architecture object is now the only place that may ask."""
    hits = [f"{p.relative_to(REPO)}:{i}" for p in sorted((REPO / "oracle").rglob("*.py"))
            for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
            if "is_v4" in line and p.name != "arch.py"]
    hits += [f"{p.relative_to(REPO)}" for pkg in ("engine", "ds41gates", "gates", "nightly", "core")
             for p in sorted((REPO / pkg).rglob("*.py")) if "is_v4" in p.read_text(encoding="utf-8")]
    assert hits == []
