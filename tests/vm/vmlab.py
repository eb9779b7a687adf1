"""VM lab: throw-away Debian bookworm VMs under qemu (software emulation) for tests that
need a real node kernel (IPVS, systemd, the role over SSH).

Image
    :func:`ensure_image` builds, once, a Debian bookworm image with the stock kernel
    (``debootstrap --variant=minbase``), bakes an offline wheelhouse and a test venv into
    it, and caches it outside the repository in ``<cache root>/<key>/`` where ``key`` is
    the sha256 of every input (suite, package list, guest files, masked units, kernel
    command line, recipe version, the guest requirements). Cache root:
    ``$KUBENODE_VMLAB_CACHE``, else ``/var/cache/kubenode-proxy/vmlab`` (root) or
    ``~/.cache/kubenode-proxy/vmlab``. A cache entry holds::

        disk.raw        ext4 root file system (sparse raw; never written: VMs use overlays)
        vmlinuz         the guest kernel (booted with -kernel)
        initrd.img      its initramfs (virtio + ext4 only, for a fast boot)
        id_ed25519      root's SSH key for every VM of this image (0600), and .pub
        wheelhouse/     the offline wheelhouse (+ requirements.txt); the same files are in
                        the image at /var/cache/kubenode-wheelhouse
        manifest.json   inputs, build step timings, package versions

    The build runs in a temporary directory beside the cache entry, under a lock file
    (``<key>.lock``), and is renamed into place atomically when complete.

    In the guest: ``/opt/kubenode-test-venv`` (pytest, pyroute2, kubernetes, PyYAML,
    jmespath; installed with ``pip install --no-index --find-links`` from the wheelhouse),
    ``/var/cache/kubenode-wheelhouse`` (for roles that build the daemon's venv offline),
    root SSH login with the image key, DHCP on eth0 (``net.ifnames=0``) via
    systemd-networkd, journald in memory, periodic jobs masked.

VMs
    :class:`VMLab` boots N VMs (``qemu-system-x86_64 -accel tcg``; /dev/kvm is not used),
    each on its own qcow2 overlay in a temporary directory, with user-mode networking and
    an SSH port forward on a free 127.0.0.1 port, waits until SSH answers, writes an
    Ansible inventory and always tears everything down again (context manager, atexit,
    parent-death signal, and a state file in ``$KUBENODE_VMLAB_STATE_DIR`` or
    ``/run/kubenode-vmlab`` so that ``vmlab.py down`` or a later run kills leftovers).
    :class:`VM` runs commands in the guest (:meth:`VM.ssh`), copies files
    (:meth:`VM.put`, :meth:`VM.get`) and the repository checkout (:meth:`VM.put_repo`).

Command line::

    python3 tests/vm/vmlab.py image [--rebuild]       # build (or find) the cached image
    python3 tests/vm/vmlab.py up [-n 2] [--foreground] # boot VMs, print the inventory
    python3 tests/vm/vmlab.py ssh [--lab ID] [VM] [-- COMMAND...]
    python3 tests/vm/vmlab.py status | down [ID...] | prune
"""

from __future__ import annotations

import argparse
import atexit
import concurrent.futures
import contextlib
import ctypes
import fcntl
import hashlib
import json
import os
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parent.parent
GUEST_REQUIREMENTS = HERE / "requirements-guest.txt"

# ----------------------------------------------------------------- image recipe
# Everything in this section is part of the image cache key. Bump RECIPE_VERSION when
# the build procedure (code below) changes in a way that the data here does not show.
RECIPE_VERSION = 1
SUITE = "bookworm"
ARCH = "amd64"
PACKAGES = (
    "systemd", "systemd-sysv", "udev", "dbus", "python3", "python3-venv", "python3-pip",
    "iproute2", "kmod", "ipvsadm", "iptables", "nftables", "ipset", "conntrack", "curl",
    "procps", "linux-image-amd64", "openssh-server", "ifupdown", "isc-dhcp-client", "sudo",
    "ca-certificates", "less", "iputils-ping",
)
DISK_SIZE = "4G"
HOSTNAME = "kubenode-vm"
GUEST_VENV = "/opt/kubenode-test-venv"
GUEST_PYTHON = f"{GUEST_VENV}/bin/python"
GUEST_WHEELHOUSE = "/var/cache/kubenode-wheelhouse"
GUEST_REPO = "/root/kubenode.proxy"
SSH_KEY_SCHEME = "ed25519 key pair generated per image, public half in /root/.ssh/authorized_keys"
WHEEL_TARGET = {  # what `pip download` fetches for: the guest's python3 (bookworm: 3.11)
    "python_version": "3.11",
    "implementation": "cp",
    "abis": ("cp311", "abi3", "none"),
    "platforms": tuple(f"manylinux_2_{minor}_x86_64" for minor in range(36, 16, -1))
    + ("manylinux2014_x86_64", "linux_x86_64"),
}
KERNEL_APPEND = (
    "root=/dev/vda rw rootfstype=ext4 console=ttyS0 net.ifnames=0 biosdevname=0 panic=-1 "
    "loglevel=4 systemd.show_status=error tsc=reliable mitigations=off"
)
GUEST_FILES: dict[str, tuple[int, str]] = {
    "/etc/hostname": (0o644, f"{HOSTNAME}\n"),
    "/etc/hosts": (0o644, f"127.0.0.1 localhost\n127.0.1.1 {HOSTNAME}\n::1 localhost ip6-localhost ip6-loopback\n"),
    "/etc/fstab": (0o644, "/dev/vda / ext4 rw,noatime,errors=remount-ro 0 0\n"),  # no fsck: a fresh overlay
    "/etc/resolv.conf": (0o644, "nameserver 10.0.2.3\n"),  # qemu user-mode DNS
    # The virtio NIC is eth0 (net.ifnames=0); match the predictable names too.
    "/etc/systemd/network/10-vmlab.network": (0o644, (
        "[Match]\nName=eth* en*\n\n[Network]\nDHCP=ipv4\nLinkLocalAddressing=no\nIPv6AcceptRA=no\n"
    )),
    "/etc/network/interfaces": (0o644, (
        "# The VM lab configures eth0 with systemd-networkd (/etc/systemd/network).\n"
        "auto lo\niface lo inet loopback\nsource /etc/network/interfaces.d/*\n"
    )),
    "/etc/ssh/sshd_config.d/kubenode-vmlab.conf": (0o644, (
        "PermitRootLogin prohibit-password\nPasswordAuthentication no\nKbdInteractiveAuthentication no\n"
        "UseDNS no\nGSSAPIAuthentication no\nMaxStartups 100\nMaxSessions 100\n"
    )),
    "/etc/systemd/journald.conf.d/kubenode-vmlab.conf": (0o644, "[Journal]\nStorage=volatile\n"),
    "/etc/systemd/system.conf.d/kubenode-vmlab.conf": (0o644, "[Manager]\nDefaultTimeoutStartSec=60s\n"),
    # A small initramfs: only what mounting /dev/vda needs (faster to load and unpack).
    "/etc/initramfs-tools/conf.d/kubenode-vmlab.conf": (0o644, "MODULES=list\n"),
    "/etc/initramfs-tools/modules": (0o644, "virtio_pci\nvirtio_blk\next4\n"),
    "/etc/apt/apt.conf.d/90kubenode-vmlab": (0o644, 'APT::Install-Recommends "false";\n'),
    # Drivers udev would load for emulated hardware the tests never use (each costs boot
    # time under emulation). Explicit `modprobe` still works; IPVS/netfilter are untouched.
    "/etc/modprobe.d/kubenode-vmlab-blacklist.conf": (0o644, "".join(f"blacklist {name}\n" for name in (
        "kvm_amd", "kvm_intel", "kvm", "ccp", "floppy", "pcspkr", "ata_piix", "ata_generic", "i2c_piix4",
        "cfg80211", "psmouse", "serio_raw", "drm", "aesni_intel", "ghash_clmulni_intel", "sha1_ssse3",
        "sha256_ssse3", "sha512_ssse3", "crc32_pclmul", "crct10dif_pclmul", "efi_pstore",
    ))),
}
MASKED_UNITS = (
    "apt-daily.timer", "apt-daily-upgrade.timer", "dpkg-db-backup.timer", "e2scrub_all.timer",
    "e2scrub_reap.service", "fstrim.timer", "logrotate.timer", "man-db.timer",
    "systemd-networkd-wait-online.service", "networking.service", "ifupdown-pre.service",
    "systemd-timesyncd.service", "getty@tty1.service",
    # Not needed by the tests (root's systemctl talks to PID 1 directly; D-Bus stays
    # socket-activated): cuts the boot's CPU time under emulation.
    "systemd-logind.service", "systemd-binfmt.service", "proc-sys-fs-binfmt_misc.automount",
    "proc-sys-fs-binfmt_misc.mount", "modprobe@drm.service", "modprobe@efi_pstore.service",
    "modprobe@fuse.service", "modprobe@loop.service", "modprobe@dm_mod.service", "sys-fs-fuse-connections.mount",
)
ENABLED_UNITS = ("systemd-networkd.service", "ssh.service")

# ----------------------------------------------------------------- runtime settings
MEMORY_MB = 1024
SMP = 2
BOOT_TIMEOUT = float(os.environ.get("KUBENODE_VMLAB_BOOT_TIMEOUT", "600"))
COMMAND_TIMEOUT = 600.0
STATE_DIR = Path(os.environ.get("KUBENODE_VMLAB_STATE_DIR", "/run/kubenode-vmlab"))
NAME_PREFIX = "kubenode-vmlab"
SSH_OPTIONS = (
    "-o", "BatchMode=yes",
    "-o", "StrictHostKeyChecking=no",
    "-o", "UserKnownHostsFile=/dev/null",
    "-o", "LogLevel=ERROR",
    "-o", "ConnectTimeout=20",
    "-o", "ServerAliveInterval=10",
    "-o", "ServerAliveCountMax=6",
    "-o", "IdentitiesOnly=yes",
)
CHROOT_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "HOME": "/root",
    "LANG": "C.UTF-8",
    "DEBIAN_FRONTEND": "noninteractive",
}


class VMLabError(RuntimeError):
    """Something in the VM lab failed; the message says what, with logs where useful."""


def log(message: str) -> None:
    print(f"[vmlab {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def run(argv: Sequence[str], *, check: bool = True, timeout: float | None = COMMAND_TIMEOUT,
        env: dict[str, str] | None = None, capture: bool = True,
        input: str | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` (never through a shell); raise VMLabError with its output on failure."""
    argv = [str(arg) for arg in argv]
    try:
        proc = subprocess.run(argv, check=False, timeout=timeout, env=env, text=True, input=input,
                              stdout=subprocess.PIPE if capture else None,
                              stderr=subprocess.PIPE if capture else None,
                              stdin=None if input is not None else subprocess.DEVNULL)
    except subprocess.TimeoutExpired as exc:
        raise VMLabError(f"timed out after {timeout}s: {shlex.join(argv)}") from exc
    if check and proc.returncode != 0:
        output = "\n".join(part.strip() for part in (proc.stdout or "", proc.stderr or "") if part.strip())
        raise VMLabError(f"command failed (rc={proc.returncode}): {shlex.join(argv)}\n{output[-4000:]}".rstrip())
    return proc


# ================================================================== the image


def default_cache_root() -> Path:
    """Where images are cached (never inside the repository)."""
    if os.environ.get("KUBENODE_VMLAB_CACHE"):
        return Path(os.environ["KUBENODE_VMLAB_CACHE"])
    if os.geteuid() == 0:
        return Path("/var/cache/kubenode-proxy/vmlab")
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kubenode-proxy" / "vmlab"


def recipe(requirements: Path = GUEST_REQUIREMENTS) -> dict[str, Any]:
    """Every input of the image build (what the cache key is computed from)."""
    return {
        "recipe_version": RECIPE_VERSION,
        "suite": SUITE,
        "arch": ARCH,
        "packages": sorted(PACKAGES),
        "disk_size": DISK_SIZE,
        "guest_files": {path: [mode, text] for path, (mode, text) in sorted(GUEST_FILES.items())},
        "masked_units": sorted(MASKED_UNITS),
        "enabled_units": sorted(ENABLED_UNITS),
        "kernel_append": KERNEL_APPEND,
        "guest_venv": GUEST_VENV,
        "guest_wheelhouse": GUEST_WHEELHOUSE,
        "ssh_key": SSH_KEY_SCHEME,
        "wheel_target": {key: list(value) if isinstance(value, tuple) else value
                         for key, value in WHEEL_TARGET.items()},
        "requirements": requirements.read_text(),
    }


def image_key(requirements: Path = GUEST_REQUIREMENTS) -> str:
    blob = json.dumps(recipe(requirements), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


@dataclass(frozen=True)
class Image:
    """A built, cached image (a directory of the cache)."""

    root: Path

    @property
    def key(self) -> str:
        return self.root.name

    @property
    def disk(self) -> Path:
        return self.root / "disk.raw"

    @property
    def kernel(self) -> Path:
        return self.root / "vmlinuz"

    @property
    def initrd(self) -> Path:
        return self.root / "initrd.img"

    @property
    def ssh_key(self) -> Path:
        return self.root / "id_ed25519"

    @property
    def wheelhouse(self) -> Path:
        """Host path of the offline wheelhouse (same files as GUEST_WHEELHOUSE in the guest)."""
        return self.root / "wheelhouse"

    @property
    def manifest_path(self) -> Path:
        return self.root / "manifest.json"

    def manifest(self) -> dict[str, Any]:
        return json.loads(self.manifest_path.read_text())

    def complete(self) -> bool:
        return all(path.exists() for path in (self.disk, self.kernel, self.initrd, self.ssh_key,
                                              self.manifest_path))


def find_image(*, cache: Path | None = None, requirements: Path = GUEST_REQUIREMENTS) -> Image | None:
    """The cached image for the current recipe, or None if it has not been built."""
    image = Image((cache or default_cache_root()) / image_key(requirements))
    return image if image.complete() else None


def missing_build_tools() -> list[str]:
    return [tool for tool in ("debootstrap", "mkfs.ext4", "unshare", "ssh-keygen", "chroot")
            if shutil.which(tool) is None]


def missing_boot_tools() -> list[str]:
    return [tool for tool in ("qemu-system-x86_64", "qemu-img", "ssh", "tar")
            if shutil.which(tool) is None]


def unavailable_reason(*, cache: Path | None = None) -> str | None:
    """Why VMs cannot be booted on this machine, or None if they can."""
    missing = missing_boot_tools()
    if find_image(cache=cache) is None:
        missing += missing_build_tools()
        if os.geteuid() != 0:
            return "building the VM image needs root (debootstrap, chroot)"
    if missing:
        return (f"VM lab tools missing: {', '.join(missing)} (Debian packages: qemu-system-x86 "
                "qemu-utils debootstrap openssh-client e2fsprogs util-linux tar)")
    return None


def host_mirror(suite: str = SUITE) -> str | None:
    """The Debian mirror the host's apt uses for ``suite`` (None: debootstrap's default)."""
    if os.environ.get("KUBENODE_VMLAB_MIRROR"):
        return os.environ["KUBENODE_VMLAB_MIRROR"]
    sources = [Path("/etc/apt/sources.list"), *sorted(Path("/etc/apt/sources.list.d").glob("*"))]
    for path in sources:
        try:
            text = path.read_text()
        except OSError:
            continue
        if path.suffix == ".sources":  # deb822
            for stanza in text.split("\n\n"):
                fields: dict[str, str] = {}
                for line in stanza.splitlines():
                    if ":" in line and not line.startswith(("#", " ")):
                        name, _sep, value = line.partition(":")
                        fields[name.strip().lower()] = value.strip()
                if ("deb" in fields.get("types", "").split() and suite in fields.get("suites", "").split()
                        and "main" in fields.get("components", "").split()):
                    for uri in fields.get("uris", "").split():
                        if uri.startswith(("http://", "https://")):
                            return uri
        elif path.suffix == ".list" or path.name == "sources.list":
            for line in text.splitlines():
                words = [w for w in line.split("#", 1)[0].split() if not w.startswith("[")]
                if len(words) >= 4 and words[0] == "deb" and words[2] == suite and "main" in words[3:]:
                    if words[1].startswith(("http://", "https://")):
                        return words[1]
    return None


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f"waiting for another image build ({path})")
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def ensure_image(*, cache: Path | None = None, requirements: Path = GUEST_REQUIREMENTS,
                 rebuild: bool = False) -> Image:
    """Return the cached image for the current recipe, building it first if needed."""
    cache = cache or default_cache_root()
    key = image_key(requirements)
    image = Image(cache / key)
    if image.complete() and not rebuild:
        return image
    with _locked(cache / f"{key}.lock"):
        if image.complete() and not rebuild:  # built by someone else while we waited
            return image
        for stale in cache.glob(f".build-{key}-*"):  # left by a crashed build (we hold the lock)
            shutil.rmtree(stale, ignore_errors=True)
        if missing_build_tools():
            raise VMLabError(f"cannot build the VM image, missing: {', '.join(missing_build_tools())}")
        if os.geteuid() != 0:
            raise VMLabError("building the VM image needs root (debootstrap, chroot)")
        work = Path(tempfile.mkdtemp(prefix=f".build-{key}-", dir=cache))
        try:
            _build(work, key, requirements)
            if image.root.exists():  # --rebuild: move the old one away first
                old = cache / f".old-{key}-{secrets.token_hex(4)}"
                image.root.rename(old)
                shutil.rmtree(old, ignore_errors=True)
            work.chmod(0o755)
            work.rename(image.root)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    log(f"image ready: {image.root}")
    return image


def _chroot(root: Path, argv: Sequence[str], *, timeout: float = 1800) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` chrooted in ``root``, in a private mount+pid namespace with its own /proc
    (nothing stays mounted afterwards, even if we crash)."""
    return run(["unshare", "--mount", "--pid", "--fork", "--mount-proc", f"--root={root}", *argv],
               env=CHROOT_ENV, timeout=timeout)


def _write(path: Path, text: str, mode: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.is_symlink():
        path.unlink()
    path.write_text(text)
    path.chmod(mode)


def _build(work: Path, key: str, requirements: Path) -> None:
    """Build the image into ``work`` (a fresh directory)."""
    timings: dict[str, float] = {}
    started = time.monotonic()

    def step(name: str, since: float) -> float:
        now = time.monotonic()
        timings[name] = round(now - since, 1)
        log(f"{name}: {timings[name]} s")
        return now

    rootfs = work / "rootfs"
    wheelhouse = work / "wheelhouse"
    mark = started

    # 1. The offline wheelhouse, on the host (the guest never uses the network for Python).
    log("downloading the guest wheelhouse")
    wheelhouse.mkdir()
    shutil.copyfile(requirements, wheelhouse / "requirements.txt")
    target: list[str] = ["--python-version", str(WHEEL_TARGET["python_version"]),
                         "--implementation", str(WHEEL_TARGET["implementation"])]
    for abi in WHEEL_TARGET["abis"]:
        target += ["--abi", abi]
    for platform in WHEEL_TARGET["platforms"]:
        target += ["--platform", platform]
    run([sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "--quiet",
         "--only-binary=:all:", *target, "--dest", wheelhouse, "-r", wheelhouse / "requirements.txt"],
        timeout=900)
    mark = step("wheelhouse", mark)

    # 2. debootstrap (Debian's packages, from the host's mirror).
    mirror = host_mirror()
    log(f"debootstrap {SUITE} ({mirror or 'default mirror'}); this takes a few minutes")
    argv = ["debootstrap", "--variant=minbase", f"--arch={ARCH}", f"--include={','.join(PACKAGES)}",
            SUITE, rootfs]
    if mirror:
        argv.append(mirror)
    proc = run(argv, timeout=3600, check=False)
    if proc.returncode != 0:
        debootstrap_log = rootfs / "debootstrap" / "debootstrap.log"
        tail = debootstrap_log.read_text(errors="replace")[-3000:] if debootstrap_log.exists() else ""
        raise VMLabError(f"debootstrap failed (rc={proc.returncode}):\n{proc.stdout[-2000:]}\n"
                         f"{proc.stderr[-2000:]}\n{tail}")
    mark = step("debootstrap", mark)

    # 3. Configuration.
    for path, (mode, text) in GUEST_FILES.items():
        _write(rootfs / path.lstrip("/"), text, mode)
    for unit in MASKED_UNITS:
        link = rootfs / "etc/systemd/system" / unit
        link.unlink(missing_ok=True)
        link.symlink_to("/dev/null")
    _chroot(rootfs, ["systemctl", "enable", *ENABLED_UNITS])
    (rootfs / "etc/machine-id").write_text("")  # each VM makes its own at boot
    (rootfs / "var/lib/dbus/machine-id").unlink(missing_ok=True)
    _chroot(rootfs, ["passwd", "--delete", "root"])  # console login on the serial port (ssh: key only)
    run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "kubenode-vmlab", "-f", work / "id_ed25519"])
    (work / "id_ed25519").chmod(0o600)
    ssh_dir = rootfs / "root/.ssh"
    ssh_dir.mkdir(mode=0o700, exist_ok=True)
    _write(ssh_dir / "authorized_keys", (work / "id_ed25519.pub").read_text(), 0o600)
    _chroot(rootfs, ["update-initramfs", "-u", "-k", "all"])
    mark = step("configure", mark)

    # 4. The wheelhouse and the test venv, installed offline inside the image.
    guest_wheelhouse = rootfs / GUEST_WHEELHOUSE.lstrip("/")
    shutil.copytree(wheelhouse, guest_wheelhouse)
    _chroot(rootfs, ["python3", "-m", "venv", GUEST_VENV])
    _chroot(rootfs, [GUEST_PYTHON, "-m", "pip", "install", "--disable-pip-version-check", "--quiet",
                     "--no-index", "--find-links", GUEST_WHEELHOUSE, "-r", f"{GUEST_WHEELHOUSE}/requirements.txt"])
    freeze = _chroot(rootfs, [GUEST_PYTHON, "-m", "pip", "freeze", "--disable-pip-version-check"]).stdout
    mark = step("venv", mark)

    # 5. Kernel + initrd beside the disk; the package list; shrink; the disk image.
    boot = rootfs / "boot"
    kernels = sorted(boot.glob("vmlinuz-*"))
    if not kernels:
        raise VMLabError("no kernel in the image's /boot")
    version = kernels[-1].name.removeprefix("vmlinuz-")
    shutil.copyfile(kernels[-1], work / "vmlinuz")
    shutil.copyfile(boot / f"initrd.img-{version}", work / "initrd.img")
    packages = _chroot(rootfs, ["dpkg-query", "-W", "-f", "${Package} ${Version}\n"]).stdout.splitlines()
    _chroot(rootfs, ["apt-get", "clean"])
    for lists in (rootfs / "var/lib/apt/lists").glob("*_*"):  # the package indexes (apt-get update)
        lists.unlink()
    shutil.rmtree(rootfs / "root/.cache", ignore_errors=True)
    run(["mkfs.ext4", "-q", "-F", "-L", "kubenode-root", "-E", "lazy_itable_init=0,lazy_journal_init=0",
         "-d", rootfs, work / "disk.raw", DISK_SIZE], timeout=1800)
    (work / "disk.raw").chmod(0o444)  # VMs only ever read it (through an overlay)
    shutil.rmtree(rootfs)
    mark = step("disk", mark)

    timings["total"] = round(time.monotonic() - started, 1)
    manifest = {
        "key": key,
        "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "kernel_version": version,
        "mirror": mirror,
        "timings_s": timings,
        "guest_venv": GUEST_VENV,
        "guest_python": GUEST_PYTHON,
        "guest_wheelhouse": GUEST_WHEELHOUSE,
        "venv_packages": freeze.split(),
        "debian_packages": packages,
        "recipe": recipe(requirements),
    }
    (work / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    log(f"image built in {timings['total']} s")


def prune_images(*, cache: Path | None = None, keep: Sequence[str] = ()) -> list[Path]:
    """Delete cached images other than the current recipe's (and ``keep``)."""
    cache = cache or default_cache_root()
    keep = {image_key(), *keep}
    removed = []
    for entry in sorted(cache.glob("*")) if cache.is_dir() else []:
        name = entry.name.removesuffix(".lock")
        if entry.is_dir() and name not in keep and not name.startswith(".build-"):
            with _locked(cache / f"{name}.lock"):
                shutil.rmtree(entry, ignore_errors=True)
            (cache / f"{name}.lock").unlink(missing_ok=True)
            removed.append(entry)
    return removed


# ================================================================== processes and state


def _process_start_time(pid: int) -> str | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]  # field 22: starttime


def _alive(pid: int, start_time: str | None = None) -> bool:
    current = _process_start_time(pid)
    return current is not None and (start_time is None or current == start_time)


def _cmdline_has(pid: int, marker: str) -> bool:
    try:
        return marker.encode() in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def _terminate(pid: int, marker: str, *, process: subprocess.Popen[bytes] | None = None,
               grace: float = 10.0) -> None:
    """Stop the process ``pid`` if (and only if) its command line contains ``marker``."""
    if process is not None and process.poll() is not None:
        return
    if not _cmdline_has(pid, marker):
        return
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if process is not None:
                if process.poll() is not None:
                    return
            elif not _cmdline_has(pid, marker):
                return
            time.sleep(0.1)


def _set_pdeathsig() -> None:  # runs in the child between fork and exec
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG


def _state_dir() -> Path:
    try:
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        if os.access(STATE_DIR, os.W_OK):
            return STATE_DIR
    except OSError:
        pass
    fallback = Path(tempfile.gettempdir()) / f"kubenode-vmlab-state-{os.getuid()}"
    fallback.mkdir(mode=0o700, exist_ok=True)
    return fallback


def list_labs() -> list[dict[str, Any]]:
    """The state of every lab recorded on this machine (running or left over)."""
    labs = []
    for path in sorted(_state_dir().glob("*.json")):
        with contextlib.suppress(OSError, ValueError):
            labs.append(json.loads(path.read_text()))
    return labs


def kill_lab(state: dict[str, Any]) -> None:
    """Kill the VMs of a lab from its recorded state and remove its files."""
    for vm in state.get("vms", []):
        control = Path(vm["workdir"]) / "ssh-control"
        if control.exists():
            run(["ssh", "-o", f"ControlPath={control}", "-O", "exit", "vmlab"], check=False, timeout=10)
        if vm.get("pid"):
            _terminate(int(vm["pid"]), state["marker"], grace=3.0)
    workdir = Path(state.get("workdir", ""))
    if workdir.name.startswith(f"{NAME_PREFIX}-"):
        shutil.rmtree(workdir, ignore_errors=True)
    (_state_dir() / f"{state['id']}.json").unlink(missing_ok=True)


def cleanup_stale(*, everything: bool = False) -> list[str]:
    """Kill leftovers of labs whose owner process is gone (``everything``: all labs, also
    running and detached ones). Returns the ids of the labs killed."""
    killed = []
    for state in list_labs():
        owner_alive = _alive(int(state.get("owner", 0)), state.get("owner_start"))
        if everything or (not state.get("detached") and not owner_alive):
            kill_lab(state)
            killed.append(state["id"])
    return killed


# ================================================================== VMs


def _free_ports(count: int) -> list[int]:
    sockets = []
    try:
        for _vm in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind(("127.0.0.1", 0))
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


@dataclass
class VM:
    """One running guest. Commands go over SSH as root (multiplexed on one connection)."""

    name: str
    index: int
    image: Image
    workdir: Path
    marker: str
    port: int = 0
    process: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    boot_seconds: float | None = None

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    @property
    def serial_log(self) -> Path:
        return self.workdir / "serial.log"

    @property
    def qemu_log(self) -> Path:
        return self.workdir / "qemu.log"

    @property
    def overlay(self) -> Path:
        return self.workdir / "overlay.qcow2"

    @property
    def control_path(self) -> Path:
        return self.workdir / "ssh-control"

    @property
    def ssh_key(self) -> Path:
        return self.image.ssh_key

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    # ----------------------------------------------------------- lifecycle

    def start(self, *, memory: int = MEMORY_MB, smp: int = SMP, cpu: str = "max", extra_args: Sequence[str] = (),
              detached: bool = False) -> None:
        """Create the overlay and start qemu (does not wait for the guest)."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        run(["qemu-img", "create", "-q", "-f", "qcow2", "-b", self.image.disk, "-F", "raw", self.overlay])
        for attempt in range(5):
            self.port = self.port if attempt == 0 and self.port else _free_ports(1)[0]
            argv = [
                "qemu-system-x86_64", "-name", f"{self.marker}-{self.name}",
                "-accel", "tcg,thread=multi", "-cpu", cpu, "-m", str(memory), "-smp", str(smp),
                "-nodefaults", "-no-user-config", "-display", "none", "-vga", "none", "-no-reboot",
                "-serial", f"file:{self.serial_log}", "-monitor", "none",
                "-kernel", self.image.kernel, "-initrd", self.image.initrd,
                "-append", f"{KERNEL_APPEND} systemd.hostname={self.name}",
                "-drive", f"file={self.overlay},format=qcow2,if=virtio,cache=unsafe,discard=unmap",
                "-netdev", f"user,id=net0,hostfwd=tcp:127.0.0.1:{self.port}-:22",
                "-device", "virtio-net-pci,netdev=net0,romfile=",
                "-device", "virtio-rng-pci",
                *extra_args,
            ]
            qemu_log = open(self.qemu_log, "wb")  # noqa: SIM115 - handed to the child
            try:
                pdeathsig = not detached and threading.current_thread() is threading.main_thread()
                self.process = subprocess.Popen(
                    [str(arg) for arg in argv], stdin=subprocess.DEVNULL, stdout=qemu_log, stderr=subprocess.STDOUT,
                    start_new_session=True, preexec_fn=_set_pdeathsig if pdeathsig else None)
            finally:
                qemu_log.close()
            time.sleep(0.3)
            if self.process.poll() is None or "host forwarding" not in self.qemu_log.read_text(errors="replace"):
                return
            log(f"{self.name}: port {self.port} taken, retrying")
        raise VMLabError(f"{self.name}: qemu could not bind an SSH port:\n{self.qemu_log.read_text()}")

    def serial_tail(self, lines: int = 40) -> str:
        try:
            text = self.serial_log.read_text(errors="replace")
        except OSError:
            return "(no serial log)"
        return "\n".join(text.replace("\r", "").splitlines()[-lines:])

    def wait_ssh(self, timeout: float = BOOT_TIMEOUT) -> float:
        """Wait until the guest accepts SSH; then open the shared connection. Returns seconds."""
        started = time.monotonic()
        deadline = started + timeout
        last = "no attempt finished"
        while True:
            if not self.alive():
                qemu = self.qemu_log.read_text(errors="replace") if self.qemu_log.exists() else ""
                raise VMLabError(f"{self.name}: qemu exited (rc={self.process.poll() if self.process else None})"
                                 f"\nqemu: {qemu.strip()}\n--- serial log tail ---\n{self.serial_tail()}")
            # The deadline is checked before each attempt and bounds it: an attempt that
            # outlived the deadline must not turn a timed-out boot into a success.
            left = deadline - time.monotonic()
            if left <= 0:
                raise VMLabError(f"{self.name}: SSH on 127.0.0.1:{self.port} not ready after {timeout:.0f} s "
                                 f"(last error: {last})\n--- serial log tail ---\n{self.serial_tail()}")
            connect = max(1, min(10, int(left)))
            try:
                proc = subprocess.run(
                    ["ssh", *self._ssh_base(), "-o", "ControlPath=none", "-o", f"ConnectTimeout={connect}", "true"],
                    stdin=subprocess.DEVNULL, capture_output=True, text=True, check=False, timeout=min(60.0, left))
            except subprocess.TimeoutExpired:
                last = f"ssh gave no answer within {min(60.0, left):.1f} s"
            else:
                if proc.returncode == 0:
                    break
                last = proc.stderr.strip()
            time.sleep(max(0.0, min(1.0, deadline - time.monotonic())))
        # One master connection for all later commands (stdio detached so that nothing hangs).
        subprocess.run(["ssh", *self._ssh_base(), "-o", f"ControlPath={self.control_path}", "-M", "-N", "-f",
                        "-o", "ControlPersist=no"],
                       stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                       check=False, timeout=60)
        self.boot_seconds = round(time.monotonic() - started, 1)
        return self.boot_seconds

    def stop(self) -> None:
        """Kill qemu (and the SSH master). Idempotent; the overlay is left to the lab."""
        if self.control_path.exists():
            run(["ssh", "-o", f"ControlPath={self.control_path}", "-O", "exit", "vmlab"], check=False, timeout=10)
        if self.process is not None:
            _terminate(self.process.pid, self.marker, process=self.process, grace=3.0)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=5)

    # ----------------------------------------------------------- commands

    def _ssh_base(self) -> list[str]:
        return [*SSH_OPTIONS, "-i", str(self.ssh_key), "-p", str(self.port), "-l", "root", "127.0.0.1"]

    def ssh_argv(self, argv: Sequence[str] = (), *, tty: bool = False) -> list[str]:
        """The host command line that runs ``argv`` in the guest (empty: a login shell)."""
        options = ["-o", f"ControlPath={self.control_path}", "-o", "ControlMaster=no"]
        if tty:
            options.append("-t")
        base = self._ssh_base()
        command = [shlex.join([str(arg) for arg in argv])] if argv else []
        return ["ssh", *options, *base[:-1], "--", base[-1], *command]

    def ssh(self, argv: Sequence[str], *, check: bool = True, input: str | bytes | None = None,
            timeout: float | None = COMMAND_TIMEOUT, text: bool = True) -> subprocess.CompletedProcess[Any]:
        """Run ``argv`` in the guest as root (quoted with shlex.join for the remote shell);
        captures stdout/stderr; raises VMLabError on a non-zero exit if ``check``."""
        if not argv:
            raise ValueError("ssh() needs a command")
        full = self.ssh_argv(argv)
        try:
            proc = subprocess.run(full, input=input, capture_output=True, text=text, check=False, timeout=timeout,
                                  stdin=subprocess.DEVNULL if input is None else None)
        except subprocess.TimeoutExpired as exc:
            raise VMLabError(f"{self.name}: timed out after {timeout}s: {shlex.join(argv)}") from exc
        if check and proc.returncode != 0:
            out = proc.stdout if text else proc.stdout.decode(errors="replace")
            err = proc.stderr if text else proc.stderr.decode(errors="replace")
            raise VMLabError(f"{self.name}: command failed (rc={proc.returncode}): {shlex.join(argv)}\n"
                             f"{out.strip()[-3000:]}\n{err.strip()[-3000:]}".rstrip())
        return proc

    def sh(self, script: str, **kwargs: Any) -> subprocess.CompletedProcess[Any]:
        """Run a shell script in the guest (``sh -ec script``)."""
        return self.ssh(["sh", "-ec", script], **kwargs)

    def _pipe_tar(self, tar_argv: Sequence[str], remote_argv: Sequence[str], timeout: float) -> None:
        tar = subprocess.Popen([str(arg) for arg in tar_argv], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE)
        try:
            assert tar.stdout is not None
            proc = subprocess.run(self.ssh_argv(remote_argv), stdin=tar.stdout, capture_output=True, text=True,
                                  check=False, timeout=timeout)
        finally:
            if tar.stdout:
                tar.stdout.close()
            tar_err = tar.communicate(timeout=60)[1].decode(errors="replace")
        if tar.returncode != 0 or proc.returncode != 0:
            raise VMLabError(f"{self.name}: copy failed: tar rc={tar.returncode} {tar_err.strip()}; "
                             f"remote rc={proc.returncode} {proc.stderr.strip()}")

    def put(self, local: str | os.PathLike[str], remote: str, *, timeout: float = COMMAND_TIMEOUT) -> None:
        """Copy a file or a directory tree from the host to ``remote`` (tar over ssh).
        A directory's contents land in ``remote`` (created if needed); modes are kept."""
        local = Path(local)
        if not remote.startswith("/") or remote.rstrip("/") == "":
            raise ValueError(f"remote path must be absolute and not '/': {remote!r}")
        if local.is_dir():
            self._pipe_tar(["tar", "-C", local, "-cf", "-", "."],
                           ["sh", "-ec", 'mkdir -p "$1" && tar --no-same-owner -C "$1" -xf -', "put", remote],
                           timeout)
        elif local.is_file():
            script = 'mkdir -p "$(dirname "$1")" && cat > "$1" && chmod "$2" "$1"'
            mode = format(local.stat().st_mode & 0o7777, "o")
            with open(local, "rb") as handle:
                proc = subprocess.run(self.ssh_argv(["sh", "-ec", script, "put", remote, mode]), stdin=handle,
                                      capture_output=True, check=False, timeout=timeout)
            if proc.returncode != 0:
                raise VMLabError(f"{self.name}: put {local} -> {remote} failed: {proc.stderr.decode().strip()}")
        else:
            raise FileNotFoundError(local)

    def get(self, remote: str, local: str | os.PathLike[str], *, timeout: float = COMMAND_TIMEOUT) -> None:
        """Copy one file from the guest to the host."""
        proc = self.ssh(["cat", remote], text=False, timeout=timeout)
        Path(local).write_bytes(proc.stdout)

    def put_repo(self, repo: str | os.PathLike[str] = REPO_ROOT, remote: str = GUEST_REPO, *,
                 timeout: float = COMMAND_TIMEOUT) -> str:
        """Copy the checkout (tracked + untracked, non-ignored files: what ``git ls-files``
        lists, as they are in the work tree) to ``remote`` in the guest, replacing what was
        there. Returns ``remote``."""
        repo = Path(repo).resolve()
        if remote.rstrip("/") in ("", "/root", "/", "/usr", "/etc", "/opt") or not remote.startswith("/"):
            raise ValueError(f"refusing to replace {remote!r}")
        listing = run(["git", "-C", repo, "ls-files", "-z", "--cached", "--others", "--exclude-standard"]).stdout
        files = sorted({name for name in listing.split("\0") if name and os.path.lexists(repo / name)})
        with tempfile.NamedTemporaryFile("w", prefix="vmlab-files-", suffix=".lst") as file_list:
            file_list.write("\0".join(files) + "\0")
            file_list.flush()
            self._pipe_tar(["tar", "-C", repo, "--null", f"--files-from={file_list.name}", "-cf", "-"],
                           ["sh", "-ec", 'rm -rf "$1" && mkdir -p "$1" && tar --no-same-owner -C "$1" -xf -',
                            "put_repo", remote], timeout)
        return remote


class VMLab:
    """N VMs booted from the cached image; use as a context manager (or call close()).

    ``with VMLab(2) as lab: lab.vms[0].ssh(["uname", "-r"]); lab.inventory`` ...
    """

    def __init__(self, count: int = 1, *, names: Sequence[str] | None = None, image: Image | None = None,
                 memory: int = MEMORY_MB, smp: int = SMP, boot_timeout: float = BOOT_TIMEOUT,
                 detached: bool = False, group: str = "vms",
                 python_interpreter: str = "/usr/bin/python3", cpu: str = "max",
                 extra_qemu_args: Sequence[str] = ()) -> None:
        names = list(names) if names else [f"vm{i + 1}" for i in range(count)]
        if len(set(names)) != len(names) or not names:
            raise ValueError(f"bad VM names: {names}")
        self.id = secrets.token_hex(4)
        self.marker = f"{NAME_PREFIX}-{self.id}"
        self.image = image or ensure_image()
        self.memory, self.smp, self.boot_timeout = memory, smp, boot_timeout
        self.cpu, self.extra_qemu_args = cpu, list(extra_qemu_args)
        self.detached, self.group, self.python_interpreter = detached, group, python_interpreter
        self.workdir = Path(tempfile.mkdtemp(prefix=f"{self.marker}-"))
        self.vms = [VM(name, index, self.image, self.workdir / name, self.marker) for index, name in enumerate(names)]
        self.inventory = self.workdir / "inventory.ini"
        self._closed = False
        self._state_file = _state_dir() / f"{self.id}.json"
        if not detached:
            atexit.register(self.close)

    def __enter__(self) -> VMLab:
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getitem__(self, name: str) -> VM:
        for vm in self.vms:
            if vm.name == name:
                return vm
        raise KeyError(name)

    def _save_state(self) -> None:
        state = {
            "id": self.id, "marker": self.marker, "owner": os.getpid(),
            "owner_start": _process_start_time(os.getpid()), "detached": self.detached,
            "workdir": str(self.workdir), "inventory": str(self.inventory), "image": str(self.image.root),
            "vms": [{"name": vm.name, "pid": vm.pid, "port": vm.port, "workdir": str(vm.workdir),
                     "ssh_key": str(vm.ssh_key)} for vm in self.vms],
        }
        tmp = self._state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(state, indent=2) + "\n")
        tmp.replace(self._state_file)

    def start(self) -> VMLab:
        """Boot every VM (in parallel) and wait for SSH; write the inventory."""
        cleanup_stale()
        self._save_state()
        for vm in self.vms:  # started from this thread: the parent-death signal follows this thread
            vm.start(memory=self.memory, smp=self.smp, cpu=self.cpu, extra_args=self.extra_qemu_args,
                     detached=self.detached)
            self._save_state()
        with concurrent.futures.ThreadPoolExecutor(max_workers=len(self.vms)) as pool:
            futures = [pool.submit(vm.wait_ssh, self.boot_timeout) for vm in self.vms]
            errors = [str(f.exception()) for f in futures if f.exception() is not None]
        if errors:
            raise VMLabError("\n\n".join(errors))
        self.write_inventory()
        return self

    def write_inventory(self, path: Path | None = None) -> Path:
        """Write an Ansible INI inventory of the VMs (group ``self.group``)."""
        path = path or self.inventory
        lines = [f"[{self.group}]"]
        for vm in self.vms:
            lines.append(
                f"{vm.name} ansible_host=127.0.0.1 ansible_port={vm.port} ansible_user=root "
                f"ansible_ssh_private_key_file={vm.ssh_key} ansible_python_interpreter={self.python_interpreter}")
        lines += [
            "",
            f"[{self.group}:vars]",
            "ansible_connection=ssh",
            "ansible_ssh_common_args='-o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null "
            "-o LogLevel=ERROR -o IdentitiesOnly=yes'",
            f"kubenode_wheelhouse={GUEST_WHEELHOUSE}",
            f"kubenode_test_venv={GUEST_VENV}",
            "",
        ]
        path.write_text("\n".join(lines))
        return path

    def close(self) -> None:
        """Kill every VM, remove overlays and state. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for vm in self.vms:
            with contextlib.suppress(Exception):
                vm.stop()
        shutil.rmtree(self.workdir, ignore_errors=True)
        self._state_file.unlink(missing_ok=True)
        with contextlib.suppress(Exception):
            atexit.unregister(self.close)


@contextlib.contextmanager
def boot(count: int = 1, **kwargs: Any) -> Iterator[VMLab]:
    """``with boot(2) as lab: ...`` - same as ``with VMLab(2, **kwargs) as lab``."""
    with VMLab(count, **kwargs) as lab:
        yield lab


# ================================================================== command line


def _du(path: Path) -> str:
    proc = run(["du", "-sh", path], check=False)
    return proc.stdout.split("\t")[0] if proc.returncode == 0 else "?"


def _find_lab(lab_id: str | None) -> dict[str, Any]:
    labs = [lab for lab in list_labs() if lab_id in (None, lab["id"])]
    if not labs:
        raise VMLabError(f"no running lab{' ' + lab_id if lab_id else ''} (see: vmlab.py status)")
    if len(labs) > 1:
        raise VMLabError(f"several labs run, pick one with --lab: {', '.join(lab['id'] for lab in labs)}")
    return labs[0]


def _cmd_image(args: argparse.Namespace) -> int:
    started = time.monotonic()
    image = ensure_image(rebuild=args.rebuild)
    manifest = image.manifest()
    print(json.dumps({
        "image": str(image.root), "disk": str(image.disk), "kernel": str(image.kernel),
        "initrd": str(image.initrd), "ssh_key": str(image.ssh_key), "wheelhouse": str(image.wheelhouse),
        "guest_wheelhouse": GUEST_WHEELHOUSE, "guest_venv": GUEST_VENV,
        "kernel_version": manifest["kernel_version"], "build_timings_s": manifest["timings_s"],
        "seconds_this_call": round(time.monotonic() - started, 1), "disk_use": _du(image.root),
    }, indent=2))
    return 0


def _cmd_up(args: argparse.Namespace) -> int:
    lab = VMLab(args.count, detached=not args.foreground, memory=args.memory, smp=args.smp)
    started = time.monotonic()
    try:
        lab.start()
    except BaseException:
        lab.close()
        raise
    seconds = round(time.monotonic() - started, 1)
    print(json.dumps({"lab": lab.id, "inventory": str(lab.inventory), "boot_seconds": seconds,
                      "vms": {vm.name: {"port": vm.port, "pid": vm.pid, "ssh_ready_s": vm.boot_seconds,
                                        "serial_log": str(vm.serial_log)} for vm in lab.vms},
                      "ssh": f"python3 {Path(__file__).resolve()} ssh --lab {lab.id} {lab.vms[0].name}",
                      "down": f"python3 {Path(__file__).resolve()} down {lab.id}"}, indent=2), flush=True)
    if args.foreground:
        stop = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        log("VMs up; Ctrl-C (or SIGTERM) tears them down")
        while not stop.wait(1.0):
            if not all(vm.alive() for vm in lab.vms):
                log("a VM exited")
                break
        lab.close()
    return 0


def _cmd_down(args: argparse.Namespace) -> int:
    for state in list_labs():
        if not args.ids or state["id"] in args.ids:
            kill_lab(state)
            print(f"killed lab {state['id']}")
    return 0


def _cmd_status(args: argparse.Namespace) -> int:
    for state in list_labs():
        alive = [vm["name"] for vm in state["vms"] if vm.get("pid") and _cmdline_has(int(vm["pid"]), state["marker"])]
        print(f"{state['id']}: detached={state['detached']} owner={state['owner']} inventory={state['inventory']} "
              f"running={','.join(alive) or '-'}")
    return 0


def _cmd_ssh(args: argparse.Namespace) -> int:
    state = _find_lab(args.lab)
    entry = next((vm for vm in state["vms"] if args.vm in (None, vm["name"])), None)
    if entry is None:
        raise VMLabError(f"no VM {args.vm!r} in lab {state['id']}")
    vm = VM(entry["name"], 0, Image(Path(state["image"])), Path(entry["workdir"]), state["marker"], port=entry["port"])
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    argv = vm.ssh_argv(command, tty=not command and sys.stdin.isatty())
    os.execvp(argv[0], argv)
    return 1  # not reached


def _cmd_prune(args: argparse.Namespace) -> int:
    for path in prune_images():
        print(f"removed {path}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", maxsplit=1)[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("image", help="build (once) and describe the cached image")
    p.add_argument("--rebuild", action="store_true", help="build again even if cached")
    p.set_defaults(func=_cmd_image)
    p = sub.add_parser("up", help="boot VMs; detached unless --foreground")
    p.add_argument("-n", "--count", type=int, default=1)
    p.add_argument("--memory", type=int, default=MEMORY_MB)
    p.add_argument("--smp", type=int, default=SMP)
    p.add_argument("--foreground", action="store_true", help="stay attached; tear down on Ctrl-C")
    p.set_defaults(func=_cmd_up)
    p = sub.add_parser("down", help="kill running labs (all, or the ids given)")
    p.add_argument("ids", nargs="*")
    p.set_defaults(func=_cmd_down)
    p = sub.add_parser("status", help="list labs")
    p.set_defaults(func=_cmd_status)
    p = sub.add_parser("ssh", help="ssh into a VM (or run a command: ssh VM -- CMD...)")
    p.add_argument("--lab")
    p.add_argument("vm", nargs="?")
    p.add_argument("command", nargs=argparse.REMAINDER)
    p.set_defaults(func=_cmd_ssh)
    p = sub.add_parser("prune", help="delete cached images of other recipes")
    p.set_defaults(func=_cmd_prune)
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except VMLabError as exc:
        print(f"vmlab: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
