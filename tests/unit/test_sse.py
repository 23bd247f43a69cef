"""gateway/serving/sse.py: the same events, at the same stream offsets, however a stream is cut.

Each recorded stream is fed whole, then cut at every byte boundary into two chunks, then one
byte at a time: the events must match the whole stream's every time."""

from __future__ import annotations

import pytest

from gateway.serving.sse import Event, SseParser

# A chat stream as vLLM sends it (one event per chunk, LF endings), usage chunk last.
CHAT_LF = (
    b'data: {"id":"c1","object":"chat.completion.chunk","choices":[{"index":0,'
    b'"delta":{"role":"assistant","content":""}}],"usage":null}\n\n'
    b'data: {"id":"c1","choices":[{"index":0,"delta":{"content":"Hi"}}],"usage":null}\n\n'
    b'data: {"id":"c1","choices":[],"usage":{"prompt_tokens":12,"completion_tokens":2,'
    b'"total_tokens":14,"prompt_tokens_details":{"cached_tokens":8}}}\n\n'
    b"data: [DONE]\n\n"
)
CHAT_CRLF = CHAT_LF.replace(b"\n", b"\r\n")
CHAT_CR = CHAT_LF.replace(b"\n", b"\r")
# Comments, an event name, a multi-line data field, a field without a space after its colon,
# fields that are kept out (id, retry), an event with no data (not dispatched), a BOM.
MIXED = (
    b"\xef\xbb\xbf: keep-alive\r\n"
    b"\r\n"
    b"event: response.completed\r\n"
    b"id: 7\n"
    b'data: {"usage":\r\n'
    b'data:{"input_tokens":5}}\n'
    b"retry: 100\r"
    b"\r\n"
    b"event: ping\n\n"
    b": a comment between events\n"
    b"data\n"
    b"\n"
    b"data: last\r\n\r\n"
)
STREAMS = {"chat-lf": CHAT_LF, "chat-crlf": CHAT_CRLF, "chat-cr": CHAT_CR, "mixed": MIXED}


def parse(*chunks: bytes) -> list[Event]:
    parser = SseParser()
    return [event for chunk in chunks for event in parser.feed(chunk)]


def same(stream: bytes, cut: list[Event], whole: list[Event]) -> bool:
    """The same events; each ends where it ends in the whole stream, or one byte before when
    a chunk ended between the CR and LF of its blank line (the LF is then the next bytes')."""
    if [(e.event, e.data) for e in cut] != [(e.event, e.data) for e in whole]:
        return False
    return all(
        c.end == w.end or (c.end == w.end - 1 and stream[c.end - 1 : c.end + 1] == b"\r\n")
        for c, w in zip(cut, whole, strict=True)
    )


def test_the_chat_stream_s_events() -> None:
    events = parse(CHAT_LF)
    assert [e.data[:9] for e in events] == [b'{"id":"c1'] * 3 + [b"[DONE]"]
    assert events[2].data.endswith(b'"cached_tokens":8}}}')
    assert [e.end for e in events][-1] == len(CHAT_LF)
    assert events[2].end == CHAT_LF.index(b"data: [DONE]")


def test_fields_comments_and_multi_line_data() -> None:
    events = parse(MIXED)
    assert events == [
        Event(b"response.completed", b'{"usage":\n{"input_tokens":5}}', MIXED.index(b"event: p")),
        Event(b"", b"", MIXED.index(b"data: last")),
        Event(b"", b"last", len(MIXED)),
    ]


@pytest.mark.parametrize("name", STREAMS)
def test_every_cut_in_two_gives_the_same_events(name: str) -> None:
    stream = STREAMS[name]
    whole = parse(stream)
    for cut in range(len(stream) + 1):
        assert same(stream, parse(stream[:cut], stream[cut:]), whole), f"cut at byte {cut}"


@pytest.mark.parametrize("name", STREAMS)
def test_one_byte_at_a_time_gives_the_same_events(name: str) -> None:
    stream = STREAMS[name]
    assert same(stream, parse(*(stream[i : i + 1] for i in range(len(stream)))), parse(stream))


@pytest.mark.parametrize("name", STREAMS)
def test_every_cut_in_three_gives_the_same_events(name: str) -> None:
    stream = STREAMS[name]
    whole = parse(stream)
    step = max(1, len(stream) // 40)  # bounded: ~40 x 40 cuts
    for a in range(0, len(stream) + 1, step):
        for b in range(a, len(stream) + 1, step):
            cut = parse(stream[:a], stream[a:b], stream[b:])
            assert same(stream, cut, whole), f"cuts at {a}, {b}"


def test_an_incomplete_event_is_not_dispatched() -> None:
    assert parse(b'data: {"usage":', b"{}}\n") == []


def test_a_leading_byte_order_mark_split_in_two() -> None:
    assert parse(b"\xef", b"\xbb\xbfdata: x\n\n") == [Event(b"", b"x", 12)]
    assert parse(b"\xef", b"data: x\n\n") == []  # not a BOM: a byte of the field name
