"""What a DeepSeek-V4.1 oracle run is asked to do (RunOptions), the error it raises when it cannot, and the
deterministic compute settings it runs under."""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Iterator

import torch

from .numerics import PRECISION_MODES

TOP_K = 256


class RunnerError(RuntimeError):
    """The runner cannot start or continue; the message says what to change."""


@dataclass(frozen=True)
class RunOptions:
    precision: str = "fp32"
    device: str = "cpu"
    threads: int = 0  # 0: torch's default
    spill: str = "auto"  # "auto" | "ram" | "disk"
    ram_budget: int = 0  # bytes of activations kept in RAM under "auto"; 0: a quarter of MemAvailable
    top_k: int = TOP_K
    full_logprobs: bool = False
    index_k: str = "upstream"  # prefill-only scoring is identical for both switches (§18.1)
    progress: bool = True
    keep_work: bool = False
    restart: bool = False
    shard: tuple[int, int] | None = None  # (I, N), recorded in the provenance
    seq_indices: tuple[int, ...] | None = None  # panel indices of the sequences (sharding)
    panel_sequences: int | None = None  # sequences in the whole panel (sharding)
    # decode each routed expert when the MoE reaches it (one expert held, not the layer's: 54 GB fp32 on the
    # release) and send the stage's sequences through as few MoE calls as STREAM_GROUP_BYTES allows
    stream_experts: bool = False

    def __post_init__(self):
        if self.precision not in PRECISION_MODES:
            raise RunnerError(f"precision {self.precision!r}: expected one of {PRECISION_MODES}")
        if self.spill not in ("auto", "ram", "disk"):
            raise RunnerError(f"spill {self.spill!r}: expected auto, ram or disk")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise RunnerError(f"device {self.device!r}: expected cpu or cuda[:N]")


@contextlib.contextmanager
def compute_context(device: str, threads: int) -> Iterator[None]:
    """A fixed thread count; on CUDA deterministic algorithms, TF32 off and cuBLAS's fixed-workspace mode (the
    env var must be set before the first cuBLAS call, so the CLI sets it at start too). On the CPU every op
    the oracle uses is deterministic already (repeated and resumed runs are tested bit-identical), and
    torch.use_deterministic_algorithms costs ~2 s of torch._inductor imports per process, so it is CUDA-only."""
    prev = (torch.get_num_threads(), torch.are_deterministic_algorithms_enabled())
    cuda = device.startswith("cuda")
    if threads:
        torch.set_num_threads(threads)
    if cuda:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        if not torch.cuda.is_available():
            raise RunnerError(f"device {device!r}: this torch build sees no CUDA device")
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
        torch.use_deterministic_algorithms(True)
    try:
        with torch.device(device), torch.inference_mode():
            yield
    finally:
        torch.set_num_threads(prev[0])
        if cuda:
            torch.use_deterministic_algorithms(prev[1])
