"""Tensor and pipeline parallelism across processes on torch.distributed: starting the ranks, the step each
step's batch travels in, the worker loop, and turning a dead or hung rank into one clear error.

Processes. Rank 0 is the process that loads the engine (`Engine.load(path, tensor_parallel_size=T,
pipeline_parallel_size=P)`, P x T ranks; rank r is stage r // T, tensor-parallel rank r % T): it owns
the scheduler, KV manager, sampler, detokenizer and speculative proposer. On one machine it starts
ranks 1 .. PT-1 itself (`torch.multiprocessing`, spawn). Across machines either `torchrun` starts every
rank (rendezvous through `env://`), or each node runs the same optc command with its `node_rank`
(EngineConfig's nnodes, node_rank, master_addr, master_port) and spawns its own ranks but the first,
meeting at master_addr. Rank 0 serves the command; on any other torchrun rank or node, `Engine.load`
serves steps until rank 0 closes, then exits the process (docs/PARALLEL.md has the commands).

Groups. The model's collectives (optc/core/ops/collective.py) run over a device group, one per stage
(every rank when P = 1): NCCL on CUDA, gloo on the CPU, with a bounded timeout; stages hand values over in
a group of every rank on the same backend (runtime/pipeline.py). The default group (gloo) carries control:
each step's message and the agreement on the KV pool size; ranks wait on it without a practical deadline
(a rank loading a large shard, an idle server that sends nothing).

Step. Before each forward, rank 0's model runner sends the step: the block copies and the forward's
arguments (new token ids, start positions, block ids, logits rows per request) flattened into one
int64 tensor, broadcast as a 4-number header and a body (runtime/step_message.py encodes them). Every
rank builds the same batch, copies the same blocks, runs the same forward and ends with the gathered
logits; rank 0 samples. Block tables are the same on every rank; each rank's KV pool holds its own heads.

Query. Rank 0 can ask every rank for its counters (`rank_stats`: forwards run, KV pool size) with a
header of its own on the control group, answered by an all_gather: how a test checks that the ranks
ran the same steps over pools of the same size. Ranks > 0 hold no KV manager: rank 0's assigns every
block and the others write where each step's block ids say, so only rank 0 counts blocks in use.

Faults. Before every step rank 0 checks its workers are alive; a collective that fails (a peer closed
its connection) or times out raises on rank 0. Either becomes a TensorParallelError naming the ranks
whose processes exited, with their exit codes, and every later step raises it again. A worker exits
on a stop message, when rank 0's connection closes, or (spawned) when its parent dies. `close()`
stops and joins the workers and kills any that do not exit in time.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from optc.core.errors import UserError
from optc.core.ops.sharding import plan_shards
from optc.core.ops.stages import plan_stages, stage_graph
from optc.runtime.config import EngineConfig
from optc.runtime.rank_stats import RankStats
from optc.runtime.step_message import QUERY, STOP, StepArgs, body_size, decode_step, encode_step

JOIN_TIMEOUT_S = 10.0  # how long close() waits for a worker before killing it
WATCHDOG_INTERVAL_S = 1.0
EXIT_GRACE_S = 2.0  # a collective fails as soon as a killed peer's socket closes, before its exit is seen


class TensorParallelError(UserError, RuntimeError):
    """A tensor-parallel rank died or stopped answering; the engine cannot step any more."""


@dataclass
class TensorParallelGroup:
    """One rank's membership: its rank, the control group, and (rank 0 on one machine) the workers."""

    rank: int
    size: int
    backend: str
    timeout_s: float
    control: Any  # the gloo group steps travel in
    device_group: Any  # the group the model's collectives run over, with the collective timeout
    workers: list[Any] = field(default_factory=list)  # spawned processes of ranks 1 .. N-1
    error: TensorParallelError | None = None  # set by the first failure: every later step raises it
    is_closed: bool = False
    pipeline_size: int = 1  # stages (runtime/pipeline.py): rank r is stage r // tensor_size
    pipe_group: Any = None  # every rank, on the device backend: what stages hand values over in

    @property
    def tensor_size(self) -> int:
        return self.size // self.pipeline_size

    @property
    def stage(self) -> int:
        return self.rank // self.tensor_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tensor_size

    def load_model(self, artifact: Any, device: str, use_references: bool = False) -> Any:
        """This rank's stage and shard of the artifact, its collectives over its stage's device group."""
        from optc.runtime.loader import load_model

        return load_model(artifact, _rank_device(device), self.tp_rank, self.tensor_size, self.device_group,
                          use_references, self.stage, self.pipeline_size)

    def agree_num_blocks(self, num_blocks: int) -> int:
        """The smallest KV pool any rank can hold: every rank allocates that many blocks."""
        t = torch.tensor([num_blocks], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.control)
        return int(t.item())

    def send_step(self, block_copies: Sequence[tuple[int, int]], token_ids: list[list[int]], starts: list[int],
                  block_ids: list[list[int]], num_rows: list[int] | None) -> None:
        """Rank 0: broadcast one step's arguments to every rank."""
        self.check()
        timeout = datetime.timedelta(seconds=self.timeout_s)  # the control group waits forever; the sender not
        for t in encode_step(block_copies, token_ids, starts, block_ids, num_rows):
            dist.broadcast(t, 0, group=self.control, async_op=True).wait(timeout)

    def receive_step(self, counters: Callable[[], tuple[int, int]]) -> StepArgs | None:
        """Ranks > 0: the next step's arguments, or None when rank 0 says stop; a query met on the way
        is answered with `counters()` (num_forwards, num_kv_blocks)."""
        while True:
            header = torch.empty(4, dtype=torch.int64)
            dist.broadcast(header, 0, group=self.control)
            if header[0].item() == STOP:
                return None
            if header[0].item() == QUERY:
                self._gather_stats(*counters())
                continue
            body = torch.empty(body_size(header), dtype=torch.int64)
            dist.broadcast(body, 0, group=self.control)
            return decode_step(header, body)

    def rank_stats(self, num_forwards: int, num_kv_blocks: int) -> list[RankStats]:
        """Rank 0: every rank's counters, in rank order (rank 0's are the arguments)."""
        self.check()
        timeout = datetime.timedelta(seconds=self.timeout_s)
        with self.guard():
            dist.broadcast(torch.tensor([QUERY, 0, 0, 0]), 0, group=self.control, async_op=True).wait(timeout)
            return self._gather_stats(num_forwards, num_kv_blocks)

    def _gather_stats(self, num_forwards: int, num_kv_blocks: int) -> list[RankStats]:
        mine = torch.tensor([num_forwards, num_kv_blocks], dtype=torch.int64)
        every = [torch.empty_like(mine) for _ in range(self.size)]
        dist.all_gather(every, mine, group=self.control, async_op=True).wait(
            datetime.timedelta(seconds=self.timeout_s))
        return [RankStats(rank, *t.tolist()) for rank, t in enumerate(every)]

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """Turn a collective's failure inside into a TensorParallelError naming the dead ranks."""
        try:
            yield
        except TensorParallelError:
            raise
        except RuntimeError as e:  # DistBackendError and gloo's errors are RuntimeErrors
            self.error = self._failure(str(e).splitlines()[0])
            raise self.error from e

    def check(self) -> None:
        """Raise the stored failure, or a new one when a worker process has exited."""
        if self.error is not None:
            raise self.error
        if any(not w.is_alive() for w in self.workers):
            self.error = self._failure("a worker process exited")
            raise self.error

    def close(self) -> None:
        """Stop every worker (a stop message, then join; kill what does not exit) and leave the groups."""
        if self.is_closed:
            return
        self.is_closed = True
        if self.rank == 0 and self.error is None:
            with contextlib.suppress(RuntimeError):
                stop = dist.broadcast(torch.tensor([STOP, 0, 0, 0]), 0, group=self.control, async_op=True)
                stop.wait(datetime.timedelta(seconds=self.timeout_s))
        deadline = time.monotonic() + (JOIN_TIMEOUT_S if self.error is None else 1.0)
        for w in self.workers:
            w.join(max(0.0, deadline - time.monotonic()))
            if w.is_alive():
                w.kill()
                w.join()
        with contextlib.suppress(RuntimeError, ValueError):
            dist.destroy_process_group()

    def _failure(self, cause: str) -> TensorParallelError:
        exited = lambda: [(rank, w.exitcode) for rank, w in enumerate(self.workers, self.rank + 1) if not w.is_alive()]
        dead, deadline = exited(), time.monotonic() + EXIT_GRACE_S
        while not dead and self.workers and time.monotonic() < deadline:
            time.sleep(0.05)
            dead = exited()
        kind = _kind(self.pipeline_size)
        if dead:
            which = ", ".join(f"rank {r} (exit code {c})" for r, c in dead)
            return TensorParallelError(f"{kind} {which} died; the engine stopped ({cause})")
        return TensorParallelError(f"a {kind} collective failed or timed out after {self.timeout_s:g} s "
                                   f"(a rank died or hung): {cause}")


def launched_by_torchrun() -> bool:
    """torchrun sets RANK and WORLD_SIZE in every process it starts: `Engine.load` then joins its group
    even at N = 1, so one GPU runs the code path (NCCL, collectives in the graph) that N GPUs run."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def start(config: EngineConfig, artifact: Any, device: str, verify: bool) -> TensorParallelGroup:
    """Join (torchrun: every rank runs this) or start (spawn this node's ranks but the first: ranks 1 .. N-1
    on one machine) a group of tensor_parallel_size x pipeline_parallel_size ranks for an opened artifact;
    on a torchrun rank other than 0, or a node other than 0 (`config.node_rank`), serve steps and exit.
    A model that does not split or cut that many ways raises before any process starts."""
    tp, pp, path = config.tensor_parallel_size, config.pipeline_parallel_size, artifact.path
    size = tp * pp
    stages = plan_stages(artifact.graph, pp)  # StageError: more stages than layers
    for stage in range(pp):
        graph = stage_graph(artifact.graph, stages, stage)
        for rank in range(tp):
            plan_shards(graph, rank, tp)  # ShardError naming the tensor and the sizes that work
    backend = config.distributed_backend or ("nccl" if device.startswith("cuda") else "gloo")
    if launched_by_torchrun():
        if config.nnodes > 1 or config.master_addr is not None:
            raise UserError("under torchrun, torchrun's own --nnodes, --node-rank and --master-addr place the "
                            "ranks: drop optc's")
        if int(os.environ["WORLD_SIZE"]) != size:
            raise UserError(f"torchrun started {os.environ['WORLD_SIZE']} processes but tensor_parallel_size x "
                            f"pipeline_parallel_size is {tp} x {pp} = {size}: they must match")
        group = _join(int(os.environ["RANK"]), size, backend, "env://", config.collective_timeout_s, pp)
        if group.rank != 0:
            run_worker(group, config, path, device, verify)
            raise SystemExit(0)
        return group
    first = config.node_rank * size // config.nnodes  # this node's ranks: first .. first + size / nnodes - 1
    init_method = f"tcp://{config.master_addr or '127.0.0.1'}:{config.master_port or _free_port()}"
    spawn = mp.get_context("spawn")
    workers = [spawn.Process(target=_spawned_worker, daemon=True, name=f"optc-rank-{rank}",
                             args=(rank, rank - first, size, backend, init_method, config, str(path), device, verify,
                                   os.getpid()))
               for rank in range(first + 1, first + size // config.nnodes)]
    for w in workers:
        w.start()
    try:
        group = _join_watching(workers, first, size, backend, init_method, config.collective_timeout_s, pp)
    except BaseException as e:
        dead = [f"rank {rank} (exit code {w.exitcode})" for rank, w in enumerate(workers, first + 1)
                if not w.is_alive()]
        for w in workers:
            w.kill()
            w.join()
        if dead:
            raise TensorParallelError(f"{_kind(pp)} {', '.join(dead)} died while starting") from e
        raise
    group.workers = workers
    if first != 0:
        run_worker(group, config, path, device, verify)
        raise SystemExit(0)
    return group


def _join_watching(workers: list, rank: int, size: int, backend: str, init_method: str, timeout_s: float,
                   pipeline_size: int) -> TensorParallelGroup:
    """Rank 0's `_join`, run beside a watch on the spawned workers: the control group's rendezvous has no
    deadline (see `_join`), so a worker that dies before joining (e.g. a spawn that cannot re-import the
    parent's main module) would leave rank 0 waiting forever; a dead worker raises here instead."""
    joined: dict[str, Any] = {}

    def join() -> None:
        try:
            joined["group"] = _join(rank, size, backend, init_method, timeout_s, pipeline_size)
        except BaseException as e:  # re-raised in the caller's thread
            joined["error"] = e

    thread = threading.Thread(target=join, daemon=True, name="optc-tp-join")
    thread.start()
    while thread.is_alive():
        thread.join(0.2)
        if thread.is_alive() and any(not w.is_alive() for w in workers):
            raise TensorParallelError(f"a {_kind(pipeline_size)} worker exited before joining the group")
    if "error" in joined:
        raise joined["error"]
    return joined["group"]


def run_worker(group: TensorParallelGroup, config: EngineConfig, path: str | Path, device: str,
               verify: bool) -> None:
    """A rank > 0: load its shard, agree on the KV pool, then run every step rank 0 sends."""
    from optc.core.artifact import read
    from optc.runtime.kv_sizing import num_kv_blocks
    from optc.runtime.model_runner import ModelRunner

    try:
        model = group.load_model(read(path, verify=verify, device=device), device, config.use_references)
        max_model_len = min(model.max_position_embeddings, config.max_seq_len or 1 << 62)
        num_blocks = group.agree_num_blocks(config.num_blocks or num_kv_blocks([model], config, max_model_len))
        runner = ModelRunner(model, config, num_blocks, max_model_len,
                             stage_group=group if group.pipeline_size > 1 else None)
        counters = lambda: (runner.num_forwards, num_blocks)
        while (step := group.receive_step(counters)) is not None:
            block_copies, token_ids, starts, block_ids, num_rows = step
            runner.forward(token_ids, starts, block_ids, num_rows, block_copies)
    finally:
        group.close()


# -- helpers ----------------------------------------------------------------------------------------


def _join(rank: int, size: int, backend: str, init_method: str, timeout_s: float,
          pipeline_size: int = 1) -> TensorParallelGroup:
    if dist.is_initialized():
        raise UserError("this process already belongs to a tensor-parallel group: close the other engine first "
                        "(Engine.close)")
    if backend == "nccl":
        torch.cuda.set_device(torch.device(_rank_device("cuda")))
    # the default group (gloo, no practical deadline) is the control group: ranks start and load at
    # their own pace, and an idle worker waits for the next step as long as the engine idles
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=size,
                            timeout=datetime.timedelta(days=365))
    timeout = datetime.timedelta(seconds=timeout_s)
    device_group = pipe_group = dist.new_group(backend=backend, timeout=timeout)
    if pipeline_size > 1:  # each stage's tensor-parallel ranks: every rank creates every group, in order
        t = size // pipeline_size
        stages = [dist.new_group(list(range(s * t, (s + 1) * t)), backend=backend, timeout=timeout)
                  for s in range(pipeline_size)]
        device_group = stages[rank // t]
    return TensorParallelGroup(rank, size, backend, timeout_s, dist.group.WORLD, device_group,
                               pipeline_size=pipeline_size, pipe_group=pipe_group)


def _spawned_worker(rank: int, local_rank: int, size: int, backend: str, init_method: str, config: EngineConfig,
                    path: str, device: str, verify: bool, parent: int) -> None:
    threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()
    os.environ["LOCAL_RANK"] = str(local_rank)
    if device == "cpu":  # a node's ranks share its cores: oversubscribed threads stall every collective
        torch.set_num_threads(max(1, torch.get_num_threads() // (size // config.nnodes)))
    group = _join(rank, size, backend, init_method, config.collective_timeout_s, config.pipeline_parallel_size)
    run_worker(group, config, path, device, verify)


def _watch_parent(parent: int) -> None:
    """Exit this worker when rank 0's process is gone: no worker outlives its engine."""
    while os.getppid() == parent:
        time.sleep(WATCHDOG_INTERVAL_S)
    os._exit(1)


def _kind(pipeline_size: int) -> str:
    """What errors call a rank: tensor-parallel, or pipeline-parallel when there are stages."""
    return "tensor-parallel" if pipeline_size == 1 else "pipeline-parallel"


def _rank_device(device: str) -> str:
    """`cuda` on a rank: the GPU of its local rank; anything else as it is."""
    return f"cuda:{os.environ.get('LOCAL_RANK', '0')}" if device == "cuda" else device


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
