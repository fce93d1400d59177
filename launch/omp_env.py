"""OpenMP's spin-wait for node processes, set before torch loads.

torch's CPU build runs its intra-op threads on GNU OpenMP (libgomp). At the end of every
parallel region an idle thread spins for GOMP_SPINCOUNT iterations (300,000 by default)
before it sleeps. Alone on its cores that is what makes small matmuls fast; but a PD pair on
one machine (`pdserve up`: a prefill node and a decode node, each with a thread per core)
puts two spinning teams on the same cores, and each team's spinners then steal the time
slices the other team's working threads need. Measured on 2 cores, bf16 prepacked matmuls,
a decode-sized (16 x 576 x 3072) loop in one process beside a prefill-sized (512 rows) loop
in another, GFLOP/s decode + prefill:

    default spin (300,000)      7 + 117   (the decode loop nearly stops)
    GOMP_SPINCOUNT=3000       127 + 206
    GOMP_SPINCOUNT=1000       161 + 212
    one thread each           196 + 208
    OMP_WAIT_POLICY=PASSIVE   190 + 213, but alone: 16 rows 365 -> 229, 1 row 65 -> 26

Alone, 3,000 spins keep the default's speed (1 row 70, 16 rows 366 GFLOP/s; SmolLM2 bf16
offline uniform 456/489 tok/s against 445/492 default, 1,000: 420/460), so every node
process takes it unless the user set GOMP_SPINCOUNT or OMP_WAIT_POLICY. libgomp reads the
variables when it loads, i.e. at `import torch`: this must run before that.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import MutableMapping

NODE_SPINCOUNT = "3000"
_USER_KNOBS = ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")

log = logging.getLogger(__name__)


def apply_node_spin_default(environ: MutableMapping[str, str] | None = None) -> bool:
    """Set GOMP_SPINCOUNT for this process unless the user chose a wait policy. Returns
    whether it was set; False too (with a warning) when torch is already loaded, since
    libgomp would not see it."""
    env = os.environ if environ is None else environ
    if any(k in env for k in _USER_KNOBS):
        return False
    if "torch" in sys.modules:
        log.warning("torch was loaded before the OpenMP spin default could be set; nodes "
                    "sharing cores may slow each other (set GOMP_SPINCOUNT=%s)",
                    NODE_SPINCOUNT)
        return False
    env["GOMP_SPINCOUNT"] = NODE_SPINCOUNT
    return True
