"""Multi-turn episodes: the model and an environment take turns, token-in/token-out.

:class:`MultiTurn` is the rollout stage's generator when ``rollout.environment`` is set
(:class:`gspo.training.sampler.SingleTurn` otherwise). All episodes of a batch advance
turn by turn through the same rollout engine (torch or vLLM): turn 0 samples ``G``
responses per prompt from one shared prefill; each later turn continues every live
episode from its whole context.

**Token-in/token-out.** The tokens the model sampled are kept as sampled, never decoded
and re-encoded. The environment's reply (tool responses, turn separators, the next
generation prompt) is appended as the token ids of exactly the text the chat template
puts between the model's end-of-turn and its next turn (:class:`TurnFormat`). The
training sequence is the sampler's context, token for token.

**Loss mask.** The completion of an episode holds the model's tokens and the
environment's; ``RolloutBatch.action_mask`` marks the model's. Environment tokens are
context: the trainer computes through them but they take no part in the policy loss,
in GSPO's length normalisation, in clip fractions or in the mismatch metrics.
"""

from __future__ import annotations

import copy
import sys
from dataclasses import dataclass, replace
from typing import Any

import torch

from gspo.chat import (
    SENTINEL,
    control_tokens,
    encode_marked,
    marked,
    render,
    special_markers,
    spells,
    template_text,
    turn_end,
    turn_text,
)
from gspo.config import Config
from gspo.distributed import rank_said
from gspo.engines import RolloutBatch, SamplingParams, pad_batch
from gspo.environments import EnvError, EnvironmentFactory, Episode
from gspo.environments.tool_turns import respond_all
from gspo.rewards.parsing import completion_text
from gspo.training.metrics import env_metrics
from gspo.training.sampler import (
    MODEL_CONTEXT,
    Generated,
    Sampler,
    SingleTurn,
    rollout_context,
    said_context,
)
from gspo.training.seeds import derive_seed


class TurnFormat:
    """Token ids of prompts and of the environment's replies, from the chat template.

    ``schemas`` are the environment's tool schemas (rendered by the template's ``tools``
    support); ``chat_kwargs`` reach the template as its variables (``enable_thinking``).
    """

    def __init__(self, tokenizer, schemas: list[dict[str, Any]], chat_kwargs: dict[str, Any]):
        self.tokenizer = tokenizer
        self.schemas = schemas or None
        self.chat_kwargs = dict(chat_kwargs)
        where = "(the model directory's chat_template.jinja or tokenizer_config.json)"
        if getattr(tokenizer, "chat_template", None) is None:
            raise EnvError(
                "rollout.environment needs a tokenizer with a chat template (none found); "
                f"give the model one that renders tools and tool messages {where}"
            )
        # what a cold-start turn ends with (the template's end of turn, else EOS)
        self.end = turn_end(tokenizer, **self.chat_kwargs)
        self.markers = special_markers(tokenizer)  # (tool-call markers: kept in a turn's text)
        self.control = control_tokens(tokenizer)  # (in an environment's text: plain text)
        if self.schemas:
            probe = [{"role": "user", "content": "x"}]
            with_tools = self._render(probe, tools=self.schemas)
            if with_tools == self._render(probe, tools=None):
                raise EnvError(
                    "the tokenizer's chat template ignores `tools`: the model would never see "
                    "the environment's tools (rollout.environment); use a template with tool "
                    f"support {where}"
                )
            result = {"role": "tool", "name": "probe", "content": SENTINEL + "R"}
            turns = [*probe, {"role": "assistant", "content": "a"}, result]
            if SENTINEL + "R" not in self._render(turns, tools=self.schemas):
                raise EnvError(
                    "the tokenizer's chat template leaves out `tool` messages: the model "
                    "would never see what its tool calls return (rollout.environment); use a "
                    f"template that renders tool messages {where}"
                )

    def _render(self, messages: list[dict[str, Any]], *, tools=None, generation=False) -> str:
        return template_text(
            self.tokenizer, messages, tools=tools, generation=generation, **self.chat_kwargs
        )

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def mark(self, value: Any) -> tuple[Any, bool]:
        """Text (or messages) from the environment, marked so that the spelling of a special
        token in it (``<|im_end|>``, ``<tool_call>``) is encoded as plain text, not as the
        token (a tool result must not end its turn or forge an assistant turn or a call),
        and whether it was: text that spells none is left as it is, to be encoded as it is
        (the same tokens as before marking existed, U+E000 and U+E001 included)."""
        if not spells(value, self.control):
            return value, False
        return marked(value, self.control), True

    def encode_env(self, text: str) -> list[int]:
        """Rendered text whose environment parts were :meth:`mark`-ed: those as plain text,
        the template's markup as its tokens."""
        return encode_marked(self.tokenizer, text, self.control)

    def prompt_ids(self, messages: list[dict[str, Any]], *, marked: bool = False) -> list[int]:
        """The prompt, tools included, up to the model's first turn (a prefill continued:
        :func:`gspo.chat.render`); ``marked``: text :meth:`mark`-ed in it, encoded as plain
        text (else the text is encoded as it is)."""
        return render(
            self.tokenizer, messages, tools=self.schemas,
            encode=self.encode_env if marked else None, **self.chat_kwargs,
        )  # fmt: skip

    def reply_ids(self, messages: list[dict[str, Any]], *, stopped_with: int | None) -> list[int]:
        """What follows the model's turn when the environment answers with ``messages``.

        The template renders a stand-in conversation (a user message, an assistant
        message, then ``messages`` and the generation prompt); the text after the
        assistant's content is the reply. Its first token is left out when it is the one
        the model's turn ended with (``stopped_with``: already among its sampled tokens),
        not otherwise: a Gemma turn ended by ``<eos>`` is still followed by the template's
        ``<end_of_turn>``. The messages' text is the environment's (:meth:`mark`).
        """
        base = [{"role": "user", "content": "u"}, {"role": "assistant", "content": SENTINEL}]
        shown, spelt = self.mark(messages)
        text = self._render(base + shown, tools=self.schemas, generation=True)
        tail = text[text.rindex(SENTINEL) + len(SENTINEL) :]
        encode = self.encode_env if spelt else self.encode
        ended = encode(tail.lstrip())  # ("content\n<|im_end|>": the newline with it)
        if ended and stopped_with is not None and ended[0] == stopped_with:
            return ended[1:]
        return encode(tail)


def as_messages(prompt: Any) -> list[dict[str, Any]]:
    """A prompt as chat messages (a string becomes one user message); a copy."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    return [dict(m) for m in prompt]


def with_observation(messages: list[dict[str, Any]], observation: str | None) -> list[dict]:
    """``reset()``'s text appended to the last user message (TRL's convention)."""
    if observation:
        for m in reversed(messages):
            if m.get("role") == "user":
                content = m.get("content")
                if isinstance(content, list):  # TRL's list of parts: one more text part
                    m["content"] = [*content, {"type": "text", "text": observation}]
                else:
                    m["content"] = f"{content or ''}{observation}"
                break
        else:
            messages.append({"role": "user", "content": observation})
    return messages


def encode_conversation(
    fmt: TurnFormat, prompt: Any, completion: list[dict[str, Any]]
) -> tuple[list[int], list[int], list[bool]]:
    """A cold-start row whose completion is a list of messages, as an episode's tokens.

    Assistant messages are the model's tokens (their content, then the end of its turn,
    ``fmt.end``; in the loss), the
    other messages the environment's reply tokens (context), exactly as a rollout lays
    them out. Returns ``(prompt_ids, completion_ids, action_mask)``.
    """
    ids: list[int] = []
    actions: list[bool] = []
    pending: list[dict[str, Any]] = []
    for message in completion:
        if message.get("role") == "assistant":
            if pending:
                reply = fmt.reply_ids(pending, stopped_with=fmt.end)
                ids += reply
                actions += [False] * len(reply)
                pending = []
            content = message.get("content")  # (null: none; TRL's list of parts: their text)
            text = completion_text(message) if isinstance(content, list) else str(content or "")
            turn = [*fmt.encode(text), fmt.end]
            ids += turn
            actions += [True] * len(turn)
        else:
            pending.append(message)
    return fmt.prompt_ids(as_messages(prompt)), ids, actions


@dataclass
class _State:
    """One episode in progress."""

    episode: Episode
    messages: list[dict[str, Any]]
    prompt: list[int]
    ids: list[int]
    actions: list[bool]
    logprobs: list[float]
    limit: int = 0  # tokens after the prompt: rollout.max_episode_tokens, or the context's
    turns: int = 0
    finish: str | None = None

    def __post_init__(self) -> None:
        self.first = len(self.messages)  # where the episode's messages start


class MultiTurn:
    """``generate(rows, prompt_ids, n=, params=, seed=) -> Generated`` over episodes.

    ``max_turns`` bounds the model's turns per episode, ``max_tokens`` the tokens after
    the prompt (the model's and the environment's); ``params.max_new_tokens`` bounds one
    turn. An episode cut by either limit, or whose turn was cut, finishes as ``"length"``.
    Turn ``t`` samples with seed ``derive_seed(seed, "turn", t)`` (turn 0: ``seed``), its
    decode buffers freed after it but turn 0's (later turns' shapes never come again).
    """

    def __init__(
        self,
        sampler: Sampler,
        environment: EnvironmentFactory,
        tokenizer,
        *,
        max_turns: int,
        max_tokens: int,
        chat_kwargs: dict[str, Any],
        context: int | None = None,
        context_key: str = MODEL_CONTEXT,
    ):
        self.sampler = sampler
        self.context = context  # the positions an episode may take, when known
        self.context_key = context_key  # the setting that bounds them (rollout_context)
        self.environment = environment
        self.tokenizer = tokenizer
        self.format = TurnFormat(tokenizer, environment.schemas, chat_kwargs)
        self.max_turns = max_turns
        self.max_tokens = max_tokens
        self.warned: set[str] = set()  # warnings given, shared with `using`'s copies

    def using(self, sampler: Sampler) -> MultiTurn:
        """The same episodes sampled through another sampler (an async producer's)."""
        other = copy.copy(self)
        other.sampler = sampler
        return other

    def start(self, row: dict[str, Any]) -> _State:
        episode = self.environment.episode(dict(row))
        observation = episode.reset(dict(row))
        messages = with_observation(as_messages(row["prompt"]), observation)
        # (reset's text is the environment's: a special token's spelling in it, plain text)
        shown, spelt = self.format.mark(observation)
        shown_messages = with_observation(as_messages(row["prompt"]), shown)
        prompt = self.format.prompt_ids(shown_messages, marked=spelt)
        if self.context is not None and len(prompt) >= self.context:  # (no room for a turn)
            raise EnvError(
                f"environment {self.environment.name!r}: the episode's prompt (the row's and "
                f"reset()'s text) is {len(prompt)} tokens, longer than "
                f"{said_context(self.context, self.context_key)}"
            )
        limit = self.max_tokens
        if self.context is not None and len(prompt) + limit > self.context:
            limit = self.context - len(prompt)  # (a learned position table fails past it)
            self.warn_context_cut(len(prompt))
        return _State(episode, messages, prompt, [], [], [], limit)

    def generate(
        self,
        rows: list[dict[str, Any]],
        prompt_ids: list[list[int]],
        *,
        n: int,
        params: SamplingParams,
        seed: int,
    ) -> Generated:
        del prompt_ids  # episodes render their own prompts (tools, reset observations)
        states = [self.start(row) for row in rows for _ in range(n)]
        live = list(range(len(states)))
        cut = 0  # first turns that max_new_tokens cut
        for turn in range(self.max_turns):
            if not live:
                break
            turn_seed = seed if turn == 0 else derive_seed(seed, "turn", turn)
            answering: list[tuple[int, str]] = []  # (episode, its turn's text)
            for part, budget, batch in self.sample(states, live, n, turn, params, turn_seed):
                if turn == 0 and budget == params.max_new_tokens:
                    cut += sum(reason == "length" for reason in batch.finish_reasons)
                for j, i in enumerate(part):
                    if (text := self.advance(states[i], batch, j)) is not None:
                        answering.append((i, text))
            # (the environments' replies together: async tools' calls run at once)
            replies = respond_all([(states[i].episode, text) for i, text in answering])
            live = sorted(
                i for (i, _), reply in zip(answering, replies, strict=True)
                if self.follow(states[i], reply, turn)
            )  # fmt: skip
        for i in live:  # still wanting to go on after max_turns
            states[i].finish = "length"
        if self.max_turns > 1 and all(s.turns == 1 for s in states):
            self.warn_first_turns_cut(cut, len(states), params.max_new_tokens)
        return self.collect(states, n)

    def sample(
        self,
        states: list[_State],
        live: list[int],
        n: int,
        turn: int,
        params: SamplingParams,
        seed: int,
    ) -> list[tuple[list[int], int, RolloutBatch]]:
        """This turn's samples of the ``live`` episodes, as ``(episodes, budget, batch)``
        parts: one, of the turn budget the roomiest episode has (tokens past an episode's
        own room are cut in :meth:`advance`), but for episodes that budget would carry past
        the model's context (a learned position table fails there: an IndexError), sampled
        apart with their own room, a part per room (seeds derived from ``seed`` and it)."""
        rooms = {i: states[i].limit - len(states[i].ids) for i in live}
        budget = min(params.max_new_tokens, max(rooms.values()))
        parts: dict[int, list[int]] = {}
        for i in live:
            end = len(states[i].prompt) + len(states[i].ids) + budget
            own = budget if self.context is None or end <= self.context else rooms[i]
            parts.setdefault(own, []).append(i)
        out = []
        for k, (own, part) in enumerate(sorted(parts.items(), reverse=True)):
            # (turn 0's decode buffers kept for the next batch: its main part's shapes)
            kept = replace(params, max_new_tokens=own, keep_buffers=turn == 0 and k == 0)
            shared = turn == 0 and all(states[i].prompt == states[i - i % n].prompt for i in part)
            if shared:  # one prefill per prompt, n responses each
                contexts, each = [states[i].prompt for i in part if i % n == 0], n
            else:
                contexts, each = [states[i].prompt + states[i].ids for i in part], 1
            part_seed = seed if k == 0 else derive_seed(seed, "room", own)
            out.append(
                (part, own, self.sampler.generate(contexts, n=each, params=kept, seed=part_seed))
            )
        return out

    def warn_first_turns_cut(self, cut: int, episodes: int, max_new_tokens: int) -> None:
        """One line on stderr (once a run) when no episode got past its first turn and
        ``rollout.max_new_tokens`` cut most of those turns: the budget, not the model,
        ends the episodes, and no tool result or observation ever reaches the model."""
        # (most ended on their own: an environment ending after one turn by design)
        if cut * 2 <= episodes or "first turns" in self.warned:
            return
        self.warned.add("first turns")
        print(
            f"gspo: warning{rank_said()}: every episode of a batch of {episodes} (training "
            f"or evaluation) ended after its first turn, and rollout.max_new_tokens="
            f"{max_new_tokens} cut {cut} of those turns: "
            "no tool result or environment reply reaches the model (raise "
            "rollout.max_new_tokens to fit a whole turn, a tool call included; shown once)",
            file=sys.stderr,
            flush=True,
        )

    def warn_context_cut(self, prompt: int) -> None:
        """One line on stderr (once a run) when an episode's prompt leaves fewer than
        ``rollout.max_episode_tokens`` positions of the model's context: its episode ends
        where the context does, as ``length`` (it ran past it before)."""
        if "context" in self.warned:
            return
        self.warned.add("context")
        print(
            f"gspo: warning{rank_said()}: environment {self.environment.name!r}: an episode's "
            f"prompt of {prompt} tokens leaves {self.context - prompt} of "
            f"rollout.max_episode_tokens={self.max_tokens} positions in "
            f"{said_context(self.context, self.context_key)}: such episodes end there, as "
            "length (shown once)",
            file=sys.stderr,
            flush=True,
        )

    def warn_reply_too_long(self, reply: int, used: int, limit: int) -> None:
        """One line on stderr (once a run) when an environment's reply does not fit the
        episode's token budget: the episode ends there as ``length``, the reply unseen."""
        if "long reply" in self.warned:
            return
        self.warned.add("long reply")
        bound = f"rollout.max_episode_tokens={self.max_tokens}"
        if limit < self.max_tokens:  # the context's end came first
            bound = said_context(self.context, self.context_key)
        print(
            f"gspo: warning{rank_said()}: an environment reply of {reply} tokens did not fit the "
            f"episode ({used} tokens so far of {limit}: {bound}): the episode ended as length "
            "without it (shown once)",
            file=sys.stderr,
            flush=True,
        )

    def advance(self, state: _State, batch: RolloutBatch, j: int) -> str | None:
        """Append row ``j`` of ``batch`` (this turn) to ``state``: the turn's text for the
        environment to answer (:meth:`follow`), or None when the episode ended in it."""
        mask = batch.completion_mask[j].bool()
        ids = batch.completion_ids[j][mask].tolist()
        logprobs = batch.sampler_logprobs[j][mask].tolist()
        room = state.limit - len(state.ids)
        cut = len(ids) > room
        ids, logprobs = ids[:room], logprobs[:room]
        state.ids += ids
        state.actions += [True] * len(ids)
        state.logprobs += logprobs
        state.turns += 1
        stopped = batch.finish_reasons[j] == "stop" and not cut
        text_ids = ids[:-1] if stopped else ids
        text = turn_text(self.tokenizer, text_ids, self.format.markers)
        state.messages.append({"role": "assistant", "content": text})
        if not stopped:
            state.finish = "length"
            return None
        return text

    def follow(self, state: _State, reply: list[dict[str, Any]] | None, turn: int) -> bool:
        """The environment's ``reply`` to ``state``'s turn ``turn`` appended (None: it ended
        the episode); whether the episode goes on."""
        if reply is None:
            state.finish = "stop"
            return False
        if turn + 1 == self.max_turns:
            return True  # marked "length" by the caller; the reply is never seen
        reply_ids = self.format.reply_ids(reply, stopped_with=state.ids[-1])  # (its stop)
        if len(state.ids) + len(reply_ids) >= state.limit:
            state.finish = "length"
            self.warn_reply_too_long(len(reply_ids), len(state.ids), state.limit)
            return False
        state.messages += reply
        state.ids += reply_ids
        state.actions += [False] * len(reply_ids)
        state.logprobs += [0.0] * len(reply_ids)
        return True

    def collect(self, states: list[_State], n: int) -> Generated:
        """The episodes as one :class:`RolloutBatch`, their messages and their metrics."""
        device = self.sampler.policy.device
        pad = self.tokenizer.pad_token_id
        prompt_ids, prompt_mask = pad_batch([s.prompt for s in states], pad, device)
        completion_ids, completion_mask = pad_batch(
            [s.ids for s in states], pad, device, side="right"
        )
        width = completion_ids.shape[1]

        def right(values: list, fill, dtype) -> torch.Tensor:
            return torch.tensor([v + [fill] * (width - len(v)) for v in values], dtype=dtype)

        actions = right([s.actions for s in states], False, torch.bool).to(device)
        logprobs = right([s.logprobs for s in states], 0.0, torch.float32).to(device)
        batch = RolloutBatch(
            prompt_ids=prompt_ids,
            prompt_mask=prompt_mask,
            completion_ids=completion_ids,
            completion_mask=completion_mask.bool(),
            sampler_logprobs=logprobs,
            finish_reasons=[s.finish or "length" for s in states],
            group_size=n,
            action_mask=actions,
        )
        # what each model saw before its first turn (reset's text too), and what followed
        prompts, completions = (
            [s.messages[: s.first] for s in states],
            [s.messages[s.first :] for s in states],
        )
        counts = {  # (each episode's: env/* of the episodes a rollout batch keeps)
            "turns": [s.turns for s in states],
            "tool_calls": [s.episode.tool_calls for s in states],
            "tool_errors": [s.episode.tool_errors for s in states],
        }
        metrics = env_metrics(counts, completion_mask, actions)
        columns: dict[str, list[Any]] = {"environments": [s.episode.env for s in states]}
        episodes = [s.episode for s in states]
        return Generated(batch, completions, columns, metrics, episodes, prompts, counts)


def build_generator(
    config: Config, sampler: Sampler, tokenizer, sample_row: dict[str, Any] | None = None
) -> SingleTurn | MultiTurn:
    """Episodes with ``rollout.environment`` (or the calculator task), else single turns;
    ``sample_row`` (a training row) makes one environment up front, so that a factory
    that fails does so before anything runs."""
    spec = config.environment
    if spec is None:
        return SingleTurn(sampler)
    context, key = rollout_context(config, sampler.policy.module)
    return MultiTurn(
        sampler,
        EnvironmentFactory(spec, sample_row, timeout=config.rollout.env_timeout),
        tokenizer,
        max_turns=config.rollout.max_turns,
        max_tokens=config.max_episode_tokens,
        chat_kwargs=config.data.chat_template_kwargs,
        context=context,
        context_key=key,
    )
