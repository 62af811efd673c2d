//! `runner migrate` (and `POST /admin/migrate`): moves one tenant's instances of a saga from
//! version N to N+1, as N+1's `migration: { from: N, … }` declares.
//!
//! The pass walks the instance index oldest first and migrates in committed batches of
//! [`BATCH`]: each instance is read, migrated ([`crate::saga::migrate::migrate`]) and written
//! back in one write transaction, so an input the node applies meanwhile sees either the old
//! instance or the new one, never half of each. Timers (the `schedule` table), the commands
//! an instance waits for (`awaiting`), its history and its index entries stay with it; only
//! its version, data and state name change. An instance that cannot be migrated (its state
//! has no counterpart, the data expression fails) stays on N and is reported; the others go
//! on.
//!
//! Guarantees: a crash between batches loses nothing — what was committed is on N+1, the
//! rest on N — and running the command again finishes the job (instances already on N+1 are
//! skipped). `dry_run` computes the same report, sample included, and writes nothing.

use serde::Serialize;
use serde_json::Value as Json;

use super::OpsError;
use crate::manifest::Catalog;
use crate::saga::Instance;
use crate::saga::migrate::migrate;
use crate::storage::Store;
use crate::storage::tables::InstanceQuery;

/// Instances migrated per write transaction.
pub const BATCH: usize = 100;
/// Instances shown before and after.
const SAMPLE: usize = 3;

/// One instance before and after.
#[derive(Debug, Serialize)]
pub struct Change {
    /// Correlation id.
    pub correlation_id: String,
    /// State and data before.
    pub before: Shape,
    /// State and data after.
    pub after: Shape,
}

/// What a migration changes of an instance.
#[derive(Debug, Serialize)]
pub struct Shape {
    /// Version.
    pub version: u32,
    /// State name.
    pub state: String,
    /// Data.
    pub data: Json,
}

impl From<&Instance> for Shape {
    fn from(i: &Instance) -> Self {
        Self {
            version: i.version,
            state: i.state.clone(),
            data: i.data.clone(),
        }
    }
}

/// An instance left on the old version.
#[derive(Debug, Serialize)]
pub struct Failure {
    /// Correlation id.
    pub correlation_id: String,
    /// Why.
    pub error: String,
}

/// What a migration pass did (or, dry, would do).
#[derive(Debug, Serialize)]
pub struct MigrationReport {
    /// Tenant.
    pub tenant: String,
    /// Saga.
    pub saga: String,
    /// From this version…
    pub from: u32,
    /// …to this one.
    pub to: u32,
    /// Nothing was written.
    pub dry_run: bool,
    /// Instances migrated (or that would be).
    pub migrated: usize,
    /// Instances of this saga on other versions, left alone.
    pub other_versions: usize,
    /// Instances of partitions another node owns, left to it.
    pub elsewhere: usize,
    /// Write transactions committed.
    pub batches: usize,
    /// The first instances migrated, before and after.
    pub sample: Vec<Change>,
    /// Instances that stay on the old version, and why.
    pub failed: Vec<Failure>,
}

/// Migrates `tenant`'s instances of `saga` on version `from` to `from + 1` with `catalog`
/// (which must load `from + 1` declaring a migration from `from`). Only instances `here`
/// accepts are touched — in partitioned mode, those of the partitions this node owns; the
/// others are counted in `elsewhere`. Blocking.
pub fn migrate_instances(
    store: &Store,
    catalog: &Catalog,
    tenant: &str,
    saga: &str,
    from: u32,
    dry_run: bool,
    here: &dyn Fn(&Instance) -> bool,
) -> Result<MigrationReport, OpsError> {
    let to = from
        .checked_add(1)
        .ok_or_else(|| OpsError::BadQuery(format!("version {from} has no successor")))?;
    let declared = catalog
        .saga(saga, to)
        .and_then(|s| s.migration.as_ref())
        .is_some_and(|m| m.from == from);
    if !declared {
        return Err(OpsError::BadQuery(format!(
            "saga `{saga}` version {to} is not loaded with a `migration: {{ from: {from} }}`; \
             load it beside version {from}, then migrate"
        )));
    }
    let mut report = MigrationReport {
        tenant: tenant.to_string(),
        saga: saga.to_string(),
        from,
        to,
        dry_run,
        migrated: 0,
        other_versions: 0,
        elsewhere: 0,
        batches: 0,
        sample: Vec::new(),
        failed: Vec::new(),
    };
    let mut after: Option<String> = None;
    loop {
        let q = InstanceQuery {
            tenant: tenant.to_string(),
            saga: saga.to_string(),
            state: None,
            started_before_ms: None,
            after: after.clone(),
            limit: BATCH,
        };
        // Read, migrate and write one page in one transaction (a dry run only reads).
        let (next, planned) = if dry_run {
            store.read_blocking(|t| plan(t, &q, catalog, from, here))?
        } else {
            store.write_blocking(|t| {
                let (next, planned) = plan(t, &q, catalog, from, here)?;
                for p in &planned {
                    if let Planned::Migrate { before, new } = p {
                        t.put_instance(new, Some(before.state.as_str()))?;
                    }
                }
                Ok((next, planned))
            })?
        };
        let mut wrote = false;
        for p in planned {
            match p {
                Planned::Migrate { before, new } => {
                    report.migrated += 1;
                    wrote = true;
                    if report.sample.len() < SAMPLE {
                        report.sample.push(Change {
                            correlation_id: new.correlation_id.clone(),
                            before,
                            after: Shape::from(new.as_ref()),
                        });
                    }
                }
                Planned::Other => report.other_versions += 1,
                Planned::Elsewhere => report.elsewhere += 1,
                Planned::Failed(f) => report.failed.push(f),
            }
        }
        if wrote && !dry_run {
            report.batches += 1;
        }
        match next {
            Some(n) => after = Some(n),
            None => return Ok(report),
        }
    }
}

/// What happens to one instance of a page.
enum Planned {
    /// Migrated: its old shape and the new instance.
    Migrate {
        /// Before.
        before: Shape,
        /// After.
        new: Box<Instance>,
    },
    /// On another version: left alone.
    Other,
    /// In a partition another node owns.
    Elsewhere,
    /// Cannot be migrated: stays.
    Failed(Failure),
}

/// Reads one page of the listing `q` and works out each instance's migration.
fn plan<K: libmdbx::TransactionKind>(
    t: &crate::storage::Tables<'_, K>,
    q: &InstanceQuery,
    catalog: &Catalog,
    from: u32,
    here: &dyn Fn(&Instance) -> bool,
) -> Result<(Option<String>, Vec<Planned>), crate::storage::StorageError> {
    let page = t.list_instances(q)?;
    let planned = page
        .items
        .iter()
        .map(|old| {
            if old.version != from {
                return Planned::Other;
            }
            if !here(old) {
                return Planned::Elsewhere;
            }
            match migrate(catalog, old) {
                Ok(new) => Planned::Migrate {
                    before: Shape::from(old),
                    new: Box::new(new),
                },
                Err(e) => Planned::Failed(Failure {
                    correlation_id: old.correlation_id.clone(),
                    error: e.to_string(),
                }),
            }
        })
        .collect();
    Ok((page.next, planned))
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use crate::config::StorageConfig;
    use crate::saga::Status;

    const V1: &str = "format: 1\nsagas:\n  - name: doc\n    version: 1\n    triggers: [{ subject: aggregate.Doc.*, correlation: event.aggregate_id, start: true }]\n    initial_state: a\n    states:\n      a: { on: { Go: { goto: b } } }\n      b: { on: { Go: { goto: odd } } }\n      odd: { terminal: true }\n";
    const V2: &str = "format: 1\nsagas:\n  - name: doc\n    version: 2\n    triggers: [{ subject: aggregate.Doc.*, correlation: event.aggregate_id, start: true }]\n    initial_state: a\n    states:\n      a: { on: { Go: { goto: b } } }\n      b: { terminal: true }\n    migration: { from: 1, data: \"{'moved': true}\" }\n";

    fn put(store: &Store, corr: &str, state: &str, started: u64) {
        let i = Instance {
            tenant: "acme".into(),
            saga: "doc".into(),
            version: 1,
            correlation_id: corr.into(),
            state: state.into(),
            status: Status::Running,
            data: serde_json::json!({}),
            timers: BTreeMap::new(),
            progress: None,
            started_ms: started,
            updated_ms: started,
            applied: 1,
            awaiting: None,
        };
        store
            .write_blocking(|t| t.put_instance(&i, None))
            .expect("put");
    }

    fn versions(store: &Store) -> Vec<(String, u32)> {
        let mut v: Vec<(String, u32)> = store
            .read_blocking(|t| t.instances())
            .expect("read")
            .into_iter()
            .map(|i| (i.correlation_id, i.version))
            .collect();
        v.sort();
        v
    }

    #[test]
    fn an_interrupted_pass_is_finished_by_the_next_and_a_failure_stays_behind() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = Store::open(&StorageConfig {
            data_dir: dir.path().to_path_buf(),
            ..StorageConfig::default()
        })
        .expect("store");
        let catalog = crate::manifest::load_str(&[("v1.yaml", V1), ("v2.yaml", V2)])
            .catalog
            .expect("catalog");
        // 250 instances (three batches); d-7 is in a state version 2 does not have.
        for n in 0..250u64 {
            let state = if n == 7 { "odd" } else { "a" };
            put(&store, &format!("d-{n}"), state, 1_000 + n);
        }
        // A pass that stopped part of the way: here, one that touched only the even ones.
        let even = |i: &Instance| {
            i.correlation_id[2..]
                .parse::<u64>()
                .is_ok_and(|n| n % 2 == 0)
        };
        let first = migrate_instances(&store, &catalog, "acme", "doc", 1, false, &even)
            .expect("first pass");
        assert_eq!((first.migrated, first.elsewhere), (125, 125));
        assert_eq!(first.batches, 3);
        // The next full pass migrates exactly the rest, except the one that cannot go.
        let second = migrate_instances(&store, &catalog, "acme", "doc", 1, false, &|_| true)
            .expect("second pass");
        assert_eq!((second.migrated, second.other_versions), (124, 125));
        assert_eq!(second.failed.len(), 1);
        assert_eq!(second.failed[0].correlation_id, "d-7");
        assert!(
            second.failed[0].error.contains("state `odd`"),
            "{:?}",
            second.failed
        );
        let v = versions(&store);
        assert_eq!(v.iter().filter(|(_, ver)| *ver == 2).count(), 249);
        assert_eq!(v.iter().find(|(c, _)| c == "d-7").map(|x| x.1), Some(1));
        // The index follows the new data and versions; a dry run changes nothing.
        let dry =
            migrate_instances(&store, &catalog, "acme", "doc", 1, true, &|_| true).expect("dry");
        assert_eq!((dry.migrated, dry.failed.len(), dry.batches), (0, 1, 0));
    }
}
