"""Experiment grids: axes expanded into cells, with exceptions (attacker.experiments.spec.expand_grid).

The main test: every file in configs/experiments/ expands to exactly the cells of the snapshot
tests/data/experiment_cells.json, taken from the hand-written cell lists before the files became grids
(every Cell field, in cell order, and the experiment's own fields). Regenerate the snapshot only when the
cells are meant to change: ``.venv/bin/python tests/test_experiment_grids.py --write``.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from attacker.experiments import ExperimentError, load_experiment, parse_experiment
from attacker.experiments.spec import expand_grid

ROOT = Path(__file__).resolve().parents[1]
EXPERIMENTS = ROOT / "configs" / "experiments"
SNAPSHOT = ROOT / "tests" / "data" / "experiment_cells.json"


def _plain(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def expansion(folder: Path = EXPERIMENTS) -> dict[str, Any]:
    """Per experiment file (by stem): the Experiment's fields but cells and path, and ``cells``: every
    Cell field of every cell, in order."""
    out = {}
    for path in sorted(Path(folder).glob("*.yaml")):
        exp = load_experiment(path)
        entry = {
            f.name: _plain(getattr(exp, f.name)) for f in dataclasses.fields(exp) if f.name not in ("cells", "path")
        }
        entry["cells"] = [_plain(dataclasses.asdict(cell)) for cell in exp.cells]
        out[path.stem] = entry
    return out


def dump(data: dict[str, Any]) -> str:
    return json.dumps(data, indent=1, sort_keys=True) + "\n"


def test_every_experiment_file_expands_to_the_snapshot() -> None:
    want = json.loads(SNAPSHOT.read_text())
    have = json.loads(dump(expansion()))  # through JSON, as the snapshot went
    assert sorted(have) == sorted(want)
    for name in want:
        for key in want[name]:
            if key != "cells":
                assert have[name][key] == want[name][key], f"{name}: {key}"
        ids = [c["id"] for c in have[name]["cells"]]
        assert ids == [c["id"] for c in want[name]["cells"]], f"{name}: cell ids or their order"
        for got, cell in zip(have[name]["cells"], want[name]["cells"]):
            assert got == cell, f"{name}: cell {cell['id']}"
        assert have[name] == want[name]


# ---- the grid expansion itself ---------------------------------------------------------------------


def _ids(cells: list[tuple[str, dict[str, Any]]]) -> list[str]:
    return [raw["id"] for _, raw in cells]


def _exp(**data: Any) -> Any:
    return parse_experiment({"name": "t", **data})


def test_axes_expand_as_a_product_first_axis_outermost() -> None:
    cells = expand_grid(
        {
            "id": "{model}-{dataset}-p{p}",
            "cell": {"attacks": ["dia"]},
            "axes": {"dataset": ["mnist", "cifar10"], "model": ["mlp", "vit"], "p": [0.0, 0.25]},
        }
    )
    assert _ids(cells) == [
        "mlp-mnist-p0",
        "mlp-mnist-p0.25",
        "vit-mnist-p0",
        "vit-mnist-p0.25",
        "mlp-cifar10-p0",
        "mlp-cifar10-p0.25",
        "vit-cifar10-p0",
        "vit-cifar10-p0.25",
    ]
    assert cells[1][1] == {"id": "mlp-mnist-p0.25", "dataset": "mnist", "model": "mlp", "p": 0.25, "attacks": ["dia"]}
    assert cells[1][0] == "grid cell mlp-mnist-p0.25"


def test_default_id_is_an_explicit_cells_default_and_patterns_format() -> None:
    exp = _exp(
        grids=[
            {
                "cell": {"model": "mlp", "dataset": "mnist", "attacks": ["dia"]},
                "axes": {"p": [0.5], "victim_batch_size": [1, 16]},
            }
        ]
    )
    assert [c.id for c in exp.cells] == ["mlp-mnist-p0.5-B1", "mlp-mnist-p0.5-B16"]
    with pytest.raises(ExperimentError, match=r"\{p\} is neither an axis nor a field"):
        expand_grid({"id": "{model}-p{p}", "cell": {"model": "vit"}, "axes": {"overrides.lambda_mask": [0.0]}})
    cells = expand_grid(
        {
            "id": "{model}-lm{overrides.lambda_mask}-B{victim_batch_size}",
            "cell": {"model": "vit"},
            "axes": {"overrides.lambda_mask": [0.0, 0.0001, 1e-05]},
        }
    )
    assert _ids(cells) == ["vit-lm0-B1", "vit-lm0.0001-B1", "vit-lm1e-05-B1"]
    assert [raw["overrides"] for _, raw in cells] == [
        {"lambda_mask": 0.0},
        {"lambda_mask": 0.0001},
        {"lambda_mask": 1e-05},
    ]
    cells = expand_grid({"id": "{model}-p{p:.2f}", "cell": {"model": "vit"}, "axes": {"p": [0.25]}})
    assert _ids(cells) == ["vit-p0.25"]


def test_named_axis_values_set_fields_together_and_the_template_fills_the_rest() -> None:
    cells = expand_grid(
        {
            "id": "{model}-{defense}",
            "cell": {"federation": {"onestep_lr": 100.0}, "paper": {"accuracy": None, "dia": {"ssim": None}}},
            "axes": {
                "model": ["mlp"],
                "defense": {
                    "none": None,
                    "ldp-eps10": {"federation": {"defense": "local-dp", "dp_epsilon": 10.0}},
                    "fast": {"federation": {"onestep_lr": 1.0}},
                },
            },
        }
    )
    assert _ids(cells) == ["mlp-none", "mlp-ldp-eps10", "mlp-fast"]
    feds = [raw["federation"] for _, raw in cells]
    assert feds == [
        {"onestep_lr": 100.0},
        {"defense": "local-dp", "dp_epsilon": 10.0, "onestep_lr": 100.0},
        {"onestep_lr": 1.0},
    ]  # the axes win over the template
    assert list(feds[1]) == ["defense", "dp_epsilon", "onestep_lr"]  # the template's keys after the axes'
    assert cells[0][1]["paper"] == {"accuracy": None, "dia": {"ssim": None}}
    assert cells[0][1]["paper"] is not cells[1][1]["paper"]  # copies, not shared


def test_exceptions_set_and_drop_matching_values_lists_globs_and_ids() -> None:
    grid = {
        "id": "{model}-p{p}-{defense}",
        "cell": {"attacks": ["ig_eval", "dia"]},
        "axes": {
            "model": ["mlp", "lenet"],
            "p": [0.0, 0.5],
            "defense": {
                "ldp-eps1": {"federation": {"defense": "local-dp"}},
                "prune0.5": {"federation": {"defense": "prune"}},
            },
        },
        "exceptions": [
            {"where": {"p": 0}, "set": {"attacks": ["ig_eval"]}},  # 0 == 0.0; lists are replaced
            {"where": {"model": "lenet", "defense": ["ldp-*", "cdp-*"]}, "set": {"federation": {"clip_norm": 0.35}}},
            {"where": {"federation.defense": "prune", "model": "mlp"}, "set": {"optional": True}},
            {"where": {"id": "lenet-p0.5-prune*"}, "drop": True},
            {"where": {"id": "mlp-p0-ldp-eps1"}, "set": {"id": "renamed"}},
        ],
    }
    cells = dict((raw["id"], raw) for _, raw in expand_grid(grid))
    assert list(cells) == [
        "renamed",
        "mlp-p0-prune0.5",
        "mlp-p0.5-ldp-eps1",
        "mlp-p0.5-prune0.5",
        "lenet-p0-ldp-eps1",
        "lenet-p0-prune0.5",
        "lenet-p0.5-ldp-eps1",
    ]
    assert cells["renamed"]["attacks"] == ["ig_eval"] and cells["mlp-p0.5-ldp-eps1"]["attacks"] == ["ig_eval", "dia"]
    assert cells["lenet-p0.5-ldp-eps1"]["federation"] == {"defense": "local-dp", "clip_norm": 0.35}
    assert cells["mlp-p0.5-ldp-eps1"]["federation"] == {"defense": "local-dp"}
    assert cells["mlp-p0-prune0.5"]["optional"] is True and "optional" not in cells["lenet-p0-prune0.5"]


def test_paper_table_by_id_over_the_template() -> None:
    exp = _exp(
        metrics=["ssim", "mmd"],
        grids=[
            {
                "id": "{model}-p{p}",
                "cell": {"dataset": "mnist", "attacks": ["ig_eval", "dia"], "paper": {"ig_eval": {"ssim": None}}},
                "axes": {"model": ["mlp"], "p": [0.0, 0.5]},
                "paper": {"mlp-p0.5": {"dia": {"ssim": 0.9, "mmd": 0.1}, "ig_eval": {"ssim": 0.2}}},
            }
        ],
    )
    assert [c.paper for c in exp.cells] == [
        {"ig_eval": {"ssim": None}},
        {"dia": {"ssim": 0.9, "mmd": 0.1}, "ig_eval": {"ssim": 0.2}},
    ]


@pytest.mark.parametrize("first", ["cells", "grids"])
def test_explicit_cells_and_grids_mix_in_file_order(first: str) -> None:
    parts = {
        "cells": [{"id": "solo", "model": "mlp", "dataset": "mnist", "p": 0.1, "attacks": ["dia"]}],
        "grids": [
            {
                "id": "{model}-p{p}",
                "cell": {"dataset": "mnist", "attacks": ["dia"]},
                "axes": {"model": ["mlp"], "p": [0.25, 0.5]},
            },
            {
                "id": "{model}-p{p}",
                "cell": {"dataset": "cifar10", "attacks": ["dia"]},
                "axes": {"model": ["vit"], "p": [0.25]},
            },
        ],
    }
    data = {"name": "t", first: parts[first], **{k: v for k, v in parts.items() if k != first}}
    ids = [c.id for c in parse_experiment(data).cells]
    grid_ids = ["mlp-p0.25", "mlp-p0.5", "vit-p0.25"]
    assert ids == (["solo", *grid_ids] if first == "cells" else [*grid_ids, "solo"])
    cell = parse_experiment(data).cells[0 if first == "grids" else 1]  # mlp-p0.25
    assert (cell.experiment, cell.model, cell.dataset, cell.p, cell.B) == ("t", "mlp", "mnist", 0.25, 1)


def test_a_grid_file_loads(tmp_path: Path) -> None:
    path = tmp_path / "g.yaml"
    path.write_text(
        "grids:\n- id: '{model}-p{p}'\n  cell: {dataset: mnist, attacks: [dia]}\n"
        "  axes:\n    model: [mlp]\n    p: [0.25, 0.5]\n"
    )
    exp = load_experiment(path)
    assert exp.name == "g" and [c.key for c in exp.cells] == ["g-mlp-p0.25", "g-mlp-p0.5"]


def test_a_cells_caption_shows_the_cap_the_run_used(tmp_path: Path) -> None:
    path = tmp_path / "g.yaml"
    path.write_text(
        "grids:\n- id: '{model}'\n  cell: {dataset: mnist, p: 0.25, attacks: [dia], overrides: {max_iterations: 500}}\n"
        "  axes:\n    model: [mlp]\n"
    )
    (cell,) = load_experiment(path).cells
    assert "max_iterations=500" in cell.label()
    # --iterations replaces the config's cap in the caption, as it does in the run
    assert "max_iterations=4000" in cell.label(4000) and "500" not in cell.label(4000)


GOOD = {
    "id": "{model}-p{p}",
    "cell": {"dataset": "mnist", "attacks": ["dia"]},
    "axes": {"model": ["mlp"], "p": [0.25, 0.5]},
}


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"colour": 1}, r"grids\[0\]: unknown key\(s\) \['colour'\]"),
        ({"axes": {"model": "mlp", "p": [0.25]}}, r"grids\[0\]: axes.model: must be a list of values or a mapping"),
        ({"axes": {"model": [], "p": [0.25]}}, r"axes.model: must not be empty"),
        ({"axes": {}}, r"axes must be a non-empty mapping"),
        ({"axes": {"lambda_mask": [0.0]}}, r"axes.lambda_mask: a list axis is named after the cell field"),
        ({"axes": {"model": {"mlp": {}}}}, r"axes.model: a named axis .* must not be called like a cell field"),
        ({"axes": {"v": {"a": {"colour": 1}}}}, r"axes.v.a: unknown key\(s\) \['colour'\]"),
        ({"cell": {"id": "x", "attacks": ["dia"]}}, r"grids\[0\]: cell: unknown key\(s\) \['id'\]"),
        (
            {"exceptions": [{"where": {"p": 0.75}, "set": {"optional": True}}]},
            r"grids\[0\]: exceptions\[0\]: matches no cell of the grid \(where \{'p': 0.75\}\)",
        ),
        ({"exceptions": [{"where": {"colour": 1}, "drop": True}]}, r"exceptions\[0\]: where.colour is neither an axis"),
        ({"exceptions": [{"where": {"p": 0.5}}]}, r"exceptions\[0\]: needs either set: \(cell fields\) or drop: true"),
        ({"exceptions": [{"where": {"p": 0.5}, "set": {}, "drop": True}]}, r"needs either set"),
        ({"exceptions": [{"where": {"p": 0.5}, "drop": False}]}, r"drop must be true"),
        ({"exceptions": [{"set": {"optional": True}}]}, r"exceptions\[0\]: needs where"),
        ({"exceptions": [{"where": {"p": 0.5}, "set": {"colour": 1}}]}, r"exceptions\[0\]: set: unknown key\(s\)"),
        ({"exceptions": {"where": {}}}, r"exceptions must be a list"),
        ({"id": "{model}"}, r"grids\[0\] cell mlp: duplicate id 'mlp'"),
        ({"id": "{model}-{colour}"}, r"id pattern '\{model\}-\{colour\}': \{colour\} is neither an axis"),
        ({"id": ""}, r"id must be a pattern"),
        (
            {"paper": {"mlp-p0.75": {"dia": {"ssim": 1.0}}}},
            r"grids\[0\]: paper: no cell of the grid has the id\(s\) \['mlp-p0.75'\]",
        ),
        ({"paper": {"mlp-p0.5": {"dia": {"colour": 1.0}}}}, r"grids\[0\] cell mlp-p0.5: paper.dia must map metrics"),
        ({"axes": {"model": ["mlp"], "p": ["high"]}}, r"grids\[0\] cell mlp-phigh: p must be a number"),
    ],
)
def test_bad_grids_are_one_line_errors_naming_file_and_problem(
    tmp_path: Path, change: dict[str, Any], words: str
) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({"grids": [{**GOOD, **change}]}, sort_keys=False))
    with pytest.raises(ExperimentError, match=words) as err:
        load_experiment(path)
    assert str(err.value).startswith(str(path)) and "\n" not in str(err.value)


def test_a_duplicate_id_between_a_grid_and_explicit_cells() -> None:
    with pytest.raises(ExperimentError, match=r"t: grids\[0\] cell mlp-p0.25: duplicate id 'mlp-p0.25'"):
        parse_experiment(
            {
                "name": "t",
                "cells": [{"id": "mlp-p0.25", "model": "mlp", "dataset": "mnist", "p": 0.1, "attacks": ["dia"]}],
                "grids": [GOOD],
            },
            Path("t"),
        )


@pytest.mark.parametrize(
    ("data", "words"),
    [
        ({"grids": "x"}, "grids must be a non-empty list"),
        ({"grids": []}, "grids must be a non-empty list"),
        ({"cells": []}, "cells must be a non-empty list"),
        ({"grids": [GOOD], "cells": {}}, "cells must be a list"),
    ],
)
def test_bad_experiment_level_grids(data: dict[str, Any], words: str) -> None:
    with pytest.raises(ExperimentError, match=words):
        parse_experiment({"name": "t", **data})


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit(f"usage: {sys.argv[0]} --write   (rewrites {SNAPSHOT.relative_to(ROOT)} from configs/experiments/)")
    SNAPSHOT.write_text(dump(expansion()))
    print(f"wrote {SNAPSHOT}")
