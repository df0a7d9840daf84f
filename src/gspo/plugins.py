"""User code named by a spec string, and its errors on one line.

:func:`load_object` loads the object a ``path/to/file.py:name`` or ``package.module:name``
spec names (reward functions, environments); :func:`one_line` and :func:`raised` put an
exception that user code (or a user's file) raised into a one-line message.
"""

from __future__ import annotations

import contextlib
import difflib
import hashlib
import importlib
import importlib.util
import inspect
import os
import re
import sys
import threading
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any


def missing_arguments(function: Callable[..., Any], given: list[str]) -> list[str]:
    """Required parameters of ``function`` (a user's reward function, environment class or
    method) that a call with the keywords ``given`` leaves unbound (none when its
    signature cannot be read, or it takes ``**kwargs`` for them)."""
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):
        return []
    required = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return [
        p.name
        for p in parameters
        if p.kind in required and p.default is inspect.Parameter.empty and p.name not in given
    ]


def unexpected_arguments(
    function: Callable[..., Any], given: list[str], *, follow_wrapped: bool = False
) -> list[str]:
    """Keywords in ``given`` that ``function`` has no parameter for (none when it takes
    ``**kwargs``, or its signature cannot be read). A decorated function is read as its
    wrapper takes them (``functools.wraps`` names the wrapped one, which a wrapper may
    call with fewer); ``follow_wrapped``: as the wrapped one does."""
    try:
        parameters = inspect.signature(function, follow_wrapped=follow_wrapped).parameters
    except (TypeError, ValueError):
        return []
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return []
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    accepted = {n for n, p in parameters.items() if p.kind in named}
    return [key for key in given if key not in accepted]


def takes_keyword(function: Callable[..., Any], key: str) -> bool:
    """Whether a call may pass ``function`` the keyword ``key``: a parameter of that name in
    its own signature, or ``**kwargs`` there and, where it is a decorated function, ``key``
    taken by the wrapped one (a wrapper's ``**kwargs`` passes them on to it)."""
    try:
        own = inspect.signature(function, follow_wrapped=False).parameters
    except (TypeError, ValueError):
        return True  # (unreadable: as unexpected_arguments reads it)
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    if key in own and own[key].kind in named:
        return True
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in own.values()):
        return False
    return not unexpected_arguments(function, [key], follow_wrapped=True)


def run_coroutine(coroutine: Any) -> Any:
    """What an ``async def`` function a user gave (a reward function, a tool) returned,
    awaited on one event loop that lives as long as the process, in a thread of its own
    (:func:`event_loop`). So what a call leaves bound to its loop (a subprocess's pipes,
    a client session, a task) serves the next call: a fresh loop per call (``asyncio.run``)
    broke such a tool at its second call ("attached to a different loop"). A wait that is
    interrupted (``rollout.env_timeout``) cancels the call."""
    import asyncio
    import concurrent.futures

    loop = event_loop()
    try:
        inside = asyncio.get_running_loop() is loop
    except RuntimeError:  # (no loop running in this thread)
        inside = False
    if inside:  # called from a coroutine on that loop: waiting there would block it
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            return pool.submit(asyncio.run, coroutine).result()
    future = asyncio.run_coroutine_threadsafe(coroutine, loop)
    try:
        return future.result()
    finally:  # (done: a no-op; an interrupted wait: the task is cancelled at its next await)
        future.cancel()


def awaited(value: Any) -> Any:
    """``value``, or what it returns when it is a coroutine (an ``async def`` method's call:
    :func:`run_coroutine`)."""
    return run_coroutine(value) if inspect.iscoroutine(value) else value


_LOOP: list[Any] = []  # [pid, loop]: the process's (a forked child makes its own)
_LOOP_LOCK = threading.Lock()


def event_loop() -> Any:
    """The process's event loop for user coroutines (:func:`run_coroutine`), started at the
    first use, running in a daemon thread."""
    import asyncio

    with _LOOP_LOCK:
        if not _LOOP or _LOOP[0] != os.getpid():
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, daemon=True, name="gspo-async").start()
            _LOOP[:] = [os.getpid(), loop]
        return _LOOP[1]


def one_line(exc: BaseException, limit: int = 500) -> str:
    """An exception's message on one line, at most ``limit`` characters."""
    text = " ".join(str(exc).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def counted(n: int, noun: str) -> str:
    """``1 row``, ``2 rows``: a count in a message, its noun agreeing."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


class Rows(list):
    """Rows some of which were left out (``data.drop_long_prompts``): ``numbers`` are the
    kept rows' numbers in their file (from 1), which messages about them name."""

    def __init__(self, rows: Any, numbers: list[int]):
        super().__init__(rows)
        self.numbers = numbers


def numbered(rows: Any) -> list[tuple[int, Any]]:
    """``(number, row)`` of each of ``rows``: its number in its file (:class:`Rows`), else
    its place, from 1."""
    numbers = getattr(rows, "numbers", None) or range(1, len(rows) + 1)
    return list(zip(numbers, rows, strict=True))


def some_of(found: list[int], total: int, noun: str) -> str:
    """``1 of 2 rows (row 2) has``, ``2 of 5 rows (row 1 first) have``: which of the
    ``total`` (numbered from 1) a message is about, the first of them and the verb."""
    first, verb = (
        (f"{noun} {found[0]}", "has") if len(found) == 1 else (f"{noun} {found[0]} first", "have")
    )
    return f"{len(found)} of {counted(total, noun)} ({first}) {verb}"


def raised(exc: BaseException, limit: int = 500) -> str:
    """``Type: message (at file.py:12; GSPO_DEBUG=1 shows the traceback)``: a raising
    user function's error on one line, with the place of the frame that raised it."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = f"at {frames[-1].filename}:{frames[-1].lineno}; " if frames else ""
    said = one_line(exc, limit)  # (none: "TimeoutError", not "TimeoutError: ")
    what = f"{type(exc).__name__}: {said}" if said else type(exc).__name__
    return f"{what} ({where}GSPO_DEBUG=1 shows the traceback)"


def _import_file(path_text: str, spec: str, kind: str, error: type[Exception]) -> Any:
    path = Path(path_text).expanduser()
    resolved = path if path.is_absolute() else Path.cwd() / path
    if not resolved.is_file():
        raise error(f"{kind} file not found: {path_text!r} (spec {spec!r}, looked for {resolved})")
    resolved = resolved.resolve()
    stem = re.sub(r"\W", "_", resolved.stem)
    digest = hashlib.sha1(str(resolved).encode()).hexdigest()[:12]
    module_name = f"_gspo_{kind.split()[0]}_{stem}_{digest}"
    import_spec = importlib.util.spec_from_file_location(module_name, resolved)
    if import_spec is None or import_spec.loader is None:
        raise error(f"cannot import {kind} file {str(resolved)!r} (spec {spec!r})")
    module = importlib.util.module_from_spec(import_spec)
    sys.modules[module_name] = module  # dataclasses, pickling etc. look the module up here
    directory = str(resolved.parent)
    sys.path.insert(0, directory)  # so the file can import its sibling modules
    try:
        import_spec.loader.exec_module(module)
    except Exception as e:
        sys.modules.pop(module_name, None)
        raise error(
            f"importing {kind} file {path_text!r} (spec {spec!r}) failed: "
            f"{type(e).__name__}: {one_line(e)}"
        ) from e
    finally:
        with contextlib.suppress(ValueError):
            sys.path.remove(directory)
    # ... and after it, last (nothing installed shadowed), for the imports its functions
    # make when called (a factory's `import my_env` beside it failed at its first call)
    if directory not in sys.path:
        sys.path.append(directory)
    return module


def _import_module(module_name: str, spec: str, kind: str, error: type[Exception]) -> Any:
    """``module_name`` imported; from the current directory too, as ``python -m`` would
    find it (the ``gspo`` console script does not put it on ``sys.path``)."""
    try:
        try:
            return importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            here = str(Path.cwd())
            if e.name != module_name.split(".")[0] or here in sys.path or "" in sys.path:
                raise
            sys.path.insert(0, here)
            try:
                return importlib.import_module(module_name)
            finally:
                with contextlib.suppress(ValueError):
                    sys.path.remove(here)
    except Exception as e:
        raise error(
            f"importing module {module_name!r} for {kind} {spec!r} failed: "
            f"{type(e).__name__}: {one_line(e)}"
        ) from e


#: How :func:`object_spec` writes an object no spec can load again (``<python object f>``).
PYTHON_OBJECT = "<python object "


#: The forms an environment spec takes (``rollout.environment``), as its errors say them.
ENVIRONMENT_FORMS = "'path/to/env.py:Factory' or 'package.module:Factory'"


def is_file_source(source: str) -> bool:
    """Whether a spec's ``source`` (before its ``:``) is a file's path, not a module's name."""
    return source.endswith(".py") or "/" in source or "\\" in source


def spec_form(spec: str, kind: str, expected: str) -> str | None:
    """What is malformed in a ``source:attribute`` spec, read as text alone (no file is
    read, nothing imported: ``gspo config`` and a config made in Python check it), or None.
    ``kind`` and ``expected`` as :func:`load_object` takes them."""

    def malformed(why: str) -> str:
        return f"invalid {kind} spec {spec!r}: {why}; expected {expected}"

    if ":" not in spec:
        module, _, name = spec.rpartition(".")
        dotted = module and name.isidentifier() and not spec.endswith(".py")
        hint = f" ({module}:{name}?)" if dotted else ""
        return malformed(f"no ':name' part{hint}")
    source, _, attr_path = spec.rpartition(":")
    source, attr_path = source.strip(), attr_path.strip()
    if not source:
        return malformed("missing the file or module before ':'")
    if not attr_path or not all(part.isidentifier() for part in attr_path.split(".")):
        return malformed(f"{attr_path!r} after ':' is not a Python name")
    if not is_file_source(source) and not all(part.isidentifier() for part in source.split(".")):
        return malformed(f"{source!r} is neither a .py file nor a module name")
    return None


# The override that names again what a run was given as a Python object, by ``kind``.
OBJECT_OVERRIDES = {
    "reward function": "'reward.functions=[file.py:name, ...]'",
    "environment": "rollout.environment=file.py:Name",
}


def load_object(spec: str, kind: str, error: type[Exception], expected: str) -> Any:
    """The object a ``source:attribute`` spec names (``attribute`` may be dotted).

    ``source`` is a ``.py`` file (relative to the current directory, or absolute; imported
    under a unique module name with its directory first on ``sys.path`` while it is
    imported, last after that) or
    a module name. ``kind`` names what is loaded in messages ("reward function"), ``error``
    is the exception raised, ``expected`` describes the accepted forms for a malformed spec.
    The object must be callable.
    """

    if spec.startswith(PYTHON_OBJECT):  # what a config.yaml records of an object given
        override = OBJECT_OVERRIDES.get(kind, "KEY=path/to/file.py:name")
        raise error(
            f"{kind} {spec}: the run was given it as a Python object, which no spec loads; "
            "give it again: from Python in the config (gspo.train(config, DIR, resume=True), "
            "gspo.evaluate(DIR, config=config)), or as path/to/file.py:name in an override "
            f"(gspo train --resume DIR {override}, gspo eval DIR {override})"
        )
    if (problem := spec_form(spec, kind, expected)) is not None:
        raise error(problem)
    source, _, attr_path = spec.rpartition(":")
    source, attr_path = source.strip(), attr_path.strip()
    if is_file_source(source):
        module = _import_file(source, spec, kind, error)
        where = f"file {source!r}"
    else:
        module = _import_module(source, spec, kind, error)
        where = f"module {source!r}"
    obj: Any = module
    for part in attr_path.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            available = sorted(
                name
                for name, value in vars(module).items()
                if callable(value) and not name.startswith("_")
                and getattr(value, "__module__", None) == module.__name__
            )  # fmt: skip
            near = difflib.get_close_matches(part, available, n=1)
            more = f", and {len(available) - 20} more" if len(available) > 20 else ""
            hint = f" (defined there: {', '.join(available[:20])}{more})" if available else ""
            hint = f"; did you mean {near[0]!r}?{hint}" if near else hint
            raise error(f"{kind} {spec!r}: {where} has no attribute {attr_path!r}{hint}") from None
    if not callable(obj):
        raise error(
            f"{kind} {spec!r}: {attr_path!r} in {where} is not callable "
            f"(it is a {type(obj).__name__})"
        )
    return obj


def absolute_spec(spec: Any, find: Callable[[str], Path | None] | None = None) -> Any:
    """A ``path/to/file.py:name`` spec with its file made absolute (an existing file
    named relative to the current directory), so a run resumed from elsewhere loads the
    same file; anything else (``module:name``, objects, a file not there) as it is.
    ``find(source)``: the file's absolute place, or None (default: where it exists)."""
    if not isinstance(spec, str) or ":" not in spec or spec.startswith(PYTHON_OBJECT):
        return spec
    source, _, name = spec.rpartition(":")
    if not (source.strip().endswith(".py") or "/" in source):
        return spec
    if find is None:
        path = Path(source.strip()).expanduser()
        where = path.resolve() if path.exists() else None
    else:
        where = find(source.strip())
    return spec if where is None or not where.is_file() else f"{where}:{name}"


def object_spec(obj: Any) -> str:
    """A spec string for ``obj`` that :func:`load_object` loads back: ``module:qualname``
    when the object is what that names (a function of an importable module), else
    ``<python object NAME>`` (a function of the main script, a lambda, a closure, a
    callable instance), which records what it was but cannot be loaded."""
    module_name = getattr(obj, "__module__", None)
    qualname = getattr(obj, "__qualname__", None)
    if (
        isinstance(module_name, str) and isinstance(qualname, str)
        and module_name not in ("__main__", "__mp_main__")
        and not module_name.startswith("_gspo_")  # a file loaded by path: its path is lost
        and "<" not in qualname
    ):  # fmt: skip
        found: Any = sys.modules.get(module_name)
        for part in qualname.split("."):
            found = getattr(found, part, None)
        if found is obj:
            return f"{module_name}:{qualname}"
    name = getattr(obj, "__name__", None) or type(obj).__name__
    return f"{PYTHON_OBJECT}{name}>"
