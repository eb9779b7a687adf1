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
  went; called with the Context when the mode writes iptables rules, else with the netns.
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


@dataclass(frozen=True)
class Mode:
    name: str
    module: str  # under modes/, imported on first use
    proxier: str  # class name (provider.Proxier)
    config: str  # function name: (cfg, ipt_cfg, netns) -> the mode's compiler config
    cleanup: str  # function name: (ctx) -> int, or (netns) -> int when uses_iptables is False
    # The configuration section whose syncPeriod/minSyncPeriod replace the proxy's in this
    # mode (and whose --<section>-sync-period flags apply), "" for none.
    sync_section: str = ""
    uses_iptables: bool = True  # writes iptables rules (IPVS mode does, for masquerading)

    def _hook(self, attr: str) -> Any:
        return getattr(importlib.import_module(f"{__name__}.{self.module}"), getattr(self, attr))

    def make_config(self, cfg: ProxyConfig, netns: str, node: Any = None,
                    addresses: Optional[List[str]] = None) -> Any:
        """The mode's compiler configuration; reads the node's addresses unless given."""
        from .iptables.options import iptables_config

        ipt_cfg = iptables_config(cfg, netns, node=node, addresses=addresses)
        return self._hook("config")(cfg, ipt_cfg, netns)

    def build(self, state: ProxyState, mode_cfg: Any, ctx: Context) -> Proxier:
        cls = self._hook("proxier")
        return cls.create(state, mode_cfg, ctx)

    def clean(self, ctx: Context) -> int:
        fn = self._hook("cleanup")
        return fn(ctx) if self.uses_iptables else fn(ctx.netns)


REGISTRY: Dict[str, Mode] = {m.name: m for m in (
    Mode("iptables", "iptables.proxier", "IptablesProxier", "iptables_mode_config", "cleanup_iptables"),
    Mode("ipvs", "ipvs.proxier", "IpvsProxier", "ipvs_config", "cleanup_ipvs", sync_section="ipvs"),
    # Mode("nftables", "nftables", "NftablesProxier", "nftables_config", "cleanup_nftables", uses_iptables=False),
)}


def names() -> Tuple[str, ...]:
    """The modes this proxy implements."""
    return tuple(REGISTRY)


def get(name: str) -> Optional[Mode]:
    return REGISTRY.get(name or DEFAULT_MODE)


def cleanup_order(configured: str) -> List[Mode]:
    """Every mode, in reverse registry order: IPVS mode's chains jump to iptables mode's
    KUBE-MARK-MASQ, so they must go before it (iptables-restore refuses to delete a chain
    still referenced). ``configured`` is accepted for callers; the order does not depend
    on it."""
    return list(reversed(list(REGISTRY.values())))


def sync_section(name: str) -> str:
    mode = get(name)
    return mode.sync_section if mode is not None else ""
