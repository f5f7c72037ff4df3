"""What a profile is gated on, resolved once: its ``[gate]`` table (engine.profiles.GateTarget) made concrete.

The demo, the gate suite's plugin (its session-scoped ``gate_target`` fixture), the nightly and the
localizer all ask here, so one profile is gated on one model, panel, encoding, oracle, bands and sizes
wherever it runs::

    t = resolve_gate_target("vllm-cpu-dsv4")
    t.model_dir, t.encoded, t.oracle, t.precision, t.bands, t.sizes

    profiles, checked = one_gate_target(["vllm-cpu-fp32", "vllm-cpu-bf16"])   # names and files only
    t = resolve_gate_target(checked)                                          # builds; checks nothing again

No profile (``None``) is the embedded default: SmolLM2 on the `default` panel, its own tokenizer, the
transformers oracle. Paths in the table are relative to the repository root.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from engine.profiles import (
    DEFAULT_GATE_TARGET,
    OWN_TOKENIZER,
    REPO_ROOT,
    GateTarget,
    Profile,
    ProfileError,
    load_profile,
)

if TYPE_CHECKING:
    from oracle.kinds import OracleKind
    from panels import EncodedPanel

ProfileRef = str | os.PathLike[str] | Profile | None


@dataclass(frozen=True)
class ResolvedTarget:
    """A profile's gate target with its model folder built and its panel encoded as that model reads it."""

    profile: str                 # the profile's name; "" for the embedded default (no profile)
    target: GateTarget           # as declared
    model_dir: Path              # the folder the oracle loads (built on demand by the model provider)
    tokenizer: str               # the panels.load_tokenizer spec the panel is encoded with
    bands: Path                  # the KL bands file (core.verdicts.judge)
    sizes: Path | None           # gate sizes over gates/config.toml; None: the CI sizes alone
    encoded: EncodedPanel | None  # None when resolved with encode=False

    @property
    def oracle(self) -> str:
        return self.target.oracle

    @property
    def oracle_kind(self) -> OracleKind:
        """The registered oracle kind (oracle.kinds) the reference comes from."""
        from oracle.kinds import oracle_kind

        return oracle_kind(self.target.oracle)

    @property
    def precision(self) -> str:
        return self.target.precision


def _profile(profile: ProfileRef) -> Profile | None:
    if profile is None or isinstance(profile, Profile):
        return profile
    return load_profile(profile)


def gate_target(profile: ProfileRef) -> GateTarget:
    """The profile's declared target (the embedded default for no profile or a profile without [gate])."""
    prof = _profile(profile)
    return prof.gate if prof is not None else DEFAULT_GATE_TARGET


def serves_embedded_default(profile: ProfileRef) -> bool:
    """Whether the profile is gated on the embedded default (SmolLM2) rather than a model of its own."""
    # whether the engine caches prefixes says nothing about the model it serves
    return dataclasses.replace(gate_target(profile), prefix_cache=DEFAULT_GATE_TARGET.prefix_cache) \
        == DEFAULT_GATE_TARGET


def _where(prof: Profile | None) -> str:
    return str(prof.source) if prof is not None and prof.source else "the embedded default gate target"


def _repo_file(value: str, key: str, where: str) -> Path:
    path = Path(value).expanduser()
    path = path if path.is_absolute() else REPO_ROOT / path
    if not path.is_file():
        raise ProfileError(f"{where} [gate]: {key} = {value!r}: no such file ({path})")
    return path


@dataclass(frozen=True)
class CheckedTarget:
    """A profile's gate target checked: the model a known provider, the panel and tokenizer names resolvable, the
    bands and sizes files present -- so a nightly's preflight refuses a name that would only fail hours later, in
    a cell. Nothing is built yet; ``resolve`` builds, and checks nothing again."""

    profile: Profile | None      # None: the embedded default
    target: GateTarget
    bands: Path
    sizes: Path | None

    def resolve(self, panel: str | None = None, *, encode: bool = True) -> ResolvedTarget:
        """The model folder built (cached after the first time), the panel — `panel` when given, else the
        target's — encoded with the target's tokenizer and chat encoding."""
        from engine.launcher import default_providers

        model_dir = Path(default_providers()[self.target.model]())
        tokenizer = str(model_dir) if self.target.tokenizer == OWN_TOKENIZER else self.target.tokenizer
        encoded = None
        if encode:
            from panels import encode_panel, load_panel, load_tokenizer

            encoded = encode_panel(load_panel(panel or self.target.panel), load_tokenizer(tokenizer))
        return ResolvedTarget(profile=self.profile.name if self.profile is not None else "", target=self.target,
                              model_dir=model_dir, tokenizer=tokenizer, bands=self.bands, sizes=self.sizes,
                              encoded=encoded)


def checked_target(profile: ProfileRef) -> CheckedTarget:
    """Load the profile (unless given one) and check its target once (CheckedTarget)."""
    from engine.launcher import MODEL_PROVIDERS

    prof = _profile(profile)
    target, where = gate_target(prof), _where(prof)
    if target.model not in MODEL_PROVIDERS:
        raise ProfileError(f"{where} [gate]: model {target.model!r} is not a model provider; "
                           f"known: {list(MODEL_PROVIDERS)} (engine.launcher.MODEL_PROVIDERS)")
    _check_names(target, where)
    sizes = _repo_file(target.sizes, "sizes", where) if target.sizes else None
    return CheckedTarget(prof, target, _repo_file(target.bands, "bands", where), sizes)


TOKENIZER_NAMES = ("smollm2", "deepseek")   # panels.load_tokenizer's named tokenizers


def _check_names(target: GateTarget, where: str) -> None:
    """The panel resolves (panels.load_panel: name, name@version or a manifest) and the tokenizer is the model's
    own, a named one, or a folder / tokenizer.json that exists; without building or loading a tokenizer."""
    from panels import PanelError, load_panel

    try:
        load_panel(target.panel)
    except PanelError as exc:
        raise ProfileError(f"{where} [gate]: panel = {target.panel!r}: {exc}") from None
    spec = target.tokenizer
    if spec == OWN_TOKENIZER or spec in TOKENIZER_NAMES:
        return
    path = Path(spec).expanduser()
    if not any(p.is_dir() or (p.is_file() and p.name == "tokenizer.json") for p in (path, REPO_ROOT / path)):
        raise ProfileError(f"{where} [gate]: tokenizer = {spec!r}: not {OWN_TOKENIZER!r} (the model's own), one of "
                           f"{list(TOKENIZER_NAMES)}, or an existing folder or tokenizer.json")


def check_gate_target(profile: ProfileRef) -> GateTarget:
    """Every name in the target is known and every file exists, without building a model or encoding a panel."""
    return checked_target(profile).target


def resolve_gate_target(profile: ProfileRef | CheckedTarget, panel: str | None = None, *,
                        encode: bool = True) -> ResolvedTarget:
    """The profile's target checked (unless `profile` is already a CheckedTarget) and made concrete
    (CheckedTarget.resolve)."""
    checked = profile if isinstance(profile, CheckedTarget) else checked_target(profile)
    return checked.resolve(panel, encode=encode)


def one_gate_target(profiles: Sequence[str | os.PathLike[str] | Profile]) -> tuple[list[Profile], CheckedTarget]:
    """Load `profiles` and check they can share one reference and one pass rule: the same model, panel, encoding,
    oracle, precision and bands file (gate sizes may differ per profile). Names and files only: nothing is built.
    -> (the loaded profiles, the first one's CheckedTarget: what `resolve_gate_target` builds from)."""
    if not profiles:
        raise ProfileError("no engine profile given")
    checked = [checked_target(ref if isinstance(ref, Profile) else load_profile(ref)) for ref in profiles]
    targets = {c.profile.name: c.target for c in checked}
    if len({(t.model, t.panel, t.tokenizer, t.oracle, t.precision, t.bands) for t in targets.values()}) > 1:
        what = ", ".join(f"{n}: {t.model} on {t.panel} ({t.oracle})" for n, t in targets.items())
        raise ProfileError(f"profiles {list(targets)} are gated on different targets ({what}); one run gates one "
                           "model against one reference: run once per target")
    return [c.profile for c in checked], checked[0]
