"""FedAvg rounds: capture of training updates, the exact replay of the client's local steps, the
K = 1 equivalence with the one-step attack, and bad update captures."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from flower_harness import NODE_IDS, FakeGrid, client_context, offline_config, set_task_identity
from flwr.app import ArrayRecord, ConfigRecord
from torch.utils.data import TensorDataset

from attacker.attacks import make_attack
from attacker.captures import jobs_from_captures
from attacker.cli import main as attacker_main
from attacker.engine.replay import replay_terms
from attacker.engine.runner import run_jobs
from attacker.jobs import as_one_gradient, exact_as_gradient, jobs_from_images, model_from_job
from fedsim import task
from fedsim.capture import list_captures
from fedsim.client_app import handle_train
from fedsim.client_step import LocalPlan, OptimizerSpec, Schedule, one_step_plan, run_local_round
from fedsim.models import ModelSpec
from fedsim.strategy import CuriousFedAvg

_context = client_context


@pytest.fixture(scope="module", autouse=True)
def task_identity() -> None:
    set_task_identity()


def _captured_round(tmp_path: Path, **overrides: Any) -> Path:
    """One update-capture round of two in-process clients, audited, written as a run folder."""
    cfg = offline_config(
        {
            "audit": True,
            "model-options": '{"width": 64}',
            "capture-kind": "update",
            "capture-images": 4,
            "batch-size": 1,
            "batch-order": "in-order",
            **overrides,
        }
    )
    strategy = CuriousFedAvg(
        task.model_spec(cfg),
        capture_rounds="all",
        capture_kind="update",
        capture_dir=tmp_path / "captures",
        oracle_dir=tmp_path / "oracle",
        min_available_nodes=2,
        min_train_nodes=2,
        fraction_evaluate=0.0,
    )
    arrays = ArrayRecord(task.make_model(cfg).state_dict())
    messages = list(strategy.configure_train(1, arrays, ConfigRecord(dict(cfg)), FakeGrid()))
    replies = [
        handle_train(m, _context(NODE_IDS.index(m.metadata.dst_node_id), m.metadata.dst_node_id)) for m in messages
    ]
    strategy.aggregate_train(1, replies)
    assert not strategy.failures
    return tmp_path


@pytest.mark.parametrize("optimizer,lr", [("sgd", 0.05), ("sgd-momentum", 0.05), ("adam", 1e-3)])
def test_replay_with_the_oracle_reproduces_the_captured_update(tmp_path: Path, optimizer: str, lr: float) -> None:
    extra = {"optimizer": "sgd", "momentum": 0.9} if optimizer == "sgd-momentum" else {"optimizer": optimizer}
    run = _captured_round(tmp_path, lr=lr, **extra)
    jobs, oracles, skipped = jobs_from_captures(list_captures(run), run)
    assert not skipped and len(jobs) == 2
    for job, oracle in zip(jobs, oracles):
        assert job.kind == "update" and job.steps == [[0], [1], [2], [3]] and job.batch_size == 4
        assert job.plan.optimizer.name == "sgd" if optimizer != "adam" else job.plan.optimizer.name == "adam"
        assert job.label_source == "known" and len(oracle.masks) == 4 * 3  # K steps x 3 dropout layers
        model = model_from_job(job)
        for p in model.parameters():
            p.requires_grad_(False)
        masks = [[m.float() for m in oracle.masks[t * 3 : (t + 1) * 3]] for t in range(4)]
        terms = replay_terms(
            model, dict(model.named_parameters()), job.plan, [oracle.images], [job.labels], [masks], [job.gradient]
        )
        # the replay's Δ equals the captured one: <Δ, Δ*> = ||Δ||² = ||Δ*||² to float precision
        total = terms.target_norm2.sum()
        assert total > 0
        torch.testing.assert_close(terms.norm2.sum(), total, rtol=1e-5, atol=0)
        torch.testing.assert_close(terms.dot.sum(), total, rtol=1e-5, atol=0)


def test_k1_plain_sgd_update_is_the_one_step_attack(mnist_like: tuple[torch.Tensor, torch.Tensor], tmp_path: Path):
    """A FedAvg round of one plain SGD step on all images, captured as an update, is attacked exactly
    like the paper's one-step round: the same gradient bits, so the same reconstruction."""
    x, y = mnist_like
    spec = ModelSpec("mlp", "mnist", 0.25, 0, {"width": 64})
    batches = [(x[:2], y[:2]), (x[2:4], y[2:4])]
    lr = 0.01
    plan = LocalPlan(Schedule(epochs=1, batch_size=0, order="in-order"), OptimizerSpec("sgd", lr), float64_weights=True)
    upd_jobs, _ = jobs_from_images(spec, batches, plan=plan)
    assert all(exact_as_gradient(j) for j in upd_jobs)
    converted = [as_one_gradient(j) for j in upd_jobs]
    # the one-step round as the ClientApp runs it, and the gradient as the curious server recovers it
    grad_jobs = []
    for job, (images, labels) in zip(upd_jobs, batches):
        model = model_from_job(job)
        result = run_local_round(model, TensorDataset(images, labels), one_step_plan(lr, seed=job.plan.seed))
        names = [n for n, _ in model.named_parameters()]
        gradient = [((job.weights[n].double() - result.weights[n].double()) / lr).float() for n in names]
        grad_jobs.append(dataclasses.replace(job, gradient=gradient, plan=None))
    for g, u in zip(grad_jobs, converted):
        assert all(torch.equal(a, b) for a, b in zip(g.gradient, u.gradient))
    attacks = [make_attack("dia", max_iterations=15)] * 2
    one = run_jobs(grad_jobs, attacks, None, tmp_path / "a", progress=False)
    two = run_jobs(converted, attacks, None, tmp_path / "b", progress=False)
    for a, b in zip(one, two):
        assert torch.equal(a.images, b.images) and a.losses == b.losses


def test_update_attack_runs_end_to_end_from_captures(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = _captured_round(tmp_path / "fed", lr=0.05, optimizer="sgd")
    out = tmp_path / "attack"
    code = attacker_main(
        [
            "run",
            "--captures",
            str(run),
            "--attacks",
            "ig_eval",
            "wiig",
            "dia",
            "dia_onestep",
            "--iterations",
            "6",
            "--no-lpips",
            "--quiet",
            "--out",
            str(out),
        ]
    )
    text = capsys.readouterr().out
    assert code == 0, text
    assert "client updates of 4 local steps" in text and "victim-it/s" in text
    rows = (out / "metrics.csv").read_text().splitlines()
    attacks = {line.split(",")[1] for line in rows[1:]}
    assert attacks == {"ig_eval", "wiig", "dia", "dia_onestep"}


def _edit_capture(run: Path, change) -> None:
    import hashlib
    import json

    for record in list_captures(run):
        meta = json.loads((record / "record.json").read_text())
        change(meta)
        meta["tensors_sha256"] = hashlib.sha256((record / "tensors.safetensors").read_bytes()).hexdigest()
        (record / "record.json").write_text(json.dumps(meta))


@pytest.mark.parametrize(
    "change,words",
    [
        (lambda m: m["hyperparameters"].update(optimizer="rmsprop"), "optimizer must be one of"),
        (lambda m: m["hyperparameters"].pop("lr"), "lack lr"),
        (lambda m: m.update(local_steps=7), "the client reported 7"),
        (
            lambda m: (
                m["hyperparameters"].update({"batch-order": "shuffled", "local-epochs": 2}),
                m.update(local_steps=8),
            ),
            "shuffled across 2 epochs",
        ),
    ],
)
def test_bad_update_captures_give_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str], change, words) -> None:
    run = _captured_round(tmp_path / "fed", lr=0.05, optimizer="sgd")
    _edit_capture(run, change)
    out = tmp_path / "attack"
    assert (
        attacker_main(["run", "--captures", str(run), "--iterations", "2", "--no-lpips", "--quiet", "--out", str(out)])
        == 2
    )
    text = capsys.readouterr().out.strip()
    assert words in text and "Traceback" not in text and text.startswith("error:")
    assert not out.exists()


def test_a_round_too_large_to_unroll_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "big.yaml"
    cfg.write_text(
        "victims: {source: builtin, victim_batch_size: 8, count: 8, data_root: data,\n"
        "  local_round: {local_epochs: 50, batch_size: 1, optimizer: sgd, lr: 0.01}}\n"
        "max_unroll_gb: 0.01\nlpips: false\n"
    )
    out = tmp_path / "attack"
    code = attacker_main(["run", str(cfg), "--iterations", "2", "--quiet", "--out", str(out)])
    text = capsys.readouterr().out
    if "OFFLINE" not in text and "not found" in text and code == 2 and "data" in text:
        pytest.skip("no offline MNIST sample")
    assert code == 2 and "too large to unroll" in text and "limit 0.01 GB" in text, text
    assert not out.exists()


def test_a_corrupt_capture_in_a_live_attack_is_skipped(tmp_path: Path) -> None:
    run = _captured_round(tmp_path / "fed", lr=0.05, optimizer="sgd")
    first, second = list_captures(run)
    (first / "tensors.safetensors").write_bytes(b"garbage")
    jobs, _, skipped = jobs_from_captures([first, second], run, skip_bad=True)
    assert len(jobs) == 1 and len(skipped) == 1 and "corrupt" in skipped[0]
    shutil.rmtree(run)


def test_live_watch_attacks_update_captures(tmp_path: Path) -> None:
    from attacker.config import parse_config
    from attacker.live import watch

    run = _captured_round(tmp_path / "fed", lr=0.05, optimizer="sgd")
    (run / "results.json").write_text("{}")  # the federation has finished: the watch ends after one pass
    cfg = parse_config(
        {
            "victims": {"source": "captures", "captures": str(run)},
            "attacks": ["wiig", "dia"],
            "attack_overrides": {"max_iterations": 3},
            "lpips": False,
        }
    )
    summaries = watch(run, tmp_path / "live", cfg, poll_s=0.01, log=lambda m: None)
    assert len(summaries) == 1 and len(summaries[0]["rows"]) == 4
    assert {r["batch_size"] for r in summaries[0]["rows"]} == {4}


# -- an unknown batch order: one dummy copy per epoch, tied by the order-invariant prior ----------------


def _shuffled_two_epoch_round(tmp_path: Path) -> Path:
    return _captured_round(
        tmp_path, lr=0.05, optimizer="sgd", **{"batch-order": "shuffled", "local-epochs": 2, "batch-size": 2}
    )


def test_unknown_order_replay_with_the_oracle_reproduces_a_shuffled_update(tmp_path: Path) -> None:
    from attacker.jobs import unknown_order
    from fedsim.capture import find_oracle, load_capture

    run = _shuffled_two_epoch_round(tmp_path)
    jobs, _, _ = jobs_from_captures(list_captures(run), run, replay_order="unknown")
    assert len(jobs) == 2
    for path, job in zip(list_captures(run), jobs):
        record = find_oracle(run, load_capture(path))
        used = [i for batch in record.batches for i in batch]  # the client's order: 2 epochs of 4 images
        assert len(used) == 8 and sorted(used[:4]) == sorted(used[4:]) == [0, 1, 2, 3]
        assert torch.equal(job.step_labels, record.labels[torch.tensor(used)])  # disclosed per step
        copies = unknown_order(job)
        assert copies.copies == 2 and copies.batch_size == 8 and copies.steps == [[0, 1], [2, 3], [4, 5], [6, 7]]
        model = model_from_job(copies)
        for p in model.parameters():
            p.requires_grad_(False)
        masks = [[m.float() for m in record.masks[t * 3 : (t + 1) * 3]] for t in range(4)]
        # copy e holds epoch e's images in the order epoch e used them: the replay is the client's round
        images = record.images.float()[torch.tensor(used)]
        terms = replay_terms(
            model, dict(model.named_parameters()), copies.plan, [images], [copies.labels], [masks], [copies.gradient]
        )
        total = terms.target_norm2.sum()
        assert total > 0
        torch.testing.assert_close(terms.norm2.sum(), total, rtol=1e-5, atol=0)
        torch.testing.assert_close(terms.dot.sum(), total, rtol=1e-5, atol=0)


def test_shuffled_epochs_need_the_unknown_order_and_its_step_labels(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from fedsim.capture import CaptureError

    run = _shuffled_two_epoch_round(tmp_path / "fed")
    assert (
        attacker_main(
            [
                "run",
                "--captures",
                str(run),
                "--iterations",
                "2",
                "--no-lpips",
                "--quiet",
                "--out",
                str(tmp_path / "known"),
            ]
        )
        == 2
    )
    text = capsys.readouterr().out.strip()
    assert "shuffled across 2 epochs" in text and "replay_order: unknown" in text and text.startswith("error:")
    out = tmp_path / "unknown"
    code = attacker_main(
        [
            "run",
            "--captures",
            str(run),
            "--attacks",
            "wiig",
            "dia",
            "--replay-order",
            "unknown",
            "--iterations",
            "3",
            "--no-lpips",
            "--quiet",
            "--out",
            str(out),
        ]
    )
    text = capsys.readouterr().out
    assert code == 0, text
    rows = (out / "metrics.csv").read_text().splitlines()
    assert len(rows) == 1 + 2 * 2 and ",4," in rows[1]  # scored as the client's N = 4 images

    import hashlib
    import json

    from safetensors.torch import load as st_load
    from safetensors.torch import save as st_save

    for record in list_captures(run):  # as a record written before per-step labels
        tensors = st_load((record / "tensors.safetensors").read_bytes())
        tensors.pop("step_labels")
        blob = st_save(tensors, metadata={"format": "fedsim.capture", "schema_version": "1"})
        (record / "tensors.safetensors").write_bytes(blob)
        meta = json.loads((record / "record.json").read_text())
        meta["tensors_sha256"] = hashlib.sha256(blob).hexdigest()
        (record / "record.json").write_text(json.dumps(meta))
    with pytest.raises(CaptureError, match="lacks per-step labels"):
        jobs_from_captures(list_captures(run), run, replay_order="unknown")


def test_unknown_order_attack_on_offline_victims_runs_and_is_scored(
    mnist_like: tuple[torch.Tensor, torch.Tensor], tmp_path: Path
) -> None:
    from attacker.jobs import unknown_order
    from attacker.scoring import score_results

    x, y = mnist_like
    spec = ModelSpec("mlp", "mnist", 0.25, 0, {"width": 64})
    plan = LocalPlan(Schedule(epochs=2, batch_size=2, order="shuffled"), OptimizerSpec("sgd", 0.05))
    jobs, oracles = jobs_from_images(spec, [(x, y)], plan=plan)
    assert jobs[0].steps != [[0, 1], [2, 3]] * 2  # the client's order was shuffled
    copies = [unknown_order(j) for j in jobs]
    attack = make_attack("dia", max_iterations=4, replay_order="unknown")
    results = run_jobs(copies, [attack], None, tmp_path / "run", progress=False)
    assert results[0].images.shape == (4, 1, 28, 28) and len(results[0].losses) == 4
    rows = score_results(jobs, oracles, results, None)
    assert len(rows) == 1 and rows[0]["batch_size"] == 4


def test_the_order_prior_is_zero_for_permuted_copies() -> None:
    from attacker.engine.objectives import copies_prior

    g = torch.Generator().manual_seed(0)
    copy = torch.randn(4, 1, 6, 6, generator=g)
    tied = torch.cat([copy, copy[torch.tensor([2, 0, 3, 1])]])
    other = torch.cat([copy, torch.randn(4, 1, 6, 6, generator=g)])
    values = copies_prior(torch.cat([tied, other]), 2, 2)
    assert values[0].abs() < 1e-12 and values[1] > 1e-3
    assert copies_prior(copy, 1, 1).abs().max() == 0  # one copy (a known order): nothing to tie


def test_a_shuffled_single_epoch_is_replayed_in_step_order(tmp_path: Path) -> None:
    """One epoch in a shuffled order is only a relabelling of the dummies: dummy i takes the label of
    the image the client used i-th, and the replay with those images and the true masks gives Δ back."""
    from fedsim.capture import find_oracle, load_capture

    run = _captured_round(tmp_path, lr=0.05, optimizer="sgd", **{"batch-order": "shuffled"})
    jobs, oracles, _ = jobs_from_captures(list_captures(run), run)
    for path, job, oracle in zip(list_captures(run), jobs, oracles):
        record = find_oracle(run, load_capture(path))
        order = [i for batch in record.batches for i in batch]
        assert sorted(order) == [0, 1, 2, 3] and torch.equal(job.labels, record.labels[order])
        model = model_from_job(job)
        for p in model.parameters():
            p.requires_grad_(False)
        masks = [[m.float() for m in oracle.masks[t * 3 : (t + 1) * 3]] for t in range(4)]
        assert torch.equal(oracle.images, record.images[order].float())  # the truth in the replay's order
        terms = replay_terms(
            model, dict(model.named_parameters()), job.plan, [oracle.images], [job.labels], [masks], [job.gradient]
        )
        torch.testing.assert_close(terms.dot.sum(), terms.target_norm2.sum(), rtol=1e-5, atol=0)
