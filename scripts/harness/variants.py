"""Our server again with another configuration, next to the default one: the benchmarks' `--variants`."""

from __future__ import annotations

import tempfile
from pathlib import Path

import tomllib

from .clients import chat_ttft
from .servers import Server, free_port, toml_text

VARIANTS = {
    "ssd-off": "[ssd]\nenabled = false\n",
    # the order before cached-first scheduling: arrival order, every waiting prompt prefilled together
    "fifo": '[server]\nscheduling = "fifo"\nprefill_batch_size = 0\n',
    # cached-first order, one prompt prefilled at a time (shortest uncached rest first)
    "serial": '[server]\nscheduling = "cached_first"\nprefill_batch_size = 1\n',
    # the short-join rule before: any uncached rest within one prefill chunk joined past the slots
    "chunk-short": "[server]\nshort_prefill_tokens = 512\n",
    # a smaller prefill budget per step: running streams get a token every 128 prompt tokens
    "chunk-128": "[generation]\nprefill_step_size = 128\n",
    # each prompt prefilling a whole chunk per step (mlx-lm's step), before prompts shared a step's tokens
    "step-each": "[generation]\nprefill_step_shared = false\n",
    # every waiting long prompt prefilled together (up to 8, mlx_lm.server's prompt concurrency): the default before
    "batch8": "[server]\nprefill_batch_size = 8\n",
    # half the CPU's prefill chunk: a later turn arriving during a cold prompt's chunk waits for less of it
    "step256": "[generation]\nprefill_step_size = 256\n[server]\nshort_prefill_tokens = 128\n",
    # MLX's own attention on the CPU, not the NumPy softmax where it wins (cpu/attention.py)
    "mlx-attention": '[generation]\ncpu_attention_softmax = "mlx"\n',
}


def variant_server(ours: Server, name: str) -> Server:
    """A second instance of our server, on its own port and home, configured as VARIANTS[name]."""
    config = Path(tempfile.mkdtemp(prefix=f"kvserve-{name}-")) / "config.toml"
    sections = {section: dict(values) for section, values in ours.config.items()}  # the shared bounds, if any
    for section, values in tomllib.loads(VARIANTS[name]).items():
        sections.setdefault(section, {}).update(values)
    config.write_text(toml_text(sections))
    port = free_port()
    cmd = [a if a != str(ours.port) else str(port) for a in ours.cmd]
    if "--config" in cmd:  # ours' own file: the variant's replaces it (it holds the same bounds)
        at = cmd.index("--config")
        del cmd[at : at + 2]
    cmd += ["--config", str(config)]
    env = dict(ours.env, MLX_KVSERVE_HOME=str(config.parent))
    label = "SSD off" if name == "ssd-off" else name
    server = Server(f"{ours.name} ({label})", cmd, port, env, ours.ready_path)
    server.wait(server.ready_path)
    chat_ttft(server, [{"role": "user", "content": "warm up"}], 4)  # first-use kernel compilation
    return server
