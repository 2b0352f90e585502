//! The kernel's ZeroMQ side: the connection file Jupyter gives it, the sockets
//! bound from it (shell, control, iopub, stdin, heartbeat; HMAC-signed messages),
//! a reader task per socket forwarding the messages that verify, and the sending
//! half, through which every reply and iopub message goes out.

use std::path::Path;

use anyhow::Context as _;
use jupyter_protocol::{ConnectionInfo, JupyterMessage};
use jupyter_zmq_client as zmq;
use serde_json::{json, Value};
use tokio::sync::mpsc;
use uuid::Uuid;

use super::messages::{message, parse_raw};
use super::Kernel;

/// The connection file Jupyter gives the kernel (`-f CONNECTION_FILE`), with a
/// signature scheme the kernel can verify.
pub(super) fn read_connection_file(connection_file: &Path) -> anyhow::Result<ConnectionInfo> {
    let text = std::fs::read_to_string(connection_file)
        .with_context(|| format!("while reading the connection file {}", connection_file.display()))?;
    let info: ConnectionInfo = serde_json::from_str(&text)
        .with_context(|| format!("{} is not a Jupyter connection file", connection_file.display()))?;
    anyhow::ensure!(
        info.signature_scheme == "hmac-sha256" || info.key.is_empty(),
        "signature scheme {:?} is not supported (hmac-sha256 is)",
        info.signature_scheme
    );
    Ok(info)
}

/// The kernel's sockets, split into what the main task sends on and what the
/// reader tasks forward.
pub(super) struct Sockets {
    pub(super) shell: zmq::RouterSendConnection,
    pub(super) control: zmq::RouterSendConnection,
    pub(super) iopub: zmq::KernelIoPubConnection,
    pub(super) stdin: zmq::RouterSendConnection,
    pub(super) shell_rx: mpsc::UnboundedReceiver<JupyterMessage>,
    pub(super) control_rx: mpsc::UnboundedReceiver<JupyterMessage>,
    pub(super) stdin_rx: mpsc::UnboundedReceiver<JupyterMessage>,
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

pub(super) async fn bind(info: &ConnectionInfo) -> anyhow::Result<Sockets> {
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

/// The sending half: what the main task publishes and replies, a failure logged.
impl Kernel {
    pub(super) async fn iopub(&mut self, msg_type: &str, content: Value, parent: &JupyterMessage) {
        match message(msg_type, content, parent) {
            Ok(m) => {
                if let Err(e) = self.sockets.iopub.send(m).await {
                    tracing::warn!(error = %e, "could not publish on iopub");
                }
            }
            Err(e) => tracing::warn!(error = %e, "an output was not relayed"),
        }
    }

    pub(super) async fn status(&mut self, state: &str, parent: &JupyterMessage) {
        self.iopub("status", json!({ "execution_state": state }), parent).await;
    }

    pub(super) async fn reply_on(&mut self, control: bool, msg_type: &str, content: Value, parent: &JupyterMessage) {
        let sent = match message(msg_type, content, parent) {
            Ok(m) if control => self.sockets.control.send(m).await.map_err(anyhow::Error::from),
            Ok(m) => self.sockets.shell.send(m).await.map_err(anyhow::Error::from),
            Err(e) => Err(e),
        };
        if let Err(e) = sent {
            tracing::warn!(msg_type, error = %e, "could not send a reply");
        }
    }
}
