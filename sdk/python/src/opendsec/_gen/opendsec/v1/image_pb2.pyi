import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ImageLayer(_message.Message):
    __slots__ = ("digest", "size")
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    digest: str
    size: int
    def __init__(self, digest: _Optional[str] = ..., size: _Optional[int] = ...) -> None: ...

class ImageConfig(_message.Message):
    __slots__ = ("env", "workdir", "user", "entrypoint", "cmd", "labels", "start_cmd", "ready_cmd", "exposed_ports")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ENV_FIELD_NUMBER: _ClassVar[int]
    WORKDIR_FIELD_NUMBER: _ClassVar[int]
    USER_FIELD_NUMBER: _ClassVar[int]
    ENTRYPOINT_FIELD_NUMBER: _ClassVar[int]
    CMD_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    START_CMD_FIELD_NUMBER: _ClassVar[int]
    READY_CMD_FIELD_NUMBER: _ClassVar[int]
    EXPOSED_PORTS_FIELD_NUMBER: _ClassVar[int]
    env: _containers.RepeatedScalarFieldContainer[str]
    workdir: str
    user: str
    entrypoint: _containers.RepeatedScalarFieldContainer[str]
    cmd: _containers.RepeatedScalarFieldContainer[str]
    labels: _containers.ScalarMap[str, str]
    start_cmd: str
    ready_cmd: str
    exposed_ports: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, env: _Optional[_Iterable[str]] = ..., workdir: _Optional[str] = ..., user: _Optional[str] = ..., entrypoint: _Optional[_Iterable[str]] = ..., cmd: _Optional[_Iterable[str]] = ..., labels: _Optional[_Mapping[str, str]] = ..., start_cmd: _Optional[str] = ..., ready_cmd: _Optional[str] = ..., exposed_ports: _Optional[_Iterable[str]] = ...) -> None: ...

class Image(_message.Message):
    __slots__ = ("name", "id", "created", "size", "layers", "config", "source")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    name: str
    id: str
    created: _timestamp_pb2.Timestamp
    size: int
    layers: _containers.RepeatedCompositeFieldContainer[ImageLayer]
    config: ImageConfig
    source: str
    def __init__(self, name: _Optional[str] = ..., id: _Optional[str] = ..., created: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., size: _Optional[int] = ..., layers: _Optional[_Iterable[_Union[ImageLayer, _Mapping]]] = ..., config: _Optional[_Union[ImageConfig, _Mapping]] = ..., source: _Optional[str] = ...) -> None: ...

class ImportImageRequest(_message.Message):
    __slots__ = ("ref", "name", "merge_layers", "insecure")
    REF_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    MERGE_LAYERS_FIELD_NUMBER: _ClassVar[int]
    INSECURE_FIELD_NUMBER: _ClassVar[int]
    ref: str
    name: str
    merge_layers: bool
    insecure: bool
    def __init__(self, ref: _Optional[str] = ..., name: _Optional[str] = ..., merge_layers: bool = ..., insecure: bool = ...) -> None: ...

class ImportProgress(_message.Message):
    __slots__ = ("files", "bytes", "total_files", "total_bytes")
    FILES_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FILES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    files: int
    bytes: int
    total_files: int
    total_bytes: int
    def __init__(self, files: _Optional[int] = ..., bytes: _Optional[int] = ..., total_files: _Optional[int] = ..., total_bytes: _Optional[int] = ...) -> None: ...

class ImportImageResponse(_message.Message):
    __slots__ = ("progress", "image")
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    progress: ImportProgress
    image: Image
    def __init__(self, progress: _Optional[_Union[ImportProgress, _Mapping]] = ..., image: _Optional[_Union[Image, _Mapping]] = ...) -> None: ...

class ListImagesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListImagesResponse(_message.Message):
    __slots__ = ("images",)
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    images: _containers.RepeatedCompositeFieldContainer[Image]
    def __init__(self, images: _Optional[_Iterable[_Union[Image, _Mapping]]] = ...) -> None: ...

class GetImageRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class GetImageResponse(_message.Message):
    __slots__ = ("image",)
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    image: Image
    def __init__(self, image: _Optional[_Union[Image, _Mapping]] = ...) -> None: ...

class TagImageRequest(_message.Message):
    __slots__ = ("source", "target")
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    source: str
    target: str
    def __init__(self, source: _Optional[str] = ..., target: _Optional[str] = ...) -> None: ...

class TagImageResponse(_message.Message):
    __slots__ = ("image",)
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    image: Image
    def __init__(self, image: _Optional[_Union[Image, _Mapping]] = ...) -> None: ...

class RemoveImageRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class RemoveImageResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ComposeLayer(_message.Message):
    __slots__ = ("digest", "image")
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    digest: str
    image: str
    def __init__(self, digest: _Optional[str] = ..., image: _Optional[str] = ...) -> None: ...

class ComposeImageRequest(_message.Message):
    __slots__ = ("base", "layers", "name", "config", "merge_layers")
    BASE_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    MERGE_LAYERS_FIELD_NUMBER: _ClassVar[int]
    base: str
    layers: _containers.RepeatedCompositeFieldContainer[ComposeLayer]
    name: str
    config: ImageConfig
    merge_layers: bool
    def __init__(self, base: _Optional[str] = ..., layers: _Optional[_Iterable[_Union[ComposeLayer, _Mapping]]] = ..., name: _Optional[str] = ..., config: _Optional[_Union[ImageConfig, _Mapping]] = ..., merge_layers: bool = ...) -> None: ...

class ComposeImageResponse(_message.Message):
    __slots__ = ("image",)
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    image: Image
    def __init__(self, image: _Optional[_Union[Image, _Mapping]] = ...) -> None: ...

class GarbageCollectRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GarbageCollectResponse(_message.Message):
    __slots__ = ("removed_layers", "removed_bytes")
    REMOVED_LAYERS_FIELD_NUMBER: _ClassVar[int]
    REMOVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    removed_layers: _containers.RepeatedScalarFieldContainer[str]
    removed_bytes: int
    def __init__(self, removed_layers: _Optional[_Iterable[str]] = ..., removed_bytes: _Optional[int] = ...) -> None: ...

class VerifyImagesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CorruptLayer(_message.Message):
    __slots__ = ("digest", "reason")
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    digest: str
    reason: str
    def __init__(self, digest: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class VerifyImagesResponse(_message.Message):
    __slots__ = ("checked", "corrupt")
    CHECKED_FIELD_NUMBER: _ClassVar[int]
    CORRUPT_FIELD_NUMBER: _ClassVar[int]
    checked: int
    corrupt: _containers.RepeatedCompositeFieldContainer[CorruptLayer]
    def __init__(self, checked: _Optional[int] = ..., corrupt: _Optional[_Iterable[_Union[CorruptLayer, _Mapping]]] = ...) -> None: ...

class PackDiffRequest(_message.Message):
    __slots__ = ("sandbox_id", "name", "scrub_paths")
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    SCRUB_PATHS_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    name: str
    scrub_paths: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, sandbox_id: _Optional[str] = ..., name: _Optional[str] = ..., scrub_paths: _Optional[_Iterable[str]] = ...) -> None: ...

class PackDiffResponse(_message.Message):
    __slots__ = ("image",)
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    image: Image
    def __init__(self, image: _Optional[_Union[Image, _Mapping]] = ...) -> None: ...

class UploadBuildContextRequest(_message.Message):
    __slots__ = ("data", "size")
    DATA_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    size: int
    def __init__(self, data: _Optional[bytes] = ..., size: _Optional[int] = ...) -> None: ...

class UploadBuildContextResponse(_message.Message):
    __slots__ = ("context_id", "size")
    CONTEXT_ID_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    context_id: str
    size: int
    def __init__(self, context_id: _Optional[str] = ..., size: _Optional[int] = ...) -> None: ...

class BuildImageRequest(_message.Message):
    __slots__ = ("name", "dockerfile", "context_id", "build_args", "target", "no_cache", "timeout_seconds", "start_cmd", "ready_cmd")
    class BuildArgsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    DOCKERFILE_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_ID_FIELD_NUMBER: _ClassVar[int]
    BUILD_ARGS_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    NO_CACHE_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    START_CMD_FIELD_NUMBER: _ClassVar[int]
    READY_CMD_FIELD_NUMBER: _ClassVar[int]
    name: str
    dockerfile: str
    context_id: str
    build_args: _containers.ScalarMap[str, str]
    target: str
    no_cache: bool
    timeout_seconds: int
    start_cmd: str
    ready_cmd: str
    def __init__(self, name: _Optional[str] = ..., dockerfile: _Optional[str] = ..., context_id: _Optional[str] = ..., build_args: _Optional[_Mapping[str, str]] = ..., target: _Optional[str] = ..., no_cache: bool = ..., timeout_seconds: _Optional[int] = ..., start_cmd: _Optional[str] = ..., ready_cmd: _Optional[str] = ...) -> None: ...

class BuildStep(_message.Message):
    __slots__ = ("index", "total", "instruction", "done", "cached", "duration_ms")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    INSTRUCTION_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    CACHED_FIELD_NUMBER: _ClassVar[int]
    DURATION_MS_FIELD_NUMBER: _ClassVar[int]
    index: int
    total: int
    instruction: str
    done: bool
    cached: bool
    duration_ms: int
    def __init__(self, index: _Optional[int] = ..., total: _Optional[int] = ..., instruction: _Optional[str] = ..., done: bool = ..., cached: bool = ..., duration_ms: _Optional[int] = ...) -> None: ...

class BuildLog(_message.Message):
    __slots__ = ("step", "stream", "data")
    STEP_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    step: int
    stream: str
    data: bytes
    def __init__(self, step: _Optional[int] = ..., stream: _Optional[str] = ..., data: _Optional[bytes] = ...) -> None: ...

class BuildImageResponse(_message.Message):
    __slots__ = ("step", "log", "image")
    STEP_FIELD_NUMBER: _ClassVar[int]
    LOG_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    step: BuildStep
    log: BuildLog
    image: Image
    def __init__(self, step: _Optional[_Union[BuildStep, _Mapping]] = ..., log: _Optional[_Union[BuildLog, _Mapping]] = ..., image: _Optional[_Union[Image, _Mapping]] = ...) -> None: ...
