//! The client of the frontend's HTTP API: its JSON ([`api`]) and a [`Frontend`]
//! that speaks it, including the session's Server-Sent Events stream. The CLI, the
//! Jupyter kernel and the tests all use this one.

pub mod api;
pub mod events;
pub mod stream;
pub mod usage;

use api::{
    CellCode, Checkout, CodeAtCursor, CommAnswer, CommMessage, CreateSession, InputLine, Interrupted, RunAccepted,
    RunCell, SessionCreated, SessionDetached, SessionDiscarded, SessionListed, StateMoved, StreamItem,
};
use stream::{read_items, StreamPosition};
use tokio::sync::mpsc;
use usage::{UsageBy, UsageReport};
use uuid::Uuid;

/// Why a call to the frontend failed.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The frontend could not be reached (or the connection broke).
    #[error("{what}: could not reach the frontend at {base}: {source}")]
    Unreachable {
        /// The call.
        what: &'static str,
        /// The frontend's base URL.
        base: String,
        /// What the HTTP client said.
        source: reqwest::Error,
    },
    /// The frontend answered with an error status.
    #[error("{what}: the frontend answered {status}: {body}")]
    Status {
        /// The call.
        what: &'static str,
        /// The HTTP status.
        status: reqwest::StatusCode,
        /// Its body (a JSON error naming what was wrong).
        body: String,
    },
    /// The answer was not the JSON the API promises.
    #[error("{what}: unreadable answer from the frontend: {source}")]
    Answer {
        /// The call.
        what: &'static str,
        /// Why it did not decode.
        source: reqwest::Error,
    },
}

impl ClientError {
    /// The HTTP status the frontend answered with, if it answered.
    pub fn status(&self) -> Option<reqwest::StatusCode> {
        match self {
            ClientError::Status { status, .. } => Some(*status),
            _ => None,
        }
    }

    /// What went wrong, for a user: the frontend's own error message when it
    /// answered one, else the whole error.
    pub fn detail(&self) -> String {
        let said = match self {
            ClientError::Status { body, .. } => serde_json::from_str::<serde_json::Value>(body)
                .ok()
                .and_then(|v| v.get("error").and_then(|e| e.as_str()).map(str::to_owned)),
            _ => None,
        };
        said.unwrap_or_else(|| self.to_string())
    }
}

/// How long an event stream that broke is tried again (a frontend restarting, a
/// network blip) before the reader gives up and its channel closes.
pub const RECONNECT_FOR: std::time::Duration = std::time::Duration::from_secs(60);

/// The frontend at one base URL.
#[derive(Clone, Debug)]
pub struct Frontend {
    base: String,
    http: reqwest::Client,
    /// The bearer token sent with every request, if the API asks for one.
    token: Option<String>,
    /// Whether a request ever reached this frontend: from then on a request it
    /// refuses to connect (it restarts) is tried again for [`RECONNECT_FOR`]; a
    /// wrong address fails at once.
    reached: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl Frontend {
    /// A client of the frontend at `base` (e.g. `http://127.0.0.1:8470`).
    pub fn new(base: &str) -> Self {
        Self {
            base: base.trim_end_matches('/').to_string(),
            http: reqwest::Client::new(),
            token: None,
            reached: Default::default(),
        }
    }

    /// The same client, sending `token` as its bearer token.
    pub fn with_token(mut self, token: impl Into<String>) -> Self {
        self.token = Some(token.into());
        self
    }

    /// The base URL.
    pub fn base(&self) -> &str {
        &self.base
    }

    async fn send(&self, what: &'static str, req: reqwest::RequestBuilder) -> Result<reqwest::Response, ClientError> {
        let mut req = match &self.token {
            Some(token) => req.bearer_auth(token),
            None => req,
        };
        // the request continues the caller's trace (a kernel's execute_request)
        for (name, value) in schemas::telemetry::http_trace_headers() {
            req = req.header(name, value);
        }
        use std::sync::atomic::Ordering;
        let deadline = tokio::time::Instant::now() + RECONNECT_FOR;
        // A request that could not connect was never sent: sending it again is
        // safe. One whose connection broke may have reached the frontend (it was
        // stopped meanwhile): sent again only if it is idempotent (an edit, a
        // read, a delete), never a run.
        let idempotent = req.try_clone().and_then(|r| r.build().ok()).is_some_and(|r| r.method().is_idempotent());
        let resp = loop {
            let again = req.try_clone();
            match (req.send().await, again) {
                (Ok(resp), _) => break resp,
                (Err(e), Some(again))
                    if (e.is_connect() || (idempotent && e.is_request())) && self.reached.load(Ordering::Relaxed) =>
                {
                    if tokio::time::Instant::now() > deadline {
                        return Err(ClientError::Unreachable { what, base: self.base.clone(), source: e });
                    }
                    tracing::debug!(error = %e, what, "the frontend is not there; trying again");
                    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
                    req = again;
                }
                (Err(source), _) => return Err(ClientError::Unreachable { what, base: self.base.clone(), source }),
            }
        };
        self.reached.store(true, Ordering::Relaxed);
        let status = resp.status();
        if status.is_success() {
            return Ok(resp);
        }
        let body = resp.text().await.unwrap_or_default();
        Err(ClientError::Status { what, status, body })
    }

    async fn json<T: serde::de::DeserializeOwned>(
        &self,
        what: &'static str,
        req: reqwest::RequestBuilder,
    ) -> Result<T, ClientError> {
        self.send(what, req).await?.json().await.map_err(|source| ClientError::Answer { what, source })
    }

    fn cell_url(&self, sid: Uuid, cell: &str) -> String {
        format!("{}/v1/sessions/{sid}/cells/{}", self.base, encode(cell))
    }

    /// Create a session whose cells run in `cwd`.
    pub async fn create_session(&self, cwd: &str, all_gpu: bool, speculate: bool) -> Result<Uuid, ClientError> {
        let body = CreateSession { cwd: cwd.to_string(), all_gpu, speculate, notebook: None, resume: false };
        Ok(self.open_session(&body).await?.session_id)
    }

    /// Create a session as `body` says: with `resume`, the caller's latest
    /// detached session of its notebook, if there is one.
    pub async fn open_session(&self, body: &CreateSession) -> Result<SessionCreated, ClientError> {
        let req = self.http.post(format!("{}/v1/sessions", self.base)).json(body);
        self.json("create session", req).await
    }

    /// The caller's sessions, live and detached.
    pub async fn sessions(&self) -> Result<Vec<SessionListed>, ClientError> {
        let req = self.http.get(format!("{}/v1/sessions", self.base));
        self.json("list sessions", req).await
    }

    /// The caller's detached sessions LooseLeaf discarded lately, and why.
    pub async fn discards(&self) -> Result<Vec<SessionDiscarded>, ClientError> {
        let req = self.http.get(format!("{}/v1/discards", self.base));
        self.json("list discarded sessions", req).await
    }

    /// What was used from `from` to `to` (UTC days, `YYYY-MM-DD`; None: the
    /// frontend's defaults), grouped `by`; an admin may ask for one `user`'s.
    pub async fn usage(
        &self,
        by: UsageBy,
        from: Option<&str>,
        to: Option<&str>,
        user: Option<&str>,
    ) -> Result<UsageReport, ClientError> {
        let mut query = vec![("by", by.as_str())];
        query.extend(from.map(|d| ("from", d)));
        query.extend(to.map(|d| ("to", d)));
        query.extend(user.map(|u| ("user", u)));
        let req = self.http.get(format!("{}/v1/usage", self.base)).query(&query);
        self.json("read usage", req).await
    }

    /// Detach a session: its workers are freed, its state stays to resume.
    pub async fn detach(&self, sid: Uuid) -> Result<SessionDetached, ClientError> {
        let req = self.http.post(format!("{}/v1/sessions/{sid}/detach", self.base));
        self.json("detach session", req).await
    }

    /// Resume a detached session by id.
    pub async fn resume(&self, sid: Uuid) -> Result<SessionCreated, ClientError> {
        let req = self.http.post(format!("{}/v1/sessions/{sid}/resume", self.base));
        self.json("resume session", req).await
    }

    /// Move the session's state back to before its last cell.
    pub async fn undo(&self, sid: Uuid) -> Result<StateMoved, ClientError> {
        let req = self.http.post(format!("{}/v1/sessions/{sid}/undo", self.base));
        self.json("undo", req).await
    }

    /// Move the session's state to the one revision `revision` holds.
    pub async fn checkout(&self, sid: Uuid, revision: u64) -> Result<StateMoved, ClientError> {
        let req = self.http.post(format!("{}/v1/sessions/{sid}/checkout", self.base)).json(&Checkout { revision });
        self.json("checkout", req).await
    }

    /// Fork the session into a new one that shares its state.
    pub async fn fork(&self, sid: Uuid) -> Result<StateMoved, ClientError> {
        let req = self.http.post(format!("{}/v1/sessions/{sid}/fork", self.base));
        self.json("fork", req).await
    }

    /// Publish a cell's code as an edit (the planner prepares a worker for it).
    pub async fn edit(&self, sid: Uuid, cell: &str, code: &str) -> Result<(), ClientError> {
        let req = self.http.put(self.cell_url(sid, cell)).json(&CellCode { code: code.to_string() });
        self.send("edit", req).await.map(|_| ())
    }

    /// Run a cell: it is queued behind the session's earlier runs.
    pub async fn run(&self, sid: Uuid, cell: &str, code: &str) -> Result<RunAccepted, ClientError> {
        self.run_cell(
            sid,
            cell,
            &RunCell { code: code.to_string(), allow_stdin: false, user_expressions: Default::default() },
        )
        .await
    }

    /// Run a cell as `run` does; with `allow_stdin`, its input requests come to
    /// this client (answer them with [`Frontend::input`]).
    pub async fn run_cell(&self, sid: Uuid, cell: &str, run: &RunCell) -> Result<RunAccepted, ClientError> {
        self.json("run", self.http.post(format!("{}/run", self.cell_url(sid, cell))).json(run)).await
    }

    /// Completions at the cursor, from the session's live objects: the content of
    /// Jupyter's `complete_reply`.
    pub async fn complete(&self, sid: Uuid, at: &CodeAtCursor) -> Result<serde_json::Value, ClientError> {
        self.json("complete", self.http.post(format!("{}/v1/sessions/{sid}/complete", self.base)).json(at)).await
    }

    /// What the name at the cursor is: the content of Jupyter's `inspect_reply`.
    pub async fn inspect(&self, sid: Uuid, at: &CodeAtCursor) -> Result<serde_json::Value, ClientError> {
        self.json("inspect", self.http.post(format!("{}/v1/sessions/{sid}/inspect", self.base)).json(at)).await
    }

    /// Pass a client's comm message to the session's CPU worker (ADR 33).
    pub async fn comm(&self, sid: Uuid, msg: &CommMessage) -> Result<CommAnswer, ClientError> {
        self.json("comm", self.http.post(format!("{}/v1/sessions/{sid}/comm", self.base)).json(msg)).await
    }

    /// Answer execution `exec`'s input request with `value`.
    pub async fn input(&self, sid: Uuid, exec: Uuid, value: &str) -> Result<(), ClientError> {
        let url = format!("{}/v1/sessions/{sid}/executions/{exec}/input", self.base);
        let req = self.http.post(url).json(&InputLine { value: value.to_string() });
        self.send("input", req).await.map(|_| ())
    }

    /// Interrupt the session: the running cell gets a KeyboardInterrupt (and is
    /// killed if it ignores it), queued cells are aborted.
    pub async fn interrupt(&self, sid: Uuid) -> Result<Interrupted, ClientError> {
        self.json("interrupt", self.http.post(format!("{}/v1/sessions/{sid}/interrupt", self.base))).await
    }

    /// The session's summary (current run, queue, revision).
    pub async fn summary(&self, sid: Uuid) -> Result<serde_json::Value, ClientError> {
        self.json("session summary", self.http.get(format!("{}/v1/sessions/{sid}", self.base))).await
    }

    /// Delete a session (its state too).
    pub async fn delete(&self, sid: Uuid) -> Result<(), ClientError> {
        self.send("delete session", self.http.delete(format!("{}/v1/sessions/{sid}", self.base))).await.map(|_| ())
    }

    /// Open the session's event stream (what happened before is replayed first);
    /// items arrive on the channel, each once. A stream that breaks (a frontend
    /// restarting) is resumed; the channel closes when the session is gone or no
    /// frontend answers for [`RECONNECT_FOR`].
    pub async fn events(&self, sid: Uuid) -> Result<mpsc::UnboundedReceiver<StreamItem>, ClientError> {
        let url = format!("{}/v1/sessions/{sid}/events", self.base);
        let resp = self.send("events", self.http.get(&url)).await?;
        let (tx, rx) = mpsc::unbounded_channel();
        let client = self.clone();
        tokio::spawn(async move {
            let mut pos = StreamPosition::default();
            let mut body = resp;
            loop {
                if read_items(body.bytes_stream(), &tx, &mut pos).await {
                    return; // the receiver was dropped
                }
                // the stream ended or broke: the frontend restarted or the network
                // failed; resume after the last event seen (a frontend that adopted
                // the session in the meantime replays what it has)
                match client.reconnect(&url, pos.last_id.as_deref(), &tx).await {
                    Some(resp) => body = resp,
                    None => return,
                }
            }
        });
        Ok(rx)
    }

    /// Open the event stream at `url` again, resuming after `last_id`: tried every
    /// half second for [`RECONNECT_FOR`]; None if that passed, the session is gone
    /// (404, 401) or the receiver was dropped.
    async fn reconnect(
        &self,
        url: &str,
        last_id: Option<&str>,
        tx: &mpsc::UnboundedSender<StreamItem>,
    ) -> Option<reqwest::Response> {
        let deadline = tokio::time::Instant::now() + RECONNECT_FOR;
        while tokio::time::Instant::now() < deadline && !tx.is_closed() {
            let mut req = self.http.get(url);
            if let Some(id) = last_id {
                req = req.header("Last-Event-ID", id);
            }
            match self.send("events", req).await {
                Ok(resp) => return Some(resp),
                Err(e) if e.status().is_some_and(|s| s.is_client_error()) => {
                    tracing::info!(error = %e, "the event stream cannot be resumed");
                    return None;
                }
                Err(e) => tracing::debug!(error = %e, "the event stream is not back yet"),
            }
            tokio::time::sleep(std::time::Duration::from_millis(500)).await;
        }
        None
    }
}

/// Percent-encode a path segment (cell ids are usually uuids, but need not be).
fn encode(segment: &str) -> String {
    let mut out = String::with_capacity(segment.len());
    for b in segment.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[test]
    fn cell_ids_are_percent_encoded() {
        assert_eq!(super::encode("a b/c?é"), "a%20b%2Fc%3F%C3%A9");
        assert_eq!(super::encode("0f3e-_.~"), "0f3e-_.~");
    }

    /// A frontend that goes away while a request is in flight (it read the request
    /// and closed the connection): an edit is sent again and lands; a run is not
    /// sent again (it may have been accepted) and fails, naming the frontend.
    #[tokio::test]
    async fn a_broken_connection_retries_an_edit_but_never_a_run() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        let server = tokio::spawn(async move {
            let mut seen = Vec::new();
            // answered, dropped, answered, dropped
            for answer in [true, false, true, false] {
                let (mut conn, _) = listener.accept().await.unwrap();
                let mut buf = vec![0u8; 64 * 1024];
                let n = conn.read(&mut buf).await.unwrap();
                let head = String::from_utf8_lossy(&buf[..n]).lines().next().unwrap_or_default().to_string();
                seen.push(head);
                if answer {
                    let body = "{}";
                    let resp = format!("HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}", body.len());
                    conn.write_all(resp.as_bytes()).await.unwrap();
                }
            }
            // nothing more may come: a second run would be accepted here
            let more = tokio::time::timeout(std::time::Duration::from_secs(2), listener.accept()).await;
            (seen, more.is_ok())
        });
        let fe = super::Frontend::new(&base);
        let sid = uuid::Uuid::nil();
        fe.summary(sid).await.unwrap();
        fe.edit(sid, "a", "x = 1").await.unwrap();
        let run = fe.run(sid, "a", "x = 1").await;
        assert!(matches!(run, Err(super::ClientError::Unreachable { .. })), "{run:?}");
        let (seen, more) = server.await.unwrap();
        assert_eq!(
            seen.iter().map(|l| l.split(' ').next().unwrap_or_default()).collect::<Vec<_>>(),
            ["GET", "PUT", "PUT", "POST"]
        );
        assert!(!more, "a run was sent twice");
    }
}
