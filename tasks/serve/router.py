"""`grpo-pipeline serve`: the OpenAI-compatible router in front of the engine. It assigns each request to an arm
(champion or challenger) by a hash of the user's key, sends it to that arm's adapter in the engine, writes the
request to the A/B log before answering, takes feedback, and follows the registry's aliases.

One module, since the request path, the alias follower and the engine's supervisor share the `Router`'s state and
one event loop: cut apart, each would reach into the others' locks.

`Router` is the state one process holds: which adapter serves each alias, and how many requests each adapter has
in flight; the rules it applies are pure functions in `api` (the assignment, the validation of bodies and keys), a
streamed answer passes through `streaming`, and each request's row is written by `request_rows`. It holds nothing
else: the assignment is a function of the key and `ab.challenger_fraction`, the log is the shared store, so
replicas behind any load balancer agree.

- **Assignment.** The key is the `X-Assignment-Key` header, else the body's `safety_identifier`, else its
  `user` (OpenAI's older name for it); a request without one gets a random key, so an arm at random.
  sha256(key) read as a number in [0, 1) below `challenger_fraction` is the challenger. Raising the fraction
  moves users champion -> challenger only, never back.
- **Each response** carries `X-GRPO-Arm` and `X-GRPO-Version`, its `model` is `<alias>-v<version>` and its
  `id` the log's id (what `/v1/feedback` takes).
- **Logging before answering.** The row is committed before the response is sent, so an answered request is
  in the log even if the router is killed right after; the id is the primary key, so never twice. A streamed
  answer (`stream: true`) is relayed chunk by chunk and its row committed when the engine's stream ends,
  before the final `data: [DONE]`; a client that leaves mid-stream gets its row with the error flag, once. A store
  that fails mid-run does not stop serving: the row goes to a local write-ahead file (`tasks/serve/ab_spool.py`),
  counted by `ab status` and replayed into the store by the next successful write.
- **Feedback** takes a `score`, or a `reference` that the pipeline's own rewards (the config's `RewardSet`,
  weighted total) score the logged completion against: one judge for training, holdout and production.
- **Up before its engine.** The router binds its port at once: `/health` answers while the engine starts (minutes
  for vLLM), and requests get a 503 with `Retry-After` until it answers, as during an engine restart. With
  `ab.serve.reattach_engine` (the stack's router) a killed router's engine keeps running, and the router started
  after it attaches to it (`Engine.adopt`, checked with the engine's key and its adapters set right): serving again
  within seconds of the kill, not after an engine start.
- **Alias moves.** Every `ab.serve.poll_s` the registry is read; a moved alias gets its new adapter loaded,
  requests switched to it, and the old one unloaded once its requests in flight have finished. An adapter
  of another base (or a rank above the engine's) is refused with the reason, and the old one keeps serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Lifespan

from grpo_pipeline.tasks.promote.registry import Registry, RegistryServiceError
from grpo_pipeline.tasks.promote.registry_client import open_client
from grpo_pipeline.tasks.serve import ab_spool
from grpo_pipeline.tasks.serve.ab_log import LogStoreError, RequestLog, UnknownRequest
from grpo_pipeline.tasks.serve.adapters import Adapter, local_base, refusal, resolve
from grpo_pipeline.tasks.serve.api import (
    API_KEY_ENV,
    ARM_HEADER,
    CHALLENGER,
    CHAMPION,
    VERSION_HEADER,
    BadRequest,
    answer_text,
    api_key_policy,
    arm_for,
    assignment_hash,
    assignment_key,
    authorized,
    engine_answer,
    error_response,
    parse_object,
    passed_on,
    score_reference,
    validate_feedback,
    validate_generation,
)
from grpo_pipeline.tasks.serve.engine import Engine, EngineError
from grpo_pipeline.tasks.serve.request_rows import RequestRows, StreamRow
from grpo_pipeline.tasks.serve.streaming import LoggedStream, Relay, ask_for_usage, relay_events
from grpo_pipeline.trainer.rewards.base import RewardError

if TYPE_CHECKING:
    from grpo_pipeline.configs.ab import ServeConfig
    from grpo_pipeline.configs.rewards import RewardSet
    from grpo_pipeline.configs.schema import PipelineConfig
    from grpo_pipeline.tasks.serve.engine import Engine, EngineError

# What callers import from here: the router, its process, and the names they use with it.
__all__ = [
    "CHALLENGER",
    "CHAMPION",
    "Router",
    "ServeSetupError",
    "api_key_policy",
    "arm_for",
    "assignment_hash",
    "run",
    "serve",
]

log = logging.getLogger("grpo_pipeline.serve")


# ------------------------------------------------------------------------------------------------ the router


class Router:
    """What one process holds: the adapter serving each alias and the requests in flight on each adapter."""

    def __init__(
        self,
        *,
        engine: Engine,
        client: httpx.AsyncClient | None,
        request_log: RequestLog,
        spool: Path,
        challenger_fraction: float,
        api_key: str | None,
        base: str,
        base_sha256: str | None,
        max_rank: int,
        request_timeout_s: float,
        rewards: RewardSet | None = None,
        log_completions: bool = True,
        retry_after_s: int = 5,
    ):
        self.engine, self._client, self.log, self.spool = engine, client, request_log, spool
        self.rows = RequestRows(request_log, spool, log_completions)
        self.rewards = rewards
        self.fraction, self.api_key = challenger_fraction, api_key
        self.base, self.base_sha256, self.max_rank = base, base_sha256, max_rank
        self.timeout_s = request_timeout_s
        self.arms: dict[str, Adapter] = {}
        self.inflight: Counter[str] = Counter()
        self.refused: dict[str, str] = {}  # engine name -> reason, so a refusal is logged once per version
        self._swap = asyncio.Lock()
        # The engine's supervision (`supervise`): what a restart starts it with (every adapter it holds, by engine
        # name: the arms and any old version still draining), whether one is under way, how many were done, and
        # the error that ended the router when the engine would not come back.
        self.loaded: dict[str, Path] = {}
        self.starting = False  # the engine's first start (or the attach to a running one), in the background
        self.restarting = False
        self.restarts = 0
        self.gave_up: EngineError | None = None
        self.retry_after_s = retry_after_s
        self.started = time.time()  # what tells this process from the one before it (`health`)
        self.stop: Callable[[], None] = lambda: None  # stops the server: set by `run`, called on giving up

    @property
    def unlogged(self) -> int:
        """Rows this process spooled because the store failed, until a replay takes them."""
        return self.rows.unlogged

    # --- requests

    def pick(self, key: str | None) -> tuple[Adapter, str | None]:
        """(the adapter that answers, the hash of the user's key for the log)."""
        hashed = assignment_hash(key) if key is not None else None
        arm = arm_for(hashed or assignment_hash(secrets.token_hex(16)), self.fraction)
        if arm not in self.arms:  # no challenger alias (none yet, or rolled back): everyone gets the champion
            arm = CHAMPION
        return self.arms[arm], hashed

    def engine_down(self) -> bool:
        """Whether the engine is known not to serve: starting, restarting, or its process gone (before the next
        check)."""
        return self.starting or self.restarting or (self.engine is not None and self.engine.exit_status() is not None)

    @property
    def engine_state(self) -> str:
        """The engine as the router knows it: starting, restarting, gave up or up (as of its last check)."""
        if self.gave_up is not None:
            return "gave up"
        if self.starting:
            return "starting"
        return "restarting" if self.engine_down() else "up"

    def unavailable(self) -> JSONResponse:
        """The fast answer while the engine starts or restarts: not the arm's failure, so not logged (the A/B
        counts it against neither arm); `Retry-After` tells a client when to come back."""
        return error_response(
            503,
            f"the engine is {'starting' if self.starting else 'restarting'}; retry in {self.retry_after_s} s",
            "service_unavailable",
            headers={"Retry-After": str(self.retry_after_s)},
        )

    def _denied(self, request: Request) -> JSONResponse | None:
        if authorized(request.headers.get("authorization"), self.api_key):
            return None
        return error_response(
            401, f"missing or wrong API key: send Authorization: Bearer <{API_KEY_ENV}>", "authentication_error"
        )

    async def generate(self, request: Request, kind: str) -> Response:
        if (denied := self._denied(request)) is not None:
            return denied
        if self.engine_down():
            return self.unavailable()
        try:
            body = validate_generation(kind, parse_object(await request.body()))
        except BadRequest as e:
            return error_response(400, str(e))
        if CHAMPION not in self.arms:
            return error_response(503, "no champion adapter is loaded", "service_unavailable")
        adapter, hashed = self.pick(assignment_key(body, request.headers))
        arm_headers = {ARM_HEADER: adapter.alias, VERSION_HEADER: adapter.version}
        request_id = f"grpo-{uuid.uuid4().hex}"
        body["model"] = adapter.engine_name  # the arm decides; a client's `model` is not a choice of adapter
        path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
        if body.get("stream"):
            return await self._stream(kind, path, body, adapter, hashed, request_id, arm_headers)
        self.inflight[adapter.engine_name] += 1
        started = time.perf_counter()
        try:
            answer = await self.client.post(path, json=body, timeout=self.timeout_s)
            failure = None
        except httpx.HTTPError as e:
            answer, failure = None, f"the engine did not answer ({type(e).__name__}: {e})"
        finally:
            self.inflight[adapter.engine_name] -= 1
        latency = time.perf_counter() - started
        if answer is None and self.engine_down():  # the engine died under it: the engine's fault, not the arm's
            return self.unavailable()
        if answer is not None and answer.status_code in (400, 422):  # the client's input, not the arm's failure
            return passed_on(answer.status_code, answer.content, arm_headers)
        payload: dict[str, Any] | None = None
        if answer is not None:
            payload, failure = engine_answer(answer)
        row = self.rows.row(
            request_id,
            adapter,
            hashed,
            latency,
            (payload or {}).get("usage") or {},
            error=payload is None,
            completion=answer_text(kind, payload) if payload else None,
        )
        await anyio.to_thread.run_sync(self.rows.write, row)  # committed (or spooled) before the answer leaves
        if payload is None:
            return error_response(
                502, failure or "the engine gave no answer", "engine_error", headers=arm_headers, id=request_id
            )
        return JSONResponse(payload | {"id": request_id, "model": adapter.engine_name}, headers=arm_headers)

    async def _stream(
        self,
        kind: str,
        path: str,
        body: dict,
        adapter: Adapter,
        hashed: str | None,
        request_id: str,
        arm_headers: dict[str, str],
    ) -> Response:
        """Relay the engine's server-sent events; the row is committed when its stream ends, before `[DONE]`.
        The engine is always asked for usage (the token counts of the log); the client gets it if it asked."""
        relay = Relay(kind, request_id, adapter.engine_name, client_wants_usage=ask_for_usage(body))
        commit = StreamRow(self.rows, self.inflight, request_id, adapter, hashed, relay)
        upstream = await self._open_stream(path, body, commit, arm_headers, request_id)
        if isinstance(upstream, Response):
            return upstream

        async def closed() -> None:
            await upstream.aclose()
            await commit(error=True)  # a no-op when the stream ended: only a client that left mid-stream

        return LoggedStream(relay_events(upstream, relay, commit), closed, arm_headers)

    async def _open_stream(
        self, path: str, body: dict, commit: StreamRow, arm_headers: dict[str, str], request_id: str
    ) -> httpx.Response | Response:
        """The engine's stream, or the response that ends the request there: the engine's own 400/422 passed on
        (the client's input, not logged), or a 502 (the arm's failure, logged)."""
        try:
            upstream = await self.client.send(
                self.client.build_request("POST", path, json=body, timeout=self.timeout_s), stream=True
            )
        except httpx.HTTPError as e:
            if self.engine_down():
                commit.skip()
                return self.unavailable()
            await commit(error=True)
            return error_response(
                502,
                f"the engine did not answer ({type(e).__name__}: {e})",
                "engine_error",
                headers=arm_headers,
                id=request_id,
            )
        if upstream.status_code != 200:
            raw = await upstream.aread()
            await upstream.aclose()
            if upstream.status_code in (400, 422):
                commit.skip()
                return passed_on(upstream.status_code, raw, arm_headers)
            await commit(error=True)
            return error_response(
                502,
                f"the engine answered HTTP {upstream.status_code}: {raw[:300].decode(errors='replace')}",
                "engine_error",
                headers=arm_headers,
                id=request_id,
            )
        return upstream

    async def chat(self, request: Request) -> Response:
        return await self.generate(request, "chat")

    async def completions(self, request: Request) -> Response:
        return await self.generate(request, "completions")

    async def feedback(self, request: Request) -> JSONResponse:
        if (denied := self._denied(request)) is not None:
            return denied
        try:
            request_id, score, reference = validate_feedback(parse_object(await request.body()))
            rewards: dict[str, float] | None = None
            if reference is not None:
                rewards = await self._score_reference(request_id, reference)
                score = rewards["total"]
            assert score is not None
            await anyio.to_thread.run_sync(self.log.feedback, request_id, score)
        except BadRequest as e:
            return error_response(400, str(e))
        except UnknownRequest as e:
            return error_response(404, f"{e}: feedback takes the id of a response this service gave", "not_found_error")
        except LogStoreError as e:
            return error_response(503, f"the A/B log store did not take the feedback: {e}", "service_unavailable")
        return JSONResponse(
            {"id": request_id, "score": score, **({"rewards": rewards} if rewards else {}), "status": "stored"}
        )

    async def _score_reference(self, request_id: str, reference: str) -> dict[str, float]:
        """The rewards' scores of the logged completion against `reference` (BadRequest when it cannot be)."""
        if self.rewards is None:
            raise BadRequest("this router was started without the pipeline's rewards: send a score instead")
        completion, tokens = await anyio.to_thread.run_sync(self.log.completion, request_id)
        if completion is None:
            raise BadRequest(
                f"request {request_id!r} has no logged completion to score (an error, or ab.serve.log_completions "
                "is off): send a score instead"
            )
        assert self.rewards is not None
        try:
            return await anyio.to_thread.run_sync(score_reference, self.rewards, completion, reference, tokens)
        except RewardError as exc:  # a skill that reads more than the answer (a row's tests, its labels): a score
            raise BadRequest(
                f"{exc}: this task's reference alone cannot be scored here, send a score instead"
            ) from None

    async def models(self, request: Request) -> JSONResponse:
        if (denied := self._denied(request)) is not None:
            return denied
        data = [
            {
                "id": a.alias,
                "object": "model",
                "owned_by": "grpo-pipeline",
                "version": a.version,
                "engine_name": a.engine_name,
                "parent": self.base,
            }
            for a in self.arms.values()
        ]
        return JSONResponse({"object": "list", "data": data})

    async def health(self, request: Request) -> JSONResponse:
        """Liveness: the router process answers (a load balancer or Kubernetes restarts it when not), from its
        first second, whatever its engine does. No key, nothing about the models: the engine's state
        (`engine_state`), its restarts, the rows spooled, and this process's pid and start time (`stack status`
        tells a restarted router by them)."""
        return JSONResponse(
            {
                "status": "ok",
                "engine": self.engine_state,
                "restarts": self.restarts,
                "unlogged": self.unlogged,
                "pid": os.getpid(),
                "started": self.started,
            }
        )

    async def ready(self, request: Request) -> JSONResponse:
        """Readiness: the champion is loaded and the engine answers now (a load balancer sends traffic only
        here); 503 while the engine starts or restarts, with the reason."""
        reason = None
        if self.starting:
            reason = "the engine is starting"
        elif CHAMPION not in self.arms:
            reason = "no champion adapter is loaded"
        elif self.restarting:
            reason = "the engine is restarting"
        elif self.engine is not None:
            reason = await self.engine.probe(self.client, min(self.probe_timeout_s, 5.0))
        body = {"status": "ready" if reason is None else "not ready", "restarts": self.restarts}
        return JSONResponse(body | ({"reason": reason} if reason else {}), 200 if reason is None else 503)

    # --- the engine's supervision

    probe_timeout_s = 30.0  # set by `supervise` from ab.serve.probe_timeout_s

    async def supervise(self, probe_s: float, probe_timeout_s: float, restart_limit: int) -> None:
        """Check the engine every `probe_s` (its process, then `/v1/models` within `probe_timeout_s`); restart a
        dead or hung one (`restart_engine`). Returns when it gave up (`gave_up`)."""
        self.probe_timeout_s = probe_timeout_s
        while self.gave_up is None:
            await asyncio.sleep(probe_s)
            if (reason := await self.engine.probe(self.client, probe_timeout_s)) is not None:
                await self.restart_engine(reason, restart_limit)

    async def restart_engine(self, reason: str, restart_limit: int) -> None:
        """Start the engine again with every adapter it held (`_start_engine`); meanwhile requests get a fast 503.
        The restart is counted, and recorded in the A/B log."""
        self.restarting = True
        adapters = dict(self.loaded)
        log.error("%s; restarting it with %s", reason, ", ".join(adapters) or "no adapter")
        if not await self._start_engine(adapters, restart_limit, reason, first=False):
            return
        self.restarts += 1
        self.restarting = False
        log.warning("the engine is back (restart %d) with %s", self.restarts, ", ".join(adapters) or "no adapter")
        try:
            await anyio.to_thread.run_sync(self.log.engine_restarted, reason)
        except LogStoreError as e:
            log.error("the restart was not recorded in the A/B log (%s); `ab status` will not count it", e)

    async def _start_engine(self, adapters: dict[str, Path], restart_limit: int, reason: str, first: bool) -> bool:
        """Start the engine with `adapters`, `restart_limit` tries with exponential backoff (1, 2, 4, ... s, at most
        30: a start that failed for want of memory may succeed once it is freed). After the last try, `gave_up`
        holds the error with the engine log's tail and `stop` stops the server, which exits non-zero so that its
        own supervisor restarts it; returns whether the engine is up."""
        from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_attempt, wait_exponential

        try:
            async for attempt in AsyncRetrying(
                stop=stop_after_attempt(restart_limit),
                wait=wait_exponential(min=1, max=30),
                retry=retry_if_exception_type(EngineError),
                before_sleep=lambda state: log.error(
                    "engine start %d of %d failed: %s",
                    state.attempt_number,
                    restart_limit,
                    state.outcome.exception() if state.outcome else None,
                ),
                reraise=True,
            ):
                with attempt:
                    await self.engine.restart(
                        self.client, adapters, marker=not first or attempt.retry_state.attempt_number > 1
                    )
        except EngineError as e:
            self.engine.kill()
            self.gave_up = EngineError(
                f"the engine did not start after {restart_limit} tries (ab.serve.restart_limit); the last: {e}"
                if first
                else f"the engine did not come back after {restart_limit} starts (ab.serve.restart_limit); the "
                f"first fault: {reason}; the last start: {e}"
            )
            log.error("%s", self.gave_up)
            self.stop()
            return False
        return True

    async def bring_up(self, restart_limit: int) -> None:
        """The engine's first start, in the background while the router already answers (503 meanwhile): attach
        to the engine an earlier router left (`Engine.adopt` found it; it must answer with its key, and gets the
        arms' adapters loaded and the others unloaded), else start one with the arms' adapters."""
        self.starting = True
        if self.engine.adopted is not None:
            reason = await self.engine.probe(self.client, min(self.probe_timeout_s, 10.0))
            if reason is None:
                try:
                    await self._match_adapters()
                except (EngineError, httpx.HTTPError) as e:
                    reason = f"setting its adapters failed ({e})"
            if reason is None:
                self.starting = False
                log.warning(
                    "serving with the engine an earlier router left (pid %s, %s) holding %s",
                    self.engine.pid,
                    self.engine.url,
                    ", ".join(self.loaded),
                )
                return
            log.error("the engine an earlier router left does not serve (%s); starting a new one", reason)
            self.engine.kill()
        log.warning(
            "starting the engine (%s) on %s with %s; its log: %s",
            self.engine.python,
            self.engine.url,
            ", ".join(self.loaded) or "no adapter",
            self.engine.log_path,
        )
        if await self._start_engine(dict(self.loaded), restart_limit, "", first=True):
            self.starting = False
            log.warning("the engine answers; serving %s", ", ".join(self.arms))

    async def _match_adapters(self) -> None:
        """An adopted engine holds what the router before held: load the arms' adapters it lacks, unload the
        others (an old version that was draining when that router died)."""
        wanted = {a.engine_name: a.path for a in self.arms.values()}
        held = await self.engine.models(self.client) - {self.engine.base}
        for name in wanted.keys() - held:
            await self.engine.load(self.client, name, wanted[name])
        for name in held - wanted.keys():
            await self.engine.unload(self.client, name)
        self.loaded = wanted

    # --- alias moves

    async def swap(self, alias: str, new: Adapter | None) -> str | None:
        """Serve `new` for `alias` (None: stop serving the alias): load it, switch, drain and unload the old.
        Returns why it was refused (the old adapter keeps serving), else None."""
        async with self._swap:
            old = self.arms.get(alias)
            if (old and new and old.engine_name == new.engine_name) or (old is None and new is None):
                return None
            if new is not None:
                reason = refusal(new, self.base, self.base_sha256, self.max_rank)
                if reason is None:
                    if self.engine_down():
                        return "the engine is restarting"  # the next poll moves it, onto the restarted engine
                    try:
                        await self.engine.load(self.client, new.engine_name, new.path)
                    except (RuntimeError, httpx.HTTPError) as e:
                        if self.engine_down():
                            return "the engine is restarting"
                        reason = f"{alias} v{new.version} not loaded: {e}"
                    else:
                        self.loaded[new.engine_name] = new.path
                if reason is not None:
                    if self.refused.get(new.engine_name) != reason:
                        log.error("%s; %s keeps serving", reason, old.engine_name if old else "nothing")
                        self.refused[new.engine_name] = reason
                    return reason
                self.arms[alias] = new
            else:
                del self.arms[alias]
            log.warning("%s: %s -> %s", alias, old.engine_name if old else "-", new.engine_name if new else "-")
            if old is not None:
                await self._drain(old.engine_name)
                try:
                    await self.engine.unload(self.client, old.engine_name)
                except (RuntimeError, httpx.HTTPError) as e:
                    log.error("%s", e)  # it stays loaded, unused: memory, not correctness
                else:
                    self.loaded.pop(old.engine_name, None)
            return None

    async def _drain(self, name: str) -> None:
        """Until no request is in flight on `name` (at most one request timeout)."""
        deadline = time.monotonic() + self.timeout_s
        while self.inflight[name] > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    async def follow(self, resolve: Callable[[str], Adapter | None], poll_s: float) -> None:
        """Poll the registry forever; apply each alias's move. A failed read is logged and retried."""
        while True:
            await asyncio.sleep(poll_s)
            for alias in (CHAMPION, CHALLENGER):
                try:
                    wanted = await anyio.to_thread.run_sync(resolve, alias)
                except Exception as e:
                    log.error("reading alias %s failed (%s: %s); serving what is loaded", alias, type(e).__name__, e)
                    continue
                if alias == CHAMPION and wanted is None:
                    log.error(
                        "the champion alias is gone from the registry; serving %s until it is set again",
                        self.arms[CHAMPION].engine_name if CHAMPION in self.arms else "nothing",
                    )
                    continue
                await self.swap(alias, wanted)

    @property
    def client(self) -> httpx.AsyncClient:
        """The engine's HTTP client: opened by the app's lifespan (`serve`), hence None until it starts."""
        if self._client is None:
            raise RuntimeError(
                "the router has no engine client yet: it is opened by the lifespan given to "
                "Router.app, so serve the app (uvicorn, TestClient) before sending requests"
            )
        return self._client

    @client.setter
    def client(self, client: httpx.AsyncClient) -> None:
        self._client = client

    async def _up_then_supervise(self, cfg: ServeConfig) -> None:
        """The engine brought up (unless the caller started it and waited for it), then supervised."""
        self.probe_timeout_s = cfg.probe_timeout_s
        try:
            if self.engine.pid is None or self.engine.exit_status() is not None or self.engine.adopted is not None:
                await self.bring_up(cfg.restart_limit)
            if self.gave_up is None:
                await self.supervise(cfg.probe_s, cfg.probe_timeout_s, cfg.restart_limit)
        except Exception as e:  # a background task's error is seen by no one: the router would serve 503s forever
            log.exception("the engine's supervision failed")
            self.gave_up = EngineError(f"the engine's supervision failed ({type(e).__name__}: {e})")
            self.stop()

    def lifespan(self, resolve: Callable[[str], Adapter | None] | None, cfg: ServeConfig) -> Lifespan[Starlette]:
        """What `serve` runs beside the app: the engine's HTTP client, the engine brought up in the background
        (uvicorn binds the port only once this returns control: the router answers from its first second), its
        supervisor, and the alias follower (with `resolve`)."""

        @contextlib.asynccontextmanager
        async def lifespan(_app: Starlette) -> AsyncIterator[None]:
            if self.engine.pid is None and self.engine.record is not None:
                log.warning("%s", self.engine.adopt())  # its port and key decide the client's
            limits = httpx.Limits(max_connections=256, max_keepalive_connections=64)
            async with httpx.AsyncClient(
                base_url=self.engine.url, headers=self.engine.headers, limits=limits, timeout=cfg.request_timeout_s
            ) as client:
                self.client = client
                tasks = [asyncio.create_task(self._up_then_supervise(cfg))]
                if resolve is not None:
                    tasks.append(asyncio.create_task(self.follow(resolve, cfg.poll_s)))
                try:
                    yield
                finally:
                    for task in tasks:
                        task.cancel()

        return lifespan

    def app(self, lifespan: Lifespan[Starlette] | None = None) -> Starlette:
        return Starlette(
            routes=[
                Route("/v1/chat/completions", self.chat, methods=["POST"]),
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/v1/feedback", self.feedback, methods=["POST"]),
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/health", self.health, methods=["GET"]),
                Route("/ready", self.ready, methods=["GET"]),
            ],
            lifespan=lifespan,
        )


# ------------------------------------------------------------------------------------------------ the process


class ServeSetupError(RuntimeError):
    """What keeps the router from starting that the user fixes (exit 2): no champion, an unreachable registry."""


def serve(cfg: PipelineConfig, host: str, port: int, api_key: str | None, request_log: RequestLog, python: str) -> None:
    """Resolve the aliases, start the engine with their adapters, serve until stopped (SIGINT/SIGTERM).
    The caller checks what needs no download first: the log store opened (and proven reachable), `api_key` from
    `api_key_policy`, the engine's `python` from `engine.engine_python`."""
    serve_cfg = cfg.ab.serve
    registry = Registry(open_client(cfg.mlflow_uri), cfg.tracking.registered_model)
    cache = Path(cfg.data_dir) / "serve" / "adapters"

    def resolve_alias(alias: str) -> Adapter | None:
        if alias == CHALLENGER and cfg.promote.mode != "canary":
            return None  # offline promotion puts the candidate its gate rejected there: never live traffic
        return resolve(registry, alias, cfg.mlflow_uri, cache)

    service_errors: tuple[type[BaseException], ...] = (RegistryServiceError, *registry.errors)
    try:
        champion = resolve_alias(CHAMPION)
        challenger = resolve_alias(CHALLENGER)
    except service_errors as e:
        raise ServeSetupError(f"the registry {registry.name} at {cfg.mlflow_uri} did not answer: {e}") from e
    if champion is None:
        raise ServeSetupError(
            f"no champion alias in the registry {registry.name} at {cfg.mlflow_uri}: run the "
            "pipeline until a version is promoted, or `grpo-pipeline promote --force`"
        )
    spool = ab_spool.spool_path(cfg.data_dir)
    if ab_spool.replay(spool, request_log):
        log.warning("replayed the requests an earlier run answered while the log store was unreachable")

    base = local_base(champion.base, champion.base_sha256, cfg.mlflow_uri)
    serve_dir = Path(cfg.data_dir) / "serve"
    record = serve_dir / "engine.json" if serve_cfg.reattach_engine else None
    engine = Engine(python, base, serve_cfg, serve_dir / "engine.log", record=record)
    initial, refused = {champion.alias: champion}, {}
    if challenger is not None:
        reason = refusal(challenger, champion.base, champion.base_sha256, serve_cfg.max_lora_rank)
        if reason:
            log.error("%s; all traffic goes to the champion", reason)
            refused[challenger.engine_name] = reason  # said once: the alias polls do not repeat it
        else:
            initial[CHALLENGER] = challenger
    if (reason := refusal(champion, champion.base, champion.base_sha256, serve_cfg.max_lora_rank)) is not None:
        raise ServeSetupError(reason)
    try:
        router = Router(
            engine=engine,
            client=None,
            request_log=request_log,
            spool=spool,
            challenger_fraction=cfg.ab.challenger_fraction,
            api_key=api_key,
            base=champion.base,
            base_sha256=champion.base_sha256,
            max_rank=serve_cfg.max_lora_rank,
            request_timeout_s=serve_cfg.request_timeout_s,
            rewards=cfg.train.reward_set().skill_only(),  # `reference` feedback scored by the skill, as the gate
            log_completions=serve_cfg.log_completions,
            retry_after_s=serve_cfg.retry_after_s,
        )
        router.arms, router.refused = initial, refused
        router.loaded = {a.engine_name: a.path for a in initial.values()}
        run(router, host, port, resolve_alias, serve_cfg)  # the engine starts (or is attached) in the background
    finally:
        engine.stop()  # a clean stop takes the engine along; a killed router leaves it for the next (record)


def run(router: Router, host: str, port: int, resolve: Callable[[str], Adapter | None], cfg: ServeConfig) -> None:
    """Serve `router` under uvicorn until stopped (SIGINT/SIGTERM): the port answers at once, the engine is started
    (or attached, or was started and waited for by the caller) in the background, then supervised, and the
    aliases followed with `resolve`; raise the engine's `EngineError` when it would not start or come back
    (`ab.serve.restart_limit`), so that the process exits non-zero and its own supervisor (the stack, the
    container) restarts it. Start the server on the main thread: the engine's death signal follows the thread
    that forks it (a thread that lives as long as the server also does)."""
    import uvicorn

    log.warning(
        "serving %s on http://%s:%d (API key %s)",
        ", ".join(router.arms),
        host,
        port,
        "required" if router.api_key else f"off: loopback only, {API_KEY_ENV} unset",
    )
    server = uvicorn.Server(
        uvicorn.Config(
            router.app(router.lifespan(resolve, cfg)), host=host, port=port, log_level="warning", access_log=False
        )
    )
    router.stop = lambda: setattr(server, "should_exit", True)
    server.run()
    if router.gave_up is not None:
        raise router.gave_up
