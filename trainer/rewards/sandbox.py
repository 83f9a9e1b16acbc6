"""Run untrusted Python (a completion's code and its row's tests) in a throwaway process sandbox.

One run (`run_python`) is one fresh process, started as

    unshare --net --pid --ipc --mount-proc --fork --kill-child [--setuid 65534 --setgid 65534 | --map-root-user]
        -- python3 -I -S -B -X utf8 -c RUNNER LIMITS...

in a new temporary folder (its working directory, removed afterwards), with an empty environment, stdin closed,
and stdout + stderr captured through one pipe, of which the first `MAX_OUTPUT_BYTES` are kept. What that gives,
and what it does not, is in docs/security.md ("Code answers: `code_tests`"); in short:

- no network: a new network namespace has only a loopback device, down;
- no other processes: a new PID namespace (the program is its PID 1 and sees only itself in /proc), and
  RLIMIT_NPROC 0, so `fork`, threads and subprocesses fail;
- bounded: wall time (the parent SIGKILLs the whole process group, which takes the namespace with it), CPU time
  (RLIMIT_CPU), address space (RLIMIT_AS), file size (RLIMIT_FSIZE), open files, no core dumps;
- as root, the program runs as the unprivileged user 65534 (`nobody`): it can write only where anyone may
  (its folder, and world-writable places such as /tmp); not root, it runs as the calling user in a user
  namespace, and can write wherever that user can;
- a Python audit hook refuses writes outside the folder, sockets, subprocesses, exec, fork, signals to other
  processes and ctypes: defence in depth only, since audit hooks are not a security boundary.

`check_sandbox()` probes once per process whether all of that can be set up here, and raises `RewardError`
naming what is missing and the fix if not.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from grpo_pipeline.trainer.rewards.base import RewardError

SANDBOX_UID = SANDBOX_GID = 65534  # nobody / nogroup on Debian and most distributions
MAX_OUTPUT_BYTES = 64 << 10  # kept of a run's output; the rest is read and dropped
MAX_FILE_BYTES = 8 << 20  # RLIMIT_FSIZE: the largest file the program may write
MAX_OPEN_FILES = 64
MARKER = "@@sandbox-refused@@"  # the audit hook's line on stderr; a program that prints it only scores itself 0

# What the child's exit says (besides 0: passed, and a signal).
EXIT_FAILED, EXIT_COMPILE, EXIT_MEMORY, EXIT_REFUSED, EXIT_CPU = 1, 2, 3, 4, 5

# Runs in the child before any of its code: limits, the audit hook, then the program, then the tests, in one
# namespace. It is trusted; everything after `sys.addaudithook` is not.
RUNNER = r"""
import os, resource, signal, sys
cpu_s, memory, fsize, nofile, result_fd = (int(a) for a in sys.argv[1:6])
with open(".nonce", "rb") as f:  # the parent's proof that the tests ran to their end; gone before the program runs
    finished = (lambda nonce: lambda: os.write(result_fd, nonce))(f.read())
os.remove(".nonce")
for limit, value in ((resource.RLIMIT_CPU, (cpu_s, cpu_s + 1)), (resource.RLIMIT_AS, (memory, memory)),
                     (resource.RLIMIT_FSIZE, (fsize, fsize)), (resource.RLIMIT_NOFILE, (nofile, nofile)),
                     (resource.RLIMIT_CORE, (0, 0)), (resource.RLIMIT_NPROC, (0, 0))):
    resource.setrlimit(limit, value)
# As PID 1 of its namespace the program ignores signals it has no handler for (SIGXCPU, SIGXFSZ included).
signal.signal(signal.SIGXCPU, lambda *_: os._exit(5))
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
with open("solution.py", encoding="utf-8") as f:
    code = f.read()
with open("tests.py", encoding="utf-8") as f:
    tests = f.read()
home = os.path.realpath(os.getcwd())
refused = []
WRITES = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC
BLOCKED = ("socket.", "subprocess.", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty",
           "os.system", "os.kill", "os.killpg", "signal.pthread_kill", "ctypes.", "pty.", "os.setuid",
           "os.setgid", "os.setresuid", "os.setresgid", "os.chroot", "os.unshare", "os.setns")
PATHS = ("os.remove", "os.rmdir", "os.mkdir", "os.rename", "os.symlink", "os.link", "os.truncate", "os.chmod",
         "os.chown", "os.chflags", "os.utime", "os.mkfifo", "os.mknod", "os.setxattr", "os.removexattr")
def inside(path):
    if isinstance(path, int):
        return True  # an fd: opening it was checked
    try:
        full = os.path.realpath(os.fsdecode(os.fspath(path)))
    except (TypeError, ValueError):
        return False
    return full == home or full.startswith(home + os.sep)
def refuse(event, detail):
    refused.append(event)
    try:
        os.write(2, ("\n" + MARKER + " " + event + " " + detail + "\n").encode())
    except OSError:
        pass
    raise PermissionError("the sandbox refuses " + event + " " + detail)
def hook(event, args):
    if event == "open":
        path, mode, flags = (tuple(args) + (None, None))[:3]
        writes = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
            isinstance(flags, int) and flags & WRITES)
        if writes and not inside(path):
            refuse(event, "for writing: " + repr(path))
    elif event == "import" and args and args[0] in ("ctypes", "_ctypes"):
        refuse(event, args[0])
    elif event.startswith(BLOCKED):
        refuse(event, repr(args)[:200])
    elif event.startswith(PATHS):
        bad = [a for a in args if isinstance(a, (str, bytes, os.PathLike)) and not inside(a)]
        if bad:
            refuse(event, repr(bad[0]))
MARKER = sys.argv[6]
sys.addaudithook(hook)
del f
status = 0
scope = {"__name__": "solution", "__builtins__": __builtins__}
try:
    try:
        program = compile(code, "solution.py", "exec")
    except (SyntaxError, ValueError) as exc:
        print("the code does not compile:", exc, file=sys.stderr)
        status = 2
    else:
        exec(program, scope)
        exec(compile(tests, "tests.py", "exec"), scope)
        if not refused:
            finished()
except MemoryError:
    status = 3
except BaseException:  # SystemExit too: exiting, even with 0, before the tests end is not passing them
    import traceback
    traceback.print_exc()
    status = 1
sys.stdout.flush()
os._exit(4 if refused else status)
"""


@dataclasses.dataclass(frozen=True)
class Limits:
    """One run's limits: wall and CPU seconds, memory (address space) in MiB."""

    timeout_s: float = 10.0
    memory_mb: int = 512


@dataclasses.dataclass(frozen=True)
class Outcome:
    """How a run ended: `passed`, else `reason` in words; `hostile` when the program broke a limit or tried
    something the sandbox refuses (logged as a warning), not merely failed its tests."""

    passed: bool
    reason: str
    output: str
    hostile: bool = False


@dataclasses.dataclass(frozen=True)
class Sandbox:
    """What `check_sandbox` found works here: the command prefix and the interpreter the programs run on."""

    prefix: tuple[str, ...]
    python: str
    as_root: bool


def _prefix(unshare: str, as_root: bool) -> tuple[str, ...]:
    user = ("--setgid", str(SANDBOX_GID), "--setuid", str(SANDBOX_UID)) if as_root else ("--map-root-user",)
    return (unshare, "--net", "--pid", "--ipc", "--mount-proc", "--fork", "--kill-child", *user, "--")


def _interpreters() -> list[str]:
    """Pythons to try, ours first: the sandbox user must be able to execute one (ours may live under /root)."""
    base = os.path.realpath(getattr(sys, "_base_executable", "") or sys.executable)
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    found = [base]
    for name in (version, "python3"):
        for folder in ("/usr/bin", "/usr/local/bin", "/bin"):
            path = os.path.join(folder, name)
            if os.path.isfile(path) and os.access(path, os.X_OK):
                found.append(os.path.realpath(path))
    return list(dict.fromkeys(found))


# The probe's tests: what the sandbox must give, checked from inside it.
_PROBE_TESTS = """
import os
assert os.getpid() == 1, f"not alone in a PID namespace (pid {os.getpid()})"
with open("/proc/self/net/dev") as f:
    devices = [line.split(":")[0].strip() for line in f.read().splitlines()[2:]]
assert devices == ["lo"], f"not in a network namespace of its own (devices: {devices})"
assert set(os.environ) <= {"LC_CTYPE"}, f"the environment reached it: {sorted(os.environ)}"  # Python sets LC_CTYPE (PEP 538)
assert UID_CHECK, f"still root (uid {os.getuid()})"
import sys
assert sys.version_info >= (3, 8), "Python 3.8+ (audit hooks)"
"""


@functools.cache
def check_sandbox() -> Sandbox:
    """The sandbox this machine gives, probed once per process with a tiny program; `RewardError` naming what
    is missing and the fix when it cannot be set up (the reward is refused at start)."""
    if sys.platform != "linux":
        raise RewardError(f"code_tests runs code in Linux namespaces; this is {sys.platform}: run it on Linux")
    unshare = shutil.which("unshare")
    if unshare is None:
        raise RewardError(
            "code_tests needs util-linux's `unshare` (network and PID namespaces) on PATH: install util-linux"
        )
    as_root = os.geteuid() == 0
    tests = _PROBE_TESTS.replace("UID_CHECK", f"os.getuid() == {SANDBOX_UID}" if as_root else "True")
    problems = []
    for python in _interpreters():
        box = Sandbox(_prefix(unshare, as_root), python, as_root)
        outcome = run_python(box, "", tests, Limits(timeout_s=30.0, memory_mb=256))
        if outcome.passed:
            return box
        problems.append(f"{python}: {outcome.reason}: {outcome.output.strip()[-300:]}")
    who = f"the unprivileged user {SANDBOX_UID}" if as_root else "this user in a new user namespace"
    raise RewardError(
        f"code_tests cannot set up its sandbox on this machine ({'; '.join(problems)}). It needs: `unshare` "
        f"allowed to create network, PID, IPC and mount namespaces ({'root with CAP_SYS_ADMIN' if as_root else 'unprivileged user namespaces enabled: sysctl kernel.unprivileged_userns_clone=1, user.max_user_namespaces > 0'}; "
        f"in a container, one that allows unshare), and a Python 3.8+ that {who} can execute "
        "(e.g. /usr/bin/python3, not one under a private home folder)"
    )


def run_python(box: Sandbox, code: str, tests: str, limits: Limits) -> Outcome:
    """Run `code`, then `tests` in its namespace, in a fresh sandbox; never raises for what the program does
    (an `OSError` means the sandbox could not be started: the machine's problem, not the program's)."""
    with tempfile.TemporaryDirectory(prefix="code_tests-", ignore_cleanup_errors=True) as folder:
        nonce = secrets.token_hex(16)
        for name, text in (("solution.py", code), ("tests.py", tests), (".nonce", nonce)):
            with open(os.path.join(folder, name), "w", encoding="utf-8") as f:
                f.write(text)
        if box.as_root:
            os.chown(folder, SANDBOX_UID, SANDBOX_GID)
        cpu_s = max(1, int(limits.timeout_s + 0.999))
        # the runner writes the nonce to this pipe after the tests end, and nothing else does
        result_r, result_w = os.pipe()
        try:
            limits_argv = [str(cpu_s), str(limits.memory_mb << 20), str(MAX_FILE_BYTES), str(MAX_OPEN_FILES)]
            argv = [*box.prefix, box.python, "-I", "-S", "-B", "-X", "utf8", "-c", RUNNER]
            proc = subprocess.Popen(
                [*argv, *limits_argv, str(result_w), MARKER],
                cwd=folder,
                env={},
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group, killed whole on overrun
                close_fds=True,
                pass_fds=(result_w,),
            )
        except BaseException:
            os.close(result_r)
            raise
        finally:
            os.close(result_w)
        try:
            output, timed_out = _read_bounded(proc, limits.timeout_s)
        finally:
            _kill(proc)
            proc.stdout.close()  # type: ignore[union-attr]
            os.set_blocking(result_r, False)
            try:
                result = os.read(result_r, 64)
            except BlockingIOError:
                result = b""
            os.close(result_r)
        return _outcome(proc.returncode, output, timed_out, limits, result == nonce.encode())


def _read_bounded(proc: subprocess.Popen, timeout_s: float) -> tuple[str, bool]:
    """The first MAX_OUTPUT_BYTES of its output until it exits or the wall-clock limit passes."""
    deadline = time.monotonic() + timeout_s
    kept = bytearray()
    fd = proc.stdout.fileno()  # type: ignore[union-attr]
    with selectors.DefaultSelector() as selector:
        selector.register(fd, selectors.EVENT_READ)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return kept.decode("utf-8", "replace"), True
            if selector.select(left):
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    break
                kept += chunk[: MAX_OUTPUT_BYTES - len(kept)]
    try:  # it closed its output; it may still be running
        proc.wait(max(deadline - time.monotonic(), 0.001))
    except subprocess.TimeoutExpired:
        return kept.decode("utf-8", "replace"), True
    return kept.decode("utf-8", "replace"), False


def _kill(proc: subprocess.Popen) -> None:
    """SIGKILL its process group (unshare and the program; the program's PID namespace dies with it)."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


def _outcome(code: int, output: str, timed_out: bool, limits: Limits, finished: bool) -> Outcome:
    if MARKER in output:
        refused = output.split(MARKER, 1)[1].strip().splitlines()[0]
        return Outcome(False, f"refused by the sandbox: {refused}", output, hostile=True)
    if timed_out:
        return Outcome(False, f"timeout: still running after {limits.timeout_s:g} s (killed)", output, hostile=True)
    if code == 0 and finished:
        return Outcome(True, "passed", output)
    if code == 0:
        return Outcome(False, "exited 0 before its tests ended", output, hostile=True)
    if code == EXIT_FAILED:
        return Outcome(False, "the tests failed", output)
    if code == EXIT_COMPILE:
        return Outcome(False, "the code does not compile", output)
    if code == EXIT_MEMORY:
        return Outcome(False, f"memory: past its {limits.memory_mb} MiB", output, hostile=True)
    if code == EXIT_REFUSED:
        return Outcome(False, "refused by the sandbox", output, hostile=True)
    if code == EXIT_CPU or code == -signal.SIGKILL:
        return Outcome(False, "cpu time: past its limit (killed)", output, hostile=True)
    if code < 0:
        return Outcome(False, f"killed by {signal.Signals(-code).name}", output, hostile=True)
    return Outcome(False, f"exit status {code}", output)
