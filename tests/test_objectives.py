"""Loss terms and mask modes are lookups: adding one is a function and a config key, and the
threat-model gate (which attack may see the oracle) is one rule."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from attacker.attacks import AttackConfig, AttackConfigError, make_attack
from attacker.engine import objectives
from attacker.engine.inversion import InversionModule
from attacker.engine.masks import MASK_MODES
from attacker.jobs import jobs_from_images
from fedsim.models import ModelSpec


def test_every_term_weight_is_an_attack_setting_and_every_distance_is_accepted():
    fields = {f.name for f in dataclasses.fields(AttackConfig)}
    assert set(objectives.TERMS) <= fields
    for name in objectives.DISTANCES:
        assert make_attack("dia", distance=name).distance == name
    with pytest.raises(AttackConfigError, match="distance"):
        make_attack("dia", distance="manhattan")
    with pytest.raises(AttackConfigError, match="lambda_mask"):
        make_attack("dia", lambda_mask=-1.0)


def test_only_modes_that_replay_true_masks_receive_the_oracle():
    assert {name for name, mode in MASK_MODES.items() if mode.uses_oracle} == {"oracle"}
    assert make_attack("wiig").receives_oracle
    assert not any(make_attack(a).receives_oracle for a in ("ig_eval", "ig_train", "dia", "april"))


def test_a_new_term_is_one_function_and_one_key(mnist_like, monkeypatch):
    """Register a term under an existing weight key's shape: the engine adds weight * term per job."""
    x, y = mnist_like
    spec = ModelSpec("mlp", "mnist", 0.25, 0)
    jobs, oracles = jobs_from_images(spec, [(x[i : i + 1], y[i : i + 1]) for i in range(2)])
    seen = {}

    def brightness(inputs: objectives.TermInputs) -> torch.Tensor:
        seen["called"] = True
        return inputs.images.reshape(inputs.num_jobs, -1).mean(1)

    # a new key on the config (a subclass stands in for adding the field) and one registered function
    NewConfig = dataclasses.make_dataclass(
        "NewConfig", [("lambda_bright", float, 0.0)], bases=(AttackConfig,), frozen=True
    )
    monkeypatch.setitem(objectives.TERMS, "lambda_bright", objectives.Term("lambda_bright", brightness))
    plain = NewConfig("dia", masks="learn")
    bright = NewConfig("dia", masks="learn", lambda_bright=2.0)
    module = InversionModule(jobs, [plain, bright])
    base = InversionModule(jobs, [plain, plain])
    loss, images = module.job_losses([0, 1])
    loss_base, _ = base.job_losses([0, 1])
    assert seen["called"]
    torch.testing.assert_close(loss[0], loss_base[0])
    torch.testing.assert_close(loss[1] - loss_base[1], 2.0 * images[1:2].mean(), rtol=1e-5, atol=1e-6)


def test_a_pruned_capture_is_matched_on_its_surviving_entries_only(mnist_like):
    """Under pruning the dummy gradient is cut to the entries the client kept: a dummy that equals the
    client's image then matches the pruned target exactly (cosine distance 0), which the full dummy
    gradient would not."""
    x, y = mnist_like
    spec = ModelSpec("mlp", "mnist", 0.0, 0, {"width": 32})
    jobs, oracles = jobs_from_images(spec, [(x[:1], y[:1]), (x[1:2], y[1:2])])
    pruned = []
    for job in jobs:  # keep the 10 % largest entries of each tensor, as the prune mod does
        kept = []
        for g in job.gradient:
            k = max(1, int(0.1 * g.numel()))
            threshold = g.abs().flatten().kthvalue(g.numel() - k + 1).values
            kept.append(torch.where(g.abs() >= threshold, g, torch.zeros_like(g)))
        pruned.append(dataclasses.replace(job, gradient=kept, match_support=True))
    attack = make_attack("ig_eval")
    for jobs_, expect_zero in ((pruned, True), ([dataclasses.replace(j, match_support=False) for j in pruned], False)):
        module = InversionModule(jobs_, [attack, attack])
        with torch.no_grad():
            for j, oracle in enumerate(oracles):
                module.images[j].copy_(oracle.images)
        loss, _ = module.job_losses([0, 1])
        tv = module.weight_tv_weight * objectives.total_variation(torch.cat([o.images for o in oracles]), 2)
        distance = loss.detach() - tv
        if expect_zero:
            assert distance.abs().max() < 1e-5
        else:
            assert distance.min() > 1e-2


# -- APRIL's position-embedding term: the parameter found by what it is, not by its name --------------

TIMM_VIT = ModelSpec("timm:vit_tiny_patch16_224", "cifar10", 0.1, 0, {"img_size": 32, "patch_size": 4, "depth": 1})


def test_aprils_term_on_a_timm_vit_equals_autograd(monkeypatch):
    """timm calls it pos_embed (the project's ViT pos_embedding): the engine finds it by structure, and
    the term's per-job position-embedding terms and cosine equal plain autograd on each job alone."""
    from attacker.jobs import model_from_job
    from fedsim.models import DropoutMode, dropout_mode

    gen = torch.Generator().manual_seed(0)
    batches = [(torch.randn(2, 3, 32, 32, generator=gen), torch.tensor([k, k + 1])) for k in (1, 5)]
    jobs, _ = jobs_from_images(TIMM_VIT, batches)
    module = InversionModule(jobs, [make_attack("april")] * 2)
    params = dict(module.model.named_parameters())
    assert module.position is not None and params[module.position] is module.model.net.pos_embed
    seen = {}
    real = objectives.TERMS["lambda_pos"]

    def spy(inputs: objectives.TermInputs) -> torch.Tensor:
        seen["inputs"], seen["value"] = inputs, real.fn(inputs)
        return seen["value"]

    monkeypatch.setitem(objectives.TERMS, "lambda_pos", dataclasses.replace(real, fn=spy))
    module.job_losses([0, 1])
    match, row = seen["inputs"].match, list(params).index(module.position)
    assert match.names[row] == module.position
    reference = model_from_job(jobs[0])
    pos = dict(reference.named_parameters())[module.position]
    for j, job in enumerate(jobs):
        with dropout_mode(reference, DropoutMode.OFF):  # APRIL's constant 1 - p masks cancel the dropout scaling
            loss = F.cross_entropy(reference(module.images[j].detach()), job.labels)
        (g,) = torch.autograd.grad(loss, [pos])
        target = job.gradient[row]
        dot, norm2 = (g * target).sum(), g.pow(2).sum()
        torch.testing.assert_close(match.dot[row, j], dot, rtol=1e-4, atol=1e-7)
        torch.testing.assert_close(match.norm2[row, j], norm2, rtol=1e-4, atol=1e-7)
        cosine = 1 - dot / (norm2.sqrt() * target.pow(2).sum().sqrt() + objectives.EPS)
        torch.testing.assert_close(seen["value"][j], cosine, rtol=1e-4, atol=1e-6)


def test_aprils_term_finds_the_projects_vit_position_embedding_and_refuses_a_model_without_one(mnist_like):
    x, y = mnist_like
    vit = jobs_from_images(ModelSpec("vit", "mnist", 0.1, 0, {"depth": 1}), [(x[:1], y[:1])])[0]
    module = InversionModule(vit, [make_attack("april")])
    assert dict(module.model.named_parameters())[module.position] is module.model.tokens.pos_embedding
    assert InversionModule(vit, [make_attack("ig_eval")]).position is None  # no term, no probe
    mlp = jobs_from_images(ModelSpec("mlp", "mnist", 0.0, 0), [(x[:1], y[:1])])[0]
    module = InversionModule(mlp, [make_attack("april")])
    assert module.position is None
    with pytest.raises(ValueError, match="the model has no position embedding"):
        module.job_losses([0])
