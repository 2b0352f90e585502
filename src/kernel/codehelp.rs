//! Completion and inspection from the session's code, for when no live objects
//! can answer: no CPU cell ran yet, or every cell is serverless (`--all-gpu`), so
//! the session has no CPU worker. A helper process (`codehelp.py`, run by the
//! worker's Python) infers with jedi from the cells the kernel ran followed by
//! the edited cell, as an editor does; it stays up between requests, since
//! jedi's first inference takes a second or more.

use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use anyhow::Context as _;
use serde_json::Value;
use tokio::io::{AsyncBufReadExt as _, AsyncWriteExt as _, BufReader, Lines};
use tokio::process::{Child, ChildStdin, ChildStdout, Command};

/// The helper's source, carried in the binary (nothing to find on disk).
const HELPER: &str = include_str!("codehelp.py");

/// How long one answer may take (the first includes importing jedi); past it
/// the helper is stopped and the client gets nothing rather than a wait.
const ANSWER_TIMEOUT: Duration = Duration::from_secs(10);

/// The helper, started on first use.
pub struct CodeHelp {
    python: PathBuf,
    helper: Option<Helper>,
}

struct Helper {
    _child: Child,
    stdin: ChildStdin,
    lines: Lines<BufReader<ChildStdout>>,
}

impl Helper {
    fn start(python: &PathBuf) -> anyhow::Result<Self> {
        let mut child = Command::new(python)
            .args(["-c", HELPER])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("could not start {} for completion", python.display()))?;
        let stdin = child.stdin.take().context("the helper has no stdin")?;
        let stdout = child.stdout.take().context("the helper has no stdout")?;
        Ok(Self { _child: child, stdin, lines: BufReader::new(stdout).lines() })
    }

    async fn ask(&mut self, request: &Value) -> anyhow::Result<Value> {
        let mut line = request.to_string();
        line.push('\n');
        self.stdin.write_all(line.as_bytes()).await.context("writing to the helper")?;
        self.stdin.flush().await.context("writing to the helper")?;
        let answer = self.lines.next_line().await.context("reading the helper")?.context("the helper exited")?;
        serde_json::from_str(&answer).context("the helper's answer is not JSON")
    }
}

impl CodeHelp {
    pub fn new(python: PathBuf) -> Self {
        Self { python, helper: None }
    }

    /// The reply content for `kind` ("complete" or "inspect") at `cursor_pos` in
    /// `code`, after the session's `history`; None when the helper cannot answer.
    pub async fn ask(&mut self, kind: &str, history: &[&str], code: &str, cursor_pos: u64) -> Option<Value> {
        let request = serde_json::json!({
            "kind": kind, "history": history, "code": code, "cursor_pos": cursor_pos,
        });
        // a helper that died (or was stopped) is started again, once per request
        for _ in 0..2 {
            if self.helper.is_none() {
                match Helper::start(&self.python) {
                    Ok(h) => self.helper = Some(h),
                    Err(e) => {
                        tracing::warn!(error = %format!("{e:#}"), "no completion from the session's code");
                        return None;
                    }
                }
            }
            let helper = self.helper.as_mut()?;
            match tokio::time::timeout(ANSWER_TIMEOUT, helper.ask(&request)).await {
                Ok(Ok(answer)) => return Some(answer),
                Ok(Err(e)) => {
                    tracing::warn!(error = %format!("{e:#}"), "the completion helper failed; starting it again");
                    self.helper = None;
                }
                Err(_) => {
                    tracing::warn!(?ANSWER_TIMEOUT, "the completion helper did not answer in time; stopped");
                    self.helper = None;
                    return None;
                }
            }
        }
        None
    }
}
