"""The results folder of one gate run: the one object that names every file a run writes, and the only way the
harness writes or reads them.

A run claims its folder once (`ResultsFolder.claim` for a given ``--results`` / ``--out``, `ResultsFolder.fresh`
for the default ``results/<timestamp>``): the folder then holds that run only, marked and locked for as long as
the run lives (the refusals are below, docs/RELIABILITY.md "Verdict integrity"). A reader of a finished
run (the nightly reading a cell, `ds41gate report`) opens it with `ResultsFolder.of` and claims nothing.

What lies in a results folder::

    .ds41-results, .ds41-results.lock     the run's marker and lock (RunMarker)
    results.json                          core.results.GateResults, rewritten after every gate
    report.json, report.md, report.html   the session report (reports/render.py), report.manifest.json last
    per_prompt.json                       PerPrompt: each engine record's per-prompt mean KL_part (--per-prompt-metrics)
    engine-<label>.safetensors            the engine records the gates scored (core.records.Record)
    junit.xml, pytest.log                 what the nightly asks its cell's pytest for
    needles_heatmap.png                   the needles gate's figure
    vision_tower.json, vision-tower-work/ the vision tower gate's verdict evidence and its engine's scratch folder
    kernels.json, kernels-work/           the kernel gate's verdicts and its engine runner's scratch folder
    engine_bench.json, engine_bench.png   the speed bench's measurements and figure
    evals/                                the task evals' generations and eval records (evals/run.py)
    localize/, localize-flag-<F>/         the localizer's output for a failed panel gate, for a failed flag

Every name that comes from outside (an engine label, a flag, an eval suite) goes through `core.paths.safe_name`, so
no file of a run lies outside its folder.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import os
import shutil
import socket
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import pydantic
from pydantic import ConfigDict, Field, TypeAdapter
from pydantic.dataclasses import dataclass as typed_record
from filelock import FileLock, Timeout

from core import paths
from core.atomic import make_folder
from core.errors import ResultsDirError
from core.atomic import write_json_atomic
from core.errors import UserError
from core.results import FILE_NAME as RESULTS_FILE
from core.results import GateResults, json_object

if TYPE_CHECKING:
    from core.records import Record

PER_PROMPT_FORMAT = "ds41-per-prompt/1"

# the report set's file names (reports/render.py writes them as one unit, the manifest last)
REPORT_JSON = "report.json"
REPORT_MARKDOWN = "report.md"
REPORT_HTML = "report.html"
REPORT_MANIFEST = "report.manifest.json"


class PerPromptError(UserError, ValueError):
    """A per_prompt.json cannot be read as `ds41-per-prompt/1`; the message names the file and what it found."""


_STRICT = ConfigDict(extra="forbid", strict=True)


@typed_record(frozen=True, config=_STRICT)
class PromptMeans:
    """One engine record against the reference: the mean KL_part of each prompt (None where the prompt has no
    finite, unambiguous position) and how many of its positions are a hard fail (infinite KL_part)."""

    kl_part: tuple[float | None, ...] = Field(strict=False)
    hard_fails: int = Field(ge=0)


@typed_record(frozen=True, config=_STRICT)
class PerPrompt:
    """per_prompt.json: the per-prompt series the nightly history keeps per engine record (paired trends)."""

    seq_ids: tuple[str, ...] = Field(strict=False)
    domains: tuple[str, ...] = Field(strict=False)
    engines: dict[str, PromptMeans] = dataclasses.field(default_factory=dict)
    format: Literal["ds41-per-prompt/1"] = PER_PROMPT_FORMAT

    @classmethod
    def of(cls, reference: Record, engines: Sequence[tuple[str, Record]]) -> PerPrompt:
        """Each engine record's per-prompt mean KL_part against `reference` (pure)."""
        import numpy as np

        from core import metrics

        means_by_label = {}
        for label, rec in engines:
            pm = metrics.position_metrics(reference, rec)
            keep = np.isfinite(pm.kl_part) & ~pm.ambiguous
            means = metrics.per_prompt_means(pm.kl_part[keep], pm.seq[keep], len(reference.seq_ids))
            means_by_label[label] = PromptMeans(tuple(float(m) if np.isfinite(m) else None for m in means),
                                                int(np.sum(~np.isfinite(pm.kl_part))))
        return cls(tuple(reference.seq_ids), tuple(reference.domains), means_by_label)

    def to_data(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, text: str, where: str) -> PerPrompt:
        refused = f"{where}: not a {PER_PROMPT_FORMAT} file"
        data = json_object(text, refused, PerPromptError)
        if data.get("format") != PER_PROMPT_FORMAT:
            raise PerPromptError(f"{refused}: format {data.get('format')!r:.60}")
        try:
            return _PER_PROMPT.validate_json(text, strict=True)
        except pydantic.ValidationError as exc:
            first = exc.errors()[0]
            key = ".".join(str(p) for p in first["loc"]) or "top level"
            raise PerPromptError(f"{refused}: {key}: {first['msg'].lower()}") from None


_PER_PROMPT = TypeAdapter(PerPrompt)


@typed_record(frozen=True, config=ConfigDict(extra="ignore", strict=True))
class RunMarker:
    """What the harness wrote into `.ds41-results` when a run claimed the folder (`_write_marker`)."""

    format: Literal["ds41-results-dir/1"]
    run_id: str
    pid: int | None = None
    host: str | None = None
    created: str | None = None


# ------------------------------------------------------------------- claiming a folder for one run (the rules)

RUN_MARKER = ".ds41-results"            # written by the harness when it claims a folder: {format, run_id, ...}
RUN_LOCK = ".ds41-results.lock"         # held (filelock) for as long as the run that claimed the folder lives
MARKER_FORMAT = "ds41-results-dir/1"
# the locks this process holds, by folder: released by `_release` (or when the process ends)
_HELD: dict[Path, FileLock] = {}


def _describe(entries: list[str]) -> str:
    shown = sorted(entries)[:5]
    return ", ".join(shown) + (f" and {len(entries) - 5} more" if len(entries) > 5 else "")


def _read_marker(folder: Path) -> dict | None:
    """The run marker of `folder` when it is one the harness wrote (a plain file, a JSON object of
    MARKER_FORMAT with a run id), else None: a file merely named like it marks nothing."""
    marker = folder / RUN_MARKER
    if marker.is_symlink() or not marker.is_file():
        return None
    try:
        doc = json.loads(marker.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict) or doc.get("format") != MARKER_FORMAT or not isinstance(doc.get("run_id"), str):
        return None
    return doc


def _holder(folder: Path) -> str:
    doc = _read_marker(folder)
    if doc is None:
        return "a run that has not written its marker yet"
    return (f"run {doc.get('run_id')} (pid {doc.get('pid')} on {doc.get('host')}, since "
            f"{doc.get('created')})")


def _lock(folder: Path, option: str) -> None:
    """Take this folder's run lock without waiting; held by another live run: ResultsDirError naming it."""
    folder = folder.resolve()
    if folder in _HELD:
        raise ResultsDirError(f"{option} {folder}: this process already holds it for another run")
    lock = FileLock(folder / RUN_LOCK, timeout=0, thread_local=False)
    try:
        lock.acquire()
    except Timeout:
        raise ResultsDirError(f"{option} {folder}: in use by {_holder(folder)}; a results folder holds one run "
                              "at a time — wait for it to finish, or choose another folder") from None
    _HELD[folder] = lock


def _release(folder: str | os.PathLike) -> None:
    """Let go of the run lock this process took on `folder` (a no-op when it holds none)."""
    lock = _HELD.pop(Path(folder).resolve(), None)
    if lock is not None:
        lock.release(force=True)


def _claim(path: str | os.PathLike, *, replace: bool = False, option: str = "--results",
                      replace_option: str = "--replace-results") -> Path:
    """Make `path` the folder of exactly one run, locked for this process, and return it.

    Absent: created. Empty: used. Holding anything: refused (ResultsDirError) unless `replace`, and then only
    when it carries the run marker a harness run wrote when it claimed it (a folder merely holding a
    results.json or report.json — a checkout, `.git/` — is never cleared); its contents are removed first, so
    no file of the earlier run (a PASS report beside this run's ERROR) survives. The folder's run lock (a
    filelock) is taken before anything is removed and held until `_release` or the end of the
    process, so a second run on the same folder, with or without `replace`, is refused naming the holder.
    Call this only after the run's own inputs are checked: a run that stops on a bad input clears nothing."""
    folder = Path(path)
    make_folder(folder, ResultsDirError, f"{option} {folder}")
    if RUN_LOCK not in os.listdir(folder):      # not yet a run's folder: refused before a lock file is made in it
        _refuse_unless_claimable(folder, os.listdir(folder), replace, option, replace_option)
    _lock(folder, option)                        # a run still holding it is named, with or without `replace`
    try:
        entries = [e for e in os.listdir(folder) if e != RUN_LOCK]
        _refuse_unless_claimable(folder, entries, replace, option, replace_option)  # again, now that it is ours
        for entry in entries:
            p = folder / entry
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            else:
                p.unlink()
        _write_marker(folder, option)
    except BaseException:
        _release(folder)
        raise
    return folder


def _check(path: str | os.PathLike | None, *, replace: bool = False, option: str = "--results",
                      replace_option: str = "--replace-results") -> None:
    """`_claim`'s refusals without touching anything (no folder made, nothing cleared, no lock): a
    caller whose inputs take a while to check refuses a reused folder before that work, and claims it after."""
    if path is None:
        return
    folder = Path(path)
    if folder.exists() and not folder.is_dir():
        raise ResultsDirError(f"{option} {folder}: exists and is not a folder")
    if folder.is_dir():
        _refuse_unless_claimable(folder, os.listdir(folder), replace, option, replace_option)


def _refuse_unless_claimable(folder: Path, entries: list[str], replace: bool, option: str,
                             replace_option: str) -> None:
    entries = [e for e in entries if e != RUN_LOCK]
    if not entries:
        return
    if not replace:
        raise ResultsDirError(
            f"{option} {folder}: folder is not empty ({_describe(entries)}); a results folder holds one run — "
            f"choose a new folder, or pass {replace_option} to clear it first")
    if _read_marker(folder) is None:
        raise ResultsDirError(
            f"{option} {folder}: folder is not empty and carries no ds41-gates run marker ({RUN_MARKER}); "
            f"{replace_option} clears only a folder an earlier run claimed — refusing to clear it")


def _write_marker(folder: Path, option: str) -> None:
    try:
        fd = os.open(folder / RUN_MARKER, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        raise ResultsDirError(f"{option} {folder}: another run claimed this folder at the same time") from None
    with os.fdopen(fd, "w") as fh:
        json.dump({"format": MARKER_FORMAT, "run_id": uuid.uuid4().hex[:12], "pid": os.getpid(),
                   "host": socket.gethostname(),
                   "created": _dt.datetime.now().astimezone().isoformat(timespec="seconds")}, fh)
        fh.flush()
        os.fsync(fh.fileno())


def _fresh(root: str | os.PathLike = "results", stem: str | None = None) -> Path:
    """A new folder `root/<stem or timestamp>[-N]` that no other run has used (created exclusively)."""
    base = Path(root)
    stem = stem or _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    base.mkdir(parents=True, exist_ok=True)
    n = 1
    while True:
        folder = base / (stem if n == 1 else f"{stem}-{n}")
        try:
            folder.mkdir()
        except FileExistsError:
            n += 1
            continue
        _lock(folder, "results folder")
        _write_marker(folder, "results folder")
        return folder




@dataclasses.dataclass(frozen=True)
class ResultsFolder:
    """One run's results folder. Made by `claim` / `fresh` (this process's run: marked and locked until
    `release`) or `of` (a finished run's, to read)."""

    path: Path

    # ------------------------------------------------------------------ claiming (the rules above)
    @classmethod
    def claim(cls, path: str | os.PathLike, *, replace: bool = False, option: str = "--results",
              replace_option: str = "--replace-results") -> ResultsFolder:
        """`path` made this run's folder: absent or empty, or — with `replace` — an earlier run's folder cleared
        first; anything else is a ResultsDirError naming `option`. Call it after the run's inputs are checked."""
        return cls(_claim(path, replace=replace, option=option, replace_option=replace_option))

    @classmethod
    def fresh(cls, root: str | os.PathLike = "results", stem: str | None = None) -> ResultsFolder:
        """A new `root/<stem or timestamp>[-N]` no other run has used, claimed for this run."""
        return cls(_fresh(root, stem))

    @classmethod
    def claim_or_fresh(cls, path: str | os.PathLike | None, *, replace: bool = False, option: str = "--results",
                       replace_option: str = "--replace-results") -> ResultsFolder:
        """`claim(path)` when a folder is given, else a `fresh` one under results/."""
        if path:
            return cls.claim(path, replace=replace, option=option, replace_option=replace_option)
        return cls.fresh()

    @staticmethod
    def check(path: str | os.PathLike | None, *, replace: bool = False, option: str = "--results",
              replace_option: str = "--replace-results") -> None:
        """`claim`'s refusals without touching anything: refuse a reused folder before slow input checks."""
        _check(path, replace=replace, option=option, replace_option=replace_option)

    @classmethod
    def of(cls, path: str | os.PathLike) -> ResultsFolder:
        """A finished run's folder, to read its files; nothing is claimed or made."""
        return cls(Path(path))

    def release(self) -> None:
        """Let go of this run's lock on the folder (a no-op when this process holds none)."""
        _release(self.path)

    @property
    def marker_file(self) -> Path:
        return self.path / RUN_MARKER

    def holds_a_run(self) -> bool:
        """Whether a gate run wrote here: results.json, or a file named as the run marker (even one that marks
        nothing: a folder that looks like a run's is not another tool's to write into)."""
        return self.results_file.exists() or self.marker_file.exists()

    def marker(self) -> RunMarker | None:
        """The run marker, when one the harness wrote is there (a file merely named like it marks nothing)."""
        doc = _read_marker(self.path)
        return None if doc is None else RunMarker(**doc)

    # ------------------------------------------------------------------ names
    @property
    def results_file(self) -> Path:
        return self.path / RESULTS_FILE

    @property
    def per_prompt_file(self) -> Path:
        return self.path / "per_prompt.json"

    @property
    def junit_file(self) -> Path:
        return self.path / "junit.xml"

    @property
    def pytest_log(self) -> Path:
        return self.path / "pytest.log"

    @property
    def report_json(self) -> Path:
        return self.path / REPORT_JSON

    @property
    def report_markdown(self) -> Path:
        return self.path / REPORT_MARKDOWN

    @property
    def report_html(self) -> Path:
        return self.path / REPORT_HTML

    @property
    def needles_heatmap(self) -> Path:
        return self.path / "needles_heatmap.png"

    @property
    def vision_tower_file(self) -> Path:
        return self.path / "vision_tower.json"

    @property
    def vision_tower_work(self) -> Path:
        return self.path / "vision-tower-work"

    @property
    def kernels_file(self) -> Path:
        return self.path / "kernels.json"

    @property
    def kernels_work(self) -> Path:
        return self.path / "kernels-work"

    @property
    def engine_bench_file(self) -> Path:
        return self.path / "engine_bench.json"

    @property
    def engine_bench_plot(self) -> Path:
        return self.path / "engine_bench.png"

    @property
    def evals_dir(self) -> Path:
        return self.path / "evals"

    @property
    def localize_dir(self) -> Path:
        return self.path / "localize"

    def localize_flag_dir(self, flag: str) -> Path:
        return self.path / f"localize-flag-{paths.safe_name(flag, 'flag')}"

    def engine_record_file(self, label: str) -> Path:
        return self.path / f"engine-{paths.safe_name(label, 'engine label')}.safetensors"

    def eval_record_file(self, suite: str) -> Path:
        return self.evals_dir / eval_record_name(suite)

    # ------------------------------------------------------------------ writing and reading
    def write_results(self, results: GateResults) -> None:
        results.save(self.results_file)

    def read_results(self) -> GateResults:
        """results.json (a ResultsError naming the file when absent or not `ds41-results/1`)."""
        return GateResults.load(self.results_file)

    def write_per_prompt(self, per_prompt: PerPrompt) -> None:
        write_json_atomic(self.per_prompt_file, per_prompt.to_data())

    def read_per_prompt(self) -> PerPrompt | None:
        """per_prompt.json, or None when the run wrote none; an unreadable one is a PerPromptError."""
        try:
            text = self.per_prompt_file.read_text(encoding="utf-8")
        except FileNotFoundError:
            return None
        except (OSError, UnicodeDecodeError) as exc:
            raise PerPromptError(f"{self.per_prompt_file}: cannot read it ({exc})") from None
        return PerPrompt.from_json(text, str(self.per_prompt_file))

    def save_engine_record(self, label: str, record: Record) -> Path:
        path = self.engine_record_file(label)
        record.save(path)
        return path

    def load_engine_record(self, label: str) -> Record:
        from core.records import Record

        return Record.load(self.engine_record_file(label))


def eval_record_name(suite: str) -> str:
    """The eval record of one suite (evals/run.py): `<suite>.eval.json`, a `+` spelled `plus`."""
    return f"{_suite_stem(suite)}.eval.json"


def generations_name(suite: str) -> str:
    """The resumable generations of one suite (evals/run.py): `<suite>.generations.jsonl`."""
    return f"{_suite_stem(suite)}.generations.jsonl"


def _suite_stem(suite: str) -> str:
    return paths.safe_name(suite.replace("+", "plus"), "eval suite")
