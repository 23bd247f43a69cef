"""gateway/http/request_schema.py: one schema for chat, completions and responses, table-driven."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.http.request_schema import schema_problem

USER = {"role": "user", "content": "hi"}


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [USER], **fields}


def user(content: Any, **fields: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": content, **fields}]}


def responses(input_: Any, **fields: Any) -> dict[str, Any]:
    return {"model": "m", "input": input_, **fields}


def completions(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "prompt": "x", **fields}


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
FLAT_TOOL = {"type": "function", "name": "f", "parameters": {"type": "object"}}

VALID = [
    ("chat", chat()),
    ("chat", chat(stream=True, stream_options={"include_usage": True}, tools=[TOOL])),
    ("chat", chat(tool_choice="auto", stop=["a"], temperature=0, top_p=0.5, n=1, seed=3)),
    ("chat", user([{"type": "text", "text": "a"}, {"type": "image_url", "image_url": "u"}])),
    ("chat", user([{"type": "input_audio", "input_audio": {"data": "d", "format": "wav"}}])),
    ("chat", user(None, name="n")),
    ("chat", chat(messages=[{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}])),
    ("chat", chat(top_k=5, chat_template_kwargs={"x": 1})),  # engine extensions pass
    ("completions", completions(echo=False, logprobs=2, stop="x", max_tokens=None)),
    ("responses", responses("hi", instructions="be brief", tools=[FLAT_TOOL], stream=False)),
    ("responses", responses([{"role": "user", "content": [{"type": "input_text", "text": "a"}]}])),
    ("responses", responses([{"type": "function_call", "call_id": "c", "name": "f",
                              "arguments": "{}"}, {"type": "function_call_output",
                              "call_id": "c", "output": "1"}])),
    ("responses", responses([{"type": "web_search_call", "id": "w"}])),
]  # fmt: skip


@pytest.mark.parametrize(("endpoint", "body"), VALID, ids=range(len(VALID)))
def test_valid_bodies_pass(endpoint: str, body: dict[str, Any]) -> None:
    assert schema_problem(endpoint, body) is None


INVALID = [
    # (id, endpoint, body, param, expected type in the message)
    ("input_text-5", "responses",
     responses([{"role": "user", "content": [{"type": "input_text", "text": 5}]}]),
     "input[0].content[0].text", "expected a string, but got an integer"),
    ("tools-5", "chat", chat(tools=5), "tools", "expected an array"),
    ("name-5", "chat", user("x", name=5), "messages[0].name", "expected a string"),
    ("part-type-7", "chat", user([{"type": 7, "text": "a"}]), "messages[0].content[0].type",
     "expected a string, but got an integer"),
    ("stream-yes", "chat", chat(stream="yes"), "stream", "expected a boolean, but got a string"),
    ("stream-yes-completions", "completions", completions(stream="yes"), "stream",
     "expected a boolean"),
    ("stream-yes-responses", "responses", responses("x", stream="yes"), "stream",
     "expected a boolean"),
    ("tools-5-responses", "responses", responses("x", tools=5), "tools", "expected an array"),
    ("tool-no-name", "chat", chat(tools=[{"type": "function", "function": {}}]),
     "tools[0].function.name", "Missing required parameter"),
    ("flat-tool-name-5", "responses", responses("x", tools=[{**FLAT_TOOL, "name": 5}]),
     "tools[0].name", "expected a string"),
    ("tool-call-args-obj", "chat", chat(messages=[{"role": "assistant", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": {}}}]}]),
     "messages[0].tool_calls[0].function.arguments", "expected a string"),
    ("role-missing", "chat", chat(messages=[{"content": "x"}]), "messages[0].role", "Missing"),
    ("messages-empty", "chat", chat(messages=[]), "messages", "empty array"),
    ("content-object", "chat", user({"a": 1}), "messages[0].content", "a string or an array"),
    ("image-url-5", "chat", user([{"type": "image_url", "image_url": {"url": 5}}]),
     "messages[0].content[0].image_url.url", "expected a string"),
    ("temperature-str", "completions", completions(temperature="hot"), "temperature",
     "expected a number"),
    ("max-tokens-float", "chat", chat(max_tokens=1.5), "max_tokens", "expected an integer"),
    ("max-tokens-bool", "chat", chat(max_tokens=True), "max_tokens", "got a boolean"),
    ("stop-list-of-int", "chat", chat(stop=[1]), "stop[0]", "expected a string"),
    ("stream-options-int", "chat", chat(stream_options={"include_usage": 1}),
     "stream_options.include_usage", "expected a boolean"),
    ("model-5", "completions", completions(model=5), "model", "expected a string"),
    ("item-no-role", "responses", responses([{"content": "x"}]), "input[0]", "role"),
    ("input-5", "responses", responses(5), "input", "a string or an array"),
    ("instructions-5", "responses", responses("x", instructions=5), "instructions", "a string"),
    ("function-call-no-id", "responses",
     responses([{"type": "function_call", "name": "f", "arguments": "{}"}]),
     "input[0].call_id", "Missing"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("endpoint", "body", "param", "message"),
    [case[1:] for case in INVALID],
    ids=[case[0] for case in INVALID],
)
def test_invalid_bodies_name_the_field(
    endpoint: str, body: dict[str, Any], param: str, message: str
) -> None:
    problem = schema_problem(endpoint, body)
    assert problem is not None
    assert problem.param == param
    assert message in str(problem), str(problem)
