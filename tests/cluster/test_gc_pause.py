"""freeze_startup_objects: what is alive at start leaves the collector's generations (so
full passes skip it); what is allocated afterwards is still collected."""

from __future__ import annotations

import gc
import weakref

from cluster.gc_pause import freeze_startup_objects


class _Cycle:
    def __init__(self):
        self.me = self


def test_objects_alive_at_start_are_frozen_and_later_garbage_still_collected():
    before = [object(), {}]            # containers alive "at start"
    try:
        frozen = freeze_startup_objects()
        assert frozen >= gc.get_freeze_count() > 0
        tracked = {id(o) for o in gc.get_objects()}
        assert id(before) not in tracked and id(before[1]) not in tracked
        later = _Cycle()
        assert id(later) in {id(o) for o in gc.get_objects()}
        alive = weakref.ref(later)
        del later
        gc.collect()
        assert alive() is None, "a cycle made after start was not collected"
    finally:
        gc.unfreeze()
