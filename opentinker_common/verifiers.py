"""Built-in verifiers: small pure functions that score a model's reply against a dataset line.

Torch-free on purpose: the scheduler runs :func:`check_fit` at submit (a verifier that does not
fit the data is refused with line numbers), the trainer scores replies with
:func:`make_reward`, and a client can score replies itself with the same code.

Contract of every verifier: ``verify(reply, expected, **options) -> float`` in ``[0, 1]``; it never
raises on any ``reply`` (``None`` and ``""`` score 0.0); a bad ``expected`` (the dataset's value,
checked at submit by :func:`check_expected`) raises :class:`VerifierError`.

=================  =========================================================================
``exact``          1.0 when the reply equals the expected text; options ``case_sensitive``
                   (default false), ``normalize_whitespace`` (default true: runs of spaces,
                   tabs and newlines become one space, ends stripped).
``numeric``        1.0 when the reply's answer is within ``tolerance`` (absolute, default 1e-6)
                   of the expected number. Which number is the answer (``extract``): ``auto``
                   (default: the content of the last ``\\boxed{...}`` if any, else what follows
                   the last ``####``, else the last number), ``last``, ``boxed``, ``hash``.
                   Numbers are read by :func:`opentinker_common.arithmetic.last_number`'s rules
                   (``-7``, ``1,234``, ``7.5``).
``choice``         1.0 when the chosen letter (``answer: b``, ``(B)``, ``B)``, else the last
                   standalone capital letter) equals the expected letter; ``choices``
                   (default ``ABCD``) lists the valid letters.
``regex``          1.0 when ``pattern`` (an RE2 regex, option or the expected value) matches
                   anywhere in the reply; ``full_match: true`` needs the whole stripped reply
                   to match. Matching takes time linear in the reply
                   (:mod:`opentinker_common.patterns`): no backreferences or lookaround.
``json_schema``    1.0 when the reply (or its first ```` ```json ```` block) parses as JSON and
                   is valid against the schema (the ``schema`` option, or the line's expected
                   value); uses :mod:`jsonschema`.
=================  =========================================================================

Shaping terms (:func:`length_term`, :func:`format_term`) add small rewards on the reply's form;
:func:`make_reward` combines a verifier and terms as ``weight * verifier + sum(w_i * term_i)``.
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Any, Callable, Mapping, Sequence

from opentinker_common.arithmetic import last_number
from opentinker_common.documents import DocumentError, load_json
from opentinker_common.patterns import PatternError, compile_pattern

__all__ = [
    "VERIFIERS",
    "VerifierError",
    "check_expected",
    "choice",
    "exact",
    "extract_answer",
    "format_term",
    "json_schema",
    "length_term",
    "make_reward",
    "numeric",
    "parse_number",
    "regex",
]


class VerifierError(ValueError):
    """The expected value (from the dataset) or an option cannot be used by a verifier."""


_WS = re.compile(r"\s+")


def _norm(text: str, *, case_sensitive: bool, normalize_whitespace: bool) -> str:
    if normalize_whitespace:
        text = _WS.sub(" ", text).strip()
    return text if case_sensitive else text.casefold()


def exact(
    reply: str | None, expected: Any, *, case_sensitive: bool = False, normalize_whitespace: bool = True
) -> float:
    """1.0 when ``reply`` equals ``expected`` (a string, or a number written as its text) after
    normalisation (module docstring), else 0.0."""
    if reply is None:
        return 0.0
    want = _expected_text(expected)
    opts = {"case_sensitive": case_sensitive, "normalize_whitespace": normalize_whitespace}
    return 1.0 if _norm(reply, **opts) == _norm(want, **opts) else 0.0


def _expected_text(expected: Any) -> str:
    if isinstance(expected, bool) or not isinstance(expected, (str, int, float)):
        raise VerifierError(f"expected a string answer, got {type(expected).__name__} {expected!r:.60}")
    return expected if isinstance(expected, str) else str(expected)


def parse_number(expected: Any) -> Decimal:
    """The expected value as a number: an int, a finite float, or a string such as ``"42"``,
    ``"-3.5"``, ``"1,234"`` (the whole string must be one number).

    Raises:
        VerifierError: not a number.
    """
    if isinstance(expected, bool):
        raise VerifierError(f"expected a number, got {expected!r}")
    if isinstance(expected, int):
        return Decimal(expected)
    if isinstance(expected, float):
        if not math.isfinite(expected):
            raise VerifierError(f"expected a finite number, got {expected!r}")
        return Decimal(repr(expected))
    if isinstance(expected, str):
        text = expected.strip().replace("\u2212", "-")
        if re.fullmatch(r"-?[0-9]{1,3}(,[0-9]{3})+(\.[0-9]+)?|-?[0-9]+(\.[0-9]+)?", text):
            try:
                return Decimal(text.replace(",", ""))
            except InvalidOperation:  # pragma: no cover - the pattern admits only decimals
                pass
        raise VerifierError(f"expected a number, got {expected!r:.60}")
    raise VerifierError(f"expected a number, got {type(expected).__name__} {expected!r:.60}")


EXTRACT_MODES = ("auto", "last", "boxed", "hash")
_BOXED = re.compile(r"\\boxed\s*\{([^{}]*)\}")


def extract_answer(reply: str | None, extract: str = "auto") -> Decimal | None:
    """The number a reply gives as its answer (module docstring, ``numeric``), or None."""
    if not reply:
        return None
    if extract not in EXTRACT_MODES:
        raise VerifierError(f"extract: expected one of {', '.join(EXTRACT_MODES)}, got {extract!r}")
    if extract in ("auto", "boxed"):
        boxes = _BOXED.findall(reply)
        if boxes:
            return last_number(boxes[-1])
        if extract == "boxed":
            return None
    if extract in ("auto", "hash"):
        at = reply.rfind("####")
        if at >= 0:
            return last_number(reply[at + 4 :].split("\n", 1)[0]) if reply[at + 4 :].strip() else None
        if extract == "hash":
            return None
    return last_number(reply)


def numeric(reply: str | None, expected: Any, *, tolerance: float = 1e-6, extract: str = "auto") -> float:
    """1.0 when the reply's answer (``extract``) is within ``tolerance`` of ``expected``, else 0.0.

    Raises:
        VerifierError: ``expected`` is not a number, or ``extract`` is unknown.
    """
    want = parse_number(expected)
    got = extract_answer(reply, extract)
    if got is None:
        return 0.0
    return 1.0 if abs(got - want) <= Decimal(repr(float(tolerance))) else 0.0


_CHOICE_PATTERNS = (
    re.compile(r"(?i)answer\s*(?:is)?\s*[:=]?\s*\(?([A-Z])\)?(?![A-Za-z])"),
    re.compile(r"(?i)\(([A-Z])\)"),
    re.compile(r"(?i)(?<![A-Za-z])([A-Z])\)"),
    re.compile(r"(?<![A-Za-z])([A-Z])(?![A-Za-z])"),
)


def choice(reply: str | None, expected: Any, *, choices: str = "ABCD") -> float:
    """1.0 when the letter the reply picks equals ``expected`` (one of ``choices``), else 0.0.

    The pick is the last match of the first pattern that matches among ``answer: X`` /
    ``answer is (X)``, ``(X)``, ``X)`` (these in either case), and a standalone capital letter
    (a lone ``a`` is an article, not a pick); only letters in ``choices`` count.

    Raises:
        VerifierError: ``expected`` is not one of ``choices``.
    """
    want = _expected_text(expected).strip().strip("()").upper()
    if len(want) != 1 or want not in choices.upper():
        raise VerifierError(f"expected one of the letters {', '.join(choices.upper())}, got {expected!r:.60}")
    if not reply:
        return 0.0
    valid = set(choices.upper())
    for pattern in _CHOICE_PATTERNS:
        picks = [m.group(1).upper() for m in pattern.finditer(reply) if m.group(1).upper() in valid]
        if picks:
            return 1.0 if picks[-1] == want else 0.0
    return 0.0


def _compile(pattern: Any):
    try:
        return compile_pattern(pattern)
    except PatternError as exc:
        raise VerifierError(str(exc)) from None


def regex(reply: str | None, expected: Any = None, *, pattern: str = "", full_match: bool = False) -> float:
    """1.0 when ``pattern`` (else ``expected``) matches the reply, else 0.0.

    Raises:
        VerifierError: no pattern, or not one :func:`~opentinker_common.patterns.compile_pattern`
            accepts.
    """
    rx = _compile(pattern or expected)
    if reply is None:
        return 0.0
    hit = rx.fullmatch(reply.strip()) if full_match else rx.search(reply)
    return 1.0 if hit else 0.0


_JSON_BLOCK = compile_pattern(r"(?s)```(?:json)?\s*\n(.*?)```")


def _schema_validator(schema: Any):
    import jsonschema

    if not isinstance(schema, Mapping):
        raise VerifierError(f"expected a JSON schema (an object), got {type(schema).__name__}")
    cls = jsonschema.validators.validator_for(schema)
    try:
        cls.check_schema(schema)
    except jsonschema.SchemaError as exc:
        raise VerifierError(f"expected a valid JSON schema: {exc.message:.200}") from None
    _check_schema_patterns(schema)
    return _linear_time(cls)(schema)


def _check_schema_patterns(schema: Any) -> None:
    """Refuse a schema whose ``pattern`` or ``patternProperties`` RE2 cannot match."""
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, Mapping):
            patterns = [node.get("pattern")] if isinstance(node.get("pattern"), str) else []
            if isinstance(node.get("patternProperties"), Mapping):
                patterns += list(node["patternProperties"])
            for pattern in patterns:
                _compile(pattern)
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)


@functools.cache
def _linear_time(cls):
    """``cls`` (a jsonschema validator class) with ``pattern``, ``patternProperties`` and
    ``additionalProperties`` matched by RE2 instead of Python's backtracking ``re``."""
    import jsonschema

    def pattern(validator, patrn, instance, schema):
        if validator.is_type(instance, "string") and not _compile(patrn).search(instance):
            yield jsonschema.ValidationError(f"{instance!r:.80} does not match {patrn!r:.80}")

    def pattern_properties(validator, patterns, instance, schema):
        if not validator.is_type(instance, "object"):
            return
        for patrn, subschema in patterns.items():
            rx = _compile(patrn)
            for key, value in instance.items():
                if rx.search(key):
                    yield from validator.descend(value, subschema, path=key, schema_path=patrn)

    def additional_properties(validator, extra_schema, instance, schema):
        if not validator.is_type(instance, "object"):
            return
        known = schema.get("properties", {})
        rxs = [_compile(p) for p in schema.get("patternProperties", {})]
        extras = [k for k in instance if k not in known and not any(rx.search(k) for rx in rxs)]
        if validator.is_type(extra_schema, "object"):
            for key in extras:
                yield from validator.descend(instance[key], extra_schema, path=key)
        elif not extra_schema and extras:
            names = ", ".join(repr(k) for k in sorted(extras, key=str)[:10])
            yield jsonschema.ValidationError(f"additional properties are not allowed ({names} unexpected)")

    return jsonschema.validators.extend(
        cls,
        {"pattern": pattern, "patternProperties": pattern_properties, "additionalProperties": additional_properties},
    )


def json_schema(reply: str | None, expected: Any = None, *, schema: Mapping[str, Any] | None = None) -> float:
    """1.0 when the reply (or its first fenced code block) is JSON valid against ``schema``
    (else ``expected``, a schema object or its JSON text), else 0.0.

    Raises:
        VerifierError: no schema, or not a valid JSON schema.
    """
    chosen = schema if schema else expected
    if isinstance(chosen, str):
        try:
            chosen = load_json(chosen)
        except DocumentError as exc:
            raise VerifierError(f"expected a JSON schema, got text that is not JSON: {chosen!r:.60} ({exc})") from None
    validator = _schema_validator(chosen)
    if not reply:
        return 0.0
    block = _JSON_BLOCK.search(reply)
    text = block.group(1) if block else reply.strip()
    try:
        value = load_json(text)
    except DocumentError:
        return 0.0
    return 1.0 if validator.is_valid(value) else 0.0


# --- shaping terms ------------------------------------------------------------------------------


def length_term(reply: str | None, *, max_chars: int = 400) -> float:
    """-1.0 .. 0.0: how far past ``max_chars`` characters the reply runs (0.0 at or under it,
    -1.0 at twice the length or more). Weighted by the term's weight in :func:`make_reward`."""
    n = len(reply or "")
    if n <= max_chars:
        return 0.0
    return -min(1.0, (n - max_chars) / max(1, max_chars))


def format_term(reply: str | None, *, pattern: str) -> float:
    """1.0 when ``pattern`` matches somewhere in the reply (e.g. ``"####\\s*-?[0-9]"``), else 0.0."""
    rx = _compile(pattern)
    return 1.0 if reply and rx.search(reply) else 0.0


#: Verifier name -> (function, option names it takes, whether it reads a field of the line).
VERIFIERS: dict[str, tuple[Callable[..., float], tuple[str, ...], bool]] = {
    "exact": (exact, ("case_sensitive", "normalize_whitespace"), True),
    "numeric": (numeric, ("tolerance", "extract"), True),
    "choice": (choice, ("choices",), True),
    "regex": (regex, ("pattern", "full_match"), False),
    "json_schema": (json_schema, ("schema",), False),
}

TERMS: dict[str, tuple[Callable[..., float], tuple[str, ...]]] = {
    "length": (length_term, ("max_chars",)),
    "format": (format_term, ("pattern",)),
}


def check_expected(verifier: str, expected: Any, options: Mapping[str, Any]) -> None:
    """Raise :class:`VerifierError` when ``expected`` (a line's value; None when the line has
    none) cannot be scored by ``verifier`` with ``options`` — what :func:`check_fit` runs on a
    sample of lines at submit."""
    fn, _, _ = VERIFIERS[verifier]
    fn("", expected, **options)  # every verifier checks ``expected`` before reading the reply


@dataclass(frozen=True)
class Term:
    """One shaping term of a reward: ``weight * TERMS[kind](reply, **options)``."""

    kind: str
    weight: float
    options: Mapping[str, Any]


def make_reward(
    verifier: str, options: Mapping[str, Any], *, weight: float = 1.0, terms: Sequence[Term] = ()
) -> Callable[[str | None, Any], float]:
    """``reward(reply, expected) = weight * verifier(reply, expected, **options) + sum of terms``.

    Raises:
        VerifierError: an unknown verifier or term name (listing the known ones).
    """
    if verifier not in VERIFIERS:
        raise VerifierError(f"verifier: expected one of {', '.join(VERIFIERS)}, got {verifier!r:.60}")
    fn, _, _ = VERIFIERS[verifier]
    shaped = []
    for t in terms:
        if t.kind not in TERMS:
            raise VerifierError(f"term: expected one of {', '.join(TERMS)}, got {t.kind!r:.60}")
        shaped.append((TERMS[t.kind][0], t.weight, dict(t.options)))
    opts = dict(options)

    def reward(reply: str | None, expected: Any) -> float:
        total = weight * fn(reply, expected, **opts)
        for term_fn, w, o in shaped:
            total += w * term_fn(reply, **o)
        return total

    return reward
