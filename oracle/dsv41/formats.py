"""Exact decoders for the weight formats of DeepSeek-V4.1-Flash builds (weight-formats.md).

Everything decodes raw bytes with the rules of §3 (own lookup tables), never through torch's float8/float4
conversions, and returns fp32 ``Linear.weight`` layout ``[out, in]``:

* FP8 e4m3 with E8M0 / F32 block scales, block size from shapes (§4)   ``fp8_dequant``
* MXFP4, I8-packed e2m1 pairs + one E8M0 scale per 32 inputs (§5)      ``mxfp4_dequant``
* gpt-oss style ``blocks`` / ``scales`` MXFP4 (§5.2)                      ``mxfp4_blocks_dequant``
* Engram table rows, e4m3 with a 1x32 E8M0 scale per row (§6)          ``engram_rows_dequant``
* EXL3 trellis packs, Levels A and B (§7)                               ``exl3_w_hat`` / ``exl3_dequant``

``detect_linear_format`` implements the per-tensor dispatch of §2.3 from safetensors headers alone.
"""

from __future__ import annotations

import functools
import hashlib
import math
from dataclasses import dataclass, field

import numba
import numpy as np
import torch

from core.errors import UserError


class FormatError(UserError, ValueError):
    """A tensor (set) that does not decode under the rules of weight-formats.md."""


# ----------------------------------------------------------------------------------------------------------
# §3 element encodings: 256/16-entry tables built from the bit definitions


def _e8m0_table() -> torch.Tensor:
    b = torch.arange(256, dtype=torch.int32)
    t = (b << 23).view(torch.float32).clone()
    t[0] = 2.0**-127  # exponent field 0 would read as +0; e8m0 byte 0 is 2^-127 (an fp32 subnormal)
    t[255] = float("nan")  # OCP: 0xFF is NaN
    return t


def _e4m3_table() -> torch.Tensor:
    vals = []
    for b in range(256):
        s, e, m = b >> 7, (b >> 3) & 0xF, b & 0x7
        if e == 0xF and m == 0x7:
            v = float("nan")  # 0x7F / 0xFF; e4m3fn has no infinity
        elif e == 0:
            v = 2.0**-6 * (m / 8)  # subnormal
        else:
            v = 2.0 ** (e - 7) * (1 + m / 8)
        vals.append(-v if s else v)
    return torch.tensor(vals, dtype=torch.float32)


E8M0_TABLE = _e8m0_table()
E4M3_TABLE = _e4m3_table()
# code 8 decodes to -0 (either sign is acceptable after scaling, §3.3)
E2M1_TABLE = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                           -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=torch.float32)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """Reinterpret a 1-byte tensor (uint8, int8, float8_*) as uint8 without copying."""
    if t.element_size() != 1:
        raise FormatError(f"expected a 1-byte dtype, got {t.dtype}")
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


# numpy views of the tables for the compiled decoders
_E4M3_NP = E4M3_TABLE.numpy()
_E8M0_NP = E8M0_TABLE.numpy()
_E2M1_NP = E2M1_TABLE.numpy()



def _lookup(table: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``table[idx]`` (index_select over flat int32 indices is the fastest CPU gather here)."""
    flat = torch.index_select(table, 0, idx.reshape(-1).to(torch.int32))
    return flat.view(*idx.shape, *table.shape[1:])


def e8m0_to_f32(b: torch.Tensor) -> torch.Tensor:
    return _lookup(E8M0_TABLE, as_bytes(b))


def e4m3_to_f32(b: torch.Tensor) -> torch.Tensor:
    return _lookup(E4M3_TABLE, as_bytes(b))


def e2m1_to_f32(codes: torch.Tensor) -> torch.Tensor:
    return _lookup(E2M1_TABLE, codes)


# ----------------------------------------------------------------------------------------------------------
# §4 FP8 e4m3 with block scales


@dataclass(frozen=True)
class BlockSize:
    rows: int
    cols: int
    rule: str  # "config": the configured block fits the scale grid; "ratio": derived by exact division (§4.3)


def fp8_block_size(shape, scale_shape, configured=None) -> BlockSize:
    """Block size of an FP8 weight from its shape and its scale grid (§4.3); never assumed.

    The configured ``[br, bc]`` wins if the ceil-divided grid matches; otherwise an exact ratio; otherwise
    FormatError. The caller decides whether a "ratio" result is acceptable (only for the Engram table).
    """
    (R, C), (sr, sc) = tuple(shape), tuple(scale_shape)
    if configured is not None:
        br, bc = (int(v) for v in configured)
        if math.ceil(R / br) == sr and math.ceil(C / bc) == sc:
            return BlockSize(br, bc, "config")
    if sr > 0 and sc > 0 and R % sr == 0 and C % sc == 0:
        return BlockSize(R // sr, C // sc, "ratio")
    raise FormatError(f"FP8 weight {list(shape)} with scale grid {list(scale_shape)}: no block size fits "
                      f"(configured {list(configured) if configured is not None else None})")


def _out_buffer(out: np.ndarray | None, shape: tuple[int, int], who: str) -> np.ndarray:
    """A caller's reusable fp32 output array (checked), or a new one."""
    if out is None:
        return np.empty(shape, dtype=np.float32)
    if out.shape != tuple(shape) or out.dtype != np.float32 or not out.flags.c_contiguous or not out.flags.writeable:
        raise FormatError(f"{who}: output buffer {out.shape} {out.dtype} is not a writable C-contiguous float32 "
                          f"array of shape {list(shape)}")
    return out


@numba.njit(parallel=True, cache=True)
def _fp8_blocks_kernel(codes, scales, br, bc, lut, out):  # pragma: no cover - compiled
    rows, cols = codes.shape
    for r in numba.prange(rows):
        srow = r // br
        for cb in range(scales.shape[1]):
            sv = scales[srow, cb]
            for c in range(cb * bc, min(cols, (cb + 1) * bc)):
                out[r, c] = lut[codes[r, c]] * sv  # one fp32 multiply, as W = e4m3(w) * S


def fp8_dequant(weight: torch.Tensor, scale: torch.Tensor, block: BlockSize | tuple[int, int],
                out: np.ndarray | None = None) -> torch.Tensor:
    """``W[o, i] = e4m3(w[o, i]) * S[o // br, i // bc]`` (§4.2); E8M0 scale bytes or F32 scales.

    With E8M0 scales the product is exact in fp32; with F32 scales it is one RNE multiply. One fused
    pass (numba, rows in parallel; elementwise, so the result does not depend on the thread count):
    a table lookup and a gather-then-multiply in torch cost ~5x more on release-size layers. `out`: an
    fp32 array to decode into (a runner reuses one layer's arrays for the next, sparing the page faults).
    """
    br, bc = (block.rows, block.cols) if isinstance(block, BlockSize) else block
    R, C = weight.shape
    if tuple(scale.shape) != (math.ceil(R / br), math.ceil(C / bc)):
        raise FormatError(f"FP8 scale shape {list(scale.shape)} does not match weight {[R, C]} with block "
                          f"{br}x{bc}")
    s = scale.float() if scale.dtype == torch.float32 else e8m0_to_f32(scale)
    dst = _out_buffer(out, (R, C), "FP8 decode")
    _fp8_blocks_kernel(as_bytes(weight).contiguous().numpy(), s.contiguous().numpy(), br, bc, _E4M3_NP, dst)
    return torch.from_numpy(dst)


def engram_rows_dequant(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Engram table rows: ``T[r, j] = e4m3(w[r, j]) * 2^(scale[r, j // 32] - 127)`` (§6), exact."""
    rows, width = weight.shape
    if tuple(scale.shape) != (rows, width // 32) or width % 32:
        raise FormatError(f"Engram rows {list(weight.shape)} need scale [{rows}, {width // 32}], "
                          f"got {list(scale.shape)}")
    return fp8_dequant(weight, scale, (1, 32))


# ----------------------------------------------------------------------------------------------------------
# §5 MXFP4


def _unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    b = as_bytes(packed)
    # low nibble is the even (first) element (§5.1)
    return torch.stack((b & 0xF, b >> 4), dim=-1).flatten(-2)


@numba.njit(parallel=True, cache=True)
def _mxfp4_kernel(packed, scale_codes, e2m1, e8m0, out):  # pragma: no cover - compiled
    rows, half = packed.shape
    for r in numba.prange(rows):
        for g in range(half // 16):
            sv = e8m0[scale_codes[r, g]]
            for j in range(16):
                b = packed[r, g * 16 + j]
                out[r, g * 32 + 2 * j] = e2m1[b & 15] * sv  # low nibble first (§5.1)
                out[r, g * 32 + 2 * j + 1] = e2m1[b >> 4] * sv


def mxfp4_dequant(weight: torch.Tensor, scale: torch.Tensor, out: np.ndarray | None = None) -> torch.Tensor:
    """DeepSeek MXFP4: I8 ``[out, in/2]`` + E8M0 ``[out, in/32]`` -> fp32 ``[out, in]`` (§5.3), exact.

    One fused pass (numba, rows in parallel): on a release-size expert the torch lookup + multiply was ~5x
    slower and dominated the layer-streamed runner's weight time. `out`: as for `fp8_dequant`."""
    rows, half = weight.shape
    if tuple(scale.shape) != (rows, 2 * half // 32) or (2 * half) % 32:
        raise FormatError(f"MXFP4 weight {list(weight.shape)} needs scale [{rows}, {2 * half // 32}], "
                          f"got {list(scale.shape)}")
    dst = _out_buffer(out, (rows, 2 * half), "MXFP4 decode")
    _mxfp4_kernel(as_bytes(weight).contiguous().numpy(), as_bytes(scale).contiguous().numpy(), _E2M1_NP, _E8M0_NP, dst)
    return torch.from_numpy(dst)


def warm_up_decoders() -> None:
    """Compile (or load from numba's cache) the fused decoders now. The layer-streamed runner calls this
    before it takes its RSS baseline: the JIT's ~50 MB is a per-process constant, not working set."""
    mxfp4_dequant(torch.zeros(1, 16, dtype=torch.uint8), torch.full((1, 1), 127, dtype=torch.uint8))
    fp8_dequant(torch.zeros(1, 1, dtype=torch.uint8), torch.full((1, 1), 127, dtype=torch.uint8), (1, 1))
    fp8_dequant(torch.zeros(1, 1, dtype=torch.uint8), torch.ones(1, 1), (1, 1))


def mxfp4_blocks_dequant(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """gpt-oss MXFP4: ``blocks`` U8 ``[..., G, 16]`` + ``scales`` U8 ``[..., G]`` -> ``[..., G*32]`` (§5.2)."""
    if blocks.shape[-1] != 16 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise FormatError(f"MXFP4 blocks {list(blocks.shape)} / scales {list(scales.shape)}: expected "
                          f"[..., G, 16] / [..., G]")
    v = e2m1_to_f32(_unpack_nibbles(blocks))  # [..., G, 32]
    return (v * e8m0_to_f32(scales)[..., None]).flatten(-2)


# ----------------------------------------------------------------------------------------------------------
# §7 EXL3

MCG_MARKER = -877912083  # 0xCBAC1FED as int32
MUL1_MARKER = -2082680531  # 0x83DCD12D as int32
CODEBOOKS = {0: "3inst", 1: "mcg", 2: "mul1"}
CODEBOOK_SHA256 = {  # §7.4: SHA-256 of the 65,536 fp16 values, little-endian
    0: "ad88de2dcff5bb05fff2faec37cceceb43aa1c2e8203f9d81a6fbd6dd3393eea",
    1: "95383563929baa9d1ae5de0be22490284382673620bdd85929feea7bdbef04a9",
    2: "bc48d02cb1c14939dc47b90f870dd689d63e3b1ab69a157e65538db68677a6c8",
}
# K = trellis.shape[-1] / 16; k2 = 2K. Half-integer K (odd k2) only with mul1 (§7.2).
_INT_K2 = frozenset(range(2, 17, 2))
_HALF_K2 = frozenset({3, 5, 7})


def _u16_as_f16(u: torch.Tensor) -> torch.Tensor:
    return (u - ((u >> 15) << 16)).to(torch.int16).view(torch.float16)


def _codebook_values(cb: int) -> torch.Tensor:
    s = torch.arange(65536, dtype=torch.int64)
    if cb in (0, 1):
        x = (s * 89226354 + 64248484) if cb == 0 else s * 0xCBAC1FED
        x = ((x & 0xFFFFFFFF) & 0x8FFF8FFF) ^ 0x3B603B60  # PTX lop3 0x6a: (a & b) ^ c
        # both halves lie in ±[0.125, 2): their fp32 sum is exact, the fp16 cast is the one __hadd RNE
        return (_u16_as_f16(x & 0xFFFF).float() + _u16_as_f16(x >> 16).float()).to(torch.float16)
    if cb == 2:
        x = (s * 0x83DCD12D) & 0xFFFFFFFF
        bsum = (x & 0xFF) + ((x >> 8) & 0xFF) + ((x >> 16) & 0xFF) + (x >> 24)
        h = (1024 + bsum).to(torch.float32)
        # fp32 h * k_inv + k_bias is exact (§7.4), the fp16 cast is the single __hfma rounding
        return (h * (887.0 / 131072.0) + (-10.3828125)).to(torch.float16)
    raise FormatError(f"unknown EXL3 codebook {cb}")


@functools.cache
def codebook_table(cb: int) -> torch.Tensor:
    """The 65,536-entry fp16 state -> value table of codebook ``cb``, hash-checked against §7.4."""
    lut = _codebook_values(cb)
    digest = hashlib.sha256(lut.view(torch.int16).numpy().astype("<i2").tobytes()).hexdigest()
    if digest != CODEBOOK_SHA256[cb]:
        raise FormatError(f"EXL3 codebook {CODEBOOKS[cb]} table hash {digest} != {CODEBOOK_SHA256[cb]}")
    return lut


def exl3_k2(trellis_shape, cb: int, who: str = "trellis") -> int:
    """``2K`` from the trellis width, validated against the codebook (§7.2)."""
    if len(trellis_shape) != 3:
        raise FormatError(f"{who}: EXL3 trellis must be rank 3 [in/16, out/16, 16K], got {list(trellis_shape)}")
    width = trellis_shape[-1]
    k2 = width // 8
    if width % 8 or k2 not in _INT_K2 | _HALF_K2:
        raise FormatError(f"{who}: trellis width {width} gives K = {width / 16}, not in 1..8 or {{1.5, 2.5, 3.5}}")
    if k2 in _HALF_K2 and cb != 2:
        raise FormatError(f"{who}: half-integer K = {k2 / 2} requires the mul1 codebook, found {CODEBOOKS[cb]}")
    return k2


@functools.cache
def tile_position_of() -> torch.Tensor:
    """``t(r, c)`` for the 256 tile elements in row-major ``16r + c`` order (§7.5, tensor-core permutation)."""
    r = torch.arange(16).repeat_interleave(16)
    c = torch.arange(16).repeat(16)
    lane = 4 * (c % 8) + (r % 8) // 2
    j = (r % 2) + 2 * (r // 8) + 4 * (c // 8)
    return 8 * lane + j


@functools.cache
def _state_gather(k2: int, tile_order: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For each of the 256 windows of a tile: the two int16 word indices it spans and its bit offset.

    §7.3 reads the ring MSB-first inside little-endian uint32 words; equivalently it is the big-endian
    concatenation of the uint16 stream ``u16[j ^ 1]`` (the two halves of every uint32 swapped). Window t
    covers ring bits [e - 16, e), e = ((t + 1) * k2) >> 1, so it spans stream words j0 = (e - 16) // 16 and
    j0 + 1 (mod the ring), starting ``off`` bits into j0.
    """
    n16 = 8 * k2  # 16K uint16 words = 128 * k2 ring bits
    t = torch.arange(256, dtype=torch.int64)
    if tile_order:
        t = tile_position_of()
    b0 = (((t + 1) * k2) >> 1) - 16 + 128 * k2  # biased by one ring so it stays >= 0
    j0 = (b0 // 16) % n16
    return j0 ^ 1, ((j0 + 1) % n16) ^ 1, b0 % 16


def exl3_states(trellis: torch.Tensor, k2: int, tile_order: bool = False) -> torch.Tensor:
    """Trellis ``[kt, nt, 16K]`` int16 -> 16-bit states ``[kt, nt, 256]`` (int32), in position order t, or
    with ``tile_order`` in row-major tile order ``16r + c`` (§7.3, §7.5)."""
    u = trellis.to(torch.int32) & 0xFFFF
    i0, i1, off = _state_gather(k2, tile_order)
    off = off.to(torch.int32)
    # (hi << off) stays below 2^31; lo >> (16 - off) supplies the remaining low bits
    return ((u[..., i0] << off) | (u[..., i1] >> (16 - off))) & 0xFFFF


def exl3_w_hat(trellis: torch.Tensor, cb: int, k2: int | None = None) -> torch.Tensor:
    """Level A: ``W_hat [in, out]`` in fp16, bit-exact with exllamav3's ``reconstruct`` (§7.3-7.5)."""
    k2 = exl3_k2(trellis.shape, cb) if k2 is None else k2
    kt, nt, _ = trellis.shape
    tiles = codebook_table(cb)[exl3_states(trellis, k2, tile_order=True)].view(kt, nt, 16, 16)
    return tiles.permute(0, 2, 1, 3).reshape(16 * kt, 16 * nt)


@functools.cache
def sylvester(n: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Unnormalised natural-order Sylvester matrix, ``H[i, j] = (-1)^popcount(i & j)`` (§7.6)."""
    h = torch.ones(1, 1, dtype=dtype)
    while h.shape[0] < n:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return h


def unpack_sign_bits(bits: torch.Tensor) -> torch.Tensor:
    """Legacy ``su`` / ``sv`` int16 bitfields -> fp16 ±1: bit i of word j is element 16j+i, 1 means -1 (§7.9)."""
    u = bits.to(torch.int32) & 0xFFFF
    b = (u[:, None] >> torch.arange(16, dtype=torch.int32)) & 1
    return (1 - 2 * b).flatten().to(torch.float16)


@functools.cache
def _codebook_f64(cb: int) -> torch.Tensor:
    return codebook_table(cb).to(torch.float64)


def exl3_dequant(trellis: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor, cb: int,
                 rows_per_chunk: int = 1024) -> torch.Tensor:
    """Level B, the canonical fp32 weight (§7.6): returns ``Linear.weight [out, in]`` in fp32.

    Per 128x128 block ``S = H W_hat H`` in fp64 is exact in any summation order (W_hat values are multiples
    of 2^-18 below 4, so |S| * 2^18 < 2^34); ``S * suh / 128`` is exact; ``* svh`` is one fp64 rounding, the
    fp32 cast one more. The 128-point transform is H8 (x) H16 over the (tile, in-tile) index split, applied
    directly in the tile layout. Decoded ``rows_per_chunk`` input rows at a time to bound memory.
    """
    k2 = exl3_k2(trellis.shape, cb)
    kt, nt, _ = trellis.shape
    n_in, n_out = 16 * kt, 16 * nt
    if n_in % 128 or n_out % 128:
        raise FormatError(f"EXL3 in/out {n_in}/{n_out} must be multiples of 128 (§7.1)")
    if tuple(suh.shape) != (n_in,) or tuple(svh.shape) != (n_out,):
        raise FormatError(f"EXL3 suh {list(suh.shape)} / svh {list(svh.shape)} must be [{n_in}] / [{n_out}]")
    H8, H16 = sylvester(8), sylvester(16)
    lut = _codebook_f64(cb)
    B = n_out // 128
    sv = svh.to(torch.float64).view(1, 1, B, 8, 1, 16)
    out = torch.empty(n_out, n_in, dtype=torch.float32)
    step = max(128, rows_per_chunk // 128 * 128)
    for r0 in range(0, n_in, step):
        r1 = min(n_in, r0 + step)
        A = (r1 - r0) // 128
        # V[A, ka, B, nb, r, c]: input row 128A + 16ka + r, output column 128B + 16nb + c
        v = _lookup(lut, exl3_states(trellis[r0 // 16:r1 // 16], k2, tile_order=True)).view(A, 8, B, 8, 16, 16)
        v = torch.matmul(v, H16)  # c
        v = torch.matmul(H16, v)  # r
        v = torch.matmul(H8, v.view(A * 8 * B, 8, 256))  # nb
        v = torch.matmul(H8, v.view(A, 8, B * 8 * 256)).view(A, 8, B, 8, 16, 16)  # ka
        su = (suh[r0:r1].to(torch.float64) / 128).view(A, 8, 1, 1, 16, 1)
        # su * svh is exact (11 + 11 bits), so S * (su * svh) is the same single fp64 rounding as (S * su) * svh
        v.mul_(su * sv)
        out[:, r0:r1].view(B, 8, 16, A, 8, 16).copy_(v.permute(2, 3, 5, 0, 1, 4))  # fp32 RNE + [out, in] layout
    return out


# ----------------------------------------------------------------------------------------------------------
# §2.3 per-tensor format dispatch from headers

EXL3_SUFFIXES = ("trellis", "suh", "svh", "su", "sv", "mcg", "mul1", "bias")
# every tensor suffix that carries a linear's weight (§2.4 rule 2)
LINEAR_SUFFIXES = ("weight", "scale", "weight_scale_inv", *EXL3_SUFFIXES)
BLOCK_SUFFIXES = ("_blocks", "_scales")


@dataclass(frozen=True)
class Header:
    dtype: str  # safetensors dtype name, e.g. "F8_E4M3"
    shape: tuple[int, ...]


@dataclass
class LinearFormat:
    """How one linear prefix is stored; ``out``/``in_`` are the logical ``Linear.weight`` dimensions."""
    kind: str  # "exl3" | "mxfp4" | "mxfp4_blocks" | "fp8" | "plain"
    out: int
    in_: int
    tensors: dict[str, str]  # role -> tensor name
    block: BlockSize | None = None  # fp8
    k2: int | None = None  # exl3
    codebook: int | None = None  # exl3
    extra: dict = field(default_factory=dict)

    def describe(self) -> dict:
        d = {"format": self.kind, "shape": [self.out, self.in_]}
        if self.kind == "fp8":
            d["block"] = [self.block.rows, self.block.cols]
            d["scale"] = self.extra["scale_dtype"]
        if self.kind == "exl3":
            d["K"] = self.k2 / 2
            d["codebook"] = CODEBOOKS[self.codebook]
        if self.kind == "plain":
            d["dtype"] = self.extra["dtype"]
        return d


def linear_tensor_names(prefix: str) -> list[str]:
    return [f"{prefix}.{s}" for s in LINEAR_SUFFIXES] + [prefix + s for s in BLOCK_SUFFIXES]


def detect_linear_format(prefix: str, headers: dict[str, Header], configured_block=None) -> LinearFormat:
    """Decide a linear's format from the tensor headers of its prefix only (§2.3), with shape checks (§2.6).

    ``headers`` holds the tensors of this prefix (names as in the checkpoint). Raises FormatError naming
    every problem found.
    """
    def h(s):
        return headers.get(f"{prefix}.{s}")

    present = sorted(n for n in headers if n in set(linear_tensor_names(prefix)))
    unknown = sorted(set(headers) - set(present))
    problems = [f"{n}: not a tensor of a linear" for n in unknown]

    def fail(msg):
        raise FormatError("; ".join(problems + [f"{prefix}: {msg}"]))

    if h("bias") is not None:
        problems.append(f"{prefix}.bias: DeepSeek linears have no bias (§2.4 rule 4)")
    if h("trellis") is not None:
        extra = [s for s in ("weight", "scale", "weight_scale_inv") if h(s) is not None]
        if extra:
            fail(f"both EXL3 .trellis and {', '.join('.' + s for s in extra)} present; never mix formats")
        tr = h("trellis")
        if tr.dtype != "I16":
            fail(f".trellis dtype {tr.dtype}, expected I16")
        if h("mcg") is not None and h("mul1") is not None:
            fail("both .mcg and .mul1 codebook markers present (§7.2)")
        cb = 1 if h("mcg") is not None else 2 if h("mul1") is not None else 0
        for m in ("mcg", "mul1"):
            if h(m) is not None and (h(m).dtype != "I32" or h(m).shape not in ((), (1,))):
                fail(f".{m} marker must be an I32 scalar, got {h(m).dtype} {list(h(m).shape)}")
        try:
            k2 = exl3_k2(tr.shape, cb, f"{prefix}.trellis")
        except FormatError as e:
            fail(str(e))
        n_in, n_out = 16 * tr.shape[0], 16 * tr.shape[1]
        if n_in % 128 or n_out % 128:
            fail(f"EXL3 in/out {n_in}/{n_out} must be multiples of 128 (§7.1)")
        for scaled, legacy, n in (("suh", "su", n_in), ("svh", "sv", n_out)):
            hs, hl = h(scaled), h(legacy)
            if (hs is None) == (hl is None):
                fail(f"needs exactly one of .{scaled} / .{legacy}")
            if hs is not None and (hs.dtype != "F16" or hs.shape != (n,)):
                fail(f".{scaled} must be F16 [{n}], got {hs.dtype} {list(hs.shape)}")
            if hl is not None and (hl.dtype != "I16" or hl.shape != (n // 16,)):
                fail(f".{legacy} must be I16 [{n // 16}], got {hl.dtype} {list(hl.shape)}")
        if problems:
            fail("invalid")
        roles = {s: f"{prefix}.{s}" for s in EXL3_SUFFIXES if h(s) is not None}
        return LinearFormat("exl3", n_out, n_in, roles, k2=k2, codebook=cb)

    exl3_only = [s for s in ("suh", "svh", "su", "sv", "mcg", "mul1") if h(s) is not None]
    if exl3_only:
        fail(f"EXL3 tensors {exl3_only} without .trellis")
    w, s, sinv = h("weight"), h("scale"), h("weight_scale_inv")
    blocks, scales = headers.get(prefix + "_blocks"), headers.get(prefix + "_scales")
    if blocks is not None or scales is not None:
        if w is not None or s is not None or sinv is not None or blocks is None or scales is None:
            fail("gpt-oss _blocks/_scales must come as a pair and alone")
        if blocks.dtype != "U8" or scales.dtype != "U8" or blocks.shape[-1] != 16 or blocks.shape[:-1] != scales.shape:
            fail(f"_blocks {blocks.dtype} {list(blocks.shape)} / _scales {scales.dtype} {list(scales.shape)} "
                 f"must be U8 [..., G, 16] / [..., G]")
        if problems:
            fail("invalid")
        out = math.prod(blocks.shape[:-2])
        return LinearFormat("mxfp4_blocks", out, blocks.shape[-2] * 32,
                            {"blocks": prefix + "_blocks", "scales": prefix + "_scales"})
    if w is None:
        fail("no .weight, .trellis or _blocks tensor")
    if len(w.shape) != 2:
        fail(f".weight must be rank 2, got {list(w.shape)}")
    if s is not None and sinv is not None:
        fail("both .scale and .weight_scale_inv present")
    scale = s or sinv
    scale_name = f"{prefix}.scale" if s is not None else f"{prefix}.weight_scale_inv"
    if w.dtype in ("I8", "U8"):
        if s is None or s.dtype != "F8_E8M0" or len(s.shape) != 2 or s.shape[-1] * 32 != 2 * w.shape[-1]:
            fail(f"MXFP4 .weight {w.dtype} {list(w.shape)} needs an F8_E8M0 .scale [{w.shape[0]}, "
                 f"{2 * w.shape[1] // 32}], got {None if s is None else (s.dtype, list(s.shape))}")
        if s.shape[0] != w.shape[0]:
            fail(f"MXFP4 .scale rows {s.shape[0]} != weight rows {w.shape[0]}")
        if problems:
            fail("invalid")
        return LinearFormat("mxfp4", w.shape[0], 2 * w.shape[1], {"weight": f"{prefix}.weight", "scale": scale_name})
    if w.dtype == "F8_E4M3":
        if scale is None:
            fail("F8_E4M3 .weight without a block scale")
        ok = {"scale": ("F8_E8M0", "F32"), "weight_scale_inv": ("F32",)}["scale" if s is not None else "weight_scale_inv"]
        if scale.dtype not in ok or len(scale.shape) != 2:
            fail(f"{scale_name} must be rank-2 {' or '.join(ok)}, got {scale.dtype} {list(scale.shape)}")
        try:
            block = fp8_block_size(w.shape, scale.shape, configured_block)
        except FormatError as e:
            fail(str(e))
        if problems:
            fail("invalid")
        return LinearFormat("fp8", w.shape[0], w.shape[1], {"weight": f"{prefix}.weight", "scale": scale_name},
                            block=block, extra={"scale_dtype": scale.dtype})
    if w.dtype in ("F32", "F16", "BF16"):
        if scale is not None:
            fail(f"{w.dtype} .weight with a block scale")
        if problems:
            fail("invalid")
        return LinearFormat("plain", w.shape[0], w.shape[1], {"weight": f"{prefix}.weight"},
                            extra={"dtype": w.dtype})
    fail(f".weight dtype {w.dtype} is not a known linear format")


def decode_linear(fmt: LinearFormat, t: dict[str, torch.Tensor], out: np.ndarray | None = None) -> torch.Tensor:
    """Decode one linear from its tensors (role -> tensor, as read) into fp32 ``[out, in]``; into the
    caller's array `out` when given (FP8 and MXFP4 decode in place, the others are copied in)."""
    if fmt.kind == "fp8":
        return fp8_dequant(t["weight"], t["scale"], fmt.block, out)
    if fmt.kind == "mxfp4":
        return mxfp4_dequant(t["weight"], t["scale"], out)
    w = _decode_other(fmt, t)
    if out is None:
        return w
    dst = torch.from_numpy(_out_buffer(out, (fmt.out, fmt.in_), f"{fmt.kind} decode"))
    return dst.copy_(w)


def _decode_other(fmt: LinearFormat, t: dict[str, torch.Tensor]) -> torch.Tensor:
    if fmt.kind == "mxfp4_blocks":
        blocks, scales = t["blocks"], t["scales"]
        return mxfp4_blocks_dequant(blocks, scales).reshape(fmt.out, fmt.in_)
    if fmt.kind == "plain":
        return t["weight"].to(torch.float32)
    if fmt.kind == "exl3":
        for m, value in (("mcg", MCG_MARKER), ("mul1", MUL1_MARKER)):
            if m in t and int(t[m].reshape(-1)[0]) != value:
                raise FormatError(f"EXL3 .{m} marker value {int(t[m].reshape(-1)[0])} != {value} (§7.1)")
        suh = t["suh"] if "suh" in t else unpack_sign_bits(t["su"])
        svh = t["svh"] if "svh" in t else unpack_sign_bits(t["sv"])
        return exl3_dequant(t["trellis"], suh, svh, fmt.codebook)
    raise FormatError(f"unknown linear format {fmt.kind}")
