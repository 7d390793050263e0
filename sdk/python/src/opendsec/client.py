"""The entry point: :class:`DSecClient`."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import logging
import math
import uuid
from collections.abc import AsyncIterable, AsyncIterator, Generator, Iterable, Iterator, Mapping
from types import TracebackType
from typing import Any, Self

import grpc.aio

from opendsec._conn import Conn
from opendsec._gen.opendsec.v1 import sandbox_pb2 as pb
from opendsec.errors import ConfigError, DSecError, UnavailableError, from_code_name, from_grpc_error
from opendsec.images import Images
from opendsec.sandbox import Sandbox, _Trajectory, _trajectory
from opendsec.snapshots import Snapshot, _Snapshots
from opendsec.types import DSecRunArgs, SandboxInfo

__all__ = ["BatchFailure", "BatchItem", "BatchOutcome", "BatchRun", "DSecClient"]


@dataclasses.dataclass(frozen=True)
class BatchItem:
    """One result of :meth:`DSecClient.run_sandboxes`.

    Attributes:
        index: position in the batch, ``0 <= index < count``.
        sandbox: the sandbox when this item succeeded, else ``None``.
        error: the typed error when this item failed, else ``None``.
    """

    index: int
    sandbox: Sandbox | None
    error: DSecError | None

    @property
    def ok(self) -> bool:
        """True when this item made a sandbox."""
        return self.error is None and self.sandbox is not None


class BatchRun:
    """A batch create in flight. Iterate it to get each :class:`BatchItem` as
    the sandbox becomes ready (``async for item in client.run_sandboxes(...)``),
    or ``await`` it for all items sorted by index."""

    def __init__(self, conn: Conn, req: pb.BatchCreateSandboxesRequest, timeout: float | None) -> None:
        self._conn = conn
        self._req = req
        self._timeout = timeout
        self._used = False

    @property
    def request_id(self) -> str:
        """The batch's idempotency key; item ``i`` is created with ``"<request_id>-<i>"``."""
        return self._req.request_id

    async def __aiter__(self) -> AsyncIterator[BatchItem]:
        if self._used:
            raise RuntimeError("a BatchRun can be consumed only once; call run_sandboxes again")
        self._used = True
        attempt = 0
        seen: set[int] = set()
        while True:
            call = self._conn.sandboxes.BatchCreateSandboxes(
                self._req, metadata=self._conn.metadata, timeout=self._timeout
            )
            try:
                async for msg in call:
                    if msg.index in seen:
                        continue  # delivered before the stream broke
                    seen.add(msg.index)
                    attempt = 0  # progress: the retry budget starts again
                    yield _batch_item(self._conn, msg)
                return
            except grpc.aio.AioRpcError as e:
                err = from_grpc_error(e)
                # The same request again is safe, also after items arrived
                # (the apiserver restarted, the connection broke): item i
                # carries "<request_id>-<i>", so the server returns the
                # sandboxes it already made and makes only the missing ones;
                # the ones already yielded are skipped.
                if not isinstance(err, UnavailableError) or attempt >= self._conn.max_retries:
                    raise err from None
            finally:
                call.cancel()
            await asyncio.sleep(self._conn.retry_backoff * (2**attempt))
            attempt += 1

    async def collect(self) -> list[BatchItem]:
        """Wait for every item; return them sorted by index."""
        items = [item async for item in self]
        items.sort(key=lambda i: i.index)
        return items

    def __await__(self) -> Generator[Any, None, list[BatchItem]]:
        return self.collect().__await__()


@dataclasses.dataclass(frozen=True)
class BatchFailure:
    """A sandbox :meth:`DSecClient.pause_sandboxes` or
    :meth:`DSecClient.resume_sandboxes` could not handle.

    ``sandbox_id`` is empty when a whole node failed to answer.
    """

    sandbox_id: str
    error: DSecError


@dataclasses.dataclass(frozen=True)
class SandboxReclaim:
    """The memory a task pause with reclaim pushed out of one sandbox: bytes
    charged to it in RAM (page cache included, swap not) before and after.

    ``note`` says why less could go, e.g. when the node has no swap (then
    only page cache is freed); empty when nothing held it back.
    """

    sandbox_id: str
    bytes_before: int
    bytes_after: int
    bytes_freed: int
    note: str


@dataclasses.dataclass(frozen=True)
class BatchOutcome:
    """What a batch pause or resume did: the sandboxes now paused (or
    running) and the failures, one per sandbox. After
    :meth:`DSecClient.pause_task` with ``reclaim``, ``reclaimed`` has one
    entry per paused sandbox and ``bytes_freed`` their sum over every node."""

    sandboxes: list[Sandbox]
    failures: list[BatchFailure]
    reclaimed: list[SandboxReclaim] = dataclasses.field(default_factory=list)
    bytes_freed: int = 0

    @property
    def ok(self) -> bool:
        """True when nothing failed."""
        return not self.failures


def _selector(labels: Mapping[str, str] | None, task_id: str | None, ids: list[str] | None) -> pb.SandboxSelector:
    if not labels and not task_id and not ids:
        raise ConfigError("selector: give labels, task_id or ids (an empty selector would match every sandbox)")
    return pb.SandboxSelector(labels=dict(labels or {}), task_id=task_id or "", ids=list(ids or []))


def _run_args(args: DSecRunArgs | None) -> DSecRunArgs:
    if args is None:
        return DSecRunArgs()
    if not isinstance(args, DSecRunArgs):
        raise ConfigError(f"args must be a DSecRunArgs, got {type(args).__name__}")
    if not isinstance(args.skip_warm_pool, bool):
        got = args.skip_warm_pool
        raise ConfigError(f"skip_warm_pool: must be True or False, got {got!r} ({type(got).__name__})")
    return args


def _batch_item(conn: Conn, msg: pb.BatchCreateSandboxesResponse) -> BatchItem:
    if msg.error_code or not msg.HasField("sandbox"):
        err = from_code_name(msg.error_code or "unknown", msg.error_message)
        return BatchItem(index=msg.index, sandbox=None, error=err)
    return BatchItem(index=msg.index, sandbox=Sandbox(conn, SandboxInfo.from_proto(msg.sandbox)), error=None)


@dataclasses.dataclass(frozen=True)
class ReplayDifference:
    """One call whose replay differed from its log entry.

    Attributes:
        seq / call_id / command: the call in the log.
        field: what differed first: ``"exit_code"``, ``"stdout"`` or ``"stderr"``.
        recorded / replayed: the two values.
    """

    seq: int
    call_id: str
    command: list[str]
    field: str
    recorded: Any
    replayed: Any


@dataclasses.dataclass(frozen=True)
class ReplayReport:
    """What :meth:`DSecClient.replay` found.

    Attributes:
        sandbox_id: the sandbox the log was replayed in (stopped unless ``keep=True``).
        calls: how many exec calls were replayed.
        skipped: log entries not replayed (entries of another kind than
            ``exec``, calls not ``done`` or without a command). Calls whose
            output was truncated or compacted are replayed and compared on
            their exit code only.
        differences: the calls that differed, in order; empty when the
            replay matched.
    """

    sandbox_id: str
    calls: int
    skipped: int
    differences: list[ReplayDifference]

    @property
    def ok(self) -> bool:
        """True when every replayed call matched its log entry."""
        return not self.differences


class DSecClient:
    """Async client for an OpenDsec apiserver.

    Args:
        endpoint: ``host:port``, ``http://host:port`` or ``https://host:port``;
            default ``$OPENDSEC_ENDPOINT``. For https, ``$OPENDSEC_CA_FILE``
            may name a PEM file of CA certificates.
        token: bearer token; default ``$OPENDSEC_TOKEN``. Sent on every call as
            ``authorization: Bearer <token>``.
        timeout: deadline in seconds for each unary call (create, get, stop,
            file calls...). Exec streams have no deadline unless a process
            ``timeout`` is given.
        max_retries: how many times calls that are safe to repeat (create with
            its request_id, get, list) are retried on UNAVAILABLE.
        retry_backoff: first retry delay in seconds; doubles each retry.

    Raises:
        ConfigError: no endpoint or token, or a malformed endpoint.

    Use it as an async context manager, or call :meth:`close`::

        async with DSecClient() as client:
            sandbox = await client.run_sandbox(DSecRunArgs(image="root/busybox"))
    """

    def __init__(
        self,
        endpoint: str | None = None,
        token: str | None = None,
        *,
        timeout: float = 60.0,
        max_retries: int = 4,
        retry_backoff: float = 0.25,
    ) -> None:
        self._conn = Conn(endpoint, token, timeout=timeout, max_retries=max_retries, retry_backoff=retry_backoff)
        self.images: Images = Images(self._conn)
        """The shared image store: import, list, get, tag, remove, compose, gc, verify."""

    def __repr__(self) -> str:
        return f"DSecClient(endpoint={self._conn.endpoint!r})"

    @property
    def endpoint(self) -> str:
        """The endpoint this client talks to."""
        return self._conn.endpoint

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the connection. Sandboxes keep running until they time out or are stopped."""
        await self._conn.close()

    async def run_sandbox(
        self,
        args: DSecRunArgs | None = None,
        *,
        request_id: str | None = None,
        timeout: float | None = None,
    ) -> Sandbox:
        """Create a sandbox and return once its agent answers.

        A fresh ``request_id`` (uuid4) is generated unless given; UNAVAILABLE is
        retried with the SAME request_id, so a lost answer never makes a second
        sandbox.

        The sandbox may come prestarted from its node's warm pool
        (:attr:`Sandbox.from_warm_pool`); then its ID is the pooled sandbox's.
        Always use the returned sandbox's :attr:`Sandbox.id`.

        Raises:
            ConfigError: ``args`` is not a :class:`DSecRunArgs` or has a field
                of the wrong type (nothing is sent).
            InvalidArgumentError: a field of ``args`` is wrong (``err.field`` names it).
            NotFoundError: the image does not exist.
            QuotaExceededError: no quota or no node capacity left.
        """
        args = _run_args(args)
        req = pb.CreateSandboxRequest(
            spec=args.to_proto(),
            request_id=request_id or uuid.uuid4().hex,
            skip_warm_pool=args.skip_warm_pool,
        )
        resp = await self._conn.unary(self._conn.sandboxes.CreateSandbox, req, timeout=timeout, retry=True)
        return Sandbox(self._conn, SandboxInfo.from_proto(resp.sandbox))

    def run_sandboxes(
        self,
        args: DSecRunArgs | None,
        count: int,
        *,
        request_id: str | None = None,
        timeout: float | None = None,
    ) -> BatchRun:
        """Create ``count`` sandboxes from one spec (up to 32768).

        ``async for item in client.run_sandboxes(args, n)`` yields a
        :class:`BatchItem` per sandbox as it becomes ready, each with either a
        ``sandbox`` or a typed ``error``; ``await client.run_sandboxes(args, n)``
        returns all of them sorted by index. ``timeout`` bounds the whole
        batch (default: none). Items take prestarted sandboxes from the warm
        pool while it has them (unless ``args.skip_warm_pool``); the rest are
        made from scratch.

        A stream cut with UNAVAILABLE (an apiserver restart, a lost
        connection), also after items arrived, is retried with the same
        ``request_id``: the server returns the sandboxes it already made and
        makes only the missing ones, and items already yielded are not
        yielded again, so a batch never makes a sandbox twice.

        Raises:
            ConfigError: ``args`` is not a :class:`DSecRunArgs` or has a field
                of the wrong type (nothing is sent).
        """
        args = _run_args(args)
        req = pb.BatchCreateSandboxesRequest(
            spec=args.to_proto(),
            count=count,
            request_id=request_id or uuid.uuid4().hex,
            skip_warm_pool=args.skip_warm_pool,
        )
        return BatchRun(self._conn, req, timeout)

    async def prewarm(
        self,
        args: DSecRunArgs | None,
        count: int,
        *,
        ttl: float | None = None,
        wait: bool = False,
        timeout: float | None = None,
    ) -> int:
        """Ask the warm pool to hold ``count`` prestarted sandboxes of ``args``'s
        shape; return how many it will hold.

        Call it while the trainer computes, before the burst: the creates of
        that shape that follow (``run_sandboxes(args, count)``) each take a
        prestarted sandbox instead of starting from scratch. Only the shape
        counts (backend, image, cpu, memory, disk, pids limit, user, workdir,
        network, allow_privilege_escalation); env, labels and timeouts may
        differ. Each create of the shape consumes one of the count; after
        that, or after ``ttl`` seconds (default: the pool's idle TTL, node
        ``warm_pool.idle_ttl_sec``; at most 86400), the pool goes back to
        its normal size.

        The answer may be below ``count`` when the node's capacity or its
        ``node.warm_pool.max_sandboxes`` does not allow more; the reason is
        logged (logger ``opendsec``) at WARNING. Filling runs in the
        background; with ``wait`` the call returns once the pool holds them
        (or ``timeout`` passes).

        Raises:
            ConfigError: ``args`` or ``count`` has the wrong type, or ``ttl``
                is out of range (nothing is sent).
            InvalidArgumentError: ``count`` is 0 or above the node's bound, or
                a field of ``args`` is wrong (``err.field`` names it).
            FailedPreconditionError: the node has no warm pool.
        """
        args = _run_args(args)
        if not isinstance(count, int) or isinstance(count, bool):
            raise ConfigError(f"count: must be an int, got {count!r} ({type(count).__name__})")
        ttl_seconds = 0
        if ttl is not None:
            if not isinstance(ttl, (int, float)) or isinstance(ttl, bool) or not 0 <= ttl <= 86400:
                raise ConfigError(f"ttl: must be between 0 and 86400 seconds, got {ttl!r}")
            ttl_seconds = math.ceil(ttl)
        req = pb.PrewarmSandboxesRequest(spec=args.to_proto(), count=count, ttl_seconds=ttl_seconds, wait=bool(wait))
        resp = await self._conn.unary(self._conn.sandboxes.PrewarmSandboxes, req, timeout=timeout, retry=True)
        if resp.held < count:
            log = logging.getLogger("opendsec")
            log.warning("prewarm: the warm pool holds %d of %d: %s", resp.held, count, resp.reason)
        return int(resp.held)

    async def get_sandbox(self, sandbox_id: str) -> Sandbox:
        """Return the sandbox with this ID (NotFoundError if there is none)."""
        resp = await self._conn.unary(self._conn.sandboxes.GetSandbox, pb.GetSandboxRequest(id=sandbox_id), retry=True)
        return Sandbox(self._conn, SandboxInfo.from_proto(resp.sandbox))

    async def list_sandboxes(
        self,
        labels: Mapping[str, str] | None = None,
        task_id: str | None = None,
        backend: str | None = None,
    ) -> list[Sandbox]:
        """List the caller's sandboxes, optionally only those whose labels
        contain all of ``labels``, of ``task_id``, or of ``backend``."""
        req = pb.ListSandboxesRequest(labels=dict(labels or {}), task_id=task_id or "", backend=backend or "")
        resp = await self._conn.unary(self._conn.sandboxes.ListSandboxes, req, retry=True)
        return [Sandbox(self._conn, SandboxInfo.from_proto(s)) for s in resp.sandboxes]

    def _outcome(self, sbs: Any, failures: Any) -> BatchOutcome:
        return BatchOutcome(
            sandboxes=[Sandbox(self._conn, SandboxInfo.from_proto(s)) for s in sbs],
            failures=[
                BatchFailure(sandbox_id=f.sandbox_id, error=from_code_name(f.error_code or "unknown", f.error_message))
                for f in failures
            ],
        )

    async def pause_sandboxes(
        self,
        labels: Mapping[str, str] | None = None,
        task_id: str | None = None,
        ids: list[str] | None = None,
    ) -> BatchOutcome:
        """Pause every sandbox matching the selector, on every node at once: the
        preemption case of a training job (``client.pause_sandboxes(task_id=job)``).

        Set selector fields are AND-ed; at least one is required (ConfigError
        otherwise). Sandboxes fail one by one (:attr:`BatchOutcome.failures`).
        See :meth:`Sandbox.pause` for what pausing means.
        """
        req = pb.PauseSandboxesRequest(selector=_selector(labels, task_id, ids))
        resp = await self._conn.unary(self._conn.sandboxes.PauseSandboxes, req)
        return self._outcome(resp.sandboxes, resp.failures)

    async def pause_task(
        self,
        task_id: str,
        reclaim: bool = True,
        labels: Mapping[str, str] | None = None,
    ) -> BatchOutcome:
        """Pause every sandbox of the task on every node in one call and, with
        ``reclaim`` (the default), push their memory out of RAM: to swap where
        the node has it (the quickstart sets up zram swap), page cache either
        way. The outcome reports the bytes each sandbox freed
        (:attr:`BatchOutcome.reclaimed`) and the total
        (:attr:`BatchOutcome.bytes_freed`).

        ``labels`` narrow the task to the sandboxes that have all of them. A
        task with no running or paused sandbox raises NotFoundError.
        :meth:`resume_task` brings them back (each takes its pages back as it
        touches them; processes and data are kept); sandboxes paused longer
        than the node's max_paused are stopped.
        """
        if not isinstance(task_id, str) or not task_id:
            raise ConfigError(f"task_id: must be a non-empty string (the task the sandboxes were created with), got {task_id!r}")
        if not isinstance(reclaim, bool):
            raise ConfigError(f"reclaim: must be True or False, got {reclaim!r}")
        req = pb.PauseSandboxesRequest(selector=_selector(labels, task_id, None), reclaim=reclaim)
        resp = await self._conn.unary(self._conn.sandboxes.PauseSandboxes, req)
        out = self._outcome(resp.sandboxes, resp.failures)
        return dataclasses.replace(
            out,
            reclaimed=[
                SandboxReclaim(
                    sandbox_id=r.sandbox_id,
                    bytes_before=r.bytes_before,
                    bytes_after=r.bytes_after,
                    bytes_freed=r.bytes_freed,
                    note=r.note,
                )
                for r in resp.reclaimed
            ],
            bytes_freed=resp.bytes_freed,
        )

    async def resume_task(self, task_id: str, labels: Mapping[str, str] | None = None) -> BatchOutcome:
        """Resume every paused sandbox of the task (with all of ``labels``) on
        every node at once; each continues with the lifetime it had left at the
        pause. A task with no running or paused sandbox raises NotFoundError."""
        if not isinstance(task_id, str) or not task_id:
            raise ConfigError(f"task_id: must be a non-empty string (the task the sandboxes were created with), got {task_id!r}")
        return await self.resume_sandboxes(labels=labels, task_id=task_id)

    async def resume_sandboxes(
        self,
        labels: Mapping[str, str] | None = None,
        task_id: str | None = None,
        ids: list[str] | None = None,
        timeout: float | None = None,
    ) -> BatchOutcome:
        """Resume every sandbox matching the selector, on every node at once.
        ``timeout`` is as in :meth:`Sandbox.resume`."""
        secs = 0 if timeout is None else (math.ceil(timeout) if timeout > 0 else int(timeout))
        req = pb.ResumeSandboxesRequest(selector=_selector(labels, task_id, ids), timeout_seconds=secs)
        resp = await self._conn.unary(self._conn.sandboxes.ResumeSandboxes, req)
        return self._outcome(resp.sandboxes, resp.failures)

    async def list_snapshots(self) -> list[Snapshot]:
        """List your snapshots (an admin's: every one), oldest first."""
        return await _Snapshots(self._conn).list()

    async def get_snapshot(self, snapshot_id: str) -> Snapshot:
        """Return one of your snapshots (NotFoundError if there is none)."""
        return await _Snapshots(self._conn).get(snapshot_id)

    async def delete_snapshot(self, snapshot_id: str) -> None:
        """Delete one of your snapshots and its image. Sandboxes started from
        it keep running."""
        await _Snapshots(self._conn).delete(snapshot_id)

    @contextlib.contextmanager
    def trajectory(self, rollout_id: str) -> Iterator[None]:
        """Number the calls in the block for exactly-once replay.

        Inside ``with client.trajectory(rollout_id):`` every exec or
        ``run_shell`` without its own ``call_id`` gets ``<rollout_id>/<n>``,
        where n counts that sandbox's calls in the block from 0. A trainer
        that is preempted and runs the same rollout again in a new block gets
        the same IDs in the same order, so the calls already done return
        their recorded results (``replayed=True``) instead of running twice.
        Issue concurrent calls to one sandbox with explicit ``call_id`` s:
        their order, and so their numbers, may differ between runs.
        """
        if not rollout_id:
            raise ValueError("rollout_id must not be empty")
        token = _trajectory.set(_Trajectory(rollout_id))
        try:
            yield
        finally:
            _trajectory.reset(token)

    async def replay(
        self,
        log: str | Iterable[Mapping[str, Any]] | AsyncIterable[Mapping[str, Any]],
        *,
        image: str | None = None,
        snapshot: str | None = None,
        args: DSecRunArgs | None = None,
        keep: bool = False,
    ) -> ReplayReport:
        """Re-run a trajectory log's exec calls in a fresh sandbox, in order.

        ``log`` is a sandbox ID (its log is read, so only its owner can
        replay it) or the entries of :meth:`Sandbox.trajectory`. The new
        sandbox is made from ``image`` or ``snapshot`` (or ``args``). Each
        call's exit code, stdout and stderr are compared with the log's; the
        report lists every call that differed (a determinism check). Calls
        inherited from a fork's parent are replayed too. The sandbox is
        stopped at the end unless ``keep``.
        """
        if isinstance(log, str):
            entries = [e async for e in (await self.get_sandbox(log)).trajectory()]
        elif isinstance(log, AsyncIterable):
            entries = [e async for e in log]
        else:
            entries = list(log)
        run_args = _run_args(args)
        if image is not None and snapshot is not None:
            raise ValueError("give image or snapshot, not both")
        if image is not None:
            run_args = dataclasses.replace(run_args, image=image, snapshot="")
        if snapshot is not None:
            # A snapshot is started with spec.snapshot; its image name
            # ("snapshot/<id>") is refused as an image.
            run_args = dataclasses.replace(run_args, image="", snapshot=snapshot)
        sb = await self.run_sandbox(run_args)
        diffs: list[ReplayDifference] = []
        calls = skipped = 0
        try:
            for e in entries:
                if e.get("kind", "exec") != "exec" or e.get("state") != "done" or not e.get("command"):
                    skipped += 1
                    continue
                calls += 1
                r = await sb.run_shell_argv(
                    list(e["command"]), env=e.get("env"), cwd=e.get("cwd"), user=e.get("user")
                )
                rec_code = int(e.get("exit_code", 0))
                full = not e.get("output_truncated") and not e.get("output_compacted")
                rec_out = base64.b64decode(e.get("stdout", "")) if full else None
                rec_err = base64.b64decode(e.get("stderr", "")) if full else None
                for field, rec, got in (
                    ("exit_code", rec_code, r.exit_code),
                    ("stdout", rec_out, r.stdout_bytes),
                    ("stderr", rec_err, r.stderr_bytes),
                ):
                    if rec is not None and rec != got:
                        diffs.append(
                            ReplayDifference(
                                seq=int(e.get("seq", 0)),
                                call_id=e.get("call_id", ""),
                                command=list(e["command"]),
                                field=field,
                                recorded=rec,
                                replayed=got,
                            )
                        )
                        break
        finally:
            if not keep:
                await sb.stop()
        return ReplayReport(sandbox_id=sb.id, calls=calls, skipped=skipped, differences=diffs)

    async def stop_sandbox(self, sandbox_id: str) -> None:
        """Stop and delete the sandbox with this ID."""
        await self._conn.unary(self._conn.sandboxes.StopSandbox, pb.StopSandboxRequest(id=sandbox_id))
