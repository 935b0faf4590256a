"""The item INT4 layout (kernels/int4/awq_items.py): single nibbles, scales and zero points placed
by hand against the spec (decode_step.cu item_mma: word ((rt * 2 + kt // 4) * 32 + lane) * 4 + kt % 4,
bits 4 p + 16 h), AWQ <-> items round trips, the reference against the AWQ oracle and a
reading of the words in mma.sync fragment order (_dequant_mma, below), the Triton
dequantize (TRITON_INTERPRET=1 without CUDA) and items_linear. `gpu`: realistic shapes."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():  # must precede the first triton import in this process
    os.environ["TRITON_INTERPRET"] = "1"

from hisparse_cli.kernels.int4 import awq_items  # noqa: E402
from hisparse_cli.kernels.int4.awq_items import (dequantize_items_ref, items_from_awq,  # noqa: E402
                                                 items_to_awq)
from hisparse_cli.kernels.int4.awq_items_linear import dequantize_items, items_linear  # noqa: E402
from hisparse_cli.kernels.int4.awq_pack import pack_int4, quantize_weight  # noqa: E402
from hisparse_cli.kernels.int4.awq_ref import dequantize_weight  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.float16: 4e-3}  # relative to max |y| (test_awq_triton.py)


def random_awq(k: int, n: int, seed: int = 0, device: str = "cpu"):
    """Any bits in qweight/qzeros (every nibble value), fp16 scales of both signs."""
    g = torch.Generator().manual_seed(seed)
    qw = torch.randint(-2**31, 2**31 - 1, (k, n // 8), dtype=torch.int32, generator=g)
    qz = torch.randint(-2**31, 2**31 - 1, (k // 128, n // 8), dtype=torch.int32, generator=g)
    sign = torch.randint(0, 2, (k // 128, n), generator=g) * 2 - 1
    s = (torch.rand(k // 128, n, generator=g) + 0.5) * sign / 64
    return qw.to(device), qz.to(device), s.half().to(device)


def one_code(k: int, n: int, row: int, kk: int, value: int):
    """AWQ tensors with every code 0 but q[K kk, row] = value; zeros 0, scales 1."""
    codes = torch.zeros(k, n, dtype=torch.int64)
    codes[kk, row] = value
    return (pack_int4(codes), torch.zeros(k // 128, n // 8, dtype=torch.int32),
            torch.ones(k // 128, n, dtype=torch.float16))


def signed(v: int) -> int:
    return v - 2**32 if v >= 2**31 else v


# -- the layout, word by word -------------------------------------------------------------------
@pytest.mark.parametrize("tile,j,rt,g,t,kt,pr,pk,h", [
    (0, 0, 0, 0, 0, 0, 0, 0, 0),
    (1, 1, 3, 5, 2, 6, 1, 1, 1),  # row 16 rt + g + 8, K 16 kt + 2 t + 9: bits 28..31
    (1, 0, 7, 7, 3, 7, 1, 0, 1),
    (0, 1, 2, 1, 1, 3, 0, 1, 0),
    (1, 1, 5, 4, 0, 4, 1, 1, 0),
])
def test_single_nibble_lands_where_the_spec_says(tile, j, rt, g, t, kt, pr, pk, h):
    k, n, value = 256, 256, 0xB  # G = 2 groups, T = 2 tiles; 0xB: its top bit set
    row = 128 * tile + 16 * rt + 8 * pr + g
    kk = 128 * j + 16 * kt + 8 * pk + 2 * t + h
    items = items_from_awq(*one_code(k, n, row, kk, value))
    assert items.shape == (4, 2128) and items.dtype == torch.int32
    lane = 4 * g + t
    word = ((rt * 2 + kt // 4) * 32 + lane) * 4 + kt % 4
    bit = 4 * (2 * pk + pr) + 16 * h
    expect = torch.zeros(4, 2048, dtype=torch.int32)
    expect[tile * 2 + j, word] = signed(value << bit)
    assert torch.equal(items[:, :2048], expect)
    assert torch.equal(items[:, 2112:], torch.zeros(4, 16, dtype=torch.int32))


def test_every_word_matches_the_spec():
    """All words of a 256 x 256 linear (4 items) encoded nibble by nibble from the spec's
    formula, against items_from_awq of the same codes."""
    k = n = 256
    codes = torch.randint(0, 16, (k, n), generator=torch.Generator().manual_seed(2))
    items = items_from_awq(pack_int4(codes), torch.zeros(2, n // 8, dtype=torch.int32),
                           torch.ones(2, n, dtype=torch.float16))
    q = codes.tolist()
    for tile in range(2):
        for j in range(2):
            words = items[tile * 2 + j, :2048].tolist()
            for rt in range(8):
                for kt in range(8):
                    for lane in range(32):
                        g, t = divmod(lane, 4)
                        want = 0
                        for p in range(4):
                            for h in range(2):
                                row = 128 * tile + 16 * rt + g + 8 * (p & 1)
                                kk = 128 * j + 16 * kt + 2 * t + 8 * (p >> 1) + h
                                want |= q[kk][row] << (4 * p + 16 * h)
                        word = ((rt * 2 + kt // 4) * 32 + lane) * 4 + kt % 4
                        assert words[word] == signed(want), (tile, j, rt, kt, lane)


@pytest.mark.parametrize("tile,j,rt,g,pr", [(0, 0, 0, 0, 0), (1, 1, 6, 3, 1), (1, 0, 7, 7, 1),
                                             (0, 1, 1, 6, 0)])
def test_scale_and_zero_bytes_where_the_spec_says(tile, j, rt, g, pr):
    k = n = 256
    row = 128 * tile + 16 * rt + 8 * pr + g
    codes = torch.zeros(2, n, dtype=torch.int64)
    codes[j, row] = 0x9
    scales = torch.ones(2, n, dtype=torch.float16)
    scales[j, row] = -3.25
    items = items_from_awq(torch.zeros(k, n // 8, dtype=torch.int32), pack_int4(codes), scales)
    by = items.view(torch.uint8).view(4, 8512)[tile * 2 + j]
    s = by[8192:8448].view(torch.float16)  # [g 8][rt 8][pr 2]
    want_s = torch.ones(128, dtype=torch.float16)
    want_s[(g * 8 + rt) * 2 + pr] = -3.25
    assert torch.equal(s, want_s)
    want_z = torch.zeros(64, dtype=torch.uint8)
    want_z[8 * g + rt] = 0x9 << (4 * pr)  # byte (g, rt): row 16 rt + g low, + 8 high
    assert torch.equal(by[8448:], want_z)
    assert by[:8192].eq(0).all()
    assert set(items.view(4, 2128)[[i for i in range(4) if i != tile * 2 + j], 2112:]
               .unique().tolist()) == {0}


@pytest.mark.parametrize("k,n", [(128, 128), (256, 384), (384, 256)])
def test_round_trip_and_chunking(k, n, monkeypatch):
    qw, qz, s = random_awq(k, n, seed=k + n)
    whole = items_from_awq(qw, qz, s)
    assert whole.shape == ((n // 128) * (k // 128), 2128)
    monkeypatch.setattr(awq_items, "CONVERT_CHUNK_ELEMS", 128 * k)  # one tile a step
    assert torch.equal(items_from_awq(qw, qz, s), whole)
    back = items_to_awq(whole, k, n)
    for got, want in zip(back, (qw, qz, s)):
        assert got.dtype == want.dtype and torch.equal(got, want)


def test_every_item_bit_pattern_round_trips():
    """Items -> AWQ -> items is the identity on arbitrary bits (the maps are bijections),
    the items made as the CUDA benchmark makes them (random words, fp16 scales)."""
    g = torch.Generator().manual_seed(3)
    items = torch.randint(-2**31, 2**31 - 1, (6, 2128), dtype=torch.int32, generator=g)
    items[:, 2048:2112] = (torch.rand(6, 128, generator=g) + 0.5).half().view(torch.int32)
    assert torch.equal(items_from_awq(*items_to_awq(items, 256, 384)), items)


@pytest.mark.parametrize("args,match", [
    (((200, 16), (1, 16), (1, 128)), "in_features % 128"),
    (((256, 17), (2, 17), (2, 136)), "out_features % 128"),
    (((256, 16), (4, 16), (4, 128)), "group size 128"),  # group 64
    (((256, 16), (2, 16), (2, 128), torch.float32), "scales must be fp16"),
])
def test_bad_shapes_raise(args, match):
    qw_shape, qz_shape, s_shape = args[:3]
    s_dtype = args[3] if len(args) > 3 else torch.float16
    with pytest.raises(ValueError, match=match):
        items_from_awq(torch.zeros(qw_shape, dtype=torch.int32),
                       torch.zeros(qz_shape, dtype=torch.int32), torch.ones(s_shape, dtype=s_dtype))
    items = items_from_awq(*random_awq(256, 256))
    with pytest.raises(ValueError, match="items must be"):
        dequantize_items_ref(items, 256, 384)
    with pytest.raises(ValueError, match="column range"):
        dequantize_items_ref(items, 256, 256, 64, 256)


# -- the reference against two oracles --------------------------------------------------------
@pytest.mark.parametrize("k,n", [(128, 256), (384, 256), (256, 384)])
def test_reference_equals_awq_dequantization(k, n):
    qw, qz, s = random_awq(k, n, seed=k * n)
    items = items_from_awq(qw, qz, s)
    oracle = dequantize_weight(qw, qz, s, 128).t()  # awq_pack's unpack: (q - z) s, [out, in]
    assert torch.equal(dequantize_items_ref(items, k, n), oracle)
    assert torch.equal(dequantize_items_ref(items, k, n, 128, 256), oracle[128:256])


def _dequant_mma(it: torch.Tensor, t: int, g: int) -> torch.Tensor:
    """W [K, N] of items [T, G, 2128] read in the decode kernel's mma.sync fragment order
    (decode_step.cu's item_mma; written for the CUDA benchmark kernels that preceded it and
    checked there against their outputs on the H200): words [T, G, rt 8, kt/4 2, lane (gg 8,
    tt 4), kt%4 4]; nibble pair p = 2 pk + pr at bits 4 p (K even) and 16 + 4 p (K odd): row
    16 rt + 8 pr + gg, K 64 kt4 + 16 c + 8 pk + 2 tt + h."""
    w = it[..., :2048].reshape(t, g, 8, 2, 8, 4, 4)[..., None, None, None]
    dev = w.device
    pk = torch.arange(2, device=dev, dtype=torch.int32).view(2, 1, 1)
    pr = torch.arange(2, device=dev, dtype=torch.int32).view(1, 2, 1)
    h = torch.arange(2, device=dev, dtype=torch.int32).view(1, 1, 2)
    q = (w >> (4 * (2 * pk + pr) + 16 * h)) & 15  # [T, G, rt, kt4, gg, tt, c, pk, pr, h]
    q = q.permute(1, 3, 6, 7, 5, 9, 0, 2, 8, 4).reshape(g * 128, t * 128).float()
    s = it[..., 2048:2112].contiguous().view(torch.float16).view(t, g, 8, 8, 2).float()
    zb = it[..., 2112:2128].contiguous().view(torch.uint8).view(t, g, 8, 8, 1).int()
    z = (zb >> (4 * torch.arange(2, device=dev, dtype=torch.int32))) & 15  # [T, G, gg, rt, pr]
    s = s.permute(1, 0, 3, 4, 2).reshape(g, t * 128).repeat_interleave(128, 0)
    z = z.permute(1, 0, 3, 4, 2).reshape(g, t * 128).float().repeat_interleave(128, 0)
    return (q - z) * s


def test_reference_equals_the_mma_fragment_reading():
    """The product must agree with the layout the decode kernel reads: the words read in
    mma.sync fragment order (_dequant_mma), and the kernel's item size."""
    from hisparse_cli.kernels.cuda import cuda_step

    assert cuda_step.ITEM_WORDS == awq_items.ITEM_WORDS
    assert cuda_step.ITEM_BYTES == awq_items.ITEM_BYTES
    k, n = 384, 256
    qw, qz, s = random_awq(k, n, seed=5)
    items = items_from_awq(qw, qz, s)
    w = _dequant_mma(items.view(n // 128, k // 128, 2128), n // 128, k // 128)  # [K, N]
    assert torch.equal(w, dequantize_weight(qw, qz, s, 128))
    assert torch.equal(w.t(), dequantize_items_ref(items, k, n))


# -- Triton dequantize and items_linear (interpreter on CPU) ------------------------------------
@pytest.mark.parametrize("cols", [(0, 384), (128, 256), (256, 384), (0, 128)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_triton_dequantize_equals_reference(cols, dtype):
    k, n = 256, 384
    items = items_from_awq(*random_awq(k, n, seed=11, device=DEV))
    ref = dequantize_items_ref(items, k, n, *cols).to(dtype)
    out = torch.full((cols[1] - cols[0], k + 64), 7.0, dtype=dtype, device=DEV)  # row stride
    w = dequantize_items(items, k, n, *cols, out=out[:, :k])
    assert w.data_ptr() == out.data_ptr() and torch.equal(w, ref)
    assert out[:, k:].eq(7.0).all()  # nothing written past the rows' K
    if dtype == torch.float16:
        assert torch.equal(dequantize_items(items, k, n, *cols), ref)


@pytest.mark.parametrize("block_rt", [1, 2, 4])
def test_triton_dequantize_row_blocks(block_rt):
    from hisparse_cli.kernels.int4.awq_items_triton import dequant_items_launch

    k, n = 128, 256
    items = items_from_awq(*random_awq(k, n, seed=block_rt, device=DEV))
    out = torch.empty(n, k, dtype=torch.float16, device=DEV)
    dequant_items_launch(items, 1, 0, 2, out, block_rt=block_rt)
    assert torch.equal(out, dequantize_items_ref(items, k, n).half())


@pytest.mark.parametrize("m", [1, 7, 64])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("triton", [True, False])
def test_items_linear(m, dtype, triton):
    if not triton and DEV == "cuda":
        pytest.skip("the reference path is the CPU fallback")
    k, n = 256, 384
    p = quantize_weight(torch.randn(n, k, generator=torch.Generator().manual_seed(m)) / 16, 128)
    items = items_from_awq(p.qweight, p.qzeros, p.scales).to(DEV)
    x = torch.randn(2, m, k).to(dtype).to(DEV)
    b = (torch.randn(n) * 0.1).to(dtype).to(DEV)
    w = dequantize_items_ref(items, k, n)  # fp32 [n, k]
    want = x.float() @ w.t() + b.float()
    for chunk in (None, 128, 256):  # one chunk; three; a full one and a partial one
        y = items_linear(x, items, k, n, b, chunk_cols=chunk, triton=triton)
        assert y.shape == (2, m, n) and y.dtype == dtype
        err = float((y.float() - want).abs().max() / want.abs().max())
        assert err <= TOL[dtype], f"relative error {err:.2e} (chunk {chunk})"
    y = items_linear(x[0], items, k, n, triton=triton)
    err = float((y.float() - (x[0].float() @ w.t())).abs().max() / want.abs().max())
    assert y.shape == (m, n) and err <= TOL[dtype]
    with pytest.raises(ValueError, match="chunk_cols"):
        items_linear(x, items, k, n, chunk_cols=192, triton=triton)


@pytest.mark.parametrize("m,chunk", [(1, None), (33, None), (33, 128)])
def test_prepared_items_linear_equals_items_linear(m, chunk, monkeypatch):
    """The prepared form (checks once, dequantize launches replayed from CUDA graphs on CUDA)
    gives items_linear's values exactly: the same dequantized W^T into the same matmul;
    repeated calls replay the captured graphs and still agree."""
    from hisparse_cli.kernels.int4 import awq_items_triton as t

    k, n = 256, 384
    items = items_from_awq(*random_awq(k, n, seed=m, device=DEV))
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).half().to(DEV)
    b = (torch.randn(n, generator=torch.Generator().manual_seed(1)) * 0.1).half().to(DEV)
    if chunk is not None:  # three chunks of W^T rows, the last one partial
        monkeypatch.setattr(t, "dequant_chunk", lambda k_, n_, e_: chunk)
    prep = t.PreparedItemsLinear(items, k, n, b)
    want = items_linear(x, items, k, n, b, chunk_cols=chunk, triton=True)
    for _ in range(3):  # capture, then replays
        assert torch.equal(prep(x), want)
    assert torch.equal(prep(x.view(1, m, k)), want.view(1, m, n))
    if DEV == "cuda":  # one graph per chunk (the workspace comes back at the same address)
        from hisparse_cli.kernels.int4.awq_triton import GRAPHS_PER_LINEAR

        assert 1 <= len(prep.graphs) <= GRAPHS_PER_LINEAR
    with pytest.raises(ValueError, match="x must be"):
        prep(torch.zeros(m, k + 1, dtype=torch.float16, device=DEV))
    with pytest.raises(ValueError, match="bias"):
        t.PreparedItemsLinear(items, k, n, b[:-1])


_COMPILE = """
import sys
sys.path.insert(0, 'benchmarks')
import sm90_compile as c
from hisparse_cli.kernels.int4 import awq_items_triton as t
for dt in ('*fp16', '*bf16'):
    k = c.compile_one(t._dequant_items_kernel, dict(it_ptr='*i32', s_ptr='*fp16', z_ptr='*u8',
                      w_ptr=dt, G='i32', tile0='i32', stride_wn='i32', sc_ptr=dt,
                      stride_sc='i32'),
                      dict(ITEM=2128, SCALES=2048, ZEROS=2112, BLOCK_RT=t.BLOCK_RT),
                      t.NUM_WARPS, ('it_ptr', 's_ptr', 'z_ptr', 'w_ptr', 'stride_wn'), stages=1)
    c.report(dt, k, None)
"""


@pytest.mark.slow
def test_triton_dequantize_compiles_for_sm90():
    """What the interpreter cannot say: the kernel (its 6-D register permutation included)
    goes through Triton's compiler and ptxas for sm_90 (no GPU needed), without spills, with
    16-byte loads and stores."""
    import subprocess

    import triton

    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("no ptxas in this Triton")
    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(root)
    out = subprocess.run([sys.executable, "-c", _COMPILE], cwd=root, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("*")]
    assert len(lines) == 2, out.stdout
    for ln in lines:
        assert " stack 0 local 0 " in ln and "LDG.128 0 " not in ln and "STG.128 0 " not in ln, ln


# -- GPU ------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("k,n", [(4096, 14336), (14336, 4096)])
def test_triton_dequantize_llama_shapes(k, n):
    qw, qz, s = random_awq(k, n, seed=1, device="cuda")
    items = items_from_awq(qw, qz, s)
    assert torch.equal(items.cpu(), items_from_awq(qw.cpu(), qz.cpu(), s.cpu()))
    ref = dequantize_weight(qw, qz, s, 128).t()  # the AWQ oracle, fp32 [n, k]
    assert torch.equal(dequantize_items_ref(items, k, n), ref)
    assert torch.equal(dequantize_items(items, k, n), ref.half())
    assert torch.equal(dequantize_items(items, k, n, 1024, 3072), ref[1024:3072].half())
    out = torch.empty(2048, k, dtype=torch.bfloat16, device="cuda")
    assert torch.equal(dequantize_items(items, k, n, n - 2048, n, out=out),
                       ref[n - 2048:].bfloat16())


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 64, 512])
def test_items_linear_cuda(m):
    k, n = 4096, 14336
    p = quantize_weight(torch.randn(n, k, device="cuda") / 64, 128)
    items = items_from_awq(p.qweight, p.qzeros, p.scales)
    x = torch.randn(m, k, device="cuda").half()
    want = x.float() @ dequantize_weight(p.qweight, p.qzeros, p.scales, 128)
    for chunk in (None, 2048):
        y = items_linear(x, items, k, n, chunk_cols=chunk)
        err = float((y.float() - want).abs().max() / want.abs().max())
        assert y.dtype == torch.float16 and err <= TOL[torch.float16], err
