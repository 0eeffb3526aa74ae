"""Document-set affinity for the engine replicas: a Ray Serve request router.

Requests over the same ordered document set (the ``route_key`` the ingress computes) rank
the replicas in the same order, by rendezvous hashing over the live replica ids: the first
is the one whose warm document-prefix entries fit the request, the others follow in an
order of their own. Ray Serve takes the first rank whose replica has a free slot
(``max_ongoing_requests``), so a full or dead replica passes its requests on; without a
key every replica is one rank and the least loaded of them answers. A replica set change
moves only the keys of the replicas that came or went.
"""

from __future__ import annotations

import hashlib

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica


def replica_rank(route_key: str, replica_id: str) -> int:
    """The rendezvous score of ``replica_id`` for ``route_key`` (highest wins)."""
    digest = hashlib.sha256(f"{route_key}\x00{replica_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big")


def ranked_replicas(route_key: str, replica_ids: list[str]) -> list[str]:
    """``replica_ids`` in order of preference for ``route_key``."""
    return sorted(replica_ids, key=lambda rid: replica_rank(route_key, rid), reverse=True)


class DocumentSetRouter(RequestRouter):
    """Ranks the replicas by rendezvous hash of the request's ``route_key`` keyword."""

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        if pending_request is not None:
            # every rank full: back off before the next round instead of spinning
            pending_request.routing_context.should_backoff = True
        key = pending_request.kwargs.get("route_key") if pending_request is not None else None
        if not key:
            return [candidate_replicas]
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        return [[by_id[rid]] for rid in ranked_replicas(str(key), list(by_id))]
