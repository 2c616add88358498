"""The engine's per-layer hybrid (attacker/engine/gradients.py, hybrid.py): batched closed forms for the
layers it knows, the per-job vjp for the rest, one job at a time only where a layer couples a batch.

Per job, its loss terms (<g_j, g*_j> and ||g_j||^2 per parameter) and their gradients w.r.t. the
images and DIA's masks equal plain autograd on that job alone, on: the example CNN, a model holding
every kind of layer the hybrid treats (eval BatchNorm, depthwise and reflect-padded convolutions,
PReLU, InstanceNorm, a layer scale, a parameter read outside its layer, a layer run twice, an output
changed in place), timm's resnet18 (its functional dropout routed), a timm ViT (its cls token and
position embedding read by its forward), timm's distilled DeiT (one dropout layer run twice a pass,
a learned mask per call), and torchvision's mobilenet_v2 (depthwise convolutions,
BatchNorm, ReLU6; its mobilenet_v3 is refused by fedsim.models.own: hardsigmoid has no second
derivative in torch)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from attacker.engine.gradients import BATCHED, NOT_RUN, VJP, PerJobGradients
from attacker.engine.matching import Matcher
from attacker.jobs import VictimJob
from fedsim.models import build_model, mask_shapes, set_dropout_mode, set_masks
from fedsim.models.own import TRUSTED_FACTORIES_ENV

CNN = "examples.own_model:small_cnn"
MIXED = "tests.test_hybrid_terms:Mixed"
MOBILENET = "torchvision.models:mobilenet_v2"
CASES = {
    "cnn": (CNN, {}),
    "mixed": (MIXED, {}),
    "timm_resnet18": ("timm:resnet18", {}),
    "timm_vit": ("timm:vit_tiny_patch16_224", {"img_size": 32, "patch_size": 8, "depth": 1, "embed_dim": 48}),
    "mobilenet_v2": (MOBILENET, {"dropout": 0.25, "width_mult": 0.25}),
    # its head_drop runs twice in a pass (class and distillation token): two masks of one layer
    "timm_deit_distilled": (
        "timm:deit_tiny_distilled_patch16_224",
        {"img_size": 32, "patch_size": 8, "depth": 1, "embed_dim": 48},
    ),
}


@pytest.fixture(autouse=True)
def _trusted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(TRUSTED_FACTORIES_ENV, ",".join([CNN, MIXED, MOBILENET]))


class LayerScale(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.gamma = nn.Parameter(torch.linspace(0.5, 1.5, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gamma.view(1, -1, 1, 1)


class Gate(nn.Module):
    """Owns a parameter and runs a child: its parameter is read by its forward, op by op."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.linspace(-0.1, 0.1, dim).view(1, -1, 1, 1))
        self.conv = nn.Conv2d(dim, dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x) + self.bias


class Mixed(nn.Module):
    def __init__(self, num_classes: int = 10, p: float = 0.25, width: int = 4) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, width, 3, stride=2, padding=1)
        self.bn = nn.BatchNorm2d(width)
        self.prelu = nn.PReLU(width)
        self.depthwise = nn.Conv2d(width, width, 3, padding=1, groups=width)
        self.grouped = nn.Conv2d(width, 2 * width, 3, padding=1, groups=2, bias=False)
        self.reflect = nn.Conv2d(2 * width, width, 3, padding=1, padding_mode="reflect")
        self.inorm = nn.InstanceNorm2d(width, affine=True)
        self.scale = LayerScale(width)
        self.gate = Gate(width)
        self.shared = nn.Conv2d(width, width, 1)  # runs twice
        self.drop = nn.Dropout(p)
        self.fc = nn.Linear(width * 4, num_classes)
        with torch.no_grad():  # running statistics that are not the identity
            self.bn.running_mean.uniform_(-0.2, 0.2)
            self.bn.running_var.uniform_(0.5, 2.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.bn(self.stem(x))
        x += 0.5  # the BatchNorm's output, changed in place
        x = self.depthwise(self.prelu(x))
        x = F.relu(self.reflect(F.gelu(self.grouped(x))))
        x = self.gate(self.scale(self.inorm(x)))
        x = self.shared(F.silu(self.shared(x)))
        x = F.adaptive_avg_pool2d(x, 2).flatten(1)
        return self.fc(self.drop(x) * self.fc.weight[0, 0])  # fc.weight also read outside fc


def _build(case: str) -> nn.Module:
    name, options = CASES[case]
    return build_model(name, "cifar10", 0.25, seed=0, **options)


def _plain(model, x, y, masks, targets, V):
    """Per job by plain autograd on the job's images alone: dot and norm2, (params, V)."""
    params = list(model.parameters())
    for prm in params:
        prm.requires_grad_(True)
    B = x.shape[0] // V
    dots, norms = [], []
    for j in range(V):
        rows = slice(j * B, (j + 1) * B)
        if masks:
            set_masks(model, [m[rows] for m in masks])
        grads = torch.autograd.grad(
            F.cross_entropy(model(x[rows]), y[rows]), params, create_graph=True, allow_unused=True
        )
        grads = [torch.zeros_like(p) if g is None else g for g, p in zip(grads, params)]
        dots.append(torch.stack([(g * t[j]).sum() for g, t in zip(grads, targets)]))
        norms.append(torch.stack([g.pow(2).sum() for g in grads]))
    for prm in params:
        prm.requires_grad_(False)
    if masks:
        set_masks(model, masks)
    return torch.stack(dots, 1), torch.stack(norms, 1)


def _close(got: torch.Tensor, ref: torch.Tensor, rtol: float = 1e-4) -> None:
    torch.testing.assert_close(got, ref, rtol=rtol, atol=rtol * ref.abs().max().item())


@pytest.mark.parametrize("case", list(CASES))
def test_hybrid_terms_equal_plain_autograd_per_job(case: str) -> None:
    model = _build(case)
    for prm in model.parameters():
        prm.requires_grad_(False)
    V, B = 3, 2
    g = torch.Generator().manual_seed(0)
    x = torch.randn(V * B, 3, 32, 32, generator=g).requires_grad_(True)
    y = torch.randint(0, 10, (V * B,), generator=g)
    masks = [torch.rand(s, generator=g).requires_grad_(True) for s in mask_shapes(model, x.detach())]
    set_masks(model, masks)
    set_dropout_mode(model, "learn")  # DIA's masks: real-valued, learned
    targets = [torch.randn(V, *prm.shape, generator=g) for prm in model.parameters()]

    ghost = PerJobGradients(model)  # no layer here couples a batch: all jobs in one pass
    ghost.set_targets(targets)
    terms = ghost.compute(x, y, V)
    ref_dot, ref_norm2 = _plain(model, x, y, masks, targets, V)
    _close(terms.dot, ref_dot)
    _close(terms.norm2, ref_norm2)
    grads = torch.autograd.grad(terms.dot.sum() - 0.1 * terms.norm2.sum(), [x, *masks])
    ref_grads = torch.autograd.grad(ref_dot.sum() - 0.1 * ref_norm2.sum(), [x, *masks])
    for got, ref in zip(grads, ref_grads):
        _close(got, ref, rtol=1e-3)
    # the next pass (no longer watching parameter reads where none were found) gives the same terms
    again = ghost.compute(x, y, V)
    _close(again.dot, ref_dot)
    assert set(ghost.paths.values()) <= {BATCHED, "batched-factored", VJP, NOT_RUN}


def test_each_layer_takes_the_path_it_should() -> None:
    ghost = PerJobGradients(_build("mixed"))
    ghost.probe((3, 32, 32))
    paths = {k.removeprefix("net."): v for k, v in ghost.paths.items()}
    for name in ("stem", "bn", "depthwise", "grouped", "gate.conv"):
        assert paths[name] == BATCHED, (name, paths[name])
    for name in ("prelu", "reflect", "inorm", "scale", "gate.bias", "shared", "fc"):
        assert paths[name] == VJP, (name, paths[name])
    vit = PerJobGradients(_build("timm_vit"))
    vit.probe((3, 32, 32))
    assert vit.paths["net.cls_token"] == VJP and vit.paths["net.pos_embed"] == VJP
    assert vit.paths["net.blocks.0.attn.qkv"] in (BATCHED, "batched-factored")


def _scale_terms(t, m, inp, d):
    """LayerScale's per-job gradient: sum over the job's images and pixels of delta * input, per channel."""
    g = (d * inp).reshape(t.V, -1, *inp.shape[1:]).sum((1, 3, 4))
    return {t.of(m.gamma): t.dense(m.gamma, g)}


class ShiftedScale(LayerScale):
    """A subclass with a forward of its own, not what LayerScale's formula assumes."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gamma.view(1, -1, 1, 1) + 0.1


@pytest.mark.parametrize("own_forward", [False, True])
def test_a_new_layer_type_is_one_registered_formula(monkeypatch: pytest.MonkeyPatch, own_forward: bool) -> None:
    """One entry in layer_terms.FORMULAS batches a layer type (and its subclasses); a subclass whose
    own forward is not what the entry's reference computes (checked once) stays on the per-job vjp.
    Either way the terms equal plain autograd."""
    from attacker.engine import layer_terms

    entry = layer_terms.LayerFormula(LayerScale, _scale_terms, lambda m, x: x * m.gamma.view(1, -1, 1, 1))
    monkeypatch.setitem(layer_terms.FORMULAS, LayerScale, entry)
    model = _build("mixed")
    if own_forward:
        model.net.scale.__class__ = ShiftedScale
    for prm in model.parameters():
        prm.requires_grad_(False)
    V, B = 2, 2
    g = torch.Generator().manual_seed(3)
    x = torch.randn(V * B, 3, 32, 32, generator=g).requires_grad_(True)
    y = torch.randint(0, 10, (V * B,), generator=g)
    set_dropout_mode(model, "off")
    targets = [torch.randn(V, *prm.shape, generator=g) for prm in model.parameters()]
    ghost = PerJobGradients(model)
    ghost.set_targets(targets)
    terms = ghost.compute(x, y, V)
    assert ghost.paths["net.scale"] == (VJP if own_forward else BATCHED)
    ref_dot, ref_norm2 = _plain(model, x, y, [], targets, V)
    _close(terms.dot, ref_dot)
    _close(terms.norm2, ref_norm2)
    grads = torch.autograd.grad(terms.dot.sum() - 0.1 * terms.norm2.sum(), x)
    ref_grads = torch.autograd.grad(ref_dot.sum() - 0.1 * ref_norm2.sum(), x)
    _close(grads[0], ref_grads[0], rtol=1e-3)


def test_train_mode_batchnorm_couples_and_goes_one_job_at_a_time() -> None:
    model = build_model("resnet18", "cifar10", 0.25, norm="batch")
    reason = PerJobGradients.check(model)
    assert reason is not None and "BatchNorm2d" in reason and "couples the images" in reason
    assert PerJobGradients.check(_build("timm_resnet18"), (3, 32, 32)) is None  # eval-mode BatchNorm


def test_the_matcher_batches_own_models_and_logs_the_paths() -> None:
    model = _build("mixed")
    for prm in model.parameters():
        prm.requires_grad_(False)
    V, B = 2, 2
    g = torch.Generator().manual_seed(1)
    x = torch.randn(V * B, 3, 32, 32, generator=g).requires_grad_(True)
    y = torch.randint(0, 10, (V * B,), generator=g)
    weights = {k: v.detach() for k, v in model.state_dict().items()}
    targets = [torch.randn(V, *prm.shape, generator=g) for prm in model.parameters()]
    jobs = [VictimJob(f"j{j}", model.spec, weights, [t[j] for t in targets], y[j * B : (j + 1) * B]) for j in range(V)]
    matcher = Matcher(jobs, model)
    assert matcher.ghost is not None
    set_dropout_mode(model, "off")
    terms = matcher.terms(x, [0, 1], [])
    assert terms.dot.shape == (len(targets), V)
    paths = matcher.gradient_paths()
    assert paths["net.prelu"] == VJP and paths["net.bn"] == BATCHED


# -- train-mode BatchNorm: the client's batch is coupled, so the attack takes it whole, one job at a time --


def test_train_mode_batchnorm_is_audited_as_the_client_ran_it() -> None:
    assert not _build("mixed").net.bn.training  # the default: eval mode, running statistics
    model = build_model(MIXED, "cifar10", 0.25, seed=0, batchnorm_mode="train")
    assert model.net.bn.training  # left to the model's mode: batch statistics in the clients' rounds
    reason = PerJobGradients.check(model)
    assert reason is not None and "couples the images" in reason
    for prm in model.parameters():
        prm.requires_grad_(False)
    B = 2
    g = torch.Generator().manual_seed(2)
    x = torch.randn(B, 3, 32, 32, generator=g).requires_grad_(True)
    y = torch.randint(0, 10, (B,), generator=g)
    targets = [torch.randn(1, *prm.shape, generator=g) for prm in model.parameters()]
    weights = {k: v.detach() for k, v in model.state_dict().items()}
    matcher = Matcher([VictimJob("j0", model.spec, weights, [t[0] for t in targets], y)], model)
    assert matcher.ghost is None
    set_dropout_mode(model, "off")
    terms = matcher.terms(x, [0], [])
    ref_dot, ref_norm2 = _plain(model, x, y, [], targets, 1)  # the batch's statistics, as the client's step
    _close(terms.dot, ref_dot)
    _close(terms.norm2, ref_norm2)
    assert set(matcher.gradient_paths().values()) == {"one-job autograd"}
    with pytest.raises(Exception, match="batchnorm_mode of .* must be one of"):
        build_model(MIXED, "cifar10", 0.25, batchnorm_mode="frozen")


def test_attacker_runs_train_mode_batchnorm_and_refuses_b1_in_one_line(tmp_path, capsys, monkeypatch) -> None:
    import json

    from attacker.cli import main as attacker_main

    from .conftest import ROOT

    monkeypatch.chdir(ROOT)
    common = ["run", "--dataset", "cifar10", "--p", "0.25", "--attacks", "dia", "--iterations", "2", "--no-lpips"]
    options = ["--model-options", '{"batchnorm_mode": "train"}', "--quiet"]
    out = tmp_path / "ok"
    args = [*common, "--model", MIXED, *options, "--victims", "2", "--victim-batch-size", "2", "--out", str(out)]
    assert attacker_main(args) == 0, capsys.readouterr()
    paths = json.loads((out / "gradient_paths.json").read_text())
    assert len(paths) == 1 and all(set(p["layers"].values()) == {"one-job autograd"} for p in paths.values())
    bad = tmp_path / "bad"
    args = [
        *common,
        "--model",
        "timm:resnet18",
        *options,
        "--victims",
        "1",
        "--victim-batch-size",
        "1",
        "--out",
        str(bad),
    ]
    assert attacker_main(args) == 2
    text = capsys.readouterr()
    assert "B = 1" in text.out + text.err and not bad.exists()
