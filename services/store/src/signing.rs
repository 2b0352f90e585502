//! Manifests carry a MAC (HMAC-SHA256) with a key only the store gateway holds, so
//! that write access to the bucket is not code execution in a worker (DESIGN.md
//! section 13, ADR 24): a manifest names the records a worker unpickles, through
//! chunk hashes the host checks every chunk against, and restore loads only
//! manifests that verify.
//!
//! The stored object is the manifest's JSON with one more field, `mac`: the hex
//! HMAC of the manifest's JSON without it (serde_json of the struct, which is
//! deterministic: fields in declaration order, maps sorted). The MAC covers the
//! session and revision, which the reader checks against the object's key, so a
//! manifest cannot be replayed under another session or revision.

use std::path::Path;

use ring::hmac;
use schemas::checkpoint::Manifest;
use serde::{Deserialize, Serialize};

/// Fewest bytes a key file must hold.
pub const MIN_KEY_BYTES: usize = 32;

/// The platform's manifest key.
#[derive(Clone)]
pub struct ManifestKey(hmac::Key);

impl std::fmt::Debug for ManifestKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ManifestKey(..)") // never print the key
    }
}

/// Why a key file cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum KeyError {
    /// It cannot be read.
    #[error("manifest key file {path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// It is too short to be a key.
    #[error("manifest key file {path} holds {len} bytes; a key needs at least {MIN_KEY_BYTES}")]
    TooShort {
        /// The file.
        path: String,
        /// Its length after trimming whitespace.
        len: usize,
    },
}

impl ManifestKey {
    /// A key of `bytes` (at least [`MIN_KEY_BYTES`]; callers check).
    pub fn new(bytes: &[u8]) -> Self {
        Self(hmac::Key::new(hmac::HMAC_SHA256, bytes))
    }

    /// The key in `path` (its bytes, surrounding whitespace trimmed).
    pub fn from_file(path: &Path) -> Result<Self, KeyError> {
        let shown = path.display().to_string();
        let bytes = std::fs::read(path).map_err(|source| KeyError::Read { path: shown.clone(), source })?;
        let key = bytes.trim_ascii();
        if key.len() < MIN_KEY_BYTES {
            return Err(KeyError::TooShort { path: shown, len: key.len() });
        }
        Ok(Self::new(key))
    }
}

/// Why a stored manifest was refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum Unverified {
    /// It carries no MAC.
    #[error("it carries no MAC (written without the platform's key, or by something else)")]
    NoMac,
    /// Its MAC does not match its contents under the platform's key.
    #[error("its MAC does not verify (changed after it was written, or written with another key)")]
    BadMac,
}

#[derive(Serialize)]
struct SignedRef<'a> {
    #[serde(flatten)]
    manifest: &'a Manifest,
    mac: String,
}

#[derive(Deserialize)]
struct Stored {
    #[serde(flatten)]
    manifest: Manifest,
    #[serde(default)]
    mac: Option<String>,
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) {
        return None;
    }
    (0..s.len()).step_by(2).map(|i| s.get(i..i + 2).and_then(|h| u8::from_str_radix(h, 16).ok())).collect()
}

/// The bytes to store for `manifest`: signed with `key`, or plain JSON without one.
pub fn seal(manifest: &Manifest, key: Option<&ManifestKey>) -> serde_json::Result<Vec<u8>> {
    let Some(key) = key else { return serde_json::to_vec(manifest) };
    let body = serde_json::to_vec(manifest)?;
    let mac = hex(hmac::sign(&key.0, &body).as_ref());
    serde_json::to_vec(&SignedRef { manifest, mac })
}

/// What a stored object holds, once parsed.
pub enum Opened {
    /// A manifest that verified (or any manifest, where no key is configured).
    Verified(Manifest),
    /// A manifest that did not verify, and why. Never load it; only the collector
    /// looks at it, to keep its chunks rather than risk a real revision's.
    Unverified(Manifest, Unverified),
}

/// Parse stored `bytes` and verify their MAC under `key` (no key: nothing to verify).
pub fn open(bytes: &[u8], key: Option<&ManifestKey>) -> serde_json::Result<Opened> {
    let stored: Stored = serde_json::from_slice(bytes)?;
    let Some(key) = key else { return Ok(Opened::Verified(stored.manifest)) };
    let Some(mac) = stored.mac.as_deref() else { return Ok(Opened::Unverified(stored.manifest, Unverified::NoMac)) };
    let body = serde_json::to_vec(&stored.manifest)?;
    let ok = unhex(mac).is_some_and(|tag| hmac::verify(&key.0, &body, &tag).is_ok());
    Ok(if ok { Opened::Verified(stored.manifest) } else { Opened::Unverified(stored.manifest, Unverified::BadMac) })
}

#[cfg(test)]
mod tests {
    use super::*;
    use schemas::checkpoint::{Blob, VarEntry};
    use uuid::Uuid;

    fn manifest() -> Manifest {
        let mut m = Manifest::empty(Uuid::new_v4());
        m.revision = 3;
        let x = VarEntry { version: Uuid::new_v4(), oid: Some("o1".into()), module: None, global_reads: vec![] };
        m.variables.insert("x".into(), x);
        m.ambient = Some(Blob { len: 5, chunks: vec!["ab".repeat(16)] });
        m
    }

    fn key(byte: u8) -> ManifestKey {
        ManifestKey::new(&[byte; MIN_KEY_BYTES])
    }

    fn verified(o: Opened) -> Result<Manifest, Unverified> {
        match o {
            Opened::Verified(m) => Ok(m),
            Opened::Unverified(_, why) => Err(why),
        }
    }

    #[test]
    fn a_sealed_manifest_opens_to_itself() {
        let m = manifest();
        let bytes = seal(&m, Some(&key(1))).unwrap();
        assert_eq!(verified(open(&bytes, Some(&key(1))).unwrap()), Ok(m));
    }

    #[test]
    fn a_changed_manifest_or_another_key_does_not_verify() {
        let m = manifest();
        let bytes = seal(&m, Some(&key(1))).unwrap();
        assert_eq!(verified(open(&bytes, Some(&key(2))).unwrap()), Err(Unverified::BadMac));
        // a forger edits the record a variable points at, keeping the old MAC
        let text = String::from_utf8(bytes).unwrap().replace("\"len\":5", "\"len\":6");
        assert_eq!(verified(open(text.as_bytes(), Some(&key(1))).unwrap()), Err(Unverified::BadMac));
        let garbage = String::from_utf8(seal(&m, Some(&key(1))).unwrap()).unwrap();
        let garbage = garbage.replace("\"mac\":\"", "\"mac\":\"zz");
        assert_eq!(verified(open(garbage.as_bytes(), Some(&key(1))).unwrap()), Err(Unverified::BadMac));
    }

    #[test]
    fn an_unsigned_manifest_verifies_only_without_a_key() {
        let m = manifest();
        let plain = seal(&m, None).unwrap();
        assert_eq!(verified(open(&plain, Some(&key(1))).unwrap()), Err(Unverified::NoMac));
        assert_eq!(verified(open(&plain, None).unwrap()), Ok(m));
    }

    #[test]
    fn a_short_or_missing_key_file_is_an_error_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let short = dir.path().join("short");
        std::fs::write(&short, "abc\n").unwrap();
        let e = ManifestKey::from_file(&short).unwrap_err().to_string();
        assert!(e.contains("short") && e.contains("holds 3 bytes"), "{e}");
        let e = ManifestKey::from_file(&dir.path().join("none")).unwrap_err().to_string();
        assert!(e.contains("none"), "{e}");
        let good = dir.path().join("good");
        std::fs::write(&good, format!("{}\n", "k".repeat(64))).unwrap();
        assert!(ManifestKey::from_file(&good).is_ok());
    }
}
