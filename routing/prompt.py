"""Canonical prompt text: the stable string whose prefix blocks are hashed.

A chat request's text is the concatenation of one rendering per message, so a conversation that
grows turn by turn keeps every earlier turn's text as an exact prefix. This is not the model's chat
template (precise mode tokenizes with the engine's own template); it only has to be deterministic
and prefix-stable.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import xxhash

CHARS_PER_TOKEN = 4
# Approximate mode counts tokens as characters / 4: OpenAI's rule of thumb for English text
# ("one token is roughly 4 characters", help.openai.com "What are tokens and how to count them").


TEXT_PARTS = ("text", "input_text", "output_text")
# Chat's text part and the Responses API's input and output text parts: the same text to the
# engine (vLLM renders a Responses request as the chat it stands for), so the same prompt here.


class PromptError(ValueError):
    """The request has no usable prompt; the message says which field is wrong."""


def _render_part(part: Any) -> str:
    if isinstance(part, str):
        return part
    if not isinstance(part, Mapping):
        raise PromptError("content parts must be strings or objects")
    kind = part.get("type")
    if kind in TEXT_PARTS:
        return _text(part.get("text", ""), "a text part's 'text'")
    if kind in ("image_url", "input_image"):
        image = part.get("image_url", part.get("input_image"))
        url = image.get("url", "") if isinstance(image, Mapping) else image or ""
        url = _text(url, "an image part's URL")
        # Data URLs can be megabytes; only their identity matters for caching.
        return f"<image:{xxhash.xxh3_64_hexdigest(url.encode())}>"
    if kind == "input_audio":
        audio = part.get("input_audio") or {}
        data = audio.get("data", "") if isinstance(audio, Mapping) else ""
        data = _text(data, "an audio part's 'data'")
        return f"<audio:{xxhash.xxh3_64_hexdigest(data.encode())}>"
    return _json(part)


def _text(value: Any, what: str) -> str:
    if not isinstance(value, str):
        raise PromptError(f"{what} must be a string")
    return value


def _json(value: Any) -> str:
    """The canonical JSON of a part or tool call (the body parser bounded its depth and numbers;
    keys that are not all strings, or a value that is not JSON, are a client's error)."""
    try:
        return json.dumps(value, sort_keys=True, separators=(",", ":"))
    except (TypeError, ValueError, RecursionError) as err:
        raise PromptError(f"a message part is not valid JSON: {err}") from None


def _render_content(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(_render_part(p) for p in content)
    raise PromptError("message content must be a string or a list of parts")


def chat_text(messages: Any) -> str:
    """Canonical text of a chat request's `messages`."""
    if not isinstance(messages, list) or not messages:
        raise PromptError("'messages' must be a non-empty array")
    pieces: list[str] = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise PromptError(f"'messages[{i}]' must be an object with a string 'role'")
        pieces.append(f"<|{message['role']}|>")
        if isinstance(message.get("name"), str):
            pieces.append(f"[{message['name']}]")
        pieces.append(_render_content(message.get("content")))
        calls = message.get("tool_calls") or []
        if not isinstance(calls, list) or not all(isinstance(c, Mapping) for c in calls):
            raise PromptError(f"'messages[{i}].tool_calls' must be an array of objects")
        for call in calls:
            pieces.append(f"<tool_call>{_json(call)}")
        if isinstance(message.get("tool_call_id"), str):
            pieces.append(f"<tool_result:{message['tool_call_id']}>")
        pieces.append("\n")
    return "".join(pieces)


def completion_text(prompt: Any) -> str:
    """Canonical text of a completions request's `prompt` (a string, strings, or token ids)."""
    if isinstance(prompt, str):
        if not prompt:
            raise PromptError("'prompt' must not be empty")
        return prompt
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return "\n".join(prompt)
        if all(isinstance(p, int) for p in prompt):
            return " ".join(str(p) for p in prompt)
    raise PromptError("'prompt' must be a non-empty string, array of strings or array of token ids")


def approx_tokens(text: str) -> int:
    """Approximate token count of text (ceil of characters / CHARS_PER_TOKEN)."""
    return -(-len(text) // CHARS_PER_TOKEN)


def responses_messages(input_: Any, instructions: Any = None) -> list[dict[str, Any]]:
    """A Responses API request's `input` (a string, or a list of items) as chat messages, with
    `instructions` as the system message: the conversation the engine renders. An item with a
    role is a message (its content parts pass as they are); any other item (a function call,
    its output, reasoning) stands as a message whose role is its `type`."""
    messages: list[dict[str, Any]] = []
    if instructions is not None:
        messages.append({"role": "system", "content": _text(instructions, "'instructions'")})
    if isinstance(input_, str):
        if not input_:
            raise PromptError("'input' must not be empty")
        return [*messages, {"role": "user", "content": input_}]
    if not isinstance(input_, list) or not input_:
        raise PromptError("'input' must be a non-empty string or array of items")
    for i, item in enumerate(input_):
        if not isinstance(item, Mapping):
            raise PromptError(f"'input[{i}]' must be an object")
        if isinstance(item.get("role"), str):
            messages.append({"role": item["role"], "content": item.get("content")})
        elif isinstance(item.get("type"), str):
            messages.append({"role": item["type"], "content": _json(item)})
        else:
            raise PromptError(f"'input[{i}]' must have a string 'role' or 'type'")
    return messages


def embedding_text(input_: Any) -> str:
    """Canonical text of an embeddings request's `input` (a string, strings, token ids, or
    arrays of token ids), only to count its tokens: embeddings reuse no prefix."""
    if isinstance(input_, list) and input_ and all(isinstance(p, list) for p in input_):
        return "\n".join(completion_text(p) for p in input_)
    try:
        return completion_text(input_)
    except PromptError:
        raise PromptError(
            "'input' must be a non-empty string, array of strings, array of token ids or "
            "array of token id arrays"
        ) from None
