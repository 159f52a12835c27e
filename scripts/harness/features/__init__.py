"""Scenario modules: add_args(parser) and run(args) each (harness/cli.py)."""
