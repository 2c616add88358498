"""Loss terms and mask modes are lookups: adding one is a function and a config key, and the
threat-model gate (which attack may see the oracle) is one rule."""

from __future__ import annotations

import dataclasses

import pytest
import torch

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
