//! Reading a running runner's `/metrics` in tests, strictly: a sample that is not there
//! fails the test (naming it and listing what exists) instead of reading as zero, so a
//! renamed metric or label cannot make an assertion pass by accident.

use std::time::{Duration, Instant};

/// One scrape of a runner's `/metrics`.
pub struct Scrape(String);

impl Scrape {
    /// Reads `{admin}/metrics`.
    pub async fn of(admin: &str) -> Self {
        Self(super::get_text(&format!("{admin}/metrics")).await)
    }

    /// The value of a sample, written as Prometheus prints it (`name{label="v",…}`, labels
    /// in name order), if the series exists.
    pub fn get(&self, sample: &str) -> Option<f64> {
        self.0
            .lines()
            .filter(|l| !l.starts_with('#'))
            .find_map(|l| {
                let (series, value) = l.rsplit_once(' ')?;
                (series == sample).then(|| value.trim().parse().ok())?
            })
    }

    /// Whether the metric family of `sample` is registered and exported (`# TYPE` line).
    pub fn has_family(&self, sample: &str) -> bool {
        let family = family_of(sample);
        self.0
            .lines()
            .any(|l| l.strip_prefix("# TYPE ").and_then(|r| r.split(' ').next()) == Some(family))
    }

    /// What the scrape holds for the family of `sample` (for failure messages).
    pub fn describe(&self, sample: &str) -> String {
        let family = family_of(sample);
        let lines: Vec<&str> = self
            .0
            .lines()
            .filter(|l| !l.starts_with('#') && l.starts_with(family))
            .collect();
        if lines.is_empty() {
            let families: Vec<&str> = self
                .0
                .lines()
                .filter_map(|l| l.strip_prefix("# TYPE ")?.split(' ').next())
                .collect();
            format!("no family {family}; families: {families:?}")
        } else {
            format!("family {family} has:\n{}", lines.join("\n"))
        }
    }
}

/// The metric name of a sample.
fn family_of(sample: &str) -> &str {
    sample.split('{').next().unwrap_or(sample)
}

/// Reads one sample (name with labels as Prometheus prints them) from `/metrics`; panics,
/// naming the sample and listing what exists, when the series is not there.
pub async fn metric(admin: &str, sample: &str) -> f64 {
    let s = Scrape::of(admin).await;
    s.get(sample)
        .unwrap_or_else(|| panic!("{admin}: no series {sample}; {}", s.describe(sample)))
}

/// Like [`metric`], but a series that was never incremented reads 0 — allowed only when
/// its family is exported, i.e. some other series of the same counter exists.
///
/// The runner's labelled counters (`prometheus` vecs) have no series for a label value
/// until its first increment, and a family with no series is not exported at all. So a
/// zero can only be told from a renamed counter when a sibling series exists; use this for
/// assertions like `busy == 0` where others (`acquired`, `renewed`) surely are.
pub async fn metric_or_zero(admin: &str, sample: &str) -> f64 {
    let s = Scrape::of(admin).await;
    match s.get(sample) {
        Some(v) => v,
        None if s.has_family(sample) => 0.0,
        None => panic!("{admin}: no family for {sample}; {}", s.describe(sample)),
    }
}

/// One sample read from several runners; a runner without the series reads 0, but at
/// least one of them must have it (so a renamed metric fails instead of summing to 0).
pub async fn metric_across(admins: &[&str], sample: &str) -> Vec<f64> {
    let mut values = Vec::new();
    let mut found = false;
    let mut described = String::new();
    for admin in admins {
        let s = Scrape::of(admin).await;
        match s.get(sample) {
            Some(v) => {
                found = true;
                values.push(v);
            }
            None => {
                described = s.describe(sample);
                values.push(0.0);
            }
        }
    }
    assert!(found, "no runner has the series {sample}; {described}");
    values
}

/// Polls until the sample exists on `admin` and satisfies `ok`; returns its value. Panics
/// with what the scrape holds after `timeout`.
pub async fn wait_metric(
    admin: &str,
    sample: &str,
    ok: impl Fn(f64) -> bool,
    timeout: Duration,
) -> f64 {
    let deadline = Instant::now() + timeout;
    loop {
        let s = Scrape::of(admin).await;
        if let Some(v) = s.get(sample).filter(|v| ok(*v)) {
            return v;
        }
        assert!(
            Instant::now() < deadline,
            "{admin}: {sample} did not reach the expected value within {timeout:?}; {}",
            s.describe(sample)
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Polls until the sum of the sample over `admins` satisfies `ok` (a runner without the
/// series counts 0); returns the sum.
pub async fn wait_metric_sum(
    admins: &[&str],
    sample: &str,
    ok: impl Fn(f64) -> bool,
    timeout: Duration,
) -> f64 {
    let deadline = Instant::now() + timeout;
    loop {
        let mut sum = 0.0;
        let mut found = false;
        for admin in admins {
            if let Some(v) = Scrape::of(admin).await.get(sample) {
                found = true;
                sum += v;
            }
        }
        if found && ok(sum) {
            return sum;
        }
        assert!(
            Instant::now() < deadline,
            "{sample} summed over {admins:?} is {sum} (series found: {found}) after {timeout:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
