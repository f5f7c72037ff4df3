"""The tiny VLM (engine/vlm.py) through its fp32 oracle (oracle/hf_vision.py), no server: it is not
degenerate (images measurably change the text's logprobs, the next-token distribution is far from uniform),
it is deterministic, and its layout is what the panel encodes."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
import torch

from engine.vlm import TOKENS_PER_IMAGE, ensure_tiny_vlm, image_layout, writer_hash
from oracle.hf_vision import HFVisionOracle
from oracle.scoring import OracleError
from panels import load_tokenizer
from panels.images import encode_image_panel, load_image_panel


@pytest.fixture(scope="module")
def setup():
    d = ensure_tiny_vlm()
    panel = load_image_panel("images")
    enc = encode_image_panel(panel, load_tokenizer(d), image_layout(d))
    return d, panel, enc, HFVisionOracle.load(d)


def _lp(orc, seq, spans, images):
    return torch.log_softmax(orc.logits(seq.token_ids, spans, images).double(), -1)


def test_folder_is_keyed_by_the_writer_and_says_its_layout(setup):
    d, *_ = setup
    meta = json.loads((d / "ds41_tiny_vlm.json").read_text())
    assert d.name == f"tiny-idefics3-{writer_hash()}" and meta["writer_hash"] == writer_hash()
    assert meta["tokens_per_image"] == TOKENS_PER_IMAGE == 16
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["architectures"] == ["Idefics3ForConditionalGeneration"]
    assert cfg["text_config"]["hidden_size"] // cfg["text_config"]["num_attention_heads"] == 64


def test_images_change_the_text_logprobs_and_the_model_is_not_flat(setup):
    _, panel, enc, orc = setup
    e = next(s for s in enc.sequences if s.seq_id == "img-note-total")
    rows = torch.nonzero(torch.tensor(e.scored_mask))[:, 0] - 1
    a = _lp(orc, e, e.spans, panel.images)[rows]
    b = _lp(orc, e, tuple(replace(s, file="photo-dusk.png") for s in e.spans), panel.images)[rows]
    kl = (a.exp() * (a - b)).sum(-1)
    entropy = -(a.exp() * a).sum(-1)
    print(f"\nKL(receipt image || photo image) on the text after it: mean {kl.mean():.3f}, max {kl.max():.3f} nats; "
          f"entropy mean {entropy.mean():.2f} of ln V = {math.log(a.shape[1]):.2f}")
    assert kl.mean() > 0.1                          # the image reaches the text
    assert entropy.mean() < math.log(a.shape[1]) - 2  # far from uniform
    again = _lp(orc, e, e.spans, panel.images)[rows]
    assert torch.equal(a, again)                   # deterministic


def test_tower_features_have_one_row_per_image_position(setup):
    _, panel, _, orc = setup
    pv, mask = orc.pixel_values([panel.images["chart-sales.png"], panel.images["photo-field.png"]])
    feats = orc.image_features(pv, mask)
    assert feats.shape == (2, TOKENS_PER_IMAGE, 128)


def test_oracle_refuses_an_image_token_outside_its_span(setup):
    _, panel, enc, orc = setup
    e = next(s for s in enc.sequences if s.seq_id == "img-note-total")
    ids = list(e.token_ids)
    ids[-2] = orc.image_token_id
    with pytest.raises(OracleError, match="outside every image span"):
        orc.logits(ids, e.spans, panel.images, "bad")


def test_vlm_profiles_serve_the_tiny_vlm_with_content_parts():
    from engine import launcher, profiles

    fake = {n: (lambda n=n: f"<{n}>") for n in ("vllm_python", "vlm_hf_dir", "cache", "stamp")}
    assert "vlm_hf_dir" in launcher.default_providers()
    for name, dtype in (("vllm-cpu-vlm-fp32", "float32"), ("vllm-cpu-vlm-bf16", "bfloat16")):
        argv = list(launcher.resolve(profiles.load_profile(name), providers=fake).argv)
        assert argv[argv.index("--model") + 1] == "<vlm_hf_dir>"
        assert argv[argv.index("--dtype") + 1] == dtype
        assert argv[argv.index("--chat-template-content-format") + 1] == "openai"
        assert json.loads(argv[argv.index("--limit-mm-per-prompt") + 1]) == {"image": 4}
        assert argv[argv.index("--served-model-name") + 1] == "tiny-vlm" and "--enforce-eager" in argv
