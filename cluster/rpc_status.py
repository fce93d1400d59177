"""Structured error details between pdserve processes: which side failed, and whether the
caller should replay the request elsewhere. They ride in gRPC trailing metadata, so a
caller never has to guess from the text of a message.

- `pdserve-failed-side`: `prefill` or `decode`, the node whose fault (or refusal) ended
  the call. A Prefill call that fails because the decode node refused the push says
  `decode`, so the router blames (and avoids) the right node.
- `pdserve-retry`: `replay` when the node is fine but will not finish this request
  (draining, a reservation released before its push began, a lease that ran out): the
  caller should run it on another pair, without marking the node as failed.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc

FAILED_SIDE_KEY = "pdserve-failed-side"
RETRY_KEY = "pdserve-retry"
PREFILL, DECODE = "prefill", "decode"
REPLAY = "replay"


@dataclass(frozen=True)
class RpcFailure:
    code: grpc.StatusCode
    message: str
    side: str                       # PREFILL or DECODE
    replay: bool = False

    def metadata(self) -> tuple[tuple[str, str], ...]:
        md = ((FAILED_SIDE_KEY, self.side),)
        return md + ((RETRY_KEY, REPLAY),) if self.replay else md

    async def abort(self, context) -> None:
        """End the servicer call with this failure (raises, as context.abort does)."""
        await context.abort(self.code, self.message, trailing_metadata=self.metadata())


def failure_of(exc: grpc.aio.AioRpcError, default_side: str) -> RpcFailure:
    """Read the structured details of a failed call (a peer that sent none: the side the
    caller called, no replay)."""
    md = {}
    try:
        md = {k: v for k, v in (exc.trailing_metadata() or ())}
    except Exception:  # noqa: BLE001 - a call that never got trailers has none
        md = {}
    side = md.get(FAILED_SIDE_KEY, default_side)
    if side not in (PREFILL, DECODE):
        side = default_side
    return RpcFailure(exc.code(), exc.details() or exc.code().name, side,
                      md.get(RETRY_KEY) == REPLAY)
