"""Integrations of pagedkv with inference libraries; each is an optional extra.

``pagedkv.integrations.hf``: a Hugging Face ``transformers`` cache backed by a pagedkv
sequence (``pip install -e ".[hf]"``). Importing this package imports neither torch
nor transformers; only the submodule does.
"""

from __future__ import annotations

__all__ = ["hf"]
