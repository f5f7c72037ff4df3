"""Gate: batch invariance (gates.md §5).

Each subject runs solo (the reference), then again solo (serial repeat: the floor), as 2 and 3 identical
concurrent copies, with heterogeneous companions (the subject in each slot), and with a long companion
arriving mid-decode (mixed prefill + decode steps). Verdict: token-id equality with the solo run in
every scenario; the first diverging position and the solo margin there are reported. Greedy,
``ignore_eos``, fresh salt on every request (no prefix-cache sharing between copies).
"""

from __future__ import annotations

import threading

import pytest

from core.results import GateEntry, headline
from gates import _engine
from gates.lib import batch

pytestmark = [pytest.mark.gate, pytest.mark.engine]


def _out(gen) -> batch.Output:
    return batch.Output(tuple(gen.token_ids), tuple(gen.positions))


def _subjects(cfg, tok):
    from panels.bench import encode_chat_prompt, load_bench

    bench = load_bench()
    return [(cls, encode_chat_prompt(tok, bench.decode_class(cls)[0].text)) for cls in cfg.subjects]


def _companion(tok, n_tokens: int, seed: int):
    from panels.bench import prefill_prompt

    # the companion opens with a system turn; a tokenizer without a system-turn marker (DeepSeek-V4's has no
    # <｜System｜>) gets the raw form (salt right after BOS): a companion only has to be long and different
    chat = not tok.missing_markers()
    return tuple(int(t) for t in prefill_prompt(tok, n_tokens, salt=f"batchcomp{seed:04d}", chat=chat).token_ids)


@pytest.fixture(scope="module")
def batch_runs(engine_client, gate_config, gate_tokenizer):
    cfg = gate_config.batch
    n, k = cfg.max_tokens, cfg.k
    c = engine_client
    go = lambda ids, sid: (lambda: _engine.complete(c, ids, n, k, seq_id=sid))
    from panels.bench import encode_chat_prompt, load_bench

    short = encode_chat_prompt(gate_tokenizer, load_bench().acceptance_domain("chat")[0].text)
    comps = [short] + [_companion(gate_tokenizer, L, i) for i, L in enumerate(cfg.companion_lengths)]
    long_comp = _companion(gate_tokenizer, cfg.mid_decode_companion_tokens, 99)
    out: list[batch.Comparison] = []
    solos = {}
    for name, ids in _subjects(cfg, gate_tokenizer):
        solo = _out(go(ids, name)())
        solos[name] = (ids, solo)
        out.append(batch.compare("serial repeat", name, solo, _out(go(ids, name)())))
        for b in cfg.copies:
            res = _engine.together([go(ids, f"{name}#{i}") for i in range(b)])
            for i, g in enumerate(res):
                out.append(batch.compare(f"{b} identical copies", f"{name} copy {i}", solo, _out(g)))
        for slot in range(len(comps) + 1):
            calls = [go(cp, f"companion{j}") for j, cp in enumerate(comps)]
            calls.insert(slot, go(ids, name))
            res = _engine.together(calls, stagger_s=0.02)
            out.append(batch.compare("heterogeneous companions", f"{name} slot {slot}", solo, _out(res[slot])))
        # a long-prompt companion arrives once the subject has produced `mid_decode_after` tokens
        fired = threading.Event()
        comp_thread: list[threading.Thread] = []
        comp_result: list = []

        def companion() -> None:
            try:
                comp_result.append(_engine.complete(c, long_comp, 8, 1, seq_id="mid-companion"))
            except Exception as exc:  # surfaced below: a failed companion means the scenario did not happen
                comp_result.append(exc)

        def on_tokens(total: int) -> None:
            if total >= cfg.mid_decode_after and not fired.is_set():
                fired.set()
                t = threading.Thread(target=companion)
                t.start()
                comp_thread.append(t)

        streamed = _engine.stream(c, ids, n, k, seq_id=name, on_tokens=on_tokens)
        for t in comp_thread:
            t.join()
        assert fired.is_set(), "the mid-decode companion never fired"
        if isinstance(comp_result[0], Exception):
            raise comp_result[0]
        out.append(batch.compare("mid-decode arrival", name, solo, _out(streamed.generation)))
    return out, solos


def test_batch_invariance(batch_runs, engine_endpoint, gate_run, gate_config):
    comparisons, _ = batch_runs
    res = batch.judge(comparisons)
    gate_run.add(GateEntry("batch_invariance", res.passed, profile=engine_endpoint.profile,
                           failures=res.failures, metrics=headline(res.summary),
                           evidence={"summary": res.summary, "scenarios": res.scenarios,
                                     "comparisons": res.rows, "config": gate_config.for_json("batch")}))
    gate_run.add_section("Batch invariance (gates.md §5)",
                         [{k: v for k, v in s.items() if k != "first_divergences"} for s in res.scenarios],
                         f"{engine_endpoint.profile}: verdict = greedy token ids equal to the solo run; "
                         f"{res.summary['mismatches']}/{res.summary['comparisons']} mismatches, "
                         f"{res.summary['bitwise_equal']}/{res.summary['comparisons']} with bitwise-equal logprobs")
    assert {c.scenario for c in comparisons} >= {"serial repeat", "heterogeneous companions", "mid-decode arrival"}
    assert res.passed, "batch invariance gate failed:\n" + "\n".join(res.failures)


def test_batch_invariance_detects_output_change(batch_runs, engine_client, gate_config, gate_tokenizer,
                                                gate_run):
    """Violation: a 'copy' that is really a different request (the same class's other bench prompt) must be
    reported as a mismatch with its first diverging position; a truncated output must never count as equal."""
    from panels.bench import encode_chat_prompt, load_bench

    cfg = gate_config.batch
    _, solos = batch_runs
    name, (ids, solo) = next(iter(solos.items()))
    changed = encode_chat_prompt(gate_tokenizer, load_bench().decode_class(name)[1].text)
    assert tuple(changed) != tuple(ids)
    other = _engine.complete(engine_client, changed, cfg.max_tokens, cfg.k, seq_id="changed")
    cmp = batch.compare("changed request", name, solo, _out(other))
    truncated = batch.compare("truncated", name, solo, batch.Output(solo.ids[:-3], solo.steps[:-3]))
    res = batch.judge([cmp, truncated])
    gate_run.add(GateEntry("batch_invariance_violation", not res.passed,
                           evidence={"caught": res.failures, "comparisons": res.rows}))
    assert not res.passed
    assert cmp.first_divergence is not None and not cmp.equal_ids, "a changed prompt gave identical ids"
    assert truncated.first_divergence == len(solo.ids) - 3
    assert res.scenarios[0]["failures"] == "1/1"
