"""save_pretrained of an override model: an `auto_map` and `modeling_flexcache.py`, loadable with trust_remote_code.

The fresh-process check runs one child Python for every model case (importing torch and transformers costs most of
its time); the parametrized tests below read its per-model report.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.model_cases import MODEL_CASES
from transformers_flexcache import unregister
from transformers_flexcache.models.auto_classes import REMOTE_CODE_MODULE, auto_classes_for

REPO_ROOT = Path(__file__).resolve().parents[2]
CASES = [pytest.param(case, id=case.name) for case in MODEL_CASES]
NEW_TOKENS = 4
SAVED_CACHE_CONFIG = {"max_batch_size": 4, "max_cache_len": 24}

# Runs in a process that never imports transformers_flexcache itself: only the saved folders lead to it.
CHILD_SCRIPT = """
import importlib, json, sys, traceback
import torch
import transformers
from transformers import GenerationMixin
from transformers.models.auto.auto_factory import _LazyAutoMapping
from transformers.models.auto import modeling_auto

jobs = torch.load(sys.argv[1], weights_only=False)
report = {}
# First plain transformers: no trust_remote_code, so nothing leads it to transformers_flexcache.
plain = {}
for name, job in jobs.items():
    try:
        auto_class = getattr(transformers, json.load(open(job["dir"] + "/config.json"))["auto_map"].popitem()[0])
        generation_config = transformers.GenerationConfig.from_pretrained(job["dir"])
        model = auto_class.from_pretrained(job["dir"]).eval()
        out = model.generate(**job["inputs"], **job["generate_kwargs"])
        plain[name] = {"class": type(model).__name__, "sequences": out.tolist(),
                       "saved_request": getattr(generation_config, "flexible_static", None)}
    except Exception:
        plain[name] = {"error": traceback.format_exc()}
plain_imported_us = "transformers_flexcache" in sys.modules
for name, job in jobs.items():
    try:
        config = json.load(open(job["dir"] + "/config.json"))
        loaded = {}
        for auto_name in config["auto_map"]:
            auto_class = getattr(transformers, auto_name)
            model = auto_class.from_pretrained(job["dir"], trust_remote_code=True).eval()
            out = model.generate(**job["inputs"], cache_implementation="flexible_static", **job["generate_kwargs"])
            # Imported after loading, so that only the saved folder could have led transformers to it.
            package_class = getattr(importlib.import_module(job["module"]), job["class_name"])
            loaded[auto_name] = {
                "is_package_class": type(model) is package_class,
                "wraps_package_class": type(model).__bases__ == (package_class, GenerationMixin),
                "sequences": out.tolist(),
            }
        registered = [
            str(config_class) for value in vars(modeling_auto).values() if isinstance(value, _LazyAutoMapping)
            for config_class, model_class in value._extra_content.items()
            if model_class.__module__.startswith(("model_overrides", "transformers_flexcache"))
        ]
        model.save_pretrained(job["resave_dir"])
        report[name] = {"loaded": loaded, "registered": registered}
    except Exception:
        report[name] = {"error": traceback.format_exc()}
    report[name]["plain"] = plain[name]
    report[name]["plain_imported_us"] = plain_imported_us
print("REPORT" + json.dumps(report))
"""


def _generate_kwargs(case) -> dict:
    return {"max_new_tokens": NEW_TOKENS, "do_sample": False, **case.generate_kwargs}


@pytest.fixture(autouse=True)
def unregistered():
    unregister()
    yield


@pytest.fixture(scope="module")
def fresh_process(tmp_path_factory):
    """Save every case's override model, load them all in one fresh Python process; its report per case name."""
    root = tmp_path_factory.mktemp("remote_code")
    jobs, expected = {}, {}
    for case in MODEL_CASES:
        upstream, flex = case.build()
        inputs = case.make_inputs(2, 5, torch.Generator().manual_seed(0))
        # A folder that asks for the flexible cache by default (saved where upstream does not validate it).
        flex.generation_config.cache_implementation = "flexible_static"
        flex.generation_config.cache_config = SAVED_CACHE_CONFIG
        flex.save_pretrained(root / case.name)
        expected[case.name] = upstream.generate(**inputs, **_generate_kwargs(case)).tolist()
        jobs[case.name] = {
            "dir": str(root / case.name),
            "resave_dir": str(root / f"{case.name}-resaved"),
            "inputs": inputs,
            "generate_kwargs": _generate_kwargs(case),
            "module": case.flex_class.__module__,
            "class_name": case.flex_class.__name__,
        }
    torch.save(jobs, root / "jobs.pt")
    script = root / "child.py"
    script.write_text(CHILD_SCRIPT)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
        "HF_MODULES_CACHE": str(root / "hf_modules"),
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
    }
    result = subprocess.run(
        [sys.executable, str(script), str(root / "jobs.pt")],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = [line for line in result.stdout.splitlines() if line.startswith("REPORT")]
    assert result.returncode == 0 and lines, f"child failed (rc={result.returncode}):\n{result.stderr[-3000:]}"
    return root, json.loads(lines[-1].removeprefix("REPORT")), expected


@pytest.mark.parametrize("case", CASES)
def test_save_pretrained_writes_an_auto_map_for_every_upstream_auto_class_and_the_module_it_names(case, tmp_path):
    _, flex = case.build()
    flex.save_pretrained(tmp_path)
    auto_map = json.loads((tmp_path / "config.json").read_text())["auto_map"]
    upstream_class = case.flex_class.flex_upstream_class()
    assert sorted(auto_map) == sorted(auto_class.__name__ for auto_class in auto_classes_for(upstream_class))
    assert set(auto_map.values()) == {f"{REMOTE_CODE_MODULE}.{case.flex_class.__name__}"}
    module = (tmp_path / f"{REMOTE_CODE_MODULE}.py").read_text()
    # Only the package's stable, public entry point: no module path that a refactor could move.
    assert "from transformers_flexcache.saved import override_class\n" in module
    assert f'{case.flex_class.__name__} = override_class("{case.flex_class.__name__}", format_version=1)' in module
    assert "model_overrides" not in module
    assert not hasattr(flex.config, "auto_map"), "save_pretrained left auto_map on the model's config"


@pytest.mark.parametrize("case", CASES)
def test_the_saved_folder_loads_into_upstream_without_trust_remote_code(case, tmp_path):
    upstream, flex = case.build()
    flex.save_pretrained(tmp_path)
    auto_class = auto_classes_for(case.flex_class.flex_upstream_class())[-1]
    loaded = auto_class.from_pretrained(tmp_path)
    assert type(loaded) is case.flex_class.flex_upstream_class()
    assert all(torch.equal(loaded.state_dict()[name], value) for name, value in upstream.state_dict().items())


def test_save_pretrained_with_push_to_hub_is_refused_before_writing(tmp_path):
    _, flex = MODEL_CASES[0].build()
    with pytest.raises(ValueError, match=r"push_to_hub=True.*call model.push_to_hub\(repo_id\)"):
        flex.save_pretrained(tmp_path / "out", push_to_hub=True)
    assert not (tmp_path / "out").exists()


def test_register_for_auto_class_adds_the_auto_class_without_copying_the_override_source(tmp_path):
    case = MODEL_CASES[0]
    _, flex = case.build()
    with pytest.raises(ValueError, match="AutoModelForNothing is not a valid auto class"):
        case.flex_class.register_for_auto_class("AutoModelForNothing")
    try:
        case.flex_class.register_for_auto_class("AutoModel")
        flex.save_pretrained(tmp_path)
    finally:
        del case.flex_class._flex_extra_auto_classes
    auto_map = json.loads((tmp_path / "config.json").read_text())["auto_map"]
    assert auto_map["AutoModel"] == f"{REMOTE_CODE_MODULE}.{case.flex_class.__name__}"
    assert case.flex_class._auto_class is None
    assert sorted(path.name for path in tmp_path.glob("*.py")) == [f"{REMOTE_CODE_MODULE}.py"]


@pytest.mark.parametrize("case", CASES)
def test_a_fresh_process_loads_the_override_with_trust_remote_code_and_generates_like_dynamic_cache(
    case, fresh_process
):
    root, report, expected = fresh_process
    result = report[case.name]
    assert "error" not in result, result.get("error")
    auto_names = [auto_class.__name__ for auto_class in auto_classes_for(case.flex_class.flex_upstream_class())]
    assert sorted(result["loaded"]) == sorted(auto_names)
    for auto_name, loaded in result["loaded"].items():
        # transformers' add_generation_mixin_to_remote_model subclasses a loaded class (adding GenerationMixin)
        # when the class defines its own prepare_inputs_for_generation (Whisper does): ours, plus that mixin.
        assert loaded["is_package_class"] or loaded["wraps_package_class"], auto_name
        assert loaded["sequences"] == expected[case.name], auto_name
    assert result["registered"] == [], "the child registered override classes in the AutoModel mappings"
    # Saved again by the model the child loaded: the same files, no copy of the override's source.
    resaved = root / f"{case.name}-resaved"
    assert sorted(path.name for path in resaved.glob("*.py")) == [f"{REMOTE_CODE_MODULE}.py"]
    original_map = json.loads((root / case.name / "config.json").read_text())["auto_map"]
    assert json.loads((resaved / "config.json").read_text())["auto_map"] == original_map


@pytest.mark.parametrize("case", CASES)
def test_a_fresh_process_with_plain_transformers_loads_the_saved_folder_and_generates_without_the_plugin(
    case, fresh_process
):
    _, report, expected = fresh_process
    plain = report[case.name]["plain"]
    assert "error" not in plain, plain.get("error")
    assert plain["class"] == case.flex_class.flex_upstream_class().__name__
    assert plain["saved_request"] == SAVED_CACHE_CONFIG  # kept, unread by upstream
    assert plain["sequences"] == expected[case.name]
    assert report[case.name]["plain_imported_us"] is False


def test_a_saved_folder_naming_a_class_this_version_lacks_says_to_upgrade():
    from transformers_flexcache.saved import override_class

    with pytest.raises(ValueError, match=r"no override class 'FlexNothingForCausalLM'.*upgrade"):
        override_class("FlexNothingForCausalLM", format_version=1)
    with pytest.raises(ValueError, match=r"format 99.*upgrade"):
        override_class("FlexLlamaForCausalLM", format_version=99)
