"""env_id prompts: the dataset line rules, the reward config, the sample check at submit, the split."""

from __future__ import annotations

import json

import pytest

from opentinker_common.prompts import PromptsEnv, load_lines
from opentinker_common.spec import SpecError, validate_env_config
from opentinker_common.spec.prompts import SAMPLE_LINES, check_sample, parse_prompt_line
from opentinker_common.spec.sft import DatasetError

DATASET = "sha256:" + "a" * 64


def env(**kw):
    return validate_env_config({"env_id": "prompts", "dataset_id": DATASET, **kw})


def jl(*objs) -> list[str]:
    return [json.dumps(o) for o in objs]


def test_a_prompt_line_and_a_chat_line_with_metadata() -> None:
    line = parse_prompt_line('{"prompt": "2+2?", "answer": 4, "id": "q1"}', 1)
    assert (line.prompt, line.metadata) == ("2+2?", {"answer": 4, "id": "q1"})
    chat = parse_prompt_line(
        json.dumps({"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]}), 2
    )
    assert chat.text() == "2+2?" and chat.metadata == {}
    assert parse_prompt_line("   ", 3) is None


@pytest.mark.parametrize(
    ("line", "words"),
    [
        ('{"answer": 4}', 'a "prompt" (text) or "messages"'),
        ('{"prompt": "", "answer": 4}', '"prompt" to be non-empty text'),
        ('{"prompt": 3}', '"prompt" to be non-empty text'),
        ('{"prompt": "a", "messages": []}', "not both"),
        ('{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}', "last message"),
        ('{"messages": [{"role": "robot", "content": "q"}]}', "role to be one of"),
        ("[1, 2]", "JSON object"),
        ('{"prompt": "a",', "JSON error at column"),
    ],
)
def test_bad_lines_name_their_line_number(line, words) -> None:
    with pytest.raises(DatasetError) as err:
        parse_prompt_line(line, 7)
    assert str(err.value).startswith("line 7: expected") and words in str(err.value)


def test_an_unknown_verifier_is_refused_listing_the_known_ones() -> None:
    with pytest.raises(SpecError) as err:
        env(reward={"verifier": "fuzzy"})
    assert err.value.field == "spec.env_config.reward.verifier"
    assert "exact, numeric, choice, regex, json_schema, client" in str(err.value)


@pytest.mark.parametrize(
    ("reward", "field"),
    [
        ({"verifier": "numeric", "options": {"schema": {}}}, "spec.env_config.reward.options.schema"),
        ({"verifier": "numeric", "options": {"extract": "first"}}, "spec.env_config.reward.options.extract"),
        ({"verifier": "numeric", "options": {"tolerance": -1}}, "spec.env_config.reward.options.tolerance"),
        ({"verifier": "regex", "options": {"pattern": "("}}, "spec.env_config.reward.options.pattern"),
        ({"verifier": "client"}, "spec.env_config.reward.endpoint"),
        ({"verifier": "numeric", "endpoint": "h:1"}, "spec.env_config.reward.endpoint"),
        ({"terms": [{"kind": "bonus"}]}, "spec.env_config.reward.terms[0].kind"),
        ({"terms": [{"kind": "format", "pattern": "["}]}, "spec.env_config.reward.terms[0].pattern"),
    ],
)
def test_bad_reward_configs_name_their_field(reward, field) -> None:
    with pytest.raises(SpecError) as err:
        env(reward=reward)
    assert err.value.field == field


def test_exactly_one_of_dataset_id_or_path() -> None:
    with pytest.raises(SpecError, match="exactly one of dataset_id"):
        validate_env_config({"env_id": "prompts"})
    with pytest.raises(SpecError, match="exactly one of dataset_id"):
        validate_env_config({"env_id": "prompts", "dataset_id": DATASET, "path": "/d.jsonl"})


def test_the_sample_check_names_the_lines_a_verifier_cannot_score() -> None:
    lines = jl(
        {"prompt": "a", "answer": 1},
        {"prompt": "b", "answer": "seven"},
        {"prompt": "c"},
        {"prompt": "d", "answer": "3.5"},
    )
    with pytest.raises(SpecError) as err:
        check_sample(env().reward, lines)
    msg = str(err.value)
    assert err.value.field == "spec.env_config.reward.verifier"
    assert "cannot score 2 of the first 4 prompts" in msg
    assert "line 2: \"answer\": expected a number, got 'seven'" in msg and 'line 3: no "answer" field' in msg
    assert check_sample(env(reward={"verifier": "exact"}).reward, lines[:2]) == 2  # text answers fit exact


def test_only_missing_fields_point_at_the_field_and_only_the_sample_is_read() -> None:
    with pytest.raises(SpecError) as err:
        check_sample(env(reward={"field": "label"}).reward, jl({"prompt": "a", "answer": 1}))
    assert err.value.field == "spec.env_config.reward.field"
    good = jl(*({"prompt": "q", "answer": i} for i in range(SAMPLE_LINES)))
    assert check_sample(env().reward, [*good, "not json at all"]) == SAMPLE_LINES  # past the sample: unread


def test_the_environment_skips_and_counts_lines_it_cannot_score_and_holds_out_an_eval_split() -> None:
    lines = load_lines(jl(*({"prompt": f"q{i}", "answer": i} for i in range(20)), {"prompt": "x"}, {"prompt": "y"}))
    e = PromptsEnv(env(eval_fraction=0.25), lines)
    assert e.skipped_lines == [21, 22]
    assert len(e.eval_problems) == 5 and len(e.train_problems) == 15
    assert not {p.line.lineno for p in e.eval_problems} & {p.line.lineno for p in e.train_problems}
    first = [p.line.lineno for p in e.sample(15)]
    assert sorted(first) == sorted(p.line.lineno for p in e.train_problems)  # one epoch: each once
    state = e.get_state()
    nxt = [p.line.lineno for p in e.sample(4)]
    e.set_state(json.loads(json.dumps(state)))  # through a file, as a checkpoint carries it
    assert [p.line.lineno for p in e.sample(4)] == nxt
    assert e.score_batch(["it is 3", "no"], [e.train_problems[0]] * 2) == [
        float(e.train_problems[0].expected == 3),
        0.0,
    ]


def test_no_usable_line_at_all_is_an_error() -> None:
    with pytest.raises(ValueError, match='all 2 lines lack a usable "answer"'):
        PromptsEnv(env(), load_lines(jl({"prompt": "a"}, {"prompt": "b", "answer": "x"})))
