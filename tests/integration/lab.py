"""Network-namespace lab that looks like one Kubernetes node, for integration tests.

A :class:`Lab` builds a small, throw-away topology out of network namespaces
and veth pairs, all named with a per-lab random prefix ``kn<6 hex>-`` so that
parallel or leftover labs never collide. Nothing is ever configured in the
host's own network namespace: every link is created directly inside its
target namespace (``ip -n NS link add ... peer ... netns OTHER``).

Topology (``P`` is the prefix, e.g. ``kn1a2b3c-``)::

      pod / client namespaces                 node namespace ("P" + "node")
    +----------------------+              +-------------------------------+
    | P<pod>               |  veth pair   |  ip_forward=1, proxy rules    |
    |  eth0 10.244.x.y/32  |--------------|  Pp<n>  proxy_arp=1           |
    |  default via         |              |         route 10.244.x.y/32   |
    |   169.254.1.1 onlink |              |                               |
    +----------------------+              |  Peth0  192.168.50.1/24       |
                                          |  default via 192.168.50.254   |
                                          +---------------|---------------+
                                                          | veth pair
      external namespaces                 +---------------|---------------+
    +----------------------+              |  Pn0 (bridge port)            |
    | P<ext>               |  veth pair   |  Pbr bridge 192.168.50.254/24 |
    |  eth0 192.168.50.x/24|--------------|  Px<n> (bridge port)          |
    |  10.96.0.0/12,       |              |  ip_forward=0: the "gateway"  |
    |  203.0.113.0/24,     |              |  silently drops what it gets  |
    |  198.51.100.0/24     |              +-------------------------------+
    |   via 192.168.50.1   |                 lan namespace ("P" + "lan")
    +----------------------+

Addressing plan
    * Cluster (pod) CIDR ``10.244.0.0/16``: pods get the ``/32`` the caller
      passes, Calico style. The pod's default route points at the fake
      gateway ``169.254.1.1`` (``onlink``); the node-side veth has
      ``proxy_arp=1`` and ``proxy_delay=0`` and answers the ARP for it; the
      node has a host route ``<pod ip>/32 dev Pp<n>``.
    * Service CIDR ``10.96.0.0/12``, external IPs ``203.0.113.0/24`` and
      load-balancer IPs ``198.51.100.0/24`` are not assigned anywhere.
    * Node network ``192.168.50.0/24``: the node's uplink ``Peth0`` holds the
      node IP ``192.168.50.1``; ``192.168.50.254`` is the "LAN router" (the
      bridge in the lan namespace); external hosts take ``.2`` - ``.253`` and
      route the service, external-IP and LB ranges via the node IP.

    * Dual stack (``Lab(dual_stack=True)``): the same plan in IPv6 — pods
      ``fd00:10:244::/48`` (``/128`` each, default via ``fe80::1`` held by every
      node-side veth), services ``fd00:10:96::/112``, external IPs
      ``2001:db8:203::/64``, LB IPs ``2001:db8:198::/64``, node network
      ``fd00:50::/64`` (node ``::1``, LAN router ``::fe``). Addresses skip
      duplicate address detection; echo servers also listen on ``::``.

Routing of service IPs
    Like a real node, the node namespace has a *default route* via
    ``192.168.50.254``; it makes ClusterIPs, external IPs and LB IPs routable
    from the node itself (locally generated packets need a route *before*
    OUTPUT DNAT; the kernel re-routes after DNAT) and it is also what makes
    proxy ARP answer for ``169.254.1.1``. The source address the node picks
    is the node IP. Traffic to a service IP that no rule catches ends at the
    lan namespace, which has forwarding disabled and drops it silently: the
    client sees a timeout. ICMP redirects are disabled on the node (and
    ignored by external hosts), otherwise an external host that once sent to
    an unhandled service IP would be told to use ``.254`` directly and bypass
    the node for that IP afterwards.

The node namespace also gets ``icmp_ratemask=0`` / ``icmp_ratelimit=0`` (so
every REJECT produces its ICMP error), ``send_redirects=0``, a configurable
``rp_filter`` and optionally ``route_localnet=1``. Pods and external hosts get
the ICMP settings too. In the lan namespace the bridge does not call
netfilter (``bridge-nf-call-*=0``).

Servers (``echo_server.py``) answer each TCP connection / UDP datagram with
``<name> <local_ip> <peer_ip>:<peer_port>``; probes (``echo_client.py``) turn
that into :class:`Reply` objects. See :meth:`Lab.request`.

Cleanup: :meth:`Lab.close` (also via ``with``) kills every process the lab
started and deletes every namespace (which destroys every veth and the
bridge); it is idempotent and also runs when the constructor fails half way.
:func:`cleanup_stale` removes namespaces left by crashed runs; a lab records
its owner process in ``STATE_DIR`` so that labs of a still-running test
session are not touched.
"""

from __future__ import annotations

import atexit
import contextlib
import ipaddress
import json
import os
import re
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Optional

HERE = Path(__file__).resolve().parent
ECHO_SERVER = HERE / "echo_server.py"
ECHO_CLIENT = HERE / "echo_client.py"
PYTHON = [sys.executable or "python3", "-I", "-S"]  # isolated + no site: faster start

CLUSTER_CIDR = "10.244.0.0/16"
SERVICE_CIDR = "10.96.0.0/12"
EXTERNAL_IP_CIDR = "203.0.113.0/24"
LOADBALANCER_CIDR = "198.51.100.0/24"
NODE_NETWORK = "192.168.50.0/24"
NODE_IP = "192.168.50.1"
GATEWAY_IP = "192.168.50.254"
POD_GATEWAY_IP = "169.254.1.1"
EXTERNAL_ROUTES = (SERVICE_CIDR, EXTERNAL_IP_CIDR, LOADBALANCER_CIDR)
# IPv6 (Lab(dual_stack=True)): the same plan, one prefix per role.
CLUSTER_CIDR6 = "fd00:10:244::/48"
SERVICE_CIDR6 = "fd00:10:96::/112"
EXTERNAL_IP_CIDR6 = "2001:db8:203::/64"
LOADBALANCER_CIDR6 = "2001:db8:198::/64"
NODE_NETWORK6 = "fd00:50::/64"
NODE_IP6 = "fd00:50::1"
GATEWAY_IP6 = "fd00:50::fe"
POD_GATEWAY_IP6 = "fe80::1"  # on every node-side pod veth, as Calico does
EXTERNAL_ROUTES6 = (SERVICE_CIDR6, EXTERNAL_IP_CIDR6, LOADBALANCER_CIDR6)
# No duplicate address detection: addresses are usable at once (a tentative link-local
# address would delay a pod's first neighbour solicitation by a second or more).
NO_DAD_SYSCTLS = {"net.ipv6.conf.all.accept_dad": "0", "net.ipv6.conf.default.accept_dad": "0"}
NODE_SYSCTLS6 = {**NO_DAD_SYSCTLS, "net.ipv6.conf.all.forwarding": "1", "net.ipv6.icmp.ratelimit": "0"}
DEFAULT_TCP_PORTS = (8080,)
DEFAULT_UDP_PORTS = (5353,)

STALE_PATTERN = r"^kn[0-9a-f]{6}-"
STATE_DIR = Path(os.environ.get("KN_LAB_STATE_DIR", "/run/kubenode-lab"))
NAME_RE = re.compile(r"^[a-z][a-z0-9-]{0,30}$")
PREFIX_RE = re.compile(r"^[a-z][a-z0-9]{0,7}-$")  # <= 9 chars keeps every ifname <= 15
RESERVED_NAMES = frozenset({"node", "lan"})
MAX_INTERFACES = 9999
SERVER_READY_TIMEOUT = 10.0
COMMAND_TIMEOUT = 30.0
NODE_SYSCTLS = {
    "net.ipv4.ip_forward": "1",
    "net.ipv4.conf.all.send_redirects": "0",
    "net.ipv4.conf.default.send_redirects": "0",
}
ICMP_SYSCTLS = {"net.ipv4.icmp_ratelimit": "0", "net.ipv4.icmp_ratemask": "0"}
HOST_SYSCTLS = {"net.ipv4.conf.all.accept_redirects": "0", "net.ipv4.conf.default.accept_redirects": "0"}
BRIDGE_SYSCTLS = {
    "net.bridge.bridge-nf-call-iptables": "0",
    "net.bridge.bridge-nf-call-ip6tables": "0",
    "net.bridge.bridge-nf-call-arptables": "0",
}

Proto = Literal["tcp", "udp"]
Outcome = Literal["ok", "refused", "unreachable", "timeout", "error"]


class LabError(RuntimeError):
    """A lab command failed; the message carries the command and its stderr."""


@dataclass(frozen=True)
class Reply:
    """Result of one probe. See ``echo_client.py`` for the outcome rules.

    ``outcome``: "ok", "refused" (RST / ICMP port unreachable, i.e. a plain
    ``REJECT``), "unreachable" (ICMP host/net unreachable or prohibited),
    "timeout" (no answer within the timeout; also for packets dropped in the
    client's own OUTPUT chain) or "error".
    ``backend`` is the name of the server that answered, ``seen_client`` the
    client address the server saw (masqueraded or not), ``server_ip`` the
    address the server was reached at (after DNAT).
    """

    outcome: Outcome
    backend: str | None = None
    seen_client: str | None = None
    seen_port: int | None = None
    server_ip: str | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.outcome == "ok"

    @classmethod
    def from_json(cls, line: str) -> Reply:
        data = json.loads(line)
        return cls(
            outcome=data["outcome"],
            backend=data.get("backend"),
            seen_client=data.get("seen_client"),
            seen_port=data.get("seen_port"),
            server_ip=data.get("server_ip"),
            error=data.get("error"),
        )


@dataclass(frozen=True)
class Host:
    """A pod, client pod or external host of the lab."""

    name: str  # short name, as passed to add_pod()/add_external()
    kind: Literal["pod", "external"]
    ns: str  # full namespace name
    ip: str
    peer_interface: str  # node-side veth (pods) or lan bridge port (external hosts)
    ip6: str | None = None  # its IPv6 address (dual-stack labs)


@dataclass
class Server:
    """An ``echo_server.py`` process running inside a namespace."""

    name: str  # the name it reports as ``backend``
    ns: str
    tcp_ports: tuple[int, ...]
    udp_ports: tuple[int, ...]
    process: subprocess.Popen[str] = field(repr=False)
    log: Path

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.poll() is None


def tally(replies: Iterable[Reply]) -> Counter[str]:
    """Count replies by backend name (successful ones) or by outcome (others)."""
    return Counter(r.backend if r.ok and r.backend else r.outcome for r in replies)


# --------------------------------------------------------------------------
# small command helpers


def run(argv: Sequence[str], *, input: str | None = None, check: bool = True,
        timeout: float = COMMAND_TIMEOUT) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` (never through a shell), capturing text output."""
    try:
        proc = subprocess.run(list(argv), input=input, capture_output=True, text=True,
                              timeout=timeout, check=False)
    except subprocess.TimeoutExpired as exc:
        raise LabError(f"timed out after {timeout}s: {' '.join(argv)}") from exc
    if check and proc.returncode != 0:
        raise LabError(f"command failed (rc={proc.returncode}): {' '.join(argv)}\n"
                       f"{proc.stderr.strip()}\n{proc.stdout.strip()}".rstrip())
    return proc


def ip_batch(ns: str, commands: Sequence[Sequence[str]]) -> None:
    """Run several ``ip`` commands inside ``ns`` with a single ``ip -batch``."""
    for command in commands:
        for token in command:
            if not token or any(ch.isspace() for ch in token):
                raise ValueError(f"bad token {token!r} in ip command {command}")
    text = "".join(" ".join(command) + "\n" for command in commands)
    run(["ip", "-n", ns, "-batch", "-"], input=text)


def sysctl(ns: str, settings: dict[str, str], *, ignore_missing: bool = False) -> None:
    """Set sysctls inside ``ns`` (one process for all of them)."""
    flags = ["-e"] if ignore_missing else []
    pairs = [f"{key}={value}" for key, value in settings.items()]
    run(["ip", "netns", "exec", ns, "sysctl", "-q", *flags, "-w", *pairs])


def list_namespaces() -> list[str]:
    """Names of all named network namespaces (``ip netns list``)."""
    out = run(["ip", "netns", "list"]).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def namespace_pids(ns: str) -> list[int]:
    proc = run(["ip", "netns", "pids", ns], check=False)
    return [int(tok) for tok in proc.stdout.split() if tok.isdigit()]


def kill_pids(pids: Iterable[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def delete_namespace(ns: str) -> None:
    """Kill whatever still runs in ``ns``, then delete it (veths go with it)."""
    kill_pids(namespace_pids(ns))
    run(["ip", "netns", "del", ns], check=False)


# --------------------------------------------------------------------------
# ownership markers, used to tell stale labs from live ones


def _start_time(pid: int) -> str | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def _marker(prefix: str) -> Path:
    return STATE_DIR / f"{prefix.rstrip('-')}.owner"


def _write_marker(prefix: str) -> None:
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    _marker(prefix).write_text(f"{os.getpid()} {_start_time(os.getpid())}\n")


def _owner_alive(prefix: str) -> bool:
    try:
        pid_text, start = _marker(prefix).read_text().split()
    except (OSError, ValueError):
        return False
    return _start_time(int(pid_text)) == start


def cleanup_stale(prefix_pattern: str = STALE_PATTERN, *, force: bool = False) -> list[str]:
    """Delete namespaces whose name matches ``prefix_pattern`` and whose lab is gone.

    A namespace belongs to the lab whose prefix is the pattern's match. It is
    left alone while the process that created that lab is still running,
    unless ``force`` is true. Processes still inside a deleted namespace are
    killed. Returns the deleted namespace names.
    """
    pattern = re.compile(prefix_pattern)
    removed: list[str] = []
    for ns in list_namespaces():
        match = pattern.match(ns)
        if not match or (not force and _owner_alive(match.group(0))):
            continue
        delete_namespace(ns)
        removed.append(ns)
    if STATE_DIR.is_dir():
        for marker in STATE_DIR.glob("*.owner"):
            prefix = marker.name.removesuffix(".owner") + "-"
            if pattern.match(prefix) and (force or not _owner_alive(prefix)):
                marker.unlink(missing_ok=True)
    return removed


# --------------------------------------------------------------------------


def new_prefix() -> str:
    return f"kn{secrets.token_hex(3)}-"


def _check_name(name: str) -> None:
    if not NAME_RE.match(name) or name in RESERVED_NAMES:
        raise ValueError(f"invalid lab host name {name!r} (lowercase, <= 31 chars, not node/lan)")


def _check_ip(ip: str, network: str) -> None:
    if ipaddress.ip_address(ip) not in ipaddress.ip_network(network):
        raise ValueError(f"{ip} is not in {network}")


_open_labs: set[Lab] = set()


@atexit.register
def _close_open_labs() -> None:
    for lab in list(_open_labs):
        lab.close()


class Lab:
    """A Kubernetes-node-like topology made of network namespaces.

    Building starts in the constructor (node + lan namespaces); use it as a
    context manager or call :meth:`close`. See the module docstring for the
    topology and addressing plan.

    Args:
        route_localnet: set ``net.ipv4.conf.all.route_localnet=1`` on the node.
        rp_filter: value for ``net.ipv4.conf.{all,default}.rp_filter`` on the node.
        prefix: name prefix (default: random ``kn<6 hex>-``).
    """

    node_ip = NODE_IP
    gateway_ip = GATEWAY_IP
    node_network = NODE_NETWORK
    cluster_cidr = CLUSTER_CIDR
    service_cidr = SERVICE_CIDR

    def __init__(self, *, route_localnet: bool = False, rp_filter: int = 0,
                 prefix: str | None = None, dual_stack: bool = False) -> None:
        self.prefix = prefix or new_prefix()
        self.dual_stack = dual_stack
        self.node_ip6 = NODE_IP6 if dual_stack else None
        if not PREFIX_RE.match(self.prefix):
            raise ValueError(f"invalid prefix {self.prefix!r}")
        self.node_interface = f"{self.prefix}eth0"
        self.pod_interface_prefix = f"{self.prefix}p"  # node-side pod veths: Pp0, Pp1, ...
        self.bridge = f"{self.prefix}br"
        self.hosts: dict[str, Host] = {}
        self.servers: list[Server] = []
        self._processes: list[subprocess.Popen[str]] = []
        self._namespaces: list[str] = []
        self._interfaces = 0
        self._closed = False
        self._workdir = Path(tempfile.mkdtemp(prefix=self.prefix))
        _open_labs.add(self)
        try:
            _write_marker(self.prefix)
            self._build_node(route_localnet=route_localnet, rp_filter=rp_filter)
        except BaseException:
            self.close()
            raise

    # ----------------------------------------------------------- lifecycle

    def __enter__(self) -> Lab:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Lab(prefix={self.prefix!r}, hosts={sorted(self.hosts)})"

    @property
    def namespaces(self) -> list[str]:
        """Full names of every namespace this lab created (and not yet deleted)."""
        return list(self._namespaces)

    def close(self) -> None:
        """Stop every process, delete every namespace (and so every veth). Idempotent."""
        if self._closed:
            return
        self._closed = True
        _open_labs.discard(self)
        self._stop_processes()
        for ns in self._own_namespaces():
            delete_namespace(ns)
        self._namespaces.clear()
        leftovers = [ns for ns in list_namespaces() if ns.startswith(self.prefix)]
        if leftovers:
            warnings.warn(f"lab namespaces could not be deleted: {leftovers}", stacklevel=2)
        _marker(self.prefix).unlink(missing_ok=True)
        shutil.rmtree(self._workdir, ignore_errors=True)

    def _own_namespaces(self) -> list[str]:
        known = list(reversed(self._namespaces))
        return known + [ns for ns in list_namespaces() if ns.startswith(self.prefix) and ns not in known]

    def _stop_processes(self, grace: float = 2.0) -> None:
        for proc in self._processes:
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + grace
        for proc in self._processes:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if proc.stdout:
                proc.stdout.close()

    # --------------------------------------------------------------- naming

    def ns(self, name: str) -> str:
        """Full namespace name for a short name ("node", "lan", a pod or external host)."""
        full = name if name.startswith(self.prefix) else f"{self.prefix}{name}"
        if full not in self._namespaces:
            raise KeyError(f"no namespace {name!r} in {self!r}")
        return full

    def _next_interface(self, kind: str) -> str:
        if self._interfaces >= MAX_INTERFACES:
            raise LabError("too many interfaces in one lab")
        self._interfaces += 1
        return f"{self.prefix}{kind}{self._interfaces}"

    def _add_namespace(self, short: str) -> str:
        full = f"{self.prefix}{short}"
        if full in self._namespaces:
            raise ValueError(f"{short!r} already exists in {self!r}")
        self._namespaces.append(full)  # track first: close() must see half-built state
        run(["ip", "netns", "add", full])
        return full

    # ------------------------------------------------------------- building

    def _build_node(self, *, route_localnet: bool, rp_filter: int) -> None:
        node = self._add_namespace("node")
        lan = self._add_namespace("lan")
        settings = {**NODE_SYSCTLS, **ICMP_SYSCTLS,
                    "net.ipv4.conf.all.rp_filter": str(rp_filter),
                    "net.ipv4.conf.default.rp_filter": str(rp_filter)}
        if route_localnet:
            settings["net.ipv4.conf.all.route_localnet"] = "1"
        if self.dual_stack:
            settings.update(NODE_SYSCTLS6)
            sysctl(lan, NO_DAD_SYSCTLS)
        sysctl(node, settings)
        sysctl(lan, BRIDGE_SYSCTLS, ignore_missing=True)
        uplink_peer = f"{self.prefix}n0"
        ip_batch(lan, [
            ["link", "set", "lo", "up"],
            ["link", "add", self.bridge, "type", "bridge", "stp_state", "0", "forward_delay", "0"],
            ["link", "set", self.bridge, "up"],
            ["addr", "add", f"{GATEWAY_IP}/24", "dev", self.bridge],
        ])
        run(["ip", "-n", node, "link", "add", self.node_interface, "type", "veth",
             "peer", "name", uplink_peer, "netns", lan])
        ip_batch(lan, [["link", "set", uplink_peer, "master", self.bridge, "up"]])
        ip_batch(node, [
            ["link", "set", "lo", "up"],
            ["link", "set", self.node_interface, "up"],
            ["addr", "add", f"{NODE_IP}/24", "dev", self.node_interface],
            ["route", "add", "default", "via", GATEWAY_IP, "dev", self.node_interface],
        ])
        if self.dual_stack:
            ip_batch(lan, [["addr", "add", f"{GATEWAY_IP6}/64", "dev", self.bridge, "nodad"]])
            ip_batch(node, [
                ["addr", "add", f"{NODE_IP6}/64", "dev", self.node_interface, "nodad"],
                ["route", "add", "::/0", "via", GATEWAY_IP6, "dev", self.node_interface],
            ])

    def add_pod(self, name: str, ip: str, serve: bool = True, *,
                tcp_ports: Sequence[int] = DEFAULT_TCP_PORTS,
                udp_ports: Sequence[int] = DEFAULT_UDP_PORTS, ip6: str | None = None) -> Host:
        """Add a pod namespace with address ``ip``/32 (inside 10.244.0.0/16), and ``ip6``/128
        (inside fd00:10:244::/48) in a dual-stack lab.

        With ``serve`` an echo server answering as ``name`` listens on
        ``tcp_ports`` and ``udp_ports`` (0.0.0.0, and :: in a dual-stack lab) before this returns.
        """
        _check_name(name)
        _check_ip(ip, CLUSTER_CIDR)
        if any(h.ip == ip for h in self.hosts.values()):
            raise ValueError(f"{ip} is already used in {self!r}")
        self._check_ip6(ip6, CLUSTER_CIDR6)
        node = self.ns("node")
        pod = self._add_namespace(name)
        veth = self._next_interface("p")
        sysctl(pod, {**ICMP_SYSCTLS, **(NO_DAD_SYSCTLS if ip6 else {})})  # before the link exists
        run(["ip", "-n", node, "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", pod])
        sysctl(node, {f"net.ipv4.conf.{veth}.proxy_arp": "1", f"net.ipv4.neigh.{veth}.proxy_delay": "0"})
        ip_batch(node, [
            ["link", "set", veth, "up"],
            ["route", "add", f"{ip}/32", "dev", veth],
        ])
        ip_batch(pod, [
            ["link", "set", "lo", "up"],
            ["link", "set", "eth0", "up"],
            ["addr", "add", f"{ip}/32", "dev", "eth0"],
            ["route", "add", "default", "via", POD_GATEWAY_IP, "dev", "eth0", "onlink"],
        ])
        if ip6:
            ip_batch(node, [
                ["addr", "add", f"{POD_GATEWAY_IP6}/64", "dev", veth, "nodad"],
                ["route", "add", f"{ip6}/128", "dev", veth],
            ])
            ip_batch(pod, [
                ["addr", "add", f"{ip6}/128", "dev", "eth0", "nodad"],
                ["route", "add", "::/0", "via", POD_GATEWAY_IP6, "dev", "eth0"],
            ])
        host = Host(name=name, kind="pod", ns=pod, ip=ip, peer_interface=veth, ip6=ip6)
        self.hosts[name] = host
        if serve:
            self.start_server(name, tcp_ports=tcp_ports, udp_ports=udp_ports)
        return host

    def add_client(self, name: str, ip: str, ip6: str | None = None) -> Host:
        """An in-cluster client: a pod without a server."""
        return self.add_pod(name, ip, serve=False, ip6=ip6)

    def _check_ip6(self, ip6: str | None, network: str) -> None:
        if ip6 is None:
            return
        if not self.dual_stack:
            raise ValueError(f"{ip6}: IPv6 addresses need Lab(dual_stack=True)")
        _check_ip(ip6, network)
        if any(h.ip6 == ip6 for h in self.hosts.values()) or ip6 in (NODE_IP6, GATEWAY_IP6):
            raise ValueError(f"{ip6} is already used in {self!r}")

    def add_external(self, name: str, ip: str, routes: Sequence[str] | None = None,
                     ip6: str | None = None) -> Host:
        """Add a host on the node network (``ip``/24 inside 192.168.50.0/24).

        ``routes`` (default: service CIDR, external-IP and LB ranges) are
        routed via the node IP. Several external hosts share the lan bridge.
        """
        _check_name(name)
        _check_ip(ip, NODE_NETWORK)
        if ip in (NODE_IP, GATEWAY_IP) or any(h.ip == ip for h in self.hosts.values()):
            raise ValueError(f"{ip} is already used in {self!r}")
        self._check_ip6(ip6, NODE_NETWORK6)
        lan = self.ns("lan")
        ext = self._add_namespace(name)
        port = self._next_interface("x")
        sysctl(ext, {**ICMP_SYSCTLS, **HOST_SYSCTLS, **(NO_DAD_SYSCTLS if ip6 else {})})
        run(["ip", "-n", lan, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ext])
        ip_batch(lan, [["link", "set", port, "master", self.bridge, "up"]])
        commands = [
            ["link", "set", "lo", "up"],
            ["link", "set", "eth0", "up"],
            ["addr", "add", f"{ip}/24", "dev", "eth0"],
        ]
        for prefix in EXTERNAL_ROUTES if routes is None else routes:
            commands.append(["route", "add", str(ipaddress.ip_network(prefix)), "via", NODE_IP, "dev", "eth0"])
        if ip6:
            commands.append(["addr", "add", f"{ip6}/64", "dev", "eth0", "nodad"])
            for prefix in EXTERNAL_ROUTES6:
                commands.append(["route", "add", prefix, "via", NODE_IP6, "dev", "eth0"])
        ip_batch(ext, commands)
        host = Host(name=name, kind="external", ns=ext, ip=ip, peer_interface=port, ip6=ip6)
        self.hosts[name] = host
        return host

    # ------------------------------------------------------------ processes

    def spawn(self, ns: str, argv: Sequence[str], stdout: Optional[Path] = None) -> subprocess.Popen[str]:
        """Start a long-running process in ``ns``; it is killed by :meth:`close`.

        stdout is a pipe (or the file ``stdout``), stderr goes to a log file in the lab's
        work dir.
        """
        return self._spawn(ns, argv, "proc", stdout)[0]

    @property
    def record_dir(self) -> Path:
        """Where daemons run by this lab keep their restart record (``--record-dir``): in the
        lab's work dir, removed with it, so that no test leaves files in /run/kubenode-proxy
        (nor finds one a past lab left under a namespace inode the kernel reused)."""
        return self._workdir / "run"

    def daemon_argv(self, argv: Sequence[str]) -> list[str]:
        """``argv`` with ``--record-dir`` added after ``bin/kubenode-proxy`` when it runs the
        daemon and names no record directory itself."""
        argv = list(argv)
        at = next((i for i, a in enumerate(argv) if str(a).endswith("bin/kubenode-proxy")), None)
        if at is None or any(str(a).startswith("--record-dir") for a in argv):
            return argv
        return [*argv[:at + 1], "--record-dir", str(self.record_dir), *argv[at + 1:]]

    def _spawn(self, ns: str, argv: Sequence[str], log_name: str,
               stdout: Optional[Path] = None) -> tuple[subprocess.Popen[str], Path]:
        argv = self.daemon_argv(argv)
        log = self._workdir / f"{log_name}-{len(self._processes)}.log"
        with log.open("w") as stderr, (stdout.open("w") if stdout else contextlib.nullcontext()) as out:
            proc = subprocess.Popen(["ip", "netns", "exec", self.ns(ns), *argv],
                                    stdin=subprocess.DEVNULL, stdout=out if stdout else subprocess.PIPE,
                                    stderr=stderr, text=True)
        self._processes.append(proc)
        return proc, log

    def start_server(self, ns: str, name: str | None = None, *,
                     tcp_ports: Sequence[int] = DEFAULT_TCP_PORTS,
                     udp_ports: Sequence[int] = DEFAULT_UDP_PORTS,
                     bind: str = "0.0.0.0") -> Server:
        """Run an echo server in ``ns`` reporting as ``name`` (default: ``ns``).

        Returns once every port is listening (bounded wait). Works in any
        lab namespace, e.g. ``"node"`` for host-network style backends.
        """
        label = name or ns
        argv = [*PYTHON, str(ECHO_SERVER), "--name", label, "--bind", bind]
        if self.dual_stack and bind == "0.0.0.0":
            argv += ["--bind6", "::"]
        argv += [arg for port in tcp_ports for arg in ("--tcp", str(port))]
        argv += [arg for port in udp_ports for arg in ("--udp", str(port))]
        proc, log = self._spawn(ns, argv, f"server-{label}")
        server = Server(name=label, ns=self.ns(ns), tcp_ports=tuple(tcp_ports),
                        udp_ports=tuple(udp_ports), process=proc, log=log)
        _wait_ready(server, SERVER_READY_TIMEOUT)
        self.servers.append(server)
        return server

    # ------------------------------------------------------------- commands

    def exec(self, ns: str, argv: Sequence[str], check: bool = True, *,
             input: str | None = None, timeout: float = COMMAND_TIMEOUT) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` inside namespace ``ns`` (short or full name) and wait for it."""
        return run(["ip", "netns", "exec", self.ns(ns), *argv], input=input, check=check, timeout=timeout)

    def iptables_restore(self, rules: str, ns: str = "node", *, noflush: bool = True) -> None:
        """Feed ``rules`` to ``iptables-restore [--noflush]`` inside ``ns``."""
        self.exec(ns, ["iptables-restore", *(["--noflush"] if noflush else [])], input=rules)

    def nft(self, script: str, ns: str = "node") -> None:
        """Feed an nft script to ``nft -f -`` inside ``ns``."""
        self.exec(ns, ["nft", "-f", "-"], input=script)

    def request(self, ns: str, ip: str, port: int, proto: Proto = "tcp", timeout: float = 2.0,
                source_ip: str | None = None) -> Reply:
        """Send one request from namespace ``ns`` to ``ip``:``port`` and classify the result."""
        return self.request_many(ns, ip, port, proto, count=1, timeout=timeout, source_ip=source_ip)[0]

    def request_many(self, ns: str, ip: str, port: int, proto: Proto = "tcp", count: int = 10, *,
                     timeout: float = 2.0, source_ip: str | None = None,
                     concurrency: int = 1) -> list[Reply]:
        """Run ``count`` requests (fresh socket each) in ONE client process.

        With ``concurrency`` > 1 that many requests are in flight at once,
        which keeps probes that time out cheap.
        """
        if proto not in ("tcp", "udp"):
            raise ValueError(f"unknown protocol {proto!r}")
        if count < 1 or concurrency < 1:
            raise ValueError("count and concurrency must be >= 1")
        argv = [*PYTHON, str(ECHO_CLIENT), "--host", ip, "--port", str(port), "--proto", proto,
                "--count", str(count), "--timeout", str(timeout), "--concurrency", str(concurrency)]
        if source_ip:
            argv += ["--source", source_ip]
        rounds = -(-count // concurrency)
        proc = self.exec(ns, argv, timeout=rounds * timeout + 15.0)
        replies = [Reply.from_json(line) for line in proc.stdout.splitlines() if line.strip()]
        if len(replies) != count:
            raise LabError(f"client returned {len(replies)} replies, expected {count}: {proc.stderr}")
        return replies


def _wait_ready(server: Server, timeout: float) -> None:
    """Block until the server printed READY; raise (with its log) otherwise."""
    stdout = server.process.stdout
    assert stdout is not None
    deadline = time.monotonic() + timeout
    with selectors.DefaultSelector() as selector:
        selector.register(stdout, selectors.EVENT_READ)
        while (left := deadline - time.monotonic()) > 0:
            if not selector.select(left):
                continue
            line = stdout.readline()
            if line.strip() == "READY":
                return
            if not line:  # EOF: the server exited
                break
    log = server.log.read_text() if server.log.exists() else ""
    raise LabError(f"echo server {server.name!r} in {server.ns} did not become ready "
                   f"(exit code {server.process.poll()}):\n{log}")
