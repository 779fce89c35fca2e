"""The multi-turn agent workload: conversations reproducible from the seed, every turn built
on the previous turn's prompt and the server's real answer, conversations in a closed loop;
`tokenmill bench --conversations` end to end against the fake server, and against a real
server whose prefix cache serves later turns."""

from __future__ import annotations

import json
import time

import pytest
import typer
from typer.testing import CliRunner

from tests.bench.fake_server import Behavior, FakeOpenAIServer
from tokenmill.bench.agent import build_conversations
from tokenmill.bench.cli import bench
from tokenmill.bench.client import ClientConfig
from tokenmill.bench.harness import BenchConfig, run_benchmark
from tokenmill.bench.runner import RunSpec
from tokenmill.bench.stats import Slo
from tokenmill.bench.workload import AgentConfig, LengthDist, WorkloadConfig


def workload(seed: int = 0, **agent) -> WorkloadConfig:
    defaults = dict(conversations=5, turns=3, prefix_len=40, num_prefixes=1)
    return WorkloadConfig(input_len=LengthDist(8, "uniform", 0.5), output_len=LengthDist(6, "uniform", 0.5),
                          seed=seed, agent=AgentConfig(**(defaults | agent)))


def test_conversations_are_reproducible_from_the_seed():
    a, b = build_conversations(workload(seed=1)), build_conversations(workload(seed=1))
    assert a == b and len(a) == 5 and all(len(c.turns) == 3 for c in a)
    other = build_conversations(workload(seed=2))
    assert [t.user for c in other for t in c.turns] != [t.user for c in a for t in c.turns]
    assert other[0].system != a[0].system
    # each run of a sweep has its own conversations, on the same shared prefix
    run1 = build_conversations(workload(seed=1), run_index=1)
    assert run1 == build_conversations(workload(seed=1), run_index=1)
    assert not {t.user for c in run1 for t in c.turns} & {t.user for c in a for t in c.turns}
    assert {c.system for c in run1} == {a[0].system}
    assert len(a[0].system.split()) == 40


def test_prefixes_are_shared_and_dealt_in_turn():
    one = build_conversations(workload(conversations=6))
    assert len({c.system for c in one}) == 1
    three = build_conversations(workload(conversations=6, num_prefixes=3))
    systems = [c.system for c in three]
    assert len(set(systems)) == 3 and systems[:3] == systems[3:]


def test_each_turn_extends_the_previous_prompt_and_answer():
    conv = build_conversations(workload(turns=4))[2]
    answers = [" first answer.", " a second one", "third\n"]
    for k in range(1, 4):
        prev, cur = conv.request(k - 1, answers[:k - 1]), conv.request(k, answers[:k])
        assert cur.messages[:len(prev.messages)] == prev.messages
        assert cur.messages[len(prev.messages)] == {"role": "assistant", "content": answers[k - 1]}
        assert cur.messages[-1] == {"role": "user", "content": conv.turns[k].user}
        assert cur.prompt.startswith(prev.prompt + answers[k - 1])
        assert cur.prompt.endswith(conv.turns[k].user + "\nAssistant:")
        assert (cur.conversation, cur.turn, cur.index, cur.max_tokens) == (2, k, 2 * 4 + k, conv.turns[k].max_tokens)
    assert conv.request(0, []).messages[0] == {"role": "system", "content": conv.system}
    with pytest.raises(AssertionError):
        conv.request(2, answers[:1])


def test_think_times_are_drawn_with_the_asked_mean():
    convs = build_conversations(workload(conversations=200, turns=5, think_time_s=2.0))
    thinks = [t.think_s for c in convs for t in c.turns[1:]]
    assert all(c.turns[0].think_s == 0 for c in convs)
    assert abs(sum(thinks) / len(thinks) - 2.0) < 0.2 and len(set(thinks)) == len(thinks)
    assert {t.think_s for c in build_conversations(workload()) for t in c.turns} == {0.0}


def test_a_jsonl_trace_is_replayed_as_written(tmp_path):
    path = tmp_path / "trace.jsonl"
    fix = {"user": "fix it", "max_tokens": 9, "think_s": 0.25}
    rows = [{"system": "You are a coding agent.", "turns": ["open the file", fix]},
            {"turns": [{"user": "hello"}]}, {"turns": ["never read"]}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    w = WorkloadConfig(prompts_file=path, output_len=LengthDist(7), seed=1,
                       agent=AgentConfig(conversations=2, think_time_s=1.0))
    a, b = build_conversations(w), build_conversations(w, run_index=1)
    assert a == b and len(a) == 2
    assert [t.user for t in a[0].turns] == ["open the file", "fix it"] and a[0].turns[1].max_tokens == 9
    assert a[0].turns[0].max_tokens == 7 and a[0].turns[0].think_s == 0 and a[0].turns[1].think_s == 0.25
    assert a[1].system == "" and a[1].request(0, []).messages == [{"role": "user", "content": "hello"}]
    assert a[0].request(1, [" ok"]).messages[0] == {"role": "system", "content": "You are a coding agent."}
    bad_files = [("{", "not JSON"), ({"turns": []}, "non-empty list"), ({"turns": [{"text": "x"}]}, "string 'user'"),
                 ({"turns": [{"user": "x", "max_tokens": 0}]}, "max_tokens"), ({"turns": ["x"]}, "1 conversations, 2")]
    for bad, says in bad_files:
        path.write_text((bad if isinstance(bad, str) else json.dumps(bad)) + "\n")
        with pytest.raises(ValueError, match=says):
            build_conversations(w)


def _run(base_url: str, w: WorkloadConfig, concurrency: int, endpoint: str = "chat") -> dict:
    client = ClientConfig(base_url=base_url, model="fake-model", endpoint=endpoint,  # type: ignore[arg-type]
                          request_timeout_s=30)
    cfg = BenchConfig(client=client,
                      workload=w, runs=(RunSpec("closed", w.agent.num_requests, concurrency=concurrency),),
                      slo=Slo(ttft_ms=1000), warmup=0)
    return run_benchmark(cfg)


def test_replay_sends_real_answers_one_turn_at_a_time():
    """Against the fake server: every turn carries the answers the server streamed before,
    a conversation's turns never overlap, and `concurrency` conversations run at once."""
    w = workload(conversations=4, turns=3, think_time_s=0.05)
    plan = lambda i, body: Behavior(ttft_s=0.03, itl_s=0.01, cached_tokens=len(body["messages"]))  # noqa: E731
    with FakeOpenAIServer(plan) as srv:
        t0 = time.perf_counter()
        res = _run(srv.base_url, w, concurrency=2)
        wall = time.perf_counter() - t0
        bodies = srv.bodies
    run = res["runs"][0]
    assert run["num_ok"] == run["num_requests"] == 12 and run["num_good"] == 12
    convs = build_conversations(w)
    by_conv: dict[str, list[dict]] = {}
    for body in bodies:  # conversations told apart by their first user message
        by_conv.setdefault(body["messages"][1]["content"], []).append(body)
    assert len(by_conv) == 4
    for conv in convs:
        sent = by_conv[conv.turns[0].user]
        assert [len(b["messages"]) for b in sent] == [2, 4, 6]
        for k, body in enumerate(sent):
            assert body["max_tokens"] == conv.turns[k].max_tokens
            answers = [m["content"] for m in body["messages"] if m["role"] == "assistant"]
            assert answers == ["tok " * conv.turns[j].max_tokens for j in range(k)]
            assert body["messages"] == conv.request(k, answers).messages
    recs = run["requests"]
    for a, b in zip(recs, recs[1:]):
        if a["conversation"] == b["conversation"]:  # the next turn only after the answer (and a think)
            assert b["start_s"] >= a["start_s"] + a["e2e_ms"] / 1000
    assert [r["turn"] for r in recs] == [0, 1, 2] * 4
    # two at a time: about half the serial time (each turn ~0.1 s, plus think times)
    serial = sum(r["e2e_ms"] for r in recs) / 1000
    assert wall < 0.8 * serial + 0.5
    prompt = sum(r["prompt_tokens"] for r in recs)
    assert run["cached_tokens_total"] == sum(2 * (t + 1) for t in range(3)) * 4
    assert run["cached_token_share"] == pytest.approx(run["cached_tokens_total"] / prompt)
    assert list(run["by_turn"]) == ["1", "2", "3"] and run["by_turn"]["2"]["requests"] == 4
    assert run["by_turn"]["1"]["cached_tokens_total"] == 2 * 4


def test_completions_endpoint_replays_text_and_a_failed_turn_ends_its_conversation():
    w = workload(conversations=2, turns=3)
    plan = lambda i, body: Behavior(ttft_s=0.01, itl_s=0.005, kind="http_500" if i == 1 else "ok")  # noqa: E731
    with FakeOpenAIServer(plan) as srv:
        res = _run(srv.base_url, w, concurrency=1, endpoint="completions")
        bodies = srv.bodies
    run = res["runs"][0]
    # the first conversation's second turn failed: its third is never sent
    assert run["num_requests"] == 1 + 1 + 3 and run["errors_by_kind"] == {"http_500": 1}
    assert run["cached_token_share"] is None  # the fake server said nothing about its cache
    assert bodies[3]["prompt"].startswith(bodies[2]["prompt"] + "tok " * bodies[2]["max_tokens"])


def app() -> typer.Typer:
    a = typer.Typer()
    a.command()(bench)
    return a


def test_cli_agent_workload_report(tmp_path):
    plan = lambda i, body: Behavior(ttft_s=0.01, itl_s=0.005, cached_tokens=3)  # noqa: E731
    with FakeOpenAIServer(plan) as srv:
        result = CliRunner().invoke(app(), [
            "--base-url", srv.base_url, "--endpoint", "chat", "--conversations", "3", "--turns", "2",
            "--prefix-len", "30", "--num-prefixes", "2", "--think-time", "0.01", "--concurrency", "1,3",
            "--input-len", "5", "--output-len", "4", "--out", str(tmp_path), "--no-plots", "--no-progress"])
    assert result.exit_code == 0, result.output
    res = json.loads((tmp_path / "results.json").read_text())
    assert res["meta"]["workload"]["agent"] == {"conversations": 3, "turns": 2, "prefix_len": 30,
                                                "num_prefixes": 2, "think_time_s": 0.01}
    assert [r["num_ok"] for r in res["runs"]] == [6, 6]
    report = (tmp_path / "report.md").read_text()
    assert "agent: 3 conversations x 2 turns, 2 shared prefixes of 30 tokens" in report
    assert "## By turn" in report and "| c=3 | 2 | 3 |" in report


def test_cli_replays_a_trace_file(tmp_path):
    trace = tmp_path / "trace.jsonl"
    trace.write_text(json.dumps({"system": "s", "turns": ["a", "b", "c"]}) + "\n"
                     + json.dumps({"turns": ["d"]}) + "\n")
    with FakeOpenAIServer(lambda i, body: Behavior(ttft_s=0.01, itl_s=0.005)) as srv:
        result = CliRunner().invoke(app(), [
            "--base-url", srv.base_url, "--endpoint", "chat", "--conversations", "2", "--prompts-file", str(trace),
            "--output-len", "3", "--concurrency", "2", "--out", str(tmp_path), "--no-plots", "--no-progress"])
        bodies = srv.bodies
    assert result.exit_code == 0, result.output
    res = json.loads((tmp_path / "results.json").read_text())
    assert res["runs"][0]["num_ok"] == 4 and len(bodies) == 1 + 4  # the warm-up, then every turn
    assert sorted(b["messages"][-1]["content"] for b in bodies[1:]) == ["a", "b", "c", "d"]
    result = CliRunner().invoke(app(), ["--model", "m", "--no-progress", "--conversations", "3", "--prompts-file",
                                        str(trace)])
    assert result.exit_code == 2 and "2 conversations, 3 asked for" in result.output, result.output


@pytest.mark.parametrize("args, says", [
    (["--conversations", "2", "--request-rate", "1"], "--request-rate"),
    (["--conversations", "2", "--num-requests", "9"], "--num-requests"),
    (["--conversations", "2", "--shared-prefix", "0.5"], "--shared-prefix"),
    (["--turns", "3"], "only apply with --conversations"),
    (["--conversations", "0"], "conversations must be >= 1"),
    (["--conversations", "2", "--think-time", "-1"], "think time"),
    (["--conversations", "2", "--prompts-file", "/no/such.jsonl"], "does not exist"),
    (["--conversations", "2", "--prompts-file", __file__, "--turns", "2"], "--turns (the trace decides)"),
])
def test_cli_refuses_options_the_agent_workload_would_ignore(args, says):
    result = CliRunner().invoke(app(), ["--model", "m", "--no-progress", *args])
    assert result.exit_code == 2 and says in result.output, result.output


@pytest.mark.slow
def test_real_server_serves_later_turns_from_its_prefix_cache():
    """`tokenmill serve` on the embedded model: its chat template renders the history so
    that each turn's prompt starts with the previous turn's, so every later turn finds at
    least the previous prompt's full blocks (less one, for a merge at the answer's edge)
    in the prefix cache."""
    from tests.server.conftest import MODEL, ServerProcess

    srv = ServerProcess("--no-batch-api").wait_ready()
    try:
        w = WorkloadConfig(input_len=LengthDist(16), output_len=LengthDist(8), seed=5,
                           agent=AgentConfig(conversations=2, turns=3, prefix_len=200))
        cfg = BenchConfig(client=ClientConfig(base_url=srv.url, model=MODEL, endpoint="chat", request_timeout_s=120),
                          workload=w, runs=(RunSpec("closed", w.agent.num_requests, concurrency=2),), warmup=0)
        run = run_benchmark(cfg)["runs"][0]
    finally:
        srv.stop()
    recs = run["requests"]
    assert run["num_ok"] == 6, run["errors_by_kind"]
    for prev, cur in zip(recs, recs[1:]):
        if cur["turn"] == 0:
            continue
        assert cur["prompt_tokens"] >= prev["prompt_tokens"] + prev["output_tokens"] + 16
        assert cur["cached_tokens"] >= (prev["prompt_tokens"] + prev["output_tokens"]) // 16 * 16 - 16, (prev, cur)
    assert run["by_turn"]["3"]["cached_token_share"] > 0.8
