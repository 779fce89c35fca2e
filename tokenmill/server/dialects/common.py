"""What every dialect shares: building the one ChatCompletionRequest a dialect's body
translates to, and naming a refused parameter as the dialect spells it."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from tokenmill.server.errors import APIError, as_api_error, validation_error
from tokenmill.server.protocol import ChatCompletionRequest


def chat_request(fields: dict[str, Any], renames: dict[str, str]) -> ChatCompletionRequest:
    """The chat body a dialect's request stands for. A value the chat body refuses is
    the client's 400, named by the dialect's field."""
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as exc:
        raise renamed(validation_error(exc.errors()), renames) from None


def renamed(exc: Exception, renames: dict[str, str]) -> Exception:
    """A client's error with its parameter (and the message's first mention of it) in
    the dialect's spelling: a Messages client sent `stop_sequences`, not `stop`. Any
    other exception (a bug) is returned as it is."""
    exc = as_api_error(exc) or exc
    if not isinstance(exc, APIError):
        return exc
    new = renames.get(exc.param or "")
    if new is None:
        return exc
    return APIError(exc.status, exc.message.replace(exc.param, new, 1), param=new, code=exc.code,
                    headers=exc.headers, type_=exc.type)
