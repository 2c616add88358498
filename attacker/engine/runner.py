"""Run many victim jobs: group those that can share one batched optimization, hand each group to
Lightning's Trainer (GPU when there is one), checkpoint, resume, and collect the results."""

from __future__ import annotations

import json
import logging
import math
import warnings
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, RichProgressBar
from lightning.pytorch.loggers import CSVLogger

from fedsim.atomic import atomic_path, atomic_write
from fedsim.models import ModelSpec, model_family

from ..attacks import AttackConfig
from ..curves import SSIMCurve
from ..jobs import JobResult, Oracle, VictimJob, model_from_job
from .checkpoints import CHECKPOINT_EVERY, CheckpointError
from .gradients import PerJobGradients
from .inversion import InversionModule
from .optimizers import ATTACK_OPTIMIZERS

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
    update of the same local steps under the same optimizer and FedProx mu) run as one optimization:
    the matcher replays a group with its first job's plan."""
    groups: dict[tuple, list[int]] = {}
    for i, job in enumerate(jobs):
        key = (
            json.dumps(job.spec.to_dict(), sort_keys=True),
            id(job.weights),
            job.batch_size,
            job.kind,
            json.dumps(job.steps),
            job.members,
            None if job.plan is None else (repr(job.plan.optimizer), job.plan.proximal_mu),
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


def check_batch_sizes(batches: Iterable[tuple[ModelSpec, int]]) -> None:
    """A model whose layers couple the images of a batch (train-mode BatchNorm) must run on each
    victim batch (model spec, batch size B) as the client did: one line (``ModelSpecError``) where it
    cannot, e.g. train-mode BatchNorm at B = 1 with a feature map that reaches 1x1 (a single value
    per channel). Called before anything is run or written."""
    from fedsim.models import DropoutMode, ModelSpecError, build_model, dropout_mode

    seen: set[tuple[str, int]] = set()
    coupled: dict[str, str | None] = {}
    for spec, batch_size in batches:
        key = json.dumps(spec.to_dict(), sort_keys=True, default=repr)
        if (key, batch_size) in seen:
            continue
        seen.add((key, batch_size))
        model = build_model(spec)
        if key not in coupled:
            coupled[key] = PerJobGradients.check(model)
        if coupled[key] is None:
            continue
        model.train()
        try:
            with torch.no_grad(), dropout_mode(model, DropoutMode.OFF):
                model(torch.zeros(batch_size, *spec.input_shape))
        except Exception as err:  # the model's own forward: its error, in one line
            text = str(err).strip().splitlines()
            raise ModelSpecError(
                f"model {spec.name} cannot run a victim batch of B = {batch_size} as the client ran it "
                f"({coupled[key]}): {type(err).__name__}: {text[0] if text else ''}; use a larger victim batch "
                "(B >= 2)"
            ) from None


GRADIENT_PATHS = "gradient_paths.json"  # in the run folder: the path each layer's per-job terms took


def describe_paths(paths: dict[str, str]) -> str:
    """One line: how many layers took each path, naming those off the batched one."""
    by_path: dict[str, list[str]] = {}
    for layer, path in paths.items():
        by_path.setdefault(path, []).append(layer)
    parts = []
    for path, layers in sorted(by_path.items(), key=lambda kv: (not kv[0].startswith("batched"), kv[0])):
        named = "" if path.startswith("batched") else f" ({', '.join(layers[:8])}{', ...' if len(layers) > 8 else ''})"
        parts.append(f"{len(layers)} {path}{named}")
    return "; ".join(parts) if parts else "no layer with parameters"


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
    log: Callable[[str], object] | None = None,
) -> list[JobResult]:
    """Optimize every job; results come back in job order. An interrupted run resumes from the
    groups' last checkpoints when called again with the same jobs and run_dir. With
    ``score_oracles`` (the ground truth, for scoring only), each result carries its SSIM curve.

    Which path each layer's per-job gradient terms took (gradients.PerJobGradients: batched,
    batched-factored, per-job vjp; or one-job autograd for a model with a layer that couples a batch)
    is written per group to ``gradient_paths.json`` in the run folder, and said in one line per
    group to ``log`` (the run's log)."""
    run_dir = Path(run_dir)
    results: list[JobResult | None] = [None] * len(jobs)
    groups = []
    kind = device_kind(accelerator)
    for group in group_jobs(jobs):
        # each model family's own cap on this device (fedsim.models.MODELS), within the run's
        cap = min(max_jobs_per_group, model_family(jobs[group[0]].spec.name).group_caps.get(kind, max_jobs_per_group))
        for start in range(0, len(group), cap):
            groups.append(group[start : start + cap])
    # A model with a layer that couples a batch (train-mode BatchNorm) cannot batch jobs, nor can an
    # optimizer with one objective (L-BFGS: ATTACK_OPTIMIZERS' batches_jobs): single-job groups.
    # Checked once per model spec (a probe pass).
    split = []
    checked: dict[str, str | None] = {}
    for group in groups:
        first = jobs[group[0]]
        key = json.dumps(first.spec.to_dict(), sort_keys=True, default=repr)
        if key not in checked:
            checked[key] = PerJobGradients.check(model_from_job(first), tuple(first.spec.input_shape))
            if checked[key] is not None and log is not None:
                log(f"{first.spec.name}: victim jobs one at a time by autograd: {checked[key]}")
        batched = checked[key] is None
        alone = [i for i in group if not batched or not ATTACK_OPTIMIZERS[attacks[i].optimizer].batches_jobs]
        rest: dict[str, list[int]] = {}  # the others, one group per optimizer (a module steps by one)
        for i in group:
            if i not in alone:
                rest.setdefault(attacks[i].optimizer, []).append(i)
        split.extend([[i] for i in alone] + list(rest.values()))
    record: dict[str, dict] = {}
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
        paths = module.matcher.gradient_paths()
        record[f"group{g:03d}"] = {"jobs": [jobs[i].job_id for i in group], "layers": paths}
        atomic_write(run_dir / GRADIENT_PATHS, json.dumps(record, indent=1))
        if log is not None:
            what = f"group {g} ({len(group)} jobs, {jobs[group[0]].spec.name})"
            log(f"{what}: per-job gradient terms: {describe_paths(paths)}")
        for k, (i, result) in enumerate(zip(group, module.results())):
            if curve is not None:
                result.ssim_curve = list(curve.points[k])
            results[i] = result
    return [r for r in results if r is not None]
