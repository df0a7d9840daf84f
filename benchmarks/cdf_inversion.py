"""The sampler's draw from a CDF: one float64 running sum over the whole vocabulary (what
``gspo.engines.sampling`` did) against two levels (blocks' sums, then the chosen block's
own CDF: :func:`gspo.engines.sampling.invert_cdf`), and the whole decoding step's sampling
(:func:`gspo.engines.sampling.sample_next`) around it.

    .venv/bin/python benchmarks/cdf_inversion.py [--device cuda] [--rows 64 128]

Vocabulary 151,936 (Qwen's), softmax of random logits, temperature 1, no top-p; the
variants interleaved, medians in ms (CUDA: synchronised around each run). Also checks that
both draw the same tokens for these rows.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "src"))

from levers import interleaved, table  # noqa: E402

from gspo.engines import sampling  # noqa: E402
from gspo.engines.batch import SamplingParams  # noqa: E402
from gspo.engines.sampling import invert_cdf, sample_next  # noqa: E402
from gspo.provenance import measured_at  # noqa: E402

VOCAB = 151_936


def one_level(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """The float64 CDF over the whole vocabulary, inverted (the draw before the blocks)."""
    cdf = probs.double().cumsum(-1)
    target = (uniforms.double() * cdf[:, -1]).unsqueeze(-1)
    tokens = torch.searchsorted(cdf, target, right=True).squeeze(-1)
    return tokens.clamp_(max=probs.shape[-1] - 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rows", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--reps", type=int, default=15)
    args = parser.parse_args()
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    print(measured_at(), flush=True)
    print(f"torch {torch.__version__}, {device}, {torch.get_num_threads()} threads")
    gen = torch.Generator(device).manual_seed(0)
    for rows in args.rows:
        logits = torch.randn(rows, VOCAB, generator=gen, device=device) * 3
        probs = torch.softmax(logits, dim=-1)
        uniforms = torch.rand(rows, generator=gen, device=device)
        same = torch.equal(one_level(probs, uniforms), invert_cdf(probs, uniforms))

        def timed(fn, *a):
            def run() -> None:
                fn(*a)
                sync()

            return run

        def step(inversion, logits=logits, uniforms=uniforms):  # ``inversion`` as its draw
            def run() -> None:
                sampling.invert_cdf = inversion
                try:
                    sample_next(logits, SamplingParams(temperature=1.0), uniforms=uniforms)
                finally:
                    sampling.invert_cdf = invert_cdf
                sync()

            return run

        table(
            f"{rows} rows x {VOCAB:,} tokens (the same tokens drawn: {same})",
            interleaved(
                {
                    "inversion, one float64 CDF": timed(one_level, probs, uniforms),
                    "inversion, two levels": timed(invert_cdf, probs, uniforms),
                    "sample_next with one float64 CDF": step(one_level),
                    "sample_next with two levels": step(invert_cdf),
                },
                args.reps,
            ),
        )


if __name__ == "__main__":
    main()
