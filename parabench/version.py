"""parabench's version, recorded in every run's manifest (``results.recorded_versions``), and the
schema version of the files it writes (manifests, case records, collectives results).

Their own module, below everything that writes or reads those files: the package's front
(``parabench.load``), the record (``parabench.record``) and its loader (``parabench.results``).
"""

__version__ = "0.1.0"
# The shape of every JSON file a run writes; ``results.load_json`` refuses any other.
SCHEMA_VERSION = 1
