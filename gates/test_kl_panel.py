"""Gate: per-domain KL panel (gates.md §3) — the engine's prompt logprobs against the fp32 oracle.

Pass rule per domain: mean and p99 KL_part, top-1 on decided positions and |ln PPL ratio| within the
profile's bands (its [gate] table's bands file; gates/bands.toml by default), and no infinite position. Guards every `numerics` flag.
"""

import pytest

from core.results import GateEntry, headline
from core.verdicts import judge

pytestmark = [pytest.mark.gate, pytest.mark.engine]


def test_kl_panel_per_domain(panel_reference, panel_engine_record, engine_endpoint, gate_run, gate_bands):
    result, gate = judge(panel_reference, panel_engine_record, engine_endpoint.profile,
                         label=engine_endpoint.profile, bands_file=gate_bands)
    gate_run.panel_gates.append(gate)
    gate_run.add(GateEntry("kl_panel", gate.passed, profile=gate.profile, failures=gate.failures,
                           metrics=headline(gate.summary),
                           # the origin(s) whose answers this verdict rests on (the engine record's own)
                           evidence={"metrics": result.as_dict(),
                                     "answered_by": panel_engine_record.provenance.extra.get("answered_by")}))
    assert result.overall.n_positions == panel_reference.n_positions
    assert gate.passed, "KL panel gate failed:\n" + "\n".join(gate.failures)
