"""The config's base model (unknown keys fail), its shared field types and patterns."""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

_ZMQ_TCP = re.compile(r"^tcp://[^:/\s]+:\d{1,5}$")

PositiveFloat = Annotated[float, Field(gt=0)]
PositiveInt = Annotated[int, Field(gt=0)]
NonNegativeFloat = Annotated[float, Field(ge=0)]
NonNegativeInt = Annotated[int, Field(ge=0)]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def url_key(url: str) -> str:
    """A replica URL as the config compares them: without a trailing slash."""
    return url.rstrip("/")
