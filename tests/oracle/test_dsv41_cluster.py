"""Panel shards on a Ray cluster (oracle/dsv41/cluster.py), on a local multi-worker Ray instance: a worker
process SIGKILLed while it scores its shard, the shard run again in another worker process, and the merged
record equal, array for array, to the single-process record; a bad address and a shard that fails on every
attempt end as named errors."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from core.records import Record
from oracle.dsv41.checkpoint import INDEX_NAME, Checkpoint
from oracle.dsv41.cluster import ATTEMPTS_LOG, ClusterError, parse_cluster, run_on_cluster
from oracle.dsv41.runner import MANIFEST, RunOptions, run_panel
from panels import encoded_from_json

from .test_dsv41_runner import assert_same_record

LENGTHS = (21, 9, 16, 13, 48)  # shards of 3: {q0, q3}, {q1, q4}, {q2}; shard 1 holds the longest sequence
SHARDS = 3
WORKERS = 2  # shard 2 waits for a free worker; the killed shard's retry needs a new worker process
VICTIM = 1


def _opts(**kw) -> RunOptions:
    return RunOptions(**{"threads": 1, "progress": False, "full_logprobs": True, **kw})


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint) -> Path:
    return tiny_checkpoint(seed=0)


@pytest.fixture(scope="module")
def panel_json(tmp_path_factory) -> Path:
    g = torch.Generator().manual_seed(3)
    seqs = [{"seq_id": f"q{i}", "domain": "code" if i % 2 else "chat",
             "token_ids": torch.randint(0, 512, (n,), generator=g).tolist()} for i, n in enumerate(LENGTHS)]
    p = tmp_path_factory.mktemp("panel") / "panel.json"
    p.write_text(json.dumps({"panel_name": "cluster-test", "panel_version": "1", "sequences": seqs}))
    return p


@pytest.fixture(scope="module")
def panel(panel_json):
    return encoded_from_json(panel_json)


def _cli(ck: Path, panel_json: Path, out: Path, *extra: str, timeout: float) -> subprocess.CompletedProcess:
    """`ds41gate oracle run` in its own process group: Ray's local instance (GCS, raylet, workers) are its
    children, and a run that outlives `timeout` is killed with all of them rather than hanging the suite."""
    cmd = [sys.executable, "-m", "ds41gates.cli", "oracle", "run", "--checkpoint", str(ck), "--panel",
           str(panel_json), "--out", str(out), "--threads", "1", "--full-logprobs", "--no-progress", *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"`{' '.join(cmd)}` still running after {timeout} s\n{stderr[-3000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def _kill_mid_shard(shard_work: Path, stages: int, done: threading.Event, deadline: float) -> dict:
    """Wait until the shard's first attempt has committed a stage but not its last, then SIGKILL the worker
    process that runs it. Returns what was killed and where it was."""
    log, manifest = shard_work / ATTEMPTS_LOG, shard_work / MANIFEST
    while time.monotonic() < deadline and not done.is_set():
        try:
            attempts = [json.loads(x) for x in log.read_text().splitlines()]
            stage = json.loads(manifest.read_text())["stages_done"]
        except (FileNotFoundError, json.JSONDecodeError, KeyError):
            time.sleep(0.01)
            continue
        if len(attempts) == 1 and 1 <= stage < stages:
            pid = attempts[0]["pid"]
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
                os.kill(pid, signal.SIGKILL)
            except (FileNotFoundError, ProcessLookupError):
                return {}  # it ended on its own in between: the assertion below says so
            return {"pid": pid, "stage": stage, "cmdline": cmdline}
        time.sleep(0.01)
    return {}


def test_a_killed_worker_s_shard_is_rerun_and_the_merged_record_is_bit_identical(tiny, panel, panel_json, tmp_path):
    t = time.perf_counter()
    single = run_panel(Checkpoint(tiny), panel, tmp_path / "single-work", _opts())
    single_s = time.perf_counter() - t

    work, out = tmp_path / "work", tmp_path / "ref.safetensors"
    stages = 1 + Checkpoint(tiny).model_config.n_layers  # committed stages before the head
    done = threading.Event()
    t = time.perf_counter()
    with ThreadPoolExecutor(1) as pool:
        killer = pool.submit(_kill_mid_shard, work / f"shard-{VICTIM}-of-{SHARDS}", stages, done,
                             time.monotonic() + 240)
        try:
            run = _cli(tiny, panel_json, out, "--cluster", f"local:{WORKERS}", "--shards", str(SHARDS),
                       "--retries", "2", "--work", str(work), timeout=240)
        finally:
            done.set()
        killed = killer.result()
    cluster_s = time.perf_counter() - t
    print(f"\nsingle process (in this process) {single_s:.1f} s; `oracle run --cluster local:{WORKERS}`, {SHARDS} "
          f"shards, one worker killed: {cluster_s:.1f} s")
    assert run.returncode == 0, run.stderr[-3000:]
    assert f"merged from {SHARDS} shards run on local:{WORKERS}" in run.stdout

    assert killed, "the victim shard finished before it could be killed mid-run"
    assert b"ray" in killed["cmdline"].lower(), killed["cmdline"]  # a Ray worker process, not something else
    merged = Record.load(out)
    assert_same_record(merged, single)
    by_shard = {m["shard"][0]: m for m in merged.provenance.extra["merged_from"]}
    assert sorted(by_shard) == list(range(SHARDS))
    victim = by_shard[VICTIM]
    pids = [a["pid"] for a in victim["cluster"]["attempts"]]
    assert len(pids) == 2 and pids[0] == killed["pid"] and victim["cluster"]["pid"] == pids[1] != killed["pid"]
    # the retry continued from the killed attempt's last committed stage (the work dir is shared)
    assert victim["run"]["resumed_from_stage"] >= killed["stage"]
    for i in set(by_shard) - {VICTIM}:
        assert len(by_shard[i]["cluster"]["attempts"]) == 1
    assert merged.provenance.extra["cluster"] == {"address": f"local:{WORKERS}", "shards": SHARDS, "retries": 2}
    assert not (tmp_path / "ref.safetensors.shards").exists()  # shard records removed after the merge


def test_a_shard_that_fails_on_every_attempt_ends_with_a_named_error(tiny, panel_json, tmp_path):
    """A corrupt checkpoint whose headers are valid (a NaN in layer 0's weights, found only when a worker
    reads the layer): every attempt fails the same way, and the run ends once the retries are spent."""
    import shutil

    from safetensors.torch import load_file, save_file

    ck = Path(shutil.copytree(tiny, tmp_path / "ck"))
    name = "layers.0.ffn_norm.weight"
    shard_file = ck / json.loads((ck / INDEX_NAME).read_text())["weight_map"][name]
    tensors = load_file(shard_file)
    tensors[name][3] = float("nan")
    save_file(tensors, shard_file)
    Checkpoint(ck)  # the driver's own validation passes: only reading the values finds the damage

    work = tmp_path / "work"
    run = _cli(ck, panel_json, tmp_path / "ref.safetensors", "--cluster", "local:1", "--retries", "1", "--work",
               str(work), timeout=180)
    assert run.returncode == 2
    assert re.search(rf"error: shard 0/1 failed on all 2 attempts; last: shard 0/1 on .* CheckpointError: "
                     rf".*{name}: 1 non-finite value", run.stderr), run.stderr[-3000:]
    assert len((work / "shard-0-of-1" / ATTEMPTS_LOG).read_text().splitlines()) == 2  # 1 + retries attempts
    assert not (tmp_path / "ref.safetensors").exists()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_bad_cluster_address_is_a_named_error(tiny, panel, tmp_path, capsys):
    for text, why in [("local:0", "positive integer"), ("local:x", "positive integer"), ("nohost", "not a cluster"),
                      ("http://head:6379", "not a cluster"), ("head:99999", "not a cluster")]:
        with pytest.raises(ClusterError, match=f"--cluster '{text}': .*{why}"):
            parse_cluster(text)
    port = _closed_port()
    t = time.perf_counter()
    with pytest.raises(ClusterError, match=rf"--cluster 127\.0\.0\.1:{port}: no Ray cluster answers at "
                                           rf"127\.0\.0\.1:{port} \(Connection refused\)"):
        run_on_cluster(tiny, None, panel, tmp_path / "ref.safetensors", _opts(), f"127.0.0.1:{port}")
    assert time.perf_counter() - t < 10  # refused at once, not after Ray's minutes of reconnecting
    with pytest.raises(ClusterError, match="--cluster auto: cannot connect to Ray .*Could not find any running Ray"):
        run_on_cluster(tiny, None, panel, tmp_path / "ref.safetensors", _opts(), "auto")

    from ds41gates.cli import main

    panel_json = tmp_path / "p.json"
    panel_json.write_text(json.dumps([[1, 2, 3], [4, 5, 6]]))
    base = ["oracle", "run", "--checkpoint", str(tiny), "--panel", str(panel_json), "--out",
            str(tmp_path / "r.safetensors"), "--no-progress"]
    assert main(base + ["--cluster", f"ray://127.0.0.1:{port}"]) == 2
    assert f"no Ray cluster answers at 127.0.0.1:{port}" in capsys.readouterr().err
    assert main(base + ["--cluster", "local:2", "--shard", "0/2"]) == 2
    assert "cannot be combined with --shard" in capsys.readouterr().err
