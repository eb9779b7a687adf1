# Copyright (c) kubenode.proxy contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
"""The proxy's view of the cluster: services, endpoint slices, and what changed.

Changes are tracked per Service (``namespace/name``): a backend's partial sync
recompiles only those services.
"""

from __future__ import annotations

from typing import Dict, Iterable, List, Optional, Sequence, Set, Tuple

from .model import Endpoint, EndpointSlice, Node, Service, ServicePort, ServicePortName


class ProxyState:
    def __init__(self, hostname: str) -> None:
        self.hostname = hostname
        self.services: Dict[str, Service] = {}
        self.slices: Dict[str, EndpointSlice] = {}  # key "ns/slicename"
        self._slices_by_service: Dict[str, Set[str]] = {}
        # Per slice, its endpoints per (port name, protocol), built once when the slice
        # arrives (as upstream's change tracker does) rather than at every compile.
        self._slice_endpoints: Dict[str, Dict[Tuple[str, str], Tuple[Endpoint, ...]]] = {}
        self._endpoint_total = 0  # endpoint_count(), kept as slices come and go
        self.node: Optional[Node] = None
        self._changed: Set[str] = set()

    # --- updates --------------------------------------------------------------------

    def set_service(self, svc: Service) -> None:
        key = f"{svc.namespace}/{svc.name}"
        if self.services.get(key) != svc:
            self.services[key] = svc
            self._changed.add(key)

    def delete_service(self, namespace: str, name: str) -> None:
        key = f"{namespace}/{name}"
        if self.services.pop(key, None) is not None:
            self._changed.add(key)

    def set_slice(self, sl: EndpointSlice) -> None:
        key = f"{sl.namespace}/{sl.name}"
        old = self.slices.get(key)
        if old == sl:
            return
        if old is not None:
            self._unlink(key, old)
        if old is not None:
            self._endpoint_total -= _slice_endpoint_count(old)
        self._endpoint_total += _slice_endpoint_count(sl)
        self.slices[key] = sl
        self._slice_endpoints[key] = self._endpoints_of(sl)
        svc_key = f"{sl.namespace}/{sl.service}"
        self._slices_by_service.setdefault(svc_key, set()).add(key)
        self._changed.add(svc_key)

    def delete_slice(self, namespace: str, name: str) -> None:
        key = f"{namespace}/{name}"
        old = self.slices.pop(key, None)
        self._slice_endpoints.pop(key, None)
        if old is not None:
            self._endpoint_total -= _slice_endpoint_count(old)
            self._unlink(key, old)

    def _unlink(self, key: str, old: EndpointSlice) -> None:
        svc_key = f"{old.namespace}/{old.service}"
        keys = self._slices_by_service.get(svc_key)
        if keys is not None:
            keys.discard(key)
            if not keys:
                del self._slices_by_service[svc_key]
        self._changed.add(svc_key)

    def replace_all(self, services: Iterable[Service], slices: Iterable[EndpointSlice]) -> None:
        """Make the state exactly these objects (a manifests reload)."""
        self.replace_services(services)
        self.replace_slices(slices)

    def replace_services(self, services: Iterable[Service]) -> None:
        """Exactly these services (a relist): only real differences count as changes."""
        new_svcs = {f"{s.namespace}/{s.name}": s for s in services}
        for key in list(self.services):
            if key not in new_svcs:
                ns, name = key.split("/", 1)
                self.delete_service(ns, name)
        for svc in new_svcs.values():
            self.set_service(svc)

    def replace_slices(self, slices: Iterable[EndpointSlice]) -> None:
        new_slices = {f"{s.namespace}/{s.name}": s for s in slices}
        for key in list(self.slices):
            if key not in new_slices:
                ns, name = key.split("/", 1)
                self.delete_slice(ns, name)
        for sl in new_slices.values():
            self.set_slice(sl)

    def take_changes(self) -> Set[str]:
        changed, self._changed = self._changed, set()
        return changed

    def requeue(self, changed: Set[str]) -> None:
        """Put back changes a failed sync took but did not apply (the retry covers them)."""
        self._changed |= changed

    def mark_all_changed(self) -> None:
        self._changed.update(self.services)

    # --- views ----------------------------------------------------------------------

    def service_keys(self) -> List[str]:
        return sorted(self.services)

    def endpoints_for(self, key: str) -> Dict[ServicePortName, Sequence[Endpoint]]:
        """Endpoints of every port of one service, merged over its slices, sorted. Read-only:
        with one slice (the common case) these are the state's own tuples, not copies."""
        svc = self.services.get(key)
        if svc is None:
            return {}
        family = 6 if ":" in (svc.ports[0].cluster_ip if svc.ports else "") else 4
        want = "IPv6" if family == 6 else "IPv4"
        slice_keys = [k for k in self._slices_by_service.get(key, ()) if self.slices[k].address_type == want]
        result: Dict[ServicePortName, Sequence[Endpoint]] = {}
        if len(slice_keys) == 1:
            # The common case: one slice, whose lists are sorted and deduplicated at intake.
            lists = self._slice_endpoints[slice_keys[0]]
            for sp in svc.ports:
                result[sp.name] = lists.get((sp.name.port, sp.protocol), ())
            return result
        by_port: Dict[Tuple[str, str], Dict[str, Endpoint]] = {}
        for slice_key in sorted(slice_keys):
            for port_key, eps in self._slice_endpoints[slice_key].items():
                bucket = by_port.setdefault(port_key, {})
                for e in eps:
                    # A duplicate across slices (during slice churn): keep the first one seen.
                    bucket.setdefault(e.addr, e)
        for sp in svc.ports:
            bucket = by_port.get((sp.name.port, sp.protocol), {})
            result[sp.name] = [bucket[k] for k in sorted(bucket)]
        return result

    def _endpoints_of(self, sl: EndpointSlice) -> Dict[Tuple[str, str], Tuple[Endpoint, ...]]:
        """Per (port name, protocol): the slice's endpoints sorted by address, a duplicate
        address kept once (its first occurrence), as endpoints_for() returns them."""
        out: Dict[Tuple[str, str], Tuple[Endpoint, ...]] = {}
        for port in sl.ports:
            unique: Dict[str, Endpoint] = {}
            for ep in sl.endpoints:
                e = Endpoint(ip=ep.addresses[0], port=port.port, node_name=ep.node_name,
                             ready=ep.ready, serving=ep.serving, terminating=ep.terminating,
                             is_local=bool(ep.node_name) and ep.node_name == self.hostname)
                unique.setdefault(e.addr, e)
            out[(port.name, port.protocol)] = tuple(unique[k] for k in sorted(unique))
        return out

    def ports_of(self, key: str) -> Tuple[ServicePort, ...]:
        svc = self.services.get(key)
        return svc.ports if svc else ()

    def endpoint_count(self) -> int:
        return self._endpoint_total


def _slice_endpoint_count(sl: EndpointSlice) -> int:
    return len(sl.endpoints) * max(1, len(sl.ports))
