"""Heterogeneity-aware planning and launching of distributed PyTorch training."""

__version__ = "0.1.0"
