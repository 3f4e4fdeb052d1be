"""parabench: distributed-training strategies, from-scratch and production, measured side by side."""

__version__ = "0.1.0"
