"""The backends' output limit (they import it, not the package, which imports them by name)."""

from __future__ import annotations


def cap_output(text: str | None, limit: int) -> tuple[str, bool]:
    """`text` cut to `limit` UTF-8 bytes (never ending on half a character), and whether it was cut."""
    data = (text or "").encode("utf-8", "replace")
    if len(data) <= limit:
        return text or "", False
    return data[:limit].decode("utf-8", "ignore"), True
