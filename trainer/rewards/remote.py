"""`remote_verifier`: scores from an HTTP service (a code sandbox, a judge model, a grader someone else runs).

The protocol, one POST per chunk of `batch_size` completions, JSON both ways:

    request:  {"completions": ["...", ...], "prompts": [...], "<column>": [...], ...}   (one entry per completion)
    reply:    {"scores": [0.0, 1.0, ...]}   (or the bare list), one number per completion, in order

Chunks go out `concurrency` at a time. A connection error, a timeout, HTTP 429 or a 5xx is retried
`retries` times with exponential backoff; any other 4xx, a reply that is not JSON, or one with the wrong
number of scores is not (the service would answer the same again). A chunk that still fails raises an
error naming the verifier, its URL and the rows: `RewardUnavailable` when the service could not be reached
or kept failing (an outage: the trainer exits 1 and the relaunch resumes), `RewardError` when it answered
and the answer is unusable (the same again on every attempt: exit 2). Or, when `fallback` is set, those
rows score `fallback` and are counted: `remote_verifier/fallbacks` in the step's metrics (TRL's
`log_metric`), and a warning in the log. Never a silent 0.

What it will not do, since the URL and the service are outside the run's control:
- speak anything but http(s) (a `file://` URL would read the node's files into the error message);
- follow a redirect (its headers, credentials included, would go to wherever the service points): a 3xx is
  a `RewardError` naming the new location, to be put in `url` if it is right;
- read more than `max_reply_bytes` of a reply (a reply is a few numbers per completion);
- wait longer than `timeout_s` for one request, from connecting to the reply's last byte, however slowly a
  server trickles it (a socket timeout alone restarts at every byte);
- take a credential in the config: `headers_from_env: {Authorization: VERIFIER_TOKEN}` reads the header's
  value (e.g. `Bearer ...`) from that environment variable when the reward runs; `headers` whose name or
  value looks like a credential, and a URL with a user or password, are refused with that fix.
"""

from __future__ import annotations

import http.client
import json
import logging
import math
import os
import re
import socket
import ssl
import threading
import time
import urllib.parse
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor

from grpo_pipeline.trainer.rewards.base import RewardError, RewardUnavailable, completion_text

log = logging.getLogger(__name__)
_NOT_SENT = {"trainer_state", "log_extra", "log_metric", "completion_ids", "environments"}
MAX_REPLY_BYTES = 4 << 20  # JSON scores for thousands of completions fit in a few hundred KiB
_CHUNK = 64 << 10
# header names and values that carry a credential: these go in the environment (`headers_from_env`)
_SECRET_NAME = re.compile(r"auth|token|secret|passw|api[-_]?key|cookie|session|signature|credential", re.I)
_SECRET_VALUE = re.compile(
    r"^\s*(bearer|basic|digest|token|negotiate)\s+\S|^eyJ[\w-]+\.[\w-]+|"
    r"^(sk-|hf_|ghp_|gho_|github_pat_|glpat-|xox[abp]-|AKIA)",
    re.I,
)
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_HEADER_NAME = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")  # RFC 9110 token


class _Retryable(Exception):
    pass


class _Failed(str):
    """A chunk's failure, and whether another attempt later could succeed (an outage, not a bad answer)."""

    transient = False


def _jsonable(value: object) -> bool:
    try:
        json.dumps(value)
        return True
    except (TypeError, ValueError):
        return False


def check_arguments(
    url: str,
    headers: Mapping[str, str] | None = None,
    headers_from_env: Mapping[str, str] | None = None,
    max_reply_bytes: int = MAX_REPLY_BYTES,
) -> None:
    """Refuse, before any request, what `remote_verifier` must not be given: a URL that is not http(s) or that
    holds a user or password, a header that carries a credential in the config, a malformed header or
    environment variable name. Each refusal names the argument, why, and the fix. Pure: reads no environment.

    >>> check_arguments("https://grader.internal/score", {"X-Task": "math"}, {"Authorization": "VERIFIER_TOKEN"})
    >>> check_arguments("file:///etc/passwd")
    Traceback (most recent call last):
    ...
    grpo_pipeline.trainer.rewards.base.RewardError: remote_verifier: url 'file:///etc/passwd' is not http:// or https://; the verifier is an HTTP service: give its http(s) URL
    >>> check_arguments("http://127.0.0.1:8000/score", {"Authorization": "Bearer abc"})
    Traceback (most recent call last):
    ...
    grpo_pipeline.trainer.rewards.base.RewardError: remote_verifier: headers.Authorization looks like a credential, which must not be in the config (it is logged with it); put its value in an environment variable and name it instead: headers_from_env: {Authorization: VERIFIER_TOKEN}
    """
    for given, what in ((headers, "headers"), (headers_from_env, "headers_from_env")):
        if given is not None and not isinstance(given, Mapping):
            raise RewardError(
                f"remote_verifier: {what} must be a mapping of header name to "
                f"{'value' if what == 'headers' else 'environment variable name'}, not {type(given).__name__}"
            )
    parts = urllib.parse.urlsplit(url) if isinstance(url, str) else None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
        raise RewardError(
            f"remote_verifier: url {url!r} is not http:// or https://; the verifier is an HTTP service: "
            "give its http(s) URL"
        )
    if parts.username is not None or parts.password is not None:
        raise RewardError(
            f"remote_verifier: url {parts.scheme}://...@{parts.hostname} holds a user or password, "
            "which must not be in the config; drop them from the url and send the credential as a "
            "header from the environment: headers_from_env: {Authorization: VERIFIER_TOKEN}"
        )
    try:
        parts.port  # noqa: B018 - parsing it raises on a bad port
    except ValueError as exc:
        raise RewardError(f"remote_verifier: url {url!r}: {exc}; give host:port with a port number") from None
    if isinstance(max_reply_bytes, bool) or not isinstance(max_reply_bytes, int) or max_reply_bytes < 1:
        raise RewardError(f"remote_verifier: max_reply_bytes must be a positive integer, not {max_reply_bytes!r}")
    for key, value in (headers or {}).items():
        if (
            not isinstance(key, str)
            or not _HEADER_NAME.match(key)
            or not isinstance(value, str)
            or any(c in value for c in "\r\n\0")
        ):
            raise RewardError(
                f"remote_verifier: headers.{key} is not a valid HTTP header (a token name, a one-line "
                "string value); fix the name or the value"
            )
        if _SECRET_NAME.search(key) or _SECRET_VALUE.search(value):
            raise RewardError(
                f"remote_verifier: headers.{key} looks like a credential, which must not be in the "
                "config (it is logged with it); put its value in an environment variable and name it "
                f"instead: headers_from_env: {{{key}: VERIFIER_TOKEN}}"
            )
    for key, env in (headers_from_env or {}).items():
        if not isinstance(key, str) or not _HEADER_NAME.match(key):
            raise RewardError(f"remote_verifier: headers_from_env has {key!r}, which is not an HTTP header name")
        if not isinstance(env, str) or not _ENV_NAME.match(env):
            raise RewardError(
                f"remote_verifier: headers_from_env.{key} must name an environment variable "
                f"(letters, digits, '_'), not {env!r}"
            )
        if key.lower() in {k.lower() for k in headers or {}}:
            raise RewardError(
                f"remote_verifier: header {key} is given both in headers and in headers_from_env; keep one"
            )


def _env_headers(headers_from_env: Mapping[str, str]) -> dict[str, str]:
    """Header values from the environment variables named; a missing or malformed one is named (never its value)."""
    out = {}
    for key, env in headers_from_env.items():
        value = os.environ.get(env)
        if not value:
            raise RewardError(
                f"remote_verifier: headers_from_env.{key} names the environment variable {env}, which "
                "is not set (or empty) here; set it where the trainer runs (the launcher's secrets)"
            )
        if any(c in value for c in "\r\n\0"):
            raise RewardError(
                f"remote_verifier: the environment variable {env} (headers_from_env.{key}) holds a "
                "line break; set it to a one-line header value"
            )
        out[key] = value
    return out


def _connection(url: str, timeout_s: float) -> tuple[http.client.HTTPConnection, str]:
    parts = urllib.parse.urlsplit(url)
    if not parts.hostname:
        raise RewardError(f"remote_verifier: {url!r} names no host; use http(s)://host[:port]/path")
    conn: http.client.HTTPConnection
    if parts.scheme == "https":
        conn = http.client.HTTPSConnection(
            parts.hostname, parts.port, timeout=timeout_s, context=ssl.create_default_context()
        )
    else:
        conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout_s)
    return conn, (parts.path or "/") + (f"?{parts.query}" if parts.query else "")


def _read_capped(reply: http.client.HTTPResponse, limit: int) -> bytes:
    """The reply's body, refused past `limit` bytes without reading (or holding) more than that."""
    length = reply.getheader("Content-Length")
    if length and length.isdigit() and int(length) > limit:
        raise RewardError(
            f"the reply is {int(length):,} bytes, over max_reply_bytes={limit:,}; raise "
            "max_reply_bytes if the service really answers that much"
        )
    chunks, size = [], 0
    while chunk := reply.read(min(_CHUNK, limit + 1 - size)):
        chunks.append(chunk)
        size += len(chunk)
        if size > limit:
            raise RewardError(
                f"the reply is over max_reply_bytes={limit:,} bytes; raise max_reply_bytes if the "
                "service really answers that much"
            )
    return b"".join(chunks)


def _post(url: str, body: bytes, timeout_s: float, headers: dict[str, str], max_reply_bytes: int) -> object:
    """One POST, done within `timeout_s` from connecting to the reply's last byte, or `_Retryable`.

    The deadline is a timer that shuts the socket down: a socket timeout applies to each read, and a server
    sending a byte now and then would reset it for ever. Redirects are never followed (http.client does not)."""
    conn, path = _connection(url, timeout_s)
    expired = threading.Event()
    connected: list[socket.socket] = []  # held here: http.client drops conn.sock once an HTTP/1.0 reply starts

    def cut() -> None:
        expired.set()
        for sock in connected:
            try:
                sock.shutdown(socket.SHUT_RDWR)  # wakes the blocked read in the requesting thread
            except OSError:
                pass

    timer = threading.Timer(timeout_s, cut)
    timer.daemon = True
    timer.start()
    try:
        conn.connect()  # bounded by timeout_s itself
        connected.append(conn.sock)
        if expired.is_set():  # the timer fired while connecting, before there was a socket to cut
            raise TimeoutError
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json", **headers})
        reply = conn.getresponse()
        if 300 <= reply.status < 400:
            where = reply.getheader("Location") or "(no Location)"
            raise RewardError(
                f"HTTP {reply.status} {reply.reason}: a redirect to {where}, which is not followed (the "
                "request's headers would go with it); set url to the verifier's own address"
            )
        if reply.status == 429 or reply.status >= 500:
            raise _Retryable(f"HTTP {reply.status} {reply.reason}")
        if reply.status >= 400:
            raise RewardError(f"HTTP {reply.status} {reply.reason}")
        raw = _read_capped(reply, max_reply_bytes)
    except (OSError, http.client.HTTPException) as exc:
        if expired.is_set() or isinstance(exc, TimeoutError):
            raise _Retryable(f"no reply within {timeout_s:g} s") from None
        raise _Retryable(f"{type(exc).__name__}: {exc}") from None
    finally:
        timer.cancel()
        conn.close()
    if expired.is_set():  # the last read beat the timer by a hair: still too late
        raise _Retryable(f"no reply within {timeout_s:g} s")
    try:
        return json.loads(raw)
    except ValueError:
        raise RewardError(f"the reply is not JSON: {raw[:120]!r}") from None


def _scores(reply: object, n: int) -> list[float]:
    scores = reply.get("scores") if isinstance(reply, dict) else reply
    if not isinstance(scores, list):
        raise RewardError(f"the reply has no list of scores: {str(reply)[:120]}")
    if len(scores) != n:
        raise RewardError(f"the reply has {len(scores)} scores for {n} completions")
    out = []
    for s in scores:
        if isinstance(s, bool) or not isinstance(s, int | float) or not math.isfinite(s):
            raise RewardError(f"the reply holds {s!r}, not a finite number")
        out.append(float(s))
    return out


def remote_verifier(
    completions: list,
    prompts: list | None = None,
    *,
    url: str,
    timeout_s: float = 30.0,
    concurrency: int = 8,
    batch_size: int = 1,
    retries: int = 2,
    backoff_s: float = 0.5,
    fallback: float | None = None,
    headers: dict[str, str] | None = None,
    headers_from_env: dict[str, str] | None = None,
    max_reply_bytes: int = MAX_REPLY_BYTES,
    log_metric: Callable[[str, float], None] | None = None,
    **columns: object,
) -> list[float]:
    """Scores from an HTTP verifier: POST of completions + columns to `url`, with a deadline per request, bounded
    concurrency, retries. `timeout_s` bounds each request whole; `headers_from_env` maps a header to the
    environment variable holding its value (a credential); `max_reply_bytes` caps a reply.

    >>> remote_verifier([], url="http://127.0.0.1:9/never-called")
    []
    """
    if concurrency < 1 or batch_size < 1 or retries < 0 or timeout_s <= 0:
        raise RewardError("remote_verifier: concurrency and batch_size must be >= 1, retries >= 0, timeout_s > 0")
    check_arguments(url, headers, headers_from_env, max_reply_bytes)
    n = len(completions)
    if not n:
        return []
    sent_headers = {**(headers or {}), **_env_headers(headers_from_env or {})}
    sent = {
        k: v for k, v in columns.items() if k not in _NOT_SENT and isinstance(v, list) and len(v) == n and _jsonable(v)
    }
    if prompts is not None and _jsonable(prompts):
        sent["prompts"] = prompts
    texts = [completion_text(c) for c in completions]
    chunks = [(start, min(start + batch_size, n)) for start in range(0, n, batch_size)]

    def score_chunk(bounds: tuple[int, int]) -> list[float] | _Failed:
        lo, hi = bounds
        body = json.dumps({"completions": texts[lo:hi], **{k: v[lo:hi] for k, v in sent.items()}}).encode()
        for attempt in range(retries + 1):
            try:
                return _scores(_post(url, body, timeout_s, sent_headers, max_reply_bytes), hi - lo)
            except _Retryable as exc:
                problem = f"{exc} (after {attempt + 1} attempt{'s' if attempt else ''})"
                if attempt < retries:
                    time.sleep(backoff_s * 2**attempt)
            except RewardError as exc:
                return _Failed(exc)
        outage = _Failed(problem)
        outage.transient = True
        return outage

    with ThreadPoolExecutor(max_workers=min(concurrency, len(chunks))) as pool:
        results = list(pool.map(score_chunk, chunks))
    scores: list[float] = []
    failed: list[tuple[int, int, _Failed]] = []
    for (lo, hi), result in zip(chunks, results, strict=True):
        if isinstance(result, _Failed):
            failed.append((lo, hi, result))
            if fallback is None:
                continue
            result = [float(fallback)] * (hi - lo)
        scores += result
    if failed and fallback is None:
        # a bad answer anywhere repeats on every attempt; only when every failure is an outage may a later
        # attempt succeed
        lasting = [f for f in failed if not f[2].transient]
        lo, hi, problem = (lasting or failed)[0]
        rows = f"row {lo}" if hi - lo == 1 else f"rows {lo}-{hi - 1}"
        raise (RewardError if lasting else RewardUnavailable)(
            f"reward 'remote_verifier' at {url} failed for {rows} of {n}"
            f"{f' (and {len(failed) - 1} more chunks)' if len(failed) > 1 else ''}: {problem}"
        )
    fell_back = sum(hi - lo for lo, hi, _ in failed)
    if log_metric is not None:
        log_metric("remote_verifier/fallbacks", float(fell_back))
    if fell_back:
        log.warning(
            "remote_verifier at %s: %d of %d completions scored with the fallback %s: %s",
            url,
            fell_back,
            n,
            fallback,
            failed[0][2],
        )
    return scores
