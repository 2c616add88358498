"""The one dropout layer: every mode, in train and eval mode, and the model-level API."""

import pytest
import torch
from torch import nn

from fedsim.models import (
    DropoutMode,
    MaskedDropout,
    build_model,
    dropout_layers,
    get_recorded_masks,
    mask_shapes,
    set_dropout_mode,
    set_masks,
)
from fedsim.models.dropout import call_layers, mask_rates


def _grads(model, x, y):
    loss = nn.functional.cross_entropy(model(x), y)
    return torch.autograd.grad(loss, list(model.parameters()))


@pytest.mark.parametrize("name,dataset", [("mlp", "mnist"), ("vit", "mnist"), ("lenet", "mnist")])
@pytest.mark.parametrize("train_mode", [True, False])
def test_replay_reproduces_recorded_pass_exactly(name, dataset, train_mode):
    model = build_model(name, dataset, 0.5, seed=1).train(train_mode)
    x = torch.randn(2, *model.spec.input_shape)
    y = torch.tensor([3, 7])
    set_dropout_mode(model, "record")
    out_rec = model(x)
    grads_rec = _grads_from(model, out_rec, y)
    masks = get_recorded_masks(model)
    assert all(m.shape[0] == 2 for m in masks), "batch dimension is kept in the mask"
    assert any((m == 0).any() for m in masks)
    set_masks(model, masks)
    set_dropout_mode(model, "replay")
    out_rep = model(x)
    grads_rep = _grads_from(model, out_rep, y)
    assert torch.equal(out_rec, out_rep)
    for a, b in zip(grads_rec, grads_rep):
        assert torch.equal(a, b)


def _grads_from(model, out, y):
    loss = nn.functional.cross_entropy(out, y)
    return torch.autograd.grad(loss, list(model.parameters()))


def test_learn_with_binary_mask_equals_replay_and_receives_gradients():
    model = build_model("mlp", "mnist", 0.25, seed=0)
    x = torch.randn(3, 1, 28, 28)
    y = torch.tensor([0, 1, 2])
    set_dropout_mode(model, "record")
    model(x)
    masks = get_recorded_masks(model)
    set_masks(model, masks)
    set_dropout_mode(model, "replay")
    out_replay = model(x)
    learned = [m.clone().requires_grad_(True) for m in masks]
    set_masks(model, learned)
    set_dropout_mode(model, "learn")
    out_learn = model(x)
    assert torch.equal(out_replay, out_learn)
    loss = nn.functional.cross_entropy(out_learn, y)
    mask_grads = torch.autograd.grad(loss, learned)
    assert all(g.shape == m.shape for g, m in zip(mask_grads, learned))
    assert all(g.abs().sum() > 0 for g in mask_grads)


def test_learn_mask_gets_second_order_gradients():
    # DIA differentiates a gradient-matching loss w.r.t. the masks: the double backward must reach them.
    model = build_model("mlp", "mnist", 0.25, seed=0)
    x = torch.randn(1, 1, 28, 28, requires_grad=True)
    mask_shapes = [torch.Size([1, 512])] * 3
    masks = [torch.full(s, 0.75, requires_grad=True) for s in mask_shapes]
    set_masks(model, masks)
    set_dropout_mode(model, "learn")
    loss = nn.functional.cross_entropy(model(x), torch.tensor([4]))
    grads = torch.autograd.grad(loss, list(model.parameters()), create_graph=True)
    dist = sum((g**2).sum() for g in grads)
    dx, *dmasks = torch.autograd.grad(dist, [x, *masks])
    assert dx.abs().sum() > 0
    assert all(d.abs().sum() > 0 for d in dmasks)


@pytest.mark.parametrize("train_mode", [True, False])
def test_off_equals_nn_dropout_in_eval(train_mode):
    layer = MaskedDropout(0.5).train(train_mode)
    layer.mode = DropoutMode.OFF
    ref = nn.Dropout(0.5).eval()
    x = torch.randn(4, 10)
    assert torch.equal(layer(x), ref(x))


def test_auto_mode_follows_train_and_eval_like_nn_dropout():
    layer = MaskedDropout(0.5)
    x = torch.ones(1000)
    layer.train()
    out = layer(x)
    assert set(out.unique().tolist()) <= {0.0, 2.0}
    assert 0.35 < (out == 0).float().mean() < 0.65
    layer.eval()
    assert torch.equal(layer(x), x)


@pytest.mark.parametrize("train_mode", [True, False])
def test_sample_mode_scales_by_inverse_keep_probability(train_mode):
    layer = MaskedDropout(0.25).train(train_mode)
    layer.mode = DropoutMode.SAMPLE
    out = layer(torch.ones(20000))
    kept = out[out != 0]
    assert torch.allclose(kept, torch.full_like(kept, 4 / 3))
    assert abs((out == 0).float().mean().item() - 0.25) < 0.02


def test_replay_scales_like_sample():
    layer = MaskedDropout(0.5)
    layer.mode = DropoutMode.REPLAY
    set_masks(layer, [torch.tensor([1.0, 0.0, 1.0])])  # a layer alone is a model of one dropout call
    assert torch.equal(layer(torch.tensor([1.0, 2.0, 3.0])), torch.tensor([2.0, 0.0, 6.0]))


def test_mask_errors_are_clear():
    layer = MaskedDropout(0.5)
    layer.mode = DropoutMode.REPLAY
    with pytest.raises(RuntimeError, match="no mask"):
        layer(torch.ones(3))
    set_masks(layer, [torch.ones(4)])
    with pytest.raises(ValueError, match="does not match"):
        layer(torch.ones(3))
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
        MaskedDropout(1.0)
    model = build_model("mlp", "mnist", 0.5)
    with pytest.raises(ValueError, match="3 dropout layers"):
        set_masks(model, [torch.ones(1, 512)])


def test_layer_order_is_forward_order_for_vit():
    model = build_model("vit", "cifar10", 0.1)
    names = [n for n, m in model.named_modules() if isinstance(m, MaskedDropout)]
    assert names[0] == "emb_drop"
    assert names[1:6] == [
        "blocks.0.attn.attn_drop",
        "blocks.0.attn.proj_drop",
        "blocks.0.ff.drop1",
        "blocks.0.ff.drop2",
        "blocks.1.attn.attn_drop",
    ]
    assert len(dropout_layers(model)) == 1 + 4 * 4


# -- a layer called more than once per pass: one mask per call, in call order -----------------------


class Reused(nn.Module):
    """Runs ``drop`` twice, with ``other`` between its two calls: three masks, (B, 6), (B, 5), (B, 4)."""

    def __init__(self, p: float = 0.5) -> None:
        super().__init__()
        self.drop, self.other = MaskedDropout(p), MaskedDropout(p)
        self.a, self.b, self.c = nn.Linear(6, 5), nn.Linear(5, 4), nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(self.drop(x)))
        h = torch.tanh(self.b(self.other(h)))
        return self.c(self.drop(h))


def test_a_layer_run_twice_records_and_replays_a_mask_per_call_in_call_order():
    torch.manual_seed(0)
    model = Reused()
    x, y = torch.randn(3, 6), torch.tensor([0, 2, 1])
    assert dropout_layers(model) == [model.drop, model.other]
    assert mask_shapes(model, x) == [torch.Size([3, 6]), torch.Size([3, 5]), torch.Size([3, 4])]
    assert call_layers(model) == [model.drop, model.other, model.drop]
    assert mask_rates(model, 0.5, 6) == [0.5] * 6
    set_dropout_mode(model, "record")
    out = model(x)
    grads = _grads_from(model, out, y)
    masks = get_recorded_masks(model)
    assert [m.shape for m in masks] == mask_shapes(model, x)
    assert all(0 < float(m.mean()) < 1 for m in masks)  # each call drew its own mask
    set_masks(model, masks)
    set_dropout_mode(model, "replay")
    for _ in range(2):  # the next pass starts again at the first call
        again = model(x)
        assert torch.equal(again, out)
        for a, b in zip(grads, _grads_from(model, again, y), strict=True):
            assert torch.equal(a, b)
    # the same masks in another order do not fit the calls: refused, not silently reused
    set_masks(model, masks[::-1])
    with pytest.raises(ValueError, match=r"does not match .*dropout call 1"):
        model(x)
    with pytest.raises(ValueError, match="makes 3 dropout calls per pass, got 2 masks"):
        set_masks(model, masks[:2])


def test_a_layer_run_twice_learns_a_mask_per_call_equal_to_replay():
    torch.manual_seed(1)
    model = Reused()
    x, y = torch.randn(2, 6), torch.tensor([1, 0])
    set_dropout_mode(model, "record")
    model(x)
    masks = get_recorded_masks(model)
    set_masks(model, masks)
    set_dropout_mode(model, "replay")
    replayed = model(x)
    learned = [m.clone().requires_grad_(True) for m in masks]
    set_masks(model, learned)
    set_dropout_mode(model, "learn")
    out = model(x)
    assert torch.equal(out, replayed)
    grads = torch.autograd.grad(nn.functional.cross_entropy(out, y), learned)
    assert all(float(g.abs().sum()) > 0 for g in grads)  # both calls of ``drop`` reach their own mask
