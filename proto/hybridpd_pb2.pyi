# ruff: noqa
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "ignore_eos", "logprobs", "top_logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens", "logit_bias", "include_stop_str_in_output", "structured_output", "min_p", "allowed_token_ids", "bad_words", "skip_special_tokens", "prompt_logprobs")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BAD_WORDS_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    logprobs: bool
    top_logprobs: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    min_tokens: int
    logit_bias: _containers.ScalarMap[int, float]
    include_stop_str_in_output: bool
    structured_output: StructuredOutput
    min_p: float
    allowed_token_ids: _containers.RepeatedScalarFieldContainer[int]
    bad_words: _containers.RepeatedScalarFieldContainer[str]
    skip_special_tokens: bool
    prompt_logprobs: int
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., min_tokens: _Optional[int] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., include_stop_str_in_output: _Optional[bool] = ..., structured_output: _Optional[_Union[StructuredOutput, _Mapping]] = ..., min_p: _Optional[float] = ..., allowed_token_ids: _Optional[_Iterable[int]] = ..., bad_words: _Optional[_Iterable[str]] = ..., skip_special_tokens: _Optional[bool] = ..., prompt_logprobs: _Optional[int] = ...) -> None: ...

class StructuredOutput(_message.Message):
    __slots__ = ("kind", "spec")
    KIND_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    kind: str
    spec: str
    def __init__(self, kind: _Optional[str] = ..., spec: _Optional[str] = ...) -> None: ...

class GroupBlocks(_message.Message):
    __slots__ = ("group_id", "block_ids")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    group_id: int
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, group_id: _Optional[int] = ..., block_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GroupStates(_message.Message):
    __slots__ = ("group_id", "state_slot")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_SLOT_FIELD_NUMBER: _ClassVar[int]
    group_id: int
    state_slot: int
    def __init__(self, group_id: _Optional[int] = ..., state_slot: _Optional[int] = ...) -> None: ...

class TransferParams(_message.Message):
    __slots__ = ("worker_id", "epoch", "prefill_address", "groups", "num_computed_tokens", "num_prompt_tokens", "lease_expiry_unix", "checkpoint_num_tokens", "lease_token", "prompt_digest", "states", "mac", "checkpoint_pages")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    PREFILL_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRY_UNIX_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LEASE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    PROMPT_DIGEST_FIELD_NUMBER: _ClassVar[int]
    STATES_FIELD_NUMBER: _ClassVar[int]
    MAC_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_PAGES_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    epoch: str
    prefill_address: str
    groups: _containers.RepeatedCompositeFieldContainer[GroupBlocks]
    num_computed_tokens: int
    num_prompt_tokens: int
    lease_expiry_unix: float
    checkpoint_num_tokens: int
    lease_token: str
    prompt_digest: bytes
    states: _containers.RepeatedCompositeFieldContainer[GroupStates]
    mac: bytes
    checkpoint_pages: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, worker_id: _Optional[str] = ..., epoch: _Optional[str] = ..., prefill_address: _Optional[str] = ..., groups: _Optional[_Iterable[_Union[GroupBlocks, _Mapping]]] = ..., num_computed_tokens: _Optional[int] = ..., num_prompt_tokens: _Optional[int] = ..., lease_expiry_unix: _Optional[float] = ..., checkpoint_num_tokens: _Optional[int] = ..., lease_token: _Optional[str] = ..., prompt_digest: _Optional[bytes] = ..., states: _Optional[_Iterable[_Union[GroupStates, _Mapping]]] = ..., mac: _Optional[bytes] = ..., checkpoint_pages: _Optional[_Iterable[int]] = ...) -> None: ...

class HealthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HealthResponse(_message.Message):
    __slots__ = ("role", "model", "epoch", "ready", "worker_id", "draining")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    role: str
    model: str
    epoch: str
    ready: bool
    worker_id: str
    draining: bool
    def __init__(self, role: _Optional[str] = ..., model: _Optional[str] = ..., epoch: _Optional[str] = ..., ready: _Optional[bool] = ..., worker_id: _Optional[str] = ..., draining: _Optional[bool] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("drain",)
    DRAIN_FIELD_NUMBER: _ClassVar[int]
    drain: bool
    def __init__(self, drain: _Optional[bool] = ...) -> None: ...

class DrainResponse(_message.Message):
    __slots__ = ("draining",)
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    draining: bool
    def __init__(self, draining: _Optional[bool] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PoolStats(_message.Message):
    __slots__ = ("group_id", "kind", "total", "free", "cached", "in_use", "pinned", "integrity_ok")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    FREE_FIELD_NUMBER: _ClassVar[int]
    CACHED_FIELD_NUMBER: _ClassVar[int]
    IN_USE_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    INTEGRITY_OK_FIELD_NUMBER: _ClassVar[int]
    group_id: int
    kind: str
    total: int
    free: int
    cached: int
    in_use: int
    pinned: int
    integrity_ok: bool
    def __init__(self, group_id: _Optional[int] = ..., kind: _Optional[str] = ..., total: _Optional[int] = ..., free: _Optional[int] = ..., cached: _Optional[int] = ..., in_use: _Optional[int] = ..., pinned: _Optional[int] = ..., integrity_ok: _Optional[bool] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("role", "worker_id", "epoch", "num_running", "num_waiting", "pools", "leases_pinned", "metrics_port", "memory_bytes", "max_num_seqs", "max_generate")
    class MemoryBytesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    ROLE_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    POOLS_FIELD_NUMBER: _ClassVar[int]
    LEASES_PINNED_FIELD_NUMBER: _ClassVar[int]
    METRICS_PORT_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    MAX_GENERATE_FIELD_NUMBER: _ClassVar[int]
    role: str
    worker_id: str
    epoch: str
    num_running: int
    num_waiting: int
    pools: _containers.RepeatedCompositeFieldContainer[PoolStats]
    leases_pinned: int
    metrics_port: int
    memory_bytes: _containers.ScalarMap[str, int]
    max_num_seqs: int
    max_generate: int
    def __init__(self, role: _Optional[str] = ..., worker_id: _Optional[str] = ..., epoch: _Optional[str] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., pools: _Optional[_Iterable[_Union[PoolStats, _Mapping]]] = ..., leases_pinned: _Optional[int] = ..., metrics_port: _Optional[int] = ..., memory_bytes: _Optional[_Mapping[str, int]] = ..., max_num_seqs: _Optional[int] = ..., max_generate: _Optional[int] = ...) -> None: ...

class CacheEventsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CacheEvent(_message.Message):
    __slots__ = ("stored", "group", "block_hash")
    STORED_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    stored: bool
    group: int
    block_hash: bytes
    def __init__(self, stored: _Optional[bool] = ..., group: _Optional[int] = ..., block_hash: _Optional[bytes] = ...) -> None: ...

class GroupHashes(_message.Message):
    __slots__ = ("group", "block_hashes")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    group: int
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, group: _Optional[int] = ..., block_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class CacheShape(_message.Message):
    __slots__ = ("block_size", "attention_groups", "recurrent_groups", "checkpoint_align")
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_GROUPS_FIELD_NUMBER: _ClassVar[int]
    RECURRENT_GROUPS_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_ALIGN_FIELD_NUMBER: _ClassVar[int]
    block_size: int
    attention_groups: _containers.RepeatedScalarFieldContainer[int]
    recurrent_groups: _containers.RepeatedScalarFieldContainer[int]
    checkpoint_align: int
    def __init__(self, block_size: _Optional[int] = ..., attention_groups: _Optional[_Iterable[int]] = ..., recurrent_groups: _Optional[_Iterable[int]] = ..., checkpoint_align: _Optional[int] = ...) -> None: ...

class CacheEventBatch(_message.Message):
    __slots__ = ("epoch", "first_seq", "events", "snapshot", "groups", "shape")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    FIRST_SEQ_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    epoch: str
    first_seq: int
    events: _containers.RepeatedCompositeFieldContainer[CacheEvent]
    snapshot: bool
    groups: _containers.RepeatedCompositeFieldContainer[GroupHashes]
    shape: CacheShape
    def __init__(self, epoch: _Optional[str] = ..., first_seq: _Optional[int] = ..., events: _Optional[_Iterable[_Union[CacheEvent, _Mapping]]] = ..., snapshot: _Optional[bool] = ..., groups: _Optional[_Iterable[_Union[GroupHashes, _Mapping]]] = ..., shape: _Optional[_Union[CacheShape, _Mapping]] = ...) -> None: ...

class TransferMetadataRequest(_message.Message):
    __slots__ = ("nonce",)
    NONCE_FIELD_NUMBER: _ClassVar[int]
    nonce: bytes
    def __init__(self, nonce: _Optional[bytes] = ...) -> None: ...

class TransferMetadata(_message.Message):
    __slots__ = ("agent_metadata", "worker_id", "epoch", "compat_hash", "proof", "tp_layout")
    AGENT_METADATA_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    COMPAT_HASH_FIELD_NUMBER: _ClassVar[int]
    PROOF_FIELD_NUMBER: _ClassVar[int]
    TP_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    agent_metadata: bytes
    worker_id: str
    epoch: str
    compat_hash: str
    proof: bytes
    tp_layout: bytes
    def __init__(self, agent_metadata: _Optional[bytes] = ..., worker_id: _Optional[str] = ..., epoch: _Optional[str] = ..., compat_hash: _Optional[str] = ..., proof: _Optional[bytes] = ..., tp_layout: _Optional[bytes] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling_params", "cache_salt")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling_params: SamplingParams
    cache_salt: str
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling_params: _Optional[_Union[SamplingParams, _Mapping]] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("request_id", "params", "num_cached_tokens", "first")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FIRST_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    params: TransferParams
    num_cached_tokens: int
    first: GenerateChunk
    def __init__(self, request_id: _Optional[str] = ..., params: _Optional[_Union[TransferParams, _Mapping]] = ..., num_cached_tokens: _Optional[int] = ..., first: _Optional[_Union[GenerateChunk, _Mapping]] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("request_id", "epoch", "lease_token")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    LEASE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    epoch: str
    lease_token: str
    def __init__(self, request_id: _Optional[str] = ..., epoch: _Optional[str] = ..., lease_token: _Optional[str] = ...) -> None: ...

class CommitRequest(_message.Message):
    __slots__ = ("request_id", "epoch", "lease_token", "prompt_digest", "params", "pages_read")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    LEASE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    PROMPT_DIGEST_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    PAGES_READ_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    epoch: str
    lease_token: str
    prompt_digest: bytes
    params: TransferParams
    pages_read: _containers.RepeatedCompositeFieldContainer[GroupBlocks]
    def __init__(self, request_id: _Optional[str] = ..., epoch: _Optional[str] = ..., lease_token: _Optional[str] = ..., prompt_digest: _Optional[bytes] = ..., params: _Optional[_Union[TransferParams, _Mapping]] = ..., pages_read: _Optional[_Iterable[_Union[GroupBlocks, _Mapping]]] = ...) -> None: ...

class CommitResponse(_message.Message):
    __slots__ = ("committed", "reason")
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    committed: bool
    reason: str
    def __init__(self, committed: _Optional[bool] = ..., reason: _Optional[str] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling_params", "params", "cache_salt", "first_token", "resume")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    RESUME_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling_params: SamplingParams
    params: TransferParams
    cache_salt: str
    first_token: FirstToken
    resume: Resume
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling_params: _Optional[_Union[SamplingParams, _Mapping]] = ..., params: _Optional[_Union[TransferParams, _Mapping]] = ..., cache_salt: _Optional[str] = ..., first_token: _Optional[_Union[FirstToken, _Mapping]] = ..., resume: _Optional[_Union[Resume, _Mapping]] = ...) -> None: ...

class Resume(_message.Message):
    __slots__ = ("token_ids", "text_chars")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_CHARS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text_chars: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text_chars: _Optional[int] = ...) -> None: ...

class FirstToken(_message.Message):
    __slots__ = ("token_id", "logprob", "top_logprobs")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top_logprobs: TopLogprobs
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top_logprobs: _Optional[_Union[TopLogprobs, _Mapping]] = ...) -> None: ...

class GenerateChunk(_message.Message):
    __slots__ = ("token_ids", "text", "logprobs", "finish_reason", "num_prompt_tokens", "num_cached_tokens", "num_external_cached_tokens", "top_logprobs", "stop_string", "stop_token_id", "prompt_logprobs", "num_resumed_tokens")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_EXTERNAL_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STOP_STRING_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    NUM_RESUMED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    finish_reason: str
    num_prompt_tokens: int
    num_cached_tokens: int
    num_external_cached_tokens: int
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogprobs]
    stop_string: str
    stop_token_id: int
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[PromptLogprob]
    num_resumed_tokens: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., logprobs: _Optional[_Iterable[float]] = ..., finish_reason: _Optional[str] = ..., num_prompt_tokens: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ..., num_external_cached_tokens: _Optional[int] = ..., top_logprobs: _Optional[_Iterable[_Union[TopLogprobs, _Mapping]]] = ..., stop_string: _Optional[str] = ..., stop_token_id: _Optional[int] = ..., prompt_logprobs: _Optional[_Iterable[_Union[PromptLogprob, _Mapping]]] = ..., num_resumed_tokens: _Optional[int] = ...) -> None: ...

class PromptLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "rank", "top")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    rank: int
    top: TopLogprobs
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., rank: _Optional[int] = ..., top: _Optional[_Union[TopLogprobs, _Mapping]] = ...) -> None: ...

class TopLogprobs(_message.Message):
    __slots__ = ("token_ids", "logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("aborted",)
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    aborted: bool
    def __init__(self, aborted: _Optional[bool] = ...) -> None: ...
