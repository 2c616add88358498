"""docs/reference.md is the CLIs' option reference rendered from their own parsers: it must be current."""

from __future__ import annotations

import re

from attacker import cli_reference
from attacker.cli_reference import REFERENCE, WRITE_COMMAND, parsers, render, subcommands


def test_the_committed_reference_is_the_rendering_of_todays_parsers():
    fresh = render()
    committed = REFERENCE.read_text(encoding="utf-8") if REFERENCE.exists() else ""
    assert committed == fresh, f"docs/reference.md is stale: run `{WRITE_COMMAND}` from the repository root"


def test_every_subcommand_and_every_option_appears():
    text = render()
    seen = 0
    for prog, parser in parsers().items():
        for name, (_, sub) in subcommands(parser).items():
            assert f"### `{prog} {name}`" in text, f"{prog} {name} has no section"
            section = text.split(f"### `{prog} {name}`", 1)[1].split("\n### ", 1)[0]
            for action in sub._actions:
                for flag in action.option_strings:
                    if flag not in ("-h", "--help"):
                        assert f"`{flag}`" in section, f"{prog} {name}: {flag} missing"
            seen += 1
    # both commands, each with its known subcommands (a subcommand dropped from a parser shows here)
    attacker = {"attacker run", "attacker demo", "attacker watch", "attacker audit", "attacker presets"}
    assert attacker | {"attacker experiment"} <= set(re.findall(r"^### `(attacker \w+)`", text, re.M))
    assert {"fedsim simulate", "fedsim sweep", "fedsim deploy-local", "fedsim captures", "fedsim victims"} <= set(
        re.findall(r"^### `(fedsim [\w-]+)`", text, re.M)
    )
    assert seen == len(re.findall(r"^### `", text, re.M))


def test_the_rendering_depends_on_nothing_but_the_parsers(monkeypatch, tmp_path):
    first = render()
    monkeypatch.setenv("COLUMNS", "37")  # argparse's width comes from the terminal; the reference must not
    monkeypatch.chdir(tmp_path)
    assert render() == first
    assert str(tmp_path) not in first and str(REFERENCE.parents[1]) not in first


def test_write_puts_the_rendering_in_the_reference_file(monkeypatch, tmp_path, capsys):
    target = tmp_path / "reference.md"
    monkeypatch.setattr(cli_reference, "REFERENCE", target)
    assert cli_reference.main(["--write"]) == 0
    assert target.read_text(encoding="utf-8") == render()
    assert cli_reference.main([]) == 0 and capsys.readouterr().out.endswith(render())
