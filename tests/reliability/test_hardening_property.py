"""Hardening, property style: a valid record, panel and config mutated at random (types, ranges, keys, bytes)
either is refused with a named error (a `core.errors.UserError`) or gives exactly the unmutated result —
never another exception (a traceback) and never a different number.

Value mutations draw only values that cannot be right (a positive logprob, NaN, an id below the padding
mark, a wrong type ...): a valid edit legitimately changes the result and proves nothing here. Byte-level
mutations of a record are arbitrary: the record's content hash turns every change of a number into an error.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import tomllib
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from core import metrics
from core.bands import load_bands
from core.errors import UserError
from core.records import Record
from oracle.dsv41.config import ModelConfig
from panels.store import content_hash, load_manifest_panel, parse_jsonl
from tests.core.recordkit import pair_of_records

REPO = Path(__file__).resolve().parents[2]
SETTINGS = settings(max_examples=80, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


def _result(ref: Record, eng: Record) -> dict:
    pm = metrics.position_metrics(ref, eng)
    return {f.name: np.asarray(getattr(pm, f.name)) for f in dataclasses.fields(pm)}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        x.shape == y.shape and (np.array_equal(x, y, equal_nan=True) if x.dtype.kind in "fc" else np.array_equal(x, y))
        for x, y in ((a[k], b[k]) for k in a))


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("prop")
    ref, eng, _ = pair_of_records(np.random.default_rng(3), n_seq=3, length=10, vocab=40, k_ref=16, k_eng=5)
    ref.save(d / "ref.safetensors")
    eng.save(d / "eng.safetensors")
    ref, eng = Record.load(d / "ref.safetensors"), Record.load(d / "eng.safetensors")
    return d, ref, eng, _result(ref, eng)


def _check(ref_path: Path, eng_path: Path, expected: dict) -> str:
    """'error' for a named refusal, 'same' for the unchanged result; anything else fails the test."""
    try:
        ref, eng = Record.load(ref_path), Record.load(eng_path)
        got = _result(ref, eng)
    except UserError as exc:
        event(f"named error: {type(exc).__name__}")
        return "error"
    assert _same(got, expected), "a mutated record gave a different number without an error"
    event("unchanged result")
    return "same"


# ----------------------------------------------------------------------------- records: bytes
@SETTINGS
@given(data=st.data())
def test_record_bytes_mutated_at_random(pair, tmp_path, data):
    d, _, _, expected = pair
    which = data.draw(st.sampled_from(["ref", "eng"]))
    raw = bytearray((d / f"{which}.safetensors").read_bytes())
    kind = data.draw(st.sampled_from(["flip", "overwrite", "truncate", "insert", "delete"]))
    at = data.draw(st.integers(0, len(raw) - 1))
    if kind == "flip":
        raw[at] ^= 1 << data.draw(st.integers(0, 7))
    elif kind == "overwrite":
        chunk = data.draw(st.binary(min_size=1, max_size=16))
        raw[at:at + len(chunk)] = chunk
    elif kind == "truncate":
        del raw[at:]
    elif kind == "insert":
        raw[at:at] = data.draw(st.binary(min_size=1, max_size=16))
    else:
        del raw[at:at + data.draw(st.integers(1, 16))]
    bad = tmp_path / f"{which}-mut.safetensors"
    bad.write_bytes(bytes(raw))
    paths = {"ref": d / "ref.safetensors", "eng": d / "eng.safetensors", which: bad}
    _check(paths["ref"], paths["eng"], expected)


# ----------------------------------------------------------------------------- records: values and types
INVALID_LOGPROBS = [float("nan"), float("inf"), 0.5, 3.0, 1e30]
ARRAY_MUTATIONS = {
    "topk_logprobs": INVALID_LOGPROBS,
    "actual_logprob": INVALID_LOGPROBS,
    "topk_ids": [-2, -1000, "dup"],
    "actual_rank": [0, -3],
    "pos_index": [0, 10, 999, -1],
    "pos_seq": [-1, 3, 77],
    "token_ids": [-1, -50],
}


@SETTINGS
@given(data=st.data())
def test_record_values_mutated_to_impossible_ones(pair, tmp_path, data):
    d, ref, eng, expected = pair
    which = data.draw(st.sampled_from(["ref", "eng"]))
    rec = copy.copy(ref if which == "ref" else eng)
    name = data.draw(st.sampled_from(sorted(ARRAY_MUTATIONS)))
    arr = np.array(getattr(rec, name))
    idx = tuple(data.draw(st.integers(0, n - 1)) for n in arr.shape)
    value = data.draw(st.sampled_from(ARRAY_MUTATIONS[name]))
    if value == "dup":
        value = arr[idx[0], (idx[1] + 1) % arr.shape[1]]
    if name == "pos_index" and value == 0 and arr[idx] == 0:
        value = 999
    arr[idx] = value
    setattr(rec, name, arr)
    rec.save(tmp_path / "mut.safetensors")
    paths = {"ref": d / "ref.safetensors", "eng": d / "eng.safetensors", which: tmp_path / "mut.safetensors"}
    assert _check(paths["ref"], paths["eng"], expected) == "error"


@SETTINGS
@given(data=st.data())
def test_record_metadata_keys_and_types_mutated(pair, tmp_path, data):
    from safetensors import safe_open
    from safetensors.numpy import load_file, save_file

    d, _, _, expected = pair
    src = d / "eng.safetensors"
    with safe_open(str(src), framework="numpy") as f:
        meta = dict(f.metadata())
    prov = json.loads(meta["provenance"])
    hostile = st.one_of(st.integers(), st.none(), st.booleans(), st.lists(st.integers(), max_size=2),
                        st.dictionaries(st.text(max_size=3), st.integers(), max_size=2), st.floats())
    op = data.draw(st.sampled_from(["drop", "rename", "add", "retype", "meta_k", "meta_ids", "meta_drop"]))
    key = data.draw(st.sampled_from(sorted(prov)))
    if op == "drop":
        prov.pop(key)
    elif op == "rename":
        prov[key + data.draw(st.text(min_size=1, max_size=4))] = prov.pop(key)
    elif op == "add":
        prov[data.draw(st.text(min_size=1, max_size=8).filter(lambda k: k not in prov))] = "x"
    elif op == "retype":
        value = data.draw(hostile)
        if isinstance(value, type(prov[key])) and not isinstance(value, bool):
            value = [value]
        prov[key] = value
    elif op == "meta_k":
        meta["k"] = data.draw(st.sampled_from(["0", "-1", "x", "5.0", "", "3", "7"]))
    elif op == "meta_ids":
        meta[data.draw(st.sampled_from(["seq_ids", "domains"]))] = data.draw(
            st.sampled_from(["[1, 2, 3]", "{}", "nope", '["s0"]', '["s0", "s0", "s1"]']))
    else:
        meta.pop(data.draw(st.sampled_from(sorted(meta))))
    meta["provenance"] = json.dumps(prov)
    save_file(load_file(str(src)), str(tmp_path / "m.safetensors"), metadata=meta)
    result = _check(d / "ref.safetensors", tmp_path / "m.safetensors", expected)
    if op in ("rename", "add", "retype", "meta_k", "meta_ids"):   # an optional key dropped keeps its default
        assert result == "error", (op, key)


# ----------------------------------------------------------------------------- panels
@pytest.fixture(scope="module")
def panel_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("panel")
    lines = (REPO / "panels" / "data" / "default-1.jsonl").read_text(encoding="utf-8").split("\n")[:3]
    (d / "p-1.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    items = parse_jsonl(d / "p-1.jsonl")
    (d / "p-1.manifest.json").write_text(json.dumps({"name": "p", "version": 1, "file": "p-1.jsonl",
                                                      "content_hash": content_hash(items)}))
    return d, items


@SETTINGS
@given(data=st.data())
def test_panel_bytes_and_fields_mutated_at_random(panel_dir, tmp_path, data):
    src, items = panel_dir
    d = tmp_path / "p"
    d.mkdir(exist_ok=True)
    files = {n: (src / n).read_bytes() for n in ("p-1.jsonl", "p-1.manifest.json")}
    target = data.draw(st.sampled_from(sorted(files)))
    raw = bytearray(files[target])
    kind = data.draw(st.sampled_from(["bytes", "field"]))
    if kind == "bytes":
        at = data.draw(st.integers(0, len(raw)))
        raw[at:at + data.draw(st.integers(0, 4))] = data.draw(st.binary(min_size=1, max_size=8))
    else:
        lines = bytes(raw).decode().split("\n")
        i = data.draw(st.integers(0, len([ln for ln in lines if ln.strip()]) - 1))
        obj = json.loads(lines[i])
        key = data.draw(st.sampled_from(sorted(obj)))
        obj[key] = data.draw(st.one_of(st.integers(), st.none(), st.lists(st.text(max_size=3), max_size=2),
                                       st.text(max_size=5), st.just("\ud800")))
        lines[i] = json.dumps(obj)
        raw = bytearray("\n".join(lines).encode("utf-8", "surrogatepass"))
    files[target] = bytes(raw)
    for n, b in files.items():
        (d / n).write_bytes(b)
    try:
        panel = load_manifest_panel(d / "p-1.manifest.json")
    except UserError as exc:
        event(f"named error: {type(exc).__name__}")
        return
    event("unchanged result")
    assert panel.items == items and panel.content_hash == content_hash(items)


# ----------------------------------------------------------------------------- configs
BANDS = (REPO / "gates" / "bands.toml").read_text(encoding="utf-8")
BANDS_EXPECTED = {p: tomllib.loads(BANDS)["profiles"][p] for p in tomllib.loads(BANDS)["profiles"]}
BAND_VALUES = st.one_of(st.sampled_from(['"0.1"', "true", "[0.1]", "{ a = 1 }", "-0.5", "inf", "nan", "-inf",
                                         "1e309", "-1"]), st.text(min_size=1, max_size=4).map(json.dumps))


@SETTINGS
@given(data=st.data())
def test_bands_mutated_at_random(tmp_path, data):
    lines = BANDS.split("\n")
    assignments = [i for i, ln in enumerate(lines) if "=" in ln and not ln.lstrip().startswith("#")]
    i = data.draw(st.sampled_from(assignments))
    key, _, _ = lines[i].partition("=")
    op = data.draw(st.sampled_from(["value", "key", "byte", "table"]))
    if op == "value":
        value = data.draw(BAND_VALUES)
        if key.strip() == "top1_decided" and value == "-0.5":
            value = "1.5"
        lines[i] = f"{key}= {value}"
    elif op == "key":
        lines[i] = f"{key.strip()}{data.draw(st.sampled_from(['_x', 's', '2', 'X']))} = 0.1"
    elif op == "table":
        headers = [j for j, ln in enumerate(lines) if ln.startswith("[profiles.")]
        j = data.draw(st.sampled_from(headers))
        lines[j] = lines[j].replace(".default]", f".{data.draw(st.sampled_from(['mathh', 'Code', 'x', 'prose']))}]")
    text = "\n".join(lines).encode()
    if op == "byte":
        at = data.draw(st.integers(0, len(text)))
        text = text[:at] + data.draw(st.sampled_from([b"\xff", b"\xc3", b"\x00", b"\xfe\xff"])) + text[at:]
    path = tmp_path / "bands.toml"
    path.write_bytes(text)
    profile = data.draw(st.sampled_from(sorted(BANDS_EXPECTED)))
    try:
        bands = load_bands(profile, path)
    except UserError as exc:
        event(f"named error: {type(exc).__name__}")
        return
    # every mutation above makes the file invalid, so reaching here means an invalid file was accepted;
    # the comparison shows what it would have judged with
    expected = BANDS_EXPECTED[profile]
    assert {d: dataclasses.asdict(b) for d, b in bands.items()} == {
        d: {k: float(v) for k, v in b.items()} for d, b in expected.items()}
    pytest.fail(f"mutation {op} of line {i} ({lines[i]!r}) was accepted")


TINY = {k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(ModelConfig.tiny()).items()
        if k != "extra"}


@SETTINGS
@given(data=st.data())
def test_checkpoint_config_mutated_at_random(data):
    cfg = dict(TINY)
    key = data.draw(st.sampled_from(sorted(cfg)))
    op = data.draw(st.sampled_from(["retype", "rename", "add"]))
    if op == "retype":
        old = cfg[key]
        candidates = [v for v in ("7", True, None, [1, "x"], {"a": 1}, 2.5, [], "fp8", 3)
                      if not (type(v) is type(old) and (not isinstance(v, list) or all(isinstance(x, int) for x in v)))
                      and not (isinstance(old, float) and type(v) is int)
                      and not (key == "expert_dtype" and v is None)]
        cfg[key] = data.draw(st.sampled_from(candidates))
    elif op == "rename":
        cfg[key + data.draw(st.sampled_from(["_", "s", "X", "_ids"]))] = cfg.pop(key)
    else:
        cfg[data.draw(st.text(min_size=1, max_size=6).filter(lambda k: k not in cfg and not k.startswith("ds41_")))] = 1
    try:
        got = ModelConfig.from_dict(cfg)
    except UserError as exc:
        event(f"named error: {type(exc).__name__}")
        return
    event("unchanged result")
    assert got == ModelConfig.from_dict(dict(TINY)), (op, key, cfg.get(key))
