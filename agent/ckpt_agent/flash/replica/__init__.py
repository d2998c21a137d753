"""Peer replicas of flash (shared-memory) snapshots: a node's sidecar pushes every
committed snapshot to the sidecar of k peer nodes, which keeps the newest complete one in
its memory; a node lost with its memory is recovered from a peer's replica.

Modules, one job each (the wire format, auth, memory bound and ports are in
``docs/replicas.md``): :mod:`.wire` (framing, bounded sizes, timeouts), :mod:`.auth`
(the per-job HMAC challenge–response), :mod:`.plan` (a snapshot's chunks and the offer),
:mod:`.layout`, :mod:`.store` and :mod:`.incoming` (the receiver's replicas, never
half-written, at most two per peer-rank), :mod:`.server` (the receiving TCP server),
:mod:`.client` (:func:`push`), :mod:`.fetch` (reading a replica back, verified),
:mod:`.replicator` (the sidecar's background pusher). Torch-free, standard library only.
"""
