import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SandboxState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SANDBOX_STATE_UNSPECIFIED: _ClassVar[SandboxState]
    SANDBOX_STATE_CREATING: _ClassVar[SandboxState]
    SANDBOX_STATE_RUNNING: _ClassVar[SandboxState]
    SANDBOX_STATE_PAUSED: _ClassVar[SandboxState]
    SANDBOX_STATE_STOPPING: _ClassVar[SandboxState]
    SANDBOX_STATE_STOPPED: _ClassVar[SandboxState]
    SANDBOX_STATE_FAILED: _ClassVar[SandboxState]

class FileType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FILE_TYPE_UNSPECIFIED: _ClassVar[FileType]
    FILE_TYPE_FILE: _ClassVar[FileType]
    FILE_TYPE_DIRECTORY: _ClassVar[FileType]
    FILE_TYPE_SYMLINK: _ClassVar[FileType]
SANDBOX_STATE_UNSPECIFIED: SandboxState
SANDBOX_STATE_CREATING: SandboxState
SANDBOX_STATE_RUNNING: SandboxState
SANDBOX_STATE_PAUSED: SandboxState
SANDBOX_STATE_STOPPING: SandboxState
SANDBOX_STATE_STOPPED: SandboxState
SANDBOX_STATE_FAILED: SandboxState
FILE_TYPE_UNSPECIFIED: FileType
FILE_TYPE_FILE: FileType
FILE_TYPE_DIRECTORY: FileType
FILE_TYPE_SYMLINK: FileType

class SandboxSpec(_message.Message):
    __slots__ = ("backend", "image", "cpu", "memory_mb", "timeout_seconds", "idle_timeout_seconds", "env", "user", "labels", "task_id", "pids_limit", "workdir", "network", "auto_pause", "disk_mb", "snapshot", "on_timeout", "allow_privilege_escalation", "cpu_class")
    class EnvEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    CPU_FIELD_NUMBER: _ClassVar[int]
    MEMORY_MB_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    IDLE_TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ENV_FIELD_NUMBER: _ClassVar[int]
    USER_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    PIDS_LIMIT_FIELD_NUMBER: _ClassVar[int]
    WORKDIR_FIELD_NUMBER: _ClassVar[int]
    NETWORK_FIELD_NUMBER: _ClassVar[int]
    AUTO_PAUSE_FIELD_NUMBER: _ClassVar[int]
    DISK_MB_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    ON_TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    ALLOW_PRIVILEGE_ESCALATION_FIELD_NUMBER: _ClassVar[int]
    CPU_CLASS_FIELD_NUMBER: _ClassVar[int]
    backend: str
    image: str
    cpu: float
    memory_mb: int
    timeout_seconds: int
    idle_timeout_seconds: int
    env: _containers.ScalarMap[str, str]
    user: str
    labels: _containers.ScalarMap[str, str]
    task_id: str
    pids_limit: int
    workdir: str
    network: NetworkPolicy
    auto_pause: bool
    disk_mb: int
    snapshot: str
    on_timeout: str
    allow_privilege_escalation: bool
    cpu_class: str
    def __init__(self, backend: _Optional[str] = ..., image: _Optional[str] = ..., cpu: _Optional[float] = ..., memory_mb: _Optional[int] = ..., timeout_seconds: _Optional[int] = ..., idle_timeout_seconds: _Optional[int] = ..., env: _Optional[_Mapping[str, str]] = ..., user: _Optional[str] = ..., labels: _Optional[_Mapping[str, str]] = ..., task_id: _Optional[str] = ..., pids_limit: _Optional[int] = ..., workdir: _Optional[str] = ..., network: _Optional[_Union[NetworkPolicy, _Mapping]] = ..., auto_pause: bool = ..., disk_mb: _Optional[int] = ..., snapshot: _Optional[str] = ..., on_timeout: _Optional[str] = ..., allow_privilege_escalation: bool = ..., cpu_class: _Optional[str] = ...) -> None: ...

class NetworkPolicy(_message.Message):
    __slots__ = ("rule_sets", "allow")
    RULE_SETS_FIELD_NUMBER: _ClassVar[int]
    ALLOW_FIELD_NUMBER: _ClassVar[int]
    rule_sets: _containers.RepeatedScalarFieldContainer[str]
    allow: _containers.RepeatedCompositeFieldContainer[NetworkRule]
    def __init__(self, rule_sets: _Optional[_Iterable[str]] = ..., allow: _Optional[_Iterable[_Union[NetworkRule, _Mapping]]] = ...) -> None: ...

class NetworkRule(_message.Message):
    __slots__ = ("cidr", "domain", "protocol", "ports")
    CIDR_FIELD_NUMBER: _ClassVar[int]
    DOMAIN_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_FIELD_NUMBER: _ClassVar[int]
    PORTS_FIELD_NUMBER: _ClassVar[int]
    cidr: str
    domain: str
    protocol: str
    ports: str
    def __init__(self, cidr: _Optional[str] = ..., domain: _Optional[str] = ..., protocol: _Optional[str] = ..., ports: _Optional[str] = ...) -> None: ...

class Sandbox(_message.Message):
    __slots__ = ("id", "node_id", "spec", "state", "created_at", "expires_at", "last_activity_at", "reason", "from_warm_pool", "owner", "project", "parent_id", "paused_filesystem")
    ID_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    LAST_ACTIVITY_AT_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    FROM_WARM_POOL_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    PROJECT_FIELD_NUMBER: _ClassVar[int]
    PARENT_ID_FIELD_NUMBER: _ClassVar[int]
    PAUSED_FILESYSTEM_FIELD_NUMBER: _ClassVar[int]
    id: str
    node_id: str
    spec: SandboxSpec
    state: SandboxState
    created_at: _timestamp_pb2.Timestamp
    expires_at: _timestamp_pb2.Timestamp
    last_activity_at: _timestamp_pb2.Timestamp
    reason: str
    from_warm_pool: bool
    owner: str
    project: str
    parent_id: str
    paused_filesystem: bool
    def __init__(self, id: _Optional[str] = ..., node_id: _Optional[str] = ..., spec: _Optional[_Union[SandboxSpec, _Mapping]] = ..., state: _Optional[_Union[SandboxState, str]] = ..., created_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., expires_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., last_activity_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., reason: _Optional[str] = ..., from_warm_pool: bool = ..., owner: _Optional[str] = ..., project: _Optional[str] = ..., parent_id: _Optional[str] = ..., paused_filesystem: bool = ...) -> None: ...

class CreateSandboxRequest(_message.Message):
    __slots__ = ("spec", "request_id", "skip_warm_pool")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SKIP_WARM_POOL_FIELD_NUMBER: _ClassVar[int]
    spec: SandboxSpec
    request_id: str
    skip_warm_pool: bool
    def __init__(self, spec: _Optional[_Union[SandboxSpec, _Mapping]] = ..., request_id: _Optional[str] = ..., skip_warm_pool: bool = ...) -> None: ...

class CreateSandboxResponse(_message.Message):
    __slots__ = ("sandbox",)
    SANDBOX_FIELD_NUMBER: _ClassVar[int]
    sandbox: Sandbox
    def __init__(self, sandbox: _Optional[_Union[Sandbox, _Mapping]] = ...) -> None: ...

class BatchCreateSandboxesRequest(_message.Message):
    __slots__ = ("spec", "count", "request_id", "skip_warm_pool")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SKIP_WARM_POOL_FIELD_NUMBER: _ClassVar[int]
    spec: SandboxSpec
    count: int
    request_id: str
    skip_warm_pool: bool
    def __init__(self, spec: _Optional[_Union[SandboxSpec, _Mapping]] = ..., count: _Optional[int] = ..., request_id: _Optional[str] = ..., skip_warm_pool: bool = ...) -> None: ...

class BatchCreateSandboxesResponse(_message.Message):
    __slots__ = ("index", "sandbox", "error_code", "error_message")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    SANDBOX_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    index: int
    sandbox: Sandbox
    error_code: str
    error_message: str
    def __init__(self, index: _Optional[int] = ..., sandbox: _Optional[_Union[Sandbox, _Mapping]] = ..., error_code: _Optional[str] = ..., error_message: _Optional[str] = ...) -> None: ...

class PrewarmSandboxesRequest(_message.Message):
    __slots__ = ("spec", "count", "ttl_seconds", "wait")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    WAIT_FIELD_NUMBER: _ClassVar[int]
    spec: SandboxSpec
    count: int
    ttl_seconds: int
    wait: bool
    def __init__(self, spec: _Optional[_Union[SandboxSpec, _Mapping]] = ..., count: _Optional[int] = ..., ttl_seconds: _Optional[int] = ..., wait: bool = ...) -> None: ...

class PrewarmSandboxesResponse(_message.Message):
    __slots__ = ("held", "ready", "reason", "ttl_seconds", "nodes")
    HELD_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    held: int
    ready: int
    reason: str
    ttl_seconds: int
    nodes: _containers.RepeatedCompositeFieldContainer[PrewarmNodeResult]
    def __init__(self, held: _Optional[int] = ..., ready: _Optional[int] = ..., reason: _Optional[str] = ..., ttl_seconds: _Optional[int] = ..., nodes: _Optional[_Iterable[_Union[PrewarmNodeResult, _Mapping]]] = ...) -> None: ...

class PrewarmNodeResult(_message.Message):
    __slots__ = ("node_id", "held", "ready", "reason")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    held: int
    ready: int
    reason: str
    def __init__(self, node_id: _Optional[str] = ..., held: _Optional[int] = ..., ready: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class GetSandboxRequest(_message.Message):
    __slots__ = ("id",)
    ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    def __init__(self, id: _Optional[str] = ...) -> None: ...

class GetSandboxResponse(_message.Message):
    __slots__ = ("sandbox",)
    SANDBOX_FIELD_NUMBER: _ClassVar[int]
    sandbox: Sandbox
    def __init__(self, sandbox: _Optional[_Union[Sandbox, _Mapping]] = ...) -> None: ...

class ListSandboxesRequest(_message.Message):
    __slots__ = ("labels", "task_id", "backend")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    LABELS_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    labels: _containers.ScalarMap[str, str]
    task_id: str
    backend: str
    def __init__(self, labels: _Optional[_Mapping[str, str]] = ..., task_id: _Optional[str] = ..., backend: _Optional[str] = ...) -> None: ...

class ListSandboxesResponse(_message.Message):
    __slots__ = ("sandboxes",)
    SANDBOXES_FIELD_NUMBER: _ClassVar[int]
    sandboxes: _containers.RepeatedCompositeFieldContainer[Sandbox]
    def __init__(self, sandboxes: _Optional[_Iterable[_Union[Sandbox, _Mapping]]] = ...) -> None: ...

class StopSandboxRequest(_message.Message):
    __slots__ = ("id",)
    ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    def __init__(self, id: _Optional[str] = ...) -> None: ...

class StopSandboxResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SetTimeoutRequest(_message.Message):
    __slots__ = ("id", "timeout_seconds")
    ID_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    id: str
    timeout_seconds: int
    def __init__(self, id: _Optional[str] = ..., timeout_seconds: _Optional[int] = ...) -> None: ...

class SetNetworkRequest(_message.Message):
    __slots__ = ("id", "network")
    ID_FIELD_NUMBER: _ClassVar[int]
    NETWORK_FIELD_NUMBER: _ClassVar[int]
    id: str
    network: NetworkPolicy
    def __init__(self, id: _Optional[str] = ..., network: _Optional[_Union[NetworkPolicy, _Mapping]] = ...) -> None: ...

class SetNetworkResponse(_message.Message):
    __slots__ = ("sandbox",)
    SANDBOX_FIELD_NUMBER: _ClassVar[int]
    sandbox: Sandbox
    def __init__(self, sandbox: _Optional[_Union[Sandbox, _Mapping]] = ...) -> None: ...

class SetTimeoutResponse(_message.Message):
    __slots__ = ("sandbox",)
    SANDBOX_FIELD_NUMBER: _ClassVar[int]
    sandbox: Sandbox
    def __init__(self, sandbox: _Optional[_Union[Sandbox, _Mapping]] = ...) -> None: ...

class ForkSandboxRequest(_message.Message):
    __slots__ = ("sandbox_id", "count", "request_id", "timeout_seconds", "target_node")
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TARGET_NODE_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    count: int
    request_id: str
    timeout_seconds: int
    target_node: str
    def __init__(self, sandbox_id: _Optional[str] = ..., count: _Optional[int] = ..., request_id: _Optional[str] = ..., timeout_seconds: _Optional[int] = ..., target_node: _Optional[str] = ...) -> None: ...

class ForkSandboxResponse(_message.Message):
    __slots__ = ("forks", "source_frozen_us")
    FORKS_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FROZEN_US_FIELD_NUMBER: _ClassVar[int]
    forks: _containers.RepeatedCompositeFieldContainer[ForkResult]
    source_frozen_us: int
    def __init__(self, forks: _Optional[_Iterable[_Union[ForkResult, _Mapping]]] = ..., source_frozen_us: _Optional[int] = ...) -> None: ...

class ForkResult(_message.Message):
    __slots__ = ("sandbox", "memory_preserved")
    SANDBOX_FIELD_NUMBER: _ClassVar[int]
    MEMORY_PRESERVED_FIELD_NUMBER: _ClassVar[int]
    sandbox: Sandbox
    memory_preserved: bool
    def __init__(self, sandbox: _Optional[_Union[Sandbox, _Mapping]] = ..., memory_preserved: bool = ...) -> None: ...

class PauseSandboxRequest(_message.Message):
    __slots__ = ("id", "reclaim", "filesystem_only")
    ID_FIELD_NUMBER: _ClassVar[int]
    RECLAIM_FIELD_NUMBER: _ClassVar[int]
    FILESYSTEM_ONLY_FIELD_NUMBER: _ClassVar[int]
    id: str
    reclaim: bool
    filesystem_only: bool
    def __init__(self, id: _Optional[str] = ..., reclaim: bool = ..., filesystem_only: bool = ...) -> None: ...

class PauseSandboxResponse(_message.Message):
    __slots__ = ("sandbox", "bytes_freed")
    SANDBOX_FIELD_NUMBER: _ClassVar[int]
    BYTES_FREED_FIELD_NUMBER: _ClassVar[int]
    sandbox: Sandbox
    bytes_freed: int
    def __init__(self, sandbox: _Optional[_Union[Sandbox, _Mapping]] = ..., bytes_freed: _Optional[int] = ...) -> None: ...

class ResumeSandboxRequest(_message.Message):
    __slots__ = ("id", "timeout_seconds")
    ID_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    id: str
    timeout_seconds: int
    def __init__(self, id: _Optional[str] = ..., timeout_seconds: _Optional[int] = ...) -> None: ...

class ResumeSandboxResponse(_message.Message):
    __slots__ = ("sandbox",)
    SANDBOX_FIELD_NUMBER: _ClassVar[int]
    sandbox: Sandbox
    def __init__(self, sandbox: _Optional[_Union[Sandbox, _Mapping]] = ...) -> None: ...

class GetSandboxMetricsRequest(_message.Message):
    __slots__ = ("id",)
    ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    def __init__(self, id: _Optional[str] = ...) -> None: ...

class SandboxMetrics(_message.Message):
    __slots__ = ("timestamp", "cpu_count", "cpu_used_pct", "cpu_usage_ns", "mem_used_bytes", "mem_total_bytes", "mem_cache_bytes", "pids", "pids_limit", "disk_used_bytes", "disk_total_bytes", "state")
    TIMESTAMP_FIELD_NUMBER: _ClassVar[int]
    CPU_COUNT_FIELD_NUMBER: _ClassVar[int]
    CPU_USED_PCT_FIELD_NUMBER: _ClassVar[int]
    CPU_USAGE_NS_FIELD_NUMBER: _ClassVar[int]
    MEM_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEM_TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEM_CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    PIDS_FIELD_NUMBER: _ClassVar[int]
    PIDS_LIMIT_FIELD_NUMBER: _ClassVar[int]
    DISK_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    DISK_TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    timestamp: _timestamp_pb2.Timestamp
    cpu_count: float
    cpu_used_pct: float
    cpu_usage_ns: int
    mem_used_bytes: int
    mem_total_bytes: int
    mem_cache_bytes: int
    pids: int
    pids_limit: int
    disk_used_bytes: int
    disk_total_bytes: int
    state: SandboxState
    def __init__(self, timestamp: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., cpu_count: _Optional[float] = ..., cpu_used_pct: _Optional[float] = ..., cpu_usage_ns: _Optional[int] = ..., mem_used_bytes: _Optional[int] = ..., mem_total_bytes: _Optional[int] = ..., mem_cache_bytes: _Optional[int] = ..., pids: _Optional[int] = ..., pids_limit: _Optional[int] = ..., disk_used_bytes: _Optional[int] = ..., disk_total_bytes: _Optional[int] = ..., state: _Optional[_Union[SandboxState, str]] = ...) -> None: ...

class GetSandboxMetricsResponse(_message.Message):
    __slots__ = ("metrics",)
    METRICS_FIELD_NUMBER: _ClassVar[int]
    metrics: SandboxMetrics
    def __init__(self, metrics: _Optional[_Union[SandboxMetrics, _Mapping]] = ...) -> None: ...

class SandboxSelector(_message.Message):
    __slots__ = ("labels", "task_id", "ids")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    LABELS_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    labels: _containers.ScalarMap[str, str]
    task_id: str
    ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, labels: _Optional[_Mapping[str, str]] = ..., task_id: _Optional[str] = ..., ids: _Optional[_Iterable[str]] = ...) -> None: ...

class BatchFailure(_message.Message):
    __slots__ = ("sandbox_id", "error_code", "error_message")
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    error_code: str
    error_message: str
    def __init__(self, sandbox_id: _Optional[str] = ..., error_code: _Optional[str] = ..., error_message: _Optional[str] = ...) -> None: ...

class PauseSandboxesRequest(_message.Message):
    __slots__ = ("selector", "reclaim")
    SELECTOR_FIELD_NUMBER: _ClassVar[int]
    RECLAIM_FIELD_NUMBER: _ClassVar[int]
    selector: SandboxSelector
    reclaim: bool
    def __init__(self, selector: _Optional[_Union[SandboxSelector, _Mapping]] = ..., reclaim: bool = ...) -> None: ...

class SandboxReclaim(_message.Message):
    __slots__ = ("sandbox_id", "bytes_before", "bytes_after", "bytes_freed", "note")
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    BYTES_BEFORE_FIELD_NUMBER: _ClassVar[int]
    BYTES_AFTER_FIELD_NUMBER: _ClassVar[int]
    BYTES_FREED_FIELD_NUMBER: _ClassVar[int]
    NOTE_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    bytes_before: int
    bytes_after: int
    bytes_freed: int
    note: str
    def __init__(self, sandbox_id: _Optional[str] = ..., bytes_before: _Optional[int] = ..., bytes_after: _Optional[int] = ..., bytes_freed: _Optional[int] = ..., note: _Optional[str] = ...) -> None: ...

class PauseSandboxesResponse(_message.Message):
    __slots__ = ("sandboxes", "failures", "reclaimed", "bytes_freed")
    SANDBOXES_FIELD_NUMBER: _ClassVar[int]
    FAILURES_FIELD_NUMBER: _ClassVar[int]
    RECLAIMED_FIELD_NUMBER: _ClassVar[int]
    BYTES_FREED_FIELD_NUMBER: _ClassVar[int]
    sandboxes: _containers.RepeatedCompositeFieldContainer[Sandbox]
    failures: _containers.RepeatedCompositeFieldContainer[BatchFailure]
    reclaimed: _containers.RepeatedCompositeFieldContainer[SandboxReclaim]
    bytes_freed: int
    def __init__(self, sandboxes: _Optional[_Iterable[_Union[Sandbox, _Mapping]]] = ..., failures: _Optional[_Iterable[_Union[BatchFailure, _Mapping]]] = ..., reclaimed: _Optional[_Iterable[_Union[SandboxReclaim, _Mapping]]] = ..., bytes_freed: _Optional[int] = ...) -> None: ...

class ResumeSandboxesRequest(_message.Message):
    __slots__ = ("selector", "timeout_seconds")
    SELECTOR_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    selector: SandboxSelector
    timeout_seconds: int
    def __init__(self, selector: _Optional[_Union[SandboxSelector, _Mapping]] = ..., timeout_seconds: _Optional[int] = ...) -> None: ...

class ResumeSandboxesResponse(_message.Message):
    __slots__ = ("sandboxes", "failures")
    SANDBOXES_FIELD_NUMBER: _ClassVar[int]
    FAILURES_FIELD_NUMBER: _ClassVar[int]
    sandboxes: _containers.RepeatedCompositeFieldContainer[Sandbox]
    failures: _containers.RepeatedCompositeFieldContainer[BatchFailure]
    def __init__(self, sandboxes: _Optional[_Iterable[_Union[Sandbox, _Mapping]]] = ..., failures: _Optional[_Iterable[_Union[BatchFailure, _Mapping]]] = ...) -> None: ...

class ExecStart(_message.Message):
    __slots__ = ("sandbox_id", "command", "env", "cwd", "user", "stdin", "timeout_seconds", "pty", "tag", "output_limit_bytes", "call_id")
    class EnvEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    COMMAND_FIELD_NUMBER: _ClassVar[int]
    ENV_FIELD_NUMBER: _ClassVar[int]
    CWD_FIELD_NUMBER: _ClassVar[int]
    USER_FIELD_NUMBER: _ClassVar[int]
    STDIN_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PTY_FIELD_NUMBER: _ClassVar[int]
    TAG_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_LIMIT_BYTES_FIELD_NUMBER: _ClassVar[int]
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    command: _containers.RepeatedScalarFieldContainer[str]
    env: _containers.ScalarMap[str, str]
    cwd: str
    user: str
    stdin: bool
    timeout_seconds: int
    pty: PtySize
    tag: str
    output_limit_bytes: int
    call_id: str
    def __init__(self, sandbox_id: _Optional[str] = ..., command: _Optional[_Iterable[str]] = ..., env: _Optional[_Mapping[str, str]] = ..., cwd: _Optional[str] = ..., user: _Optional[str] = ..., stdin: bool = ..., timeout_seconds: _Optional[int] = ..., pty: _Optional[_Union[PtySize, _Mapping]] = ..., tag: _Optional[str] = ..., output_limit_bytes: _Optional[int] = ..., call_id: _Optional[str] = ...) -> None: ...

class PtySize(_message.Message):
    __slots__ = ("cols", "rows")
    COLS_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    cols: int
    rows: int
    def __init__(self, cols: _Optional[int] = ..., rows: _Optional[int] = ...) -> None: ...

class ExecRequest(_message.Message):
    __slots__ = ("start", "stdin", "close_stdin", "resize", "signal")
    START_FIELD_NUMBER: _ClassVar[int]
    STDIN_FIELD_NUMBER: _ClassVar[int]
    CLOSE_STDIN_FIELD_NUMBER: _ClassVar[int]
    RESIZE_FIELD_NUMBER: _ClassVar[int]
    SIGNAL_FIELD_NUMBER: _ClassVar[int]
    start: ExecStart
    stdin: bytes
    close_stdin: bool
    resize: PtySize
    signal: int
    def __init__(self, start: _Optional[_Union[ExecStart, _Mapping]] = ..., stdin: _Optional[bytes] = ..., close_stdin: bool = ..., resize: _Optional[_Union[PtySize, _Mapping]] = ..., signal: _Optional[int] = ...) -> None: ...

class ExecResponse(_message.Message):
    __slots__ = ("started", "stdout", "stderr", "pty", "exit")
    STARTED_FIELD_NUMBER: _ClassVar[int]
    STDOUT_FIELD_NUMBER: _ClassVar[int]
    STDERR_FIELD_NUMBER: _ClassVar[int]
    PTY_FIELD_NUMBER: _ClassVar[int]
    EXIT_FIELD_NUMBER: _ClassVar[int]
    started: ExecStarted
    stdout: bytes
    stderr: bytes
    pty: bytes
    exit: ExecExit
    def __init__(self, started: _Optional[_Union[ExecStarted, _Mapping]] = ..., stdout: _Optional[bytes] = ..., stderr: _Optional[bytes] = ..., pty: _Optional[bytes] = ..., exit: _Optional[_Union[ExecExit, _Mapping]] = ...) -> None: ...

class ExecStarted(_message.Message):
    __slots__ = ("pid", "seq", "replayed", "joined")
    PID_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    REPLAYED_FIELD_NUMBER: _ClassVar[int]
    JOINED_FIELD_NUMBER: _ClassVar[int]
    pid: int
    seq: int
    replayed: bool
    joined: bool
    def __init__(self, pid: _Optional[int] = ..., seq: _Optional[int] = ..., replayed: bool = ..., joined: bool = ...) -> None: ...

class ExecExit(_message.Message):
    __slots__ = ("exit_code", "status", "timed_out", "output_truncated", "stdout_total_bytes", "stderr_total_bytes", "replayed")
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    TIMED_OUT_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    STDOUT_TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    STDERR_TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    REPLAYED_FIELD_NUMBER: _ClassVar[int]
    exit_code: int
    status: str
    timed_out: bool
    output_truncated: bool
    stdout_total_bytes: int
    stderr_total_bytes: int
    replayed: bool
    def __init__(self, exit_code: _Optional[int] = ..., status: _Optional[str] = ..., timed_out: bool = ..., output_truncated: bool = ..., stdout_total_bytes: _Optional[int] = ..., stderr_total_bytes: _Optional[int] = ..., replayed: bool = ...) -> None: ...

class ProcessInfo(_message.Message):
    __slots__ = ("pid", "command", "tag", "cwd")
    PID_FIELD_NUMBER: _ClassVar[int]
    COMMAND_FIELD_NUMBER: _ClassVar[int]
    TAG_FIELD_NUMBER: _ClassVar[int]
    CWD_FIELD_NUMBER: _ClassVar[int]
    pid: int
    command: _containers.RepeatedScalarFieldContainer[str]
    tag: str
    cwd: str
    def __init__(self, pid: _Optional[int] = ..., command: _Optional[_Iterable[str]] = ..., tag: _Optional[str] = ..., cwd: _Optional[str] = ...) -> None: ...

class ListProcessesRequest(_message.Message):
    __slots__ = ("sandbox_id",)
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    def __init__(self, sandbox_id: _Optional[str] = ...) -> None: ...

class ListProcessesResponse(_message.Message):
    __slots__ = ("processes",)
    PROCESSES_FIELD_NUMBER: _ClassVar[int]
    processes: _containers.RepeatedCompositeFieldContainer[ProcessInfo]
    def __init__(self, processes: _Optional[_Iterable[_Union[ProcessInfo, _Mapping]]] = ...) -> None: ...

class SignalProcessRequest(_message.Message):
    __slots__ = ("sandbox_id", "pid", "signal")
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    SIGNAL_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    pid: int
    signal: int
    def __init__(self, sandbox_id: _Optional[str] = ..., pid: _Optional[int] = ..., signal: _Optional[int] = ...) -> None: ...

class SignalProcessResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SendInputRequest(_message.Message):
    __slots__ = ("sandbox_id", "pid", "data", "pty")
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    PTY_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    pid: int
    data: bytes
    pty: bool
    def __init__(self, sandbox_id: _Optional[str] = ..., pid: _Optional[int] = ..., data: _Optional[bytes] = ..., pty: bool = ...) -> None: ...

class SendInputResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResizePtyRequest(_message.Message):
    __slots__ = ("sandbox_id", "pid", "size")
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    pid: int
    size: PtySize
    def __init__(self, sandbox_id: _Optional[str] = ..., pid: _Optional[int] = ..., size: _Optional[_Union[PtySize, _Mapping]] = ...) -> None: ...

class ResizePtyResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class FileInfo(_message.Message):
    __slots__ = ("name", "path", "type", "size", "mode", "owner", "group", "modified_at", "symlink_target")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    MODIFIED_AT_FIELD_NUMBER: _ClassVar[int]
    SYMLINK_TARGET_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    type: FileType
    size: int
    mode: int
    owner: str
    group: str
    modified_at: _timestamp_pb2.Timestamp
    symlink_target: str
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ..., type: _Optional[_Union[FileType, str]] = ..., size: _Optional[int] = ..., mode: _Optional[int] = ..., owner: _Optional[str] = ..., group: _Optional[str] = ..., modified_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., symlink_target: _Optional[str] = ...) -> None: ...

class ReadFileRequest(_message.Message):
    __slots__ = ("sandbox_id", "path", "user")
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    USER_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    path: str
    user: str
    def __init__(self, sandbox_id: _Optional[str] = ..., path: _Optional[str] = ..., user: _Optional[str] = ...) -> None: ...

class ReadFileResponse(_message.Message):
    __slots__ = ("data",)
    DATA_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    def __init__(self, data: _Optional[bytes] = ...) -> None: ...

class WriteFileHeader(_message.Message):
    __slots__ = ("sandbox_id", "path", "user", "size")
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    USER_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    path: str
    user: str
    size: int
    def __init__(self, sandbox_id: _Optional[str] = ..., path: _Optional[str] = ..., user: _Optional[str] = ..., size: _Optional[int] = ...) -> None: ...

class WriteFileRequest(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: WriteFileHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[WriteFileHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class WriteFileResponse(_message.Message):
    __slots__ = ("file",)
    FILE_FIELD_NUMBER: _ClassVar[int]
    file: FileInfo
    def __init__(self, file: _Optional[_Union[FileInfo, _Mapping]] = ...) -> None: ...

class ListDirRequest(_message.Message):
    __slots__ = ("sandbox_id", "path", "depth", "user")
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    DEPTH_FIELD_NUMBER: _ClassVar[int]
    USER_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    path: str
    depth: int
    user: str
    def __init__(self, sandbox_id: _Optional[str] = ..., path: _Optional[str] = ..., depth: _Optional[int] = ..., user: _Optional[str] = ...) -> None: ...

class ListDirResponse(_message.Message):
    __slots__ = ("entries",)
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[FileInfo]
    def __init__(self, entries: _Optional[_Iterable[_Union[FileInfo, _Mapping]]] = ...) -> None: ...

class StatRequest(_message.Message):
    __slots__ = ("sandbox_id", "path", "user")
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    USER_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    path: str
    user: str
    def __init__(self, sandbox_id: _Optional[str] = ..., path: _Optional[str] = ..., user: _Optional[str] = ...) -> None: ...

class StatResponse(_message.Message):
    __slots__ = ("file",)
    FILE_FIELD_NUMBER: _ClassVar[int]
    file: FileInfo
    def __init__(self, file: _Optional[_Union[FileInfo, _Mapping]] = ...) -> None: ...

class RemoveRequest(_message.Message):
    __slots__ = ("sandbox_id", "path", "user")
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    USER_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    path: str
    user: str
    def __init__(self, sandbox_id: _Optional[str] = ..., path: _Optional[str] = ..., user: _Optional[str] = ...) -> None: ...

class RemoveResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class MakeDirRequest(_message.Message):
    __slots__ = ("sandbox_id", "path", "user")
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    USER_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    path: str
    user: str
    def __init__(self, sandbox_id: _Optional[str] = ..., path: _Optional[str] = ..., user: _Optional[str] = ...) -> None: ...

class MakeDirResponse(_message.Message):
    __slots__ = ("file", "created")
    FILE_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    file: FileInfo
    created: bool
    def __init__(self, file: _Optional[_Union[FileInfo, _Mapping]] = ..., created: bool = ...) -> None: ...

class MoveRequest(_message.Message):
    __slots__ = ("sandbox_id", "source", "destination", "user")
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    DESTINATION_FIELD_NUMBER: _ClassVar[int]
    USER_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    source: str
    destination: str
    user: str
    def __init__(self, sandbox_id: _Optional[str] = ..., source: _Optional[str] = ..., destination: _Optional[str] = ..., user: _Optional[str] = ...) -> None: ...

class MoveResponse(_message.Message):
    __slots__ = ("file",)
    FILE_FIELD_NUMBER: _ClassVar[int]
    file: FileInfo
    def __init__(self, file: _Optional[_Union[FileInfo, _Mapping]] = ...) -> None: ...

class Header(_message.Message):
    __slots__ = ("name", "value")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    name: str
    value: str
    def __init__(self, name: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...

class HTTPRequestRequest(_message.Message):
    __slots__ = ("sandbox_id", "port", "method", "path", "headers", "body", "timeout_ms")
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    HEADERS_FIELD_NUMBER: _ClassVar[int]
    BODY_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    port: int
    method: str
    path: str
    headers: _containers.RepeatedCompositeFieldContainer[Header]
    body: bytes
    timeout_ms: int
    def __init__(self, sandbox_id: _Optional[str] = ..., port: _Optional[int] = ..., method: _Optional[str] = ..., path: _Optional[str] = ..., headers: _Optional[_Iterable[_Union[Header, _Mapping]]] = ..., body: _Optional[bytes] = ..., timeout_ms: _Optional[int] = ...) -> None: ...

class HTTPRequestResponse(_message.Message):
    __slots__ = ("status", "headers", "body")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    HEADERS_FIELD_NUMBER: _ClassVar[int]
    BODY_FIELD_NUMBER: _ClassVar[int]
    status: int
    headers: _containers.RepeatedCompositeFieldContainer[Header]
    body: bytes
    def __init__(self, status: _Optional[int] = ..., headers: _Optional[_Iterable[_Union[Header, _Mapping]]] = ..., body: _Optional[bytes] = ...) -> None: ...

class ConnectPortRequest(_message.Message):
    __slots__ = ("start", "data", "close_write")
    START_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    CLOSE_WRITE_FIELD_NUMBER: _ClassVar[int]
    start: ConnectPortStart
    data: bytes
    close_write: bool
    def __init__(self, start: _Optional[_Union[ConnectPortStart, _Mapping]] = ..., data: _Optional[bytes] = ..., close_write: bool = ...) -> None: ...

class ConnectPortStart(_message.Message):
    __slots__ = ("sandbox_id", "port", "timeout_ms")
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    port: int
    timeout_ms: int
    def __init__(self, sandbox_id: _Optional[str] = ..., port: _Optional[int] = ..., timeout_ms: _Optional[int] = ...) -> None: ...

class ConnectPortResponse(_message.Message):
    __slots__ = ("connected", "data", "eof")
    CONNECTED_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    EOF_FIELD_NUMBER: _ClassVar[int]
    connected: ConnectPortConnected
    data: bytes
    eof: bool
    def __init__(self, connected: _Optional[_Union[ConnectPortConnected, _Mapping]] = ..., data: _Optional[bytes] = ..., eof: bool = ...) -> None: ...

class ConnectPortConnected(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetTrajectoryRequest(_message.Message):
    __slots__ = ("sandbox_id", "without_output")
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    WITHOUT_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    without_output: bool
    def __init__(self, sandbox_id: _Optional[str] = ..., without_output: bool = ...) -> None: ...

class TrajectoryEntry(_message.Message):
    __slots__ = ("sandbox_id", "parent_id", "parent_seq", "seq", "call_id", "kind", "state", "origin", "command", "env", "cwd", "user", "path", "sha256", "size", "started", "ended", "pid", "exit_code", "status", "error_code", "error", "stdout", "stderr", "pty", "stdout_total_bytes", "stderr_total_bytes", "output_truncated", "output_compacted", "timeout_ms", "http_status", "files", "code", "language", "context_id", "code_error")
    class EnvEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    PARENT_ID_FIELD_NUMBER: _ClassVar[int]
    PARENT_SEQ_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    ORIGIN_FIELD_NUMBER: _ClassVar[int]
    COMMAND_FIELD_NUMBER: _ClassVar[int]
    ENV_FIELD_NUMBER: _ClassVar[int]
    CWD_FIELD_NUMBER: _ClassVar[int]
    USER_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    STARTED_FIELD_NUMBER: _ClassVar[int]
    ENDED_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    STDOUT_FIELD_NUMBER: _ClassVar[int]
    STDERR_FIELD_NUMBER: _ClassVar[int]
    PTY_FIELD_NUMBER: _ClassVar[int]
    STDOUT_TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    STDERR_TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_COMPACTED_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    HTTP_STATUS_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    LANGUAGE_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_ID_FIELD_NUMBER: _ClassVar[int]
    CODE_ERROR_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    parent_id: str
    parent_seq: int
    seq: int
    call_id: str
    kind: str
    state: str
    origin: str
    command: _containers.RepeatedScalarFieldContainer[str]
    env: _containers.ScalarMap[str, str]
    cwd: str
    user: str
    path: str
    sha256: str
    size: int
    started: _timestamp_pb2.Timestamp
    ended: _timestamp_pb2.Timestamp
    pid: int
    exit_code: int
    status: str
    error_code: str
    error: str
    stdout: bytes
    stderr: bytes
    pty: bytes
    stdout_total_bytes: int
    stderr_total_bytes: int
    output_truncated: bool
    output_compacted: bool
    timeout_ms: int
    http_status: int
    files: _containers.RepeatedCompositeFieldContainer[TrajectoryFile]
    code: str
    language: str
    context_id: str
    code_error: str
    def __init__(self, sandbox_id: _Optional[str] = ..., parent_id: _Optional[str] = ..., parent_seq: _Optional[int] = ..., seq: _Optional[int] = ..., call_id: _Optional[str] = ..., kind: _Optional[str] = ..., state: _Optional[str] = ..., origin: _Optional[str] = ..., command: _Optional[_Iterable[str]] = ..., env: _Optional[_Mapping[str, str]] = ..., cwd: _Optional[str] = ..., user: _Optional[str] = ..., path: _Optional[str] = ..., sha256: _Optional[str] = ..., size: _Optional[int] = ..., started: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., ended: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., pid: _Optional[int] = ..., exit_code: _Optional[int] = ..., status: _Optional[str] = ..., error_code: _Optional[str] = ..., error: _Optional[str] = ..., stdout: _Optional[bytes] = ..., stderr: _Optional[bytes] = ..., pty: _Optional[bytes] = ..., stdout_total_bytes: _Optional[int] = ..., stderr_total_bytes: _Optional[int] = ..., output_truncated: bool = ..., output_compacted: bool = ..., timeout_ms: _Optional[int] = ..., http_status: _Optional[int] = ..., files: _Optional[_Iterable[_Union[TrajectoryFile, _Mapping]]] = ..., code: _Optional[str] = ..., language: _Optional[str] = ..., context_id: _Optional[str] = ..., code_error: _Optional[str] = ...) -> None: ...

class TrajectoryFile(_message.Message):
    __slots__ = ("path", "sha256", "size")
    PATH_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    path: str
    sha256: str
    size: int
    def __init__(self, path: _Optional[str] = ..., sha256: _Optional[str] = ..., size: _Optional[int] = ...) -> None: ...
