"""Probe: two ways to ship a compiled decode step that a later process loads without tracing (issue 55).

On one bucket decode graph of the serving engine (a t5-small-sized T5 with seeded random weights, the server's
default capacities and buckets), at batch 1 and batch 8, one thread:
- `today`: the engine's decode step as `serve --compile` runs it (`compile_config_for_cpu()`, freezing), compiled in
  this process; its first call is its cold compile.
- `A` (no freezing): `torch.compile(fullgraph=True).aot_compile(...)` of the model's forward with the same settings
  but `freezing=False` (the weights stay inputs of the graph), saved with `save_compiled_function` and loaded with
  `torch.compiler.load_compiled_function` in a child process with an empty inductor cache (what a replica sees).
- `B` (AOTInductor): `torch.export` of the same decode step (the cache's tensors as inputs, mutated in place) and
  `torch._inductor.aoti_compile_and_package` with the settings of `compile_config_for_cpu()` (freezing and the
  package's graph passes), loaded with `torch._C._aoti.AOTIModelPackageLoader` in a child process.

Per route: cold compile seconds, load seconds (child process, time to the loaded callable and to its first step),
the package's bytes, and the decode step's median milliseconds at batch 1 and 8, the routes interleaved in one
process (round after round), with the largest logit difference against `today`.

    PYTHONPATH=. python scripts/probe_compile_routes.py --threads 1 --json probe.json [--int8] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch


def build(quick: bool, int8: bool):
    """(override T5, engine) with the server's default capacities and buckets, compiled as `serve --compile`."""
    from transformers_flexcache.bench.models import BENCH_MODELS, build_models
    from transformers_flexcache.compile import compile_config_for_cpu, quantize, raise_recompile_limits
    from transformers_flexcache.serving import Engine
    from transformers_flexcache.serving.buckets import default_buckets

    _, model = build_models(BENCH_MODELS["t5"], quick=quick, seed=0)
    if int8:
        quantize(model, "int8")
    capacities = {"max_batch_size": 8, "max_cache_len": 512, "max_encoder_len": 512}
    cache_config = {**capacities, "shape_policy": "bucketed", "buckets": default_buckets(capacities)}
    engine = Engine(model, cache_config=cache_config, compile_config=compile_config_for_cpu())
    raise_recompile_limits(len(engine.decode_shapes()))
    return model, engine


class StepInputs:
    """The engine's decode step at one shape `(B, W, E_W)`, every seat free: its kwargs, and the cache's tensors."""

    def __init__(self, engine, shape):
        self.engine, self.shape = engine, shape

    def __enter__(self) -> dict:
        span, window, cross_window = self.shape
        cache = self.engine.cache
        cache.begin_decode(span=span, window=window, cross_window=cross_window)
        cache.mark_written(span)
        empty = torch.zeros(0, dtype=torch.long)
        return self.engine.steps.decode_inputs(
            span=span, window=window, cross_window=cross_window, rows=empty, tokens=empty, positions=None
        )

    def __exit__(self, *exc) -> None:
        self.engine.cache.end_step()


class ExportedStep(torch.nn.Module):
    """The decode step at one shape as a module of tensors: `forward(decoder_input_ids, decoder_attention_mask,
    attention_mask, *cache_tensors) -> logits`; the cache's tensors are swapped in for the call (so that export sees
    them as inputs, mutated in place), and its step state (`SeatSteps._by_device`) is rebuilt from them."""

    def __init__(self, model, engine, shape):
        super().__init__()
        self.model, self.engine, self.shape = model, engine, shape
        from transformers_flexcache.cache import tensor_slots

        self.slots = tensor_slots(engine.cache)

    def cache_tensors(self) -> list[torch.Tensor]:
        return [getattr(owner, name) for owner, name in self.slots]

    def forward(self, decoder_input_ids, decoder_attention_mask, attention_mask, *tensors):
        from transformers.modeling_outputs import BaseModelOutput

        span, window, cross_window = self.shape
        cache, steps = self.engine.cache, self.engine.steps
        saved = self.cache_tensors()
        try:
            for (owner, name), tensor in zip(self.slots, tensors, strict=True):
                setattr(owner, name, tensor)
            cache.begin_decode(span=span, window=window, cross_window=cross_window)  # its step state, from them
            kwargs = {
                "cache": cache,
                "use_cache": True,
                "return_dict": True,
                "decoder_input_ids": decoder_input_ids,
                "decoder_attention_mask": decoder_attention_mask,
                "encoder_outputs": BaseModelOutput(
                    last_hidden_state=steps.encoder_dummy.expand(span, cross_window, -1)
                ),
                steps.encoder_mask_key: attention_mask,
            }
            return self.model(**kwargs).logits
        finally:
            cache.end_step()
            for (owner, name), tensor in zip(self.slots, saved, strict=True):
                setattr(owner, name, tensor)


def median_ms(run, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--int8", action="store_true")
    parser.add_argument("--quick", action="store_true", help="tiny T5: a smoke test")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20, help="decode steps timed per route per round")
    parser.add_argument("--routes", default="A,B")
    parser.add_argument("--json")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.child:
        return child(args)
    return probe(args)


def probe(args) -> int:
    from transformers_flexcache.bench.report import machine_info

    routes = args.routes.split(",")
    model, engine = build(args.quick, args.int8)
    shapes = [shape for shape in engine.decode_shapes() if shape[1] == min(s[1] for s in engine.decode_shapes())]
    shapes = [s for s in shapes if s[2] == min(x[2] for x in shapes) and s[0] in (1, engine.max_batch_size)]
    figures = {"machine": machine_info(args.threads), "load_average": os.getloadavg(), "int8": args.int8, "shapes": {}}
    work = Path(tempfile.mkdtemp(prefix="probe-routes-"))
    runs = {}
    torch.manual_seed(0)
    with torch.no_grad():
        for shape in shapes:
            span = shape[0]
            ids = torch.randint(3, model.config.vocab_size - 1, (span, 1))
            entry = figures["shapes"][str(shape)] = {}
            runs[shape] = {}
            # today
            with StepInputs(engine, shape) as kwargs:
                kwargs["decoder_input_ids"] = ids
                started = time.perf_counter()
                with engine.steps.compile_settings():
                    reference = engine.steps.decode_forward(**kwargs).logits
                entry["today_compile_s"] = time.perf_counter() - started

            def today(shape=shape, ids=ids):
                with StepInputs(engine, shape) as kwargs, engine.steps.compile_settings():
                    kwargs["decoder_input_ids"] = ids
                    return engine.steps.decode_forward(**kwargs).logits

            runs[shape]["today"] = today
            step = ExportedStep(model, engine, shape)
            with StepInputs(engine, shape) as kwargs:
                inputs = (ids, kwargs["decoder_attention_mask"], kwargs[engine.steps.encoder_mask_key])
            if "B" in routes:
                entry["B"] = route_b(step, inputs, work / f"b{span}.pt2", args, runs[shape], reference)
            if "A" in routes:
                entry["A"] = route_a(model, engine, shape, ids, work / f"a{span}.bin", args, runs[shape], reference)
        # step times, interleaved
        times = {shape: {name: [] for name in runs[shape]} for shape in shapes}
        for _ in range(args.rounds):
            for shape in shapes:
                for name, run in runs[shape].items():
                    run()
                    times[shape][name].append(median_ms(run, args.steps))
        for shape in shapes:
            figures["shapes"][str(shape)]["step_ms"] = {n: statistics.median(t) for n, t in times[shape].items()}
    print(json.dumps(figures, indent=1, default=str))
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1, default=str))
    return 0


def route_b(step, inputs, path: Path, args, runs: dict, reference) -> dict:
    from transformers_flexcache.compile import compile_config_for_cpu

    result = {}
    tensors = step.cache_tensors()
    started = time.perf_counter()
    try:
        program = torch.export.export(step, (*inputs, *tensors), strict=False)
        result["export_s"] = time.perf_counter() - started
        options = dict(compile_config_for_cpu().options)
        torch._inductor.aoti_compile_and_package(program, package_path=str(path), inductor_configs=options)
    except Exception as error:  # noqa: BLE001 - a probe reports what failed
        result["error"] = f"{type(error).__name__}: {error}"[:2000]
        return result
    result["compile_s"] = time.perf_counter() - started
    result["bytes"] = path.stat().st_size
    result["load"] = load_in_child(args, "B", path)
    loader = torch._C._aoti.AOTIModelPackageLoader(str(path), "model", False, 1, -1)

    def run():
        return loader.run([*inputs, *step.cache_tensors()])[0]

    result["max_abs_diff"] = (run() - reference).abs().max().item()
    runs["B"] = run
    return result


def route_a(model, engine, shape, ids, path: Path, args, runs: dict, reference) -> dict:
    from transformers_flexcache.compile import compile_config_for_cpu

    result = {}
    options = {key: value for key, value in compile_config_for_cpu().options.items() if key != "freezing"}
    # the joint-graph passes pack parameters for freezing to fold; without freezing they would pack at every step
    options.pop("joint_custom_post_pass", None)
    # dynamo cannot serialize guards on objects (the model's modules, the cache's classes and identities): only the
    # tensors' guards (shapes, strides, dtypes) are kept
    options["guard_filter_fn"] = torch.compiler.skip_all_guards_unsafe
    compiled = torch.compile(type(model).forward, fullgraph=True, dynamic=False, backend="inductor", options=options)
    started = time.perf_counter()
    try:
        with StepInputs(engine, shape) as kwargs:
            kwargs["decoder_input_ids"] = ids
            function = compiled.aot_compile(((model,), kwargs))
        result["compile_s"] = time.perf_counter() - started
        function.save_compiled_function(str(path), external_data=external_data(model))
    except Exception as error:  # noqa: BLE001
        result["error"] = f"{type(error).__name__}: {error}"[:2000]
        return result
    result["bytes"] = path.stat().st_size
    result["load"] = load_in_child(args, "A", path)

    def run():
        with StepInputs(engine, shape) as kwargs:
            kwargs["decoder_input_ids"] = ids
            return function(model, **kwargs).logits

    result["max_abs_diff"] = (run() - reference).abs().max().item()
    runs["A"] = run
    return result


def external_data(model) -> dict:
    """What the saved function refers to and pickle cannot name: the model, and its class's forward (an override
    class carries its upstream's name) with the functions it wraps."""
    data, function, depth = {"model": model}, type(model).forward, 0
    while function is not None:
        data[f"forward{depth}"] = function
        function, depth = getattr(function, "__wrapped__", None), depth + 1
    return data


def load_route_a(path, model):
    """`torch.compiler.load_compiled_function` of `path`. Dynamo names the modules its bytecode reads by their id
    in the compiling process (`___module_collections_<id>_c1`): each such name it reports missing is given its
    module, once."""
    import importlib
    import re

    data = Path(path).read_bytes()
    f_globals = {}
    for _ in range(2):
        try:
            return torch._dynamo.aot_compile.AOTCompiledFunction.deserialize(data, f_globals, external_data(model))
        except RuntimeError as error:
            missing = re.findall(r"'(___module_([A-Za-z0-9_.]+?)_\d+_c\d+)'", str(error))
            if not missing:
                raise
            f_globals = {name: importlib.import_module(module) for name, module in missing}
    raise RuntimeError("unreachable")


def load_in_child(args, route: str, path: Path) -> dict:
    """Seconds a fresh process (empty inductor cache) takes to load the route's file."""
    environment = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": tempfile.mkdtemp(prefix="probe-inductor-")}
    command = [sys.executable, __file__, "--child", f"{route}:{path}", "--threads", str(args.threads)]
    command += ["--quick"] if args.quick else []
    command += ["--int8"] if args.int8 else []
    done = subprocess.run(command, capture_output=True, text=True, env=environment, timeout=1800)
    if done.returncode:
        return {"error": done.stderr[-2000:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def child(args) -> int:
    route, path = args.child.split(":", 1)
    started = time.perf_counter()
    if route == "B":
        from transformers_flexcache.compile import resolve_int8_linears  # noqa: F401  (imports the passes, which
        # register the package's ops that an int8 graph calls)

        loader = torch._C._aoti.AOTIModelPackageLoader(path, "model", False, 1, -1)
        print(json.dumps({"load_s": time.perf_counter() - started, "call_spec": len(loader.get_call_spec())}))
        return 0
    model, engine = build(args.quick, args.int8)
    built = time.perf_counter()
    function = load_route_a(path, model)
    loaded = time.perf_counter()
    shape = next(iter(engine.decode_shapes()))
    with torch.no_grad(), StepInputs(engine, shape) as kwargs:
        kwargs["decoder_input_ids"] = torch.zeros((shape[0], 1), dtype=torch.long)
        try:
            function(model, **kwargs)
        except RuntimeError:
            pass  # another shape than the file's: its guards say so (the load is what is timed)
    print(
        json.dumps(
            {"build_s": built - started, "load_s": loaded - built, "first_call_s": time.perf_counter() - loaded}
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
