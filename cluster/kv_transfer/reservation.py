"""The decode side's reservation: its states and the transitions allowed between them,
why it was released, the errors a push can meet, and the record itself
(cluster/kv_transfer/kv_receiver.py's KvReceiver drives it; docs/ARCHITECTURE.md has the
state machine). The sequence it holds is the engine's, WAITING_FOR_KV in its scheduler."""

from __future__ import annotations

import enum
import threading
from dataclasses import dataclass, field

from engine.commands import CapacityError
from engine.sequence import Sequence


class ReservationState(enum.Enum):
    RESERVED = "reserved"        # blocks held, no KV yet
    RECEIVING = "receiving"      # the push has started writing
    ADMITTED = "admitted"        # in the running batch; the blocks belong to the sequence
    RELEASED = "released"        # blocks returned; `release_reason` says why


class ReleaseReason(enum.Enum):
    CALLER_CANCELLED = "caller cancelled"
    PREFILL_FAILED = "prefill failed"
    PUSH_REFUSED = "push refused"
    LEASE_EXPIRED = "lease expired"
    DRAINING = "node draining"


ALLOWED = {
    ReservationState.RESERVED: {ReservationState.RECEIVING, ReservationState.ADMITTED,
                                ReservationState.RELEASED},
    ReservationState.RECEIVING: {ReservationState.ADMITTED, ReservationState.RELEASED},
    ReservationState.ADMITTED: set(),
    ReservationState.RELEASED: set(),
}


class UnknownReservation(KeyError):
    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "unknown reservation"


class Draining(CapacityError):
    """The node is draining: it takes no new reservation (UNAVAILABLE; go elsewhere)."""


class PushRejected(ValueError):
    """A KV chunk or completion that does not fit the reservation; nothing was written."""


class PushDenied(PermissionError):
    """The caller does not hold the reservation's token (or names another request):
    PERMISSION_DENIED. The reservation is untouched."""


@dataclass
class Reservation:
    reservation_id: str
    request_id: str
    seq: Sequence
    num_cached_blocks: int
    deadline: float                       # time.monotonic()
    state: ReservationState = ReservationState.RESERVED
    release_reason: ReleaseReason | None = None
    detail: str = ""                      # what the releaser said
    pending: dict[tuple[int, int], set[int]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    bytes_received: int = 0
    chunks_received: int = 0
    token: bytes = field(default=b"", repr=False)     # the push secret; never logged
    lease_s: float = 0.0                  # the lease granted (after the cap)

    @property
    def block_ids(self) -> list[int]:
        return list(self.seq.block_table)

    @property
    def push_block_ids(self) -> list[int]:
        return self.seq.block_table[self.num_cached_blocks:]

    @property
    def open(self) -> bool:
        return self.state in (ReservationState.RESERVED, ReservationState.RECEIVING)

    def missing(self) -> str:
        left = {k: v for k, v in self.pending.items() if v}
        parts = [f"layer {layer} {'KV'[kind]} blocks {sorted(ids)}"
                 for (layer, kind), ids in sorted(left.items())[:4]]
        more = f" and {len(left) - 4} more" if len(left) > 4 else ""
        return ", ".join(parts) + more
