"""Make the checkout importable as ansible_collections.kubenode.proxy (the name the
modules and the daemon use), without installing anything: bin/kubenode-proxy's
setup_path() does it, so tests, benchmarks and the command agree on one path."""
import importlib.machinery
import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_entry_point():
    path = os.path.join(ROOT, "bin", "kubenode-proxy")
    loader = importlib.machinery.SourceFileLoader("kubenode_proxy_bin", path)
    spec = importlib.util.spec_from_loader("kubenode_proxy_bin", loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


COLLECTIONS_PATH = load_entry_point().setup_path()
os.environ["KUBENODE_COLLECTIONS_PATH"] = COLLECTIONS_PATH
