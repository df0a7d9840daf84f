"""What a checkpoint's ``manifest.json`` costs: CRC-32 of a file read back from the page cache.

    .venv/bin/python benchmarks/checksum.py [--gib 1] [--repeats 3]

Writes ``--gib`` GiB of random bytes to a temporary file, then times
:func:`gspo.publish.file_crc32` on it (what the checkpoint writer does once per file after
writing it, and a resume once per file it loads), and SHA-256 over the same file for
comparison; the best of ``--repeats`` per GiB is printed.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import tempfile
import time
from pathlib import Path

from gspo.publish import file_crc32


def sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "weights.bin"
        with open(path, "wb") as f:
            for _ in range(args.gib * 16):
                f.write(os.urandom(64 * 2**20))
        for name, digest in (("crc32 (gspo.publish.file_crc32)", file_crc32), ("sha256", sha256)):
            times = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                digest(path)
                times.append(time.perf_counter() - start)
            print(f"{name}: {min(times) / args.gib:.2f} s per GiB")


if __name__ == "__main__":
    main()
