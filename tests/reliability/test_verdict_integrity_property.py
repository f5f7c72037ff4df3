"""Verdict integrity, property style (issue 27): for any mutation of the engine's responses or of the records,
the outcome is a named error (a `core.errors.UserError` or an `engine.errors.EngineError`) or the unmutated
verdict — never a PASS that the unmutated input would not give.

The whole path runs on every example: the engine's JSON answers are served by a real HTTP server on 127.0.0.1
and scored by `engine.client.score_panel` (transport guard, strict JSON, the vLLM adapter's parser, the record
writer); the record is saved and loaded (`Record.load`: hash, dtypes, values) and judged against an exact fp32
reference with `core.verdicts.judge` under a band the unmutated engine FAILs by far (every position carries
KL ≈ 0.3 against a band of 0.01), so a valid-looking edit cannot legitimately bring it to a PASS.

Mutations of the responses: a field deleted, a value of another type, a prompt-logprob id changed (in and out
of the vocabulary, 10^9, negative, zero-padded, not a number), NaN / ±Infinity / 1e999, positions or echoed
ids added, dropped, duplicated or nulled, the body cut short. Mutations of the records: array dtypes (float16,
float32, int32, uint64 …), ids set outside the vocabulary, provenance `vocab_size` changed, the content hash
dropped, rows dropped, NaN written — with the hash recomputed (a "whole" edited file) or left stale.
"""

from __future__ import annotations

import copy
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from core.errors import UserError
from core.records import Provenance, Record, RecordError, _content_sha256
from core.verdicts import judge
from engine.client import ClientConfig, EngineClient, EngineSource, RetryPolicy, score_panel
from engine.errors import EngineError
from panels import EncodedPanel, EncodedSequence
from tests.core.recordkit import sequence_from_full
from tests.engine.test_client_malformed import MODEL, VOCAB, distribution

K = 3
SEQS = [("s0", "code", [5, 17, 3, 29, 11, 8]), ("s1", "prose", [2, 9, 4, 33, 1, 20, 7]),
        ("s2", "code", [12, 0, 6, 39, 21])]
BANDS = """[profiles.default.default]
kl_mean = 0.01
kl_p99 = 0.1
top1_decided = 0.9
ln_ppl = 0.01
"""
SETTINGS = settings(max_examples=120, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


# ============================================================================================ the unmutated input
def engine_distribution(prefix: tuple[int, ...]) -> np.ndarray:
    """The engine under test: the reference distribution with strong deterministic noise (KL ≈ 0.3)."""
    rng = np.random.default_rng(1 + sum((i + 1) * t for i, t in enumerate(prefix)))
    logits = distribution(prefix) + rng.normal(0, 1.0, VOCAB)
    return logits - np.logaddexp.reduce(logits)


def response(ids: list[int]) -> dict:
    """A vLLM 0.32 prompt_logprobs answer (the shape of tests/engine/test_client_malformed.py) for the engine."""
    plp: list[Any] = [None]
    for i in range(1, len(ids)):
        lp = engine_distribution(tuple(ids[:i]))
        rk = 1 + (lp[None, :] > lp[:, None]).sum(axis=1)
        entry = {str(ids[i]): {"logprob": float(lp[ids[i]]), "rank": int(rk[ids[i]]), "decoded_token": "x"}}
        for t in np.argsort(-lp)[:K]:
            entry[str(int(t))] = {"logprob": float(lp[t]), "rank": int(rk[t]), "decoded_token": "y"}
        plp.append(entry)
    return {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": MODEL,
            "choices": [{"index": 0, "text": "z", "logprobs": None, "finish_reason": "length", "token_ids": [3],
                         "prompt_logprobs": plp, "prompt_token_ids": list(ids)}],
            "usage": {"prompt_tokens": len(ids), "total_tokens": len(ids) + 1, "completion_tokens": 1}}


def encoded_panel() -> EncodedPanel:
    return EncodedPanel("prop-panel", 1, "p" * 64, "t" * 64, tuple(
        EncodedSequence(sid, dom, tuple(ids), (False,) + (True,) * (len(ids) - 1)) for sid, dom, ids in SEQS))


def reference() -> Record:
    seqs = [sequence_from_full(sid, dom, np.asarray(ids), np.stack([distribution(tuple(ids[:i]))
                                                                  for i in range(1, len(ids))]), VOCAB, keep_full=True)
            for sid, dom, ids in SEQS]
    prov = Provenance(side="oracle", panel_name="prop-panel", panel_version="1", panel_hash="p" * 64,
                      tokenizer_hash="t" * 64, source={"vocab_size": VOCAB}, precision="fp32")
    return Record.from_sequences(prov, seqs)


class Bodies:
    """A real HTTP server on 127.0.0.1 answering each prompt with the bytes the current example scripts."""

    def __init__(self):
        self.bodies: dict[tuple[int, ...], bytes] = {}
        outer = self

        class H(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                data = outer.bodies[tuple(body["prompt"])]
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *a):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    d = tmp_path_factory.mktemp("verdict-prop")
    (d / "bands.toml").write_text(BANDS)
    srv = Bodies()
    good = {tuple(ids): json.dumps(response(ids)).encode() for _, _, ids in SEQS}
    reference().save(d / "ref.safetensors")
    client = EngineClient(ClientConfig(srv.url, MODEL, retry=RetryPolicy(max_attempts=1), timeout_s=5.0))
    w = {"dir": d, "server": srv, "good": good, "bands": d / "bands.toml", "client": client}
    eng_path = score_to(w, good, d / "eng.safetensors")
    _, base = judge(Record.load(d / "ref.safetensors"), Record.load(eng_path), "default", "base", d / "bands.toml")
    assert not base.passed and base.summary["kl_part_mean"] > 0.1, base.summary   # FAILs the band by far
    w["base"] = base
    yield w
    client.close()
    srv.close()


def score_to(w: dict, bodies: dict, path: Path) -> Path:
    w["server"].bodies = bodies
    rec = score_panel(w["client"], encoded_panel(), K, EngineSource(w["server"].url, MODEL, "prop"),
                      max_concurrency=1, progress=False)
    return rec.save(path)


def verdict(w: dict, ref_path: Path, eng_path: Path) -> str:
    """'error' for a named refusal, 'same' for the unmutated verdict; a PASS (or a traceback) fails the test."""
    try:
        _, got = judge(Record.load(ref_path), Record.load(eng_path), "default", "mut", w["bands"])
    except (UserError, EngineError) as exc:
        event(f"named error: {type(exc).__name__}")
        return "error"
    assert got.passed == w["base"].passed, f"a mutation turned the verdict into PASS: {got.summary}"
    same = got.summary == w["base"].summary
    event("unchanged verdict" + (", same numbers" if same else ", other numbers"))
    return "same"


# ============================================================================================ responses
HOSTILE = [None, "x", "", [], {}, True, False, -1, 0, 10 ** 12, 0.5, -0.0, 1e308, -1e308, [1, 2], {"a": 1}]
NONFINITE = ["NaN", "Infinity", "-Infinity", "1e999", "-1e999"]
BAD_KEYS = [str(VOCAB), str(VOCAB + 1), "1000000000", "-1", "007", "x", "3.0", " 3", ""]


def _paths(obj: Any, prefix: tuple = ()) -> list[tuple]:
    out = [prefix] if prefix else []
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out += _paths(v, prefix + (i,))
    return out


def _parent(obj: Any, path: tuple) -> Any:
    for p in path[:-1]:
        obj = obj[p]
    return obj


SENTINEL = "__ds41_number__"


@settings(SETTINGS, max_examples=150)
@given(data=st.data())
def test_engine_responses_mutated_give_a_named_error_or_the_same_verdict(world, data):
    which = data.draw(st.integers(0, len(SEQS) - 1), label="sequence")
    ids = SEQS[which][2]
    resp = response(ids)
    op = data.draw(st.sampled_from(["delete", "retype", "nonfinite", "rekey", "positions", "cut"]), label="op")
    raw_literal = None
    paths = _paths(resp)
    plp = resp["choices"][0]["prompt_logprobs"]
    if op == "delete":
        path = data.draw(st.sampled_from(paths), label="path")
        parent = _parent(resp, path)
        del parent[path[-1]]
    elif op == "retype":
        path = data.draw(st.sampled_from(paths), label="path")
        _parent(resp, path)[path[-1]] = copy.deepcopy(data.draw(st.sampled_from(HOSTILE), label="value"))
    elif op == "nonfinite":
        numeric = [p for p in paths if isinstance(_parent(resp, p)[p[-1]], (int, float))]
        path = data.draw(st.sampled_from(numeric), label="path")
        _parent(resp, path)[path[-1]] = SENTINEL
        raw_literal = data.draw(st.sampled_from(NONFINITE), label="literal")
    elif op == "rekey":
        pos = data.draw(st.integers(1, len(plp) - 1), label="position")
        entry = plp[pos]
        old = data.draw(st.sampled_from(sorted(entry)), label="key")
        new = data.draw(st.sampled_from(BAD_KEYS + [str(t) for t in range(VOCAB)]), label="new key")
        entry[new] = entry.pop(old)
    elif op == "positions":
        target = data.draw(st.sampled_from(["prompt_logprobs", "prompt_token_ids"]), label="list")
        lst = resp["choices"][0][target]
        how = data.draw(st.sampled_from(["append", "pop", "insert-null", "duplicate", "swap"]), label="how")
        i = data.draw(st.integers(1, len(lst) - 1), label="index")
        if how == "append":
            lst.append(copy.deepcopy(lst[i]))
        elif how == "pop":
            lst.pop(i)
        elif how == "insert-null":
            lst.insert(i, None)
        elif how == "duplicate":
            lst[i] = copy.deepcopy(lst[i - 1]) if i > 1 else copy.deepcopy(lst[i])
        else:
            j = 1 + (i % (len(lst) - 1))
            lst[i], lst[j] = lst[j], lst[i]
    body = json.dumps(resp).encode()
    if raw_literal is not None:
        body = body.replace(json.dumps(SENTINEL).encode(), raw_literal.encode())
    if op == "cut":
        body = body[:data.draw(st.integers(0, len(body) - 1), label="cut at")]
    bodies = dict(world["good"])
    bodies[tuple(ids)] = body
    d = world["dir"]
    try:
        eng_path = score_to(world, bodies, d / "eng-mut.safetensors")
    except (UserError, EngineError) as exc:
        event(f"named error: {type(exc).__name__}")
        return
    verdict(world, d / "ref.safetensors", eng_path)


# ============================================================================================ records
def _rewrite(src: Path, dst: Path, arrays: dict | None = None, meta_update: dict | None = None,
             drop_meta: tuple = (), rehash: bool = True) -> Path:
    with safe_open(str(src), framework="numpy") as f:
        meta = dict(f.metadata())
    tensors = load_file(str(src))
    tensors.update(arrays or {})
    for key in drop_meta:
        meta.pop(key, None)
    meta.update(meta_update or {})
    if rehash and "content_sha256" not in drop_meta:
        meta["content_sha256"] = _content_sha256(tensors, json.loads(meta["seq_ids"]), json.loads(meta["domains"]),
                                                 int(meta["k"]))
    save_file(tensors, str(dst), metadata=meta)
    return dst


DTYPES = [np.float16, np.float32, np.float64, np.int8, np.int16, np.int32, np.int64, np.uint64, np.bool_]
ID_VALUES = [VOCAB, VOCAB + 7, 10 ** 9, 2 ** 62, -5, -1, 0, 7]
VOCAB_VALUES = [VOCAB - 1, VOCAB + 1, 10 ** 9, 0, -3, "40", True, 40.0, None]


@settings(SETTINGS, max_examples=150)
@given(data=st.data())
def test_records_mutated_give_a_named_error_or_the_same_verdict(world, data):
    d = world["dir"]
    which = data.draw(st.sampled_from(["ref", "eng"]), label="record")
    src = d / f"{which}.safetensors"
    arrays = load_file(str(src))
    op = data.draw(st.sampled_from(["dtype", "ids", "vocab", "nohash", "rows", "nan", "forge"]), label="op")
    # a forged record with a recomputed hash is indistinguishable from an honest one: forging is only drawn with
    # the hash dropped (an "old" record) or left stale
    rehash = op != "forge" and data.draw(st.booleans(), label="rehash")
    kw: dict[str, Any] = {}
    if op == "dtype":
        name = data.draw(st.sampled_from(sorted(arrays)), label="array")
        dt = data.draw(st.sampled_from([t for t in DTYPES if np.dtype(t) != arrays[name].dtype]), label="dtype")
        with np.errstate(all="ignore"):
            kw["arrays"] = {name: arrays[name].astype(dt)}
    elif op == "ids":
        name = data.draw(st.sampled_from(["topk_ids", "token_ids"]), label="array")
        arr = arrays[name].copy()
        flat = arr.reshape(-1)
        flat[data.draw(st.integers(0, flat.size - 1), label="index")] = data.draw(st.sampled_from(ID_VALUES),
                                                                                  label="id")
        kw["arrays"] = {name: arr}
    elif op == "vocab":
        with safe_open(str(src), framework="numpy") as f:
            prov = json.loads(f.metadata()["provenance"])
        table = data.draw(st.sampled_from(["source", "extra"]), label="table")
        prov[table] = {**prov[table], "vocab_size": data.draw(st.sampled_from(VOCAB_VALUES), label="vocab_size")}
        kw["meta_update"] = {"provenance": json.dumps(prov)}
    elif op == "nohash":
        kw["drop_meta"] = ("content_sha256",)
        if data.draw(st.booleans(), label="and an edit"):
            lp = arrays["actual_logprob"].copy()
            lp[data.draw(st.integers(0, lp.size - 1), label="index")] *= 0.5
            kw["arrays"] = {"actual_logprob": lp}
    elif op == "rows":
        name = data.draw(st.sampled_from(["topk_ids", "topk_logprobs", "actual_logprob", "actual_rank", "pos_seq",
                                          "pos_index", "token_ids", "scored"]), label="array")
        kw["arrays"] = {name: arrays[name][:-1]}
    elif op == "forge":   # the engine record claims the reference's own numbers: a PASS if it were read
        ref = load_file(str(d / "ref.safetensors"))
        which, src = "eng", d / "eng.safetensors"
        kw["arrays"] = {"topk_ids": ref["topk_ids"][:, :K].copy(), "topk_logprobs": ref["topk_logprobs"][:, :K].copy(),
                        "actual_logprob": ref["actual_logprob"], "actual_rank": ref["actual_rank"]}
        if data.draw(st.booleans(), label="drop the hash"):
            kw["drop_meta"] = ("content_sha256",)
    else:
        name = data.draw(st.sampled_from([n for n in arrays if arrays[n].dtype.kind == "f"]), label="array")
        arr = arrays[name].copy()
        arr.reshape(-1)[data.draw(st.integers(0, arr.size - 1), label="index")] = data.draw(
            st.sampled_from([np.nan, np.inf]), label="value")
        kw["arrays"] = {name: arr}
    mut = _rewrite(src, d / f"{which}-mut.safetensors", rehash=rehash, **kw)
    paths = {"ref": d / "ref.safetensors", "eng": d / "eng.safetensors", which: mut}
    verdict(world, paths["ref"], paths["eng"])


def test_the_unmutated_input_fails_the_band_and_each_side_alone_is_whole(world):
    """The property's anchor: the unmutated engine FAILs, and both records load cleanly (hash, dtypes, vocab)."""
    d = world["dir"]
    ref, eng = Record.load(d / "ref.safetensors"), Record.load(d / "eng.safetensors")
    assert ref.vocab_size() == VOCAB and eng.provenance.extra["answered_by"] == [world["server"].url]
    assert not world["base"].passed and any("mean KL_part" in f for f in world["base"].failures)


def test_the_forged_record_would_pass_if_it_were_read(world):
    """The "forge" mutation has teeth: read anyway (the caller vouching for an unhashed file), it PASSes."""
    d = world["dir"]
    ref = load_file(str(d / "ref.safetensors"))
    forged = _rewrite(d / "eng.safetensors", d / "forged.safetensors", drop_meta=("content_sha256",), arrays={
        "topk_ids": ref["topk_ids"][:, :K].copy(), "topk_logprobs": ref["topk_logprobs"][:, :K].copy(),
        "actual_logprob": ref["actual_logprob"], "actual_rank": ref["actual_rank"]})
    _, got = judge(Record.load(d / "ref.safetensors"), Record.load(forged, trust_unhashed=True), "default", "forged",
                   world["bands"])
    assert got.passed
    with pytest.raises(RecordError, match="no content_sha256"):
        Record.load(forged)
