//! Opening the checkpoint object store from a URL, the same way in the store gateway
//! and in every host (both read and write it directly; DESIGN.md "The byte path").

use std::sync::Arc;

use object_store::local::LocalFileSystem;
use object_store::ObjectStore;

/// Why the object store could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    /// The URL's scheme is not one this build supports.
    #[error("unsupported store URL {0:?}: use file:///path or a plain directory path")]
    Unsupported(String),
    /// The directory could not be created or opened.
    #[error("cannot open store directory {path}: {reason}")]
    Local {
        /// The directory.
        path: String,
        /// Why.
        reason: String,
    },
}

/// Open `url`: `file:///dir`, or a plain directory path (created if missing).
pub fn open(url: &str) -> Result<Arc<dyn ObjectStore>, OpenError> {
    let path = if let Some(p) = url.strip_prefix("file://") {
        p
    } else if url.contains("://") {
        return Err(OpenError::Unsupported(url.to_string()));
    } else {
        url
    };
    std::fs::create_dir_all(path)
        .map_err(|e| OpenError::Local { path: path.to_string(), reason: e.to_string() })?;
    let fs = LocalFileSystem::new_with_prefix(path)
        .map_err(|e| OpenError::Local { path: path.to_string(), reason: e.to_string() })?;
    Ok(Arc::new(fs))
}
