"""/v1/embeddings and /v1/rerank over HTTP, driven by the official `openai` SDK where it
has a call: on the served decoder (the session's SmolLM2 server) against transformers'
final hidden states, and on the installed encoder (`tokenmill serve --model
all-minilm-l6-v2`) against SentenceTransformer loaded from the same folder; bad input
a clear 4xx in OpenAI's error shape, the server unharmed."""

from __future__ import annotations

import base64
import json
import struct
import threading
import time

import httpx
import pytest
import torch

from tests.model.test_encoder import SENTENCES, minilm, tiny_encoder  # noqa: F401 (minilm: a fixture)
from tests.server.conftest import MODEL, ServerProcess, free_port

openai = pytest.importorskip("openai")
ENCODER = "all-minilm-l6-v2"
QUERY = "What is the capital of France?"
DOCS = ["Bananas are a yellow fruit rich in potassium.", "Paris is the capital and largest city of France.",
        "The Eiffel Tower stands in Paris.", "Python is a programming language."]


def post(url: str, path: str, body) -> httpx.Response:
    return httpx.post(url + path, content=json.dumps(body), headers={"content-type": "application/json"}, timeout=120)


def hf_vector(hf_smol, ids: list[int], pooling: str) -> torch.Tensor:
    with torch.no_grad():
        h = hf_smol.model(torch.tensor([ids])).last_hidden_state[0].float()
    return torch.nn.functional.normalize(h[-1] if pooling == "last" else h.mean(0), dim=0)


def cos(a, b) -> float:
    return torch.nn.functional.cosine_similarity(torch.tensor(a), torch.as_tensor(b), dim=0).item()


def assert_client_error(r: httpx.Response, status: int = 400, param: str | None = None) -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["type"] == ("not_found_error" if status == 404 else "invalid_request_error") and err["message"]
    if param is not None:
        assert err["param"] == param, err


# -- the decoder ---------------------------------------------------------------------------
@pytest.mark.slow
def test_decoder_embeddings_match_transformers(server, client, hf_smol, hf_tokenizer):
    """Last-token pooling by default, mean on request; floats and base64 (the SDK's
    default, decoded by the SDK) are the same vectors; usage counts the input tokens."""
    texts = ["The cat sits outside.", "Paris is the capital of France, naïve café ☕."]
    ids = [hf_tokenizer(t).input_ids for t in texts]
    floats = client.embeddings.create(model=MODEL, input=texts, encoding_format="float")
    assert [d.index for d in floats.data] == [0, 1] and floats.model == MODEL
    assert floats.usage.prompt_tokens == floats.usage.total_tokens == sum(map(len, ids))
    decoded = client.embeddings.create(model=MODEL, input=texts)  # base64 on the wire
    for i in range(2):
        want = hf_vector(hf_smol, ids[i], "last")
        assert cos(floats.data[i].embedding, want) >= 0.9999
        assert abs(sum(x * x for x in floats.data[i].embedding) - 1.0) < 1e-5
        assert torch.allclose(torch.tensor(decoded.data[i].embedding), torch.tensor(floats.data[i].embedding),
                              atol=1e-6)
    mean = client.embeddings.create(model=MODEL, input=ids[1], encoding_format="float", extra_body={"pooling": "mean"})
    assert cos(mean.data[0].embedding, hf_vector(hf_smol, ids[1], "mean")) >= 0.9999
    raw = post(server.url, "/v1/embeddings", {"model": MODEL, "input": texts[0], "encoding_format": "base64"}).json()
    packed = base64.b64decode(raw["data"][0]["embedding"])
    assert torch.allclose(torch.tensor(struct.unpack(f"<{len(packed) // 4}f", packed)),
                          torch.tensor(floats.data[0].embedding), atol=1e-6)


def test_decoder_bad_input(server, client):
    url = server.url
    too_long = list(range(10, 10 + httpx.get(url + "/v1/models").json()["data"][0]["max_model_len"] + 1))
    cases = [
        ({"input": []}, "input"), ({"input": ""}, "input"), ({"input": ["a", ""]}, "input"),
        ({"input": [[]]}, "input"), ({"input": ["x"] * 65}, "input"), ({"input": 5}, None),
        ({"input": ["a", 1]}, None), ({"input": [1, 2, 10 ** 9]}, "input"), ({"input": too_long}, "input"),
        ({"input": "a", "dimensions": 64}, "dimensions"), ({"input": "a", "pooling": "cls"}, "pooling"),
        ({"input": "a", "encoding_format": "hex"}, None),
    ]
    for body, param in cases:
        assert_client_error(post(url, "/v1/embeddings", {"model": MODEL, **body}), param=param)
    assert_client_error(post(url, "/v1/embeddings", {"model": "nope", "input": "a"}), 404, "model")
    with pytest.raises(openai.BadRequestError):
        client.embeddings.create(model=MODEL, input="a", dimensions=8)
    # unharmed: health, an embedding and a chat answer
    assert httpx.get(url + "/health").status_code == 200
    assert len(client.embeddings.create(model=MODEL, input="still here").data) == 1
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3)
    assert chat.choices[0].message.content is not None


def test_models_say_the_task(server):
    m = httpx.get(server.url + "/v1/models").json()["data"][0]
    assert m["task"] == "generate" and "embeddings" in m["capabilities"]
    assert m["embedding"]["poolings"] == ["last", "mean"] and m["embedding"]["dimensions"] is None
    assert "cosine" in m["rerank"]


# -- the encoder ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def encoder(minilm):  # noqa: F811 (a fixture's name)
    srv = ServerProcess("--model", ENCODER).wait_ready()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def st_model(minilm):  # noqa: F811
    st = pytest.importorskip("sentence_transformers")
    return st.SentenceTransformer(minilm, device="cpu")


def test_encoder_embeddings_match_sentence_transformers(encoder, st_model):
    client = openai.OpenAI(base_url=encoder.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    want = st_model.encode(SENTENCES)
    for fmt in ("float", "base64"):
        got = client.embeddings.create(model=ENCODER, input=SENTENCES, **({"encoding_format": fmt}
                                                                          if fmt == "float" else {}))
        assert len(got.data) == len(SENTENCES) and len(got.data[0].embedding) == 384
        for d in got.data:
            assert cos(d.embedding, want[d.index]) >= 0.9999, (fmt, d.index)


def test_encoder_rerank(encoder, st_model):
    """The Paris documents first; each score is the cosine of SentenceTransformer's
    query and document vectors; top_n, return_documents, {text} documents, /rerank."""
    r = post(encoder.url, "/v1/rerank", {"model": ENCODER, "query": QUERY, "documents": DOCS})
    assert r.status_code == 200, r.text
    body = r.json()
    order = [x["index"] for x in body["results"]]
    assert order[:2] == [1, 2] and sorted(order) == [0, 1, 2, 3]
    scores = [x["relevance_score"] for x in body["results"]]
    assert scores == sorted(scores, reverse=True)
    q, *d = st_model.encode([QUERY, *DOCS])
    for x in body["results"]:
        assert abs(x["relevance_score"] - cos(q, d[x["index"]])) < 1e-4
        assert x["document"]["text"] == DOCS[x["index"]]
    assert body["usage"]["prompt_tokens"] > 0
    short = post(encoder.url, "/rerank", {"model": ENCODER, "query": QUERY, "top_n": 1, "return_documents": False,
                                          "documents": [{"text": t} for t in DOCS]}).json()
    assert short["results"] == [{"index": 1, "relevance_score": body["results"][0]["relevance_score"]}]


def test_encoder_refuses(encoder):
    url = encoder.url
    r = post(url, "/v1/chat/completions", {"model": ENCODER, "messages": [{"role": "user", "content": "hi"}]})
    assert_client_error(r, param="model")
    assert "embedding model" in r.json()["error"]["message"]
    assert_client_error(post(url, "/v1/completions", {"model": ENCODER, "prompt": "hi"}), param="model")
    assert_client_error(post(url, "/v1/embeddings", {"model": ENCODER, "input": "word " * 300}), param="input")
    assert_client_error(post(url, "/v1/embeddings", {"model": ENCODER, "input": "a", "dimensions": 128}),
                        param="dimensions")
    assert_client_error(post(url, "/v1/embeddings", {"model": ENCODER, "input": "a", "pooling": "last"}),
                        param="pooling")
    for body in ({"query": QUERY, "documents": []}, {"query": "", "documents": DOCS},
                 {"query": QUERY, "documents": ["x"] * 64}, {"query": QUERY, "documents": [3]},
                 {"query": QUERY, "documents": DOCS, "top_n": 0}):
        assert_client_error(post(url, "/v1/rerank", {"model": ENCODER, **body}))
    m = httpx.get(url + "/v1/models").json()["data"][0]
    assert m["task"] == "embed" and m["capabilities"] == ["embeddings", "rerank"]
    assert m["embedding"] == {"size": 384, "poolings": ["mean"], "dimensions": None}
    assert httpx.get(url + "/health").status_code == 200
    assert len(post(url, "/v1/embeddings", {"model": ENCODER, "input": "fine"}).json()["data"]) == 1


def test_matryoshka_dimensions(tmp_path_factory, minilm):  # noqa: F811
    """A model whose config.json says it was trained for truncation: `dimensions`
    truncates and renormalizes; a size it was not trained for is a 400. (A tiny random
    encoder with the MiniLM vocabulary's tokenizer, served in-process.)"""
    import shutil

    import uvicorn

    from tokenmill.engine.factory import make_engine
    from tokenmill.server.app import build_app
    from tokenmill.server.options import ServeOptions

    folder = tmp_path_factory.mktemp("matryoshka")
    tiny_encoder(folder, vocab_size=30522, matryoshka_dimensions=[16, 32])
    shutil.copy(f"{minilm}/tokenizer.json", folder / "tokenizer.json")
    engine = make_engine(ServeOptions(model=str(folder)).engine_config(), "thread")
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(build_app(engine), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        name = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        full = post(url, "/v1/embeddings", {"model": name, "input": "a cat"}).json()["data"][0]["embedding"]
        cut = post(url, "/v1/embeddings", {"model": name, "input": "a cat", "dimensions": 16}).json()
        vec = cut["data"][0]["embedding"]
        assert len(vec) == 16 and torch.allclose(torch.tensor(vec),
                                                 torch.nn.functional.normalize(torch.tensor(full[:16]), dim=0))
        assert_client_error(post(url, "/v1/embeddings", {"model": name, "input": "a", "dimensions": 20}),
                            param="dimensions")
    finally:
        server.should_exit = True
        thread.join(30)
