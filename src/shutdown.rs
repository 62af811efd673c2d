//! Signals: the first SIGTERM or SIGINT begins the drain; a second one exits at once.

use std::sync::Arc;

use crate::app::AppState;

/// Exit status used when a second signal cuts the drain short.
pub const FORCED_EXIT_CODE: i32 = 130;

/// Waits for signals for the life of the process. Spawn it once the app state exists.
pub async fn watch_signals(state: Arc<AppState>) {
    let mut count = 0u32;
    loop {
        let name = next_signal().await;
        count += 1;
        if count == 1 {
            state.lifecycle.begin_drain(name);
        } else {
            tracing::warn!(
                message = "Second signal: exiting without finishing the drain.",
                signal = name
            );
            std::process::exit(FORCED_EXIT_CODE);
        }
    }
}

#[cfg(unix)]
async fn next_signal() -> &'static str {
    use tokio::signal::unix::{SignalKind, signal};
    let (mut term, mut int) = match (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) {
        (Ok(t), Ok(i)) => (t, i),
        _ => {
            // Without signal handlers, only the admin endpoint can drain.
            std::future::pending::<()>().await;
            unreachable!("pending never completes")
        }
    };
    tokio::select! {
        _ = term.recv() => "SIGTERM",
        _ = int.recv() => "SIGINT",
    }
}

#[cfg(not(unix))]
async fn next_signal() -> &'static str {
    let _ = tokio::signal::ctrl_c().await;
    "ctrl-c"
}
