"""gates.lib.needles: exact-substring verdict, dash normalisation, heatmap rows, burst."""

from gates.lib import needles


def _cell(n, d, answer, pp="amber-onyx-1234-quill"):
    return needles.Cell(n, d, 0, n, d, pp, answer)


def test_found_is_exact_substring_after_dash_normalisation():
    assert needles.found("The passphrase is amber\u2013onyx-1234-quill.", "amber-onyx-1234-quill")
    assert not needles.found("amber-onyx-1235-quill", "amber-onyx-1234-quill")
    assert not needles.found("Amber-onyx-1234-quill", "amber-onyx-1234-quill")


def test_judge_table_and_heatmap():
    cells = [_cell(512, 0.1, "amber-onyx-1234-quill"), _cell(512, 0.9, "no idea"), _cell(1024, 0.1, "amber-onyx-1234-quill")]
    res = needles.judge(cells, [("burst", True)])
    assert not res.passed and len(res.failures) == 1 and "depth 0.9" in res.failures[0]
    assert res.heatmap == [{"length": 512, "depth 0.1": "✓", "depth 0.9": "✗"},
                           {"length": 1024, "depth 0.1": "✓", "depth 0.9": ""}]
    assert needles.judge(cells[:1] + cells[2:], [("burst", True)]).passed
    assert not needles.judge(cells[:1], [("burst", False)]).passed
    assert not needles.judge([]).passed


def test_a_model_that_cannot_retrieve_is_gated_on_burst_only():
    misses = [_cell(512, 0.5, "ments glances neutral"), _cell(1024, 0.5, "no idea")]
    res = needles.judge(misses, [("burst", True)], gate_found=False)
    assert res.passed and res.summary["found"] == 0 and res.summary["found_gated"] is False
    assert len(res.rows) == 2                     # the misses stay in the report
    assert not needles.judge(misses, [("burst", False)], gate_found=False).passed
    assert not needles.judge(misses, [("burst", True)]).passed   # the default gates what was found
