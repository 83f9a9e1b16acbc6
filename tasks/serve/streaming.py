"""A streamed answer (`stream: true`) on its way from the engine to the client: each server-sent event read
(`Relay.feed`: the text and usage kept for the log, the chunk as the client sees it), the end however it comes
(`relay_events`: the row committed before `[DONE]`), and a response that closes the engine's stream and writes the
row even when the client leaves mid-stream (`LoggedStream`).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable

import anyio
import httpx
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

DONE = b"data: [DONE]\n\n"


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


class LoggedStream(StreamingResponse):
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


def ask_for_usage(body: dict) -> bool:
    """Ask the engine for the stream's usage (the token counts of the log), whatever the client asked; returns
    whether the client asked for it itself.

    >>> body = {"stream_options": {"include_usage": False}}
    >>> ask_for_usage(body), body
    (False, {'stream_options': {'include_usage': True}})
    """
    options = body.get("stream_options") or {}
    body["stream_options"] = {**options, "include_usage": True}
    return bool(options.get("include_usage"))


class Relay:
    """One streamed answer as it passes: each line of the engine's stream in, the event the client gets out; the
    text of each choice, the usage and how the stream ended kept for the log.

    >>> relay = Relay("completions", "grpo-9", "champion-v1", client_wants_usage=False)
    >>> relay.feed('data: {"id": "cmpl-1", "choices": [{"index": 0, "text": "4"}]}')
    b'data: {"id": "grpo-9", "choices": [{"index": 0, "text": "4"}], "model": "champion-v1"}\\n\\n'
    >>> relay.feed("data: [DONE]"), relay.stopped, relay.completion()
    (None, True, '4')
    """

    def __init__(self, kind: str, request_id: str, model: str, client_wants_usage: bool):
        self.kind, self.request_id, self.model, self.client_wants_usage = kind, request_id, model, client_wants_usage
        self.texts: dict[int, list[str]] = {}
        self.usage: dict = {}
        self.chunks_with_text = 0
        self.done = False  # the engine sent [DONE]
        self.stopped = False  # nothing more to read: [DONE], or an event that is not a JSON object
        self.failure: str | None = None

    def feed(self, line: str) -> bytes | None:
        """The event the client gets for one line of the engine's stream; None: nothing to send."""
        if not line.startswith("data:"):
            return None  # blank separators, comments
        data = line[len("data:") :].strip()
        if data == "[DONE]":
            self.done = self.stopped = True
            return None
        try:
            chunk = json.loads(data)
        except ValueError:
            chunk = None
        if not isinstance(chunk, dict):
            self.failure = f"the engine streamed something other than a JSON object: {data[:200]}"
            self.stopped = True
            return None
        if "error" in chunk:  # vLLM reports a failure mid-stream as an event, then [DONE]
            self.failure = f"the engine failed mid-stream: {json.dumps(chunk['error'])[:300]}"
        if isinstance(chunk.get("usage"), dict):
            self.usage = chunk["usage"]
        for index, text in chunk_text(self.kind, chunk).items():
            self.texts.setdefault(index, []).append(text)
            self.chunks_with_text += 1
        out = relay_chunk(chunk, self.request_id, self.model, self.client_wants_usage)
        return None if out is None else f"data: {json.dumps(out)}\n\n".encode()

    def broke(self, error: httpx.HTTPError) -> None:
        self.failure = f"the engine's stream broke ({type(error).__name__}: {error})"

    def end(self) -> None:
        """The stream is over: one that stopped without [DONE] and without a failure was cut short."""
        if not self.done and self.failure is None:
            self.failure = "the engine's stream ended without [DONE]"

    def completion(self) -> str:
        """The first choice's text: what `reference` feedback is scored on."""
        return "".join(self.texts.get(0, []))

    def closing(self) -> list[bytes]:
        """The client's last events: the failure, if any, as an error event, then [DONE]."""
        if self.failure is None:
            return [DONE]
        error = {"message": self.failure, "type": "engine_error", "code": 502}
        return [f"data: {json.dumps({'id': self.request_id, 'error': error})}\n\n".encode(), DONE]


async def relay_events(
    upstream: httpx.Response, relay: Relay, commit: Callable[[bool], Awaitable[None]]
) -> AsyncIterator[bytes]:
    """The client's events of the engine's stream; when it ends (however), `commit(error)` writes the row before
    the client's [DONE]."""
    try:
        async for line in upstream.aiter_lines():
            out = relay.feed(line)
            if out is not None:
                yield out
            if relay.stopped:
                break
    except httpx.HTTPError as e:
        relay.broke(e)
    relay.end()
    await commit(relay.failure is not None)  # in the log before the client's [DONE]
    for event in relay.closing():
        yield event
