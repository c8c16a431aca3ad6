"""Op families, mirroring kernels/: one module per family."""
from .elementwise import add_mul_exp, add_relu, fma, mul_tanh

__all__ = ["add_relu", "mul_tanh", "add_mul_exp", "fma"]
