"""The attack engine: per-job terms, batched jobs equal single runs, stopping, divergence, resume."""

import pytest
import torch
from engine_harness import fit_attack as _fit

from attacker.attacks import AttackConfigError, make_attack
from attacker.engine.gradients import PerJobGradients, autograd_terms
from attacker.engine.inversion import InversionModule
from attacker.engine.masks import analytical_masks, analytical_rules
from attacker.engine.runner import EpochCheckpoint, run_jobs
from attacker.jobs import VictimJob, jobs_from_images
from attacker.labels import recover_labels
from fedsim.models import ModelSpec, build_model, mask_shapes, set_dropout_mode, set_masks
from fedsim.models.dropout import MaskedDropout


@pytest.mark.parametrize(
    "name,dataset,options",
    [
        ("mlp", "mnist", {}),
        ("vit", "mnist", {"depth": 1}),
        ("lenet", "mnist", {}),
        ("resnet18", "cifar10", {}),
        ("resnet18", "cifar10", {"stem": "cifar"}),  # 3x3 stride-1 conv1, no max-pool
    ],
)
def test_per_job_terms_equal_autograd(name, dataset, options):
    model = build_model(name, dataset, 0.25, seed=0, **options)
    for p in model.parameters():
        p.requires_grad_(False)
    V, B = 3, 2
    x = torch.randn(V * B, *model.spec.input_shape, requires_grad=True)
    y = torch.randint(0, 10, (V * B,))
    masks = [torch.rand(s) for s in mask_shapes(model, x.detach())]
    set_masks(model, masks)
    set_dropout_mode(model, "learn")
    targets = [torch.randn(V, *p.shape) for p in model.parameters()]
    ghost = PerJobGradients(model)
    ghost.set_targets(targets)
    terms = ghost.compute(x, y, V)
    for j in range(V):
        rows = slice(j * B, (j + 1) * B)
        set_masks(model, [m[rows] for m in masks])
        for p in model.parameters():
            p.requires_grad_(True)
        ref = autograd_terms(model, x.detach()[rows], y[rows], [t[j : j + 1] for t in targets])
        for p in model.parameters():
            p.requires_grad_(False)
        set_masks(model, masks)
        torch.testing.assert_close(terms.dot[:, j], ref.dot[:, 0], rtol=1e-4, atol=1e-4 * ref.dot.abs().max().item())
        torch.testing.assert_close(
            terms.norm2[:, j], ref.norm2[:, 0], rtol=1e-4, atol=1e-4 * ref.norm2.abs().max().item()
        )


def test_batchnorm_is_reported_unsupported():
    model = build_model("resnet18", "cifar10", 0.25, norm="batch")
    assert "BatchNorm2d" in PerJobGradients.check(model)


def _jobs(mnist_like, p=0.25, n=3):
    x, y = mnist_like
    return jobs_from_images(ModelSpec("mlp", "mnist", p), [(x[i : i + 1], y[i : i + 1]) for i in range(n)])


def test_three_batched_jobs_equal_three_single_runs(mnist_like):
    jobs, oracles = _jobs(mnist_like)
    attacks = [
        make_attack("dia", max_iterations=40),
        make_attack("ig_eval", max_iterations=40),
        make_attack("wiig", max_iterations=40),
    ]
    given = [None, None, oracles[2]]  # only WIIG receives the oracle
    module = InversionModule(jobs, attacks, given)
    module.chunk = 40
    batched = _fit(module)
    for j in range(3):
        single_module = InversionModule([jobs[j]], [attacks[j]], [given[j]])
        single_module.chunk = 40
        (single,) = _fit(single_module)
        assert single.best_iteration == batched[j].best_iteration
        assert single.losses == pytest.approx(batched[j].losses, rel=1e-3, abs=1e-6)
        torch.testing.assert_close(single.images, batched[j].images, rtol=1e-3, atol=1e-3)


def test_mlp_attacks_reach_the_papers_ordering(mnist_like):
    """Capped at 400 iterations (paper: up to 20,000): WIIG and DIA reconstruct, IG (eval) does not."""
    from attacker.metrics import score_batch

    jobs, oracles = _jobs(mnist_like, n=2)
    names = ["ig_eval", "wiig", "dia"]
    all_jobs = [j for _ in names for j in jobs]
    attacks = [make_attack(n, max_iterations=400) for n in names for _ in jobs]
    module = InversionModule(all_jobs, attacks, [o if n == "wiig" else None for n in names for o in oracles])
    module.chunk = 400
    results = _fit(module)
    mean, std = (0.13066373765468597,), (0.30810782313346863,)
    ssim = {}
    for name in names:
        vals = [
            score_batch(o.images, r.images, mean, std, match=False)["metrics"]["ssim_paper"]["mean"]
            for r, o in zip([r for r in results if r.attack == name], oracles)
        ]
        ssim[name] = sum(vals) / len(vals)
    assert ssim["wiig"] >= 0.95 and ssim["dia"] >= 0.95, ssim
    assert ssim["ig_eval"] <= 0.85, ssim


def test_stop_rules(mnist_like):
    jobs, oracles = _jobs(mnist_like, n=2)
    attacks = [
        make_attack("wiig", max_iterations=30, loss_threshold=0.5),
        make_attack("dia", max_iterations=30, patience=1, lr=1e3),
    ]
    module = InversionModule(jobs, attacks, [oracles[0], None])
    module.chunk = 30
    converged, stalled = _fit(module)
    assert converged.status == "converged" and converged.iterations < 30
    assert stalled.status in ("no_improvement", "max_iterations")
    assert stalled.best_iteration <= stalled.iterations


def test_diverging_job_stops_and_others_finish(mnist_like):
    jobs, oracles = _jobs(mnist_like, n=2)
    bad = VictimJob("bad", jobs[0].spec, jobs[0].weights, [g * float("nan") for g in jobs[0].gradient], jobs[0].labels)
    attacks = [make_attack("dia", max_iterations=20)] * 2
    module = InversionModule([bad, jobs[1]], attacks, None)
    module.chunk = 20
    diverged, good = _fit(module)
    assert diverged.status == "diverged"
    assert good.status == "max_iterations" and good.iterations == 20
    assert torch.isfinite(good.images).all()


def _sixty_iteration_dia(jobs):
    """A fresh module of two DIA jobs that stop at 60 iterations, in Lightning epochs of 20."""
    m = InversionModule(jobs, [make_attack("dia", max_iterations=60)] * len(jobs), None)
    m.chunk = 20
    return m


def test_interrupted_run_resumes_to_the_same_result(mnist_like, tmp_path):
    jobs, oracles = _jobs(mnist_like, n=2)

    def module():
        return _sixty_iteration_dia(jobs)

    full = _fit(module(), max_epochs=3)
    last = tmp_path / "last.ckpt"
    _fit(module(), max_epochs=1, callbacks=[EpochCheckpoint(last)])  # "killed" after 20 iterations
    resumed = _fit(module(), max_epochs=3, callbacks=[EpochCheckpoint(last)], ckpt_path=str(last))
    for a, b in zip(full, resumed):
        assert a.iterations == b.iterations == 60
        assert a.losses == pytest.approx(b.losses, rel=1e-5)
        torch.testing.assert_close(a.images, b.images)


def test_runner_groups_and_orders_results(mnist_like, tmp_path):
    jobs, oracles = _jobs(mnist_like, n=2)
    other, other_oracles = jobs_from_images(ModelSpec("mlp", "mnist", 0.5), [(mnist_like[0][:1], mnist_like[1][:1])])
    all_jobs = jobs + other
    attacks = [make_attack("dia", max_iterations=5)] * 3
    results = run_jobs(all_jobs, attacks, None, tmp_path, checkpoint_every=5, progress=False)
    assert [r.job_id for r in results] == [j.job_id for j in all_jobs]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["group000", "group001"]


def test_optimized_values_follow_the_parameters_check(mnist_like):
    jobs, oracles = _jobs(mnist_like, n=1)
    module = InversionModule(jobs * 2, [make_attack("ig_eval"), make_attack("dia")], None)
    ig, dia = module.results()
    assert ig.optimized_values == 784 and dia.optimized_values == 2320


def test_oracle_needed_only_for_wiig(mnist_like):
    jobs, _ = _jobs(mnist_like, n=1)
    InversionModule(jobs, [make_attack("dia")], None)
    with pytest.raises(ValueError, match="oracle"):
        InversionModule(jobs, [make_attack("wiig")], None)


@pytest.mark.parametrize("attack", ["ig_eval", "ig_train", "dia", "april", "dia_april"])
def test_the_oracle_cannot_reach_ig_or_dia(mnist_like, attack):
    jobs, oracles = _jobs(mnist_like, n=1)
    with pytest.raises(ValueError, match="must not receive the oracle"):
        InversionModule(jobs, [make_attack(attack)], oracles)
    with pytest.raises(TypeError):
        VictimJob("x", jobs[0].spec, jobs[0].weights, jobs[0].gradient, jobs[0].labels, images=oracles[0].images)


def test_analytical_masks_recover_true_masks_for_mlp(mnist_like):
    jobs, oracles = _jobs(mnist_like, n=1)
    model = build_model(jobs[0].spec)
    shapes = [m.shape for m in oracles[0].masks]
    masks = analytical_masks(model, jobs[0].gradient, shapes, 0.25)
    for got, true in zip(masks, oracles[0].masks):
        assert torch.equal(got, true)


class _OnceAndTwice(torch.nn.Module):
    """``once`` runs after ``a`` (a row rule); ``twice`` runs after ``b`` twice in a row: two masks."""

    def __init__(self, calls: int = 2) -> None:
        super().__init__()
        self.calls = calls
        self.a, self.once = torch.nn.Linear(6, 5), MaskedDropout(0.25)
        self.b, self.twice, self.c = torch.nn.Linear(5, 4), MaskedDropout(0.25), torch.nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.b(self.once(self.a(x)))
        for _ in range(self.calls):
            h = self.twice(h)
        return self.c(h)


def test_analytical_rules_are_one_per_call_and_none_for_a_layer_run_twice():
    x = torch.zeros(1, 6)
    single = _OnceAndTwice(calls=1)
    assert analytical_rules(single, mask_shapes(single, x)) == [("row", "a.weight"), ("row", "b.weight")]
    model = _OnceAndTwice()  # where the second call's zeros show in b's gradient, its neighbours cannot say
    assert analytical_rules(model, mask_shapes(model, x)) == [("row", "a.weight"), None, None]


@pytest.mark.parametrize("model", ["lenet", "resnet18"])
def test_analytical_masks_recover_a_dropout_before_the_classifier(model):
    # LeNet and ResNet drop the features right before their Linear classifier: the classifier's
    # weight gradient has an all-zero column exactly where a feature was dropped (B = 1).
    x = torch.rand(1, 3, 32, 32)
    spec = ModelSpec(model, "cifar10", 0.5, options={"norm": "group"} if model == "resnet18" else {})
    jobs, oracles = jobs_from_images(spec, [(x, torch.tensor([3]))])
    shapes = [m.shape for m in oracles[0].masks]
    net = build_model(spec)
    masks = analytical_masks(net, jobs[0].gradient, shapes, 0.5, torch.Generator().manual_seed(0))
    true = oracles[0].masks[0].float()
    assert len(masks) == 1 and 0 < int(true.sum()) < shapes[0][1]
    # Exact wherever the feature itself is non-zero (after ReLU and pooling some are 0: any mask fits there).
    inputs = []
    dropout = next(m for m in net.modules() if isinstance(m, MaskedDropout))
    dropout.register_forward_hook(lambda _m, args, _out: inputs.append(args[0].detach()))
    net.eval()(x)
    live = inputs[0] != 0
    assert live.float().mean() > 0.5
    assert torch.equal(masks[0][live], true[live]) and not (masks[0] > true).any()


@pytest.mark.parametrize("bias", [False, True])
def test_label_recovery_single_image(mnist_like, bias):
    x, y = mnist_like
    spec = ModelSpec("mlp", "mnist", 0.25, options={"bias": bias})
    jobs, _ = jobs_from_images(spec, [(x[i : i + 1], y[i : i + 1]) for i in range(4)])
    model = build_model(spec)
    for job in jobs:
        assert recover_labels(model, job.gradient, 1).tolist() == job.labels.tolist()


def test_attack_config_errors():
    with pytest.raises(AttackConfigError, match="unknown attack"):
        make_attack("dlg")
    with pytest.raises(AttackConfigError, match="unknown attack setting"):
        make_attack("dia", learning_rate=0.1)
    with pytest.raises(AttackConfigError, match="max_iterations"):
        make_attack("dia", max_iterations=0)


def test_the_ssim_curve_survives_a_resume(mnist_like, tmp_path):
    """The curve lives in the callback's checkpointed state: a resumed run continues it, and ends with
    the same points as an uninterrupted one."""
    from attacker.curves import SSIMCurve

    jobs, oracles = _jobs(mnist_like, n=2)

    def module():
        return _sixty_iteration_dia(jobs)

    full_curve = SSIMCurve(oracles, every=20)
    _fit(module(), max_epochs=3, callbacks=[full_curve])
    last = tmp_path / "last.ckpt"
    _fit(module(), max_epochs=1, callbacks=[EpochCheckpoint(last), SSIMCurve(oracles, every=20)])
    resumed_curve = SSIMCurve(oracles, every=20)
    _fit(module(), max_epochs=3, callbacks=[EpochCheckpoint(last), resumed_curve], ckpt_path=str(last))
    for a, b in zip(full_curve.points, resumed_curve.points):
        assert [it for it, _ in a] == [it for it, _ in b] == [1, 20, 40, 60]
        assert [s for _, s in a] == pytest.approx([s for _, s in b], abs=1e-4)


def test_group_caps_follow_the_device_lightning_will_pick(monkeypatch):
    from attacker.engine.runner import device_kind
    from fedsim.models import MODELS

    assert device_kind("cpu") == "cpu" and device_kind("gpu") == device_kind("cuda") == "gpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert device_kind("auto") == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert device_kind("auto") == "gpu"
    caps = MODELS["vit"].group_caps
    assert caps["gpu"] > caps["cpu"]  # measured: flat ms/iteration on a GPU
