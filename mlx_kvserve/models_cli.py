"""`mlx-kvserve models list | load | unload`: the models of a running server ([[models]]), over its admin
API (/v1/cache/models)."""

from __future__ import annotations

import json

import click

from .cache_cli import _call, server_group, server_options, table
from .cache_summary import gib

COLUMNS = ["id", "kind", "state", "in_use", "memory_bytes", "loads", "unloads", "load_s", "idle_s", "pinned", "pid"]


def rows(models: list[dict]) -> list[dict]:
    """The admin API's rows with `pid`: the model's own process (`process = true`), "-" for none."""
    return [row | {"pid": (row.get("process") or {}).get("pid") or "-"} for row in models]


models_group = server_group("models", "See, load and unload the models of a running server.")


@models_group.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print the raw JSON.")
@server_options
@click.pass_context
def list_models(ctx: click.Context, as_json: bool) -> None:
    """Every registered model: its state, memory and use."""
    data = _call(ctx, "GET", "/v1/cache/models")
    if as_json:
        click.echo(json.dumps(data, indent=2))
        return
    click.echo(table(rows(data["models"]), COLUMNS))
    click.echo(f"memory: {gib(data['memory_used_bytes'])} of {gib(data['memory_budget_bytes'])}")


@models_group.command()
@click.argument("model")
@server_options
@click.pass_context
def load(ctx: click.Context, model: str) -> None:
    """Load MODEL now (unloading idle ones when the memory budget needs room)."""
    click.echo(table(rows([_call(ctx, "POST", "/v1/cache/models/load", {"model": model})]), COLUMNS))


@models_group.command()
@click.argument("model")
@server_options
@click.pass_context
def unload(ctx: click.Context, model: str) -> None:
    """Unload MODEL now (its KV blocks stay on the SSD)."""
    click.echo(table(rows([_call(ctx, "POST", "/v1/cache/models/unload", {"model": model})]), COLUMNS))
