"""Sampling kernels: the greedy pick (argmax_triton.py) and the kernels of the greedy sampler
inside the decode graph (graph_sampler.py)."""
