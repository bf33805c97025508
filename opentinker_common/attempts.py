"""How a task's attempts read to a person: attempts used against ``max_attempts`` and the
hand-backs (preemption, drain, a node stopping its work) that do not count against it.

The scheduler grants one more attempt for each hand-back, so a task preempted three times may
be on attempt 4 with ``max_attempts`` 3 and only one attempt used; the CLI's ``get`` and the
dashboard show the same sentence (:func:`attempts_text`)."""

from __future__ import annotations


def attempts_text(attempt: int, max_attempts: int, handed_back: int = 0) -> str:
    """``attempt`` (1 for the first) as a phrase: ``"2 of 3"``, or with hand-backs
    ``"4: 1 of 3 used, 3 handed back (preempted, drained or node lost; not counted)"``; ``max_attempts`` 0
    (unknown) leaves the budget out (``"4"``, ``"4: 3 handed back ..."``)."""
    if handed_back <= 0:
        return f"{attempt} of {max_attempts}" if max_attempts else str(attempt)
    used = max(0, attempt - handed_back)
    budget = f"{used} of {max_attempts} used, " if max_attempts else ""
    return f"{attempt}: {budget}{handed_back} handed back (preempted, drained or node lost; not counted)"
