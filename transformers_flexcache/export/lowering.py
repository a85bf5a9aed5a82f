"""Lowering exported programs into one ExecuTorch `.pte`: partitioning, memory planning, metadata methods.

Design decisions:
- All methods are lowered together (one edge program manager) and go through one `to_executorch`, so that memory
  planning sees them together: `MemoryPlanningPass(share_mutable_buffers=True)` gives each cache buffer one allocation,
  shared by every method (matched by buffer name), which persists between calls.
- `run_reinplace_pass=True`: the cache writes are functional `index_put`s after export; ExecuTorch turns them back
  into in-place writes of the shared buffer (no copy of the buffer per layer and step).
- XNNPACK's per-partition passes that cannot change a partition (it lacks their ops) are skipped while lowering
  (`_xnnpack_passes_limited_to_each_partition`, undone afterwards).
- One decomposition per method: `to_edge` keeping the ops that XNNPACK takes whole (`linear`; quantized: also the
  quantize/dequantize ops), then `to_backend`. `to_edge_transform_and_lower` re-traces each method three times
  before partitioning (functionalize; decompose all but the kept ops; decompose again the kept nodes that XNNPACK
  refuses), which is 40% of bart-base's lowering. When XNNPACK takes every kept node, both give the same program,
  byte for byte (tested); quantized programs are functionalized first (XNNPACK's checks do not see through the
  weights' tensor subclasses before); where XNNPACK would refuse a node, the lowering goes through
  `to_edge_transform_and_lower`, which decides node by node. bart-base: 130 CPU s against 164 (docs/export.md).
- No edge transform passes: each would cost a verification of every method (seconds per method at real sizes). The
  graph rewrites that XNNPACK needs are done on the ATen programs at export (`rewrites.py`).
- The wrapper's `initialized_buffers` (the decoder-only `sequence_mask`, all ones) are written into the `.pte` with
  their values (`et_init_buffer`, what ExecuTorch's `InitializedMutableBufferPass` sets): ExecuTorch's LLM runner
  calls `forward` without `start`, and must find row 0 unpadded. Set on the placeholders directly, not by that pass:
  a pass re-traces every method. The cache buffers stay uninitialized (the methods zero rows as sequences start).
- Metadata methods (constant methods of the `.pte`): our capacities (`max_batch_size`, `max_cache_len`,
  `max_encoder_len`, `is_encoder_decoder`, `encoder_input`) and, for decoder-only models, those of ExecuTorch's LLM
  runner (`get_max_seq_len`, `get_max_context_len`, `get_vocab_size`, `get_bos_id`, `get_eos_ids`,
  `use_kv_cache`, `enable_dynamic_shape`, `get_n_layers`, `use_sdpa_with_kv_cache`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from collections.abc import Callable

BACKENDS = ("xnnpack", "portable")
# Model types whose programs export (torch programs serve every shape) but do not lower with executorch 1.4.1, as
# measured; `lower_to_executorch` refuses them before spending minutes, and the export command before loading.
NOT_LOWERABLE = {
    "phi3": (
        "ExecuTorch's re-tracing of its `forward` method narrows the batch bound (max_batch_size=3 became 2), so calls "
        "within the capacities would fail in the runtime (`set_inputs` error 0x10); measured with executorch 1.4.1 "
        "on a tiny Phi3"
    ),
    "gpt2": (
        "ExecuTorch's re-tracing of its `forward` method narrows the batch bound (max_batch_size=3 became 2), so calls "
        "within the capacities would fail in the runtime; measured with executorch 1.4.1 on a tiny GPT2 (with "
        "three methods its ReplaceViewCopyWithViewPass failed first)"
    ),
}

# XNNPACK's preprocessing runs 17 graph passes on every partition, and most re-trace the partition with symbolic
# shapes (about 0.05 s per pass and partition for t5-small). These ones change nothing unless the partition holds one
# of the ops listed (executorch 1.4.1, backends/xnnpack/_passes/), so they are skipped for partitions without them.
_XNNPACK_PASS_TRIGGERS = {
    "ConvertToUpsampleBilinear2d": ("upsample_bilinear2d",),
    "FuseBatchNormPass": ("batch_norm",),
    "DecomposeBatchNorm": ("batch_norm",),
    "Conv1dUnsqueezePass": ("convolution",),
    "PReLUReshapePass": ("prelu",),
    "InsertPadQDQPass": ("constant_pad_nd",),
    "RemoveGetItemPass": ("max_pool2d_with_indices", "aten.max.dim"),
    "DecomposeConcatenate": ("aten.cat",),
    "PropagateCustomMetaPass": ("quantize", "dequantize"),
    # Inserts layout conversions around ops that XNNPACK runs channels-last; inputs here are contiguous.
    "ChannelsLastTaggedReshapePass": ("convolution", "upsample", "mean.dim", "pool2d", "amax", "max.dim", "prelu"),
}


@contextlib.contextmanager
def _xnnpack_passes_limited_to_each_partition():
    """While lowering, XNNPACK's pass manager skips the passes of `_XNNPACK_PASS_TRIGGERS` on partitions that hold
    none of their ops. Restored on exit."""
    from executorch.backends.xnnpack._passes import XNNPACKPassManager

    original = XNNPACKPassManager.transform

    def transform(self):
        ops = {str(node.target) for node in self.exported_program.graph.nodes if node.op == "call_function"}
        self.passes = [
            p
            for p in self.passes
            if p.__name__ not in _XNNPACK_PASS_TRIGGERS
            or any(trigger in op for trigger in _XNNPACK_PASS_TRIGGERS[p.__name__] for op in ops)
        ]
        return original(self)

    XNNPACKPassManager.transform = transform
    try:
        yield
    finally:
        XNNPACKPassManager.transform = original


@dataclasses.dataclass
class LoweringReport:
    """What `lower_to_executorch` did, for progress lines and the CLI's summary.

    Attributes:
        path (`str`): the `.pte` written.
        seconds (`dict[str, float]`): wall time of each stage (`lower`, `to_executorch`, `write`).
        pte_bytes (`int`): size of the file.
        planned_bytes (`dict[str, int]`): memory that ExecuTorch plans for each method (activations and the cache
            buffers it uses; shared buffers are counted in every method that uses them).
        shared_bytes (`int`): the cache buffers, planned once and shared by all methods.
        num_partitions (`dict[str, int]`): XNNPACK partitions (delegate calls) of each method.
        metadata (`dict`): the metadata methods and their values.
    """

    path: str
    seconds: dict[str, float]
    pte_bytes: int
    planned_bytes: dict[str, int]
    shared_bytes: int
    num_partitions: dict[str, int]
    metadata: dict


def program_metadata(runner) -> dict:
    """The constant methods written into the `.pte` of `runner` (an `ExportedPrograms`)."""
    from .modules import ENCODER_INPUTS

    wrapper = runner.wrapper
    metadata = {**runner.capacities, "is_encoder_decoder": int(runner.is_encoder_decoder)}
    config = wrapper.model.config.get_text_config(decoder=True)
    if runner.is_encoder_decoder:
        metadata["encoder_input"] = ENCODER_INPUTS.index(runner.encoder_input)
        start = getattr(wrapper.model.generation_config, "decoder_start_token_id", None)
        if isinstance(start, int):
            metadata["decoder_start_token_id"] = start
        return metadata
    eos = wrapper.model.generation_config.eos_token_id
    eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
    metadata.update(
        {
            "get_max_seq_len": wrapper.max_cache_len,
            "get_max_context_len": wrapper.max_cache_len,
            "get_vocab_size": config.vocab_size,
            "get_n_layers": wrapper.num_layers,
            "use_kv_cache": True,
            "use_sdpa_with_kv_cache": False,
            "enable_dynamic_shape": True,
        }
    )
    bos = wrapper.model.generation_config.bos_token_id
    if isinstance(bos, int):
        metadata["get_bos_id"] = bos
    if eos_ids:
        metadata["get_eos_ids"] = eos_ids
    return metadata


def _partitioners(backend: str) -> list:
    from executorch.backends.xnnpack.partition.config import ALL_PARTITIONER_CONFIGS
    from executorch.backends.xnnpack.partition.config.generic_node_configs import BMMConfig
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner

    from .rewrites import KERNEL_BMM

    class KernelBMMConfig(BMMConfig):
        # The batched matmuls marked `KERNEL_BMM` stay with ExecuTorch's kernels
        def check_constraints(self, node, ep) -> bool:
            return not node.meta.get("custom", {}).get(KERNEL_BMM, False) and super().check_constraints(node, ep)

    configs = [KernelBMMConfig if config is BMMConfig else config for config in ALL_PARTITIONER_CONFIGS]
    return [XnnpackPartitioner(configs=configs)]


def check_backend(backend: str) -> None:
    """Raise `ValueError` unless `backend` is one of `BACKENDS`."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {BACKENDS}")


def lower_to_executorch(
    runner,
    path: str | os.PathLike,
    *,
    backend: str = "xnnpack",
    on_stage: Callable[[str, float], None] | None = None,
) -> LoweringReport:
    """Lower every method of `runner` (an `ExportedPrograms`) into one `.pte` at `path`, the cache buffers shared.

    Args:
        runner: the `ExportedPrograms` of an exportable wrapper.
        path: where to write the `.pte`.
        backend (`str`, *optional*, defaults to `"xnnpack"`): `"xnnpack"` delegates what XNNPACK runs (linear layers,
            attention matmuls, norms, ...); `"portable"` keeps ExecuTorch's portable kernels only (lowers faster,
            runs slower).
        on_stage (`Callable[[str, float], None]`, *optional*): called after each stage with its name and seconds.

    Returns:
        `LoweringReport`.

    Raises:
        ImportError: executorch is not installed (`pip install "transformers-flexcache[executorch]"`).
        ValueError: an unknown `backend`, a model type of `NOT_LOWERABLE`, or a `.pte` whose input bounds ExecuTorch
            narrowed below the capacities (nothing is written then).
    """
    check_backend(backend)
    model_type = getattr(runner.wrapper.model.config, "model_type", None)
    if model_type in NOT_LOWERABLE:
        raise ValueError(
            f"model_type={model_type!r} does not lower to ExecuTorch: {NOT_LOWERABLE[model_type]}. Its torch programs "
            "(export_model) serve every shape"
        )
    programs = runner.programs
    try:
        from executorch.exir import ExecutorchBackendConfig, to_edge
        from executorch.exir.passes import MemoryPlanningPass
    except ImportError as error:
        raise ImportError(
            'to_executorch needs executorch: pip install "transformers-flexcache[executorch]"'
        ) from error
    seconds = {}

    def stage(name: str, started: float) -> None:
        seconds[name] = time.perf_counter() - started
        if on_stage is not None:
            on_stage(name, seconds[name])

    metadata = program_metadata(runner)
    # Before lowering: ExecuTorch's passes may narrow the programs' constraints in place.
    input_bounds = {name: _input_upper_bounds(exported) for name, exported in programs.items()}
    started = time.perf_counter()
    if backend == "xnnpack":
        with _xnnpack_passes_limited_to_each_partition():
            edge = _lower_with_xnnpack(programs, metadata)
    else:
        # Without a partitioner, `to_edge` decomposes each method once; `to_edge_transform_and_lower` would first
        # functionalize it in a run of its own (a whole re-trace more).
        edge = to_edge(programs, constant_methods=metadata)
    stage("lower", started)
    num_partitions = {
        name: sum("call_delegate" in str(node.target) for node in edge.exported_program(name).graph.nodes)
        for name in programs
    }
    _mark_initialized_buffers(edge, programs, getattr(runner.wrapper, "initialized_buffers", ()))
    started = time.perf_counter()
    program = edge.to_executorch(
        ExecutorchBackendConfig(
            # One allocation of every cache buffer, shared by all methods (matched by buffer name).
            memory_planning_pass=MemoryPlanningPass(share_mutable_buffers=True),
            emit_mutable_buffer_names=True,
            run_reinplace_pass=True,
        )
    )
    stage("to_executorch", started)
    started = time.perf_counter()
    with open(path, "wb") as file:
        program.write_to_file(file)
    stage("write", started)
    _check_input_bounds(path, input_bounds, runner)
    planned, shared = _planned_memory(program, runner, programs)
    return LoweringReport(
        path=os.fspath(path),
        seconds=seconds,
        pte_bytes=os.path.getsize(path),
        planned_bytes=planned,
        shared_bytes=shared,
        num_partitions=num_partitions,
        metadata=metadata,
    )


def _lower_with_xnnpack(programs: dict, metadata: dict):
    """The edge programs of `programs` with what XNNPACK runs delegated: one decomposition per method when XNNPACK
    takes every node of the ops it keeps whole, else `to_edge_transform_and_lower` (see the module docstring)."""
    from executorch.exir import EdgeCompileConfig, to_edge, to_edge_transform_and_lower

    partitioner = _partitioners("xnnpack")[0]
    kept = _ops_taken_whole(programs, partitioner)
    if kept is None:
        # Quantized linears read their weights through tensor subclasses until the programs are functionalized (one
        # re-trace): XNNPACK's checks see them then.
        programs = {name: exported.run_decompositions({}) for name, exported in programs.items()}
        kept = _ops_taken_whole(programs, partitioner)
    if kept is None:
        return to_edge_transform_and_lower(programs, partitioner=[partitioner], constant_methods=metadata)
    edge = to_edge(programs, constant_methods=metadata, compile_config=EdgeCompileConfig(preserve_ops=kept))
    with _quiet_deprecation_of_to_backend():
        return edge.to_backend(partitioner)


def _ops_taken_whole(programs: dict, partitioner) -> list | None:
    """The ops of `programs` that `partitioner` asks to keep from decomposition, or `None` if it would refuse one of
    their nodes (then `to_edge_transform_and_lower` must decompose that node, and only it)."""
    kept = set()
    for exported in programs.values():
        ops, takes = partitioner.ops_to_not_decompose(exported)
        for node in exported.graph.nodes:
            if node.op == "call_function" and node.target in ops:
                if takes is not None and not takes(node):
                    return None
                kept.add(node.target)
    return sorted(kept, key=str)


@contextlib.contextmanager
def _quiet_deprecation_of_to_backend():
    """Drop the XNNPACK partitioner's warning that `to_edge` + `to_backend` is deprecated (executorch 1.4.1 logs it
    when no caller on the stack is named `to_edge_transform_and_lower`): both flows give the same program here."""
    import logging

    logger = logging.getLogger("executorch.backends.xnnpack.partition.xnnpack_partitioner")

    def keep(record) -> bool:
        return "DEPRECATION WARNING" not in record.getMessage()

    logger.addFilter(keep)
    try:
        yield
    finally:
        logger.removeFilter(keep)


def _mark_initialized_buffers(edge, method_names, buffer_names) -> None:
    """Mark the placeholders of the wrapper's buffers `buffer_names` (`owner.<name>` in every method) as holding
    their initial values in the `.pte`."""
    fqns = {f"owner.{name}" for name in buffer_names}
    for method_name in method_names:
        exported = edge.exported_program(method_name)
        inputs_to_buffers = exported.graph_signature.inputs_to_buffers
        for node in exported.graph.nodes:
            if node.op == "placeholder" and inputs_to_buffers.get(node.name) in fqns:
                node.meta["et_init_buffer"] = True


def _input_upper_bounds(exported) -> list[list[int]]:
    """The largest shape of each user input of an exported program, from its range constraints."""
    import torch

    bounds = {symbol: constraint.upper for symbol, constraint in exported.range_constraints.items()}
    names = set(exported.graph_signature.user_inputs)
    shapes = []
    for node in exported.graph.nodes:
        if node.op == "placeholder" and node.name in names:
            shape = []
            for size in node.meta["val"].shape:
                expr = size.node.expr if isinstance(size, torch.SymInt) else size
                shape.append(int(expr.subs(bounds)) if hasattr(expr, "subs") else int(expr))
            shapes.append(shape)
    return shapes


def _check_input_bounds(path, input_bounds: dict[str, list[list[int]]], runner) -> None:
    """Refuse (and remove) a `.pte` whose methods take smaller inputs than the exported programs. ExecuTorch re-traces
    each method, and where it loses a dynamic size there (measured on Phi3: the batch bound 3 became 2, and an
    `arange` became static), calls within the capacities would fail in the runtime (`set_inputs` error 0x10)."""
    from executorch.runtime import Runtime

    program = Runtime.get().load_program(os.fspath(path))
    for name, want in input_bounds.items():
        meta = program.metadata(name)
        got = [list(meta.input_tensor_meta(index).sizes()) for index in range(meta.num_inputs())]
        if got != want:
            os.remove(path)
            model = runner.wrapper.model
            model_type = getattr(model.config, "model_type", type(model).__name__)
            raise ValueError(
                f"ExecuTorch lowered method {name!r} of this {model_type} model with input bounds {got}, smaller than "
                f"the exported program's {want} (the capacities): calls within them would fail in its runtime, so no "
                f".pte was written. This model type does not lower with this version of executorch; its torch "
                "programs (export_model) still serve every shape"
            )


def _planned_memory(program, runner, programs) -> tuple[dict[str, int], int]:
    """Planned bytes per method, and the bytes of the cache buffers (shared by the methods)."""
    planned = {
        plan.name: int(sum(plan.non_const_buffer_sizes))
        for plan in program.executorch_program.execution_plan
        if plan.name in programs
    }
    shared = sum(buffer.nbytes for _, buffer in runner.wrapper.named_buffers(recurse=False))
    return planned, int(shared)


def bf16_unsupported_reason(backend: str) -> str | None:
    """Why a bfloat16 program cannot run on `backend`, or `None` if it can."""
    if backend != "xnnpack":
        return None
    # executorch 1.4.1, backends/xnnpack/partition/config/xnnpack_config.py: `_check_node_has_valid_dtype`.
    return (
        "ExecuTorch's XNNPACK partitioner (executorch 1.4.1) delegates float32 and float16 ops only, whatever the CPU "
        "supports, so a bfloat16 program would run entirely on portable kernels; pass --backend portable to do that "
        "knowingly"
    )
