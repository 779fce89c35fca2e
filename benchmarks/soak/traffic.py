"""The soak's requests: what each kind sends, how its answer is read and judged, and the
ledger every request's outcome lands in exactly once.

Greedy (and seeded n>1) requests are judged against the reference: the same request
answered once, alone, before any load. The default mode is batch-invariant
(tests/engine/test_determinism.py), so the same text must come back whatever runs beside
it, after a cache hit, across an engine restart.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import httpx

REQUEST_TIMEOUT_S = 120.0  # past this a request counts as hung (it never ended)

CHAT = ("Name three colors.", "What is the capital of France?", "Give me a word that rhymes with cat.",
        "Count from one to five.", "Say hello in Spanish.", "What do bees make?", "Name a large animal.",
        "Why is the sky blue?")
TEXT = ("The capital of France is", "Once upon a time", "The three primary colors are", "Water boils at",
        "My favourite food is", "The quick brown fox", "In the morning I", "The moon is")
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]

# kind -> weight in the mix. The checked kinds reuse a reference: chat, completion, json,
# tool, n2 (seeded sampling, two choices).
MIX = {"chat_stream": 4, "chat_whole": 2, "completion": 2, "n2": 1, "logprobs": 1, "json": 1, "tool": 1,
       "cancel": 2, "slow_reader": 1}
EXPECTED = ("ok", "cancelled", "rate_limited", "engine_fault")  # the outcomes that are not a failure
ENGINE_FAULT_CODES = ("engine_unavailable", "engine_hung")  # a killed engine's, a stopped (hung) one's


@dataclass
class Outcome:
    kind: str
    tenant: str
    start: float  # time.monotonic()
    end: float
    status: str  # one of EXPECTED, or what went wrong
    detail: str = ""
    ttft: Optional[float] = None
    gaps: list[float] = field(default_factory=list)  # between content-bearing chunks


@dataclass
class Ledger:
    """Every request started is recorded here once; `open` counts those still in flight."""

    outcomes: list[Outcome] = field(default_factory=list)
    ids: set[str] = field(default_factory=set)
    started: int = 0
    open: int = 0

    def seen(self, response_id: Optional[str]) -> bool:
        """True if this response id came back before (a duplicated answer)."""
        if not response_id:
            return False
        if response_id in self.ids:
            return True
        self.ids.add(response_id)
        return False


def reference_bodies(model: str, prompts: int, max_tokens: int) -> dict[tuple[str, int], tuple[str, dict]]:
    """(kind, i) -> (path, body) of every checked request; the reference run answers each once."""
    out: dict[tuple[str, int], tuple[str, dict]] = {}
    for i in range(prompts):
        msgs = [{"role": "user", "content": CHAT[i % len(CHAT)]}]
        base = {"model": model, "messages": msgs, "max_tokens": max_tokens, "temperature": 0}
        out[("chat", i)] = ("/v1/chat/completions", base)
        out[("completion", i)] = ("/v1/completions", {"model": model, "prompt": TEXT[i % len(TEXT)],
                                                       "max_tokens": max_tokens, "temperature": 0})
        out[("json", i)] = ("/v1/chat/completions", {
            **base, "max_tokens": 2 * max_tokens,
            "messages": [{"role": "user", "content": f"Describe a person as JSON. {CHAT[i % len(CHAT)]}"}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA,
                                                                        "strict": True}}})
        out[("tool", i)] = ("/v1/chat/completions", {
            **base, "max_tokens": 2 * max_tokens, "tools": TOOLS,
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
            "messages": [{"role": "user", "content": f"What is the weather like? {CHAT[i % len(CHAT)]}"}]})
        out[("n2", i)] = ("/v1/chat/completions", {**base, "n": 2, "temperature": 0.8, "seed": 1000 + i})
    return out


def answer_of(path: str, choices: list[dict[str, Any]]) -> list[str]:
    """What is compared: each choice's text, or its tool calls (name and arguments; ids differ)."""
    out = []
    for c in sorted(choices, key=lambda c: c.get("index", 0)):
        if path == "/v1/completions":
            out.append(c.get("text") or "")
            continue
        msg = c.get("message") or {}
        calls = msg.get("tool_calls") or []
        out.append(json.dumps([[t["function"]["name"], t["function"]["arguments"]] for t in calls])
                   if calls else (msg.get("content") or ""))
    return out


def error_code(payload: Any) -> str:
    err = payload.get("error") if isinstance(payload, dict) else None
    return str(err.get("code") or err.get("type") or "error") if isinstance(err, dict) else "error"


@dataclass
class Client:
    """One soak client: an httpx client, the reference answers and the ledger."""

    http: httpx.AsyncClient
    refs: dict[tuple[str, int], list[str]]
    bodies: dict[tuple[str, int], tuple[str, dict]]
    ledger: Ledger
    rng: random.Random
    prompts: int

    deck: list[str] = field(default_factory=list)

    def pick(self) -> str:
        """The next kind from a shuffled deck of MIX (each kind its weight's number of
        cards), so even a short run sends every kind."""
        if not self.deck:
            self.deck = [k for k, w in MIX.items() for _ in range(w)]
            self.rng.shuffle(self.deck)
        return self.deck.pop()

    async def one(self, kind: str, tenant: str, key: str) -> Outcome:
        """Run one request of `kind` to its end and record it (also when the run cancels it)."""
        self.ledger.started += 1
        self.ledger.open += 1
        o = Outcome(kind, tenant, time.monotonic(), 0.0, "no_terminal")
        try:
            await asyncio.wait_for(self._run(kind, key, o), REQUEST_TIMEOUT_S)
        except asyncio.TimeoutError:
            o.status, o.detail = "hung", f"no end after {REQUEST_TIMEOUT_S:.0f} s"
        except asyncio.CancelledError:
            o.status, o.detail = "no_terminal", "still running when the soak ended"
            raise
        except httpx.HTTPError as exc:
            o.status, o.detail = "transport_error", f"{type(exc).__name__}: {exc}"
        finally:
            o.end = time.monotonic()
            self.ledger.open -= 1
            self.ledger.outcomes.append(o)
        return o

    async def _run(self, kind: str, key: str, o: Outcome) -> None:
        i = self.rng.randrange(self.prompts)
        headers = {"Authorization": f"Bearer {key}"}
        if kind == "cancel":
            return await self._cancel(headers, o)
        ref_kind = {"chat_stream": "chat", "chat_whole": "chat", "logprobs": "chat", "slow_reader": "chat",
                    "capped": "chat"}.get(kind, kind)
        path, body = self.bodies[(ref_kind, i)]
        body = dict(body)
        stream = kind in ("chat_stream", "slow_reader") or (kind == "completion" and self.rng.random() < 0.5)
        if kind == "logprobs":
            body.update(logprobs=True, top_logprobs=2)
        if stream:
            body.update(stream=True, stream_options={"include_usage": True})
            got = await self._stream(path, body, headers, o, slow=kind == "slow_reader")
        else:
            got = await self._whole(path, body, headers, o)
        if got is None:
            return
        if kind == "logprobs" and not o.detail.startswith("logprobs ok"):
            o.status = "bad_logprobs"
            return
        want = self.refs[(ref_kind, i)]
        if got != want:
            o.status, o.detail = "wrong_answer", f"{ref_kind}#{i}: got {got!r}, reference {want!r}"
            return
        if ref_kind == "json" and o.detail == "stop":
            try:
                json.loads(got[0])
            except ValueError:
                o.status, o.detail = "bad_json", got[0][:200]
                return
        o.status = "ok"

    def _refused(self, status: int, payload: Any, o: Outcome) -> None:
        code = error_code(payload)
        if status == 429:
            o.status, o.detail = "rate_limited", code
        elif code in ENGINE_FAULT_CODES:
            o.status, o.detail = "engine_fault", f"{status} {code}"
        else:
            o.status = f"http_{status}" if status else "stream_error"
            o.detail = f"{code}: {str(payload)[:200]}"

    async def _whole(self, path: str, body: dict, headers: dict, o: Outcome) -> Optional[list[str]]:
        r = await self.http.post(path, json=body, headers=headers)
        try:
            payload = r.json()
        except ValueError:
            payload = {"error": {"code": "not_json"}}
        if r.status_code != 200:
            self._refused(r.status_code, payload, o)
            return None
        choices = payload.get("choices") or []
        want_n = body.get("n", 1)
        if len(choices) != want_n or any(c.get("finish_reason") is None for c in choices):
            o.detail = f"{len(choices)} choices of {want_n}, finish {[c.get('finish_reason') for c in choices]}"
            return None
        if self.ledger.seen(payload.get("id")):
            o.status, o.detail = "duplicate", f"response id {payload.get('id')} came back twice"
            return None
        o.detail = choices[0]["finish_reason"]
        if body.get("logprobs"):
            lp = ((choices[0].get("logprobs") or {}).get("content")) or []
            tokens = (payload.get("usage") or {}).get("completion_tokens")
            if lp and len(lp) == tokens and all(len(t.get("top_logprobs") or []) == 2 for t in lp):
                o.detail = "logprobs ok"
            else:
                o.detail = f"logprobs: {len(lp)} entries for {tokens} tokens"
        return answer_of(path, choices)

    async def _stream(self, path: str, body: dict, headers: dict, o: Outcome, slow: bool) -> Optional[list[str]]:
        texts: dict[int, str] = {}
        finish: dict[int, list[str]] = {}
        done = False
        last = None
        async with self.http.stream("POST", path, json=body, headers=headers) as r:
            if r.status_code != 200:
                await r.aread()
                try:
                    payload = json.loads(r.text)
                except ValueError:
                    payload = {"error": {"code": "not_json"}}
                self._refused(r.status_code, payload, o)
                return None
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    if done:
                        o.status, o.detail = "duplicate", "[DONE] twice"
                        return None
                    done = True
                    continue
                if done:
                    o.status, o.detail = "duplicate", "data after [DONE]"
                    return None
                chunk = json.loads(data)
                if "error" in chunk:
                    self._refused(0, chunk, o)
                    o.detail = f"stream error: {o.detail}"
                    return None
                for c in chunk.get("choices") or []:
                    piece = c.get("text") if path == "/v1/completions" else (c.get("delta") or {}).get("content")
                    if piece:
                        now = time.monotonic()
                        if o.ttft is None:
                            o.ttft = now - o.start
                        elif last is not None:
                            o.gaps.append(now - last)
                        last = now
                        texts[c.get("index", 0)] = texts.get(c.get("index", 0), "") + piece
                    if c.get("finish_reason"):
                        finish.setdefault(c.get("index", 0), []).append(c["finish_reason"])
                if slow:
                    await asyncio.sleep(self.rng.uniform(0.05, 0.3))
        n = body.get("n", 1)
        if not done or sorted(finish) != list(range(n)):
            o.detail = f"stream ended: [DONE] {done}, finished choices {sorted(finish)} of {n}"
            return None
        if any(len(v) > 1 for v in finish.values()):
            o.status, o.detail = "duplicate", f"finish_reason repeated: {finish}"
            return None
        o.detail = finish[0][0]
        return [texts.get(k, "") for k in range(n)]

    async def _cancel(self, headers: dict, o: Outcome) -> None:
        """A client that goes away: before the first chunk, after a few, or on a timer
        while a whole (unstreamed) answer is being made."""
        i = self.rng.randrange(self.prompts)
        body = {**self.bodies[("chat", i)][1], "max_tokens": 64, "ignore_eos": True}
        how = self.rng.choice(["before-first", "after-chunks", "timer"])
        o.detail = how
        if how == "timer":
            try:
                await asyncio.wait_for(self.http.post("/v1/chat/completions", json=body, headers=headers),
                                       self.rng.uniform(0.0, 0.5))
                o.status, o.detail = "ok", "answered before the client left"
            except asyncio.TimeoutError:
                o.status = "cancelled"
            return
        async with self.http.stream("POST", "/v1/chat/completions", json={**body, "stream": True},
                                    headers=headers) as r:
            if r.status_code != 200:
                await r.aread()
                self._refused(r.status_code, json.loads(r.text or "{}"), o)
                return
            want = 0 if how == "before-first" else self.rng.randint(1, 6)
            async for line in r.aiter_lines():
                if want <= 0:
                    break
                if line.startswith("data:"):
                    want -= 1
        o.status = "cancelled"
