"""Run untrusted Python (a completion's code and its row's tests) in a throwaway process sandbox.

One run (`run_python`) is one fresh process, started as

    unshare --net --pid --ipc --mount-proc --fork --kill-child [--setuid 65534 --setgid 65534 | --map-root-user]
        -- python3 -I -S -B -X utf8 -c RUNNER LIMITS...

in a folder of its own (its working directory, mode 0700, under a random name inside a temporary folder of the
caller's that others may pass through but not list; removed afterwards), with an empty environment, stdin closed,
and stdout + stderr captured through one pipe, of which the first `MAX_OUTPUT_BYTES` are kept. What that gives,
and what it does not, is in docs/security.md ("Code answers: `code_tests`"); in short:

- no network: a new network namespace has only a loopback device, down;
- no other processes: a new PID namespace (the program is its PID 1 and sees only itself in /proc), and
  RLIMIT_NPROC 0, so `fork`, threads and subprocesses fail;
- bounded: wall time (on overrun, and after every run, the parent SIGKILLs the PID namespace's first process,
  which makes the kernel kill everything in the namespace, then `unshare`: a program that left its process group
  with `os.setsid()` dies too), CPU time (RLIMIT_CPU), address space (RLIMIT_AS), file size (RLIMIT_FSIZE), open
  files, no core dumps;
- as root, the program runs as the unprivileged user 65534 (`nobody`): it can write only where anyone may
  (its folder, and world-writable places such as /tmp), and cannot find another run's folder; not root, it
  runs as the calling user in a user namespace, and can write wherever that user can;
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

# What the audit hook refuses: events that start with one of these (BLOCKED), and these with a path outside the
# folder (PATHS); besides "open" for writing outside it and importing ctypes.
BLOCKED = (
    *("socket.", "subprocess.", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty", "os.system"),
    *("os.kill", "os.killpg", "signal.pthread_kill", "ctypes.", "pty.", "os.setuid", "os.setgid", "os.setresuid"),
    *("os.setresgid", "os.chroot", "os.unshare", "os.setns"),
)
PATHS = (
    *("os.remove", "os.rmdir", "os.mkdir", "os.rename", "os.symlink", "os.link", "os.truncate", "os.chmod"),
    *("os.chown", "os.chflags", "os.utime", "os.mkfifo", "os.mknod", "os.setxattr", "os.removexattr"),
)
# The audit events (CPython's) a refusal names in `Outcome.reason`; another event that starts with a refused
# prefix (`sys.audit` raises any name) is named by its prefix and "*". Nothing the program wrote goes into a
# reason: it is logged, and a program could otherwise print a file's contents into the trainer's log.
KNOWN_EVENTS = frozenset(
    {
        *("socket.__new__", "socket.bind", "socket.connect", "socket.getaddrinfo", "socket.gethostbyaddr"),
        *("socket.gethostbyname", "socket.gethostname", "socket.getnameinfo", "socket.getservbyname"),
        *("socket.getservbyport", "socket.sendmsg", "socket.sendto", "socket.sethostname", "subprocess.Popen"),
        *("ctypes.addressof", "ctypes.call_function", "ctypes.cdata", "ctypes.cdata/buffer", "ctypes.dlopen"),
        *("ctypes.create_string_buffer", "ctypes.create_unicode_buffer", "ctypes.dlsym", "ctypes.dlsym/handle"),
        *("ctypes.get_errno", "ctypes.set_errno", "ctypes.string_at", "ctypes.wstring_at", "pty.spawn"),
        *(name for name in BLOCKED + PATHS if not name.endswith(".")),
    }
)

# What the child's exit says (besides 0: passed, and a signal).
CHILD_FAILED, CHILD_COMPILE, CHILD_MEMORY, CHILD_REFUSED, CHILD_CPU = 1, 2, 3, 4, 5

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
BLOCKED, PATHS = BLOCKED_AND_PATHS
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
""".replace("BLOCKED_AND_PATHS", repr((BLOCKED, PATHS)))


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
    with tempfile.TemporaryDirectory(prefix="code_tests-", ignore_cleanup_errors=True) as outer:
        # All runs are user 65534: each one's folder (0700, its) has a random name inside a folder of ours that
        # others may pass through but not list, so a run cannot find a concurrent run's folder to rewrite it.
        os.chmod(outer, 0o711)
        folder = os.path.join(outer, secrets.token_hex(16))
        os.mkdir(folder, 0o700)
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
    """End the run, whatever it did: SIGKILL the first process of its PID namespace (`unshare`'s child), which
    makes the kernel SIGKILL everything else in the namespace, wait until it is dead, then SIGKILL `unshare`'s
    process group. Killing the group alone is not enough: the program may have left it with `os.setsid()`
    (no audit event), and as root `unshare --kill-child`'s death signal does not reach it (the kernel clears a
    death signal when the process changes its uid, and `unshare` sets it before `--setuid`).

    `unshare` is stopped first, so that it can neither fork nor reap while its children are read: a child's pid
    cannot be reused before `unshare` reaps it. `unshare` exits only after its child did, so once it has exited
    (the usual end of a run) the namespace is gone already."""
    if proc.poll() is None:
        try:
            os.kill(proc.pid, signal.SIGSTOP)
            _wait_for_state(proc.pid, "TZX")  # stopped outside any system call (a fork finished), or dead
            children = _children(proc.pid)
            for child in children:
                try:
                    os.kill(child, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            for child in children:  # a zombie once everything in its namespace has died (it waits for them)
                _wait_for_state(child, "ZX")
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


_KILL_WAIT_S = 30.0  # how long `_kill` waits for a SIGKILLed or SIGSTOPped process: the kernel's part, generous


def _state(pid: int) -> str:
    """The process's state letter from /proc (R, S, T, Z, ...), "X" when it no longer exists."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return "X"
    fields = stat.rpartition(b")")[2].split()
    return fields[0].decode() if fields else "X"


def _wait_for_state(pid: int, states: str) -> None:
    deadline = time.monotonic() + _KILL_WAIT_S
    pause = 0.0005
    while _state(pid) not in states and time.monotonic() < deadline:
        time.sleep(pause)
        pause = min(pause * 2, 0.02)


def _children(pid: int) -> list[int]:
    """The pids of `pid`'s child processes (`unshare --fork` has one: the namespace's first process)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children", encoding="ascii") as f:
            return [int(child) for child in f.read().split()]
    except FileNotFoundError:  # a kernel without CONFIG_PROC_CHILDREN, or `pid` is gone: ask every process
        pass
    except OSError:
        return []
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    fields = f.read().rpartition(b")")[2].split()
            except OSError:
                continue
            if len(fields) > 1 and fields[1] == str(pid).encode():
                found.append(int(entry))
    return found


def _outcome(code: int, output: str, timed_out: bool, limits: Limits, finished: bool) -> Outcome:
    if MARKER in output:
        return Outcome(False, _refusal(output), output, hostile=True)
    if timed_out:
        return Outcome(False, f"timeout: still running after {limits.timeout_s:g} s (killed)", output, hostile=True)
    if code == 0 and finished:
        return Outcome(True, "passed", output)
    if code == 0:
        return Outcome(False, "exited 0 before its tests ended", output, hostile=True)
    if code == CHILD_FAILED:
        return Outcome(False, "the tests failed", output)
    if code == CHILD_COMPILE:
        return Outcome(False, "the code does not compile", output)
    if code == CHILD_MEMORY:
        return Outcome(False, f"memory: past its {limits.memory_mb} MiB", output, hostile=True)
    if code == CHILD_REFUSED:
        return Outcome(False, "refused by the sandbox", output, hostile=True)
    if code == CHILD_CPU or code == -signal.SIGKILL:
        return Outcome(False, "cpu time: past its limit (killed)", output, hostile=True)
    if code < 0:
        return Outcome(False, f"killed by {signal.Signals(-code).name}", output, hostile=True)
    return Outcome(False, f"exit status {code}", output)


def _refusal(output: str) -> str:
    """The reason for a run whose output holds the marker, in fixed words only: the first refusal whose event
    is one the hook refuses, named from `KNOWN_EVENTS` or its refused prefix (the program may print the marker
    itself, followed by anything: a file's contents, or nothing).

    >>> _refusal("\\n@@sandbox-refused@@ socket.connect (<socket.socket ...>, ('10.0.0.1', 80))\\n")
    'refused by the sandbox: socket.connect'
    >>> _refusal("@@sandbox-refused@@ open for writing: '/etc/x'"), _refusal("@@sandbox-refused@@ import ctypes")
    ('refused by the sandbox: open for writing', 'refused by the sandbox: import ctypes')
    >>> _refusal("@@sandbox-refused@@ socket.root:x:0:0 ..."), _refusal("hello\\n@@sandbox-refused@@")
    ('refused by the sandbox: socket.*', 'refused by the sandbox')
    """
    for part in output.split(MARKER)[1:]:
        words = part[:200].split(maxsplit=2)
        event = words[0] if words else ""
        if event == "open" and words[1:2] == ["for"]:
            return "refused by the sandbox: open for writing"
        if event == "import" and words[1:2] in (["ctypes"], ["_ctypes"]):
            return f"refused by the sandbox: import {words[1]}"
        if event in KNOWN_EVENTS:
            return f"refused by the sandbox: {event}"
        prefix = next((p for p in BLOCKED + PATHS if event.startswith(p)), None)
        if prefix is not None:
            return f"refused by the sandbox: {prefix}*"
    return "refused by the sandbox"
