"""The execution plan: how a run executes on its device, decided once, with the reason for
each choice.

`resolve_execution(...)` is the one function that chooses:

| choice | values | decided from |
|---|---|---|
| backend | the kernels of each family (`KernelBackend`) | device, triton, HISPARSE_BACKEND or the caller's preference (kernels/dispatch.py) |
| graph decode | on / off | CUDA + Triton attention, HISPARSE_CUDA_GRAPH |
| decode kernel | persistent / layers | HISPARSE_DECODE_KERNEL and what the persistent kernel serves (kernels/cuda/cuda_step.py: device, model, settings) |
| sampler | graph / device / host | graph decode, HISPARSE_GRAPH_SAMPLER, a host embedding table the device cannot read |
| INT4 layout | tiled / items / int4pack / awq / none | the weights, device, INT4 kernels and decode kernel (the loader's rule: model/awq.py) |
| INT4 prefill | w4a8 / w4a16 / none | the weights' group, the GPU and CUDA version (kernels/fp8/w4a8_linear.py), HISPARSE_PREFILL_FP8=1 (opt-in) |
| CPU decode | native / torch / none | CPU, float32 unquantized weights the C kernels take, a C compiler, HISPARSE_BACKEND (model/cpu_decode.py) |
| threads | a `ThreadPolicy` (CPU runs) | affinity, cgroup quota, --threads > HISPARSE_THREADS > OMP_NUM_THREADS > auto (config/threads.py) |

The `Engine` takes a plan (or resolves one from the model it loaded) and the memory planner
takes one (or resolves one from a model config, for a device that may not be this machine's);
`hisparse plan` prints it. The environment is read through config/env.py only. The sampler of
one generate may still differ from the plan's: sampling with temperature > 0 runs between graph
replays (`device`), whatever the plan says for greedy decoding.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from hisparse_cli.config.env import Environment, read_environment
from hisparse_cli.config.settings import SparseConfig
from hisparse_cli.config.threads import ThreadPolicy, resolve_thread_policy
from hisparse_cli.kernels.dispatch import KernelBackend, select_backend, triton_available

SAMPLERS = ("graph", "device", "host")
INT4_LAYOUTS = ("tiled", "items", "int4pack", "awq", "none")
INT4_PREFILLS = ("w4a8", "w4a16", "none")
CPU_DECODES = ("native", "torch", "none")


@dataclass(frozen=True)
class Choice:
    value: object
    reason: str


@dataclass(frozen=True)
class ExecutionPlan:
    """What `resolve_execution` chose (module doc). Frozen: a run never re-decides."""

    device: str  # "cpu" | "cuda"
    kernels: KernelBackend
    backend: Choice  # value: the attention kernels' name ("triton" | "torch")
    graph_decode: Choice  # value: bool
    decode_kernel: Choice  # value: "persistent" | "layers"
    graph_sampler: Choice  # value: bool, greedy graph decodes sample inside the graph
    int4_layout: Choice  # value: one of INT4_LAYOUTS
    decode_kernel_asked: str = "auto"  # HISPARSE_DECODE_KERNEL
    int4_prefill: Choice = Choice("none", "unquantized weights")  # one of INT4_PREFILLS
    cpu_decode: Choice = Choice("none", "not a CPU run")  # value: one of CPU_DECODES
    threads: Choice | None = None  # CPU runs: value a ThreadPolicy (config/threads.py)

    @property
    def sampler(self) -> Choice:
        """Who samples a greedy decode's tokens: "graph" (inside the captured decode graph),
        "device" (on the device between graph replays) or "host" (the eager loop)."""
        if not self.graph_decode.value:
            return Choice("host", "the eager decode loop samples (no CUDA-graph decode)")
        if self.graph_sampler.value:
            return Choice("graph", self.graph_sampler.reason)
        return Choice("device", self.graph_sampler.reason)

    @property
    def persistent(self) -> bool:
        return self.decode_kernel.value == "persistent"

    def rows(self) -> list[tuple[str, str, str]]:
        """(choice, value, reason) rows as `hisparse plan` prints them."""
        k = self.kernels
        kernels = (k.attention if k.attention == k.int4_linear == k.elementwise else
                   f"attention {k.attention}, int4 {k.int4_linear}, elementwise {k.elementwise}")
        return [("backend", kernels, self.backend.reason),
                ("graph decode", "on" if self.graph_decode.value else "off",
                 self.graph_decode.reason),
                ("decode kernel", str(self.decode_kernel.value), self.decode_kernel.reason),
                ("sampler", str(self.sampler.value), self.sampler.reason),
                ("INT4 layout", str(self.int4_layout.value), self.int4_layout.reason),
                *self._int4_prefill_rows(), *self._cpu_rows()]

    def _int4_prefill_rows(self) -> list[tuple[str, str, str]]:
        if self.int4_prefill.value == "none":
            return []
        return [("INT4 prefill", str(self.int4_prefill.value), self.int4_prefill.reason)]

    def _cpu_rows(self) -> list[tuple[str, str, str]]:
        if self.device != "cpu":
            return []
        rows = [("CPU decode", str(self.cpu_decode.value), self.cpu_decode.reason)]
        if self.threads is not None:
            rows.append(("threads", self.threads.value.describe(), self.threads.reason))
        return rows

    @property
    def thread_policy(self) -> ThreadPolicy | None:
        return None if self.threads is None else self.threads.value

    def to_dict(self) -> dict:
        d = {name: {"value": value, "reason": reason} for name, value, reason in
             ((r[0].replace(" ", "_").lower(), r[1], r[2]) for r in self.rows())}
        d["kernels"] = asdict(self.kernels)
        d["device"] = self.device
        d["decode_kernel_asked"] = self.decode_kernel_asked
        if self.threads is not None:
            d["threads"]["policy"] = self.threads.value.to_dict()
        return d


def _backend(device: str, prefer: str | None, env: Environment) -> tuple[KernelBackend, str]:
    kernels = select_backend(device, prefer or env.backend)
    if prefer:
        why = f"asked for {prefer}"
    elif env.backend != "auto":
        why = f"HISPARSE_BACKEND={env.backend}"
    elif device == "cuda":
        why = ("Triton kernels on CUDA" if kernels.attention == "triton"
               else "torch references: triton is not installed")
    else:
        why = ("torch references on the CPU" + (", INT4 through torch's packed int4 kernel"
                                                if kernels.int4_linear == "int4pack" else ""))
    return kernels, why


def _graph_decode(device: str, kernels: KernelBackend, env: Environment,
                  sparse: SparseConfig | None = None) -> Choice:
    """Engine CUDA-graph decode: CUDA with Triton attention, unless HISPARSE_CUDA_GRAPH=0
    (the retrieval tier's page choice and copies are device work inside the graph)."""
    if device != "cuda":
        return Choice(False, "CUDA-graph decode is off (not a CUDA device)")
    if kernels.attention != "triton":
        return Choice(False, "CUDA-graph decode is off (torch attention kernels)")
    if not env.cuda_graph:
        return Choice(False, "CUDA-graph decode is off (HISPARSE_CUDA_GRAPH=0)")
    return Choice(True, "CUDA with Triton attention: each decode step replays a captured graph")


def _graph_sampler(env: Environment, host_table_read_by_host: bool) -> Choice:
    if not env.graph_sampler:
        return Choice(False, "greedy tokens are picked between graph replays "
                             "(HISPARSE_GRAPH_SAMPLER=0)")
    if host_table_read_by_host:
        return Choice(False, "the host reads each token to copy its embedding row (the host "
                             "table is not registered for device access)")
    return Choice(True, "greedy decoding samples inside the decode graph (penalty, n-gram ban "
                        "and pick as three kernels)")


def _torch_dtype(name: str):
    import torch

    return getattr(torch, name) if name in ("float16", "bfloat16", "float32") else None


def _decode_kernel(asked: str, graph: Choice, device: str, *, awq: bool, model_cfg, group_size,
                   awq_config, compute_dtype: str, kv_dtype: str, sparse: SparseConfig,
                   loaded_model) -> Choice:
    """The persistent kernel where asked (auto or persistent) and it serves the run, else
    layer by layer. With the loaded model its own check decides (device included); from a
    config, "persistent" plans it wherever model and settings allow (the plan may be for
    another machine) and "auto" also needs this machine's GPU to run it."""
    if asked == "layers":
        return Choice("layers", "HISPARSE_DECODE_KERNEL=layers")
    if not graph.value:
        return Choice("layers", "CUDA-graph decode is off")
    from hisparse_cli.kernels.cuda import cuda_step

    if loaded_model is not None:
        import torch

        why = (cuda_step.model_unsupported(loaded_model, torch.device(device), convert=True)
               or cuda_step.settings_unsupported(sparse, _torch_dtype(kv_dtype)))
    else:
        why = ("the weights are not AWQ INT4" if not awq else
               cuda_step.config_unsupported(model_cfg, group_size, awq_config)
               or (None if compute_dtype == "float16" else "fp16 activations only")
               or cuda_step.settings_unsupported(sparse, _torch_dtype(kv_dtype)))
        if why is None and asked == "auto":
            why = cuda_step.device_unsupported()
    if why is not None:
        return Choice("layers", why)
    return Choice("persistent", "one persistent kernel a token (sm_90, AWQ INT4 model and "
                                "settings it serves)" + (", asked for" if asked == "persistent"
                                                         else ""))


def _int4_prefill(awq: bool, device: str, int4_kernels: str, group_size: int,
                  compute_dtype: str, env: Environment, planned: bool) -> Choice:
    """How prefill-sized INT4 products run on CUDA: W4A8 (e4m3 activations in 1x128 blocks,
    the exact INT4 codes, cuBLAS's block-scaled FP8 GEMM; kernels/fp8/w4a8_linear.py) where
    HISPARSE_PREFILL_FP8=1 asks for it, the group is 128 and this machine's GPU runs it, else
    W4A16 (dequantize to fp16, cuBLAS).
    planned: a plan for a device that need not be this machine's (said in the reason)."""
    if not awq:
        return Choice("none", "unquantized weights")
    if device != "cuda" or int4_kernels != "triton":
        return Choice("w4a16", "the INT4 kernels of this device dequantize to the activations' "
                               "dtype")
    if group_size != 128:
        return Choice("w4a16", f"group size {group_size}: the FP8 GEMM's weight blocks are "
                               "128 inputs")
    if compute_dtype not in ("float16", "bfloat16"):
        return Choice("w4a16", f"{compute_dtype} activations")
    if not env.prefill_fp8:  # opt-in: its activation rounding costs quality (QUALITY.md)
        return Choice("w4a16", "FP8 activations are opt-in (HISPARSE_PREFILL_FP8=1): on SmolLM2 "
                               "they cost KL 0.0098 nats/token against fp16 activations")
    import torch

    from hisparse_cli.kernels.fp8.w4a8_linear import device_support

    # this machine's GPU decides, planned or not (as the decode kernel's "auto" does): a plan
    # made without one keeps W4A16, whose workspace is the larger (fp16 W^T rows)
    why = device_support(torch.cuda.current_device() if torch.cuda.is_available() else 0)
    if why is not None:
        return Choice("w4a16", why + (" (this machine)" if planned else ""))
    return Choice("w4a8", "e4m3 activations in 1x128 blocks x the exact INT4 codes, cuBLAS's "
                          "block-scaled FP8 GEMM (sm_90, CUDA >= 12.9)")


def _int4_layout(awq: bool, device: str, int4_kernels: str, decode_kernel: Choice) -> Choice:
    """What AWQ INT4 weights are laid out as on `device` whose INT4 linears run `int4_kernels`
    (the loader's rule, linear by linear: model/awq.py's AWQLinear.repacks_on / packs_on)."""
    if not awq:
        return Choice("none", "unquantized weights")
    if device == "cuda" and int4_kernels == "triton":
        if decode_kernel.value == "persistent":
            return Choice("items", "the persistent decode kernel's items (128 x 128 tiles "
                                   "with their scales and zero points)")
        return Choice("tiled", "K-major words in the Triton GEMV's tile order, repacked at load")
    if device == "cpu" and int4_kernels == "int4pack":
        return Choice("int4pack", "the checkpoint's layout plus torch's packed int4 copy for "
                                  "decode-sized calls")
    return Choice("awq", "the checkpoint's layout (the torch reference)")


def _cpu_decode(device: str, prefer: str | None, env: Environment, *, awq: bool, model_cfg,
                compute_dtype: str, loaded_model) -> Choice:
    """One-token CPU steps through the native C kernels (model/cpu_decode.py) where the model
    and machine allow, else through torch. With the loaded model its own weights decide (and
    the library is built); from a config, its shapes and dtype and a compiler on this machine."""
    if device != "cpu":
        return Choice("none", "not a CPU run")
    if prefer == "torch" or env.backend == "torch":
        return Choice("torch", "asked for torch" if prefer == "torch" else "HISPARSE_BACKEND=torch")
    from hisparse_cli.model import cpu_decode

    if loaded_model is not None:
        why = cpu_decode.unsupported(loaded_model)
    else:
        why = ("AWQ INT4 weights decode through torch's packed int4 kernel" if awq
               else cpu_decode.config_unsupported(model_cfg, compute_dtype))
    if why is not None:
        return Choice("torch", why)
    return Choice("native", "one token a layer in three C calls over an exact tiled copy of "
                            "the weights (kernels/cpu/decode.c)")


def _threads(device: str, threads, env: Environment) -> Choice | None:
    """CPU runs: the thread policy (config/threads.py). threads: a ThreadPolicy, a count
    (--threads) or None (the environment's count, else auto)."""
    if device != "cpu":
        return None
    policy = (threads if isinstance(threads, ThreadPolicy) else
              resolve_thread_policy(None if threads is None else int(threads), env))
    if policy.override is not None:
        why = f"{policy.source} {policy.override}, in every phase"
    else:
        why = ("prefill and decode alike; the governor measures every 0.5 s of a phase "
               "(engine/thread_governor.py)")
    return Choice(policy, f"{why}; OpenMP wait: {policy.openmp_wait}")


def resolve_execution(*, device: str, model_cfg, sparse: SparseConfig, compute_dtype: str,
                      kv_dtype: str, weight_awq: bool, group_size: int = 128,
                      backend: str | None = None, kernels: KernelBackend | None = None,
                      env: Environment | None = None, loaded_model=None,
                      threads=None) -> ExecutionPlan:
    """The run's ExecutionPlan (module doc). backend: a preference ("torch" | "triton") over
    HISPARSE_BACKEND; kernels: the kernels of a planned device instead (the memory planner's
    target, which need not be this machine); env: the environment (default: read now);
    loaded_model: the engine's CausalLM, whose own layers, head and embedding table then decide
    the decode kernel and the sampler (a host table the device cannot read); threads: a CPU
    run's ThreadPolicy or thread count (--threads; default: from the environment)."""
    env = env or read_environment()
    planned = kernels is not None
    if kernels is not None:
        why = f"planned for {device} with the {kernels.attention} kernels"
        layout_kernels = kernels.int4_linear
    else:
        kernels, why = _backend(device, backend, env)
        # the loader lays INT4 weights out for the environment's kernels (AWQLinear)
        layout_kernels = select_backend(device, env.backend).int4_linear
    graph = _graph_decode(device, kernels, env, sparse)
    awq_config = None
    if weight_awq and loaded_model is None and model_cfg.quantization_config is not None:
        from hisparse_cli.model.awq import parse_quantization_config

        awq_config = parse_quantization_config(model_cfg.quantization_config)
    kernel = _decode_kernel(env.decode_kernel, graph, device, awq=weight_awq,
                            model_cfg=model_cfg, group_size=group_size, awq_config=awq_config,
                            compute_dtype=compute_dtype, kv_dtype=kv_dtype, sparse=sparse,
                            loaded_model=loaded_model)
    host_read = False
    if loaded_model is not None and device == "cuda":
        table = loaded_model.model.embed_tokens.weight
        if table.device.type == "cpu":
            from hisparse_cli.kernels.cuda.host_rows import is_mapped

            host_read = not (triton_available() and is_mapped(table))
    return ExecutionPlan(device=device, kernels=kernels, backend=Choice(kernels.attention, why),
                         graph_decode=graph, decode_kernel=kernel,
                         graph_sampler=_graph_sampler(env, host_read),
                         int4_layout=_int4_layout(weight_awq, device, layout_kernels, kernel),
                         decode_kernel_asked=env.decode_kernel,
                         int4_prefill=_int4_prefill(weight_awq, device, layout_kernels,
                                                    group_size, compute_dtype, env,
                                                    planned=planned),
                         cpu_decode=_cpu_decode(device, backend, env, awq=weight_awq,
                                                model_cfg=model_cfg, compute_dtype=compute_dtype,
                                                loaded_model=loaded_model),
                         threads=_threads(device, threads, env))


def with_graph_decode(plan: ExecutionPlan, on: bool, reason: str) -> ExecutionPlan:
    """The plan with graph decode forced on or off (tests that run the graph-decode loop on
    the CPU, uncaptured)."""
    return replace(plan, graph_decode=Choice(on, reason))


__all__ = ["Choice", "ExecutionPlan", "resolve_execution", "with_graph_decode", "SAMPLERS",
           "INT4_LAYOUTS", "INT4_PREFILLS", "CPU_DECODES"]
