"""The tuned profiles follow their library's current recommendation (sources in each adapter's
docstring), and every reference/peer pair the report makes matches in recipe, layout and
micro-batch, with a difference in gradient-reduction dtype said beside the ratio. No launches: the
profiles' settings and theory are read directly, FSDP2 is built once per profile on a one-process
gloo group in this process, and the report's pairs come from a committed run."""

from __future__ import annotations

import pytest
import torch

from parabench.case import Case
from parabench.families.data_parallel import TUNED_DDP_BUCKET_MB, DDPPeerOptions
from parabench.families.sharded import ShardedPeerOptions
from parabench.models import build_model, model_config, parameter_count
from parabench.record import rank0_comm
from parabench.registry import can_pair, expected, grad_reduce_dtype, pair_facts, pair_note
from parabench.report.frames import case_rows
from parabench.report.overview import reference_rows
from parabench.report.spread import ratio_rows
from parabench.results import load_run
from parabench.theory import BYTES
from parabench.topology import Topology
from parabench.trainer import TrainSpec

# 4 and 2 H100s, gpt-1.3b bf16-master: tuned FSDP2 beside ref.zero3 and deepspeed.zero3
RUN = "results/h100x4/20261126-203946"


def _spec(options: dict, topology=None) -> TrainSpec:
    topology = topology or Topology(1, 0)
    return TrainSpec(
        model_config("tiny"), 0, torch.device("cpu"), "bf16", topology, 1, options=options, recipe="master"
    )


def test_ddp_tuned_buckets_are_torchtitans_and_matched_keeps_the_references():
    from parabench.peers.torch_ddp import ddp_settings

    def bucket(options: dict) -> float:
        return ddp_settings(_spec(options), DDPPeerOptions.read(options))["bucket_cap_mb"]

    assert bucket({}) == bucket({"profile": "tuned"}) == TUNED_DDP_BUCKET_MB == 100.0
    assert bucket({"profile": "matched"}) == DDPPeerOptions().bucket_mb == 25.0  # the references' bucket_mb
    assert bucket({"profile": "tuned", "bucket_mb": 40}) == bucket({"profile": "matched", "bucket_mb": 40}) == 40.0


def _groups(model, groups) -> list[tuple[list[str], bool | None]]:
    names = {id(m): n or "<root>" for n, m in model.named_modules()}
    return [([names[id(m)] for m in (g if isinstance(g, list) else [g])], r) for g, r in groups]


def test_fsdp2_groups_follow_torchtitans_apply_fsdp_to_decoder():
    from parabench.peers.torch_fsdp2 import shard_groups

    model = build_model(model_config("tiny"), 0)
    blocks = [f"blocks.{i}" for i in range(len(model.blocks))]

    def groups(**options):
        return _groups(model, shard_groups(model, ShardedPeerOptions(**options), options))

    # policy "default": embeddings and every block resharded, [norm, head] kept, the root left to FSDP2
    default = [(["tok_emb"], True), (["ln_f", "head"], False)] + [([b], True) for b in blocks] + [(["<root>"], None)]
    assert groups() == groups(profile="tuned") == default
    # option given: "always" reshards [norm, head] too, "never" nothing
    assert groups(reshard_after_forward=True)[1] == (["ln_f", "head"], True)
    assert {r for _, r in groups(reshard_after_forward=False)} == {False, None}
    # matched: the blocks, then the root with every parameter left in it, all resharded
    assert groups(profile="matched") == [([b], True) for b in blocks] + [(["<root>"], True)]


def test_fsdp2_tuned_build_on_one_rank_shards_as_torchtitan():
    """The real ``fully_shard`` states after a tuned build: five groups, the [norm, head] one not
    resharded after forward, fp32 reduction without casting forward inputs; matched reduces in bf16."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule

    from parabench.peers.torch_fsdp2 import build
    from parabench.topology import build_topology

    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        topo = build_topology("cpu")
        found = {}
        for profile in ("tuned", "matched"):
            trainer = build(_spec({"profile": profile}, topo))
            states = {id(m._get_fsdp_state()): m for m in trainer.module.modules() if isinstance(m, FSDPModule)}
            found[profile] = [
                (
                    sorted(type(m).__name__ for m in state._modules),
                    state._auto_reshard_after_forward,
                    [g.post_forward_mesh_info is not None for g in state._fsdp_param_groups],
                    [(g.mp_policy.reduce_dtype, g.mp_policy.cast_forward_inputs) for g in state._fsdp_param_groups],
                )
                for state in (m._get_fsdp_state() for m in states.values())
            ]
            trainer.close()
    finally:
        dist.destroy_process_group()
    tuned = {tuple(mods): (auto, resh) for mods, auto, resh, _ in found["tuned"]}
    assert tuned[("FSDPEmbedding",)] == (False, [True])
    assert tuned[("FSDPLayerNorm", "FSDPLinear")] == (False, [False])
    assert tuned[("FSDPBlock",)] == (False, [True])  # each block (the dict keeps one: all alike)
    assert tuned[("FSDPGPT",)][0] is True  # reshard_after_forward left to FSDP2: the root stays gathered
    assert len(found["tuned"]) == 3 + model_config("tiny").n_layers  # embeddings, [norm, head], blocks, root
    assert {p for *_, policies in found["tuned"] for p in policies} == {(torch.float32, False)}
    assert {p for *_, policies in found["matched"] for p in policies} == {(torch.bfloat16, True)}


def test_fsdp2_tuned_gathers_in_backward_all_but_norm_head_and_root():
    cfg = model_config("tiny")
    p = parameter_count(cfg)["total"]
    kept = cfg.seq_len * cfg.d_model + cfg.vocab_size * cfg.d_model + 2 * cfg.d_model

    def gathered(**options):
        case = Case(
            model="tiny", strategy="torch.fsdp2", world_size=2, precision="bf16", recipe="master", options=options
        )
        return expected(case, cfg, 2)["comm_payload_bytes"]

    assert gathered()["all_gather"] == 2 * (2 * p - kept)
    assert gathered(reshard_after_forward=True)["all_gather"] == 2 * (2 * p - cfg.seq_len * cfg.d_model)
    assert gathered(profile="matched")["all_gather"] == 2 * 2 * p
    assert gathered()["reduce_scatter"] == 4 * p and gathered(profile="matched")["reduce_scatter"] == 2 * p


def test_reduce_dtype_is_what_the_committed_records_moved():
    """Every record of the run with reduce-scatter traffic moved what its strategy's fact says per
    parameter: tuned FSDP2 5.68e9 B at gpt-1.3b (fp32), ref.zero3 2.84e9 B (bf16)."""
    _, records = load_run(RUN)
    checked = set()
    for r in records:
        moved = ((rank0_comm(r) or {}).get("by_kind") or {}).get("reduce_scatter")
        if r.get("status") != "ok" or not moved:
            continue
        per_param = moved["payload_bytes"] / r["model"]["params"]["total"] / (r["case"].get("grad_accum") or 1)
        assert per_param == pytest.approx(BYTES[grad_reduce_dtype(r["case"])], rel=0.02), r["label"]
        checked.add((r["case"]["strategy"], grad_reduce_dtype(r["case"])))
    assert {("torch.fsdp2", "fp32"), ("ref.zero3", "bf16"), ("deepspeed.zero3", "bf16")} <= checked


def test_pairs_refuse_other_shapes_and_label_another_reduce_dtype():
    ref = {"strategy": "ref.zero3", "precision": "bf16", "recipe": "master", "micro_batch": 4}
    fsdp2 = {**ref, "strategy": "torch.fsdp2", "options": {"profile": "tuned"}}
    a, b = pair_facts(ref), pair_facts(fsdp2)
    assert pair_note(a, b) == "peer reduces gradients in fp32, reference in bf16"
    assert pair_note(a, pair_facts({**fsdp2, "options": {"profile": "matched"}})) is None
    assert pair_note(a, pair_facts({**ref, "strategy": "deepspeed.zero3"})) is None
    for other in ({"micro_batch": 8}, {"layout": "fused"}, {"recipe": "amp"}):
        assert not can_pair(a, pair_facts({**fsdp2, **other}))
        with pytest.raises(ValueError, match="not a pair"):
            pair_note(a, pair_facts({**fsdp2, **other}))


def test_report_says_beside_the_ratio_where_the_peer_reduces_in_another_dtype():
    """The run's ref.zero3 and tuned FSDP2 at 4 GPUs, mb 4, as if FSDP2 were the fastest peer and
    both had three launches."""
    manifest, records = load_run(RUN)
    pair = [r for r in records if r["case"]["strategy"] in ("ref.zero3", "torch.fsdp2")]
    pair = [r for r in pair if r["case"]["world_size"] == 4 and r["case"]["micro_batch"] == 4]
    rows = case_rows([(manifest, records)])
    for row in rows:
        if row["strategy"] == "torch.fsdp2":
            row["tokens_per_s_per_device"] *= 10
    shape = ("ref.zero3", 4, 4)
    [zero3] = [r for r in reference_rows(rows) if (r["strategy"], r["world_size"], r["micro_batch"]) == shape]
    assert zero3["best_peer"].startswith("torch.fsdp2")
    assert zero3["pair_note"] == "peer reduces gradients in fp32, reference in bf16"
    launched = [{**r, "launches": [{"status": "ok", "tokens_per_s": t} for t in (1.0, 1.1, 1.2)]} for r in pair]
    [ratio] = ratio_rows([(manifest, launched)])
    assert (ratio["reference"], ratio["peer"]) == ("ref.zero3", "torch.fsdp2 [tuned]")
    assert ratio["pair_note"] == "peer reduces gradients in fp32, reference in bf16"
