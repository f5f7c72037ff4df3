"""The divergence localizer's maths and its record (format ``ds41-localize/1``): where, layer by layer, an engine
leaves the oracle. Pure functions over arrays; the engine's and the oracle's captures are made elsewhere
(engine/localize_runner.py, oracle/capture.py) and the wiring is ds41gates/localize.py.

Sites. Per decoder layer L, in the order the forward computes them: ``attn`` (the attention output before the
residual add), ``mlp`` (the MLP / MoE output before the add), ``resid`` (the residual stream leaving the layer).
Each is captured for the prefill (every prompt position) and for one decode step (phase ``decode``).

Distances, per position p of a site, with e the engine's row and o the oracle's (float64):

* relative L2: ``rel_p = ||e_p - o_p|| / max(||o_p||, GUARD * scale)``, where ``scale`` is the site's activation
  scale (the RMS over positions of ||o_p||): each position against its own size, so an attention-sink row with
  a norm 100x the others neither hides nor dominates; the guard only keeps near-zero rows finite. Relative, so
  two layers' distances are comparable.
* cosine distance: ``cos_p = 1 - cos(e_p, o_p)``, computed as ``||e_p/|e_p| - o_p/|o_p|||^2 / 2`` (no
  cancellation near 0).

Both per site as the mean and the worst over positions. The **floor** is the same four numbers for the oracle's
own run at another precision (oracle/capture.py: fp64 for an fp32 engine, bf16 for a reduced-precision one) in
place of the engine: what an honest engine of that precision may differ by. A site's ``ratio`` is the largest
of mean/mean and worst/worst for rel L2 and of their square roots for the cosine distance (1 - cos is quadratic
in the angle, so its square root is on the rel-L2 scale); the site **diverged** when ``ratio > factor``.

Verdict. The first diverged site in forward order (layer, then attn < mlp < resid) names
``first_divergent_layer`` and ``first_divergent_module`` (``resid`` when neither sub-module but the stream
diverged: a norm or the residual add). The prefill is looked at first; when it names nothing, the decode step.
``positions``: the positions of that site whose distance exceeds the factor times their floor, worst first, with
their token ids and text. ``growth``: the residual stream's distance and ratio at every layer from there on.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from core.atomic import atomic_write_text
from core.errors import UserError

FORMAT = "ds41-localize/1"
SITE_ORDER = ("attn", "mlp", "resid")
PHASES = ("prefill", "decode")
DEFAULT_FACTOR = 10.0
GUARD = 1e-3
TINY = 1e-300
_KEY = re.compile(r"^(prefill|decode)/L(\d+)\.(attn|mlp|resid)$")


class LocalizeError(UserError, ValueError):
    """A localize record is malformed, or captures cannot be compared; the message names what and where."""


# ------------------------------------------------------------------------------------------- distances

def parse_key(key: str) -> tuple[str, int, str]:
    """``prefill/L3.mlp`` -> ("prefill", 3, "mlp")."""
    m = _KEY.match(key)
    if m is None:
        raise LocalizeError(f"capture key {key!r}: expected '<prefill|decode>/L<layer>.<attn|mlp|resid>'")
    return m.group(1), int(m.group(2)), m.group(3)


def site_order(key: str) -> tuple[int, int, int]:
    phase, layer, site = parse_key(key)
    return PHASES.index(phase), layer, SITE_ORDER.index(site)


def position_distances(test: np.ndarray, ref: np.ndarray) -> tuple[np.ndarray, np.ndarray, float]:
    """(rel L2 per position, cosine distance per position, the site's activation scale) of ``test`` against
    ``ref`` ([n, d] each; float64 inside)."""
    t = np.asarray(test, dtype=np.float64)
    r = np.asarray(ref, dtype=np.float64)
    if t.shape != r.shape or t.ndim != 2:
        raise LocalizeError(f"shapes {t.shape} and {r.shape}: expected two equal [positions, width] arrays")
    if not (np.isfinite(t).all() and np.isfinite(r).all()):
        bad = np.flatnonzero(~np.isfinite(t).all(axis=1) | ~np.isfinite(r).all(axis=1))
        out_rel = np.zeros(len(t))
        out_rel[bad] = np.inf
        rn = np.linalg.norm(np.where(np.isfinite(r), r, 0.0), axis=1)
        scale = float(np.sqrt(np.mean(rn ** 2))) if rn.size else 0.0
        return out_rel, out_rel.copy(), scale
    rn = np.linalg.norm(r, axis=1)
    tn = np.linalg.norm(t, axis=1)
    scale = float(np.sqrt(np.mean(rn ** 2))) if rn.size else 0.0
    denom = np.maximum(rn, GUARD * scale + TINY)
    rel = np.linalg.norm(t - r, axis=1) / denom
    tu = t / np.maximum(tn, TINY)[:, None]
    ru = r / np.maximum(rn, TINY)[:, None]
    cos = 0.5 * np.sum((tu - ru) ** 2, axis=1)
    return rel, cos, scale


@dataclass(frozen=True)
class SiteDistance:
    """One site's distances (engine vs oracle) beside its floor (oracle's other precision vs oracle)."""

    phase: str
    layer: int
    module: str
    rel_mean: float
    rel_worst: float
    worst_position: int
    cos_mean: float
    cos_worst: float
    floor_rel_mean: float
    floor_rel_worst: float
    floor_cos_mean: float
    floor_cos_worst: float
    scale: float
    ratio: float
    diverged: bool

    @property
    def key(self) -> str:
        return f"{self.phase}/L{self.layer}.{self.module}"


def _ratio(a: float, b: float) -> float:
    if math.isnan(a) or a == 0.0:
        return 0.0
    return a / max(b, TINY)


def site_ratio(rel_mean, rel_worst, cos_mean, cos_worst, f_rel_mean, f_rel_worst, f_cos_mean, f_cos_worst) -> float:
    return max(_ratio(rel_mean, f_rel_mean), _ratio(rel_worst, f_rel_worst),
               math.sqrt(_ratio(cos_mean, f_cos_mean)), math.sqrt(_ratio(cos_worst, f_cos_worst)))


def compare_site(key: str, engine: np.ndarray, oracle: np.ndarray, floor: np.ndarray,
                 factor: float = DEFAULT_FACTOR) -> tuple[SiteDistance, np.ndarray]:
    """One site -> (its SiteDistance, [2, n]: per position the engine's rel L2 and its ratio to max(the position's
    floor, the floor's mean))."""
    phase, layer, module = parse_key(key)
    rel, cos, scale = position_distances(engine, oracle)
    frel, fcos, _ = position_distances(floor, oracle)
    if rel.size == 0:
        raise LocalizeError(f"{key}: no positions")
    s = dict(rel_mean=float(rel.mean()), rel_worst=float(rel.max()), cos_mean=float(cos.mean()),
             cos_worst=float(cos.max()), f_rel_mean=float(frel.mean()), f_rel_worst=float(frel.max()),
             f_cos_mean=float(fcos.mean()), f_cos_worst=float(fcos.max()))
    ratio = site_ratio(*s.values())
    per_pos = rel / np.maximum(np.maximum(frel, s["f_rel_mean"]), TINY)
    return SiteDistance(phase, layer, module, s["rel_mean"], s["rel_worst"], int(rel.argmax()), s["cos_mean"],
                        s["cos_worst"], s["f_rel_mean"], s["f_rel_worst"], s["f_cos_mean"], s["f_cos_worst"],
                        scale, float(ratio), bool(ratio > factor)), np.stack([rel, per_pos])


# ------------------------------------------------------------------------------------------- verdict

@dataclass(frozen=True)
class Position:
    position: int
    token_id: int
    text: str
    rel: float
    ratio: float


@dataclass(frozen=True)
class Growth:
    layer: int
    rel_mean: float
    floor_rel_mean: float
    ratio: float


@dataclass(frozen=True)
class Verdict:
    first_divergent_layer: int | None
    first_divergent_module: str | None
    phase: str | None
    ratio_at_first: float | None          # the named site's distance / floor
    ratio_layer_before: float | None      # the largest distance / floor over the layer before's sites
    positions: tuple[Position, ...] = ()
    growth: tuple[Growth, ...] = ()
    growth_factor: float | None = None    # the stream's rel L2 at the last layer / at the named layer
    diverged_sites: int = 0
    max_ratio: float = 0.0                # over every site (the unperturbed engine's margin)
    max_ratio_site: str = ""

    @property
    def named(self) -> bool:
        return self.first_divergent_layer is not None


def decide(sites: Sequence[SiteDistance], position_ratios: Mapping[str, np.ndarray], token_ids: Sequence[int],
           texts: Sequence[str] | None = None, factor: float = DEFAULT_FACTOR, top_positions: int = 8) -> Verdict:
    """The verdict over every site's distance (see the module docstring)."""
    ordered = sorted(sites, key=lambda s: site_order(s.key))
    top = max(ordered, key=lambda s: s.ratio, default=None)
    base = dict(diverged_sites=sum(s.diverged for s in ordered), max_ratio=top.ratio if top else 0.0,
                max_ratio_site=top.key if top else "")
    first = next((s for s in ordered if s.diverged), None)  # prefill sites sort before the decode step's
    if first is None:
        return Verdict(None, None, None, None, None, **base)
    before = [s.ratio for s in ordered if s.phase == first.phase and s.layer == first.layer - 1]
    rels, ratios = np.asarray(position_ratios[first.key])
    offset = 0 if first.phase == "prefill" else len(token_ids) - 1
    hot = [int(i) for i in np.argsort(-ratios, kind="stable") if ratios[i] > factor][:top_positions]
    positions = tuple(Position(i + offset, int(token_ids[i + offset]),
                               texts[i + offset] if texts is not None else "", float(rels[i]), float(ratios[i]))
                      for i in hot)
    stream = {s.layer: s for s in ordered if s.phase == first.phase and s.module == "resid"}
    growth = tuple(Growth(L, s.rel_mean, s.floor_rel_mean, s.ratio) for L, s in sorted(stream.items())
                   if L >= first.layer)
    gf = growth[-1].rel_mean / max(growth[0].rel_mean, TINY) if growth else None
    return Verdict(first.layer, first.module, first.phase, first.ratio, max(before) if before else None,
                   positions, growth, gf, **base)


def localize_sites(engine: Mapping[str, Any], oracle: Mapping[str, Any], floor: Mapping[str, Any],
                   factor: float = DEFAULT_FACTOR, to_numpy: Callable[[Any], np.ndarray] = np.asarray
                   ) -> tuple[list[SiteDistance], dict[str, np.ndarray]]:
    """Every site the three mappings share (keys ``<phase>/L<i>.<site>``), one site at a time: only one site's
    three arrays are materialised at once (``to_numpy`` turns a lazily read value into an array)."""
    keys = sorted(set(engine) & set(oracle) & set(floor), key=site_order)
    if not keys:
        raise LocalizeError(f"no site in common: engine {sorted(engine)[:4]}…, oracle {sorted(oracle)[:4]}…, "
                            f"floor {sorted(floor)[:4]}…")
    sites, per_pos = [], {}
    for k in keys:
        s, r = compare_site(k, to_numpy(engine[k]), to_numpy(oracle[k]), to_numpy(floor[k]), factor)
        sites.append(s)
        per_pos[k] = r
    return sites, per_pos


# ------------------------------------------------------------------------------------------- the record

@dataclass(frozen=True)
class LocalizeRecord:
    """What `ds41gate localize` writes as DIR/localize.json."""

    engine: dict[str, Any]     # profile, flags, env, vllm version, the fault plugin's state, timings
    oracle: dict[str, Any]     # the oracle capture's info (oracle, model, precision, timings)
    floor: dict[str, Any]      # the floor run's info (precision)
    factor: float
    prompt: dict[str, Any]     # source, token_ids, texts, n_tokens, decode_token_id
    verdict: Verdict
    sites: tuple[SiteDistance, ...]
    timings: dict[str, float] = field(default_factory=dict)
    created: str = ""
    code_version: str = ""
    format: str = FORMAT

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["verdict"]["named"] = self.verdict.named
        return d

    def to_json(self) -> str:
        return json.dumps(_finite(self.to_dict()), indent=1, sort_keys=False)

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, self.to_json() + "\n")
        return path

    @classmethod
    def from_dict(cls, data: Any, where: str = "localize record") -> "LocalizeRecord":
        if not isinstance(data, dict):
            raise LocalizeError(f"{where}: expected a JSON object, got {type(data).__name__}")
        if data.get("format") != FORMAT:
            raise LocalizeError(f"{where}: format {data.get('format')!r}; this harness reads {FORMAT!r}")
        names = {f.name for f in dataclasses.fields(cls)}
        missing = sorted(n for n in ("engine", "oracle", "floor", "factor", "prompt", "verdict", "sites")
                         if n not in data)
        unknown = sorted(set(data) - names)
        if missing or unknown:
            raise LocalizeError(f"{where}: missing key(s) {missing}, unknown key(s) {unknown}")
        for name in ("engine", "oracle", "floor", "prompt", "timings"):
            if not isinstance(data.get(name, {}), dict):
                raise LocalizeError(f"{where}: {name!r} must be an object")
        v = dict(data["verdict"])
        v.pop("named", None)
        try:
            verdict = Verdict(**{**v, "positions": tuple(Position(**p) for p in v.get("positions", ())),
                                 "growth": tuple(Growth(**g) for g in v.get("growth", ()))})
            sites = tuple(SiteDistance(**_unfinite(s)) for s in data["sites"])
        except TypeError as exc:
            raise LocalizeError(f"{where}: verdict or sites malformed ({exc})") from None
        if verdict.first_divergent_module not in (None, *SITE_ORDER):
            raise LocalizeError(f"{where}: first_divergent_module {verdict.first_divergent_module!r}")
        return cls(**{**data, "verdict": verdict, "sites": sites, "factor": float(data["factor"])})

    @classmethod
    def load(cls, path: str | Path) -> "LocalizeRecord":
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise LocalizeError(f"{path}: cannot read a localize record ({exc})") from None
        return cls.from_dict(_unfinite(data), str(path))


def _finite(x):
    """JSON has no inf/nan: written as strings, read back by _unfinite."""
    if isinstance(x, float) and not math.isfinite(x):
        return repr(x)
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def _unfinite(x):
    if isinstance(x, str) and x in ("inf", "-inf", "nan"):
        return float(x)
    if isinstance(x, dict):
        return {k: _unfinite(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_unfinite(v) for v in x]
    return x


def summary_rows(rec: LocalizeRecord, phase: str = "prefill") -> list[dict]:
    """One row per layer: each site's rel L2 (mean) and distance/floor, for tables."""
    rows: dict[int, dict] = {}
    for s in rec.sites:
        if s.phase != phase:
            continue
        row = rows.setdefault(s.layer, {"layer": s.layer})
        row[f"{s.module} rel"] = s.rel_mean
        row[f"{s.module} /floor"] = s.ratio
        if s.diverged:
            row.setdefault("diverged", []).append(s.module)
    out = []
    for L in sorted(rows):
        r = rows[L]
        r["diverged"] = ",".join(r.get("diverged", []))
        out.append(r)
    return out
