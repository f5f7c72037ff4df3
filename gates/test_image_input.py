"""Gate: image input end to end over HTTP, on a real engine (issue 18, gate 2).

vLLM CPU serves the tiny random-weight Idefics3 VLM (engine/vlm.py; profile ``vllm-cpu-vlm-fp32``, or
``--vlm-profile``) and its fp32 transformers model is the oracle (oracle/hf_vision.py); the panel is the
image panel images@1 (panels/images.py): rendered text, a chart, a screenshot, a table, photo-like noise, an
image inside a tool result, two multi-image prompts, and three text-only controls.

* **Images in context** — per domain, the engine's prompt logprobs on the text positions after the images
  against the oracle's (``core.verdicts.judge``: mean / p99 KL_part, top-1, ln PPL ratio within the profile's
  bands in gates/bands.toml). The requests are OpenAI chat requests with ``image_url`` data-URL parts; the
  engine's ``prompt_token_ids`` must equal the panel's laid-out ids position for position (engine/image_chat.py).
* **Text unchanged with the vision path on** — the text-only items through the same server pass the same
  bands, and their chat-path logprobs equal the plain ``/v1/completions`` path's on the same ids.
* **Can fail** — an oracle with the wrong image preprocessing (ImageNet mean/std instead of the model's 0.5;
  bilinear instead of Lanczos resizing) must fail the same verdict; a layout with one image position too few
  is refused as a misalignment, never scored shifted.
* **Read-back** — gates/lib/image_input.py: on this random-weight model the engine's greedy reply to each
  rendered-text image equals the fp32 oracle's token for token, and the replies to different images differ.
  It cannot show transcription (random weights read nothing): ``readback_verdict`` (the rendered string back
  exactly) is the check a trained model owes, and is not asserted here.

One server start for the module (an eager start: 1-2 min on a quiet box, 7 min at load 20). With
``DS41_VLM_URL=http://HOST:PORT`` the module gates that already-running server instead (it must serve the
tiny VLM this checkout writes, under the profile's served name).
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest

from core.results import GateEntry, headline
from core.verdicts import judge
from gates import BANDS_FILE
from gates.lib.image_input import path_agreement, same_greedy_verdict

pytestmark = [pytest.mark.gate, pytest.mark.engine]

PROFILE = "vllm-cpu-vlm-fp32"
K = 20
READBACK_TOKENS = 8
IMAGENET_MEAN, IMAGENET_STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]


@pytest.fixture(scope="module")
def vlm(request):
    """The model, panel, encoding, oracle and a running server (stopped at the end of the module)."""
    import os

    from engine.endpoint import EngineEndpoint, client_for, launch_endpoint, model_vocab_size
    from engine.vlm import ensure_tiny_vlm, image_layout
    from oracle.hf_vision import HFVisionOracle
    from panels import load_tokenizer
    from panels.images import encode_image_panel, load_image_panel

    model_dir = ensure_tiny_vlm()
    panel = load_image_panel("images")
    tok = load_tokenizer(model_dir)
    layout = image_layout(model_dir)
    enc = encode_image_panel(panel, tok, layout)
    t0 = time.perf_counter()
    url = os.environ.get("DS41_VLM_URL")
    if url:
        server, endpoint = None, EngineEndpoint(url.rstrip("/"), "tiny-vlm", PROFILE, engine="vllm", precision="fp32",
                                                vocab_size=model_vocab_size(model_dir), tokenizer_dir=str(model_dir))
    else:
        server, endpoint = launch_endpoint(PROFILE, model_dir)
    start_s = time.perf_counter() - t0
    client = client_for(endpoint, max_concurrency=1)
    try:
        yield {"model_dir": model_dir, "panel": panel, "tok": tok, "layout": layout, "enc": enc,
               "oracle": HFVisionOracle.load(model_dir), "server": server, "endpoint": endpoint,
               "client": client, "start_s": start_s}
    finally:
        client.close()
        if server is not None:
            server.stop()


@pytest.fixture(scope="module")
def records(vlm):
    from engine.client import EngineSource
    from engine.image_chat import score_image_panel

    ep = vlm["endpoint"]
    t0 = time.perf_counter()
    ref = vlm["oracle"].score(vlm["enc"], vlm["panel"])
    t_ref = time.perf_counter() - t0
    src = EngineSource(url=ep.base_url, model=ep.model, profile=ep.profile, precision=ep.precision)
    t0 = time.perf_counter()
    eng = score_image_panel(vlm["client"], vlm["enc"], vlm["panel"], K, src)
    t_eng = time.perf_counter() - t0
    image_ids = [it.id for it in vlm["panel"].items if it.images]
    text_ids = [it.id for it in vlm["panel"].items if not it.images]
    return {"ref": ref, "eng": eng, "image_ids": image_ids, "text_ids": text_ids, "oracle_s": t_ref,
            "engine_s": t_eng}


def _judge(ref, eng, label):
    return judge(ref, eng, PROFILE, label=label, bands_file=BANDS_FILE)


def test_image_prompts_match_the_oracle_per_domain(vlm, records, gate_run):
    eng = records["eng"].subset(records["image_ids"])
    result, gate = _judge(records["ref"], eng, f"{PROFILE} images")
    gate_run.add(GateEntry("image_input", gate.passed, profile=PROFILE, failures=gate.failures,
                           metrics={**headline(gate.summary), "server_start_s": round(vlm["start_s"], 1),
                                    "oracle_s": round(records["oracle_s"], 1),
                                    "engine_s": round(records["engine_s"], 1)},
                           evidence={"summary": gate.summary, "rows": gate.rows}))
    print(f"\nimage prompts: {gate.summary}")
    assert result.overall.n_positions == records["ref"].subset(records["image_ids"]).n_positions
    assert len(result.domains) >= 8, sorted(result.domains)
    assert gate.passed, "image-input gate failed:\n" + "\n".join(gate.failures)


def test_text_only_prompts_unchanged_with_the_vision_path_on(vlm, records, gate_run):
    from engine.client import score_panel, EngineSource

    eng = records["eng"].subset(records["text_ids"])
    _, gate = _judge(records["ref"], eng, f"{PROFILE} text-only")
    assert gate.passed, "text-only prompts on the vision server failed:\n" + "\n".join(gate.failures)
    # the same ids through the plain text path (/v1/completions: no chat template, no multimodal processor)
    enc = vlm["enc"]
    text_panel = dataclasses.replace(enc, sequences=tuple(s for s in enc.sequences if s.seq_id in records["text_ids"]))
    ep = vlm["endpoint"]
    plain = score_panel(vlm["client"], text_panel, K, EngineSource(ep.base_url, ep.model, ep.profile,
                                                                   precision=ep.precision), progress=False)
    rows = {}
    for sid in records["text_ids"]:
        a = eng.subset([sid]).actual_logprob
        b = plain.subset([sid]).actual_logprob
        rows[sid] = path_agreement(a, b, tol=1e-5)
    gate_run.add(GateEntry("image_input_text_only", gate.passed and all(r["passed"] for r in rows.values()),
                           profile=PROFILE, metrics=headline(gate.summary),
                           evidence={"summary": gate.summary, "paths": rows}))
    print(f"\ntext-only: {gate.summary}; chat vs completions: "
          f"{max(r['max_abs_diff'] for r in rows.values()):.2e}")
    assert all(r["passed"] for r in rows.values()), rows


@pytest.mark.parametrize("wrong", [
    {"image_mean": IMAGENET_MEAN, "image_std": IMAGENET_STD},
    {"resample": 2},
], ids=["imagenet-mean-std", "bilinear-resize"])
def test_wrong_image_preprocessing_on_the_oracle_side_is_caught(vlm, records, wrong, gate_run):
    from oracle.hf_vision import HFVisionOracle

    enc = vlm["enc"]
    only_images = dataclasses.replace(enc, sequences=tuple(s for s in enc.sequences if s.seq_id in records["image_ids"]))
    bad = HFVisionOracle.load(vlm["model_dir"], processor_overrides=wrong)
    bad_ref = bad.score(only_images, vlm["panel"])
    _, gate = _judge(bad_ref, records["eng"].subset(records["image_ids"]), f"{PROFILE} wrong {sorted(wrong)}")
    # a check of the checker: it passes when the wrongly preprocessed oracle fails the gate
    gate_run.add(GateEntry(f"image_input_canfail_{'_'.join(sorted(wrong))}", not gate.passed, profile=PROFILE,
                           metrics=headline(gate.summary), evidence={"caught": gate.failures}))
    print(f"\nwrong preprocessing {sorted(wrong)}: {gate.summary}")
    assert not gate.passed, f"an oracle with {wrong} still passed: {gate.summary}"
    # every domain with an image fails (not one lucky domain): the images drive the text after them
    failed = {f.split(":")[0] for f in gate.failures}
    assert len(failed) >= 6, gate.failures


def test_request_shape_and_alignment_against_the_real_server(vlm):
    """Image parts in a user message and inside a tool result, and two images in one message, are what the
    server lays out where the panel does; a layout one image position short is refused, not shifted."""
    from engine.errors import EngineResponseError, Malformed
    from engine.image_chat import image_prompt_logprobs
    from panels.images import FixedSpanLayout, encode_image_messages

    panel, enc, lay = vlm["panel"], vlm["enc"], vlm["layout"]
    tool_item = panel.item("img-tool-screenshot")
    tool_seq = next(s for s in enc.sequences if s.seq_id == tool_item.id)
    got = image_prompt_logprobs(vlm["client"], panel, tool_item, tool_seq.token_ids, 1)
    assert got.token_ids == tool_seq.token_ids
    # the image sits inside the tool message: after the "tool" role header, before the final assistant turn
    tok = vlm["tok"].tokenizer
    text_before = tok.decode(list(tool_seq.token_ids[:tool_seq.spans[0].start]), skip_special_tokens=False)
    assert text_before.rstrip().endswith("Screenshot of the editor:") and "<|im_start|>tool" in text_before
    two = panel.item("img-two-photos")
    assert len(next(s for s in enc.sequences if s.seq_id == two.id).spans) == 2
    short = FixedSpanLayout("short", lay.image_token_id, lay.tokens_per_image - 1, lay.prefix, lay.suffix)
    ids, _ = encode_image_messages(two, panel.images, vlm["tok"], short)
    with pytest.raises(EngineResponseError) as exc:
        image_prompt_logprobs(vlm["client"], panel, two, ids, 1)
    assert exc.value.kind == Malformed.PROMPT_IDS_MISMATCH


def test_readback_greedy_reply_equals_the_oracle_and_depends_on_the_image(vlm, gate_run):
    from engine.image_chat import greedy_reply
    from panels.images import encode_image_messages

    panel, orc = vlm["panel"], vlm["oracle"]
    rows, replies = {}, {}
    for item in [it for it in panel.items if it.readback is not None]:
        upto = len(item.messages) - 1
        ids, spans = encode_image_messages(item, panel.images, vlm["tok"], vlm["layout"], upto=upto,
                                           add_generation_prompt=True)
        eng_ids, text, prompt = greedy_reply(vlm["client"], panel, item, READBACK_TOKENS)
        assert prompt == ids, f"{item.id}: the engine laid out the read-back prompt differently"
        ora_ids = orc.greedy(ids, spans, panel.images, READBACK_TOKENS)
        v = same_greedy_verdict(eng_ids, ora_ids)
        rows[item.id] = {**v.to_dict(), "engine_text": text, "rendered": item.readback}
        replies[item.id] = tuple(eng_ids)
    gate_run.add(GateEntry("image_input_readback", all(r["passed"] for r in rows.values()), profile=PROFILE,
                           failures=[f"{k}: {r['why']}" for k, r in rows.items() if not r["passed"]],
                           evidence={"replies": rows}))
    print("\nread-back (engine greedy = oracle greedy): " + "; ".join(f"{k}: {r['why']}" for k, r in rows.items()))
    assert len(rows) >= 3
    assert all(r["passed"] for r in rows.values()), rows
    assert len(set(replies.values())) == len(replies), f"different images gave the same reply: {replies}"
