"""CUDA C++ kernels compiled at run time (NVRTC: cuda_rt.py; driver launches: cuda_launch.py):
the persistent decode step (decode_step.cu + cuda_step.py) and the host-mapped embedding-row
gather (host_rows.py)."""
