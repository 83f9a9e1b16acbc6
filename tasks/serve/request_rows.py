"""What the router logs of each request before its client has the answer: the row (`RequestRows.row`), written to
the A/B log store, else to the local spool and never dropped (`RequestRows.write`); and a streamed request's row,
written once however its stream ends (`StreamRow`).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from pathlib import Path
from typing import Any

import anyio

from grpo_pipeline.tasks.serve import ab_spool
from grpo_pipeline.tasks.serve.ab_log import LogStoreError, RequestLog, RequestRow
from grpo_pipeline.tasks.serve.adapters import Adapter
from grpo_pipeline.tasks.serve.api import usage_tokens
from grpo_pipeline.tasks.serve.streaming import Relay

log = logging.getLogger("grpo_pipeline.serve")


class RequestRows:
    """The request log as the router writes it: the store, and the spool while the store fails."""

    def __init__(self, request_log: RequestLog, spool: Path, log_completions: bool = True):
        self.log, self.spool, self.log_completions = request_log, spool, log_completions
        self.unlogged = 0  # rows this process spooled because the store failed

    def row(
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

    def write(self, row: RequestRow) -> None:
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


class StreamRow:
    """A streamed request's row, written once: when its stream ends, fails, or its client leaves, whichever comes
    first; never for the client's own bad input (`skip`). The request counts as in flight on its adapter (what an
    alias move drains) from here until then."""

    def __init__(
        self,
        rows: RequestRows,
        inflight: Counter[str],
        request_id: str,
        adapter: Adapter,
        hashed: str | None,
        relay: Relay,
    ):
        self.rows, self.inflight, self.relay = rows, inflight, relay
        self.request_id, self.adapter, self.hashed = request_id, adapter, hashed
        self.inflight[adapter.engine_name] += 1
        self.started = time.perf_counter()
        self.logged = False

    def skip(self) -> None:
        """The engine refused the client's input: not the arm's request, not logged."""
        self.logged = True
        self.inflight[self.adapter.engine_name] -= 1

    async def __call__(self, error: bool) -> None:
        """Write the row, the first time only (whichever of the end, a failure or a disconnect comes first)."""
        if self.logged:
            return
        self.logged = True
        self.inflight[self.adapter.engine_name] -= 1
        relay = self.relay
        counts = {} if relay.usage else {"completion_tokens": relay.chunks_with_text}  # a cut stream has no usage
        row = self.rows.row(
            self.request_id,
            self.adapter,
            self.hashed,
            time.perf_counter() - self.started,
            relay.usage,
            error=error,
            completion=relay.completion() if not error else None,
            **counts,
        )
        await anyio.to_thread.run_sync(self.rows.write, row)
