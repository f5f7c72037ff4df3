"""`ds41gate panel list | show | stats`."""

from __future__ import annotations

import re

from typer.testing import CliRunner

from panels.cli import panel_app

runner = CliRunner()
HASH = "sha256:22befc9e93c02d268ffd14112b98ada2177899088b10dab2cd94655e1a2a5200"


def test_list_shows_default_with_hash():
    r = runner.invoke(panel_app, ["list"])
    assert r.exit_code == 0, r.output
    assert "default@1" in r.output
    assert HASH[:30] in r.output.replace("\n", "").replace("│", "").replace(" ", "")


def test_show_lists_every_item():
    r = runner.invoke(panel_app, ["show", "default@1"])
    assert r.exit_code == 0, r.output
    assert "(verified)" in r.output
    for item_id in ("code-01-ttl-cache", "agentic-01-failing-test", "multilingual-01-zh-tea", "structured-04-csv"):
        assert item_id in r.output


def _domain_counts(output: str) -> dict[str, int]:
    rows = re.findall(r"│\s*([a-z]+)\s*│\s*(\d+)\s*│\s*(\d+)\s*│\s*(\d+)\s*│", output)
    return {d: int(scored) for d, _items, _tokens, scored in rows}


def test_stats_smollm2_is_balanced():
    r = runner.invoke(panel_app, ["stats", "default", "--tokenizer", "smollm2"])
    assert r.exit_code == 0, r.output
    counts = _domain_counts(r.output)
    total = counts.pop("total")
    assert len(counts) == 8 and sum(counts.values()) == total
    mean = total / 8
    assert all(abs(n / mean - 1) <= 0.25 for n in counts.values()), counts


def test_stats_deepseek_needs_explicit_split_markers():
    r = runner.invoke(panel_app, ["stats", "default", "-t", "deepseek"])
    assert r.exit_code == 2
    assert "--allow-split-markers" in r.output
    r = runner.invoke(panel_app, ["stats", "default", "-t", "deepseek", "--allow-split-markers"])
    assert r.exit_code == 0, r.output
    assert len(_domain_counts(r.output)) == 9
    assert "split into ordinary tokens" in r.output


def test_errors_are_clean():
    r = runner.invoke(panel_app, ["show", "nope"])
    assert r.exit_code == 2 and "unknown panel 'nope'" in r.output
    r = runner.invoke(panel_app, ["stats", "default", "-t", "/does/not/exist"])
    assert r.exit_code == 2 and "not 'smollm2'" in r.output
