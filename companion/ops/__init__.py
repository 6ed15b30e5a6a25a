"""Functions on tensors: attention forms, online softmax, masks, RoPE, linear attention.

The lowest layer: nothing here imports a module, a model or a config.
"""
