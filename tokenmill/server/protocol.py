"""OpenAI request bodies as pydantic models, and their translation to SamplingParams.

Types are checked here (a wrong type is a 400 naming the field); value ranges and
every other bound are checked once, by the engine's RequestLimits, so the engine and
the HTTP API agree on them.
Unknown fields are ignored, as OpenAI-compatible servers commonly do, so newer SDKs
keep working.
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal, Union

from pydantic import (BaseModel, ConfigDict, Field, PrivateAttr, StrictBool, StrictFloat, StrictInt, StrictStr,
                      model_validator)

from tokenmill.engine.api import CACHE_TTLS, InvalidParameter, RequestBounds, SamplingParams, StructuredOutput
from tokenmill.server import tools as tool_calls
from tokenmill.server.limits import parse_keep_alive
from tokenmill.server.strict import strict_schema


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Body):
    include_usage: StrictBool = False


class JsonSchemaFormat(_Body):
    name: StrictStr | None = None
    description: StrictStr | None = None
    schema_: Union[dict[str, Any], StrictBool, None] = Field(default=None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsField(_Body):
    """vLLM's `structured_outputs` (its newer spelling of the guided_* fields)."""
    json_: Union[dict[str, Any], StrictStr, None] = Field(default=None, alias="json")
    regex: StrictStr | None = None
    choice: list[StrictStr] | None = None
    grammar: StrictStr | None = None
    json_object: StrictBool | None = None


class CacheControl(_Body):
    """Anthropic's prompt-cache breakpoint: the prompt up to here stays cached for `ttl`
    (5 minutes or an hour) from each use."""
    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] = "5m"


class ContentPart(_Body):
    type: str
    text: StrictStr | None = None
    cache_control: CacheControl | None = None


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: Union[StrictStr, list[ContentPart], None] = None
    name: StrictStr | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: StrictStr | None = None
    cache_control: CacheControl | None = None  # (as on a content part: after the whole message)

    def cache_marks(self) -> list[tuple[int | None, CacheControl]]:
        """Where this message marks cache breakpoints: (after content part i, or None: after
        the whole message, its control)."""
        marks: list[tuple[int | None, CacheControl]] = []
        if isinstance(self.content, list):
            marks = [(i, p.cache_control) for i, p in enumerate(self.content) if p.cache_control is not None]
        if self.cache_control is not None:
            marks.append((None, self.cache_control))
        return marks

    def as_template_dict(self, parts: int | None = None) -> dict[str, Any]:
        """The message as chat templates read it; `parts`: only its first content parts."""
        content = self.content
        if isinstance(content, list):
            texts = []
            for part in content[:parts]:
                if part.type != "text" or part.text is None:
                    raise ValueError(f"unsupported content part type {part.type!r}; this model reads text only")
                texts.append(part.text)
            content = "".join(texts)
        msg: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role,
                               "content": content or ""}
        if self.name is not None:
            msg["name"] = self.name
        if self.tool_calls is not None:
            msg["tool_calls"] = self.tool_calls
        if self.tool_call_id is not None:
            msg["tool_call_id"] = self.tool_call_id
        return msg


class _SamplingFields(_Body):
    model: StrictStr
    n: StrictInt = 1
    temperature: StrictFloat | None = None
    top_p: StrictFloat | None = None
    stop: Union[StrictStr, list[StrictStr], None] = None
    seed: StrictInt | None = None
    presence_penalty: StrictFloat | None = None
    frequency_penalty: StrictFloat | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: StrictStr | None = None
    # extensions (vLLM-compatible names)
    top_k: StrictInt | None = None
    min_p: StrictFloat | None = None
    repetition_penalty: StrictFloat | None = None
    ignore_eos: StrictBool = False
    min_tokens: StrictInt = 0
    stop_token_ids: list[StrictInt] | None = None
    cache_salt: StrictStr | None = None
    skip_special_tokens: StrictBool = True
    include_stop_str_in_output: StrictBool = False
    priority: Literal["interactive", "batch"] | None = None
    logit_bias: dict[StrictStr, StrictFloat] | None = None
    # false: no speculative drafts for this request (its output is the same either way)
    speculative: StrictBool = True
    # structured outputs: OpenAI's response_format, and vLLM's guided_* / structured_outputs
    response_format: ResponseFormat | None = None
    guided_json: Union[dict[str, Any], StrictStr, None] = None
    guided_regex: StrictStr | None = None
    guided_choice: list[StrictStr] | None = None
    guided_grammar: StrictStr | None = None
    structured_outputs: StructuredOutputsField | None = None
    # Ollama's: how long the model stays loaded once idle after this request, with several
    # models (seconds, or a duration such as "5m"; 0 unloads it then, -1 keeps it loaded)
    keep_alive: Union[StrictInt, StrictFloat, StrictStr, None] = None

    def keep_alive_seconds(self) -> float | None:
        if self.keep_alive is None:
            return None
        try:
            return parse_keep_alive(self.keep_alive)
        except ValueError as exc:
            raise InvalidParameter("keep_alive", str(exc)) from None

    def structured(self) -> tuple[StructuredOutput | None, str]:
        """The one output constraint the body asks for, and the field that asked for it
        (what a 400 names). Two constraints at once are refused."""
        found: list[tuple[StructuredOutput, str]] = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            found.append((StructuredOutput("json_object"), "response_format"))
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.schema_ is None:
                raise InvalidParameter("response_format", "response_format of type json_schema needs "
                                                          "json_schema.schema")
            schema = rf.json_schema.schema_
            found.append((StructuredOutput("json", strict_schema(schema) if rf.json_schema.strict else schema),
                          "response_format"))
        for name, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                           ("guided_grammar", "grammar")):
            value = getattr(self, name)
            if value is not None:
                found.append((StructuredOutput(kind, value), name))
        so = self.structured_outputs
        if so is not None:
            for kind, value in (("json", so.json_), ("regex", so.regex), ("choice", so.choice),
                                ("grammar", so.grammar)):
                if value is not None:
                    found.append((StructuredOutput(kind, value), "structured_outputs"))
            if so.json_object:
                found.append((StructuredOutput("json_object"), "structured_outputs"))
        if len(found) > 1:
            raise InvalidParameter(found[1][1], f"only one output constraint may be given; got "
                                                f"{found[0][1]} and {found[1][1]}")
        return found[0] if found else (None, "response_format")

    def param_renames(self) -> dict[str, str]:
        """SamplingParams' names for the fields this body spells differently."""
        return {"structured": self.structured()[1]}

    def _logit_bias(self) -> dict[int, float] | None:
        if self.logit_bias is None:
            return None
        out: dict[int, float] = {}
        for k, v in self.logit_bias.items():
            try:
                out[int(k)] = v
            except ValueError:
                raise InvalidParameter("logit_bias", f"logit_bias keys must be token ids, got {k!r}") from None
        return out

    def trace_params(self) -> dict[str, Any]:
        """The request's parameters a trace records (gen_ai.request.*), as the client set them."""
        max_tokens = getattr(self, "max_completion_tokens", None)
        return {"model": self.model, "max_tokens": self.max_tokens if max_tokens is None else max_tokens,
                "temperature": self.temperature,
                "top_p": self.top_p, "top_k": self.top_k, "seed": self.seed, "n": self.n,
                "frequency_penalty": self.frequency_penalty, "presence_penalty": self.presence_penalty}

    def common_params(self) -> dict[str, Any]:
        return dict(
            n=self.n,
            # None where the client said nothing: the model's generation defaults apply
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            seed=self.seed,
            stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logit_bias=self._logit_bias(),
            structured=self.structured()[0],
            speculative=self.speculative,
        )


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: StrictInt | None = None
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], dict[str, Any], None] = None
    parallel_tool_calls: StrictBool | None = None
    add_generation_prompt: StrictBool = True
    # OpenAI's prompt-cache hint: accepted; it routes nothing here (one engine holds the
    # cache, and every prompt is cached automatically). cache_control breakpoints pin.
    prompt_cache_key: StrictStr | None = None
    # thinking models (tokenmill/server/reasoning.py): a budget of reasoning tokens, or an
    # effort mapped to one; the template's own switches (enable_thinking)
    thinking_token_budget: StrictInt | None = None
    reasoning_effort: Literal["low", "medium", "high"] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # set by the server from its tokenizer: the call tags are tokens of their own
    _tag_tokens: bool = PrivateAttr(default=False)
    # computed once a request: the checked tools by name, and the output constraint
    _tools: dict[str, dict[str, Any]] | None = PrivateAttr(default=None)
    _constraint: tuple[StructuredOutput | None, str] | None = PrivateAttr(default=None)
    _thinking: Any = PrivateAttr(default=None)  # the request's ThinkingTags, with a reasoning parser

    def for_tokenizer(self, tag_tokens: bool) -> "ChatCompletionRequest":
        self._tag_tokens = tag_tokens
        return self

    @property
    def tools_active(self) -> bool:
        """The tools are offered to the model (rendered, and its calls parsed)."""
        return bool(self.tools) and self.tool_choice != "none"

    def tools_by_name(self) -> dict[str, dict[str, Any]]:
        """The tools checked (with tool_choice), once a request."""
        if self._tools is None:
            self._tools = tool_calls.check_tools(self.tools, self.tool_choice)
        return self._tools

    @property
    def uses_cache_control(self) -> bool:
        return any(m.cache_marks() for m in self.messages)

    def cache_prefixes(self) -> list[tuple[list[dict[str, Any]], int]]:
        """Each cache_control breakpoint as (the messages its cached prefix ends with, as
        template dicts; its TTL in seconds)."""
        out = []
        for i, m in enumerate(self.messages):
            for part, control in m.cache_marks():
                prefix = [x.as_template_dict() for x in self.messages[:i]]
                out.append((prefix + [m.as_template_dict(None if part is None else part + 1)],
                            CACHE_TTLS[control.ttl]))
        return out

    def structured(self) -> tuple[StructuredOutput | None, str]:
        """As for completions, plus tool_choice 'required' or a named function, which
        constrain the output to well-formed calls (a second constraint is refused).
        Computed once a request (after for_tokenizer)."""
        if self._constraint is None:
            self._constraint = self._find_constraint()
        return self._constraint

    def _find_constraint(self) -> tuple[StructuredOutput | None, str]:
        spec, param = super().structured()
        by_name = self.tools_by_name()
        names = tool_calls.forced_names(by_name, self.tool_choice) if self.tools_active else None
        if names is None:
            return spec, param
        if spec is not None:
            raise InvalidParameter(param, f"{param} conflicts with tool_choice {self.tool_choice!r}: "
                                          "the output can follow one constraint")
        parallel = self.tool_choice == "required" and self.parallel_tool_calls is not False
        return tool_calls.call_grammar(by_name, names, parallel, self._tag_tokens), "tools"

    def sampling_params(self) -> SamplingParams:
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        logprobs = None
        if self.logprobs:
            logprobs = self.top_logprobs or 0
        elif self.top_logprobs:
            raise InvalidParameter("top_logprobs", "top_logprobs requires logprobs to be true")
        return SamplingParams(max_tokens=max_tokens, logprobs=logprobs, **self.common_params())

    def param_renames(self) -> dict[str, str]:
        """SamplingParams' names for the fields this body spells differently."""
        return {**super().param_renames(), "logprobs": "top_logprobs",
                "max_tokens": "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"}

    @model_validator(mode="after")
    def _message_shapes(self) -> "ChatCompletionRequest":
        """What OpenAI requires of a message beyond its types: a tool message answers a call
        (tool_call_id) with content; an assistant message has content or tool calls."""
        for i, m in enumerate(self.messages):
            where = f"messages.[{i}]"
            if m.role == "tool" and m.tool_call_id is None:
                raise InvalidParameter(f"{where}.tool_call_id", "Missing parameter 'tool_call_id': messages with "
                                                                "role 'tool' must have a 'tool_call_id'.")
            if m.role == "tool" and m.content is None:
                raise InvalidParameter(f"{where}.content", f"Missing required parameter: '{where}.content'.")
            if m.role == "assistant" and m.content is None and not m.tool_calls:
                raise InvalidParameter(f"{where}.content", f"Invalid value for '{where}.content': an assistant "
                                                           "message needs content or tool_calls.")
        return self


class CompletionRequest(_SamplingFields):
    prompt: Union[StrictStr, list[StrictStr], list[StrictInt], list[list[StrictInt]]]
    max_tokens: StrictInt | None = 16
    logprobs: StrictInt | None = None
    echo: StrictBool = False
    suffix: StrictStr | None = None
    best_of: StrictInt | None = None
    # each choice's output token ids beside its text (vLLM's name): what `tokenmill replay` compares
    return_token_ids: StrictBool = False

    def sampling_params(self) -> SamplingParams:
        if self.best_of is not None and self.best_of != self.n:
            raise InvalidParameter("best_of", "best_of is supported only equal to n (no server-side ranking)")
        return SamplingParams(
            max_tokens=self.max_tokens, logprobs=self.logprobs,
            prompt_logprobs=self.logprobs if (self.echo and self.logprobs is not None) else None,
            **self.common_params())


# -- the body's shape, before it is parsed -----------------------------------------------
_WS = re.compile(r"[ \t\n\r]*")
_DECODER = json.JSONDecoder()


def _array_limits(bounds: RequestBounds) -> dict[str, int]:
    return {"stop": bounds.max_stop, "stop_token_ids": bounds.max_stop_token_ids,
            "logit_bias": bounds.max_logit_bias, "messages": bounds.max_messages,
            "prompt": bounds.max_prompts, "input": bounds.max_prompts, "documents": bounds.max_prompts}


def check_body_shape(raw: bytes, bounds: RequestBounds) -> None:
    """Refuse a body whose bounded lists (stop, stop_token_ids, logit_bias, messages,
    prompt, and the embedding and rerank inputs) hold more entries than any request may,
    before the whole body is parsed: parsing a million stop strings into Python objects
    takes longer than refusing them should. Walks only the top-level object, counting entries of the bounded fields and
    stopping at the first one too many; a malformed body is left to the full parser."""
    limits = _array_limits(bounds)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return
    n = len(text)

    def skip_ws(j: int) -> int:
        return _WS.match(text, j).end()

    i = skip_ws(0)
    if i >= n or text[i] != "{":
        return
    i = skip_ws(i + 1)
    while i < n and text[i] == '"':
        try:
            key, i = json.decoder.scanstring(text, i + 1)
            i = skip_ws(i)
            if text[i] != ":":
                return
            i = skip_ws(i + 1)
            limit = limits.get(key)
            if key in ("prompt", "input") and i < n and text[i] == "[" and text[skip_ws(i + 1)] in "-0123456789":
                limit = None  # one prompt's token ids: parsed at C speed, bounded by the context after
            if limit is not None and i < n and text[i] in "[{":
                close = "]" if text[i] == "[" else "}"
                i = skip_ws(i + 1)
                count = 0
                while i < n and text[i] != close:
                    count += 1
                    if count > limit:
                        raise InvalidParameter(key, f"{key} may have at most {limit} entries")
                    if close == "}":  # logit_bias: "token": value
                        _, i = json.decoder.scanstring(text, i + 1)
                        i = skip_ws(skip_ws(i) + 1)
                    _, i = _DECODER.raw_decode(text, i)
                    i = skip_ws(i)
                    if i < n and text[i] == ",":
                        i = skip_ws(i + 1)
                i += 1
            else:
                _, i = _DECODER.raw_decode(text, i)
            i = skip_ws(i)
            if i < n and text[i] == ",":
                i = skip_ws(i + 1)
        except (json.JSONDecodeError, IndexError):  # malformed: the full parser says how
            return
