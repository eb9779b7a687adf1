#!/usr/bin/python
# -*- coding: utf-8 -*-
# Copyright (c) kubenode.proxy contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)

from __future__ import absolute_import, division, print_function

__metaclass__ = type

DOCUMENTATION = r"""
---
module: ipvs_virtual_server
short_description: Manage one IPVS virtual service and its real servers
version_added: 0.1.0
description:
  - Makes one IPVS virtual service (a protocol, address and port, or a firewall mark) exist with
    the given scheduler, flags and persistence, and with the given real servers (O(state=present)),
    or removes it with all its real servers (O(state=absent)). The declarative form of
    C(ipvsadm -A/-E/-D) and C(ipvsadm -a/-e/-d).
  - Talks to the kernel over generic netlink (no C(ipvsadm) binary needed). Other virtual services
    are never touched.
  - Real servers that are not listed are left alone unless O(purge_real_servers=true).
author:
  - kubenode.proxy developers (@kubenode)
extends_documentation_fragment:
  - kubenode.proxy.attributes.platform
attributes:
  check_mode:
    description:
      - Reads the kernel's current service and reports the change, and the service as it would be,
        without applying it.
    support: full
  diff_mode:
    description:
      - Shows the service and its real servers before and after, as C(ipvsadm -Ln) lists them
        (without the connection counters).
    support: full
options:
  state:
    description: Whether the virtual service is present or absent.
    type: str
    choices: [present, absent]
    default: present
  protocol:
    description:
      - Protocol of an address/port service. V(tcp) when not given.
      - Not used with O(fwmark).
    type: str
    choices: [tcp, udp, sctp]
  address:
    description:
      - Virtual IP address (IPv4 or IPv6). Required unless O(fwmark) is given.
    type: str
  port:
    description:
      - Virtual port. Required with O(address). V(0) (any port) needs O(persistence_timeout).
    type: int
  fwmark:
    description:
      - Firewall mark of a fwmark service (C(ipvsadm -f)), instead of O(protocol), O(address) and O(port).
    type: int
  family:
    description:
      - Address family of a fwmark service. Address/port services take it from O(address).
    type: str
    choices: [ipv4, ipv6]
    default: ipv4
  scheduler:
    description:
      - Scheduling algorithm, for example V(rr), V(wrr), V(lc), V(wlc), V(lblc), V(lblcr), V(dh),
        V(sh), V(sed), V(nq), V(mh), V(fo), V(ovf), V(twos). The kernel loads its module C(ip_vs_<name>)
        on demand; a scheduler the kernel does not have fails with an error naming that module.
      - The default is C(ipvsadm)'s.
    type: str
    default: wlc
  scheduler_flags:
    description:
      - Scheduler flags (C(ipvsadm -b)). V(sh-fallback) and V(sh-port) need O(scheduler=sh),
        V(mh-fallback) and V(mh-port) need O(scheduler=mh); V(flag-1), V(flag-2), V(flag-3) are the raw bits.
    type: list
    elements: str
    choices: [flag-1, flag-2, flag-3, sh-fallback, sh-port, mh-fallback, mh-port]
    default: []
  persistence_timeout:
    description:
      - Persistence (session affinity) timeout in seconds (C(ipvsadm -p)). V(0) makes the service not persistent.
    type: int
    default: 0
  persistence_netmask:
    description:
      - Persistence granularity (C(ipvsadm -M)) - clients in one such network go to the same real server.
        For IPv4 a mask like V(255.255.255.0) or a prefix length like V(24); for IPv6 a prefix length.
      - Default is the full mask (V(255.255.255.255), V(128)).
    type: str
  real_servers:
    description:
      - The real servers of the service. With O(purge_real_servers=false), others stay as they are.
    type: list
    elements: dict
    default: []
    suboptions:
      address:
        description: Real server IP address.
        type: str
        required: true
      port:
        description:
          - Real server port. Default is the virtual port (for fwmark services V(0), the port the client
            connected to).
          - With O(real_servers[].forwarding=route) or V(tunnel) it must be the virtual port (the packets
            are not rewritten).
        type: int
      weight:
        description: Weight (C(ipvsadm -w)); V(0) takes no new connections.
        type: int
        default: 1
      forwarding:
        description:
          - Forwarding method. V(masquerade) is NAT (C(ipvsadm -m)), V(route) direct routing (C(-g)),
            V(tunnel) IP-in-IP tunnelling (C(-i)).
          - The default is C(ipvsadm)'s, direct routing. Kubernetes-style setups want V(masquerade).
        type: str
        choices: [masquerade, route, tunnel]
        default: route
      u_threshold:
        description: Upper connection threshold (C(ipvsadm -x)); V(0) means none.
        type: int
        default: 0
      l_threshold:
        description: Lower connection threshold (C(ipvsadm -y)); V(0) means none.
        type: int
        default: 0
  purge_real_servers:
    description:
      - Remove real servers of the service that are not in O(real_servers).
    type: bool
    default: false
  netns:
    description:
      - Network namespace (a name under C(/run/netns)) to work in, instead of the module's own.
    type: str
requirements:
  - Linux with IPVS (C(ip_vs); the module is loaded on first use where the kernel has it)
  - pyroute2, only with O(netns)
notes:
  - Run with root privileges (C(CAP_NET_ADMIN)). IPVS state is per network namespace.
  - Changes are sent in one batch; if the kernel refuses one, the module fails and reports which.
seealso:
  - name: ipvsadm(8)
    description: The command line tool this module's options are named after.
    link: https://man7.org/linux/man-pages/man8/ipvsadm.8.html
"""

EXAMPLES = r"""
- name: A TCP virtual service with two NATed real servers
  kubenode.proxy.ipvs_virtual_server:
    address: 10.96.0.10
    port: 80
    scheduler: rr
    real_servers:
      - {address: 10.244.1.5, port: 8080, forwarding: masquerade}
      - {address: 10.244.2.7, port: 8080, forwarding: masquerade}
    purge_real_servers: true

- name: Source-hashing UDP service with persistence per /24
  kubenode.proxy.ipvs_virtual_server:
    protocol: udp
    address: 10.96.0.53
    port: 53
    scheduler: sh
    scheduler_flags: [sh-port]
    persistence_timeout: 300
    persistence_netmask: 255.255.255.0
    real_servers:
      - {address: 10.244.1.9, forwarding: masquerade}

- name: A firewall-mark service (packets marked 1 by iptables/nftables), direct routing
  kubenode.proxy.ipvs_virtual_server:
    fwmark: 1
    scheduler: wlc
    real_servers:
      - {address: 192.168.10.11}
      - {address: 192.168.10.12, weight: 2}

- name: Remove the service and all its real servers
  kubenode.proxy.ipvs_virtual_server:
    address: 10.96.0.10
    port: 80
    state: absent
"""

RETURN = r"""
service:
  description:
    - The virtual service as the kernel has it after the run (in check mode, as it would have it); empty when absent.
  returned: always
  type: dict
  sample:
    protocol: tcp
    address: 10.96.0.10
    port: 80
    fwmark: null
    family: ipv4
    scheduler: rr
    scheduler_flags: []
    persistence_timeout: 0
    persistence_netmask: 255.255.255.255
    flags: 0
real_servers:
  description:
    - All real servers of the service after the run (also those not managed with O(purge_real_servers=false)),
      sorted, with the kernel's connection counters.
  returned: always
  type: list
  elements: dict
  sample:
    - address: 10.244.1.5
      port: 8080
      weight: 1
      forwarding: masquerade
      u_threshold: 0
      l_threshold: 0
      active_connections: 0
      inactive_connections: 0
      persistent_connections: 0
changes:
  description: The changes made (or, in check mode, to be made), as C(ipvsadm) arguments.
  returned: always
  type: list
  elements: str
  sample: ["-A -t 10.96.0.10:80 -s rr", "-a -t 10.96.0.10:80 -r 10.244.1.5:8080 -m -w 1"]
"""

import traceback

from ansible.module_utils.basic import AnsibleModule, missing_required_lib

try:
    from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.kernel import ipvs
    from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.validation import (
        Fields,
        ValidationError,
        ipvs_scheduler,
        netns_name,
    )
    IMPORT_ERROR = None
except ImportError:  # pragma: no cover - reported by the module
    IMPORT_ERROR = traceback.format_exc()


def pyroute2_error():
    """None if pyroute2 (needed for netns only, so imported only then) imports, else the traceback."""
    try:
        import pyroute2  # noqa: F401  # pylint: disable=unused-import
    except ImportError:
        return traceback.format_exc()
    return None


ARGUMENT_SPEC = dict(
    state=dict(type="str", default="present", choices=["present", "absent"]),
    protocol=dict(type="str", choices=["tcp", "udp", "sctp"]),
    address=dict(type="str"),
    port=dict(type="int"),
    fwmark=dict(type="int"),
    family=dict(type="str", default="ipv4", choices=["ipv4", "ipv6"]),
    scheduler=dict(type="str", default="wlc"),
    scheduler_flags=dict(type="list", elements="str", default=[],
                         choices=["flag-1", "flag-2", "flag-3", "sh-fallback", "sh-port", "mh-fallback", "mh-port"]),
    persistence_timeout=dict(type="int", default=0),
    persistence_netmask=dict(type="str"),
    real_servers=dict(type="list", elements="dict", default=[], options=dict(
        address=dict(type="str", required=True),
        port=dict(type="int"),
        weight=dict(type="int", default=1),
        forwarding=dict(type="str", default="route", choices=["masquerade", "route", "tunnel"]),
        u_threshold=dict(type="int", default=0),
        l_threshold=dict(type="int", default=0),
    )),
    purge_real_servers=dict(type="bool", default=False),
    netns=dict(type="str"),
)


def check_options(params):
    """The API-style checks of validation.py (ValidationError naming the option): strict IP
    syntax (no leading zeros, no IPv4-mapped IPv6, no zone), port ranges, names that end up
    in paths or kernel requests."""
    f = Fields("ipvs_virtual_server")
    if params["address"]:
        f.ip(params["address"], "address")
    if params["port"] is not None:
        f.integer(params["port"], "port", 0, 65535)
    if params["fwmark"] is not None:
        f.integer(params["fwmark"], "fwmark", 0, 0xFFFFFFFF)
    f.named(params.get("scheduler") or "", "scheduler", ipvs_scheduler)
    if params.get("netns"):
        f.named(params["netns"], "netns", netns_name)
    for i, item in enumerate(params["real_servers"] or []):
        f.ip(item.get("address"), "real_servers[%d].address" % i)
        if item.get("port") is not None:
            f.integer(item["port"], "real_servers[%d].port" % i, 0, 65535)


def desired_service(params):
    """The VirtualServer and RealServers the parameters ask for (ValueError if invalid;
    ValidationError, a ValueError, naming the option for what validation.py refuses)."""
    check_options(params)
    fwmark = params["fwmark"] or 0
    if fwmark and (params["address"] or params["port"] is not None or params["protocol"]):
        raise ValueError("fwmark cannot be combined with protocol, address or port")
    if not fwmark and not params["address"]:
        raise ValueError("one of address (with port) or fwmark is required")
    if not fwmark and params["port"] is None:
        raise ValueError("port is required with address")
    if params["persistence_timeout"] < 0:
        raise ValueError("persistence_timeout must not be negative")
    vs = ipvs.virtual_server(
        protocol=params["protocol"] or "tcp", address=params["address"] or "", port=params["port"] or 0,
        fwmark=fwmark, family=params["family"] if fwmark else None, scheduler=params["scheduler"],
        scheduler_flags=params["scheduler_flags"], persistence_timeout=params["persistence_timeout"],
        persistence_netmask=params["persistence_netmask"])
    reals = []
    for item in params["real_servers"]:
        port = item.get("port")
        if port is None:
            port = 0 if fwmark else vs.port
        rs = ipvs.RealServer(address=item["address"], port=port, weight=item.get("weight", 1),
                             forwarding=item.get("forwarding") or "route",
                             u_threshold=item.get("u_threshold") or 0, l_threshold=item.get("l_threshold") or 0)
        reals.append(rs)
    state = ipvs.ServiceState(vs, tuple(reals))
    state.validate()
    return state


def describe(state):
    if state is None:
        return {}, []
    return state.as_dicts()


class IPVSVirtualServer(object):
    def __init__(self, module):
        self.module = module
        self.params = module.params
        self.kernel = ipvs.IPVSKernel(netns=self.params["netns"] or "")

    def fail(self, msg, **extra):
        self.kernel.close()
        self.module.fail_json(msg=msg, **extra)

    def run(self):
        p = self.params
        try:
            desired = desired_service(p)
        except ValidationError as e:
            self.fail(str(e), field=e.path)
        except ValueError as e:
            self.fail(str(e))
        vs = desired.virtual
        present = p["state"] == "present"
        try:
            current = self.kernel.get(vs)
            wanted = [desired] if present else []
            plan = ipvs.plan([current] if current else [], wanted, delete_services=True,
                             purge_real_servers=p["purge_real_servers"])
            if plan.ops and present and self.module.check_mode:
                self.check_scheduler(vs, current)
            if plan.ops and not self.module.check_mode:
                applied = self.kernel.apply(plan.ops)
                if applied.errors:
                    op, error = applied.errors[0]
                    self.fail(str(error), changed=applied.applied > 0, failed_change=str(op),
                              errors=["%s: %s" % (o, e) for o, e in applied.errors],
                              changes=[str(o) for o in plan.ops])
                after = self.kernel.get(vs)
            else:
                after = ipvs.predict(current, plan.ops)
        except ipvs.IPVSError as e:
            self.fail(str(e), errno=e.code)
        finally:
            self.kernel.close()
        service, real_servers = describe(after)
        result = dict(changed=not plan.empty, service=service, real_servers=real_servers,
                      changes=[str(op) for op in plan.ops])
        if self.module._diff:
            header = "ipvs %s" % vs
            result["diff"] = dict(
                before=ipvs.format_service(current, counters=False) if current else "",
                after=ipvs.format_service(after, counters=False) if after else "",
                before_header=header, after_header=header,
            )
        self.module.exit_json(**result)

    def check_scheduler(self, vs, current):
        """In check mode, fail like a real run would for a scheduler the kernel lacks."""
        if current is not None and current.virtual.scheduler == vs.scheduler:
            return
        if ipvs.scheduler_available(vs.scheduler) is False:
            self.fail(str(ipvs.SchedulerUnavailable(vs.scheduler)))


def main():
    module = AnsibleModule(
        argument_spec=ARGUMENT_SPEC,
        mutually_exclusive=[("fwmark", "address"), ("fwmark", "port"), ("fwmark", "protocol")],
        required_one_of=[("address", "fwmark")],
        required_together=[("address", "port")],
        supports_check_mode=True,
    )
    if IMPORT_ERROR:
        module.fail_json(msg="cannot import the kubenode.proxy core", exception=IMPORT_ERROR)
    try:
        check_options(module.params)  # before anything opens a namespace by that name
    except ValidationError as e:
        module.fail_json(msg=str(e), field=e.path)
    if module.params["netns"]:
        error = pyroute2_error()
        if error:
            module.fail_json(msg=missing_required_lib("pyroute2", reason="to use netns"), exception=error)
    IPVSVirtualServer(module).run()


if __name__ == "__main__":
    main()
