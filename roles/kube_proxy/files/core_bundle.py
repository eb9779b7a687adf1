# Copyright (c) kubenode.proxy contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Pack the collection's core for a node: bin/kubenode-proxy and the
plugins/module_utils/proxier package (Python sources only, no caches) into one tar file
whose bytes depend only on the files' contents: sorted names, fixed times, owner root,
modes 0755 (directories, the command) and 0644. Runs on the Ansible controller:

    core_bundle.py COLLECTION_ROOT OUT.tar

The role unpacks it on the node with ansible.builtin.unarchive, which compares the
archive with what is there (tar --diff) and reports a change only when a file differs.
"""

import os
import sys
import tarfile

MTIME = 1767225600  # 2026-01-01T00:00:00Z: fixed, so that unchanged files compare equal
INCLUDE = ("bin/kubenode-proxy", "plugins/module_utils/proxier")
EXECUTABLE = ("bin/kubenode-proxy",)


def members(root):
    """Relative paths to pack: every parent directory, the command, the package's .py files."""
    out = set()
    for top in INCLUDE:
        path = os.path.join(root, top)
        if os.path.isfile(path):
            out.add(top)
            continue
        if not os.path.isdir(path):
            raise SystemExit(f"core_bundle: {path} is missing (not a kubenode.proxy collection root?)")
        for here, dirs, files in os.walk(path):
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            rel = os.path.relpath(here, root)
            out.add(rel)
            out.update(os.path.join(rel, f) for f in files if f.endswith(".py"))
    for name in list(out):
        parent = os.path.dirname(name)
        while parent:
            out.add(parent)
            parent = os.path.dirname(parent)
    return sorted(out)


def info(root, name):
    path = os.path.join(root, name)
    ti = tarfile.TarInfo(name)
    ti.mtime = MTIME
    ti.uid = ti.gid = 0
    ti.uname = ti.gname = "root"
    if os.path.isdir(path):
        ti.type = tarfile.DIRTYPE
        ti.mode = 0o755
    else:
        ti.size = os.path.getsize(path)
        ti.mode = 0o755 if name in EXECUTABLE else 0o644
    return ti


def main(argv):
    if len(argv) != 3:
        sys.stderr.write("usage: core_bundle.py COLLECTION_ROOT OUT.tar\n")
        return 2
    root, out = os.path.realpath(argv[1]), argv[2]
    tmp = f"{out}.{os.getpid()}"
    with tarfile.open(tmp, "w", format=tarfile.USTAR_FORMAT) as tar:
        for name in members(root):
            ti = info(root, name)
            if ti.isdir():
                tar.addfile(ti)
            else:
                with open(os.path.join(root, name), "rb") as fh:
                    tar.addfile(ti, fh)
    os.replace(tmp, out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
