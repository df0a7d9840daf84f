"""An environment's episodes: the factory a spec names, its tools and their schemas
(:class:`EnvironmentFactory`), an episode's turns (:class:`Episode`). What an environment
is: :mod:`gspo.environments`; the deadlines of calls into it: :mod:`~.deadlines`.
"""

from __future__ import annotations

import inspect
import sys
import types
from collections.abc import Callable
from typing import Any

from gspo.environments.deadlines import EnvError, EnvTimeout, SlowCalls, deadline
from gspo.environments.tool_calls import (
    NoText,
    ToolCall,
    argument_error,
    parse_tool_calls,
    tool_result_text,
)
from gspo.plugins import (
    ENVIRONMENT_FORMS,
    awaited,
    load_object,
    missing_arguments,
    one_line,
    raised,
)
from gspo.rewards.thinking import answer_text

#: Methods with a meaning of their own: never tools.
RESERVED = frozenset({"reset", "step", "get_reward", "close"})
#: What a tool may be: a method (``def``, ``async def``), a staticmethod or a classmethod.
TOOL_KINDS = (types.FunctionType, staticmethod, classmethod)


def accepted(function: Callable[..., Any], row: dict[str, Any], what: str = "") -> dict[str, Any]:
    """The columns of ``row`` that ``function`` takes by name (all of them with ``**``).

    With ``what`` (the call, for messages), a required parameter that no column gives is a
    one-line :class:`EnvError` naming it and the columns (the ``TypeError`` of the call
    pointed into gspo, where the call is)."""
    try:
        parameters = inspect.signature(function).parameters
    except (TypeError, ValueError):
        return dict(row)
    if any(p.kind is p.VAR_KEYWORD for p in parameters.values()):
        return dict(row)
    missing = missing_arguments(function, list(row)) if what else []
    if missing:
        raise EnvError(
            f"{what} needs {', '.join(missing)}, which no data column gives (the row's "
            f"columns: {', '.join(row) or 'none'})"
        )
    return {k: v for k, v in row.items() if k in parameters}


class EnvironmentFactory:
    """The environment class ``factory`` names (a spec string or the callable itself), its
    tools and their schemas. One instance is made up front to read the tools (and to fail
    early, with one line, if construction fails)."""

    def __init__(
        self,
        factory: str | Callable[..., Any],
        sample_row: dict[str, Any] | None = None,
        timeout: float | None = None,
    ):
        self.timeout = timeout  # rollout.env_timeout: seconds each call may take
        self.slow = SlowCalls()  # (without one: a call running long is said)
        if isinstance(factory, str):
            self.name = factory
            factory = load_object(factory.strip(), "environment", EnvError, ENVIRONMENT_FORMS)
        else:
            self.name = getattr(factory, "__qualname__", repr(factory))
        self.factory = factory
        try:
            self.parameters = inspect.signature(factory).parameters
        except (TypeError, ValueError):
            self.parameters = {}
        # one environment up front (fails early, in one line); a factory that needs a
        # row is tried when one is given
        needs_row = bool(self._required()) or self._takes_all()
        probe = None if needs_row and sample_row is None else self.make(sample_row or {})
        if inspect.isclass(factory):
            owner: Any = factory
        elif probe is not None:
            owner = type(probe)
        else:
            owner = type(self.make({}))
        self.tool_names = [
            name
            for name, member in inspect.getmembers(owner)
            if not name.startswith("_") and name not in RESERVED
            # (a method, static or class method: the latter two were dropped, "unknown tool")
            and isinstance(inspect.getattr_static(owner, name), TOOL_KINDS)
        ]  # fmt: skip
        self.schemas = [self._schema(owner, name) for name in self.tool_names]
        self.arguments = {  # each tool's JSON schema of its arguments (argument_error)
            name: schema["function"].get("parameters") or {}
            for name, schema in zip(self.tool_names, self.schemas, strict=True)
        }
        self.has_step = callable(getattr(owner, "step", None))
        self.has_reward = callable(getattr(owner, "get_reward", None))
        if not self.tool_names and not self.has_step:
            raise EnvError(
                f"environment {self.name!r} has no tools (public methods) and no step(text): "
                "the model would have nothing to act on"
            )
        self.warned: set[tuple[str, str] | str] = set()  # (what was said once)
        if probe is not None and sample_row is not None:
            self.try_row(sample_row, probe)

    def _schema(self, owner: type, name: str) -> dict[str, Any]:
        from transformers.utils import get_json_schema

        method = getattr(owner, name)
        packed = [
            p.name for p in inspect.signature(method).parameters.values()
            if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        ]  # fmt: skip
        if packed:
            raise EnvError(
                f"environment {self.name!r}: tool {name!r} takes *{packed[0]}/**, which a "
                "JSON tool call (named arguments only) cannot pass; give it named parameters"
            )
        if inspect.isfunction(inspect.getattr_static(owner, name)):  # (static, class: as is)
            method = types.MethodType(method, object())  # so that `self` leaves the signature
        try:
            return get_json_schema(method)
        except Exception as e:
            raise EnvError(
                f"environment {self.name!r}: tool {name!r} has no usable schema "
                f"({type(e).__name__}: {one_line(e, 200)}); give it type hints and a "
                "docstring with an Args: section, or make it private (_name)"
            ) from e

    def _required(self) -> list[inspect.Parameter]:
        return [
            p for p in self.parameters.values()
            if p.default is inspect.Parameter.empty
            and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        ]  # fmt: skip

    def _takes_all(self) -> bool:
        return any(p.kind is p.VAR_KEYWORD for p in self.parameters.values())

    def make(self, row: dict[str, Any]) -> Any:
        """One environment: ``Factory()`` (TRL's form; the row then goes to ``reset``), or,
        for a factory with required parameters, ``Factory(row)`` when it takes one
        parameter that is not a column, else ``Factory(**columns it names)``."""
        required, takes_all = self._required(), self._takes_all()
        try:
            with self.deadline("its constructor"):
                if not required and not takes_all:
                    made = self.factory()
                elif len(required) == 1 and required[0].name not in row and not takes_all:
                    made = self.factory(row)
                else:
                    what = f"environment {self.name!r}: its constructor"
                    made = self.factory(**accepted(self.factory, row, what))
        except EnvError:
            raise
        except (Exception, SystemExit) as e:  # (sys.exit in user code: an error)
            raise EnvError(
                f"environment {self.name!r}: constructing it raised {raised(e, 300)}"
            ) from e
        if made is None:
            raise EnvError(f"environment {self.name!r}: the factory returned None")
        return made

    def deadline(self, call: str):
        """:func:`deadline` for this environment's ``call`` (``step()``, a tool, ...); with
        no ``rollout.env_timeout``, :class:`SlowCalls`' watch."""
        what = f"environment {self.name!r}: {call}"
        return self.slow.watch(what) if self.timeout is None else deadline(self.timeout, what)

    def episode(self, row: dict[str, Any] | None = None) -> Episode:
        """A fresh environment for one episode of ``row``."""
        return Episode(self, self.make(row or {}))

    def try_row(self, row: dict[str, Any], env: Any = None) -> None:
        """An episode of ``row`` (in ``env``, made for it, or a new one) reset and closed up
        front: a misspelt column or a list returned is found before the model loads and the
        cold start runs, not after."""
        episode = self.episode(row) if env is None else Episode(self, env)
        episode.reset(dict(row))
        episode.close()


class Episode:
    """One environment instance and what happened in its episode."""

    def __init__(self, spec: EnvironmentFactory, env: Any):
        self.spec = spec
        self.env = env
        self.tool_calls = 0
        self.tool_errors = 0

    def reset(self, row: dict[str, Any]) -> str | None:
        """The environment's ``reset(**row)``; the text to append to the prompt, if any."""
        reset = getattr(self.env, "reset", None)
        if not callable(reset):
            return None
        kwargs = accepted(reset, row, f"environment {self.spec.name!r}: reset()")
        try:
            with self.spec.deadline("reset()"):
                out = awaited(reset(**kwargs))  # (async def: awaited, as all of these)
        except EnvTimeout:
            raise
        except (Exception, SystemExit) as e:  # (sys.exit in user code: an error)
            raise EnvError(
                f"environment {self.spec.name!r}: reset() raised {raised(e, 300)}"
            ) from e
        if out is not None and not isinstance(out, str):
            raise EnvError(
                f"environment {self.spec.name!r}: reset() returned {type(out).__name__}; "
                "expected str (text appended to the prompt) or None"
            )
        return out

    def respond(self, text: str) -> list[dict[str, Any]] | None:
        """The environment's reply to the model's turn ``text``: messages, or None (done)."""
        calls = self._calls(text)
        if calls:
            return [self._answer(call) for call in calls]
        if self.spec.has_step:
            try:
                with self.spec.deadline("step()"):
                    observation = awaited(self.env.step(text))
            except EnvTimeout:
                raise
            except (Exception, SystemExit) as e:  # (sys.exit in user code: an error)
                raise EnvError(
                    f"environment {self.spec.name!r}: step() raised {raised(e, 300)}"
                ) from e
            if observation is None:
                return None
            if not isinstance(observation, str):
                raise EnvError(
                    f"environment {self.spec.name!r}: step() returned "
                    f"{type(observation).__name__}; expected str (the observation) or None "
                    "(the episode is over)"
                )
            if not observation.strip() and "empty observation" not in self.spec.warned:
                self.spec.warned.add("empty observation")
                print(
                    f"gspo: warning: environment {self.spec.name!r}: step() returned an empty "
                    "observation, sent to the model as an empty user message (the episode "
                    "goes on; None ends it); shown once",
                    file=sys.stderr,
                    flush=True,
                )
            return [{"role": "user", "content": observation}]
        return None

    def plan(self, text: str) -> list[tuple[ToolCall, str | None, Any]] | None:
        """The calls of the model's turn ``text`` as ``(call, error, tool)`` (:meth:`check`)
        when each that runs is an ``async def`` tool's (run with other episodes' calls:
        :func:`gspo.environments.tool_turns.respond_all`); None: :meth:`respond` runs the turn."""
        checked = [(call, *self.check(call)) for call in self._calls(text)]
        running = [tool for _, error, tool in checked if error is None]
        if running and all(inspect.iscoroutinefunction(tool) for tool in running):
            return checked
        return None

    def _calls(self, text: str) -> list[ToolCall]:
        """The calls of a turn, read where its answer is (:func:`answer_text`: after a
        reasoning model's ``</think>``; a call drafted in the thinking is not run, as in
        TRL's and vLLM's parsers)."""
        return parse_tool_calls(answer_text(text)) if self.spec.tool_names else []

    def check(self, call: ToolCall) -> tuple[str | None, Any]:
        """``(error, tool)``: what ``call`` is answered with without running (None: it
        runs), and the tool it calls."""
        if call.error is not None:
            return call.error, None
        if call.name not in self.spec.tool_names:
            return f"unknown tool {call.name!r}; tools: {', '.join(self.spec.tool_names)}", None
        tool = getattr(self.env, call.name)
        try:
            signature = inspect.signature(tool)
            signature.bind(**call.arguments)
            defaults = {name: p.default for name, p in signature.parameters.items()}
            wrong = argument_error(self.spec.arguments[call.name], call.arguments, defaults)
        except TypeError as e:
            wrong = str(e)
        return (None if wrong is None else f"bad arguments for {call.name}: {wrong}"), tool

    def _answer(self, call: ToolCall) -> dict[str, Any]:
        error, tool = self.check(call)
        if error is not None:
            return self.reply(call, error=error)
        try:
            with self.spec.deadline(f"tool {call.name}()"):
                result = awaited(tool(**call.arguments))  # (async def: once never awaited)
        except EnvTimeout:
            raise
        except (Exception, SystemExit) as e:  # (sys.exit in user code: an error)
            return self.reply(call, failed=e)
        return self.reply(call, result=result)

    def reply(
        self, call: ToolCall, *, result: Any = None, error: str | None = None,
        failed: BaseException | None = None,
    ) -> dict[str, Any]:  # fmt: skip
        """The ``tool`` message answering ``call``: its ``result`` as text, else ``error``
        or what the tool raised (``failed``, said once on stderr), counted."""
        self.tool_calls += 1
        message = {"role": "tool", "name": call.name, "content": ""}
        if error is None and failed is None:
            try:
                message["content"] = tool_result_text(result)
                return message
            except NoText as e:  # (returned, not raised: no place in the tool to name)
                error = f"the tool returned {e}"
                self._warn(call.name, e, f"returned {e}")
            except Exception as e:  # (a __str__ of its own that raises)
                failed = e
        if failed is not None:
            said = one_line(failed, 200)  # (none: the type alone, "TimeoutError: " was sent)
            error = f"{type(failed).__name__}: {said}" if said else type(failed).__name__
            self._warn(call.name, failed)
        self.tool_errors += 1
        message["content"] = f"error: {error}"
        return message

    def close(self) -> None:
        """The environment's ``close()``, if it has one (after its episode is scored)."""
        close = getattr(self.env, "close", None)
        if callable(close):
            try:
                with self.spec.deadline("close()"):
                    awaited(close())
            except EnvTimeout:
                raise
            except (Exception, SystemExit) as e:  # (sys.exit in user code: an error)
                raise EnvError(
                    f"environment {self.spec.name!r}: close() raised {raised(e, 300)}"
                ) from e

    def _warn(self, tool: str, e: BaseException, did: str | None = None) -> None:
        """One line on stderr the first time a tool raises a given exception type (``did``:
        what it did instead of ``raised ...``)."""
        key = (tool, type(e).__name__)
        if key not in self.spec.warned:
            self.spec.warned.add(key)
            did = did or f"raised {raised(e, 200)}"
            print(
                f"gspo: warning: environment {self.spec.name!r}: tool {tool!r} {did}; "
                "returned to the model as an error, shown once",
                file=sys.stderr,
                flush=True,
            )
