//! The CLI's operator commands — `inspect`, `instances list`, `dlq`, `migrate`, `tenants` —
//! against a data directory or, with `--admin URL`, a running node's admin API; what they
//! print (a line per item, or JSON with `--output json`).
//!
//! Guarantees: the data directory is opened read-only for every read command, so they work
//! beside a live node; a listing (`instances list`, `dlq list`, `dlq list --stream`) prints
//! one bounded page and the `next` to pass as `--after`, never the whole table; only redrive, purge and migrate open it for writing. Every line the
//! CLI prints goes through [`out`]: a reader that stops early (`| head`) ends the output
//! quietly, never a panic.
//!
//! Inside: this file owns the output ([`out`], [`outln!`](crate::outln)); `store.rs` opens
//! the data directory or the admin client a command works against; one file per family of
//! commands: `instances.rs` (`inspect`, `instances list`), `migrate.rs`, `dlq.rs`, `replay.rs`, and
//! `node.rs` for what only a running node does (`tenants`, `partitions`).

use std::io::Write;
use std::sync::atomic::{AtomicBool, Ordering};

mod dlq;
mod instances;
mod migrate;
mod node;
mod replay;
mod store;

pub use dlq::dlq;
pub use instances::{inspect, instances};
pub use migrate::migrate;
pub use node::{partitions, tenants};
pub use replay::{ReplayArgs, replay};

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
