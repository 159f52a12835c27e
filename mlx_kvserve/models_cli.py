"""`mlx-kvserve models list | load | unload`: the models of a running server ([[models]]), over its admin
API (/v1/cache/models)."""

from __future__ import annotations

import json
import os

import click

from .cache_cli import DEFAULT_URL, _call, table

COLUMNS = ["id", "kind", "state", "in_use", "memory_bytes", "loads", "unloads", "load_s", "idle_s", "pinned", "pid"]


def rows(models: list[dict]) -> list[dict]:
    """The admin API's rows with `pid`: the model's own process (`process = true`), "-" for none."""
    return [row | {"pid": (row.get("process") or {}).get("pid") or "-"} for row in models]


@click.group("models")
@click.option("--url", default=lambda: os.environ.get("MLX_KVSERVE_URL", DEFAULT_URL), show_default=DEFAULT_URL)
@click.option("--api-key", envvar="MLX_KVSERVE_API_KEY", default=None, help="Bearer key, if the server wants one.")
@click.pass_context
def models_group(ctx: click.Context, url: str, api_key: str | None) -> None:
    """See, load and unload the models of a running server."""
    ctx.obj = {"url": url.rstrip("/"), "api_key": api_key}


@models_group.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print the raw JSON.")
@click.pass_context
def list_models(ctx: click.Context, as_json: bool) -> None:
    """Every registered model: its state, memory and use."""
    data = _call(ctx, "GET", "/v1/cache/models")
    if as_json:
        click.echo(json.dumps(data, indent=2))
        return
    click.echo(table(rows(data["models"]), COLUMNS))
    click.echo(f"memory: {data['memory_used_bytes']} of {data['memory_budget_bytes']} bytes")


@models_group.command()
@click.argument("model")
@click.pass_context
def load(ctx: click.Context, model: str) -> None:
    """Load MODEL now (unloading idle ones when the memory budget needs room)."""
    click.echo(table(rows([_call(ctx, "POST", "/v1/cache/models/load", {"model": model})]), COLUMNS))


@models_group.command()
@click.argument("model")
@click.pass_context
def unload(ctx: click.Context, model: str) -> None:
    """Unload MODEL now (its KV blocks stay on the SSD)."""
    click.echo(table(rows([_call(ctx, "POST", "/v1/cache/models/unload", {"model": model})]), COLUMNS))
