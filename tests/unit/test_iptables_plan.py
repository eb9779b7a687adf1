"""The planner: smallest restore input, shared chains diffed by rule, stale chains removed last."""
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.kernel.iptables import bulk_restore_text
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.modes.iptables.compile import (
    NODEPORTS_TAIL_COMMENT,
)
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.modes.iptables.plan import plan

SVC = ("nat", "KUBE-SERVICES")
TAIL = f'-m comment --comment "{NODEPORTS_TAIL_COMMENT}" -m addrtype --dst-type LOCAL -j KUBE-NODEPORTS'


def test_nothing_to_do_is_empty():
    rules = {SVC: ["-d 10.96.0.1/32 -j KUBE-SVC-A", TAIL], ("nat", "KUBE-SVC-A"): ["-j KUBE-SEP-A"]}
    p = plan(rules, {k: list(v) for k, v in rules.items()}, merge=False)
    assert p.empty and p.text() == "" and p.changes == []


def test_merge_mode_touches_only_changed_rules_of_shared_chains():
    before = {SVC: ["-d 10.96.0.1/32 -j KUBE-SVC-A"], ("nat", "KUBE-SVC-A"): ["-j KUBE-SEP-A"],
              ("nat", "KUBE-SEP-A"): ["-j DNAT --to-destination 10.244.0.1:80"]}
    after = {SVC: ["-d 10.96.0.2/32 -j KUBE-SVC-A"], ("nat", "KUBE-SVC-A"): ["-j KUBE-SEP-B"],
             ("nat", "KUBE-SEP-B"): ["-j DNAT --to-destination 10.244.0.2:80"]}
    p = plan(before, after, merge=True, existing={SVC})
    assert p.lines["nat"] == [
        ":KUBE-SEP-B - [0:0]",
        ":KUBE-SVC-A - [0:0]",
        ":KUBE-SEP-A - [0:0]",
        "-A KUBE-SEP-B -j DNAT --to-destination 10.244.0.2:80",
        "-D KUBE-SERVICES -d 10.96.0.1/32 -j KUBE-SVC-A",
        "-I KUBE-SERVICES 1 -d 10.96.0.2/32 -j KUBE-SVC-A",
        "-A KUBE-SVC-A -j KUBE-SEP-B",
        "-X KUBE-SEP-A",
    ]
    assert p.lines["filter"] == []


def test_full_mode_rewrites_a_shared_chain_whose_tail_is_not_last():
    have = {SVC: [TAIL, "-d 10.96.0.1/32 -j KUBE-SVC-A"]}
    want = {SVC: ["-d 10.96.0.1/32 -j KUBE-SVC-A", TAIL]}
    p = plan(have, want, merge=False)
    assert p.lines["nat"] == [":KUBE-SERVICES - [0:0]", "-A KUBE-SERVICES -d 10.96.0.1/32 -j KUBE-SVC-A",
                              f"-A KUBE-SERVICES {TAIL}"]


def test_full_mode_ignores_order_of_independent_shared_rules():
    have = {SVC: ["-d 10.96.0.2/32 -j KUBE-SVC-B", "-d 10.96.0.1/32 -j KUBE-SVC-A", TAIL]}
    want = {SVC: ["-d 10.96.0.1/32 -j KUBE-SVC-A", "-d 10.96.0.2/32 -j KUBE-SVC-B", TAIL]}
    assert plan(have, want, merge=False).empty


def test_builtin_chains_only_get_missing_jumps_inserted():
    have = {("nat", "PREROUTING"): ["-j OTHER-SOFTWARE"]}
    want = {("nat", "PREROUTING"): ['-m comment --comment "kubernetes service portals" -j KUBE-SERVICES']}
    p = plan(have, want, merge=False)
    assert p.lines["nat"] == ['-I PREROUTING 1 -m comment --comment "kubernetes service portals" -j KUBE-SERVICES']


def test_only_service_chains_are_garbage_collected():
    have = {("nat", "KUBE-SEP-OLD"): ["-j ACCEPT"], ("nat", "KUBE-KUBELET-CANARY"): [],
            ("filter", "KUBE-FIREWALL"): []}
    p = plan(have, {}, merge=False)
    assert p.lines["nat"] == [":KUBE-SEP-OLD - [0:0]", "-X KUBE-SEP-OLD"]
    assert p.lines["filter"] == []


def test_merge_appends_a_missing_tail_after_inserting_service_rules():
    p = plan({SVC: []}, {SVC: ["-d 10.96.0.1/32 -j KUBE-SVC-A", TAIL]}, merge=True, existing={SVC})
    assert p.lines["nat"] == ["-I KUBE-SERVICES 1 -d 10.96.0.1/32 -j KUBE-SVC-A", f"-A KUBE-SERVICES {TAIL}"]


def test_full_plan_deletes_stale_chains_known_only_by_name():
    """A large table's full sync reads chain names, not rules: stale chains still go."""
    desired = {("nat", "KUBE-SVC-AAAAAAAAAAAAAAAA"): ["-j KUBE-SEP-AAAAAAAAAAAAAAAA"],
               ("nat", "KUBE-SEP-AAAAAAAAAAAAAAAA"): ["-j DNAT --to-destination 10.0.0.1:80"]}
    existing = {("nat", "KUBE-SVC-AAAAAAAAAAAAAAAA"), ("nat", "KUBE-SEP-BBBBBBBBBBBBBBBB"), ("nat", "OTHER")}
    p = plan({}, desired, merge=False, existing=existing)
    lines = p.lines["nat"]
    assert "-X KUBE-SEP-BBBBBBBBBBBBBBBB" in lines and ":KUBE-SEP-BBBBBBBBBBBBBBBB - [0:0]" in lines
    assert not any("OTHER" in line for line in lines)
    assert "-A KUBE-SVC-AAAAAAAAAAAAAAAA -j KUBE-SEP-AAAAAAAAAAAAAAAA" in lines  # rules unknown: rewritten
    assert "- nat chain KUBE-SEP-BBBBBBBBBBBBBBBB (rules not read)" in p.changes


def test_merge_plan_never_deletes_chains_outside_its_scope():
    existing = {("nat", "KUBE-SEP-BBBBBBBBBBBBBBBB")}
    p = plan({}, {("nat", "KUBE-SVC-AAAAAAAAAAAAAAAA"): []}, merge=True, existing=existing)
    assert "-X KUBE-SEP-BBBBBBBBBBBBBBBB" not in p.lines["nat"]


def test_bulk_restore_text_marks_only_large_sections():
    text = "*filter\n:KUBE-A - [0:0]\nCOMMIT\n*nat\n:KUBE-B - [0:0]\n:KUBE-C - [0:0]\n-A KUBE-B -j KUBE-C\nCOMMIT\n"
    out = bulk_restore_text(text, threshold=2)
    assert out == text.replace("*nat\n", "*nat\n-Z\n")
    assert bulk_restore_text(text, threshold=3) == text
