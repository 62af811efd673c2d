//! A full disk under the data directory: commits fail, and the node says so — the log names
//! ENOSPC and the data directory, `/health` reports storage failing (`degraded`, still 200:
//! a restart would not free the disk), `runner_storage_write_failing` is 1 and
//! `runner_storage_write_failures_total{reason="disk_full"}` counts — while nothing is lost; once space is back the
//! inputs published during the outage are applied and the report clears by itself.
//!
//! The full disk is real: an 8 MiB tmpfs mounted as the data directory's parent and filled
//! with a file after the runner has committed once. Mounting needs root; without it the test
//! says so and does nothing. Real binary, real nats-server.
#![allow(clippy::unwrap_used)]

mod common;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use common::*;
use serde_json::json;

/// A tmpfs mounted for the life of the value; unmounted when dropped.
struct Tmpfs(PathBuf);

impl Tmpfs {
    /// Mounts a tmpfs of `size` on `dir`, or `None` (with the reason) when it cannot.
    fn mount(dir: &Path, size: &str) -> Result<Self, String> {
        let out = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(dir)
            .output()
            .map_err(|e| format!("cannot run mount: {e}"))?;
        if out.status.success() {
            Ok(Self(dir.to_path_buf()))
        } else {
            Err(String::from_utf8_lossy(&out.stderr).trim().to_string())
        }
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let ok = Command::new("umount")
            .arg(&self.0)
            .status()
            .is_ok_and(|s| s.success());
        if !ok {
            // Still busy (a process not yet reaped): detach it now, freed when unused.
            let _ = Command::new("umount").arg("-l").arg(&self.0).status();
        }
    }
}

/// Writes `path` until the file system refuses more (ENOSPC); returns the bytes written.
fn fill(path: &Path) -> u64 {
    let mut f = std::fs::File::create(path).unwrap();
    let chunk = vec![0x5au8; 64 * 1024];
    let mut written = 0u64;
    loop {
        match f.write(&chunk) {
            Ok(0) => break,
            Ok(n) => written += n as u64,
            Err(e) => {
                assert_eq!(
                    e.raw_os_error(),
                    Some(libc_enospc()),
                    "filling stopped for another reason: {e}"
                );
                break;
            }
        }
    }
    // Whatever a partial chunk left: fill it byte-wise too.
    while let Ok(n) = f.write(&chunk[..512]) {
        if n == 0 {
            break;
        }
        written += n as u64;
    }
    written
}

/// ENOSPC on Linux.
const fn libc_enospc() -> i32 {
    28
}

fn placed(id: &str) -> (String, serde_json::Value) {
    // Items make each instance's state a few hundred bytes, so the outage's inputs need
    // fresh pages rather than pages libmdbx can recycle.
    let items: Vec<_> = (0..8)
        .map(|i| json!({"sku": format!("sku-{id}-{i}-padding-padding-padding"), "qty": i + 1}))
        .collect();
    let ev = aggregate_event(
        "acme",
        "Order",
        id,
        "OrderPlaced",
        1_800_000_000_000,
        json!({"customer_id": format!("customer-{id}"), "amount_cents": 500, "items": items}),
    );
    (format!("tenant.acme.aggregate.Order.{id}"), ev)
}

async fn health(admin: &str) -> (u16, serde_json::Value) {
    let r = reqwest::get(format!("{admin}/health")).await.unwrap();
    let code = r.status().as_u16();
    (code, r.json().await.unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_disk_is_reported_and_recovered_from_without_losing_an_input() {
    let outer = tempfile::tempdir().unwrap();
    let mount = match Tmpfs::mount(outer.path(), "8m") {
        Ok(m) => m,
        Err(why) => {
            eprintln!(
                "SKIPPED a_full_disk_is_reported_and_recovered_from_without_losing_an_input: \
                 cannot mount a tmpfs to fill ({why}); it needs root"
            );
            return;
        }
    };
    let nats = NatsServer::start();
    let data = tempfile::tempdir_in(outer.path()).unwrap();
    let data_path = data.path().to_path_buf();
    let mut runner = RunnerProc::saga(
        data,
        &nats.url(),
        "manifests",
        &[
            // Small growth steps: the file grows in 1 MiB steps, each of which a full disk
            // refuses.
            ("RUNNER__STORAGE__GROWTH_STEP", "1MiB"),
            ("RUNNER__STORAGE__MAX_SIZE", "64MiB"),
        ],
    );
    let js = jetstream(&nats.url()).await;

    // One input committed on a disk with room.
    let (s, b) = placed("o-0");
    publish_json(&js, &s, &b).await;
    let admin = runner.admin.clone();
    wait_until(
        "the first input is committed",
        Duration::from_secs(30),
        || {
            let admin = admin.clone();
            async move { common::inputs_applied(&admin).await >= 1 }
        },
    )
    .await;
    let (code, h) = health(&runner.admin).await;
    assert_eq!(code, 200, "{h}");
    assert_eq!(h["storage"]["ok"], true, "{h}");

    // The disk fills up.
    let filler = outer.path().join("filler");
    let filled = fill(&filler);
    eprintln!("filler: {filled} bytes");

    // Inputs arrive while no commit can be written.
    const OUTAGE: usize = 300;
    // Every input published: the first one and the outage's.
    const ALL: u64 = 1 + OUTAGE as u64;
    for i in 1..=OUTAGE {
        let (s, b) = placed(&format!("o-{i}"));
        publish_json(&js, &s, &b).await;
    }
    // Some small commits may still find recycled pages; the outage's batches cannot.
    let mut seen = None;
    for _ in 0..600 {
        let (code, h) = health(&runner.admin).await;
        if h["storage"]["write_failing"] == true {
            seen = Some((code, h));
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let (code, h) = seen.expect("/health reports storage writes failing within 60 s");
    eprintln!("during the outage: {h}");
    // Degraded, not unavailable: a restart would not free the disk.
    assert_eq!(code, 200, "{h}");
    assert_eq!(h["status"], "degraded", "{h}");
    assert_eq!(h["storage"]["ok"], false, "{h}");
    assert_eq!(h["storage"]["disk_full"], true, "{h}");
    let why = h["storage"]["error"].as_str().unwrap_or_default();
    assert!(why.contains("ENOSPC"), "the reason names ENOSPC: {h}");
    assert!(
        why.contains(&data_path.display().to_string()),
        "the reason names the data directory: {h}"
    );
    let scrape = metrics::Scrape::of(&runner.admin).await;
    let failures = scrape
        .get("runner_storage_write_failures_total{reason=\"disk_full\"}")
        .unwrap_or_else(|| panic!("{}", scrape.describe("runner_storage_write_failures_total")));
    assert!(failures >= 1.0, "{failures} disk-full failures counted");
    let admin = runner.admin.clone();
    wait_until(
        "runner_storage_write_failing is 1",
        Duration::from_secs(30),
        || {
            let admin = admin.clone();
            async move {
                metrics::Scrape::of(&admin)
                    .await
                    .get("runner_storage_write_failing")
                    == Some(1.0)
            }
        },
    )
    .await;
    let line = runner.wait_for_log("ENOSPC", Duration::from_secs(10));
    assert!(
        line.contains("is full") && line.contains(&data_path.display().to_string()),
        "the log names the full disk and the data directory: {line}"
    );
    let cp = common::inputs_applied(&runner.admin).await;
    eprintln!("checkpoint during the outage: {cp}");
    assert!(
        cp < ALL,
        "the outage's inputs cannot all be committed on a full disk (checkpoint {cp})"
    );

    // Space comes back: everything published during the outage is applied, and the report
    // clears by itself.
    std::fs::remove_file(&filler).unwrap();
    let admin = runner.admin.clone();
    wait_until(
        "every input of the outage is applied",
        Duration::from_secs(90),
        || {
            let admin = admin.clone();
            async move { common::inputs_applied(&admin).await >= ALL }
        },
    )
    .await;
    let commands = wait_for_messages(
        &js,
        "WORKFLOW_COMMANDS",
        "tenant.acme.effect.charge_card.*",
        1 + OUTAGE,
        Duration::from_secs(60),
    )
    .await;
    let mut orders: Vec<String> = commands
        .iter()
        .map(|c| c.body["payload"]["order_id"].as_str().unwrap().to_string())
        .collect();
    orders.sort();
    orders.dedup();
    assert_eq!(orders.len(), 1 + OUTAGE, "one charge per order, none lost");
    let admin = runner.admin.clone();
    wait_until("/health is ok again", Duration::from_secs(30), || {
        let admin = admin.clone();
        async move {
            let (code, h) = health(&admin).await;
            code == 200 && h["storage"]["ok"] == true && h["status"] == "ok"
        }
    })
    .await;
    let scrape = metrics::Scrape::of(&runner.admin).await;
    assert_eq!(scrape.get("runner_storage_write_failing"), Some(0.0));
    assert!(
        runner.logged("Storage writes succeed again"),
        "the recovery is logged"
    );

    drop(runner);
    drop(mount);
}
