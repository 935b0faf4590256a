"""hisparse: long-document summarization with a paged, sparse-attention KV cache.

Importing this package is cheap: torch and transformers are imported only inside the
modules that need them (the CLI stays instant).
"""

__version__ = "0.1.0"
