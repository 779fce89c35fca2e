"""The reasoning parser on scripted replies: the whole reply and every way of cutting it
into two or three deltas give the same (reasoning, content), whatever the tags' cut."""

import itertools

import pytest

from tokenizers import Regex
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Split

from tokenmill.engine.types import SamplingParams
from tokenmill.model.tokenizer import Tokenizer
from tokenmill.server.reasoning import (EFFORT_BUDGETS, ChatReasoning, ReasoningParser, parser_for_template,
                                        prompt_opens_thinking, split)

# (parser, prompt opened the block, reply, expected reasoning, expected content)
CASES = [
    ("qwen3", False, "<think>\nplan it</think>\n\nThe answer.", "\nplan it", "\n\nThe answer."),
    ("qwen3", False, "  <think>x</think>y", "x", "y"),
    ("qwen3", False, "No thinking here.", None, "No thinking here."),
    ("qwen3", False, "<thin", None, "<thin"),  # a partial tag that never completes is text
    ("qwen3", False, "<think>never closes", "never closes", None),
    ("qwen3", True, "inside already</think>done", "inside already", "done"),
    ("qwen3", True, "still thinking </thi", "still thinking </thi", None),
    ("deepseek_r1", False, "<think>a</think>b", "a", "b"),
    ("deepseek_r1", False, "opened by the template</think>answer", "opened by the template", "answer"),
    ("deepseek_r1", False, "never closes", "never closes", None),
    ("deepseek_r1", True, "r</think></think>c", "r", "</think>c"),
    ("qwen3", False, "<think></think>", None, None),
    ("qwen3", False, "<think>a < b </ c </think>x <think> y", "a < b </ c ", "x <think> y"),
]


def _streamed(kind, inside, pieces):
    p = ReasoningParser(kind, inside)
    r, c = "", ""
    for piece in pieces:
        dr, dc = p.feed(piece)
        r, c = r + dr, c + dc
    dr, dc = p.finish()
    return (r + dr) or None, (c + dc) or None


@pytest.mark.parametrize("kind,inside,reply,reasoning,content", CASES)
def test_whole_reply(kind, inside, reply, reasoning, content):
    assert split(kind, reply, inside) == (reasoning, content)


@pytest.mark.parametrize("kind,inside,reply,reasoning,content", CASES)
def test_every_split_agrees_with_the_whole(kind, inside, reply, reasoning, content):
    n = len(reply)
    for i, j in itertools.combinations_with_replacement(range(n + 1), 2):
        assert _streamed(kind, inside, [reply[:i], reply[i:j], reply[j:]]) == (reasoning, content), (i, j)
    assert _streamed(kind, inside, list(reply)) == (reasoning, content)  # one character a delta


def test_reasoning_streams_before_the_close():
    p = ReasoningParser("qwen3")
    assert p.feed("<think>step one ") == ("step one ", "")
    assert p.feed("and two</th") == ("and two", "")  # the partial tag is held
    assert p.feed("ink>Answer") == ("", "Answer")


def test_template_and_prompt_detection():
    assert parser_for_template("{{ '<think>\\n' }}") == "qwen3"
    assert parser_for_template("{{ messages }}") is None and parser_for_template(None) is None
    assert prompt_opens_thinking("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not prompt_opens_thinking("<|im_start|>assistant\n")


def test_unknown_parser_refused():
    with pytest.raises(ValueError):
        ReasoningParser("nope")


def _tokenizer(template: str | None) -> Tokenizer:
    """A real tokenizer over a word-level vocabulary in which each tag is three tokens."""
    vocab = {w: i for i, w in enumerate(["<unk>", "<", "/", "think", ">", "hi"])}
    hf = HFTokenizer(WordLevel(vocab, unk_token="<unk>"))
    hf.pre_tokenizer = Split(Regex(r"[</>]|\w+"), behavior="isolated")
    return Tokenizer(hf, None, (0,), template)


def test_chat_reasoning_finds_the_tags_and_maps_effort_to_budgets():
    tok = _tokenizer("{{ '<think>' }}")
    r = ChatReasoning.choose(None, tok)
    assert r.kind == "qwen3" and r.tags.open_ids == (1, 3, 4) and r.tags.close_ids == (1, 2, 3, 4)
    assert ChatReasoning.choose("none", tok) is None
    assert ChatReasoning.choose(None, _tokenizer("{{ messages }}")) is None
    assert ChatReasoning.choose("deepseek_r1", tok).tags.always
    for effort, budget in EFFORT_BUDGETS.items():
        params = SamplingParams()
        tags = r.apply("<think>\n", params, None, effort)
        assert params.thinking_token_budget == budget and params.thinking is tags and tags.inside
    params = SamplingParams()
    r.apply("<think></think>", params, 7, "high")  # an explicit budget wins
    assert params.thinking_token_budget == 7 and not params.thinking.inside
    assert EFFORT_BUDGETS == {"low": 256, "medium": 1024, "high": 4096}
