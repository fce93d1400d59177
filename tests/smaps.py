"""Reading this process's memory mappings (/proc/self/smaps) in tests of where memory lies."""

from __future__ import annotations


def _find(address: int) -> tuple[int, int, dict[str, int]]:
    """(start, end, {field: first number}) of the mapping that holds `address`."""
    with open("/proc/self/smaps") as f:
        lines = f.read().splitlines()
    for i, line in enumerate(lines):
        head = line.split()[0]
        if "-" not in head or not all(c in "0123456789abcdef-" for c in head):
            continue
        lo, hi = (int(x, 16) for x in head.split("-"))
        if lo <= address < hi:
            fields = {}
            for ln in lines[i + 1:]:
                name, _, rest = ln.partition(":")
                if not rest or " " in name:      # the next mapping's header
                    break
                words = rest.split()
                if words and words[0].isdigit():
                    fields[name] = int(words[0])
            return lo, hi, fields
    raise AssertionError(f"no mapping holds {address:#x}")


def mapping_of(address: int) -> tuple[int, dict[str, int]]:
    """(size in bytes, {field: first number}) of the mapping that holds `address`, e.g.
    fields["Rss"] in kB, fields["THPeligible"] 0 or 1."""
    lo, hi, fields = _find(address)
    return hi - lo, fields


def mapping_start(address: int) -> int:
    """Where the mapping that holds `address` begins: two addresses share a mapping when
    their starts are equal."""
    return _find(address)[0]
