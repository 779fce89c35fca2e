"""The `tokenmill` command: serve, generate, chat, bench, cost, keys.

Thin: parse options into config objects and hand over. Heavy imports happen inside
each command so `tokenmill --help` stays fast.
"""

from __future__ import annotations

import sys
import uuid
from typing import Optional

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="tokenmill: a fast, metered, protected OpenAI-compatible LLM server.")

MODEL_HELP = ("GGUF file, Hugging Face folder, or an installed model's name (tokenmill models list; default: the "
              "embedded SmolLM2-135M-Instruct).")
DTYPE_HELP = ("Compute dtype: float32 or bfloat16 (default). --dtype float32 alone is the exact mode "
              "(no quantization); quantized weights compute in bfloat16.")
QUANT_HELP = ("Weight-only quantization: auto, none, int8 or int4 (bfloat16 compute). The default, auto, keeps "
              "the file's blocks: int8 for a Q8_0 file, int4 for 4-bit ones and for float weights (the fastest "
              "setting within 1% perplexity of float32, see benchmarks/quality.py), and in a 4-bit file its "
              "Q5_0 blocks as Q5_0 and its 6-8-bit ones (Q6_K, Q8_0) at 8 bits; int4 rounds every layer to 4 "
              "bits (faster, less faithful); with --dtype float32 the default is none.")
DEFAULT_DTYPE = "bfloat16"
DEFAULT_QUANT = "auto"


def resolve_precision(dtype: Optional[str], quantization: Optional[str]) -> tuple[str, str]:
    """The (dtype, quantization) the flags ask for: a flag the user set does what it says,
    or the command refuses it. Quantized weights compute in bfloat16, so float32 means
    no quantization unless one is asked for (which is refused)."""
    if dtype is not None and dtype not in ("float32", "bfloat16"):
        _fail(f"--dtype must be float32 or bfloat16, got {dtype!r}")
    if quantization is not None and quantization not in ("auto", "none", "int8", "int4"):
        _fail(f"--quantization must be auto, none, int8 or int4, got {quantization!r}")
    if dtype == "float32":
        if quantization not in (None, "none"):
            _fail(f"--quantization {quantization} computes in bfloat16, so it cannot run with --dtype float32; "
                  "drop one of the two")
        return "float32", "none"
    return dtype or DEFAULT_DTYPE, quantization or DEFAULT_QUANT


def _fail(message: str) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code=2)


_CLUSTER_ONLY = ("replicas", "min_replicas", "max_replicas", "target_ongoing", "scale_down_delay", "routing",
                 "imbalance", "address")


def _command(func, drop: tuple[str, ...], doc: str, **fixed):
    """A typer command with `func`'s options less `drop` (and the internal ones, given
    by `fixed`): `serve` and `cluster serve` share one definition of every option."""
    import functools
    import inspect

    sig = inspect.signature(func)
    gone = set(drop) | set(fixed)
    for p in sig.parameters.values():  # a dropped option takes its default
        if p.name in drop and p.name not in fixed:
            fixed[p.name] = getattr(p.default, "default", p.default)

    @functools.wraps(func)
    def command(**kwargs):
        return func(**kwargs, **fixed)

    command.__signature__ = sig.replace(parameters=[p for p in sig.parameters.values() if p.name not in gone])
    command.__annotations__ = {k: v for k, v in func.__annotations__.items() if k not in gone}
    command.__doc__ = doc
    return command


def _cluster_engine(config, replicas: str, min_replicas: int, max_replicas: int, target_ongoing: float,
                    scale_down_delay: float, routing: str, imbalance: int, address: Optional[str], log_format: str):
    import dataclasses
    import importlib.util
    import os

    if importlib.util.find_spec("ray") is None:
        _fail("cluster serving needs Ray Serve: pip install 'tokenmill[cluster]'")
    from tokenmill.cluster.engine import ClusterEngine, ClusterOptions
    from tokenmill.cluster.routing import POLICIES

    if routing not in POLICIES:
        _fail(f"--routing must be one of {', '.join(POLICIES)}, got {routing!r}")
    if replicas == "auto":
        count = None
        if not 1 <= min_replicas <= max_replicas or target_ongoing <= 0 or scale_down_delay < 0:
            _fail("--replicas auto needs 1 <= --min-replicas <= --max-replicas, a positive --target-ongoing and "
                  "a --scale-down-delay of 0 or more")
    elif replicas.isdigit() and int(replicas) >= 1:
        count = int(replicas)
    else:
        _fail(f"--replicas must be a positive number or auto, got {replicas!r}")
    if imbalance < 0:
        _fail("--imbalance must be 0 or more")
    if config.num_threads is None:  # the cores shared out, not every replica on all of them
        config = dataclasses.replace(config, num_threads=max(1, (os.cpu_count() or 1) // (count or max_replicas)))
    return ClusterEngine(config, ClusterOptions(replicas=count, min_replicas=min_replicas, max_replicas=max_replicas,
                                                target_ongoing=target_ongoing, scale_down_delay_s=scale_down_delay,
                                                routing=routing, imbalance=imbalance,
                                                address=address, log_format=log_format))


def engine_config(model: Optional[str], dtype: str, quantization: str, kv_cache_gb: Optional[float],
                  max_num_seqs: int, max_num_batched_tokens: int, max_model_len: Optional[int], block_size: int,
                  enable_prefix_caching: bool, num_threads: Optional[int], decode_steps: int = 8,
                  kv_cache_dtype: str = "auto", max_n: int = 16, max_body_mb: float = 8.0,
                  batch_share: float = 0.05, batch_step_tokens: int = 16, speculative: str = "off",
                  num_speculative_tokens: int = 5, kv_disk_dir: Optional[str] = None, kv_disk_gb: float = 10.0,
                  kv_disk_write_through: bool = True):
    from tokenmill.engine.api import (CacheConfig, EngineConfig, ModelOptions, RequestBounds, SchedulerConfig,
                                      SpeculativeConfig)
    from tokenmill.model.registry import resolve

    model = resolve(model)  # a known model's name becomes its installed file

    return EngineConfig(
        model=ModelOptions(path=model, dtype=dtype, quantization=quantization),
        cache=CacheConfig(block_size=block_size, kv_cache_gb=kv_cache_gb,
                          enable_prefix_caching=enable_prefix_caching, kv_cache_dtype=kv_cache_dtype,
                          kv_disk_dir=kv_disk_dir, kv_disk_gb=kv_disk_gb,
                          kv_disk_write_through=kv_disk_write_through),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                  decode_steps=decode_steps, batch_share=batch_share,
                                  batch_step_tokens=batch_step_tokens,
                                  speculative=SpeculativeConfig(method=speculative,
                                                                num_speculative_tokens=num_speculative_tokens)),
        max_model_len=max_model_len,
        num_threads=num_threads,
        bounds=RequestBounds(max_n=max_n, max_body_bytes=int(max_body_mb * 1024 * 1024)),
    )


def _cli_engine(model: Optional[str], dtype: Optional[str], quantization: Optional[str]):
    """An engine for the terminal commands: metadata checked now (one-line errors), weights
    loaded on the engine thread when it starts."""
    dtype, quantization = resolve_precision(dtype, quantization)
    from tokenmill.engine.factory import make_engine
    from tokenmill.model.config import ModelLoadError

    try:
        engine = make_engine(engine_config(model, dtype, quantization, 0.5, 8, 512, None, 16, True, None), "thread")
    except (ValueError, ModelLoadError) as exc:
        _fail(str(exc))
    if engine.tokenizer is None:
        _fail("this model has no tokenizer (tokenizer.json); cannot encode a text prompt")
    return engine


async def _start(engine) -> None:
    try:
        await engine.start()
    except RuntimeError as exc:
        _fail(str(exc))


def _serve(
    model: Optional[str] = typer.Option(None, "--model", help=MODEL_HELP),
    dtype: Optional[str] = typer.Option(None, "--dtype", help=DTYPE_HELP),
    quantization: Optional[str] = typer.Option(None, "--quantization", help=QUANT_HELP),
    host: str = typer.Option("127.0.0.1", "--host"),
    port: int = typer.Option(8000, "--port"),
    served_model_name: Optional[str] = typer.Option(None, "--served-model-name",
                                                    help="Model id to serve (default: the model's name)."),
    chat_template: Optional[str] = typer.Option(
        None, "--chat-template", help="A Jinja chat template file to use instead of the model's own (as "
                                      "transformers renders it; one that mentions `tools` gets the request's "
                                      "tools and tool calls as they are)."),
    kv_cache_gb: Optional[float] = typer.Option(None, "--kv-cache-gb",
                                                help="KV cache size (default: 1/4 of free memory, max 2 GiB)."),
    kv_cache_dtype: str = typer.Option("auto", "--kv-cache-dtype",
                                       help="auto: the model's dtype; int8: K/V rows in int8 with a scale each "
                                            "(half of bf16's bytes, +0.26% perplexity)."),
    kv_disk_dir: Optional[str] = typer.Option(
        None, "--kv-disk-dir",
        help="Keep prefix-cache blocks in files under this directory (one server per directory): a prompt "
             "whose prefix left memory, or came before a restart, reads it back instead of recomputing it."),
    kv_disk_gb: float = typer.Option(10.0, "--kv-disk-gb", help="Most GiB of block files in --kv-disk-dir "
                                                                "(least recently used go first)."),
    kv_disk_write_through: bool = typer.Option(
        True, "--kv-disk-write-through/--kv-disk-write-on-evict",
        help="Write every block to --kv-disk-dir as it is computed (in the background; a restart finds it), "
             "or only when memory evicts it."),
    max_num_seqs: int = typer.Option(64, "--max-num-seqs", help="Most sequences in one step."),
    max_num_batched_tokens: int = typer.Option(512, "--max-num-batched-tokens", help="Token budget per step."),
    decode_steps: int = typer.Option(8, "--decode-steps",
                                     help="Greedy decode steps run natively in one go, shared among the "
                                          "sequences (tokens stream in bursts); 1: one step at a time."),
    max_model_len: Optional[int] = typer.Option(None, "--max-model-len", help="Context window (default: model's)."),
    block_size: int = typer.Option(16, "--block-size", help="Tokens per KV block."),
    prefix_caching: bool = typer.Option(True, "--prefix-caching/--no-prefix-caching"),
    num_threads: Optional[int] = typer.Option(None, "--num-threads", help="Torch threads (default: all cores)."),
    shutdown_timeout: float = typer.Option(30.0, "--shutdown-timeout",
                                           help="Seconds in-flight requests get to finish on SIGTERM."),
    keys_db: Optional[str] = typer.Option(None, "--keys-db", help="Enforce API keys from this SQLite file."),
    allow_open: bool = typer.Option(False, "--allow-open",
                                    help="Allow a non-loopback --host without API keys (anyone can use it)."),
    max_prompt_tokens: Optional[int] = typer.Option(None, "--max-prompt-tokens",
                                                    help="Default per-request prompt cap."),
    max_output_tokens: Optional[int] = typer.Option(None, "--max-output-tokens",
                                                    help="Default per-request output cap (ends with 'length')."),
    max_work_tokens: Optional[int] = typer.Option(None, "--max-work-tokens",
                                                  help="Default per-request cap on prompt + output tokens."),
    max_waiting: int = typer.Option(256, "--max-waiting", help="Interactive requests that may wait; then 503."),
    max_n: int = typer.Option(16, "--max-n", help="Most samples (n, best_of) one request may ask for."),
    max_body_mb: float = typer.Option(8.0, "--max-body-mb", help="Largest request body in MiB; larger: 413."),
    max_waiting_batch: int = typer.Option(4096, "--max-waiting-batch", help="Batch requests that may wait."),
    price_card: str = typer.Option("tokenmill-default", "--price-card", help="Rate card for usage.cost."),
    cards: Optional[str] = typer.Option(None, "--cards", help="Rate card file or folder (default: shipped)."),
    usd_per_hour: Optional[float] = typer.Option(None, "--usd-per-hour",
                                                 help="This machine's cost, for a self-hosted card."),
    data_dir: Optional[str] = typer.Option(None, "--data-dir",
                                           help="Where Batch API files and batches are kept (default: "
                                                "~/.local/share/tokenmill/server-PORT)."),
    batch_api: bool = typer.Option(True, "--batch-api/--no-batch-api", help="Serve /v1/files and /v1/batches."),
    batch_inflight: int = typer.Option(16, "--batch-inflight",
                                       help="Batch lines handed to the engine at once (it runs them after "
                                            "interactive work)."),
    batch_max_lines: int = typer.Option(50_000, "--batch-max-lines", help="Most requests in one batch file."),
    batch_max_file_mb: float = typer.Option(200.0, "--batch-max-file-mb", help="Largest batch file in MB."),
    batch_share: float = typer.Option(0.05, "--batch-share",
                                      help="While interactive requests run, batch requests get this share of "
                                           "the tokens steps process (so they never starve)."),
    batch_step_tokens: int = typer.Option(16, "--batch-step-tokens",
                                          help="With no interactive work, the most tokens of a batch-only step "
                                               "(an interactive request that arrives waits for it)."),
    speculative: str = typer.Option("off", "--speculative",
                                    help="Speculative decoding from text: ngram (drafts from the request's own "
                                         "prompt and output), suffix (and from the same tenant's recent outputs) "
                                         "or off. The output is the same; drafts are checked in one step and "
                                         "turned down per request where they miss."),
    num_speculative_tokens: int = typer.Option(5, "--num-speculative-tokens",
                                               help="Most drafts one request gets in one step."),
    engine_mode: str = typer.Option("process", "--engine",
                                    help="Where the step loop runs: process (a child process; measured faster) or thread."),
    log_level: str = typer.Option("info", "--log-level"),
    log_format: str = typer.Option("text", "--log-format",
                                   help="text, or json: one JSON object per line with request and trace ids, "
                                        "and a line per finished request."),
    otlp_traces_endpoint: Optional[str] = typer.Option(
        None, "--otlp-traces-endpoint",
        help="Send a span per request (OpenTelemetry GenAI attributes) to this OTLP/HTTP endpoint, e.g. "
             "http://localhost:4318/v1/traces; an incoming W3C traceparent becomes its parent."),
    slo_ttft_ms: Optional[float] = typer.Option(
        None, "--slo-ttft-ms",
        help="Time-to-first-token objective; with --slo-itl-ms the server tunes --max-num-seqs, "
             "--max-num-batched-tokens, --decode-steps and --max-waiting (as upper bounds) while it runs, "
             "to maximize the requests meeting both."),
    slo_itl_ms: Optional[float] = typer.Option(None, "--slo-itl-ms",
                                               help="Inter-token latency objective (each request's mean)."),
    slo_percentile: float = typer.Option(90.0, "--slo-percentile",
                                         help="The percentile of requests the objectives are judged at."),
    autotune_interval: float = typer.Option(2.0, "--autotune-interval", help="Seconds between tuning decisions."),
    autotune_hold: float = typer.Option(20.0, "--autotune-hold",
                                        help="Seconds a knob lowered for a violation is not raised again "
                                             "(doubled each time a raise of it had to be taken back)."),
    replicas: str = typer.Option("2", "--replicas",
                                 help="Engine replicas: a number, or auto (Ray Serve autoscaling between "
                                      "--min-replicas and --max-replicas)."),
    min_replicas: int = typer.Option(1, "--min-replicas", help="With --replicas auto: the fewest replicas."),
    max_replicas: int = typer.Option(4, "--max-replicas", help="With --replicas auto: the most replicas."),
    target_ongoing: float = typer.Option(8.0, "--target-ongoing",
                                         help="With --replicas auto: requests in flight per replica to scale "
                                              "toward (running plus waiting)."),
    scale_down_delay: float = typer.Option(30.0, "--scale-down-delay",
                                           help="With --replicas auto: seconds the load must stay below the "
                                                "target before a replica is removed (it drains first)."),
    routing: str = typer.Option("affinity", "--routing",
                                help="affinity (prefix-cache affinity with a load guard), round_robin or p2c "
                                     "(power of two choices)."),
    imbalance: int = typer.Option(4, "--imbalance",
                                  help="Load guard: requests a prompt's preferred replica may have above the "
                                       "least busy one before the request goes to the least busy."),
    address: Optional[str] = typer.Option(None, "--address",
                                          help="Join this Ray cluster (e.g. auto, or HOST:6379) instead of "
                                               "starting a local one."),
    cluster: bool = False,
) -> None:
    """Serve the OpenAI-compatible API (default: the embedded model on 127.0.0.1:8000)."""
    import logging

    from tokenmill.cost import CardError, load_cards, with_machine
    from tokenmill.engine.factory import ENGINE_MODES, make_engine
    from tokenmill.model.config import ModelLoadError
    from tokenmill.server.app import ServerConfig, ServicePolicy, build_app
    from tokenmill.server.gate import AdmissionConfig
    from tokenmill.server.keys import KeyStore, TenantLimits
    from tokenmill.server.launch import run_server
    from tokenmill.logs import configure_logging
    from tokenmill.server.telemetry import otlp_tracer_provider

    if log_format not in ("text", "json"):
        _fail(f"--log-format must be text or json, got {log_format!r}")
    template_source = _read_chat_template(chat_template) if chat_template is not None else None
    configure_logging(log_level, log_format)
    log = logging.getLogger("tokenmill.server")
    tracer_provider = None
    if otlp_traces_endpoint is not None:
        if not otlp_traces_endpoint.startswith(("http://", "https://")):
            _fail(f"--otlp-traces-endpoint must be an http(s) URL, got {otlp_traces_endpoint!r}")
        try:
            tracer_provider = otlp_tracer_provider(otlp_traces_endpoint)
        except ImportError as exc:
            _fail(f"tracing needs the OpenTelemetry SDK and OTLP exporter ({exc}); pip install "
                  "'tokenmill[tracing]'")
    autotune = None
    if (slo_ttft_ms is None) != (slo_itl_ms is None):
        _fail("give both --slo-ttft-ms and --slo-itl-ms (the tuner balances the two)")
    if slo_ttft_ms is not None:
        if not (slo_ttft_ms > 0 and slo_itl_ms > 0 and 50 <= slo_percentile < 100 and autotune_interval > 0
                and autotune_hold >= 0):
            _fail("--slo-ttft-ms, --slo-itl-ms and --autotune-interval must be positive and --slo-percentile "
                  "in [50, 100)")
        from tokenmill.server.autotune import SLO, AutotuneConfig, Knobs

        autotune = AutotuneConfig(SLO(slo_ttft_ms / 1000, slo_itl_ms / 1000, slo_percentile),
                                  Knobs(max_num_seqs, max_num_batched_tokens, decode_steps, max_waiting),
                                  interval_s=autotune_interval, hold_s=autotune_hold)
    keys = KeyStore(keys_db) if keys_db else None
    loopback = host in ("127.0.0.1", "localhost", "::1")
    if keys is None or not keys.has_keys():
        if not loopback and not allow_open:
            _fail(f"refusing to serve {host} without API keys: add keys (tokenmill keys add) and pass "
                  "--keys-db, or pass --allow-open to serve it open")
        log.warning("no API keys configured: the server is open to anyone who can reach %s:%d", host, port)
    try:
        card_set = load_cards(cards)
        if price_card not in card_set:
            _fail(f"unknown rate card {price_card!r}; known: {', '.join(sorted(card_set))}")
        card = card_set[price_card]
        if usd_per_hour is not None:
            card = with_machine(card, usd_per_hour=usd_per_hour)
        defaults = TenantLimits(max_prompt_tokens=max_prompt_tokens, max_output_tokens=max_output_tokens,
                                max_work_tokens=max_work_tokens)
    except (CardError, ValueError) as exc:
        _fail(str(exc))
    from tokenmill.batch.runner import BatchLimits

    batch_store = None
    if batch_api:
        from tokenmill.batch.store import BatchStore, StoreLocked, default_data_dir

        try:
            batch_store = BatchStore(data_dir or default_data_dir(port))
        except (StoreLocked, OSError) as exc:
            _fail(f"{exc} (pass another --data-dir, or --no-batch-api)")
        if batch_inflight < 1 or batch_max_lines < 1 or batch_max_file_mb <= 0:
            _fail("--batch-inflight, --batch-max-lines and --batch-max-file-mb must be positive")
    policy = ServicePolicy(keys=keys, defaults=defaults, card=card, batch_store=batch_store,
                           batch=BatchLimits(max_inflight=batch_inflight, max_lines=batch_max_lines,
                                             max_file_bytes=int(batch_max_file_mb * 1e6)),
                           admission=AdmissionConfig(max_waiting_interactive=max_waiting,
                                                     max_waiting_batch=max_waiting_batch))
    try:
        dtype, quantization = resolve_precision(dtype, quantization)
        config = engine_config(model, dtype, quantization, kv_cache_gb, max_num_seqs, max_num_batched_tokens,
                               max_model_len, block_size, prefix_caching, num_threads, decode_steps,
                               kv_cache_dtype, max_n, max_body_mb, batch_share, batch_step_tokens,
                               speculative, num_speculative_tokens, kv_disk_dir, kv_disk_gb,
                               kv_disk_write_through)
    except (ValueError, ModelLoadError) as exc:
        _fail(str(exc))
    if engine_mode not in ENGINE_MODES:
        _fail(f"--engine must be one of {', '.join(ENGINE_MODES)}, got {engine_mode!r}")
    try:
        engine = _cluster_engine(config, replicas, min_replicas, max_replicas, target_ongoing, scale_down_delay,
                                 routing, imbalance, address, log_format) if cluster else make_engine(config,
                                                                                                       engine_mode)
    except (ValueError, ModelLoadError) as exc:
        _fail(str(exc))
    if engine.tokenizer is None:
        _fail("this model has no tokenizer; the server needs one")
    server_config = ServerConfig(host=host, port=port, served_model_name=served_model_name,
                                 shutdown_timeout_s=shutdown_timeout, chat_template=template_source)
    app_ = build_app(engine, server_config, policy, tracer_provider=tracer_provider, autotune=autotune)
    run_server(app_, host, port, shutdown_timeout, log_level.lower(), own_logging=log_format == "json")


def _read_chat_template(path: str) -> str:
    """The template file's text, compiled once here so that a missing or broken file stops
    the command before the model loads."""
    from jinja2 import TemplateError

    from tokenmill.model.tokenizer import ChatTemplate

    try:
        with open(path, encoding="utf-8") as f:
            source = f.read()
        ChatTemplate(source, None, None)
    except OSError as exc:
        _fail(f"--chat-template: cannot read {path}: {exc.strerror}")
    except (TemplateError, UnicodeDecodeError) as exc:
        _fail(f"--chat-template: {path} is not a valid Jinja template: {exc}")
    return source


serve = app.command("serve")(_command(
    _serve, _CLUSTER_ONLY, "Serve the OpenAI-compatible API (default: the embedded model on 127.0.0.1:8000).",
    cluster=False))
cluster_app = typer.Typer(no_args_is_help=True)
cluster_app.command("serve")(_command(
    _serve, ("engine_mode", "slo_ttft_ms", "slo_itl_ms", "slo_percentile", "autotune_interval", "autotune_hold"),
    "Serve the same API from engine replicas on Ray Serve, behind this process as the ingress (keys, limits, "
    "pricing and metrics here; prefix-affinity routing to the replicas). Needs tokenmill[cluster].",
    cluster=True))


@app.command()
def generate(
    prompt: str = typer.Argument(..., help="The prompt text."),
    max_tokens: int = typer.Option(128, "--max-tokens", help="Most tokens to generate."),
    temperature: float = typer.Option(0.0, "--temperature", help="0 = greedy."),
    top_p: float = typer.Option(1.0, "--top-p"),
    seed: Optional[int] = typer.Option(None, "--seed", help="Seed for reproducible sampling."),
    chat: bool = typer.Option(False, "--chat", help="Wrap PROMPT as one user message via the chat template."),
    model: Optional[str] = typer.Option(None, "--model", help=MODEL_HELP),
    dtype: Optional[str] = typer.Option(None, "--dtype", help=DTYPE_HELP),
    quantization: Optional[str] = typer.Option(None, "--quantization", help=QUANT_HELP),
) -> None:
    """Generate a continuation of PROMPT and print only the generated text."""
    import asyncio

    from tokenmill.engine.api import InvalidParameter, SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed)
    engine = _cli_engine(model, dtype, quantization)
    tok = engine.tokenizer
    if chat:
        if tok.chat_template is None:
            _fail("this model has no chat template; drop --chat")
        ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": prompt}]),
                         add_special_tokens=False)
    else:
        ids = tok.encode(prompt)

    async def run() -> None:
        await _start(engine)
        try:
            try:
                stream = engine.generate(uuid.uuid4().hex, ids, params)
            except (InvalidParameter, ValueError) as exc:
                _fail(str(exc))
            async for out in stream:
                sys.stdout.write(out.text)
                sys.stdout.flush()
        finally:
            await engine.stop()
        sys.stdout.write("\n")

    asyncio.run(run())


@app.command()
def chat(
    model: Optional[str] = typer.Option(None, "--model", help=MODEL_HELP),
    dtype: Optional[str] = typer.Option(None, "--dtype", help=DTYPE_HELP),
    quantization: Optional[str] = typer.Option(None, "--quantization", help=QUANT_HELP),
    system: Optional[str] = typer.Option(None, "--system", help="A system message."),
    max_tokens: int = typer.Option(512, "--max-tokens"),
    temperature: float = typer.Option(0.7, "--temperature"),
) -> None:
    """Interactive chat in the terminal (empty line or Ctrl-D to quit)."""
    import asyncio

    from tokenmill.engine.api import SamplingParams

    engine = _cli_engine(model, dtype, quantization)
    tok = engine.tokenizer
    if tok.chat_template is None:
        _fail("this model has no chat template")
    messages: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []

    async def run() -> None:
        await _start(engine)
        try:
            while True:
                try:
                    line = await asyncio.to_thread(input, "you> ")
                except EOFError:
                    break
                if not line.strip():
                    break
                messages.append({"role": "user", "content": line})
                ids = tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)
                params = SamplingParams(max_tokens=max_tokens, temperature=temperature)
                sys.stdout.write("assistant> ")
                reply = ""
                async for out in engine.generate(uuid.uuid4().hex, ids, params):
                    reply += out.text
                    sys.stdout.write(out.text)
                    sys.stdout.flush()
                sys.stdout.write("\n")
                messages.append({"role": "assistant", "content": reply})
        finally:
            await engine.stop()

    asyncio.run(run())


@app.command()
def doctor(
    no_build: bool = typer.Option(False, "--no-build", help="Only report; do not build missing kernels."),
) -> None:
    """Check this machine: CPU features, active paths, and the native kernels (built if missing)."""
    from tokenmill.doctor import run_doctor

    raise typer.Exit(code=run_doctor(build=not no_build))


from tokenmill.cost.cli import cost_app  # noqa: E402  (light: typer and the stdlib only)

from tokenmill.bench.cli import bench  # noqa: E402  (HTTP only: no torch import)
from tokenmill.server.keys_cli import keys_app  # noqa: E402
from tokenmill.batch.cli import batch_app  # noqa: E402  (HTTP only)
from tokenmill.model.models_cli import models_app  # noqa: E402  (no torch)

app.command("bench", help="Load-test any OpenAI-compatible server and report latency, throughput, goodput.")(bench)
app.add_typer(cost_app, name="cost", help="Price requests, estimate workloads, cost self-hosting.")
app.add_typer(keys_app, name="keys", help="Manage tenants and API keys.")
app.add_typer(batch_app, name="batch", help="Submit and follow Batch API jobs (OpenAI's /v1/batches).")
app.add_typer(models_app, name="models", help="Install and list models (a name for --model).")
app.add_typer(cluster_app, name="cluster", help="Scale out: engine replicas on Ray Serve behind one ingress.")


def main() -> None:  # pragma: no cover
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
