"""A scripted engine for tests of the gateway and the loops that use it: each generate call
answers with the next scripted turn's ids (plus eos), log-prob -0.5 each, and records its prompt."""

from raytool.types import TokenOutput


def scripted(renderer, turns):
    """A fake engine: each scripted turn's ids plus eos, log-prob -0.5 each; records its prompts."""
    prompts, generated = [], []

    async def generate(prompt_ids, sampling, request_id, session):
        text = turns[min(len(prompts), len(turns) - 1)]
        ids = renderer.encode(text)[: sampling.max_tokens - 1] + [renderer.eos_id]
        prompts.append(list(prompt_ids))
        generated.append(ids)
        return TokenOutput(ids, [-0.5] * len(ids), "stop", policy_version=2)

    return generate, prompts, generated
