"""Bounded YAML (aliases, depth, size; libyaml and pure-Python parsers), named non-object
documents, the config file's bounds, the HTTP servers' header/time/connection limits."""
import io
import socket
import time
import urllib.request

import pytest
import yaml

from ansible_collections.kubenode.proxy.plugins.module_utils.proxier import cli, healthz, strict_yaml
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.config import ConfigError
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.sources.manifests import load_dir, read_file

GOOD = ("apiVersion: v1\nkind: Service\nmetadata: {name: api, namespace: shop}\n"
        "spec: {clusterIP: 10.96.0.11, ports: [{name: http, port: 80, protocol: TCP}]}\n")


def laughs(levels=9):
    lines = ['a0: &a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    lines += [f"a{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


@pytest.fixture(params=[True, False], ids=["libyaml", "python"])
def loader(request):
    return strict_yaml.strict_loader(request.param)


def load(text, loader):
    return list(yaml.load_all(io.StringIO(text), Loader=loader))


def test_libyaml_path_is_the_default():
    assert strict_yaml.strict_loader().__mro__[2:4] == (yaml.composer.Composer, yaml.CSafeLoader)


def test_alias_bomb_is_refused_quickly(loader):
    start = time.monotonic()
    with pytest.raises(yaml.YAMLError, match="aliases expand to more than 100000 nodes"):
        load(laughs(), loader)
    assert time.monotonic() - start < 1.0


def test_modest_aliases_and_merge_keys_still_load(loader):
    docs = load("p: &p [{name: http, port: 80}]\na: *p\nb: *p\n---\nbase: &b {x: 1}\nd: {<<: *b, y: 2}\n", loader)
    assert docs[0]["a"] == docs[0]["b"] == [{"name": "http", "port": 80}] and docs[1]["d"] == {"x": 1, "y": 2}


@pytest.mark.parametrize("text,problem", [
    ("[" * 150 + "]" * 150, "nesting deeper than 100"),
    ("a:\n" + "".join("  " * i + f"k{i}:\n" for i in range(1, 150)) + "  " * 150 + "v\n", "nesting deeper than 100"),
    ("[" * 2_000_000, "nesting deeper than 100"),  # libyaml's own composer would recurse on the C stack
    ("a: &a [*a]\n", "recursive alias"),
])
def test_deep_and_recursive_documents_are_refused(loader, text, problem):
    with pytest.raises(yaml.YAMLError, match=problem):
        load(text, loader)


def test_hundred_levels_are_fine(loader):
    assert load("[" * 100 + "]" * 100, loader)


def test_node_budget_per_document(loader, monkeypatch):
    monkeypatch.setattr(strict_yaml, "MAX_DOCUMENT_NODES", 1000)
    with pytest.raises(yaml.YAMLError, match="more than 1000 nodes in one document"):
        load("[" + "0," * 2000 + "0]", loader)
    assert len(load("[" + "0," * 500 + "0]\n---\n[" + "0," * 500 + "0]", loader)) == 2


def test_manifests_bomb_deep_and_non_objects_are_named_the_rest_loads(tmp_path):
    (tmp_path / "bomb.yaml").write_text(laughs())
    (tmp_path / "deep.yaml").write_text("[" * 150 + "]" * 150)
    (tmp_path / "good.yaml").write_text(GOOD + "---\n- a list\n---\njust a string\n---\n42\n---\n"
                                        "kind: List\nitems: not-a-list\n---\nkind: List\nitems: [7, {kind: Pod}]\n"
                                        "---\n")
    loaded = load_dir(str(tmp_path))
    assert [s.name for s in loaded.services] == ["api"]
    errors = "\n".join(loaded.errors)
    good = tmp_path / "good.yaml"
    for expected in (f"{tmp_path / 'bomb.yaml'}: cannot parse: aliases expand", f"{tmp_path / 'deep.yaml'}: cannot "
                     "parse: nesting deeper than 100", f"{good}#1: the document is a list, not an object",
                     f"{good}#2: the document is a string", f"{good}#3: the document is a number",
                     f"{good}#4: items: expected a list, got a string", f"{good}#5: items[0]: expected an object"):
        assert expected in errors, errors
    assert len(loaded.errors) == 7


def test_json_files_take_the_json_parser_with_the_same_bounds(tmp_path, monkeypatch):
    svc = '{"kind": "Service", "metadata": {"name": "web", "namespace": "d"}, ' \
          '"spec": {"clusterIP": "10.96.0.1", "ports": [{"port": 80}]}}'
    (tmp_path / "a.json").write_text(svc)
    calls = []
    monkeypatch.setattr(strict_yaml, "load_all_list", lambda text: calls.append(text) or [])
    assert [obj["metadata"]["name"] for _origin, obj in read_file(str(tmp_path / "a.json"))] == ["web"]
    assert calls == []  # the C json parser read it, not the (Python) bounded YAML composer
    monkeypatch.undo()
    # Repeated keys and depth are refused as on the YAML path.
    (tmp_path / "dup.json").write_text('{"kind": "Service", "kind": "Node"}')
    with pytest.raises(ValueError, match="duplicate key 'kind'"):
        read_file(str(tmp_path / "dup.json"))
    (tmp_path / "deep.json").write_text("[" * 101 + "]" * 101)
    with pytest.raises(ValueError, match="nesting deeper than 100 levels"):
        read_file(str(tmp_path / "deep.json"))
    (tmp_path / "ok.json").write_text("[" * 100 + "]" * 100)
    assert strict_yaml.load_json((tmp_path / "ok.json").read_text()) is not None
    (tmp_path / "deeper.json").write_text("[" * 5000 + "]" * 5000)  # past the json module's recursion
    with pytest.raises(ValueError, match="nesting deeper"):
        read_file(str(tmp_path / "deeper.json"))
    # A .json file that is YAML is read as YAML, as before.
    (tmp_path / "y.json").write_text("kind: Service\nmetadata: {name: web2, namespace: d}\n"
                                     "spec: {clusterIP: 10.96.0.2, ports: [{port: 80}]}\n")
    assert [obj["metadata"]["name"] for _origin, obj in read_file(str(tmp_path / "y.json"))] == ["web2"]


def test_manifests_file_size_limit(tmp_path):
    path = tmp_path / "big.yaml"
    path.write_text(GOOD + "#" * 1000 + "\n")
    assert len(read_file(str(path))) == 1
    with pytest.raises(ValueError, match=r"more than the limit of 500 \(--manifests-max-file-bytes\)"):
        read_file(str(path), max_bytes=500)
    loaded = load_dir(str(tmp_path), max_bytes=500)
    assert not loaded.services and "big.yaml: cannot parse:" in loaded.errors[0]
    (tmp_path / "big.yaml").write_bytes(b"\xff\xfe" + GOOD.encode())
    assert "not UTF-8" in load_dir(str(tmp_path)).errors[0]


def test_max_file_bytes_flag():
    assert cli.build_parser().parse_args([]).manifests_max_file_bytes == 16 * 1024 * 1024
    assert cli.build_parser().parse_args(["--manifests-max-file-bytes", "1000"]).manifests_max_file_bytes == 1000
    with pytest.raises(SystemExit) as exit_:
        cli.build_parser().parse_args(["--manifests-max-file-bytes", "0"])
    assert exit_.value.code == 2


CFG = "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n"


@pytest.mark.parametrize("content,expected", [
    (b"\x7fELF\x02\x01\x01\x00\x00\x00", "(file): {path} is binary (a NUL byte at 7)"),
    (b"\xff\xfe garbage", "(file): {path} is not UTF-8 text (byte 0)"),
    (b"- a\n- b\n", "(document): expected a mapping, got a list"),
    (b"", "(document): expected a mapping, got an empty document"),
    (CFG.encode() + b"syncPeriod: 0s\n", "syncPeriod: must be greater than 0, got '0s'"),
    (CFG.encode() + b"iptables: {syncPeriod: -5}\n", "iptables.syncPeriod: must be greater than 0, got -5"),
    (CFG.encode() + b"iptables: {syncPeriod: 0s, minSyncPeriod: 0s}\n", "iptables.syncPeriod: must be greater"),
    (CFG.encode() + b"iptables: {minSyncPeriod: -1}\n", "iptables.minSyncPeriod: must be greater than or equal"),
    (CFG.encode() + b"iptables: {syncPeriod: 5s, minSyncPeriod: 10s}\n", "iptables.minSyncPeriod: must not be"),
    (CFG.encode() + b"iptables: {syncPeriod: .inf}\n", "iptables.syncPeriod: inf is out of range"),
    (CFG.encode() + b"iptables: {masqueradeBit: 40}\n", "iptables.masqueradeBit: 40 must be between 0 and 31"),
    (CFG.encode() + b"iptables: {masqueradeBit: '14'}\n", "iptables.masqueradeBit: expected int, got str '14'"),
    (CFG.encode() + b"conntrack: {tcpCloseWaitTimeout: -1s}\n", "conntrack.tcpCloseWaitTimeout: '-1s' is not"),
    (CFG.encode() + b"mode: " + b"x" * 5000 + b"\n", "mode: must be one of iptables, nftables, ipvs, got 'xxx"),
    (CFG.encode() + laughs().encode(), "aliases expand to more than"),
    (CFG.encode() + b"#" * (1024 * 1024), "is larger than 1048576 bytes"),
])
def test_config_file_errors_name_the_field(tmp_path, capsys, content, expected):
    path = tmp_path / "config.yaml"
    path.write_bytes(content)
    assert cli.main(["--config", str(path), "--cleanup"]) == 2
    err = capsys.readouterr().err
    assert expected.format(path=path) in err and "Traceback" not in err, err
    assert len(err) < 600, err  # echoed values are truncated


def test_zero_sync_period_flag_is_refused(capsys):
    args = cli.build_parser().parse_args(["--iptables-sync-period", "0s"])
    with pytest.raises(ConfigError, match="--iptables-sync-period: must be greater than 0"):
        cli.load_config(args)


# --- HTTP servers ------------------------------------------------------------------------

@pytest.fixture
def server():
    srv = healthz.HTTPServerThread("127.0.0.1", 0, lambda method, path: (200, healthz.TEXT_HEADERS, b"ok"), "t")
    srv.start()
    host, port = srv.address.rsplit(":", 1)
    srv.endpoint = (host, int(port))
    yield srv
    srv.stop()


def raw(endpoint, data, timeout=5.0):
    with socket.create_connection(endpoint, timeout=timeout) as s:
        s.sendall(data)
        out = b""
        while True:
            chunk = s.recv(65536)
            if not chunk:
                return out
            out += chunk


def test_oversized_headers_get_431_and_close(server):
    assert raw(server.endpoint, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").startswith(b"HTTP/1.0 200 OK\r\n")
    out = raw(server.endpoint, b"GET / HTTP/1.1\r\n" + b"X-A: " + b"a" * 20000 + b"\r\n\r\n")
    assert out.startswith(b"HTTP/1.0 431 ")
    assert raw(server.endpoint, b"GET /" + b"a" * 20000 + b" HTTP/1.1\r\n\r\n").startswith(b"HTTP/1.0 431 ")
    assert raw(server.endpoint, b"garbage\r\n\r\n").startswith(b"HTTP/1.0 400 ")


def test_slow_client_is_cut_off(server, monkeypatch):
    monkeypatch.setattr(healthz, "REQUEST_TIMEOUT", 0.5)
    with socket.create_connection(server.endpoint, timeout=5) as s:
        start = time.monotonic()
        try:
            for _unused in range(20):  # slowloris: a byte now and then, never the blank line
                s.sendall(b"G")
                time.sleep(0.1)
            closed = s.recv(1) == b""
        except (BrokenPipeError, ConnectionResetError):
            closed = True
        assert closed and time.monotonic() - start < 2.5


def test_connection_bound_drops_the_oldest_idle_one_and_serves(server, monkeypatch):
    monkeypatch.setattr(healthz, "MAX_CONNECTIONS", 50)
    idle = [socket.create_connection(server.endpoint) for _unused in range(80)]
    try:
        with urllib.request.urlopen(f"http://{server.address}/healthz", timeout=3) as resp:
            assert resp.read() == b"ok"
        deadline = time.monotonic() + 3
        while server.connections > 50 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert server.connections <= 50 and server.dropped >= 30
        idle[0].settimeout(3)
        assert idle[0].recv(1) == b""  # the oldest idle one was closed
    finally:
        for s in idle:
            s.close()
