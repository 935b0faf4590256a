"""`Engine`: the public API over model + paged sparse KV cache.

    eng = Engine.from_pretrained(path, device="cpu", dtype=torch.float32, sparse=SparseConfig(...))
    logits = eng.logits(token_ids)                 # [T, V], every position, chunk by chunk
    res = eng.generate(token_ids, max_new_tokens=64)
    res.token_ids, res.stats.kv_blocks_peak, res.stats.peak_memory_bytes

Each call runs one sequence and returns every KV block to the pool when it ends (also on error).
On the CUDA-graph decode path the engine keeps the run's KV storage and captured decode graph
for the next `generate` of the same shapes (engine/decode_state.py): it stays resident after
the call until `release_cached_state()`, another shape, `logits`/`new_run`, or an error.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch

from hisparse_cli.engine.block_pool import BlockPool
from hisparse_cli.config.execution import ExecutionPlan, resolve_execution
from hisparse_cli.config.settings import GenerationConfig, SparseConfig, check_positions
from hisparse_cli.engine.kv_cache import int64_to_device
from hisparse_cli.engine.runner import KVRun
from hisparse_cli.engine.sampling.host import Sampler
from hisparse_cli.kernels.compile_log import compile_counts
from hisparse_cli.model.config import ModelConfig
from hisparse_cli.model.llama import CausalLM, fuse_projections
from hisparse_cli.model.loader import load_model
from hisparse_cli.model.row_split import split_row_products
from hisparse_cli.config.threads import resolve_thread_policy
from hisparse_cli.engine.thread_governor import ThreadGovernor

Progress = Callable[[str, int, int], None]  # (phase "prefill"|"decode", done, total)


@dataclass
class RunStats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    kv_blocks_peak: int = 0
    kv_bytes_peak: int = 0
    blocks_allocated: int = 0
    blocks_freed: int = 0
    recalibrations: int = 0
    peak_memory_bytes: int = 0
    peak_memory_kind: str = ""  # "cuda_max_allocated" | "rss"
    device: str = "cpu"
    backend: str = "torch"
    decode_path: str = ""  # Engine.decode_path: "native (float16 weights)", "torch", ...
    threads: dict = field(default_factory=dict)  # CPU: {"prefill": [2], "decode": [2, 1]}
    # the retrieval tier (engine/retrieval.py; zeros when off): pages moved to the offload
    # store, their bytes there, (layer, KV head, page) picks per step, the page cache's hit
    # rate and the K/V bytes copied into it (host -> device on CUDA)
    pages_offloaded: int = 0
    offload_bytes: int = 0
    pages_retrieved_per_step: float = 0.0
    cache_hit_rate: float = 0.0
    bytes_to_cache: int = 0
    decode_cache_hit_rate: float = 0.0  # the same two over the decode steps alone
    decode_bytes_to_cache: int = 0
    # GPU kernels this call compiled / loaded from the disk cache, and the seconds they took
    # (kernels/compile_log.py; the first call of an engine also counts its model's load):
    # 0 on the CPU, and on a GPU once `hisparse warmup` has run the compiles are 0
    kernel_compiles: int = 0
    kernel_compile_seconds: float = 0.0
    kernel_loads: int = 0
    kernel_load_seconds: float = 0.0

    @property
    def prefill_tok_s(self) -> float:
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def decode_tok_s(self) -> float:
        return self.new_tokens / self.decode_seconds if self.decode_seconds else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["prefill_tok_s"], d["decode_tok_s"] = self.prefill_tok_s, self.decode_tok_s
        return d


@dataclass
class GenerationResult:
    token_ids: list[int]
    stats: RunStats
    finish_reason: str = "length"  # "eos" | "stop_string" | "length"
    text: str | None = None
    extra: dict = field(default_factory=dict)


def _peak_memory(device: torch.device) -> tuple[int, str]:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device)), "cuda_max_allocated"
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024, "rss"


def _has_int4(model) -> bool:
    """Whether the model holds AWQ INT4 linears (one built in code has no quantization_config:
    its plan must still say which INT4 layout it runs, e.g. to restore one after the items)."""
    return _int4_group(model) is not None


def _int4_group(model) -> int | None:
    """The group size of the model's AWQ INT4 linears (the smallest, where they differ;
    None: no INT4 linear)."""
    from hisparse_cli.model.awq import AWQLinear

    groups = {m.group_size for m in model.modules() if isinstance(m, AWQLinear)}
    return min(groups) if groups else None


class Engine:
    def __init__(self, model: CausalLM, cfg: ModelConfig, *, sparse: SparseConfig,
                 device: torch.device, kv_dtype: torch.dtype, path: Path | None = None,
                 pool_cap_blocks: int | None = None, backend: str | None = None,
                 probe=None, execution: ExecutionPlan | None = None, threads=None) -> None:
        """execution: how the run executes (config/execution.py); default: resolved here from
        the model, device, settings, `backend` preference, `threads` (a CPU run's ThreadPolicy
        or count; None: HISPARSE_THREADS / OMP_NUM_THREADS, else automatic) and the
        environment."""
        # q|k|v and gate|up as one matmul each (from_pretrained's loader already did it)
        self.model, self.cfg, self.sparse, self.device = fuse_projections(model), cfg, sparse, device
        self.governor = None  # CPU: the thread count of each phase (engine/thread_governor.py)
        self._threads = threads
        self.probe = probe  # token scorer for importance="probe": (layer, x [T, hs]) -> [T, Hkv]
        self.kv_dtype, self.path, self.pool_cap_blocks = kv_dtype, path, pool_cap_blocks
        self._backend_preference = backend
        self.execution = execution or self._resolve_execution()
        self._apply_execution()
        self._tokenizer = None
        self._decode_state = None  # DecodeState kept between generate calls (graph decode)
        self.step_trace = None  # callable(dict): one record per prefill chunk / decode step
        self.compile_mark = compile_counts()  # the next generate reports compiles since it
        self.prefill_cache_layers = 0  # keep_prefill_weights: decoder layers with W^T kept

    def _resolve_execution(self) -> ExecutionPlan:
        group = _int4_group(self.model)
        return resolve_execution(
            device=self.device.type, model_cfg=self.cfg, sparse=self.sparse,
            compute_dtype=str(self.model.compute_dtype).removeprefix("torch."),
            kv_dtype=str(self.kv_dtype).removeprefix("torch."),
            weight_awq=self.cfg.quantization_config is not None or group is not None,
            group_size=group or 128, backend=self._backend_preference,
            loaded_model=self.model, threads=self._threads)

    @property
    def decode_path(self) -> str:
        """How a decode step runs: "native (q4 weights)", "torch (why)", "cuda graph", ..."""
        if self.device.type == "cuda":
            return "cuda graph" if self._graph_enabled() else "cuda eager"
        native = self.model.native_decode
        if native is not None:
            return f"native ({native.weight_dtype} weights)"
        return f"torch ({self.execution.cpu_decode.reason})"

    def _apply_execution(self) -> None:
        """The plan's kernels for the model's norms/RoPE and the runs; on the CPU, the plan's
        thread policy (its governor) and decode path: the native kernels' copy of the weights
        (model/cpu_decode.py), or decode's one-row products split over the threads
        (model/row_split.py); where the persistent decode kernel runs, the INT4 linears in its
        item layout (only there: in the item layout a linear's one-token product is a
        dequantize + matmul, far slower than the layer-by-layer GEMV, so a model the kernel
        cannot take keeps its layout)."""
        self.backend = self.execution.kernels
        self.model.backend = self.backend  # its norms/RoPE follow the engine's backend
        self._apply_int4_prefill()
        if self.device.type == "cpu":
            self.governor = ThreadGovernor(self.execution.thread_policy
                                           or resolve_thread_policy(self._threads))
            if self.execution.cpu_decode.value == "native":
                from hisparse_cli.model.cpu_decode import NativeDecode

                NativeDecode.attach(self.model)
            else:
                self.model.native_decode = None
                split_row_products(self.model)
        if self.execution.persistent:
            from hisparse_cli.kernels.cuda.cuda_step import use_item_layout

            use_item_layout(self.model)
        else:  # linears an earlier plan put in the item layout (a shared model, replan()):
            # back to this plan's layout, else the checkpoint's (each decode product would
            # otherwise go through the items' dequantize)
            layout = self.execution.int4_layout.value
            layout = layout if layout in ("tiled", "kmajor", "awq") else "awq"
            for mod in self.model.modules():
                if getattr(mod, "layout", None) == "items" and hasattr(mod, "set_layout"):
                    mod.set_layout(layout)

    def _apply_int4_prefill(self) -> None:
        """The plan's INT4 prefill products for this process's INT4 linears (W4A8 or W4A16:
        kernels/fp8/w4a8_linear.py); set again by every generate (engines may share a
        process with different plans)."""
        if self.execution.int4_prefill.value != "none":
            from hisparse_cli.kernels.fp8 import w4a8_linear

            w4a8_linear.set_enabled(self.execution.int4_prefill.value == "w4a8")

    def keep_prefill_weights(self, layers: int) -> int:
        """The prefill weight cache (the memory plan's `weights.prefill_cache`, planner/
        weights.py): the INT4 linears of the first `layers` decoder layers keep W^T dequantized
        in the compute dtype, so a prefill chunk multiplies by it (one cuBLAS call) instead of
        dequantizing it again; every other layer drops its copy (first, so memory goes down
        before it goes up). Growing it first releases what the engine keeps between generate
        calls (a larger earlier run's KV storage and graph: the plan that sized the cache counts
        this run's, not both). Decode keeps the INT4 kernels. Returns the bytes held; 0 for a
        model without INT4 linears."""
        from hisparse_cli.model.awq import AWQLinear

        blocks = list(self.model.model.layers)
        layers = max(0, min(int(layers), len(blocks)))
        if layers > self.prefill_cache_layers:
            self.release_cached_state()
        mods = [[m for m in b.modules() if isinstance(m, AWQLinear)] for b in blocks]
        for group in mods[layers:]:
            for m in group:
                m.keep_prefill_weight(False)
        dtype = self.model.compute_dtype
        held = sum(m.keep_prefill_weight(True, dtype) for group in mods[:layers] for m in group)
        self.prefill_cache_layers = layers if held else 0
        return held

    def replan(self) -> ExecutionPlan:
        """Resolve the execution plan again from the environment as it is now (benchmarks and
        tests that change HISPARSE_* between runs of one engine); returns the new plan."""
        self.release_cached_state()
        self.execution = self._resolve_execution()
        self._apply_execution()
        return self.execution

    @property
    def decode_kernel_note(self) -> str | None:
        """Why the persistent decode kernel is not taken (None where it is, or where
        HISPARSE_DECODE_KERNEL=layers asked for the layer-by-layer decode)."""
        plan = self.execution
        if plan.persistent or plan.decode_kernel_asked == "layers":
            return None
        return plan.decode_kernel.reason

    @classmethod
    def from_pretrained(cls, path: str | Path, device: str | torch.device = "cpu",
                        dtype: torch.dtype = torch.float32, sparse: SparseConfig | None = None,
                        kv_dtype: torch.dtype | None = None, pool_cap_blocks: int | None = None,
                        embeddings_on_host: bool = False, backend: str | None = None,
                        probe=None, threads=None, lm_head_format: str = "checkpoint") -> "Engine":
        """lm_head_format: "int8" quantizes an fp output head at load (model/int8_linear.py).
        threads: a CPU run's ThreadPolicy, a thread count (an override, as --threads), or
        None (HISPARSE_THREADS / OMP_NUM_THREADS, else automatic; config/threads.py)."""
        device = torch.device(device)
        mark = compile_counts()  # the first generate reports the load's compiles too
        model, cfg = load_model(path, device, dtype, embeddings_on_host=embeddings_on_host,
                                decode_layout=True, fuse=True,
                                lm_head_int8=lm_head_format == "int8")
        if kv_dtype is None:
            kv_dtype = torch.float16 if device.type == "cuda" and dtype == torch.float16 else dtype
        engine = cls(model, cfg, sparse=sparse or SparseConfig(), device=device,
                     kv_dtype=kv_dtype, path=Path(path), pool_cap_blocks=pool_cap_blocks,
                     backend=backend, probe=probe, threads=threads)
        engine.compile_mark = mark
        return engine

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(str(self.path), local_files_only=True)
        return self._tokenizer

    # -- runs --------------------------------------------------------------------------------
    def new_run(self, total_tokens: int, chunk: int | None = None, *,
                reuse: bool = False) -> tuple[KVRun, BlockPool]:
        """A run of at most `total_tokens` positions in steps of at most `chunk` tokens (default:
        the prefill chunk); its KV storage is allocated now, once, at their working-set bound
        (ResourceError first when the pool cap is below it). reuse=True: take the kept
        storage when its shape matches (reset to a new cache's contents) and keep this run's
        for the next call; otherwise any kept state is freed first (never two storages).
        Sparse sizes larger than the model's positions are a ConfigError (check_positions)."""
        check_positions(self.cfg.max_position_embeddings, sparse=self.sparse)
        if not reuse:
            self.release_cached_state()
        pool = BlockPool(self.pool_cap_blocks)
        run = KVRun(self.cfg, self.sparse, self.device, self.kv_dtype, self.backend, pool,
                    token_scorer=self.probe, total_tokens=total_tokens, chunk=chunk,
                    cache_source=self._kept_cache if reuse else None,
                    tier_source=self._kept_tier if reuse else None)
        run.trace = self.step_trace
        if reuse and (self._decode_state is None or self._decode_state.cache is not run.cache):
            from hisparse_cli.engine.decode_state import DecodeState

            self._decode_state = DecodeState(run.cache)
        if reuse:
            self._decode_state.tier = run.retrieval
        return run, pool

    def _kept_cache(self, spec: dict):
        state = self._decode_state
        cache = state.take_cache(spec) if state is not None else None
        if cache is None:
            self.release_cached_state()  # before the new storage is allocated
        return cache

    def _kept_tier(self, args: dict):
        state = self._decode_state
        return state.take_tier(args) if state is not None else None

    def release_cached_state(self) -> None:
        """Free the KV storage, decode graph and static buffers kept from the last CUDA-graph
        `generate` (a no-op when nothing is kept). Call it when done with the engine."""
        state, self._decode_state = self._decode_state, None
        if state is not None:
            state.release()

    def _ids(self, token_ids) -> torch.Tensor:
        ids = torch.as_tensor(list(token_ids) if not torch.is_tensor(token_ids) else token_ids,
                              dtype=torch.int64).to(self.device).reshape(-1)
        if ids.numel() == 0:
            raise ValueError("token_ids is empty")
        return ids

    @torch.inference_mode()
    def logits(self, token_ids, chunk: int | None = None) -> torch.Tensor:
        """Logits [T, V] (fp32) for every position, through the same paged/sparse path."""
        ids = self._ids(token_ids)
        chunk = chunk or self.sparse.prefill_chunk
        run, _ = self.new_run(ids.numel(), chunk)  # frees any kept decode state first
        self._phase("prefill")
        out = []
        with run:
            for s in range(0, ids.numel(), chunk):
                out.append(run.step(self.model, ids[s:s + chunk], all_logits=True))
                self._tick()
        return torch.cat(out, dim=0)

    def _phase(self, name: str) -> None:
        if self.governor is not None:
            self.governor.begin(name)

    def _tick(self) -> None:
        if self.governor is not None:
            self.governor.tick()

    @torch.inference_mode()
    def generate(self, token_ids, max_new_tokens: int | None = None, *,
                 gen: GenerationConfig | None = None, progress: Progress | None = None,
                 **overrides) -> GenerationResult:
        gen = gen or GenerationConfig()
        if max_new_tokens is not None:
            overrides["max_new_tokens"] = max_new_tokens
        if overrides:
            gen = GenerationConfig(**{**asdict(gen), **overrides})
        ids = self._ids(token_ids)
        eos = set(gen.eos_token_ids if gen.eos_token_ids is not None else self.cfg.eos_token_ids)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        stats = RunStats(prompt_tokens=ids.numel(), device=str(self.device),
                         backend=self.backend.attention, decode_path=self.decode_path)
        if self.governor is not None:
            self.governor.used = {}
        graph = self._use_graph(gen)
        self._apply_int4_prefill()
        run, pool = self.new_run(ids.numel() + gen.max_new_tokens, reuse=graph)
        chunk = self.sparse.prefill_chunk
        try:
            with run:
                out, reason, extra = self._prefill_and_decode(run, ids, gen, eos, chunk, graph,
                                                              stats, progress)
        except BaseException:
            self.release_cached_state()  # a failed run's state is not kept
            raise
        stats.new_tokens = len(out)
        if progress:  # the final count, as the stats say (the loops report an EOS, or lag)
            progress("decode", len(out), gen.max_new_tokens)
        stats.kv_blocks_peak, stats.blocks_allocated, stats.blocks_freed = (
            pool.peak_resident, pool.allocated, pool.freed)  # (offloaded pages not counted)
        stats.kv_bytes_peak = run.kv_bytes_peak
        stats.recalibrations = run.seq.recalibrations
        if run.retrieval is not None:
            r = run.retrieval.stats
            stats.pages_offloaded, stats.offload_bytes = r.pages_offloaded, run.offload_bytes
            stats.pages_retrieved_per_step = r.pages_retrieved / r.steps if r.steps else 0.0
            stats.cache_hit_rate, stats.bytes_to_cache = r.hit_rate, r.bytes_to_cache
            d = run.retrieval.decode_stats()
            stats.decode_cache_hit_rate, stats.decode_bytes_to_cache = d.hit_rate, d.bytes_to_cache
        stats.peak_memory_bytes, stats.peak_memory_kind = _peak_memory(self.device)
        if self.governor is not None:
            stats.threads = self.governor.report()
        now = compile_counts()
        for key, value in (now - self.compile_mark).to_dict().items():
            setattr(stats, key, value)
        self.compile_mark = now
        return GenerationResult(token_ids=out, stats=stats, finish_reason=reason,
                                extra=extra)

    def _prefill_and_decode(self, run, ids, gen, eos, chunk, graph, stats, progress):
        t0 = time.perf_counter()
        logits = None
        self._phase("prefill")
        for s in range(0, ids.numel(), chunk):
            logits = run.step(self.model, ids[s:s + chunk])
            self._tick()
            if progress:
                progress("prefill", min(s + chunk, ids.numel()), ids.numel())
        self._sync()
        stats.prefill_seconds = time.perf_counter() - t0
        if run.retrieval is not None:  # the counters where decode starts (a device copy)
            run.retrieval.mark_decode()
        t0 = time.perf_counter()
        self._phase("decode")
        extra = {}
        if graph:
            out, reason, reused = self._decode_graph(run, logits, gen, eos, ids.numel(), progress)
            extra["cuda_graph"] = "reused" if reused else "new"
            dec = self._decode_state.decoder if self._decode_state is not None else None
            if dec is not None:
                extra["decode_kernel"] = "persistent" if dec.cuda_step is not None else "layers"
                note = self.decode_kernel_note or dec.cuda_step_reason
                if note and self.execution.decode_kernel_asked == "persistent":
                    extra["decode_kernel_note"] = note
        else:
            out, reason = self._decode_eager(run, logits, gen, eos, Sampler(gen, self.device),
                                             progress)
        self._sync()
        stats.decode_seconds = time.perf_counter() - t0
        return out, reason, extra

    def _use_graph(self, gen: GenerationConfig) -> bool:
        """Whether this generation decodes in a CUDA graph (tests force it per generation)."""
        return self._graph_enabled()

    def _graph_enabled(self) -> bool:
        """CUDA-graph decode, as the execution plan says: CUDA + Triton attention (with a
        host-resident embedding table too: the graph then starts after the lookup), unless
        HISPARSE_CUDA_GRAPH=0."""
        # (the retrieval tier decodes in the graph too: its page cache is device-resident)
        return bool(self.execution.graph_decode.value)

    def _stopped(self, out: list[int], gen: GenerationConfig) -> bool:
        if not gen.stop_strings:
            return False
        tail = self.tokenizer.decode(out[-16:], skip_special_tokens=True)
        return any(stop in tail for stop in gen.stop_strings)

    def _decode_eager(self, run, logits, gen, eos, sampler, progress):
        out: list[int] = []
        for i in range(gen.max_new_tokens):
            suppress = tuple(eos) if i < gen.min_new_tokens else ()
            tok = sampler(logits[-1], suppress)
            out.append(tok)
            if progress:
                progress("decode", i + 1, gen.max_new_tokens)
            if tok in eos:
                out.pop()
                return out, "eos"
            if self._stopped(out, gen):
                return out, "stop_string"
            if i + 1 < gen.max_new_tokens:
                logits = run.step(self.model, torch.tensor([tok], device=self.device))
                self._tick()
        return out, "length"

    def _decode_graph(self, run, logits, gen, eos, prompt_len, progress, sync_every: int = 16):
        from hisparse_cli.engine.sampling.device import DeviceSampler

        # the kept decoder when its capture fits this run (its graph replays from the first
        # step), else a new one that warms up and captures on its first step
        decoder, reused = self._decode_state.decoder_for(self.model, run,
                                                         prompt_len + gen.max_new_tokens,
                                                         persistent=self.execution.persistent)
        # greedy decodes sample inside the step (and its graph), kernels/graph_sampler.py,
        # where the plan says so (not with HISPARSE_GRAPH_SAMPLER=0); a graph captured the
        # other way is dropped
        had_graph = decoder.graph is not None
        fused = self.execution.graph_sampler.value and decoder.sample_in_graph(gen, eos)
        if not fused:
            decoder.use_host_sampler()
        if had_graph and decoder.graph is None:
            reused = False
        if fused:
            decoder.sample_first(logits)  # token 0; the steps sample the rest
            toks = decoder.sampler.toks
        else:
            sampler = DeviceSampler(gen, logits.shape[-1], self.device)
            eos_t = int64_to_device(sorted(eos), self.device) if eos else None
            toks = torch.empty(gen.max_new_tokens, dtype=torch.int64, device=self.device)
        # read-backs go through page-locked memory and an event, so the next step is queued
        # before the host waits: the GPU never drains at a read-back (run 134: a 0.3-1.3 ms
        # idle gap every 16 tokens). The price: the step after the block's last token runs even
        # when that block held the EOS (one wasted step a generate, its output discarded).
        cuda = self.device.type == "cuda"  # (the CPU runs this loop in tests, uncaptured)
        pinned = torch.empty(gen.max_new_tokens, dtype=torch.int64, pin_memory=cuda)
        ready = torch.cuda.Event() if cuda else None
        out: list[int] = []
        for i in range(gen.max_new_tokens):
            if not fused:
                tok = sampler(logits, eos_t if i < gen.min_new_tokens else None)
                toks[i:i + 1].copy_(tok)
            due = (i + 1) % sync_every == 0 or i + 1 == gen.max_new_tokens
            if due:
                pinned[len(out):i + 1].copy_(toks[len(out):i + 1], non_blocking=cuda)
                if ready is not None:
                    ready.record()
            if i + 1 < gen.max_new_tokens:
                logits = decoder.step(None if fused else tok)
            if due:  # the only host wait: once per sync_every, on the copy (not the step)
                if ready is not None:
                    ready.synchronize()
                for t in pinned[len(out):i + 1].tolist():  # token by token, as the eager
                    if t in eos:                             # loop stops
                        return out, "eos", reused
                    out.append(t)
                    if gen.stop_strings and self._stopped(out, gen):
                        return out, "stop_string", reused
                if progress:
                    progress("decode", len(out), gen.max_new_tokens)
        return out, "length", reused

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
