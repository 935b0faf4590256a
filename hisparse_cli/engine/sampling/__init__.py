"""Sampling the next token, one package for every decode loop: on the host for eager decodes
(host.py: `Sampler`), on the device between CUDA-graph replays (device.py: `DeviceSampler`),
and inside the captured decode graph for greedy decodes (graph.py: `GraphSampler`, whose
kernels are kernels/sampling/graph_sampler.py). The execution plan says which one a run uses
(config/execution.py)."""
