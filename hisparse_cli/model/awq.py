"""AWQ INT4 checkpoints: which `quantization_config`s we load, and the `AWQLinear` module.

Supported: what AutoAWQ publishes as "GEMM" checkpoints (`*-AWQ` models on the Hub):
    {"quant_method": "awq", "version" (or "format"): "gemm", "bits": 4,
     "group_size": 32 | 64 | 128, "zero_point": true, "modules_to_not_convert": [...] | null}
Tensors per quantized linear `<name>`: qweight int32 [in, out/8], qzeros int32
[in/group, out/8], scales fp16 [in/group, out], optional bias [out]; layout and nibble order in
kernels/int4/awq_pack.py. Everything else (GEMV, GEMV-fast, llm-awq, exllama, marlin, other bit
widths, symmetric, GPTQ, ...) is refused with a `ModelError` naming what is supported.
A module is quantized exactly when its `<name>.qweight` is in the checkpoint, so mixed
checkpoints (some linears fp16, `modules_to_not_convert`) load as they are.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from hisparse_cli.errors import ModelError
from hisparse_cli.kernels.int4 import awq_layout
from hisparse_cli.kernels.int4.awq_layout import GEMV_MAX_TOKENS, kmajor_to_awq, repack_kmajor
from hisparse_cli.kernels.dispatch import select_backend

SUPPORTED_GROUP_SIZES = (32, 64, 128)
SUPPORTED = ("AWQ 'gemm' checkpoints (AutoAWQ layout): quant_method awq, version gemm, bits 4, "
             "zero_point true, group_size 32/64/128")


@dataclass(frozen=True)
class AWQConfig:
    """A validated AWQ GEMM `quantization_config`."""

    group_size: int
    bits: int = 4
    zero_point: bool = True
    version: str = "gemm"
    modules_to_not_convert: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.bits != 4:
            raise ModelError(f"quantization_config.bits is {self.bits}; hisparse loads {SUPPORTED}")
        if self.group_size not in SUPPORTED_GROUP_SIZES:
            raise ModelError(f"quantization_config.group_size is {self.group_size}; "
                             f"hisparse loads {SUPPORTED}")
        if not self.zero_point:
            raise ModelError(f"quantization_config.zero_point is false; hisparse loads {SUPPORTED}")
        if self.version != "gemm":
            raise ModelError(f"quantization_config.version is {self.version!r}; hisparse loads "
                             f"{SUPPORTED}")

    def to_dict(self) -> dict:
        """The `quantization_config` block as AutoAWQ/transformers write it."""
        return {"quant_method": "awq", "bits": self.bits, "group_size": self.group_size,
                "zero_point": self.zero_point, "version": self.version,
                "modules_to_not_convert": list(self.modules_to_not_convert) or None}

    def keeps_fp(self, module_name: str) -> bool:
        """True when `module_name` is listed (as a name component path) to stay unquantized."""
        return any(skip == module_name or skip in module_name.split(".")
                   or module_name.startswith(skip + ".") for skip in self.modules_to_not_convert)


def parse_quantization_config(qc: dict | None) -> AWQConfig | None:
    """config.json's `quantization_config` -> AWQConfig; None when absent; ModelError otherwise."""
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise ModelError(f"quantization_config must be an object, got {type(qc).__name__}")
    method = str(qc.get("quant_method", "")).lower()
    if method != "awq":
        raise ModelError(f"quantization method {method or 'unknown'!r} is not supported; "
                         f"hisparse loads fp16/bf16/fp32 weights and {SUPPORTED}",
                         hint="use an unquantized checkpoint or an AWQ (GEMM) one, or make one "
                              "with `hisparse quantize`")
    backend = str(qc.get("backend") or "").lower()
    version = str(qc.get("version") or qc.get("format") or "gemm").lower()
    if backend == "llm-awq" or version == "llm-awq":
        version = "llm-awq (int16 packing)"
    try:
        bits = int(qc.get("bits", qc.get("w_bit", 4)))
        group = int(qc.get("group_size", qc.get("q_group_size", 128)))
    except (TypeError, ValueError) as exc:
        raise ModelError(f"quantization_config has a bad bits/group_size: {exc}") from exc
    skip = qc.get("modules_to_not_convert") or ()
    if isinstance(skip, str) or not all(isinstance(s, str) for s in skip):
        raise ModelError("quantization_config.modules_to_not_convert must be a list of names")
    return AWQConfig(group_size=group, bits=bits, zero_point=bool(qc.get("zero_point", True)),
                     version=version, modules_to_not_convert=tuple(skip))


class AWQLinear(nn.Module):
    """y = x @ dequant(qweight) + bias; computes through the kernel dispatch point.

    Buffers: qweight int32 [in, out/8], qzeros int32 [in/group, out/8], scales [in/group, out]
    (fp16 as stored), bias [out] or None (in the compute dtype).

    On CUDA with the Triton backend, `from_checkpoint` repacks qweight once into the K-major
    run-time layout int32 [out, in/8] (kernels/int4/awq_layout.py; `layout` == "kmajor"; with
    a shape of whole 64-row tiles its words in tiled order, "tiled"): same bytes, the
    checkpoint-layout tensor is dropped. `checkpoint_qweight()` gives the AutoAWQ
    layout back. On the CPU (backend "int4pack", the default there) it also keeps a packed
    copy for decode-sized calls, non-persistent buffers `int4pack` uint8 [out, in/2] and
    `int4pack_sz` bf16 [in/group, out, 2] (kernels/int4/awq_cpu.py: ~25x faster one-token calls,
    bf16 activations); prefill-sized calls keep the fp32 reference.
    """

    # "awq": qweight [in, out/8] (AutoAWQ GEMM); "kmajor": [out, in/8]; "tiled": the K-major
    # words in awq_layout.tile_kmajor's order (every shape of whole 64-row tiles)
    layout = "awq"
    _prepared_key: tuple | None = None  # forward: what `_prepared` was made for
    _prepared = None  # the backend's awq_linear_k bound to these buffers

    def __init__(self, in_features: int, out_features: int, group_size: int,
                 bias: bool = False, device=None, dtype: torch.dtype = torch.float16) -> None:
        super().__init__()
        if in_features % group_size or out_features % 8:
            raise ModelError(f"AWQ linear {in_features}->{out_features}: in_features must be a "
                             f"multiple of group_size {group_size} and out_features of 8")
        self.in_features, self.out_features, self.group_size = in_features, out_features, group_size
        groups, words = in_features // group_size, out_features // 8
        self.register_buffer("qweight", torch.zeros(in_features, words, dtype=torch.int32,
                                                    device=device))
        self.register_buffer("qzeros", torch.zeros(groups, words, dtype=torch.int32, device=device))
        self.register_buffer("scales", torch.zeros(groups, out_features, dtype=torch.float16,
                                                   device=device))
        self.register_buffer("bias", torch.zeros(out_features, dtype=dtype, device=device)
                             if bias else None)
        # the CPU decode copy (kernels/int4/awq_cpu.py), made by from_checkpoint on the CPU where
        # the shape allows; not part of the checkpoint (non-persistent)
        self.register_buffer("int4pack", None, persistent=False)
        self.register_buffer("int4pack_sz", None, persistent=False)
        # the prefill weight cache (keep_prefill_weight): W^T [out, in] dequantized once, which
        # prefill-sized products multiply by instead of dequantizing every call (non-persistent)
        self.register_buffer("prefill_weight", None, persistent=False)

    @classmethod
    def from_checkpoint(cls, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                        bias: torch.Tensor | None, group_size: int,
                        device: str | torch.device = "cpu",
                        dtype: torch.dtype = torch.float16, name: str = "",
                        expect: tuple[int, int] | None = None) -> "AWQLinear":
        """Validate checkpoint tensors (ModelError naming `name`) and move them to device.

        expect: (out_features, in_features) the model config implies, checked when given.
        """
        where = f"{name}: " if name else ""
        if qweight.dtype != torch.int32 or qzeros.dtype != torch.int32:
            raise ModelError(f"{where}qweight/qzeros are {qweight.dtype}/{qzeros.dtype}, expected "
                             f"int32 (llm-awq's int16 packing is not supported); hisparse loads "
                             f"{SUPPORTED}")
        if qweight.dim() != 2 or qzeros.dim() != 2 or scales.dim() != 2:
            raise ModelError(f"{where}AWQ tensors must be 2-D")
        in_f, out_f = qweight.shape[0], qweight.shape[1] * 8
        if in_f % group_size:
            raise ModelError(f"{where}qweight has {in_f} input rows, not a multiple of "
                             f"group_size {group_size}: not the GEMM layout; hisparse loads "
                             f"{SUPPORTED}")
        if expect is not None and (out_f, in_f) != tuple(expect):
            raise ModelError(f"{where}qweight {tuple(qweight.shape)} encodes a {in_f}->{out_f} "
                             f"linear, the config implies {expect[1]}->{expect[0]}: not the GEMM "
                             f"layout; hisparse loads {SUPPORTED}")
        groups = in_f // group_size
        if tuple(qzeros.shape) != (groups, out_f // 8) or tuple(scales.shape) != (groups, out_f):
            raise ModelError(
                f"{where}AWQ shapes qweight {tuple(qweight.shape)}, qzeros {tuple(qzeros.shape)}, "
                f"scales {tuple(scales.shape)} do not match the GEMM layout for group_size "
                f"{group_size} (expected qzeros {(groups, out_f // 8)}, scales {(groups, out_f)}); "
                f"hisparse loads {SUPPORTED}")
        if bias is not None and tuple(bias.shape) != (out_f,):
            raise ModelError(f"{where}bias has shape {tuple(bias.shape)}, expected ({out_f},)")
        with torch.device("meta"):
            mod = cls(in_f, out_f, group_size, bias=bias is not None, dtype=dtype)
        mod.qweight = qweight.to(device).contiguous()
        if cls.repacks_on(mod.qweight.device):
            tiled = awq_layout.tileable(out_f, in_f, group_size)
            # the AWQ-layout tensor is freed here
            mod.qweight = repack_kmajor(mod.qweight, group_size if tiled else None)
            mod.layout = "tiled" if tiled else "kmajor"
        mod.qzeros = qzeros.to(device).contiguous()
        mod.scales = scales.to(device=device, dtype=torch.float16).contiguous()
        mod.bias = None if bias is None else bias.to(device=device, dtype=dtype).contiguous()
        mod._pack_for_cpu()
        return mod

    def _pack_for_cpu(self) -> None:
        """(Re)make or drop the CPU decode copy to match the buffers' device and dtypes."""
        from hisparse_cli.kernels.int4.awq_cpu import int4pack_applies, pack_for_cpu

        qw = self.qweight
        if (self.layout == "awq" and self.packs_on(qw.device)
                and int4pack_applies(self.in_features, self.out_features, self.group_size)):
            if self.int4pack is None or self.int4pack_sz.dtype != torch.bfloat16:
                self.int4pack, self.int4pack_sz = pack_for_cpu(qw, self.qzeros, self.scales)
        else:
            self.int4pack = self.int4pack_sz = None

    @staticmethod
    def packs_on(device: torch.device) -> bool:
        """True where the layer keeps the packed CPU decode copy: the CPU, whose backend runs
        INT4 through torch's packed kernel (not with HISPARSE_BACKEND=torch)."""
        return device.type == "cpu" and select_backend("cpu").int4_linear == "int4pack"

    @staticmethod
    def repacks_on(device: torch.device) -> bool:
        """True where the kernels run on the K-major layout: CUDA with the Triton backend."""
        return device.type == "cuda" and select_backend("cuda").int4_linear == "triton"

    def checkpoint_qweight(self) -> torch.Tensor:
        """qweight in the AutoAWQ GEMM layout [in, out/8], whatever the run-time layout."""
        if self.layout == "items":
            from hisparse_cli.kernels.int4.awq_items import items_to_awq

            return items_to_awq(self.qweight, self.in_features, self.out_features)[0]
        if self.layout == "tiled":
            return kmajor_to_awq(self.qweight, tiled_group=self.group_size)
        return kmajor_to_awq(self.qweight) if self.layout == "kmajor" else self.qweight

    def set_tiled(self, on: bool) -> bool:
        """Store the K-major words in tiled order (on) or back in K-major order; True when the
        layout is then the one asked for (a shape whose rows do not fill 64-row tiles stays
        K-major). The same bytes: a copy per call, then the old tensor is freed."""
        if self.layout not in ("kmajor", "tiled"):
            return False
        if on and self.layout == "kmajor":
            if not awq_layout.tileable(self.out_features, self.in_features, self.group_size):
                return False
            self.qweight, self.layout = awq_layout.tile_kmajor(self.qweight,
                                                               self.group_size), "tiled"
        elif not on and self.layout == "tiled":
            self.qweight = awq_layout.untile_kmajor(self.qweight, self.group_size)
            self.layout = "kmajor"
        self._prepared = self._prepared_key = None
        return True

    def set_layout(self, layout: str) -> bool:
        """layout "items": the persistent decode kernel's layout (kernels/int4/awq_items.py: group
        size 128, in and out features multiples of 128), which packs the scales and zero
        points into the items, so qweight becomes the items [T * G, 2128] and qzeros / scales
        are dropped; any other layout is reached through the AutoAWQ tensors. True when the
        layout is then the one asked for. One linear's conversion at a time (chunked).
        Layouts: "items", "awq" (the checkpoint's), "kmajor", "tiled"; any other name is
        refused (False, nothing changed)."""
        from hisparse_cli.kernels.int4 import awq_items

        if layout == self.layout:
            return True
        if layout not in ("items", "awq", "kmajor", "tiled"):
            return False
        if layout == "items":
            if self.group_size != 128 or self.in_features % 128 or self.out_features % 128:
                return False
            qweight = self.checkpoint_qweight()
            self.qweight = None  # the run-time copy goes before the items are made
            try:
                items = awq_items.items_from_awq(qweight, self.qzeros, self.scales)
            except BaseException:  # (out of memory, Ctrl-C): a working linear stays, in the
                self.qweight, self.layout = qweight, "awq"  # AWQ layout every backend reads
                self._prepared = self._prepared_key = None
                raise
            self.qweight = items
            del qweight
            self.qzeros = self.scales = None
            self.layout = "items"
        elif self.layout == "items":
            qweight, qzeros, scales = awq_items.items_to_awq(self.qweight, self.in_features,
                                                             self.out_features)
            self.qweight, self.qzeros, self.scales, self.layout = qweight, qzeros, scales, "awq"
            if layout != "awq":
                self.qweight = repack_kmajor(qweight, self.group_size if layout == "tiled"
                                             else None)
                self.layout = layout
        elif self.layout == "awq" and layout in ("kmajor", "tiled"):
            if self.in_features % awq_layout.RUN:
                return False
            tiled = layout == "tiled" and awq_layout.tileable(self.out_features,
                                                             self.in_features, self.group_size)
            self.qweight = repack_kmajor(self.qweight, self.group_size if tiled else None)
            self.layout = "tiled" if tiled else "kmajor"
            self._prepared = self._prepared_key = None
            return self.layout == layout
        else:
            return self.set_tiled(layout == "tiled")
        self._prepared = self._prepared_key = None
        return True

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """W^T [out, in] in dtype: (q - z) s exact, rounded once to dtype, as every prefill path
        of this layout dequantizes it (CUDA: the layout's Triton dequantize; else the fp32
        reference)."""
        k, n = self.in_features, self.out_features
        if self.layout == "items":
            if self.qweight.is_cuda:
                from hisparse_cli.kernels.int4.awq_items_linear import dequantize_items

                return dequantize_items(self.qweight, k, n,
                                        out=torch.empty((n, k), dtype=dtype,
                                                        device=self.qweight.device))
            from hisparse_cli.kernels.int4.awq_items import dequantize_items_ref

            return dequantize_items_ref(self.qweight, k, n, 0, n).to(dtype)
        if self.layout in ("kmajor", "tiled") and self.qweight.is_cuda:
            from hisparse_cli.kernels.int4.awq_triton import awq_dequantize_k

            return awq_dequantize_k(self.qweight, self.qzeros, self.scales, self.group_size,
                                    dtype, tiled=self.layout == "tiled")
        from hisparse_cli.kernels.int4.awq_ref import dequantize_weight

        return dequantize_weight(self.checkpoint_qweight(), self.qzeros, self.scales,
                                 self.group_size).t().to(dtype).contiguous()

    def keep_prefill_weight(self, on: bool, dtype: torch.dtype | None = None) -> int:
        """Keep (on) or drop the prefill weight cache: W^T dequantized once in dtype (default:
        the bias's or fp16), which a product of more than GEMV_MAX_TOKENS tokens then
        multiplies by directly (F.linear: one cuBLAS call, no dequantize pass); decode-sized
        products keep the INT4 kernels. Returns the bytes it holds (the memory plan's
        `weights.prefill_cache`; Engine.keep_prefill_weights decides which linears)."""
        if not on:
            self.prefill_weight = None
            return 0
        dtype = dtype or (self.bias.dtype if self.bias is not None else torch.float16)
        pw = self.prefill_weight
        if pw is None or pw.dtype != dtype:
            self.prefill_weight = None  # (an old copy goes before the new one is made)
            self.prefill_weight = self.dequantized(dtype)
        return self.prefill_weight.numel() * self.prefill_weight.element_size()

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None, group_size: int,
                   dtype: torch.dtype | None = None) -> "AWQLinear":
        """Round-to-nearest INT4 of an fp weight [out, in] (tests, quantized lm_head)."""
        from hisparse_cli.kernels.int4.awq_pack import quantize_weight

        p = quantize_weight(weight.detach(), group_size)
        return cls.from_checkpoint(p.qweight, p.qzeros, p.scales, bias, group_size,
                                   device=weight.device, dtype=dtype or weight.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] -> [..., out] in x's dtype."""
        pw = self._buffers["prefill_weight"]
        if pw is not None and x.numel() > GEMV_MAX_TOKENS * self.in_features:
            return nn.functional.linear(x, pw if pw.dtype == x.dtype else pw.to(x.dtype),
                                        None if self.bias is None else self.bias.to(x.dtype))
        if self.layout == "items":  # dequantize column chunks, then matmul (any T)
            if x.is_cuda:  # checks once, dequantize launches from CUDA graphs
                b, key = self._buffers, self._prepared_key
                if key is None or key[0] != "items" or key[1] is not b["qweight"] \
                        or key[2] is not b["bias"]:
                    from hisparse_cli.kernels.int4.awq_items_triton import PreparedItemsLinear

                    self._prepared = PreparedItemsLinear(b["qweight"], self.in_features,
                                                         self.out_features, b["bias"])
                    self._prepared_key = ("items", b["qweight"], b["bias"])
                return self._prepared(x)
            from hisparse_cli.kernels.int4.awq_items_linear import items_linear

            return items_linear(x, self.qweight, self.in_features, self.out_features, self.bias)
        backend = select_backend(x.device.type)
        if self.layout not in ("kmajor", "tiled"):
            pack = self.int4pack
            return backend.awq_linear(x, self.qweight, self.qzeros, self.scales, self.bias,
                                      self.group_size,
                                      cpu_pack=None if pack is None else (pack, self.int4pack_sz))
        # the buffers' checks and launch constants are made once per backend and set of
        # buffer objects (a module whose buffers are replaced, e.g. by .to(), is prepared
        # again); x is checked on every call. Identity tests on the buffer dict: a module
        # attribute lookup per buffer was measurable host time per prefill linear.
        b, key = self._buffers, self._prepared_key
        qw, qz, sc, bias = b["qweight"], b["qzeros"], b["scales"], b["bias"]
        if (key is None or key[0] is not backend or key[1] is not qw or key[2] is not qz
                or key[3] is not sc or key[4] is not bias):
            self._prepared = backend.prepare_awq_linear_k(qw, qz, sc, bias, self.group_size,
                                                          tiled=self.layout == "tiled")
            self._prepared_key = (backend, qw, qz, sc, bias)
        return self._prepared(x)

    def _apply(self, fn, recurse=True):  # .to() / .half() / .cuda(): new buffers, prepare again
        self._prepared = self._prepared_key = None  # (and do not keep the old ones alive)
        out = super()._apply(fn, recurse)
        if self.int4pack is not None:  # moved off the CPU: dropped; a float cast: made again
            self._pack_for_cpu()
        return out

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"group_size={self.group_size}, bias={self.bias is not None}, "
                f"layout={self.layout}")
