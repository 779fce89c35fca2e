"""ServeOptions: every `serve` option checked once, with the one-line errors the CLI prints,
and the flags of `serve` and `cluster serve` built from its fields."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest
import torch
import typer
from typer.testing import CliRunner

from tokenmill.cli import app
from tokenmill.server.options import INGRESS, OptionError, ServeOptions, cli_fields


def test_defaults_make_the_engine_config_the_flags_describe():
    o = ServeOptions()
    cfg = o.engine_config(resolve=False)
    assert (cfg.model.path, cfg.model.dtype, cfg.model.quantization) == (None, "bfloat16", "auto")
    assert cfg.scheduler.max_num_seqs == 64 and cfg.scheduler.decode_steps == 8
    assert cfg.bounds.max_body_bytes == 8 * 1024 * 1024 and cfg.bounds.max_n == 16
    custom = ServeOptions(dtype="float32", max_num_seqs=3, max_body_mb=0.5, speculative="suffix",
                          num_speculative_tokens=2, kv_cache_dtype="int8", prefix_caching=False)
    cfg = custom.engine_config(resolve=False)
    assert (cfg.model.dtype, cfg.model.quantization) == ("float32", "none")  # the exact mode
    assert cfg.scheduler.max_num_seqs == 3 and cfg.bounds.max_body_bytes == 512 * 1024
    assert cfg.scheduler.speculative.method == "suffix" and cfg.scheduler.speculative.num_speculative_tokens == 2
    assert cfg.cache.kv_cache_dtype == "int8" and not cfg.cache.enable_prefix_caching


def test_device_defaults_to_auto_and_cuda_without_a_gpu_is_refused():
    cfg = ServeOptions().engine_config(resolve=False)
    assert (cfg.device, cfg.runner, cfg.cuda_graphs, cfg.cache.gpu_memory_utilization) == ("auto", "auto", True, 0.9)
    assert ServeOptions(device="cpu", runner="torch").engine_config(resolve=False).runner == "torch"
    if not torch.cuda.is_available():
        with pytest.raises(OptionError, match="--device cuda: torch sees no CUDA device"):
            ServeOptions(device="cuda")


def test_frozen_and_keyword_only():
    o = ServeOptions()
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.port = 1  # type: ignore[misc]
    with pytest.raises(TypeError):
        ServeOptions("model.gguf")  # type: ignore[misc]


@pytest.mark.parametrize("kwargs,message", [
    ({"dtype": "float16"}, "--dtype must be float32 or bfloat16, got 'float16'"),
    ({"dtype": "float32", "quantization": "int4"}, "cannot run with --dtype float32"),
    ({"quantization": "q4"}, "--quantization must be auto, none, int8 or int4"),
    ({"log_format": "xml"}, "--log-format must be text or json, got 'xml'"),
    ({"otlp_traces_endpoint": "localhost:4318"}, "--otlp-traces-endpoint must be an http(s) URL"),
    ({"slo_ttft_ms": 400.0}, "give both --slo-ttft-ms and --slo-itl-ms"),
    ({"slo_ttft_ms": 400.0, "slo_itl_ms": 25.0, "slo_percentile": 100.0}, "--slo-percentile in [50, 100)"),
    ({"slo_ttft_ms": 400.0, "slo_itl_ms": -1.0}, "must be positive"),
    ({"batch_inflight": 0}, "--batch-inflight, --batch-max-lines and --batch-max-file-mb must be positive"),
    ({"batch_max_file_mb": 0.0}, "--batch-max-file-mb must be positive"),
    ({"reasoning_parser": "r1"}, "--reasoning-parser must be one of deepseek_r1, qwen3, none, got 'r1'"),
    ({"engine_mode": "fork"}, "--engine must be one of process, thread, got 'fork'"),
    ({"routing": "random"}, "--routing must be one of affinity, round_robin, p2c, got 'random'"),
    ({"replicas": "0"}, "--replicas must be a positive number or auto, got '0'"),
    ({"replicas": "two"}, "--replicas must be a positive number or auto"),
    ({"replicas": "auto", "min_replicas": 3, "max_replicas": 2}, "--replicas auto needs 1 <= --min-replicas"),
    ({"replicas": "auto", "target_ongoing": 0.0}, "a positive --target-ongoing"),
    ({"imbalance": -1}, "--imbalance must be 0 or more"),
    ({"models_dir": "/m", "engine_mode": "thread"}, "several models run each in its own engine process"),
    ({"model": ["a.gguf", "b.gguf"], "served_model_name": "x"}, "--served-model-name names one model"),
    ({"keep_alive": "soon"}, "--keep-alive: keep_alive must be a number of seconds or a duration"),
    ({"memory_budget": 0.0}, "--memory-budget must be a positive number of GB"),
    ({"model_queue": 0}, "--model-queue must be at least 1"),
    ({"body_timeout": 0.0}, "--body-timeout and --write-timeout must be positive"),
    ({"keys_cache_ttl": -1.0}, "--keys-cache-ttl cannot be negative"),
    # the engine config's own checks, made when the options are
    ({"kv_cache_dtype": "fp8"}, "kv_cache_dtype must be one of auto, int8"),
    ({"decode_steps": 0}, "decode_steps must be positive"),
    ({"speculative": "eagle"}, "speculative method must be one of off, ngram, suffix"),
    ({"block_size": 0}, "block_size must be positive"),
    ({"max_n": 0}, "max_n must be positive"),
    ({"batch_share": 2.0}, "batch_share must be in (0, 1]"),
    ({"device": "tpu"}, "--device must be cpu or cuda, got 'tpu'"),
    ({"runner": "torch", "quantization": "int4"}, "the torch runner (cuda) takes dense weights only"),
    ({"runner": "fast"}, "runner must be one of auto, native, torch"),
    ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization must be in (0, 1]"),
])
def test_bad_options_are_refused_with_one_line(kwargs, message):
    with pytest.raises(OptionError) as ei:
        ServeOptions(**kwargs)
    assert message in str(ei.value) and "\n" not in str(ei.value)


def test_batch_limits_are_not_checked_without_the_batch_api():
    assert ServeOptions(batch_api=False, batch_inflight=0).batch_inflight == 0


def test_replicas():
    assert ServeOptions(replicas="3").replica_count == 3
    assert ServeOptions(replicas="auto").replica_count is None


def _params(*path: str) -> dict[str, object]:
    command = typer.main.get_command(app)
    for name in path:
        command = command.commands[name]
    return {p.name: p for p in command.params}


def test_both_commands_take_their_flags_from_the_fields():
    serve, cluster = _params("serve"), _params("cluster", "serve")
    assert list(serve) == [f.name for f in cli_fields("serve")]
    assert list(cluster) == [f.name for f in cli_fields("cluster")]
    shared = set(serve) & set(cluster)
    traffic = {f.name for f in cli_fields("serve") if f.name.startswith(INGRESS)}  # the ingress's, in both
    assert traffic <= shared
    assert (set(serve) - shared) | traffic == {"engine_mode", "slo_ttft_ms", "slo_itl_ms", "slo_percentile",
                                   "autotune_interval", "autotune_hold", "lora", "max_loras", "max_lora_rank",
                                   "models_dir", "preload", "memory_budget", "keep_alive", "model_queue",
                                   "rollout", "shadow", "rollout_error_margin", "rollout_latency_margin",
                                   "rollout_min_requests", "rollout_min_agreement", "rollout_promote_after",
                                   "rollout_success_margin"}
    assert set(cluster) - shared == {"replicas", "min_replicas", "max_replicas", "target_ongoing",
                                     "scale_down_delay", "routing", "imbalance", "address"}
    for name in shared:  # one definition: same flags, default and help in both
        a, b = serve[name], cluster[name]
        assert (a.opts, a.secondary_opts, a.default, a.help) == (b.opts, b.secondary_opts, b.default, b.help)
    assert serve["prefix_caching"].secondary_opts == ["--no-prefix-caching"]
    assert serve["engine_mode"].opts == ["--engine"]


def test_the_cli_refuses_bad_options_before_starting_anything():
    r = CliRunner().invoke(app, ["cluster", "serve", "--replicas", "0", "--port", "1"])
    assert r.exit_code == 2 and "error: --replicas must be a positive number or auto, got '0'" in r.output
    r = CliRunner().invoke(app, ["serve", "--log-format", "xml", "--port", "1"])
    assert r.exit_code == 2 and "--log-format must be text or json" in r.output
    r = CliRunner().invoke(app, ["serve", "--chat-template", "/nonexistent/t.jinja", "--port", "1"])
    assert r.exit_code == 2 and "--chat-template: cannot read /nonexistent/t.jinja" in r.output


def test_the_cli_hands_the_launcher_what_the_flags_say(tmp_path):
    """The launcher builds a real app (the engine's metadata read, nothing started) from
    the options the flags parse into; only running it is left out (in a child process:
    the launcher configures logging)."""
    code = """if True:
        import json, sys
        from tokenmill.server import launch
        def run_server(server, options):
            engine = server.state.engine
            print(json.dumps({"options": repr(options), "model": server.state.model_name,
                              "body": engine.bounds.max_body_bytes, "seqs": engine.config.scheduler.max_num_seqs}))
        launch.run_server = run_server
        from tokenmill.cli import app
        app(sys.argv[1:])
    """
    args = ["serve", "--engine", "thread", "--max-num-seqs", "7", "--served-model-name", "m", "--data-dir",
            str(tmp_path), "--max-body-mb", "1", "--port", "1", "--log-level", "warning"]
    r = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout.strip().splitlines()[-1])
    want = ServeOptions(engine_mode="thread", max_num_seqs=7, served_model_name="m", data_dir=str(tmp_path),
                        max_body_mb=1.0, port=1, log_level="warning")
    assert got == {"options": repr(want), "model": "m", "body": 1 << 20, "seqs": 7}


def test_activation_levels_flag_reaches_the_model_and_is_checked():
    """--activation-levels 1 or 2 reaches the engine's model options (unset: the model's
    recipe decides at load, 1 for qwen2.5-coder-1.5b and 2 for any other file); others
    are refused before anything loads."""
    from tokenmill.model.registry import RECIPES, recipe_activation_levels

    assert ServeOptions(activation_levels=1).engine_config(resolve=False).model.activation_levels == 1
    assert ServeOptions().engine_config(resolve=False).model.activation_levels is None
    with pytest.raises(OptionError, match="--activation-levels must be 1 or 2"):
        ServeOptions(activation_levels=3)
    assert recipe_activation_levels(RECIPES["qwen2.5-coder-1.5b"].file) == 1
    assert recipe_activation_levels(RECIPES["qwen2.5-coder-0.5b"].file) == 2
    assert recipe_activation_levels("SmolLM2-135M-Instruct.Q4_1.gguf") == 2
