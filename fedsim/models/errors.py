"""The models' user error, in a module of its own so that the registry and the own-model adapter
(``own``), which the registry's table uses, can both raise it."""


class ModelSpecError(ValueError):
    """A model spec that cannot be built (unknown name, dataset, option, or impossible value)."""
