//! Metric names, described once: every metric Runner exports is named here, and
//! registered under that name in [`super::Metrics::new`].

/// Build information (value 1), labelled with version, revision and mode.
pub const BUILD_INFO: &str = "runner_build_info";
/// 1 while the NATS connection is up, 0 otherwise (updated on every scrape).
pub const NATS_CONNECTED: &str = "runner_nats_connected";
/// 1 while the process is draining.
pub const DRAINING: &str = "runner_draining";
/// Manifest reloads by outcome (`applied` | `rejected`).
pub const MANIFEST_RELOADS_TOTAL: &str = "runner_manifest_reloads_total";
/// Sagas currently loaded (one per name and version).
pub const MANIFEST_SAGAS: &str = "runner_manifest_sagas";
/// Inputs applied per libmdbx transaction.
pub const SAGA_BATCH_SIZE: &str = "runner_saga_batch_size";
/// Inputs a transaction left for the next one because its outputs reached
/// `saga.max_batch_bytes`.
pub const SAGA_DEFERRED_INPUTS_TOTAL: &str = "runner_saga_deferred_inputs_total";
/// Time to apply a batch and commit it durably, seconds.
pub const SAGA_COMMIT_SECONDS: &str = "runner_saga_commit_seconds";
/// Seconds from an input being stored in its stream to the saga worker reading it (the
/// wait before a batch; the inbox copy's store time in partitioned mode).
pub const SAGA_INPUT_WAIT_SECONDS: &str = "runner_saga_input_wait_seconds";
/// Saga applications by saga and outcome (`applied`, `ignored`, `duplicate`, `dead_lettered`).
pub const SAGA_TRANSITIONS_TOTAL: &str = "runner_saga_transitions_total";
/// Inputs read, by stream.
pub const SAGA_INPUTS_TOTAL: &str = "runner_saga_inputs_total";
/// Inputs no saga wanted.
pub const SAGA_UNROUTED_TOTAL: &str = "runner_saga_unrouted_total";
/// Messages in a source stream after the last one its router read that its filter takes in
/// (what a loaded trigger can want), by stream and share (routing lag; set on the replica
/// that routes it).
pub const CONSUMER_LAG: &str = "runner_consumer_lag";
/// Last source sequence routed into the saga inbox, by stream (set on the replica that
/// routes it; what each partition applied is `runner_partition_checkpoint`).
pub const CONSUMER_CHECKPOINT: &str = "runner_consumer_checkpoint";
/// Records waiting in the outbox.
pub const OUTBOX_DEPTH: &str = "runner_outbox_depth";
/// Outbox records published and acknowledged.
pub const RELAY_PUBLISHED_TOTAL: &str = "runner_relay_published_total";
/// Failed relay rounds (publish or acknowledgement errors).
pub const RELAY_ERRORS_TOTAL: &str = "runner_relay_errors_total";
/// Admin connections open now.
pub const ADMIN_CONNECTIONS: &str = "runner_admin_connections";
/// Admin connections closed at once because `admin.max_connections` were open, each with a
/// request in flight.
pub const ADMIN_CONNECTIONS_REFUSED_TOTAL: &str = "runner_admin_connections_refused_total";
/// Admin connections closed to make room for a newer one at `admin.max_connections`: each
/// had waited longest of those open without a request in flight (a slow or idle one).
pub const ADMIN_CONNECTIONS_EVICTED_TOTAL: &str = "runner_admin_connections_evicted_total";
/// Outputs the relay parked because the broker can never take them (dead-lettered).
pub const RELAY_PARKED_TOTAL: &str = "runner_relay_parked_total";
/// Relays and routers failing on every attempt for 30 s or more, read at each scrape.
pub const PIPELINE_STALLED_STAGES: &str = "runner_pipeline_stalled_stages";
/// Time from publishing a window of outbox records to all acknowledged, seconds.
pub const RELAY_WINDOW_SECONDS: &str = "runner_relay_window_seconds";
/// Timers waiting to fire.
pub const TIMERS_PENDING: &str = "runner_timers_pending";
/// Timers fired.
pub const TIMERS_FIRED_TOTAL: &str = "runner_timers_fired_total";
/// How late timers fire (now minus due time), seconds.
pub const TIMER_FIRE_LAG_SECONDS: &str = "runner_timer_fire_lag_seconds";
/// How long a batch of new aggregate events waited behind work under way, seconds
/// (`saga.max_queued_work`; observed only when it waited).
pub const SAGA_ADMISSION_WAIT_SECONDS: &str = "runner_saga_admission_wait_seconds";
/// New inputs waiting at this node's routers to enter the saga inbox, by tenant.
pub const TENANT_WAITING_INPUTS: &str = "runner_tenant_waiting_inputs";
/// How long the oldest of a tenant's waiting new inputs has waited, seconds.
pub const TENANT_OLDEST_WAIT_SECONDS: &str = "runner_tenant_oldest_wait_seconds";
/// Running saga instances, by tenant, in the partitions this node owns.
pub const TENANT_LIVE_INSTANCES: &str = "runner_tenant_live_instances";
/// Pending saga timers, by tenant, in the partitions this node owns.
pub const TENANT_PENDING_TIMERS: &str = "runner_tenant_pending_timers";
/// Inputs held at a tenant's cap (on running instances or pending timers), in the
/// partitions this node owns.
pub const TENANT_HELD_AT_CAP: &str = "runner_tenant_held_at_cap";
/// How long the oldest input held at a tenant's cap has been held, seconds.
pub const TENANT_OLDEST_HELD_AT_CAP_SECONDS: &str = "runner_tenant_oldest_held_at_cap_seconds";
/// New inputs let into the saga inbox, by tenant.
pub const TENANT_INPUTS_TOTAL: &str = "runner_tenant_inputs_total";
/// Turns a tenant with new inputs waiting passed at its rate limit (`tenancy.rate_limits`).
pub const TENANT_RATE_LIMITED_TOTAL: &str = "runner_tenant_rate_limited_total";
/// Times a router found a tenant's new inputs waiting because its outputs waiting in the
/// outboxes reached its cap (`tenancy.outbox_byte_caps`); about every 20 ms while they wait.
pub const TENANT_OUTBOX_CAPPED_TOTAL: &str = "runner_tenant_outbox_capped_total";
/// Bytes of a tenant's outputs waiting in this node's outboxes.
pub const TENANT_OUTBOX_BYTES: &str = "runner_tenant_outbox_bytes";
/// Inputs applied to saga instances (committed transitions), by tenant.
pub const TENANT_APPLIED_TOTAL: &str = "runner_tenant_applied_total";
/// Effect calls this node's effect worker started, by tenant and effect.
pub const TENANT_EFFECT_CALLS_TOTAL: &str = "runner_tenant_effect_calls_total";
/// Turns a tenant with effect commands waiting passed at its effect rate limit
/// (`tenancy.effect_rate_limits`), by tenant and effect.
pub const TENANT_EFFECT_RATE_LIMITED_TOTAL: &str = "runner_tenant_effect_rate_limited_total";
/// Dead letters by kind.
pub const DEADLETTERS_TOTAL: &str = "runner_deadletters_total";
/// Saga partitions this replica owns now (partitioned mode).
pub const PARTITIONS_OWNED: &str = "runner_partitions_owned";
/// Lease epoch of each partition this replica owns (0 when not owned).
pub const PARTITION_EPOCH: &str = "runner_partition_epoch";
/// The committed inbox checkpoint, by owned partition (`runner_consumer_checkpoint` is how
/// far a source stream is routed).
pub const PARTITION_CHECKPOINT: &str = "runner_partition_checkpoint";
/// Inbox messages after the last one read, by owned partition.
pub const PARTITION_LAG: &str = "runner_partition_lag";
/// Partition lease events (`acquired`; `inherited`, an acquire from a hand-over that named its
/// snapshot; `renewed`, `lost`, `released`, `fenced`).
pub const LEASE_EVENTS_TOTAL: &str = "runner_lease_events_total";
/// Fenced publishes the broker refused because a newer owner raised the fence.
pub const FENCED_REJECTIONS_TOTAL: &str = "runner_fenced_rejections_total";
/// Outbox records not published because the fence watermark showed a predecessor had.
pub const RELAY_SUPPRESSED_TOTAL: &str = "runner_relay_suppressed_total";
/// Input copies the routers stored in the saga inbox.
pub const ROUTER_COPIES_TOTAL: &str = "runner_router_copies_total";
/// Partitions taken over, and how long from lease to first read, seconds.
pub const PARTITION_START_SECONDS: &str = "runner_partition_start_seconds";
/// Partitions handed over, and how long from stop to release, seconds.
pub const PARTITION_HANDOFF_SECONDS: &str = "runner_partition_handoff_seconds";
/// Partition starts by where the state came from (`local`, `snapshot`).
pub const PARTITION_RESTORES_TOTAL: &str = "runner_partition_restores_total";
/// Inputs applied again on take-over that an earlier owner had already applied (at or
/// below the fence watermark).
pub const PARTITION_REPLAYED_TOTAL: &str = "runner_partition_replayed_inputs_total";
/// Snapshots uploaded.
pub const SNAPSHOTS_TOTAL: &str = "runner_snapshots_total";
/// How long each snapshot round took, seconds (its reading of the store and its uploads);
/// the next round waits at least nine times as long (`worker/ownership/snap.rs`).
pub const SNAPSHOT_ROUND_SECONDS: &str = "runner_snapshot_round_seconds";
/// When each owned partition's last snapshot was uploaded, Unix seconds, by partition
/// (absent until its first).
pub const SNAPSHOT_LAST_TIMESTAMP: &str = "runner_snapshot_last_timestamp_seconds";
/// How long the saga inbox stream keeps inputs (its `max_age`), seconds; 0 = no age limit.
/// A partition's last snapshot older than this cannot be replayed without a gap.
pub const INBOX_RETENTION: &str = "runner_inbox_retention_seconds";
/// Take-overs that found inputs they needed already gone from the inbox (retention
/// shorter than snapshot age plus outage).
pub const RETENTION_GAPS_TOTAL: &str = "runner_inbox_retention_gaps_total";
/// Snapshots and fence markers refused because they cannot be genuine, by `object`
/// (`snapshot`, `fence_marker`): a snapshot whose seal does not check against the deployment key or
/// whose checkpoint lies past the inbox's last sequence; a fence marker whose epoch lies past
/// the leases bucket's last revision or whose watermark lies past the stream it covers.
pub const REFUSED_OBJECTS_TOTAL: &str = "runner_refused_objects_total";
/// The `object` labels of [`REFUSED_OBJECTS_TOTAL`].
pub const REFUSED_OBJECTS: [&str; 2] = ["snapshot", "fence_marker"];
/// Store pages write transactions added or copied for update (libmdbx's count, read at
/// scrape time; close to the pages commits write, aborted transactions included). Over
/// `runner_saga_batch_size_sum`, the store pages written per input applied.
pub const STORE_PAGES_DIRTIED_TOTAL: &str = "runner_store_pages_dirtied_total";
/// 1 while storage writes fail: the last write transaction failed in libmdbx (a full disk,
/// an I/O error, the map at `storage.max_size`); 0 once one commits. Read at each scrape.
pub const STORAGE_WRITE_FAILING: &str = "runner_storage_write_failing";
/// Write transactions failed in libmdbx, by reason (`disk_full`: no room on the disk
/// holding the data directory, ENOSPC; `other`). Brought up to the store's count at each
/// scrape.
pub const STORAGE_WRITE_FAILURES_TOTAL: &str = "runner_storage_write_failures_total";
/// Effect claim events (`acquired`, `busy`, `steal`, `renewed`, `renew_failed`,
/// `completed`, `failed`, `replayed`).
pub const EFFECT_CLAIMS_TOTAL: &str = "runner_effect_claims_total";
/// Effect commands not executed on delivery, by outcome (`refused`: undecodable or
/// inconsistent, terminated).
pub const EFFECT_COMMANDS_TOTAL: &str = "runner_effect_commands_total";
/// Effect results published, by effect and result type.
pub const EFFECT_RESULTS_TOTAL: &str = "runner_effect_results_total";
/// Effect attempts by effect and outcome (`succeeded`, `retryable`, `fatal`,
/// `timed_out`, `circuit_open`).
pub const EFFECT_ATTEMPTS_TOTAL: &str = "runner_effect_attempts_total";
/// Time from claiming a command to its outcome (all attempts), seconds, by effect.
pub const EFFECT_SECONDS: &str = "runner_effect_seconds";
/// Seconds from an effect command being stored to an effect worker starting on it.
pub const EFFECT_QUEUE_SECONDS: &str = "runner_effect_queue_seconds";
/// Circuit breaker state by effect: 0 closed, 1 open, 2 half-open.
pub const EFFECT_CIRCUIT_STATE: &str = "runner_effect_circuit_state";
/// Effect commands executing now.
pub const EFFECT_IN_FLIGHT: &str = "runner_effect_in_flight";
/// Refused effect commands kept in the local store because the dead-letter stream did
/// not take them (`runner dlq list` shows them).
pub const EFFECT_DEADLETTERS_LOCAL: &str = "runner_effect_deadletters_local_total";

/// The `outcome` values of `runner_saga_transitions_total` (what `worker/tally.rs` is told).
pub const TRANSITION_OUTCOMES: [&str; 5] =
    ["applied", "dead_lettered", "duplicate", "held", "ignored"];
/// The `outcome` values of `runner_effect_attempts_total` (`effect/attempt.rs`).
pub const EFFECT_ATTEMPT_OUTCOMES: [&str; 5] = [
    "succeeded",
    "fatal",
    "timed_out",
    "circuit_open",
    "retryable",
];
/// The `result_type` values of `runner_effect_results_total` (as result envelopes name them).
pub const EFFECT_RESULT_TYPES: [&str; 3] = ["Succeeded", "Failed", "TimedOut"];
