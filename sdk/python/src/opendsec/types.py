"""Plain data types of the SDK: run arguments, sandbox info, exec results,
file info, HTTP responses. They are dataclasses independent of protobuf."""

from __future__ import annotations

import dataclasses
import datetime as _dt
import enum
import json as _json
import math
from collections.abc import Iterable, Mapping
from typing import Any, TypeAlias

from google.protobuf import timestamp_pb2

from opendsec._gen.opendsec.v1 import sandbox_pb2 as pb
from opendsec.errors import ConfigError

__all__ = [
    "DSecRunArgs",
    "ExecEvent",
    "ExecResult",
    "FileInfo",
    "FileType",
    "HTTPResponse",
    "NetworkPolicy",
    "NetworkRule",
    "NetworkSpec",
    "ProcessInfo",
    "SandboxInfo",
    "SandboxMetrics",
    "SandboxState",
]


@dataclasses.dataclass
class DSecRunArgs:
    """What to run: the spec of a sandbox.

    Zero values mean "the server's default"; the server validates every field
    and its :class:`~opendsec.errors.InvalidArgumentError` names the field.

    Attributes:
        backend: ``"container"``, ``"microvm"`` or ``"vm"``; ``""`` = node default.
        image: image name, e.g. ``"root/py:3.11"`` or ``"root/busybox"``.
        cpu: CPU cores (fractions allowed); ``0`` = 1.
        memory_mb: memory limit in MiB (at least 16); ``None`` = the default (512).
            An explicit ``0`` is refused by the server.
        timeout: lifetime in seconds from creation; ``0`` = the default (300); max 86400.
        idle_timeout: stop after this many seconds without exec, file or port traffic; ``0`` = off.
        env: environment variables for every process.
        user: default user for processes (``"root"`` or a user of the image);
            ``""`` = the image's default user.
        labels: free-form labels, for :meth:`DSecClient.list_sandboxes`.
        task_id: the task the sandbox belongs to.
        pids_limit: maximum number of processes (at least 16); ``0`` = the default (1024).
        workdir: working directory for processes; ``""`` = the image's, else ``/``.
        disk_mb: quota of the writable layer (what the sandbox writes to its root
            filesystem) in MiB, bytes and inodes (one per 16 KiB); ``0`` = the node's
            default (``node.disk.default_mb``, 5120). At least 16, at most the node's
            ``node.disk.max_mb``. Writes past it fail with ENOSPC.
        network: what the sandbox may reach, in any form of :data:`NetworkSpec`,
            e.g. ``{"pypi": True}`` or ``[{"cidr": "10.0.0.0/8", "ports": "443"}]``;
            ``None`` = the node's default rule sets (by default no network).
            Read back from the server it is a :class:`NetworkPolicy`.
        on_timeout: what the lifetime or idle timeout does when it ends:
            ``"stop"`` (stop and delete the sandbox) or ``"pause"`` (freeze it,
            keeping its memory and files; any later call into it, or
            :meth:`Sandbox.resume`, resumes it) or ``"pause_filesystem"`` (end
            its processes keeping only its files, as
            ``Sandbox.pause(filesystem_only=True)``; container backend).
            ``""`` = ``"stop"``, or ``"pause"`` with ``auto_pause``. See
            "Lifecycle" in docs/concepts.md.
        auto_pause: alias of ``on_timeout="pause"`` (E2B's ``autoPause``); set one
            or the other (``auto_pause=True`` with ``on_timeout="stop"`` is refused,
            naming ``on_timeout``).
        skip_warm_pool: make the sandbox from scratch even when its node's warm
            pool holds a prestarted sandbox of the same shape (for measuring the
            cold path, or debugging). Default ``False``: a create whose shape
            matches takes a prestarted sandbox, which is much faster; see
            :attr:`Sandbox.from_warm_pool` and "Warm pool" in docs/concepts.md.
            It is a flag of the create call, not part of the spec: it is not
            stored, and :attr:`SandboxInfo.spec` reads it back as ``False``.
        snapshot: start from this snapshot (its ID, see :meth:`Sandbox.snapshot`)
            instead of an image: every field left unset takes the value of the
            snapshot's source (cpu, memory, env, user, workdir, network, labels...),
            set fields override (env and labels are merged). Give either
            ``image`` or ``snapshot``, not both.
        allow_privilege_escalation: let setuid programs (``sudo``) raise a
            process's privileges inside the sandbox (no ``no_new_privs``), so
            ``user`` can ``sudo`` where the image allows it (``root/base``).
            Root inside keeps the same capabilities, seccomp filter and
            namespaces. Default ``False``; E2B sandboxes have it. See
            docs/security.md.
        cpu_class: ``"latency"`` (the default) or ``"best_effort"``: the
            sandbox's processes (a VM's QEMU threads) run under ``SCHED_IDLE``
            with the least CPU weight, so they only get CPU time the node's
            latency sandboxes leave (batch work). See docs/concepts.md.
    """

    backend: str = ""
    image: str = ""
    cpu: float = 0.0
    memory_mb: int | None = None
    timeout: int = 0
    idle_timeout: int = 0
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    user: str = ""
    labels: dict[str, str] = dataclasses.field(default_factory=dict)
    task_id: str = ""
    pids_limit: int = 0
    workdir: str = ""
    disk_mb: int = 0
    network: NetworkSpec | None = None
    auto_pause: bool = False
    skip_warm_pool: bool = False
    on_timeout: str = ""
    snapshot: str = ""
    allow_privilege_escalation: bool = False
    cpu_class: str = ""

    def to_proto(self) -> pb.SandboxSpec:
        """Return the ``opendsec.v1.SandboxSpec`` message for these arguments."""
        spec = pb.SandboxSpec(
            backend=self.backend or "",
            image=self.image or "",
            cpu=float(self.cpu or 0),
            timeout_seconds=_seconds(self.timeout),
            idle_timeout_seconds=_seconds(self.idle_timeout),
            env=dict(self.env or {}),
            user=self.user or "",
            labels=dict(self.labels or {}),
            task_id=self.task_id or "",
            pids_limit=int(self.pids_limit or 0),
            workdir=self.workdir or "",
            auto_pause=bool(self.auto_pause),
            disk_mb=int(self.disk_mb or 0),
            on_timeout=self.on_timeout or "",
            snapshot=self.snapshot or "",
            allow_privilege_escalation=bool(self.allow_privilege_escalation),
            cpu_class=self.cpu_class or "",
        )
        if self.memory_mb is not None:
            spec.memory_mb = int(self.memory_mb)
        if self.network is not None:
            spec.network.CopyFrom(NetworkPolicy.parse(self.network).to_proto())
        return spec

    @classmethod
    def from_proto(cls, spec: pb.SandboxSpec) -> DSecRunArgs:
        """Build run arguments from an ``opendsec.v1.SandboxSpec`` message."""
        return cls(
            backend=spec.backend,
            image=spec.image,
            cpu=spec.cpu,
            memory_mb=spec.memory_mb if spec.HasField("memory_mb") else None,
            timeout=spec.timeout_seconds,
            idle_timeout=spec.idle_timeout_seconds,
            env=dict(spec.env),
            user=spec.user,
            labels=dict(spec.labels),
            task_id=spec.task_id,
            pids_limit=spec.pids_limit,
            workdir=spec.workdir,
            network=NetworkPolicy.from_proto(spec.network) if spec.HasField("network") else None,
            auto_pause=spec.auto_pause,
            disk_mb=spec.disk_mb,
            on_timeout=spec.on_timeout,
            snapshot=spec.snapshot,
            allow_privilege_escalation=spec.allow_privilege_escalation,
            cpu_class=spec.cpu_class,
        )


_RULE_KEYS = ("cidr", "domain", "protocol", "ports")


@dataclasses.dataclass(frozen=True)
class NetworkRule:
    """One kind of egress a sandbox may use. Set exactly one of ``cidr`` and
    ``domain``; the server checks the values and names the bad field
    (``network.allow[0].cidr: ...``).

    Attributes:
        cidr: IPv4 prefix ``"10.0.0.0/8"`` or address ``"192.0.2.7"``.
        domain: exact name ``"pypi.org"`` or suffix ``"*.pythonhosted.org"``.
        protocol: ``"tcp"``, ``"udp"``, ``"icmp"`` or ``""`` (tcp and udp with
            ports, everything without).
        ports: ``443``, ``"443"`` or ``"8000-8100"``; ``""`` = every port.
    """

    cidr: str = ""
    domain: str = ""
    protocol: str = ""
    ports: str | int = ""

    def to_proto(self) -> pb.NetworkRule:
        """Return the ``opendsec.v1.NetworkRule`` message."""
        return pb.NetworkRule(cidr=self.cidr, domain=self.domain, protocol=self.protocol, ports=str(self.ports))

    @classmethod
    def from_proto(cls, r: pb.NetworkRule) -> NetworkRule:
        """Build from an ``opendsec.v1.NetworkRule`` message."""
        return cls(cidr=r.cidr, domain=r.domain, protocol=r.protocol, ports=r.ports)


@dataclasses.dataclass(frozen=True)
class NetworkPolicy:
    """What a sandbox may reach: named rule sets of the node (e.g. ``"pypi"``)
    plus explicit rules. Everything else is denied, both ways.

    Attributes:
        rule_sets: names of rule sets from the node's configuration.
        allow: explicit rules.
    """

    rule_sets: tuple[str, ...] = ()
    allow: tuple[NetworkRule, ...] = ()

    def to_proto(self) -> pb.NetworkPolicy:
        """Return the ``opendsec.v1.NetworkPolicy`` message."""
        return pb.NetworkPolicy(rule_sets=list(self.rule_sets), allow=[r.to_proto() for r in self.allow])

    @classmethod
    def from_proto(cls, p: pb.NetworkPolicy) -> NetworkPolicy:
        """Build from an ``opendsec.v1.NetworkPolicy`` message."""
        return cls(rule_sets=tuple(p.rule_sets), allow=tuple(NetworkRule.from_proto(r) for r in p.allow))

    @classmethod
    def parse(cls, value: NetworkSpec, field: str = "network") -> NetworkPolicy:
        """Normalize every accepted form of a network policy (see :data:`NetworkSpec`).

        Raises:
            ConfigError: the value has the wrong shape; the message names ``field``.
        """
        if isinstance(value, NetworkPolicy):
            return value
        if isinstance(value, NetworkRule):
            return cls(allow=(value,))
        if isinstance(value, Mapping):
            if value and set(value) <= set(_RULE_KEYS) and not all(isinstance(v, bool) for v in value.values()):
                return cls(allow=(_rule(value, field),))
            sets: list[str] = []
            for name, on in value.items():
                if not isinstance(name, str) or not isinstance(on, bool):
                    raise ConfigError(
                        f"{field}: a mapping must map rule-set names to True/False, got {name!r}: {on!r}; "
                        'give explicit rules as a list, e.g. [{"cidr": "10.0.0.0/8", "ports": "443"}]'
                    )
                if on:
                    sets.append(name)
            return cls(rule_sets=tuple(sets))
        if isinstance(value, str | bytes) or not isinstance(value, Iterable):
            raise ConfigError(
                f"{field}: must be a NetworkPolicy, a mapping of rule-set names to True/False, "
                f"or a list of rule-set names, NetworkRule and rule dicts; got {type(value).__name__}"
            )
        sets = []
        rules: list[NetworkRule] = []
        for i, item in enumerate(value):
            if isinstance(item, str):
                sets.append(item)
            elif isinstance(item, NetworkRule):
                rules.append(item)
            elif isinstance(item, Mapping):
                rules.append(_rule(item, f"{field}[{i}]"))
            else:
                raise ConfigError(
                    f"{field}[{i}]: must be a rule-set name, a NetworkRule or a dict with "
                    f"{', '.join(_RULE_KEYS)}; got {type(item).__name__}"
                )
        return cls(rule_sets=tuple(sets), allow=tuple(rules))


#: Every form a network policy can be given in:
#:
#: - ``{"pypi": True, "npm": False}``: rule-set names, those mapped to True are on;
#: - ``[NetworkRule(cidr="10.0.0.0/8", ports="443"), {"domain": "pypi.org"}, "npm"]``:
#:   explicit rules (``NetworkRule`` or dicts) mixed with rule-set names;
#: - one ``NetworkRule`` or one rule dict;
#: - a :class:`NetworkPolicy`.
NetworkSpec: TypeAlias = (
    "NetworkPolicy | NetworkRule | Mapping[str, Any] | Iterable[str | NetworkRule | Mapping[str, Any]]"
)


def _rule(d: Mapping[str, Any], field: str) -> NetworkRule:
    unknown = sorted(str(k) for k in d if k not in _RULE_KEYS)
    if unknown:
        raise ConfigError(f"{field}: unknown rule keys {unknown}; use {', '.join(_RULE_KEYS)}")
    for k in ("cidr", "domain", "protocol"):
        if not isinstance(d.get(k, ""), str):
            raise ConfigError(f"{field}.{k}: must be a string, got {type(d[k]).__name__}")
    ports = d.get("ports", "")
    if isinstance(ports, bool) or not isinstance(ports, str | int):
        raise ConfigError(f'{field}.ports: must be a port or range like 443 or "8000-8100", got {ports!r}')
    return NetworkRule(cidr=d.get("cidr", ""), domain=d.get("domain", ""), protocol=d.get("protocol", ""), ports=ports)


def _seconds(v: float | None) -> int:
    """Whole seconds, rounding a fraction up (so 0.5 s is 1 s, not "default").
    Negative values are passed through for the server to reject."""
    if not v:
        return 0
    return math.ceil(v) if v > 0 else math.floor(v)


def _ts(t: timestamp_pb2.Timestamp, present: bool) -> _dt.datetime | None:
    if not present:
        return None
    d: _dt.datetime = t.ToDatetime(tzinfo=_dt.UTC)
    return d


class SandboxState(enum.StrEnum):
    """Lifecycle state of a sandbox."""

    UNSPECIFIED = "unspecified"
    CREATING = "creating"
    RUNNING = "running"
    PAUSED = "paused"
    STOPPING = "stopping"
    STOPPED = "stopped"
    FAILED = "failed"

    @classmethod
    def from_proto(cls, v: int) -> SandboxState:
        """Map an ``opendsec.v1.SandboxState`` value (unknown values → UNSPECIFIED)."""
        try:
            name = pb.SandboxState.Name(v)
        except ValueError:
            return cls.UNSPECIFIED
        return cls(name.removeprefix("SANDBOX_STATE_").lower())


@dataclasses.dataclass(frozen=True)
class SandboxInfo:
    """What the server knows about a sandbox.

    Attributes:
        id: sandbox ID (``[a-z0-9]``).
        node_id: the node that runs it.
        state: lifecycle state.
        spec: the spec it was created with (after server defaults).
        created_at / expires_at / last_activity_at: UTC times, ``None`` if unset.
        reason: why it is FAILED or STOPPED (e.g. ``"timeout"``, ``"idle"``).
        from_warm_pool: the create took a prestarted sandbox from its node's
            warm pool instead of making one from scratch.
        parent_id: the sandbox this one was forked from (``""`` for one
            made from an image).
        paused_filesystem: it is paused keeping only its files
            (``Sandbox.pause(filesystem_only=True)``): nothing of it runs.
    """

    id: str
    node_id: str
    state: SandboxState
    spec: DSecRunArgs
    created_at: _dt.datetime | None
    expires_at: _dt.datetime | None
    last_activity_at: _dt.datetime | None
    reason: str
    from_warm_pool: bool = False
    parent_id: str = ""
    paused_filesystem: bool = False

    @classmethod
    def from_proto(cls, s: pb.Sandbox) -> SandboxInfo:
        """Build from an ``opendsec.v1.Sandbox`` message."""
        return cls(
            id=s.id,
            node_id=s.node_id,
            state=SandboxState.from_proto(s.state),
            spec=DSecRunArgs.from_proto(s.spec),
            created_at=_ts(s.created_at, s.HasField("created_at")),
            expires_at=_ts(s.expires_at, s.HasField("expires_at")),
            last_activity_at=_ts(s.last_activity_at, s.HasField("last_activity_at")),
            reason=s.reason,
            from_warm_pool=s.from_warm_pool,
            parent_id=s.parent_id,
            paused_filesystem=s.paused_filesystem,
        )


@dataclasses.dataclass(frozen=True)
class SandboxMetrics:
    """One sample of a sandbox's resource use (host-side, cgroup-accounted).

    Attributes:
        timestamp: when it was taken (UTC).
        state: the sandbox's state (running or paused).
        cpu_count: the CPU limit in cores.
        cpu_used_pct: CPU used since the previous sample (or since start), in
            percent of ``cpu_count`` cores (0-100).
        cpu_usage_ns: CPU time used since the sandbox started.
        mem_used / mem_total / mem_cache: bytes charged (page cache included),
            the memory limit, and the page cache part.
        pids / pids_limit: processes and their limit.
        disk_used / disk_total: bytes written to the sandbox's root filesystem,
            and its quota (``disk_mb``).
    """

    timestamp: _dt.datetime | None
    state: SandboxState
    cpu_count: float
    cpu_used_pct: float
    cpu_usage_ns: int
    mem_used: int
    mem_total: int
    mem_cache: int
    pids: int
    pids_limit: int
    disk_used: int
    disk_total: int

    @classmethod
    def from_proto(cls, m: pb.SandboxMetrics) -> SandboxMetrics:
        """Build from an ``opendsec.v1.SandboxMetrics`` message."""
        return cls(
            timestamp=_ts(m.timestamp, m.HasField("timestamp")),
            state=SandboxState.from_proto(m.state),
            cpu_count=m.cpu_count,
            cpu_used_pct=m.cpu_used_pct,
            cpu_usage_ns=m.cpu_usage_ns,
            mem_used=m.mem_used_bytes,
            mem_total=m.mem_total_bytes,
            mem_cache=m.mem_cache_bytes,
            pids=m.pids,
            pids_limit=m.pids_limit,
            disk_used=m.disk_used_bytes,
            disk_total=m.disk_total_bytes,
        )


@dataclasses.dataclass(frozen=True)
class ExecResult:
    """Outcome of a finished process.

    Attributes:
        stdout: standard output decoded as UTF-8 (invalid bytes replaced).
        stderr: standard error decoded as UTF-8 (invalid bytes replaced). With a
            PTY, all output is in ``stdout``.
        exit_code: exit code; ``-1`` when a signal killed the process.
        status: the agent's description, e.g. ``"exit status 1"``, ``"signal: killed"``.
        timed_out: the process lifetime (``timeout``) killed it.
        output_truncated: output is missing: more than ``output_limit`` bytes
            of a stream were produced (the kept output is its first
            ``output_limit`` bytes), or the server dropped output read too slowly.
        pid: process ID inside the sandbox (0 if unknown).
        stdout_bytes / stderr_bytes: the raw kept output.
        stdout_total / stderr_total: bytes the process wrote to each stream,
            kept or not (more than ``len(stdout_bytes)`` when truncated, or
            when the caller iterated the output instead).
        replayed: the sandbox's trajectory log had this call's ``call_id``
            with its result: nothing ran, and the output is the recorded one
            (up to the log's per-call cap, ``node.trajectory.max_output_kb``).
        joined: the call's ``call_id`` was still running: this result is
            that process's, followed instead of starting another.
        seq: the call's sequence number in the sandbox's trajectory log.
        call_id: the call ID sent ("" for none).
    """

    stdout: str
    stderr: str
    exit_code: int
    status: str = ""
    timed_out: bool = False
    output_truncated: bool = False
    pid: int = 0
    stdout_bytes: bytes = b""
    stderr_bytes: bytes = b""
    stdout_total: int = 0
    stderr_total: int = 0
    replayed: bool = False
    joined: bool = False
    seq: int = 0
    call_id: str = ""

    @property
    def ok(self) -> bool:
        """True when the process exited with code 0."""
        return self.exit_code == 0


@dataclasses.dataclass(frozen=True)
class ExecEvent:
    """One chunk of process output.

    Attributes:
        stream: ``"stdout"``, ``"stderr"`` or ``"pty"``.
        data: the raw bytes.
    """

    stream: str
    data: bytes

    @property
    def text(self) -> str:
        """The chunk decoded as UTF-8 (invalid bytes replaced; a multi-byte
        character split across chunks shows as replacement characters)."""
        return self.data.decode("utf-8", errors="replace")


class FileType(enum.StrEnum):
    """Kind of a file system entry."""

    UNSPECIFIED = "unspecified"
    FILE = "file"
    DIRECTORY = "directory"
    SYMLINK = "symlink"

    @classmethod
    def from_proto(cls, v: int) -> FileType:
        """Map an ``opendsec.v1.FileType`` value (unknown values → UNSPECIFIED)."""
        try:
            name = pb.FileType.Name(v)
        except ValueError:
            return cls.UNSPECIFIED
        return cls(name.removeprefix("FILE_TYPE_").lower())


@dataclasses.dataclass(frozen=True)
class FileInfo:
    """A file system entry inside a sandbox."""

    name: str
    path: str
    type: FileType
    size: int
    mode: int
    owner: str
    group: str
    modified_at: _dt.datetime | None
    symlink_target: str

    @property
    def is_dir(self) -> bool:
        """True for a directory."""
        return self.type is FileType.DIRECTORY

    @classmethod
    def from_proto(cls, f: pb.FileInfo) -> FileInfo:
        """Build from an ``opendsec.v1.FileInfo`` message."""
        return cls(
            name=f.name,
            path=f.path,
            type=FileType.from_proto(f.type),
            size=f.size,
            mode=f.mode,
            owner=f.owner,
            group=f.group,
            modified_at=_ts(f.modified_at, f.HasField("modified_at")),
            symlink_target=f.symlink_target,
        )


@dataclasses.dataclass(frozen=True)
class ProcessInfo:
    """A process running inside a sandbox (started through the SDK or the agent)."""

    pid: int
    command: list[str]
    tag: str
    cwd: str

    @classmethod
    def from_proto(cls, p: pb.ProcessInfo) -> ProcessInfo:
        """Build from an ``opendsec.v1.ProcessInfo`` message."""
        return cls(pid=p.pid, command=list(p.command), tag=p.tag, cwd=p.cwd)


@dataclasses.dataclass(frozen=True)
class HTTPResponse:
    """Response of an HTTP request into a sandbox port.

    Attributes:
        status: HTTP status code.
        headers: response headers in order, as ``(name, value)`` pairs.
        body: the raw body.
    """

    status: int
    headers: list[tuple[str, str]]
    body: bytes

    def header(self, name: str, default: str | None = None) -> str | None:
        """The first header called ``name`` (case-insensitive), or ``default``."""
        low = name.lower()
        for k, v in self.headers:
            if k.lower() == low:
                return v
        return default

    @property
    def text(self) -> str:
        """The body decoded as UTF-8 (invalid bytes replaced)."""
        return self.body.decode("utf-8", errors="replace")

    def json(self) -> Any:
        """The body parsed as JSON."""
        return _json.loads(self.body)


def _headers(h: Mapping[str, str] | list[tuple[str, str]] | None) -> list[pb.Header]:
    if not h:
        return []
    items = h.items() if isinstance(h, Mapping) else h
    return [pb.Header(name=k, value=v) for k, v in items]
