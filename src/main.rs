//! The `runner` binary: parse the CLI, set up logging, load config, dispatch.
use std::process::ExitCode;

use anyhow::Context;
use clap::Parser;
use runner::app::{self, Exit};
use runner::cli::{Cli, Command, RunArgs};
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
        Command::Replay {
            store,
            current,
            nats_url,
            tenant,
            saga,
            limit,
            output,
        } => {
            let new = store.manifests.clone();
            if new.is_empty() {
                eprintln!("runner: give the new manifests with --manifest");
                return ExitCode::FAILURE;
            }
            match runner::operator::replay(runner::operator::ReplayArgs {
                store: &store,
                current: &current,
                new: &new,
                nats_url: &nats_url,
                pick: runner::ops::replay::Selection {
                    tenant,
                    saga,
                    limit,
                },
                output,
            }) {
                Ok(false) => ExitCode::SUCCESS,
                Ok(true) => ExitCode::FAILURE,
                Err(e) => {
                    eprintln!("runner: {e:#}");
                    ExitCode::FAILURE
                }
            }
        }
        Command::Graph {
            paths,
            saga,
            saga_version,
            format,
        } => graph(&paths, saga.as_deref(), saga_version, format),
        Command::Inspect {
            store,
            tenant,
            saga,
            id,
            output,
        } => report(runner::operator::inspect(
            &store, &tenant, &saga, &id, output,
        )),
        Command::Dlq { store, action } => report(runner::operator::dlq(&store, action)),
        Command::Partitions { store, action } => {
            report(runner::operator::partitions(&store, action))
        }
        Command::Tenants { store, action } => report(runner::operator::tenants(&store, action)),
        Command::Instances { store, action } => report(runner::operator::instances(&store, action)),
        Command::Migrate {
            store,
            tenant,
            saga,
            from,
            dry_run,
        } => report(runner::operator::migrate(
            &store, &tenant, &saga, from, dry_run,
        )),
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

/// Most threads of the runtime's blocking pool: four per core, at least eight. Store reads,
/// the commit thread, snapshot exports and admin queries run there. Tokio's default (512)
/// let a node under load grow about sixty threads for store reads that two cores cannot run
/// at once: each hand-off woke a cold thread, and memory allocated on one thread was freed
/// on another. Capped at eight on this project's two-core machine, the same pipeline used
/// 18 % less CPU per order, moved 16-20 % more orders and held 74 MiB of heap instead of
/// 110 (docs/benchmarks.md, 2026-11-28, tenth session). Only the commit thread holds one for
/// the node's life, so reads queue for a moment at worst.
fn blocking_threads(cores: usize) -> usize {
    (4 * cores).max(8)
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
    // Span export runs on its own thread, outside the runtime, and is flushed after it.
    let exporter = runner::telemetry::otel::init(
        &config.tracing,
        &app::node_id(
            &config.node.id,
            |k| std::env::var(k).ok(),
            runner::storage::lock::peek_store_id(&config.storage.data_dir).as_deref(),
        ),
        config.runner.mode.as_str(),
    )?;
    let cores = std::thread::available_parallelism().map_or(2, std::num::NonZeroUsize::get);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(config.runner.async_threads(cores))
        .enable_all()
        .max_blocking_threads(blocking_threads(cores))
        .thread_name("runner")
        .build()
        .context("starting the async runtime")?;
    let exit = rt.block_on(async move {
        let lifecycle = std::sync::Arc::new(runner::runtime::Lifecycle::new());
        runner::shutdown::install(lifecycle.clone()).context("installing signal handlers")?;
        Ok(Box::pin(app::run(config, lifecycle)).await?)
    });
    drop(rt);
    if let Some(exporter) = exporter {
        exporter.shutdown();
    }
    exit
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

/// `runner graph`: loads the manifests (refusing invalid ones as `validate` would) and
/// prints the chosen sagas' diagrams, separated by a blank line.
fn graph(
    paths: &[std::path::PathBuf],
    saga: Option<&str>,
    version: Option<u32>,
    format: runner::cli::GraphFormat,
) -> ExitCode {
    use runner::manifest::graph::{Diagram, Format};
    let report = runner::manifest::load(paths);
    for d in &report.diagnostics {
        eprintln!("{d}");
    }
    let Some(catalog) = &report.catalog else {
        eprintln!("runner: the manifests are invalid; nothing drawn");
        return ExitCode::FAILURE;
    };
    let chosen: Vec<_> = match (saga, version) {
        (Some(name), Some(v)) => catalog.saga(name, v).into_iter().collect(),
        (Some(name), None) => catalog.newest(name).into_iter().collect(),
        (None, _) => catalog
            .saga_names()
            .filter_map(|n| catalog.newest(n))
            .collect(),
    };
    if chosen.is_empty() {
        let known: Vec<String> = catalog
            .sagas()
            .map(|s| format!("{} v{}", s.name, s.version))
            .collect();
        eprintln!(
            "runner: no saga {}{} in these manifests; they hold {known:?}",
            saga.unwrap_or(""),
            version.map(|v| format!(" v{v}")).unwrap_or_default()
        );
        return ExitCode::FAILURE;
    }
    let format = match format {
        runner::cli::GraphFormat::Mermaid => Format::Mermaid,
        runner::cli::GraphFormat::Dot => Format::Dot,
    };
    let text: Vec<String> = chosen
        .iter()
        .map(|s| Diagram::of(s).render(format))
        .collect();
    // A closed pipe (`| head`) ends the output quietly.
    let _ = runner::outln!("{}", text.join("\n"));
    ExitCode::SUCCESS
}

fn validate(paths: &[std::path::PathBuf], data_dir: Option<&std::path::Path>) -> ExitCode {
    let mut report = runner::manifest::load(paths);
    if let (Some(dir), Some(catalog)) = (data_dir, &report.catalog) {
        let cfg = runner::config::StorageConfig {
            data_dir: dir.to_path_buf(),
            ..Default::default()
        };
        // Read-only, as beside a live node it must be: a write open would have to match the
        // node's mode (`Store::open_read_only`), and would create a store where there is none.
        let stranded = runner::storage::Store::open_read_only(&cfg)
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
            let printed = runner::outln!(
                "ok: {} file(s), {} saga version(s), {} effect(s), {warnings} warning(s)",
                s.files.len(),
                s.sagas.len(),
                s.effects.len()
            );
            self::report(printed.map_err(Into::into))
        }
        None => {
            eprintln!("{errors} error(s), {warnings} warning(s)");
            ExitCode::FAILURE
        }
    }
}

/// `runner test`: load the manifests, run every `*.tests.yaml` found under the paths.
fn run_tests(paths: &[std::path::PathBuf]) -> ExitCode {
    run_tests_printing(paths).unwrap_or_else(|e| report(Err(e.into())))
}

/// [`run_tests`]; `Err` only when stdout fails for another reason than a closed pipe.
fn run_tests_printing(paths: &[std::path::PathBuf]) -> std::io::Result<ExitCode> {
    use runner::manifest::{collect_files, is_test_file, with_manifests_beside};
    use runner::saga::scenario;
    let report = runner::manifest::load(&with_manifests_beside(paths));
    for d in &report.diagnostics {
        eprintln!("{d}");
    }
    let Some(catalog) = report.catalog else {
        eprintln!("manifests have errors; no test was run");
        return Ok(ExitCode::FAILURE);
    };
    if catalog.summary().sagas.is_empty() {
        let given: Vec<String> = paths.iter().map(|p| p.display().to_string()).collect();
        eprintln!(
            "no manifest was loaded: no saga is declared under {} (give the manifest too, or \
             the directory holding it and its tests, e.g. `runner test manifests/`; a tests \
             file finds `<name>.yaml` beside it by itself); no test was run",
            given.join(", ")
        );
        return Ok(ExitCode::FAILURE);
    }
    let files = match collect_files(paths) {
        Ok(f) => f,
        Err(d) => {
            eprintln!("{d}");
            return Ok(ExitCode::FAILURE);
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
                runner::outln!("ok     {}:{}: {}", r.file, r.line, r.name)?;
            } else {
                failed += 1;
                runner::outln!("FAILED {}:{}: {}", r.file, r.line, r.name)?;
                for f in &r.failures {
                    runner::outln!("    {f}")?;
                }
            }
        }
    }
    runner::outln!("{passed} passed, {failed} failed")?;
    if failed == 0 && passed > 0 {
        Ok(ExitCode::SUCCESS)
    } else {
        if passed == 0 && failed == 0 {
            eprintln!("no test found (test files are named *.tests.yaml)");
        }
        Ok(ExitCode::FAILURE)
    }
}
