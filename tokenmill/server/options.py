"""`ServeOptions`: every option of `tokenmill serve` and `tokenmill cluster serve`, in one
frozen object, checked once when it is made.

Each field is the whole definition of its option: default, flag and help. The CLI
builds both commands' flags from these fields (tokenmill/cli.py), so an option is added
in one place; `only` marks the few that belong to one of the two commands. What can be
checked without touching the machine (value ranges, pairs, the engine's own config
checks) is checked here and refused with `OptionError`, a one-line message naming the
flag; what needs the disk or the network (the key store, rate cards, the data dir, the
model file) is checked by the launcher (tokenmill/server/launch.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from tokenmill.cluster.routing import POLICIES
from tokenmill.config import (DEFAULT_MAX_TOKENS, CacheConfig, EngineConfig, LoraConfig, ModelOptions,
                              RequestBounds, SchedulerConfig, SpeculativeConfig)
from tokenmill.engine.factory import ENGINE_MODES
from tokenmill.server.limits import parse_keep_alive

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
LOG_FORMATS = ("text", "json")


class OptionError(ValueError):
    """An option the server cannot run with; the message is the one line the CLI prints."""


def precision(dtype: str | None, quantization: str | None) -> tuple[str, str]:
    """The (dtype, quantization) the flags ask for: a flag the user set does what it says,
    or it is refused. Quantized weights compute in bfloat16, so float32 means no
    quantization unless one is asked for (which is refused)."""
    if dtype is not None and dtype not in ("float32", "bfloat16"):
        raise OptionError(f"--dtype must be float32 or bfloat16, got {dtype!r}")
    if quantization is not None and quantization not in ("auto", "none", "int8", "int4"):
        raise OptionError(f"--quantization must be auto, none, int8 or int4, got {quantization!r}")
    if dtype == "float32":
        if quantization not in (None, "none"):
            raise OptionError(f"--quantization {quantization} computes in bfloat16, so it cannot run with "
                              "--dtype float32; drop one of the two")
        return "float32", "none"
    return dtype or DEFAULT_DTYPE, quantization or DEFAULT_QUANT


def option(default, flags: str, help: str | None = None, only: str | None = None):
    """A field that is a command-line option. `flags`: as click spells them ("--x" or
    "--x/--no-x"); `only`: "serve" or "cluster" for an option of one command alone."""
    return field(default=default, metadata={"flags": flags, "help": help, "only": only})


@dataclass(frozen=True, kw_only=True)
class ServeOptions:
    model: list[str] | None = option(None, "--model", MODEL_HELP + " Repeat it to serve several models (the "
                                     "first is the default): serve loads each on its first request (see "
                                     "--preload); cluster serve deploys each as replicas of its own.")
    models_dir: str | None = option(None, "--models-dir", "Serve every model in this folder too (each GGUF file "
                                                          "and Hugging Face folder in it), loaded on demand.",
                                    only="serve")
    preload: bool = option(False, "--preload", "With several models: load them at start (in order, while they fit "
                                               "the memory budget) instead of on their first request.", only="serve")
    memory_budget: float | None = option(
        None, "--memory-budget", "With several models: GB of memory for the weights and KV caches of the loaded "
                                 "models (default: 80% of the memory available at start); idle models are unloaded "
                                 "to make room.", only="serve")
    keep_alive: str = option("5m", "--keep-alive", "With several models: how long an idle model stays loaded "
                                                   "(seconds or 5m, 1h; 0: unload after each request; -1: never). A "
                                                   "request's keep_alive field overrides it.", only="serve")
    model_queue: int = option(64, "--model-queue", "With several models: requests that may wait for one model to "
                                                   "load; more are refused (503).", only="serve")
    dtype: str | None = option(None, "--dtype", DTYPE_HELP)
    quantization: str | None = option(None, "--quantization", QUANT_HELP)
    activation_levels: int | None = option(
        None, "--activation-levels", "int8 levels of the quantized layers' inputs: 2 (~16 bits) or 1 (llama.cpp's "
        "class; ~1.5x at 16 streams). Default: the model's install recipe says (1 for qwen2.5-coder-1.5b), else 2.")
    host: str = option("127.0.0.1", "--host")
    port: int = option(8000, "--port")
    max_connections: int = option(2048, "--max-connections",
                                  "Open connections; past it a new one closes the longest-idle one (none idle: 503).")
    header_timeout: float = option(10.0, "--header-timeout",
                                   "Seconds a connection has to send a request's headers (then 408 and closed).")
    write_timeout: float = option(
        30.0, "--write-timeout", "Seconds a response may wait on a client that reads nothing (its send buffer full) "
                                 "before the connection is dropped and its request aborted.")
    body_timeout: float = option(
        30.0, "--body-timeout", "Seconds a request's body has to arrive after its headers, plus one for every 64 KiB "
                                "received (a trickle is cut, a large upload on a slow link is not; an idle-gap bound "
                                "would let a byte every few seconds hold a connection forever); then 408 and closed.")
    served_model_name: str | None = option(None, "--served-model-name",
                                           "Model id to serve (default: the model's name).")
    lora: list[str] | None = option(
        None, "--lora", "A LoRA adapter of the model as NAME=PATH (a PEFT folder, or a llama.cpp LoRA GGUF): "
                        "requests name it as their model; repeat for more. Requests on adapters and on the model "
                        "share batches.", only="serve")
    max_loras: int | None = option(
        None, "--max-loras", "LoRA adapters resident at once; the least recently used idle one makes room for "
                             "another (default: 4 with --lora, else 0: adapters off, none may be loaded).",
        only="serve")
    max_lora_rank: int = option(64, "--max-lora-rank", "The highest LoRA rank an adapter may have.", only="serve")
    chat_template: str | None = option(
        None, "--chat-template", "A Jinja chat template file to use instead of the model's own (as transformers "
                                 "renders it; one that mentions `tools` gets the request's tools and tool calls "
                                 "as they are).")
    reasoning_parser: str | None = option(
        None, "--reasoning-parser", "Split <think>...</think> from the answer into reasoning_content: deepseek_r1 (the "
                                    "reply thinks from its first token), qwen3 (it thinks if it opens <think>), or none; "
                                    "default: qwen3 when the chat template mentions <think>, else none.")
    kv_cache_gb: float | None = option(None, "--kv-cache-gb", "KV cache size (default: 1/4 of free memory, max 2 GiB).")
    device: str | None = option(None, "--device", "cpu or cuda (default: cuda when torch sees one; said at start).")
    runner: str = option("auto", "--runner", "native (CPU kernels), torch (PyTorch ops, any device), auto (torch on cuda).")
    gpu_memory_utilization: float = option(0.9, "--gpu-memory-utilization",
                                           "cuda: the share of GPU memory to hold; the KV cache gets what weights leave.")
    cuda_graphs: bool = option(True, "--cuda-graphs/--no-cuda-graphs", "cuda: replay decode steps as CUDA graphs.")
    kv_cache_dtype: str = option("auto", "--kv-cache-dtype",
                                 "auto: the model's dtype; int8: K/V rows in int8 with a scale each (half of bf16's "
                                 "bytes, +0.26% perplexity).")
    max_num_seqs: int = option(64, "--max-num-seqs", "Most sequences in one step.")
    max_num_batched_tokens: int = option(512, "--max-num-batched-tokens", "Token budget per step.")
    decode_steps: int = option(8, "--decode-steps",
                               "Greedy decode steps run natively in one go, shared among the sequences (tokens "
                               "stream in bursts); 1: one step at a time.")
    max_model_len: int | None = option(None, "--max-model-len", "Context window (default: model's).")
    block_size: int = option(16, "--block-size", "Tokens per KV block.")
    prefix_caching: bool = option(True, "--prefix-caching/--no-prefix-caching")
    kv_disk_dir: str | None = option(
        None, "--kv-disk-dir",
        "Keep prefix-cache blocks in files under this directory (one server per directory): a prompt whose "
        "prefix left memory, or came before a restart, reads it back instead of recomputing it.")
    kv_disk_gb: float = option(10.0, "--kv-disk-gb",
                               "Most GiB of block files in --kv-disk-dir (least recently used go first).")
    kv_disk_write_through: bool = option(
        True, "--kv-disk-write-through/--kv-disk-write-on-evict",
        "Write every block to --kv-disk-dir as it is computed (in the background; a restart finds it), or only "
        "when memory evicts it.")
    num_threads: int | None = option(None, "--num-threads", "Torch threads (default: all cores).")
    shutdown_timeout: float = option(30.0, "--shutdown-timeout", "Seconds in-flight requests get to finish on SIGTERM.")
    keys_db: str | None = option(None, "--keys-db", "Enforce API keys from this SQLite file.")
    keys_cache_ttl: float = option(
        5.0, "--keys-cache-ttl", "Seconds a verified API key is served from memory (requests go on while another "
                                 "process locks --keys-db); a revoked key or changed limits take effect within it. "
                                 "0: read the file for every request.")
    allow_open: bool = option(False, "--allow-open", "Allow a non-loopback --host without API keys (anyone can use it).")
    max_prompt_tokens: int | None = option(None, "--max-prompt-tokens", "Default per-request prompt cap.")
    max_output_tokens: int | None = option(None, "--max-output-tokens",
                                           "Default per-request output cap (ends with 'length').")
    max_work_tokens: int | None = option(None, "--max-work-tokens", "Default per-request cap on prompt + output tokens.")
    default_max_tokens: int = option(
        DEFAULT_MAX_TOKENS, "--default-max-tokens",
        "Output cap of a request that sets no max_tokens (after the model's own generation defaults), so a "
        "silent request cannot hold a sequence slot until the context is full; 0: up to the context window. "
        "--max-output-tokens, by contrast, clamps every request.")
    generation_config: str = option(
        "auto", "--generation-config",
        "Sampling defaults where a request says nothing: auto (the model's own: GGUF general.sampling.*, "
        "generation_config.json, or its install recipe), none (the API's: temperature 1, no truncation), or a "
        "generation_config.json file.")
    max_waiting: int = option(256, "--max-waiting", "Interactive requests that may wait; then 503.")
    max_n: int = option(16, "--max-n", "Most samples (n, best_of) one request may ask for.")
    max_body_mb: float = option(8.0, "--max-body-mb", "Largest request body in MiB; larger: 413.")
    max_waiting_batch: int = option(4096, "--max-waiting-batch", "Batch requests that may wait.")
    price_card: str = option("tokenmill-default", "--price-card", "Rate card for usage.cost.")
    model_price_card: list[str] | None = option(
        None, "--model-price-card", "A served model's or adapter's own rate card, as NAME=CARD; repeat for more. "
                                    "Others use --price-card; an adapter without one, its base model's.")
    cards: str | None = option(None, "--cards", "Rate card file or folder (default: shipped).")
    usd_per_hour: float | None = option(None, "--usd-per-hour", "This machine's cost, for a self-hosted card.")
    spend_alarm_usd: float | None = option(
        None, "--spend-alarm-usd",
        "Server spend alarm: raised (logged, counted in /metrics) while all tenants' spend in the trailing "
        "--spend-alarm-window exceeds this (per tenant: tokenmill keys add --alarm-usd).")
    spend_alarm_window: float = option(3600.0, "--spend-alarm-window", "Seconds.")
    spend_alarm_block: bool = option(False, "--spend-alarm-block",
                                     "Refuse every request (429) while the server's alarm is raised.")
    model_alias: list[str] | None = option(
        None, "--model-alias",
        "Another name for the model, or for one snapshot of it: NAME=TARGET[@YYYY-MM-DD] (TARGET the served name or "
        "its snapshot id NAME@sha256:HEX, which pins it). With a date the alias is deprecated: its answers carry "
        "Deprecation and Sunset headers naming that day. Repeatable.")
    rollout: list[str] | None = option(
        None, "--rollout", "A canary: NAME=STABLE:WEIGHT,CANARY:WEIGHT over two served models. Requests for NAME "
        "split by weight, sticky per `user` (or API key); the canary is rolled back when it does worse "
        "(docs/rollouts.md). Repeatable.", only="serve")
    shadow: list[str] | None = option(
        None, "--shadow", "Mirror a share of the requests for NAME (a model, alias or rollout) to another served "
        "model, compared and discarded: NAME=MODEL[:FRACTION]. Repeatable.", only="serve")
    rollout_error_margin: float = option(0.05, "--rollout-error-margin", "Roll a canary back when its error rate "
                                         "exceeds the stable arm's by more than this (0.05: five points)...",
                                         only="serve")
    rollout_latency_margin: float = option(0.5, "--rollout-latency-margin", "...or its p99 latency exceeds the "
                                           "stable arm's times 1 + this.", only="serve")
    rollout_min_requests: int = option(20, "--rollout-min-requests", "Outcomes each arm needs before the two are "
                                       "compared.", only="serve")
    rollout_min_agreement: float | None = option(
        None, "--rollout-min-agreement", "...or fewer of its greedy answers than this share match the stable "
        "model's on the same request (each checked after the answer; default: unchecked).", only="serve")
    rollout_success_margin: float | None = option(
        None, "--rollout-success-margin", "...or the share of its answers that pass their request's own check (a "
        "json_schema response_format, a forced tool call) is below the stable arm's by more than this (default: "
        "unchecked).", only="serve")
    rollout_promote_after: int = option(0, "--rollout-promote-after", "Promote a canary still healthy after this "
                                        "many requests (0: only by hand).", only="serve")
    capture: str = option("off", "--capture",
                          "Capture finished requests for `tokenmill replay` (snapshot id, resolved parameters, seed, "
                          "prompt and output token ids; no text): off, all, or keys (the keys added with "
                          "--capture). docs/capture.md.")
    capture_db: str | None = option(None, "--capture-db", "The captures' SQLite file (default: captures.db in "
                                                          "--data-dir).")
    capture_retention_days: float = option(7.0, "--capture-retention-days", "Captures older than this are deleted.")
    capture_max_mb: float = option(512.0, "--capture-max-mb", "Most MB of captures kept (the oldest go first).")
    data_dir: str | None = option(None, "--data-dir", "Where Batch API files and batches are kept (default: "
                                                      "~/.local/share/tokenmill/server-PORT).")
    batch_api: bool = option(True, "--batch-api/--no-batch-api", "Serve /v1/files and /v1/batches.")
    batch_inflight: int = option(16, "--batch-inflight",
                                 "Batch lines handed to the engine at once (it runs them after interactive work).")
    batch_max_lines: int = option(50_000, "--batch-max-lines", "Most requests in one batch file.")
    batch_max_file_mb: float = option(200.0, "--batch-max-file-mb", "Largest batch file in MB.")
    batch_share: float = option(0.05, "--batch-share",
                                "While interactive requests run, batch requests get this share of the tokens steps "
                                "process (so they never starve).")
    batch_step_tokens: int = option(16, "--batch-step-tokens",
                                    "With no interactive work, the most tokens of a batch-only step (an interactive "
                                    "request that arrives waits for it).")
    speculative: str = option("off", "--speculative",
                              "Speculative decoding from text: ngram (drafts from the request's own prompt and "
                              "output), suffix (and from the same tenant's recent outputs) or off. The output is the "
                              "same; drafts are checked in one step and turned down per request where they miss.")
    num_speculative_tokens: int = option(5, "--num-speculative-tokens", "Most drafts one request gets in one step.")
    engine_mode: str = option("process", "--engine",
                              "Where the step loop runs: process (a child process; measured faster) or thread.",
                              only="serve")
    engine_hang_timeout: float = option(
        10.0, "--engine-hang-timeout",
        "Seconds the engine process may show no sign of life (a heartbeat from a thread of its own, or output) "
        "before it is declared hung: killed, its requests ended (503 engine_hung) and a new one started; 0: never.")
    log_level: str = option("info", "--log-level")
    log_format: str = option("text", "--log-format",
                             "text, or json: one JSON object per line with request and trace ids, and a line per "
                             "finished request.")
    otlp_traces_endpoint: str | None = option(
        None, "--otlp-traces-endpoint",
        "Send a span per request (OpenTelemetry GenAI attributes) to this OTLP/HTTP endpoint, e.g. "
        "http://localhost:4318/v1/traces; an incoming W3C traceparent becomes its parent.")
    slo_ttft_ms: float | None = option(
        None, "--slo-ttft-ms",
        "Time-to-first-token objective; with --slo-itl-ms the server tunes --max-num-seqs, --max-num-batched-tokens, "
        "--decode-steps and --max-waiting (as upper bounds) while it runs, to maximize the requests meeting both.",
        only="serve")
    slo_itl_ms: float | None = option(None, "--slo-itl-ms", "Inter-token latency objective (each request's mean).",
                                      only="serve")
    slo_percentile: float = option(90.0, "--slo-percentile", "The percentile of requests the objectives are judged at.",
                                   only="serve")
    autotune_interval: float = option(2.0, "--autotune-interval", "Seconds between tuning decisions.", only="serve")
    autotune_hold: float = option(20.0, "--autotune-hold",
                                  "Seconds a knob lowered for a violation is not raised again (doubled each time a "
                                  "raise of it had to be taken back).", only="serve")
    replicas: str = option("2", "--replicas", "Engine replicas: a number, or auto (Ray Serve autoscaling between "
                                              "--min-replicas and --max-replicas).", only="cluster")
    min_replicas: int = option(1, "--min-replicas", "With --replicas auto: the fewest replicas.", only="cluster")
    max_replicas: int = option(4, "--max-replicas", "With --replicas auto: the most replicas.", only="cluster")
    target_ongoing: float = option(8.0, "--target-ongoing",
                                   "With --replicas auto: requests in flight per replica to scale toward (running "
                                   "plus waiting).", only="cluster")
    scale_down_delay: float = option(30.0, "--scale-down-delay",
                                     "With --replicas auto: seconds the load must stay below the target before a "
                                     "replica is removed (it drains first).", only="cluster")
    routing: str = option("affinity", "--routing", "affinity (prefix-cache affinity with a load guard), round_robin "
                                                   "or p2c (power of two choices).", only="cluster")
    imbalance: int = option(4, "--imbalance", "Load guard: requests a prompt's preferred replica may have above the "
                                              "least busy one before the request goes to the least busy.",
                            only="cluster")
    address: str | None = option(None, "--address", "Join this Ray cluster (e.g. auto, or HOST:6379) instead of "
                                                    "starting a local one.", only="cluster")
    cluster: bool = False  # `tokenmill cluster serve`: the engine's replicas on Ray Serve

    def __post_init__(self) -> None:
        # one path, a list of them (repeated --model), or none: kept as a tuple (or None)
        models = (self.model,) if isinstance(self.model, str) else tuple(self.model or ())
        object.__setattr__(self, "model", models or None)
        precision(self.dtype, self.quantization)
        if self.activation_levels not in (None, 1, 2):
            raise OptionError(f"--activation-levels must be 1 or 2, got {self.activation_levels}")
        self._check_models()
        if self.log_format not in LOG_FORMATS:
            raise OptionError(f"--log-format must be text or json, got {self.log_format!r}")
        if self.otlp_traces_endpoint is not None and not self.otlp_traces_endpoint.startswith(("http://", "https://")):
            raise OptionError(f"--otlp-traces-endpoint must be an http(s) URL, got {self.otlp_traces_endpoint!r}")
        if (self.slo_ttft_ms is None) != (self.slo_itl_ms is None):
            raise OptionError("give both --slo-ttft-ms and --slo-itl-ms (the tuner balances the two)")
        if self.slo_ttft_ms is not None and not (
                self.slo_ttft_ms > 0 and self.slo_itl_ms > 0 and 50 <= self.slo_percentile < 100
                and self.autotune_interval > 0 and self.autotune_hold >= 0):
            raise OptionError("--slo-ttft-ms, --slo-itl-ms and --autotune-interval must be positive and "
                              "--slo-percentile in [50, 100)")
        if self.batch_api and (self.batch_inflight < 1 or self.batch_max_lines < 1 or self.batch_max_file_mb <= 0):
            raise OptionError("--batch-inflight, --batch-max-lines and --batch-max-file-mb must be positive")
        if self.reasoning_parser not in (None, "none", "deepseek_r1", "qwen3"):
            raise OptionError(f"--reasoning-parser must be one of deepseek_r1, qwen3, none, got {self.reasoning_parser!r}")
        if self.capture not in ("off", "all", "keys"):
            raise OptionError(f"--capture must be off, all or keys, got {self.capture!r}")
        if self.keys_cache_ttl < 0:
            raise OptionError("--keys-cache-ttl cannot be negative")
        if not (self.capture_retention_days > 0 and self.capture_max_mb > 0):
            raise OptionError("--capture-retention-days and --capture-max-mb must be positive")
        if self.max_connections < 1 or not (self.header_timeout > 0 and self.write_timeout > 0
                                              and self.body_timeout > 0):
            raise OptionError("--max-connections, --header-timeout, --body-timeout and --write-timeout must be positive")
        if not self.engine_hang_timeout >= 0:
            raise OptionError("--engine-hang-timeout must be 0 (off) or a positive number of seconds")
        if self.engine_mode not in ENGINE_MODES:
            raise OptionError(f"--engine must be one of {', '.join(ENGINE_MODES)}, got {self.engine_mode!r}")
        self._check_cluster()
        self._check_device()
        try:
            self.engine_config(resolve=False)  # the engine config's own checks, before anything starts
        except ValueError as exc:
            raise OptionError(str(exc)) from None

    def _check_device(self) -> None:
        if self.device not in (None, "cpu", "cuda"):
            raise OptionError(f"--device must be cpu or cuda, got {self.device!r}")
        if (self.device == "cuda" or self.runner == "torch") and self.quantization in ("int8", "int4"):
            raise OptionError(f"--quantization {self.quantization}: the torch runner (cuda) takes dense weights only")
        if self.device == "cuda":  # (torch is loaded here only when cuda is asked for by name)
            import torch

            if not torch.cuda.is_available():
                raise OptionError("--device cuda: torch sees no CUDA device here; drop --device to run on the CPU")

    @property
    def several_models(self) -> bool:
        return len(self.model or ()) > 1 or self.models_dir is not None

    def _check_models(self) -> None:
        try:
            parse_keep_alive(self.keep_alive)
        except ValueError as exc:
            raise OptionError(f"--keep-alive: {exc}") from None
        if self.memory_budget is not None and not self.memory_budget > 0:
            raise OptionError("--memory-budget must be a positive number of GB")
        if self.model_queue < 1:
            raise OptionError("--model-queue must be at least 1")
        if not self.several_models:
            return
        if self.engine_mode != "process":
            raise OptionError("several models run each in its own engine process: drop --engine thread")
        if self.served_model_name is not None:
            raise OptionError("--served-model-name names one model; with several, each is served under its own name")
        if self.lora or self.max_loras:
            raise OptionError("LoRA adapters (--lora, --max-loras) are served beside one model: not built with "
                              "several models yet")

    def _check_cluster(self) -> None:
        if self.routing not in POLICIES:
            raise OptionError(f"--routing must be one of {', '.join(POLICIES)}, got {self.routing!r}")
        if self.replicas == "auto":
            if not (1 <= self.min_replicas <= self.max_replicas and self.target_ongoing > 0
                    and self.scale_down_delay >= 0):
                raise OptionError("--replicas auto needs 1 <= --min-replicas <= --max-replicas, a positive "
                                  "--target-ongoing and a --scale-down-delay of 0 or more")
        elif not (self.replicas.isdigit() and int(self.replicas) >= 1):
            raise OptionError(f"--replicas must be a positive number or auto, got {self.replicas!r}")
        if self.imbalance < 0:
            raise OptionError("--imbalance must be 0 or more")

    @property
    def replica_count(self) -> int | None:
        """A fixed number of replicas, or None under --replicas auto."""
        return None if self.replicas == "auto" else int(self.replicas)

    def engine_configs(self) -> list[EngineConfig]:
        """One engine config per model to serve: each --model in order, then the entries of
        --models-dir (GGUF files and folders with a config.json), sorted by name. Raises
        ModelLoadError for a --model that is not installed, ValueError for a bad folder."""
        import os

        paths: list[str | None] = list(self.model or ())
        if self.models_dir is not None:
            if not os.path.isdir(self.models_dir):
                raise ValueError(f"--models-dir: {self.models_dir} is not a folder")
            found = [e.path for e in sorted(os.scandir(self.models_dir), key=lambda e: e.name)
                     if (e.is_file() and e.name.endswith(".gguf"))
                     or (e.is_dir() and os.path.isfile(os.path.join(e.path, "config.json")))]
            if not found and not paths:
                raise ValueError(f"--models-dir: {self.models_dir} holds no model (GGUF files or folders with "
                                 "a config.json)")
            given = {os.path.realpath(p) for p in paths if p is not None and os.path.exists(p)}
            paths += [p for p in found if os.path.realpath(p) not in given]
        from tokenmill.model.registry import resolve as resolve_model

        base = self.engine_config(resolve=False)
        return [dataclasses.replace(base, model=dataclasses.replace(base.model, path=resolve_model(p)))
                for p in paths or [None]]

    def engine_config(self, resolve: bool = True) -> EngineConfig:
        """The engine's config (the first model's). `resolve`: a known model's name becomes
        its installed file (tokenmill/model/registry.py; raises ModelLoadError when it is
        not installed)."""
        path = self.model[0] if self.model else None
        if resolve:
            from tokenmill.model.registry import resolve as resolve_model

            path = resolve_model(path)
        dtype, quantization = precision(self.dtype, self.quantization)
        return EngineConfig(
            model=ModelOptions(path=path, dtype=dtype, quantization=quantization, served_name=self.served_model_name,
                               activation_levels=self.activation_levels,
                               generation_config=self.generation_config,
                               default_max_tokens=self.default_max_tokens or None),
            cache=CacheConfig(block_size=self.block_size, kv_cache_gb=self.kv_cache_gb,
                              enable_prefix_caching=self.prefix_caching, kv_cache_dtype=self.kv_cache_dtype,
                              kv_disk_dir=self.kv_disk_dir, kv_disk_gb=self.kv_disk_gb,
                              kv_disk_write_through=self.kv_disk_write_through,
                              gpu_memory_utilization=self.gpu_memory_utilization),
            scheduler=SchedulerConfig(
                max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
                decode_steps=self.decode_steps, batch_share=self.batch_share,
                batch_step_tokens=self.batch_step_tokens,
                speculative=SpeculativeConfig(method=self.speculative,
                                              num_speculative_tokens=self.num_speculative_tokens)),
            max_model_len=self.max_model_len,
            num_threads=self.num_threads,
            bounds=RequestBounds(max_n=self.max_n, max_body_bytes=int(self.max_body_mb * 1024 * 1024)),
            lora=self.lora_config(),
            hang_timeout_s=self.engine_hang_timeout,
            device=self.device or "auto", runner=self.runner, cuda_graphs=self.cuda_graphs,
        )

    def lora_config(self) -> LoraConfig:
        adapters = []
        for spec in self.lora or []:
            name, sep, path = spec.partition("=")
            if not (sep and name.strip() and path.strip()):
                raise OptionError(f"--lora takes NAME=PATH, got {spec!r}")
            if any(name.strip() == n for n, _ in adapters):
                raise OptionError(f"--lora names {name.strip()!r} twice")
            adapters.append((name.strip(), path.strip()))
        max_loras = self.max_loras if self.max_loras is not None else (max(4, len(adapters)) if adapters else 0)
        if max_loras < len(adapters):
            raise OptionError(f"--max-loras {max_loras} is below the {len(adapters)} adapters given with --lora")
        if max_loras < 0 or self.max_lora_rank < 1:
            raise OptionError("--max-loras must be 0 or more and --max-lora-rank positive")
        return LoraConfig(tuple(adapters), max_loras, self.max_lora_rank)


# traffic control (rollouts, shadows) runs at the ingress, the same code under both commands
INGRESS = ("rollout", "shadow")


def cli_fields(command: str) -> list[dataclasses.Field]:
    """The fields that are options of `command` ("serve" or "cluster"), in help order."""
    return [f for f in dataclasses.fields(ServeOptions)
            if "flags" in f.metadata and (f.metadata["only"] in (None, command) or f.name.startswith(INGRESS))]
