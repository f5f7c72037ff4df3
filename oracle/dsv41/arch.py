"""The architecture of a DeepSeek checkpoint, chosen once from its config: DeepSeek-V4.1 or DeepSeek-V4.

Everything else in the oracle is one code path; what really differs between the two is here, as one `Arch`:

    arch = arch_of(cfg)
    block = arch.block(cfg, L, index_k)        # block.Block (V4.1's one-sublayer-late mHC) | block_v4.BlockV4
    head = arch.head(cfg)                      # head.Head | head.HyperHead (collapses the streams itself)
    inv = arch.inventory(cfg)                  # inventory.inventory_v41 | inventory.inventory_v4
    arch.head_tensors                          # what the head stage reads: {name: "linear" | "tensor"}
    arch.drafter(cfg, w, embed, head)          # mtp.DSpark | dspark_v4.DSparkV4 (the DSpark drafter)
    arch.taps_block_output                     # DSpark taps a target layer's input (V4.1) or output (V4)

The pieces below a block that differ (attention_v4, compressor_v4, moe_v4) are chosen by the block class; the
config decides the architecture (config.detect_arch -> cfg.arch) and nothing outside this module asks which
one it is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .block import Block
from .block_v4 import BlockV4
from .config import ModelConfig
from .dspark_v4 import DSparkV4
from .head import Head, HyperHead
from .inventory import Inventory, inventory_v4, inventory_v41
from .mtp import DSpark

HEAD_TENSORS = {"norm.weight": "tensor", "head.weight": "linear"}
HC_HEAD_TENSORS = {f"hc_head_{k}": "tensor" for k in ("fn", "base", "scale")}


@dataclass(frozen=True)
class Arch:
    name: str  # cfg.arch
    block: type[Block]
    head: type[Head]
    inventory: Callable[[ModelConfig], Inventory]
    head_tensors: dict[str, str]  # the head stage's weights: name -> "linear" | "tensor"
    drafter: type = DSpark
    taps_block_output: bool = False


V41 = Arch("v4.1", Block, Head, inventory_v41, HEAD_TENSORS)
# the V4 head collapses the residual streams with its own hc_head weights; V4-Flash's DSpark taps the stream mean
# of a target layer's output (exllamav3's DeepseekV4 export_state_layers), V4.1's the layer's input (§7)
V4 = Arch("v4", BlockV4, HyperHead, inventory_v4, HEAD_TENSORS | HC_HEAD_TENSORS, DSparkV4, True)
ARCHS = {a.name: a for a in (V41, V4)}


def arch_of(cfg: ModelConfig) -> Arch:
    return ARCHS[cfg.arch]  # cfg.arch is checked against config.ARCHITECTURES when the config is built


def expected_inventory(cfg: ModelConfig) -> Inventory:
    """Every tensor of the official checkpoint for ``cfg``, in its architecture's names."""
    return arch_of(cfg).inventory(cfg)
