"""Rates, ETA and the three progress views, from JobProgress readings (no server)."""

from __future__ import annotations

import io
import json
from datetime import UTC, datetime, timedelta

import pytest
from rich.console import Console

from llmbatch.cli._support import progress
from llmbatch.contract.messages import JobProgress, TokenCounts
from llmbatch.contract.progress import format_duration
from llmbatch.contract.states import JobState


def reading(
    done: int, *, total: int = 1000, state: JobState = JobState.RUNNING, **kw: object
) -> JobProgress:
    return JobProgress(
        job_id="j1",
        model="m",
        state=state,
        items_total=total,
        items_succeeded=done,
        tokens=TokenCounts(prompt=10 * done, completion=2 * done),
        **kw,  # type: ignore[arg-type]
    )


def test_rates_come_from_successive_readings() -> None:
    rates = progress.Rates(window_s=60)
    rates.add(reading(100), at=0.0)
    snap = rates.add(reading(300), at=10.0)
    assert snap.items_per_s == pytest.approx(20.0)
    assert snap.tokens_per_s == pytest.approx(240.0)
    assert snap.eta_s == pytest.approx(700 / 20)


def test_old_readings_leave_the_window() -> None:
    rates = progress.Rates(window_s=30)
    rates.add(reading(0), at=0.0)
    rates.add(reading(600), at=20.0)  # fast at first
    rates.add(reading(700), at=50.0)
    snap = rates.add(reading(800), at=80.0)  # 100 items per 30 s since
    assert snap.items_per_s == pytest.approx(100 / 30)


def test_without_a_change_yet_the_rate_is_the_average_since_the_job_started() -> None:
    started = (datetime.now(UTC) - timedelta(seconds=100)).isoformat()
    rates = progress.Rates()
    snap = rates.add(reading(500, started_at=started), at=0.0)
    assert snap.items_per_s == pytest.approx(5.0, rel=0.05)
    assert snap.eta_s == pytest.approx(100.0, rel=0.05)
    assert progress.Rates().add(reading(0), at=0.0).items_per_s == 0.0


def test_no_eta_while_paused_or_once_ended() -> None:
    rates = progress.Rates()
    rates.add(reading(100), at=0.0)
    assert rates.add(reading(200, state=JobState.PAUSED, paused=True), at=5.0).eta_s is None
    assert rates.add(reading(1000, state=JobState.SUCCEEDED), at=10.0).eta_s is None


def test_durations_are_short() -> None:
    assert [format_duration(s) for s in (None, 4.6, 190, 7500)] == [
        "-",
        "5s",
        "3m10s",
        "2h05m",
    ]


def plain_console() -> tuple[Console, io.StringIO]:
    buffer = io.StringIO()
    return Console(file=buffer, force_terminal=False, width=200), buffer


def test_outside_a_terminal_lines_come_at_the_interval_and_on_state_changes() -> None:
    console, buffer = plain_console()
    view = progress.choose_view(console, as_json=False, interval_s=3600)
    assert isinstance(view, progress.LineView)
    rates = progress.Rates()
    with view:
        view.show(rates.add(reading(100), at=0.0))
        view.show(rates.add(reading(200), at=1.0))  # within the interval: no line
        view.show(rates.add(reading(200, state=JobState.PAUSED, paused=True), at=2.0))
        view.show(rates.add(reading(1000, state=JobState.SUCCEEDED), at=3.0), final=True)
    lines = buffer.getvalue().splitlines()
    assert len(lines) == 3
    assert "j1 running: 100/1000 items (10%), 0 dead" in lines[0]
    assert "paused: 200/1000" in lines[1] and "ETA" not in lines[1]
    assert "succeeded: 1000/1000 items (100%)" in lines[2]
    assert "\x1b" not in buffer.getvalue()  # no escape codes in logs


def test_in_a_terminal_the_view_is_a_live_bar() -> None:
    buffer = io.StringIO()
    console = Console(file=buffer, force_terminal=True, width=200)
    view = progress.choose_view(console, as_json=False)
    assert isinstance(view, progress.BarView)
    with view:
        view.show(progress.Rates().add(reading(250), at=0.0))
    assert "250/1000" in buffer.getvalue()


def test_json_lines_parse_and_carry_the_rates(capsys: pytest.CaptureFixture[str]) -> None:
    console, _ = plain_console()
    view = progress.choose_view(console, as_json=True, interval_s=0)
    rates = progress.Rates()
    with view:
        view.show(rates.add(reading(100), at=0.0))
        view.show(rates.add(reading(300), at=10.0))
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["items_done"] for r in records] == [100, 300]
    assert records[1]["type"] == "progress" and records[1]["items_per_s"] == 20.0
    assert records[1]["eta_s"] == 35.0 and records[1]["paused"] is False
