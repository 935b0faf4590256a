"""Embedding rows read by the GPU straight out of a host-resident table (zero-copy gather).

The tight-VRAM option (`embeddings_on_host`, the 6 GiB profiles) keeps the input embedding
table in host memory: 1 GiB for Llama-3-8B. Each decode step needs one row of it, chosen by
the token the device just sampled. Without this module the host has to learn that token first
(`.item()`: one wait for the GPU a token, which also stalls the CUDA-graph decode loop's
lookahead), then copy the row over. Here the table is page-locked and mapped for the device
(`cudaHostRegister`; under unified addressing a kernel reads it at its host address), and
`gather_rows` copies the rows of device-resident ids into a device buffer over PCIe, inside the
captured graph: the token never goes to the host (8 KiB a token for an 8B model).

`map_table(t)`: register a CPU parameter's memory for device access (the loader calls it for a
host table when the run's device is CUDA); False where that is not possible (no CUDA, a
non-contiguous tensor, the driver refused), and the engine keeps the host-read path.
`is_mapped(t)`: whether t's memory is registered. The registration ends when the tensor object
is collected (not at interpreter exit, when the CUDA context may be gone).

Oracle: `table[ids]` (tests/test_host_rows.py: the interpreter on the CPU, a registered table on
CUDA; tests/test_cuda_graph.py: graph decode with a host table equals the eager loop and reads
tokens back only every 16 steps).
"""

from __future__ import annotations

import weakref

import torch
import triton
import triton.language as tl

_MAPPED: dict[int, int] = {}  # data_ptr -> nbytes of registered tables


@triton.jit
def _gather_rows(table_ptr, ids_ptr, out_ptr, H, stride_t, stride_o, BLOCK: tl.constexpr):
    """out[r, c] = table[ids[r], c] for one row r and BLOCK columns c (program (r, c tile))."""
    r = tl.program_id(0)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = c < H
    i = tl.load(ids_ptr + r).to(tl.int64)
    v = tl.load(table_ptr + i * stride_t + c, mask=ok)
    tl.store(out_ptr + r * stride_o + c, v.to(out_ptr.dtype.element_ty), mask=ok)


def gather_rows(table: torch.Tensor, ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out [R, H] (device) <- table[ids] for ids [R] int (device) and table [V, H] (host
    memory registered by map_table, read by the device; any memory the kernel can read under
    the CPU interpreter). Rows are converted to out's dtype. Returns out."""
    assert table.dim() == 2 and table.stride(1) == 1, table.shape
    assert out.dim() == 2 and out.stride(1) == 1 and out.shape == (ids.numel(), table.shape[1])
    assert not ids.is_floating_point() and ids.is_contiguous()
    h = table.shape[1]
    block = min(1024, triton.next_power_of_2(h))
    _gather_rows[(ids.numel(), triton.cdiv(h, block))](
        table, ids, out, h, table.stride(0), out.stride(0), BLOCK=block, num_warps=4)
    return out


def is_mapped(t: torch.Tensor) -> bool:
    """Whether t's memory is a table registered by map_table (CPU tensors only)."""
    return t.device.type == "cpu" and _MAPPED.get(t.data_ptr()) == t.untyped_storage().nbytes()


def _code(err) -> int:
    """A cudaError from torch.cuda.cudart() as an int (an enum, or an int, by version)."""
    return int(getattr(err, "value", err))


def map_table(t: torch.Tensor) -> bool:
    """Page-lock and map t (a contiguous CPU tensor that owns its memory, e.g. a parameter the
    loader made) for device access; True when it is (or already was) registered."""
    if is_mapped(t):
        return True
    if (t.device.type != "cpu" or not t.is_contiguous() or t.storage_offset() != 0
            or not torch.cuda.is_available() or torch.version.hip is not None):
        return False
    try:
        cudart = torch.cuda.cudart()
        ptr, nbytes = t.data_ptr(), t.untyped_storage().nbytes()
        err = _code(cudart.cudaHostRegister(ptr, nbytes, 0))  # default: mapped + portable
    except Exception:  # noqa: BLE001 - no cudart binding, no driver: keep the host path
        return False
    if err != 0:
        try:
            torch.cuda.cudart().cudaGetLastError()  # clear the sticky-free error state
        except Exception:  # noqa: BLE001
            pass
        return False
    _MAPPED[ptr] = nbytes
    # the memory must stay registered while it is alive and be unregistered before it is
    # freed: the finalizer holds the storage (not the tensor, whose collection it waits for)
    fin = weakref.finalize(t, _unmap, ptr, t.untyped_storage())
    fin.atexit = False
    return True


def _unmap(ptr: int, storage) -> None:
    _MAPPED.pop(ptr, None)
    try:
        torch.cuda.cudart().cudaHostUnregister(ptr)
    except Exception:  # noqa: BLE001 - a torn-down context: nothing left to release
        pass
    del storage  # the memory may be freed from here
