"""Panel → token ids + scored masks for one tokenizer.

The harness always sends ids to engines, so the template is applied exactly once, here.
"""

from __future__ import annotations

from pathlib import Path

from panels.chat import ChatFormatError, chat_spans
from panels.model import EncodedPanel, EncodedSequence, Panel, PanelItem
from panels.tokenizers import PanelTokenizer, load_tokenizer


def _mask_from_spans(
    offsets: list[tuple[int, int]], spans: tuple[tuple[int, int], ...], item_id: str
) -> list[bool]:
    mask = [False] * len(offsets)
    for start, end in spans:
        for i, (a, b) in enumerate(offsets):
            if a == b:
                continue
            if start <= a < end:
                mask[i] = True
                if b > end:
                    raise ChatFormatError(f"item '{item_id}': token {i} straddles the end of a scored reply")
            elif a < start < b:
                # The reply's first token is shared with the prompt; scoring it would mix prompt and
                # reply, dropping it would hide the first reply token. Neither is right: refuse.
                raise ChatFormatError(f"item '{item_id}': token {i} straddles the start of a scored reply")
    return mask


def _mask_from_positions(item: PanelItem, n_ids: int, tok: PanelTokenizer) -> list[bool]:
    """A long item is built to an exact token count in one tokenizer: another count means another tokenizer,
    whose positions would not be the chosen depths, so it is refused rather than scored."""
    if n_ids != item.tokens:
        raise ChatFormatError(f"item '{item.id}': built to {item.tokens} tokens, but tokenizer '{tok.name}' "
                              f"({tok.source}) gives {n_ids}; long panels are built for the DeepSeek tokenizer "
                              "(panels/long.py)")
    mask = [False] * n_ids
    for p in item.positions:
        mask[p] = True
    return mask


def encode_item(item: PanelItem, tok: PanelTokenizer, *, allow_split_markers: bool = False) -> EncodedSequence:
    return _encode_item(item, tok, allow_split_markers)[0]


def _encode_item(item: PanelItem, tok: PanelTokenizer, allow_split_markers: bool) -> tuple[EncodedSequence, list[str]]:
    tk = tok.tokenizer
    split: list[str] = []
    if item.kind == "raw":
        assert item.text is not None
        if tok.raw_prefix is not None:
            enc = tk.encode(tok.raw_prefix + item.text, add_special_tokens=False)
        else:
            enc = tk.encode(item.text, add_special_tokens=True)
        ids = list(enc.ids)
        if item.score == "positions":
            mask = _mask_from_positions(item, len(ids), tok)
        else:
            mask = [i > 0 for i in range(len(ids))]
    else:
        rendered = chat_spans(tok.chat_format, item)
        split = [m for m in tok.missing_markers() if m in rendered.text]
        if split and not allow_split_markers:
            raise ChatFormatError(
                f"item '{item.id}': tokenizer '{tok.name}' ({tok.source}) has no special token for "
                f"{split}, which format '{tok.chat_format.name}' writes; they would be split into "
                "ordinary tokens. Use the model's own tokenizer, or pass allow_split_markers=True (CLI: --allow-split-markers)."
            )
        enc = tk.encode(rendered.text, add_special_tokens=False)
        ids = list(enc.ids)
        mask = _mask_from_spans(list(enc.offsets), rendered.spans, item.id)
    if mask:
        mask[0] = False
    if not any(mask):
        raise ChatFormatError(f"item '{item.id}': no scored positions with tokenizer '{tok.name}'")
    return EncodedSequence(seq_id=item.id, domain=item.domain, token_ids=tuple(ids), scored_mask=tuple(mask)), split


def encode_panel(
    panel: Panel, tokenizer: PanelTokenizer | str | Path, *, allow_split_markers: bool = False
) -> EncodedPanel:
    tok = tokenizer if isinstance(tokenizer, PanelTokenizer) else load_tokenizer(tokenizer)
    done = [_encode_item(i, tok, allow_split_markers) for i in panel.items]
    seqs = tuple(s for s, _ in done)
    used = sorted({m for _, split in done for m in split})
    notes = (f"markers split into ordinary tokens: {used}",) if used else ()
    return EncodedPanel(
        panel_name=panel.name,
        panel_version=panel.version,
        panel_hash=panel.content_hash,
        tokenizer_hash=tok.hash,
        sequences=seqs,
        tokenizer_name=tok.name,
        chat_format=tok.chat_format.name,
        notes=notes,
    )
