"""A reference DDP that all-reduces every gradient once, after backward: one bucket, nothing
overlapped (the naive data parallelism that bucketing improves on; Li et al. 2020, "PyTorch
Distributed", VLDB). Importing this module registers it as ``ref.ddp_flat``."""

from parabench.builders.data_parallel import common_kwargs, dp_groups, reference_model
from parabench.families.data_parallel import DataParallelOptions
from parabench.models import lm_loss
from parabench.registry import register
from parabench.strategies import ANY_LAYOUT, DP_PRECISIONS, PlanFacts, StrategySpec
from parabench.theory import BYTES, Expectation, psi, zero_paper_state_bytes
from parabench.trainer import as_trainer

ONE_BUCKET_MB = 1e9  # larger than any model: every gradient lands in one bucket


def build_flat_ddp(spec):
    from reference_impls.data_parallel import DDP

    o = DataParallelOptions.read(spec.options)
    model = reference_model(spec, o)  # the recipe's casts, fp8 linears, checkpointing, compiled blocks
    kwargs = common_kwargs(spec, o, dp_groups(spec))
    return as_trainer(DDP)(model, lm_loss, spec.topology.dp_group, bucket_mb=ONE_BUCKET_MB, **kwargs)


def expect_flat_ddp(cfg, case, o, dp):
    """State bytes per rank and payload bytes per collective kind, from the layout the code keeps."""
    p, b = psi(cfg), BYTES[case.param_precision]
    master = case.param_precision != "fp32"  # 16-bit parameters: fp32 master weights and main gradients
    return Expectation(
        state_bytes={
            "params": b * p,
            "grads": b * p + (4 * p if master else 0),  # + the fp32 main gradient made for the update
            "optimizer": 8 * p + (4 * p if master else 0),  # Adam's two fp32 moments + the fp32 master weights
        },
        comm_payload_bytes={"all_reduce": b * p},  # one all-reduce of every gradient per step
        paper_state_bytes=zero_paper_state_bytes(0, p, dp),
    )


register(
    StrategySpec(
        name="ref.ddp_flat",
        family="data_parallel",
        builder=f"{__name__}:build_flat_ddp",
        kind="reference",
        description="reference DDP, one all-reduce of every gradient after backward",
        precisions=DP_PRECISIONS,
        recipes=("master", "amp", "fp8"),  # reference_model applies each of them
        legacy_recipe="master",
        layouts=ANY_LAYOUT,  # the gradients are a bag of tensors: separate or fused qkv
        compile_unsupported=None,  # reference_model compiles the blocks
        options=DataParallelOptions,
        expect=expect_flat_ddp,
        # the planner prices it as data parallelism whose all-reduce waits for backward's end
        plan=PlanFacts(
            family="data_parallel",
            grad_sync_once_per_step=True,
            persistent_grads="flat",
            device_copies="flat_grad_zero",
        ),
        peers=("torch.ddp",),  # the library strategy the report pairs it with
    )
)
