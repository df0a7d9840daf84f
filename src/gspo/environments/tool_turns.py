"""A batch's turn of tool calls: the ``async def`` tools' calls of all episodes at once.

:func:`respond_all` answers the turns of a batch's episodes (:meth:`Episode.respond` of
each) with the same messages, counts and errors, but runs the calls of the turns whose
calls are all to ``async def`` tools together on the process's event loop
(:func:`gspo.plugins.event_loop`), ``asyncio.gather``-ed: tools that wait on a server,
a sandbox or a subprocess wait together, not one after another. An episode's own calls
still run in order, each after the one before has returned (its environment sees them
as before); a turn with a plain ``def`` tool's call runs as before, in the calling
thread (a tool may hold what is bound to it: a ``sqlite3`` connection).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable
from typing import Any

from gspo.environments.deadlines import EnvTimeout, deadline
from gspo.environments.episodes import Episode
from gspo.plugins import awaited

#: What :func:`run_chains` says of a call: it returned, it raised, or it ran past its time.
RETURNED, RAISED, OVERRAN = "returned", "raised", "overran"


async def run_chains(
    chains: list[list[Callable[[], Awaitable[Any]]]], timeout: float | None
) -> list[list[tuple[str, Any]]]:
    """Each chain's calls one after another, the chains at once; for each, per call run,
    ``(RETURNED, value)``, ``(RAISED, exception)`` or ``(OVERRAN, None)``, which ends its
    chain: past ``timeout`` seconds (None: none) the call is cancelled at its next await
    (one that swallowed the cancellation and returned overran all the same)."""

    async def chain(calls: list[Callable[[], Awaitable[Any]]]) -> list[tuple[str, Any]]:
        out: list[tuple[str, Any]] = []
        for start in calls:
            scope = asyncio.timeout(timeout)
            try:
                async with scope:
                    value = await start()
            except (Exception, SystemExit) as e:  # (sys.exit in user code: an error)
                if scope.expired():
                    return [*out, (OVERRAN, None)]
                out.append((RAISED, e))
                continue
            except asyncio.CancelledError as e:  # (raised by the tool: its error, as alone)
                if asyncio.current_task().cancelling():  # (the batch's own cancellation)
                    raise
                out.append((RAISED, e))
                continue
            if scope.expired():
                return [*out, (OVERRAN, None)]
            out.append((RETURNED, value))
        return out

    return list(await asyncio.gather(*(chain(calls) for calls in chains)))


def respond_all(turns: list[tuple[Episode, str]]) -> list[list[dict[str, Any]] | None]:
    """``[episode.respond(text) for episode, text in turns]``, the turns whose calls are
    all to ``async def`` tools run at once (the module's docstring). A call past
    ``rollout.env_timeout`` stops the run as :meth:`Episode.respond`'s does, naming it."""
    replies: list[list[dict[str, Any]] | None] = [None] * len(turns)
    plans = {}
    for k, (episode, text) in enumerate(turns):
        plan = episode.plan(text)
        if plan is None:
            replies[k] = episode.respond(text)
        else:
            plans[k] = plan
    if len(plans) == 1:  # (nothing to run with: as respond runs it)
        [(k, _)] = plans.items()
        replies[k] = turns[k][0].respond(turns[k][1])
    if len(plans) < 2:
        return replies
    spec = turns[next(iter(plans))][0].spec
    chains = [
        [functools.partial(tool, **call.arguments) for call, error, tool in plan if error is None]
        for plan in plans.values()
    ]
    what = f"environment {spec.name!r}: a batch of async tool calls ({len(chains)} episodes')"
    if spec.timeout is None:
        guard: Any = spec.slow.watch(what)
    else:  # (each call is timed on the loop; this, past them all, if the loop is held)
        guard = deadline(spec.timeout * max(map(len, chains)) + 1.0, what)
        guard.said = deadline(spec.timeout, what).said
    with guard:
        outcomes = awaited(run_chains(chains, spec.timeout))
    for plan, ran in zip(plans.values(), outcomes, strict=True):
        runs = [call for call, error, _ in plan if error is None]
        if ran and ran[-1][0] == OVERRAN:
            call = runs[len(ran) - 1]
            name = f"environment {spec.name!r}: tool {call.name}()"
            raise EnvTimeout(deadline(spec.timeout, name).said)
    for (k, plan), ran in zip(plans.items(), outcomes, strict=True):
        episode, results = turns[k][0], iter(ran)
        messages = []
        for call, error, _ in plan:
            if error is not None:
                messages.append(episode.reply(call, error=error))
                continue
            how, value = next(results)
            if how == RETURNED:
                messages.append(episode.reply(call, result=value))
            else:
                messages.append(episode.reply(call, failed=value))
        replies[k] = messages
    return replies
