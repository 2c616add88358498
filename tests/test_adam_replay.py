"""The smoothed Adam replay: the attacker's replay of an Adam client's round with its ε annealed from
``replay_eps_start`` to the client's. At the end of the schedule (or with it off) it is the client's
computation to float precision; at the start it gives the dummies a usable gradient where the exact
replay's almost vanishes; bad settings are refused, on the command line as one line."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from flower_harness import set_task_identity

from attacker.attacks import AttackConfigError, make_attack
from attacker.captures import jobs_from_captures
from attacker.cli import main as attacker_main
from attacker.config import ConfigError, parse_config
from attacker.engine.matching import Matcher
from attacker.engine.objectives import cosine_distance
from attacker.engine.replay import annealed_eps, replay_terms, smoothing_end
from attacker.jobs import model_from_job
from fedsim.capture import list_captures
from tests.test_fedavg import _captured_round

LAYERS = 3  # dropout layers of the MLP


@pytest.fixture(scope="module", autouse=True)
def task_identity() -> None:
    set_task_identity()


def _adam_jobs(tmp_path: Path, images: int = 4):
    """An audited Adam update capture (two clients, batch size 1: K = ``images`` steps) as jobs and oracles."""
    run = _captured_round(tmp_path, lr=1e-3, optimizer="adam", **{"capture-images": images})
    jobs, oracles, skipped = jobs_from_captures(list_captures(run), run)
    assert not skipped and jobs[0].plan.optimizer.name == "adam"
    return jobs, oracles


def _frozen_model(job):
    model = model_from_job(job)
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def _true_masks(oracle, steps: int) -> list[list[torch.Tensor]]:
    return [[m.float() for m in oracle.masks[t * LAYERS : (t + 1) * LAYERS]] for t in range(steps)]


def test_the_schedule_is_geometric_and_ends_at_its_end_value() -> None:
    attack = make_attack("dia", max_iterations=1000, replay_eps_start=1e-4, replay_eps_end=None, replay_eps_anneal=0.5)
    assert annealed_eps(1e-8, attack, 0) == 1e-4
    torch.testing.assert_close(annealed_eps(1e-8, attack, 250), 1e-6)  # halfway in log space
    assert annealed_eps(1e-8, attack, 500) == annealed_eps(1e-8, attack, 999) == 1e-8  # the client's, exactly
    assert smoothing_end(attack) == 500
    assert annealed_eps(1e-8, replace(attack, replay_eps_start=None), 0) == 1e-8  # off
    assert smoothing_end(replace(attack, replay_eps_start=None)) is None
    floor = replace(attack, replay_eps_end=1e-5)
    assert annealed_eps(1e-8, floor, 999) == 1e-5
    default = make_attack("dia", max_iterations=1000)  # the measured default: 1e-3 to 1e-5 over the whole budget
    assert annealed_eps(1e-8, default, 0) == 1e-3 and smoothing_end(default) is None
    torch.testing.assert_close(annealed_eps(1e-8, default, 500), 1e-4)


def test_the_annealed_replay_reproduces_the_captured_adam_update(tmp_path: Path) -> None:
    """Through the engine's own path (Matcher.replay with the attacks and the iteration): at the end of
    the schedule, and with smoothing off, the replay with the true masks is the client's round: <Δ, Δ*> =
    ||Δ||² = ||Δ*||² to float precision. At iteration 0 it is not."""
    jobs, oracles = _adam_jobs(tmp_path)
    matcher = Matcher(jobs, _frozen_model(jobs[0]))
    dummies = [o.images for o in oracles]
    masks = {j: [m.float() for m in o.masks] for j, o in enumerate(oracles)}
    active = list(range(len(jobs)))
    annealed = make_attack(
        "wiig", max_iterations=100, replay_eps_start=1e-4, replay_eps_end=None, replay_eps_anneal=0.5
    )
    off = make_attack("wiig", replay_eps_start=None)
    for attacks, iteration in (([annealed] * 2, 50), ([annealed] * 2, 99), ([off] * 2, 0), (None, 0)):
        terms = matcher.replay(active, dummies, masks, attacks, iteration)
        total = terms.target_norm2.sum(0)
        assert (total > 0).all()
        torch.testing.assert_close(terms.norm2.sum(0), total, rtol=1e-5, atol=0)
        torch.testing.assert_close(terms.dot.sum(0), total, rtol=1e-5, atol=0)
    start = matcher.replay(active, dummies, masks, [annealed] * 2, 0)
    assert (cosine_distance(start) > 1e-3).all()  # the smoothed round is another computation


def test_sgd_captures_ignore_the_smoothing(tmp_path: Path) -> None:
    run = _captured_round(tmp_path, lr=0.05, optimizer="sgd")
    jobs, oracles, _ = jobs_from_captures(list_captures(run), run)
    job, oracle = jobs[0], oracles[0]
    model = _frozen_model(job)
    args = (model, dict(model.named_parameters()), job.plan, [oracle.images], [job.labels])
    masks = [_true_masks(oracle, 4)]
    plain = replay_terms(*args, masks, [job.gradient])
    smoothed = replay_terms(*args, masks, [job.gradient], eps=[1e-2])
    assert torch.equal(plain.dot, smoothed.dot) and torch.equal(plain.norm2, smoothed.norm2)


def test_at_k1_the_smoothed_replay_gives_the_images_a_usable_gradient(tmp_path: Path) -> None:
    """One Adam step is ≈ lr·sign(g): the exact replay's gradient in the images is a few spikes where
    |g| ~ ε, nearly orthogonal to the way to the truth. The smoothed replay at iteration 0 (the default
    start, ε = 1e-3) is another computation, and its gradient points toward the truth.
    (Measured on three dummies: cosine with x* − x 0.01-0.05 exact, 0.32-0.35 smoothed.)"""
    jobs, oracles = _adam_jobs(tmp_path, images=1)
    job, oracle = jobs[0], oracles[0]
    assert job.steps == [[0]]
    model = _frozen_model(job)
    torch.manual_seed(1)
    dummy = (oracle.images + 0.5 * torch.randn_like(oracle.images)).requires_grad_(True)  # away from the truth
    toward_truth = (oracle.images - dummy).detach().flatten()

    def loss_and_alignment(eps: float) -> tuple[torch.Tensor, float]:
        terms = replay_terms(
            model,
            dict(model.named_parameters()),
            job.plan,
            [dummy],
            [job.labels],
            [_true_masks(oracle, 1)],
            [job.gradient],
            eps=[eps],
        )
        loss = cosine_distance(terms).sum()
        (grad,) = torch.autograd.grad(loss, dummy)
        assert torch.isfinite(grad).all()
        return loss.detach(), float(torch.cosine_similarity(-grad.flatten(), toward_truth, dim=0))

    exact_loss, exact_alignment = loss_and_alignment(job.plan.optimizer.eps)
    smooth_loss, smooth_alignment = loss_and_alignment(annealed_eps(job.plan.optimizer.eps, make_attack("dia"), 0))
    assert not torch.isclose(exact_loss, smooth_loss, rtol=1e-3)
    assert exact_alignment < 0.1 and smooth_alignment > 0.25, (exact_alignment, smooth_alignment)


@pytest.mark.parametrize(
    "overrides,words",
    [
        ({"replay_eps_start": 0.0}, "replay_eps_start must be a positive number"),
        ({"replay_eps_start": -1e-5}, "replay_eps_start must be a positive number"),
        ({"replay_eps_start": "1e-4"}, "write 1.0e-4"),  # how YAML reads 1e-4
        ({"replay_eps_end": 0}, "replay_eps_end must be a positive number"),
        ({"replay_eps_anneal": 1.5}, "replay_eps_anneal is a fraction of max_iterations"),
        ({"replay_eps_anneal": 0}, "replay_eps_anneal is a fraction of max_iterations"),
    ],
)
def test_bad_smoothing_settings_raise(overrides: dict, words: str) -> None:
    with pytest.raises(AttackConfigError, match=words):
        make_attack("dia", **overrides)
    with pytest.raises(ConfigError, match=words):
        parse_config({"attacks": ["wiig", "dia"], "attack_overrides": overrides})


def test_a_bad_smoothing_setting_on_the_command_line_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = tmp_path / "adam.yaml"
    cfg.write_text(
        "victims: {source: paper, victim_batch_size: 4, count: 4,\n"
        "  local_round: {local_epochs: 1, batch_size: 1, optimizer: adam, lr: 0.001}}\n"
        "attack_overrides: {replay_eps_anneal: 2.0}\nlpips: false\n"
    )
    out = tmp_path / "attack"
    assert attacker_main(["run", str(cfg), "--iterations", "2", "--quiet", "--out", str(out)]) == 2
    lines = [line for line in capsys.readouterr().out.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and "replay_eps_anneal" in lines[0], lines
    assert not out.exists()
