//! An HTTP client of the frontend's API (reqwest), including its SSE event stream.

use anyhow::{bail, Context};
use looseleaf_frontend::api::{spawn_item_reader, CellCode, CreateSession, RunAccepted, SessionCreated, StreamItem};
use tokio::sync::mpsc;
use uuid::Uuid;

/// The frontend at one base URL.
#[derive(Clone, Debug)]
pub struct Frontend {
    base: String,
    http: reqwest::Client,
}

async fn check(resp: reqwest::Response, what: &str) -> anyhow::Result<reqwest::Response> {
    let status = resp.status();
    if status.is_success() {
        return Ok(resp);
    }
    let body = resp.text().await.unwrap_or_default();
    bail!("{what}: the frontend answered {status}: {body}")
}

impl Frontend {
    /// A client of the frontend at `base` (e.g. `http://127.0.0.1:8470`).
    pub fn new(base: &str) -> Self {
        Self { base: base.trim_end_matches('/').to_string(), http: reqwest::Client::new() }
    }

    /// Create a session.
    pub async fn create_session(&self, cwd: &str, all_gpu: bool, speculate: bool) -> anyhow::Result<Uuid> {
        let req = CreateSession { cwd: cwd.to_string(), all_gpu, speculate };
        let resp = self.http.post(format!("{}/v1/sessions", self.base)).json(&req).send().await;
        let resp = resp.with_context(|| format!("while connecting to the frontend at {}", self.base))?;
        let created: SessionCreated = check(resp, "create session").await?.json().await?;
        Ok(created.session_id)
    }

    /// Publish a cell's code as an edit.
    pub async fn edit(&self, sid: Uuid, cell: &str, code: &str) -> anyhow::Result<()> {
        let url = format!("{}/v1/sessions/{sid}/cells/{}", self.base, encode(cell));
        let resp = self.http.put(url).json(&CellCode { code: code.to_string() }).send().await?;
        check(resp, "edit").await?;
        Ok(())
    }

    /// Run a cell.
    pub async fn run(&self, sid: Uuid, cell: &str, code: &str) -> anyhow::Result<RunAccepted> {
        let url = format!("{}/v1/sessions/{sid}/cells/{}/run", self.base, encode(cell));
        let resp = self.http.post(url).json(&CellCode { code: code.to_string() }).send().await?;
        Ok(check(resp, "run").await?.json().await?)
    }

    /// Delete a session.
    pub async fn delete(&self, sid: Uuid) -> anyhow::Result<()> {
        let resp = self.http.delete(format!("{}/v1/sessions/{sid}", self.base)).send().await?;
        check(resp, "delete session").await?;
        Ok(())
    }

    /// Open the session's event stream; items arrive on the channel, which closes
    /// when the stream ends.
    pub async fn events(&self, sid: Uuid) -> anyhow::Result<mpsc::UnboundedReceiver<StreamItem>> {
        let resp = self.http.get(format!("{}/v1/sessions/{sid}/events", self.base)).send().await?;
        Ok(spawn_item_reader(check(resp, "events").await?.bytes_stream()))
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
