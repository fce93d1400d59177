"""The engine loop of a node: a dedicated thread that steps the engine while it has work.

The asyncio gRPC servers never run the model themselves: they add/abort requests under
`lock` (the same lock the loop holds around each step) and `wake()` the loop. After each
step `on_step(grew)` runs on the loop thread (still under the lock), where the node turns
new tokens into stream events.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

log = logging.getLogger("cluster.engine_loop")


class EngineLoop:
    def __init__(self, engine, lock: threading.RLock | None = None,
                 on_step: Callable[[list], None] | None = None,
                 after_step: Callable[[], None] | None = None, name: str = "engine"):
        self.engine = engine
        self.lock = lock or threading.RLock()
        self.on_step = on_step
        self.after_step = after_step
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"{name}-loop", daemon=True)
        self.error: BaseException | None = None

    def start(self) -> EngineLoop:
        self._thread.start()
        return self

    def wake(self) -> None:
        self._wake.set()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        while not self._stop.is_set():
            with self.lock:
                busy = self.engine.has_unfinished()
                if busy:
                    try:
                        grew = self.engine.step()
                    except Exception as exc:  # noqa: BLE001 - report, keep the node up
                        log.exception("engine step failed; aborting the batch")
                        self.error = exc
                        self._abort_all(exc)
                        grew = []
                    if self.on_step is not None:
                        self.on_step(grew)
                if self.after_step is not None:
                    self.after_step()
            if not busy:
                self._wake.wait(0.05)
                self._wake.clear()

    def _abort_all(self, exc: BaseException) -> None:
        for request_id in list(self.engine.requests):
            self.engine.abort(request_id)
