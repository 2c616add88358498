"""Victim jobs from the curious server's captures (the federated path): one-step gradients, and
updates of whole local rounds (FedAvg) with the round's plan for the replay.

Under secure aggregation a capture is the mean of N clients' replies (``Capture.aggregate``): a one-step
aggregate is the gradient of one batch of all N·B images, each with its own dropout masks, so it is one
job of N·B images (labels recovered or known as for B > 1; the N clients' oracles, concatenated in the
capture's image order, are its ground truth); a mean of FedAvg updates is one job of all the clients'
images whose replay runs each client's round from the shared start on its own images and averages
them by weight (``VictimJob.members``). The quantization noise stays in the target.

The attacker reads only captures. The oracle folder of an audited simulation run is read for
WIIG's masks and for scoring, and is handed to nothing else.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

import torch

from fedsim import dp_sgd
from fedsim.capture import Capture, CaptureError, find_oracles, list_captures, load_capture
from fedsim.capture_kinds import CAPTURE_KINDS
from fedsim.client_step import LocalPlan, LocalPlanError
from fedsim.defenses import NO_DEFENSE, Defense, get_defense
from fedsim.run_config import DEFAULTS, RunConfigError, resolve_config
from fedsim.task import local_plan

from .jobs import Oracle, VictimJob, model_from_job
from .labels import recover_labels

log = logging.getLogger(__name__)


def _same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def replay_plan(capture: Capture, replay_order: str = "known") -> LocalPlan:
    """The client's local round as the server sent it (the capture's hyperparameters), read with the
    same function the client used (``fedsim.task.local_plan``), batches in order. With a known batch
    order (the default) a round shuffled across several epochs is refused; with "unknown" it is
    replayed on one copy of the images per epoch (``attacker.jobs.unknown_order``), which needs the
    capture's per-step labels. A plan the replay does not know is a CaptureError naming the problem."""
    sent = capture.hyperparameters
    missing = [k for k in ("optimizer", "lr", "local-epochs", "batch-size", "local-steps") if k not in sent]
    if missing:
        raise CaptureError(f"capture {capture.path}: the update's hyperparameters lack {', '.join(missing)}")
    try:
        cfg = resolve_config({k: v for k, v in sent.items() if k in DEFAULTS}, strict=False)
        dp = None
        if get_defense(str(cfg["defense"])).in_local_round:
            # DP-SGD: the replay clips per example as the client did (dp_sgd.clipped_gradients), on the
            # fixed batches of a victim set; a whole partition's round ran Poisson batches, not recorded.
            if int(cfg["capture-images"]) <= 0:
                raise CaptureError(
                    f"capture {capture.path}: a dp-sgd update of the client's whole partition ran "
                    "Poisson-sampled batches the capture does not record; capture on a victim set "
                    "(capture-images > 0, fixed batches) to attack it"
                )
            dp = dp_sgd.fixed_batch_spec(cfg, 0.0)  # no noise: the server does not know it
            cfg = {**cfg, "defense": NO_DEFENSE}  # the plan's schedule and optimizer; dp set below
        plan = replace(local_plan(cfg, one_step=False, seed=0), dp=dp)
    except (RunConfigError, LocalPlanError, ValueError) as err:
        if isinstance(err, CaptureError):
            raise
        raise CaptureError(f"capture {capture.path}: the replay cannot run this update ({err})") from None
    # A SecAgg+ mean of several clients' rounds: each ran this plan on its own images (counts in clear).
    counts = capture.aggregate.images if capture.aggregate is not None else [capture.num_examples]
    if (
        plan.schedule.order == "shuffled"
        and plan.schedule.epochs > 1
        and plan.schedule.max_steps == 0
        and plan.schedule.batch_size
        and plan.schedule.batch_size < max(counts)
    ):
        # Within one epoch a shuffled order is only a relabelling of the dummies; across epochs the
        # replay has to tie each epoch's copy of an image without knowing where it went.
        if replay_order == "known":
            raise CaptureError(
                f"capture {capture.path}: batches were shuffled across {plan.schedule.epochs} epochs; a "
                "known batch order cannot replay it (attack it with attack_overrides: "
                "{replay_order: unknown}, or --replay-order unknown)"
            )
        if capture.step_labels is None:
            raise CaptureError(
                f"capture {capture.path}: batches were shuffled across {plan.schedule.epochs} epochs and "
                "the capture lacks per-step labels, which the unknown batch order needs"
            )
    # FedProx: the client's steps followed loss + (mu/2)·||w − w_global||², so the replay's must too.
    plan = replace(
        plan,
        schedule=replace(plan.schedule, order="in-order"),
        record_masks=False,
        proximal_mu=capture.proximal_mu,
    )
    steps = max(len(plan.schedule.batches(n, 0)) for n in counts)
    if steps != capture.local_steps:
        raise CaptureError(
            f"capture {capture.path}: the hyperparameters give {steps} local steps on "
            f"{max(counts)} images, the client reported {capture.local_steps}"
        )
    return plan


def jobs_from_captures(
    paths: list[Path],
    run_dir: Path | None = None,
    label_policy: str = "known",
    skip_bad: bool = False,
    replay_order: str = "known",
) -> tuple[list[VictimJob], list[Oracle | None], list[str]]:
    """Load captures as jobs: a one-step gradient, or an update with the local round to replay.
    Captures that share the same global weights (one round) share one weights object, so their jobs
    run as one optimization. Returns the jobs, their oracles (None where the run was not audited)
    and a note per skipped capture. ``replay_order`` is the attacks' (see ``replay_plan``). A capture
    that cannot be read or replayed raises CaptureError, or with ``skip_bad`` (live attacks: the
    others go on) is skipped with a note."""
    jobs: list[VictimJob] = []
    oracles: list[Oracle | None] = []
    skipped: list[str] = []
    weight_sets: list[dict[str, torch.Tensor]] = []
    for path in paths:
        try:
            capture: Capture = load_capture(path)
            plan = replay_plan(capture, replay_order) if CAPTURE_KINDS[capture.kind].replays_local_round else None
        except CaptureError as err:
            if not skip_bad:
                raise
            skipped.append(f"{path.name}: {err}")
            continue
        weights = {k: v.float() if v.is_floating_point() else v for k, v in capture.weights.items()}
        for known in weight_sets:
            if _same_weights(known, weights):
                weights = known
                break
        else:
            weight_sets.append(weights)
        try:
            defense = get_defense(capture.defense)
        except ValueError as err:
            if not skip_bad:
                raise CaptureError(f"capture {path}: {err}") from None
            skipped.append(f"{path.name}: {err}")
            continue
        job = _job(capture, path, weights, plan, defense, label_policy)
        oracle = _oracle(run_dir, capture, plan, job.job_id)
        jobs.append(job)
        oracles.append(oracle)
    return jobs, oracles, skipped


def capture_paths(run_dir: Path | str) -> list[Path]:
    paths = list_captures(run_dir)
    if not paths:
        raise CaptureError(f"no captures found under {run_dir} (expected a run folder with captures/)")
    return paths


def _job(
    capture: Capture,
    path: Path,
    weights: dict[str, torch.Tensor],
    plan: LocalPlan | None,
    defense: Defense,
    label_policy: str,
) -> VictimJob:
    """The victim job of one capture: what the server saw, the replay plan of an update, the labels."""
    if plan is None:
        shared = [g.float() for g in capture.gradient]  # type: ignore[union-attr]
    else:
        shared = [capture.update[n].float() for n in capture.param_names]  # type: ignore[index]
    job_id = f"r{capture.round:04d}_c{capture.client:03d}"
    # What the capture holds under its defense, and the attacker's standard adaptation to it
    # (clipping: none, the cosine distance ignores the scale; noise: attacked as is; pruning:
    # match only the surviving entries). Named in the attack report (attacker.scoring).
    meta: dict = {
        "round": capture.round,
        "client": capture.client,
        "capture": str(path),
        "defense": defense.name,
        "adaptation": defense.adaptation,
    }
    if capture.aggregate is not None:  # one job of all the clients' images: the mean's batch
        agg = capture.aggregate
        job_id = f"r{capture.round:04d}_secagg"
        meta.update(
            client="mean of " + ",".join(map(str, agg.clients)),
            clients=list(agg.clients),
            image_clients=[c for c, count in zip(agg.clients, agg.images) for _ in range(count)],
            quantization_step=agg.step,
        )
    count = capture.label_count
    # A SecAgg+ mean of several clients' rounds: replayed client by client, averaged by their weights.
    members = (
        tuple(zip(capture.aggregate.images, map(float, capture.aggregate.num_examples)))
        if plan is not None and capture.aggregate is not None
        else ()
    )
    if label_policy == "known" and capture.labels is not None:
        labels = capture.labels.long()
        if members and capture.step_labels is not None:
            labels = _members_step_labels(capture.step_labels, [c for c, _ in members], labels)
        elif plan is not None and capture.step_labels is not None and capture.step_labels.numel() >= count:
            # The replay runs its steps in order over the dummies, so dummy i takes the label of the
            # image the client used i-th (its first epoch); for in-order batches that is the same.
            labels = capture.step_labels[:count].long()
        return VictimJob(
            job_id,
            capture.spec,
            weights,
            shared,
            labels,
            "known",
            meta,
            plan,
            match_support=defense.match_support,
            step_labels=capture.step_labels,
            members=members,
        )
    job = VictimJob(
        job_id,
        capture.spec,
        weights,
        shared,
        torch.zeros(count, dtype=torch.long),
        "recovered",
        meta,
        plan,
        match_support=defense.match_support,
        members=members,
    )
    # an update's label counts sit in its last layer just as a gradient's do (up to the step size)
    job.labels = recover_labels(model_from_job(job), shared, count)
    return job


def _members_step_labels(step_labels: torch.Tensor, counts: list[int], labels: torch.Tensor) -> torch.Tensor:
    """Each client's labels in the order its steps used its images (its first epoch), client by client:
    the clients' step labels lie client-major, as many epochs of each client's images as the others'."""
    if step_labels.numel() % sum(counts):
        return labels
    epochs, parts, offset = step_labels.numel() // sum(counts), [], 0
    for count in counts:
        parts.append(step_labels[offset : offset + count])
        offset += epochs * count
    return torch.cat(parts).long()


def _oracle(run_dir: Path | None, capture: Capture, plan: LocalPlan | None, job_id: str) -> Oracle | None:
    """The ground truth of an audited run's capture (scoring and WIIG only), or None."""
    if run_dir is None or not (Path(run_dir) / "oracle").is_dir():
        return None
    try:
        records = find_oracles(run_dir, capture)
    except CaptureError as err:
        log.warning("no oracle for %s: %s", job_id, err)
        return None
    if plan is None and len(records) > 1:  # one-step rounds' mean: the clients' images as one batch
        if any(len(r.masks) != len(records[0].masks) for r in records):
            log.warning("no oracle for %s: its clients' oracles hold different numbers of masks", job_id)
            return None
        images = torch.cat([r.images.float() for r in records])
        masks = tuple(torch.cat([r.masks[i].float() for r in records]) for i in range(len(records[0].masks)))
        return Oracle(images, masks)
    # one client's round, or a mean of several clients' rounds: their truths client by client, each client's
    # images in the order its steps used them (the replay's dummies), its masks step by step
    parts, masks = [], []
    for record in records:
        images = record.images.float()
        if plan is not None and record.batches:
            used = [i for batch in record.batches for i in batch][: images.shape[0]]
            images = images[torch.tensor(used)]
        parts.append(images)
        masks += [m.float() for m in record.masks]
    return Oracle(torch.cat(parts), tuple(masks))
