//! The checkpoint format (DESIGN.md section 6), shared by the store gateway, which
//! commits manifests, and the hosts, which read and write chunks directly.
//!
//! A session's state is its highest manifest revision. A manifest binds each live
//! name to an object id (`oid`) and a version; objects are root records (pickles)
//! that refer to other objects (RootRef / ObjRef) and to payloads (large buffers),
//! every blob cut into 2 MiB content-addressed chunks. Two names bound to the same
//! oid are the same object (`b = a`).

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};
use uuid::Uuid;

/// Chunk size: blobs are cut into pieces of this many bytes.
pub const CHUNK_BYTES: usize = 2 << 20;

/// A byte string stored as content-addressed chunks (xxh3-128, 32 hex digits each).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Blob {
    /// Total length in bytes.
    pub len: u64,
    /// Chunk hashes, in order.
    pub chunks: Vec<String>,
}

/// A large buffer (ndarray, tensor, bytes) stored outside its record's pickle.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Payload {
    /// Total length in bytes.
    pub len: u64,
    /// Chunk hashes, in order.
    pub chunks: Vec<String>,
    /// Element type as the worker names it ("float64", "bytes").
    pub dtype: String,
    /// Shape.
    pub shape: Vec<u64>,
    /// Where the buffer lived ("cpu", "cuda:0").
    pub device: String,
}

/// One object record: a root object or a sub-object shared by several variables.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ObjectEntry {
    /// The pickle.
    pub record: Blob,
    /// Oids this record refers to (RootRef and ObjRef).
    pub refs: Vec<String>,
    /// Payloads, in PayloadRef order.
    pub payloads: Vec<Payload>,
    /// Top-level modules needed to load the record.
    pub modules: Vec<String>,
    /// Whether any of its payloads lived on a GPU.
    pub on_gpu: bool,
}

impl ObjectEntry {
    /// Bytes of the record and its payloads.
    pub fn bytes(&self) -> u64 {
        self.record.len + self.payloads.iter().map(|p| p.len).sum::<u64>()
    }

    /// Every chunk hash of the record and its payloads.
    pub fn chunks(&self) -> impl Iterator<Item = &String> {
        self.record.chunks.iter().chain(self.payloads.iter().flat_map(|p| p.chunks.iter()))
    }
}

/// One live name.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct VarEntry {
    /// The execution that last defined or changed it.
    pub version: Uuid,
    /// Its root object, or None for a module reference.
    pub oid: Option<String>,
    /// For a module reference, the module's name (restore = import).
    pub module: Option<String>,
    /// For a callable made at run time (lambda, closure, partial): the globals it
    /// may read when called, as the worker found them.
    #[serde(default)]
    pub global_reads: Vec<String>,
}

/// A name whose value could not be saved; it lives only in the worker that holds it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Unsavable {
    /// The execution that defined it.
    pub version: Uuid,
    /// Why it could not be saved.
    pub reason: String,
    /// Host holding the worker.
    pub host: String,
    /// The worker.
    pub worker: String,
    /// The cell that defined it.
    pub cell_id: String,
}

/// A session's committed state at one revision.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    /// The session.
    pub session: Uuid,
    /// Revision (0 = nothing saved yet).
    pub revision: u64,
    /// The execution that committed it.
    pub exec_id: Uuid,
    /// Live savable names.
    pub variables: BTreeMap<String, VarEntry>,
    /// Object records by oid.
    pub objects: BTreeMap<String, ObjectEntry>,
    /// Live names that could not be saved.
    pub unsavable: BTreeMap<String, Unsavable>,
    /// Ambient state (RNGs, settings, cwd, counter, history).
    pub ambient: Option<Blob>,
    /// The revision whose state this one was built on: a save's base; for a
    /// revision that copies an earlier one's state (undo, checkout), that one's
    /// parent, so that undo again steps further back. None: no earlier state (the
    /// state before the first cell, a fork's first revision, or a manifest written
    /// before lineage was kept).
    #[serde(default)]
    pub parent: Option<u64>,
    /// For a fork's revisions: the session and revision it was forked from.
    #[serde(default)]
    pub forked_from: Option<ForkPoint>,
}

/// Where a fork came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ForkPoint {
    /// The session forked.
    pub session: Uuid,
    /// Its revision that the fork's first revision copies.
    pub revision: u64,
}

/// A name in a worker's save.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeltaVar {
    /// Root object, or None for a module.
    pub oid: Option<String>,
    /// Module name for a module reference.
    pub module: Option<String>,
    /// Globals a callable made at run time may read.
    #[serde(default)]
    pub global_reads: Vec<String>,
}

/// What a worker's save changes (the worker-protocol `Delta`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Delta {
    /// Every name the worker holds after the cell.
    pub variables: BTreeMap<String, DeltaVar>,
    /// Names the worker held before the cell and no longer holds.
    pub deleted: Vec<String>,
    /// Records written by this save.
    pub objects: BTreeMap<String, ObjectEntry>,
    /// Names that could not be saved, with why.
    pub unsavable: BTreeMap<String, String>,
    /// Ambient state after the cell.
    pub ambient: Option<Blob>,
}

impl Delta {
    /// Bytes of the records, payloads and ambient blob it writes: the most its
    /// save can upload (chunks the store has already are not uploaded).
    pub fn written_bytes(&self) -> u64 {
        self.objects.values().map(ObjectEntry::bytes).sum::<u64>() + self.ambient.as_ref().map_or(0, |a| a.len)
    }
}

/// Who made a save, recorded for unsavable names.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SaveOrigin<'a> {
    /// The execution.
    pub exec_id: Uuid,
    /// Host of the worker.
    pub host: &'a str,
    /// The worker.
    pub worker: &'a str,
    /// The cell.
    pub cell_id: &'a str,
}

/// Why a delta cannot be applied.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum DeltaError {
    /// A variable names an oid that neither the manifest nor the delta has.
    #[error("variable {name} refers to object {oid}, which the save did not write")]
    MissingObject {
        /// The variable.
        name: String,
        /// Its oid.
        oid: String,
    },
    /// A record refers to an oid that neither the manifest nor the delta has.
    #[error("object {from} refers to object {to}, which the save did not write")]
    DanglingRef {
        /// Referring oid.
        from: String,
        /// Missing oid.
        to: String,
    },
}

impl Manifest {
    /// An empty manifest (revision 0) for a session.
    pub fn empty(session: Uuid) -> Self {
        Self { session, ..Self::default() }
    }

    /// Oids reachable from `roots` (following record refs), in a stable order.
    pub fn reachable<'a>(&self, roots: impl IntoIterator<Item = &'a str>) -> BTreeSet<String> {
        reachable(&self.objects, roots)
    }

    /// Oids a variable's value depends on.
    pub fn reachable_from_name(&self, name: &str) -> BTreeSet<String> {
        match self.variables.get(name).and_then(|v| v.oid.as_deref()) {
            Some(oid) => self.reachable([oid]),
            None => BTreeSet::new(),
        }
    }

    /// Bytes the revision holds: every record and payload, and the ambient state
    /// (what a session's quota counts).
    pub fn stored_bytes(&self) -> u64 {
        self.objects.values().map(ObjectEntry::bytes).sum::<u64>() + self.ambient.as_ref().map_or(0, |a| a.len)
    }

    /// Bytes a variable's restore reads.
    pub fn bytes_of_name(&self, name: &str) -> u64 {
        self.reachable_from_name(name).iter().filter_map(|oid| self.objects.get(oid)).map(ObjectEntry::bytes).sum()
    }

    /// Every live name, savable or not.
    pub fn live_names(&self) -> impl Iterator<Item = &String> {
        self.variables.keys().chain(self.unsavable.keys())
    }

    /// Every chunk any object or the ambient blob of this manifest references.
    pub fn chunks(&self) -> BTreeSet<String> {
        let mut all: BTreeSet<String> = self.objects.values().flat_map(|o| o.chunks().cloned()).collect();
        if let Some(a) = &self.ambient {
            all.extend(a.chunks.iter().cloned());
        }
        all
    }

    /// The next revision: this manifest with a worker's save applied.
    ///
    /// A name keeps its version unless its binding changed or some object reachable
    /// from it was rewritten with different content, so a mutation through one alias
    /// also bumps the other alias's version. Objects no name reaches are dropped.
    pub fn apply(&self, delta: &Delta, origin: &SaveOrigin<'_>) -> Result<Manifest, DeltaError> {
        let mut next = self.clone();
        next.revision = self.revision + 1;
        next.exec_id = origin.exec_id;
        next.parent = Some(self.revision);

        let mut rewritten: BTreeSet<&str> = BTreeSet::new();
        for (oid, obj) in &delta.objects {
            if self.objects.get(oid) != Some(obj) {
                rewritten.insert(oid.as_str());
            }
            next.objects.insert(oid.clone(), obj.clone());
        }
        for (from, obj) in &delta.objects {
            if let Some(to) = obj.refs.iter().find(|r| !next.objects.contains_key(*r)) {
                return Err(DeltaError::DanglingRef { from: from.clone(), to: to.clone() });
            }
        }
        for name in &delta.deleted {
            next.variables.remove(name);
            next.unsavable.remove(name);
        }
        for (name, var) in &delta.variables {
            if let Some(oid) = &var.oid {
                if !next.objects.contains_key(oid) {
                    return Err(DeltaError::MissingObject { name: name.clone(), oid: oid.clone() });
                }
            }
            let rebound = match self.variables.get(name) {
                Some(old) => old.oid != var.oid || old.module != var.module,
                None => true,
            };
            let version = if rebound { origin.exec_id } else { self.variables[name].version };
            next.unsavable.remove(name);
            next.variables.insert(
                name.clone(),
                VarEntry {
                    version,
                    oid: var.oid.clone(),
                    module: var.module.clone(),
                    global_reads: var.global_reads.clone(),
                },
            );
        }
        for (name, reason) in &delta.unsavable {
            next.variables.remove(name);
            // Still held by the same worker: it is the same value, defined by the same cell
            // (a later cell on that worker may have used it, but did not rebind it).
            let (version, cell_id) = match self.unsavable.get(name) {
                Some(u) if u.worker == origin.worker => (u.version, u.cell_id.clone()),
                _ => (origin.exec_id, origin.cell_id.to_string()),
            };
            next.unsavable.insert(
                name.clone(),
                Unsavable {
                    version,
                    reason: reason.clone(),
                    host: origin.host.to_string(),
                    worker: origin.worker.to_string(),
                    cell_id,
                },
            );
        }
        if delta.ambient.is_some() {
            next.ambient = delta.ambient.clone();
        }
        // A content change anywhere below a name is a new version of that name.
        if !rewritten.is_empty() {
            let names: Vec<String> = next.variables.keys().cloned().collect();
            for name in names {
                let touched = next.reachable_from_name(&name).iter().any(|o| rewritten.contains(o.as_str()));
                if touched {
                    if let Some(v) = next.variables.get_mut(&name) {
                        v.version = origin.exec_id;
                    }
                }
            }
        }
        let live: BTreeSet<String> = reachable(&next.objects, next.variables.values().filter_map(|v| v.oid.as_deref()));
        next.objects.retain(|oid, _| live.contains(oid));
        Ok(next)
    }
}

fn reachable<'a>(
    objects: &BTreeMap<String, ObjectEntry>,
    roots: impl IntoIterator<Item = &'a str>,
) -> BTreeSet<String> {
    let mut seen = BTreeSet::new();
    let mut stack: Vec<&str> = roots.into_iter().collect();
    while let Some(oid) = stack.pop() {
        if !seen.insert(oid.to_string()) {
            continue;
        }
        if let Some(obj) = objects.get(oid) {
            stack.extend(obj.refs.iter().map(String::as_str));
        }
    }
    seen
}

/// Object-store key of a chunk: content-addressed, shared by every session.
pub fn chunk_key(hash: &str) -> String {
    let fan = hash.get(..2).unwrap_or("00");
    format!("chunks/{fan}/{hash}")
}

/// Folder of a session's manifests.
pub fn manifests_dir(session: Uuid) -> String {
    format!("sessions/{session}/manifests")
}

/// Object-store key of a deleted session's tombstone: once it exists, nothing
/// commits to the session again (a cell still saving when its session was deleted,
/// or a gateway that remembers the session, would bring it back).
pub fn tombstone_key(session: Uuid) -> String {
    format!("sessions/{session}/deleted")
}

/// Object-store key of a manifest revision; zero-padded so keys sort by revision.
pub fn manifest_key(session: Uuid, revision: u64) -> String {
    format!("{}/{revision:020}.json", manifests_dir(session))
}

/// The revision a manifest key names.
pub fn revision_of_key(key: &str) -> Option<u64> {
    key.rsplit('/').next()?.strip_suffix(".json")?.parse().ok()
}

/// xxh3-128 of a chunk, as the 32 lowercase hex digits that name it.
pub fn chunk_hash(bytes: &[u8]) -> String {
    format!("{:032x}", xxhash_rust::xxh3::xxh3_128(bytes))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn obj(refs: &[&str], chunk: &str) -> ObjectEntry {
        ObjectEntry {
            record: Blob { len: 10, chunks: vec![chunk.to_string()] },
            refs: refs.iter().map(|s| s.to_string()).collect(),
            ..Default::default()
        }
    }

    fn var(oid: &str) -> DeltaVar {
        DeltaVar { oid: Some(oid.to_string()), module: None, global_reads: vec![] }
    }

    fn origin(exec_id: Uuid) -> SaveOrigin<'static> {
        SaveOrigin { exec_id, host: "h", worker: "w", cell_id: "c" }
    }

    #[test]
    fn alias_mutation_bumps_both_names() {
        let sid = Uuid::now_v7();
        let e1 = Uuid::now_v7();
        let mut d = Delta::default();
        d.objects.insert("L".into(), obj(&[], "aa"));
        d.objects.insert("D".into(), obj(&["L"], "bb"));
        d.variables.insert("a".into(), var("L"));
        d.variables.insert("b".into(), var("L"));
        d.variables.insert("d".into(), var("D"));
        let m1 = Manifest::empty(sid).apply(&d, &origin(e1)).unwrap();
        assert_eq!(m1.revision, 1);
        assert_eq!(m1.variables["b"].version, e1);

        // a later cell restores only `a` and appends to it
        let e2 = Uuid::now_v7();
        let mut d2 = Delta::default();
        d2.objects.insert("L".into(), obj(&[], "cc"));
        d2.variables.insert("a".into(), var("L"));
        let m2 = m1.apply(&d2, &origin(e2)).unwrap();
        assert_eq!(m2.variables["a"].version, e2);
        assert_eq!(m2.variables["b"].version, e2, "alias sees the mutation");
        assert_eq!(m2.variables["d"].version, e2, "container of the list changed too");
        assert_eq!(m2.objects["D"], m1.objects["D"]);
    }

    #[test]
    fn unchanged_save_keeps_versions_and_drops_garbage() {
        let sid = Uuid::now_v7();
        let e1 = Uuid::now_v7();
        let mut d = Delta::default();
        d.objects.insert("X".into(), obj(&[], "aa"));
        d.objects.insert("Y".into(), obj(&[], "bb"));
        d.variables.insert("x".into(), var("X"));
        d.variables.insert("y".into(), var("Y"));
        let m1 = Manifest::empty(sid).apply(&d, &origin(e1)).unwrap();
        let e2 = Uuid::now_v7();
        let mut d2 = Delta::default();
        d2.objects.insert("X".into(), obj(&[], "aa"));
        d2.variables.insert("x".into(), var("X"));
        d2.deleted.push("y".into());
        let m2 = m1.apply(&d2, &origin(e2)).unwrap();
        assert_eq!(m2.variables["x"].version, e1);
        assert!(!m2.variables.contains_key("y"));
        assert!(!m2.objects.contains_key("Y"), "unreferenced object collected");
    }

    #[test]
    fn dangling_refs_are_rejected() {
        let mut d = Delta::default();
        d.objects.insert("A".into(), obj(&["nope"], "aa"));
        d.variables.insert("a".into(), var("A"));
        let err = Manifest::empty(Uuid::now_v7()).apply(&d, &origin(Uuid::now_v7())).unwrap_err();
        assert!(matches!(err, DeltaError::DanglingRef { .. }));
        let mut d = Delta::default();
        d.variables.insert("a".into(), var("missing"));
        let err = Manifest::empty(Uuid::now_v7()).apply(&d, &origin(Uuid::now_v7())).unwrap_err();
        assert!(matches!(err, DeltaError::MissingObject { .. }));
    }

    #[test]
    fn unsavable_replaces_variable_and_back() {
        let e1 = Uuid::now_v7();
        let mut d = Delta::default();
        d.objects.insert("G".into(), obj(&[], "aa"));
        d.variables.insert("g".into(), var("G"));
        let m1 = Manifest::empty(Uuid::now_v7()).apply(&d, &origin(e1)).unwrap();
        let mut d2 = Delta::default();
        d2.unsavable.insert("g".into(), "TypeError: cannot pickle 'generator' object".into());
        let e2 = Uuid::now_v7();
        let m2 = m1.apply(&d2, &SaveOrigin { exec_id: e2, host: "h", worker: "w", cell_id: "c2" }).unwrap();
        assert!(!m2.variables.contains_key("g"));
        assert_eq!(m2.unsavable["g"].worker, "w");
        assert!(m2.live_names().any(|n| n == "g"));
        // a later cell on the same worker that uses it keeps its defining cell
        let m3 = m2.apply(&d2, &SaveOrigin { exec_id: Uuid::now_v7(), host: "h", worker: "w", cell_id: "c5" }).unwrap();
        assert_eq!((m3.unsavable["g"].cell_id.as_str(), m3.unsavable["g"].version), ("c2", e2));
    }

    #[test]
    fn keys_sort_by_revision() {
        let s = Uuid::now_v7();
        assert!(manifest_key(s, 9) < manifest_key(s, 10));
        assert_eq!(revision_of_key(&manifest_key(s, 42)), Some(42));
        assert_eq!(chunk_key("abcdef"), "chunks/ab/abcdef");
        assert_eq!(chunk_hash(b"").len(), 32);
    }
}
