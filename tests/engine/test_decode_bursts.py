"""Several greedy or plain sampled decode steps as one engine step (SchedulerConfig.decode_steps): the same
tokens, text, finish reasons and usage as one step at a time, through the native loop
(bfloat16 + int4) and the step-by-step fallback (other models); stops inside a burst."""

from __future__ import annotations

import pytest

from tests.helpers import make_engine, run_to_completion, tiny_loaded
from tokenmill.engine.api import SamplingParams
from tokenmill.model.fused import FusedDecoder
from tokenmill.model.kernels import native_ops

ops = native_ops()


@pytest.fixture(scope="module")
def tiny():
    return tiny_loaded()


def _prompt(n, offset=1):
    return [(offset + 7 * i) % 290 + 5 for i in range(n)]


def _run(engine, requests):
    """run_to_completion, plus each sample's usage and how many engine steps were taken."""
    tokens, texts, finish, usage, calls = {}, {}, {}, {}, 0
    for rid, (ids, params) in requests.items():
        engine.add_request(rid, ids, params)
    while engine.has_unfinished():
        calls += 1
        for out in engine.step():
            key = (out.request_id, out.index)
            tokens.setdefault(key, []).extend(out.new_token_ids)
            texts[key] = texts.get(key, "") + out.text
            if out.finished:
                finish[key] = (out.finish_reason, out.stop_reason)
                usage[key] = out.num_output_tokens
        engine.kv.check_integrity()
    assert engine.kv.num_used_blocks == 0  # no block left behind (cached ones are free)
    return (tokens, texts, finish, usage), calls


def _both(loaded, requests, **kw):
    """The same requests one step at a time and in bursts (32 steps shared among the
    sequences): (results, engine steps) each."""
    one = _run(make_engine(loaded, decode_steps=1, **kw), requests)
    burst = _run(make_engine(loaded, decode_steps=32, **kw), requests)
    return one, burst


def test_bursts_equal_single_steps_on_the_fallback_path(tiny):
    greedy = _run(make_engine(tiny), {"g": (_prompt(12), SamplingParams(
        temperature=0, max_tokens=40, ignore_eos=True))})[0][0][("g", 0)]
    stop_tok = greedy[13]  # a stop token id that comes up (at the latest) inside a later burst
    first = greedy.index(stop_tok)
    requests = {
        "long": (_prompt(12), SamplingParams(temperature=0, max_tokens=37, ignore_eos=True)),
        "stop_tok": (_prompt(12), SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[stop_tok])),
        "n2": (_prompt(20, 3), SamplingParams(temperature=0, max_tokens=19, n=2)),
        "short": (_prompt(5, 9), SamplingParams(temperature=0, max_tokens=3)),
        # plain sampled: the fallback steps advance the output position the draw uses
        "sampled": (_prompt(8, 5), SamplingParams(temperature=1.0, seed=11, max_tokens=30, ignore_eos=True)),
        # truncated sampling bursts as well
        "top_p": (_prompt(8, 5), SamplingParams(temperature=1.0, top_p=0.7, seed=11, max_tokens=30, ignore_eos=True)),
        "top_k": (_prompt(8, 5), SamplingParams(temperature=1.2, top_k=4, min_p=0.1, seed=11, max_tokens=30,
                                                ignore_eos=True)),
    }
    (one, one_steps), (burst, burst_calls) = _both(tiny, requests, max_model_len=64)
    assert len(set(one[0][("sampled", 0)])) > 5
    # the same prompt and seed: truncation changed the draws
    assert one[0][("top_p", 0)] != one[0][("sampled", 0)] != one[0][("top_k", 0)]
    assert burst == one
    assert one[0][("stop_tok", 0)] == greedy[:first + 1] and one[2][("stop_tok", 0)] == ("stop", stop_tok)
    assert one[3][("long", 0)] == 37
    assert burst_calls * 3 < one_steps  # bursts did happen
    # a model's context window ends a burst as it ends a request
    capped = _both(tiny, {"cap": (_prompt(50), SamplingParams(temperature=0, max_tokens=None,
                                                                 ignore_eos=True))}, max_model_len=64)
    assert capped[0][0] == capped[1][0] and capped[0][0][3][("cap", 0)] == 14


def test_requests_that_need_every_step_run_one_step_at_a_time(tiny):
    engine = make_engine(tiny, decode_steps=8)
    sched = engine.scheduler
    for rid, sp in (("logprobs", SamplingParams(temperature=0, logprobs=2, max_tokens=20)),
                    ("penalty", SamplingParams(temperature=0, frequency_penalty=1.0, max_tokens=20)),
                    ("min_tokens", SamplingParams(temperature=0, min_tokens=6, max_tokens=20))):
        engine.add_request(rid, _prompt(10), sp)
        engine.step()  # prefill
        steps = []
        while engine.has_unfinished():
            out = sched.schedule()
            steps.append(out.num_steps)
            result = engine.runner.execute(out)
            sched.update(out, result.sampled)
            for req in list(sched.requests.values()):  # drop text state: no output processing here
                if req.finished:
                    engine.outputs.drop(req.request_id)
        if rid == "min_tokens":  # one at a time until min_tokens is met, then bursts
            assert steps[:5] == [1] * 5 and max(steps) == 8
        else:
            assert set(steps) == {1}, rid


def test_no_burst_in_a_step_that_admits_and_blocks_are_allocated_ahead(tiny):
    engine = make_engine(tiny, decode_steps=8, max_num_seqs=2)
    sched = engine.scheduler
    engine.add_request("a", _prompt(10), SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    engine.step()  # prefill
    out = sched.schedule()
    assert out.num_steps == 8
    req = sched.requests["a"]
    # the blocks hold the 8 steps' positions
    assert len(engine.kv.blocks_of("a")) * engine.kv.block_size >= req.num_computed_tokens + 8
    sched.update(out, engine.runner.execute(out).sampled)
    assert req.num_output_tokens == 9 and req.num_computed_tokens == req.num_tokens - 1
    engine.add_request("b", _prompt(10, 2), SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    out = sched.schedule()
    assert out.num_steps == 1 and [len(s.token_ids) for s in out.scheduled] == [1, 10]  # b admitted: no burst
    sched.update(out, engine.runner.execute(out).sampled)
    # c finds both slots taken: it waits, and the two decodes burst meanwhile
    engine.add_request("c", _prompt(10, 3), SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    out = sched.schedule()
    assert out.num_steps == 4 and len(sched.waiting) == 1
    sched.update(out, engine.runner.execute(out).sampled)
    assert "b" not in sched.requests  # its 5th token (max_tokens) came in the burst: finished
    out = sched.schedule()  # c takes b's slot now
    assert [s.request_id for s in out.scheduled] == ["a", "c"] and out.num_steps == 1


def test_burst_steps_are_shared_among_the_sequences(tiny):
    engine = make_engine(tiny, decode_steps=8)
    for i in range(3):
        engine.add_request(f"r{i}", _prompt(10, i), SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    engine.step()  # the three prefills
    seen = []
    while engine.has_unfinished():
        out = engine.scheduler.schedule()
        seen.append((len(out.scheduled), out.num_steps))
        engine.scheduler.update(out, engine.runner.execute(out).sampled)
        if len(seen) == 3:
            engine.abort("r0")
        if len(seen) == 6:
            engine.abort("r1")
    assert seen[:3] == [(3, 2)] * 3 and seen[3:6] == [(2, 4)] * 3 and seen[6][0] == 1 and seen[6][1] == 8


def test_stop_string_inside_a_burst(smol):
    tok = smol.tokenizer
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}]),
                     add_special_tokens=False)
    # "l of Fr" ends inside the fourth token: inside the first burst; the length limit (12)
    # comes later in the same engine step when bursts are 12 long
    for stop, include in (("l of Fr", False), ("l of Fr", True), ("Paris", False)):
        sp = SamplingParams(temperature=0, max_tokens=12, stop=[stop], include_stop_str_in_output=include)
        one = _run(make_engine(smol, num_blocks=64, decode_steps=1), {"q": (ids, sp)})[0]
        many = _run(make_engine(smol, num_blocks=64, decode_steps=12), {"q": (ids, sp)})[0]
        assert many == one
        assert one[2][("q", 0)] == ("stop", stop)
        assert one[1][("q", 0)].endswith(stop) == include
    # a stop string completed by the last token allowed still ends the text, as "stop"
    sp = SamplingParams(temperature=0, max_tokens=12)
    full = _run(make_engine(smol, num_blocks=64, decode_steps=1), {"q": (ids, sp)})[0]
    toks = full[0][("q", 0)]
    n = next(i for i in range(1, 13) if "Paris" in tok.decode(toks[:i]))
    sp = SamplingParams(temperature=0, max_tokens=n, stop=["Paris"])
    for steps in (1, 8):
        res = _run(make_engine(smol, num_blocks=64, decode_steps=steps), {"q": (ids, sp)})[0]
        assert res[2][("q", 0)] == ("stop", "Paris") and "Paris" not in res[1][("q", 0)]


def test_bursts_equal_single_steps_through_the_native_loop(smol_int4, monkeypatch):
    if ops is None or not ops.decode_step_available():
        pytest.skip("the native decode loop needs the build with AVX-512 VNNI and BF16")
    tok = smol_int4.tokenizer
    native = []
    inner = FusedDecoder.decode_steps

    def counting(self, *args):
        toks = inner(self, *args)
        native.append(toks is not None)
        return toks

    monkeypatch.setattr(FusedDecoder, "decode_steps", counting)
    chat = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Name three colours."}]),
                      add_special_tokens=False)
    requests = {
        "chat": (chat, SamplingParams(temperature=0, max_tokens=200)),  # ends at EOS
        "long": (tok.encode("1, 2, 3, 4, 5, 6, 7, 8, 9, 10,") * 8,
                 SamplingParams(temperature=0, max_tokens=45, ignore_eos=True)),
        "stop": (tok.encode("The capital of France is"), SamplingParams(temperature=0, max_tokens=30,
                                                                         stop=["."])),
        "n2": (tok.encode("def fibonacci(n):"), SamplingParams(temperature=0, max_tokens=21, n=2,
                                                                ignore_eos=True)),
        # sampled at a temperature: bursts too, drawing what single steps draw
        "sampled": (tok.encode("Once upon a time"), SamplingParams(temperature=0.7, seed=3, max_tokens=40,
                                                                    ignore_eos=True)),
        "hot": (tok.encode("Once upon a time"), SamplingParams(temperature=1.5, seed=4, max_tokens=40,
                                                                ignore_eos=True)),
        # truncated: bursts as well, truncating in the native draw
        "top_p": (tok.encode("Once upon a time"), SamplingParams(temperature=0.9, top_p=0.8, seed=5,
                                                                  max_tokens=30, ignore_eos=True)),
        "top_k_min_p": (tok.encode("Once upon a time"), SamplingParams(temperature=1.1, top_k=20, min_p=0.05,
                                                                        seed=6, max_tokens=30, ignore_eos=True)),
    }
    (one, one_steps), (burst, burst_calls) = _both(smol_int4, requests, num_blocks=128)
    assert burst == one
    assert one[2][("chat", 0)][0] == "stop" and len(one[0][("chat", 0)]) < 200
    assert one[2][("stop", 0)] == ("stop", ".")
    assert burst_calls * 2 < one_steps and native and all(native)


def test_serve_refuses_a_bad_decode_steps():
    from typer.testing import CliRunner

    from tokenmill.cli import app

    result = CliRunner().invoke(app, ["serve", "--decode-steps", "0"])
    assert result.exit_code == 2
    assert "decode_steps must be positive" in result.output


def test_a_one_token_prefill_chunk_is_not_a_burst(tiny):
    # a token budget of 1: every prefill chunk is one token that samples nothing
    requests = {"a": (_prompt(9), SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)),
                "b": (_prompt(5, 4), SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))}
    one = _run(make_engine(tiny, decode_steps=1, max_num_batched_tokens=1), requests)[0]
    burst_engine = make_engine(tiny, decode_steps=8, max_num_batched_tokens=1)
    sched = burst_engine.scheduler
    for rid, (ids, sp) in requests.items():
        burst_engine.add_request(rid, ids, sp)
    out = sched.schedule()
    assert [len(s.token_ids) for s in out.scheduled] == [1] and not out.scheduled[0].sample
    assert out.num_steps == 1
    sched.update(out, burst_engine.runner.execute(out).sampled)
    burst_engine.abort("a")
    burst_engine.abort("b")
    assert _run(make_engine(tiny, decode_steps=8, max_num_batched_tokens=1), requests)[0] == one


def test_no_lookahead_blocks_unless_all_fit(tiny):
    engine = make_engine(tiny, decode_steps=8, num_blocks=4, block_size=4, prefix_caching=False)
    sched = engine.scheduler
    engine.add_request("a", _prompt(3), SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    engine.add_request("b", _prompt(3, 2), SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    engine.step()  # both prefills: a block each
    out = sched.schedule()
    # 4 steps take each one into a second block: the two free ones, exactly
    assert out.num_steps == 4 and engine.kv.num_free_blocks == 0
    sched.update(out, engine.runner.execute(out).sampled)
    out = sched.schedule()  # 3 + 1 + 4 = 8 tokens done: 4 more steps need a third block each
    assert out.num_steps == 1
    assert [len(engine.kv.blocks_of(r)) for r in ("a", "b")] == [2, 2]  # nothing grown for a burst
    sched.update(out, engine.runner.execute(out).sampled)
