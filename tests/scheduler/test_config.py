"""Scheduler config: the seed's form loads; bad files are refused with file, line and key."""

from __future__ import annotations

import pytest

from opentinker_scheduler.config import ConfigError, load_config, parse_config

SEED = """\
resource_pool:
  - node_id: "gpu-node-01"
    gpu_count: 4
    max_tasks: 8
workload_types:
  - type: "lora_finetune"
    priority: 1
  - type: "full_rl"
    priority: 2
"""


def test_seed_config_loads() -> None:
    cfg = parse_config(SEED, "seed.yaml")
    assert cfg.pool_node("gpu-node-01").gpu_count == 4
    assert cfg.pool_node("gpu-node-01").max_tasks == 8
    assert cfg.priority_of("full_rl") == 2
    assert cfg.priority_of("lora_finetune") == 1
    assert cfg.priority_of("sft") is None
    assert cfg.workload_names == ("lora_finetune", "full_rl")
    assert cfg.max_tasks_per_gpu == 2 and cfg.preemption_timeout_s == 120.0  # documented defaults


@pytest.mark.parametrize(
    ("text", "line", "key"),
    [
        (SEED + "bogus: 1\n", 10, "bogus"),
        (SEED.replace("gpu_count: 4", "gpu_count: four"), 3, "resource_pool[0].gpu_count"),
        (SEED.replace("gpu_count: 4", "gpu_count: -1"), 3, "resource_pool[0].gpu_count"),
        (SEED.replace("max_tasks: 8", "max_task: 8"), 4, "resource_pool[0].max_task"),
        (SEED.replace('type: "full_rl"', 'type: "rlhf"'), 8, "workload_types[1].type"),
        (SEED.replace("priority: 2", "priority: high"), 9, "workload_types[1].priority"),
        (SEED + "lease: 1\nheartbeat_interval: 2\n", 10, "lease"),
        (SEED + "resource_pool: []\n", 10, "resource_pool"),
        (SEED + "max_tasks_per_gpu: 0\n", 10, "max_tasks_per_gpu"),
        (SEED + "max_tasks_per_gpu: two\n", 10, "max_tasks_per_gpu"),
        (SEED + "preemption_timeout: 0\n", 10, "preemption_timeout"),
        (SEED + "forget_disconnected_after: 0\n", 10, "forget_disconnected_after"),
        (SEED + "forget_disconnected_after: soon\n", 10, "forget_disconnected_after"),
    ],
)
def test_bad_config_names_file_line_and_key(text: str, line: int, key: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config(text, "cfg.yaml")
    msg = str(err.value)
    assert f"cfg.yaml:{line}:" in msg, msg
    assert key in msg, msg


def test_duplicate_node_refused() -> None:
    text = SEED.replace("workload_types:", '  - node_id: "gpu-node-01"\n    gpu_count: 1\nworkload_types:')
    with pytest.raises(ConfigError, match="appears twice"):
        parse_config(text, "cfg.yaml")


def test_missing_file_and_bad_yaml(tmp_path) -> None:
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("resource_pool: [\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)


def test_relative_paths_resolve_against_config_folder(tmp_path) -> None:
    (tmp_path / "models" / "m").mkdir(parents=True)
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text("state_dir: st\ndefault_model: models/m\n")
    cfg = load_config(cfg_file)
    assert cfg.state_dir == tmp_path / "st"
    assert cfg.default_model == str(tmp_path / "models" / "m")
    cfg_file.write_text("default_model: Qwen/Qwen2.5-0.5B-Instruct\n")
    assert load_config(cfg_file).default_model == "Qwen/Qwen2.5-0.5B-Instruct"


@pytest.mark.parametrize("value", [".nan", ".inf", "-.inf"])
def test_non_finite_seconds_refused(value: str) -> None:
    with pytest.raises(ConfigError, match="cfg.yaml:1:21: heartbeat_interval"):
        parse_config(f"heartbeat_interval: {value}\n", "cfg.yaml")


def test_non_utf8_config_refused(tmp_path) -> None:
    bad = tmp_path / "latin1.yaml"
    bad.write_bytes("state_dir: caf\xe9\n".encode("latin-1"))
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_config(bad)


def test_yaml12_floats_accepted() -> None:
    assert parse_config("heartbeat_interval: 5e-1\nlease: 1e1\n", "c.yaml").heartbeat_interval_s == 0.5


@pytest.mark.parametrize(("word", "fix"), [("no", "false"), ("off", "false"), ("yes", "true"), ("On", "true")])
def test_yaml11_boolean_word_for_a_bool_key_refused_with_a_hint(word: str, fix: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config(f"state_dir: st\nallow_unknown_nodes: {word}\n", "cfg.yaml")
    assert str(err.value) == (
        f"cfg.yaml:2:22: allow_unknown_nodes: expected true or false; '{word}' is a string in YAML 1.2 — write {fix}"
    )


def test_yaml11_boolean_words_stay_strings() -> None:
    cfg = parse_config('default_model: no\nresource_pool:\n  - node_id: off\nstate_dir: "on"\n', "cfg.yaml")
    assert cfg.default_model == "no" and cfg.pool_node("off") is not None
    assert str(cfg.state_dir) == "on"


def test_every_error_gives_line_and_column(tmp_path) -> None:
    with pytest.raises(ConfigError, match=r"^cfg\.yaml:3:16: resource_pool\[0\]\.gpu_count: expected an integer"):
        parse_config(SEED.replace("gpu_count: 4", "gpu_count: four"), "cfg.yaml")
    with pytest.raises(ConfigError, match=r"^cfg\.yaml:4:5: resource_pool\[0\]\.max_task: expected one of"):
        parse_config(SEED.replace("max_tasks: 8", "max_task: 8"), "cfg.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("state_dir: st\nresource_pool: [\n")
    with pytest.raises(ConfigError, match=rf"^{bad}:3:1: not valid YAML: "):
        load_config(bad)


def test_forget_disconnected_after_defaults_to_ten_minutes_and_is_read() -> None:
    assert parse_config(SEED, "c.yaml").forget_disconnected_after_s == 600.0
    assert parse_config(SEED + "forget_disconnected_after: 90\n", "c.yaml").forget_disconnected_after_s == 90.0


#: The deployment guide's config exactly as it is printed (bullets and typographic quotes).
GUIDE = """\
resource_pool:
• node_id: “gpu-node-01”
  gpu_count: 4
  max_tasks: 8

workload_types:

• type: “lora_finetune”
  priority: 1
• type: “full_rl”
  priority: 2
"""


def test_the_guides_bullets_and_curly_quotes_are_refused_with_the_character_and_what_to_type() -> None:
    with pytest.raises(ConfigError) as err:
        parse_config(GUIDE, "scheduler_config.yaml")
    assert str(err.value) == (
        "scheduler_config.yaml:2:1: '•' (U+2022 bullet) is not a YAML list marker; "
        'expected "- " (a hyphen, then a space)'
    )
    with pytest.raises(ConfigError) as err:  # bullets fixed, quotes not: the id would keep its quotes
        parse_config(GUIDE.replace("•", "-"), "scheduler_config.yaml")
    assert str(err.value).startswith("scheduler_config.yaml:2:12: '“' (U+201C left double quotation mark)")
    assert 'expected a straight " or no quotes' in str(err.value)
    fixed = parse_config(GUIDE.replace("•", "-").replace("“", '"').replace("”", '"'), "scheduler_config.yaml")
    assert fixed.pool_node("gpu-node-01").gpu_count == 4 and fixed.priority_of("full_rl") == 2


@pytest.mark.parametrize(
    ("text", "where", "expected"),
    [
        ("lease: !!foo 3\n", "1:8: lease", "without a YAML tag; got the tag !!foo"),
        ("lease: !!python/name:os.system 3\n", "1:8: lease", "got the tag !!python/name:os.system"),
        ("lease: !local 3\n", "1:8: lease", "got the tag !local"),
        ("lease: !!int abc\n", "1:8: lease", "got !!int 'abc' ('abc' is not a valid !!int)"),
        ("resource_pool: !!python/object:x []\n", "1:16: resource_pool", "a list, without a YAML tag"),
        ("auth: !!omap {enabled: true}\n", "1:7: auth", "a mapping, without a YAML tag; got the tag !!omap"),
        ("auth:\n  enabled: !!bool no\n", "2:12: auth.enabled", "'no' is a string in YAML 1.2 — write false"),
    ],
)
def test_a_bad_explicit_tag_is_a_config_error_with_line_and_column(text, where, expected) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config(text, "s.yaml")
    assert str(err.value).startswith(f"s.yaml:{where}: expected") and expected in str(err.value)
    assert "\n" not in str(err.value)


def test_explicit_core_tags_still_work() -> None:
    cfg = parse_config("lease: !!float 5\nheartbeat_interval: !!int 1\ndefault_model: !!str 7\n", "s.yaml")
    assert (cfg.lease_s, cfg.heartbeat_interval_s, cfg.default_model) == (5.0, 1.0, "7")


def test_http_on_grpc_port_is_on_unless_turned_off() -> None:
    assert parse_config("", "s.yaml").http_on_grpc_port is True
    assert parse_config("http_on_grpc_port: false\n", "s.yaml").http_on_grpc_port is False
    with pytest.raises(ConfigError, match=r"s.yaml:1:20: http_on_grpc_port: expected true or false; 'no' is a string"):
        parse_config("http_on_grpc_port: no\n", "s.yaml")
