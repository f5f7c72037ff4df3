"""The DeepSeek-V4.1 vision path of the oracle (dsv41-architecture.md §16) against independent math: patch
embedding as a stride-p conv2d, 2-D RoPE by worked angles, attention as an explicit softmax, the aligner's
unfold as an explicit loop, the image processor on small worked images; then the tiny vision checkpoint end
to end, and the reference-bf16 vs fp32 tower difference at tiny and at release tower sizes."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from oracle.dsv41.aligner import Aligner, unfold_cells, unfold_cells_reference
from oracle.dsv41.checkpoint import Checkpoint
from oracle.dsv41.config import ModelConfig
from oracle.dsv41.image_processor import (IMAGE, IMAGE_END, IMAGE_NEW_LINE, IMAGE_START, TEXT, GridPlan,
                                          ImageInputError, layout_prompt, plan_grid, process_image,
                                          prompt_from_ids, span_length)
from oracle.dsv41.model import Model
from oracle.dsv41.numerics import Numerics
from oracle.dsv41.runner import engram_token_map, full_weights
from oracle.dsv41.tiny import TINY_VISION_OVERRIDES, random_vision_weights, tiny_config, write_tiny_checkpoint
from oracle.dsv41.vision import (VisionBlock, VisionTower, apply_vision_rope, rope_tables, vision_attention,
                                 vision_inv_freq, vision_rope_angles)

TINY = tiny_config(TINY_VISION_OVERRIDES)
FP32, BF16 = Numerics("fp32"), Numerics("reference-bf16")


def _rgb(h, w, seed):
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def _normalised(arr):
    return (arr.astype(np.float64) / 255 - 0.5) / 0.5


def rel_l2(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


# ------------------------------------------------------------------------------------------ image processor


def test_image_processor_worked_example_without_resize():
    """42 x 28 pixels (3 x 2 patches of 14): no resize, patches in row-major order, normalised pixels,
    n_llm = ceil(n_vit / 3) per axis, the span START IMAGE NEW_LINE END."""
    arr = _rgb(42, 28, 0)
    img = process_image(arr, TINY)
    assert img.plan == GridPlan(height=42, width=28, n_vit_h=3, n_vit_w=2, n_llm_h=1, n_llm_w=1)
    assert img.patches.shape == (6, 3, 14, 14) and img.patches.dtype == torch.float32
    want = _normalised(arr)
    for k in range(6):
        r, c = divmod(k, 2)
        block = want[14 * r:14 * r + 14, 14 * c:14 * c + 14].transpose(2, 0, 1)
        np.testing.assert_allclose(img.patches[k].numpy(), block, rtol=0, atol=1e-6)
    assert img.span_types() == [IMAGE_START, IMAGE, IMAGE_NEW_LINE, IMAGE_END]


def test_image_processor_pads_with_grey_127_around_the_centred_image():
    """14 wide x 7 tall, one colour: padded to 14 x 14; 7 rows keep the colour, 7 rows are grey 127."""
    arr = np.zeros((7, 14, 3), dtype=np.uint8)
    arr[...] = (200, 10, 50)
    img = process_image(Image.fromarray(arr), TINY)
    assert (img.plan.height, img.plan.width) == (14, 14)
    px = img.patches[0]  # [3, 14, 14]
    grey = torch.full((3, 14), (127 / 255 - 0.5) / 0.5)
    colour = torch.tensor(_normalised(np.array([200, 10, 50])), dtype=torch.float32)[:, None].expand(3, 14)
    kinds = ["grey" if torch.allclose(px[:, y], grey, atol=1e-6) else
             "colour" if torch.allclose(px[:, y], colour, atol=1e-6) else "other" for y in range(14)]
    assert kinds.count("grey") == 7 and kinds.count("colour") == 7, kinds
    rows = [y for y, k in enumerate(kinds) if k == "colour"]
    assert rows == list(range(rows[0], rows[0] + 7)) and 3 <= rows[0] <= 4  # one contiguous, centred band


def test_grid_plan_worked_examples_at_release_sizes():
    rel = ModelConfig.release()
    # below 544^2 pixels: enlarged to 544 x 544, then up to the next multiple of 14 (546 = 39 patches)
    assert plan_grid(100, 100, rel) == GridPlan(546, 546, 39, 39, 13, 13)
    # 2002 x 1008 would be a 48 x 24 cell grid = 1178 positions > 1024: the widest aspect-kept grid that fits
    # (n_w = sqrt(1022 / 0.5 + 0.25) - 0.5 = 44.7 -> 44 cells x 22 cells, 924 x 1848 pixels, 992 positions)
    plan = plan_grid(2000, 1000, rel)
    assert plan == GridPlan(924, 1848, 66, 132, 22, 44)
    assert plan.n_span == 22 * 45 + 2 == 992


@pytest.mark.parametrize("seed", range(3))
def test_every_grid_fits_the_token_budget_and_whole_patches(seed):
    rel = ModelConfig.release()
    rng = np.random.default_rng(seed)
    for w, h in rng.integers(1, 6000, (200, 2)):
        plan = plan_grid(int(w), int(h), rel)
        assert plan.n_span <= rel.vision_max_n_token
        assert plan.height == 14 * plan.n_vit_h and plan.width == 14 * plan.n_vit_w
        assert (plan.n_llm_h, plan.n_llm_w) == (math.ceil(plan.n_vit_h / 3), math.ceil(plan.n_vit_w / 3))


def test_layout_prompt_places_the_span_and_refuses_bad_parts():
    img = process_image(_rgb(70, 56, 1), TINY)  # 5 x 4 patches -> 2 x 2 cells
    p = layout_prompt([[5, 7], img, [9]], TINY)
    n = span_length(2, 2)
    assert n == 8 and len(p.input_ids) == 2 + n + 1
    assert p.input_ids == (5, 7) + (TINY.image_token_id,) * n + (9,)
    assert p.token_types == (TEXT, TEXT, IMAGE_START, IMAGE, IMAGE, IMAGE_NEW_LINE, IMAGE, IMAGE,
                             IMAGE_NEW_LINE, IMAGE_END, TEXT)
    assert [s.start for s in p.spans] == [2] and p.spans[0].end == 10
    with pytest.raises(ImageInputError, match="image_token_id"):
        layout_prompt([[5, TINY.image_token_id]], TINY)
    with pytest.raises(ImageInputError, match=r"RGB uint8 \[H, W, 3\]"):
        layout_prompt([np.zeros((4, 4), dtype=np.uint8)], TINY)
    with pytest.raises(ImageInputError, match="PIL image"):
        process_image("picture.png", TINY)


def test_prompt_from_ids_rebuilds_the_layout_and_refuses_a_wrong_span():
    img = _rgb(70, 56, 1)
    laid = layout_prompt([[5, 7], img, [9], img, []], TINY)
    starts = [s.start for s in laid.spans]
    again = prompt_from_ids(laid.input_ids, [(starts[1], img), (starts[0], img)], TINY)
    assert again.input_ids == laid.input_ids and again.token_types == laid.token_types
    assert [s.start for s in again.spans] == starts
    assert torch.equal(again.spans[0].image.patches, laid.spans[0].image.patches)
    with pytest.raises(ImageInputError, match="belongs to no image"):
        prompt_from_ids(laid.input_ids, [(starts[0], img)], TINY)
    with pytest.raises(ImageInputError, match="must all be image_token_id"):
        prompt_from_ids(laid.input_ids, [(starts[0] - 1, img), (starts[1], img)], TINY)
    with pytest.raises(ImageInputError, match="outside"):
        prompt_from_ids(laid.input_ids[:-3], [(starts[0], img), (starts[1], img)], TINY)


def test_vision_sizes_read_from_the_hf_vision_config_and_checked():
    hf = {"num_hidden_layers": 40, "vision_config": {"num_hidden_layers": 32, "hidden_size": 1024,
                                                     "num_attention_heads": 16, "intermediate_size": 2816,
                                                     "patch_size": 14, "rope_theta": 10000, "downsample_ratio": 3,
                                                     "max_image_tokens": 1024, "min_pixels": 295936,
                                                     "max_wh_ratio": None}}
    cfg = ModelConfig.from_dict(hf)
    assert (cfg.vision_n_layers, cfg.vision_dim, cfg.vision_n_heads, cfg.vision_head_dim) == (32, 1024, 16, 64)
    assert (cfg.vision_max_n_token, cfg.vision_min_pixels, cfg.vision_max_wh_ratio) == (1024, 295936, None)
    with pytest.raises(ValueError, match="head size divisible by 4"):
        tiny_config({**TINY_VISION_OVERRIDES, "vision_n_heads": 3})


# ------------------------------------------------------------------------------------------ tower modules


def test_patch_embedding_equals_a_stride_p_conv2d():
    """The Linear over flattened patches is a conv2d with kernel = stride = patch size over the image."""
    w = random_vision_weights(TINY, 0, "vision.patch_embed.")
    tower = VisionTower(TINY)
    tower.patch_w, tower.patch_b = w["vision.patch_embed.proj.weight"], w["vision.patch_embed.proj.bias"]
    arr = _rgb(56, 70, 2)  # 4 x 5 patches
    img = process_image(arr, TINY)
    got = tower.embed(img.patches, FP32)
    pixels = torch.tensor(_normalised(arr)).permute(2, 0, 1)[None]  # float64 [1, 3, 56, 70]
    conv = F.conv2d(pixels, tower.patch_w.double().view(TINY.vision_dim, 3, 14, 14), tower.patch_b.double(),
                    stride=14)
    want = conv[0].permute(1, 2, 0).reshape(20, TINY.vision_dim)
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)


def test_rope_angles_worked_example():
    """head 16 -> 8 angles per patch: row * [1, 0.1, 0.01, 0.001] then column * the same (theta 10000)."""
    torch.testing.assert_close(vision_inv_freq(TINY), torch.tensor([1.0, 0.1, 0.01, 0.001]))
    ang = vision_rope_angles(TINY, 2, 3)
    assert ang.shape == (6, 8)
    torch.testing.assert_close(ang[5], torch.tensor([1.0, 0.1, 0.01, 0.001, 2.0, 0.2, 0.02, 0.002]))  # (1, 2)
    torch.testing.assert_close(ang[1], torch.tensor([0.0, 0.0, 0.0, 0.0, 1.0, 0.1, 0.01, 0.001]))  # (0, 1)
    cos, sin = rope_tables(ang)
    # rotate-half pairs dims (i, i + 8): e_0 turns by the row angle, e_12 (pair 4) by the column angle
    e = torch.eye(16)
    x = torch.stack([e[0], e[12]])[None].expand(6, 2, 16)
    out = apply_vision_rope(x, cos, sin, FP32)[5]
    want0 = torch.zeros(16)
    want0[0], want0[8] = math.cos(1.0), math.sin(1.0)
    want12 = torch.zeros(16)
    want12[4], want12[12] = -math.sin(2.0), math.cos(2.0)
    torch.testing.assert_close(out, torch.stack([want0, want12]), rtol=0, atol=1e-7)


def test_rope_scores_depend_only_on_the_2d_offset():
    """<rope(q, p1), rope(k, p2)> is a function of p2 - p1 (per axis): the defining property of 2-D RoPE."""
    g = torch.Generator().manual_seed(3)
    q, k = torch.randn(1, 1, 16, generator=g), torch.randn(1, 1, 16, generator=g)
    cos, sin = rope_tables(vision_rope_angles(TINY, 6, 6))

    def score(p1, p2):
        i, j = p1[0] * 6 + p1[1], p2[0] * 6 + p2[1]
        a = apply_vision_rope(q, cos[i:i + 1], sin[i:i + 1], FP32)
        b = apply_vision_rope(k, cos[j:j + 1], sin[j:j + 1], FP32)
        return float((a * b).sum())
    assert score((0, 0), (2, 1)) == pytest.approx(score((3, 4), (5, 5)), abs=1e-5)
    assert score((1, 0), (1, 3)) == pytest.approx(score((4, 2), (4, 5)), abs=1e-5)
    assert abs(score((0, 0), (2, 1)) - score((0, 0), (1, 2))) > 1e-3  # the two axes are not interchangeable


def _explicit_attention(q, k, v):
    n, h, d = q.shape
    out = np.zeros((n, h, d))
    for head in range(h):
        qh, kh, vh = (t[:, head].double().numpy() for t in (q, k, v))
        s = qh @ kh.T / math.sqrt(d)
        p = np.exp(s - s.max(axis=1, keepdims=True))
        out[:, head] = (p / p.sum(axis=1, keepdims=True)) @ vh
    return torch.tensor(out)


def test_attention_equals_explicit_softmax():
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(23, 4, 16, generator=g) * 2 for _ in range(3))
    torch.testing.assert_close(vision_attention(q, k, v, FP32).double(), _explicit_attention(q, k, v),
                               rtol=1e-6, atol=1e-6)
    rb = [t.to(torch.bfloat16).float() for t in (q, k, v)]
    got = vision_attention(q, k, v, BF16)
    assert torch.equal(got, got.to(torch.bfloat16).float())  # the reference's bf16 attention output
    torch.testing.assert_close(got.double(), _explicit_attention(*rb), rtol=2e-2, atol=2e-2)


def test_aligner_unfold_equals_an_explicit_loop():
    n_h, n_w, c, r = 5, 4, 3, 3
    x = torch.arange(n_h * n_w * c, dtype=torch.float32).reshape(n_h * n_w, c) + 1
    want = torch.zeros(2 * 2, c * r * r)
    for cell_r in range(2):
        for cell_c in range(2):
            for ch in range(c):
                for i in range(r):
                    for j in range(r):
                        y, xx = cell_r * r + i, cell_c * r + j
                        if y < n_h and xx < n_w:
                            want[cell_r * 2 + cell_c, ch * r * r + i * r + j] = x[y * n_w + xx, ch]
    assert torch.equal(unfold_cells(x, n_h, n_w, r), want)


def test_reference_unfold_is_the_same_cells_as_a_strided_view():
    """reference-bf16's unfold (vision.py's F.unfold + transpose, handed on uncopied) gives unfold_cells'
    values; only the memory layout differs (a transposed view)."""
    for n_h, n_w in ((5, 4), (32, 29), (3, 3)):
        x = torch.randn(n_h * n_w, 7, generator=torch.Generator().manual_seed(n_h)).to(torch.bfloat16)
        ref = unfold_cells_reference(x, n_h, n_w, 3)
        assert torch.equal(ref, unfold_cells(x.float(), n_h, n_w, 3).to(torch.bfloat16))
        assert ref.stride()[0] == 1  # cells along the fast axis: the transposed unfold output


def test_aligner_equals_w2_gelu_erf_w1_on_the_cells():
    w = random_vision_weights(TINY, 0, "aligner.")
    al = Aligner(TINY).load(w)
    feats = torch.randn(5 * 4, TINY.vision_dim, generator=torch.Generator().manual_seed(5))
    cells = unfold_cells(feats, 5, 4, 3).double().numpy()
    h1 = cells @ w["aligner.w1.weight"].double().numpy().T + w["aligner.w1.bias"].double().numpy()
    gelu = 0.5 * h1 * (1 + np.vectorize(math.erf)(h1 / math.sqrt(2)))
    want = gelu @ w["aligner.w2.weight"].double().numpy().T + w["aligner.w2.bias"].double().numpy()
    got = al(feats, 5, 4, FP32)
    assert got.shape == (4, TINY.dim)
    np.testing.assert_allclose(got.double().numpy(), want, rtol=1e-5, atol=1e-6)


def test_vision_block_equals_an_explicit_fp64_block():
    """One block written out independently: RMSNorm -> wqkv -> RoPE -> softmax attention -> wo -> residual,
    RMSNorm -> silu(gate) * up -> w2 -> residual."""
    w = random_vision_weights(TINY, 0, "vision.blocks.0.")
    blk = VisionBlock(TINY, 0).load(w)
    x = torch.randn(12, TINY.vision_dim, generator=torch.Generator().manual_seed(6))
    cos, sin = rope_tables(vision_rope_angles(TINY, 3, 4))
    d = {k.split("blocks.0.")[1]: v.double() for k, v in w.items()}
    xd, cd, sd = x.double(), cos.double()[:, None], sin.double()[:, None]

    def norm(t, wt):
        return wt * t / torch.sqrt(t.square().mean(-1, keepdim=True) + 1e-6)

    def rot(t):
        return torch.cat([-t[..., 8:], t[..., :8]], -1)
    qkv = (norm(xd, d["norm1.weight"]) @ d["attn.wqkv.weight"].T + d["attn.wqkv.bias"]).view(12, 3, 4, 16)
    q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]
    q, k = q * cd + rot(q) * sd, k * cd + rot(k) * sd
    att = _explicit_attention(q, k, v).reshape(12, 64)
    h = xd + att @ d["attn.wo.weight"].T + d["attn.wo.bias"]
    gu = norm(h, d["norm2.weight"]) @ d["mlp.w1.weight"].T
    want = h + (F.silu(gu[:, :128]) * gu[:, 128:]) @ d["mlp.w2.weight"].T
    torch.testing.assert_close(blk(x, cos, sin, FP32).double(), want, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------ end to end


@pytest.fixture(scope="module")
def tiny_vision(tmp_path_factory):
    d = write_tiny_checkpoint(tmp_path_factory.mktemp("vision") / "ck", seed=0, config_overrides=TINY_VISION_OVERRIDES)
    ck = Checkpoint(d)
    return ck, full_weights(ck), engram_token_map(ck)


def _model(tiny_vision, precision="fp32"):
    ck, w, tmap = tiny_vision
    return Model(ck.model_config, w, tmap, precision=precision, index_k="intended", with_mtp=False)


def test_tiny_vision_checkpoint_has_the_release_layout(tiny_vision):
    ck, w, _ = tiny_vision
    cfg = ck.model_config
    assert cfg.vision_n_layers == 2 and cfg.vision_dim == 64
    assert ck.inventory.linears["vision.blocks.1.mlp.w1"].storage == "bf16"
    shapes = {"vision.patch_embed.proj.weight": (64, 588), "vision.blocks.0.attn.wqkv.weight": (192, 64),
              "vision.blocks.0.mlp.w1.weight": (256, 64), "vision.blocks.1.mlp.w2.weight": (64, 128),
              "aligner.w1.weight": (256, 576), "aligner.w2.weight": (256, 256), "image_newline": (256,),
              "layers.3.ffn.gate.bias_vl": (8,)}
    for name, shape in shapes.items():
        assert tuple(w[name].shape) == shape, name
        assert torch.equal(w[name], w[name].to(torch.bfloat16).float()) or name.endswith("bias_vl"), name


def test_images_change_the_logits_after_the_span_only(tiny_vision):
    cfg = tiny_vision[0].model_config
    m = _model(tiny_vision)
    a = layout_prompt([[5, 7, 9], _rgb(70, 56, 10), [11, 13, 15, 17]], cfg)
    b = layout_prompt([[5, 7, 9], _rgb(70, 56, 11), [11, 13, 15, 17]], cfg)
    assert a.input_ids == b.input_ids and a.token_types == b.token_types
    la = m.forward(a.ids_tensor(), m.new_state(1), a.types_tensor(), images=[a.spans]).logits[0]
    lb = m.forward(b.ids_tensor(), m.new_state(1), b.types_tensor(), images=[b.spans]).logits[0]
    start, end = a.spans[0].start, a.spans[0].end
    assert torch.equal(la[:start], lb[:start])  # causal: nothing before the image sees it
    after = (la[end:] - lb[end:]).abs().amax(-1)
    assert bool((after > 1e-3).all()), after  # every text position after the span reads the image
    lp_a, lp_b = la[end:].log_softmax(-1), lb[end:].log_softmax(-1)
    assert float((lp_a - lp_b).abs().max()) > 1e-2


def test_decode_after_an_image_prefill_equals_one_pass(tiny_vision):
    cfg = tiny_vision[0].model_config
    m = _model(tiny_vision)
    p = layout_prompt([[5, 7, 9], _rgb(70, 84, 12), [11, 13, 15, 17, 19, 21, 23]], cfg)
    ids, types = p.ids_tensor(), p.types_tensor()
    full = m.forward(ids, m.new_state(1), types, images=[p.spans]).logits
    n_prefill = len(p.input_ids) - 3
    st = m.new_state(1)
    outs = [m.forward(ids[:, :n_prefill], st, types[:, :n_prefill], images=[p.spans]).logits]
    for pos in range(n_prefill, ids.shape[1]):
        outs.append(m.forward(ids[:, pos:pos + 1], st, types[:, pos:pos + 1]).logits)
    inc = torch.cat(outs, 1)
    assert float((inc - full).abs().max() / full.abs().max()) < 1e-5


def test_images_outside_the_first_prefill_or_off_their_span_are_refused(tiny_vision):
    cfg = tiny_vision[0].model_config
    m = _model(tiny_vision)
    p = layout_prompt([[5, 7], _rgb(42, 42, 13), [9]], cfg)
    ids, types = p.ids_tensor(), p.types_tensor()
    st = m.new_state(1)
    m.forward(ids[:, :2], st, types[:, :2])
    with pytest.raises(ImageInputError, match="position-0 prefill"):
        m.forward(ids[:, 2:3], st, types[:, 2:3], images=[p.spans])
    shifted = types.roll(1, dims=1)
    with pytest.raises(ImageInputError, match="span layout"):
        m.forward(ids, m.new_state(1), shifted, images=[p.spans])
    with pytest.raises(ImageInputError, match="token_types"):
        m.forward(ids, m.new_state(1), None, images=[p.spans])
    with pytest.raises(ValueError, match="image_token_id 129264 is outside the vocabulary"):
        Model(cfg.replace(image_token_id=129264), tiny_vision[1], tiny_vision[2], with_mtp=False)
    text_only = Model(cfg, tiny_vision[1], tiny_vision[2], with_mtp=False, with_vision=False)
    with pytest.raises(ImageInputError, match="no vision tower"):
        text_only.forward(ids, text_only.new_state(1), types, images=[p.spans])


# ------------------------------------------------------------------------------------------ bf16 vs fp32


def test_reference_bf16_tower_vs_fp32_on_the_tiny_checkpoint(tiny_vision):
    cfg = tiny_vision[0].model_config
    tower = VisionTower(cfg).load(tiny_vision[1])
    img = process_image(_rgb(84, 84, 14), cfg)  # 6 x 6 patches
    f32 = tower(img.patches, 6, 6, FP32)
    assert torch.equal(f32, tower(img.patches, 6, 6, Numerics("fp32")))  # deterministic
    bf = tower(img.patches, 6, 6, BF16)
    assert torch.equal(bf, bf.to(torch.bfloat16).float())
    r = rel_l2(bf, f32)
    print(f"\ntiny tower (2 blocks, width 64, 6x6 patches): reference-bf16 vs fp32 relative L2 = {r:.3e}")
    assert 1e-3 < r < 3e-2  # a few bf16 roundings (2^-9 relative each) through 2 blocks


@pytest.mark.long  # 32 release-width blocks in both precisions (84 s of CI); the tiny tower's case stays in CI
def test_reference_bf16_tower_vs_fp32_at_release_tower_sizes():
    """Width 1024, 16 heads, 32 blocks, random weights at trained scale, one 448 x 448 image (32 x 32 patches);
    blocks drawn one at a time so memory stays at one block."""
    cfg = ModelConfig.release().replace(vision_min_pixels=0)
    img = process_image(_rgb(448, 448, 15), cfg)
    assert (img.n_vit_h, img.n_vit_w) == (32, 32)
    t0 = time.time()
    angles = vision_rope_angles(cfg, 32, 32)
    (cos, sin), (cos16, sin16) = rope_tables(angles), rope_tables(angles, BF16)  # each mode's tables
    tower = VisionTower(cfg)
    w = random_vision_weights(cfg, 0, "vision.patch_embed.")
    tower.patch_w, tower.patch_b = w["vision.patch_embed.proj.weight"], w["vision.patch_embed.proj.bias"]
    x32, x16 = tower.embed(img.patches, FP32), tower.embed(img.patches, BF16)
    for i in range(cfg.vision_n_layers):
        blk = VisionBlock(cfg, i).load(random_vision_weights(cfg, 0, f"vision.blocks.{i}."))
        x32, x16 = blk(x32, cos, sin, FP32), blk(x16, cos16, sin16, BF16)
    norm = random_vision_weights(cfg, 0, "vision.norm.")["vision.norm.weight"]
    x32, x16 = FP32.rmsnorm(x32, norm, 1e-6), BF16.rmsnorm(x16, norm, 1e-6)
    r = rel_l2(x16, x32)
    print(f"\nrelease tower (32 blocks, width 1024, 32x32 patches): reference-bf16 vs fp32 relative L2 = {r:.3e} "
          f"({time.time() - t0:.0f} s)")
    assert torch.isfinite(x32).all() and torch.isfinite(x16).all()
    assert 3e-3 < r < 1e-1
