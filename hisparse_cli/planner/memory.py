"""Memory planner: what one `Engine.generate` run allocates on its device, before loading.

    plan = plan_memory(cfg, weight_format="awq-int4", sparse=profile.sparse_config(),
                       context_tokens=131072, max_new_tokens=512, kv_dtype="float16",
                       compute_dtype="float16", device_kind="cuda", backend="triton",
                       embeddings_on_host=True, budget_bytes=profile.vram_budget_bytes)
    plan.peak_allocated_bytes, plan.fits, plan.suggestions, plan.to_dict()

How: weights are summed tensor by tensor (planner/weights.py); the run is replayed step by
step with the engine's own host policy (planner/run.py) and op-level allocation traces of
every step (planner/trace.py, planner/step.py). `peak_allocated_bytes` predicts
`torch.cuda.max_memory_allocated()` over a generate call (the engine resets the peak at its
start). Counted line items sum to it exactly: the weights, cuBLAS's workspace, and what was
live at the peak moment (ids, paged KV storage, slots, logits, that step's temporaries).

Constants measured by benchmarks/gpu_engine.py (it prints the values to put here):
CUDA_CONTEXT_BYTES is what the driver holds outside torch's allocator (not in
max_memory_allocated, so reported separately; H100, after cuBLAS init);
CUBLAS_WORKSPACE_BYTES is torch's cuBLAS workspace, allocated through the caching allocator
on the first matmul (H200).

A budget (a profile's `vram_budget_gib`) covers allocations only: the profiles subtract the
context and a fragmentation margin when they set it. `fits` = peak_allocated <= budget.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from hisparse_cli.config.execution import ExecutionPlan, resolve_execution
from hisparse_cli.config.settings import SparseConfig, check_positions
from hisparse_cli.errors import ConfigError
from hisparse_cli.kernels.dispatch import KernelBackend
from hisparse_cli.model.config import ModelConfig
from hisparse_cli.planner.run import KVSummary, policy, simulate_run
from hisparse_cli.planner.suggest import Suggestion, suggestions
from hisparse_cli.planner.trace import StepShape, cuda_block_bytes
from hisparse_cli.planner.weights import check_awq_shapes, weight_items

MIB = 1 << 20
GIB = 1 << 30
# the driver's context outside torch's allocator, measured after cuBLAS init on an H100
# (torch 2.11, CUDA 13: 595 MiB; gpu_engine.py calibrate's non_allocator_bytes_after_cublas)
CUDA_CONTEXT_BYTES = 595 * MIB
CUBLAS_WORKSPACE_BYTES = 32 * MIB  # torch default on sm90 (4096 KiB x 8); calibrate likewise
DEFAULT_NUM_SMS = 132  # H200 / H100 SXM: Triton split choices depend on it
WEIGHT_FORMATS = ("fp16", "bf16", "fp32", "awq-int4")
DEVICE_KINDS = ("cuda", "cpu")
BACKENDS = ("triton", "torch")
_DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}
_ALIASES = {"fp16": "float16", "half": "float16", "bf16": "bfloat16", "fp32": "float32",
            "float": "float32"}


def dtype_name(value: object, field_name: str) -> str:
    """'float16' | 'bfloat16' | 'float32' from a torch dtype or a name; ConfigError otherwise."""
    name = str(value).removeprefix("torch.").lower()
    name = _ALIASES.get(name, name)
    if name not in _DTYPE_BYTES:
        raise ConfigError(f"{field_name} must be float16, bfloat16 or float32, got {value!r}")
    return name


@dataclass(frozen=True)
class LineItem:
    name: str
    bytes: int
    formula: str
    counted: bool = True  # part of peak_allocated_bytes (False: shown for information)


@dataclass(frozen=True)
class MemoryPlan:
    model: str
    settings: dict
    items: tuple[LineItem, ...]
    weights_bytes: int
    peak_allocated_bytes: int  # predicted torch.cuda.max_memory_allocated of the run
    resident_bytes: int  # allocated between steps when the run ends (weights, KV, slots, ...)
    cuda_context_bytes: int  # outside torch's allocator (0 on cpu)
    device_total_bytes: int  # peak + context: what the device must hold
    budget_bytes: int | None
    fits: bool | None
    peak_when: str
    kv: KVSummary
    phase_peaks: dict
    suggestions: tuple[Suggestion, ...] = ()
    notes: tuple[str, ...] = ()
    # host memory the run allocates outside the device's: the retrieval tier's offload store
    # (pinned, CUDA; 0 on the CPU, where offloaded pages stay in the KV storage) and weights
    # kept in host RAM; host_fits: whether it fits this machine's RAM
    host_bytes: int = 0
    offload_store_bytes: int = 0
    offload_bytes: int = 0  # pages off the working set at the run's end (x bytes per page)
    host_ram_bytes: int | None = None
    host_fits: bool | None = None
    request: dict = field(default_factory=dict, repr=False, compare=False)  # for re-planning
    execution: ExecutionPlan | None = field(default=None, compare=False)

    @property
    def headroom_bytes(self) -> int | None:
        return None if self.budget_bytes is None else self.budget_bytes - self.peak_allocated_bytes

    def to_dict(self) -> dict:
        d = {k: v for k, v in asdict(self).items() if k not in ("request", "execution")}
        d["headroom_bytes"] = self.headroom_bytes
        d["execution"] = self.execution.to_dict() if self.execution is not None else None
        return d


def _validate(weight_format: str, device_kind: str, backend: str, group_size: int,
              context_tokens: int, max_new_tokens: int, budget_bytes: int | None) -> None:
    for name, value, choices in (("weight_format", weight_format, WEIGHT_FORMATS),
                                 ("device_kind", device_kind, DEVICE_KINDS),
                                 ("backend", backend, BACKENDS)):
        if value not in choices:
            raise ConfigError(f"{name} must be one of {', '.join(choices)}, got {value!r}")
    if device_kind == "cpu" and backend == "triton":
        raise ConfigError("backend 'triton' needs device_kind 'cuda'",
                          hint="plan the cpu with backend='torch'")
    if weight_format == "awq-int4" and group_size not in (32, 64, 128):
        raise ConfigError(f"group_size must be 32, 64 or 128, got {group_size!r}")
    for name, value, lo in (("context_tokens", context_tokens, 1),
                            ("max_new_tokens", max_new_tokens, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < lo:
            raise ConfigError(f"{name} must be an integer >= {lo}, got {value!r}")
    if budget_bytes is not None and (not isinstance(budget_bytes, int) or budget_bytes <= 0):
        raise ConfigError(f"budget_bytes must be a positive integer, got {budget_bytes!r}")


def planned_kernels(device_kind: str, backend: str) -> KernelBackend:
    """The kernels a run on the planned device uses: `backend` for every family, except that a
    CPU run's AWQ INT4 calls go through torch's packed int4 kernel where this machine's CPU
    backend does (AWQLinear.packs_on; not with HISPARSE_BACKEND=torch)."""
    int4 = backend
    if device_kind == "cpu":
        from hisparse_cli.kernels.dispatch import select_backend

        int4 = select_backend("cpu").int4_linear
    return KernelBackend(attention=backend, int4_linear=int4, elementwise=backend)


def sampler_buffer_bytes(vocab: int, new_tokens: int, in_graph: bool) -> tuple[int, ...]:
    """The graph decode's sampler buffers: the in-graph sampler's, or DeviceSampler's."""
    if in_graph:
        from hisparse_cli.engine.sampling.graph import GraphSampler

        return GraphSampler.buffer_bytes(vocab, new_tokens)
    from hisparse_cli.engine.sampling.device import DeviceSampler

    return DeviceSampler.buffer_bytes(vocab, new_tokens)


def _cpu_decode_bytes(execution: ExecutionPlan, model_cfg: ModelConfig) -> int:
    """Element size of the native CPU decode copy the run holds (0: none; model/cpu_decode.py)."""
    if execution.cpu_decode.value != "native":
        return 0
    from hisparse_cli.model.cpu_decode import copy_element_bytes

    return copy_element_bytes(model_cfg)


def plan_memory(model_cfg: ModelConfig, *, weight_format: str, group_size: int = 128,
                awq_lm_head: bool = False, embeddings_on_host: bool = False,
                lm_head_int8: bool = False, sparse: SparseConfig, context_tokens: int,
                max_new_tokens: int, kv_dtype,
                compute_dtype, device_kind: str, backend: str, budget_bytes: int | None = None,
                num_sms: int = DEFAULT_NUM_SMS, model_name: str = "",
                suggest: bool = True, execution: ExecutionPlan | None = None,
                prefill_cache_layers: int | None = 0) -> MemoryPlan:
    """Predict the device memory of one generate run (see the module docstring).
    lm_head_int8: an fp output head quantized to INT8 at load (model/int8_linear.py; an INT4
    head, awq_lm_head, stays INT4). execution: how the run executes (an Engine's plan);
    default: resolved for the planned device and backend, as an Engine there would
    (config/execution.py). prefill_cache_layers: decoder layers whose INT4 linears keep W^T
    for prefill (Engine.keep_prefill_weights); None: as many as the budget has room for after
    the run (CUDA, AWQ INT4 weights on the Triton kernels, a budget; else 0)."""
    if prefill_cache_layers is None:
        return _with_prefill_cache(dict(
            model_cfg=model_cfg, weight_format=weight_format, group_size=group_size,
            awq_lm_head=awq_lm_head, embeddings_on_host=embeddings_on_host,
            lm_head_int8=lm_head_int8, sparse=sparse, context_tokens=context_tokens,
            max_new_tokens=max_new_tokens, kv_dtype=kv_dtype, compute_dtype=compute_dtype,
            device_kind=device_kind, backend=backend, budget_bytes=budget_bytes,
            num_sms=num_sms, model_name=model_name, suggest=suggest, execution=execution))
    _validate(weight_format, device_kind, backend, group_size, context_tokens, max_new_tokens,
              budget_bytes)
    check_positions(model_cfg.max_position_embeddings, sparse=sparse,
                    max_new_tokens=max_new_tokens)  # what summarize refuses, refused here too
    kv_name, c_name = dtype_name(kv_dtype, "kv_dtype"), dtype_name(compute_dtype, "compute_dtype")
    awq = weight_format == "awq-int4"
    if awq:
        bad = check_awq_shapes(model_cfg, group_size, awq_lm_head)
        if bad:
            raise ConfigError(f"weight_format awq-int4: {bad}")
    request = dict(model_cfg=model_cfg, weight_format=weight_format, group_size=group_size,
                   awq_lm_head=awq_lm_head, embeddings_on_host=embeddings_on_host,
                   lm_head_int8=lm_head_int8, sparse=sparse, context_tokens=context_tokens,
                   max_new_tokens=max_new_tokens,
                   kv_dtype=kv_name, compute_dtype=c_name, device_kind=device_kind,
                   backend=backend, budget_bytes=budget_bytes, num_sms=num_sms,
                   model_name=model_name)
    cuda = device_kind == "cuda"
    host_emb = embeddings_on_host and cuda  # on the cpu the table is already in host memory
    if execution is None:
        execution = resolve_execution(
            device=device_kind, model_cfg=model_cfg, sparse=sparse, compute_dtype=c_name,
            kv_dtype=kv_name, weight_awq=awq, group_size=group_size,
            kernels=planned_kernels(device_kind, backend))
    cpu_int4 = execution.int4_layout.value == "int4pack"
    cb, kvb = _DTYPE_BYTES[c_name], _DTYPE_BYTES[kv_name]
    seq = policy(sparse, model_cfg.sliding_window)
    use_globals = seq.window is not None and sparse.global_tokens > 0
    imp = sparse.importance
    track = use_globals and imp in ("attention", "snapkv")  # runner.KVRun.track_scores
    w = seq.window or 1
    min_distance = w - min(sparse.observation_window, w) if track and imp == "snapkv" else 0
    shape = StepShape(
        layers=model_cfg.num_hidden_layers, hidden=model_cfg.hidden_size,
        inter=model_cfg.intermediate_size, vocab=model_cfg.vocab_size,
        hq=model_cfg.num_attention_heads, hkv=model_cfg.num_key_value_heads,
        d=model_cfg.head_dim, cb=cb, kvb=kvb, cuda=cuda, backend=backend, awq=awq,
        group=group_size, awq_lm_head=awq_lm_head, qkv_bias=model_cfg.attention_bias,
        o_bias=model_cfg.o_bias, mlp_bias=model_cfg.mlp_bias, qk_norm=model_cfg.qk_norm,
        bs=sparse.block_size, sinks=seq.sinks, window=seq.window,
        G=sparse.global_tokens if use_globals else 0,
        C=sparse.recalibrate_topk if use_globals else 0,
        track_scores=track, score_tensor=track or (use_globals and imp == "probe"),
        score_stride=sparse.score_stride, min_distance=min_distance, importance=imp,
        num_sms=num_sms, cpu_int4=cpu_int4,
        fp8_prefill=execution.int4_prefill.value == "w4a8",
        prefill_cached=awq and prefill_cache_layers >= model_cfg.num_hidden_layers,
        residual_chain=cuda and execution.kernels.elementwise == "triton")
    graph = bool(execution.graph_decode.value)  # Engine._use_graph
    in_graph = graph and bool(execution.graph_sampler.value)
    run = simulate_run(shape, sparse, model_cfg.sliding_window, context_tokens, max_new_tokens,
                       graph_workspace=CUBLAS_WORKSPACE_BYTES if graph else 0,
                       graph_input_bytes=model_cfg.hidden_size * cb if host_emb else 0,
                       sampler_bytes=(sampler_buffer_bytes(model_cfg.vocab_size, max_new_tokens,
                                                           in_graph) if graph else ()),
                       sampler_kept=in_graph)
    witems = weight_items(model_cfg, cb=cb, awq=awq, group=group_size, awq_lm_head=awq_lm_head,
                          lm_head_int8=lm_head_int8,
                          embeddings_on_host=host_emb, cuda=cuda, cpu_int4=cpu_int4,
                          cpu_decode=_cpu_decode_bytes(execution, model_cfg),
                          prefill_cache_layers=prefill_cache_layers if awq else 0)
    items = [LineItem(w.name if w.on_device else w.name + " (host RAM)", w.bytes, w.formula,
                      counted=w.on_device) for w in witems]
    weights = sum(w.bytes for w in witems if w.on_device)
    workspace = CUBLAS_WORKSPACE_BYTES if cuda else 0
    if cuda:
        items.append(LineItem("workspace.cublas", workspace,
                              "torch's cuBLAS workspace (caching allocator; calibrated constant)"))
    if cuda and awq and backend == "triton":
        from hisparse_cli.kernels.int4.awq_gemv import COUNTERS

        workspace += COUNTERS * 4
        items.append(LineItem("workspace.awq_gemv_counters", COUNTERS * 4,
                              "the split-K INT4 GEMV's column-tile counters (int32, made once "
                              "per device on its first split call, kept)"))
    persistent = graph and awq and execution.persistent
    persistent_why = (execution.decode_kernel.reason if graph and awq and not persistent
                      else None)
    if persistent:  # kernels/cuda/cuda_step.py's buffers
        from hisparse_cli.kernels.cuda.cuda_step import buffer_bytes

        pb = sum(cuda_block_bytes(n) for n in buffer_bytes(model_cfg, awq_lm_head, num_sms))
        workspace += pb
        items.append(LineItem(
            "workspace.persistent_decode", pb,
            "the persistent decode kernel's buffers (the decode takes it: HISPARSE_DECODE_KERNEL "
            "unset on an sm_90 GPU, or =persistent): its zeroed workspace (each layer's q|k|v "
            "and gate|up sums, the INT4 head's logits), residual stream, attention partials, "
            "phase table; the layer-by-layer decode activations are still counted (an upper "
            "bound)"))
    items += _run_items(run, shape, context_tokens)
    peak = weights + workspace + run.peak
    assert sum(i.bytes for i in items if i.counted) == peak
    items += _info_items(run)
    store = run.extra.get("offload_store_host_bytes", 0)
    if run.extra:
        items.append(LineItem(
            "offload_store (host RAM)", store,
            "retrieval tier: every page of the run in pinned host memory, K and V "
            "[L, Hkv, pages, bs, D]" if cuda else
            "retrieval tier: offloaded pages stay in place in kv.paged_kv (sized for every "
            f"block); {run.extra['offloaded_pages']} pages = {run.extra['offload_bytes']:,} B "
            "of it are off the working set at the end", counted=False))
    host = store + sum(w.bytes for w in witems if not w.on_device)
    ram = host_ram_bytes() if cuda else None
    host_fits = None if ram is None else host <= ram
    context = CUDA_CONTEXT_BYTES if cuda else 0
    resident = weights + workspace + sum(run.resident_end.values())
    fits = None if budget_bytes is None else peak <= budget_bytes
    notes = _notes(model_cfg, sparse, context_tokens, max_new_tokens, weight_format, c_name,
                   device_kind, backend)
    if graph:
        notes += (_REUSE_NOTE.format(logits=model_cfg.vocab_size * 4,
                                     inputs=run.resident_end.get("cuda_graph", 0),
                                     sampler=run.resident_end.get("sampler", 0)),)
    if persistent:
        notes += ("decode: the persistent kernel (one launch a token; its buffers are "
                  "workspace.persistent_decode)",)
    elif persistent_why and execution.decode_kernel_asked == "persistent":
        notes += (f"decode: layer by layer, not the persistent kernel asked for: "
                  f"{persistent_why}",)
    if host_emb and graph:
        notes += ("the host embedding table is page-locked (cudaHostRegister) so that the "
                  "decode graph reads each token's row itself; where the driver refuses, the host "
                  "reads each token instead",)
    settings = dict(weight_format=weight_format, group_size=group_size if awq else None,
                    awq_lm_head=awq_lm_head, embeddings_on_host=embeddings_on_host,
                    lm_head_int8=lm_head_int8, context_tokens=context_tokens,
                    max_new_tokens=max_new_tokens,
                    kv_dtype=kv_name, compute_dtype=c_name, device_kind=device_kind,
                    backend=backend, num_sms=num_sms, sparse=asdict(sparse),
                    prefill_cache_layers=prefill_cache_layers if awq else 0)
    plan = MemoryPlan(model=model_name or model_cfg.model_type, settings=settings,
                      items=tuple(items), weights_bytes=weights, peak_allocated_bytes=peak,
                      resident_bytes=resident, cuda_context_bytes=context,
                      device_total_bytes=peak + context, budget_bytes=budget_bytes, fits=fits,
                      peak_when=run.peak_label, kv=run.kv, phase_peaks=dict(run.phase_peaks),
                      notes=notes, request=request, execution=execution, host_bytes=host,
                      offload_store_bytes=store, host_ram_bytes=ram, host_fits=host_fits,
                      offload_bytes=run.extra.get("offload_bytes", 0))
    if suggest and fits is False:
        from dataclasses import replace

        plan = replace(plan, suggestions=tuple(suggestions(plan, plan_memory)))
    return plan


def prefill_cache_applies(weight_format: str, device_kind: str, backend: str) -> bool:
    """Where the prefill weight cache runs: INT4 weights on CUDA's Triton kernels (elsewhere a
    prefill product has no per-chunk dequantize pass worth keeping)."""
    return weight_format == "awq-int4" and device_kind == "cuda" and backend == "triton"


def _with_prefill_cache(req: dict) -> MemoryPlan:
    """plan_memory with prefill_cache_layers=None: the run planned without the cache, then
    with as many decoder layers' W^T as the budget has room for beside its peak (the cache is
    held for the whole run, so it adds to the peak at every point)."""
    base = plan_memory(**req, prefill_cache_layers=0)
    if (base.budget_bytes is None or not base.fits
            or not prefill_cache_applies(req["weight_format"], req["device_kind"],
                                         req["backend"])):
        return base
    from hisparse_cli.planner.weights import prefill_cache_layer_bytes

    cfg = req["model_cfg"]
    per = prefill_cache_layer_bytes(cfg, _DTYPE_BYTES[dtype_name(req["compute_dtype"],
                                                                 "compute_dtype")], True)
    layers = min(cfg.num_hidden_layers, (base.budget_bytes - base.peak_allocated_bytes) // per)
    while layers > 0:  # all layers cached also drops the dequantize workspace: re-planned
        plan = plan_memory(**req, prefill_cache_layers=layers)
        if plan.fits:
            return plan
        layers -= 1
    return base


def with_prefill_cache_info(plan: MemoryPlan, cached: MemoryPlan) -> MemoryPlan:
    """`plan` (the run's requirement) with what `cached` (the same run planned with
    prefill_cache_layers=None) keeps for prefill shown beside it, not counted: the cache is
    elastic, made of the budget's room after the run, so it never makes a run not fit, and
    `hisparse plan` reports what the run needs (summarize plans the cache in, exactly)."""
    from dataclasses import replace

    layers = int(cached.settings.get("prefill_cache_layers") or 0)
    item = next((i for i in cached.items if i.name == "weights.prefill_cache"), None)
    if not layers or item is None:
        return plan
    info = LineItem(item.name + " (elastic)", item.bytes,
                    item.formula + f"; summarize keeps it: peak then {cached.peak_allocated_bytes:,} B",
                    counted=False)
    return replace(plan, items=plan.items + (info,),
                   settings={**plan.settings, "prefill_cache_layers": layers})


def host_ram_bytes() -> int | None:
    """This machine's physical RAM (None where the OS does not say)."""
    import os

    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


_REUSE_NOTE = (
    "between generate calls the engine keeps the paged KV storage and slots, the decode graph "
    "and its static inputs for the next call of the same shapes (Engine.release_cached_state() "
    "frees them): they stay resident after generate. This plan is one run as the first call "
    "makes it; a later call that reuses them takes the same storage (no new allocation) but holds "
    "the graph's output logits ({logits} B), static inputs ({inputs} B) and in-graph sampler "
    "state ({sampler} B; 0 where the host loop samples) from its start, so "
    "a prefill-time peak can be up to that much higher; the graph's private pool and the "
    "graph stream's cuBLAS workspace stay reserved as well")

_RESIDENT = {
    "input_ids": "prompt token ids [{P}] int64",
    "kv.paged_kv": ("paged K and V storage, allocated once at the run's start: {cap} blocks "
                    "(the working-set bound) x {bpb} B (2*L*bs*Hkv*D*kv bytes)"),
    "kv.importance_scores": "fp32 importance per cached token: {cap} blocks x L*bs*Hkv*4",
    "kv.global_slots": "{G} global tokens per layer/KV head: K, V + pos/mass/seen",
    "kv.candidate_slots": "{C} candidate tokens per layer/KV head: K, V + pos/mass/seen",
    "kv.global_and_page_cache_slots": ("{G} global tokens + the retrieval tier's page-cache "
                                       "slots per layer/KV head: K, V + pos/mass/seen"),
    "kv.page_summaries": ("retrieval tier: one key summary per page (mean: one, minmax: two "
                          "[L, Hkv, pages, D]; INT8 values + an fp32 scale a page)"),
    "kv.page_cache_state": ("retrieval tier: which page each page-cache slot holds and when it "
                            "was last picked [L, Hkv, slots], the page -> store row map, counters"),
    "logits": "fp32 logits [V] of the previous (and, after the forward, the current) step",
    "step_tensors": "slot mapping, block ids/starts, positions of the step",
    "cuda_graph": ("CUDA-graph decode's static inputs (position, slot, padded block list, "
                   "token; the embedded row when the table is in host memory)"),
    "sampler": ("the graph decode's sampler state: seen tokens, generated tokens (and the "
                "in-graph sampler's n-gram bans and pick scratch)"),
    "workspace.cublas_graph_stream": ("cuBLAS workspace of the stream decode graphs are "
                                      "captured on (one per process; calibrated constant)"),
}


def _run_items(run, s: StepShape, prompt: int) -> list[LineItem]:
    kv = run.kv
    fill = dict(P=prompt, cap=kv.capacity_blocks, bpb=kv.bytes_per_block, G=s.G, C=s.C)
    items, transient = [], {}
    for name, n in sorted(run.peak_live.items(), key=lambda x: -x[1]):
        if name in _RESIDENT:
            items.append(LineItem(name, n, _RESIDENT[name].format(**fill)))
        else:
            transient[name] = n
    if transient:
        total = sum(transient.values())
        top = ", ".join(f"{k} {v / (1 << 20):.1f} MiB" for k, v in
                        sorted(transient.items(), key=lambda x: -x[1])[:6])
        items.append(LineItem("activations.at_peak", total,
                              f"temporaries live at the peak ({run.peak_label}): {top}"))
    return items


def _info_items(run) -> list[LineItem]:
    kv = run.kv
    out = [
        LineItem("kv.working_set_bound", kv.working_set_bound_blocks * kv.bytes_per_block,
                 (f"SparseSequence.working_set_bound: {kv.working_set_bound_blocks} blocks = "
                  f"min(sinks {kv.sink_blocks} + window+chunk span {kv.span_blocks}, every "
                  "position); the paged storage is allocated at it"
                  if kv.window is not None else
                  f"dense: {kv.working_set_bound_blocks} blocks = every position; the paged "
                  "storage is allocated at it"), False),
        LineItem("kv.peak_live", kv.kv_bytes_peak,
                 f"{kv.peak_live_blocks} live blocks x {kv.bytes_per_block} B + K/V slots "
                 f"(RunStats.kv_bytes_peak)", False),
    ]
    names = {"prefill_forward": "activations.prefill_chunk", "decode_forward":
             "activations.decode_step", "evict": "kv.eviction_temporaries",
             "recalibrate": "kv.recalibration_temporaries"}
    for key, label in names.items():
        if key in run.phase_peaks:
            out.append(LineItem(label, run.phase_peaks[key],
                                "largest transient of this kind in the run", False))
    return out


def _notes(cfg: ModelConfig, sparse: SparseConfig, prompt: int, new: int, fmt: str,
           c_name: str, device_kind: str, backend: str) -> tuple[str, ...]:
    notes = []
    if prompt + new > cfg.max_position_embeddings:
        notes.append(f"{prompt + new} tokens exceed the model's {cfg.max_position_embeddings} "
                     "positions: summarize would switch to map-reduce; this plans one stream")
    if fmt in ("fp16", "bf16", "fp32") and _ALIASES[fmt] != c_name:
        notes.append(f"unquantized weights load in the compute dtype {c_name} (the loader "
                     f"casts), not {fmt}")
    if device_kind == "cuda" and backend == "torch":
        notes.append("torch attention reference on CUDA: SDPA's internal buffers are estimated "
                     "(mask padded to 16 keys), not traced")
    if device_kind == "cpu":
        notes.append("cpu: bytes are host RAM the run allocates through torch; the process's "
                     "RSS adds the Python runtime and libraries")
    return tuple(notes)
