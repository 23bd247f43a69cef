"""gateway/serving/usage.py: the usage read from a stream's events however its bytes are cut, the
usage-only chunk stripped only when asked, and every other byte relayed as it came."""

from __future__ import annotations

import pytest

from gateway.serving.sse import SseParser
from gateway.serving.usage import StreamReader, Usage, ask_for_usage, usage_in
from tests.unit.test_sse import CHAT_CR, CHAT_CRLF, CHAT_LF

USAGE_CHUNK_LF = (
    b'data: {"id":"c1","choices":[],"usage":{"prompt_tokens":12,"completion_tokens":2,'
    b'"total_tokens":14,"prompt_tokens_details":{"cached_tokens":8}}}\n\n'
)
RESPONSES = (
    b"event: response.output_text.delta\n"
    b'data: {"type":"response.output_text.delta","delta":"Hi"}\n\n'
    b"event: response.completed\n"
    b'data: {"type":"response.completed","response":{"usage":{"input_tokens":7,'
    b'"output_tokens":3,"input_tokens_details":{"cached_tokens":4}}}}\n\n'
)
STREAMS = {"lf": CHAT_LF, "crlf": CHAT_CRLF, "cr": CHAT_CR}
LINE_ENDS = {"lf": b"\n", "crlf": b"\r\n", "cr": b"\r"}
EXPECTED = (12, 2, 8)


def counts(usage: Usage | None) -> tuple[int | None, int | None, int | None] | None:
    if usage is None:
        return None
    return usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens


def relay(reader: StreamReader, *chunks: bytes) -> bytes:
    out = b"".join(reader.relay(chunk, float(i)) for i, chunk in enumerate(chunks))
    return out + reader.rest()


def without_usage_chunk(name: str) -> bytes:
    chunk = USAGE_CHUNK_LF.replace(b"\n", LINE_ENDS[name])
    assert chunk in STREAMS[name]
    return STREAMS[name].replace(chunk, b"")


def events(stream: bytes) -> list[tuple[bytes, bytes]]:
    return [(e.event, e.data) for e in SseParser().feed(stream)]


@pytest.mark.parametrize("name", STREAMS)
def test_passing_through_every_cut_relays_every_byte_and_reads_the_usage(name: str) -> None:
    stream = STREAMS[name]
    for cut in range(len(stream) + 1):
        reader = StreamReader()
        assert relay(reader, stream[:cut], stream[cut:]) == stream, cut
        assert counts(reader.usage) == EXPECTED, cut


@pytest.mark.parametrize("name", STREAMS)
def test_stripping_at_every_cut_drops_only_the_usage_chunk(name: str) -> None:
    stream = STREAMS[name]
    expected = without_usage_chunk(name)
    for cut in range(len(stream) + 1):
        reader = StreamReader(strip_usage=True)
        out = relay(reader, stream[:cut], stream[cut:])
        # a cut between the CR and LF of a blank line moves that LF to the next event's bytes
        # (an event stream reads it as nothing): the same events, one LF more or fewer
        assert events(out) == events(expected), cut
        assert out == expected or (abs(len(out) - len(expected)) == 1 and b"\r" in stream), cut
        assert counts(reader.usage) == EXPECTED, cut


@pytest.mark.parametrize("name", STREAMS)
def test_stripping_one_byte_at_a_time(name: str) -> None:
    stream = STREAMS[name]
    reader = StreamReader(strip_usage=True)
    out = relay(reader, *(stream[i : i + 1] for i in range(len(stream))))
    assert events(out) == events(without_usage_chunk(name))
    assert counts(reader.usage) == EXPECTED


def test_a_chunk_without_a_usage_only_chunk_is_not_stripped() -> None:
    """Chunks that carry usage beside their choices (vLLM's continuous_usage_stats) stay."""
    stream = b'data: {"choices":[{"delta":{"content":"a"}}],"usage":{"prompt_tokens":3}}\n\n'
    reader = StreamReader(strip_usage=True)
    assert relay(reader, stream) == stream
    assert counts(reader.usage) == (3, None, None)


def test_the_responses_api_usage_and_the_last_token_time() -> None:
    reader = StreamReader()
    cut = RESPONSES.index(b"event: response.completed")
    assert relay(reader, RESPONSES[:cut], RESPONSES[cut:]) == RESPONSES
    assert counts(reader.usage) == (7, 3, 4)
    assert reader.last_token_s == 0.0  # the delta's chunk, not the completed event's


def test_the_last_token_is_the_last_chunk_with_choices() -> None:
    reader = StreamReader()
    chunks = CHAT_LF.split(b"\n\n")[:-1]
    relay(reader, *(c + b"\n\n" for c in chunks))
    assert reader.last_token_s == 1.0  # the second content chunk; not the usage's, not [DONE]


def test_a_whole_answer_s_usage() -> None:
    body = b'{"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":1,"total_tokens":6}}'
    assert counts(usage_in(body)) == (5, 1, None)
    assert usage_in(b"not json _tokens") is None
    assert usage_in(b'{"object":"list"}') is None


@pytest.mark.parametrize(
    ("endpoint", "body", "asks"),
    [
        ("chat", {"stream": True}, True),
        ("chat", {"stream": True, "stream_options": {"include_usage": False}}, True),
        ("chat", {"stream": True, "stream_options": {"include_usage": True}}, False),
        ("completions", {"stream": True}, True),
        ("chat", {"stream": False}, False),
        ("responses", {"stream": True}, False),
        ("embeddings", {}, False),
    ],
    ids=["chat", "asked-false", "asked", "completions", "whole", "responses", "embeddings"],
)
def test_when_the_gateway_asks_for_usage(
    endpoint: str, body: dict[str, object], asks: bool
) -> None:
    assert ask_for_usage(endpoint, body) is asks
