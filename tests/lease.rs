//! `runner::worker::ownership::lease` against a real nats-server, on a bucket made by
//! `runner::broker::ensure_leases_bucket` with a short TTL.
//!
//! What it must keep: of two contenders exactly one holds a key; renewing keeps it past its
//! TTL; a holder that stops renewing loses the key after the TTL, a later holder has a
//! greater epoch, and the old holder's renew is then refused as lost; a release frees the
//! key at once; a hand-over frees the key and tells the one next holder the snapshot it was
//! left at, ages out unclaimed, can be handed on again by a kept heir, and cannot be written
//! by a holder that lost the key; the
//! holder's deadline lies within one TTL of its acquire. A kept lease
//! (`runner::worker::ownership::keeper`) stays held while its holder is busy for several TTLs, and one
//! taken from under it is reported lost. Waits are on
//! conditions with generous bounds; nothing asserts how long something took.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::{Duration, Instant};

use async_nats::jetstream::kv;
use common::{NatsServer, jetstream};
use runner::broker::{BrokerError, ensure_leases_bucket};
use runner::config::StreamStorage;
use runner::worker::ownership::keeper::Kept;
use runner::worker::ownership::lease::{Lease, LeaseError, holder};

/// Short, and above the server's 1 s floor for limit markers.
const TTL: Duration = Duration::from_secs(2);
/// Bound on waiting for an expiry the server decides (TTL plus its expiry sweep).
const EXPIRY_BOUND: Duration = Duration::from_secs(30);

async fn bucket(server: &NatsServer) -> kv::Store {
    let js = jetstream(&server.url()).await;
    ensure_leases_bucket(&js, "LEASES", TTL, 1, StreamStorage::File)
        .await
        .unwrap()
}

/// Polls `acquire` until it wins or `bound` passes.
async fn acquire_eventually(kv: &kv::Store, key: &str, owner: &str) -> Lease {
    let deadline = Instant::now() + EXPIRY_BOUND;
    loop {
        if let Some(lease) = Lease::acquire(kv, key, owner, TTL).await.unwrap() {
            return lease;
        }
        assert!(
            Instant::now() < deadline,
            "{owner} could not acquire {key} within {EXPIRY_BOUND:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Whether `owner` could take `p.0` now (the asserts expect it cannot).
async fn can_acquire(kv: &kv::Store, owner: &str) -> bool {
    Lease::acquire(kv, "p.0", owner, TTL)
        .await
        .unwrap()
        .is_some()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn of_two_contenders_exactly_one_acquires() {
    let server = NatsServer::start();
    let kv = bucket(&server).await;
    let (a, b) = tokio::join!(
        Lease::acquire(&kv, "p.0", "a", TTL),
        Lease::acquire(&kv, "p.0", "b", TTL)
    );
    let (a, b) = (a.unwrap(), b.unwrap());
    assert!(a.is_some() != b.is_some(), "a: {a:?}, b: {b:?}");
    let won = a.or(b).unwrap();
    let seen = holder(&kv, "p.0").await.unwrap().unwrap();
    assert_eq!(seen.epoch, won.epoch());
    // The holder still holds it: a third try loses too.
    assert!(!can_acquire(&kv, "c").await);
    // Other keys are independent.
    assert!(
        Lease::acquire(&kv, "p.1", "c", TTL)
            .await
            .unwrap()
            .is_some()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn renewing_keeps_the_lease_past_its_ttl() {
    let server = NatsServer::start();
    let kv = bucket(&server).await;
    let mut lease = Lease::acquire(&kv, "p.0", "a", TTL).await.unwrap().unwrap();
    let epoch = lease.epoch();
    let first_deadline = lease.valid_until();
    let until = Instant::now() + TTL * 3;
    while Instant::now() < until {
        tokio::time::sleep(lease.renew_every()).await;
        lease.renew().await.unwrap();
        assert!(lease.is_valid());
        assert!(!can_acquire(&kv, "b").await);
    }
    assert_eq!(lease.epoch(), epoch, "renewing keeps the epoch");
    assert!(
        lease.valid_until() > first_deadline,
        "renewing moves the deadline"
    );
    let seen = holder(&kv, "p.0").await.unwrap().unwrap();
    assert_eq!((seen.owner.as_str(), seen.epoch), ("a", epoch));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_that_stops_renewing_loses_the_lease_to_a_greater_epoch() {
    let server = NatsServer::start();
    let kv = bucket(&server).await;
    let mut old = Lease::acquire(&kv, "p.0", "a", TTL).await.unwrap().unwrap();
    // Renewed once, so its entry is an update, not the create: expiry must still happen.
    old.renew().await.unwrap();
    let new = acquire_eventually(&kv, "p.0", "b").await;
    assert!(
        new.epoch() > old.epoch(),
        "new epoch {} after old epoch {}",
        new.epoch(),
        old.epoch()
    );
    match old.renew().await {
        Err(LeaseError::Lost { key, epoch }) => {
            assert_eq!((key.as_str(), epoch), ("p.0", old.epoch()));
        }
        other => panic!("the old holder's renew must be refused as lost: {other:?}"),
    }
    assert!(!old.is_valid(), "a lost lease is never valid");
    // Its release is refused too, and leaves the new holder in place.
    assert!(matches!(old.release().await, Err(LeaseError::Lost { .. })));
    let seen = holder(&kv, "p.0").await.unwrap().unwrap();
    assert_eq!((seen.owner.as_str(), seen.epoch), ("b", new.epoch()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_lease_is_not_renewed_even_when_nobody_took_it() {
    let server = NatsServer::start();
    let kv = bucket(&server).await;
    let mut lease = Lease::acquire(&kv, "p.0", "a", TTL).await.unwrap().unwrap();
    common::wait_until("the lease ages out", EXPIRY_BOUND, || async {
        holder(&kv, "p.0").await.unwrap().is_none()
    })
    .await;
    assert!(matches!(lease.renew().await, Err(LeaseError::Lost { .. })));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn release_lets_another_acquire_at_once() {
    let server = NatsServer::start();
    let kv = bucket(&server).await;
    let mut lease = Lease::acquire(&kv, "p.0", "a", TTL).await.unwrap().unwrap();
    lease.renew().await.unwrap();
    let epoch = lease.epoch();
    assert!(!can_acquire(&kv, "b").await);
    lease.release().await.unwrap();
    assert_eq!(holder(&kv, "p.0").await.unwrap(), None);
    let next = Lease::acquire(&kv, "p.0", "b", TTL).await.unwrap().unwrap();
    assert!(next.epoch() > epoch);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hand_over_frees_the_key_and_tells_the_next_holder_its_snapshot() {
    let server = NatsServer::start();
    let kv = bucket(&server).await;
    let mut lease = Lease::acquire(&kv, "p.0", "a", TTL).await.unwrap().unwrap();
    assert_eq!(
        lease.handed_over_at(),
        None,
        "a fresh key names no snapshot"
    );
    lease.renew().await.unwrap();
    let epoch = lease.epoch();
    lease.hand_over(4242).await.unwrap();
    assert_eq!(
        holder(&kv, "p.0").await.unwrap(),
        None,
        "a handed-over key is free"
    );
    // Two contenders for the handed-over key: exactly one swaps it.
    let (b, c) = tokio::join!(
        Lease::acquire(&kv, "p.0", "b", TTL),
        Lease::acquire(&kv, "p.0", "c", TTL)
    );
    let (b, c) = (b.unwrap(), c.unwrap());
    assert!(b.is_some() != c.is_some(), "b: {b:?}, c: {c:?}");
    let mut next = b.or(c).unwrap();
    assert_eq!(next.handed_over_at(), Some(4242));
    assert!(next.epoch() > epoch);
    let seen = holder(&kv, "p.0").await.unwrap().unwrap();
    assert_eq!(seen.epoch, next.epoch());
    next.renew().await.unwrap();
    assert!(
        !can_acquire(&kv, "d").await,
        "the heir holds it like any holder"
    );
    // Released plainly, the key names no snapshot to the one after.
    next.release().await.unwrap();
    let last = Lease::acquire(&kv, "p.0", "d", TTL).await.unwrap().unwrap();
    assert_eq!(last.handed_over_at(), None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unclaimed_hand_over_ages_out_and_a_lost_holder_cannot_hand_over() {
    let server = NatsServer::start();
    let kv = bucket(&server).await;
    let lease = Lease::acquire(&kv, "p.0", "a", TTL).await.unwrap().unwrap();
    lease.hand_over(7).await.unwrap();
    common::wait_until("the hand-over ages out", EXPIRY_BOUND, || async {
        kv.entry("p.0")
            .await
            .unwrap()
            .is_none_or(|e| e.operation != kv::Operation::Put)
    })
    .await;
    let next = Lease::acquire(&kv, "p.0", "b", TTL).await.unwrap().unwrap();
    assert_eq!(
        next.handed_over_at(),
        None,
        "an aged-out hand-over names nothing"
    );
    // A former holder whose key was taken meanwhile cannot write a hand-over over it.
    let stale = acquire_eventually(&kv, "p.1", "a").await;
    let entry = kv.entry("p.1").await.unwrap().unwrap();
    let rival = serde_json::json!({"owner": "b", "nonce": "rival"});
    kv.update("p.1", rival.to_string().into(), entry.revision)
        .await
        .unwrap();
    assert!(matches!(
        stale.hand_over(9).await,
        Err(LeaseError::Lost { .. })
    ));
    assert_eq!(holder(&kv, "p.1").await.unwrap().unwrap().owner, "b");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_deadline_lies_within_one_ttl_of_the_acquire() {
    let server = NatsServer::start();
    let kv = bucket(&server).await;
    let before = Instant::now();
    let lease = Lease::acquire(&kv, "p.0", "a", TTL).await.unwrap().unwrap();
    let after = Instant::now();
    assert!(lease.valid_until() > before, "{lease:?}");
    assert!(lease.valid_until() < after + TTL, "{lease:?}");
    assert!(lease.is_valid());
    assert_eq!(lease.renew_every(), TTL / 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_recognises_its_own_write_whose_answer_was_lost() {
    let server = NatsServer::start();
    let kv = bucket(&server).await;
    let mut lease = Lease::acquire(&kv, "p.0", "a", TTL).await.unwrap().unwrap();
    lease.renew().await.unwrap();
    // The holder's last write lands once more behind its back, as a renew whose answer was
    // lost would: the held revision is now stale, but the live entry is still its own.
    let entry = kv.entry("p.0").await.unwrap().unwrap();
    kv.update("p.0", entry.value, entry.revision).await.unwrap();
    lease.renew().await.unwrap();
    assert!(lease.is_valid());
    let seen = holder(&kv, "p.0").await.unwrap().unwrap();
    assert_eq!((seen.owner.as_str(), seen.epoch), ("a", lease.epoch()));
    // A rival's write with the same owner name is not mistaken for its own.
    let entry = kv.entry("p.0").await.unwrap().unwrap();
    let forged = serde_json::json!({"owner": "a", "epoch": lease.epoch(), "nonce": "rival"});
    kv.update("p.0", forged.to_string().into(), entry.revision)
        .await
        .unwrap();
    assert!(matches!(lease.renew().await, Err(LeaseError::Lost { .. })));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_bucket_is_idempotent_and_an_incompatible_one_is_refused() {
    let server = NatsServer::start();
    let js = jetstream(&server.url()).await;
    let kv = ensure_leases_bucket(&js, "LEASES", TTL, 1, StreamStorage::File)
        .await
        .unwrap();
    let status = kv.status().await.unwrap();
    assert_eq!(status.max_age(), TTL);
    assert_eq!(status.history(), 1);
    let config = &status.info.config;
    assert!(config.subject_delete_marker_ttl.is_some(), "{config:?}");
    // Again with the same TTL: opened, not changed.
    ensure_leases_bucket(&js, "LEASES", TTL, 1, StreamStorage::File)
        .await
        .unwrap();
    // With another TTL: refused, naming the field.
    match ensure_leases_bucket(&js, "LEASES", TTL * 2, 1, StreamStorage::File).await {
        Err(BrokerError::Incompatible { field, .. }) => assert_eq!(field, "max_age"),
        other => panic!(
            "expected an incompatible max_age, got {:?}",
            other.map(|_| ())
        ),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kept_lease_stays_held_while_its_holder_is_busy_for_several_ttls() {
    let server = NatsServer::start();
    let kv = bucket(&server).await;
    let lease = Lease::acquire(&kv, "p.0", "a", TTL).await.unwrap().unwrap();
    let first_deadline = lease.valid_until();
    let kept = Kept::keep(lease, None);
    let epoch = kept.epoch();
    // The holder does something long (a flush, a snapshot) and renews nothing itself.
    tokio::time::sleep(TTL * 3).await;
    assert!(kept.is_valid(), "{kept:?}");
    assert!(
        kept.valid_until() > first_deadline,
        "the keeper moved the deadline"
    );
    assert!(
        !can_acquire(&kv, "b").await,
        "nobody else can take a kept lease"
    );
    let seen = holder(&kv, "p.0").await.unwrap().unwrap();
    assert_eq!((seen.owner.as_str(), seen.epoch), ("a", epoch));
    kept.release().await.unwrap();
    let next = Lease::acquire(&kv, "p.0", "b", TTL).await.unwrap().unwrap();
    assert!(next.epoch() > epoch, "released at once, to a greater epoch");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kept_lease_taken_from_under_it_is_reported_lost() {
    let server = NatsServer::start();
    let kv = bucket(&server).await;
    let lease = Lease::acquire(&kv, "p.0", "a", TTL).await.unwrap().unwrap();
    let kept = Kept::keep(lease, None);
    // Someone deletes the key behind the holder's back and another contender takes it.
    kv.delete("p.0").await.unwrap();
    let rival = Lease::acquire(&kv, "p.0", "b", TTL).await.unwrap().unwrap();
    tokio::time::timeout(EXPIRY_BOUND, kept.expired())
        .await
        .expect("the keeper's next renewal finds the lease lost");
    assert!(!kept.is_valid());
    assert!(matches!(kept.release().await, Err(LeaseError::Lost { .. })));
    let seen = holder(&kv, "p.0").await.unwrap().unwrap();
    assert_eq!((seen.owner.as_str(), seen.epoch), ("b", rival.epoch()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_inherited_kept_lease_can_be_handed_on_with_the_same_snapshot() {
    let server = NatsServer::start();
    let kv = bucket(&server).await;
    let first = Kept::keep(
        Lease::acquire(&kv, "p.0", "a", TTL).await.unwrap().unwrap(),
        None,
    );
    assert_eq!(first.handed_over_at(), None);
    first.hand_over(77).await.unwrap();
    // An heir that cannot start gives the key back naming the same snapshot, after its
    // keeper renewed it at least once.
    let heir = Kept::keep(
        Lease::acquire(&kv, "p.0", "b", TTL).await.unwrap().unwrap(),
        None,
    );
    assert_eq!(heir.handed_over_at(), Some(77));
    tokio::time::sleep(TTL / 2).await;
    assert!(heir.is_valid());
    heir.hand_over(77).await.unwrap();
    assert_eq!(holder(&kv, "p.0").await.unwrap(), None);
    let next = Lease::acquire(&kv, "p.0", "c", TTL).await.unwrap().unwrap();
    assert_eq!(
        next.handed_over_at(),
        Some(77),
        "the next taker still knows it"
    );
}
