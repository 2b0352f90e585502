//! The frontend: sessions and cells for people and programs (DESIGN.md section 3).
//!
//! HTTP API (JSON, axum on a tokio task):
//! - `POST /v1/sessions` `{cwd, all_gpu}` -> `{session_id}`
//! - `PUT /v1/sessions/{sid}/cells/{cell}` `{code}` -> 202, publishes an edit
//! - `POST /v1/sessions/{sid}/cells/{cell}/run` `{code}` -> `{exec_id, position}`
//! - `GET /v1/sessions/{sid}/events` -> Server-Sent Events, each data line one
//!   [`api::StreamItem`] with an id ([`resume`]); what happened before the client
//!   connected is replayed (the newest `--history-items`), or with `Last-Event-ID`
//!   only what came after that event and was not seen, also across a frontend
//!   restart (no item twice)
//! - `POST /v1/sessions/{sid}/interrupt` -> [`api::Interrupted`]: the running cell
//!   gets a KeyboardInterrupt (killed if it ignores it), queued cells are aborted
//! - `GET /v1/sessions/{sid}` (summary), `DELETE /v1/sessions/{sid}`, `GET /v1/health`
//!
//! Speaks: publishes `{prefix}.v1.session.{sid}.edit|run|close|interrupt`, requests
//! `{prefix}.v1.store.session.delete`; subscribes `{prefix}.v1.session.{sid}.event`
//! and `{prefix}.v1.output.{sid}.*` per session. Creates the session-events stream.
//!
//! Actors (flat): one [`session::SessionActor`] per session, fed by that session's
//! two subscriptions and by messages from the HTTP handlers. It holds the run queue:
//! one cell at a time, the next run published only when the previous execution is
//! complete (Saved or Failed, and all its announced outputs delivered).

/// The HTTP API's JSON, shared with its one client crate.
pub use looseleaf_client::api;
pub mod admission;
pub mod auth;
pub mod dashboard;
pub mod http;
pub mod hub;
pub mod origins;
pub mod quota;
pub mod records;
pub mod resume;
pub mod serve;
pub mod session;
pub mod usage;

use std::collections::HashMap;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use anyhow::Context as _;
use schemas::messages::HostStatusV2;
use schemas::service::Service;
use tokio_util::sync::CancellationToken;

/// Deadlines of the run queue.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Timeouts {
    /// A run no host claimed within this fails ("no host took the cell"), once the
    /// frontend holds its claim (so that no host runs it later).
    pub claim: Duration,
    /// A run not complete within this is interrupted, as the user would (the
    /// hosts' cell timeout is the usual limit; this is the frontend's own). None:
    /// a cell may run as long as it likes, as in Jupyter (ADR 52).
    pub execution: Option<Duration>,
    /// After Saved/Failed, how long to wait for announced outputs that are missing.
    pub output_grace: Duration,
    /// After a delete, how long late events (slot releases) are still relayed.
    pub close_grace: Duration,
    /// A host whose status (published every 2 s) has not been heard for this long
    /// while it runs a cell is lost: the cell ends with what the store committed.
    pub host_lost: Duration,
}

impl Default for Timeouts {
    fn default() -> Self {
        Self {
            claim: Duration::from_secs(60),
            execution: None,
            output_grace: Duration::from_secs(5),
            close_grace: Duration::from_secs(2),
            host_lost: Duration::from_secs(10),
        }
    }
}

/// Stream items a session keeps by default (about a notebook's worth of outputs
/// and events, many times over).
pub const DEFAULT_HISTORY_ITEMS: usize = 20_000;

/// Bytes of stream items a session keeps by default: the item count alone let a
/// cell printing a megabyte a run keep every run's megabyte (20 GB at 20,000).
pub const DEFAULT_HISTORY_BYTES: usize = 64 << 20;

/// How often the `looseleaf_runs` gauge is counted again.
const RUNS_GAUGE_EVERY: Duration = Duration::from_secs(2);

/// Sessions idle this long with no client following them are detached by
/// default: a minute (a kernel that was killed, a script that stopped).
pub const DEFAULT_DETACH_UNWATCHED: Duration = Duration::from_secs(60);

/// A session watched but idle this long gives back its workers by default: an
/// hour (a notebook left open; its next cell restores its closure).
pub const DEFAULT_IDLE_CULL: Duration = Duration::from_secs(3600);

/// Detached sessions are kept this long by default: a week.
pub const DEFAULT_SESSION_RETENTION: Duration = Duration::from_secs(7 * 24 * 3600);

/// How often the detached sessions past their retention are looked for.
const RETENTION_SWEEP_EVERY: Duration = Duration::from_secs(600);

/// What the frontend needs.
#[derive(Clone, Debug)]
pub struct Config {
    /// Where NATS is and how to log in.
    pub nats: schemas::nats::NatsOptions,
    /// Where to serve `/healthz` and `/readyz`, if anywhere.
    pub health_listen: Option<std::net::SocketAddr>,
    /// Subject prefix.
    pub prefix: String,
    /// Address to serve HTTP on; port 0 picks a free one.
    pub listen: SocketAddr,
    /// Run-queue deadlines.
    pub timeouts: Timeouts,
    /// The API's bearer tokens (open: none asked).
    pub tokens: auth::Tokens,
    /// Stream items each session keeps for clients that connect or reconnect later.
    pub history_items: usize,
    /// The most bytes of those items (their JSON) each session keeps.
    pub history_bytes: usize,
    /// Sessions idle this long with no client are detached (None: never).
    pub detach_unwatched: Option<Duration>,
    /// Sessions idle this long, watched or not, give back their CPU worker and
    /// kept workers (None: never).
    pub idle_cull: Option<Duration>,
    /// Detached sessions are deleted with their state after this long (None: never).
    pub session_retention: Option<Duration>,
    /// Working-directory root, sessions per user, queued runs per session.
    pub limits: admission::Limits,
    /// Host names the API answers and browser origins that may read it (None: the
    /// defaults for `listen`).
    pub origins: Option<origins::Origins>,
    /// How long a client may take to send a request's headers and body.
    pub http_timeouts: serve::HttpTimeouts,
    /// Per-user limits on GPU use (none: no limit), read again when their file
    /// changes.
    pub quotas: quota::Quotas,
    /// This is the only frontend of its records (the user's local cluster): at
    /// start, the sessions they hold attached were served by a frontend that is
    /// gone, so they are marked detached, for their notebooks to resume.
    pub sole_frontend: bool,
}

impl Config {
    /// A config with the default deadlines.
    pub fn new(nats: schemas::nats::NatsOptions, prefix: impl Into<String>, listen: SocketAddr) -> Self {
        Self {
            nats,
            health_listen: None,
            prefix: prefix.into(),
            listen,
            timeouts: Timeouts::default(),
            tokens: auth::Tokens::open(),
            history_items: DEFAULT_HISTORY_ITEMS,
            history_bytes: DEFAULT_HISTORY_BYTES,
            detach_unwatched: Some(DEFAULT_DETACH_UNWATCHED),
            idle_cull: Some(DEFAULT_IDLE_CULL),
            session_retention: Some(DEFAULT_SESSION_RETENTION),
            limits: admission::Limits::default(),
            origins: None,
            http_timeouts: serve::HttpTimeouts::default(),
            quotas: quota::Quotas::none(),
            sole_frontend: false,
        }
    }
}

/// Run the frontend until `shutdown` resolves. Must be called inside an actix system.
pub async fn run(config: Config, shutdown: impl Future<Output = ()>) -> anyhow::Result<()> {
    run_with_bound(config, shutdown, |_| {}).await
}

/// [`run`], telling `on_bound` the address HTTP is served on once it listens.
pub async fn run_with_bound(
    config: Config,
    shutdown: impl Future<Output = ()>,
    on_bound: impl FnOnce(SocketAddr),
) -> anyhow::Result<()> {
    let description = "HTTP API, session events and run queues";
    let service = Service::start("looseleaf-frontend", None, description, &config.nats, &config.prefix).await?;
    let bus = service.bus().clone();
    schemas::buckets::events_stream(&bus.jetstream(), bus.subjects(), bus.replicas())
        .await
        .context("while creating the session-events stream (is JetStream enabled?)")?;
    schemas::buckets::outputs_stream(&bus.jetstream(), bus.subjects(), bus.replicas())
        .await
        .context("while creating the outputs stream")?;
    let claims = schemas::buckets::claims(&bus.jetstream(), &config.prefix, bus.replicas()).await?;
    let listener = tokio::net::TcpListener::bind(config.listen)
        .await
        .with_context(|| format!("while binding {}", config.listen))?;
    let bound = listener.local_addr().context("while reading the bound address")?;
    let token = CancellationToken::new();
    let hosts = session::HostsSeen::default();
    let statuses = bus.subscribe::<HostStatusV2>(bus.subjects().all_host_status()).await?;
    tokio::spawn(hosts.clone().follow(statuses));
    tokio::spawn(hosts.clone().watch_connection(bus.client().clone()));
    let dashboard = dashboard::Dashboard::default();
    let statuses = bus.subscribe::<HostStatusV2>(bus.subjects().all_host_status()).await?;
    tokio::spawn(dashboard.clone().follow_hosts(statuses));
    let records =
        records::Records::new(schemas::buckets::sessions(&bus.jetstream(), &config.prefix, bus.replicas()).await?);
    if config.sole_frontend {
        let orphans = records.detach_orphans().await.context("while detaching the sessions left attached")?;
        if !orphans.is_empty() {
            tracing::info!(sessions = ?orphans, "sessions left attached when the cluster stopped are detached");
        }
    }
    let usage = usage::Ledger::open(schemas::buckets::usage(&bus.jetstream(), &config.prefix, bus.replicas()).await?)
        .await
        .context("while reading today's usage")?;
    let state = http::AppState {
        shared: session::Shared {
            bus: bus.clone(),
            timeouts: config.timeouts,
            hosts,
            claims,
            records,
            bodies: schemas::bodies::Bodies::new(bus.client().clone(), &config.prefix, bus.replicas()),
            history_items: config.history_items.max(1),
            history_bytes: config.history_bytes.max(1),
            queued_runs: config.limits.queued_runs.max(1),
            dashboard,
            usage,
            quotas: config.quotas.clone(),
        },
        arbiter: actix::Arbiter::current(),
        sessions: Arc::new(RwLock::new(HashMap::new())),
        shutdown: token.clone(),
        tokens: config.tokens.clone(),
        limits: config.limits.clone(),
        origins: config.origins.clone().unwrap_or_else(|| origins::Origins::new(bound, &[], &[])),
        creating: Default::default(),
    };
    tokio::spawn(config.quotas.clone().follow(token.clone()));
    if !config.tokens.required() {
        tracing::warn!("the HTTP API asks for no token: anyone who reaches {bound} can use every session");
    }
    if let Some(after) = config.detach_unwatched {
        let (culler, stop) = (state.clone(), token.clone());
        let every = (after / 4).clamp(Duration::from_millis(200), Duration::from_secs(60));
        tokio::spawn(async move {
            while tokio::time::timeout(every, stop.cancelled()).await.is_err() {
                culler.detach_unwatched(after).await;
            }
        });
    }
    // the store stays low on space: one frontend discards the oldest detached session
    let mut pressures =
        bus.queue_subscribe::<schemas::messages::StorePressureV1>(bus.subjects().store_pressure(), "frontend").await?;
    {
        let (discarder, stop) = (state.clone(), token.clone());
        tokio::spawn(async move {
            loop {
                let pressure = tokio::select! {
                    () = stop.cancelled() => return,
                    next = pressures.next() => match next {
                        Some(Ok(env)) => env.msg,
                        Some(Err(_)) => continue, // logged by the bus
                        None => return,
                    },
                };
                discarder.discard_for_space(&pressure).await;
            }
        });
    }
    if let Some(after) = config.idle_cull {
        let (culler, stop) = (state.clone(), token.clone());
        let every = (after / 4).clamp(Duration::from_millis(200), Duration::from_secs(60));
        tokio::spawn(async move {
            while tokio::time::timeout(every, stop.cancelled()).await.is_err() {
                culler.cull_idle_workers(after).await;
            }
        });
    }
    if let Some(retention) = config.session_retention {
        let (sweeper, stop) = (state.clone(), token.clone());
        tokio::spawn(async move {
            loop {
                sweeper.sweep_detached(retention).await;
                // (a retention shorter than the sweep's period is swept within half of it)
                let every = RETENTION_SWEEP_EVERY.min(retention / 2).max(Duration::from_millis(200));
                if tokio::time::timeout(every, stop.cancelled()).await.is_ok() {
                    return;
                }
            }
        });
    }
    // the runs gauge, read by autoscalers: fresher than a scrape interval
    let (counter, stop) = (state.clone(), token.clone());
    tokio::spawn(async move {
        while tokio::time::timeout(RUNS_GAUGE_EVERY, stop.cancelled()).await.is_err() {
            counter.count_runs().await;
        }
    });
    // probes need no token: /healthz and /readyz sit beside the API, outside its checks
    let sessions = schemas::health::bucket(&bus, schemas::buckets::sessions_bucket(&config.prefix));
    let readiness = schemas::health::Readiness::new(&bus).with("sessions_bucket", sessions);
    if let Some(listen) = config.health_listen {
        schemas::health::serve(listen, readiness.clone()).await?;
    }
    let app = http::router(state.clone(), config.http_timeouts.body).merge(schemas::health::router(readiness));
    let header_timeout = config.http_timeouts.header;
    // The HTTP server is this service's worker: if it ends by itself the service
    // stops with an error (the skeleton notices through `serving`).
    let serving = Arc::new(AtomicBool::new(true));
    let (ended_tx, ended_rx) = tokio::sync::oneshot::channel();
    let (server_token, flag) = (token.clone(), serving.clone());
    let server = tokio::spawn(async move {
        let result = serve::serve(listener, app, header_timeout, server_token).await;
        if let Err(e) = &result {
            tracing::error!(error = %e, "the HTTP server stopped");
        }
        flag.store(false, Ordering::SeqCst);
        let _ = ended_tx.send(result);
    });
    tracing::info!(addr = %bound, prefix = %config.prefix, "frontend serving on http://{bound}");
    on_bound(bound);
    let drain = async {
        // no new requests; open event streams end; sessions stop at once
        token.cancel();
        for addr in state.drain() {
            addr.do_send(session::Close { grace: Duration::ZERO });
        }
        if tokio::time::timeout(Duration::from_secs(5), ended_rx).await.is_err() {
            tracing::warn!("HTTP connections did not close in 5 s; aborting them");
            server.abort();
        }
    };
    service.serve(shutdown, || serving.load(Ordering::SeqCst), drain).await?;
    Ok(())
}
