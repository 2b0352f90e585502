//! Version 1 of the commit (`commit` 1), frozen, with the delta as version 1
//! encodes it.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::checkpoint as live;
use crate::messages::CommitV2;

/// host -> store: commit a worker's save, naming no uploads.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CommitV1 {
    /// The session.
    pub session: Uuid,
    /// The revision the worker's state was based on.
    pub base_revision: u64,
    /// The execution whose results these are.
    pub exec_id: Uuid,
    /// The host that holds the worker.
    pub host: String,
    /// The worker.
    pub worker: String,
    /// The cell id.
    pub cell_id: String,
    /// What changed.
    pub delta: Delta,
}

/// A save's delta.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Delta {
    /// Names (re)bound by the cell.
    pub variables: BTreeMap<String, DeltaVar>,
    /// Names the cell deleted.
    pub deleted: Vec<String>,
    /// New objects by oid.
    pub objects: BTreeMap<String, ObjectEntry>,
    /// Unsavable names and why.
    pub unsavable: BTreeMap<String, String>,
    /// The kernel state that is not a variable.
    pub ambient: Option<Blob>,
}

/// One rebound name.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DeltaVar {
    /// Its root object.
    pub oid: Option<String>,
    /// A module it names.
    pub module: Option<String>,
    /// Globals its function reads.
    pub global_reads: Vec<String>,
}

/// One object.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ObjectEntry {
    /// Its pickled record.
    pub record: Blob,
    /// Objects it references.
    pub refs: Vec<String>,
    /// Its out-of-band buffers.
    pub payloads: Vec<Payload>,
    /// Modules it needs to load.
    pub modules: Vec<String>,
    /// Whether any payload lives on a GPU.
    pub on_gpu: bool,
}

/// Bytes stored as chunks.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Blob {
    /// Length.
    pub len: u64,
    /// Chunk hashes in order.
    pub chunks: Vec<String>,
}

/// An out-of-band buffer.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Payload {
    /// Length.
    pub len: u64,
    /// Chunk hashes in order.
    pub chunks: Vec<String>,
    /// Element type.
    pub dtype: String,
    /// Shape.
    pub shape: Vec<u64>,
    /// Device it lived on.
    pub device: String,
}

impl CommitV1 {
    /// The same commit as version 2: it names no uploads, so every chunk new to the
    /// base is looked up.
    pub fn upgrade(self) -> CommitV2 {
        CommitV2 {
            session: self.session,
            base_revision: self.base_revision,
            exec_id: self.exec_id,
            host: self.host,
            worker: self.worker,
            cell_id: self.cell_id,
            delta: self.delta.upgrade(),
            uploaded: Vec::new(),
        }
    }
}

impl Delta {
    fn upgrade(self) -> live::Delta {
        live::Delta {
            variables: self
                .variables
                .into_iter()
                .map(|(k, v)| (k, live::DeltaVar { oid: v.oid, module: v.module, global_reads: v.global_reads }))
                .collect(),
            deleted: self.deleted,
            objects: self.objects.into_iter().map(|(k, o)| (k, o.upgrade())).collect(),
            unsavable: self.unsavable,
            ambient: self.ambient.map(Blob::upgrade),
        }
    }
}

impl ObjectEntry {
    pub(super) fn upgrade(self) -> live::ObjectEntry {
        live::ObjectEntry {
            record: self.record.upgrade(),
            refs: self.refs,
            payloads: self
                .payloads
                .into_iter()
                .map(|p| live::Payload {
                    len: p.len,
                    chunks: p.chunks,
                    dtype: p.dtype,
                    shape: p.shape,
                    device: p.device,
                })
                .collect(),
            modules: self.modules,
            on_gpu: self.on_gpu,
        }
    }
}

impl Blob {
    pub(super) fn upgrade(self) -> live::Blob {
        live::Blob { len: self.len, chunks: self.chunks }
    }
}
