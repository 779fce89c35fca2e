"""The FastAPI app: thin routes over the serving classes, health, readiness, metrics.

`build_app(engine, config, policy)` wires one engine client into one app; nothing is
global, so two servers can live in one process (tests).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from starlette.responses import JSONResponse, Response

from tokenmill.batch.runner import BatchLimits
from tokenmill.engine.api import EngineClient, ModelHost, UnknownModel, text_digest
from tokenmill.server.autotune import Autotuner, AutotuneConfig
from tokenmill.server.dialects import add_dialect_routes
from tokenmill.server.dialects.embeddings import model_capabilities
from tokenmill.server.errors import APIError, install_error_handlers
from tokenmill.server.gate import AdmissionConfig, Gate
from tokenmill.server.idempotency import IdempotencyStore
from tokenmill.server.key_cache import KeyCache
from tokenmill.server.keys import Tenant, TenantLimits
from tokenmill.server.limits import ServerTokens
from tokenmill.server.lora_routes import add_lora_routes
from tokenmill.server.model_routes import add_model_routes
from tokenmill.server.metrics import Metrics
from tokenmill.server.middleware import Frontdoor, ServerState, bounded_route
from tokenmill.server.protocol import ChatCompletionRequest, CompletionRequest
from tokenmill.server.serving import BaseServing, RequestContext, new_id
from tokenmill.server.reasoning import ChatReasoning
from tokenmill.server.serving_chat import ServingChat
from tokenmill.server.serving_completion import ServingCompletion
from tokenmill.server.stats import StatsWindow, TenantTotals, engine_block, registry_totals
from tokenmill.server.telemetry import Telemetry
from tokenmill.server.ui import add_console_routes

log = logging.getLogger("tokenmill.server")
ANONYMOUS = "anonymous"


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    shutdown_timeout_s: float = 30.0  # SIGTERM: in-flight requests get this long to finish
    chat_template: str | None = None  # a Jinja source replacing the model's own template
    reasoning_parser: str | None = None  # deepseek_r1, qwen3, none; None: chosen from the chat template
    aliases: tuple = ()  # tokenmill.server.aliases.ModelAlias: other names for the model or a snapshot of it
    traffic: object | None = None  # tokenmill.server.traffic.TrafficConfig: rollouts and shadows (None: none)


@dataclass
class ServicePolicy:
    """Tenancy, limits and pricing. With no key store the server is open: every
    request is the anonymous tenant under `defaults`."""
    keys: KeyCache | None = None  # the key store, read off the event loop (server/key_cache.py)
    defaults: TenantLimits = field(default_factory=TenantLimits)
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    card: object | None = None  # tokenmill.cost.RateCard used for usage.cost (None: no pricing)
    model_cards: dict = field(default_factory=dict)  # a model's or adapter's own RateCard, by name
    batch_store: object | None = None  # tokenmill.batch.store.BatchStore (None: no Batch API)
    batch: BatchLimits = field(default_factory=BatchLimits)
    server_alarm: object | None = None  # tokenmill.cost.SpendAlarm over all tenants' spend (None: none)
    capture: object | None = None  # tokenmill.server.capture.CapturePolicy (None: nothing captured)


LAG_PROBE_S = 0.05  # how often the event loop's lag is sampled


async def watch_loop_lag(metrics: Metrics) -> None:
    """Sample how late a timer fires: the time the loop was busy with something else."""
    loop = asyncio.get_running_loop()
    while True:
        t = loop.time()
        await asyncio.sleep(LAG_PROBE_S)
        metrics.observe_loop_lag(max(0.0, loop.time() - t - LAG_PROBE_S))


def _timeout_header(raw: Request) -> float | None:
    value = raw.headers.get("x-request-timeout")
    if value is None:
        return None
    try:
        t = float(value)
    except ValueError:
        t = -1.0
    if not t > 0:
        raise APIError(400, "X-Request-Timeout must be a positive number of seconds", param="X-Request-Timeout")
    return t


def build_app(engine: EngineClient, config: ServerConfig | None = None,
              policy: ServicePolicy | None = None, tracer_provider: object | None = None,
              autotune: AutotuneConfig | None = None) -> FastAPI:
    """`tracer_provider`: an OpenTelemetry TracerProvider for request spans (None: no
    tracing; see telemetry.otlp_tracer_provider). `autotune`: objectives the server tunes
    its scheduling knobs to meet while it runs (None: the knobs stay as configured)."""
    config = config or ServerConfig()
    policy = policy or ServicePolicy()
    model_name = engine.model_names()[0]  # (--served-model-name reaches the engine's config)
    if engine.served().tokenizer is None:
        raise ValueError("the server needs a model with a tokenizer")
    state = ServerState()
    # a cluster engine (tokenmill.cluster) also reports its replicas and routing
    host = engine if isinstance(engine, ModelHost) else None  # several models, loaded on demand
    metrics = Metrics(engine.stats, engine.replica_stats, getattr(engine, "router_decisions", None),
                      host.model_states if host is not None else None)

    def processed() -> int:  # tokens the engine has computed and generated
        s = engine.stats()
        return s.prompt_tokens_computed + s.generation_tokens

    gate = Gate(policy.defaults, engine.stats, metrics, policy.admission,
                server_alarm=policy.server_alarm,
                server_tokens=ServerTokens(processed, lambda: engine.served().limits.cache_tokens))
    pricer = None
    if policy.card is not None:
        from tokenmill.server.pricing import Pricer

        pricer = Pricer(policy.card, model_name, metrics, gate.ledger, policy.model_cards, engine.served)
    idempotency = IdempotencyStore()
    telemetry = Telemetry(StatsWindow(), model_name, tracer_provider)
    tuner = None
    if autotune is not None:
        tuner = Autotuner(autotune.slo, engine, gate, telemetry.stats, metrics, autotune.ceiling,
                          interval_s=autotune.interval_s, hold_s=autotune.hold_s)
    chat, completion = _servings(engine, config, metrics)
    tokenizer = chat.tokenizer
    snapshot = engine.served().snapshot
    if snapshot is not None and config.chat_template is not None:  # the template this server renders
        snapshot = snapshot.replace(chat_template=text_digest(config.chat_template))
    aliases = {a.name: a for a in config.aliases}
    traffic = None
    if config.traffic is not None:
        from tokenmill.server.traffic import Traffic

        traffic = Traffic(config.traffic, {"chat": chat, "text_completion": completion}, host, metrics.registry,
                          keys_on=policy.keys is not None, served=engine.model_names, aliases=aliases)
    for family in (chat.siblings, completion.siblings):
        for name, serving in family.items():
            serving.snapshot = snapshot if name == model_name else engine.served(name).snapshot
            serving.aliases = aliases
            if traffic is not None:
                serving.rollout_stable = traffic.stable_model
    capture = policy.capture

    runner = None
    if policy.batch_store is not None:
        from tokenmill.batch.runner import BatchRunner
        from tokenmill.server.batch_api import ServerLineExecutor, add_batch_routes

        executor = ServerLineExecutor(chat, completion, gate, pricer, policy.keys, Tenant(ANONYMOUS, policy.defaults),
                                      telemetry)
        runner = BatchRunner(policy.batch_store, executor, policy.batch)

    def engine_gave_up() -> None:
        if state.on_fatal is not None:
            state.on_fatal()

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        engine.on_give_up = engine_gave_up
        await engine.start()
        lag = asyncio.ensure_future(watch_loop_lag(metrics))
        if runner is not None:
            await runner.start()
        if tuner is not None:
            tuner.start()
        log.info("serving %s", model_name)
        try:
            yield
        finally:
            lag.cancel()
            if traffic is not None:
                await traffic.stop()
            if tuner is not None:
                await tuner.stop()
            if runner is not None:
                await runner.stop()
                runner.store.close()
            await engine.stop()
            telemetry.shutdown()
            if capture is not None:
                capture.store.close()

    app = FastAPI(title="tokenmill", lifespan=lifespan)
    app.router.route_class = bounded_route(engine.bounds)
    app.state.server = state
    app.state.engine = engine
    app.state.metrics = metrics
    app.state.model_name = model_name
    app.state.config = config
    app.state.idempotency = idempotency
    app.state.telemetry = telemetry
    app.state.tuner = tuner
    install_error_handlers(app)

    def context(raw: Request, prefix: str, body, operation: str) -> RequestContext:
        ctx = RequestContext(request_id=new_id(prefix))
        raw.scope["state"]["ctx"] = ctx  # Frontdoor settles it when the exchange ends
        tenant: Tenant = raw.scope["state"]["tenant"]
        ctx.tenant = tenant.name
        telemetry.begin(ctx, operation, raw.headers, body.trace_params(), raw.scope["state"]["client_request_id"])
        gate.admit(ctx, tenant, body.priority, _timeout_header(raw))
        ctx.gate = gate
        if pricer is not None:
            pricer.attach(ctx)
        if capture is not None and capture.wants(tenant):
            from tokenmill.server.capture import Recording

            ctx.capture = Recording(capture.store, ctx.request_id, tenant.name, operation)
            ctx.finalizers.append(ctx.capture.finish)
        if traffic is not None:  # a rollout places it on an arm; a shadow may copy it
            traffic.enter(ctx, raw, body, operation)
        return ctx

    async def serve(raw: Request, body, serving, prefix: str, operation: str) -> Response:
        response = await answer(raw, body, serving, prefix, operation)
        alias = aliases.get(getattr(body, "model", None))
        if alias is not None:  # a deprecated alias says so on every answer
            response.headers.update(alias.headers())
        if traffic is not None:  # which arm of a rollout answered
            response.headers.update(traffic.headers(raw.scope["state"].get("ctx")))
        return response

    async def create(raw: Request, body, serving, prefix: str, operation: str) -> Response:
        ctx = context(raw, prefix, body, operation)
        if ctx.route is None:
            return await serving.create(body, raw, ctx)
        return await traffic.run(ctx, body, lambda: serving.create(body, raw, ctx))

    async def answer(raw: Request, body, serving, prefix: str, operation: str) -> Response:
        key = raw.headers.get("idempotency-key")
        if key is None or body.stream:
            return await create(raw, body, serving, prefix, operation)
        fingerprint = hashlib.sha256(raw.url.path.encode() + b"\0" + await raw.body()).hexdigest()
        scope = raw.scope["state"]["tenant"].name
        return await idempotency.run(scope, key, fingerprint,
                                     lambda: create(raw, body, serving, prefix, operation))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Response:
        return await serve(raw, body, chat, "chatcmpl", "chat")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request) -> Response:
        return await serve(raw, body, completion, "cmpl", "text_completion")

    if runner is not None:
        add_batch_routes(app, runner.store, runner, policy.batch)

    add_lora_routes(app, engine, open_server=policy.keys is None)

    def model_rows() -> list[dict]:
        states = {m["id"]: m for m in host.model_states()} if host is not None else {}
        data = []
        for name in engine.model_names():
            m = engine.served(name)  # per model: tokenizer, limits, generation defaults
            row = {"id": name, "object": "model", "created": int(state.started), "owned_by": "tokenmill",
                   "parent": m.parent}  # a LoRA adapter's base model
            if name in states:  # loaded, loading, unloading or available; its memory
                row.update(states[name])
            else:
                row.update(max_model_len=m.max_model_len, state="loaded" if engine.running else "loading")
            # what a request that says nothing gets (the model's own, then the server's)
            row["generation_defaults"] = m.defaults.as_dict()
            # pin it by requesting this id (tokenmill models show NAME prints the manifest)
            row["snapshot"] = (snapshot if name == model_name else m.snapshot).id if m.snapshot is not None else None
            row.update(model_capabilities(m.embedding))  # generation or embeddings, how rerank is made
            data.append(row)
        return data

    @app.get("/v1/models")
    async def models() -> dict:
        out: dict = {"object": "list", "data": model_rows() + [a.as_dict() for a in aliases.values()]
                     + (traffic.model_rows() if traffic is not None else [])}
        if host is not None:
            out["memory_budget_bytes"] = host.budget
        return out

    if host is not None:
        add_model_routes(app, host, policy.keys is not None, model_rows)
    if traffic is not None:
        traffic.add_routes(app)

    @app.get("/health")
    async def health() -> Response:
        if engine.error is not None or engine.gave_up:
            return JSONResponse({"status": "engine failed", "error": str(engine.error),
                                 "restarting": not engine.gave_up}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/ready")
    async def ready() -> Response:
        ok = engine.running and not state.draining
        return JSONResponse({"ready": ok, "model": model_name}, status_code=200 if ok else 503)

    @app.get("/v1/stats")
    async def stats(raw: Request, window: float = 60.0) -> dict:
        if not 1.0 <= window <= telemetry.stats.horizon_s:
            raise APIError(400, f"window must be 1 to {telemetry.stats.horizon_s:.0f} seconds", param="window")
        known = {t.name: t for t in await policy.keys.tenants()} if policy.keys is not None else {}
        return stats_view(raw.scope["state"]["tenant"], window, known)

    def parent_of(name: str) -> str | None:
        try:
            return engine.served(name).parent
        except UnknownModel:  # an adapter unloaded since its requests
            return None

    def stats_view(tenant: Tenant, window: float, known: dict[str, Tenant]) -> dict:
        """An admin (or everyone, on an open server) sees the server and every tenant; a
        tenant sees its own traffic, usage and headroom."""
        admin = policy.keys is None or tenant.admin
        series, summary = telemetry.stats.series(None if admin else tenant.name, window)
        out: dict = {"object": "stats", "scope": "server" if admin else "tenant", "tenant": tenant.name,
                     "model": model_name, "time": time.time(), "uptime_s": time.time() - state.started,
                     "window": summary, "series": series}
        names = [tenant.name]
        if admin:
            out["engine"] = engine_block(engine.stats())
            out["totals"] = registry_totals(metrics, parent_of)
            names = sorted({*telemetry.stats.totals, *known} or {ANONYMOUS})
        rows = []
        for name in names:
            tot = telemetry.stats.totals.get(name)
            who = known.get(name) or (tenant if name == tenant.name else Tenant(name, policy.defaults))
            rows.append({"tenant": name, **(vars(tot) if tot is not None else vars(TenantTotals())),
                         "headroom": gate.headroom(who)})
        out["tenants"] = rows
        if runner is not None:
            out["batches"] = runner.store.status_counts(None if admin else tenant.name)
        if admin and traffic is not None and traffic.rollouts:  # (the console shows them)
            out["rollouts"] = traffic.status()["data"]
        if tuner is not None and admin:
            out["autotune"] = tuner.status()
        replicas = engine.replica_stats() if admin else None  # behind `tokenmill cluster serve`
        if replicas is not None:
            out["replicas"] = replicas
        return out

    add_console_routes(app, keys_required=policy.keys is not None)

    @app.get("/metrics")
    async def metrics_endpoint() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    app.add_middleware(Frontdoor, state=state, metrics=metrics, gate=gate, keys=policy.keys,
                       open_tenant=Tenant(ANONYMOUS, policy.defaults),
                       max_body_bytes=engine.bounds.max_body_bytes,
                       upload_bytes=policy.batch.max_file_bytes + (1 << 20) if runner is not None else None)
    add_dialect_routes(app, engine, chat, gate, serve, getattr(policy.batch_store, "root", None))
    return app


def _servings(engine: EngineClient, config: ServerConfig, metrics: Metrics) -> tuple[ServingChat, ServingCompletion]:
    """The default model's chat and completion serving objects, each knowing its siblings:
    one per model the engine serves, with that model's tokenizer and chat template (the
    --chat-template file replaces the default model's)."""
    chats: dict[str, BaseServing] = {}
    completions: dict[str, BaseServing] = {}
    for i, name in enumerate(engine.model_names()):
        tokenizer = engine.served(name).tokenizer
        if tokenizer is None:
            raise ValueError(f"the server needs a model with a tokenizer; {name!r} has none")
        if i == 0 and config.chat_template is not None:
            tokenizer = tokenizer.with_chat_template(config.chat_template)
        chat = chats[name] = ServingChat(engine, tokenizer, name, metrics)
        chat.reasoning = ChatReasoning.choose(config.reasoning_parser, tokenizer)
        completions[name] = ServingCompletion(engine, tokenizer, name, metrics)
    for family in (chats, completions):
        for serving in family.values():
            serving.siblings = family
    default = engine.model_names()[0]
    return chats[default], completions[default]


async def drain(app: FastAPI, timeout_s: float) -> None:
    """Stop admitting, give in-flight requests `timeout_s` to finish, abort the rest."""
    state: ServerState = app.state.server
    engine: EngineClient = app.state.engine
    state.draining = True
    deadline = time.monotonic() + timeout_s
    while state.inflight and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    if state.inflight:
        log.warning("shutdown deadline passed: aborting %d in-flight requests", state.inflight)
        engine.abort_all()
        end = time.monotonic() + 5.0
        while state.inflight and time.monotonic() < end:
            await asyncio.sleep(0.05)
