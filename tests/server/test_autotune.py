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


def obs(ttft, itl, waiting=0, requests=10) -> Observation:
    return Observation(requests, ttft, itl, waiting, 4)


def test_itl_over_cuts_prefill_budget_then_sequences():
    c = decide(CEIL, obs(0.1, 0.08), SLO_, CEIL, never_held)
    assert (c.knob, c.new) == ("max_num_batched_tokens", 256)
    at_floor = dataclasses.replace(CEIL, max_num_batched_tokens=FLOORS.max_num_batched_tokens)
    c = decide(at_floor, obs(0.1, 0.08), SLO_, CEIL, never_held)
    assert (c.knob, c.new) == ("max_num_seqs", 48)
    bottom = dataclasses.replace(at_floor, max_num_seqs=FLOORS.max_num_seqs)
    assert decide(bottom, obs(0.1, 0.08), SLO_, CEIL, never_held) is None  # nothing lower to go


def test_ttft_over_admits_more_then_shortens_bursts():
    k = dataclasses.replace(CEIL, max_num_seqs=16)
    c = decide(k, obs(0.9, 0.01, waiting=5), SLO_, CEIL, never_held)
    assert (c.knob, c.new) == ("max_num_seqs", 24)
    c = decide(CEIL, obs(0.9, 0.01, waiting=5), SLO_, CEIL, never_held)  # seqs at the ceiling
    assert (c.knob, c.new) == ("decode_steps", 4)
    c = decide(k, obs(0.9, 0.01, waiting=0), SLO_, CEIL, never_held)  # no queue: admission is not it
    assert c.knob == "decode_steps"


def test_both_over_sheds_load_and_dead_band_holds_still():
    c = decide(CEIL, obs(0.9, 0.08, waiting=40), SLO_, CEIL, never_held)
    assert (c.knob, c.new) == ("max_waiting", 128)
    assert decide(CEIL, obs(0.4, 0.04), SLO_, CEIL, never_held) is None  # between 60% and 100%
    low = Knobs(8, 128, 2, 32)
    assert decide(low, obs(0.4, 0.04), SLO_, CEIL, never_held) is None
    c = decide(low, obs(0.2, 0.04), SLO_, CEIL, never_held)  # ITL in the band, but nobody waits
    assert (c.knob, c.new) == ("max_waiting", 64)
    assert decide(low, obs(0.2, 0.04, waiting=3), SLO_, CEIL, never_held) is None


def test_headroom_gives_back_toward_the_ceiling_unless_held():
    low = Knobs(8, 128, 2, 32)
    c = decide(low, obs(0.1, 0.01), SLO_, CEIL, never_held)
    assert (c.knob, c.new) == ("max_num_batched_tokens", 256)
    c = decide(low, obs(0.1, 0.01), SLO_, CEIL, lambda knob: knob == "max_num_batched_tokens")
    assert (c.knob, c.new) == ("decode_steps", 4)
    assert decide(CEIL, obs(0.1, 0.01), SLO_, CEIL, never_held) is None  # never past the operator's settings


def test_needs_fresh_samples_unless_the_queue_starves():
    assert decide(CEIL, obs(2.0, 0.2, requests=3), SLO_, CEIL, never_held) is None
    starving = Observation(0, None, None, 12, 64, oldest_wait_s=0.7)  # a queued request is past its TTFT
    c = decide(dataclasses.replace(CEIL, max_num_seqs=32), starving, SLO_, CEIL, never_held)
    assert (c.knob, c.new) == ("max_num_seqs", 48)
    queued = Observation(0, None, None, 12, 64, oldest_wait_s=0.3)  # waiting, but not late yet
    assert decide(dataclasses.replace(CEIL, max_num_seqs=32), queued, SLO_, CEIL, never_held) is None


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
        c = tuner.step()
        if c is not None:
            changes.append(c)
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
    assert heavy[0].knob in ("max_num_batched_tokens", "max_waiting") and heavy[0].new < heavy[0].old
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
    srv = ServerProcess("--slo-ttft-ms", "400", "--slo-itl-ms", "12", "--autotune-interval", "0.5",
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
        heavy = [threading.Thread(target=client, args=(200, 48)) for _ in range(16)]
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
