"""core/console.py: the one status-line printer and progress display (both on stderr, never stdout)."""

from __future__ import annotations

from core.console import StagedProgress, counting, echo


def test_echo_prints_one_prefixed_line_on_stderr_only(capsys):
    echo("launching [bold]vllm[/] 12 ok")
    out, err = capsys.readouterr()
    assert out == ""
    assert err.strip() == "ds41 launching vllm 12 ok"   # rich markup is rendered, not printed


def test_counting_counts_on_stderr_and_says_nothing_when_disabled(capsys):
    with counting("score", 3, done=1) as advance:
        advance()
        advance()
    out, err = capsys.readouterr()
    assert out == "" and "score" in err and "3/3" in err
    with counting("quiet", 3, enabled=False) as advance:
        advance()
    assert capsys.readouterr() == ("", "")


def test_staged_progress_ends_with_every_stage_done(capsys):
    bars = StagedProgress(True, 2, 4, label="panel")
    for stage, name in enumerate(("embed", "head")):
        bars.begin(name, stage)
        for _ in range(4):
            bars.step()
    bars.close()
    out, err = capsys.readouterr()
    assert out == "" and "panel" in err and "2/2" in err and "head" in err and "4/4" in err
    quiet = StagedProgress(False, 2, 4)
    quiet.begin("embed", 0)
    quiet.step()
    quiet.close()
    assert capsys.readouterr() == ("", "")
