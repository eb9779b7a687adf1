# Copyright (c) kubenode.proxy contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
"""The ipsets of upstream kube-proxy's IPVS mode: names, types, comments, and the
iptables matches that use them (kubernetes ``pkg/proxy/ipvs/ipset.go`` and the
``ipsetInfo`` / ``ipsetWithIptablesChain`` tables of ``pkg/proxy/ipvs/proxier.go``).

Use::

    from .ipset_specs import KUBE_IPSETS, KUBE_IPSET_MATCHES, kube_ipset, kube_ipset_name
    want = kube_ipset("KUBE-CLUSTER-IP", entries=["10.96.0.10,tcp:80"])   # an ipset.IPSet
    kernel.sync([want, ...], exclusive=True)

Upstream creates hash sets with ``family inet|inet6 hashsize 1024 maxelem 65536`` and
bitmap:port sets with ``range 0-65535``, without ``comment`` support: the comments below
are upstream's descriptions of the sets, not ipset comments. IPv6 sets are named with
``KUBE-6-`` instead of ``KUBE-`` and cut to 31 characters (:func:`kube_ipset_name`).
"""

from __future__ import annotations

from typing import Iterable, Optional

# The set tables moved to names.py (a leaf); importers of this module still find them here.
from ..names import (  # noqa: F401 pylint: disable=unused-import
    KUBE_CLUSTER_IP,
    KUBE_EXTERNAL_IP,
    KUBE_EXTERNAL_IP_LOCAL,
    KUBE_HEALTH_CHECK_NODE_PORT,
    KUBE_IPSET_MATCHES,
    KUBE_IPSETS,
    KUBE_IPSETS_BY_NAME,
    KUBE_IPVS_IPS,
    KUBE_LOAD_BALANCER,
    KUBE_LOAD_BALANCER_FW,
    KUBE_LOAD_BALANCER_LOCAL,
    KUBE_LOAD_BALANCER_SOURCE_CIDR,
    KUBE_LOAD_BALANCER_SOURCE_IP,
    KUBE_LOOP_BACK,
    KUBE_NODE_PORT_LOCAL_SCTP,
    KUBE_NODE_PORT_LOCAL_TCP,
    KUBE_NODE_PORT_LOCAL_UDP,
    KUBE_NODE_PORT_SCTP,
    KUBE_NODE_PORT_TCP,
    KUBE_NODE_PORT_UDP,
    KubeIPSetMatch,
    KubeIPSetSpec,
    kube_ipset_name,
)
from .ipset import DEFAULT_PORT_RANGE, IPSet, entries_of

DEFAULT_HASHSIZE = 1024
DEFAULT_MAXELEM = 65536


def kube_ipset(name: str, ipv6: bool = False, entries: Iterable[str] = (),
               comment: Optional[str] = None) -> IPSet:
    """A desired :class:`IPSet` for upstream set ``name`` (the IPv4 name), created the way
    upstream creates it. ``comment`` gives the entries an ipset comment (and the set
    comment support); upstream does not use ipset comments."""
    spec = KUBE_IPSETS_BY_NAME[name]
    s = IPSet(kube_ipset_name(name, ipv6), spec.type, entries=entries_of(entries, comment=comment),
              comment=comment is not None)
    if s.is_hash:
        s.family = "inet6" if ipv6 else "inet"
        s.hashsize = DEFAULT_HASHSIZE
        s.maxelem = DEFAULT_MAXELEM
    else:
        s.range = DEFAULT_PORT_RANGE
    return s
