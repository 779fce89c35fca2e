"""A bounded, seeded schemathesis run against a live server, over its own OpenAPI
document: the POST endpoints (chat, completions, and the dialects: Responses, Messages,
tokenize, embeddings, rerank), schema-conforming (positive) and schema-violating
(negative) bodies. The
promise checked for every case: no 5xx, no hang, an error in the route's own shape
(Anthropic's on /v1/messages, OpenAI's elsewhere) for every 4xx, a stream that ends as
its dialect ends one, and /health still answering 200 afterwards.

The served document types every field but states no bounds (those live in the
engine's RequestLimits and are configurable), and `model` is any string. So the run
first narrows a copy of the document to the served model and the documented bounds
(docs/api.md): positive cases then reach the engine and generate, negative ones step
just outside a bound. The server caps output with `--max-output-tokens` so that
generated requests stay cheap without any change to the API.
"""

from __future__ import annotations

import copy
import json
import time

import httpx
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode

from tests.server.conftest import MODEL, ServerProcess

pytestmark = pytest.mark.slow

VOCAB = 49152  # the embedded SmolLM2's vocabulary
MAX_N = 3  # the server's --max-n (default 16): fewer samples keep generated requests cheap
MAX_PROMPTS = 3  # the server allows 64 prompts a body; the positive phase sends at most this many
# Cases per endpoint and mode, 300 in all. A positive case mostly generates (seconds on 2 busy
# cores), a negative one is mostly refused at once.
CASES = {GenerationMode.POSITIVE: 50, GenerationMode.NEGATIVE: 100}
# The dialects translate onto the chat path fuzzed above: fewer cases reach their own edges.
DIALECT_CASES = {GenerationMode.POSITIVE: 15, GenerationMode.NEGATIVE: 30}
TIMEOUT_S = 60.0  # a response (or a stream's next chunk) slower than this is a hang
ERROR_KEYS = {"message", "type", "param", "code"}

_INT = ("integer",)
_NUM = ("number", "integer")
# The documented bound of each scalar field, applied to its numeric branch.
SCALAR_BOUNDS: dict[str, tuple[tuple[str, ...], dict]] = {
    "n": (_INT, {"minimum": 1, "maximum": MAX_N}),
    "best_of": (_INT, {"minimum": 1, "maximum": MAX_N}),
    "temperature": (_NUM, {"minimum": 0, "maximum": 100}),
    "top_p": (_NUM, {"exclusiveMinimum": 0, "maximum": 1}),
    "top_k": (_INT, {"minimum": -1, "maximum": 2 ** 63 - 1}),
    "min_p": (_NUM, {"minimum": 0, "maximum": 1}),
    "presence_penalty": (_NUM, {"minimum": -2, "maximum": 2}),
    "frequency_penalty": (_NUM, {"minimum": -2, "maximum": 2}),
    "repetition_penalty": (_NUM, {"exclusiveMinimum": 0, "maximum": 100}),
    "seed": (_INT, {"minimum": -(2 ** 63), "maximum": 2 ** 64 - 1}),
    "max_tokens": (_INT, {"minimum": 1, "maximum": 2 ** 63 - 1}),
    "max_completion_tokens": (_INT, {"minimum": 1, "maximum": 2 ** 63 - 1}),
    "max_output_tokens": (_INT, {"minimum": 1, "maximum": 2 ** 63 - 1}),
    "min_tokens": (_INT, {"minimum": 0, "maximum": 2 ** 63 - 1}),
    "logprobs": (_INT, {"minimum": 0, "maximum": 20}),
    "top_logprobs": (_INT, {"minimum": 0, "maximum": 20}),
}
TOKEN_ID = {"minimum": 0, "maximum": VOCAB - 1}
# The documented bound of each array or object field, by the branch's type.
SHAPED_BOUNDS: dict[str, dict[str, dict]] = {
    "stop": {"string": {"maxLength": 256}, "array": {"maxItems": 16, "items": {"type": "string", "maxLength": 256}}},
    "stop_token_ids": {"array": {"maxItems": 64, "items": {"type": "integer", **TOKEN_ID}}},
    "logit_bias": {"object": {"maxProperties": 300, "propertyNames": {"pattern": "^[0-9]{1,4}$"},
                              "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100}}},
    "messages": {"array": {"maxItems": 2048}},
    "stop_sequences": {"array": {"maxItems": 16, "items": {"type": "string", "maxLength": 256}}},
    "tokens": {"array": {"items": {"type": "integer", **TOKEN_ID}}},
}
BODIES = ("ChatCompletionRequest", "CompletionRequest", "ResponsesRequest", "MessagesRequest", "CountTokensRequest",
          "TokenizeRequest", "DetokenizeRequest", "EmbeddingRequest", "RerankRequest")
PROMPT = {"anyOf": [
    {"type": "string"},
    {"type": "array", "minItems": 1, "maxItems": MAX_PROMPTS, "items": {"type": "string"}},
    {"type": "array", "minItems": 1, "items": {"type": "integer", **TOKEN_ID}},
    {"type": "array", "minItems": 1, "maxItems": MAX_PROMPTS,
     "items": {"type": "array", "minItems": 1, "items": {"type": "integer", **TOKEN_ID}}},
]}


def _branches(prop: dict) -> list[dict]:
    return prop["anyOf"] if "anyOf" in prop else [prop]


def narrowed(doc: dict) -> dict:
    """A copy of the served document with `model` fixed to the served one and every
    documented bound written in."""
    doc = copy.deepcopy(doc)
    for name in BODIES:
        props = doc["components"]["schemas"][name]["properties"]
        props["model"] = {"type": "string", "enum": [MODEL]}
        for field, (types, bounds) in SCALAR_BOUNDS.items():
            for branch in _branches(props.get(field, {})):
                if branch.get("type") in types:
                    branch.update(bounds)
        for field, by_type in SHAPED_BOUNDS.items():
            for branch in _branches(props.get(field, {})):
                branch.update(by_type.get(branch.get("type"), {}))
        for field in ("prompt", "input"):  # (/v1/embeddings' input has the prompt's shapes)
            if field in props:
                props[field] = PROMPT
    return doc


@pytest.fixture(scope="module")
def fuzz_server():
    # the exact mode loads fastest; every sample generates at most 2 tokens (a prefill and
    # a decode step: the fuzzing is of the API, and a sequence's step costs ~0.25 s on 2 busy cores)
    srv = ServerProcess("--dtype", "float32", "--quantization", "none", "--max-model-len", "512",
                        "--max-output-tokens", "2", "--max-n", str(MAX_N)).wait_ready()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def schema(fuzz_server):
    served = httpx.get(fuzz_server.url + "/openapi.json", timeout=TIMEOUT_S).json()
    assert {"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages",
            "/tokenize"} <= set(served["paths"])
    doc = narrowed(served)
    config = schemathesis.Config.from_dict({"output": {"sanitization": {"enabled": False}}})  # show max_tokens
    return schemathesis.openapi.from_dict(doc, config=config)


class Tally:
    """Status codes seen, for the failure message and the log."""

    def __init__(self) -> None:
        self.statuses: dict[int, int] = {}
        self.slowest = 0.0

    def __str__(self) -> str:
        return f"statuses {dict(sorted(self.statuses.items()))}, slowest {self.slowest:.1f}s"


def check_case(server: ServerProcess, case, session: requests.Session, tally: Tally) -> None:
    """Send one case and hold the server to its promise."""
    t0 = time.monotonic()
    try:
        resp = case.call(base_url=server.url, session=session, timeout=TIMEOUT_S)
    except requests.Timeout:
        pytest.fail(f"no answer within {TIMEOUT_S:.0f}s (a hang):\n{case.as_curl_command()}")
    except requests.RequestException as exc:
        pytest.fail(f"the connection broke ({exc!r}):\n{case.as_curl_command()}")
    elapsed = time.monotonic() - t0
    tally.statuses[resp.status_code] = tally.statuses.get(resp.status_code, 0) + 1
    tally.slowest = max(tally.slowest, elapsed)
    where = f"\n{case.as_curl_command()}\n-> {resp.status_code} {resp.text[:500]}"
    assert resp.status_code < 500, "a 5xx" + where
    assert elapsed < TIMEOUT_S, f"took {elapsed:.1f}s" + where
    anthropic = case.path.startswith("/v1/messages")
    if resp.status_code >= 400:
        body = resp.json()
        if anthropic:
            assert body.get("type") == "error" and set(body["error"]) == {"type", "message"}, \
                "not an Anthropic-shaped error" + where
            assert body["error"]["type"] != "api_error", "a server error" + where
        else:
            assert set(body) == {"error"} and set(body["error"]) == ERROR_KEYS, "not an OpenAI-shaped error" + where
        assert body["error"]["message"], "an error without a message" + where
    elif resp.headers.get("content-type", [""])[0].startswith("text/event-stream"):
        check_stream(case.path, resp.text, where)
    else:
        resp.json()
    health = httpx.get(server.url + "/health", timeout=TIMEOUT_S)
    assert health.status_code == 200, f"/health answered {health.status_code} {health.text} after" + where


def check_stream(path: str, text: str, where: str) -> None:
    """The stream ended the way its dialect ends one, with no server error in it."""
    data = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    names = [line[7:] for line in text.splitlines() if line.startswith("event: ")]
    if path == "/v1/messages":
        assert names and names[-1] in ("message_stop", "error"), "a stream that did not end" + where
        errors = [json.loads(d)["error"] for d in data if json.loads(d)["type"] == "error"]
        assert all(e["type"] != "api_error" for e in errors), "a server error in the stream" + where
    elif path == "/v1/responses":
        assert names and names[-1] in ("response.completed", "response.incomplete", "response.failed"), \
            "a stream that did not end" + where
        errors = [json.loads(d) for d in data if json.loads(d)["type"] == "error"]
        assert all(e["code"] != "server_error" for e in errors), "a server error in the stream" + where
    else:
        assert data and data[-1] == "[DONE]", "a stream that did not end" + where
        for e in data[:-1]:
            err = json.loads(e).get("error")
            assert err is None or err["type"] != "server_error", "a server error in the stream" + where


# The POST routes fuzzed here over their OpenAPI bodies (test_fuzz_routes.py fuzzes the rest
# and fails when the app has a route neither file fuzzes).
BODY_ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages",
               "/v1/messages/count_tokens", "/tokenize", "/detokenize", "/v1/embeddings", "/v1/rerank")

SETTINGS = settings(derandomize=True, database=None, deadline=None,
                    phases=[Phase.explicit, Phase.generate],  # no shrinking: the run stays bounded
                    suppress_health_check=list(HealthCheck))


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=str)
@pytest.mark.parametrize("path", BODY_ROUTES)
def test_fuzz(fuzz_server, schema, path, mode):
    operation = schema[path]["POST"]
    tally = Tally()
    cases = CASES if path in ("/v1/chat/completions", "/v1/completions") else DIALECT_CASES
    with requests.Session() as session:
        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(SETTINGS, max_examples=cases[mode])
        def run(case):
            check_case(fuzz_server, case, session, tally)

        run()
    print(f"{path} {mode}: {tally}")
