"""Run hostile programs through the `code` reward's sandbox and print what each did.

    python experiments/sandbox_hostile.py [--rlimits]

Each program is scored against a test it would pass if it ever finished (``assert True``):
contained means score 0, no trace on the host, and the process count back to where it was.
``--rlimits`` forces the fallback without bubblewrap.
"""

from __future__ import annotations

import argparse
import os
import threading
import time
from pathlib import Path

from gspo.rewards import sandbox

CASES = {
    "infinite loop": "while True:\n    pass",
    "fork bomb": "import os\nwhile True:\n    try:\n        os.fork()\n"
    "    except OSError:\n        pass",
    "allocate 10 GB": "x = bytearray(10 * 1024 ** 3)\nx[-1] = 1",
    "write outside": "open('/tmp/gspo-hostile-marker', 'w').write('x')",
    "read parent env": "import os\nprint(open(f'/proc/{os.getppid()}/environ').read())\n"
    "assert 'GSPO_HOSTILE_SECRET' in open(f'/proc/{os.getppid()}/environ').read()",
    "open a socket": "import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=2)",
    "kill its parent": "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\n"
    "os.kill(-1, signal.SIGKILL)",
    "flood stdout": "while True:\n    print('x' * 4096)",
    "exit 0 early": "import os\nos._exit(0)",
}


def _processes() -> int:
    return sum(1 for entry in os.listdir("/proc") if entry.isdigit())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rlimits", action="store_true", help="force the fallback mode")
    args = parser.parse_args()
    if args.rlimits:
        sandbox._bwrap_works = lambda: False  # type: ignore[assignment]
    os.environ["GSPO_HOSTILE_SECRET"] = "hunter2"
    print(f"isolation: {sandbox.isolation()[0]}")
    limits = sandbox.Limits()
    print(f"limits: {limits}")
    print("| program | score | seconds | peak extra processes | left on host |")
    print("|---|---|---|---|---|")
    marker = Path("/tmp/gspo-hostile-marker")
    for name, program in CASES.items():
        marker.unlink(missing_ok=True)
        base, peak, done = _processes(), [0], threading.Event()

        def watch(base: int = base, peak: list[int] = peak, done: threading.Event = done) -> None:
            while not done.is_set():
                peak[0] = max(peak[0], _processes() - base)
                time.sleep(0.02)

        watcher = threading.Thread(target=watch)
        watcher.start()
        start = time.monotonic()
        score = sandbox.score_code(program, sandbox.parse_tests("assert True"), limits)
        seconds = time.monotonic() - start
        done.set()
        watcher.join()
        deadline = time.monotonic() + 10
        while _processes() > base + 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        left = "marker file" if marker.exists() else "nothing"
        if _processes() > base + 2:
            left += f", {_processes() - base} processes"
        print(f"| {name} | {score:.1f} | {seconds:.1f} | {peak[0]} | {left} |")
    marker.unlink(missing_ok=True)


if __name__ == "__main__":
    main()
