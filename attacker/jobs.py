"""Victim jobs (what the server has) and oracles (ground truth), kept apart in the types.

A ``VictimJob`` holds only what an honest-but-curious server sees: the model spec and weights,
the shared gradient of one local step, the labels (assumed known, or recovered), p and B. The
client's real images and dropout masks live in an ``Oracle``, which the engine hands only to WIIG
(replayed masks) and to scoring, never to IG or DIA.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import Tensor, nn
from torch.utils.data import TensorDataset

from fedsim.client_step import one_step_plan, run_local_round
from fedsim.models import ModelSpec, build_model


@dataclass
class VictimJob:
    job_id: str
    spec: ModelSpec
    weights: dict[str, Tensor]  # the global weights the server sent (shared between jobs, not copied)
    gradient: list[Tensor]  # the client's shared gradient, in model.parameters() order
    labels: Tensor  # (B,)
    label_source: str = "known"  # "known" or "recovered"
    meta: dict = field(default_factory=dict)

    @property
    def batch_size(self) -> int:
        return int(self.labels.shape[0])

    @property
    def p(self) -> float:
        return self.spec.p


@dataclass(frozen=True)
class Oracle:
    """Ground truth of one job: the client's images and the dropout masks of its step."""

    images: Tensor
    masks: tuple[Tensor, ...]


def model_from_job(job: VictimJob) -> nn.Module:
    model = build_model(job.spec)
    model.load_state_dict(job.weights)
    return model


def jobs_from_images(
    spec: ModelSpec,
    batches: list[tuple[Tensor, Tensor]],
    *,
    seed: int = 0,
    prefix: str = "victim",
) -> tuple[list[VictimJob], list[Oracle]]:
    """Build victim jobs the offline way: every batch is one client step at the model's (seeded)
    initial weights, as in the paper ("all models are initialized randomly"). The dropout masks
    are drawn from a generator seeded per batch, so a job is reproducible on its own."""
    model = build_model(spec)
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    jobs, oracles = [], []
    for i, (images, labels) in enumerate(batches):
        # The client's round, as in the federation: one plain SGD step on the batch (fedsim's client step).
        plan = one_step_plan(1.0, seed=seed * 100_003 + i, float64=False, keep_gradients=True)
        (step,) = run_local_round(model, TensorDataset(images, labels), plan).steps
        jobs.append(VictimJob(f"{prefix}{i:03d}", spec, weights, step.gradient, labels.clone(), "known", {"index": i}))
        oracles.append(Oracle(images.clone(), tuple(step.masks)))
    return jobs, oracles
