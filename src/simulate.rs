//! `looseleaf simulate`: the policies side by side on replayed sessions (the `sim`
//! crate), written as a results JSON, a Markdown summary and PNG plots.

use std::path::{Path, PathBuf};

use anyhow::Context;
use looseleaf_planner::speculator::Budget;
use looseleaf_sim::cluster::Autoscaler;
use looseleaf_sim::costs::Costs;
use looseleaf_sim::run::{compare, Comparison, Setup};
use looseleaf_sim::workload::{recorded_workload, Synthetic, Trace, VARIANTS};
use serde_json::{json, Value};

/// What to simulate.
#[derive(clap::Args, Debug)]
pub struct SimulateArgs {
    /// Base-workload loads to run (concurrent sessions); none with `--recorded`.
    #[arg(long = "sessions", value_delimiter = ',', default_values_t = [24, 48, 72, 720, 2400])]
    pub sessions: Vec<usize>,
    /// Recorded sessions to replay instead: REPORT.json files of `looseleaf run`.
    #[arg(long, num_args = 1..)]
    pub recorded: Vec<PathBuf>,
    /// Skip the trace-derived workload.
    #[arg(long)]
    pub no_trace: bool,
    /// Skip the sensitivity variants (run at the middle load).
    #[arg(long)]
    pub no_variants: bool,
    /// Skip the runs with NotebookOS's reserved floor of 7 hosts (ADR 50).
    #[arg(long)]
    pub no_floor_runs: bool,
    /// Only these policies (comma-separated; default: all).
    #[arg(long, value_delimiter = ',')]
    pub policies: Option<Vec<String>>,
    /// A fixed cluster of this many hosts instead of the autoscaler.
    #[arg(long)]
    pub hosts: Option<u32>,
    /// GPUs per host of that fixed cluster.
    #[arg(long, default_value_t = 8)]
    pub gpus_per_host: u32,
    /// Slots are CPU-backed (virtual GPUs): no CUDA initialisation or
    /// host-to-GPU copy is charged.
    #[arg(long)]
    pub virtual_gpus: bool,
    /// A directory of bench results to take LooseLeaf's measured costs from
    /// (default: the repository's `bench/results`, built into looseleaf, so that
    /// it runs from any folder).
    #[arg(long)]
    pub costs: Option<PathBuf>,
    /// Take start costs from the `--recorded` reports themselves where they hold samples.
    #[arg(long)]
    pub costs_from_reports: bool,
    /// Speculation budget: prepared-but-idle workers per host.
    #[arg(long, default_value_t = looseleaf_planner::DEFAULT_BUDGET.prepared_per_host)]
    pub prepared_per_host: usize,
    /// Speculation budget: idle GPU-slot seconds per session.
    #[arg(long, default_value_t = looseleaf_planner::DEFAULT_BUDGET.idle_seconds_per_session)]
    pub idle_gpu_seconds_per_session: f64,
    /// The seed of every draw.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Where to write simulation.json, summary.md and the plots.
    #[arg(long, default_value = "simulation")]
    pub out: PathBuf,
    /// Do not draw the plots.
    #[arg(long)]
    pub no_plots: bool,
    /// Python with matplotlib, for the plots (default: the checkout's .venv, else python3).
    #[arg(long, env = "LOOSELEAF_PYTHON")]
    pub python: Option<PathBuf>,
}

/// The plotting script, run with the results file.
const PLOTS: &str = include_str!("../sim/plots.py");

/// Run the comparison and write its files; returns the results.
pub fn simulate(args: &SimulateArgs) -> anyhow::Result<Value> {
    let wall = std::time::Instant::now();
    let mut costs = match &args.costs {
        Some(dir) => Costs::from_bench(dir).context("while reading the measured costs (--costs)")?,
        None => Costs::built_in().context("while reading the built-in measured costs")?,
    };
    let reports = read_reports(&args.recorded)?;
    if args.costs_from_reports {
        costs = costs.with_reports(&reports);
    }
    if args.virtual_gpus {
        costs.cuda_init_s = 0.0;
        costs.host_to_gpu_bytes_per_s = 0.0;
    }
    let budget = Budget {
        prepared_per_host: args.prepared_per_host,
        idle_seconds_per_session: args.idle_gpu_seconds_per_session,
    };
    let provisioning = match args.hosts {
        Some(h) => Autoscaler::fixed(h, args.gpus_per_host),
        None => Autoscaler::ec2_without_floor(),
    };
    let setup = Setup { costs: &costs, budget, seed: args.seed, only: args.policies.as_deref(), keep_cells: false };
    let run = |key: &str, w, a: Autoscaler, keep_cells: bool| {
        let c = compare(key, w, a, &Setup { keep_cells, ..setup });
        eprintln!("{key}: {} policies in {:.1} s", c.outcomes.len(), wall.elapsed().as_secs_f64());
        c
    };
    let mut main: Vec<Comparison> = vec![];
    let mut extra: Vec<Comparison> = vec![];
    if !reports.is_empty() {
        main.push(run("recorded", recorded_workload(&reports)?, provisioning.clone(), true));
    } else {
        for &n in &args.sessions {
            let w = Synthetic::base(n, args.seed).generate("base");
            main.push(run(&format!("s{n}"), w, provisioning.clone(), false));
            if !args.no_floor_runs && args.hosts.is_none() {
                let w = Synthetic::base(n, args.seed).generate("base");
                extra.push(run(&format!("s{n}_ec2_floor"), w, Autoscaler::ec2(), false));
            }
        }
        if !args.no_trace {
            main.push(run("trace", Trace::adobe(args.seed).generate(), provisioning.clone(), false));
        }
        if let (false, Some(&mid)) = (args.no_variants, args.sessions.get(args.sessions.len() / 2)) {
            for v in VARIANTS {
                let w = Synthetic::base(mid, args.seed).variant(v)?.generate(&format!("base/{v}"));
                extra.push(run(&format!("s{mid}_{v}"), w, provisioning.clone(), false));
            }
        }
    }
    let mut results = serde_json::Map::new();
    let mut plots = serde_json::Map::new();
    for c in main.iter().chain(&extra) {
        results.insert(c.key.clone(), c.to_json());
    }
    for c in &main {
        plots.insert(c.key.clone(), c.plot_json());
    }
    let summary = markdown(&main, &extra, &costs);
    let out = json!({
        "what": "GPU-hours and start delays of each policy on replayed notebook sessions (looseleaf simulate, DESIGN.md section 15)",
        "seed": args.seed,
        "budget": { "prepared_per_host": budget.prepared_per_host, "idle_seconds_per_session": budget.idle_seconds_per_session },
        "costs": costs,
        "costs_summary": costs_summary(&costs),
        "loads": results,
        "wall_seconds": wall.elapsed().as_secs_f64(),
    });
    std::fs::create_dir_all(&args.out).with_context(|| format!("creating {}", args.out.display()))?;
    write(&args.out.join("simulation.json"), &serde_json::to_string_pretty(&out)?)?;
    write(&args.out.join("plot-data.json"), &serde_json::to_string(&Value::Object(plots))?)?;
    write(&args.out.join("summary.md"), &summary)?;
    print!("{summary}");
    if !args.no_plots {
        match plot(args) {
            Ok(()) => eprintln!("plots in {}", args.out.display()),
            Err(e) => eprintln!("no plots: {e:#}"),
        }
    }
    Ok(out)
}

fn write(path: &Path, text: &str) -> anyhow::Result<()> {
    std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))
}

fn read_reports(paths: &[PathBuf]) -> anyhow::Result<Vec<(String, Value)>> {
    paths
        .iter()
        .map(|p| {
            let text = std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?;
            let v: Value = serde_json::from_str(&text).with_context(|| format!("{} is not JSON", p.display()))?;
            Ok((p.display().to_string(), v))
        })
        .collect()
}

fn costs_summary(c: &Costs) -> Value {
    let q = |s: &looseleaf_sim::dist::Samples| json!({ "n": s.values.len(), "p50": s.quantile(0.5), "p95": s.quantile(0.95), "max": s.quantile(1.0) });
    json!({
        "hit_start_ms": q(&c.hit_start_ms),
        "cold_start_ms": q(&c.cold_start_ms),
        "import_tail_ms": q(&c.import_tail_ms),
        "naive_start_ms": q(&c.naive_start_ms),
    })
}

fn markdown(main: &[Comparison], extra: &[Comparison], costs: &Costs) -> String {
    let mut s = String::from("# looseleaf simulate\n\n");
    for c in main.iter().chain(extra) {
        s.push_str(&c.markdown());
        s.push('\n');
    }
    s.push_str(&format!(
        "Costs: LooseLeaf's from {}; cited: CUDA init {} s, host-to-GPU {:.1} GB/s, store {:.0}/{:.0} MB/s down/up, snapshot restore GCR {} s, CRIU {} s.\n",
        costs.sources.join(", "),
        costs.cuda_init_s,
        costs.host_to_gpu_bytes_per_s / 1e9,
        costs.s3_down_bytes_per_s / 1e6,
        costs.s3_up_bytes_per_s / 1e6,
        costs.snapshot_gcr_s,
        costs.snapshot_criu_s
    ));
    s
}

fn plot(args: &SimulateArgs) -> anyhow::Result<()> {
    let python = schemas::locate::python(args.python.as_deref());
    let status = std::process::Command::new(&python)
        .arg("-c")
        .arg(PLOTS)
        .arg(args.out.join("simulation.json"))
        .arg(args.out.join("plot-data.json"))
        .arg(&args.out)
        .status()
        .with_context(|| format!("running {}", python.display()))?;
    anyhow::ensure!(status.success(), "{} exited with {status} (is matplotlib installed?)", python.display());
    Ok(())
}
