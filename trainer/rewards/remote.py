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
"""

from __future__ import annotations

import json
import logging
import math
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from trainer.rewards.base import RewardError, RewardUnavailable, completion_text

log = logging.getLogger(__name__)
_NOT_SENT = {"trainer_state", "log_extra", "log_metric", "completion_ids", "environments"}


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


def _post(url: str, body: bytes, timeout_s: float, headers: dict[str, str]) -> object:
    request = urllib.request.Request(url, data=body, method="POST",
                                     headers={"Content-Type": "application/json", **headers})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as reply:
            raw = reply.read()
    except urllib.error.HTTPError as exc:
        if exc.code == 429 or exc.code >= 500:
            raise _Retryable(f"HTTP {exc.code} {exc.reason}") from None
        raise RewardError(f"HTTP {exc.code} {exc.reason}") from None
    except (TimeoutError, ConnectionError, urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise _Retryable(f"no reply within {timeout_s:g} s" if isinstance(reason, TimeoutError)
                         else f"{type(reason).__name__}: {reason}") from None
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
    log_metric=None,
    **columns: object,
) -> list[float]:
    """Scores from an HTTP verifier: POST of completions + columns to `url`, with timeout, bounded concurrency, retries.

    >>> remote_verifier([], url="http://127.0.0.1:9/never-called")
    []
    """
    if concurrency < 1 or batch_size < 1 or retries < 0 or timeout_s <= 0:
        raise RewardError("remote_verifier: concurrency and batch_size must be >= 1, retries >= 0, timeout_s > 0")
    n = len(completions)
    if not n:
        return []
    sent = {k: v for k, v in columns.items()
            if k not in _NOT_SENT and isinstance(v, list) and len(v) == n and _jsonable(v)}
    if prompts is not None and _jsonable(prompts):
        sent["prompts"] = prompts
    texts = [completion_text(c) for c in completions]
    chunks = [(start, min(start + batch_size, n)) for start in range(0, n, batch_size)]

    def score_chunk(bounds: tuple[int, int]) -> list[float] | _Failed:
        lo, hi = bounds
        body = json.dumps({"completions": texts[lo:hi], **{k: v[lo:hi] for k, v in sent.items()}}).encode()
        for attempt in range(retries + 1):
            try:
                return _scores(_post(url, body, timeout_s, headers or {}), hi - lo)
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
    failed: list[tuple[int, int, str]] = []
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
            f"{f' (and {len(failed) - 1} more chunks)' if len(failed) > 1 else ''}: {problem}")
    fell_back = sum(hi - lo for lo, hi, _ in failed)
    if log_metric is not None:
        log_metric("remote_verifier/fallbacks", float(fell_back))
    if fell_back:
        log.warning("remote_verifier at %s: %d of %d completions scored with the fallback %s: %s",
                    url, fell_back, n, fallback, failed[0][2])
    return scores
