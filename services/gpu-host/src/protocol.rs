//! The host side of the worker protocol (`python/looseleaf_worker/worker-protocol.json`, read by
//! both sides' tests): length-prefixed JSON frames over a Unix socket.
//!
//! Bulk bytes never travel here; regions point into files in /dev/shm. (These are
//! JSON frames, not bincode, so optional fields may be omitted when empty.)

use std::collections::BTreeMap;
use std::time::Duration;

use schemas::checkpoint::Delta;
use schemas::messages::{CellMessage, CommToClient};
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;

/// Largest frame either side sends (the protocol file's `max_frame_bytes`).
pub const MAX_FRAME_BYTES: usize = 64 << 20;

/// `[offset, length]` into a message's shm file.
pub type Region = [u64; 2];

/// A variable to restore.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct VarRestore {
    /// Root object, or None for a module.
    pub oid: Option<String>,
    /// The version the worker will hold.
    pub version: String,
    /// Module to import and bind, for module references.
    pub module: Option<String>,
}

/// Where an object's record and payloads are in the restore file.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ObjRestore {
    /// The pickle.
    pub record: Region,
    /// Payload buffers, in PayloadRef order.
    pub payloads: Vec<Region>,
}

/// An error output's fields.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ErrorInfo {
    /// Exception class name.
    pub ename: String,
    /// Exception message.
    pub evalue: String,
    /// Formatted traceback lines.
    #[serde(default)]
    pub traceback: Vec<String>,
}

/// What a request sends its client, as frames carry it (`CellMessage` in the
/// protocol file: one key names its kind); made a `schemas::messages::CellMessage`
/// as it arrives, the one conversion on the host.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WorkerMessage {
    /// A notebook output, or a change to those shown.
    Output(serde_json::Value),
    /// A comm message to the client.
    Comm {
        /// comm_open, comm_msg or comm_close.
        msg_type: String,
        /// The Jupyter message's content.
        content: serde_json::Value,
        /// Its metadata.
        metadata: serde_json::Value,
        /// Its buffers, base64.
        buffers: Vec<String>,
    },
    /// The text of `obj?`, for a pager.
    Pager {
        /// The mime bundle.
        data: serde_json::Value,
        /// The line to start at.
        #[serde(default)]
        start: u64,
    },
    /// The results of the run's user expressions.
    UserExpressions {
        /// name -> result.
        data: serde_json::Value,
    },
}

impl From<WorkerMessage> for CellMessage {
    fn from(m: WorkerMessage) -> CellMessage {
        match m {
            WorkerMessage::Output(output) => CellMessage::Output(output),
            WorkerMessage::Comm { msg_type, content, metadata, buffers } => {
                CellMessage::Comm(CommToClient { msg_type, content, metadata, buffers })
            }
            WorkerMessage::Pager { data, start } => CellMessage::Pager { data, start },
            WorkerMessage::UserExpressions { data } => CellMessage::UserExpressions(data),
        }
    }
}

/// Every control message, tagged by `type` as in the protocol file.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Frame {
    /// First frame of every connection.
    Hello {
        /// "zygote" or "worker".
        role: String,
        /// Zygote or worker id.
        id: String,
        /// Process id.
        pid: u32,
        /// Zygote: packages imported.
        #[serde(default)]
        packages: Vec<String>,
        /// Zygote: import time.
        #[serde(default)]
        import_ms: f64,
        /// Zygote: packages that initialised CUDA.
        #[serde(default)]
        cuda_unsafe: Vec<String>,
        /// Zygote: packages that failed to import.
        #[serde(default)]
        import_errors: BTreeMap<String, String>,
        /// Zygote: the interpreter's standard-library module names.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        stdlib: Vec<String>,
        /// Zygote: top-level modules loaded in it.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        loaded: Vec<String>,
        /// Worker: the zygote it was forked from.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        zygote_id: Option<String>,
    },
    /// host -> zygote: fork a worker.
    Fork {
        /// New worker's id.
        worker_id: String,
        /// Environment to set in the child.
        env: BTreeMap<String, String>,
        /// Working directory of the child.
        cwd: String,
        /// Socket the child connects to.
        socket: String,
        /// The uid (and gid) it runs as once connected; absent: the zygote's.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        uid: Option<u32>,
    },
    /// host -> zygote: fork a child zygote that adds tail packages.
    SpawnZygote {
        /// The child's id.
        zygote_id: String,
        /// Packages it imports on top of its parent's.
        packages: Vec<String>,
    },
    /// zygote -> host: forked.
    Forked {
        /// Worker id.
        worker_id: String,
        /// Its pid.
        pid: u32,
    },
    /// zygote -> host: fork failed.
    ForkFailed {
        /// Worker id.
        worker_id: String,
        /// Why.
        error: String,
    },
    /// host -> worker: restore variables.
    Restore {
        /// File holding records and payloads.
        shm_path: Option<String>,
        /// Names to bind.
        variables: BTreeMap<String, VarRestore>,
        /// Records to load.
        objects: BTreeMap<String, ObjRestore>,
        /// Ambient state blob.
        ambient: Option<Region>,
        /// Modules to import first.
        imports: Vec<String>,
        /// Names to drop first.
        drop: Vec<String>,
        /// Set first, outside the ambient state: the devices of the worker's GPU
        /// slot (a worker prepared before Run gets its slot at Run).
        env: BTreeMap<String, String>,
    },
    /// worker -> host: restore done.
    Restored {
        /// No errors.
        ok: bool,
        /// Bytes read.
        restored_bytes: u64,
        /// Time spent.
        ms: f64,
        /// Of that, importing the import closure.
        #[serde(default)]
        imports_ms: f64,
        /// Of that, copying staged GPU-resident tensors to the slot's devices (a
        /// worker prepared without a slot, at Run; ADR 70).
        #[serde(default)]
        stage_in_ms: f64,
        /// The bytes that copy moved.
        #[serde(default)]
        staged_in_bytes: u64,
        /// Errors by name.
        errors: BTreeMap<String, String>,
    },
    /// host -> worker: run a cell.
    Run {
        /// Execution id.
        exec_id: String,
        /// Cell id.
        cell_id: String,
        /// Code.
        code: String,
        /// Jupyter's `user_expressions`: evaluated after the cell if it succeeds;
        /// the results come back as a `user_expressions` output.
        #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
        user_expressions: BTreeMap<String, String>,
    },
    /// worker -> host: the cell's first line is about to run.
    Started {
        /// Execution id.
        exec_id: String,
        /// When.
        unix_ms: u64,
        /// Execution count.
        execution_count: u32,
        /// The worker's Python version (`platform.python_version()`).
        #[serde(default)]
        python: String,
    },
    /// worker -> host: what the running cell sends its client.
    CellMessage {
        /// Execution id.
        exec_id: String,
        /// The message.
        message: WorkerMessage,
    },
    /// worker -> host, while a cell runs: names it reached that the worker does not
    /// hold (the closure missed them); the worker waits for `Faulted`.
    Fault {
        /// Execution id.
        exec_id: String,
        /// The names.
        names: Vec<String>,
    },
    /// host -> worker: the faulted names the committed state has, to restore.
    Faulted {
        /// File holding records and payloads.
        shm_path: Option<String>,
        /// Names to bind.
        variables: BTreeMap<String, VarRestore>,
        /// Records to load (those the worker does not hold yet).
        objects: BTreeMap<String, ObjRestore>,
    },
    /// worker -> host: the running cell called `input()` or `getpass()`; the
    /// worker waits for `InputReply`.
    InputRequest {
        /// Execution id.
        exec_id: String,
        /// The prompt.
        prompt: String,
        /// Whether the answer is a password (not echoed).
        password: bool,
    },
    /// host -> worker: the answer to `InputRequest`.
    InputReply {
        /// Execution id.
        exec_id: String,
        /// What the user typed.
        value: String,
        /// Why there is no answer: the cell gets StdinNotImplementedError with it.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        refused: Option<String>,
        /// The user interrupted the cell while it waited: the cell gets
        /// KeyboardInterrupt.
        #[serde(default)]
        interrupted: bool,
    },
    /// host -> worker, between cells: complete or inspect code against the
    /// worker's live objects.
    Query {
        /// "complete" or "inspect".
        kind: String,
        /// The code.
        code: String,
        /// The cursor, in characters.
        cursor_pos: u64,
        /// Inspection's detail level (0 or 1).
        detail_level: u8,
    },
    /// worker -> host: the content of Jupyter's complete or inspect reply.
    QueryAnswer {
        /// The reply content.
        content: serde_json::Value,
    },
    /// host -> worker, between cells: a client's comm message (ipywidgets).
    Comm {
        /// comm_open, comm_msg, comm_close or comm_info_request.
        msg_type: String,
        /// The Jupyter message's content.
        content: serde_json::Value,
        /// Its metadata.
        metadata: serde_json::Value,
        /// Its buffers, base64.
        buffers: Vec<String>,
    },
    /// worker -> host: what handling a comm message caused.
    CommAnswer {
        /// comm_info_reply's content for comm_info_request, else empty.
        reply: serde_json::Value,
        /// Comm messages to the client and what callbacks printed, in order.
        messages: Vec<WorkerMessage>,
    },
    /// worker -> host: the cell ended.
    Finished {
        /// Execution id.
        exec_id: String,
        /// "ok" or "error".
        status: String,
        /// Execution count.
        execution_count: u32,
        /// Run time.
        run_ms: f64,
        /// Whether the cell touched CUDA.
        cuda_used: bool,
        /// The error, if any.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        error: Option<ErrorInfo>,
        /// Names brought in by `Fault` while the cell ran.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        faulted: Vec<String>,
    },
    /// host -> worker: save what changed.
    Save {
        /// Execution id.
        exec_id: String,
    },
    /// worker -> host: the chunks of the save.
    SavePlan {
        /// Execution id.
        exec_id: String,
        /// Every distinct chunk hash.
        chunks: Vec<String>,
        /// The delta the save will commit (the store checks the session's quota
        /// on it before anything is uploaded); absent from older workers.
        #[serde(default)]
        delta: Option<Delta>,
    },
    /// host -> worker: the chunks the store lacks.
    SaveMissing {
        /// Execution id.
        exec_id: String,
        /// Hashes to place in shared memory.
        missing: Vec<String>,
    },
    /// worker -> host: one filled save file, to upload while the worker writes the next.
    SavePart {
        /// Execution id.
        exec_id: String,
        /// File holding these chunks.
        shm_path: String,
        /// Where each chunk is.
        chunks: BTreeMap<String, Region>,
    },
    /// worker -> host: chunks placed, here is the delta.
    SaveReady {
        /// Execution id.
        exec_id: String,
        /// File holding the missing chunks.
        shm_path: Option<String>,
        /// Where each chunk is.
        chunks: BTreeMap<String, Region>,
        /// The manifest change.
        delta: Delta,
        /// Worker-side save time.
        save_ms: f64,
    },
    /// host -> worker: the commit's outcome.
    Committed {
        /// Execution id.
        exec_id: String,
        /// Whether it committed.
        ok: bool,
        /// New revision.
        revision: u64,
        /// Versions of the names the worker holds.
        versions: BTreeMap<String, String>,
        /// Why not, if not.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        error: Option<String>,
    },
    /// Either side: something went wrong handling the last message.
    Error {
        /// What.
        message: String,
    },
    /// host -> zygote/worker: exit.
    Shutdown {},
}

impl Frame {
    /// The `type` tag.
    pub fn kind(&self) -> &'static str {
        match self {
            Frame::Hello { .. } => "hello",
            Frame::Fork { .. } => "fork",
            Frame::SpawnZygote { .. } => "spawn_zygote",
            Frame::Forked { .. } => "forked",
            Frame::ForkFailed { .. } => "fork_failed",
            Frame::Restore { .. } => "restore",
            Frame::Restored { .. } => "restored",
            Frame::Run { .. } => "run",
            Frame::Started { .. } => "started",
            Frame::CellMessage { .. } => "cell_message",
            Frame::Fault { .. } => "fault",
            Frame::Faulted { .. } => "faulted",
            Frame::InputRequest { .. } => "input_request",
            Frame::InputReply { .. } => "input_reply",
            Frame::Query { .. } => "query",
            Frame::QueryAnswer { .. } => "query_answer",
            Frame::Comm { .. } => "comm",
            Frame::CommAnswer { .. } => "comm_answer",
            Frame::Finished { .. } => "finished",
            Frame::Save { .. } => "save",
            Frame::SavePlan { .. } => "save_plan",
            Frame::SaveMissing { .. } => "save_missing",
            Frame::SavePart { .. } => "save_part",
            Frame::SaveReady { .. } => "save_ready",
            Frame::Committed { .. } => "committed",
            Frame::Error { .. } => "error",
            Frame::Shutdown {} => "shutdown",
        }
    }
}

/// Why a conversation with a zygote or worker failed.
#[derive(Debug, thiserror::Error)]
pub enum ConnError {
    /// The process closed its socket (it exited or died).
    #[error("the process closed its socket (it died or exited)")]
    Closed,
    /// No frame arrived in time.
    #[error("no answer within {0:?} (the process hangs)")]
    Timeout(Duration),
    /// A frame was too large or not valid JSON of the protocol.
    #[error("bad frame: {0}")]
    BadFrame(String),
    /// Socket I/O failed.
    #[error("socket: {0}")]
    Io(#[from] std::io::Error),
}

/// One framed connection.
#[derive(Debug)]
pub struct Conn {
    stream: UnixStream,
}

impl Conn {
    /// Wrap an accepted stream.
    pub fn new(stream: UnixStream) -> Self {
        Self { stream }
    }

    /// Send one frame.
    pub async fn send(&mut self, frame: &Frame) -> Result<(), ConnError> {
        let body = serde_json::to_vec(frame).map_err(|e| ConnError::BadFrame(e.to_string()))?;
        if body.len() > MAX_FRAME_BYTES {
            return Err(ConnError::BadFrame(format!("{} bytes exceeds the frame limit", body.len())));
        }
        let len = (body.len() as u32).to_be_bytes();
        self.stream.write_all(&len).await.map_err(closed_or_io)?;
        self.stream.write_all(&body).await.map_err(closed_or_io)?;
        Ok(())
    }

    /// Receive one frame, waiting at most `timeout`.
    pub async fn recv(&mut self, timeout: Duration) -> Result<Frame, ConnError> {
        match tokio::time::timeout(timeout, self.recv_forever()).await {
            Ok(r) => r,
            Err(_) => Err(ConnError::Timeout(timeout)),
        }
    }

    pub async fn recv_forever(&mut self) -> Result<Frame, ConnError> {
        let mut len = [0u8; 4];
        self.stream.read_exact(&mut len).await.map_err(closed_or_io)?;
        let len = u32::from_be_bytes(len) as usize;
        if len > MAX_FRAME_BYTES {
            return Err(ConnError::BadFrame(format!("frame of {len} bytes exceeds the limit")));
        }
        let mut body = vec![0u8; len];
        self.stream.read_exact(&mut body).await.map_err(closed_or_io)?;
        serde_json::from_slice(&body).map_err(|e| ConnError::BadFrame(e.to_string()))
    }
}

fn closed_or_io(e: std::io::Error) -> ConnError {
    match e.kind() {
        std::io::ErrorKind::UnexpectedEof | std::io::ErrorKind::BrokenPipe | std::io::ErrorKind::ConnectionReset => {
            ConnError::Closed
        }
        _ => ConnError::Io(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every message of the shared protocol file has a variant here with the same
    /// required fields, and every variant is in the file.
    #[test]
    fn matches_the_shared_protocol_file() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/python/looseleaf_worker/worker-protocol.json");
        let spec: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        let messages = spec["messages"].as_object().unwrap();
        let samples = samples();
        let kinds: Vec<&str> = samples.iter().map(Frame::kind).collect();
        for name in messages.keys() {
            assert!(kinds.contains(&name.as_str()), "protocol message {name} has no Rust variant");
        }
        for frame in &samples {
            let json = serde_json::to_value(frame).unwrap();
            let spec = &messages[frame.kind()];
            for field in spec["fields"].as_object().unwrap().keys() {
                assert!(json.get(field).is_some(), "{}: field {field} missing in Rust", frame.kind());
            }
            let back: Frame = serde_json::from_value(json).unwrap();
            assert_eq!(&back, frame);
        }
        assert_eq!(spec["max_frame_bytes"].as_u64().unwrap() as usize, MAX_FRAME_BYTES);
        let version = spec["version"].as_u64().unwrap();
        assert_eq!(version, u64::from(schemas::locate::WORKER_PROTOCOL_VERSION), "the hosts' protocol version");
    }

    fn samples() -> Vec<Frame> {
        vec![
            Frame::Hello {
                role: "worker".into(),
                id: "w".into(),
                pid: 1,
                packages: vec![],
                import_ms: 0.0,
                cuda_unsafe: vec![],
                import_errors: BTreeMap::new(),
                stdlib: vec![],
                loaded: vec![],
                zygote_id: None,
            },
            Frame::SpawnZygote { zygote_id: "z".into(), packages: vec!["sklearn".into()] },
            Frame::Fork {
                worker_id: "w".into(),
                env: BTreeMap::new(),
                cwd: "/".into(),
                socket: "/s".into(),
                uid: Some(7),
            },
            Frame::Forked { worker_id: "w".into(), pid: 2 },
            Frame::ForkFailed { worker_id: "w".into(), error: "e".into() },
            Frame::Restore {
                shm_path: None,
                variables: BTreeMap::new(),
                objects: BTreeMap::new(),
                ambient: None,
                imports: vec![],
                drop: vec![],
                env: BTreeMap::from([("CUDA_VISIBLE_DEVICES".into(), "0".into())]),
            },
            Frame::Restored {
                ok: true,
                restored_bytes: 0,
                ms: 0.0,
                imports_ms: 0.0,
                stage_in_ms: 0.0,
                staged_in_bytes: 0,
                errors: BTreeMap::new(),
            },
            Frame::Run {
                exec_id: "e".into(),
                cell_id: "c".into(),
                code: "1".into(),
                user_expressions: [("n".to_string(), "1 + 1".to_string())].into(),
            },
            Frame::Started { exec_id: "e".into(), unix_ms: 1, execution_count: 1, python: "3.11.7".into() },
            Frame::CellMessage {
                exec_id: "e".into(),
                message: WorkerMessage::Output(serde_json::json!({"output_type": "stream"})),
            },
            Frame::Fault { exec_id: "e".into(), names: vec!["x".into()] },
            Frame::Faulted { shm_path: None, variables: BTreeMap::new(), objects: BTreeMap::new() },
            Frame::InputRequest { exec_id: "e".into(), prompt: "name? ".into(), password: false },
            Frame::InputReply { exec_id: "e".into(), value: "Ada".into(), refused: None, interrupted: false },
            Frame::Query { kind: "complete".into(), code: "x.".into(), cursor_pos: 2, detail_level: 0 },
            Frame::QueryAnswer { content: serde_json::json!({"status": "ok", "matches": []}) },
            Frame::Comm {
                msg_type: "comm_msg".into(),
                content: serde_json::json!({"comm_id": "c", "data": {}}),
                metadata: serde_json::json!({}),
                buffers: vec!["AAE=".into()],
            },
            Frame::CommAnswer {
                reply: serde_json::json!({}),
                messages: vec![
                    WorkerMessage::Comm {
                        msg_type: "comm_msg".into(),
                        content: serde_json::json!({}),
                        metadata: serde_json::json!({}),
                        buffers: vec![],
                    },
                    WorkerMessage::Pager { data: serde_json::json!({"text/plain": "Doc"}), start: 0 },
                    WorkerMessage::UserExpressions { data: serde_json::json!({}) },
                ],
            },
            Frame::Finished {
                exec_id: "e".into(),
                status: "ok".into(),
                execution_count: 1,
                run_ms: 1.0,
                cuda_used: false,
                error: None,
                faulted: vec!["x".into()],
            },
            Frame::Save { exec_id: "e".into() },
            Frame::SavePlan { exec_id: "e".into(), chunks: vec![], delta: None },
            Frame::SaveMissing { exec_id: "e".into(), missing: vec![] },
            Frame::SavePart { exec_id: "e".into(), shm_path: "/dev/shm/p".into(), chunks: BTreeMap::new() },
            Frame::SaveReady {
                exec_id: "e".into(),
                shm_path: None,
                chunks: BTreeMap::new(),
                delta: Delta::default(),
                save_ms: 0.0,
            },
            Frame::Committed { exec_id: "e".into(), ok: true, revision: 1, versions: BTreeMap::new(), error: None },
            Frame::Error { message: "m".into() },
            Frame::Shutdown {},
        ]
    }
}
