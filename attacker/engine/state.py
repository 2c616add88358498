"""Each job's bookkeeping as plain data: stopping, best iterate, learning-rate schedule, Adam steps.

The engine optimizes V jobs at once, but every job stops, keeps its best iterate and lowers its
learning rate on its own (the paper's rules, per job). Lists indexed by job, saved whole in a
checkpoint: the keys of :meth:`JobState.state_dict` are this dataclass's fields, written once.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from ..attacks import AttackConfig
from .job_adam import SCHEDULES

RUNNING = "running"


@dataclass
class JobState:
    job_lr: list[float]  # each job's current learning rate (lowered by its plateau rule)
    iteration: int = 0
    status: list[str] = field(default_factory=list)  # running | converged | no_improvement | max_iterations | diverged
    best_loss: list[float] = field(default_factory=list)
    best_iteration: list[int] = field(default_factory=list)
    since_best: list[int] = field(default_factory=list)
    has_best: list[bool] = field(default_factory=list)
    losses: list[list[float]] = field(default_factory=list)
    adam_steps: list[int] = field(default_factory=list)
    plateau_best: list[float] = field(default_factory=list)
    plateau_bad: list[int] = field(default_factory=list)

    @classmethod
    def start(cls, attacks: list[AttackConfig]) -> JobState:
        v = len(attacks)
        return cls(
            job_lr=[float(a.lr) for a in attacks],
            status=[RUNNING] * v,
            best_loss=[float("inf")] * v,
            best_iteration=[-1] * v,
            since_best=[0] * v,
            has_best=[False] * v,
            losses=[[] for _ in range(v)],
            adam_steps=[0] * v,
            plateau_best=[float("inf")] * v,
            plateau_bad=[0] * v,
        )

    def active(self) -> list[int]:
        return [j for j, status in enumerate(self.status) if status == RUNNING]

    def observe(
        self, active: list[int], values: list[float], attacks: list[AttackConfig]
    ) -> tuple[list[int], list[tuple[int, float]]]:
        """Record this iteration's loss of each active job and apply the stopping rules: returns the
        jobs whose loss improved (their best iterate is to be kept) and the (job, loss) pairs still to
        be stepped."""
        improved, stepping = [], []
        for j, value in zip(active, values):
            attack = attacks[j]
            if value != value or value in (float("inf"), float("-inf")):
                self.status[j] = "diverged"
                continue
            self.losses[j].append(value)
            if value < self.best_loss[j]:
                self.best_loss[j], self.best_iteration[j], self.since_best[j] = value, self.iteration, 0
                self.has_best[j] = True
                improved.append(j)
            else:
                self.since_best[j] += 1
            if self.best_loss[j] < attack.loss_threshold:
                self.status[j] = "converged"
            elif self.since_best[j] >= attack.patience:
                self.status[j] = "no_improvement"
            elif self.iteration + 1 >= attack.max_iterations:
                self.status[j] = "max_iterations"
            if self.status[j] == RUNNING:
                stepping.append((j, value))
        return improved, stepping

    def restart_tracking(self, jobs: list[int]) -> None:
        """Forget these jobs' best loss and plateau counter (not their best iterate until a new one
        comes): their objective has changed (an Adam replay's smoothing ended), so earlier losses are
        not comparable with later ones."""
        for j in jobs:
            self.best_loss[j], self.since_best[j] = float("inf"), 0
            self.plateau_best[j], self.plateau_bad[j] = float("inf"), 0

    def schedule(self, j: int, loss: float, attack: AttackConfig) -> None:
        """Job j's learning rate after its schedule (job_adam.SCHEDULES: the paper's plateau rule, or
        steps at fixed fractions of the cap) saw this iteration's ``loss``."""
        self.job_lr[j], self.plateau_best[j], self.plateau_bad[j] = SCHEDULES[attack.schedule](
            self.job_lr[j], self.plateau_best[j], self.plateau_bad[j], loss, self.iteration, attack
        )

    def state_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def load_state_dict(self, state: dict) -> None:
        for f in fields(self):
            setattr(self, f.name, state[f.name])
