"""scripts/check_reference_folder.py: an assembled reference folder checked file by file.

The digests the tests expect are computed independently of the script: by `tail -n +K | sed ... | sha256sum`,
the very commands docs/ORACLE.md gives for a check by hand.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from core.errors import UserError

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "check_reference_folder.py"
HEADER = "".join(f"# provenance line {i}\n" for i in range(5)) + "\n"  # 6 lines, as tt-metal's copies carry


@pytest.fixture(scope="module")
def crf():
    spec = importlib.util.spec_from_file_location("check_reference_folder", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def _shell_sha(cmd: str, path: Path) -> str:
    if shutil.which("sha256sum") is None:
        pytest.skip("sha256sum not on PATH")
    out = subprocess.run(["bash", "-c", f"cat '{path}' | {cmd} | sha256sum"], capture_output=True, text=True, check=True)
    return out.stdout.split()[0]


def _folder(tmp_path: Path) -> Path:
    """A folder laid out like the V4.1 one: headers, package-relative imports in model.py, an empty __init__."""
    d = tmp_path / "ref"
    d.mkdir()
    (d / "model.py").write_text(HEADER + "# two more header lines\n# of model.py\n\n"
                                "from .engram import Engram\nfrom .kernel_cpu import act_quant\n"
                                "from .vision import ViT\nfrom .image_processor import load_image\n"
                                "x = 'from .vision import stays (not at a line start)'\n")
    (d / "engram.py").write_text(HEADER + "class Engram: pass\n")
    (d / "kernel_cpu.py").write_text("def act_quant(x):\n    return x\n")
    (d / "__init__.py").write_text("")
    return d


@pytest.fixture()
def pinned(crf, tmp_path, monkeypatch):
    """A folder kind whose digests come from the shell commands of docs/ORACLE.md, over _folder's files."""
    d = _folder(tmp_path)
    sed = ("sed -e 's/^from \\.engram import/from engram import/' -e 's/^from \\.image_processor import/"
           "from image_processor import/' -e 's/^from \\.kernel_cpu import/from kernel import/' "
           "-e 's/^from \\.vision import/from vision import/'")
    kind = (
        crf.ExpectedFile("model.py", _shell_sha(f"tail -n +10 | {sed}", d / "model.py"),
                         crf.Transform(skip_lines=9, upstream_imports=True), "test"),
        crf.ExpectedFile("engram.py", _shell_sha("tail -n +7", d / "engram.py"), crf.Transform(skip_lines=6), "test"),
        crf.ExpectedFile("kernel_cpu.py", _shell_sha("cat", d / "kernel_cpu.py"), crf.Transform(), "test"),
        crf.ExpectedFile("__init__.py", _shell_sha("cat", d / "__init__.py"), crf.Transform(), "empty"),
    )
    monkeypatch.setitem(crf.FOLDERS, "t", kind)
    return d


def test_all_good_folder_passes(crf, pinned, capsys):
    checks = crf.check_folder("t", pinned)
    assert [c.status for c in checks] == ["ok"] * 4
    assert crf.main(["t", str(pinned)]) == 0
    assert "4/4 files as pinned" in capsys.readouterr().out


def test_missing_file_is_named(crf, pinned, capsys):
    (pinned / "engram.py").unlink()
    checks = {c.name: c for c in crf.check_folder("t", pinned)}
    assert checks["engram.py"].status == "missing"
    assert [n for n, c in checks.items() if not c.ok] == ["engram.py"]
    assert crf.main(["t", str(pinned)]) == 1
    out = capsys.readouterr().out
    assert "MISSING  engram.py" in out and "missing or different: engram.py" in out


def test_wrong_digest_is_named_with_both_digests(crf, pinned, capsys):
    body = (pinned / "model.py").read_text().replace("ViT", "ViT2")
    (pinned / "model.py").write_text(body)
    checks = {c.name: c for c in crf.check_folder("t", pinned)}
    assert checks["model.py"].status == "differs"
    assert crf.FOLDERS["t"][0].sha256 in checks["model.py"].detail
    assert [n for n, c in checks.items() if not c.ok] == ["model.py"]
    assert crf.main(["t", str(pinned)]) == 1
    assert "DIFFERS  model.py" in capsys.readouterr().out


def test_header_change_alone_still_matches_upstream(crf, pinned):
    """Only the body is pinned for header-carrying files: another provenance header is still upstream's body."""
    text = (pinned / "engram.py").read_text()
    (pinned / "engram.py").write_text(text.replace("provenance line 0", "another header"))
    assert all(c.ok for c in crf.check_folder("t", pinned))
    (pinned / "__init__.py").write_text("import os\n")  # the package file must stay empty
    assert [c.name for c in crf.check_folder("t", pinned) if not c.ok] == ["__init__.py"]


def test_bad_arguments_are_one_line_user_errors(crf, tmp_path, capsys):
    with pytest.raises(UserError, match="unknown reference folder kind 'v5'"):
        crf.check_folder("v5", tmp_path)
    with pytest.raises(UserError, match="is not a folder"):
        crf.check_folder("v4", tmp_path / "nowhere")
    assert crf.main(["v41", str(tmp_path / "nowhere")]) == 2
    assert "error: reference folder" in capsys.readouterr().err


def test_the_shipped_kinds_name_every_file_the_harnesses_import(crf):
    assert [e.name for e in crf.FOLDERS["v41"]] == ["model.py", "engram.py", "vision.py", "image_processor.py",
                                                     "kernel_cpu.py", "__init__.py"]
    assert [e.name for e in crf.FOLDERS["v4"]] == ["model.py", "kernel.py"]
    # the V4 folder's kernel.py is the V4.1 folder's kernel_cpu.py, renamed
    assert crf.FOLDERS["v4"][1].sha256 == crf.FOLDERS["v41"][4].sha256
