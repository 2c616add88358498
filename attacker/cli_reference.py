"""The option reference of both commands, rendered as markdown from their own argparse parsers.

python -m attacker.cli_reference           print it
python -m attacker.cli_reference --write   rewrite docs/reference.md (tests/test_cli_reference.py checks it)

The text depends only on the parsers: no paths, times or terminal widths, so the committed file can be
compared with a fresh rendering.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable
from pathlib import Path

REFERENCE = Path(__file__).resolve().parents[1] / "docs" / "reference.md"
WRITE_COMMAND = "python -m attacker.cli_reference --write"


def parsers() -> dict[str, argparse.ArgumentParser]:
    """Each command's top-level parser by program name; building them runs nothing."""
    from attacker.cli import build_parser as attacker_parser
    from fedsim.cli import build_parser as fedsim_parser

    builders: list[Callable[[], argparse.ArgumentParser]] = [attacker_parser, fedsim_parser]
    return {parser.prog: parser for parser in (build() for build in builders)}


def subcommands(parser: argparse.ArgumentParser) -> dict[str, tuple[str, argparse.ArgumentParser]]:
    """A parser's subcommands in declaration order: name -> (its one-line help, its parser)."""
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    helps = {choice.dest: choice.help or "" for choice in action._choices_actions}
    return {name: (helps.get(name, ""), sub) for name, sub in action.choices.items()}


_CODE = re.compile(r"(`+).+?\1")  # a markdown code span, left as it is


def _cell(text: str) -> str:
    """One table cell: one line, pipes escaped, and outside `code` no '<' or '*' markdown would eat."""
    text = " ".join(text.split()).replace("|", "\\|")
    out, start = [], 0
    for span in _CODE.finditer(text):
        out += [text[start : span.start()].replace("<", "&lt;").replace("*", "\\*"), span.group()]
        start = span.end()
    out.append(text[start:].replace("<", "&lt;").replace("*", "\\*"))
    return "".join(out)


def _metavar(action: argparse.Action) -> str:
    if action.metavar is not None:
        return str(action.metavar)
    if action.choices is not None:
        return "{" + ",".join(str(c) for c in action.choices) + "}"
    return action.dest.upper()


def _value(action: argparse.Action) -> str:
    """What follows the option on the command line, as argparse's usage writes it (empty for a flag)."""
    if action.nargs == 0:
        return ""
    name = _metavar(action)
    if action.nargs is None:
        return name
    if action.nargs == "?":
        return f"[{name}]"
    if action.nargs == "+":
        return f"{name} [{name} ...]"
    if action.nargs == "*":
        return f"[{name} ...]"
    return " ".join([name] * int(action.nargs))


def _default(action: argparse.Action) -> str:
    """The argparse default when it says something; "" for None, a flag's False, an empty list."""
    default = action.default
    if default is None or default is argparse.SUPPRESS or default == [] or (action.nargs == 0 and not default):
        return ""
    if isinstance(default, list):
        return "`" + " ".join(str(v) for v in default) + "`"
    return "`''`" if default == "" else f"`{default}`"


def _help(action: argparse.Action, prog: str) -> str:
    if not action.help or action.help is argparse.SUPPRESS:
        return ""
    # argparse's own expansion of %(default)s and friends (and of '%%'), with a fixed width
    return argparse.HelpFormatter(prog, width=100)._expand_help(action)


def _synopsis(prog: str, parser: argparse.ArgumentParser) -> str:
    words = [prog]
    for action in parser._positionals._group_actions:
        name = _metavar(action)
        words.append({"?": f"[{name}]", "+": f"{name}...", "*": f"[{name}...]"}.get(str(action.nargs), name))
    if any(a.option_strings and not isinstance(a, argparse._HelpAction) for a in parser._actions):
        words.append("[options]")
    return " ".join(words)


def _group_title(parser: argparse.ArgumentParser, group: argparse._ArgumentGroup) -> str:
    if group is parser._positionals:
        return "arguments"
    if group is parser._optionals:
        return "options"
    return group.title or "options"


def _subcommand_section(prog: str, summary: str, parser: argparse.ArgumentParser) -> list[str]:
    lines = [f"### `{prog}`", "", _cell(summary), "", f"`{_synopsis(prog, parser)}`", ""]
    for group in parser._action_groups:
        actions = [a for a in group._group_actions if not isinstance(a, argparse._HelpAction)]
        if not actions:
            continue
        positional = group is parser._positionals
        lines += [f"**{_group_title(parser, group)}**", ""]
        lines += ["| argument | help |", "|---|---|"] if positional else ["| option | value | default | help |"]
        lines += [] if positional else ["|---|---|---|---|"]
        for action in actions:
            if positional:
                lines.append(f"| `{_value(action)}` | {_cell(_help(action, prog))} |")
                continue
            flags = ", ".join(f"`{s}`" for s in action.option_strings)
            value = f"`{_value(action)}`" if _value(action) else ""
            lines.append(f"| {flags} | {_cell(value)} | {_default(action)} | {_cell(_help(action, prog))} |")
        lines.append("")
    return lines


def render() -> str:
    """docs/reference.md: per command its subcommands, then a section per subcommand with every option."""
    lines = [
        "# Command-line reference",
        "",
        f"Generated from the commands' own argparse parsers by `{WRITE_COMMAND}`; do not edit it by hand",
        "(`tests/test_cli_reference.py` fails when it is stale). `--help` on any command prints the same",
        "options. What the commands are for, with examples and what they write: [usage.md](usage.md).",
        "An option without a default here takes it from the config, the run config schema",
        "(`fedsim/run_config.py`) or the attack profile (`attacker/profiles.py`), as its help says.",
        "",
    ]
    for prog, parser in parsers().items():
        lines += [f"## `{prog}`", "", _cell(parser.description or ""), "", "| command | what it does |", "|---|---|"]
        for name, (summary, _) in subcommands(parser).items():
            anchor = re.sub(r"[^a-z0-9 -]", "", f"{prog} {name}".lower()).replace(" ", "-")
            lines.append(f"| [`{prog} {name}`](#{anchor}) | {_cell(summary)} |")
        lines.append("")
        for name, (summary, sub) in subcommands(parser).items():
            lines += _subcommand_section(f"{prog} {name}", summary, sub)
    return "\n".join(lines).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m attacker.cli_reference", description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"rewrite {REFERENCE.parent.name}/{REFERENCE.name}")
    args = parser.parse_args(argv)
    text = render()
    if args.write:
        REFERENCE.write_text(text, encoding="utf-8")
        print(f"wrote {REFERENCE.parent.name}/{REFERENCE.name}")
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
