//! Claims checked before they are obeyed. Fence markers and snapshots sit on subjects and in
//! buckets that whoever can write to Runner's own subjects could also write to, and each
//! makes a claim about the streams:
//!
//! | object | claim | genuine only when |
//! |---|---|---|
//! | fence marker | its epoch, a revision of the leases bucket | ≤ the bucket's last revision |
//! | fence marker | its watermark and its lanes' last inputs, sequences of the stream it covers (a router share's source; the inbox, for a partition's outputs) | ≤ that stream's last sequence |
//! | snapshot | its checkpoint, a sequence of the inbox | ≤ the inbox's last sequence (and, with a deployment key, its seal checks: `worker/ownership/snapshot.rs`) |
//!
//! A claim past those bounds cannot be genuine (forged, or left by another deployment on a
//! stream since recreated). Obeying it would skip inputs (a watermark, a checkpoint) or
//! stall the partition for good (an epoch no lease will reach). So it is refused here, with
//! a reason that names what to do, and counted in `runner_refused_objects_total`; the
//! caller leaves the partition or share unstarted (stalled in `/health`) until an operator
//! resets the fence (`POST /admin/partition-fence`, `POST /admin/router-fence`), while a
//! refused snapshot is skipped for an older one or the local copy. A check that cannot be
//! made now (the stream or bucket it reads does not answer, as during a leader election)
//! is not a refusal ([`Unaccepted::Unchecked`]): the caller treats it as a broker fault and
//! tries again, and it is neither counted nor logged as a refused object.

use crate::broker::fence::Observed;
use crate::runtime::AppState;
use crate::telemetry::names::REFUSED_OBJECTS;

/// The last sequence `stream` holds (0 when empty). Looking the stream up reads its info from
/// the server: one request.
pub(crate) async fn last_sequence(
    state: &AppState,
    stream: &str,
) -> Result<u64, async_nats::Error> {
    let s = state.broker.jetstream().get_stream(stream).await?;
    Ok(s.cached_info().state.last_sequence)
}

/// Why a claim was not accepted: refused (it cannot be genuine: an operator must act), or
/// not checked (what it is checked against could not be read: a broker fault, retried).
#[derive(Debug)]
pub(crate) enum Unaccepted {
    /// The claim cannot be genuine; the reason names the way out.
    Refused(String),
    /// The check could not be made now.
    Unchecked(String),
}

impl std::fmt::Display for Unaccepted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Unaccepted::Refused(why) | Unaccepted::Unchecked(why) => f.write_str(why),
        }
    }
}

impl From<Unaccepted> for String {
    fn from(u: Unaccepted) -> String {
        u.to_string()
    }
}

/// Refuses a fence marker whose epoch lies past the leases bucket's last revision or whose
/// watermark lies past `covers`' last sequence. `reset` names the operator's way out.
pub(crate) async fn marker(
    state: &AppState,
    seen: &Observed,
    covers: &str,
    reset: &str,
) -> Result<(), Unaccepted> {
    if let Some(epoch) = seen.epoch() {
        let bucket = format!("KV_{}", state.config.partitions.leases_bucket);
        let revision = last_sequence(state, &bucket)
            .await
            .map_err(|e| Unaccepted::Unchecked(format!("cannot read the leases bucket: {e}")))?;
        if epoch > revision {
            return Err(refused(
                state,
                REFUSED_OBJECTS[1],
                format!(
                    "its fence marker claims lease epoch {epoch}, but the leases bucket has \
                     reached revision {revision} only: the marker is forged or from another \
                     deployment, and no lease would ever pass it; {reset}"
                ),
            ));
        }
    }
    if let Some(at) = seen.through() {
        watermark(state, at.seq, covers, reset).await?;
    }
    // A lane's last input (a router's tenants, `crate::fair`) is a sequence of the same
    // stream: one past it would skip that tenant's inputs up to it.
    if let Some(seq) = seen.lanes().values().max() {
        watermark(state, *seq, covers, reset).await?;
    }
    Ok(())
}

/// Refuses a watermark at `seq` past `covers`' last sequence.
pub(crate) async fn watermark(
    state: &AppState,
    seq: u64,
    covers: &str,
    reset: &str,
) -> Result<(), Unaccepted> {
    let last = last_sequence(state, covers)
        .await
        .map_err(|e| Unaccepted::Unchecked(format!("cannot read stream {covers}: {e}")))?;
    if seq > last {
        return Err(refused(
            state,
            REFUSED_OBJECTS[1],
            format!(
                "its fence marker says everything through sequence {seq} of {covers} is done, \
                 but {covers} holds sequences up to {last} only: the marker is forged or from \
                 another deployment, and obeying it would skip every input up to it; {reset}"
            ),
        ));
    }
    Ok(())
}

/// Counts a refused `object` and returns the refusal.
pub(crate) fn refused(state: &AppState, object: &str, why: String) -> Unaccepted {
    state
        .metrics
        .refused_objects
        .with_label_values(&[object])
        .inc();
    Unaccepted::Refused(why)
}
