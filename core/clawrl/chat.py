"""``clawrl chat "message"``: one reply from the configured model, for a quick check that a model
directory (or the embedded model) loads and answers, without starting the server."""
from __future__ import annotations

import asyncio

from clawrl.engines.base import EngineError, SamplingParams


def render_prompt(tokenizer, message: str) -> list[int]:
    """Token ids of a one-user-message conversation, ready for the assistant's reply."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": message}], add_generation_prompt=True,
                                         tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def chat_cli(args) -> int:
    from clawrl.cli import CliError
    from clawrl.config import compose
    from clawrl.engines import make_engine

    if args.max_tokens < 1:
        raise CliError("--max-tokens must be at least 1")
    if args.temperature < 0:
        raise CliError("--temperature must be >= 0")
    cfg = compose(args.overrides)
    try:
        engine = make_engine(cfg)
        prompt = render_prompt(engine.tokenizer, args.message)
        max_new = min(args.max_tokens, engine.model_info().max_context - len(prompt))
        if max_new < 1:
            raise CliError(f"the message is {len(prompt)} tokens; the model's context is "
                           f"{engine.model_info().max_context}")
        params = SamplingParams(max_new_tokens=max_new, temperature=args.temperature, seed=cfg.seed)
        result = asyncio.run(_generate(engine, prompt, params))
    except EngineError as e:
        raise CliError(str(e)) from None
    print(engine.tokenizer.decode(result.token_ids, skip_special_tokens=True).strip())
    return 0


async def _generate(engine, prompt, params):
    await engine.start()
    try:
        return await engine.generate(prompt, params)
    finally:
        await engine.shutdown()
