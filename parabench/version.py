"""parabench's version, recorded in every run's manifest and record (``results.recorded_versions``).

Its own module so that what records it needs not import the package's front (``parabench.load``).
"""

__version__ = "0.1.0"
