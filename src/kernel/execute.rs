//! Execution: an `execute_request` run as a Run of its cell on the LooseLeaf
//! cluster, the cell's outputs relayed on iopub (and its `input()` on stdin) as
//! they arrive, and its end turned into an honest `execute_reply`.

use std::collections::BTreeMap;

use jupyter_protocol::{JupyterMessage, JupyterMessageContent};
use looseleaf_client::api::{ExecStatus, RunCell, StateMoved, StreamItem};
use looseleaf_client::events::Event;
use looseleaf_client::Frontend;
use schemas::messages::CellMessage;
use serde_json::{json, Value};
use tracing::Instrument as _;
use uuid::Uuid;

use super::dispatch::Turn;
use super::messages::message;
use super::{badge, Kernel};

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
pub(super) struct Ended {
    pub(super) ok: bool,
    pub(super) error: Option<(String, String, Vec<String>)>,
    pub(super) payload: Vec<Value>,
    /// The results of the request's `user_expressions` (the reply's field).
    pub(super) user_expressions: Value,
    /// Where and how the cell ran, for the reply's `metadata.looseleaf`.
    pub(super) placement: serde_json::Map<String, Value>,
    /// The session's revision after it (the state `%looseleaf checkout N` returns to).
    pub(super) after_revision: Option<u64>,
}

impl Ended {
    /// A cell that ended well, with nothing to say yet.
    pub(super) fn ok() -> Self {
        Ended {
            ok: true,
            error: None,
            payload: vec![],
            user_expressions: json!({}),
            placement: Default::default(),
            after_revision: None,
        }
    }
}

/// A cell being run: what the dispatch loop's turns need while it runs, and how
/// it has ended so far.
pub(super) struct Running<'a> {
    /// Its execute request.
    msg: &'a JupyterMessage,
    fe: Frontend,
    sid: Uuid,
    exec_id: Uuid,
    cell_id: &'a str,
    /// When Run was sent.
    sent: std::time::Instant,
    silent: bool,
    count: u64,
    ended: Ended,
}

impl Running<'_> {
    /// The run, as its badge follows it.
    pub(super) fn current(&self) -> badge::CurrentRun<'_> {
        badge::CurrentRun { exec_id: self.exec_id, cell_id: self.cell_id }
    }
}

/// The kernel's own magics (`%looseleaf ...`): they act on the session, and
/// never reach a worker.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Magic {
    /// Discard the notebook's session for a clean one.
    Fresh,
    /// Move the session's state, or fork it.
    Move(StateMove),
}

/// What `%looseleaf undo`, `checkout N` and `fork` ask of the session's state.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum StateMove {
    /// The session's state before its last cell.
    Undo,
    /// The session's state after execution N (this kernel's `In[N]`).
    Checkout(u64),
    /// A new session holding this state.
    Fork,
}

const MAGIC_USAGE: &str = "%looseleaf fresh | undo | checkout N | fork";

/// The kernel magic `code` is, if it is one (an error for `%looseleaf` with
/// anything else, or with more lines after it).
fn magic(code: &str) -> Option<Result<Magic, String>> {
    let code = code.trim();
    let rest = code.strip_prefix("%looseleaf")?;
    // `%looseleafx` is some other magic
    if !rest.is_empty() && !rest.starts_with(char::is_whitespace) {
        return None;
    }
    if rest.contains('\n') {
        return Some(Err(format!("a `%looseleaf` magic is a cell of its own ({MAGIC_USAGE})")));
    }
    let words: Vec<&str> = rest.split_whitespace().collect();
    Some(match words.as_slice() {
        ["fresh"] => Ok(Magic::Fresh),
        ["undo"] => Ok(Magic::Move(StateMove::Undo)),
        ["fork"] => Ok(Magic::Move(StateMove::Fork)),
        ["checkout", n] => n
            .parse()
            .map(|n| Magic::Move(StateMove::Checkout(n)))
            .map_err(|_| format!("`{n}` is not an execution number; usage: {MAGIC_USAGE}")),
        _ => Err(format!("usage: {MAGIC_USAGE}")),
    })
}

impl Kernel {
    pub(super) async fn execute(&mut self, msg: &JupyterMessage) {
        let JupyterMessageContent::ExecuteRequest(req) = &msg.content else { return };
        let (code, silent, allow_stdin) = (req.code.clone(), req.silent, req.allow_stdin);
        let user_expressions: BTreeMap<String, String> =
            req.user_expressions.clone().unwrap_or_default().into_iter().collect();
        let store_history = req.store_history && !silent;
        let stop_on_error = req.stop_on_error;
        // a cell of whitespace alone is nothing to IPython: no count, no history,
        // no run; ipykernel still announces it with the next count
        if code.trim().is_empty() && user_expressions.is_empty() {
            if !silent {
                let next = self.execution_count + 1;
                self.iopub("execute_input", json!({ "code": code, "execution_count": next }), msg).await;
            }
            let content = json!({ "status": "ok", "execution_count": self.execution_count, "payload": [],
                                  "user_expressions": {} });
            self.reply_on(false, "execute_reply", content, msg).await;
            return;
        }
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
        let span = tracing::info_span!("execute_request", otel.name = "execute_request",
            looseleaf.cell_id = %cell_id, looseleaf.jupyter.msg_id = %msg.header.msg_id);
        let opened = if let Some(magic) = magic(&code) {
            self.kernel_magic(magic, msg, silent).await
        } else {
            self.ensure_session().instrument(span.clone()).await.map(|()| None)
        };
        let mut ended = match opened {
            // a `%looseleaf` magic ran (it is the kernel's, not the cell's)
            Ok(Some(ended)) => ended,
            Ok(None) => {
                if let (Some(notice), false) = (self.notice.take(), silent) {
                    self.iopub("stream", json!({ "name": "stderr", "text": notice }), msg).await;
                }
                let run = RunCell { code: self.pinned(&cell_id, &code), allow_stdin, user_expressions };
                self.run_cell(msg, &cell_id, &run, silent, count).instrument(span).await
            }
            Err(why) => {
                let evalue = format!("no LooseLeaf session: {why}");
                let error = Some(("LooseLeafUnavailable".into(), evalue, vec![]));
                Ended { ok: false, error, ..Ended::ok() }
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
            if let Some(revision) = ended.after_revision {
                self.revisions.insert(count, revision);
            }
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

    /// Run a `%looseleaf` magic: what it did is printed; a magic that could not
    /// be done is the cell's error.
    async fn kernel_magic(
        &mut self,
        magic: Result<Magic, String>,
        msg: &JupyterMessage,
        silent: bool,
    ) -> Result<Option<Ended>, String> {
        let done = match magic {
            Ok(Magic::Fresh) => return self.fresh_session(msg, silent).await,
            Err(usage) => Err(usage),
            Ok(Magic::Move(asked)) => {
                self.ensure_session().await?;
                self.move_state(asked).await
            }
        };
        match done {
            Ok(text) => {
                if !silent {
                    self.iopub("stream", json!({ "name": "stdout", "text": text }), msg).await;
                }
                Ok(Some(Ended::ok()))
            }
            Err(why) => {
                Ok(Some(Ended { ok: false, error: Some(("LooseLeafError".into(), why, vec![])), ..Ended::ok() }))
            }
        }
    }

    /// `%looseleaf undo`, `checkout N` and `fork`: what the session's state did,
    /// in one line for the user.
    async fn move_state(&mut self, asked: StateMove) -> Result<String, String> {
        let Some(session) = &self.session else { return Err("the kernel has no LooseLeaf session".into()) };
        let (fe, sid) = (session.fe.clone(), session.sid);
        let holds = |m: &StateMoved| {
            let lost = if m.unsavable.is_empty() {
                String::new()
            } else {
                format!("; not saved, so not in it: {}", m.unsavable.join(", "))
            };
            format!("{} variables, {} bytes{lost}", m.variables, m.bytes)
        };
        let kept = "Outputs stay as they are, and files cells wrote are not undone.";
        match asked {
            StateMove::Undo => {
                let m = fe.undo(sid).await.map_err(|e| format!("undo: {}", e.detail()))?;
                Ok(format!(
                    "LooseLeaf: undone: the session's state is back to revision {}'s ({}). {kept}\n",
                    m.state_of,
                    holds(&m)
                ))
            }
            StateMove::Checkout(n) => {
                let Some(&revision) = self.revisions.get(&n) else {
                    let known = match (self.revisions.keys().next(), self.revisions.keys().last()) {
                        (Some(lo), Some(hi)) => format!("it ran executions {lo} to {hi}"),
                        _ => "it has run none yet".into(),
                    };
                    return Err(format!("execution {n} is not one this kernel ran ({known})"));
                };
                let m = fe.checkout(sid, revision).await.map_err(|e| format!("checkout: {}", e.detail()))?;
                Ok(format!(
                    "LooseLeaf: the session's state is execution {n}'s again (revision {}: {}). {kept}\n",
                    m.state_of,
                    holds(&m)
                ))
            }
            StateMove::Fork => {
                let m = fe.fork(sid).await.map_err(|e| format!("fork: {}", e.detail()))?;
                Ok(format!(
                    "LooseLeaf: forked: session {} holds this state ({}); this notebook stays on session {sid}. \
                     `looseleaf sessions resume {}` (or any API request on it) opens it.\n",
                    m.session_id,
                    holds(&m),
                    m.session_id
                ))
            }
        }
    }

    /// `%looseleaf fresh`: the notebook's session is deleted with its state and a
    /// clean one opens (as a restart would, keeping the kernel).
    async fn fresh_session(&mut self, msg: &JupyterMessage, silent: bool) -> Result<Option<Ended>, String> {
        if let Some(s) = self.session.take() {
            if let Err(e) = s.fe.delete(s.sid).await {
                tracing::warn!(session = %s.sid, error = %e, "could not delete the session for a fresh one");
            }
        }
        self.resume = false;
        self.revisions.clear();
        self.ensure_session().await?;
        self.notice = None;
        if !silent {
            let text = "LooseLeaf: a fresh session: every variable is gone.\n";
            self.iopub("stream", json!({ "name": "stdout", "text": text }), msg).await;
        }
        Ok(Some(Ended::ok()))
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
    /// channel is served meanwhile (the dispatch loop's turns, with the cell
    /// running).
    async fn run_cell(
        &mut self,
        msg: &JupyterMessage,
        cell_id: &str,
        run: &RunCell,
        silent: bool,
        count: u64,
    ) -> Ended {
        let mut ended = Ended { ok: false, ..Ended::ok() };
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
        let mut running = Running { msg, fe, sid, exec_id, cell_id, sent, silent, count, ended };
        loop {
            match self.turn(Some(&mut running)).await {
                Turn::Continue => {}
                Turn::Stop => {
                    running.ended.error = Some(("LooseLeafError".into(), "the kernel was shut down".into(), vec![]));
                    return running.ended;
                }
                Turn::RunEnded => return running.ended,
            }
        }
    }

    /// What the session's stream brings while `run` runs (None: the stream
    /// ended): its outputs relayed, its placement noted; [`Turn::RunEnded`] once
    /// the run is over (`run.ended` says how).
    pub(super) async fn on_run_item(&mut self, run: &mut Running<'_>, item: Option<StreamItem>) -> Turn {
        let Some(item) = item else {
            // the event stream ended: the frontend went away
            self.session = None;
            let why = "lost the LooseLeaf frontend while the cell ran; its outcome is unknown here".to_string();
            run.ended.error = Some(("LooseLeafError".into(), why, vec![]));
            return Turn::RunEnded;
        };
        match item {
            StreamItem::Output { exec_id: e, output, .. } if e == run.exec_id => {
                self.relay(run.msg, output, run.silent, run.count, &mut run.ended).await;
            }
            StreamItem::Event { exec_id: e, event, .. } if e == run.exec_id => {
                placement_of(&event, run.sent, &mut run.ended.placement);
            }
            StreamItem::Done { exec_id: e, status, error, after_revision, .. } if e == run.exec_id => {
                run.ended.after_revision = Some(after_revision);
                run.ended.ok = status == ExecStatus::Ok;
                if !run.ended.ok && run.ended.error.is_none() {
                    let why = error.unwrap_or_else(|| "the cell failed".into());
                    // interrupted before it started: to the user, an interrupt
                    // like any other (a plain kernel says KeyboardInterrupt)
                    let ename = if why == schemas::messages::INTERRUPTED_BEFORE_START {
                        "KeyboardInterrupt"
                    } else {
                        "LooseLeafError"
                    };
                    run.ended.error = Some((ename.into(), why, vec![]));
                }
                return Turn::RunEnded;
            }
            _ => {}
        }
        Turn::Continue
    }

    /// The client's answer to the running cell's input request, passed on to it.
    pub(super) async fn answer_input(&mut self, run: &Running<'_>, reply: JupyterMessage) {
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
        let (fe, sid, exec_id) = (&run.fe, run.sid, run.exec_id);
        if let Err(e) = fe.input(sid, exec_id, &value).await {
            // the cell was interrupted or ended meanwhile: nobody waits for it
            tracing::warn!(%exec_id, error = %e, "the cell did not take the input");
        }
    }

    /// Pass on what the cell sent its client, each kind on its Jupyter channel:
    /// outputs on iopub, an input request on stdin, comm messages on iopub whether
    /// or not the cell is silent, user expressions and the pager into the reply.
    pub(super) async fn relay(
        &mut self,
        msg: &JupyterMessage,
        sent: CellMessage,
        silent: bool,
        count: u64,
        ended: &mut Ended,
    ) {
        match sent {
            CellMessage::Output(output) => self.relay_output(msg, output, silent, count, ended).await,
            // the cell called input(): the client is asked on the stdin channel
            // (the frontend sends this only for a run made with allow_stdin)
            CellMessage::InputRequest { prompt, password } => {
                match message("input_request", json!({ "prompt": prompt, "password": password }), msg) {
                    Ok(m) => {
                        if let Err(e) = self.sockets.stdin.send(m).await {
                            tracing::warn!(error = %e, "could not ask for input on the stdin channel");
                        }
                    }
                    Err(e) => tracing::error!(error = %e, "could not build an input request"),
                }
            }
            CellMessage::Comm(comm) => self.relay_comm(msg, comm).await,
            CellMessage::UserExpressions(data) => ended.user_expressions = data,
            // the text of `obj?` goes to Jupyter's pager, as the reply's payload
            CellMessage::Pager { data, start } => {
                ended.payload.push(json!({ "source": "page", "data": data, "start": start }))
            }
        }
    }

    /// Publish one notebook output on iopub (an error also ends the reply as one).
    async fn relay_output(
        &mut self,
        msg: &JupyterMessage,
        mut output: Value,
        silent: bool,
        count: u64,
        ended: &mut Ended,
    ) {
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

#[cfg(test)]
mod tests {
    use super::{magic, Magic, StateMove};

    #[test]
    fn kernel_magics_are_told_from_cells_and_bad_ones_named() {
        assert_eq!(magic("%looseleaf undo"), Some(Ok(Magic::Move(StateMove::Undo))));
        assert_eq!(magic("  %looseleaf   checkout 12 \n"), Some(Ok(Magic::Move(StateMove::Checkout(12)))));
        assert_eq!(magic("%looseleaf fork"), Some(Ok(Magic::Move(StateMove::Fork))));
        assert_eq!(magic("%looseleaf fresh"), Some(Ok(Magic::Fresh)));
        assert_eq!(magic("x = 1"), None);
        assert_eq!(magic("%looseleafy undo"), None);
        for bad in [
            "%looseleaf",
            "%looseleaf undo 3",
            "%looseleaf checkout",
            "%looseleaf checkout x",
            "%looseleaf undo\nx = 1",
        ] {
            let err = magic(bad).unwrap().unwrap_err();
            assert!(err.contains("%looseleaf fresh | undo | checkout N | fork"), "{bad}: {err}");
        }
    }
}
