"""The kube_proxy role's templates and computed variables, rendered on localhost by
ansible-playbook (no node, no root): the KubeProxyConfiguration parses with the daemon's
own parser, the kubeconfig loads with the real kubernetes client, the unit and the boot
files say what the mode needs. The role on real nodes is tested by molecule (molecule/)."""
from __future__ import annotations

import base64
import json
import os
import subprocess
import sys

import yaml

from ansible_collections.kubenode.proxy.plugins.module_utils.proxier import config as kpconfig

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ROLE = os.path.join(ROOT, "roles", "kube_proxy")
TEMPLATES = ("config.yaml.j2", "kubeconfig.j2", "kubenode-proxy.service.j2", "kubenode-proxy.sh.j2",
             "sysctl.conf.j2", "modules-load.conf.j2")
CA = "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"


def render(tmp_path, **extra):
    """Render every template of the role with ``extra`` as extra vars; return {name: text}
    and the computed variables."""
    out = tmp_path / "out"
    out.mkdir()
    play = [{
        "hosts": "localhost", "gather_facts": False,
        "vars_files": [os.path.join(ROLE, "defaults", "main.yml"), os.path.join(ROLE, "vars", "main.yml")],
        "vars": {"role_path": ROLE, "kube_proxy__has_br_netfilter": True,
                 "kube_proxy__sysctls": "{{ kube_proxy__sysctls_mode }}"},
        "tasks": [
            {"ansible.builtin.template": {"src": os.path.join(ROLE, "templates", name),
                                          "dest": str(out / name[:-3]), "mode": "0600"}}
            for name in TEMPLATES
        ] + [{"ansible.builtin.copy": {
            "dest": str(out / "computed.json"), "mode": "0600",
            "content": "{{ {'sysctls': kube_proxy__sysctls_mode, 'modules': kube_proxy__modules, "
                       "'args': kube_proxy__args, 'healthz': kube_proxy__healthz_url, "
                       "'packages': kube_proxy__os_packages} | to_json }}"}}],
    }]
    (tmp_path / "play.yml").write_text(yaml.safe_dump(play))
    extra["ansible_python_interpreter"] = sys.executable
    extra.setdefault("ansible_facts", {"os_family": "Debian", "kernel": "6.1.0-50-amd64"})
    (tmp_path / "extra.json").write_text(json.dumps(extra))
    env = dict(os.environ, ANSIBLE_LOCALHOST_WARNING="False", ANSIBLE_INVENTORY_UNPARSED_WARNING="False")
    proc = subprocess.run(["ansible-playbook", "-i", "localhost,", "-c", "local", str(tmp_path / "play.yml"),
                           "-e", f"@{tmp_path / 'extra.json'}"], capture_output=True, text=True, env=env,
                          check=False, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    files = {name[:-3]: (out / name[:-3]).read_text() for name in TEMPLATES}
    return files, json.loads((out / "computed.json").read_text())


def test_iptables_mode_with_manifests(tmp_path):
    files, computed = render(tmp_path, kube_proxy_source="manifests", kube_proxy_cluster_cidr=["10.244.0.0/16"])
    cfg = kpconfig.parse(yaml.safe_load(files["config.yaml"]))
    assert (cfg.mode, cfg.cluster_cidrs, cfg.kubeconfig) == ("iptables", ("10.244.0.0/16",), "")
    assert cfg.conntrack.max_per_core == 32768 and cfg.conntrack.tcp_established_timeout == 86400
    assert computed["sysctls"] == {"net.ipv4.ip_forward": "1", "net.ipv4.conf.all.route_localnet": "1"}
    assert computed["modules"] == ["nf_conntrack"]
    assert computed["args"] == ["--config", "/etc/kubenode-proxy/config.yaml",
                                "--manifests", "/etc/kubenode-proxy/manifests"]
    unit = files["kubenode-proxy.service"]
    assert ("ExecStart=/usr/local/bin/kubenode-proxy --config /etc/kubenode-proxy/config.yaml "
            "--manifests /etc/kubenode-proxy/manifests") in unit
    assert "CapabilityBoundingSet=CAP_NET_ADMIN CAP_NET_RAW\n" in unit
    assert "ProtectKernelTunables=yes" in unit and "ProtectSystem=strict" in unit
    # /run is read-only under ProtectSystem=strict: the restart record's directory is the
    # unit's runtime directory, kept across restarts.
    assert "RuntimeDirectory=kubenode-proxy\nRuntimeDirectoryMode=0700\nRuntimeDirectoryPreserve=yes\n" in unit
    assert "net.ipv4.conf.all.route_localnet = 1" in files["sysctl.conf"]
    assert files["modules-load.conf"].split("\n")[2:4] == ["nf_conntrack", "br_netfilter"]
    assert "exec /opt/kubenode-proxy/venv/bin/python /opt/kubenode-proxy/collections/ansible_collections/" \
           "kubenode/proxy/bin/kubenode-proxy" in files["kubenode-proxy.sh"]


def test_ipvs_mode_with_a_built_kubeconfig(tmp_path):
    from kubernetes import config as kconfig

    files, computed = render(
        tmp_path, kube_proxy_mode="ipvs", kube_proxy_ipvs_scheduler="lc", kube_proxy_ipvs_strict_arp=True,
        kube_proxy_api_server="https://k8s.example:6443", kube_proxy_api_ca_cert=CA, kube_proxy_api_token="t0ken",
        kube_proxy_healthz_bind_address="0.0.0.0:10256", kube_proxy_config_extra={"iptables": {"masqueradeAll": True}},
        ansible_facts={"os_family": "Debian", "kernel": "5.4.0-100-generic"})
    cfg = kpconfig.parse(yaml.safe_load(files["config.yaml"]))
    assert (cfg.mode, cfg.ipvs.scheduler, cfg.ipvs.strict_arp, cfg.masquerade_all) == ("ipvs", "lc", True, True)
    assert cfg.kubeconfig == "/etc/kubenode-proxy/kubeconfig"
    assert computed["sysctls"]["net.ipv4.vs.conn_reuse_mode"] == "0"  # kernel 4.1 to 5.8 only
    assert computed["sysctls"]["net.ipv4.conf.all.arp_ignore"] == "1"
    assert "net.ipv4.conf.all.route_localnet" not in computed["sysctls"]
    assert {"ip_vs", "ip_vs_rr", "ip_vs_lc", "dummy"} <= set(computed["modules"])
    assert {"ipset", "ipvsadm"} <= set(computed["packages"])
    assert computed["healthz"] == "http://127.0.0.1:10256/healthz"
    assert "ProtectKernelTunables=no" in files["kubenode-proxy.service"]
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(files["kubeconfig"])
    client = kconfig.new_client_from_config(config_file=str(kubeconfig))
    assert client.configuration.host == "https://k8s.example:6443"
    assert client.configuration.api_key == {"BearerToken": "Bearer t0ken"}
    ca = yaml.safe_load(files["kubeconfig"])["clusters"][0]["cluster"]["certificate-authority-data"]
    assert base64.b64decode(ca).decode() == CA


def test_kubeconfig_given_whole(tmp_path):
    whole = {"apiVersion": "v1", "kind": "Config", "current-context": "x"}
    files, _computed = render(tmp_path, kube_proxy_kubeconfig_content=whole)
    assert yaml.safe_load(files["kubeconfig"]) == whole
    (tmp_path / "as-text").mkdir()
    files, _computed = render(tmp_path / "as-text", kube_proxy_kubeconfig_content="apiVersion: v1\nkind: Config\n")
    assert yaml.safe_load(files["kubeconfig"]) == {"apiVersion": "v1", "kind": "Config"}
