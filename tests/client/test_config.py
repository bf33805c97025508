import datetime as dt
import textwrap

import pytest
from google.protobuf import struct_pb2

from opentinker_client import ConfigError, InvalidArgumentError, TaskConfig, load_task_config, parse_task_config
from opentinker_client._convert import duration_to_seconds, struct_to_dict

VALID = textwrap.dedent(
    """\
    name: arithmetic-demo
    workload_type: lora_finetune
    model: .cache/models/SmolLM2-135M-Instruct   # optional: scheduler default
    gpu_count: 0
    priority: 5            # optional
    max_runtime: 600       # seconds, optional
    max_attempts: 3        # optional
    env: {env_id: arithmetic, min_digits: 1, max_digits: 1}
    hyperparameters: {steps: 15, learning_rate: 0.0002}
    """
)


def write(tmp_path, text, name="task.yaml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def test_valid_file(tmp_path):
    cfg = load_task_config(write(tmp_path, VALID))
    assert cfg == TaskConfig(
        name="arithmetic-demo",
        workload_type="lora_finetune",
        model=".cache/models/SmolLM2-135M-Instruct",
        gpu_count=0,
        priority=5,
        max_runtime=600.0,
        max_attempts=3,
        env={"env_id": "arithmetic", "min_digits": 1, "max_digits": 1},
        hyperparameters={"steps": 15, "learning_rate": 0.0002},
    )
    assert cfg.source.endswith("task.yaml")
    spec = cfg.check()
    assert spec.hyperparameters.steps == 15 and spec.model == ".cache/models/SmolLM2-135M-Instruct"


def test_minimal_file_uses_defaults(tmp_path):
    cfg = load_task_config(write(tmp_path, "workload_type: lora_finetune\nmodel:\nenv:\n"))
    assert cfg.model == "" and cfg.env == {} and cfg.hyperparameters == {}
    assert cfg.gpu_count == 0 and cfg.priority is None and cfg.max_runtime is None and cfg.max_attempts is None
    cfg.check()  # an empty model is the scheduler's default, not an error


def test_frozen():
    cfg = TaskConfig(workload_type="lora_finetune")
    with pytest.raises(AttributeError):
        cfg.gpu_count = 2  # type: ignore[misc]


def error_of(tmp_path, text) -> ConfigError:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as exc:
        load_task_config(path)
    err = exc.value
    assert isinstance(err, InvalidArgumentError)
    assert str(path) in str(err)
    assert "\n" not in str(err)
    return err


def test_unknown_top_level_key(tmp_path):
    err = error_of(tmp_path, VALID.replace("gpu_count: 0\n", "gpu_count: 0\ngpus: 1\n"))
    assert (err.line, err.key) == (5, "gpus")
    assert "task.yaml:5:1: gpus: unknown key" in str(err)
    assert "workload_type" in str(err)  # lists the known keys
    assert "did you mean 'gpu_count'?" in str(err)  # another word for it


@pytest.mark.parametrize("typo", ["enviroment", "environment", "env_config"])
def test_a_top_level_word_for_env_suggests_env(tmp_path, typo):
    err = error_of(tmp_path, "workload_type: lora_finetune\n" + typo + ":\n  env_id: arithmetic\n")
    assert (err.line, err.key) == (2, typo) and "did you mean 'env'?" in str(err)


def test_wrong_type(tmp_path):
    err = error_of(tmp_path, VALID.replace("gpu_count: 0", "gpu_count: two"))
    assert (err.line, err.key) == (4, "gpu_count")
    assert "expected an integer" in str(err) and "'two'" in str(err)
    err = error_of(tmp_path, VALID.replace("max_runtime: 600", "max_runtime: 10m"))
    assert (err.line, err.key) == (6, "max_runtime")
    err = error_of(tmp_path, VALID.replace("gpu_count: 0", "gpu_count: true"))
    assert err.key == "gpu_count"
    err = error_of(
        tmp_path, VALID.replace("env: {env_id: arithmetic, min_digits: 1, max_digits: 1}", "env: arithmetic")
    )
    assert (err.line, err.key) == (8, "env")


def with_hyperparameters(block: str) -> str:
    """``VALID`` with its one-line hyperparameters replaced by ``block`` (its keys in block style, one a line)."""
    return VALID.replace("hyperparameters: {steps: 15, learning_rate: 0.0002}", "hyperparameters:\n" + block)


def test_unknown_hyperparameter_with_its_line(tmp_path):
    err = error_of(tmp_path, with_hyperparameters("  steps: 15\n  lr: 0.0002\n"))
    assert (err.line, err.key) == (11, "hyperparameters.lr")
    assert "task.yaml:11:3: hyperparameters.lr: unknown key, expected one of the known keys (" in str(err)
    assert "learning_rate" in str(err)


def test_bad_hyperparameter_value_with_its_line(tmp_path):
    err = error_of(tmp_path, with_hyperparameters("  steps: 0\n"))
    assert (err.line, err.key) == (10, "hyperparameters.steps")
    assert "expected an integer in [1, 100000], got 0" in str(err)


def test_bad_list_item_line(tmp_path):
    err = error_of(tmp_path, with_hyperparameters("  target_modules:\n    - q_proj\n    - 7\n"))
    assert (err.line, err.key) == (12, "hyperparameters.target_modules[1]")


def test_unknown_env_key_with_its_line(tmp_path):
    text = VALID.replace(
        "env: {env_id: arithmetic, min_digits: 1, max_digits: 1}",
        "env:\n  env_id: arithmetic\n  digits: 2\n",
    )
    err = error_of(tmp_path, text)
    assert (err.line, err.key) == (10, "env.digits")


def test_spec_level_errors_map_to_yaml_keys(tmp_path):
    with pytest.raises(ConfigError) as exc:
        load_task_config(write(tmp_path, VALID.replace("workload_type: lora_finetune", "workload_type: lora")))
    first, unchecked = exc.value.problems  # the hyperparameters depend on the type: said, not checked
    assert (first.line, first.key) == (2, "workload_type")
    assert "expected one of lora_finetune, full_rl, sft, inference" in str(first)
    assert unchecked.key == "hyperparameters" and "not checked" in str(unchecked)
    err = error_of(tmp_path, VALID.replace("max_attempts: 3", "max_attempts: 1000"))
    assert (err.line, err.key) == (7, "max_attempts")
    err = error_of(tmp_path, VALID.replace("max_runtime: 600", "max_runtime: -1"))
    assert (err.line, err.key) == (6, "max_runtime")
    err = error_of(tmp_path, VALID.replace("gpu_count: 0", "gpu_count: -1"))
    assert (err.line, err.key) == (4, "gpu_count")


def test_missing_workload_type(tmp_path):
    err = error_of(tmp_path, "name: x\n")
    assert "missing workload_type" in str(err)


def test_duplicate_key(tmp_path):
    err = error_of(tmp_path, VALID + "gpu_count: 1\n")
    assert (err.line, err.key) == (10, "gpu_count")
    assert "duplicate key (first on line 4)" in str(err)


def test_not_yaml_and_not_a_mapping(tmp_path):
    err = error_of(tmp_path, "name: [unclosed\nworkload_type: x\n")
    assert "not valid YAML" in str(err) and err.line is not None
    err = error_of(tmp_path, "- a\n- b\n")
    assert "mapping" in str(err)
    err = error_of(tmp_path, "")
    assert "empty" in str(err)


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_task_config(tmp_path / "nope.yaml")


def test_to_proto_round_trip(tmp_path):
    cfg = load_task_config(write(tmp_path, VALID))
    spec = cfg.to_proto()
    assert spec.workload_type == "lora_finetune"
    assert spec.model == ".cache/models/SmolLM2-135M-Instruct"
    assert spec.name == "arithmetic-demo"
    assert spec.resources.gpu_count == 0
    assert spec.HasField("priority") and spec.priority == 5
    assert duration_to_seconds(spec.limits.max_runtime) == 600.0
    assert spec.limits.max_attempts == 3
    assert isinstance(spec.env_config, struct_pb2.Struct)
    assert struct_to_dict(spec.env_config) == dict(cfg.env)
    assert struct_to_dict(spec.hyperparameters) == dict(cfg.hyperparameters)
    # and back through the wire format
    from opentinker.common.v1 import common_pb2

    again = common_pb2.TaskSpec.FromString(spec.SerializeToString())
    assert again == spec


def test_to_proto_optional_fields_unset():
    spec = TaskConfig(workload_type="lora_finetune").to_proto()
    assert not spec.HasField("priority")
    assert not spec.limits.HasField("max_runtime")
    assert spec.limits.max_attempts == 0 and spec.model == ""
    spec = TaskConfig(workload_type="lora_finetune", priority=0, max_runtime=1.5).to_proto()
    assert spec.HasField("priority") and spec.priority == 0
    assert duration_to_seconds(spec.limits.max_runtime) == 1.5


def test_to_proto_refuses_unsendable_values():
    with pytest.raises(InvalidArgumentError, match="spec.hyperparameters"):
        TaskConfig(workload_type="lora_finetune", hyperparameters={"when": dt.date(2024, 1, 1)}).to_proto()


def test_check_names_spec_path():
    with pytest.raises(InvalidArgumentError) as exc:
        TaskConfig(workload_type="lora_finetune", hyperparameters={"steps": 0}).check()
    assert exc.value.field == "spec.hyperparameters.steps"


def test_parse_from_string():
    cfg = parse_task_config("workload_type: lora_finetune\n", source="inline")
    assert cfg.source == "inline"
    with pytest.raises(ConfigError, match=r"^INVALID_ARGUMENT: inline:2:1: foo: unknown key"):
        parse_task_config("workload_type: lora_finetune\nfoo: 1\n", source="inline")


# ---------------------------------------------------------------------------------------------
# YAML 1.2 floats: `learning_rate: 1e-4` is the common way to write it; PyYAML (YAML 1.1) alone
# reads it as a string.


@pytest.mark.parametrize(
    "text, value",
    [
        ("1e-4", 1e-4),
        ("5E+3", 5e3),
        ("1e4", 1e4),
        (".5", 0.5),
        ("-.5", -0.5),
        ("+.5", 0.5),
        ("-1e-3", -1e-3),
        ("+1e-4", 1e-4),
        ("1.5e3", 1.5e3),
        ("2.e-5", 2e-5),
        ("0.0002", 2e-4),
    ],
)
def test_yaml12_loader_reads_yaml12_floats(text, value):
    import yaml

    from opentinker_common.yaml12 import Yaml12Loader

    got = yaml.load(f"x: {text}", Loader=Yaml12Loader)["x"]
    assert isinstance(got, float) and got == pytest.approx(value)


@pytest.mark.parametrize(
    "text, value",
    [
        ("1", 1),
        ("-3", -3),
        ("0x1f", 31),
        ("09", "09"),
        ("1e", "1e"),
        ("e5", "e5"),
        ("1.2.3", "1.2.3"),
        ("'1e-4'", "1e-4"),
        ("true", True),
    ],
)
def test_yaml12_loader_leaves_other_scalars_alone(text, value):
    import yaml

    from opentinker_common.yaml12 import Yaml12Loader

    got = yaml.load(f"x: {text}", Loader=Yaml12Loader)["x"]
    assert got == value and type(got) is type(value)
    # SafeLoader itself is not changed by the subclass.
    assert yaml.safe_load("x: 1e-4")["x"] == "1e-4"


def test_yaml12_loader_keeps_line_numbers():
    import yaml

    from opentinker_common.yaml12 import Yaml12Loader

    root = yaml.compose("a: 1\nb:\n  lr: 1e-4\n", Loader=Yaml12Loader)
    (_, b_node) = root.value[1]
    key, value = b_node.value[0]
    assert value.tag == "tag:yaml.org,2002:float" and value.start_mark.line + 1 == 3


def test_learning_rate_in_exponent_form(tmp_path):
    cfg = load_task_config(
        write(tmp_path, "workload_type: lora_finetune\nhyperparameters:\n  learning_rate: 1e-4\n  steps: 3\n")
    )
    assert cfg.hyperparameters["learning_rate"] == pytest.approx(1e-4)
    assert isinstance(cfg.hyperparameters["learning_rate"], float)
    assert cfg.check().hyperparameters.learning_rate == pytest.approx(1e-4)
    # A bad value in the same form still points at its line.
    err = error_of(tmp_path, "workload_type: lora_finetune\nhyperparameters:\n  steps: 3\n  learning_rate: -1e-3\n")
    assert err.line == 4 and err.key == "hyperparameters.learning_rate"


def test_yaml11_boolean_words_stay_strings(tmp_path):
    cfg = load_task_config(
        write(
            tmp_path,
            "workload_type: full_rl\nname: no\nmodel: off\n"
            "env: {env_id: client, endpoint: '127.0.0.1:50123', action_space: 2, observation_space: 4,"
            " action_names: [no, yes]}\n",
        )
    )
    assert (cfg.name, cfg.model) == ("no", "off")
    assert cfg.env["action_names"] == ["no", "yes"]
    assert cfg.check().env.action_names == ("no", "yes")


def test_yaml11_boolean_word_for_a_bool_env_option_refused_with_a_hint(tmp_path):
    env = "env:\n  env_id: client\n  endpoint: '127.0.0.1:50123'\n  action_space: 2\n  observation_space: 4\n"
    err = error_of(tmp_path, f"workload_type: full_rl\n{env}  tls: off\n")
    assert (err.line, err.column, err.key) == (7, 3, "env.tls")
    assert "task.yaml:7:3: env.tls: expected true or false; 'off' is a string in YAML 1.2 — write false" in str(err)


@pytest.mark.parametrize(("word", "fix"), [("no", "false"), ("off", "false"), ("Yes", "true"), ("ON", "true")])
def test_yaml11_boolean_word_for_a_bool_key_refused_with_a_hint(tmp_path, word, fix):
    err = error_of(tmp_path, with_hyperparameters(f"  steps: 15\n  scale_rewards: {word}\n"))
    assert (err.line, err.column, err.key) == (11, 3, "hyperparameters.scale_rewards")
    assert (
        f"task.yaml:11:3: hyperparameters.scale_rewards: expected true or false; "
        f"'{word}' is a string in YAML 1.2 — write {fix}"
    ) in str(err)


def test_every_error_gives_line_and_column(tmp_path):
    err = error_of(tmp_path, with_hyperparameters("  steps: 15\n  lr: 0.0002\n"))
    assert (err.line, err.column) == (11, 3)
    assert "task.yaml:11:3: hyperparameters.lr: unknown key" in str(err)
    err = error_of(tmp_path, with_hyperparameters("  target_modules:\n    - q_proj\n    - 7\n"))
    assert (err.line, err.column) == (12, 7)
    err = error_of(tmp_path, VALID.replace("gpu_count: 0", "gpu_count: two"))
    assert (err.line, err.column) == (4, 1)
    err = error_of(tmp_path, "name: x\n")  # missing workload_type: the top mapping's start
    assert (err.line, err.column) == (1, 1) and "task.yaml:1:1: missing workload_type" in str(err)
    err = error_of(tmp_path, "workload_type: lora_finetune\nname: [unclosed\n")
    assert err.line is not None and err.column is not None
    assert f"task.yaml:{err.line}:{err.column}: not valid YAML" in str(err)
    err = error_of(tmp_path, "workload_type: lora_finetune\nname: !!bool no\n")
    assert (err.line, err.column) == (2, 7) and "not valid YAML" in str(err)
    err = error_of(tmp_path, "- a\n- b\n")
    assert (err.line, err.column) == (1, 1)
    err = error_of(tmp_path, "")
    assert (err.line, err.column) == (1, 1)


def test_typographic_quotes_and_bullets_in_a_task_config_are_refused_with_line_and_column(tmp_path):
    err = error_of(tmp_path, "workload_type: “lora_finetune”\n")
    assert (err.line, err.column) == (1, 16) and "typographic quote" in str(err) and 'straight "' in str(err)
    err = error_of(tmp_path, "workload_type: lora_finetune\nenv:\n• env_id: arithmetic\n")
    assert (err.line, err.column) == (3, 1) and "'•' (U+2022 bullet)" in str(err) and '"- "' in str(err)
    with pytest.raises(ConfigError) as both:  # every line's, at once
        load_task_config(write(tmp_path, "workload_type: “lora_finetune”\nenv:\n• env_id: arithmetic\n"))
    assert [(p.line, p.column) for p in both.value.problems] == [(1, 16), (3, 1)]
    assert len(str(both.value).splitlines()) == 2
    cfg = load_task_config(write(tmp_path, 'workload_type: lora_finetune\nname: "run “one”"  # • ok\n'))
    assert cfg.name == "run “one”"


def test_sft_without_a_dataset_says_it_needs_one_and_how_to_give_it(tmp_path):
    err = error_of(tmp_path, "workload_type: sft\n")
    assert (err.line, err.column, err.key) == (1, 1, "dataset")
    assert "sft needs a dataset: add `dataset: train.jsonl`" in str(err) and "arithmetic" not in str(err)
    err = error_of(tmp_path, "workload_type: sft\nenv: {env_id: CartPole-v1}\n")  # an environment named: where
    assert (err.line, err.key) == (2, "env.env_id") and "expected a dataset: sft trains on chat examples" in str(err)


def test_submit_task_sft_without_a_dataset_names_the_argument():
    from opentinker_client import RLClient

    with RLClient(scheduler_url="127.0.0.1:1") as client, pytest.raises(InvalidArgumentError) as err:
        client.submit_task(workload_type="sft", gpu_count=0)  # refused locally: nothing is dialled
    assert 'pass dataset="train.jsonl"' in str(err.value) and "arithmetic" not in str(err.value)


def test_a_bad_dataset_line_names_the_file_line_and_column(tmp_path):
    from opentinker_client import RLClient

    good = '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}'
    path = tmp_path / "train.jsonl"
    path.write_text(good + "\n" + good.replace('"yo"', "yo") + "\n")
    with RLClient(scheduler_url="127.0.0.1:1") as client, pytest.raises(InvalidArgumentError) as err:
        client.upload_dataset(path)  # checked before anything is sent
    column = good.index('"yo"') + 1
    assert str(err.value).startswith(f"INVALID_ARGUMENT: {path}:2:{column}: expected a JSON object")
    assert err.value.field == "dataset"


def test_every_bad_dataset_line_is_named_in_one_pass(tmp_path, capsys):
    from opentinker_client import RLClient
    from opentinker_client.cli.commands import main as cli_main

    good = '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}'
    no_reply = '{"messages": [{"role": "user", "content": "hi"}]}'
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join([good, "{oops", good, no_reply, good, "[1]"]) + "\n")
    with RLClient(scheduler_url="127.0.0.1:1") as client, pytest.raises(InvalidArgumentError) as err:
        client.upload_dataset(path)
    assert [text.split(": ")[0] for _, text in err.value.violations] == [f"{path}:2:2", f"{path}:4", f"{path}:6"]
    assert str(err.value).startswith(f"INVALID_ARGUMENT: 3 bad lines; first: {path}:2:2: expected")
    task = tmp_path / "task.yaml"
    task.write_text("workload_type: sft\ndataset: train.jsonl\n")
    assert cli_main(["--scheduler-url", "127.0.0.1:1", "submit", str(task)]) != 0  # checked before dialling
    printed = capsys.readouterr().err.splitlines()
    assert [line.split(": ")[2] for line in printed] == [f"{path}:2:2", f"{path}:4", f"{path}:6"], printed


def test_overrides_set_values_of_the_file_without_editing_it(tmp_path):
    from opentinker_client.config import apply_overrides

    cfg = load_task_config(write(tmp_path, VALID))
    new = apply_overrides(
        cfg, ["hyperparameters.steps=3", "hyperparameters.learning_rate=2e-4", "gpu_count=1", "name=tweaked"]
    )
    assert new.hyperparameters["steps"] == 3 and new.hyperparameters["learning_rate"] == 2e-4
    assert (new.gpu_count, new.name) == (1, "tweaked")
    assert cfg.gpu_count == 0  # the loaded config itself is unchanged
    assert "steps" not in apply_overrides(new, ["hyperparameters.steps=null"]).hyperparameters  # null: removed
    both = apply_overrides(cfg, ["nodes=2", "gpu_count=1", "tracking.tensorboard=/runs/tb"])
    assert (both.nodes, both.tracking) == (2, {"tensorboard": "/runs/tb"})
    assert apply_overrides(both, ["nodes=~"]).nodes == 1  # null: back to the default


@pytest.mark.parametrize(("text", "override"), [("abc", "abc"), ("-1", "-1"), ("5000", "5000")])
def test_a_bad_gpu_count_reads_the_same_in_the_file_and_in_set(tmp_path, text, override):
    """One wording, from the spec (opentinker_common.spec.task.EXPECTED), wherever the value came from."""
    from opentinker_client.config import apply_overrides

    with pytest.raises(ConfigError) as in_file:
        load_task_config(write(tmp_path, VALID.replace("gpu_count: 0", f"gpu_count: {text}")))
    with pytest.raises(ConfigError) as in_set:
        apply_overrides(load_task_config(write(tmp_path, VALID)), [f"gpu_count={override}"])
    assert str(in_file.value).split(": ", 2)[2] == str(in_set.value).split(": ", 2)[2]
    assert "gpu_count: expected an integer in [0, 1024] (0 = CPU task)" in str(in_set.value)


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("steps", "--set steps: expected KEY=VALUE"),
        ("bogus=1", "--set bogus=1: unknown key 'bogus'"),
        (
            "bogus=1",
            "gpu_count, nodes, priority, max_runtime, max_attempts, init_from, dataset, env.KEY, "
            "hyperparameters.KEY, tracking.KEY",
        ),
        ("gpu_count=two", "--set gpu_count=two: gpu_count: expected an integer in [0, 1024] (0 = CPU task), got 'two'"),
        ("gpu_count=-1", "--set gpu_count=-1: gpu_count: expected an integer in [0, 1024] (0 = CPU task), got -1"),
        ("nodes=x", "--set nodes=x: nodes: expected an integer in [1, 64] (nodes of a gang task), got 'x'"),
        (
            "hyperparameters.stesp=3",
            "--set hyperparameters.stesp=3: hyperparameters.stesp: unknown key, expected one of",
        ),
        ("hyperparameters.steps=-1", "--set hyperparameters.steps=-1: hyperparameters.steps: expected"),
        ("tracking.tensorboard=rel", "--set tracking.tensorboard=rel: tracking.tensorboard: expected an absolute"),
        ("name=“x”", "typographic quote"),
        (
            "hyperparameters.steps=",
            "--set hyperparameters.steps=: hyperparameters.steps: no value after '='; expected "
            "hyperparameters.steps=VALUE, or hyperparameters.steps=null to remove it and use its default",
        ),
        ("gpu_count=", "--set gpu_count=: gpu_count: no value after '='; expected gpu_count=VALUE, or gpu_count=null"),
        (
            "hyperparameters=3",
            "--set hyperparameters=3: hyperparameters: expected a key inside it, dotted: hyperparameters.KEY=VALUE "
            "(e.g. hyperparameters.steps=20); hyperparameters is a mapping",
        ),
        ("env=x", "--set env=x: env: expected a key inside it, dotted: env.KEY=VALUE (e.g. env.max_digits=2)"),
    ],
)
def test_a_bad_override_names_itself(tmp_path, override, needle):
    from opentinker_client.config import apply_overrides

    cfg = load_task_config(write(tmp_path, VALID))
    with pytest.raises(ConfigError) as err:
        apply_overrides(cfg, [override])
    assert needle in str(err.value), str(err.value)
