//! `saga_progress` in `/info`: how far each source stream is routed into the saga inbox,
//! and how far this node's partitions have applied it. Read from the broker and the store
//! on each call; it reports, it never decides.

use std::sync::Arc;

use serde_json::json;

use crate::runtime::AppState;

/// Where the saga pipeline stands, for `/info`: how far each source stream is routed into
/// the saga inbox (its router's fence marker, read from the broker), how many partitions
/// this node owns and how many of them have inbox messages not applied yet, and what waits
/// in the outbox and the timer table. The routed positions are read before the partitions,
/// so `partitions_behind = 0` means every input routed by then is applied here, as far as
/// this node owns its partition.
pub(super) async fn saga_progress(state: &Arc<AppState>) -> serde_json::Value {
    if !state.config.runner.mode.runs_sagas() {
        return json!(null);
    }
    let js = state.broker.jetstream();
    let inbox = &state.config.streams.saga_inbox;
    let mut routed = serde_json::Map::new();
    for s in crate::worker::sources(state) {
        let at = match routed_through(js, inbox, &s).await {
            Ok(seq) => json!(seq),
            Err(e) => json!({ "error": e.to_string() }),
        };
        routed.insert(s.stream, at);
    }
    let owned = state.placement.owned();
    let mut behind = 0u64;
    let mut unknown = 0u64;
    if let Ok(stream) = js.get_stream(inbox).await {
        for &p in owned.keys() {
            let key = crate::worker::ownership::partition_checkpoint(state, p);
            let applied = state.store.read(move |t| t.checkpoint(&key)).await;
            let last = stream
                .get_last_raw_message_by_subject(&format!("runner.inbox.{p}.>"))
                .await;
            match (applied, last) {
                (Ok(a), Ok(m)) if m.sequence > a => behind += 1,
                (Ok(_), Ok(_)) => {}
                (Ok(_), Err(e))
                    if e.kind()
                        == async_nats::jetstream::stream::LastRawMessageErrorKind::NoMessageFound => {}
                _ => unknown += 1,
            }
        }
    } else {
        unknown = owned.len() as u64;
    }
    let local = state
        .store
        .read(|t| Ok((t.outbox_depth()?, t.timers_pending()?)))
        .await;
    let (outbox, timers) = match local {
        Ok((o, t)) => (json!(o), json!(t)),
        Err(e) => (json!({ "error": e.to_string() }), json!(null)),
    };
    json!({
        "routed": routed,
        "partitions_owned": owned.len(),
        "partitions_behind": behind,
        "partitions_unknown": unknown,
        "outbox_depth": outbox,
        "timers_pending": timers,
    })
}

/// How far every share of `source` has routed it: the lowest of their markers (a share
/// with none yet stands where the source's former single router stopped).
async fn routed_through(
    js: &async_nats::jetstream::Context,
    inbox: &str,
    source: &crate::worker::Source,
) -> Result<u64, crate::broker::fence::FenceError> {
    use crate::broker::fence::Fence;
    use crate::worker::ownership::router::share::Share;
    let single = Fence::observe(js, inbox, &source.stream).await?.through();
    let mut lowest = u64::MAX;
    for share in Share::all(source) {
        let at = Fence::observe(js, inbox, &share)
            .await?
            .through()
            .or(single);
        lowest = lowest.min(at.map_or(0, |t| t.seq));
    }
    Ok(lowest)
}
