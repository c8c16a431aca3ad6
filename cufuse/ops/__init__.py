"""Op families, mirroring kernels/: one module per family."""
from .elementwise import add_mul_exp, add_relu, bias_gelu, fma, gelu_dropout, mul_tanh
from .quantize import dequantize_int8, quantize_int8

__all__ = ["add_relu", "mul_tanh", "add_mul_exp", "fma", "bias_gelu", "gelu_dropout",
           "quantize_int8", "dequantize_int8"]
