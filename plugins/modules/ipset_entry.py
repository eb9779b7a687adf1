#!/usr/bin/python
# -*- coding: utf-8 -*-
# Copyright (c) kubenode.proxy contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)

from __future__ import absolute_import, division, print_function

__metaclass__ = type

DOCUMENTATION = r"""
---
module: ipset_entry
short_description: Manage an ipset and its entries on a host
version_added: 0.1.0
description:
  - Creates an ipset of a given type and keeps entries in it (O(state=present)), removes
    entries (O(state=absent) with O(entries)), or destroys the set (O(state=absent) without
    O(entries)).
  - All changes of one run are written with a single C(ipset restore). With O(exclusive=true)
    the new content is built in a temporary set that is then swapped with the live one, so
    rules using the set (C(-m set --match-set)) see the old entries or the new ones, never a mix.
  - Entries are compared the way the kernel prints them, so C(10.96.0.10,80) and
    C(10.96.0.10,tcp:80), or C(10.0.0.1/32) and C(10.0.0.1) in a C(hash:net) set, are the same entry.
    Ranges and CIDRs that ipset expands (C(tcp:80-82), C(10.0.0.0/30) in C(hash:ip)) are expanded.
author:
  - kubenode.proxy developers (@kubenode)
extends_documentation_fragment:
  - kubenode.proxy.attributes.platform
attributes:
  check_mode:
    description: Reads the sets from the kernel and reports the change without applying it.
    support: full
  diff_mode:
    description: Shows the set's header and its entries (sorted, with comments) before and after.
    support: full
options:
  name:
    description: Name of the set (at most 31 characters).
    type: str
    required: true
  type:
    description:
      - Type of the set. Required with O(state=present).
      - A set that exists with another type or family is not changed in place (the kernel cannot
        swap such sets); the module fails and says so. Remove it with O(state=absent) first.
    type: str
    choices: ['hash:ip', 'hash:ip,port', 'hash:ip,port,ip', 'hash:ip,port,net', 'hash:net', 'bitmap:port']
  entries:
    description:
      - Entries in ipset's own syntax, for example C(10.96.0.10,tcp:80), C(10.96.0.10,udp:53),
        C(10.96.0.10,tcp:80,10.244.1.5), C(10.0.0.0/8) or C(30080).
      - With O(state=present), the entries to have in the set; omitted, the set is only created
        (or, with O(exclusive=true), emptied).
      - With O(state=absent), the entries to remove; omitted, the whole set is destroyed.
    type: list
    elements: str
  state:
    description: Whether the set and O(entries) are present or absent.
    type: str
    choices: [present, absent]
    default: present
  exclusive:
    description:
      - With O(state=present), the set holds exactly O(entries); other entries are removed.
        The new content is applied atomically with an ipset C(swap).
    type: bool
    default: false
  timeout:
    description:
      - Default timeout of the set's entries in seconds (C(0) means entries never expire, but the
        set supports timeouts). A set without timeout support is rebuilt (atomically) to add it.
      - Per-entry remaining timeouts are never compared.
    type: int
  comment:
    description:
      - Create the set with comment support and give O(entries) this comment. An entry that is
        present with another comment gets this one.
    type: str
  family:
    description: Address family of a hash set.
    type: str
    choices: [inet, inet6]
    default: inet
  hashsize:
    description:
      - Initial hash size of a hash set (used when the set is created; the kernel grows it as needed,
        so it is never compared).
    type: int
  maxelem:
    description: Maximal number of entries of a hash set. A different value rebuilds the set atomically.
    type: int
  range:
    description: Port range of a C(bitmap:port) set, for example C(0-65535). Required with O(type=bitmap:port).
    type: str
requirements:
  - ipset (the command line tool) on the managed host, and kernel support for the set type
notes:
  - Run with root privileges. Sets are per network namespace.
"""

EXAMPLES = r"""
- name: Cluster IPs and ports, as kube-proxy's IPVS mode keeps them
  kubenode.proxy.ipset_entry:
    name: KUBE-CLUSTER-IP
    type: hash:ip,port
    entries:
      - 10.96.0.10,tcp:53
      - 10.96.0.10,udp:53
      - 10.96.0.1,tcp:443

- name: Exactly these node ports (the set is swapped in atomically)
  kubenode.proxy.ipset_entry:
    name: KUBE-NODE-PORT-TCP
    type: bitmap:port
    range: 0-65535
    entries:
      - "30080"
      - "30443"
    exclusive: true

- name: Blocked sources, expiring after an hour, with a comment
  kubenode.proxy.ipset_entry:
    name: blocked
    type: hash:net
    timeout: 3600
    comment: added by ansible
    entries:
      - 192.0.2.0/24
      - 198.51.100.7

- name: Remove one entry
  kubenode.proxy.ipset_entry:
    name: KUBE-CLUSTER-IP
    entries:
      - 10.96.0.1,tcp:443
    state: absent

- name: Destroy the set (fails while a rule still uses it)
  kubenode.proxy.ipset_entry:
    name: blocked
    state: absent
"""

RETURN = r"""
added:
  description: Entries added (as the kernel prints them).
  returned: always
  type: list
  elements: str
  sample: ["10.96.0.10,tcp:53"]
removed:
  description: Entries removed (all of them when the set was destroyed).
  returned: always
  type: list
  elements: str
  sample: ["10.96.0.1,tcp:443"]
updated:
  description: Entries that were present with another comment and were given O(comment).
  returned: always
  type: list
  elements: str
  sample: ["10.96.0.10,udp:53"]
entries:
  description: The set's entries after the run, sorted (empty when the set does not exist).
  returned: always
  type: list
  elements: str
  sample: ["10.96.0.10,tcp:53", "10.96.0.10,udp:53"]
action:
  description: What happened to the set as a whole.
  returned: always
  type: str
  choices: [create, update, swap, destroy, none]
  sample: update
restore_input:
  description: The C(ipset restore) input that was (or in check mode would be) applied.
  returned: always
  type: str
  sample: "add KUBE-CLUSTER-IP 10.96.0.10,tcp:53 -exist\n"
"""

import traceback

from ansible.module_utils.basic import AnsibleModule

try:
    from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.kernel import text
    from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.kernel.ipset import (
        MAX_TIMEOUT,
        MISSING_TOOL,
        EntryError,
        IPSet,
        IpsetError,
        IpsetKernel,
        check_range,
        entries_of,
        entry_sort_key,
        plan,
    )
    IMPORT_ERROR = None
except ImportError:  # pragma: no cover - reported by the module
    IMPORT_ERROR = traceback.format_exc()


def desired_set(p):
    """The IPSet the parameters ask for (entries not yet normalised)."""
    comment = p["comment"]
    s = IPSet(p["name"], p["type"], entries=entries_of(p["entries"] or [], comment=comment),
              comment=comment is not None, timeout=p["timeout"], maxelem=p["maxelem"],
              hashsize=p["hashsize"], range=p["range"])
    if s.is_hash:
        s.family = p["family"]
    return s


class IpsetEntry(object):
    def __init__(self, module, kernel=None):
        self.module = module
        self.params = module.params
        self.kernel = kernel

    def _check_text(self):
        """Every option that reaches the ``ipset restore`` input is one token of it
        (kernel/text.py): a newline in ``range`` must not become a second command."""
        p = self.params
        try:
            text.ipset_name(p["name"], "name")
            if p["range"] is not None:
                check_range(p["range"], "range")
            if p["timeout"] is not None:
                text.number(p["timeout"], "timeout", 0, MAX_TIMEOUT)
            if p["hashsize"] is not None:
                text.number(p["hashsize"], "hashsize", 1, 1 << 31)
            if p["maxelem"] is not None:
                text.number(p["maxelem"], "maxelem", 1, (1 << 32) - 1)
            if p["comment"] is not None:
                text.ipset_comment(p["comment"], "comment")
            for i, entry in enumerate(p["entries"] or []):
                text.ipset_token(entry.strip() if isinstance(entry, str) else entry, "entries[%d]" % i)
        except text.UnsafeText as e:
            self.module.fail_json(msg=str(e), option=e.field)

    def _check(self):
        self._check_text()
        p = self.params
        if p["state"] != "present":
            return
        if not p["type"]:
            self.module.fail_json(msg="type is required with state=present")
        if p["type"] == "bitmap:port" and not p["range"]:
            self.module.fail_json(msg="range is required with type=bitmap:port (for example 0-65535)")
        if p["type"] != "bitmap:port" and p["range"]:
            self.module.fail_json(msg="range applies to type=bitmap:port only")
        if p["type"] == "bitmap:port" and (p["hashsize"] is not None or p["maxelem"] is not None):
            self.module.fail_json(msg="hashsize and maxelem apply to hash types only")

    def plan(self, current):
        p = self.params
        name = p["name"]
        if p["state"] == "present":
            return plan(current, [desired_set(p)], exclusive=p["exclusive"], atomic=p["exclusive"])
        if p["entries"] is None:
            return plan(current, destroy=[name])
        return plan(current, remove={name: p["entries"]})

    def run(self):
        self._check()
        p = self.params
        name = p["name"]
        if self.kernel is None:
            binary = self.module.get_bin_path("ipset")
            if not binary:
                self.module.fail_json(msg=MISSING_TOOL)
            self.kernel = IpsetKernel(binary=binary)
        try:
            current = self.kernel.current([name])
            pl = self.plan(current)
            if not pl.empty and not self.module.check_mode:
                self.kernel.restore(pl.lines)
        except EntryError as e:
            self.module.fail_json(msg=str(e), entry=e.entry)
        except IpsetError as e:
            self.module.fail_json(msg=str(e))
        change = pl.sets[name]
        after = change.after if change.action != "destroy" else None
        before = current.get(name)
        result = dict(
            changed=change.changed,
            action=change.action if change.changed else "none",
            added=list(change.added),
            removed=list(change.removed),
            updated=list(change.updated),
            entries=sorted(after.entries, key=entry_sort_key) if after is not None else [],
            restore_input=pl.text(),
        )
        if self.module._diff:
            result["diff"] = dict(
                before_header="ipset %s" % name, after_header="ipset %s" % name,
                before=before.text() if before is not None else "",
                after=after.text() if after is not None else "",
            )
        self.module.exit_json(**result)


def main():
    module = AnsibleModule(
        argument_spec=dict(
            name=dict(type="str", required=True),
            type=dict(type="str", choices=["hash:ip", "hash:ip,port", "hash:ip,port,ip", "hash:ip,port,net",
                                           "hash:net", "bitmap:port"]),
            entries=dict(type="list", elements="str"),
            state=dict(type="str", default="present", choices=["present", "absent"]),
            exclusive=dict(type="bool", default=False),
            timeout=dict(type="int"),
            comment=dict(type="str"),
            family=dict(type="str", default="inet", choices=["inet", "inet6"]),
            hashsize=dict(type="int"),
            maxelem=dict(type="int"),
            range=dict(type="str"),
        ),
        supports_check_mode=True,
    )
    if IMPORT_ERROR:
        module.fail_json(msg="cannot import the kubenode.proxy core", exception=IMPORT_ERROR)
    IpsetEntry(module).run()


if __name__ == "__main__":
    main()
