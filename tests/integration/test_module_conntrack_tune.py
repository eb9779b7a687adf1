"""conntrack_tune through ansible-playbook, with the module's Python running INSIDE the lab's
node namespace (an interpreter wrapper): per-namespace sysctls set live and read back from
/proc in that namespace, idempotence, check mode, diff, persistence files under tmp_path, the
global keys refused with a clear message, and `delete` removing real UDP conntrack entries.

The host's own (initial namespace) values are never written: the module runs in a child
namespace, files go to tmp_path, and every test checks afterwards that the host's values
are what they were.
"""
from __future__ import annotations

import stat
import sys

import pytest
from playbook import python_in, run_tasks

from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.kernel import conntrack_tune as tune
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.kernel.conntrack import list_flows
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.kernel.sysctl import parse_sysctl_conf

MAX = tune.MAX_KEY
EST = tune.KEYS["tcp_timeout_established"]
CW = tune.KEYS["tcp_timeout_close_wait"]
LIB = tune.KEYS["tcp_be_liberal"]
UDP = tune.KEYS["udp_timeout"]
UDPS = tune.KEYS["udp_timeout_stream"]
HS = tune.HASHSIZE_KEY
PER_NS = (EST, CW, LIB, UDP, UDPS)

SVC = "10.96.0.53"
OTHER_SVC = "10.96.0.54"
BE1, BE2 = "10.244.1.1", "10.244.1.2"
CLIENT_IP = "10.244.2.10"
DNS_PORT = 5353  # the echo servers' UDP port
CHAIN = "KN-CT-TUNE"

# One datagram from a fixed source port (so every send is the same conntrack entry);
# prints the answering backend's name or "timeout".
SEND_ONE = r"""
import socket, sys
dst, port, sport = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", sport))
s.settimeout(2.0)
s.sendto(b"ping", (dst, port))
try:
    print(s.recvfrom(4096)[0].decode().split()[0])
except socket.timeout:
    print("timeout")
"""


def host_values() -> dict:
    """The host's (this test process's, initial namespace) conntrack values."""
    return tune.LiveConntrack().read()


@pytest.fixture
def node(lab, tmp_path):
    """The node namespace with an interpreter wrapper, two UDP backends, a client, and a DNAT
    chain hooked into PREROUTING (its existence makes the namespace track connections)."""
    host_before = host_values()
    assert host_before[MAX] is not None, "nf_conntrack is not available on this kernel"
    lab.add_pod("be1", BE1)
    lab.add_pod("be2", BE2)
    lab.add_client("client", CLIENT_IP)
    lab.iptables_restore(f"*nat\n:{CHAIN} - [0:0]\n-A PREROUTING -j {CHAIN}\nCOMMIT\n")
    lab.wrapper = python_in(lab, "node", tmp_path)  # Ansible runs the module inside the node
    lab.tmp = tmp_path
    lab.files = dict(sysctl_file=str(tmp_path / "etc/sysctl.d/90-kubenode-conntrack.conf"),
                     modprobe_file=str(tmp_path / "etc/modprobe.d/kubenode-nf_conntrack.conf"))
    yield lab
    assert host_values() == host_before, "the host's own conntrack settings changed"


def play(lab, tasks, *flags):
    """Run conntrack_tune once per task (args dicts, files under tmp_path unless given; a
    ``check_mode`` key becomes the task keyword) in the node namespace; return each task's
    registered result (failures included)."""
    def task(args):
        args = {**lab.files, **args}
        keywords = {"check_mode": args.pop("check_mode")} if "check_mode" in args else {}
        return {"kubenode.proxy.conntrack_tune": args, "ignore_errors": True, **keywords}

    return run_tasks(lab.wrapper, lab.tmp, [task(args) for args in tasks], *flags)


def ns_values(lab, ns="node", keys=PER_NS + (MAX,)) -> dict:
    """Read from /proc inside the namespace."""
    paths = [tune.LiveConntrack().path(k) for k in keys]
    out = lab.exec(ns, ["cat", *paths]).stdout.split()
    return dict(zip(keys, map(int, out)))


def test_per_namespace_keys_live_persisted_idempotent(node):
    lab = node
    before = ns_values(lab)
    pod_before = ns_values(lab, "be1")
    args = dict(tcp_timeout_established="1h0m0s", tcp_timeout_close_wait=1800, tcp_be_liberal=True,
                udp_timeout="45s", udp_timeout_stream=150)
    wanted = {EST: 3600, CW: 1800, LIB: 1, UDP: 45, UDPS: 150}
    assert any(before[k] != v for k, v in wanted.items())

    # set, again (idempotent), then a new value with apply_live=false: only the file changes
    r, again, file_only = play(lab, [args, args, {**args, "udp_timeout": 50, "apply_live": False}], "--diff")
    assert r["changed"] and not r.get("failed"), r
    assert ns_values(lab) == {**before, **wanted}  # read from /proc inside the node namespace
    assert {k: r["values"][k] for k in wanted} == wanted and {k: r["previous"][k] for k in wanted} == {
        k: before[k] for k in wanted}
    assert r["skipped"] == [] and r["deleted"] == 0 and r["wanted"] == wanted
    assert ns_values(lab, "be1") == pod_before  # per namespace: the pod's own values are untouched

    live_diff, file_diff = r["diff"]  # no hash size, so no modprobe file
    assert live_diff["before"] == "".join(f"{k} = {before[k]}\n" for k in PER_NS)
    assert live_diff["after"] == "".join(f"{k} = {wanted[k]}\n" for k in PER_NS)
    sysctl_file = lab.tmp / "etc/sysctl.d/90-kubenode-conntrack.conf"
    assert file_diff["before"] == "" and file_diff["after_header"] == str(sysctl_file)
    assert parse_sysctl_conf(file_diff["after"]) == {k: str(v) for k, v in wanted.items()}
    assert not (lab.tmp / "etc/modprobe.d").exists()

    assert not again["changed"] and again["files"] == []
    assert again["diff"][0]["before"] == again["diff"][0]["after"] and len(again["diff"]) == 1

    assert file_only["changed"] and file_only["values"][UDP] == 45 and ns_values(lab)[UDP] == 45
    assert file_only["diff"] == [{"before_header": str(sysctl_file), "after_header": str(sysctl_file),
                                  "before": file_diff["after"], "after": sysctl_file.read_text()}]
    assert parse_sysctl_conf(sysctl_file.read_text()) == {**{k: str(v) for k, v in wanted.items()}, UDP: "50"}
    assert stat.S_IMODE(sysctl_file.stat().st_mode) == 0o644


def test_check_mode_changes_nothing(node):
    lab = node
    before = ns_values(lab)
    (r,) = play(lab, [dict(tcp_timeout_established=7200, udp_timeout=33)], "--check", "--diff")
    assert r["changed"] and r["values"][EST] == 7200 and r["values"][UDP] == 33
    assert f"{EST} = 7200" in r["diff"][0]["after"] and f"{EST} = {before[EST]}" in r["diff"][0]["before"]
    assert "udp_timeout = 33" in r["diff"][1]["after"]
    assert ns_values(lab) == before
    assert not (lab.tmp / "etc").exists()


def test_global_keys_are_refused_clearly_in_a_child_namespace(node):
    lab = node
    path = tune.LiveConntrack().path(MAX)
    mode = lab.exec("node", ["stat", "-c", "%a", path]).stdout.strip()
    assert mode == "444", f"{path} is writable in a child namespace here; not testing global keys"
    host = host_values()
    before = ns_values(lab)
    assert before[MAX] == host[MAX]  # one global value, seen from everywhere
    other_max, other_hashsize = host[MAX] * 2, host[HS] * 2

    refused, hashsize, skipping, current = play(lab, [
        dict(max=other_max, udp_timeout=44),
        dict(hashsize=other_hashsize, persist=False),
        dict(max=other_max, udp_timeout=44, skip_readonly=True),
        dict(max=host[MAX], hashsize=0, persist=False),  # the current value needs no write: fine
    ])
    assert refused["failed"] and not refused["changed"]
    assert refused["msg"].startswith(f"cannot set read-only key: {MAX} (have {host[MAX]}, want {other_max}): "
                                     "global (one value for the whole host): writable only from the initial "
                                     "network namespace"), refused["msg"]
    assert "skip_readonly=true" in refused["msg"]

    assert hashsize["failed"] and f"{HS} (have {host[HS]}, want {other_hashsize}): global" in hashsize["msg"]

    assert skipping["changed"] and not skipping.get("failed")
    skipped = {s["key"]: s for s in skipping["skipped"]}
    assert set(skipped) == {MAX} | ({HS} if host[HS] < other_max // 4 else set())
    assert (skipped[MAX]["current"], skipped[MAX]["wanted"]) == (host[MAX], other_max)
    assert "initial network namespace" in skipped[MAX]["reason"]
    assert skipping["values"][MAX] == host[MAX] and skipping["values"][UDP] == 44
    assert parse_sysctl_conf((lab.tmp / "etc/sysctl.d/90-kubenode-conntrack.conf").read_text()) == {
        MAX: str(other_max), UDP: "44"}  # persisted for the host's boot anyway

    assert not current["changed"] and not current.get("failed") and current["skipped"] == []
    assert ns_values(lab) == {**before, UDP: 44}


def dnat(lab, *rules):
    lines = ["*nat", f":{CHAIN} - [0:0]"]
    lines += [f"-A {CHAIN} -d {dst}/32 -p udp -m udp --dport 53 -j DNAT --to-destination {to}:{DNS_PORT}"
              for dst, to in rules]
    lab.iptables_restore("\n".join([*lines, "COMMIT", ""]))


def udp_flows(lab):
    return sorted((f.orig_dst, f.orig_sport, f.reply_src) for f in list_flows(lab.ns("node"), ("UDP",), (4,)))


def test_delete_removes_real_udp_flows_and_leaves_others(node):
    lab = node
    lab.exec("node", ["sysctl", "-qw", f"{UDP.replace('.', '/')}=300"])  # flows outlive the test
    dnat(lab, (SVC, BE1), (OTHER_SVC, BE2))
    replies = lab.request_many("client", SVC, 53, "udp", count=3) + [lab.request("client", OTHER_SVC, 53, "udp")]
    assert [r.backend for r in replies] == ["be1", "be1", "be1", "be2"]
    flows = udp_flows(lab)
    assert [(dst, be) for dst, _sport, be in flows] == [(SVC, BE1)] * 3 + [(OTHER_SVC, BE2)]
    to_svc = [dict(protocol="udp", orig_dst=SVC, orig_dst_port=53)]

    checked, checked_again, deleted, again = play(lab, [
        dict(delete=to_svc, persist=False, check_mode=True), dict(delete=to_svc, persist=False, check_mode=True),
        dict(delete=to_svc, persist=False), dict(delete=to_svc, persist=False)])
    assert (checked["changed"], checked["deleted"]) == (True, 3)
    assert (checked_again["changed"], checked_again["deleted"]) == (True, 3)  # check mode deleted nothing
    assert (deleted["changed"], deleted["deleted"]) == (True, 3)
    assert (again["changed"], again["deleted"]) == (False, 0)
    assert udp_flows(lab) == [f for f in flows if f[0] == OTHER_SVC]

    # The use case: a flow stuck on an endpoint that left the service follows it once deleted.
    assert lab.exec("client", [sys.executable, "-c", SEND_ONE, SVC, "53", "40053"]).stdout.strip() == "be1"
    dnat(lab, (SVC, BE2), (OTHER_SVC, BE2))
    assert lab.exec("client", [sys.executable, "-c", SEND_ONE, SVC, "53", "40053"]).stdout.strip() == "be1"
    (r,) = play(lab, [dict(delete=[dict(protocol="udp", reply_src=BE1), dict(orig_src_port=1)], persist=False)])
    assert (r["changed"], r["deleted"]) == (True, 1)
    assert lab.exec("client", [sys.executable, "-c", SEND_ONE, SVC, "53", "40053"]).stdout.strip() == "be2"
    assert [f[0] for f in udp_flows(lab)] == [SVC, OTHER_SVC]
