"""One vocabulary: a setting has the same name, values and default in the run config, the fedsim and
attacker flags, the attack YAML and the experiment YAML."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import yaml

from attacker import cli as attacker_cli
from attacker.config import RunConfig, VictimConfig, load_config, parse_config
from attacker.experiments import load_experiment
from attacker.story import OFFLINE_DEMO
from fedsim import cli as fedsim_cli
from fedsim.run_config import DEFAULTS, SETTINGS, from_run_config, to_run_config

ROOT = Path(__file__).resolve().parents[1]
SHARED = (
    "model",
    "dataset",
    "p",
    "model_options",
    "model_seed",
    "victim_batch_size",
    "data_root",
    "num_clients",
    "seed",
)


def _flags(parser) -> set[str]:
    out = set()
    for action in parser._actions:
        if hasattr(action, "choices") and isinstance(action.choices, dict):  # subparsers
            for sub in action.choices.values():
                out |= _flags(sub)
        out |= {s for s in action.option_strings if s.startswith("--")}
    return out


def test_attack_settings_shared_with_the_federation_have_its_names_and_defaults():
    fed = from_run_config(DEFAULTS)
    victims = VictimConfig()
    for key in SHARED:
        assert getattr(victims, key) == fed[key], key
    assert RunConfig().labels == fed["labels"] and SETTINGS["labels"].choices == ("known", "recovered")
    assert to_run_config(from_run_config(DEFAULTS)) == {k: v for k, v in DEFAULTS.items()}


def test_shared_flags_have_one_name_in_both_commands():
    fed_flags, att_flags = _flags(fedsim_cli.build_parser()), _flags(attacker_cli.build_parser())
    for key in ("model", "dataset", "p", "victim-batch-size", "data-root", "labels"):
        assert f"--{key}" in fed_flags and f"--{key}" in att_flags, key
    assert "--batch-size" not in att_flags  # the training batch size is the federation's alone


def test_yaml_files_use_the_schema_names():
    for path in sorted((ROOT / "configs" / "attacks").glob("*.yaml")):
        victims = (yaml.safe_load(path.read_text()) or {}).get("victims", {})
        fields = {f.name for f in dataclasses.fields(VictimConfig)}
        assert set(victims) <= fields, path
        load_config(path)
    for path in sorted((ROOT / "configs" / "experiments").glob("*.yaml")):
        for cell in load_experiment(path).cells:
            assert cell.victim_batch_size >= 1


def test_the_offline_demo_embeds_configs_attacks_demo_yaml():
    assert parse_config(OFFLINE_DEMO) == load_config(ROOT / "configs" / "attacks" / "demo.yaml")


def test_every_capture_kind_is_a_run_config_choice_and_a_demo_variant():
    from attacker.story import STORIES
    from fedsim.capture_kinds import CAPTURE_KINDS, aggregate_kind, client_kinds
    from fedsim.run_config import resolve_config

    # A run chooses what one client's reply is; under secagg the server records that kind's aggregate.
    assert SETTINGS["capture-kind"].choices == client_kinds() == tuple(STORIES)
    assert {aggregate_kind(k) for k in client_kinds()} == set(CAPTURE_KINDS) - set(client_kinds())
    for kind, story in STORIES.items():
        assert resolve_config(story.federation, {})["capture-kind"] == kind
