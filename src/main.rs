//! The `runner` binary: parse the CLI, set up logging, load config, dispatch.
use std::process::ExitCode;

use clap::Parser;
use runner::cli::{Cli, Command};

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Validate { paths } => validate(&paths),
        Command::Run(_) => {
            eprintln!("runner: `run` is not wired yet");
            ExitCode::FAILURE
        }
    }
}

fn validate(paths: &[std::path::PathBuf]) -> ExitCode {
    let report = runner::manifest::load(paths);
    for d in &report.diagnostics {
        eprintln!("{d}");
    }
    if report.catalog.is_some() { ExitCode::SUCCESS } else { ExitCode::FAILURE }
}
