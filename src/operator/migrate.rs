//! `runner migrate`: moves a saga's instances to the next version through the node that
//! owns them; against a data directory only as a dry run, which reads this store's copy.

use super::store::{open_store, open_store_read_only, remote};
use crate::cli::StoreArgs;

/// `runner migrate`: moves a saga's instances from version `from` to the next.
pub fn migrate(
    args: &StoreArgs,
    tenant: &str,
    saga: &str,
    from: u32,
    dry_run: bool,
) -> anyhow::Result<()> {
    if let Some(api) = remote(args)? {
        let r = api.post(
            "/admin/migrate",
            &serde_json::json!({ "tenant": tenant, "saga": saga, "from": from, "dry_run": dry_run }),
        )?;
        crate::outln!("{}", serde_json::to_string_pretty(&r)?)?;
        let failed = r["failed"].as_array().map_or(0, Vec::len);
        if failed > 0 {
            anyhow::bail!("{failed} instance(s) could not be migrated and stay on version {from}");
        }
        return Ok(());
    }
    let (config, store) = if dry_run {
        open_store_read_only(args)?
    } else {
        open_store(args)?
    };
    if !dry_run {
        // This store may hold stale copies of partitions other replicas own, and a
        // migration written here would bypass the partitions' logs: only the owner migrates.
        anyhow::bail!(
            "migrate through each node's admin API (--admin URL, or POST /admin/migrate), \
             which migrates the instances of the partitions that node owns; --dry-run reads \
             this store's copy"
        );
    }
    let report = crate::manifest::load(&config.runner.manifests);
    let Some(catalog) = report.catalog else {
        let errs: Vec<String> = report.errors().map(|d| d.to_string()).collect();
        anyhow::bail!("manifests are invalid:\n{}", errs.join("\n"));
    };
    let r = crate::ops::migrate::migrate_instances(
        &store,
        &catalog,
        tenant,
        saga,
        from,
        dry_run,
        &|_| true,
    )?;
    crate::outln!("{}", serde_json::to_string_pretty(&r)?)?;
    if !r.failed.is_empty() {
        anyhow::bail!(
            "{} instance(s) could not be migrated and stay on version {from}",
            r.failed.len()
        );
    }
    Ok(())
}
