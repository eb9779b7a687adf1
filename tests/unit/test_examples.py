"""Every module's EXAMPLES and every ```yaml block of README.md and docs/ parse, and each
task of this collection's modules passes the module's own argument validation (option names
exist, types convert, required and mutually exclusive options hold). ipset_entry examples that
are self-contained also run in check mode against an empty (fake) kernel, so a value the
module would refuse (an entry of the wrong shape for the set type) fails here."""
import importlib
import json
import os
import re

import pytest
import yaml
from ansible.module_utils.common.arg_spec import ArgumentSpecValidator
from ansible.module_utils.testing import patch_module_args

from ansible_collections.kubenode.proxy.plugins.module_utils.proxier.kernel.ipset import IpsetKernel

from .test_module_ipset_entry import FakeIpset

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODULES = sorted(f[:-3] for f in os.listdir(os.path.join(ROOT, "plugins", "modules")) if f.endswith(".py"))
DOCS = ["README.md"] + ["docs/" + f for f in sorted(os.listdir(os.path.join(ROOT, "docs"))) if f.endswith(".md")]
FQCN = "kubenode.proxy."
TASK_KEYWORDS = {"name", "register", "when", "loop", "loop_control", "delegate_to", "run_once", "become",
                 "check_mode", "diff", "vars", "tags", "notify", "changed_when", "failed_when", "environment"}


class _Captured(Exception):
    pass


def _module(name):
    return importlib.import_module("ansible_collections.kubenode.proxy.plugins.modules." + name)


def _spec(name, monkeypatch):
    """The keyword arguments main() gives AnsibleModule (argument_spec, mutually_exclusive, ...)."""
    mod = _module(name)
    seen = {}

    def capture(**kwargs):
        seen.update(kwargs)
        raise _Captured()

    monkeypatch.setattr(mod, "AnsibleModule", capture)
    with pytest.raises(_Captured):
        mod.main()
    return seen


def _blocks():
    """(where, yaml text) for every EXAMPLES string and every ```yaml block of the docs."""
    for name in MODULES:
        yield "plugins/modules/%s.py EXAMPLES" % name, _module(name).EXAMPLES
    for doc in DOCS:
        with open(os.path.join(ROOT, doc)) as f:
            text = f.read()
        for m in re.finditer(r"^```yaml\n(.*?)^```", text, re.M | re.S):
            yield "%s:%d" % (doc, text[:m.start()].count("\n") + 1), m.group(1)


BLOCKS = list(_blocks())


def _tasks():
    for where, text in BLOCKS:
        data = yaml.safe_load(text)
        if isinstance(data, list) and all(isinstance(t, dict) and "name" in t for t in data):
            for i, task in enumerate(data):
                modules = [k for k in task if k not in TASK_KEYWORDS]
                assert len(modules) == 1, (where, i, modules)
                yield "%s task %d (%s)" % (where, i, task["name"]), modules[0], task[modules[0]]


def _placeholder(spec):
    """A value of the option's type for a templated ("{{ ... }}") value: names, requiredness and
    exclusivity are still checked, only the value is not known before run time."""
    return {"dict": {}, "list": [], "int": 1, "bool": True}.get(spec.get("type", "str"), "x")


def _untemplated(args, argument_spec):
    out = {}
    for key, value in args.items():
        if isinstance(value, str) and "{{" in value and key in argument_spec:
            value = _placeholder(argument_spec[key])
        out[key] = value
    return out


@pytest.mark.parametrize("where,text", BLOCKS, ids=[block[0] for block in BLOCKS])
def test_block_is_yaml(where, text):
    assert yaml.safe_load(text) is not None, where


def test_every_module_has_examples_and_the_docs_show_every_module():
    used = {task[1] for task in _tasks()}
    assert {FQCN + m for m in MODULES} <= used, {FQCN + m for m in MODULES} - used


def test_module_tasks_pass_the_modules_argument_validation(monkeypatch):
    specs = {}
    checked = 0
    for where, module, args in _tasks():
        if not module.startswith(FQCN):
            continue  # another collection's module (kubernetes.core.k8s_info): YAML-parsed only
        name = module[len(FQCN):]
        assert name in MODULES, (where, module)
        if name not in specs:
            specs[name] = _spec(name, monkeypatch)
        kw = specs[name]
        validator = ArgumentSpecValidator(
            kw["argument_spec"], mutually_exclusive=kw.get("mutually_exclusive"),
            required_together=kw.get("required_together"), required_one_of=kw.get("required_one_of"),
            required_if=kw.get("required_if"), required_by=kw.get("required_by"))
        result = validator.validate(_untemplated(args, kw["argument_spec"]))
        assert not result.error_messages, (where, result.error_messages)
        checked += 1
    assert checked >= 10


def test_self_contained_ipset_examples_run_in_check_mode(capsys, monkeypatch):
    mod = _module("ipset_entry")
    monkeypatch.setattr(mod.AnsibleModule, "get_bin_path", lambda self, name, *a, **k: "/sbin/" + name)
    ran = 0
    for where, module, args in _tasks():
        if module != FQCN + "ipset_entry" or "{{" in json.dumps(args):
            continue
        fake = FakeIpset()
        monkeypatch.setattr(mod, "IpsetKernel", lambda binary, fake=fake: IpsetKernel(binary=binary, runner=fake))
        with patch_module_args(dict(args, _ansible_check_mode=True)):
            with pytest.raises(SystemExit):
                mod.main()
        out = json.loads(capsys.readouterr().out)
        assert not out.get("failed"), (where, out.get("msg"))
        if args.get("state", "present") == "present" and args.get("entries"):
            assert len(out["entries"]) == len(args["entries"]) and not fake.restores, (where, out)
        ran += 1
    assert ran >= 2
