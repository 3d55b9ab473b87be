from protos.gyre.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KvTransport(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_TRANSPORT_UNSPECIFIED: _ClassVar[KvTransport]
    KV_TRANSPORT_AUTO: _ClassVar[KvTransport]
    KV_TRANSPORT_UCX: _ClassVar[KvTransport]
    KV_TRANSPORT_TCP: _ClassVar[KvTransport]
    KV_TRANSPORT_REPREFILL: _ClassVar[KvTransport]
KV_TRANSPORT_UNSPECIFIED: KvTransport
KV_TRANSPORT_AUTO: KvTransport
KV_TRANSPORT_UCX: KvTransport
KV_TRANSPORT_TCP: KvTransport
KV_TRANSPORT_REPREFILL: KvTransport

class GenerateRequest(_message.Message):
    __slots__ = ("context", "prompt_ids", "prompt_delta", "sampling", "request_id")
    CONTEXT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_DELTA_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    context: _common_pb2.CallContext
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt_delta: _common_pb2.TitoDelta
    sampling: _common_pb2.SamplingParams
    request_id: str
    def __init__(self, context: _Optional[_Union[_common_pb2.CallContext, _Mapping]] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., prompt_delta: _Optional[_Union[_common_pb2.TitoDelta, _Mapping]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., request_id: _Optional[str] = ...) -> None: ...

class GenerateChunk(_message.Message):
    __slots__ = ("request_id", "token_ids", "logprobs", "offset", "finished", "finish_reason", "weight_version", "migrated_to", "seed")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    MIGRATED_TO_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    offset: int
    finished: bool
    finish_reason: str
    weight_version: int
    migrated_to: str
    seed: int
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., offset: _Optional[int] = ..., finished: _Optional[bool] = ..., finish_reason: _Optional[str] = ..., weight_version: _Optional[int] = ..., migrated_to: _Optional[str] = ..., seed: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "output_ids", "output_logprobs", "finish_reason", "weight_version", "seed", "prompt_len", "num_migrations", "num_reprefills", "cell_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LEN_FIELD_NUMBER: _ClassVar[int]
    NUM_MIGRATIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_REPREFILLS_FIELD_NUMBER: _ClassVar[int]
    CELL_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    output_ids: _containers.RepeatedScalarFieldContainer[int]
    output_logprobs: _containers.RepeatedScalarFieldContainer[float]
    finish_reason: str
    weight_version: int
    seed: int
    prompt_len: int
    num_migrations: int
    num_reprefills: int
    cell_id: str
    def __init__(self, request_id: _Optional[str] = ..., output_ids: _Optional[_Iterable[int]] = ..., output_logprobs: _Optional[_Iterable[float]] = ..., finish_reason: _Optional[str] = ..., weight_version: _Optional[int] = ..., seed: _Optional[int] = ..., prompt_len: _Optional[int] = ..., num_migrations: _Optional[int] = ..., num_reprefills: _Optional[int] = ..., cell_id: _Optional[str] = ...) -> None: ...

class ResumeRequest(_message.Message):
    __slots__ = ("request", "generated_ids", "generated_logprobs", "rng_state", "weight_version")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    GENERATED_IDS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    RNG_STATE_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    request: GenerateRequest
    generated_ids: _containers.RepeatedScalarFieldContainer[int]
    generated_logprobs: _containers.RepeatedScalarFieldContainer[float]
    rng_state: bytes
    weight_version: int
    def __init__(self, request: _Optional[_Union[GenerateRequest, _Mapping]] = ..., generated_ids: _Optional[_Iterable[int]] = ..., generated_logprobs: _Optional[_Iterable[float]] = ..., rng_state: _Optional[bytes] = ..., weight_version: _Optional[int] = ...) -> None: ...

class AttachRequest(_message.Message):
    __slots__ = ("request_id", "wait_s")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    wait_s: float
    def __init__(self, request_id: _Optional[str] = ..., wait_s: _Optional[float] = ...) -> None: ...

class CancelRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class CancelResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class MigrateOutRequest(_message.Message):
    __slots__ = ("request_ids", "target_address", "transport")
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    TARGET_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    target_address: str
    transport: KvTransport
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ..., target_address: _Optional[str] = ..., transport: _Optional[_Union[KvTransport, str]] = ...) -> None: ...

class MigrationResult(_message.Message):
    __slots__ = ("request_id", "source_cell_id", "target_cell_id", "transport", "bytes", "duration_s", "kv_tokens", "ok", "error")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SOURCE_CELL_ID_FIELD_NUMBER: _ClassVar[int]
    TARGET_CELL_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    DURATION_S_FIELD_NUMBER: _ClassVar[int]
    KV_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    source_cell_id: str
    target_cell_id: str
    transport: KvTransport
    bytes: int
    duration_s: float
    kv_tokens: int
    ok: bool
    error: str
    def __init__(self, request_id: _Optional[str] = ..., source_cell_id: _Optional[str] = ..., target_cell_id: _Optional[str] = ..., transport: _Optional[_Union[KvTransport, str]] = ..., bytes: _Optional[int] = ..., duration_s: _Optional[float] = ..., kv_tokens: _Optional[int] = ..., ok: _Optional[bool] = ..., error: _Optional[str] = ...) -> None: ...

class MigrateOutResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[MigrationResult]
    def __init__(self, results: _Optional[_Iterable[_Union[MigrationResult, _Mapping]]] = ...) -> None: ...

class AcceptMigrationRequest(_message.Message):
    __slots__ = ("transport", "request_ids")
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    transport: KvTransport
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, transport: _Optional[_Union[KvTransport, str]] = ..., request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class AcceptMigrationResponse(_message.Message):
    __slots__ = ("transport", "receiver_address", "cell_id")
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    RECEIVER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    CELL_ID_FIELD_NUMBER: _ClassVar[int]
    transport: KvTransport
    receiver_address: str
    cell_id: str
    def __init__(self, transport: _Optional[_Union[KvTransport, str]] = ..., receiver_address: _Optional[str] = ..., cell_id: _Optional[str] = ...) -> None: ...

class UpdateWeightsResponse(_message.Message):
    __slots__ = ("weight_version", "num_tensors", "num_bytes")
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    NUM_TENSORS_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    weight_version: int
    num_tensors: int
    num_bytes: int
    def __init__(self, weight_version: _Optional[int] = ..., num_tensors: _Optional[int] = ..., num_bytes: _Optional[int] = ...) -> None: ...

class GetLoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EngineLoad(_message.Message):
    __slots__ = ("cell_id", "active", "kv_tokens", "capacity_tokens", "weight_version", "model_name", "vocab_size", "max_context", "draining", "request_ids")
    CELL_ID_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_FIELD_NUMBER: _ClassVar[int]
    KV_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    cell_id: str
    active: int
    kv_tokens: int
    capacity_tokens: int
    weight_version: int
    model_name: str
    vocab_size: int
    max_context: int
    draining: bool
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, cell_id: _Optional[str] = ..., active: _Optional[int] = ..., kv_tokens: _Optional[int] = ..., capacity_tokens: _Optional[int] = ..., weight_version: _Optional[int] = ..., model_name: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_context: _Optional[int] = ..., draining: _Optional[bool] = ..., request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("wait_s", "cancel")
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    wait_s: float
    cancel: bool
    def __init__(self, wait_s: _Optional[float] = ..., cancel: _Optional[bool] = ...) -> None: ...

class DrainResponse(_message.Message):
    __slots__ = ("active",)
    ACTIVE_FIELD_NUMBER: _ClassVar[int]
    active: int
    def __init__(self, active: _Optional[int] = ...) -> None: ...

class EngineInfo(_message.Message):
    __slots__ = ("cell_id", "address", "state", "in_flight", "load")
    CELL_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    cell_id: str
    address: str
    state: str
    in_flight: int
    load: EngineLoad
    def __init__(self, cell_id: _Optional[str] = ..., address: _Optional[str] = ..., state: _Optional[str] = ..., in_flight: _Optional[int] = ..., load: _Optional[_Union[EngineLoad, _Mapping]] = ...) -> None: ...

class RegisterEngineRequest(_message.Message):
    __slots__ = ("cell_id", "address")
    CELL_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    cell_id: str
    address: str
    def __init__(self, cell_id: _Optional[str] = ..., address: _Optional[str] = ...) -> None: ...

class RegisterEngineResponse(_message.Message):
    __slots__ = ("engine",)
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    engine: EngineInfo
    def __init__(self, engine: _Optional[_Union[EngineInfo, _Mapping]] = ...) -> None: ...

class DeregisterEngineRequest(_message.Message):
    __slots__ = ("cell_id",)
    CELL_ID_FIELD_NUMBER: _ClassVar[int]
    cell_id: str
    def __init__(self, cell_id: _Optional[str] = ...) -> None: ...

class DeregisterEngineResponse(_message.Message):
    __slots__ = ("in_flight",)
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    in_flight: int
    def __init__(self, in_flight: _Optional[int] = ...) -> None: ...

class DrainEngineRequest(_message.Message):
    __slots__ = ("cell_id", "transport", "keep_registered")
    CELL_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    KEEP_REGISTERED_FIELD_NUMBER: _ClassVar[int]
    cell_id: str
    transport: KvTransport
    keep_registered: bool
    def __init__(self, cell_id: _Optional[str] = ..., transport: _Optional[_Union[KvTransport, str]] = ..., keep_registered: _Optional[bool] = ...) -> None: ...

class DrainEngineResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[MigrationResult]
    def __init__(self, results: _Optional[_Iterable[_Union[MigrationResult, _Mapping]]] = ...) -> None: ...

class ListEnginesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListEnginesResponse(_message.Message):
    __slots__ = ("engines",)
    ENGINES_FIELD_NUMBER: _ClassVar[int]
    engines: _containers.RepeatedCompositeFieldContainer[EngineInfo]
    def __init__(self, engines: _Optional[_Iterable[_Union[EngineInfo, _Mapping]]] = ...) -> None: ...
