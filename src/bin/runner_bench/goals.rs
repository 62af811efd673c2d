//! The performance goals (PRD §10a) and the line that prints a measured figure beside its
//! goal, so a run says by itself what is met and what is not.
//!
//! Every line has the same shape, which tooling can read:
//! `goal: <what>: <measured> <unit> (goal <op> <target>) met|NOT MET`.

/// Which side of the target a figure must be on.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Bound {
    /// The figure must be at least the target.
    AtLeast,
    /// The figure must be below the target.
    Below,
}

/// Order pipeline, single node: runner over the messaging limit of the same run.
pub(crate) const PIPELINE_RATIO: f64 = 0.85;
/// Partitioned pipeline on the three-node cluster, three replicas: over the fenced limit.
pub(crate) const CLUSTER_RATIO: f64 = 0.70;
/// Cluster, replicas capped at the same CPU share: throughput of N replicas over one, per
/// replica (scaling efficiency; three replicas at 0.8 deliver 2.4x one).
pub(crate) const CAPPED_SCALING: f64 = 0.8;
/// Half rate, single node: input → first output stored, p99 in ms.
pub(crate) const HALF_RATE_FIRST_P99_MS: f64 = 20.0;
/// Half rate, single node: input → saga completed, p99 in ms.
pub(crate) const HALF_RATE_COMPLETED_P99_MS: f64 = 100.0;
/// Ledger throughput with 1 000 000 live instances over that with 10 000.
pub(crate) const SCALE_RATIO: f64 = 0.85;
/// The runner's anonymous memory with 1 000 000 live instances, MiB.
pub(crate) const SCALE_ANON_MIB: f64 = 150.0;
/// The runner's peak anonymous memory with 256 KiB events, MiB: the batch and pull byte
/// caps (`saga.max_batch_bytes`, `saga.max_pull_bytes`) keep it from reaching hundreds.
pub(crate) const LARGE_EVENT_ANON_MIB: f64 = 256.0;
/// Open loop up to 100 % of the maximum rate: completion p99 at most this many times the
/// lowest load's ("flat").
pub(crate) const FLAT_FACTOR: f64 = 1.5;
/// Open loop up to 100 % of the maximum rate: orders/s completed while the load was
/// offered (past its first quarter, `pipeline::drive::steady_rate`) over orders/s offered, at the
/// lowest ("keeping up").
pub(crate) const KEEPING_UP: f64 = 0.95;

/// One open-loop run: its load (a fraction of the maximum rate), orders/s offered and
/// completed, and the p99s in ms to the first output and to completion.
#[derive(Clone, Copy, Debug)]
pub(crate) struct OpenLoopRun {
    pub(crate) load: f64,
    pub(crate) offered: f64,
    pub(crate) completed: f64,
    pub(crate) first_p99: f64,
    pub(crate) done_p99: f64,
}

/// The open-loop goals over the runs up to 100 % of the maximum rate (none with fewer than
/// two): completion p99 flat (highest over lowest within [`FLAT_FACTOR`]) and completions
/// keeping up with the offered rate ([`KEEPING_UP`]). `what` opens each figure's name
/// (`open loop` gives `open loop up to 100%, …`).
pub(crate) fn open_loop(what: &str, runs: &[OpenLoopRun]) -> Vec<String> {
    let upto: Vec<_> = runs.iter().filter(|r| r.load <= 1.0 + 1e-9).collect();
    if upto.len() < 2 {
        return Vec::new();
    }
    let lowest = upto
        .iter()
        .map(|r| r.done_p99)
        .fold(f64::INFINITY, f64::min);
    let highest = upto.iter().map(|r| r.done_p99).fold(0.0, f64::max);
    let keeping = upto
        .iter()
        .map(|r| r.completed / r.offered)
        .fold(f64::INFINITY, f64::min);
    vec![
        line(
            &format!("{what} up to 100%, completion p99 highest/lowest"),
            highest / lowest,
            "",
            Bound::Below,
            FLAT_FACTOR,
        ),
        line(
            &format!("{what} up to 100%, completions/offered (lowest)"),
            keeping,
            "",
            Bound::AtLeast,
            KEEPING_UP,
        ),
    ]
}

/// One figure beside its goal.
pub(crate) fn line(what: &str, measured: f64, unit: &str, bound: Bound, target: f64) -> String {
    let (op, met) = match bound {
        Bound::AtLeast => ("≥", measured >= target),
        Bound::Below => ("<", measured < target),
    };
    let verdict = if met { "met" } else { "NOT MET" };
    let unit = if unit.is_empty() {
        String::new()
    } else {
        format!(" {unit}")
    };
    format!("goal: {what}: {measured:.2}{unit} (goal {op} {target}{unit}) {verdict}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_line_names_the_figure_its_goal_and_the_verdict() {
        assert_eq!(
            line("pipeline ratio", 0.6, "", Bound::AtLeast, PIPELINE_RATIO),
            "goal: pipeline ratio: 0.60 (goal ≥ 0.85) NOT MET"
        );
        assert_eq!(
            line("p99", 12.345, "ms", Bound::Below, 20.0),
            "goal: p99: 12.35 ms (goal < 20 ms) met"
        );
    }

    #[test]
    fn open_loop_goals_take_the_runs_up_to_full_rate_only() {
        let run = |load, offered, completed, done_p99| OpenLoopRun {
            load,
            offered,
            completed,
            first_p99: 1.0,
            done_p99,
        };
        let runs = [
            run(0.5, 400.0, 396.0, 100.0),
            run(0.8, 640.0, 600.0, 140.0),
            run(1.2, 960.0, 700.0, 5000.0),
        ];
        assert_eq!(
            open_loop("cluster, 3 replicas, open loop", &runs),
            [
                "goal: cluster, 3 replicas, open loop up to 100%, completion p99 highest/lowest: 1.40 (goal < 1.5) met",
                "goal: cluster, 3 replicas, open loop up to 100%, completions/offered (lowest): 0.94 (goal ≥ 0.95) NOT MET",
            ]
        );
        assert!(open_loop("open loop", &runs[..1]).is_empty());
        assert!(open_loop("open loop", &runs[2..]).is_empty());
    }
}
