"""engine.models: the three SmolLM2 forms, checked against the independent values of engines.md §12.7.

The first run builds the forms under $DS41_CACHE (about 45 s); later runs reuse them.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from core.hashing import sha256_file
from engine import models
from engine.models import (
    CANARY_IDS,
    CANARY_PROMPT,
    ModelSetupError,
    Q4_1_SHA256,
    SmolLM2Paths,
    ensure_smollm2,
    expected_paths,
)

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def smol() -> SmolLM2Paths:
    return ensure_smollm2()


def test_paths_layout(smol: SmolLM2Paths) -> None:
    assert smol == expected_paths()
    assert smol.gguf_q4_1.stat().st_size == 98_362_432
    assert sha256_file(smol.gguf_q4_1) == Q4_1_SHA256
    assert smol.tokenizer_json == smol.hf_dir / "tokenizer.json"
    for name in models.HF_REQUIRED_FILES:
        assert (smol.hf_dir / name).is_file(), name
    config = json.loads((smol.hf_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["num_hidden_layers"] == 30 and config["hidden_size"] == 576
    assert config["vocab_size"] == 49152
    assert config["tie_word_embeddings"] is True
    assert "quantization_config" not in config
    template = (smol.hf_dir / "chat_template.jinja").read_text()
    assert "<|im_start|>" in template and "<|im_end|>" in template
    # nothing half-built is left next to the forms
    assert not [p for p in smol.hf_dir.parent.iterdir() if "partial" in p.name]


def test_tokenizer_json_gives_reference_ids(smol: SmolLM2Paths) -> None:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(smol.tokenizer_json))
    assert tok.encode(CANARY_PROMPT, add_special_tokens=True).ids == list(CANARY_IDS)
    assert tok.get_vocab_size() == 49152


def test_hf_fp32_forward_matches_published_reference(smol: SmolLM2Paths) -> None:
    """§12.7: an fp32 transformers forward of Form C, log-softmax in float64."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(smol.hf_dir))
    ids = tok(CANARY_PROMPT)["input_ids"]
    assert list(ids) == [504, 3575, 282, 4649, 314]
    model = AutoModelForCausalLM.from_pretrained(str(smol.hf_dir), dtype=torch.float32)
    model.eval()
    assert next(model.parameters()).dtype == torch.float32
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].double()
    lp = torch.log_softmax(logits, dim=-1).numpy()
    # position i is predicted by row i-1
    assert lp[0, 3575] == pytest.approx(-11.5393, abs=1e-3)  # " capital"
    assert lp[1, 282] == pytest.approx(-0.3376, abs=1e-3)  # " of"
    assert lp[2, 4649] == pytest.approx(-2.4387, abs=1e-3)  # " France"
    assert lp[3, 314] == pytest.approx(-0.4510, abs=1e-3)  # " is"
    assert lp[4, 7042] == pytest.approx(-0.2581, abs=1e-3)  # " Paris" (next token)
    # ranks and top entries
    assert int((lp[0] > lp[0, 3575]).sum()) + 1 == 2923
    assert int((lp[2] > lp[2, 4649]).sum()) + 1 == 2
    top_next = np.argsort(-lp[4])[:5].tolist()
    assert top_next == [7042, 260, 4528, 2250, 1315]
    assert lp[4, 260] == pytest.approx(-2.7407, abs=1e-3)


def test_f32_gguf_is_an_exact_dequantization(smol: SmolLM2Paths) -> None:
    from gguf import GGMLQuantizationType, GGUFReader
    from gguf.quants import dequantize

    src = GGUFReader(smol.gguf_q4_1)
    dst = GGUFReader(smol.gguf_f32)
    assert len(dst.tensors) == len(src.tensors) == 272
    assert {t.tensor_type for t in dst.tensors} == {GGMLQuantizationType.F32}
    assert int(dst.get_field("general.file_type").contents()) == 0  # LlamaFileType.ALL_F32
    src_keys = {k for k in src.fields if not k.startswith("GGUF.")}
    dst_keys = {k for k in dst.fields if not k.startswith("GGUF.")}
    assert src_keys == dst_keys
    for key in ("llama.block_count", "llama.rope.freq_base", "tokenizer.ggml.pre"):
        assert dst.get_field(key).contents() == src.get_field(key).contents(), key
    assert dst.get_field("tokenizer.ggml.tokens").contents()[:3] == src.get_field(
        "tokenizer.ggml.tokens"
    ).contents()[:3]
    by_name = {t.name: t for t in dst.tensors}
    checked = 0
    for t in src.tensors:
        if t.tensor_type in (GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0) and checked < 3:
            want = dequantize(t.data, t.tensor_type)
            got = np.asarray(by_name[t.name].data)
            assert got.shape == want.shape, t.name
            assert np.array_equal(got, want), t.name
            checked += 1
    assert checked == 3


def test_idempotent_second_call_is_fast_and_unchanged(smol: SmolLM2Paths) -> None:
    before = {p: p.stat().st_mtime_ns for p in (smol.gguf_f32, smol.gguf_q4_1, smol.hf_dir)}
    messages: list[str] = []
    again = ensure_smollm2(report=messages.append)
    assert again == smol
    assert {p: p.stat().st_mtime_ns for p in before} == before
    assert len(messages) == 1 and "ready" in messages[0], messages


def test_corrupt_q4_1_is_refused_with_its_path(tmp_path: Path) -> None:
    paths = expected_paths(tmp_path)
    paths.gguf_q4_1.parent.mkdir(parents=True)
    paths.gguf_q4_1.write_bytes(b"not a gguf")
    with pytest.raises(ModelSetupError) as err:
        ensure_smollm2(cache=tmp_path, report=lambda m: None)
    assert str(paths.gguf_q4_1) in str(err.value)
    assert Q4_1_SHA256 in str(err.value)
    assert not paths.gguf_f32.exists() and not paths.hf_dir.exists()


def test_hf_dir_missing_files_is_refused(tmp_path: Path, smol: SmolLM2Paths) -> None:
    paths = expected_paths(tmp_path)
    paths.gguf_q4_1.parent.mkdir(parents=True)
    paths.gguf_q4_1.symlink_to(smol.gguf_q4_1)
    paths.gguf_f32.symlink_to(smol.gguf_f32)
    paths.hf_dir.mkdir()
    (paths.hf_dir / "config.json").write_text("{}")
    with pytest.raises(ModelSetupError, match="model.safetensors"):
        ensure_smollm2(cache=tmp_path, report=lambda m: None)


def test_cli_prints_paths(smol: SmolLM2Paths) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "ds41gates.cli", "setup", "smollm2", "--json"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == smol.as_dict()
    assert "ready" in proc.stderr


def test_a_builder_waits_for_the_lock_another_holds_and_says_so_once(tmp_path: Path) -> None:
    import threading

    from filelock import FileLock

    lock_path = tmp_path / ".lock"
    said: list[str] = []
    entered = threading.Event()

    def builder() -> None:
        with models._file_lock(lock_path, said.append):
            entered.set()

    other = FileLock(lock_path)
    other.acquire()
    worker = threading.Thread(target=builder)
    worker.start()
    try:
        assert not entered.wait(0.5)             # held elsewhere: the builder waits
        assert said == [f"another process is building the model; waiting for lock {lock_path}"]
    finally:
        other.release()
    worker.join(10)
    assert entered.is_set() and len(said) == 1   # released: it builds, without a second message
