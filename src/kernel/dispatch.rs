//! Dispatch: the one loop that routes what arrives (the shell, control and stdin
//! channels, SIGINT, the session's stream), both between runs and while a cell
//! runs, and the handling of each control and shell request.

use jupyter_protocol::{JupyterMessage, JupyterMessageContent};
use looseleaf_client::api::StreamItem;
use serde_json::json;

use super::execute::Running;
use super::messages::kernel_info;
use super::{complete, Kernel};

enum Next {
    Continue,
    Stop,
}

/// What one turn of the loop leaves to whoever loops.
pub(super) enum Turn {
    /// Wait for what comes next.
    Continue,
    /// The kernel was shut down (the control channel said so; or, between runs,
    /// every channel closed).
    Stop,
    /// The running cell is over (its [`Running`] says how).
    RunEnded,
}

/// What arrived, of what a turn waits on.
enum Arrived {
    Control(JupyterMessage),
    Shell(JupyterMessage),
    /// The session's stream (None: it ended).
    Item(Option<StreamItem>),
    Sigint,
    Stdin(JupyterMessage),
    /// Every channel closed, and nothing to read from the session.
    Closed,
}

impl Kernel {
    /// Serve until shut down: each shell request in turn (those queued first),
    /// and between them whatever else arrives.
    pub(super) async fn serve(&mut self) {
        loop {
            let next = if let Some(msg) = self.pending.pop_front() {
                self.on_shell(msg).await
            } else {
                match self.turn(None).await {
                    Turn::Stop => Next::Stop,
                    Turn::Continue | Turn::RunEnded => Next::Continue,
                }
            };
            if matches!(next, Next::Stop) {
                return;
            }
        }
    }

    /// One turn of the loop: wait for what arrives first and route it. `run` is
    /// the cell running, if one is (`run_cell` loops on these turns until it is
    /// over); between runs (None) shell requests are queued for `serve` to answer,
    /// in order. The control channel is served either way, as ipykernel does.
    pub(super) async fn turn(&mut self, run: Option<&mut Running<'_>>) -> Turn {
        let arrived = tokio::select! {
            Some(msg) = self.sockets.control_rx.recv() => Arrived::Control(msg),
            Some(msg) = self.sockets.shell_rx.recv() => Arrived::Shell(msg),
            // between runs: what the session does with the cells being edited, until
            // its stream ends; while a cell runs, also what the cell does (and if
            // there is no session, or its stream ended, the run hears so at once)
            item = async { self.session.as_mut()?.items.recv().await },
                if run.is_some() || self.session.as_ref().is_some_and(|s| !s.ended) => Arrived::Item(item),
            Some(()) = self.sigint.recv() => Arrived::Sigint,
            Some(msg) = self.sockets.stdin_rx.recv() => Arrived::Stdin(msg),
            // never while a cell runs: the session's branch is always enabled then
            else => Arrived::Closed,
        };
        match arrived {
            Arrived::Control(msg) => match self.on_control(msg).await {
                Next::Continue => Turn::Continue,
                Next::Stop => Turn::Stop,
            },
            Arrived::Shell(msg) => {
                if run.is_some() && self.is_edit_comm(&msg) {
                    // the user edits the next cell while this one runs: its edits go on
                    // now (a worker is prepared meanwhile); other requests wait their turn
                    self.edit_comm(&msg).await;
                } else {
                    // between runs the queue is empty: `serve` answers it next
                    self.pending.push_back(msg);
                }
                Turn::Continue
            }
            Arrived::Item(item) => {
                if let Some(item) = &item {
                    self.follow(item, run.as_deref().map(|r| r.current())).await;
                }
                match run {
                    Some(run) => self.on_run_item(run, item).await,
                    None => {
                        // the stream ended between runs,
                        // not reopened here: a new session would lose the user's
                        // state without a word; the next run reports it
                        if let (None, Some(s)) = (item, self.session.as_mut()) {
                            tracing::warn!(session = %s.sid, "the session's event stream ended");
                            s.ended = true;
                        }
                        Turn::Continue
                    }
                }
            }
            // SIGINT: interrupt the running cell, as ipykernel does
            Arrived::Sigint => {
                if run.is_some() {
                    self.interrupt().await;
                }
                Turn::Continue
            }
            Arrived::Stdin(msg) => {
                match run {
                    Some(run) => self.answer_input(run, msg).await,
                    // an answer after its cell ended (interrupted meanwhile)
                    None => {
                        tracing::debug!(msg_type = msg.message_type(), "a stdin message with no cell waiting; dropped");
                    }
                }
                Turn::Continue
            }
            Arrived::Closed => Turn::Stop,
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
                let info = kernel_info(&self.language_version);
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
        // the session's workers and slots are freed at once. Jupyter's "Restart
        // kernel" is a fresh session, as users expect (the old one is deleted);
        // any other end detaches it, for the next kernel on this notebook (ADR 63)
        if let Some(mut s) = self.session.take() {
            // stop following its events first: a reconnection of this kernel's
            // own stream would attach the session again
            s.stop_following();
            let done = if restart {
                s.fe.delete(s.sid).await
            } else {
                s.fe.detach(s.sid).await.map(|d| {
                    // Jupyter's log is where a closing notebook's user can read it
                    if !d.unsavable.is_empty() {
                        tracing::warn!(session = %s.sid, names = %d.unsavable.join(", "),
                            "the session is detached; these names could not be saved and are gone");
                    }
                })
            };
            if let Err(e) = done {
                tracing::warn!(session = %s.sid, error = %e, restart, "could not end the session");
            }
        }
        // a cluster of the kernel's own ends with it: nothing to leave there
        if restart && !matches!(self.opts.place, super::Place::OwnCluster) {
            // Jupyter starts a new kernel process, as ipykernel's exits: it resumes
            // the notebook's latest detached session, so that one is left empty
            self.resume = false;
            if self.ensure_session().await.is_ok() {
                if let Some(mut s) = self.session.take() {
                    s.stop_following();
                    if let Err(e) = s.fe.detach(s.sid).await {
                        tracing::warn!(session = %s.sid, error = %e, "could not leave a fresh session for the restart");
                    }
                }
            }
        }
        self.reply_on(control, "shutdown_reply", json!({ "status": "ok", "restart": restart }), &msg).await;
        Next::Stop
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
                let info = kernel_info(&self.language_version);
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
}
