"""L-BFGS in the engine: one iteration per engine step follows torch's own L-BFGS, and an L-BFGS
attack runs one job per group with its masks held at their (analytical) init."""

import pytest
import torch

from attacker.attacks import AttackConfigError, make_attack
from attacker.engine.lbfgs import ImageLBFGS
from attacker.engine.runner import run_jobs
from attacker.jobs import jobs_from_images
from fedsim.models import ModelSpec


def _problem(seed=0):
    gen = torch.Generator().manual_seed(seed)
    a, b = torch.randn(30, 12, generator=gen), torch.randn(30, generator=gen)
    return lambda x: ((a @ x.flatten() - b) ** 2).sum() + 0.1 * (x**4).sum(), torch.randn(1, 3, 4, generator=gen)


def test_one_iteration_per_step_follows_torch_lbfgs():
    fn, start = _problem()
    x = torch.nn.Parameter(start.clone())
    stepper = ImageLBFGS(x, lr=1.0, box=None)
    for _ in range(15):
        stepper.step(lambda: fn(x), lambda loss: loss.backward())
    y = torch.nn.Parameter(start.clone())
    ref = torch.optim.LBFGS([y], lr=1.0, max_iter=15, max_eval=10_000, tolerance_grad=0.0, tolerance_change=0.0,
                            line_search_fn="strong_wolfe")  # fmt: skip

    def closure():
        ref.zero_grad()
        loss = fn(y)
        loss.backward()
        return loss

    ref.step(closure)
    assert torch.allclose(x.detach(), y.detach(), atol=1e-6)
    # the accepted point of a line search is not evaluated twice
    assert stepper.evaluations <= ref.state[ref._params[0]]["func_evals"]


def test_the_box_holds():
    fn, start = _problem(1)
    x = torch.nn.Parameter(start.clone())
    low, high = torch.full((1, 1, 1), -0.2), torch.full((1, 1, 1), 0.3)
    stepper = ImageLBFGS(x, lr=1.0, box=(low, high))
    for _ in range(5):
        stepper.step(lambda: fn(x), lambda loss: loss.backward())
    assert bool((x >= low).all()) and bool((x <= high).all())


def test_lbfgs_dia_runs_alone_with_its_masks_held(tmp_path):
    gen = torch.Generator().manual_seed(0)
    spec = ModelSpec("lenet", "cifar10", 0.5)
    batches = [(torch.rand(1, 3, 32, 32, generator=gen), torch.tensor([k])) for k in range(2)]
    jobs, oracles = jobs_from_images(spec, batches)
    attack = make_attack("dia", optimizer="lbfgs", lr=1.0, mask_init="analytical", max_iterations=30)
    results = run_jobs(jobs, [attack, attack], None, tmp_path, checkpoint_every=30, progress=False)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["group000", "group001"]  # one job each
    for result, oracle in zip(results, oracles):
        assert result.losses[-1] < 0.5 * result.losses[0]
        assert torch.equal(result.masks[0], oracle.masks[0].float())  # analytical: the true masks, not moved


def test_unknown_optimizer_is_refused():
    with pytest.raises(AttackConfigError, match="optimizer must be one of"):
        make_attack("dia", optimizer="sgd")


def test_a_stuck_lbfgs_job_ends_as_converged(tmp_path):
    gen = torch.Generator().manual_seed(1)
    jobs, _ = jobs_from_images(
        ModelSpec("lenet", "mnist", 0.0), [(torch.rand(1, 3, 28, 28, generator=gen), torch.tensor([2]))]
    )
    # loss_threshold 0: only the stuck rule can end it before the cap
    attack = make_attack("ig_eval", optimizer="lbfgs", lr=1.0, max_iterations=3_000, patience=3_000, loss_threshold=0.0)
    (result,) = run_jobs(jobs, [attack], None, tmp_path, checkpoint_every=500, progress=False)
    assert result.status == "converged" and result.iterations < 3_000


def test_the_strong_profile_takes_lbfgs_only_where_the_masks_need_no_learning():
    from attacker.config import parse_config
    from attacker.engine.lbfgs import lbfgs_fits
    from attacker.jobs import model_from_job

    gen = torch.Generator().manual_seed(2)
    cfg = parse_config({"profile": "strong"})
    one = jobs_from_images(
        ModelSpec("lenet", "cifar10", 0.5), [(torch.rand(1, 3, 32, 32, generator=gen), torch.tensor([1]))]
    )[0][0]
    two = jobs_from_images(
        ModelSpec("lenet", "cifar10", 0.5), [(torch.rand(2, 3, 32, 32, generator=gen), torch.tensor([1, 2]))]
    )[0][0]

    def fitted(job, name):
        return cfg.for_model(make_attack(name), job.spec, lambda a: lbfgs_fits(job, a, model_from_job(job)))

    assert fitted(one, "dia").optimizer == "lbfgs" and fitted(one, "dia").tv_weight == 1e-3
    assert fitted(one, "wiig").optimizer == "lbfgs"
    # B = 2: the masks are not read from the gradient, DIA must learn them: the paper's settings
    assert (fitted(two, "dia").optimizer, fitted(two, "dia").lr, fitted(two, "dia").tv_weight) == ("adam", 0.1, 1e-2)
    assert fitted(one, "ig_train").optimizer == "adam"  # fresh random masks each iteration


# -- the attack optimizers as one table (engine/optimizers.py) --------------------------------------


def test_the_attack_optimizers_are_one_table():
    from attacker.attacks import OPTIMIZERS
    from attacker.engine.optimizers import ATTACK_OPTIMIZERS

    assert OPTIMIZERS == tuple(ATTACK_OPTIMIZERS) == ("adam", "lbfgs")
    assert all(entry.name == name for name, entry in ATTACK_OPTIMIZERS.items())
    assert ATTACK_OPTIMIZERS["adam"].batches_jobs and not ATTACK_OPTIMIZERS["adam"].needs_fixed_masks
    assert not ATTACK_OPTIMIZERS["lbfgs"].batches_jobs and ATTACK_OPTIMIZERS["lbfgs"].needs_fixed_masks


def test_a_new_attack_optimizer_is_one_entry(tmp_path, monkeypatch):
    """An entry that steps one job at a time: the attack config accepts its name, the runner gives each
    of its jobs a group of its own, and the module's training_step runs its step."""
    from attacker.engine.inversion import InversionModule
    from attacker.engine.optimizers import ATTACK_OPTIMIZERS, LBFGS

    calls = []

    class Counted(LBFGS):
        name = "counted"

        def step(self, module, active):
            calls.append(list(active))
            super().step(module, active)

    monkeypatch.setitem(ATTACK_OPTIMIZERS, "counted", Counted())
    gen = torch.Generator().manual_seed(3)
    jobs, _ = jobs_from_images(
        ModelSpec("lenet", "mnist", 0.0), [(torch.rand(1, 3, 28, 28, generator=gen), torch.tensor([k])) for k in (1, 2)]
    )
    attack = make_attack("ig_eval", optimizer="counted", lr=1.0, max_iterations=4)
    results = run_jobs(jobs, [attack, attack], None, tmp_path, checkpoint_every=4, progress=False)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["group000", "group001"]
    assert calls == [[0]] * 8 and all(r.iterations == 4 for r in results)
    with pytest.raises(ValueError, match="share one attack optimizer"):
        InversionModule(jobs, [make_attack("ig_eval"), attack])
    with pytest.raises(ValueError, match="runs one job per module"):
        InversionModule(jobs, [attack, attack])
