"""DeepSeek-V4 MoE (dsv4-engine.md §5 "router"): the V4.1 experts (moe.expert) behind the V4 router.

* The first `num_hash_layers` layers are hash-routed: the experts are `tid2eid[token id]` ([V, k] ints in
  the checkpoint), the gate has no bias; the weights are still the scores of those experts.
* Later layers select top-k of score + bias (the bias picks, it does not weight), as in V4.1.
* Weights are divided by their sum (no 1e-20; V4 has no norm_topk_prob switch) unless the scores are a
  softmax, then multiplied by route_scale. No gate_temp, no bias_vl (no vision path).
* Experts take fp8 inputs QDQ'd per 128 channels (attention_v4.V4_ACT_BLOCK).
"""

from __future__ import annotations

import torch

from .attention_v4 import V4_ACT_BLOCK
from .config import ModelConfig
from .moe import MoE, router_scores
from .numerics import Numerics
from .weights import need


def route_v4(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tid2eid: torch.Tensor | None,
             ids: torch.Tensor | None, k: int, cfg: ModelConfig, num: Numerics, site: str = "router"):
    """x [n, d], ids [n] -> (weights [n, k], expert indices [n, k])."""
    s = router_scores(num.fp32_linear(x, weight), cfg.score_func, num)  # no gate_temp in V4
    if tid2eid is not None:
        if ids is None or ids.numel() != x.shape[0]:
            raise ValueError(f"{site}: a hash-routed layer needs the token id of each of its {x.shape[0]} rows")
        idx = tid2eid[ids.reshape(-1).to(tid2eid.device)]
    else:
        _, idx = num.topk(s + bias, k, site)
    wts = s.gather(1, idx)
    if cfg.score_func != "softmax":
        wts = wts / num.sum(wts, -1, keepdim=True)
    return wts * cfg.route_scale, idx


class MoEV4(MoE):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__(cfg, layer_id)
        self.n_experts, self.k = cfg.n_routed_experts, cfg.n_activated_experts
        self.hash = cfg.is_hash_layer(layer_id)

    def load_router(self, w: dict, p: str) -> None:
        """A hash-routed layer's token -> experts table (no bias), else the selection bias."""
        if self.hash:
            t = need(w, p + "gate.tid2eid")
            if t.shape != (self.cfg.vocab_size, self.k):
                raise ValueError(f"{p}gate.tid2eid has shape {tuple(t.shape)}, expected "
                                 f"{(self.cfg.vocab_size, self.k)}")
            self.tid2eid, self.bias = t.long(), None  # the loader hands every tensor over as fp32 (exact here)
            if int(self.tid2eid.min()) < 0 or int(self.tid2eid.max()) >= self.n_experts:
                raise ValueError(f"{p}gate.tid2eid names experts outside 0..{self.n_experts - 1}")
        else:
            self.tid2eid, self.bias = None, need(w, p + "gate.bias")

    def __call__(self, x: torch.Tensor, num: Numerics, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """`input_ids` [.., s] beside x's rows: a hash-routed layer picks its experts by them."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        wts, idx = route_v4(x, self.gate, self.bias, self.tid2eid, input_ids, self.k, self.cfg, num,
                            f"router.{self.layer_id}")
        # fp8 inputs per 128 channels; an FP4 expert's kernel scales its weight per 32 along K
        routed_kw = dict(block=V4_ACT_BLOCK, gemm_block=32 if self.cfg.expert_dtype == "fp4" else None,
                         fmt=self.cfg.scale_fmt)
        shared_kw = dict(block=V4_ACT_BLOCK, fmt=self.cfg.scale_fmt)
        return num.r(self.run_experts(x, wts, idx, num, routed_kw, shared_kw)).reshape(shape)
