"""One command line for an entry script's named scenarios: `SCRIPT SCENARIO [flags]`, each scenario a
module with `add_args(parser)` and `run(args)` (its docstring is its --help)."""

from __future__ import annotations

import argparse
import sys
from types import ModuleType


def run_scenario(doc: str, scenarios: dict[str, ModuleType], argv: list[str] | None = None) -> None:
    """Parse `argv`, run the chosen scenario, exit with its status (a returned int; 0 otherwise)."""
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=doc, formatter_class=raw)
    choices = parser.add_subparsers(dest="scenario", required=True, metavar="SCENARIO")
    for name, module in scenarios.items():
        text = module.__doc__ or name
        module.add_args(choices.add_parser(name, help=text.splitlines()[0], description=text, formatter_class=raw))
    args = parser.parse_args(argv)
    status = scenarios[args.scenario].run(args)
    sys.exit(status if isinstance(status, int) else 0)
