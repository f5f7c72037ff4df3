"""Gate: prefix cache (gates.md §6), cold versus warm on one running server.

Cases: exact hit, multi-turn extension and fork, at shared-prefix lengths b−1, b, b+1 around multiples
of the engine's KV block size (read from the server's ``vllm:cache_config_info``), plus one even and one
odd length; prompts are real code from the default panel. Cold = fresh salt (cached_tokens must be 0);
prime = the shared prefix under salt s; warm = the test prompt under s (cached_tokens must reach the
block-aligned shared length, or the case is INVALID). The whole gate runs twice on the same server
(``passes``), optionally a third time after filling the KV cache (``eviction_pass``). Verdicts: see
gates/lib/prefix.py.

Whether the gate applies is the profile's word (gates/lib/prefix.py, ``expected_prefix_caching``): not applicable
(xfail) only when the profile runs the engine without prefix caching (``--no-enable-prefix-caching`` in its launch,
or ``[gate] prefix_cache = "optional"``) and the engine reports it off; an engine that reports caching off while its
profile requires it FAILS, naming both.
"""

from __future__ import annotations

import uuid

import pytest

from core.results import GateEntry, headline
from gates import _engine
from gates.lib import prefix

pytestmark = [pytest.mark.gate, pytest.mark.engine]

TURN = "\n\n# Next: add a method that returns the number of live entries, with a docstring and a test.\n"
BRANCHES = ("\n\ndef test_first_case():\n    assert", "\n\nclass AnotherThing:\n    \"\"\"A different")


SOURCE_ITEMS = ("agentic-01-failing-test", "code-02-rust-kv", "code-01-ttl-cache")  # a chat transcript with code


def _source_ids(tok) -> list[int]:
    """Real code and chat transcripts: default-panel items, chat ones rendered with the model's template."""
    from panels import load_panel

    items = {it.id: it for it in load_panel("default").items}
    ids: list[int] = []
    for name in SOURCE_ITEMS:
        it = items[name]
        text = it.text or tok.chat_format.render(list(it.messages), tuple(it.tools or ()), add_generation_prompt=False)
        ids += tok.tokenizer.encode(text, add_special_tokens=False).ids
    return ids


def _cases(cfg, block: int, tok):
    src = _source_ids(tok)
    enc = lambda s: list(tok.tokenizer.encode(s, add_special_tokens=False).ids)
    turn, b1, b2 = enc(TURN), enc(BRANCHES[0]), enc(BRANCHES[1])
    lengths = sorted({m * block + d for m in cfg.boundaries for d in (-1, 0, 1)} | set(cfg.extra_lengths))
    cases = []
    for L in lengths:
        if L + len(turn) + 2 > len(src):
            raise ValueError(f"prefix source has {len(src)} tokens, too few for a shared prefix of {L}")
        shared = src[:L]
        for kind in cfg.kinds:
            prime, test = {"exact": (shared, shared), "extend": (shared, shared + turn),
                           "fork": (shared + b1, shared + b2)}[kind]
            exp = prefix.expected_cached(L, len(test), block)
            cases.append({"case": f"{kind}@{L}", "kind": kind, "shared": L, "prime": prime, "test": test,
                          "expected": exp})
    return cases


def _run(client, ids, cfg, salt=None) -> prefix.Run:
    g = _engine.complete(client, ids, cfg.max_tokens, cfg.k, salt=salt, seq_id="prefix")
    return prefix.Run(tuple(g.token_ids), tuple(g.positions), g.cached_tokens)


def _one_case(client, case, cfg, kl_tol):
    cold = _run(client, case["test"], cfg)
    salt = uuid.uuid4().hex
    _engine.complete(client, case["prime"], 1, 1, salt=salt, seq_id="prefix-prime")
    warm = _run(client, case["test"], cfg, salt=salt)
    return cold, warm, prefix.classify(case["case"], cold, warm, case["expected"], kl_tol, cfg.fail_window)


def _fill_cache(client, tok, tokens: int, max_model_len: int):
    from panels.bench import prefill_prompt

    per = min(1800, max_model_len - 8)
    for i in range(tokens // per + 1):
        _engine.complete(client, [int(t) for t in prefill_prompt(tok, per).token_ids], 1, 1, seq_id="evict")


def applicability(request, engine_endpoint, engine_facts) -> prefix.Applicability:
    """The profile under test (None for --engine-url without --engine-profile) and the flags it runs with decide
    whether caching is expected; the engine's report is checked against that, never taken as the answer."""
    from engine.endpoint import DEFAULT_PROFILE
    from engine.profiles import load_profile

    name = request.config.getoption("--engine-profile") or (
        None if request.config.getoption("--engine-url") else DEFAULT_PROFILE)
    expected, why = prefix.expected_prefix_caching(load_profile(name) if name else None, engine_endpoint.flags)
    reported = engine_facts.get("prefix_caching")
    return prefix.prefix_cache_applicability(expected, why, None if reported is None else str(reported) == "True")


@pytest.fixture(scope="module")
def prefix_runs(request, engine_client, engine_endpoint, gate_config, engine_facts, gate_tokenizer):
    cfg = gate_config.prefix
    appl = applicability(request, engine_endpoint, engine_facts)
    if appl.problem:
        return {"misdeclared": appl.problem}
    if not appl.applies:
        # e.g. vllm-cpu-dsv4: vLLM CPU turns prefix caching off for MLA models, and the profile declares it
        cc = engine_facts.get("cache_config") or {}
        return {"not_applicable": f"{appl.reason}, and the engine reports enable_prefix_caching="
                                  f"{engine_facts.get('prefix_caching')} (block_size {cc.get('block_size')})"}
    block = engine_facts["block_size"]
    assert block, f"the server did not report its KV block size: {engine_facts['cache_config']}"
    cases = [c for c in _cases(cfg, block, gate_tokenizer) if c["expected"] > 0]
    skipped = [c["case"] for c in _cases(cfg, block, gate_tokenizer) if c["expected"] <= 0]
    # F_run: two cold runs of the first three cases
    pairs = [(_run(engine_client, c["test"], cfg), _run(engine_client, c["test"], cfg)) for c in cases[:3]]
    f_run = prefix.run_to_run(pairs)
    kl_tol = max(cfg.spread_factor * f_run, cfg.kl_tol_floor)
    labels = [f"pass {i + 1}" for i in range(cfg.passes)] + (["after eviction"] if cfg.eviction_pass else [])
    verdicts, rows, kept = [], [], {}
    for label in labels:
        if label == "after eviction":
            _fill_cache(engine_client, gate_tokenizer, 30000, engine_facts["max_model_len"] or 2048)
        for c in cases:
            cold, warm, v = _one_case(engine_client, c, cfg, kl_tol)
            verdicts.append((label, v))
            rows.append(v.as_row(run=label, kind=c["kind"], shared=c["shared"]))
            kept[c["case"]] = (c, cold)
    return {"verdicts": verdicts, "rows": rows, "f_run": f_run, "kl_tol": kl_tol, "block": block,
            "skipped": skipped, "cases": kept, "labels": labels}


def _not_applicable(r: dict, profile: str, gate_run) -> None:
    if "misdeclared" in r:
        gate_run.add(GateEntry("prefix_cache", False, profile=profile, failures=[r["misdeclared"]]))
        pytest.fail(f"prefix cache gate on {profile}: {r['misdeclared']}")
    if "not_applicable" in r:
        gate_run.add(GateEntry("prefix_cache", None, profile=profile,
                               failures=[f"not applicable: {r['not_applicable']}"]))
        pytest.xfail(f"prefix cache gate not applicable on {profile}: {r['not_applicable']}")


def test_prefix_cache(prefix_runs, engine_endpoint, gate_run, gate_config):
    r = prefix_runs
    _not_applicable(r, engine_endpoint.profile, gate_run)
    res = prefix.judge(r["verdicts"])
    gate_run.add(GateEntry("prefix_cache", res.passed, profile=engine_endpoint.profile, failures=res.failures,
                           metrics={**headline(res.counts), "f_run": r["f_run"], "kl_tol": r["kl_tol"]},
                           evidence={"cases": r["rows"], "block_size": r["block"], "passes": r["labels"],
                                     "not_testable": r["skipped"], "config": gate_config.for_json("prefix")}))
    gate_run.add_section("Prefix cache: cold vs warm (gates.md §6)", r["rows"],
                         f"{engine_endpoint.profile}: block size {r['block']}; passes {r['labels']}; "
                         f"counts {res.counts}; F_run {r['f_run']:.3g}, per-step KL tolerance {r['kl_tol']:.3g}; "
                         f"not testable (no full shared block): {r['skipped']}")
    assert len(r["labels"]) >= 2 and len(r["verdicts"]) >= 2 * len(r["cases"])
    assert res.passed, "prefix cache gate failed:\n" + "\n".join(res.failures)


def test_prefix_cache_detects_mismatch_and_missing_hit(prefix_runs, engine_client, gate_config, gate_run):
    """Violations on the live server: (a) a warm request whose prompt differs from the cold one after the
    cached prefix (a real output mismatch) must be FAIL or CORRUPT; (b) a 'warm' request under a fresh
    salt has cached_tokens 0, and the gate must call it INVALID (no hit proven), never PASS."""
    if "misdeclared" in prefix_runs:
        pytest.fail(f"prefix cache gate: {prefix_runs['misdeclared']}")
    if "not_applicable" in prefix_runs:
        pytest.xfail(f"prefix cache gate not applicable: {prefix_runs['not_applicable']}")
    cfg = gate_config.prefix
    case, cold = next((c, cold) for c, cold in prefix_runs["cases"].values() if c["kind"] == "fork")
    salt = uuid.uuid4().hex
    _engine.complete(engine_client, case["prime"], 1, 1, salt=salt, seq_id="prefix-prime")
    other = case["prime"]                                 # same prefix, the *other* branch
    warm = _run(engine_client, other, cfg, salt=salt)
    v = prefix.classify(case["case"] + " (other branch)", cold, warm, case["expected"], prefix_runs["kl_tol"])
    assert warm.cached_tokens and warm.cached_tokens >= case["expected"]
    assert v.verdict in prefix.BAD and v.verdict != "INVALID", v
    unsalted = _run(engine_client, case["test"], cfg)      # fresh salt: nothing can be served from cache
    v2 = prefix.classify(case["case"] + " (fresh salt)", cold, unsalted, case["expected"], prefix_runs["kl_tol"])
    caught = v.verdict in prefix.BAD and v.verdict != "INVALID" and v2.verdict == "INVALID"
    gate_run.add(GateEntry("prefix_cache_violation", caught,
                           evidence={"mismatch": v.as_row(), "fresh_salt": v2.as_row()}))
    assert unsalted.cached_tokens == 0
    assert v2.verdict == "INVALID" and "no hit proven" in v2.reason, v2
    assert not prefix.judge([("violation", v), ("violation", v2)]).passed
