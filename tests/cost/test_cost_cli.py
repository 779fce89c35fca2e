"""`tokenmill cost` commands, driven through typer's CliRunner."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from tokenmill.cost.cli import cost_app

runner = CliRunner(env={"COLUMNS": "220"})

WORKLOAD = """
name = "support bot"
requests_per_month = 1000
input_tokens = 1000
output_tokens = 500
retry_rate = 0.1
task_success_rate = 0.8
batch_share = 0.5
"""


def test_cards_lists_every_shipped_card():
    result = runner.invoke(cost_app, ["cards"])
    assert result.exit_code == 0, result.output
    for name in ("gpt-5.6-sol", "claude-opus-5", "claude-haiku-4.5", "gemini-3.5-flash-lite", "tokenmill-default"):
        assert name in result.output
    assert "272,000" in result.output


def test_estimate_prints_a_table_and_json(tmp_path):
    path = tmp_path / "w.toml"
    path.write_text(WORKLOAD)
    result = runner.invoke(cost_app, ["estimate", str(path)])
    assert result.exit_code == 0, result.output
    assert "support bot" in result.output and "claude-haiku-4.5 *" in result.output
    assert "3.85" in result.output  # haiku: batch billed at list, 0.0035 x 1000 x 1.1
    assert "billed at list" in result.output
    out = runner.invoke(cost_app, ["estimate", str(path), "--json"])
    rows = {r["card"]: r for r in json.loads(out.output)}
    assert rows["claude-haiku-4.5"]["monthly_usd"] == 3.85
    # gemini: half list (0.0003 + 0.00125), half batch (0.00015 + 0.000625) = 0.0011625 x 1100
    assert rows["gemini-3.5-flash-lite"]["monthly_usd"] == 1.27875


def test_estimate_reports_bad_files_in_one_line(tmp_path):
    path = tmp_path / "w.toml"
    path.write_text(WORKLOAD.replace("retry_rate = 0.1", "retry_rate = -1"))
    result = runner.invoke(cost_app, ["estimate", str(path)])
    assert result.exit_code == 2
    assert "error: workload w.toml: 'retry_rate' must be >= 0" in result.output


def test_from_bench_prints_prices_and_method(tmp_path):
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"runs": [{"label": "c8", "mode": "closed", "concurrency": 8, "duration_s": 100,
                                          "num_ok": 200, "input_tokens_total": 100000,
                                          "output_tokens_total": 20000, "ttft_ms": {"mean": 250},
                                          "e2e_ms": {"mean": 1000}}]}))
    result = runner.invoke(cost_app, ["from-bench", str(path), "--usd-per-hour", "3.6"])
    assert result.exit_code == 0, result.output
    assert "c8" in result.output and "25.0%" in result.output and "3.75" in result.output
    assert "Method:" in result.output
    rows = json.loads(runner.invoke(cost_app, ["from-bench", str(path), "--usd-per-hour", "3.6", "--json"]).output)
    assert rows[0]["usd_per_mtok_input"] == 0.25 and rows[0]["usd_per_mtok_output"] == 3.75
    missing = runner.invoke(cost_app, ["from-bench", str(tmp_path / "nope.json"), "--usd-per-hour", "1"])
    assert missing.exit_code == 2 and "no such file" in missing.output
