"""Adapters that run production libraries (PyTorch, DeepSpeed) behind parabench's Strategy interface."""
