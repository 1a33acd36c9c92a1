"""``ServerFleet``: the one owner of rollout-server membership on a learner rank.

Each server is *healthy* or *quarantined*. A quarantined server gets no rollouts and no weight pushes; with
``readmit_after_s`` set it is *probed* on ``/health/`` at weight-sync points, first ``readmit_after_s`` after the
failure, then with the wait doubling up to ``readmit_max_interval_s``. One that answers is re-synced by its owner (the
rollout client, with the weights built for that sync) and *re-admitted* only once that succeeded; a failed re-sync
backs off like a failed probe. Without ``readmit_after_s`` a failed server stays out for the run.

Process identity: our servers answer ``/rm/identity/`` with a ``boot_id`` drawn at start-up, so a server restarted
between two syncs without any request failing in between (nothing was sent to it meanwhile) is told from the process
the learner pushed to before (``boot_ids``). A server without that endpoint (``swift rollout``) reads as ``None``.

Several learner ranks: each rank sees its own failures; at every sync the ranks pool them on rank 0
(``pool_on_rank0``, which must be called by every rank), rank 0 pushes, probes and re-admits, and every rank then
adopts rank 0's set (``adopt_rank0``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import httpx

from trainer.sync.http import server_http_client

log = logging.getLogger(__name__)

KEY = "custom.extra.rollout_matching.vllm.server"


class Endpoint(Protocol):
    base_url: str

    def headers(self) -> dict[str, str]: ...


@dataclass
class Probe:
    """When a quarantined server is probed next, and the current wait."""

    due: float
    wait: float


def servers_for_rank(num_servers: int, rank: int, world_size: int) -> list[int]:
    """Server indices rank ``rank`` of ``world_size`` sends to: every W-th server starting at ``rank`` when
    there are at least as many servers as ranks, else the single server ``rank % S``."""
    if num_servers < 1 or world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"bad topology: {num_servers} servers, rank {rank} of {world_size}")
    if num_servers >= world_size:
        return list(range(rank, num_servers, world_size))
    return [rank % num_servers]


class ServerFleet:
    """See the module docstring."""

    def __init__(self, servers: Sequence[Endpoint], *, rank: int = 0, world_size: int = 1,
                 readmit_after_s: float | None = None, readmit_max_interval_s: float = 300.0,
                 clock: Callable[[], float] = time.monotonic, probe_timeout_s: float = 5.0):
        if not servers:
            raise ValueError(f"{KEY}.servers: at least one server is needed")
        self.servers = list(servers)
        self.rank = rank
        self.mine = [self.servers[i] for i in servers_for_rank(len(self.servers), rank, world_size)]
        self.readmit_after_s = readmit_after_s
        self.readmit_max_interval_s = max(readmit_max_interval_s, readmit_after_s or 0.0)
        self.clock = clock
        self.probe_timeout_s = probe_timeout_s
        self._quarantined: dict[str, Probe | None] = {}
        self.readmissions: list[dict[str, Any]] = []
        self.on_quarantine: list[Callable[[str], None]] = []
        self._client = server_http_client(probe_timeout_s)

    # -- who serves ------------------------------------------------------------------------------------------------
    @property
    def quarantined(self) -> frozenset[str]:
        return frozenset(self._quarantined)

    def endpoint(self, url: str) -> Endpoint:
        return next(s for s in self.servers if s.base_url == url)

    def healthy(self) -> list[Endpoint]:
        """Every healthy server, in server-list order (the weight-push targets)."""
        return [s for s in self.servers if s.base_url not in self._quarantined]

    def healthy_for_rank(self) -> list[Endpoint]:
        """This rank's healthy servers; when all of them are quarantined, every healthy server (they receive the same
        weight pushes), so one rank's faults never stop it while others can serve."""
        own = [s for s in self.mine if s.base_url not in self._quarantined]
        if own:
            return own
        borrowed = self.healthy()
        if borrowed:
            log.warning("rank %d: all of its rollout servers are quarantined; borrowing %s", self.rank,
                        [s.base_url for s in borrowed])
        return borrowed

    # -- transitions -----------------------------------------------------------------------------------------------
    def quarantine(self, url: str, reason: str = "") -> None:
        if url in self._quarantined:
            return
        when = (f"probed for re-admission in {self.readmit_after_s:g}s ({KEY}.readmit_after_s)"
                if self.readmit_after_s else f"for the rest of the run ({KEY}.readmit_after_s is off)")
        log.warning("quarantining rollout server %s (%s): no rollouts or weight pushes until re-admitted; %s",
                    url, reason[:300] or "failed", when)
        self._quarantined[url] = Probe(self.clock() + self.readmit_after_s, self.readmit_after_s) \
            if self.readmit_after_s else None
        for hook in self.on_quarantine:
            hook(url)

    def back_off(self, url: str) -> None:
        """A probe or re-sync of ``url`` failed: double its wait (up to ``readmit_max_interval_s``)."""
        probe = self._quarantined.get(url)
        if probe is None:
            return
        probe.wait = min(probe.wait * 2, self.readmit_max_interval_s)
        probe.due = self.clock() + probe.wait

    def readmit(self, url: str, **record: Any) -> None:
        """``url`` took the current weights: it serves again."""
        self._quarantined.pop(url, None)
        self.readmissions.append({"server": url, **record})

    def probe_of(self, url: str) -> Probe | None:
        return self._quarantined.get(url)

    def due_and_answering(self) -> list[str]:
        """Quarantined servers due for a probe that answer ``/health/`` now (they still need a re-sync); a probe
        that fails backs off."""
        if not self.readmit_after_s:
            return []
        now = self.clock()
        answering = []
        for url in sorted(self._quarantined):
            probe = self._quarantined[url]
            if probe is None or probe.due > now:
                continue
            try:
                ok = self._client.get(url + "/health/").status_code == 200
            except httpx.HTTPError:
                ok = False
            if ok:
                answering.append(url)
            else:
                self.back_off(url)
                log.info("quarantined rollout server %s still down; next probe in %.0fs", url, probe.wait)
        return answering

    def boot_ids(self, urls: Sequence[str]) -> dict[str, str | None]:
        """The ``boot_id`` of each of ``urls`` now (``/rm/identity/``; None for a server without that endpoint),
        asked concurrently; a server that does not answer is left out."""
        from concurrent.futures import ThreadPoolExecutor

        def one(url: str) -> tuple[str, str | None] | None:
            try:
                resp = self._client.get(url + "/rm/identity/", headers=self.endpoint(url).headers())
            except httpx.HTTPError:
                return None
            if resp.status_code == 404:
                return url, None
            return (url, _boot_id(resp)) if resp.status_code == 200 else None

        if not urls:
            return {}
        with ThreadPoolExecutor(max_workers=len(urls)) as pool:
            return dict(r for r in pool.map(one, urls) if r is not None)

    # -- several learner ranks -------------------------------------------------------------------------------------
    def adopt(self, urls: Sequence[str] | set[str] | frozenset[str]) -> list[str]:
        """Take a quarantine set decided elsewhere: new members are quarantined, missing ones re-admitted; returns
        the re-admitted urls."""
        urls = set(urls) & {s.base_url for s in self.servers}
        for url in sorted(urls - set(self._quarantined)):
            self.quarantine(url, "failed on another learner rank")
        back = sorted(set(self._quarantined) - urls)
        for url in back:
            self._quarantined.pop(url, None)
        return back

    def pool_on_rank0(self) -> None:
        """Every rank's quarantined servers become rank 0's (call on all ranks at the same sync)."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            return
        gathered: list[object] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, sorted(self._quarantined))
        for urls in gathered:
            for url in urls or []:
                self.quarantine(url, "failed on another learner rank")

    def adopt_rank0(self) -> list[str]:
        """Every rank adopts rank 0's quarantine set (call on all ranks); returns the urls re-admitted here."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            return []
        box: list[object] = [sorted(self._quarantined)]
        dist.broadcast_object_list(box, src=0)
        return self.adopt(set(box[0] or []))

    def metadata(self) -> dict[str, Any]:
        return {"quarantined": sorted(self._quarantined), "readmissions": list(self.readmissions),
                "readmit_after_s": self.readmit_after_s}

    def close(self) -> None:
        self._client.close()


def _boot_id(resp: httpx.Response) -> str | None:
    try:
        value = resp.json().get("boot_id")
    except (ValueError, AttributeError):
        return None
    return str(value) if value is not None else None
