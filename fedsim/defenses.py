"""Defenses applied to what leaves a client, by name: configured once, applied in one place.

A defense maps the client's update (global - local, per state-dict key) to the update it sends.
``fedsim.client_step.run_local_round`` applies the configured one; adding a defense is one
function here and one entry in ``DEFENSES``.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

Update = dict[str, Tensor]


def no_defense(update: Update) -> Update:
    """Send the update as it is (returns the same object, so nothing is recomputed)."""
    return update


DEFENSES: dict[str, Callable[[Update], Update]] = {
    "none": no_defense,
}


def apply_defense(name: str, update: Update) -> Update:
    try:
        defense = DEFENSES[name]
    except KeyError:
        raise ValueError(f"unknown defense {name!r}; choose from {sorted(DEFENSES)}") from None
    return defense(update)
