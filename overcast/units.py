"""Sizes as people write and read them: '64KiB' to bytes, and bytes to '64.0 KiB'; counts as
'3.44M'. Shared by every command and report."""

from __future__ import annotations

SIZE_UNITS = {
    "": 1,
    "B": 1,
    "KIB": 1 << 10,
    "MIB": 1 << 20,
    "GIB": 1 << 30,
    "KB": 1000,
    "MB": 10**6,
    "GB": 10**9,
    "K": 1 << 10,
    "M": 1 << 20,
    "G": 1 << 30,
}


def parse_size(text: str) -> int:
    """'64KiB', '1MiB', '4MB', '1000' -> bytes (K, M and G alone are binary: 64k is 65,536)."""
    s = text.strip()
    i = len(s)
    while i and not s[i - 1].isdigit():
        i -= 1
    number, unit = s[:i], s[i:].strip().upper()
    if not number or unit not in SIZE_UNITS:
        raise ValueError(f"cannot read size {text!r}; write e.g. 64KiB, 1MiB, 4MiB or 1000")
    return int(float(number) * SIZE_UNITS[unit])


def human_bytes(n: float) -> str:
    """Bytes in the largest binary unit that keeps the number at least 1."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def human_count(n: float) -> str:
    """A count as `overcast plan --params` takes it: 3.44M, 7B, 125K, 512."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale * 0.9995:  # what .3g would round up to 1000 takes the next unit
            return f"{n / scale:.3g}{unit}"
    return f"{n:.0f}"
