//! How every LooseLeaf process connects to NATS as operators run it (ADR 35): a
//! seed list of servers, a login (user and password in the URL, a token, an NKEY
//! seed or a `.creds` file), TLS with a private CA and a client certificate, a
//! wait with backoff while NATS is not up yet, and the replica count of the
//! JetStream buckets and streams the services create.

use std::path::PathBuf;
use std::time::Duration;

use async_nats::{Client, ConnectErrorKind, ServerAddr};

use crate::bus::shown_url;
use crate::BusError;

/// First wait between connection attempts; it doubles up to [`MAX_BACKOFF`].
const FIRST_BACKOFF: Duration = Duration::from_millis(100);
/// Longest wait between connection attempts.
const MAX_BACKOFF: Duration = Duration::from_secs(5);

/// Where NATS is and how to log in to it (flattened into every service's flags and
/// the CLI's). Secrets come from files or the environment, never from logs: `Debug`
/// leaves the token and passwords out.
#[derive(clap::Args, Clone)]
pub struct NatsOptions {
    /// NATS server URL, or a comma-separated seed list of a cluster's servers
    /// (`nats://a:4222,nats://b:4222`). A URL may carry `user:password@` or
    /// `token@`; `tls://` requires TLS.
    #[arg(long = "nats-url", env = "LOOSELEAF_NATS_URL", default_value = "nats://127.0.0.1:4222")]
    pub url: String,
    /// The user to log in as, with `--nats-password-file` (instead of a password
    /// in the URL, which shows in the environment).
    #[arg(long = "nats-user", env = "LOOSELEAF_NATS_USER", requires = "password_file")]
    pub user: Option<String>,
    /// A file holding the password of `--nats-user` (a mounted secret).
    #[arg(long = "nats-password-file", env = "LOOSELEAF_NATS_PASSWORD_FILE", requires = "user")]
    pub password_file: Option<PathBuf>,
    /// A `.creds` file (user JWT and NKEY seed) to log in with.
    #[arg(long = "nats-creds", env = "LOOSELEAF_NATS_CREDS")]
    pub creds: Option<PathBuf>,
    /// A file holding an NKEY seed (`SU…`) to log in with.
    #[arg(long = "nats-nkey", env = "LOOSELEAF_NATS_NKEY")]
    pub nkey: Option<PathBuf>,
    /// A token to log in with (prefer the environment variable: arguments show in `ps`).
    #[arg(long = "nats-token", env = "LOOSELEAF_NATS_TOKEN", hide_env_values = true)]
    pub token: Option<String>,
    /// PEM file of the CA that signed the servers' certificates (a private CA);
    /// giving it requires TLS.
    #[arg(long = "nats-tls-ca", env = "LOOSELEAF_NATS_TLS_CA")]
    pub tls_ca: Option<PathBuf>,
    /// PEM client certificate, for servers that verify clients (with `--nats-tls-key`).
    #[arg(long = "nats-tls-cert", env = "LOOSELEAF_NATS_TLS_CERT", requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// PEM private key of the client certificate.
    #[arg(long = "nats-tls-key", env = "LOOSELEAF_NATS_TLS_KEY", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// Replicas of the JetStream buckets and streams this process creates (3 on a
    /// 3-node cluster; at most the number of servers). Only the first creator's
    /// count applies: an existing bucket is used as it is.
    #[arg(long = "nats-replicas", env = "LOOSELEAF_NATS_REPLICAS", default_value_t = 1)]
    pub replicas: usize,
    /// How long to keep trying while no server answers (seconds), so that a service
    /// started before NATS waits for it instead of exiting.
    #[arg(long = "nats-connect-wait", env = "LOOSELEAF_NATS_CONNECT_WAIT", default_value_t = 60)]
    pub connect_wait_s: u64,
}

impl std::fmt::Debug for NatsOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NatsOptions")
            .field("url", &self.shown())
            .field("user", &self.user)
            .field("password_file", &self.password_file)
            .field("creds", &self.creds)
            .field("nkey", &self.nkey)
            .field("token", &self.token.as_ref().map(|_| "…"))
            .field("tls_ca", &self.tls_ca)
            .field("tls_cert", &self.tls_cert)
            .field("tls_key", &self.tls_key)
            .field("replicas", &self.replicas)
            .field("connect_wait_s", &self.connect_wait_s)
            .finish()
    }
}

impl NatsOptions {
    /// `url` (one server or a seed list) with no other login, one replica, and a
    /// short wait: what tests and local tools use.
    pub fn url(url: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            user: None,
            password_file: None,
            creds: None,
            nkey: None,
            token: None,
            tls_ca: None,
            tls_cert: None,
            tls_key: None,
            replicas: 1,
            connect_wait_s: 5,
        }
    }

    /// The server URLs without passwords or tokens, for messages and logs.
    pub fn shown(&self) -> String {
        self.seeds().map(shown_url).collect::<Vec<_>>().join(",")
    }

    fn seeds(&self) -> impl Iterator<Item = &str> {
        self.url.split(',').map(str::trim).filter(|s| !s.is_empty())
    }

    /// The client options these settings make: the login, TLS, and (for a user
    /// named in the URL) the user's own inbox prefix (ADR 27).
    async fn options(&self, name: &str) -> Result<(async_nats::ConnectOptions, Vec<ServerAddr>), BusError> {
        let shown = self.shown();
        let parse_error = |source| BusError::Connect {
            url: shown.clone(),
            source: async_nats::ConnectError::with_source(ConnectErrorKind::ServerParse, source),
        };
        let mut addrs = Vec::new();
        let mut login: Option<(String, Option<String>)> = None;
        for seed in self.seeds() {
            let addr: ServerAddr = seed.parse().map_err(parse_error)?;
            if login.is_none() {
                login = addr.username().map(|u| (u.to_string(), addr.password().map(str::to_string)));
            }
            // the address without the login: the client logs addresses at debug level
            addrs.push(shown_url(seed).parse().unwrap_or(addr));
        }
        if addrs.is_empty() {
            return Err(parse_error(std::io::Error::other("no server URL given")));
        }
        let file_error = |what: &'static str, path: &PathBuf, source: std::io::Error| BusError::LoginFile {
            what,
            path: path.display().to_string(),
            source,
        };
        let mut options = match &self.creds {
            Some(path) => async_nats::ConnectOptions::with_credentials_file(path)
                .await
                .map_err(|e| file_error("credentials file", path, e))?,
            None => async_nats::ConnectOptions::new(),
        };
        if let Some(path) = &self.nkey {
            let text = std::fs::read_to_string(path).map_err(|e| file_error("NKEY seed file", path, e))?;
            let seed = text.lines().map(str::trim).find(|l| l.starts_with("SU")).ok_or_else(|| {
                file_error("NKEY seed file", path, std::io::Error::other("it holds no user seed (a line starting SU)"))
            })?;
            options = options.nkey(seed.to_string());
        }
        if let (Some(user), Some(path)) = (&self.user, &self.password_file) {
            let text = std::fs::read_to_string(path).map_err(|e| file_error("password file", path, e))?;
            // a secret file's trailing newline is not part of the password
            let password = text.trim_end_matches(['\n', '\r']);
            if password.is_empty() {
                return Err(file_error("password file", path, std::io::Error::other("it is empty")));
            }
            login = Some((user.clone(), Some(password.to_string())));
        }
        match (login, &self.token) {
            (Some((user, Some(password))), _) => {
                options = options
                    .user_and_password(user.clone(), password)
                    .custom_inbox_prefix(crate::permissions::inbox_prefix(&user));
            }
            // `nats://TOKEN@host`, NATS's own convention
            (Some((token, None)), None) => options = options.token(token),
            (_, Some(token)) => options = options.token(token.clone()),
            (None, None) => {}
        }
        if let Some(ca) = &self.tls_ca {
            options = options.add_root_certificates(ca.clone()).require_tls(true);
        }
        if let (Some(cert), Some(key)) = (&self.tls_cert, &self.tls_key) {
            options = options.add_client_certificate(cert.clone(), key.clone());
        }
        // a connection after a disconnection is a reconnect (the first one is not)
        let lost = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let options = options.name(name).connection_timeout(Duration::from_secs(5)).event_callback(move |event| {
            let lost = lost.clone();
            async move {
                use std::sync::atomic::Ordering;
                match event {
                    async_nats::Event::Connected if lost.swap(false, Ordering::SeqCst) => {
                        crate::metrics::metrics().nats_reconnects.inc();
                        tracing::info!("reconnected to NATS");
                    }
                    async_nats::Event::Disconnected => {
                        lost.store(true, Ordering::SeqCst);
                        tracing::warn!("disconnected from NATS; reconnecting");
                    }
                    other => tracing::debug!(event = %other, "NATS connection"),
                }
            }
        });
        Ok((options, addrs))
    }

    /// Connect as `name`. While no server answers, try again with backoff for up to
    /// the connect wait; a refused login or a TLS failure is reported at once.
    pub async fn connect(&self, name: &str) -> Result<Client, BusError> {
        let (options, addrs) = self.options(name).await?;
        let deadline = tokio::time::Instant::now() + Duration::from_secs(self.connect_wait_s);
        let mut backoff = FIRST_BACKOFF;
        loop {
            let error = match options.clone().connect(addrs.clone()).await {
                Ok(client) => return Ok(client),
                Err(e) => e,
            };
            let now = tokio::time::Instant::now();
            if !nobody_answered(&error) || now + backoff > deadline {
                return Err(BusError::Connect { url: self.shown(), source: error });
            }
            tracing::warn!(url = %self.shown(), error = %error, "NATS is not reachable yet; trying again in {backoff:?}");
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(MAX_BACKOFF);
        }
    }
}

/// Whether a failed connect is worth trying again: no server answered (refused,
/// unreachable, timed out). A refused login, a certificate the client does not
/// trust (rustls reports it as invalid data) or a TLS setup error will not change.
/// Whether a connect failed because nothing answered there (not a refused login
/// or a TLS certificate problem).
pub fn nobody_answered(error: &async_nats::ConnectError) -> bool {
    match error.kind() {
        ConnectErrorKind::TimedOut | ConnectErrorKind::Dns => true,
        ConnectErrorKind::Io => {
            let mut source = std::error::Error::source(error);
            while let Some(e) = source {
                if e.downcast_ref::<std::io::Error>().is_some_and(|io| io.kind() == std::io::ErrorKind::InvalidData) {
                    return false;
                }
                source = e.source();
            }
            !error.to_string().contains("certificate")
        }
        _ => false,
    }
}
