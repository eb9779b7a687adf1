"""The core's layers, read from the import statements (ast, nothing imported):

- kernel/ (I/O) imports only kernel/ modules and the leaves (errors, names, durations);
- the leaves import nothing of the core but each other;
- the pure compile/plan steps of every mode import no kernel/ module but kernel/text
  (the escaping rules: pure functions);
- no module outside the registry compares the configured mode's name.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

CORE = Path(__file__).resolve().parents[2] / "plugins" / "module_utils" / "proxier"
PKG = "ansible_collections.kubenode.proxy.plugins.module_utils.proxier"
LEAVES = {"errors", "names", "durations"}
PURE_KERNEL = {"kernel.text"}  # escaping and checks of kernel tool input: no I/O


def module_name(path: Path) -> str:
    rel = path.relative_to(CORE).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def core_imports(path: Path):
    """Every core module ``path`` imports (at any depth: lazy imports count), dotted
    relative to the core package, with the line."""
    mod = module_name(path)
    package = mod.split(".")[:-1] if path.name != "__init__.py" else mod.split(".")
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - (node.level - 1)] if node.level > 1 else package
                target = ".".join([*base, *(node.module.split(".") if node.module else [])])
            elif node.module and node.module.startswith(PKG + "."):
                target = node.module[len(PKG) + 1:]
            else:
                continue
            # "from . import text" names a module; "from .ipset import IPSet" a name in one.
            names = [a.name for a in node.names]
            targets = [f"{target}.{n}".lstrip(".") for n in names
                       if (CORE / Path(*f"{target}.{n}".lstrip(".").split("."))).with_suffix(".py").exists()]
            for t in targets or [target]:
                yield t, node.lineno
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith(PKG + "."):
                    yield a.name[len(PKG) + 1:], node.lineno


def files(sub: str = ""):
    return sorted((CORE / sub).rglob("*.py")) if sub else sorted(CORE.glob("*.py"))


def test_the_walk_sees_imports():
    """The walk itself: a kernel module's known imports are found."""
    found = {t for t, _line in core_imports(CORE / "kernel" / "ipset.py")}
    assert {"kernel.text", "names", "errors"} <= found


@pytest.mark.parametrize("path", files("kernel"), ids=lambda p: p.name)
def test_kernel_imports_nothing_above_it(path):
    upward = [f"line {line}: {t}" for t, line in core_imports(path)
              if not (t == "kernel" or t.startswith("kernel.") or t in LEAVES)]
    assert not upward, f"{path.name} imports above kernel/: {upward}"


@pytest.mark.parametrize("leaf", sorted(LEAVES))
def test_leaves_import_only_leaves(leaf):
    bad = [f"line {line}: {t}" for t, line in core_imports(CORE / f"{leaf}.py") if t not in LEAVES]
    assert not bad, f"{leaf}.py is a leaf but imports {bad}"


PURE = [p for p in files("modes") if p.stem in ("compile", "plan", "checked")]


@pytest.mark.parametrize("path", PURE, ids=lambda p: str(p.relative_to(CORE)))
def test_pure_steps_do_no_io(path):
    io = [f"line {line}: {t}" for t, line in core_imports(path)
          if t.startswith("kernel") and t not in PURE_KERNEL]
    assert not io, f"{path.relative_to(CORE)} is pure but imports kernel I/O: {io}"
    text = path.read_text()
    assert not re.search(r"^\s*import (subprocess|socket\.socket)|subprocess\.", text, re.M)


MODE_COMPARE = re.compile(r"""\.mode\s*(==|!=|in|not in)\s*[("']|mode\s*==\s*["'](iptables|ipvs|nftables)["']""")


def test_no_mode_name_compared_outside_the_registry():
    hits = []
    for path in files("."):
        if path.parent == CORE / "modes" and path.name == "__init__.py":
            continue
        for no, line in enumerate(path.read_text().splitlines(), 1):
            if MODE_COMPARE.search(line):
                hits.append(f"{path.relative_to(CORE)}:{no}: {line.strip()}")
    assert not hits, "mode names compared outside modes/__init__.py:\n" + "\n".join(hits)


def test_sysctl_module_loads_alone():
    """kernel/sysctl.py is run by path inside another network namespace (no package
    around it): it must import with the standard library only."""
    import subprocess
    import sys

    code = ("import importlib.util, sys\n"
            "spec = importlib.util.spec_from_file_location('alone', sys.argv[1])\n"
            "mod = importlib.util.module_from_spec(spec)\n"
            "spec.loader.exec_module(mod)\n"
            "print(issubclass(mod.SysctlError, RuntimeError), mod.ensure_here({}, check=True))\n")
    proc = subprocess.run([sys.executable, "-I", "-c", code, str(CORE / "kernel" / "sysctl.py")],
                          capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["True", "{}"]
