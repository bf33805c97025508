"""RL on a user's prompt dataset (``env_id: prompts``, env kind ``text``) with a verifiable reward.

A prompt dataset is a JSONL file, one prompt a line, holding what the reward needs beside it::

    {"prompt": "Tom has 3 apples and buys 4 more. How many now?", "answer": 7}
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}],
     "answer": "4", "id": "q2"}

``prompt`` (non-empty text) or ``messages`` (chat messages ending with a ``user`` one) is the
prompt; every other key is the line's *metadata*, handed to the reward (``reward.field`` names the
one a built-in verifier compares with, ``answer`` by default). It is uploaded like an SFT dataset
(``RLClient.upload_dataset(path, format="prompts")``: chunked, content-addressed, every line checked
by :func:`parse_prompt_line`) and named by ``dataset_id``, or read from ``path`` on the trainer node.

The reward (:class:`RewardConfig`): a built-in verifier of :mod:`opentinker_common.verifiers`
plus weighted shaping terms, or ``verifier: client`` — the user's own function served from the
user's process (``RLClient.serve_reward``), called at ``endpoint`` like a client-hosted
environment. At submit the scheduler runs :func:`check_sample` on the first :data:`SAMPLE_LINES`
lines: a verifier that cannot score them (a numeric verifier on non-numeric answers, a missing
answer field) is refused naming the lines.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Iterable

from opentinker_common.net.url import redact_userinfo
from opentinker_common.spec._parse import SpecError, num
from opentinker_common.spec.client_env import ClientEnvConfig, check_token, parse_endpoint
from opentinker_common.spec.registry import register_env
from opentinker_common.spec.sft import CHAT_ROLES, DatasetError, is_dataset_id, json_object_line
from opentinker_common.verifiers import EXTRACT_MODES, TERMS, VERIFIERS, VerifierError, check_expected

__all__ = [
    "CLIENT_VERIFIER",
    "DATASET_FORMATS",
    "PROMPT_KEYS",
    "PromptLine",
    "PromptsEnvConfig",
    "RewardConfig",
    "SAMPLE_LINES",
    "TermConfig",
    "check_sample",
    "expected_value",
    "parse_prompt_line",
    "verifier_names",
]

#: How a dataset's lines are checked on upload: ``chat`` (sft examples) or ``prompts`` (RL prompts).
DATASET_FORMATS: tuple[str, ...] = ("chat", "prompts")
#: The keys that hold the prompt; every other key of a line is metadata.
PROMPT_KEYS: tuple[str, ...] = ("prompt", "messages")
#: Lines checked against the reward at submit (the first ones of the file).
SAMPLE_LINES = 200
#: The reward computed by the user's own function in the user's process.
CLIENT_VERIFIER = "client"


def verifier_names() -> tuple[str, ...]:
    """Every ``reward.verifier`` accepted: the built-in ones, then ``client``."""
    return (*VERIFIERS, CLIENT_VERIFIER)


@dataclass(frozen=True)
class PromptLine:
    """One parsed line: its 1-based number, the prompt (text or messages) and the metadata."""

    lineno: int
    prompt: str | None
    messages: tuple[dict[str, str], ...] | None
    metadata: dict[str, Any]

    def text(self) -> str:
        """The prompt as plain text (the user messages joined) for a client reward."""
        if self.prompt is not None:
            return self.prompt
        return "\n".join(m["content"] for m in self.messages or () if m["role"] == "user")


def parse_prompt_line(line: str | bytes, lineno: int) -> PromptLine | None:
    """Check one JSONL line of a prompt dataset; None for a blank line (skipped).

    Raises:
        DatasetError: naming ``lineno`` and what was expected (no prompt, an empty prompt,
            malformed messages, not JSON).
    """
    obj = json_object_line(line, lineno, example='{"prompt": "...", "answer": ...}', wanted='a "prompt" or "messages"')
    if obj is None:
        return None
    has = [k for k in PROMPT_KEYS if k in obj]
    if not has:
        raise DatasetError(
            lineno, 'a "prompt" (text) or "messages" (chat messages ending with a user one)', sorted(obj)[:8]
        )
    if len(has) > 1:
        raise DatasetError(lineno, 'one of "prompt" or "messages", not both')
    metadata = {k: v for k, v in obj.items() if k not in PROMPT_KEYS}
    if has[0] == "prompt":
        prompt = obj["prompt"]
        if not isinstance(prompt, str) or not prompt.strip():
            raise DatasetError(lineno, '"prompt" to be non-empty text', prompt)
        return PromptLine(lineno, prompt, None, metadata)
    messages = obj["messages"]
    if not isinstance(messages, list) or not messages:
        raise DatasetError(lineno, 'a non-empty "messages" list', messages)
    out = []
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(msg, dict) or set(msg) != {"role", "content"}:
            raise DatasetError(lineno, f'{where} to be an object with just "role" and "content"', msg)
        if msg["role"] not in CHAT_ROLES:
            raise DatasetError(lineno, f"{where}.role to be one of {', '.join(CHAT_ROLES)}", msg["role"])
        if msg["role"] == "system" and i != 0:
            raise DatasetError(lineno, f'{where}: "system" only as the first message', msg["role"])
        if not isinstance(msg["content"], str):
            raise DatasetError(lineno, f"{where}.content to be a string", msg["content"])
        out.append({"role": msg["role"], "content": msg["content"]})
    if out[-1]["role"] != "user" or not out[-1]["content"].strip():
        raise DatasetError(lineno, 'the last message to be a non-empty "user" one (the model answers it)')
    return PromptLine(lineno, None, tuple(out), metadata)


@dataclass(frozen=True)
class TermConfig:
    """A shaping term added to the verifier's score: ``weight * term(reply)``.

    ``kind: length`` is 0 up to ``max_chars`` characters and falls to -1 at twice that (so a
    positive weight penalises rambling); ``kind: format`` is 1 when ``pattern`` matches the reply.
    """

    kind: str = field(default="", metadata={"choices": tuple(TERMS)})
    weight: float = num(0.1, -100.0, 100.0)
    max_chars: int = num(400, 1, 1_000_000)
    pattern: str = field(default="", metadata={"max_len": 1024})

    def check(self, path: str) -> None:
        if self.kind == "format":
            try:
                check_expected("regex", None, {"pattern": self.pattern})
            except VerifierError as exc:
                raise SpecError(f"{path}.pattern", str(exc).removeprefix("expected ")) from None
        elif self.pattern:
            raise SpecError(f"{path}.pattern", f"empty for kind {self.kind} (only format terms take a pattern)")

    def options(self) -> dict[str, Any]:
        return {"max_chars": self.max_chars} if self.kind == "length" else {"pattern": self.pattern}


@dataclass(frozen=True)
class RewardConfig:
    """How a reply is scored: ``weight * verifier(reply, line[field], **options) + terms``.

    Attributes:
        verifier: one of :func:`verifier_names` (``exact``, ``numeric``, ``choice``, ``regex``,
            ``json_schema``, ``client``); see :mod:`opentinker_common.verifiers` for each contract.
        field: the line's key holding the expected value (``answer``); ``regex`` and
            ``json_schema`` read it only when ``options`` give no ``pattern`` / ``schema``.
        options: the verifier's keyword options (``tolerance``, ``extract``, ``case_sensitive``,
            ``normalize_whitespace``, ``choices``, ``pattern``, ``full_match``, ``schema``).
        weight: weight of the verifier's score.
        terms: shaping terms (:class:`TermConfig`).
        endpoint, token, tls, tls_root_certificates, timeout_s, grace_s: ``verifier: client``
            only: where the user's RewardServer listens and how to reach it (the fields of a
            client-hosted environment, :class:`~opentinker_common.spec.client_env.ClientEnvConfig`).
        max_consecutive_failures: ``client`` only: Score calls in a row that fail (raise, time
            out, or give no usable reward at all) before the task ends FAILED with the reason.
    """

    verifier: str = dataclasses.field(default="numeric", metadata={"max_len": 64})
    field: str = dataclasses.field(default="answer", metadata={"max_len": 128})
    options: dict[str, Any] = dataclasses.field(default_factory=dict, metadata={"nested_depth": 8})
    weight: float = num(1.0, -100.0, 100.0)
    terms: tuple[TermConfig, ...] = ()
    endpoint: str = dataclasses.field(default="", metadata={"max_len": 300})
    token: str = dataclasses.field(default="", repr=False, metadata={"max_len": 1 << 30})
    tls: bool = False
    tls_root_certificates: str = dataclasses.field(default="", repr=False, metadata={"max_len": 1 << 30})
    timeout_s: float = num(30.0, 0.0, 3600.0, min_exclusive=True)
    grace_s: float = num(30.0, 0.0, 3600.0)
    max_consecutive_failures: int = num(3, 1, 1000)

    @property
    def is_client(self) -> bool:
        return self.verifier == CLIENT_VERIFIER

    def check(self, path: str) -> None:
        if self.verifier not in verifier_names():
            raise SpecError(f"{path}.verifier", f"one of {', '.join(verifier_names())}", self.verifier)
        if self.is_client:
            check_token(self.token, f"{path}.token")
            ClientEnvConfig._check_tls(self, path)  # the same TLS rules as a client-hosted environment
            if parse_endpoint(self.endpoint) is None:
                raise SpecError(
                    f"{path}.endpoint",
                    "host:port of the client's RewardServer, e.g. 127.0.0.1:50123 (RLClient.serve_reward sets it)",
                    redact_userinfo(self.endpoint),
                )
            if self.options:
                raise SpecError(f"{path}.options", "empty for verifier client (the function takes what it needs)")
            return
        if self.endpoint or self.token:
            raise SpecError(f"{path}.endpoint", f"empty unless verifier is {CLIENT_VERIFIER}")
        _, allowed, _ = VERIFIERS[self.verifier]
        for key in self.options:
            if key not in allowed:
                raise SpecError(
                    f"{path}.options.{key}",
                    f"an option of verifier {self.verifier} ({', '.join(allowed) or 'none'})",
                )
        opts = self.options
        if "extract" in opts and opts["extract"] not in EXTRACT_MODES:
            raise SpecError(f"{path}.options.extract", f"one of {', '.join(EXTRACT_MODES)}", opts["extract"])
        tol = opts.get("tolerance", 0)
        if isinstance(tol, bool) or not isinstance(tol, (int, float)) or tol < 0:
            raise SpecError(f"{path}.options.tolerance", "a number >= 0", opts["tolerance"])
        for key in ("case_sensitive", "normalize_whitespace", "full_match"):
            if key in opts and not isinstance(opts[key], bool):
                raise SpecError(f"{path}.options.{key}", "true or false", opts[key])
        if "choices" in opts and (not isinstance(opts["choices"], str) or not opts["choices"].isalpha()):
            raise SpecError(f"{path}.options.choices", "the valid letters, e.g. ABCD", opts["choices"])
        for verifier, key in (("regex", "pattern"), ("json_schema", "schema")):
            if self.verifier == verifier and key in opts:
                try:
                    check_expected(verifier, None, opts)
                except VerifierError as exc:
                    raise SpecError(f"{path}.options.{key}", str(exc).removeprefix("expected ")) from None

    def reads_field(self) -> bool:
        """Whether the verifier compares with ``line[field]`` (else its options say everything)."""
        if self.is_client:
            return False
        if self.verifier == "regex":
            return "pattern" not in self.options
        if self.verifier == "json_schema":
            return "schema" not in self.options
        return True


def expected_value(reward: RewardConfig, line: PromptLine) -> tuple[Any, str | None]:
    """``(line[reward.field], None)``, or ``(None, why)`` when the verifier cannot score this
    line (the field is missing, or of a kind the verifier does not take)."""
    if not reward.reads_field():
        return None, None
    if reward.field not in line.metadata:
        return None, f'no "{reward.field}" field (reward.field)'
    value = line.metadata[reward.field]
    try:
        check_expected(reward.verifier, value, reward.options)
    except VerifierError as exc:
        return None, f'"{reward.field}": {exc}'
    return value, None


def check_sample(reward: RewardConfig, lines: Iterable[str | bytes], path: str = "spec.env_config.reward") -> int:
    """Check that ``reward`` can score the first :data:`SAMPLE_LINES` lines of a prompt
    dataset; return how many prompts the sample had.

    Raises:
        SpecError: at ``path.verifier`` (or ``.field``), naming up to 5 offending lines and why,
            e.g. ``verifier numeric does not fit the dataset: line 3: "answer": expected a number,
            got 'seven'``; a malformed line is named at ``spec.env_config.dataset_id``.
    """
    bad: list[str] = []
    n = 0
    for lineno, raw in enumerate(lines, start=1):
        if lineno > SAMPLE_LINES:
            break
        try:
            line = parse_prompt_line(raw, lineno)
        except DatasetError as exc:
            raise SpecError("spec.env_config.dataset_id", f"a prompt dataset; dataset {exc}") from None
        if line is None:
            continue
        n += 1
        _, why = expected_value(reward, line)
        if why is not None:
            bad.append(f"line {lineno}: {why}")
    if bad:
        where = f"{path}.field" if all("field (reward.field)" in b for b in bad) else f"{path}.verifier"
        more = f" and {len(bad) - 5} more" if len(bad) > 5 else ""
        raise SpecError(
            where,
            f"a reward that fits the dataset; verifier {reward.verifier} cannot score "
            f"{len(bad)} of the first {n} prompts: " + "; ".join(bad[:5]) + more,
        )
    return n


@dataclass(frozen=True)
class PromptsEnvConfig:
    """``env_id: prompts``: GRPO on the prompts of a JSONL dataset, scored by ``reward``.

    Exactly one of ``dataset_id`` (uploaded with ``format="prompts"``) or ``path`` (a file on the
    trainer node) names the data. ``eval_fraction`` of the prompts (at least one when there are
    two or more; at most ``max_eval_prompts`` scored), chosen by ``seed``, are held out: every
    ``eval_every`` steps (and after the last) the trainer answers them greedily and reports
    ``eval/accuracy`` (share of replies whose verifier score is 1; for a client reward, reward
    >= ``eval_threshold``), ``eval/reward`` (mean reward) and ``eval/prompts``. A prompt whose
    tokens with ``max_new_tokens`` do not fit the model's context fails the task at start naming
    its lines; a line whose expected value is missing or unusable is skipped and counted in
    ``data/skipped_lines``.
    """

    env_id: str = "prompts"
    dataset_id: str | None = field(default=None, metadata={"max_len": 71})
    path: str | None = None
    reward: RewardConfig = field(default_factory=RewardConfig)
    eval_fraction: float = num(0.1, 0.0, 0.9, doc="share of prompts held out for eval/accuracy; 0 = none")
    eval_every: int = num(0, 0, 1_000_000, doc="steps between evaluations; 0 = only after the last step")
    max_eval_prompts: int = num(64, 1, 100_000, doc="held-out prompts answered per evaluation, at most")
    eval_threshold: float = num(1.0, -1e9, 1e9, doc="reward at or above which an eval reply counts as right")
    system_prompt: str | None = None
    seed: int = num(0, 0, 2**31 - 1, doc="seed of the train/eval split and of the prompt order")
    action_space: int | None = num(None, 1, 1_000_000)
    observation_space: int | None = num(None, 1, 1_000_000)

    def check(self, path: str) -> None:
        if (self.dataset_id is None) == (self.path is None):
            raise SpecError(
                f"{path}.dataset_id",
                'exactly one of dataset_id ("sha256:<hex>", from upload_dataset(..., format="prompts")) or path '
                "(a JSONL file on the trainer node)",
            )
        if self.dataset_id is not None and not is_dataset_id(self.dataset_id):
            raise SpecError(
                f"{path}.dataset_id", "sha256:<64 lowercase hex digits>, as upload_dataset returns", self.dataset_id
            )
        if self.path is not None and not self.path.startswith("/"):
            raise SpecError(f"{path}.path", "an absolute path of a JSONL file on the trainer node", self.path)


register_env(
    "prompts",
    PromptsEnvConfig,
    kind="text",
    description="a JSONL dataset of prompts, scored by a verifier or the client's own reward function",
)
