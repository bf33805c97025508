"""Scheduler config: the seed's form loads; bad files are refused with file, line and key."""

from __future__ import annotations

from pathlib import Path

import pytest

from opentinker_scheduler.config import ConfigError, load_config, parse_config
from tests.support.procs import Proc, free_port_pair, scheduler_args

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


def test_store_defaults_to_sqlite_and_reads_postgres() -> None:
    assert parse_config("").store.kind == "sqlite"
    cfg = parse_config(
        "store:\n  kind: postgres\n  dsn: host=db dbname=opentinker user=ot\n  password_env: OT_DB_PASSWORD\n"
        "  schema: ot\n  leader_lease: 6\n  renew_interval: 1\n  synchronous_commit: false\n",
        "cfg.yaml",
    )
    s = cfg.store
    assert s.synchronous_commit is False
    assert (s.kind, s.dsn, s.password_env, s.schema, s.leader_lease_s, s.renew_interval_s) == (
        "postgres",
        "host=db dbname=opentinker user=ot",
        "OT_DB_PASSWORD",
        "ot",
        6.0,
        1.0,
    )


@pytest.mark.parametrize(
    "text,where",
    [
        ("store:\n  kind: mysql\n", "cfg.yaml:2:9: store.kind: expected sqlite or postgres, got 'mysql'"),
        (
            "store:\n  kind: postgres\n",
            "cfg.yaml:2:3: store.dsn: expected a libpq connection string with kind postgres",
        ),
        ("store:\n  dsn: host=db\n", "cfg.yaml:2:8: store.dsn: expected no dsn with kind sqlite"),
        (
            "store:\n  kind: postgres\n  dsn: host=db password=hunter2\n",
            "cfg.yaml:3:8: store.dsn: expected a connection string without a password",
        ),
        (
            "store:\n  kind: postgres\n  dsn: postgresql://ot:hunter2@db/ot\n",
            "cfg.yaml:3:8: store.dsn: expected a connection string without a password",
        ),
        (
            "store:\n  kind: postgres\n  dsn: host=db\n  password_env: A\n  password_file: /f\n",
            "cfg.yaml:5:18: store.password_file: expected only one of password_env and password_file",
        ),
        (
            "store:\n  kind: postgres\n  dsn: host=db\n  schema: a-b\n",
            "cfg.yaml:4:11: store.schema: expected a plain identifier",
        ),
        (
            "store:\n  kind: postgres\n  dsn: host=db\n  leader_lease: 3\n  renew_interval: 2\n",
            "cfg.yaml:5:19: store.renew_interval: expected at most a third of store.leader_lease",
        ),
        ("store:\n  kind: postgres\n  dsn: host=db\n  leasee: 3\n", "cfg.yaml:4:3: store.leasee: expected one of"),
        (
            "store:\n  kind: postgres\n  dsn: host=db\n  flush: thread\n",
            "cfg.yaml:4:3: store.flush: expected no such key: it was removed",
        ),
        ("store:\n  flush: inline\n", "cfg.yaml:2:3: store.flush: expected no such key: it was removed"),
    ],
)
def test_bad_store_section_names_the_field(text: str, where: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(text, "cfg.yaml")
    assert str(info.value).startswith(where), str(info.value)
    assert "hunter2" not in str(info.value), "a password in the DSN was echoed"


def test_store_password_from_env_or_file(tmp_path, monkeypatch) -> None:
    from opentinker_scheduler.config.store import StoreConfig

    monkeypatch.setenv("OT_DB_PASSWORD", "pw-from-env")
    assert StoreConfig(kind="postgres", dsn="host=db", password_env="OT_DB_PASSWORD").password() == "pw-from-env"
    f = tmp_path / "pw"
    f.write_text("pw-from-file\n")
    assert StoreConfig(kind="postgres", dsn="host=db", password_file=str(f)).password() == "pw-from-file"
    assert StoreConfig(kind="postgres", dsn="host=db").password() is None
    with pytest.raises(OSError, match="store.password_file: cannot read"):
        StoreConfig(kind="postgres", dsn="host=db", password_file=str(tmp_path / "none")).password()


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
    lines = str(err.value).splitlines()  # every one of them, in order, in one pass
    assert lines[0] == (
        "scheduler_config.yaml:2:1: '•' (U+2022 bullet) is not a YAML list marker; "
        'expected "- " (a hyphen, then a space)'
    )
    assert [line.split(": ")[0] for line in lines] == [
        f"scheduler_config.yaml:{at}:1" for at in (2, 8, 10)
    ]  # the first on each line
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


def test_http_metrics_token_file_is_read_at_start_and_checked(tmp_path) -> None:
    (tmp_path / "scrape.token").write_text("0123456789abcdef0123\n")
    cfg = parse_config("http_metrics_token_file: scrape.token\n", "s.yaml", base_dir=tmp_path)
    assert cfg.http_metrics_token == "0123456789abcdef0123" and "0123456789abcdef" not in repr(cfg)
    (tmp_path / "short.token").write_text("abc\n")
    with pytest.raises(ConfigError, match=r"s\.yaml:1:26: http_metrics_token_file: .*at least 16 printable"):
        parse_config("http_metrics_token_file: short.token\n", "s.yaml", base_dir=tmp_path)
    with pytest.raises(ConfigError, match=r"s\.yaml:1:26: http_metrics_token_file: .*readable token file"):
        parse_config("http_metrics_token_file: missing.token\n", "s.yaml", base_dir=tmp_path)


QUEUES = """\
queues:
  - name: team-a
    gpus: 8
    cpu_tasks: 16
    borrowing_limit: {gpus: 4}
    owners: [alice, bob]
  - name: team-b
    gpus: 4
    limits: {max_pending_per_owner: 5, submit_rate: 0.5}
default_queue: team-b
"""


def test_queues_section_reads_quotas_borrowing_and_owners() -> None:
    cfg = parse_config(QUEUES, "cfg.yaml")
    a, b = cfg.queues
    assert (a.name, a.gpus, a.cpu_tasks, a.borrowing_gpus, a.borrowing_cpu_tasks, a.owners) == (
        "team-a",
        8,
        16,
        4,
        None,
        ("alice", "bob"),
    )
    assert (b.gpus, b.cpu_tasks, b.owners) == (4, 0, ()) and cfg.default_queue == "team-b"
    assert (b.max_pending_per_owner, b.submit_rate, b.submit_burst, a.submit_rate) == (5, 0.5, None, None)
    assert parse_config("", "cfg.yaml").queues == ()


@pytest.mark.parametrize(
    ("text", "where"),
    [
        (QUEUES.replace("gpus: 8", "gpus: -1"), "cfg.yaml:3:11: queues[0].gpus: expected an integer in [0, 1000000]"),
        (QUEUES.replace("team-b\n    gpus", "team-a\n    gpus"), "cfg.yaml:7:11: queues[1].name: expected a unique"),
        (QUEUES.replace("{gpus: 4}", "{gpu: 4}"), "cfg.yaml:5:23: queues[0].borrowing_limit.gpu: expected one of"),
        (QUEUES.replace("gpus: 4\n", "gpus: 4\n    owners: [bob]\n"), "cfg.yaml:9:14: queues[1].owners[0]: expected"),
        (QUEUES.replace("name: team-a", "name: 'team a'"), "cfg.yaml:2:11: queues[0].name: expected a queue name"),
        (QUEUES.replace("default_queue: team-b", "default_queue: '#'"), "cfg.yaml:10:16: default_queue: expected"),
        (QUEUES.replace("submit_rate: 0.5", "submit_rate: -1"), "cfg.yaml:9:53: queues[1].limits.submit_rate"),
    ],
)
def test_bad_queues_section_names_the_field(text: str, where: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(text, "cfg.yaml")
    assert str(info.value).startswith(where), str(info.value)


def test_a_config_naming_the_removed_store_flush_key_stops_the_scheduler_at_start(tmp_path: Path) -> None:
    config = tmp_path / "old.yaml"
    config.write_text(SEED + "store:\n  kind: postgres\n  dsn: host=db\n  flush: background\n")
    port = free_port_pair()
    args = scheduler_args(config, port=port, http_port=port + 1, state_dir=tmp_path / "state", host="127.0.0.1")
    proc = Proc(args, tmp_path / "scheduler.log")
    try:
        assert proc.wait_exit(what="the scheduler refuses its config") == 2
    finally:
        proc.close()
    assert f"error: {config}:13:3: store.flush: expected no such key: it was removed" in proc.log_text()


def test_model_names_map_tinker_names_to_folders_relative_to_the_config(tmp_path) -> None:
    for name in ("a", "b"):
        (tmp_path / "models" / name).mkdir(parents=True)
        (tmp_path / "models" / name / "config.json").write_text("{}")
    text = "model_names:\n  - {name: org/A, folder: models/a}\n  - {name: org/B, folder: %s}\n" % (
        tmp_path / "models" / "b"
    )
    (tmp_path / "c.yaml").write_text(text)
    cfg = load_config(tmp_path / "c.yaml")
    assert [(m.name, m.folder) for m in cfg.model_names] == [
        ("org/A", str(tmp_path / "models" / "a")),
        ("org/B", str(tmp_path / "models" / "b")),
    ]
    assert parse_config("").model_names == ()


@pytest.mark.parametrize(
    "entries, where",
    [
        (
            "  - {name: org/A, folder: models/a}\n  - {name: org/A, folder: models/a}\n",
            "c.yaml:3:12: model_names[1].name: expected each name once; 'org/A' is listed already",
        ),
        (
            "  - {name: org/A, folder: models/nope}\n",
            "c.yaml:2:27: model_names[0].folder: expected a model folder holding config.json, got 'models/nope'",
        ),
        ("  - {name: org/A}\n", "c.yaml:2:5: model_names[0].folder: expected a value; missing"),
        (
            "  - {name: '', folder: models/a}\n",
            "c.yaml:2:12: model_names[0].name: expected a model name of 1 to 200 characters",
        ),
        (
            "  - {name: org/A, folder: models/a, rank: 8}\n",
            "c.yaml:2:37: model_names[0].rank: expected one of the known keys",
        ),
    ],
)
def test_bad_model_names_are_refused_naming_the_entry(tmp_path, entries: str, where: str) -> None:
    (tmp_path / "models" / "a").mkdir(parents=True)
    (tmp_path / "models" / "a" / "config.json").write_text("{}")
    (tmp_path / "c.yaml").write_text("model_names:\n" + entries)
    with pytest.raises(ConfigError) as err:
        load_config(tmp_path / "c.yaml")
    assert str(err.value).startswith(str(tmp_path / where)), err.value


def test_every_error_of_a_config_comes_at_once_in_file_order(tmp_path) -> None:
    path = tmp_path / "scheduler.yaml"
    path.write_text("leese: 10\nheartbeat_interval: x\nstate_dir: [1]\nbogus: 1\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    lines = str(err.value).splitlines()
    assert [line.split(": ", 2)[1] for line in lines] == ["leese", "heartbeat_interval", "state_dir", "bogus"]
    assert lines[0].startswith(f"{path}:1:1: leese: ") and lines[0].endswith("did you mean 'lease'?")
    assert lines[1].startswith(f"{path}:2:21: heartbeat_interval: expected a number")
