"""The panel report: report.json, report.md and a self-contained report.html (gates.md §3).

`build_report(evidence, out_dir, extra)` renders a `core.metrics.PanelEvidence`, every metric computed once
beforehand (`score_pair` per pair, as the gate verdict reads it; `score_panel` for records no gate scored),
turns it into one JSON-able dict (`report_data`, pure), renders Markdown and HTML
from that dict with jinja2 templates, and writes the three files as one unit (`write_report_set`: all three
or none, `report.manifest.json` last; `report_set_problems` checks a folder's set).

Text taken from records, panels or `extra` is never trusted: the HTML environment autoescapes, and the
Markdown environment escapes every `{{ ... }}` output through `md_escape` (pipes, angle brackets,
link/emphasis characters, newlines).

The evidence's noise floor is the oracle's other precision mode (for DeepSeek-V4.1: the `reference-bf16`
run beside the `fp32` reference, dsv41-architecture.md §5.5). It is scored against the reference like an
engine, and the report shows its KL_part per domain next to every engine's, with the engine/floor ratio:
an engine cannot be asked to sit closer to the oracle than the oracle's own rounding noise.

`extra` lets later gates add sections without touching this module:

    extra = {
        "Gate verdicts": {
            "note": "bands from bands/v3.toml",          # optional free text, shown above the table
            "rows": [{"gate": "kl_panel", "domain": "code", "verdict": "pass", "mean": 0.012}, ...],
        },
        ...
    }

Each section becomes one table; its columns are the union of the rows' keys in first-seen order.
Values may be numbers, strings, booleans, None, or nested lists/dicts (shown as compact JSON).
Non-finite numbers are written to report.json as null.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import jinja2
import numpy as np

from core.errors import UserError
from core import metrics
from core.atomic import check_file_set, write_file_set
from core.records import Record
from core.redact import redact_data
from core.results_folder import REPORT_HTML, REPORT_JSON, REPORT_MANIFEST, REPORT_MARKDOWN

REPORT_FORMAT = "ds41-report/1"
TEMPLATES = Path(__file__).resolve().parent / "templates"


class ReportError(UserError, ValueError):
    """The report cannot be built from these inputs; the message says which input."""


@dataclass(frozen=True)
class ReportPaths:
    out_dir: Path
    json: Path
    markdown: Path
    html: Path

    @classmethod
    def in_folder(cls, out_dir: str | os.PathLike) -> ReportPaths:
        """The report set of `out_dir`, named as a results folder names it (core.results_folder)."""
        out = Path(out_dir)
        return cls(out_dir=out, json=out / REPORT_JSON, markdown=out / REPORT_MARKDOWN, html=out / REPORT_HTML)


# ---------------------------------------------------------------------------- JSON-safe values

def jsonable(value: Any) -> Any:
    """Plain JSON types only: numpy scalars/arrays unwrapped, tuples to lists, non-finite floats to None."""
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, np.ndarray):
        return [jsonable(v) for v in value.tolist()]
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        f = float(value)
        return f if math.isfinite(f) else None
    if value is None or isinstance(value, str):
        return value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return jsonable(dataclasses.asdict(value))
    return str(value)


# ---------------------------------------------------------------------------- the report's data

def normalise_extra(extra: Mapping[str, Any] | None) -> dict[str, dict]:
    """Check `extra` against {title: {"rows": [dict, ...], "note": str}} and add the column list."""
    if extra is None:
        return {}
    if not isinstance(extra, Mapping):
        raise ReportError(f"extra must be a dict of sections, got {type(extra).__name__}")
    out = {}
    for title, section in extra.items():
        if not isinstance(title, str):
            raise ReportError(f"extra section titles must be strings, got {title!r}")
        if not isinstance(section, Mapping):
            raise ReportError(f"extra section {title!r} must be a dict with 'rows' and optional 'note'")
        unknown = set(section) - {"rows", "note"}
        if unknown:
            raise ReportError(f"extra section {title!r} has unknown keys {sorted(unknown)} (allowed: rows, note)")
        rows = section.get("rows", [])
        if not isinstance(rows, (list, tuple)) or not all(isinstance(r, Mapping) for r in rows):
            raise ReportError(f"extra section {title!r}: 'rows' must be a list of dicts")
        note = section.get("note", "")
        if not isinstance(note, str):
            raise ReportError(f"extra section {title!r}: 'note' must be a string")
        columns = list(dict.fromkeys(str(k) for r in rows for k in r))
        out[title] = {"note": note, "columns": columns,
                      "rows": [jsonable({str(k): v for k, v in r.items()}) for r in rows]}
    return out


def _topk_ties(rec: Record) -> int | None:
    """The DeepSeek-V4.1 oracle's count of top-k selections its tie rule decided (architecture §18.3); None
    for records that do not carry one."""
    ties = (rec.provenance.extra or {}).get("ties")
    return int(ties["total"]) if isinstance(ties, Mapping) and "total" in ties else None


def _record_info(label: str, rec: Record) -> dict:
    return {
        "label": label,
        "topk_ties": _topk_ties(rec),
        "provenance": dataclasses.asdict(rec.provenance),
        "k": rec.k,
        "n_sequences": rec.n_sequences,
        "n_positions": rec.n_positions,
        "full_vocabulary": rec.full_logprobs is not None,
    }


def _noise_floor_data(floor: metrics.PairMetrics, results: Sequence[metrics.PairMetrics], domains: list[str]) -> dict:
    """Per domain and overall: the floor's KL_part and each engine's KL_part as a multiple of it."""
    def ratio(a: float, b: float) -> float:
        return a / b if math.isfinite(a) and math.isfinite(b) and b > 0 else float("nan")

    f = floor.panel
    rows = {d: f.domains[d].kl_part.mean for d in domains}
    return {
        **_record_info(floor.label, floor.engine),
        "metrics": f.as_dict(),
        "kl_part": {"domains": rows, "overall": f.overall.kl_part.mean, "macro": f.macro_kl},
        "engine_ratio": {
            r.label: {"domains": {d: ratio(r.panel.domains[d].kl_part.mean, rows[d]) for d in domains},
                      "overall": ratio(r.panel.overall.kl_part.mean, f.overall.kl_part.mean),
                      "macro": ratio(r.panel.macro_kl, f.macro_kl)}
            for r in results},
    }


def headline(results: Sequence[metrics.PairMetrics], verdicts: Sequence[Mapping[str, Any]] = ()) -> list[dict]:
    """What the report opens with: per engine its verdict (PASS / FAIL / ERROR from the gates, or "not gated"
    when no gate judged it), why, and the headline numbers, KL_part mean, top-1 on decided positions and the
    perplexity ratio, all over the whole panel. A row for "gate session" carries a session-wide ERROR."""
    by_label = {str(v["engine"]): v for v in verdicts}
    rows = []
    for r in results:
        o = r.panel.overall
        v = by_label.pop(r.label, {})
        rows.append({"engine": r.label, "verdict": v.get("verdict", "not gated"), "why": v.get("why", ""),
                     "kl_part_mean": o.kl_part.mean, "top1_decided": o.top1_decided,
                     "ppl_ratio": o.perplexity.get("ratio")})
    rows += [{"engine": str(v["engine"]), "verdict": v["verdict"], "why": v.get("why", ""),
              "kl_part_mean": None, "top1_decided": None, "ppl_ratio": None} for v in by_label.values()]
    return rows


def report_data(evidence: metrics.PanelEvidence, extra: Mapping[str, Any] | None = None, title: str | None = None,
                verdicts: Sequence[Mapping[str, Any]] = ()) -> dict:
    """Everything the report shows, as plain JSON types (pure apart from the creation time): the evidence's
    numbers as they were computed, nothing scored again."""
    reference, results, noise_floor = evidence.reference, evidence.pairs, evidence.noise_floor
    prov = reference.provenance
    domains = list(dict.fromkeys(reference.domains))
    return jsonable({
        "verdicts": headline(results, verdicts),
        "format": REPORT_FORMAT,
        "title": title or f"KL panel report: {prov.panel_name}@{prov.panel_version}",
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "settings": {
            "near_tie_delta": metrics.NEAR_TIE_DELTA,
            "rest_floor": metrics.REST_FLOOR,
            "r20_support": metrics.R20_SUPPORT,
            "confidence_buckets": list(metrics.CONFIDENCE_LABELS),
            "n_boot": evidence.n_boot,
            "seed": evidence.seed,
            "ci_level": 0.95,
        },
        "reference": _record_info("reference", reference),
        "domains": domains,
        "noise_floor": None if noise_floor is None else _noise_floor_data(noise_floor, results, domains),
        "engines": [{**_record_info(r.label, r.engine), "metrics": r.panel.as_dict(),
                     "derived": {"macro_kl_r20": r.macro_kl_r20, "worst_prompt": r.worst_prompt}}
                    for r in results],
        "comparison": evidence.comparison,
        "extra": normalise_extra(extra),
    })


# ---------------------------------------------------------------------------- formatting

_MD_BACKSLASH = re.compile(r"([\\`*_\[\]|#~!])")


class MdSafe(str):
    """Markdown that was produced by the template itself (its own outputs already escaped)."""


def md_escape(value: Any) -> str:
    """Make any text inert inside a Markdown table cell or paragraph."""
    if isinstance(value, MdSafe):
        return value
    text = str(value)
    text = text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    text = _MD_BACKSLASH.sub(r"\\\1", text)
    return re.sub(r"[\r\n\t]+", " ", text)


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def fmt(x: Any, digits: int = 4) -> str:
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, int):
        return f"{x:,}"
    if not _finite(x):
        return "—"
    if x != 0 and (abs(x) < 1e-3 or abs(x) >= 1e6):
        return f"{x:.{max(digits - 1, 1)}e}"
    return f"{x:.{digits}g}"


def fmt_pct(x: Any, digits: int = 2) -> str:
    return f"{100 * x:.{digits}f}%" if _finite(x) else "—"


def fmt_ci(lo: Any, hi: Any) -> str:
    return f"[{fmt(lo)}, {fmt(hi)}]" if _finite(lo) and _finite(hi) else ""


def fmt_p(p: Any) -> str:
    if not _finite(p):
        return "—"
    return f"{p:.2e}" if p < 1e-3 else f"{p:.3f}"


def fmt_cell(value: Any) -> str:
    """A generic `extra` table cell."""
    if value is None:
        return "—"
    if isinstance(value, (bool, int, float)):
        return fmt(value)
    if isinstance(value, (dict, list)):
        return json.dumps(value, sort_keys=True, separators=(",", ":"))
    return str(value)


def fmt_source(source: Mapping[str, Any]) -> list[tuple[str, str]]:
    """Provenance `source` (url, model, profile, flags...) as (key, text) pairs."""
    out = []
    for key, val in source.items():
        text = val if isinstance(val, str) else json.dumps(val, sort_keys=True)
        out.append((str(key), text))
    return out


def _environment(markdown: bool) -> jinja2.Environment:
    if markdown:
        env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(TEMPLATES)), autoescape=False,
                                 undefined=jinja2.StrictUndefined, keep_trailing_newline=True,
                                 trim_blocks=True, lstrip_blocks=True, finalize=md_escape)
    else:
        env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(TEMPLATES)), autoescape=True,
                                 undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True)
    if markdown:
        env.filters["rendered"] = MdSafe  # only for macro output, whose own {{ }} were escaped already
    env.filters.update(fmt=fmt, pct=fmt_pct, ci=fmt_ci, p=fmt_p, cell=fmt_cell, source=fmt_source)
    env.globals.update(finite=_finite)
    return env


def render_markdown(data: dict) -> str:
    return _environment(markdown=True).get_template("report.md.jinja").render(r=data)


def render_html(data: dict, plots: Mapping[str, str]) -> str:
    """`plots`: {title: base64 PNG}; embedded as data: URIs so the file is self-contained."""
    return _environment(markdown=False).get_template("report.html.jinja").render(r=data, plots=plots)


# ---------------------------------------------------------------------------- IO

def build_report(evidence: metrics.PanelEvidence, out_dir: str | os.PathLike, extra: dict | None = None, *,
                 title: str | None = None, extra_plots: Mapping[str, str] | None = None,
                 verdicts: Sequence[Mapping[str, Any]] = ()) -> ReportPaths:
    """Render `evidence` (core.metrics.panel_evidence / score_panel: every number computed already) and write
    report.json, report.md and report.html to `out_dir`.
    `verdicts`: [{"engine": label, "verdict": "PASS" | "FAIL" | "ERROR", "why": text}], the first thing shown."""
    from reports import plots  # matplotlib is imported only when a report is drawn

    data = redact_data(report_data(evidence, extra, title, verdicts))
    images = plots.render_all(data, evidence.pairs)
    images.update(extra_plots or {})   # {caption: base64 PNG} drawn by others (the divergence localizer)
    paths = ReportPaths.in_folder(out_dir)
    write_report_set(paths, json.dumps(data, indent=1, allow_nan=False) + "\n", render_markdown(data),
                     render_html(data, images))
    return paths


def write_report_set(paths: ReportPaths, json_text: str, markdown: str, html: str) -> None:
    """The three files as one unit (core.atomic.write_file_set): all rendered first, then written in full
    beside their targets, renamed, and `report.manifest.json` written last. A failure (a full disk) raises
    OutputWriteError and leaves the previous set whole; never report.json of one run beside report.html of
    another."""
    write_file_set(paths.out_dir, {paths.json.name: json_text.encode("utf-8"),
                                   paths.markdown.name: markdown.encode("utf-8"),
                                   paths.html.name: html.encode("utf-8")}, REPORT_MANIFEST)


def report_set_problems(out_dir: str | os.PathLike) -> list[str]:
    """[] when `out_dir` holds one complete report set (its manifest matches every file), else the reasons."""
    return check_file_set(out_dir, REPORT_MANIFEST)
