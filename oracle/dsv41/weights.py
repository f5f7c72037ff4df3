"""Looking up the tensors a module needs in a name -> tensor map (official names, §4)."""

from __future__ import annotations

import torch


def need(w: dict, name: str) -> torch.Tensor:
    """`w[name]`, or a KeyError that names the missing checkpoint tensor."""
    try:
        return w[name]
    except KeyError:
        raise KeyError(f"missing checkpoint tensor {name!r}") from None
