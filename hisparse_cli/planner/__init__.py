"""The memory planner: what a run allocates, summed before anything loads (memory.py: the
weights, the components' declared buffers, and the run's steps replayed with the engine's own
host policy), what to change when it does not fit (suggest.py), its rendering, and VRAM budget
enforcement (vram.py)."""
