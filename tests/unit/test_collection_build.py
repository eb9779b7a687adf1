"""`ansible-galaxy collection build` ships what a user needs and no cache or local state.

The checkout is copied (tracked and new files, as scripts/sanity.sh does) and the caches and
local state that tools leave in a working checkout are planted in the copy, so the test
proves build_ignore drops them rather than that a clean checkout has none."""
import json
import os
import shutil
import subprocess
import tarfile

import pytest
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PLANTED = [
    ".ansible/collections/ansible_collections/kubenode/proxy/galaxy.yml",  # ansible-lint without --offline
    ".pytest_cache/v/cache/nodeids", ".ruff_cache/0.14.5/123", ".hypothesis/examples/ab/cd",
    ".benchmarks/Linux-CPython-3.11/0001.json", ".mypy_cache/3.11/x.json",
    "plugins/module_utils/proxier/__pycache__/model.cpython-311.pyc", "tests/unit/.hypothesis/x",
    "tests/output/.tmp/sanity/x.txt", "changelogs/.plugin-cache.yaml", "benchmarks/results/run.tmp",
    "molecule/default/.molecule/state.yml", "kubenode-proxy-0.0.9.tar.gz", "build/lib/x.py",
]
# Directories or files (prefixes of archive member names) that must not ship.
FORBIDDEN = [".ansible", ".pytest_cache", ".ruff_cache", ".hypothesis", ".benchmarks", ".mypy_cache", ".git",
             ".ci", "__pycache__", "tests/output", "tests/unit", "tests/integration", "tests/vm",
             "benchmarks", "molecule", "scripts", "build", "changelogs/fragments", "requirements.txt"]
REQUIRED = ["plugins/modules/k8s_service_iptables.py", "plugins/module_utils/proxier/model.py",
            "plugins/doc_fragments/attributes.py", "roles/kube_proxy/tasks/main.yml", "meta/runtime.yml",
            "meta/execution-environment.yml", "bindep.txt", "requirements-ee.txt", "bin/kubenode-proxy",
            "README.md", "COPYING", "CHANGELOG.rst", "changelogs/changelog.yaml", "docs/role.md",
            "playbooks/site.yml", "playbooks/k8s_info_services.yml", "tests/sanity/ignore-2.19.txt",
            "MANIFEST.json", "FILES.json"]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    if shutil.which("ansible-galaxy") is None or not os.path.exists(os.path.join(ROOT, ".git")):
        pytest.skip("needs ansible-galaxy and a git checkout")
    src = tmp_path_factory.mktemp("checkout")
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           check=True, capture_output=True).stdout.decode().split("\0")
    for rel in filter(None, files):
        if os.path.isfile(os.path.join(ROOT, rel)):
            os.makedirs(os.path.join(src, os.path.dirname(rel)), exist_ok=True)
            shutil.copy2(os.path.join(ROOT, rel), os.path.join(src, rel))
    for rel in PLANTED:
        os.makedirs(os.path.join(src, os.path.dirname(rel)) or src, exist_ok=True)
        with open(os.path.join(src, rel), "w") as f:
            f.write("local state\n")
    out = tmp_path_factory.mktemp("dist")
    subprocess.run(["ansible-galaxy", "collection", "build", "--output-path", str(out), str(src)],
                   check=True, capture_output=True, timeout=120)
    [tarball] = os.listdir(out)
    with tarfile.open(os.path.join(out, tarball)) as tar:
        names = [m.name.rstrip("/") for m in tar.getmembers()]
        manifest = json.load(tar.extractfile("MANIFEST.json"))
    return names, manifest


def test_tarball_has_no_cache_local_state_or_developer_tools(built):
    names = built[0]
    bad = [n for n in names for f in FORBIDDEN
           if n == f or n.startswith(f + "/") or ("/" + f + "/") in ("/" + n + "/")]
    assert not bad, bad
    assert not [n for n in names if os.path.basename(n).startswith(".")], "a hidden file or directory shipped"


def test_tarball_has_what_a_user_needs(built):
    names = built[0]
    missing = [r for r in REQUIRED if r not in names]
    assert not missing, missing
    assert len([n for n in names if n.startswith("plugins/modules/") and n.endswith(".py")]) >= 4


def test_metadata_has_no_placeholder_urls_and_bounded_ansible():
    with open(os.path.join(ROOT, "galaxy.yml")) as f:
        galaxy = yaml.safe_load(f)
    urls = {k: galaxy.get(k) for k in ("repository", "documentation", "homepage", "issues")}
    for key, url in urls.items():
        assert url is None or ("example" not in url and url.startswith("https://")), (key, url)
    assert {"kubernetes", "networking"} <= set(galaxy["tags"])
    with open(os.path.join(ROOT, "meta", "runtime.yml")) as f:
        assert yaml.safe_load(f)["requires_ansible"] == ">=2.19.0,<2.20.0"


def test_manifest_carries_the_metadata(built):
    manifest = built[1]
    info = manifest["collection_info"]
    assert (info["namespace"], info["name"]) == ("kubenode", "proxy")
    assert not any("example.invalid" in str(v) for v in info.values())
