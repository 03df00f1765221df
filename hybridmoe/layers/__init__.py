"""Model layers. Importing the package registers the optional attention backends."""

from hybridmoe.layers import attention_cudnn as _attention_cudnn
from hybridmoe.layers import attention_splash as _attention_splash

_attention_cudnn.register()
_attention_splash.register()
