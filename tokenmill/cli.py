"""The `tokenmill` command: serve, generate, chat, bench, cost, keys.

Thin: parse options into config objects and hand over. Heavy imports happen inside
each command so `tokenmill --help` stays fast.
"""

from __future__ import annotations

import sys
import uuid
from typing import Optional

import typer

from tokenmill.server.options import DTYPE_HELP, MODEL_HELP, QUANT_HELP, OptionError, precision  # no torch

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="tokenmill: a fast, metered, protected OpenAI-compatible LLM server.")


def resolve_precision(dtype: Optional[str], quantization: Optional[str]) -> tuple[str, str]:
    """The (dtype, quantization) the flags ask for, or exit 2 saying why not
    (tokenmill/server/options.py's `precision`)."""
    try:
        return precision(dtype, quantization)
    except OptionError as exc:
        _fail(str(exc))


def _fail(message: str) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code=2)


def _cli_engine(model: Optional[str], dtype: Optional[str], quantization: Optional[str]):
    """An engine for the terminal commands: metadata checked now (one-line errors), weights
    loaded on the engine thread when it starts."""
    from tokenmill.engine.factory import make_engine
    from tokenmill.model.config import ModelLoadError
    from tokenmill.server.options import ServeOptions

    try:
        options = ServeOptions(model=model, dtype=dtype, quantization=quantization, kv_cache_gb=0.5, max_num_seqs=8)
        engine = make_engine(options.engine_config(), "thread")
    except (ValueError, ModelLoadError) as exc:
        _fail(str(exc))
    if engine.served().tokenizer is None:
        _fail("this model has no tokenizer (tokenizer.json); cannot encode a text prompt")
    return engine


async def _start(engine) -> None:
    try:
        await engine.start()
    except RuntimeError as exc:
        _fail(str(exc))


def _serve(options) -> None:
    from tokenmill.server.launch import build_server, run_server

    try:
        server = build_server(options)
    except OptionError as exc:
        _fail(str(exc))
    run_server(server, options)


def _serve_command(command: str, doc: str):
    """A typer command whose options are ServeOptions' fields for `command` ("serve" or
    "cluster"): `serve` and `cluster serve` share one definition of every option."""
    import inspect
    import typing

    from tokenmill.server.options import ServeOptions, cli_fields

    hints = typing.get_type_hints(ServeOptions)
    params = [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, annotation=hints[f.name],
                                default=typer.Option(f.default, f.metadata["flags"], help=f.metadata["help"]))
              for f in cli_fields(command)]

    def serve_command(**kwargs) -> None:
        try:
            options = ServeOptions(**kwargs, cluster=command == "cluster")
        except OptionError as exc:
            _fail(str(exc))
        _serve(options)

    serve_command.__signature__ = inspect.Signature(params)
    serve_command.__annotations__ = {p.name: p.annotation for p in params}
    serve_command.__doc__ = doc
    return serve_command


serve = app.command("serve")(_serve_command(
    "serve", "Serve the OpenAI-compatible API (default: the embedded model on 127.0.0.1:8000)."))
cluster_app = typer.Typer(no_args_is_help=True)
cluster_app.command("serve")(_serve_command(
    "cluster", "Serve the same API from engine replicas on Ray Serve, behind this process as the ingress (keys, "
               "limits, pricing and metrics here; prefix-affinity routing to the replicas). Needs tokenmill[cluster]."))


@app.command()
def generate(
    prompt: str = typer.Argument(..., help="The prompt text."),
    max_tokens: int = typer.Option(128, "--max-tokens", help="Most tokens to generate."),
    temperature: float = typer.Option(0.0, "--temperature", help="0 = greedy."),
    top_p: float = typer.Option(1.0, "--top-p"),
    seed: Optional[int] = typer.Option(None, "--seed", help="Seed for reproducible sampling."),
    chat: bool = typer.Option(False, "--chat", help="Wrap PROMPT as one user message via the chat template."),
    model: Optional[str] = typer.Option(None, "--model", help=MODEL_HELP),
    dtype: Optional[str] = typer.Option(None, "--dtype", help=DTYPE_HELP),
    quantization: Optional[str] = typer.Option(None, "--quantization", help=QUANT_HELP),
) -> None:
    """Generate a continuation of PROMPT and print only the generated text."""
    import asyncio

    from tokenmill.engine.api import InvalidParameter, SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed)
    engine = _cli_engine(model, dtype, quantization)
    tok = engine.served().tokenizer
    if chat:
        if tok.chat_template is None:
            _fail("this model has no chat template; drop --chat")
        ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": prompt}]),
                         add_special_tokens=False)
    else:
        ids = tok.encode(prompt)

    async def run() -> None:
        await _start(engine)
        try:
            try:
                stream = engine.generate(uuid.uuid4().hex, ids, engine.served().resolve([ids], params))
            except (InvalidParameter, ValueError) as exc:
                _fail(str(exc))
            async for out in stream:
                sys.stdout.write(out.text)
                sys.stdout.flush()
        finally:
            await engine.stop()
        sys.stdout.write("\n")

    asyncio.run(run())


@app.command()
def chat(
    model: Optional[str] = typer.Option(None, "--model", help=MODEL_HELP),
    dtype: Optional[str] = typer.Option(None, "--dtype", help=DTYPE_HELP),
    quantization: Optional[str] = typer.Option(None, "--quantization", help=QUANT_HELP),
    system: Optional[str] = typer.Option(None, "--system", help="A system message."),
    max_tokens: int = typer.Option(512, "--max-tokens"),
    temperature: float = typer.Option(0.7, "--temperature"),
) -> None:
    """Interactive chat in the terminal (empty line or Ctrl-D to quit)."""
    import asyncio

    from tokenmill.engine.api import SamplingParams

    engine = _cli_engine(model, dtype, quantization)
    tok = engine.served().tokenizer
    if tok.chat_template is None:
        _fail("this model has no chat template")
    messages: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []

    async def run() -> None:
        await _start(engine)
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
                async for out in engine.generate(uuid.uuid4().hex, ids, engine.served().resolve([ids], params)):
                    reply += out.text
                    sys.stdout.write(out.text)
                    sys.stdout.flush()
                sys.stdout.write("\n")
                messages.append({"role": "assistant", "content": reply})
        finally:
            await engine.stop()

    asyncio.run(run())


@app.command()
def doctor(
    no_build: bool = typer.Option(False, "--no-build", help="Only report; do not build missing kernels."),
) -> None:
    """Check this machine: CPU features, active paths, and the native kernels (built if missing)."""
    from tokenmill.doctor import run_doctor

    raise typer.Exit(code=run_doctor(build=not no_build))


@app.command()
def replay(
    capture_id: str = typer.Argument(..., help="A captured request's id (the response's id)."),
    base_url: str = typer.Option("http://127.0.0.1:8000", "--base-url", help="The server to replay it on."),
    db: Optional[str] = typer.Option(None, "--db", help="The captures' SQLite file (default: captures.db in the "
                                                        "data dir of the server on --port)."),
    port: int = typer.Option(8000, "--port", help="Whose default data dir holds the captures (without --db)."),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="OPENAI_API_KEY"),
    model: Optional[str] = typer.Option(None, "--model", help="The model name to ask for (default: the captured "
                                                              "snapshot's name; a snapshot id pins it)."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON."),
) -> None:
    """Re-run a captured request (serve --capture) from its token ids through the HTTP API and report
    whether its output is identical or where it first differs (exit 0: identical, 1: differs)."""
    import json
    import os

    from tokenmill.batch.storage import default_data_dir
    from tokenmill.server.capture import CaptureStore
    from tokenmill.server.replay import ReplayError, replay as run_replay

    path = db or os.path.join(default_data_dir(port), "captures.db")
    if not os.path.isfile(path):
        _fail(f"no captures at {path} (pass --db)")
    store = CaptureStore(path, read_only=True)
    try:
        captured = store.get(capture_id)
    finally:
        store.close()
    if captured is None:
        _fail(f"no capture {capture_id!r} in {path}")
    try:
        report = run_replay(captured, base_url, api_key, model)
    except ReplayError as exc:
        _fail(str(exc))
    typer.echo(json.dumps(report.as_dict(), indent=2) if as_json else report.summary())
    raise typer.Exit(code=0 if report.identical else 1)


def models_show(
    name: Optional[str] = typer.Argument(None, help="An installed model's name, a GGUF file or a folder "
                                                    "(default: the embedded model)."),
    dtype: Optional[str] = typer.Option(None, "--dtype", help=DTYPE_HELP),
    quantization: Optional[str] = typer.Option(None, "--quantization", help=QUANT_HELP),
    kv_cache_dtype: str = typer.Option("auto", "--kv-cache-dtype"),
    block_size: int = typer.Option(16, "--block-size"),
    max_model_len: Optional[int] = typer.Option(None, "--max-model-len"),
    generation_config: str = typer.Option("auto", "--generation-config"),
    default_max_tokens: int = typer.Option(2048, "--default-max-tokens"),
    chat_template: Optional[str] = typer.Option(None, "--chat-template"),
    served_model_name: Optional[str] = typer.Option(None, "--served-model-name"),
) -> None:
    """Print the model's snapshot (its id and manifest, JSON) as `serve` with the same options would run it:
    the id its answers report as system_fingerprint and a request may pin."""
    import json

    from tokenmill.engine.api import text_digest
    from tokenmill.server.launch import read_chat_template
    from tokenmill.server.options import ServeOptions

    try:
        options = ServeOptions(model=name, dtype=dtype, quantization=quantization, kv_cache_dtype=kv_cache_dtype,
                               block_size=block_size, max_model_len=max_model_len,
                               generation_config=generation_config, default_max_tokens=default_max_tokens,
                               served_model_name=served_model_name)
        template = read_chat_template(chat_template) if chat_template is not None else None
    except OptionError as exc:
        _fail(str(exc))
    snapshot = _cli_engine_for(options).served().snapshot
    if template is not None:
        snapshot = snapshot.replace(chat_template=text_digest(template))
    typer.echo(json.dumps(snapshot.as_dict(), indent=2))


def _cli_engine_for(options):
    from tokenmill.engine.factory import make_engine
    from tokenmill.model.config import ModelLoadError

    try:
        return make_engine(options.engine_config(), "thread")  # metadata only: no weights load
    except (ValueError, ModelLoadError) as exc:
        _fail(str(exc))


from tokenmill.cost.cli import cost_app  # noqa: E402  (light: typer and the stdlib only)

from tokenmill.bench.cli import bench  # noqa: E402  (HTTP only: no torch import)
from tokenmill.server.keys_cli import keys_app  # noqa: E402
from tokenmill.batch.cli import batch_app  # noqa: E402  (HTTP only)
from tokenmill.server.rollout_cli import rollout_app  # noqa: E402  (HTTP only)
from tokenmill.model.models_cli import models_app  # noqa: E402  (no torch)
from tokenmill.eval.cli import eval_command  # noqa: E402  (HTTP only)

app.command("bench", help="Load-test any OpenAI-compatible server and report latency, throughput, goodput.")(bench)
app.command("eval", help="Run a task suite against OpenAI-compatible servers: success rate and cost per "
                         "successful task.")(eval_command)
app.add_typer(cost_app, name="cost", help="Price requests, estimate workloads, cost self-hosting.")
app.add_typer(keys_app, name="keys", help="Manage tenants and API keys.")
app.add_typer(batch_app, name="batch", help="Submit and follow Batch API jobs (OpenAI's /v1/batches).")
app.add_typer(rollout_app, name="rollout", help="Canary rollouts and shadows of a running server.")
models_app.command("show")(models_show)
app.add_typer(models_app, name="models", help="Install and list models (a name for --model).")
app.add_typer(cluster_app, name="cluster", help="Scale out: engine replicas on Ray Serve behind one ingress.")


def main() -> None:  # pragma: no cover
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
