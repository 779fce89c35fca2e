"""The soak (benchmarks/soak): its short run with an engine kill passes its own invariants
against a real server, and its judges catch what they are there to catch (a wrong,
duplicated or unfinished answer, growth past the thresholds, a fault that never
recovers), so a passing soak means something."""

from __future__ import annotations

import asyncio
import json
import random
import re
from pathlib import Path

import httpx
import pytest

from benchmarks.soak import report
from benchmarks.soak.batches import judge
from benchmarks.soak.faults import settle
from benchmarks.soak.run import HANG_TIMEOUT_S
from benchmarks.soak.traffic import EXPECTED, Client, Ledger, Outcome
from tests.test_benchmarks import QUICK, run


@pytest.mark.slow
def test_soak_with_an_engine_kill(tmp_path: Path) -> None:
    """`--quick --faults`: 3 minutes of mixed traffic (about 3.5 minutes' wall with the
    start, reference run and drain), the engine SIGKILLed in it, later SIGSTOPped (hung)."""
    out = tmp_path / "soak.json"
    proc = run("soak.run", "--quick", "--faults", "--json", str(out), timeout=600)
    tail = f"\n--- stdout ---\n{proc.stdout[-4000:]}\n--- stderr ---\n{proc.stderr[-3000:]}"
    assert proc.returncode == 0, tail
    assert re.search(QUICK["soak.run"], proc.stdout), tail
    rep = json.loads(out.read_text())
    assert rep["ok"] and rep["why"] == [] and rep["unexpected"] == [], tail
    assert set(rep["outcomes"]) <= set(EXPECTED), rep["outcomes"]
    for kind, by in rep["kinds"].items():  # every kind was served, and checked, at least once
        if kind != "cancel":
            assert by.get("ok", 0) > 0, (kind, by)
    assert rep["kinds"]["cancel"].get("cancelled", 0) > 0
    assert rep["kinds"]["capped"].get("rate_limited", 0) > 0  # the limit that must trip did
    assert [f["signal"] for f in rep["faults"]] == ["SIGKILL", "SIGSTOP"]
    for fault in rep["faults"]:
        assert fault["new_pid"] not in (None, fault["pid"])
        assert fault["recovered_s"] is not None and fault["recovered_s"] <= report.FAULT_RECOVERY_BOUND_S
        assert fault["caught_end_max_s"] is None or fault["caught_end_max_s"] <= fault["end_bound_s"]
    # the stop was found by the watchdog: /ready said so after its bound, not before
    assert rep["faults"][1]["detected_s"] is not None and rep["faults"][1]["detected_s"] >= 0.9 * HANG_TIMEOUT_S
    last = rep["samples"][-1]
    assert last["kv_blocks_idle"] == 0 and last["engine_restarts"] == 2
    assert Path(out.with_suffix(".png")).stat().st_size > 0 or "plot:" not in proc.stdout


def _o(status: str, start: float = 0.0, end: float = 1.0, kind: str = "chat_whole") -> Outcome:
    return Outcome(kind, "alpha", start, end, status)


def _sample(t: float, rss: float, fds: int, kv: float | None = 0) -> dict:
    return {"t_s": t, "rss_mib": rss, "fds": fds, "kv_blocks_idle": kv}


def test_verdict_fails_what_it_must() -> None:
    # from the warm-up's end (60 s) to 3600 s: 48 + 64 * 59/60 = 110.9 MiB and 16 + 8 * 59/60 = 23.9 fds allowed
    clean = [_sample(0, 800, 50), _sample(60, 900, 60), _sample(3600, 1000, 80)]
    assert report.verdict(clean, [_o("ok"), _o("cancelled"), _o("rate_limited")], [], 1) == []
    for bad in ("wrong_answer", "duplicate", "no_terminal", "hung", "engine_fault_unexplained", "http_500"):
        assert bad in report.verdict(clean, [_o("ok"), _o(bad)], [], 1)[0]
    grown = clean[:2] + [_sample(3600, 1015, 60)]
    assert "resident memory" in report.verdict(grown, [], [], 1)[0]
    leaky = clean[:2] + [_sample(3600, 900, 85)]
    assert "descriptors" in report.verdict(leaky, [], [], 1)[0]
    held = clean[:2] + [_sample(3600, 900, 60, kv=3)]
    assert "KV blocks" in report.verdict(held, [], [], 1)[0]
    never = {"t_s": 10, "recovered_s": None, "caught_end_max_s": 0.1}
    slow = {"t_s": 10, "recovered_s": 3.0, "caught_end_max_s": report.FAULT_END_BOUND_S + 1}
    assert "no good answer" in report.verdict(clean, [], [never], 1)[0]
    assert "caught in the engine's SIGKILL" in report.verdict(clean, [], [slow], 1)[0]
    # a stop is found only after the hang bound: its caught requests get that much longer, no more
    stopped = {"t_s": 10, "recovered_s": 12.0, "signal": "SIGSTOP", "end_bound_s": report.FAULT_END_BOUND_S + 10,
               "caught_end_max_s": report.FAULT_END_BOUND_S + 6}
    assert report.verdict(clean, [], [stopped], 1) == []
    stopped["caught_end_max_s"] = report.FAULT_END_BOUND_S + 11
    assert "caught in the engine's SIGSTOP" in report.verdict(clean, [], [stopped], 1)[0]


def test_engine_errors_outside_a_fault_are_failures() -> None:
    fault = {"kill_at": 100.0, "recovered_s": 5.0}
    caught = _o("engine_fault", 99.0, 100.1)
    late = _o("engine_fault", 110.0, 110.5)  # after the first good answer and its grace
    fine = _o("ok", 99.5, 101.0)
    batch = _o("engine_fault", 90.0, 130.0, kind="batch")  # a batch overlapping the fault: lines failed by it
    stray = _o("engine_fault", 120.0, 150.0, kind="batch")
    settle([fault], [caught, late, fine, batch, stray])
    assert caught.status == "engine_fault" and late.status == "engine_fault_unexplained"
    assert batch.status == "engine_fault" and stray.status == "engine_fault_unexplained"
    assert fault["batches_failed"] == 1
    assert fault["caught"] == 2 and fault["caught_errors"] == 1 and fault["caught_end_max_s"] == pytest.approx(1.0)


def _client(refs: dict) -> Client:
    return Client(http=None, refs=refs, bodies={}, ledger=Ledger(),  # type: ignore[arg-type]
                  rng=random.Random(0), prompts=1)


def _line(cid: str, text: str, rid: str) -> dict:
    body = {"id": rid, "choices": [{"index": 0, "message": {"content": text}, "finish_reason": "length"}]}
    return {"custom_id": cid, "response": {"status_code": 200, "body": body}}


def test_batch_judge() -> None:
    refs = {("chat", 0): ["Paris."]}
    which = {"b-0": 0, "b-1": 0}
    assert judge(_client(refs), which, [_line("b-0", "Paris.", "r0"), _line("b-1", "Paris.", "r1")], [])[0] == "ok"
    assert judge(_client(refs), which, [_line("b-0", "Paris.", "r0")], [])[0] == "no_terminal"
    assert judge(_client(refs), which, [_line("b-0", "Paris.", "r0"), _line("b-0", "Paris.", "r2"),
                                        _line("b-1", "Paris.", "r1")], [])[0] == "duplicate"
    assert judge(_client(refs), which, [_line("b-0", "Paris.", "r0"), _line("b-1", "Lyon.", "r1")], [])[0] \
        == "wrong_answer"
    assert judge(_client(refs), which, [_line("b-0", "Paris.", "r0"), _line("b-1", "Paris.", "r0")], [])[0] \
        == "duplicate"  # one response id twice
    dead = {"custom_id": "b-1", "response": {"status_code": 503, "body": {"error": {"code": "engine_unavailable"}}}}
    assert judge(_client(refs), which, [_line("b-0", "Paris.", "r0"), dead], [])[0] == "engine_fault"
    odd = {"custom_id": "b-1", "response": {"status_code": 500, "body": {"error": {"code": "server_error"}}}}
    assert judge(_client(refs), which, [_line("b-0", "Paris.", "r0")], [odd])[0] == "batch_line_error"


def _sse(*events: str) -> bytes:
    return "".join(f"data: {e}\n\n" for e in events).encode()


@pytest.mark.parametrize("events, status", [
    ((json.dumps({"id": "a", "choices": [{"index": 0, "delta": {"content": "Paris."}, "finish_reason": "stop"}]}),
      "[DONE]"), "ok"),
    ((json.dumps({"id": "a", "choices": [{"index": 0, "delta": {"content": "Paris."}, "finish_reason": "stop"}]}),),
     "no_terminal"),  # no [DONE]
    ((json.dumps({"id": "a", "choices": [{"index": 0, "delta": {"content": "Paris."}}]}), "[DONE]"),
     "no_terminal"),  # no finish_reason
    ((json.dumps({"id": "a", "choices": [{"index": 0, "delta": {"content": "Paris."}, "finish_reason": "stop"}]}),
      "[DONE]", "[DONE]"), "duplicate"),
    ((json.dumps({"id": "a", "choices": [{"index": 0, "delta": {"content": "Lyon."}, "finish_reason": "stop"}]}),
      "[DONE]"), "wrong_answer"),
    ((json.dumps({"error": {"code": "engine_unavailable", "message": "x"}}), "[DONE]"), "engine_fault"),
])
def test_stream_judge(events: tuple[str, ...], status: str) -> None:
    """A crafted stream (what a broken server could send; the real one is the slow test's)."""
    transport = httpx.MockTransport(lambda req: httpx.Response(200, content=_sse(*events),
                                                               headers={"content-type": "text/event-stream"}))

    async def go() -> Outcome:
        async with httpx.AsyncClient(transport=transport, base_url="http://soak") as http:
            c = _client({("chat", 0): ["Paris."]})
            c.http = http
            c.bodies = {("chat", 0): ("/v1/chat/completions", {"model": "m", "messages": []})}
            return await c.one("chat_stream", "alpha", "k")

    assert asyncio.run(go()).status == status
