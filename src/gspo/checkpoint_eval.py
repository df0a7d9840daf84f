"""``gspo eval PATH``: a checkpoint, or any model, evaluated on held-out prompts the way a
run evaluates, writing nothing (:func:`evaluate`, also ``gspo.evaluate``).

``PATH`` is a checkpoint (``RUN/checkpoints/step-N``), a run (its latest checkpoint, or
``--step N``'s), or a model directory (a Hugging Face model: the base before training,
an export, which keeps its checkpoint's step). A checkpoint is evaluated with the config
its run trained with (the checkpoint's own ``config.yaml``, else the run's; ``--config
FILE`` replaces it) and the evaluation seed of its step, so its figures are the ones the
run logged at that step when nothing changed (the same device, dtype and engine;
``eval.*`` and ``data.eval`` as they were). Overrides change anything else:
``eval.samples=16``, ``data.eval=FILE``, ``model.device=cuda``. A LoRA checkpoint is its
base with the adapter loaded onto it.

It builds the run's trainer (model, engine, data, rewards) in a temporary directory,
removed afterwards, and calls its evaluator; no cold start, no update.
"""

from __future__ import annotations

import math
import re
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gspo.config import Config, checked_config, load_config
from gspo.models import model_files
from gspo.moved import moved_path
from gspo.plugins import counted
from gspo.telemetry import METRICS_FILE, read_metrics
from gspo.training.checkpoint import (
    CHECKPOINTS,
    CONFIG,
    TRAINER_STATE,
    trainer_state,
)
from gspo.training.lora import ADAPTER_WEIGHTS, base_model_path, is_lora_checkpoint
from gspo.training.setup import with_absolute_paths

if TYPE_CHECKING:
    from gspo.distributed import Distributed

#: What an evaluation turns off: nothing trains, and nothing is written or tracked.
QUIET = {
    "train.cold_start_steps": 0,
    "train.max_steps": 0,
    "rollout.max_staleness": 0,
    "log.progress": False,
    "log.plots": False,
    "log.tensorboard": False,
    "log.wandb": None,
    "log.mlflow": None,
    "log.profile_steps": [],
    "log.completions_every": 0,
}


@dataclass
class Evaluated:
    """What :func:`evaluate` measured: ``metrics`` (``eval/*``, ``time/eval``) of ``model``
    at ``step`` (a checkpoint's RL step: its evaluation seed; an export's, its checkpoint's;
    0 for another model directory), and the run's own ``eval/*`` at that step where its
    ``metrics.jsonl`` has them (evaluated with its own config: no overrides, no other
    config)."""

    model: Path
    step: int
    prompts: int
    metrics: dict[str, float]
    logged: dict[str, float] = field(default_factory=dict)


def evaluate(
    path: str | Path,
    *,
    step: int | None = None,
    config: Config | str | Path | None = None,
    overrides: list[str] | tuple[str, ...] = (),
    join: Callable[[str], Distributed] | None = None,
) -> Evaluated:
    """Evaluate the checkpoint, run or model directory ``path`` (see the module). ``step``
    picks a run's checkpoint; ``config`` (a :class:`Config` or a YAML file) replaces the
    config a checkpoint names (a model directory's: the defaults). ``join``: under
    torchrun, called with ``model.device`` once the config is known, the rank it returns
    (:func:`gspo.distributed.setup_distributed`) evaluates its share of the prompts, the
    figures being every rank's (the same as one process's); by default one process."""
    from gspo.trainer import Trainer  # (loads transformers)

    checkpoint, run = _checkpoint(Path(path).expanduser(), step)
    config_given = config
    if isinstance(config, Config):
        config = config.model_copy(deep=True)
        checked_config(config, "evaluate")
        if overrides:
            raise ValueError("evaluate: pass overrides with a config file, or set them on config")
    else:
        named = Path(config) if config is not None else _config_of(checkpoint, run)
        config = load_config(named, list(overrides))
        if named is not None and run is not None:
            # (the run moved with its data and reward files: where they are now)
            config = with_absolute_paths(config, lambda p: moved_path(p, run, named))
    if checkpoint is None:  # a model directory (an export: its checkpoint's step)
        from gspo.export import exported_step

        model, lora = Path(path).expanduser(), False
        config.model.path = str(model)
        at = exported_step(model)
    else:
        lora = is_lora_checkpoint(checkpoint)
        if lora != (config.model.lora.r > 0):
            raise ValueError(
                f"eval: {checkpoint} holds {'a LoRA adapter' if lora else 'a whole model'}, "
                f"but its config has model.lora.r={config.model.lora.r}"
            )
        where = config.model.path
        model = base_model_path(checkpoint, where) if lora else _whole(checkpoint, where)
        if not model.is_dir():
            raise FileNotFoundError(
                f"eval: the model {model} that {checkpoint} builds on is gone (moved or "
                "removed); put it back there, or pass model.path=WHERE_IT_IS"
            )
        config.model.path = str(model)
        at = _step_of(checkpoint)
    for key, value in QUIET.items():
        section, name = key.split(".")
        setattr(getattr(config, section), name, value)
    dist = join(config.model.device) if join is not None else None
    with (
        tempfile.TemporaryDirectory(prefix="gspo-eval-") as scratch,
        Trainer(config, Path(scratch) / "run", dist=dist) as trainer,
    ):
        if lora:  # the adapter's weights onto the fresh adapters
            _load_adapter(trainer.policy, checkpoint)
        evaluator = trainer.evaluator
        if not evaluator.rows:
            raise ValueError(
                "eval: no held-out prompts (data.eval, or a built-in task's data.eval_size)"
            )
        metrics = evaluator.run(at)
    # (the run's own figures beside them only where they measure the same: no overrides)
    as_run = checkpoint is not None and config_given is None and not overrides
    logged = _logged(run, at) if as_run else {}
    return Evaluated(model=checkpoint or model, step=at, prompts=len(evaluator.rows),
                     metrics=metrics, logged=logged)  # fmt: skip


def _checkpoint(path: Path, step: int | None) -> tuple[Path | None, Path | None]:
    """``(checkpoint, run)`` of ``path``: a checkpoint and its run (None if it stands
    alone), a run's checkpoint (``step``'s or its latest), or ``(None, None)`` for a model
    directory; a one-line error for anything else."""
    from gspo.export import resolve_checkpoint

    if (path / TRAINER_STATE).is_file():
        run = path.parent.parent if path.parent.name == CHECKPOINTS else None
        return resolve_checkpoint(path, command="eval", step=step), run
    if (path / CHECKPOINTS).is_dir() or (path / "config.yaml").is_file():
        return resolve_checkpoint(path, command="eval", step=step), path
    if (path / "config.json").is_file():
        if step is not None:
            raise ValueError(f"eval: --step with the model directory {path}: it has no steps")
        return None, None
    # a checkpoint's name mistyped: those beside it; a gspo compare's directory: its runs
    if any(path.parent.glob("step-*")) or any(path.glob("runs/*/checkpoints")):
        resolve_checkpoint(path, command="eval")
    said = "does not exist" if not path.exists() else (
        "is neither a checkpoint, a run with one, nor a model directory (no config.json)"
    )  # fmt: skip
    raise FileNotFoundError(f"eval: {path} {said}")


def _config_of(checkpoint: Path | None, run: Path | None) -> Path | None:
    """The config a checkpoint's run trained with: its own copy, else the run's."""
    if checkpoint is None:
        return None  # (a model directory: the defaults)
    for candidate in (checkpoint / CONFIG, run / "config.yaml" if run else None):
        if candidate is not None and candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"eval: {checkpoint} holds no config.yaml (nor does its run): pass --config FILE, "
        "the config it was trained with"
    )


def _load_adapter(policy: Any, checkpoint: Path) -> None:
    """A LoRA checkpoint's adapter weights (PEFT's file, checked against its manifest)
    onto ``policy``'s adapters: weights only (a checkpoint of ``train.save_only_model``
    holds no optimizer state, which a resume's loading asked for); under torchrun, each
    rank its shard of them."""
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    from gspo.models import is_model_file
    from gspo.publish import check_manifest

    check_manifest(checkpoint, is_model_file)
    state = load_file(checkpoint / ADAPTER_WEIGHTS, device=str(policy.device))
    # PEFT's names lack the adapter's (lora_A.weight: the module's lora_A.default.weight;
    # an adapted embedding's lora_embedding_A.default, and its base_layer.weight, saved too)
    ours = {re.sub(r"\.default(?=\.|$)", "", n): n for n, _ in policy.module.named_parameters()}
    if unexpected := [name for name in state if name not in ours]:
        raise ValueError(
            f"eval: {checkpoint / ADAPTER_WEIGHTS} holds weights its config's adapters lack "
            f"({unexpected[0]}, ...): model.lora.* differs from its run's"
        )
    # (whole tensors onto FSDP's shards: each rank keeps its own part)
    options = StateDictOptions(full_state_dict=True, strict=False)
    set_model_state_dict(policy.module, {ours[k]: v for k, v in state.items()}, options=options)
    policy.stepped()  # (the engine reads the new adapters at its next sync)


def _whole(checkpoint: Path, where: str | None) -> Path:
    """A whole-model checkpoint's model directory (a step 0's: the model it names)."""
    from gspo.models import is_model_file
    from gspo.publish import check_manifest

    model = model_files(checkpoint, where)
    if model == checkpoint:
        check_manifest(checkpoint, is_model_file)  # the files named are the files written
    return model


def _step_of(checkpoint: Path) -> int:
    """A checkpoint's RL step, as its ``trainer_state.pt`` records it (a copy renamed or
    moved out of its run keeps it: its name gave step 0's seed)."""
    return int(trainer_state(checkpoint)["step"])


def _logged(run: Path | None, step: int) -> dict[str, float]:
    """The run's own evaluation at ``step``, if its metrics.jsonl holds one."""
    if run is None or not (run / METRICS_FILE).is_file():
        return {}
    try:
        records = read_metrics(run / METRICS_FILE)
    except ValueError:
        return {}
    found: dict[str, float] = {}
    for record in records:
        if record.get("step") == step:
            found |= {k: v for k, v in record.items() if k.startswith("eval/")}
    return found


def report(evaluated: Evaluated) -> str:
    """The lines ``gspo eval`` prints: each ``eval/*`` figure, beside the run's own."""
    what = f"{evaluated.model} (step {evaluated.step})" if evaluated.step else evaluated.model
    lines = [f"evaluated {what} on {counted(evaluated.prompts, 'held-out prompt')}"]
    width = max((len(k) for k in evaluated.metrics), default=0)
    for key, value in sorted(evaluated.metrics.items()):
        line = f"  {key:<{width}}  {_figure(value)}"
        if key in evaluated.logged:
            line += f"   (the run logged {_figure(evaluated.logged[key])})"
        lines.append(line)
    return "\n".join(lines)


def _figure(value: Any) -> str:
    if isinstance(value, float) and math.isfinite(value):
        return f"{value:.4f}"
    return str(value)


def eval_command(
    source: Path,
    step: int | None,
    config: Path | None,
    overrides: list[str],
    json_file: Path | None,
) -> int:
    """``gspo eval``: :func:`evaluate`, its figures printed (and written to ``json_file``,
    ``--json``); 0. Under torchrun the ranks share the prompts out and rank 0 says the
    figures, those of one process; bad input is said once (by rank 0)."""
    import json

    from gspo.distributed import (
        said_once,
        setup_distributed,
        several_ranks,
        teardown_distributed,
    )

    joined: list[Distributed] = []

    def join(device: str) -> Distributed:
        joined.append(setup_distributed(device))
        return joined[-1]

    try:
        with said_once():  # (every rank reads the same files: rank 0 says what is wrong)
            if json_file is not None and json_file.is_dir():
                raise ValueError(f"--json {json_file}: is a directory, not a file")
            if json_file is not None and not json_file.parent.is_dir():
                raise ValueError(f"--json {json_file}: {json_file.parent} is no directory")
            evaluated = evaluate(source, step=step, config=config, overrides=overrides,
                                 join=join if several_ranks() else None)  # fmt: skip
    finally:
        for dist in joined:
            teardown_distributed(dist)
    if joined and not joined[0].is_main:
        return 0
    print(report(evaluated))
    if json_file is not None:
        from gspo.publish import write_atomic

        record = {"model": str(evaluated.model), "step": evaluated.step,
                  "prompts": evaluated.prompts, **evaluated.metrics}  # fmt: skip
        write_atomic(json_file, json.dumps(record, indent=1) + "\n")
    return 0
