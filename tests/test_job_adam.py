"""attacker.job_adam steps many jobs' Adam optimizers at once: element for element what each
optimizer's own step() gives, with per-job learning rates (a plateau scheduler lowers them apart)
and per-job step counts (jobs start and stop at different iterations)."""

from __future__ import annotations

import copy

import torch

from attacker.job_adam import adam_step_all


def _jobs(n: int) -> list[torch.optim.Adam]:
    g = torch.Generator().manual_seed(0)
    opts = []
    for j in range(n):
        params = [torch.nn.Parameter(torch.randn(1, 1, 6, 6, generator=g)),
                  torch.nn.Parameter(torch.rand(20, generator=g))]
        opts.append(torch.optim.Adam(params, lr=0.1 / (j + 1), betas=(0.9, 0.999)))
    return opts


def _grads(opts: list[torch.optim.Adam], seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for opt in opts:
        for p in opt.param_groups[0]["params"]:
            p.grad = torch.randn(p.shape, generator=g)


def test_batched_step_equals_each_optimizers_own_step() -> None:
    ours = _jobs(5)
    theirs = copy.deepcopy(ours)
    for it in range(12):
        stepping = [j for j in range(5) if not (j == 3 and it < 4) and not (j == 1 and it > 8)]
        _grads(ours, it)
        _grads(theirs, it)
        if it == 6:
            for opts in (ours, theirs):
                opts[2].param_groups[0]["lr"] *= 0.5  # what a plateau scheduler does to one job
        adam_step_all([ours[j] for j in stepping])
        for j in stepping:
            theirs[j].step()
    for a, b in zip(ours, theirs):
        for p, q in zip(a.param_groups[0]["params"], b.param_groups[0]["params"]):
            torch.testing.assert_close(p, q, rtol=0, atol=0)
            torch.testing.assert_close(a.state[p]["exp_avg_sq"], b.state[q]["exp_avg_sq"], rtol=0, atol=0)
            assert float(a.state[p]["step"]) == float(b.state[q]["step"])
    # the state is Adam's own: a batched optimizer's state_dict loads into a plain Adam and back
    fresh = _jobs(5)[0]
    fresh.load_state_dict(ours[0].state_dict())
    assert float(fresh.state[fresh.param_groups[0]["params"][0]]["step"]) == 12


def test_an_optimizer_with_other_settings_takes_its_own_step() -> None:
    (plain,) = _jobs(1)
    decayed = torch.optim.Adam([torch.nn.Parameter(torch.ones(3))], lr=0.1, weight_decay=0.1)
    reference = copy.deepcopy(decayed)
    _grads([plain], 0)
    for opt in (decayed, reference):
        opt.param_groups[0]["params"][0].grad = torch.full((3,), 0.5)
    adam_step_all([plain, decayed])
    reference.step()
    torch.testing.assert_close(decayed.param_groups[0]["params"][0], reference.param_groups[0]["params"][0])
