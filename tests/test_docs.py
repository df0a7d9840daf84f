"""The README and the pages under docs/: every relative Markdown link points at a file,
and every ``gspo train|config|compare`` command they (and the recipes) show parses."""

import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "examples" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# [text](target) and ![alt](target); the target ends at whitespace or the closing paren
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
CODE = re.compile(r"```.*?```|`[^`\n]*`", re.DOTALL)


def relative_links(page: Path) -> list[str]:
    """Link targets in ``page`` outside code, without web links, mail and pure anchors."""
    text = CODE.sub("", page.read_text())
    targets = []
    for target in LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE) or target.startswith("#"):
            continue
        targets.append(target.split("#", 1)[0])
    return targets


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    missing = [t for t in relative_links(page) if not (page.parent / t).exists()]
    assert not missing, f"{page.relative_to(ROOT)} links to missing files: {missing}"


def test_link_parser_finds_links():
    assert LINK.findall("see [a](docs/x.md#y) and ![b](img.png)") == ["docs/x.md#y", "img.png"]


def test_index_lists_every_page():
    index = (ROOT / "docs" / "index.md").read_text()
    listed = set(re.findall(r"\]\(([\w.-]+\.md)\)", index))
    pages = {p.name for p in (ROOT / "docs").glob("*.md")} - {"index.md"}
    assert pages <= listed, f"docs/index.md does not list {sorted(pages - listed)}"
    assert "algorithm.md" in listed


# ------------------------------------------------ commands the docs tell a user to run

#: Where commands are: the pages, the examples' README and the recipes' own comments.
COMMAND_SOURCES = [
    ROOT / "README.md",
    *sorted((ROOT / "docs").rglob("*.md")),
    *sorted((ROOT / "examples").rglob("*.md")),
    *sorted((ROOT / "examples").glob("*.yaml")),
]
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.MULTILINE | re.DOTALL)
INLINE = re.compile(r"`([^`]+)`")
GSPO = re.compile(r"(?:^|[\s/])gspo\s+(?:train|config|compare)\b")
#: An optional part of a synopsis, ``[--config FILE.yaml]`` (not a value: ``key=[a, b]``).
OPTIONAL = re.compile(r"(?<!\S)\[[^\]]*\]")
SHELL_OPERATORS = {"|", "||", "&&", ";", "&", ">", ">>", "2>&1"}
#: The user's own config files the docs name (``--config my.yaml``): the overrides of such
#: a command are checked on the default config. Any other --config must exist in the repo.
USER_FILES = {"my.yaml", "config.yaml"}  # (the user's own; a run's own)


def shell_lines(text: str) -> list[str]:
    """Lines of a shell snippet, those continued with a backslash joined."""
    lines, current = [], []
    for line in text.splitlines():
        current.append(line.strip().removesuffix("\\").strip())
        if not line.rstrip().endswith("\\"):
            lines.append(" ".join(current))
            current = []
    return [*lines, " ".join(current)] if current else lines


def snippets(path: Path) -> list[str]:
    """Shell lines of a page's code blocks and its inline code (a recipe: its comments)."""
    text = path.read_text()
    if path.suffix == ".yaml":
        comments = [line.strip()[1:] for line in text.splitlines() if line.strip()[:1] == "#"]
        return shell_lines("\n".join(comments))
    found = [line for block in FENCE.findall(text) for line in shell_lines(block)]
    return found + [" ".join(code.split()) for code in INLINE.findall(FENCE.sub("", text))]


def documented_commands() -> list[tuple[str, str]]:
    """``(page, command)`` for every ``gspo train|config|compare`` line the docs show."""
    return [
        (str(path.relative_to(ROOT)), line.strip())
        for path in COMMAND_SOURCES
        for line in snippets(path)
        if GSPO.search(line)
    ]


def gspo_arguments(command: str) -> list[str]:
    """The words after ``gspo`` (or ``-m gspo``, ``.venv/bin/gspo``) up to a pipe or
    redirection, without a synopsis' optional parts and ``...`` placeholders."""
    words = shlex.split(OPTIONAL.sub("", command), comments=True)
    start = next(i for i, w in enumerate(words) if w == "gspo" or w.endswith("/gspo"))
    args = []
    for word in words[start + 1 :]:
        if word in SHELL_OPERATORS or word.startswith((">", "2>")):
            break
        if word != "...":
            args.append(word)
    return args


def check_command(command: str) -> None:
    """Parse ``command`` as the gspo CLI does and validate its config, in-process.

    ``--config`` is read from the repository (a recipe must exist) but for the user's own
    files (:data:`USER_FILES`); ``--resume DIR``'s overrides apply to the default config
    (DIR's config.yaml is the user's). ``gspo compare`` builds every run's config as it
    would (its preset, algorithms and seeds), with a stand-in cold-start checkpoint.
    """
    from gspo.cli import parse_args
    from gspo.config import load_config
    from gspo.experiments import ALGORITHMS, PRESETS, run_configs

    try:
        args = parse_args(gspo_arguments(command))
    except SystemExit:
        raise AssertionError("the gspo command line does not parse (see stderr)") from None
    config = getattr(args, "config", None)
    if config is not None:
        if config.name in USER_FILES:
            config = None
        else:
            config = ROOT / config
            assert config.is_file(), f"--config {args.config}: no such file in the repository"
    if args.command == "train":
        load_config(None if args.resume else config, args.overrides)
    elif args.command == "config":
        assert not (args.doc and (args.config or args.overrides)), "--doc takes nothing else"
        load_config(config, args.overrides)
    else:
        assert args.preset in PRESETS, f"--preset {args.preset}: not one of {list(PRESETS)}"
        algorithms = [a.strip() for a in args.algorithms.split(",")]
        assert set(algorithms) <= set(ALGORITHMS), f"--algorithms {args.algorithms}"
        run_configs(config, args.overrides, checkpoint=Path("cold-start"),
                    seeds=range(args.seeds), preset=args.preset, algorithms=algorithms)  # fmt: skip


COMMANDS = documented_commands()


@pytest.mark.parametrize(("page", "command"), COMMANDS, ids=[f"{p}: {c}" for p, c in COMMANDS])
def test_documented_command_parses(page, command):
    check_command(command)


def test_the_docs_commands_are_found(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "Run `gspo train\ndata.task=calculator` or\n\n```bash\ngspo config \\\n"
        "  --config my.yaml  # the resolved config\nls\n```\n"
    )
    assert snippets(page) == [
        "gspo config --config my.yaml  # the resolved config",
        "ls",
        "gspo train data.task=calculator",  # inline code across lines
    ]
    found = {command for _, command in COMMANDS}
    assert any("examples/math_qwen3_4b_8gpu.yaml" in c and "torchrun" in c for c in found)
    assert any(page.endswith(".yaml") for page, _ in COMMANDS)  # a recipe's own comment
    assert len(COMMANDS) > 40
    (line,) = shell_lines(
        "torchrun --nproc-per-node 8 -m gspo train --config my.yaml \\\n  a.b=1 # 8 GPUs"
    )
    assert gspo_arguments(line) == ["train", "--config", "my.yaml", "a.b=1"]
    assert gspo_arguments(".venv/bin/gspo config [--config F] [k=...] x.y='[1, 2]' > f") == [
        "config",
        "x.y=[1, 2]",
    ]


@pytest.mark.parametrize(
    ("command", "error"),
    [
        ("gspo train optim.lrr=3e-4", "optim.lrr"),  # a key that does not exist
        ("gspo train algorithm.level=grpoo", "algorithm.level"),  # a value it does not take
        ("gspo train --config examples/missing.yaml", "no such file"),
        ("gspo compare --preset longest", "--preset"),
        ("gspo compare --algorithms GSPO,PPO", "--algorithms"),
        ("gspo config --doc optim.lr=1", "--doc"),
    ],
)
def test_a_wrong_command_in_the_docs_fails(command, error):
    with pytest.raises((AssertionError, ValueError), match=re.escape(error)):
        check_command(command)


def test_an_unknown_option_in_the_docs_fails(capsys):
    with pytest.raises(AssertionError, match="does not parse"):
        check_command("gspo train --outputdir runs/x")


# ------------------------------------------------ config keys the docs name in passing

#: Keys the docs name as examples of a mistake (a misspelt key and what gspo says to it).
#: (a misspelling shown refused; verl's own keys in docs/from_verl.md, in sections whose
#: names gspo's share)
WRONG_ON_PURPOSE = {"optim.lrr", "algorithm.adv_estimator", "algorithm.ppo_mini_batch_size",
                    "data.max_response_length", "data.train_batch_size"}  # fmt: skip
FILE_NAME = re.compile(r"\.(jsonl|json|safetensors|py|yaml|md|png|pt|csv|parquet|txt)$")


def named_keys(text: str, tops: set[str]) -> set[str]:
    """Dotted config keys (``rollout.group_size``, ``model.lora.r=4``) in inline code."""
    sections = "|".join(sorted(tops))
    key = re.compile(rf"(?<![\w./-])((?:{sections})\.[a-z_][a-z0-9_.]*)")
    found = {k.rstrip(".") for code in INLINE.findall(text) for k in key.findall(code)}
    return {k for k in found if not FILE_NAME.search(k) and not k.endswith("_")}


def test_every_config_key_the_docs_name_exists():
    """A renamed or removed key leaves no stale mention (the TRL mapping names ~60)."""
    from gspo.config import keys, sections

    known = {d for d, _ in sections()}
    known |= {f"{d}.{name}" for d, model in sections() for name, _ in keys(model)}
    tops = {d.split(".")[0] for d in known}
    stale = {
        str(page.relative_to(ROOT)): sorted(named_keys(page.read_text(), tops) - known)
        for page in [*PAGES, *sorted((ROOT / "docs").rglob("*/*.md"))]
    }
    assert named_keys("`rollout.group_size=8` and `model.lora.r` in train.jsonl", tops) == {
        "rollout.group_size", "model.lora.r"
    }  # fmt: skip
    assert {page: keys for page, keys in stale.items() if set(keys) - WRONG_ON_PURPOSE} == {}


def test_training_md_says_routing_replay_works_with_activation_checkpointing():
    """b0fff5d let model.activation_checkpointing run with moe.routing_replay (the replay
    lasts through the backward); training.md's Memory section still said it was refused."""
    from gspo.config import load_config

    both = ["model.builtin=qwen3_moe", "model.activation_checkpointing=true"]
    config = load_config(overrides=[*both, "moe.routing_replay=true"])
    assert config.model.activation_checkpointing and config.moe.routing_replay
    text = " ".join((ROOT / "docs" / "training.md").read_text().split())
    assert "Refused with** `moe.routing_replay=true`" not in text
    assert "`moe.routing_replay=true` the replayed routing lasts through the backward" in text
