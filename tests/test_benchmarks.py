"""The benchmarks: the plain baseline (one victim at a time, autograd on the weights) runs the same
attack as the batched engine (same losses, step by step, from the same start); the GPU check says
in one line that there is no GPU."""

import gpu_check  # benchmarks/ is on the test path (pyproject's pythonpath)
import pytest
import torch
from attack_throughput import engine_step, make_module
from plain_baseline import plain_attacks, run_plain


@pytest.mark.parametrize(
    "model,dataset,weights",
    [
        ("mlp", "mnist", {}),
        ("mlp", "mnist", {"tv_weight": 0.1, "lambda_mask": 0.1}),  # large enough that a missing term shows
        ("lenet", "mnist", {}),
    ],
)
def test_plain_loop_runs_the_engines_attack(model, dataset, weights):
    torch.manual_seed(0)
    V, steps = 2, 3
    module = make_module(model, dataset, V, **weights)
    engine = [engine_step(module) for _ in range(steps)]  # engine[i][j]: step i, job j
    _, plain = run_plain(plain_attacks(make_module(model, dataset, V, **weights), V), steps)  # plain[j][i]
    for j in range(V):
        got = torch.tensor(plain[j])
        want = torch.tensor([engine[i][j] for i in range(steps)])
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert len(set(plain[0])) == steps  # the dummies do move


def test_gpu_check_without_a_gpu_exits_with_one_line(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_check.main() == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err.count("\n") == 1 and "no CUDA GPU" in out.err


def test_bench_times_the_bf16_path_beside_the_others(capsys):
    from attack_throughput import main

    rows = main(
        ["--models", "mlp", "--jobs", "2", "--iterations", "1", "--repeats", "1", "--baseline-victims", "1", "--bf16"]
    )
    assert [r["path"] for r in rows] == ["baseline", "dense", "factored", "fact+bf16"]
    assert all(r["rate"] > 0 for r in rows)
    line = next(x for x in capsys.readouterr().out.splitlines() if "fact+bf16" in x)
    error = float(line.split("by up to ")[1].split(" %")[0])
    assert 0 < error < 50  # bf16 moves the losses a little, not wholesale


def test_adam_span_shows_sgd_in_the_images_span_and_adam_out_of_it():
    from adam_span import measure

    rows = {(r["optimizer"], r["B"]): r for r in measure([1, 8], jobs=1)}
    assert rows["sgd", 1]["in span"] > 0.9999 and rows["sgd", 8]["in span"] > 0.9999  # D^T X, exactly
    assert rows["adam", 8]["in span"] < 0.95  # Adam's elementwise step leaves the span
    assert rows["adam", 1]["sign fit"] > 0.999 > rows["sgd", 1]["sign fit"]  # one image: u sign(x)^T


def test_hold_share_holds_the_first_n_true_images_and_refuses_a_taken_folder(tmp_path, capsys):
    from types import SimpleNamespace

    from hold_share import held_truth, main

    truth = torch.rand(4, 1, 28, 28)
    guess = held_truth({"job0": truth}, 2)(None, SimpleNamespace(job_id="job0"))
    assert guess.held.tolist() == [True, True, False, False]
    assert torch.equal(guess.images[:2], truth[:2]) and not torch.equal(guess.images[2:], truth[2:])
    (tmp_path / "held2").mkdir()
    assert main(["--held", "2", "--out", str(tmp_path)]) == 2  # before loading anything
    assert main(["--held", "64", "--out", str(tmp_path / "new")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 2 and "held2 exists" in err and "the batch size 64)" in err
    assert not (tmp_path / "new").exists()
