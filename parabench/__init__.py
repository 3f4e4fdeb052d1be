"""parabench: distributed-training strategies, from-scratch and production, measured side by side."""

from parabench.version import __version__

__all__ = ["__version__", "load"]


def __getattr__(name: str):
    # ``parabench.load`` on first use: importing parabench stays cheap (no pandas, no torch) for
    # the launcher, the workers and the report.
    if name == "load":
        from parabench.data import load

        return load
    raise AttributeError(f"module 'parabench' has no attribute {name!r}")
