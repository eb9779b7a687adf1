"""Make the checkout importable as ansible_collections.kubenode.proxy (the name the
modules and the daemon use), without installing anything."""
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _collection_path() -> str:
    parent = os.path.dirname(os.path.dirname(ROOT))
    if os.path.basename(parent) == "ansible_collections":
        return os.path.dirname(parent)
    base = os.path.join(tempfile.gettempdir(), f"kubenode-proxy-{os.getuid()}", "collections")
    link = os.path.join(base, "ansible_collections", "kubenode", "proxy")
    if os.path.realpath(link) != os.path.realpath(ROOT):
        os.makedirs(os.path.dirname(link), mode=0o700, exist_ok=True)
        tmp = f"{link}.{os.getpid()}"
        os.symlink(ROOT, tmp)
        os.replace(tmp, link)
    return base


COLLECTIONS_PATH = _collection_path()
if COLLECTIONS_PATH not in sys.path:
    sys.path.insert(0, COLLECTIONS_PATH)
