"""The classifier's input features as a constraint: each job's target from its gradient (closed form
(c), ``closed_form.solvers.last_linear_features``), and the dummies' features read off the same layer
during the engine's forward pass, for ``objectives``' features term (weight ``lambda_features``)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..closed_form.solvers import NotApplicable, find_last_linear, last_linear_features
from ..jobs import VictimJob


class FeatureTargets(nn.Module):
    """Per job the target features (a row of ``targets``) and whether it has one (``has``); a hook on
    the model's last Linear keeps the input of the latest forward pass (the dummies' features)."""

    def __init__(self, jobs: list[VictimJob], model: nn.Module) -> None:
        super().__init__()
        shape = tuple(jobs[0].spec.input_shape)
        try:
            layer = find_last_linear(model, shape)
        except NotApplicable:
            layer = None
        rows, has = [], []
        for job in jobs:
            try:
                if layer is None:
                    raise NotApplicable("no last Linear")
                rows.append(last_linear_features(layer, job, model).values[0])
                has.append(True)
            except NotApplicable:  # an update, or B > 1: no closed form for this job's features
                has.append(False)
        width = rows[0].numel() if rows else 1
        filled = [rows.pop(0) if h else torch.zeros(width) for h in has]
        self.register_buffer("targets", torch.stack(filled), persistent=False)
        self.has = has
        self.seen: list[Tensor] = []
        self._hook = layer.module.register_forward_pre_hook(self._keep) if layer is not None and any(has) else None

    def _keep(self, module: nn.Module, args: tuple) -> None:
        self.seen.append(args[0])

    def dummies(self, num_rows: int) -> Tensor | None:
        """The dummies' features of the latest forward pass (a pass run twice: its last), then cleared."""
        if not self.seen:
            return None
        out = self.seen[-1].reshape(num_rows, -1)
        self.seen.clear()
        return out
