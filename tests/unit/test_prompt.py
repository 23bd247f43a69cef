import pytest

from routing.prompt import (
    PromptError,
    approx_tokens,
    chat_text,
    completion_text,
    responses_messages,
)


def test_chat_text_is_prefix_stable_as_a_conversation_grows() -> None:
    turn1 = [{"role": "system", "content": "sys"}, {"role": "user", "content": "q1"}]
    turn2 = [*turn1, {"role": "assistant", "content": "a1"}, {"role": "user", "content": "q2"}]
    assert chat_text(turn2).startswith(chat_text(turn1))


@pytest.mark.parametrize(
    ("messages", "expected"),
    [
        ([{"role": "user", "content": "hi"}], "<|user|>hi\n"),
        ([{"role": "user", "content": [{"type": "text", "text": "a"}, "b"]}], "<|user|>ab\n"),
        ([{"role": "user", "name": "bob", "content": "x"}], "<|user|>[bob]x\n"),
        (
            [
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [{"id": "c1", "function": {"name": "f", "arguments": "{}"}}],
                }
            ],
            '<|assistant|><tool_call>{"function":{"arguments":"{}","name":"f"},"id":"c1"}\n',
        ),
        ([{"role": "tool", "tool_call_id": "c1", "content": "42"}], "<|tool|>42<tool_result:c1>\n"),
    ],
    ids=["text", "parts", "name", "tool-call", "tool-result"],
)
def test_chat_text(messages: list[dict[str, object]], expected: str) -> None:
    assert chat_text(messages) == expected


def test_images_are_hashed_by_url() -> None:
    def msg(url: str) -> list[dict[str, object]]:
        return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]

    a, b = chat_text(msg("data:image/png;base64," + "A" * 10_000)), chat_text(msg("http://x/1"))
    assert len(a) < 100 and a != b
    assert chat_text(msg("http://x/1")) == b


@pytest.mark.parametrize(
    "messages",
    [None, [], "hello", [{"content": "no role"}], [{"role": "user", "content": 5}]],
    ids=["missing", "empty", "string", "no-role", "bad-content"],
)
def test_chat_text_rejects(messages: object) -> None:
    with pytest.raises(PromptError):
        chat_text(messages)


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [("abc", "abc"), (["a", "b"], "a\nb"), ([1, 2, 3], "1 2 3")],
    ids=["string", "strings", "token-ids"],
)
def test_completion_text(prompt: object, expected: str) -> None:
    assert completion_text(prompt) == expected


@pytest.mark.parametrize(
    "prompt", ["", [], None, [1, "a"]], ids=["empty", "empty-list", "none", "mixed"]
)
def test_completion_text_rejects(prompt: object) -> None:
    with pytest.raises(PromptError):
        completion_text(prompt)


@pytest.mark.parametrize(("chars", "tokens"), [(0, 0), (1, 1), (4, 1), (5, 2), (4000, 1000)])
def test_approx_tokens(chars: int, tokens: int) -> None:
    assert approx_tokens("x" * chars) == tokens


def test_responses_text_parts_render_as_chat_text_parts() -> None:
    chat = chat_text([{"role": "user", "content": [{"type": "text", "text": "hello"}]}])
    for kind in ("input_text", "output_text"):
        item = {"role": "user", "content": [{"type": kind, "text": "hello"}]}
        assert chat_text(responses_messages([item])) == chat
        item["content"] = [{"type": kind, "text": 5}]
        with pytest.raises(PromptError):
            chat_text(responses_messages([item]))
