//! Signals: the first SIGTERM or SIGINT begins the drain; a second one exits at once.
//!
//! Handlers are installed before anything else starts, so a signal during start-up is
//! never lost: it begins the drain, and the process drains as soon as it is up.

use std::sync::Arc;

use crate::runtime::Lifecycle;

/// Exit status used when a second signal cuts the drain short.
pub const FORCED_EXIT_CODE: i32 = 130;

/// Installs the SIGTERM/SIGINT handlers now and watches them for the life of the process.
/// Must be called from within the Tokio runtime.
#[cfg(unix)]
pub fn install(lifecycle: Arc<Lifecycle>) -> std::io::Result<()> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    tokio::spawn(async move {
        let mut count = 0u32;
        loop {
            let name = tokio::select! {
                _ = term.recv() => "SIGTERM",
                _ = int.recv() => "SIGINT",
            };
            count += 1;
            if count == 1 {
                lifecycle.begin_drain(name);
            } else {
                tracing::warn!(
                    message = "Second signal: exiting without finishing the drain.",
                    signal = name
                );
                std::process::exit(FORCED_EXIT_CODE);
            }
        }
    });
    Ok(())
}

/// Installs a Ctrl-C handler (non-Unix platforms).
#[cfg(not(unix))]
pub fn install(lifecycle: Arc<Lifecycle>) -> std::io::Result<()> {
    tokio::spawn(async move {
        let mut count = 0u32;
        while tokio::signal::ctrl_c().await.is_ok() {
            count += 1;
            if count == 1 {
                lifecycle.begin_drain("ctrl-c");
            } else {
                std::process::exit(FORCED_EXIT_CODE);
            }
        }
    });
    Ok(())
}
