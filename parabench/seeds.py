"""The seeds' headline figures beside parabench's own answer: ``docs/seeds.md``, generated.

    python -m parabench.seeds            # (re)write docs/seeds.md from the committed records
    python -m parabench.seeds --check    # exit 1 when docs/seeds.md is not what the records give

The five seed documents this project started from are cited by file name (``000_88bdc561a8f154f5.txt``
to ``004_3bf43e16fadc26f6.txt``); each figure they quote is copied here with its seed, so nothing
outside the repository is read. parabench's side is computed from committed result records (named by
path under ``results/``, read as they are) and from parabench's own tables and formulas
(``parabench.shapes``, ``parabench.hardware``, ``parabench.theory``, ``parabench.collectives_scaling``):
the model shapes and FLOP convention the planner prices with, the peak table MFU divides by, the
memory formulas the state checks use. Where the seed assumes something parabench does not, the entry
says both.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import textwrap
from pathlib import Path

from parabench.hardware import PEAK_FLOPS
from parabench.shapes import GPTConfig, model_config, model_flops_per_token, parameter_count
from parabench.theory import zero_paper_state_bytes

ROOT = Path(__file__).resolve().parents[1]
DOC = Path("docs") / "seeds.md"
GB, GIB, MIB = 1e9, 2**30, 2**20
PROSE_WIDTH = 118  # docs' prose lines stay under 120 characters (tests/test_docs.py)
SECONDS_PER_YEAR = 365.25 * 24 * 3600

# The records each entry reads, relative to the repository root.
H100X4 = "results/h100x4/20261126-203946/cases"
RECORDS = {
    "bubble_1f1b": f"{H100X4}/2517697879a17095.json",  # pp 4, 16 micro-batches, gpt-1.3b, 4 H100
    "bubble_gpipe": f"{H100X4}/caa6f5fc3a8b9676.json",
    "ac_on": "results/memory-savers-gpu/20261126-030222/cases/9dc441c5cc0b2f2c.json",  # gpt-1.3b ZeRO-2, 2 GPUs
    "ac_off": "results/memory-savers-gpu/20261126-030222/cases/cf6224923d58f5e7.json",
    "ps": "results/gpu-dp/20261126-020920/cases/420e8e57c4a6f496.json",  # parameter server, gpt-1.3b, 2 GPUs
    "dp_weak_1": f"{H100X4}/5987ebea232d619c.json",  # reference DDP, micro-batch 4, 1 GPU
    "dp_weak_4": f"{H100X4}/18b9447fb95f9785.json",  # the same on 4 GPUs
    "single_mb8": f"{H100X4}/9c1e29ce05378c86.json",  # reference DDP, micro-batch 8, 1 GPU
    "tp4": f"{H100X4}/598b8681fd3ea77b.json",  # Megatron tensor parallel, tp 4, micro-batch 8
    "mfu_1gpu": f"{H100X4}/014455567097f742.json",  # ZeRO-1 on 1 GPU, micro-batch 8: a measured MFU
    "zero3": "results/zeropp-gpu/20261126-223652/cases/85e9549894b4bb1c.json",  # bf16 all-gather
    "qwz": "results/zeropp-gpu/20261126-223652/cases/7614143dc9b63ab1.json",  # int8 weights (qwZ)
    "qgz": "results/zeropp-gpu/20261126-223652/cases/daeda66d98b3aa42.json",  # int4 gradients (qgZ)
}

# GPT-3 175B (Brown et al. 2020, Table 2.1): 96 layers, d_model 12288, 96 heads, context 2048, GPT-2's
# vocabulary; trained on 300B tokens (Sec. 2.2).
GPT3 = GPTConfig(n_layers=96, d_model=12288, n_heads=96, vocab_size=50257, seq_len=2048)
GPT3_TOKENS = 300e9


def _record(root: Path, key: str) -> dict:
    return json.loads((root / RECORDS[key]).read_text())


def _link(key: str) -> str:
    path = RECORDS[key]
    return f"[{Path(path).stem}](../{path})"


def _case(r: dict) -> str:
    c = r["case"]
    opts = ", ".join(f"{k} {v}" for k, v in sorted(c.get("options", {}).items()) if k in ("pp", "microbatches", "tp"))
    return f"{c['strategy']} {c['model']} on {c['world_size']} GPU(s), micro-batch {c['micro_batch']}" + (
        f", {opts}" if opts else ""
    )


def _payload(r: dict, kind: str) -> int:
    return int(r["per_rank"][0]["comm"]["by_kind"][kind]["payload_bytes"])


def _stage_bubbles(r: dict) -> list[float]:
    return [pr["pipeline"]["bubble_fraction_measured"] for pr in r["per_rank"]]


def _activation_bytes(r: dict) -> float:
    m = r["metrics"]
    return m["peak_alloc_bytes"] - m["model_state_bytes_max"]


def entries(root: Path = ROOT) -> list[dict]:
    """One dict per headline figure: ``title``, ``seed`` (file), ``seed_says``, ``seed_assumes``,
    ``parabench`` (its answer, with numbers), ``parabench_assumes`` and ``sources`` (record links)."""
    out = []

    # --- GPT-3's compute and weights ---------------------------------------------------------------
    flops_token = model_flops_per_token(GPT3)
    total = flops_token * GPT3_TOKENS
    fp32_peak, bf16_peak = PEAK_FLOPS[("H100", "fp32")], PEAK_FLOPS[("H100", "bf16")]
    mfu_rec = _record(root, "mfu_1gpu")
    mfu = mfu_rec["metrics"]["mfu"]
    years = {k: total / rate / SECONDS_PER_YEAR for k, rate in (("fp32", fp32_peak), ("bf16", bf16_peak))}
    out.append(
        {
            "title": "GPT-3's training compute on one device",
            "seed": "001_49cb7c694370cc74.txt",
            "seed_says": "3.14 × 10^23 FLOPs; an H100 SXM at 6.7 × 10^13 FLOP/s takes ≈ 150 years",
            "seed_assumes": "the GPT-3 paper's total (6 FLOPs per parameter per token, 175B parameters, 300B "
            "tokens); the H100's fp32 (non-tensor-core) rate, at 100 % of peak",
            "parabench": f"{total:.3g} FLOPs ({flops_token / 1e9:,.0f} GFLOPs per token × 300B tokens): "
            f"{years['fp32']:.0f} years at the same 6.7 × 10^13 FLOP/s (parabench's H100 fp32 peak), "
            f"{years['bf16']:.1f} years at the H100's dense bf16 peak ({bf16_peak / 1e12:.1f} TFLOP/s), "
            f"{years['bf16'] / mfu:.0f} years at the {mfu:.0%} MFU parabench measured for gpt-1.3b on one H100",
            "parabench_assumes": "parabench.shapes' FLOP convention: 6 × matmul parameters + 12·L·s·d attention "
            "per token (PaLM appendix B), so "
            f"{(flops_token / (6 * 175e9) - 1):+.1%} over 6 × 175B; the GPT-3 175B shape of the paper's Table 2.1",
            "sources": [_link("mfu_1gpu")],
        }
    )
    params = parameter_count(GPT3)["total"]
    out.append(
        {
            "title": "GPT-3's weights in 16 bits",
            "seed": "001_49cb7c694370cc74.txt",
            "seed_says": "175B parameters ≈ 350 GB if all are 16-bit",
            "seed_assumes": "175 × 10^9 parameters × 2 bytes, GB = 10^9 bytes",
            "parabench": f"{params / 1e9:.1f}B parameters × 2 bytes = {2 * params / GB:.0f} GB "
            f"({2 * params / GIB:.0f} GiB); with Adam in mixed precision (16Ψ, below) {16 * params / GB:,.0f} GB",
            "parabench_assumes": "parabench.shapes.parameter_count of the Table 2.1 shape (embeddings, learned "
            "positions and an untied head counted)",
            "sources": [],
        }
    )

    # --- ZeRO's 16Ψ and the 7.5B example ------------------------------------------------------------
    psi = 7.5e9
    zero = [zero_paper_state_bytes(stage, psi, 64) / GB for stage in range(4)]
    out.append(
        {
            "title": "Model states per device: 16Ψ, divided by N_d (7.5B parameters, N_d = 64)",
            "seed": "000_88bdc561a8f154f5.txt",
            "seed_says": "2Ψ + 2Ψ + (4Ψ + 4Ψ + 4Ψ) = 16Ψ bytes; partition to N_d GPUs ⇒ divide by N_d",
            "seed_assumes": "fp16 parameters and gradients, fp32 master, momentum and variance (Adam); the "
            "ZeRO paper's Fig. 1 example: Ψ = 7.5B, N_d = 64, 120 / 31.4 / 16.6 / 1.9 GB for DP / P_os / "
            "P_os+g / P_os+g+p",
            "parabench": "parabench.theory.zero_paper_state_bytes: "
            + " / ".join(f"{v:.1f} GB" for v in zero)
            + " for stages 0 / 1 / 2 / 3: only stage 3 divides all 16Ψ by N_d, as the seed's one line says",
            "parabench_assumes": "the paper's formula; parabench's own references keep an fp32 gradient beside "
            "the bf16 one in the master recipe (20Ψ at stage 0), which each record's state check states",
            "sources": [],
        }
    )

    # --- the pipeline bubble ------------------------------------------------------------------------
    p, m = 4, 16
    theory = (p - 1) / (m + p - 1)
    b1, bg = _record(root, "bubble_1f1b"), _record(root, "bubble_gpipe")
    means = {k: sum(_stage_bubbles(r)) / len(_stage_bubbles(r)) for k, r in (("1F1B", b1), ("GPipe", bg))}
    out.append(
        {
            "title": "The pipeline bubble at m = 4d",
            "seed": "003_e2e346ed8bfc8aec.txt",
            "seed_says": "bubble fraction (d − 1)/(m + d − 1); 'almost negligible if the number of microbatches "
            "is 4x the number of partitions, i.e. m > 4d'",
            "seed_assumes": "forward and backward of a micro-batch take one unit each, stages equal, no "
            "communication time",
            "parabench": f"theory at d = {p}, m = {m}: {theory:.1%}, not negligible; measured (each stage's idle "
            f"share of its step, bubble_fraction_measured, mean over the 4 stages): 1F1B {means['1F1B']:.1%}, GPipe {means['GPipe']:.1%}; per stage "
            + ", ".join(f"{x:.0%}" for x in _stage_bubbles(b1))
            + " (1F1B)",
            "parabench_assumes": "gpt-1.3b cut into 4 equal stages (the first also embeds, the last runs the "
            "head and loss: unequal work), send/recv waits counted as bubble",
            "sources": [_link("bubble_1f1b"), _link("bubble_gpipe")],
        }
    )

    # --- activation checkpointing -------------------------------------------------------------------
    on, off = _record(root, "ac_on"), _record(root, "ac_off")
    act_on, act_off = _activation_bytes(on), _activation_bytes(off)
    n = model_config(on["case"]["model"]).n_layers
    out.append(
        {
            "title": "Activation memory under checkpointing",
            "seed": "003_e2e346ed8bfc8aec.txt",
            "seed_says": "checkpointing reduces the memory of an n-layer network to O(√n), with k = √n segments, "
            "for one extra forward pass",
            "seed_assumes": "n equal layers, checkpoints at √n segment boundaries: n/k + k = 2√n layer-activations "
            f"(at n = {n}: {2 * math.sqrt(n):.1f} against {n}, {n / (2 * math.sqrt(n)):.1f}x less)",
            "parabench": f"checkpointing every block of gpt-1.3b (n = {n}): activations (peak minus model "
            f"state) {act_off / GB:.1f} GB → {act_on / GB:.1f} GB, {act_off / act_on:.1f}x less",
            "parabench_assumes": "one checkpoint per transformer block (k = n, not √n): only the block inputs are "
            "kept, each far smaller than a block's internal activations, so the saving exceeds the √n schedule's "
            "at this depth; the √n schedule itself is not implemented",
            "sources": [_link("ac_off"), _link("ac_on")],
        }
    )

    # --- the parameter server's bandwidth -----------------------------------------------------------
    model_mb, grad_s, workers = 97.5, 1 / 3, 256
    seed_rate = workers * model_mb * MIB / grad_s / GIB
    ours = (workers - 1) * model_mb * MIB / grad_s / GIB
    ps = _record(root, "ps")
    recv = _payload(ps, "recv")
    bpsi = _payload(ps, "broadcast")
    step = ps["metrics"]["step_time_s_median"]
    out.append(
        {
            "title": "The parameter server's bandwidth",
            "seed": "001_49cb7c694370cc74.txt",
            "seed_says": "ResNet-50 (97.5 MB), one gradient per 1/3 s per GPU, 256 workers ⇒ 73.1 GB/s in and out "
            "at the master",
            "seed_assumes": "the master receives K gradients and sends K models; MB = 2^20 and GB = 2^30 bytes "
            f"(256 × 97.5 MiB × 3 /s = {seed_rate:.1f} GiB/s)",
            "parabench": f"the reference parameter server's theory: the server receives (K − 1)·bΨ per step, {ours:.1f} GiB/s in the seed's "
            f"example (the server trains a slice too), and broadcasts bΨ once; measured on {_case(ps)}: "
            f"{recv / GB:.2f} GB received per step (= (K − 1)·bΨ = {bpsi / GB:.2f} GB exactly), "
            f"{recv / step / GB:.1f} GB/s at its {step * 1e3:.0f} ms step",
            "parabench_assumes": "the server is rank 0 of K (it computes its own gradient); the new parameters "
            "leave through one broadcast of the backend, whose per-link bytes depend on its algorithm, not K "
            "sends; the seed's 'Peak Bandwidth O(K)' is fitted in the collective-scaling study",
            "sources": [_link("ps")],
        }
    )

    # --- weak-scaling efficiency --------------------------------------------------------------------
    w1, w4 = _record(root, "dp_weak_1"), _record(root, "dp_weak_4")
    s8, tp4 = _record(root, "single_mb8"), _record(root, "tp4")

    def per_dev(r):
        return r["metrics"]["tokens_per_s_per_device"]

    out.append(
        {
            "title": "Weak-scaling efficiency",
            "seed": "004_3bf43e16fadc26f6.txt",
            "seed_says": "Megatron-LM: 'over 76% scaling efficiency', 'up to 77% efficiency in weak scaling'",
            "seed_assumes": "512 V100s in 32 DGX-2H; the model grows with the GPUs (1.2B on 1 GPU to 8.3B on 8-way "
            "tensor parallel × 64-way data parallel); efficiency = throughput per GPU against the 1-GPU run",
            "parabench": f"tokens/s per device against one H100, fixed gpt-1.3b: data parallel, micro-batch 4 per "
            f"GPU, 4 GPUs {per_dev(w4) / per_dev(w1):.0%}; tensor parallel tp 4 (micro-batch 8 per tp group) "
            f"{per_dev(tp4) / per_dev(s8):.0%} of one GPU at micro-batch 8",
            "parabench_assumes": "the model does not grow with the GPUs (one H100 holds gpt-1.3b), so tensor "
            "parallelism only splits the same work four ways; 4 GPUs of one NVSwitch host, not 512 across nodes",
            "sources": [_link("dp_weak_1"), _link("dp_weak_4"), _link("single_mb8"), _link("tp4")],
        }
    )

    # --- quantisation -------------------------------------------------------------------------------
    z3, qwz, qgz = _record(root, "zero3"), _record(root, "qwz"), _record(root, "qgz")
    ag, ag_q = _payload(z3, "all_gather"), _payload(qwz, "all_gather")
    rs, rs_q = _payload(z3, "reduce_scatter"), _payload(qgz, "all_to_all")
    out.append(
        {
            "title": "Quantisation's saving",
            "seed": "004_3bf43e16fadc26f6.txt",
            "seed_says": "quantizing the weights to 8-bit integers reduces the memory footprint 'normally around 4x'",
            "seed_assumes": "fp32 weights to int8: 4 bytes to 1",
            "parabench": f"ZeRO++ on {_case(z3)}: the weights' all-gather in int8 (qwZ) moves {ag_q / GB:.2f} GB "
            f"against {ag / GB:.2f} GB in bf16, {ag / ag_q:.2f}x less ({2 * ag / ag_q:.2f}x against fp32); the "
            f"gradients in int4 (qgZ) {rs_q / GB:.2f} GB against {rs / GB:.2f} GB, {rs / rs_q:.2f}x less",
            "parabench_assumes": "wire bytes, not memory: parabench quantises what crosses the network, with an "
            "fp32 scale per block of weights (hence a little under 2x and 4x)",
            "sources": [_link("zero3"), _link("qwz"), _link("qgz")],
        }
    )
    return out


def _wrap(text: str, first: str = "", rest: str = "") -> list[str]:
    return textwrap.wrap(
        text,
        width=PROSE_WIDTH,
        initial_indent=first,
        subsequent_indent=rest,
        break_long_words=False,
        break_on_hyphens=False,
    )


def render(items: list[dict]) -> str:
    lines = [
        "# The seeds' headline figures beside parabench's",
        "",
        *_wrap(
            "Generated by `python -m parabench.seeds` from committed records and parabench's own formulas; do not "
            "edit by hand (`tests/test_seeds_doc.py` regenerates it and fails when the two disagree). The seeds are "
            "the five documents this project started from, cited by file name; their figures are quoted as they "
            "give them. The records each figure rests on are linked under it."
        ),
        "",
        "| figure | seed | the seed says | parabench |",
        "| --- | --- | --- | --- |",
    ]
    for e in items:
        lines.append(f"| {e['title']} | `{e['seed']}` | {e['seed_says']} | {e['parabench']} |")
    for e in items:
        lines += ["", f"## {e['title']}", ""]
        lines += _wrap(f"**Seed** `{e['seed']}`: {e['seed_says']}.", "- ", "  ")
        lines += _wrap(f"**The seed assumes**: {e['seed_assumes']}.", "- ", "  ")
        lines += _wrap(f"**parabench**: {e['parabench']}.", "- ", "  ")
        lines += _wrap(f"**parabench assumes**: {e['parabench_assumes']}.", "- ", "  ")
        if e["sources"]:
            lines += _wrap(f"**Records**: {', '.join(e['sources'])}.", "- ", "  ")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m parabench.seeds", description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="compare docs/seeds.md with the records; write nothing")
    parser.add_argument("--root", type=Path, default=ROOT, help="repository root (default: this checkout)")
    args = parser.parse_args(argv)
    text = render(entries(args.root))
    path = args.root / DOC
    if args.check:
        if not path.is_file() or path.read_text() != text:
            print(f"{DOC} differs from what the records give: run python -m parabench.seeds", file=sys.stderr)
            return 1
        return 0
    path.write_text(text)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
