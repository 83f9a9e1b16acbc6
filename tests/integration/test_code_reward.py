"""`code_tests` for real: each completion runs in a sandboxed subprocess (unshare, uid 65534 as root, rlimits,
the audit hook). Right code scores 1, wrong code 0, and hostile code 0 without hurting this process or the
machine. The OS layer is checked on its own too, with the audit hook taken out of the runner, so that what the
namespaces and limits stop is not credited to the hook (which is not a security boundary)."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import uuid

import pytest

from grpo_pipeline.trainer.rewards import describe, resolve_reward
from grpo_pipeline.trainer.rewards import sandbox as sandbox_module
from grpo_pipeline.trainer.rewards.base import RewardError
from grpo_pipeline.trainer.rewards.code import check_code_arguments, code_of, code_tests, tests_problem
from grpo_pipeline.trainer.rewards.sandbox import MAX_OUTPUT_BYTES, Limits, check_sandbox, run_python

# `make test-slow`: each hostile program runs to its limit in the sandbox; the code task through the data stage stays
# in the default run (tests/integration/test_code_task.py)
pytestmark = [pytest.mark.integration, pytest.mark.slow]

ADD = "def add(a, b):\n    return a + b\n"
ADD_TESTS = ["assert add(2, 3) == 5", "assert add(-1, 1) == 0", "assert add(0, 0) == 0"]
FIB_TESTS = "assert fib(1) == 1\nassert fib(2) == 1\nassert fib(10) == 55"
SLOW = 8.0  # generous: two cores shared with other work


def fenced(code: str, tag: str = "python") -> str:
    return f"Here is my solution:\n```{tag}\n{code}```\nIt adds the numbers."


@pytest.fixture
def listener():
    """A TCP listener on loopback that records whether anything connected."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    server.setblocking(False)
    yield server
    server.close()


def connected(server: socket.socket) -> bool:
    try:
        conn, _ = server.accept()
    except BlockingIOError:
        return False
    conn.close()
    return True


def test_right_code_passes_and_wrong_code_and_near_misses_fail():
    fib = "def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n"
    off_by_one = fib.replace("range(n)", "range(n + 1)")
    completions = [
        fenced(ADD),  # right, fenced
        ADD,  # right, no fence: the whole completion is the code
        [{"role": "assistant", "content": fenced(ADD, tag="")}],  # right, a message list, an untagged fence
        fenced("def add(a, b):\n    return a - b\n"),  # wrong
        fenced("def plus(a, b):\n    return a + b\n"),  # the wrong name: NameError in the tests
        fenced("def add(a, b)\n    return a + b\n"),  # does not compile
        "Sure! " + ADD,  # prose around unfenced code: does not compile
        fenced(fib),
        fenced(off_by_one),  # a near miss
        fenced("def fib(n):\n    return 1\n"),  # passes two of the three asserts
        # exiting 0 before the tests run is not passing them
        fenced("import sys\ndef add(a, b):\n    return 0\nsys.exit(0)\n"),
        fenced("import os\ndef add(a, b):\n    return 0\nos._exit(0)\n"),
    ]
    tests = [ADD_TESTS] * 7 + [FIB_TESTS] * 3 + [ADD_TESTS] * 2
    assert code_tests(completions, tests, timeout_s=SLOW) == [1.0, 1.0, 1.0] + [0.0] * 4 + [1.0] + [0.0] * 4


def test_the_last_fenced_block_is_the_code():
    text = "First try:\n```python\ndef add(a, b):\n    return 0\n```\nFixed:\n```python\n" + ADD + "```\n"
    assert code_of(text) == ADD
    assert code_of("```bash\nls\n```\nno python block") == "```bash\nls\n```\nno python block"
    assert code_tests([text], [ADD_TESTS], timeout_s=SLOW) == [1.0]


def test_hostile_code_scores_zero_and_leaves_this_process_and_the_machine_alone(listener, caplog, monkeypatch):
    port = listener.getsockname()[1]
    outside = f"/tmp/code_tests_escape_{uuid.uuid4().hex}"  # world-writable: only the audit hook stops this
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "hunter2-secret")
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "hunter3-secret")
    hostile = {
        "loop": "while True:\n    pass\n",
        "memory": "hog = []\nwhile True:\n    hog.append(bytearray(50 << 20))\n",
        "fork": "import os\nwhile True:\n    os.fork()\n",
        "socket": f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\n",
        "write": f"with open({outside!r}, 'w') as f:\n    f.write('out')\n",
        "ctypes": "import ctypes\nctypes.CDLL(None).kill(-1, 9)\n",
        "system": f"import os\nos.system('touch {outside}')\n",
        "secret": "import os\nSECRET = os.environ.get('AWS_SECRET_ACCESS_KEY')\n",
        "parent secret": f"SECRET = open('/proc/{os.getpid()}/environ', 'rb').read().decode()\n",
    }
    completions = [fenced(ADD)] + [fenced(code + ADD) for code in hostile.values()]
    tests = [ADD_TESTS] * 8 + ["assert 'hunter2' in SECRET"] * 2
    caplog.set_level(logging.WARNING, logger="grpo_pipeline.trainer.rewards.code")
    assert code_tests(completions, tests, timeout_s=SLOW, memory_mb=256) == [1.0] + [0.0] * len(hostile)
    assert not connected(listener)
    assert not os.path.exists(outside)
    reasons = "\n".join(r.getMessage() for r in caplog.records)
    for reason in (
        "timeout" if "timeout" in reasons else "cpu time",
        "memory",
        "os.fork",
        "socket",
        "open for writing",
    ):
        assert reason in reasons
    assert "import ctypes" in reasons and "os.system" in reasons
    # this process still starts processes, and scores the next batch
    assert subprocess.run(["true"], check=False).returncode == 0
    assert code_tests([fenced(ADD)], [ADD_TESTS], timeout_s=SLOW) == [1.0]


@pytest.fixture
def no_audit_hook(monkeypatch):
    """The runner without its audit hook: only the namespaces, the user and the limits stand."""
    runner = sandbox_module.RUNNER.replace("sys.addaudithook(hook)", "pass")
    assert runner != sandbox_module.RUNNER
    monkeypatch.setattr(sandbox_module, "RUNNER", runner)


def run(code: str, tests: str):
    return run_python(check_sandbox(), code, tests, Limits(timeout_s=SLOW, memory_mb=256))


def test_without_the_audit_hook_the_os_still_refuses_network_processes_and_secrets(
    no_audit_hook, listener, monkeypatch
):
    port = listener.getsockname()[1]
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "hunter2-secret")
    probe = f"""
import os, socket
try:
    socket.create_connection(("127.0.0.1", {port}), timeout=2).close()
    reached = True
except OSError:
    reached = False
forked = 0
try:
    for _ in range(1000):
        if os.fork() == 0:
            os._exit(0)
        forked += 1
except OSError:
    pass
secret = "hunter2" in repr(dict(os.environ))
parent = os.path.exists("/proc/{os.getpid()}/environ") and b"hunter2" in open("/proc/{os.getpid()}/environ", "rb").read()
"""
    outcome = run(probe, "assert not reached\nassert forked == 0\nassert not secret\nassert not parent")
    assert outcome.passed, outcome.output
    assert not connected(listener)
    fork_bomb = run("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n", "")
    assert not fork_bomb.passed and fork_bomb.hostile  # spins until killed, alone
    assert subprocess.run(["true"], check=False).returncode == 0


@pytest.mark.skipif(os.geteuid() != 0, reason="as root the program runs as 65534; otherwise as this user")
def test_without_the_audit_hook_root_owned_places_are_not_writable(no_audit_hook, tmp_path):
    target = f"/tmp/code_tests_root_{uuid.uuid4().hex}"
    os.mkdir(target, 0o755)  # readable by all, writable by root only
    try:
        outcome = run(f"open({target + '/x'!r}, 'w').write('out')\n", "")
        assert not outcome.passed and "PermissionError" in outcome.output
        assert os.listdir(target) == []
        assert run("import os\nassert os.getuid() == 65534 and os.getgid() == 65534\n", "").passed
    finally:
        os.rmdir(target)


def test_output_is_bounded_and_the_folder_is_removed():
    outcome = run("import os\nprint(os.getcwd())\nprint('x' * (10 << 20))\nassert False\n", "")
    assert not outcome.passed and not outcome.hostile
    assert len(outcome.output.encode()) <= MAX_OUTPUT_BYTES
    folder = outcome.output.splitlines()[0]
    assert "code_tests-" in folder and not os.path.exists(folder)


def test_tests_problem_names_rows_that_cannot_judge():
    assert tests_problem(ADD_TESTS) is None and tests_problem(FIB_TESTS) is None
    assert tests_problem("def check(f):\n    assert f(1) == 2\n\ncheck(add)") is None  # HumanEval, called
    assert tests_problem(None) == "the row has no tests"
    assert tests_problem([]) == "the tests are an empty list"
    assert tests_problem("  \n") == "the tests are empty"
    assert tests_problem(["assert f(1) == 2", 3]) == "the tests are a list holding a int, not only strings of Python"
    assert tests_problem(42) == "the tests are a int, not a string of Python or a list of strings"
    assert tests_problem("assert f(1) ==").startswith("the tests do not compile")
    assert "any code would pass" in tests_problem("def check(f):\n    assert f(1) == 2")
    assert "any code would pass" in tests_problem("x = 1")
    with pytest.raises(RewardError, match="row 0: the row has no tests"):
        code_tests([ADD], [None])


def test_the_reward_is_registered_and_refused_at_start_where_the_sandbox_cannot_run(monkeypatch):
    assert describe("code_tests")["columns"] == ["tests"]
    fn = resolve_reward("code_tests", {"timeout_s": SLOW})
    assert fn([fenced(ADD), "nothing"], tests=[ADD_TESTS, ADD_TESTS]) == [1.0, 0.0]
    with pytest.raises(RewardError, match="runs python only, not language='rust'"):
        resolve_reward("code_tests", {"language": "rust"})
    with pytest.raises(RewardError, match="timeout_s"):
        check_code_arguments(timeout_s=0)
    with pytest.raises(RewardError, match="memory_mb"):
        check_code_arguments(memory_mb=1.5)
    check_sandbox.cache_clear()
    monkeypatch.setattr(sandbox_module.shutil, "which", lambda _: None)
    try:
        with pytest.raises(RewardError, match="needs util-linux's `unshare`"):
            resolve_reward("code_tests")
        monkeypatch.undo()
        monkeypatch.setattr(sandbox_module, "_interpreters", lambda: ["/nonexistent/python3"])
        check_sandbox.cache_clear()
        with pytest.raises(RewardError, match="cannot set up its sandbox on this machine"):
            resolve_reward("code_tests")
    finally:
        monkeypatch.undo()
        check_sandbox.cache_clear()
    assert check_sandbox().python


def holders(marker: str) -> list[int]:
    """The host pids of the processes that hold a file open whose path names `marker`."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            links = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
        except OSError:  # gone, or not ours to look at
            continue
        if any(marker in link for link in links):
            found.append(int(pid))
    return found


@pytest.mark.parametrize("hook", ["with the audit hook", "without it"])
def test_a_program_that_leaves_its_process_group_dies_with_its_run(hook, request):
    """`os.setsid()` raises no audit event and takes the program out of the process group that is killed on
    overrun (and, as root, `unshare --kill-child`'s death signal is cleared by its setuid): the run must still
    leave nothing behind. The program holds a file open whose name is this test's marker, so the host can find
    it in /proc whatever its pid."""
    if hook == "without it":
        request.getfixturevalue("no_audit_hook")
    marker = f"alive-{uuid.uuid4().hex}"
    code = f"import os, time\nheld = open({marker!r}, 'w')\nos.setsid()\nprint('ready', flush=True)\ntime.sleep(120)\n"
    outcome = run_python(check_sandbox(), code, "", Limits(timeout_s=4.0, memory_mb=256))
    assert "ready" in outcome.output, outcome.output  # it got as far as leaving its process group
    assert not outcome.passed and outcome.hostile and outcome.reason.startswith("timeout")
    assert holders(marker) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="as root the runs are user 65534; otherwise this user")
def test_without_the_audit_hook_a_run_cannot_find_other_runs_folders(no_audit_hook):
    """All runs are user 65534: each one's folder sits, under a random name, in a folder of root's that others
    may pass through but not list, so a run cannot find (and rewrite) a concurrent run's files."""
    probe = (
        "import os, stat\ntry:\n    os.listdir('..')\n    listed = True\nexcept PermissionError:\n    listed = False\n"
    )
    probe += "mode = stat.S_IMODE(os.stat('.').st_mode)\n"
    assert run(probe, "assert not listed\nassert mode == 0o700, oct(mode)").passed


@pytest.mark.parametrize(
    "output",
    [
        "hello\n" + sandbox_module.MARKER,  # printed bare at the end
        "x" * (MAX_OUTPUT_BYTES - len(sandbox_module.MARKER)) + sandbox_module.MARKER,  # cut at the output limit
        sandbox_module.MARKER + "   \n\n",
        sandbox_module.MARKER * 3,
    ],
)
def test_a_marker_the_program_prints_scores_it_zero_and_never_raises(output):
    outcome = sandbox_module._outcome(0, output, False, Limits(), True)
    assert not outcome.passed and outcome.hostile
    assert outcome.reason == "refused by the sandbox"


def test_the_reason_never_carries_what_the_program_printed(caplog):
    leak = "import os\nprint('@@sandbox-refused@@ ' + repr(open('/etc/passwd').read()))\n"
    fake_event = "import sys\nsys.audit('socket.' + open('/etc/passwd').read().replace('\\n', '_'))\n"
    long_event = "import sys\nsys.audit('os.fork' + 'x' * 5000)\n"
    caplog.set_level(logging.WARNING, logger="grpo_pipeline.trainer.rewards.code")
    scores = code_tests(
        [leak, fake_event, long_event, fenced("import os\nos.fork()\n")], [ADD_TESTS] * 4, timeout_s=SLOW
    )
    assert scores == [0.0] * 4
    reasons = [r.getMessage().split(" scored 0: ", 1)[1] for r in caplog.records]
    assert sorted(reasons) == sorted(
        [
            "refused by the sandbox",
            "refused by the sandbox: socket.*",
            "refused by the sandbox: os.fork*",
            "refused by the sandbox: os.fork",
        ]
    ), reasons
    assert "root" not in "".join(reasons)
    with open("/etc/passwd") as f:
        assert f.readline().split(":")[0] not in "\n".join(r.getMessage() for r in caplog.records)


def test_tests_too_large_or_too_deep_to_compile_are_a_problem_not_a_crash():
    too_deep = "the tests are too deeply nested or too large to compile"
    assert tests_problem("assert " + "-" * 200000 + "1") == too_deep  # MemoryError in the parser
    assert tests_problem("assert 1" + "+1" * 300000) == too_deep  # RecursionError in the parser
    assert tests_problem(["assert 1" + "+1" * 300000]) == too_deep
