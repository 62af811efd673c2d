//! The `runner` binary: parse the CLI, set up logging, load config, dispatch.
use std::process::ExitCode;

use anyhow::Context;
use clap::Parser;
use runner::app::{self, Exit};
use runner::cli::{Cli, Command, DlqAction, InstancesAction, OutputFormat, RunArgs, StoreArgs};
use runner::config::{self, Overrides};

/// mimalloc: the per-input work allocates many small, short-lived buffers (JSON values,
/// keys); glibc malloc showed up as a sixth of the saga worker's profile.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    let cli = Cli::parse();
    runner::effect::provider::check_settings_on_load();
    match cli.command {
        Command::Validate { paths, data_dir } => validate(&paths, data_dir.as_deref()),
        Command::Test { paths } => run_tests(&paths),
        Command::Inspect {
            store,
            tenant,
            saga,
            id,
        } => report(ops_inspect(&store, &tenant, &saga, &id)),
        Command::Dlq { store, action } => report(ops_dlq(&store, action)),
        Command::Instances { store, action } => report(ops_instances(&store, action)),
        Command::Migrate {
            store,
            tenant,
            saga,
            from,
            dry_run,
        } => report(ops_migrate(&store, &tenant, &saga, from, dry_run)),
        Command::Run(args) => {
            runner::telemetry::init_logging(cli.log_format);
            match run(args) {
                Ok(Exit::Drained) => ExitCode::SUCCESS,
                Ok(Exit::DrainTimedOut) => ExitCode::FAILURE,
                Err(e) => {
                    // One line an operator can act on; the cause chain is joined into it.
                    eprintln!("runner: {e:#}");
                    ExitCode::FAILURE
                }
            }
        }
    }
}

fn run(args: RunArgs) -> anyhow::Result<Exit> {
    let overrides = Overrides {
        mode: args.mode,
        manifests: args.manifests,
        nats_urls: args.nats_urls,
        admin_addr: args.admin_addr,
        data_dir: args.data_dir,
    };
    let config = config::load(args.config.as_deref(), std::env::vars(), &overrides)?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("runner")
        .build()
        .context("starting the async runtime")?;
    rt.block_on(async move {
        let lifecycle = std::sync::Arc::new(runner::runtime::Lifecycle::new());
        runner::shutdown::install(lifecycle.clone()).context("installing signal handlers")?;
        Ok(Box::pin(app::run(config, lifecycle)).await?)
    })
}

/// Prints an operator command's error as one line; exit 1.
fn report(r: anyhow::Result<()>) -> ExitCode {
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("runner: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// Opens the store the way `runner run` would, for commands that write to it.
fn open_store(
    args: &StoreArgs,
) -> anyhow::Result<(runner::config::Config, runner::storage::Store)> {
    open_store_as(args, runner::storage::Store::open)
}

/// Opens an existing store for reading: works beside a live node in any durability mode.
fn open_store_read_only(
    args: &StoreArgs,
) -> anyhow::Result<(runner::config::Config, runner::storage::Store)> {
    open_store_as(args, runner::storage::Store::open_read_only)
}

fn open_store_as(
    args: &StoreArgs,
    open: fn(&runner::config::StorageConfig) -> runner::storage::Result<runner::storage::Store>,
) -> anyhow::Result<(runner::config::Config, runner::storage::Store)> {
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
fn remote(args: &StoreArgs) -> anyhow::Result<Option<runner::admin::client::AdminClient>> {
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
    Ok(Some(runner::admin::client::AdminClient::new(base, token)))
}

fn ops_inspect(args: &StoreArgs, tenant: &str, saga: &str, id: &str) -> anyhow::Result<()> {
    if let Some(api) = remote(args)? {
        use runner::admin::client::enc;
        let v = api.get(&format!(
            "/admin/instance?tenant={}&saga={}&id={}",
            enc(tenant),
            enc(saga),
            enc(id)
        ))?;
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    let (_, store) = open_store_read_only(args)?;
    let view = runner::ops::inspect(&store, tenant, saga, id)?;
    println!("{}", serde_json::to_string_pretty(&view)?);
    Ok(())
}

fn ops_migrate(
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
        println!("{}", serde_json::to_string_pretty(&r)?);
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
    if config.partitions.enabled {
        // This store may hold stale copies of partitions other replicas own; only the node
        // knows which it holds.
        anyhow::bail!(
            "in partitioned mode, migrate through each node's admin API (POST /admin/migrate),              which migrates the instances of the partitions that node owns"
        );
    }
    let report = runner::manifest::load(&config.runner.manifests);
    let Some(catalog) = report.catalog else {
        let errs: Vec<String> = report.errors().map(|d| d.to_string()).collect();
        anyhow::bail!("manifests are invalid:\n{}", errs.join("\n"));
    };
    let r = runner::ops::migrate::migrate_instances(
        &store,
        &catalog,
        tenant,
        saga,
        from,
        dry_run,
        &|_| true,
    )?;
    println!("{}", serde_json::to_string_pretty(&r)?);
    if !r.failed.is_empty() {
        anyhow::bail!(
            "{} instance(s) could not be migrated and stay on version {from}",
            r.failed.len()
        );
    }
    Ok(())
}

fn ops_instances(args: &StoreArgs, action: InstancesAction) -> anyhow::Result<()> {
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
            use runner::admin::client::enc;
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
            let (config, store) = open_store_read_only(args)?;
            if config.partitions.enabled {
                eprintln!(
                    "runner: partitioned mode: this store may keep stale copies of partitions \
                     other nodes own; --admin URL lists what that node owns"
                );
            }
            serde_json::to_value(runner::ops::list_instances(
                &store,
                &runner::ops::Listing {
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
        println!("{}", serde_json::to_string_pretty(&page)?);
        return Ok(());
    }
    let e = |v: &serde_json::Value| -> String {
        let text = match v {
            serde_json::Value::String(s) => s.clone(),
            other => other.to_string(),
        };
        runner::telemetry::escape_controls(&text).into_owned()
    };
    for i in page["items"].as_array().into_iter().flatten() {
        println!(
            "{}\t{}\t{}\tv{}\tstarted {}\tupdated {}\t{} inputs",
            e(&i["correlation_id"]),
            e(&i["state"]),
            e(&i["status"]),
            i["version"],
            i["started_ms"],
            i["updated_ms"],
            i["inputs_applied"]
        );
    }
    if let Some(next) = page["next"].as_str() {
        println!("next: {next}");
    }
    Ok(())
}

/// `runner dlq` against a running node's admin API.
fn ops_dlq_remote(
    api: &runner::admin::client::AdminClient,
    action: DlqAction,
) -> anyhow::Result<()> {
    use runner::admin::client::enc;
    match action {
        DlqAction::List {
            tenant,
            stream: true,
            output,
            ..
        } => {
            let mut q = "limit=1000".to_string();
            if let Some(t) = &tenant {
                q += &format!("&tenant={}", enc(t));
            }
            let v = api.get(&format!("/admin/dlq/stream?{q}"))?;
            if output == OutputFormat::Json {
                println!("{}", serde_json::to_string_pretty(&v)?);
                return Ok(());
            }
            let e = |v: &serde_json::Value| {
                runner::telemetry::escape_controls(v.as_str().unwrap_or("-")).into_owned()
            };
            let items = v["items"].as_array().cloned().unwrap_or_default();
            for i in &items {
                let l = &i["letter"];
                println!(
                    "{}\t{}\t{}\t{}\t{}",
                    i["seq"],
                    e(&l["tenant_id"]),
                    e(&l["kind"]),
                    e(&l["subject"]),
                    e(&l["reason"])
                );
            }
            println!("{} dead letter(s) on stream {}", items.len(), v["stream"]);
        }
        DlqAction::List {
            tenant,
            all,
            output,
            ..
        } => {
            let mut q = format!("limit=1000&all={all}");
            if let Some(t) = &tenant {
                q += &format!("&tenant={}", enc(t));
            }
            let v = api.get(&format!("/admin/dlq?{q}"))?;
            let items: Vec<runner::storage::tables::DeadLetter> =
                serde_json::from_value(v["items"].clone())?;
            print_letters(&items, output)?;
        }
        DlqAction::Show { tenant, id } => {
            let v = api.get(&format!("/admin/dlq/{}/{id}", enc(&tenant)))?;
            println!("{}", serde_json::to_string_pretty(&v)?);
        }
        DlqAction::Redrive { tenant, id } => {
            let v = api.post(
                &format!("/admin/dlq/{}/{id}/redrive", enc(&tenant)),
                &serde_json::json!({}),
            )?;
            println!("{}", serde_json::to_string_pretty(&v)?);
        }
        DlqAction::Purge { .. } => {
            anyhow::bail!("dlq purge works on a data directory (--data-dir), not through --admin")
        }
    }
    Ok(())
}

/// Prints dead letters one line each (values escaped: they may come from inputs), or as
/// one JSON document.
fn print_letters(
    items: &[runner::storage::tables::DeadLetter],
    output: OutputFormat,
) -> anyhow::Result<()> {
    if output == OutputFormat::Json {
        println!("{}", serde_json::to_string_pretty(items)?);
        return Ok(());
    }
    let e = runner::telemetry::escape_controls;
    for d in items {
        println!(
            "{}\t{}\t{}\t{:?}\t{}\t{}/{}\t{}",
            d.id,
            e(&d.tenant),
            d.kind,
            d.status,
            e(&d.source),
            e(d.saga.as_deref().unwrap_or("-")),
            e(d.correlation_id.as_deref().unwrap_or("-")),
            e(&d.reason)
        );
    }
    println!("{} dead letter(s)", items.len());
    Ok(())
}

fn ops_dlq(args: &StoreArgs, action: DlqAction) -> anyhow::Result<()> {
    if let Some(api) = remote(args)? {
        return ops_dlq_remote(&api, action);
    }
    if matches!(action, DlqAction::List { stream: true, .. }) {
        anyhow::bail!("the dead-letter stream is read through a running node: add --admin URL");
    }
    let (config, store) = if matches!(action, DlqAction::Redrive { .. } | DlqAction::Purge { .. }) {
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
            output,
            ..
        } => {
            let items = runner::deadletter::list(&store, tenant.as_deref(), all)?;
            print_letters(&items, output)?;
        }
        DlqAction::Show { tenant, id } => {
            println!(
                "{}",
                serde_json::to_string_pretty(&runner::deadletter::show(&store, &tenant, id)?)?
            );
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
                    d.parse::<runner::config::HumanDuration>()
                        .map_err(|e| anyhow::anyhow!("--older-than {d:?}: {e}"))
                })
                .transpose()?;
            let p = runner::deadletter::Purge {
                tenant,
                before_ms: older_than
                    .map(|d| runner::clock::now_ms().saturating_sub(d.get().as_millis() as u64)),
                kind,
                force,
                dry_run,
            };
            let gone = runner::deadletter::purge(&store, &p)?;
            let e = runner::telemetry::escape_controls;
            for d in &gone {
                println!(
                    "{}\t{}\t{}\t{:?}\t{}",
                    d.id,
                    e(&d.tenant),
                    d.kind,
                    d.status,
                    e(&d.source)
                );
            }
            let verb = if dry_run {
                "would be removed"
            } else {
                "removed"
            };
            println!("{} dead letter(s) {verb}", gone.len());
        }
        DlqAction::Redrive { tenant, id } => {
            if config.partitions.enabled {
                // A redrive writes state and outputs into this store's copy of a partition
                // that another replica may own, outside its log and its fences.
                anyhow::bail!(
                    "dlq redrive is not available in partitioned mode (partitions.enabled) yet: \
                     the dead letter stays pending; list and show still work"
                );
            }
            let report = runner::manifest::load(&config.runner.manifests);
            let Some(catalog) = report.catalog else {
                let errs: Vec<String> = report.errors().map(|d| d.to_string()).collect();
                anyhow::bail!("manifests are invalid:\n{}", errs.join("\n"));
            };
            let limits = runner::worker::process::Limits::from_config(&config);
            let r = runner::ops::redrive(&store, &catalog, &limits, &tenant, id)?;
            println!("{}", serde_json::to_string_pretty(&r)?);
        }
    }
    Ok(())
}

fn validate(paths: &[std::path::PathBuf], data_dir: Option<&std::path::Path>) -> ExitCode {
    let mut report = runner::manifest::load(paths);
    if let (Some(dir), Some(catalog)) = (data_dir, &report.catalog) {
        let cfg = runner::config::StorageConfig {
            data_dir: dir.to_path_buf(),
            ..Default::default()
        };
        let stranded = runner::storage::Store::open(&cfg)
            .and_then(|store| store.read_blocking(|t| t.running_versions()))
            .map(|in_use| {
                catalog
                    .stranded(&in_use)
                    .iter()
                    .map(|s| s.to_diagnostic())
                    .collect::<Vec<_>>()
            });
        match stranded {
            Ok(found) if found.is_empty() => {}
            Ok(found) => {
                report.diagnostics.extend(found);
                report.catalog = None;
            }
            Err(e) => {
                eprintln!("runner: cannot read the store in {}: {e}", dir.display());
                return ExitCode::FAILURE;
            }
        }
    }
    for d in &report.diagnostics {
        eprintln!("{d}");
    }
    let errors = report.errors().count();
    let warnings = report.diagnostics.len() - errors;
    match &report.catalog {
        Some(c) => {
            let s = c.summary();
            println!(
                "ok: {} file(s), {} saga version(s), {} effect(s), {warnings} warning(s)",
                s.files.len(),
                s.sagas.len(),
                s.effects.len()
            );
            ExitCode::SUCCESS
        }
        None => {
            eprintln!("{errors} error(s), {warnings} warning(s)");
            ExitCode::FAILURE
        }
    }
}

/// `runner test`: load the manifests, run every `*.tests.yaml` found under the paths.
fn run_tests(paths: &[std::path::PathBuf]) -> ExitCode {
    use runner::manifest::{collect_files, is_test_file, with_manifests_beside};
    use runner::saga::scenario;
    let report = runner::manifest::load(&with_manifests_beside(paths));
    for d in &report.diagnostics {
        eprintln!("{d}");
    }
    let Some(catalog) = report.catalog else {
        eprintln!("manifests have errors; no test was run");
        return ExitCode::FAILURE;
    };
    if catalog.summary().sagas.is_empty() {
        let given: Vec<String> = paths.iter().map(|p| p.display().to_string()).collect();
        eprintln!(
            "no manifest was loaded: no saga is declared under {} (give the manifest too, or \
             the directory holding it and its tests, e.g. `runner test manifests/`; a tests \
             file finds `<name>.yaml` beside it by itself); no test was run",
            given.join(", ")
        );
        return ExitCode::FAILURE;
    }
    let files = match collect_files(paths) {
        Ok(f) => f,
        Err(d) => {
            eprintln!("{d}");
            return ExitCode::FAILURE;
        }
    };
    let (mut passed, mut failed) = (0usize, 0usize);
    for file in files.iter().filter(|f| is_test_file(f)) {
        let parsed = std::fs::read_to_string(file)
            .map_err(|e| format!("{}:0:0: error: cannot read: {e}", file.display()))
            .and_then(|text| scenario::parse(file, &text).map_err(|d| d.to_string()));
        let parsed = match parsed {
            Ok(p) => p,
            Err(msg) => {
                eprintln!("{msg}");
                failed += 1;
                continue;
            }
        };
        for r in scenario::run_file(&catalog, file, &parsed) {
            if r.passed() {
                passed += 1;
                println!("ok     {}:{}: {}", r.file, r.line, r.name);
            } else {
                failed += 1;
                println!("FAILED {}:{}: {}", r.file, r.line, r.name);
                for f in &r.failures {
                    println!("    {f}");
                }
            }
        }
    }
    println!("{passed} passed, {failed} failed");
    if failed == 0 && passed > 0 {
        ExitCode::SUCCESS
    } else {
        if passed == 0 && failed == 0 {
            eprintln!("no test found (test files are named *.tests.yaml)");
        }
        ExitCode::FAILURE
    }
}
