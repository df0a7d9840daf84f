"""The ``gspo`` command.

    gspo train [--config FILE.yaml] [--output-dir DIR] [key.sub=value ...]
    gspo train --resume DIR [key.sub=value ...]
    torchrun --nproc-per-node N -m gspo train ...           # data-parallel, FSDP2
    gspo compare [--config FILE.yaml] [--output-dir DIR] [--seeds 3]
                 [--preset default|stress|long|tools] [--algorithms GSPO,GRPO]
    gspo config [--config FILE.yaml] [key.sub=value ...]     # print the resolved config
    gspo config --doc                                         # print the config reference
    gspo export RUN_OR_CHECKPOINT [--step N] [--merge OUT [--dtype D]]  # one HF model
    gspo eval RUN_CHECKPOINT_OR_MODEL [--step N] [--config FILE.yaml] [--json FILE]
              [key.sub=value ...]                             # held-out accuracy, nothing written

Overrides may stand anywhere on the line, before or after the options; a text key takes
its value as written (``data.prompt_template=Q: {question} A:``), other values are YAML.

Bad input (config keys and values, files, reward functions) ends with one line on
stderr naming what is wrong, and exit status 2 (set GSPO_DEBUG=1 for the traceback); so
does running out of memory (CUDA's or the CPU's, loading the model included), naming the
settings to lower (:mod:`gspo.training.memory`).
"""

from __future__ import annotations

import argparse
import atexit
import os
import re
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from gspo import __version__
from gspo.distributed import (
    PEER_LINE_AFTER_S,
    SaidByRankZero,
    Terminated,
    last_words,
    leads_another_node,
    not_rank_zero,
    peer_gone,
    posted_setup_error,
    rank_said,
    said_once,
    sigterm_stops_as_ctrl_c,
    world_size,
)
from gspo.publish import machine_errors_in_threads_said_in_one_line

if TYPE_CHECKING:
    from gspo.config import Config

NO_CACHE_HELP = "redo the cold start even if an identical one is cached (train.cold_start_cache)"
#: What the overrides are, for each command's --help (it listed them without a word).
OVERRIDES = "config keys to set, e.g. train.max_steps=50 optim.lr=1e-6 (all: gspo config --doc)"


def a_path(text: str) -> Path:
    """A path argument; an empty one (``--merge ''``) would be the working directory."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty path")
    return Path(text)


class OneLineErrors(argparse.ArgumentParser):
    """argparse, with its errors on one line (its usage block of several lines came first,
    the error last); the subcommands' parsers are of this class too. No abbreviated
    options: ``--seed 2`` was taken as ``--seeds 2``, unsaid."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **{"allow_abbrev": False, **kwargs})

    def error(self, message: str) -> NoReturn:
        if not_rank_zero():  # every rank parsed the same words: rank 0 says it
            time.sleep(RANK_ZERO_GRACE_S)  # (leaving at once, torchrun could stop rank 0 first)
            self.exit(2)
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrors(
        prog="gspo", description="GSPO / GRPO reinforcement learning for language models."
    )
    parser.add_argument("--version", action="version", version=f"gspo {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="cold-start SFT then RL (GSPO by default)")
    train.add_argument("--config", type=a_path, action=Once, help="YAML config file")
    train.add_argument(
        "--output-dir",
        type=a_path,
        default=None,
        metavar="DIR",
        help="where the run writes config.yaml, metrics.jsonl, plots/ and checkpoints/ "
        "(default: runs/gspo)",
    )
    train.add_argument("--resume", type=a_path, metavar="DIR", help="continue the run in DIR")
    train.add_argument(
        "--auto-resume",
        action="store_true",
        help="continue the run in --output-dir from its last checkpoint if it has one, "
        "start it otherwise: the same command again, for a job a scheduler requeues "
        "(--config and overrides apply as given; settings that differ from the "
        "checkpoint's are named in one warning line)",
    )
    train.add_argument(
        "--overwrite",
        action="store_true",
        help="start over in --output-dir: a run already there is removed once the new one "
        "has trained its first rollout batch (kept if the new one's inputs fail before: a "
        "reward function, an environment, a data row)",
    )
    train.add_argument("--no-cache", action="store_true", help=NO_CACHE_HELP)
    train.add_argument("overrides", nargs="*", metavar="key.sub=value", help=OVERRIDES)

    comp = sub.add_parser(
        "compare",
        help="GSPO vs GRPO vs GSPO-token from one cold start, several seeds, one report",
    )
    comp.add_argument(
        "--config", type=a_path, action=Once, help="YAML config file (shared by every run)"
    )
    comp.add_argument(
        "--output-dir",
        type=a_path,
        default=Path("runs/compare"),
        metavar="DIR",
        help="where the shared cold start, the runs and the report go (default: runs/compare)",
    )
    comp.add_argument(
        "--seeds", type=int, default=3, help="seeds 0..N-1 per algorithm (default: 3)"
    )
    comp.add_argument(
        "--preset", default="default", help="default | stress | long | tools (default: default)"
    )
    comp.add_argument(
        "--algorithms",
        default="GSPO,GRPO,GSPO-token",
        help="comma-separated subset of GSPO, GRPO, GSPO-token (default: all three)",
    )
    comp.add_argument("--no-cache", action="store_true", help=NO_CACHE_HELP)
    comp.add_argument("overrides", nargs="*", metavar="key.sub=value", help=OVERRIDES)

    export = sub.add_parser(
        "export", help="write a run's latest (or a given) checkpoint as one plain HF model"
    )
    export.add_argument("source", type=a_path, metavar="RUN_OR_CHECKPOINT")
    export.add_argument(
        "--merge",
        type=a_path,
        metavar="OUT",
        help="output directory: the base with a LoRA adapter merged in (a full fine-tuning "
        "checkpoint is written as it is); needed for LoRA runs only: without it a full "
        "fine-tuning run's checkpoint is named, already a plain HF model",
    )
    export.add_argument("--step", type=int, help="a run's checkpoint of this RL step (latest)")
    export.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        help="with --merge: the dtype OUT's weights are written in (default: a LoRA merge the "
        "base's, a full fine-tuning checkpoint float32, as trained)",
    )

    ev = sub.add_parser(
        "eval",
        help="evaluate a checkpoint (or any model) on held-out prompts as its run does; "
        "writes nothing",
    )
    ev.add_argument("source", type=a_path, metavar="RUN_CHECKPOINT_OR_MODEL")
    ev.add_argument("--step", type=int, help="a run's checkpoint of this RL step (default: latest)")
    ev.add_argument(
        "--config",
        type=a_path,
        action=Once,
        help="YAML config file instead of the one the checkpoint's run trained with (a model "
        "directory's: the defaults)",
    )
    ev.add_argument("--json", type=a_path, metavar="FILE", help="also write the figures to FILE")
    ev.add_argument("overrides", nargs="*", metavar="key.sub=value", default=[], help=OVERRIDES)

    show = sub.add_parser("config", help="print the resolved config as YAML")
    show.add_argument("--config", type=a_path, action=Once, help="YAML config file")
    show.add_argument(
        "--doc",
        action="store_true",
        help="print the Markdown reference of every key instead (docs/configuration.md)",
    )
    show.add_argument("overrides", nargs="*", metavar="key.sub=value", help=OVERRIDES)
    return parser


DEFAULT_RUN = Path("runs/gspo")  # gspo train's --output-dir by default


class Once(argparse.Action):
    """An option given at most once (a second ``--config`` silently replaced the first)."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        if getattr(namespace, self.dest) is not None:
            parser.error(f"{option_string} given twice: put the settings in one file")
        setattr(namespace, self.dest, values)


# How long a rank other than 0 waits, after a setup error, for rank 0 to say it. torchrun
# stops every rank as soon as one exits with an error: had this rank left at once, rank 0
# could be stopped before printing, and nobody would say what was wrong. Rank 0 normally
# leaves within seconds, and torchrun then stops this rank; the wait only runs out where
# rank 0 found no error (then this rank's status 2 ends the run). The first rank of another
# node says it at once, in that node's log (its error may be its own: its files).
RANK_ZERO_GRACE_S = 60.0


def run_train(args: argparse.Namespace) -> int:
    from gspo.distributed import setup_distributed, teardown_distributed
    from gspo.runs import RunDirectory, finished_model_only
    from gspo.telemetry import StepProfiler
    from gspo.trainer import Trainer

    with said_once():
        config, output_dir = train_config(args)
        if args.resume is not None and finished_model_only(output_dir, config) is not None:
            return 0
        # under torchrun: one process per rank, joined here (a no-op in a single process)
        dist = setup_distributed(config.model.device, output_dir)
    try:
        # --overwrite: the old run goes once the new one has trained its first rollout
        # batch (RunDirectory); its engines close before the process group goes (Trainer.close)
        replace = args.resume is None
        name = "--output-dir" if replace else "--resume"
        with RunDirectory(output_dir, replace=replace, dist=dist, name=name) as run:
            with said_once(), StepProfiler.of_run(config, output_dir, dist).startup():
                trainer = Trainer(config, output_dir, resume=args.resume is not None, dist=dist)
            run.built()
            with trainer:
                trainer.fit(started=run.started)
                dist.barrier()
    finally:
        teardown_distributed(dist)
    if dist.is_main:
        from gspo.export import trained_model

        going_on = trainer.time_limit.stopped is not None  # (its model: not yet)
        print(f"run written to {output_dir}{'' if going_on else trained_model(output_dir)}")
    if trainer.time_limit.stopped is not None:  # (not finished: to be continued)
        from gspo.training.time_limit import OUT_OF_TIME

        return OUT_OF_TIME if dist.world_size == 1 else 0  # (torchrun: STOPPED_FILE)
    return 0


def train_config(args: argparse.Namespace) -> tuple[Config, Path]:
    """``gspo train``'s config and output directory, its options checked."""
    from gspo.config import load_config
    from gspo.runs import auto_resumes, check_same_model, not_a_run, resume_config
    from gspo.trainer import CHECKPOINTS

    if args.auto_resume and args.resume is not None:
        raise ValueError(
            "--auto-resume continues the run in --output-dir; --resume names one: pick one"
        )
    if args.auto_resume and args.overwrite:
        raise ValueError("--overwrite starts a run over, --auto-resume continues one: pick one")
    if args.resume is not None:
        named = str(args.resume)
        if "=" in named and not args.resume.exists():  # `--resume` as a flag, a setting after
            raise ValueError(
                f"--resume takes the run's directory, not {named!r} (a setting): "
                "gspo train --resume DIR [key=value ...]"
            )
        if args.config is not None:
            raise ValueError("--resume takes the run's own config.yaml; drop --config")
        if args.overwrite:
            raise ValueError("--overwrite starts a run over, --resume continues one: pick one")
        if args.output_dir is not None:
            raise ValueError(
                f"--output-dir {args.output_dir}: --resume continues the run where it is "
                f"({args.resume}); drop --output-dir"
            )
        output_dir = args.resume.expanduser()
        if (problem := not_a_run(output_dir, "--resume")) is not None:
            raise ValueError(f"--resume {output_dir}: {problem}")
        config = resume_config(output_dir, args.overrides)
    else:
        config = load_config(args.config, args.overrides)
        output_dir = run_directory(args).expanduser()
        if output_dir.exists() and not output_dir.is_dir():
            raise ValueError(f"--output-dir {output_dir}: is a file, not a directory")
        from gspo.experiments.runs import holds_compare

        if holds_compare(output_dir):  # (its plots and the report's share names)
            raise ValueError(
                f"--output-dir {output_dir} holds a gspo compare; give the run a directory of "
                "its own (its runs are in runs/ there)"
            )
        if args.auto_resume and auto_resumes(output_dir):
            if (problem := not_a_run(output_dir, "--auto-resume")) is not None:
                raise ValueError(f"--output-dir {output_dir}: {problem}")
            check_same_model(output_dir, config, "--auto-resume", "--output-dir")
            args.resume = output_dir  # (resumed from here on, as with --resume)
        elif (output_dir / CHECKPOINTS).exists() and not (args.overwrite or args.auto_resume):
            raise ValueError(
                f"--output-dir {output_dir} already holds a run; "
                "use --resume to continue it or --overwrite to start over"
            )
    return config, output_dir


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, with ``key.sub=value`` overrides accepted anywhere in it.

    argparse gives a ``nargs="*"`` positional only one run of words, so overrides after
    an option (``train a=1 --output-dir DIR b=2``) come back unrecognised; they are
    appended here in the order written. Anything else unrecognised is argparse's error.
    """
    parser = build_parser()
    if not (sys.argv[1:] if argv is None else argv):  # a bare `gspo`: what it can do
        parser.print_help(sys.stderr)
        parser.exit(2)
    args, extra = parser.parse_known_args(argv)
    unknown = [word for word in extra if word.startswith("-") or "=" not in word]
    if unknown or (extra and not hasattr(args, "overrides")):
        parser.error(f"unrecognized arguments: {' '.join(unknown or extra)}{_near(args, unknown)}")
    if hasattr(args, "overrides"):  # `gspo export` takes none
        args.overrides = [*args.overrides, *extra]
    return args


def _near(args: argparse.Namespace, unknown: list[str]) -> str:
    """``; did you mean --output-dir?`` for a misspelt option of the command given
    (``--output_dir``, as TRL spells its fields)."""
    from difflib import get_close_matches

    from gspo.config.ported import TRL_NAMES

    options = [o for a in build_parser_command(args.command)._actions for o in a.option_strings]
    for word in unknown:
        option = word.partition("=")[0]
        if not option.startswith("--"):
            continue
        near = get_close_matches(option, options, n=1, cutoff=0.75)  # (not --lr -> --help)
        # the one option it begins (--out: no abbreviations, it was --output-dir before)
        near = near or [o for o in options if o.startswith(option)][:2]
        if len(near) == 1:
            return f"; did you mean {near[0]}?"
        name = option[2:].replace("-", "_")  # (TRL's parser takes --max-steps too)
        if "." in name or name in TRL_NAMES:  # a setting as TRL's command line gives one
            said = f"TRL's {name} is {TRL_NAMES[name]} here; " if name in TRL_NAMES else ""
            return f"; {said}settings are key=value words, without dashes (optim.lr=1e-6)"
    return ""


def build_parser_command(command: str) -> argparse.ArgumentParser:
    """The parser of one command (``train``, ...), as :func:`build_parser` makes it."""
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[command]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if getattr(args, "no_cache", False):
        args.overrides.append("train.cold_start_cache=false")
    with sigterm_stops_as_ctrl_c(), machine_errors_in_threads_said_in_one_line():
        return _main(args)


def _main(args: argparse.Namespace) -> int:
    try:
        world_size()  # (a WORLD_SIZE set by hand: its one line)
        if args.command == "train":
            return run_train(args)
        if args.command == "compare":
            from gspo.experiments import compare

            if world_size() > 1:  # (each rank ran a whole compare)
                if not_rank_zero():  # (rank 0 says it; torchrun stops this rank once it has)
                    time.sleep(RANK_ZERO_GRACE_S)
                else:
                    print("gspo: error: gspo compare is not for torchrun: it runs its "
                          "trainings itself, one after another; run it as a plain command",
                          file=sys.stderr)  # fmt: skip
                return 2
            if args.seeds < 1:
                raise ValueError(f"--seeds {args.seeds}: at least 1")
            compare(
                args.config,
                args.overrides,
                args.output_dir,
                seeds=range(args.seeds),
                preset=args.preset,
                algorithms=[a.strip() for a in args.algorithms.split(",") if a.strip()],
            )
            return 0
        if args.command == "export":
            from gspo.export import export_command

            return export_command(args.source, args.merge, args.dtype, args.step)
        if args.command == "eval":
            from gspo.checkpoint_eval import eval_command

            return eval_command(args.source, args.step, args.config, args.overrides, args.json)
        if args.doc:
            if args.config is not None or args.overrides:
                raise ValueError("--doc takes no --config or overrides")
            from gspo.config import render_reference

            print(render_reference(), end="")
            return 0
        from gspo.config import dump_config_text, load_config

        config = load_config(args.config, args.overrides)
        text = dump_config_text(config)
        if config.model.path is not None:  # (the built-in sizes printed beside it read as its)
            # (before builtin: a long path is wrapped onto more lines)
            path = text.index("\n  builtin: ", text.index("\n  path: ")) + 1
            note = ("  # builtin to norm_topk_prob: the built-in model's sizes, unused with "
                    "model.path (its config.json gives them)\n")  # fmt: skip
            text = text[:path] + note + text[path:]
        print(text, end="")
        return 0
    except SaidByRankZero as said:
        if not leads_another_node():  # (on rank 0's node: rank 0 says it)
            time.sleep(RANK_ZERO_GRACE_S)
        print(f"gspo: error{rank_said()}: {said.__cause__}", file=sys.stderr)
        return 2
    except (ValueError, FileNotFoundError) as exc:  # ConfigError and RewardError included
        if os.environ.get("GSPO_DEBUG"):
            raise
        every = getattr(exc, "for_every_rank", False)  # (a setup error, said by rank 0)
        said = "; ".join([str(exc), *getattr(exc, "__notes__", ())])  # (RunDirectory's)
        print(f"gspo: error{'' if every else rank_said()}: {said}", file=sys.stderr)
        return 2
    except OSError as exc:  # unwritable output directory, full disk, ...
        if os.environ.get("GSPO_DEBUG"):
            raise
        where = f": {exc.filename}" if exc.filename else ""
        from gspo.publish import DiskFull, is_disk_full

        # (TensorBoard's full disk names no file; a DiskFull names its directory itself)
        unnamed = not where and is_disk_full(exc) and not isinstance(exc, DiskFull)
        if unnamed and args.command == "train":
            where = f" (writing under {run_directory(args)})"
        print(f"gspo: error{rank_said()}: {exc.strerror or exc}{where}{_after(args)}",
              file=sys.stderr)  # fmt: skip
        return 2
    except RuntimeError as exc:
        if os.environ.get("GSPO_DEBUG") or not peer_gone(exc):
            raise
        run = run_directory(args)
        # (gloo's own line names its source file first: the reason is after it)
        broke = re.sub(r"\[[^\]]*\.(?:cc|cpp|h):\d+\]\s*", "", str(exc).strip())
        # (RunDirectory put an old run back, or removed a run that never started; a run
        # with nothing written said --resume on it all the same)
        after = "; ".join(getattr(exc, "__notes__", ())) or (
            _resume_hint(args) if args.command == "train" else f"the same command on {run}"
        )
        if not_rank_zero():
            time.sleep(PEER_LINE_AFTER_S)
        posted = None if not_rank_zero() else posted_setup_error()  # (its own error)
        last_words(
            f"gspo: error{rank_said()}: {posted}; {after}" if posted else
            f"gspo: error{rank_said()}: another rank stopped (the process "
            f"group broke: {broke.splitlines()[0].split('. ')[0][:160]}); its own line, if it "
            f"printed one (a signal or a kill prints none), says why; {after}",
            by="collective",
        )  # fmt: skip
        return 2
    except KeyboardInterrupt as stop:
        code = 143 if isinstance(stop, Terminated) else 130
        if not_rank_zero():  # (Ctrl-C reaches every rank: rank 0 says how to resume)
            return code
        if args.command == "compare":  # its runs are reused and resumed by the same command
            hint = "run the same gspo compare again: finished runs are reused, the rest resumed"
        elif notes := getattr(stop, "__notes__", None):  # (RunDirectory put an old run back)
            hint = "; ".join(notes)
        elif args.command == "train":
            hint = _resume_hint(args)
        else:  # (gspo eval, export: nothing to resume)
            hint = ""
        how = "terminated (SIGTERM)" if isinstance(stop, Terminated) else "interrupted"
        print(f"gspo: {how}{'; ' if hint else ''}{hint}", file=sys.stderr)
        return code


def _resume_hint(args: argparse.Namespace) -> str:
    """How a stopped ``gspo train`` goes on: ``--resume`` from the checkpoint it names, the
    same command (``--auto-resume``), or, where it wrote no checkpoint to resume from (its
    directory removed, or kept with its config.yaml and metrics alone), the same command
    to start it again."""
    import shlex

    from gspo.runs import auto_resumes, not_a_run
    from gspo.training.checkpoint import latest_named

    run = run_directory(args)  # (its config.yaml and first metric line are no checkpoint)
    if not_a_run(run, "--resume") is not None or not auto_resumes(run):
        return "it had written nothing to resume from: the same command starts it again"
    named, problem = latest_named(run)
    since = f" (from {named})" if named and problem is None else ""
    if getattr(args, "auto_resume", False):
        return f"the same command continues it{since} (--auto-resume)"
    return f"resume with gspo train --resume {shlex.quote(str(run))}{since}"


def _after(args: argparse.Namespace) -> str:
    """What a command stopped by the machine (a full disk, an unwritable directory) leaves
    to do: ``gspo train --resume`` where the run has checkpoints, the same compare again."""
    if args.command == "compare":
        return "; the same gspo compare again continues it (its finished runs are kept)"
    from gspo.training.checkpoint import CHECKPOINTS

    run = run_directory(args) if args.command == "train" else None
    if run is None or not any((run / CHECKPOINTS).glob("step-*")):
        return ""  # (nothing to continue: an export, or a run that never wrote one)
    return (f"; checkpoints already written are intact (gspo train --resume {run} "
            "continues from the last one)")  # fmt: skip


def run_directory(args: argparse.Namespace) -> Path:
    """The run ``gspo train`` works on: ``--resume DIR``, ``--output-dir DIR``, or the
    default ``runs/gspo``."""
    return getattr(args, "resume", None) or getattr(args, "output_dir", None) or DEFAULT_RUN


def entry() -> None:
    """The console script: :func:`main`, then :func:`quick_exit`."""
    quick_exit(main())


def quick_exit(code: int) -> NoReturn:
    """Leave the process once everything it owns is closed, without interpreter teardown.

    After ``import torch`` and transformers, Python's teardown (freeing every module)
    takes over a second on a small CPU machine (1.2-1.4 s measured here, see
    benchmarks/README.md), longer than many a short run's training, and it runs C++
    static destructors (the suspect, not established, when a test's torchrun rank
    aborted with "terminate called without an active exception"). So: the ``atexit``
    handlers (multiprocessing's child joins, W&B and the like), stdio flushed, then
    ``os._exit``. A Ctrl-C or SIGTERM meanwhile (a second one, after the run stopped on
    the first) leaves at once, quietly: it printed a handler's traceback.
    """
    for stop in (signal.SIGINT, signal.SIGTERM):
        signal.signal(stop, lambda *_: os._exit(code))
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
