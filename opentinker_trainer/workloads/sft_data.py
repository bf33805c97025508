"""Data side of ``sft``: read or fetch a chat JSONL dataset, split it, and tokenise examples with
the model's chat template so that only assistant tokens are trained on.

Which tokens are trained on: each assistant message's content and the template's end-of-turn
token after it (``<|im_end|>`` for ChatML templates such as SmolLM2's and Qwen's), so the model
learns what to say and when to stop; never the system or user text, the role headers
(``<|im_start|>assistant\\n``) or the whitespace between turns. The spans are found on the
rendered text (the template rendered for the conversation up to each assistant message, with the
generation prompt, is a prefix of the one that includes it) and mapped to tokens by their
character offsets, so they do not depend on how the tokenizer merges text across a boundary.
"""

from __future__ import annotations

import hashlib
import os
import random
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from opentinker_common.spec.sft import MAX_BAD_LINES, DatasetError, is_dataset_id, parse_chat_line
from opentinker_common.datasets import DEFAULT_MAX_DATASET_BYTES
from opentinker_trainer.context import UserError

__all__ = [
    "IGNORE_INDEX",
    "MAX_DATASET_BYTES",
    "Encoded",
    "assistant_char_spans",
    "assistant_label_mask",
    "batch_indices",
    "collate",
    "encode_chat",
    "fetch_dataset",
    "read_chat_jsonl",
    "task_dataset",
    "read_jsonl",
    "split_indices",
]

#: Largest dataset file read, in bytes: the scheduler's upload limit (256 MiB).
MAX_DATASET_BYTES = DEFAULT_MAX_DATASET_BYTES

#: Label of a token that is not trained on (what ``torch.nn.functional.cross_entropy`` ignores).
IGNORE_INDEX = -100

Messages = list[dict[str, str]]


# --------------------------------------------------------------------------------------------
# Reading and fetching


_KINDS = (
    (stat.S_ISDIR, "a folder"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISSOCK, "a socket"),
)


def _open_dataset(path: Path, max_bytes: int):
    """``path`` opened for reading, after checking that it is a regular file of at most
    ``max_bytes`` bytes: before opening (a device or FIFO is never opened) and again on the open
    descriptor (a file swapped in between cannot slip in; opened non-blocking so a FIFO swapped
    in is refused instead of waiting for a writer). Nothing is read before the checks pass.

    Raises:
        UserError: ``dataset <path> cannot be used by this task: <why>``.
    """

    def refuse(why: str) -> UserError:
        return UserError(f"dataset {path} cannot be used by this task: {why}")

    def check(st: os.stat_result) -> None:
        if not stat.S_ISREG(st.st_mode):
            kind = next((name for test, name in _KINDS if test(st.st_mode)), "not a regular file")
            raise refuse(f"expected a regular file, got {kind}")
        if st.st_size > max_bytes:
            raise refuse(
                f"expected at most {max_bytes} bytes ({max_bytes / 2**20:g} MiB, the upload limit), "
                f"got {st.st_size} bytes"
            )

    try:
        check(os.stat(path))  # a device or FIFO is not even opened
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError as exc:
        raise refuse(f"it cannot be read on this trainer node ({exc.strerror or exc})") from None
    try:
        check(os.fstat(fd))  # the file opened, should it have been swapped since
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_chat_jsonl(path: Path, *, max_bytes: int = MAX_DATASET_BYTES) -> list[Messages]:
    """Every example of the chat JSONL file at ``path`` (blank lines skipped).

    The file must be a regular file (not a folder, device or FIFO) of at most ``max_bytes``
    bytes (:data:`MAX_DATASET_BYTES`, the scheduler's upload limit); a file that grows past it
    while being read is refused too, so a read never goes on without bound.

    Raises:
        UserError: ``dataset <path> cannot be used by this task: <why>`` (cannot be read, not a
            regular file, too large), lines that are not chat examples (each named with its
            number and what was expected, up to :data:`MAX_BAD_LINES`), or there is no example
            at all.
    """
    return read_jsonl(path, parse_chat_line, max_bytes=max_bytes)


def read_jsonl(path: Path, parse: Callable[[bytes, int], Any], *, max_bytes: int = MAX_DATASET_BYTES) -> list[Any]:
    """``parse(line, lineno)`` of every line of the JSONL file at ``path`` that gives not None
    (blank lines), with the file checks and errors of :func:`read_chat_jsonl`; ``parse`` raises
    :class:`~opentinker_common.spec.sft.DatasetError` for a bad line (e.g.
    :func:`~opentinker_common.spec.prompts.parse_prompt_line` for a prompt dataset)."""
    examples: list[Any] = []
    bad: list[str] = []
    more = False
    try:
        with _open_dataset(path, max_bytes) as fh:
            read, lineno = 0, 0
            while raw := fh.readline(max_bytes - read + 1):  # bounded even when one line never ends
                read += len(raw)
                lineno += 1
                if read > max_bytes:
                    raise UserError(
                        f"dataset {path} cannot be used by this task: expected at most {max_bytes} bytes, "
                        "and it grew past that while being read"
                    )
                try:
                    item = parse(raw.rstrip(b"\r\n"), lineno)
                except DatasetError as exc:
                    if len(bad) == MAX_BAD_LINES:
                        more = True
                        break
                    bad.append(exc.at(str(path)))
                    continue
                if item is not None:
                    examples.append(item)
    except OSError as exc:
        raise UserError(
            f"dataset {path} cannot be used by this task: "
            f"it cannot be read on this trainer node ({exc.strerror or exc})"
        ) from None
    if len(bad) == 1:
        raise UserError(f"dataset {bad[0]}")
    if bad:
        count = f"the first {len(bad)} bad lines (it has more)" if more else f"{len(bad)} bad lines"
        raise UserError(f"dataset {path}: {count}: " + "; ".join(bad))
    if not examples:
        raise UserError(f"dataset {path}: expected at least one example (one JSON object per line), got an empty file")
    return examples


def task_dataset(ctx, dataset_id: str) -> Path:
    """:func:`fetch_dataset` for the worker of ``ctx`` (a ``WorkerContext``): its artifact store
    and node-local cache (``ctx.publisher``), the scheduler and the dataset cache the agent set."""
    cache = Path(os.environ.get("OPENTINKER_DATASET_CACHE") or Path(ctx.checkpoint_dir).parent / "datasets")
    publisher = getattr(ctx, "publisher", None)
    return fetch_dataset(
        dataset_id,
        os.environ.get("OPENTINKER_SCHEDULER_URL"),
        cache,
        store=getattr(publisher, "store", None),
        artifact_cache=getattr(publisher, "cache", None),
        env=ctx.scheduler_env() if hasattr(ctx, "scheduler_env") else None,
    )


def fetch_dataset(
    dataset_id: str, scheduler_target: str | None, cache_dir: Path, *, store=None, artifact_cache=None, env=None
) -> Path:
    """The local file of an uploaded dataset.

    With an ``s3`` artifact ``store`` (and the node's ``artifact_cache``), read from the bucket
    directly with this process's credentials (:func:`~opentinker_trainer.worker_artifacts.fetch_dataset_artifact`:
    the artifact ``datasets/<hex>``, cached by hash, checked against the id); the scheduler is
    asked only for a dataset the bucket does not have. Otherwise (the ``local`` store, or no
    store): from ``cache_dir`` when there, else downloaded from the scheduler
    (``NodeService.FetchDataset``, with the key of ``env``, default ``os.environ``: the attempt's
    credential) and checked against its SHA-256. The
    download goes to a temporary file renamed into place once complete and verified, so
    concurrent workers on one node and crashed downloads never leave a wrong file behind.

    Raises:
        UserError: no scheduler address is known, the scheduler has no such dataset, or the
            store's copy is corrupt (its bytes do not hash to the id: refused, not retried).
        RuntimeError: the download failed or did not match its hash, or the store cannot be
            read now (a retry may succeed).
    """
    import grpc

    from opentinker.node.v1 import node_pb2, node_pb2_grpc
    from opentinker_trainer.scheduler_link import scheduler_channel

    if not is_dataset_id(dataset_id):
        raise UserError(f"env_config.dataset_id: expected sha256:<64 hex digits>, got {dataset_id!r}")
    hex_ = dataset_id.removeprefix("sha256:")
    if store is not None and artifact_cache is not None and store.backend == "s3":
        from opentinker_common.artifacts import ArtifactCorrupt, ArtifactError
        from opentinker_trainer.worker_artifacts import fetch_dataset_artifact

        try:
            got = fetch_dataset_artifact(store, artifact_cache, dataset_id)
        except ArtifactCorrupt as exc:
            raise UserError(
                f"env_config.dataset_id: dataset {dataset_id} in the {store.describe()} is corrupt: {exc} "
                "(uploading the dataset again repairs the store)"
            ) from None
        except ArtifactError as exc:
            raise RuntimeError(f"reading dataset {dataset_id} from the {store.describe()} failed: {exc}") from None
        if got is not None:
            return got
    cache_dir = Path(cache_dir)
    final = cache_dir / f"{hex_}.jsonl"
    if final.exists():
        return final
    if not scheduler_target:
        raise UserError(
            "env_config.dataset_id: this worker does not know the scheduler's address "
            "(OPENTINKER_SCHEDULER_URL) to fetch the dataset from"
        )
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = cache_dir / f".{hex_}.{secrets.token_hex(4)}.part"
    digest = hashlib.sha256()
    try:
        channel, metadata = scheduler_channel(scheduler_target, env)
        with channel, open(tmp, "wb") as fh:
            stub = node_pb2_grpc.NodeServiceStub(channel)
            for resp in stub.FetchDataset(
                node_pb2.FetchDatasetRequest(dataset_id=dataset_id), timeout=3600, metadata=metadata
            ):
                digest.update(resp.chunk)
                fh.write(resp.chunk)
        if digest.hexdigest() != hex_:
            raise RuntimeError(f"dataset {dataset_id}: downloaded bytes hash to sha256:{digest.hexdigest()}")
        os.replace(tmp, final)
    except grpc.RpcError as err:
        if err.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT):
            raise UserError(f"env_config.dataset_id: {err.details()}") from None
        raise RuntimeError(
            f"downloading dataset {dataset_id} from {scheduler_target} failed: {err.code().name}: {err.details()}"
        ) from None
    finally:
        tmp.unlink(missing_ok=True)
    return final


# --------------------------------------------------------------------------------------------
# Which tokens are trained on


def assistant_char_spans(
    render: Callable[[Messages, bool], str], messages: Messages
) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the ``[start, end)`` character spans trained on.

    Args:
        render: ``render(messages, add_generation_prompt) -> text`` (the chat template).
        messages: the conversation (a user message precedes the first assistant one).

    Returns:
        ``(text, spans)``: one span per assistant message, from the end of the generation prompt
        before it to the end of its turn with trailing whitespace left out (so the end-of-turn
        token is in, the newline after it is not).

    Raises:
        UserError: the template does not render the conversation incrementally (the prompt
            before an assistant message is not a prefix of the whole), so the spans are unknown.
    """
    text = render(messages, False)
    spans: list[tuple[int, int]] = []
    for i, msg in enumerate(messages):
        if msg["role"] != "assistant":
            continue
        prompt = render(messages[:i], True)
        upto = render(messages[: i + 1], False)
        if not upto.startswith(prompt) or not text.startswith(upto):
            raise UserError(
                "the model's chat template does not render a conversation incrementally (the prompt before an "
                "assistant message is not a prefix of the whole), so the assistant tokens cannot be found"
            )
        end = len(upto.rstrip())
        if end > len(prompt):
            spans.append((len(prompt), end))
    return text, spans


def assistant_label_mask(offsets: Sequence[tuple[int, int]], spans: Sequence[tuple[int, int]]) -> list[bool]:
    """Per token, whether it is trained on: its first character lies inside an assistant span.

    Args:
        offsets: ``[start, end)`` character offsets of each token in the rendered text (what a
            fast tokenizer returns with ``return_offsets_mapping=True``).
        spans: ``[start, end)`` assistant spans from :func:`assistant_char_spans`.

    Returns:
        One bool per token, True = the token's label is kept (trained on).
    """
    out = []
    for start, end in offsets:
        out.append(end > start and any(s <= start < e for s, e in spans))
    return out


@dataclass(frozen=True)
class Encoded:
    """One tokenised example: ``input_ids`` and ``labels`` (``IGNORE_INDEX`` where not trained on)."""

    input_ids: list[int]
    labels: list[int]

    @property
    def trained_tokens(self) -> int:
        """Labels a causal LM is trained on (one at position 0 has no context and never counts)."""
        return sum(1 for x in self.labels[1:] if x != IGNORE_INDEX)


def encode_chat(tokenizer, messages: Messages, max_seq_len: int) -> Encoded:
    """Tokenise one conversation with ``tokenizer``'s chat template; labels only on assistant
    tokens (:func:`assistant_label_mask`). Cut to the first ``max_seq_len`` tokens.

    Raises:
        UserError: the tokenizer has no chat template or no character offsets (not a fast
            tokenizer), or the template is not incremental.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise UserError("the model's tokenizer has no chat template; sft needs one to lay out the conversation")

    def render(msgs: Messages, gen: bool) -> str:
        return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)

    text, spans = assistant_char_spans(render, messages)
    try:
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    except NotImplementedError:
        raise UserError(
            "the model's tokenizer gives no character offsets (not a fast tokenizer); sft needs them"
        ) from None
    ids = list(enc["input_ids"])[:max_seq_len]
    mask = assistant_label_mask(enc["offset_mapping"][: len(ids)], spans)
    return Encoded(ids, [t if m else IGNORE_INDEX for t, m in zip(ids, mask)])


def collate(
    examples: Sequence[Encoded], pad_id: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-pad a batch: ``input_ids`` [batch, seq], ``attention_mask`` [batch, seq] (bool),
    ``labels`` [batch, seq] (``IGNORE_INDEX`` on padding and on tokens not trained on)."""
    width = max(len(e.input_ids) for e in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE_INDEX, dtype=torch.long)
    attn = torch.zeros((len(examples), width), dtype=torch.bool)
    for i, e in enumerate(examples):
        n = len(e.input_ids)
        ids[i, :n] = torch.tensor(e.input_ids)
        labels[i, :n] = torch.tensor(e.labels)
        attn[i, :n] = True
    return ids.to(device), attn.to(device), labels.to(device)


# --------------------------------------------------------------------------------------------
# Split and order


def split_indices(n: int, eval_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """``(train, eval)`` example indices: a seeded shuffle, ``round(eval_fraction * n)`` held out
    (at least one when ``eval_fraction > 0`` and ``n >= 2``; at least one always left to train)."""
    order = list(range(n))
    random.Random(seed).shuffle(order)
    n_eval = 0
    if eval_fraction > 0 and n >= 2:
        n_eval = min(n - 1, max(1, round(eval_fraction * n)))
    return sorted(order[n_eval:]), sorted(order[:n_eval])


def batch_indices(step: int, batch_size: int, n_train: int, seed: int) -> list[int]:
    """Positions (into the training split) of the examples of optimizer step ``step`` (from 1).

    The training split is read in epochs, each a fresh seeded permutation, continuing across
    epoch boundaries; a step's batch depends only on ``step``, so a resumed run reads exactly
    what an uninterrupted one would have.
    """
    out = []
    start = (step - 1) * batch_size
    for pos in range(start, start + batch_size):
        epoch, k = divmod(pos, n_train)
        perm = _epoch_perm(epoch, n_train, seed)
        out.append(perm[k])
    return out


_PERMS: dict[tuple[int, int, int], list[int]] = {}


def _epoch_perm(epoch: int, n: int, seed: int) -> list[int]:
    key = (epoch, n, seed)
    perm = _PERMS.get(key)
    if perm is None:
        if len(_PERMS) > 4:
            _PERMS.clear()
        perm = list(range(n))
        random.Random(seed * 1_000_003 + epoch).shuffle(perm)
        _PERMS[key] = perm
    return perm
