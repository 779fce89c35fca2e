"""Shadow traffic: a share of the requests for a name (`serve --shadow NAME=MODEL:FRACTION`)
run again on a shadow model, whose answers are compared with the client's and thrown
away. The client never waits for it and is never billed for it:

- the copy starts when the client's exchange has ended (its whole answer sent), as the
  batch class, with no gate: no rate limit, budget, pricing, capture or tenant stats;
- at most `max_inflight` copies of each shadow run at once; more are dropped (counted), and a copy
  whose model would have to push a resident model out of the memory budget is skipped
  (counted): a shadow never makes the live model reload;
- compared: the exact token ids of every sample when both runs were greedy (a match
  rate, and where the first difference fell), and the engine's latency of both runs.

It only costs the client what sharing the machine's CPU with the copy costs.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections import deque
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram

from tokenmill.engine.api import ModelHost, Priority
from tokenmill.server.rollouts import LATENCY_BUCKETS, Observed, p99
from tokenmill.server.serving import BaseServing, RequestContext, new_id

log = logging.getLogger("tokenmill.server")
_RECENT = 20
_LATENCIES = 1000


@dataclass(frozen=True)
class ShadowSpec:
    name: str  # what clients request: a served model, an alias or a rollout
    model: str  # the served model that runs the copies
    fraction: float


def parse_shadow(spec: str, names: list[str], served: list[str]) -> ShadowSpec:
    """`NAME=MODEL[:FRACTION]`. Raises ValueError naming what is wrong."""
    name, eq, rest = spec.partition("=")
    name, rest = name.strip(), rest.strip()
    model, colon, frac = rest.rpartition(":")
    if not colon:
        model, frac = rest, "1"
    try:
        fraction = float(frac)
    except ValueError:
        fraction = -1.0
    if not eq or not name or not model:
        raise ValueError(f"--shadow takes NAME=MODEL[:FRACTION], got {spec!r}")
    if not 0 < fraction <= 1:
        raise ValueError(f"--shadow {name}: the fraction must be in (0, 1], got {frac!r}")
    if name not in names:
        raise ValueError(f"--shadow: {name!r} is not a served model, alias or rollout ({', '.join(names)})")
    if model not in served or model == name:
        raise ValueError(f"--shadow {name}: {model!r} must be another served model ({', '.join(served)})")
    return ShadowSpec(name, model, fraction)


class ShadowMetrics:
    def __init__(self, registry: CollectorRegistry):
        self.requests = Counter("tokenmill_shadow_requests", "Shadow copies by outcome: ok, error, dropped (too "
                                "many running), skipped (the primary failed, or no memory beside it).",
                                ["shadow", "model", "outcome"], registry=registry)
        self.compared = Counter("tokenmill_shadow_compared", "Greedy requests whose shadow's token ids matched "
                                "the primary's exactly (match) or not (differ).", ["shadow", "result"],
                                registry=registry)
        self.latency = Histogram("tokenmill_shadow_latency_seconds", "Engine time from arrival to the last token "
                                 "of mirrored requests, primary and shadow.", ["shadow", "side"],
                                 buckets=LATENCY_BUCKETS, registry=registry)


class Shadow:
    """One shadow's counts, latencies and latest comparisons. (A target of Shadows.attach:
    `spec.model`, `running`, `wants`, `count`, `compare`.)"""

    def __init__(self, spec: ShadowSpec, metrics: ShadowMetrics):
        self.spec, self.metrics = spec, metrics
        self.running = 0  # copies running now
        self.counts = {"ok": 0, "error": 0, "dropped": 0, "skipped": 0}
        self.compared = self.matches = 0
        self.latencies: deque[tuple[float, float]] = deque(maxlen=_LATENCIES)  # (primary, shadow)
        self.recent: deque[dict] = deque(maxlen=_RECENT)

    def wants(self, ctx: RequestContext, greedy: bool) -> bool:
        return True

    def count(self, outcome: str) -> None:
        self.counts[outcome] += 1
        self.metrics.requests.labels(self.spec.name, self.spec.model, outcome).inc()

    def compare(self, request_id: str, greedy: bool, primary: Observed, shadow: Observed) -> None:
        self.count("ok")
        row: dict = {"request_id": request_id, "greedy": greedy, "primary_latency_s": primary.latency,
                     "shadow_latency_s": shadow.latency}
        if primary.latency is not None and shadow.latency is not None:
            self.latencies.append((primary.latency, shadow.latency))
            self.metrics.latency.labels(self.spec.name, "primary").observe(primary.latency)
            self.metrics.latency.labels(self.spec.name, "shadow").observe(shadow.latency)
        if greedy:
            match = primary.tokens == shadow.tokens
            self.compared += 1
            self.matches += match
            self.metrics.compared.labels(self.spec.name, "match" if match else "differ").inc()
            row["match"] = match
            row["first_difference"] = None if match else first_difference(primary.tokens, shadow.tokens)
        self.recent.append(row)

    def status(self) -> dict:
        lat = {}
        for i, side in enumerate(("primary", "shadow")):
            values = [p[i] for p in self.latencies]
            lat[f"{side}_p50_s"] = sorted(values)[len(values) // 2] if values else None
            lat[f"{side}_p99_s"] = p99(values) if values else None
        return {"id": self.spec.name, "object": "shadow", "model": self.spec.model, "fraction": self.spec.fraction,
                **self.counts, "compared": self.compared, "matches": self.matches,
                "match_rate": self.matches / self.compared if self.compared else None, "latency": lat,
                "recent": list(self.recent)}


def first_difference(a: dict[tuple[str, int], list[int]], b: dict[tuple[str, int], list[int]]) -> dict:
    """The first sample (in order) whose token ids differ, and the position they part at."""
    for key in sorted(set(a) | set(b)):
        x, y = a.get(key, []), b.get(key, [])
        if x != y:
            at = next((i for i, (s, t) in enumerate(zip(x, y)) if s != t), min(len(x), len(y)))
            return {"sample": f"{key[0] or ''}#{key[1]}", "token": at, "primary_tokens": len(x),
                    "shadow_tokens": len(y)}
    return {}


class Shadows:
    """The shadows of one server. `offer` at the ingress; the copy runs after the exchange."""

    def __init__(self, specs: list[ShadowSpec], servings: dict[str, BaseServing], host: ModelHost | None,
                 registry: CollectorRegistry, max_inflight: int = 2, timeout_s: float = 300.0):
        metrics = ShadowMetrics(registry)
        self.by_name = {s.name: Shadow(s, metrics) for s in specs}
        self._servings = servings  # operation (chat, text_completion) -> its serving object
        self._host = host
        self.max_inflight, self.timeout_s = max_inflight, timeout_s
        self._tasks: set[asyncio.Task] = set()

    def offer(self, ctx: RequestContext, requested: str | None, body, operation: str, primary: Observed) -> None:
        shadow = self.by_name.get(requested)
        if shadow is not None and random.random() < shadow.spec.fraction:
            self.attach(ctx, shadow, body, operation, primary)

    def attach(self, ctx: RequestContext, target, body, operation: str, primary: Observed) -> None:
        """Run `body` again on `target.spec.model` once the exchange of `ctx` has ended."""
        if operation not in self._servings:
            return
        copy = body.model_copy(deep=True)  # as the client sent it, before serving fills it in
        copy.model, copy.stream, copy.stream_options = target.spec.model, False, None
        ctx.finalizers.append(lambda _usage: self._launch(target, copy, operation, ctx, primary))

    def _launch(self, target, body, operation: str, ctx: RequestContext, primary: Observed) -> None:
        greedy = ctx.params is not None and ctx.params.greedy
        if not target.wants(ctx, greedy):
            return
        if ctx.status_code != 200 or not primary.finished or not self._fits(target.spec.model):
            target.count("skipped")
            return
        if target.running >= self.max_inflight:
            target.count("dropped")
            return
        target.running += 1
        task = asyncio.ensure_future(self._run(target, body, operation, ctx.request_id, greedy, primary))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(self, target, body, operation: str, request_id: str, greedy: bool, primary: Observed) -> None:
        ctx = RequestContext(request_id=new_id("shadow"), priority=Priority.BATCH)
        seen = Observed(ctx.request_id)
        ctx.observers.append(seen.observe)
        try:
            await asyncio.wait_for(self._servings[operation].complete(body, ctx), self.timeout_s)
        except Exception as exc:  # the shadow's failure is only counted: the client has its answer
            log.info("shadow %s of %s failed: %s", target.spec.model, request_id, exc)
            target.count("error")
            return
        finally:
            ctx.finish()
            target.running -= 1
        target.compare(request_id, greedy and ctx.params is not None and ctx.params.greedy, primary, seen)

    def _fits(self, model: str) -> bool:
        """The shadow model is loaded, or loads beside the resident models without pushing one out."""
        if self._host is None:
            return True
        rows = {r["id"]: r for r in self._host.model_states()}
        row = rows[model]
        if row["state"] == "loaded":
            return True
        others = sum(r["memory"]["estimate_bytes"] for r in rows.values() if r["state"] != "available"
                     and r["id"] != model)
        return others + row["memory"]["estimate_bytes"] <= self._host.budget

    async def stop(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def status(self) -> list[dict]:
        return [s.status() for s in self.by_name.values()]
