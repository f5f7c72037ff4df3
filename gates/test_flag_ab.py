"""Gate: per-flag A/B (gates.md §10). The profile runs with the flag off and on; the flag's class picks the gates.

    pytest gates -m gate --flag NAME [--flag NAME ...] [--engine-profile P] [--flag-registry FILE]

* flag off = the session's engine (``engine_endpoint``: the profile as configured, shared with the other
  gates); flag on = the same profile launched with ``flags=[NAME]``. The on-server is a session fixture per
  flag, and the tests are grouped by flag, so one on-server runs at a time.
* ``exact``    → bitwise_panel (prompt logprobs of the whole panel: ids and values) and bitwise_greedy
  (greedy generation ids + top-k logprobs of one prompt per domain) identical to flag off;
* ``numerics`` → kl_band (the on-run's KL panel within its band against the oracle) and paired_not_worse
  (per-prompt paired KL_part on − off: gates.md §2.7 rule with Wilcoxon significance);
* ``perf``     → both bitwise gates plus speed (median tokens/s, alternating off/on rounds).
* a flag whose code runs at depth (its registry ``mechanisms``: window eviction, compressed entries, indexer
  pruning) also gets ``kl_depth`` (numerics: the on-run's KL per depth bucket against the oracle's long-context
  reference of long@1's ``kl_lengths`` items) or ``bitwise_depth`` (exact / perf: the on-run's prompt logprobs of
  those items identical to off's). Both arms' scored positions join the coverage of their own arm: only the
  on-arm's count for the flag (ds41gates/coverage.py), so a flag A/B'd on the short panel alone is NOT EXERCISED.

One test function per registry gate; a flag gets the tests its class (or its ``gates`` list) names. Every
verdict lands in results.json under ``flag_ab`` and in the report's "Flag A/B verdicts" section. Without
--flag these items are deselected (the plugin), so the plain gate suite neither runs nor skips them.
"""

from __future__ import annotations

import time

import pytest

from core.results import FlagGateVerdict
from gates.lib import flag_ab as verdicts
from nightly import flag_ab as stats
from nightly.flags import FlagRegistryError, check_profile, load_registry

pytestmark = [pytest.mark.gate, pytest.mark.engine, pytest.mark.flag_ab]

GREEDY_K = 20
MAX_PROMPT_TOKENS = 256


def guards(gate: str):
    """Mark a test function as the registry gate ``gate`` (a flag gets it when its gates list it)."""
    def mark(fn):
        fn.ab_gate = gate
        return fn
    return mark


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "flag_name" not in metafunc.fixturenames:
        return
    flags = list(dict.fromkeys(metafunc.config.getoption("--flag")))
    gate = getattr(metafunc.function, "ab_gate", None)
    if gate is not None:
        try:
            reg = load_registry(metafunc.config.getoption("--flag-registry"))
        except FlagRegistryError:
            reg = None  # test_flag_registered reports the registry error
        flags = [f for f in flags if reg is not None and f in reg and gate in reg.get(f).effective_gates()]
    # session scope: pytest groups the items by flag, so each flag's on-server starts once
    metafunc.parametrize("flag_name", flags, ids=flags, scope="session")


# ------------------------------------------------------------------------------------------------- the IO

@pytest.fixture(scope="session")
def ab_profile(request) -> str:
    from engine.endpoint import DEFAULT_PROFILE

    if request.config.getoption("--engine-url"):
        pytest.fail("the flag A/B launches the profile with the flag on; --engine-url gives only the off side: "
                    "run it with --engine-profile instead")
    return request.config.getoption("--engine-profile") or DEFAULT_PROFILE


@pytest.fixture(scope="session")
def flag_on(flag_name, flag_registry, ab_profile, launch_engine, engine_endpoint):
    """The endpoint of the profile launched with the flag on (refused before launch when the preflight fails):
    the off side's own flags (--engine-flag) plus this one, so the two differ in exactly this flag."""
    from engine.profiles import load_profile

    check = check_profile(load_profile(ab_profile), flag_registry, [flag_name])
    if not check.ok:
        pytest.fail("flag A/B preflight:\n" + "\n".join(check.problems))
    server, endpoint = launch_engine(ab_profile, flags=[*dict.fromkeys([*engine_endpoint.flags, flag_name])])
    try:
        yield endpoint
    finally:
        server.stop()


@pytest.fixture(scope="session")
def on_record(flag_name, flag_on, encoded_panel, engine_endpoint, panel_reference, gate_run):
    from engine.endpoint import DEFAULT_ENGINE_K, score_engine

    rec = score_engine(flag_on, encoded_panel, DEFAULT_ENGINE_K)
    label = f"{engine_endpoint.profile}+{flag_name}"
    gate_run.save_engine_record(label, rec)
    # the panel's positions, scored by the flag's own arm, count towards the flag's coverage
    gate_run.add_coverage(panel_reference, arm=flag_name)
    return rec


@pytest.fixture(scope="session")
def ab_prompts(request, encoded_panel) -> list[tuple[str, tuple[int, ...]]]:
    return verdicts.greedy_prompts(encoded_panel.sequences, request.config.getoption("--ab-prompts-per-domain"),
                                   MAX_PROMPT_TOKENS)


def _generate(endpoint, prompts, n_tokens: int) -> tuple[list, float, int]:
    """Greedy generations of every prompt, one at a time: (generations, wall seconds, tokens generated)."""
    from engine.endpoint import client_for

    client = client_for(endpoint, max_concurrency=1)
    try:
        t0 = time.perf_counter()
        gens = [client.generate(ids, n_tokens, GREEDY_K, seq_id=sid) for sid, ids in prompts]
        wall = time.perf_counter() - t0
    finally:
        client.close()
    return gens, wall, sum(len(g.token_ids) for g in gens)


@pytest.fixture(scope="session")
def greedy_tokens(request) -> int:
    return request.config.getoption("--ab-greedy-tokens")


@pytest.fixture(scope="session")
def off_greedy(engine_endpoint, ab_prompts, greedy_tokens) -> tuple[list, list]:
    """Two greedy passes of the off-server: the second is the determinism pre-check."""
    return (_generate(engine_endpoint, ab_prompts, greedy_tokens)[0],
            _generate(engine_endpoint, ab_prompts, greedy_tokens)[0])


@pytest.fixture(scope="session")
def on_greedy(flag_on, ab_prompts, greedy_tokens) -> list:
    return _generate(flag_on, ab_prompts, greedy_tokens)[0]


@pytest.fixture
def entry(flag_name, flag_registry):
    return flag_registry.get(flag_name)


def _settle(verdict: FlagGateVerdict, entry, gate_run, profile: str) -> None:
    """Record the verdict (results.json's flag table and the report section), then pass or fail the test on it."""
    gate_run.add_flag_verdict(entry.name, entry.cls, entry.kind, profile, verdict)
    gate_run.add_section(verdicts.REPORT_TITLE, verdicts.report_rows(
        gate_run.results, {entry.name: entry.effective_gates()}), verdicts.REPORT_NOTE)
    assert verdict.passed, f"flag {entry.name} ({entry.cls}) gate {verdict.gate}: {verdict.why}"


# ----------------------------------------------------------------------------------------------- the gates

def test_flag_registered(flag_name, flag_registry, ab_profile):
    """The flag is in the registry, the profile has its [flags.NAME] table, no unknown / test-only VLLM_DS41_*."""
    from engine.profiles import load_profile

    entry = flag_registry.get(flag_name)
    check = check_profile(load_profile(ab_profile), flag_registry, [flag_name])
    assert check.ok, "\n".join(check.problems)
    assert entry.effective_gates(), f"{flag_name}: no gates for class {entry.cls}"


@guards("bitwise_panel")
def test_bitwise_panel(entry, panel_engine_record, on_record, gate_run, engine_endpoint):
    verdict = verdicts.bitwise_verdict(stats.compare_records_bitwise(panel_engine_record, on_record))
    _settle(verdict, entry, gate_run, engine_endpoint.profile)


@guards("bitwise_greedy")
def test_bitwise_greedy(entry, off_greedy, on_greedy, gate_run, engine_endpoint):
    off, off_again = off_greedy
    verdict = verdicts.greedy_verdict(stats.compare_generations(off, off_again), stats.compare_generations(off, on_greedy))
    _settle(verdict, entry, gate_run, engine_endpoint.profile)


@guards("kl_band")
def test_kl_band(entry, panel_reference, on_record, gate_run, engine_endpoint, gate_bands):
    from core.verdicts import judge

    band = entry.thresholds.band_profile or engine_endpoint.profile
    _, pg = judge(panel_reference, on_record, band, f"{engine_endpoint.profile}+{entry.name}", gate_bands)
    gate_run.panel_gates.append(pg)
    verdict = verdicts.band_verdict(pg.passed, pg.failures, band, pg.summary)
    _settle(verdict, entry, gate_run, engine_endpoint.profile)


@guards("paired_not_worse")
def test_paired_not_worse(entry, panel_reference, panel_engine_record, on_record, gate_run,
                          engine_endpoint):
    from core import metrics

    paired = metrics.paired_comparison(metrics.position_metrics(panel_reference, panel_engine_record),
                                       metrics.position_metrics(panel_reference, on_record), "kl_part")
    verdict = verdicts.paired_verdict(stats.paired_not_worse(paired, entry.thresholds),
                                      stats.compare_records_bitwise(panel_engine_record, on_record))
    _settle(verdict, entry, gate_run, engine_endpoint.profile)


@guards("speed")
def test_speed(request, entry, flag_on, engine_endpoint, ab_prompts, greedy_tokens, gate_run):
    off_s, on_s = [], []
    for _ in range(request.config.getoption("--ab-speed-rounds")):  # alternate so drift hits both sides
        for endpoint, speeds in ((engine_endpoint, off_s), (flag_on, on_s)):
            _, wall, n = _generate(endpoint, ab_prompts, greedy_tokens)
            speeds.append(n / wall)
    verdict = verdicts.speed_verdict(stats.speed_verdict(off_s, on_s, entry.thresholds))
    _settle(verdict, entry, gate_run, engine_endpoint.profile)


# ------------------------------------------------------------------------------------ at depth (issue 39)

@pytest.fixture(scope="session")
def depth_items(gate_config, gate_target, engine_facts, engine_endpoint):
    """long@1's items of the profile's kl_lengths (past the indexer's 2,048 on vllm-cpu-dsv4), encoded; a profile
    with none, or whose engine cannot hold them, is not applicable here (xfail, never PASS)."""
    from gates.lib.depth import long_items, not_applicable

    lengths = tuple(gate_config.long_context.kl_lengths)
    why = not_applicable(lengths, engine_facts["max_model_len"], engine_endpoint.profile)
    if why:
        pytest.xfail(f"depth A/B not applicable: {why}")
    return lengths, long_items(lengths, gate_config.long_context.kl_domains, gate_target.tokenizer)


@pytest.fixture(scope="session")
def depth_reference(depth_items, long_reference):
    return long_reference(depth_items[1])


def _depth_record(endpoint, depth_items, depth_reference, gate_run, arm):
    from engine.endpoint import DEFAULT_ENGINE_K, score_engine

    lengths, encoded = depth_items
    rec = score_engine(endpoint, encoded, DEFAULT_ENGINE_K)
    gate_run.add_coverage(depth_reference, arm=arm, lengths=lengths)
    return rec


@pytest.fixture(scope="session")
def off_depth_record(engine_endpoint, depth_items, depth_reference, gate_run):
    return _depth_record(engine_endpoint, depth_items, depth_reference, gate_run, None)


@pytest.fixture(scope="session")
def on_depth_record(flag_name, flag_on, depth_items, depth_reference, gate_run):
    return _depth_record(flag_on, depth_items, depth_reference, gate_run, flag_name)


@guards("kl_depth")
def test_kl_depth(entry, depth_items, depth_reference, on_depth_record, gate_run, engine_endpoint, gate_target):
    from gates.lib.depth import judge_at_depth

    band = entry.thresholds.band_profile or engine_endpoint.profile
    dv = judge_at_depth(depth_reference, on_depth_record, gate_target.bands, band)
    gate_run.add_section(f"Flag A/B at depth: {entry.name} on, KL / top-1 per depth bucket against the oracle",
                         list(dv.rows), f"bands per bucket: [depth.{band}] in {gate_target.bands}")
    _settle(verdicts.depth_band_verdict(dv.passed, dv.failures, band, dv.rows, depth_items[0]), entry, gate_run,
            engine_endpoint.profile)


@guards("bitwise_depth")
def test_bitwise_depth(entry, off_depth_record, on_depth_record, gate_run, engine_endpoint):
    verdict = verdicts.bitwise_verdict(stats.compare_records_bitwise(off_depth_record, on_depth_record),
                                       "bitwise_depth")
    _settle(verdict, entry, gate_run, engine_endpoint.profile)
