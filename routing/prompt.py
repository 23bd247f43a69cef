"""Canonical prompt text: the stable string whose prefix blocks are hashed.

A chat request's text is the concatenation of one rendering per message, so a conversation that
grows turn by turn keeps every earlier turn's text as an exact prefix. This is not the model's chat
template (precise mode tokenizes with the engine's own template); it only has to be deterministic
and prefix-stable.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import xxhash

CHARS_PER_TOKEN = 4
# Approximate mode counts tokens as characters / 4: OpenAI's rule of thumb for English text
# ("one token is roughly 4 characters", help.openai.com "What are tokens and how to count them").


class PromptError(ValueError):
    """The request has no usable prompt; the message says which field is wrong."""


def _render_part(part: Any) -> str:
    if isinstance(part, str):
        return part
    if not isinstance(part, Mapping):
        raise PromptError("content parts must be strings or objects")
    kind = part.get("type")
    if kind == "text":
        return str(part.get("text", ""))
    if kind in ("image_url", "input_image"):
        image = part.get("image_url", part.get("input_image"))
        url = image.get("url", "") if isinstance(image, Mapping) else str(image or "")
        # Data URLs can be megabytes; only their identity matters for caching.
        return f"<image:{xxhash.xxh3_64_hexdigest(url.encode())}>"
    if kind == "input_audio":
        audio = part.get("input_audio") or {}
        data = audio.get("data", "") if isinstance(audio, Mapping) else ""
        return f"<audio:{xxhash.xxh3_64_hexdigest(str(data).encode())}>"
    return json.dumps(part, sort_keys=True, separators=(",", ":"))


def _render_content(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence):
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
        for call in message.get("tool_calls") or ():
            pieces.append(f"<tool_call>{json.dumps(call, sort_keys=True, separators=(',', ':'))}")
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
