"""`ds41gate localize`: name the first layer and module where an engine leaves the oracle (docs/DESIGN.md,
"The divergence localizer").

    ds41gate localize --engine-profile vllm-cpu-fp32 --panel-item code-03 --out out/loc
    ds41gate localize --engine-profile vllm-cpu-fp32 --engine-env DS41_PERTURB_LAYER=15 \\
        --engine-env DS41_PERTURB_MODULE=mlp --prompt "The capital of France" --out out/loc-planted

Steps: the profile's vLLM runs the prompt in process with hooks on every decoder layer (engine/localize.py ->
engine/localize_runner.py, the engine's own venv, one model load for every case); the oracle of the profile's
model (transformers for SmolLM2, the DeepSeek oracle for vllm-cpu-dsv4) captures the same sites in fp32, and its
own run at the floor precision (fp64 for an fp32 engine, bf16 / reference-bf16 otherwise) gives the per-layer
noise floor (oracle/capture.py); core/localize.py compares them and decides; reports/localize.py draws.
Writes DIR/localize.json (core.localize.LocalizeRecord, ``ds41-localize/2``), DIR/localize.png (prefill) and,
with a decode step, DIR/localize-decode.png, and DIR/localize.md.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import typer

from core.errors import UserError
from core.localize import (
    DEFAULT_FALSE_ALARM,
    ORACLE_ALLOWANCE,
    LocalizeRecord,
    decide,
    greedy_differences,
    localize_sites,
    parse_key,
)
from core.redact import redact_data

DEFAULT_PROFILE = "vllm-cpu-fp32"


def _say(msg: str) -> None:
    import sys

    print(f"[localize] {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------ what to compare

def oracle_for(profile: str) -> tuple[str, Path, str]:
    """(oracle kind, the folder it loads, the tokenizer spec) of a profile's model: its [gate] target."""
    from engine.target import resolve_gate_target

    t = resolve_gate_target(profile, encode=False)
    return t.oracle, t.model_dir, t.tokenizer


def floor_precision(kind: str, engine_dtype: str) -> str:
    """The oracle's own run that an honest engine of this precision may differ like (the oracle kind's word)."""
    from oracle.kinds import oracle_kind

    return oracle_kind(kind).floor_precision(engine_dtype)


def prompt_ids(profile: str, prompt: str | None = None, panel_item: str | None = None, panel: str | None = None,
               max_tokens: int | None = None) -> tuple[list[int], dict]:
    """The prompt's token ids and where they came from: raw ``prompt`` text through the model's tokenizer, or a
    panel item exactly as the gates encode it."""
    if (prompt is None) == (panel_item is None):
        raise UserError("localize: give exactly one of --prompt TEXT and --panel-item SEQ_ID")
    if prompt is not None:
        from panels import load_tokenizer

        _, _, tok_spec = oracle_for(profile)
        ids = list(load_tokenizer(tok_spec).tokenizer.encode(prompt, add_special_tokens=False).ids)
        source = {"kind": "prompt", "text": prompt[:400]}
    else:
        from engine.target import resolve_gate_target

        encoded = resolve_gate_target(profile, panel).encoded
        seq = next((s for s in encoded.sequences if s.seq_id == panel_item), None)
        if seq is None:
            raise UserError(f"localize: panel {encoded.panel_name}@{encoded.panel_version} has no item "
                            f"{panel_item!r} (items: {[s.seq_id for s in encoded.sequences][:12]}…)")
        ids = list(seq.token_ids)
        source = {"kind": "panel_item", "panel": f"{encoded.panel_name}@{encoded.panel_version}",
                  "seq_id": panel_item, "domain": seq.domain}
    if max_tokens is not None:
        ids = ids[:max_tokens]
    if len(ids) < 2:
        raise UserError(f"localize: the prompt has {len(ids)} token(s); at least 2 are needed")
    return ids, source


def token_texts(profile: str, ids: Sequence[int]) -> list[str]:
    from panels import load_tokenizer

    _, _, tok_spec = oracle_for(profile)
    tok = load_tokenizer(tok_spec).tokenizer
    return [tok.decode([int(i)], skip_special_tokens=False) for i in ids]


def _capturer(kind: str, model_dir: Path, precision: str, base=None):
    """The oracle's captures of ``ids + [decode token]`` at one precision, as the oracle kind makes them
    (oracle/kinds.py: one load per capturer; ``base`` an fp32 capturer of the same folder whose load is copied)."""
    from oracle.kinds import oracle_kind

    return oracle_kind(kind).capturer(model_dir, precision, base=base)


class _Phased(Mapping):
    """The oracle's ``L<i>.<site>`` rows of ``ids + [decode token]`` as ``prefill/…`` (rows :n) and ``decode/…``
    (row n), fetched from the underlying mapping on each access: over a SpillCaptures, one site read at a time."""

    def __init__(self, acts: Mapping[str, Any], n: int, decode: bool):
        self.acts, self.n = acts, n
        self._keys = {f"{ph}/{k}": (ph, k) for k in acts for ph in (("prefill", "decode") if decode else ("prefill",))}

    def __getitem__(self, key: str):
        phase, k = self._keys[key]
        v = self.acts[k]
        return v[:self.n] if phase == "prefill" else v[self.n:self.n + 1]

    def __iter__(self):
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)


def _phased(acts: Mapping[str, Any], n: int, decode: bool) -> Mapping:
    return _Phased(acts, n, decode)


def _to_numpy(t) -> Any:
    """[n, ...] -> [n, width] (DeepSeek's hyper-connection streams [n, hc, d] compare as one row per position)."""
    a = t.numpy() if hasattr(t, "numpy") else t
    return a.reshape(a.shape[0], -1)


class _OnlyPrefill(Mapping):
    """A capture mapping without its decode rows (A/B arms whose first tokens differ decode different inputs)."""

    def __init__(self, acts: Mapping[str, Any]):
        self.acts = acts
        self._keys = [k for k in acts if k.startswith("prefill/")]
        if callable(getattr(acts, "row_view", None)):     # the logits keep being read in row chunks
            self.row_view = self._row_view

    def __getitem__(self, key: str):
        if key not in self._keys:
            raise KeyError(key)
        return self.acts[key]

    def _row_view(self, key: str):
        if key not in self._keys:
            raise KeyError(key)
        return self.acts.row_view(key)

    def __iter__(self):
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)


def check_layers(profile: str, layers: Sequence[int] | None) -> None:
    """``--layers`` inside the model: an index past the end is an error naming the range (never wrapped)."""
    if layers is None:
        return
    n = n_decoder_layers(profile)
    bad = [i for i in layers if not -n <= i < n]
    if bad:
        raise UserError(f"--layers {','.join(map(str, bad))}: {profile}'s model has {n} decoder layers "
                        f"(0..{n - 1}, or -{n}..-1 from the end)")


def check_fault_applied(inv, rc: dict, case: dict) -> None:
    """A run that asked for a fault through DS41_PERTURB_* must have it: the plugin reports the module it
    perturbed. A plugin the engine never loaded (VLLM_PLUGINS=none, not installed) leaves no target: ERROR,
    rather than a clean-looking record of a fault that never ran."""
    from engine.localize import PERTURB_ENV

    asked = {k: inv.profile_env[k] for k in PERTURB_ENV if k in inv.profile_env}
    if case.get("perturb") != "env" or "DS41_PERTURB_LAYER" not in asked:
        return
    state = rc.get("perturb") or {}
    plugins = inv.env.get("VLLM_PLUGINS")
    if state.get("target") is None:
        raise UserError(f"localize: the run asked for a fault ({', '.join(f'{k}={v}' for k, v in asked.items())}) "
                        f"but the engine did not apply it (plugin state {state}"
                        f"{'; VLLM_PLUGINS=' + repr(plugins) + ' in its environment' if plugins is not None else ''}"
                        "); the record would describe an unperturbed engine")
    want = int(asked["DS41_PERTURB_LAYER"])
    n = int(state.get("n_layers") or 0)
    if n and (want % n != state.get("layer") or asked.get("DS41_PERTURB_MODULE") != state.get("module")):
        raise UserError(f"localize: the fault asked for ({asked}) is not the one the engine applied ({state})")


def _oracle_greedy(o_acts: Mapping, n: int, decode: bool) -> list[int]:
    """The reference's greedy tokens at the engine's sampling points: the last prompt position, the decode row."""
    import numpy as np

    out = [int(np.argmax(_to_numpy(o_acts["prefill/logits"])[n - 1]))] if "prefill/logits" in o_acts else []
    if decode and "decode/logits" in o_acts and out:
        out.append(int(np.argmax(_to_numpy(o_acts["decode/logits"])[0])))
    return out


def run_localize(profile: str, ids: Sequence[int], source: dict, work: Path,
                 cases: Sequence[dict] = ({"name": "run", "perturb": "env"},), flags: Sequence[str] = (),
                 engine_env: Mapping[str, str] | None = None, false_alarm_rate: float = DEFAULT_FALSE_ALARM,
                 floor: str | None = None, decode: bool = True, layers: Sequence[int] | None = None,
                 echo: Callable[[str], None] = _say) -> dict[str, LocalizeRecord]:
    """Oracle mode. Every case through ONE engine process, the oracle and its floor once per distinct decode
    token; one LocalizeRecord per case. Memory: one site's captures at a time on every side: the engine's hooks
    and the oracle's write each site to disk as it fires (``work/captures``, ``work/oracle``) and the comparison
    reads the engine's, the oracle's and the floor's rows back one site at a time. ``layers``: capture only these
    decoder layers (less time and disk; a first pass on a few layers, then the stretch between them, bisects)."""
    from core.version import code_version
    from engine.localize import LazyCaptures, engine_invocation, run_engine_captures

    t_all = time.perf_counter()
    check_layers(profile, layers)
    inv = engine_invocation(profile, flags, engine_env)
    kind, model_dir, _ = oracle_for(profile)
    floor = floor or floor_precision(kind, inv.dtype)
    echo(f"engine {profile} ({inv.dtype}) in process: {len(cases)} case(s), {len(ids)} prompt tokens "
         f"+ {'1 decode step' if decode else 'no decode'}")
    report = run_engine_captures(inv, ids, cases, Path(work), decode=decode, layers=layers)
    for case in cases:
        check_fault_applied(inv, report["cases"][case["name"]], case)
    echo(f"engine done in {report['wall_s']:.1f} s (load {report['load_s']:.1f} s); oracle {kind} fp32 and the "
         f"{floor} floor")
    oracle = _capturer(kind, model_dir, "fp32")
    floor_orc = _capturer(kind, model_dir, floor, base=oracle)   # captured after the fp32 oracle, from its load
    texts = token_texts(profile, ids)
    refs: dict[int | None, tuple[Mapping, Mapping]] = {}
    out: dict[str, LocalizeRecord] = {}
    for case in cases:
        name = case["name"]
        rc = report["cases"][name]
        tok = int(rc["generated_ids"][0]) if decode else None
        full = list(ids) + ([tok] if decode else [])
        if tok not in refs:
            t = time.perf_counter()
            spill = Path(work) / "oracle" / f"t{len(refs)}"
            if spill.exists():
                shutil.rmtree(spill)
            refs[tok] = (_phased(oracle.capture(full, layers, spill / "oracle"), len(ids), decode),
                         _phased(floor_orc.capture(full, layers, spill / "floor"), len(ids), decode))
            echo(f"oracle + floor captured in {time.perf_counter() - t:.1f} s")
        o_acts, f_acts = refs[tok]
        t = time.perf_counter()
        sites, per_row, cal = localize_sites(LazyCaptures(rc["file"]), o_acts, f_acts, false_alarm_rate,
                                             ORACLE_ALLOWANCE, to_numpy=_to_numpy)
        all_texts = texts + (token_texts(profile, [tok]) if decode else [])
        diffs = greedy_differences(rc["generated_ids"], _oracle_greedy(o_acts, len(ids), decode), "oracle")
        verdict = decide(sites, per_row, full, all_texts, output_differs=diffs)
        compare_s = time.perf_counter() - t
        engine = {"profile": profile, "flags": list(flags), "case": name, "dtype": inv.dtype,
                  "env": redact_data(dict(inv.profile_env)), "vllm": report.get("vllm"),
                  "perturb": rc.get("perturb"), "tweak": rc.get("tweak"), "generated_ids": rc.get("generated_ids"),
                  "rows_per_call": rc.get("rows_per_call"), "model": report.get("model"),
                  "ignored_args": report.get("ignored_args"), "spill_files": rc.get("spill_files"),
                  "runner_max_rss_mb": rc.get("max_rss_mb")}
        timings = {"engine_process_s": round(report["wall_s"], 3), "engine_load_s": round(report["load_s"], 3),
                   "engine_generate_s": round(rc["generate_s"], 3),
                   "oracle_load_s": round(oracle.load_s, 3), "oracle_forward_s": round(oracle.forward_s, 3),
                   "floor_load_s": round(floor_orc.load_s, 3), "floor_forward_s": round(floor_orc.forward_s, 3),
                   "compare_s": round(compare_s, 3), "total_s": round(time.perf_counter() - t_all, 3)}
        out[name] = LocalizeRecord(
            engine=engine, oracle=dict(oracle.info), floor=dict(floor_orc.info), calibration=cal,
            prompt={**source, "n_tokens": len(ids), "token_ids": list(ids), "decode_token_id": tok},
            verdict=verdict, sites=tuple(sites), timings=timings, created=_now(), code_version=code_version())
    shutil.rmtree(Path(work) / "oracle", ignore_errors=True)
    return out


BASE, REPEAT = "base", "base-repeat"


def run_ab(profile: str, ids: Sequence[int], source: dict, work: Path, flags: Sequence[str] = (),
           cases: Sequence[dict] = (), engine_env: Mapping[str, str] | None = None,
           false_alarm_rate: float = DEFAULT_FALSE_ALARM, decode: bool = True,
           layers: Sequence[int] | None = None, oracle_context: bool = True,
           echo: Callable[[str], None] = _say) -> dict[str, LocalizeRecord]:
    """A/B mode: the engine against itself. The base arm (the profile as it is) runs the prompt twice in one
    process: the first run is the reference, the second the floor (the engine's run-to-run spread; all zeros
    for a deterministic engine, so any difference departs). The test arms: ``flags`` (the profile with those
    flags: its own engine process) and/or ``cases`` (runner cases in the base arm's process, e.g. a weight
    ``tweak``). One LocalizeRecord per test arm (``flags`` -> key "flag"). ``oracle_context``: the oracle's
    distance to the base arm per site, beside the verdict (not part of it)."""
    from core.version import code_version
    from engine.localize import LazyCaptures, engine_invocation, run_engine_captures

    if not flags and not cases:
        raise UserError("localize A/B: nothing to compare the base arm with (give --flag F)")
    t_all = time.perf_counter()
    check_layers(profile, layers)
    inv_a = engine_invocation(profile, (), engine_env)
    base_cases = [{"name": BASE, "perturb": None}, {"name": REPEAT, "perturb": None}]
    for c in cases:
        if c["name"] in (BASE, REPEAT, "flag"):
            raise UserError(f"localize A/B: case name {c['name']!r} is reserved")
    echo(f"A/B on {profile}: base arm twice{' + ' + str(len(cases)) + ' case(s)' if cases else ''} in one "
         f"process, {len(ids)} prompt tokens + {'1 decode step' if decode else 'no decode'}")
    rep_a = run_engine_captures(inv_a, ids, base_cases + list(cases), Path(work) / "a", decode=decode,
                                layers=layers)
    arms = {c["name"]: (rep_a["cases"][c["name"]], rep_a, inv_a, ()) for c in cases}
    if flags:
        inv_b = engine_invocation(profile, flags, engine_env)
        echo(f"flag arm {list(flags)}: its own engine process")
        rep_b = run_engine_captures(inv_b, ids, [{"name": "flag", "perturb": None}], Path(work) / "b",
                                    decode=decode, layers=layers)
        arms["flag"] = (rep_b["cases"]["flag"], rep_b, inv_b, tuple(flags))
    base_rc = rep_a["cases"][BASE]
    base, repeat = LazyCaptures(base_rc["file"]), LazyCaptures(rep_a["cases"][REPEAT]["file"])
    tok = int(base_rc["generated_ids"][0]) if decode else None
    full = list(ids) + ([tok] if decode else [])
    texts = token_texts(profile, full)
    context, oracle_info = {}, {}
    if oracle_context:
        import numpy as np

        from core.localize import kl_per_position, metric_of, position_distances

        kind, model_dir, _ = oracle_for(profile)
        orc = _capturer(kind, model_dir, "fp32")
        o_acts = _phased(orc.capture(full, layers, Path(work) / "oracle"), len(ids), decode)
        for k in sorted(set(o_acts) & set(base)):
            t, r = _to_numpy(base[k]), _to_numpy(o_acts[k])
            d = kl_per_position(t, r) if metric_of(parse_key(k)[2]) == "kl" else position_distances(t, r)[0]
            context[k] = float(np.mean(d))
        oracle_info = {**orc.info, "role": "context: the base arm's distance to it per site (mean), not the verdict"}
        shutil.rmtree(Path(work) / "oracle", ignore_errors=True)
    out: dict[str, LocalizeRecord] = {}
    for name, (rc, rep, inv, arm_flags) in arms.items():
        t = time.perf_counter()
        test, ref, flo = LazyCaptures(rc["file"]), base, repeat
        diffs = greedy_differences(rc["generated_ids"], base_rc["generated_ids"], "base arm")
        same_first = not decode or int(rc["generated_ids"][0]) == tok
        if not same_first:   # the decode step of each arm read a different token: only the prefill compares
            test, ref, flo = _OnlyPrefill(test), _OnlyPrefill(ref), _OnlyPrefill(flo)
        sites, per_row, cal = localize_sites(test, ref, flo, false_alarm_rate, to_numpy=_to_numpy)
        verdict = decide(sites, per_row, full if same_first else list(ids), texts if same_first else texts[:len(ids)],
                         output_differs=diffs)
        engine = {"profile": profile, "flags": list(arm_flags), "case": name, "dtype": inv.dtype,
                  "env": redact_data(dict(inv.profile_env)), "vllm": rep.get("vllm"),
                  "perturb": rc.get("perturb"), "tweak": rc.get("tweak"), "generated_ids": rc.get("generated_ids"),
                  "base_generated_ids": base_rc.get("generated_ids"), "decode_compared": same_first,
                  "model": rep.get("model"), "runner_max_rss_mb": rc.get("max_rss_mb"),
                  "base_runner_max_rss_mb": rep_a["cases"][BASE].get("max_rss_mb")}
        timings = {"base_process_s": round(rep_a["wall_s"], 3), "test_process_s": round(rep["wall_s"], 3),
                   "compare_s": round(time.perf_counter() - t, 3), "total_s": round(time.perf_counter() - t_all, 3)}
        out[name] = LocalizeRecord(
            engine=engine, oracle=oracle_info, floor={"precision": "engine run-to-run", "run": REPEAT,
                                                      "of": BASE},
            calibration=cal, prompt={**source, "n_tokens": len(ids), "token_ids": list(ids), "decode_token_id": tok},
            verdict=verdict, sites=tuple(sites), timings=timings, mode="ab", context=context, created=_now(),
            code_version=code_version())
    return out


def _now() -> str:
    import datetime as dt

    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def write_outputs(rec: LocalizeRecord, out_dir: Path) -> dict[str, Path]:
    from core.atomic import atomic_write_text
    from reports.localize import markdown, write_plot

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": rec.save(out_dir / "localize.json"), "plot": write_plot(rec, out_dir / "localize.png")}
    if any(s.phase == "decode" for s in rec.sites):
        paths["plot_decode"] = write_plot(rec, out_dir / "localize-decode.png", phase="decode")
    atomic_write_text(out_dir / "localize.md", markdown(rec))
    paths["markdown"] = out_dir / "localize.md"
    return paths


# ------------------------------------------------------------------------------------------ worst prompt

def worst_prompt(reference, engine_record) -> tuple[str, float]:
    """The sequence with the largest mean KL_part of the engine against the reference (the KL gate's worst)."""
    import numpy as np

    from core import metrics

    pm = metrics.position_metrics(reference, engine_record)
    keep = np.isfinite(pm.kl_part) & ~pm.ambiguous
    means = metrics.per_prompt_means(pm.kl_part[keep], pm.seq[keep], len(reference.seq_ids))
    means = np.where(np.isfinite(means), means, -np.inf)
    i = int(np.argmax(means))
    return reference.seq_ids[i], float(means[i])


# ------------------------------------------------------------------------------------------ the command

def _layer_list(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"--layers {text!r}: expected comma-separated layer indices, e.g. 0,8,16") from None
    if not out:
        raise UserError("--layers: no layer given")
    return out


def _env_pairs(items: Sequence[str]) -> dict[str, str]:
    out = {}
    for item in items:
        k, eq, v = item.partition("=")
        if not eq or not k:
            raise UserError(f"--engine-env {item!r}: expected KEY=VALUE")
        out[k] = v
    return out


def localize_cmd(
    out: Path = typer.Option(..., "--out", help="folder for localize.json, localize.png, localize.md"),
    engine_profile: str = typer.Option(DEFAULT_PROFILE, "--engine-profile", help="a vLLM profile (engine/profiles/)"),
    engine_flag: list[str] = typer.Option([], "--engine-flag", help="profile flag the engine runs with (repeatable)"),
    engine_env: list[str] = typer.Option([], "--engine-env", help="KEY=VALUE added to the engine's environment "
                                         "(repeatable), e.g. DS41_PERTURB_LAYER=15 DS41_PERTURB_MODULE=mlp"),
    prompt: str = typer.Option(None, "--prompt", help="raw prompt text (the model's tokenizer, no chat template)"),
    prompt_file: Path = typer.Option(None, "--prompt-file", help="raw prompt text read from a UTF-8 file"),
    panel_item: str = typer.Option(None, "--panel-item", help="a panel sequence id, encoded as the gates encode it"),
    panel: str = typer.Option(None, "--panel", help="panel name[@version] for --panel-item (default: the profile's)"),
    max_prompt_tokens: int = typer.Option(None, "--max-prompt-tokens", help="cut the prompt to this many tokens"),
    flag: list[str] = typer.Option([], "--flag", help="A/B mode: localize where the profile with this flag "
                                   "(repeatable) leaves the profile without it; the floor is the engine's own "
                                   "run-to-run spread"),
    false_alarm_rate: float = typer.Option(DEFAULT_FALSE_ALARM, "--false-alarm-rate",
                                           help="the chance per run that an engine distributed like its floor "
                                                "has a site named (sets every site's threshold)"),
    floor: str = typer.Option(None, "--floor", help="the floor's precision (default: fp64 for fp32 engines, "
                              "bf16 otherwise; reference-bf16 for the DeepSeek oracle)"),
    no_decode: bool = typer.Option(False, "--no-decode", help="prefill only (no decode step)"),
    keep_captures: bool = typer.Option(False, "--keep-captures", help="keep the engine's raw per-site rows "
                                       "(DIR/work/captures/*.safetensors)"),
    layers: str = typer.Option(None, "--layers", help="only these decoder layers, e.g. 0,8,16,24 (default: all)"),
) -> None:
    """Name the first site (embedding, layer and module, final norm, logits) where the engine leaves the oracle
    (or, with --flag, where the flag-on engine leaves the flag-off one), for one prompt."""
    if prompt_file is not None:
        if prompt is not None:
            raise UserError("localize: give --prompt or --prompt-file, not both")
        prompt = Path(prompt_file).read_text(encoding="utf-8")
    ids, source = prompt_ids(engine_profile, prompt, panel_item, panel, max_prompt_tokens)
    check_layers(engine_profile, _layer_list(layers))
    if flag:
        if engine_flag or floor:
            raise UserError("localize --flag (A/B mode): --engine-flag and --floor belong to oracle mode; the base "
                            "arm is the profile as it is and the floor its own second run")
        rec = run_ab(engine_profile, ids, source, Path(out) / "work", flags=flag, engine_env=_env_pairs(engine_env),
                     false_alarm_rate=false_alarm_rate, decode=not no_decode, layers=_layer_list(layers))["flag"]
    else:
        rec = run_localize(engine_profile, ids, source, Path(out) / "work", flags=engine_flag,
                           engine_env=_env_pairs(engine_env), false_alarm_rate=false_alarm_rate, floor=floor,
                           decode=not no_decode, layers=_layer_list(layers))["run"]
    paths = write_outputs(rec, Path(out))
    if not keep_captures:
        import shutil

        for sub in ("captures", "a/captures", "b/captures"):
            shutil.rmtree(Path(out) / "work" / sub, ignore_errors=True)
    from reports.localize import headline

    typer.echo(headline(rec))
    typer.echo(f"record: {paths['json']}\nplot:   {paths['plot']}")


# ------------------------------------------------------------------------------------------ planted faults

def n_decoder_layers(profile: str) -> int:
    """The profile's model's decoder-layer count, from its config.json."""
    import json

    _, model_dir, _ = oracle_for(profile)
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    for key in ("num_hidden_layers", "n_layers", "num_layers"):
        if key in cfg:
            return int(cfg[key])
    raise UserError(f"{model_dir}/config.json: no layer count (num_hidden_layers)")


def planted_cases(n_layers: int, scale: float = 1e-3) -> list[dict]:
    """The can-fail: the first, a middle and the last layer x (attn, mlp), plus the fault off ("clean")."""
    cases = [{"name": "clean", "perturb": None}]
    for layer in (0, n_layers // 2, n_layers - 1):
        for module in ("attn", "mlp"):
            cases.append({"name": f"L{layer}.{module}",
                          "perturb": {"layer": layer, "module": module, "scale": scale}})
    return cases


def planted_table(recs: Mapping[str, LocalizeRecord], cases: Sequence[dict]) -> list[dict]:
    """One row per case: the planted (layer, module), what the localizer named, distance/floor there and at the
    layer before, and whether the naming is exact (the clean case: exact when nothing is named)."""
    rows = []
    for case in cases:
        rec = recs[case["name"]]
        v = rec.verdict
        want = case.get("perturb")
        planted = (want["layer"], want["module"]) if isinstance(want, dict) else (None, None)
        named = (v.first_divergent_layer, v.first_divergent_module)
        rows.append({"engine": rec.engine.get("profile"), "case": case["name"], "planted_layer": planted[0],
                     "planted_module": planted[1], "named_layer": named[0], "named_module": named[1],
                     "phase": v.phase, "ratio_at_named": v.ratio_at_first, "ratio_layer_before": v.ratio_before,
                     "status": v.status,
                     "max_ratio": v.max_ratio, "max_ratio_site": v.max_ratio_site,
                     "plugin_target": (rec.engine.get("perturb") or {}).get("target"),
                     "exact": named == planted})
    return rows
