"""`ds41gate eval` and `ds41gate eval-compare`: task evals (HumanEval, HumanEval+, MBPP+, IFEval) through
the engine under test, and their paired comparison in the KL comparison's layout (docs/EVALS.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from core.console import echo
from core.errors import UserError


def _suites(spec: str) -> list[str]:
    from evals.records import SUITES

    names = [s.strip().lower() for s in spec.split(",") if s.strip()]
    bad = [s for s in names if s not in SUITES]
    if bad or not names:
        raise UserError(f"SUITE {spec!r}: unknown {bad or 'empty'}; known: {', '.join(SUITES)} (comma-separated)")
    return names


def eval_app(
    suite: str = typer.Argument(..., help="humaneval, humaneval+, mbpp+, ifeval; comma-separate several"),
    engine_url: Optional[str] = typer.Option(None, help="an engine that is already serving (OpenAI API root)"),
    engine_profile: Optional[str] = typer.Option(None, help="launch this profile (engine/profiles) for the run; "
                                                            "with --engine-url: the profile serving there"),
    engine: str = typer.Option("vllm", help="with --engine-url: vllm, sglang or llama-server"),
    tokenizer: Optional[str] = typer.Option(None, help="model folder / tokenizer with the chat template "
                                                        "(default: the profile's model; smollm2)"),
    out: Path = typer.Option(..., help="results folder: generations (resumable) and <suite>.eval.json"),
    max_tokens: int = typer.Option(512, help="generation cap per problem"),
    chat: str = typer.Option("model", help="model: the model's chat encoding; raw: no template (a can-fail defect)"),
    concurrency: int = typer.Option(4, help="requests in flight"),
    limit: Optional[int] = typer.Option(None, help="only the first N problems of each suite"),
    data: Optional[Path] = typer.Option(None, help="the EvalPlus file for humaneval+ / mbpp+ "
                                                   "(else HUMANEVAL_OVERRIDE_PATH / MBPP_OVERRIDE_PATH)"),
    no_progress: bool = typer.Option(False, "--no-progress", help="no progress bars (logs)"),
    score_only: bool = typer.Option(False, "--score-only", help="score the generations already in --out, generate "
                                                                "nothing (an unfinished run; the record says partial)"),
) -> None:
    """Greedy generation through the engine, sandboxed scoring, records with provenance; reruns resume."""
    from rich.console import Console

    from engine.endpoint import EngineEndpoint, launch_endpoint
    from engine.models import default_model_dir
    from evals.run import Settings, run_suites

    names = _suites(suite)
    settings = Settings(max_tokens=max_tokens, chat=chat, concurrency=concurrency, limit=limit)
    if not engine_url and not engine_profile:
        raise UserError("give --engine-url or --engine-profile (with --engine-url, the profile names what serves there)")
    server = None
    if engine_profile and not engine_url and score_only:    # nothing to send: name the profile, start nothing
        from engine.endpoint import precision_of
        from engine.profiles import load_profile

        prof = load_profile(engine_profile)
        endpoint = EngineEndpoint("(not contacted: --score-only)", prof.served_model, prof.name, engine=prof.engine,
                                  precision=precision_of(prof), tokenizer_dir=tokenizer or str(default_model_dir()))
    elif engine_profile and not engine_url:
        model_dir = default_model_dir()
        server, endpoint = launch_endpoint(engine_profile, model_dir, echo=echo)
    else:
        from engine.client import ClientConfig, EngineClient

        root = engine_url.rstrip("/").removesuffix("/v1")
        with EngineClient(ClientConfig(base_url=root, model="?")) as probe:
            models = probe.models()
        if not models:
            raise UserError(f"--engine-url {engine_url}: serves no model")
        if engine_profile:      # the server at the URL runs this profile: its name, kind and precision
            from engine.endpoint import precision_of
            from engine.profiles import load_profile

            prof = load_profile(engine_profile)
            endpoint = EngineEndpoint(root, models[0], prof.name, engine=prof.engine or engine,
                                      precision=precision_of(prof), tokenizer_dir=tokenizer or str(default_model_dir()))
        else:
            endpoint = EngineEndpoint(root, models[0], "url", engine=engine, tokenizer_dir=tokenizer)
    try:
        recs = run_suites(endpoint, names, out, settings, tokenizer,
                          {s: data for s in names if s.endswith("+")}, progress=not no_progress, echo=echo,
                          score_only=score_only)
    finally:
        if server is not None:
            server.stop()
    console = Console()
    for s, rec in recs.items():
        scores = "  ".join(f"{k} {100 * v:.1f}" for k, v in rec.scores().items())
        console.print(f"{s} ({len(rec.problems)}) · {endpoint.profile}: {scores}   → {out}", highlight=False)


def eval_compare_app(
    baseline: Path = typer.Argument(..., help="results folder of the baseline (A) run"),
    candidate: Path = typer.Argument(..., help="results folder of the candidate (B) run"),
    label_a: Optional[str] = typer.Option(None, help="baseline name in the table"),
    label_b: Optional[str] = typer.Option(None, help="candidate name in the table"),
    out: Optional[Path] = typer.Option(None, help="where evals-compare.{json,md} go (default: the candidate folder)"),
    alpha: float = typer.Option(0.05, help="significance level of the verdict"),
    fail_on_difference: bool = typer.Option(False, help="exit 1 when a suite differs significantly"),
    common: bool = typer.Option(False, "--common", help="pair only the problems both runs hold (an unfinished "
                                                        "run); the table says how many"),
) -> None:
    """Per-suite paired comparison (exact McNemar on per-problem outcomes), the model-card table."""
    from evals.compare import common_problems, compare_records
    from evals.records import EvalRecord
    from reports import evals as rep

    comps = []
    for d, arg in ((baseline, "BASELINE"), (candidate, "CANDIDATE")):
        if not d.is_dir() or not list(d.glob("*.eval.json")):
            raise UserError(f"{arg} {d}: no *.eval.json there (run `ds41gate eval` with --out {d})")
    la = label_a or baseline.name
    lb = label_b or candidate.name
    for fa in sorted(baseline.glob("*.eval.json")):
        fb = candidate / fa.name
        if fb.is_file():
            ra, rb = EvalRecord.load(fa), EvalRecord.load(fb)
            if common:
                n_a, n_b = len(ra.problems), len(rb.problems)
                ra, rb = common_problems(ra, rb)
                echo(f"{ra.suite}: pairing the {len(ra.problems)} problems both runs hold ({la}: {n_a}, {lb}: {n_b})")
            comps.append(compare_records(ra, rb, la, lb))
    if not comps:
        raise UserError(f"{baseline} and {candidate} share no suite")
    rep.ALPHA = alpha
    md = rep.write_eval_report(comps, la, lb, out or candidate)
    typer.echo(md.read_text())
    sig = [c for c in comps for m in c.metrics if m.metric in rep.HEADLINE[c.suite] and m.test.p_value < alpha]
    if fail_on_difference and sig:
        raise typer.Exit(1)


def ifeval_panel_app(
    n_prompts: int = typer.Option(120, help="the first N IFEval prompts"),
    max_new_tokens: int = typer.Option(128, help="reply cap (oracle greedy, fp32)"),
    version: int = typer.Option(1, help="panel version to publish (never overwrites a published one)"),
    model: Optional[Path] = typer.Option(None, help="HF model folder of the oracle (default: embedded SmolLM2)"),
    data_dir: Optional[Path] = typer.Option(None, help="panel folder (default: panels/data)"),
) -> None:
    """Build the IFEval-reply KL panel from the fp32 oracle's own greedy replies (resumable)."""
    from engine.models import default_model_dir
    from evals.ifeval_panel import build_panel
    from panels.store import DATA_DIR

    last = [0]

    def tick(i: int, n: int) -> None:
        if i == n or i - last[0] >= 10:
            last[0] = i
            echo(f"ifeval-replies: {i}/{n} oracle replies")

    path = build_panel(model or default_model_dir(), n_prompts, max_new_tokens, version, data_dir or DATA_DIR,
                       progress=tick)
    typer.echo(str(path))
