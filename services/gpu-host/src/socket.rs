//! The host's Unix socket: zygotes and workers connect back to it and introduce
//! themselves with `hello`; [`Listener`] routes each connection to whoever waits
//! for it.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::net::UnixListener;
use tokio::sync::oneshot;

use crate::protocol::{Conn, Frame};

/// A process that was expected never connected.
#[derive(Debug, thiserror::Error)]
#[error("{what} did not connect within {timeout:?}")]
pub struct NoHello {
    /// What we waited for.
    pub what: String,
    /// How long.
    pub timeout: Duration,
}

/// A process that connected and said hello.
pub struct Hello {
    /// Its connection.
    pub conn: Conn,
    /// Its hello frame.
    pub frame: Frame,
}

/// Accepts zygote and worker connections on the host's socket.
#[derive(Clone)]
pub struct Listener {
    path: PathBuf,
    waiting: Arc<Mutex<HashMap<String, oneshot::Sender<Hello>>>>,
}

impl Listener {
    /// Bind `path` and start accepting; connections whose hello nobody waits for are
    /// closed with a log line.
    pub fn bind(path: &Path) -> std::io::Result<Self> {
        let _ = std::fs::remove_file(path);
        let listener = UnixListener::bind(path)?;
        let me = Self { path: path.to_path_buf(), waiting: Arc::new(Mutex::new(HashMap::new())) };
        let waiting = me.waiting.clone();
        tokio::spawn(async move {
            loop {
                let stream = match listener.accept().await {
                    Ok((s, _)) => s,
                    Err(e) => {
                        tracing::error!(error = %e, "host socket accept failed");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        continue;
                    }
                };
                let waiting = waiting.clone();
                tokio::spawn(async move {
                    let mut conn = Conn::new(stream);
                    match conn.recv(Duration::from_secs(30)).await {
                        Ok(frame @ Frame::Hello { .. }) => {
                            let Frame::Hello { id, .. } = &frame else { return };
                            let tx = waiting.lock().ok().and_then(|mut w| w.remove(id));
                            match tx {
                                Some(tx) => {
                                    let _ = tx.send(Hello { conn, frame });
                                }
                                None => tracing::warn!(%id, "unexpected hello; closing the connection"),
                            }
                        }
                        Ok(other) => tracing::warn!(kind = other.kind(), "first frame was not hello"),
                        Err(e) => tracing::warn!(error = %e, "connection without hello"),
                    }
                });
            }
        });
        Ok(me)
    }

    /// The socket path processes connect to.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Wait for the process with this id to connect.
    pub fn expect(&self, id: &str) -> oneshot::Receiver<Hello> {
        let (tx, rx) = oneshot::channel();
        if let Ok(mut w) = self.waiting.lock() {
            w.insert(id.to_string(), tx);
        }
        rx
    }

    /// Stop waiting for `id` (its process failed before it could connect).
    pub fn forget(&self, id: &str) {
        if let Ok(mut w) = self.waiting.lock() {
            w.remove(id);
        }
    }

    /// Wait for `id`'s hello, at most `timeout`.
    pub async fn wait(&self, id: &str, rx: oneshot::Receiver<Hello>, timeout: Duration) -> Result<Hello, NoHello> {
        match tokio::time::timeout(timeout, rx).await {
            Ok(Ok(h)) => Ok(h),
            _ => {
                self.forget(id);
                Err(NoHello { what: id.to_string(), timeout })
            }
        }
    }
}
