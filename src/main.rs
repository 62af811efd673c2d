//! The `runner` binary: parse the CLI, set up logging, load config, dispatch.
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::Parser;
use runner::app::{self, Exit};
use runner::cli::{Cli, Command, RunArgs};
use runner::config::{self, Overrides};

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Validate { paths } => validate(&paths),
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
        let exit = app::run(config, |state| {
            tokio::spawn(runner::shutdown::watch_signals(state));
        })
        .await?;
        Ok(exit)
    })
}

fn validate(paths: &[PathBuf]) -> ExitCode {
    let report = runner::manifest::load(paths);
    for d in &report.diagnostics {
        eprintln!("{d}");
    }
    if report.catalog.is_some() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
