"""Exact weight formats and activation quantizers: every test vector of weight-formats.md §9, plus agreement
with independent decoders (torch float8 dtypes, ml_dtypes, a bit-level trellis reader, scipy's Hadamard)."""

import hashlib
import math

import ml_dtypes
import numpy as np
import pytest
import scipy.linalg
import torch

from oracle.dsv41 import formats as F
from oracle.dsv41.quant import (act_quant_dequant, e2m1_rne, e4m3_rne, fp4_act_quant, fp4_act_quant_dequant,
                                pow2ceil)


def u8(vals):
    return torch.tensor(vals, dtype=torch.uint8)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality of fp32 tensors (distinguishes -0; any NaN equals any NaN)."""
    a, b = a.float().contiguous(), b.float().contiguous()
    nan = torch.isnan(a)
    return torch.equal(nan, torch.isnan(b)) and torch.equal(a[~nan].view(torch.int32), b[~nan].view(torch.int32))


def i16(words):
    w = torch.tensor(words, dtype=torch.int32)
    return (w - ((w >> 15) << 16)).to(torch.int16)


# ---------------------------------------------------------------------------------------------------
# §9 items 1-5: element encodings


def test_e8m0_vector():  # §9.1
    got = F.e8m0_to_f32(u8([0, 1, 120, 126, 127, 128, 254, 255]))
    want = [2.0**-127, 2.0**-126, 2.0**-7, 0.5, 1.0, 2.0, 2.0**127]
    assert got[:7].tolist() == want and math.isnan(got[7])
    assert got[0].item() == pytest.approx(5.877472e-39, rel=1e-6)


def test_e8m0_all_bytes_match_torch_and_ml_dtypes():
    b = torch.arange(256, dtype=torch.uint8)
    ours = F.e8m0_to_f32(b)
    assert same_bits(ours, b.view(torch.float8_e8m0fnu).float())
    ml = b.numpy().view(ml_dtypes.float8_e8m0fnu).astype(np.float32)
    assert np.array_equal(ours.numpy(), ml, equal_nan=True)


def test_e4m3_vector():  # §9.2
    got = F.e4m3_to_f32(u8([0x00, 0x80, 0x01, 0x08, 0x38, 0xC4, 0x7E, 0x7F, 0xFF]))
    assert same_bits(got[:7], torch.tensor([0.0, -0.0, 2.0**-9, 2.0**-6, 1.0, -3.0, 448.0]))
    assert torch.isnan(got[7:]).all()


def test_e4m3_all_bytes_match_torch_and_ml_dtypes():
    b = torch.arange(256, dtype=torch.uint8)
    ours = F.e4m3_to_f32(b)
    assert same_bits(ours, b.view(torch.float8_e4m3fn).float())
    ml = b.numpy().view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    assert np.array_equal(ours.numpy(), ml, equal_nan=True)


def test_e4m3_rne_vector():  # §9.3
    x = torch.tensor([1e6, 449, 464, 480, 2.0**-10, 1.5 * 2.0**-9, 2.5 * 2.0**-9, 1 / 6])
    assert e4m3_rne(x).tolist() == [448, 448, 448, 448, 0, 2.0**-8, 2.0**-8, 0.171875]


def test_e4m3_rne_matches_ml_dtypes():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(200_000, generator=g) * torch.exp2(torch.randint(-14, 10, (200_000,), generator=g).float())
    ml = np.clip(x.numpy(), -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    assert np.array_equal(e4m3_rne(x).numpy(), ml)


def test_e2m1_table():  # §9.4
    want = [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6]
    assert F.E2M1_TABLE.tolist() == want
    ml = np.arange(16, dtype=np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    assert np.array_equal(F.E2M1_TABLE.numpy(), ml)


def test_e2m1_rne_vector():  # §9.5
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, 5.5, 6.0, 0.2, -5.0])
    want = torch.tensor([0, 1, 1, 2, 2, 4, 4, -0.0, -1, 6, 6, 0, -4])
    assert same_bits(e2m1_rne(x), want)


def test_e2m1_rne_matches_ml_dtypes():
    x = torch.linspace(-6, 6, 48_001)  # every tie point is on this grid (step 2.5e-4)
    ml = x.numpy().astype(ml_dtypes.float4_e2m1fn).astype(np.float32)
    assert np.array_equal(e2m1_rne(x).numpy(), ml)


# ---------------------------------------------------------------------------------------------------
# §9 items 6-8: FP8 block-scaled weights


def test_fp8_worked_example():  # §4.4 / §9.6
    w = F.fp8_dequant(u8([[0x38, 0xC4], [0x7E, 0x01]]), u8([[120]]), (32, 32))
    assert w.tolist() == [[0.0078125, -0.0234375], [3.5, 1.52587890625e-05]]


@pytest.mark.parametrize("shape,scale,cfg,want", [
    ((8192, 4096), (256, 128), None, (32, 32, "ratio")),
    ((8192, 4096), (64, 32), None, (128, 128, "ratio")),
    ((660, 256), (660, 8), None, (1, 32, "ratio")),
    ((100, 70), (4, 3), (32, 32), (32, 32, "config")),
    ((8192, 4096), (256, 128), (32, 32), (32, 32, "config")),
    ((8192, 4096), (256, 128), (128, 128), (32, 32, "ratio")),  # config check fails; ratio rule gives 32x32
])
def test_fp8_block_size(shape, scale, cfg, want):  # §9.7
    b = F.fp8_block_size(shape, scale, cfg)
    assert (b.rows, b.cols, b.rule) == want


def test_fp8_block_size_rejects_unfit_grid():
    with pytest.raises(F.FormatError, match=r"\[100, 70\].*\[3, 3\]"):
        F.fp8_block_size((100, 70), (3, 3), (32, 32))


def test_fp8_config_mismatch_fails_validation():  # §9.7 last case, at the dispatch level
    hdr = {"p.weight": F.Header("F8_E4M3", (8192, 4096)), "p.scale": F.Header("F8_E8M0", (256, 128))}
    fmt = F.detect_linear_format("p", hdr, (128, 128))
    assert fmt.block.rule == "ratio"  # the checkpoint loader rejects a non-"config" block for a linear


def test_fp8_partial_edge_blocks_match_torch_float8():
    g = torch.Generator().manual_seed(2)
    w = torch.randint(0, 256, (100, 70), generator=g, dtype=torch.uint8)
    w[w == 0x7F], w[w == 0xFF] = 0, 0
    s = torch.randint(100, 140, (4, 3), generator=g, dtype=torch.uint8)
    ref = w.view(torch.float8_e4m3fn).float() * torch.stack(
        [torch.stack([s[o // 32, i // 32] for i in range(70)]) for o in range(100)]).view(torch.float8_e8m0fnu).float()
    assert same_bits(F.fp8_dequant(w, s, (32, 32)), ref)


def test_fp8_f32_scale_is_one_fp32_multiply():  # §9.8
    g = torch.Generator().manual_seed(3)
    w = torch.randint(0, 0x7E, (64, 64), generator=g, dtype=torch.uint8)
    s = torch.rand(2, 2, generator=g, dtype=torch.float32) * 1e-3
    ref = w.numpy().view(ml_dtypes.float8_e4m3fn).astype(np.float32) * np.kron(s.numpy(), np.ones((32, 32), np.float32))
    assert np.array_equal(F.fp8_dequant(w, s, (32, 32)).numpy(), ref)


# ---------------------------------------------------------------------------------------------------
# §9 items 9-11: MXFP4 and the Engram table


def test_mxfp4_worked_example_and_nibble_order():  # §5.4 / §9.9
    w = F.mxfp4_dequant(u8([[0x21, 0xF7] + [0] * 14]).view(torch.int8), u8([[126]]))
    assert w[0, :4].tolist() == [0.25, 0.5, 3.0, -3.0] and not w[0, 4:].any()
    assert F.mxfp4_dequant(u8([[0x21] + [0] * 15]), u8([[127]]))[0, :2].tolist() == [0.5, 1.0]


def test_mxfp4_extremes():  # §9.10
    assert (F.mxfp4_dequant(u8([[0x77] * 16]), u8([[127]])) == 6.0).all()
    assert (F.mxfp4_dequant(u8([[0xFF] * 16]), u8([[127]])) == -6.0).all()


def test_mxfp4_matches_ml_dtypes():
    g = torch.Generator().manual_seed(4)
    packed = torch.randint(0, 256, (96, 64), generator=g, dtype=torch.uint8)
    scale = torch.randint(0, 254, (96, 4), generator=g, dtype=torch.uint8)
    nib = np.stack([packed.numpy() & 0xF, packed.numpy() >> 4], -1).reshape(96, 128)
    vals = nib.astype(np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float64)
    ref = vals * np.ldexp(1.0, np.repeat(scale.numpy().astype(np.int64) - 127, 32, axis=1))
    ours = F.mxfp4_dequant(packed.view(torch.int8), scale)
    assert np.array_equal(ours.numpy().astype(np.float64), ref)  # exact in fp32 (§5.3)


def test_mxfp4_gpt_oss_blocks_layout():
    g = torch.Generator().manual_seed(5)
    blocks = torch.randint(0, 256, (3, 5, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(110, 140, (3, 5), generator=g, dtype=torch.uint8)
    assert same_bits(F.mxfp4_blocks_dequant(blocks, scales), F.mxfp4_dequant(blocks.reshape(3, 80), scales))


def test_engram_row_example():  # §9.11
    row = F.engram_rows_dequant(torch.full((1, 256), 0x38, dtype=torch.uint8), u8([[127, 126, 125, 124, 123, 122, 121, 120]]))
    want = torch.tensor([2.0**-k for k in range(8)]).repeat_interleave(32)
    assert torch.equal(row[0], want) and torch.equal(row.bfloat16().float(), row)


# ---------------------------------------------------------------------------------------------------
# §9 items 12-22: EXL3


def test_codebook_hashes_and_ranges():  # §9.12
    ranges = {0: (-3.957, 3.973), 1: (-3.949, 3.949), 2: (-3.453, 3.348)}
    for cb, (lo, hi) in ranges.items():
        lut = F.codebook_table(cb)
        assert hashlib.sha256(lut.numpy().astype("<f2").tobytes()).hexdigest() == F.CODEBOOK_SHA256[cb]
        assert round(lut.min().item(), 3) == lo and round(lut.max().item(), 3) == hi


def test_codebook_values():  # §9.13
    lut = [F.codebook_table(cb) for cb in range(3)]
    bits = lambda v: v.view(torch.int16).item() & 0xFFFF  # noqa: E731
    assert (lut[0][0xDEF0].item(), bits(lut[0][0xDEF0])) == (-1.025390625, 0xBC1A)
    assert (lut[0][0xEF01].item(), bits(lut[0][0xEF01])) == (2.06640625, 0x4022)
    assert (lut[1][0xDEF0].item(), bits(lut[1][0xDEF0])) == (3.43359375, 0x42DE)
    assert (lut[2][0xDEF0].item(), bits(lut[2][0xDEF0])) == (-2.01171875, 0xC006)
    assert [lut[cb][0].item() for cb in range(3)] == [0.76806640625, 1.84375, -3.453125]


def k4_tile() -> torch.Tensor:
    """§7.8: symbols 0..15 repeated, K = 4, written MSB-first as a uint16 stream, halves of each uint32 swapped."""
    sym = list(range(16)) * 16
    stream = [(sym[i] << 12) | (sym[i + 1] << 8) | (sym[i + 2] << 4) | sym[i + 3] for i in range(0, 256, 4)]
    words = [w for i in range(0, 64, 2) for w in (stream[i + 1], stream[i])]
    return i16(words).view(1, 1, 64)


def test_k4_tile_states():  # §9.14
    tile = k4_tile()
    assert [v & 0xFFFF for v in tile[0, 0, :4].tolist()] == [0x4567, 0x0123, 0xCDEF, 0x89AB]
    st = F.exl3_states(tile, 8)[0, 0]
    got = {t: st[t].item() for t in (0, 1, 2, 3, 4, 8, 32, 255)}
    assert got == {0: 0xDEF0, 1: 0xEF01, 2: 0xF012, 3: 0x0123, 4: 0x1234, 8: 0x5678, 32: 0xDEF0, 255: 0xCDEF}


@pytest.mark.parametrize("k2,n_words,want", [
    (4, 32, [0x2, 0x8, 0x20, 0x80, 0x200, 0x800, 0x2000, 0x8000]),
    (5, 40, [0x2, 0x10, 0x40, 0x200, 0x800, 0x4000]),
])
def test_single_set_bit_tiles(k2, n_words, want):  # §9.15
    words = [0] * n_words
    words[1] = 0x8000  # ring bit 0
    st = F.exl3_states(i16(words).view(1, 1, n_words), k2)[0, 0].tolist()
    assert st[:len(want)] == want and not any(st[len(want):])


def reference_tile_states(words16: list[int], k2: int) -> list[int]:
    """§7.7's direct bit-level reader (slow, unambiguous)."""
    L = 128 * k2
    w32 = [words16[2 * m] | (words16[2 * m + 1] << 16) for m in range(len(words16) // 2)]

    def bit(p):
        p %= L
        return (w32[p // 32] >> (31 - p % 32)) & 1
    out = []
    for t in range(256):
        e = ((t + 1) * k2) >> 1
        out.append(sum(bit(e - 16 + i) << (15 - i) for i in range(16)))
    return out


@pytest.mark.parametrize("k2", [2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16])
def test_vectorised_states_match_bit_reader(k2):
    g = torch.Generator().manual_seed(k2)
    tr = torch.randint(-2**15, 2**15, (2, 1, 8 * k2), generator=g, dtype=torch.int16)
    got = F.exl3_states(tr, k2)
    for kt in range(2):
        words = [v & 0xFFFF for v in tr[kt, 0].tolist()]
        assert got[kt, 0].tolist() == reference_tile_states(words, k2)


def test_tile_permutation():  # §9.16
    def forward(t):  # position -> (row, col), written from the §7.5 description
        lane, j = divmod(t, 8)
        r0, c0 = (lane % 4) * 2, lane // 4
        return ((r0, r0 + 1, r0 + 8, r0 + 9)[j % 4], c0 + 8 * (j // 4))
    assert {t: forward(t) for t in (0, 1, 2, 3, 4, 8, 32, 255)} == {
        0: (0, 0), 1: (1, 0), 2: (8, 0), 3: (9, 0), 4: (0, 8), 8: (2, 0), 32: (0, 1), 255: (15, 15)}
    pos = F.tile_position_of()  # the inverse formula, at row-major tile index 16r + c
    assert sorted(pos.tolist()) == list(range(256))
    assert all(forward(pos[16 * r + c].item()) == (r, c) for r in range(16) for c in range(16))


def test_w_hat_entries():  # §9.17
    w = F.exl3_w_hat(k4_tile(), 0)
    got = [w[i, j].item() for i, j in [(0, 0), (1, 0), (2, 0), (8, 0), (0, 1), (0, 8), (15, 15)]]
    assert got == [-1.025390625, 2.06640625, -1.3037109375, -0.41015625, -1.025390625, -2.19921875, -0.401611328125]
    assert w.dtype == torch.float16


@pytest.mark.parametrize("cb,v", [(0, 98.3125), (1, 236.0), (2, -442.0)])
def test_all_zero_trellis(cb, v):  # §9.18
    tr = torch.zeros(16, 8, 48, dtype=torch.int16)  # in 256, out 128, K = 3
    W = F.exl3_dequant(tr, torch.ones(256, dtype=torch.float16), torch.ones(128, dtype=torch.float16), cb).T
    assert W[0, 0].item() == v and W[128, 0].item() == v
    mask = torch.ones_like(W, dtype=torch.bool)
    mask[0, 0] = mask[128, 0] = False
    assert not W[mask].any()
    suh = torch.ones(256, dtype=torch.float16)
    suh[128] = -0.5
    W2 = F.exl3_dequant(tr, suh, torch.full((128,), 0.25, dtype=torch.float16), cb).T
    assert W2[128, 0].item() == 128 * F.codebook_table(cb)[0].item() * -0.5 * 0.25


@pytest.mark.parametrize("cb,v", [(0, -41.158203125), (1, 94.41796875), (2, -82.89794921875)])
def test_replicated_k4_tile(cb, v):  # §9.19
    tr = k4_tile().expand(8, 8, 64).contiguous()
    W = F.exl3_dequant(tr, torch.ones(128, dtype=torch.float16), torch.ones(128, dtype=torch.float16), cb).T
    assert W[0, 0].item() == v and W[0, 1].item() == 0
    assert int((W != 0).sum()) == 16


def test_legacy_sign_bits():  # §9.20
    su = torch.zeros(8, dtype=torch.int16)
    su[0] = 1
    s = F.unpack_sign_bits(su)
    assert s[0].item() == -1 and (s[1:] == 1).all() and s.shape == (128,)
    su[2] = i16([0x8000])[0]
    assert F.unpack_sign_bits(su)[47].item() == -1


def exl3_headers(width=48, n_in=256, n_out=128, markers=(), legacy=False):
    h = {"p.trellis": F.Header("I16", (n_in // 16, n_out // 16, width))}
    if legacy:
        h |= {"p.su": F.Header("I16", (n_in // 16,)), "p.sv": F.Header("I16", (n_out // 16,))}
    else:
        h |= {"p.suh": F.Header("F16", (n_in,)), "p.svh": F.Header("F16", (n_out,))}
    for m in markers:
        h[f"p.{m}"] = F.Header("I32", ())
    return h


def test_exl3_dispatch_accepts_valid_sets():
    assert F.detect_linear_format("p", exl3_headers(40, markers=("mul1",))).k2 == 5
    fmt = F.detect_linear_format("p", exl3_headers(128, markers=("mcg",), legacy=True))
    assert (fmt.kind, fmt.k2, fmt.codebook, fmt.out, fmt.in_) == ("exl3", 16, 1, 128, 256)


@pytest.mark.parametrize("headers,msg", [
    (exl3_headers(40), "half-integer K = 2.5 requires the mul1"),  # K = 2.5 without .mul1
    (exl3_headers(72), "not in 1..8"),  # K = 4.5
    (exl3_headers(144), "not in 1..8"),  # K = 9
    (exl3_headers(48, markers=("mcg", "mul1")), "both .mcg and .mul1"),
    (exl3_headers(48, n_in=192), "multiples of 128"),
    (exl3_headers(48, n_out=64), "multiples of 128"),
    (exl3_headers(48) | {"p.weight": F.Header("F8_E4M3", (128, 256))}, "never mix"),
    (exl3_headers(48) | {"p.bias": F.Header("F16", (128,))}, "no bias"),
])
def test_exl3_rejections(headers, msg):  # §9.21
    with pytest.raises(F.FormatError, match=msg):
        F.detect_linear_format("p", headers)


def test_exl3_wrong_marker_value_rejected():  # §9.21
    fmt = F.detect_linear_format("p", exl3_headers(48, markers=("mcg",)))
    t = {"trellis": torch.zeros(16, 8, 48, dtype=torch.int16), "suh": torch.ones(256, dtype=torch.float16),
         "svh": torch.ones(128, dtype=torch.float16), "mcg": torch.tensor(F.MUL1_MARKER, dtype=torch.int32)}
    with pytest.raises(F.FormatError, match="marker value"):
        F.decode_linear(fmt, t)


def test_level_b_matches_scipy_hadamard_reference():
    g = torch.Generator().manual_seed(7)
    tr = torch.randint(-2**15, 2**15, (16, 24, 56), generator=g, dtype=torch.int16)  # K = 3.5, in 256, out 384
    suh = (torch.randn(256, generator=g).exp() * (torch.randint(0, 2, (256,), generator=g) * 2 - 1)).half()
    svh = (0.01 * torch.randn(384, generator=g)).half()
    w_hat = F.exl3_w_hat(tr, 2).double().numpy()
    H = scipy.linalg.hadamard(128).astype(np.float64)
    S = np.zeros_like(w_hat)
    for a in range(2):
        for b in range(3):
            S[128 * a:128 * (a + 1), 128 * b:128 * (b + 1)] = H @ w_hat[128 * a:128 * (a + 1), 128 * b:128 * (b + 1)] @ H
    ref = ((S * (suh.double().numpy()[:, None] / 128)) * svh.double().numpy()[None, :]).astype(np.float32).T
    for chunk in (128, 1024):
        assert np.array_equal(F.exl3_dequant(tr, suh, svh, 2, rows_per_chunk=chunk).numpy(), ref)


def test_level_b_determinism_across_threads():  # §9.22
    g = torch.Generator().manual_seed(8)
    tr = torch.randint(-2**15, 2**15, (32, 16, 48), generator=g, dtype=torch.int16)
    suh, svh = torch.randn(512, generator=g).half(), torch.randn(256, generator=g).half()
    a = F.exl3_dequant(tr, suh, svh, 0)
    n = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        b = F.exl3_dequant(tr, suh, svh, 0)
    finally:
        torch.set_num_threads(n)
    assert same_bits(a, b) and same_bits(a, F.exl3_dequant(tr, suh, svh, 0))


# ---------------------------------------------------------------------------------------------------
# §9 items 23-25: activation quantizers


def bf16(vals, n=32):
    return torch.tensor(list(vals) + [0.0] * (n - len(vals)), dtype=torch.bfloat16)


def test_qdq8_examples():  # §8.6 a-e
    a = act_quant_dequant(bf16([3.0, 0.01, -1e-3]))
    assert a.dtype == torch.bfloat16 and a[:3].float().tolist() == [3.0, 0.009765625, -0.0009765625]
    assert act_quant_dequant(bf16([3.0, 0.01, -1e-3], 128), 128)[:3].float().tolist() == [3.0, 0.009765625, -0.0009765625]
    assert act_quant_dequant(torch.tensor([448.0, 1.0] + [0.0] * 30))[:2].tolist() == [448.0, 1.0]
    c = act_quant_dequant(torch.tensor([449.0, -3.3] + [0.0] * 30))
    assert c[:2].tolist() == [448.0, -3.25]
    assert not act_quant_dequant(torch.zeros(32)).any()
    from oracle.dsv41.quant import act_quant
    q, s = act_quant(torch.zeros(32))
    assert s.item() == 2.0**-22
    q, s = act_quant(torch.tensor([1.0] + [0.0] * 31))
    assert (s.item(), q[0, 0].item()) == (2.0**-8, 256.0)
    q, s = act_quant(torch.tensor([448.0, 1.0] + [0.0] * 30))
    assert (s.item(), q[0, 0].item(), q[0, 1].item()) == (1.0, 448.0, 1.0)


def test_qdq4_examples():  # §8.6 f-h
    f = fp4_act_quant_dequant(bf16([1.0, 0.3, -0.55, 0.12, 2.0, -0.8, 0.05, 1.6]), 32, "ue8m0")
    assert f[:8].float().tolist() == [1.0, 0.25, -0.5, 0, 2.0, -0.75, 0, 1.5]
    q, s = fp4_act_quant(bf16([1.0, 0.3, -0.55, 0.12, 2.0, -0.8, 0.05, 1.6]), 32, "ue8m0")
    assert s.item() == 0.5 and q[0, :8].tolist() == [2, 0.5, -1, 0, 4, -1.5, 0, 3]
    x = bf16([1.0, 0.3, -0.55, 0.12, 0.9, -0.8, 0.05, 0.6], 16)
    q, s = fp4_act_quant(x, 16, "e4m3")
    assert s.item() == 0.171875 and q[0, :8].tolist() == [6, 2, -3, 0.5, 6, -4, 0.5, 4]
    assert fp4_act_quant_dequant(x, 16, "e4m3")[:8].float().tolist() == [
        1.03125, 0.34375, -0.515625, 0.0859375, 1.03125, -0.6875, 0.0859375, 0.6875]
    assert fp4_act_quant(torch.zeros(16), 16, "e4m3")[1].item() == 2.0**-9
    assert fp4_act_quant(torch.zeros(32), 32, "ue8m0")[1].item() == 2.0**-126
    assert not fp4_act_quant_dequant(torch.zeros(32)).any()


def test_pow2ceil_bits():  # §9.24
    t = torch.tensor([2.0**-8 * (1 + 2.0**-23), 2.0**-8, 3.0, 1e-4 / 448])
    assert pow2ceil(t).tolist() == [2.0**-7, 2.0**-8, 4.0, 2.0**-22]
    # the log2 pitfall: a float log2 rounds this input down to exactly -8
    assert torch.exp2(torch.ceil(torch.log2(t[:1]))).item() == 2.0**-8
    g = torch.Generator().manual_seed(9)
    r = torch.rand(100_000, generator=g, dtype=torch.float64) * 2.0 ** torch.randint(-100, 100, (100_000,), generator=g)
    r32 = r.float()
    want = np.ldexp(1.0, np.ceil(np.log2(r32.double().numpy())).astype(np.int64))  # fp64 log2 is exact enough here
    assert np.array_equal(pow2ceil(r32).double().numpy(), want)


def test_qdq8_idempotent_and_bounded():  # §9.25
    g = torch.Generator().manual_seed(10)
    x = torch.randn(4096, 256, generator=g) * torch.exp2(torch.randint(-30, 30, (4096, 1), generator=g).float())
    x = x * torch.exp2(torch.randint(-6, 6, (4096, 256), generator=g).float())
    y = act_quant_dequant(x)
    assert same_bits(act_quant_dequant(y), y)
    # every output is an e4m3 value times a power of two, and never exceeds the block amax by more than rounding
    assert (y.abs().view(4096, 8, 32).amax(-1) <= x.abs().view(4096, 8, 32).amax(-1) * (1 + 2**-4)).all()


def test_quant_rejects_bad_block():
    with pytest.raises(ValueError, match="not a multiple of block 32"):
        act_quant_dequant(torch.zeros(3, 48))
    with pytest.raises(ValueError, match="scale_fmt"):
        fp4_act_quant_dequant(torch.zeros(32), 32, "fp8")
