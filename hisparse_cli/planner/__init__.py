"""The memory planner: what a run allocates, summed before anything loads (memory.py), its
suggestions, the plan of a document (document.py) and its rendering; VRAM budget enforcement
(vram.py)."""
