"""attacker.engine.job_adam: Adam on stacked rows equals one torch.optim.Adam per row, element for element,
with per-row learning rates (a plateau lowers one job's) and per-row step counts (jobs start and stop
apart); rows that do not move keep their values."""

from __future__ import annotations

import torch

from attacker.engine.job_adam import adam_factors, adam_rows_


def test_stacked_rows_step_like_one_adam_per_row() -> None:
    g = torch.Generator().manual_seed(0)
    rows, shape = 5, (2, 6, 6)
    start = torch.randn(rows, *shape, generator=g)
    lr = [0.1 / (j + 1) for j in range(rows)]
    stacked = start.clone()
    m, v = torch.zeros_like(stacked), torch.zeros_like(stacked)
    singles = [torch.nn.Parameter(start[j].clone()) for j in range(rows)]
    opts = [torch.optim.Adam([p], lr=lr[j], betas=(0.9, 0.999)) for j, p in enumerate(singles)]
    steps = [0] * rows
    for it in range(15):
        grad = torch.randn(rows, *shape, generator=g)
        if it == 3:
            grad[4] = float("nan")  # a diverged job: it does not move, and its NaN does not spread
        moving = [not (j == 3 and it < 4) and not (j == 1 and it > 9) and not (j == 4 and it >= 3) for j in range(rows)]
        if it == 6:
            lr[2] *= 0.5  # what a plateau does to one job
            opts[2].param_groups[0]["lr"] = lr[2]
        for j in range(rows):
            if moving[j]:
                steps[j] += 1
                singles[j].grad = grad[j].clone()
                opts[j].step()
        before = stacked.clone()
        size, corr = adam_factors(lr, steps, moving)
        adam_rows_(stacked, grad, m, v, size, corr, torch.tensor(moving))
        for j in range(rows):
            if not moving[j]:
                assert torch.equal(stacked[j], before[j])
    for j in range(rows):
        assert torch.equal(stacked[j], singles[j].detach()), j  # bit for bit
    assert torch.isfinite(stacked).all()


def test_plateau_step_lowers_the_rate_when_torchs_scheduler_does() -> None:
    from attacker.engine.job_adam import plateau_step

    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.Adam([param], lr=0.1)
    scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, mode="min", factor=0.1, patience=3)
    g = torch.Generator().manual_seed(1)
    # falling, then flat (with tiny relative gains under the 1e-4 threshold), then falling, then flat
    losses = (
        [1.0, 0.9, 0.8]
        + [0.8 * (1 - 5e-5)] * 6
        + [0.5, 0.4]
        + [0.4 + 0.01 * float(torch.rand(1, generator=g)) for _ in range(12)]
    )
    lr, best, bad = 0.1, float("inf"), 0
    for loss in losses:
        scheduler.step(loss)
        lr, best, bad = plateau_step(lr, best, bad, loss, patience=3, factor=0.1)
        assert lr == opt.param_groups[0]["lr"] and bad == scheduler.num_bad_epochs
    assert lr < 0.01  # it was lowered twice along the way
