//! `looseleaf kernel`: a Jupyter kernel whose cells run on LooseLeaf (ADR 31).
//!
//! Jupyter starts `looseleaf kernel -f CONNECTION_FILE` (the kernelspec that
//! `looseleaf kernel install` writes). The kernel speaks the Jupyter messaging
//! protocol over ZeroMQ (`jupyter-zmq-client`: HMAC-signed messages on shell,
//! control, iopub, stdin and heartbeat) and is a client of the frontend's HTTP API
//! (`looseleaf_client`): one kernel is one LooseLeaf session whose working
//! directory is the kernel's (Jupyter starts a kernel in the notebook's folder).
//! An execute request is a Run of the cell Jupyter names (`metadata.cellId`); its
//! outputs, which the worker already sends as Jupyter's own output messages, are
//! relayed on iopub as they arrive; its Done becomes the execute reply. A cell's
//! `input()` reaches the client on the stdin channel and the client's answer goes
//! back through the API (ADR 32).
//!
//! One task owns every socket's sending half; a reader task per socket forwards
//! requests into channels, so that while a cell runs the kernel still answers the
//! control channel (interrupt, shutdown, kernel info) as ipykernel does.
//!
//! Outcomes are honest: a cell's reply is `ok` only if the cell ran to its end; a
//! cell the platform could not run (its cluster lost NATS, no session) is an
//! `error` reply with the matching `error` message, naming what went wrong.
//!
//! Without `--frontend`, the kernel uses the user's local cluster (ADR 65,
//! `crate::local`), starting it if none runs; if it dies, the next cell starts it
//! again and resumes the session there. With `--own-cluster`, a cluster of the
//! kernel's own heals meanwhile: its nats-server, if it exits, is started again
//! on its port with its JetStream store (`Cluster::keep_nats_up`), the services
//! reconnect by themselves, and the next cell runs with the session's committed
//! state, with no restart of the kernel. Any `shutdown_request` ends the process,
//! as ipykernel's: Jupyter starts a new one for a restart.
//!
//! The files, one layer each:
//! - `install`: the kernelspec `looseleaf kernel install` writes.
//! - `connection`: the connection file, the ZeroMQ sockets bound from it (their
//!   messages signed and verified), a reader task per socket, and the sending half.
//! - `messages`: the Jupyter messages themselves: building, reading, `kernel_info`.
//! - `dispatch`: the one loop that routes the shell, control and stdin channels,
//!   SIGINT and the session's stream, between runs and while a cell runs, and the
//!   control and shell requests' handlers.
//! - `execute`: an `execute_request` run on the LooseLeaf cluster, its outputs
//!   relayed, its reply.
//! - `comms`: the extension's edit comm (edits, pins, badges) and ipywidgets' comms.
//! - `queries`: completion, inspection and history.
//! - `complete`, `codehelp`, `badge`: `is_complete_request`; completion inferred
//!   from code; what the extension's badges and side panel show.
//! - this file: the kernel's state (its options, its session) and `serve`, which
//!   starts it and stops it.

use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context as _;
use jupyter_protocol::JupyterMessage;
use looseleaf_client::api::{CreateSession, ResumedSession, SessionCreated, StreamItem};
use looseleaf_client::Frontend;
use tokio::sync::{mpsc, watch};
use uuid::Uuid;

use crate::cluster::{Cluster, ClusterOptions};
use crate::local::LocalCluster;

mod badge;
mod codehelp;
mod comms;
mod complete;
mod connection;
mod cost;
mod dispatch;
mod execute;
mod install;
mod messages;
mod queries;

pub use self::install::{install, Install, InstallPlace};

/// Where the kernel's cells run.
pub enum Place {
    /// The user's local cluster, started if none runs (ADR 65).
    Local(LocalCluster),
    /// A running frontend, with its bearer token.
    Frontend { url: String, token: Option<String> },
    /// A cluster of the kernel's own, stopped with it (ADR 31).
    OwnCluster,
}

/// How the kernel runs cells.
pub struct KernelOptions {
    /// Where.
    pub place: Place,
    /// Every cell serverless (`--all-gpu`).
    pub all_gpu: bool,
    /// Prepare workers while cells are edited.
    pub speculate: bool,
    /// The Python that runs the cells (for `language_info`).
    pub python: PathBuf,
    /// The notebook this kernel runs (Jupyter's `JPY_SESSION_NAME`, else
    /// `--notebook`): its session detaches when the kernel ends, and the next
    /// kernel on the same notebook resumes it.
    pub notebook: Option<String>,
}

/// The session the kernel runs cells in, and the stream of what happens in it.
///
/// On the user's local cluster, a cluster that stopped or died meanwhile is
/// started again before the next cell, and the session resumed in it (see
/// [`Kernel::heal_local`]).
struct Session {
    fe: Frontend,
    sid: Uuid,
    items: mpsc::UnboundedReceiver<StreamItem>,
    /// The totals the extension's side panel shows.
    tally: badge::SessionTally,
    /// What each cell's last run cost, told as it is known.
    costs: cost::RunCosts,
    /// The stream ended between runs (the session is gone, or the frontend was
    /// unreachable for the client's reconnection window): the next run says so.
    ended: bool,
}

impl Session {
    /// A session for the kernel: with `resume`, its notebook's latest detached
    /// session if there is one; and the one line that tells the user what was
    /// resumed (or why a resume gave a fresh session).
    async fn open(fe: &Frontend, opts: &KernelOptions, resume: bool) -> anyhow::Result<(Self, Option<String>)> {
        let cwd = std::env::current_dir().context("the kernel's working directory")?;
        let body = CreateSession {
            cwd: cwd.display().to_string(),
            all_gpu: opts.all_gpu,
            speculate: opts.speculate,
            notebook: opts.notebook.clone(),
            resume: resume && opts.notebook.is_some(),
        };
        let created = fe
            .open_session(&body)
            .await
            .with_context(|| format!("could not create a session on the LooseLeaf frontend at {}", fe.base()))?;
        Self::follow(fe, created).await
    }

    /// Follow the session `created` names; the line that says what it resumed.
    async fn follow(fe: &Frontend, created: SessionCreated) -> anyhow::Result<(Self, Option<String>)> {
        let sid = created.session_id;
        let items = fe.events(sid).await.with_context(|| format!("could not follow session {sid}"))?;
        tracing::info!(session = %sid, frontend = fe.base(), resumed = created.resumed.is_some(), "kernel session open");
        let notice = match (&created.resumed, &created.fresh_because) {
            // one with nothing saved (a restart's) is a fresh session to the user
            (Some(r), _) if r.revision == 0 => None,
            (Some(r), _) => Some(resumed_notice(r)),
            (None, Some(why)) => Some(format!("LooseLeaf: a fresh session: {why}.\n")),
            (None, None) => None,
        };
        Ok((
            Self {
                fe: fe.clone(),
                sid,
                items,
                tally: badge::SessionTally::new(),
                costs: Default::default(),
                ended: false,
            },
            notice,
        ))
    }
}

impl Session {
    /// Stop following the session's events (before it is detached: the
    /// stream's reader would otherwise reconnect and attach it again).
    fn stop_following(&mut self) {
        self.items.close();
        while self.items.try_recv().is_ok() {}
    }
}

/// The line a resumed session's first cell shows.
fn resumed_notice(r: &ResumedSession) -> String {
    let when = r
        .detached_unix_ms
        .map(|ms| {
            let at = std::time::UNIX_EPOCH + Duration::from_millis(ms);
            format!(" saved {}", humantime::format_rfc3339_seconds(at))
        })
        .unwrap_or_default();
    let lost = if r.unsavable.is_empty() {
        String::new()
    } else {
        format!("; not saved, so gone: {}", r.unsavable.join(", "))
    };
    format!(
        "LooseLeaf: resumed this notebook's session{when}: {} variables, {} bytes (revision {}){lost}. `%looseleaf fresh` starts a clean one.\n",
        r.variables, r.bytes, r.revision
    )
}

/// What the main task knows.
struct Kernel {
    opts: KernelOptions,
    fe: Frontend,
    session: Option<Session>,
    execution_count: u64,
    /// (execution count, code) of each stored execution.
    history: Vec<(u64, String)>,
    language_version: String,
    sockets: connection::Sockets,
    /// Shell requests that arrived while a cell ran (answered in order after it);
    /// between runs, the one that just arrived (answered next).
    pending: VecDeque<JupyterMessage>,
    /// SIGINT: interrupt the running cell, as ipykernel does.
    sigint: mpsc::UnboundedReceiver<()>,
    /// Completion and inspection from the session's code (no live objects).
    codehelp: codehelp::CodeHelp,
    /// Comms open on [`EDIT_COMM_TARGET`](comms::EDIT_COMM_TARGET).
    edit_comms: std::collections::HashSet<String>,
    /// The last message on an edit comm: the parent of what the kernel tells the
    /// client on those comms between runs (badge states, the session's totals).
    last_edit: Option<JupyterMessage>,
    /// Cells the user pinned to a device (the extension's badge; the notebook keeps
    /// it in the cell's metadata): cell id -> `gpu` or `cpu`.
    pins: std::collections::HashMap<String, &'static str>,
    /// The revision each of this kernel's executions left (`%looseleaf checkout N`).
    revisions: std::collections::BTreeMap<u64, u64>,
    /// The next session opened resumes the notebook's detached one (false after
    /// a restart or `%looseleaf fresh`: the user asked for a clean one).
    resume: bool,
    /// What the next cell's output says first (a resumed session's line).
    notice: Option<String>,
    /// Why the embedded cluster cannot run cells now, while it heals (its
    /// nats-server is down and being started again; see
    /// [`Cluster::keep_nats_up`]): named in the errors of the cells it fails.
    /// None when all is well, or with no embedded cluster.
    cluster_trouble: watch::Receiver<Option<String>>,
    /// How to start the user's local cluster, if it has to be started again.
    cluster: ClusterOptions,
    /// The local cluster this kernel uses (None: another place).
    local_address: Option<crate::local::Address>,
}

impl Kernel {
    /// Open the session if there is none (a frontend that was down may be back).
    async fn ensure_session(&mut self) -> Result<(), String> {
        self.heal_local().await?;
        if self.session.is_some() {
            return Ok(());
        }
        match Session::open(&self.fe, &self.opts, self.resume).await {
            Ok((s, notice)) => {
                self.session = Some(s);
                // a line already waiting (why a heal gave a fresh session) is kept
                self.notice = self.notice.take().or(notice);
                Ok(())
            }
            Err(e) => {
                let why = format!("{e:#}");
                tracing::error!(error = %why, "no LooseLeaf session");
                Err(why)
            }
        }
    }
}

impl Kernel {
    /// On the user's local cluster: if the one this kernel uses stopped or died
    /// (killed, idle-exited), connect to the one running now, or start it, and
    /// resume this kernel's session there (the new cluster detached it at its
    /// start). Cheap when it still runs: its address file and /proc.
    async fn heal_local(&mut self) -> Result<(), String> {
        let Place::Local(local) = &self.opts.place else { return Ok(()) };
        if self.local_address.as_ref().is_some_and(|a| local.serves(a)) {
            return Ok(());
        }
        tracing::warn!(frontend = self.fe.base(), "the local cluster this kernel used is gone; connecting again");
        let (fe, address) = local.connect_or_start(&self.cluster).await.map_err(|e| format!("{e:#}"))?;
        (self.fe, self.local_address) = (fe, Some(address));
        let Some(mut old) = self.session.take() else { return Ok(()) };
        old.stop_following();
        let resumed = match self.fe.resume(old.sid).await {
            Ok(created) => Session::follow(&self.fe, created).await,
            Err(e) => Err(e.into()),
        };
        match resumed {
            Ok((session, notice)) => {
                self.session = Some(session);
                let said = |n: String| n.strip_prefix("LooseLeaf: ").map(str::to_owned).unwrap_or(n);
                self.notice = notice.map(|n| format!("LooseLeaf: the local cluster was started again; {}", said(n)));
            }
            Err(e) => {
                tracing::error!(session = %old.sid, error = format!("{e:#}"), "could not resume the session");
                self.revisions.clear(); // they were the old session's
                self.notice = Some(format!(
                    "LooseLeaf: the local cluster was started again, and session {} could not be resumed ({e:#}): a \
                     fresh session.\n",
                    old.sid
                ));
            }
        }
        Ok(())
    }
}

/// `looseleaf kernel -f CONNECTION_FILE`.
pub async fn serve(connection_file: &Path, opts: KernelOptions, cluster: ClusterOptions) -> anyhow::Result<()> {
    let info = connection::read_connection_file(connection_file)?;
    // The connection file's ports first: the embedded cluster picks free ports of
    // its own (nats-server, the frontend), and one of those could be a port the
    // client chose for us that nothing holds yet.
    let sockets = connection::bind(&info).await?;
    let (mut local_address, mut embedded): (_, Option<Cluster>) = (None, None);
    let fe = match &opts.place {
        Place::Frontend { url, token } => {
            let fe = Frontend::new(url);
            token.as_ref().map_or(fe.clone(), |t| fe.with_token(t))
        }
        Place::Local(local) => {
            let (fe, address) =
                local.connect_or_start(&cluster).await.context("while connecting to the local cluster")?;
            local_address = Some(address);
            fe
        }
        Place::OwnCluster => {
            tracing::info!(data_dir = %cluster.data_dir.display(), "starting an embedded cluster");
            let mut c = Cluster::start(&cluster).await.context("while starting the embedded cluster")?;
            if let Err(e) = c.wait_ready(cluster.hosts, Duration::from_secs(180)).await {
                c.stop().await;
                return Err(e.context("while waiting for the gpu-hosts"));
            }
            let fe = Frontend::new(&c.frontend_url).with_token(&c.api_token);
            embedded = Some(c);
            fe
        }
    };
    let (sigint_tx, sigint) = mpsc::unbounded_channel();
    let mut interrupts = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt())?;
    tokio::spawn(async move {
        while interrupts.recv().await.is_some() {
            if sigint_tx.send(()).is_err() {
                return;
            }
        }
    });
    let mut terminate = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    let (trouble_tx, cluster_trouble) = watch::channel(None);
    let mut kernel = Kernel {
        language_version: messages::python_version(&opts.python),
        codehelp: codehelp::CodeHelp::new(opts.python.clone()),
        opts,
        fe,
        session: None,
        execution_count: 0,
        revisions: Default::default(),
        history: Vec::new(),
        sockets,
        pending: VecDeque::new(),
        sigint,
        edit_comms: Default::default(),
        last_edit: None,
        pins: Default::default(),
        resume: true,
        notice: None,
        cluster_trouble,
        cluster,
        local_address,
    };
    // a frontend that is not there is said in the log now, and in each cell's
    // reply until it is back
    let _ = kernel.ensure_session().await;
    // the embedded cluster's nats-server, if it exits, is started again meanwhile:
    // the cells after it run with no restart of the kernel
    let supervise = async {
        match embedded.as_mut() {
            Some(c) => c.keep_nats_up(trouble_tx).await,
            None => futures::future::pending().await,
        }
    };
    tokio::select! {
        () = kernel.serve() => {}
        _ = terminate.recv() => {}
        () = supervise => {}
    }
    if let Some(mut s) = kernel.session.take() {
        // its workers and slots are freed now; its state stays for the next
        // kernel on this notebook (ADR 63)
        s.stop_following();
        if let Err(e) = s.fe.detach(s.sid).await {
            tracing::warn!(session = %s.sid, error = %e, "could not detach the kernel's session on exit");
        }
    }
    if let Some(c) = embedded {
        c.stop().await;
    }
    Ok(())
}
