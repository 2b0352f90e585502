//! Comms: the edit comm the JupyterLab extension opens (each cell's text as it is
//! typed, device pins, and what the kernel tells it back: badge states and the
//! session's totals), and every other comm (ipywidgets), passed to the session's
//! CPU worker with what it causes relayed back to the client.

use jupyter_protocol::{JupyterMessage, JupyterMessageContent};
use looseleaf_client::api::{CommAnswer, CommMessage, StreamItem};
use schemas::messages::CommToClient;
use serde_json::{json, Value};

use super::execute::Ended;
use super::messages::message;
use super::{badge, Kernel};

/// The comm target a client (the JupyterLab extension) opens to stream each cell's
/// text as the user types it: the kernel passes the edits on, so that a worker is
/// prepared before Run (ADR 45).
const EDIT_COMM_TARGET: &str = "looseleaf";

/// A comm message's content as JSON.
fn comm_content(msg: &JupyterMessage) -> Value {
    match &msg.content {
        JupyterMessageContent::UnknownMessage(m) => m.content.clone(),
        other => serde_json::to_value(other).unwrap_or_else(|_| json!({})),
    }
}

impl Kernel {
    /// Tell the client what `item` changed: a cell's badge state, the session's
    /// totals. Nothing is sent unless a client opened an edit comm.
    pub(super) async fn follow(&mut self, item: &StreamItem, run: Option<badge::CurrentRun<'_>>) {
        // counted whether or not a client listens: one may open a comm later
        let totals = self.session.as_mut().and_then(|s| s.tally.observe(item).then(|| s.tally.message()));
        let cost = self.session.as_mut().and_then(|s| s.costs.observe(item));
        if self.edit_comms.is_empty() {
            return;
        }
        if let Some(state) = badge::cell_state(item, run) {
            self.tell_edit_comms(state).await;
        }
        if let Some(cost) = cost {
            self.tell_edit_comms(cost).await;
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
    pub(super) fn is_edit_comm(&self, msg: &JupyterMessage) -> bool {
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
    pub(super) async fn edit_comm(&mut self, msg: &JupyterMessage) {
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
    pub(super) fn pinned(&self, cell_id: &str, code: &str) -> String {
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
    pub(super) async fn comm(&mut self, msg: &JupyterMessage) -> Value {
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
        let mut ended = Ended::ok();
        for message in answer.outputs {
            self.relay(msg, message, false, self.execution_count, &mut ended).await;
        }
        answer.reply
    }

    /// A worker's comm message to the client, published as that Jupyter message
    /// (its buffers decoded).
    pub(super) async fn relay_comm(&mut self, parent: &JupyterMessage, comm: CommToClient) {
        use base64::Engine as _;
        let msg_type = comm.msg_type.as_str();
        if !matches!(msg_type, "comm_open" | "comm_msg" | "comm_close") {
            tracing::warn!(msg_type, "a comm message of no comm message type; dropped");
            return;
        }
        let mut m = match message(msg_type, comm.content, parent) {
            Ok(m) => m,
            Err(e) => {
                tracing::warn!(error = %e, "a comm message was not relayed");
                return;
            }
        };
        if comm.metadata.is_object() {
            m.metadata = comm.metadata;
        }
        for b in &comm.buffers {
            match base64::engine::general_purpose::STANDARD.decode(b) {
                Ok(bytes) => m.buffers.push(bytes.into()),
                Err(e) => tracing::warn!(error = %e, "a comm message's buffer is not base64; left out"),
            }
        }
        if let Err(e) = self.sockets.iopub.send(m).await {
            tracing::warn!(error = %e, "could not publish a comm message on iopub");
        }
    }
}
