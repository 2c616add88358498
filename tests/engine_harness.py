"""Running an attack's Lightning module the way the tests do: on CPU, quietly, one call."""

from __future__ import annotations

import lightning as L


def fit_attack(module, max_epochs=1, callbacks=(), ckpt_path=None):
    """Fit ``module`` (an ``InversionModule``) with a quiet CPU Trainer and return its results."""
    trainer = L.Trainer(
        max_epochs=max_epochs,
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=bool(callbacks),
        callbacks=list(callbacks),
    )
    trainer.fit(module, ckpt_path=ckpt_path)
    return module.results()
