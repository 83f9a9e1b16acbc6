"""`code_tests`: a completion's Python code run against its row's tests in a sandbox (`sandbox.py`).

The row's `tests` column is Python that fails by raising: the `assert`s of an MBPP row's `test_list` (a list of
strings) or a HumanEval-style `test`, which must call its check function itself (e.g. end with `check(add)`):
nothing appends that call. `tests_problem` says why a row's tests cannot judge anything (tests that only define
`check` and call nothing among them, since any code would pass); the data stage quarantines such rows.
What the sandbox isolates, and what it does not: docs/security.md ("Code answers: `code_tests`").
"""

from __future__ import annotations

import ast
import logging
import math
import os
import re
from concurrent.futures import ThreadPoolExecutor

from grpo_pipeline.trainer.rewards.base import RewardError, completion_text
from grpo_pipeline.trainer.rewards.sandbox import Limits, check_sandbox, run_python

log = logging.getLogger(__name__)

LANGUAGES = ("python",)
# A fenced block tagged python (py, python3) or untagged; its fences on lines of their own.
_FENCE = re.compile(r"^[ \t]*```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)^[ \t]*```[ \t]*$", re.M | re.S | re.I)


def code_of(completion: str | list[dict]) -> str:
    """The completion's code: its last fenced code block (```python or ```), else the whole completion.

    >>> code_of("Here:\\n```python\\ndef f():\\n    return 1\\n```\\nDone.")
    'def f():\\n    return 1\\n'
    >>> code_of("def f():\\n    return 2")
    'def f():\\n    return 2'
    """
    text = completion_text(completion)
    blocks = _FENCE.findall(text)
    return blocks[-1] if blocks else text


def tests_problem(tests: object) -> str | None:
    """Why a row's tests cannot judge a completion, in words; None when they can: a string of Python, or a list
    of such strings, that compiles and asserts something at its top level or calls something that may.

    >>> tests_problem(["assert add(1, 2) == 3"]) is None
    True
    >>> tests_problem(""), tests_problem(None), tests_problem({"a": 1})
    ('the tests are empty', 'the row has no tests', 'the tests are a dict, not a string of Python or a list of strings')
    >>> tests_problem("def check(candidate):\\n    assert candidate(1) == 2")
    'the tests never assert anything at their top level nor call anything that may: any code would pass'
    >>> tests_problem("def check(candidate):\\n    assert candidate(1) == 2\\n\\ncheck(f)") is None
    True
    >>> tests_problem("assert 1" + "+1" * 300000)
    'the tests are too deeply nested or too large to compile'
    """
    if tests is None:
        return "the row has no tests"
    if isinstance(tests, list | tuple):
        if not tests:
            return "the tests are an empty list"
        wrong = [type(t).__name__ for t in tests if not isinstance(t, str)]
        if wrong:
            return f"the tests are a list holding a {wrong[0]}, not only strings of Python"
        source = _joined(tests)
    elif isinstance(tests, str):
        source = tests
    else:
        return f"the tests are a {type(tests).__name__}, not a string of Python or a list of strings"
    if not source.strip():
        return "the tests are empty"
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError) as exc:
        return f"the tests do not compile: {exc}"
    except (MemoryError, RecursionError):  # the parser's own limits: a long chain of operators, deep nesting
        return "the tests are too deeply nested or too large to compile"
    # A definition asserts nothing until it is called: top-level asserts, or top-level calls, or it passes all.
    top = [n for n in tree.body if not isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)]
    if not any(isinstance(n, ast.Assert | ast.Call | ast.Raise) for stmt in top for n in ast.walk(stmt)):
        return "the tests never assert anything at their top level nor call anything that may: any code would pass"
    return None


tests_problem.__test__ = False  # type: ignore[attr-defined]  # its name is pytest's test pattern: not a test


def _joined(tests: str | list[str] | tuple[str, ...]) -> str:
    return tests if isinstance(tests, str) else "\n\n".join(tests)


def check_code_arguments(timeout_s: float = 10.0, memory_mb: int = 512, language: str = "python") -> None:
    """`code_tests`'s arguments before any work, and whether this machine can give its sandbox (probed once
    per process): a `RewardError` naming the argument or what the machine lacks and the fix."""
    if language not in LANGUAGES:
        raise RewardError(f"reward 'code_tests' runs {', '.join(LANGUAGES)} only, not language={language!r}")
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float) or not 0 < timeout_s <= 600:
        raise RewardError(f"reward 'code_tests' needs timeout_s between 0 and 600 seconds, not {timeout_s!r}")
    if not math.isfinite(timeout_s):
        raise RewardError(f"reward 'code_tests' needs a finite timeout_s, not {timeout_s!r}")
    if isinstance(memory_mb, bool) or not isinstance(memory_mb, int) or not 64 <= memory_mb <= 65536:
        raise RewardError(f"reward 'code_tests' needs memory_mb, a whole number of MiB from 64, not {memory_mb!r}")
    check_sandbox()


def code_tests(
    completions: list,
    tests: list,
    *,
    timeout_s: float = 10.0,
    memory_mb: int = 512,
    language: str = "python",
    **_: object,
) -> list[float]:
    """1.0 when the completion's code, then the row's tests, run to the end without an error in the sandbox
    within the limits (`timeout_s` wall-clock and CPU seconds, `memory_mb` of address space); else 0.0.

    The code is the completion's last fenced code block (```python or ```), else the whole completion. It runs
    first, as a module named `solution`; the tests run after it in the same namespace, so they see its
    functions. Right means: the tests ran to their end and nothing raised (an `assert` that fails, a
    `NameError` for a function the code lacks, ...); exiting early, even with status 0, is not passing. Code that does not compile, runs too long, uses
    too much memory, or tries what the sandbox refuses (network, subprocesses, writes outside its folder,
    ctypes) scores 0 and is logged; it never stops the run. A row's completions run concurrently, at most one
    per CPU.

    >>> code_tests(
    ...     ["```python\\ndef add(a, b):\\n    return a + b\\n```", "def add(a, b):\\n    return a + b + 1"],
    ...     tests=[["assert add(2, 3) == 5", "assert add(-1, 1) == 0"]] * 2,
    ... )
    [1.0, 0.0]
    """
    check_code_arguments(timeout_s, memory_mb, language)
    box = check_sandbox()
    limits = Limits(timeout_s=float(timeout_s), memory_mb=memory_mb)

    def score(i: int) -> float:
        problem = tests_problem(tests[i])
        if problem is not None:
            raise RewardError(f"row {i}: {problem}")  # the data stage quarantines such rows: a bug if one gets here
        outcome = run_python(box, code_of(completions[i]), _joined(tests[i]), limits)
        if outcome.hostile:
            log.warning("code_tests: completion %d scored 0: %s", i, outcome.reason)
        return 1.0 if outcome.passed else 0.0

    n = len(completions)
    if len(tests) != n:
        raise RewardError(f"reward 'code_tests' got {len(tests)} rows of tests for {n} completions")
    if n == 0:
        return []
    with ThreadPoolExecutor(max_workers=min(n, len(os.sched_getaffinity(0)) or 1)) as pool:
        return list(pool.map(score, range(n)))


def code_tests_reference_problem(answer: str, tests: object = None) -> str | None:
    """Why a row cannot judge code (`tests_problem` of its tests), for the data stage's quarantine; the answer (a
    reference solution) is then run against them as any completion is.

    >>> code_tests_reference_problem("def f(): return 1", tests=None)
    'the row has no tests'
    """
    return tests_problem(tests)
