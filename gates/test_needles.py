"""Gate: needle in a haystack at growing context (gates.md §7).

The panels' length × depth grid (``panels.needles.needle_grid``) capped by the server's max_model_len:
on the CPU profile (2048) the CI lengths in gates/config.toml are small by configuration; production
lengths (8K … 1M) are the same code path (gates/config-production.toml). Chat template, T = 0, fresh
salt per cell, streamed for TTFT. Pass: every needle found (exact substring) and burst == solo at the
largest length.
"""

from __future__ import annotations

import pytest

from core.results import GateEntry, headline
from gates import _engine
from gates.lib import needles

pytestmark = [pytest.mark.gate, pytest.mark.engine]


def _cell(client, tok, case, max_tokens, answer_prefix=""):
    from panels.needles import build_haystack

    hay = build_haystack(tok, case.length, case.depth, case.seed, chat=True, answer_prefix=answer_prefix)
    ids = [int(t) for t in hay.token_ids]
    st = _engine.stream(client, ids, max_tokens, 1, ignore_eos=False, seq_id=f"needle-{case.length}-{case.depth}")
    gen = st.generation
    assert gen.prompt_tokens in (None, len(ids))
    return needles.Cell(case.length, case.depth, case.seed, len(ids), hay.actual_depth, hay.passphrase, gen.text,
                        st.stream.ttft_s), ids, gen


@pytest.fixture(scope="module")
def needle_runs(engine_client, gate_config, engine_facts, gate_tokenizer):
    from panels.needles import needle_grid

    cfg = gate_config.needles
    mml = engine_facts["max_model_len"] or 2048
    grid = needle_grid(mml, lengths=cfg.lengths, depths=cfg.depths, seed=cfg.seed)
    cells, solo = [], {}
    for case in grid:
        cell, ids, gen = _cell(engine_client, gate_tokenizer, case, cfg.max_tokens, cfg.answer_prefix)
        cells.append(cell)
        solo[(case.length, case.depth)] = (ids, gen)
    extra = [n for n in cfg.report_only_lengths if n <= mml - 64]
    report_only = []
    if extra:
        for case in needle_grid(mml, lengths=extra, depths=cfg.depths, seed=cfg.seed):
            report_only.append(_cell(engine_client, gate_tokenizer, case, cfg.max_tokens)[0])
    burst = []
    longest = max(c.length for c in grid)
    for (length, depth), (ids, gen) in solo.items():
        if length != longest or depth != cfg.depths[0]:
            continue
        outs = _engine.together([lambda: _engine.complete(engine_client, ids, cfg.max_tokens, 1, ignore_eos=False)
                                 for _ in range(cfg.burst_copies)])
        for i, o in enumerate(outs):
            burst.append((f"length {length}, depth {depth:g}, copy {i}", tuple(o.token_ids) == tuple(gen.token_ids)))
    return {"cells": cells, "burst": burst, "max_model_len": mml, "grid": grid, "report_only": report_only}


def _heatmap_png(cells, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    lengths = sorted({c.length for c in cells})
    depths = sorted({c.depth for c in cells})
    grid = np.full((len(lengths), len(depths)), np.nan)
    for c in cells:
        grid[lengths.index(c.length), depths.index(c.depth)] = 1.0 if c.passed else 0.0
    fig, ax = plt.subplots(figsize=(1.2 + 0.9 * len(depths), 1.0 + 0.5 * len(lengths)))
    ax.imshow(grid, cmap="RdYlGn", vmin=0, vmax=1, aspect="auto")
    ax.set_xticks(range(len(depths)), [f"{d:g}" for d in depths])
    ax.set_yticks(range(len(lengths)), [str(n) for n in lengths])
    ax.set_xlabel("needle depth")
    ax.set_ylabel("context tokens")
    ax.set_title("needles found")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def test_needles(needle_runs, engine_endpoint, gate_run, gate_config):
    r = needle_runs
    cfg = gate_config.needles
    res = needles.judge(r["cells"], r["burst"], gate_found=cfg.gate_found)
    png = gate_run.folder.needles_heatmap
    _heatmap_png(r["cells"] + r["report_only"], png)
    extra_rows = [{**c.as_row(), "gated": False} for c in r["report_only"]]
    gate_run.add(GateEntry("needles", res.passed, profile=engine_endpoint.profile, failures=res.failures,
                           metrics=headline(res.summary),
                           evidence={"summary": res.summary, "cells": res.rows, "heatmap": res.heatmap,
                                     "max_model_len": r["max_model_len"], "heatmap_png": str(png),
                                     "report_only_cells": extra_rows, "answer_prefix": cfg.answer_prefix,
                                     "report_only_found": f"{sum(c.passed for c in r['report_only'])}/"
                                                          f"{len(r['report_only'])}",
                                     "config": gate_config.for_json("needles")}))
    gate_run.add_section("Needles: length × depth (gates.md §7)",
                         res.heatmap + [{**row, "length": f"{row['length']} (plain question, report-only)"}
                                        for row in needles.heatmap_rows(r["report_only"])],
                         f"{engine_endpoint.profile}: {res.summary['found']}/{res.summary['cells']} found, burst == "
                         f"solo {res.summary['burst_equal']}; grid capped by max_model_len {r['max_model_len']}")
    gate_run.add_section("Needles: cells", [{**row, "gated": True} for row in res.rows] + extra_rows,
                         f"exact substring match of the passphrase; gated cells primed with {cfg.answer_prefix!r}; "
                         "report-only cells ask the plain question (the model's own limit)")
    assert res.summary["cells"] == len(r["grid"]) > 0 and r["burst"]
    assert res.passed, "needle gate failed:\n" + "\n".join(res.failures)


def test_needles_detects_missing_needle(needle_runs, engine_client, gate_config, gate_tokenizer, gate_run):
    """Violation: the filler alone (the needle paragraph cut out of a real haystack) cannot yield the
    passphrase; the gate must report the cell as missed, and judge must fail."""
    from panels.needles import build_haystack

    cfg = gate_config.needles
    case = needle_runs["grid"][0]
    hay = build_haystack(gate_tokenizer, case.length, case.depth, case.seed, chat=True)
    start = hay.needle_token_offset
    ids = [int(t) for t in hay.token_ids]
    piece = next(p for p in hay._pieces if hay.passphrase in p)
    n_needle = len(gate_tokenizer.tokenizer.encode(piece, add_special_tokens=False).ids)
    cut = ids[:start] + ids[start + n_needle:]
    assert gate_tokenizer.tokenizer.decode(cut).count(hay.passphrase) == 0
    if cfg.answer_prefix:  # the same prompt form as the gated cells
        cut += gate_tokenizer.tokenizer.encode(cfg.answer_prefix, add_special_tokens=False).ids
    gen = _engine.complete(engine_client, cut, cfg.max_tokens, 1, ignore_eos=False, seq_id="needle-cut")
    cell = needles.Cell(case.length, case.depth, case.seed, len(cut), hay.actual_depth, hay.passphrase, gen.text)
    res = needles.judge([cell])
    gate_run.add(GateEntry("needles_violation", not res.passed, evidence={"caught": res.failures,
                                                                         "cell": cell.as_row()}))
    assert not cell.passed and not res.passed
    assert "needle missed" in res.failures[0]
