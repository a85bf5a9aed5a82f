"""An engine started from a compiled artifact loads its graphs lazily (`Engine.warmup(artifact=)`): the key is checked
before it serves, and each graph is loaded while the engine is idle or at its first use, so that a server answers
before it has loaded every bucket's package. Here the packages are stand-ins (no AOTInductor build: that is
tests/serving/test_artifact.py, slow): the order and the moments of the loads, and that requests are served
meanwhile with upstream's tokens."""

from __future__ import annotations

import threading
import time

import pytest

from tests.helpers import own_copy
from tests.model_cases import MODEL_CASES
from tests.serving.test_engine import TIMEOUT, assert_same_output, capacities, reference, request_stream
from transformers_flexcache.compile import ArtifactRefused, LoadedArtifact, PackageGraph
from transformers_flexcache.serving import Engine
from transformers_flexcache.serving import engine as engine_module


class StandIn(PackageGraph):
    """A graph whose `load` is recorded (and, where asked, blocks until released) and fails: its shape then runs
    the engine's own step, so the tokens stay upstream's."""

    def __init__(self, shape, log, gate=None):
        super().__init__(root=None, name=f"graphs/{shape}", entry={})
        self.shape, self.log, self.gate = shape, log, gate

    def load(self):
        self.log.append((self.shape, threading.current_thread().name))
        if self.gate is not None:
            self.gate.wait(TIMEOUT)
        raise ArtifactRefused(f"stand-in {self.shape}")


@pytest.fixture
def llama():
    case = next(case for case in MODEL_CASES if case.name == "llama")
    upstream, flex = case.build("sdpa")
    return case, upstream, flex


def start(flex, monkeypatch, graphs_of):
    # no compile config: a shape whose graph fails runs the eager step (what it compiles otherwise), so that this
    # test compiles nothing; `_load_artifact` is what `warmup(artifact=)` runs after its compile-config check
    engine = Engine(flex, cache_config={**capacities(flex), "shape_policy": "padded"})
    shapes = engine.decode_shapes()
    graphs = graphs_of(shapes)
    monkeypatch.setattr(
        engine_module, "load_artifact", lambda directory, facts, lazy: LoadedArtifact(str(directory), graphs, 0.0)
    )
    return engine, graphs


def test_an_idle_engine_loads_the_artifact_s_graphs_one_by_one_in_its_own_thread(llama, monkeypatch, tmp_path):
    _, _, flex = llama
    log = []
    engine, graphs = start(flex, monkeypatch, lambda shapes: {shape: StandIn(shape, log) for shape in shapes})
    with engine:
        assert engine._load_artifact(tmp_path) and engine.artifact_refused is None
        deadline = time.monotonic() + TIMEOUT
        while engine.artifact.pending and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine.artifact.pending == 0
    assert [shape for shape, _ in log] == list(graphs)  # each once, in order, none by the caller's thread
    assert all(name != threading.current_thread().name for _, name in log)
    assert all(graph.error == f"stand-in {shape}" for shape, graph in graphs.items())


def test_requests_are_served_while_graphs_load_and_a_request_waits_for_one_graph_at_most(llama, monkeypatch, tmp_path):
    case, upstream, flex = llama
    log, gate = [], threading.Event()
    engine, graphs = start(flex, monkeypatch, lambda shapes: {shape: StandIn(shape, log, gate) for shape in shapes})
    stream = request_stream(case, num_requests=3)
    expected = [reference(upstream, inputs, kwargs, seed) for inputs, kwargs, seed in stream]
    with engine:
        assert engine._load_artifact(tmp_path)
        deadline = time.monotonic() + TIMEOUT
        while not log and time.monotonic() < deadline:  # the idle engine is loading its first graph (held)
            time.sleep(0.01)
        handles = [engine.submit(**own_copy(inputs), seed=seed, **kwargs) for inputs, kwargs, seed in stream]
        time.sleep(0.2)
        assert len(log) == 1 and not any(handle.done() for handle in handles)  # waits for that one load
        gate.set()
        outputs = [handle.result(timeout=TIMEOUT) for handle in handles]
    for want, got in zip(expected, outputs, strict=True):
        assert_same_output(want, got)
    assert engine.artifact.pending == 0 and len(log) == len(graphs)  # the rest loaded at first use or when idle
