"""The prompts the agent CLIs' requests become: a Claude Code request (Messages API) and a
Codex CLI request (Responses API), each a first turn with tools and a tool round trip,
shaped as the CLIs sent them (2026-12-07: Claude Code 2.1.328, Codex CLI 0.169.0, bodies
logged from the wire and trimmed), served with Qwen2.5-Coder's own chat template
(tests/data/qwen2_5_coder.jinja, byte for byte the one in the Qwen2.5-Coder-1.5B-Instruct
GGUF, Apache-2.0). The token ids the engine ran, read back from `--capture`, are the ids
transformers' `apply_chat_template(messages, tools=..., add_generation_prompt=True)`
gives for the same conversation written as chat messages: the tools block, the system
prompt's place and the history are the model's own format, not a translation of ours."""

from __future__ import annotations

import json
import os
import time

import httpx
import pytest

from tests.server.conftest import MODEL, ServerProcess
from tokenmill.server.capture import CaptureStore

pytestmark = pytest.mark.slow

TEMPLATE = os.path.join(os.path.dirname(__file__), "..", "data", "qwen2_5_coder.jinja")

BASH_SCHEMA = {"$schema": "https://json-schema.org/draft/2020-12/schema", "type": "object", "properties": {
    "command": {"description": "The command to execute", "type": "string"},
    "description": {"description": "Say what it does:\n- ls → \"List files in current directory\"", "type": "string"},
    "timeout": {"description": "Optional timeout in milliseconds", "type": "number"}},
    "required": ["command"], "additionalProperties": False}
CLAUDE = {  # the fields Claude Code sends, the ones with no effect here included
    "model": MODEL, "max_tokens": 1, "stream": False, "temperature": 0,
    "system": [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.328.d9f; cc_entrypoint=sdk-cli;"},
               {"type": "text", "text": "You are a Claude agent, built on Anthropic's Claude Agent SDK.",
                "cache_control": {"type": "ephemeral"}},
               {"type": "text", "text": "You are a coding assistant.", "cache_control": {"type": "ephemeral"}}],
    "tools": [{"name": "Bash", "description": "execute shell commands", "input_schema": BASH_SCHEMA}],
    "messages": [{"role": "user", "content": [{"type": "text", "text": "Use the Bash tool to run: cat notes.txt",
                                               "cache_control": {"type": "ephemeral"}}]}],
    "metadata": {"user_id": '{"device_id":"d6da","session_id":"fb3b"}'},
    "thinking": {"type": "adaptive", "display": "omitted"}, "output_config": {"effort": "high"},
    "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]}}
BASH_CALL = {"command": "cat notes.txt", "description": "Show the notes"}
CLAUDE_ROUND_TRIP = {**CLAUDE, "messages": CLAUDE["messages"] + [
    {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "Bash", "input": BASH_CALL}]},
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "is_error": False,
                                  "content": "The code word is PERIWINKLE."}]}]}

EXEC = {"type": "function", "name": "exec_command", "strict": False,
        "description": "Runs a command in a PTY, returning output or a session ID for ongoing interaction.",
        "parameters": {"type": "object", "required": ["cmd"], "additionalProperties": False, "properties": {
            "cmd": {"type": "string", "description": "Shell command to execute."},
            "yield_time_ms": {"type": "number", "description": "Wait before yielding output."}}}}
SPAWN = {"type": "function", "name": "spawn_agent", "description": "Start a sub-agent.",
         "parameters": {"type": "object", "properties": {"task": {"type": "string"}}}}


def _text(text):
    return {"type": "input_text", "text": text}


CODEX = {  # instructions ride in developer messages; one namespace tool; web_search is hosted
    "model": MODEL, "stream": False, "max_output_tokens": 1, "temperature": 0, "store": False,
    "tool_choice": "auto", "parallel_tool_calls": True, "reasoning": {"summary": "auto"},
    "include": ["reasoning.encrypted_content"], "prompt_cache_key": "01a2",
    "tools": [EXEC, {"type": "namespace", "name": "multi_agent_v1", "description": "Sub-agents.", "tools": [SPAWN]},
              {"type": "web_search", "external_web_access": False}],
    "input": [{"type": "message", "role": "developer", "content": [_text("You are a coding agent.")]},
              {"type": "message", "role": "developer", "content": [
                  _text("<skills_instructions>\nNone.\n</skills_instructions>"),
                  _text("<permissions instructions>\nread-only\n</permissions instructions>")]},
              {"type": "message", "role": "user", "content": [_text("<environment_context>\n  <shell>bash</shell>\n"
                                                                    "</environment_context>")]},
              {"type": "message", "role": "user", "content": [_text("Use the shell to run: cat notes.txt")]}]}
CODEX_ROUND_TRIP = {**CODEX, "input": CODEX["input"] + [
    {"type": "function_call", "call_id": "call_1", "name": "exec_command", "arguments": '{"cmd": "cat notes.txt"}'},
    {"type": "function_call_output", "call_id": "call_1", "output": "Output:\nThe code word is PERIWINKLE.\n"}]}


def _chat_tool(name, description, parameters):
    return {"type": "function", "function": {"name": name, "description": description, "parameters": parameters}}


def _reference_claude(body):
    """The Messages conversation as chat messages, as one would hand it to transformers."""
    msgs = [{"role": "system", "content": "\n".join(b["text"] for b in body["system"])}]
    for m in body["messages"]:
        for b in m["content"]:
            if b["type"] == "text":
                msgs.append({"role": m["role"], "content": b["text"]})
            elif b["type"] == "tool_use":
                msgs.append({"role": "assistant", "content": "", "tool_calls": [
                    {"id": b["id"], "type": "function", "function": {"name": b["name"], "arguments": b["input"]}}]})
            else:
                msgs.append({"role": "tool", "tool_call_id": b["tool_use_id"], "content": b["content"]})
    return msgs, [_chat_tool(t["name"], t["description"], t["input_schema"]) for t in body["tools"]]


def _reference_codex(body):
    msgs = []
    for it in body["input"]:
        if it["type"] == "message":
            msgs.append({"role": "system" if it["role"] == "developer" else it["role"],
                         "content": "".join(p["text"] for p in it["content"])})
        elif it["type"] == "function_call":
            msgs.append({"role": "assistant", "content": "", "tool_calls": [{"id": it["call_id"], "type": "function",
                         "function": {"name": it["name"], "arguments": json.loads(it["arguments"])}}]})
        else:
            msgs.append({"role": "tool", "tool_call_id": it["call_id"], "content": it["output"]})
    tools = [_chat_tool(EXEC["name"], EXEC["description"], EXEC["parameters"]),
             _chat_tool("multi_agent_v1__spawn_agent", SPAWN["description"], SPAWN["parameters"])]
    return msgs, tools


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    db = str(tmp_path_factory.mktemp("captures") / "captures.db")
    srv = ServerProcess("--chat-template", TEMPLATE, "--capture", "all", "--capture-db", db).wait_ready()
    yield srv, db
    srv.stop()


def _captured_prompt(db, rid, timeout=30.0):
    deadline = time.monotonic() + timeout
    while True:
        store = CaptureStore(db, read_only=True)
        got = store.get(rid)
        store.close()
        if got is not None or time.monotonic() > deadline:
            assert got is not None, f"{rid} was not captured"
            return got.prompts[0]
        time.sleep(0.2)


@pytest.mark.parametrize("route,body,reference", [
    ("/v1/messages", CLAUDE, _reference_claude), ("/v1/messages", CLAUDE_ROUND_TRIP, _reference_claude),
    ("/v1/responses", CODEX, _reference_codex), ("/v1/responses", CODEX_ROUND_TRIP, _reference_codex)],
    ids=["claude-code", "claude-code-round-trip", "codex", "codex-round-trip"])
def test_agent_requests_render_as_the_models_template_does(served, embedded_path, route, body, reference):
    transformers = pytest.importorskip("transformers")
    from tokenmill.model.loader import load_metadata

    srv, db = served
    r = httpx.post(srv.url + route, json=body, headers={"x-api-key": "unused"}, timeout=120)
    assert r.status_code == 200, r.text
    _, tok = load_metadata(embedded_path)
    ref = transformers.PreTrainedTokenizerFast(tokenizer_object=tok.hf)
    with open(TEMPLATE, encoding="utf-8") as f:
        ref.chat_template = f.read()
    messages, tools = reference(body)
    text = ref.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    assert "<tools>" in text and text.count("<|im_start|>system") == (2 if route == "/v1/responses" else 1)
    if body in (CLAUDE_ROUND_TRIP, CODEX_ROUND_TRIP):
        assert "<tool_response>" in text and "PERIWINKLE" in text and '"arguments": {"c' in text
    expected = ref(text, add_special_tokens=False)["input_ids"]
    assert _captured_prompt(db, r.json()["id"]) == expected
