"""The data layer's user errors, in a module of their own so that every loader can raise them: the
torchvision and offline loaders (``datasets``), which read Hugging Face sources through ``hf``, and
``hf`` itself, which cannot import ``datasets`` back."""


class DataUnavailableError(RuntimeError):
    """A dataset is neither on disk, nor downloadable, nor available as an offline sample."""


class VictimFileError(ValueError):
    """A victim file is missing, unreadable, or does not hold valid ``inputs``/``targets``."""
