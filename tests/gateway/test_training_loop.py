"""The unmodified tinker SDK trains through the gateway: a LoRA training client, forward_backward
with cross_entropy, optim_step (the loss falls), save_weights_for_sampler and a sample."""

from __future__ import annotations

import tinker
from tinker import types

from tests.support.gateway import MODEL_NAME


def _datum(tokens: list[int]) -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )


def test_sdk_training_loop(gateway_factory, sdk_env) -> None:
    gateway = gateway_factory()
    sdk_env(gateway)
    with tinker.ServiceClient() as service:
        capabilities = tinker.RestClient().get_server_capabilities().result()
        assert [m.model_name for m in capabilities.supported_models] == [MODEL_NAME]
        training = service.create_lora_training_client(base_model=MODEL_NAME, rank=4).result()
        tokenizer = training.get_tokenizer()
        tokens = tokenizer.encode("The cat sat on the mat. The cat sat on the mat.")
        batch = [_datum(tokens), _datum(tokens[:8])]
        losses = []
        for _ in range(4):
            fb = training.forward_backward(batch, "cross_entropy")
            opt = training.optim_step(types.AdamParams(learning_rate=5e-2))
            out = fb.result()
            opt.result()
            losses.append(out.metrics["loss:sum"])
            assert [len(o["logprobs"].tolist()) for o in out.loss_fn_outputs] == [len(tokens) - 1, 7]
        assert losses[-1] < losses[0]

        path = training.save_weights_for_sampler("first").result().path
        assert path.startswith("tinker://") and path.endswith("/sampler_weights/first")
        sampler = service.create_sampling_client(model_path=path).result()
        prompt = types.ModelInput.from_ints(tokens[:5])
        result = sampler.sample(prompt, 2, types.SamplingParams(max_tokens=4, seed=1)).result()
        assert len(result.sequences) == 2
        assert all(1 <= len(s.tokens) <= 4 and len(s.logprobs) == len(s.tokens) for s in result.sequences)
