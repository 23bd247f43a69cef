"""Keys a config file may no longer use, in one table, and what an unknown key was likely meant
to be: a file written for an older cachelane fails naming what replaced each key, a typo gets a
suggestion ("did you mean"), never just "extra inputs are not permitted".

A key is written as its path with `[]` for any list item (`pools[].costs.prefill_chunk_tokens`),
as deploy/CONFIG.md names them. CHANGELOG.md lists each entry under Removed or Renamed.
"""

from __future__ import annotations

import difflib
import types
import typing
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel


@dataclass(frozen=True)
class Gone:
    """A key that a config file may no longer set, and what to write instead."""

    path: str  # e.g. "pools[].costs.prefill_chunk_tokens"
    instead: str  # the key that replaced it, or what to do
    renamed: bool  # True: `instead` is the key's new path, same meaning


GONE: tuple[Gone, ...] = (
    Gone(
        "pools[].costs.prefill_chunk_tokens",
        "pools[].engine.max_num_batched_tokens (the engine's step budget, vLLM's flag of that "
        "name: the cost model follows vLLM V1's token-budget steps)",
        renamed=True,
    ),
    Gone(
        "pools[].lend_keep_idle",
        "delete it: measured no help on the token-budget engine (docs/critical.md, "
        '"A pinned pool"); lend_below decides when a pinned pool is lent',
        renamed=False,
    ),
    Gone(
        "pools[].lend_max_prefill_tokens",
        "delete it: measured no help on the token-budget engine (docs/critical.md, "
        '"A pinned pool"); lend_below decides when a pinned pool is lent',
        renamed=False,
    ),
    Gone(
        "auth.api_keys",
        "each key belongs to a tenant now: tenants: [{name: NAME, api_key_sha256: DIGEST}] "
        "(`cachelane keygen NAME` makes a key and that entry)",
        renamed=False,
    ),
)
_BY_PATH = {g.path: g for g in GONE}

SUGGEST_CUTOFF = 0.6  # difflib.get_close_matches' own default: a typo, not a different word


def key_path(loc: Sequence[int | str]) -> str:
    """("pools", 0, "costs", "x") -> "pools[].costs.x"."""
    out = ""
    for part in loc:
        out += "[]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def unknown_key(root: type[BaseModel], loc: Sequence[int | str]) -> str:
    """What to say of the key at `loc` that the config does not take: what replaced it, the
    key it is closest to, or the keys that place does take."""
    gone = _BY_PATH.get(key_path(loc))
    if gone is not None:
        if gone.renamed:
            return f"renamed: write {gone.instead}"
        return f"removed: {gone.instead}"
    keys = keys_at(root, loc[:-1])
    if not keys:
        return "unknown key"
    close = difflib.get_close_matches(str(loc[-1]), keys, n=1, cutoff=SUGGEST_CUTOFF)
    if close:
        return f"unknown key: did you mean {close[0]!r}?"
    return f"unknown key (this section takes: {', '.join(sorted(keys))})"


def keys_at(root: type[BaseModel], loc: Sequence[int | str]) -> list[str]:
    """The keys the section at `loc` takes (by their names in the file); [] where it is not a
    section of fixed keys."""
    model: Any = root
    for part in loc:
        if isinstance(part, int) or model is None:
            continue  # a list item: the item's model is the list's
        field = model.model_fields.get(part) or next(
            (f for f in model.model_fields.values() if f.alias == part), None
        )
        if field is None:
            return []
        model = _model_in(field.annotation)
    if model is None:
        return []
    return [f.alias or name for name, f in model.model_fields.items()]


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The config section a field holds: the model itself, or inside Optional, list, Annotated."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    origin = typing.get_origin(annotation)
    if origin is dict:
        return None  # keys of the user's choosing
    if origin in (list, typing.Union, types.UnionType, typing.Annotated):
        for arg in typing.get_args(annotation):
            found = _model_in(arg)
            if found is not None:
                return found
    return None
