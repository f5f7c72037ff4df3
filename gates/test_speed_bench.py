"""Bench: speed as a user sees it (gates.md §9) — decode tok/s, TTFT, prefill tok/s, 1–4 streams.

Streamed greedy requests with ``ignore_eos`` and fixed ``max_tokens`` (A/B comparable), fresh salt per
request, a warm-up first. Decode per class of the bench set (code / prose / structured); prefill on
salted prompts (``panels.bench.prefill_prompt``: random first block, cached count must be 0); N streams
released on a barrier. Medians over repetitions. Writes engine_bench.json and engine_bench.png into the
results folder. Fails on an invalid measurement (a cache hit in a prefill, a short reply) and, when
gates/bench_best_known.toml holds values for the profile, on a median below 0.95 × best-known.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from core.errors import UserError
from core.results import GateEntry, headline
from gates import _engine
from gates.lib import bench

pytestmark = [pytest.mark.bench, pytest.mark.engine]

BEST_KNOWN = Path(__file__).resolve().parent / "bench_best_known.toml"


class BestKnownError(UserError, ValueError):
    """gates/bench_best_known.toml is malformed (a profile table of metric = number)."""


def _times(t: _engine.Timed) -> bench.StreamTimes:
    st = t.stream
    g = st.generation
    return bench.StreamTimes(t.t_send, tuple(t.t_send + x for x in st.chunk_times_s), st.chunk_token_counts,
                             g.prompt_tokens, g.cached_tokens)


def _plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    dec = result["decode"]
    axes[0].bar(list(dec), [dec[c]["decode_tps"]["median"] for c in dec], color="tab:blue")
    axes[0].set_title("decode tok/s (median)")
    pre = result["prefill"]
    xs = sorted(pre, key=int)
    axes[1].plot([int(x) for x in xs], [pre[x]["prefill_tps"]["median"] for x in xs], "o-")
    axes[1].set_title("prefill tok/s (median, salted)")
    axes[1].set_xlabel("prompt tokens")
    st = result["streams"]
    ns = sorted(st, key=int)
    axes[2].plot([int(n) for n in ns], [st[n]["aggregate_decode_tps"] for n in ns], "o-", label="aggregate decode")
    axes[2].plot([int(n) for n in ns], [st[n]["aggregate_e2e_tps"] for n in ns], "s--", label="aggregate e2e")
    axes[2].plot([int(n) for n in ns], [st[n]["per_stream_decode_tps_p50"] for n in ns], "^:", label="per stream p50")
    axes[2].set_title("streams")
    axes[2].set_xlabel("concurrent streams")
    axes[2].legend(fontsize=8)
    fig.suptitle(result["profile"])
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


@pytest.fixture(scope="module")
def bench_result(engine_client, engine_endpoint, gate_config, gate_tokenizer, engine_facts):
    from panels.bench import encode_chat_prompt, load_bench, prefill_prompt

    cfg = gate_config.bench
    c = engine_client
    sets = load_bench()
    invalid: list[str] = []
    prompts = {cls: [encode_chat_prompt(gate_tokenizer, p.text) for p in sets.decode_class(cls)[: cfg.prompts_per_class]]
               for cls in cfg.decode_classes}
    for ids_list in prompts.values():                      # warm-up: one short request per prompt
        for ids in ids_list:
            _engine.stream(c, ids, cfg.warmup_tokens)
    decode = {}
    for cls, ids_list in prompts.items():
        tps, ttfts, texts = [], [], {}
        for ids in ids_list:
            for _ in range(cfg.reps):
                t = _engine.stream(c, ids, cfg.max_tokens, seq_id=f"bench-{cls}")
                s = _times(t)
                if s.n_out != cfg.max_tokens:
                    invalid.append(f"decode {cls}: {s.n_out} tokens, expected {cfg.max_tokens}")
                    continue
                tps.append(bench.decode_tps(s))
                ttfts.append(bench.ttft(s))
                texts.setdefault(tuple(ids), set()).add(tuple(t.generation.token_ids))
        decode[cls] = {"decode_tps": bench.med(tps), "ttft_s": bench.med(ttfts), "tokens": cfg.max_tokens,
                       "identical_texts": all(len(v) == 1 for v in texts.values())}
    prefill = {}
    mml = engine_facts["max_model_len"] or 2048
    for n in [x for x in cfg.prefill_lengths if x < mml]:
        tps, ttfts = [], []
        for _ in range(cfg.prefill_reps):
            p = prefill_prompt(gate_tokenizer, n)
            s = _times(_engine.stream(c, [int(x) for x in p.token_ids], 1, seq_id=f"prefill-{n}"))
            try:
                tps.append(bench.prefill_tps(s))
                ttfts.append(bench.ttft(s))
            except bench.BenchInvalid as exc:
                invalid.append(f"prefill {n}: {exc}")
        prefill[str(n)] = {"prefill_tps": bench.med(tps), "ttft_s": bench.med(ttfts)}
    streams = {}
    base = prompts[cfg.decode_classes[0]][0]
    for n in cfg.streams:
        calls = [lambda: _engine.stream(c, base, cfg.stream_max_tokens, seq_id="stream") for _ in range(n)]
        streams[str(n)] = bench.aggregate([_times(t) for t in _engine.together(calls)])
    return {"profile": engine_endpoint.profile, "decode": decode, "prefill": prefill, "streams": streams,
            "invalid": invalid, "config": cfg.model_dump(mode="json"),
            "definitions": "decode tok/s = (N_out-1)/(t_last-t_first); TTFT = t_first-t_send; "
                           "prefill tok/s = N_in/TTFT with cached == 0; aggregate e2e = ΣN_out/(max t_last-min t_send); "
                           "aggregate decode = ΣN_out/(max t_last-min t_first)"}


def _medians(r: dict) -> dict[str, float]:
    out = {f"decode_tps.{k}": v["decode_tps"]["median"] for k, v in r["decode"].items()}
    out.update({f"prefill_tps.{k}": v["prefill_tps"]["median"] for k, v in r["prefill"].items()})
    out.update({f"aggregate_decode_tps.{k}": v["aggregate_decode_tps"] for k, v in r["streams"].items()})
    return out


def test_speed_bench(bench_result, engine_endpoint, gate_run, gate_config):
    from core.atomic import write_json_atomic

    r = bench_result
    best = {}
    if BEST_KNOWN.exists():
        from core.schema import read_model

        # profile -> metric -> best-known median: read through the one TOML reader, numbers checked
        table = read_model(dict[str, dict[str, float]], BEST_KNOWN, "best-known bench medians", BestKnownError)
        best = table.get(engine_endpoint.profile, {})
    regress = bench.regressions(_medians(r), best, gate_config.bench.regression_ratio)
    r["regressions"] = regress
    r["best_known"] = best or None
    write_json_atomic(gate_run.folder.engine_bench_file, r)
    _plot(r, gate_run.folder.engine_bench_plot)
    gate_run.add(GateEntry("speed_bench", not r["invalid"] and not regress, profile=engine_endpoint.profile,
                           failures=[*r["invalid"], *regress], metrics=headline(_medians(r)), evidence=r))
    rows = [{"measure": f"decode {k}", "median": v["decode_tps"]["median"], "min": v["decode_tps"]["min"],
             "max": v["decode_tps"]["max"], "ttft_s": v["ttft_s"]["median"], "identical_texts": v["identical_texts"]}
            for k, v in r["decode"].items()]
    rows += [{"measure": f"prefill {k} tokens", "median": v["prefill_tps"]["median"], "min": v["prefill_tps"]["min"],
              "max": v["prefill_tps"]["max"], "ttft_s": v["ttft_s"]["median"]} for k, v in r["prefill"].items()]
    rows += [{"measure": f"{k} streams aggregate decode", "median": v["aggregate_decode_tps"],
              "ttft_s": v["ttft_p50"], "per_stream_p50": v["per_stream_decode_tps_p50"]} for k, v in r["streams"].items()]
    gate_run.add_section("Speed benches (gates.md §9)", rows,
                         f"{engine_endpoint.profile}: tok/s; {r['definitions']}; best-known: "
                         f"{'none recorded' if not best else len(best)}")
    assert not r["invalid"], "invalid bench measurements:\n" + "\n".join(r["invalid"])
    assert all(v["decode_tps"]["median"] and v["decode_tps"]["median"] > 0 for v in r["decode"].values())
    assert set(r["streams"]) == {str(n) for n in gate_config.bench.streams}
    assert not regress, "speed regression:\n" + "\n".join(regress)


def test_speed_bench_refuses_cached_prefill(engine_client, gate_tokenizer):
    """Violation: a prefill prompt sent twice under one salt is served from the prefix cache on the second
    send; that measurement must be refused, not reported as a (too fast) prefill speed."""
    import uuid

    from panels.bench import prefill_prompt

    ids = [int(x) for x in prefill_prompt(gate_tokenizer, 600).token_ids]
    salt = uuid.uuid4().hex
    first = _times(_engine.stream(engine_client, ids, 1, salt=salt))
    second = _times(_engine.stream(engine_client, ids, 1, salt=salt))
    assert bench.prefill_tps(first) > 0
    assert second.cached and second.cached > 0
    with pytest.raises(bench.BenchInvalid, match="prefix cache"):
        bench.prefill_tps(second)
