//! `looseleaf`: the embedded cluster (`up`), notebook runs (`run`) and a status view.

mod analyze;
mod cluster;
mod embed;
mod kernel;
mod local;
mod notebook;
mod outputs;
mod report;
mod run;
mod sessions;
mod simulate;
mod status;

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::{Parser, Subcommand};
use schemas::nats::NatsOptions;

use crate::cluster::{Cluster, ClusterOptions};
use crate::embed::{options, EmbedArgs};

/// LooseLeaf: serverless GPUs for notebooks.
#[derive(Parser, Debug)]
#[command(version)]
struct Cli {
    /// Log filter for this process and the services it embeds.
    #[arg(long, global = true, env = "LOOSELEAF_LOG", default_value = "warn")]
    log: String,
    /// How log lines are written: text (coloured only on a terminal) or json (one
    /// object per line, with trace and span ids).
    #[arg(long, global = true, env = "LOOSELEAF_LOG_FORMAT", value_enum, default_value_t)]
    log_format: schemas::telemetry::LogFormat,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Run NATS, the store, the planner, gpu-hosts and the frontend until Ctrl-C.
    Up {
        /// CPU-backed GPU slots per host instead of probing real GPUs.
        #[arg(long, env = "LOOSELEAF_VIRTUAL_GPUS")]
        virtual_gpus: Option<u32>,
        /// Frontend HTTP port on 127.0.0.1 (0: a free one).
        #[arg(long, env = "LOOSELEAF_PORT", default_value_t = 8470)]
        port: u16,
        /// Directory for NATS data, the object store and host sockets.
        #[arg(long, env = "LOOSELEAF_DATA_DIR", default_value = ".looseleaf")]
        data_dir: PathBuf,
        /// Run each session's workers as a uid of its own from FIRST-LAST (needs
        /// root; a session's working directory must be writable by its uid; ADR 29).
        #[arg(long, env = "LOOSELEAF_SESSION_UIDS")]
        session_uids: Option<String>,
        /// The API's users: a file of `USER TOKEN` lines, readable by its owner only
        /// (default: one user, `local`, with a fresh token in DATA_DIR/api-token).
        /// With two or more, each session's workers run as a uid of their own
        /// (default range 200000-201999; needs root), so no user's cell can read
        /// another's work (ADR 52).
        #[arg(long, env = "LOOSELEAF_USERS")]
        users: Option<PathBuf>,
        /// Let a cluster of several users run every user's cells as the user who
        /// started it (not root, say): any cell can then read every other user's
        /// variables, files, tokens and checkpoints.
        #[arg(long, env = "LOOSELEAF_INSECURE_SHARED_WORKERS")]
        insecure_shared_workers: bool,
        /// Run as the user's local cluster, the one `looseleaf kernel` uses (and
        /// starts in the background when none runs): its data folder is the
        /// user's (`LOOSELEAF_USER_DIR`, else ~/.local/share/looseleaf), its
        /// address is in the user's runtime folder, its port a free one (ADR 65).
        /// `--data-dir`, `--port`, `--users`, `--session-uids` and the NATS options
        /// do not apply to it.
        #[arg(long)]
        local: bool,
        /// With `--local`: stop after this many seconds with no attached session
        /// (0: never); detached sessions stay in the data folder.
        #[arg(long, env = "LOOSELEAF_IDLE_EXIT_S", default_value_t = local::DEFAULT_IDLE_EXIT_S)]
        idle_exit_s: f64,
        /// Use the NATS these options name (`--nats-url` and the login and TLS
        /// flags) instead of starting one; without `--nats-url`, a nats-server is
        /// started in the data directory.
        #[command(flatten)]
        nats: NatsOptions,
        #[command(flatten)]
        embed: EmbedArgs,
    },
    /// Run a notebook's code cells in order and write the executed notebook and a report.
    Run {
        /// The notebook to run (nbformat 4).
        notebook: PathBuf,
        /// Where to write the executed notebook (after every cell); default
        /// NOTEBOOK.looseleaf.ipynb beside the notebook.
        #[arg(long, env = "LOOSELEAF_OUTPUT")]
        output: Option<PathBuf>,
        /// Where to write the per-cell report (JSON; its `$schema` names its JSON
        /// Schema by URL); default NOTEBOOK.looseleaf.json beside the notebook.
        #[arg(long, env = "LOOSELEAF_REPORT")]
        report: Option<PathBuf>,
        /// Run every cell even after one raises; without it the run stops at the
        /// first cell that raises and exits with status 1 (as nbconvert and papermill).
        #[arg(long, env = "LOOSELEAF_ALLOW_ERRORS")]
        allow_errors: bool,
        /// Run a cell again, as a user would, up to this many times when the
        /// platform failed it (a lost host, no host free: nothing of it was committed).
        #[arg(long, env = "LOOSELEAF_RETRIES", default_value_t = 0)]
        retries: u32,
        /// Keep the session and its state after the run (its id is in the report);
        /// by default it is deleted.
        #[arg(long)]
        keep_session: bool,
        /// Treat every code cell as a GPU cell.
        #[arg(long, env = "LOOSELEAF_ALL_GPU")]
        all_gpu: bool,
        /// Use this frontend (e.g. http://127.0.0.1:8470) instead of an embedded cluster.
        #[arg(long, env = "LOOSELEAF_FRONTEND")]
        frontend: Option<String>,
        /// The bearer token for that frontend, if its API asks for one.
        #[arg(long, env = "LOOSELEAF_TOKEN", hide_env_values = true)]
        token: Option<String>,
        /// CPU-backed GPU slots per host of the embedded cluster.
        #[arg(long, env = "LOOSELEAF_VIRTUAL_GPUS", default_value_t = 2)]
        virtual_gpus: u32,
        /// Replay each cell as typed at this many characters a second (edits as the
        /// text grows, then Run), so speculation has the editing time it would get.
        #[arg(long, env = "LOOSELEAF_TYPING_CPS")]
        typing_cps: Option<f64>,
        /// The session's working directory as the gpu-hosts see it (default: the
        /// notebook's folder). For a frontend whose hosts see other paths, such as
        /// compose.yaml's `/notebooks` volume.
        #[arg(long, env = "LOOSELEAF_CWD")]
        cwd: Option<String>,
        /// Do not prepare workers while cells are edited (for comparison).
        #[arg(long, env = "LOOSELEAF_NO_SPECULATION")]
        no_speculation: bool,
        #[command(flatten)]
        embed: EmbedArgs,
    },
    /// A Jupyter kernel whose cells run on LooseLeaf (`looseleaf kernel install`
    /// writes its kernelspec; Jupyter starts `looseleaf kernel -f FILE`).
    #[command(args_conflicts_with_subcommands = true)]
    Kernel {
        #[command(subcommand)]
        action: Option<KernelAction>,
        /// The connection file Jupyter gives the kernel.
        #[arg(short = 'f', long = "connection-file")]
        connection_file: Option<PathBuf>,
        /// Use this frontend instead of the user's local cluster.
        #[arg(long, env = "LOOSELEAF_FRONTEND")]
        frontend: Option<String>,
        /// The bearer token for that frontend.
        #[arg(long, env = "LOOSELEAF_TOKEN", hide_env_values = true)]
        token: Option<String>,
        /// Start a cluster for this kernel alone, stopped with it (its sessions
        /// go with it), instead of using the user's local cluster.
        #[arg(long, env = "LOOSELEAF_OWN_CLUSTER", conflicts_with = "frontend")]
        own_cluster: bool,
        /// A file holding the bearer token (its first line).
        #[arg(long, env = "LOOSELEAF_TOKEN_FILE", conflicts_with = "token_env")]
        token_file: Option<PathBuf>,
        /// The environment variable holding the bearer token: JUPYTERHUB_API_TOKEN
        /// in a JupyterHub user's server, whose frontend serves the Hub's users.
        #[arg(long, env = "LOOSELEAF_TOKEN_ENV")]
        token_env: Option<String>,
        /// Treat every code cell as a GPU cell.
        #[arg(long, env = "LOOSELEAF_ALL_GPU")]
        all_gpu: bool,
        /// Do not prepare workers while cells are edited.
        #[arg(long, env = "LOOSELEAF_NO_SPECULATION")]
        no_speculation: bool,
        /// CPU-backed GPU slots per host of the cluster the kernel starts.
        #[arg(long, env = "LOOSELEAF_VIRTUAL_GPUS", default_value_t = 2)]
        virtual_gpus: u32,
        /// The notebook this kernel runs, where Jupyter does not say
        /// (`JPY_SESSION_NAME`): the next kernel on it resumes its session.
        #[arg(long, env = "LOOSELEAF_NOTEBOOK")]
        notebook: Option<String>,
        #[command(flatten)]
        embed: EmbedArgs,
    },
    /// A user's sessions on a frontend: list them, resume a detached one, or
    /// discard one with its state.
    Sessions {
        #[command(subcommand)]
        action: sessions::SessionsAction,
        /// The frontend (default: the user's local cluster, which must be running).
        #[arg(long, env = "LOOSELEAF_FRONTEND", global = true)]
        frontend: Option<String>,
        /// The bearer token for that frontend.
        #[arg(long, env = "LOOSELEAF_TOKEN", hide_env_values = true, global = true)]
        token: Option<String>,
    },
    /// Print the nats-server configuration LooseLeaf's services log in with: the
    /// bus's message limit, a user per service allowed only what it uses, and an
    /// `operator` user, each password read from the server's environment
    /// (`STORE_NATS_PASSWORD`, ...). compose.yaml's deploy/nats/auth.conf is its output.
    NatsConfig {
        /// Subject prefix the services use.
        #[arg(long, env = "LOOSELEAF_PREFIX", default_value = "ll")]
        prefix: String,
    },
    /// Print each code cell's static state closure, as the planner derives it.
    Analyze {
        /// The notebook (nbformat 4).
        notebook: PathBuf,
        /// Write the per-cell report as JSON here instead of printing.
        #[arg(long)]
        json: Option<PathBuf>,
        /// Also time the analysis of each cell (median µs).
        #[arg(long)]
        time: bool,
    },
    /// Measure edit events per second through a running planner (bench/analysis).
    #[command(hide = true)]
    BenchEdits {
        /// NATS server URL.
        #[arg(long, env = "LOOSELEAF_NATS_URL")]
        nats_url: String,
        /// Subject prefix of the planner.
        #[arg(long, env = "LOOSELEAF_PREFIX")]
        prefix: String,
        /// Edits to publish.
        #[arg(long, default_value_t = 20000)]
        events: u64,
        /// Write the result as JSON here.
        #[arg(long)]
        json: Option<PathBuf>,
    },
    /// Replay notebook sessions on simulated GPU hosts under each provisioning
    /// policy (pinned, NotebookOS, naive, Modal-style, snapshot, LooseLeaf) and
    /// compare GPU-hours and start delays (DESIGN.md section 15).
    Simulate(simulate::SimulateArgs),
    /// Probe a service's `/readyz` or `/healthz` (a container's healthcheck, where
    /// the image has no curl): exit 0 when URL answers 2xx, else say why and exit 1.
    Health {
        /// The probe's URL, e.g. http://127.0.0.1:9464/readyz.
        url: String,
        /// Give up after this many seconds.
        #[arg(long, default_value_t = 5.0)]
        timeout_s: f64,
    },
    /// Show hosts (slots, zygotes, CPU sessions, cache) and the services that answer.
    Status {
        /// The NATS to ask (without `--nats-url`: the one `looseleaf up` recorded in
        /// its data directory, else the default URL). It is tried once, unless
        /// `--nats-connect-wait` asks to wait for it.
        #[command(flatten)]
        nats: NatsOptions,
        /// The data directory of a `looseleaf up` to find.
        #[arg(long, env = "LOOSELEAF_DATA_DIR", default_value = ".looseleaf")]
        data_dir: PathBuf,
        /// Subject prefix.
        #[arg(long, env = "LOOSELEAF_PREFIX", default_value = "ll")]
        prefix: String,
        /// How long to listen for host statuses and service replies (ms).
        #[arg(long, env = "LOOSELEAF_WAIT_MS", default_value_t = 2500)]
        wait_ms: u64,
    },
}

/// What `looseleaf kernel` does besides serving.
#[derive(Subcommand, Debug)]
enum KernelAction {
    /// Write the kernelspec, so Jupyter lists and starts the LooseLeaf kernel.
    Install {
        /// Into this user's Jupyter data directory (the default).
        #[arg(long, conflicts_with_all = ["sys_prefix", "prefix"])]
        user: bool,
        /// Into the active Python environment (`sys.prefix`).
        #[arg(long, conflicts_with = "prefix")]
        sys_prefix: bool,
        /// Into PREFIX/share/jupyter/kernels.
        #[arg(long)]
        prefix: Option<PathBuf>,
        /// The kernel's name.
        #[arg(long, default_value = "looseleaf")]
        name: String,
        /// The name Jupyter shows.
        #[arg(long, default_value = "LooseLeaf (Python)")]
        display_name: String,
        /// The frontend the kernel uses (default: the user's local cluster).
        #[arg(long)]
        frontend: Option<String>,
        /// A file holding the frontend's bearer token.
        #[arg(long, conflicts_with = "token_env")]
        token_file: Option<PathBuf>,
        /// The environment variable that holds the frontend's bearer token when
        /// the kernel starts (`JUPYTERHUB_API_TOKEN` for a JupyterHub's users).
        #[arg(long)]
        token_env: Option<String>,
        /// Run every cell serverless.
        #[arg(long)]
        all_gpu: bool,
    },
}

/// Which of the running subcommand's NATS options were given rather than left at
/// their defaults.
#[derive(Clone, Copy, Debug)]
struct Given {
    /// `--nats-url`.
    nats_url: bool,
    /// `--nats-connect-wait`.
    nats_connect_wait: bool,
}

/// Whether the running subcommand's argument `id` was given (on the command line
/// or in the environment) rather than left at its default.
fn arg_given(matches: &clap::ArgMatches, id: &str) -> bool {
    let Some((_, m)) = matches.subcommand() else { return false };
    // a subcommand without that argument: `value_source` would panic in a debug build
    if m.try_get_raw(id).is_err() {
        return false;
    }
    matches!(m.value_source(id), Some(clap::parser::ValueSource::CommandLine | clap::parser::ValueSource::EnvVariable))
}

async fn up(opts: ClusterOptions) -> anyhow::Result<()> {
    let mut cluster = Cluster::start(&opts).await?;
    cluster.wait_ready(opts.hosts, std::time::Duration::from_secs(180)).await?;
    println!("LooseLeaf is up: frontend {} (NATS {}); Ctrl-C stops it", cluster.frontend_url, cluster.nats_url);
    match &opts.users {
        Some(users) => println!("API users and their tokens: {}", users.display()),
        None => println!("API token (also in {}): {}", opts.data_dir.join("api-token").display(), cluster.api_token),
    }
    let res = tokio::select! {
        () = schemas::telemetry::shutdown_signal() => Ok(()),
        (name, res) = cluster.any_exit() => match res {
            Ok(()) => Err(anyhow::anyhow!("{name} stopped by itself")),
            Err(e) => Err(e.context(format!("{name} failed"))),
        },
    };
    eprintln!("stopping");
    cluster.stop().await;
    res
}

fn main() -> std::process::ExitCode {
    schemas::allocator::keep_freed_memory();
    let matches = <Cli as clap::CommandFactory>::command().get_matches();
    let cli = <Cli as clap::FromArgMatches>::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    let given =
        Given { nats_url: arg_given(&matches, "url"), nats_connect_wait: arg_given(&matches, "connect_wait_s") };
    // a probe (run every few seconds by a healthcheck) neither logs nor traces
    let telemetry = match cli.command {
        Command::Health { .. } => Ok(()),
        _ => schemas::telemetry::init(schemas::telemetry::MANY_COMPONENTS, &cli.log, cli.log_format),
    };
    let result = telemetry.map_err(anyhow::Error::from).and_then(|()| {
        let system = actix_rt::System::new();
        command(cli, given, &system)
    });
    // the last spans (a run's, a kernel's) leave before the process does
    schemas::telemetry::flush();
    exit_code(result)
}

/// An error's exit status, printed as a `main` returning it would (`Error: ` and
/// its chain, status 1); a run a signal stopped said what it wrote already and
/// exits with the signal's status (130 for Ctrl-C), as a shell reports it.
fn exit_code(result: anyhow::Result<()>) -> std::process::ExitCode {
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => match e.downcast_ref::<run::Interrupted>() {
            Some(run::Interrupted(stop)) => std::process::ExitCode::from(stop.exit_code()),
            None => {
                eprintln!("Error: {e:?}");
                std::process::ExitCode::FAILURE
            }
        },
    }
}

fn command(cli: Cli, given: Given, system: &actix_rt::SystemRunner) -> anyhow::Result<()> {
    let nats_given = given.nats_url;
    match cli.command {
        Command::Simulate(args) => simulate::simulate(&args).map(|_| ()),
        Command::Up { local: true, idle_exit_s, virtual_gpus, embed, .. } => {
            let local = local::LocalCluster::of_user()?;
            let opts =
                ClusterOptions { sole_frontend: true, ..options(embed, local.data_dir().into(), virtual_gpus, 0) };
            let idle_exit = (idle_exit_s > 0.0)
                .then(|| Duration::try_from_secs_f64(idle_exit_s))
                .transpose()
                .map_err(|e| anyhow::anyhow!("--idle-exit-s: {e}"))?;
            system.block_on(local::serve(local, opts, idle_exit))
        }
        Command::Up {
            local: false,
            virtual_gpus,
            port,
            data_dir,
            session_uids,
            users,
            insecure_shared_workers,
            nats,
            embed,
            ..
        } => {
            let nats = nats_given.then_some(nats);
            let opts = ClusterOptions {
                session_uids,
                nats,
                users,
                insecure_shared_workers,
                ..options(embed, data_dir, virtual_gpus, port)
            };
            system.block_on(up(opts))
        }
        Command::Run {
            notebook,
            output,
            report,
            allow_errors,
            retries,
            keep_session,
            all_gpu,
            frontend,
            token,
            virtual_gpus,
            typing_cps,
            cwd,
            no_speculation,
            embed,
        } => {
            if let Some(cps) = typing_cps {
                anyhow::ensure!(
                    cps.is_finite() && cps > 0.0,
                    "--typing-cps must be a positive number of characters a second, not {cps}"
                );
            }
            if let Some(cwd) = &cwd {
                // a path on the hosts: nothing here could make a relative one mean the same there
                anyhow::ensure!(
                    cwd.starts_with('/'),
                    "--cwd must be an absolute path, as the hosts see it, not {cwd:?}"
                );
            }
            let tmp = tempfile::Builder::new().prefix("looseleaf-run-").tempdir().context("while making a temp dir")?;
            let opts = options(embed, tmp.path().to_path_buf(), Some(virtual_gpus), 0);
            let (default_output, default_report) = run::default_paths(&notebook);
            let req = run::RunRequest {
                output: output.unwrap_or(default_output),
                report: report.unwrap_or(default_report),
                notebook,
                all_gpu,
                frontend,
                token,
                typing_cps,
                cwd,
                speculate: !no_speculation,
                allow_errors,
                retries,
                keep_session,
            };
            system.block_on(run::run(req, opts))
        }
        Command::Kernel {
            action:
                Some(KernelAction::Install {
                    user: _,
                    sys_prefix,
                    prefix,
                    name,
                    display_name,
                    frontend,
                    token_file,
                    token_env,
                    all_gpu,
                }),
            ..
        } => {
            let place = match (sys_prefix, prefix) {
                (true, _) => kernel::InstallPlace::SysPrefix,
                (false, Some(p)) => kernel::InstallPlace::Prefix(p),
                (false, None) => kernel::InstallPlace::User,
            };
            let token_file = match token_file {
                Some(f) => Some(std::path::absolute(&f).with_context(|| format!("{}", f.display()))?),
                None => None,
            };
            let dir = kernel::install(&kernel::Install {
                place,
                name,
                display_name,
                frontend,
                token_file,
                token_env,
                all_gpu,
            })?;
            println!("installed the LooseLeaf kernelspec in {}", dir.display());
            Ok(())
        }
        Command::Kernel {
            action: None,
            connection_file,
            frontend,
            token,
            own_cluster,
            token_file,
            token_env,
            all_gpu,
            no_speculation,
            virtual_gpus,
            notebook,
            embed,
        } => {
            let connection_file =
                connection_file.context("looseleaf kernel needs -f CONNECTION_FILE (Jupyter gives it)")?;
            let token = match (token, token_file, token_env) {
                (Some(t), _, _) => Some(t),
                (None, Some(f), _) => {
                    let text = std::fs::read_to_string(&f)
                        .with_context(|| format!("while reading the token file {}", f.display()))?;
                    Some(text.lines().next().unwrap_or_default().trim().to_string())
                }
                (None, None, Some(var)) => Some(
                    std::env::var(&var)
                        .ok()
                        .filter(|t| !t.trim().is_empty())
                        .with_context(|| format!("--token-env {var}: the environment has no {var}"))?,
                ),
                (None, None, None) => None,
            };
            let python = schemas::locate::python(embed.python.as_deref());
            let tmp =
                tempfile::Builder::new().prefix("looseleaf-kernel-").tempdir().context("while making a temp dir")?;
            let opts = options(embed, tmp.path().to_path_buf(), Some(virtual_gpus), 0);
            // what Jupyter Server tells a kernel of its notebook, else the flag
            let notebook = std::env::var("JPY_SESSION_NAME").ok().filter(|n| !n.is_empty()).or(notebook);
            let place = match frontend {
                Some(url) => kernel::Place::Frontend { url, token },
                None if own_cluster => kernel::Place::OwnCluster,
                None => kernel::Place::Local(local::LocalCluster::of_user()?),
            };
            let kopts = kernel::KernelOptions { place, all_gpu, speculate: !no_speculation, python, notebook };
            system.block_on(kernel::serve(&connection_file, kopts, opts))
        }
        Command::NatsConfig { prefix } => {
            print!("{}", schemas::local_nats::deployment_config(&prefix));
            Ok(())
        }
        Command::Analyze { notebook, json, time } => analyze::analyze_command(&notebook, json.as_ref(), time),
        Command::BenchEdits { nats_url, prefix, events, json } => {
            system.block_on(analyze::bench_edits(&nats_url, &prefix, events, json.as_ref()))
        }
        Command::Sessions { action, frontend, token } => system.block_on(sessions::sessions(action, frontend, token)),
        Command::Health { url, timeout_s } => system.block_on(status::health(&url, timeout_s)),
        Command::Status { nats, data_dir, prefix, wait_ms } => {
            let target = status::Target::find(nats, nats_given, given.nats_connect_wait, &data_dir);
            system.block_on(status::status(&target, &prefix, Duration::from_millis(wait_ms)))
        }
    }
}
