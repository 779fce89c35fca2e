"""The `tokenmill` command: serve, generate, chat, bench, cost, keys.

Thin: parse options into config objects and hand over. Heavy imports happen inside
each command so `tokenmill --help` stays fast.
"""

from __future__ import annotations

import sys
import uuid
from typing import Optional

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="tokenmill: a fast, metered, protected OpenAI-compatible LLM server.")

MODEL_HELP = "GGUF file or Hugging Face folder (default: the embedded SmolLM2-135M-Instruct)."
DTYPE_HELP = "Weight and compute dtype: float32 or bfloat16."


def _fail(message: str) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code=2)


def engine_config(model: Optional[str], dtype: str, kv_cache_gb: Optional[float], max_num_seqs: int,
                  max_num_batched_tokens: int, max_model_len: Optional[int], block_size: int,
                  enable_prefix_caching: bool, num_threads: Optional[int]):
    from tokenmill.config import CacheConfig, EngineConfig, ModelOptions
    from tokenmill.engine.scheduler import SchedulerConfig

    return EngineConfig(
        model=ModelOptions(path=model, dtype=dtype),
        cache=CacheConfig(block_size=block_size, kv_cache_gb=kv_cache_gb,
                          enable_prefix_caching=enable_prefix_caching),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens),
        max_model_len=max_model_len,
        num_threads=num_threads,
    )


def _load(model: Optional[str], dtype: str):
    from tokenmill.model.config import ModelLoadError
    from tokenmill.model.loader import load_model

    try:
        return load_model(model, dtype)
    except ModelLoadError as exc:
        _fail(str(exc))


@app.command()
def generate(
    prompt: str = typer.Argument(..., help="The prompt text."),
    max_tokens: int = typer.Option(128, "--max-tokens", help="Most tokens to generate."),
    temperature: float = typer.Option(0.0, "--temperature", help="0 = greedy."),
    top_p: float = typer.Option(1.0, "--top-p"),
    seed: Optional[int] = typer.Option(None, "--seed", help="Seed for reproducible sampling."),
    chat: bool = typer.Option(False, "--chat", help="Wrap PROMPT as one user message via the chat template."),
    model: Optional[str] = typer.Option(None, "--model", help=MODEL_HELP),
    dtype: str = typer.Option("float32", "--dtype", help=DTYPE_HELP),
) -> None:
    """Generate a continuation of PROMPT and print only the generated text."""
    import asyncio

    from tokenmill.engine.async_engine import AsyncEngine
    from tokenmill.engine.sampling_params import InvalidParameter, SamplingParams

    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed)
    except InvalidParameter as exc:
        _fail(str(exc))
    loaded = _load(model, dtype)
    tok = loaded.tokenizer
    if tok is None:
        _fail("this model has no tokenizer (tokenizer.json); cannot encode a text prompt")
    if chat:
        if tok.chat_template is None:
            _fail("this model has no chat template; drop --chat")
        ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": prompt}]),
                         add_special_tokens=False)
    else:
        ids = tok.encode(prompt)

    async def run() -> None:
        engine = AsyncEngine(loaded, engine_config(model, dtype, 0.5, 8, 512, None, 16, True, None))
        await engine.start()
        try:
            async for out in engine.generate(uuid.uuid4().hex, ids, params):
                sys.stdout.write(out.text)
                sys.stdout.flush()
        finally:
            await engine.stop()
        sys.stdout.write("\n")

    asyncio.run(run())


@app.command()
def chat(
    model: Optional[str] = typer.Option(None, "--model", help=MODEL_HELP),
    dtype: str = typer.Option("float32", "--dtype", help=DTYPE_HELP),
    system: Optional[str] = typer.Option(None, "--system", help="A system message."),
    max_tokens: int = typer.Option(512, "--max-tokens"),
    temperature: float = typer.Option(0.7, "--temperature"),
) -> None:
    """Interactive chat in the terminal (empty line or Ctrl-D to quit)."""
    import asyncio

    from tokenmill.engine.async_engine import AsyncEngine
    from tokenmill.engine.sampling_params import SamplingParams

    loaded = _load(model, dtype)
    tok = loaded.tokenizer
    if tok is None or tok.chat_template is None:
        _fail("this model has no chat template")
    messages: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []

    async def run() -> None:
        engine = AsyncEngine(loaded, engine_config(model, dtype, 0.5, 8, 512, None, 16, True, None))
        await engine.start()
        try:
            while True:
                try:
                    line = await asyncio.to_thread(input, "you> ")
                except EOFError:
                    break
                if not line.strip():
                    break
                messages.append({"role": "user", "content": line})
                ids = tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)
                params = SamplingParams(max_tokens=max_tokens, temperature=temperature)
                sys.stdout.write("assistant> ")
                reply = ""
                async for out in engine.generate(uuid.uuid4().hex, ids, params):
                    reply += out.text
                    sys.stdout.write(out.text)
                    sys.stdout.flush()
                sys.stdout.write("\n")
                messages.append({"role": "assistant", "content": reply})
        finally:
            await engine.stop()

    asyncio.run(run())


from tokenmill.cost.cli import cost_app  # noqa: E402  (light: typer and the stdlib only)

app.add_typer(cost_app, name="cost", help="Price requests, estimate workloads, cost self-hosting.")


def main() -> None:  # pragma: no cover
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
