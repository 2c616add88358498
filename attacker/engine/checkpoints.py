"""The checkpoint interval and the checkpoint error, apart from the Lightning modules that use them:
the config and the CLI read them without importing Lightning (about 2 s in every CLI process)."""

from __future__ import annotations

CHECKPOINT_EVERY = 250  # iterations per Lightning "epoch": the checkpoint interval


class CheckpointError(ValueError):
    """A checkpoint in the run folder that cannot be read safely."""
