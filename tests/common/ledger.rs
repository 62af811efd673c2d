//! The ledger saga (`tests/manifests/ledger.yaml`) as a workload: deposits per account, and
//! the acknowledgements it emits read back per account, so lost, doubled or reordered work
//! shows.

use std::collections::BTreeMap;
use std::time::Duration;

/// The acknowledged deposit numbers per account, in stream order.
pub async fn acknowledged(js: &async_nats::jetstream::Context) -> BTreeMap<String, Vec<u64>> {
    let mut per: BTreeMap<String, Vec<u64>> = BTreeMap::new();
    for m in super::read_stream(js, "WORKFLOW_COMMANDS", "tenant.bank.command.Account.*").await {
        let n = &m.body["payload"]["n"];
        let n = n
            .as_u64()
            .or_else(|| n.as_str().and_then(|v| v.parse().ok()))
            .unwrap();
        let account = m.subject.rsplit('.').next().unwrap().to_string();
        per.entry(account).or_default().push(n);
    }
    per
}

/// The names of accounts `0..count`.
pub fn accounts(count: usize) -> Vec<String> {
    (0..count).map(|a| format!("a-{a}")).collect()
}

/// How many of `accounts` have `n` deposits acknowledged.
pub fn reached(acks: &BTreeMap<String, Vec<u64>>, accounts: &[String], n: usize) -> usize {
    accounts
        .iter()
        .filter(|a| acks.get(*a).is_some_and(|v| v.len() >= n))
        .count()
}

/// Waits until every one of `accounts` has `n` deposits acknowledged.
pub async fn wait_reached(
    js: &async_nats::jetstream::Context,
    accounts: &[String],
    n: usize,
    timeout: Duration,
) {
    let what = format!("{} accounts with {n} deposits acknowledged", accounts.len());
    super::wait_until(&what, timeout, || async {
        reached(&acknowledged(js).await, accounts, n) == accounts.len()
    })
    .await;
}

/// Publishes deposit `n` of accounts `0..count`.
pub async fn deposit_all(js: &async_nats::jetstream::Context, count: usize, n: u64) {
    for a in 0..count {
        let (subject, ev) = super::ledger_deposit(a, n);
        super::publish_json(js, &subject, &ev).await;
    }
}

/// Every one of `count` accounts has exactly deposits `1..=n` acknowledged, once each and in
/// order.
pub async fn assert_exactly(js: &async_nats::jetstream::Context, count: usize, n: u64) {
    let acks = acknowledged(js).await;
    assert_eq!(acks.len(), count, "{acks:?}");
    for (account, ns) in acks {
        assert_eq!(
            ns,
            (1..=n).collect::<Vec<_>>(),
            "{account}: applied once each, in order"
        );
    }
}
