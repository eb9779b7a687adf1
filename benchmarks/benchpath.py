"""The checkout's collection on ``sys.path``, the way ``bin/kubenode-proxy`` puts it there
(its ``setup_path``: a private per-user directory, never one another user can write).
Imported first by the benchmarks that use the proxier's modules in-process."""
from __future__ import annotations

import importlib.machinery
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _setup() -> None:
    loader = importlib.machinery.SourceFileLoader("kubenode_proxy_bin", str(ROOT / "bin" / "kubenode-proxy"))
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader("kubenode_proxy_bin", loader))
    loader.exec_module(module)
    module.setup_path()


_setup()
