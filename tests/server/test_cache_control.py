"""Anthropic-style cache_control breakpoints on chat messages, through a real server on
the embedded model priced with the shipped claude-haiku-4.5 card: the marked prefix is
written once (priced by its TTL), then read (at the cached rate); bad breakpoints are 400s."""

from __future__ import annotations

import pytest

from tests.server.conftest import ServerProcess

openai = pytest.importorskip("openai")

SYSTEM = " ".join(f"Rule {i}: answer in plain words, cite the clause, and keep it under {i + 20} words."
                  for i in range(40))
MTOK = 1_000_000


@pytest.fixture(scope="module")
def client():
    srv = ServerProcess("--dtype", "float32", "--quantization", "none", "--price-card", "claude-haiku-4.5",
                        "--no-batch-api").wait_ready()
    yield openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    srv.stop()


def _ask(client, question, ttl="1h", on_message=False):
    control = {"type": "ephemeral", "ttl": ttl}
    system = ({"role": "system", "content": SYSTEM, "cache_control": control} if on_message else
              {"role": "system", "content": [{"type": "text", "text": SYSTEM, "cache_control": control}]})
    r = client.chat.completions.create(model="SmolLM2-135M-Instruct", max_tokens=4, temperature=0,
                                       messages=[system, {"role": "user", "content": question}])
    return r.usage.model_dump()


def test_a_marked_prefix_is_written_once_then_read(client):
    u = _ask(client, "What is rule 7?")
    written = u["prompt_tokens_details"]["cache_write_tokens"]
    assert 600 < written < u["prompt_tokens"] and written % 16 == 0
    assert u["prompt_tokens_details"]["cached_tokens"] == u["cache_read_input_tokens"] == 0
    assert u["cache_creation_input_tokens"] == written
    assert u["cache_creation"] == {"ephemeral_5m_input_tokens": 0, "ephemeral_1h_input_tokens": written}
    cost = u["cost"]
    assert cost["card"] == "claude-haiku-4.5"
    assert cost["cache_write_usd"] == pytest.approx(written * 2.00 / MTOK)  # the 1h write: 2x input
    assert cost["input_usd"] == pytest.approx((u["prompt_tokens"] - written) * 1.00 / MTOK)

    again = _ask(client, "And rule 9?", on_message=True)  # the same prefix, marked on the message
    cached = again["prompt_tokens_details"]["cached_tokens"]
    assert cached >= written and again["prompt_tokens_details"]["cache_write_tokens"] == 0
    assert again["cost"]["cached_input_usd"] == pytest.approx(cached * 0.10 / MTOK)
    assert again["cost"]["cache_write_usd"] == 0


def test_a_5m_write_is_priced_as_one(client):
    u = _ask(client, "Rule 3?", ttl="5m")
    # the 1h pin of the first test holds the system prompt already: only new blocks count
    w = u["cache_creation"]["ephemeral_5m_input_tokens"]
    assert u["cost"]["cache_write_usd"] == pytest.approx(w * 1.25 / MTOK)


@pytest.mark.parametrize("control,says", [({"type": "ephemeral", "ttl": "10m"}, "'5m' or '1h'"),
                                          ({"type": "persistent"}, "'ephemeral'")])
def test_a_bad_breakpoint_is_a_400(client, control, says):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="SmolLM2-135M-Instruct", max_tokens=2, messages=[
            {"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": control}]}])
    assert err.value.body["param"] == "messages"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="SmolLM2-135M-Instruct", max_tokens=2, messages=[
            {"role": "user", "content": "hi", "cache_control": control}])
    assert err.value.body["param"] == "messages" and says in err.value.message


def test_at_most_four_breakpoints(client):
    parts = [{"type": "text", "text": f"part {i}. ", "cache_control": {"type": "ephemeral"}} for i in range(5)]
    with pytest.raises(openai.BadRequestError, match="at most 4") as err:
        client.chat.completions.create(model="SmolLM2-135M-Instruct", max_tokens=2,
                                       messages=[{"role": "user", "content": parts}])
    assert err.value.body["param"] == "cache_control"
