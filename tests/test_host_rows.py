"""kernels/cuda/host_rows.py: the zero-copy gather of embedding rows from a host-resident table.
Oracle: torch indexing `table[ids]`. On the CPU the kernel runs under the Triton interpreter;
on CUDA it reads a table registered with cudaHostRegister (`gpu` tests)."""

from __future__ import annotations

import gc
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

CPU = not torch.cuda.is_available()


@pytest.mark.parametrize("hidden,ids,dtype,out_dtype", [
    (64, [3, 0, 3, 9], torch.float32, torch.float32),
    (1500, [7], torch.float16, torch.float16),  # two column tiles, the second partial
    (96, [1, 2], torch.float16, torch.float32),  # converted to out's dtype
])
def test_gather_equals_indexing_on_cpu(hidden, ids, dtype, out_dtype):
    if not CPU:
        pytest.skip("CPU test: the Triton interpreter is only enabled without CUDA")
    from hisparse_cli.kernels.cuda.host_rows import gather_rows

    table = torch.randn(10, hidden, generator=torch.Generator().manual_seed(hidden)).to(dtype)
    idx = torch.tensor(ids, dtype=torch.int64)
    out = torch.full((len(ids), hidden), float("nan"), dtype=out_dtype)
    assert gather_rows(table, idx, out) is out
    assert torch.equal(out, table[idx].to(out_dtype))


def test_map_table_needs_cuda_and_a_plain_tensor():
    from hisparse_cli.kernels.cuda.host_rows import is_mapped, map_table

    t = torch.zeros(4, 8)
    if CPU:
        assert not map_table(t) and not is_mapped(t)
    assert not map_table(t[:, :4])  # not contiguous
    assert not map_table(t[1:])  # a view into memory it does not own from the start


@pytest.mark.gpu
@pytest.mark.skipif(CPU, reason="needs CUDA")
def test_registered_table_is_read_by_the_device():
    """A registered CPU table, gathered at CUDA ids into a CUDA buffer (the rows cross PCIe
    inside the kernel); the registration ends when the tensor is collected."""
    from hisparse_cli.kernels.cuda import host_rows

    table = torch.randn(1000, 4096, generator=torch.Generator().manual_seed(0)).half()
    assert host_rows.map_table(table) and host_rows.is_mapped(table)
    assert host_rows.map_table(table)  # idempotent
    ids = torch.tensor([999, 0, 17, 17], device="cuda")
    out = torch.empty(4, 4096, dtype=torch.float16, device="cuda")
    host_rows.gather_rows(table, ids, out)
    torch.cuda.synchronize()
    assert torch.equal(out.cpu(), table[ids.cpu()])
    ptr = table.data_ptr()
    del table
    gc.collect()
    assert ptr not in host_rows._MAPPED


@pytest.mark.gpu
@pytest.mark.skipif(CPU, reason="needs CUDA")
def test_loader_maps_a_host_table_for_cuda_runs(tmp_path):
    from conftest import save_tiny

    from hisparse_cli.kernels.cuda.host_rows import is_mapped
    from hisparse_cli.model.loader import load_model

    path, hf = save_tiny(tmp_path, "llama")
    model, _ = load_model(path, "cuda", torch.float16, embeddings_on_host=True, fuse=True)
    w = model.model.embed_tokens.weight
    assert w.device.type == "cpu" and is_mapped(w)
    assert torch.equal(w, hf.model.embed_tokens.weight.detach().half())
