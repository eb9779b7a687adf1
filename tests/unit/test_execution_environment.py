"""meta/execution-environment.yml, requirements-ee.txt and bindep.txt list what the modules need.

The Python side is derived from the code: every import reachable from plugins/modules (through
the module_utils they import, lazy imports inside functions included) that is neither the
standard library nor Ansible must be in requirements-ee.txt, and nothing else may be (the EE
stays minimal). The system side is derived from the modules' documented requirements."""
import ast
import os
import re
import sys

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PREFIX = "ansible_collections.kubenode.proxy."
# Import name -> distribution name, for the imports whose names differ (an import missing here
# and in requirements-ee.txt fails the test by name).
DIST = {"yaml": "PyYAML"}


def _file_of(module):
    path = os.path.join(ROOT, *module[len(PREFIX):].split("."))
    for candidate in (path + ".py", os.path.join(path, "__init__.py")):
        if os.path.isfile(candidate):
            return candidate
    return None


def _imports(path):
    package = PREFIX + os.path.relpath(os.path.dirname(path), ROOT).replace(os.sep, ".")
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = node.module
            yield base
            yield from (base + "." + a.name for a in node.names)


def third_party_imports():
    """{top-level import name: [files importing it]} reachable from the modules."""
    todo = [os.path.join(ROOT, "plugins", "modules", f) for f in os.listdir(os.path.join(ROOT, "plugins", "modules"))
            if f.endswith(".py")]
    seen, found = set(), {}
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        for name in _imports(path):
            if name.startswith(PREFIX):
                target = _file_of(name)
                if target:
                    todo.append(target)
                continue
            top = name.split(".")[0]
            if top in sys.stdlib_module_names or top in ("ansible", "ansible_collections", "__future__"):
                continue
            found.setdefault(top, []).append(os.path.relpath(path, ROOT))
    return found


def _requirement_names(path):
    reqs = {}
    with open(path) as f:
        for line in f:
            line = line.split("#")[0].strip()
            if line:
                name = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", line).group(0)
                reqs[name.lower()] = line
    return reqs


def _ee():
    with open(os.path.join(ROOT, "meta", "execution-environment.yml")) as f:
        return yaml.safe_load(f)


def test_execution_environment_file_points_at_existing_files():
    ee = _ee()
    assert ee["version"] == 1
    deps = ee["dependencies"]
    assert set(deps) == {"python", "system"}
    for key in ("python", "system"):
        assert os.path.isfile(os.path.join(ROOT, deps[key])), deps[key]


def test_python_requirements_are_exactly_what_the_modules_import():
    found = third_party_imports()
    assert "pyroute2" in found, "the scan lost the IPVS/conntrack modules' netlink import"
    wanted = {DIST.get(name, name).lower() for name in found}
    listed = _requirement_names(os.path.join(ROOT, _ee()["dependencies"]["python"]))
    assert wanted - set(listed) == set(), {n: found[n] for n in found if DIST.get(n, n).lower() not in listed}
    assert set(listed) - wanted == set(), "listed but imported by no module (keep the EE minimal)"


def test_python_pins_agree_with_requirements_txt():
    dev = _requirement_names(os.path.join(ROOT, "requirements.txt"))
    for name, spec in _requirement_names(os.path.join(ROOT, _ee()["dependencies"]["python"])).items():
        assert name in dev and dev[name] == spec, (spec, dev.get(name))


def _module_requirements():
    for fname in sorted(os.listdir(os.path.join(ROOT, "plugins", "modules"))):
        if not fname.endswith(".py"):
            continue
        with open(os.path.join(ROOT, "plugins", "modules", fname)) as f:
            tree = ast.parse(f.read())
        docs = [n.value.value for n in tree.body if isinstance(n, ast.Assign)
                and getattr(n.targets[0], "id", None) == "DOCUMENTATION"]
        assert len(docs) == 1, fname
        doc = docs[0]
        for req in yaml.safe_load(doc).get("requirements", []):
            yield fname, req


def test_bindep_lists_the_tools_the_modules_document():
    packages = {}
    with open(os.path.join(ROOT, _ee()["dependencies"]["system"])) as f:
        for line in f:
            line = line.split("#")[0].strip()
            if line:
                m = re.fullmatch(r"([a-z0-9][a-z0-9.+_-]*)(?:\s+\[([^\]]+)\])?", line)
                assert m, "not bindep syntax: %r" % line
                packages[m.group(1)] = (m.group(2) or "").split()
    tools = []
    for fname, req in _module_requirements():
        # "ipset (the command line tool) on the managed host", "iptables (iptables-save ...) on ..."
        m = re.match(r"([\w-]+) \(", req)
        if m and "on the managed host" in req and "Python" not in req:
            tools.append((fname, m.group(1)))
    assert {tool[1] for tool in tools} >= {"iptables", "ipset"}, tools
    for fname, tool in tools:
        assert tool in packages, "%s needs %s, bindep.txt does not list it" % (fname, tool)
        assert "platform:dpkg" in packages[tool] and "platform:rpm" in packages[tool], (tool, packages[tool])


def test_documented_python_libraries_are_in_the_ee():
    listed = _requirement_names(os.path.join(ROOT, _ee()["dependencies"]["python"]))
    for fname, req in _module_requirements():
        m = re.match(r"([\w-]+)\b", req)
        if "Python" in req or m.group(1) in listed:
            assert m.group(1).lower() in listed, (fname, req)
