"""The console at /ui in a real headless Chromium (Debian's, driven by Playwright)
against a live server: the playground streams and prices an answer, stop cancels it in
the engine, a wrong key shows the 401, and the dashboard follows a background load
and agrees with /metrics. Screenshots go to test-artifacts/console/.

Waits are Playwright's locator assertions: the page's CSP (script-src 'self') refuses
the string evaluation that wait_for_function needs, as it should."""

from __future__ import annotations

import os
import re
import shutil
import threading
import time
from pathlib import Path

import httpx
import pytest
from playwright.sync_api import expect

from tests.server.conftest import MODEL, ServerProcess, add_key, metric

pytestmark = pytest.mark.slow
ARTIFACTS = Path(os.environ.get("TOKENMILL_TEST_ARTIFACTS", Path(__file__).resolve().parents[2] / "test-artifacts"))
# the flags that keep Chromium off the network it cannot reach here
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]


def chromium_path() -> str:
    path = os.environ.get("TOKENMILL_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        pytest.fail("no chromium: `make install` installs Debian's chromium package for these tests")
    return path


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    db = tmp_path_factory.mktemp("console-keys") / "keys.db"
    keys = {"admin": add_key(db, "ops", "--admin"), "user": add_key(db, "carol", "--rpm", "600")}
    srv = ServerProcess("--keys-db", str(db)).wait_ready()
    yield srv, keys
    srv.stop()


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=chromium_path(), args=CHROMIUM_ARGS, headless=True)
        yield b
        b.close()


class Page:
    """A fresh page with its console errors collected."""

    def __init__(self, browser, url: str):
        self.page = browser.new_page(viewport={"width": 1280, "height": 900})
        self.errors: list[str] = []
        self.page.on("console", lambda m: self.errors.append(m.text) if m.type == "error" else None)
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.page.goto(url + "/ui")

    def set_key(self, key: str) -> None:
        self.page.fill("#api-key", key)
        self.page.press("#api-key", "Tab")  # `change` stores it and reloads the models

    def ask(self, key: str, prompt: str, max_tokens: int) -> None:
        """Send a greedy chat turn from the playground once the models are loaded."""
        self.set_key(key)
        self.page.wait_for_selector(f"#model option[value='{MODEL}']", state="attached")
        self.page.fill("#temperature", "0")
        self.page.fill("#max_tokens", str(max_tokens))
        self.page.fill("#prompt", prompt)
        self.page.click("#send")

    def text(self, selector: str) -> str:
        return self.page.text_content(selector) or ""

    def shot(self, name: str) -> None:
        ARTIFACTS.joinpath("console").mkdir(parents=True, exist_ok=True)
        self.page.screenshot(path=str(ARTIFACTS / "console" / f"{name}.png"), full_page=True)

    def close(self) -> None:
        self.page.close()


def number(text: str) -> float:
    m = re.search(r"-?[\d,]+(\.\d+)?", text)
    assert m, f"no number in {text!r}"
    return float(m.group(0).replace(",", ""))


def test_playground_streams_an_answer_with_usage_and_cost(live, browser):
    srv, keys = live
    p = Page(browser, srv.url)
    try:
        p.ask(keys["user"], "What is the capital of France?", 24)
        expect(p.page.locator("#fig-completion")).not_to_have_text("–", timeout=60_000)
        answer = p.text(".msg.assistant .content")
        assert "Paris" in answer
        assert number(p.text("#fig-ttft")) > 0 and p.text("#fig-ttft").endswith("ms")
        assert number(p.text("#fig-tps")) > 0
        assert 0 < number(p.text("#fig-completion")) <= 24
        assert number(p.text("#fig-prompt")) > 5
        assert number(p.text("#fig-cached")) >= 0
        assert number(p.text("#fig-cost")) > 0
        assert p.text("#fig-finish") in ("stop", "length")
        assert p.page.is_hidden("#error")
        p.shot("playground")
        # the key never leaves this browser except as the bearer token
        assert p.page.evaluate("localStorage.getItem('tokenmill.apiKey')") == keys["user"]
        assert p.errors == []
    finally:
        p.close()


def test_stop_cancels_the_request_in_the_engine(live, browser):
    srv, keys = live
    p = Page(browser, srv.url)
    try:
        # an answer that runs past 1,500 tokens in greedy (a counting prompt ends after ~120)
        p.ask(keys["user"], "Write a very long essay about the history of the Roman Empire, at least 3000 words.", 4000)
        expect(p.page.locator(".msg.assistant .content")).to_have_text(re.compile(r"\S"), timeout=60_000)
        deadline = time.monotonic() + 10  # the engine's figures reach /metrics with its next report
        while time.monotonic() < deadline and metric(srv, "tokenmill_num_requests_running") != 1:
            time.sleep(0.05)
        assert metric(srv, "tokenmill_num_requests_running") == 1
        assert p.text("#fig-finish") == "–"  # still streaming
        p.page.click("#stop")
        stopped = time.monotonic()
        expect(p.page.locator("#fig-finish")).to_have_text("stopped", timeout=10_000)
        assert p.page.is_enabled("#send") and p.page.is_disabled("#stop")
        # thousands of tokens were asked for: only an abort frees the engine this soon
        while time.monotonic() - stopped < 5 and metric(srv, "tokenmill_num_requests_running") != 0:
            time.sleep(0.05)
        assert metric(srv, "tokenmill_num_requests_running") == 0
        assert metric(srv, "tokenmill_kv_blocks_used") == 0
        assert p.text("#fig-completion") == "–"  # no usage chunk: the stream was cut
        assert len(p.text(".msg.assistant .content")) < 2000
        p.shot("stopped")
        assert p.errors == []
    finally:
        p.close()


def test_wrong_key_shows_the_401_message(live, browser):
    srv, _ = live
    p = Page(browser, srv.url)
    try:
        p.set_key("tm-this-is-not-a-key")
        p.page.wait_for_selector("#error:not([hidden])")
        assert p.text("#error") == "401: invalid or missing API key"
        p.shot("wrong-key")
        # the only console errors are the browser's own notes on the refused calls
        assert all("401" in e for e in p.errors), p.errors
    finally:
        p.close()


def test_dashboard_follows_load_and_agrees_with_metrics(live, browser):
    srv, keys = live
    p = Page(browser, srv.url)
    stop = threading.Event()

    def load() -> None:  # two streams of chat requests from another tenant
        def one() -> None:
            while not stop.is_set():
                httpx.post(srv.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {keys['user']}"},
                           json={"model": MODEL, "messages": [{"role": "user", "content": "Tell me about owls."}],
                                 "max_tokens": 48, "temperature": 0.8}, timeout=120)

        workers = [threading.Thread(target=one) for _ in range(2)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()

    try:
        p.set_key(keys["admin"])
        p.page.click("#tab-dashboard")
        expect(p.page.locator("#dash-updated")).not_to_have_text("never")
        assert "server view" in p.text("#dash-scope")
        before = number(p.text("#stat-generation-total"))
        loader = threading.Thread(target=load)
        loader.start()
        try:
            expect(p.page.locator("#stat-output-tps")).to_have_text(re.compile(r"[1-9]"), timeout=60_000)
            expect(p.page.locator("#stat-running")).not_to_have_text("0", timeout=30_000)
            p.page.wait_for_selector("#tenants tr[data-tenant='carol']")
            p.shot("dashboard-under-load")
        finally:
            stop.set()
            loader.join()
        # once idle, a refresh later the dashboard shows what /metrics says
        expected = metric(srv, "tokenmill_generation_tokens_total")
        expect(p.page.locator("#stat-generation-total")).to_have_text(f"{int(expected):,}", timeout=5_000)
        assert number(p.text("#stat-generation-total")) > before
        assert number(p.text("#stat-prompt-total")) == metric(srv, "tokenmill_prompt_tokens_total")
        assert p.text("#stat-running") == "0"
        kv_used, kv_total = (number(x) for x in p.text("#stat-kv").split("/"))
        assert kv_total == metric(srv, "tokenmill_kv_blocks_total")
        carol = p.page.locator("#tenants tr[data-tenant='carol'] td").all_text_contents()
        assert number(carol[1]) >= 2  # requests
        assert "ops" in p.page.locator("#tenants").text_content()
        ok = p.page.locator("#response-counts span[data-key='200']").text_content()
        # the dashboard's own polls are responses too: its count trails /metrics' by those since
        assert 0 < number(ok.split(":")[1]) <= metric(srv, 'tokenmill_http_responses_total{status_code="200"}')
        p.shot("dashboard")
        assert p.errors == []
    finally:
        stop.set()
        p.close()


def test_tenant_dashboard_shows_only_itself(live, browser):
    srv, keys = live
    p = Page(browser, srv.url)
    try:
        p.set_key(keys["user"])
        p.page.click("#tab-dashboard")
        expect(p.page.locator("#dash-updated")).not_to_have_text("never")
        assert "tenant carol" in p.text("#dash-scope")
        assert p.page.locator("#tenants tbody tr").count() == 1
        assert p.page.is_hidden("#stat-running")  # the server's state is for admins
        p.shot("dashboard-tenant")
        assert p.errors == []
    finally:
        p.close()


def test_dashboard_shows_rollouts_and_their_decisions(tmp_path, browser):
    """A server with a rollout: the admin's dashboard lists it with each arm's weight,
    traffic and checked answers, and an operator's rollback appears as its last decision;
    a tenant sees none."""
    from tests.server.test_multimodel import TINY, make_tiny

    make_tiny(str(tmp_path / TINY))
    make_tiny(str(tmp_path / "tiny-canary"), seed=1)
    db = tmp_path / "keys.db"
    admin, user = add_key(db, "ops", "--admin"), add_key(db, "carol")
    srv = ServerProcess("--model", str(tmp_path / TINY), "--models-dir", str(tmp_path), "--keys-db", str(db),
                        "--rollout", f"ship={TINY}:70,tiny-canary:30").wait_ready()
    p = Page(browser, srv.url)
    try:
        auth = {"authorization": f"Bearer {admin}"}
        for i in range(4):
            r = httpx.post(srv.url + "/v1/chat/completions", headers=auth, timeout=120, json={
                "model": "ship", "user": f"u{i}", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
            assert r.status_code == 200, r.text
        r = httpx.post(srv.url + "/v1/chat/completions", headers=auth, timeout=120, json={  # its answer is checked
            "model": "ship", "user": "u0", "messages": [{"role": "user", "content": "hi"}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": {
                "type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
                "additionalProperties": False}}}})
        assert r.status_code == 200, r.text
        p.set_key(admin)
        p.page.click("#tab-dashboard")
        row = p.page.locator("#rollouts tr[data-rollout='ship']")
        expect(row).to_contain_text("of 1 checked passed")
        expect(row).to_contain_text(f"{TINY}: weight 70")
        expect(row).to_contain_text("tiny-canary: weight 30")
        expect(row).to_contain_text("running")
        served = sum(int(m) for m in re.findall(r"(\d+) req", row.text_content() or ""))
        assert served == 5
        r = httpx.post(srv.url + "/v1/rollouts/ship", headers=auth, json={"action": "rollback"}, timeout=30)
        assert r.status_code == 200, r.text
        expect(row).to_contain_text("rollback by operator")
        expect(row).to_contain_text("tiny-canary: weight 0")
        p.shot("dashboard-rollouts")
        p.set_key(user)
        expect(p.page.locator("#dash-scope")).to_contain_text("tenant carol")
        assert p.page.is_hidden("#rollouts")
        assert p.errors == []
    finally:
        p.close()
        srv.stop()


def test_dashboard_shows_tokens_and_spend_by_model_and_adapter(tmp_path, browser):
    """A server with a LoRA adapter: the dashboard's models table has a row for the base
    model and one for the adapter (naming its base), each with the samples, tokens and
    spend /v1/stats counts for it."""
    from tests.server.test_lora_server import write_adapter

    srv = ServerProcess("--lora", f"a1={write_adapter(tmp_path / 'a1', seed=1)}", "--max-lora-rank", "16").wait_ready()
    p = Page(browser, srv.url)
    try:
        for model, n in ((MODEL, 1), ("a1", 2)):
            for _ in range(n):
                r = httpx.post(srv.url + "/v1/completions", timeout=120,
                               json={"model": model, "prompt": "Once upon a time", "max_tokens": 4, "temperature": 0})
                assert r.status_code == 200, r.text
        rows = {m["model"]: m for m in httpx.get(srv.url + "/v1/stats", timeout=30).json()["totals"]["models"]}
        assert rows["a1"]["parent"] == MODEL and rows[MODEL]["parent"] is None
        assert rows["a1"]["samples"] == 2 and rows[MODEL]["samples"] == 1
        p.page.click("#tab-dashboard")
        adapter = p.page.locator("#models tr[data-model='a1']")
        expect(adapter).to_contain_text(MODEL)
        cells = adapter.locator("td")
        expect(cells.nth(2)).to_have_text("2")
        expect(cells.nth(4)).to_have_text(f"{rows['a1']['generation_tokens']:,}")
        base = p.page.locator(f"#models tr[data-model='{MODEL}'] td")
        expect(base.nth(1)).to_have_text("–")
        expect(base.nth(2)).to_have_text("1")
        p.shot("dashboard-models")
        assert p.errors == []
    finally:
        p.close()
        srv.stop()
