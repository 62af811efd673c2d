//! The admin server's connections: how many are open, and those it refused or evicted at
//! `admin.max_connections`.

use prometheus::{IntCounter, IntGauge, Registry};

use super::reg;
use crate::telemetry::names;

/// The admin server's collectors.
pub(in crate::telemetry) struct Admin {
    pub(in crate::telemetry) admin_connections: IntGauge,
    pub(in crate::telemetry) admin_connections_refused: IntCounter,
    pub(in crate::telemetry) admin_connections_evicted: IntCounter,
}

/// Defines and registers in `r` the collectors of [`Admin`].
pub(in crate::telemetry) fn register(r: &Registry) -> prometheus::Result<Admin> {
    let admin_connections = reg(
        r,
        IntGauge::new(names::ADMIN_CONNECTIONS, "Admin connections open now.")?,
    )?;
    let admin_connections_refused = reg(
        r,
        IntCounter::new(
            names::ADMIN_CONNECTIONS_REFUSED_TOTAL,
            "Admin connections closed at once: admin.max_connections were open, each with a request in flight.",
        )?,
    )?;
    let admin_connections_evicted = reg(
        r,
        IntCounter::new(
            names::ADMIN_CONNECTIONS_EVICTED_TOTAL,
            "Admin connections closed to make room for a newer one at admin.max_connections: the one open that had waited longest without a request in flight.",
        )?,
    )?;
    Ok(Admin {
        admin_connections,
        admin_connections_refused,
        admin_connections_evicted,
    })
}
