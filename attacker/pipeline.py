"""From a run config to a finished run folder: victims -> jobs -> batched attack -> scores -> report."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from fedsim.data import load_dataset, load_victim_file, paper_victims, partition_iid, sample_victims

from .attacks import ALIASES, AttackConfig
from .captures import capture_paths, jobs_from_captures
from .closed_form.run import SOLVED, ClosedForms
from .config import ConfigError, RunConfig, dump_config
from .engine.lbfgs import lbfgs_fits
from .engine.replay import unroll_bytes
from .engine.span import span_reason
from .jobs import (
    BatchOrderError,
    JobResult,
    Oracle,
    VictimJob,
    as_one_gradient,
    exact_as_gradient,
    jobs_from_images,
    model_from_job,
    unknown_order,
)
from .labels import recover_labels
from .metrics import LpipsScorer
from .report import atomic_write, write_results
from .scoring import score_results


class RunDirError(ValueError):
    """The output folder cannot take this run (it holds a finished run)."""


def build_victims(cfg: RunConfig, log: Callable[[str], Any] | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    v = cfg.victims
    spec = cfg.model_spec()
    channels = spec.input_shape[0]
    if v.source in ("file", "paper"):
        path = v.file if v.source == "file" else paper_victims(v.dataset, v.data_root, log=log)
        inputs, targets = load_victim_file(path)  # type: ignore[arg-type]
        if inputs.shape[1] == 1 and channels == 3:
            inputs = inputs.repeat(1, 3, 1, 1)  # the paper feeds MNIST to the CNNs as 3 channels
        if tuple(inputs.shape[1:]) != tuple(spec.input_shape):
            raise ConfigError(
                f"victim file {path} holds images of shape {tuple(inputs.shape[1:])}, but {spec.name} on "
                f"{spec.dataset} takes {tuple(spec.input_shape)}"
            )
        if inputs.shape[0] < v.count:
            raise ConfigError(f"victim file {path} holds {inputs.shape[0]} images, fewer than victims.count={v.count}")
        if int(targets.max()) >= spec.num_classes:
            raise ConfigError(
                f"victim file {path} has labels up to {int(targets.max())}, the model has {spec.num_classes} classes"
            )
        b = v.victim_batch_size
        return [(inputs[i : i + b], targets[i : i + b]) for i in range(0, v.count, b)]
    dataset = load_dataset(v.dataset, v.data_root, train=True, channels=channels)
    parts = partition_iid(len(dataset), v.num_clients, v.seed)
    try:
        return sample_victims(dataset, parts[v.client], k=v.count, batch_size=v.victim_batch_size, seed=v.seed)
    except ValueError as err:
        raise ConfigError(f"cannot sample victims: {err}") from None


def apply_label_policy(jobs: list[VictimJob], policy: str) -> list[VictimJob]:
    if policy == "known":
        return jobs
    model = model_from_job(jobs[0])
    out = []
    for job in jobs:
        labels = recover_labels(model, job.gradient, job.batch_size)
        # recovered labels come without their step order: an unknown batch order cannot be attacked then
        out.append(replace(job, labels=labels, label_source="recovered", step_labels=None))
    return out


def load_jobs(
    cfg: RunConfig, log: Callable[[str], Any] = print, only: list[Path] | None = None
) -> tuple[list[VictimJob], list[Oracle | None]]:
    """The victim jobs of a config, with their oracles (None where there is no ground truth).
    ``only`` restricts a captures run to the given capture folders (live attacks)."""
    # The engine's runner imports Lightning (about 2 s): only commands that load jobs pay for it.
    from .engine.runner import check_batch_sizes

    v = cfg.victims
    if v.source == "captures":
        paths = only if only is not None else capture_paths(v.captures)  # type: ignore[arg-type]
        if v.max_captures:
            paths = paths[: v.max_captures]
        # live attacks (``only``) report a bad capture and attack the others; a whole run refuses it
        # a capture shuffled across epochs is refused unless every attack takes the batch order as unknown
        order = "unknown" if all(a.replay_order == "unknown" for a in cfg.attack_configs()) else "known"
        jobs, oracles, skipped = jobs_from_captures(
            paths,
            Path(v.captures),
            cfg.labels,  # type: ignore[arg-type]
            skip_bad=only is not None,
            replay_order=order,
        )
        for note in skipped:
            log(f"skipped {note}")
        if not jobs:
            raise ConfigError(f"{v.captures} holds no captures to attack")
        if any(o is None for o in oracles):
            log("no oracle (the run was not audited): WIIG is skipped and only losses are reported")
        check_batch_sizes((j.spec, j.batch_size) for j in jobs)  # a model that couples a batch must run on it
        return jobs, oracles
    batches = build_victims(cfg, log)
    check_batch_sizes((cfg.model_spec(), len(labels)) for _, labels in batches)
    jobs, images_oracles = jobs_from_images(cfg.model_spec(), batches, seed=cfg.seed, plan=cfg.local_plan())
    return apply_label_policy(jobs, cfg.labels), list(images_oracles)


def _unroll_cap(jobs: list[VictimJob], limit_gb: float) -> int:
    """Jobs per optimization so that replayed updates fit in ``limit_gb``; a ConfigError (nothing is
    written yet) when one job alone does not fit."""
    updates = [j for j in jobs if j.plan is not None]
    if not updates:
        return 512
    job = max(updates, key=lambda j: len(j.steps) * j.batch_size)
    per_job = unroll_bytes(model_from_job(job), tuple(job.spec.input_shape), job.steps)
    limit = limit_gb * 2**30
    if per_job > limit:
        raise ConfigError(
            f"the local round of {len(job.steps)} steps on {job.batch_size} images is too large to unroll: "
            f"about {per_job / 2**30:.1f} GB per job, limit {limit_gb:g} GB (max_unroll_gb)"
        )
    return max(1, int(limit // per_job))


def prepare_run_dir(run_dir: Path) -> bool:
    """True when resuming an interrupted run. A finished run is never overwritten."""
    marker = run_dir / "run.json"
    if marker.exists():
        try:
            state = json.loads(marker.read_text()).get("status")
        except (OSError, ValueError):
            state = "unknown"
        if state == "finished":
            raise RunDirError(f"{run_dir} already holds a finished run; choose another --out or remove it")
        return True
    if run_dir.exists() and any(run_dir.iterdir()):
        raise RunDirError(f"{run_dir} exists and is not a run folder of this tool; choose another --out")
    return False


@dataclass
class Pairs:
    """Every (job, attack) the run optimizes, as the engine takes them (jobs, attacks, the oracles only
    WIIG may see, the ground truth of the SSIM curves), and as scoring reads them (each job as the
    client ran it, its ground truth); ``origin[i]``: the scoring entry engine job i belongs to (one
    per restart)."""

    jobs: list[VictimJob] = field(default_factory=list)
    attacks: list[AttackConfig] = field(default_factory=list)
    oracles: list[Oracle | None] = field(default_factory=list)
    curve_oracles: list[Oracle | None] = field(default_factory=list)
    scoring_jobs: list[VictimJob] = field(default_factory=list)
    scoring_oracles: list[Oracle | None] = field(default_factory=list)
    origin: list[int] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)  # per attack that applies to no job, why

    def best_of_restarts(self, results: list[JobResult]) -> list[JobResult]:
        """Per scoring entry, its restart with the lowest loss (never chosen by the ground truth),
        under the entry's own job id."""
        best: dict[int, JobResult] = {}
        for o, result in zip(self.origin, results):
            if o not in best or result.best_loss < best[o].best_loss:
                best[o] = result
        return [replace(best[o], job_id=self.scoring_jobs[o].job_id) for o in range(len(self.scoring_jobs))]


def _pair(
    jobs: list[VictimJob], oracles: list[Oracle | None], attack_cfgs: list[AttackConfig], cfg: RunConfig
) -> Pairs:
    """The run's pairs (see :class:`Pairs`). Each attack takes the profile's settings for its job's
    model family (``RunConfig.for_model``); an attack with restarts runs its job that many times, each
    from its own start (the job id seeds the dummies)."""
    pairs = Pairs()
    built: dict[str, torch.nn.Module] = {}

    def models(job: VictimJob) -> torch.nn.Module:  # one model per spec, only when a profile asks
        key = json.dumps(job.spec.to_dict(), sort_keys=True)
        if key not in built:
            built[key] = model_from_job(job)
        return built[key]

    for attack in attack_cfgs:
        if attack.solver:
            continue  # a closed form is solved, not optimized (closed_form_pairs)
        if attack.image_span:  # the dummies held in the images' span: every job must have one
            refused = [r for r in (span_reason(j, models(j)) for j in jobs) if r is not None]
            if refused:
                line = f"{attack.name} holds the dummies in the span of the first Linear's gradient; {refused[0]}"
                if not cfg.skip_inapplicable:
                    raise ConfigError(line)
                pairs.skipped[attack.name] = line
                continue
        for job, oracle in zip(jobs, oracles):
            if job.plan is not None and not attack.replay:  # the baseline: Δ/(lr·K) as one gradient
                if attack.receives_oracle:
                    continue  # K steps' true masks do not fit one step
                job, oracle = as_one_gradient(job), (Oracle(oracle.images, ()) if oracle is not None else None)
            if attack.receives_oracle and oracle is None:
                continue  # WIIG needs the client's true masks: only audited runs have them
            pairs.scoring_jobs.append(job)
            pairs.scoring_oracles.append(oracle)
            if job.plan is not None and attack.replay_order == "unknown":
                try:
                    job = unknown_order(job)
                except BatchOrderError as err:
                    raise ConfigError(f"attack {attack.name}: {err}") from None
            fitted = cfg.for_model(attack, job.spec, lambda a, job=job: lbfgs_fits(job, a, models(job)))
            for r in range(fitted.restarts):
                pairs.jobs.append(job if r == 0 else replace(job, job_id=f"{job.job_id}+restart{r}"))
                pairs.attacks.append(fitted)
                pairs.oracles.append(oracle if attack.receives_oracle else None)  # the threat model (attacks.py)
                pairs.curve_oracles.append(oracle)
                pairs.origin.append(len(pairs.scoring_jobs) - 1)
    return pairs


@dataclass
class ClosedFormPlan:
    """The closed-form solves of a run: (job, oracle, solver) for each that applies, and per solver
    that applies to no job, why (one line each)."""

    solves: list[tuple[VictimJob, Oracle | None, str]] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)


def closed_form_pairs(
    forms: ClosedForms, jobs: list[VictimJob], oracles: list[Oracle | None], cfg: RunConfig
) -> ClosedFormPlan:
    """Which closed form solves which job. A solver named on its own must apply to every job (else a
    ConfigError: one line naming what is missing) unless the run skips what does not apply
    (``skip_inapplicable``, as an experiment's cells do); one that came with ``closed_form`` is skipped
    where it does not apply, and the reason kept for the report."""
    explicit = {ALIASES.get(n, n) for n in cfg.attacks}
    plan = ClosedFormPlan()
    for attack in cfg.attack_configs():
        if not attack.solver:
            continue
        reasons = {j.job_id: forms.reason(attack.solver, j) for j in jobs}
        bad = [r for r in reasons.values() if r is not None]
        if bad and attack.name in explicit and not cfg.skip_inapplicable:
            raise ConfigError(bad[0])
        plan.solves += [(j, o, attack.solver) for j, o in zip(jobs, oracles) if reasons[j.job_id] is None]
        if len(bad) == len(jobs):
            plan.skipped[attack.solver] = bad[0]
    return plan


def run_attack(
    cfg: RunConfig,
    run_dir: str | Path,
    *,
    progress: bool = True,
    log: Callable[[str], Any] = print,
    only: list[Path] | None = None,
) -> dict[str, Any]:
    """Run every configured attack on every victim and write the run folder. Returns the summary."""
    from .engine.runner import run_jobs  # Lightning: see load_jobs

    run_dir = Path(run_dir)
    resuming = prepare_run_dir(run_dir)
    if resuming:
        log(f"resuming the interrupted run in {run_dir}")
    started = time.time()
    jobs, oracles = load_jobs(cfg, log, only)  # before writing anything: bad input leaves no folder
    # One plain SGD step on all images IS a gradient: the one-step attack, exactly.
    jobs = [as_one_gradient(j) if exact_as_gradient(j) else j for j in jobs]
    attack_cfgs = cfg.attack_configs()
    forms = ClosedForms()
    closed = closed_form_pairs(forms, jobs, oracles, cfg)
    pairs = _pair(jobs, oracles, attack_cfgs, cfg)
    closed.skipped.update(pairs.skipped)  # one record of what did not run, and why (closed_form.json)
    all_jobs = pairs.jobs
    if not all_jobs and not closed.solves:
        if closed.skipped and len(closed.skipped) == len(attack_cfgs):
            raise ConfigError("no attack applies:\n" + "\n".join(closed.skipped.values()))
        raise ConfigError("nothing to attack: no victim job fits the chosen attacks")
    group_cap = _unroll_cap(all_jobs, cfg.max_unroll_gb)
    atomic_write(run_dir / "config.yaml", dump_config(cfg))
    atomic_write(run_dir / "run.json", json.dumps({"status": "running", "started": started}))
    spec = jobs[0].spec
    what = "victim batches" if jobs[0].plan is None else f"client updates of {len(jobs[0].steps)} local steps"
    if jobs[0].plan is not None and jobs[0].plan.proximal_mu:  # the replay includes FedProx's term
        what += f" (FedProx, mu {jobs[0].plan.proximal_mu:g})"
    ran = [a for a in attack_cfgs if (a.solver or a.name) not in closed.skipped]
    log(
        f"{len(all_jobs) + len(closed.solves)} victim jobs: {len(jobs)} {what} x {len(ran)} attacks "
        f"({', '.join(a.name for a in ran)}), {spec.name}/{spec.dataset}, p={spec.p}, B={jobs[0].batch_size}"
    )
    for reason in closed.skipped.values():
        log(f"skipped: {reason}")
    # Closed forms first: one shot each, and a run's report lists them above the optimizations.
    solved = [forms.solve(name, job) for job, _, name in closed.solves]
    if solved:
        exact = sum(r.status == SOLVED for r in solved)
        log(
            f"closed forms: {len(solved)} solves, {exact} exact, {sum(r.extras['solve_seconds'] for r in solved):.2f} s"
        )
    results: list[JobResult] = []
    if all_jobs:
        attack_started = time.time()
        results = run_jobs(
            all_jobs,
            pairs.attacks,
            pairs.oracles,
            run_dir,
            seed=cfg.seed,
            accelerator=cfg.device,
            checkpoint_every=cfg.checkpoint_every,
            progress=progress,
            max_jobs_per_group=group_cap,
            score_oracles=pairs.curve_oracles,
            log=log,
        )
        iterations = sum(len(r.losses) for r in results)
        log(
            f"{iterations:,} victim-iterations in {time.time() - attack_started:.0f} s: "
            f"{iterations / max(time.time() - attack_started, 1e-9):.1f} victim-it/s"
        )
        results = pairs.best_of_restarts(results)
    lpips = LpipsScorer(allow_download=True, download_timeout=5.0) if cfg.lpips else None  # offline: "unavailable"
    results = solved + results
    scoring_jobs = [j for j, _, _ in closed.solves] + pairs.scoring_jobs
    scoring_oracles = [o for _, o, _ in closed.solves] + pairs.scoring_oracles
    atomic_write(run_dir / "closed_form.json", json.dumps({"skipped": closed.skipped}, indent=1))
    rows = score_results(scoring_jobs, scoring_oracles, results, lpips)
    for row in rows:
        row["profile"] = cfg.profile  # every result says which attack settings ran
    summary = write_results(
        run_dir,
        scoring_jobs,
        scoring_oracles,
        results,
        rows,
        title=f"{spec.name} / {spec.dataset}, p = {spec.p}, B = {jobs[0].batch_size}, profile {cfg.profile}",
        skipped=closed.skipped,
    )
    elapsed = time.time() - started
    atomic_write(run_dir / "run.json", json.dumps({"status": "finished", "started": started, "seconds": elapsed}))
    return {"summary": summary, "rows": rows, "seconds": elapsed, "run_dir": str(run_dir)}
