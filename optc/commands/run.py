"""`optc run`: generate text from one prompt with an artifact, in this process, and print it (or, with
--json, the text, token ids, token counts, finish reason and seconds). Its options are declared here,
beside the one call they make (`Engine.load`, then `Engine.generate`); optc.cli registers the command.
An adapter given by --lora is loaded into the engine's one slot, sized to its rank, under the name `lora`.
"""

from __future__ import annotations

import json
from pathlib import Path

import typer

from optc.commands import parallel
from optc.commands.cli_common import SPECULATIVE_HELP, read_text, user_errors
from optc.core.errors import UserError
from optc.core.lora import adapter_rank


def run(
    artifact: Path = typer.Argument(..., help="Artifact folder."),
    prompt: str = typer.Option(..., "--prompt", help="Prompt text."),
    chat: bool = typer.Option(False, "--chat", help="Format the prompt with the model's chat template (a base "
                              "model has none: give one with --chat-template)."),
    chat_template: Path | None = typer.Option(None, "--chat-template", help="A Jinja chat template file that "
                                              "replaces the tokenizer's (or gives a base model one)."),
    max_tokens: int = typer.Option(
        64, "--max-tokens", min=1, help="Maximum new tokens; the prompt and these must fit in the context."
    ),
    temperature: float = typer.Option(0.0, "--temperature", min=0.0, help="0 = greedy."),
    top_k: int = typer.Option(0, "--top-k", min=0, help="Keep the k most likely tokens (0 = off)."),
    top_p: float = typer.Option(1.0, "--top-p", help="Nucleus sampling mass in (0, 1]."),
    seed: int | None = typer.Option(None, "--seed", help="Seed for sampling."),
    stop: list[str] = typer.Option([], "--stop", help="Stop string (repeatable)."),
    device: str = typer.Option("cpu", "--device", help="cpu or cuda."),
    no_verify: bool = typer.Option(False, "--no-verify", help="Skip the sha256 check of the artifact's files."),
    as_json: bool = typer.Option(
        False, "--json", help="Print text, token_ids, prompt_tokens, completion_tokens, seconds as JSON."
    ),
    speculative: str | None = typer.Option(None, "--speculative", help=SPECULATIVE_HELP),
    tensor_parallel_size: int | None = parallel.TP,
    pipeline_parallel_size: int | None = parallel.PP,
    distributed_backend: str | None = parallel.BACKEND,
    nnodes: int | None = parallel.NNODES,
    node_rank: int | None = parallel.NODE_RANK,
    master_addr: str | None = parallel.MASTER_ADDR,
    master_port: int | None = parallel.MASTER_PORT,
    lora: Path | None = typer.Option(None, "--lora", help="A peft LoRA adapter folder to generate under."),
) -> None:
    """Generate text from one prompt."""
    import time

    from optc.runtime import Engine, SamplingParams
    from optc.runtime.speculative import SpeculativeConfig

    with user_errors():
        params = SamplingParams(
            temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, max_tokens=max_tokens, stop=tuple(stop)
        )
        spec = SpeculativeConfig.parse(speculative) if speculative else None
        template = read_text(chat_template, "--chat-template") if chat_template else None
        if template is not None and not chat:
            raise UserError("--chat-template formats chat prompts: add --chat")
        loras = {"max_loras": 1, "max_lora_rank": adapter_rank(lora)} if lora else {}
        parallel_options = parallel.overrides(tensor_parallel_size, pipeline_parallel_size, distributed_backend, nnodes,
                                              node_rank, master_addr, master_port)
        engine = Engine.load(artifact, device=device, verify=not no_verify, speculative=spec, chat_template=template,
                             **parallel_options, **loras)
        try:
            if lora:
                engine.load_lora("lora", lora)
            t0 = time.perf_counter()
            (completion,) = engine.generate([prompt], params, chat=chat, loras=["lora" if lora else None])
            seconds = time.perf_counter() - t0
        finally:
            engine.close()
    if as_json:
        typer.echo(
            json.dumps(
                {
                    "text": completion.text,
                    "token_ids": completion.token_ids,
                    "prompt_tokens": len(completion.prompt_token_ids),
                    "completion_tokens": len(completion.token_ids),
                    "finish_reason": completion.finish_reason,
                    "seconds": round(seconds, 4),
                }
            )
        )
    else:
        typer.echo(completion.text)
