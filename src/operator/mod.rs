//! The CLI's operator commands — `inspect`, `instances list`, `dlq`, `migrate`, `tenants` —
//! against a data directory or, with `--admin URL`, a running node's admin API; what they
//! print (a line per item, or JSON with `--output json`).
//!
//! Guarantees: the data directory is opened read-only for every read command, so they work
//! beside a live node; a listing (`instances list`, `dlq list`, `dlq list --stream`) prints
//! one bounded page and the `next` to pass as `--after`, never the whole table; only redrive, purge and migrate open it for writing. Every line the
//! CLI prints goes through [`out`]: a reader that stops early (`| head`) ends the output
//! quietly, never a panic.

use std::io::Write;
use std::sync::atomic::{AtomicBool, Ordering};

use anyhow::Context;

use crate::cli::{
    DlqAction, InstancesAction, OutputFormat, PartitionsAction, StoreArgs, TenantsAction,
};
use crate::config::{self, Overrides};

/// Set once stdout's reader has gone away (EPIPE); nothing more is written.
static STDOUT_GONE: AtomicBool = AtomicBool::new(false);

/// Writes one line to stdout: every line the CLI prints goes through here
/// ([`outln!`](crate::outln)).
///
/// Guarantee: a reader that stops early (`runner instances list … | head`: the write fails
/// with EPIPE) ends the output quietly — the rest is dropped, the command finishes with the
/// exit code it would have had, nothing panics. Any other write error (a full disk) is an
/// error naming stdout.
pub fn out(args: std::fmt::Arguments<'_>) -> std::io::Result<()> {
    if STDOUT_GONE.load(Ordering::Relaxed) {
        return Ok(());
    }
    let mut w = std::io::stdout().lock();
    match writeln!(w, "{args}").and_then(|()| w.flush()) {
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => {
            STDOUT_GONE.store(true, Ordering::Relaxed);
            Ok(())
        }
        Err(e) => Err(std::io::Error::new(
            e.kind(),
            format!("writing to stdout: {e}"),
        )),
        Ok(()) => Ok(()),
    }
}

/// `println!` for the CLI's output, through [`operator::out`](crate::operator::out): a
/// closed pipe ends the output quietly; returns `std::io::Result<()>`.
#[macro_export]
macro_rules! outln {
    ($($arg:tt)*) => {
        $crate::operator::out(format_args!($($arg)*))
    };
}

/// Opens the store the way `runner run` would, for commands that write to it.
fn open_store(args: &StoreArgs) -> anyhow::Result<(crate::config::Config, crate::storage::Store)> {
    open_store_as(args, crate::storage::Store::open)
}

/// Opens an existing store for reading: works beside a live node in any durability mode.
fn open_store_read_only(
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
fn remote(args: &StoreArgs) -> anyhow::Result<Option<crate::admin::client::AdminClient>> {
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
    Ok(Some(crate::admin::client::AdminClient::new(base, token)))
}

/// `runner inspect`: one instance with its timers and recent transitions.
pub fn inspect(
    args: &StoreArgs,
    tenant: &str,
    saga: &str,
    id: &str,
    output: OutputFormat,
) -> anyhow::Result<()> {
    let view = if let Some(api) = remote(args)? {
        use crate::admin::client::enc;
        api.get(&format!(
            "/admin/instance?tenant={}&saga={}&id={}",
            enc(tenant),
            enc(saga),
            enc(id)
        ))?
    } else {
        let (_, store) = open_store_read_only(args)?;
        serde_json::to_value(crate::ops::inspect(&store, tenant, saga, id)?)?
    };
    if output == OutputFormat::Json {
        crate::outln!("{}", serde_json::to_string_pretty(&view)?)?;
        return Ok(());
    }
    let e = |v: &serde_json::Value| match v {
        serde_json::Value::String(s) => crate::telemetry::escape_controls(s).into_owned(),
        other => other.to_string(),
    };
    let i = &view["instance"];
    crate::outln!(
        "{}/{}/{}\tstate {}\tstatus {}\tversion {}\tinputs {}",
        e(&i["tenant"]),
        e(&i["saga"]),
        e(&i["correlation_id"]),
        e(&i["state"]),
        e(&i["status"]),
        i["version"],
        i["applied"]
    )?;
    if let Some(first) = view["parked_by"].as_u64() {
        crate::outln!("parked behind dead letter {first}")?;
    }
    for t in view["timers"].as_array().into_iter().flatten() {
        crate::outln!("timer {}\tdue_ms {}", e(&t["name"]), t["due_ms"])?;
    }
    for h in view["recent_transitions"].as_array().into_iter().flatten() {
        crate::outln!(
            "{}\t{}\t{} -> {}\tat_ms {}\toutputs {}",
            h["n"],
            e(&h["event"]),
            e(&h["from"]),
            e(&h["to"]),
            h["at_ms"],
            h["emitted"]
        )?;
    }
    Ok(())
}

/// Prints one dead letter: JSON, or one `field: value` line each (values escaped).
fn print_letter(v: &serde_json::Value, output: OutputFormat) -> anyhow::Result<()> {
    if output == OutputFormat::Json {
        crate::outln!("{}", serde_json::to_string_pretty(v)?)?;
        return Ok(());
    }
    for (k, val) in v.as_object().into_iter().flatten() {
        let text = match val {
            serde_json::Value::String(s) => crate::telemetry::escape_controls(s).into_owned(),
            other => other.to_string(),
        };
        crate::outln!("{k}: {text}")?;
    }
    Ok(())
}

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

/// `runner instances list`: one page of a tenant's instances of a saga.
pub fn instances(args: &StoreArgs, action: InstancesAction) -> anyhow::Result<()> {
    let InstancesAction::List {
        tenant,
        saga,
        state,
        older_than,
        limit,
        after,
        output,
    } = action;
    let older_than_ms = older_than.map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
    let page: serde_json::Value = match remote(args)? {
        Some(api) => {
            use crate::admin::client::enc;
            let mut q = format!("tenant={}&saga={}&limit={limit}", enc(&tenant), enc(&saga));
            if let Some(s) = &state {
                q += &format!("&state={}", enc(s));
            }
            if let Some(ms) = older_than_ms {
                q += &format!("&older_than={ms}ms");
            }
            if let Some(a) = &after {
                q += &format!("&after={}", enc(a));
            }
            api.get(&format!("/admin/instances?{q}"))?
        }
        None => {
            // With replicas, this store may also keep stale copies of partitions other
            // nodes own now: `--admin URL` lists what that node owns.
            let (_, store) = open_store_read_only(args)?;
            serde_json::to_value(crate::ops::list_instances(
                &store,
                &crate::ops::Listing {
                    tenant: &tenant,
                    saga: &saga,
                    state: state.as_deref(),
                    older_than_ms,
                    after: after.as_deref(),
                    limit,
                },
                &|_| true,
            )?)?
        }
    };
    if output == OutputFormat::Json {
        crate::outln!("{}", serde_json::to_string_pretty(&page)?)?;
        return Ok(());
    }
    let e = |v: &serde_json::Value| -> String {
        let text = match v {
            serde_json::Value::String(s) => s.clone(),
            other => other.to_string(),
        };
        crate::telemetry::escape_controls(&text).into_owned()
    };
    for i in page["items"].as_array().into_iter().flatten() {
        crate::outln!(
            "{}\t{}\t{}\tv{}\tstarted {}\tupdated {}\t{} inputs",
            e(&i["correlation_id"]),
            e(&i["state"]),
            e(&i["status"]),
            i["version"],
            i["started_ms"],
            i["updated_ms"],
            i["inputs_applied"]
        )?;
    }
    if let Some(next) = page["next"].as_str() {
        crate::outln!("next: {next}")?;
    }
    Ok(())
}

/// `runner dlq` against a running node's admin API.
fn ops_dlq_remote(
    api: &crate::admin::client::AdminClient,
    action: DlqAction,
) -> anyhow::Result<()> {
    use crate::admin::client::enc;
    match action {
        DlqAction::List {
            tenant,
            stream: true,
            limit,
            after,
            output,
            ..
        } => {
            let mut q = format!("limit={limit}");
            if let Some(t) = &tenant {
                q += &format!("&tenant={}", enc(t));
            }
            if let Some(a) = &after {
                q += &format!("&after={}", enc(a));
            }
            let v = api.get(&format!("/admin/dlq/stream?{q}"))?;
            if output == OutputFormat::Json {
                crate::outln!("{}", serde_json::to_string_pretty(&v)?)?;
                return Ok(());
            }
            let e = |v: &serde_json::Value| {
                crate::telemetry::escape_controls(v.as_str().unwrap_or("-")).into_owned()
            };
            let items = v["items"].as_array().cloned().unwrap_or_default();
            for i in &items {
                let l = &i["letter"];
                crate::outln!(
                    "{}\t{}\t{}\t{}\t{}",
                    i["seq"],
                    e(&l["tenant_id"]),
                    e(&l["kind"]),
                    e(&l["subject"]),
                    e(&l["reason"])
                )?;
            }
            crate::outln!("{} dead letter(s) on stream {}", items.len(), v["stream"])?;
            print_next(&v)?;
        }
        DlqAction::List {
            tenant,
            all,
            limit,
            after,
            output,
            ..
        } => {
            let mut q = format!("limit={limit}&all={all}");
            if let Some(t) = &tenant {
                q += &format!("&tenant={}", enc(t));
            }
            if let Some(a) = &after {
                q += &format!("&after={}", enc(a));
            }
            let v = api.get(&format!("/admin/dlq?{q}"))?;
            let page: crate::deadletter::Page = serde_json::from_value(v)?;
            print_letters(&page, output)?;
        }
        DlqAction::Show { tenant, id, output } => {
            let v = api.get(&format!("/admin/dlq/{}/{id}", enc(&tenant)))?;
            print_letter(&v, output)?;
        }
        DlqAction::Redrive { tenant, id, stream } => {
            let path = if stream {
                format!("/admin/dlq/stream/{}/{id}/redrive", enc(&tenant))
            } else {
                format!("/admin/dlq/{}/{id}/redrive", enc(&tenant))
            };
            let v = api.post(&path, &serde_json::json!({}))?;
            crate::outln!("{}", serde_json::to_string_pretty(&v)?)?;
        }
        DlqAction::Purge { .. } => {
            anyhow::bail!("dlq purge works on a data directory (--data-dir), not through --admin")
        }
    }
    Ok(())
}

/// Prints a page of dead letters one line each (values escaped: they may come from
/// inputs), a count, and `next: …` when more follow; or the page as one JSON document.
fn print_letters(page: &crate::deadletter::Page, output: OutputFormat) -> anyhow::Result<()> {
    if output == OutputFormat::Json {
        crate::outln!("{}", serde_json::to_string_pretty(page)?)?;
        return Ok(());
    }
    let e = crate::telemetry::escape_controls;
    for d in page.items.iter().map(|l| &l.letter) {
        crate::outln!(
            "{}\t{}\t{}\t{:?}\t{}\t{}/{}\t{}",
            d.id,
            e(&d.tenant),
            e(&d.kind),
            d.status,
            e(&d.source),
            e(d.saga.as_deref().unwrap_or("-")),
            e(d.correlation_id.as_deref().unwrap_or("-")),
            e(&d.reason)
        )?;
    }
    crate::outln!("{} dead letter(s)", page.items.len())?;
    print_next(&serde_json::to_value(page)?)
}

/// The end of a printed page: `next: …` when more follow, and why the page is short when it
/// stopped before its `limit` (its answer's byte cap, or its scan bound).
fn print_next(page: &serde_json::Value) -> anyhow::Result<()> {
    if let Some(next) = page["next"].as_str() {
        if let Some(why) = page["stopped_at"].as_str() {
            crate::outln!(
                "page stopped at its {}; more may follow",
                crate::telemetry::escape_controls(why)
            )?;
        }
        crate::outln!("next: {}", crate::telemetry::escape_controls(next))?;
    }
    Ok(())
}

/// `runner dlq redrive` without `--admin`: refused, naming why. A redrive writes state and
/// outputs into a partition: only its owner does that, in the partition's log and under its
/// fences. An effect command's letter is never a saga input: that is said, as a node would.
fn redrive_here(args: &StoreArgs, tenant: &str, id: u64) -> anyhow::Result<()> {
    if let Ok((_, store)) = open_store_read_only(args)
        && let Ok(letter) = crate::deadletter::show(&store, tenant, id)
        && crate::deadletter::is_effect_command(&letter)
    {
        return Err(crate::deadletter::DeadLetterError::EffectCommand(id).into());
    }
    anyhow::bail!(
        "a dead letter is redriven by its partition's owner: run this with --admin URL of that \
         node (the letter stays pending)"
    )
}

/// `runner dlq`: dead letters listed, shown, redriven, purged.
pub fn dlq(args: &StoreArgs, action: DlqAction) -> anyhow::Result<()> {
    if let Some(api) = remote(args)? {
        return ops_dlq_remote(&api, action);
    }
    if matches!(
        action,
        DlqAction::List { stream: true, .. } | DlqAction::Redrive { stream: true, .. }
    ) {
        anyhow::bail!("the dead-letter stream is read through a running node: add --admin URL");
    }
    if let DlqAction::Redrive { tenant, id, .. } = &action {
        return redrive_here(args, tenant, *id);
    }
    let (_, store) = if matches!(action, DlqAction::Purge { .. }) {
        open_store(args)?
    } else {
        open_store_read_only(args)?
    };
    match action {
        DlqAction::List { stream: true, .. } => {
            anyhow::bail!("the dead-letter stream is read through a running node: add --admin URL");
        }
        DlqAction::List {
            tenant,
            all,
            limit,
            after,
            output,
            ..
        } => {
            let page = crate::deadletter::page(
                &store,
                &crate::deadletter::Listing {
                    tenant: tenant.as_deref(),
                    all,
                    after: after.as_deref(),
                    limit,
                },
            )?;
            print_letters(&page, output)?;
        }
        DlqAction::Show { tenant, id, output } => {
            let letter = crate::deadletter::show(&store, &tenant, id)?;
            print_letter(&serde_json::to_value(letter)?, output)?;
        }
        DlqAction::Purge {
            tenant,
            older_than,
            kind,
            force,
            dry_run,
        } => {
            let older_than = older_than
                .map(|d| {
                    d.parse::<crate::config::HumanDuration>()
                        .map_err(|e| anyhow::anyhow!("--older-than {d:?}: {e}"))
                })
                .transpose()?;
            let p = crate::deadletter::Purge {
                tenant,
                before_ms: older_than
                    .map(|d| crate::clock::now_ms().saturating_sub(d.get().as_millis() as u64)),
                kind,
                force,
                dry_run,
            };
            let gone = crate::deadletter::purge(&store, &p)?;
            let e = crate::telemetry::escape_controls;
            for d in &gone {
                crate::outln!(
                    "{}\t{}\t{}\t{:?}\t{}",
                    d.id,
                    e(&d.tenant),
                    d.kind,
                    d.status,
                    e(&d.source)
                )?;
            }
            let verb = if dry_run {
                "would be removed"
            } else {
                "removed"
            };
            crate::outln!("{} dead letter(s) {verb}", gone.len())?;
        }
        DlqAction::Redrive { tenant, id, .. } => redrive_here(args, &tenant, id)?,
    }
    Ok(())
}

/// `runner tenants`: pause, resume, list — through a running saga node only (the pause is
/// shared by every node through NATS, and a resume releases inside the node's commits).
pub fn tenants(args: &StoreArgs, action: TenantsAction) -> anyhow::Result<()> {
    use crate::admin::client::enc;
    let Some(api) = remote(args)? else {
        anyhow::bail!(
            "tenants are paused and resumed through a running saga node: add --admin URL"
        );
    };
    match action {
        TenantsAction::Pause { tenant } => {
            let v = api.post(
                &format!("/admin/tenants/{}/pause", enc(&tenant)),
                &serde_json::json!({}),
            )?;
            crate::outln!("{}", serde_json::to_string_pretty(&v)?)?;
        }
        TenantsAction::Resume { tenant } => {
            let v = api.post(
                &format!("/admin/tenants/{}/resume", enc(&tenant)),
                &serde_json::json!({}),
            )?;
            crate::outln!("{}", serde_json::to_string_pretty(&v)?)?;
        }
        TenantsAction::List { output } => {
            let v = api.get("/admin/tenants/paused")?;
            if output == OutputFormat::Json {
                crate::outln!("{}", serde_json::to_string_pretty(&v)?)?;
            } else {
                let paused = v["paused"].as_array().cloned().unwrap_or_default();
                for t in &paused {
                    crate::outln!(
                        "{}",
                        crate::telemetry::escape_controls(t.as_str().unwrap_or("-"))
                    )?;
                }
                crate::outln!("{} tenant(s) paused", paused.len())?;
            }
        }
    }
    Ok(())
}

/// `runner partitions replay`: asks the owner of a partition to read its inbox again.
pub fn partitions(args: &StoreArgs, action: PartitionsAction) -> anyhow::Result<()> {
    let Some(api) = remote(args)? else {
        anyhow::bail!("a partition is replayed by the node that owns it: add --admin URL");
    };
    match action {
        PartitionsAction::Replay {
            partition,
            from,
            confirm,
        } => {
            let body = serde_json::json!({ "from": from, "confirm": confirm });
            match api.post(&format!("/admin/partitions/{partition}/replay"), &body) {
                Ok(v) => crate::outln!("{}", serde_json::to_string_pretty(&v)?)?,
                Err(crate::admin::client::ClientError::Refused {
                    status: 400,
                    message,
                }) if !confirm => {
                    crate::outln!("{message}")?;
                    anyhow::bail!("nothing done: add --confirm to replay");
                }
                Err(e) => return Err(e.into()),
            }
        }
    }
    Ok(())
}
