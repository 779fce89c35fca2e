"""Assemble the server from `ServeOptions` and run it under uvicorn with graceful shutdown.

`build_server(options)` makes everything `tokenmill serve` and `tokenmill cluster serve`
start: logging, tracing, the autotuner, the key store, the rate card, the Batch API's
store, the engine (local, or the cluster's replicas) and the app. A problem the user can
fix raises `OptionError` with the one line to print, before the model loads where it can.

On the first SIGTERM or SIGINT the server stops admitting (503), gives requests in
flight `shutdown_timeout_s` to finish, aborts the rest, then exits 0. A second
signal exits at once. If the engine dies too often to be restarted, the server exits
with status 3, for a supervisor to restart it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.util
import logging
import os
import signal
import sqlite3
import sys

import uvicorn
from fastapi import FastAPI

from tokenmill.config import EngineConfig
from tokenmill.engine.api import EngineClient
from tokenmill.server.app import ServerConfig, ServicePolicy, build_app, drain
from tokenmill.server.options import OptionError, ServeOptions

log = logging.getLogger("tokenmill.server")


class GracefulServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, app: FastAPI, shutdown_timeout_s: float):
        super().__init__(config)
        self._fastapi = app
        self._shutdown_timeout_s = shutdown_timeout_s
        self._draining = False
        self.exit_code = 0
        app.state.server.on_fatal = self._fatal

    def _fatal(self) -> None:
        log.critical("the engine cannot be restarted: exiting with status 3")
        self.exit_code = 3
        self.should_exit = True

    def handle_exit(self, sig: int, frame) -> None:  # type: ignore[override]
        if self._draining:
            super().handle_exit(sig, frame)
            return
        self._draining = True
        log.info("%s received: draining (deadline %.0fs)", signal.Signals(sig).name, self._shutdown_timeout_s)
        loop = asyncio.get_event_loop()
        loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._drain_then_exit()))

    async def _drain_then_exit(self) -> None:
        try:
            await drain(self._fastapi, self._shutdown_timeout_s)
        finally:
            self.should_exit = True


def build_server(options: ServeOptions) -> FastAPI:
    """The app `options` describe, its engine made (weights load when the app starts)."""
    from tokenmill.logs import configure_logging

    template = read_chat_template(options.chat_template) if options.chat_template is not None else None
    configure_logging(options.log_level, options.log_format)
    tracer_provider = _tracer_provider(options)
    autotune = _autotune(options)
    policy = _policy(options)
    engine = _engine(options)
    for name in engine.model_names():
        if engine.served(name).tokenizer is None:
            raise OptionError(f"the model {name!r} has no tokenizer; the server needs one")
    for name in policy.model_cards:
        if name not in engine.model_names():
            raise OptionError(f"--model-price-card: no model or adapter named {name!r} is served; served: "
                              f"{', '.join(engine.model_names())}")
    config = ServerConfig(host=options.host, port=options.port,
                          shutdown_timeout_s=options.shutdown_timeout, chat_template=template,
                          reasoning_parser=options.reasoning_parser, aliases=_aliases(options, engine),
                          traffic=_traffic(options, engine))
    policy.capture = _capture(options)
    return build_app(engine, config, policy, tracer_provider=tracer_provider, autotune=autotune)


def _aliases(options: ServeOptions, engine: EngineClient) -> tuple:
    from tokenmill.server.aliases import parse_alias

    try:
        aliases = tuple(parse_alias(a, engine.model_names()[0]) for a in options.model_alias or ())
    except ValueError as exc:
        raise OptionError(str(exc)) from None
    for a in aliases:
        if a.sunset is not None:
            log.warning("model alias %s (-> %s) is deprecated: it goes away on %s", a.name, a.target, a.sunset)
    return aliases


def _traffic(options: ServeOptions, engine: EngineClient):
    """The rollouts and shadows, checked against the served models (None: none, and none
    can be started: the server serves one model)."""
    if not options.rollout and not options.shadow and len(engine.model_names()) < 2:
        return None
    from tokenmill.server.rollouts import Thresholds, parse_rollout
    from tokenmill.server.shadow import parse_shadow
    from tokenmill.server.traffic import TrafficConfig

    served = engine.model_names()
    try:
        thresholds = Thresholds(options.rollout_error_margin, options.rollout_latency_margin,
                                options.rollout_min_requests, options.rollout_min_agreement,
                                options.rollout_promote_after, success_margin=options.rollout_success_margin)
        rollouts = tuple(parse_rollout(r, served) for r in options.rollout or ())
        names = [*served, *(a.split("=", 1)[0].strip() for a in options.model_alias or ()), *(r.name for r in rollouts)]
        if len(set(names)) < len(names):
            raise ValueError("each --rollout needs a name of its own (not another rollout's or an alias's)")
        shadows = tuple(parse_shadow(s, names, served) for s in options.shadow or ())
        if len({s.name for s in shadows}) < len(shadows):
            raise ValueError("one --shadow per name")
    except ValueError as exc:
        raise OptionError(str(exc)) from None
    return TrafficConfig(rollouts, shadows, thresholds, data_dir=options.data_dir)


def _capture(options: ServeOptions):
    """The capture policy (None: --capture off); its store opened now, so a bad path stops the start."""
    if options.capture == "off":
        return None
    from tokenmill.batch.storage import default_data_dir
    from tokenmill.server.capture import CapturePolicy, CaptureStore

    o = options
    path = o.capture_db or os.path.join(o.data_dir or default_data_dir(o.port), "captures.db")
    try:
        store = CaptureStore(path, retention_s=o.capture_retention_days * 86400,
                             max_bytes=int(o.capture_max_mb * 1e6))
    except (OSError, sqlite3.Error) as exc:
        raise OptionError(f"--capture: cannot open {path}: {exc}") from None
    log.info("capturing %s requests in %s", "every key's" if o.capture == "all" else "flagged keys'", path)
    return CapturePolicy(store, o.capture)


def read_chat_template(path: str) -> str:
    """The template file's text, compiled once here so that a missing or broken file stops
    the command before the model loads."""
    from jinja2 import TemplateError

    from tokenmill.model.tokenizer import ChatTemplate

    try:
        with open(path, encoding="utf-8") as f:
            source = f.read()
        ChatTemplate(source, None, None)
    except OSError as exc:
        raise OptionError(f"--chat-template: cannot read {path}: {exc.strerror}") from None
    except (TemplateError, UnicodeDecodeError) as exc:
        raise OptionError(f"--chat-template: {path} is not a valid Jinja template: {exc}") from None
    return source


def _tracer_provider(options: ServeOptions) -> object | None:
    if options.otlp_traces_endpoint is None:
        return None
    from tokenmill.server.telemetry import otlp_tracer_provider

    try:
        return otlp_tracer_provider(options.otlp_traces_endpoint)
    except ImportError as exc:
        raise OptionError(f"tracing needs the OpenTelemetry SDK and OTLP exporter ({exc}); pip install "
                          "'tokenmill[tracing]'") from None


def _autotune(options: ServeOptions):
    if options.slo_ttft_ms is None:
        return None
    from tokenmill.server.autotune import SLO, AutotuneConfig, Knobs

    o = options
    return AutotuneConfig(SLO(o.slo_ttft_ms / 1000, o.slo_itl_ms / 1000, o.slo_percentile),
                          Knobs(o.max_num_seqs, o.max_num_batched_tokens, o.decode_steps, o.max_waiting),
                          interval_s=o.autotune_interval, hold_s=o.autotune_hold)


def _policy(options: ServeOptions) -> ServicePolicy:
    """Keys, the tenants' default limits, admission, the rate card and the Batch API's store."""
    from tokenmill.batch.runner import BatchLimits
    from tokenmill.cost import CardError, load_cards, with_machine
    from tokenmill.server.gate import AdmissionConfig
    from tokenmill.server.key_cache import KeyCache
    from tokenmill.server.keys import KeyStore, TenantLimits

    o = options
    store = KeyStore(o.keys_db) if o.keys_db else None
    if store is None or not store.has_keys():
        if o.host not in ("127.0.0.1", "localhost", "::1") and not o.allow_open:
            raise OptionError(f"refusing to serve {o.host} without API keys: add keys (tokenmill keys add) and "
                              "pass --keys-db, or pass --allow-open to serve it open")
        log.warning("no API keys configured: the server is open to anyone who can reach %s:%d", o.host, o.port)
    keys = KeyCache(store, o.keys_cache_ttl) if store is not None else None
    try:
        card_set = load_cards(o.cards)
        if o.price_card not in card_set:
            raise OptionError(f"unknown rate card {o.price_card!r}; known: {', '.join(sorted(card_set))}")
        card = card_set[o.price_card]
        model_cards = {}
        for spec in o.model_price_card or ():
            name, sep, card_name = spec.partition("=")
            if not sep or not name or not card_name:
                raise OptionError(f"--model-price-card {spec!r}: expected NAME=CARD")
            if card_name not in card_set:
                raise OptionError(f"--model-price-card {spec!r}: unknown rate card {card_name!r}; known: "
                                  f"{', '.join(sorted(card_set))}")
            model_cards[name] = card_set[card_name]
        if o.usd_per_hour is not None:
            card = with_machine(card, usd_per_hour=o.usd_per_hour)
            model_cards = {n: with_machine(c, usd_per_hour=o.usd_per_hour) for n, c in model_cards.items()}
        defaults = TenantLimits(max_prompt_tokens=o.max_prompt_tokens, max_output_tokens=o.max_output_tokens,
                                max_work_tokens=o.max_work_tokens)
    except (CardError, ValueError) as exc:
        raise OptionError(str(exc)) from None
    batch_store = None
    if o.batch_api:
        from tokenmill.batch.storage import StoreLocked, default_data_dir
        from tokenmill.batch.store import BatchStore

        try:
            batch_store = BatchStore(o.data_dir or default_data_dir(o.port))
        except (StoreLocked, OSError) as exc:
            raise OptionError(f"{exc} (pass another --data-dir, or --no-batch-api)") from None
    alarm = None
    if o.spend_alarm_usd is not None:
        from tokenmill.cost.alarms import SpendAlarm

        try:
            alarm = SpendAlarm(o.spend_alarm_usd, o.spend_alarm_window, o.spend_alarm_block)
        except ValueError as exc:
            raise OptionError(f"--spend-alarm-usd/--spend-alarm-window: {exc}") from None
    return ServicePolicy(keys=keys, defaults=defaults, card=card, model_cards=model_cards, batch_store=batch_store,
                         server_alarm=alarm,
                         batch=BatchLimits(max_inflight=o.batch_inflight, max_lines=o.batch_max_lines,
                                           max_file_bytes=int(o.batch_max_file_mb * 1e6)),
                         admission=AdmissionConfig(max_waiting_interactive=o.max_waiting,
                                                   max_waiting_batch=o.max_waiting_batch))


def _engine(options: ServeOptions) -> EngineClient:
    from tokenmill.engine.factory import make_engine
    from tokenmill.model.config import ModelLoadError

    try:
        if options.several_models:
            return _cluster_models(options) if options.cluster else _models(options)
        config = options.engine_config()
        for name, path in config.lora.adapters:
            if not os.path.exists(path):
                raise OptionError(f"--lora {name}={path}: {path} does not exist")
        return _cluster_engine(options, config) if options.cluster else make_engine(config, options.engine_mode)
    except (ValueError, ModelLoadError) as exc:
        raise OptionError(str(exc)) from None


def _models(options: ServeOptions) -> EngineClient:
    """Several models: one engine process each, loaded on demand (tokenmill/engine/models.py)."""
    from tokenmill.engine.factory import make_models
    from tokenmill.server.limits import parse_keep_alive

    o = options
    budget = int(o.memory_budget * 1024 ** 3) if o.memory_budget is not None else None
    return make_models(o.engine_configs(), budget_bytes=budget, keep_alive=parse_keep_alive(o.keep_alive),
                       max_waiting=o.model_queue, preload=o.preload)


def _cluster_models(options: ServeOptions) -> EngineClient:
    """Several models behind the cluster's ingress: each its own Ray Serve application."""
    from tokenmill.cluster.models import ClusterModels

    configs = options.engine_configs()
    return ClusterModels([_cluster_engine(options, config, len(configs)) for config in configs])


def _cluster_engine(options: ServeOptions, config: EngineConfig, models: int = 1) -> EngineClient:
    if importlib.util.find_spec("ray") is None:
        raise OptionError("cluster serving needs Ray Serve: pip install 'tokenmill[cluster]'")
    from tokenmill.cluster.engine import ClusterEngine, ClusterOptions

    o = options
    if config.num_threads is None:  # the cores shared out, not every replica on all of them
        share = (os.cpu_count() or 1) // ((o.replica_count or o.max_replicas) * models)
        config = dataclasses.replace(config, num_threads=max(1, share))
    return ClusterEngine(config, ClusterOptions(
        replicas=o.replica_count, min_replicas=o.min_replicas, max_replicas=o.max_replicas,
        target_ongoing=o.target_ongoing, scale_down_delay_s=o.scale_down_delay, routing=o.routing,
        imbalance=o.imbalance, address=o.address, log_format=o.log_format))


def run_server(app: FastAPI, options: ServeOptions) -> None:
    """Serve `app` until a signal (exit 0 after the drain) or an engine that cannot be
    restarted (exit 3)."""
    from tokenmill.server.connections import ConnectionLimits, guarded_protocol

    # json logs: keep the root logger's handlers (JSON lines) for uvicorn's loggers too
    extra = {"log_config": None} if options.log_format == "json" else {}
    limits = ConnectionLimits(_room_for_connections(options.max_connections), options.header_timeout,
                              options.write_timeout, options.body_timeout)
    config = uvicorn.Config(app, host=options.host, port=options.port, log_level=options.log_level.lower(),
                            access_log=False, timeout_graceful_shutdown=5, lifespan="on",
                            http=guarded_protocol(limits, app.state.metrics.observe_cut), **extra)
    server = GracefulServer(config, app, options.shutdown_timeout)
    app.state.metrics.connections.set_function(lambda: len(server.server_state.connections))
    server.run()
    if server.exit_code:
        sys.exit(server.exit_code)


_FD_RESERVE = 256  # descriptors beside the connections: model files, SQLite, the engine's pipes, logs


def _room_for_connections(cap: int) -> int:
    """The connection cap the descriptor limit allows, raising the soft limit toward the
    hard one first: a process out of descriptors cannot accept at all, so the cap (which
    closes idle connections to admit new ones) must bind before the limit does."""
    import resource

    want = cap + _FD_RESERVE
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < want:
        soft = want if hard == resource.RLIM_INFINITY else min(want, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    if soft != resource.RLIM_INFINITY and soft < want:
        log.warning("--max-connections %d lowered to %d: the descriptor limit is %d", cap,
                    max(1, soft - _FD_RESERVE), soft)
        return max(1, soft - _FD_RESERVE)
    return cap
