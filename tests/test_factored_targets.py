"""Factored low-rank targets: exact factors, and the factored path equal to the dense one (loss and
its gradient w.r.t. the dummy images and the learned masks) for every batched model."""

import pytest
import torch
import torch.nn.functional as F

from attacker.engine.gradients import FACTOR_RTOL, PerJobGradients, factor_targets
from attacker.engine.objectives import cosine_distance
from fedsim.models import build_model, mask_shapes, set_dropout_mode, set_masks


def test_factors_are_exact_and_cut_at_the_rank():
    g = torch.Generator().manual_seed(0)
    ranks = [1, 3, 7, 0]
    target = torch.stack([torch.randn(40, r, generator=g) @ torch.randn(r, 30, generator=g) for r in ranks])
    left, right = factor_targets(target, max_rank=10)
    assert left.shape == (4, 40, 7) and right.shape == (4, 30, 7)  # padded to the largest rank
    recon = left @ right.transpose(1, 2)
    err = (recon - target).flatten(1).norm(dim=1) / target.flatten(1).norm(dim=1).clamp_min(1e-30)
    assert err.max() < FACTOR_RTOL
    assert recon[3].abs().max() == 0  # a zero target stays zero
    assert left.dtype == target.dtype and left.device == target.device
    target64 = torch.stack(
        [
            torch.randn(40, r, generator=g, dtype=torch.float64) @ torch.randn(r, 30, generator=g, dtype=torch.float64)
            for r in ranks
        ]
    )
    left64, right64 = factor_targets(target64, max_rank=10)  # float64 in, float64 out, rank cut as well
    assert left64.dtype == torch.float64 and left64.shape == (4, 40, 7)
    assert (left64 @ right64.transpose(1, 2) - target64).abs().max() < 1e-10 * target64.abs().max()


def test_full_rank_and_non_finite_targets_stay_dense():
    target = torch.randn(2, 40, 30, generator=torch.Generator().manual_seed(1))
    assert factor_targets(target, max_rank=10) is None
    low = target[:, :, :1] @ target[:, :1, :]
    assert factor_targets(low, max_rank=10) is not None
    low[1, 0, 0] = float("nan")
    assert factor_targets(low, max_rank=10) is None


def _one_step_targets(model, images, labels, masks, V):
    """Real captured gradients: one client step per job (low rank, as in an attack)."""
    params = list(model.parameters())
    for p in params:
        p.requires_grad_(True)
    per_job = []
    B = images.shape[0] // V
    for j in range(V):
        rows = slice(j * B, (j + 1) * B)
        if masks:
            set_masks(model, [m[rows] for m in masks])
        loss = F.cross_entropy(model(images[rows]), labels[rows])
        per_job.append(torch.autograd.grad(loss, params))
    for p in params:
        p.requires_grad_(False)
    return [torch.stack(t) for t in zip(*per_job)]


@pytest.mark.parametrize(
    "name,dataset,B",
    [("mlp", "mnist", 1), ("mlp", "mnist", 2), ("vit", "mnist", 1), ("lenet", "mnist", 1), ("resnet18", "cifar10", 1)],
)
def test_factored_path_equals_dense_path(name, dataset, B):
    torch.manual_seed(0)
    model = build_model(name, dataset, 0.25, seed=0, **({"depth": 1} if name == "vit" else {}))
    for p in model.parameters():
        p.requires_grad_(False)
    V = 3
    set_dropout_mode(model, "learn")
    shapes = mask_shapes(model, torch.zeros(V * B, *model.spec.input_shape))
    client_masks = [torch.bernoulli(torch.full(s, 0.75)) for s in shapes]
    targets = _one_step_targets(
        model, torch.randn(V * B, *model.spec.input_shape), torch.randint(0, 10, (V * B,)), client_masks, V
    )
    x0 = torch.randn(V * B, *model.spec.input_shape)
    y = torch.randint(0, 10, (V * B,))
    masks0 = [torch.rand(s) for s in shapes]

    def loss_and_grads(factored):
        ghost = PerJobGradients(model)
        ghost.factored = factored
        ghost.set_targets(targets)
        x = x0.clone().requires_grad_(True)
        masks = [m.clone().requires_grad_(True) for m in masks0]
        set_masks(model, masks)
        loss = cosine_distance(ghost.compute(x, y, V))
        grads = torch.autograd.grad(loss.sum(), [x, *masks])
        return ghost, loss.detach(), grads

    dense_ghost, dense_loss, dense_grads = loss_and_grads(False)
    ghost, loss, grads = loss_and_grads(True)
    assert not dense_ghost.factored_layers() and not dense_ghost.used_factors
    assert ghost.used_factors, "no layer took the factored path"
    torch.testing.assert_close(loss, dense_loss, rtol=1e-5, atol=1e-6)
    for got, want in zip(grads, dense_grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())


def test_fewer_jobs_select_rows_of_the_cached_factors():
    model = build_model("mlp", "mnist", 0.0, seed=0)
    for p in model.parameters():
        p.requires_grad_(False)
    V = 4
    targets = _one_step_targets(model, torch.randn(V, 1, 28, 28), torch.arange(V), [], V)
    ghost = PerJobGradients(model)
    ghost.set_targets(targets)
    cached = ghost._all_factors
    jobs = torch.tensor([0, 2])
    ghost.set_targets(targets, jobs=jobs)
    assert ghost._all_factors is cached  # not factored again
    assert ghost.targets[0].shape[0] == 2
    x = torch.randn(2, 1, 28, 28, requires_grad=True)
    y = torch.tensor([0, 2])
    fresh = PerJobGradients(model)
    fresh.set_targets([t.index_select(0, jobs) for t in targets])
    torch.testing.assert_close(ghost.compute(x, y, 2).dot, fresh.compute(x, y, 2).dot)


@pytest.mark.parametrize("m,p", [(1, 1), (1, 3), (3, 1), (2, 2), (1, 5), (4, 4)])
def test_small_products_equal_bmm_with_their_gradients(m, p):
    """layer_terms.bmm takes tiny per-job products (B = 1, rank-1 targets) elementwise: the same values
    and gradients as a bmm, up to float rounding."""
    from attacker.engine.layer_terms import bmm

    g = torch.Generator().manual_seed(m * 10 + p)
    x = torch.randn(6, m, 50, generator=g, requires_grad=True)
    y = torch.randn(6, 50, p, generator=g, requires_grad=True)
    probe = torch.randn(6, m, p, generator=g)
    got = bmm(x, y)
    want = x @ y
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for a, b in zip(
        torch.autograd.grad((got * probe).sum(), [x, y]), torch.autograd.grad((want * probe).sum(), [x, y])
    ):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
