//! `looseleaf sessions list|resume|discard`: a user's sessions, live, detached
//! and discarded, on a frontend or the user's local cluster (ADR 63, 65).

use std::time::Duration;

use anyhow::Context as _;
use clap::Subcommand;
use looseleaf_client::Frontend;

use crate::local;

/// What `looseleaf sessions` does.
#[derive(Subcommand, Debug)]
pub enum SessionsAction {
    /// List the caller's sessions, live and detached.
    List,
    /// Resume a detached session (its id, from `list`).
    Resume { session: uuid::Uuid },
    /// Delete a session with its state.
    Discard { session: uuid::Uuid },
}

/// `looseleaf sessions ACTION` on `frontend` (with `token`), else on the user's
/// local cluster, which must be running.
pub async fn sessions(action: SessionsAction, frontend: Option<String>, token: Option<String>) -> anyhow::Result<()> {
    let fe = match frontend {
        Some(url) => {
            let fe = Frontend::new(&url);
            token.as_deref().map_or(fe.clone(), |t| fe.with_token(t))
        }
        None => {
            let local = local::LocalCluster::of_user()?;
            let (fe, _) = local.connect().await.with_context(|| {
                format!(
                    "the local cluster of {} is not running (it stops after --idle-exit-s with no \
                     session): open a LooseLeaf notebook, or run `looseleaf up --local`, or name a \
                     --frontend",
                    local.data_dir().display()
                )
            })?;
            fe
        }
    };
    run(&fe, action).await
}

/// What `action` does on `fe`.
async fn run(fe: &Frontend, action: SessionsAction) -> anyhow::Result<()> {
    let when = |ms: u64| humantime::format_rfc3339_seconds(std::time::UNIX_EPOCH + Duration::from_millis(ms));
    match action {
        SessionsAction::List => {
            let listed = fe.sessions().await?;
            if listed.is_empty() {
                println!("no sessions");
            }
            for s in listed {
                let state = s.detached_unix_ms.map_or("live".to_string(), |ms| format!("detached {}", when(ms)));
                let notebook = s.notebook.as_deref().unwrap_or("-");
                println!("{}  {state:<30}  revision {:<5} {notebook}  (in {})", s.session_id, s.revision, s.cwd);
            }
            // what LooseLeaf discarded lately (past its retention, or for space), and why
            let discards = match fe.discards().await {
                Ok(d) => d,
                // a frontend from before discards were listed
                Err(e) if e.status() == Some(reqwest::StatusCode::NOT_FOUND) => Vec::new(),
                Err(e) => return Err(e.into()),
            };
            for d in discards {
                let notebook = d.notebook.as_deref().unwrap_or("-");
                let state = format!("discarded {}", when(d.discarded_unix_ms));
                println!("{}  {state:<30}  {notebook}: {}", d.session_id, d.why);
            }
        }
        SessionsAction::Resume { session } => {
            let created = fe.resume(session).await?;
            let revision = created.resumed.map_or(0, |r| r.revision);
            println!("resumed {} at revision {revision}", created.session_id);
        }
        SessionsAction::Discard { session } => {
            fe.delete(session).await?;
            println!("discarded {session}");
        }
    }
    Ok(())
}
