"""Panels: versioned, immutable prompt sets and their encodings for one tokenizer.

`load_panel("default")` → `Panel`; `encode_panel(panel, tokenizer)` → `EncodedPanel` (token ids and
scored masks); `encoded_from_record(record)` → the `EncodedPanel` a record was scored on. See
docs/DESIGN.md, "Panels seam".
"""

from panels.chat import ChatFormatError, DeepSeekV41Format, HFJinjaFormat
from panels.encode import encode_item, encode_panel
from panels.model import (
    DOMAINS,
    EncodedPanel,
    EncodedSequence,
    Message,
    Panel,
    PanelError,
    PanelHashMismatch,
    PanelInfo,
    PanelItem,
    ToolCall,
    ToolSpec,
)
from panels.pre_encoded import encoded_from_json, encoded_from_record
from panels.store import content_hash, list_panels, load_panel
from panels.tokenizers import PanelTokenizer, TokenizerError, load_tokenizer

__all__ = [
    "DOMAINS",
    "ChatFormatError",
    "DeepSeekV41Format",
    "EncodedPanel",
    "EncodedSequence",
    "HFJinjaFormat",
    "Message",
    "Panel",
    "PanelError",
    "PanelHashMismatch",
    "PanelInfo",
    "PanelItem",
    "PanelTokenizer",
    "ToolCall",
    "ToolSpec",
    "TokenizerError",
    "content_hash",
    "encode_item",
    "encode_panel",
    "encoded_from_json",
    "encoded_from_record",
    "list_panels",
    "load_panel",
    "load_tokenizer",
]
