"""Slow: AWQ on the embedded SmolLM2-135M, calibrated on the first 75% of every samples/
document, scored on the held-out rest. AWQ must not be worse than round-to-nearest INT4 of
the same group size (64: SmolLM2's hidden size 576 is not a multiple of 128)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.slow

GROUP = 64


@pytest.fixture(scope="module")
def smollm2():
    from hisparse_cli.errors import ModelError
    from hisparse_cli.hub.resolve import resolve_model

    try:
        return resolve_model(None)
    except ModelError as exc:
        pytest.skip(f"embedded model unavailable: {exc}")


def test_awq_perplexity_not_worse_than_rtn(smollm2, tmp_path):
    from transformers import AutoTokenizer

    from hisparse_cli.model.loader import load_model
    from hisparse_cli.quantize.api import quantize_model
    from hisparse_cli.quantize.calibration import default_calibration_texts
    from hisparse_cli.quantize.evaluate import perplexity, split_texts, token_windows

    calib, held = split_texts(default_calibration_texts())
    windows = token_windows(AutoTokenizer.from_pretrained(str(smollm2)), held, 512)
    fp, _ = load_model(smollm2, "cpu", torch.float32)
    ppl = {"fp": perplexity(fp, windows)[0]}
    del fp
    for method in ("rtn", "awq"):
        quantize_model(smollm2, tmp_path / method, calib_texts=calib, group_size=GROUP,
                       n_samples=8, seq_len=512, method=method)
        q, _ = load_model(tmp_path / method, "cpu", torch.float32)
        ppl[method] = perplexity(q, windows)[0]
    print(f"held-out perplexity, group {GROUP}: {ppl}")
    assert ppl["fp"] < ppl["rtn"]  # INT4 costs something on a 135M model
    assert ppl["awq"] <= ppl["rtn"], ppl
    assert ppl["awq"] < 1.5 * ppl["fp"], ppl  # and stays usable
