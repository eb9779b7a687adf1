# Copyright (c) kubenode.proxy contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Which endpoints a service port uses for Cluster and Local traffic (upstream's
CategorizeEndpoints, without topology hints)."""

from __future__ import annotations

from typing import List, NamedTuple, Sequence

from .model import Endpoint, ServicePort


class Categorized(NamedTuple):  # a NamedTuple: built once per service port, cheaply
    cluster: List[Endpoint]
    local: List[Endpoint]
    reachable: List[Endpoint]  # every endpoint some policy chain jumps to: gets a SEP chain
    has_any: bool


def categorize(endpoints: Sequence[Endpoint], svc: ServicePort) -> Categorized:
    cluster: List[Endpoint] = []
    local: List[Endpoint] = []
    has_any = False
    if svc.uses_cluster_endpoints:
        cluster = [ep for ep in endpoints if ep.ready]
        if not cluster:
            # Fall back to serving-terminating endpoints so that a rolling update does not
            # drop connections while the new pods are not ready yet.
            cluster = [ep for ep in endpoints if ep.serving and ep.terminating]
        has_any = bool(cluster)
    if not svc.uses_local_endpoints:
        return Categorized(cluster, [], cluster, has_any)

    local_ready = local_term = False
    for ep in endpoints:
        if ep.ready:
            has_any = True
            local_ready = local_ready or ep.is_local
        elif ep.serving and ep.terminating:
            has_any = True
            local_term = local_term or ep.is_local
    if local_ready:
        local = [ep for ep in endpoints if ep.is_local and ep.ready]
    elif local_term:
        local = [ep for ep in endpoints if ep.is_local and ep.serving and ep.terminating]
    if not svc.uses_cluster_endpoints:
        return Categorized([], local, local, has_any)
    seen = set()
    reachable = []
    for ep in cluster + local:
        if ep.addr not in seen:
            seen.add(ep.addr)
            reachable.append(ep)
    return Categorized(cluster, local, reachable, has_any)
