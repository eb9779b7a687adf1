"""``--once`` reads the manifests directory with the daemon's reader and intake rules."""
import yaml

from ansible_collections.kubenode.proxy.plugins.module_utils.proxier import cli
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.state import ProxyState


def svc(name, ip):
    return {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "namespace": "default"},
            "spec": {"clusterIP": ip, "ports": [{"name": "http", "port": 80, "protocol": "TCP"}]}}


def test_once_uses_the_daemon_rules_later_file_wins_and_rejections_count(tmp_path, capsys):
    (tmp_path / "a.yaml").write_text(yaml.safe_dump_all([svc("web", "10.96.0.10"), svc("Bad_Name", "10.96.0.12")]))
    (tmp_path / "b.yaml").write_text(yaml.safe_dump(svc("web", "10.96.0.11")))
    (tmp_path / "c.yaml").write_text("kind: [unclosed\n")
    state = ProxyState("node1")
    assert cli._reload(state, str(tmp_path)) == 2  # c.yaml, and Service Bad_Name
    assert state.ports_of("default/web")[0].cluster_ip == "10.96.0.11"  # b.yaml is later in load order
    out = capsys.readouterr()
    assert "defined in 2 files" in out.out
    rejected = [line for line in out.err.splitlines() if line.startswith("rejected: ")]
    assert any("c.yaml: cannot parse" in line for line in rejected), out.err
    assert any("Service default/Bad_Name: metadata.name" in line for line in rejected), out.err


def test_once_with_a_missing_directory_fails_without_programming(tmp_path, capsys):
    rc = cli.main(["--once", "--manifests", str(tmp_path / "gone"), "--netns", "no-such-ns-for-this-test"])
    assert rc == 1
    assert "cannot read the manifests" in capsys.readouterr().err
