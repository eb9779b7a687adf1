"""bin/kubenode-proxy's setup_path() as an attacker would try it: another local user (nobody)
prepares the directories the launcher puts on sys.path, with a package that writes a marker
file when it is imported; the launcher runs as root and must neither import it nor use a
directory that user can write (it uses a private one or refuses with exit 2)."""
from __future__ import annotations

import hashlib
import os
import pwd
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, Iterator

import pytest

ROOT = Path(__file__).resolve().parents[2]
BIN = ROOT / "bin" / "kubenode-proxy"
KEY = hashlib.sha256(str(ROOT).encode()).hexdigest()[:12]
NOBODY = 65534

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")


@pytest.fixture
def shared() -> Iterator[Path]:
    """A /tmp-like directory (root-owned, sticky, world-writable) other users can reach."""
    path = Path(tempfile.mkdtemp(prefix="kubenode-launcher-", dir="/tmp"))
    path.chmod(0o1777)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def as_nobody(script: str) -> None:
    """Run a Python snippet as uid/gid nobody (the other local user)."""
    subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
                    sys.executable, "-c", script], check=True, cwd="/", timeout=30)


def plant(collections: Path, marker: Path, top: Path) -> None:
    """As nobody: <collections>/ansible_collections as a regular package whose __init__ writes
    `marker`, with world-writable directories (from `top` down) the launcher would happily add
    its link to."""
    as_nobody(f"""
import os
import pwd
c = {str(collections)!r}
os.makedirs(os.path.join(c, "ansible_collections", "kubenode"), exist_ok=True)
with open(os.path.join(c, "ansible_collections", "__init__.py"), "w") as f:
    f.write("open({str(marker)!r}, 'w').write('planted code ran')\\n")
for d, _, _ in os.walk({str(top)!r}):
    os.chmod(d, 0o777)
""")


def launch(env: Dict[str, str]) -> subprocess.CompletedProcess[str]:
    """The launcher as root; --help imports the core (ansible_collections...cli)."""
    clean = {k: v for k, v in os.environ.items() if k not in ("TMPDIR", "XDG_CACHE_HOME", "PYTHONPATH")}
    return subprocess.run([sys.executable, str(BIN), "--help"], capture_output=True, text=True,
                          env={**clean, **env}, timeout=60, check=False)


def test_code_planted_where_the_old_launcher_looked_does_not_run(shared: Path) -> None:
    # The old launcher used $TMPDIR/kubenode-proxy-<uid>/<sha of checkout>/collections.
    marker = shared / "marker"
    top = shared / f"kubenode-proxy-{os.getuid()}"
    plant(top / KEY / "collections", marker, top)
    proc = launch({"TMPDIR": str(shared)})
    assert not marker.exists(), "code planted by another user ran as root"
    assert proc.returncode == 0, proc.stderr
    assert "usage: kubenode-proxy" in proc.stdout


@pytest.fixture
def outside_tmp() -> Iterator[Path]:
    """A root-owned 0755 directory outside the sticky /tmp, so that the first unsafe
    component the launcher meets is the one the test makes (in /run: root-owned, 0755)."""
    path = Path(tempfile.mkdtemp(prefix="kubenode-launcher-", dir="/run"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def test_a_cache_directory_another_user_owns_is_refused(outside_tmp: Path) -> None:
    # E.g. `sudo -E` keeping a user's XDG_CACHE_HOME: that user prepared the link's parents.
    marker = outside_tmp / "marker"
    cache = outside_tmp / "nobody-cache"
    cache.mkdir()
    os.chown(cache, NOBODY, NOBODY)
    plant(cache / "kubenode-proxy" / KEY / "collections", marker, cache)
    proc = launch({"XDG_CACHE_HOME": str(cache)})
    assert not marker.exists(), "code planted by another user ran as root"
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert proc.stderr == ("kubenode-proxy: refusing to import code from an unsafe place: "
                           f"{cache} is owned by uid {NOBODY}, not by uid 0 or root\n")


def test_a_group_writable_directory_on_the_way_is_refused(outside_tmp: Path) -> None:
    # Root-owned but group-writable (not sticky): any member of the group could plant code.
    cache = outside_tmp / "root-owned"
    cache.mkdir(mode=0o700)
    (cache / "kubenode-proxy").mkdir(mode=0o700)
    (cache / "kubenode-proxy").chmod(0o770)
    proc = launch({"XDG_CACHE_HOME": str(cache)})
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert f"{cache}/kubenode-proxy is writable by group or others (mode 0770)\n" in proc.stderr


@pytest.fixture
def private() -> Iterator[Path]:
    """A root-owned 0700 directory directly in /tmp (the only kind a sticky parent allows)."""
    path = Path(tempfile.mkdtemp(prefix="kubenode-launcher-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def test_a_private_directory_below_a_sticky_one_is_accepted_and_made_private(private: Path) -> None:
    cache = private / "cache"
    old = os.umask(0)  # the launcher must not rely on the umask for the directories it makes
    try:
        proc = launch({"XDG_CACHE_HOME": str(cache)})
    finally:
        os.umask(old)
    assert proc.returncode == 0, proc.stderr
    collections = cache / "kubenode-proxy" / KEY / "collections"
    for d in (cache, cache / "kubenode-proxy", cache / "kubenode-proxy" / KEY, collections,
              collections / "ansible_collections", collections / "ansible_collections" / "kubenode"):
        st = d.lstat()
        assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (0, 0o700), d
    assert os.path.realpath(collections / "ansible_collections" / "kubenode" / "proxy") == str(ROOT)


def test_a_root_directory_below_a_sticky_one_is_accepted_one_of_another_user_is_not(private: Path) -> None:
    # Ours and 0755 directly in /tmp (a checkout cloned there, as CI may): nobody else can
    # rename it (sticky /tmp) or write in it, so it is accepted.
    private.chmod(0o755)
    proc = launch({"XDG_CACHE_HOME": str(private / "cache")})
    assert proc.returncode == 0, proc.stderr
    # The same directory owned by another user: refused, whatever its mode.
    nobody = pwd.getpwnam("nobody")
    os.chown(private, nobody.pw_uid, nobody.pw_gid)
    proc = launch({"XDG_CACHE_HOME": str(private / "cache")})
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert "/tmp is writable by group or others (mode 1777); below a sticky directory only a directory of " \
           "uid 0 or root is accepted" in proc.stderr


def test_without_a_usable_home_a_fresh_private_directory_is_used_and_removed(private: Path) -> None:
    blocker = private / "a-file"
    blocker.write_text("")
    proc = launch({"XDG_CACHE_HOME": str(blocker / "cache"), "TMPDIR": str(private)})
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in private.iterdir()) == ["a-file"], "temporary directory left behind"


@pytest.fixture
def copy_of_checkout(private: Path) -> Path:
    """bin/ and plugins/ of this checkout copied into a private root-owned directory."""
    for top in ("bin", "plugins"):
        shutil.copytree(ROOT / top, private / top, ignore=shutil.ignore_patterns("__pycache__"))
    return private


def run_copy(checkout: Path, cache: Path) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if k not in ("TMPDIR", "XDG_CACHE_HOME", "PYTHONPATH")}
    return subprocess.run([sys.executable, str(checkout / "bin" / "kubenode-proxy"), "--help"], capture_output=True,
                          text=True, env={**clean, "XDG_CACHE_HOME": str(cache)}, timeout=60, check=False)


def test_a_module_dropped_beside_the_command_does_not_shadow_the_standard_library(copy_of_checkout: Path) -> None:
    # bin/ is sys.path[0] for the script; a hashlib.py there would have run before any check.
    marker = copy_of_checkout / "marker"
    (copy_of_checkout / "bin" / "hashlib.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    proc = run_copy(copy_of_checkout, copy_of_checkout / "cache")
    assert proc.returncode == 0, proc.stderr
    assert not marker.exists()


def test_code_inside_the_collection_writable_by_others_is_refused(copy_of_checkout: Path) -> None:
    target = copy_of_checkout / "plugins" / "module_utils" / "proxier" / "cli.py"
    assert run_copy(copy_of_checkout, copy_of_checkout / "cache").returncode == 0
    target.chmod(0o664)  # a checkout made with umask 002: anyone in the group could edit it
    proc = run_copy(copy_of_checkout, copy_of_checkout / "cache")
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert f"{target} is writable by group or others (mode 0664)" in proc.stderr
    target.chmod(0o644)
    os.chown(target, NOBODY, NOBODY)
    proc = run_copy(copy_of_checkout, copy_of_checkout / "cache")
    assert proc.returncode == 2 and f"{target} is owned by uid {NOBODY}" in proc.stderr
