"""Layers for inference, in the PyTorch style: parameters by name, state_dict keys PyTorch uses."""

from libnn.nn.activation import GELU, ReLU, ReLU6, SiLU
from libnn.nn.basic import Dropout, Embedding, Flatten, LogSoftmax, Softmax
from libnn.nn.conv import Conv2d, Conv2dBNAct
from libnn.nn.graphs import GraphedModule
from libnn.nn.linear import Linear
from libnn.nn.module import Module
from libnn.nn.norm import BatchNorm2d, LayerNorm, RMSNorm
from libnn.nn.pool import AvgPool2d, MaxPool2d
from libnn.nn.sequential import Sequential
from libnn.nn.transformer import MultiheadAttention, TransformerEncoderLayer

__all__ = ["Module", "Linear", "Conv2d", "BatchNorm2d", "Conv2dBNAct", "ReLU", "ReLU6", "GELU", "SiLU",
           "MaxPool2d", "AvgPool2d", "Sequential", "LayerNorm", "MultiheadAttention", "TransformerEncoderLayer",
           "GraphedModule", "Flatten", "Dropout", "Softmax", "LogSoftmax", "Embedding", "RMSNorm"]
