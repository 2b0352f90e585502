//! Opening the checkpoint object store from a URL, the same way in the store gateway
//! and in every host (both read and write it directly; DESIGN.md "The byte path").
//!
//! - `file:///dir` or a plain path: a local directory (created if missing).
//! - `s3://bucket[/prefix]`: S3 or any S3-compatible server. Credentials, region and
//!   endpoint come from the usual `AWS_*` variables (`AWS_ACCESS_KEY_ID`,
//!   `AWS_SECRET_ACCESS_KEY`, `AWS_REGION`, `AWS_ENDPOINT_URL`, and
//!   `AWS_ALLOW_HTTP=true` for a plain-HTTP test server); `AWS_ACCESS_KEY_ID_FILE`
//!   and `AWS_SECRET_ACCESS_KEY_FILE` name files holding the keys (mounted secrets).

use std::sync::{Arc, Once};

use object_store::aws::AmazonS3Builder;
use object_store::local::LocalFileSystem;
use object_store::prefix::PrefixStore;
use object_store::ObjectStore;

/// Why the object store could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    /// The URL's scheme is not one this build supports.
    #[error("unsupported store URL {0:?}: use file:///path, a plain directory path, or s3://bucket[/prefix]")]
    Unsupported(String),
    /// The directory could not be created or opened.
    #[error("cannot open store directory {path}: {reason}")]
    Local {
        /// The directory.
        path: String,
        /// Why.
        reason: String,
    },
    /// The S3 client could not be configured from the URL and `AWS_*` variables.
    #[error("cannot open S3 store {url}: {reason}")]
    S3 {
        /// The URL.
        url: String,
        /// Why.
        reason: String,
    },
}

/// Open `url` (see the module docs for the forms).
pub fn open(url: &str) -> Result<Arc<dyn ObjectStore>, OpenError> {
    open_with(url, &[])
}

/// Open `url`; for S3, `settings` (e.g. `("aws_endpoint", "http://…")`) override the
/// `AWS_*` variables, so a test can point one store at its own server.
pub fn open_with(url: &str, settings: &[(&str, &str)]) -> Result<Arc<dyn ObjectStore>, OpenError> {
    if url.starts_with("s3://") {
        return open_s3(url, settings);
    }
    let path = if let Some(p) = url.strip_prefix("file://") {
        p
    } else if url.contains("://") {
        return Err(OpenError::Unsupported(url.to_string()));
    } else {
        url
    };
    // made owner-only: sessions' checkpoints are theirs alone, and cells may run
    // as other users on this machine (ADR 29)
    if !std::path::Path::new(path).exists() {
        use std::os::unix::fs::DirBuilderExt as _;
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(path)
            .map_err(|e| OpenError::Local { path: path.to_string(), reason: e.to_string() })?;
    }
    let fs = LocalFileSystem::new_with_prefix(path)
        .map_err(|e| OpenError::Local { path: path.to_string(), reason: e.to_string() })?;
    Ok(Arc::new(fs))
}

fn open_s3(url: &str, settings: &[(&str, &str)]) -> Result<Arc<dyn ObjectStore>, OpenError> {
    install_crypto_provider();
    let rest = url.trim_start_matches("s3://");
    let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
    if bucket.is_empty() {
        return Err(OpenError::S3 { url: url.to_string(), reason: "no bucket name".into() });
    }
    let mut builder = AmazonS3Builder::from_env().with_bucket_name(bucket);
    // keys from mounted secret files (compose's and Kubernetes' way), not the environment
    let from_file = |var: &str| -> Result<Option<String>, OpenError> {
        let Some(path) = std::env::var_os(var) else { return Ok(None) };
        let text = std::fs::read_to_string(&path).map_err(|e| OpenError::S3 {
            url: url.to_string(),
            reason: format!("{var} names {}: {e}", std::path::Path::new(&path).display()),
        })?;
        Ok(Some(text.trim().to_string()))
    };
    if let Some(key) = from_file("AWS_ACCESS_KEY_ID_FILE")? {
        builder = builder.with_access_key_id(key);
    }
    if let Some(secret) = from_file("AWS_SECRET_ACCESS_KEY_FILE")? {
        builder = builder.with_secret_access_key(secret);
    }
    for (key, value) in settings {
        let key =
            key.parse().map_err(|e| OpenError::S3 { url: url.to_string(), reason: format!("setting {key:?}: {e}") })?;
        builder = builder.with_config(key, *value);
    }
    let s3 = builder.build().map_err(|e| OpenError::S3 { url: url.to_string(), reason: e.to_string() })?;
    let prefix = prefix.trim_matches('/');
    if prefix.is_empty() {
        Ok(Arc::new(s3))
    } else {
        Ok(Arc::new(PrefixStore::new(s3, prefix)))
    }
}

/// async-nats and object_store's HTTP client both use rustls; with more than one
/// provider compiled in, rustls needs the process to pick one before first use.
pub fn install_crypto_provider() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // Err means another part of the process already installed one: fine.
        let _ = rustls::crypto::ring::default_provider().install_default();
    });
}
