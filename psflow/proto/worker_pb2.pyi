from . import ps_pb2 as _ps_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RunClosureRequest(_message.Message):
    __slots__ = ("session_id", "closure_id", "function_key", "function", "arguments", "resource_key", "step", "training")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    CLOSURE_ID_FIELD_NUMBER: _ClassVar[int]
    FUNCTION_KEY_FIELD_NUMBER: _ClassVar[int]
    FUNCTION_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_FIELD_NUMBER: _ClassVar[int]
    RESOURCE_KEY_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TRAINING_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    closure_id: int
    function_key: str
    function: bytes
    arguments: bytes
    resource_key: str
    step: int
    training: TrainingMode
    def __init__(self, session_id: _Optional[str] = ..., closure_id: _Optional[int] = ..., function_key: _Optional[str] = ..., function: _Optional[bytes] = ..., arguments: _Optional[bytes] = ..., resource_key: _Optional[str] = ..., step: _Optional[int] = ..., training: _Optional[_Union[TrainingMode, _Mapping]] = ...) -> None: ...

class TrainingMode(_message.Message):
    __slots__ = ("mode", "num_workers", "sync_timeout", "compression", "compression_by_variable")
    class CompressionByVariableEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    MODE_FIELD_NUMBER: _ClassVar[int]
    NUM_WORKERS_FIELD_NUMBER: _ClassVar[int]
    SYNC_TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    COMPRESSION_FIELD_NUMBER: _ClassVar[int]
    COMPRESSION_BY_VARIABLE_FIELD_NUMBER: _ClassVar[int]
    mode: str
    num_workers: int
    sync_timeout: float
    compression: str
    compression_by_variable: _containers.ScalarMap[str, str]
    def __init__(self, mode: _Optional[str] = ..., num_workers: _Optional[int] = ..., sync_timeout: _Optional[float] = ..., compression: _Optional[str] = ..., compression_by_variable: _Optional[_Mapping[str, str]] = ...) -> None: ...

class ClosureError(_message.Message):
    __slots__ = ("type", "message", "traceback", "pickled", "code")
    TYPE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    TRACEBACK_FIELD_NUMBER: _ClassVar[int]
    PICKLED_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    type: str
    message: str
    traceback: str
    pickled: bytes
    code: int
    def __init__(self, type: _Optional[str] = ..., message: _Optional[str] = ..., traceback: _Optional[str] = ..., pickled: _Optional[bytes] = ..., code: _Optional[int] = ...) -> None: ...

class RunClosureResponse(_message.Message):
    __slots__ = ("result", "error", "function_missing", "missing_resource", "run_seconds")
    RESULT_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    FUNCTION_MISSING_FIELD_NUMBER: _ClassVar[int]
    MISSING_RESOURCE_FIELD_NUMBER: _ClassVar[int]
    RUN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    result: bytes
    error: ClosureError
    function_missing: bool
    missing_resource: str
    run_seconds: float
    def __init__(self, result: _Optional[bytes] = ..., error: _Optional[_Union[ClosureError, _Mapping]] = ..., function_missing: _Optional[bool] = ..., missing_resource: _Optional[str] = ..., run_seconds: _Optional[float] = ...) -> None: ...

class EndSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class EndSessionResponse(_message.Message):
    __slots__ = ("existed",)
    EXISTED_FIELD_NUMBER: _ClassVar[int]
    existed: bool
    def __init__(self, existed: _Optional[bool] = ...) -> None: ...

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetStatusResponse(_message.Message):
    __slots__ = ("task", "session_ids", "closures_run", "closures_failed", "pid", "started_at", "data_plane")
    TASK_FIELD_NUMBER: _ClassVar[int]
    SESSION_IDS_FIELD_NUMBER: _ClassVar[int]
    CLOSURES_RUN_FIELD_NUMBER: _ClassVar[int]
    CLOSURES_FAILED_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    DATA_PLANE_FIELD_NUMBER: _ClassVar[int]
    task: str
    session_ids: _containers.RepeatedScalarFieldContainer[str]
    closures_run: int
    closures_failed: int
    pid: int
    started_at: float
    data_plane: _ps_pb2.DataPlaneInfoResponse
    def __init__(self, task: _Optional[str] = ..., session_ids: _Optional[_Iterable[str]] = ..., closures_run: _Optional[int] = ..., closures_failed: _Optional[int] = ..., pid: _Optional[int] = ..., started_at: _Optional[float] = ..., data_plane: _Optional[_Union[_ps_pb2.DataPlaneInfoResponse, _Mapping]] = ...) -> None: ...
