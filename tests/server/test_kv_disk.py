"""The disk tier through a real server on the embedded model: a prompt's prefix outlives a
restart (`cached_tokens` > 0, the same answer), /metrics shows the tier, and a second
server on the same directory is refused."""

from __future__ import annotations

import httpx
import pytest

from tests.server.conftest import ServerProcess

openai = pytest.importorskip("openai")

# ~700 tokens: a system prompt and a question, as an agent sends them again and again
SYSTEM = " ".join(f"Rule {i}: answer in plain words, cite the clause, and keep it under {i + 20} words."
                  for i in range(40))


def _ask(srv):
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    r = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", max_tokens=12, temperature=0,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is rule 7?"}])
    return r.choices[0].message.content, r.usage


def _metric(srv, name):
    for line in httpx.get(srv.url + "/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


def _serve(root):
    return ServerProcess("--kv-disk-dir", str(root), "--kv-disk-gb", "1", "--dtype", "float32",
                         "--quantization", "none", "--no-batch-api")


def test_prefix_outlives_a_restart(tmp_path):
    srv = _serve(tmp_path).wait_ready()
    try:
        text, usage = _ask(srv)
        assert usage.prompt_tokens > 600 and usage.prompt_tokens_details.cached_tokens == 0
        second = _serve(tmp_path)  # the same directory while the first holds it
        second.proc.wait(timeout=300)
        assert second.proc.returncode != 0 and "kv disk directory" in second.stop().lower()
    finally:
        srv.stop()
    srv = _serve(tmp_path).wait_ready()
    try:
        again, usage2 = _ask(srv)
        cached = usage2.prompt_tokens_details.cached_tokens
        assert again == text
        assert cached == (usage.prompt_tokens - 1) // 16 * 16
        assert _metric(srv, "tokenmill_kv_disk_hit_tokens_total") == cached
        assert _metric(srv, "tokenmill_kv_disk_restore_seconds_count") == 1
        assert _metric(srv, "tokenmill_kv_disk_used_bytes") > 0
        assert _metric(srv, "tokenmill_kv_disk_faults_total") == 0
    finally:
        srv.stop()
