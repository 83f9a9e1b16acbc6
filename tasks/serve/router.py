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
  in the log even if the router is killed right after; the id is the primary key, so never twice. A streamed
  answer (`stream: true`) is relayed chunk by chunk and its row committed when the engine's stream ends,
  before the final `data: [DONE]`; a client that leaves mid-stream gets its row with the error flag, once. A store
  that fails mid-run does not stop serving: the row goes to a local write-ahead file (`tasks/serve/ab_spool.py`),
  counted by `ab status` and replayed into the store by the next successful write.
- **Feedback** takes a `score`, or a `reference` that the pipeline's own rewards (the config's `RewardSet`,
  weighted total) score the logged completion against: one judge for training, holdout and production.
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
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Lifespan, Receive, Scope, Send

from grpo_pipeline.tasks.serve import ab_spool
from grpo_pipeline.tasks.serve.ab_log import LogStoreError, RequestLog, RequestRow, UnknownRequest
from grpo_pipeline.tasks.serve.adapters import Adapter, refusal

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Awaitable

    from grpo_pipeline.configs.rewards import RewardSet
    from grpo_pipeline.configs.schema import PipelineConfig
    from grpo_pipeline.tasks.serve.engine import Engine

CHAMPION, CHALLENGER = "champion", "challenger"
KEY_HEADER = "x-assignment-key"
ARM_HEADER, VERSION_HEADER = "X-GRPO-Arm", "X-GRPO-Version"
API_KEY_ENV = "GRPO_SERVE_API_KEY"
MAX_ID = 64  # the log's id column
MAX_REFERENCE = 100_000  # characters of a feedback reference
DONE = b"data: [DONE]\n\n"

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
    is passed on): the prompt's shape, the key fields' and the streaming fields' types.

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
    if "stream" in body and not isinstance(body["stream"], bool):
        raise BadRequest("stream must be true or false")
    if body.get("stream_options") is not None and not isinstance(body["stream_options"], dict):
        raise BadRequest('stream_options must be an object, e.g. {"include_usage": true}')
    return body


def validate_feedback(body: dict) -> tuple[str, float | None, str | None]:
    """(request id, score, reference) of a `/v1/feedback` body, exactly one of score and reference set; else
    `BadRequest`. A score is the outcome itself; a reference is what the answer should have been, scored by
    the pipeline's rewards. Both at once is refused: which one would count is not the router's guess.

    >>> try:
    ...     validate_feedback({"id": "grpo-1", "score": float("nan")})
    ... except BadRequest as e:
    ...     print(e)
    score must be a finite number, got nan
    >>> validate_feedback({"id": "grpo-1", "reference": "42"})
    ('grpo-1', None, '42')
    """
    request_id = body.get("id")
    if not isinstance(request_id, str) or not 0 < len(request_id) <= MAX_ID:
        raise BadRequest(f"id must be the response's id (a string of 1 to {MAX_ID} characters), got {request_id!r}")
    extra = set(body) - {"id", "score", "reference"}
    if extra:
        raise BadRequest(f"unknown fields {sorted(extra)}: feedback takes id and one of score or reference")
    if "score" in body and "reference" in body:
        raise BadRequest(
            "give score or reference, not both: a score is stored as it is, a reference is scored by the "
            "pipeline's rewards; send two requests if both are meant (the later one replaces the earlier)"
        )
    if "reference" in body:
        reference = body["reference"]
        if not isinstance(reference, (str, int)) or isinstance(reference, bool) or not str(reference).strip():
            raise BadRequest(f"reference must be a non-empty string (the expected answer), got {reference!r}")
        if len(str(reference)) > MAX_REFERENCE:
            raise BadRequest(f"reference is longer than {MAX_REFERENCE:,} characters")
        return request_id, None, str(reference)
    score = body.get("score")
    if "score" not in body:
        raise BadRequest("feedback needs a score (a finite number) or a reference (the expected answer)")
    if isinstance(score, bool) or not isinstance(score, (int, float)) or not math.isfinite(score):
        raise BadRequest(f"score must be a finite number, got {score!r}")
    return request_id, float(score), None


def score_reference(rewards: RewardSet, completion: str, reference: str, completion_tokens: int) -> dict[str, float]:
    """The pipeline's rewards on one logged completion against its reference, as evaluation scores the holdout
    (`grpo_pipeline.tasks.evaluate.score`): each reward's score and the weighted `total`, the outcome stored.

    >>> from grpo_pipeline.configs.rewards import RewardSet
    >>> score_reference(RewardSet(names=("correct_answer", "number_only"), weights=(1.0, 0.5)), "42", "42", 1)
    {'correct_answer': 1.0, 'number_only': 1.0, 'total': 1.5}
    """
    from grpo_pipeline.tasks.evaluate import score  # the reward functions: loaded once feedback needs them

    row = score([{"answer": reference}], [completion], rewards, [completion_tokens]).rows[0]
    return {**{name: float(row[name]) for name in rewards.names}, "total": float(row["total"])}


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


def answer_text(kind: str, answer: dict) -> str | None:
    """The first choice's text of a whole (not streamed) answer: what `reference` feedback is scored on.

    >>> answer_text("chat", {"choices": [{"message": {"role": "assistant", "content": "7"}}]})
    '7'
    >>> answer_text("completions", {"choices": []}) is None
    True
    """
    try:
        first = answer["choices"][0]
        text = first["message"]["content"] if kind == "chat" else first["text"]
    except (KeyError, IndexError, TypeError):
        return None
    return text if isinstance(text, str) else None


def chunk_text(kind: str, chunk: dict) -> dict[int, str]:
    """{choice index: the text it adds} of one streamed chunk.

    >>> chunk_text("chat", {"choices": [{"index": 0, "delta": {"content": "4"}}]})
    {0: '4'}
    >>> chunk_text("completions", {"choices": [{"index": 1, "text": " two"}], "usage": None})
    {1: ' two'}
    """
    out: dict[int, str] = {}
    for choice in chunk.get("choices") or ():
        if not isinstance(choice, dict):
            continue
        text = (choice.get("delta") or {}).get("content") if kind == "chat" else choice.get("text")
        if isinstance(text, str) and text:
            out[int(choice.get("index") or 0)] = text
    return out


def relay_chunk(chunk: dict, request_id: str, model: str, client_wants_usage: bool) -> dict | None:
    """A chunk as the client sees it: the log's `id` and the arm's `model`, as for a whole answer; the usage the
    router asked the engine for (to log the token counts) is taken out again when the client did not ask.
    None: nothing left to send (the usage-only last chunk nobody asked for).

    >>> relay_chunk({"id": "cmpl-1", "model": "champion-v1", "choices": [], "usage": {"completion_tokens": 3}},
    ...             "grpo-9", "champion-v1", False) is None
    True
    >>> relay_chunk({"id": "cmpl-1", "choices": [{"text": "a"}], "usage": None}, "grpo-9", "champion-v1", False)
    {'id': 'grpo-9', 'choices': [{'text': 'a'}], 'model': 'champion-v1'}
    """
    out = chunk | {"id": request_id, "model": model}
    if not client_wants_usage and "usage" in out:
        del out["usage"]
        if not out.get("choices"):
            return None
    return out


def _error(
    status: int,
    message: str,
    kind: str = "invalid_request_error",
    headers: Mapping[str, str] | None = None,
    **extra: Any,
) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}, **extra}, status, headers=headers)


def _passed_on(status: int, raw: bytes, headers: Mapping[str, str]) -> JSONResponse:
    """The engine's own 400/422 (the client's input), passed on as it said it."""
    try:
        return JSONResponse(json.loads(raw), status, headers=headers)
    except ValueError:
        return _error(status, raw[:500].decode(errors="replace"), headers=headers)


class _LoggedStream(StreamingResponse):
    """Server-sent events whose `closed` runs however the response ends: streamed to the end, the client gone
    (Starlette cancels the stream, or the send fails), or an error. Shielded, so a cancelled response still
    closes the engine's stream and writes its row."""

    def __init__(self, content: AsyncIterator[bytes], closed: Callable[[], Awaitable[None]], headers: dict[str, str]):
        super().__init__(content, media_type="text/event-stream", headers=headers)
        self.closed = closed

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.closed()


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
    ):
        self.engine, self._client, self.log, self.spool = engine, client, request_log, spool
        self.rewards, self.log_completions = rewards, log_completions
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

    def _denied(self, request: Request) -> JSONResponse | None:
        if authorized(request.headers.get("authorization"), self.api_key):
            return None
        return _error(
            401, f"missing or wrong API key: send Authorization: Bearer <{API_KEY_ENV}>", "authentication_error"
        )

    def _row(
        self, request_id: str, adapter: Adapter, hashed: str | None, latency: float, usage: dict, **fields: Any
    ) -> RequestRow:
        prompt_tokens, completion_tokens = usage_tokens({"usage": usage})
        completion = fields.pop("completion", None)
        return RequestRow(
            id=request_id,
            arm=adapter.alias,
            version=adapter.version,
            latency_s=latency,
            prompt_tokens=fields.pop("prompt_tokens", prompt_tokens),
            completion_tokens=fields.pop("completion_tokens", completion_tokens),
            assignment=hashed,
            completion=completion if self.log_completions else None,
            **fields,
        )

    async def generate(self, request: Request, kind: str) -> Response:
        if (denied := self._denied(request)) is not None:
            return denied
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
        if answer is not None and answer.status_code in (400, 422):  # the client's input, not the arm's failure
            return _passed_on(answer.status_code, answer.content, arm_headers)
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
        row = self._row(
            request_id,
            adapter,
            hashed,
            latency,
            (payload or {}).get("usage") or {},
            error=payload is None,
            completion=answer_text(kind, payload) if payload else None,
        )
        await anyio.to_thread.run_sync(self._write, row)  # committed (or spooled) before the answer leaves
        if payload is None:
            return _error(
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
        options = body.get("stream_options") or {}
        client_wants_usage = bool(options.get("include_usage"))
        body["stream_options"] = {**options, "include_usage": True}
        name = adapter.engine_name
        self.inflight[name] += 1
        started = time.perf_counter()
        texts: dict[int, list[str]] = {}
        usage: dict = {}
        chunks_with_text = 0
        logged = False

        async def commit(error: bool) -> None:
            """Write the row once (whichever of the end, a failure or a disconnect comes first)."""
            nonlocal logged
            if logged:
                return
            logged = True
            self.inflight[name] -= 1
            counts = {} if usage else {"completion_tokens": chunks_with_text}  # a cut stream has no usage
            row = self._row(
                request_id,
                adapter,
                hashed,
                time.perf_counter() - started,
                usage,
                error=error,
                completion="".join(texts.get(0, [])) if not error else None,
                **counts,
            )
            await anyio.to_thread.run_sync(self._write, row)

        try:
            upstream = await self.client.send(
                self.client.build_request("POST", path, json=body, timeout=self.timeout_s), stream=True
            )
        except httpx.HTTPError as e:
            await commit(error=True)
            return _error(
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
                logged = True  # the client's input: not the arm's request, not logged
                self.inflight[name] -= 1
                return _passed_on(upstream.status_code, raw, arm_headers)
            await commit(error=True)
            return _error(
                502,
                f"the engine answered HTTP {upstream.status_code}: {raw[:300].decode(errors='replace')}",
                "engine_error",
                headers=arm_headers,
                id=request_id,
            )

        async def events() -> AsyncIterator[bytes]:
            nonlocal usage, chunks_with_text
            done, failure = False, None
            try:
                async for line in upstream.aiter_lines():
                    if not line.startswith("data:"):
                        continue  # blank separators, comments
                    data = line[len("data:") :].strip()
                    if data == "[DONE]":
                        done = True
                        break
                    try:
                        chunk = json.loads(data)
                    except ValueError:
                        chunk = None
                    if not isinstance(chunk, dict):
                        failure = f"the engine streamed something other than a JSON object: {data[:200]}"
                        break
                    if "error" in chunk:  # vLLM reports a failure mid-stream as an event, then [DONE]
                        failure = f"the engine failed mid-stream: {json.dumps(chunk['error'])[:300]}"
                    if isinstance(chunk.get("usage"), dict):
                        usage = chunk["usage"]
                    for index, text in chunk_text(kind, chunk).items():
                        texts.setdefault(index, []).append(text)
                        chunks_with_text += 1
                    out = relay_chunk(chunk, request_id, name, client_wants_usage)
                    if out is not None:
                        yield f"data: {json.dumps(out)}\n\n".encode()
            except httpx.HTTPError as e:
                failure = f"the engine's stream broke ({type(e).__name__}: {e})"
            if not done and failure is None:
                failure = "the engine's stream ended without [DONE]"
            await commit(error=failure is not None)  # in the log before the client's [DONE]
            if failure is not None:
                error = {"message": failure, "type": "engine_error", "code": 502}
                yield f"data: {json.dumps({'id': request_id, 'error': error})}\n\n".encode()
            yield DONE

        async def closed() -> None:
            await upstream.aclose()
            await commit(error=True)  # a no-op when the stream ended: only a client that left mid-stream

        return _LoggedStream(events(), closed, arm_headers)

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
            return _error(400, str(e))
        except UnknownRequest as e:
            return _error(404, f"{e}: feedback takes the id of a response this service gave", "not_found_error")
        except LogStoreError as e:
            return _error(503, f"the A/B log store did not take the feedback: {e}", "service_unavailable")
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
        return await anyio.to_thread.run_sync(score_reference, self.rewards, completion, reference, tokens)

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
            rewards=cfg.train.reward_set(),  # the same judge as training and the holdout, for `reference` feedback
            log_completions=serve_cfg.log_completions,
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
