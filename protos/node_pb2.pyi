from protos import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KvKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_KIND_KEY: _ClassVar[KvKind]
    KV_KIND_VALUE: _ClassVar[KvKind]
    KV_KIND_KEY_VALUE: _ClassVar[KvKind]
KV_KIND_KEY: KvKind
KV_KIND_VALUE: KvKind
KV_KIND_KEY_VALUE: KvKind

class Fingerprint(_message.Message):
    __slots__ = ("model", "dtype", "block_size", "kv_layout", "num_layers", "num_kv_heads", "head_dim", "mtp")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    MTP_FIELD_NUMBER: _ClassVar[int]
    model: str
    dtype: str
    block_size: int
    kv_layout: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    mtp: MtpConfig
    def __init__(self, model: _Optional[str] = ..., dtype: _Optional[str] = ..., block_size: _Optional[int] = ..., kv_layout: _Optional[str] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., mtp: _Optional[_Union[MtpConfig, _Mapping]] = ...) -> None: ...

class MtpConfig(_message.Message):
    __slots__ = ("enabled", "num_speculative_tokens", "num_draft_layers")
    ENABLED_FIELD_NUMBER: _ClassVar[int]
    NUM_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_LAYERS_FIELD_NUMBER: _ClassVar[int]
    enabled: bool
    num_speculative_tokens: int
    num_draft_layers: int
    def __init__(self, enabled: _Optional[bool] = ..., num_speculative_tokens: _Optional[int] = ..., num_draft_layers: _Optional[int] = ...) -> None: ...

class ReserveRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "prefill_fingerprint", "lease_ms", "self_prefill")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    SELF_PREFILL_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    prefill_fingerprint: Fingerprint
    lease_ms: int
    self_prefill: bool
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., prefill_fingerprint: _Optional[_Union[Fingerprint, _Mapping]] = ..., lease_ms: _Optional[int] = ..., self_prefill: _Optional[bool] = ...) -> None: ...

class Reservation(_message.Message):
    __slots__ = ("reservation_id", "block_ids", "num_cached_blocks", "lease_ms", "fingerprint", "push_token")
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    PUSH_TOKEN_FIELD_NUMBER: _ClassVar[int]
    reservation_id: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_cached_blocks: int
    lease_ms: int
    fingerprint: Fingerprint
    push_token: bytes
    def __init__(self, reservation_id: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ..., num_cached_blocks: _Optional[int] = ..., lease_ms: _Optional[int] = ..., fingerprint: _Optional[_Union[Fingerprint, _Mapping]] = ..., push_token: _Optional[bytes] = ...) -> None: ...

class TokenEvent(_message.Message):
    __slots__ = ("token_ids", "text_delta", "logprobs", "finish_reason", "stop_reason", "usage")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_DELTA_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text_delta: str
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    finish_reason: _common_pb2.FinishReason
    stop_reason: str
    usage: _common_pb2.Usage
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text_delta: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., stop_reason: _Optional[str] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ...) -> None: ...

class DecodeEvent(_message.Message):
    __slots__ = ("reservation", "tokens")
    RESERVATION_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    reservation: Reservation
    tokens: TokenEvent
    def __init__(self, reservation: _Optional[_Union[Reservation, _Mapping]] = ..., tokens: _Optional[_Union[TokenEvent, _Mapping]] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "decode_address", "reservation_id", "block_ids", "num_cached_blocks", "decode_fingerprint", "push_token", "lease_ms")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    DECODE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DECODE_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    PUSH_TOKEN_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    decode_address: str
    reservation_id: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_cached_blocks: int
    decode_fingerprint: Fingerprint
    push_token: bytes
    lease_ms: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., decode_address: _Optional[str] = ..., reservation_id: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ..., num_cached_blocks: _Optional[int] = ..., decode_fingerprint: _Optional[_Union[Fingerprint, _Mapping]] = ..., push_token: _Optional[bytes] = ..., lease_ms: _Optional[int] = ...) -> None: ...

class PrefillReply(_message.Message):
    __slots__ = ("first_token_id", "first_logprob", "num_pushed_blocks", "pushed_bytes", "prefix_cached_tokens")
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    NUM_PUSHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PUSHED_BYTES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    first_token_id: int
    first_logprob: _common_pb2.TokenLogprob
    num_pushed_blocks: int
    pushed_bytes: int
    prefix_cached_tokens: int
    def __init__(self, first_token_id: _Optional[int] = ..., first_logprob: _Optional[_Union[_common_pb2.TokenLogprob, _Mapping]] = ..., num_pushed_blocks: _Optional[int] = ..., pushed_bytes: _Optional[int] = ..., prefix_cached_tokens: _Optional[int] = ...) -> None: ...

class FirstToken(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: _common_pb2.TokenLogprob
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[_Union[_common_pb2.TokenLogprob, _Mapping]] = ...) -> None: ...

class PrefillEvent(_message.Message):
    __slots__ = ("first_token", "reply")
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    REPLY_FIELD_NUMBER: _ClassVar[int]
    first_token: FirstToken
    reply: PrefillReply
    def __init__(self, first_token: _Optional[_Union[FirstToken, _Mapping]] = ..., reply: _Optional[_Union[PrefillReply, _Mapping]] = ...) -> None: ...

class PushHeader(_message.Message):
    __slots__ = ("request_id", "reservation_id", "fingerprint", "block_ids", "push_token")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    PUSH_TOKEN_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    reservation_id: str
    fingerprint: Fingerprint
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    push_token: bytes
    def __init__(self, request_id: _Optional[str] = ..., reservation_id: _Optional[str] = ..., fingerprint: _Optional[_Union[Fingerprint, _Mapping]] = ..., block_ids: _Optional[_Iterable[int]] = ..., push_token: _Optional[bytes] = ...) -> None: ...

class KvChunk(_message.Message):
    __slots__ = ("layer", "kind", "block_ids", "shape", "dtype", "data", "num_layers")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    layer: int
    kind: KvKind
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    data: bytes
    num_layers: int
    def __init__(self, layer: _Optional[int] = ..., kind: _Optional[_Union[KvKind, str]] = ..., block_ids: _Optional[_Iterable[int]] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ..., data: _Optional[bytes] = ..., num_layers: _Optional[int] = ...) -> None: ...

class MtpPayload(_message.Message):
    __slots__ = ("last_hidden_state", "hidden_shape", "dtype", "draft_kv")
    LAST_HIDDEN_STATE_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_KV_FIELD_NUMBER: _ClassVar[int]
    last_hidden_state: bytes
    hidden_shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    draft_kv: _containers.RepeatedCompositeFieldContainer[KvChunk]
    def __init__(self, last_hidden_state: _Optional[bytes] = ..., hidden_shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ..., draft_kv: _Optional[_Iterable[_Union[KvChunk, _Mapping]]] = ...) -> None: ...

class PushDone(_message.Message):
    __slots__ = ("first_token_id", "first_logprob", "mtp", "num_chunks")
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    MTP_FIELD_NUMBER: _ClassVar[int]
    NUM_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    first_token_id: int
    first_logprob: _common_pb2.TokenLogprob
    mtp: MtpPayload
    num_chunks: int
    def __init__(self, first_token_id: _Optional[int] = ..., first_logprob: _Optional[_Union[_common_pb2.TokenLogprob, _Mapping]] = ..., mtp: _Optional[_Union[MtpPayload, _Mapping]] = ..., num_chunks: _Optional[int] = ...) -> None: ...

class PushKeepalive(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KvPushMessage(_message.Message):
    __slots__ = ("header", "chunk", "done", "keepalive")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    KEEPALIVE_FIELD_NUMBER: _ClassVar[int]
    header: PushHeader
    chunk: KvChunk
    done: PushDone
    keepalive: PushKeepalive
    def __init__(self, header: _Optional[_Union[PushHeader, _Mapping]] = ..., chunk: _Optional[_Union[KvChunk, _Mapping]] = ..., done: _Optional[_Union[PushDone, _Mapping]] = ..., keepalive: _Optional[_Union[PushKeepalive, _Mapping]] = ...) -> None: ...

class PushAck(_message.Message):
    __slots__ = ("bytes_received", "num_chunks")
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    NUM_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    bytes_received: int
    num_chunks: int
    def __init__(self, bytes_received: _Optional[int] = ..., num_chunks: _Optional[int] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id", "reservation_id", "reason", "push_token")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    PUSH_TOKEN_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    reservation_id: str
    reason: str
    push_token: bytes
    def __init__(self, request_id: _Optional[str] = ..., reservation_id: _Optional[str] = ..., reason: _Optional[str] = ..., push_token: _Optional[bytes] = ...) -> None: ...

class AbortReply(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class NodeInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class NodeInfo(_message.Message):
    __slots__ = ("node_id", "role", "model_id", "max_model_len", "fingerprint", "kv_tcp_address", "kv_local_socket", "host_id")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    KV_TCP_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    KV_LOCAL_SOCKET_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    role: str
    model_id: str
    max_model_len: int
    fingerprint: Fingerprint
    kv_tcp_address: str
    kv_local_socket: str
    host_id: str
    def __init__(self, node_id: _Optional[str] = ..., role: _Optional[str] = ..., model_id: _Optional[str] = ..., max_model_len: _Optional[int] = ..., fingerprint: _Optional[_Union[Fingerprint, _Mapping]] = ..., kv_tcp_address: _Optional[str] = ..., kv_local_socket: _Optional[str] = ..., host_id: _Optional[str] = ...) -> None: ...
