"""benchmarks/gpu_cluster_probe.py: its kernel (benchmarks/cuda/cluster_probe.cu, ring.cuh
inlined) builds with NVRTC for sm_90 at every cluster size the probe asks for, and the source
it hands NVRTC is self-contained. The GPU run itself checks the DSMEM exchange's values."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def _probe():
    spec = importlib.util.spec_from_file_location("gpu_cluster_probe",
                                                  BENCH / "gpu_cluster_probe.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gpu_cluster_probe"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_probe_source_is_self_contained():
    src = _probe().source()
    assert '#include "ring.cuh"' not in src and "red_release_add" in src
    assert "__cluster_dims__(CL, 1, 1)" in src


@pytest.mark.parametrize("cl", [1, 2, 4, 8, 16])
def test_probe_builds_for_sm90(cl, tmp_path, monkeypatch):
    from hisparse_cli.kernels.cuda import cuda_rt

    if not cuda_rt.nvrtc_available():
        pytest.skip("no libnvrtc found (HISPARSE_NVRTC points at one)")
    monkeypatch.setenv("HISPARSE_HOME", str(tmp_path))
    compiled = _probe().build(cl, (9, 0))
    assert compiled.cubin[:4] == b"\x7fELF"
