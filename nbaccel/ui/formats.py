"""Numbers as people read them: durations, SI suffixes, bytes. Shared by every view and chart."""

from __future__ import annotations


def format_seconds(seconds: float | None) -> str:
    """``12.3 s``, ``4:05``, ``1:02:03``; ``-`` for unknown."""
    if seconds is None:
        return "-"
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def format_si(value: float, digits: int = 3) -> str:
    """A number with an SI suffix: ``1840`` -> ``1.84k``; whole numbers below 1000 as integers.

    >>> format_si(1840), format_si(52), format_si(0.000531), format_si(2.5e6), format_si(0.25)
    ('1.84k', '52', '531µ', '2.5M', '0.25')
    """
    if value != value or value in (float("inf"), float("-inf")):
        return str(value)
    magnitude = abs(value)
    for factor, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if magnitude >= factor:
            return f"{value / factor:.{digits}g}{suffix}"
    for factor, suffix in ((1e-3, "m"), (1e-6, "µ"), (1e-9, "n")):
        if factor <= magnitude < min(factor * 1000, 1e-2):
            return f"{value / factor:.{digits}g}{suffix}"
    if float(value).is_integer():
        return str(int(value))
    return f"{value:.{digits}g}"


def format_bytes(n: int | None) -> str:
    """``1.2 GiB``, ``350 MiB``; ``-`` for unknown."""
    if n is None:
        return "-"
    if n >= 1 << 30:
        return f"{n / (1 << 30):.1f} GiB"
    return f"{n / (1 << 20):.0f} MiB"
