"""Precise mode's prompt: the token ids the engine will see, from the model's own tokenizer.

Chat requests are rendered with the model's chat template the way vLLM does it (transformers'
`apply_chat_template`: a sandboxed jinja2 environment with trim_blocks and lstrip_blocks, the
`tojson` / `raise_exception` / `strftime_now` helpers, `messages`, `add_generation_prompt`
(default true), `tools`, `bos_token` / `eos_token`), then tokenized without adding special
tokens (vLLM's chat default `add_special_tokens=False`: the template writes them). Completions
are tokenized with special tokens (vLLM's completions default) unless they are token ids already.

Text-only: a content part that is not text (an image, audio) cannot be tokenized here the way a
multimodal engine does it, and raises UnsupportedPrompt, so the caller routes without cache hits.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from routing.prompt import PromptError


class UnsupportedPrompt(ValueError):
    """A valid request this tokenizer cannot reproduce the engine's tokens for."""


class TemplateError(PromptError):
    """The chat template refused the messages (its raise_exception), as the engine would."""


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # transformers overrides jinja's tojson: no HTML escaping, same options as json.dumps.
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (assistant masks in transformers): renders its
    body unchanged, so templates that use it render as they do for the engine."""

    tags = {"generation"}

    def parse(self, parser: Any) -> Any:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> Any:
        return caller()


def compile_chat_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def load_chat_template(value: str) -> str:
    """A template given inline (it contains `{{` or `{%`) or as a path to a file."""
    if "{{" in value or "{%" in value:
        return value
    return Path(value).read_text()


def _text_content(content: Any) -> Any:
    """vLLM's "string" content format: text parts joined by newlines; other parts unsupported."""
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise PromptError("message content must be a string or a list of parts")
    texts = []
    for part in content:
        if isinstance(part, str):
            texts.append(part)
        elif isinstance(part, Mapping) and part.get("type") == "text":
            text = part.get("text", "")
            if not isinstance(text, str):
                raise PromptError("a text part's 'text' must be a string")
            texts.append(text)
        else:
            kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
            raise UnsupportedPrompt(f"content part of type {kind!r} is not text")
    return "\n".join(texts)


class PromptTokenizer:
    def __init__(
        self,
        tokenizer: Tokenizer,
        chat_template: str | None,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
    ) -> None:
        self._tokenizer = tokenizer
        self._template = compile_chat_template(chat_template) if chat_template else None
        self._specials = {"bos_token": bos_token or "", "eos_token": eos_token or ""}

    @classmethod
    def from_files(
        cls,
        tokenizer_json: str | Path,
        chat_template: str | None,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
    ) -> PromptTokenizer:
        template = load_chat_template(chat_template) if chat_template else None
        return cls(
            Tokenizer.from_file(str(tokenizer_json)),
            template,
            bos_token=bos_token,
            eos_token=eos_token,
        )

    def render_chat(self, body: Mapping[str, Any]) -> str:
        if self._template is None:
            raise UnsupportedPrompt("no chat template is configured for this model")
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise PromptError("'messages' must be a non-empty array")
        conversation = []
        for i, message in enumerate(messages):
            if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
                raise PromptError(f"'messages[{i}]' must be an object with a string 'role'")
            conversation.append({**message, "content": _text_content(message.get("content"))})
        kwargs = body.get("chat_template_kwargs")
        extra = dict(kwargs) if isinstance(kwargs, Mapping) else {}
        try:
            return self._template.render(
                **{
                    **self._specials,
                    **extra,
                    "messages": conversation,
                    "tools": body.get("tools"),
                    "documents": body.get("documents"),
                    "add_generation_prompt": bool(body.get("add_generation_prompt", True)),
                }
            )
        except jinja2.exceptions.TemplateError as err:
            raise TemplateError(f"the chat template refused the messages: {err}") from None
        except (TypeError, ValueError, LookupError, AttributeError, RecursionError) as err:
            # the template met values of types it does not expect (a client's tool_calls as a
            # number, say): the engine's own rendering fails the same way, with a 400
            raise TemplateError(
                f"the chat template cannot render these messages: {type(err).__name__}: {err}"
            ) from None

    def chat_ids(self, body: Mapping[str, Any]) -> list[int]:
        special = bool(body.get("add_special_tokens", False))
        return self.encode(self.render_chat(body), add_special_tokens=special)

    def completion_ids(self, body: Mapping[str, Any]) -> list[int]:
        prompt = body.get("prompt")
        special = bool(body.get("add_special_tokens", True))
        if isinstance(prompt, str) and prompt:
            return self.encode(prompt, add_special_tokens=special)
        if isinstance(prompt, list) and prompt:
            first = prompt[0]
            if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
                return self._in_vocabulary(prompt)
            # A batch of prompts is several engine requests; the first one is routed on.
            if isinstance(first, str) and first:
                return self.encode(first, add_special_tokens=special)
            if (
                isinstance(first, list)
                and first
                and all(isinstance(t, int) and not isinstance(t, bool) for t in first)
            ):
                return self._in_vocabulary(first)
        raise PromptError("'prompt' must be a non-empty string, array of strings or token ids")

    def _in_vocabulary(self, ids: list[int]) -> list[int]:
        """Token ids as given, each one of the model's (vLLM answers 400 for any other)."""
        size = self._tokenizer.get_vocab_size(with_added_tokens=True)
        bad = next((t for t in ids if not 0 <= t < size), None)
        if bad is not None:
            raise PromptError(f"token id {bad} is out of the vocabulary (0 to {size - 1})")
        return list(ids)

    def encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        ids: list[int] = self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        return ids
