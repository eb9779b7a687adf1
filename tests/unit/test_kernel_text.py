"""No kernel text from unvalidated strings: every byte 0x00-0xff, inserted into each field
that reaches iptables-restore or ipset restore input, is either refused with an error
naming the field, or written so that the tools read exactly the commands and tokens of a
clean value (tokenized as the tools do, restore_tokens.py). Model objects are built
directly, bypassing model.py's validation: this is the writers' own line of defence.
Then hypothesis properties over the three writers."""
from __future__ import annotations

import dataclasses
import re
from typing import Any, Dict, List, Tuple

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.kernel import text
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.kernel.ipset import IPSet, IpsetError
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.kernel.ipset import plan as ipset_plan
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.kernel.ipset_specs import kube_ipset
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.model import (
    Endpoint,
    ServicePort,
    ServicePortName,
    ValidationError,
)
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.modes import checked
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.modes.iptables import compile as ipt
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.modes.iptables.plan import plan
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.modes.ipvs import compile as ipvsc
from ansible_collections.kubenode.proxy.plugins.modules import ipset_entry as mod

from .restore_tokens import ipset_line, ipset_restore, iptables_line, iptables_restore

BYTES = [chr(b) for b in range(256)]
HASHED = re.compile(r"KUBE-(?:SVC|SVL|EXT|FW|SEP)-[A-Z2-7]{16}")
CFG = ipt.IptablesConfig(local_cidrs=("10.0.0.0/8",), node_ips=("192.168.0.2",))
IPVS_CFG = ipvsc.IpvsConfig(iptables=CFG, node_port_ips=("192.168.0.2",), primary_node_ip="192.168.0.2")

# field path -> (prefix, clean character, suffix): the byte under test replaces the clean one.
FIELDS: Dict[str, Tuple[Any, str, str]] = {
    "metadata.namespace": ("team", "q", "a"),
    "metadata.name": ("we", "b", "site"),
    "spec.ports[1].name": ("ht", "t", "ps"),
    "spec.clusterIP": ("172.30.0.4", "1", ""),
    "spec.ports[1].port": ("44", "3", ""),  # a string where an int belongs: always refused
    "spec.ports[1].protocol": ("T", "C", "P"),
    "spec.ports[1].nodePort": ("3044", "3", ""),
    "spec.healthCheckNodePort": ("3000", "0", ""),
    "spec.sessionAffinityConfig.clientIP.timeoutSeconds": ("1080", "0", ""),
    "spec.externalIPs[0]": ("192.168.99.2", "2", ""),
    "status.loadBalancer.ingress[0].ip": ("1.2.3.", "4", ""),
    "spec.loadBalancerSourceRanges[0]": ("203.0.11", "3", ".0/25"),
    "endpoints[1].addresses[0]": ("10.180.0.2", "9", ""),
    "endpoints[1].port": ("844", "3", ""),
}
INT_FIELDS = {"spec.ports[1].port", "spec.ports[1].nodePort", "spec.healthCheckNodePort",
              "spec.sessionAffinityConfig.clientIP.timeoutSeconds", "endpoints[1].port"}


def service(values: Dict[str, Any]):
    """Two ports of one Service: a ClusterIP-only one (the compiler's short path) and one
    with every feature (NodePort, external and LB IPs, source ranges, affinity, local policy)."""
    v = {f: (p + c + s) for f, (p, c, s) in FIELDS.items()}
    v.update(values)
    for f in INT_FIELDS:
        if f not in values:
            v[f] = int(v[f])
    ns, name = v["metadata.namespace"], v["metadata.name"]
    a = ServicePort(ServicePortName(ns, name, "http", "TCP"), v["spec.clusterIP"], 80, "TCP")
    b_name = ServicePortName(ns, name, v["spec.ports[1].name"], "TCP")
    b = ServicePort(b_name, v["spec.clusterIP"], v["spec.ports[1].port"], v["spec.ports[1].protocol"],
                    node_port=v["spec.ports[1].nodePort"], external_ips=(v["spec.externalIPs[0]"],),
                    load_balancer_ips=(v["status.loadBalancer.ingress[0].ip"],),
                    load_balancer_source_ranges=(v["spec.loadBalancerSourceRanges[0]"],),
                    external_policy_local=True, health_check_node_port=v["spec.healthCheckNodePort"],
                    session_affinity_seconds=v["spec.sessionAffinityConfig.clientIP.timeoutSeconds"])
    eps = {a.name: [Endpoint("10.180.0.1", 8080), Endpoint("10.180.0.3", 8080)],
           b.name: [Endpoint("10.180.0.1", 8443, is_local=True),
                    Endpoint(v["endpoints[1].addresses[0]"], v["endpoints[1].port"])]}
    return (a, b), eps


def iptables_text(ports, eps) -> str:
    rules = ipt.compile_service(ports, eps, CFG)
    desired = dict(rules.chains)
    for key, lines in rules.shared.items():
        desired.setdefault(key, []).extend(lines)
    return plan({}, desired, merge=False).text()


def ipvs_texts(ports, eps) -> Tuple[str, str]:
    desired = ipvsc.assemble({"ns/svc": ipvsc.compile_service(ports, eps, IPVS_CFG)}, IPVS_CFG)
    sets = ipset_plan({}, [kube_ipset(n, sorted(desired.ipsets[n])) for n in ipvsc.IPSET_NAMES]).text()
    return sets, plan({}, desired.rules, merge=False).text()


def normalized(commands: List[List[str]], old: str = "", new: str = "") -> List[Tuple[str, ...]]:
    """Commands as sorted token tuples: hashed chain names (which follow the names) as H;
    ``old`` replaced by ``new`` in every token (what the value under test should become)."""
    out = []
    for cmd in commands:
        out.append(tuple(HASHED.sub("H", t.replace(old, new) if old else t) for t in cmd))
    return sorted(out)


def assert_same_commands(out: List[List[str]], base: List[List[str]], old: str, new: str) -> None:
    assert len(out) == len(base)
    assert normalized(out) == normalized(base, old, new)


@pytest.mark.parametrize("field", sorted(FIELDS))
def test_every_byte_in_every_field_is_refused_by_name_or_written_as_one_token(field):
    prefix, clean, suffix = FIELDS[field]
    base_ports, base_eps = service({})
    base_value = prefix + clean + suffix
    base_ipt = iptables_restore(iptables_text(base_ports, base_eps))
    sets_text, ipvs_rules_text = ipvs_texts(base_ports, base_eps)
    base_sets, base_ipvs_rules = ipset_restore(sets_text), iptables_restore(ipvs_rules_text)
    refused = written = 0
    for ch in BYTES:
        value = prefix + ch + suffix
        ports, eps = service({field: value})
        for writer, base, tokenize in ((iptables_text, [base_ipt], iptables_restore),
                                       (ipvs_texts, [base_sets, base_ipvs_rules], None)):
            try:
                outputs = writer(ports, eps)
            except ValidationError as e:
                assert e.path == field, (repr(ch), str(e))
                assert "\n" not in str(e) and "\r" not in str(e) and "\0" not in str(e)
                refused += 1
                continue
            written += 1
            assert field not in INT_FIELDS, f"{field}={value!r} was written"
            if isinstance(outputs, str):
                outputs = (outputs,)
            for out_text, base_cmds, tok in zip(outputs, base, (tokenize,) if tokenize else
                                                (ipset_restore, iptables_restore)):
                assert_same_commands(tok(out_text), base_cmds, base_value, value)
    assert refused and (written or field in INT_FIELDS)


@pytest.mark.parametrize("ch", ['"', "\\", "'", "#", " ", "\t", "\n", "\r", "\0", "\x7f", "\x85", "\u2028"])
def test_names_are_escaped_as_iptables_save_writes_them_or_refused(ch):
    ports, eps = service({"metadata.name": f"a{ch}b"})
    try:
        out = iptables_text(ports, eps)
    except ValidationError as e:
        assert ch in "\t\n\r\0\x7f\x85\u2028" and e.path == "metadata.name"
        return
    # iptables-save escapes ", \ and ' with a backslash; the kernel stores the plain text.
    shown = {'"': '\\"', "\\": "\\\\", "'": "\\'"}.get(ch, ch)
    assert f'--comment "teamqa/a{shown}b:https external IP"' in out
    assert ["--comment", f"teamqa/a{ch}b:https external IP"] == next(
        c[i:i + 2] for c in iptables_restore(out) for i in range(len(c)) if c[i] == "--comment"
        and "external IP" in c[i + 1])


def test_a_legitimate_name_of_the_longest_kind_fits_and_a_longer_one_is_refused():
    longest = {"metadata.namespace": "n" * 63, "metadata.name": "s" * 63, "spec.ports[1].name": "p" * 15}
    ports, eps = service(longest)
    for cmd in iptables_restore(iptables_text(ports, eps)):
        for i, tok in enumerate(cmd[:-1]):
            if tok == "--comment":
                assert len(cmd[i + 1]) <= text.IPT_MAX_COMMENT
    ports, eps = service({**longest, "metadata.name": "s" * 120})
    with pytest.raises(ValidationError, match="metadata.name: namespace/name:port is longer than"):
        iptables_text(ports, eps)


# --- the ipset_entry module's arguments ----------------------------------------------------


class Exit(Exception):
    pass


class FakeModule:
    check_mode = True
    _diff = False

    def __init__(self, params):
        self.params = params

    def fail_json(self, **kw):
        raise Exit(dict(kw, failed=True))

    def exit_json(self, **kw):
        raise Exit(kw)


class NoSets:
    def current(self, names):
        return {}


MODULE_DEFAULTS = dict(state="present", exclusive=False, timeout=None, comment=None, family="inet",
                       hashsize=None, maxelem=None, range=None, entries=None, type=None, name=None)
MODULE_CASES = {
    # option -> (base params, prefix, clean, suffix)
    "name": (dict(type="hash:ip,port"), "KN-SE", "T", "S"),
    "range": (dict(name="P", type="bitmap:port", entries=["80"]), "0-6553", "5", ""),
    "comment": (dict(name="S", type="hash:ip,port", entries=["10.96.0.10,tcp:80"]), "we", "b", "site"),
    "entries[0]": (dict(name="S", type="hash:ip,port"), "10.96.0.1", "0", ",tcp:80"),
    "timeout": (dict(name="S", type="hash:ip"), "36", "0", "0"),
    "hashsize": (dict(name="S", type="hash:ip"), "102", "4", ""),
    "maxelem": (dict(name="S", type="hash:ip"), "6553", "6", ""),
}


def run_ipset_entry(params: Dict[str, Any]) -> Dict[str, Any]:
    module = FakeModule(dict(MODULE_DEFAULTS, **params))
    with pytest.raises(Exit) as exc:
        mod.IpsetEntry(module, kernel=NoSets()).run()
    return exc.value.args[0]


def module_params(option: str, value: Any) -> Dict[str, Any]:
    base = dict(MODULE_CASES[option][0])
    if option == "entries[0]":
        base["entries"] = [value]
    else:
        base[option] = value
    return base


@pytest.mark.parametrize("option", sorted(MODULE_CASES))
def test_every_byte_in_every_ipset_entry_option_is_refused_by_name_or_one_token(option):
    _base, prefix, clean, suffix = MODULE_CASES[option]
    base_value = prefix + clean + suffix
    typed = int if option in ("timeout", "hashsize", "maxelem") else (lambda s: s)
    base = run_ipset_entry(module_params(option, typed(base_value)))
    assert not base.get("failed"), base
    base_cmds = ipset_restore(base["restore_input"])
    written = 0
    for ch in BYTES:
        value = prefix + ch + suffix
        out = run_ipset_entry(module_params(option, value))  # as a string: ints must be refused too
        if out.get("failed"):
            named = out.get("option") == option or (option == "entries[0]" and out.get("entry") == value)
            assert named and "\n" not in out["msg"] and "\0" not in out["msg"], (repr(ch), out)
            continue
        written += 1
        assert option not in ("timeout", "hashsize", "maxelem"), out
        assert_same_commands(ipset_restore(out["restore_input"]), base_cmds,
                             base_value, value if option != "name" else value)
    assert option in ("timeout", "hashsize", "maxelem") or written


# --- properties --------------------------------------------------------------------------

HOSTILE = st.text(alphabet=st.characters(max_codepoint=0x2030), max_size=24)


def maybe(valid):
    return st.one_of(st.sampled_from(valid), HOSTILE)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ns=maybe(["ns1", "kube-system"]), name=maybe(["web", "a"]), pname=maybe(["https", ""]),
       cluster_ip=maybe(["172.30.0.41", "fd00::1"]), ext=maybe(["192.168.99.22"]), cidr=maybe(["203.0.113.0/25"]),
       ep_ip=maybe(["10.180.0.29"]), proto=maybe(["TCP", "UDP"]),
       port=st.one_of(st.integers(-5, 70000), HOSTILE))
def test_property_compilers_refuse_by_field_or_write_only_well_formed_commands(
        ns, name, pname, cluster_ip, ext, cidr, ep_ip, proto, port):
    ports, eps = service({"metadata.namespace": ns, "metadata.name": name, "spec.ports[1].name": pname,
                          "spec.clusterIP": cluster_ip, "spec.externalIPs[0]": ext,
                          "spec.loadBalancerSourceRanges[0]": cidr, "endpoints[1].addresses[0]": ep_ip,
                          "spec.ports[1].protocol": proto, "spec.ports[1].port": port})
    for writer in (iptables_text, ipvs_texts):
        try:
            outputs = writer(ports, eps)
        except ValidationError as e:
            assert e.path in FIELDS and e.path in str(e) and "\n" not in str(e)
            continue
        outputs = (outputs,) if isinstance(outputs, str) else outputs
        for out in outputs:
            for line in out.split("\n"):
                assert line.isascii() and line.isprintable() or line == ""
                cmd = ipset_line(line) if out is outputs[0] and writer is ipvs_texts else iptables_line(line)
                assert not cmd or cmd[0] in ("*nat", "*filter", "COMMIT", "-A", "-I", "-D", "-X", "create", "add",
                                             "del", "destroy", "swap") or cmd[0].startswith(":KUBE-"), line
                if cmd and cmd[0] == "-A":
                    # every option is followed by its value: no token was split or merged
                    assert cmd[-2] == "-j" or "-j" in cmd or cmd[1].startswith("KUBE-"), cmd


@settings(max_examples=300, deadline=None)
@given(name=maybe(["KN-S", "x"]), stype=maybe(["hash:ip,port", "bitmap:port"]), rng=st.one_of(st.none(), HOSTILE),
       entry=maybe(["10.0.0.1,tcp:80", "80"]), comment=st.one_of(st.none(), HOSTILE),
       opt=st.dictionaries(HOSTILE, HOSTILE, max_size=2), timeout=st.one_of(st.none(), st.integers(), HOSTILE))
def test_property_ipset_plan_refuses_or_writes_one_command_per_line(name, stype, rng, entry, comment, opt, timeout):
    want = IPSet(name, stype, range=rng, timeout=timeout, comment=comment is not None, options=opt,
                 entries={entry: ({"comment": comment} if comment is not None else {})})
    try:
        p = ipset_plan({}, [want])
    except IpsetError as e:  # PlanError / EntryError: names the set, field or entry
        assert "\n" not in str(e) and str(e)
        return
    out = p.text()
    cmds = ipset_restore(out)
    assert [c[0] for c in cmds] == ["create"] + ["add"] * (len(cmds) - 1)
    assert all(c[1] == name for c in cmds) and len(out.splitlines()) == len(cmds)
    assert all(line.isascii() and line.isprintable() for line in out.splitlines())


@settings(max_examples=300, deadline=None)
@given(option=st.sampled_from(sorted(MODULE_CASES)), value=st.one_of(HOSTILE, st.integers(-10, 1 << 33)))
def test_property_ipset_entry_arguments_fail_naming_the_option_or_write_one_command_per_line(option, value):
    if option == "entries[0]" and not isinstance(value, str):
        value = str(value)
    out = run_ipset_entry(module_params(option, value))
    if out.get("failed"):
        assert out.get("option") == option or "entry" in out or "range" in out["msg"] or out["msg"], out
        assert "\n" not in out["msg"]
        if out.get("option"):
            assert out["msg"].startswith(out["option"] + ":")
        return
    lines = out["restore_input"].splitlines()
    assert len(ipset_restore(out["restore_input"])) == len(lines)
    assert all(line.isascii() and line.isprintable() for line in lines)


def test_nft_quoting_is_ready_for_the_next_mode():
    assert text.nft_string("ns/web:http", "comment") == '"ns/web:http"'
    for bad in ('a"b', "a\nb", "a\\b", "x" * 200):
        with pytest.raises(text.UnsafeText, match="^comment: "):
            text.nft_string(bad, "comment")
    with pytest.raises(text.UnsafeText, match="^chain: "):
        text.nft_identifier("svc; flush ruleset", "chain")


def test_checked_field_paths_are_what_the_fuzzer_expects():
    # The refusal of a field that is fine alone but too long together names metadata.name.
    assert checked.NAME_BUDGET == text.IPT_MAX_COMMENT - checked.COMMENT_OVERHEAD
    assert dataclasses.is_dataclass(ServicePort)


@pytest.mark.parametrize("writer", [text.iface, text.ipset_name])
def test_a_name_starting_with_a_dash_is_refused_as_the_restore_parsers_would_read_an_option(writer):
    assert writer("eth0", "f") == "eth0"
    assert writer("a-b", "f") == "a-b"
    for value in ("-j", "-exist", "--noflush", "-"):
        with pytest.raises(text.UnsafeText, match="not starting with -"):
            writer(value, "f")
