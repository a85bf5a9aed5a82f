"""torch drift: every private torch name the package uses still exists, with the arguments we pass, on this torch.

The table is `utils.torch_drift.TORCH_NAMES`; a scan of the package sources demands an entry for every private name
the code spells out. A renamed or removed name fails here instead of silently switching a feature off.
"""

from __future__ import annotations

import pytest
import torch

from utils import torch_drift
from utils.torch_drift import TORCH_NAMES, TorchName

USES = torch_drift.find_private_uses()


def test_the_installed_torch_is_one_the_table_was_checked_on_and_setup_cfg_admits_exactly_those():
    import configparser

    from tests.helpers import REPO_ROOT

    minor = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    assert minor in torch_drift.CHECKED_TORCH, (
        f"torch {torch.__version__} is not one of {torch_drift.CHECKED_TORCH}: run this file on it, fix what moved, "
        "and add it to CHECKED_TORCH (utils/torch_drift.py) and setup.cfg's window"
    )
    config = configparser.ConfigParser()
    config.read(REPO_ROOT / "setup.cfg")
    (pin,) = [line for line in config["options"]["install_requires"].split() if line.startswith("torch>=")]
    oldest, newest = torch_drift.CHECKED_TORCH[0], torch_drift.CHECKED_TORCH[-1]
    major, last = newest.split(".")
    assert pin == f"torch>={oldest},<{major}.{int(last) + 1}", pin


@pytest.mark.parametrize("name", sorted(TORCH_NAMES))
def test_torch_still_has_the_private_name_with_the_arguments_we_pass(name):
    found = torch_drift.problem(name, TORCH_NAMES[name])
    if found is not None:
        pytest.fail(torch_drift.drift_message(name, found), pytrace=False)


def test_every_private_torch_name_in_the_package_has_an_entry():
    unlisted = torch_drift.unlisted(USES)
    assert not unlisted, f"add these to TORCH_NAMES (utils/torch_drift.py), with what they are for: {unlisted}"


def test_a_private_name_without_an_entry_is_unlisted_even_beside_listed_ones(tmp_path):
    source = tmp_path / "module.py"
    source.write_text(
        "import torch\n"
        "from torch._guards import CompileContext\n"
        "from torch._dynamo.utils import compilation_time_metrics\n"
        "a = CompileContext.current_compile_id()\n"  # listed
        "b = CompileContext.try_get()\n"  # an attribute of a listed class: no entry of its own
        "c = compilation_time_metrics.get('x')\n"  # a dict's method: covered by the dict's entry
        "d = compilation_time_metrics._private\n"
        "e = torch.ops.mkl._mkl_linear(1)\n"  # the packet of a listed overload
        "f = getattr(torch._dynamo.eval_frame, '_not_listed', None)\n"
    )
    found = torch_drift.unlisted(torch_drift.find_private_uses([str(source)]))
    assert set(found) == {
        "torch._guards.CompileContext.try_get",
        "torch._dynamo.utils.compilation_time_metrics._private",
        "torch._dynamo.eval_frame._not_listed",
    }


def test_every_entry_is_still_used_by_the_package():
    # Config options are passed as keywords or option keys, which the scan does not see: the next test checks them.
    # A stamp is spelled as a string: its attribute names must appear in the package's sources.
    # An entry that a used entry extends is used on the way (`....default` of `....default._op`).
    covering = {torch_drift.entry_for(name) for name in USES} - {None}
    used = covering | {name for name in TORCH_NAMES if any(entry.startswith(name + ".") for entry in covering)}
    sources = "".join(open(path, encoding="utf-8").read() for path in torch_drift._source_files())
    stale = [
        name
        for name, entry in TORCH_NAMES.items()
        if (entry.kind == "stamp" and not all(f'"{attribute}"' in sources for attribute in entry.args))
        or (entry.kind not in ("config", "stamp") and name not in used)
    ]
    assert not stale, f"no code of ours uses these any more: remove them from TORCH_NAMES: {stale}"


def test_every_inductor_option_that_compile_config_for_cpu_passes_has_an_entry():
    from transformers_flexcache import compile_config_for_cpu

    options = set()
    for kernels in ("auto", "onednn", "mkl"):
        for int8 in ("fbgemm", "inductor", "library"):
            for attention in ("inductor", "library"):
                config = compile_config_for_cpu(linear_kernels=kernels, int8_linears=int8, decode_attention=attention)
                options |= set(config.options)
    listed = {
        name.removeprefix("torch._inductor.config.")
        for name in TORCH_NAMES
        if name.startswith("torch._inductor.config.")
    }
    assert options <= listed, f"inductor options without an entry in TORCH_NAMES: {sorted(options - listed)}"


def test_the_scan_finds_private_names_through_aliases_imports_and_getattr(tmp_path):
    source = tmp_path / "module.py"
    source.write_text(
        "import torch\n"
        "from torch._inductor.custom_graph_pass import CustomGraphPass\n"
        "ops = torch.ops.aten\n"
        "x = ops._int_mm.default\n"
        "y = torch._dynamo.config.recompile_limit\n"
        "z = torch.ops.aten.add.Tensor\n"
        "w = torch.nn.functional.pad\n"
        "import torch._inductor.config as inductor_config\n"
        "v = inductor_config.patch\n"
        "u = getattr(torch._dynamo.eval_frame, '_stance', None)\n"
        "from unittest import mock\n"
        "from torch._inductor.codegen.cpp import CppScheduling\n"
        "t = mock.patch.object(CppScheduling, 'MAX_FUSED_KERNEL_ARGS_NUM', 0)\n"
        "s = hasattr(torch.cpu, 'get_capabilities')\n"
    )
    found = torch_drift.find_private_uses([str(source)])
    assert set(found) == {
        "torch._inductor.custom_graph_pass.CustomGraphPass",
        "torch.ops.aten._int_mm.default",
        "torch._dynamo.config.recompile_limit",
        "torch.ops.aten.add.Tensor",
        "torch._inductor.config.patch",
        "torch._dynamo.eval_frame._stance",
        "torch._inductor.codegen.cpp.CppScheduling.MAX_FUSED_KERNEL_ARGS_NUM",
    }
    assert torch_drift.is_public_op("torch.ops.aten.add.Tensor")
    assert not torch_drift.is_public_op("torch.ops.aten._int_mm.default")


@pytest.mark.parametrize(
    ("name", "entry", "breaks", "message"),
    [
        (
            "torch._dynamo.eval_frame._stance",
            TorchName("object", "test"),
            lambda monkeypatch: monkeypatch.delattr(torch._dynamo.eval_frame, "_stance"),
            "missing: AttributeError",
        ),
        (
            "torch._inductor.config.freezing",
            TorchName("config", "test"),
            lambda monkeypatch: monkeypatch.delitem(torch._inductor.config._config, "freezing"),
            "has no option 'freezing'",
        ),
        (
            "torch._inductor.config.cpp.enable_kernel_profile",
            TorchName("config", "test"),
            lambda monkeypatch: monkeypatch.delitem(torch._inductor.config._config, "cpp.enable_kernel_profile"),
            "has no option 'cpp.enable_kernel_profile'",
        ),
        (
            "torch._guards.detect_fake_mode",
            TorchName("object", "test", ("inputs",)),
            lambda monkeypatch: monkeypatch.setattr(torch._guards, "detect_fake_mode", lambda values=None: None),
            "without ['inputs']",
        ),
        (
            "torch.ops.mkldnn._linear_pointwise.default",
            TorchName("op", "test", ("X", "W", "B", "post_op")),
            lambda monkeypatch: None,
            "ours assume",
        ),
    ],
    ids=["renamed-attribute", "renamed-config-option", "renamed-nested-option", "renamed-parameter", "changed-schema"],
)
def test_the_guard_fails_on_a_renamed_name(monkeypatch, name, entry, breaks, message):
    import torch._inductor.config  # noqa: F401

    assert torch_drift.problem(name, TorchName(entry.kind, "test")) is None  # present as it is
    breaks(monkeypatch)
    found = torch_drift.problem(name, entry)
    assert found is not None and message in found, found
