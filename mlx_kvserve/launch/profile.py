"""What a client is run with: a Profile (environment, private files, the command), written and shown.

Pure but for `write`: clients.py builds profiles, command.py writes them and runs the command, and
`describe` is what `--dry-run` prints (the key shown as a placeholder, never its text).
"""

from __future__ import annotations

import json
import os
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

KEY_PLACEHOLDER = "<the server API key>"


@dataclass(frozen=True)
class ProfileFile:
    """A file of the client's private profile. `merge`: a JSON object whose keys are set over those of
    the file already there (a client that keeps its own state in the same file, as Claude Code's
    .claude.json does); otherwise the file is written whole every launch."""

    path: Path
    text: str
    merge: bool = False


@dataclass(frozen=True)
class Profile:
    """`env` is set over the caller's environment, `unset` removed from it (a variable that would
    override ours, such as a real Anthropic key), `argv` run in the current folder."""

    client: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    unset: tuple[str, ...] = ()
    files: list[ProfileFile] = field(default_factory=list)
    secret: str = ""  # the API key in `env` and `files`: replaced by KEY_PLACEHOLDER when shown
    notes: tuple[str, ...] = ()  # warnings for the user (a context too small for the client, ...)

    def environment(self, base: dict[str, str]) -> dict[str, str]:
        env = {k: v for k, v in base.items() if k not in self.unset}
        return env | self.env


def json_text(value: Any) -> str:
    return json.dumps(value, indent=2) + "\n"


def write(profile: Profile) -> None:
    """Write the profile's files, private to the user (0700 folders, 0600 files: some hold the key)."""
    for item in profile.files:
        item.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        text = item.text
        if item.merge and item.path.exists():
            try:
                current = json.loads(item.path.read_text())
            except (OSError, ValueError):
                current = {}  # a damaged state file: start it again from ours
            if isinstance(current, dict):
                text = json_text(current | json.loads(item.text))
        partial = item.path.with_name(item.path.name + ".part")
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(text)
        os.replace(partial, item.path)


def describe(profile: Profile) -> str:
    """What `launch --dry-run` prints: the variables set and removed, each file with its contents,
    and the command, in that order; the key (when the server has one) shown as KEY_PLACEHOLDER."""

    def hide(text: str) -> str:
        return text.replace(profile.secret, KEY_PLACEHOLDER) if profile.secret else text

    lines = [f"# mlx-kvserve launch {profile.client}"]
    lines += [f"# note: {note}" for note in profile.notes]
    lines += ["# environment"]
    lines += [f"unset {name}" for name in profile.unset]
    lines += [f"export {name}={shlex.quote(hide(value))}" for name, value in profile.env.items()]
    for item in profile.files:
        how = "merged into" if item.merge else "written to"
        lines += [f"# file {how} {item.path}", hide(item.text).rstrip("\n")]
    lines += ["# command", shlex.join(profile.argv)]
    return "\n".join(lines) + "\n"
