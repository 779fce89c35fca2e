"""The same API with the step loop in a child process (`--engine process`)."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.server.conftest import MODEL, ServerProcess, metric


@pytest.mark.slow
def test_process_engine_serves_and_frees():
    srv = ServerProcess("--engine", "process").wait_ready()
    try:
        # a completion, not the chat question: in bf16 the chat answer's first token is a
        # near-tie ("The capital..." vs "L'Étoile...") that weight rounding can flip
        r = httpx.post(srv.url + "/v1/completions", timeout=120, json={
            "model": MODEL, "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200 and "Paris" in r.json()["choices"][0]["text"]
        body = {"model": MODEL, "messages": [{"role": "user", "content": "What is the capital of France?"}],
                "max_tokens": 12, "temperature": 0}
        bad = httpx.post(srv.url + "/v1/chat/completions", json={**body, "max_tokens": 100000}, timeout=60)
        assert bad.status_code == 400 and "8192" in bad.json()["error"]["message"]
        with httpx.stream("POST", srv.url + "/v1/completions", timeout=120, json={
                "model": MODEL, "prompt": "Once", "max_tokens": 3000, "ignore_eos": True, "stream": True}) as s:
            for i, _ in enumerate(s.iter_lines()):
                if i > 6:
                    break
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and (metric(srv, "tokenmill_num_requests_running") or
                                               metric(srv, "tokenmill_kv_blocks_used")):
            time.sleep(0.2)
        assert metric(srv, "tokenmill_num_requests_running") == 0
        assert metric(srv, "tokenmill_kv_blocks_used") == 0
    finally:
        srv.stop()
    assert srv.proc.returncode == 0


@pytest.mark.slow
def test_process_engine_child_loads_while_the_front_reads_metadata():
    """The child is launched before the front parses the metadata, and start() waits for
    that child rather than a second one; a bad model path leaves no child behind."""
    import asyncio
    import multiprocessing

    from tokenmill.engine.api import SamplingParams
    from tokenmill.engine.factory import make_engine
    from tokenmill.server.options import ServeOptions

    engine = make_engine(ServeOptions(dtype="bfloat16", quantization="int4", kv_cache_gb=0.25, max_num_seqs=4,
                                      max_num_batched_tokens=256).engine_config(), "process")
    early = engine.pid
    assert early is not None and engine.tokenizer is not None

    async def run() -> str:
        await engine.start()
        try:
            assert engine.pid == early
            ids = engine.tokenizer.encode("The capital of France is")
            text = ""
            async for out in engine.generate("r", ids, engine.served().resolve([ids], SamplingParams(temperature=0.0, max_tokens=4))):
                text += out.text
            return text
        finally:
            await engine.stop()

    assert "Paris" in asyncio.run(run())

    bad = "/nonexistent/model.gguf"
    with pytest.raises(Exception, match="not found"):
        make_engine(ServeOptions(model=bad, dtype="bfloat16", quantization="int4", kv_cache_gb=0.25, max_num_seqs=4,
                                 max_num_batched_tokens=256).engine_config(), "process")
    deadline = time.monotonic() + 10
    while multiprocessing.active_children() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not multiprocessing.active_children()
