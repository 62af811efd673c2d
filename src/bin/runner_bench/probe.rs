//! What a bench reads off the processes under test: `/metrics` scrapes (sums, and quantiles
//! of histograms over a window between two scrapes) and `/proc` figures (CPU seconds,
//! memory, and the peaks while a measurement runs).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::Result;

/// Scrapes `/metrics`.
#[derive(Clone)]
pub(crate) struct Metrics {
    url: String,
    http: reqwest::Client,
}

impl Metrics {
    /// A scraper of `url` (a node's `/metrics`).
    pub(crate) fn new(url: String, http: reqwest::Client) -> Self {
        Self { url, http }
    }
    pub(crate) async fn text(&self) -> Result<String> {
        Ok(self.http.get(&self.url).send().await?.text().await?)
    }
    /// Sum of the samples of `name` whose labels contain every `labels` pair.
    pub(crate) async fn sum(&self, name: &str, labels: &[(&str, &str)]) -> Result<f64> {
        Ok(metric_sum(&self.text().await?, name, labels))
    }
}

/// Sum of the samples of `name` (exact metric name) whose labels contain every pair.
pub(crate) fn metric_sum(text: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (series, value) = l.rsplit_once(' ')?;
            let (n, rest) = match series.find('{') {
                Some(i) => (&series[..i], &series[i..]),
                None => (series, ""),
            };
            (n == name
                && labels
                    .iter()
                    .all(|(k, v)| rest.contains(&format!("{k}=\"{v}\""))))
            .then(|| value.parse::<f64>().ok())
            .flatten()
        })
        .sum()
}

/// Estimates a quantile from a Prometheus histogram (`<name>_bucket` samples, summed over
/// its label sets): the upper bound of the first bucket holding the quantile.
pub(crate) fn histogram_quantile(text: &str, name: &str, q: f64) -> Option<f64> {
    let by_le = buckets(text, name);
    let total = by_le.last()?.1;
    if total <= 0.0 {
        return None;
    }
    by_le
        .iter()
        .find(|(_, c)| *c >= q * total)
        .map(|(le, _)| *le)
}

/// Cumulative bucket counts of histogram `name` in a scrape, summed over its label sets,
/// by upper bound.
fn buckets(text: &str, name: &str) -> Vec<(f64, f64)> {
    let prefix = format!("{name}_bucket");
    let mut by_le: Vec<(f64, f64)> = Vec::new();
    for l in text.lines().filter(|l| l.starts_with(&prefix)) {
        let Some(le) = l.split("le=\"").nth(1).and_then(|r| r.split('"').next()) else {
            continue;
        };
        let le = if le == "+Inf" {
            f64::INFINITY
        } else {
            let Ok(v) = le.parse() else { continue };
            v
        };
        let Some(count) = l.rsplit_once(' ').and_then(|(_, v)| v.parse::<f64>().ok()) else {
            continue;
        };
        match by_le.iter_mut().find(|(b, _)| *b == le) {
            Some(e) => e.1 += count,
            None => by_le.push((le, count)),
        }
    }
    by_le.sort_by(|a, b| a.0.total_cmp(&b.0));
    by_le
}

/// Quantile `q` of what histogram `name` observed between two scrapes, interpolated
/// linearly inside its bucket (as Prometheus' `histogram_quantile` does); `None` when it
/// observed nothing.
pub(crate) fn window_quantile(before: &str, after: &str, name: &str, q: f64) -> Option<f64> {
    let old = buckets(before, name);
    let new: Vec<(f64, f64)> = buckets(after, name)
        .into_iter()
        .map(|(le, c)| {
            let was = old.iter().find(|(b, _)| *b == le).map_or(0.0, |(_, c)| *c);
            (le, c - was)
        })
        .collect();
    let total = new.last()?.1;
    if total <= 0.0 {
        return None;
    }
    let rank = q * total;
    let mut prev = (0.0, 0.0);
    for (le, c) in new {
        if c >= rank {
            if le.is_infinite() {
                return Some(prev.0);
            }
            let inside = (rank - prev.1) / (c - prev.1).max(f64::MIN_POSITIVE);
            return Some(prev.0 + (le - prev.0) * inside);
        }
        prev = (le, c);
    }
    None
}

/// CPU seconds (user + system) a process has used so far.
pub(crate) fn cpu_seconds(pid: u32) -> f64 {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return 0.0;
    };
    // Fields after the command name, which is in parentheses and may hold spaces.
    let Some(rest) = stat.rsplit_once(')').map(|(_, r)| r) else {
        return 0.0;
    };
    let f: Vec<&str> = rest.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of the whole line: 11 and 12 after the name.
    let ticks: f64 = [11, 12]
        .iter()
        .filter_map(|&i| f.get(i)?.parse::<f64>().ok())
        .sum();
    ticks / 100.0
}

/// Context switches (voluntary and involuntary) of a process's live threads so far: the
/// wake-ups it costs the machine. Threads that exited are not counted.
pub(crate) fn context_switches(pid: u32) -> u64 {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return 0;
    };
    tasks
        .flatten()
        .filter_map(|t| std::fs::read_to_string(t.path().join("status")).ok())
        .map(|s| {
            s.lines()
                .filter(|l| l.contains("ctxt_switches:"))
                .filter_map(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
                .sum::<u64>()
        })
        .sum()
}

/// Memory figures of a process, in KiB.
#[derive(Default, Clone, Copy, Debug)]
pub(crate) struct Mem {
    pub(crate) rss: u64,
    pub(crate) anon: u64,
    pub(crate) file: u64,
    pub(crate) hwm: u64,
}

pub(crate) fn mem(pid: u32) -> Mem {
    let mut m = Mem::default();
    if let Ok(s) = std::fs::read_to_string(format!("/proc/{pid}/status")) {
        for l in s.lines() {
            let kib = || {
                l.split_whitespace()
                    .nth(1)
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(0)
            };
            match l.split(':').next() {
                Some("VmRSS") => m.rss = kib(),
                Some("RssAnon") => m.anon = kib(),
                Some("RssFile") => m.file = kib(),
                Some("VmHWM") => m.hwm = kib(),
                _ => {}
            }
        }
    }
    m
}

/// Samples a process's memory every 100 ms while a measurement runs and keeps the peaks;
/// also takes its CPU time and context switches at start and stop.
pub(crate) struct Sampler {
    pid: u32,
    cpu0: f64,
    switches0: u64,
    stop: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<Mem>,
}

/// What a [`Sampler`] saw.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Usage {
    pub(crate) cpu: f64,
    pub(crate) switches: u64,
    pub(crate) peak: Mem,
}

impl Usage {
    pub(crate) fn line(&self, who: &str, elapsed: f64) -> String {
        let mib = |k: u64| k as f64 / 1024.0;
        format!(
            "{who}: cpu_seconds={:.2} ({:.0}% of one core) context_switches={} ({:.0}/s) peak_rss={:.0}MiB peak_rss_anon={:.0}MiB peak_rss_file={:.0}MiB",
            self.cpu,
            100.0 * self.cpu / elapsed.max(1e-9),
            self.switches,
            self.switches as f64 / elapsed.max(1e-9),
            mib(self.peak.rss),
            mib(self.peak.anon),
            mib(self.peak.file),
        )
    }
}

impl Sampler {
    pub(crate) fn start(pid: u32) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        let task = tokio::spawn(async move {
            let mut peak = Mem::default();
            loop {
                let m = mem(pid);
                peak.rss = peak.rss.max(m.rss);
                peak.anon = peak.anon.max(m.anon);
                peak.file = peak.file.max(m.file);
                peak.hwm = peak.hwm.max(m.hwm);
                if s.load(Ordering::Relaxed) {
                    return peak;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        });
        Self {
            pid,
            cpu0: cpu_seconds(pid),
            switches0: context_switches(pid),
            stop,
            task,
        }
    }
    pub(crate) async fn finish(self) -> Usage {
        self.stop.store(true, Ordering::Relaxed);
        let peak = self.task.await.unwrap_or_default();
        Usage {
            cpu: cpu_seconds(self.pid) - self.cpu0,
            switches: context_switches(self.pid).saturating_sub(self.switches0),
            peak,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SCRAPE: &str = "\
# TYPE h histogram
h_bucket{stream=\"a\",le=\"0.01\"} 90
h_bucket{stream=\"a\",le=\"0.1\"} 100
h_bucket{stream=\"a\",le=\"+Inf\"} 100
h_bucket{stream=\"b\",le=\"0.01\"} 0
h_bucket{stream=\"b\",le=\"0.1\"} 80
h_bucket{stream=\"b\",le=\"+Inf\"} 100
h_count{stream=\"a\"} 100
h_count{stream=\"b\"} 100
";

    #[test]
    fn a_histogram_is_read_over_all_its_label_sets() {
        // Of 200 observations, 90 at or below 10 ms and 180 at or below 100 ms.
        assert_eq!(histogram_quantile(SCRAPE, "h", 0.4), Some(0.01));
        assert_eq!(histogram_quantile(SCRAPE, "h", 0.5), Some(0.1));
        assert_eq!(histogram_quantile(SCRAPE, "h", 0.95), Some(f64::INFINITY));
        assert_eq!(histogram_quantile(SCRAPE, "missing", 0.5), None);
        assert_eq!(metric_sum(SCRAPE, "h_count", &[]), 200.0);
        assert_eq!(metric_sum(SCRAPE, "h_count", &[("stream", "b")]), 100.0);
    }
}
