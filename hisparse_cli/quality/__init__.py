"""Summary quality under sparsity: how much a sparse KV policy changes what the model computes
and writes, measured against the dense run of the same model on the same tokens.

    settings.py     spec strings ("w1024-g64", "window=512,importance=snapkv") -> SparseConfig
    dataset.py      evaluation documents, truncation, the teacher-forced token layout
    capture.py      teacher-forced runs through the engine with q/k/globals captured
    metrics.py      attention recall, KL / top-1 / perplexity (pure torch)
    harness.py      documents x settings -> rows (+ summaries and ROUGE through the pipeline)
    aggregate.py    per-setting means, bootstrap intervals, paired ROUGE deltas, the goal
    report.py       Markdown + JSON + PNG
    probe.py        the learned importance probe (model, safetensors I/O, shipped-probe lookup)
    probe_train.py  distilling the probe from the model's attention
"""
