//! Explicit migration of an instance from saga version N to N+1.
//!
//! An instance never changes version by itself (DESIGN §4): operators migrate, and only when
//! version N+1 is loaded and declares `migration: { from: N, ... }`. The function is pure:
//! the caller stores the result in the same transaction that reads the old instance.

use serde_json::json;

use super::emitter::saga_json;
use super::types::Instance;
use crate::expr::{ExprError, Vars};
use crate::manifest::Catalog;
use crate::manifest::catalog::SagaKind;

/// Why an instance could not be migrated.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum MigrateError {
    /// Version N+1 is not loaded, or declares no migration from N.
    #[error("saga `{saga}` has no loaded version {to} with a migration from {from}")]
    NoMigration {
        /// Saga.
        saga: String,
        /// Instance version.
        from: u32,
        /// The version that would be needed.
        to: u32,
    },
    /// The instance's state, after renaming, does not exist in the new version.
    #[error("state `{0}` does not exist in the new version")]
    UnknownState(String),
    /// The data expression failed.
    #[error("migration data: {0}")]
    Data(ExprError),
}

/// Migrates `instance` one version up. The state data is replaced by the migration's `data`
/// expression (over the old `state` and `saga`; `event` is `{}`), the state renamed by its
/// map; timers, status and the rest are kept.
pub fn migrate(catalog: &Catalog, instance: &Instance) -> Result<Instance, MigrateError> {
    let to = instance.version.saturating_add(1);
    let no = || MigrateError::NoMigration {
        saga: instance.saga.clone(),
        from: instance.version,
        to,
    };
    let target = catalog.saga(&instance.saga, to).ok_or_else(no)?;
    let m = target
        .migration
        .as_ref()
        .filter(|m| m.from == instance.version)
        .ok_or_else(no)?;
    let mut out = instance.clone();
    if let Some(e) = &m.data {
        let event = json!({});
        let sj = saga_json(
            &instance.saga,
            &instance.tenant,
            &instance.correlation_id,
            instance.version,
            &instance.state,
        );
        let vars = Vars::pruned(&event, &[], &instance.data, &sj, e.needs());
        out.data = e.eval(&vars).map_err(MigrateError::Data)?;
    }
    if let Some(new) = m.states.get(&instance.state) {
        out.state = new.clone();
    }
    if let SagaKind::Machine(machine) = &target.kind
        && !machine.states.contains_key(&out.state)
    {
        return Err(MigrateError::UnknownState(out.state));
    }
    out.version = to;
    Ok(out)
}
