"""The tiny vision-language model the CPU rig serves with images: a random-weight Idefics3 (transformers
``Idefics3ForConditionalGeneration``, SmolVLM's architecture: a 2-layer SigLIP-style vision tower at 112 px,
the pixel-shuffle connector, a 2-layer Llama text model of width 128 with 64-wide heads, the smallest head
vLLM's CPU attention has a kernel for) with the SmolLM2-135M tokenizer plus the four image
tokens, written in fp32.

    ds41gate setup tiny-vlm         # build if needed, print the folder
    ensure_tiny_vlm() -> Path       # $DS41_CACHE/models/tiny-idefics3-<writer hash>/

No DeepSeek-V4.1 engine runs on this box; this model proves the image path over HTTP on a real server (vLLM
CPU serves ``Idefics3ForConditionalGeneration``) with transformers fp32 as its oracle (oracle/hf_vision.py).
Why not LLaVA: vLLM 0.32's ``llava.py`` imports its Pixtral module, which imports transformers' Pixtral image
processor, which needs torchvision, and the vLLM venv has none (scripts/setup-vllm.sh removes the PyPI build,
which does not match torch 2.13.0+cpu); Idefics3 imports nothing of the kind.

* **Layout.** 112 x 112 pixels in 14-px patches: 64 patches; the connector's pixel shuffle (scale 2) makes
  16 rows. Image splitting is off, so every image is one "global" image and takes 19 positions:
  ``<fake_token_around_image> <global-img> <image> x 16 <fake_token_around_image>`` (vLLM's and transformers'
  Idefics3 layout for an unsplit image); the 16 ``<image>`` positions (id 49152) take the connector rows.
  The image processor is Idefics3's (longest edge to 112, then 112 x 112, Lanczos, mean/std 0.5).
* **Chat template** (``chat_template.jinja``): ChatML, no default system message; content parts are
  concatenated in order, an image part printing ``<image>``; a tool call prints ``<tool_call>NAME</tool_call>``
  (only the name: vLLM and the harness hand the template the arguments in different types).
* **Weights** (own choice; seeded): every linear and the patch convolution N(0, 1/fan_in) (gain 1), biases
  N(0, 0.02²), norm weights 1 ± 10 %, the token embeddings N(0, 1), the vision position embeddings
  N(0, 0.2²) (so the pixels, not the positions, dominate the patch rows), the LM head N(0, (3/√d)²) so the
  next-token distribution is far from uniform. With gain-1 attention the image rows reach the text at the
  scale of the text rows, so images change the text's logprobs (tested: tests/engine/test_tiny_vlm.py).
  Random weights read nothing: the model cannot transcribe a rendered string (gates/test_image_input.py says
  what its read-back can show).

The folder name carries the sha256 of this file, so changing the writer writes a new model and never reuses
a stale one; the build goes to a temporary folder renamed into place under a file lock.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
import tempfile
from pathlib import Path

from filelock import FileLock

from engine.models import publish_dir

IMAGE_TOKEN = "<image>"
FAKE_TOKEN = "<fake_token_around_image>"
GLOBAL_TOKEN = "<global-img>"
END_TOKEN = "<end_of_utterance>"
ADDED_TOKENS = (IMAGE_TOKEN, FAKE_TOKEN, GLOBAL_TOKEN, END_TOKEN)   # ids 49152.. in this order
IMAGE_SIZE = 112
PATCH_SIZE = 14
SCALE_FACTOR = 2
TOKENS_PER_IMAGE = (IMAGE_SIZE // PATCH_SIZE) ** 2 // SCALE_FACTOR ** 2
TEXT_DIM = 128   # head_dim 64: vLLM CPU attention has no kernel for head_dim 16
VISION_DIM = 64
SEED = 1234
LM_HEAD_GAIN = 3.0
VISION_POSITION_STD = 0.2
SERVED_NAME = "tiny-vlm"

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% else %}{{ '<image>' }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{% if message.tool_calls is defined and message.tool_calls %}"
    "{% for call in message.tool_calls %}{{ '<tool_call>' + call['function']['name'] + '</tool_call>' }}{% endfor %}"
    "{% endif %}"
    "{{ '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class VLMSetupError(RuntimeError):
    """The tiny VLM could not be written; the message says which step and where."""


def writer_hash() -> str:
    return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:12]


def vlm_dir(cache: Path | None = None) -> Path:
    from core.paths import cache_dir

    return (cache or cache_dir()) / "models" / f"tiny-idefics3-{writer_hash()}"


def build_config(vocab_size: int, image_token_id: int):
    from transformers import Idefics3Config, Idefics3VisionConfig, LlamaConfig

    vision = Idefics3VisionConfig(hidden_size=VISION_DIM, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, image_size=IMAGE_SIZE, patch_size=PATCH_SIZE,
                                  layer_norm_eps=1e-6, hidden_act="gelu_pytorch_tanh")
    text = LlamaConfig(vocab_size=vocab_size, hidden_size=TEXT_DIM, intermediate_size=256, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048,
                       rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
                       bos_token_id=1, eos_token_id=2, pad_token_id=None)
    return Idefics3Config(vision_config=vision.to_dict(), text_config=text.to_dict(), scale_factor=SCALE_FACTOR,
                          image_token_id=image_token_id, tie_word_embeddings=False)


def init_weights(model, seed: int = SEED) -> None:
    """Every parameter drawn by the rule in the module docstring, from one seeded generator in name order."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda np_: np_[0]):
            leaf = name.rsplit(".", 1)[-1]
            if "norm" in name:
                if leaf == "weight":
                    p.copy_(1.0 + 0.1 * (2 * torch.rand(p.shape, generator=g) - 1))
                else:
                    p.copy_(0.02 * torch.randn(p.shape, generator=g))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            elif "position_embedding" in name:
                p.copy_(VISION_POSITION_STD * torch.randn(p.shape, generator=g))
            elif name.startswith("lm_head"):
                p.copy_(torch.randn(p.shape, generator=g) * (LM_HEAD_GAIN / math.sqrt(p.shape[1])))
            elif leaf == "bias":
                p.copy_(0.02 * torch.randn(p.shape, generator=g))
            elif p.ndim >= 2:
                fan_in = int(torch.tensor(p.shape[1:]).prod())
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(fan_in))
            else:
                raise VLMSetupError(f"init_weights: no rule for parameter {name} {list(p.shape)}")


def image_processor_kwargs() -> dict:
    return dict(do_resize=True, size={"longest_edge": IMAGE_SIZE}, resample=1, do_image_splitting=False,
                max_image_size={"longest_edge": IMAGE_SIZE}, do_rescale=True, rescale_factor=1 / 255,
                do_normalize=True, image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5], do_pad=True,
                do_convert_rgb=True)


def write_tiny_vlm(dst: Path, tokenizer_dir: Path, seed: int = SEED) -> None:
    """Write the model, tokenizer, image processor, processor and chat template to `dst` (atomically)."""
    import torch
    from safetensors import safe_open
    from tokenizers import AddedToken
    from transformers import AutoTokenizer, Idefics3ForConditionalGeneration, Idefics3ImageProcessorPil, Idefics3Processor

    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=dst.parent, prefix=f".{dst.name}.partial-"))
    try:
        tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
        base_vocab = len(tok)
        tok.add_tokens([AddedToken(t, special=True, normalized=False) for t in ADDED_TOKENS], special_tokens=True)
        ids = [tok.convert_tokens_to_ids(t) for t in ADDED_TOKENS]
        if ids != list(range(base_vocab, base_vocab + len(ADDED_TOKENS))) or len(tok) != base_vocab + len(ADDED_TOKENS):
            raise VLMSetupError(f"{tokenizer_dir}: adding {ADDED_TOKENS} gave ids {ids} (vocabulary {base_vocab})")
        tok.chat_template = CHAT_TEMPLATE
        cfg = build_config(len(tok), ids[0])
        torch.manual_seed(seed)
        model = Idefics3ForConditionalGeneration(cfg).to(torch.float32).eval()
        init_weights(model, seed)
        improc = Idefics3ImageProcessorPil(**image_processor_kwargs())
        proc = Idefics3Processor(image_processor=improc, tokenizer=tok, image_seq_len=TOKENS_PER_IMAGE,
                                 chat_template=CHAT_TEMPLATE)
        if len(tok) != base_vocab + len(ADDED_TOKENS):
            raise VLMSetupError(f"the Idefics3 processor added tokens beyond {ADDED_TOKENS}: vocabulary {len(tok)}")
        model.save_pretrained(str(tmp), safe_serialization=True)
        proc.save_pretrained(str(tmp))
        (tmp / "chat_template.jinja").write_text(CHAT_TEMPLATE, encoding="utf-8")
        with safe_open(str(tmp / "model.safetensors"), framework="pt") as f:
            keys = sorted(f.keys())
        want = sorted(n for n, _ in model.named_parameters())
        if keys != want:  # vLLM's Idefics3 loader reads the model's own names (model.vision_model.*, ...)
            raise VLMSetupError(f"saved tensor names differ from the model's: {sorted(set(keys) ^ set(want))[:5]}")
        (tmp / "ds41_tiny_vlm.json").write_text(json.dumps(
            {"writer_hash": writer_hash(), "seed": seed, "architecture": "Idefics3ForConditionalGeneration",
             "image_token_id": ids[0], "fake_token_id": ids[1], "global_token_id": ids[2],
             "tokens_per_image": TOKENS_PER_IMAGE, "image_size": IMAGE_SIZE,
             "tokenizer_from": str(tokenizer_dir)}, indent=1) + "\n")
        publish_dir(tmp, dst, VLMSetupError, "writing")
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)


def ensure_tiny_vlm(cache: Path | None = None, tokenizer_dir: Path | None = None) -> Path:
    """The tiny VLM's folder, written first if this writer's version is not in the cache yet."""
    dst = vlm_dir(cache)
    if (dst / "ds41_tiny_vlm.json").is_file():
        return dst
    dst.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(dst.parent / ".tiny-vlm.lock", thread_local=False):
        if (dst / "ds41_tiny_vlm.json").is_file():
            return dst
        if tokenizer_dir is None:
            from engine.models import ensure_smollm2

            tokenizer_dir = ensure_smollm2(cache).hf_dir
        write_tiny_vlm(dst, Path(tokenizer_dir))
    return dst


def image_layout(model_dir: Path):
    """The panel layout of this model's images (panels.images.FixedSpanLayout), read from its marker file:
    an unsplit Idefics3 image, ``<fake> <global-img> <image> x n <fake>``."""
    from panels.images import FixedSpanLayout

    meta = json.loads((Path(model_dir) / "ds41_tiny_vlm.json").read_text())
    fake, glob = int(meta["fake_token_id"]), int(meta["global_token_id"])
    return FixedSpanLayout(f"idefics3-unsplit-{meta['image_size']}px-{meta['tokens_per_image']}",
                           int(meta["image_token_id"]), int(meta["tokens_per_image"]), prefix=(fake, glob),
                           suffix=(fake,))
