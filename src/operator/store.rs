//! Where an operator command works: the data directory, opened read-only for reads (so it
//! works beside a live node) or for writing, or a running node's admin API with `--admin`.

use anyhow::Context;

use crate::cli::StoreArgs;
use crate::config::{self, Overrides};

/// Opens the store the way `runner run` would, for commands that write to it.
pub(super) fn open_store(
    args: &StoreArgs,
) -> anyhow::Result<(crate::config::Config, crate::storage::Store)> {
    open_store_as(args, crate::storage::Store::open)
}

/// Opens an existing store for reading: works beside a live node in any durability mode.
pub(super) fn open_store_read_only(
    args: &StoreArgs,
) -> anyhow::Result<(crate::config::Config, crate::storage::Store)> {
    open_store_as(args, crate::storage::Store::open_read_only)
}

fn open_store_as(
    args: &StoreArgs,
    open: fn(&crate::config::StorageConfig) -> crate::storage::Result<crate::storage::Store>,
) -> anyhow::Result<(crate::config::Config, crate::storage::Store)> {
    let overrides = Overrides {
        manifests: args.manifests.clone(),
        data_dir: args.data_dir.clone(),
        ..Overrides::default()
    };
    let config = config::load(args.config.as_deref(), std::env::vars(), &overrides)?;
    let store = open(&config.storage)
        .with_context(|| format!("opening the store in {}", config.storage.data_dir.display()))?;
    Ok((config, store))
}

/// The admin API client when `--admin` is given.
pub(super) fn remote(
    args: &StoreArgs,
) -> anyhow::Result<Option<crate::admin::client::AdminClient>> {
    let Some(base) = &args.admin else {
        return Ok(None);
    };
    let token = match &args.admin_token_file {
        Some(p) => Some(
            std::fs::read_to_string(p)
                .with_context(|| format!("reading the admin token file {}", p.display()))?
                .trim()
                .to_string(),
        ),
        None => std::env::var("RUNNER_ADMIN_TOKEN").ok(),
    };
    let ca = match &args.admin_ca_file {
        Some(p) => Some(
            std::fs::read(p)
                .with_context(|| format!("reading the admin CA file {}", p.display()))?,
        ),
        None => None,
    };
    let client = crate::admin::client::AdminClient::new(base, token);
    Ok(Some(match ca {
        Some(pem) => client.trusting(&pem).map_err(|e| {
            let file = args.admin_ca_file.as_ref().map(|p| p.display().to_string());
            anyhow::anyhow!("admin CA file {}: {e}", file.unwrap_or_default())
        })?,
        None => client,
    }))
}
