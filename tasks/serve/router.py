"""`grpo-pipeline serve`: the OpenAI-compatible router in front of the engine. It assigns each request to an arm
(champion or challenger) by a hash of the user's key, sends it to that arm's adapter in the engine, writes the
request to the A/B log before answering, takes feedback, and follows the registry's aliases.

The pure parts first (the assignment, the validation of bodies and keys), then `Router`, the state one process
holds: which adapter serves each alias, and how many requests each adapter has in flight. It holds nothing
else: the assignment is a function of the key and `ab.challenger_fraction`, the log is the shared store, so
replicas behind any load balancer agree.

- **Assignment.** The key is the `X-Assignment-Key` header, else the body's `safety_identifier`, else its
  `user` (OpenAI's older name for it); a request without one gets a random key, so an arm at random.
  sha256(key) read as a number in [0, 1) below `challenger_fraction` is the challenger. Raising the fraction
  moves users champion -> challenger only, never back.
- **Each response** carries `X-GRPO-Arm` and `X-GRPO-Version`, its `model` is `<alias>-v<version>` and its
  `id` the log's id (what `/v1/feedback` takes).
- **Logging before answering.** The row is committed before the response is sent, so an answered request is
  in the log even if the router is killed right after; the id is the primary key, so never twice. A store
  that fails mid-run does not stop serving: the row goes to a local write-ahead file (`tasks/serve/ab_spool.py`),
  counted by `ab status` and replayed into the store by the next successful write.
- **Alias moves.** Every `ab.serve.poll_s` the registry is read; a moved alias gets its new adapter loaded,
  requests switched to it, and the old one unloaded once its requests in flight have finished. An adapter
  of another base (or a rank above the engine's) is refused with the reason, and the old one keeps serving.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import ipaddress
import json
import logging
import math
import secrets
import time
import uuid
from collections import Counter
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.types import Lifespan

from grpo_pipeline.tasks.serve import ab_spool
from grpo_pipeline.tasks.serve.ab_log import LogStoreError, RequestLog, RequestRow, UnknownRequest
from grpo_pipeline.tasks.serve.adapters import Adapter, refusal

if TYPE_CHECKING:
    from grpo_pipeline.configs.schema import PipelineConfig
    from grpo_pipeline.tasks.serve.engine import Engine

CHAMPION, CHALLENGER = "champion", "challenger"
KEY_HEADER = "x-assignment-key"
ARM_HEADER, VERSION_HEADER = "X-GRPO-Arm", "X-GRPO-Version"
API_KEY_ENV = "GRPO_SERVE_API_KEY"
MAX_ID = 64  # the log's id column

log = logging.getLogger("grpo_pipeline.serve")


class BadRequest(ValueError):
    """A request body the router refuses (HTTP 400), with the reason."""


# ------------------------------------------------------------------------------------------------ pure parts


def assignment_hash(key: str) -> str:
    """The key's hash as the log stores it (never the key itself): 16 hex digits, 64 bits.

    >>> assignment_hash("user-42")
    '6d894aa3ee802549'
    """
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def arm_for(key_hash: str, challenger_fraction: float) -> str:
    """The arm of a key's hash: its 64 bits read as a number in [0, 1), below the fraction is the challenger.
    A pure function of (key, fraction): every replica, every restart, gives one user one arm.

    >>> arm_for("0000000000000000", 0.1), arm_for("ffffffffffffffff", 0.1), arm_for("ffffffffffffffff", 1.0)
    ('challenger', 'champion', 'challenger')
    """
    # compared as integers against fraction * 2**64: a float division would round the top keys up to 1.0
    return CHALLENGER if int(key_hash, 16) < challenger_fraction * 2**64 else CHAMPION


def assignment_key(body: dict, headers: Mapping[str, str]) -> str | None:
    """The user's key: the `X-Assignment-Key` header, else `safety_identifier`, else `user` (None: none given)."""
    for value in (headers.get(KEY_HEADER), body.get("safety_identifier"), body.get("user")):
        if isinstance(value, str) and value:
            return value
    return None


def parse_object(raw: bytes) -> dict:
    """The body as a JSON object, or `BadRequest` naming what is wrong.

    >>> try:
    ...     parse_object(b'[1]')
    ... except BadRequest as e:
    ...     print(e)
    the body must be a JSON object, got a list
    """
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise BadRequest(f"the body is not valid JSON ({e})") from None
    if not isinstance(body, dict):
        raise BadRequest(f"the body must be a JSON object, got a {type(body).__name__}")
    return body


def _is_token_list(value: object) -> bool:
    return (
        isinstance(value, list) and bool(value) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    )


def validate_generation(kind: str, body: dict) -> dict:
    """What the router checks itself before the engine sees a request (the engine checks the rest and its 400
    is passed on): the prompt's shape, the key fields' types, no streaming.

    >>> try:
    ...     validate_generation("chat", {"messages": []})
    ... except BadRequest as e:
    ...     print(e)
    messages must be a non-empty list of {"role": ..., "content": ...} objects
    """
    if kind == "chat":
        messages = body.get("messages")
        if not (
            isinstance(messages, list)
            and messages
            and all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages)
        ):
            raise BadRequest('messages must be a non-empty list of {"role": ..., "content": ...} objects')
    else:
        prompt = body.get("prompt")
        ok = (
            isinstance(prompt, str)
            or _is_token_list(prompt)
            or (isinstance(prompt, list) and prompt and all(isinstance(p, str) or _is_token_list(p) for p in prompt))
        )
        if not ok:
            raise BadRequest("prompt must be a string, a list of strings, or token ids (a list of integers)")
    for field in ("user", "safety_identifier"):
        if field in body and not isinstance(body[field], str):
            raise BadRequest(f"{field} must be a string (the user's key for the A/B assignment)")
    if body.get("stream"):
        raise BadRequest(
            "stream=true is not supported by this router: send stream=false (the whole answer is "
            "logged with its token counts before it is returned)"
        )
    return body


def validate_feedback(body: dict) -> tuple[str, float]:
    """(request id, score) of a `/v1/feedback` body, or `BadRequest`.

    >>> try:
    ...     validate_feedback({"id": "grpo-1", "score": float("nan")})
    ... except BadRequest as e:
    ...     print(e)
    score must be a finite number, got nan
    """
    request_id, score = body.get("id"), body.get("score")
    if not isinstance(request_id, str) or not 0 < len(request_id) <= MAX_ID:
        raise BadRequest(f"id must be the response's id (a string of 1 to {MAX_ID} characters), got {request_id!r}")
    if isinstance(score, bool) or not isinstance(score, (int, float)) or not math.isfinite(score):
        raise BadRequest(f"score must be a finite number, got {score!r}")
    extra = set(body) - {"id", "score"}
    if extra:
        raise BadRequest(f"unknown fields {sorted(extra)}: feedback takes id and score")
    return request_id, float(score)


def authorized(header: str | None, api_key: str | None) -> bool:
    """A request may pass: no key configured, or `Authorization: Bearer <key>` (compared in constant time)."""
    if api_key is None:
        return True
    scheme, _, token = (header or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), api_key.encode())


def is_loopback(host: str) -> bool:
    """Only this machine can connect.

    >>> is_loopback("127.0.0.1"), is_loopback("localhost"), is_loopback("0.0.0.0")
    (True, True, False)
    """
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def api_key_policy(environ: dict, host: str) -> str | None:
    """The key clients must send: `$GRPO_SERVE_API_KEY`. Absent, the router serves without one only on a
    loopback host (local use); on any other host it refuses to start. Set but empty is a mistake, not a choice.

    >>> api_key_policy({}, "127.0.0.1") is None
    True
    >>> api_key_policy({}, "0.0.0.0")
    Traceback (most recent call last):
    ...
    ValueError: serving on 0.0.0.0 needs an API key for clients: set GRPO_SERVE_API_KEY (clients send Authorization: Bearer <key>), or serve on 127.0.0.1 for local use
    """
    key = environ.get(API_KEY_ENV)
    if key is not None and not key.strip():
        raise ValueError(f"{API_KEY_ENV} is set but empty: set a key, or unset it to serve keyless on 127.0.0.1")
    if key is None and not is_loopback(host):
        raise ValueError(
            f"serving on {host} needs an API key for clients: set {API_KEY_ENV} (clients send "
            "Authorization: Bearer <key>), or serve on 127.0.0.1 for local use"
        )
    return key


def usage_tokens(answer: dict) -> tuple[int, int]:
    usage = answer.get("usage") or {}
    return int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0)


def _error(
    status: int,
    message: str,
    kind: str = "invalid_request_error",
    headers: Mapping[str, str] | None = None,
    **extra: Any,
) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}, **extra}, status, headers=headers)


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
    ):
        self.engine, self._client, self.log, self.spool = engine, client, request_log, spool
        self.fraction, self.api_key = challenger_fraction, api_key
        self.base, self.base_sha256, self.max_rank = base, base_sha256, max_rank
        self.timeout_s = request_timeout_s
        self.arms: dict[str, Adapter] = {}
        self.inflight: Counter[str] = Counter()
        self.unlogged = 0  # rows this process spooled because the store failed
        self.refused: dict[str, str] = {}  # engine name -> reason, so a refusal is logged once per version
        self._swap = asyncio.Lock()

    # --- requests

    def pick(self, key: str | None) -> tuple[Adapter, str | None]:
        """(the adapter that answers, the hash of the user's key for the log)."""
        hashed = assignment_hash(key) if key is not None else None
        arm = arm_for(hashed or assignment_hash(secrets.token_hex(16)), self.fraction)
        if arm not in self.arms:  # no challenger alias (none yet, or rolled back): everyone gets the champion
            arm = CHAMPION
        return self.arms[arm], hashed

    def _write(self, row: RequestRow) -> None:
        """Into the store (then replay any spooled rows), else into the spool: never dropped. In a thread."""
        try:
            self.log.record(row)
        except LogStoreError as e:
            ab_spool.append(self.spool, row)
            self.unlogged += 1
            log.error(
                "A/B log store failed; request %s kept in %s (%d waiting): %s",
                row.id,
                self.spool,
                ab_spool.pending(self.spool),
                e,
            )
            return
        if self.unlogged or self.spool.exists():
            try:
                if ab_spool.replay(self.spool, self.log):
                    log.warning("A/B log store back: the spooled requests are in the log")
                self.unlogged = 0
            except LogStoreError:
                pass

    async def generate(self, request: Request, kind: str) -> JSONResponse:
        if not authorized(request.headers.get("authorization"), self.api_key):
            return _error(
                401, f"missing or wrong API key: send Authorization: Bearer <{API_KEY_ENV}>", "authentication_error"
            )
        try:
            body = validate_generation(kind, parse_object(await request.body()))
        except BadRequest as e:
            return _error(400, str(e))
        if CHAMPION not in self.arms:
            return _error(503, "no champion adapter is loaded", "service_unavailable")
        adapter, hashed = self.pick(assignment_key(body, request.headers))
        arm_headers = {ARM_HEADER: adapter.alias, VERSION_HEADER: adapter.version}
        request_id = f"grpo-{uuid.uuid4().hex}"
        body["model"] = adapter.engine_name  # the arm decides; a client's `model` is not a choice of adapter
        path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
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
        if answer is not None and answer.status_code in (400, 422):  # the client's input, not the arm's failure
            try:
                return JSONResponse(answer.json(), answer.status_code, headers=arm_headers)
            except ValueError:
                return _error(answer.status_code, answer.text[:500], headers=arm_headers)
        payload: dict[str, Any] | None = None
        if answer is not None:
            if answer.status_code != 200:
                failure = f"the engine answered HTTP {answer.status_code}: {answer.text[:300]}"
            else:
                try:
                    payload = answer.json()
                except ValueError:
                    payload = None
                if not isinstance(payload, dict):  # a completion is a JSON object: anything else is the arm failing
                    payload, failure = None, f"the engine answered HTTP 200 without a JSON object: {answer.text[:300]}"
        prompt_tokens, completion_tokens = usage_tokens(payload or {})
        row = RequestRow(
            id=request_id,
            arm=adapter.alias,
            version=adapter.version,
            latency_s=latency,
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            error=payload is None,
            assignment=hashed,
        )
        await anyio.to_thread.run_sync(self._write, row)  # committed (or spooled) before the answer leaves
        if payload is None:
            return _error(
                502, failure or "the engine gave no answer", "engine_error", headers=arm_headers, id=request_id
            )
        return JSONResponse(payload | {"id": request_id, "model": adapter.engine_name}, headers=arm_headers)

    async def chat(self, request: Request) -> JSONResponse:
        return await self.generate(request, "chat")

    async def completions(self, request: Request) -> JSONResponse:
        return await self.generate(request, "completions")

    async def feedback(self, request: Request) -> JSONResponse:
        if not authorized(request.headers.get("authorization"), self.api_key):
            return _error(
                401, f"missing or wrong API key: send Authorization: Bearer <{API_KEY_ENV}>", "authentication_error"
            )
        try:
            request_id, score = validate_feedback(parse_object(await request.body()))
            await anyio.to_thread.run_sync(self.log.feedback, request_id, score)
        except BadRequest as e:
            return _error(400, str(e))
        except UnknownRequest as e:
            return _error(404, f"{e}: feedback takes the id of a response this service gave", "not_found_error")
        except LogStoreError as e:
            return _error(503, f"the A/B log store did not take the feedback: {e}", "service_unavailable")
        return JSONResponse({"id": request_id, "score": score, "status": "stored"})

    async def models(self, request: Request) -> JSONResponse:
        if not authorized(request.headers.get("authorization"), self.api_key):
            return _error(
                401, f"missing or wrong API key: send Authorization: Bearer <{API_KEY_ENV}>", "authentication_error"
            )
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
        # For load balancers: no key, nothing about the models; 503 until the champion is loaded.
        ready = CHAMPION in self.arms
        return JSONResponse({"status": "ok" if ready else "starting", "unlogged": self.unlogged}, 200 if ready else 503)

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
                    try:
                        await self.engine.load(self.client, new.engine_name, new.path)
                    except (RuntimeError, httpx.HTTPError) as e:
                        reason = f"{alias} v{new.version} not loaded: {e}"
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

    def app(self, lifespan: Lifespan[Starlette] | None = None) -> Starlette:
        return Starlette(
            routes=[
                Route("/v1/chat/completions", self.chat, methods=["POST"]),
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/v1/feedback", self.feedback, methods=["POST"]),
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/health", self.health, methods=["GET"]),
            ],
            lifespan=lifespan,
        )


# ------------------------------------------------------------------------------------------------ the process


class ServeSetupError(RuntimeError):
    """What keeps the router from starting that the user fixes (exit 2): no champion, an unreachable registry."""


def serve(
    cfg: PipelineConfig, host: str, port: int, api_key: str | None, request_log: RequestLog, cwd: Path | None = None
) -> None:
    """Resolve the aliases, start the engine with their adapters, serve until stopped (SIGINT/SIGTERM).
    The log store is opened (and proven reachable) by the caller; `api_key` comes from `api_key_policy`."""
    import contextlib

    import uvicorn

    from grpo_pipeline.tasks.promote.registry import Registry, RegistryServiceError, open_client
    from grpo_pipeline.tasks.serve.adapters import local_base, resolve
    from grpo_pipeline.tasks.serve.engine import Engine, default_python

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
    python = serve_cfg.engine_python or str(default_python(cwd or Path.cwd()))
    engine = Engine(python, base, serve_cfg, Path(cfg.data_dir) / "serve" / "engine.log")
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
    log.warning(
        "starting the engine (%s) on %s with %s; its log: %s",
        python,
        engine.url,
        ", ".join(a.engine_name for a in initial.values()),
        engine.log_path,
    )
    engine.start({a.engine_name: a.path for a in initial.values()})  # main thread: the death signal follows it
    try:
        engine.wait_ready()
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
        )
        router.arms, router.refused = initial, refused

        @contextlib.asynccontextmanager
        async def lifespan(_app):
            limits = httpx.Limits(max_connections=256, max_keepalive_connections=64)
            async with httpx.AsyncClient(
                base_url=engine.url, headers=engine.headers, limits=limits, timeout=serve_cfg.request_timeout_s
            ) as client:
                router.client = client
                follower = asyncio.create_task(router.follow(resolve_alias, serve_cfg.poll_s))
                try:
                    yield
                finally:
                    follower.cancel()

        log.warning(
            "serving %s on http://%s:%d (API key %s)",
            ", ".join(router.arms),
            host,
            port,
            "required" if api_key else f"off: loopback only, {API_KEY_ENV} unset",
        )
        uvicorn.run(router.app(lifespan), host=host, port=port, log_level="warning", access_log=False)
    finally:
        engine.stop()
