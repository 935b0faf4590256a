"""Programmatic dependent launch (kernels/pdl.py): where it is on, and on sm_90 that a PDL
GEMV reads x only after the kernel writing it has finished (a producer that triggers its
dependents at once and writes x last), eagerly and replayed from a CUDA graph.

Without CUDA: the switch is off and a pdl config gives the plain config's bits (interpreter);
a --slow test compiles the GEMV and the producers for sm_90 and checks the griddepcontrol
instructions are where kernels/pdl.py says.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():  # must precede the first triton import in this process
    os.environ["TRITON_INTERPRET"] = "1"

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from hisparse_cli.kernels import pdl  # noqa: E402
from hisparse_cli.kernels.int4 import awq_gemv  # noqa: E402
from hisparse_cli.kernels.int4 import awq_layout  # noqa: E402
from hisparse_cli.kernels.int4.awq_layout import GemvConfig  # noqa: E402
from hisparse_cli.kernels.pdl import gdc_launch_dependents  # noqa: E402
from test_awq_triton import case_k, check  # noqa: E402

CPU = not torch.cuda.is_available()
ROOT = Path(__file__).resolve().parents[1]


def test_pdl_off_on_cpu_and_by_env(monkeypatch):
    assert not pdl.pdl_enabled(torch.device("cpu"))
    monkeypatch.setenv("HISPARSE_PDL", "0")
    assert not pdl.pdl_enabled(torch.device("cuda", 0))  # the switch wins before any probe
    assert "launch_pdl" not in pdl.chain_args(torch.device("cuda", 0))


def test_chain_args_wait_whenever_launched_with_pdl(monkeypatch):
    """launch_pdl only ever comes with PDL_WAIT (a consumer that did not wait could read
    what the previous kernel has not written yet); where PDL is on, the kernel also triggers
    its dependents."""
    assert pdl.chain_args(torch.device("cpu")) == {"PDL_WAIT": False, "PDL_TRIGGER": False}
    monkeypatch.setattr(pdl, "pdl_enabled", lambda device: True)
    args = pdl.chain_args(torch.device("cuda", 0))
    assert args.get("launch_pdl", False) == args["PDL_WAIT"] is True
    assert args["PDL_TRIGGER"] is True


@pytest.mark.skipif(not CPU, reason="interpreter test")
@pytest.mark.parametrize("prefetch", [0, 1])
@pytest.mark.parametrize("m,split", [(1, 1), (4, 2)])
def test_pdl_config_same_bits_without_pdl(prefetch, m, split):
    """Off sm_90 a pdl config launches the plain kernel: the same bits."""
    x, qw, qt, qz, s, b = case_k(m, 4 * 128, 64, 128, torch.float16, "cpu", seed=m)
    cfg = GemvConfig(block_n=32, block_kw=16, split=split, num_warps=1, num_stages=1,
                     prefetch=prefetch, packed=2)
    y = awq_gemv.awq_gemv_k(x, qt, qz, s, b, 128, config=replace(cfg, pdl=1))
    assert torch.equal(y, awq_gemv.awq_gemv_k(x, qt, qz, s, b, 128, config=cfg))
    check(y, x, qw, qz, s, b, 128)


def test_gemv_config_pdl_field():
    with pytest.raises(ValueError, match="pdl"):
        GemvConfig(block_n=32, block_kw=16, split=1, num_warps=2, num_stages=1, pdl=2)
    tile = awq_layout.GEMV_TABLE["small_n"]
    cfg = awq_layout.gemv_config(1, 4096, 4096, 128, 132)
    assert cfg.pdl == tile.pdl  # the table's choice reaches the launch


_COMPILE = """
import sys
sys.path.insert(0, 'benchmarks')
import sm90_compile as c
from hisparse_cli.kernels.int4 import awq_gemv as ag
from hisparse_cli.kernels.norm_rope import norm_rope_triton as nr
from hisparse_cli.kernels.attention import store_kv_triton as sk
for pdl in (False, True):
    for pf in (0, 1):
        k = c.compile_one(ag._awq_gemv_kernel, c.GEMV_SIG, dict(
            GROUP=128, M=1, BLOCK_N=64, BLOCK_KW=16, NUM_STAGES=1, HAS_BIAS=False, SPLIT=4,
            PREFETCH=pf, STREAM=2, PACKED=2, ASM=True, PDL=pdl, PDL_TRIGGER=pdl),
            2, c.GEMV_ALIGNED)
        ptx = k.asm['ptx']
        print('gemv', pdl, pf, ptx.count('griddepcontrol.wait'),
              ptx.count('griddepcontrol.launch_dependents'))
    k = c.compile_one(nr._silu_mul, dict(gu_ptr='*fp16', INTER='i32', stride_t='i32'),
                      dict(BLOCK=1024, PDL_WAIT=pdl, PDL_TRIGGER=pdl), 4, ('gu_ptr',))
    print('silu', pdl, k.asm['ptx'].count('griddepcontrol.wait'),
          k.asm['ptx'].count('griddepcontrol.launch_dependents'))
    k = c.compile_one(nr._rms_norm, dict(x_ptr='*fp16', y_ptr='*fp16', w_ptr='*fp16',
                      out_ptr='*fp16', sum_ptr='*fp16', R='i32', B='i32', sxa='i32', sxb='i32',
                      sya='i32', syb='i32', eps='fp32'),
                      dict(H=4096, BLOCK_H=4096, ROWS=1, HAS_RES=True, PDL_WAIT=pdl,
                           PDL_TRIGGER=pdl), 8, ('x_ptr',))
    print('norm', pdl, k.asm['ptx'].count('griddepcontrol.wait'),
          k.asm['ptx'].count('griddepcontrol.launch_dependents'))
    k = c.compile_one(sk._store_kv, dict(k_ptr='*fp16', v_ptr='*fp16', kc_ptr='*fp16',
                      vc_ptr='*fp16', slot_ptr='*i64', stride_kt='i32', stride_kh='i32',
                      stride_vt='i32', stride_vh='i32', stride_cb='i32', stride_cs='i32',
                      stride_ch='i32'), dict(HKV=8, H_PAD=8, D=128, BS=16, PDL_WAIT=pdl,
                                             PDL_TRIGGER=pdl), 4, ('k_ptr',))
    print('store_kv', pdl, k.asm['ptx'].count('griddepcontrol.wait'),
          k.asm['ptx'].count('griddepcontrol.launch_dependents'))
"""


@pytest.mark.slow
def test_pdl_instructions_compile_for_sm90():
    """sm_90 PTX: a PDL GEMV waits exactly once (after its first weight loads, before x) and
    triggers once; a plain one has no griddepcontrol at all; the chain kernels wait and
    trigger once each when asked to, and not otherwise."""
    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("no ptxas in this Triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    out = subprocess.run([sys.executable, "-c", _COMPILE], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    got = {tuple(ln.split()[:-2]): ln.split()[-2:] for ln in out.stdout.splitlines()}
    for pf in ("0", "1"):
        assert got[("gemv", "False", pf)] == ["0", "0"], out.stdout
        assert got[("gemv", "True", pf)] == ["1", "1"], out.stdout
    for kern in ("silu", "norm", "store_kv"):
        assert got[(kern, "False")] == ["0", "0"], out.stdout
        assert got[(kern, "True")] == ["1", "1"], out.stdout


# -- sm_90: the wait holds x back until the producer is done -------------------------------
needs_pdl = pytest.mark.skipif(CPU or not pdl.pdl_enabled(torch.device("cuda")),
                               reason="needs CUDA sm_90+ with PDL")


@triton.jit
def _late_writer(src_ptr, dst_ptr, n, spin, BLOCK: tl.constexpr):
    """Triggers its dependents at once, spins, then copies src to dst: a PDL consumer that
    read dst before waiting would see the old contents."""
    gdc_launch_dependents()
    acc = tl.program_id(0).to(tl.float32)
    for _ in range(spin):
        acc = acc * 0.999 + 1.0
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(src_ptr + offs, mask=offs < n)
    v = tl.where(acc < 0.0, v + 1.0, v)  # keeps the spin (acc is never negative)
    tl.store(dst_ptr + offs, v, mask=offs < n)


@pytest.mark.gpu
@needs_pdl
@pytest.mark.parametrize("prefetch", [0, 1])
@pytest.mark.parametrize("m,k,n", [(1, 4096, 4096), (1, 4096, 28672), (4, 14336, 4096)])
def test_pdl_gemv_waits_for_its_producer(prefetch, m, k, n):
    """The first K step's weights are loaded before the wait; x only after it."""
    x, qw, qt, qz, s, b = case_k(m, k, n, 128, torch.float16, "cuda", seed=k + n)
    sms = awq_gemv._sm_count(x.device)
    cfg = replace(awq_layout.gemv_config(m, k, n, 128, sms), prefetch=prefetch)
    want = awq_gemv.awq_gemv_k(x, qt, qz, s, b, 128, config=replace(cfg, pdl=0))
    check(want, x, qw, qz, s, b, 128)
    buf = torch.full_like(x, float("nan"))

    def step():
        buf.fill_(float("nan"))  # stale contents a racing read would pick up
        _late_writer[(triton.cdiv(x.numel(), 1024),)](x, buf, x.numel(), 20000, BLOCK=1024)
        return awq_gemv.awq_gemv_k(buf, qt, qz, s, b, 128, config=replace(cfg, pdl=1))

    def close(y):  # a read of the stale NaNs would show; the peeled first step may contract
        # other products into FMAs than the plain loop, so not always the same bits
        return bool(torch.isfinite(y).all()) and float((y.float() - want.float()).abs().max()) \
            <= 1e-3 * float(want.float().abs().max())

    for _ in range(3):  # eager
        assert close(step())
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = step()
    for _ in range(5):  # replayed: the programmatic edge survives capture
        out.fill_(0)
        g.replay()
        torch.cuda.synchronize()
        assert close(out)


def test_profile_critical_path_charges_overlap_once():
    """benchmarks/gpu_decode.py profile: with PDL a kernel's profiled span starts at its early
    launch, inside its predecessor's; the critical-path attribution charges each instant of
    device time to one kernel, so the parts add up to the busy time (gaps excluded)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from gpu_decode import exclusive_us

    spans = [("gemv", 5.0, 12.0), ("norm", 0.0, 10.0), ("rope", 12.0, 15.0),
             ("gemv", 20.0, 21.0), ("tiny", 13.0, 14.0)]  # inside rope: charged nothing
    got = exclusive_us(spans)
    assert got == {"norm": 10.0, "gemv": 3.0, "rope": 3.0, "tiny": 0.0}
    assert sum(got.values()) == 16.0  # the union of the spans
