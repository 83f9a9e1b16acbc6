"""Whether a recorded service still runs (`services.alive`) and how long a start is waited for (`wait_until`), on real
detached processes. A live server taken for dead was started again by `stack up` and the first one orphaned: the
record's epoch start time (psutil's create_time: the start tick plus the kernel's boot time in whole seconds) moved by
a second when the boot time did, and the check allowed less than one. No test here assumes a quiet machine: none
waits for a process to do something in a given time."""

from __future__ import annotations

import dataclasses
import sys
import time
from contextlib import suppress

import psutil
import pytest

from grpo_pipeline.infra import services

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the boot time psutil adds is Linux's")


@pytest.fixture
def spawn(tmp_path):
    """Detached `sleep` processes recorded as `spawn` records them; all stopped at the end."""
    started: list[services.Service] = []

    def start(name: str = "svc") -> services.Service:
        started.append(services.spawn(name, ["sleep", "300"], tmp_path / f"{name}-{len(started)}"))
        return started[-1]

    yield start
    for service in started:
        services.stop(service, grace_s=1)


@linux_only
def test_a_live_service_is_ours_after_the_kernels_boot_time_moved_a_second(spawn, monkeypatch):
    service = spawn()
    assert service.identity is not None and services.alive(service)
    boot_time = psutil._pslinux.boot_time()  # /proc/stat btime: whole seconds, moved by clock adjustments
    monkeypatch.setattr(psutil._pslinux, "boot_time", lambda: boot_time + 1)
    moved = psutil.Process(service.pid).create_time() - service.created
    assert moved == pytest.approx(1.0)  # what the old check, |difference| < 1, took for another process
    assert services.alive(service)
    assert services.alive(dataclasses.replace(service, identity=None))  # a record from before identities too


def test_a_recycled_pid_is_not_ours(spawn):
    ours = spawn()
    time.sleep(0.05)  # past the next clock tick (10 ms): a pid is only recycled by a process started after ours
    other = spawn()
    assert other.identity != ours.identity
    recycled = dataclasses.replace(ours, pid=other.pid)  # our record; another live process now holds the pid
    assert services.alive(ours) and services.alive(other)
    assert not services.alive(recycled)
    older = dataclasses.replace(other, identity=None, created=other.created - 5)  # a record without an identity
    assert not services.alive(older)


def test_a_dead_process_is_dead_exited_or_killed(tmp_path, spawn):
    exited = services.spawn("done", ["true"], tmp_path / "done")
    with suppress(psutil.NoSuchProcess):  # reaped already, by its Popen's finaliser
        psutil.Process(exited.pid).wait(600)  # reaped: its pid is free (and may be anyone's next)
    assert not services.alive(exited)
    killed = spawn()
    services.stop(killed, grace_s=1)
    assert not services.alive(killed)


def test_a_start_that_makes_no_progress_is_given_up_and_stopped(spawn):
    hung = spawn()  # `sleep`: no log line, no CPU time
    with pytest.raises(services.ServiceError, match="no progress .* for 1 s"):
        services.wait_until(lambda: False, hung, 600, stall_s=1)
    assert not services.alive(hung)


def test_a_start_that_keeps_making_progress_is_waited_for_up_to_its_ceiling(spawn):
    busy = spawn()

    def not_yet() -> bool:  # the service's log grows between every two looks, however slow the machine
        with open(busy.log, "a") as log:
            log.write("migrating...\n")
        return False

    with pytest.raises(services.ServiceError, match="after 2 s, its ceiling"):
        services.wait_until(not_yet, busy, 2, stall_s=1)
    assert not services.alive(busy)
