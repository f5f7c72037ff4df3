"""The panel report: files, JSON equal to the metrics, self-contained HTML, escaping, comparison, CLI."""

from __future__ import annotations

import base64
import dataclasses
import json
import math
from html.parser import HTMLParser

import numpy as np
import pandas as pd
import pytest
import typer
from scipy import stats
from typer.testing import CliRunner

from core import metrics
from core.metrics import EvidenceError, score_panel
from core.records import Record, RecordMismatch
from reports.cli import report_app
from reports.render import ReportError, build_report, md_escape
from tests.core.recordkit import pair_of_records

N_BOOT = 300
SCRIPT = "<script>alert(1)</script>"
ATTR = '" onmouseover="x'
DOMAINS = ("code", "math", "chat")


def _records(seed: int = 0, noise: float = 0.3, domains=DOMAINS, n_seq: int = 12, length: int = 30):
    return pair_of_records(np.random.default_rng(seed), n_seq=n_seq, length=length, domains=domains, noise=noise)


def _report(ref, engines, out, extra=None, **kw):
    """The report of `engines` scored against `ref` (score_panel), as ds41gate report makes it."""
    return build_report(score_panel(ref, engines, n_boot=N_BOOT), out, extra=extra, **kw)


def _nan_to_none(value):
    """The JSON convention, written independently: non-finite floats become null, tuples lists."""
    if isinstance(value, dict):
        return {k: _nan_to_none(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_nan_to_none(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _strict_json(path):
    def refuse(name):
        raise AssertionError(f"non-standard JSON constant {name} in {path}")
    return json.loads(path.read_text(encoding="utf-8"), parse_constant=refuse)


class _Tags(HTMLParser):
    def __init__(self):
        super().__init__()
        self.tags: list[tuple[str, dict]] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))


def _tags(html: str) -> list[tuple[str, dict]]:
    parser = _Tags()
    parser.feed(html)
    return parser.tags


@pytest.fixture(scope="module")
def one_engine(tmp_path_factory):
    ref, eng, _ = _records()
    out = tmp_path_factory.mktemp("one")
    paths = _report(ref, [("eng", eng)], out)
    return ref, eng, paths


@pytest.fixture(scope="module")
def two_engines(tmp_path_factory):
    ref, eng_a, _ = _records(seed=0, noise=0.3)
    _, eng_b, _ = _records(seed=0, noise=0.45)  # same seed: same tokens and reference, noisier engine
    out = tmp_path_factory.mktemp("two")
    paths = _report(ref, [("base", eng_a), ("cand", eng_b)], out)
    return ref, eng_a, eng_b, paths


# ---------------------------------------------------------------------------- files and numbers

def test_report_files_exist_and_json_numbers_equal_panel_metrics(one_engine):
    ref, eng, paths = one_engine
    for p in (paths.json, paths.markdown, paths.html):
        assert p.is_file() and p.stat().st_size > 0
    assert not list(paths.out_dir.glob("*.partial"))
    data = _strict_json(paths.json)
    expected = _nan_to_none(metrics.panel_metrics(ref, eng, n_boot=N_BOOT).as_dict())
    assert data["engines"][0]["metrics"] == expected
    assert data["engines"][0]["label"] == "eng"
    assert data["settings"]["near_tie_delta"] == metrics.NEAR_TIE_DELTA
    assert data["domains"] == list(DOMAINS)
    assert data["comparison"] is None
    # JSON round-trips: dumping what was read reproduces the same structure.
    assert json.loads(json.dumps(data, allow_nan=False)) == data


def test_json_records_provenance_of_every_record(one_engine):
    ref, eng, paths = one_engine
    data = _strict_json(paths.json)
    assert data["reference"]["provenance"] == dataclasses.asdict(ref.provenance)
    assert data["engines"][0]["provenance"] == dataclasses.asdict(eng.provenance)
    assert data["engines"][0]["n_positions"] == eng.n_positions
    assert data["engines"][0]["k"] == eng.k


def test_worst_prompt_is_the_highest_per_prompt_mean(one_engine):
    ref, eng, paths = one_engine
    data = _strict_json(paths.json)
    pm = metrics.position_metrics(ref, eng)
    frame = pd.DataFrame({"seq": np.asarray(ref.seq_ids)[pm.seq], "domain": pm.domain, "kl": pm.kl_part})
    per_prompt = frame.groupby(["domain", "seq"])["kl"].mean()
    for d in DOMAINS:
        worst = data["engines"][0]["derived"]["worst_prompt"][d]
        assert worst["seq_id"] == per_prompt[d].idxmax()
        assert worst["kl_part_mean"] == pytest.approx(per_prompt[d].max(), rel=1e-12)


def test_markdown_shows_domain_table_and_overall_both_weightings(one_engine):
    ref, eng, paths = one_engine
    md = paths.markdown.read_text(encoding="utf-8")
    pmx = metrics.panel_metrics(ref, eng, n_boot=N_BOOT)
    rows = {line.split("|")[1].strip(): line for line in md.splitlines() if line.startswith("| ")}
    for d in DOMAINS:
        assert f"{pmx.domains[d].kl_part.mean:.4g}" in rows[d]
        assert f"{pmx.domains[d].n_positions}" in rows[d]
    assert f"{pmx.overall.kl_part.mean:.4g}" in rows["all (position-weighted)"]
    assert f"{pmx.macro_kl:.4g}" in rows["all (domain-macro)"]
    assert "Confidence buckets" in md and "Δp statistics" in md
    assert "near-tie δ = 0.05" in md
    # Every domain-table row has the header's column count (no stray pipes).
    header = next(line for line in md.splitlines() if line.startswith("| domain | positions"))
    for d in DOMAINS:
        assert rows[d].count("|") == header.count("|")


# ---------------------------------------------------------------------------- HTML

def test_html_is_self_contained_with_embedded_pngs(one_engine):
    _, _, paths = one_engine
    html = paths.html.read_text(encoding="utf-8")
    tags = _tags(html)
    assert not [t for t, _ in tags if t in ("script", "link", "iframe", "object", "embed")]
    for tag, attrs in tags:
        for name in ("src", "href", "srcset", "data", "action"):
            if name in attrs:
                assert attrs[name].startswith("data:") or attrs[name].startswith("#"), (tag, name, attrs[name][:60])
    assert "url(" not in html and "@import" not in html
    imgs = [a["src"] for t, a in tags if t == "img"]
    assert len(imgs) == 4
    for src in imgs:
        assert src.startswith("data:image/png;base64,")
        assert base64.b64decode(src.split(",", 1)[1])[:8] == b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------------------- escaping

def _hostile_records():
    """Records whose every text field carries HTML, attribute and Markdown injections."""
    ref, eng, _ = _records(domains=(SCRIPT + "|$x_", ATTR, "plain"))

    def poison(rec: Record, side: str) -> Record:
        prov = dataclasses.replace(
            rec.provenance, panel_name="panel" + SCRIPT, panel_version=ATTR, precision="bf16" + SCRIPT,
            code_version="[click](javascript:alert(1))",
            source={"url": "http://e/" + ATTR, "model": SCRIPT, "flags": ["--x=" + SCRIPT, ATTR],
                    "profile": "a|b\nc"} if side == "engine" else {"checkpoint": SCRIPT})
        seq_ids = [f"{SCRIPT}{i}{ATTR}" for i in range(rec.n_sequences)]
        return dataclasses.replace(rec, provenance=prov, seq_ids=seq_ids)

    return poison(ref, "oracle"), poison(eng, "engine")


@pytest.fixture(scope="module")
def hostile(tmp_path_factory):
    ref, eng = _hostile_records()
    extra = {SCRIPT + " section": {"note": "note " + SCRIPT + ATTR,
                                   "rows": [{"who" + SCRIPT: ATTR, "v": 1.5}, {"v": SCRIPT + "|pipe"}]}}
    out = tmp_path_factory.mktemp("hostile")
    return _report(ref, [(SCRIPT, eng), (ATTR, eng)], out, extra=extra)


def test_html_escapes_all_record_text(hostile):
    html = hostile.html.read_text(encoding="utf-8")
    assert "<script" not in html.lower()
    assert ATTR not in html
    for _, attrs in _tags(html):
        assert not any(name.startswith("on") for name in attrs), attrs
    # The text is shown, escaped, not dropped.
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    assert "&#34; onmouseover=&#34;x" in html
    assert "http://e/" in html  # the engine URL appears as text ...
    assert not [a for t, a in _tags(html) if "href" in a]  # ... never as a link


def test_markdown_escapes_all_record_text(hostile):
    md = hostile.markdown.read_text(encoding="utf-8")
    assert "<script" not in md.lower()
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in md
    assert "[click](javascript:" not in md  # link syntax is broken by escaping the brackets
    assert "\\[click\\](javascript:" in md
    # A domain with a pipe keeps its table row intact.
    header = next(line for line in md.splitlines() if line.startswith("| domain | positions"))
    row = next(line for line in md.splitlines() if line.startswith("| &lt;script&gt;") and "\\|$x" in line
               and line.count("|") - line.count("\\|") == header.count("|"))
    assert row
    # The multi-line provenance value stays on one line.
    assert "a\\|b c" in md


def test_md_escape_unit():
    assert md_escape("a|b") == "a\\|b"
    assert md_escape("<b>&") == "&lt;b&gt;&amp;"
    assert md_escape("[x](y)") == "\\[x\\](y)"
    assert md_escape("l1\nl2") == "l1 l2"
    assert md_escape("*_`") == "\\*\\_\\`"


# ---------------------------------------------------------------------------- comparison

def test_comparison_paired_p_equals_scipy_wilcoxon(two_engines):
    ref, eng_a, eng_b, paths = two_engines
    data = _strict_json(paths.json)
    comp = data["comparison"]
    assert comp["baseline"] == "base"
    cand = comp["candidates"][0]
    assert cand["label"] == "cand"

    def per_prompt(eng):
        pm = metrics.position_metrics(ref, eng)
        return pd.Series(pm.kl_part).groupby(pm.seq).mean().to_numpy()

    a, b = per_prompt(eng_a), per_prompt(eng_b)
    d = b - a
    assert cand["overall"]["kl_part"]["wilcoxon_p"] == pytest.approx(stats.wilcoxon(d).pvalue, rel=1e-12)
    assert cand["overall"]["kl_part"]["mean_diff"] == pytest.approx(d.mean(), rel=1e-12)
    assert cand["overall"]["kl_part"]["n_prompts"] == ref.n_sequences
    # Per domain: the same test on that domain's prompts only.
    seq_domain = np.asarray(ref.domains)
    for name in DOMAINS:
        dd = d[seq_domain == name]
        assert cand["domains"][name]["kl_part"]["wilcoxon_p"] == pytest.approx(stats.wilcoxon(dd).pvalue, rel=1e-12)
    closer = sum(data["engines"][1]["metrics"]["domains"][x]["kl_part"]["mean"]
                 < data["engines"][0]["metrics"]["domains"][x]["kl_part"]["mean"] for x in DOMAINS)
    assert cand["closer_domains"] == closer


def test_comparison_section_appears_only_with_two_engines(one_engine, two_engines):
    md_one = one_engine[2].markdown.read_text(encoding="utf-8")
    html_one = one_engine[2].html.read_text(encoding="utf-8")
    md_two = two_engines[3].markdown.read_text(encoding="utf-8")
    html_two = two_engines[3].html.read_text(encoding="utf-8")
    assert "## Comparison" not in md_one and 'id="comparison"' not in html_one
    assert "## Comparison (baseline: base)" in md_two and 'id="comparison"' in html_two
    data = _strict_json(two_engines[3].json)
    p = data["comparison"]["candidates"][0]["overall"]["kl_part"]["wilcoxon_p"]
    assert f"{p:.2e}" in md_two or f"{p:.3f}" in md_two
    assert "domains weighted equally" in md_two and "perplexity on the panel" in md_two


# ---------------------------------------------------------------------------- edge cases and errors

def test_hard_fail_and_infinite_perplexity_give_strict_json(tmp_path):
    ref, eng, _ = _records()
    actual = eng.actual_logprob.copy()
    actual[3] = -np.inf  # the engine gives the actual token q = 0 while p > 0
    eng = dataclasses.replace(eng, actual_logprob=actual)
    paths = _report(ref, [("broken", eng)], tmp_path)
    data = _strict_json(paths.json)
    overall = data["engines"][0]["metrics"]["overall"]
    assert overall["hard_fails"] == 1
    assert overall["perplexity"]["ppl_eng"] is None  # +inf written as null
    assert 'class="bad"' in paths.html.read_text(encoding="utf-8")


def test_extra_sections_render_as_tables(tmp_path):
    ref, eng, _ = _records()
    extra = {"Gate verdicts": {"note": "bands v1", "rows": [{"gate": "kl_panel", "pass": True, "mean": 0.0123},
                                                            {"gate": "needle", "ctx": [8, 32]}]},
             "Empty": {"rows": []}}
    paths = _report(ref, [("e", eng)], tmp_path, extra=extra)
    data = _strict_json(paths.json)
    assert data["extra"]["Gate verdicts"]["columns"] == ["gate", "pass", "mean", "ctx"]
    md = paths.markdown.read_text(encoding="utf-8")
    assert "## Gate verdicts" in md and "bands v1" in md
    assert "| kl\\_panel | yes | 0.0123 | — |" in md
    assert "| needle | — | — | \\[8,32\\] |" in md
    html = paths.html.read_text(encoding="utf-8")
    assert "<h2>Gate verdicts</h2>" in html and "<td class=\"text\">kl_panel</td>" in html
    assert "<h2>Empty</h2>" in html and "(no rows)" in html


@pytest.mark.parametrize("extra, message", [
    ([1, 2], "dict of sections"),
    ({"s": [1]}, "must be a dict"),
    ({"s": {"rows": [1]}}, "list of dicts"),
    ({"s": {"rows": [], "colour": "x"}}, "unknown keys"),
    ({"s": {"rows": [], "note": 3}}, "'note' must be a string"),
])
def test_bad_extra_is_refused_with_a_clear_error(tmp_path, extra, message):
    ref, eng, _ = _records()
    with pytest.raises(ReportError, match=message):
        _report(ref, [("e", eng)], tmp_path, extra=extra)
    assert not (tmp_path / "report.json").exists()


def test_duplicate_labels_and_no_engines_are_refused(tmp_path):
    ref, eng, _ = _records()
    with pytest.raises(EvidenceError, match="unique"):
        _report(ref, [("x", eng), ("x", eng)], tmp_path)
    with pytest.raises(EvidenceError, match="at least one"):
        _report(ref, [], tmp_path)


def test_incompatible_engine_record_is_named(tmp_path):
    ref, eng, _ = _records()
    other = dataclasses.replace(eng, provenance=dataclasses.replace(eng.provenance, panel_hash="q" * 64))
    with pytest.raises(RecordMismatch, match="engine record 'bad'.*panel hash"):
        _report(ref, [("ok", eng), ("bad", other)], tmp_path)


# ---------------------------------------------------------------------------- CLI

def _cli() -> typer.Typer:
    app = typer.Typer()
    app.command()(report_app)
    return app


def test_cli_writes_report_and_prints_summary(tmp_path):
    ref, eng_a, _ = _records(noise=0.3)
    _, eng_b, _ = _records(noise=0.45)
    ref.save(tmp_path / "ref.safetensors")
    eng_a.save(tmp_path / "a.safetensors")
    eng_b.save(tmp_path / "b.safetensors")
    out = tmp_path / "out"
    result = CliRunner().invoke(_cli(), [str(tmp_path / "ref.safetensors"), str(tmp_path / "a.safetensors"),
                                         str(tmp_path / "b.safetensors"), "--out", str(out),
                                         "--label", "[bold]A", "--label", "B", "--n-boot", "200"],
                                terminal_width=200)
    assert result.exit_code == 0, result.output
    for name in ("report.json", "report.md", "report.html"):
        assert (out / name).is_file()
        assert str(out / name) in result.output
    assert "[bold]A" in result.output  # labels are printed literally, not read as rich markup
    assert "Wilcoxon p vs first" in result.output
    data = _strict_json(out / "report.json")
    assert [e["label"] for e in data["engines"]] == ["[bold]A", "B"]


def test_cli_label_count_mismatch_and_bad_record(tmp_path):
    ref, eng, _ = _records()
    ref.save(tmp_path / "ref.safetensors")
    eng.save(tmp_path / "e.safetensors")
    runner = CliRunner()
    r = runner.invoke(_cli(), [str(tmp_path / "ref.safetensors"), str(tmp_path / "e.safetensors"),
                               "--label", "a", "--label", "b"], terminal_width=200)
    assert r.exit_code == 2 and "--label" in r.output
    (tmp_path / "junk.safetensors").write_bytes(b"not a record")
    r = runner.invoke(_cli(), [str(tmp_path / "ref.safetensors"), str(tmp_path / "junk.safetensors"),
                               "--out", str(tmp_path / "o")], terminal_width=200)
    assert r.exit_code == 2
    assert "not a readable record file" in r.output
    assert not (tmp_path / "o" / "report.json").exists()


def test_cli_default_labels_are_unique_stems(tmp_path):
    ref, eng, _ = _records()
    ref.save(tmp_path / "ref.safetensors")
    (tmp_path / "x").mkdir()
    eng.save(tmp_path / "e.safetensors")
    eng.save(tmp_path / "x" / "e.safetensors")
    out = tmp_path / "out"
    r = CliRunner().invoke(_cli(), [str(tmp_path / "ref.safetensors"), str(tmp_path / "e.safetensors"),
                                    str(tmp_path / "x" / "e.safetensors"), "-o", str(out), "--n-boot", "100"],
                           terminal_width=200)
    assert r.exit_code == 0, r.output
    assert [e["label"] for e in _strict_json(out / "report.json")["engines"]] == ["e", "e#2"]


def test_cli_noise_floor_is_shown_beside_each_engine_and_engine_records_are_refused(tmp_path):
    ref, eng, full = _records(noise=0.3)
    _, floor_eng, _ = _records(noise=0.1)  # same seed: same tokens; a closer "oracle in bf16"
    floor = dataclasses.replace(floor_eng, provenance=dataclasses.replace(
        floor_eng.provenance, side="oracle", precision="reference-bf16"))
    for name, rec in (("ref", ref), ("eng", eng), ("floor", floor), ("floor_engine_side", floor_eng)):
        rec.save(tmp_path / f"{name}.safetensors")
    args = [str(tmp_path / "ref.safetensors"), str(tmp_path / "eng.safetensors"), "--n-boot", "200"]
    result = CliRunner().invoke(_cli(), args + ["--out", str(tmp_path / "out"),
                                               "--noise-floor", str(tmp_path / "floor.safetensors")])
    assert result.exit_code == 0, result.output
    data = _strict_json(tmp_path / "out" / "report.json")
    nf = data["noise_floor"]
    assert nf["label"] == "oracle reference-bf16"
    expected = metrics.panel_metrics(ref, floor, n_boot=200)
    for d in DOMAINS:
        assert nf["kl_part"]["domains"][d] == pytest.approx(expected.domains[d].kl_part.mean)
        engine_kl = data["engines"][0]["metrics"]["domains"][d]["kl_part"]["mean"]
        assert nf["engine_ratio"]["eng"]["domains"][d] == pytest.approx(engine_kl / expected.domains[d].kl_part.mean)
        assert nf["engine_ratio"]["eng"]["domains"][d] > 1  # noise 0.3 sits above a 0.1 floor
    md = (tmp_path / "out" / "report.md").read_text()
    assert "## KL_part beside the oracle noise floor" in md

    bad = CliRunner().invoke(_cli(), args + ["--out", str(tmp_path / "bad"),
                                             "--noise-floor", str(tmp_path / "floor_engine_side.safetensors")])
    assert bad.exit_code == 2
    assert "is an 'engine' record" in bad.output
    assert not (tmp_path / "bad" / "report.json").exists()


def test_the_report_opens_with_the_verdicts_and_headline_numbers(tmp_path):
    """Verdicts first (before provenance), each engine's headline numbers equal to its panel metrics; a gate
    session's ERROR is a row of its own; an engine no gate judged says so instead of passing."""
    from core.verdicts import PanelGateResult
    from ds41gates.pipeline import write_report

    ref, eng, _ = _records()
    gate = PanelGateResult("e", "vllm-cpu-fp32", False, ["code: KL_part mean 0.3 > 0.01"], [], {})
    paths = write_report(ref, [("e", eng), ("other", eng)], tmp_path, [gate], errored=["test_prefix_cache"])
    data = _strict_json(paths.json)
    rows = {v["engine"]: v for v in data["verdicts"]}
    assert rows["e"]["verdict"] == "FAIL" and "KL_part mean 0.3" in rows["e"]["why"]
    assert rows["e"]["kl_part_mean"] == pytest.approx(data["engines"][0]["metrics"]["overall"]["kl_part"]["mean"])
    assert rows["other"]["verdict"] == "not gated"
    assert rows["gate session"]["verdict"] == "ERROR" and "test_prefix_cache" in rows["gate session"]["why"]
    html = paths.html.read_text(encoding="utf-8")
    assert html.index('<h2 id="verdicts">Verdicts</h2>') < html.index('<h2 id="provenance">')
    assert "<b>FAIL</b>" in html and "<b>ERROR</b>" in html
    md = paths.markdown.read_text(encoding="utf-8")
    assert md.index("## Verdicts") < md.index("## Provenance") and "| e | **FAIL** |" in md


def test_write_report_renders_the_pair_each_gate_scored_and_scores_only_the_rest(tmp_path, monkeypatch):
    """Metrics are computed once per pair: the gated engine's numbers are the ones its verdict carries (nothing
    scored again); an engine no gate judged is scored for the report; a restriction to fewer sequences makes
    another pair, scored anew."""
    import core.metrics.pair as pair_mod
    from core.verdicts import judge
    from ds41gates.pipeline import write_report
    from gates import BANDS_FILE

    ref, eng, _ = _records()
    _, other, _ = _records(noise=0.45)
    panel, gate = judge(ref, eng, "default", "e", BANDS_FILE)
    scored = []
    real = pair_mod.panel_metrics
    monkeypatch.setattr(pair_mod, "panel_metrics", lambda r, e, **kw: scored.append(e) or real(r, e, **kw))
    data = _strict_json(write_report(ref, [("e", eng)], tmp_path / "one", [gate]).json)
    assert scored == []
    assert data["engines"][0]["metrics"] == _nan_to_none(panel.as_dict())
    assert data["engines"][0]["derived"]["worst_prompt"] == gate.pair.worst_prompt

    write_report(ref, [("e", eng), ("other", other)], tmp_path / "two", [gate])
    assert scored == [other]
    scored.clear()
    write_report(ref, [("e", eng), ("short", other.subset(other.seq_ids[1:]))], tmp_path / "three", [gate])
    assert len(scored) == 2   # both restricted to the sequences every engine scored: two new pairs
