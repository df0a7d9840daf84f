"""The report of ``gspo compare``: plots, ``report.md``, ``report.html`` (plots embedded)
and ``summary.json`` under the output directory."""

from __future__ import annotations

import base64
import json
import math
import numbers
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from gspo.experiments.claims import gradient_noise_notes, notes, verdicts
from gspo.experiments.summary import (
    CHURN,
    EPISODE_METRICS,
    Run,
    algorithm_summary,
    per_rollout,
    train_lines,
    with_elapsed,
)
from gspo.telemetry import per_rollout_batch, plot_bands, plot_histograms


def write_report(
    runs: Sequence[Run],
    out: Path,
    *,
    preset: str = "default",
    seconds: float = math.nan,
    cold_start_seconds: float = math.nan,
    cold_start_cached: str | None = None,
    overrides: Sequence[str] = (),
    trained_on: str = "unknown",
    config: Path | None = None,
) -> dict[str, Any]:
    """Plots, ``report.md``, ``report.html`` and ``summary.json`` under ``out``;
    ``trained_on``: the commits and machines the runs were trained with; ``config``: the
    ``--config`` file the runs read (the report named the overrides alone)."""
    by_algo: dict[str, list[Run]] = {}
    for r in runs:
        by_algo.setdefault(r.algorithm, []).append(r)
    summary = {name: algorithm_summary(rs) for name, rs in by_algo.items()}
    # the curves: of the seeds that went on where some did (a band is over the steps every
    # run reached: one collapsed seed ended its algorithm's curves at its collapse)
    drawn = {name: [r for r in rs if not r.collapse] or rs for name, rs in by_algo.items()}
    groups = {name: [with_elapsed(r.records) for r in rs] for name, rs in drawn.items()}
    trains = {name: [train_lines(x) for x in recs] for name, recs in groups.items()}
    # (a rollout batch's reward is on each of its minibatches' lines: one point per batch)
    batches = {name: [per_rollout_batch(x) for x in recs] for name, recs in trains.items()}
    plots = out / "plots"
    figures = [
        ("Held-out accuracy vs optimizer steps", plot_bands(
            groups, "eval/accuracy", plots / "accuracy_steps.png", title="Held-out accuracy")),
        ("Held-out accuracy vs run time", plot_bands(
            groups, "eval/accuracy", plots / "accuracy_time.png", x="elapsed",
            title="Held-out accuracy")),
        ("Training reward vs optimizer steps", plot_bands(
            batches, "train/reward_mean", plots / "reward_steps.png", title="Training reward")),
        ("Training reward vs run time", plot_bands(
            batches, "train/reward_mean", plots / "reward_time.png", x="elapsed",
            title="Training reward")),
        ("MoE expert change: the fraction of expert choices changed since the rollout, after "
         "each optimizer step (minibatch k: k + 1 updates)",
         plot_bands(trains, CHURN, plots / "expert_change.png", logy=True,
                    title="Expert choices changed since the rollout")),
        ("Fraction of clipped tokens per rollout batch (the paper's Figure 2)", plot_bands(
            {name: [per_rollout(x, "train/clip_fraction") for x in recs]
             for name, recs in trains.items()},
            "train/clip_fraction", plots / "clip_fraction.png", logy=True,
            title="Clipped fraction of tokens (per rollout batch)")),
        ("Token ratios w_it and sequence ratios s_i, last minibatch of a rollout batch",
         plot_histograms(
             {f"{name}: {kind}": s["ratio_dumps"][key]
              for name, s in summary.items()
              for kind, key in (("w_it", "token_log_ratio"), ("s_i", "sequence_log_ratio"))
              if s["ratio_dumps"] and s["ratio_dumps"][key].numel()},
             plots / "ratios.png", title="log importance ratios (second half of training)")),
        ("Variance of the ratios by response length", plot_bands(
            {f"{name}: {label}": [[{"step": row["length_mid"], "variance": row[key]}
                                   for row in s["spread_by_length"]]]
             for name, s in summary.items()
             for label, key in (("w_it", "token_ratio_var"), ("s_i", "sequence_ratio_var"))},
            "variance", plots / "ratio_variance_by_length.png", logy=True,
            xlabel="response length (bucket middle)",
            title="Variance of importance ratios by response length")),
        ("Gradient noise by response length: cosine between the gradient of half a "
         "length bucket and the full-batch gradient (to_full), and between the two halves "
         "(halves); last minibatch's weights", plot_bands(
            cosine_lines(summary, "to_full", "halves"), "cosine",
            plots / "gradient_cosine_by_length.png", xlabel="response length (bucket mean)",
            title="cos(half-bucket gradient, full-batch gradient / other half)")),
        ("How far the importance ratios turn the gradient: cosine between a half bucket's "
         "gradient with the run's ratios and with ratios 1", plot_bands(
            cosine_lines(summary, "to_on_policy"), "cosine",
            plots / "gradient_ratio_turn_by_length.png",
            xlabel="response length (bucket mean)",
            title="cos(gradient with ratios, gradient with ratios 1)")),
    ]  # fmt: skip
    claims = verdicts(summary, preset)
    for s in summary.values():
        s.pop("ratio_dumps")
    result = {
        "preset": preset,
        "config": None if config is None else str(config),
        "overrides": list(overrides),
        "trained_on": trained_on,
        "seconds": seconds,
        "cold_start_seconds": cold_start_seconds,
        "cold_start_cached": cold_start_cached,
        "run_seconds": sum(with_elapsed(r.records)[-1]["elapsed"] for r in runs if r.records),
        "algorithms": summary,
        "verdicts": claims,
    }
    # strict JSON: a figure that could not be computed (NaN) is null
    text = json.dumps(_finite(result), indent=2, default=float, allow_nan=False)
    (out / "summary.json").write_text(text + "\n")
    md = report_markdown(result, [(t, p) for t, p in figures if p is not None], out, runs)
    (out / "report.md").write_text(md)
    (out / "report.html").write_text(report_html(md, out))
    return result


def verdict_table(claims: list[dict[str, str]]) -> list[str]:
    """The verdicts as a Markdown table, or the line saying why there are none."""
    if not claims:
        return ["Every claim compares GSPO with GRPO: run both (`--algorithms GSPO,GRPO`)."]
    rows = [f"| {c['claim']} | **{c['verdict']}** | {c['figures']} |" for c in claims]
    return ["| claim | verdict | figures |", "|---|---|---|", *rows]


def cosine_lines(summary: Mapping[str, Mapping[str, Any]], *keys: str) -> dict[str, Any]:
    """``plot_bands`` groups: per algorithm and key, one line against the bucket length."""
    return {
        f"{name}: {key}" if len(keys) > 1 else name: [
            [{"step": row["length_mean"], "cosine": row[key]}
             for row in s["gradient_cosines_by_length"]]]
        for name, s in summary.items() if s["gradient_cosines_by_length"]
        for key in keys
    }  # fmt: skip


def report_markdown(
    result: Mapping[str, Any],
    figures: list[tuple[str, Path]],
    out: Path,
    runs: Sequence[Run] = (),
) -> str:
    summary = result["algorithms"]
    seeds = next(iter(summary.values()))["seeds"] if summary else []
    n_runs = len(result["algorithms"]) * len(seeds)
    cached = (
        f" (taken from the cold-start cache, `{result['cold_start_cached']}`: that is how long "
        "the run that trained it took; `--no-cache` redoes it)"
        if result.get("cold_start_cached")
        else ""
    )
    lines = [
        "# " + " vs ".join(summary),
        "",
        f"Produced by `gspo compare` (preset `{result['preset']}`"
        + (f", config `{result['config']}`" if result.get("config") else "")
        + "".join(f", override `{o}`" for o in result.get("overrides", []))
        + ", seeds "
        f"{', '.join(map(str, seeds))}). Time: the shared cold start "
        f"{result['cold_start_seconds'] / 60:.1f} min{cached}, the {n_runs} "
        f"run{'s' if n_runs != 1 else ''}"
        f" {result['run_seconds'] / 60:.1f} min together (each run's steps, "
        f"evaluations and checkpoints); this invocation {result['seconds'] / 60:.1f} min "
        "(reused runs cost nothing). "
        "Every run "
        "starts from the same cold-start checkpoint with the same config but "
        "`algorithm.level` (and its paper clip range) and `train.seed`. Figures are means "
        "over seeds (± one standard deviation in the plots' bands). Trained at "
        f"{result.get('trained_on', 'unknown')}.",
        "",
        "## Verdicts",
        "",
        *verdict_table(result["verdicts"]),
        "",
        "## Final numbers",
        "",
        "| algorithm | held-out accuracy (start -> end, ± sd over seeds) | greedy (end) "
        "| reward, last quarter | clipped tokens | sd log w_it | sd log s_i | run time (s) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, s in summary.items():
        fell = len(s.get("collapsed", ()))
        of = f" ({fell} of {len(s['seeds'])} collapsed)" if fell else ""
        lines.append(
            f"| {name}{of} | "
            f"{cell(s['accuracy_start'])} -> {pm(s['accuracy'], spread(s))} | "
            f"{cell(s['accuracy_greedy'])} | {cell(s['reward_tail'])} | "
            f"{cell(s['clip_fraction'], '.4f')} | {cell(s['token_log_ratio_sd'], '.2e')} | "
            f"{cell(s['sequence_log_ratio_sd'], '.2e')} | {cell(s['seconds'], '.0f')} |"
        )
    lines += ["", *[f"- {note}" for note in notes(summary, runs)]]
    lines += collapsed_section(summary)
    if any(math.isfinite(s.get("expert_change", math.nan)) for s in summary.values()):
        lines += [
            "",
            "## MoE routing",
            "",
            f"`{CHURN}`: after the optimizer step on minibatch k, the fraction of its "
            "tokens' expert choices that differ from the rollout's (routed again after the "
            "step: k + 1 updates since the rollout). *One update* is minibatch 0 (the paper's "
            "figure), *all updates* a rollout batch's last minibatch; means over the rollout "
            "batches, then over seeds. With `moe.routing_replay` the update still routes as "
            "the rollout did; the churn is what it replays over.",
            "",
            "| algorithm | changed after one update | after all updates |",
            "|---|---|---|",
        ]
        for name, s in summary.items():
            one, every = (
                cell(s.get(k, math.nan), ".4f") for k in ("expert_change", "expert_change_all")
            )
            lines.append(f"| {name} | {one} | {every} |")
    if any(s.get("episodes") for s in summary.values()):
        lines += [
            "",
            "## Episodes",
            "",
            "Held-out episodes (sampled), at the first and the last evaluation, means over seeds.",
            "",
            "| algorithm | " + " | ".join(EPISODE_METRICS.values()) + " |",
            "|---|" + "---|" * len(EPISODE_METRICS),
        ]
        for name, s in summary.items():
            cells = [
                f"{s['episodes'][k][0]:.3f} -> {s['episodes'][k][1]:.3f}"
                if k in s.get("episodes", {})
                else "-"
                for k in EPISODE_METRICS
            ]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "## Ratio variance by response length", ""]
    lines += ["| algorithm | lengths | responses | var w_it | var s_i |", "|---|---|---|---|---|"]
    for name, s in summary.items():
        for row in s["spread_by_length"]:
            lines.append(
                f"| {name} | {row['lengths']} | {row['responses']} | "
                f"{row['token_ratio_var']:.2e} | {row['sequence_ratio_var']:.2e} |"
            )
    if any(s["gradient_cosines_by_length"] for s in summary.values()):
        lines += [
            "",
            "## Gradient noise by response length",
            "",
            "On every dumped rollout batch, at the weights its last (most off-policy) "
            "minibatch sees, the batch is cut into four length buckets (its quartiles) and "
            "each bucket into two random halves; the gradient of the policy loss over each "
            "half is compared with the full-batch gradient (*to full*), with the other "
            "half (*halves*), and with the same half's gradient under ratios 1 (*to ratio "
            "1*: how far the importance ratios and the clipping turn it). Means over the "
            "dumps of the second half of training, all seeds, ± their standard error. 1 is "
            "perfect agreement. "
            "*Halves* is the noise measure proper (two independent samples of the same "
            "lengths); *to full* also rises with the bucket's weight in the full-batch "
            "gradient (a bucket whose gradient is larger pulls the full one toward it).",
            "",
            "| algorithm | bucket | mean length | to full | halves | to ratio 1 | dumps |",
            "|---|---|---|---|---|---|---|",
        ]
        for name, s in summary.items():
            for row in s["gradient_cosines_by_length"]:
                lines.append(
                    f"| {name} | {row['bucket'] + 1} | {row['length_mean']:.0f} | "
                    f"{pm(row['to_full'], row['to_full_se'])} | "
                    f"{pm(row['halves'], row['halves_se'])} | "
                    f"{pm(row['to_on_policy'], row['to_on_policy_se'])} | {row['dumps']} |"
                )
        lines += [""] + [
            f"- {name}: whole-batch gradient with ratios vs with ratios 1, cosine "
            f"{s['gradient_cosine_full_to_on_policy']:.3f}."
            for name, s in summary.items()
            if s["gradient_cosines_by_length"]
            and math.isfinite(s["gradient_cosine_full_to_on_policy"])  # (NaN: none computed)
        ]
        lines += [f"- {note}" for note in gradient_noise_notes(summary)]
    elif skipped := sorted({why for s in summary.values() for why in s["gradient_noise_skipped"]}):
        lines += [
            "",
            "## Gradient noise by response length",
            "",
            f"Not measured: {'; '.join(skipped)}.",
        ]
    lines += ["", "## Plots", ""]
    for title, path in figures:
        lines += [f"### {title}", "", f"![{title}]({path.relative_to(out).as_posix()})", ""]
    return "\n".join(lines)


def report_html(markdown: str, out: Path) -> str:
    """A self-contained HTML page of the report (CommonMark with tables, by markdown-it):
    the plots embedded as data URIs."""
    from markdown_it import MarkdownIt

    parser = MarkdownIt("commonmark", {"html": False}).enable("table")
    tokens = parser.parse(markdown)
    for token in tokens:
        for child in token.children or ():
            src = child.attrGet("src") if child.type == "image" else None
            if isinstance(src, str) and (out / src).is_file():
                data = base64.b64encode((out / src).read_bytes()).decode()
                child.attrSet("src", f"data:image/png;base64,{data}")
    body = parser.renderer.render(tokens, parser.options, {})
    style = "body{font-family:sans-serif;max-width:980px;margin:auto}td,th{border:1px solid #ccc;padding:4px}table{border-collapse:collapse}img{max-width:100%}code{background:#f4f4f4}"  # noqa: E501
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>gspo compare</title>"
        f"<style>{style}</style></head><body>{body}</body></html>\n"
    )


def collapsed_section(summary: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """The runs ``train.max_skipped`` stopped (the compare went on without them): each
    one's step and error line; none where no run collapsed."""
    rows = [(name, c) for name, s in summary.items() for c in s.get("collapsed", ())]
    if not rows:
        return []
    return [
        "",
        "## Collapsed runs",
        "",
        "Stopped by `train.max_skipped` (updates with a non-finite loss or gradient in a "
        "row); the other runs went on. Their final accuracy is left out of the table "
        "(they never reached the end), and their curves from the plots where other seeds of "
        "their algorithm went on. A later compare "
        "into this directory reuses them as collapsed: delete one to train it again.",
        "",
        "| algorithm | seed | stopped at step | why |",
        "|---|---|---|---|",
        *[
            f"| {name} | {c['seed']} | {c['step']} | {c['reason'].replace('|', '/')} |"
            for name, c in rows
        ],
    ]


def spread(s: Mapping[str, Any]) -> float:
    """The accuracy's sd over seeds; none (NaN) from one seed, or where one seed alone
    has a final accuracy (the others without an evaluation, or collapsed)."""
    finals = s.get("accuracy_per_seed", s.get("seeds", ()))
    return s["accuracy_sd"] if sum(math.isfinite(a) for a in finals) > 1 else math.nan


def cell(value: float, spec: str = ".3f") -> str:
    """``value`` formatted, ``n/a`` where there is none (NaN: e.g. no held-out rows)."""
    return format(value, spec) if math.isfinite(value) else "n/a"


def pm(value: float, error: float) -> str:
    """``value ± error`` to 3 decimals; ``value`` alone without an error (one seed or one
    dump), ``n/a`` without a value (e.g. a zero gradient's cosine), never ``nan ± nan``."""
    if not (math.isfinite(value) and math.isfinite(error)):
        return cell(value)
    return f"{value:.3f} ± {error:.3f}"


def _finite(value: Any) -> Any:
    """``value`` with every NaN or infinite float (nested in dicts and lists) as None."""
    if isinstance(value, numbers.Real) and not isinstance(value, numbers.Integral):
        return float(value) if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value
