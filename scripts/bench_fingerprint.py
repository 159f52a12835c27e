"""What the model fingerprint costs at startup: a full content hash vs the memo (issue 23, bug 2).

The fingerprint is a blake3 hash of the model's config and weight files. Per-file digests are
memoized by (path, device, inode, size, mtime, ctime), so a restart with unchanged files reads
only the memo; an edited, copied or replaced file is hashed again. This measures, side by side in
one run on one weights folder (default: the default model, or --size-mb of random bytes):
- the raw read bandwidth of the weight files (plain sequential reads), page cache warm and dropped;
- the full content hash (what a first start or an edited file costs), warm and dropped;
- the memo lookup (what every other restart costs).

Usage: .venv/bin/python scripts/bench_fingerprint.py [--model DIR | --size-mb 2048] [--reps 3]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from harness import default_model_dir
from harness.diskio import CAN_DROP, drop_file, read_file
from harness.reports import median

from mlx_kvserve.kv.hashing import model_fingerprint


def weight_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.suffix in (".json", ".safetensors") and p.is_file())


def timed(fn, files: list[Path], cold: bool, reps: int) -> float:
    times = []
    for _ in range(reps):
        if cold:
            for path in files:
                drop_file(path)
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return median(times)


def synthetic_model(folder: Path, size_mb: int) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text('{"model_type": "synthetic"}')
    with open(folder / "model.safetensors", "wb") as f:
        for _ in range(size_mb):
            f.write(os.urandom(1 << 20))
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, help="an MLX model folder (default: the default model)")
    parser.add_argument("--size-mb", type=int, help="hash a folder of this many MB of random bytes instead")
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = (
            synthetic_model(Path(tmp) / "model", args.size_mb) if args.size_mb else (args.model or default_model_dir())
        )
        files = weight_files(folder)
        total = sum(p.stat().st_size for p in files)
        memo = Path(tmp) / "memo.json"
        buf = memoryview(bytearray(8 << 20))
        model_fingerprint(folder, memo)  # fills the memo
        rows = []
        for cold in (False, True) if CAN_DROP else (False,):
            read_s = timed(lambda: [read_file(p, buf) for p in files], files, cold, args.reps)
            hash_s = timed(lambda: model_fingerprint(folder), files, cold, args.reps)
            memo_s = timed(lambda: model_fingerprint(folder, memo), files, cold, args.reps)
            rows.append(("dropped" if cold else "warm", read_s, hash_s, memo_s))
    print(f"{folder.name}: {total / 1e9:.3f} GB in {len(files)} files")
    print("| page cache | raw read | full content hash | memo lookup |")
    print("| --- | --- | --- | --- |")
    for label, read_s, hash_s, memo_s in rows:
        print(
            f"| {label} | {read_s:.3f} s ({total / read_s / 1e9:.2f} GB/s) | {hash_s:.3f} s "
            f"({total / hash_s / 1e9:.2f} GB/s) | {memo_s * 1e3:.2f} ms |"
        )


if __name__ == "__main__":
    main()
