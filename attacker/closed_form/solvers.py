"""Closed-form attacks: where a one-step gradient gives the input away by linear algebra, in one shot.

One table, ``SOLVERS``: each entry says what structure it needs (found by ``probe``, never by a
name), why it cannot take a batch of several images, and how it solves a job on the server's view
alone (the captured gradient and the model; never the oracle). Adding a solver is one
``@solver(...)`` function here; ``--attacks NAME`` (or ``closed_form``: every one that applies),
experiment files and ``attacker audit`` pick it up.

``last_linear_features`` is a closed form too, but of the classifier's input features, not of the
image: a constraint for the optimization (``objectives``' features term), with no SSIM of its own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from scipy.optimize import minimize, minimize_scalar
from torch import Tensor, nn

from fedsim.data import box_bounds, get_spec

from ..jobs import VictimJob
from .probe import Layer, _Stop, evaluating, first_layer, images_from_rows, last_linear, position_embedding
from .separation import (
    LEVEL_ATOL,
    MASK_RTOL,
    complete_by_smoothness,
    refine_by_zeros,
    same_image,
    separate_by_level,
    snap_to_level,
    unmix,
    zero_tolerance,
)

# A solve claims "exact" only where the linear system it solved holds to this relative residual
# (float32 rounding of the client's own gradient is about 1e-7); pruning or noise leave more.
EXACT_RTOL = 1e-6
NOISE_FACTOR = 10  # a separation's check: exact within this many times the gradients' own rounding (_Mixture)
ROUNDING = 1e-6  # the largest floor taken for float32 rounding rather than noise
# A gradient row whose part in the missing images' dimensions is below this fraction of it holds none of
# them: what is left there is the rounding of the images already solved (next-layer misfit ~4e-7).
FAINT = 1e-4


class NotApplicable(ValueError):
    """The model or the capture lacks what a solver needs; the message says what, in one line."""


@dataclass(frozen=True)
class Solution:
    """One job's closed-form answer: its images (normalized space) and how well the system fixed them."""

    images: Tensor
    rank: int  # the rank of the system's matrix
    unknowns: int  # the rank it needs for a unique answer (patches, or 1 for a rank-one gradient)
    residual: float  # relative residual of the solved linear system
    extra: dict[str, Any] = field(default_factory=dict)
    tolerance: float = EXACT_RTOL  # the residual of an exact answer, at most (raised only to the data's own noise)
    # per image (row of ``images``), whether its own check pinned it down exactly, beside others that may not
    # be (a partial separation): an optimization started from the answer holds these (``hold_certain``)
    certain: tuple[bool, ...] | None = None

    @property
    def exact(self) -> bool:
        return self.rank >= self.unknowns and self.residual <= self.tolerance

    def metrics(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "unknowns": self.unknowns,
            "relative_residual": self.residual,
            "exact": self.exact,
            "exact_tolerance": self.tolerance,
        }


@dataclass(frozen=True)
class Solver:
    name: str
    needs: str  # the structure it needs, in words ("NAME needs ...; MODEL has none")
    mechanism: str  # what gives the image away, in plain words (the audit's verdict)
    batch_reason: str  # why it takes only one image per gradient (a separating solver: none at B = 1)
    find: Callable[[nn.Module, tuple[int, ...], int], Any]  # the structure, or NotApplicable
    solve: Callable[[Any, VictimJob, nn.Module], Solution]
    # True: it separates the images of a batch (B >= 2) rather than solving one image's gradient
    separates: bool = False
    # False: its images come in an order of their own, not the job's labels' (scored by matching alone)
    ordered: bool = True
    # True: a separating solver that takes an update of one image too (no one-image solver takes an update)
    single_updates: bool = False
    # True: it also takes the update of a local round whose steps move the first Linear by outer products
    # (fedsim's ClientOptimizer.lowrank_replay: SGD, with momentum or not): those rows still span the images
    updates: bool = False
    # True: it takes only the update of one image's round of scale-free elementwise steps (Adam: fedsim's
    # ClientOptimizer.scale_free_steps), and neither a gradient nor another optimizer's update
    scale_free_updates: bool = False
    # (structure, job, model, images, held) -> (images, certain): where the solver can tell an image exactly from
    # an optimization's approximation of it (dark_background: the nearest image with a background), the images
    # with those put in and which they are, of those not ``held`` (B,) already; None: it cannot (an
    # optimization holding its images then learns the rest alone)
    snap: Callable[[Any, VictimJob, nn.Module, Tensor, Tensor], tuple[Tensor, Tensor]] | None = None


SOLVERS: dict[str, Solver] = {}


def solver(
    name: str,
    *,
    needs: str,
    mechanism: str,
    batch_reason: str,
    find: Callable[..., Any],
    separates: bool = False,
    ordered: bool = True,
    single_updates: bool = False,
    updates: bool = False,
    scale_free_updates: bool = False,
    snap: Callable[[Any, VictimJob, nn.Module, Tensor, Tensor], tuple[Tensor, Tensor]] | None = None,
):
    def register(fn: Callable[[Any, VictimJob, nn.Module], Solution]) -> Callable[..., Solution]:
        SOLVERS[name] = Solver(
            name,
            needs,
            mechanism,
            batch_reason,
            find,
            fn,
            separates,
            ordered,
            single_updates,
            updates,
            scale_free_updates,
            snap,
        )
        return fn

    return register


def follows_labels(attack: str) -> bool:
    """Whether ``attack``'s images come in the order of the job's labels (every optimization does; a
    separating closed form does not): scoring pairs them to the originals by label only where they do."""
    return attack not in SOLVERS or SOLVERS[attack].ordered


def _grads(job: VictimJob, model: nn.Module) -> dict[str, Tensor]:
    return {n: g.detach().double().cpu() for (n, _), g in zip(model.named_parameters(), job.gradient)}


def _rank(matrix: Tensor) -> int:
    """Numerical rank at the exactness tolerance (singular values above EXACT_RTOL of the largest)."""
    s = torch.linalg.svdvals(matrix)
    return int((s > EXACT_RTOL * s[0]).sum()) if s.numel() and s[0] > 0 else 0


@dataclass(frozen=True)
class _RankOne:
    """The best rank-one fit s u v^T of a matrix, its numerical rank and the fit's relative residual."""

    v: Tensor  # top right singular vector (unit)
    rank: int
    residual: float


def _rank_one(matrix: Tensor) -> _RankOne:
    """Through the Gram matrix of the smaller side (an eigendecomposition of 512x512 rather than an SVD
    of 512x3072: seconds to milliseconds here); the residual is computed on the matrix itself."""
    wide = matrix.shape[0] <= matrix.shape[1]
    gram = matrix @ matrix.T if wide else matrix.T @ matrix
    values, vectors = torch.linalg.eigh(gram)  # ascending
    top = vectors[:, -1]
    if wide:
        v = matrix.T @ top
        v = v / torch.linalg.norm(v).clamp_min(1e-300)
        u = top
    else:
        v = top
        u = matrix @ v
        u = u / torch.linalg.norm(u).clamp_min(1e-300)
    fit = torch.outer(u, matrix.T @ u) if wide else torch.outer(matrix @ v, v)
    lam = values.clamp_min(0)
    rank = int((lam > (EXACT_RTOL**2) * lam[-1]).sum()) if lam[-1] > 0 else 0
    return _RankOne(v, rank, _relative(matrix - fit, matrix))


def _relative(residual: Tensor, target: Tensor) -> float:
    return float(torch.linalg.norm(residual) / torch.linalg.norm(target).clamp_min(1e-300))


# -- (a) the ViT's patches from the position-embedding gradient ---------------------------------------


@dataclass(frozen=True)
class _Patches:
    layer: Layer
    pos: Any  # probe.PositionEmbedding
    input_shape: tuple[int, ...]


def _find_patches(model: nn.Module, input_shape: tuple[int, ...], classes: int) -> _Patches:
    layer = first_layer(model, input_shape)
    if layer is None:
        raise NotApplicable("no Linear or Conv2d layer")
    if layer.pixels is None or layer.tokens < 2:
        raise NotApplicable(f"its first layer, {layer.kind}, is no linear map of separate patches")
    pos = position_embedding(model, layer, input_shape, classes)
    if pos is None:
        raise NotApplicable(
            f"its first layer embeds {layer.tokens} patches, but no parameter is added to every token after it"
        )
    return _Patches(layer, pos, input_shape)


@solver(
    "vit_patches",
    needs="a learned position embedding added after a per-patch linear embedding",
    mechanism=(
        "the position-embedding gradient gives every patch exactly: dropout does not protect this ViT at batch size 1"
    ),
    batch_reason="at B > 1 the position-embedding gradient sums every image's token gradients",
    find=_find_patches,
)
def solve_patches(found: _Patches, job: VictimJob, model: nn.Module) -> Solution:
    """Tokens z_i = W p_i + b + pos_i, so dL/dpos_i = dL/dz_i =: g_i (dropout after the sum is inside
    g_i) and dL/dW = sum_i g_i p_i^T = G^T P: the patches P are the least-squares solution of G^T P = dW,
    unique when G has full row rank (tokens <= embedding width)."""
    grads, pos = _grads(job, model), found.pos
    g = grads[pos.name].reshape(-1, pos.dim)[pos.offset : pos.offset + pos.tokens]  # (tokens, dim)
    dw = grads[found.layer.weight].reshape(pos.dim, -1)  # (dim, entries per patch)
    rows = torch.linalg.lstsq(g.T, dw, driver="gelsd").solution  # minimum norm where G is rank-deficient
    images = images_from_rows(rows[None], found.layer.pixels, found.input_shape)
    return Solution(images, _rank(g), pos.tokens, _relative(g.T @ rows - dw, dw))


# -- (b) the first Linear's input: a rank-one gradient at B = 1 ---------------------------------------


@dataclass(frozen=True)
class _FirstLinear:
    layer: Layer
    following: Layer | None  # the next Linear, whose gradient fixes the scale where there is no bias
    input_shape: tuple[int, ...]


def _flat_first_linear(model: nn.Module, input_shape: tuple[int, ...]) -> Layer:
    layer = first_layer(model, input_shape)
    if layer is None or not isinstance(layer.module, nn.Linear):
        raise NotApplicable(f"its first layer is {layer.kind if layer else 'none'}")
    if layer.pixels is None or layer.tokens != 1:
        raise NotApplicable(f"its first Linear sees {layer.tokens or 'no'} patch rows, not the flattened image")
    return layer


def _find_first_linear(model: nn.Module, input_shape: tuple[int, ...], classes: int) -> _FirstLinear:
    layer = _flat_first_linear(model, input_shape)
    following = None
    if layer.bias is None:
        following = _second_linear(model, layer, input_shape)
        if following is None:
            raise NotApplicable("its first Linear has no bias and no second Linear follows to fix the scale")
    return _FirstLinear(layer, following, input_shape)


def _second_linear(model: nn.Module, first: Layer, input_shape: tuple[int, ...]) -> Layer | None:
    calls: list[nn.Module] = []
    handles = [
        m.register_forward_pre_hook(lambda m, a: calls.append(m)) for m in model.modules() if isinstance(m, nn.Linear)
    ]
    try:
        with torch.no_grad(), evaluating(model):
            model(torch.zeros(1, *input_shape))
    finally:
        for h in handles:
            h.remove()
    later = [m for m in calls if m is not first.module]
    if not later:
        return None
    names = {id(m): n for n, m in model.named_modules()}
    module = later[0]
    prefix = names[id(module)]
    bias = f"{prefix}.bias" if module.bias is not None else None
    return Layer(module, f"{prefix}.weight", bias, (module.in_features,))


def _layer_inputs(model: nn.Module, module: nn.Module, x: Tensor) -> Tensor:
    """The input ``module`` receives when the model runs ``x`` (dropout off); the pass stops there."""
    seen: list[Tensor] = []

    def keep(m: nn.Module, args: tuple) -> None:
        seen.append(args[0].detach())
        raise _Stop

    handle = module.register_forward_pre_hook(keep)
    try:
        with torch.no_grad(), evaluating(model):
            model(x)
    except _Stop:
        pass
    finally:
        handle.remove()
    return seen[0].reshape(x.shape[0], -1).double()


def _best_scale(misfit: Callable[[np.ndarray], np.ndarray], typical: float) -> tuple[float, float]:
    """The scale c (either sign) that minimizes ``misfit`` (vectorized over c): a log grid over six
    decades around ``typical``, refined by a bounded scalar search around the best grid point."""
    grid = typical * np.logspace(-3, 3, 241)
    candidates = np.concatenate([grid, -grid])
    values = misfit(candidates)
    best = int(np.nanargmin(values))
    c0, sign = abs(candidates[best]), np.sign(candidates[best])
    res = minimize_scalar(
        lambda t: float(misfit(np.array([sign * np.exp(t)]))[0]),
        bounds=(np.log(c0) - 0.06, np.log(c0) + 0.06),
        method="bounded",
        options={"xatol": 1e-10},
    )
    c = float(sign * np.exp(res.x))
    return (c, float(res.fun)) if res.fun <= values[best] else (float(candidates[best]), float(values[best]))


@solver(
    "first_linear",
    needs="a first Linear layer on the flattened image",
    mechanism="the first Linear's gradient is rank one and gives the image exactly at batch size 1",
    batch_reason="at B > 1 the first Linear's gradient mixes the images (rank B: the images' span, not the images)",
    find=_find_first_linear,
)
def solve_first_linear(found: _FirstLinear, job: VictimJob, model: nn.Module) -> Solution:
    """dL/dW = delta x^T (rank one). With a bias, dL/db = delta fixes x = delta^T dW / |delta|^2. Without
    one, x = c v (v: the top right singular vector), and the next Linear's gradient, delta2 h^T with
    h = act(W c v) (dropout zeroing some entries), fixes c: the c whose h is parallel to h on the
    entries that were kept."""
    grads, layer = _grads(job, model), found.layer
    dw = grads[layer.weight]
    fit = _rank_one(dw)
    rank = fit.rank
    if layer.bias is not None:
        db = grads[layer.bias]
        x = (db @ dw) / (db @ db).clamp_min(1e-300)
        residual = _relative(dw - torch.outer(db, x), dw)
        extra: dict[str, Any] = {"scale_from": "bias"}
    else:
        v, residual = fit.v, fit.residual  # x = c v; the residual of the best rank-one fit
        nxt = found.following
        assert nxt is not None
        w = _rank_one(grads[nxt.weight]).v  # direction of h, sign unknown
        kept = w.abs() > EXACT_RTOL * w.abs().max()
        w_kept = w[kept] / torch.linalg.norm(w[kept])
        shape = found.input_shape

        def misfit(cs: np.ndarray) -> np.ndarray:  # sin of the angle between act(W c v) and h on kept entries
            xs = torch.as_tensor(cs, dtype=torch.float64)[:, None] * v[None]
            h = _layer_inputs(model, nxt.module, xs.float().reshape(-1, *shape))[:, kept]
            cos = (h @ w_kept).abs() / torch.linalg.norm(h, dim=1).clamp_min(1e-300)
            return torch.sqrt((1 - cos.clamp(max=1) ** 2).clamp_min(0)).numpy()

        scale, misfit_at = _best_scale(misfit, typical=float(np.sqrt(v.numel())))
        x = scale * v
        residual = max(residual, misfit_at)
        extra = {"scale_from": "next layer", "scale_misfit": misfit_at}
    images = x.reshape(1, *found.input_shape).float()
    return Solution(images, rank, 1, residual, extra)


# -- (b') the first Linear's inputs at B > 1: unmixed by independent component analysis ------------------


def _outer(cs: np.ndarray, v: Tensor) -> Tensor:
    """The candidate images c v for each scale c of ``cs``."""
    return torch.as_tensor(cs, dtype=torch.float64)[:, None] * v[None]


def _along_free_directions(image: _Image, free: Tensor, tolerance: float) -> _Image:
    """The image ``a (x + |x| free^T t)`` nearest ``image.row`` (x) that the next layer accepts best: a
    local search over the scale a and the free directions' weights t (Nelder-Mead: the misfit is a norm,
    not smooth at its zero). Keeps ``image`` where the search finds nothing better."""
    x, misfit = image.row, image.misfit
    size = float(torch.linalg.norm(x))

    def row(theta: np.ndarray) -> Tensor:
        t = torch.as_tensor(theta[1:], dtype=torch.float64)
        return float(np.exp(theta[0])) * (x + size * (t @ free))

    dims = 1 + free.shape[0]
    theta, best = np.zeros(dims), image.misfit_at
    for step in (1e-1, 1e-2, 1e-3, 1e-4):  # restarted on shrinking simplices: a kink can stall one run
        res = minimize(
            lambda th: float(misfit(row(th)[None])[0]),
            theta,
            method="Nelder-Mead",
            options={
                "initial_simplex": np.vstack([theta, theta + step * np.eye(dims)]),
                "xatol": 1e-13,
                "fatol": 1e-14,
                "maxiter": 600 * dims,
            },
        )
        if res.fun < best:
            theta, best = res.x, float(res.fun)
        if best <= tolerance:
            break
    return _Image(row(theta), best, misfit) if best < image.misfit_at else image


def _find_mixed(model: nn.Module, input_shape: tuple[int, ...], classes: int) -> _FirstLinear:
    found = _find_first_linear(model, input_shape, classes)
    following = found.following or _second_linear(model, found.layer, input_shape)
    if following is None:
        raise NotApplicable("no second Linear follows its first to tell a separated image from a mix")
    return _FirstLinear(found.layer, following, input_shape)


@dataclass(frozen=True)
class _Image:
    """One separated image as a row of the first Linear's input, its next-layer misfit, and that check."""

    row: Tensor
    misfit_at: float
    misfit: Callable[[Tensor], np.ndarray]


class _Mixture:
    """A batch gradient's first-Linear rows in their row space (``dW = coords @ space``), and the check
    every separated image must pass: its next-layer input, with its dropout mask (the zeros of its
    delta), lies in the row space of the next Linear's gradient."""

    def __init__(
        self,
        model: nn.Module,
        found: _FirstLinear,
        coords: Tensor,
        space: Tensor,
        next_grad: Tensor,
        bias_grad: Tensor | None,
        noise: float,
        singular_values: Tensor,
    ) -> None:
        assert found.following is not None
        self.model, self.module, self.shape = model, found.following.module, found.input_shape
        self.coords, self.space, self.bias_grad, self.noise = coords, space, bias_grad, noise
        b = space.shape[0]
        svd = torch.linalg.svd(next_grad, full_matrices=False)
        self.basis = svd.Vh[:b]
        # An exact image's misfit sits at the captured gradients' own rounding (float32), which grows with B:
        # their first singular value past rank B against the B-th (MLP MNIST p = 0.25, B = 32: 2-3e-7, the
        # misfits of separations whose every plane was found 4e-7-2e-6; the one wrong image there 0.1-0.2).
        # Within NOISE_FACTOR of that floor, or EXACT_RTOL where the floor is lower, is exact. A floor above
        # ROUNDING is noise (a quantized SecAgg+ mean, DP), not rounding, and forgives nothing.
        floors = [float(v[b] / v[b - 1]) for v in (svd.S, singular_values) if v.numel() > b and v[b - 1] > 0]
        self.exact_rtol = max([EXACT_RTOL] + [NOISE_FACTOR * f for f in floors if f <= ROUNDING])
        self.on_plane = zero_tolerance(torch.linalg.norm(coords, dim=1), noise, MASK_RTOL)  # per row

    def misfit_of(self, kept: Tensor) -> Callable[[Tensor], np.ndarray]:
        """Each candidate image's (rows of ``xs``) next-layer input off that gradient's row space, relative."""

        def misfit(xs: Tensor) -> np.ndarray:
            h = _layer_inputs(self.model, self.module, xs.float().reshape(-1, *self.shape)) * kept[None]
            off = h - (h @ self.basis.T) @ self.basis
            return (torch.linalg.norm(off, dim=1) / torch.linalg.norm(h, dim=1).clamp_min(1e-300)).numpy()

        return misfit

    def sources(self, normals: Tensor) -> Tensor:
        """(B, inputs): each image's direction, with dW = (coords @ normals^T) @ sources."""
        return torch.linalg.solve(normals.T, self.space)

    def images(self, normals: Tensor, which: list[int]) -> dict[int, _Image]:
        coeffs = self.coords @ normals.T  # (outputs, B): a_b, each image's delta up to scale
        sources = self.sources(normals)
        scales = None
        if self.bias_grad is not None:
            scales = torch.linalg.lstsq(coeffs, self.bias_grad[:, None]).solution[:, 0]
        out = {}
        for i in which:
            # a unit is dropped where its row lies on image i's hyperplane (relative to the row: a kept
            # unit's delta can be tiny beside the largest)
            kept = (coeffs[:, i].abs() > self.on_plane * torch.linalg.norm(normals[i])).double()
            v = sources[i] / torch.linalg.norm(sources[i]).clamp_min(1e-300)
            misfit = self.misfit_of(kept)
            if scales is not None:
                scale = float(torch.linalg.norm(sources[i]) / scales[i])
                misfit_at = float(misfit((scale * v)[None])[0])
            else:
                typical = float(v.numel()) ** 0.5
                scale, misfit_at = _best_scale(lambda cs, v=v, m=misfit: m(_outer(cs, v)), typical=typical)
            out[i] = _Image(scale * v, misfit_at, misfit)
        return out


def _complete_the_missing(
    mixture: _Mixture, solved: dict[int, _Image], normals: Tensor, missing: list[int], p: float
) -> tuple[dict[int, _Image], Tensor, dict[str, Any]]:
    """The images whose hyperplane was found, completed (``complete_by_smoothness`` gave the start; where
    the next layer disagrees, a local search along the missing images' directions), and the normals of
    all, the missing images' recovered where the others are exact."""
    # smoothness is a prior, not a proof: the next layer has the last word
    free = mixture.sources(normals)[missing]
    free = free / torch.linalg.norm(free, dim=1, keepdim=True)
    tol = mixture.exact_rtol
    solved = {i: _along_free_directions(im, free, tol) if im.misfit_at > tol else im for i, im in solved.items()}
    completed = [i for i in solved if solved[i].misfit_at <= tol]
    space, coords = mixture.space, mixture.coords
    rows = torch.zeros(len(normals), space.shape[1], dtype=space.dtype)
    for i, im in solved.items():
        rows[i] = im.row
    rows[missing] = mixture.sources(normals)[missing]  # one missing: its functional follows from the others
    normals = torch.linalg.inv(rows @ space.T).T
    extra: dict[str, Any] = {"images_completed": completed}
    if len(missing) > 1 and len(completed) == len(solved):
        # Every other image exact: the missing ones' functionals lie in the m dimensions those leave free,
        # where the rows without a missing image lie on a hyperplane again, now of m dimensions (a line
        # at m = 2, which one row draws): found as before.
        free_space = torch.linalg.svd(rows[completed] @ space.T, full_matrices=True).Vh[len(completed) :]
        projected = coords @ free_space.T
        # rows without any missing image project to the found images' rounding only: no direction to count
        projected[torch.linalg.norm(projected, dim=1) < FAINT * torch.linalg.norm(coords, dim=1)] = 0
        sub = refine_by_zeros(projected, normals[missing] @ free_space.T, p, mixture.noise)
        extra["missing_separated"] = sub.found
        if not sub.missing:
            normals[missing] = sub.normals @ free_space
    return solved, normals, extra


@solver(
    "cocktail_party",
    needs="a first Linear layer on the flattened image and a second Linear after it",
    mechanism=(
        "the first Linear's gradient mixes the batch's images, and independent component analysis unmixes them "
        "(the Cocktail Party Attack); under dropout each image's own zeros in that gradient separate it exactly"
    ),
    batch_reason="at B = 1 the first Linear's gradient is rank one, and first_linear solves it exactly",
    find=_find_mixed,
    separates=True,
    ordered=False,
)
def solve_cocktail_party(found: _FirstLinear, job: VictimJob, model: nn.Module) -> Solution:
    """dL/dW = sum_b delta_b x_b^T: ICA of its rows gives each image up to sign and scale, s_b = c_b x_b,
    and dW = sum_b a_b s_b^T with a_b = delta_b / c_b; under dropout the rows without image b (its zeros)
    fix each s_b exactly where their hyperplane is found (``refine_by_zeros``). The scale c_b from the bias
    where there is one (dL/db = sum_b c_b a_b); else, and as the check of every image, from the next Linear: its input
    h_b = m_b * act(W x_b + b) (m_b: the dropout mask, the zeros of a_b) lies in the row space of that
    Linear's gradient (rank B). A mix of images fits it for no scale: the largest misfit is the residual."""
    grads, layer, nxt = _grads(job, model), found.layer, found.following
    assert nxt is not None
    dw, b = grads[layer.weight], job.batch_size
    unmixing = unmix(dw, b)
    # the rows' coordinates in the gradient's row space: dW = C V, and image b's delta is C n_b
    svd = torch.linalg.svd(dw, full_matrices=False)
    coords, space = svd.U[:, :b] * svd.S[:b], svd.Vh[:b]
    # ICA's sources are K V: image b's normal is row b of K^-T (then dW = (C K^-1)(K V))
    normals = torch.linalg.inv(unmixing.matrix @ dw @ space.T).T
    extra: dict[str, Any] = {"ica_steps": unmixing.steps, "ica_converged": unmixing.converged}
    missing: list[int] = []  # images whose hyperplane was not found, beside others whose was
    # noise in the coordinates (a quantized SecAgg+ mean, DP): the first singular value past the
    # images' B, as an m x n matrix of iid noise of std sigma has sigma (sqrt(m) + sqrt(n))
    noise = float(svd.S[b] / (dw.shape[0] ** 0.5 + dw.shape[1] ** 0.5)) if svd.S.numel() > b else 0.0
    bias = grads[layer.bias] if layer.bias is not None else None
    mixture = _Mixture(model, found, coords, space, grads[nxt.weight], bias, noise, svd.S)
    if job.p > 0:  # dropout's zeros pin each image down exactly (separation.refine_by_zeros)
        refined = refine_by_zeros(coords, normals, job.p, noise)
        normals = refined.normals
        extra |= {
            "separated_by": "dropout zeros",
            "images_separated": refined.found,
            "zero_rows": refined.zeros,
            "zero_misfit": refined.residual,
        }
        if refined.found and refined.missing:  # the found normals leave the others' images a few directions
            missing = refined.missing
            sources = mixture.sources(normals)
            laid_out = images_from_rows(sources[:, None], layer.pixels, found.input_shape, dtype=torch.float64)
            completed = complete_by_smoothness(laid_out, missing) @ sources
            normals = torch.linalg.inv(completed @ space.T).T  # the completed images' functionals
    else:
        extra |= {"separated_by": "ica"}
    solved = mixture.images(normals, [i for i in range(b) if i not in missing])
    if missing:
        solved, normals, more = _complete_the_missing(mixture, solved, normals, missing, job.p)
        solved |= mixture.images(normals, missing)
        extra |= more
    misfits = [solved[i].misfit_at for i in range(b)]
    images = images_from_rows(torch.stack([solved[i].row for i in range(b)])[:, None], layer.pixels, found.input_shape)
    extra |= {"scale_from": "bias" if bias is not None else "next layer", "scale_misfits": misfits}
    certain = tuple(m <= mixture.exact_rtol for m in misfits)  # each image checked by the next layer on its own
    return Solution(images, _rank(dw), b, max(misfits), extra, mixture.exact_rtol, certain)


# -- (b'') images on a background: each image's pixels at the box's low value fix it in the span ---------


@dataclass(frozen=True)
class _Flat:
    layer: Layer
    input_shape: tuple[int, ...]


def _find_flat(model: nn.Module, input_shape: tuple[int, ...], classes: int) -> _Flat:
    return _Flat(_flat_first_linear(model, input_shape), input_shape)


def _fill_span(space: Tensor, found: Tensor, missing: int, size: float) -> Tensor:
    """``missing`` rows of ``space``'s span orthogonal to the ``found`` images, each of norm ``size``: what a
    partial separation leaves (an optimization started from it moves them; they are no claim)."""
    rest = space
    if found.shape[0]:
        q = torch.linalg.qr(found.T).Q.T  # orthonormal rows spanning the found images
        rest = space - (space @ q.T) @ q
    directions = torch.linalg.svd(rest, full_matrices=False).Vh[:missing]
    return directions * size


def _level_problem(found: _Flat, job: VictimJob, model: nn.Module) -> tuple[Tensor, Tensor, Tensor]:
    """The images' span (the first Linear's top B right singular vectors) and the box's bounds on its entries."""
    dw = _grads(job, model)[found.layer.weight]
    space = torch.linalg.svd(dw, full_matrices=False).Vh[: job.batch_size]
    low, high = box_bounds(get_spec(job.spec.dataset, found.input_shape[0]), dtype=torch.float64)
    entries = found.layer.pixels.reshape(-1)
    low_e = low.expand(*found.input_shape).reshape(-1)[entries]
    high_e = high.expand(*found.input_shape).reshape(-1)[entries]
    return space, low_e, high_e


def snap_dark_background(
    found: _Flat, job: VictimJob, model: nn.Module, images: Tensor, held: Tensor
) -> tuple[Tensor, Tensor]:
    """An optimization's images (the job's order) with each one not ``held`` that is near an image with a
    background replaced by that image, exactly (``separation.snap_to_level``), and which were. An image is
    taken only where the one it snaps to is nearer to it than to any other of the batch (so it keeps its place
    and label), and only once, held ones included. The held ones are exact already and not searched again: a
    program per image is most of a snap's time, and late in a run most images are held."""
    space, low_e, high_e = _level_problem(found, job, model)
    entries = found.layer.pixels.reshape(-1)
    flat = images.detach().double().cpu().reshape(images.shape[0], -1)[:, entries]
    open_ = (~held.cpu()).nonzero().flatten().tolist()
    snapped = snap_to_level(space, low_e, high_e, flat[open_]) if open_ else []
    out, taken = flat.clone(), torch.zeros(len(flat), dtype=torch.bool)
    kept = held.cpu().clone()  # the images no other may snap to: the held ones and those taken here
    for k, x in zip(open_, snapped):
        if x is None or int(torch.linalg.norm(flat - x, dim=1).argmin()) != k:
            continue
        if any(same_image(out[i], x) for i in kept.nonzero().flatten()):
            continue
        out[k], taken[k], kept[k] = x, True, True
    whole = images.detach().double().cpu().reshape(images.shape[0], -1).clone()
    whole[:, entries] = out
    return whole.reshape(images.shape).to(images.dtype), taken


@solver(
    "dark_background",
    needs="a first Linear layer on the flattened image",
    mechanism=(
        "the first Linear's gradient (or plain-SGD update) spans the batch's images, and each image's background "
        "pixels, at the data's darkest value, pin it down in that span exactly"
    ),
    batch_reason="at B = 1 a one-step gradient is rank one, and first_linear solves it exactly",
    find=_find_flat,
    separates=True,
    ordered=False,
    single_updates=True,
    updates=True,
    snap=snap_dark_background,
)
def solve_dark_background(found: _Flat, job: VictimJob, model: nn.Module) -> Solution:
    """dL/dW (or an SGD round's update of W) = sum_b delta_b x_b^T: its top B right singular vectors V span
    the images, x_b = a_b V. Where the images have a background at the box's low value (MNIST: about 80 %
    of each digit's pixels), image b's background pixels j satisfy a_b . V[:, j] = low_j: one hyperplane per
    image, found by ``separation.separate_by_level``. Each image it finds is exact (its background fixes
    it, and a mix of images is not as dark); the images it misses are filled with the span's directions
    orthogonal to the found ones, and the answer is then partial (inexact), for DIA to start from
    (``dia_cf``). Where the data has no background the search finds none."""
    layer, b = found.layer, job.batch_size
    space, low_e, high_e = _level_problem(found, job, model)
    sep = separate_by_level(space, low_e, high_e, torch.Generator().manual_seed(0))
    k = sep.images.shape[0]
    size = float(torch.linalg.norm(sep.images, dim=1).mean()) if k else float(torch.linalg.norm(low_e))
    rows = torch.cat([sep.images, _fill_span(space, sep.images, b - k, size)]) if k < b else sep.images
    images = images_from_rows(rows[:, None], layer.pixels, found.input_shape)
    extra: dict[str, Any] = {"images_separated": k, "background_pixels": sep.at_level}
    # exact only where every image was found; the residual is then their background's misfit
    residual = sep.misfit if k == b else 1.0
    certain = (True,) * k + (False,) * (b - k)  # each found image is fixed by its own background
    return Solution(images, k, b, residual, extra, tolerance=LEVEL_ATOL, certain=certain)


# -- (b'') one image's Adam round: the pixels' signs, and epsilon's share of the update their magnitudes ---

# An Adam update row whose median entry is below this fraction of the largest row's had steps of both signs
# (its entries then depend on the pixel through more than epsilon's share): those rows are left out.
EPS_ROWS = 0.5
# A pixel whose entries are below this fraction of their row's largest, at the median over rows, is one
# epsilon moves strongly (|x| near 0): the linear model of its share holds for the others, which fix the
# model; these are then read through the one-epsilon form of each row.
EPS_LINEAR = 0.5


def _signs(dw: Tensor) -> tuple[Tensor, float]:
    """sign(x) from the update's rank-one form u sign(x)^T, up to one global sign, and the fit's residual."""
    fit = _rank_one(dw)
    return torch.sign(fit.v), fit.residual


def _inverse_magnitudes(a: Tensor, linear: Tensor) -> tuple[Tensor, Tensor]:
    """Per pixel, a direction v with 1/|x| = alpha + beta v on the ``linear`` pixels, and the rows' loading.

    With epsilon's share small, each entry is |dw_jk| = R_j - E_j / |x_k| (R_j: the row's value at |x| -> inf,
    E_j > 0: epsilon's weight in that row): centred per row, the matrix is rank one, and its right factor is
    1/|x| up to an affine map. Oriented so that |dw| falls as 1/|x| grows in most rows."""
    part = a[:, linear]
    centred = part - part.mean(dim=1, keepdim=True)
    u, _, vh = torch.linalg.svd(centred, full_matrices=False)
    v, load = vh[0], u[:, 0]
    if float((load < 0).double().mean()) < 0.5:
        v, load = -v, -load
    return v, load


BOX_ASYMMETRY = 0.25  # the box's two ends fix the map where their magnitudes differ by this fraction (MNIST)


def box_leaves_open(job: VictimJob) -> str | None:
    """Why the data's box cannot fix 1/|x|'s affine map for ``job`` (both ends about as far from 0, as for
    natural images normalized by their mean: CIFAR-10's -1.99 and 2.06), in words; None where it can."""
    low, high = box_bounds(get_spec(job.spec.dataset, job.spec.input_shape[0]), dtype=torch.float64)
    y_neg, y_pos = 1 / low.abs().flatten(), 1 / high.abs().flatten()
    if bool(((y_neg - y_pos).abs() >= BOX_ASYMMETRY * torch.maximum(y_neg, y_pos)).all()):
        return None
    ends = ", ".join(f"({float(lo):.2f}, {float(hi):.2f})" for lo, hi in zip(low.flatten(), high.flatten()))
    return (
        f"the magnitudes are fixed by the data's box, whose ends for {job.spec.dataset} {ends} are about as far "
        "from 0, and then leave 1/|x|'s spread open"
    )


def _by_the_box(sign: Tensor, v: Tensor, a: Tensor, linear: Tensor, low: Tensor, high: Tensor) -> Tensor | None:
    """The image for one global sign: 1/|x| = alpha + beta v on the linear pixels, with the darkest pixel at
    the box's low value and the brightest at its high one; None where that map does not give every pixel a
    magnitude above 0 growing with v (the sign does not fit the box). The other pixels are read through each
    row's one-epsilon form, 1/|dw| = 1/R + (e/R) y, fitted on the linear pixels."""
    s = sign[linear]
    neg, pos = torch.nonzero(s < 0).flatten(), torch.nonzero(s > 0).flatten()
    if not (len(neg) and len(pos)):
        return None
    k_neg, k_pos = int(neg[v[neg].argmin()]), int(pos[v[pos].argmin()])  # the largest |x| below 0, above 0
    if v[k_neg] == v[k_pos]:
        return None
    y_neg, y_pos = 1 / float(low[linear][k_neg].abs()), 1 / float(high[linear][k_pos].abs())
    beta = (y_neg - y_pos) / float(v[k_neg] - v[k_pos])  # box_leaves_open: the two differ
    y_lin = y_pos + beta * (v - v[k_pos])
    if not (beta > 0 and bool((y_lin > 0).all())):
        return None
    basis = torch.stack([torch.ones_like(y_lin), y_lin], dim=1)
    coef = torch.linalg.lstsq(basis, (1 / a[:, linear]).T).solution
    y = (((1 / a.clamp_min(1e-300)) - coef[0][:, None]) / coef[1][:, None]).median(dim=0).values
    y[linear] = y_lin
    x = torch.where(sign != 0, sign / y.clamp_min(1e-12), torch.zeros_like(y))
    return torch.minimum(torch.maximum(x, low), high)


def _next_layer_agreement(found: _Flat, job: VictimJob, model: nn.Module, x: Tensor) -> float:
    """How well x's hidden activations explain the next Linear's update: Adam's epsilon shrinks the columns
    of small inputs there too, so |h| correlates with the columns' median |dw| for the true sign (and, with
    GELU or ReLU between, not for -x). 0 where no Linear follows."""
    nxt = _second_linear(model, found.layer, found.input_shape)
    if nxt is None:
        return 0.0
    column = _grads(job, model)[nxt.weight].abs().median(dim=0).values
    image = images_from_rows(x[None, None], found.layer.pixels, found.input_shape)
    h = _layer_inputs(model, nxt.module, image).reshape(-1).abs()
    if h.numel() != column.numel():
        return 0.0
    value = torch.corrcoef(torch.stack([column, h]))[0, 1]
    return float(value) if torch.isfinite(value) else 0.0


@solver(
    "adam_eps",
    needs="a first Linear layer on the flattened image",
    mechanism=(
        "Adam divides each entry of the first Linear's update by its own history, which keeps each pixel's sign; "
        "its epsilon leaves a share that falls with the pixel's magnitude, and one image's update gives both away"
    ),
    batch_reason=(
        "at B > 1 an entry's history mixes the images' pixels, and Adam's division no longer factors a pixel out"
    ),
    find=_find_flat,
    scale_free_updates=True,
)
def solve_adam_eps(found: _Flat, job: VictimJob, model: nn.Module) -> Solution:
    """One image x, K Adam steps: every entry of the first Linear sees gradients g_t = d_tj x_k, and Adam's
    step m/(sqrt(v) + eps) is m'/(sqrt(v') + eps/|x_k|) sign(x_k) in the row's own d's terms. So the update is
    u sign(x)^T (rank one, up to 1e-5 of it), and the eps term makes |dw_jk| = R_j/(1 + e_j/|x_k|): affine in
    1/|x_k| while e_j/|x_k| is small (``_inverse_magnitudes``). That fixes 1/|x| up to an affine map; the data's
    box fixes the map: the darkest pixel sits at the box's low value and the brightest at its high one
    (MNIST's background and saturated strokes; an image spanning less than its box comes back stretched), and
    the box also picks the global sign (only one of the two puts every magnitude above 0). The other pixels
    (|x| near 0) are read through each row's one-epsilon form, at the median over rows. The answer rests on
    that prior, not on a check of its own, so it is never claimed exact."""
    layer = found.layer
    dw = _grads(job, model)[layer.weight]
    low, high = box_bounds(get_spec(job.spec.dataset, found.input_shape[0]), dtype=torch.float64)
    entries = layer.pixels.reshape(-1)
    low_e = low.expand(*found.input_shape).reshape(-1)[entries]
    high_e = high.expand(*found.input_shape).reshape(-1)[entries]
    sign, sign_residual = _signs(dw)
    a = dw.abs()
    typical = a.median(dim=1).values
    a = a[typical >= EPS_ROWS * typical.max()]
    relative = (a / a.amax(dim=1, keepdim=True).clamp_min(1e-300)).median(dim=0).values
    linear = (relative >= EPS_LINEAR) & (sign != 0)
    v, _ = _inverse_magnitudes(a, linear)
    answers = [x for x in (_by_the_box(t, v, a, linear, low_e, high_e) for t in (sign, -sign)) if x is not None]
    if len(answers) == 2:  # a box about symmetric around 0 leaves the global sign open: the next layer picks it
        answers.sort(key=lambda x: -_next_layer_agreement(found, job, model, x))
    if not answers:
        x = torch.zeros_like(low_e)
        extra: dict[str, Any] = {"magnitudes_from": "none: neither sign of the update fits the box"}
        residual = 1.0
    else:
        x = answers[0]
        extra = {
            "magnitudes_from": "epsilon's share, scaled by the box",
            "linear_pixels": int(linear.sum()),
            "signs_fitting_the_box": len(answers),
        }
        residual = sign_residual
    images = images_from_rows(x[None, None], layer.pixels, found.input_shape)
    # rank 1 of the 2 an answer needs: epsilon's share fixes 1/|x| up to the affine map the box prior sets
    return Solution(images, 1, 2, residual, extra)


# -- (c) the classifier's input features: a constraint, not an image ----------------------------------


@dataclass(frozen=True)
class Features:
    """The input of the model's last Linear for one job (B = 1), as its gradient gives it."""

    values: Tensor  # (1, features): dropout before the classifier already applied (zeros where dropped)
    residual: float


def find_last_linear(model: nn.Module, input_shape: tuple[int, ...]) -> Layer:
    layer = last_linear(model, input_shape)
    if layer is None:
        raise NotApplicable("the model does not end in a Linear layer")
    return layer


def last_linear_features(layer: Layer, job: VictimJob, model: nn.Module) -> Features:
    """h from dL/dW = delta h^T (rank one at B = 1): with a bias, h = delta^T dW / |delta|^2; without
    one, h = c u (u: the top right singular vector) with c such that the cross-entropy's delta for
    logits W c u (+ b) reproduces dW u = c delta."""
    if job.plan is not None or job.batch_size != 1:
        raise NotApplicable("the features follow from a one-step gradient of one image")
    grads = _grads(job, model)
    dw = grads[layer.weight]
    if layer.bias is not None:
        db = grads[layer.bias]
        h = (db @ dw) / (db @ db).clamp_min(1e-300)
        return Features(h[None].float(), _relative(dw - torch.outer(db, h), dw))
    u = _rank_one(dw).v
    weight = layer.module.weight.detach().double()
    onehot = F.one_hot(job.labels.long().cpu(), weight.shape[0]).double()[0]
    r = dw @ u

    def misfit(cs: np.ndarray) -> np.ndarray:
        c = torch.as_tensor(cs, dtype=torch.float64)[:, None]
        delta = torch.softmax(c * (weight @ u)[None], dim=1) - onehot[None]
        return (torch.linalg.norm(r[None] - c * delta, dim=1) / torch.linalg.norm(r)).numpy()

    scale, misfit_at = _best_scale(misfit, typical=float(np.sqrt(u.numel())))
    h = scale * u
    return Features(h[None].float(), max(misfit_at, _relative(dw - torch.outer(dw @ u, u), dw)))


# -- (d) a separated batch in the labels' order: where an optimization starts from a separation -------------


# How much a held image's label score weighs against one slot's change of label in ``relabel``: a held image is
# exact, and with the true images the top score is the label for all 32 of a B = 32 SGD round, while an open
# slot's image may be any mix.
HELD_WEIGHT = 10.0


def label_scores(images: Tensor, job: VictimJob, model: nn.Module) -> Tensor | None:
    """(B, classes): how much each of ``images`` scores each label by the last Linear's gradient, P estimated;
    None where the model does not end in a Linear. That gradient of a mean cross-entropy is
    B dW = (S - P)^T H (S: the softmax outputs, P: the labels one-hot, H: that layer's inputs, rows per
    image), so P^T = (S^T H - B dW) H^+ from the images' own S and H (dropout off: the client's masks on
    that layer are not known, which blurs but does not move the estimate). A round's update: its
    gradients summed (``as_one_gradient``), which the labels still fix."""
    layer = last_linear(model, tuple(job.spec.input_shape))
    if layer is None:
        return None
    x = images.float().reshape(-1, *job.spec.input_shape)
    h = _layer_inputs(model, layer.module, x)
    with torch.no_grad(), evaluating(model):
        s = torch.softmax(model(x).double(), dim=1)
    dw = _grads(job, model)[layer.weight]
    return torch.linalg.lstsq(h.T, (s.T @ h - job.batch_size * dw).T).solution


def label_order(images: Tensor, job: VictimJob, model: nn.Module) -> Tensor | None:
    """The permutation putting a separating solver's images (which come in an order of their own) in the
    order of ``job.labels``, for an optimization whose dummies carry those labels to start from them; None
    where the model does not end in a Linear. Each image goes to a place of the label it scores highest
    (``label_scores``), every label keeping its count (an assignment). (Weighing the images the solver held
    exactly first, ``HELD_WEIGHT`` times, was tried: on a one-step B = 64 gradient under p = 0.25, whose scores
    put 44 of the 64 true images at their labels, it lost images, 59 -> 55 of 64; the snaps' ``relabel`` mends a
    held image's label instead, on one step only where the loss drops.)"""
    from scipy.optimize import linear_sum_assignment

    scores = label_scores(images, job, model)
    if scores is None:
        return None
    labels = job.labels.long().cpu()
    rows, cols = linear_sum_assignment(-scores[:, labels].numpy())  # image rows[k] to place cols[k]
    order = torch.empty(len(labels), dtype=torch.long)
    order[torch.as_tensor(cols)] = torch.as_tensor(rows)
    return order


def relabel(images: Tensor, held: Tensor, slot_labels: Tensor, job: VictimJob, model: nn.Module) -> Tensor | None:
    """New labels for an optimization's slots (a permutation of ``slot_labels``, the labels its dummies carry
    now): each held image (exact, fixed) at a label it scores (``label_scores``, ``HELD_WEIGHT``), every
    change of a slot's label costing 1, so open slots keep theirs unless a held image needs it. A held image
    under the wrong label takes a label the missing image needs; given it back, the open slot that had it
    can drift to that image (not to a copy of an image held elsewhere). None where the model does not end in
    a Linear."""
    from scipy.optimize import linear_sum_assignment

    scores = label_scores(images, job, model)
    if scores is None:
        return None
    slot_labels = slot_labels.long().cpu()
    cost = (slot_labels.view(-1, 1) != slot_labels.view(1, -1)).double()  # slot k takes place c's label
    cost[held.cpu()] -= HELD_WEIGHT * scores[held.cpu()][:, slot_labels]
    rows, cols = linear_sum_assignment(cost.numpy())
    out = slot_labels.clone()
    out[torch.as_tensor(rows)] = slot_labels[torch.as_tensor(cols)]
    return out
