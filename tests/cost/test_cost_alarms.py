"""Spend-rate alarms: raised past the window's limit, cleared as spend leaves the window."""

from __future__ import annotations

import threading
from decimal import Decimal as D

import pytest

from tokenmill.cost.alarms import SLOTS, AlarmBoard, SpendAlarm


class FakeClock:
    def __init__(self, now: float):
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_raised_when_the_trailing_window_exceeds_the_limit_and_cleared_when_it_falls_back():
    clock = FakeClock(1000.0)
    board = AlarmBoard(clock)
    alarm = SpendAlarm(D("1.00"), window_s=600)  # slots of 10 s
    s = board.observe("tenant:acme", alarm, D("0.60"))
    assert not s.raised and s.change is None and s.spent_usd == D("0.60")
    clock.now += 100
    s = board.observe("tenant:acme", alarm, D("0.40"))
    assert not s.raised  # exactly the limit is not over it
    clock.now += 100
    s = board.observe("tenant:acme", alarm, D("0.01"))
    assert s.raised and s.change == "raised" and s.spent_usd == D("1.01")
    # spend must fall to <= 1.00: the 0.60 of t=1000 (bucket [1000, 1010)) leaves when all of
    # that bucket is older than the window, at 1010 + 600
    assert s.retry_after_s == pytest.approx(1610 - 1200)
    assert "tenant:acme" in s.message() and "$1.01" in s.message()
    s = board.observe("tenant:acme", alarm)
    assert s.raised and s.change is None  # looking does not change it
    clock.now = 1609.0
    assert board.observe("tenant:acme", alarm).raised
    clock.now = 1610.0
    s = board.observe("tenant:acme", alarm)
    assert not s.raised and s.change == "cleared" and s.spent_usd == D("0.41")


def test_a_burst_is_caught_however_long_the_quiet_before():
    clock = FakeClock(0.0)
    board = AlarmBoard(clock)
    alarm = SpendAlarm(D("0.10"), window_s=60)
    for _ in range(100):  # a slow, steady spend stays under the rate
        board.observe("server", alarm, D("0.01"))
        clock.now += 10
    assert not board.observe("server", alarm).raised
    for _ in range(5):  # then five in a second
        s = board.observe("server", alarm, D("0.02"))
    assert s.raised and s.spent_usd > D("0.10")


def test_spend_leaves_at_bucket_granularity_late_never_early():
    clock = FakeClock(0.5)
    board = AlarmBoard(clock)
    alarm = SpendAlarm(D("0"), window_s=SLOTS)  # 1 s buckets; any spend raises it
    board.observe("s", alarm, D("0.5"))  # spent at t=0.5: an exact window holds it until 60.5
    clock.now = 60.4
    assert board.observe("s", alarm).raised
    clock.now = 60.7  # an exact window has let it go; the bucket [0, 1) has not
    assert board.observe("s", alarm).raised
    clock.now = 61.0
    s = board.observe("s", alarm)
    assert not s.raised and s.change == "cleared"


def test_scopes_are_separate_and_a_changed_alarm_starts_afresh():
    clock = FakeClock(0.0)
    board = AlarmBoard(clock)
    a = SpendAlarm(D(1), 60)
    board.observe("tenant:a", a, D(2))
    assert board.observe("tenant:a", a).raised
    assert not board.observe("tenant:b", a).raised
    wider = SpendAlarm(D(5), 60)
    s = board.observe("tenant:a", wider)
    assert not s.raised and s.spent_usd == 0
    assert board.observe("tenant:a", None) is None  # no alarm: nothing kept


def test_bad_alarms_and_spend_are_refused():
    with pytest.raises(ValueError):
        SpendAlarm(D(-1))
    with pytest.raises(ValueError):
        SpendAlarm(D(1), window_s=0)
    with pytest.raises(ValueError):
        AlarmBoard().observe("s", SpendAlarm(D(1)), D(-1))


def test_concurrent_records_are_all_counted():
    board = AlarmBoard(FakeClock(0.0))
    alarm = SpendAlarm(D(1000), 3600)

    def spend() -> None:
        for _ in range(500):
            board.observe("server", alarm, D("0.001"))

    threads = [threading.Thread(target=spend) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert board.observe("server", alarm).spent_usd == D("4.000")
