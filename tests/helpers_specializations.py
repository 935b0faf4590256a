"""The specializations Triton's JIT would compile for the launches a test makes, on the CPU.

Under TRITON_INTERPRET=1 nothing is compiled, so Triton's own per-device kernel cache stays
empty; instead every launch of an interpreted kernel is recorded with the key Triton's JIT
binder would cache it under (runtime/jit.py: the constexprs by value, each other argument's
(type, specialization) from Triton's own `native_specialize_impl` with the kernel's
do_not_specialize / do_not_specialize_on_alignment lists, and the launch options). Two keys
that differ compile two variants on a GPU.

    rec = SpecializationRecorder.install(monkeypatch)
    ... launch kernels ...
    rec.value_classes()   # {kernel: {arg: {class, ...}}} for plain integer arguments
    rec.extra_variants()  # kernels whose integer values alone added variants (want: {})
"""

from __future__ import annotations

import inspect
from collections import defaultdict

_OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg", "launch_pdl")


class SpecializationRecorder:
    def __init__(self) -> None:
        self.keys: dict[str, set] = defaultdict(set)  # kernel -> full keys
        self.int_free: dict[str, set] = defaultdict(set)  # kernel -> keys, int classes erased
        self.classes: dict[str, dict[str, set]] = defaultdict(lambda: defaultdict(set))

    @classmethod
    def install(cls, monkeypatch) -> "SpecializationRecorder":
        from triton.runtime.interpreter import InterpretedFunction

        rec, run = cls(), InterpretedFunction.run

        def recording_run(self, *args, grid, warmup, **kwargs):
            rec.record(self, args, kwargs)
            return run(self, *args, grid=grid, warmup=warmup, **kwargs)

        monkeypatch.setattr(InterpretedFunction, "run", recording_run)
        return rec

    def record(self, kernel, args, kwargs) -> None:
        from triton._C.libtriton import native_specialize_impl
        from triton.backends.compiler import BaseBackend

        sig = inspect.signature(kernel.fn)
        bound = sig.bind(*args, **{k: v for k, v in kwargs.items() if k in sig.parameters})
        bound.apply_defaults()
        dns = set(kernel.kwargs.get("do_not_specialize") or ())
        dnsa = set(kernel.kwargs.get("do_not_specialize_on_alignment") or ())
        name = f"{kernel.fn.__module__.rsplit('.', 1)[-1]}.{kernel.fn.__name__}"
        full, erased = [], []
        for arg, value in bound.arguments.items():
            if "constexpr" in str(sig.parameters[arg].annotation):
                full.append((arg, repr(value)))
                erased.append((arg, repr(value)))
                continue
            key = native_specialize_impl(BaseBackend, value, False, arg not in dns,
                                         arg not in dnsa)
            full.append((arg, str(key)))
            plain_int = isinstance(value, int) and not isinstance(value, bool)
            erased.append((arg, "int" if plain_int else str(key)))
            if plain_int:
                self.classes[name][arg].add(str(key))
        opts = tuple((k, kwargs.get(k)) for k in _OPTIONS)
        self.keys[name].add((tuple(full), opts))
        self.int_free[name].add((tuple(erased), opts))

    def value_classes(self) -> dict[str, dict[str, set]]:
        return {k: dict(v) for k, v in self.classes.items()}

    def extra_variants(self) -> dict[str, dict]:
        """Kernels compiled more often than their constexprs, dtypes and pointer alignments
        ask: {kernel: {"variants": n, "without_int_classes": m, "args": {arg: classes}}}
        naming the integer arguments seen in more than one class."""
        out = {}
        for name, keys in self.keys.items():
            if len(keys) > len(self.int_free[name]):
                varying = {a: sorted(c) for a, c in self.classes[name].items() if len(c) > 1}
                out[name] = {"variants": len(keys), "without_int_classes":
                             len(self.int_free[name]), "args": varying}
        return out
