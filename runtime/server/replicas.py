"""Data-parallel serving (`optc serve --data-parallel-size N`): N engine replicas as Ray Serve replicas behind the
one OpenAI endpoint of `optc serve`. Needs the `ray` extra.

The seam is the AsyncEngine: the FastAPI app (app.py), its auth, limits, streaming and errors run unchanged in the
`optc serve` process (the ingress, a Ray driver), over a `RemoteEngine` instead of an AsyncEngine. RemoteEngine
tokenizes on the ingress (its own copy of the tokenizer), so routing sees token ids, and forwards each request to
a DeploymentHandle of `EngineReplica`, a Ray Serve deployment whose every replica hosts one AsyncEngine (one
engine thread, continuous batching, as a single-process server). Ray's request router for that handle is
routing.py's PrefixAffinityRouter. Ray restarts a replica that died or whose health check fails (an engine that
failed twice within the failure window); a request whose replica died before it produced an output is sent
again (to a live replica), one that had produced outputs ends with EngineFailed naming the replica (a 500, or an
error event in a stream). /metrics is every replica's exposition, each series labelled `replica`.

Without --ray-address, Ray runs locally: the ingress starts a Ray instance of its own (as many logical CPUs as the
most replicas need, no dashboard) and shuts it down when the server stops, leaving no process behind. With an
address it joins that cluster (whose nodes must have optc installed) and deletes only its own application.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from ray import serve
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError, RayTaskError
from ray.serve.config import AutoscalingConfig, RequestRouterConfig

from optc.runtime.sampler import SamplingParams
from optc.runtime.server.async_engine import Accepted, AsyncEngine, ChatPrompt, EngineFailed, Output, Prompt
from optc.runtime.server.metrics import Metrics
from optc.runtime.server.routing import PrefixAffinityRouter, replica_ids

log = logging.getLogger("optc.serve")
_DIED = (ActorDiedError, ActorUnavailableError, RayActorError)
MAX_RESENDS = 3  # a request whose replicas keep dying before its first output fails after this many resends


class EngineReplica:
    """One engine replica (a Ray Serve deployment's class): an AsyncEngine over the artifact, loaded before Ray
    routes to it. Its health check fails once its engine can step no more, so Ray replaces it."""

    async def __init__(self, options) -> None:
        from optc.runtime.server.loading import load_engine

        self.replica = serve.get_replica_context().replica_id.unique_id
        self.fatal: BaseException | None = None
        self.metrics = Metrics(options.model_name)
        self.engine = AsyncEngine(lambda: load_engine(options), asyncio.get_running_loop(), self.metrics,
                                  self._on_fatal, options.failure_window)
        self.engine.start()
        await self.engine.ready.wait()
        if self.engine.load_error is not None:
            raise self.engine.load_error

    def _on_fatal(self, error: BaseException) -> None:
        self.fatal = error

    async def generate(self, prompt_ids: list[int], params: list[SamplingParams], is_streaming: bool,
                       lora: str | None) -> AsyncIterator[Accepted | Output]:
        async for item in self.engine.generate(prompt_ids, params, is_streaming, time.perf_counter(), lora):
            yield item

    async def call(self, fn: Callable[[Any], Any], replica: str | None = None) -> Any:
        """fn(engine) on the engine thread (`replica` pins the request to this replica: routing.py)."""
        return await self.engine.call(fn)

    async def describe(self, replica: str | None = None) -> dict[str, Any]:
        engine = self.engine.engine
        return {"max_num_seqs": engine.config.max_num_seqs, "block_size": engine.config.block_size,
                "max_model_len": engine.max_model_len, "vocab_size": engine.model.vocab_size,
                "architecture": engine.model.graph.config.architecture, "loras": engine.lora_names()}

    async def metrics_text(self, replica: str | None = None) -> tuple[str, str]:
        """(this replica's id, its Prometheus exposition)."""
        return self.replica, self.metrics.render().decode()

    def check_health(self) -> None:
        if self.fatal is not None:
            raise RuntimeError(f"the engine can step no more: {self.fatal}")

    def __del__(self) -> None:
        if getattr(self, "engine", None) is not None:
            self.engine.stop()


@dataclass
class _Namespace:
    """Attributes read as an Engine's by the app (app.py reads config, max_model_len, model, tokenizer)."""

    values: dict[str, Any] = field(default_factory=dict)

    def __getattr__(self, name: str) -> Any:
        try:
            return self.__dict__["values"][name]
        except KeyError:
            raise AttributeError(name) from None


@dataclass
class Replicas:
    """The running deployment: its handle, the replicas' description, the ingress's tokenizer, and how to stop."""

    handle: Any
    name: str
    description: dict[str, Any]
    tokenizer: Any
    num_replicas: int  # the most replicas (autoscaling's max)
    owns_ray: bool  # Ray was started here: shut it down at the end

    def close(self) -> None:
        if not self.owns_ray:
            serve.delete(self.name)
            return
        started = _descendants(os.getpid())  # Ray's processes, its agents included
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
            _end(started)  # ray.shutdown leaves the raylet's agents running (Ray 2.60)


def start_replicas(options, affinity: bool = True) -> Replicas:
    """Start Ray (or join --ray-address), deploy the replicas and wait until they serve (routed by prefix
    affinity, or by load alone)."""
    from transformers import AutoTokenizer

    from optc.core.artifact import read
    from optc.runtime.config import EngineConfig

    artifact = read(options.artifact, verify=options.verify, device=options.device)  # a bad one: exit 2 here
    config = EngineConfig.from_manifest(artifact.manifest, **({"max_num_seqs": options.max_num_seqs}
                                                               if options.max_num_seqs else {}))
    tokenizer = AutoTokenizer.from_pretrained(artifact.tokenizer_dir)
    if options.chat_template is not None:
        tokenizer.chat_template = options.chat_template
    lowest, initial, highest = options.replica_bounds
    ranks = options.tensor_parallel_size or config.tensor_parallel_size
    actor = {"num_cpus": ranks} if options.device == "cpu" else {"num_cpus": 1, "num_gpus": ranks}
    owns_ray = options.ray_address is None
    logging.getLogger("ray").setLevel(logging.ERROR)  # not its INFO lines, nor a warning about signal handlers
    if owns_ray:
        ray.init(address="local", num_cpus=highest * actor["num_cpus"], include_dashboard=False,  # not `ray start`'s
                 configure_logging=False, logging_level=logging.WARNING, log_to_driver=False)
    else:
        ray.init(address=options.ray_address, configure_logging=False, logging_level=logging.WARNING,
                 log_to_driver=False)
    serve.start(proxy_location="Disabled", logging_config={"log_level": "WARNING"})
    logging.getLogger("ray.serve").setLevel(logging.WARNING)
    name = f"optc-{Path(options.artifact).resolve().name}-{uuid.uuid4().hex[:8]}"
    scaling = ({"num_replicas": initial} if lowest == highest else {"autoscaling_config": AutoscalingConfig(
        min_replicas=lowest, initial_replicas=initial, max_replicas=highest,
        target_ongoing_requests=config.max_num_seqs)})
    router = RequestRouterConfig(request_router_class=PrefixAffinityRouter,
                                 request_router_kwargs={"block_size": config.block_size,
                                                        "imbalance": config.max_num_seqs, "affinity": affinity})
    deployment = serve.deployment(EngineReplica).options(
        name="engine", ray_actor_options=actor, max_ongoing_requests=config.max_num_seqs + options.max_waiting,
        request_router_config=router, health_check_period_s=2.0, logging_config={"log_level": "WARNING"},
        **scaling)
    try:
        handle = serve.run(deployment.bind(options), name=name, route_prefix=None)
        description = handle.describe.remote().result()
    except BaseException:
        Replicas(None, name, {}, None, highest, owns_ray).close()
        raise
    return Replicas(handle, name, description, tokenizer, highest, owns_ray)


class RemoteEngine:
    """What app.py uses of an AsyncEngine (generate, prepare, call, engine, ready, load_error, stop, render_metrics),
    over the replicas `load()` starts (on a thread of its own, so /health answers 503 meanwhile)."""

    def __init__(self, load: Callable[[], Replicas], loop: asyncio.AbstractEventLoop, metrics: Metrics,
                 on_fatal: Callable[[BaseException], None] = lambda error: None, failure_window_s: float = 0.0) -> None:
        self._load = load
        self._loop = loop
        self.metrics = metrics
        self.replicas: Replicas | None = None
        self.engine: _Namespace | None = None
        self.ready = asyncio.Event()
        self.load_error: BaseException | None = None
        self.num_in_flight = 0
        self._preparer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="optc-prepare")
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._start, name="optc-replicas", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _start(self) -> None:
        """Start the replicas, wait for `stop`, stop them. One thread does both: Ray's local processes die with
        the thread that started them (PR_SET_PDEATHSIG)."""
        try:
            self.replicas = self._load()
            self.engine = self._view(self.replicas.description["loras"])
        except BaseException as e:  # reported by the server, which exits
            self.load_error = e
        self._loop.call_soon_threadsafe(_reclaim_signals)
        self._loop.call_soon_threadsafe(self.ready.set)
        self._stopping.wait()
        if self.replicas is not None:
            self.replicas.close()

    def stop(self, timeout: float = 60.0) -> None:
        self._preparer.shutdown(wait=False, cancel_futures=True)
        self._stopping.set()
        self._thread.join(timeout)

    def _view(self, loras: list[str]) -> _Namespace:
        d, r = self.replicas.description, self.replicas
        graph = _Namespace({"config": _Namespace({"architecture": d["architecture"]})})
        return _Namespace({
            "config": _Namespace({"max_num_seqs": d["max_num_seqs"] * r.num_replicas, "block_size": d["block_size"]}),
            "max_model_len": d["max_model_len"], "tokenizer": r.tokenizer,
            "model": _Namespace({"vocab_size": d["vocab_size"], "graph": graph}), "lora_names": lambda: list(loras)})

    async def prepare(self, fn: Callable[[Any], Any]) -> Any:
        """fn(tokenizer) on the preparation thread, with the ingress's tokenizer."""
        return await self._loop.run_in_executor(self._preparer, fn, self.replicas.tokenizer)

    async def generate(self, prompt: Prompt | ChatPrompt, params: Sequence[SamplingParams], is_streaming: bool,
                       arrival_time: float, lora: str | None = None) -> AsyncIterator[Accepted | Output]:
        """As AsyncEngine.generate, on the replica the router picks for the prompt's token ids."""
        from optc.runtime.server.async_engine import prompt_ids_of

        self.num_in_flight += 1
        try:
            prompt_ids = await self.prepare(lambda tokenizer: prompt_ids_of(tokenizer, prompt))
            has_output, is_accepted = False, False
            for attempt in range(MAX_RESENDS + 1):
                response = self.replicas.handle.options(stream=True).generate.remote(
                    prompt_ids=prompt_ids, params=list(params), is_streaming=is_streaming, lora=lora)
                try:
                    async for item in response:
                        if isinstance(item, Accepted):
                            if is_accepted:
                                continue
                            is_accepted = True
                        else:
                            has_output = True
                        yield item
                    return
                except _DIED as e:
                    if has_output or attempt == MAX_RESENDS:
                        raise EngineFailed(f"the engine replica serving this request died ({type(e).__name__}); "
                                           "the request was aborted") from None
                    log.warning("an engine replica died before answering a request; sending it again")
                except RayTaskError as e:
                    raise _cause(e) from None
                finally:
                    response.cancel()
        finally:
            self.num_in_flight -= 1

    async def call(self, fn: Callable[[Any], Any]) -> Any:
        """fn(engine) on every replica's engine thread; the first replica's result (its error, if one failed)."""
        results = await self._broadcast("call", fn)
        self.engine = self._view(await self._first("call", lambda e: e.lora_names()))
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise errors[0]
        return results[0]

    async def render_metrics(self) -> bytes:
        """Every replica's metrics, each series labelled with its replica's id."""
        registry = CollectorRegistry()
        families: dict[str, Any] = {}
        for result in await self._broadcast("metrics_text"):
            if isinstance(result, BaseException):  # a replica that died meanwhile: the others' metrics
                continue
            replica, text = result
            for family in text_string_to_metric_families(text):
                merged = families.setdefault(family.name, family)
                samples = [s._replace(labels={**s.labels, "replica": replica}) for s in family.samples]
                merged.samples = (merged.samples if merged is not family else []) + samples
        registry.register(_Families(list(families.values())))
        return generate_latest(registry)

    async def _broadcast(self, method: str, *args: Any) -> list[Any]:
        ids = replica_ids(self.replicas.handle.deployment_name) or [None]
        calls = [getattr(self.replicas.handle, method).remote(*args, replica=i) for i in ids]
        results = await asyncio.gather(*(asyncio.wait_for(_awaited(c), 30) for c in calls), return_exceptions=True)
        return [_cause(r) if isinstance(r, RayTaskError) else r for r in results]

    async def _first(self, method: str, *args: Any) -> Any:
        try:
            return await getattr(self.replicas.handle, method).remote(*args)
        except RayTaskError as e:
            raise _cause(e) from None


def _reclaim_signals() -> None:
    """Give SIGINT and SIGTERM back to the server's (Python) handlers, on the main thread: Ray's core worker puts a
    C++ failure handler in front of them, which aborts the process after the server's graceful stop (exit 134)."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in (signal.SIGINT, signal.SIGTERM):
        handler = signal.getsignal(sig)
        if handler is not None:
            signal.signal(sig, handler)


def _descendants(pid: int) -> list[int]:
    """Every process below `pid`, from /proc's parent links (none where there is no /proc)."""
    parents = {}
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
    found, frontier = [], {pid}
    while frontier:
        frontier = {p for p, parent in parents.items() if parent in frontier}
        found += frontier
    return found


def _end(pids: list[int], grace_s: float = 5.0) -> None:
    """SIGTERM the processes of `pids` still running, then SIGKILL those alive after `grace_s`."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        alive = [p for p in pids if _signal(p, 0)]
        deadline = time.monotonic() + (grace_s if sig == signal.SIGTERM else 0)
        for p in alive:
            _signal(p, sig)
        while alive and time.monotonic() < deadline:
            time.sleep(0.1)
            alive = [p for p in alive if _signal(p, 0)]
        pids = alive


def _signal(pid: int, sig: int) -> bool:
    """Send `sig`; False where the process is gone (or a zombie: reaped by its parent, or by init)."""
    try:
        if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
            return False
        os.kill(pid, sig)
        return True
    except (OSError, IndexError):
        return False


async def _awaited(response) -> Any:
    return await response


def _cause(error: RayTaskError) -> BaseException:
    """The exception a replica raised (Ray wraps it in a RayTaskError whose text is a remote traceback)."""
    cause = getattr(error, "cause", None)
    return cause if isinstance(cause, BaseException) else error


class _Families:
    def __init__(self, families: list) -> None:
        self.families = families

    def collect(self):
        return iter(self.families)
