"""Models, registry, seeding and the paper's Parameters check."""

import json

import pytest
import torch

from fedsim.models import ModelSpec, ModelSpecError, build_model, mask_shapes

# Appendix tables: values the attacker optimizes per victim batch (pixels + mask entries).
PARAMETERS_CHECK = [
    ("mlp", "mnist", {}, 1, 784, 2320),
    ("mlp", "mnist", {}, 4, 4 * 784, 9280),
    ("mlp", "mnist", {}, 16, 16 * 784, 37120),
    ("mlp", "cifar10", {}, 1, 3072, 4608),
    ("vit", "mnist", {}, 1, 784, 327184),
    ("vit", "mnist", {}, 4, 4 * 784, 4 * 327184),
    ("vit", "mnist", {}, 16, 16 * 784, 5234944),
    ("vit", "cifar10", {}, 1, 3072, 489792),
    ("vit", "cifar10", {}, 4, 4 * 3072, 4 * 489792),
    ("vit", "cifar10", {}, 16, 16 * 3072, 7836672),
    ("lenet", "mnist", {}, 1, 2352, 2940),
    ("lenet", "cifar10", {}, 1, 3072, 3840),
    ("resnet18", "mnist", {"norm": "group"}, 1, 2352, 2864),
    ("resnet18", "mnist", {"norm": "batch"}, 1, 2352, 2864),
    ("resnet18", "cifar10", {"norm": "group"}, 1, 3072, 3584),
    ("resnet18", "cifar10", {"norm": "batch"}, 1, 3072, 3584),
    ("vit_b16", "imagenet", {}, 1, 150528, 16783632),
]


@pytest.mark.parametrize("name,dataset,options,batch,pixels,total", PARAMETERS_CHECK)
def test_parameters_check(name, dataset, options, batch, pixels, total):
    model = build_model(name, dataset, 0.25, **options)
    if options.get("norm") == "batch":
        model.eval()  # BatchNorm cannot run a 1-image batch in train mode; shapes are the same
    x = torch.zeros(batch, *model.spec.input_shape)
    assert x.numel() == pixels
    masks = sum(torch.Size(s).numel() for s in mask_shapes(model, x))
    assert x.numel() + masks == total


@pytest.mark.parametrize(
    "name,dataset", [("mlp", "mnist"), ("vit", "cifar10"), ("lenet", "mnist"), ("resnet18", "cifar10")]
)
def test_seeded_initialization_is_reproducible(name, dataset):
    a = build_model(name, dataset, 0.5, seed=3)
    b = build_model(name, dataset, 0.5, seed=3)
    c = build_model(name, dataset, 0.5, seed=4)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert any(not torch.equal(sa[k], sc[k]) for k in sa if sa[k].is_floating_point())


def test_build_does_not_touch_global_rng():
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    build_model("mlp", "mnist", 0.1, seed=9)
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.parametrize(
    "name,dataset,classes",
    [("mlp", "mnist", 10), ("vit", "mnist", 10), ("lenet", "cifar10", 10), ("resnet18", "mnist", 10)],
)
def test_forward_shapes(name, dataset, classes):
    model = build_model(name, dataset, 0.25)
    x = torch.randn(2, *model.spec.input_shape)
    assert model(x).shape == (2, classes)


def test_model_details_follow_protocol():
    mlp = build_model("mlp", "mnist", 0.25)
    assert all(m.bias is None for m in mlp.modules() if isinstance(m, torch.nn.Linear))
    lenet = build_model("lenet", "mnist", 0.25)
    assert lenet.spec.input_shape == (3, 28, 28)
    w = torch.cat([p.flatten() for p in lenet.parameters()])
    assert w.min() >= -0.5 and w.max() <= 0.5 and w.std() > 0.25  # U(-0.5, 0.5)
    gn = build_model("resnet18", "cifar10", 0.25)
    assert any(isinstance(m, torch.nn.GroupNorm) and m.num_groups == 2 for m in gn.modules())
    bn = build_model("resnet18", "cifar10", 0.25, norm="batch")
    assert any(isinstance(m, torch.nn.BatchNorm2d) for m in bn.modules())


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(name="cnn", dataset="mnist", p=0.1), "unknown model"),
        (dict(name="mlp", dataset="svhn", p=0.1), "unknown dataset"),
        (dict(name="mlp", dataset="mnist", p=1.0), r"\[0, 1\)"),
        (dict(name="mlp", dataset="mnist", p=-0.1), r"\[0, 1\)"),
        (dict(name="mlp", dataset="mnist", p=0.1, heads=3), "unknown option"),
        (dict(name="vit_b16", dataset="mnist", p=0.1), "224x224"),
        (dict(name="vit", dataset="mnist", p=0.1, patch_size=5), "does not divide"),
        (dict(name="resnet18", dataset="mnist", p=0.1, norm="layer"), "model option norm of resnet18 must be one of"),
        (dict(name="resnet18", dataset="cifar10", p=0.1, stem="tiny"), "model option stem of resnet18 must be one of"),
    ],
)
def test_bad_specs_give_clear_errors(kwargs, match):
    with pytest.raises((ModelSpecError, ValueError), match=match):
        build_model(kwargs.pop("name"), kwargs.pop("dataset"), kwargs.pop("p"), **kwargs)


def test_spec_round_trip():
    spec = ModelSpec("vit", "cifar10", 0.25, seed=2, options={"depth": 2})
    assert ModelSpec.from_dict(spec.to_dict()) == spec
    with pytest.raises(ModelSpecError, match="unknown model spec keys"):
        ModelSpec.from_dict({**spec.to_dict(), "extra": 1})


def test_a_model_is_one_table_entry(monkeypatch: pytest.MonkeyPatch, tmp_path, capsys) -> None:
    """A new model added only as a `ModelFamily` in `MODELS` (and its attack settings as one profile
    entry): the run config and the attacker take its name, its TV and group cap apply, and a
    one-iteration DIA attack runs on it."""
    from torch import nn

    from attacker.attacks import make_attack
    from attacker.cli import main as attacker_main
    from attacker.engine.objectives import term_weight
    from attacker.profiles import PROFILES
    from fedsim.models import MODELS, MaskedDropout, ModelFamily

    def construct(spec, channels, size, classes, options):
        return nn.Sequential(
            nn.Flatten(),
            nn.Linear(channels * size * size, 16),
            nn.ReLU(),
            MaskedDropout(spec.p),
            nn.Linear(16, classes),
        )

    monkeypatch.setitem(
        MODELS, "toy", ModelFamily("toy", construct, attack_family="toy", group_caps={"cpu": 1, "gpu": 1})
    )
    monkeypatch.setitem(PROFILES["paper"], "toy", {"tv_weight": 0.5})  # its attack settings: one profile entry
    assert term_weight(make_attack("dia"), "tv_weight", "toy") == 0.5
    out = tmp_path / "run"
    code = attacker_main(
        [
            "run",
            "--model",
            "toy",
            "--dataset",
            "mnist",
            "--victims",
            "2",
            "--attacks",
            "dia",
            "--iterations",
            "1",
            "--no-lpips",
            "--quiet",
            "--device",
            "cpu",
            "--out",
            str(out),
        ]
    )
    assert code == 0, capsys.readouterr().out
    rows = json.loads((out / "metrics.json").read_text())
    assert [r["model"] for r in rows] == ["toy", "toy"]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["group000", "group001"]  # its cap: 1 job a group


# -- the ResNet-18's stem (model option ``stem``) ------------------------------------------------------


def _layer1_size(model: torch.nn.Module, x: torch.Tensor) -> tuple[int, int]:
    seen = []
    handle = model.layer1.register_forward_hook(lambda _m, _a, out: seen.append(tuple(out.shape[-2:])))
    try:
        model(x)
    finally:
        handle.remove()
    return seen[0]


@pytest.mark.parametrize("norm", ["group", "batch"])
def test_resnet_cifar_stem_keeps_the_image_size_to_layer1(norm: str) -> None:
    cifar = build_model("resnet18", "cifar10", 0.25, norm=norm, stem="cifar").eval()
    imagenet = build_model("resnet18", "cifar10", 0.25, norm=norm, stem="imagenet").eval()
    x = torch.randn(2, 3, 32, 32)
    assert cifar(x).shape == imagenet(x).shape == (2, 10)
    assert _layer1_size(cifar, x) == (32, 32)
    assert _layer1_size(imagenet, x) == (8, 8)  # 7x7 stride-2 conv, then the stride-2 max-pool
    conv1 = cifar.conv1
    assert (conv1.kernel_size, conv1.stride, conv1.padding, conv1.bias) == ((3, 3), (1, 1), (1, 1), None)
    assert isinstance(cifar.maxpool, torch.nn.Identity)
    # same layers otherwise: only conv1's weight changes shape, and the dropout masks stay one before fc
    shapes = {k: v.shape for k, v in imagenet.state_dict().items()}
    assert {k: v.shape for k, v in cifar.state_dict().items()} == {**shapes, "conv1.weight": (64, 3, 3, 3)}
    assert mask_shapes(cifar, x) == mask_shapes(imagenet, x)
    mnist = build_model("resnet18", "mnist", 0.25, norm=norm, stem="cifar").eval()
    assert mnist(torch.randn(2, *mnist.spec.input_shape)).shape == (2, 10)


def test_resnet_default_stem_is_unchanged() -> None:
    """The default is still torchvision's ImageNet ResNet-18 as built before the option: the same
    parameters at seed 0 as torchvision's resnet18 built directly under that seed."""
    from functools import partial

    from torchvision.models import resnet18

    default = build_model("resnet18", "cifar10", 0.25, seed=0)
    named = build_model("resnet18", "cifar10", 0.25, seed=0, stem="imagenet")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        reference = resnet18(weights=None, num_classes=10, norm_layer=partial(torch.nn.GroupNorm, 2))
    ref = {k.replace("fc.", "fc.1."): v for k, v in reference.state_dict().items()}  # fc sits after the dropout
    for model in (default, named):
        got = model.state_dict()
        assert list(got) == list(ref)
        assert all(torch.equal(got[k], ref[k]) for k in ref)
    assert default.conv1.kernel_size == (7, 7) and isinstance(default.maxpool, torch.nn.MaxPool2d)


def test_a_bad_stem_is_one_line_and_writes_nothing(tmp_path, capsys) -> None:
    from attacker.cli import main as attacker_main

    out = tmp_path / "run"
    args = ["run", "--model", "resnet18", "--dataset", "cifar10", "--p", "0.25", "--victims", "1"]
    code = attacker_main([*args, "--model-options", '{"stem": "tiny"}', "--quiet", "--out", str(out)])
    text = capsys.readouterr()
    text = text.out + text.err
    assert code == 2, text
    assert "model option stem of resnet18 must be one of ('imagenet', 'cifar'), got 'tiny'" in text
    assert len(text.strip().splitlines()) == 1 and not out.exists()
