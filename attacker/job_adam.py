"""One Adam step for many victim jobs at once.

Every job keeps its own ``torch.optim.Adam`` (its state, its learning rate that its own
``ReduceLROnPlateau`` lowers, its checkpointed ``state_dict``); only the arithmetic of the step is
done here, for all jobs together, with torch's ``_foreach`` kernels. Why by hand: calling 128 small
optimizers one after another cost 62% of a V = 128 MLP iteration on CPU (measured: 44 of 71 ms, most
of it Python and dispatch overhead per call), and torch has no optimizer over parameters that live in
different optimizers with different learning rates and step counts.

The arithmetic is torch.optim.Adam's single-tensor path (its default on CPU) with amsgrad, weight decay
and maximize off, the settings the attacks use; tests/test_job_adam.py checks the result against
``Adam.step()`` element for element. An optimizer with other settings is stepped by ``step()`` itself.
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch


def _plain(group: dict) -> bool:
    return (not group.get("amsgrad") and not group.get("maximize") and group.get("weight_decay", 0) == 0
            and not group.get("capturable") and not group.get("differentiable") and not torch.is_tensor(group["lr"]))


@torch.no_grad()
def adam_step_all(optimizers: list[torch.optim.Adam]) -> None:
    """``opt.step()`` for every optimizer in ``optimizers``, batched across them."""
    # (beta1, beta2, eps) -> params, grads, first moments, second moments, step sizes, sqrt(bias correction 2)
    groups: dict[tuple[float, float, float], tuple[list, list, list, list, list, list]] = defaultdict(
        lambda: ([], [], [], [], [], []))
    steps: list[torch.Tensor] = []
    for opt in optimizers:
        if not all(_plain(group) for group in opt.param_groups):
            opt.step()
            continue
        for group in opt.param_groups:
            beta1, beta2 = group["betas"]
            lists = groups[(beta1, beta2, group["eps"])]
            corrections: tuple[float, float] | None = None
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = opt.state[p]
                if not state:  # as Adam._init_group creates it
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                if corrections is None:  # a job's parameters share their step count: computed once for them
                    step = state["step"].item() + 1
                    corrections = (-group["lr"] / (1 - beta1**step), math.sqrt(1 - beta2**step))
                steps.append(state["step"])
                lists[0].append(p)
                lists[1].append(p.grad)
                lists[2].append(state["exp_avg"])
                lists[3].append(state["exp_avg_sq"])
                lists[4].append(corrections[0])
                lists[5].append(corrections[1])
    if steps:
        torch._foreach_add_(steps, 1.0)
    for (beta1, beta2, eps), (params, grads, avgs, sqs, step_sizes, bc2_sqrt) in groups.items():
        if not params:
            continue
        torch._foreach_lerp_(avgs, grads, 1 - beta1)
        torch._foreach_mul_(sqs, beta2)
        torch._foreach_addcmul_(sqs, grads, grads, 1 - beta2)
        denom = torch._foreach_sqrt(sqs)
        torch._foreach_div_(denom, bc2_sqrt)
        torch._foreach_add_(denom, eps)
        torch._foreach_addcdiv_(params, avgs, denom, step_sizes)
