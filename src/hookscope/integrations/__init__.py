"""Trainer integrations: import the one you need.

- ``from hookscope.integrations.lightning import HookscopeCallback`` (PyTorch Lightning)
- ``from hookscope.integrations.transformers import HookscopeCallback`` (Hugging Face Trainer)

Each module imports its framework when imported; ``import hookscope`` imports neither.
"""
