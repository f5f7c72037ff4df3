"""The divergence localizer's maths and its record (format ``ds41-localize/2``): where, from the embedding to the
logits, a test run leaves a reference run. Pure functions over arrays; the captures are made elsewhere
(engine/localize_runner.py, oracle/capture.py) and the wiring is ds41gates/localize.py.

Two modes share this module. *Oracle mode*: the engine against the oracle, the floor the oracle's own run at the
engine's precision class. *A/B mode*: an engine arm (flag on, a changed model) against the engine's own base arm,
the floor the base arm's second run in the same process (its run-to-run spread: zero for a deterministic engine).

Sites, in the order the forward computes them (``<phase>/<site>``, phase ``prefill`` or ``decode``):
``embed`` (the embedding output), per decoder layer L ``L<i>.<module>`` (``attn`` the attention output before
the residual add, ``mlp`` the MLP / MoE output before the add, ``resid`` the stream leaving the layer; DeepSeek's
own sites between them, LAYER_MODULES), ``final_norm`` (the final norm's output, what the head reads) and
``logits``. So a change anywhere between the token ids and the output distribution has a site.

Distances, per position p, with t the test row and r the reference row (float64): for vector sites the relative
L2 ``||t_p - r_p|| / max(||r_p||, GUARD * scale)`` (``scale`` the site's RMS row norm; each position against its
own size) and the cosine distance ``1 - cos`` (recorded, not decided on); for ``logits`` the KL divergence
``KL(softmax(r_p) || softmax(t_p))`` in nats (the outputs compared as distributions).

Thresholds by a stated false-alarm rate. A site's floor is a DISTRIBUTION: the floor run's m per-position
distances of that site (prefill and decode rows pooled). Its log is taken as normal (mean mu, standard deviation
sigma, at least SIGMA_MIN, both estimated from the m draws), and a position departs when its distance exceeds
``max(worst floor position, exp(mu + t * sigma * sqrt(1 + 1/m)))``, the prediction bound of one new draw, with
``t`` Student's quantile (m - 1 degrees of freedom) of ``1 - rate / tests``: Bonferroni over every position of
every site, so an engine that is distributed like its floor names a site in at most ``rate`` of runs (tested by
simulation in tests/core/test_localize.py). A single floor draw (m = 1) gets four times the normal z. In
oracle mode the bound is multiplied by ORACLE_ALLOWANCE (an engine of that precision class may round three
times as much as the oracle's own run); in A/B mode by nothing (the floor is the same engine's own second run). A floor
that is exactly zero everywhere (a deterministic engine against itself) has threshold 0: any difference departs.
A site **diverged** when any of its positions departs; its ``ratio`` is its worst distance over the threshold.

Verdict. The first diverged site in forward order (the prefill before the decode step) is named, with its onset
(the first departing position; the decode step when it departs there), its worst positions and the stream's
growth after it. The rule that cannot be broken: when the outputs differ (the greedy tokens, or the logits
beyond their floor) and no site diverged, the verdict is ``floor_too_wide``, saying where the largest
distance/threshold is and by how much the floor would have to narrow to place it; never "nothing diverged".
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from statistics import NormalDist
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from core.atomic import atomic_write_text
from core.errors import UserError

FORMAT = "ds41-localize/2"
PHASES = ("prefill", "decode")
# a decoder layer's sites in forward order; the DeepSeek-only ones appear where the engine has them
LAYER_MODULES = ("attn_in", "compressor", "indexer", "attn", "attn_stream", "ffn_in", "router", "router_weights", "mlp",
                 "resid")
SITE_ORDER = LAYER_MODULES          # the per-layer modules (the record's module names)
OUTER_SITES = ("embed", "final_norm", "logits")
DISCRETE_MODULES = ("indexer", "router")   # sets compared, not vectors (engine/localize_runner.py)
DEFAULT_FALSE_ALARM = 1e-3
# Oracle mode: an honest engine of the floor's precision class may round up to three times as much as the
# oracle's own run at that precision, and its distance to the fp32 oracle adds the oracle's own rounding:
# sqrt(1 + 3^2) = 3.16. Measured (SmolLM2, vllm-cpu-fp32, 224 tokens, 15 sites): per position, the clean engine's
# distance over the fp64 floor's is 1.5-1.8 at the median and 2.5-3.8 at the 99th percentile; the positions
# that are hard for the oracle's rounding are hard for the engine's too (log-correlation 0.4-0.8), which the
# pooled floor distribution does not pair, so the allowance covers the tail, not the median.
# A/B mode needs none: the floor is the same engine's second run, distributed as the test arm's distance is.
ORACLE_ALLOWANCE = math.sqrt(1.0 + 3.0 ** 2)
SIGMA_MIN = 0.25        # e-folds: the least spread a floor distribution is given (a few agreeing positions
#                         must not make the threshold tight)
GUARD = 1e-3
TINY = 1e-300
_KEY = re.compile(r"^(prefill|decode)/(?:(embed|final_norm|logits)|L(\d+)\.([a-z_]+))$")


class LocalizeError(UserError, ValueError):
    """A localize record is malformed, or captures cannot be compared; the message names what and where."""


# ------------------------------------------------------------------------------------------- sites

def parse_key(key: str) -> tuple[str, int | None, str]:
    """``prefill/L3.mlp`` -> ("prefill", 3, "mlp"); ``decode/logits`` -> ("decode", None, "logits")."""
    m = _KEY.match(key)
    if m is None or (m.group(4) is not None and m.group(4) not in LAYER_MODULES):
        raise LocalizeError(f"capture key {key!r}: expected '<prefill|decode>/<embed|final_norm|logits>' or "
                            f"'<prefill|decode>/L<layer>.<{'|'.join(LAYER_MODULES)}>'")
    if m.group(2) is not None:
        return m.group(1), None, m.group(2)
    return m.group(1), int(m.group(3)), m.group(4)


def site_name(layer: int | None, module: str) -> str:
    return module if layer is None else f"L{layer}.{module}"


def site_order(key: str) -> tuple[int, int, int, int]:
    """(phase, stage, layer, module): embed < the layers < final_norm < logits, the prefill before decode."""
    phase, layer, module = parse_key(key)
    if layer is None:
        stage = {"embed": 0, "final_norm": 2, "logits": 3}[module]
        return PHASES.index(phase), stage, 0, 0
    return PHASES.index(phase), 1, layer, LAYER_MODULES.index(module)


def metric_of(module: str) -> str:
    return "kl" if module == "logits" else "jaccard" if module in DISCRETE_MODULES else "rel_l2"


# ------------------------------------------------------------------------------------------- distances

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


KL_ROWS = 64     # logits rows converted to float64 at a time: [64, vocab] temporaries, not [n, vocab] (a 2,300-token
#                  prompt's float64 copies of DeepSeek's 129,280-wide logits would be 2.4 GB each)


def kl_per_position(test_logits: np.ndarray, ref_logits: np.ndarray, rows: int = KL_ROWS) -> np.ndarray:
    """KL(softmax(ref) || softmax(test)) per position, in nats (float64; >= 0 up to rounding, clipped there),
    ``rows`` positions at a time (each row's KL is its own: the chunking changes no value)."""
    if test_logits.shape != ref_logits.shape or len(test_logits.shape) != 2:
        raise LocalizeError(f"logits shapes {tuple(test_logits.shape)} and {tuple(ref_logits.shape)}: expected two "
                            "equal [positions, vocab] arrays")

    def log_softmax(x):
        x = x - x.max(axis=1, keepdims=True)
        return x - np.log(np.exp(x).sum(axis=1, keepdims=True))

    out = np.zeros(test_logits.shape[0])
    for start in range(0, test_logits.shape[0], max(int(rows), 1)):
        t = np.asarray(test_logits[start:start + rows], dtype=np.float64)
        r = np.asarray(ref_logits[start:start + rows], dtype=np.float64)
        bad = ~np.isfinite(t).all(axis=1) | ~np.isfinite(r).all(axis=1)
        t, r = np.where(bad[:, None], 0.0, t), np.where(bad[:, None], 0.0, r)
        lr, lt = log_softmax(r), log_softmax(t)
        kl = np.maximum(np.sum(np.exp(lr) * (lr - lt), axis=1), 0.0)
        out[start:start + len(kl)] = np.where(bad, np.inf, kl)
    return out


def set_distances(test: np.ndarray, ref: np.ndarray) -> np.ndarray:
    """A discrete site (per position the set of chosen indices, -1 padding): 1 - Jaccard(test, ref) per position
    (0: the same set; 1: nothing in common)."""
    t = np.asarray(test)
    r = np.asarray(ref)
    if t.shape != r.shape or t.ndim != 2:
        raise LocalizeError(f"index sets {t.shape} and {r.shape}: expected two equal [positions, k] arrays")
    out = np.zeros(len(t))
    for i, (a, b) in enumerate(zip(t, r)):
        sa, sb = {int(x) for x in a if x >= 0}, {int(x) for x in b if x >= 0}
        union = sa | sb
        out[i] = 0.0 if not union else 1.0 - len(sa & sb) / len(union)
    return out


@dataclass(frozen=True)
class SiteRows:
    """One site's per-position distances: the test run's and the floor run's against the same reference."""

    key: str
    metric: str
    dist: np.ndarray
    floor: np.ndarray
    cos: np.ndarray
    scale: float


def site_rows(key: str, test: np.ndarray, ref: np.ndarray, floor: np.ndarray) -> SiteRows:
    _, _, module = parse_key(key)
    metric = metric_of(module)
    if metric == "kl":
        d, f = kl_per_position(test, ref), kl_per_position(floor, ref)
        cos, scale = np.full(len(d), np.nan), float("nan")
    elif metric == "jaccard":
        d, f = set_distances(test, ref), set_distances(floor, ref)
        cos, scale = np.full(len(d), np.nan), float("nan")
    else:
        d, cos, scale = position_distances(test, ref)
        f, _, _ = position_distances(floor, ref)
    if d.size == 0:
        raise LocalizeError(f"{key}: no positions")
    return SiteRows(key, metric, d, f, cos, scale)


# ------------------------------------------------------------------------------------------- thresholds

@dataclass(frozen=True)
class Calibration:
    """How the thresholds were set: the false-alarm rate per run, over how many tests, the z it gives."""

    false_alarm_rate: float
    tests: int
    z: float
    allowance: float = 1.0          # the null distribution is the floor's scaled by this (oracle mode: ORACLE_ALLOWANCE)
    sigma_min: float = SIGMA_MIN


def calibration(false_alarm_rate: float, tests: int, allowance: float = 1.0) -> Calibration:
    if not 0.0 < false_alarm_rate < 1.0:
        raise LocalizeError(f"false-alarm rate {false_alarm_rate!r}: expected a probability in (0, 1)")
    if not allowance >= 1.0:
        raise LocalizeError(f"precision allowance {allowance!r}: expected >= 1")
    tests = max(int(tests), 1)
    return Calibration(false_alarm_rate, tests, NormalDist().inv_cdf(1.0 - false_alarm_rate / tests),
                       float(allowance))


def site_threshold(floor_dists: np.ndarray, cal: Calibration) -> float:
    """The distance above which a position departs from a floor distribution (the module docstring): the upper
    prediction bound of a new log-normal draw given the floor's m draws, ``mu + t(m-1) * sigma * sqrt(1 + 1/m)``
    (Student's t: mu and sigma are estimates from a few dozen positions; the plug-in normal bound false-alarms
    several times its rate), at the per-test rate ``rate / tests``."""
    from scipy.stats import t as student_t

    f = np.asarray(floor_dists, dtype=np.float64)
    f = f[np.isfinite(f)]
    pos = f[f > 0]
    if pos.size == 0:
        return 0.0
    logs = np.log(pos)
    m = logs.size
    sigma = max(float(logs.std(ddof=1)) if m > 1 else 0.0, cal.sigma_min)
    q = 1.0 - cal.false_alarm_rate / cal.tests
    k = float(student_t.ppf(q, m - 1)) * math.sqrt(1.0 + 1.0 / m) if m > 1 else cal.z * 4.0
    return cal.allowance * float(max(pos.max(), math.exp(float(logs.mean()) + k * sigma)))


def thresholds(rows: Sequence[SiteRows], cal: Calibration) -> dict[str, float]:
    """Per site name (phases pooled): its threshold."""
    pooled: dict[str, list[np.ndarray]] = {}
    for r in rows:
        _, layer, module = parse_key(r.key)
        pooled.setdefault(site_name(layer, module), []).append(r.floor)
    return {name: site_threshold(np.concatenate(fs), cal) for name, fs in pooled.items()}


@dataclass(frozen=True)
class SiteDistance:
    """One site's distances (test vs reference) beside its floor distribution's summary and threshold."""

    phase: str
    layer: int | None
    module: str
    metric: str
    mean: float
    worst: float
    worst_position: int          # row index within the phase (prefill: the prompt position; decode: 0)
    cos_mean: float | None       # None where a cosine means nothing (logits, index sets)
    cos_worst: float | None
    floor_mean: float
    floor_worst: float
    threshold: float
    ratio: float                 # worst / threshold (inf when the threshold is 0 and the site moved)
    diverged: bool
    onset: int | None            # the first row that departs
    departed: int                # how many rows depart
    scale: float | None

    @property
    def key(self) -> str:
        return f"{self.phase}/{self.name}"

    @property
    def name(self) -> str:
        return site_name(self.layer, self.module)


def _over(d: np.ndarray, thr: float) -> np.ndarray:
    return d / thr if thr > 0 else np.where(d > 0, np.inf, 0.0)


def score_site(r: SiteRows, thr: float) -> tuple[SiteDistance, np.ndarray]:
    """-> (the SiteDistance, [2, n]: per row the distance and its ratio to the threshold)."""
    phase, layer, module = parse_key(r.key)
    ratio_rows = _over(r.dist, thr)
    hot = np.flatnonzero(r.dist > thr)
    worst = float(r.dist.max())
    ratio = float(ratio_rows.max())
    vector = r.metric == "rel_l2"
    return SiteDistance(phase, layer, module, r.metric, float(r.dist.mean()), worst, int(r.dist.argmax()),
                        float(r.cos.mean()) if vector else None, float(r.cos.max()) if vector else None,
                        float(r.floor.mean()), float(r.floor.max()), float(thr), ratio, bool(hot.size),
                        int(hot[0]) if hot.size else None, int(hot.size),
                        r.scale if vector else None), np.stack([r.dist, ratio_rows])


# ------------------------------------------------------------------------------------------- verdict

@dataclass(frozen=True)
class Position:
    position: int
    token_id: int
    text: str
    distance: float
    ratio: float


@dataclass(frozen=True)
class Growth:
    layer: int
    mean: float
    floor_mean: float
    ratio: float


STATUSES = ("named", "floor_too_wide", "clean")


@dataclass(frozen=True)
class Verdict:
    status: str                           # named | floor_too_wide | clean
    site: str | None                      # "embed", "L3.mlp", "final_norm", "logits"
    first_divergent_layer: int | None
    first_divergent_module: str | None
    phase: str | None
    ratio_at_first: float | None          # the named site's worst distance / threshold
    ratio_before: float | None            # the largest distance / threshold over the sites of the stage before
    onset_position: int | None = None     # the first prompt position where the named site departs (prefill)
    onset_step: int | None = None         # 1 when the named site departs at the decode step, else None
    positions: tuple[Position, ...] = ()
    growth: tuple[Growth, ...] = ()
    growth_factor: float | None = None    # the stream's distance at the last layer / at the named layer
    diverged_sites: int = 0
    max_ratio: float = 0.0                # over every site (a clean run's margin)
    max_ratio_site: str = ""
    output_differs: tuple[str, ...] = ()  # why the outputs are said to differ (greedy tokens, logits)
    explanation: str = ""

    @property
    def named(self) -> bool:
        return self.status == "named"


def _before(ordered: Sequence[SiteDistance], first: SiteDistance) -> float | None:
    """The largest ratio of the stage before the named site: the layer before, the embedding before layer 0,
    the last layer before the final norm."""
    same = [s for s in ordered if s.phase == first.phase]
    if first.layer is not None:
        prev = [s for s in same if s.layer == first.layer - 1] or (
            [s for s in same if s.module == "embed"] if first.layer == 0 else [])
    elif first.module == "embed":
        prev = []
    else:
        layers = [s.layer for s in same if s.layer is not None]
        prev = ([s for s in same if s.layer == max(layers)] if layers else []) if first.module == "final_norm" \
            else [s for s in same if s.module == "final_norm"]
    return max((s.ratio for s in prev), default=None)


def decide(sites: Sequence[SiteDistance], rows: Mapping[str, np.ndarray], token_ids: Sequence[int],
           texts: Sequence[str] | None = None, output_differs: Sequence[str] = (),
           top_positions: int = 8) -> Verdict:
    """The verdict over every site (the module docstring). ``token_ids``: the prompt and, with a decode step, its
    token; ``output_differs``: the caller's findings on the outputs (e.g. the greedy tokens differ); a departed
    ``logits`` site is added to them here."""
    ordered = sorted(sites, key=lambda s: site_order(s.key))
    top = max(ordered, key=lambda s: s.ratio, default=None)
    diffs = list(output_differs)
    for s in ordered:
        if s.module == "logits" and s.diverged:
            diffs.append(f"{s.phase} logits: KL {s.worst:.3g} nats at row {s.onset}, threshold {s.threshold:.3g}")
    base = dict(diverged_sites=sum(s.diverged for s in ordered), max_ratio=top.ratio if top else 0.0,
                max_ratio_site=top.key if top else "", output_differs=tuple(diffs))
    first = next((s for s in ordered if s.diverged), None)  # prefill sites sort before the decode step's
    if first is None:
        if diffs:
            where = top.key if top else "no site"
            r = top.ratio if top else 0.0
            how = (f"the largest distance/threshold is {r:.3g} at {where}: the floor would have to be "
                   f"{1 / r:.3g}x narrower there to place it" if r > 0 else "every site equals the reference")
            return Verdict("floor_too_wide", None, None, None, None, None, None,
                           explanation=f"the outputs differ ({'; '.join(diffs)}) but no site leaves its floor at "
                                       f"the stated false-alarm rate; {how}", **base)
        return Verdict("clean", None, None, None, None, None, None, **base)
    dist, ratios = np.asarray(rows[first.key])
    n_prompt = len(token_ids) - (1 if any(s.phase == "decode" for s in ordered) else 0)
    offset = 0 if first.phase == "prefill" else n_prompt
    if first.module == "logits" and first.phase == "prefill" and len(dist) < n_prompt:
        offset = n_prompt - len(dist)          # the engine's logits rows are the last prompt positions
    hot = [int(i) for i in np.argsort(-ratios, kind="stable") if ratios[i] > 1.0][:top_positions]

    def at(i):
        j = min(i + offset, len(token_ids) - 1)
        return Position(i + offset, int(token_ids[j]), texts[j] if texts is not None else "", float(dist[i]),
                        float(ratios[i]))

    positions = tuple(at(i) for i in hot)
    decode_same = next((s for s in ordered if s.phase == "decode" and s.name == first.name), None)
    onset_step = 1 if (first.phase == "decode" or (decode_same is not None and decode_same.diverged)) else None
    onset_position = first.onset + offset if first.phase == "prefill" and first.onset is not None else None
    stream = {s.layer: s for s in ordered if s.phase == first.phase and s.module == "resid"}
    start = first.layer if first.layer is not None else (-1 if first.module == "embed" else 10 ** 9)
    growth = tuple(Growth(L, s.mean, s.floor_mean, s.ratio) for L, s in sorted(stream.items()) if L >= start)
    gf = growth[-1].mean / max(growth[0].mean, TINY) if growth else None
    return Verdict("named", first.name, first.layer, first.module, first.phase, first.ratio, _before(ordered, first),
                   onset_position, onset_step, positions, growth, gf, **base)


def localize_sites(test: Mapping[str, Any], ref: Mapping[str, Any], floor: Mapping[str, Any],
                   false_alarm_rate: float = DEFAULT_FALSE_ALARM, allowance: float = 1.0,
                   to_numpy: Callable[[Any], np.ndarray] = np.asarray
                   ) -> tuple[list[SiteDistance], dict[str, np.ndarray], Calibration]:
    """Every site the three mappings share (keys as parse_key reads them), one site at a time: only one site's
    three arrays are materialised at once (``to_numpy`` turns a lazily read value into an array); the per-row
    distances are kept (a few floats a position), then each site's threshold is set from the floor rows."""
    keys = sorted(set(test) & set(ref) & set(floor), key=site_order)
    if not keys:
        raise LocalizeError(f"no site in common: test {sorted(test)[:4]}…, reference {sorted(ref)[:4]}…, "
                            f"floor {sorted(floor)[:4]}…")
    def side(m: Mapping[str, Any], k: str):
        # the logits (n x vocab: 1.2 GB at 2,300 tokens of DeepSeek) are read in row chunks where the mapping can
        # (``row_view``: engine/localize.py's LazyCaptures), so no side holds them whole
        if metric_of(parse_key(k)[2]) == "kl" and callable(getattr(m, "row_view", None)):
            return m.row_view(k)
        return to_numpy(m[k])

    rows = [site_rows(k, side(test, k), side(ref, k), side(floor, k)) for k in keys]
    cal = calibration(false_alarm_rate, sum(len(r.dist) for r in rows), allowance)
    thr = thresholds(rows, cal)
    sites, per_row = [], {}
    for r in rows:
        _, layer, module = parse_key(r.key)
        s, pr = score_site(r, thr[site_name(layer, module)])
        sites.append(s)
        per_row[r.key] = pr
    return sites, per_row, cal


def greedy_differences(test_ids: Sequence[int], ref_ids: Sequence[int], what: str = "reference") -> list[str]:
    """The output check of the no-contradiction rule: the greedy tokens, step by step, until the first that
    differs (after it the two continue from different inputs)."""
    for step, (a, b) in enumerate(zip(test_ids, ref_ids)):
        if int(a) != int(b):
            return [f"greedy token {step + 1}: {int(a)} vs the {what}'s {int(b)}"]
    return []


# ------------------------------------------------------------------------------------------- the record

@dataclass(frozen=True)
class LocalizeRecord:
    """What `ds41gate localize` writes as DIR/localize.json."""

    engine: dict[str, Any]     # profile, flags, env, vllm version, the fault plugin's state, timings
    oracle: dict[str, Any]     # the oracle capture's info (oracle, model, precision, timings)
    floor: dict[str, Any]      # the floor run's info (precision; in A/B mode the base arm's second run)
    calibration: Calibration
    prompt: dict[str, Any]     # source, token_ids, texts, n_tokens, decode_token_id
    verdict: Verdict
    sites: tuple[SiteDistance, ...]
    timings: dict[str, float] = field(default_factory=dict)
    mode: str = "oracle"       # oracle | ab
    context: dict[str, Any] = field(default_factory=dict)   # A/B: the oracle beside the arms, per site
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
        missing = sorted(n for n in ("engine", "oracle", "floor", "calibration", "prompt", "verdict", "sites")
                         if n not in data)
        unknown = sorted(set(data) - names)
        if missing or unknown:
            raise LocalizeError(f"{where}: missing key(s) {missing}, unknown key(s) {unknown}")
        for name in ("engine", "oracle", "floor", "prompt", "timings", "context"):
            if not isinstance(data.get(name, {}), dict):
                raise LocalizeError(f"{where}: {name!r} must be an object")
        v = dict(data["verdict"])
        v.pop("named", None)
        try:
            verdict = Verdict(**{**v, "positions": tuple(Position(**p) for p in v.get("positions", ())),
                                 "growth": tuple(Growth(**g) for g in v.get("growth", ()))})
            verdict = dataclasses.replace(verdict, output_differs=tuple(verdict.output_differs))
            sites = tuple(SiteDistance(**_unfinite(s)) for s in data["sites"])
            cal = Calibration(**data["calibration"])
        except TypeError as exc:
            raise LocalizeError(f"{where}: verdict, sites or calibration malformed ({exc})") from None
        if verdict.status not in STATUSES:
            raise LocalizeError(f"{where}: verdict status {verdict.status!r}: expected one of {STATUSES}")
        if verdict.first_divergent_module not in (None, *LAYER_MODULES, *OUTER_SITES):
            raise LocalizeError(f"{where}: first_divergent_module {verdict.first_divergent_module!r}")
        if verdict.status == "named" and verdict.site is None:
            raise LocalizeError(f"{where}: verdict 'named' without a site")
        return cls(**{**data, "verdict": verdict, "sites": sites, "calibration": cal})

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
    """One row per stage (the embedding, each layer, the final norm and logits): each site's mean distance and
    worst distance / threshold, for tables."""
    rows: dict[tuple, dict] = {}
    for s in sorted(rec.sites, key=lambda s: site_order(s.key)):
        if s.phase != phase:
            continue
        label = "head" if s.module in ("final_norm", "logits") else ("embed" if s.layer is None else s.layer)
        row = rows.setdefault((site_order(s.key)[1], s.layer or 0), {"layer": label})
        row[f"{s.module} dist"] = s.mean
        row[f"{s.module} /thr"] = s.ratio
        if s.diverged:
            row.setdefault("diverged", []).append(s.module)
    out = []
    for k in sorted(rows):
        r = rows[k]
        r["diverged"] = ",".join(r.get("diverged", []))
        out.append(r)
    return out
