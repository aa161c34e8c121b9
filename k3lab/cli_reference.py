"""The command-line reference (``docs/reference/cli.md``), made from the parser itself, so it cannot say
what the commands do not: ``python -m k3lab.cli_reference > docs/reference/cli.md`` (a test checks the
page is what this prints)."""

from __future__ import annotations

import argparse
import os

from k3lab.cli import EXAMPLES, build_parser

WIDTH = 100  # argparse wraps usage lines to the terminal: fixed, so the page is the same everywhere


def _commands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def summary(link: str = "") -> list[str]:
    """The table of commands, each linked to its section of the page (``link``: the page's path from
    where the table is; the README shows the same table)."""
    commands = _commands(build_parser())
    rows = [f"| [`{name}`]({link}#{name}) | {_cell(p.description or '')} |" for name, p in commands.items()]
    return ["| command | what it does |", "| --- | --- |", *rows]


def markdown() -> str:
    """The page: each command's purpose, usage, options and an example that runs after `k3lab demo`."""
    os.environ["COLUMNS"] = str(WIDTH)
    parser = build_parser()
    out = [
        "# Command-line reference",
        "",
        "Generated from k3lab's argument parser (`python -m k3lab.cli_reference > docs/reference/cli.md`);",
        "every example runs verbatim after `k3lab demo` (a test runs each).",
        "",
        *summary(),
    ]
    commands = _commands(parser)
    for name, p in commands.items():
        usage = p.format_usage().removeprefix("usage: ").strip()
        out += ["", f"## {name}", "", _cell(p.description or ""), "", "```", usage, "```", ""]
        rows = [
            (", ".join(a.option_strings) or a.dest, _cell(a.help or ""))
            for a in p._actions
            if a.dest != "help" and a.help != argparse.SUPPRESS
        ]
        if rows:
            out += ["| option | meaning |", "| --- | --- |"]
            out += [f"| `{flags}` | {meaning} |" for flags, meaning in rows]
            out.append("")
        out += ["Example:", "", "```bash", EXAMPLES[name], "```"]
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    print(markdown(), end="")
