//! The instance index against a real libmdbx store: paging, filters, tenant isolation,
//! state changes, the retention sweep, snapshot import and the rebuild of an older store.

use std::collections::BTreeMap;

use super::*;
use crate::config::StorageConfig;
use crate::saga::{Instance, Status};
use crate::storage::Store;

fn store() -> (tempfile::TempDir, Store) {
    let dir = tempfile::tempdir().expect("tempdir");
    let cfg = StorageConfig {
        data_dir: dir.path().to_path_buf(),
        ..StorageConfig::default()
    };
    (dir, Store::open(&cfg).expect("opens"))
}

fn inst(tenant: &str, corr: &str, state: &str, started_ms: u64) -> Instance {
    Instance {
        tenant: tenant.into(),
        saga: "order".into(),
        version: 1,
        correlation_id: corr.into(),
        state: state.into(),
        status: if state == "done" {
            Status::Completed
        } else {
            Status::Running
        },
        data: serde_json::json!({}),
        timers: BTreeMap::new(),
        progress: None,
        started_ms,
        updated_ms: started_ms,
        applied: 1,
        awaiting: None,
    }
}

fn put(store: &Store, i: &Instance) {
    store
        .write_blocking(|t| {
            let before = t
                .instance(&i.tenant, &i.saga, &i.correlation_id)?
                .map(|x| x.state);
            t.put_instance(i, before.as_deref())
        })
        .expect("writes");
}

fn query(tenant: &str, state: Option<&str>) -> InstanceQuery {
    InstanceQuery {
        tenant: tenant.into(),
        saga: "order".into(),
        state: state.map(str::to_string),
        started_before_ms: None,
        after: None,
        limit: 2,
    }
}

/// Every page of `q`, as correlation ids in order.
fn all(store: &Store, mut q: InstanceQuery) -> Vec<String> {
    let mut out = Vec::new();
    loop {
        let page = store
            .read_blocking(|t| t.list_instances(&q))
            .expect("lists");
        assert!(page.items.len() <= q.limit);
        out.extend(page.items.into_iter().map(|i| i.correlation_id));
        match page.next {
            Some(n) => q.after = Some(n),
            None => return out,
        }
    }
}

#[test]
fn pages_filters_and_tenants() {
    let (_d, store) = store();
    // Started out of order; listed oldest first.
    for (corr, state, at) in [
        ("o-3", "new", 300),
        ("o-1", "new", 100),
        ("o-2", "paid", 200),
        ("o-5", "new", 500),
        ("o-4", "done", 400),
    ] {
        put(&store, &inst("acme", corr, state, at));
    }
    put(&store, &inst("globex", "g-1", "new", 50));
    assert_eq!(
        all(&store, query("acme", None)),
        ["o-1", "o-2", "o-3", "o-4", "o-5"]
    );
    assert_eq!(
        all(&store, query("acme", Some("new"))),
        ["o-1", "o-3", "o-5"]
    );
    assert_eq!(
        all(&store, query("acme", Some("gone"))),
        Vec::<String>::new()
    );
    let mut old = query("acme", Some("new"));
    old.started_before_ms = Some(300);
    assert_eq!(all(&store, old), ["o-1"]);
    assert_eq!(all(&store, query("globex", None)), ["g-1"]);
    // A continuation from one tenant's listing read in another's stays in the other's.
    let first = store
        .read_blocking(|t| t.list_instances(&query("acme", None)))
        .expect("lists");
    let mut other = query("globex", None);
    other.after = first.next;
    let page = store
        .read_blocking(|t| t.list_instances(&other))
        .expect("lists");
    assert!(page.items.iter().all(|i| i.tenant == "globex"));
    // A state change moves the instance between state listings, not in the age one.
    put(&store, &inst("acme", "o-1", "paid", 100));
    assert_eq!(all(&store, query("acme", Some("new"))), ["o-3", "o-5"]);
    assert_eq!(all(&store, query("acme", Some("paid"))), ["o-1", "o-2"]);
    assert_eq!(all(&store, query("acme", None)).len(), 5);
}

#[test]
fn the_sweep_removes_entries_and_old_stores_are_rebuilt() {
    let (dir, store) = store();
    put(&store, &inst("acme", "o-1", "done", 100));
    put(&store, &inst("acme", "o-2", "new", 200));
    let (removed, _) = store
        .write_blocking(|t| t.sweep_finished(u64::MAX, &[], 100))
        .expect("sweeps");
    assert_eq!(removed, 1);
    assert_eq!(all(&store, query("acme", None)), ["o-2"]);
    assert_eq!(
        all(&store, query("acme", Some("done"))),
        Vec::<String>::new()
    );

    // A store from before the index: entries and version gone; opening rebuilds them.
    store
        .write_blocking(|t| {
            let keys: Vec<Vec<u8>> = {
                let mut c = t.txn.cursor(&t.index)?;
                c.iter_start::<Vec<u8>, Vec<u8>>()
                    .map_while(|r| r.ok())
                    .map(|(k, _)| k)
                    .collect()
            };
            for k in keys {
                t.txn.del(&t.index, k, None)?;
            }
            t.txn.del(&t.meta, INDEX_VERSION_KEY.as_bytes(), None)?;
            Ok(())
        })
        .expect("clears");
    assert_eq!(all(&store, query("acme", None)), Vec::<String>::new());
    drop(store);
    let reopened = Store::open(&StorageConfig {
        data_dir: dir.path().to_path_buf(),
        ..StorageConfig::default()
    })
    .expect("reopens");
    assert_eq!(all(&reopened, query("acme", None)), ["o-2"]);
    assert_eq!(all(&reopened, query("acme", Some("new"))), ["o-2"]);
}
