//! Version 1 of the manifest get (`manifest-get` 1), frozen.

use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::messages::ManifestGetV2;

/// -> store: the latest manifest of a session (no known revision).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ManifestGetV1 {
    /// The session.
    pub session: Uuid,
}

impl ManifestGetV1 {
    /// The same request as version 2: it names no known revision, so the gateway asks.
    pub fn upgrade(self) -> ManifestGetV2 {
        ManifestGetV2 { session: self.session, at_least: None }
    }
}
