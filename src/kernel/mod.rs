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
//! `error` reply with the matching `error` message, naming what went wrong. An
//! embedded cluster heals meanwhile: its nats-server, if it exits, is started
//! again on its port with its JetStream store (`Cluster::keep_nats_up`), the
//! services reconnect by themselves, and the next cell runs with the session's
//! committed state, with no restart of the kernel.

use std::collections::{BTreeMap, VecDeque};
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context as _;
use jupyter_protocol::{ConnectionInfo, JupyterMessage, JupyterMessageContent};
use jupyter_zmq_client as zmq;
use looseleaf_client::api::{CodeAtCursor, CommAnswer, CommMessage, ExecStatus, RunCell, StreamItem};
use looseleaf_client::events::Event;
use looseleaf_client::Frontend;
use serde_json::{json, Value};
use tokio::sync::{mpsc, watch};
use tracing::Instrument as _;
use uuid::Uuid;

use crate::cluster::{Cluster, ClusterOptions};

mod badge;
mod codehelp;
mod complete;

/// The protocol version the kernel speaks.
const PROTOCOL_VERSION: &str = "5.3";

/// The comm target a client (the JupyterLab extension) opens to stream each cell's
/// text as the user types it: the kernel passes the edits on, so that a worker is
/// prepared before Run (ADR 45).
const EDIT_COMM_TARGET: &str = "looseleaf";

/// How many of the session's latest cells completion reads when it infers from
/// the code (no live objects to ask).
const HELP_HISTORY_CELLS: usize = 500;

/// Where the kernel's cells run.
pub struct KernelOptions {
    /// A running frontend; None: start an embedded cluster (ADR 31).
    pub frontend: Option<String>,
    /// Its bearer token.
    pub token: Option<String>,
    /// Every cell serverless (`--all-gpu`).
    pub all_gpu: bool,
    /// Prepare workers while cells are edited.
    pub speculate: bool,
    /// The Python that runs the cells (for `language_info`).
    pub python: PathBuf,
}

/// Which kernelspec directory `install` writes into.
#[derive(Clone, Debug)]
pub enum InstallPlace {
    /// The user's Jupyter data directory.
    User,
    /// The current Python environment's (`sys.prefix`).
    SysPrefix,
    /// `PREFIX/share/jupyter/kernels`.
    Prefix(PathBuf),
}

/// What `looseleaf kernel install` writes.
#[derive(Clone, Debug)]
pub struct Install {
    /// Where.
    pub place: InstallPlace,
    /// The kernel's name (its directory).
    pub name: String,
    /// The name Jupyter shows.
    pub display_name: String,
    /// The frontend the kernel uses (else it starts an embedded cluster).
    pub frontend: Option<String>,
    /// A file holding the frontend's token.
    pub token_file: Option<PathBuf>,
    /// Run every cell serverless.
    pub all_gpu: bool,
}

/// The kernelspec (`kernel.json`) that starts `exe` as a LooseLeaf kernel.
pub fn kernelspec(exe: &Path, install: &Install) -> Value {
    let mut argv = vec![exe.display().to_string(), "kernel".into(), "-f".into(), "{connection_file}".into()];
    if let Some(url) = &install.frontend {
        argv.extend(["--frontend".into(), url.clone()]);
    }
    if let Some(file) = &install.token_file {
        argv.extend(["--token-file".into(), file.display().to_string()]);
    }
    if install.all_gpu {
        argv.push("--all-gpu".into());
    }
    json!({
        "argv": argv,
        "display_name": install.display_name,
        "language": "python",
        "interrupt_mode": "message",
        "metadata": { "debugger": false, "looseleaf": { "all_gpu": install.all_gpu } },
    })
}

/// The Jupyter data directory of this user (`JUPYTER_DATA_DIR`, else XDG's).
fn user_data_dir() -> anyhow::Result<PathBuf> {
    if let Some(dir) = std::env::var_os("JUPYTER_DATA_DIR") {
        return Ok(PathBuf::from(dir));
    }
    if let Some(dir) = std::env::var_os("XDG_DATA_HOME") {
        return Ok(PathBuf::from(dir).join("jupyter"));
    }
    let home = std::env::var_os("HOME").context("neither JUPYTER_DATA_DIR nor HOME is set")?;
    Ok(PathBuf::from(home).join(".local/share/jupyter"))
}

/// `sys.prefix` of the Python environment in use: the active virtual
/// environment, else `python3`'s.
fn sys_prefix() -> anyhow::Result<PathBuf> {
    if let Some(venv) = std::env::var_os("VIRTUAL_ENV") {
        return Ok(PathBuf::from(venv));
    }
    let out = std::process::Command::new("python3")
        .args(["-c", "import sys; print(sys.prefix)"])
        .output()
        .context("--sys-prefix: could not run python3 to find sys.prefix")?;
    anyhow::ensure!(out.status.success(), "--sys-prefix: python3 failed: {}", String::from_utf8_lossy(&out.stderr));
    Ok(PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()))
}

/// Write the kernelspec; returns its directory.
pub fn install(install: &Install) -> anyhow::Result<PathBuf> {
    anyhow::ensure!(
        !install.name.is_empty()
            && install.name.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.')),
        "kernel name {:?}: use letters, digits, '-', '_' and '.' (Jupyter's rule)",
        install.name
    );
    let kernels = match &install.place {
        InstallPlace::User => user_data_dir()?.join("kernels"),
        InstallPlace::SysPrefix => sys_prefix()?.join("share/jupyter/kernels"),
        InstallPlace::Prefix(p) => p.join("share/jupyter/kernels"),
    };
    let dir = kernels.join(&install.name);
    std::fs::create_dir_all(&dir).with_context(|| format!("while creating {}", dir.display()))?;
    let exe = std::env::current_exe().context("while finding the looseleaf binary")?;
    let exe = exe.canonicalize().unwrap_or(exe);
    let spec = serde_json::to_string_pretty(&kernelspec(&exe, install))?;
    let file = dir.join("kernel.json");
    std::fs::write(&file, spec + "\n").with_context(|| format!("while writing {}", file.display()))?;
    Ok(dir)
}

/// The Python version of `python`, for `language_info` ("3" if it cannot be run).
fn python_version(python: &Path) -> String {
    let out = std::process::Command::new(python)
        .args(["-c", "import sys; print('%d.%d.%d' % sys.version_info[:3])"])
        .output();
    match out {
        Ok(o) if o.status.success() => String::from_utf8_lossy(&o.stdout).trim().to_string(),
        _ => "3".into(),
    }
}

/// The kernel's sockets, split into what the main task sends on and what the
/// reader tasks forward.
struct Sockets {
    shell: zmq::RouterSendConnection,
    control: zmq::RouterSendConnection,
    iopub: zmq::KernelIoPubConnection,
    stdin: zmq::RouterSendConnection,
    shell_rx: mpsc::UnboundedReceiver<JupyterMessage>,
    control_rx: mpsc::UnboundedReceiver<JupyterMessage>,
    stdin_rx: mpsc::UnboundedReceiver<JupyterMessage>,
}

/// Forward every message a socket receives. A message that does not verify (its
/// HMAC) or has no header is logged and dropped; one whose content is not what
/// its type says is forwarded with its content as it came (`UnknownMessage`), so
/// that it gets an error reply rather than none (a client never hangs on it).
fn forward(mut recv: zmq::RouterRecvConnection, channel: &'static str) -> mpsc::UnboundedReceiver<JupyterMessage> {
    use zeromq::SocketRecv as _;
    let (tx, rx) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        loop {
            let parsed = match recv.socket.recv().await {
                Ok(multipart) => zmq::RawMessage::from_multipart(multipart, &recv.mac)
                    .map_err(anyhow::Error::from)
                    .and_then(parse_raw),
                Err(e) => {
                    tracing::error!(channel, error = %e, "the channel's socket failed");
                    return;
                }
            };
            match parsed {
                Ok(msg) => {
                    if tx.send(msg).is_err() {
                        return;
                    }
                }
                Err(e) => tracing::warn!(channel, error = %e, "dropped a message that does not verify or parse"),
            }
        }
    });
    rx
}

/// A verified message's parts as a message; content that does not parse as its
/// type is kept as it came.
fn parse_raw(raw: zmq::RawMessage) -> anyhow::Result<JupyterMessage> {
    let [header, parent, metadata, content, buffers @ ..] = raw.jparts.as_slice() else {
        anyhow::bail!("a message of {} parts (at least 4 are needed)", raw.jparts.len());
    };
    let header: jupyter_protocol::Header = serde_json::from_slice(header).context("its header")?;
    let content: Value = serde_json::from_slice(content).context("its content is not JSON")?;
    let content = JupyterMessageContent::from_type_and_content(&header.msg_type, content.clone()).unwrap_or_else(|e| {
        tracing::debug!(msg_type = %header.msg_type, error = %e, "content that does not parse as its type; kept as it came");
        JupyterMessageContent::UnknownMessage(jupyter_protocol::UnknownMessage {
            msg_type: header.msg_type.clone(),
            content,
        })
    });
    Ok(JupyterMessage {
        zmq_identities: raw.zmq_identities,
        header,
        parent_header: serde_json::from_slice(parent).ok(),
        metadata: serde_json::from_slice(metadata).unwrap_or_else(|_| json!({})),
        content,
        buffers: buffers.to_vec(),
        channel: None,
    })
}

/// Whether `text` matches the glob `pattern` (`*` any run, `?` one character), as
/// IPython's history search matches. Iterative (a cell may be megabytes long):
/// on a mismatch, the last `*` takes one more character.
fn glob_match(pattern: &[char], text: &[char]) -> bool {
    let (mut p, mut t) = (0, 0);
    let mut star: Option<(usize, usize)> = None;
    while t < text.len() {
        match pattern.get(p) {
            Some('*') => {
                star = Some((p, t));
                p += 1;
            }
            Some(c) if *c == '?' || *c == text[t] => {
                p += 1;
                t += 1;
            }
            _ => match star {
                Some((sp, st)) => {
                    p = sp + 1;
                    t = st + 1;
                    star = Some((sp, st + 1));
                }
                None => return false,
            },
        }
    }
    pattern[p.min(pattern.len())..].iter().all(|c| *c == '*')
}

async fn bind(info: &ConnectionInfo) -> anyhow::Result<Sockets> {
    let session = Uuid::new_v4().to_string();
    let shell = zmq::create_kernel_shell_connection(info, &session).await.context("binding the shell channel")?;
    let control = zmq::create_kernel_control_connection(info, &session).await.context("binding the control channel")?;
    let iopub = zmq::create_kernel_iopub_connection(info, &session).await.context("binding the iopub channel")?;
    let stdin = zmq::create_kernel_stdin_connection(info, &session).await.context("binding the stdin channel")?;
    let mut heartbeat = zmq::create_kernel_heartbeat_connection(info).await.context("binding the heartbeat")?;
    tokio::spawn(async move { while heartbeat.single_heartbeat().await.is_ok() {} });
    let (shell, shell_recv) = shell.split();
    let (control, control_recv) = control.split();
    let (stdin, stdin_recv) = stdin.split();
    Ok(Sockets {
        shell,
        control,
        iopub,
        stdin,
        shell_rx: forward(shell_recv, "shell"),
        control_rx: forward(control_recv, "control"),
        stdin_rx: forward(stdin_recv, "stdin"),
    })
}

/// A reply or iopub message of `msg_type` with `content`, child of `parent`. The
/// content goes out exactly as given (the worker's outputs are already Jupyter's
/// own messages; a typed round trip would add `null` fields the spec forbids).
fn message(msg_type: &str, content: Value, parent: &JupyterMessage) -> anyhow::Result<JupyterMessage> {
    anyhow::ensure!(content.is_object(), "a {msg_type} message's content must be a JSON object");
    let content = JupyterMessageContent::UnknownMessage(jupyter_protocol::UnknownMessage {
        msg_type: msg_type.to_string(),
        content,
    });
    Ok(JupyterMessage::new(content, Some(parent)))
}

/// A comm message's content as JSON.
fn comm_content(msg: &JupyterMessage) -> Value {
    match &msg.content {
        JupyterMessageContent::UnknownMessage(m) => m.content.clone(),
        other => serde_json::to_value(other).unwrap_or_else(|_| json!({})),
    }
}

/// The session the kernel runs cells in, and the stream of what happens in it.
struct Session {
    fe: Frontend,
    sid: Uuid,
    items: mpsc::UnboundedReceiver<StreamItem>,
    /// The totals the extension's side panel shows.
    tally: badge::SessionTally,
    /// The stream ended between runs (the session is gone, or the frontend was
    /// unreachable for the client's reconnection window): the next run says so.
    ended: bool,
}

impl Session {
    async fn open(fe: &Frontend, opts: &KernelOptions) -> anyhow::Result<Self> {
        let cwd = std::env::current_dir().context("the kernel's working directory")?;
        let sid = fe
            .create_session(&cwd.display().to_string(), opts.all_gpu, opts.speculate)
            .await
            .with_context(|| format!("could not create a session on the LooseLeaf frontend at {}", fe.base()))?;
        let items = fe.events(sid).await.with_context(|| format!("could not follow session {sid}"))?;
        tracing::info!(session = %sid, frontend = fe.base(), "kernel session open");
        Ok(Self { fe: fe.clone(), sid, items, tally: badge::SessionTally::new(), ended: false })
    }
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
    sockets: Sockets,
    /// Shell requests that arrived while a cell ran (answered in order after it).
    pending: VecDeque<JupyterMessage>,
    /// SIGINT: interrupt the running cell, as ipykernel does.
    sigint: mpsc::UnboundedReceiver<()>,
    /// Completion and inspection from the session's code (no live objects).
    codehelp: codehelp::CodeHelp,
    /// Comms open on [`EDIT_COMM_TARGET`].
    edit_comms: std::collections::HashSet<String>,
    /// The last message on an edit comm: the parent of what the kernel tells the
    /// client on those comms between runs (badge states, the session's totals).
    last_edit: Option<JupyterMessage>,
    /// Cells the user pinned to a device (the extension's badge; the notebook keeps
    /// it in the cell's metadata): cell id -> `gpu` or `cpu`.
    pins: std::collections::HashMap<String, &'static str>,
    /// Why the embedded cluster cannot run cells now, while it heals (its
    /// nats-server is down and being started again; see
    /// [`Cluster::keep_nats_up`]): named in the errors of the cells it fails.
    /// None when all is well, or with no embedded cluster.
    cluster_trouble: watch::Receiver<Option<String>>,
}

/// What the reply's `metadata.looseleaf` says, from the run's events: its device
/// and why, the closure's size, the host and slot, how its worker was prepared,
/// and the start delay (from sending Run to hearing the cell start).
fn placement_of(event: &Event, sent: std::time::Instant, into: &mut serde_json::Map<String, Value>) {
    match event {
        Event::Planned { closure, device, device_reason, .. } => {
            into.insert("device".into(), json!(device));
            into.insert("device_reason".into(), json!(device_reason));
            into.insert("closure".into(), json!(closure.len()));
        }
        Event::Started { host, slot, prepare, .. } => {
            into.insert("host".into(), json!(host));
            into.insert("slot".into(), json!(slot));
            into.insert("prepare".into(), json!(prepare));
            into.insert("start_delay_ms".into(), json!(sent.elapsed().as_secs_f64() * 1000.0));
        }
        _ => {}
    }
}

/// How an execution ended, for its reply.
struct Ended {
    ok: bool,
    error: Option<(String, String, Vec<String>)>,
    payload: Vec<Value>,
    /// The results of the request's `user_expressions` (the reply's field).
    user_expressions: Value,
    /// Where and how the cell ran, for the reply's `metadata.looseleaf`.
    placement: serde_json::Map<String, Value>,
}

enum Next {
    Continue,
    Stop,
}

impl Kernel {
    async fn iopub(&mut self, msg_type: &str, content: Value, parent: &JupyterMessage) {
        match message(msg_type, content, parent) {
            Ok(m) => {
                if let Err(e) = self.sockets.iopub.send(m).await {
                    tracing::warn!(error = %e, "could not publish on iopub");
                }
            }
            Err(e) => tracing::warn!(error = %e, "an output was not relayed"),
        }
    }

    async fn status(&mut self, state: &str, parent: &JupyterMessage) {
        self.iopub("status", json!({ "execution_state": state }), parent).await;
    }

    async fn reply_on(&mut self, control: bool, msg_type: &str, content: Value, parent: &JupyterMessage) {
        let sent = match message(msg_type, content, parent) {
            Ok(m) if control => self.sockets.control.send(m).await.map_err(anyhow::Error::from),
            Ok(m) => self.sockets.shell.send(m).await.map_err(anyhow::Error::from),
            Err(e) => Err(e),
        };
        if let Err(e) = sent {
            tracing::warn!(msg_type, error = %e, "could not send a reply");
        }
    }

    fn kernel_info(&self) -> Value {
        json!({
            "status": "ok",
            "protocol_version": PROTOCOL_VERSION,
            "implementation": "looseleaf",
            "implementation_version": env!("CARGO_PKG_VERSION"),
            "language_info": {
                "name": "python",
                "version": self.language_version,
                "mimetype": "text/x-python",
                "file_extension": ".py",
                "pygments_lexer": "ipython3",
                "codemirror_mode": { "name": "ipython", "version": 3 },
                "nbconvert_exporter": "python",
            },
            "banner": format!("LooseLeaf {}: IPython cells on serverless GPUs", env!("CARGO_PKG_VERSION")),
            "help_links": [],
            "debugger": false,
        })
    }

    /// Open the session if there is none (a frontend that was down may be back).
    async fn ensure_session(&mut self) -> Result<(), String> {
        if self.session.is_some() {
            return Ok(());
        }
        match Session::open(&self.fe, &self.opts).await {
            Ok(s) => {
                self.session = Some(s);
                Ok(())
            }
            Err(e) => {
                let why = format!("{e:#}");
                tracing::error!(error = %why, "no LooseLeaf session");
                Err(why)
            }
        }
    }

    /// Serve until shut down.
    async fn serve(&mut self) {
        loop {
            let next = if let Some(msg) = self.pending.pop_front() {
                self.on_shell(msg).await
            } else {
                tokio::select! {
                    Some(msg) = self.sockets.control_rx.recv() => self.on_control(msg).await,
                    Some(msg) = self.sockets.shell_rx.recv() => self.on_shell(msg).await,
                    // between runs: what the session does with the cells being edited
                    item = async { self.session.as_mut()?.items.recv().await },
                        if self.session.as_ref().is_some_and(|s| !s.ended) => {
                        match (item, self.session.as_mut()) {
                            (Some(item), _) => self.follow(&item, None).await,
                            // not reopened here: a new session would lose the user's
                            // state without a word; the next run reports it
                            (None, Some(s)) => {
                                tracing::warn!(session = %s.sid, "the session's event stream ended");
                                s.ended = true;
                            }
                            (None, None) => {}
                        }
                        Next::Continue
                    }
                    Some(()) = self.sigint.recv() => Next::Continue,
                    Some(msg) = self.sockets.stdin_rx.recv() => {
                        // an answer after its cell ended (interrupted meanwhile)
                        tracing::debug!(msg_type = msg.message_type(), "a stdin message with no cell waiting; dropped");
                        Next::Continue
                    }
                    else => Next::Stop,
                }
            };
            if matches!(next, Next::Stop) {
                return;
            }
        }
    }

    async fn on_control(&mut self, msg: JupyterMessage) -> Next {
        match msg.message_type() {
            "interrupt_request" => {
                self.interrupt().await;
                self.reply_on(true, "interrupt_reply", json!({ "status": "ok" }), &msg).await;
                Next::Continue
            }
            "shutdown_request" => self.shutdown(true, msg).await,
            "kernel_info_request" => {
                let info = self.kernel_info();
                self.reply_on(true, "kernel_info_reply", info, &msg).await;
                Next::Continue
            }
            other => {
                self.unsupported(true, other, &msg).await;
                Next::Continue
            }
        }
    }

    async fn interrupt(&mut self) {
        if let Some(s) = &self.session {
            if let Err(e) = s.fe.interrupt(s.sid).await {
                tracing::warn!(error = %e, "could not interrupt");
            }
        }
    }

    async fn shutdown(&mut self, control: bool, msg: JupyterMessage) -> Next {
        let restart = match &msg.content {
            JupyterMessageContent::ShutdownRequest(r) => r.restart,
            _ => false,
        };
        // the session's workers and slots are freed at once (the API's delete)
        if let Some(s) = self.session.take() {
            if let Err(e) = s.fe.delete(s.sid).await {
                tracing::warn!(session = %s.sid, error = %e, "could not delete the session");
            }
        }
        if restart {
            self.execution_count = 0;
            let _ = self.ensure_session().await;
        }
        self.reply_on(control, "shutdown_reply", json!({ "status": "ok", "restart": restart }), &msg).await;
        if restart {
            Next::Continue
        } else {
            Next::Stop
        }
    }

    async fn unsupported(&mut self, control: bool, msg_type: &str, msg: &JupyterMessage) {
        tracing::warn!(msg_type, "a request the kernel does not serve");
        if let Some(reply) = msg_type.strip_suffix("_request").map(|t| format!("{t}_reply")) {
            let content = json!({
                "status": "error",
                "ename": "NotImplementedError",
                "evalue": format!("the LooseLeaf kernel does not serve {msg_type}"),
                "traceback": [],
            });
            self.reply_on(control, &reply, content, msg).await;
        }
    }

    async fn on_shell(&mut self, msg: JupyterMessage) -> Next {
        self.status("busy", &msg).await;
        let next = match msg.message_type() {
            "kernel_info_request" => {
                let info = self.kernel_info();
                self.reply_on(false, "kernel_info_reply", info, &msg).await;
                Next::Continue
            }
            "execute_request" => {
                self.execute(&msg).await;
                Next::Continue
            }
            "is_complete_request" => {
                let code = match &msg.content {
                    JupyterMessageContent::IsCompleteRequest(r) => r.code.clone(),
                    _ => String::new(),
                };
                let (status, indent) = complete::is_complete(&code);
                self.reply_on(false, "is_complete_reply", json!({ "status": status, "indent": indent }), &msg).await;
                Next::Continue
            }
            "history_request" => {
                let request = serde_json::to_value(&msg.content).unwrap_or_default();
                let history = self.history_entries(&request);
                self.reply_on(false, "history_reply", json!({ "status": "ok", "history": history }), &msg).await;
                Next::Continue
            }
            "comm_info_request" => {
                let reply = self.comm(&msg).await;
                let reply = if reply.get("comms").is_some() { reply } else { json!({ "status": "ok", "comms": {} }) };
                self.reply_on(false, "comm_info_reply", reply, &msg).await;
                Next::Continue
            }
            "comm_open" | "comm_msg" | "comm_close" if self.is_edit_comm(&msg) => {
                self.edit_comm(&msg).await;
                Next::Continue
            }
            // ipywidgets: served by the session's CPU worker (ADR 33); no reply
            "comm_open" | "comm_msg" | "comm_close" => {
                self.comm(&msg).await;
                Next::Continue
            }
            "complete_request" | "inspect_request" => {
                let content = self.query(&msg).await;
                let reply = if msg.message_type() == "complete_request" { "complete_reply" } else { "inspect_reply" };
                self.reply_on(false, reply, content, &msg).await;
                Next::Continue
            }
            "shutdown_request" => self.shutdown(false, msg.clone()).await,
            other => {
                let other = other.to_string();
                self.unsupported(false, &other, &msg).await;
                Next::Continue
            }
        };
        self.status("idle", &msg).await;
        next
    }

    /// Tell the client what `item` changed: a cell's badge state, the session's
    /// totals. Nothing is sent unless a client opened an edit comm.
    async fn follow(&mut self, item: &StreamItem, run: Option<badge::CurrentRun<'_>>) {
        // counted whether or not a client listens: one may open a comm later
        let totals = self.session.as_mut().and_then(|s| s.tally.observe(item).then(|| s.tally.message()));
        if self.edit_comms.is_empty() {
            return;
        }
        if let Some(state) = badge::cell_state(item, run) {
            self.tell_edit_comms(state).await;
        }
        if let Some(totals) = totals {
            self.tell_edit_comms(totals).await;
        }
    }

    /// Send `data` on every open edit comm, as children of the last message on one.
    async fn tell_edit_comms(&mut self, data: Value) {
        let Some(parent) = self.last_edit.clone() else { return };
        let ids: Vec<String> = self.edit_comms.iter().cloned().collect();
        for comm_id in ids {
            self.iopub("comm_msg", json!({ "comm_id": comm_id, "data": data }), &parent).await;
        }
    }

    /// Whether `msg` belongs to a comm on [`EDIT_COMM_TARGET`] (one being opened, or
    /// one open).
    fn is_edit_comm(&self, msg: &JupyterMessage) -> bool {
        let content = comm_content(msg);
        match msg.message_type() {
            "comm_open" => content["target_name"] == EDIT_COMM_TARGET,
            "comm_msg" | "comm_close" => content["comm_id"].as_str().is_some_and(|id| self.edit_comms.contains(id)),
            _ => false,
        }
    }

    /// A message on an edit comm:
    /// - `{"action": "edit", "cell_id": ..., "code": ...}` goes to the session as
    ///   that cell's edit. Edits are hints: one that cannot be passed on is logged
    ///   and dropped (its Run still runs the cell).
    /// - `{"action": "pin", "cell_id": ..., "device": "gpu" | "cpu" | null}` pins
    ///   the cell's runs and edits to a device, or unpins it.
    async fn edit_comm(&mut self, msg: &JupyterMessage) {
        let content = comm_content(msg);
        let comm_id = content["comm_id"].as_str().unwrap_or_default().to_string();
        self.last_edit = Some(msg.clone());
        match msg.message_type() {
            "comm_open" => {
                self.edit_comms.insert(comm_id);
                if let Some(totals) = self.session.as_ref().map(|s| s.tally.message()) {
                    self.tell_edit_comms(totals).await;
                }
            }
            "comm_close" => {
                self.edit_comms.remove(&comm_id);
            }
            _ if content["data"]["action"] == "pin" => {
                let data = &content["data"];
                let Some(cell_id) = data["cell_id"].as_str() else {
                    tracing::warn!(%data, "a pin without a cell_id; dropped");
                    return;
                };
                match data["device"].as_str() {
                    Some("gpu") => self.pins.insert(cell_id.to_string(), "gpu"),
                    Some("cpu") => self.pins.insert(cell_id.to_string(), "cpu"),
                    _ => self.pins.remove(cell_id),
                };
            }
            _ => {
                let data = &content["data"];
                let (Some("edit"), Some(cell_id), Some(code)) =
                    (data["action"].as_str(), data["cell_id"].as_str(), data["code"].as_str())
                else {
                    tracing::warn!(%data, "an edit comm message that is not an edit (action, cell_id, code); dropped");
                    return;
                };
                if let Err(why) = self.ensure_session().await {
                    tracing::warn!(error = %why, "an edit was dropped: no LooseLeaf session");
                    return;
                }
                let code = self.pinned(cell_id, code);
                let Some(s) = &self.session else { return };
                if let Err(e) = s.fe.edit(s.sid, cell_id, &code).await {
                    tracing::warn!(cell = cell_id, error = %e, "an edit was dropped");
                }
            }
        }
    }

    /// `code` as the platform gets it: with the placement line of the cell's pin,
    /// unless the code has a placement line of its own (the cell's text wins).
    fn pinned(&self, cell_id: &str, code: &str) -> String {
        let first = code.lines().next().unwrap_or_default().trim_start();
        match self.pins.get(cell_id) {
            Some(device) if !first.starts_with("%%gpu") && !first.starts_with("%%cpu") => {
                format!("%%{device}\n{code}")
            }
            _ => code.to_string(),
        }
    }

    /// Pass a client's comm message to the session's CPU worker and publish what
    /// it caused (comm messages, what callbacks printed) as children of it. A
    /// `comm_open` no worker took is closed, as ipykernel closes one for a target
    /// it lacks, so that the client does not wait on it. Returns the worker's
    /// reply content (for `comm_info_request`).
    async fn comm(&mut self, msg: &JupyterMessage) -> Value {
        use base64::Engine as _;
        let content = comm_content(msg);
        let comm_id = content.get("comm_id").cloned().unwrap_or_else(|| json!(""));
        let request = CommMessage {
            msg_type: msg.message_type().to_string(),
            content,
            metadata: if msg.metadata.is_object() { msg.metadata.clone() } else { json!({}) },
            buffers: msg.buffers.iter().map(|b| base64::engine::general_purpose::STANDARD.encode(b)).collect(),
        };
        let answer = match (self.ensure_session().await, &self.session) {
            (Ok(()), Some(s)) => s.fe.comm(s.sid, &request).await.map_err(|e| e.to_string()),
            (opened, _) => Err(format!("no LooseLeaf session: {}", opened.err().unwrap_or_default())),
        };
        let answer = match answer {
            Ok(a) => a,
            Err(why) => {
                tracing::warn!(msg_type = msg.message_type(), error = %why, "a comm message was not taken");
                CommAnswer { held: false, reply: json!({}), outputs: vec![] }
            }
        };
        if !answer.held && msg.message_type() == "comm_open" {
            self.iopub("comm_close", json!({ "comm_id": comm_id, "data": {} }), msg).await;
        }
        let mut ended = Ended {
            ok: true,
            error: None,
            payload: vec![],
            user_expressions: json!({}),
            placement: Default::default(),
        };
        for output in answer.outputs {
            self.relay(msg, output, false, self.execution_count, &mut ended).await;
        }
        answer.reply
    }

    /// A comm message to the client among a worker's outputs, published as that
    /// Jupyter message (its buffers decoded).
    async fn relay_comm(&mut self, parent: &JupyterMessage, obj: &serde_json::Map<String, Value>) {
        use base64::Engine as _;
        let msg_type = obj.get("msg_type").and_then(Value::as_str).unwrap_or_default();
        if !matches!(msg_type, "comm_open" | "comm_msg" | "comm_close") {
            tracing::warn!(msg_type, "a comm output of no comm message type; dropped");
            return;
        }
        let content = obj.get("content").cloned().unwrap_or_else(|| json!({}));
        let mut m = match message(msg_type, content, parent) {
            Ok(m) => m,
            Err(e) => {
                tracing::warn!(error = %e, "a comm message was not relayed");
                return;
            }
        };
        if let Some(metadata) = obj.get("metadata").filter(|m| m.is_object()) {
            m.metadata = metadata.clone();
        }
        let buffers = obj.get("buffers").and_then(Value::as_array).map(Vec::as_slice).unwrap_or_default();
        for b in buffers {
            match base64::engine::general_purpose::STANDARD.decode(b.as_str().unwrap_or_default()) {
                Ok(bytes) => m.buffers.push(bytes.into()),
                Err(e) => tracing::warn!(error = %e, "a comm message's buffer is not base64; left out"),
            }
        }
        if let Err(e) = self.sockets.iopub.send(m).await {
            tracing::warn!(error = %e, "could not publish a comm message on iopub");
        }
    }

    /// A completion or inspection, answered by the session's live objects (its
    /// CPU worker, through the frontend); an error reply when that cannot be
    /// asked, never a hang.
    async fn query(&mut self, msg: &JupyterMessage) -> Value {
        let raw = serde_json::to_value(&msg.content).unwrap_or_default();
        let code = raw["code"].as_str().unwrap_or_default().to_string();
        let cursor_pos = raw["cursor_pos"].as_u64().unwrap_or(code.chars().count() as u64);
        let detail_level = raw["detail_level"].as_u64().map_or(0, |d| d.min(1) as u8);
        let at = CodeAtCursor { code, cursor_pos, detail_level };
        let opened = self.ensure_session().await;
        let answer = match (&self.session, opened) {
            (None, opened) => Err(format!("no LooseLeaf session: {}", opened.err().unwrap_or_default())),
            (Some(s), _) if msg.message_type() == "complete_request" => {
                s.fe.complete(s.sid, &at).await.map_err(|e| e.to_string())
            }
            (Some(s), _) => s.fe.inspect(s.sid, &at).await.map_err(|e| e.to_string()),
        };
        let answer = answer.unwrap_or_else(
            |why| json!({ "status": "error", "ename": "LooseLeafError", "evalue": why, "traceback": [] }),
        );
        // no live object answered (no CPU worker yet, or every cell serverless):
        // infer from the session's code, as an editor does
        let found_nothing = answer["status"] != "ok"
            || answer["matches"].as_array().is_some_and(Vec::is_empty)
            || answer["found"] == false;
        if !found_nothing {
            return answer;
        }
        let kind = if msg.message_type() == "complete_request" { "complete" } else { "inspect" };
        let skip = self.history.len().saturating_sub(HELP_HISTORY_CELLS);
        let history: Vec<&str> = self.history[skip..].iter().map(|(_, code)| code.as_str()).collect();
        match self.codehelp.ask(kind, &history, &at.code, at.cursor_pos).await {
            Some(inferred) if inferred["status"] == "ok" => inferred,
            _ => answer,
        }
    }

    /// The history a `history_request` asks for (tail, range or search) of this
    /// kernel's stored executions; the session number is 0, the current one.
    fn history_entries(&self, request: &Value) -> Vec<Value> {
        let output = request["output"].as_bool().unwrap_or(false);
        fn last(mut entries: Vec<&(u64, String)>, n: Option<u64>) -> Vec<&(u64, String)> {
            let n = n.map_or(entries.len(), |n| usize::try_from(n).unwrap_or(usize::MAX));
            entries.split_off(entries.len().saturating_sub(n))
        }
        let all: Vec<&(u64, String)> = self.history.iter().collect();
        let chosen = match request["hist_access_type"].as_str() {
            Some("tail") => last(all, Some(request["n"].as_u64().unwrap_or(10))),
            Some("range") => {
                let start = request["start"].as_u64().unwrap_or(0);
                let stop = request["stop"].as_u64().filter(|s| *s > 0).unwrap_or(u64::MAX);
                all.into_iter().filter(|(n, _)| *n >= start && *n < stop).collect()
            }
            Some("search") => {
                let pattern: Vec<char> = request["pattern"].as_str().unwrap_or("*").chars().collect();
                let mut found: Vec<&(u64, String)> = all
                    .into_iter()
                    .filter(|(_, code)| glob_match(&pattern, &code.chars().collect::<Vec<_>>()))
                    .collect();
                if request["unique"].as_bool().unwrap_or(false) {
                    // the latest run of each distinct input
                    let mut seen = std::collections::HashSet::new();
                    found.reverse();
                    found.retain(|(_, code)| seen.insert(code.clone()));
                    found.reverse();
                }
                last(found, request["n"].as_u64())
            }
            _ => all,
        };
        chosen
            .into_iter()
            .map(|(n, code)| if output { json!([0, n, [code, ""]]) } else { json!([0, n, code]) })
            .collect()
    }

    async fn execute(&mut self, msg: &JupyterMessage) {
        let JupyterMessageContent::ExecuteRequest(req) = &msg.content else { return };
        let (code, silent, allow_stdin) = (req.code.clone(), req.silent, req.allow_stdin);
        let user_expressions: BTreeMap<String, String> =
            req.user_expressions.clone().unwrap_or_default().into_iter().collect();
        let store_history = req.store_history && !silent;
        let stop_on_error = req.stop_on_error;
        if store_history {
            self.execution_count += 1;
        }
        let count = self.execution_count;
        if !silent {
            self.iopub("execute_input", json!({ "code": code, "execution_count": count }), msg).await;
        }
        // JupyterLab names the cell; for a client that does not (nbclient), the
        // same code is the same cell (ADR 31)
        let cell_id = msg
            .metadata
            .get("cellId")
            .and_then(Value::as_str)
            .map(str::to_owned)
            .unwrap_or_else(|| format!("code-{:016x}", xxhash_rust::xxh3::xxh3_64(code.as_bytes())));
        // the cell's trace starts at the request Jupyter sent
        let span = tracing::info_span!("execute_request", otel.name = "execute_request", cell = %cell_id,
            msg_id = %msg.header.msg_id);
        let mut ended = match self.ensure_session().instrument(span.clone()).await {
            Ok(()) => {
                let run = RunCell { code: self.pinned(&cell_id, &code), allow_stdin, user_expressions };
                self.run_cell(msg, &cell_id, &run, silent, count).instrument(span).await
            }
            Err(why) => {
                let evalue = format!("no LooseLeaf session: {why}");
                let error = Some(("LooseLeafUnavailable".into(), evalue, vec![]));
                Ended { ok: false, error, payload: vec![], user_expressions: json!({}), placement: Default::default() }
            }
        };
        // the reply is `ok` only for a cell that ran to its end: one the platform
        // could not run, save or follow is an error, whatever else happened
        if !ended.ok && ended.error.is_none() {
            let why = "the cell's outcome is unknown: the kernel lost track of it".to_string();
            ended.error = Some(("LooseLeafError".into(), why, vec![]));
        }
        if let (false, Some((ename, evalue, traceback))) = (ended.ok, &mut ended.error) {
            if traceback.is_empty() {
                // a platform failure (no output said so): shown as the cell's error,
                // with what the kernel knows of its cluster
                let trouble: Option<String> = (*self.cluster_trouble.borrow()).clone();
                if let Some(trouble) = trouble {
                    evalue.push_str(&format!(" ({trouble})"));
                }
                *traceback = vec![format!("{ename}: {evalue}")];
                if !silent {
                    let content = json!({ "ename": ename, "evalue": evalue, "traceback": traceback });
                    self.iopub("error", content, msg).await;
                }
            }
        }
        if store_history {
            self.history.push((count, code));
        }
        let content = match &ended.error {
            None => json!({ "status": "ok", "execution_count": count, "payload": ended.payload,
                            "user_expressions": ended.user_expressions }),
            Some((ename, evalue, traceback)) => json!({
                "status": "error", "execution_count": count, "ename": ename, "evalue": evalue,
                "traceback": traceback, "payload": ended.payload, "user_expressions": {},
            }),
        };
        // after a failed cell with `stop_on_error`, the execute requests that arrived
        // while it ran are aborted (as ipykernel does); later ones run
        if !ended.ok && stop_on_error {
            self.abort_queued_executions().await;
        }
        // where and how it ran, for a client that shows it (the JupyterLab extension)
        match message("execute_reply", content, msg) {
            Ok(mut m) => {
                if !ended.placement.is_empty() {
                    m.metadata = json!({ "looseleaf": ended.placement });
                }
                if let Err(e) = self.sockets.shell.send(m).await {
                    tracing::warn!(error = %e, "could not send an execute reply");
                }
            }
            Err(e) => tracing::warn!(error = %e, "could not build an execute reply"),
        }
    }

    /// Abort the execute requests queued now; other requests are kept.
    async fn abort_queued_executions(&mut self) {
        while let Ok(m) = self.sockets.shell_rx.try_recv() {
            self.pending.push_back(m);
        }
        let queued = std::mem::take(&mut self.pending);
        for m in queued {
            if m.message_type() == "execute_request" {
                self.status("busy", &m).await;
                let content = json!({ "status": "aborted", "execution_count": self.execution_count });
                self.reply_on(false, "execute_reply", content, &m).await;
                self.status("idle", &m).await;
            } else {
                self.pending.push_back(m);
            }
        }
    }

    /// Run the cell and relay what it prints until it is done; the control
    /// channel is served meanwhile.
    async fn run_cell(
        &mut self,
        msg: &JupyterMessage,
        cell_id: &str,
        run: &RunCell,
        silent: bool,
        count: u64,
    ) -> Ended {
        let mut ended = Ended {
            ok: false,
            error: None,
            payload: vec![],
            user_expressions: json!({}),
            placement: Default::default(),
        };
        let Some(session) = &self.session else {
            ended.error = Some(("LooseLeafError".into(), "the kernel has no LooseLeaf session".into(), vec![]));
            return ended;
        };
        let (fe, sid) = (session.fe.clone(), session.sid);
        let sent = std::time::Instant::now();
        let exec_id = match fe.run_cell(sid, cell_id, run).await {
            Ok(accepted) => accepted.exec_id,
            Err(e) => {
                ended.error = Some(("LooseLeafError".into(), format!("the cell was not accepted: {e}"), vec![]));
                return ended;
            }
        };
        loop {
            let item = tokio::select! {
                item = async { self.session.as_mut()?.items.recv().await } => item,
                Some(control) = self.sockets.control_rx.recv() => {
                    if matches!(self.on_control(control).await, Next::Stop) {
                        ended.error = Some(("LooseLeafError".into(), "the kernel was shut down".into(), vec![]));
                        return ended;
                    }
                    continue;
                }
                Some(()) = self.sigint.recv() => {
                    self.interrupt().await;
                    continue;
                }
                Some(reply) = self.sockets.stdin_rx.recv() => {
                    self.answer_input(&fe, sid, exec_id, reply).await;
                    continue;
                }
                // the user edits the next cell while this one runs: its edits go on
                // now (a worker is prepared meanwhile); other requests wait their turn
                Some(request) = self.sockets.shell_rx.recv() => {
                    if self.is_edit_comm(&request) {
                        self.edit_comm(&request).await;
                    } else {
                        self.pending.push_back(request);
                    }
                    continue;
                }
            };
            if let Some(item) = &item {
                self.follow(item, Some(badge::CurrentRun { exec_id, cell_id })).await;
            }
            let Some(item) = item else {
                // the event stream ended: the frontend went away
                self.session = None;
                let why = "lost the LooseLeaf frontend while the cell ran; its outcome is unknown here".to_string();
                ended.error = Some(("LooseLeafError".into(), why, vec![]));
                return ended;
            };
            match item {
                StreamItem::Output { exec_id: e, output, .. } if e == exec_id => {
                    self.relay(msg, output, silent, count, &mut ended).await;
                }
                StreamItem::Event { exec_id: e, event, .. } if e == exec_id => {
                    placement_of(&event, sent, &mut ended.placement);
                }
                StreamItem::Done { exec_id: e, status, error, .. } if e == exec_id => {
                    ended.ok = status == ExecStatus::Ok;
                    if !ended.ok && ended.error.is_none() {
                        let why = error.unwrap_or_else(|| "the cell failed".into());
                        // interrupted before it started: to the user, an interrupt
                        // like any other (a plain kernel says KeyboardInterrupt)
                        let ename = if why == schemas::messages::INTERRUPTED_BEFORE_START {
                            "KeyboardInterrupt"
                        } else {
                            "LooseLeafError"
                        };
                        ended.error = Some((ename.into(), why, vec![]));
                    }
                    return ended;
                }
                _ => {}
            }
        }
    }

    /// The client's answer to the running cell's input request, passed on to it.
    async fn answer_input(&mut self, fe: &Frontend, sid: Uuid, exec_id: Uuid, reply: JupyterMessage) {
        let value = match &reply.content {
            JupyterMessageContent::InputReply(r) => Some(r.value.clone()),
            JupyterMessageContent::UnknownMessage(m) => {
                m.content.get("value").and_then(Value::as_str).map(str::to_owned)
            }
            _ => None,
        };
        let Some(value) = value.filter(|_| reply.message_type() == "input_reply") else {
            tracing::warn!(msg_type = reply.message_type(), "a stdin message that is not an input reply; dropped");
            return;
        };
        if let Err(e) = fe.input(sid, exec_id, &value).await {
            // the cell was interrupted or ended meanwhile: nobody waits for it
            tracing::warn!(%exec_id, error = %e, "the cell did not take the input");
        }
    }

    /// Relay one of the cell's outputs (the worker's own output message) on iopub.
    async fn relay(&mut self, msg: &JupyterMessage, mut output: Value, silent: bool, count: u64, ended: &mut Ended) {
        let Some(obj) = output.as_object_mut() else { return };
        let kind = obj.remove("output_type").and_then(|k| k.as_str().map(str::to_owned)).unwrap_or_default();
        match kind.as_str() {
            "error" => {
                let text = |k: &str| obj.get(k).and_then(Value::as_str).unwrap_or_default().to_string();
                let traceback = obj
                    .get("traceback")
                    .and_then(Value::as_array)
                    .map(|t| t.iter().filter_map(|l| l.as_str().map(str::to_owned)).collect())
                    .unwrap_or_default();
                ended.error = Some((text("ename"), text("evalue"), traceback));
            }
            // the cell called input(): the client is asked on the stdin channel
            // (the frontend sends this only for a run made with allow_stdin)
            schemas::messages::INPUT_REQUEST_OUTPUT => {
                let content = json!({
                    "prompt": obj.get("prompt").cloned().unwrap_or_else(|| json!("")),
                    "password": obj.get("password").cloned().unwrap_or(json!(false)),
                });
                match message("input_request", content, msg) {
                    Ok(m) => {
                        if let Err(e) = self.sockets.stdin.send(m).await {
                            tracing::warn!(error = %e, "could not ask for input on the stdin channel");
                        }
                    }
                    Err(e) => tracing::error!(error = %e, "could not build an input request"),
                }
                return;
            }
            // a comm message (ipywidgets), whether or not the cell is silent
            schemas::messages::COMM_OUTPUT => {
                self.relay_comm(msg, obj).await;
                return;
            }
            // the results of the request's user_expressions, for the reply
            schemas::messages::USER_EXPRESSIONS_OUTPUT => {
                ended.user_expressions = obj.remove("data").unwrap_or_else(|| json!({}));
                return;
            }
            // the text of `obj?` goes to Jupyter's pager, as the reply's payload
            "pager" => {
                let data = obj.get("data").cloned().unwrap_or_else(|| json!({}));
                ended.payload.push(json!({ "source": "page", "data": data, "start": 0 }));
                return;
            }
            "execute_result" => {
                obj.insert("execution_count".into(), json!(count));
            }
            _ => {}
        }
        if silent {
            return;
        }
        self.iopub(&kind, output, msg).await;
    }
}

/// `looseleaf kernel -f CONNECTION_FILE`.
pub async fn serve(connection_file: &Path, opts: KernelOptions, cluster: ClusterOptions) -> anyhow::Result<()> {
    let text = std::fs::read_to_string(connection_file)
        .with_context(|| format!("while reading the connection file {}", connection_file.display()))?;
    let info: ConnectionInfo = serde_json::from_str(&text)
        .with_context(|| format!("{} is not a Jupyter connection file", connection_file.display()))?;
    anyhow::ensure!(
        info.signature_scheme == "hmac-sha256" || info.key.is_empty(),
        "signature scheme {:?} is not supported (hmac-sha256 is)",
        info.signature_scheme
    );
    let (fe, mut embedded) = match &opts.frontend {
        Some(url) => {
            let fe = Frontend::new(url);
            (opts.token.as_ref().map_or(fe.clone(), |t| fe.with_token(t)), None)
        }
        None => {
            tracing::info!(data_dir = %cluster.data_dir.display(), "starting an embedded cluster");
            let mut c = Cluster::start(&cluster).await.context("while starting the embedded cluster")?;
            if let Err(e) = c.wait_ready(cluster.hosts, Duration::from_secs(180)).await {
                c.stop().await;
                return Err(e.context("while waiting for the gpu-hosts"));
            }
            (Frontend::new(&c.frontend_url).with_token(&c.api_token), Some(c))
        }
    };
    let sockets = bind(&info).await?;
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
        language_version: python_version(&opts.python),
        codehelp: codehelp::CodeHelp::new(opts.python.clone()),
        opts,
        fe,
        session: None,
        execution_count: 0,
        history: Vec::new(),
        sockets,
        pending: VecDeque::new(),
        sigint,
        edit_comms: Default::default(),
        last_edit: None,
        pins: Default::default(),
        cluster_trouble,
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
    if let Some(s) = kernel.session.take() {
        // its workers and slots are freed now, not when the session is culled idle
        if let Err(e) = s.fe.delete(s.sid).await {
            tracing::warn!(session = %s.sid, error = %e, "could not delete the kernel's session on exit");
        }
    }
    if let Some(c) = embedded {
        c.stop().await;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::glob_match;

    #[test]
    fn history_search_globs_match_as_ipython_does_even_on_huge_cells() {
        let m = |p: &str, t: &str| glob_match(&p.chars().collect::<Vec<_>>(), &t.chars().collect::<Vec<_>>());
        assert!(m("1?2*", "1+2+3") && m("*", "") && m("a*b*c", "aXbYc") && m("??", "ab"));
        assert!(!m("1?2*", "12+3") && !m("a*b", "ac") && !m("?", "") && !m("abc", "ab"));
        let huge = "x".repeat(4 << 20) + "y";
        assert!(m("*y", &huge) && !m("*z*", &huge));
    }
}
