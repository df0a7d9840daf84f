"""One command for the day a GPU is lent: tests, a bf16 training run and gspo vs TRL on CUDA.

    make gpu-check            # or: PYTHONPATH=src python benchmarks/gpu_check.py [--out DIR]
    PYTHONPATH=src python benchmarks/gpu_check.py --smoke    # toy sizes, CPU or GPU

On one CUDA GPU, with nothing downloaded, it first runs the whole test suite (``make
test``'s ``pytest``, up to ``--suite-limit`` seconds; the target is under 10 minutes on one
H100, and the report says whether it was met: passed / failed / skipped counts, the
failing tests, the wall time; with pytest-xdist installed the files are spread over
workers, else they run one after another). Then, in under 10 minutes (each stage has a
time limit taken from what is left of ``--budget``), it runs in turn:

1. ``tests``: the tests that need CUDA (``tests/test_cuda.py``), then ``precision``:
   ``experiments/precision.py probe`` on CUDA (the sampler's and the trainer's log-probs
   per precision setting: float32, bf16 as it was, each agreement fix, the defaults; its
   report beside this one as ``precision.md``);
2. ``decode``: the torch engine's decoding on the ~0.5B Qwen3 of 5. (128 rows, 512 new
   tokens, bf16 autocast) with ``rollout.cuda_graphs`` off (the per-step loop), the static
   step uncaptured and the static step as CUDA graphs: tokens/s, ms per step and each
   one's fraction of the memory-bandwidth floor (``decode_graphs.py``);
3. ``vllm``: the vLLM engine tests (``tests/test_vllm_engine.py``) when vLLM is installed;
4. ``train``: ``gspo train`` of the built-in task in bfloat16 on CUDA (the demo's config,
   40 RL steps instead of 200);
5. ``vs_trl``: gspo vs TRL (when installed) on a random-init Qwen3 of ~0.5B parameters
   (28 layers, hidden 1,024, 16/8 heads, vocabulary 151,936 characters, so EOS is rare
   and responses run to 512 tokens), 16 prompts x 8 responses, 8 optimizer steps,
   one run of each side;
6. ``profile``: the gspo side of 5. again, its start-up and second rollout batch under
   ``log.profile_steps=[0,8]`` (the device's busy share, the host's waits, the costliest
   operators and Python functions: ``profile.md`` and ``profile_startup.md`` beside the
   report);
7. ``async``: the gspo side of 5. with ``rollout.max_staleness`` 0 and 1 (one run each):
   whole-process time, the time the trainer waited for rollouts, and where it went;
8. ``workloads``: gspo vs TRL on issue 33's other workloads (:data:`WORKLOADS`: ~0.4B at
   128 new tokens, ~0.2B at 256, the CPU benchmark's 3M model at 32), one run each side;

and writes one report, ``DIR/report.md`` (and ``report.json``): each stage's outcome and
wall time, the device's peak memory in use during it (``nvidia-smi``, every 0.5 s),
gspo's generation and training tokens/s and their MFU (model FLOPs, as in
``vs_trl.py``, over the GPU's dense bf16 peak and over a measured bf16 matmul rate).

``--stages`` picks and orders the stages (keys ``suite``, ``cuda``, ``precision``,
``precision_runs`` (``experiments/precision.py runs`` on CUDA: the whole-run experiment of
docs/precision.md), ``head`` (the training
forward's vocabulary projection, forward and backward, at each ``model.head_precision``),
``decode``, ``vllm``, ``train``, ``vs_trl``, ``profile``, ``lora`` (one rollout batch of
the full model and of LoRA r=16 over a bf16 base, the time ratio), ``async``,
``workloads``; the report is
rewritten after each, into ``--report-dir``, with the stages' logs (``KEY.log``, the
tests' ``KEY.tests.tsv``) packed beside it as ``logs.tar.gz``), ``--budget`` bounds them
together. A lent GPU of 15 device-minutes runs ``--lease 1`` and ``--lease 2``
(:data:`LEASE`) as two calls through ``benchmarks/gpu_lease.sh``: the whole suite, the
CUDA tests in it (the 25 slowest tests listed), in the first; gspo vs TRL on its four
workloads, the head and decoding in the second.

On a machine without CUDA it stops at once with one line and exit status 2.

``--smoke`` runs the same stages at toy sizes (two small test files for the suite, a
2-layer model, 16-token responses, a few steps, the train stage's cold start cut to 20
steps) on CUDA when present and on the CPU otherwise, in float32 there: a check of this
script end to end before a GPU's minutes are spent on it. Its figures mean nothing.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

#: Dense bf16 tensor-core peaks (FLOP/s) by a substring of the device name (datasheets).
NOMINAL_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "L4": 121e12}

#: The ~0.5B Qwen3 of the vs_trl stage (sizes of Qwen3-0.6B but head_dim 64).
HALF_B = dict(layers=28, hidden=1024, heads=16, kv_heads=8, intermediate=3072)
HALF_B_VOCAB = 151_936
RESPONSE_TOKENS = 512
#: the target for the whole suite on one H100 (``make test`` on a GPU machine)
SUITE_TARGET_S = 600.0
PYTEST_COUNTS = r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed)"


@dataclass(frozen=True)
class Workload:
    """One of the ``workloads`` stage's gspo-vs-TRL runs: ``model`` the TinyModelSpec sizes
    (None: ``vs_trl.py``'s 3M reference model, its own vocabulary), ``vocab`` the padded
    vocabulary, ``tokens`` the most new tokens, ``steps`` optimizer steps (4 per rollout
    batch of 16 prompts x 8)."""

    key: str
    label: str
    model: dict[str, int] | None
    vocab: int | None
    tokens: int
    steps: int
    lr: float


#: Issue 33's other workloads (its table, measured on an H100 at a55081f: 0.90x, 1.59x,
#: 1.77x; targets >= 2x at the 0.4B and the 3M): random-init Qwen3s of ~0.4B (24 x 1024)
#: and ~0.2B (12 x 768; 0.13B was its label there, without the embedding's 117M) at
#: vocabulary 151,936, and the CPU benchmark's 3M reference model at 32 new tokens.
WORKLOADS = (
    Workload("w04b", "~0.4B Qwen3, 128-token responses",
             dict(layers=24, hidden=1024, heads=16, kv_heads=8, intermediate=3072),
             HALF_B_VOCAB, 128, 8, 1e-5),
    Workload("w013b", "~0.2B Qwen3 (12 x 768), 256-token responses",
             dict(layers=12, hidden=768, heads=12, kv_heads=4, intermediate=2304),
             HALF_B_VOCAB, 256, 8, 1e-5),
    Workload("w3m", "the 3M reference model, 32-token responses", None, None, 32, 32, 1e-4),
)  # fmt: skip


@dataclass(frozen=True)
class Sizes:
    """What the stages run: the GPU check's sizes, or ``--smoke``'s toy ones."""

    device: str
    dtype: str  # of the train stage's run
    suite: tuple[str, ...]  # what the suite stage gives pytest (the whole suite: tests/)
    train: tuple[str, ...]  # the train stage's overrides of the demo's config
    model: dict[str, int]  # TinyModelSpec sizes of the vs_trl and async stages' model
    model_label: str
    vocab: int | None  # their vocabulary (None: the reference workload's)
    response_tokens: int
    steps: int  # their optimizer steps (4 per rollout batch)
    precision: tuple[str, ...]  # the precision stage's experiments/precision.py arguments
    precision_steps: int  # the precision_runs stage's RL steps per run
    workloads: tuple[Workload, ...] = WORKLOADS  # the workloads stage's


FULL = Sizes(
    device="cuda",
    dtype="bfloat16",
    suite=("tests",),
    train=("train.max_steps=40", "eval.every=20"),
    model=HALF_B,
    model_label="~0.5B Qwen3",
    vocab=HALF_B_VOCAB,
    response_tokens=RESPONSE_TOKENS,
    steps=8,
    # (the cold start too on CUDA, in float32: on the CPU it takes minutes)
    precision=(
        *("--preset", "long", "--batches", "2"),
        *("--set", "train.cold_start_steps=400", "model.device=cuda"),
    ),
    precision_steps=16,
)


SMOKE_WORKLOADS = (
    Workload("w_toy", "toy 2-layer Qwen3, 8-token responses",
             dict(layers=2, hidden=64, heads=4, kv_heads=2, intermediate=96), 520, 8, 4, 1e-5),
    Workload("w3m", "the 3M reference model, 8-token responses", None, None, 8, 4, 1e-4),
)  # fmt: skip


def smoke_sizes(device: str) -> Sizes:
    """Toy sizes on ``device`` (float32 on the CPU, where bf16 matmuls crawl)."""
    return Sizes(
        device=device,
        dtype="bfloat16" if device == "cuda" else "float32",
        # not the whole suite (which runs --smoke itself); the CUDA tests as the suite has them
        suite=("tests/test_config.py", "tests/test_cuda.py"),
        train=("train.max_steps=4", "eval.every=2", "train.cold_start_steps=20"),
        model=dict(layers=2, hidden=64, heads=4, kv_heads=2, intermediate=96),
        model_label="toy 2-layer Qwen3",
        vocab=520,
        response_tokens=16,
        steps=4,
        precision=("--preset", "default", "--batches", "1", "--set", "train.cold_start_steps=20"),
        precision_steps=2,
        workloads=SMOKE_WORKLOADS,
    )


def parameters(layers: int, hidden: int, heads: int, kv_heads: int, intermediate: int, vocab: int):
    """Parameters of a built-in Qwen3 (tied embeddings; norms left out): (total, non-embedding)."""
    head_dim = hidden // heads
    attention = hidden * head_dim * (2 * heads + 2 * kv_heads)
    body = layers * (attention + 3 * hidden * intermediate)
    return body + vocab * hidden, body


def no_cuda_reason() -> str | None:
    """Why this machine cannot run the check (one line), or ``None`` when it can."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return f"no CUDA device (torch {torch.__version__}: torch.cuda.is_available() is False)"
    return None


class MemoryPoller:
    """Highest ``memory.used`` (MiB) that ``nvidia-smi`` reports while the block runs."""

    def __init__(self, interval: float = 0.5):
        self.interval = interval
        self.peak_mib = 0.0
        self._stop = threading.Event()

    def _poll(self) -> None:
        query = ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"]
        while not self._stop.is_set():
            try:
                out = subprocess.run(query, capture_output=True, text=True, timeout=5).stdout
                used = max(float(x) for x in out.split())
                self.peak_mib = max(self.peak_mib, used)
            except (OSError, ValueError, subprocess.SubprocessError):
                pass
            self._stop.wait(self.interval)

    def __enter__(self) -> MemoryPoller:
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


@dataclass
class Stage:
    """One stage's outcome for the report."""

    name: str
    status: str = "not run"  # passed | failed | skipped | timed out | not run
    seconds: float = 0.0
    peak_memory_mib: float = 0.0
    detail: str = ""
    figures: dict[str, float | str] = field(default_factory=dict)


def run_stage(stage: Stage, body: Callable[[Stage, float], None], limit: float) -> None:
    """Run ``body(stage, limit)``, recording status, wall time and peak device memory."""
    start = time.perf_counter()
    with MemoryPoller() as memory:
        try:
            body(stage, limit)
            if stage.status == "not run":
                stage.status = "passed"
        except subprocess.TimeoutExpired:
            stage.status, stage.detail = "timed out", f"stopped after {limit:.0f} s"
        except Exception as exc:  # any failure goes into the report, and the next stage runs
            stage.status = "failed"
            first = " ".join(str(exc).split())[:1000]
            stage.detail = stage.detail or f"{type(exc).__name__}: {first}"
    stage.seconds = time.perf_counter() - start
    stage.peak_memory_mib = memory.peak_mib


def run(
    command: list[str],
    limit: float,
    stage: Stage,
    log: Path | None = None,
    env: dict[str, str] | None = None,
) -> str:
    """A subprocess within ``limit`` seconds; a non-zero exit fails the stage with its tail.
    ``log``: a file that gets the last MiB of its output, also when it runs out of time;
    ``env``: variables added to this process's environment for it."""
    try:
        out = subprocess.run(command, capture_output=True, text=True, timeout=limit, cwd=ROOT,
                             env={**os.environ, **(env or {})})  # fmt: skip
    except subprocess.TimeoutExpired as timeout:
        if log is not None:
            text = [x.decode(errors="replace") if isinstance(x, bytes) else x or ""
                    for x in (timeout.stdout, timeout.stderr)]  # fmt: skip
            log.write_text(("".join(text) + f"\n(stopped after {limit:.0f} s)\n")[-(2**20) :])
        raise
    if log is not None:
        log.write_text((out.stdout + out.stderr)[-(2**20) :])
    if out.returncode != 0:
        stage.status = "failed"
        tail = (out.stdout + out.stderr).strip().splitlines()[-5:]
        stage.detail = " / ".join(tail)[-600:]
    return out.stdout


def pytest_summary(out: str) -> tuple[str, dict[str, float | str]]:
    """pytest's closing line (``3 failed, 450 passed, 12 skipped in 512.3s``), its counts
    and seconds as figures, and the failing tests (``-ra``'s FAILED / ERROR lines)."""
    words = ("passed", "failed", "skipped", "error")
    lines = [x for x in out.strip().splitlines() if " in " in x and any(w in x for w in words)]
    summary = lines[-1].strip("= ") if lines else ""
    figures: dict[str, float | str] = {}
    for count, word in re.findall(PYTEST_COUNTS, summary):
        figures[word.rstrip("s") if word.startswith("error") else word] = int(count)
    seconds = re.search(r" in ([\d.]+)s", summary)
    if seconds:
        figures["pytest s"] = float(seconds.group(1))
    failing = [x.split(" - ")[0] for x in out.splitlines() if x.startswith(("FAILED ", "ERROR "))]
    if failing:
        figures["failing tests"] = "; ".join(failing)[:2000]
    return summary, figures


def tests_so_far(
    path: Path, slowest: int = 25, file: str = "tests/test_cuda.py"
) -> dict[str, float | str]:
    """What a suite wrote to its GSPO_TEST_LOG (tests/conftest.py ``TestLog``) by the time
    it stopped: the tests that ended (their teardown logged), passed / failed / skipped (a
    test failed if any of its phases did, else skipped if one was), those of ``file`` (the
    CUDA tests, when the suite runs them) apart too, the failing ones, the ones running at
    the stop (begun, not ended) and the slowest ones (their phases' seconds summed). Empty
    when the file is absent."""
    if not path.exists():
        return {}
    seconds: dict[str, float] = {}
    outcome: dict[str, str] = {}
    ended: set[str] = set()
    rank = {"passed": 0, "skipped": 1, "failed": 2}
    for line in path.read_text().splitlines():
        parts = line.split("\t", 3)
        if len(parts) != 4:
            continue  # a line cut off by the stop
        result, took, phase, test = parts
        ended.update([test] if phase == "teardown" else [])
        seconds[test] = seconds.get(test, 0.0) + float(took)
        if rank.get(result, 2) > rank[outcome.get(test, "passed")]:
            outcome[test] = result if result in rank else "failed"
        outcome.setdefault(test, "passed")

    def said(tests: list[str]) -> str:
        counts = {k: sum(outcome[t] == k for t in tests) for k in rank}
        return "{passed} / {failed} / {skipped}".format(**counts)

    figures: dict[str, float | str] = {"tests ended (passed / failed / skipped)": said([*ended])}
    of_file = [t for t in ended if t.startswith(f"{file}::")]
    if of_file:
        figures[f"of them {file}'s"] = said(of_file)
    failing = [t for t, v in outcome.items() if v == "failed"]
    if failing:
        figures["failing tests so far"] = "; ".join(failing)[:2000]
    running = [t for t in outcome if t not in ended]
    if running:
        figures["running at the stop"] = "; ".join(running)[:2000]
    top = sorted(seconds.items(), key=lambda kv: -kv[1])[:slowest]
    figures[f"slowest {len(top)} so far (s)"] = "; ".join(f"{t} {s:.1f}" for t, s in top)
    return figures


def pytest_command(paths: list[str] | tuple[str, ...], workers: int = 0) -> list[str]:
    """``pytest -q`` over ``paths``; over ``workers`` pytest-xdist workers when > 0, an
    idle worker taking tests queued on a busy one (``worksteal``: the suite's minute-long
    torchrun tests otherwise end it on one worker while the others wait)."""
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *paths]
    return [*command, "-n", str(workers), "--dist", "worksteal"] if workers else command


def xdist_workers() -> int:
    """pytest-xdist workers for the suite, as ``make test`` chooses them (TEST_WORKERS in
    the Makefile): half the cores, at most 8, from 8 cores up; else 0 (one process), and
    0 where pytest-xdist is not installed."""
    # the cores this process may use, as `nproc` counts them
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    cores = cores or 1
    if importlib.util.find_spec("xdist") is None or cores < 8:
        return 0
    return min(8, cores // 2)


def pytest_stage(
    paths: list[str] | tuple[str, ...],
    *,
    workers: int = 0,
    target_s: float | None = None,
    log: Path | None = None,
) -> Callable[[Stage, float], None]:
    """pytest over ``paths``; with ``target_s`` the report says whether it ran within it
    (and pytest lists the slowest tests); ``log``: where its output goes (its last MiB)."""

    def body(stage: Stage, limit: float) -> None:
        start = time.perf_counter()
        command = pytest_command(paths, workers)
        if target_s is not None:
            command.append("--durations=25")
            # (said before it runs: a suite stopped at its limit reports it too)
            stage.figures["pytest-xdist workers"] = workers or "none: one process"
        tests_log = log.with_suffix(".tests.tsv") if log is not None else None
        if tests_log is not None:
            tests_log.unlink(missing_ok=True)
        try:
            env = {"GSPO_TEST_LOG": str(tests_log.resolve())} if tests_log else None
            out = run(command, limit, stage, log=log, env=env)
        except subprocess.TimeoutExpired:  # what ended before the stop, from the tests' log
            stage.figures.update(tests_so_far(tests_log) if tests_log else {})
            raise
        seconds = time.perf_counter() - start
        summary, figures = pytest_summary(out)
        stage.figures.update(figures)
        ended = tests_so_far(tests_log) if tests_log else {}  # (the CUDA tests apart)
        stage.figures.update({k: v for k, v in ended.items() if k.startswith("of them")})
        # pytest's own closing line and the failing tests, not its output's last lines
        # (warnings on stderr, at 9891430)
        failing = figures.get("failing tests", "")
        stage.detail = f"{summary}: {failing}" if summary and failing else summary or stage.detail
        if target_s is not None:
            stage.figures["wall s"] = round(seconds, 1)
            stage.figures[f"under {target_s:.0f} s"] = "yes" if seconds < target_s else "NO"
        if stage.status == "not run" and "passed" not in summary:
            stage.status = "skipped"  # nothing ran (no CUDA, say): not a pass

    return body


def train_stage(
    out: Path, sizes: Sizes = FULL, extra: tuple[str, ...] = ()
) -> Callable[[Stage, float], None]:
    """The demo's ``gspo train`` on CUDA in bf16 (``extra``: ``--gspo-set``'s overrides);
    tokens/s from its metrics."""

    def body(stage: Stage, limit: float) -> None:
        run_dir = out / "train"
        # the demo's config, RL cut to 40 steps so the stage fits its time
        command = [sys.executable, "-m", "gspo", "train", "--overwrite", "--output-dir",
                   str(run_dir), f"model.device={sizes.device}", f"model.dtype={sizes.dtype}",
                   *sizes.train, "log.progress=false", "log.plots=false",
                   "log.tensorboard=false", *extra]  # fmt: skip
        run(command, limit, stage)
        records = read_metrics(run_dir)
        train = [r for r in records if "train/loss" in r]
        firsts = [r for r in train if r["train/minibatch"] == 0]
        evals = [r for r in records if "eval/accuracy" in r]
        stage.figures["RL steps"] = len(train)
        generate_s = sum(r["time/generate"] for r in firsts)
        stage.figures["generation s (all rollout batches)"] = round(generate_s, 2)
        stage.figures["forward/backward/optimizer s"] = round(
            sum(r["time/train"] for r in train), 2
        )
        if evals:
            stage.figures["held-out accuracy, first -> last eval"] = (
                f"{evals[0]['eval/accuracy']:.3f} -> {evals[-1]['eval/accuracy']:.3f}"
            )
        checkpoint_figures(records, stage.figures)

    return body


def read_metrics(run: Path) -> list[dict]:
    """A gspo run's ``metrics.jsonl`` records (the checkout's reader)."""
    from gspo.telemetry import read_metrics

    return read_metrics(run)


def time_left(deadline: float, what: str, least: float = 30.0) -> float:
    """The seconds to ``deadline``; a ``TimeoutExpired`` for ``what`` under ``least``
    (a whole process started then would only be killed)."""
    left = deadline - time.perf_counter()
    if left < least:
        raise subprocess.TimeoutExpired(what, left)
    return left


def without_trl(stage: Stage) -> bool:
    """Whether TRL is missing here (the stage is then marked skipped)."""
    if importlib.util.find_spec("trl") is not None:
        return False
    stage.status, stage.detail = "skipped", "TRL is not installed (the `bench` extra)"
    return True


def checkpoint_waits(records: list[dict]) -> float:
    """The seconds a run waited for its checkpoints (``time/checkpoint``)."""
    return sum(r.get("time/checkpoint", 0.0) for r in records if "io/checkpoint_bytes" in r)


#: A checkpoint write's parts (``time/checkpoint_<part>``: gspo.training.checkpoint)
PARTS = ("model", "sharded", "manifest")


def checkpoint_figures(records: list[dict], figures: dict, label: str = "checkpoints") -> float:
    """What a run's checkpoints cost it (train.background_checkpoints: written by a thread;
    the run waits for the copy, and for its last one whole): MB written, s waited / writing,
    and the last one's parts (the HF files, beside the shards; the shards; the manifest's
    CRC-32s). The seconds waited."""
    writes = [r for r in records if "io/checkpoint_bytes" in r]
    waited = checkpoint_waits(records)
    if writes:
        figures[f"{label}, MB written"] = round(
            sum(r["io/checkpoint_bytes"] for r in writes) / 1e6, 1
        )
        writing = sum(r.get("time/checkpoint_write", 0.0) for r in writes)
        figures[f"{label}, s waited / s writing"] = f"{waited:.2f} / {writing:.2f}"
        last = writes[-1]
        parts = [f"{last.get(f'time/checkpoint_{p}', float('nan')):.3f}" for p in PARTS]
        figures[f"{label}, the last one's s {' / '.join(PARTS)}"] = " / ".join(parts)
    return waited


def matmul_peak(device: str = "cuda", size: int = 8192, reps: int = 10) -> float:
    """Measured matmul rate on ``device``, FLOP/s: bf16 on CUDA, float32 on the CPU."""
    import torch

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    a @ b
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    for _ in range(reps):
        a @ b
    sync()
    return 2 * size**3 * reps / (time.perf_counter() - start)


def nominal_peak(name: str) -> float | None:
    return next((peak for key, peak in NOMINAL_BF16.items() if key in name), None)


def workload_for(out: Path, sizes: Sizes) -> tuple[Path, object]:
    """The vs_trl and async stages' workload (built once) and their schedule."""
    import vs_trl
    import workload

    from gspo.models import TinyModelSpec

    work = out / ("half_b" if sizes.model == HALF_B else "toy")
    if not (work / "model").is_dir():
        spec = TinyModelSpec(max_positions=1024, **sizes.model)
        workload.build(work, vocab=sizes.vocab, spec=spec)
    schedule = vs_trl.Schedule(
        steps=sizes.steps, lr=1e-5, max_new_tokens=sizes.response_tokens, device=sizes.device
    )
    return work, schedule


def vs_trl_stage(
    out: Path, peaks: dict[str, float], sizes: Sizes = FULL, extra: tuple[str, ...] = ()
) -> Callable[[Stage, float], None]:
    """gspo vs TRL on the ~0.5B Qwen3 at 512-token responses, one run each (``extra``:
    ``--gspo-set``'s overrides of the gspo side); then, time allowing, gspo once more with
    each of :data:`COMPILE_SETTINGS`, compiling from empty caches, as a user's first run
    does (the compiled graphs' step took 3.68 ms against 4.56 in the decode stage at
    9891430; the training forward's elementwise kernels outweighed its matrix products in
    the profile there: does compiling pay for itself within a whole process?)."""

    def body(stage: Stage, limit: float) -> None:
        import vs_trl

        if without_trl(stage):
            return
        deadline = time.perf_counter() + limit
        work, schedule = workload_for(out, sizes)
        gspo_s, gspo_run = vs_trl.run_gspo(
            work, schedule=schedule, extra=extra, timeout=deadline - time.perf_counter()
        )
        g = vs_trl.gspo_summary(gspo_run)
        stage.figures["gspo whole process s"] = round(gspo_s, 1)
        stage.figures["gspo start-up s / loop s / exit s"] = (
            f"{g['startup_s']:.1f} / {g['loop_s']:.1f} / {g['exit_s']:.1f}"
        )
        records = read_metrics(gspo_run)
        waited = checkpoint_figures(records, stage.figures, "gspo checkpoints")
        trl_s, result = vs_trl.run_trl(work, schedule, timeout=time_left(deadline, "trl_side.py"))
        t = vs_trl.trl_summary(result)
        stage.figures["TRL whole process s"] = round(trl_s, 1)
        # (what both pay outside the loop: the interpreter, torch, transformers, the model)
        stage.figures["TRL loop s (trainer.train()) / outside it s"] = (
            f"{t['loop_s']:.1f} / {trl_s - t['loop_s']:.1f}"
        )
        stage.figures["ratio TRL / gspo"] = round(trl_s / gspo_s, 2)
        stage.figures["ratio of the loops TRL / gspo"] = round(t["loop_s"] / g["loop_s"], 2)
        # TRL's side saves nothing (save_strategy="no"); gspo ends with a resumable checkpoint
        stage.figures["ratio TRL / gspo less its checkpoint waits"] = round(
            trl_s / (gspo_s - waited), 2
        )
        g_len, t_len = vs_trl.mean_length(g), vs_trl.mean_length(t)
        stage.figures["mean completion length gspo / TRL"] = f"{g_len:.0f} / {t_len:.0f}"
        completions = g["steps"] // 4 * vs_trl.ROLLOUT
        gen_flops, train_flops = (completions * f for f in vs_trl.completion_flops(work, g_len))
        gen_s = g["phases"]["generation"]
        train_s = g["phases"][TRAIN_PHASE]
        stage.figures["gspo generation tokens/s"] = round(g["completion_tokens"] / gen_s)
        stage.figures["gspo training tokens/s"] = round(g["completion_tokens"] / train_s)
        for label, peak in peaks.items():
            stage.figures[f"gspo generation MFU ({label})"] = round(gen_flops / gen_s / peak, 3)
            stage.figures[f"gspo training MFU ({label})"] = round(train_flops / train_s / peak, 3)
        for setting in COMPILE_SETTINGS:
            # (compiling from empty caches: allow it twice the plain run)
            if deadline - time.perf_counter() < 2 * gspo_s:
                stage.figures[f"gspo, {setting}"] = "not run: no time left in the stage"
                continue
            try:  # (one failing or running out of time keeps the figures above)
                compiled_s, run = compiled_run(work, schedule, (*extra, setting), deadline)
                c = vs_trl.gspo_summary(run)
                tokens, phases = c["completion_tokens"], c["phases"]
                figures = {
                    "whole process s": round(compiled_s, 1),
                    "ratio TRL / gspo": round(trl_s / compiled_s, 2),
                    "generation tokens/s": round(tokens / phases["generation"]),
                    "training tokens/s": round(tokens / phases[TRAIN_PHASE]),
                }
            except Exception as exc:  # (reported in the stage, the next setting still runs)
                text = " ".join(f"{type(exc).__name__}: {exc}".split())
                stage.figures[f"gspo, {setting}"] = f"failed: {text[:300]}"
                continue
            stage.figures.update({f"gspo, {setting}: {k}": v for k, v in figures.items()})

    return body


#: The vs-TRL stage's gspo runs after the first, each with one of these: the decoder's
#: layers compiled, the training forward's blocks compiled.
COMPILE_SETTINGS = ("rollout.compile=true", "model.compile=true")
TRAIN_PHASE = "forward/backward/optimizer"


def compiled_run(work: Path, schedule, extra: tuple[str, ...], deadline: float):
    """:func:`vs_trl.run_gspo` with ``extra`` (a compile setting), its inductor and Triton
    caches empty directories of its own (a user's first run; not what earlier stages of
    this check compiled). On the CPU (``--smoke``) with torch's linear layers, which
    inductor compiles (oneDNN's it cannot)."""
    import shutil
    from unittest import mock

    import vs_trl

    caches = {
        "TORCHINDUCTOR_CACHE_DIR": work / "inductor_cache",
        "TRITON_CACHE_DIR": work / "triton_cache",
    }
    for path in caches.values():
        shutil.rmtree(path, ignore_errors=True)
    with mock.patch.dict(os.environ, {key: str(path) for key, path in caches.items()}):
        name = "gspo_" + extra[-1].split(".")[0] + "_compiled"  # (its log kept apart)
        return vs_trl.run_gspo(
            work, name=name, schedule=schedule,
            extra=(*extra, *(["model.cpu_linear=torch"] if schedule.device == "cpu" else [])),
            timeout=deadline - time.perf_counter(),
        )  # fmt: skip


def workloads_stage(
    out: Path, sizes: Sizes = FULL, extra: tuple[str, ...] = ()
) -> Callable[[Stage, float], None]:
    """gspo vs TRL on :data:`WORKLOADS` (one whole process each side, in turn), the ratio
    with and without gspo's checkpoint waits (TRL's side saves none)."""

    def body(stage: Stage, limit: float) -> None:
        import vs_trl
        import workload

        from gspo.models import TinyModelSpec

        if without_trl(stage):
            return
        deadline = time.perf_counter() + limit
        for w in sizes.workloads:
            left = time_left(deadline, w.label)
            work = out / w.key
            if not (work / "model").is_dir():
                spec = TinyModelSpec(max_positions=1024, **w.model) if w.model else None
                workload.build(work, vocab=w.vocab, spec=spec)
            schedule = vs_trl.Schedule(
                steps=w.steps, lr=w.lr, max_new_tokens=w.tokens, device=sizes.device
            )
            gspo_s, run = vs_trl.run_gspo(work, schedule=schedule, extra=extra, timeout=left)
            waited = checkpoint_waits(read_metrics(run))
            stage.figures[f"{w.label}: gspo s"] = round(gspo_s, 1)
            trl_s, _ = vs_trl.run_trl(work, schedule, timeout=time_left(deadline, "trl_side.py"))
            stage.figures[f"{w.label}: TRL s"] = round(trl_s, 1)
            stage.figures[f"{w.label}: TRL / gspo (less its checkpoint waits)"] = (
                f"{trl_s / gspo_s:.2f} ({trl_s / (gspo_s - waited):.2f})"
            )

    return body


def profile_stage(
    out: Path, reports: Path, sizes: Sizes = FULL, extra: tuple[str, ...] = ()
) -> Callable[[Stage, float], None]:
    """The start-up and the second rollout batch (optimizer steps 5-8) of the vs_trl
    stage's gspo run under ``log.profile_steps=[0,8]``: where their time goes (the first
    batch holds the warm-ups: graph capture, the libraries' first calls). Their
    ``summary.md`` (the costliest operators on the device and the CPU) are copied beside
    the report as ``profile.md`` and ``profile_startup.md``; then the start-up's pieces
    before the trainer (:data:`STARTUP_PIECES`)."""

    def body(stage: Stage, limit: float) -> None:
        import dataclasses

        import vs_trl

        work, schedule = workload_for(out, sizes)
        two = dataclasses.replace(schedule, steps=8)
        run = work / "gspo_profile"
        try:  # (its final checkpoint: the weights, not 6 GB with the AdamW state)
            vs_trl.run_gspo(
                work, name=run.name, schedule=two, timeout=limit,
                extra=(*extra, "log.profile_steps=[0,8]", "train.save_only_model=true"),
            )  # fmt: skip
        finally:  # (stopped at its limit too: its output, and the start-up's profile if done)
            if (log := work / f"{run.name}.log").exists():
                shutil.copy(log, out / "logs" / "profile_run.log")
            if (startup_md := run / "profile" / "startup" / "summary.md").exists():
                startup = startup_md.read_text()
                (reports / "profile_startup.md").write_text(startup)
                stage.figures["start-up (building the trainer) s"] = profile_figures(startup)[
                    "wall"
                ]
        summary = (run / "profile" / "steps_5-8" / "summary.md").read_text()
        (reports / "profile.md").write_text(summary)
        stage.figures.update(profile_figures(summary))
        stage.figures.update(startup_pieces(sizes.device))

    return body


#: What a process pays before gspo's trainer is built, a piece at a time: each a fresh
#: interpreter (after the profiled run, so the files are cached and compiled as for the
#: runs that follow it); the vs_trl run's start-up, 12.3 s on an H200 at d819f52, was
#: 5.75 s of building the trainer by its profile (887befd) and the rest unaccounted for.
STARTUP_PIECES = {
    "the interpreter": "pass",
    "import torch": "import torch",
    "import torch, the first CUDA tensor": "import torch; torch.zeros(1, device='{device}')",
    "import gspo.cli, transformers' model code": "import gspo.cli, transformers.modeling_utils",
}


def startup_pieces(device: str) -> dict[str, float]:
    """Seconds of each of :data:`STARTUP_PIECES`, one process each."""
    figures = {}
    for label, code in STARTUP_PIECES.items():
        start = time.perf_counter()
        subprocess.run([sys.executable, "-c", code.format(device=device)], check=True,
                       cwd=ROOT, capture_output=True, timeout=120)  # fmt: skip
        figures[f"start-up piece, {label}: s"] = round(time.perf_counter() - start, 2)
    return figures


def profile_figures(summary: str) -> dict[str, str]:
    """The figures of a ``log.profile_steps`` summary: its bullet lines and stage rows
    (seconds, and on CUDA the device seconds of the kernels the stage launched)."""
    figures = {}
    for line in summary.splitlines():
        if line.startswith("- ") and ": " in line:
            key, value = line[2:].split(": ", 1)
            figures[key] = value
        elif row := re.fullmatch(r"\| (time/\S+) \| ([0-9.]+) \|(?: ([0-9.]+) \|)?", line):
            figures[f"{row[1]} s"] = row[2]
            if row[3] is not None:
                figures[f"{row[1]}: its kernels' device s"] = row[3]
    return figures


def precision_stage(
    out: Path, reports: Path, sizes: Sizes = FULL, what: str = "probe"
) -> Callable[[Stage, float], None]:
    """``experiments/precision.py probe`` on the device: one float32 cold start, then per
    setting (float32, bf16 as it was, each agreement fix, the defaults) a
    rollout batch sampled by the torch engine and recomputed by the trainer's forward on
    the device: the sampler-trainer gap per token and per sequence, and the share of
    sequences outside GSPO's clip band (the report: ``precision.md`` beside this one).
    ``what="runs"`` (the ``precision_runs`` stage): its whole RL runs from that cold
    start instead, GSPO and GRPO with pi_old from the sampler in bf16 as it was / with
    the fixes / recomputed / in float32: on- and off-policy clipped tokens, the on-policy
    ratio range (``precision_runs.md``)."""

    def body(stage: Stage, limit: float) -> None:
        where = out / "precision"
        steps = ("--steps", str(sizes.precision_steps)) if what == "runs" else ()
        command = [sys.executable, "experiments/precision.py", what, *sizes.precision, *steps,
                   "--device", sizes.device, "--work-dir", str(where / "work"),
                   "--output-dir", str(where)]  # fmt: skip
        run(command, limit, stage, log=out / "logs" / f"precision_{what}.log")
        if stage.status == "failed":
            return
        name = f"{what}_" + sizes.precision[sizes.precision.index("--preset") + 1]
        report = "precision.md" if what == "probe" else "precision_runs.md"
        (reports / report).write_text((where / f"{name}.md").read_text())
        results = json.loads((where / f"{name}.json").read_text())
        if what == "runs":
            for r in results:
                low, high = r["on_policy_ratio_range"]
                stage.figures[f"{r['run']}: clipped on-policy / off-policy, on-policy ratios"] = (
                    f"{r['on_policy_clip_fraction']:.3f} / {r['off_policy_clip_fraction']:.3f}, "
                    f"{low:.5f} - {high:.5f}"
                )
            return
        for setting, r in results.items():
            stage.figures[f"{setting}: sequences outside the clip band / token gap"] = (
                f"{r['sequences_outside_clip_band']:.3f} / {r['token_abs_mean']:.1e}"
            )

    return body


def decode_stage(out: Path, sizes: Sizes = FULL) -> Callable[[Stage, float], None]:
    """Decoding with ``rollout.cuda_graphs`` off and on, against the bandwidth floor."""

    def body(stage: Stage, limit: float) -> None:
        import decode_graphs

        work, _ = workload_for(out, sizes)
        figures = decode_graphs.compare(
            work, device=sizes.device, tokens=sizes.response_tokens, limit=limit
        )
        stage.figures.update(figures)

    return body


def head_stage(sizes: Sizes = FULL, tokens: int = 4096) -> Callable[[Stage, float], None]:
    """The training forward's vocabulary projection and log-softmax, forward and backward
    (``logprobs_from_hidden``: chunked, each chunk recomputed in backward), for ``tokens``
    tokens of the vs_trl model's hidden size and vocabulary, at each
    ``model.head_precision``, in the default chunks (``head_chunk``: 1,024 tokens of this
    vocabulary on CUDA since 9891430's figures): ms and TFLOP/s (CUDA events after a
    warm-up, mean of 3); then bf16_weight in chunks of 256 tokens (the default until then,
    ``LOGPROB_CHUNK``) and of 4,096."""

    def body(stage: Stage, limit: float) -> None:
        import decode_graphs
        import torch

        from gspo.models import LOGPROB_CHUNK, head_chunk, logprobs
        from gspo.models.kernels import bf16_weight_linear

        device = torch.device(sizes.device)
        hidden_size, vocab = sizes.model["hidden"], sizes.vocab or 520
        n = tokens if sizes is FULL else 256
        g = torch.Generator(device=device).manual_seed(0)
        hidden = torch.randn(1, n, hidden_size, device=device, generator=g, requires_grad=True)
        weight = 0.02 * torch.randn(vocab, hidden_size, device=device, generator=g)
        weight.requires_grad_()
        ids = torch.randint(vocab, (1, n), device=device, generator=g)
        flops = 8 * n * hidden_size * vocab  # forward, its recompute in backward, backward
        ms = {}
        kernels = {"float32": torch.nn.functional.linear, "bf16_weight": bf16_weight_linear}
        chunks: dict[str, int | None] = {name: None for name in kernels}
        stage.figures["default chunk: tokens"] = head_chunk(vocab, device)
        for chunk in (LOGPROB_CHUNK, 4096):
            name = f"bf16_weight, {chunk}-token chunks"
            kernels[name], chunks[name] = bf16_weight_linear, chunk
        for name, linear in kernels.items():

            def step(linear=linear, chunk=chunks[name]):
                out = logprobs.logprobs_from_hidden(hidden, weight, ids, 1.0, chunk, linear=linear)
                out.sum().backward()

            step()  # warm-up
            seconds = decode_graphs.timed(device, lambda: [step() for _ in range(3)]) / 3
            ms[name] = 1e3 * seconds
            stage.figures[f"{name}: ms per {n} tokens"] = round(ms[name], 2)
            stage.figures[f"{name}: TFLOP/s"] = round(flops / seconds / 1e12, 1)
        stage.figures["bf16_weight speed-up"] = round(ms["float32"] / ms["bf16_weight"], 2)

    return body


def lora_stage(out: Path, sizes: Sizes = FULL, rank: int = 16) -> Callable[[Stage, float], None]:
    """One rollout batch (16 prompts x 8, the vs_trl workload's responses) of the full model
    and of the same model with LoRA adapters of rank ``rank`` on every linear layer (B
    random, so they count), as a run holds them: on CUDA the frozen base in bf16, the
    adapters float32 beside it, sampled under bf16 autocast by the fast decoder's per-step
    loop, both sides (``decode_graphs.measure(way="loop")``: the stage compares the two
    models, not the decoders). The target: LoRA within 1.25x of the full model's time."""

    def body(stage: Stage, limit: float) -> None:
        import copy

        import decode_graphs
        import torch

        from gspo.config import LoraSettings, load_config
        from gspo.engines.decoding import fast_decodable
        from gspo.models import load_model
        from gspo.models.kernels import set_linear_kernel
        from gspo.training.lora import attach_lora
        from gspo.training.setup import head_precision

        work, _ = workload_for(out, sizes)
        device = torch.device(sizes.device)
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        full, tokenizer = load_model(work / "model", device=device, dtype=torch.float32)
        lora = attach_lora(copy.deepcopy(full), LoraSettings(r=rank), seed=0, base_dtype=dtype)
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for name, param in lora.named_parameters():
                if "lora_B" in name:
                    param.copy_(torch.randn(param.shape, generator=gen) * 0.01)
        head = head_precision(load_config(None, []), device, dtype)
        lines = (work / "train.jsonl").read_text().splitlines()[: decode_graphs.PROMPTS]
        prompts = [tokenizer(json.loads(x)["prompt"])["input_ids"] for x in lines]
        seconds = {}
        for name, model in (("full", full), (f"LoRA r={rank}", lora)):
            set_linear_kernel(model, "onednn", head)
            # (a bf16 LoRA base took PEFT's forward: the two sides ran different decoders)
            fast = fast_decodable(model)
            stage.figures[f"{name}: decoder"] = "fast (KVDecoder)" if fast else "PEFT's forward"
            m = decode_graphs.measure(
                model.eval(), tokenizer, prompts, tokens=sizes.response_tokens, dtype=dtype,
                way="loop",
            )  # fmt: skip
            seconds[name] = m["seconds"]
            stage.figures[f"{name}: s / tokens/s"] = (
                f"{m['seconds']:.2f} / {m['tokens'] / m['seconds']:.0f}"
            )
        ratio = seconds[f"LoRA r={rank}"] / seconds["full"]
        stage.figures["LoRA / full time (target <= 1.25)"] = round(ratio, 2)

    return body


def async_stage(
    out: Path, sizes: Sizes = FULL, extra: tuple[str, ...] = ()
) -> Callable[[Stage, float], None]:
    """``rollout.max_staleness`` 0 vs 1 on the ~0.5B Qwen3 (the vs_trl stage's workload;
    ``extra``: ``--gspo-set``'s overrides)."""

    def body(stage: Stage, limit: float) -> None:
        import vs_trl

        deadline = time.perf_counter() + limit
        work, schedule = workload_for(out, sizes)
        for k in (0, 1):
            seconds, run_dir = vs_trl.run_gspo(
                work,
                name=f"async_k{k}",
                schedule=schedule,
                extra=(*extra, f"rollout.max_staleness={k}"),
                timeout=time_left(deadline, "gspo train", least=30.0 if k else 0.0),
            )
            g = vs_trl.gspo_summary(run_dir)
            records = read_metrics(run_dir)
            firsts = [r for r in records if "train/loss" in r and r["train/minibatch"] == 0]
            stage.figures[f"k={k} whole process s"] = round(seconds, 1)
            stage.figures[f"k={k} training loop s"] = round(g["loop_s"], 1)
            stage.figures[f"k={k} generation s"] = round(g["phases"]["generation"], 1)
            stage.figures[f"k={k} forward/backward/optimizer s"] = round(
                g["phases"]["forward/backward/optimizer"], 1
            )
            waited = sum(r.get("time/rollout_wait", 0.0) for r in firsts)
            stage.figures[f"k={k} waited for rollouts s"] = round(waited, 1)
        stage.figures["loop k=0 / k=1"] = round(
            stage.figures["k=0 training loop s"] / stage.figures["k=1 training loop s"], 2
        )

    return body


def render(stages: list[Stage], header: dict[str, str]) -> str:
    """The report as markdown: the machine, then one section per stage."""
    lines = ["# gspo GPU check", ""]
    lines += [f"- {key}: {value}" for key, value in header.items()]
    lines += ["", "| stage | outcome | wall s | peak device memory (MiB) | detail |"]
    lines += ["|---|---|---|---|---|"]
    for s in stages:
        detail = s.detail.replace("|", "/")
        lines.append(
            f"| {s.name} | {s.status} | {s.seconds:.1f} | {s.peak_memory_mib:.0f} | {detail} |"
        )
    for s in stages:
        if s.figures:
            lines += ["", f"## {s.name}", "", "| figure | value |", "|---|---|"]
            lines += [f"| {k} | {v} |" for k, v in s.figures.items()]
    return "\n".join(lines) + "\n"


#: The stages ``--stages`` picks from, in the order a full check runs them, with the
#: seconds each may take at most (the suite's is ``--suite-limit``).
STAGES = (
    "suite", "cuda", "precision", "precision_runs", "head", "decode", "vllm", "train",
    "vs_trl", "profile", "lora", "async", "workloads",
)  # fmt: skip
SHARES = {
    "cuda": 190, "precision": 120, "precision_runs": 420, "head": 30, "decode": 120,
    "vllm": 150, "train": 180, "vs_trl": 300, "profile": 120, "lora": 60, "async": 150,
    "workloads": 300,
}  # fmt: skip

#: What a GPU lease of 15 device-minutes runs, as two calls (``benchmarks/gpu_lease.sh 1``
#: then ``2``) beside a machine start of 1-2 minutes: the numerics and the suite first,
#: then speed. ``budget`` is the call's seconds for its stages, ``suite`` the suite's.
#: The stages' shares exceed the budgets: a stage takes at most its share of what is left,
#: in order, and the last all that is left, so part 2 is gspo vs TRL first and the others
#: as far as time allows; the rest wait for another lease or ``--stages``.
#: Part 1 is the whole suite, the CUDA tests in it (its workers share them; the report
#: counts them apart). On one H200 at 289ba95 (benchmarks/gpu_reports/) the CUDA tests
#: took 126 s alone and the suite then ended 1,772 of its 1,781 other tests (none failed)
#: in the 273 s left, 8 workers: its tests' own seconds summed to 1,510 (the chain task's
#: documented run 150 of them), so the suite needs about 300 s and the CUDA tests' 117 s
#: spread over its workers. A call's ``timeout_s`` must leave the wheels' install and the
#: report beyond ``budget`` (45 s or more): a call cut there returns nothing. At 887befd the
#: profile took 68 s and decoding 59 s (now with compiled layers, the step's kernel
#: families and the graphs' attention ways: up to 120 s, those extras skipped once it is
#: spent); gspo vs TRL 130 s at d819f52; the head (seconds) before async (k=0 vs 1, never
#: measured), which may be cut. The
#: whole lease: 440 s and 320 s of stages (a stage's own runs may overrun what it was
#: given), the machine's start with part 1's transfers 48 s, the wheels' install (with
#: their byte-compiling) about 15 s in part 1 and none in part 2 (``gpu_lease.sh`` keeps
#: it), within 900 s. LoRA (1.23x, target met at 02e1dd7) and the bf16 probe are left to
#: ``--stages``. At 9891430 (H200) part 1 ended the whole suite in 322 s, and part 2,
#: given the 470 s left, ran the profile (97 s), gspo vs TRL (117), decoding (125), the
#: head (1) and async (74; k=1 slower than k=0) before the bf16 demo ran out of time.
#: Since, part 2 is gspo vs TRL (then gspo with its decoder compiled, and with its
#: training blocks compiled), the head (seconds), the other workloads against TRL (not
#: measured since a55081f) and decoding (what time is left); the profile, async and the
#: demo by ``--stages``.
LEASE: dict[str, dict] = {
    "1": {"stages": "suite", "budget": 440.0, "suite": 430.0},
    "2": {"stages": "vs_trl,head,workloads,decode", "budget": 320.0, "suite": 0.0},
}


def pack(logs: Path, target: Path) -> None:
    """Every file in ``logs`` (the stages' pytest and script logs) into one ``target``
    archive: a lent GPU's call returns at most 8 files, so the logs travel as one."""
    import tarfile

    partial = target.with_suffix(".partial")
    with tarfile.open(partial, "w:gz") as archive:
        for path in sorted(p for p in logs.iterdir() if p.is_file()):
            archive.add(path, arcname=path.name)
    partial.replace(target)


def parse_stages(text: str) -> list[str]:
    """``--stages``' comma-separated keys, in the order given; one line naming a wrong one."""
    keys = [k.strip() for k in text.split(",") if k.strip()]
    unknown = [k for k in keys if k not in STAGES]
    if unknown or not keys or len(set(keys)) < len(keys):
        raise argparse.ArgumentTypeError(
            f"--stages {text!r}: each of {', '.join(STAGES)} at most once"
            + (f" ({', '.join(unknown)} is not one)" if unknown else "")
        )
    return keys


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "gpu_check")
    parser.add_argument(
        "--report-dir",
        type=Path,
        default=None,
        help="where report.md, report.json and the pytest logs go (default: --out)",
    )
    parser.add_argument(
        "--stages",
        type=parse_stages,
        default=list(STAGES),
        help=f"comma-separated, run in the order given (default: {','.join(STAGES)})",
    )
    parser.add_argument(
        "--budget",
        type=float,
        default=None,
        help="seconds for all the stages (default: 570, plus --suite-limit with the suite)",
    )
    parser.add_argument(
        "--suite-limit",
        type=float,
        default=1200.0,
        help=f"seconds the whole suite may run (the target is {SUITE_TARGET_S:.0f})",
    )
    parser.add_argument(
        "--smoke", action="store_true", help="toy sizes, on the CPU when there is no CUDA"
    )
    parser.add_argument(
        "--gspo-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a config override for the gspo runs of the train, vs_trl and async stages "
        "(e.g. rollout.cuda_graphs=true); repeatable",
    )
    parser.add_argument(
        "--lease",
        choices=sorted(LEASE),
        help="one call of a 15-minute GPU lease: its stages and budget (see LEASE)",
    )
    args = parser.parse_args()
    if args.lease:  # its stages and limits; a --budget given beside it (less time left) wins
        lease = LEASE[args.lease]
        args.stages, args.suite_limit = parse_stages(lease["stages"]), lease["suite"]
        args.budget = lease["budget"] if args.budget is None else args.budget
    reason = no_cuda_reason()
    if reason is not None and not (args.smoke and importlib.util.find_spec("torch")):
        print(f"gpu-check: {reason}; nothing run", file=sys.stderr)
        return 2
    import torch

    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])]
    )
    sys.path.insert(0, str(ROOT / "src"))  # (as the children: the checkout is measured)
    from gspo.provenance import code_commit

    reports = args.report_dir or args.out
    logs = args.out / "logs"  # (packed into the report dir's logs.tar.gz after each stage)
    for folder in (args.out, reports, logs):
        folder.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    budget = args.budget
    if budget is None:
        budget = 570.0 + (args.suite_limit if "suite" in args.stages else 0.0)
    sizes = smoke_sizes("cpu" if reason else "cuda") if args.smoke else FULL
    if sizes.device == "cuda":
        name = torch.cuda.get_device_name()
        memory = f"{torch.cuda.get_device_properties(0).total_memory / 2**30:.0f} GiB"
        measured = matmul_peak()
        peaks = {"measured bf16 matmul": measured}
        if nominal_peak(name):
            peaks["datasheet dense bf16"] = nominal_peak(name)
        rate = f"{measured / 1e12:.0f} TFLOP/s (bf16, 8192^3)"
    else:
        import platform

        name, memory = f"CPU ({platform.machine()})", f"{torch.get_num_threads()} threads"
        measured = matmul_peak("cpu", size=1024, reps=3)
        peaks = {"measured float32 matmul": measured}
        rate = f"{measured / 1e9:.0f} GFLOP/s (float32, 1024^3)"
    header = {
        "device": f"{name}, {memory}",
        "torch": torch.__version__,
        "commit": code_commit(),
        "measured matmul": rate,
        "stages": f"{','.join(args.stages)} in {budget:.0f} s",
    }
    if args.gspo_set:
        header["gspo overrides"] = " ".join(args.gspo_set)
    if args.smoke:
        header["mode"] = "smoke: toy sizes, a check of the script; the figures mean nothing"
    model = f"{sizes.model_label}, {sizes.response_tokens}-token responses"
    # the suite leaves test_cuda.py to the cuda stage when that runs too
    cuda_apart = "cuda" in args.stages
    suite = [p for p in sizes.suite if not (cuda_apart and p == "tests/test_cuda.py")]
    suite += ["--ignore=tests/test_cuda.py"] if cuda_apart else []
    stages = {
        "suite": (
            Stage("test suite" + (" (smoke: one file)" if args.smoke else "")),
            pytest_stage(
                suite, workers=xdist_workers(), target_s=SUITE_TARGET_S, log=logs / "suite.log"
            ),
        ),
        "cuda": (
            Stage("tests (CUDA)"),
            pytest_stage(["tests/test_cuda.py"], log=logs / "cuda.log"),
        ),
        "precision": (
            Stage("sampler vs trainer log-probs per precision setting (the bf16 probe)"),
            precision_stage(args.out, reports, sizes),
        ),
        "precision_runs": (
            Stage("GSPO's and GRPO's clipping per precision setting, whole runs"),
            precision_stage(args.out, reports, sizes, what="runs"),
        ),
        "head": (
            Stage(f"log-prob head forward+backward, {sizes.model_label} sizes"),
            head_stage(sizes),
        ),
        "decode": (
            Stage(f"decode, rollout.cuda_graphs off vs on, {model}"),
            decode_stage(args.out, sizes),
        ),
        "vllm": (
            Stage("vLLM engine tests"),
            pytest_stage(["tests/test_vllm_engine.py"], log=logs / "vllm.log")
            if importlib.util.find_spec("vllm") is not None
            else None,
        ),
        "train": (
            Stage(f"gspo train, built-in task, {sizes.dtype}"),
            train_stage(args.out, sizes, tuple(args.gspo_set)),
        ),
        "vs_trl": (
            Stage(f"gspo vs TRL, {model}"),
            vs_trl_stage(args.out, peaks, sizes, tuple(args.gspo_set)),
        ),
        "workloads": (
            Stage("the other workloads, gspo vs TRL"),
            workloads_stage(args.out, sizes, tuple(args.gspo_set)),
        ),
        "profile": (
            Stage(f"one rollout batch profiled, {model}"),
            profile_stage(args.out, reports, sizes, tuple(args.gspo_set)),
        ),
        "lora": (
            Stage(f"LoRA generation vs the full model, {model}"),
            lora_stage(args.out, sizes),
        ),
        "async": (
            Stage(f"async rollouts, max_staleness 0 vs 1, {sizes.model_label}"),
            async_stage(args.out, sizes, tuple(args.gspo_set)),
        ),
    }
    done: list[Stage] = []
    for key in args.stages:
        stage, body = stages[key]
        share = args.suite_limit if key == "suite" else SHARES[key]
        left = budget - (time.perf_counter() - start)
        if body is None:
            stage.status, stage.detail = "skipped", "vLLM is not installed"
        elif left < 20:
            stage.status, stage.detail = "not run", "no time left in the budget"
        else:
            run_stage(stage, body, left if key == args.stages[-1] else min(share, left))
        print(f"{stage.name}: {stage.status} ({stage.seconds:.0f} s) {stage.detail}", flush=True)
        done.append(stage)
        (reports / "report.md").write_text(render(done, header))
        try:
            pack(logs, reports / "logs.tar.gz")
        except OSError as exc:  # (the report stands without its logs)
            print(f"gpu-check: the logs were not packed ({exc})", flush=True)
        (reports / "report.json").write_text(
            json.dumps({"header": header, "stages": [s.__dict__ for s in done]}, indent=1)
        )
    print(f"report: {reports / 'report.md'}")
    return 0 if all(s.status in ("passed", "skipped") for s in done) else 1


if __name__ == "__main__":
    sys.exit(main())
