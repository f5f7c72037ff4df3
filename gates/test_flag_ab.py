"""Gate: per-flag A/B (gates.md §10). The profile runs with the flag off and on; the flag's class picks the gates.

    pytest gates -m gate --flag NAME [--flag NAME ...] [--engine-profile P] [--flag-registry FILE]

* flag off = the session's engine (``engine_endpoint``: the profile as configured, shared with the other
  gates); flag on = the same profile launched with ``flags=[NAME]`` (one on-server at a time).
* ``exact``    → bitwise_panel (prompt logprobs of the whole panel: ids and values) and bitwise_greedy
  (greedy generation ids + top-k logprobs of one prompt per domain) identical to flag off;
* ``numerics`` → kl_band (the on-run's KL panel within its band against the oracle) and paired_not_worse
  (per-prompt paired KL_part on − off: gates.md §2.7 rule with Wilcoxon significance);
* ``perf``     → both bitwise gates plus speed (median tokens/s, alternating off/on rounds).

Every verdict lands in results.json under ``flag_ab`` and in the report's "Flag A/B verdicts" section.
Without --flag these items are deselected (the plugin), so the plain gate suite neither runs nor skips them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import pytest

from engine import flag_ab as ab
from engine.flags import FlagRegistryError, check_profile, load_registry

pytestmark = [pytest.mark.gate, pytest.mark.engine, pytest.mark.flag_ab]

GREEDY_K = 20
MAX_PROMPT_TOKENS = 256


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    flags = list(dict.fromkeys(metafunc.config.getoption("--flag")))
    if "flag_name" in metafunc.fixturenames:
        metafunc.parametrize("flag_name", flags, ids=flags)
    if "flag_gate" in metafunc.fixturenames:
        try:
            reg = load_registry(metafunc.config.getoption("--flag-registry"))
        except FlagRegistryError:
            reg = None  # test_flag_registered reports the registry error
        pairs = [(f, g) for f in flags if reg is not None and f in reg for g in reg.get(f).effective_gates()]
        metafunc.parametrize("flag_gate", pairs, ids=[f"{f}-{g}" for f, g in pairs])


def _profile_arg(config: pytest.Config) -> str:
    from engine.endpoint import DEFAULT_PROFILE

    return config.getoption("--engine-profile") or DEFAULT_PROFILE


@dataclass
class FlagAB:
    """The A/B state of this session: one off side (shared), on-servers launched per flag, results."""

    config: pytest.Config
    registry: Any
    off: Any                    # EngineEndpoint
    off_record: Any
    reference: Any
    encoded: Any
    gate_run: Any
    profile_arg: str
    results: dict[str, dict] = field(default_factory=dict)
    _server: Any = None
    _server_flag: str | None = None
    _on_endpoint: Any = None
    _records: dict[str, Any] = field(default_factory=dict)
    _greedy: dict[str, list] = field(default_factory=dict)

    # ----------------------------------------------------------------------------------------- IO
    def preflight(self, flag: str) -> None:
        from engine.launcher import load_profile

        if self.config.getoption("--engine-url"):
            pytest.fail("the flag A/B launches the profile with the flag on; --engine-url gives only the off "
                        "side: run it with --engine-profile instead")
        check = check_profile(load_profile(self.profile_arg), self.registry, [flag])
        if not check.ok:
            pytest.fail("flag A/B preflight:\n" + "\n".join(check.problems))

    def on_endpoint(self, flag: str):
        from ds41gates.pytest_plugin import launch_endpoint

        if self._server_flag != flag:
            self.stop()
            self._server, self._on_endpoint = launch_endpoint(self.profile_arg, flags=[flag])
            self._server_flag = flag
        return self._on_endpoint

    def stop(self) -> None:
        if self._server is not None:
            server, self._server, self._server_flag = self._server, None, None
            server.stop()

    def on_record(self, flag: str):
        from engine.endpoint import DEFAULT_ENGINE_K, score_engine

        if flag not in self._records:
            ep = self.on_endpoint(flag)
            rec = score_engine(ep, self.encoded, DEFAULT_ENGINE_K)
            label = f"{self.off.profile}+{flag}"
            rec.save(self.gate_run.out_dir / f"engine-{label}.safetensors")
            self.gate_run.engines.append((label, rec))
            self._records[flag] = rec
        return self._records[flag]

    def prompts(self) -> list[tuple[str, tuple[int, ...]]]:
        per_domain = self.config.getoption("--ab-prompts-per-domain")
        seen: dict[str, int] = {}
        out = []
        for seq in self.encoded.sequences:
            if seen.get(seq.domain, 0) >= per_domain:
                continue
            seen[seq.domain] = seen.get(seq.domain, 0) + 1
            first = next((i for i, s in enumerate(seq.scored_mask) if s), len(seq.token_ids))
            out.append((seq.seq_id, tuple(seq.token_ids[:max(1, min(first, MAX_PROMPT_TOKENS))])))
        return out

    def _generate(self, endpoint) -> tuple[list, float, int]:
        from engine.endpoint import client_for

        n_tokens = self.config.getoption("--ab-greedy-tokens")
        client = client_for(endpoint, max_concurrency=1)
        try:
            t0 = time.perf_counter()
            gens = [client.generate(ids, n_tokens, GREEDY_K, seq_id=sid) for sid, ids in self.prompts()]
            wall = time.perf_counter() - t0
        finally:
            client.close()
        return gens, wall, sum(len(g.token_ids) for g in gens)

    def greedy(self, side: str) -> list:
        """side: 'off', 'off#2' (determinism pre-check, same server) or a flag name."""
        if side not in self._greedy:
            ep = self.off if side.startswith("off") else self.on_endpoint(side)
            self._greedy[side] = self._generate(ep)[0]
        return self._greedy[side]

    # -------------------------------------------------------------------------------------- gates
    def run_gate(self, flag: str, gate: str) -> dict:
        entry = self.registry.get(flag)
        self.preflight(flag)
        th = entry.thresholds
        if gate == "bitwise_panel":
            res = ab.compare_records_bitwise(self.off_record, self.on_record(flag))
            verdict = {"passed": res.identical, "why": _bitwise_why(res), **res.as_dict()}
        elif gate == "bitwise_greedy":
            det = ab.compare_generations(self.greedy("off"), self.greedy("off#2"))
            res = ab.compare_generations(self.greedy("off"), self.greedy(flag))
            verdict = {"passed": res.identical, "why": _bitwise_why(res), "baseline_deterministic": det.identical,
                       **res.as_dict()}
            if not det.identical:  # gates.md §10.6 step 2: fall back to the observed spread, provisional
                verdict.update(passed=res.ids_identical and res.max_abs_diff <= det.max_abs_diff, provisional=True,
                               why=f"baseline not deterministic (off vs off max |Δ| {det.max_abs_diff:.3g}); "
                                   f"provisional tolerance verdict: {_bitwise_why(res)}")
        elif gate == "kl_band":
            from core.verdicts import judge

            band = th.band_profile or self.off.profile
            result, pg = judge(self.reference, self.on_record(flag), band, label=f"{self.off.profile}+{flag}")
            self.gate_run.panel_gates.append(pg)
            verdict = {"passed": pg.passed, "why": "; ".join(pg.failures) or f"within the {band} bands",
                       "band_profile": band, "summary": pg.summary}
        elif gate == "paired_not_worse":
            from core import metrics

            on = self.on_record(flag)
            paired = metrics.paired_comparison(metrics.position_metrics(self.reference, self.off_record),
                                               metrics.position_metrics(self.reference, on), "kl_part")
            pv = ab.paired_not_worse(paired, th)
            bit = ab.compare_records_bitwise(self.off_record, on)
            verdict = {"passed": pv.passed, "why": pv.reason, **pv.as_dict(),
                       "bit_identical": bit.identical, "max_abs_diff": bit.max_abs_diff}
        elif gate == "speed":
            verdict = self._speed(flag, th)
        else:
            pytest.fail(f"flag {flag}: unknown A/B gate {gate!r}")
        self._record(flag, entry, gate, verdict)
        return verdict

    def _speed(self, flag: str, th) -> dict:
        rounds = self.config.getoption("--ab-speed-rounds")
        on_ep = self.on_endpoint(flag)
        off_s, on_s = [], []
        for _ in range(rounds):
            for ep, acc in ((self.off, off_s), (on_ep, on_s)):
                _, wall, n = self._generate(ep)
                acc.append(n / wall)
        sv = ab.speed_verdict(off_s, on_s, th)
        return {"passed": sv.passed, "why": sv.reason, **sv.as_dict()}

    def _record(self, flag: str, entry, gate: str, verdict: dict) -> None:
        slot = self.results.setdefault(flag, {"class": entry.cls, "kind": entry.kind, "profile": self.off.profile,
                                              "gates": {}})
        slot["gates"][gate] = verdict
        slot["passed"] = all(v["passed"] for v in slot["gates"].values())
        self.gate_run.add("flag_ab", self.results)
        rows = [{"flag": f, "class": s["class"], "gate": g, "verdict": "pass" if v["passed"] else "FAIL",
                 "why": v["why"]} for f, s in self.results.items() for g, v in s["gates"].items()]
        self.gate_run.add_section("Flag A/B verdicts", rows, "gates.md §10; classes and thresholds in the flag registry")


def _bitwise_why(res: ab.BitwiseResult) -> str:
    if res.identical:
        return f"{res.what}: {res.compared} positions bit-identical"
    return (f"{res.what}: {res.n_mismatches} of {res.compared} differ (max |Δ logprob| {res.max_abs_diff:.3g}): "
            + "; ".join(res.mismatches))


@pytest.fixture(scope="session")
def flag_ab(request, flag_registry, engine_endpoint, panel_engine_record, panel_reference, encoded_panel, gate_results):
    state = FlagAB(request.config, flag_registry, engine_endpoint, panel_engine_record, panel_reference,
                   encoded_panel, gate_results, _profile_arg(request.config))
    try:
        yield state
    finally:
        state.stop()


def test_flag_registered(flag_name, flag_registry, request):
    """The flag is in the registry, the profile has its [flags.NAME] table, no unknown / test-only VLLM_DS41_*."""
    from engine.launcher import load_profile

    entry = flag_registry.get(flag_name)
    check = check_profile(load_profile(_profile_arg(request.config)), flag_registry, [flag_name])
    assert check.ok, "\n".join(check.problems)
    assert entry.effective_gates(), f"{flag_name}: no gates for class {entry.cls}"


def test_flag_gate(flag_gate, flag_ab):
    flag, gate = flag_gate
    verdict = flag_ab.run_gate(flag, gate)
    assert verdict["passed"], f"flag {flag} ({flag_ab.registry.get(flag).cls}) gate {gate}: {verdict['why']}"
