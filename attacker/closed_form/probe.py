"""What a model is made of, found by running it: the layers the closed forms rely on, by structure.

Every finding here comes from a probe forward pass, never from a parameter's or a module's name:

* ``first_layer``: the first Linear or Conv2d the input reaches, and which input pixel each entry of
  its input is (an *index probe*: the image ``0, 1, 2, ...`` run up to that layer; a layer that sees
  the pixels only rearranged shows them as those integers);
* ``last_linear``: the last Linear the forward runs and the shape of its input (the features);
* ``position_embedding``: a parameter added to every token after a per-patch linear embedding,
  checked by the identity it implies on a probe's own gradient (``dL/dW = sum_i g_i p_i^T`` with
  ``g_i`` the parameter's gradient at token i).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedsim.models import DropoutMode, dropout_mode

# The identity a structure implies holds to float32 rounding on the probe; far beyond it, it does not.
STRUCTURE_RTOL = 1e-3


class _Stop(Exception):
    """Ends a probe forward pass once the layer it looks for has been reached."""


@dataclass(frozen=True)
class Layer:
    """A weight-bearing layer as a probe met it: its module, its parameters' names, the shape of its
    input and, for the first layer, the input pixel behind every entry of its patch rows."""

    module: nn.Module
    weight: str  # the full name of its weight in model.named_parameters()
    bias: str | None
    input_shape: tuple[int, ...]
    pixels: Tensor | None = None  # (tokens, entries): flat pixel index of each patch entry; -1: padding

    @property
    def kind(self) -> str:
        m = self.module
        if isinstance(m, nn.Conv2d):
            return f"a {m.kernel_size[0]}x{m.kernel_size[1]} Conv2d with stride {m.stride[0]}"
        return "a Linear"

    @property
    def tokens(self) -> int:
        return 0 if self.pixels is None else int(self.pixels.shape[0])


@contextmanager
def evaluating(model: nn.Module) -> Iterator[None]:
    """Dropout off and norm layers on their running statistics (a batch of one probe image cannot
    take train-mode BatchNorm); the model's modes restored after."""
    was = {m: m.training for m in model.modules()}
    model.eval()
    try:
        with dropout_mode(model, DropoutMode.OFF):
            yield
    finally:
        for m, mode in was.items():
            m.training = mode


def _names(model: nn.Module, module: nn.Module) -> tuple[str, str | None]:
    owner = {id(m): n for n, m in model.named_modules()}[id(module)]
    prefix = f"{owner}." if owner else ""
    bias = f"{prefix}bias" if getattr(module, "bias", None) is not None else None
    return f"{prefix}weight", bias


def _is_per_patch(conv: nn.Conv2d) -> bool:
    """A Conv2d that maps each non-overlapping patch on its own: a linear map per patch."""
    return (
        conv.kernel_size == conv.stride and conv.dilation == (1, 1) and conv.groups == 1 and conv.padding in (0, (0, 0))
    )


def patch_rows(layer_input: Tensor, module: nn.Module) -> Tensor:
    """The layer's input as (B, tokens, entries): the rows its weight multiplies (a Conv2d's patches)."""
    if isinstance(module, nn.Conv2d):
        k, s = module.kernel_size, module.stride
        cols = F.unfold(layer_input, k, dilation=module.dilation, padding=module.padding, stride=s)
        return cols.transpose(1, 2)  # (B, patches in row-major order, C·kh·kw): the conv's weight order
    return layer_input.reshape(layer_input.shape[0], -1, layer_input.shape[-1])


def _run_until(model: nn.Module, x: Tensor, pick) -> tuple[nn.Module, Tensor] | None:
    """Forward ``x`` and return the (module, input) ``pick`` chooses among the Linear/Conv2d calls."""
    found: list[tuple[nn.Module, Tensor]] = []

    def hook(module: nn.Module, args: tuple) -> None:
        if args and isinstance(args[0], Tensor):
            found.append((module, args[0].detach()))
            if pick == "first":
                raise _Stop

    handles = [m.register_forward_pre_hook(hook) for m in model.modules() if isinstance(m, nn.Linear | nn.Conv2d)]
    try:
        with torch.no_grad(), evaluating(model):
            model(x)
    except _Stop:
        pass
    finally:
        for h in handles:
            h.remove()
    if not found:
        return None
    return found[0] if pick == "first" else found[-1]


def first_layer(model: nn.Module, input_shape: tuple[int, ...]) -> Layer | None:
    """The first Linear or Conv2d the input reaches, with the pixel behind each entry of its patch
    rows where it sees the input pixels as they are (only rearranged); ``pixels`` None otherwise."""
    numel = int(torch.tensor(input_shape).prod())
    index = torch.arange(numel, dtype=torch.float32).reshape(1, *input_shape)
    hit = _run_until(model, index, "first")
    if hit is None:
        return None
    module, seen = hit
    weight, bias = _names(model, module)
    pixels = None
    rows = patch_rows(seen, module)[0] if not isinstance(module, nn.Conv2d) or _is_per_patch(module) else None
    if rows is not None and torch.equal(rows, rows.round()) and rows.min() >= 0 and rows.max() < numel:
        if seen.numel() == numel and torch.equal(seen.flatten().sort().values, index.flatten()):
            pixels = rows.long()  # every pixel exactly once: the layer sees the image, rearranged
    return Layer(module, weight, bias, tuple(seen.shape[1:]), pixels)


def last_linear(model: nn.Module, input_shape: tuple[int, ...]) -> Layer | None:
    """The last Linear the forward runs (the classifier of a model that ends in one)."""
    hit = _run_until(model, torch.zeros(1, *input_shape), "last")
    if hit is None or not isinstance(hit[0], nn.Linear):
        return None
    weight, bias = _names(model, hit[0])
    return Layer(hit[0], weight, bias, tuple(hit[1].shape[1:]))


def images_from_rows(
    rows: Tensor, pixels: Tensor, input_shape: tuple[int, ...], dtype: torch.dtype = torch.float32
) -> Tensor:
    """Patch rows (B, tokens, entries) back into images (B, *input_shape); a pixel seen in several
    rows takes their mean, one seen in none stays 0 (the dataset mean in normalized space)."""
    b = rows.shape[0]
    numel = int(torch.tensor(input_shape).prod())
    flat, idx = rows.reshape(b, -1).to(torch.float64), pixels.reshape(-1)
    keep = idx >= 0
    out = torch.zeros(b, numel, dtype=torch.float64).index_add_(1, idx[keep], flat[:, keep])
    count = torch.zeros(numel, dtype=torch.float64).index_add_(
        0, idx[keep], torch.ones(int(keep.sum()), dtype=torch.float64)
    )
    return (out / count.clamp_min(1)).reshape(b, *input_shape).to(dtype)


@dataclass(frozen=True)
class PositionEmbedding:
    """A parameter whose rows ``offset .. offset + tokens`` are added to the patch tokens."""

    name: str
    offset: int
    tokens: int
    dim: int


def _probe_gradient(model: nn.Module, input_shape: tuple[int, ...], classes: int) -> dict[str, Tensor]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, *input_shape, generator=gen)
    y = torch.randint(0, classes, (1,), generator=gen)
    params = dict(model.named_parameters())
    with evaluating(model):
        loss = F.cross_entropy(model(x), y)
    grads = torch.autograd.grad(loss, list(params.values()), allow_unused=True)
    probe = {n: g for n, g in zip(params, grads) if g is not None}
    # the probe's own patch rows, as the first layer saw them
    hit = _run_until(model, x, "first")
    assert hit is not None
    probe["__rows__"] = patch_rows(hit[1], hit[0])[0]
    return probe


def position_embedding(
    model: nn.Module, layer: Layer, input_shape: tuple[int, ...], classes: int
) -> PositionEmbedding | None:
    """The parameter added to every patch token right after ``layer`` (the patch embedding), if any:
    of the parameters with one row of the embedding's width per token (or more, for prefix tokens),
    the one whose probe gradient satisfies ``dL/dW = G^T P`` on some block of ``tokens`` rows."""
    dim = layer.module.out_channels if isinstance(layer.module, nn.Conv2d) else layer.module.out_features
    n = layer.tokens
    if n < 2:
        return None
    candidates = [
        (name, q.numel() // dim)
        for name, q in model.named_parameters()
        if name not in (layer.weight, layer.bias) and q.shape[-1] == dim and q.numel() // dim >= n
    ]
    if not candidates:
        return None
    probe = _probe_gradient(model, input_shape, classes)
    rows = probe["__rows__"].double()
    dw = probe[layer.weight].double().reshape(dim, -1)
    for name, total in candidates:
        if name not in probe:
            continue
        g_all = probe[name].double().reshape(total, dim)
        for offset in dict.fromkeys((total - n, 0)):
            g = g_all[offset : offset + n]
            err = torch.linalg.norm(g.T @ rows - dw) / torch.linalg.norm(dw).clamp_min(1e-30)
            if err < STRUCTURE_RTOL:
                return PositionEmbedding(name, offset, n, dim)
    return None
