"""What ``pagedkv inspect`` shows of a store's remote tier: the section its last commit recorded."""

from __future__ import annotations

from typing import Any

from .counters import committed_section

__all__ = ["committed_section", "remote_text"]


def remote_text(section: dict[str, Any]) -> str:
    """One line of the inspect report: the URL (never a password) and the counter totals."""
    counts = section["counters"]
    kind = "cluster " if section["cluster"] else ""
    return (f"{kind}{section['url']} (namespace {section['namespace']}): "
            f"{counts['remote_published']:,} published, {counts['remote_present']:,} present already, "
            f"{counts['remote_skipped']:,} skipped; {counts['remote_fetched']:,} fetched, "
            f"{counts['remote_fetch_misses']:,} misses, {counts['remote_rejected']:,} refused values; "
            f"{counts['remote_errors']:,} errors ({counts['remote_timeouts']:,} timeouts, "
            f"{counts['remote_refused']:,} refusals); {counts['remote_bytes_sent']:,} bytes sent, "
            f"{counts['remote_bytes_fetched']:,} fetched (as of the last commit)")
