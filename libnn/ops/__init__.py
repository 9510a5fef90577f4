"""Ops: one module per op, each holding its signature, shape checks and paths side by side."""

from libnn.ops.argmax import argmax
from libnn.ops.attention import attention
from libnn.ops.conv2d import conv2d
from libnn.ops.embedding import embedding
from libnn.ops.fft_conv import fft_conv1d, fft_conv2d
from libnn.ops.kv_append import kv_append
from libnn.ops.layer_norm import layer_norm
from libnn.ops.linear import linear
from libnn.ops.linear_fp8 import linear_fp8
from libnn.ops.pool2d import avg_pool2d, max_pool2d
from libnn.ops.rms_norm import rms_norm
from libnn.ops.rms_norm_linear import rms_norm_linear
from libnn.ops.rope import rope, rope_frequencies
from libnn.ops.softmax import softmax
from libnn.ops.swiglu import swiglu

__all__ = ["attention", "linear", "conv2d", "max_pool2d", "avg_pool2d", "fft_conv2d", "fft_conv1d", "softmax",
           "layer_norm", "rms_norm", "embedding", "rope", "rope_frequencies", "swiglu",
           "kv_append", "linear_fp8", "rms_norm_linear", "argmax"]
