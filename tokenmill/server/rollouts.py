"""Canary rollouts: a name whose traffic splits between two served models by weight
(`serve --rollout NAME=STABLE:90,CANARY:10`), and the automatic rollback that takes the
canary's share away when it does worse than the stable arm.

- Each request is placed by a hash of the rollout's name and its sticky key (the body's
  `user`, else the API key, else nothing: then at random), so one user's conversation
  stays on one side. The canary holds the bottom of the hash range: raising its weight
  moves stable users over and never moves a canary user back.
- Each arm keeps its last `window` outcomes: a request is an error when it ended with a
  5xx (or failed over, below), a success when every sample finished; a 4xx is the
  client's and counts for neither. Latency and TTFT are the engine's own (the request's
  arrival at the arm's engine to its last and first token), so a model's load time is
  not charged to it.
- Rollback: once both arms hold at least `min_requests` outcomes, the canary's weight
  drops to 0 when its error rate exceeds the stable arm's by more than `error_margin`
  (absolute: 0.05 is five points), or its p99 latency over successful requests exceeds
  the stable arm's times 1 + `latency_margin`, or (with `min_agreement`) fewer than that
  share of its greedy answers match, token for token, what the stable model answers to
  the same request (run after the answer, as a shadow: shadow.py), or (with
  `success_margin`) the share of its checked answers that pass their request's own
  check (a json_schema, a forced tool call: answer_check.py) is below the stable arm's by
  more than that margin. The decision and its evidence are logged and kept (GET
  /v1/rollouts).
- Promotion (with `promote_after`): once the canary holds that many outcomes (and, with
  `min_agreement`, `min_requests` agreement checks) and no rule fires, it takes all the
  traffic.
"""

from __future__ import annotations

import hashlib
import logging
import math
import random
import time
from collections import deque
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from tokenmill.engine.api import RequestOutput
from tokenmill.server.aliases import NAME

log = logging.getLogger("tokenmill.server")
STABLE, CANARY = "stable", "canary"
LATENCY_BUCKETS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
_DECISIONS_KEPT = 50


@dataclass(frozen=True)
class Thresholds:
    error_margin: float = 0.05  # canary error rate - stable error rate that rolls it back
    latency_margin: float = 0.5  # canary p99 > stable p99 * (1 + this) rolls it back
    min_requests: int = 20  # outcomes each arm needs before anything is compared
    min_agreement: float | None = None  # greedy canary answers that must match the stable model's (None: unchecked)
    promote_after: int = 0  # canary outcomes after which a healthy canary is promoted (0: never by itself)
    window: int = 500  # the latest outcomes per arm that are compared
    success_margin: float | None = None  # stable success rate - canary's that rolls it back (None: unchecked)

    def __post_init__(self) -> None:
        if not (0 <= self.error_margin < 1 and self.latency_margin >= 0 and 1 <= self.min_requests <= self.window
                and (self.min_agreement is None or 0 < self.min_agreement <= 1) and self.promote_after >= 0
                and (self.success_margin is None or 0 <= self.success_margin < 1)):
            raise ValueError("--rollout-error-margin must be in [0, 1), --rollout-latency-margin 0 or more, "
                             f"--rollout-min-requests 1 to {self.window}, --rollout-min-agreement in (0, 1], "
                             "--rollout-promote-after 0 or more and --rollout-success-margin in [0, 1)")


@dataclass(frozen=True)
class RolloutSpec:
    name: str
    stable: str
    canary: str
    weights: tuple[int, int]  # (stable, canary)


class NameTaken(ValueError):
    """A rollout's name that a served model, an alias or another rollout already has."""


class UnknownArm(ValueError):
    """An arm that names no served model."""


def parse_rollout(spec: str, served: list[str], taken: Collection[str] = ()) -> RolloutSpec:
    """`NAME=STABLE:W,CANARY:W` over served model names; `taken`: other names in use
    (aliases, rollouts). Raises ValueError naming what is wrong (NameTaken, UnknownArm)."""
    name, eq, rest = spec.partition("=")
    name = name.strip()
    arms = [a.strip() for a in rest.split(",")]
    if not eq or not name or len(arms) != 2:
        raise ValueError(f"--rollout takes NAME=STABLE:WEIGHT,CANARY:WEIGHT, got {spec!r}")
    if not NAME.match(name):
        raise ValueError(f"--rollout: a rollout's name is a letter or digit, then up to 127 letters, digits or "
                         f"'._:/-', got {name!r}")
    if name in served or name in taken:
        raise NameTaken(f"--rollout: {name!r} names a served model, an alias or a rollout; a rollout needs a name "
                        "of its own")
    models, weights = [], []
    for arm in arms:
        model, colon, w = arm.rpartition(":")
        if not colon or not w.isdigit() or not model:
            raise ValueError(f"--rollout: {arm!r} is not MODEL:WEIGHT (a whole number)")
        if model not in served:
            raise UnknownArm(f"--rollout: {model!r} is not a served model (serving {', '.join(served)})")
        models.append(model)
        weights.append(int(w))
    if models[0] == models[1] or sum(weights) == 0:
        raise ValueError(f"--rollout {name}: the two arms must be different models, with weights not both 0")
    return RolloutSpec(name, models[0], models[1], (weights[0], weights[1]))


def bucket(name: str, key: str | None) -> float:
    """Where a sticky key falls in [0, 1) for this rollout; no key: at random."""
    if key is None:
        return random.random()
    digest = hashlib.sha256(f"{name}\0{key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2 ** 64


def p99(values: list[float]) -> float:
    s = sorted(values)
    return s[max(0, math.ceil(0.99 * len(s)) - 1)]  # nearest rank


class Observed:
    """What a request's engine outputs showed: each sample's token ids and the engine's
    timing (first arrival, first token, last finish). `base`: the request's id, so that
    samples are keyed the same way for two requests (a primary and its shadow)."""

    def __init__(self, base: str):
        self.base = base
        self.tokens: dict[tuple[str, int], list[int]] = {}
        self._chunks: dict[tuple[str, int], list[str]] = {}  # each sample's text as the engine wrote it
        self.finished = 0
        self.arrival = self.first_token = self.last = None

    @property
    def texts(self) -> dict[tuple[str, int], str]:
        return {key: "".join(chunks) for key, chunks in self._chunks.items()}

    def observe(self, out: RequestOutput) -> None:
        key = (out.request_id.removeprefix(self.base), out.index)
        self.tokens.setdefault(key, []).extend(out.new_token_ids)
        self._chunks.setdefault(key, []).append(out.text)
        t = out.times
        if not out.finished or t is None:
            return
        self.finished += 1
        self.arrival = t.arrival if self.arrival is None else min(self.arrival, t.arrival)
        if t.first_token is not None:
            self.first_token = t.first_token if self.first_token is None else min(self.first_token, t.first_token)
        if t.finished is not None:
            self.last = t.finished if self.last is None else max(self.last, t.finished)

    @property
    def ttft(self) -> float | None:
        return self.first_token - self.arrival if self.first_token is not None else None

    @property
    def latency(self) -> float | None:
        return self.last - self.arrival if self.last is not None else None


class RolloutMetrics:
    """The rollouts' series in the app's registry (one set for every rollout)."""

    def __init__(self, registry: CollectorRegistry):
        r = registry
        self.requests = Counter("tokenmill_rollout_requests", "Requests through a rollout by arm and outcome (ok: "
                                "every sample finished; error: a 5xx, or a canary failure that failed over).",
                                ["rollout", "arm", "model", "outcome"], registry=r)
        self.ttft = Histogram("tokenmill_rollout_ttft_seconds", "Engine time to first token by rollout arm.",
                              ["rollout", "arm"], buckets=LATENCY_BUCKETS, registry=r)
        self.latency = Histogram("tokenmill_rollout_latency_seconds", "Engine time from arrival to the last "
                                 "token by rollout arm.", ["rollout", "arm"], buckets=LATENCY_BUCKETS, registry=r)
        self.weight = Gauge("tokenmill_rollout_weight", "An arm's current weight.", ["rollout", "arm"], registry=r)
        self.failovers = Counter("tokenmill_rollout_failovers", "Canary requests that failed before answering "
                                 "and were answered by the stable arm.", ["rollout"], registry=r)
        self.rollbacks = Counter("tokenmill_rollout_rollbacks", "Automatic rollbacks.", ["rollout"], registry=r)
        self.promotions = Counter("tokenmill_rollout_promotions", "Automatic promotions.", ["rollout"], registry=r)
        self.agreement = Counter("tokenmill_rollout_agreement", "Greedy canary answers checked against the stable "
                                 "model's: match or differ.", ["rollout", "result"], registry=r)
        self.checks = Counter("tokenmill_rollout_checks", "Answers checked by their request's own check (a "
                              "json_schema, a forced tool call) by arm: pass or fail.", ["rollout", "arm", "result"],
                              registry=r)


@dataclass
class Arm:
    role: str  # stable or canary
    model: str
    weight: int
    window: deque  # (ok, latency or None), the latest outcomes (bounded: Thresholds.window)
    checks: deque  # passed?, the latest checked answers (answer_check.py), bounded alike
    ok: int = 0
    errors: int = 0
    checked: int = 0
    passed: int = 0

    def summary(self) -> dict:
        n, m = len(self.window), len(self.checks)
        errs = sum(1 for ok, _ in self.window if not ok)
        lats = [lat for ok, lat in self.window if ok and lat is not None]
        return {"model": self.model, "weight": self.weight, "requests": self.ok + self.errors, "errors": self.errors,
                "window": n, "window_error_rate": errs / n if n else None,
                "window_p99_latency_s": p99(lats) if lats else None, "checked": self.checked, "passed": self.passed,
                "window_checked": m, "window_success_rate": sum(self.checks) / m if m else None}


class Rollout:
    """One rollout's arms, weights, outcome windows and decisions."""

    def __init__(self, spec: RolloutSpec, thresholds: Thresholds, metrics: RolloutMetrics,
                 on_change: Callable[[Rollout], None] | None = None):
        self.name, self.thresholds, self.metrics = spec.name, thresholds, metrics
        self.on_change = on_change  # after each decision (rollout_store.py keeps it)
        n = thresholds.window
        self.stable = Arm(STABLE, spec.stable, spec.weights[0], deque(maxlen=n), deque(maxlen=n))
        self.canary = Arm(CANARY, spec.canary, spec.weights[1], deque(maxlen=n), deque(maxlen=n))
        self.state = "running"  # running, rolled_back, promoted
        self.decisions: deque[dict] = deque(maxlen=_DECISIONS_KEPT)
        self.agreement: deque[bool] = deque(maxlen=thresholds.window)  # canary answers == the stable model's?
        self._show_weights()

    @property
    def arms(self) -> tuple[Arm, Arm]:
        return self.stable, self.canary

    def choose(self, key: str | None) -> Arm:
        total = self.stable.weight + self.canary.weight
        assert total > 0, "weights are never both 0"
        return self.canary if bucket(self.name, key) < self.canary.weight / total else self.stable

    def record(self, arm: Arm, ok: bool, observed: Observed | None = None, passed: bool | None = None) -> None:
        """One outcome; `passed`: a successful answer's own check (None: it carried none)."""
        latency = observed.latency if observed is not None else None
        arm.window.append((ok, latency))
        if ok and passed is not None:
            arm.checks.append(passed)
            arm.checked += 1
            arm.passed += passed
            self.metrics.checks.labels(self.name, arm.role, "pass" if passed else "fail").inc()
        if ok:
            arm.ok += 1
        else:
            arm.errors += 1
        self.metrics.requests.labels(self.name, arm.role, arm.model, "ok" if ok else "error").inc()
        if ok and observed is not None:
            if observed.ttft is not None:
                self.metrics.ttft.labels(self.name, arm.role).observe(observed.ttft)
            if latency is not None:
                self.metrics.latency.labels(self.name, arm.role).observe(latency)
        self._judge()

    def record_agreement(self, match: bool) -> None:
        self.agreement.append(match)
        self.metrics.agreement.labels(self.name, "match" if match else "differ").inc()
        self._judge()

    def _judge(self) -> None:
        if self.state != "running" or self.canary.weight == 0:
            return
        evidence = self.evaluate()
        if evidence is None:
            return
        if evidence["rule"] == "healthy":
            self.metrics.promotions.labels(self.name).inc()
            self.promote("auto", evidence)
        else:
            self.metrics.rollbacks.labels(self.name).inc()
            self.rollback("auto", evidence)

    def evaluate(self) -> dict | None:
        """The evidence for a rollback (or, with promote_after, a promotion: rule
        "healthy"), or None while too few outcomes are in to say."""
        t, s, c = self.thresholds, self.stable.summary(), self.canary.summary()
        if min(s["window"], c["window"]) < t.min_requests:
            return None
        evidence = {"stable": s, "canary": c, "agreement": self._agreement(), **vars(t)}
        if c["window_error_rate"] - s["window_error_rate"] > t.error_margin:
            return {"rule": "error_rate", **evidence}
        lats = [[lat for ok, lat in a.window if ok and lat is not None] for a in self.arms]
        if min(map(len, lats)) >= t.min_requests and p99(lats[1]) > p99(lats[0]) * (1 + t.latency_margin):
            return {"rule": "p99_latency", **evidence}
        if t.success_margin is not None and min(s["window_checked"], c["window_checked"]) >= t.min_requests and \
                s["window_success_rate"] - c["window_success_rate"] > t.success_margin:
            return {"rule": "success_rate", **evidence}
        checked = len(self.agreement) >= t.min_requests
        if t.min_agreement is not None and checked and evidence["agreement"]["rate"] < t.min_agreement:
            return {"rule": "agreement", **evidence}
        if t.promote_after and c["window"] >= t.promote_after and (t.min_agreement is None or checked):
            return {"rule": "healthy", **evidence}
        return None

    def _agreement(self) -> dict:
        n = len(self.agreement)
        return {"checked": n, "matches": sum(self.agreement), "rate": sum(self.agreement) / n if n else None}

    def rollback(self, by: str, evidence: dict | None = None) -> dict:
        """The canary's weight to 0 (the stable arm takes the canary's, if it had none)."""
        return self.set_weights("rolled_back", by, evidence, stable=self.stable.weight or self.canary.weight,
                                canary=0)

    def promote(self, by: str, evidence: dict | None = None) -> dict:
        """Every request to the canary (at the larger of the two weights)."""
        return self.set_weights("promoted", by, evidence, stable=0,
                                canary=max(self.stable.weight, self.canary.weight))

    def set_weights(self, state: str, by: str, evidence: dict | None = None, *, stable: int | None = None,
                    canary: int | None = None) -> dict:
        """Change the weights (None: as they are) and record why; windows start afresh
        when the rollout runs again, so old outcomes do not judge the new split."""
        before = self.weights()
        if stable is not None:
            self.stable.weight = stable
        if canary is not None:
            self.canary.weight = canary
        if state == "running":
            for a in self.arms:
                a.window.clear()
                a.checks.clear()
            self.agreement.clear()
        self.state = state
        self._show_weights()
        decision = {"time": time.time(), "action": {"rolled_back": "rollback", "promoted": "promote"}.get(
            state, "set_weights"), "by": by, "weights_before": before, "weights": self.weights(), "evidence": evidence}
        self.decisions.append(decision)
        level = logging.WARNING if state == "rolled_back" else logging.INFO
        log.log(level, "rollout %s: %s by %s, weights %s -> %s%s", self.name, decision["action"], by, before,
                decision["weights"], f"; evidence {_brief(evidence)}" if evidence else "")
        if self.on_change is not None:
            self.on_change(self)
        return decision

    def restore(self, weights: tuple[int, int], state: str, decisions: list[dict]) -> None:
        """The weights, state and decisions a previous run of the server left (its
        outcome windows are not kept: a running rollout is judged afresh)."""
        self.stable.weight, self.canary.weight = weights
        self.state = state
        self.decisions.extend(decisions)
        self._show_weights()

    def weights(self) -> dict[str, int]:
        return {a.model: a.weight for a in self.arms}

    def _show_weights(self) -> None:
        for a in self.arms:
            self.metrics.weight.labels(self.name, a.role).set(a.weight)

    def status(self) -> dict:
        return {"id": self.name, "object": "rollout", "state": self.state, "stable": self.stable.summary(),
                "canary": self.canary.summary(), "agreement": self._agreement(), "thresholds": vars(self.thresholds),
                "decisions": list(self.decisions)}


def _brief(evidence: dict) -> str:
    s, c = evidence["stable"], evidence["canary"]

    def fmt(v):
        return "n/a" if v is None else f"{v:.3f}"
    return (f"{evidence['rule']}: error rate {fmt(c['window_error_rate'])} vs {fmt(s['window_error_rate'])}, p99 "
            f"{fmt(c['window_p99_latency_s'])}s vs {fmt(s['window_p99_latency_s'])}s over {c['window']} and "
            f"{s['window']} requests (canary vs stable); success {fmt(c['window_success_rate'])} vs "
            f"{fmt(s['window_success_rate'])} over {c['window_checked']} and {s['window_checked']} checked; "
            f"agreement {fmt(evidence['agreement']['rate'])} over {evidence['agreement']['checked']}")
