"""Your own model (fedsim/models/own/): ``module.path:factory`` and ``timm:NAME`` resolve through the
model table to its generic entries, their dropout (modules and timm's functional F.dropout) is
recorded and replayed like the built-in models', the attack engine's per-job terms equal plain
autograd on them (all batched by the engine's per-layer hybrid: eval-mode BatchNorm and timm's ViT
too, see tests/test_hybrid_terms.py), the
attacker and the federation run on the example CNN, and bad models are one line, exit 2."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from attacker.cli import main as attacker_main
from attacker.engine.gradients import PerJobGradients
from attacker.engine.matching import Matcher
from attacker.jobs import VictimJob
from attacker.profiles import GENERIC, PROFILES, profile_settings
from fedsim.models import (
    MODELS,
    MaskedDropout,
    ModelSpecError,
    build_model,
    dropout_layers,
    get_recorded_masks,
    mask_shapes,
    model_family,
    set_dropout_mode,
    set_masks,
)
from fedsim.models.own import CALLABLE_KEY, TIMM_KEY, TRUSTED_FACTORIES_ENV, TWICE_DIFFERENTIABLE, ExactActivation

from .conftest import ROOT

CNN = "examples.own_model:small_cnn"
# name, options, whether the engine batches its jobs (else: one job at a time by autograd)
CASES = {
    "cnn": (CNN, {}, True),
    "timm_resnet18": ("timm:resnet18", {}, True),  # BatchNorm (eval mode), functional head dropout
    "timm_vit": ("timm:vit_tiny_patch16_224", {"img_size": 32, "patch_size": 4, "depth": 2}, True),
    "torchvision_squeezenet": ("torchvision.models:squeezenet1_1", {"dropout": 0.25}, True),
    # nn.Hardsigmoid in its squeeze-excite gates (swapped for its exact equivalent), BatchNorm, head F.dropout
    "timm_mobilenetv3": ("timm:mobilenetv3_small_050", {}, True),
    # one nn.Dropout run twice in a pass (on the input, then on the hidden features): a mask per call
    "dropout_twice": ("tests.test_own_models:DropoutTwice", {}, True),
    # timm's distilled DeiT runs its head_drop on both heads' tokens: two masks of one layer
    "timm_deit_distilled": (
        "timm:deit_tiny_distilled_patch16_224",
        {"img_size": 32, "patch_size": 8, "depth": 1, "embed_dim": 48},
        True,
    ),
}


@pytest.fixture(autouse=True)
def _trusted(monkeypatch: pytest.MonkeyPatch) -> None:
    """The factories these tests build directly count as named by the user (fedsim.models.own); the
    variable is restored after each test, whatever a CLI call added to it."""
    names = [CNN, "torchvision.models:squeezenet1_1", "tests.test_own_models:OutOfOrder"]
    names += ["tests.test_own_models:InPlaceConv", "tests.test_own_models:FunctionalHardsigmoid"]
    names += ["tests.test_own_models:DropoutTwice"]
    monkeypatch.setenv(TRUSTED_FACTORIES_ENV, ",".join(names))


def _build(case: str, p: float = 0.25) -> nn.Module:
    name, options, _ = CASES[case]
    return build_model(name, "cifar10", p, seed=0, **options)


# -- models the tests use by name (tests.test_own_models:...) ---------------------------------------


def raising_factory(num_classes: int = 10) -> nn.Module:
    raise RuntimeError("the factory fails\nwith a second line")


def wrong_classes() -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Dropout(0.25), nn.Linear(3 * 32 * 32, 7))


class TrainModeBatchNorm(nn.Module):
    """track_running_stats=False: batch statistics even in eval mode."""

    def __init__(self, num_classes: int = 10, p: float = 0.25) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4, track_running_stats=False)
        self.drop, self.fc = nn.Dropout(p), nn.Linear(4, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.drop(self.bn(self.conv(x)).mean((2, 3))))


class InPlaceConv(nn.Module):
    """Changes Conv2d and Linear outputs in place: the engine copies what it keeps and reruns the pass."""

    def __init__(self, num_classes: int = 10, p: float = 0.25) -> None:
        super().__init__()
        self.conv, self.hidden = nn.Conv2d(3, 4, 3, stride=4), nn.Linear(4 * 8 * 8, 6)
        self.drop, self.fc = nn.Dropout(p), nn.Linear(6, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv(x)
        x += 1
        x.relu_()
        h = self.hidden(x.flatten(1))
        F.relu_(h)
        return self.fc(self.drop(h))


class OwnDropPath(nn.Module):
    """A stochastic depth of its own (not timm's DropPath module): a draw the attack cannot replay."""

    def __init__(self, num_classes: int = 10, p: float = 0.25) -> None:
        super().__init__()
        self.conv, self.drop, self.fc = nn.Conv2d(3, 4, 3), nn.Dropout(p), nn.Linear(4, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv(x)
        keep = x.new_empty(x.shape[0], 1, 1, 1).bernoulli_(0.9) if self.training else 1.0
        return self.fc(self.drop((x + x * keep).mean((2, 3))))


class DropoutTwice(nn.Module):
    """Runs its one dropout layer twice in a pass: on the input (3072 features), then on the hidden (8)."""

    def __init__(self, num_classes: int = 10, p: float = 0.25) -> None:
        super().__init__()
        self.hidden, self.drop, self.fc = nn.Linear(3 * 32 * 32, 8), nn.Dropout(p), nn.Linear(8, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.drop(self.hidden(self.drop(x.flatten(1)))))


class OutOfOrder(nn.Module):
    """Registers its layers in another order than it runs them: the masks must still come in forward
    order, and the batched per-job terms must still pair each layer with its own input."""

    def __init__(self, num_classes: int = 10, p: float = 0.25) -> None:
        super().__init__()
        self.fc = nn.Linear(6, num_classes)
        self.drop_late = nn.Dropout(p)
        self.hidden = nn.Linear(12, 6)
        self.drop_early = nn.Dropout(p)
        self.conv = nn.Conv2d(3, 3, 3, stride=8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.drop_early(F.relu(self.conv(x)).flatten(1)[:, :12])  # 12 features
        return self.fc(self.drop_late(F.relu(self.hidden(x))))  # 6 features


class FunctionalHardsigmoid(nn.Module):
    """Calls F.hardsigmoid in its forward, once in place: routed to the exact equivalent while it runs."""

    def __init__(self, num_classes: int = 10, p: float = 0.25) -> None:
        super().__init__()
        self.conv, self.drop, self.fc = nn.Conv2d(3, 4, 3, stride=4), nn.Dropout(p), nn.Linear(4, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv(x)
        h = h * F.hardsigmoid(h)
        F.hardsigmoid(h, inplace=True)
        return self.fc(self.drop(h.mean((2, 3))))


# -- resolving and building -------------------------------------------------------------------------


def test_names_resolve_to_the_generic_entries_of_the_one_table() -> None:
    assert model_family(CNN) is MODELS[CALLABLE_KEY]
    assert model_family("torchvision.models:squeezenet1_1") is MODELS[CALLABLE_KEY]
    assert model_family("timm:resnet18") is MODELS[TIMM_KEY]
    for name in (CNN, "timm:resnet18"):
        assert model_family(name).attack_family == GENERIC
        assert profile_settings("paper", name, "cifar10") == PROFILES["paper"][GENERIC]
    for bad in ("transformer", "timm:", "not a:name", ":factory"):
        with pytest.raises(ModelSpecError, match="unknown model"):
            model_family(bad)


@pytest.mark.parametrize("case", list(CASES))
def test_dropout_is_recorded_and_replayed(case: str) -> None:
    model = _build(case)
    x = torch.randn(2, 3, 32, 32)
    layers = dropout_layers(model)
    assert layers and all(layer.p == 0.25 for layer in layers)
    set_dropout_mode(model, "off")
    clean = model(x)
    set_dropout_mode(model, "record")
    out = model(x)
    masks = get_recorded_masks(model)
    assert [m.shape for m in masks] == mask_shapes(model, x)
    assert any(bool((m == 0).any()) for m in masks) and not torch.allclose(out, clean)  # it did drop
    set_masks(model, masks)
    set_dropout_mode(model, "replay")
    assert torch.equal(model(x), out)
    set_masks(model, [m.float() for m in masks])
    set_dropout_mode(model, "learn")  # a learned mask equal to the recorded one equals replay
    torch.testing.assert_close(model(x), out)
    set_dropout_mode(model, "auto")
    model.eval()
    torch.testing.assert_close(model(x), clean)  # eval mode: no dropout


def test_timm_resnet_functional_dropout_is_routed_and_batchnorm_stays_in_eval_mode() -> None:
    model = _build("timm_resnet18")
    # timm's head calls F.dropout: no dropout module in the net, one routed slot before fc (512 features)
    assert model.functional == [0]
    assert not any(isinstance(m, (MaskedDropout, nn.Dropout)) for m in model.net.modules())
    assert mask_shapes(model, torch.zeros(2, 3, 32, 32)) == [torch.Size([2, 512])]
    model.train()
    norms = [m for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
    assert norms and not any(m.training for m in norms)
    assert not any(getattr(m, "inplace", False) for m in model.modules())  # in-place activations off
    # a model without dropout at p = 0 builds, with no mask to learn
    assert dropout_layers(_build("timm_resnet18", p=0.0)) == []


def test_a_dropout_layer_run_twice_is_accepted_with_a_mask_per_call() -> None:
    """Formerly refused: timm's distilled DeiT runs head_drop on its class and its distillation token."""
    model = _build("timm_deit_distilled")
    (head_drop,) = dropout_layers(model)
    assert head_drop is model.net.head_drop
    assert mask_shapes(model, torch.zeros(2, 3, 32, 32)) == [torch.Size([2, 48])] * 2
    model = _build("dropout_twice")
    assert len(dropout_layers(model)) == 1
    assert mask_shapes(model, torch.zeros(2, 3, 32, 32)) == [torch.Size([2, 3 * 32 * 32]), torch.Size([2, 8])]


def test_masks_come_in_forward_order_whatever_the_registration_order() -> None:
    model = build_model("tests.test_own_models:OutOfOrder", "cifar10", 0.25)
    assert [tuple(s) for s in mask_shapes(model, torch.zeros(2, 3, 32, 32))] == [(2, 12), (2, 6)]


def test_the_factory_gets_the_runs_values_it_names() -> None:
    model = build_model(CNN, "mnist", 0.5, width=4)
    assert model.spec.input_shape == (1, 28, 28)
    assert model.net[0].in_channels == 1 and model.net[0].out_channels == 4
    assert model(torch.zeros(1, 1, 28, 28)).shape == (1, 10)
    assert dropout_layers(model)[0].p == 0.5


# -- activations torch cannot differentiate twice --------------------------------------------------


def _second_order_error(act: nn.Module | object) -> str | None:
    """The error of differentiating a gradient through ``act`` a second time, or None."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 4, 3, 3, generator=g).mul(3).requires_grad_(True)
    w = torch.randn(4, 1, 1, generator=g).requires_grad_(True)
    try:
        (gw,) = torch.autograd.grad(act(x * w).sum(), w, create_graph=True)
        torch.autograd.grad(gw.pow(2).sum(), x)
    except RuntimeError as err:
        return str(err)
    return None


def _kinked_inputs(dtype: torch.dtype) -> torch.Tensor:
    """Random values over the activations' range, their kinks (-3, 0, 3, +-6) and each kink's float neighbours."""
    kinks = torch.tensor([-6.0, -3.0, 0.0, 3.0, 6.0], dtype=dtype)
    near = torch.cat([torch.nextafter(kinks, kinks + 1), torch.nextafter(kinks, kinks - 1)])
    rand = torch.randn(20000, generator=torch.Generator().manual_seed(0), dtype=dtype) * 4
    return torch.cat([rand, kinks, near])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("activation", list(TWICE_DIFFERENTIABLE), ids=lambda c: c.__name__)
def test_each_replacement_is_the_activation_exactly(activation: type[nn.Module], dtype: torch.dtype) -> None:
    """Same values bit for bit, the same first gradient (non-zero at the same inputs; its value 1/6 of
    the incoming one, which torch takes times its float 1/6: equal for a unit incoming gradient in
    float32, within rounding otherwise), for the module and each functional spelling, kinks included."""
    exact = TWICE_DIFFERENTIABLE[activation]
    x = _kinked_inputs(dtype)
    upstream = torch.randn(x.shape, generator=torch.Generator().manual_seed(1), dtype=dtype)
    for original in [activation(), *exact.functional]:
        for incoming in (torch.ones_like(x), upstream):
            xa, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
            ya, yb = original(xa), exact.function(xb)
            assert torch.equal(ya, yb)
            (ga,) = torch.autograd.grad(ya, xa, incoming)
            (gb,) = torch.autograd.grad(yb, xb, incoming)
            assert torch.equal(ga != 0, gb != 0)
            if dtype == torch.float32 and incoming is not upstream:
                assert torch.equal(ga, gb)
            torch.testing.assert_close(ga, gb, rtol=1e-6 if dtype == torch.float32 else 1e-7, atol=0)
    # why the entry is there, and that its replacement mends it
    assert "not implemented" in (_second_order_error(activation()) or "")
    assert _second_order_error(ExactActivation(exact.function, activation.__name__)) is None


def test_the_table_holds_only_what_torch_cannot_differentiate_twice() -> None:
    from timm.layers import activations, activations_me

    for act in (nn.Hardswish, activations.HardSigmoid, activations.HardSwish):
        assert act not in TWICE_DIFFERENTIABLE and _second_order_error(act()) is None
    for act in (activations_me.HardSigmoidMe, activations_me.HardSwishMe):
        assert act not in TWICE_DIFFERENTIABLE and _second_order_error(act()) is None


def test_timm_mobilenetv3_builds_with_its_gates_replaced_and_passes_the_model_check() -> None:
    import timm

    from fedsim.models.own import check_timm

    model = _build("timm_mobilenetv3")
    assert not any(isinstance(m, nn.Hardsigmoid) for m in model.modules())
    gates = [m for name, m in model.net.named_modules() if name.endswith(".se.gate")]
    assert len(gates) == 9 and all(isinstance(m, ExactActivation) for m in gates)
    assert check_timm(model.spec) is None  # the second-order check passes
    # the same model as timm builds it, and the same outputs bit for bit (eval mode: no dropout)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        reference = timm.create_model("mobilenetv3_small_050", pretrained=False, num_classes=10, drop_rate=0.25)
    assert all(torch.equal(a, b) for a, b in zip(model.net.state_dict().values(), reference.state_dict().values()))
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    assert torch.equal(model.eval()(x), reference.eval()(x))


def test_functional_hardsigmoid_in_forward_is_routed() -> None:
    from fedsim.models.own import _second_order_problem, check_callable

    name = "tests.test_own_models:FunctionalHardsigmoid"
    model = build_model(name, "cifar10", 0.25)
    assert model.exact_calls and check_callable(model.spec) is None
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        reference = FunctionalHardsigmoid()
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    assert torch.equal(model.eval()(x), reference.eval()(x))  # the in-place call too
    assert _second_order_problem(model, model.spec) is None
    model.exact_calls = False  # not routed: torch's own hardsigmoid, which the check refuses
    assert "hardsigmoid_backward is not implemented" in (_second_order_problem(model, model.spec) or "")


# -- the engine's per-job terms against plain autograd ------------------------------------------------


def _plain_terms(model, x, y, masks, targets, V):
    """Per job, by plain autograd: <g_j, t_j> and ||g_j||^2 per parameter, g_j the job's gradient."""
    params = list(model.parameters())
    for prm in params:
        prm.requires_grad_(True)
    B = x.shape[0] // V
    dots, norms = [], []
    for j in range(V):
        rows = slice(j * B, (j + 1) * B)
        set_masks(model, [m[rows] for m in masks])
        grads = torch.autograd.grad(F.cross_entropy(model(x[rows]), y[rows]), params, create_graph=True)
        dots.append(torch.stack([(g * t[j]).sum() for g, t in zip(grads, targets)]))
        norms.append(torch.stack([g.pow(2).sum() for g in grads]))
    for prm in params:
        prm.requires_grad_(False)
    return torch.stack(dots, 1), torch.stack(norms, 1)


def _engine_terms(model, spec, x, y, masks, targets, V, batched):
    """The terms as the attack engine computes them: one Matcher for V jobs on the batched path, else
    one Matcher per job (the runner's single-job groups)."""
    B = x.shape[0] // V
    weights = {k: v.detach() for k, v in model.state_dict().items()}
    jobs = [VictimJob(f"j{j}", spec, weights, [t[j] for t in targets], y[j * B : (j + 1) * B]) for j in range(V)]
    if batched:
        set_masks(model, masks)
        terms = Matcher(jobs, model).terms(x, list(range(V)), [])
        return terms.dot, terms.norm2
    dots, norms = [], []
    for j, job in enumerate(jobs):
        rows = slice(j * B, (j + 1) * B)
        set_masks(model, [m[rows] for m in masks])
        terms = Matcher([job], model).terms(x[rows], [0], [])
        dots.append(terms.dot)
        norms.append(terms.norm2)
    return torch.cat(dots, 1), torch.cat(norms, 1)


@pytest.mark.parametrize("case", [*CASES, "out_of_order", "in_place"])
def test_engine_terms_equal_plain_autograd(case: str) -> None:
    if case == "out_of_order":
        model, batched = build_model("tests.test_own_models:OutOfOrder", "cifar10", 0.25), True
    elif case == "in_place":  # Conv2d and Linear outputs changed in place (x += 1, relu_): no longer refused
        model, batched = build_model("tests.test_own_models:InPlaceConv", "cifar10", 0.25), True
    else:
        model, batched = _build(case), CASES[case][2]
    assert (PerJobGradients.check(model) is None) == batched
    for prm in model.parameters():
        prm.requires_grad_(False)
    V, B = 2, 2
    g = torch.Generator().manual_seed(0)
    x = torch.randn(V * B, 3, 32, 32, generator=g).requires_grad_(True)
    y = torch.randint(0, 10, (V * B,), generator=g)
    masks = [torch.rand(s, generator=g).requires_grad_(True) for s in mask_shapes(model, x.detach())]
    set_dropout_mode(model, "learn")  # DIA's masks: real-valued, with gradients
    targets = [torch.randn(V, *prm.shape, generator=g) for prm in model.parameters()]

    dot, norm2 = _engine_terms(model, model.spec, x, y, masks, targets, V, batched)
    ref_dot, ref_norm2 = _plain_terms(model, x, y, masks, targets, V)
    torch.testing.assert_close(dot, ref_dot, rtol=1e-4, atol=1e-4 * ref_dot.abs().max().item())
    torch.testing.assert_close(norm2, ref_norm2, rtol=1e-4, atol=1e-4 * ref_norm2.abs().max().item())
    # and what the attack steps on: the gradient of the match terms w.r.t. the images and masks
    grads = torch.autograd.grad(dot.sum() - norm2.sum(), [x, *masks])
    ref_grads = torch.autograd.grad(ref_dot.sum() - ref_norm2.sum(), [x, *masks])
    for got, ref in zip(grads, ref_grads):
        torch.testing.assert_close(got, ref, rtol=1e-3, atol=1e-4 * ref.abs().max().item())


# -- the command lines ---------------------------------------------------------------------------------


def _attacker(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = attacker_main(args)
    out = capsys.readouterr()
    return code, out.out + out.err


def test_attacker_run_on_the_example_cnn(tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch) -> None:
    monkeypatch.chdir(ROOT)  # `examples` imports from the working folder, as with python -m
    out = tmp_path / "run"
    args = ["run", "--model", CNN, "--dataset", "cifar10", "--p", "0.25", "--victims", "2"]
    code, text = _attacker(
        [*args, "--attacks", "ig_eval", "dia", "--iterations", "5", "--no-lpips", "--quiet", "--out", str(out)], capsys
    )
    assert code == 0, text
    rows = json.loads((out / "metrics.json").read_text())
    assert {(r["attack"], r["model"]) for r in rows} == {("ig_eval", CNN), ("dia", CNN)}
    assert all(r["iterations"] == 5 for r in rows)


@pytest.mark.parametrize(
    "model,options,message",
    [
        ("nosuch_pkg.models:net", None, "cannot import nosuch_pkg.models (ModuleNotFoundError"),
        ("examples.own_model:no_such_factory", None, "has no attribute 'no_such_factory'"),
        ("tests.test_own_models:raising_factory", None, "raised RuntimeError: the factory fails"),
        ("tests.test_own_models:wrong_classes", None, "returns shape (2, 7) for 2 images, not (2, 10)"),
        ("timm:resnet18x", None, "unknown timm model 'resnet18x'; did you mean resnet18"),
        ("tests.test_own_models:OwnDropPath", None, "a random draw (bernoulli_) outside dropout and timm's DropPath"),
        ("timm:resnet18", '{"pretrained": true}', "are set by the run"),
        ("tests.test_own_models:TrainModeBatchNorm", None, "train-mode BatchNorm"),
        ("torchvision.models:squeezenet1_1", None, "has p = 0.5, the run's p is 0.25"),
        (CNN, '{"p": 0.5}', "come from the run"),
        (CNN, "{width: 3}", "model-options must be a JSON object"),
    ],
)
def test_bad_models_are_one_line_and_write_nothing(
    model: str, options: str | None, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch
) -> None:
    monkeypatch.chdir(ROOT)
    out = tmp_path / "run"
    args = [
        "run",
        "--model",
        model,
        "--dataset",
        "cifar10",
        "--p",
        "0.25",
        "--victims",
        "2",
        "--quiet",
        "--out",
        str(out),
    ]
    code, text = _attacker([*args, *(["--model-options", options] if options else [])], capsys)
    assert code == 2, text
    assert message in text and "Traceback" not in text
    assert len(text.strip().splitlines()) == 1, text
    assert not out.exists()


def test_federation_rejects_a_bad_model_before_writing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from fedsim.cli import main as fedsim_main

    run_dir = tmp_path / "fed"
    code = fedsim_main(
        ["simulate", "--model", "timm:resnet18x", "--dataset", "cifar10", "--no-download", "--run-dir", str(run_dir)]
    )
    assert code == 2 and "unknown timm model" in capsys.readouterr().out
    assert not run_dir.exists()


def test_federation_and_attack_on_the_example_cnn(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch
) -> None:
    """A one-round federation trains the example CNN (the ClientApp builds it by name from the working
    folder), the curious server captures a one-step round with the oracle, and the attacker attacks the
    captures (WIIG with the recorded masks). The federation runs on the in-process grid
    (flower_harness): Ray workers building an own model from the working folder is
    tests/test_commands.py's sweep."""
    from flower_harness import run_in_process

    monkeypatch.chdir(ROOT)
    run_dir = run_in_process(
        {
            "model": CNN,
            "dataset": "cifar10",
            "p": 0.25,
            "num-clients": 2,
            "num-server-rounds": 1,
            "local-steps": 1,
            "capture-rounds": "1",
            "audit": True,
            "download": False,
            "data-root": str(tmp_path / "data"),
            "run-dir": str(tmp_path / "fed"),
        },
    )
    assert len(list((run_dir / "captures").iterdir())) == 2
    out = tmp_path / "attack"
    args = ["run", "--captures", str(run_dir), "--attacks", "wiig", "dia", "--iterations", "2", "--no-lpips"]
    # A capture names its model; a Python factory named by a capture (data, not the user) is not imported.
    monkeypatch.setenv(TRUSTED_FACTORIES_ENV, "")
    code, text = _attacker([*args, "--quiet", "--out", str(tmp_path / "refused")], capsys)
    assert code == 2 and f"name it yourself with --model {CNN}" in text and not (tmp_path / "refused").exists()
    code, text = _attacker([*args, "--model", CNN, "--quiet", "--out", str(out)], capsys)
    assert code == 0, text
    rows = json.loads((out / "metrics.json").read_text())
    assert len(rows) == 4 and {r["model"] for r in rows} == {CNN}


def test_a_factory_not_named_by_the_user_is_not_imported(monkeypatch: pytest.MonkeyPatch) -> None:
    # e.g. a server's round config sending model="os:system" to a SuperNode, or a downloaded capture
    monkeypatch.setenv(TRUSTED_FACTORIES_ENV, CNN)
    with pytest.raises(ModelSpecError, match="importing it runs its code: name it yourself with --model os:system"):
        build_model("os:system", "cifar10", 0.25, command="true")


def test_trust_is_asked_on_every_check_not_cached(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check's cache holds what a build gives, never a refusal for want of trust: a name the
    user trusts after a first check (a CLI trusting --model) builds."""
    from fedsim.models import ModelSpec
    from fedsim.models.own import check_callable, trust_factory

    spec = ModelSpec("tests.test_own_models:wrong_classes", "cifar10", 0.25)
    monkeypatch.setenv(TRUSTED_FACTORIES_ENV, "")
    assert "name it yourself with --model tests.test_own_models:wrong_classes" in (check_callable(spec) or "")
    trust_factory(spec.name)
    assert "returns shape (2, 7) for 2 images" in (check_callable(spec) or "")


def test_wiig_objective_is_zero_at_the_truth_on_the_distilled_deit() -> None:
    """The client's two head_drop masks, replayed at their calls by WIIG's engine, give the captured
    gradient itself: its gradient distance at the true image is 0 (float rounding), and it is not
    with the two masks swapped or with dropout off."""
    from attacker.attacks import make_attack
    from attacker.engine.inversion import InversionModule
    from attacker.jobs import jobs_from_images

    spec = _build("timm_deit_distilled").spec
    g = torch.Generator().manual_seed(0)
    jobs, oracles = jobs_from_images(spec, [(torch.rand(1, 3, 32, 32, generator=g), torch.tensor([3]))])
    assert len(oracles[0].masks) == 2 and not torch.equal(*oracles[0].masks)
    module = InversionModule(jobs, [make_attack("wiig", tv_weight=0.0)], oracles)
    with torch.no_grad():
        module.unknowns.image_stack.copy_(oracles[0].images.unsqueeze(0))
    at_truth = float(module.job_losses([0])[0].detach())
    assert at_truth < 1e-6, at_truth
    for masks in (oracles[0].masks[::-1], tuple(torch.full_like(m, 0.75) for m in oracles[0].masks)):
        other = InversionModule(jobs, [make_attack("wiig", tv_weight=0.0)], [replace(oracles[0], masks=masks)])
        with torch.no_grad():
            other.unknowns.image_stack.copy_(oracles[0].images.unsqueeze(0))
        assert float(other.job_losses([0])[0].detach()) > 1e-3
