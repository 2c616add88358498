"""Per-job gradient-matching terms for V victim jobs that share one model, without ever building
a per-job weight-sized gradient where it can be avoided.

Why by hand: autograd gives the gradient of a sum over the whole batch, but every victim job has
its own target gradient, so each job needs its own <g_j, g*_j> and ||g_j||^2. vmap or stacked
weights cost as much as one job at a time (see docs/performance.md). Instead we take the gradient
of the summed loss w.r.t. each layer's OUTPUT (delta), which is per row and so per job, and
assemble each job's parameter-gradient terms from deltas and the layer inputs:
  Linear / Conv2d (via unfold):  g_j = sum_t delta_t a_t^T,
      <g_j, G*_j> = sum_t delta_t^T G*_j a_t,   ||g_j||^2 = sum_{t,t'} (delta_t.delta_t')(a_t.a_t')
      (the Gram form is used where it is cheaper than materializing g_j)
  LayerNorm / GroupNorm: g_w = sum delta * x_hat, g_b = sum delta   (materialized: they are small)
  TokenEmbedding (ViT cls token and position embedding): sums of delta over the job's images.
The double backward then flows through ordinary batched matrix products.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedsim.models.vit import TokenEmbedding

SUPPORTED = (nn.Linear, nn.Conv2d, nn.LayerNorm, nn.GroupNorm, TokenEmbedding)


class UnsupportedModelError(ValueError):
    """The model holds a layer whose per-job gradient this module cannot assemble (e.g. BatchNorm,
    which couples the images of a batch)."""


@dataclass
class MatchTerms:
    """Per parameter p and job j: dot[p, j] = <g, g*>, norm2[p, j] = ||g||^2, target_norm2 = ||g*||^2."""

    dot: Tensor
    norm2: Tensor
    target_norm2: Tensor
    names: list[str]


def _linear_terms(d: Tensor, a: Tensor, target: Tensor) -> tuple[Tensor, Tensor]:
    """d: (V, R, out), a: (V, R, in), target: (V, out, in) -> dot (V,), norm2 (V,)."""
    rows, out_f, in_f = d.shape[1], d.shape[2], a.shape[2]
    if rows * (out_f + in_f) < out_f * in_f:
        dot = ((d @ target) * a).sum((1, 2))
        norm2 = ((d @ d.transpose(1, 2)) * (a @ a.transpose(1, 2))).sum((1, 2))
    else:
        g = d.transpose(1, 2) @ a
        dot = (g * target).sum((1, 2))
        norm2 = (g * g).sum((1, 2))
    return dot, norm2


def _dense_terms(g: Tensor, target: Tensor) -> tuple[Tensor, Tensor]:
    g = g.reshape(g.shape[0], -1)
    return (g * target.reshape(g.shape[0], -1)).sum(1), (g * g).sum(1)


class PerJobGradients:
    """Computes ``MatchTerms`` for a batch holding V jobs of equal size, rows ordered job by job."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.names = [name for name, _ in model.named_parameters()]
        index = {id(p): i for i, (_, p) in enumerate(model.named_parameters())}
        self.layers: list[tuple[nn.Module, dict[str, int]]] = []
        covered: set[int] = set()
        for mname, module in model.named_modules():
            own = dict(module.named_parameters(recurse=False))
            if not own:
                continue
            if not isinstance(module, SUPPORTED) or (isinstance(module, nn.Conv2d) and module.groups != 1):
                raise UnsupportedModelError(
                    f"layer {mname or type(module).__name__} ({type(module).__name__}) is not supported for batched jobs"
                )
            self.layers.append((module, {k: index[id(p)] for k, p in own.items()}))
            covered.update(id(p) for p in own.values())
        self.targets: list[Tensor] = []
        self.target_norm2: Tensor | None = None

    @staticmethod
    def check(model: nn.Module) -> str | None:
        """None when the model is supported, else the reason."""
        try:
            PerJobGradients(model)
        except UnsupportedModelError as err:
            return str(err)
        return None

    def set_targets(self, targets: list[Tensor]) -> None:
        """targets[p]: (V, *param_shape), the jobs' target gradients stacked per parameter."""
        if len(targets) != len(self.names):
            raise ValueError(f"expected {len(self.names)} target gradients, got {len(targets)}")
        self.targets = targets
        self.target_norm2 = torch.stack([t.reshape(t.shape[0], -1).pow(2).sum(1) for t in targets])

    def compute(self, x: Tensor, labels: Tensor, num_jobs: int) -> MatchTerms:
        captured: list[tuple[Tensor, Tensor]] = []
        hooks = [
            module.register_forward_hook(lambda _m, inp, out: captured.append((inp[0], out)))
            for module, _ in self.layers
        ]
        try:
            logits = self.model(x)
        finally:
            for h in hooks:
                h.remove()
        if len(captured) != len(self.layers):
            raise UnsupportedModelError("a parametrized layer ran more or fewer than once per forward pass")
        # Each job's loss is the mean cross-entropy over its own images, as the client computed it.
        loss = F.cross_entropy(logits, labels, reduction="none").view(num_jobs, -1).mean(1).sum()
        deltas = torch.autograd.grad(loss, [out for _, out in captured], create_graph=True)
        dots: list[Tensor | None] = [None] * len(self.names)
        norms: list[Tensor | None] = [None] * len(self.names)
        V = num_jobs
        for (module, params), (inp, _), d in zip(self.layers, captured, deltas):
            for key, (dot, norm2) in self._layer_terms(module, params, inp, d, V).items():
                dots[params[key]], norms[params[key]] = dot, norm2
        assert self.target_norm2 is not None, "set_targets first"
        return MatchTerms(torch.stack(dots), torch.stack(norms), self.target_norm2, self.names)  # type: ignore[arg-type]

    def _layer_terms(self, module: nn.Module, params: dict[str, int], inp: Tensor, d: Tensor, V: int):
        t = self.targets
        terms = {}
        if isinstance(module, nn.Linear):
            a = inp.reshape(V, -1, inp.shape[-1])
            dd = d.reshape(V, -1, d.shape[-1])
            terms["weight"] = _linear_terms(dd, a, t[params["weight"]])
            if "bias" in params:
                terms["bias"] = _dense_terms(dd.sum(1), t[params["bias"]])
        elif isinstance(module, nn.Conv2d):
            cols = F.unfold(inp, module.kernel_size, module.dilation, module.padding, module.stride)
            a = cols.transpose(1, 2).reshape(V, -1, cols.shape[1])
            dd = d.flatten(2).transpose(1, 2).reshape(V, -1, d.shape[1])
            w = t[params["weight"]]
            terms["weight"] = _linear_terms(dd, a, w.reshape(V, w.shape[1], -1))
            if "bias" in params:
                terms["bias"] = _dense_terms(dd.sum(1), t[params["bias"]])
        elif isinstance(module, nn.LayerNorm):
            shape = module.normalized_shape
            x_hat = F.layer_norm(inp, shape, eps=module.eps).reshape(V, -1, *shape)
            dd = d.reshape(V, -1, *shape)
            if "weight" in params:
                terms["weight"] = _dense_terms((dd * x_hat).sum(1), t[params["weight"]])
            if "bias" in params:
                terms["bias"] = _dense_terms(dd.sum(1), t[params["bias"]])
        elif isinstance(module, nn.GroupNorm):
            x_hat = F.group_norm(inp, module.num_groups, eps=module.eps)
            channels = inp.shape[1]
            dd = d.reshape(V, -1, channels, d[0, 0].numel())
            if "weight" in params:
                prod = (dd * x_hat.reshape(dd.shape)).sum((1, 3))
                terms["weight"] = _dense_terms(prod, t[params["weight"]])
            if "bias" in params:
                terms["bias"] = _dense_terms(dd.sum((1, 3)), t[params["bias"]])
        else:  # TokenEmbedding
            dd = d.reshape(V, -1, *d.shape[1:])
            terms["pos_embedding"] = _dense_terms(dd.sum(1), t[params["pos_embedding"]])
            terms["cls_token"] = _dense_terms(dd[:, :, 0].sum(1), t[params["cls_token"]])
        return terms


def autograd_terms(model: nn.Module, x: Tensor, labels: Tensor, targets: list[Tensor]) -> MatchTerms:
    """The same terms for ONE job by plain autograd: the reference, and the path for models that
    ``PerJobGradients`` does not support (BatchNorm). targets[p]: (1, *param_shape)."""
    params = [p for p in model.parameters()]
    loss = F.cross_entropy(model(x), labels)
    grads = torch.autograd.grad(loss, params, create_graph=True, allow_unused=True)
    dots, norms, tnorms = [], [], []
    for g, p, tgt in zip(grads, params, targets):
        g = torch.zeros_like(p) if g is None else g
        dots.append((g * tgt[0]).sum().reshape(1))
        norms.append(g.pow(2).sum().reshape(1))
        tnorms.append(tgt.pow(2).sum().reshape(1))
    names = [n for n, _ in model.named_parameters()]
    return MatchTerms(torch.stack(dots), torch.stack(norms), torch.stack(tnorms), names)
