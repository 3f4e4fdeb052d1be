"""Strategy families: each module holds, for its strategies, the registry rows, the typed options
(one default and one line of meaning per option), the validation and the analytic expectation,
without torch. The rows name their builders by import path (``parabench/builders/`` for the
references, ``parabench/peers/`` for the libraries). ``parabench.registry`` collects the rows.

Adding a strategy: its implementation (``reference_impls/`` or a peer in ``parabench/peers/``), a
row in its family here (with its expectation), its test, and a line in a suite.
"""

from parabench.families import compression, context, data_parallel, expert, model_parallel, sharded

ROWS = data_parallel.ROWS + sharded.ROWS + model_parallel.ROWS + context.ROWS + expert.ROWS + compression.ROWS
