"""gateway/fleet/step_watch.py: a replica's engine steps, read from the tokens of its streams
(`mid_stream_token` says which chunks carry one)."""

from __future__ import annotations

import pytest

from gateway.config import parse_config
from gateway.fleet.registry import Registry
from gateway.fleet.step_watch import StepWatch, last_token, mid_stream_token
from loadtest.sim.protocol import SSE_DONE, ChunkWriter, Kind


def test_tokens_of_one_step_on_several_streams_mark_one_step_end() -> None:
    watch = StepWatch()
    watch.token(1.000, None)
    watch.token(1.010, 1.000)  # a stream's next token: a decode step of 10 ms
    watch.token(1.0012, None)  # another stream's token of the same step, read 1.2 ms later
    assert watch.end_s == 1.010
    assert watch.decode_s == pytest.approx(0.010)
    assert watch.seen(1.013)[0] == pytest.approx(0.003)


def test_the_decode_step_is_a_moving_average_of_gaps_while_only_decodes_ran() -> None:
    watch = StepWatch()
    for i in range(1, 60):
        watch.token(i * 0.02, (i - 1) * 0.02)
    assert watch.decode_s == pytest.approx(0.02)
    watch.token(10.0, None)  # a gap that held a prefill step: the replica passes no previous
    watch.token(10.3, None)
    assert watch.decode_s == pytest.approx(0.02)
    assert watch.end_s == 10.3
    watch.token(10.3004, 10.3)  # a read split in two: no step is that short
    assert watch.decode_s == pytest.approx(0.02)


def test_nothing_seen_places_nothing() -> None:
    assert StepWatch().seen(5.0)[0] is None


def test_a_mid_stream_token_marks_a_step_and_the_closing_events_do_not() -> None:
    chat = ChunkWriter(Kind.CHAT, "m", include_usage=True)
    assert mid_stream_token(chat.content("Hel"))
    assert not mid_stream_token(chat.finish("stop"))  # may come after the KV is written out
    assert not mid_stream_token(chat.usage({"prompt_tokens": 1, "completion_tokens": 2}))
    assert not mid_stream_token(SSE_DONE)
    completion = ChunkWriter(Kind.COMPLETION, "m", include_usage=False)
    assert mid_stream_token(completion.content("lo"))
    assert not mid_stream_token(completion.content("!", "length"))  # the last token
    assert last_token(completion.content("!", "length")) and last_token(chat.finish("stop"))
    assert not last_token(chat.content("Hel"))
    # vLLM 0.32.0's chunk (pydantic's compact JSON), and a writer that spaces its JSON
    vllm = b'data: {"id":"c","choices":[{"index":0,"delta":{"content":" the"},'
    vllm += b'"logprobs":null,"finish_reason":null}]}\n\n'
    assert mid_stream_token(vllm)
    spaced = b'data: {"choices": [{"delta": {"content": "x"}, "finish_reason": null}]}'
    assert mid_stream_token(spaced)


def test_a_replica_learns_its_decode_step_only_while_none_of_its_requests_prefills() -> None:
    config = parse_config({"pools": [{"name": "p", "replicas": ["http://127.0.0.1:1"]}]})
    registry = Registry(config)
    replica = next(iter(registry.replicas.values()))
    first = registry.reserve(replica, prefill_tokens=100, swaps=0)
    first.first_byte()  # its first token: a step end, and the queue's head moves on
    start = replica.steps.end_s
    assert start is not None and replica.head_since_s == start
    replica.token_seen(start + 0.02, start)
    assert replica.steps.decode_s == pytest.approx(0.02)  # nothing else was prefilling
    registry.reserve(replica, prefill_tokens=500, swaps=0)  # a prefill joins the steps
    replica.token_seen(start + 0.30, start + 0.02)  # that gap held its prefill chunk
    assert replica.steps.decode_s == pytest.approx(0.02)
    assert replica.steps.end_s == start + 0.30
    load = replica.load(0.0, 1.0)
    assert load.decode_step_s == 0.0 and load.step_ended_ago_s is not None  # no stream decodes
    replica.steps.streams = 1  # one does (gateway/serving/proxy.py counts them)
    replica.steps.decoding(start + 0.30, 5)  # 5 tokens to come, a decode step apart
    load = replica.load(0.0, 1.0)
    assert load.decode_step_s == pytest.approx(0.02)
    assert replica.steps.until_s == pytest.approx(start + 0.30 + 5 * 0.02)
    assert 0.3 < load.decodes_for_s <= 0.4  # read a moment after `start`
    replica.steps.stream_ended()
    assert replica.load(0.0, 1.0).decode_step_s == 0.0 and replica.steps.until_s == 0.0


def test_an_answer_read_whole_marks_no_step_end() -> None:
    config = parse_config({"pools": [{"name": "p", "replicas": ["http://127.0.0.1:1"]}]})
    registry = Registry(config)
    replica = next(iter(registry.replicas.values()))
    whole = registry.reserve(replica, prefill_tokens=100, swaps=0)
    whole.first_byte(step_end=False)  # its end, after its last token (and any KV write out)
    assert replica.steps.end_s is None and not replica.joining
    gone = registry.reserve(replica, prefill_tokens=100, swaps=0)
    gone.release()  # ended before its first byte: no token either
    assert replica.steps.end_s is None
