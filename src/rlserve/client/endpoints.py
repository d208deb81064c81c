"""Which endpoint serves a call: sessions stick by rendezvous hashing, the rest go to the least busy.

Pure bookkeeping, no I/O: the transport probes endpoints and reports what it saw.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import random
import time
from dataclasses import dataclass, field


@dataclass(eq=False)
class Endpoint:
    url: str
    up: bool = True  # until a probe or a connection says otherwise
    paused: bool = False  # the server said is_paused (someone is syncing weights)
    policy_version: int = 0  # last version the server reported
    floor: int = 0  # the oldest version this endpoint may serve: it never goes back unless it restarted
    in_flight: int = 0  # this client's calls now open on it
    checked_at: float = -math.inf  # monotonic time of the last probe (or failure)
    probe: asyncio.Task | None = field(default=None, repr=False)

    @property
    def behind(self) -> bool:
        return self.policy_version < self.floor

    @property
    def serving(self) -> bool:
        return self.up and not self.paused and not self.behind

    def observed(self, version: int) -> None:
        """A response's version: responses may arrive out of order, so only move forward."""
        self.policy_version = max(self.policy_version, version)
        self.floor = max(self.floor, version)

    def probed(self, version: int, paused: bool) -> None:
        """The server's own word: a version below the floor means it restarted and lost its weights."""
        self.up, self.paused, self.policy_version = True, paused, version
        self.floor = max(self.floor, version)

    def committed(self, version: int) -> None:
        """An update through this client: the new baseline, also for a server that had restarted."""
        self.policy_version = self.floor = version

    def went_down(self) -> None:
        self.up, self.checked_at = False, time.monotonic()


def rendezvous_score(session_id: str, url: str) -> int:
    """Highest-random-weight hashing: removing an endpoint moves only the sessions it held.
    blake2b, not hash(), so every process agrees."""
    digest = hashlib.blake2b(f"{session_id}\x00{url}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


class Pool:
    def __init__(self, urls: list[str], probe_interval: float):
        if not urls:
            raise ValueError("give at least one base URL")
        self.endpoints = [Endpoint(normalize_url(u)) for u in urls]
        if len({e.url for e in self.endpoints}) != len(self.endpoints):
            raise ValueError(f"duplicate base URLs in {urls}")
        self.probe_interval = probe_interval

    def routable(self, check_versions: bool) -> list[Endpoint]:
        return [e for e in self.endpoints if e.up and not (check_versions and e.behind)]

    def pick(self, session_id: str | None, check_versions: bool, avoid: Endpoint | None = None) -> Endpoint | None:
        """The session's endpoint, else the least busy; `avoid` (the one that just failed) when possible."""
        candidates = self.routable(check_versions)
        if avoid is not None and len(candidates) > 1:
            candidates = [e for e in candidates if e is not avoid]
        if not candidates:
            return None
        if session_id is not None:
            return max(candidates, key=lambda e: rendezvous_score(session_id, e.url))
        least = min(e.in_flight for e in candidates)
        return random.choice([e for e in candidates if e.in_flight == least])

    def due(self, now: float) -> list[Endpoint]:
        """Endpoints whose state is older than probe_interval (at most 1 s for those not serving:
        callers may be waiting on them) and not being probed already."""
        return [
            e
            for e in self.endpoints
            if e.probe is None
            and now - e.checked_at >= (self.probe_interval if e.serving else min(self.probe_interval, 1.0))
        ]


def normalize_url(url: str) -> str:
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url
