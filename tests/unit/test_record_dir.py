"""--record-dir: where a clean shutdown records the rules it leaves (iptables mode)."""
import pytest

from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.cli import build_parser
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.kernel.iptables import IptablesKernel
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.modes.iptables.compile import IptablesConfig
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.modes.iptables.proxier import IptablesProxier
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.provider import RECORD_DIR
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.state import ProxyState


def test_default_is_run_kubenode_proxy_and_a_directory_is_normalized(tmp_path):
    assert RECORD_DIR == "/run/kubenode-proxy"
    assert build_parser().parse_args([]).record_dir == RECORD_DIR
    assert build_parser().parse_args(["--record-dir", f"{tmp_path}/a//b/"]).record_dir == f"{tmp_path}/a/b"


@pytest.mark.parametrize("bad", ["", "relative/dir", "./run"])
def test_a_relative_path_is_refused(bad, capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["--record-dir", bad])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--record-dir" in err and "is not an absolute path" in err


def test_a_file_is_refused(tmp_path, capsys):
    f = tmp_path / "file"
    f.write_text("")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--record-dir", str(f)])
    assert "exists and is not a directory" in capsys.readouterr().err


def test_the_proxier_records_in_the_directory_given(tmp_path):
    proxier = IptablesProxier(ProxyState("node1"), IptablesConfig(), IptablesKernel(netns=""))
    path = proxier.record_path(str(tmp_path / "run"))
    assert path.startswith(f"{tmp_path}/run/iptables-applied-iptables-netns") and path.endswith(".json")
    assert proxier.record_path().startswith(RECORD_DIR + "/")
