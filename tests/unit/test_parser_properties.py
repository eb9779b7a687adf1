"""Property tests (hypothesis) of the manifest parser and the config parser: whatever the
input, only the declared errors, every rejection names its file or field, bounded time."""
import time

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ansible_collections.kubenode.proxy.plugins.module_utils.proxier import cli, config
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.config import ConfigError
from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.sources.manifests import (
    load_objects,
    read_file_checked,
)

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
scalars = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=30)
KEYS = ["apiVersion", "kind", "metadata", "name", "namespace", "spec", "ports", "port", "protocol", "clusterIP",
        "items", "iptables", "syncPeriod", "minSyncPeriod", "masqueradeBit", "ipvs", "conntrack", "mode",
        "clusterCIDR", "nodePortAddresses", "endpoints", "addresses", "type", "selector", "labels"]
trees = st.recursive(scalars, lambda kids: st.lists(kids, max_size=4)
                     | st.dictionaries(st.sampled_from(KEYS) | st.text(max_size=8), kids, max_size=5), max_leaves=25)
objects = st.fixed_dictionaries({"kind": st.sampled_from(["Service", "EndpointSlice", "Node", "List", "Pod"]),
                                 "apiVersion": st.sampled_from(["v1", "discovery.k8s.io/v1"])},
                                optional={k: trees for k in ("metadata", "spec", "items", "endpoints", "ports")})
yaml_text = st.text(alphabet=st.sampled_from(list("ab: -[]{},&*!|>'\"#\n\t0123456789.?%@`\\")), max_size=200)


def check_file(tmp_path, data: bytes) -> None:
    path = tmp_path / "m.yaml"
    path.write_bytes(data)
    start = time.monotonic()
    try:
        found, errors = read_file_checked(str(path), max_bytes=4096)
    except (yaml.YAMLError, ValueError):  # the declared errors of one file
        return
    assert all(e.startswith(f"{path}#") for e in errors), errors
    loaded = load_objects(found)
    assert all(e.startswith(f"{path}#") for e in loaded.errors + loaded.skipped), loaded.errors + loaded.skipped
    assert time.monotonic() - start < 5


@SETTINGS
@given(text=yaml_text)
def test_manifest_parser_on_generated_yaml_text(tmp_path, text):
    check_file(tmp_path, text.encode())


@SETTINGS
@given(data=st.binary(max_size=300))
def test_manifest_parser_on_arbitrary_bytes(tmp_path, data):
    check_file(tmp_path, data)


@SETTINGS
@given(docs=st.lists(objects | trees, min_size=1, max_size=4))
def test_manifest_parser_on_generated_object_trees(tmp_path, docs):
    check_file(tmp_path, yaml.safe_dump_all(docs).encode())


def config_docs():
    section = st.dictionaries(st.sampled_from(KEYS), trees, max_size=4)
    return st.fixed_dictionaries({"apiVersion": st.just(config.API_VERSION), "kind": st.just(config.KIND)},
                                 optional={k: trees | section for k in ("iptables", "ipvs", "conntrack", "mode",
                                                                        "syncPeriod", "clusterCIDR", "detectLocal",
                                                                        "nodePortAddresses", "healthzBindAddress")})


@SETTINGS
@given(doc=config_docs() | trees)
def test_config_parse_raises_only_config_errors_naming_a_field(doc):
    try:
        cfg = config.parse(doc)
    except ConfigError as e:
        assert e.path and str(e).startswith("KubeProxyConfiguration: ")
        assert len(str(e)) < 700
        return
    assert cfg.sync_period > 0 and 0 <= cfg.min_sync_period <= cfg.sync_period and 0 <= cfg.masquerade_bit <= 31


@SETTINGS
@given(data=st.binary(max_size=300) | yaml_text.map(str.encode)
       | config_docs().map(lambda d: yaml.safe_dump(d).encode()))
def test_load_config_on_arbitrary_file_bytes(tmp_path, data):
    path = tmp_path / "config.yaml"
    path.write_bytes(data)
    args = cli.build_parser().parse_args(["--config", str(path)])
    start = time.monotonic()
    try:
        cli.load_config(args)
    except ConfigError as e:
        assert e.path
    assert time.monotonic() - start < 5
