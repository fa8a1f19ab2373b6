"""Adapters that plug attn into other frameworks; each imports its framework lazily.

``import attn`` never imports this package: ``attn.integrations.hf`` needs transformers
(``pip install 'attn[hf]'``).
"""
