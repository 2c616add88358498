"""One validated-number type for every setting that takes a number: the run config's ranges, the
strategies' parameters and the attack settings.

A ``Range`` is an interval (either side open or absent) with optional rules on the value's kind: whole
numbers only, finite only, ``None`` allowed. :meth:`Range.problem` says what a refused value must be,
in the words that follow "must be" in the callers' messages ("in [0, 1)", ">= 1", "an integer"), or
the range's own ``words`` ("a positive integer") where a caller names it so; the callers keep their
own prefixes ("strategy fedadam: eta", "attack dia: lr").
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Range:
    """Numbers between ``low`` and ``high`` (``None``: that side is open-ended; ``*_open``: the bound
    itself is out). ``integer``: whole numbers (ints) only; ``finite``: no inf or nan; ``optional``:
    ``None`` is allowed too. ``words``: how a refusal names the range instead of its interval."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    integer: bool = False
    finite: bool = False
    optional: bool = False
    words: str = ""

    def within(self, value: float) -> bool:
        """Whether the number lies in the interval. Written as comparisons that hold, so nan never does."""
        if self.low is not None and not (self.low < value if self.low_open else self.low <= value):
            return False
        return self.high is None or (value < self.high if self.high_open else value <= self.high)

    def problem(self, value: Any) -> str | None:
        """None when ``value`` is allowed, else what it must be (the words after "must be")."""
        if value is None and self.optional:
            return None
        # bool is an int subclass (JSON and YAML true): refused rather than read as 1
        if isinstance(value, bool) or not isinstance(value, int | float):
            found = "a number"
        elif self.integer and not isinstance(value, int):
            found = "an integer"
        elif self.finite and not math.isfinite(value):
            found = "finite"
        elif not self.within(value):
            found = self.describe()
        else:
            return None
        return self.words or found

    def __contains__(self, value: Any) -> bool:
        return self.problem(value) is None

    def __str__(self) -> str:
        """The interval alone: "[0, 1)", ">= 1", "> 0" (the run config's help text shows it so)."""
        if self.low is not None and self.high is not None:
            return f"{'(' if self.low_open else '['}{self.low:g}, {self.high:g}{')' if self.high_open else ']'}"
        if self.low is not None:
            return f"{'>' if self.low_open else '>='} {self.low:g}"
        if self.high is not None:
            return f"{'<' if self.high_open else '<='} {self.high:g}"
        return "any number"

    def describe(self) -> str:
        """The range as a refusal names it: its ``words``, else "in [0, 1)" for a bounded interval
        and ">= 1" for a half-open one."""
        if self.words:
            return self.words
        bounded = self.low is not None and self.high is not None
        return f"in {self}" if bounded else str(self)


# The ranges several settings share.
AT_LEAST_0 = Range(0)
AT_LEAST_1 = Range(1)
POSITIVE = Range(0, low_open=True)
UNIT = Range(0, 1)
