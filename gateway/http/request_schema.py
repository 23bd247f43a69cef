"""One request schema for the three generation endpoints: the type of every field the gateway or
the engine reads, checked the same way for chat completions, completions and responses, before
anything is routed or sent. A violation is OpenAI's 400 `invalid_request_error` naming the field
in `param` (`messages[0].content[1].type`), with OpenAI's wording: "Invalid type for 'tools':
expected an array, but got an integer instead."

Shared by all three: the sampling fields (types as in OpenAI's API reference), `stream` and
`stream_options`, `tools` (chat's `{"type": "function", "function": {"name", ...}}`, responses'
`{"type": "function", "name", ...}`), `tool_choice`, and the content parts of a message (chat's
`text`, `image_url`, `input_audio`, `refusal`, responses' `input_text`, `output_text`,
`input_image`; any other part needs a string `type`). Fields this module does not know pass as
they are: the engines take extensions of their own (vLLM's `top_k`, `chat_template_kwargs`, ...).
The prompt itself (messages, prompt, input) is rendered by routing/prompt.py, which checks what
is left (a non-empty prompt, token ids).

A prompt has at most MAX_PROMPT_PARTS parts (messages or input items, and their content parts):
more is 400 `too_many_parts`, counted before any part is checked.

Numbers are held to the ranges OpenAI's API reference gives them (`temperature` 0 to 2, `top_p`
0 to 1, the penalties -2 to 2, `top_logprobs` 0 to 20, ...), integers without a documented bound
to what the engines take (a seed in 64 bits, an output limit at most MAX_OUTPUT_TOKENS), and
refused with OpenAI's wording ("Invalid 'temperature': decimal above maximum value. Expected a
value <= 2, but got 3 instead.") before anything is sent: a replica never sees, or echoes back,
a number no engine accepts.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from gateway.http.errors import bad_request
from gateway.serving.deadline import MAX_OUTPUT_TOKENS

Check = Callable[[Any, str], None]  # (value, its param) -> None, or raise SchemaError


class SchemaError(ValueError):
    def __init__(self, message: str, param: str, code: str = "invalid_request") -> None:
        super().__init__(message)
        self.param = param
        self.code = code


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a decimal"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


def _wrong(param: str, expected: str, value: Any) -> SchemaError:
    return SchemaError(
        f"Invalid type for '{param}': expected {expected}, but got {_kind(value)} instead.", param
    )


def _of(expected: str, test: Callable[[Any], bool]) -> Check:
    def check(value: Any, param: str) -> None:
        if not test(value):
            raise _wrong(param, expected, value)

    return check


string = _of("a string", lambda v: isinstance(v, str))
boolean = _of("a boolean", lambda v: isinstance(v, bool))
integer = _of("an integer", lambda v: isinstance(v, int) and not isinstance(v, bool))
number = _of("a number", lambda v: isinstance(v, int | float) and not isinstance(v, bool))
obj = _of("an object", lambda v: isinstance(v, dict))


MAX_SHOWN_DIGITS = 20  # a refused number is shown so far: 10**400 is no line of a message


def _shown(value: int | float) -> str:
    text = repr(value) if isinstance(value, float) else str(value)
    return text if len(text) <= MAX_SHOWN_DIGITS else f"{text[:MAX_SHOWN_DIGITS]}..."


def within(low: float, high: float, *, integral: bool = False) -> Check:
    """A number (an integer if `integral`) from `low` to `high`, both included; NaN is none."""
    kind = "integer" if integral else "decimal"
    of_type = integer if integral else number

    def check_range(value: Any, param: str) -> None:
        of_type(value, param)
        if low <= value <= high:
            return
        below = not value >= low  # NaN is out of range, on the low side
        side, bound = ("below minimum", f">= {low}") if below else ("above maximum", f"<= {high}")
        raise SchemaError(
            f"Invalid '{param}': {kind} {side} value. Expected a value {bound}, but got "
            f"{_shown(value)} instead.",
            param,
            f"{kind}_{'below_min' if below else 'above_max'}_value",
        )

    return check_range


def values_of(check: Check) -> Check:
    """An object whose every value passes `check` (logit_bias: token id -> bias)."""

    def check_values(value: Any, param: str) -> None:
        obj(value, param)
        for key, item in value.items():
            check(item, f"{param}.{key}")

    return check_values


def optional(check: Check) -> Check:
    """`check`, or null."""

    def check_optional(value: Any, param: str) -> None:
        if value is not None:
            check(value, param)

    return check_optional


def one_of(expected: str, *checks: Check) -> Check:
    """The first check that passes; else the error of one whose shape matched but whose inside
    is wrong (it names the field within), else one error naming every accepted type."""

    def check_any(value: Any, param: str) -> None:
        inner: SchemaError | None = None
        for check in checks:
            try:
                check(value, param)
                return
            except SchemaError as err:
                if err.param != param and inner is None:
                    inner = err
        raise inner or _wrong(param, expected, value)

    return check_any


def array(item: Check, *, non_empty: bool = False) -> Check:
    def check_array(value: Any, param: str) -> None:
        if not isinstance(value, list):
            raise _wrong(param, "an array", value)
        if non_empty and not value:
            raise SchemaError(f"Invalid '{param}': empty array. Expected at least 1 item.", param)
        for i, element in enumerate(value):
            item(element, f"{param}[{i}]")

    return check_array


def fields(required: Mapping[str, Check], known: Mapping[str, Check] | None = None) -> Check:
    """An object with the `required` fields and, when present, the `known` ones."""

    def check_object(value: Any, param: str) -> None:
        obj(value, param)
        for name, check in required.items():
            if name not in value:
                raise SchemaError(
                    f"Missing required parameter: '{param}.{name}'.", f"{param}.{name}"
                )
            check(value[name], f"{param}.{name}")
        for name, check in (known or {}).items():
            if name in value:
                check(value[name], f"{param}.{name}")

    return check_object


def tagged(variants: Mapping[str, Check]) -> Check:
    """An object with a string `type`; the variant of that type checks the rest (an unknown type
    passes: the engine says whether it takes it)."""

    def check_tagged(value: Any, param: str) -> None:
        fields({"type": string})(value, param)
        variant = variants.get(value["type"])
        if variant is not None:
            variant(value, param)

    return check_tagged


def _text_part(key: str) -> Check:
    return fields({key: string})


IMAGE = one_of("a string or an object with a string 'url'", string, fields({"url": string}))
PART = one_of(
    "a string or a content part object",
    string,
    tagged(
        {
            "text": _text_part("text"),
            "input_text": _text_part("text"),
            "output_text": _text_part("text"),
            "refusal": _text_part("refusal"),
            "image_url": fields({"image_url": IMAGE}),
            "input_image": fields({}, {"image_url": optional(IMAGE), "file_id": optional(string)}),
            "input_audio": fields(
                {"input_audio": fields({"data": string}, {"format": optional(string)})}
            ),
        }
    ),
)
CONTENT = optional(one_of("a string or an array of content parts", string, array(PART)))
TOOL_CALL = fields(
    {},
    {
        "id": optional(string),
        "type": string,
        "function": fields({"name": string}, {"arguments": optional(string)}),
    },
)
MESSAGE = fields(
    {"role": string},
    {
        "content": CONTENT,
        "name": optional(string),
        "tool_calls": optional(array(TOOL_CALL)),
        "tool_call_id": optional(string),
        "refusal": optional(string),
    },
)
FUNCTION = {
    "description": optional(string),
    "parameters": optional(obj),
    "strict": optional(boolean),
}
CHAT_TOOL = tagged({"function": fields({"function": fields({"name": string}, FUNCTION)})})
RESPONSES_TOOL = tagged({"function": fields({"name": string}, FUNCTION)})
RESPONSES_MESSAGE = fields({"role": string}, {"content": CONTENT, "type": optional(string)})
RESPONSES_TYPED_ITEM = tagged(
    {
        "function_call": fields({"call_id": string, "name": string, "arguments": string}),
        "function_call_output": fields({"call_id": string}),
    }
)


def _responses_item(value: Any, param: str) -> None:
    """A message (it has a role) or a typed item (a function call, its output, ...)."""
    obj(value, param)
    if "role" in value:
        RESPONSES_MESSAGE(value, param)
    elif "type" in value:
        RESPONSES_TYPED_ITEM(value, param)
    else:
        raise SchemaError(f"Missing required parameter: '{param}.role' (or '{param}.type').", param)


STOP = optional(one_of("a string or an array of strings", string, array(string)))
# The ranges of OpenAI's API reference (platform.openai.com/docs/api-reference/chat/create,
# completions/create, responses/create), per field
TEMPERATURE = optional(within(0, 2))
TOP_P = optional(within(0, 1))
PENALTY = optional(within(-2, 2))
CHOICES = optional(within(1, 128, integral=True))  # n
TOP_LOGPROBS = optional(within(0, 20, integral=True))
COMPLETION_LOGPROBS = optional(within(0, 5, integral=True))  # completions' logprobs
BEST_OF = optional(within(0, 20, integral=True))
LOGIT_BIAS = optional(values_of(within(-100, 100)))
SEED = optional(within(-(2**63), 2**63 - 1, integral=True))  # the engines keep it in 64 bits
OUTPUT_TOKENS = optional(within(1, MAX_OUTPUT_TOKENS, integral=True))
COMMON: dict[str, Check] = {
    "model": string,
    "stream": optional(boolean),
    "stream_options": optional(fields({}, {"include_usage": optional(boolean)})),
    "temperature": TEMPERATURE,
    "top_p": TOP_P,
    "presence_penalty": PENALTY,
    "frequency_penalty": PENALTY,
    "n": CHOICES,
    "seed": SEED,
    "max_tokens": OUTPUT_TOKENS,
    "user": optional(string),
    "metadata": optional(obj),
    "tool_choice": optional(one_of("a string or an object", string, obj)),
    "parallel_tool_calls": optional(boolean),
    "top_logprobs": TOP_LOGPROBS,
}
SCHEMAS: dict[str, dict[str, Check]] = {
    "chat": {
        **COMMON,
        "messages": array(MESSAGE, non_empty=True),
        "tools": optional(array(CHAT_TOOL)),
        "stop": STOP,
        "max_completion_tokens": OUTPUT_TOKENS,
        "logprobs": optional(boolean),
        "logit_bias": LOGIT_BIAS,
        "response_format": optional(obj),
    },
    "completions": {
        **COMMON,
        "stop": STOP,
        "logprobs": COMPLETION_LOGPROBS,
        "logit_bias": LOGIT_BIAS,
        "echo": optional(boolean),
        "best_of": BEST_OF,
        "suffix": optional(string),
    },
    "responses": {
        **COMMON,
        "input": one_of("a string or an array of input items", string, array(_responses_item)),
        "instructions": optional(string),
        "tools": optional(array(RESPONSES_TOOL)),
        "max_output_tokens": OUTPUT_TOKENS,
        "previous_response_id": optional(string),
        "store": optional(boolean),
        "include": optional(array(string)),
        "text": optional(obj),
        "reasoning": optional(obj),
        "truncation": optional(string),
    },
}


# A request's prompt has at most this many parts (messages or input items, and their content
# parts): far above any conversation an agent sends (each part is at least one template token,
# and the longest contexts are ~128k tokens), while the check of the largest body it lets through
# stays short (measured with `python -m loadtest.bench.faults`, docs/security.md)
MAX_PROMPT_PARTS = 10_000
PROMPT_FIELDS = {"chat": "messages", "responses": "input"}  # a completion's prompt is text or ids


def _parts(value: Any) -> int:
    """A prompt's parts: its messages or items, and the content parts of each."""
    if not isinstance(value, list):
        return 0
    count = len(value)
    for item in value:
        content = item.get("content") if isinstance(item, dict) else None
        if isinstance(content, list):
            count += len(content)
    return count


def parts_problem(endpoint: str, body: Mapping[str, Any]) -> SchemaError | None:
    """The prompt field of `body` with more than MAX_PROMPT_PARTS parts, or None (pure)."""
    field = PROMPT_FIELDS.get(endpoint)
    if field is None:
        return None
    count = _parts(body.get(field))
    if count <= MAX_PROMPT_PARTS:
        return None
    return SchemaError(
        f"Invalid '{field}': {count} parts (messages, items and their content parts), more "
        f"than the {MAX_PROMPT_PARTS} a request may have.",
        field,
        "too_many_parts",
    )


def schema_problem(endpoint: str, body: Mapping[str, Any]) -> SchemaError | None:
    """The first field of `body` that breaks `endpoint`'s schema, or None (pure)."""
    parts = parts_problem(endpoint, body)
    if parts is not None:
        return parts
    for name, check in SCHEMAS.get(endpoint, {}).items():
        if name in body:
            try:
                check(body[name], name)
            except SchemaError as err:
                return err
    return None


def check_request(endpoint: str, body: Mapping[str, Any]) -> None:
    """Raise the 400 for the first field of `body` that breaks `endpoint`'s schema."""
    problem = schema_problem(endpoint, body)
    if problem is not None:
        raise bad_request(str(problem), code=problem.code, param=problem.param)
