"""``gspo compare``: GSPO, GRPO and GSPO-token from one cold start, several seeds, one report.

The runs share everything but ``algorithm.level`` (each level with its paper clip range)
and ``train.seed``: the same config, task, budget and cold-start checkpoint. Layout under
the output directory::

    cold_start/                the shared cold start (its checkpoints/step-0000000)
    runs/<algorithm>-seed<N>/  one ``gspo train`` run each (reused when finished,
                               resumed from its last checkpoint when interrupted)
    report.md, report.html     the report (the HTML embeds the plots)
    plots/*.png, summary.json

This module plans and launches the runs (the algorithms, the presets, each run's config,
the shared cold start); :mod:`gspo.experiments.report` writes the report, which states a
verdict per claim of the paper (reproduced, not reproduced or inconclusive) with the figure
behind it; :func:`gspo.experiments.claims.verdicts` holds the rules.
"""

from __future__ import annotations

import functools
import hashlib
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import yaml

from gspo.config import Config, changed_settings, flat_settings, load_config
from gspo.config.loading import dump_config_text
from gspo.experiments.report import write_report
from gspo.experiments.summary import (
    CACHED_FROM,
    Run,
    cold_start_cached,
    cold_start_seconds,
    collapse,
    record_collapse,
    train_lines,
)
from gspo.experiments.trained_on import PROVENANCE as PROVENANCE
from gspo.experiments.trained_on import provenance as provenance
from gspo.experiments.trained_on import record_provenance
from gspo.telemetry import read_metrics

#: name -> overrides; the clip ranges are each level's defaults (the paper's).
ALGORITHMS: dict[str, list[str]] = {
    "GSPO": ["algorithm.level=sequence"],
    "GRPO": ["algorithm.level=token"],
    "GSPO-token": ["algorithm.level=sequence_token"],
}

#: Keys gspo compare sets itself for every run, and how the user chooses them instead.
OWNED: dict[str, str] = {
    **{
        o.split("=", 1)[0]: "per algorithm (choose them with --algorithms)"
        for overrides in ALGORITHMS.values()
        for o in overrides
    },
    "train.seed": "per run (choose them with --seeds)",
    # one range for all three would compare GRPO at GSPO's band or the other way round
    "algorithm.clip_low": "per algorithm (each level's paper clip range)",
    "algorithm.clip_high": "per algorithm (each level's paper clip range)",
}

#: Why LoRA settings are refused (the shared cold start's step 0 would be an adapter).
NO_LORA = (
    "gspo compare runs full fine-tuning only (its shared cold start and runs take whole "
    "weights); compare LoRA runs with gspo train"
)

#: Overrides per preset, applied before the user's (which win), cold start included.
#: "stress" is where the paper predicts GRPO trouble: more off-policy minibatches per
#: rollout batch and a 3x larger learning rate. "long" is the paper's other lever: long
#: responses (the chain task, 20-130 tokens against addition's 3-4) and twice the default
#: minibatches, on a smaller model, sized for about half an hour on 2 CPU cores.
PRESETS: dict[str, list[str]] = {
    "default": [],
    # (train.max_steps: the default 200 as the run takes it, 13 whole rollout batches)
    "stress": ["algorithm.minibatches=16", "rollout.prompts_per_batch=64", "train.max_steps=208"],
    "long": [
        "data.task=chain",
        "data.terms=12",
        "data.label_noise=0.2",
        "reward.functions=[numeric_match]",
        "rollout.max_new_tokens=144",
        "model.layers=2",
        "model.hidden=128",
        "model.heads=4",
        "model.kv_heads=2",
        "model.intermediate=384",
        "train.cold_start_steps=1000",
        "train.max_steps=128",
        "algorithm.minibatches=8",
        # at the default 1e-4 all three degraded in a trial (held-out 0.72 -> 0.53-0.60)
        "optim.lr=2e-5",
        "eval.every=32",
        "eval.max_prompts=96",
        "log.ratio_dump_every=2",
    ],
    # Multi-turn episodes with a tool (docs/environments.md): 5-digit additions that the
    # small model cannot do by itself, and an add tool the cold start calls unreliably;
    # the task brings its own turns, model and schedule (gspo.tasks.TASK_DEFAULTS).
    "tools": ["data.task=calculator", "log.ratio_dump_every=4"],
}
STRESS_LR_FACTOR = 3.0

#: Rollout batches between ratio dumps (``log.ratio_dump_every``) in compared runs.
RATIO_DUMP_EVERY = 5


def ratio_dump_every(config: Config) -> int:
    """:data:`RATIO_DUMP_EVERY`, or for a run of at most twice as many rollout batches a
    quarter of them: the report reads the dumps of the second half of training (an 8-step
    run's only dump was rollout batch 0's, before any update: "the policy did not move")."""
    batches = -(-config.train.max_steps // config.algorithm.minibatches)
    if batches > 2 * RATIO_DUMP_EVERY:
        return RATIO_DUMP_EVERY
    return max(1, batches // 4)


def slug(algorithm: str) -> str:
    return algorithm.lower().replace("-", "_")


def finished(run_dir: Path, max_steps: int) -> bool:
    """Whether ``run_dir`` holds a run that reached ``max_steps`` (its metrics say so)."""
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        return False
    steps = [r["step"] for r in train_lines(read_metrics(metrics))]
    return bool(steps) and max(steps) >= max_steps


#: What compare asked of a run (or of the cold start), kept beside it: a later compare into
#: the same directory reuses or resumes it only when it asks the same.
REQUEST = "compare_request.yaml"


#: Settings a reused or resumed run may change: what is logged, and the cold-start cache's
#: (``--no-cache``, its directory and size: none changes what is trained).
FREE = ("log.", "train.cold_start_cache")

#: And the shared cold start's: RL's optimizer and objective, which it never uses (it takes
#: no RL step), so that a sweep of ``optim.lr`` in one output directory keeps it.
COLD_START_FREE = (*FREE, "optim.", "algorithm.")

#: The shared cold start's directory in the output directory.
COLD_START = "cold_start"

#: Stands for the output directory in a recorded request: a copied or moved directory
#: asks the same of its runs (their model is the directory's own cold start).
HERE = "<output-dir>"


def _request(config: Config, root: Path | None, older: bool = False) -> dict[str, Any]:
    """``config`` as a tree, its paths absolute (``train.jsonl`` given in two directories
    named two files) and ``root`` (the output directory) in them as :data:`HERE`, and the
    digests of the files it reads (``contents``, :func:`input_digests`). ``older``: as a
    request recorded before 19da888 was (paths as given, no digests), to compare with one.
    """
    from gspo.training.setup import with_absolute_paths

    tree = yaml.safe_load(dump_config_text(config if older else with_absolute_paths(config)))
    if not older:
        tree["contents"] = input_digests(config)
    return _relative(tree, root)


def input_digests(config: Config) -> dict[str, str]:
    """A digest of each local file (or directory) a run reads that its settings name by
    path alone: ``data.train/eval/sft``, reward function files, the environment's file. A
    compare rerun after the data or a reward function was edited reused the runs made
    from the old ones, and wrote their report as new. Not the model's directory (its
    weights are too large to read each time) nor what those files import."""
    named = {f"data.{key}": getattr(config.data, key) for key in ("train", "eval", "sft")}
    named.update({f"reward.functions.{i}": f for i, f in enumerate(config.reward.functions)})
    named["rollout.environment"] = config.rollout.environment
    digests = {}
    for key, value in named.items():
        if not isinstance(value, str):
            continue
        path = next(
            (p for p in (Path(value), Path(value.partition(":")[0])) if p.expanduser().exists()),
            None,
        )
        if path is None:  # a built-in, a hub id, a module: nothing of the user's to read
            continue
        path = path.expanduser().resolve()
        files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
        stamps = tuple((str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files)
        digests[key] = _digest(path, stamps)
    return digests


@functools.lru_cache(maxsize=64)
def _digest(path: Path, stamps: tuple[tuple[str, int, int], ...]) -> str:
    """The files' names under ``path`` and bytes, read once while their sizes and times
    (``stamps``) stay: every run of a compare names the same data."""
    h = hashlib.sha256()
    for name, _, _ in stamps:
        file = Path(name)
        h.update(str(file.relative_to(path) if path.is_dir() else "").encode() + b"\0")
        h.update(file.read_bytes())
    return h.hexdigest()[:16]


def _relative(tree: Any, root: Path | None) -> Any:
    if isinstance(tree, dict):
        return {key: _relative(value, root) for key, value in tree.items()}
    if isinstance(tree, list):
        return [_relative(value, root) for value in tree]
    under = root is not None and isinstance(tree, str)  # (a path under it, not one like it)
    if under and (tree == str(root) or tree.startswith(f"{root}{os.sep}")):
        return HERE + tree[len(str(root)) :]
    return tree


def changed_request(config: Config, run_dir: Path, root: Path | None = None) -> str | None:
    """What differs between ``config`` and what ``run_dir`` was made with (None: the same,
    or nothing made yet). ``log.*`` and the cache may change, and ``train.max_steps`` may
    grow (a finished run is then resumed to it); the cold start's RL settings may change
    (:data:`COLD_START_FREE`)."""
    path = run_dir / REQUEST
    if not path.is_file():
        return None
    free = COLD_START_FREE if root is not None and run_dir == root / COLD_START else FREE
    recorded = yaml.safe_load(path.read_text())
    # (an older request: absolute paths, no data.seed; or paths as given and no contents)
    asked = _data_seed(flat_settings(_request(config, root, older="contents" not in recorded)))
    before = _data_seed(flat_settings(_relative(recorded, root)))
    changed = changed_settings(before, asked, free)
    more = f" (and {len(changed) - 3} more)" if len(changed) > 3 else ""
    return f"{'; '.join(changed[:3])}{more}" if changed else None


def _data_seed(flat: dict[str, Any]) -> dict[str, Any]:
    """``data.seed`` as the data it draws (:attr:`Config.task_seed`, on a recorded
    request's keys): none for the user's own data, where it draws nothing; train.seed's
    where null or unrecorded (runs made before it existed)."""
    if flat.get("data.train") is not None:
        flat.pop("data.seed", None)
    elif flat.get("data.seed") is None and "train.seed" in flat:
        flat["data.seed"] = flat["train.seed"]
    return flat


def write_request(config: Config, run_dir: Path, root: Path | None = None) -> None:
    """Record what is asked of ``run_dir`` (``root``, the output directory, as
    :data:`HERE`), once its trainer is set up: a compare stopped by bad input (a missing
    file, a misspelt reward function) recorded it first, and refused the corrected
    command into the same directory as "made with other settings". A later compare into
    the directory reuses or resumes it only when it asks the same
    (:func:`unchanged_requests`: a rerun with other overrides or another preset reused
    every run, and resumed an interrupted one under the new settings, while the report
    named the new ones)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / REQUEST).write_text(yaml.safe_dump(_request(config, root), sort_keys=False))


def run_or_reuse(
    config: Config,
    run_dir: Path,
    log: Callable[[str], None],
    root: Path | None = None,
    *,
    go_on: bool = False,
) -> list[dict[str, Any]]:
    """Train ``config`` into ``run_dir``; reuse a finished run, resume an interrupted one,
    each only when it was made with the same settings (:func:`write_request`). ``go_on``
    (compare's): a run ``train.max_skipped`` stops is recorded as collapsed
    (:func:`~gspo.experiments.summary.collapse`) and its records returned, not raised; a
    run recorded so is reused by compare alone (other callers get the error)."""
    from gspo.trainer import Trainer
    from gspo.training.update import NonFiniteTraining

    unchanged_requests({run_dir: config}, root)
    fell = collapse(run_dir)  # (stopped on train.max_skipped: it would collapse again)
    if fell and not go_on:  # (a compare's: reused as if finished, where training raises)
        raise NonFiniteTraining(
            f"{run_dir} collapsed at step {fell['step']} (a gspo compare went on past it: "
            f"{fell['reason']}): delete it to redo it",
            fell["step"],
        )
    if fell or finished(run_dir, config.train.max_steps):
        log(f"  reusing {run_dir}" + (f" (collapsed at step {fell['step']})" if fell else ""))
        return read_metrics(run_dir / "metrics.jsonl")
    resume = resumable(run_dir)
    log(f"  {'resuming' if resume else 'training'} {run_dir}")
    try:
        with Trainer(in_trackers(config, run_dir, root), run_dir, resume=resume) as trainer:
            write_request(config, run_dir, root)
            record_provenance(run_dir)  # (once it starts)
            return trainer.fit()
    except NonFiniteTraining as exc:  # (it stopped the whole compare, its collapse unsaid)
        if not go_on:
            raise
        record_collapse(run_dir, exc.step, str(exc))
        log(f"  collapsed at step {exc.step}: {exc}; going on with the other runs")
        return read_metrics(run_dir / "metrics.jsonl")


def resumable(run_dir: Path) -> bool:
    """Whether ``run_dir`` holds a run to resume (False: nothing to resume); one line where
    it has checkpoints but lost its ``metrics.jsonl`` (the trainer's refusal advised
    ``resume=True`` or ``overwrite=True``, which compare has not; a resume would report
    the steps trained after it alone)."""
    from gspo.trainer import latest_checkpoint

    if latest_checkpoint(run_dir) is None:
        return False
    if not (run_dir / "metrics.jsonl").is_file():
        raise ValueError(
            f"{run_dir} has checkpoints but no metrics.jsonl, the records its report is "
            "made of: delete it to redo it"
        )
    return True


def in_trackers(config: Config, run_dir: Path, root: Path | None) -> Config:
    """``config`` with its W&B and MLflow runs named for the compare's run ``run_dir``
    (``grpo-seed1``, after the user's own name) and grouped by the compare (W&B's group,
    MLflow's ``gspo_compare`` tag): every run was named the user's name alone, none said
    its algorithm or seed. An ``id``/``run_id`` of the user's, which would put every run
    into one, is left out."""
    log = config.log
    if log.wandb is None and log.mlflow is None:
        return config
    config = config.model_copy(deep=True)
    label = run_dir.name
    group = (root or run_dir.parent).resolve().name
    if log.wandb is not None:
        wandb = {k: v for k, v in log.wandb.items() if k != "id"}
        wandb["name"] = f"{wandb['name']}-{label}" if wandb.get("name") else label
        config.log.wandb = {**wandb, "group": wandb.get("group") or group}
    if log.mlflow is not None:
        mlflow = {k: v for k, v in log.mlflow.items() if k != "run_id"}
        named = mlflow.get("run_name")
        mlflow["run_name"] = f"{named}-{label}" if named else label
        config.log.mlflow = {
            **mlflow,
            "tags": {**(mlflow.get("tags") or {}), "gspo_compare": group},
        }
    return config


def cold_start_checkpoint(
    base: list[str], config_path: Path | None, out: Path, log: Callable[[str], None]
) -> Path:
    """The shared cold start: ``out/cold_start/checkpoints/step-0000000`` (made once)."""
    from gspo.models import model_files

    path = cold_start_path(out)
    config = cold_start_config(base, config_path)
    unchanged_requests({out / COLD_START: config}, out)
    if (model_files(path) / "config.json").is_file():  # (a step 0 may name its model)
        log(f"cold start: reusing {path}")
        return path
    log("cold start")
    from gspo.trainer import Trainer

    with Trainer(in_trackers(config, out / COLD_START, out), out / COLD_START) as trainer:
        write_request(config, out / COLD_START, out)
        # (one the cache gives was trained by this code too: its key holds gspo's sources)
        record_provenance(out / COLD_START)
        from gspo.training.cold_start import reusable_entry

        entry = reusable_entry(trainer.config, trainer.data.sft, trainer.policy, trainer.dist)
        said = out / COLD_START / CACHED_FROM  # (its metrics are an uncached run's: beside)
        if entry is not None:
            said.write_text(str(entry))
        else:  # (an earlier attempt's, whose entry has gone since: trained here)
            said.unlink(missing_ok=True)
        trainer.fit()
    if entry := cold_start_cached(out / COLD_START):  # (log.progress=false: it said nothing)
        took = cold_start_seconds(out / COLD_START) / 60
        log(f"cold start: taken from the cache {entry} (the run that trained it took {took:.1f} "
            "min; --no-cache redoes it)")  # fmt: skip
    return path


def cold_start_path(out: Path) -> Path:
    from gspo.training.checkpoint import CHECKPOINTS

    return out / COLD_START / CHECKPOINTS / f"step-{0:07d}"


def cold_start_config(base: list[str], config_path: Path | None) -> Config:
    config = load_config(config_path, [*base, "train.max_steps=0"])
    if config.model.lora.r > 0:
        raise ValueError(f"model.lora.r={config.model.lora.r}: {NO_LORA}")
    return config


def with_preset(preset: str, overrides: Sequence[str]) -> list[str]:
    """The preset's overrides, then the user's (so that the user's win)."""
    return [*PRESETS[preset], *overrides]


def run_configs(
    config_path: Path | None,
    overrides: Sequence[str],
    *,
    checkpoint: Path,
    seeds: Sequence[int],
    preset: str,
    algorithms: Sequence[str] = tuple(ALGORITHMS),
) -> dict[tuple[str, int], Config]:
    """The config of every (algorithm, seed) run: a built-in task's data is the cold
    start's (``data.seed``) whatever the run's seed (seed 1's held-out prompts were drawn
    apart from seed 0's, and most were rows the cold start had trained on)."""
    given = load_config(config_path, with_preset(preset, overrides))
    extra = [f"data.seed={given.task_seed}"]
    if preset == "stress":
        extra.append(f"optim.lr={given.optim.lr * STRESS_LR_FACTOR}")
    configs = {}
    for name in algorithms:
        algo = ALGORITHMS[name]
        for seed in seeds:
            configs[name, seed] = load_config(
                config_path,
                [
                    f"log.ratio_dump_every={ratio_dump_every(given)}",  # a preset may change it
                    *with_preset(preset, overrides),
                    *extra,
                    *algo,
                    f"model.path={checkpoint}",
                    "train.cold_start_steps=0",
                    f"train.seed={seed}",
                    "log.progress=false",
                    "log.plots=false",
                ],
            )
    return configs


def compare(
    config_path: Path | None,
    overrides: Sequence[str],
    out: Path,
    *,
    seeds: Sequence[int] = (0, 1, 2),
    preset: str = "default",
    log: Callable[[str], None] = print,
    algorithms: Sequence[str] = tuple(ALGORITHMS),
) -> dict[str, Any]:
    """Run (or reuse) every run, then write the report; returns the summary."""
    preset = {name.lower(): name for name in PRESETS}.get(preset.lower(), preset)  # (Stress)
    if preset not in PRESETS:
        raise ValueError(f"--preset {preset!r}: expected one of {', '.join(PRESETS)}")
    named = {name.lower(): name for name in ALGORITHMS}  # (gspo,grpo as algorithm.level)
    given, algorithms = algorithms, [named.get(a.lower(), a) for a in algorithms]
    unknown = [a for a in algorithms if a not in ALGORITHMS]
    if unknown or not algorithms:
        raise ValueError(
            f"--algorithms {','.join(given)!r}: expected some of {', '.join(ALGORITHMS)}"
        )
    if twice := sorted({a for a in algorithms if algorithms.count(a) > 1}):
        raise ValueError(f"--algorithms {','.join(given)!r}: {', '.join(twice)} named twice")
    if not seeds:
        raise ValueError("--seeds: at least one seed")
    refuse_owned(config_path, preset, overrides)
    from gspo.runs import hold_lock

    out = output_directory(out)
    lock = hold_lock(out, "gspo compare: --output-dir", "comparing in this directory")
    try:
        return _compare(config_path, overrides, out, seeds, preset, log, algorithms)
    finally:
        if lock is not None:
            os.close(lock)


def refuse_owned(config_path: Path | None, preset: str, overrides: Sequence[str]) -> None:
    """One line for a setting gspo compare owns (:data:`OWNED`) or refuses (LoRA), set by
    an override, a section's override (``algorithm={clip_low: 0.1}``) or ``--config``."""
    for override in overrides:
        key = override.split("=", 1)[0].strip()
        if key in OWNED:
            raise ValueError(f"{override}: gspo compare sets {key} {OWNED[key]}; drop it")
        if key.startswith("model.lora."):
            raise ValueError(f"{override}: {NO_LORA}")
    # (level and seed are set after these for every run; the clip ranges are left unset)
    given = load_config(config_path, [*with_preset(preset, overrides), "train.cold_start_steps=0"])
    if given.train.max_steps == 0:
        raise ValueError("train.max_steps=0: the runs would train nothing to compare")
    if given.train.time_limit is not None:
        raise ValueError(
            "train.time_limit: gspo compare trains its runs one after another in one command; "
            "give the time limit to gspo train runs"
        )
    if given.model.lora.r > 0:
        raise ValueError(f"model.lora.r={given.model.lora.r} (--config or a section): {NO_LORA}")
    for key, how in OWNED.items():  # (train.seed there was taken, the runs' seeds not)
        section, field = key.split(".")
        if field in getattr(given, section).model_fields_set:
            value = getattr(getattr(given, section), field)
            value = f"{value:g}" if isinstance(value, float) else value
            raise ValueError(
                f"{key}={value} (--config or a section): gspo compare sets {key} {how}; drop it"
            )


def holds_compare(out: Path) -> bool:
    """Whether ``out`` is a ``gspo compare`` output directory (its cold start or a run of it
    has its request: one stopped in its cold start included)."""
    return (out / COLD_START / REQUEST).is_file() or any(out.glob(f"runs/*/{REQUEST}"))


def output_directory(out: Path) -> Path:
    """``--output-dir``, made if needed, as an absolute path (the runs name the cold start
    by it: the same from any working directory)."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"--output-dir {out} is a file, not a directory")
    from gspo.runs import holds_run

    if holds_run(out):
        raise ValueError(  # (its plots and the report's share names: each overwrote the other)
            f"--output-dir {out} holds a gspo train run; give gspo compare a directory of its own"
        )
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"--output-dir {out}: cannot be made ({exc.strerror or exc})") from exc
    return out.resolve()


def unchanged_requests(configs: dict[Path, Config], out: Path | None) -> None:
    """One line naming every directory of ``configs`` (under ``out``) made with other
    settings: checked before anything trains (they were found one at a time, each after
    the runs before it had trained)."""
    changed = {d: c for d, config in configs.items() if (c := changed_request(config, d, out))}
    if not changed:
        return
    first, what = next(iter(changed.items()))
    if len(changed) == 1:
        raise ValueError(
            f"{first} was made with other settings ({what}): use another --output-dir, or "
            "delete it to redo it"
        )
    assert out is not None  # (several directories: those of one output directory)
    names = ", ".join(str(d.relative_to(out)) for d in changed)
    raise ValueError(
        f"{out}: {names} were made with other settings ({first.relative_to(out)}: {what}): "
        "use another --output-dir, or delete them to redo them"
    )


def _compare(
    config_path: Path | None,
    overrides: Sequence[str],
    out: Path,
    seeds: Sequence[int],
    preset: str,
    log: Callable[[str], None],
    algorithms: Sequence[str],
) -> dict[str, Any]:
    start = time.perf_counter()
    base = [*with_preset(preset, overrides), "log.progress=false", "log.plots=false"]
    configs = run_configs(
        config_path, overrides, checkpoint=cold_start_path(out), seeds=seeds, preset=preset,
        algorithms=algorithms,
    )  # fmt: skip
    run_dirs = {key: out / "runs" / f"{slug(key[0])}-seed{key[1]}" for key in configs}
    unchanged_requests(
        {
            out / COLD_START: cold_start_config(base, config_path),
            **{run_dirs[key]: config for key, config in configs.items()},
        },
        out,
    )
    for key, config in configs.items():  # (before anything trains, as the requests are)
        if not finished(run_dirs[key], config.train.max_steps):
            resumable(run_dirs[key])
    cold_start_checkpoint(base, config_path, out, log)
    runs = []
    for (name, seed), config in configs.items():
        log(f"{name}, seed {seed}")
        run_dir = run_dirs[name, seed]
        runs.append(Run(name, seed, run_dir, run_or_reuse(config, run_dir, log, out, go_on=True)))
    summary = write_report(
        runs,
        out,
        preset=preset,
        seconds=time.perf_counter() - start,
        cold_start_seconds=cold_start_seconds(out / COLD_START),
        cold_start_cached=cold_start_cached(out / COLD_START),
        overrides=overrides,
        config=config_path,
        trained_on=provenance([out / COLD_START, *run_dirs.values()]),
    )
    log(f"report written to {out / 'report.md'} and {out / 'report.html'}")
    return summary
