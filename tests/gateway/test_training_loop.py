"""The unmodified tinker SDK trains through the gateway: a LoRA training client (a lora_session
task), forward_backward with cross_entropy, optim_step (the loss falls), save_weights_for_sampler
and samples: concurrent requests batched answer as alone, and the sampler is a snapshot that
later optimizer steps leave as it was; save_state and load_state restore the saved weights; the
REST view lists the run's checkpoints; leaving ``with ServiceClient()`` finishes the session, which cancels its task.
The tokenizer loads from the client's own Hugging Face cache by the model's name; a batch the SDK
splits into several requests makes one optimizer step equal to the same batch unsplit."""

from __future__ import annotations

import base64
import json
import re

import httpx
import numpy as np
import tinker
import torch
from tinker import types

from opentinker.common.v1 import common_pb2
from tests.support.gateway import MODEL_NAME
from tests.support.waiting import wait_for


def _datum(tokens: list[int], weight: float = 1.0) -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [weight] * (len(tokens) - 1)},
    )


def _sample_calls(gateway) -> tuple[float, float]:
    """The gateway's SampleSnapshot calls and the asample prompts they carried (its /metrics)."""
    text = httpx.get(f"{gateway.url}/metrics").text
    found = {
        part: re.search(rf"^opentinker_gateway_sample_batch_prompts_{part} (\S+)$", text, re.M)
        for part in ("count", "sum")
    }
    assert all(found.values()), text
    return float(found["count"].group(1)), float(found["sum"].group(1))


def _sampler_id(sampler: tinker.SamplingClient) -> str:
    """The sampler's id (``sampling_session_id``), which its handle carries."""
    return json.loads(base64.urlsafe_b64decode(sampler.get_sampler_handle()))["sampling_session_id"]


def _check_sampling_params(base, current, training, tokenizer, tokens: list[int]) -> None:
    """SamplingParams and the prompt log-probs of ``SamplingClient.sample`` reach the model host:
    stop token ids and stop strings end a greedy completion, top_k 1 draws the greedy tokens,
    and the prompt's log-probs and top-k are those of ``forward``."""
    prompt = types.ModelInput.from_ints(tokens[:4])
    greedy = base.sample(prompt, 1, types.SamplingParams(max_tokens=6, temperature=0.0, stop=[])).result()
    free = greedy.sequences[0].tokens
    assert len(free) == 6 and greedy.sequences[0].stop_reason == "length"

    (seq,) = (
        base.sample(prompt, 1, types.SamplingParams(max_tokens=6, temperature=0.0, stop=[free[2]])).result().sequences
    )
    assert (seq.tokens, seq.stop_reason) == (free[: free.index(free[2]) + 1], "stop")

    # The shortest prefix with some text that the whole completion's text starts with.
    text = tokenizer.decode(free)
    k = next(
        k for k in range(1, 6) if tokenizer.decode(free[:k]).strip() and text.startswith(tokenizer.decode(free[:k]))
    )
    stop = tokenizer.decode(free[:k])
    (seq,) = base.sample(prompt, 1, types.SamplingParams(max_tokens=6, temperature=0.0, stop=[stop])).result().sequences
    assert seq.stop_reason == "stop" and len(seq.tokens) <= k and seq.tokens == free[: len(seq.tokens)]
    assert stop in tokenizer.decode(seq.tokens)

    top1 = types.SamplingParams(max_tokens=6, temperature=1.0, top_k=1, seed=7, stop=[])
    assert [s.tokens for s in base.sample(prompt, 2, top1).result().sequences] == [free, free]

    scored = tokens[:8]
    answer = current.sample(
        types.ModelInput.from_ints(scored),
        1,
        types.SamplingParams(max_tokens=1),
        include_prompt_logprobs=True,
        topk_prompt_logprobs=3,
    ).result()
    expected = training.forward([_datum(scored)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
    assert answer.prompt_logprobs[0] is None and len(answer.prompt_logprobs) == len(scored)
    np.testing.assert_allclose(answer.prompt_logprobs[1:], expected, atol=1e-3)
    for position, top in enumerate(answer.topk_prompt_logprobs[1:], start=1):
        assert len(top) == 3 and [lp for _, lp in top] == sorted((lp for _, lp in top), reverse=True)
        assert top[0][1] >= answer.prompt_logprobs[position] - 1e-3
        for token, lp in top:
            if token == scored[position]:
                assert abs(lp - answer.prompt_logprobs[position]) < 1e-3


def test_sdk_training_loop(cluster, gateway_factory, sdk_env) -> None:
    gateway = gateway_factory()
    sdk_env(gateway)
    # base_url: RestClient() alone reuses the process's first session-less client, whose gateway
    # an earlier test may have closed.
    rest = tinker.RestClient(base_url=gateway.url)
    with tinker.ServiceClient() as service:
        capabilities = rest.get_server_capabilities().result()
        assert [m.model_name for m in capabilities.supported_models] == [MODEL_NAME]
        training = service.create_lora_training_client(base_model=MODEL_NAME, rank=4).result()
        # The tokenizer by the model's name, from the client's Hugging Face cache (sdk_env).
        assert training.get_info().model_data.tokenizer_id == MODEL_NAME
        tokenizer = training.get_tokenizer()
        tokens = tokenizer.encode("The cat sat on the mat. The cat sat on the mat.")
        batch = [_datum(tokens), _datum(tokens[:8])]
        forward = training.forward(batch, "cross_entropy").result()
        losses = []
        for _ in range(4):
            fb = training.forward_backward(batch, "cross_entropy")
            opt = training.optim_step(types.AdamParams(learning_rate=5e-2))
            out = fb.result()
            opt.result()
            if not losses:  # forward scored the same weights
                for f, o in zip(forward.loss_fn_outputs, out.loss_fn_outputs):
                    np.testing.assert_allclose(f["logprobs"].tolist(), o["logprobs"].tolist(), atol=1e-4)
            losses.append(out.metrics["loss:sum"])
            assert out.metrics["tokens:sum"] == len(tokens) - 1 + 7
            assert [len(o["logprobs"].tolist()) for o in out.loss_fn_outputs] == [len(tokens) - 1, 7]
        assert losses[-1] < losses[0]

        path = training.save_weights_for_sampler("first").result().path
        assert path == f"tinker://{training.model_id}/sampler_weights/first"
        task = cluster.get(training.model_id)
        assert (task.spec.workload_type, task.state) == ("lora_session", common_pb2.TASK_STATE_RUNNING)
        sampler = service.create_sampling_client(model_path=path).result()
        prompt = types.ModelInput.from_ints(tokens[:5])
        result = sampler.sample(prompt, 2, types.SamplingParams(max_tokens=4, seed=1)).result()
        assert len(result.sequences) == 2
        assert all(1 <= len(s.tokens) <= 4 and len(s.logprobs) == len(s.tokens) for s in result.sequences)

        # Concurrent greedy requests (batched into one SampleSnapshot) answer as each alone does.
        greedy = types.SamplingParams(max_tokens=6, temperature=0.0, stop=[])
        prompts = [types.ModelInput.from_ints(tokens[: 3 + i]) for i in range(3)]
        alone = [sampler.sample(p, 1, greedy).result().sequences[0].tokens for p in prompts]
        calls, carried = _sample_calls(gateway)
        rollouts = 4 * prompts  # the cookbook's shape: many one-sample requests at once
        together = [f.result().sequences[0].tokens for f in [sampler.sample(p, 1, greedy) for p in rollouts]]
        assert together == 4 * alone and all(len(t) == 6 for t in alone)
        # They went to the model host in fewer SampleSnapshot calls than requests.
        calls_after, carried_after = _sample_calls(gateway)
        assert carried_after - carried == len(rollouts) and calls_after - calls < len(rollouts)
        # get_sampler: the sampler's base model and the save it samples.
        info = rest.get_sampler(_sampler_id(sampler)).result()
        assert (info.base_model, info.model_path) == (MODEL_NAME, path)
        # The sampler is a snapshot: later optimizer steps leave its samples as they were.
        for _ in range(2):
            training.forward_backward(batch, "cross_entropy")
            training.optim_step(types.AdamParams(learning_rate=5e-2)).result()
        assert [sampler.sample(p, 1, greedy).result().sequences[0].tokens for p in prompts] == alone
        # A base-model sampler (the adapter off) on the session's training client.
        base = service.create_sampling_client(base_model=MODEL_NAME).result()
        assert len(base.sample(prompts[0], 1, greedy).result().sequences[0].tokens) == 6
        current = training.save_weights_and_get_sampling_client().result()
        assert len(current.sample(prompts[0], 1, greedy).result().sequences[0].tokens) == 6
        _check_sampling_params(base, current, training, tokenizer, tokens)

        # forward_backward_custom: a client-side loss, sent back as cross_entropy weights -dC/dlogp
        # (negative here: this loss pushes the logprobs down).
        def push_down(data, logprobs_list):
            loss = torch.stack([lp.sum() for lp in logprobs_list]).sum()
            return loss, {"push_down:sum": loss.item()}

        custom = training.forward_backward_custom(batch, push_down).result()
        assert len(custom.loss_fn_outputs) == 2 and custom.metrics["push_down:sum"] < 0
        training.optim_step(types.AdamParams(learning_rate=5e-2)).result()

        # The REST view: the training run and its checkpoints by tinker:// path.
        state = training.save_state("after-6").result().path
        assert state == f"tinker://{training.model_id}/weights/after-6"
        saved = training.forward(batch, "cross_entropy").result()
        training.forward_backward(batch, "cross_entropy")
        training.optim_step(types.AdamParams(learning_rate=5e-2)).result()
        training.load_state(state).result()  # the weights of the save again
        loaded = training.forward(batch, "cross_entropy").result()
        for a, b in zip(saved.loss_fn_outputs, loaded.loss_fn_outputs):
            np.testing.assert_allclose(a["logprobs"].tolist(), b["logprobs"].tolist(), atol=1e-5)

        # A batch over the SDK's 1024 datums per request goes as two requests that accumulate
        # into one optimizer step, the step of the same loss sent as one request: 1024 copies of
        # a datum weigh as much as the datum with weight 1024.
        def step(data: list[types.Datum]) -> tuple[float, float, list[list[float]]]:
            training.load_state_with_optimizer(state).result()
            fb = training.forward_backward(data, "cross_entropy")
            opt = training.optim_step(types.AdamParams(learning_rate=5e-2))
            after = training.forward(batch, "cross_entropy").result()
            lps = [o["logprobs"].tolist() for o in after.loss_fn_outputs]
            return fb.result().metrics["loss:sum"], opt.result().metrics["grad_norm:mean"], lps

        first, second = tokens[:3], tokens[3:6]
        split = step([_datum(first)] * 1024 + [_datum(second, 1024.0)])
        whole = step([_datum(first, 1024.0), _datum(second, 1024.0)])
        np.testing.assert_allclose(split[:2], whole[:2], rtol=1e-4)
        for a, b in zip(split[2], whole[2]):
            np.testing.assert_allclose(a, b, atol=1e-4)
        listed = wait_for(
            lambda: (
                {c.tinker_path for c in rest.list_checkpoints(training.model_id).result().checkpoints} >= {path, state}
                or None
            ),
            what="both saves listed as checkpoints of the training run",
        )
        assert listed
        run = rest.get_training_run(training.model_id).result()
        assert (run.base_model, run.last_checkpoint.tinker_path) == (MODEL_NAME, state)
    cluster.wait_state(training.model_id, common_pb2.TASK_STATE_CANCELLED)
