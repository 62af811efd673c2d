//! The log subscriber: stderr, text or JSON, filtered by `RUST_LOG`.
//!
//! Guarantee: one event is one line. Values that come from inputs (tenants, subjects, ids,
//! reasons) may hold control characters; in text every field value is written with them
//! escaped ([`escape_controls`]), so a crafted id cannot start a line of its own or drive
//! the terminal; JSON escapes them by its own rules. The same escaping serves every other
//! text Runner prints from input values (`runner dlq list`).

use std::fmt::Write as _;

use tracing_subscriber::EnvFilter;
use tracing_subscriber::field::MakeExt;

use crate::cli::LogFormat;

/// Filter used when `RUST_LOG` is unset: our events at info, chatty libraries at warn.
pub const DEFAULT_FILTER: &str = "info,async_nats=warn,libmdbx=warn";

/// `text` with every control character written as an escape (`\n`, `\r`, `\t`,
/// `\u{1b}`...), so it stays on one line and cannot drive a terminal.
pub fn escape_controls(text: &str) -> std::borrow::Cow<'_, str> {
    if !text.chars().any(char::is_control) {
        return std::borrow::Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len() + 8);
    for c in text.chars() {
        if c.is_control() {
            let _ = write!(out, "{}", c.escape_default());
        } else {
            out.push(c);
        }
    }
    std::borrow::Cow::Owned(out)
}

/// A log line rate limit shared by all threads: [`Every::ready`] says yes at most once per
/// period and counts the occasions it said no in between.
#[derive(Debug)]
pub struct Every {
    period_ms: u64,
    last_ms: std::sync::atomic::AtomicU64,
    skipped: std::sync::atomic::AtomicU64,
}

impl Every {
    /// At most one line per `period_ms`.
    pub const fn new(period_ms: u64) -> Self {
        Self {
            period_ms,
            last_ms: std::sync::atomic::AtomicU64::new(0),
            skipped: std::sync::atomic::AtomicU64::new(0),
        }
    }

    /// `Some(lines skipped since the last one)` when a line may be written now.
    pub fn ready(&self) -> Option<u64> {
        use std::sync::atomic::Ordering::Relaxed;
        let now = crate::clock::now_ms();
        let last = self.last_ms.load(Relaxed);
        if now.saturating_sub(last) >= self.period_ms
            && self
                .last_ms
                .compare_exchange(last, now, Relaxed, Relaxed)
                .is_ok()
        {
            return Some(self.skipped.swap(0, Relaxed));
        }
        self.skipped.fetch_add(1, Relaxed);
        None
    }
}

/// Installs the global tracing subscriber. Call once, first thing in `main`.
pub fn init_logging(format: LogFormat) {
    let filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(DEFAULT_FILTER));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => {
            use std::io::IsTerminal;
            let fields = tracing_subscriber::fmt::format::debug_fn(|w, field, value| {
                let text = format!("{value:?}");
                let text = escape_controls(&text);
                if field.name() == "message" {
                    write!(w, "{text}")
                } else {
                    write!(w, "{}={text}", field.name())
                }
            })
            .delimited(" ");
            builder
                .with_target(false)
                .with_ansi(std::io::stderr().is_terminal())
                .fmt_fields(fields)
                .init()
        }
        LogFormat::Json => builder
            .json()
            .flatten_event(true)
            .with_current_span(true)
            .init(),
    }
}

#[cfg(test)]
mod tests {
    use super::escape_controls;

    #[test]
    fn control_characters_are_escaped_and_nothing_else_changes() {
        assert_eq!(escape_controls("acme"), "acme");
        assert_eq!(escape_controls("a\nERROR forged"), "a\\nERROR forged");
        assert_eq!(escape_controls("x\u{1b}[31my"), "x\\u{1b}[31my");
        assert_eq!(escape_controls("é ü"), "é ü");
    }
}
