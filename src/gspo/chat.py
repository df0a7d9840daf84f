"""A conversation's tokens: prompts through the chat template, and where a turn ends.

Prompts (:func:`encode_prompt`) are text, tokenized as it is, or chat messages rendered
by the tokenizer's chat template. The model's turn ends at any of its stop tokens
(:func:`stop_token_ids`): the tokenizer's EOS, the EOS ids of the model's
``generation_config.json`` (Gemma's ``[1, 107]``), and the token the chat template puts
after an assistant message (:func:`end_of_turn`: Llama 3's ``<|eot_id|>``, Qwen's
``<|im_end|>``, Gemma's ``<end_of_turn>``), which is also what a cold-start completion
of a chat prompt ends with (:func:`turn_end`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

#: Content of the stand-in assistant message a template is rendered around.
SENTINEL = "GSPO7TURN9SENTINEL"


def template_text(
    tokenizer,
    messages: list[dict[str, Any]],
    *,
    tools: list[dict[str, Any]] | None = None,
    generation: bool = False,
    prefill: bool = False,
    **chat_kwargs: Any,
) -> str:
    """The chat template's text for ``messages`` (with ``tools``; the generation prompt
    after them, or their last message continued with ``prefill``). A template that fails
    (Gemma's refuses a system message) is a one-line ``ValueError``."""
    try:
        return tokenizer.apply_chat_template(
            messages,
            tools=tools,
            add_generation_prompt=generation,
            continue_final_message=prefill,
            tokenize=False,
            **chat_kwargs,
        )
    except Exception as exc:  # jinja's TemplateError (raise_exception) and the like
        roles = ", ".join(str(m.get("role")) for m in messages)
        said = " ".join(str(exc).split())[:200]
        raise ValueError(
            f"the chat template failed on messages ({roles}): {type(exc).__name__}: {said}"
        ) from None


def render(
    tokenizer,
    messages: list[dict[str, Any]],
    *,
    tools: list[dict[str, Any]] | None = None,
    encode: Callable[[str], list[int]] | None = None,
    **chat_kwargs: Any,
) -> list[int]:
    """The token ids of ``messages`` ready for the model's turn: the generation prompt
    after a user (or tool) message; after an assistant message (a prefill such as
    ``"Let me check:"``), that message continued (TRL's ``apply_chat_template`` renders
    it so; its ``GRPOTrainer`` opens a new assistant turn after it). ``encode``: how the
    text becomes ids (:func:`encode_marked` for text from an environment)."""
    prefill = bool(messages) and messages[-1].get("role") == "assistant"
    text = template_text(
        tokenizer, messages, tools=tools, generation=not prefill, prefill=prefill, **chat_kwargs
    )
    _written(messages, text)
    if encode is not None:
        return encode(text)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


#: The chat roles every template knows (other roles, ``model`` or ``ipython``, some do).
ROLES = ("system", "user", "assistant", "tool")


def _written(messages: list[dict[str, Any]], text: str) -> None:
    """A message of another role than :data:`ROLES` whose text the template left out
    (Qwen's writes nothing for ``narrator``: the model never saw it, unsaid) is a
    one-line ``ValueError`` naming it. (A template may write it JSON-encoded: Llama 3's
    ``ipython`` turns.) So is a content that is a list of parts (TRL's
    ``[{"type": "text", ...}]``) which the template wrote as its repr (Qwen2.5's does)."""
    for k, message in enumerate(messages, start=1):
        role, content = message.get("role"), message.get("content")
        if isinstance(content, list) and content and (shown := str(content)) in text:
            shown = shown if len(shown) <= 60 else f"{shown[:57]}..."
            raise ValueError(
                f"message {k}'s content is a list of parts, which the chat template writes "
                f"as its Python repr ({shown}); write the content as text"
            )
        if role in ROLES or not isinstance(content, str):
            continue
        if content.strip() in text or json.dumps(content)[1:-1].strip() in text:
            continue
        raise ValueError(
            f"message {k} has the role {role!r}, which the chat template writes nothing "
            f"for (the roles every template knows: {', '.join(ROLES)})"
        )


def encode_prompt(
    prompt: str | list[dict[str, str]], tokenizer, **chat_template_kwargs: Any
) -> list[int]:
    """Token ids of a prompt: chat messages go through the tokenizer's chat template.

    ``chat_template_kwargs`` (``data.chat_template_kwargs``, e.g. Qwen3's
    ``enable_thinking``) reach the template as its variables. A text prompt gets the
    tokenizer's special tokens (its BOS) unless it already starts with the BOS text (a
    prompt rendered by the chat template beforehand, TRL's "standard" format): one BOS
    either way.
    """
    if isinstance(prompt, str):
        bos = getattr(tokenizer, "bos_token", None)
        special = not (isinstance(bos, str) and bos and prompt.startswith(bos))
        return list(tokenizer(prompt, add_special_tokens=special)["input_ids"])
    if isinstance(prompt, list):
        for i, message in enumerate(prompt):
            if not isinstance(message, dict) or "role" not in message:
                raise ValueError(
                    f"chat message {i} must be a mapping with a 'role' (and its 'content'); "
                    f"got {message!r:.80}"
                )
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError(
                "prompts are chat messages (a message-list prompt column, data.system_prompt "
                "or data.chat_template) but the tokenizer has no chat template"
            )
        return render(tokenizer, prompt, **chat_template_kwargs)
    raise ValueError(
        f"prompt must be a string or a list of chat messages; got {type(prompt).__name__}"
    )


def _special_ids(tokenizer) -> set[int]:
    ids = set(getattr(tokenizer, "all_special_ids", ()) or ())
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    return ids | {i for i, token in added.items() if getattr(token, "special", False)}


_ROLES = ("user", "assistant", "system", "model", "tool")


def end_of_turn(tokenizer, **chat_kwargs: Any) -> int | None:
    """The special token the chat template puts after an assistant message's content
    (whitespace before it aside), or None: no template, one that ends a turn with plain
    text, or one whose token there opens the next message (``<|im_start|>assistant``
    from a template without an end marker: a role name in or right after the token). A
    template that needs a system message is asked with one."""
    if getattr(tokenizer, "chat_template", None) is None:
        return None
    turn = [{"role": "user", "content": "u"}, {"role": "assistant", "content": SENTINEL}]
    for system in ([], [{"role": "system", "content": "s"}]):
        try:
            text = tokenizer.apply_chat_template([*system, *turn], tokenize=False, **chat_kwargs)
            break
        except Exception:  # a template that cannot render this exchange: try the next
            continue
    else:
        return None
    if not isinstance(text, str) or SENTINEL not in text:
        return None
    tail = text[text.rindex(SENTINEL) + len(SENTINEL) :].lstrip()
    ids = tokenizer(tail, add_special_tokens=False)["input_ids"] if tail else []
    if not ids or ids[0] not in _special_ids(tokenizer):
        return None
    name = str(tokenizer.convert_ids_to_tokens(ids[0]))
    after = tail[len(name) :].lstrip().lower() if tail.startswith(name) else ""
    if any(role in name.lower() for role in _ROLES) or after.startswith(_ROLES):
        return None
    return ids[0]


def turn_end(tokenizer, **chat_kwargs: Any) -> int | None:
    """What ends the model's turn after a chat prompt: the template's end of turn, else
    the tokenizer's EOS."""
    end = end_of_turn(tokenizer, **chat_kwargs)
    return tokenizer.eos_token_id if end is None else end


def stop_token_ids(tokenizer, model: Any, **chat_kwargs: Any) -> tuple[int, ...]:
    """The tokens at which a response ends: the tokenizer's EOS, ``model``'s
    ``generation_config`` EOS ids (what Hugging Face ``generate`` and vLLM stop at) and
    the chat template's end of turn."""
    stops = {tokenizer.eos_token_id, end_of_turn(tokenizer, **chat_kwargs)}
    config = getattr(model, "generation_config", None)
    eos = getattr(config, "eos_token_id", None)
    stops.update(eos if isinstance(eos, list | tuple) else [eos])
    return tuple(sorted(int(i) for i in stops if i is not None))


#: The Hermes/Qwen tool-call markers (:func:`gspo.environments.tool_calls.parse_tool_calls`).
TOOL_MARKERS = ("<tool_call>", "</tool_call>")


def special_markers(tokenizer) -> dict[int, str]:
    """The :data:`TOOL_MARKERS` that ``tokenizer`` makes special tokens, by token id (a
    decode without special tokens drops them)."""
    markers = {}
    for marker in TOOL_MARKERS:
        found = tokenizer.encode(marker, add_special_tokens=False)
        if len(found) == 1 and not tokenizer.decode(found, skip_special_tokens=True):
            markers[found[0]] = marker
    return markers


def turn_text(tokenizer, ids: list[int], markers: dict[int, str] | None = None) -> str:
    """A model's turn as text, without special tokens but for the tool-call markers: a
    tokenizer that makes ``<tool_call>`` a special token (vLLM's Hermes parser keeps them
    for that reason) had them decoded away, so no call was ever parsed, unsaid.
    ``markers``: :func:`special_markers` of ``tokenizer``, found once by the caller."""
    if markers is None:
        markers = special_markers(tokenizer)
    parts: list[str] = []
    start = 0
    for i, token in enumerate(ids):
        if token in markers:
            parts += [tokenizer.decode(ids[start:i], skip_special_tokens=True), markers[token]]
            start = i + 1
    return "".join([*parts, tokenizer.decode(ids[start:], skip_special_tokens=True)])


#: Put around a control token's spelling in text from outside the model (:func:`marked`)
#: so that :func:`encode_marked` encodes it as plain text (Unicode private-use characters,
#: the ones ``transformers``' ``sanitize_control_tokens`` uses).
_OPEN, _CLOSE = "\ue000", "\ue001"


def control_tokens(tokenizer) -> re.Pattern[str]:
    """What an environment's text must not turn into: the tokenizer's special tokens and
    the added tokens its chat template writes or that mark a tool call (``<tool_call>``,
    ``<tool_response>``: Qwen makes them added tokens that are not special), longest first."""
    template = str(getattr(tokenizer, "chat_template", None) or "")
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    tokens = {str(t) for t in getattr(tokenizer, "all_special_tokens", ()) or ()}
    tokens |= {
        token.content for token in added.values()
        if getattr(token, "special", False)
        or token.content in TOOL_MARKERS
        or (token.content in template and not token.content.isspace())
    }  # fmt: skip
    tokens.discard("")
    # (a token past _TRIE_DEPTH characters, none known, alternated before the tree: each
    # of its characters may nest a group, which re's parser recurses into)
    long = sorted((t for t in tokens if len(t) > _TRIE_DEPTH), key=len, reverse=True)
    short = _trie_pattern({t for t in tokens if len(t) <= _TRIE_DEPTH})
    return re.compile("|".join([*map(re.escape, long), *[short][: bool(short)]]) or "(?!)")


_TRIE_DEPTH = 200


def _trie_pattern(tokens: set[str]) -> str:
    """A pattern matching what the alternation of ``tokens``, longest first, matches (at
    each position the longest token that starts there), shaped as their prefix tree: an
    alternation of thousands (Gemma's ``<unusedN>``, Llama-3's reserved tokens) tried
    every one of them at each ``<`` of every environment text, tens of milliseconds per
    12 KB tool result; the tree tries one branch per character. No capturing group
    (:func:`encode_marked` wraps it in one)."""
    end = ""  # (a key no character is: a token ends at this node)
    trie: dict[str, dict] = {}
    for token in tokens:
        node = trie
        for char in token:
            node = node.setdefault(char, {})
        node[end] = {}

    def pattern(node: dict[str, dict]) -> str:
        branches = [
            re.escape(char) + pattern(child) for char, child in sorted(node.items()) if char
        ]
        if not branches:
            return ""
        body = branches[0] if len(branches) == 1 else f"(?:{'|'.join(branches)})"
        # greedy: a longer token first, this one where none continues (its ``?``)
        return f"(?:{body})?" if end in node else body

    return pattern(trie)


def marked(value: Any, tokens: re.Pattern[str]) -> Any:
    """``value`` (a string, or messages: lists and dicts of them, roles aside) with each
    control token's spelling marked (markers already there are dropped first), and
    :data:`SENTINEL` broken by a lone marker (the same text once encoded), so that it is
    never taken for the stand-in message a reply is cut after."""
    if isinstance(value, str):
        value = value.replace(_OPEN, "").replace(_CLOSE, "")
        value = value.replace(SENTINEL, f"{SENTINEL[0]}{_CLOSE}{SENTINEL[1:]}")
        return tokens.sub(lambda m: f"{_OPEN}{m.group(0)}{_CLOSE}", value)
    if isinstance(value, dict):
        return {k: v if k == "role" else marked(v, tokens) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [marked(v, tokens) for v in value]
    return value


def spells(value: Any, tokens: re.Pattern[str]) -> bool:
    """Whether ``value`` (as :func:`marked` takes it) spells a control token or holds
    :data:`SENTINEL`: text that needs :func:`marked`. Text that does not is encoded as it
    is, the characters U+E000 and U+E001 kept (marking drops them; the prompt's own, in
    the same rendered text, were read as markers and dropped too)."""
    if isinstance(value, str):
        return SENTINEL in value or tokens.search(value) is not None
    if isinstance(value, dict):
        return any(spells(v, tokens) for k, v in value.items() if k != "role")
    if isinstance(value, list | tuple):
        return any(spells(v, tokens) for v in value)
    return False


def encode_marked(tokenizer, text: str, tokens: re.Pattern[str]) -> list[int]:
    """The ids of ``text``, rendered from :func:`marked` messages: a marked token as plain
    text, the template's own special tokens as themselves. Text without a marker is
    encoded as ever; around a marker, each piece after a newline (no SentencePiece prefix
    space at a piece's start), as ``transformers``' ``encode_marked_chat`` does."""
    if _OPEN not in text and _CLOSE not in text:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    # [text, marked token, text, ...]; None for a lone marker (a template that cut one)
    pieces = re.split(f"{_OPEN}({tokens.pattern}){_CLOSE}|[{_OPEN}{_CLOSE}]", text)

    def normal(piece: str) -> list[int]:
        return list(tokenizer(piece, add_special_tokens=False)["input_ids"])

    def plain(piece: str) -> list[int]:
        return _plain(tokenizer, piece)

    newline, ids = normal("\n"), normal(pieces[0])
    for i, piece in enumerate(pieces[1:], start=1):
        if not piece:
            continue
        encode = plain if i % 2 else normal
        got = encode("\n" + piece)
        ids += got[len(newline) :] if newline and got[: len(newline)] == newline else encode(piece)
    return ids


def _plain(tokenizer, text: str) -> list[int]:
    """``text`` as plain text: no added token, special or not, matched (a fast tokenizer's
    normalizer, pre-tokenizer and model; a slow one splits its special tokens only)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return list(
            tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
        )
    if backend.normalizer is not None:
        text = backend.normalizer.normalize_str(text)
    pieces = [text]
    if backend.pre_tokenizer is not None:
        pieces = [piece for piece, _ in backend.pre_tokenizer.pre_tokenize_str(text)]
    return [token.id for piece in pieces for token in backend.model.tokenize(piece)]
