"""The parallelism options `optc run`, `serve` and `bench` share (`eval` takes -tp, -pp and the backend):
tensor- and pipeline-parallel sizes, the torch.distributed backend, and where the ranks of several
machines meet when optc starts them itself (named as vLLM's: --nnodes, --node-rank, --master-addr,
--master-port; under torchrun, torchrun's own flags place them). Each is an EngineConfig field
(runtime/config.py); an unset one keeps the artifact's runtime setting or the default.
"""

from __future__ import annotations

from typing import Any

import typer

TP = typer.Option(
    None, "--tensor-parallel-size", "-tp", min=1,
    help="Split the model over N ranks (tensor parallelism: N GPUs, or N CPU processes); the size must divide the "
         "model's heads (`optc inspect -tp N` shows what each rank holds). Default: the artifact's "
         "runtime.tensor_parallel_size, else 1.")
PP = typer.Option(
    None, "--pipeline-parallel-size", "-pp", min=1,
    help="Cut the model's layers into P stages (pipeline parallelism), each split over -tp ranks: P x TP ranks in "
         "all (`optc inspect -pp P` shows the stages). Default: the artifact's runtime.pipeline_parallel_size, "
         "else 1.")
BACKEND = typer.Option(
    None, "--distributed-backend",
    help="torch.distributed backend of tensor and pipeline parallelism: nccl or gloo (default: nccl on cuda, gloo "
         "on cpu).")
NNODES = typer.Option(None, "--nnodes", min=1, help="Machines the ranks run on (without torchrun): run the same "
                      "command on each, with its --node-rank; each runs (P x TP) / nnodes ranks. Default 1.")
NODE_RANK = typer.Option(None, "--node-rank", min=0, help="This machine's index, 0 .. nnodes - 1 (node 0 serves "
                         "the command; the others run steps and exit when it stops). Default 0.")
MASTER_ADDR = typer.Option(None, "--master-addr", help="Address of node 0, where the ranks meet (needed with "
                           "--nnodes > 1; default on one machine: 127.0.0.1).")
MASTER_PORT = typer.Option(None, "--master-port", min=1, max=65535, help="Port on node 0 where the ranks meet "
                           "(needed with --nnodes > 1; default on one machine: a free port).")


def overrides(tensor_parallel_size: int | None = None, pipeline_parallel_size: int | None = None,
              distributed_backend: str | None = None, nnodes: int | None = None, node_rank: int | None = None,
              master_addr: str | None = None, master_port: int | None = None) -> dict[str, Any]:
    """The engine overrides of the options given (unset ones keep the artifact's settings or the defaults)."""
    options = {"tensor_parallel_size": tensor_parallel_size, "pipeline_parallel_size": pipeline_parallel_size,
               "distributed_backend": distributed_backend, "nnodes": nnodes, "node_rank": node_rank,
               "master_addr": master_addr, "master_port": master_port}
    return {k: v for k, v in options.items() if v is not None}
