//! The byte path on a host (DESIGN.md "The byte path"): chunks move between the
//! object store and shared-memory files that workers map, through a bounded
//! per-host chunk cache. Every chunk read is verified against its hash.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path as FsPath, PathBuf};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use futures::{StreamExt, TryStreamExt};
use object_store::path::Path;
use object_store::ObjectStore;
use schemas::checkpoint::{chunk_hash, chunk_key, Manifest};

use crate::protocol::{ObjRestore, Region};

/// How many chunk transfers a host runs at once.
const PARALLEL: usize = 16;

/// A save file or chunk this small is read, hashed and copied on the step at
/// hand rather than handed to a blocking thread (each hand-off costs more).
const SMALL_SAVE_FILE: u64 = 256 << 10;

/// Why moving chunks failed.
#[derive(Debug, thiserror::Error)]
pub enum ChunkError {
    /// The object store failed.
    #[error("object store: {0}")]
    Storage(#[from] object_store::Error),
    /// A chunk's bytes do not hash to its name.
    #[error("chunk {hash} is corrupt (its bytes hash to {actual}){}", .variable.as_ref().map(|v| format!(", needed by variable '{v}'")).unwrap_or_default())]
    Corrupt {
        /// The chunk.
        hash: String,
        /// What its bytes hash to.
        actual: String,
        /// A variable that needs it, when known.
        variable: Option<String>,
    },
    /// The manifest lacks an object a variable needs.
    #[error("object {oid} needed by '{variable}' is not in the manifest")]
    MissingObject {
        /// The oid.
        oid: String,
        /// The variable.
        variable: String,
    },
    /// A worker's save region lies outside its file.
    #[error("chunk {0} lies outside the worker's save file")]
    BadRegion(String),
    /// A task on the blocking pool (hashing, mapping) did not finish.
    #[error("a chunk task stopped: {0}")]
    Task(String),
    /// Shared-memory file I/O failed.
    #[error("shared memory file {path}: {source}")]
    Shm {
        /// The file.
        path: String,
        /// Why.
        source: std::io::Error,
    },
}

/// Run byte work (hashing, mapping, freeing gigabytes) on the blocking pool. The
/// host's actor, its claims and every run's steps share one thread (actix's
/// current-thread runtime): a gigabyte hashed there held every claim of the host
/// for seconds.
pub(crate) async fn off_thread<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> Result<T, ChunkError> {
    tokio::task::spawn_blocking(f).await.map_err(|e| ChunkError::Task(e.to_string()))
}

/// Hash `data` off the host's thread; (the bytes, their hash).
async fn hashed(data: Bytes) -> Result<(Bytes, String), ChunkError> {
    off_thread(move || {
        let hash = chunk_hash(&data);
        (data, hash)
    })
    .await
}

/// The host's chunk cache (issue 38 item 3): the chunks its sessions saved and
/// restored here, bounded by bytes; the least recently used go first. A hit makes
/// a chunk the most recent, so a session's closure stays while it is in use
/// however much else passes through.
struct Cache {
    max_bytes: u64,
    bytes: u64,
    /// Use counter: each get or put takes the next value.
    clock: u64,
    /// Chunk bytes and their last use.
    map: HashMap<String, (Bytes, u64)>,
    /// Last use to chunk, oldest first.
    by_use: BTreeMap<u64, String>,
}

impl Cache {
    fn new(max_bytes: u64) -> Self {
        Self { max_bytes, bytes: 0, clock: 0, map: HashMap::new(), by_use: BTreeMap::new() }
    }

    fn get(&mut self, hash: &str) -> Option<Bytes> {
        let (data, used) = self.map.get_mut(hash)?;
        self.clock += 1;
        self.by_use.remove(used);
        *used = self.clock;
        self.by_use.insert(self.clock, hash.to_string());
        Some(data.clone())
    }

    fn put(&mut self, hash: &str, data: Bytes) {
        if data.len() as u64 > self.max_bytes {
            return;
        }
        if self.get(hash).is_some() {
            return; // the same bytes (chunks are named by their hash); now recent
        }
        self.clock += 1;
        self.bytes += data.len() as u64;
        self.map.insert(hash.to_string(), (data, self.clock));
        self.by_use.insert(self.clock, hash.to_string());
        while self.bytes > self.max_bytes {
            let Some((_, old)) = self.by_use.pop_first() else { break };
            if let Some((d, _)) = self.map.remove(&old) {
                self.bytes -= d.len() as u64;
            }
        }
    }
}

/// Chunks of the object store, through this host's cache.
#[derive(Clone)]
pub struct Chunks {
    objects: Arc<dyn ObjectStore>,
    cache: Arc<Mutex<Cache>>,
    shm_dir: PathBuf,
}

/// A restore file written for a worker: the message fields that point into it.
#[derive(Debug)]
pub struct RestoreFile {
    /// The file (None when nothing needed bytes).
    pub path: Option<PathBuf>,
    /// Objects and where they are.
    pub objects: BTreeMap<String, ObjRestore>,
    /// The ambient blob, if any.
    pub ambient: Option<Region>,
    /// Bytes in the file.
    pub bytes: u64,
}

impl Chunks {
    /// Chunks in `objects`, cached up to `cache_bytes`, restore files in `shm_dir`.
    pub fn new(objects: Arc<dyn ObjectStore>, cache_bytes: u64, shm_dir: PathBuf) -> Self {
        Self { objects, cache: Arc::new(Mutex::new(Cache::new(cache_bytes))), shm_dir }
    }

    /// Bytes held in the cache.
    pub fn cached_bytes(&self) -> u64 {
        self.cache.lock().map(|c| c.bytes).unwrap_or(0)
    }

    /// Does the cache hold this chunk (used to score hosts)?
    pub fn is_cached(&self, hash: &str) -> bool {
        self.cache.lock().map(|c| c.map.contains_key(hash)).unwrap_or(false)
    }

    /// One chunk, from the cache or the store, verified.
    pub async fn get(&self, hash: &str) -> Result<Bytes, ChunkError> {
        let lookups = &schemas::metrics::metrics().chunk_cache;
        if let Some(b) = self.cache.lock().ok().and_then(|mut c| c.get(hash)) {
            lookups.get_or_create(&[("result", "hit")]).inc();
            return Ok(b);
        }
        lookups.get_or_create(&[("result", "miss")]).inc();
        let data = self.objects.get(&Path::from(chunk_key(hash).as_str())).await?.bytes().await?;
        let (data, actual) = hashed(data).await?;
        if actual != hash {
            return Err(ChunkError::Corrupt { hash: hash.to_string(), actual, variable: None });
        }
        if let Ok(mut c) = self.cache.lock() {
            c.put(hash, data.clone());
        }
        Ok(data)
    }

    /// The hashes of a save plan its session's revision does not reference
    /// (`stored`: the chunks it does, which the collector keeps); the store gateway
    /// answers for the rest. Chunks seen for other sessions are not trusted: a
    /// deleted session's are freed within a minute (ADR 54).
    pub fn unknown(plan: &[String], stored: &BTreeSet<String>) -> Vec<String> {
        plan.iter().filter(|h| !stored.contains(*h)).cloned().collect()
    }

    /// Upload the chunks a worker placed in its save file; returns bytes written.
    ///
    /// The file is unlinked at once and mapped, not copied: each chunk goes to the
    /// store as a slice of the mapping. The worker closed the file before it said
    /// so, and after the unlink nothing else can open it, so the mapped bytes
    /// cannot change under us. The cache takes a copy of each chunk: a slice would
    /// keep the whole save's mapping (its shared memory) alive for as long as one
    /// of its chunks stays recently used, beyond what the cache counts.
    pub async fn upload(&self, file: &FsPath, regions: &BTreeMap<String, Region>) -> Result<u64, ChunkError> {
        let path = file.to_path_buf();
        let opened = off_thread(move || {
            let shm = |source| ChunkError::Shm { path: path.display().to_string(), source };
            let mut f = std::fs::File::open(&path).map_err(shm)?;
            std::fs::remove_file(&path).map_err(shm)?;
            let size = f.metadata().map_err(shm)?.len();
            // a small file (most cells' whole save: the ambient state) is read
            // here, in the step that opened it, and not mapped: each hand-off to
            // a blocking thread costs more than copying it
            let mut small = None;
            if size > 0 && size <= SMALL_SAVE_FILE {
                let mut bytes = Vec::with_capacity(size as usize);
                std::io::Read::read_to_end(&mut f, &mut bytes).map_err(shm)?;
                small = Some(Bytes::from(bytes));
            }
            Ok::<_, ChunkError>((f, size, small))
        });
        let (f, size, small) = opened.await??;
        match regions.keys().next() {
            None => return Ok(0),
            // an empty file cannot be mapped, and no region lies inside it
            Some(hash) if size == 0 => return Err(ChunkError::BadRegion(hash.clone())),
            Some(_) => {}
        }
        // only a small file's chunks are hashed here: a large file's many small
        // chunks together would hold the host's thread (ADR 73)
        let inline = small.is_some();
        let whole = match small {
            Some(bytes) => bytes,
            None => {
                let path = file.display().to_string();
                // SAFETY: the file is unlinked and its writer closed it (above), so no one
                // can change the mapped bytes; they are verified against their hashes below.
                // Mapped with its pages faulted in at once: off the host's thread.
                let mapped = off_thread(move || unsafe { memmap2::MmapOptions::new().populate().map(&f) });
                let map = mapped.await?.map_err(|source| ChunkError::Shm { path, source })?;
                Bytes::from_owner(map)
            }
        };
        let size = whole.len() as u64;
        let objects = self.objects.clone();
        let cache = self.cache.clone();
        let regions: Vec<(String, Region)> = regions.iter().map(|(h, r)| (h.clone(), *r)).collect();
        let written: Vec<u64> = futures::stream::iter(regions)
            .map(|(hash, [off, len])| {
                let objects = objects.clone();
                let cache = cache.clone();
                let data = match off.checked_add(len).filter(|end| *end <= size) {
                    Some(end) => Ok(whole.slice(off as usize..end as usize)),
                    None => Err(ChunkError::BadRegion(hash.clone())),
                };
                async move {
                    let data = data?;
                    let (data, actual) = if inline {
                        let hash = chunk_hash(&data);
                        (data, hash)
                    } else {
                        hashed(data).await?
                    };
                    if actual != hash {
                        return Err(ChunkError::Corrupt { hash, actual, variable: None });
                    }
                    objects.put(&Path::from(chunk_key(&hash).as_str()), data.clone().into()).await?;
                    let owned = if inline {
                        Bytes::copy_from_slice(&data)
                    } else {
                        off_thread(move || Bytes::copy_from_slice(&data)).await?
                    };
                    if let Ok(mut c) = cache.lock() {
                        c.put(&hash, owned);
                    }
                    Ok(len)
                }
            })
            .buffer_unordered(PARALLEL)
            .try_collect()
            .await?;
        Ok(written.iter().sum())
    }

    /// Write the records and payloads of `oids` (and, with `ambient`, the ambient
    /// blob) into one new shared-memory file for a worker to map, each blob
    /// contiguous. `name` must be unique among the files not yet deleted.
    pub async fn write_restore_file(
        &self,
        manifest: &Manifest,
        oids: &[(String, String)],
        name: &str,
        owner: Option<u32>,
        ambient: bool,
    ) -> Result<RestoreFile, ChunkError> {
        // Lay out every blob: (offset, chunk hashes); chunks are fetched once each.
        let mut placements: Vec<(u64, String, Option<String>)> = Vec::new(); // (offset, hash, variable)
        let mut objects = BTreeMap::new();
        let mut offset = 0u64;
        // A blob already laid out is pointed at again: the members of a reference
        // cycle share one record (and its payloads), and a figure's cycle has
        // thousands of members.
        let mut laid_out: HashMap<(u64, Vec<String>), Region> = HashMap::new();
        let mut place = |chunks: &[String], len: u64, variable: &str, placements: &mut Vec<_>| -> Region {
            if let Some(region) = laid_out.get(&(len, chunks.to_vec())) {
                return *region;
            }
            let start = offset;
            let mut at = offset;
            for h in chunks {
                placements.push((at, h.clone(), Some(variable.to_string())));
                at += schemas::checkpoint::CHUNK_BYTES as u64;
            }
            offset += len;
            laid_out.insert((len, chunks.to_vec()), [start, len]);
            [start, len]
        };
        for (oid, variable) in oids {
            let obj = manifest
                .objects
                .get(oid)
                .ok_or_else(|| ChunkError::MissingObject { oid: oid.clone(), variable: variable.clone() })?;
            let record = place(&obj.record.chunks, obj.record.len, variable, &mut placements);
            let payloads = obj.payloads.iter().map(|p| place(&p.chunks, p.len, variable, &mut placements)).collect();
            objects.insert(oid.clone(), ObjRestore { record, payloads });
        }
        let ambient = manifest
            .ambient
            .as_ref()
            .filter(|_| ambient)
            .map(|a| place(&a.chunks, a.len, "<ambient state>", &mut placements));
        let total = offset;
        if placements.is_empty() {
            return Ok(RestoreFile { path: None, objects, ambient, bytes: 0 });
        }
        let path = self.shm_dir.join(format!("looseleaf-restore-{name}"));
        let shm = |source| ChunkError::Shm { path: path.display().to_string(), source };
        // owner-only: another session's cells must not read this one's state
        let file = std::fs::OpenOptions::new().create_new(true).write(true).mode(0o600).open(&path).map_err(shm)?;
        // a worker running as its session's uid reads it; no other session can
        if let Some(uid) = owner {
            std::os::unix::fs::fchown(&file, Some(uid), Some(uid)).map_err(shm)?;
        }
        file.set_len(total).map_err(shm)?;
        let file = Arc::new(file);
        let result: Result<Vec<()>, ChunkError> = futures::stream::iter(placements)
            .map(|(at, hash, variable)| {
                let file = file.clone();
                async move {
                    let data = self.get(&hash).await.map_err(|e| match e {
                        ChunkError::Corrupt { hash, actual, .. } => ChunkError::Corrupt { hash, actual, variable },
                        other => other,
                    })?;
                    tokio::task::spawn_blocking(move || file.write_all_at(&data, at))
                        .await
                        .map_err(|e| ChunkError::Shm { path: "restore file".into(), source: std::io::Error::other(e) })?
                        .map_err(|source| ChunkError::Shm { path: "restore file".into(), source })
                }
            })
            .buffer_unordered(PARALLEL)
            .try_collect()
            .await;
        if let Err(e) = result {
            let _ = std::fs::remove_file(&path);
            return Err(e);
        }
        Ok(RestoreFile { path: Some(path), objects, ambient, bytes: total })
    }
}

#[cfg(test)]
mod tests {
    use object_store::memory::InMemory;
    use schemas::checkpoint::{Blob, ObjectEntry};

    use super::*;

    #[tokio::test]
    async fn corrupt_chunk_names_the_variable() {
        let objects: Arc<dyn ObjectStore> = Arc::new(InMemory::new());
        let good = b"hello".to_vec();
        let hash = chunk_hash(&good);
        objects.put(&Path::from(chunk_key(&hash).as_str()), b"HELLO".to_vec().into()).await.unwrap();
        let mut m = Manifest::default();
        m.objects.insert(
            "o1".into(),
            ObjectEntry { record: Blob { len: 5, chunks: vec![hash.clone()] }, ..Default::default() },
        );
        let dir = tempfile::tempdir().unwrap();
        let chunks = Chunks::new(objects, 1 << 20, dir.path().to_path_buf());
        let err = chunks.write_restore_file(&m, &[("o1".into(), "df".into())], "t1", None, true).await.unwrap_err();
        let text = err.to_string();
        assert!(text.contains("corrupt") && text.contains("'df'"), "{text}");
        assert!(std::fs::read_dir(dir.path()).unwrap().next().is_none(), "no half-written file left");
    }

    #[test]
    fn the_cache_keeps_what_was_used_last_within_its_bytes() {
        let chunk = |c: u8| Bytes::from(vec![c; 100]);
        let mut cache = Cache::new(300);
        for name in ["a", "b", "c"] {
            cache.put(name, chunk(name.as_bytes()[0]));
        }
        assert!(cache.get("a").is_some(), "a is now the most recent");
        cache.put("d", chunk(b'd'));
        assert!(cache.get("b").is_none(), "the least recently used went first");
        assert!(["a", "c", "d"].iter().all(|h| cache.map.contains_key(*h)));
        assert_eq!(cache.bytes, 300);
        cache.put("c", chunk(b'c')); // cached again: no second copy, and now recent
        cache.put("e", chunk(b'e'));
        assert!(!cache.map.contains_key("a") && cache.map.contains_key("c"), "a was the oldest");
        assert_eq!((cache.bytes, cache.map.len(), cache.by_use.len()), (300, 3, 3));
        cache.put("huge", Bytes::from(vec![0; 301]));
        assert!(!cache.map.contains_key("huge") && cache.bytes == 300, "a chunk over the bound is not cached");
    }

    #[tokio::test(flavor = "current_thread")]
    async fn chunks_are_hashed_off_the_hosts_thread() {
        let data = Bytes::from(vec![7u8; 1 << 20]);
        let (back, hash) = hashed(data.clone()).await.unwrap();
        assert_eq!((back, hash), (data.clone(), chunk_hash(&data)));
        let here = std::thread::current().id();
        assert_ne!(off_thread(|| std::thread::current().id()).await.unwrap(), here);
    }

    #[test]
    fn only_chunks_of_the_sessions_revision_are_taken_as_stored() {
        let (stored, new) = ("a".repeat(32), "b".repeat(32));
        let revision = BTreeSet::from([stored.clone()]);
        assert_eq!(Chunks::unknown(&[stored, new.clone()], &revision), vec![new]);
    }

    #[tokio::test]
    async fn upload_then_restore_roundtrips() {
        upload_then_restore(Arc::new(InMemory::new())).await;
    }

    #[tokio::test]
    async fn upload_then_restore_on_s3() {
        let s3 = looseleaf_test_support::S3Server::start().unwrap();
        let settings = s3.settings();
        let settings: Vec<(&str, &str)> = settings.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        upload_then_restore(schemas::objects::open_with(&s3.url(), &settings).unwrap()).await;
    }

    async fn upload_then_restore(objects: Arc<dyn ObjectStore>) {
        let dir = tempfile::tempdir().unwrap();
        let chunks = Chunks::new(objects.clone(), 1 << 20, dir.path().to_path_buf());
        let a = b"aaaa".to_vec();
        let b = b"bb".to_vec();
        let (ha, hb) = (chunk_hash(&a), chunk_hash(&b));
        let save = dir.path().join("save");
        std::fs::write(&save, [a.clone(), b.clone()].concat()).unwrap();
        let plan = vec![ha.clone(), hb.clone()];
        assert_eq!(Chunks::unknown(&plan, &BTreeSet::new()).len(), 2);
        let regions = BTreeMap::from([(ha.clone(), [0, 4]), (hb.clone(), [4, 2])]);
        assert_eq!(chunks.upload(&save, &regions).await.unwrap(), 6);
        assert!(!save.exists(), "the save file is unlinked once read");
        // a save file over SMALL_SAVE_FILE is mapped, not read: its chunks too
        let big = vec![9u8; (SMALL_SAVE_FILE + 1000) as usize];
        let hbig = chunk_hash(&big);
        std::fs::write(&save, [a.clone(), big.clone()].concat()).unwrap();
        let regions = BTreeMap::from([(ha.clone(), [0, 4]), (hbig.clone(), [4, big.len() as u64])]);
        assert_eq!(chunks.upload(&save, &regions).await.unwrap(), 4 + big.len() as u64);
        let stored = objects.get(&Path::from(chunk_key(&hbig).as_str())).await.unwrap().bytes().await.unwrap();
        assert_eq!(stored, big, "the large chunk is stored whole");
        // a region outside the file is refused
        std::fs::write(&save, [a.clone(), b.clone()].concat()).unwrap();
        let bad = BTreeMap::from([(ha.clone(), [4, 100])]);
        assert!(matches!(chunks.upload(&save, &bad).await, Err(ChunkError::BadRegion(_))));

        let mut m = Manifest::default();
        m.objects
            .insert("o".into(), ObjectEntry { record: Blob { len: 6, chunks: vec![ha, hb] }, ..Default::default() });
        // two chunks of one blob: the second starts CHUNK_BYTES in, so use a tiny layout check
        let rf = chunks.write_restore_file(&m, &[("o".into(), "x".into())], "t2", None, true).await.unwrap();
        assert_eq!(rf.objects["o"].record, [0, 6]);
        let path = rf.path.unwrap();
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(std::fs::metadata(&path).unwrap().permissions().mode() & 0o777, 0o600, "owner-only");
    }
}
