"""Precise mode's prompt tokens (a real tokenizer built here, a real chat template) and its
config checks."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.config import ConfigError, parse_config
from gateway.engines.tokenizer import PromptTokenizer, TemplateError, UnsupportedPrompt
from loadtest.sim.tiny_tokenizer import (
    BOS,
    CHAT_TEMPLATE,
    EOS,
    TinyTokenizerFiles,
    write_tiny_tokenizer,
)
from routing.prompt import PromptError


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> TinyTokenizerFiles:
    return write_tiny_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def tok(files: TinyTokenizerFiles) -> PromptTokenizer:
    return PromptTokenizer.from_files(
        files.tokenizer_json, str(files.chat_template), bos_token=BOS, eos_token=EOS
    )


def msgs(*pairs: tuple[str, Any]) -> dict[str, Any]:
    return {"messages": [{"role": r, "content": c} for r, c in pairs]}


RENDERS = [
    (
        "generation-prompt",
        msgs(("system", "Be brief."), ("user", "hi")),
        "<s><|system|>\nBe brief.</s>\n<|user|>\nhi</s>\n<|assistant|>\n",
    ),
    (
        "no-generation-prompt",
        {**msgs(("user", "hi")), "add_generation_prompt": False},
        "<s><|user|>\nhi</s>\n",
    ),
    (
        "text-parts-joined-by-newline",
        msgs(("user", [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}])),
        "<s><|user|>\na\nb</s>\n<|assistant|>\n",
    ),
]


@pytest.mark.parametrize(("body", "text"), [r[1:] for r in RENDERS], ids=[r[0] for r in RENDERS])
def test_chat_template_renders_like_the_engine(
    tok: PromptTokenizer, body: dict[str, Any], text: str
) -> None:
    assert tok.render_chat(body) == text


def test_chat_ids_add_no_second_bos_and_completions_get_one(tok: PromptTokenizer) -> None:
    ids = tok.chat_ids(msgs(("user", "hi")))
    bos = tok.encode(BOS, add_special_tokens=False)
    assert ids[:1] == bos and ids[1:2] != bos
    assert tok.completion_ids({"prompt": "hi"})[:1] == bos
    assert tok.completion_ids({"prompt": [5, 6, 7]}) == [5, 6, 7]


def test_a_longer_conversation_extends_the_tokens_of_the_shorter(tok: PromptTokenizer) -> None:
    short = msgs(("system", "You are a meticulous assistant."), ("user", "Where is my order?"))
    longer = msgs(
        ("system", "You are a meticulous assistant."),
        ("user", "Where is my order?"),
        ("assistant", "It ships today."),
        ("user", "Thanks"),
    )
    common = tok.chat_ids({**short, "add_generation_prompt": False})
    assert tok.chat_ids(longer)[: len(common)] == common


PROBLEMS = [
    (
        "image-part",
        msgs(("user", [{"type": "image_url", "image_url": {"url": "x"}}])),
        UnsupportedPrompt,
    ),
    ("no-messages", {"messages": []}, PromptError),
    ("bad-message", {"messages": [{"content": "x"}]}, PromptError),
]


@pytest.mark.parametrize(("body", "error"), [p[1:] for p in PROBLEMS], ids=[p[0] for p in PROBLEMS])
def test_prompts_it_cannot_tokenize(
    tok: PromptTokenizer, body: dict[str, Any], error: type[Exception]
) -> None:
    with pytest.raises(error):
        tok.chat_ids(body)


def test_template_raise_exception_is_a_prompt_error(files: TinyTokenizerFiles) -> None:
    strict = PromptTokenizer.from_files(
        files.tokenizer_json,
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}",
    )
    with pytest.raises(TemplateError, match="user first"):
        strict.chat_ids(msgs(("system", "x")))


def precise(files: TinyTokenizerFiles, **pool: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "name": "p",
        "models": ["m"],
        "replicas": ["http://127.0.0.1:8001", "http://127.0.0.1:8002"],
        "kv_events": {"port_offset": 1000},
        "tokenizer": {"path": str(files.tokenizer_json), "chat_template": CHAT_TEMPLATE},
    }
    base.update(pool)
    return {"routing": {"mode": "precise"}, "pools": [base]}


def test_precise_config_resolves_endpoints(files: TinyTokenizerFiles) -> None:
    config = parse_config(
        precise(
            files,
            kv_events={
                "endpoints": {
                    "http://127.0.0.1:8001/": "tcp://127.0.0.1:5557",
                    "http://127.0.0.1:8002": "tcp://127.0.0.1:5558",
                },
                "replay_port_offset": 2000,
            },
        )
    )
    events = config.pools[0].kv_events
    assert events is not None
    assert events.endpoint_for("http://127.0.0.1:8002/") == "tcp://127.0.0.1:5558"
    assert events.replay_endpoint_for("http://127.0.0.1:8001") == "tcp://127.0.0.1:10001"
    offset = parse_config(precise(files)).pools[0].kv_events
    assert (
        offset is not None
        and offset.endpoint_for("http://127.0.0.1:8001") == "tcp://127.0.0.1:9001"
    )


BAD_CONFIGS = [
    ("no-kv-events", {"kv_events": None}, "needs kv_events and tokenizer"),
    ("two-models", {"models": ["a", "b"]}, "the one model the pool serves"),
    ("both-rules", {"kv_events": {"port_offset": 1, "endpoints": {}}}, "exactly one of"),
    ("bad-endpoint", {"kv_events": {"endpoints": {"http://127.0.0.1:8001": "udp://x"}}}, "tcp://"),
    (
        "endpoint-missing",
        {"kv_events": {"endpoints": {"http://127.0.0.1:8001": "tcp://127.0.0.1:1"}}},
        "missing ['http://127.0.0.1:8002']",
    ),
    ("typo", {"kv_events": {"port_ofset": 1}}, "port_ofset"),
    ("no-tokenizer-file", {"tokenizer": {"path": "/nonexistent/tokenizer.json"}}, "is not a file"),
]


@pytest.mark.parametrize(
    ("pool", "message"), [b[1:] for b in BAD_CONFIGS], ids=[b[0] for b in BAD_CONFIGS]
)
def test_precise_config_errors_name_the_problem(
    files: TinyTokenizerFiles, pool: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config(precise(files, **pool))
    assert message in str(err.value)


def test_template_given_as_a_file(files: TinyTokenizerFiles) -> None:
    config = parse_config(
        precise(
            files,
            tokenizer={
                "path": str(files.tokenizer_json),
                "chat_template": str(files.chat_template),
            },
        )
    )
    assert config.routing.mode == "precise"
