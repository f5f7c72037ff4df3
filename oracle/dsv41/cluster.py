"""A panel run whose shards are scored by the workers of a Ray cluster (`ds41gate oracle run --cluster`).

The driver splits the panel exactly as `--shard I/N` does (shards.select_shard), submits one Ray task per
shard, and joins the returned shard records with shards.merge_records, so the merged record is the one a
single process writes, array for array. Each task opens the checkpoint itself from shared storage and
streams it layer by layer (runner.run_panel); nothing but the shard's panel goes out and its record comes
back. A task whose worker process dies (SIGKILL, OOM killer, lost node) is run again by Ray with the same
task definition, up to `retries` more times; so is one that raised (a deterministic failure therefore ends
as a ClusterError naming the shard and the last error once the attempts are spent, never as a hang).

Why Ray (docs/ORACLE.md, "Shards on a Ray cluster"): vLLM's multi-node serving runs on Ray, so the users
already run and secure Ray clusters; a Ray task runs in a worker *process* of its own, which matches one
shard = one long CPU-bound process holding one layer at a time, and Ray re-executes a task whose process or
node died without any bookkeeping here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import re
import shutil
import socket
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from core.records import Record
from core.version import code_version
from panels.model import EncodedPanel
from panels.pre_encoded import sequences_hash

from .options import RunnerError, RunOptions
from .panel_shards import merge_records, select_shard

ATTEMPTS_LOG = "attempts.jsonl"  # in a shard's work dir: one line per attempt (host, pid, start time)
DEFAULT_RETRIES = 2
CONNECT_TIMEOUT_S = 5.0
MEMORY_MONITOR_ENV = "RAY_memory_monitor_refresh_ms"


class ClusterError(RunnerError):
    """The cluster cannot be reached or used, or a shard failed on every attempt."""


# ----------------------------------------------------------------------------------------------------------
# Where the shards run


@dataclass(frozen=True)
class ClusterSpec:
    """`local:N`: a Ray instance started here with N worker slots (each `threads` CPUs); `auto`: the Ray
    cluster this machine belongs to (RAY_ADDRESS or the running head); `HOST:PORT`: a head node's GCS
    address; `ray://HOST:PORT`: a Ray client server."""

    text: str
    local_workers: int | None = None
    host: str | None = None
    port: int | None = None

    @property
    def address(self) -> str | None:
        if self.local_workers is not None:
            return None
        if self.host is None:
            return "auto"
        return self.text


_HOST_PORT = re.compile(r"^(?:ray://)?(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9][A-Za-z0-9.\-]*):(\d{1,5})$")


def parse_cluster(text: str) -> ClusterSpec:
    forms = "expected local:N, auto, HOST:PORT (a Ray head's GCS port) or ray://HOST:PORT"
    if text.startswith("local:"):
        n = text[len("local:"):]
        if not n.isdigit() or int(n) < 1:
            raise ClusterError(f"--cluster {text!r}: the number of local workers must be a positive integer; {forms}")
        return ClusterSpec(text, local_workers=int(n))
    if text == "auto":
        return ClusterSpec(text)
    m = _HOST_PORT.match(text)
    if not m or not 0 < int(m.group(2)) < 65536:
        raise ClusterError(f"--cluster {text!r}: not a cluster address; {forms}")
    return ClusterSpec(text, host=m.group(1).strip("[]"), port=int(m.group(2)))


def check_reachable(spec: ClusterSpec, timeout: float = CONNECT_TIMEOUT_S) -> None:
    """Ray's own connect retries for minutes against an address where nothing listens; a plain TCP connect
    first turns a wrong address into an immediate, named error."""
    if spec.host is None:
        return
    try:
        with socket.create_connection((spec.host, spec.port), timeout=timeout):
            pass
    except OSError as e:
        why = e.strerror or type(e).__name__
        raise ClusterError(f"--cluster {spec.text}: no Ray cluster answers at {spec.host}:{spec.port} ({why})") from None


@contextlib.contextmanager
def _local_env() -> Iterator[None]:
    """Ray's memory monitor kills workers when the *node's* memory passes 95 %, whoever uses it; on a machine
    shared with other jobs it would kill shards for their memory. A local instance leaves that to the
    kernel. The raylet reads the variable when it starts, so it is set only around ray.init."""
    saved = os.environ.get(MEMORY_MONITOR_ENV)
    os.environ[MEMORY_MONITOR_ENV] = "0"
    try:
        yield
    finally:
        if saved is None:
            del os.environ[MEMORY_MONITOR_ENV]
        else:
            os.environ[MEMORY_MONITOR_ENV] = saved


def _import_ray():
    try:
        import ray
    except ModuleNotFoundError:
        raise ClusterError("--cluster needs Ray: install the project's 'cluster' extra "
                           "(pip install -e '.[cluster]')") from None
    return ray


class Connection:
    """ray.init for the spec; ray.shutdown on leaving the `with` (a local instance stops with it)."""

    def __init__(self, spec: ClusterSpec, cpus_per_worker: int):
        import logging

        check_reachable(spec)
        self.ray = ray = _import_ray()
        if ray.is_initialized():
            raise ClusterError("Ray is already initialised in this process; --cluster manages its own connection")
        kw = dict(logging_level=logging.WARNING, log_to_driver=False)
        try:
            if spec.local_workers is not None:
                with _local_env():
                    ray.init(num_cpus=spec.local_workers * cpus_per_worker, include_dashboard=False, **kw)
            else:
                ray.init(address=spec.address, **kw)
        except (ConnectionError, RuntimeError, ValueError) as e:
            raise ClusterError(f"--cluster {spec.text}: cannot connect to Ray ({e})") from None

    def worker_slots(self, cpus_per_worker: int) -> int:
        """How many shards can run at once: per node, its CPUs // cpus_per_worker."""
        nodes = [n for n in self.ray.nodes() if n.get("Alive")]
        slots = sum(int(n["Resources"].get("CPU", 0)) // cpus_per_worker for n in nodes)
        if slots < 1:
            biggest = max((int(n["Resources"].get("CPU", 0)) for n in nodes), default=0)
            raise ClusterError(f"no node of the cluster has {cpus_per_worker} CPUs for one shard (largest: {biggest}); "
                               f"lower --threads")
        return slots

    def __enter__(self) -> "Connection":
        return self

    def __exit__(self, *exc) -> None:
        self.ray.shutdown()


# ----------------------------------------------------------------------------------------------------------
# One shard, as a task


@dataclass(frozen=True)
class ShardTask:
    checkpoint: str
    pack: str | None
    checkpoint_hash: str  # the driver's view of the build: a node that mounts another one refuses
    panel: EncodedPanel  # the shard's sequences only
    opts: RunOptions  # shard, seq_indices, panel_sequences and threads set
    token_map: np.ndarray | None
    work_dir: str | None  # None: a folder under the worker's temp dir (resume only on the same node)
    job_key: str
    code_version: str

    @property
    def name(self) -> str:
        i, n = self.opts.shard
        return f"shard {i}/{n}"


class ShardFailed(RuntimeError):
    """A shard's attempt failed; only a message crosses the process boundary (the original exception's
    class need not unpickle on the driver)."""


def score_shard(task: ShardTask) -> Record:
    """Run in a Ray worker process: stream the checkpoint through the shard's sequences; the record comes back."""
    host, pid = socket.gethostname(), os.getpid()
    try:
        return _score_shard(task, host, pid)
    except Exception as e:  # noqa: BLE001 - re-raised with its class name, host and pid
        detail = "; ".join(line.strip(" -") for line in str(e).splitlines() if line.strip())
        raise ShardFailed(f"{task.name} on {host} (pid {pid}): {type(e).__name__}: {detail}") from None


def _score_shard(task: ShardTask, host: str, pid: int) -> Record:
    from .checkpoint import Checkpoint
    from .runner import checkpoint_identity, run_panel

    if task.code_version != code_version():
        raise ClusterError(f"the worker runs {code_version()}, the driver {task.code_version}; install the "
                           f"same ds41-gates on every node")
    i, n = task.opts.shard
    work = Path(task.work_dir) if task.work_dir else (Path(tempfile.gettempdir()) / "ds41-oracle-cluster" / task.job_key)
    work = work / f"shard-{i}-of-{n}"
    work.mkdir(parents=True, exist_ok=True)
    attempts = _log_attempt(work / ATTEMPTS_LOG, host, pid)
    ck = Checkpoint(task.checkpoint, task.pack)
    seen = checkpoint_identity(ck)
    if seen != task.checkpoint_hash:
        raise ClusterError(f"the checkpoint at {task.checkpoint} here has identity {seen[:12]}, the driver's "
                           f"{task.checkpoint_hash[:12]}: every node must see the same build")
    rec = run_panel(ck, task.panel, work, task.opts, task.token_map)
    rec.provenance.extra["cluster"] = {"host": host, "pid": pid, "attempts": attempts}
    if not task.opts.keep_work:
        shutil.rmtree(work, ignore_errors=True)
    return rec


def _log_attempt(path: Path, host: str, pid: int) -> list[dict]:
    """Append this attempt to the shard's log and return every attempt it holds (earlier ones on this node
    or on shared storage). A torn last line from a killed writer is skipped."""
    entry = {"host": host, "pid": pid, "started": time.time()}
    with open(path, "a") as f:
        f.write(json.dumps(entry) + "\n")
        f.flush()
        os.fsync(f.fileno())
    out = []
    for line in path.read_text().split("\n"):
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


# ----------------------------------------------------------------------------------------------------------
# The driver


def run_on_cluster(checkpoint: str | os.PathLike, pack: str | os.PathLike | None, panel: EncodedPanel,
                   out: str | os.PathLike, opts: RunOptions, cluster: str, *, shards: int | None = None,
                   retries: int = DEFAULT_RETRIES, work: str | os.PathLike | None = None,
                   token_map: np.ndarray | None = None, log: Callable[[str], None] = lambda msg: None) -> Record:
    """Score `panel` as `shards` shards on the cluster `cluster` (see parse_cluster), each shard retried up
    to `retries` times; write the merged record to `out` and return it. `work`: a folder every worker can
    write (shared storage) for the shards' resumable state; by default each worker uses its temp dir.
    Shard records are kept beside `out` (OUT.shards/) only with opts.keep_work."""
    from .checkpoint import Checkpoint
    from .runner import checkpoint_identity

    if opts.shard is not None:
        raise ClusterError("--cluster splits the panel itself; it cannot be combined with --shard")
    if retries < 0:
        raise ClusterError(f"--retries {retries}: must be >= 0")
    spec = parse_cluster(cluster)
    threads = opts.threads or 1
    ck = Checkpoint(checkpoint, pack)
    ident = checkpoint_identity(ck)
    out = Path(out)
    total = len(panel.sequences)
    with Connection(spec, threads) as conn:
        slots = conn.worker_slots(threads)  # also refuses a task no node could ever take (it would wait forever)
        n = shards or min(total, slots)
        if not 1 <= n <= total:
            raise ClusterError(f"--shards {n}: need 1 <= N <= {total} (the panel's sequences)")
        key = _job_key(ident, pack, panel, dataclasses.replace(opts, threads=threads), n)
        tasks = []
        for i in range(n):
            sub, picked = select_shard(panel, i, n)
            tasks.append(ShardTask(
                checkpoint=str(Path(checkpoint).resolve()), pack=str(Path(pack).resolve()) if pack else None,
                checkpoint_hash=ident, panel=sub,
                opts=dataclasses.replace(opts, threads=threads, shard=(i, n), seq_indices=tuple(picked),
                                         panel_sequences=total, progress=False),
                token_map=token_map, work_dir=str(Path(work).resolve()) if work else None, job_key=key,
                code_version=code_version()))
        remote = conn.ray.remote(score_shard).options(
            num_cpus=threads, num_gpus=1 if opts.device.startswith("cuda") else 0,
            max_retries=retries, retry_exceptions=True)
        log(f"{n} shards of {total} sequences on {spec.text} ({threads} thread(s) each, up to {retries} retries)")
        pending = {remote.remote(t): t for t in tasks}
        shard_dir = out.with_name(out.name + ".shards")
        paths = {}
        while pending:
            ready, _ = conn.ray.wait(list(pending), num_returns=1)
            ref = ready[0]
            task = pending.pop(ref)
            try:
                rec = conn.ray.get(ref)
            except conn.ray.exceptions.RayError as e:
                for other in pending:
                    conn.ray.cancel(other, force=True)
                raise ClusterError(f"{task.name} failed on all {retries + 1} attempts; last: {_cause(e)}") from None
            i = task.opts.shard[0]
            paths[i] = rec.save(shard_dir / f"shard-{i}-of-{n}.safetensors")
            attempts = rec.provenance.extra.get("cluster", {}).get("attempts", [])
            log(f"{task.name} done: {rec.n_sequences} sequences, attempt {len(attempts)} "
                f"on {rec.provenance.extra['cluster']['host']}")
    merged = merge_records([paths[i] for i in range(n)])
    merged.provenance.extra["cluster"] = {"address": spec.text, "shards": n, "retries": retries}
    merged.save(out)
    if not opts.keep_work:
        shutil.rmtree(shard_dir, ignore_errors=True)
    return merged


def _cause(e: BaseException) -> str:
    """The worker's own message for a task error; Ray's summary (with its traceback cut) otherwise."""
    cause = getattr(e, "cause", None)
    if isinstance(cause, BaseException):
        return str(cause)
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def _job_key(ident: str, pack, panel: EncodedPanel, opts: RunOptions, n: int) -> str:
    """Names the default per-worker work dir: a rerun of the same job on the same node resumes there."""
    parts = [ident, str(pack), panel.panel_hash, sequences_hash(panel.sequences), opts.precision, opts.index_k,
             opts.device, str(opts.threads), str(n)]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]
