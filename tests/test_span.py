"""The images' span (attacker/engine/span.py): read off a first Linear's gradient or an SGD update, it
holds the client's true images; it is refused where it would not (Adam, a conv first layer, pruning);
``dia_span`` keeps its dummies in it."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from engine_harness import fit_attack

from attacker.attacks import make_attack
from attacker.cli import main
from attacker.engine.inversion import InversionModule
from attacker.engine.span import image_span, span_reason
from attacker.jobs import jobs_from_images, model_from_job
from fedsim.client_step import LocalPlan, OptimizerSpec, Schedule
from fedsim.models import ModelSpec


def _batch(spec: ModelSpec, b: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.rand(b, *spec.input_shape, generator=gen), torch.randint(0, 10, (b,), generator=gen))]


def _residual(basis: torch.Tensor, images: torch.Tensor) -> float:
    flat = images.reshape(images.shape[0], -1).double()
    return float(torch.linalg.norm(flat - flat @ basis @ basis.T) / torch.linalg.norm(flat))


def test_the_true_images_lie_in_the_span_of_a_gradient_and_of_an_sgd_round() -> None:
    spec = ModelSpec("mlp", "mnist", 0.25, 0, {"width": 64, "depth": 2})
    sgd = LocalPlan(Schedule(epochs=2, batch_size=2, order="in-order"), OptimizerSpec("sgd", 0.05, momentum=0.9))
    for plan in (None, sgd):
        (job,), (oracle,) = jobs_from_images(spec, _batch(spec, 6), plan=plan)
        basis = image_span(job, model_from_job(job))
        assert basis is not None and basis.shape == (784, 6)
        torch.testing.assert_close(basis.T @ basis, torch.eye(6, dtype=basis.dtype), atol=1e-9, rtol=0)
        assert _residual(basis, oracle.images) < 1e-4
        # a random image is far from it: the span is a real constraint
        other = torch.rand(1, 784, generator=torch.Generator().manual_seed(99))
        assert _residual(basis, other) > 0.5


def test_the_span_is_refused_where_it_does_not_hold() -> None:
    mlp = ModelSpec("mlp", "mnist", 0.25, 0, {"width": 64, "depth": 2})
    adam = LocalPlan(Schedule(epochs=2, batch_size=2, order="in-order"), OptimizerSpec("adam", 1e-3))
    (job,), _ = jobs_from_images(mlp, _batch(mlp, 4), plan=adam)
    assert "Adam" in span_reason(job, model_from_job(job)) and image_span(job, model_from_job(job)) is None
    lenet = ModelSpec("lenet", "mnist", 0.25)
    (job,), _ = jobs_from_images(lenet, _batch(lenet, 2))
    assert "no Linear" in span_reason(job, model_from_job(job))
    (job,), _ = jobs_from_images(mlp, _batch(mlp, 4))
    assert "pruned" in span_reason(replace(job, match_support=True), model_from_job(job))
    # noise fills the gradient's spectrum: rank above B, no span
    noisy = replace(job, gradient=[g + 1e-2 * torch.randn_like(g) for g in job.gradient])
    assert image_span(noisy, model_from_job(noisy)) is None


def test_dia_span_keeps_its_dummies_in_the_span() -> None:
    spec = ModelSpec("mlp", "mnist", 0.25, 0, {"width": 64, "depth": 2})
    (job,), _ = jobs_from_images(spec, _batch(spec, 4))
    basis = image_span(job, model_from_job(job))
    attacks = [make_attack("dia_span", max_iterations=20), make_attack("dia", max_iterations=20)]
    module = InversionModule([job, job], attacks, None)
    module.chunk = 20
    held, free = fit_attack(module)
    assert _residual(basis, held.images) < 1e-5
    assert _residual(basis, free.images) > 0.1  # plain DIA's dummies are not held there


def test_dia_span_named_where_it_does_not_hold_is_refused_and_skipped_where_asked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Named by the user on a LeNet (no first Linear): one line, exit 2, nothing written. With
    skip_inapplicable (the audit's defaults) it is skipped, its reason in closed_form.json, and the rest runs."""
    base = ["--model", "lenet", "--dataset", "mnist", "--p", "0.25", "--victims", "1", "--no-lpips", "--quiet"]
    out = tmp_path / "named"
    code = main(["run", *base, "--attacks", "dia_span", "--out", str(out)])
    text = capsys.readouterr()
    assert code == 2 and "dia_span holds the dummies" in text.err + text.out and not out.exists()
    config = tmp_path / "skip.yaml"
    config.write_text(
        "victims: {source: builtin, model: lenet, dataset: mnist, p: 0.25, count: 1}\n"
        "attacks: [ig_eval, dia_span]\nattack_overrides: {max_iterations: 2}\nlpips: false\nskip_inapplicable: true\n"
    )
    out = tmp_path / "skipped"
    assert main(["run", str(config), "--quiet", "--out", str(out)]) == 0
    skipped = json.loads((out / "closed_form.json").read_text())["skipped"]
    assert "no Linear on the flattened image" in skipped["dia_span"]
    assert {r["attack"] for r in json.loads((out / "metrics.json").read_text())} == {"ig_eval"}
