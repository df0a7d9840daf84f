"""A run's prompts as token ids, by the kind of generator: single turns encode them through
the chat template here; episodes (:class:`gspo.training.episodes.MultiTurn`) render theirs
themselves. Also what a prompt's length means for length-dependent RoPE, and the cold
start's encoder, which lays out a conversation as an episode would."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch

from gspo.chat import encode_prompt
from gspo.config import Config
from gspo.models import length_dependent_rope, model_context
from gspo.plugins import Rows, numbered
from gspo.tasks import TaskData
from gspo.training.cold_start import single_turn_encoder
from gspo.training.episodes import MultiTurn, TurnFormat, encode_conversation
from gspo.training.sampler import MODEL_CONTEXT, SingleTurn, rollout_context, said_context


def encode_prompts(
    config: Config,
    generate: SingleTurn | MultiTurn,
    tokenizer,
    rows: list[dict[str, Any]],
    *,
    name: str,
    context: int | None = None,
    learned_positions: bool = False,
    context_key: str = MODEL_CONTEXT,
    say: bool = True,
) -> list[list[int]]:
    """The rows' prompts as token ids for single turns; episodes render their prompts
    themselves (tools, reset observations), so theirs are empty.

    A prompt that is not text or messages, that encodes to no token (an empty string, a
    message without content) or to more than ``context`` positions (the setting
    ``context_key``: :func:`gspo.training.sampler.rollout_context`) is a one-line error
    naming ``name`` (``data.train``, ``data.eval``) and the row. Prompts leaving fewer
    than ``rollout.max_new_tokens`` positions are a warning line, or an error for a model
    with ``learned_positions`` (:func:`gspo.models.model_context`), whose lookup fails
    past its context. ``say``: print the warnings (every torchrun rank reads the same
    rows: rank 0 says them).
    """
    whose = said_context(context, context_key)
    if not isinstance(generate, SingleTurn):
        return [[] for _ in rows]
    chat = config.data.chat_template_kwargs
    encoded = []
    for i, row in enumerate(rows, start=1):
        try:
            ids = encode_prompt(row["prompt"], tokenizer, **chat)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{name} row {i}: {exc}") from exc
        if not ids:
            raise ValueError(
                f"{name} row {i}: the prompt is empty (0 tokens): {row['prompt']!r}"[:300]
            )
        if context is not None and len(ids) > context and not config.data.drop_long_prompts:
            raise ValueError(
                f"{name} row {i}: the prompt is {len(ids)} tokens, longer than {whose}"
            )
        encoded.append(ids)
    unknown = [i for i, ids in enumerate(encoded, start=1) if tokenizer.unk_token_id in ids]
    if tokenizer.unk_token_id is not None and unknown and say:  # (the built-in char tokenizer)
        print(f"gspo: warning: {name}: {len(unknown)} prompt(s) (row {unknown[0]} first) hold "
              f"text the tokenizer does not have, which it encodes as {tokenizer.unk_token}: "
              "the model never sees it", file=sys.stderr, flush=True)  # fmt: skip
    room = config.rollout.max_new_tokens
    over = [len(ids) for ids in encoded if context is not None and len(ids) + room > context]
    if over and not config.data.drop_long_prompts:  # (else task_prompt_ids drops them)
        said = (
            f"{name}: {len(over)} prompt(s) (the longest {max(over)} tokens) leave fewer "
            f"than rollout.max_new_tokens={room} positions of {whose}"
        )
        fix = "shorten them or lower rollout.max_new_tokens"
        if learned_positions and context_key == MODEL_CONTEXT:
            raise ValueError(f"{said}, whose positions are a learned table that no token may "
                             f"run past; {fix}")  # fmt: skip
        what = "may run past it" if context_key == MODEL_CONTEXT else "are cut there"
        if say:
            print(f"gspo: warning: {said}: their responses {what}; {fix}",
                  file=sys.stderr, flush=True)  # fmt: skip
    return encoded


def task_prompt_ids(
    config: Config,
    generate: SingleTurn | MultiTurn,
    tokenizer,
    module: torch.nn.Module,
    data: TaskData,
    *,
    say: bool = True,
) -> tuple[list[list[int]], list[list[int]]]:
    """``data.train``'s and ``data.eval``'s prompts as token ids (:func:`encode_prompts`),
    checked against the context the rollouts have on ``module``
    (:func:`gspo.training.sampler.rollout_context`)."""
    _, learned = model_context(module)
    context, context_key = rollout_context(config, module)
    train, held_out = (
        _kept(config, data, key, encode_prompts(
            config, generate, tokenizer, getattr(data, key),
            name=f"data.{key} ({config.data.source_of(f'data.{key}')})", context=context,
            learned_positions=learned, context_key=context_key, say=say,
        ), context=context, context_key=context_key, say=say)
        for key in ("train", "eval")
    )  # fmt: skip
    if say:  # (the trainer's forward sees the training rollouts only)
        # what bounds the rollouts: vLLM's max_model_len, an episode's end at the context;
        # a single turn may run past max_position_embeddings (a rotary model's is no wall)
        single = isinstance(generate, SingleTurn) and context_key == MODEL_CONTEXT
        warn_length_dependent_rope(config, generate, module, train, None if single else context)
    return train, held_out


def _kept(
    config: Config,
    data: TaskData,
    key: str,
    ids: list[list[int]],
    *,
    context: int | None,
    context_key: str,
    say: bool,
) -> list[list[int]]:
    """With ``data.drop_long_prompts``, ``data``'s ``key`` rows and their ``ids`` without
    the prompts that leave fewer than ``rollout.max_new_tokens`` positions of ``context``,
    said in one warning line; all of them dropped is an error. The rows left are
    :class:`gspo.plugins.Rows`, which keep their numbers in the file for the messages
    about them (the start's warnings, counted among these rows)."""
    rows, name = getattr(data, key), f"data.{key}"
    room = config.rollout.max_new_tokens
    if not config.data.drop_long_prompts or context is None or not rows:
        return ids
    keep = [i for i, one in enumerate(ids) if len(one) + room <= context]
    if len(keep) == len(rows):
        return ids
    first = next(i for i, one in enumerate(ids) if len(one) + room > context) + 1
    said = (f"{name} ({config.data.source_of(name)}): data.drop_long_prompts left out "
            f"{len(rows) - len(keep)} of {len(rows)} prompts (row {first} first), which leave "
            f"fewer than rollout.max_new_tokens={room} positions of "
            f"{said_context(context, context_key)}")  # fmt: skip
    if not keep:
        raise ValueError(f"{said}: none is left")
    if say:
        print(f"gspo: warning: {said}", file=sys.stderr, flush=True)
    numbers = [number for number, _ in numbered(rows)]
    rows[:] = [rows[i] for i in keep]  # (in place: and as Rows, numbered as in the file)
    setattr(data, key, Rows(rows, [numbers[i] for i in keep]))
    return [ids[i] for i in keep]


def warn_length_dependent_rope(
    config: Config,
    generate: SingleTurn | MultiTurn,
    module: torch.nn.Module,
    prompts: list[list[int]],
    context: int | None,
) -> None:
    """One warning line where the sampler's and the trainer's log-probs part because the
    model's rotary frequencies depend on the length (:func:`gspo.models.
    length_dependent_rope`): the trainer's forward takes one scaling for its whole packed
    batch (from its largest position, so one long sequence rescales those beside it).
    The torch engine's cached decode keeps each key at the scaling of the step that wrote
    it: they part where the rollouts (``context`` at most, where it bounds them: None
    where nothing does) pass the rescale length. vLLM
    takes longrope's long factors at every position when its ``max_model_len`` passes it:
    they part on the rollouts within it."""
    rope = length_dependent_rope(module)
    if rope is None:
        return
    kind, positions = rope
    r = config.rollout
    if r.engine == "vllm" and kind == "longrope":
        room = r.vllm.max_model_len or context
        if room is None or room > positions:
            print(f"gspo: warning: vLLM takes the long factors of the model's longrope at "
                  f"every position when its max_model_len ({room}) passes {positions}, where "
                  f"the trainer's forward takes the short ones for batches within {positions} "
                  "positions, so their log-probs part (mismatch/* says by how much); "
                  f"rollout.vllm.max_model_len={positions} keeps them together",
                  file=sys.stderr, flush=True)  # fmt: skip
        return
    if isinstance(generate, SingleTurn):
        longest = max(map(len, prompts), default=0)
        reach, parts = longest + r.max_new_tokens, f"prompt {longest} + rollout.max_new_tokens"
    else:
        reach = r.max_episode_tokens or r.max_turns * r.max_new_tokens
        parts = "an episode's tokens after its prompt, which adds more"
    reach = reach if context is None else min(reach, context)
    if reach > positions:
        print(f"gspo: warning: the model's rotary embedding ({kind}) rescales its frequencies "
              f"once a forward sees more than {positions} positions, and rollouts here reach "
              f"{reach} ({parts}): the sampler and the trainer's forward then scale them "
              "differently, so their log-probs part (mismatch/* says by how much); keep "
              f"sequences within {positions} positions", file=sys.stderr, flush=True)  # fmt: skip


def sft_encoder(
    config: Config, tokenizer, generator: SingleTurn | MultiTurn
) -> Callable[[dict[str, Any]], tuple[list[int], list[int], list[bool]]]:
    """How the cold start encodes a row: ``(prompt_ids, completion_ids, action_mask)``.

    A string completion is the model's tokens and the end of its turn
    (:func:`gspo.training.cold_start.single_turn_encoder`); a completion that is a list of
    messages is laid out as an episode (:func:`encode_conversation`), its non-assistant
    messages left out of the loss.
    """
    chat = config.data.chat_template_kwargs
    fmt = generator.format if isinstance(generator, MultiTurn) else None
    single = single_turn_encoder(config, tokenizer)

    def encode(row: dict[str, Any]) -> tuple[list[int], list[int], list[bool]]:
        nonlocal fmt
        completion = row["completion"]
        if not isinstance(completion, list):
            return single(row)
        fmt = fmt or TurnFormat(tokenizer, [], chat)
        return encode_conversation(fmt, row["prompt"], completion)

    return encode
