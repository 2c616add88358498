"""Stochastic depth (timm's ``drop_path_rate``) as a second mask (fedsim.models.dropout.MaskedDropPath):
timm's ``DropPath`` modules are swapped for it (fedsim/models/own/swap.py), one keep-or-drop per image of
shape (B, 1, ..., 1) at each layer's own rate, so the client samples timm's own draws and records them,
a replay of the recorded masks gives the recorded pass (output and gradient), the engine's per-job
terms equal plain autograd with learned drop-path masks, and DIA learns them end to end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from attacker.cli import main as attacker_main
from attacker.engine.gradients import NOT_RUN, VJP, PerJobGradients
from attacker.engine.masks import MASK_MODES, MaskContext
from attacker.engine.objectives import TERMS, TermInputs, mask_regularizer
from fedsim.models import build_model, dropout_layers, get_recorded_masks, mask_shapes, set_dropout_mode, set_masks
from fedsim.models.dropout import MaskedDropPath, mask_rates

from .conftest import ROOT
from .test_hybrid_terms import _close, _plain

VIT = "timm:vit_tiny_patch16_224"
VIT_OPTIONS = {"img_size": 32, "patch_size": 8, "depth": 2, "embed_dim": 48, "drop_path_rate": 0.2}


def _vit(p: float = 0.25) -> nn.Module:
    return build_model(VIT, "cifar10", p, seed=0, **VIT_OPTIONS)


def test_timm_drop_path_becomes_mask_layers_at_their_own_rates() -> None:
    model = build_model("timm:resnet18", "cifar10", 0.25, seed=0, drop_path_rate=0.1)
    layers = dropout_layers(model)
    # timm spreads the rate over resnet18's 8 blocks (the first at 0: no draw, left as it is), then the head
    assert [type(m).__name__ for m in layers] == ["MaskedDropPath"] * 7 + ["MaskedDropout"]
    rates = [m.p for m in layers]
    assert rates[-1] == 0.25 and rates[:-1] == sorted(rates[:-1]) and rates[-2] == pytest.approx(0.1)
    shapes = mask_shapes(model, torch.zeros(3, 3, 32, 32))
    assert shapes == [torch.Size([3, 1, 1, 1])] * 7 + [torch.Size([3, 512])]
    assert mask_rates(model, 0.25, 2 * len(layers)) == rates * 2  # per local step, step-major
    assert not any(type(m).__name__ == "DropPath" for m in model.modules())


def test_the_client_draws_timms_own_masks() -> None:
    """At p = 0 the only draws are drop path's: the adapted model samples exactly what timm's does."""
    import timm

    model = _vit(p=0.0)
    raw = timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=10, **VIT_OPTIONS)
    raw.load_state_dict(model.net.state_dict())
    raw.train()
    model.train()
    x = torch.randn(8, 3, 32, 32)
    torch.manual_seed(5)
    ref = raw(x)
    torch.manual_seed(5)
    torch.testing.assert_close(model(x), ref)  # (rounding only: x * keep / q against x * (keep / q))
    set_dropout_mode(model, "off")
    assert not torch.allclose(model(x), ref)  # it did drop paths


@pytest.mark.parametrize("name,options", [("timm:resnet18", {"drop_path_rate": 0.1}), (VIT, VIT_OPTIONS)])
def test_recorded_drop_path_masks_replay_the_recorded_pass(name: str, options: dict) -> None:
    model = build_model(name, "cifar10", 0.25, seed=0, **options)
    params = list(model.parameters())
    x, y = torch.randn(6, 3, 32, 32), torch.arange(6) % 10

    def run() -> tuple[torch.Tensor, list[torch.Tensor]]:
        out = model(x)
        return out, list(torch.autograd.grad(F.cross_entropy(out, y), params))

    set_dropout_mode(model, "off")
    clean, _ = run()
    set_dropout_mode(model, "record")
    for seed in range(20):  # the first seed whose draw drops some image's path
        torch.manual_seed(seed)
        out, grads = run()
        masks = get_recorded_masks(model)
        drop_path = [m for m, layer in zip(masks, dropout_layers(model)) if isinstance(layer, MaskedDropPath)]
        if any(bool((m == 0).any()) for m in drop_path):
            break
    assert drop_path and all(m.shape == (6,) + (1,) * (m.dim() - 1) for m in drop_path)
    assert any(bool((m == 0).any()) for m in drop_path)
    assert not torch.allclose(out, clean)
    set_masks(model, masks)
    set_dropout_mode(model, "replay")
    replayed, replayed_grads = run()
    assert torch.equal(replayed, out)
    for got, ref in zip(replayed_grads, grads):
        torch.testing.assert_close(got, ref, rtol=0, atol=0)
    set_masks(model, [m.float() for m in masks])
    set_dropout_mode(model, "learn")  # a learned mask equal to the recorded one equals replay
    torch.testing.assert_close(model(x), out)
    with pytest.raises(ValueError, match="drop-path mask shape"):
        set_masks(model, [torch.ones(5, *m.shape[1:]) for m in masks])
        model(x)


# The ResNet on 16 x 16 inputs (it pools globally; its drop-path masks are one entry per image whatever
# the size): a quarter of the 32 x 32 cost. The ViT's patch embedding fixes its 32 x 32.
@pytest.mark.parametrize("name,options,size", [("timm:resnet18", {"drop_path_rate": 0.1}, 16), (VIT, VIT_OPTIONS, 32)])
def test_hybrid_terms_with_learned_drop_path_masks_equal_plain_autograd_per_job(
    name: str, options: dict, size: int
) -> None:
    model = build_model(name, "cifar10", 0.25, seed=0, **options)
    for prm in model.parameters():
        prm.requires_grad_(False)
    V, B = 3, 2
    g = torch.Generator().manual_seed(0)
    x = torch.randn(V * B, 3, size, size, generator=g).requires_grad_(True)
    y = torch.randint(0, 10, (V * B,), generator=g)
    shapes = mask_shapes(model, x.detach())
    drop_path = [s for s, layer in zip(shapes, dropout_layers(model)) if isinstance(layer, MaskedDropPath)]
    assert drop_path and all(s[0] == V * B and s[1:].numel() == 1 for s in drop_path)  # one entry per image
    masks = [torch.rand(s, generator=g).requires_grad_(True) for s in shapes]
    set_masks(model, masks)
    set_dropout_mode(model, "learn")
    targets = [torch.randn(V, *prm.shape, generator=g) for prm in model.parameters()]
    ghost = PerJobGradients(model)
    ghost.set_targets(targets)
    terms = ghost.compute(x, y, V)
    ref_dot, ref_norm2 = _plain(model, x, y, masks, targets, V)
    _close(terms.dot, ref_dot)
    _close(terms.norm2, ref_norm2)
    grads = torch.autograd.grad(terms.dot.sum() - 0.1 * terms.norm2.sum(), [x, *masks])
    ref_grads = torch.autograd.grad(ref_dot.sum() - 0.1 * ref_norm2.sum(), [x, *masks])
    for got, ref in zip(grads, ref_grads):
        _close(got, ref, rtol=1e-3)
    assert set(ghost.paths.values()) <= {"batched", "batched-factored", VJP, NOT_RUN}


def test_mask_modes_take_each_layers_own_rate() -> None:
    """IG (eval)'s constant masks cancel each layer's own 1/(1 - rate): the pass is the clean one."""
    model = _vit()
    x = torch.randn(2, 3, 32, 32)
    shapes = mask_shapes(model, x)
    rates = mask_rates(model, 0.25, len(shapes))
    assert rates == [pytest.approx(0.2), pytest.approx(0.2), 0.25]
    ctx = MaskContext(shapes, 0.25, "bernoulli", model, None, None, torch.Generator().manual_seed(0), rates)
    set_dropout_mode(model, "off")
    clean = model(x)
    set_masks(model, MASK_MODES["off"].init(ctx))
    set_dropout_mode(model, "learn")
    torch.testing.assert_close(model(x), clean)
    learned = MASK_MODES["learn"].init(ctx)
    assert [m.shape for m in learned] == shapes


def test_the_mask_prior_pulls_each_mask_toward_its_own_rate() -> None:
    """DIA's mask term (paper eq. 5) with stochastic depth: a drop-path mask keeping 80 % of its samples
    costs nothing at its own rate 0.2, and |0.2 - 0.25| at the dropout layers' p."""
    keep_80 = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]])  # one job, 1 - mean = 0.2
    keep_75 = torch.tensor([[1.0, 1.0, 1.0, 0.0]])  # 1 - mean = 0.25
    own = mask_regularizer([keep_80, keep_75], 1, [0.2, 0.25])
    torch.testing.assert_close(own, torch.zeros(1))
    torch.testing.assert_close(mask_regularizer([keep_80, keep_75], 1, 0.25), torch.tensor([0.05]))
    inputs = TermInputs(None, torch.zeros(1, 1, 2, 2), 1, [keep_80, keep_75], 0.25, rates=[0.2, 0.25])  # type: ignore[arg-type]
    torch.testing.assert_close(TERMS["lambda_mask"].fn(inputs), torch.zeros(1))


@pytest.mark.parametrize(
    ("p", "expected"),
    [
        ("0.25", {"mask00": (2, 1, 1), "mask01": (2, 1, 1), "mask02": (2, 48)}),
        # p = 0: no dropout, but the drop-path masks are still random, so DIA still learns them
        ("0", {"mask00": (2, 1, 1), "mask01": (2, 1, 1)}),
    ],
)
def test_dia_learns_drop_path_masks_end_to_end(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch, p: str, expected: dict
) -> None:
    from safetensors.torch import load_file

    monkeypatch.chdir(ROOT)
    out = tmp_path / "run"
    args = ["run", "--model", VIT, "--model-options", json.dumps(VIT_OPTIONS), "--dataset", "cifar10", "--p", p]
    args += ["--victims", "2", "--victim-batch-size", "2", "--attacks", "wiig", "dia", "--iterations", "3"]
    code = attacker_main([*args, "--no-lpips", "--quiet", "--out", str(out)])
    assert code == 0, capsys.readouterr()
    rows = json.loads((out / "metrics.json").read_text())
    assert {r["attack"] for r in rows} == {"wiig", "dia"}
    saved = load_file(str(out / "reconstructions.safetensors"))
    learned = {k.rsplit("/", 1)[1]: v.shape for k, v in saved.items() if "/dia/mask" in k}
    assert learned == expected
