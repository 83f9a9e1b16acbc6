"""Two routers, each with its engine (the stand-in vLLM server), on one PostgreSQL request log (the stack's own,
`Stack.up(["postgres"])`), behind a round-robin client that, as a load balancer does, sends a request that got a
503 to the other replica:

- each user sticks to one arm across both replicas; every answered request is in the log once;
- an alias move (the registry stand-in: a JSON file both replicas poll) reaches both within a few poll_s;
- killing one replica's engine leaves the other answering every request; the restarted one serves again;
- PostgreSQL killed (SIGKILL) while requests flow: they are answered through the spool; `stack up` starts it
  again cleanly (stale pid file, shared memory) and the spool replays into it: no answered request is missing.
"""

import json
import os
import shutil
import signal
import tempfile
from collections import defaultdict
from pathlib import Path

import httpx
import pytest
from sqlalchemy import text

from grpo_pipeline.configs.ab import ServeConfig
from grpo_pipeline.infra import services
from grpo_pipeline.infra.stack import Stack
from grpo_pipeline.tasks.serve.ab_log import RequestLog
from grpo_pipeline.tasks.serve.api import ARM_HEADER, CHALLENGER, CHAMPION, VERSION_HEADER
from tests.engine_python import STAND_IN_VLLM
from tests.serve_world import adapter_at, replica, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # a PostgreSQL initdb: minutes on a busy machine

POLL_S = 0.5


class RoundRobin:
    """Requests to the replicas in turn; one that answers 503 (its engine restarting), or whose connection breaks
    before an answer, is retried on the next, as a load balancer does."""

    def __init__(self, urls: list[str]):
        self.clients = [httpx.Client(base_url=u, timeout=60) for u in urls]
        self.turn = 0
        self.answered: dict[str, tuple[str, str, str]] = {}  # id -> (user, arm, version)
        self.refused = 0  # 503s a replica gave (retried elsewhere)

    def ask(self, user: str) -> httpx.Response:
        for _ in range(2 * len(self.clients)):
            client = self.clients[self.turn % len(self.clients)]
            self.turn += 1
            try:
                answer = client.post("/v1/completions", json={"prompt": "x", "user": user})
            except httpx.TransportError:  # a keep-alive connection the replica closed as it was reused: elsewhere
                continue
            if answer.status_code != 503:
                break
            self.refused += 1
        assert answer.status_code == 200, answer.text
        self.answered[answer.json()["id"]] = (user, answer.headers[ARM_HEADER], answer.headers[VERSION_HEADER])
        return answer

    def close(self):
        for c in self.clients:
            c.close()


@pytest.fixture
def world(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(STAND_IN_VLLM))
    monkeypatch.setenv("STAND_IN_ENGINE_START_S", "1")
    # PostgreSQL's folder outside pytest's temporary root: a concurrent test session resets that root to 0700,
    # which shuts the server's unprivileged user out of its data mid-run (when the tests run as root)
    home = Path(tempfile.mkdtemp(prefix="grpo-replicas-"))
    stack = Stack(home / "stack")
    pg = stack.up(["postgres"])["postgres"]
    aliases = tmp_path / "aliases.json"
    aliases.write_text(json.dumps({CHAMPION: "1", CHALLENGER: "2"}))
    adapters = tmp_path / "adapters"

    def resolve(alias: str):
        version = json.loads(aliases.read_text()).get(alias)
        return None if version is None else adapter_at(adapters, alias, version)

    yield stack, services.database_uri(pg, "ab"), aliases, resolve
    stack.down()
    shutil.rmtree(home, ignore_errors=True)


def test_two_replicas_on_one_log_sticky_logged_once_moved_together_and_each_covering_the_other(tmp_path, world):
    stack, uri, aliases, resolve = world
    cfg = ServeConfig(poll_s=POLL_S, probe_s=0.2, probe_timeout_s=5)
    arms = {CHAMPION: resolve(CHAMPION), CHALLENGER: resolve(CHALLENGER)}
    logs = [RequestLog.open(uri), RequestLog.open(uri)]
    with (
        replica(tmp_path / "a", logs[0], arms, cfg, resolve) as a,
        replica(tmp_path / "b", logs[1], arms, cfg, resolve) as b,
    ):
        balancer = RoundRobin([a.url, b.url])
        users = [f"user-{i}" for i in range(40)]
        for i in range(80):  # each user twice, once on each replica
            balancer.ask(users[i % 40])

        aliases.write_text(json.dumps({CHAMPION: "1", CHALLENGER: "3"}))  # the challenger alias moves
        wait_for(lambda: all(r.router.arms[CHALLENGER].version == "3" for r in (a, b)), 40 * POLL_S, "the move on both")
        for i in range(40):
            balancer.ask(users[i % 40])

        os.kill(a.engine_pid, signal.SIGKILL)  # replica a's engine dies: b answers, a comes back
        for i in range(60):
            balancer.ask(users[i % 40])
        wait_for(lambda: a.router.restarts == 1 and not a.router.restarting, 60, "replica a's engine restart")
        for i in range(20):
            balancer.ask(users[i % 40])

        pg = stack.service("postgres")
        os.kill(pg.pid, signal.SIGKILL)  # the log store dies while requests flow
        for i in range(20):
            balancer.ask(users[i % 40])
        assert a.router.unlogged + b.router.unlogged > 0  # answered, kept in the spools
        stack.up(["postgres"])  # what `stack up` does: start it again, cleanly
        for i in range(4):  # the next successful writes replay the spools
            balancer.ask(users[i])
        wait_for(lambda: a.router.unlogged == b.router.unlogged == 0, 30, "the replay")
        balancer.close()
    for log in logs:
        log.close()

    with RequestLog.open(uri).engine.connect() as c:
        rows = c.execute(text("SELECT id, arm, version, assignment, error FROM ab_requests")).all()
    assert sorted(r[0] for r in rows) == sorted(balancer.answered)  # every answered request, once
    assert not any(r[4] for r in rows)
    arm_of_user = defaultdict(set)
    for user, arm, _ in balancer.answered.values():
        arm_of_user[user].add(arm)
    assert all(len(arms) == 1 for arms in arm_of_user.values())  # sticky across both replicas
    assert {arm for arms in arm_of_user.values() for arm in arms} == {CHAMPION, CHALLENGER}
    moved = list(balancer.answered.values())[80:]
    assert {v for _, arm, v in moved if arm == CHALLENGER} == {"3"}
    assert balancer.refused > 0  # replica a refused while its engine restarted, and b answered those
