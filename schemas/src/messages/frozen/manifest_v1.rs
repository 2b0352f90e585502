//! Version 1 of the manifest reply (`manifest` 1), frozen: a manifest without its
//! lineage (parent revision, fork point). Its objects and blobs encode as the
//! commit's version 1 does.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use uuid::Uuid;

use super::commit_v1::{Blob, ObjectEntry};
use crate::checkpoint as live;
use crate::messages::ManifestV2;

/// store ->: a session's manifest.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ManifestV1 {
    /// The manifest.
    pub manifest: Manifest,
}

/// A session's committed state at one revision.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    /// The session.
    pub session: Uuid,
    /// Revision.
    pub revision: u64,
    /// The execution that committed it.
    pub exec_id: Uuid,
    /// Live savable names.
    pub variables: BTreeMap<String, VarEntry>,
    /// Object records by oid.
    pub objects: BTreeMap<String, ObjectEntry>,
    /// Live names that could not be saved.
    pub unsavable: BTreeMap<String, Unsavable>,
    /// Ambient state.
    pub ambient: Option<Blob>,
}

/// One live name.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct VarEntry {
    /// The execution that last defined or changed it.
    pub version: Uuid,
    /// Its root object.
    pub oid: Option<String>,
    /// A module it names.
    pub module: Option<String>,
    /// Globals its function reads.
    pub global_reads: Vec<String>,
}

/// A name whose value could not be saved.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Unsavable {
    /// The execution that defined it.
    pub version: Uuid,
    /// Why.
    pub reason: String,
    /// Host holding the worker.
    pub host: String,
    /// The worker.
    pub worker: String,
    /// The cell that defined it.
    pub cell_id: String,
}

impl ManifestV1 {
    /// The same manifest as version 2, its lineage unknown (undo cannot step
    /// back from it).
    pub fn upgrade(self) -> ManifestV2 {
        let m = self.manifest;
        ManifestV2 {
            manifest: live::Manifest {
                session: m.session,
                revision: m.revision,
                exec_id: m.exec_id,
                variables: m
                    .variables
                    .into_iter()
                    .map(|(k, v)| {
                        let v = live::VarEntry {
                            version: v.version,
                            oid: v.oid,
                            module: v.module,
                            global_reads: v.global_reads,
                        };
                        (k, v)
                    })
                    .collect(),
                objects: m.objects.into_iter().map(|(k, o)| (k, o.upgrade())).collect(),
                unsavable: m
                    .unsavable
                    .into_iter()
                    .map(|(k, u)| {
                        let u = live::Unsavable {
                            version: u.version,
                            reason: u.reason,
                            host: u.host,
                            worker: u.worker,
                            cell_id: u.cell_id,
                        };
                        (k, u)
                    })
                    .collect(),
                ambient: m.ambient.map(Blob::upgrade),
                parent: None,
                forked_from: None,
            },
        }
    }
}
