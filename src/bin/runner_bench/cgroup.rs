//! CPU caps for bench processes through cgroup v1 (`/sys/fs/cgroup/cpu/`, root only).
//!
//! On this two-core machine three NATS nodes use most of the CPU, so replicas add
//! throughput only when the replicas are what is short. The `cluster` scenario can cap
//! each replica at the same share of a core (`BENCH_CLUSTER_CPU`): then one replica and
//! three replicas are compared under the same per-replica budget.
//!
//! Guarantees: a [`Cap`] puts exactly one process in a cgroup of its own whose
//! `cpu.cfs_quota_us` is the share times `cpu.cfs_period_us`; the cgroup is removed when
//! the `Cap` is dropped (after its process has exited; a leftover of a crashed run is
//! removed by the next run that uses the same name). Failing to create or join it is an
//! error that names the file, never a silently uncapped run.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};

/// The cgroup v1 cpu controller's mount.
const ROOT: &str = "/sys/fs/cgroup/cpu";

/// One process in a cgroup of its own, capped at a share of one core.
pub(crate) struct Cap {
    dir: PathBuf,
}

impl Cap {
    /// Caps process `pid` at `cores` (for example 0.25) of one core, in cgroup
    /// `runner-bench-<name>`.
    pub(crate) fn new(name: &str, pid: u32, cores: f64) -> Result<Self> {
        if !(cores.is_finite() && cores > 0.0) {
            bail!("a CPU cap must be a positive number of cores, got {cores}");
        }
        let root = Path::new(ROOT);
        let period: u64 = read(&root.join("cpu.cfs_period_us"))?
            .trim()
            .parse()
            .context("cpu.cfs_period_us is not a number")?;
        let dir = root.join(format!("runner-bench-{name}"));
        if dir.exists() {
            // A leftover of an earlier run; empty once its process is gone.
            let _ = std::fs::remove_dir(&dir);
        }
        std::fs::create_dir_all(&dir)
            .with_context(|| format!("creating {} (cgroup v1, needs root)", dir.display()))?;
        let quota = ((period as f64) * cores).round().max(1000.0) as u64;
        write(&dir.join("cpu.cfs_quota_us"), &quota.to_string())?;
        write(&dir.join("cgroup.procs"), &pid.to_string())?;
        Ok(Self { dir })
    }
}

impl Drop for Cap {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir(&self.dir);
    }
}

fn read(path: &Path) -> Result<String> {
    std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))
}

fn write(path: &Path, value: &str) -> Result<()> {
    std::fs::write(path, value).with_context(|| format!("writing {value} to {}", path.display()))
}
