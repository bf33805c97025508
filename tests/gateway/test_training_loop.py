"""The unmodified tinker SDK trains through the gateway: a LoRA training client (a lora_session
task), forward_backward with cross_entropy, optim_step (the loss falls), save_weights_for_sampler
and samples: concurrent requests batched answer as alone, and the sampler is a snapshot that
later optimizer steps leave as it was; save_state and load_state restore the saved weights; the
REST view lists the run's checkpoints; leaving ``with ServiceClient()`` finishes the session, which cancels its task."""

from __future__ import annotations

import numpy as np
import tinker
import torch
from tinker import types

from opentinker.common.v1 import common_pb2
from tests.support.gateway import MODEL_NAME
from tests.support.waiting import wait_for


def _datum(tokens: list[int]) -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )


def test_sdk_training_loop(cluster, gateway_factory, sdk_env) -> None:
    gateway = gateway_factory()
    sdk_env(gateway)
    with tinker.ServiceClient() as service:
        capabilities = tinker.RestClient().get_server_capabilities().result()
        assert [m.model_name for m in capabilities.supported_models] == [MODEL_NAME]
        training = service.create_lora_training_client(base_model=MODEL_NAME, rank=4).result()
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
        together = [f.result().sequences[0].tokens for f in [sampler.sample(p, 1, greedy) for p in prompts]]
        assert together == alone and all(len(t) == 6 for t in alone)
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
        rest = tinker.RestClient()
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
