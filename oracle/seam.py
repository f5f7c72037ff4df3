"""The oracle seam (docs/DESIGN.md): an oracle scores an encoded panel and returns a record.

    record = oracle.score(encoded_panel)     # side "oracle", top-K + actual token + logsumexp per position

Implemented by oracle.hf.HFPanelOracle (fp32 transformers models) and oracle.dsv41.runner.DSV41Oracle
(the layer-streamed DeepSeek-V4.1 oracle). Both turn logits into record rows with oracle.scoring, so the
same logits give the same record whichever oracle produced them.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from core.records import Record
from panels.model import EncodedPanel


@runtime_checkable
class Oracle(Protocol):
    def score(self, panel: EncodedPanel) -> Record:
        """Every scored position of every sequence of `panel`, as an oracle record."""
        ...
