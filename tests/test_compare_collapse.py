"""`gspo compare` where a run collapses (non-finite updates), a seed has no final accuracy,
the cold start comes from the cache, and the preset is typed in another case."""

from __future__ import annotations

import json
import math

import pytest
from test_compare import TINY, summary

from gspo.cli import main
from gspo.experiments import compare
from gspo.experiments.claims import INCONCLUSIVE, REPRODUCED, verdicts
from gspo.experiments.report import write_report
from gspo.experiments.summary import Run


@pytest.fixture
def tiny(varied_reward):
    """test_compare's tiny runs, with a reward that is never flat."""
    return [*TINY, varied_reward]


def test_the_preset_in_any_case(tmp_path, capsys):
    """``--preset Stress`` was refused ("expected one of default, stress, ...")."""
    out = ["compare", "--output-dir", str(tmp_path / "out"), "train.max_steps=0"]
    assert main([*out, "--preset", "Stress"]) == 2  # (past the preset: max_steps)
    assert main([*out, "--preset", "GSPO-vs-GRPO"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "gspo: error: train.max_steps=0: the runs would train nothing to compare",
        "gspo: error: --preset 'GSPO-vs-GRPO': expected one of default, stress, long, tools",
    ]
