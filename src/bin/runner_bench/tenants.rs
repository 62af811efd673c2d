//! Tenant fairness: one tenant's flood against another tenant's trickle, on one node and on
//! a three-node cluster with three replicas.
//!
//! Per deployment, three drives of the order saga (noop effects), each tenant fresh:
//! - tenant B alone: `--trickle` orders at `--trickle-rate` per second;
//! - tenant A alone: `--flood` orders published at once;
//! - both together: A's flood published at once while B's trickle is offered.
//!
//! It prints B's input → saga completed p50/p95/p99 alone and under the flood, their p95
//! ratio, where B's orders waited hop by hop (`tenants/hops.rs`), and A's completion rate alone and under the flood, then the `goal:` lines of the
//! fairness goal (B's p95 under the flood within 2× of alone; A's rate within 10 %).
//!
//! Guarantees: every drive counts each order once and fails the scenario when an order
//! is lost (a drive ends after [`QUIET`] with no output); the tenants of each drive are
//! fresh, so no order of one drive meets state left by another.

#[path = "tenants/hops.rs"]
mod hops;

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Result, bail};
use async_nats::jetstream;

use crate::cluster::{start_replica_named, wait_spread};
use crate::harness::{Nats, NatsCluster, Programs, Runner, WorkDir};
use crate::pipeline::{Flow, QUIET, drive};

#[derive(clap::Args, Debug)]
pub(crate) struct Args {
    #[command(flatten)]
    programs: Programs,
    /// Orders tenant A publishes at once.
    #[arg(long, env = "BENCH_TENANTS_FLOOD", default_value_t = 50_000)]
    flood: u64,
    /// Orders tenant B offers at `trickle_rate`.
    #[arg(long, env = "BENCH_TENANTS_TRICKLE", default_value_t = 100)]
    trickle: u64,
    /// B's orders per second.
    #[arg(long, env = "BENCH_TENANTS_TRICKLE_RATE", default_value_t = 10.0)]
    trickle_rate: f64,
    /// Where to run: `node` (one nats-server, one runner), `cluster` (three NATS nodes, R3
    /// streams, three runner replicas), or both.
    #[arg(
        long,
        env = "BENCH_TENANTS_SETUPS",
        value_delimiter = ',',
        default_value = "node,cluster"
    )]
    setups: Vec<String>,
    /// The order manifest with noop effects.
    #[arg(long, default_value = "bench/order.yaml")]
    manifest: PathBuf,
}

/// What one deployment measured.
struct Figures {
    setup: String,
    b_alone: [f64; 3],
    b_flood: [f64; 3],
    a_alone: f64,
    a_flood: f64,
}

impl Figures {
    fn p95_ratio(&self) -> f64 {
        self.b_flood[1] / self.b_alone[1]
    }
    fn a_share(&self) -> f64 {
        self.a_flood / self.a_alone
    }
}

pub(crate) async fn run(a: Args) -> Result<()> {
    if !(a.trickle_rate.is_finite() && a.trickle_rate > 0.0) || a.trickle == 0 || a.flood == 0 {
        bail!("tenants: the flood and the trickle need orders, and the trickle a positive rate");
    }
    let mut all = Vec::new();
    for setup in &a.setups {
        let figures = match setup.as_str() {
            "node" => Box::pin(on_node(&a)).await?,
            "cluster" => Box::pin(on_cluster(&a)).await?,
            other => bail!("tenants: unknown setup `{other}` (node, cluster)"),
        };
        all.push(figures);
    }
    for f in &all {
        println!(
            "goal: tenants ({}), B's p95 under A's flood / alone: {:.2}× (goal ≤ 2×) {}",
            f.setup,
            f.p95_ratio(),
            if f.p95_ratio() <= 2.0 {
                "met"
            } else {
                "NOT MET"
            }
        );
        println!(
            "goal: tenants ({}), A's rate beside B / alone: {:.2} (goal ≥ 0.90) {}",
            f.setup,
            f.a_share(),
            if f.a_share() >= 0.9 { "met" } else { "NOT MET" }
        );
    }
    Ok(())
}

async fn on_node(a: &Args) -> Result<Figures> {
    let work = WorkDir::new("tenants", a.programs.keep)?;
    let nats = Nats::start(&a.programs.nats_server, &work.path).await?;
    println!(
        "tenants (node): {} cores, nats-server {}, one runner in combined mode; order saga, noop effects; A: {} orders at once, B: {} at {}/s",
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        Nats::version(&a.programs.nats_server),
        a.flood,
        a.trickle,
        a.trickle_rate,
    );
    let mut runner = Runner::start(
        &a.programs.runner,
        &work.path,
        &nats.url,
        "combined",
        &a.manifest,
        &[],
    )
    .await?;
    let js = jetstream::new(crate::connect(&nats.url).await?);
    let figures = Box::pin(measure(a, &js, "node", &work, &[&runner])).await;
    runner.proc.stop(Duration::from_secs(30));
    figures
}

async fn on_cluster(a: &Args) -> Result<Figures> {
    const NODES: usize = 3;
    let work = WorkDir::new("tenants-cluster", a.programs.keep)?;
    let cluster = NatsCluster::start(&a.programs.nats_server, &work.path, NODES).await?;
    println!(
        "tenants (cluster): {NODES}-node NATS cluster on loopback, R{NODES} streams, {NODES} runner replicas in combined mode, uncapped; A: {} orders at once, B: {} at {}/s",
        a.flood, a.trickle, a.trickle_rate,
    );
    let mut replicas = Vec::new();
    for i in 1..=NODES {
        let name = format!("r{i}");
        replicas.push(
            start_replica_named(
                &a.programs.runner,
                &work.path,
                &cluster.urls,
                &name,
                &a.manifest,
            )
            .await?,
        );
    }
    wait_spread(&replicas, Duration::from_secs(120)).await?;
    let js = jetstream::new(crate::connect(&cluster.urls).await?);
    let all: Vec<&Runner> = replicas.iter().collect();
    let figures = Box::pin(measure(a, &js, "cluster", &work, &all)).await;
    for r in &mut replicas {
        r.proc.stop(Duration::from_secs(30));
    }
    figures
}

/// The three drives on a running deployment.
async fn measure(
    a: &Args,
    js: &jetstream::Context,
    setup: &str,
    work: &WorkDir,
    runners: &[&Runner],
) -> Result<Figures> {
    let lost = |who: &str, done: usize, of: u64| -> Result<()> {
        if done as u64 != of {
            bail!(
                "tenants ({setup}): {who}: only {done} of {of} orders completed; see the runner logs in {} (run with --keep)",
                work.path.display()
            );
        }
        Ok(())
    };
    let quantiles = |d: &mut crate::pipeline::Drive| [0.5, 0.95, 0.99].map(|q| d.done_quantile(q));
    let (b1, a1, a2, b2) = (
        tenant("b-alone"),
        tenant("a-alone"),
        tenant("a"),
        tenant("b"),
    );

    // A warm-up, so that B alone does not pay for the first sagas' consumers and claims.
    let warm_up = a.flood.min(1000);
    let warm = drive(js, &tenant("warm-up"), warm_up, 0.0, QUIET).await?;
    lost("the warm-up", warm.completed, warm_up)?;
    let mut alone = drive(js, &b1, a.trickle, a.trickle_rate, QUIET).await?;
    lost("B alone", alone.completed, a.trickle)?;
    let b_alone = quantiles(&mut alone);
    println!("  B alone: {}", line(b_alone));

    let mut flood_alone = drive(js, &a1, a.flood, 0.0, QUIET).await?;
    lost("A alone", flood_alone.completed, a.flood)?;
    let a_alone = flood_alone.sagas_per_s();
    let p50 = flood_alone.done_quantile(0.5);
    println!(
        "  A alone: {} orders in {:.1} s, {:.0} sagas/s; completed p50 {p50:.0} ms",
        a.flood, flood_alone.elapsed, a_alone,
    );

    // Both at once: A's whole flood is published while B's trickle runs.
    let scraped = scrape(runners).await?;
    let (flood, trickle) = tokio::join!(
        drive(js, &a2, a.flood, 0.0, QUIET),
        drive(js, &b2, a.trickle, a.trickle_rate, QUIET),
    );
    let (mut flood, mut trickle) = (flood?, trickle?);
    lost("A beside B", flood.completed, a.flood)?;
    lost("B under A's flood", trickle.completed, a.trickle)?;
    println!(
        "{}",
        crate::pipeline::where_time_goes_of("all tenants", &scraped, &scrape(runners).await?)
    );
    println!("  {}", trickle.line("B under A's flood, whole", 0.0));
    let b_flood = quantiles(&mut trickle);
    let a_flood = flood.sagas_per_s();
    println!("  B under A's flood: {}", line(b_flood));
    // Where B's orders waited, alone and under the flood (stored times, p50/p95 ms).
    for (who, flow) in [("alone", &b1), ("under the flood", &b2)] {
        let Flow::Runner { tenant } = flow else {
            continue;
        };
        match hops::line(js, tenant).await {
            Ok(l) => println!("  where B waits {who} (p50/p95 ms): {l}"),
            Err(e) => println!("  where B waits {who}: not read ({e})"),
        }
    }
    let p50 = flood.done_quantile(0.5);
    println!(
        "  A beside B: {} orders in {:.1} s, {:.0} sagas/s; completed p50 {p50:.0} ms",
        a.flood, flood.elapsed, a_flood,
    );
    let figures = Figures {
        setup: setup.into(),
        b_alone,
        b_flood,
        a_alone,
        a_flood,
    };
    println!(
        "result: tenants ({setup}): B's completed p95 {:.0} ms alone, {:.0} ms under the flood ({:.2}×); A {:.0} sagas/s alone, {:.0} beside B ({:.2})",
        b_alone[1],
        b_flood[1],
        figures.p95_ratio(),
        a_alone,
        a_flood,
        figures.a_share()
    );
    Ok(figures)
}

/// The runners' metrics, concatenated.
async fn scrape(runners: &[&Runner]) -> Result<String> {
    let mut all = String::new();
    for r in runners {
        all.push_str(&r.client().text().await?);
    }
    Ok(all)
}

fn tenant(name: &str) -> Flow {
    Flow::Runner {
        tenant: name.into(),
    }
}

fn line(q: [f64; 3]) -> String {
    format!(
        "input -> saga completed ms p50={:.1} p95={:.1} p99={:.1}",
        q[0], q[1], q[2]
    )
}
