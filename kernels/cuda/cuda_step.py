"""The persistent decode step (kernels/cuda/decode_step.cu) for the engine's CUDA-graph decoder:
when it applies, how its launch is laid out, and the launch itself.

`CudaDecodeStep(model, run, dev, tok)` replaces the model's forward of one decode token in
`GraphDecoder` (engine/cuda_graph.py): the same inputs (the decoder's static `dev` buffer:
position, slot, padded block ids and starts; the token), the same effects on the run's state
(the current K/V in the paged cache, the importance mass in score / global mass / global seen)
and the same output (logits [1, V] fp32 for the sampler). Everything is one memset of the
step's workspace plus one kernel launch (plus the fp16 or INT8 head's product when the head is not
INT4), all on the current stream, so the graph captures it like the Triton step.

`unsupported(model, run)` says why a model/run cannot take it (None when it can): sm_90 with
NVRTC, Llama-family layers whose linears are AWQ INT4 held as items (kernels/int4/awq_items.py,
group size 128), no biases or q/k norms, head dim 128, at most 8 query heads a KV head, fp16
activations and KV cache, 16-token pages, global slots in whole pages, and the attention,
SnapKV or uniform importance (the learned probe reads hidden states the kernel does not make).
"""

from __future__ import annotations

import ctypes
import math
import re
from functools import lru_cache
from pathlib import Path

import torch

from hisparse_cli.kernels.norm_rope.norm_rope_ref import rope_tables

SOURCE = Path(__file__).with_name("decode_step.cu")
_INCLUDE = re.compile(r'^#include "([\w.]+)"$', re.M)


def source() -> str:
    """decode_step.cu with its local includes (ring.cuh) inlined: NVRTC gets one string."""
    return _INCLUDE.sub(lambda m: (SOURCE.parent / m.group(1)).read_text(), SOURCE.read_text())
HD, NW, GROUPS, PAGE = 128, 16, 4, 16
MERGE_GROUPS = 8  # attention groups decode_step.cu's merge space holds
ITEM_BYTES, ITEM_WORDS, SLOT = 8512, 2128, 9216
MAX_K, MAX_S, MAX_HQ, MAX_UNIT_PAGES, MASS_PAGES = 14336, 32, 64, 1024, 32
MAX_HIDDEN = 8192  # the RMSNorm's x loads stay in registers (NORM_PAIRS)
META = 12
K_GEMV, K_ATTN, K_FINAL_NORM, K_MLP2 = 0, 1, 2, 4  # decode_step.cu's phase kinds
X_NORM, X_ATT, X_NORM_EMB = 0, 2, 3  # and a GEMV's x transforms
F_MASS, F_TIMELINE = 2, 4
STAGES = 16  # ring slots allocated at most (a multiple of 4; ring_plan picks how many run)
SPLIT = 4  # warps a GEMV item (decode_step.cu's SPLIT): nw / SPLIT consumer groups


class StepParams(ctypes.Structure):
    """decode_step.cu's `StepParams`, field for field (passed by value)."""

    _fields_ = [(name, ctypes.c_void_p) for name in (
        "meta", "dev", "tok", "embed", "h", "part", "counter", "inv_freq", "kcache", "vcache",
        "gpos", "score", "gmass", "gseen", "stamps")] + [("capacity", ctypes.c_longlong)] + [
        (name, ctypes.c_int) for name in (
            "n_phase", "stages", "red_tiles", "flags", "nb", "bs", "hkv", "hq", "hidden", "G",
            "S", "sinks", "window", "min_distance")] + [
        (name, ctypes.c_float) for name in ("scale", "eps", "rope_scaling")]


def smem_bytes(stages: int, red_tiles: int, gqa: int, mass: bool) -> int:
    """Dynamic shared memory of a launch (decode_step.cu's carve-up, 1024 for the alignment)."""
    att_stride = gqa * (HD + 2)
    floats = (red_tiles * 128 + MAX_K // 128 + MAX_HQ * MAX_S + gqa * HD + MERGE_GROUPS * att_stride
              + NW + 3 * HD + 8 + 16 + MAX_S * 16 + 512 + MAX_UNIT_PAGES
              + (MASS_PAGES * gqa * PAGE if mass else 0))
    return 1024 + stages * SLOT + (MAX_K // 2) * 4 + 4 * floats + 2 * stages * 8


ATT_WARPS_2_PAGES = 13  # unit pages from which the attention runs 2 warps a page (8 groups)


def att_warps(unit_pages: int) -> int:
    """Warps an attention page in the default build (decode_step.cu's ATT_WARPS): 2 (8 groups,
    64 dims of P.V a warp) where a unit has more than 3 pages a group of 4 warps, else 4. Runs
    145-146 (Llama-3-8B shape, 132 SMs): at 19 pages a unit (h200-141g settings) 2 warps took
    0.039-0.045 ms off a ~1.97 ms step; at 9 (4060ti-6g) they cost 0.005-0.016 ms (merging 8
    groups' states outweighs the shorter page chains). The threshold lies between those two
    measured points; it was not measured in between. ring_plan takes 4 where 2 would leave
    the ring fewer slots (GQA 8)."""
    return 2 if unit_pages >= ATT_WARPS_2_PAGES else 4


def ring_units(nw: int, att_warps_: int) -> int:
    """What the ring's slot count must be a multiple of: every count of consumer units that
    take every units-th ring entry in a phase (the GEMV groups, nw / SPLIT; the attention
    groups, nw / att_warps_). A slot's previous entry in the same phase is then the same
    group's, whose warps waited for it themselves. The full barriers' parity waits are sound
    only so: a bulk copy issued earlier may land after a later one, and a group that waits on
    a slot whose previous fill is still in flight takes that fill's completion for its own
    entry's (stale data, then its arrivals count toward the wrong phase). Run 153: 16 slots
    with 3 GEMV groups (NW=12), and 14 with 4, failed to launch ("unspecified launch
    failure") in the INT4 head's 243 items a CTA at the 8B shape; 12 and 15 with 3 groups, and
    16 with 2, passed the check."""
    return math.lcm(nw // SPLIT, nw // att_warps_)


def ring_plan(allocated: int, nw: int, unit_pages: int,
              att_warps_: int | None = None) -> tuple[int, int]:
    """(warps an attention page, ring slots) a launch runs with, given the slots its shared
    memory holds (ring_stages) and nw consumer warps (decode_step.cu's NW). att_warps_: the
    build asked for (the checks run the 2-warp build on small models too); by default
    att_warps(unit_pages), but 4 where the 2-warp build (twice the attention groups) would run
    fewer slots (GQA 8 holds 12: 8 groups could use only 8 of them). The slots are the most
    that are a multiple of ring_units. ValueError where none is sound (fewer than 8)."""
    def most(aw: int) -> int:
        units = ring_units(nw, aw)
        return allocated - allocated % units

    if att_warps_ is None:
        att_warps_ = att_warps(unit_pages)
        if att_warps_ == 2 and most(2) < most(4):
            att_warps_ = 4
    units = ring_units(nw, att_warps_)
    stages = most(att_warps_)
    if not 8 <= stages <= allocated:
        raise ValueError(f"{stages} ring slots with {nw} consumer warps and {att_warps_} warps "
                         f"an attention page: a multiple of {units}, 8 to {allocated}")
    return att_warps_, stages


def buffer_bytes(cfg, int4_head: bool, ctas: int) -> tuple[int, ...]:
    """The device buffers one CudaDecodeStep allocates (bytes requested): the step's zeroed
    workspace (barrier, each layer's q|k|v sums, the INT4 head's logits),
    the residual stream, the attention partials, the phase table, each layer's gate|up sums
    and tile flags, and the fp16 head's normed input. The memory planner sums them (with its
    allocator's rounding) where the decode takes the kernel."""
    L, hq, hkv = cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads
    hidden, inter = cfg.hidden_size, cfg.intermediate_size
    S = min(MAX_S, ctas // hkv)
    ws = 4 + L * (hq + 2 * hkv) * HD + (cfg.vocab_size if int4_head else 0)
    parts = [4 * ws, 4 * hidden, 4 * hkv * S * (hq // hkv) * (HD + 2),
             8 * META * (4 * L + 1), 4 * L * (2 * inter + 2 * (inter // 128))]
    if not int4_head:
        parts.append(2 * hidden)
    return tuple(parts)


def ring_stages(red_tiles: int, gqa: int, mass: bool, limit: int) -> int | None:
    """Most ring slots (STAGES at most, a multiple of the 4 consumer groups, at least 8) whose
    launch fits `limit` bytes of shared memory a block; None when 8 do not."""
    stages = STAGES
    while stages >= 8 and smem_bytes(stages, red_tiles, gqa, mass) > limit:
        stages -= GROUPS
    return stages if stages >= 8 else None


def red_tiles_needed(phases: list[tuple[int, int]], ctas: int) -> int:
    """Most 128-column tiles one CTA touches in one GEMV (G groups x T tiles each)."""
    most = 1
    for g, t in phases:
        n = g * t
        for c in range(ctas):
            a, b = n * c // ctas, n * (c + 1) // ctas
            if b > a:
                most = max(most, (b - 1) // g - a // g + 1)
    return most


def _items_of(lin) -> torch.Tensor | None:
    """An AWQ INT4 linear's items (held as its qweight in the item layout), else None."""
    return lin.qweight if getattr(lin, "layout", None) == "items" else None


def _int4_linear(mod) -> bool:
    """An AWQ INT4 linear (model/awq.py's AWQLinear, told by what it holds: a layout, a group
    size and set_layout; this kernel module imports nothing of the model)."""
    return hasattr(mod, "set_layout") and hasattr(mod, "group_size") and hasattr(mod, "layout")


def _readable(lin, convert: bool) -> bool:
    """Whether the kernel reads this linear: INT4 items, or (convert) an AWQ linear that
    set_layout("items") would turn into them."""
    if _items_of(lin) is not None:
        return True
    return (convert and _int4_linear(lin) and lin.group_size == 128
            and lin.in_features % 128 == 0 and lin.out_features % 128 == 0)


def config_unsupported(cfg, group_size: int = 128, awq=None) -> str | None:
    """Why the kernel cannot run a model of this config (None: it can), from what the config
    says: the shapes the kernel is built for, Llama-family layers without biases or q/k norms,
    SiLU, AWQ INT4 of group size 128 for every layer's linears (awq: the checkpoint's
    AWQConfig, whose modules_to_not_convert must leave every layer linear INT4; the lm_head may
    stay fp16). The memory planner asks this (planner/memory.py); model_unsupported asks it too."""
    if cfg.head_dim != HD:
        return f"head dim {cfg.head_dim} (the kernel is built for {HD})"
    hq, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    if hq % hkv or hq // hkv > 8 or hq > MAX_HQ:
        return f"{hq} query heads over {hkv} KV heads (at most 8 a KV head, {MAX_HQ} in all)"
    if (cfg.hidden_size % 128 or cfg.intermediate_size % 128 or cfg.hidden_size > MAX_HIDDEN
            or cfg.intermediate_size > MAX_K):
        return (f"hidden {cfg.hidden_size} / intermediate {cfg.intermediate_size} (multiples of "
                f"128 up to {MAX_HIDDEN} / {MAX_K})")
    if cfg.qk_norm:
        return "q/k norms"
    if cfg.attention_bias or cfg.o_bias or cfg.mlp_bias:
        return "linears with a bias"
    if cfg.hidden_act != "silu":
        return f"the MLP activation {cfg.hidden_act!r} (the kernel's is silu)"
    if group_size != 128:
        return f"AWQ group size {group_size} (the kernel reads 128)"
    if awq is not None:
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                     "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"):
            for i in range(cfg.num_hidden_layers):
                if awq.keeps_fp(f"model.layers.{i}.{name}"):
                    return f"layer {i} {name.split('.')[1]} is kept fp16 (modules_to_not_convert)"
    return None


def model_unsupported(model, device: torch.device, convert: bool = False) -> str | None:
    """Why the kernel cannot run this model on `device` (None: it can), whatever the run's
    settings; convert: AWQ linears still to be put in the item layout count as readable (the
    Engine asks before converting, so that a model the kernel cannot run keeps its layout)."""
    why = device_unsupported(device) or config_unsupported(model.cfg)
    if why is not None:
        return why
    if model.compute_dtype != torch.float16:
        return "fp16 activations only"
    for i, layer in enumerate(model.model.layers):
        att, mlp = layer.self_attn, layer.mlp
        if att.q_norm is not None:
            return "q/k norms"
        for name, lin in (("qkv_proj", att.qkv_proj), ("o_proj", att.o_proj),
                          ("gate_up_proj", mlp.gate_up_proj), ("down_proj", mlp.down_proj)):
            if lin is None or not _readable(lin, convert):
                return (f"layer {i} {name} is not an AWQ INT4 linear of group size 128 "
                        f"(in the item layout)")
            if lin.bias is not None:
                return f"layer {i} {name} has a bias"
    head = model.lm_head
    int8_head = getattr(head, "weight_q", None) is not None and head.weight_q.dtype == torch.int8
    if not _readable(head, convert) and not ((isinstance(head, torch.nn.Linear) or int8_head)
                                             and head.bias is None):
        return ("the lm_head is neither INT4 (group size 128) nor an fp16 or INT8 linear "
                "without bias")
    table = model.model.embed_tokens.weight
    if table.device.type == "cpu":
        from hisparse_cli.kernels.cuda.host_rows import is_mapped

        if not is_mapped(table):
            return "the host embedding table is not registered for device access"
    return None


def settings_unsupported(sparse, kv_dtype: torch.dtype) -> str | None:
    """Why the kernel cannot serve runs with these sparse settings (None: it can)."""
    if kv_dtype != torch.float16:
        return "an fp16 KV cache only"
    if sparse.block_size % PAGE:
        return f"block size {sparse.block_size} (a multiple of {PAGE})"
    globals_on = sparse.window_size is not None and sparse.global_tokens > 0
    if globals_on and sparse.global_tokens % PAGE:
        return f"{sparse.global_tokens} global tokens (a multiple of {PAGE})"
    if globals_on and sparse.importance == "probe":
        return "the learned importance probe"
    return None


def device_unsupported(device: torch.device | None = None) -> str | None:
    """Why the kernel cannot run on `device` (default: the current CUDA device; None: it
    can): a CUDA device of sm_90 or later, and NVRTC to build the kernel."""
    from hisparse_cli.kernels.cuda import cuda_rt

    if device is None:
        if not torch.cuda.is_available():
            return "no CUDA device"
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type != "cuda":
        return "not a CUDA device"
    if torch.cuda.get_device_capability(device) < (9, 0):
        return "needs sm_90 (Hopper): the kernel streams with TMA and bulk copies"
    if not cuda_rt.nvrtc_available():
        return cuda_rt.nvrtc_unavailable_reason()
    return None


def unsupported(model, run) -> str | None:
    """Why this model and run cannot use the persistent step (None: they can)."""
    why = model_unsupported(model, run.device)
    if why is not None:
        return why
    if run.cache.dtype != torch.float16:
        return "an fp16 KV cache only"
    if run.sparse.block_size % PAGE:
        return f"block size {run.sparse.block_size} (a multiple of {PAGE})"
    if run.cache.G % PAGE:
        return f"{run.cache.G} global tokens (a multiple of {PAGE})"
    if run.token_scorer is not None:
        return "the learned importance probe"
    return None


def use_item_layout(model) -> int:
    """Every AWQ INT4 linear of the model that the kernel can read (group size 128, sizes in
    whole 128s) into the item layout, one linear at a time; the count converted. Prefill then
    runs them through a dequantize + matmul of item chunks (AWQLinear.forward)."""
    n = 0
    for mod in model.modules():
        if _int4_linear(mod) and mod.layout != "items" and mod.set_layout("items"):
            n += 1
    return n


def norm_pairs(hidden: int, nw: int = NW) -> int:
    """decode_step.cu's NORM_PAIRS: the x pairs each of the nw * 32 consumer threads holds in
    the RMSNorm (hidden / 2 pairs in all)."""
    return -(-(hidden // 2) // (nw * 32))


@lru_cache(maxsize=None)
def build_kernel(gqa: int, norm_pairs: int, device_index: int, extra: tuple[str, ...] = ()):
    """The kernel built for this GQA and hidden size (x pairs a thread in the RMSNorm): its
    decode_step<false> / <true> (without / with the importance mass) functions. extra: more
    compiler options ("-DATT_WARPS=2"; "-DTIMELINE=1", the profiling stamps benchmarks read)."""
    from hisparse_cli.kernels.cuda import cuda_launch
    from hisparse_cli.kernels.cuda import cuda_rt

    arch = torch.cuda.get_device_capability(device_index)
    names = ["decode_step<false>", "decode_step<true>"]
    compiled = cuda_rt.compile_cubin(source(), arch=arch, name_expressions=names,
                                     options=[f"-DGQA={gqa}", f"-DNORM_PAIRS={norm_pairs}",
                                              *extra])
    module = cuda_launch.load_module(compiled, device_index)
    return {False: module.function(names[0]), True: module.function(names[1])}


class CudaDecodeStep:
    """One run's persistent decode step (module doc). dev: the decoder's [2 + 2 nb] int64
    inputs; tok: [1] int64 token."""

    def __init__(self, model, run, dev: torch.Tensor, tok: torch.Tensor, nb: int,
                 att_warps: int | None = None) -> None:
        """att_warps: the attention build to run (2 or 4 warps a page; default: ring_plan's
        choice for the unit's pages; the checks run the 2-warp build on small models too)."""
        from hisparse_cli.kernels.cuda import cuda_launch

        why = unsupported(model, run)
        assert why is None, why
        cfg, cache, device = model.cfg, run.cache, run.device
        self.model, self.run, self.dev, self.tok, self.nb = model, run, dev, tok, nb
        hq, hkv, hidden, inter = (cfg.num_attention_heads, cfg.num_key_value_heads,
                                  cfg.hidden_size, cfg.intermediate_size)
        self.gqa = hq // hkv
        props = torch.cuda.get_device_properties(device)
        self.ctas = props.multi_processor_count
        self.S = min(MAX_S, self.ctas // hkv)
        # the key segment beside the paged blocks: the globals, then (retrieval tier) the
        # page-cache slots, which the step reads as more global slots (positions -1: masked)
        self.seg = seg = cache.G + cache.P
        n_pages = nb * run.sparse.block_size // PAGE + seg // PAGE
        unit_pages = self.unit_pages = -(-n_pages // self.S)
        if unit_pages > MAX_UNIT_PAGES:
            raise ValueError(f"{unit_pages} pages a split (the kernel takes {MAX_UNIT_PAGES})")
        self.mass = run.track_scores
        if self.mass and unit_pages > MASS_PAGES:
            raise ValueError(f"{unit_pages} pages a split with the importance mass "
                             f"(the kernel keeps {MASS_PAGES})")
        L = cfg.num_hidden_layers
        self.qkv_n, self.gu_n = (hq + 2 * hkv) * HD, 2 * inter
        self.gu_stride = self.gu_n + 2 * (inter // 128)  # a layer's gate|up sums and flags
        head_items = _items_of(model.lm_head)
        self.vocab = cfg.vocab_size
        # per step zeroed: the barrier counter (4 floats' room), each layer's q|k|v sums, the
        # INT4 head's logits; and each layer's gate|up sums and tile flags (self.gu)
        self.off_qkv = 4
        self.off_logits = self.off_qkv + L * self.qkv_n
        n_ws = self.off_logits + (self.vocab if head_items is not None else 0)
        self.ws = torch.zeros(n_ws, dtype=torch.float32, device=device)
        self.gu = torch.zeros(L * self.gu_stride, dtype=torch.float32, device=device)
        self.h = torch.zeros(hidden, dtype=torch.float32, device=device)
        self.part = torch.zeros(hkv * self.S * self.gqa * (HD + 2), dtype=torch.float32,
                                device=device)
        self.normed = None if head_items is not None else torch.zeros(
            (1, hidden), dtype=torch.float16, device=device)
        # shared memory: the most red tiles a CTA touches in one GEMV
        shapes = [(hidden // 128, self.qkv_n // 128), (hq, hidden // 128),
                  (hidden // 128, self.gu_n // 128), (inter // 128, hidden // 128)]
        if head_items is not None:
            shapes.append((hidden // 128, self.vocab // 128))
        red_tiles = max(2, red_tiles_needed(shapes, self.ctas))
        limit = props.shared_memory_per_block_optin
        self.stages = ring_stages(red_tiles, self.gqa, self.mass, limit)
        if self.stages is None:
            raise ValueError(f"the kernel's buffers do not fit {limit} bytes of shared memory")
        self.smem = smem_bytes(self.stages, red_tiles, self.gqa, self.mass)
        self.device_index = (device.index if device.index is not None
                             else torch.cuda.current_device())

        table = model.model.embed_tokens.weight
        seq = run.seq
        G = seg
        p = StepParams()
        p.dev, p.tok = dev.data_ptr(), tok.data_ptr()
        p.embed, p.h, p.part = table.data_ptr(), self.h.data_ptr(), self.part.data_ptr()
        p.counter = self.ws.data_ptr()
        p.inv_freq = model.rope.inv_freq.data_ptr()
        p.kcache, p.vcache = cache.k.data_ptr(), cache.v.data_ptr()
        p.gpos = cache.spos.data_ptr() if G else 0  # ([L, Hkv, seg]: the globals' when P = 0)
        p.score = cache.score.data_ptr() if cache.score is not None else 0
        p.gmass = cache.smass.data_ptr() if G else 0
        p.gseen = cache.sseen.data_ptr() if G else 0
        p.capacity = cache.capacity
        p.stages, p.red_tiles = self.stages, red_tiles  # (_load_build: ring_plan's slots)
        p.flags = F_MASS if self.mass else 0
        p.nb, p.bs, p.hkv, p.hq, p.hidden, p.G, p.S = (
            nb, run.sparse.block_size, hkv, hq, hidden, G, self.S)
        p.sinks = seq.sinks
        p.window = seq.window if seq.window is not None else -1
        if run.retrieval is not None and seq.window is not None:  # every key of a listed block,
            p.window += run.sparse.block_size - 1  # as GraphStepContext's window (a key leaves
            # the view only when its block is offloaded, and is retrievable from then on)
        p.min_distance = run.score_kwargs.get("score_min_distance", 0)
        p.scale, p.eps = run.scale, float(model.model.norm.eps)
        p.rope_scaling = float(model.rope.scaling)
        self.params = p
        self._phases()
        self._load_build(att_warps)
        # TMA maps: the cache as [L * capacity * bs rows, Hkv, 128], K plain, V 128-B swizzled
        # in two 64-dim boxes; the globals as [L * Hkv * G rows, 1, 128] the same way
        rows_kv = L * cache.capacity * run.sparse.block_size
        enc = cuda_launch.encode_tensor_map
        kv_strides = [HD * 2, hkv * HD * 2]
        self.maps = [enc(cache.k, [HD, hkv, rows_kv], kv_strides, [HD, 1, PAGE]),
                     enc(cache.v, [HD, hkv, rows_kv], kv_strides, [64, 1, PAGE], swizzle="128B")]
        if G:
            g_rows = L * hkv * G
            self.maps += [enc(cache.sk, [HD, 1, g_rows], [HD * 2, HD * 2], [HD, 1, PAGE]),
                          enc(cache.sv, [HD, 1, g_rows], [HD * 2, HD * 2], [64, 1, PAGE],
                              swizzle="128B")]
        else:  # never read (no global pages): any valid map
            self.maps += self.maps[:2]

    def _phases(self) -> None:
        """The phase table (META int64 a row): per layer the q|k|v GEMV, the attention, the o
        GEMV and the MLP as one phase over every CTA with tile flags between gate|up and down
        (K_MLP2; run 141: 0.02-0.05 ms a step faster than the other forms); then the INT4
        head's GEMV or the final norm (an fp16 head runs after the kernel)."""
        model, cfg = self.model, self.model.cfg
        hq, hidden, inter = cfg.num_attention_heads, cfg.hidden_size, cfg.intermediate_size
        ws, h = self.ws.data_ptr(), self.h.data_ptr()
        rows, kinds = [], []

        def items(lin, k: int, n: int) -> int:
            it = _items_of(lin)
            assert it.is_contiguous() and it.shape == (n // 128 * (k // 128), ITEM_WORDS)
            return it.data_ptr()

        def gemv(kind, lin, k: int, n: int, out: int, xform: int, src: int, norm: int,
                 layer: int = 0):
            rows.append([K_GEMV, k, n, k // 128, n // 128, items(lin, k, n), out, xform, src,
                         norm, layer, 0])
            kinds.append(kind)

        for i, layer in enumerate(model.model.layers):
            att, mlp = layer.self_attn, layer.mlp
            qkv = ws + 4 * (self.off_qkv + i * self.qkv_n)
            gemv("qkv", att.qkv_proj, hidden, self.qkv_n, qkv,
                 X_NORM_EMB if i == 0 else X_NORM, h, layer.input_layernorm.weight.data_ptr())
            rows.append([K_ATTN, i, qkv] + [0] * (META - 3))
            kinds.append("attn")
            gemv("o", att.o_proj, hq * HD, hidden, h, X_ATT, 0, 0, i)
            norm = layer.post_attention_layernorm.weight.data_ptr()
            gu = self.gu.data_ptr() + 4 * i * self.gu_stride
            rows.append([K_MLP2, hidden, inter, hidden // 128, inter // 128,
                         items(mlp.gate_up_proj, hidden, self.gu_n), h, gu, h, norm, i,
                         items(mlp.down_proj, inter, hidden)])
            kinds.append("mlp")
        final_w = model.model.norm.weight.data_ptr()
        if self.normed is None:
            gemv("head", model.lm_head, hidden, self.vocab, ws + 4 * self.off_logits, X_NORM, h,
                 final_w)
        else:
            rows.append([K_FINAL_NORM, hidden, 0, 0, 0, 0, self.normed.data_ptr(), 0, 0,
                         final_w, 0, 0])
            kinds.append("head")
        self.meta = torch.tensor(rows, dtype=torch.int64, device=self.ws.device)
        self.kinds = kinds
        self.params.meta, self.params.n_phase = self.meta.data_ptr(), len(rows)

    def _load_build(self, att_warps: int | None = None, extra: tuple[str, ...] = ()) -> None:
        """Launch the build with `att_warps` warps an attention page (None: ring_plan's
        choice) and the ring slots ring_plan gives it; extra: more compiler options (the
        profiling stamps, -DTIMELINE=1)."""
        aw, stages = ring_plan(self.stages, NW, self.unit_pages, att_warps)
        opts = (*extra, f"-DATT_WARPS={aw}") if aw != 4 else tuple(extra)
        self.att_warps, self.params.stages = aw, stages
        self.function = build_kernel(self.gqa, norm_pairs(self.model.cfg.hidden_size),
                                     self.device_index, opts)[self.mass]
        self.function.set_max_dynamic_shared_memory(self.smem)

    def keep_queries(self, tier) -> None:
        """The retrieval tier's last_q from this step's q sums (pre-RoPE, fp32, in the
        workspace until the next step zeroes it) rotated at the step's position: what each
        layer's attention used, for the next decode step's page choice (engine/retrieval.py)."""
        cfg = self.model.cfg
        hq = cfg.num_attention_heads
        L = cfg.num_hidden_layers
        raw = self.ws[self.off_qkv:self.off_logits].view(L, self.qkv_n)[:, :hq * HD]
        cos, sin = self.model.rope.cos_sin(self.dev[0:1], torch.float32)
        tier.keep_queries(raw.view(L, hq, HD), *rope_tables(cos, sin))

    def __call__(self) -> torch.Tensor:
        """One step on the current stream -> logits [1, V] fp32 (a static buffer)."""
        self.ws.zero_()
        self.gu.zero_()
        self.function.launch((self.ctas, 1, 1), ((NW + 1) * 32, 1, 1), self.smem,
                             [self.params, *self.maps])
        if self.normed is None:
            return self.ws[self.off_logits:].view(1, -1)
        return self.model.lm_head(self.normed).float()  # fp16 or INT8 head, after the kernel
