"""Traffic control at the ingress, over several served models: canary rollouts
(rollouts.py) and shadows (shadow.py).

A request naming a rollout is placed on an arm before anything else reads its `model`:
from then on it is a request for that arm's model (its tokenizer, template, limits and
snapshot), and its answer says so (`model`, `system_fingerprint`, and the headers
`x-tokenmill-model` and `x-tokenmill-rollout: NAME; arm=canary`). A canary request that
fails before anything was reserved or sent (its model failed to load, does not fit, its
queue is full, its engine is gone) is counted against the canary and answered by the
stable arm: a broken candidate never fails a client request.

The operator's routes (an admin key's, when keys are on): GET /v1/rollouts (every
rollout and shadow, with their figures and decisions), GET /v1/rollouts/{name},
POST /v1/rollouts {"rollout": "NAME=STABLE:W,CANARY:W"} (a new rollout, as the flag
writes it) and POST /v1/rollouts/{name} with {"weights": {MODEL: W, MODEL: W}} or
{"action": "promote" | "rollback"}. With a data directory every decision is kept
(rollout_store.py) and outlives a restart.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from prometheus_client import CollectorRegistry

from tokenmill.engine.api import ModelHost
from tokenmill.server import answer_check
from tokenmill.server.errors import APIError
from tokenmill.server.keys import Tenant
from tokenmill.server.rollout_store import RolloutStore
from tokenmill.server.rollouts import (Arm, NameTaken, Observed, Rollout, RolloutMetrics, RolloutSpec, Thresholds,
                                       UnknownArm, parse_rollout)
from tokenmill.server.serving import BaseServing, RequestContext
from tokenmill.server.shadow import Shadows, ShadowSpec

log = logging.getLogger("tokenmill.server")
MAX_WEIGHT = 1_000_000


@dataclass(frozen=True)
class TrafficConfig:
    rollouts: tuple[RolloutSpec, ...] = ()
    shadows: tuple[ShadowSpec, ...] = ()
    thresholds: Thresholds = field(default_factory=Thresholds)
    data_dir: str | None = None  # where decisions are kept across restarts (None: in memory only)


@dataclass
class Route:
    """Where one request was placed."""
    rollout: Rollout
    arm: Arm
    observed: Observed
    failed_over: bool = False
    body: Any = None  # the request, when its answers carry a check of their own (answer_check.py)

    def headers(self) -> dict[str, str]:
        tail = "; failover" if self.failed_over else ""
        return {"x-tokenmill-model": self.arm.model,
                "x-tokenmill-rollout": f"{self.rollout.name}; arm={self.arm.role}{tail}"}


class AgreementCheck:
    """A rollout's check of its canary's greedy answers: the same request run again on the
    stable model after the answer (a Shadows target), the token ids compared."""

    def __init__(self, rollout: Rollout):
        self.rollout = rollout
        self.spec = ShadowSpec(rollout.name, rollout.stable.model, 1.0)
        self.running = 0

    def wants(self, ctx: RequestContext, greedy: bool) -> bool:
        r = self.rollout
        return greedy and r.state == "running" and ctx.route is not None and ctx.route.arm is r.canary

    def count(self, outcome: str) -> None:
        """A check that did not run (dropped, skipped, the stable model failed) judges nothing."""

    def compare(self, request_id: str, greedy: bool, primary: Observed, stable: Observed) -> None:
        if greedy:
            self.rollout.record_agreement(primary.tokens == stable.tokens)


def sticky_key(raw: Request, body, keys_on: bool) -> str | None:
    """The body's `user`, else (when keys are on: elsewhere any client's placeholder key
    would put everyone on one side) a digest of the API key; None: placed at random."""
    user = getattr(body, "user", None)
    if user:
        return f"user:{user}"
    if keys_on:
        scheme, _, token = raw.headers.get("authorization", "").partition(" ")
        token = token.strip() if scheme.lower() == "bearer" else raw.headers.get("x-api-key", "").strip()
        if token:
            return "key:" + hashlib.sha256(token.encode()).hexdigest()
    return None


class Traffic:
    def __init__(self, config: TrafficConfig, servings: dict[str, BaseServing], host: ModelHost | None,
                 registry: CollectorRegistry, keys_on: bool, served: Callable[[], list[str]],
                 aliases: Collection[str] = ()):
        self._metrics, self._thresholds = RolloutMetrics(registry), config.thresholds
        self._served, self._aliases = served, set(aliases)
        self.rollouts: dict[str, Rollout] = {}
        self._checks: dict[str, AgreementCheck] = {}
        self._started: set[str] = set()  # rollouts started at run time, not by a flag
        self.servings = servings
        self.keys_on = keys_on
        self._store = RolloutStore(config.data_dir) if config.data_dir is not None else None
        kept = self._store.load() if self._store is not None else {}
        for spec in config.rollouts:
            r, k = self._add(spec), kept.get(spec.name)
            if k is not None and (k.spec.stable, k.spec.canary) == (spec.stable, spec.canary):
                r.restore(k.spec.weights, k.state, k.decisions)
                log.info("rollout %s: %s with weights %s, as the last run left it", r.name, r.state, r.weights())
            else:
                self._keep(r)
        names = set(served())
        for name, k in kept.items():  # started at run time: again, while both models are served and its name free
            if k.started and name not in self.rollouts and name not in self._aliases and name not in names and \
                    {k.spec.stable, k.spec.canary} <= names:
                self._started.add(name)
                self._add(k.spec).restore(k.spec.weights, k.state, k.decisions)
                log.info("rollout %s (started at run time): %s with weights %s", name, k.state,
                         self.rollouts[name].weights())
        self.shadows = Shadows(list(config.shadows), servings, host, registry)

    def _add(self, spec: RolloutSpec) -> Rollout:
        r = Rollout(spec, self._thresholds, self._metrics, on_change=self._keep)
        self.rollouts[spec.name] = r
        if self._thresholds.min_agreement is not None:
            self._checks[spec.name] = AgreementCheck(r)
        return r

    @property
    def stable_of(self) -> dict[str, str]:
        """A rollout's name -> its stable model."""
        return {name: r.stable.model for name, r in self.rollouts.items()}

    def stable_model(self, name: str | None) -> str | None:
        """The stable model of the rollout `name`, None if it names none (each serving
        asks: a rollout started at run time reaches them all)."""
        r = self.rollouts.get(name) if name is not None else None
        return r.stable.model if r is not None else None

    def _keep(self, rollout: Rollout) -> None:
        if self._store is not None:
            self._store.save(rollout, started=rollout.name in self._started)

    def start(self, spec_text: str, by: str) -> Rollout:
        """A new rollout at run time, from the flag's text; raises APIError: 409 for a
        name in use, 404 for an arm that is not served, 400 for the rest."""
        try:
            spec = parse_rollout(spec_text, self._served(), taken={*self._aliases, *self.rollouts})
        except NameTaken as exc:
            raise APIError(409, str(exc).removeprefix("--rollout: "), param="rollout", code="name_taken") from None
        except UnknownArm as exc:
            raise APIError(404, str(exc).removeprefix("--rollout: "), param="rollout",
                           code="model_not_found") from None
        except ValueError as exc:
            raise APIError(400, str(exc).removeprefix("--rollout: "), param="rollout") from None
        if max(spec.weights) > MAX_WEIGHT:
            raise APIError(400, f"weights are whole numbers from 0 to {MAX_WEIGHT}", param="rollout")
        self._started.add(spec.name)
        r = self._add(spec)
        r.decisions.append({"time": time.time(), "action": "start", "by": by, "weights_before": None,
                            "weights": r.weights(), "evidence": None})
        log.info("rollout %s: started by %s, %s", r.name, by, r.weights())
        self._keep(r)
        return r

    def enter(self, ctx: RequestContext, raw: Request, body, operation: str) -> None:
        """At admission: place a request for a rollout on an arm, and offer it to its shadow."""
        requested = getattr(body, "model", None)
        rollout = self.rollouts.get(requested)
        if rollout is None and requested not in self.shadows.by_name:
            return
        observed = Observed(ctx.request_id)
        ctx.observers.append(observed.observe)
        allowed = getattr(ctx.limits, "allowed_models", None)
        if rollout is not None and (allowed is None or requested in allowed):
            arm = rollout.choose(sticky_key(raw, body, self.keys_on))
            body.model = arm.model
            ctx.route = Route(rollout, arm, observed, body=body if answer_check.carries_check(body) else None)
            ctx.finalizers.append(lambda _usage: self._settle(ctx.route, ctx.status_code))
            if arm is rollout.canary and requested in self._checks:
                self.shadows.attach(ctx, self._checks[requested], body, operation, observed)
        self.shadows.offer(ctx, requested, body, operation, observed)

    async def run(self, ctx: RequestContext, body, call: Callable[[], Awaitable]):
        """`call()` (the serving's create, for body.model), once more on the stable arm if
        the canary failed before it reserved or sent anything."""
        route = ctx.route
        try:
            return await call()
        except APIError as exc:
            if route is None or route.arm is not route.rollout.canary or exc.status < 500 or ctx.usage is not None:
                raise
            rollout = route.rollout
            log.warning("rollout %s: the canary %s failed (%s: %s); answering from %s", rollout.name,
                        route.arm.model, exc.code, exc.message, rollout.stable.model)
            rollout.record(route.arm, ok=False)
            rollout.metrics.failovers.labels(rollout.name).inc()
            route.arm, route.failed_over = rollout.stable, True
            body.model = route.arm.model
            return await call()

    def _settle(self, route: Route, status: int) -> None:
        """A 5xx is the arm's error; a finished answer its success (and, when the request
        carries a check, passed or failed); a 4xx or an answer cut short (the client went
        away) counts for neither."""
        if status >= 500:
            route.rollout.record(route.arm, ok=False)
        elif status == 200 and route.observed.finished:
            route.rollout.record(route.arm, ok=True, observed=route.observed, passed=self._passed(route))

    def _passed(self, route: Route) -> bool | None:
        if route.body is None or not route.observed.texts:
            return None
        parser = getattr(self.servings["chat"].for_model(route.arm.model), "reasoning", None)
        kind = parser.kind if parser is not None else None
        return all(answer_check.passes(route.body, text, kind) for text in route.observed.texts.values())

    @staticmethod
    def headers(ctx: RequestContext | None) -> dict[str, str]:
        return ctx.route.headers() if ctx is not None and ctx.route is not None else {}

    def model_rows(self) -> list[dict]:
        return [{"id": r.name, "object": "model", "owned_by": "tokenmill",
                 "rollout": {"stable": r.stable.model, "canary": r.canary.model, "weights": r.weights(),
                             "state": r.state}} for r in self.rollouts.values()]

    def status(self) -> dict:
        return {"object": "list", "data": [r.status() for r in self.rollouts.values()],
                "shadows": self.shadows.status()}

    async def stop(self) -> None:
        await self.shadows.stop()
        if self._store is not None:
            self._store.close()

    def add_routes(self, app: FastAPI) -> None:
        def check(raw: Request, name: str | None = None) -> Rollout | None:
            tenant: Tenant = raw.scope["state"]["tenant"]
            if self.keys_on and not tenant.admin:
                raise APIError(403, "rollouts are an operator's: they need an admin key (tokenmill keys add NAME "
                                    "--admin)", code="permission_denied")
            if name is None:
                return None
            rollout = self.rollouts.get(name)
            if rollout is None:
                raise APIError(404, f"no rollout {name!r} (rollouts: {', '.join(self.rollouts) or 'none'})",
                               code="rollout_not_found")
            return rollout

        @app.get("/v1/rollouts")
        async def rollouts(raw: Request) -> dict:
            check(raw)
            return self.status()

        @app.post("/v1/rollouts")
        async def start(raw: Request) -> dict:
            check(raw)
            body = await _json_object(raw)
            if set(body) != {"rollout"} or not isinstance(body["rollout"], str):
                raise APIError(400, 'send {"rollout": "NAME=STABLE:WEIGHT,CANARY:WEIGHT"}', param="rollout")
            return self.start(body["rollout"], "operator").status()

        @app.get("/v1/rollouts/{name:path}")
        async def rollout(name: str, raw: Request) -> dict:
            return check(raw, name).status()

        @app.post("/v1/rollouts/{name:path}")
        async def change(name: str, raw: Request) -> dict:
            r = check(raw, name)
            body = await _json_object(raw)
            if set(body) - {"weights", "action"} or len(body) != 1:
                raise APIError(400, 'send one of {"weights": {MODEL: WEIGHT, ...}} or {"action": "promote" | '
                                    '"rollback"}')
            if "action" in body:
                if body["action"] == "promote":
                    return r.promote("operator")
                if body["action"] == "rollback":
                    return r.rollback("operator")
                raise APIError(400, f"action must be promote or rollback, got {body['action']!r}", param="action")
            w = body["weights"]
            arms = {r.stable.model, r.canary.model}
            if not isinstance(w, dict) or set(w) != arms or not all(
                    type(v) is int and 0 <= v <= MAX_WEIGHT for v in w.values()) or not sum(w.values()):
                raise APIError(400, f"weights must give each of {sorted(arms)} a whole number from 0 to "
                                    f"{MAX_WEIGHT}, not all 0", param="weights")
            return r.set_weights("running", "operator", stable=w[r.stable.model], canary=w[r.canary.model])


async def _json_object(raw: Request) -> dict:
    try:
        body = json.loads(await raw.body() or b"null")
    except ValueError:
        raise APIError(400, "the request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise APIError(400, "the body must be a JSON object")
    return body
