"""Closed-form attacks (attacker/closed_form): the patch solve of a ViT and the first Linear's rank-one
solve return the client's images from the gradient alone, exactly where the system has full rank and
no defense touched it; the classifier's input features are read off its gradient; a solver that does
not apply says why in one line (the CLI: exit 2, nothing written); the audit runs them first."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from flower_harness import offline_config, set_task_identity

from attacker.attacks import CLOSED_FORMS, attack_names, make_attack
from attacker.cli import main
from attacker.closed_form.probe import first_layer, images_from_rows, patch_rows
from attacker.closed_form.run import SOLVED, SOLVED_INEXACT, ClosedForms
from attacker.closed_form.solvers import EXACT_RTOL, find_last_linear, last_linear_features
from attacker.engine.objectives import TermInputs, features_term
from attacker.jobs import jobs_from_images, model_from_job
from fedsim.data import box_bounds, get_spec
from fedsim.models import DropoutMode, ModelSpec, set_dropout_mode, set_masks
from fedsim.models.own import trust_factory


def _victims(
    spec: ModelSpec, n: int = 2, batch: int = 1, seed: int = 0, blocks: int | None = None
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Valid images (inside the pixel box, in normalized space) and labels: a stand-in for a client's data.
    With ``blocks``, each image is blocks x blocks flat patches (the flat regions real images have)."""
    low, high = box_bounds(get_spec(spec.dataset, spec.input_shape[0]))
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        if blocks is None:
            u = torch.rand(batch, *spec.input_shape, generator=gen)
        else:
            u = torch.rand(batch, spec.input_shape[0], blocks, blocks, generator=gen)
            u = torch.nn.functional.interpolate(u, size=spec.input_shape[1:], mode="nearest")
        out.append((low + u * (high - low), torch.randint(0, spec.num_classes, (batch,), generator=gen)))
    return out


def _solve(spec: ModelSpec, name: str, **kw):
    jobs, oracles = jobs_from_images(spec, _victims(spec, **kw))
    forms = ClosedForms()
    return [(forms.solve(name, job), oracle) for job, oracle in zip(jobs, oracles)]


@pytest.mark.parametrize(
    "spec",
    [
        ModelSpec("vit", "cifar10", 0.5, 0, {"dim": 96, "depth": 1, "heads": 2, "dim_head": 8, "mlp_dim": 32}),
        ModelSpec("vit", "mnist", 0.75, 0, {"dim": 64, "depth": 1, "heads": 2, "dim_head": 8, "mlp_dim": 32}),
    ],
    ids=["vit-cifar10-p0.5", "vit-mnist-p0.75"],
)
def test_patch_solve_returns_every_patch_of_a_dropout_vit(spec: ModelSpec) -> None:
    for result, oracle in _solve(spec, "vit_patches"):
        assert result.status == SOLVED and result.iterations == 0
        assert result.extras["rank"] == result.extras["unknowns"] == (spec.input_shape[1] // 4) ** 2
        assert result.extras["relative_residual"] <= EXACT_RTOL
        assert torch.allclose(result.images, oracle.images, atol=1e-3)


def test_patch_solve_finds_timm_position_embeddings_by_structure() -> None:
    """timm's ViT: a Conv2d patch embedding, its pos_embed (with or without the cls token's row) and
    register tokens, none of them found by name."""
    trust_factory("timm:vit_tiny_patch16_224")
    base = {"img_size": 32, "patch_size": 4, "depth": 1, "embed_dim": 96, "num_heads": 2}
    for extra in ({}, {"no_embed_class": True}, {"reg_tokens": 2}):
        spec = ModelSpec("timm:vit_tiny_patch16_224", "cifar10", 0.25, 0, {**base, **extra})
        for result, oracle in _solve(spec, "vit_patches", n=1):
            assert result.status == SOLVED, extra
            # float32 rounding of the client's gradient, through G's conditioning (timm's small init)
            error = (result.images - oracle.images).abs()
            assert error.mean() < 1e-3 and error.max() < 2e-2, extra


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias-scale-from-next-layer", "bias"])
def test_first_linear_solve_returns_the_image_at_batch_size_one(bias: bool) -> None:
    spec = ModelSpec("mlp", "mnist", 0.75, 0, {"width": 64, "bias": bias})
    for result, oracle in _solve(spec, "first_linear"):
        assert result.status == SOLVED and result.extras["rank"] == 1
        assert result.extras["scale_from"] == ("bias" if bias else "next layer")
        assert torch.allclose(result.images, oracle.images, atol=1e-3)


def test_noise_and_rank_deficiency_are_reported_never_claimed_exact() -> None:
    spec = ModelSpec("vit", "cifar10", 0.25, 0, {"dim": 96, "depth": 1, "heads": 2, "dim_head": 8, "mlp_dim": 32})
    (job,), _ = jobs_from_images(spec, _victims(spec, n=1))
    gen = torch.Generator().manual_seed(1)
    noisy = replace(job, gradient=[g + 1e-3 * g.std() * torch.randn(g.shape, generator=gen) for g in job.gradient])
    result = ClosedForms().solve("vit_patches", noisy)
    assert result.status == SOLVED_INEXACT and result.extras["relative_residual"] > EXACT_RTOL
    # an embedding narrower than the 64 patches: G has rank 32 < 64, the answer is only a least-squares one
    narrow = ModelSpec("vit", "cifar10", 0.25, 0, {"dim": 32, "depth": 1, "heads": 2, "dim_head": 8, "mlp_dim": 32})
    (result, _), *_ = _solve(narrow, "vit_patches", n=1)
    assert result.status == SOLVED_INEXACT and result.extras["rank"] == 32 and result.extras["unknowns"] == 64


def test_a_solver_says_in_one_line_why_it_does_not_apply() -> None:
    forms = ClosedForms()
    (cnn,), _ = jobs_from_images(ModelSpec("lenet", "cifar10", 0.25), _victims(ModelSpec("lenet", "cifar10", 0.25), 1))
    reason = forms.reason("vit_patches", cnn)
    assert reason.startswith("vit_patches needs a learned position embedding added after a per-patch linear")
    assert "lenet has none" in reason and "\n" not in reason
    mlp = ModelSpec("mlp", "mnist", 0.25, 0, {"width": 32})
    (pair,), _ = jobs_from_images(mlp, _victims(mlp, n=1, batch=2))
    assert "B = 2" in forms.reason("first_linear", pair)
    assert forms.reason("cocktail_party", pair) is None
    (one,), _ = jobs_from_images(mlp, _victims(mlp, n=1))
    assert "has B = 1" in forms.reason("cocktail_party", one) and "first_linear solves it" in forms.reason(
        "cocktail_party", one
    )
    (update,), _ = jobs_from_images(mlp, _victims(mlp, n=1), plan=_plan())
    assert "update of 2 local steps" in forms.reason("first_linear", update)


def _plan():
    from fedsim.client_step import LocalPlan, OptimizerSpec, Schedule

    return LocalPlan(Schedule(epochs=2, batch_size=1, order="in-order"), OptimizerSpec("sgd", 0.1))


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias-scale-from-next-layer", "bias"])
def test_cocktail_party_separates_a_dropout_batch_exactly(bias: bool) -> None:
    """B = 4 images in one gradient: dropout's zeros give each image's hyperplane of rows, so every image
    comes back exactly (in an order of its own: matched to the originals by distance alone)."""
    from attacker.metrics import match_reconstructions

    spec = ModelSpec("mlp", "mnist", 0.25, 0, {"width": 128, "bias": bias})
    for result, oracle in _solve(spec, "cocktail_party", n=2, batch=4):
        assert result.status == SOLVED and result.extras["separated_by"] == "dropout zeros"
        assert result.extras["images_separated"] == 4
        assert result.extras["rank"] == result.extras["unknowns"] == 4
        # each image's hyperplane holds the rows of the units its own mask dropped (every other image's
        # delta is nonzero there but for the units two images both dropped)
        dropped = (oracle.masks[0] == 0).sum(dim=1).sort().values
        assert sorted(result.extras["zero_rows"]) <= dropped.tolist()
        matched = result.images[match_reconstructions(oracle.images, result.images)]
        assert torch.allclose(matched, oracle.images, atol=1e-3)


def test_smoothness_completes_an_image_mixed_with_a_missing_one() -> None:
    """A separated image known only up to the missing images' directions: the least total variation
    gives back the image itself (one missing: the weighted median, exact; two: reweighted least squares)."""
    from attacker.closed_form.separation import complete_by_smoothness

    spec = ModelSpec("mlp", "mnist", 0.0)
    # each image's edges where the others are flat: blocks of 7 pixels, of 4, and of 4 shifted by 2
    sevens, fours = _victims(spec, 1, 2, blocks=4)[0][0], _victims(spec, 1, 2, blocks=7, seed=1)[0][0]
    images = torch.cat([sevens, fours[:1], fours[1:].roll((2, 2), dims=(2, 3))]).double()
    mixed = images.clone()
    mixed[0] = images[0] + 0.7 * images[3]
    mixed[1] = images[1] - 1.3 * images[3]
    completed = complete_by_smoothness(mixed, [3]) @ mixed.flatten(1)
    assert torch.allclose(completed, images.flatten(1), atol=1e-9)
    mixed[0] = images[0] + 0.7 * images[2] - 0.4 * images[3]
    completed = complete_by_smoothness(mixed, [2, 3]) @ mixed.flatten(1)
    assert torch.allclose(completed[[0, 1]], images.flatten(1)[[0, 1]], atol=1e-6)
    assert torch.equal(complete_by_smoothness(mixed, []), torch.eye(4, dtype=torch.float64))


def test_cocktail_party_completes_a_batch_whose_hyperplanes_were_not_all_found(monkeypatch) -> None:
    """B = 8: the sampling finds most images' hyperplanes, not all. The found ones fix the others' images
    up to the missing images' directions (completed by smoothness, checked by the next layer), and in
    the dimensions left the missing images' zero rows are found again: exact, where the sampling alone
    returned mixes. (The reweighted search, which finds them all here, is off: this is the completion's test.)"""
    from attacker.closed_form import separation
    from attacker.metrics import match_reconstructions

    monkeypatch.setattr(separation, "SEARCH_ROUNDS", 0)

    spec = ModelSpec("mlp", "mnist", 0.25, 0, {"width": 256})
    jobs, oracles = jobs_from_images(spec, _victims(spec, 3, 8, blocks=4))
    forms, completed = ClosedForms(), 0
    # One BLAS thread, whatever the machine's: which planes the sampling finds turns on the rounding (at two
    # threads these batches leave other images missing, and one found image then fails the next layer's
    # check, so none is completed; measured on 10 such batches: 5 completed at one thread, 2 at two).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        results = [forms.solve("cocktail_party", job) for job in jobs]
    finally:
        torch.set_num_threads(threads)
    for result, oracle in zip(results, oracles):
        if result.extras["images_separated"] < 8 and result.status == SOLVED:
            completed += 1
            matched = result.images[match_reconstructions(oracle.images, result.images)]
            assert torch.allclose(matched, oracle.images, atol=1e-3)
        if result.status == SOLVED:  # never claimed without every image passing the next layer's check
            assert max(result.extras["scale_misfits"]) <= result.extras["exact_tolerance"]
    assert completed >= 1


def _planted_planes(rows: int, b: int, dropped: float, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows mixing b images' deltas, each delta zero on a random ``dropped`` share of the rows (dropout's
    zeros), in coordinates of their own: (coordinates, each image's true unit normal, b x b)."""
    gen = torch.Generator().manual_seed(seed)
    deltas = torch.randn(rows, b, generator=gen, dtype=torch.float64) * (torch.rand(rows, b, generator=gen) >= dropped)
    mixing = torch.randn(b, b, generator=gen, dtype=torch.float64)
    normals = torch.linalg.inv(mixing).T  # coords @ normals[k] = deltas[:, k]: zero where image k was dropped
    return deltas @ mixing, normals / torch.linalg.norm(normals, dim=1, keepdim=True)


def test_the_reweighted_search_finds_every_plane_where_sampling_finds_none(monkeypatch) -> None:
    """B = 16, p = 0.25, 512 rows: B - 1 rows drawn from one image's plane are hopeless odds (about 0.25^15
    from a random pool), and the sampling alone finds no plane; the reweighted search finds each image's
    plane exactly."""
    from attacker.closed_form import separation

    coords, truth = _planted_planes(512, 16, 0.25)
    start = torch.randn(16, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    refined = separation.refine_by_zeros(coords, start, 0.25)
    assert refined.found == 16 and not refined.missing
    cos = (refined.normals @ truth.T).abs()
    assert sorted(cos.argmax(dim=1).tolist()) == list(range(16))  # each image's plane once
    assert float(cos.max(dim=1).values.min()) > 1 - 1e-9
    monkeypatch.setattr(separation, "SEARCH_ROUNDS", 0)
    assert separation.refine_by_zeros(coords, start, 0.25).found == 0


def test_a_separated_batch_starts_an_optimization_in_the_labels_order() -> None:
    """dia_cf starts from cocktail_party's images, which come in an order of their own: the last Linear's
    gradient puts each at a place of its own label."""
    spec = ModelSpec("mlp", "mnist", 0.25, 0, {"width": 256})
    jobs, oracles = jobs_from_images(spec, _victims(spec, 1, 8, blocks=4))
    guess = ClosedForms().first_guess(jobs[0])
    assert guess is not None and guess.images.shape == oracles[0].images.shape
    start = guess.images
    nearest = torch.cdist(start.flatten(1).double(), oracles[0].images.flatten(1).double()).argmin(dim=1)
    assert torch.equal(jobs[0].labels[nearest], jobs[0].labels)
    assert sorted(nearest.tolist()) == list(range(8))  # every image once
    assert make_attack("dia_cf").image_init == "closed_form"


def test_cocktail_party_without_dropout_is_ica_alone_and_never_claimed_exact() -> None:
    spec = ModelSpec("mlp", "mnist", 0.0, 0, {"width": 128})
    for result, _ in _solve(spec, "cocktail_party", n=1, batch=4):
        assert result.status == SOLVED_INEXACT and result.extras["separated_by"] == "ica"
        assert result.extras["relative_residual"] > EXACT_RTOL


def test_classifier_features_equal_the_clients_own() -> None:
    """The last Linear's input, as the client computed it (its dropout masks applied), from the gradient."""
    for spec in (ModelSpec("lenet", "cifar10", 0.5), ModelSpec("mlp", "mnist", 0.5, 0, {"width": 64})):
        jobs, oracles = jobs_from_images(spec, _victims(spec, n=2))
        model = model_from_job(jobs[0])
        layer = find_last_linear(model, spec.input_shape)
        for job, oracle in zip(jobs, oracles):
            seen: list[torch.Tensor] = []
            handle = layer.module.register_forward_pre_hook(lambda m, a, seen=seen: seen.append(a[0].detach()))
            set_masks(model, [m.float() for m in oracle.masks])
            set_dropout_mode(model, DropoutMode.LEARN)
            model(oracle.images)
            handle.remove()
            features = last_linear_features(layer, job, model)
            assert features.residual < 1e-5
            assert torch.allclose(features.values, seen[0].reshape(1, -1), rtol=1e-3, atol=1e-5), spec.name


def test_the_features_term_is_zero_at_the_target_and_pulls_the_dummies() -> None:
    target = torch.randn(2, 8)
    dummies = torch.randn(2, 8, requires_grad=True)
    inputs = TermInputs(None, torch.zeros(2, 1), 2, [], 0.0, features=dummies, target_features=target)  # type: ignore[arg-type]
    value = features_term(inputs)
    value.sum().backward()
    assert value.shape == (2,) and (value > 0).all() and dummies.grad is not None and dummies.grad.abs().sum() > 0
    at_target = TermInputs(None, torch.zeros(2, 1), 2, [], 0.0, features=target, target_features=target)  # type: ignore[arg-type]
    assert torch.allclose(features_term(at_target), torch.zeros(2))


def test_the_index_probe_maps_patch_rows_back_to_pixels() -> None:
    model = model_from_job(
        jobs_from_images(ModelSpec("vit", "mnist", 0.0), _victims(ModelSpec("vit", "mnist", 0.0), 1))[0][0]
    )
    layer = first_layer(model, (1, 28, 28))
    assert layer is not None and layer.tokens == 49
    x = torch.randn(2, 1, 28, 28)
    rows = patch_rows(model.patchify(x), layer.module)
    assert torch.equal(images_from_rows(rows, layer.pixels, (1, 28, 28)), x)


def test_attack_names_expand_closed_form_and_make_attack_knows_each_solver() -> None:
    assert attack_names(["closed_form", "ig", "dia"]) == [*CLOSED_FORMS, "ig_eval", "dia"]
    assert make_attack("vit_patches").solver == "vit_patches"
    assert make_attack("vit_patches", max_iterations=10).max_iterations == 20_000  # unused: no optimization


def _run(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = main(args)
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def test_cli_runs_closed_forms_into_the_run_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run"
    args = ["run", "--model", "mlp", "--dataset", "mnist", "--p", "0.5", "--victims", "2", "--attacks", "closed_form"]
    code, text = _run([*args, "--no-lpips", "--device", "cpu", "--quiet", "--out", str(out)], capsys)
    assert code == 0, text
    rows = json.loads((out / "metrics.json").read_text())
    assert {r["attack"] for r in rows} == {"first_linear"}
    assert all(r["status"] == SOLVED and r["iterations"] == 0 and r["rank"] == 1 for r in rows)
    assert all(r["ssim_paper"] > 0.99 for r in rows)
    skipped = json.loads((out / "closed_form.json").read_text())["skipped"]
    assert set(skipped) == {"vit_patches", "cocktail_party", "dark_background", "adam_eps"}  # a gradient: no Adam round
    assert "first_linear: 2 of 2 jobs exact" in (out / "report.md").read_text()


def test_cli_refuses_a_closed_form_that_does_not_apply(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = ["run", "--model", "lenet", "--dataset", "mnist", "--p", "0.25", "--victims", "1", "--no-lpips"]
    out = tmp_path / "named"
    code, text = _run([*base, "--attacks", "vit_patches", "--out", str(out)], capsys)
    assert code == 2 and "vit_patches needs a learned position embedding" in text and "Traceback" not in text
    assert not out.exists()
    out = tmp_path / "group"
    code, text = _run([*base, "--attacks", "closed_form", "--out", str(out)], capsys)
    assert code == 2 and "no attack applies" in text
    assert "vit_patches needs" in text and "first_linear needs" in text and not out.exists()


def test_audit_runs_the_closed_forms_first_and_names_the_mechanism(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An audited two-client round of the MLP with one image per gradient: the first Linear's solve
    recovers both images, and the verdict says why."""
    from test_audit import InProcessGrid

    from fedsim.server_app import run_server

    set_task_identity()
    fed = tmp_path / "fed"
    cfg = offline_config(
        {
            "audit": True,
            "capture-rounds": "1",
            "num-server-rounds": 1,
            "local-steps": 1,
            "victim-batch-size": 1,
            "model-options": '{"width": 64}',
            "run-dir": str(fed),
        }
    )
    run_server(InProcessGrid(), cfg)
    out = tmp_path / "audit"
    code, text = _run(
        ["audit", str(fed), "--attacks", "closed_form", "--no-lpips", "--quiet", "--out", str(out)], capsys
    )
    assert code == 0, text
    audit = json.loads((out / "audit.json").read_text())
    assert audit["attacks"] == ["first_linear"]
    assert set(audit["closed_forms_skipped"]) == {"vit_patches", "cocktail_party", "dark_background", "adam_eps"}
    assert audit["summary"]["recognisable"] == audit["summary"]["images"] == 2
    assert "rank one and gives the image exactly" in audit["verdict"]
    assert "Skipped: vit_patches needs" in (out / "audit.md").read_text()


def _dark_victims(spec: ModelSpec, batch: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Images on a black background, as MNIST's: a random block of strokes on each, the rest at the box's low
    value (normalized pixel value 0)."""
    low, high = box_bounds(get_spec(spec.dataset, spec.input_shape[0]))
    gen = torch.Generator().manual_seed(seed)
    u = torch.rand(batch, *spec.input_shape, generator=gen) * (
        torch.rand(batch, *spec.input_shape, generator=gen) < 0.2
    )
    return [(low + u * (high - low), torch.randint(0, spec.num_classes, (batch,), generator=gen))]


@pytest.mark.parametrize("round_", ["one-step", "sgd-K2"])
def test_dark_background_separates_a_batch_and_an_sgd_round_exactly(round_: str) -> None:
    """B = 6 images, 80 % of each at the box's low value: in the first Linear's row space (the gradient's,
    and an SGD round's update's alike) each image's dark pixels fix it, so every image comes back exactly,
    claimed exact, where no one-step closed form takes the update."""
    from attacker.metrics import match_reconstructions
    from fedsim.client_step import LocalPlan, OptimizerSpec, Schedule

    spec = ModelSpec("mlp", "mnist", 0.25, 0, {"width": 64})
    plan = (
        None
        if round_ == "one-step"
        else LocalPlan(Schedule(epochs=2, batch_size=6, order="in-order"), OptimizerSpec("sgd", 0.05))
    )
    (job,), (oracle,) = jobs_from_images(spec, _dark_victims(spec, 6), plan=plan)
    forms = ClosedForms()
    assert forms.reason("dark_background", job) is None
    if plan is not None:
        assert "update of 2 local steps" in forms.reason("cocktail_party", job)
    result = forms.solve("dark_background", job)
    assert result.status == SOLVED and result.extras["images_separated"] == 6
    matched = result.images[match_reconstructions(oracle.images, result.images)]
    assert torch.allclose(matched, oracle.images, atol=1e-3)


def test_dia_hold_keeps_the_images_a_partial_separation_pinned_down_and_learns_the_rest() -> None:
    """An SGD round of four images on a background and two of uniform noise: dark_background (the one closed
    form that takes an update) finds the four, each fixed by its own background (``certain``), and not the
    noise, so its answer is partial. dia_hold starts from it and keeps the four exactly while the others
    move; dia_cf, from the same start, moves them all."""
    from engine_harness import fit_attack

    from attacker.engine.inversion import InversionModule
    from fedsim.client_step import LocalPlan, OptimizerSpec, Schedule

    spec = ModelSpec("mlp", "mnist", 0.25, 0, {"width": 64})
    ((dark, dark_labels),) = _dark_victims(spec, 4)
    ((noise, noise_labels),) = _victims(spec, n=1, batch=2, seed=3)
    plan = LocalPlan(Schedule(epochs=2, batch_size=6, order="in-order"), OptimizerSpec("sgd", 0.05))
    (job,), (oracle,) = jobs_from_images(
        spec, [(torch.cat([dark, noise]), torch.cat([dark_labels, noise_labels]))], plan=plan
    )
    forms = ClosedForms()
    result = forms.solve("dark_background", job)
    assert result.status == SOLVED_INEXACT and result.extras["images_separated"] == 4
    guess = forms.first_guess(job)
    assert guess is not None and int(guess.held.sum()) == 4
    # solved once: the start (here and in each attack's own ClosedForms) reuses the run's solve
    assert ClosedForms()._solve("dark_background", job)[0] is forms._solve("dark_background", job)[0]
    other = replace(job, labels=job.labels.roll(1))
    assert ClosedForms()._solve("dark_background", other)[0] is not forms._solve("dark_background", job)[0]
    held = guess.held.nonzero().flatten()
    # each held image is a true one, exactly, at a place of its own label
    nearest = torch.cdist(guess.images[held].flatten(1).double(), oracle.images.flatten(1).double()).argmin(dim=1)
    assert sorted(nearest.tolist()) == [0, 1, 2, 3]
    assert torch.equal(job.labels[nearest], job.labels[held])
    assert torch.allclose(guess.images[held], oracle.images[nearest], atol=1e-3)
    attacks = [make_attack("dia_hold", max_iterations=20), make_attack("dia_cf", max_iterations=20)]
    module = InversionModule([job, job], attacks, None)
    module.chunk = 20
    holding, moving = fit_attack(module)
    assert torch.equal(holding.images[held], guess.images[held].to(holding.images.dtype))
    free = ~guess.held
    assert float((holding.images[free] - guess.images[free]).abs().max()) > 1e-3  # the rest is learned
    assert float((moving.images[held] - guess.images[held]).abs().max()) > 1e-3  # dia_cf holds nothing
    with pytest.raises(ValueError, match="hold_certain holds a closed form's images"):
        make_attack("dia", hold_certain=True)


def test_the_vertex_search_alone_finds_images_with_a_background_and_only_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With the hyperplane search held to one image, the vertex search (linear programs over the sign of
    x - low) finds the other five of a B = 6 span, each exactly; every vertex it yields that passes the box and the
    background check is one of the images (a mix with negative weights would fail the box or its darkness)."""
    from attacker.closed_form import separation

    spec = ModelSpec("mlp", "mnist", 0.25, 0, {"width": 64})
    ((images, _),) = _dark_victims(spec, 6, seed=4)
    flat = images.flatten(1).double()
    low, high = (t.expand(*spec.input_shape).reshape(-1).double() for t in box_bounds(get_spec("mnist", 1)))
    mixing = torch.randn(6, 6, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    space = torch.linalg.qr((mixing @ flat).T).Q.T  # orthonormal rows spanning the images, as an SVD gives
    rows = torch.cat([space.T, low[:, None]], dim=1)
    vertices = list(separation.box_vertices(separation._distinct(rows), 30, torch.Generator().manual_seed(0)))
    assert vertices and all(n.shape == (7,) for n in vertices)
    images_found = set()
    for n in vertices:
        x = (n[:-1] * (-1.0 / n[-1])) @ space
        in_box = bool(((x > low - 1e-6) & (x < high + 1e-6)).all())
        if in_box and int(((x - low).abs() < 1e-6).sum()) >= x.numel() // 4:
            distance = torch.linalg.norm(flat - x, dim=1) / torch.linalg.norm(flat, dim=1)
            assert float(distance.min()) < 1e-6  # an image, not a mix
            images_found.add(int(distance.argmin()))
    assert len(images_found) >= 3
    # the hyperplane search finds only the first image (it shows the data has a background); the rest is the
    # vertex search's
    first = torch.cat([flat[0] @ space.T, -torch.ones(1, dtype=torch.float64)])[None]
    monkeypatch.setattr(separation, "reweighted_normals", lambda *a, **k: first)
    sep = separation.separate_by_level(space, low, high, torch.Generator().manual_seed(0))
    assert sep.images.shape[0] == 6
    assert float((torch.cdist(sep.images, flat).min(dim=1).values / flat.norm(dim=1).min()).max()) < 1e-6


def test_dark_background_snaps_approximations_to_the_exact_images_and_nothing_else() -> None:
    """An SGD round of six images on a background: images within a little noise of three of them snap to
    those exactly (in their places); a noise image, a slot all at the background (no ink to aim at) and a slot
    whose image another slot is nearer to do not, and the nearer one takes it."""
    from fedsim.client_step import LocalPlan, OptimizerSpec, Schedule

    spec = ModelSpec("mlp", "mnist", 0.25, 0, {"width": 64})
    plan = LocalPlan(Schedule(epochs=2, batch_size=6, order="in-order"), OptimizerSpec("sgd", 0.05))
    (job,), (oracle,) = jobs_from_images(spec, _dark_victims(spec, 6, seed=2), plan=plan)
    truth = oracle.images
    gen = torch.Generator().manual_seed(5)
    approx = truth + 0.05 * torch.randn(truth.shape, generator=gen)
    approx[3] = torch.randn(truth[3].shape, generator=gen)  # no image near it
    approx[4] = truth[0] + 0.01 * torch.randn(truth[0].shape, generator=gen)  # nearer slot 0's image than its own
    low, _ = box_bounds(get_spec("mnist", 1))
    approx[5] = low.expand(truth[5].shape)  # all background: no ink to aim at
    images, taken = ClosedForms().snap(job, approx)
    assert taken.tolist() == [False, True, True, False, True, False]
    assert torch.allclose(images[1:3], truth[1:3], atol=1e-3) and torch.allclose(images[4], truth[0], atol=1e-3)
    assert torch.equal(images[~taken], approx[~taken])
    # an SGD round of noise images: the separation pinned nothing down, so there is nothing to snap to
    (noise,), (noise_oracle,) = jobs_from_images(spec, _victims(spec, n=1, batch=4, seed=6), plan=plan)
    assert ClosedForms().snap(noise, noise_oracle.images) is None


def test_a_one_step_job_starts_from_the_solver_that_pinned_the_most_and_snaps_with_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A one-step gradient of six images on a background, which cocktail_party (first in the table) and
    dark_background both take. Where cocktail_party solves it exactly, the optimization starts from that answer
    and no snap is tried. Where it pins nothing down (as at B = 64 under p = 0.25), the start is
    dark_background's, holding its exact images, and the snaps are dark_background's."""
    from attacker.closed_form import run, solvers

    spec = ModelSpec("mlp", "mnist", 0.25, 0, {"width": 64})
    (job,), (oracle,) = jobs_from_images(spec, _dark_victims(spec, 6, seed=7))
    truth = oracle.images
    approx = truth + 0.05 * torch.randn(truth.shape, generator=torch.Generator().manual_seed(8))
    monkeypatch.setattr(run, "_RECENT", {})
    forms = ClosedForms()
    assert forms.solve("cocktail_party", job).status == SOLVED
    assert bool(forms.first_guess(job).held.all()) and forms.snap(job, approx) is None

    real = solvers.SOLVERS["cocktail_party"]

    def pins_nothing(found, job_, model):
        answer = real.solve(found, job_, model)
        return replace(answer, residual=1.0, certain=(False,) * job_.batch_size)

    monkeypatch.setitem(solvers.SOLVERS, "cocktail_party", replace(real, solve=pins_nothing))
    monkeypatch.setattr(run, "_RECENT", {})
    forms = ClosedForms()
    guess = forms.first_guess(job)
    assert guess is not None and int(guess.held.sum()) >= 3
    held = guess.images[guess.held].flatten(1)
    assert float(torch.cdist(held, truth.flatten(1)).min(dim=1).values.max()) < 1e-3  # true images, held
    snapped = forms.snap(job, approx)
    assert snapped is not None and int(snapped[1].sum()) >= 3
    assert torch.allclose(snapped[0][snapped[1]], truth[snapped[1]], atol=1e-3)


def test_dia_hold_holds_what_a_snap_adds(monkeypatch: pytest.MonkeyPatch) -> None:
    """snap_every: at each due epoch end the images ``ClosedForms.snap`` returns as exact join the held ones
    and stay at those values to the end; without snap_every nothing is added."""
    from engine_harness import fit_attack

    from attacker.engine.inversion import InversionModule

    spec = ModelSpec("mlp", "mnist", 0.25, 0, {"width": 64})
    from fedsim.client_step import LocalPlan, OptimizerSpec, Schedule

    plan = LocalPlan(Schedule(epochs=2, batch_size=4, order="in-order"), OptimizerSpec("sgd", 0.05))
    # an SGD round of noise images: dark_background takes it and holds none
    (job,), (oracle,) = jobs_from_images(spec, _victims(spec, n=1, batch=4, seed=6), plan=plan)
    asked = []

    def snap(self, job_, images, held=None):
        asked.append(images.shape)
        taken = torch.tensor([False, True, False, False])
        return torch.where(taken[:, None, None, None], oracle.images, images), taken

    monkeypatch.setattr(ClosedForms, "snap", snap)
    snapping = make_attack("dia_hold", max_iterations=30, snap_every=10, patience=1000)
    plain = make_attack("dia_hold", max_iterations=30, snap_every=0, patience=1000)
    module = InversionModule([job, job], [snapping, plain], None)
    module.chunk = 10
    held_before = module.unknowns.held.clone()
    result, other = fit_attack(module, max_epochs=3)
    assert asked and all(shape == oracle.images.shape for shape in asked)
    assert not bool(held_before[0, 1]) and module.snapped == [1, 0]
    assert bool(module.unknowns.held[0, 1]) and torch.equal(module.unknowns.held[1], held_before[1])
    assert torch.allclose(module.unknowns.image_stack[0, 1], oracle.images[1])
    with pytest.raises(ValueError, match="snap_every adds to the held images and needs hold_certain"):
        make_attack("dia", snap_every=10)


def test_slots_trade_labels_so_a_held_image_sits_under_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """A held image in a slot of the wrong label (the true images of a one-step gradient, slots 0 and 1
    swapped, slot 0 held): relabel gives slot 0 the label its image scores and slot 1 the freed label, and no
    other slot changes; with the held image where it belongs nothing moves. The engine relabels at each snap,
    reports the images in the labels' order, and a checkpoint keeps the slots' labels; a one-step gradient's
    new labels are checked by the loss, a round's are not."""
    from engine_harness import fit_attack

    from attacker.engine.inversion import InversionModule
    from fedsim.client_step import LocalPlan, OptimizerSpec, Schedule

    spec = ModelSpec("mlp", "mnist", 0.25, 0, {"width": 256})
    labels = torch.tensor([0, 1, 2, 3, 4, 5])
    (job,), (oracle,) = jobs_from_images(spec, [(_dark_victims(spec, 6, seed=2)[0][0], labels)])
    one_step, truth = job, oracle.images
    swapped = truth[[1, 0, 2, 3, 4, 5]]
    forms = ClosedForms()
    one = torch.tensor([True, False, False, False, False, False])
    assert forms.relabel(job, swapped, one, labels).tolist() == [1, 0, 2, 3, 4, 5]
    assert forms.relabel(job, truth, one, labels).tolist() == labels.tolist()
    assert forms.relabel(job, swapped, torch.zeros(6, dtype=torch.bool), labels) is None  # nothing held
    plan = LocalPlan(Schedule(epochs=2, batch_size=3, order="in-order"), OptimizerSpec("sgd", 0.05))
    (halves,), _ = jobs_from_images(spec, [(truth, labels)], plan=plan)
    assert forms.relabel(halves, swapped, one, labels) is None  # its slots differ by their steps too

    # the engine: a snap holds truth[1] in slot 0 (label 0) of an SGD round on the whole batch
    plan = LocalPlan(Schedule(epochs=2, batch_size=6, order="in-order"), OptimizerSpec("sgd", 0.05))
    (job,), (oracle,) = jobs_from_images(spec, [(truth, labels)], plan=plan)

    def snap(self, job_, images, held=None):
        taken = one.clone()
        return torch.where(taken[:, None, None, None], swapped, images), taken

    monkeypatch.setattr(ClosedForms, "first_guess", lambda self, job_: None)
    monkeypatch.setattr(ClosedForms, "snap", snap)
    module = InversionModule([job], [make_attack("dia_hold", max_iterations=20, snap_every=10, patience=1000)], None)
    module.chunk = 10
    (result,) = fit_attack(module, max_epochs=2)
    assert module.matcher.job_labels(0).tolist()[:2] == [1, 0] and module.relabeled[0] >= 2
    assert torch.equal(job.labels, labels)  # the job (what the server saw) is untouched
    assert torch.allclose(result.images[1], truth[1])  # the held image, at a place of its label
    saved: dict = {}
    module.on_save_checkpoint(saved)
    fresh = InversionModule([job], [make_attack("dia_hold", max_iterations=20, snap_every=10)], None)
    assert fresh.matcher.job_labels(0).tolist() == labels.tolist()
    fresh.on_load_checkpoint(saved)
    assert torch.equal(fresh.matcher.job_labels(0), module.matcher.job_labels(0))

    # every image held at its own label, and new labels proposed that swap two: on a one-step gradient (its
    # scores blurred by one mask per image) they are refused, since the dummies explain it worse under them;
    # a round's (its steps' masks averaged) are taken as scored
    from attacker.closed_form.run import Guess

    monkeypatch.setattr(ClosedForms, "first_guess", lambda self, job_: Guess(truth, torch.ones(6, dtype=torch.bool)))
    monkeypatch.setattr(ClosedForms, "relabel", lambda self, job_, images, held, slots: slots[[0, 1, 3, 2, 4, 5]])
    for target, taken in ((one_step, False), (job, True)):
        attack = make_attack("dia_hold", max_iterations=20, snap_every=10, patience=1000)
        module = InversionModule([target], [attack], None)
        module.chunk = 10
        fit_attack(module, max_epochs=2)
        assert (module.matcher.job_labels(0).tolist() != labels.tolist()) == taken
        assert (module.relabeled[0] > 0) == taken


def test_snaps_come_every_snap_every_iterations_not_only_at_checkpoints(monkeypatch: pytest.MonkeyPatch) -> None:
    """A snap is due after the iteration that reaches a multiple of snap_every, whatever the checkpoint chunk:
    with chunks of 25 and snap_every 10, a 30-iteration run snaps after iterations 10 and 20 (at the chunk's end
    only, it would snap once, after 25; after 30 the job has ended)."""
    from engine_harness import fit_attack

    from attacker.engine.inversion import InversionModule
    from fedsim.client_step import LocalPlan, OptimizerSpec, Schedule

    spec = ModelSpec("mlp", "mnist", 0.25, 0, {"width": 64})
    plan = LocalPlan(Schedule(epochs=2, batch_size=4, order="in-order"), OptimizerSpec("sgd", 0.05))
    (job,), _ = jobs_from_images(spec, _victims(spec, n=1, batch=4, seed=6), plan=plan)
    at: list[int] = []
    module = InversionModule([job], [make_attack("dia_hold", max_iterations=30, snap_every=10, patience=1000)], None)
    module.chunk = 25
    monkeypatch.setattr(ClosedForms, "snap", lambda self, job_, images, held=None: at.append(module.state.iteration))
    fit_attack(module, max_epochs=2)
    assert at == [10, 20]


def test_a_runs_snaps_solve_each_job_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every snap asks for the job's solves again; the module keeps one ClosedForms, so however many snaps
    (and with the shared cache of recent solves gone), the solver runs once for the start and once for all
    the snaps."""
    from engine_harness import fit_attack

    from attacker.closed_form import run, solvers
    from attacker.engine.inversion import InversionModule
    from fedsim.client_step import LocalPlan, OptimizerSpec, Schedule

    spec = ModelSpec("mlp", "mnist", 0.25, 0, {"width": 64})
    plan = LocalPlan(Schedule(epochs=2, batch_size=6, order="in-order"), OptimizerSpec("sgd", 0.05))
    (job,), _ = jobs_from_images(spec, _dark_victims(spec, 6, seed=3), plan=plan)
    real, calls = solvers.SOLVERS["dark_background"], []

    def counted(found, job_, model):
        calls.append(job_.job_id)
        answer = real.solve(found, job_, model)
        return replace(answer, residual=1.0, certain=(True,) + (False,) * (job_.batch_size - 1))  # one pinned

    monkeypatch.setitem(solvers.SOLVERS, "dark_background", replace(real, solve=counted))
    monkeypatch.setattr(run, "_RECENT", {})
    monkeypatch.setattr(run, "_RECENT_SIZE", 0)
    module = InversionModule([job], [make_attack("dia_hold", max_iterations=40, snap_every=10, patience=1000)], None)
    module.chunk = 10
    fit_attack(module, max_epochs=4)
    assert module._snaps[0] >= 2 and len(calls) == 2


def test_the_best_iterate_comes_after_a_snap_even_where_the_loss_was_lower_before(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A snap's images are exact by their own check: the result keeps them even where the loss after the snap
    stays above the best before it (here a snap that sets one slot to noise, which the loss cannot forgive)."""
    from engine_harness import fit_attack

    from attacker.engine.inversion import InversionModule
    from fedsim.client_step import LocalPlan, OptimizerSpec, Schedule

    spec = ModelSpec("mlp", "mnist", 0.25, 0, {"width": 64})
    plan = LocalPlan(Schedule(epochs=2, batch_size=4, order="in-order"), OptimizerSpec("sgd", 0.05))
    (job,), _ = jobs_from_images(spec, _victims(spec, n=1, batch=4, seed=6), plan=plan)
    noise = 3 * torch.randn(4, *spec.input_shape, generator=torch.Generator().manual_seed(9))
    taken = torch.tensor([False, True, False, False])

    def snap(self, job_, images, held=None):
        return torch.where(taken[:, None, None, None], noise, images), taken

    monkeypatch.setattr(ClosedForms, "snap", snap)
    module = InversionModule([job], [make_attack("dia_hold", max_iterations=30, snap_every=10, patience=1000)], None)
    module.chunk = 10
    (result,) = fit_attack(module, max_epochs=3)
    losses = module.state.losses[0]
    assert min(losses[10:]) > min(losses[:10])  # the loss after the snap stays above the best before it
    assert result.best_iteration >= 10 and torch.allclose(result.images[1], noise[1])


def test_a_snap_searches_only_the_open_images_and_never_takes_a_held_ones_image(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Held images are exact already: a snap runs its program for the other slots only, and a slot near a held
    image does not take it a second time."""
    from attacker.closed_form import solvers
    from fedsim.client_step import LocalPlan, OptimizerSpec, Schedule

    spec = ModelSpec("mlp", "mnist", 0.25, 0, {"width": 64})
    plan = LocalPlan(Schedule(epochs=2, batch_size=6, order="in-order"), OptimizerSpec("sgd", 0.05))
    (job,), (oracle,) = jobs_from_images(spec, _dark_victims(spec, 6, seed=2), plan=plan)
    truth = oracle.images
    approx = truth + 0.05 * torch.randn(truth.shape, generator=torch.Generator().manual_seed(5))
    approx[4] = truth[0]  # held at slot 0's image: slot 0, near it, must not take it again
    held = torch.tensor([False, True, False, False, True, False])
    searched: list[int] = []
    real = solvers.snap_to_level

    def counted(space, low, high, rows):
        searched.append(rows.shape[0])
        return real(space, low, high, rows)

    monkeypatch.setattr(solvers, "snap_to_level", counted)
    images, taken = ClosedForms().snap(job, approx, held)
    assert searched == [4]
    assert taken.tolist() == [False, False, True, True, False, True]
    assert torch.allclose(images[taken], truth[taken], atol=1e-3) and torch.equal(images[~taken], approx[~taken])


def test_dark_background_claims_nothing_where_the_images_have_no_background() -> None:
    """Uniform-noise images have no pixel at the low value: no image is found, the answer is the span's
    directions (a start for DIA), never claimed exact; an Adam round is refused with the reason."""
    from fedsim.client_step import LocalPlan, OptimizerSpec, Schedule

    spec = ModelSpec("mlp", "mnist", 0.25, 0, {"width": 64})
    (job,), _ = jobs_from_images(spec, _victims(spec, n=1, batch=4))
    result = ClosedForms().solve("dark_background", job)
    assert result.status == SOLVED_INEXACT and result.extras["images_separated"] == 0
    assert result.images.shape == (4, *spec.input_shape)
    adam = LocalPlan(Schedule(epochs=2, batch_size=4, order="in-order"), OptimizerSpec("adam", 1e-3))
    (update,), _ = jobs_from_images(spec, _dark_victims(spec, 4), plan=adam)
    reason = ClosedForms().reason("dark_background", update)
    assert "Adam's elementwise steps take it out of that span" in reason and "\n" not in reason


def test_dark_background_takes_an_sgd_update_of_one_image() -> None:
    """B = 1, an SGD round of 3 steps: no one-image solver takes the update; the background fixes the image
    (and its scale) in the update's rank-one row space."""
    from fedsim.client_step import LocalPlan, OptimizerSpec, Schedule

    spec = ModelSpec("mlp", "mnist", 0.25, 0, {"width": 64})
    plan = LocalPlan(Schedule(epochs=3, batch_size=1, order="in-order"), OptimizerSpec("sgd", 0.05))
    (job,), (oracle,) = jobs_from_images(spec, _dark_victims(spec, 1), plan=plan)
    forms = ClosedForms()
    assert "update of 3 local steps" in forms.reason("first_linear", job)
    result = forms.solve("dark_background", job)
    assert result.status == SOLVED and torch.allclose(result.images, oracle.images, atol=1e-3)


def _adam_round(epochs: int = 4, batch: int = 1):
    from fedsim.client_step import LocalPlan, OptimizerSpec, Schedule

    return LocalPlan(Schedule(epochs=epochs, batch_size=batch, order="in-order"), OptimizerSpec("adam", 1e-3))


def _digit_like(spec: ModelSpec, n: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One image per batch, as a digit: 80 % of it at the box's low value, strokes up to its high one."""
    out = []
    for k in range(n):
        ((image, label),) = _dark_victims(spec, 1, seed=seed + k)
        low, high = box_bounds(get_spec(spec.dataset, spec.input_shape[0]))
        image.view(-1)[int(image.argmax())] = float(high.flatten()[0])  # the brightest stroke saturates
        out.append((image, label))
    return out


def test_adam_eps_reads_one_images_adam_round_and_never_claims_exact() -> None:
    """K = 4 Adam steps on one image: the first Linear's update is u sign(x)^T but for epsilon's share, which
    falls with |x|; with the box fixing the map, every pixel comes back (to 2 % of the box), where the
    one-step solvers and dark_background refuse the update. The answer rests on the box, so it is inexact."""
    spec = ModelSpec("mlp", "mnist", 0.25, 0, {"width": 64})
    jobs, oracles = jobs_from_images(spec, _digit_like(spec, 2), plan=_adam_round())
    forms = ClosedForms()
    for job, oracle in zip(jobs, oracles):
        assert forms.reason("adam_eps", job) is None
        assert "Adam's elementwise steps" in forms.reason("dark_background", job)
        result = forms.solve("adam_eps", job)
        assert result.status == SOLVED_INEXACT and result.extras["unknowns"] == 2
        err = (result.images - oracle.images).abs()
        assert float(err.max()) < 0.05 and float(err.mean()) < 5e-3, (float(err.max()), float(err.mean()))
        # the pixels' signs alone are not the answer: the magnitudes come back too
        assert len(torch.unique(torch.round(result.images * 100))) > 10
    guess = forms.first_guess(jobs[0])
    assert guess is not None and not bool(guess.held.any())  # a start for DIA (dia_cf), holding nothing


def test_adam_eps_refuses_what_it_cannot_read_in_one_line() -> None:
    """A one-step gradient, an SGD round, a batch of two and a box about symmetric around 0 (CIFAR-10):
    each refused with its reason."""
    from fedsim.client_step import LocalPlan, OptimizerSpec, Schedule

    spec = ModelSpec("mlp", "mnist", 0.25, 0, {"width": 64})
    forms = ClosedForms()
    (gradient,), _ = jobs_from_images(spec, _digit_like(spec, 1))
    assert "holds a one-step gradient" in forms.reason("adam_eps", gradient)
    sgd = LocalPlan(Schedule(epochs=2, batch_size=1, order="in-order"), OptimizerSpec("sgd", 0.05))
    (update,), _ = jobs_from_images(spec, _digit_like(spec, 1), plan=sgd)
    assert "holds an update of SGD" in forms.reason("adam_eps", update)
    (pair,), _ = jobs_from_images(spec, _dark_victims(spec, 2), plan=_adam_round(batch=2))
    assert "has B = 2" in forms.reason("adam_eps", pair)
    cifar = ModelSpec("mlp", "cifar10", 0.25, 0, {"width": 64})
    (natural,), _ = jobs_from_images(cifar, _victims(cifar, n=1), plan=_adam_round())
    assert "about as far from 0" in forms.reason("adam_eps", natural)
