"""k8s_service_nftables: the options it shares with k8s_service_iptables, and the pure core
(modes/nftables/service.py) on listings as nft 1.0 prints them. The kernel side runs through
ansible-playbook in tests/integration/test_module_nftables_playbook.py."""
import json

import pytest
import yaml
from ansible.module_utils.testing import patch_module_args

from ansible_collections.kubenode.proxy.plugins.module_utils import k8s_service
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.modes.nftables import compile as nc
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.modes.nftables import service as ns
from ansible_collections.kubenode.proxy.plugins.modules import k8s_service_iptables as ipt_mod
from ansible_collections.kubenode.proxy.plugins.modules import k8s_service_nftables as mod


def run_module(capsys, args):
    with patch_module_args(args):
        with pytest.raises(SystemExit):
            mod.main()
    return json.loads(capsys.readouterr().out)


def test_both_modules_share_the_options_and_their_docs():
    spec = {}

    class Capture(Exception):
        pass

    def capture(**kwargs):
        spec.update(kwargs)
        raise Capture()

    for m in (mod, ipt_mod):
        orig = m.AnsibleModule
        m.AnsibleModule = capture
        try:
            with pytest.raises(Capture):
                m.main()
        finally:
            m.AnsibleModule = orig
        spec[m.__name__] = dict(spec.pop("argument_spec"))
    nft_spec, ipt_spec = spec[mod.__name__], spec[ipt_mod.__name__]
    assert set(ipt_spec) - set(nft_spec) == {"localhost_nodeports", "iptables_binary"}
    assert all(nft_spec[k] == ipt_spec[k] for k in nft_spec)
    for m in (mod, ipt_mod):
        assert "kubenode.proxy.k8s_service" in yaml.safe_load(m.DOCUMENTATION)["extends_documentation_fragment"]


def test_flat_form_checks_are_the_shared_ones(capsys):
    out = run_module(capsys, dict(name="Web_Service", cluster_ip="10.96.0.10"))
    assert out["failed"] and out["field"] == "name" and out["msg"].startswith("k8s_service_nftables: name:")
    out = run_module(capsys, {"service": {"metadata": {"name": "x"}}, "cluster_ip": "10.96.0.1"})
    assert out["failed"] and "mutually exclusive: service|cluster_ip" in out["msg"]


def test_module_config_is_the_daemons_with_endpoint_chains(capsys, monkeypatch):
    from ansible_collections.kubenode.proxy.plugins.module_utils.proxier import config as kpconfig
    from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.modes import get

    seen = []
    monkeypatch.setattr(mod.ServiceNftables, "run", lambda self: (seen.append(self._config()),
                                                                  self.module.exit_json(changed=False)))
    monkeypatch.setattr(k8s_service, "local_addresses", lambda: ["127.0.0.1", "192.168.50.1"])
    run_module(capsys, dict(name="web", cluster_ip="10.96.0.10", cluster_cidr="10.244.0.0/16", masquerade_bit=12,
                            node_port_addresses=["192.168.50.0/24"]))
    daemon = get("nftables").make_config(
        kpconfig.ProxyConfig(cluster_cidrs=("10.244.0.0/16",), masquerade_bit=12,
                             node_port_addresses=("192.168.50.0/24",)),
        "", addresses=["127.0.0.1", "192.168.50.1"])
    assert seen[0].base == daemon.base and seen[0].endpoint_chains and not daemon.endpoint_chains


LISTING = """table ip kube-proxy {
\tcomment "rules for kube-proxy"
\tmap service-ips {
\t\ttype ipv4_addr . inet_proto . inet_service : verdict
\t\tcomment "ClusterIP, ExternalIP and LoadBalancer IP traffic"
\t\telements = { 10.96.0.11 . tcp . 5432 comment "shop/db" : goto service-AAAAAAAA-shop/db/tcp/pg,
\t\t\t     10.96.0.10 . tcp . 80 comment "shop/web" : goto service-BBBBBBBB-shop/web/tcp/http,
\t\t\t     10.96.0.12 . tcp . 80 : goto service-CCCCCCCC-shop/api/tcp/http }
\t}

\tset affinity-DDDDDDDD-shop/web/tcp/http__10.244.1.1/8080 {
\t\ttype ipv4_addr
\t\tsize 65535
\t\tflags dynamic,timeout
\t\ttimeout 1m
\t\telements = { 10.244.2.10 expires 58s }
\t}

\tchain service-BBBBBBBB-shop/web/tcp/http {
\t\tnumgen random mod 2 0 goto endpoint-EEEEEEEE-shop/web/tcp/http__10.244.1.1/8080
\t}

\tchain service-AAAAAAAA-shop/db/tcp/pg {
\t\tgoto endpoint-FFFFFFFF-shop/db/tcp/pg__10.244.1.2/8080
\t}

\tchain nat-output {
\t\ttype nat hook output priority dstnat; policy accept;
\t\tjump services
\t}
}
"""


def test_parse_table_and_what_belongs_to_a_service():
    objs = ns.parse_table(LISTING)
    assert objs["nat-output"].decl == ["type nat hook output priority dstnat; policy accept;"]
    assert objs["nat-output"].rules == ["jump services"]
    assert len(objs["service-ips"].elements) == 3
    web = ns.view(objs, "shop", "web")
    assert list(web.chains) == ["service-BBBBBBBB-shop/web/tcp/http"]
    assert list(web.sets) == ["affinity-DDDDDDDD-shop/web/tcp/http__10.244.1.1/8080"]
    assert list(web.elements["service-ips"]) == ["10.96.0.10 . tcp . 80"]
    # "shop/we" is not a prefix match of "shop/web"; the uncommented element is nobody's.
    assert ns.view(objs, "shop", "we").chains == {} and ns.view(objs, "shop", "api").elements == {}


def _plan(current, wanted, svc=None, name="web"):
    cfg = nc.NftablesConfig(endpoint_chains=True)
    return ns.plan_service("ip kube-proxy", current, wanted, svc, nc.infrastructure(cfg), "shop", name)


def test_absent_removes_only_the_services_objects():
    objs = ns.parse_table(LISTING)
    p = _plan(objs, None)
    assert "delete element ip kube-proxy service-ips { 10.96.0.10 . tcp . 80 }" in p.text
    assert "delete chain ip kube-proxy service-BBBBBBBB-shop/web/tcp/http" in p.text
    assert "delete set ip kube-proxy affinity-DDDDDDDD-shop/web/tcp/http__10.244.1.1/8080" in p.text
    assert "shop/db" not in p.text and "nat-output" not in p.text and "10.96.0.12" not in p.text
    # the flush comes before the delete, the element deletion before both
    assert p.text.index("delete element") < p.text.index("flush chain") < p.text.index("delete chain")
    assert p.chains == [] and "shop/web" in p.before and "shop/web" not in p.after
    assert _plan(ns.parse_table(p.after), None).text == ""


def test_same_listing_is_no_change_and_runtime_affinity_entries_do_not_count():
    objs = ns.parse_table(LISTING)
    wanted = ns.parse_table(LISTING.replace("\t\telements = { 10.244.2.10 expires 58s }\n", ""))
    svc = nc.ServiceNft(chains={"service-BBBBBBBB-shop/web/tcp/http": ["x"]},
                        sets={"affinity-DDDDDDDD-shop/web/tcp/http__10.244.1.1/8080": "type ipv4_addr ;"})
    p = _plan(objs, wanted, svc)
    # the node-wide objects missing from this listing are the only change
    assert "shop/web" not in p.text and "service-BBBBBBBB" not in p.text, p.text


def test_a_key_held_by_another_owner_is_a_conflict_and_nothing_is_written():
    objs = ns.parse_table(LISTING)
    wanted = ns.parse_table(LISTING.replace('10.96.0.12 . tcp . 80 : goto service-CCCCCCCC-shop/api/tcp/http',
                                            '10.96.0.12 . tcp . 80 comment "shop/web" : drop'))
    p = _plan(objs, wanted, nc.ServiceNft())
    assert p.text == "" and p.conflicts == [
        "service-ips 10.96.0.12 . tcp . 80 is held by an element without owner comment"]


def test_comments_are_added_to_every_element():
    svc = nc.ServiceNft()
    svc.element("service-ips", "10.96.0.10 . tcp . 80 : goto service-X")
    svc.element("cluster-ips", "10.96.0.10")
    out = ns.with_comments(svc, "shop/web")
    assert out.elements == {"service-ips": ['10.96.0.10 . tcp . 80 comment "shop/web" : goto service-X'],
                            "cluster-ips": ['10.96.0.10 comment "shop/web"']}
