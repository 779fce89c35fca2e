"""LangChain's structured output against the server: `with_structured_output` through
response_format json_schema (strict and not) and through a forced function call, each
parsed into the caller's pydantic model. (instructor is not tested here: its pins,
jiter<0.15 and rich<15, conflict with the openai SDK the tests use, which needs
jiter>=0.16.)"""

from __future__ import annotations

import pytest
from pydantic import BaseModel

from tests.server.conftest import MODEL

langchain_openai = pytest.importorskip("langchain_openai")


class Cat(BaseModel):
    name: str
    age: int


@pytest.mark.parametrize("method,strict", [("json_schema", True), ("json_schema", None),
                                           ("function_calling", True)])
def test_with_structured_output_returns_the_model(server, method, strict):
    llm = langchain_openai.ChatOpenAI(base_url=server.url + "/v1", api_key="unused", model=MODEL, temperature=0,
                                      max_tokens=48, max_retries=0, timeout=300)
    cat = llm.with_structured_output(Cat, method=method, strict=strict).invoke(
        "Describe a cat named Tom who is 3 years old.")
    assert isinstance(cat, Cat) and isinstance(cat.name, str) and isinstance(cat.age, int)
