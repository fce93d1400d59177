"""A memory probe for pdserve processes (bench/prefill_rss.py puts this folder on a node's
PYTHONPATH): when PDSERVE_MEMPROBE names a folder, a daemon thread writes, every
PDSERVE_MEMPROBE_S seconds (default 20), the process's RSS, glibc's heap statistics
(mallinfo2: arena bytes, in-use bytes, free bytes held), the count of live Python
objects by type (top 25), and with PYTHONTRACEMALLOC set the tracemalloc lines that grew
most since the PDSERVE_MEMPROBE_BASE-th report (default 3), and glibc's malloc_info XML
(free chunks per arena and size) to <folder>/<pid>.malloc.xml; the rest to
<folder>/<pid>.txt. PDSERVE_MEMPROBE_TRIM=1 calls malloc_trim(0) before each report.
Not used in production."""

import os

if os.environ.get("PDSERVE_MEMPROBE"):
    import ctypes
    import gc
    import threading
    import time
    import tracemalloc
    from collections import Counter

    class _Mallinfo2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
            "uordblks", "fordblks", "keepcost")]

    def _mallinfo() -> str:
        try:
            libc = ctypes.CDLL("libc.so.6")
            libc.mallinfo2.restype = _Mallinfo2
            m = libc.mallinfo2()
        except (OSError, AttributeError):
            return "mallinfo2: unavailable"
        mb = 1 / (1 << 20)
        return (f"malloc: arena {m.arena * mb:.1f} MB, mmapped {m.hblkhd * mb:.1f} MB "
                f"({m.hblks} chunks), in use {m.uordblks * mb:.1f} MB, free held "
                f"{m.fordblks * mb:.1f} MB, top pad {m.keepcost * mb:.1f} MB")

    def _malloc_info(path: str) -> None:
        """glibc's per-arena XML (free chunk sizes by bin, per arena) into `path`."""
        try:
            libc = ctypes.CDLL("libc.so.6")
            libc.fopen.restype = ctypes.c_void_p
            f = libc.fopen(path.encode(), b"w")
            libc.malloc_info(0, ctypes.c_void_p(f))
            libc.fclose(ctypes.c_void_p(f))
        except (OSError, AttributeError):
            pass

    def _rss() -> str:
        with open("/proc/self/status") as f:
            return " ".join(line.split(":")[1].strip() for line in f
                            if line.startswith(("VmRSS", "RssAnon")))

    def _probe(folder: str, every: float) -> None:
        path = os.path.join(folder, f"{os.getpid()}.txt")
        first, reports = None, 0
        while True:
            time.sleep(every)
            counts = Counter(type(o).__name__ for o in gc.get_objects())
            if os.environ.get("PDSERVE_MEMPROBE_TRIM"):     # the experiment: give back
                ctypes.CDLL("libc.so.6").malloc_trim(0)      # free pages every report
            _malloc_info(os.path.join(folder, f"{os.getpid()}.malloc.xml"))
            threads = len(os.listdir("/proc/self/task"))
            lines = [f"=== t={time.monotonic():.0f} RSS/anon {_rss()} threads {threads}",
                     _mallinfo(),
                     f"gc objects {sum(counts.values())}: "
                     + ", ".join(f"{k} {v}" for k, v in counts.most_common(25))]
            if tracemalloc.is_tracing():
                snap = tracemalloc.take_snapshot()
                reports += 1
                if reports == int(os.environ.get("PDSERVE_MEMPROBE_BASE", "3")):
                    first = snap        # the baseline: after the warm-up
                lines.append(f"traced {tracemalloc.get_traced_memory()[0] / 1e6:.1f} MB")
                if first is not None:
                    lines += [f"  {stat}" for stat in snap.compare_to(first, "lineno")[:15]]
            with open(path, "a") as f:
                f.write("\n".join(lines) + "\n")

    threading.Thread(target=_probe, args=(os.environ["PDSERVE_MEMPROBE"],
                                          float(os.environ.get("PDSERVE_MEMPROBE_S", "20"))),
                     daemon=True, name="memprobe").start()
