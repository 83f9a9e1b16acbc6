"""The router's contract with its clients, as pure functions: which arm a user gets (`assignment_hash`, `arm_for`,
`assignment_key`), what a request body and an API key must be (`validate_generation`, `validate_feedback`,
`authorized`, `api_key_policy`), what a whole answer holds (`answer_text`, `usage_tokens`), how a reference is scored
(`score_reference`), and the error bodies (`error_response`, `passed_on`). `router` applies them.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import httpx
from starlette.responses import JSONResponse

if TYPE_CHECKING:
    from grpo_pipeline.configs.rewards import RewardSet

CHAMPION, CHALLENGER = "champion", "challenger"
KEY_HEADER = "x-assignment-key"
ARM_HEADER, VERSION_HEADER = "X-GRPO-Arm", "X-GRPO-Version"
API_KEY_ENV = "GRPO_SERVE_API_KEY"
MAX_ID = 64  # the log's id column
MAX_REFERENCE = 100_000  # characters of a feedback reference


class BadRequest(ValueError):
    """A request body the router refuses (HTTP 400), with the reason."""


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


def error_response(
    status: int,
    message: str,
    kind: str = "invalid_request_error",
    headers: Mapping[str, str] | None = None,
    **extra: Any,
) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}, **extra}, status, headers=headers)


def passed_on(status: int, raw: bytes, headers: Mapping[str, str]) -> JSONResponse:
    """The engine's own 400/422 (the client's input), passed on as it said it."""
    try:
        return JSONResponse(json.loads(raw), status, headers=headers)
    except ValueError:
        return error_response(status, raw[:500].decode(errors="replace"), headers=headers)


def engine_answer(answer: httpx.Response) -> tuple[dict[str, Any] | None, str | None]:
    """(the completion, None) of the engine's whole answer, or (None, why it is not one): a status other than 200,
    or a body that is not a JSON object."""
    if answer.status_code != 200:
        return None, f"the engine answered HTTP {answer.status_code}: {answer.text[:300]}"
    try:
        payload = answer.json()
    except ValueError:
        payload = None
    if not isinstance(payload, dict):  # a completion is a JSON object: anything else is the arm failing
        return None, f"the engine answered HTTP 200 without a JSON object: {answer.text[:300]}"
    return payload, None
