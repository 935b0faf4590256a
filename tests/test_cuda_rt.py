"""Runtime-built CUDA kernels (kernels/cuda/cuda_rt.py, cuda_launch.py): NVRTC compile, cubin cache,
driver launch.

CPU, always: argument bytes as cuLaunchKernel reads them, the cache key, the disk cache with a
fake compiler (round trip, a corrupt entry rebuilt, an unwritable folder skipped), tensor-map
validation, the libnvrtc search order over a fake site-packages tree, the "not available"
reason. With a libnvrtc (found as cuda_rt searches, or HISPARSE_NVRTC=/path/to/libnvrtc.so.N):
the kernels below compile for sm_80 / sm_90, options reach the compiler, a bad source raises
KernelCompileError with NVRTC's log. On a GPU (`gpu` marker): y = a*x + b checked against
torch, >48 KiB of dynamic shared memory, a launch captured in a CUDA graph and replayed on new
inputs, the kernel's attributes, and (sm_90) a TMA box load through a tensor map equal to the
tensor's slice, zeros past its end.
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import struct
import warnings

import pytest
import torch

from hisparse_cli.kernels.cuda import cuda_launch as drv
from hisparse_cli.kernels.cuda import cuda_rt as rt

# y[i] = a * x[i] + b for i < n: one fma.rn per element in inline PTX (no CUDA header),
# templated on the element type and the elements each thread handles.
AXPB = r"""
template <typename T> struct Fma;
template <> struct Fma<float> {
  static __device__ __forceinline__ float run(float a, float x, float b) {
    float y;
    asm("fma.rn.f32 %0, %1, %2, %3;" : "=f"(y) : "f"(a), "f"(x), "f"(b));
    return y;
  }
};

template <typename T, int PER_THREAD>
__global__ void axpb(T* __restrict__ y, const T* __restrict__ x, T a, T b, long long n) {
  const long long base = ((long long)blockIdx.x * blockDim.x + threadIdx.x) * PER_THREAD;
#pragma unroll
  for (int k = 0; k < PER_THREAD; ++k) {
    const long long i = base + k;
    if (i < n) y[i] = Fma<T>::run(a, x[i], b);
  }
}
"""
AXPB_EXPRS = ("axpb<float, 4>", "axpb<float, 1>")

# Each block reverses its `seg` floats through dynamic shared memory: the whole segment is
# staged before any of it is written back, so a block needs seg * 4 bytes of it.
REVERSE = r"""
extern "C" __global__ void reverse_segments(float* __restrict__ y, const float* __restrict__ x,
                                            int seg) {
  extern __shared__ float stage[];
  const float* src = x + (long long)blockIdx.x * seg;
  float* dst = y + (long long)blockIdx.x * seg;
  for (int i = threadIdx.x; i < seg; i += blockDim.x) stage[i] = src[i];
  __syncthreads();
  for (int i = threadIdx.x; i < seg; i += blockDim.x) dst[i] = stage[seg - 1 - i];
}
"""

# One TMA box [16 rows][1 head][128] of fp16 (as raw u16) into shared memory: thread 0 inits
# an mbarrier (1 arrival), arrives on it expecting the box's bytes, issues the bulk tensor
# copy that completes those bytes on it; every thread waits for phase 0, then copies the box
# out row-major: out[r][d] = tensor[r0 + r][h][d] (zeros where r0 + r is past the end).
TMA_COPY = r"""
struct alignas(64) TensorMap { unsigned long long words[16]; };

__device__ __forceinline__ unsigned smem_addr(const void* p) {
  unsigned long long a;
  asm("cvta.to.shared.u64 %0, %1;" : "=l"(a) : "l"(p));
  return (unsigned)a;
}

__device__ __forceinline__ bool mbar_try_wait(unsigned bar, unsigned parity) {
  unsigned done;
  asm volatile("{\n\t.reg .pred p;\n\t"
               "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n\t"
               "selp.u32 %0, 1, 0, p;\n\t}"
               : "=r"(done) : "r"(bar), "r"(parity) : "memory");
  return done != 0;
}

constexpr int D = 128, BOX_ROWS = 16, BOX_BYTES = D * BOX_ROWS * 2;

extern "C" __global__ void tma_box_copy(const __grid_constant__ TensorMap map,
                                        unsigned short* __restrict__ out, int r0, int h) {
  __shared__ alignas(128) unsigned short box[BOX_ROWS * D];
  __shared__ alignas(8) unsigned long long bar;
  const unsigned box_s = smem_addr(box), bar_s = smem_addr(&bar);
  if (threadIdx.x == 0) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(bar_s), "r"(1) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;"
                 :: "r"(bar_s), "r"(BOX_BYTES) : "memory");
    asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes"
                 " [%0], [%1, {%2, %3, %4}], [%5];"
                 :: "r"(box_s), "l"(reinterpret_cast<unsigned long long>(&map)), "r"(0),
                    "r"(h), "r"(r0), "r"(bar_s)
                 : "memory");
  }
  while (!mbar_try_wait(bar_s, 0)) {}
  for (int i = threadIdx.x; i < BOX_ROWS * D; i += blockDim.x) out[i] = box[i];
}
"""

needs_nvrtc = pytest.mark.skipif(not rt.nvrtc_available(),
                                 reason=f"no libnvrtc: {rt.nvrtc_unavailable_reason()}")


@pytest.fixture(autouse=True)
def fresh_process_state(monkeypatch, tmp_path):
    """Each test: its own cubin cache folder and memo, libnvrtc searched again."""
    monkeypatch.setenv("HISPARSE_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(rt, "_MEMO", {})
    rt._nvrtc_lib.cache_clear()
    yield
    rt._nvrtc_lib.cache_clear()


# --- launch arguments -----------------------------------------------------------------------


def test_arguments_are_the_bytes_the_kernel_reads():
    cases = [(drv.i32(-2), struct.pack("<i", -2)),
             (drv.u32(2**32 - 1), struct.pack("<I", 2**32 - 1)),
             (drv.i64(-(2**40) - 3), struct.pack("<q", -(2**40) - 3)),
             (drv.u64(2**64 - 1), struct.pack("<Q", 2**64 - 1)),
             (drv.f32(1.1), struct.pack("<f", 1.1)),
             (drv.ptr(0x7F00_DEAD_BEEF), struct.pack("<Q", 0x7F00_DEAD_BEEF)),
             (drv.ptr(None), bytes(8))]
    tmap = drv.TensorMap(torch.empty(1))
    args = (*(arg for arg, _ in cases), tmap)
    params = drv._kernel_params(args)
    assert len(params) == len(args)
    for i, (arg, want) in enumerate(cases):
        assert bytes(arg) == want
        assert ctypes.string_at(params[i], len(want)) == want  # what cuLaunchKernel copies
    assert params[-1] == tmap.address and tmap.address % 64 == 0  # the descriptor, by value
    assert len(bytes(tmap)) == 128


@pytest.mark.parametrize("make,exc", [
    (lambda: drv.i32(2**31), OverflowError), (lambda: drv.i32(-(2**31) - 1), OverflowError),
    (lambda: drv.u32(-1), OverflowError), (lambda: drv.i64(2**63), OverflowError),
    (lambda: drv.u64(2**64), OverflowError), (lambda: drv.i32(1.5), TypeError),
    (lambda: drv.ptr(torch.zeros(4)), ValueError),
    (lambda: drv._kernel_params((5,)), TypeError),
    (lambda: drv._kernel_params((torch.zeros(1),)), TypeError),
    (lambda: drv._kernel_params((ctypes.c_double(1.0),)), TypeError),
])
def test_arguments_without_a_width_or_out_of_range_are_refused(make, exc):
    with pytest.raises(exc):
        make()


def test_launch_dims():
    assert drv._dim3("grid", 7) == (7, 1, 1)
    assert drv._dim3("grid", (2, 3)) == (2, 3, 1)
    assert drv._dim3("block", [4, 5, 6]) == (4, 5, 6)
    for bad in (0, (), (1, 2, 3, 4), (2, 0)):
        with pytest.raises(ValueError, match="grid must be 1 to 3 positive sizes"):
            drv._dim3("grid", bad)


# --- cubin cache ----------------------------------------------------------------------------


def test_cache_key_covers_everything_the_cubin_depends_on():
    base = dict(arch=(9, 0), nvrtc_version=(13, 0), name_expressions=("k<1>",), options=("-O3",))
    key = rt.cache_key("src", **base)
    assert len(key) == 64 and key == rt.cache_key("src", **base)
    changed = [("src2", {}), ("src", {"arch": (8, 0)}), ("src", {"arch": (9, 1)}),
               ("src", {"nvrtc_version": (12, 9)}), ("src", {"options": ()}),
               ("src", {"options": ("-O3", "--use_fast_math")}),
               ("src", {"name_expressions": ("k<2>",)}),
               ("src", {"driver": "580.65.06"})]  # a driver update compiles afresh
    keys = {rt.cache_key(src, **{**base, **over}) for src, over in changed}
    assert len(keys) == len(changed) and key not in keys


@pytest.fixture
def fake_nvrtc(monkeypatch):
    """NVRTC replaced: version 13.0, a 'cubin' made of the source; records each compile."""
    calls = []

    def compile_(source, arch, name_expressions, options):
        calls.append((source, arch, name_expressions, options))
        return (b"\x7fELF" + source.encode(), {e: f"_Z_{e}" for e in name_expressions},
                "a warning")

    monkeypatch.setattr(rt, "nvrtc_version", lambda: (13, 0))
    monkeypatch.setattr(rt, "_nvrtc_compile", compile_)
    return calls


def _compile(source="__global__ void k() {}"):
    return rt.compile_cubin(source, arch=(9, 0), name_expressions=["k<1>"], options=["-DX=1"])


def test_cache_round_trip(fake_nvrtc, monkeypatch):
    first = _compile()
    assert fake_nvrtc == [("__global__ void k() {}", (9, 0), ("k<1>",), ("-DX=1",))]
    assert first.lowered == {"k<1>": "_Z_k<1>"} and first.log == "a warning"
    assert first.arch == (9, 0) and first.nvrtc_version == (13, 0)
    folder = rt.kernel_cache_dir()
    assert sorted(p.name for p in folder.iterdir()) == [f"{first.key}.cubin", f"{first.key}.json"]
    assert json.loads((folder / f"{first.key}.json").read_text())["lowered"] == first.lowered
    assert _compile() is first  # the in-process memo
    monkeypatch.setattr(rt, "_MEMO", {})  # a new process: from disk, no compile
    again = _compile()
    assert len(fake_nvrtc) == 1 and again == first and again is not first
    _compile("__global__ void other() {}")
    assert len(fake_nvrtc) == 2


def test_compiles_and_disk_reads_are_counted(fake_nvrtc, monkeypatch):
    """compile_log's NVRTC counts: a compile, then (a new process) a cubin read from disk;
    a memo hit is neither."""
    from hisparse_cli.kernels import compile_log

    monkeypatch.setattr(compile_log, "_TALLY", compile_log._Tally())
    _compile()
    _compile()  # the memo
    monkeypatch.setattr(rt, "_MEMO", {})
    _compile()  # from disk
    counts = compile_log.compile_counts()
    assert (counts.compiled, counts.loaded) == (1, 1) and len(fake_nvrtc) == 1
    assert counts.compile_seconds >= 0.0 and counts.load_seconds >= 0.0
    assert [n for n, _ in counts.by_kernel][0].startswith("nvrtc:sm_90:")


def test_a_driver_update_compiles_again(fake_nvrtc, monkeypatch):
    """The same source on another driver: a new cache entry (compile_cache.driver_version is
    part of the key), not the cubin the old driver's process wrote."""
    monkeypatch.setattr(rt, "driver_version", lambda: "550.54.15")
    old = _compile()
    monkeypatch.setattr(rt, "_MEMO", {})
    monkeypatch.setattr(rt, "driver_version", lambda: "580.65.06")
    new = _compile()
    assert new.key != old.key and len(fake_nvrtc) == 2
    assert len(list(rt.kernel_cache_dir().glob("*.cubin"))) == 2


@pytest.mark.parametrize("suffix,content", [
    (".cubin", b"\x7fELF truncated"), (".cubin", None), (".json", b"{not json"),
    (".json", b'{"format": 1}'), (".json", b"[]"), (".json", None)])
def test_corrupt_cache_entry_is_rebuilt(fake_nvrtc, monkeypatch, suffix, content):
    first = _compile()
    path = rt.kernel_cache_dir() / f"{first.key}{suffix}"
    if content is None:
        path.unlink()
    else:
        path.write_bytes(content)
    monkeypatch.setattr(rt, "_MEMO", {})
    assert _compile() == first and len(fake_nvrtc) == 2
    monkeypatch.setattr(rt, "_MEMO", {})
    assert _compile() == first and len(fake_nvrtc) == 2  # the rebuilt entry is good


def test_unwritable_cache_dir_only_skips_caching(fake_nvrtc, monkeypatch, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("HISPARSE_HOME", str(blocker / "home"))  # mkdir fails, even for root
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        compiled = _compile()
    assert compiled.cubin.startswith(b"\x7fELF") and not (blocker.parent / "home").exists()
    monkeypatch.setattr(rt, "_MEMO", {})
    assert _compile() == compiled and len(fake_nvrtc) == 2


# --- tensor maps ----------------------------------------------------------------------------

_T = torch.zeros(64, 4, 128, dtype=torch.float16)  # [rows, heads, 128]
_GOOD = dict(dims=(128, 4, 64), strides_bytes=(256, 1024), box=(128, 1, 16))


@pytest.mark.parametrize("tensor,over,match", [
    (_T.double(), {}, "takes uint8, int32, float16, float32, bfloat16 tensors, not torch.float64"),
    (_T, dict(dims=(1,) * 6, strides_bytes=(16,) * 5, box=(1,) * 6), "1 to 5 dims, got 6"),
    (_T, dict(box=(128, 16)), "3 dims need 3 box sizes and 2 strides_bytes"),
    (_T, dict(strides_bytes=(256,)), "3 dims need 3 box sizes and 2 strides_bytes"),
    (_T, dict(dims=(128, 4, 0)), r"dims\[2\] = 0 is out of 1..2\^32"),
    (_T, dict(strides_bytes=(250, 1024)), r"strides_bytes\[0\] = 250 \(dim 1\) must be a "
                                          "positive multiple of 16"),
    (_T, dict(box=(128, 1, 257)), r"box\[2\] = 257 is out of 1..256"),
    (_T, dict(box=(0, 1, 16)), r"box\[0\] = 0 is out of 1..256"),
    (_T, dict(box=(4, 1, 16)), "inner row is 8 bytes .* must be a multiple of 16"),
    (_T, dict(swizzle="16B"), "swizzle '16B': one of none, 32B, 64B, 128B"),
    (_T, dict(swizzle="64B"), r"swizzle 64B needs the box's inner row \(256 bytes\) to be at "
                              "most 64 bytes"),
    (_T.view(-1)[1:], dict(dims=(128, 16), strides_bytes=(256,), box=(128, 16)),
     "not 16-byte aligned"),
    (_T, dict(dims=(128, 4, 65)), "reach 66560 bytes past the tensor's address; its storage "
                                  "holds 65536"),
    (_T[1:], {}, "reach 65536 bytes .* holds 64512"),
    (_T, {}, "a tensor map describes CUDA memory, not a cpu tensor"),
])
def test_tensor_map_arguments_are_checked_on_the_host(tensor, over, match):
    with pytest.raises(ValueError, match=match):
        drv.encode_tensor_map(tensor, **{**_GOOD, **over})


# --- finding libnvrtc -----------------------------------------------------------------------


def _touch(path):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"")
    return str(path)


def test_nvrtc_search_order(tmp_path, monkeypatch):
    site_a, site_b, torch_lib = tmp_path / "a", tmp_path / "b", tmp_path / "torch_lib"
    a12 = _touch(site_a / "nvidia/cuda_nvrtc/lib/libnvrtc.so.12")
    b13 = _touch(site_b / "nvidia/cu13/lib/libnvrtc.so.13")
    b12 = _touch(site_b / "nvidia/cuda_nvrtc/lib/libnvrtc.so.12")
    _touch(site_b / "nvidia/cuda_nvrtc/lib/libnvrtc-builtins.so.12.9")  # not a candidate
    in_torch = _touch(torch_lib / "libnvrtc-8f3c2a1b.so.12")
    _touch(torch_lib / "libnvrtc-builtins-5d1e9a7f.so.12.4")
    monkeypatch.setattr(rt, "_torch_lib_dir", lambda: torch_lib)
    monkeypatch.setattr(rt.ctypes.util, "find_library", lambda name: "libnvrtc.so.12")
    roots = [site_a, site_b, tmp_path / "missing"]
    tail = [in_torch, "libnvrtc.so.12", "libnvrtc.so"]
    assert rt.nvrtc_candidates(roots, majors=(13, 12)) == [b13, a12, b12, *tail]
    assert rt.nvrtc_candidates(roots, majors=(12, 13)) == [a12, b12, b13, *tail]
    monkeypatch.setattr(rt.ctypes.util, "find_library", lambda name: None)
    assert rt.nvrtc_candidates([tmp_path / "missing"]) == [in_torch, "libnvrtc.so"]


def test_nvrtc_search_defaults(monkeypatch, tmp_path):
    """sys.path is searched by default; torch built for CUDA 12 looks for NVRTC 12 first."""
    lib = _touch(tmp_path / "nvidia/cu13/lib/libnvrtc.so.13")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert os.path.realpath(lib) in rt.nvrtc_candidates()
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    assert rt._torch_majors() == (12, 13)
    for cuda in ("13.0", None):
        monkeypatch.setattr(torch.version, "cuda", cuda)
        assert rt._torch_majors() == (13, 12)


def test_nvrtc_not_available_reason(monkeypatch, tmp_path):
    missing = tmp_path / "libnvrtc.so.13"
    monkeypatch.setenv(rt.NVRTC_ENV, str(missing))  # used alone: no fallback search
    assert not rt.nvrtc_available()
    reason = rt.nvrtc_unavailable_reason()
    assert reason.startswith(f"HISPARSE_NVRTC={missing} could not be loaded (") and "\n" not in reason
    with pytest.raises(rt.CudaRtError, match="NVRTC is not available: HISPARSE_NVRTC=") as err:
        rt.compile_cubin("", arch=(9, 0))
    assert "nvidia-cuda-nvrtc" in err.value.hint

    monkeypatch.delenv(rt.NVRTC_ENV)
    monkeypatch.setattr(rt, "nvrtc_candidates", lambda: ["libnvrtc-hisparse-test-absent.so"])
    rt._nvrtc_lib.cache_clear()
    assert rt.nvrtc_unavailable_reason() == (
        "libnvrtc not found (no nvidia-cuda-nvrtc wheel under sys.path, none in torch/lib or "
        "on the system linker path)")


def test_load_refuses_a_cubin_for_another_arch(monkeypatch):
    monkeypatch.setattr(drv, "device_arch", lambda device: (8, 6))
    compiled = rt.Compiled("k" * 64, b"", {}, (9, 0), (13, 0), "")
    with pytest.raises(rt.CudaRtError, match="cubin is for sm_90 but cuda:0 is sm_86"):
        drv.load_module(compiled, 0)


# --- real NVRTC -----------------------------------------------------------------------------


@needs_nvrtc
@pytest.mark.parametrize("arch", [(8, 0), (9, 0)])
def test_nvrtc_compiles_templates_with_inline_ptx(arch, monkeypatch):
    compiled = rt.compile_cubin(AXPB, arch=arch, name_expressions=AXPB_EXPRS)
    assert compiled.cubin.startswith(b"\x7fELF") and compiled.arch == arch
    assert compiled.lowered == {"axpb<float, 4>": "_Z4axpbIfLi4EEvPT_PKS0_S0_S0_x",
                                "axpb<float, 1>": "_Z4axpbIfLi1EEvPT_PKS0_S0_S0_x"}
    assert compiled.nvrtc_version == rt.nvrtc_version() and compiled.nvrtc_version[0] >= 12
    monkeypatch.setattr(rt, "_MEMO", {})
    monkeypatch.setattr(rt, "_nvrtc_compile", lambda *a: pytest.fail("compiled again"))
    assert rt.compile_cubin(AXPB, arch=arch, name_expressions=AXPB_EXPRS) == compiled


@needs_nvrtc
def test_nvrtc_compiles_the_gpu_tests_kernels():
    """The sources the GPU tests launch assemble (a PTX typo fails here, without a GPU)."""
    for source, arch in ((REVERSE, (8, 0)), (TMA_COPY, (9, 0))):
        assert rt.compile_cubin(source, arch=arch).cubin.startswith(b"\x7fELF")


@needs_nvrtc
def test_nvrtc_options_reach_the_compiler():
    source = "#ifndef WIDTH\n#error WIDTH is not defined\n#endif\n" \
             "extern \"C\" __global__ void k(int* p) { p[0] = WIDTH; }\n"
    assert rt.compile_cubin(source, arch=(9, 0), options=["-DWIDTH=4"]).cubin
    with pytest.raises(rt.KernelCompileError, match="WIDTH is not defined"):
        rt.compile_cubin(source, arch=(9, 0))


@needs_nvrtc
def test_nvrtc_syntax_error_raises_with_the_log():
    source = "\n".join(f"__global__ void k{i}( {{ }}" for i in range(30))
    with pytest.raises(rt.KernelCompileError) as err:
        rt.compile_cubin(source, arch=(9, 0))
    message, log = str(err.value), err.value.log
    assert message.startswith("NVRTC could not compile a kernel for sm_90 "
                              "(NVRTC_ERROR_COMPILATION):\nhisparse_kernel.cu(1): error")
    assert len(message.splitlines()) == 21 < len(log.splitlines())  # the head of the log
    assert log.endswith('errors detected in the compilation of "hisparse_kernel.cu".')
    assert not rt.kernel_cache_dir().exists()  # nothing cached for a failed compile


# --- on a GPU -------------------------------------------------------------------------------


def _cuda_function(source, name, exprs=()):
    device = torch.device("cuda", torch.cuda.current_device())
    compiled = rt.compile_cubin(source, arch=drv.device_arch(device), name_expressions=exprs)
    return drv.load_module(compiled, device).function(name)


@pytest.mark.gpu
@needs_nvrtc
def test_gpu_axpb_launch_and_attributes():
    n, per_thread, block = 1000, 4, 128
    x = torch.randn(n, device="cuda")
    y = torch.full((n + 8,), 7.0, device="cuda")
    fn = _cuda_function(AXPB, "axpb<float, 4>", AXPB_EXPRS)
    fn.launch(math.ceil(n / (block * per_thread)), block, 0,
              [drv.ptr(y), drv.ptr(x), drv.f32(2.5), drv.f32(-1.0), drv.i64(n)])
    torch.cuda.synchronize()
    want = (2.5 * x.double() - 1.0).float()  # one rounding, as fma.rn
    torch.testing.assert_close(y[:n], want, rtol=1e-7, atol=1e-7)
    assert torch.equal(y[n:], torch.full((8,), 7.0, device="cuda"))  # nothing past n
    attrs = fn.attributes()
    assert attrs.registers > 0 and attrs.local_bytes == 0
    assert attrs.max_threads_per_block >= block and attrs.static_shared_bytes == 0


@pytest.mark.gpu
@needs_nvrtc
def test_gpu_dynamic_shared_memory_above_48k():
    seg, blocks = 16384, 3  # 64 KiB a block: above the default 48, within every sm_75+ limit
    x = torch.randn(blocks * seg, device="cuda")
    y = torch.zeros_like(x)
    fn = _cuda_function(REVERSE, "reverse_segments")
    args = [drv.ptr(y), drv.ptr(x), drv.i32(seg)]
    with pytest.raises(drv.CudaDriverError, match="cuLaunchKernel") as err:
        fn.launch(blocks, 256, seg * 4, args)  # above 48 KiB without the attribute
    assert err.value.name == "CUDA_ERROR_INVALID_VALUE"
    fn.set_max_dynamic_shared_memory(seg * 4)
    fn.launch(blocks, 256, seg * 4, args)
    torch.cuda.synchronize()
    assert torch.equal(y.view(blocks, seg), x.view(blocks, seg).flip(1))


@pytest.mark.gpu
@needs_nvrtc
def test_gpu_launch_is_captured_by_cuda_graphs():
    n = 4096
    x = torch.randn(n, device="cuda")
    y = torch.zeros(n, device="cuda")
    fn = _cuda_function(AXPB, "axpb<float, 1>", AXPB_EXPRS)
    args = [drv.ptr(y), drv.ptr(x), drv.f32(3.0), drv.f32(0.5), drv.i64(n)]
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn.launch(n // 256, 256, 0, args)  # torch's capture stream, recorded not run
    torch.cuda.synchronize()
    assert not y.any()
    for _ in range(2):
        x.copy_(torch.randn(n, device="cuda"))
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(y, (3.0 * x.double() + 0.5).float(), rtol=1e-7, atol=1e-7)


@pytest.mark.gpu
@needs_nvrtc
def test_gpu_tma_box_load():
    if drv.device_arch(torch.cuda.current_device()) < (9, 0):
        pytest.skip("the bulk tensor copy (TMA) needs sm_90")
    rows, heads, d, box_rows = 40, 3, 128, 16
    t = torch.randn(rows, heads, d, device="cuda").half()
    tmap = drv.encode_tensor_map(t, dims=(d, heads, rows), strides_bytes=(d * 2, heads * d * 2),
                                box=(d, 1, box_rows))
    fn = _cuda_function(TMA_COPY, "tma_box_copy")
    assert fn.attributes().static_shared_bytes >= box_rows * d * 2
    out = torch.empty(box_rows, d, dtype=torch.float16, device="cuda")
    for r0, h in ((0, 0), (8, 1), (24, 2), (rows - 8, 1)):
        out.fill_(float("nan"))
        fn.launch(1, 128, 0, [tmap, drv.ptr(out), drv.i32(r0), drv.i32(h)])
        torch.cuda.synchronize()
        want = torch.zeros(box_rows, d, dtype=torch.float16, device="cuda")
        inside = min(box_rows, rows - r0)
        want[:inside] = t[r0:r0 + inside, h, :]  # rows past the end read as zeros
        assert torch.equal(out, want), (r0, h)
