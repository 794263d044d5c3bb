"""Put on PYTHONPATH of a child process that imports numba-cuda's kernel compiler.

numba-cuda 0.x registers typing for np.row_stack, which NumPy 2.5 removed, so on such an
installation `from numba import cuda` fails before any memory manager is involved. The alias
(row_stack was always vstack) lets kernels compile there; the code under test is unchanged.
"""
import numpy as np

if not hasattr(np, "row_stack"):
    np.row_stack = np.vstack
