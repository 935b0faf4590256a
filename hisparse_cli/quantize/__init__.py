"""`hisparse quantize`: AWQ INT4 quantization of a Llama-family model, calibrated on the
user's own documents, written in the AutoAWQ "GEMM" checkpoint layout.

    search.py       the AWQ scale search and clip search (pure tensor functions)
    layerwise.py    layer-by-layer driver over our forward pass (hooks, folding, packing)
    calibration.py  documents -> token blocks
    export.py       the output folder (safetensors, config.json, tokenizer files)
    api.py          quantize_model(...) -> QuantizeReport
"""
