"""The ``capture-rounds`` setting read into round numbers: the run config validates it, DP-SGD's
accountant counts the captured rounds, and the curious server captures them.

In a module of its own, importing nothing of the project: the run config imports DP-SGD's tables,
so DP-SGD reading the setting through the run config would be an import cycle.
"""

from __future__ import annotations


def parse_capture_rounds(text: str) -> set[int] | str:
    """``capture-rounds`` as a set of round numbers, or "all"; ValueError saying what is wrong (the run
    config raises it as its RunConfigError)."""
    text = str(text).strip().lower()
    if text == "all":
        return "all"
    if not text:
        return set()
    try:
        rounds = {int(part) for part in text.replace(" ", ",").split(",") if part}
    except ValueError:
        raise ValueError(f"capture-rounds must be 'all' or round numbers like '1,3', got {text!r}") from None
    if min(rounds) < 1:
        raise ValueError(f"capture-rounds must be 'all' or round numbers >= 1, got {text!r}")
    return rounds
