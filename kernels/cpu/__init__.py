"""Native CPU kernels: the decode step in C (decode.c), built at run time with the machine's C
compiler and loaded through ctypes (native.py); the torch path is the fallback."""
