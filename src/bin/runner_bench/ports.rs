//! Free loopback ports for child processes that bind them later: the bench harness's
//! nats-servers and runners, and the integration tests' clusters (which include this file).
//!
//! Guarantee: the `k` ports returned were all bindable at once on 127.0.0.1 and lie below
//! Linux's ephemeral range, so no socket that asks the kernel for a port (a client, another
//! process's `:0` listener) is handed one of them between the choice and the bind.

use std::net::TcpListener;

/// `k` distinct free ports. Every listener is held until all are chosen: a port freed at
/// once can be handed out again by the next bind, and two nodes given the same port make
/// one of them fail to start.
///
/// They are taken below Linux's ephemeral range (32768 and up), from 20000 to 32767: a
/// port the kernel chose for `127.0.0.1:0` is offered again to the next process that binds
/// port 0 (another test's nats-server, a client's socket) as soon as it is closed, and a
/// caller that binds its ports only later (a cluster's nine, bound as its nodes start)
/// would find it taken.
pub(crate) fn free_ports(k: usize) -> std::io::Result<Vec<u16>> {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let seed = u64::from(std::process::id())
        ^ std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
    let mut held: Vec<TcpListener> = Vec::with_capacity(k);
    let mut tries = 0;
    while held.len() < k {
        tries += 1;
        let x = seed
            .wrapping_add(NEXT.fetch_add(1, Ordering::Relaxed))
            .wrapping_mul(0x9E37_79B9_7F4A_7C15);
        let port = 20_000 + (x >> 32) as u16 % 12_768;
        if let Ok(l) = TcpListener::bind(("127.0.0.1", port)) {
            held.push(l);
        } else if tries > 10_000 {
            // Every try taken: fall back to the kernel's choice.
            held.push(TcpListener::bind("127.0.0.1:0")?);
        }
    }
    held.iter().map(|l| Ok(l.local_addr()?.port())).collect()
}
