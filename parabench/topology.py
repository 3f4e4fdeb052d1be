"""The rank grid: data x pipeline x tensor parallel, as an object passed to every strategy.

Ranks are laid out as ``arange(world).view(dp, pp, tp)`` (picotron's grid): tensor-parallel
peers are adjacent ranks, because TP talks every layer and adjacent ranks share the fastest
links (NVLink inside one host); data-parallel peers are the furthest apart, because DP talks
once per step. The process groups come from a torch ``DeviceMesh`` with the same layout, so
peer libraries that want a mesh (FSDP2, DTensor TP) and the reference code that wants plain
groups see one and the same grid.
"""

from __future__ import annotations

from dataclasses import dataclass, field


class TopologyError(ValueError):
    pass


@dataclass(frozen=True)
class Topology:
    world_size: int
    rank: int
    dp: int = 1
    pp: int = 1
    tp: int = 1
    mesh: object = field(default=None, repr=False, compare=False)

    @staticmethod
    def check(world_size: int, pp: int = 1, tp: int = 1) -> int:
        """The data-parallel degree for this grid, or a clear error before anything launches."""
        if pp < 1 or tp < 1:
            raise TopologyError(f"pp and tp must be >= 1 (got pp={pp}, tp={tp})")
        if world_size % (pp * tp):
            raise TopologyError(f"world size {world_size} is not dp x pp x tp for pp={pp}, tp={tp}")
        return world_size // (pp * tp)

    @property
    def coords(self) -> tuple[int, int, int]:
        """(dp_rank, pp_rank, tp_rank) of this rank in the grid."""
        tp_rank = self.rank % self.tp
        pp_rank = (self.rank // self.tp) % self.pp
        dp_rank = self.rank // (self.tp * self.pp)
        return dp_rank, pp_rank, tp_rank

    @property
    def dp_rank(self) -> int:
        return self.coords[0]

    @property
    def pp_rank(self) -> int:
        return self.coords[1]

    @property
    def tp_rank(self) -> int:
        return self.coords[2]

    def group(self, dim: str):
        """The process group of this rank along ``dim`` ('dp', 'pp' or 'tp')."""
        if self.mesh is None:
            import torch.distributed as dist

            return dist.group.WORLD
        return self.mesh[dim].get_group()

    @property
    def dp_group(self):
        return self.group("dp")

    @property
    def pp_group(self):
        return self.group("pp")

    @property
    def tp_group(self):
        return self.group("tp")

    def group_ranks(self, dim: str) -> list[int]:
        """Global ranks of this rank's group along ``dim``, in group-rank order."""
        import torch.distributed as dist

        return dist.get_process_group_ranks(self.group(dim)) if self.mesh is not None else [self.rank]


def build_topology(device_type: str, pp: int = 1, tp: int = 1) -> Topology:
    """Create the grid for the current process group (which must already be initialised)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    world, rank = dist.get_world_size(), dist.get_rank()
    dp = Topology.check(world, pp, tp)
    mesh = init_device_mesh(device_type, (dp, pp, tp), mesh_dim_names=("dp", "pp", "tp"))
    return Topology(world_size=world, rank=rank, dp=dp, pp=pp, tp=tp, mesh=mesh)
