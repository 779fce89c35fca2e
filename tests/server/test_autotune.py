"""The SLO autotuner: its decisions on their own, its loop against a toy plant (it
settles, within bounds, without flip-flopping), and a live server under a step load."""

from __future__ import annotations

import dataclasses
import threading
import time

import httpx
import pytest

from tests.server.conftest import MODEL, ServerProcess, metric
from tokenmill.engine.api import EngineStats
from tokenmill.server.autotune import FLOORS, SLO, Autotuner, Knobs, Observation, decide, goodput
from tokenmill.server.gate import AdmissionConfig
from tokenmill.server.metrics import Metrics
from tokenmill.server.stats import Served, StatsWindow

SLO_ = SLO(ttft_s=0.5, itl_s=0.05)
CEIL = Knobs(max_num_seqs=64, max_num_batched_tokens=512, decode_steps=8, max_waiting=256)
never_held = lambda knob: False  # noqa: E731


def obs(ttft, itl, waiting=0, requests=10, running=16, oldest=0.0, rate=5.0) -> Observation:
    return Observation(requests, ttft, itl, waiting, running, oldest, rate)


def one(changes, knob=None):
    """The single change made (of `knob`, when given)."""
    picked = [c for c in changes if knob is None or c.knob == knob]
    assert len(picked) == 1, changes
    return picked[0]


def test_itl_over_cuts_running_sequences_by_how_far_over():
    c = one(decide(CEIL, obs(0.1, 0.08, running=16), SLO_, CEIL, never_held))
    assert (c.knob, c.new) == ("max_num_seqs", 9)  # from what runs: 16 x 0.9 x 50/80
    c = one(decide(CEIL, obs(0.1, 0.055, running=16), SLO_, CEIL, never_held))
    assert (c.knob, c.new) == ("max_num_seqs", 13)  # a little over: a small cut (at most 0.85)
    draining = dataclasses.replace(CEIL, max_num_seqs=8)
    assert decide(draining, obs(0.1, 0.08, running=16), SLO_, CEIL, never_held) == []  # 16 > 8 still drain
    at_floor = dataclasses.replace(CEIL, max_num_seqs=FLOORS.max_num_seqs)
    c = one(decide(at_floor, obs(0.1, 0.08, running=2), SLO_, CEIL, never_held))
    assert (c.knob, c.new) == ("max_num_batched_tokens", 256)
    bottom = dataclasses.replace(at_floor, max_num_batched_tokens=FLOORS.max_num_batched_tokens)
    assert decide(bottom, obs(0.1, 0.08, running=2), SLO_, CEIL, never_held) == []  # nothing lower to go


def test_ttft_over_with_itl_room_admits_more_without_it_sheds_by_littles_law():
    k = dataclasses.replace(CEIL, max_num_seqs=16)
    c = one(decide(k, obs(0.9, 0.01, waiting=5), SLO_, CEIL, never_held))
    assert (c.knob, c.new) == ("max_num_seqs", 20)
    c = one(decide(k, obs(0.9, 0.01, waiting=5), SLO_, CEIL, never_held, itl_over_at=18))
    assert (c.knob, c.new) == ("max_num_seqs", 17)  # not up to a count whose ITL was over
    assert decide(k, obs(0.9, 0.01, waiting=5), SLO_, CEIL, never_held, itl_over_at=17)[0].knob != "max_num_seqs"
    c = one(decide(k, obs(0.9, 0.045, waiting=40, rate=6.0), SLO_, CEIL, never_held))  # no ITL room
    assert (c.knob, c.new) == ("max_waiting", 64)  # 6 req/s x 0.5 s = 3 would fit; at most a quarter per change
    k2 = dataclasses.replace(k, max_waiting=16)
    c = one(decide(k2, obs(0.9, 0.045, waiting=40, rate=6.0), SLO_, CEIL, never_held))
    assert (c.knob, c.new) == ("max_waiting", 4)  # Little's law: 3, raised to the floor
    c = one(decide(k, obs(None, 0.045, waiting=3, requests=0, oldest=0.7), SLO_, CEIL, never_held), "max_waiting")
    assert c.new < k.max_waiting  # a queued request already past the objective counts before it finishes


def test_dead_band_holds_still_and_headroom_gives_back_unless_held():
    assert decide(CEIL, obs(0.4, 0.04), SLO_, CEIL, never_held) == []  # between 60% and 100%
    low = Knobs(8, 128, 2, 32)
    assert decide(low, obs(0.4, 0.04, waiting=2), SLO_, CEIL, never_held) == []
    assert [(c.knob, c.new) for c in decide(low, obs(0.1, 0.01), SLO_, CEIL, never_held)] == \
        [("max_num_seqs", 12), ("max_waiting", 64)]
    assert decide(low, obs(None, 0.01, waiting=4, requests=0, oldest=0.4), SLO_, CEIL, never_held) == []  # a queue
    held = decide(low, obs(0.1, 0.01), SLO_, CEIL, lambda knob: knob in ("max_num_seqs", "max_waiting"))
    assert [(c.knob, c.new) for c in held] == [("max_num_batched_tokens", 256)]
    assert decide(CEIL, obs(0.1, 0.01), SLO_, CEIL, never_held) == []  # never past the operator's settings
    c = one(decide(low, obs(0.2, 0.04), SLO_, CEIL, never_held))  # ITL in the band, but nobody waits
    assert (c.knob, c.new) == ("max_waiting", 64)


def test_fresh_percentiles_need_enough_requests_else_the_live_itl():
    from tokenmill.server.autotune import observe

    served = [Served(10.0, "t", 0.2, 0.03), Served(10.0, "t", 0.3, 0.03)]
    o = observe(served, SLO_, waiting=0, running=4, live_itl=0.07)
    assert o.ttft is None and o.itl == 0.07  # two requests are not a percentile: the engine's counters
    o = observe(served * 3, SLO_, waiting=0, running=4, live_itl=0.07)
    assert o.ttft == pytest.approx(0.3) and o.itl == pytest.approx(0.03)


class Plant:
    """A toy server: per-token time grows with running sequences and the prefill budget;
    TTFT grows with the queue that fewer slots leave. Requests 'finish' each tick."""

    def __init__(self, load: int, gate):
        self.load = load
        self.gate = gate  # its admission queue bound sheds what does not fit (503s)
        self.knobs = {"max_num_seqs": CEIL.max_num_seqs, "max_num_batched_tokens": CEIL.max_num_batched_tokens,
                      "decode_steps": CEIL.decode_steps}
        self.running = True

    def tune(self, **kw):
        self.knobs.update(kw)

    def latencies(self) -> tuple[float, float, int]:
        seqs = min(self.load, self.knobs["max_num_seqs"])
        waiting = min(self.load - seqs, self.gate.admission.max_waiting_interactive)
        itl = 0.004 + 0.002 * seqs + 0.00006 * self.knobs["max_num_batched_tokens"]
        ttft = 0.05 + 0.02 * self.knobs["decode_steps"] + 0.08 * waiting
        return ttft, itl, waiting

    def stats(self) -> EngineStats:
        ttft, _, waiting = self.latencies()
        return EngineStats(num_running=min(self.load, self.knobs["max_num_seqs"]), num_waiting=waiting,
                           num_waiting_interactive=waiting, oldest_waiting_s=ttft if waiting else 0.0)


class Gate:
    def __init__(self):
        self.admission = AdmissionConfig()


def run_tuner(plant: Plant, seconds: int, tuner: Autotuner, clock, window: StatsWindow) -> list:
    changes = []
    for _ in range(seconds // 2):
        ttft, itl, _ = plant.latencies()
        start = clock.t
        clock.t += 2.0
        for _ in range(6):  # requests that arrived after the last step and finished before this one
            window.served.append(Served(clock.t - 0.1, "t", ttft, itl, start + 0.1))
        changes += tuner.step()
    return changes


class Clock:
    t = 1000.0

    def __call__(self):
        return self.t


def test_tuner_loop_settles_within_bounds_without_flip_flopping():
    clock = Clock()
    window = StatsWindow(clock=clock)
    gate = Gate()
    plant = Plant(load=40, gate=gate)
    metrics = Metrics(plant.stats)
    tuner = Autotuner(SLO(ttft_s=0.6, itl_s=0.05), plant, gate, window, metrics, CEIL, hold_s=20.0, clock=clock)
    heavy = run_tuner(plant, 240, tuner, clock, window)
    assert heavy, "an over-loaded plant gets changes"
    assert heavy[0].new < heavy[0].old  # the first move is a cut
    ttft, itl, _ = plant.latencies()
    assert itl <= 0.05 and ttft <= 0.6  # it found a setting that meets both (shedding the excess)
    tail = run_tuner(plant, 120, tuner, clock, window)
    assert tail == [], f"settled: no more changes ({tail})"
    for k in ("max_num_seqs", "max_num_batched_tokens", "decode_steps"):
        assert getattr(FLOORS, k) <= plant.knobs[k] <= getattr(CEIL, k)
    for knob in {c.knob for c in heavy}:  # no flapping: each knob turned around at most once
        dirs = [c.new > c.old for c in heavy if c.knob == knob]
        assert sum(a != b for a, b in zip(dirs, dirs[1:])) <= 1, (knob, dirs)
    assert metrics.registry.get_sample_value("tokenmill_autotune_changes_total",
                                             {"knob": heavy[0].knob, "direction": "down"}) >= 1
    plant.load = 2  # the load drops: headroom, so the knobs go back toward the operator's settings
    light = run_tuner(plant, 300, tuner, clock, window)
    assert light and all(c.new > c.old for c in light)
    assert plant.knobs["max_num_batched_tokens"] == CEIL.max_num_batched_tokens
    assert tuner.knobs.max_waiting == CEIL.max_waiting and gate.admission.max_waiting_interactive == CEIL.max_waiting
    assert goodput(window.served_since(clock.t - 10), tuner.slo, 10.0) > 0


class FixedEngine:
    """An engine whose counters the test sets."""

    def __init__(self):
        self.s = EngineStats()
        self.running = True
        self.tuned = {}

    def stats(self):
        return self.s

    def tune(self, **kw):
        self.tuned.update(kw)


def test_what_is_measured_while_a_cut_drains_neither_counts_nor_sticks():
    clock = Clock()
    window = StatsWindow(clock=clock)
    engine = FixedEngine()
    tuner = Autotuner(SLO(ttft_s=1.0, itl_s=0.04), engine, Gate(), window, Metrics(engine.stats),
                      dataclasses.replace(CEIL, max_num_seqs=4), hold_s=20.0, clock=clock)
    engine.s = EngineStats(num_running=12, num_waiting=3, num_waiting_interactive=3, generation_tokens=0)
    tuner.step()
    clock.t += 2.0  # 12 still run under a bound of 4 (admitted before a cut), slowly: 2 s for 200 tokens
    engine.s = EngineStats(num_running=12, num_waiting=3, num_waiting_interactive=3, generation_tokens=200)
    tuner.step()
    assert tuner._itl_over is None and tuner.last_change == clock.t  # the fresh window starts after the drain
    tuner._itl_over = (clock.t, 4)  # a count once seen over the objective ...
    clock.t += 2.0
    engine.s = EngineStats(num_running=4, num_waiting=3, num_waiting_interactive=3, generation_tokens=1000)
    tuner.step()  # ... runs at 5 ms a token now: that record is contradicted, and forgotten
    assert tuner._itl_over is None


def test_engine_rejects_unknown_knobs():
    from tokenmill.engine.api import check_knobs

    with pytest.raises(ValueError, match="cannot be tuned"):
        check_knobs({"block_size": 8})
    with pytest.raises(ValueError, match="positive"):
        check_knobs({"max_num_seqs": 0})


@pytest.mark.slow
def test_live_step_load_moves_knobs_down_then_back_up():
    """A real server with tight objectives: a heavy burst makes the tuner cut (ITL over),
    the light load after it gives the knobs back."""
    # ITL objective 25 ms: one light stream (~4 ms a token on an AVX-512 machine, ~8 with
    # its prefill stalls on an AVX2 one) is under the 60% that gives knobs back on both,
    # while 24 heavy streams of 400-token prompts (p90 ~80 ms here, their prefills riding
    # with the decodes) are far over; 12 ms failed on AVX2. (16 streams of 200-token prompts
    # ran at ~20 ms once the decoder fused its step: the test sat on the objective's edge.)
    srv = ServerProcess("--slo-ttft-ms", "400", "--slo-itl-ms", "25", "--autotune-interval", "0.5",
                        "--autotune-hold", "4", "--max-num-seqs", "32", "--log-level", "info").wait_ready()
    stop = threading.Event()

    def client(prompt_words: int, max_tokens: int):
        body = {"model": MODEL, "prompt": "word " * prompt_words, "max_tokens": max_tokens, "ignore_eos": True,
                "temperature": 0}
        while not stop.is_set():
            httpx.post(srv.url + "/v1/completions", json=body, timeout=120)

    def knob(name):
        return metric(srv, f'tokenmill_autotune_knob{{knob="{name}"}}')

    try:
        assert knob("max_num_seqs") == 32 and knob("max_num_batched_tokens") == 512
        heavy = [threading.Thread(target=client, args=(400, 48)) for _ in range(24)]
        for t in heavy:
            t.start()
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and not (knob("max_num_batched_tokens") < 512 or knob("max_num_seqs") < 32):
            time.sleep(0.5)
        stop.set()
        for t in heavy:
            t.join()
        assert knob("max_num_batched_tokens") < 512 or knob("max_num_seqs") < 32, "heavy load cut a knob"
        downs = [line for line in httpx.get(srv.url + "/metrics").text.splitlines()
                 if line.startswith("tokenmill_autotune_changes_total{") and 'direction="down"' in line]
        assert downs and sum(float(line.rsplit(" ", 1)[1]) for line in downs) >= 1
        stop.clear()
        light = threading.Thread(target=client, args=(8, 16))
        light.start()
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and not (knob("max_num_batched_tokens") == 512 and knob("max_num_seqs") == 32):
            time.sleep(0.5)
        stop.set()
        light.join()
        assert knob("max_num_batched_tokens") == 512 and knob("max_num_seqs") == 32, "light load gave them back"
        status = httpx.get(srv.url + "/v1/stats").json()["autotune"]
        assert status["changes"] and status["knobs"]["max_num_seqs"] == 32
    finally:
        stop.set()
        log = srv.stop()
    assert "autotune: " in log  # every change is logged
