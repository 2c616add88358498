"""Run many victim jobs: group those that can share one batched optimization, hand each group to
Lightning's Trainer (GPU when there is one), checkpoint, resume, and collect the results."""

from __future__ import annotations

import json
import logging
import math
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, RichProgressBar
from lightning.pytorch.loggers import CSVLogger

from fedsim.atomic import atomic_path
from fedsim.models import model_family

from ..attacks import AttackConfig
from ..curves import SSIMCurve
from ..jobs import JobResult, Oracle, VictimJob, model_from_job
from .gradients import PerJobGradients
from .inversion import CHECKPOINT_EVERY, InversionModule

log = logging.getLogger(__name__)


class EpochCheckpoint(Callback):
    """Writes ``last.ckpt`` atomically at the end of every chunk of iterations (a Lightning epoch).

    Why not ModelCheckpoint: it skips a save when ``trainer.global_step`` has not moved since the
    last one, and the per-job optimizers of our manual optimization never move it."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        with atomic_path(self.path) as tmp:
            trainer.save_checkpoint(tmp)


class CheckpointError(ValueError):
    """A checkpoint in the run folder that cannot be read safely."""


def _check_checkpoint(path: Path) -> None:
    import torch

    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # truncated, corrupt, or holding objects a safe load refuses
        raise CheckpointError(
            f"checkpoint {path} cannot be read safely ({type(err).__name__}); remove it to restart that group"
        ) from None
    if not isinstance(state, dict) or "inversion" not in state:
        raise CheckpointError(f"checkpoint {path} is not an attack checkpoint of this tool")
    if state["inversion"].get("format") != InversionModule.CHECKPOINT_FORMAT:
        raise CheckpointError(
            f"checkpoint {path} was written by an older version of the engine; remove it to restart that group"
        )


def group_jobs(jobs: list[VictimJob]) -> list[list[int]]:
    """Jobs sharing model spec, weights object, batch size and what they match (a gradient, or an
    update of the same local steps) run as one optimization."""
    groups: dict[tuple, list[int]] = {}
    for i, job in enumerate(jobs):
        key = (
            json.dumps(job.spec.to_dict(), sort_keys=True),
            id(job.weights),
            job.batch_size,
            job.kind,
            json.dumps(job.steps),
        )
        groups.setdefault(key, []).append(i)
    return list(groups.values())


@contextmanager
def quiet_lightning() -> Iterator[None]:
    """Lightning's INFO and warnings about a Trainer the user never configured (the accelerator it
    found, tips about its cloud products, its checkpoint loading) are noise in a report or a notebook:
    only its errors pass while the engine runs. Lightning sets its loggers' levels on import, so this
    acts at run time rather than once."""
    loggers = [logging.getLogger(name) for name in ("lightning.pytorch", "lightning.fabric", "pytorch_lightning")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def device_kind(accelerator: str) -> str:
    """ "gpu" or "cpu": the device Lightning will pick for ``accelerator`` ("auto": a GPU when there is one)."""
    on_gpu = accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.is_available())
    return "gpu" if on_gpu else "cpu"


def run_jobs(
    jobs: list[VictimJob],
    attacks: list[AttackConfig],
    oracles: list[Oracle | None] | None,
    run_dir: Path | str,
    *,
    seed: int = 0,
    accelerator: str = "auto",
    checkpoint_every: int = CHECKPOINT_EVERY,
    progress: bool = True,
    max_jobs_per_group: int = 512,
    score_oracles: list[Oracle | None] | None = None,
    curve_every: int = 100,
) -> list[JobResult]:
    """Optimize every job; results come back in job order. An interrupted run resumes from the
    groups' last checkpoints when called again with the same jobs and run_dir. With
    ``score_oracles`` (the ground truth, for scoring only), each result carries its SSIM curve."""
    run_dir = Path(run_dir)
    results: list[JobResult | None] = [None] * len(jobs)
    groups = []
    kind = device_kind(accelerator)
    for group in group_jobs(jobs):
        # each model family's own cap on this device (fedsim.models.MODELS), within the run's
        cap = min(max_jobs_per_group, model_family(jobs[group[0]].spec.name).group_caps.get(kind, max_jobs_per_group))
        for start in range(0, len(group), cap):
            groups.append(group[start : start + cap])
    # BatchNorm models cannot batch jobs, nor can L-BFGS (one objective per optimizer): single-job groups.
    split = []
    for group in groups:
        batched = PerJobGradients.check(model_from_job(jobs[group[0]])) is None
        alone = [i for i in group if not batched or attacks[i].optimizer == "lbfgs"]
        rest = [i for i in group if i not in alone]
        split.extend([[i] for i in alone] + ([rest] if rest else []))
    for g, group in enumerate(split):
        module = InversionModule(
            [jobs[i] for i in group],
            [attacks[i] for i in group],
            [oracles[i] for i in group] if oracles else None,
            seed=seed,
            chunk=checkpoint_every,
        )
        max_iterations = max(attacks[i].max_iterations for i in group)
        ckpt_dir = run_dir / "checkpoints" / f"group{g:03d}"
        last = ckpt_dir / "last.ckpt"
        callbacks: list = [EpochCheckpoint(last)]
        curve = SSIMCurve([score_oracles[i] for i in group], curve_every) if score_oracles and curve_every > 0 else None
        if curve is not None:
            callbacks.append(curve)
        if progress:
            callbacks.append(RichProgressBar())
        with quiet_lightning():
            trainer = L.Trainer(
                max_epochs=math.ceil(max_iterations / checkpoint_every),
                accelerator=accelerator,
                devices=1,
                logger=CSVLogger(run_dir, name="logs", version=f"group{g:03d}"),
                callbacks=callbacks,
                enable_model_summary=False,
                enable_progress_bar=progress,
                log_every_n_steps=min(50, checkpoint_every),
                inference_mode=False,
                num_sanity_val_steps=0,
            )
            if last.exists():
                _check_checkpoint(last)
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*does not have many workers.*")
                warnings.filterwarnings("ignore", message=".*`training_step` returned `None`.*")
                # weights_only: a checkpoint is read as tensors and plain data, never as arbitrary pickles.
                trainer.fit(module, ckpt_path=str(last) if last.exists() else None, weights_only=True)
        for k, (i, result) in enumerate(zip(group, module.results())):
            if curve is not None:
                result.ssim_curve = list(curve.points[k])
            results[i] = result
    return [r for r in results if r is not None]
