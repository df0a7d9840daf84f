"""The ``code`` reward's tests: the program in a completion, a row's tests in the forms
docs/code_reward.md lists, and APPS/TACO's call-based tests (``fn_name``).

Call-based tests run in the sandbox of :mod:`gspo.rewards.sandbox` behind a harness that
calls the function (or ``Solution().fn_name``, LeetCode's form) with each test's arguments
under a per-test CPU limit and writes each result back as JSON; the results are compared
with the expected outputs here, in the trainer: the expected outputs never enter the
program's process, so a program cannot read them there, and a result whose ``==`` is
always true is compared by its JSON value, not by its own ``==``.
"""

from __future__ import annotations

import ast
import contextlib
import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from gspo.rewards.thinking import THINK, answer_text

__all__ = [
    "QUIET",
    "CodeTest",
    "call_harness",
    "calls_passed",
    "extract_code",
    "parse_tests",
    "program_of",
    "same_output",
    "same_value",
]

_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)```", re.DOTALL)
_PYTHON_TAGS = {"python", "py", "python3"}
_IO_LISTS = (("inputs", "outputs"), ("input", "output"))  # (APPS's; CodeContests')
#: A harness's ``_quiet()``: a copy of standard output for its verdicts (an argument of
#: ``_run``, held by no name the program reaches), then the program's standard output
#: and error ``/dev/null`` (its debugging prints filled the 1 MB output cap: the process
#: was killed and the tests after scored 0).
QUIET = (
    "def _quiet(os=__import__('os')):\n    fd = os.dup(1)\n"
    "    null = os.open(os.devnull, os.O_WRONLY)\n    os.dup2(null, 1)\n"
    "    os.dup2(null, 2)\n    os.close(null)\n    return fd\n"
)
#: Relative and absolute tolerance of a float result against its expected number.
FLOAT_TOLERANCE = 1e-9
#: Relative and absolute tolerance of a decimal number on standard output (checkers' 1e-6).
OUTPUT_TOLERANCE = 1e-6
_INTEGER = re.compile(r"[+-]?\d+")


@dataclass(frozen=True)
class CodeTest:
    """One test: Python statements run after the program (``code``), stdin -> stdout, or
    a call of ``fn_name`` with ``args`` (a JSON list) expected to return ``expected`` (JSON).
    """

    code: str | None = None
    stdin: str | None = None
    stdout: str | None = None
    fn_name: str | None = None
    args: str | None = None
    expected: str | None = None


def extract_code(text: str) -> str | None:
    """The program in a completion: its last fenced Python block, else its last fenced block.

    Returns None when the completion has no fenced block (```` ``` ```` ... ```` ``` ````).
    """
    return _last_program(_FENCE.findall(text))


def _last_program(blocks: Sequence[tuple[str, str]]) -> str | None:
    if not blocks:
        return None
    python = [body for tag, body in blocks if tag.lower() in _PYTHON_TAGS]
    return (python or [body for _, body in blocks])[-1]


def program_of(completion: Any, prompt: Any = None) -> str | None:
    """The program in a completion (text, or a conversation: a multi-turn episode's
    messages): :func:`extract_code` over the blocks of all its assistant messages, the
    last one's last; the other roles' (a tool's output, the user's) are not the model's.
    (It read the last assistant message alone: an episode whose final turn said "done,
    see above" scored 0 with its program a turn earlier.) Of each message only its answer
    is read (:func:`answer_text`: after a reasoning model's ``</think>``), as the math
    rewards read theirs: a draft in the thinking is not the program (it was, where the
    answer had no fenced block). After a ``prompt`` that opened the thinking (a template
    ending in ``<think>``), the first turn's text before ``</think>`` is thinking too; after
    ``<think>`` itself (a chat template that opens every turn's thinking), each turn's."""
    if isinstance(completion, list) and all(isinstance(m, dict) for m in completion):
        turns = [m for m in completion if m.get("role") == "assistant"] or completion[-1:]
        every = prompt == THINK  # (the chat template opened each turn's thinking)
        opened = [prompt if k == 0 or every else None for k in range(len(turns))]
        answers = [answer_text(m, p) for m, p in zip(turns, opened, strict=True)]
        return _last_program([b for text in answers for b in _FENCE.findall(text)])
    return extract_code(answer_text(completion, prompt))


def _io_case(item: Any, where: str) -> CodeTest:
    for key_in, key_out in (("input", "output"), ("stdin", "stdout")):
        if _has(item, key_in, key_out):
            text = [_io_text(item[key], where) for key in (key_in, key_out)]
            return CodeTest(stdin=text[0], stdout=text[1])
    raise ValueError(f"{where}: expected an assert snippet or {{'input': ..., 'output': ...}}")


def _io_text(value: Any, where: str) -> str:
    """An input or output as text; a list or dict (its repr on stdin scored 0) refused."""
    if isinstance(value, (list, tuple, dict)):
        raise ValueError(f"{where}: an input/output test's input and output are text (stdin, "
                         f"stdout), not {type(value).__name__} {value!r:.60}")  # fmt: skip
    return str(value)


def _parses(text: str, where: str) -> ast.Module:
    """``text`` parsed; refused where a comparison's result is thrown away (``f(1) == 2``
    with no ``assert``: it passed whatever the program returned)."""
    try:
        module = ast.parse(text)
    except SyntaxError as exc:
        raise ValueError(f"{where}: tests do not parse as Python ({exc.msg})") from exc
    for node in ast.walk(module):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Compare):
            line = ast.get_source_segment(text, node) or ast.unparse(node)
            raise ValueError(f"{where}: {line!r:.70} (line {node.lineno}) compares and throws "
                             f"the result away, passing whatever the program does: write "
                             f"assert {line:.60}")  # fmt: skip
    return module


def _checks(module: ast.Module) -> bool:
    """Whether a snippet can fail other than by an error: an ``assert``, a ``raise`` or a
    call of an ``assert...`` function (``np.testing.assert_allclose``, ``assertEqual``)
    run at its top level, or in a function it defines and some statement calls
    (HumanEval's ``def check(candidate): assert ...`` then ``check(f)``; uncalled, it
    passed anything)."""
    defs = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    run = [node for node in module.body if not isinstance(node, defs)]
    if any(_has_check(node) for node in run):
        return True
    checking = {n.name for n in module.body if isinstance(n, defs) and _has_check(n)}
    # (one of them named where something is called, check(f), map(check, cases), c = check:
    # an uncalled check beside print('checking') passed anything)
    nodes = [n for node in run for n in ast.walk(node)]
    names = {n.id if isinstance(n, ast.Name) else n.attr for n in nodes
             if isinstance(n, (ast.Name, ast.Attribute))}  # fmt: skip
    return any(isinstance(n, ast.Call) for n in nodes) and bool(names & checking)


def _has_check(tree: ast.AST) -> bool:
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assert, ast.Raise)):
            return True
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if "assert" in name.lower():
                return True
    return False


def _assert_cases(text: str, where: str) -> list[CodeTest]:
    """Each top-level ``assert`` is a test; other statements before it are its set-up.
    Without one, the whole text is one test where it calls a function of its own that
    asserts (HumanEval's ``def check(candidate): ...`` and ``check(f)``)."""
    module = _parses(text, where)
    cases: list[CodeTest] = []
    setup: list[str] = []
    for node in module.body:
        segment = ast.get_source_segment(text, node) or ast.unparse(node)
        if isinstance(node, ast.Assert):
            cases.append(CodeTest(code="\n".join([*setup, segment])))
        else:
            setup.append(segment)
    if not cases and _checks(module):  # (HumanEval's def check(candidate): ...; check(f))
        return [CodeTest(code=text)]
    if not cases and _has_check(module):  # (refused: "no assert statement")
        raise ValueError(
            f"{where}: its asserts are inside functions it never calls (HumanEval's "
            "def check(candidate): ...): add the call, check(f)"
        )
    if not cases:
        raise ValueError(f"{where}: no assert statement among the tests")
    return cases


def _json(value: Any, what: str, where: str) -> str:
    try:
        return json.dumps(value)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{where}: call-based tests: {what} is not JSON ({exc})") from None


def _paired(inputs: Sequence[Any], outputs: Sequence[Any], where: str) -> None:
    """One row's test inputs and outputs: as many of each, and some."""
    if len(inputs) != len(outputs):
        raise ValueError(f"{where}: {len(inputs)} inputs but {len(outputs)} outputs")
    if not inputs:
        raise ValueError(f"{where}: no tests (empty inputs and outputs)")


def _call_cases(tests: dict, where: str) -> list[CodeTest]:
    """APPS/TACO's ``{"fn_name": f, "inputs": [[args], ...], "outputs": [out, ...]}``: each
    input the list of positional arguments of one call."""
    name, inputs, outputs = tests["fn_name"], tests.get("inputs"), tests.get("outputs")
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"{where}: call-based tests: fn_name {name!r} is not a Python name")
    if not isinstance(inputs, (list, tuple)) or not isinstance(outputs, (list, tuple)):
        raise ValueError(f"{where}: call-based tests (fn_name {name!r}) need lists 'inputs' "
                         "(each a list of arguments) and 'outputs'")  # fmt: skip
    _paired(inputs, outputs, where)
    cases = []
    for k, (args, out) in enumerate(zip(inputs, outputs, strict=True)):
        if not isinstance(args, (list, tuple)):
            raise ValueError(f"{where}: call-based tests (fn_name {name!r}): inputs[{k}] is "
                             f"{type(args).__name__} {args!r:.60}, not the list of the call's "
                             "arguments ([[1, 2]] calls f(1, 2))")  # fmt: skip
        call = _json(list(args), f"inputs[{k}]", where)
        cases.append(CodeTest(fn_name=name, args=call, expected=_json(out, f"outputs[{k}]", where)))
    return cases


def parse_tests(tests: Any, where: str = "tests") -> list[CodeTest]:
    """The test cases of one dataset row.

    Accepted forms (a JSON string of any of them too): a string of Python with ``assert``
    statements (each top-level assert is one test, earlier statements its set-up); a list of
    such strings (each one test); a list of ``{"input": ..., "output": ...}`` (or
    ``stdin``/``stdout``) pairs; ``{"inputs": [...], "outputs": [...]}`` (CodeContests'
    ``{"input": [...], "output": [...]}`` too); with ``fn_name``,
    call-based tests (each input the arguments of one call). Raises ValueError naming
    ``where`` for anything else.
    """
    if isinstance(tests, str):
        stripped = tests.strip()
        if stripped[:1] in "[{":
            with contextlib.suppress(json.JSONDecodeError):
                return parse_tests(json.loads(stripped), where)
        return _assert_cases(tests, where)
    if isinstance(tests, dict) and tests.get("fn_name"):  # (APPS/TACO's call-based tests)
        return _call_cases(tests, where)
    keys = next((k for k in _IO_LISTS if _has(tests, *k)), None)
    if keys is not None and (keys[0] == "inputs" or isinstance(tests[keys[0]], list)):
        inputs, outputs = tests[keys[0]], tests[keys[1]]  # (CodeContests': input, output)
        if not isinstance(inputs, (list, tuple)) or not isinstance(outputs, (list, tuple)):
            raise ValueError(f"{where}: {keys[0]!r} and {keys[1]!r} are lists of the tests' "
                             f"standard input and output, not {type(inputs).__name__} and "
                             f"{type(outputs).__name__}")  # fmt: skip
        _paired(inputs, outputs, where)
        pairs = zip(inputs, outputs, strict=True)
        return [CodeTest(stdin=_io_text(i, where), stdout=_io_text(o, where)) for i, o in pairs]
    if isinstance(tests, Sequence) and not tests:
        raise ValueError(f"{where}: no tests (an empty list)")
    if isinstance(tests, Sequence):
        cases: list[CodeTest] = []
        for k, item in enumerate(tests):
            if isinstance(item, str):  # (one that did not compile scored every test 0)
                if not _checks(_parses(item, f"{where}[{k}]")):  # (one passed anything)
                    raise ValueError(f"{where}[{k}]: the test {item!r:.60} runs no assert "
                                     "(none at its top level, none in a function it calls), "
                                     "so it passes whatever the program returns: write "
                                     "assert f(1) == 2")  # fmt: skip
                cases.append(CodeTest(code=item))
            else:
                cases.append(_io_case(item, f"{where}[{k}]"))
        return cases
    raise ValueError(f"{where}: expected assert statements, a list of tests or input/output pairs")


def _has(tests: Any, *keys: str) -> bool:
    """Whether ``tests`` is a mapping holding ``keys`` (a Parquet column of mappings with
    other rows' keys holds None under them: a TypeError traceback, or the wrong form)."""
    return isinstance(tests, dict) and all(tests.get(key) is not None for key in keys)


def call_harness(program: str, cases: Sequence[CodeTest], nonce: str, test_cpu_s: float) -> str:
    """A script (fed on stdin) that runs ``program``, then calls each case's function with
    its arguments, writing ``NONCE I ok JSON`` (or ``error``, ``timeout``) per case to a copy
    of standard output's descriptor taken before the program runs.

    Each call gets ``test_cpu_s`` CPU seconds (``ITIMER_PROF``) and twice that on the wall
    clock (``ITIMER_REAL``); a call that outlives either is a timeout even when it caught
    the exception and returned. ``Solution().fn_name`` (a new instance per call) is called
    where the program defines a class ``Solution`` with that method, else ``fn_name``.
    The program runs as a module named ``solution``, not ``__main__``, as APPS's checker
    runs it: its ``if __name__ == "__main__":`` block (reading input that is not there:
    a right function scored 0) does not run."""
    calls = tuple((case.fn_name, case.args) for case in cases)
    return (
        "def _run(program, calls, mark, write, fd, cpu, signal, dumps, loads, module,\n"
        "         compile=compile, exec=exec, enumerate=enumerate, getattr=getattr,\n"
        "         hasattr=hasattr, isinstance=isinstance, type=type,\n"
        "         BaseException=BaseException):\n"
        "    fired = []\n"
        "    class Late(BaseException):\n"
        "        pass\n"
        "    def late(*_):\n"
        "        fired.append(1)\n"
        "        raise Late\n"
        "    ns = module.__dict__\n"
        "    try:\n"
        "        exec(compile(program, '<completion>', 'exec'), ns)\n"
        "    except BaseException:\n"
        "        return\n"
        "    for i, (name, args) in enumerate(calls):\n"
        "        del fired[:]\n"
        "        status, payload = 'error', ''\n"
        "        try:\n"
        "            signal.signal(signal.SIGPROF, late)\n"
        "            signal.signal(signal.SIGALRM, late)\n"
        "            signal.setitimer(signal.ITIMER_PROF, cpu)\n"
        "            signal.setitimer(signal.ITIMER_REAL, 2 * cpu)\n"
        "            try:\n"
        "                cls = ns.get('Solution')\n"
        "                if isinstance(cls, type) and hasattr(cls, name):\n"
        "                    fn = getattr(cls(), name)\n"
        "                else:\n"
        "                    fn = ns[name]\n"
        "                result = fn(*loads(args))\n"
        "            finally:\n"
        "                signal.setitimer(signal.ITIMER_PROF, 0)\n"
        "                signal.setitimer(signal.ITIMER_REAL, 0)\n"
        "            payload = dumps(result)\n"
        "            status = 'ok'\n"
        "        except BaseException:\n"
        "            pass\n"
        "        if fired:\n"
        "            status, payload = 'timeout', ''\n"
        "        write(fd, ('\\n%s %d %s %s\\n' % (mark, i, status, payload)).encode())\n"
        f"import json as _json, os as _os, signal as _signal, sys as _sys, types as _types\n"
        f"{QUIET}_module = _sys.modules['solution'] = _types.ModuleType('solution')\n"
        f"_run({program!r}, {calls!r}, {nonce!r}, _os.write, _quiet(), {float(test_cpu_s)!r},\n"
        "     _signal, _json.dumps, _json.loads, _module)\n"
    )


def calls_passed(stdout: str, cases: Sequence[CodeTest], nonce: str) -> int:
    """How many of ``cases`` the harness's output (:func:`call_harness`) shows passed."""
    results: dict[int, str] = {}
    for line in stdout.splitlines():
        parts = line.split(" ", 3)
        if len(parts) == 4 and parts[0] == nonce and parts[2] == "ok" and parts[1].isdigit():
            results.setdefault(int(parts[1]), parts[3])
    passed = 0
    for i, case in enumerate(cases):
        if i in results:
            with contextlib.suppress(ValueError):
                passed += same_value(json.loads(results[i]), json.loads(case.expected or "null"))
    return passed


def same_output(got: str, want: str) -> bool:
    """Whether a program's standard output is the expected one, as competitive programming
    checkers (and verl's) read it: token by token, whatever whitespace is between (spaces,
    line breaks), a token the expected output writes as a decimal (``0.333333``, ``1e-3``,
    not ``3``) matching a number within ``OUTPUT_TOLERANCE`` (relative or absolute)."""
    tokens, wanted = got.split(), want.split()
    return len(tokens) == len(wanted) and all(
        a == b or _close(a, b) for a, b in zip(tokens, wanted, strict=True)
    )


def _close(got: str, want: str) -> bool:
    if _INTEGER.fullmatch(want):  # (an integer is exact: 10**9 + 1 is not 10**9)
        return False
    try:
        a, b = float(got), float(want)
    except ValueError:
        return False
    tol = OUTPUT_TOLERANCE
    return math.isfinite(b) and math.isclose(a, b, rel_tol=tol, abs_tol=tol)


def same_value(got: Any, want: Any) -> bool:
    """Whether a call's result (JSON-decoded: tuples are lists) is the expected output:
    equal, or the one element of a one-element list (APPS stores ``3`` as ``[3]``). Types
    count (``"3"`` is not ``3``, ``True`` not ``1``) except int against float, and floats
    match within ``FLOAT_TOLERANCE`` (relative or absolute)."""
    if _equal(got, want):
        return True
    return isinstance(want, list) and len(want) == 1 and _equal(got, want[0])


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        if isinstance(a, int) and isinstance(b, int):
            return a == b
        tol = FLOAT_TOLERANCE
        try:
            return math.isclose(a, b, rel_tol=tol, abs_tol=tol) or (math.isnan(a) and math.isnan(b))
        except OverflowError:  # (an int beyond a float's range)
            return False
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b
