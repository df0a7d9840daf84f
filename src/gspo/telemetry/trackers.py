"""Secondary metric sinks: TensorBoard, Weights & Biases and MLflow.

:class:`~gspo.telemetry.logger.MetricsLogger` feeds them the numbers it writes to
``metrics.jsonl``. Each tracker's package is imported lazily, where used: a missing one
is one line naming the extra to install, and a tracker refusing its settings is one line
naming the config key. Each gets the run's settings as its hyperparameters, continues
the same tracker run when the run is resumed (its id kept in :data:`TRACKERS_FILE`),
receives the run's plots and config.yaml at its end, and, failing once the run is under
way, is dropped with one warning line: the run goes on (``metrics.jsonl`` has every
line).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

#: Sub-directory of a run's output directory that holds TensorBoard event files.
TENSORBOARD_DIR = "tensorboard"
#: The tracker runs a run logs to, each with where it is (``{"wandb": {"id": ..., "project":
#: ..., "entity": ...}, "mlflow": {"id": ..., "tracking_uri": ..., "experiment_name": ...}}``,
#: each setting as given, else its environment variable, and ``"environment": true``: its None
#: means neither was there): a resume goes on in the same ones (it started new ones, a second
#: MLflow run holding the steps after the checkpoint twice) unless they point elsewhere. A
#: tracker off at one resume keeps its entry for the next.
TRACKERS_FILE = "trackers.json"
#: Longest parameter value sent to MLflow (it refuses longer ones: 6000 characters).
MLFLOW_VALUE_CHARS = 500


@contextlib.contextmanager
def tracker_settings(key: str, name: str) -> Iterator[None]:
    """A tracker that refuses its settings (a retired MLflow store, a bad W&B project)
    ends the run with one line naming the config key, not the tracker's traceback."""
    try:
        yield
    except Exception as exc:
        text = " ".join(str(exc).split())
        text = text if len(text) <= 300 else text[:297] + "..."
        raise ValueError(
            f"{key}: {name} refused these settings ({type(exc).__name__}: {text})"
        ) from exc


def run_status(exc_type: type[BaseException] | None) -> str:
    """How a run ended, as MLflow's run status: ``FINISHED``; ``KILLED`` by Ctrl-C or
    SIGTERM (a ``KeyboardInterrupt``) or ``SystemExit``; ``FAILED`` by any other error."""
    if exc_type is None:
        return "FINISHED"
    return "KILLED" if issubclass(exc_type, KeyboardInterrupt | SystemExit) else "FAILED"


def _continued(
    sink: WandbSink | MlflowSink, settings: dict, recorded: dict | None, own: str
) -> str | None:
    """The recorded tracker run a resume goes on in: none without one, where the settings
    name their own (``own``: ``id``, ``run_id``), or where they point elsewhere than when it
    began (another project, experiment or tracking URI: a new run there, said in one line),
    each the ``log.*`` setting or, where it has none, the environment variable the tracker
    reads (:func:`located`: a resume with another ``WANDB_PROJECT`` logged to a run of the
    same id in the other project, unsaid; begun without WANDB_PROJECT and resumed with one,
    too). An entry of None recorded before the environment was (no ``"environment"``) is
    compared with a setting alone. An MLflow run not found where they point is a warning
    and a new run."""
    if not recorded or own in settings:
        return None
    now = located(sink, settings)
    moved = [
        k
        for k in sink.where
        if k in recorded
        and recorded[k] != now[k]
        and (recorded.get("environment") or recorded[k] is not None or settings.get(k) is not None)
    ]
    if moved:
        was = ", ".join(f"{k}={recorded.get(k)!r}{_from_env(k, settings, now)}" for k in moved)
        print(
            f"gspo: {sink.key}: {', '.join(moved)} changed since the run began ({was}): the "
            f"steps from here go to a new {sink.name} run; the earlier ones are in run "
            f"{recorded['id']}",
            file=sys.stderr,
            flush=True,
        )
        return None
    return recorded["id"]


#: The environment variable each tracker reads where its setting is not given.
ENVIRONMENT = {
    "project": "WANDB_PROJECT",
    "entity": "WANDB_ENTITY",
    "tracking_uri": "MLFLOW_TRACKING_URI",
    "experiment_name": "MLFLOW_EXPERIMENT_NAME",
    "mode": "WANDB_MODE",  # (checked up front: check_installed)
}


def _from_env(key: str, settings: dict, now: dict[str, Any]) -> str:
    """Where a changed value not among the settings comes from now: its variable."""
    if settings.get(key) is not None:
        return ""
    env = ENVIRONMENT[key]
    return f"; {env}={now[key]!r} now" if now[key] is not None else f"; neither it nor {env} now"


def located(sink: WandbSink | MlflowSink, settings: dict) -> dict[str, Any]:
    """Where ``sink``'s run is (``sink.where``): each setting given, else its environment
    variable (:data:`ENVIRONMENT`), else None."""
    return {
        k: settings[k] if settings.get(k) is not None else os.environ.get(ENVIRONMENT[k]) or None
        for k in sink.where
    }


def _same_run(started: str | None, recorded: dict | None) -> bool:
    """Whether the tracker run started is the one recorded (continued, or named by the
    settings' own id): it has the lines a resume logs again."""
    return recorded is not None and started is not None and started == recorded["id"]


#: The x-axis of the RL lines in W&B (``metrics.jsonl``'s ``step``); the cold start's
#: lines (``sft/*``) go by their own ``sft/step``, as in TensorBoard and MLflow.
RL_STEP = "train/step"


def axis(key: str) -> str:
    """The step a metric is drawn against: the cold start's own for ``sft/*`` and its
    ``time/sft`` (its lines are all RL step 0: its time was drawn as one column at 0), the
    RL step for the rest."""
    return "sft/step" if key.startswith("sft/") or key == "time/sft" else RL_STEP


class WandbSink:
    """``wandb.init(**settings)``: the W&B run every ``log`` is mirrored to.

    Each line is its own row (no ``step=``: W&B merges rows logged at one step, and the
    cold start's lines are all RL step 0), carrying ``train/step``; each metric is
    declared once, on first sight, against its axis (``define_metric``), so the RL curves
    are drawn by RL step and the cold start's by ``sft/step``. ``params`` (the run's
    settings) go in as its config, under the user's own ``config``; ``recorded`` (its
    entry in :data:`TRACKERS_FILE`) is continued (``resume="allow"``) unless the settings
    name an ``id`` or another project or entity (:func:`_continued`).
    """

    key, name = "log.wandb", "W&B"
    where = ("project", "entity")

    def __init__(
        self,
        wandb_mod: Any,
        settings: dict,
        params: Mapping[str, Any] | None = None,
        recorded: dict | None = None,
    ) -> None:
        settings = dict(settings)
        settings["config"] = {**(params or {}), **(settings.get("config") or {})}
        resume_id = _continued(self, settings, recorded, "id")
        if resume_id is not None:
            settings |= {"id": resume_id, "resume": settings.get("resume", "allow")}
        with tracker_settings(self.key, self.name):
            self.run = wandb_mod.init(**settings)
        self.id: str | None = getattr(self.run, "id", None)
        self.continued = _same_run(self.id, recorded)
        self.entry = {"id": self.id, **located(self, settings), "environment": True}
        self.declared: set[str] = set()

    def log(self, step: int, scalars: dict[str, float], steps: dict[str, int]) -> None:
        row = {RL_STEP: step, **scalars}
        for key in row.keys() - self.declared:
            if key in ("sft/step", RL_STEP):
                self.run.define_metric(key, hidden=True)
            else:
                self.run.define_metric(key, step_metric=axis(key))
            self.declared.add(key)
        self.run.log(row)

    def attach(self, files: list[Path], root: Path) -> None:
        for path in files:
            if path.name == "config.yaml":  # (W&B's own name for its config, see below)
                path = _copied(path, Path(self.run.dir) / "gspo_config.yaml")
                root = path.parent
            self.run.save(str(path), base_path=str(root), policy="now")

    def finish(self, status: str = "FINISHED") -> None:
        self.run.finish(exit_code=0 if status == "FINISHED" else 1)

    def dropped(self) -> None:
        """Nothing to end: W&B's run is this sink's own object."""


def _copied(path: Path, to: Path) -> Path:
    """A copy of ``path`` at ``to``. The run's config.yaml goes to W&B as a copy under
    another name: ``run.save`` links the file into the W&B run's files, where W&B writes
    its own ``config.yaml`` at the end, through the link, over the run's (which
    ``--resume`` reads)."""
    shutil.copyfile(path, to)
    return to


class MlflowSink:
    """An MLflow run: ``"tracking_uri"`` and ``"experiment_name"`` of ``settings`` are
    applied first, the rest is passed to ``mlflow.start_run`` (``recorded``, the run's
    entry in :data:`TRACKERS_FILE`, is continued unless the settings name a ``run_id`` or
    another experiment or tracking URI: :func:`_continued`); a new run gets ``params`` as
    its parameters. Metrics go by their axis's step (:func:`axis`)."""

    key, name = "log.mlflow", "MLflow"
    where = ("tracking_uri", "experiment_name")

    def __init__(
        self,
        mlflow_mod: Any,
        settings: dict | None,
        params: Mapping[str, Any] | None = None,
        recorded: dict | None = None,
    ) -> None:
        self.mlflow = mlflow_mod
        cfg = dict(settings or {})
        resume_id = _continued(self, cfg, recorded, "run_id")
        where = located(self, cfg)
        uri = cfg.pop("tracking_uri", None)
        experiment = cfg.pop("experiment_name", None)
        if resume_id is not None:
            cfg = {k: v for k, v in cfg.items() if k != "run_name"} | {"run_id": resume_id}
        with tracker_settings(self.key, self.name):
            if uri is not None:
                mlflow_mod.set_tracking_uri(uri)
            if experiment is not None:
                mlflow_mod.set_experiment(experiment)
            try:
                run = mlflow_mod.start_run(**cfg)
            except Exception as exc:  # (deleted, or another server now: a new run)
                if resume_id is None:
                    raise
                then = "the steps from here go to a new MLflow run"
                tracker_failed(self, exc, f"continuing run {resume_id}", then)
                cfg, resume_id = {k: v for k, v in cfg.items() if k != "run_id"}, None
                run = mlflow_mod.start_run(**cfg)
        info = getattr(run, "info", None)
        self.id: str | None = getattr(info, "run_id", None)
        self.entry = {"id": self.id, **where, "environment": True}
        self.continued = _same_run(self.id, recorded)
        # a run named by run_id exists and has them (MLflow refuses a parameter changed)
        if params and cfg.get("run_id") is None:
            values = {mlflow_name(k): _param_text(v) for k, v in params.items()}
            with tracker_settings(self.key, self.name):
                mlflow_mod.log_params(values)

    def log(self, step: int, scalars: dict[str, float], steps: dict[str, int]) -> None:
        parts: dict[str, dict[str, float]] = {}
        for key, value in scalars.items():
            parts.setdefault(axis(key), {})[mlflow_name(key)] = value
        for name, part in parts.items():
            self.mlflow.log_metrics(part, step=steps[name])

    def attach(self, files: list[Path], root: Path) -> None:
        for path in files:
            folder = path.parent.relative_to(root).as_posix()
            self.mlflow.log_artifact(str(path), artifact_path=None if folder == "." else folder)

    def finish(self, status: str = "FINISHED") -> None:
        self.mlflow.end_run(status=status)

    def dropped(self) -> None:
        """A failed run ended if it can be: MLflow's active run is the process's, and the
        next run started in this process (a ``gspo compare``'s next) was refused beside it."""
        with contextlib.suppress(Exception):
            self.mlflow.end_run()


def mlflow_name(key: str) -> str:
    """``key`` as MLflow takes a parameter's or metric's name: letters, digits and ``_ - . /
    : `` (space); any other character ``_`` (a ``reward.sources`` key ``my_code*``, a
    ``data_source`` ``a+b`` in ``train/reward/by_source/SOURCE``: MLflow refused the run's
    parameters at its start, and a metric line mid-run)."""
    return re.sub(r"[^/\w.\- :]", "_", key)


def _param_text(value: Any) -> str:
    """A setting as MLflow's parameter text (lists and mappings as JSON), cut to
    :data:`MLFLOW_VALUE_CHARS`."""
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return text if len(text) <= MLFLOW_VALUE_CHARS else text[: MLFLOW_VALUE_CHARS - 3] + "..."


def tracker_failed(
    sink: Any,
    exc: BaseException,
    doing: str,
    then: str = "the run goes on without it (metrics.jsonl has every line)",
) -> None:
    """One warning line for a tracker that failed once the run was under way (a server
    gone, its run deleted, its process killed), saying what ``then`` happens: by default
    the run goes on without it."""
    text = " ".join(str(exc).split())
    text = text if len(text) <= 200 else text[:197] + "..."
    print(
        f"gspo: warning: {sink.key}: {sink.name} failed {doing} ({type(exc).__name__}: "
        f"{text}); {then}",
        file=sys.stderr,
        flush=True,
    )


def recorded_trackers(output_dir: Path) -> dict[str, dict]:
    """The tracker runs :data:`TRACKERS_FILE` names, each ``{"id": ..., ...where}`` (none
    if it is missing or unreadable; an id alone, as earlier versions wrote it, is where the
    settings point now)."""
    try:
        found = json.loads((output_dir / TRACKERS_FILE).read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(found, dict):
        return {}
    entries = {k: {"id": v} if isinstance(v, str) else v for k, v in found.items()}
    return {
        k: v for k, v in entries.items() if isinstance(v, dict) and isinstance(v.get("id"), str)
    }


def check_installed(wandb: Any, mlflow: Any) -> None:
    """A tracker asked for (``log.wandb``, ``log.mlflow`` not None) but not installed, or
    given a key its start does not take (``wandb.init``'s, ``mlflow.start_run``'s), or a
    W&B ``project``, ``entity`` or ``mode`` (or ``WANDB_PROJECT``, ...) that W&B's own
    settings refuse: a one-line
    ``ValueError``, said before the model loads (minutes), not after (nothing is sent: the
    server's answer, a project one cannot write to, comes when the tracker starts)."""
    for module, name, wanted in (("wandb", "W&B", wandb), ("mlflow", "MLflow", mlflow)):
        if wanted is None:
            continue
        found = import_optional(module, name, module)
        own = ("tracking_uri", "experiment_name") if module == "mlflow" else ()
        start = "init" if module == "wandb" else "start_run"
        _known_keys(f"log.{module}", f"{module}.{start}", getattr(found, start, None), wanted, own)
        if module == "mlflow":
            _mlflow_store(found, wanted)
        settings = getattr(found, "Settings", None) if module == "wandb" else None
        if isinstance(settings, type):  # (the checks wandb.init makes of these first)
            keys = ("project", "entity", "mode")
            given = {k: v for k in keys if (v := wanted.get(k) or os.environ.get(ENVIRONMENT[k]))}
            with tracker_settings(f"log.{module}", name):
                settings(**given)


def _mlflow_store(mlflow: Any, settings: dict) -> None:
    """The tracking URI (``log.mlflow.tracking_uri``, else ``MLFLOW_TRACKING_URI``, else
    MLflow's default) has a store in this MLflow (nothing made or sent: its scheme looked
    up in MLflow's registry of stores, an internal one; not found, nothing is checked).
    mlflow-skinny has none for its own default, ``sqlite:``: refused when the tracker
    started, after the model load, in words about the model registry."""
    try:
        from mlflow.tracking._tracking_service.utils import _tracking_store_registry as stores
    except ImportError:
        return
    default = getattr(mlflow, "get_tracking_uri", None)  # (a fake's: none)
    uri = settings.get("tracking_uri") or (default() if callable(default) else None)
    if not isinstance(uri, str) or not hasattr(stores, "get_store_builder"):
        return
    try:
        stores.get_store_builder(uri)
    except Exception:
        database = str(uri).split(":")[0].split("+")[0] in ("sqlite", "postgresql", "mysql")
        hint = "; a database's needs the mlflow package, not mlflow-skinny" if database else ""
        raise ValueError(
            f"log.mlflow: MLflow has no tracking store for the URI {uri!r} (from "
            f"log.mlflow.tracking_uri, else MLFLOW_TRACKING_URI, else MLflow's default{hint})"
        ) from None


def _known_keys(key: str, what: str, start: Any, settings: dict, own: tuple[str, ...]) -> None:
    """A key of ``settings`` that ``start`` (a tracker's start) has no parameter for, nor
    gspo itself reads (``own``): one line naming it and the nearest one."""
    import difflib
    import inspect

    try:
        params = inspect.signature(start).parameters
    except (TypeError, ValueError):  # (not a function: nothing to compare with)
        return
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    known = [*own, *params]
    for name in settings:
        if name not in known:
            near = difflib.get_close_matches(name, known, n=1)
            hint = f"did you mean {key}.{near[0]}?" if near else f"its keys: {', '.join(known)}"
            raise ValueError(f"{key}.{name}: {what} takes no such keyword ({hint})")


def import_optional(module: str, name: str, extra: str) -> Any:
    import importlib

    try:
        found = importlib.import_module(module)
        spec = getattr(found, "__spec__", None)  # a folder of that name on sys.path: a
        if spec is not None and spec.origin in (None, "namespace"):  # namespace package
            raise ImportError(module)
        return found
    except ImportError:  # (a setting asked for it: a ValueError, said in one line)
        raise ValueError(
            f"log.{extra}: {name} logging was requested but the '{module}' package is not "
            f"installed; install it with: pip install 'gspo[{extra}]'"
        ) from None


def tensorboard_writer(log_dir: Path, purge_step: int) -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise ValueError(
            "log.tensorboard: TensorBoard logging needs the 'tensorboard' package (pip "
            "install tensorboard); or set log.tensorboard=false"
        ) from None
    _after_earlier_event_files(log_dir)
    return SummaryWriter(log_dir=str(log_dir), purge_step=purge_step)


def _after_earlier_event_files(log_dir: Path) -> None:
    """TensorBoard reads a directory's event files in name order, and a name is its creation
    second, then host, process id and a per-process count as text: a writer opened in the same
    second as an earlier file (a resume moments after the run stopped; the 10th writer of a
    process after its 9th) can sort before it, and its purge then hides nothing (the steps
    past the checkpoint drawn twice). Opened after that second, its name sorts last. At most
    a second: a file another host's clock dated later (a resume on another node) is not
    waited for."""
    seconds = [
        int(part[3])
        for path in log_dir.glob("events.out.tfevents.*")
        if len(part := path.name.split(".")) > 3 and part[3].isdigit()
    ]
    if seconds and (wait := max(seconds) + 1 - time.time()) > 0:
        time.sleep(min(wait, 1.0))
