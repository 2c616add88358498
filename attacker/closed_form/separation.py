"""Separating a gradient's rows into the images they mix: independent component analysis (the Cocktail
Party Attack), then, under dropout, the exact separation by dropout's own zeros (``refine_by_zeros``).

A first Linear's gradient at batch size B is ``dL/dW = sum_b delta_b x_b^T``: each of its rows is a mix
of the B images. Images are far from Gaussian (a digit is mostly background, a photo mostly smooth), so
the B directions that make the rows' mixes most non-Gaussian are the images themselves, up to order,
sign and scale (Kariyappa et al., ICML 2023). This is FastICA (Hyvarinen, 1999): whitening by the
rows' top B singular vectors, then the symmetric fixed-point iteration with the log-cosh contrast.

Written here rather than taken from scikit-learn: it is not in the project's stack, and what the
solver needs is the unmixing matrix applied to the *uncentered* gradient (ICA centers its samples;
the images' means come back only that way), a few lines on top of a few lines.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch
from scipy.optimize import linprog
from torch import Tensor

# A row of the gradient lacks an image where it lies this close to that image's hyperplane, relative to
# its norm: generous while searching (a hyperplane through sampled rows is itself a fit), tight for the
# masks read from a found one (MLP, MNIST p = 0.25, B = 8, 64 paper victims, measured against the true
# masks: dropped units' rows lie within 2e-8 of their image's hyperplane, kept units' at least 3.4e-6 off).
ZERO_RTOL = 1e-5
MASK_RTOL = 3e-7
# The reweighted hyperplane search (``reweighted_normals``): starts per round, the smoothing of its l1 phase
# and of its sparsity phase (on whitened unit rows), steps of each, and rounds (it stops earlier when a
# round finds no new plane SEARCH_PATIENCE times in a row). Measured on MLP MNIST/CIFAR-10 one-step
# gradients at B = 16-32.
SEARCH_STARTS = 300
SEARCH_SMOOTHING = (0.05, 0.01)
SEARCH_STEPS = 60
SEARCH_ROUNDS = 10
SEARCH_PATIENCE = 3  # rounds in a row without a new plane
# The sampling after the search draws B - 1 rows that must all lie on one image's plane: its odds fall as
# (the pool's purity)^(B - 1). Measured: alone it found 1 of 64 images at B = 32 and none at B = 64, where
# a CIFAR-10 job spent over 20 minutes in it; above this B it is not run (the search's planes stand).
SAMPLING_MAX_B = 32
# The fixed point stops when no unmixing direction turns by more than this (1 - |cos|) in a step.
TOLERANCE = 1e-10
MAX_STEPS = 1000


@dataclass(frozen=True)
class Unmixing:
    """``matrix @ gradient`` gives the sources (B, entries); how the iteration ended."""

    matrix: Tensor  # (B, rows of the gradient)
    singular_values: Tensor  # all of the centered gradient's, largest first
    steps: int
    converged: bool


def _symmetric_decorrelation(w: Tensor) -> Tensor:
    """(W W^T)^(-1/2) W: the nearest matrix with orthonormal rows."""
    values, vectors = torch.linalg.eigh(w @ w.T)
    return vectors @ torch.diag(values.clamp_min(1e-300).rsqrt()) @ vectors.T @ w


def unmix(gradient: Tensor, sources: int, seed: int = 0) -> Unmixing:
    """The unmixing of ``gradient``'s rows (mixes over its columns, the samples) into ``sources`` maximally
    non-Gaussian, uncorrelated signals. Deterministic for a seed."""
    g = gradient.double()
    samples = g.shape[1]
    centered = g - g.mean(dim=1, keepdim=True)
    u, s, vt = torch.linalg.svd(centered, full_matrices=False)
    k = min(sources, int(s.numel()))
    # whitened signals: unit variance, uncorrelated (rows of vt are orthonormal over the samples)
    z = vt[:k] * samples**0.5
    gen = torch.Generator().manual_seed(seed)
    w = _symmetric_decorrelation(torch.randn(k, k, generator=gen, dtype=torch.float64))
    converged, steps = False, 0
    while steps < MAX_STEPS and not converged:
        steps += 1
        y = torch.tanh(w @ z)  # log-cosh contrast: g = tanh, g' = 1 - tanh^2
        new = y @ z.T / samples - torch.diag((1 - y * y).mean(dim=1)) @ w
        new = _symmetric_decorrelation(new)
        converged = (1 - (new * w).sum(dim=1).abs()).abs().max().item() < TOLERANCE
        w = new
    # sources = w z = w diag(sqrt(n)/s) u^T centered: the same map applied to the uncentered rows
    matrix = w @ torch.diag(samples**0.5 / s[:k].clamp_min(1e-300)) @ u[:, :k].T
    return Unmixing(matrix, s, steps, converged)


@dataclass(frozen=True)
class Refined:
    """Each image's functional on the gradient's column space after the zero-pattern refinement."""

    normals: Tensor  # (B, B): delta_b = coordinates @ normals[b]
    zeros: list[int]  # per image: rows of the gradient that lack it (to the tolerance)
    residual: float  # the largest misfit of the half of the expected rows nearest each hyperplane
    found: int  # images whose hyperplane a draw found (the others keep their start)
    missing: list[int]  # the images whose hyperplane no draw found


def _candidates(unit: Tensor, pool: Tensor, trials: int, gen: torch.Generator) -> Tensor:
    """Normals of hyperplanes through B - 1 rows drawn from ``pool`` (trials x B), each the null vector
    of its rows."""
    dim = unit.shape[1]
    picks = torch.rand(trials, pool.numel(), generator=gen).argsort(dim=1)[:, : dim - 1]
    return torch.linalg.svd(unit[pool[picks]], full_matrices=True).Vh[:, -1]


def _smallest_eigenvectors(weights: Tensor, rows: Tensor) -> Tensor:
    """Per row of ``weights`` (K x rows), the unit n minimising sum_j w_j (rows_j . n)^2."""
    return torch.linalg.eigh(torch.einsum("kr,ri,rj->kij", weights, rows, rows))[1][:, :, 0]


def reweighted_normals(
    rows: Tensor, starts: int, gen: torch.Generator, found: list[Tensor] | None = None, from_rows: bool = False
) -> Tensor:
    """Candidate unit normals of hyperplanes that hold many of ``rows`` (rows x B), from
    ``starts`` random directions: iteratively reweighted least squares, first on the smoothed sum of
    |row . n| (the l1 objective of Dual Principal Component Pursuit, Tsakiris & Vidal 2018: its minima lie
    near the planes that hold a large share of the rows), then with weights 1 / (|row . n| + eps)^2 and
    eps shrinking (a concave, count-like objective, Candes, Wakin & Boyd 2008), which moves a start near a
    plane onto it exactly. Sampling B - 1 rows of one plane works while B is small; at B = 32 and p = 0.25
    its odds are about 0.25^31, and this search still lands most starts exactly on an image's plane.
    The rows are whitened first, then made unit: the l1 landscape is only faithful for rows spread evenly
    in all directions (measured: unwhitened, the true planes are not its minima; made unit before the
    whitening, 15 of 32 planes in a first round against 20). Starts are drawn orthogonal
    (in the whitened rows) to the ``found`` normals: random starts fall into a few large basins again
    and again (MLP MNIST p = 0.25, B = 32: 29 of 32 planes after 8 rounds of 300; 31 after 2 this way),
    each moved off that subspace by a random amount (up to 1.5 times its length): from the subspace alone the
    last plane or two are missed (31 of 32 after 8 rounds; with the spread, 32 of 32 after 5-7).
    ``from_rows``: start from the whitened rows themselves instead (``starts`` ignored): a row that lies on
    all planes but one is, whitened, near that one's normal (the starts of Qu, Sun & Wright 2014)."""
    u, s, vh = torch.linalg.svd(rows, full_matrices=False)
    white = u / torch.linalg.norm(u, dim=1, keepdim=True).clamp_min(1e-300)
    dim = rows.shape[1]
    if from_rows:
        n = white.clone()
    elif found:  # a normal n of the rows is s * (vh @ n) of the whitened ones
        taken = torch.stack(found) @ vh.T * s
        room = torch.linalg.svd(taken, full_matrices=True).Vh[len(found) :]
        n = torch.randn(starts, room.shape[0], generator=gen, dtype=torch.float64) @ room
        n = n / torch.linalg.norm(n, dim=1, keepdim=True)
        spread = 1.5 * torch.rand(starts, 1, generator=gen, dtype=torch.float64) / dim**0.5
        n = n + spread * torch.randn(starts, dim, generator=gen, dtype=torch.float64)
    else:
        n = torch.randn(starts, dim, generator=gen, dtype=torch.float64)
    l1, sparse = SEARCH_SMOOTHING
    for step in range(SEARCH_STEPS):
        n = _smallest_eigenvectors(1 / (n @ white.T).abs().clamp_min(max(l1 * 0.8**step, 1e-8)), white)
    for step in range(SEARCH_STEPS):
        n = _smallest_eigenvectors(1 / ((n @ white.T).abs() + max(sparse * 0.7**step, 1e-10)) ** 2, white)
    # back to the rows' coordinates: row . (V S^-1 n_w) = (whitened row) . n_w
    normals = (n / s) @ vh
    return normals / torch.linalg.norm(normals, dim=1, keepdim=True)


def zero_tolerance(norms: Tensor, noise: float = 0.0, tolerance: float = ZERO_RTOL) -> Tensor:
    """Per row, how far (in |row . n| with n a unit normal) a row of these norms may lie from a hyperplane
    and still count as on it: ``tolerance`` of its norm, or 4 ``noise`` (the std of noise in the
    coordinates, e.g. a SecAgg+ quantization's), whichever is larger."""
    return (4 * noise / norms.double().clamp_min(1e-300)).clamp_min(tolerance) * norms.double()


def refine_by_zeros(
    coordinates: Tensor,
    start: Tensor,
    dropped: float,
    noise: float = 0.0,
    trials: int = 4000,
    tolerance: float = ZERO_RTOL,
) -> Refined:
    """Dropout's own zeros separate the images exactly. The gradient's row j is sum_b delta_b[j] x_b, and
    delta_b[j] = 0 wherever image b's dropout mask dropped unit j (a fraction ``dropped`` of the rows):
    in the row coordinates C (rows x B, ``coordinates``), image b's rows-without-it lie on one
    hyperplane, C_j n_b = 0, and no other hyperplane holds nearly as many rows. They are found first by
    the reweighted search (``reweighted_normals``), then, for the images it missed, by sampling: B - 1
    rows drawn from those the start (ICA's unmixing) puts nearest to image b's hyperplane span a
    candidate. A candidate that holds a quarter of the rows expected beyond its own B - 1 is refitted
    to all it holds.
    An image whose hyperplane no draw finds keeps its start (and the residual says so). A row is on a
    hyperplane to ``tolerance`` of its norm, or to 4 ``noise`` (the std of noise in the coordinates,
    e.g. a SecAgg+ quantization's), whichever is larger."""
    c = coordinates.double()
    norms = torch.linalg.norm(c, dim=1)
    keep = norms > max(1e-9 * float(norms.max()), 4 * noise)  # a unit every image dropped: zero in every row
    c, norms = c[keep], norms[keep]
    unit = c / norms[:, None]
    rows, dim = unit.shape
    tol = zero_tolerance(norms, noise, tolerance) / norms  # on |u . n|, u: the row made unit
    gen = torch.Generator().manual_seed(0)
    expected = max(dim - 1, int(dropped * rows))
    pool_size = min(rows, max(2 * dim, 2 * expected))
    # a candidate holds its own B - 1 rows by construction: it must hold a quarter of the expected beyond
    need = dim - 1 + expected // 4
    normals: dict[int, Tensor] = {}
    starts = start.double() / torch.linalg.norm(start.double(), dim=1, keepdim=True).clamp_min(1e-300)

    def holds(n: Tensor) -> Tensor:
        return (unit @ n).abs() <= tol

    def spurious(n: Tensor, others: list[Tensor]) -> bool:
        # Rows lacking two images (dropped or inactive in both) fill the intersection of their planes, a
        # (B - 2)-dimensional subspace; a plane through it and one row more holds many rows and is no
        # image's. Almost all of its rows lie on another image's plane: fewer than B off it.
        on = holds(n)
        return any(int((on & ~holds(m)).sum()) < dim for m in others)

    def is_new(n: Tensor, planes: list[Tensor]) -> bool:
        return all(float((n @ m).abs()) < 1 - 1e-6 for m in planes)

    def search(pool: Tensor) -> Tensor | None:
        for _ in range(trials // 500):
            found = _candidates(unit, pool, 500, gen)
            counts = ((found @ unit.T).abs() <= tol).sum(dim=1)
            for k in torch.argsort(counts, descending=True)[:8].tolist():
                if counts[k] < need:
                    break
                cand = torch.linalg.svd(unit[holds(found[k])], full_matrices=True).Vh[-1]
                if is_new(cand, list(normals.values())) and not spurious(cand, list(normals.values())):
                    return cand
        return None

    def prune() -> None:  # a spurious plane found before the planes it leans on
        for b in list(normals):
            if spurious(normals[b], [m for c, m in normals.items() if c != b]):
                del normals[b]

    # the reweighted search first: rounds of random starts until every image's plane is found or
    # SEARCH_PATIENCE rounds in a row find none new; each plane that holds enough rows is refitted to all it holds
    planes: list[Tensor] = []
    stale = 0
    for _ in range(SEARCH_ROUNDS):
        before = len(planes)
        found = reweighted_normals(c, SEARCH_STARTS, gen, planes)
        counts = ((found @ unit.T).abs() <= tol).sum(dim=1)
        for k in torch.argsort(counts, descending=True).tolist():
            if counts[k] < need or len(planes) == dim:
                break
            if not is_new(found[k], planes):
                continue
            cand = torch.linalg.svd(unit[holds(found[k])], full_matrices=True).Vh[-1]
            if is_new(cand, planes) and not spurious(cand, planes):
                planes.append(cand)
        stale = 0 if len(planes) > before else stale + 1
        if len(planes) == dim or stale == SEARCH_PATIENCE or stale and not planes:  # none at all: it will not start
            break
    # each plane to the image whose start it is nearest (the images come unordered; the start only names them)
    if planes:
        near = (torch.stack(planes) @ starts.T).abs()
        for _ in planes:
            k, b = divmod(int(near.argmax()), near.shape[1])
            normals[b] = planes[k]
            near[k, :], near[:, b] = -1.0, -1.0
        prune()
    # first pass: each image's draws from the rows its start puts nearest its hyperplane; where the first
    # three images find none (or B is past SAMPLING_MAX_B), the draws' odds (about the pool's purity to
    # the power B - 1) are hopeless
    sampling = dim <= SAMPLING_MAX_B
    for b in range(start.shape[0] if sampling else 0):
        if b == 3 and not normals:
            break
        if b in normals:
            continue
        hit = search(torch.argsort((unit @ starts[b]).abs())[:pool_size])
        if hit is not None:
            normals[b] = hit
    prune()
    # second pass: the images left, from the rows no hyperplane found so far holds (those lack none of
    # the images found, so a draw of them lacks a missing image's with far better odds)
    for b in range(start.shape[0] if sampling else 0):
        if b in normals or not normals:
            continue
        held = torch.stack([(unit @ m).abs() <= tol for m in normals.values()]).any(dim=0)
        free = (~held).nonzero().flatten()
        hit = search(free) if free.numel() >= dim - 1 else None
        if hit is not None:
            normals[b] = hit
    prune()
    zeros, residual, out = [], 0.0, []
    for b in range(start.shape[0]):
        n = normals.get(b, starts[b])
        misfit = (unit @ n).abs()
        zeros.append(int((misfit <= tol).sum()))
        residual = max(residual, float(torch.sort(misfit).values[expected // 2]))
        out.append(n)
    missing = [b for b in range(start.shape[0]) if b not in normals]
    return Refined(torch.stack(out), zeros, residual, len(normals), missing)


def _total_variation_terms(images: Tensor) -> Tensor:
    """Each image's neighbour differences along its last two axes, one row per image."""
    dh = images[..., 1:, :] - images[..., :-1, :]
    dw = images[..., :, 1:] - images[..., :, :-1]
    return torch.cat([dh.flatten(1), dw.flatten(1)], dim=1).double()


def _least_absolute(d: Tensor, e: Tensor, steps: int = 200) -> Tensor:
    """argmin_t ||d + e^T t||_1 for d (n,) and e (m, n). One unknown: the weighted median of -d/e with
    weights |e|, where the minimum lies (at a breakpoint, so exactly where many terms vanish together).
    More: iteratively reweighted least squares (Schlossmacher, 1973)."""
    if e.shape[0] == 1:
        e0 = e[0]
        use = e0.abs() > 1e-12 * float(e0.abs().max().clamp_min(1e-300))
        if not bool(use.any()):  # the other image is flat: adding it changes no edge, nothing to fit
            return torch.zeros(1, dtype=d.dtype)
        points, weights = (-d[use] / e0[use]), e0[use].abs()
        order = torch.argsort(points)
        cum = torch.cumsum(weights[order], 0)
        return points[order][torch.searchsorted(cum, cum[-1] / 2).clamp(max=order.numel() - 1)][None]
    t = torch.linalg.lstsq(e.T, -d[:, None]).solution[:, 0]
    for _ in range(steps):
        w = 1 / (d + e.T @ t).abs().clamp_min(1e-12 * float(d.abs().max().clamp_min(1e-300)))
        t = torch.linalg.solve((e * w) @ e.T, -(e * w) @ d)
    return t


def complete_by_smoothness(images: Tensor, missing: list[int]) -> Tensor:
    """Where some images' hyperplanes were not found, complete the others. Image c's functional is
    fixed by the found normals only up to the directions they leave free, which are spanned by the
    missing images' rows: the true image is ``images[c] + sum_k t_k images[k]`` (k missing) for some t.
    A photo or a digit plus a multiple of another image has more edges than itself, so t is the one of
    least total variation: an L1 fit, exact where the true image is flat and the other is not (one
    missing image: the weighted median; several: iteratively reweighted). The missing images
    themselves are left as given (with one missing, exact already: the found normals fix its direction).

    ``images`` (B, ..., H, W): the separated images as laid out in pixels. Returns the (B, B) matrix M
    with the completed images ``M @ images`` (flattened)."""
    b = images.shape[0]
    mix = torch.eye(b, dtype=torch.float64)
    if not missing or len(missing) == b:
        return mix
    terms = _total_variation_terms(images)
    others = terms[missing]
    for c in range(b):
        if c not in missing:
            mix[c, missing] = _least_absolute(terms[c], others)
    return mix


# -- images with a background at one value: their pixels there fix each image in the span ---------------

# A pixel is at the background's value within this (normalized units; one step of an 8-bit pixel is
# 1 / (255 std), 0.013 for MNIST, and the span of a float32 gradient is off by about 1e-5 per pixel).
LEVEL_ATOL = 1e-3
# An image's background rows span B dimensions to this (``_rigid``). Measured on the MLP's FedAvg SGD round,
# MNIST p = 0.25, B = 64: the true images' rows at 1.1-4e-2, but for one image at 1.4e-3, and a vertex of the
# vertex search that is an image plus a little of others (0.26 % off) at 3.0e-3, its plane hinging on one entry.
LEVEL_RIGID = 5e-3
LEVEL_ROUNDS = 6  # rounds of random starts after the rows' own (it stops earlier after two without a new image)
# The vertex search (``box_vertices``), run where the hyperplane search left images unfound: linear programs
# per image of the batch at most, the reweightings of each, and how many in a row may find nothing new before
# it stops. Measured on the MLP's FedAvg SGD round (MNIST p = 0.25, B = 64, the paper's first victims): 100
# programs found 14 images, 300 found 22, 600 found 26, none after the 450th; each takes 0.2 s on one core.
VERTEX_PROGRAMS = 10
VERTEX_REWEIGHTS = 6
VERTEX_PATIENCE = 3  # times B


@dataclass(frozen=True)
class Leveled:
    """The images the background separation found, as rows of the first Linear's input."""

    images: Tensor  # (found, entries)
    at_level: list[int]  # per image: its entries at the background's value (to LEVEL_ATOL)
    misfit: float  # the largest distance of an image's background entries from the value, relative to its norm


def _distinct(rows: Tensor, copies: int = 1, cos: float = 1 - 1e-9) -> Tensor:
    """The rows, each direction at most ``copies`` times: pixels dark in every image are one and the same row,
    many times over, and would outweigh the rest in the search's whitening (B + 1 copies still outweigh any
    one row; at B = 1 every dark pixel is that row, and it must outweigh the ink: copies of it up to P / (B + 1))."""
    unit = rows / torch.linalg.norm(rows, dim=1, keepdim=True).clamp_min(1e-300)
    # Repeats are one direction up to rounding, so "same direction" groups the rows; each row's group is
    # named by its first member, and the first ``copies`` of each group are kept (a whole-matrix form of
    # keeping a row while fewer than ``copies`` kept ones repeat it: the row loop cost seconds per call).
    group = torch.cat(  # the first row of each row's direction; in column blocks, for images of many pixels
        [((unit @ unit[k : k + 1024].T).abs() >= cos).to(torch.uint8).argmax(dim=0) for k in range(0, len(unit), 1024)]
    )
    order = torch.argsort(group, stable=True)
    sorted_group = group[order]
    starts = torch.searchsorted(sorted_group, sorted_group)  # where each group's run begins
    rank = torch.empty_like(group)
    rank[order] = torch.arange(len(group)) - starts  # each row's place among its group's rows
    return rows[rank < copies]


def _rigid(rows: Tensor, b: int) -> bool:
    """Whether these rows fix one hyperplane of R^(B+1) alone: a mix of images is at the value only where all
    of them are, rows that lie on several images' planes at once (rank B - 1 at most; measured on MNIST, B = 32:
    an image's background rows have their B-th singular value at 3-6e-2 of the first, a float32 span's
    rounding puts the next at 1e-6)."""
    distinct = _distinct(rows)
    if distinct.shape[0] < b:
        return False
    s = torch.linalg.svdvals(distinct / torch.linalg.norm(distinct, dim=1, keepdim=True))
    return float(s[b - 1] / s[0]) > LEVEL_RIGID


def _level_image(n: Tensor, v: Tensor, rows: Tensor, low: Tensor, high: Tensor) -> Tensor | None:
    """The image of normal ``n`` of the rows [V^T, low], x = a V for n = [a, -1] up to scale, where it is one:
    inside the box, a quarter of its entries at the low value, and those entries' rows fixing its plane
    alone (``_rigid``); None otherwise."""
    if float(n[-1].abs()) < 1e-12:
        return None
    x = (n[:-1] * (-1.0 / n[-1])) @ v
    if not bool(((x > low - LEVEL_ATOL) & (x < high + LEVEL_ATOL)).all()):
        return None
    dark = (x - low).abs() < LEVEL_ATOL
    if int(dark.sum()) < x.numel() // 4 or not _rigid(rows[dark], v.shape[0]):
        return None
    return x


def same_image(x: Tensor, y: Tensor) -> bool:
    """Whether two found images are one (to 1e-3 of ``y``'s norm)."""
    return float(torch.linalg.norm(x - y)) < 1e-3 * float(torch.linalg.norm(y))


def _vertex(a: np.ndarray, w: np.ndarray, j: int) -> np.ndarray | None:
    """The reweighted program of ``box_vertices`` from weights ``w`` and the entry ``j`` held at 1."""
    entries, dim = a.shape
    n = None
    for step in range(VERTEX_REWEIGHTS):
        answer = linprog(
            a.T @ w,
            A_ub=-a,
            b_ub=np.zeros(entries),
            A_eq=a[j : j + 1],
            b_eq=[1.0],
            bounds=[(None, None)] * dim,
            method="highs",
        )
        if answer.status != 0:  # an entry no image inks (y_j = 1 is out of reach), or a failed solve
            break
        n = answer.x
        y = np.clip(a @ n, 0.0, None)
        w = 1.0 / (y + 0.1 * y.max() * 0.5**step)
    return n


def box_vertices(rows: Tensor, programs: int, gen: torch.Generator) -> Iterator[Tensor]:
    """Normals n of the rows (entries x (B + 1), [V^T, low]) whose y = rows @ n is >= 0 and as sparse as a linear
    program gets it, one per program. An image's y_b = s (x_b - low) is >= 0 on every entry and 0 on its
    background: a vertex of the cone {n : rows @ n >= 0}, and so the answer of some program min w . y with
    y >= 0 and y_j = 1 at an entry j of its ink (any mix of images with positive weights costs more than the
    cheapest of them). Each program draws j and w at random, then reweights w to 1 / (y + eps), eps shrinking,
    which pulls it toward the sparsest vertex near its answer (Candes, Wakin & Boyd 2008). The hyperplane
    search ignores the sign: its l1 landscape at B = 64 has too many basins (8-10 of 64 images on the round
    above); this uses it. Some vertices are not images (a mix with negative weights can stay >= 0): the
    caller's box and background checks drop them. A generator: the caller stops it once it has what it needs.
    scipy's HiGHS solves the programs (torch has no linear-programming solver)."""
    a = rows.double().numpy()
    for _ in range(programs):
        j = int(torch.randint(a.shape[0], (1,), generator=gen))
        n = _vertex(a, (0.5 + torch.rand(a.shape[0], generator=gen, dtype=torch.float64)).numpy(), j)
        if n is not None:
            yield torch.from_numpy(n)


def separate_by_level(space: Tensor, low: Tensor, high: Tensor, gen: torch.Generator) -> Leveled:
    """Images with a background (MNIST's black, a scan's empty field) each sit at the box's low value
    ``low`` (per entry) on most of their pixels. Every image lies in ``space`` (B x entries, orthonormal
    rows: the first Linear's row space, for a one-step gradient and for a plain SGD round alike), x_b = a_b V,
    so with r_j = [V[:, j], low_j] the pixels of image b's background lie on one hyperplane,
    [a_b, -1] . r_j = 0. A mix of images is at the value only where all of them are, or where its weights
    cancel, and one as dark as an image hinges on a few entries (``_rigid`` refuses it). The hyperplanes are
    found by the reweighted search (``reweighted_normals``), from the rows themselves and then from random
    starts, then, for the images still unfound, by linear programs over the sign of x - low (``box_vertices``);
    a plane gives an image when its entries lie in the box and a quarter of them sit at the value. Some images
    (a digit whose strokes others' cover) may stay unfound: they are left out, not guessed."""
    b = space.shape[0]
    v = space.double()
    rows = torch.cat([v.T, low.double()[:, None]], dim=1)  # (entries, B + 1)
    search = _distinct(rows, copies=max(b + 1, rows.shape[0] // (b + 1)))
    low64, high64 = low.double(), high.double()
    images: list[Tensor] = []
    normals: list[Tensor] = []

    def consider(found: Tensor) -> int:
        new = 0
        for n in found:
            if len(images) == b:
                continue
            x = _level_image(n, v, rows, low64, high64)
            if x is None or any(same_image(x, y) for y in images):
                continue
            images.append(x)
            normals.append(n / torch.linalg.norm(n))
            new += 1
        return new

    consider(reweighted_normals(search, 0, gen, from_rows=True))
    stale = 0
    for _ in range(LEVEL_ROUNDS):
        if len(images) == b or stale == 2:
            break
        stale = 0 if consider(reweighted_normals(search, SEARCH_STARTS, gen, normals or None)) else stale + 1
    # only where the planes showed a background: without one (CIFAR-10's photos) every program is spent for
    # nothing, 3 B of them before it stops (minutes at B = 64 on 3,072 entries)
    if images and len(images) < b:
        since = 0
        for n in box_vertices(_distinct(rows), VERTEX_PROGRAMS * b, gen):
            since = 0 if consider(n[None]) else since + 1
            if len(images) == b or since >= VERTEX_PATIENCE * b:
                break
    if not images:
        return Leveled(torch.zeros(0, v.shape[1], dtype=torch.float64), [], 0.0)
    stack = torch.stack(images)
    dark = (stack - low64).abs() < LEVEL_ATOL
    misfit = float(((stack - low64).abs() * dark).amax(dim=1).div(torch.linalg.norm(stack, dim=1)).max())
    return Leveled(stack, [int(c) for c in dark.sum(dim=1)], misfit)


def snap_to_level(space: Tensor, low: Tensor, high: Tensor, approximate: Tensor) -> list[Tensor | None]:
    """Per row of ``approximate`` (k x entries: an optimization's images, not yet exact), the image with a
    background that it is near, where one passes the same checks as the separation's (``_level_image``);
    None elsewhere. The vertex search's program, aimed: weights 1 / (y + eps) from the approximation's own
    ink y = x - low, and its inkiest entry held at 1, so the nearest sparse vertex is the one found. Measured
    on the MLP's FedAvg SGD round (MNIST p = 0.25, B = 64, the paper's first victims): dia_hold's images at
    cap 3,000, 29 of 64 recognisable with the separation's 26 held, snap to 46 exact images in 22 s."""
    v = space.double()
    rows = torch.cat([v.T, low.double()[:, None]], dim=1)
    a = rows.numpy()
    out: list[Tensor | None] = []
    for x in approximate.double():
        ink = (x - low.double()).clamp_min(0.0)
        if float(ink.max()) <= 0:
            out.append(None)
            continue
        y = ink.numpy()
        n = _vertex(a, 1.0 / (y + 0.1 * y.max()), int(ink.argmax()))
        out.append(None if n is None else _level_image(torch.from_numpy(n), v, rows, low.double(), high.double()))
    return out
