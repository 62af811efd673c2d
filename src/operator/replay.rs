//! `runner replay`: the CLI side of [`crate::ops::replay`] — loads both sets of manifests
//! (refusing invalid ones as `runner validate` would), opens the store read only, reads the
//! recorded inputs back from JetStream, and prints one line per instance the new manifests
//! would take elsewhere (or JSON). Exits 1 when any would, so it can gate a deploy.

use std::path::PathBuf;

use anyhow::{Context, anyhow};

use super::store::open_store_read_only;
use crate::cli::{OutputFormat, StoreArgs};
use crate::manifest::Catalog;
use crate::ops::replay::{self, Inputs, Selection};

/// What `runner replay` was given.
pub struct ReplayArgs<'a> {
    /// The store (`--data-dir` or `--config`).
    pub store: &'a StoreArgs,
    /// The manifests in force now.
    pub current: &'a [PathBuf],
    /// The changed manifests.
    pub new: &'a [PathBuf],
    /// Where the recorded inputs' streams are.
    pub nats_url: &'a str,
    /// Which instances.
    pub pick: Selection,
    /// Text or JSON.
    pub output: OutputFormat,
}

/// Runs the replay; `Ok(true)` when some instance would decide differently.
pub fn replay(args: ReplayArgs<'_>) -> anyhow::Result<bool> {
    let current = catalog(args.current, "--current")?;
    let new = catalog(args.new, "--manifest")?;
    let (_, store) = open_store_read_only(args.store)?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let client = rt
        .block_on(async_nats::connect(args.nats_url))
        .with_context(|| format!("connecting to {}", crate::config::redact_url(args.nats_url)))?;
    // The JetStream context starts a task of its own: build it inside the runtime.
    let js = rt.block_on(async { async_nats::jetstream::new(client) });
    let mut inputs = FromJetStream { rt: &rt, js };
    let report = replay::replay(&store, &mut inputs, &current, &new, &args.pick)?;
    if args.output == OutputFormat::Json {
        crate::outln!("{}", serde_json::to_string_pretty(&report)?)?;
    } else {
        for d in &report.diverged {
            crate::outln!(
                "differs {}/{}/{} at step {} ({}, from {}): {}",
                d.tenant,
                d.saga,
                d.correlation_id,
                d.step,
                d.event,
                d.source,
                d.what
            )?;
        }
        for d in &report.not_reproduced {
            crate::outln!(
                "not reproduced {}/{}/{} at step {} ({}): {}",
                d.tenant,
                d.saga,
                d.correlation_id,
                d.step,
                d.event,
                d.what
            )?;
        }
        for (key, why) in &report.skipped {
            crate::outln!("skipped {key}: {why}")?;
        }
        crate::outln!(
            "{} instance(s) replayed: {} would decide differently; {} not reproduced by the current manifests; {} skipped",
            report.replayed,
            report.diverged.len(),
            report.not_reproduced.len(),
            report.skipped.len()
        )?;
    }
    Ok(!report.diverged.is_empty() || !report.not_reproduced.is_empty())
}

fn catalog(paths: &[PathBuf], flag: &str) -> anyhow::Result<Catalog> {
    let report = crate::manifest::load(paths);
    for d in &report.diagnostics {
        eprintln!("{d}");
    }
    report
        .catalog
        .ok_or_else(|| anyhow!("the manifests given with {flag} are invalid"))
}

/// Recorded inputs read back by stream sequence.
struct FromJetStream<'a> {
    rt: &'a tokio::runtime::Runtime,
    js: async_nats::jetstream::Context,
}

impl Inputs for FromJetStream<'_> {
    fn message(&mut self, stream: &str, seq: u64) -> Result<(String, Vec<u8>, u64), String> {
        self.rt.block_on(async {
            let s = self
                .js
                .get_stream(stream)
                .await
                .map_err(|e| e.to_string())?;
            let m = s
                .get_raw_message(seq)
                .await
                .map_err(|e| format!("gone from the stream ({e})"))?;
            let ms = u64::try_from(m.time.unix_timestamp_nanos() / 1_000_000).unwrap_or(0);
            // An input written straight into the inbox (an effect result) names its
            // tenant subject in a header, as the worker reads it.
            let subject = m
                .headers
                .get(crate::broker::headers::ROUTED_SUBJECT)
                .map_or_else(|| m.subject.to_string(), |v| v.as_str().to_string());
            Ok((subject, m.payload.to_vec(), ms))
        })
    }
}
