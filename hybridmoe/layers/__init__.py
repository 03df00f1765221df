"""Model layers. Importing the package registers the optional attention backends."""

from hybridmoe.layers import attention_cudnn as _attention_cudnn

_attention_cudnn.register()
