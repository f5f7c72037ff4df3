"""The runner's work-dir manifest (oracle/dsv41/workdir.py): a typed, versioned record of the last committed
stage, written and read back unchanged, and an old or garbled manifest refused with an error naming the file."""

from __future__ import annotations

import json

import pytest

from oracle.dsv41.options import RunnerError
from oracle.dsv41.workdir import MANIFEST, MANIFEST_FORMAT, Manifest, RunTotals, WorkDir

IDENTITY = {"checkpoint_hash": "c0ffee", "precision": "fp32"}


def _manifest(**kw) -> Manifest:
    m = dict(stages_done=3, stage_name="layer 1", acts="acts-002.bin", acts_sha256="ab" * 32, acts_bytes=4096,
             table=[{"arrays": {"h": [0, 64, "float32", [1, 4]]}, "meta": {"shared": {}}}],
             loaded={"embed.weight": "12" * 32, "layers.0.attn.wq_a.weight": "34" * 32},
             totals=RunTotals(read_s=1.5, compute_s=2.25, io_s=0.125, largest_stage_weight_bytes=123456,
                              largest_stage_name="layer 0", activation_bytes=4096))
    m.update(kw)
    return Manifest(**m)


def _committed(tmp_path, manifest: Manifest) -> WorkDir:
    wd = WorkDir(tmp_path / "w", IDENTITY)
    wd.path.mkdir()
    (wd.path / manifest.acts).write_bytes(b"x")
    wd.commit(manifest)
    return wd


def test_a_committed_manifest_reads_back_equal_and_keeps_its_activation_file(tmp_path):
    m = _manifest()
    wd = _committed(tmp_path, m)
    (wd.path / "acts-001.bin").write_bytes(b"stale")  # a stage the manifest does not name: removed
    assert WorkDir(wd.path, IDENTITY).resume(restart=False) == m
    assert sorted(p.name for p in wd.path.iterdir()) == ["acts-002.bin", MANIFEST]


def test_the_file_is_the_flat_ds41_runner_1_layout(tmp_path):
    """Readers outside the runner (the reliability drivers) read stages_done at the top level."""
    wd = _committed(tmp_path, _manifest())
    obj = json.loads(wd.manifest_path.read_text())
    assert obj["format"] == MANIFEST_FORMAT == "ds41-runner/1"
    assert obj["stages_done"] == 3 and obj["identity"] == IDENTITY and obj["job"] == wd.job
    assert obj["timing"] == {"read_s": 1.5, "compute_s": 2.25, "io_s": 0.125}
    assert obj["largest_stage_weight_bytes"] == 123456 and obj["activation_bytes"] == 4096


@pytest.mark.parametrize("change, message", [
    (lambda o: o.update(format="ds41-runner/0"), "manifest format 'ds41-runner/0', this runner reads 'ds41-runner/1'"),
    (lambda o: o.pop("format"), "manifest format None"),
    (lambda o: o.pop("stages_done"), "garbled manifest: 'stages_done' is None"),
    (lambda o: o.update(stages_done="3"), "garbled manifest: 'stages_done' is '3'"),
    (lambda o: o.update(stages_done=True), "garbled manifest: 'stages_done' is True"),
    (lambda o: o["timing"].pop("io_s"), "garbled manifest: timing.'io_s' is None"),
    (lambda o: o.update(loaded={"embed.weight": 7}), "'loaded' maps a tensor to something other than a digest"),
    (lambda o: o.update(table=[1]), "'table' holds an entry that is not an object"),
])
def test_an_old_or_garbled_manifest_is_refused_naming_the_file(tmp_path, change, message):
    wd = _committed(tmp_path, _manifest())
    obj = json.loads(wd.manifest_path.read_text())
    change(obj)
    wd.manifest_path.write_text(json.dumps(obj))
    with pytest.raises(RunnerError) as e:
        WorkDir(wd.path, IDENTITY).resume(restart=False)
    assert str(wd.manifest_path) in str(e.value) and message in str(e.value) and "--restart" in str(e.value)


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", "\udcff"])
def test_an_unreadable_manifest_is_refused_naming_the_file(tmp_path, text):
    wd = _committed(tmp_path, _manifest())
    wd.manifest_path.write_bytes(text.encode("utf-8", "surrogateescape"))
    with pytest.raises(RunnerError, match="--restart") as e:
        WorkDir(wd.path, IDENTITY).resume(restart=False)
    assert str(wd.manifest_path) in str(e.value)


def test_another_runs_manifest_is_refused_and_restart_starts_over(tmp_path):
    wd = _committed(tmp_path, _manifest())
    other = WorkDir(wd.path, {**IDENTITY, "precision": "reference-bf16"})
    with pytest.raises(RunnerError, match=r"belongs to another run \(differs in \['precision'\]\)"):
        other.resume(restart=False)
    assert other.resume(restart=True) is None
    assert list(wd.path.iterdir()) == []  # the old manifest and every activation file are gone


def test_a_work_dir_held_by_another_run_is_refused_and_free_again_after(tmp_path):
    import subprocess
    import sys

    path = tmp_path / "w"
    holder = ("import sys; from filelock import FileLock; lock = FileLock(sys.argv[1], timeout=0); lock.acquire(); "
              "print('held', flush=True); sys.stdin.read()")
    path.mkdir()
    other = subprocess.Popen([sys.executable, "-c", holder, str(path / "lock")], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert other.stdout.readline().strip() == "held"
        with pytest.raises(RunnerError, match=r"w: another run holds this work dir"):
            with WorkDir(path, IDENTITY).locked():
                pass
    finally:
        other.stdin.close()
        other.wait(timeout=30)
    with WorkDir(path, IDENTITY).locked() as wd:      # the other run has ended: its lock went with it
        with pytest.raises(RunnerError, match="another run holds this work dir"):
            with WorkDir(path, IDENTITY).locked():     # a second run in this process is refused too
                pass
        assert wd.path == path
