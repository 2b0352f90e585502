//! The skeleton every service runs in (store, planner, gpu-host, frontend): the
//! flags they share, connecting, registering with the NATS service API (`$SRV`),
//! serving until SIGINT/SIGTERM or until the service's actor stops, then draining
//! in-flight work within a bounded time, flushing NATS and closing, and flushing
//! telemetry last (so the spans of the drain are exported too).
//!
//! ```text
//!  main ─▶ telemetry::init ─▶ Service::start (connect, $SRV) ─▶ subscribe, actor
//!       ─▶ Service::serve: wait (signal │ actor stopped) ─▶ drain (≤ DRAIN) ─▶ flush, close NATS ─▶ telemetry::flush
//! ```

use std::future::Future;
use std::time::Duration;

use crate::nats::NatsOptions;
use crate::{telemetry, Bus, BusError};

/// Longest a service waits for its in-flight work after a stop signal.
pub const DRAIN: Duration = Duration::from_secs(10);

/// Longest the flush and the close of the NATS connection may take when stopping.
const CLOSE: Duration = Duration::from_secs(2);

/// How often `serve` checks that the service's actor is still running.
const ALIVE_CHECK: Duration = Duration::from_millis(500);

/// Flags every service takes (flattened into each one's own).
#[derive(clap::Args, Clone, Debug)]
pub struct ServiceArgs {
    /// Where NATS is and how to log in.
    #[command(flatten)]
    pub nats: NatsOptions,
    /// Subject prefix (isolates tenants and tests).
    #[arg(long, env = "LOOSELEAF_PREFIX", default_value = "ll")]
    pub prefix: String,
    /// Log filter (an `EnvFilter` directive such as `info,looseleaf_planner=debug`).
    #[arg(long, env = "LOOSELEAF_LOG", default_value = "info")]
    pub log: String,
    /// How log lines are written: text (coloured only on a terminal) or json (one
    /// object per line, with trace and span ids).
    #[arg(long, env = "LOOSELEAF_LOG_FORMAT", value_enum, default_value_t)]
    pub log_format: telemetry::LogFormat,
    /// Serve `/healthz` and `/readyz` for probes on this address (e.g. 0.0.0.0:9090).
    #[arg(long, env = "LOOSELEAF_HEALTH_LISTEN")]
    pub health_listen: Option<std::net::SocketAddr>,
}

/// Why a service stopped other than by a signal.
#[derive(Debug, thiserror::Error)]
pub enum ServiceError {
    /// Connecting or registering failed.
    #[error(transparent)]
    Bus(#[from] BusError),
    /// The actor that does the service's work stopped (a panic, or every stream it
    /// served ended): the process exits with an error so its supervisor restarts it.
    #[error("{service}: its actor stopped; exiting so that it is restarted")]
    ActorStopped {
        /// The service.
        service: &'static str,
    },
}

/// A connected, registered service.
pub struct Service {
    name: &'static str,
    bus: Bus,
    registration: async_nats::service::Service,
    drain_timeout: Duration,
}

impl Service {
    /// Connect to NATS as `name` (the client name is `name`, plus `instance` when
    /// several run, like hosts) and register with `$SRV`.
    pub async fn start(
        name: &'static str,
        instance: Option<&str>,
        description: &str,
        nats: &NatsOptions,
        prefix: &str,
    ) -> Result<Self, ServiceError> {
        let client_name = match instance {
            Some(i) => format!("{name}-{i}"),
            None => name.to_string(),
        };
        let bus = Bus::connect_with(nats, prefix, &client_name).await?.for_service(name);
        let registration = bus.register_service(name, description).await?;
        Ok(Self { name, bus, registration, drain_timeout: DRAIN })
    }

    /// Wait at most `timeout` for in-flight work when stopping (default [`DRAIN`]).
    pub fn with_drain_timeout(mut self, timeout: Duration) -> Self {
        self.drain_timeout = timeout;
        self
    }

    /// The service's bus.
    pub fn bus(&self) -> &Bus {
        &self.bus
    }

    /// Serve requests on `subject` as this service's `$SRV` endpoint `name`, in
    /// `queue_group` (see [`Bus::endpoint`]).
    pub async fn endpoint<M: crate::codec::WireMessage>(
        &self,
        name: &str,
        subject: String,
        queue_group: &str,
    ) -> Result<crate::bus::Subscription<M>, BusError> {
        self.bus.endpoint(&self.registration, name, subject, queue_group).await
    }

    /// Serve until `shutdown` resolves or `alive` says the actor stopped; then run
    /// `drain` for at most the drain timeout, flush and close the connection, and flush
    /// telemetry. A stopped actor is an error (after the same clean-up).
    pub async fn serve(
        self,
        shutdown: impl Future<Output = ()>,
        alive: impl Fn() -> bool,
        drain: impl Future<Output = ()>,
    ) -> Result<(), ServiceError> {
        let name = self.name;
        let watch = async {
            loop {
                tokio::time::sleep(ALIVE_CHECK).await;
                if !alive() {
                    return;
                }
            }
        };
        let stopped = tokio::select! {
            () = shutdown => false,
            () = watch => true,
        };
        if stopped {
            tracing::error!(service = name, "the service's actor stopped");
        } else {
            tracing::info!(service = name, "stopping: draining in-flight work");
        }
        let limit = self.drain_timeout;
        if tokio::time::timeout(limit, drain).await.is_err() {
            tracing::warn!(service = name, "in-flight work did not finish within {limit:?}; stopping anyway");
        }
        self.close().await;
        if stopped {
            Err(ServiceError::ActorStopped { service: name })
        } else {
            Ok(())
        }
    }

    /// Leave `$SRV`, deliver what was published, close the connection, then flush
    /// telemetry.
    async fn close(self) {
        if let Err(e) = self.registration.stop().await {
            tracing::debug!(error = %e, "leaving $SRV");
        }
        // bounded: with NATS gone, neither would ever finish
        match tokio::time::timeout(CLOSE, self.bus.flush()).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::warn!(error = %e, "could not flush NATS before stopping"),
            Err(_) => tracing::warn!("NATS did not answer within {CLOSE:?}; stopping without a flush"),
        }
        // drain: unsubscribe everything, send what is buffered, close
        if let Ok(Err(e)) = tokio::time::timeout(CLOSE, self.bus.client().drain()).await {
            tracing::debug!(error = %e, "closing the NATS connection");
        }
        telemetry::flush();
    }
}
