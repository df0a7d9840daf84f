"""Tests of ``gspo.objectives`` against ``docs/algorithm.md``.

The reference below is written directly from the formulas of ``docs/algorithm.md``
(Eqs. (2)-(10)) in plain Python floats (float64), one response and one token at a time.
It does not call any helper of the module. Its gradient is the closed form of that page's
"Gradients" paragraph: every counted, unclipped token gets
``-ratio * A / (|y_i| * n_valid_rows)`` (for GSPO ``ratio = s_i``), plus the KL term.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gspo.objectives import (
    CORRECTIONS,
    DEFAULT_CLIP,
    DEFAULT_CORRECTION_BOUNDS,
    LEVELS,
    MAX_LOG_RATIO,
    PolicyLoss,
    k3_kl,
    policy_loss,
    rollout_correction,
    sequence_log_ratio,
    sequence_ratio,
    sequence_token_ratio,
)

F64 = torch.float64
CLIP_KEYS = ("clip_fraction", "clip_fraction_low", "clip_fraction_high", "clip_fraction_sequences")
RATIO_KEYS = ("ratio_mean", "ratio_min", "ratio_max")


# ---------------------------------------------------------------------------------------
# Reference implementation (docs/algorithm.md formulas, plain float64 loops)
# ---------------------------------------------------------------------------------------


def reference(lp, olp, adv, mask, *, level, eps_low, eps_high, ref=None, kl_coef=0.0, weights=None):
    """GRPO / GSPO / GSPO-token loss, gradient and clip metrics, from docs/algorithm.md;
    ``weights`` are the per-token c_{i,t} of Eq. (11) (None = 1)."""
    b, t_len = mask.shape
    c = [[1.0] * t_len for _ in range(b)] if weights is None else weights.double().tolist()
    lp, olp, m = lp.double().tolist(), olp.double().tolist(), mask.bool().tolist()
    adv = adv.double().tolist()
    ref = None if ref is None else ref.double().tolist()
    rows = [i for i in range(b) if any(m[i])]
    n_valid = len(rows)
    grad = [[0.0] * t_len for _ in range(b)]
    objective = kl = 0.0
    n_low = n_high = n_tokens = 0
    row_fractions, ratios = [], []
    clipped_units = unclipped_units = 0

    def clip(x):
        return min(max(x, 1.0 - eps_low), 1.0 + eps_high)

    for i in rows:
        idx = [t for t in range(t_len) if m[i][t]]
        n = len(idx)
        n_tokens += n
        a_tok = {t: (adv[i][t] if isinstance(adv[i], list) else adv[i]) for t in idx}
        if level == "token":
            ratio = {t: math.exp(lp[i][t] - olp[i][t]) for t in idx}  # w_{i,t}
            ratios.extend(ratio.values())
        else:
            s = math.exp(sum(lp[i][t] - olp[i][t] for t in idx) / n)  # s_i
            ratio = dict.fromkeys(idx, s)
            ratios.append(s)
        row_clipped = 0
        if level == "sequence":
            a = adv[i]
            c_mean = sum(c[i][t] for t in idx) / n  # (1/|y_i|) sum_t c_{i,t}
            clipped = clip(s) * a < s * a  # the clipped branch of the min is active
            objective += c_mean * min(s * a, clip(s) * a) / n_valid
            row_clipped = n if clipped else 0
            n_high += row_clipped if a > 0 else 0
            n_low += row_clipped if a < 0 else 0
            clipped_units += int(clipped)
            unclipped_units += int(not clipped)
            for t in idx:
                grad[i][t] = 0.0 if clipped else -c_mean * s * a / (n * n_valid)
        else:
            for t in idx:
                r, a = ratio[t], a_tok[t]
                clipped = clip(r) * a < r * a
                objective += c[i][t] * min(r * a, clip(r) * a) / (n * n_valid)
                row_clipped += int(clipped)
                n_high += int(clipped and a > 0)
                n_low += int(clipped and a < 0)
                clipped_units += int(clipped)
                unclipped_units += int(not clipped)
                grad[i][t] = 0.0 if clipped else -c[i][t] * r * a / (n * n_valid)
        row_fractions.append(row_clipped / n)
        if ref is not None:
            for t in idx:
                d = ref[i][t] - lp[i][t]
                kl += (math.exp(d) - d - 1.0) / (n * n_valid)
                grad[i][t] += kl_coef * (1.0 - math.exp(d)) / (n * n_valid)
    loss = -objective + kl_coef * kl
    metrics = {
        "objective": objective,
        "clip_fraction": (n_low + n_high) / n_tokens,
        "clip_fraction_low": n_low / n_tokens,
        "clip_fraction_high": n_high / n_tokens,
        "clip_fraction_sequences": sum(row_fractions) / n_valid,
        "ratio_mean": sum(ratios) / len(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "tokens": float(n_tokens),
        "sequences": float(n_valid),
    }
    if ref is not None:
        metrics["kl"] = kl
    return {
        "loss": loss,
        "grad": torch.tensor(grad, dtype=F64),
        "metrics": metrics,
        "clipped_units": clipped_units,
        "unclipped_units": unclipped_units,
    }


# ---------------------------------------------------------------------------------------
# Batches whose clip pattern is known by construction
# ---------------------------------------------------------------------------------------


def make_batch(b, t_len, level, seed, *, eps=None, token_adv=False, empty_row=True):
    """Random masked float64 batch where some units (responses for GSPO, tokens for GRPO)
    sit beyond the clip band on the side of their advantage (clipped) and others inside
    the band or beyond it on the other side (not clipped). Unit ``j`` of the batch is
    meant to be clipped when ``(j + seed) % 2 == 0``.
    """
    g = torch.Generator().manual_seed(seed)

    def u(lo, hi, *shape):
        return lo + (hi - lo) * torch.rand(*shape, generator=g, dtype=F64)

    eps_low, eps_high = eps or DEFAULT_CLIP[level]
    up, down = math.log1p(eps_high), -math.log1p(-eps_low)  # band in log space
    mask = torch.rand(b, t_len, generator=g) < 0.7
    mask[:, 0] = True
    if empty_row and b >= 3:
        mask[1] = False
    olp = -u(0.01, 3.0, b, t_len)
    adv = torch.randn(b, generator=g, dtype=F64)

    def log_ratio(sign, want_clipped, inside):
        """A log-ratio that is clipped for an advantage of this sign, or not."""
        if want_clipped:
            return up * u(1.5, 4.0, 1).item() if sign > 0 else -down * u(1.5, 4.0, 1).item()
        if inside:
            return min(up, down) * u(-0.5, 0.5, 1).item()
        return -down * u(1.5, 4.0, 1).item() if sign > 0 else up * u(1.5, 4.0, 1).item()

    drift = torch.zeros(b, t_len, dtype=F64)
    if level == "token":
        j = 0
        for i in range(b):
            for t in range(t_len):
                if mask[i, t]:
                    drift[i, t] = log_ratio(adv[i], (j + seed) % 2 == 0, bool((j // 2) % 2))
                    j += 1
    else:
        noise = 0.05 * torch.randn(b, t_len, generator=g, dtype=F64)
        valid = [i for i in range(b) if mask[i].any()]
        for j, i in enumerate(valid):
            target = log_ratio(adv[i], (j + seed) % 2 == 0, bool(j % 3))
            row_noise = noise[i] - noise[i][mask[i]].mean()  # zero mean over counted tokens
            drift[i] = target + row_noise
    lp = olp + drift
    if token_adv:
        # Per-token advantages whose sign alternates around the row's sign.
        signs = torch.where(torch.arange(t_len) % 2 == 0, 1.0, -1.0).to(F64)
        adv = adv.sign()[:, None] * signs * u(0.1, 2.0, b, t_len)
    return lp, olp, adv, mask


def run(lp, olp, adv, mask, **kwargs) -> tuple[PolicyLoss, torch.Tensor]:
    """``policy_loss`` on a fresh leaf copy of ``lp``; returns the result and d loss/d lp."""
    x = lp.detach().clone().requires_grad_(True)
    out = policy_loss(x, olp, adv, mask, **kwargs)
    out.loss.backward()
    return out, x.grad


def assert_matches_reference(out, grad, want, *, rtol, atol):
    assert out.loss.item() == pytest.approx(want["loss"], rel=rtol, abs=atol)
    torch.testing.assert_close(grad.double(), want["grad"], rtol=rtol, atol=atol)
    for key, value in want["metrics"].items():
        # The per-response clipped fraction is a float32 logging metric in the module.
        tol = max(rtol, 1e-6) if key == "clip_fraction_sequences" else rtol
        assert out.metrics[key] == pytest.approx(value, rel=tol, abs=atol), key


SHAPES = [(b, t) for b in (1, 3, 8) for t in (1, 5, 33)]


# ---------------------------------------------------------------------------------------
# Against the reference
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize(("b", "t_len"), SHAPES)
@pytest.mark.parametrize(
    ("level", "token_adv"),
    [("sequence", False), ("sequence_token", False), ("sequence_token", True), ("token", False)],
)
def test_matches_reference(level, token_adv, b, t_len, dtype):
    """Each level's loss, gradient and metrics equal the formulas (J_GSPO, J of
    GSPO-token with [B] or per-token [B, T] advantages, J_GRPO), with the default clip
    range, on masked batches where both clipped and unclipped units occur."""
    rtol, atol = (1e-10, 1e-12) if dtype == torch.float64 else (2e-5, 1e-6)
    clipped = unclipped = 0
    for seed in (0, 1):
        lp, olp, adv, mask = make_batch(b, t_len, level, seed, token_adv=token_adv)
        lp, olp, adv = lp.to(dtype), olp.to(dtype), adv.to(dtype)
        low, high = DEFAULT_CLIP[level]
        want = reference(lp, olp, adv, mask, level=level, eps_low=low, eps_high=high)
        out, grad = run(lp, olp, adv, mask, level=level)
        assert out.loss.dtype == dtype
        assert_matches_reference(out, grad, want, rtol=rtol, atol=atol)
        rows = int(mask.any(dim=1).sum())
        units = want["clipped_units"] + want["unclipped_units"] if level == "token" else rows
        if units >= 2 and not token_adv:
            # The batch itself exercises both branches of the min.
            assert want["clipped_units"] > 0
            assert want["unclipped_units"] > 0
        clipped += want["clipped_units"]
        unclipped += want["unclipped_units"]
    assert clipped > 0
    assert unclipped > 0


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("eps", [(0.1, 0.15), (0.2, 0.2), (1e-3, 5e-3)])
def test_explicit_clip_range_matches_reference(level, eps):
    """clip_low / clip_high are eps_low / eps_high of the formulas, at every level."""
    for seed in (0, 1, 2):
        lp, olp, adv, mask = make_batch(8, 17, level, seed, eps=eps)
        want = reference(lp, olp, adv, mask, level=level, eps_low=eps[0], eps_high=eps[1])
        out, grad = run(lp, olp, adv, mask, level=level, clip_low=eps[0], clip_high=eps[1])
        assert want["clipped_units"] > 0
        assert want["unclipped_units"] > 0
        assert_matches_reference(out, grad, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("level", LEVELS)
def test_kl_penalty_matches_reference(level):
    """loss = -J + kl_coef * mean_i (1/|y_i|) sum_t k3, k3 = exp(ref - lp) - (ref - lp) - 1;
    metrics['kl'] is that mean."""
    for seed in (0, 1):
        lp, olp, adv, mask = make_batch(8, 9, level, seed)
        g = torch.Generator().manual_seed(100 + seed)
        ref = olp + 0.3 * torch.randn(olp.shape, generator=g, dtype=F64)
        low, high = DEFAULT_CLIP[level]
        for kl_coef in (0.0, 0.05, 1.5):
            want = reference(
                lp,
                olp,
                adv,
                mask,
                level=level,
                eps_low=low,
                eps_high=high,
                ref=ref,
                kl_coef=kl_coef,
            )
            out, grad = run(lp, olp, adv, mask, level=level, ref_logprobs=ref, kl_coef=kl_coef)
            assert want["metrics"]["kl"] > 0.01  # a KL that moves the loss
            assert_matches_reference(out, grad, want, rtol=1e-10, atol=1e-12)
            assert out.loss.item() == pytest.approx(
                -out.metrics["objective"] + kl_coef * out.metrics["kl"], rel=1e-12
            )


def test_kl_coef_without_reference_raises():
    """kl_coef != 0 needs ref_logprobs."""
    lp, olp, adv, mask = make_batch(3, 4, "sequence", 0)
    with pytest.raises(ValueError, match="ref_logprobs"):
        policy_loss(lp, olp, adv, mask, kl_coef=0.1)


def test_no_kl_metric_without_reference():
    """metrics['kl'] is reported only when a reference is given."""
    lp, olp, adv, mask = make_batch(3, 4, "sequence", 0)
    assert "kl" not in policy_loss(lp, olp, adv, mask).metrics
    assert "kl" in policy_loss(lp, olp, adv, mask, ref_logprobs=olp).metrics


# ---------------------------------------------------------------------------------------
# Clip ranges and levels
# ---------------------------------------------------------------------------------------


def test_default_clip_values():
    """Paper ranges: (3e-4, 4e-4) for GSPO and GSPO-token, (0.2, 0.27) for GRPO."""
    assert DEFAULT_CLIP == {
        "sequence": (3e-4, 4e-4),
        "sequence_token": (3e-4, 4e-4),
        "token": (0.2, 0.27),
    }
    assert set(LEVELS) == {"sequence", "sequence_token", "token"}


@pytest.mark.parametrize(
    ("level", "inside_high", "outside_high", "inside_low", "outside_low"),
    [
        ("sequence", 1 + 3.9e-4, 1 + 4.1e-4, 1 - 2.9e-4, 1 - 3.1e-4),
        ("sequence_token", 1 + 3.9e-4, 1 + 4.1e-4, 1 - 2.9e-4, 1 - 3.1e-4),
        ("token", 1.26, 1.28, 0.81, 0.79),
    ],
)
def test_default_clip_range_is_applied(level, inside_high, outside_high, inside_low, outside_low):
    """With no clip arguments, a unit is clipped exactly when its ratio leaves the level's
    default band on the side of its advantage (ratio > 1+eps_high with A > 0, or
    ratio < 1-eps_low with A < 0), and not otherwise."""
    ratios = torch.tensor([inside_high, outside_high, inside_low, outside_low] * 2, dtype=F64)
    adv = torch.tensor([1.0] * 4 + [-1.0] * 4, dtype=F64)
    olp = torch.full((8, 3), -1.0, dtype=F64)
    lp = olp + ratios.log()[:, None]  # the same log-ratio on every token: s_i = w_{i,t}
    mask = torch.ones(8, 3, dtype=torch.bool)
    out, grad = run(lp, olp, adv, mask, level=level)
    # Only row 1 (above the band, A > 0) and row 7 (below the band, A < 0) are clipped.
    assert out.metrics["clip_fraction_high"] == pytest.approx(1 / 8)
    assert out.metrics["clip_fraction_low"] == pytest.approx(1 / 8)
    assert out.metrics["clip_fraction"] == pytest.approx(2 / 8)
    clipped_rows = (grad == 0).all(dim=1)
    assert clipped_rows.tolist() == [False, True, False, False, False, False, False, True]


def test_unknown_level_raises_naming_accepted_values():
    """An unknown level is a ValueError whose message lists the accepted levels."""
    lp, olp, adv, mask = make_batch(2, 3, "sequence", 0)
    with pytest.raises(ValueError) as info:
        policy_loss(lp, olp, adv, mask, level="grpo")
    for name in ("sequence", "sequence_token", "token"):
        assert name in str(info.value)


def test_bad_shapes_raise():
    """Mismatched [B, T] shapes and wrongly shaped advantages are rejected."""
    lp, olp, adv, mask = make_batch(3, 4, "token", 0)
    with pytest.raises(ValueError):
        policy_loss(lp, olp[:, :3], adv, mask, level="token")
    with pytest.raises(ValueError):
        policy_loss(lp, olp, adv[:2], mask, level="token")
    with pytest.raises(ValueError):
        policy_loss(lp, olp, torch.zeros(3, 5, dtype=F64), mask, level="token")


def test_on_policy_ratio_is_exactly_one():
    """Minibatch 1 is on-policy: every ratio is exactly 1, nothing is clipped and the loss is
    minus the mean advantage, at every level."""
    lp, _, adv, mask = make_batch(8, 7, "sequence", 0)
    for level in LEVELS:
        out, _ = run(lp, lp, adv, mask, level=level)
        for key in RATIO_KEYS:
            assert out.metrics[key] == 1.0
        assert out.metrics["clip_fraction"] == 0.0
        valid = mask.any(dim=1)
        assert out.loss.item() == pytest.approx(-adv[valid].mean().item(), rel=1e-12)


# ---------------------------------------------------------------------------------------
# GSPO-token
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("adv_form", ["B", "BT"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gspo_token_equals_gspo_with_response_advantages(adv_form, seed, dtype):
    """With A_{i,t} = A_i (given as [B] or as [B, T] constant across tokens) GSPO-token
    equals GSPO in objective value, in which sequences are clipped, and in gradient."""
    lp, olp, adv, mask = make_batch(8, 13, "sequence", seed)
    lp, olp, adv = lp.to(dtype), olp.to(dtype), adv.to(dtype)
    gspo, gspo_grad = run(lp, olp, adv, mask, level="sequence")
    token_adv = adv if adv_form == "B" else adv[:, None].expand_as(lp).clone()
    tok, tok_grad = run(lp, olp, token_adv, mask, level="sequence_token")
    assert 0 < gspo.metrics["clip_fraction"] < 1  # both clipped and unclipped responses
    rtol = 1e-12 if dtype == F64 else 1e-5
    assert tok.loss.item() == pytest.approx(gspo.loss.item(), rel=rtol, abs=1e-7)
    for key in CLIP_KEYS:
        assert tok.metrics[key] == pytest.approx(gspo.metrics[key], rel=1e-6), key
    for key in RATIO_KEYS:
        assert tok.metrics[key] == pytest.approx(gspo.metrics[key], rel=rtol), key
    torch.testing.assert_close(tok_grad, gspo_grad, rtol=rtol, atol=1e-7)


def test_gspo_token_passes_no_gradient_where_gspos_clamp_holds_the_ratio():
    """Rows whose mean log-ratio is past the clamp (+-20), or -inf from one token's
    log-prob: GSPO's gradient there is 0, and GSPO-token's is too (before: an e^20-scaled
    gradient, and NaN from the -inf token)."""
    inf = float("inf")
    lp = torch.tensor([[1e4, 0.0], [-1e4, 0.0], [-inf, -1.0], [-0.5, -1.0]], dtype=F64)
    olp = torch.tensor([[0.0, 0.0], [0.0, 0.0], [-2.0, -1.0], [-0.4, -1.0]], dtype=F64)
    adv, mask = torch.tensor([-1.0, 1.0, 1.0, 1.0], dtype=F64), torch.ones(4, 2, dtype=torch.bool)
    gspo, gspo_grad = run(lp, olp, adv, mask, level="sequence")
    tok, tok_grad = run(lp, olp, adv, mask, level="sequence_token")
    assert torch.isfinite(tok.loss) and tok.loss.item() == pytest.approx(gspo.loss.item())
    assert (gspo_grad[:3] == 0).all() and (gspo_grad[3] != 0).all()
    torch.testing.assert_close(tok_grad, gspo_grad, rtol=1e-12, atol=0)


def test_sequence_level_rejects_token_advantages():
    """level='sequence' takes one advantage per response: [B, T] advantages raise."""
    lp, olp, adv, mask = make_batch(3, 4, "sequence", 0)
    with pytest.raises(ValueError, match="sequence_token"):
        policy_loss(lp, olp, adv[:, None].expand(3, 4), mask, level="sequence")


def test_sequence_token_ratio_value_and_gradient():
    """s_{i,t} = sg[s_i] * exp(lp_{i,t} - sg[lp_{i,t}]): its value is s_i at every counted
    token and d s_{i,t} / d lp_{j,u} = s_i when (j, u) = (i, t), else 0."""
    lp, olp, _, mask = make_batch(4, 6, "sequence_token", 0)
    x = lp.clone().requires_grad_(True)
    s_tok = sequence_token_ratio(x, olp, mask)
    s_ref = []
    for i in range(4):
        deltas = [(lp[i, t] - olp[i, t]).item() for t in range(6) if mask[i, t]]
        s_ref.append(math.exp(sum(deltas) / len(deltas)) if deltas else 1.0)
    for i in range(4):
        for t in range(6):
            if mask[i, t]:
                assert s_tok[i, t].item() == pytest.approx(s_ref[i], rel=1e-12)
    weights = torch.randn(4, 6, dtype=F64, generator=torch.Generator().manual_seed(3))
    (s_tok * weights * mask).sum().backward()
    want = torch.tensor(s_ref, dtype=F64)[:, None] * weights * mask
    torch.testing.assert_close(x.grad, want, rtol=1e-12, atol=1e-15)


def test_gspo_token_per_token_advantages_gradient_formula():
    """With per-token A_{i,t}, each counted token gets d loss / d lp_{i,t} =
    -(1/|y_i|) s_i A_{i,t} / n_valid when unclipped and 0 when clipped, and the clipped set
    is decided token by token from s_i and the sign of A_{i,t}."""
    lp, olp, adv, mask = make_batch(6, 8, "sequence_token", 1, token_adv=True)
    _, grad = run(lp, olp, adv, mask, level="sequence_token")
    valid = mask.any(dim=1)
    n_valid = valid.sum().item()
    eps_low, eps_high = DEFAULT_CLIP["sequence_token"]
    n_clipped = n_free = 0
    for i in range(6):
        if not valid[i]:
            assert (grad[i] == 0).all()
            continue
        n = mask[i].sum().item()
        s = math.exp((lp[i] - olp[i])[mask[i]].sum().item() / n)
        for t in range(8):
            a = adv[i, t].item()
            clipped = (s > 1 + eps_high and a > 0) or (s < 1 - eps_low and a < 0)
            if not mask[i, t]:
                assert grad[i, t] == 0
            elif clipped:
                n_clipped += 1
                assert grad[i, t] == 0
            else:
                n_free += 1
                assert grad[i, t].item() == pytest.approx(-s * a / (n * n_valid), rel=1e-10)
    assert n_clipped > 0
    assert n_free > 0
    # Within one response some tokens are clipped and others are not.
    row_fractions = [(grad[i][mask[i]] == 0).double().mean().item() for i in range(6) if valid[i]]
    assert any(0 < f < 1 for f in row_fractions)


# ---------------------------------------------------------------------------------------
# Worked example and length normalisation
# ---------------------------------------------------------------------------------------


def _worked_example():
    olp = torch.full((1, 512), -1.0, dtype=F64)
    lp = olp.clone()
    lp[0, 100] += math.log(1.9)
    lp[0, 400] += math.log(0.4)
    return lp, olp, torch.ones(1, 512, dtype=torch.bool)


def test_worked_example_sequence_ratio():
    """510 tokens at ratio 1 and two at 1.9 and 0.4: s = exp((ln 1.9 + ln 0.4) / 512)
    ~ 0.9995, inside a 1 +- 0.2 band."""
    lp, olp, mask = _worked_example()
    s = math.exp((math.log(1.9) + math.log(0.4)) / 512)
    assert s == pytest.approx(0.99946, abs=1e-5)
    assert sequence_ratio(lp, olp, mask).item() == pytest.approx(s, abs=1e-6)
    assert sequence_ratio(lp.float(), olp.float(), mask).item() == pytest.approx(s, abs=1e-6)
    for level in ("sequence", "sequence_token"):
        out = policy_loss(lp, olp, torch.ones(1, dtype=F64), mask, level=level)
        assert out.metrics["ratio_mean"] == pytest.approx(s, abs=1e-6)
        out = policy_loss(lp, olp, torch.ones(1, dtype=F64), mask, level=level, clip_low=0.2)
        assert out.metrics["clip_fraction"] == 0.0  # inside 1 +- 0.2 for either sign of A
        out = policy_loss(
            lp, olp, -torch.ones(1, dtype=F64), mask, level=level, clip_low=0.2, clip_high=0.2
        )
        assert out.metrics["clip_fraction"] == 0.0
    assert 0.8 < s < 1.2


def test_worked_example_token_level_clips_the_two_outliers():
    """GRPO sees the two tokens at 1.9 and 0.4 outside [0.8, 1.27]: with A > 0 the 1.9
    token is clipped, with A < 0 the 0.4 token is; the others are not."""
    lp, olp, mask = _worked_example()
    out, grad = run(lp, olp, torch.ones(1, dtype=F64), mask, level="token")
    assert out.metrics["ratio_max"] == pytest.approx(1.9, rel=1e-12)
    assert out.metrics["ratio_min"] == pytest.approx(0.4, rel=1e-12)
    assert out.metrics["clip_fraction_high"] == pytest.approx(1 / 512)
    assert out.metrics["clip_fraction_low"] == 0.0
    assert (grad[0] == 0).nonzero().flatten().tolist() == [100]
    out, grad = run(lp, olp, -torch.ones(1, dtype=F64), mask, level="token")
    assert out.metrics["clip_fraction_low"] == pytest.approx(1 / 512)
    assert out.metrics["clip_fraction_high"] == 0.0
    assert (grad[0] == 0).nonzero().flatten().tolist() == [400]


@pytest.mark.parametrize("total", [0.01, -0.01, 3e-4, -2e-4])
def test_appending_neutral_tokens_shrinks_log_ratio(total):
    """log s_i = (1/|y_i|) sum_t log w_{i,t}: appending tokens with zero log-ratio scales
    |log s_i| as 1/|y_i| toward 0 without changing its sign, so a response can leave the
    clip band only toward its inside and is never pushed past the band."""
    base = torch.tensor([0.5 * total, 2.0 * total, -1.0 * total, -0.5 * total], dtype=F64)
    previous = math.inf
    clipped_history = {1.0: [], -1.0: []}
    for extra in range(0, 200, 7):
        deltas = torch.cat([base, torch.zeros(extra, dtype=F64)])[None]
        olp = torch.full_like(deltas, -2.0)
        mask = torch.ones_like(deltas, dtype=torch.bool)
        log_s = sequence_log_ratio(olp + deltas, olp, mask).item()
        n = 4 + extra
        assert log_s == pytest.approx(total / n, rel=1e-9)
        assert math.copysign(1.0, log_s) == math.copysign(1.0, total)
        assert abs(log_s) < previous
        previous = abs(log_s)
        for sign in (1.0, -1.0):
            out = policy_loss(olp + deltas, olp, torch.tensor([sign], dtype=F64), mask)
            clipped_history[sign].append(out.metrics["clip_fraction"])
    for history in clipped_history.values():
        # Once inside the band, a response stays inside: clipping only switches off.
        assert all(a >= b for a, b in itertools.pairwise(history))
        assert history[-1] == 0.0
    if abs(total) > 1e-3:
        assert max(clipped_history[math.copysign(1.0, total)]) == 1.0  # started clipped
    else:
        assert max(max(h) for h in clipped_history.values()) == 0.0  # never clipped


@pytest.mark.parametrize("w", [1.5, 1.2, 0.5, 0.8])
def test_token_clipping_does_not_bound_the_sequence_product(w):
    """Token ratios each clipped to [0.8, 1.2] still allow the product over 1,000 tokens
    to range over [0.8^1000, 1.2^1000]; GSPO's s_i stays within the token ratios' range."""
    n = 1000
    token_log_ratios = torch.full((1, n), math.log(w), dtype=F64)
    clipped = token_log_ratios.exp().clamp(0.8, 1.2)
    log_product = clipped.log().sum().item()
    if w >= 1.2:
        assert log_product == pytest.approx(n * math.log(1.2))
        assert log_product > math.log(1e79)  # 1.2^1000 ~ 1.5e79
    else:
        assert log_product == pytest.approx(n * math.log(0.8))
        assert log_product < math.log(1e-96)  # 0.8^1000 ~ 1.2e-97
    olp = torch.full((1, n), -1.0, dtype=F64)
    s = sequence_ratio(olp + token_log_ratios, olp, torch.ones(1, n, dtype=torch.bool)).item()
    assert s == pytest.approx(w, rel=1e-9)


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 1000),
    seed=st.integers(0, 2**31 - 1),
    lo=st.floats(0.05, 1.0),
    hi=st.floats(1.0, 20.0),
)
def test_sequence_ratio_bounded_by_token_extremes(n, seed, lo, hi):
    """s_i is the geometric mean of the token ratios: min_t w_{i,t} <= s_i <= max_t w_{i,t},
    for any length, so a per-token band bounds s_i directly."""
    g = torch.Generator().manual_seed(seed)
    w = lo + (hi - lo) * torch.rand(1, n, generator=g, dtype=F64)
    olp = -3 * torch.rand(1, n, generator=g, dtype=F64)
    s = sequence_ratio(olp + w.log(), olp, torch.ones(1, n, dtype=torch.bool)).item()
    assert w.min().item() * (1 - 1e-12) <= s <= w.max().item() * (1 + 1e-12)


# ---------------------------------------------------------------------------------------
# Masking: empty rows and garbage in masked positions
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("level", LEVELS)
def test_empty_rows_contribute_nothing(level):
    """Rows with an all-zero mask leave the loss, the metrics and the other rows' gradients
    as they are without them, and receive zero gradient."""
    lp, olp, adv, mask = make_batch(5, 9, level, 0, empty_row=False)
    ref = olp + 0.1
    kwargs = {"level": level, "ref_logprobs": ref, "kl_coef": 0.1}
    base, base_grad = run(lp, olp, adv, mask, **kwargs)
    rows = [0, 3, 6]  # where the empty rows go in the bigger batch
    keep = [i for i in range(8) if i not in rows]

    def grow(x, fill):
        big = torch.full((8, *x.shape[1:]), fill, dtype=x.dtype)
        big[keep] = x
        return big

    big_mask = grow(mask, False)
    kwargs["ref_logprobs"] = grow(ref, -9.0)
    out, grad = run(grow(lp, -7.0), grow(olp, 3.0), grow(adv, 5.0), big_mask, **kwargs)
    assert out.loss.item() == pytest.approx(base.loss.item(), rel=1e-12)
    for key, value in base.metrics.items():
        assert out.metrics[key] == pytest.approx(value, rel=1e-9), key
    torch.testing.assert_close(grad[keep], base_grad, rtol=1e-12, atol=1e-15)
    assert (grad[rows] == 0).all()


@pytest.mark.parametrize(
    ("level", "adv_form"),
    [
        ("sequence", "B"),
        ("sequence_token", "B"),
        ("sequence_token", "BT"),
        ("token", "B"),
        ("token", "BT"),
    ],
)
def test_all_rows_empty(level, adv_form):
    """A batch where every row is empty gives a finite (zero) loss and a zero gradient."""
    lp = torch.randn(3, 4, dtype=F64)
    adv = torch.ones(3, dtype=F64) if adv_form == "B" else torch.ones(3, 4, dtype=F64)
    mask = torch.zeros(3, 4, dtype=torch.bool)
    out, grad = run(lp, lp - 1.0, adv, mask, level=level, ref_logprobs=lp + 1.0, kl_coef=0.5)
    assert torch.isfinite(out.loss)
    assert out.loss.item() == 0.0
    assert grad is not None
    assert (grad == 0).all()
    assert out.metrics["clip_fraction"] == 0.0
    assert out.metrics["sequences"] == 0.0


@pytest.mark.parametrize("level", LEVELS)
def test_the_loss_and_its_metrics_read_nothing_back_from_the_device(level):
    """policy_loss computes its metrics as 0-dim tensors (``values``) without an op that
    would wait for a GPU (``.item()``, a boolean selection): the trainer reads them once,
    after the backward is queued. ``metrics`` are the floats ``.item()`` gives, exactly."""
    from torch.utils._python_dispatch import TorchDispatchMode

    waits = {"_local_scalar_dense", "nonzero", "masked_select", "item", "is_nonzero"}

    class NoWaits(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            assert func._overloadpacket.__name__ not in waits, func
            return func(*args, **(kwargs or {}))

    lp, olp, adv, mask = make_batch(6, 9, level, 3, token_adv=level != "sequence")
    mask[2] = False  # a row with nothing counted (besides make_batch's own)
    with NoWaits():
        out = policy_loss(lp, olp, adv, mask, level=level, ref_logprobs=olp - 0.1)
    assert all(v.dim() == 0 for v in out.values.values())
    assert out.metrics == {k: v.item() for k, v in out.values.items()}
    assert out.metrics["sequences"] == mask.any(-1).sum().item() < 6
    assert out.metrics["tokens"] == mask.sum().item()
    clipped = out.metrics["clip_fraction"] * out.metrics["tokens"]
    assert clipped == pytest.approx(round(clipped), abs=1e-9)  # a count over a count
    none = policy_loss(lp, olp, adv, torch.zeros_like(mask), level=level)
    assert all(math.isnan(none.metrics[k]) for k in RATIO_KEYS)
    no_columns = policy_loss(  # (a minibatch of empty completions, trimmed to width 0)
        lp[:, :0], olp[:, :0], adv if adv.dim() == 1 else adv[:, :0], mask[:, :0], level=level
    )
    assert all(math.isnan(no_columns.metrics[k]) for k in RATIO_KEYS)
    assert no_columns.metrics["tokens"] == 0.0


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("garbage", [-math.inf, math.inf, math.nan])
def test_garbage_in_masked_positions(level, garbage):
    """Masked positions may hold -inf, inf or NaN in logprobs, old_logprobs and
    ref_logprobs: loss, metrics and gradient are those of the clean batch, with no NaN."""
    token_adv = level != "sequence"
    lp, olp, adv, mask = make_batch(6, 11, level, 1, token_adv=token_adv)
    ref = olp - 0.2
    kwargs = {"level": level, "ref_logprobs": ref, "kl_coef": 0.1}
    clean, clean_grad = run(lp, olp, adv, mask, **kwargs)

    def dirty(x):
        return torch.where(mask, x, torch.full_like(x, garbage))

    kwargs["ref_logprobs"] = dirty(ref)
    out, grad = run(dirty(lp), dirty(olp), adv, mask, **kwargs)
    assert torch.isfinite(out.loss)
    assert torch.isfinite(grad).all()
    assert all(math.isfinite(v) for v in out.metrics.values())
    assert out.loss.item() == pytest.approx(clean.loss.item(), rel=1e-12)
    for key, value in clean.metrics.items():
        assert out.metrics[key] == pytest.approx(value, rel=1e-12), key
    torch.testing.assert_close(grad, clean_grad, rtol=1e-12, atol=1e-15)
    assert (grad[~mask] == 0).all()


# ---------------------------------------------------------------------------------------
# Precision and extreme inputs
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("level", LEVELS)
def test_half_precision_inputs(level, half):
    """bf16 / fp16 log-probs are accumulated in float32: the loss is finite and float32,
    equal to the float32 computation on the same rounded inputs, and the gradient matches
    it to the half dtype's rounding."""
    lp, olp, adv, mask = make_batch(8, 33, level, 0)
    lp_h, olp_h = lp.to(half), olp.to(half)
    out_h, grad_h = run(lp_h, olp_h, adv.float(), mask, level=level)
    out_f, grad_f = run(lp_h.float(), olp_h.float(), adv.float(), mask, level=level)
    assert out_h.loss.dtype == torch.float32
    assert torch.isfinite(out_h.loss)
    assert grad_h.dtype == half
    assert torch.isfinite(grad_h).all()
    assert out_h.loss.item() == pytest.approx(out_f.loss.item(), rel=1e-6, abs=1e-7)
    assert out_h.metrics["clip_fraction"] == out_f.metrics["clip_fraction"]
    assert grad_f.abs().max() > 0
    torch.testing.assert_close(grad_h.float(), grad_f, rtol=1e-2, atol=1e-5)


@pytest.mark.parametrize("level", LEVELS)
def test_extreme_drift_is_finite(level):
    """No input gives inf or NaN: 32,768-token responses drifting by +-50 per token (all
    up, all down, alternating), and single tokens at +-1e4, with A of either sign."""
    t_len = 32_768
    olp = torch.full((6, t_len), -60.0)
    drift = torch.zeros(6, t_len)
    drift[0] = 50.0
    drift[1] = -50.0
    drift[2] = torch.where(torch.arange(t_len) % 2 == 0, 50.0, -50.0)
    drift[3, 0] = 1e4
    drift[4, 0] = -1e4
    drift[5] = 50.0 * torch.randn(t_len, generator=torch.Generator().manual_seed(0))
    mask = torch.ones(6, t_len, dtype=torch.bool)
    mask[3:5, 1:] = False
    lp = olp + drift
    for sign in (1.0, -1.0):
        adv = sign * torch.tensor([1.0, 1.0, -1.0, 1.0, -1.0, 0.5])
        for kwargs in ({}, {"ref_logprobs": olp, "kl_coef": 0.1}):
            out, grad = run(lp, olp, adv, mask, level=level, **kwargs)
            assert torch.isfinite(out.loss), kwargs
            assert torch.isfinite(grad).all(), kwargs
            assert all(math.isfinite(v) for v in out.metrics.values())
            assert out.metrics["ratio_max"] <= math.exp(MAX_LOG_RATIO) * (1 + 1e-6)


# ---------------------------------------------------------------------------------------
# Properties
# ---------------------------------------------------------------------------------------


@st.composite
def batches(draw):
    level = draw(st.sampled_from(LEVELS))
    b = draw(st.integers(1, 6))
    t_len = draw(st.integers(1, 12))
    seed = draw(st.integers(0, 2**31 - 1))
    token_adv = level != "sequence" and draw(st.booleans())
    lp, olp, adv, mask = make_batch(b, t_len, level, seed, token_adv=token_adv)
    return level, lp, olp, adv, mask


@settings(max_examples=50, deadline=None)
@given(batch=batches(), data=st.data())
def test_permuting_responses_leaves_loss_unchanged(batch, data):
    """The loss is a mean over responses: reordering them changes neither the loss nor
    (up to the same reordering) the gradient."""
    level, lp, olp, adv, mask = batch
    perm = torch.tensor(data.draw(st.permutations(range(lp.shape[0]))))
    out, grad = run(lp, olp, adv, mask, level=level)
    out_p, grad_p = run(lp[perm], olp[perm], adv[perm], mask[perm], level=level)
    assert out_p.loss.item() == pytest.approx(out.loss.item(), rel=1e-12, abs=1e-14)
    torch.testing.assert_close(grad_p, grad[perm], rtol=1e-12, atol=1e-15)
    for key in (*CLIP_KEYS, *RATIO_KEYS):
        assert out_p.metrics[key] == pytest.approx(out.metrics[key], rel=1e-6), key


@settings(max_examples=50, deadline=None)
@given(batch=batches(), c=st.floats(1e-2, 1e2))
def test_scaling_advantages_scales_loss_and_gradient(batch, c):
    """Clipping depends only on the sign of A, so A -> c A (c > 0) scales the loss and the
    gradient by c and leaves the clipped set unchanged."""
    level, lp, olp, adv, mask = batch
    out, grad = run(lp, olp, adv, mask, level=level)
    out_c, grad_c = run(lp, olp, c * adv, mask, level=level)
    assert out_c.loss.item() == pytest.approx(c * out.loss.item(), rel=1e-10, abs=1e-13 * c)
    torch.testing.assert_close(grad_c, c * grad, rtol=1e-10, atol=1e-13 * c)
    for key in CLIP_KEYS:
        assert out_c.metrics[key] == out.metrics[key], key


# ---------------------------------------------------------------------------------------
# Rollout correction: the weights c_{i,t} and kept tokens of Eq. (11)
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize(
    ("level", "token_adv"),
    [("sequence", False), ("sequence_token", False), ("sequence_token", True), ("token", False)],
)
@pytest.mark.parametrize("weight_shape", ["token", "response"])
def test_weights_match_reference(level, token_adv, weight_shape, dtype):
    """c_{i,t} multiplies each token's clipped term (for GSPO the response's term, so
    J_i = mean_t c_{i,t} * min(s_i A_i, clip(s_i) A_i)); loss, gradient and metrics equal
    the float64 reference at every level, with [B, T] or [B] weights."""
    rtol, atol = (1e-10, 1e-12) if dtype == torch.float64 else (2e-5, 1e-6)
    for seed in (0, 1):
        lp, olp, adv, mask = make_batch(8, 17, level, seed, token_adv=token_adv)
        g = torch.Generator().manual_seed(50 + seed)
        shape = mask.shape if weight_shape == "token" else mask.shape[:1]
        weights = 2.0 * torch.rand(shape, generator=g, dtype=F64)
        full = weights if weights.dim() == 2 else weights[:, None].expand(mask.shape)
        low, high = DEFAULT_CLIP[level]
        want = reference(lp, olp, adv, mask, level=level, eps_low=low, eps_high=high, weights=full)
        unweighted = reference(lp, olp, adv, mask, level=level, eps_low=low, eps_high=high)
        assert abs(want["loss"] - unweighted["loss"]) > 1e-3  # the weights move the loss
        lp, olp, adv = lp.to(dtype), olp.to(dtype), adv.to(dtype)
        out, grad = run(lp, olp, adv, mask, level=level, weights=weights.to(dtype))
        assert_matches_reference(out, grad, want, rtol=rtol, atol=atol)


@pytest.mark.parametrize("level", LEVELS)
def test_unit_weights_change_nothing_and_garbage_outside_mask_is_ignored(level):
    """weights = 1 gives exactly the unweighted loss and gradient; NaN/inf weights at
    masked positions change nothing and give no NaN gradient."""
    lp, olp, adv, mask = make_batch(8, 9, level, 3)
    base, base_grad = run(lp, olp, adv, mask, level=level)
    weights = torch.ones(mask.shape, dtype=F64)
    weights[~mask] = float("nan")
    weights[~mask & (torch.arange(9) % 2 == 0)] = float("inf")
    out, grad = run(lp, olp, adv, mask, level=level, weights=weights)
    assert out.loss.item() == base.loss.item()
    assert torch.equal(grad, base_grad)


def test_bad_weight_shape_raises():
    lp, olp, adv, mask = make_batch(3, 4, "token", 0)
    with pytest.raises(ValueError, match="weights"):
        policy_loss(lp, olp, adv, mask, level="token", weights=torch.ones(3, 5, dtype=F64))


def _mismatched(b=6, t_len=40, seed=0, sd=0.3):
    """pi_old (trainer) and sampler log-probs differing by noise of sd ``sd`` per token."""
    g = torch.Generator().manual_seed(seed)
    old = -3.0 * torch.rand(b, t_len, generator=g, dtype=F64)
    sampler = old + sd * torch.randn(b, t_len, generator=g, dtype=F64)
    mask = torch.rand(b, t_len, generator=g) < 0.8
    mask[:, 0] = True
    mask[1] = False  # an empty response
    return old, sampler, mask


def test_correction_defaults_are_the_literature_values():
    assert CORRECTIONS == ("none", "token_tis", "token_mask", "sequence_mask")
    assert DEFAULT_CORRECTION_BOUNDS == {
        "token_tis": (0.0, 2.0),
        "token_mask": (0.5, 5.0),
        "sequence_mask": (0.999, 1.001),
    }


@pytest.mark.parametrize("mode", ["token_tis", "token_mask", "sequence_mask", "none"])
def test_rollout_correction_matches_definition(mode):
    """Weights, kept tokens and metrics equal Eq. (11) written out token by token."""
    old, sampler, mask = _mismatched(sd=0.8)
    low, high = {"token_tis": (0.0, 1.5), "token_mask": (0.6, 1.6)}.get(mode, (0.9, 1.1))
    out = rollout_correction(old, sampler, mask, mode, low=low, high=high)
    b, t_len = mask.shape
    n_tok = n_drop = rows = rows_drop = 0
    shown = []
    for i in range(b):
        idx = [t for t in range(t_len) if mask[i, t]]
        if not idx:
            assert not out.keep[i].any()
            continue
        rows += 1
        rho = {t: math.exp(old[i, t].item() - sampler[i, t].item()) for t in idx}
        geo = math.exp(sum(math.log(r) for r in rho.values()) / len(idx))
        row_drop = 0
        for t in idx:
            n_tok += 1
            if mode == "token_tis":
                want_w, want_keep = min(rho[t], high), True
                shown.append(want_w)
            elif mode == "token_mask":
                want_w, want_keep = 1.0, low <= rho[t] <= high
                shown.append(rho[t])
            else:
                want_w = 1.0
                want_keep = mode == "none" or low <= geo <= high
            assert out.weights[i, t].item() == pytest.approx(want_w, rel=1e-12)
            assert bool(out.keep[i, t]) == want_keep
            row_drop += int(not want_keep)
        if mode in ("sequence_mask", "none"):
            shown.append(geo)
        n_drop += row_drop
        rows_drop += int(row_drop > 0)
        assert not out.keep[i][~mask[i]].any()
    m = out.metrics
    assert m["masked_token_fraction"] == pytest.approx(n_drop / n_tok, rel=1e-12)
    assert m["masked_sequence_fraction"] == pytest.approx(rows_drop / rows, rel=1e-12)
    assert m["weight_mean"] == pytest.approx(sum(shown) / len(shown), rel=1e-10)
    assert m["weight_min"] == pytest.approx(min(shown), rel=1e-10)
    assert m["weight_max"] == pytest.approx(max(shown), rel=1e-10)
    if mode != "none":
        assert 0.0 < m["masked_token_fraction"] < 1.0 or mode == "token_tis"
    if mode == "token_tis":
        assert m["weight_max"] == pytest.approx(high) and m["masked_token_fraction"] == 0.0


def test_no_mismatch_means_no_correction():
    """Sampler == trainer: every weight is 1 and every counted token is kept."""
    old, _, mask = _mismatched()
    for mode in CORRECTIONS:
        out = rollout_correction(old, old.clone(), mask, mode)
        assert torch.equal(out.keep, mask)
        assert torch.all(out.weights == 1.0)
        assert out.metrics["masked_token_fraction"] == 0.0


def test_geometric_mean_survives_length_where_product_collapses():
    """The product of token weights drifts away from 1 like exp(sqrt(L) * sd) as L grows;
    the geometric mean tightens toward 1 (docs/algorithm.md, "Rollout correction")."""
    spread = {}
    for t_len in (16, 4096):
        old, sampler, _ = _mismatched(b=64, t_len=t_len, seed=1, sd=0.1)
        mask = torch.ones(old.shape, dtype=torch.bool)
        log_rho = old - sampler
        product = log_rho.sum(-1).exp()
        out = rollout_correction(old, sampler, mask, "sequence_mask", low=0.98, high=1.02)
        spread[t_len] = (
            ((product < 0.5) | (product > 2.0)).float().mean().item(),
            out.metrics["masked_sequence_fraction"],
        )
    product_short, geo_short = spread[16]
    product_long, geo_long = spread[4096]
    assert product_long > 0.8 > product_short  # the product leaves [0.5, 2] on long responses
    assert geo_long < geo_short  # the geometric mean is kept more often the longer it is


def test_the_geometric_mean_weight_clamps_after_the_mean():
    """Each token's log-ratio was clamped to +-20 before the mean: one token at -50 among
    ten gave e^-2 (kept by [0.1, 1.5]) where the definition's mean is e^-5 (dropped). The
    clamp comes after the mean, as for GSPO's s_i; the token weights keep theirs."""
    sampler = torch.zeros((1, 10), dtype=torch.float64)
    old = sampler.clone()
    old[0, 3] = -50.0
    mask = torch.ones((1, 10), dtype=torch.bool)
    out = rollout_correction(old, sampler, mask, "sequence_mask", low=0.1, high=1.5)
    assert out.metrics["weight_mean"] == pytest.approx(math.exp(-5.0), rel=1e-12)
    assert not out.keep.any() and out.metrics["masked_sequence_fraction"] == 1.0
    out = rollout_correction(old, sampler, mask, "token_mask", low=1e-12, high=2.0)
    assert out.metrics["weight_min"] == pytest.approx(math.exp(-20.0), rel=1e-12)
    old[0, 3] = -500.0  # past the clamp after the mean too: e^-20, not 0 or NaN
    out = rollout_correction(old, sampler, mask, "sequence_mask")
    assert out.metrics["weight_mean"] == pytest.approx(math.exp(-20.0), rel=1e-12)


def test_rollout_correction_bad_input():
    old, sampler, mask = _mismatched()
    with pytest.raises(ValueError, match="mode must be one of"):
        rollout_correction(old, sampler, mask, "tis")
    with pytest.raises(ValueError, match="share one"):
        rollout_correction(old, sampler[:, :3], mask, "token_tis")


def test_correction_leaves_dropped_responses_out_of_the_loss():
    """A response dropped by sequence_mask leaves the mean over responses entirely: the
    loss equals the loss of the batch without it."""
    level = "token"
    lp, olp, adv, mask = make_batch(8, 9, level, 0, empty_row=False)
    sampler = olp.clone()
    sampler[2] += 0.5  # response 2 sampled under a very different policy
    corr = rollout_correction(olp, sampler, mask, "sequence_mask")
    assert corr.metrics["masked_sequence_fraction"] == pytest.approx(1 / 8)
    out, _ = run(lp, olp, adv, corr.keep, level=level, weights=corr.weights)
    rest = [i for i in range(8) if i != 2]
    want, _ = run(lp[rest], olp[rest], adv[rest], mask[rest], level=level)
    assert out.loss.item() == pytest.approx(want.loss.item(), rel=1e-12)


@pytest.mark.parametrize("level", LEVELS)
def test_entropy_bonus_matches_reference(level):
    """metrics['entropy'] = mean over responses of the token-mean entropy (counted tokens
    only); entropy_coef subtracts coef * that from the loss, whose gradient with respect
    to each counted H_{i,t} is -coef / (|y_i| * |V|)."""
    lp, olp, adv, mask = make_batch(8, 9, level, 0)
    g = torch.Generator().manual_seed(7)
    h = torch.rand(mask.shape, generator=g, dtype=F64) * 3.0
    h[~mask] = float("nan")  # masked positions may hold anything
    base, base_grad = run(lp, olp, adv, mask, level=level)
    rows = [i for i in range(8) if mask[i].any()]
    want = sum(h[i][mask[i]].mean().item() for i in rows) / len(rows)
    for coef in (0.0, 0.01, 0.5):
        x = h.clone().requires_grad_(True)
        out, grad = run(lp, olp, adv, mask, level=level, entropy=x, entropy_coef=coef)
        assert out.metrics["entropy"] == pytest.approx(want, rel=1e-12)
        assert out.loss.item() == pytest.approx(base.loss.item() - coef * want, rel=1e-12)
        assert torch.equal(grad, base_grad)  # the bonus does not touch d loss / d logprobs
        if coef:
            lengths = mask.sum(-1, keepdim=True).clamp(min=1).double()
            expected = torch.where(mask, -coef / (lengths * len(rows)), 0.0)
            torch.testing.assert_close(x.grad, expected, rtol=1e-12, atol=0.0)
    with pytest.raises(ValueError, match="entropy_coef"):
        policy_loss(lp, olp, adv, mask, level=level, entropy_coef=0.1)
    with pytest.raises(ValueError, match="entropy has no gradient"):  # a metric's entropy
        policy_loss(lp.requires_grad_(), olp, adv, mask, level=level, entropy=h, entropy_coef=0.1)


def test_a_negative_clip_range_is_refused():
    lp = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=r"clip_low and clip_high must be >= 0; got -1.0"):
        policy_loss(lp, lp, torch.ones(2), torch.ones(2, 3, dtype=torch.bool), clip_low=-1.0)


def test_k3_keeps_its_value_at_the_small_log_ratios_it_is_measured_at():
    """exp(d) - d - 1 in float32 lost the value to rounding at |d| ~ 1e-4 (0, or below 0,
    which k3 never is: mismatch/k3_kl was logged at -2e-8); expm1(d) - d keeps it."""
    d = torch.tensor([[1e-3, -2e-4, 3e-5, -1e-5, 0.0, 2.0]])
    got = k3_kl(torch.zeros_like(d), d, torch.ones_like(d, dtype=torch.bool))
    exact = torch.exp(d.double()) - d.double() - 1
    assert got.dtype == torch.float32 and (got >= 0).all()
    assert torch.allclose(got.double(), exact, rtol=1e-2, atol=0)  # exp(d) - d - 1: 5% to 100% off
