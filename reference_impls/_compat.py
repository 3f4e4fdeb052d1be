"""Names of collectives that moved between torch releases (2.11 on the GPU machine, 2.13 on CPU).

torch 2.13 deprecates ``all_gather_into_tensor``/``reduce_scatter_tensor`` in favour of
``all_gather_single``/``reduce_scatter_single`` with the same arguments; 2.11 has only the old
names. One alias each, so the reference code reads the same on both and prints no warnings.
"""

import torch.distributed as dist

all_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_into = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
