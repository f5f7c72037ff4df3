"""exllamav3's EXL3 output folder as an oracle pack (oracle/dsv41/exllamav3_pack.py).

* the real name set exllamav3 1.6.5's converter wrote for the tiny DeepSeek-V4 (tests/data/exl3-dsv4-tiny-tensors.txt,
  copied from the device kit's listing of a 3 bpw conversion on the H200) maps onto oracle names: 16 wo_a slices
  stacked into 4 wo_a, every other tensor passed through;
* a synthetic exllamav3-style folder over the tiny V4 release checkpoint (random trellises, exllamav3's names,
  dtypes and config) loads through ``Checkpoint(release, pack)``: wo_a equals its slices' exact decodes stacked,
  an expert equals its own exact decode, everything exllamav3 did not write stays official;
* what cannot be decoded is refused with Exl3PackError naming it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from oracle.dsv41 import formats as F
from oracle.dsv41.exllamav3_pack import Exl3PackError, plan_pack, translate_pack

LISTING = Path(__file__).resolve().parents[1] / "data" / "exl3-dsv4-tiny-tensors.txt"
QC = {"quant_method": "exl3", "version": "1.6.5", "bits": 3.0, "head_bits": 16, "calibration": {"rows": 16},
      "out_scales": "auto", "codebook": "mul1", "tensor_storage": {}}
DT = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "I16": torch.int16, "I32": torch.int32}


def _listing() -> list[tuple[int, str, str, tuple[int, ...]]]:
    rows = []
    for line in LISTING.read_text().splitlines():
        m = re.match(r"\s*(\d+)\s+(\S+)\s+(\S+)\s+\[([\d, ]*)\]", line)
        if m:
            shape = tuple(int(x) for x in m[4].split(",") if x.strip())
            rows.append((int(m[1]), m[2], m[3], shape))
    return rows


def _expand(count: int, pattern: str) -> list[str]:
    n = pattern.count("N")
    if n == 0:
        return [pattern]
    if n == 1:
        return [pattern.replace("N", str(i), 1) for i in range(count)]
    per = {16: 4, 256: 64}[count] if "slice" in pattern or "experts" in pattern else None
    outer = count // per
    return [pattern.replace("N", str(a), 1).replace("N", str(b), 1) for a in range(outer) for b in range(per)]


def test_the_converters_real_name_set_maps_onto_oracle_names():
    rows = _listing()
    headers = {}
    for count, pattern, dtype, shape in rows:
        names = _expand(count, pattern)
        assert len(names) == count, pattern
        for name in names:
            headers[name] = F.Header(dtype, shape)
    assert len(headers) == 3366
    plan = plan_pack(headers, {"quantization_config": QC})
    assert sorted(plan.stacked) == [f"layers.{L}.attn.wo_a" for L in range(4)]
    assert all(v == [f"layers.{L}.attn.wo_a.slice.{g}" for g in range(4)]
               for L, v in ((int(p.split(".")[1]), plan.stacked[p]) for p in plan.stacked))
    exl3 = {p: f for p, f in plan.linears.items() if f.kind == "exl3"}
    # wo_a slices, experts, shared experts, wq_a/wq_b/wkv/wo_b, compressors (3 layers), indexer compressors + wq_b (2)
    assert len(exl3) == 16 + 256 * 3 + 4 * 3 + 4 * 4 + 3 * 2 + 2 * 2 + 2
    assert {f.k2 for f in exl3.values()} == {6} and {f.codebook for f in exl3.values()} == {2}
    assert not any(".slice." in n for n in plan.passthrough)
    assert plan.describe()["K"] == [3.0]


def _write(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))


def _exl3(out: int, n_in: int, k: int, g: torch.Generator, marker: str | None = "mul1") -> dict[str, torch.Tensor]:
    t = {"trellis": torch.randint(-2 ** 15, 2 ** 15, (n_in // 16, out // 16, 16 * k), generator=g, dtype=torch.int16),
         "suh": (torch.randn(n_in, generator=g).sign() * (1 + torch.rand(n_in, generator=g))).half(),
         "svh": (torch.randn(out, generator=g).sign() * 0.01 * (1 + torch.rand(out, generator=g))).half()}
    if marker:
        t[marker] = torch.tensor({"mul1": F.MUL1_MARKER, "mcg": F.MCG_MARKER}[marker], dtype=torch.int32)
    return t


@pytest.fixture(scope="module")
def release(tmp_path_factory) -> Path:
    from oracle.dsv41.tiny_v4 import write_tiny_v4_checkpoint

    return Path(write_tiny_v4_checkpoint(tmp_path_factory.mktemp("rel") / "ck", seed=0,
                                         overrides={"vocab_size": 4096}))


def _exllamav3_folder(release: Path, dst: Path, k: int = 3, only_layer: int | None = None) -> dict[str, dict]:
    """An exllamav3-style folder for the release checkpoint: its names, dtypes and config shape."""
    from oracle.dsv41.checkpoint import Checkpoint

    ck = Checkpoint(release)
    g = torch.Generator().manual_seed(1)
    tensors, exl3 = {}, {}
    plain16 = re.compile(r".*(\.ffn\.gate|indexer\.weights_proj|^head)$")
    for p, spec in ck.inventory.linears.items():
        if only_layer is not None and p.startswith("layers.") and int(p.split(".")[1]) != only_layer:
            continue
        if plain16.match(p):
            tensors[f"{p}.weight"] = ck.load_linear(p).half()
            continue
        if p.endswith(".attn.wo_a"):
            groups = 4
            for gi in range(groups):
                t = _exl3(spec.out // groups, spec.in_, k, g)
                exl3[f"{p}.slice.{gi}"] = t
        else:
            exl3[p] = _exl3(spec.out, spec.in_, k, g)
    for p, t in exl3.items():
        for s, v in t.items():
            tensors[f"{p}.{s}"] = v
    for name in ck.inventory.tensors:
        if only_layer is not None and name.startswith("layers.") and int(name.split(".")[1]) != only_layer:
            continue
        v = ck.load_tensor(name)
        tensors[name] = v.half() if name.endswith("gate.bias") else v.to(DT.get(ck._official.infos[name].dtype, v.dtype)) \
            if ck._official.infos[name].dtype in DT else v
    dst.mkdir(parents=True)
    _write(dst / "model.safetensors", tensors)
    cfg = json.loads((release / "config.json").read_text())
    cfg["quantization_config"] = dict(QC, bits=float(k))
    (dst / "config.json").write_text(json.dumps(cfg))
    return exl3


def test_a_synthetic_exllamav3_folder_loads_as_a_pack_and_decodes_exactly(release, tmp_path):
    from oracle.dsv41.checkpoint import Checkpoint

    exl3 = _exllamav3_folder(release, tmp_path / "exl3", only_layer=1)
    desc = translate_pack(tmp_path / "exl3", tmp_path / "pack")
    assert desc["stacked"] == {"layers.1.attn.wo_a": 4} and desc["K"] == [3.0]
    ck = Checkpoint(release, pack_dir=tmp_path / "pack")
    w = ck.load_layer(1)
    want = torch.cat([F.exl3_dequant(exl3[f"layers.1.attn.wo_a.slice.{g}"]["trellis"],
                                     exl3[f"layers.1.attn.wo_a.slice.{g}"]["suh"],
                                     exl3[f"layers.1.attn.wo_a.slice.{g}"]["svh"], 2) for g in range(4)])
    assert torch.equal(w["attn.wo_a.weight"], want)
    e = exl3["layers.1.ffn.experts.5.w2"]
    assert torch.equal(w["ffn.experts.5.w2.weight"], F.exl3_dequant(e["trellis"], e["suh"], e["svh"], 2))
    man = ck.manifest()["linears"]
    assert man["layers.1.ffn.experts.5.w2"]["source"] == "pack"
    assert man["layers.0.ffn.experts.5.w2"]["source"] == "official"     # not written: stays official
    assert man["layers.1.attn.wo_a"]["source"] == "pack"


def _headers(**extra) -> dict[str, F.Header]:
    h = {"layers.0.attn.wq_a.trellis": F.Header("I16", (16, 8, 48)), "layers.0.attn.wq_a.suh": F.Header("F16", (256,)),
         "layers.0.attn.wq_a.svh": F.Header("F16", (128,)), "layers.0.attn.wq_a.mul1": F.Header("I32", ())}
    h.update(extra)
    return h


@pytest.mark.parametrize("qc, needle", [
    ({"quant_method": "gptq", "codebook": "mul1"}, "quant_method 'gptq'"),
    ({"quant_method": "exl3", "codebook": "e8p"}, "codebook 'e8p'"),
    ({"quant_method": "exl3", "codebook": "mcg"}, "!= quantization_config.codebook 'mcg'"),
    ({"quant_method": "exl3", "codebook": "mul1", "bits": 0}, "bits 0"),
])
def test_config_it_cannot_decode_is_refused_by_name(qc, needle):
    with pytest.raises(Exl3PackError, match=re.escape(needle)):
        plan_pack(_headers(), {"quantization_config": qc})
    with pytest.raises(Exl3PackError, match="no quantization_config"):
        plan_pack(_headers(), {})


def test_tensors_it_cannot_decode_are_refused_by_name():
    qc = {"quantization_config": QC}
    t = F.Header("I16", (16, 8, 48))
    with pytest.raises(Exl3PackError, match=r"layers\.0\.ffn\.experts\.0\.w1\.slice\.0\.trellis: a \.slice\. split"):
        plan_pack(_headers(**{"layers.0.ffn.experts.0.w1.slice.0.trellis": t}), qc)
    gap = {f"layers.0.attn.wo_a.slice.{g}.{s}": h for g in (0, 2) for s, h in
           (("trellis", F.Header("I16", (128, 8, 48))), ("suh", F.Header("F16", (2048,))),
            ("svh", F.Header("F16", (128,))), ("mul1", F.Header("I32", ())))}
    with pytest.raises(Exl3PackError, match=r"slices \[0, 2\] do not run 0\.\.1"):
        plan_pack(_headers(**gap), qc)
    with pytest.raises(Exl3PackError, match="half-integer K = 1.5 requires the mul1 codebook"):
        plan_pack({"a.trellis": F.Header("I16", (16, 8, 24)), "a.suh": F.Header("F16", (256,)),
                   "a.svh": F.Header("F16", (128,))}, {"quantization_config": dict(QC, codebook="3inst")})
    with pytest.raises(Exl3PackError, match=r"needs exactly one of \.svh / \.sv"):
        plan_pack({k: v for k, v in _headers().items() if not k.endswith("svh")}, qc)
    with pytest.raises(Exl3PackError, match="without .trellis"):
        plan_pack({"layers.0.attn.wq_a.suh": F.Header("F16", (256,))}, qc)
