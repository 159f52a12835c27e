"""`mlx-kvserve cache …`: see and manage the cache of a running server (over HTTP), or verify
the SSD cache folder offline."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import click

from .checked_json import DamagedFile
from .config import load_config

DEFAULT_URL = "http://127.0.0.1:8000"
_STORE_NAME = re.compile(r"[0-9a-f]{16}")  # a namespace folder (kv.ssd.store_dir); verify locks only these


def _client(ctx: click.Context):
    import httpx

    key = ctx.obj["api_key"]
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.Client(base_url=ctx.obj["url"], headers=headers, timeout=600)


def _call(ctx: click.Context, method: str, path: str, body: dict | None = None) -> Any:
    import httpx

    try:
        with _client(ctx) as client:
            r = client.request(method, path, json=body)
    except httpx.HTTPError as exc:
        raise click.ClickException(f"cannot reach the server at {ctx.obj['url']}: {exc}") from None
    data = r.json() if r.headers.get("content-type", "").startswith("application/json") else {}
    if r.status_code >= 400:
        message = (data.get("error") or {}).get("message") or r.text
        raise click.ClickException(f"{r.status_code}: {message}")
    return data


def table(rows: list[dict[str, Any]], columns: list[str]) -> str:
    """A plain aligned text table."""
    cells = [[str(row.get(c, "")) for c in columns] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) if cells else len(c) for i, c in enumerate(columns)]
    line = lambda values: "  ".join(v.ljust(w) for v, w in zip(values, widths, strict=True))  # noqa: E731
    return "\n".join([line(columns), line(["-" * w for w in widths]), *(line(r) for r in cells)])


def _remember(ctx: click.Context, param: click.Parameter, value: str | None) -> None:
    """--url / --api-key given after the subcommand: over what the group got (its default)."""
    if value is not None:
        ctx.ensure_object(dict)[param.name] = value.rstrip("/") if param.name == "url" else value


def server_options(fn):
    """--url and --api-key on a subcommand too, so `cache stats --url X` works as `cache --url X stats`."""
    fn = click.option("--api-key", callback=_remember, expose_value=False, help="Bearer key, if the server wants one.")(
        fn
    )
    return click.option(
        "--url", callback=_remember, expose_value=False, help=f"The server (default $MLX_KVSERVE_URL or {DEFAULT_URL})."
    )(fn)


def server_group(name: str, help_text: str) -> click.Group:
    """A click group whose commands reach a running server: --url and --api-key before the command
    (here) or after it (server_options on each command)."""

    @click.group(name, help=help_text)
    @click.option("--url", default=lambda: os.environ.get("MLX_KVSERVE_URL", DEFAULT_URL), show_default=DEFAULT_URL)
    @click.option("--api-key", envvar="MLX_KVSERVE_API_KEY", default=None, help="Bearer key, if the server wants one.")
    @click.pass_context
    def group(ctx: click.Context, url: str, api_key: str | None) -> None:
        ctx.obj = {"url": url.rstrip("/"), "api_key": api_key}

    return group


cache_group = server_group("cache", "See and manage the KV cache.")


@cache_group.command()
@click.option("--json", "as_json", is_flag=True, help="Print the raw counters as JSON.")
@server_options
@click.pass_context
def stats(ctx: click.Context, as_json: bool) -> None:
    """The cache of the running server: hit share, RAM and SSD used, blocks, pins, writer."""
    from .cache_summary import summary

    data = _call(ctx, "GET", "/v1/cache/stats")
    if as_json:
        click.echo(json.dumps(data, indent=2))
        return
    try:  # its prefill counter gives the hit share of all prompt tokens; the summary does without
        health = _call(ctx, "GET", "/health")
    except click.ClickException:
        health = None
    click.echo(summary(data, health))


@cache_group.command()
@server_options
@click.pass_context
def pins(ctx: click.Context) -> None:
    """Pinned blocks: hash, pin count, where they are."""
    rows = _call(ctx, "GET", "/v1/cache/pins")["pins"]
    click.echo(table(rows, ["block_hash", "pin_count", "in_ram", "on_ssd"]) if rows else "no pins")


def _pin_body(file: Path | None, prompt: str | None, hashes: tuple[str, ...]) -> dict[str, Any]:
    given = [x for x in (file, prompt, hashes or None) if x is not None]
    if len(given) != 1:
        raise click.UsageError("give exactly one of --file, --prompt or block hashes")
    if file is not None:  # a system prompt file: pinned as the prefix every chat with it shares
        return {"messages": [{"role": "system", "content": file.read_text()}], "add_generation_prompt": False}
    if prompt is not None:
        return {"prompt": prompt}
    return {"block_hashes": list(hashes)}


def _pin_options(fn):
    fn = click.argument("hashes", nargs=-1)(fn)
    fn = click.option("--prompt", help="A raw text prompt (as for /v1/completions).")(fn)
    fn = click.option(
        "--file", type=click.Path(exists=True, dir_okay=False, path_type=Path), help="A system prompt file."
    )(fn)
    return fn


@cache_group.command()
@_pin_options
@server_options
@click.pass_context
def pin(ctx: click.Context, file: Path | None, prompt: str | None, hashes: tuple[str, ...]) -> None:
    """Pin a system prompt file, a prompt, or block hashes (warming them first if needed)."""
    data = _call(ctx, "POST", "/v1/cache/pin", _pin_body(file, prompt, hashes))
    click.echo(pin_message(data, _call(ctx, "GET", "/v1/cache/stats").get("block_size")))


def pin_message(data: dict[str, Any], block_size: int | None) -> str:
    """What a pin did, in blocks: the server counts pins (one per chain), each chain many blocks."""
    tokens, chains = data["tokens"], data["pinned_count"]
    kept = f"{tokens // block_size} blocks ({tokens} tokens)" if block_size else f"{tokens} tokens"
    return f"pinned {kept} as {chains} chain{'s' if chains != 1 else ''}"


@cache_group.command()
@_pin_options
@server_options
@click.pass_context
def unpin(ctx: click.Context, file: Path | None, prompt: str | None, hashes: tuple[str, ...]) -> None:
    """Remove one pin from a system prompt file, a prompt, or block hashes."""
    count = _call(ctx, "POST", "/v1/cache/unpin", _pin_body(file, prompt, hashes))["unpinned_count"]
    click.echo(f"removed {count} pin{'s' if count != 1 else ''}" if count else "no such pin: nothing removed")


@cache_group.command()
@click.option("--ssd", is_flag=True, help="Also delete unpinned blocks from the SSD.")
@server_options
@click.pass_context
def flush(ctx: click.Context, ssd: bool) -> None:
    """Drop unpinned blocks from RAM (and the SSD with --ssd); pinned blocks stay."""
    data = _call(ctx, "POST", "/v1/cache/flush", {"ssd": ssd})
    click.echo(table([data], list(data)))


@cache_group.command()
@server_options
@click.pass_context
def prune(ctx: click.Context) -> None:
    """Delete SSD blocks unused for longer than [ssd] ttl_days (pinned ones never)."""
    click.echo(f"pruned {_call(ctx, 'POST', '/v1/cache/prune')['pruned']}")


@cache_group.command()
@click.option("--config", "config_path", type=click.Path(exists=True, dir_okay=False))
@click.option("--dir", "cache_dir", type=click.Path(file_okay=False, path_type=Path), help="SSD cache folder.")
def verify(config_path: str | None, cache_dir: Path | None) -> None:
    """Offline: check every block file, tail file and bookkeeping file (index, pins, shutdown
    record) of the SSD cache (run with the server stopped). Damaged block and tail files are
    deleted, damaged bookkeeping files set aside as `<name>.damaged-<time>`, the index repaired and
    temp leftovers removed; exits 1 when anything was wrong, 2 (checking and changing nothing)
    while a server holds the cache folder's lock."""
    from .kv.ssd import folder_namespace
    from .kv.ssd.folder_label import read_label

    root = cache_dir or load_config(config_path).ssd_path()
    _lock_store_folders(root)  # exits 2, changing nothing, while a server uses the cache
    rows, notes, bad = [], [], 0
    for folder in sorted(p for p in root.glob("*") if p.is_dir()):
        namespace = folder_namespace(folder)
        if namespace is None:  # not a store folder, or one with no readable block file
            continue
        row, damaged = _verify_folder(folder, namespace)
        rows.append({"model": read_label(folder) or "-"} | row)
        if row["unchecked"]:
            notes.append(f"{folder.name}: {row['unchecked']}")
        bad += row["missing"] + row["invalid"] + row["temp"] + row["bad_tails"] + row["damaged"]
        for d in damaged:
            moved = f"set aside as {d.moved_to.name}" if d.moved_to else "could not be set aside"
            notes.append(f"{folder.name}/{d.path.name}: {d.reason}; {moved}")
    columns = ["model", "namespace", "blocks", "adopted", "missing", "invalid", "temp", "tails", "bad_tails", "damaged"]
    click.echo(table(rows, columns) if rows else f"no cache in {root}")
    for note in notes:
        click.echo(note)
    if bad:
        raise SystemExit(1)


def _lock_store_folders(root: Path) -> None:
    """Hold the lock of every store folder under `root` until the command ends, so that no server
    starts on a folder while it is checked. When another process (a server, another verify) holds
    one, print who and exit 2 before anything is read or changed: verify deletes temp files, which
    would be a running server's writes in progress."""
    from .kv.ssd import FolderBusyError, FolderLock

    ctx = click.get_current_context()
    refused = []
    for folder in sorted(p for p in root.glob("*") if _STORE_NAME.fullmatch(p.name) and p.is_dir()):
        try:
            ctx.call_on_close(FolderLock.acquire(folder, "cache verify").release)
        except FolderBusyError as exc:
            refused.append(exc.message)
        except OSError as exc:
            refused.append(f"cannot lock the cache folder {folder}: {exc}")
    if refused:
        for message in refused:
            click.echo(f"Error: {message}", err=True)
        click.echo("cache verify checked and changed nothing; run it with the server stopped.", err=True)
        ctx.exit(2)


def _verify_folder(folder: Path, namespace: bytes) -> tuple[dict[str, Any], list[DamagedFile]]:
    """Check one namespace folder: (its table row, the bookkeeping files set aside)."""
    from .checked_json import remove_leftover_temps
    from .kv.pins import PINS_FILE, PinRegistry
    from .kv.ssd import SHUTDOWN_FILE, SSDStore, SSDTailStore, read_shutdown_record
    from .kv.ssd.folder_label import read_label
    from .kv.ssd.table_check import RULES_FILE, read_rules
    from .progress import progress_bar

    temps = remove_leftover_temps(folder / PINS_FILE) + remove_leftover_temps(folder / SHUTDOWN_FILE)
    try:  # what the model's blocks may hold, as its server wrote it; without it, only the tables' structure
        rules = read_rules(folder)
    except (OSError, ValueError):
        rules = None
    store = SSDStore(folder, namespace, table_rules=rules)
    report = store.validate_index(check_headers=True)
    with progress_bar(report.kept + report.adopted, f"checking {read_label(folder) or folder.name}", "block") as bar:
        corrupt = store.verify_all(on_block=lambda: bar.update(1))
    store.flush()
    tails = SSDTailStore(folder / "tails", namespace, key=store.key, table_rules=rules).verify_all()
    damaged = store.damaged_files + PinRegistry(folder / PINS_FILE).damaged_files
    read_shutdown_record(folder, damaged, consume=False)  # the next start still needs it
    row = {
        "namespace": folder.name,
        "blocks": report.kept + report.adopted - corrupt,
        "adopted": report.adopted,
        "missing": report.dropped_missing,
        "invalid": report.deleted_invalid + corrupt,
        "temp": report.deleted_temp + tails.deleted_temp + temps,
        "tails": tails.kept,
        "bad_tails": tails.deleted_invalid,
        "damaged": len(damaged),
        "unchecked": "" if rules is not None else f"no usable {RULES_FILE}: array shapes and dtypes not checked",
    }
    return row, damaged
