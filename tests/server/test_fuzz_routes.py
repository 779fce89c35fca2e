"""Every route the server exposes, fuzzed against a live server that has all of them: a
key store (an admin key and a tenant's), the Batch API's store, stored responses,
captures, and several models (so the operator's load and unload routes exist). The POST
generation routes are fuzzed over their OpenAPI bodies in test_fuzz.py; this file takes
every other route, with hypothesis strategies of its own, because most of them read raw
requests (multipart uploads, query strings, path ids) that the OpenAPI document does not
type.

Each route has a positive phase (well-formed requests: known ids, valid bounds, a real
key) and a negative one (random ids, query strings, bodies, content types, and no key,
a wrong key or a tenant's key on an admin route). The promise checked for every case:
no 5xx, an answer within TIMEOUT_S, a 401 for a missing or wrong key and a 403 for a
tenant on an operator's route, an OpenAI-shaped error for every 4xx of the API, and
/health still 200 afterwards.

test_every_route_is_fuzzed builds the same app in this process (the engine is made, no
weights load) and fails for a route of its table that neither file fuzzes nor EXEMPT
names with a reason.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from urllib.parse import quote

import httpx
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from tests.server.conftest import ServerProcess, add_key
from tests.server.test_fuzz import BODY_ROUTES, ERROR_KEYS, TIMEOUT_S
from tests.server.test_multimodel import TINY, make_tiny

pytestmark = pytest.mark.slow

# Cases per route and phase: most are answered in milliseconds; a positive batch or
# rerank generates a token or two on the tiny model.
CASES = {"positive": 10, "negative": 25}
SLOW_CASES = {"positive": 3, "negative": 10}  # a model load starts an engine process (seconds)
EXEMPT: dict[tuple[str, str], str] = {
    **{("POST", p): "fuzzed over its OpenAPI body in test_fuzz.py" for p in BODY_ROUTES},
}
ADMIN_ROUTES = {("POST", "/v1/load_lora_adapter"), ("POST", "/v1/unload_lora_adapter"),
                ("POST", "/v1/models/{model:path}/load"), ("POST", "/v1/models/{model:path}/unload"),
                ("GET", "/v1/rollouts"), ("GET", "/v1/rollouts/{name:path}"), ("POST", "/v1/rollouts/{name:path}"),
                ("POST", "/v1/rollouts")}
CANARY = "tiny-canary"  # a second tiny model: the rollout's canary arm
ROLLOUT = f"ship={TINY}:90,{CANARY}:10"  # a rollout, so that its operator routes exist
WORDS = ("limit", "after", "order", "purpose", "window", "before", "model", "")
# routes whose well-formed requests are refused here all the same: no adapter on disk, a
# batch or response that finished before it could be cancelled
REFUSED = {("POST", "/v1/load_lora_adapter"), ("POST", "/v1/unload_lora_adapter"),
           ("POST", "/v1/batches/{batch_id}/cancel"), ("POST", "/v1/responses/{response_id}/cancel")}
LINE = {"custom_id": "x", "method": "POST", "url": "/v1/chat/completions",
        "body": {"model": TINY, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}}


@dataclass
class World:
    """What the server holds before fuzzing starts: keys, ids the positive phase names."""

    url: str
    keys: dict[str, str | None]
    files: list[str] = field(default_factory=list)
    spare_files: list[str] = field(default_factory=list)  # the positive phase may delete these
    batches: list[str] = field(default_factory=list)
    responses: list[str] = field(default_factory=list)
    spare_responses: list[str] = field(default_factory=list)
    models: list[str] = field(default_factory=list)


@dataclass
class Call:
    method: str
    path: str
    caller: str  # admin, user, none (no key) or wrong (a key the store does not hold)
    params: dict | None = None
    kwargs: dict = field(default_factory=dict)  # json=, content=, files=/data=, headers=


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    make_tiny(str(root / TINY))
    make_tiny(str(root / CANARY), seed=1)
    db = tmp_path_factory.mktemp("keys") / "keys.db"
    keys = {"admin": add_key(db, "ops", "--admin"), "user": add_key(db, "acme"), "none": None,
            "wrong": "tm-" + "0" * 40}
    srv = ServerProcess("--model", str(root / TINY), "--models-dir", str(root), "--keys-db", str(db),
                        "--capture", "all", "--kv-cache-gb", "0.05", "--max-model-len", "256",
                        "--max-output-tokens", "2", "--rollout", ROLLOUT).wait_ready()
    w = World(srv.url, keys, models=[TINY])
    try:
        user = {"authorization": f"Bearer {keys['user']}"}
        with httpx.Client(base_url=srv.url, headers=user, timeout=TIMEOUT_S) as c:
            for pool in (w.files, w.files, w.spare_files, w.spare_files, w.spare_files):
                r = c.post("/v1/files", data={"purpose": "batch"},
                           files={"file": ("in.jsonl", json.dumps(LINE) + "\n", "application/jsonl")})
                assert r.status_code == 200, r.text
                pool.append(r.json()["id"])
            r = c.post("/v1/batches", json={"input_file_id": w.files[0], "endpoint": "/v1/chat/completions",
                                            "completion_window": "24h"})
            assert r.status_code == 200, r.text
            w.batches.append(r.json()["id"])
            for pool in (w.responses, w.spare_responses, w.spare_responses):
                r = c.post("/v1/responses", json={"model": TINY, "input": "hi", "max_output_tokens": 2})
                assert r.status_code == 200, r.text
                pool.append(r.json()["id"])
        yield w
    finally:
        srv.stop()


def send(w: World, call: Call) -> httpx.Response:
    headers = dict(call.kwargs.pop("headers", {}))
    if w.keys[call.caller] is not None:
        headers["authorization"] = f"Bearer {w.keys[call.caller]}"
    with httpx.Client(base_url=w.url, timeout=TIMEOUT_S) as c:
        return c.request(call.method, call.path, params=call.params, headers=headers, **call.kwargs)


def is_api(path: str) -> bool:  # the routes behind the key check (middleware.Frontdoor)
    return path.startswith("/v1/") or path in ("/tokenize", "/detokenize", "/rerank")


def check(w: World, route: tuple[str, str], call: Call) -> int:
    where = f"\n{call}"
    t0 = time.monotonic()
    try:
        resp = send(w, call)
    except httpx.TimeoutException:
        pytest.fail(f"no answer within {TIMEOUT_S:.0f}s (a hang):{where}")
    elapsed = time.monotonic() - t0
    where += f"\n-> {resp.status_code} {resp.text[:400]}"
    assert resp.status_code < 500, "a 5xx" + where
    assert elapsed < TIMEOUT_S, f"took {elapsed:.1f}s" + where
    api = is_api(call.path)
    if api and call.caller in ("none", "wrong"):
        assert resp.status_code == 401, "an API route without a valid key" + where
    elif route in ADMIN_ROUTES and call.caller == "user" and resp.status_code != 404:
        assert resp.status_code in (400, 403, 422), "a tenant on an operator's route" + where
        if resp.status_code == 403:
            assert resp.json()["error"]["type"] == "permission_error", where
    if resp.status_code >= 400 and api:
        body = resp.json()
        assert set(body) == {"error"} and set(body["error"]) == ERROR_KEYS, "not an OpenAI-shaped error" + where
        assert body["error"]["message"], "an error without a message" + where
    health = httpx.get(w.url + "/health", timeout=TIMEOUT_S)
    assert health.status_code == 200, f"/health answered {health.status_code} {health.text} after" + where
    return resp.status_code


# --- strategies -----------------------------------------------------------------------------

TEXT = st.text(max_size=30)
JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | TEXT,
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXT, inner, max_size=4),
                    max_leaves=12)
QUERY = st.dictionaries(st.sampled_from(WORDS) | TEXT, TEXT | st.integers().map(str), max_size=4)


def seg(text: str) -> str:  # a path segment: any text, escaped so it stays one segment
    return quote(text, safe="")


def negative_caller() -> st.SearchStrategy[str]:
    return st.sampled_from(["admin", "user", "none", "wrong"])


def positive_caller(route) -> st.SearchStrategy[str]:
    return st.just("admin") if route in ADMIN_ROUTES else st.sampled_from(["admin", "user"])


def body(fields: dict[str, st.SearchStrategy]) -> st.SearchStrategy[dict]:
    """A random request body: JSON of any shape, bytes that are not JSON, or the route's own
    fields with random values (some left out)."""
    known = st.fixed_dictionaries({}, optional={k: JSON | v for k, v in fields.items()})
    return st.one_of(
        JSON.map(lambda v: {"json": v}),
        st.binary(max_size=64).map(lambda b: {"content": b, "headers": {"content-type": "application/json"}}),
        known.map(lambda v: {"json": v}),
    )


def upload(positive: bool) -> st.SearchStrategy[dict]:
    lines = st.lists(st.just(json.dumps(LINE)), min_size=1, max_size=3).map(lambda ls: "\n".join(ls) + "\n")
    if positive:
        return st.builds(lambda name, text: {"data": {"purpose": "batch"},
                                             "files": {"file": (name or "x.jsonl", text, "application/jsonl")}},
                         TEXT, lines)
    return st.one_of(
        st.builds(lambda purpose, text: {"data": {"purpose": purpose}, "files": {"file": ("x.jsonl", text)}},
                  TEXT, TEXT | lines),
        st.builds(lambda text: {"data": {"purpose": "batch", "file": text}}, TEXT),  # a field, not a file
        st.builds(lambda b, ctype: {"content": b, "headers": {"content-type": ctype}}, st.binary(max_size=64),
                  st.sampled_from(["multipart/form-data", "multipart/form-data; boundary=x", "text/plain", ""])),
    )


def calls(w: World, route: tuple[str, str], phase: str) -> st.SearchStrategy[Call]:
    method, template = route
    pos = phase == "positive"
    caller = positive_caller(route) if pos else negative_caller()
    ids = {"file_id": st.sampled_from(w.spare_files if method == "DELETE" else w.files),
           "batch_id": st.sampled_from(w.batches), "response_id": st.sampled_from(w.spare_responses if method == "DELETE" else w.responses),
           "model:path": st.sampled_from(w.models),
           "name": st.sampled_from(["console.js", "console.css"]), "name:path": st.just("ship")}
    # the path: known ids in the positive phase, any text in the negative one
    names = [p.strip("{}") for p in template.split("/") if p.startswith("{")]
    parts = st.fixed_dictionaries({n: ids[n] if pos else TEXT.map(seg) for n in names})
    params: st.SearchStrategy = st.none() if pos else QUERY
    kwargs: st.SearchStrategy = st.just({})
    if route == ("GET", "/v1/stats") and pos:
        params = st.floats(1, 3600).map(lambda s: {"window": str(s)})
    elif route in (("GET", "/v1/files"), ("GET", "/v1/batches")) and pos:
        params = st.fixed_dictionaries({}, optional={"limit": st.integers(1, 100).map(str),
                                                     "order": st.sampled_from(["asc", "desc"]),
                                                     "after": st.sampled_from(w.files + w.batches)})
    elif route == ("POST", "/v1/files"):
        kwargs = upload(pos)
    elif route == ("POST", "/v1/batches"):
        kwargs = st.fixed_dictionaries({
            "input_file_id": st.sampled_from(w.files), "endpoint": st.sampled_from(["/v1/chat/completions"]),
            "completion_window": st.just("24h")}, optional={"metadata": st.dictionaries(TEXT, TEXT, max_size=3)}
        ).map(lambda v: {"json": v}) if pos else body(
            {"input_file_id": st.sampled_from(w.files), "endpoint": TEXT, "completion_window": TEXT,
             "metadata": JSON})
    elif route == ("POST", "/v1/load_lora_adapter"):
        kwargs = st.fixed_dictionaries({"lora_name": st.text(min_size=1, max_size=20),
                                        "lora_path": st.sampled_from(["/nonexistent/adapter", "/tmp"])}
                                       ).map(lambda v: {"json": v}) if pos else body(
            {"lora_name": TEXT, "lora_path": TEXT, "lora_int_id": st.integers()})
    elif route == ("POST", "/v1/unload_lora_adapter"):
        kwargs = st.fixed_dictionaries({"lora_name": st.text(min_size=1, max_size=20)}
                                       ).map(lambda v: {"json": v}) if pos else body(
            {"lora_name": TEXT, "lora_int_id": st.integers()})
    elif route == ("POST", "/v1/rollouts/{name:path}"):
        kwargs = st.one_of(
            st.builds(lambda a, b: {"json": {"weights": {TINY: a, CANARY: b}}}, st.integers(1, 100),
                      st.integers(0, 100)),
            st.sampled_from([{"json": {"action": "promote"}}, {"json": {"action": "rollback"}}])) if pos else body(
            {"weights": st.dictionaries(TEXT, st.integers() | st.floats() | TEXT, max_size=3), "action": TEXT})
    elif route == ("POST", "/v1/rollouts"):  # a name taken before is a 409, as it should be
        kwargs = st.builds(lambda name, a, b: {"json": {"rollout": f"fz-{name}={TINY}:{a},{CANARY}:{b}"}},
                           st.from_regex(r"[a-z0-9]{1,12}", fullmatch=True), st.integers(1, 100),
                           st.integers(0, 100)) if pos else body(
            {"rollout": TEXT | st.builds(lambda n, a, b: f"{n}={a},{b}", TEXT, TEXT, TEXT)})
    elif template.startswith("/v1/models/"):
        kwargs = st.sampled_from([{}, {"json": {"keep_alive": "5m"}}, {"json": {"keep_alive": 60}}]) if pos \
            else body({"keep_alive": TEXT | st.integers() | st.floats()})
    elif route == ("POST", "/rerank"):
        kwargs = st.fixed_dictionaries({"model": st.just(TINY), "query": TEXT,
                                        "documents": st.lists(TEXT, min_size=1, max_size=3)}
                                       ).map(lambda v: {"json": v}) if pos else body(
            {"model": st.just(TINY), "query": TEXT, "documents": st.lists(TEXT, max_size=3), "top_n": st.integers()})
    elif method == "POST" and not pos:
        kwargs = body({})
    return st.builds(lambda who, p, q, kw: Call(method, fill(template, p), who, q, dict(kw)),
                     caller, parts, params, kwargs)


def fill(template: str, parts: dict[str, str]) -> str:
    for name, value in parts.items():
        template = template.replace("{" + name + "}", value)
    return template


# --- the route table ------------------------------------------------------------------------

def route_table(model_dir: str, keys_db: str, data_dir: str) -> set[tuple[str, str]]:
    """(method, path) of every route of an app built as `world` builds its server's."""
    from tokenmill.server import launch
    from tokenmill.server.app import ServerConfig, build_app
    from tokenmill.server.options import ServeOptions

    options = ServeOptions(model=[os.path.join(model_dir, TINY)], models_dir=model_dir, keys_db=keys_db,
                           data_dir=data_dir, capture="all", rollout=[ROLLOUT])
    policy = launch._policy(options)
    policy.capture = launch._capture(options)
    engine = launch._engine(options)
    app = build_app(engine, ServerConfig(traffic=launch._traffic(options, engine)), policy)
    try:
        return {(m, path) for path, r in walk(app.routes) for m in getattr(r, "methods", ()) if m != "HEAD"}
    finally:
        policy.batch_store.close()
        policy.capture.store.close()


def walk(routes, prefix: str = ""):
    for r in routes:
        if hasattr(r, "original_router"):  # FastAPI's include_router keeps the router whole
            yield from walk(r.original_router.routes, prefix + (r.include_context.prefix or ""))
        else:
            yield prefix + r.path, r


FUZZED = sorted({
    ("GET", "/openapi.json"), ("GET", "/docs"), ("GET", "/docs/oauth2-redirect"), ("GET", "/redoc"),
    ("GET", "/health"), ("GET", "/ready"), ("GET", "/metrics"), ("GET", "/ui"), ("GET", "/ui/{name}"),
    ("GET", "/v1/models"), ("GET", "/v1/stats"),
    ("POST", "/v1/files"), ("GET", "/v1/files"), ("GET", "/v1/files/{file_id}"),
    ("GET", "/v1/files/{file_id}/content"), ("DELETE", "/v1/files/{file_id}"),
    ("POST", "/v1/batches"), ("GET", "/v1/batches"), ("GET", "/v1/batches/{batch_id}"),
    ("POST", "/v1/batches/{batch_id}/cancel"),
    ("GET", "/v1/responses/{response_id}"), ("DELETE", "/v1/responses/{response_id}"),
    ("POST", "/v1/responses/{response_id}/cancel"),
    ("POST", "/v1/load_lora_adapter"), ("POST", "/v1/unload_lora_adapter"),
    ("POST", "/v1/models/{model:path}/load"), ("POST", "/v1/models/{model:path}/unload"),
    ("POST", "/rerank"),
    ("GET", "/v1/rollouts"), ("GET", "/v1/rollouts/{name:path}"), ("POST", "/v1/rollouts/{name:path}"),
    ("POST", "/v1/rollouts"),
})


def test_every_route_is_fuzzed(tmp_path):
    make_tiny(str(tmp_path / TINY))
    make_tiny(str(tmp_path / CANARY), seed=1)
    db = tmp_path / "keys.db"
    add_key(db, "ops", "--admin")
    table = route_table(str(tmp_path), str(db), str(tmp_path / "data"))
    unfuzzed = table - set(FUZZED) - set(EXEMPT)
    assert not unfuzzed, f"routes nobody fuzzes (add them to FUZZED here, or to EXEMPT with a reason): {unfuzzed}"
    assert not (set(FUZZED) | set(EXEMPT)) - table, "a fuzzed route the app no longer has"


SETTINGS = settings(derandomize=True, database=None, deadline=None, phases=[Phase.explicit, Phase.generate],
                    suppress_health_check=list(HealthCheck))


@pytest.mark.parametrize("phase", ["positive", "negative"])
@pytest.mark.parametrize("route", FUZZED, ids=lambda r: f"{r[0]} {r[1]}")
def test_fuzz_route(world, route, phase):
    statuses: dict[int, int] = {}
    count = (SLOW_CASES if route[1].startswith("/v1/models/") else CASES)[phase]

    @given(call=calls(world, route, phase))
    @settings(SETTINGS, max_examples=count)
    def run(call):
        status = check(world, route, call)
        statuses[status] = statuses.get(status, 0) + 1

    run()
    print(f"{route} {phase}: {dict(sorted(statuses.items()))}")
    if phase == "positive" and route not in REFUSED:
        assert 200 in statuses, f"no positive case succeeded: {statuses}"


def test_lora_routes_beside_several_models_refuse_cleanly(world):
    """The fuzz's first find: with several models the LoRA routes answered 500 (the model
    router had no adapter methods); now a clear 400 and 404."""
    admin = {"authorization": f"Bearer {world.keys['admin']}"}
    r = httpx.post(world.url + "/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/tmp"},
                   headers=admin, timeout=TIMEOUT_S)
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_name", r.text
    assert "several models" in r.json()["error"]["message"]
    r = httpx.post(world.url + "/v1/unload_lora_adapter", json={"lora_name": "a"}, headers=admin, timeout=TIMEOUT_S)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text
