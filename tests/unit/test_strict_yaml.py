"""Manifests and the config file refuse a mapping with a repeated key (the API's strict
decoding does too), naming the file, the key and both lines; merge keys still work."""
import io

import pytest
import yaml

from ansible_collections.kubenode.proxy.plugins.module_utils.proxier import cli
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.config import ConfigError
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.sources.manifests import load_dir
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.strict_yaml import load, load_all

RUN_TOGETHER = """\
apiVersion: v1
kind: Service
metadata: {name: web, namespace: shop}
spec: {clusterIP: 10.96.0.10, ports: [{name: http, port: 80, protocol: TCP}]}
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
"""


def test_repeated_key_is_an_error_with_both_lines():
    with pytest.raises(yaml.YAMLError) as err:
        load(io.StringIO(RUN_TOGETHER))
    text = str(err.value)
    assert "found duplicate key 'apiVersion' (first at line 1)" in text and "line 5" in text


def test_nested_repeated_key_and_documents():
    with pytest.raises(yaml.YAMLError, match="duplicate key 'port'"):
        list(load_all(io.StringIO("a: 1\n---\nspec:\n  port: 80\n  port: 81\n")))
    assert list(load_all(io.StringIO("a: 1\n---\nb: [1, 2]\n"))) == [{"a": 1}, {"b": [1, 2]}]


def test_merge_keys_may_be_overridden():
    assert load(io.StringIO("base: &b {a: 1, c: 0}\nd:\n  <<: *b\n  c: 2\n"))["d"] == {"a": 1, "c": 2}


def test_manifests_file_with_repeated_key_is_rejected_and_others_load(tmp_path):
    (tmp_path / "bad.yaml").write_text(RUN_TOGETHER)
    (tmp_path / "good.yaml").write_text(
        "apiVersion: v1\nkind: Service\nmetadata: {name: api, namespace: shop}\n"
        "spec: {clusterIP: 10.96.0.11, ports: [{name: http, port: 80, protocol: TCP}]}\n")
    loaded = load_dir(str(tmp_path))
    assert [s.name for s in loaded.services] == ["api"]
    assert len(loaded.errors) == 1 and loaded.errors[0].startswith(f"{tmp_path / 'bad.yaml'}: cannot parse:")
    assert "duplicate key 'apiVersion'" in loaded.errors[0]


def test_config_file_with_repeated_key_is_rejected(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text("apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n"
                    "mode: iptables\nmode: ipvs\n")
    args = cli.build_parser().parse_args(["--config", str(path)])
    with pytest.raises(ConfigError, match="duplicate key 'mode'"):
        cli.load_config(args)
