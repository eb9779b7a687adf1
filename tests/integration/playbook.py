"""Run Ansible tasks with the module's Python inside a lab namespace (the modules' integration
tests share this). ansible_python_interpreter is a wrapper script (``ip netns exec NS
python``): a plain ``ip netns exec`` interpreter string does not work in ansible-core 2.19."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List, Sequence

import yaml

COLLECTIONS = os.environ["KUBENODE_COLLECTIONS_PATH"]  # set by tests/conftest.py


def python_in(lab: Any, ns: str, tmp_path: Path) -> Path:
    """An interpreter wrapper that runs Python inside the lab's namespace ``ns``."""
    wrapper = tmp_path / f"python-in-{ns}"
    wrapper.write_text(f'#!/bin/sh\nexec ip netns exec {lab.ns(ns)} {sys.executable} "$@"\n')
    wrapper.chmod(0o700)
    return wrapper


def run_tasks(interpreter: Path, tmp_path: Path, tasks: Sequence[Dict[str, Any]], *flags: str) -> List[Dict]:
    """Run ``tasks`` (whole task dicts) on localhost with ``interpreter``; return each task's
    registered result. The results are written out by a last task run on the host."""
    body = [{**task, "register": f"r{i}"} for i, task in enumerate(tasks)]
    results = tmp_path / "results.json"
    body.append({"copy": {"content": "{{ [%s] | to_json }}" % ", ".join(f"r{i}" for i in range(len(tasks))),
                          "dest": str(results)},
                 "check_mode": False, "diff": False, "vars": {"ansible_python_interpreter": sys.executable}})
    path = tmp_path / "play.yml"
    path.write_text(yaml.safe_dump([{"hosts": "localhost", "gather_facts": False, "tasks": body}]))
    env = {**os.environ, "ANSIBLE_COLLECTIONS_PATH": COLLECTIONS, "ANSIBLE_NOCOLOR": "1",
           "ANSIBLE_LOCALHOST_WARNING": "0", "ANSIBLE_INVENTORY_UNPARSED_WARNING": "0"}
    proc = subprocess.run(["ansible-playbook", "-i", "localhost,", "-e", "ansible_connection=local",
                           "-e", f"ansible_python_interpreter={interpreter}", str(path), *flags],
                          capture_output=True, text=True, env=env, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(results.read_text())
