"""The paper's claims judged on ``gspo compare``'s summaries: a verdict per claim
(:func:`verdicts` holds the rules) and the statements computed beside them (:func:`notes`,
:func:`gradient_noise_notes`)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from gspo.experiments.summary import Run, train_lines

#: Presets on which claim (c) is judged: the levers the paper says break GRPO.
UNSTABLE_PRESETS = ("stress", "long")

#: Below this mean response length (tokens) claim (b) cannot be told apart from noise:
#: the spread of a mean of L log-ratios is sqrt(L) times smaller, under the 3x the rule
#: asks for.
MIN_MEAN_LENGTH = 9

REPRODUCED, NOT_REPRODUCED, INCONCLUSIVE = "reproduced", "not reproduced", "inconclusive"

#: A spread of log-ratios below this is float rounding: the policy never moved (flat
#: rewards: every advantage 0), so no claim about ratios or stability can be judged.
MOVED_SD = 1e-5


def verdicts(summary: Mapping[str, Mapping[str, Any]], preset: str) -> list[dict[str, str]]:
    """One verdict per claim, each with the figures behind it (none without both GSPO and
    GRPO among the runs).

    (a) GSPO clips far more tokens (>= 10x GRPO's fraction; the paper shows ~100x) yet
        trains at least as well (final accuracy not below GRPO's by more than two standard
        errors of the seed mean).
    (b) Token ratios are noisy, sequence ratios tight (the spread of log w_it at least 3x
        that of log s_i on GRPO's own runs), and the token noise grows with response length
        (variance of w_it higher in the longest length bucket than in the shortest). A mean
        of L independent log-ratios has sqrt(L) times less spread, so below
        :data:`MIN_MEAN_LENGTH` tokens (3x) or with the longest bucket under twice the
        shortest, the test cannot tell and the verdict is inconclusive.
    (c) GRPO unstable where GSPO is not: only judged on the presets that pull the paper's
        levers (:data:`UNSTABLE_PRESETS`); a collapse is a final accuracy more than 0.1
        below the start, or a seed that ``train.max_skipped`` stopped (non-finite updates).
    """
    if "GSPO" not in summary or "GRPO" not in summary:
        return []  # every claim compares the two (the report says so)
    gspo, grpo = summary["GSPO"], summary["GRPO"]
    out = []

    # (a)
    if grpo["clip_fraction"]:
        clip_x = gspo["clip_fraction"] / grpo["clip_fraction"]
    else:  # GRPO clipped nothing: far more if GSPO clipped some; neither: nothing to compare
        clip_x = math.inf if gspo["clip_fraction"] else math.nan
    # seeds with a final accuracy (a collapsed run has none); an sd of fewer than 2: none
    ns = {id(s): len([a for a in s.get("accuracy_per_seed", s["seeds"]) if math.isfinite(a)])
          for s in (gspo, grpo)}  # fmt: skip
    n = min(ns.values())

    def se(s: Mapping[str, Any]) -> float:  # the standard error of its mean end accuracy
        sd = s["accuracy_sd"] if math.isfinite(s["accuracy_sd"]) else 0.0
        return sd / math.sqrt(max(ns[id(s)], 1))

    noise = 2 * math.hypot(se(gspo), se(grpo))
    gap = gspo["accuracy"] - grpo["accuracy"]
    counted = f"{n} seed{'s' if n != 1 else ''}"
    if ns[id(gspo)] != ns[id(grpo)] or n < len(gspo["seeds"]):
        counted = f"{ns[id(gspo)]} and {ns[id(grpo)]} seeds with a final accuracy"
    times = (
        "neither clipped" if math.isnan(clip_x)
        else "GRPO clipped none" if math.isinf(clip_x)
        else f"{clip_x:.0f}x"
    )  # fmt: skip
    ends = (
        f"final accuracy GSPO {gspo['accuracy']:.3f} vs GRPO {grpo['accuracy']:.3f} "
        f"(difference {gap:+.3f}, two standard errors {noise:.3f}, {counted})"
        if math.isfinite(gap)
        else f"final accuracy GSPO {said(gspo['accuracy'])} vs GRPO {said(grpo['accuracy'])}: "
        "none to compare"
    )
    figures = (
        f"clip fraction GSPO {gspo['clip_fraction']:.4f} vs GRPO {grpo['clip_fraction']:.4f} "
        f"({times}); {ends}"
    )
    figures += "".join(f"; {stopped(k, s)}" for k, s in ((k, summary[k]) for k in ("GSPO", "GRPO"))
                       if s.get("collapsed"))  # fmt: skip
    # moved: by more than two standard errors of its end over the seeds (one sample in 256
    # up or down counted before: "reproduced" on runs that learned nothing)
    moved = any(abs(s["accuracy"] - s["accuracy_start"]) > 2 * se(s) for s in (gspo, grpo))
    if len(gspo.get("collapsed", ())) > len(grpo.get("collapsed", ())):  # (its mean: the rest)
        verdict = NOT_REPRODUCED
        figures += "; GSPO collapsed on more seeds than GRPO: it did not train as well"
    elif any(math.isnan(v) for v in (clip_x, gap)):
        verdict = INCONCLUSIVE
    elif not moved:  # "trains as well" of runs that learned nothing says nothing
        verdict = INCONCLUSIVE
        ceiling = min(s["accuracy_start"] for s in (gspo, grpo)) >= 0.99
        how = "a harder task: both start at the ceiling" if ceiling else "train longer"
        figures += (
            "; neither algorithm's held-out accuracy moved from its start by more than two "
            f"standard errors ({how})"
        )
    elif n < 2 and clip_x >= 10:  # one seed: the accuracies have no error bar
        verdict = INCONCLUSIVE
        figures += "; one seed gives the accuracy no error bar (--seeds 2 or more)"
    elif clip_x >= 10 and gap >= -noise:
        verdict = REPRODUCED
    elif clip_x < 10 or gap < -noise:
        verdict = NOT_REPRODUCED
    else:  # pragma: no cover - the two branches above are exhaustive
        verdict = INCONCLUSIVE
    out.append({"claim": "(a) GSPO clips far more tokens (paper: ~100x), trains as well",
                "verdict": verdict, "figures": figures})  # fmt: skip

    # (b)
    tok_sd, seq_sd = grpo["token_log_ratio_sd"], grpo["sequence_log_ratio_sd"]
    rows, mean_len = grpo["spread_by_length"], grpo.get("mean_response_length", math.nan)
    still = tok_sd < MOVED_SD  # (NaN: no dumps, nothing known)
    if math.isnan(tok_sd) or math.isnan(seq_sd) or len(rows) < 2:
        verdict = INCONCLUSIVE
        figures = (
            f"sd of log w_it {tok_sd:.2e}, of log s_i {seq_sd:.2e}; not enough ratio dumps "
            "or response lengths to compare"
        )
    elif still:
        verdict = INCONCLUSIVE
        figures = (
            f"sd of log w_it {tok_sd:.2e} on GRPO's runs: the ratios are 1 to float rounding, "
            "the policy did not move (flat rewards?)"
        )
    else:
        wide = tok_sd >= 3 * seq_sd
        grows = rows[-1]["token_ratio_var"] > rows[0]["token_ratio_var"]
        testable = mean_len >= MIN_MEAN_LENGTH and rows[-1]["lo"] >= 2 * rows[0]["hi"]
        figures = (
            f"on GRPO's runs sd of log w_it {tok_sd:.2e} vs log s_i {seq_sd:.2e} "
            f"({tok_sd / seq_sd if seq_sd else math.inf:.1f}x); variance of w_it "
            f"{rows[0]['token_ratio_var']:.2e} for lengths {rows[0]['lengths']} vs "
            f"{rows[-1]['token_ratio_var']:.2e} for {rows[-1]['lengths']}; mean response "
            f"length {mean_len:.1f} tokens"
        )
        if not testable:
            verdict = INCONCLUSIVE
            figures += (
                f" (too short or too uniform to test: needs a mean of {MIN_MEAN_LENGTH}+ "
                "tokens and a longest length bucket at least twice the shortest)"
            )
        else:
            verdict = REPRODUCED if wide and grows else NOT_REPRODUCED
    out.append({"claim": "(b) token ratios noisy and length-dependent, sequence ratios tight",
                "verdict": verdict, "figures": figures})  # fmt: skip

    # (c)
    def collapsed(s: Mapping[str, Any]) -> bool:  # (a run stopped on non-finite updates too)
        return bool(s.get("collapsed")) or s["accuracy"] < s["accuracy_start"] - 0.1

    accuracies = [s[k] for s in (grpo, gspo) for k in ("accuracy", "accuracy_start")]
    if preset not in UNSTABLE_PRESETS:
        verdict = INCONCLUSIVE
        figures = f"not tested: run gspo compare --preset {' or '.join(UNSTABLE_PRESETS)}"
    else:
        figures = (
            f"final accuracy GRPO {said(grpo['accuracy'])} (start {said(grpo['accuracy_start'])}), "
            f"GSPO {said(gspo['accuracy'])} (start {said(gspo['accuracy_start'])})"
        )
        figures += "".join(f"; {stopped(k, s)}" for k, s in summary.items() if s.get("collapsed"))
        cannot = None if grpo.get("collapsed") or gspo.get("collapsed") else (
            "no held-out accuracy" if any(math.isnan(a) for a in accuracies)
            else "the policy did not move" if still
            else "a start under 0.1, below which no collapse shows"
            if min(grpo["accuracy_start"], gspo["accuracy_start"]) < 0.1
            else None
        )  # fmt: skip
        if cannot:
            verdict = INCONCLUSIVE
            figures += f" ({cannot})"
        elif collapsed(grpo) and not collapsed(gspo):
            verdict = REPRODUCED
        elif not collapsed(grpo):
            verdict = NOT_REPRODUCED
        else:
            verdict = INCONCLUSIVE  # both collapsed
    out.append({"claim": "(c) under stress (off-policy updates, long responses) GRPO "
                "becomes unstable, GSPO does not",
                "verdict": verdict, "figures": figures})  # fmt: skip
    return out


def said(value: float) -> str:
    """``value`` to 3 decimals, ``n/a`` where there is none (the report's cells)."""
    return f"{value:.3f}" if math.isfinite(value) else "n/a"


def stopped(name: str, s: Mapping[str, Any]) -> str:
    """Which of an algorithm's seeds ``train.max_skipped`` stopped, and at which step."""
    runs = s["collapsed"]
    where = ", ".join(f"seed {c['seed']} at step {c['step']}" for c in runs)
    return (
        f"{name}: {len(runs)} of {len(s['seeds'])} seed{'s' if len(s['seeds']) != 1 else ''} "
        f"collapsed (non-finite updates, train.max_skipped: {where})"
    )


def first_divergence(a: Sequence[Mapping[str, Any]], b: Sequence[Mapping[str, Any]],
                     key: str = "train/objective", tol: float = 1e-4) -> float | None:  # fmt: skip
    """The first step at which two runs' ``key`` differ by more than ``tol`` (or None)."""
    by_step = {r["step"]: r[key] for r in train_lines(b) if key in r}
    for r in train_lines(a):
        other = by_step.get(r["step"])
        if other is not None and key in r and abs(r[key] - other) > tol:
            return r["step"]
    return None


def gradient_noise_notes(summary: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """GRPO against GSPO on the gradient cosines, shortest vs longest length bucket.

    A change with length counts as different between the two when the difference of
    their changes exceeds two standard errors (from the spread over dumps).
    """
    rows = {n: summary[n]["gradient_cosines_by_length"] for n in ("GRPO", "GSPO") if n in summary}
    if len(rows) < 2 or any(len(r) < 2 for r in rows.values()):
        return []

    def said(value: float, se: float) -> str:  # (none: "n/a", as the table writes it)
        if not math.isfinite(value):
            return "n/a"
        return f"{value:.2f}" + (f" ± {se:.2f}" if math.isfinite(se) else "")

    def trend(name: str, key: str) -> tuple[float, float, str]:
        first, last = rows[name][0], rows[name][-1]
        se = math.hypot(first[f"{key}_se"], last[f"{key}_se"])
        text = (
            f"{name} {said(first[key], first[f'{key}_se'])} -> {said(last[key], last[f'{key}_se'])}"
        )
        return last[key] - first[key], se, text

    lengths = (
        f"lengths {rows['GRPO'][0]['length_mean']:.0f} -> {rows['GRPO'][-1]['length_mean']:.0f}"
    )
    out = []
    for key, what in (
        ("halves", "Agreement between the two halves of a length bucket (the noise measure)"),
        ("to_full", "Agreement of a half-bucket gradient with the full-batch gradient"),
        ("to_on_policy", "Cosine of a half-bucket gradient to its ratio-1 gradient"),
    ):
        grpo_change, grpo_se, grpo_text = trend("GRPO", key)
        gspo_change, gspo_se, gspo_text = trend("GSPO", key)
        diff, two_se = grpo_change - gspo_change, 2 * math.hypot(grpo_se, gspo_se)
        if not math.isfinite(diff + two_se):  # (a bucket of one dump has no standard error)
            finding = "cannot tell: a bucket has too few dumps for a standard error"
            out.append(
                f"{what}, shortest -> longest bucket ({lengths}; mean ± standard error): "
                f"{grpo_text}; {gspo_text}: {finding}."
            )
            continue
        elif diff < -two_se:
            finding = "it falls more with length for GRPO than for GSPO"
        elif diff > two_se:
            finding = "it rises more with length for GRPO than for GSPO (or falls less)"
        else:
            finding = "the two change alike with length, within two standard errors"
        out.append(
            f"{what}, shortest -> longest bucket ({lengths}; mean ± standard error): "
            f"{grpo_text}; {gspo_text}. GRPO's change minus GSPO's {diff:+.2f} (two "
            f"standard errors {two_se:.2f}): {finding}."
        )
    out.append(
        "The ratio-1 cosine measures how far the ratios turn the gradient: for GSPO it "
        "includes whole responses dropped by its clipping, for GRPO the per-token weights."
    )
    return out


def notes(summary: Mapping[str, Mapping[str, Any]], runs: Sequence[Run] = ()) -> list[str]:
    """Statements computed from the numbers, beside the verdicts."""
    out = []
    gspo, token = summary.get("GSPO"), summary.get("GSPO-token")
    if gspo and token:
        same = all(
            (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)
            for key in ("accuracy_per_seed", "clip_fraction_per_seed")
            for a, b in zip(gspo[key], token[key], strict=True)
        )
        if same:
            out.append(
                "GSPO-token matched GSPO exactly on every seed (accuracy and clip fraction): "
                "with one advantage per response the two objectives and gradients are the "
                "same (docs/algorithm.md), so this checks the implementation, it is not a "
                "second result."
            )
        else:
            by = {(r.algorithm, r.seed): r.records for r in runs}
            steps = [
                first_divergence(by[("GSPO", seed)], by[("GSPO-token", seed)])
                for seed in gspo["seeds"]
                if ("GSPO", seed) in by and ("GSPO-token", seed) in by
            ]
            where = ", ".join("never" if s is None else f"step {s:g}" for s in steps)
            out.append(
                "GSPO-token differed from GSPO (final accuracy "
                f"{token['accuracy']:.3f} vs {gspo['accuracy']:.3f}). With one advantage per "
                "response the two have the same objective and gradient in exact arithmetic; "
                "their float rounding differs (the order of sums), and a chaotic run can grow "
                "that into different trajectories. First step where their objectives differ "
                f"by more than 1e-4, per seed: {where}; a late first step means rounding "
                "drift, a difference at step 1 would be a bug."
            )
    return out
