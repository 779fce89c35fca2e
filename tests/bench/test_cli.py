"""`tokenmill bench` end to end against the fake server: results.json in the agreed
schema, a markdown report and PNG plots; refusal of non-loopback targets."""

from __future__ import annotations

import json
import subprocess
import sys

import typer
from typer.testing import CliRunner

from tests.bench.fake_server import Behavior, FakeOpenAIServer
from tokenmill.bench.cli import bench
from tokenmill.bench.harness import is_loopback

RUN_KEYS = {"label", "mode", "concurrency", "request_rate", "duration_s", "num_requests", "num_ok",
            "num_errors", "errors_by_kind", "input_tokens_total", "output_tokens_total",
            "output_tokens_per_s", "total_tokens_per_s", "requests_per_s", "goodput_rps", "slo",
            "ttft_ms", "itl_ms", "e2e_ms", "decode_tokens_per_s_per_stream", "requests"}
SUMMARY_KEYS = {"p50", "p90", "p95", "p99", "mean"}


def app() -> typer.Typer:
    a = typer.Typer()
    a.command()(bench)
    return a


def test_bench_writes_json_report_and_plots(tmp_path):
    plan = lambda i, body: Behavior(ttft_s=0.02, itl_s=0.01, kind="http_500" if i == 3 else "ok")  # noqa: E731
    with FakeOpenAIServer(plan) as srv:
        result = CliRunner().invoke(app(), [
            "--base-url", srv.base_url, "--concurrency", "1,2", "--request-rate", "50",
            "--num-requests", "4", "--input-len", "16", "--output-len", "5", "--seed", "3",
            "--slo-ttft-ms", "500", "--slo-itl-ms", "100", "--out", str(tmp_path), "--no-progress"])
        body = srv.bodies[-1]
    assert result.exit_code == 0, result.output
    res = json.loads((tmp_path / "results.json").read_text())
    meta = res["meta"]
    assert {"base_url", "model", "endpoint", "seed", "started_at", "command"} <= meta.keys()
    assert meta["model"] == "fake-model"  # discovered from GET /v1/models
    assert meta["seed"] == 3 and meta["endpoint"] == "completions"
    assert meta["command"].startswith("tokenmill bench --base-url") and "--concurrency 1,2" in meta["command"]
    assert [r["label"] for r in res["runs"]] == ["c=1", "c=2", "rate=50/s"]
    for run in res["runs"]:
        assert RUN_KEYS <= run.keys()
        for key in ("ttft_ms", "itl_ms", "e2e_ms", "decode_tokens_per_s_per_stream"):
            assert run[key].keys() == SUMMARY_KEYS
        assert run["slo"]["ttft_ms"] == 500 and run["slo"]["itl_ms"] == 100
    assert sum(r["errors_by_kind"].get("http_500", 0) for r in res["runs"]) == 1
    assert body["ignore_eos"] is True and body["max_tokens"] == 5
    report = (tmp_path / "report.md").read_text()
    assert "| c=2 |" in report and "**mean** ITL" in report and "http_500 x1" in report
    for png in ("latency_cdf", "throughput_closed", "latency_vs_load_closed", "throughput_open",
                "latency_vs_load_open"):
        data = (tmp_path / f"{png}.png").read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
        assert f"({png}.png)" in report


def test_no_ignore_eos_chat_endpoint_and_stdout_json():
    with FakeOpenAIServer(lambda i, body: Behavior(ttft_s=0.01, itl_s=0.01)) as srv:
        result = CliRunner().invoke(app(), [
            "--base-url", srv.base_url + "/v1", "--model", "m", "--endpoint", "chat", "--no-ignore-eos",
            "--extra-body", '{"logit_bias": {"2": -100}, "top_k": 1}',
            "--num-requests", "2", "--output-len", "3", "--no-progress", "--warmup", "0"])
        body = srv.bodies[-1]
    assert result.exit_code == 0, result.output
    assert "ignore_eos" not in body and body["model"] == "m" and "messages" in body
    assert body["logit_bias"] == {"2": -100} and body["top_k"] == 1
    out = json.loads(result.stdout[result.stdout.index("{"):])
    assert out["runs"][0]["num_ok"] == 2 and "requests" not in out["runs"][0]


def test_non_loopback_targets_are_refused_without_a_flag():
    for url in ("http://10.1.2.3:8000", "http://example.com", "http://192.168.0.1"):
        result = CliRunner().invoke(app(), ["--base-url", url, "--model", "m", "--no-progress"])
        assert result.exit_code == 2 and "refusing non-loopback" in result.output, result.output
    assert is_loopback("http://127.0.0.1:8000") and is_loopback("http://127.5.0.1")
    assert is_loopback("http://localhost:1") and is_loopback("http://[::1]:8000")
    assert not is_loopback("http://localhost.example.com") and not is_loopback("http://0.0.0.0:80")


def test_bad_options_fail_cleanly():
    for args in (["--concurrency", "1,x"], ["--concurrency", "0"], ["--endpoint", "embeddings"],
                 ["--input-dist", "zipf"], ["--shared-prefix", "2"], ["--prompts-file", "/no/such.jsonl"],
                 ["--extra-body", "[1]"], ["--extra-body", "{bad"]):
        result = CliRunner().invoke(app(), ["--model", "m", "--no-progress", *args])
        assert result.exit_code == 2 and "error:" in result.output, (args, result.output)


def test_bench_never_imports_the_engine_or_the_model():
    code = ("import sys, tokenmill.bench.cli, tokenmill.bench.report, tokenmill.bench.__main__; "
            "bad = [m for m in sys.modules if m.startswith(('tokenmill.engine', 'tokenmill.model', 'torch'))]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)
