"""From-scratch reference implementations of distributed-training strategies (torch only).

One strategy per file, each small enough to read in one sitting, with the collectives it issues
written out in the code. parabench adapts them to its Strategy interface in its strategy
families (``parabench/families/``), passing in what they need from it (the loss, MoE routing);
nothing here imports parabench.
"""
