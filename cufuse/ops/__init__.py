"""Op families, mirroring kernels/: one module per family."""
from .attention import attention, attention_score
from .cross_entropy import cross_entropy, linear_cross_entropy
from .elementwise import add_mul_exp, add_relu, bias_gelu, fma, gelu_dropout, mul_tanh
from .norm import add_layer_norm, add_rms_norm, layer_norm, layer_norm_relu, log_softmax, rms_norm, softmax
from .quantize import dequantize_int8, fake_quantize_int8, quantize_int8
from .reduction import mean_abs, sum_squared
from .rope import rope
from .scatter import scatter_add

__all__ = ["add_relu", "mul_tanh", "add_mul_exp", "fma", "bias_gelu", "gelu_dropout",
           "quantize_int8", "dequantize_int8", "fake_quantize_int8", "sum_squared", "mean_abs", "layer_norm",
           "layer_norm_relu", "rms_norm", "add_rms_norm", "add_layer_norm", "softmax", "log_softmax", "cross_entropy", "linear_cross_entropy",
           "rope", "scatter_add", "attention", "attention_score"]
