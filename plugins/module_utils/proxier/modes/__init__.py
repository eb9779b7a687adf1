# Copyright (c) kubenode.proxy contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
"""The mode registry: mode name -> the package that implements it.

The only place that knows which modes exist. app, cli, daemon and ``--cleanup`` ask it
for the mode's compiler configuration, its proxier (a provider.Proxier) and the removal
of its leftovers; nothing else compares mode names. A mode package is imported on first
use, so a node in iptables mode never imports pyroute2 or the IPVS code.

A new mode is a package ``modes/<name>/`` (pure compile, plan, a proxier implementing
provider.Proxier) and one line in ``REGISTRY`` naming its hooks:

- ``config(cfg: ProxyConfig, ipt_cfg: IptablesConfig, netns: str)``: the mode's compiler
  configuration from the proxy's (``ipt_cfg``: the options every mode shares - masquerade
  bit, local-traffic detection, NodePort addresses - resolved by iptables_config());
- ``proxier``: a class whose ``create(state, mode_cfg, ctx)`` builds it (provider.ProxierBase
  gives ``cls(state, mode_cfg, netns=ctx.netns)``);
- ``cleanup``: removes what the mode leaves in the kernel and returns how many objects
  went; called with the Context (``leftovers_only``: the mode is not the configured one,
  and a missing tool means it never ran here).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple

if TYPE_CHECKING:  # the registry itself imports no mode and nothing of the core
    from ..config import ProxyConfig
    from ..provider import Proxier
    from ..state import ProxyState

# The mode names upstream's KubeProxyConfiguration knows (a config naming one that is not
# registered here is valid, but refused at start as not implemented).
UPSTREAM_MODES = ("iptables", "nftables", "ipvs")
DEFAULT_MODE = "iptables"


def quiet(msg: str) -> None:
    """The default log: say nothing."""


@dataclass
class Context:
    """What building a proxier or cleaning up needs beyond the configuration."""

    config: Any = None  # the ProxyConfig
    netns: str = ""
    iptables: Any = None  # a kernel.iptables.IptablesKernel (iptables-restore binary, netns)
    log: Callable[[str], None] = quiet
    refresh: Optional[Callable[[], Any]] = None  # rebuilds the mode's config (node addresses changed)
    # Cleaning up after a mode that is not the configured one: a tool that mode needs
    # being absent means it never ran here (nothing to remove), not a failure.
    leftovers_only: bool = False
    family: int = 4  # the IP family this proxier or cleanup serves (``iptables`` is that family's tools)


@dataclass(frozen=True)
class Mode:
    name: str
    module: str  # under modes/, imported on first use
    proxier: str  # class name (provider.Proxier)
    config: str  # function name: (cfg, ipt_cfg, netns) -> the mode's compiler config
    cleanup: str  # function name: (ctx: Context) -> int
    # The configuration section whose syncPeriod/minSyncPeriod replace the proxy's in this
    # mode (and whose --<section>-sync-period flags apply), "" for none.
    sync_section: str = ""
    # Cleaned up before the others, whatever is configured: IPVS mode's chains jump to
    # chains iptables mode's cleanup deletes (KUBE-MARK-MASQ), and its cleanup removes both.
    cleanup_first: bool = False
    # The kernel interface the mode's rules live in. iptables and IPVS mode share one (IPVS
    # mode writes iptables rules, KUBE-MARK-MASQ among them); starting a mode removes the
    # leftovers of the modes of the other backends, as upstream's platformCleanup does
    # when a node switches between nftables and an iptables-based mode.
    backend: str = "iptables"
    # The IP families the mode implements: a dual-stack node runs one proxier per family
    # (upstream's metaproxier); IPVS mode serves IPv4 only so far.
    families: Tuple[int, ...] = (4, 6)

    def _hook(self, attr: str) -> Any:
        return getattr(importlib.import_module(f"{__name__}.{self.module}"), getattr(self, attr))

    def make_config(self, cfg: ProxyConfig, netns: str, node: Any = None,
                    addresses: Optional[List[str]] = None, family: int = 4) -> Any:
        """The mode's compiler configuration for one IP family; reads the node's addresses
        unless given."""
        from .iptables.options import iptables_config

        ipt_cfg = iptables_config(cfg, netns, node=node, addresses=addresses, family=family)
        return self._hook("config")(cfg, ipt_cfg, netns)

    def build(self, state: ProxyState, mode_cfg: Any, ctx: Context) -> Proxier:
        cls = self._hook("proxier")
        return cls.create(state, mode_cfg, ctx)

    def clean(self, ctx: Context) -> int:
        fn = self._hook("cleanup")
        return fn(ctx)


REGISTRY: Dict[str, Mode] = {m.name: m for m in (
    Mode("iptables", "iptables.proxier", "IptablesProxier", "iptables_mode_config", "cleanup_iptables"),
    Mode("ipvs", "ipvs.proxier", "IpvsProxier", "ipvs_config", "cleanup_ipvs", sync_section="ipvs",
         cleanup_first=True, families=(4,)),
    Mode("nftables", "nftables.proxier", "NftablesProxier", "nftables_config", "cleanup_nftables",
         backend="nftables"),
)}


def names() -> Tuple[str, ...]:
    """The modes this proxy implements."""
    return tuple(REGISTRY)


def get(name: str) -> Optional[Mode]:
    return REGISTRY.get(name or DEFAULT_MODE)


def cleanup_order(configured: str) -> List[Mode]:
    """Every mode: those marked ``cleanup_first``, then the others with the configured one
    last (its errors are the ones that matter most and its message comes last)."""
    mode = get(configured)
    first = [m for m in REGISTRY.values() if m.cleanup_first]
    rest = [m for m in REGISTRY.values() if not m.cleanup_first and m is not mode]
    return first + rest + ([mode] if mode is not None and mode not in first else [])


def other_backends(configured: str) -> List[Mode]:
    """The modes whose leftovers starting ``configured`` removes (those of another backend),
    in cleanup order."""
    mode = get(configured)
    if mode is None:
        return []
    return [m for m in cleanup_order(configured) if m.backend != mode.backend]


def sync_section(name: str) -> str:
    mode = get(name)
    return mode.sync_section if mode is not None else ""
