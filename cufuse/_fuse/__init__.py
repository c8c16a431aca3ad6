"""The composition engine: ``cufuse.fuse`` traces a Python function over
symbolic arrays and generates one functor for the elementwise driver.

graph.py (trace -> typed graph), functions.py (cufuse.exp, cufuse.where, ...),
codegen.py (graph -> CUDA source), numpy_eval.py (graph -> NumPy, the
fallback), api.py (signatures, caches, launches, horizontal fusion).
"""
from .api import Fused, fuse
from .functions import PUBLIC
from .graph import TraceError

__all__ = ["Fused", "fuse", "TraceError", "PUBLIC"]
