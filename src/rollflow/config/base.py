"""The base of every config section and the constrained number types the sections share."""

from __future__ import annotations

import re
from typing import Annotated

import msgspec

Positive = Annotated[int, msgspec.Meta(gt=0)]
NonNegative = Annotated[int, msgspec.Meta(ge=0)]
PositiveFloat = Annotated[float, msgspec.Meta(gt=0)]
NonNegativeFloat = Annotated[float, msgspec.Meta(ge=0)]
Probability = Annotated[float, msgspec.Meta(gt=0, le=1)]
#: A base URL: http or https, a host and an optional port, no path.
BASE_URL = re.compile(r"https?://[A-Za-z0-9._\-\[\]:]+(:[0-9]{1,5})?/?")


class Section(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Base of every config section: unknown keys are errors, fields are keyword-only."""
