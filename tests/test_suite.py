"""Suite files: expansion, exclusion, hashing, and errors that name file, line and field."""

import re
import textwrap

import pytest

from parabench.case import Case
from parabench.results import SCHEMA_VERSION, SchemaError, load_json, write_json_atomic
from parabench.suite import SuiteError, list_suites, load_suite, validate_case


def write(tmp_path, body, name="s.toml"):
    p = tmp_path / name
    p.write_text(textwrap.dedent(body).lstrip())
    return p


def test_every_committed_suite_is_valid():
    for name in list_suites():
        load_suite(name)


def test_matrix_expansion_and_exclude(tmp_path):
    p = write(
        tmp_path,
        """
        [suite]
        name = "x"
        steps = 3
        [[matrix]]
        model = "tiny"
        strategy = ["torch.ddp", "torch.fsdp2"]
        world_size = [2, 4]
        precision = ["fp32", "bf16"]
        [[matrix]]
        model = "tiny"
        strategy = "single"
        world_size = 1
        [[exclude]]
        strategy = "torch.fsdp2"
        world_size = 4
        """,
    )
    suite = load_suite(str(p))
    assert len(suite.cases) == 2 * 2 * 2 - 2 + 1
    assert all(c.steps == 3 for c in suite.cases)
    assert len({c.case_hash for c in suite.cases}) == len(suite.cases)


def test_case_hash_ignores_timeout_but_not_what_is_measured():
    a = Case(model="tiny", strategy="torch.ddp", world_size=2)
    assert a.case_hash == Case(model="tiny", strategy="torch.ddp", world_size=2, timeout_s=5).case_hash
    assert a.case_hash != Case(model="tiny", strategy="torch.ddp", world_size=2, micro_batch=3).case_hash
    assert a.case_hash != Case(model="tiny", strategy="torch.ddp", world_size=2, options={"bucket_mb": 1}).case_hash


@pytest.mark.parametrize(
    "body, line, field, words",
    [
        (
            """
     [suite]
     name = "x"
     [[matrix]]
     model = "tiny"
     strategy = "torch.dpp"
     world_size = 2
     """,
            5,
            "strategy",
            "valid strategies: ",
        ),
        (
            """
     [suite]
     name = "x"
     [[matrix]]
     model = "tiny"
     strategy = "torch.ddp"
     world_size = "two"
     """,
            6,
            "world_size",
            "expected int",
        ),
        (
            """
     [suite]
     name = "x"
     stpes = 3
     [[matrix]]
     model = "tiny"
     strategy = "torch.ddp"
     world_size = 2
     """,
            3,
            "stpes",
            "unknown key",
        ),
        (
            """
     [suite]
     name = "x"
     [[matrix]]
     model = "tiny"
     strategy = "torch.ddp"
     world_size = 2
     [[matrix]]
     model = "gpt-9t"
     strategy = "torch.ddp"
     world_size = 2
     """,
            8,
            "model",
            "valid models: ",
        ),
        (
            """
     [suite]
     [[matrix]]
     model = "tiny"
     strategy = "ref.tp"
     world_size = 3
     options = {tp = 2}
     """,
            4,
            "strategy",
            "not dp x pp x tp",
        ),
        (
            """
     [suite]
     [[matrix]]
     model = "tiny"
     strategy = "ref.ddp"
     world_size = 2
     options = {bucket_mbs = 4}
     """,
            4,
            "strategy",
            "ref.ddp: unknown option 'bucket_mbs'; valid options: activation_checkpointing, bucket_mb,",
        ),
        (
            """
     [suite]
     [[matrix]]
     model = "tiny"
     strategy = "ref.tp"
     world_size = 2
     options = {tp = "2"}
     """,
            4,
            "strategy",
            "option tp must be an int, got '2'",
        ),
    ],
)
def test_errors_name_file_line_and_field(tmp_path, body, line, field, words):
    p = write(tmp_path, body)
    with pytest.raises(SuiteError) as err:
        load_suite(str(p))
    msg = str(err.value)
    assert f"{p}:{line}" in msg and f"'{field}'" in msg and words in msg, msg


def test_malformed_toml_names_file_and_line(tmp_path):
    p = write(
        tmp_path,
        """
        [suite]
        name = "x
        """,
    )
    with pytest.raises(SuiteError) as err:
        load_suite(str(p))
    assert str(p) in str(err.value) and "line 2" in str(err.value)


def test_unknown_suite_names_the_closest_ones_and_the_listing():
    with pytest.raises(SuiteError) as err:
        load_suite("smok")
    assert "closest: smoke" in str(err.value) and "`parabench list`" in str(err.value)


def test_loading_refuses_another_schema_version(tmp_path):
    path = tmp_path / "r.json"
    write_json_atomic(path, {"schema_version": SCHEMA_VERSION + 1})
    with pytest.raises(SchemaError, match=f"schema version {SCHEMA_VERSION + 1}"):
        load_json(path)
    write_json_atomic(path, {"schema_version": SCHEMA_VERSION, "x": 1})
    assert load_json(path)["x"] == 1
    assert not list(tmp_path.glob(".*tmp"))  # no temporary left behind


def test_own_launch_isolates_a_case_without_changing_what_it_measures(tmp_path):
    """An A/B pair (meter on / off) can ask for launches of their own; the case hash, which
    identifies the measurement for `parabench compare`, does not change."""
    from types import SimpleNamespace

    from parabench.launch import LaunchOptions
    from parabench.runner import Runner

    plain = Case(model="tiny", strategy="ref.ddp", world_size=2, device="cpu")
    alone = Case(model="tiny", strategy="ref.ddp", world_size=2, device="cpu", own_launch=True)
    assert plain.case_hash == alone.case_hash
    pending = [plain, alone, Case(model="tiny", strategy="torch.ddp", world_size=2, device="cpu")]
    runner, batches = SimpleNamespace(launch=LaunchOptions()), []
    while pending:
        batches.append([c.own_launch for c in Runner._next_batch(runner, pending)])
    assert batches == [[False, False], [True]]

    suite = tmp_path / "ab.toml"
    suite.write_text(
        '[suite]\nname = "ab"\ndevice = "cpu"\n[[matrix]]\nmodel = "tiny"\nstrategy = "ref.ddp"\n'
        "world_size = 2\ncomm_meter = [true, false]\nown_launch = true\n"
    )
    assert [c.own_launch for c in load_suite(str(suite)).cases] == [True, True]
    suite.write_text(
        '[suite]\nname = "ab"\ndevice = "cpu"\n[[matrix]]\nmodel = "tiny"\nstrategy = "ref.ddp"\n'
        'world_size = 2\nown_launch = "yes"\n'
    )
    with pytest.raises(SuiteError, match="own_launch"):
        load_suite(str(suite))


def test_options_parse_through_the_strategy_dataclass_without_touching_the_dict():
    """Defaults live in the dataclass only: the case keeps the dict it was given (and its hash)."""
    from parabench.families.sharded import ShardedOptions
    from parabench.registry import get_strategy

    spec = get_strategy("ref.hsdp")
    assert spec.options is ShardedOptions
    opts = spec.parse_options({"shard_size": 4})
    assert (opts.shard_size, opts.bucket_mb, opts.prefetch) == (4, 25.0, True)
    case = Case(model="tiny", strategy="ref.hsdp", world_size=4, options={"shard_size": 2})
    validate_case(case)
    assert case.options == {"shard_size": 2}
    with pytest.raises(ValueError, match=re.escape("option cp_split must be 'zigzag' | 'contiguous', got 'zig'")):
        get_strategy("ref.cp_ring").parse_options({"cp_split": "zig"})


def test_run_case_rejects_an_unknown_option_with_the_valid_ones(capsys):
    from parabench.cli import main

    rc = main(
        ["run", "case", "--model", "tiny", "--strategy", "ref.ddp", "--world-size", "2", "--options", '{"bucket": 4}']
    )
    err = capsys.readouterr().err
    assert rc == 2 and "unknown option 'bucket'; valid options:" in err and "bucket_mb" in err, err


def test_every_registered_builder_resolves():
    """A strategy names its builder by import path; a lost function would show only when a case ran."""
    import importlib

    from parabench.registry import STRATEGIES

    missing = []
    for name, spec in STRATEGIES.items():
        module, function = spec.builder.split(":")
        if not callable(getattr(importlib.import_module(module), function, None)):
            missing.append(f"{name} -> {spec.builder}")
    assert not missing, missing


def test_node_groups_parse_and_a_misspelt_form_names_file_and_value(tmp_path):
    """shard_size and hpz_partition_size take "node" (resolved by the runner for its nodes), and only they."""
    p = write(
        tmp_path,
        """
        [[matrix]]
        model = "tiny"
        strategy = "ref.hsdp"
        world_size = 4
        options = {shard_size = "node"}
        [[matrix]]
        model = "tiny"
        strategy = ["ref.zeropp", "deepspeed.zeropp"]
        world_size = 4
        options = {hpz = true, hpz_partition_size = "node"}
        """,
    )
    cases = load_suite(str(p)).cases
    assert [c.options.get("shard_size", c.options.get("hpz_partition_size")) for c in cases] == ["node"] * 3
    assert "[shard_size=node]" in cases[0].label
    bad = write(tmp_path, p.read_text().replace('shard_size = "node"', 'shard_size = "nodes"'), "bad.toml")
    with pytest.raises(SuiteError) as err:
        load_suite(str(bad))
    msg = str(err.value)
    assert str(bad) in msg and "option shard_size must be an int or 'node'" in msg and "got 'nodes'" in msg, msg
    assert "did you mean 'node'?" in msg
    with pytest.raises(ValueError, match="option bucket_mb must be a number, got 'node'"):
        validate_case(Case(model="tiny", strategy="ref.hsdp", world_size=4, options={"bucket_mb": "node"}))
