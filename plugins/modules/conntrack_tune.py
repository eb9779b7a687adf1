#!/usr/bin/python
# -*- coding: utf-8 -*-
# Copyright (c) kubenode.proxy contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)

from __future__ import absolute_import, division, print_function

__metaclass__ = type

DOCUMENTATION = r"""
---
module: conntrack_tune
short_description: Tune the kernel's connection tracking for a Kubernetes service proxy, and delete entries
version_added: 0.1.0
description:
  - Sets what kube-proxy sets at start-up from the C(conntrack) section of its configuration
    (C(maxPerCore), C(min), C(tcpEstablishedTimeout), C(tcpCloseWaitTimeout), C(tcpBeLiberal),
    C(udpTimeout), C(udpStreamTimeout)), with the same rules, in the running kernel (O(apply_live)) and in
    files that apply them at boot (O(persist)).
  - Only the options that are given are managed; an option left out (or C(0) where noted, as upstream)
    leaves the kernel's value alone.
  - The hash table size follows upstream's rule unless O(hashsize) is given - when nf_conntrack_max is
    managed, the table is raised to a quarter of it if smaller, and never lowered.
  - Deletes conntrack entries matching filters (O(delete)) over netlink, in batches.
  - B(Per network namespace) are the timeouts and C(nf_conntrack_tcp_be_liberal). B(Global) (one value
    for the host, writable only from the initial network namespace) are C(nf_conntrack_max) and the hash
    table size. Global keys that need a change but cannot be written here make the module fail, naming
    them, before anything is changed; with O(skip_readonly=true) they are listed in RV(skipped) instead.
    A key that already has the wanted value is never written, so setting the host's current value from
    inside a namespace works.
  - Runs in the network namespace of the Python interpreter Ansible starts; to tune a namespace, run the
    interpreter in it (for example an interpreter wrapper doing C(ip netns exec NAME python3 "$@")).
author:
  - kubenode.proxy developers (@kubenode)
extends_documentation_fragment:
  - kubenode.proxy.attributes.platform
attributes:
  check_mode:
    description: Reads the live values, the files and the conntrack table and reports what would change
      (and how many entries would be deleted) without changing anything.
    support: full
  diff_mode:
    description: Shows the managed keys as C(key = value) lines before and after, and the contents of
      the sysctl.d and modprobe.d files before and after.
    support: full
options:
  max:
    description:
      - C(net.netfilter.nf_conntrack_max), the maximum number of tracked connections (global).
      - C(0) leaves it alone. Mutually exclusive with O(max_per_core).
    type: int
  max_per_core:
    description:
      - Upstream's rule (C(conntrack.maxPerCore)) - C(nf_conntrack_max = max(max_per_core * CPUs, min)),
        with the number of online CPUs of the managed host. C(0) leaves it alone.
      - Upstream's defaults are C(max_per_core=32768) and C(min=131072).
    type: int
  min:
    description: Floor for the computed nf_conntrack_max (C(conntrack.min)); only with O(max_per_core).
    type: int
  hashsize:
    description:
      - Size of the conntrack hash table (number of buckets; the C(nf_conntrack) module parameter
        C(hashsize), global). Set live through C(/sys/module/nf_conntrack/parameters/hashsize) and
        persisted as C(options nf_conntrack hashsize=N) in O(modprobe_file).
      - Not given - upstream's rule; when nf_conntrack_max is managed and the live size is smaller than a
        quarter of it, it is raised to that (never lowered). C(0) - never touch the hash table size.
        C(N) - exactly N (may lower it).
      - The kernel rounds the size up to whole pages of buckets (a multiple of 512 on x86-64); the module
        rounds the same way, so the value it sets and compares is the one the kernel will report.
    type: int
  tcp_timeout_established:
    description:
      - C(net.netfilter.nf_conntrack_tcp_timeout_established) (C(conntrack.tcpEstablishedTimeout);
        upstream's default is 24h).
      - Seconds (C(86400)) or a duration as upstream writes them (C(24h0m0s), C(1h), C(90s)); whole
        seconds only. C(0) leaves it alone, as upstream.
    type: raw
  tcp_timeout_close_wait:
    description:
      - C(net.netfilter.nf_conntrack_tcp_timeout_close_wait) (C(conntrack.tcpCloseWaitTimeout); upstream's
        default is 1h). Seconds or a duration, as O(tcp_timeout_established).
    type: raw
  tcp_be_liberal:
    description:
      - C(net.netfilter.nf_conntrack_tcp_be_liberal) (C(conntrack.tcpBeLiberal)). V(true) sets C(1), V(false)
        sets C(0) (upstream only ever sets C(1)); not given leaves it alone.
    type: bool
  udp_timeout:
    description:
      - C(net.netfilter.nf_conntrack_udp_timeout) (C(conntrack.udpTimeout)). Seconds or a duration.
    type: raw
  udp_timeout_stream:
    description:
      - C(net.netfilter.nf_conntrack_udp_timeout_stream) (C(conntrack.udpStreamTimeout)). Seconds or a
        duration.
    type: raw
  apply_live:
    description: Set the values in the running kernel (needs the C(nf_conntrack) kernel module loaded).
    type: bool
    default: true
  persist:
    description:
      - Write the managed sysctls to O(sysctl_file) and the hash table size (when one is set) to
        O(modprobe_file), so that they apply at boot. Files are mode C(0644), written atomically and
        only when their content differs. A file with nothing to hold is left alone.
      - The module owns these files; their whole content is replaced.
      - Global keys are persisted even when they are skipped live (the files apply on the host at boot).
    type: bool
    default: true
  sysctl_file:
    description: The sysctl.d file O(persist) writes.
    type: path
    default: /etc/sysctl.d/90-kubenode-conntrack.conf
  modprobe_file:
    description: The modprobe.d file O(persist) writes the hash table size to.
    type: path
    default: /etc/modprobe.d/kubenode-nf_conntrack.conf
  skip_readonly:
    description:
      - V(false) - fail, naming the keys, when a key that needs a change cannot be written here (the global
        keys outside the initial network namespace, or a read-only C(/proc/sys) or C(/sys)); nothing is
        changed then.
      - V(true) - leave such keys alone, list them in RV(skipped) and go on.
    type: bool
    default: false
  delete:
    description:
      - Delete the conntrack entries (TCP, UDP and SCTP, IPv4 and IPv6) that match any of these filters;
        all fields given in one filter must match. Each filter needs at least one field.
      - For example the entries of a UDP service whose endpoint went away, so that the next datagram is
        NATed afresh. The table is dumped once (per protocol and family); entries are deleted in batches,
        each by its exact tuple and id. In check mode they are only counted.
      - Needs the Python library pyroute2 on the managed host.
    type: list
    elements: dict
    suboptions:
      protocol:
        description: Protocol of the entry.
        type: str
        choices: [tcp, udp, sctp]
      orig_src:
        description: Source address of the original direction (the client).
        type: str
      orig_src_port:
        description: Source port of the original direction.
        type: int
      orig_dst:
        description: Destination address of the original direction (for example the service IP).
        type: str
      orig_dst_port:
        description: Destination port of the original direction (for example the service port or nodePort).
        type: int
      reply_src:
        description: Source address of the reply direction (the DNAT target, i.e. the endpoint).
        type: str
      reply_src_port:
        description: Source port of the reply direction (the endpoint's port).
        type: int
requirements:
  - pyroute2 (Python library on the managed host), only for O(delete)
notes:
  - Run with root privileges.
  - C(systemd-sysctl) applies C(net.netfilter.*) keys only if C(nf_conntrack) is loaded by then; load it
    early (C(/etc/modules-load.d/)). If C(nf_conntrack) is built into the kernel, O(modprobe_file) has no
    effect; use the kernel command line C(nf_conntrack.hashsize=N).
  - Loading the C(nf_conntrack) kernel module is left to M(community.general.modprobe); this module
    reports clearly when it is not loaded.
seealso:
  - name: kube-proxy configuration (v1alpha1)
    description: The C(conntrack) section of KubeProxyConfiguration.
    link: https://kubernetes.io/docs/reference/config-api/kube-proxy-config.v1alpha1/
  - module: community.general.modprobe
"""

EXAMPLES = r"""
- name: What kube-proxy sets by default, live and at boot
  kubenode.proxy.conntrack_tune:
    max_per_core: 32768
    min: 131072
    tcp_timeout_established: 24h0m0s
    tcp_timeout_close_wait: 1h0m0s

- name: A fixed table size and hash size, no files
  kubenode.proxy.conntrack_tune:
    max: 1048576
    hashsize: 262144
    persist: false

- name: Inside a container's network namespace, set what can be set there
  kubenode.proxy.conntrack_tune:
    max_per_core: 32768
    min: 131072
    tcp_timeout_established: 86400
    udp_timeout: 30
    skip_readonly: true
    persist: false
  register: tune

- name: Forget the UDP flows of a DNS service that went to an endpoint that is gone
  kubenode.proxy.conntrack_tune:
    delete:
      - protocol: udp
        orig_dst: 10.96.0.10
        orig_dst_port: 53
        reply_src: 10.244.1.5
    persist: false
"""

RETURN = r"""
values:
  description:
    - The live values after the run (in check mode, what they would be), by sysctl name, and the hash table
      size as C(nf_conntrack.hashsize). A key that does not exist (nf_conntrack not loaded) is C(null).
  returned: always
  type: dict
  sample:
    net.netfilter.nf_conntrack_max: 262144
    net.netfilter.nf_conntrack_tcp_timeout_established: 86400
    net.netfilter.nf_conntrack_tcp_timeout_close_wait: 3600
    net.netfilter.nf_conntrack_tcp_be_liberal: 0
    net.netfilter.nf_conntrack_udp_timeout: 30
    net.netfilter.nf_conntrack_udp_timeout_stream: 120
    nf_conntrack.hashsize: 65536
previous:
  description: The live values before the run, as RV(values).
  returned: always
  type: dict
  sample: {"net.netfilter.nf_conntrack_max": 131072, "net.netfilter.nf_conntrack_tcp_timeout_established": 432000}
wanted:
  description: The values the options ask for (with nf_conntrack_max computed, and the hash table size
    if one is to be set), by the same names as RV(values).
  returned: always
  type: dict
  sample: {"net.netfilter.nf_conntrack_max": 262144, "nf_conntrack.hashsize": 65536}
cpus:
  description: The number of CPUs used for O(max_per_core).
  returned: when O(max_per_core) is given
  type: int
  sample: 8
skipped:
  description: Keys that needed a change but could not be written here (only with O(skip_readonly=true)).
  returned: always
  type: list
  elements: dict
  sample:
    - key: net.netfilter.nf_conntrack_max
      current: 131072
      wanted: 262144
      reason: /proc/sys/net/netfilter/nf_conntrack_max is not writable here (is /proc/sys mounted read-only?)
  contains:
    key:
      description: The sysctl name (or C(nf_conntrack.hashsize)).
      type: str
      sample: net.netfilter.nf_conntrack_max
    current:
      description: Its live value.
      type: int
      sample: 131072
    wanted:
      description: The value that was not set.
      type: int
      sample: 262144
    reason:
      description: Why it cannot be written (for example, global and not the initial network namespace).
      type: str
      sample: /proc/sys/net/netfilter/nf_conntrack_max is not writable here (is /proc/sys mounted read-only?)
deleted:
  description: Number of conntrack entries deleted (in check mode, that would be deleted).
  returned: always
  type: int
  sample: 3
files:
  description: The files written (in check mode, that would be written).
  returned: always
  type: list
  elements: str
  sample: [/etc/sysctl.d/90-kubenode-conntrack.conf]
"""

import os
import tempfile
import traceback

from ansible.module_utils.basic import AnsibleModule, missing_required_lib

try:
    from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.kernel import conntrack_tune as tune
    from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.kernel.conntrack import (
        ConntrackError,
        ConntrackUnavailable,
    )
    from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.kernel.sysctl import (
        ReadOnlyError,
        SysctlError,
    )
    IMPORT_ERROR = None
except ImportError:  # pragma: no cover - reported by the module
    IMPORT_ERROR = traceback.format_exc()

FILE_MODE = 0o644
LIVE_HEADER = "live values"


class ConntrackTune(object):
    def __init__(self, module, live=None, cpus=None):
        self.module = module
        self.params = module.params
        self.live = live or tune.LiveConntrack()
        self.cpus = cpus if cpus is not None else (os.cpu_count() or 0)
        self.changed = False
        self.diff = []
        self.files = []
        self.skipped = []

    def fail(self, msg, **extra):
        self.module.fail_json(msg=msg, changed=self.changed, **extra)

    # ------------------------------------------------------------ the plan

    def _filters(self):
        filters = []
        for i, params in enumerate(self.params["delete"] or []):
            filters.append(tune.FlowFilter.from_params(params, "delete[%d]" % i))
        return filters

    def _wanted(self, previous):
        wanted = tune.wanted_sysctls(self.params, self.cpus)
        hashsize = tune.hashsize_target(self.params["hashsize"], wanted.get(tune.MAX_KEY),
                                        previous.get(tune.HASHSIZE_KEY), tune.hashsize_granularity())
        if hashsize is not None:
            wanted[tune.HASHSIZE_KEY] = hashsize
        return wanted

    def _read(self):
        try:
            return self.live.read()
        except SysctlError as e:
            self.fail(str(e))

    # ------------------------------------------------------------ live values

    def _apply_live(self, wanted, previous):
        """Returns the values after (predicted in check mode)."""
        changes = tune.plan_changes(wanted, previous)
        missing = [c.key for c in changes if c.before is None]
        if missing:
            self.fail("%s does not exist in this kernel (%s)" % (", ".join(missing), self.live.path(missing[0])))
        blocked = {}
        for change in changes:
            reason = self.live.readonly_reason(change.key)
            if reason:
                blocked[change.key] = reason
        if blocked and not self.params["skip_readonly"]:
            self.fail(self._readonly_message(changes, blocked, self.params["hashsize"] is None),
                      previous=previous, wanted=wanted)
        after = dict(previous)
        for change in changes:
            if change.key in blocked:
                self._skip(change, blocked[change.key])
                continue
            if not self.module.check_mode:
                try:
                    self.live.write(change.key, change.after)
                except ReadOnlyError as e:
                    if not self.params["skip_readonly"]:
                        self.fail(self._readonly_message([change], {change.key: e.reason},
                                                         self.params["hashsize"] is None), previous=previous)
                    self._skip(change, e.reason)
                    continue
                except SysctlError as e:
                    self.fail("cannot set %s to %s: %s" % (change.key, change.after, e), previous=previous)
            after[change.key] = change.after
            self.changed = True
        if not self.module.check_mode and changes:
            after = self._read()
            for key, value in sorted(wanted.items()):
                skipped = any(s["key"] == key for s in self.skipped)
                if not skipped and after.get(key) != value:
                    self.module.warn("%s: set to %s, but the kernel reports %s" % (key, value, after.get(key)))
        return after

    def _skip(self, change, reason):
        self.skipped.append(dict(key=change.key, current=change.before, wanted=change.after, reason=reason))

    @staticmethod
    def _readonly_message(changes, blocked, implicit_hashsize=False):
        """'cannot set read-only keys: A (have 1, want 2), B (...): reason; C (...): other reason'."""
        by_reason = {}
        for change in changes:
            if change.key in blocked:
                why = ""
                if change.key == tune.HASHSIZE_KEY and implicit_hashsize:
                    why = " = nf_conntrack_max/4 by upstream's rule; hashsize=0 leaves it alone"
                by_reason.setdefault(blocked[change.key], []).append(
                    "%s (have %s, want %s%s)" % (change.key, change.before, change.after, why))
        parts = ["%s: %s" % (", ".join(keys), reason) for reason, keys in by_reason.items()]
        count = sum(len(keys) for keys in by_reason.values())
        return "cannot set read-only key%s: %s" % ("s" if count > 1 else "", "; ".join(parts))

    # ------------------------------------------------------------ files

    def _ensure_file(self, path, content):
        try:
            with open(path, encoding="utf-8", errors="replace") as fh:
                before = fh.read()
            mode = os.stat(path).st_mode & 0o7777
        except FileNotFoundError:
            before, mode = None, None
        except OSError as e:
            self.fail("cannot read %s: %s" % (path, e))
        if before == content and mode == FILE_MODE:
            return
        self.changed = True
        self.files.append(path)
        self.diff.append(dict(before_header=path, after_header=path, before=before or "", after=content))
        if self.module.check_mode:
            return
        try:
            if before == content:
                os.chmod(path, FILE_MODE)
            else:
                self._write_atomically(path, content)
        except OSError as e:
            self.fail("cannot write %s: %s" % (path, e))

    def _write_atomically(self, path, content):
        directory = os.path.dirname(path) or "."
        if not os.path.isdir(directory):
            os.makedirs(directory, 0o755)
        fd, tmp = tempfile.mkstemp(prefix=".%s." % os.path.basename(path), dir=directory)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                fh.write(content)
            os.chmod(tmp, FILE_MODE)
            self.module.atomic_move(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        os.chmod(path, FILE_MODE)

    def _persist(self, wanted):
        sysctls = dict((k, v) for k, v in wanted.items() if k != tune.HASHSIZE_KEY)
        if sysctls:
            self._ensure_file(self.params["sysctl_file"], tune.render_sysctl_file(sysctls))
        if tune.HASHSIZE_KEY in wanted:
            self._ensure_file(self.params["modprobe_file"], tune.render_modprobe_file(wanted[tune.HASHSIZE_KEY]))

    # ------------------------------------------------------------ entries

    def _delete(self, filters):
        try:
            flows = tune.find_flows(filters)
            if self.module.check_mode:
                deleted = len(flows)
            else:
                result = tune.delete_flows(flows)
                if result.errors:
                    self.changed = self.changed or result.deleted > 0
                    self.fail("%d of %d conntrack deletes failed; first: %s" % (
                        len(result.errors), len(flows), result.errors[0]), deleted=result.deleted)
                deleted = result.deleted
        except ConntrackUnavailable:
            self.fail(missing_required_lib("pyroute2"), exception=traceback.format_exc())
        except ConntrackError as e:
            self.fail(str(e))
        if deleted:
            self.changed = True
        return deleted

    # ------------------------------------------------------------ run

    def run(self):
        p = self.params
        try:
            filters = self._filters()
            tune.wanted_sysctls(p, self.cpus)  # validate before reading anything
        except tune.TuneError as e:
            self.fail(str(e))
        loaded = self.live.loaded()
        previous = self._read() if loaded else dict((k, None) for k in tune.ALL_KEYS)
        try:
            wanted = self._wanted(previous)
        except tune.TuneError as e:
            self.fail(str(e))
        values = dict(previous)
        if p["apply_live"] and wanted:
            if not loaded:
                self.fail(self.live.not_loaded_message())
            values = self._apply_live(wanted, previous)
            keys = [k for k in tune.ALL_KEYS if k in wanted]
            self.diff.insert(0, dict(before_header=LIVE_HEADER, after_header=LIVE_HEADER,
                                     before=tune.render_values(previous, keys), after=tune.render_values(values, keys)))
        if p["persist"]:
            self._persist(wanted)
        deleted = self._delete(filters) if filters else 0
        result = dict(changed=self.changed, values=values, previous=previous, wanted=wanted,
                      skipped=self.skipped, deleted=deleted, files=self.files)
        if p["max_per_core"] is not None:
            result["cpus"] = self.cpus
        if self.module._diff:
            result["diff"] = self.diff
        self.module.exit_json(**result)


def main():
    module = AnsibleModule(
        argument_spec=dict(
            max=dict(type="int"),
            max_per_core=dict(type="int"),
            min=dict(type="int"),
            hashsize=dict(type="int"),
            tcp_timeout_established=dict(type="raw"),
            tcp_timeout_close_wait=dict(type="raw"),
            tcp_be_liberal=dict(type="bool"),
            udp_timeout=dict(type="raw"),
            udp_timeout_stream=dict(type="raw"),
            apply_live=dict(type="bool", default=True),
            persist=dict(type="bool", default=True),
            sysctl_file=dict(type="path", default="/etc/sysctl.d/90-kubenode-conntrack.conf"),
            modprobe_file=dict(type="path", default="/etc/modprobe.d/kubenode-nf_conntrack.conf"),
            skip_readonly=dict(type="bool", default=False),
            delete=dict(type="list", elements="dict", options=dict(
                protocol=dict(type="str", choices=["tcp", "udp", "sctp"]),
                orig_src=dict(type="str"),
                orig_src_port=dict(type="int"),
                orig_dst=dict(type="str"),
                orig_dst_port=dict(type="int"),
                reply_src=dict(type="str"),
                reply_src_port=dict(type="int"),
            )),
        ),
        mutually_exclusive=[("max", "max_per_core")],
        required_by={"min": "max_per_core"},
        supports_check_mode=True,
    )
    if IMPORT_ERROR:
        module.fail_json(msg="cannot import the kubenode.proxy core", exception=IMPORT_ERROR)
    ConntrackTune(module).run()


if __name__ == "__main__":
    main()
