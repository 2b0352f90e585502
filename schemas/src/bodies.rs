//! Message bodies too large for one bus message (ADR 30).
//!
//! No message on the bus is larger than [`BUS_MESSAGE_MAX_BYTES`], whatever the
//! session holds: a payload over [`INLINE_MAX_BYTES`] (a manifest or delta of many
//! thousands of names, a recipe whose closure is a whole namespace, a 16 MiB cell)
//! is put into the JetStream object store bucket `{prefix}_bodies` (cut into
//! 128 KiB chunks by the object store), and the message carries only the object's
//! key, size and hash in its `ll-body` header. The receiver fetches and checks it
//! before decoding, so every sender and receiver of every message type obeys the
//! same rule without knowing it.
//!
//! Bodies are transient transport, not state: the bucket keeps them as long as the
//! events and outputs streams keep their messages (a day), and an asker deletes
//! the body of a reply once it has read it (exactly one reader).

use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::{self, object_store};
use tokio::io::AsyncReadExt;
use tokio::sync::OnceCell;

/// The rule: no message on the bus is larger than this (payload and headers).
pub const BUS_MESSAGE_MAX_BYTES: usize = 512 * 1024;

/// A payload larger than this travels as a body.
pub const INLINE_MAX_BYTES: usize = 256 * 1024;

/// The largest body a message may have (a 16 MiB cell, a manifest of a few hundred
/// thousand names); anything larger is refused before it is sent.
pub const MAX_BODY_BYTES: usize = 64 << 20;

/// How long reading a body may take, plus a second per MiB.
const GET_PATIENCE: Duration = Duration::from_secs(10);

/// Header naming a message's body: `{key} {size} {xxh3-64 hex}`.
pub const BODY_HEADER: &str = "ll-body";

/// How long a body is kept (as long as the streams keep the messages naming it).
pub const BODY_TTL: Duration = Duration::from_secs(24 * 3600);

/// Why a body could not be stored or read.
#[derive(Debug, thiserror::Error)]
pub enum BodyError {
    /// The bodies bucket could not be opened or created.
    #[error("the message-bodies bucket {bucket} could not be opened: {reason}")]
    Bucket {
        /// The bucket.
        bucket: String,
        /// What JetStream said.
        reason: String,
    },
    /// A payload exceeds [`MAX_BODY_BYTES`].
    #[error("a message of {0} bytes is larger than the bus carries ({MAX_BODY_BYTES} bytes)")]
    TooLarge(usize),
    /// Storing the body failed.
    #[error("storing a {size}-byte message body failed: {reason}")]
    Put {
        /// The body's size.
        size: usize,
        /// What JetStream said.
        reason: String,
    },
    /// Reading the body failed (expired, deleted, or the store is unreachable).
    #[error("message body {key} could not be read: {reason}")]
    Get {
        /// The body's key.
        key: String,
        /// Why.
        reason: String,
    },
    /// The header does not name a body, or the body is not the one it names.
    #[error("message body {header:?}: {reason}")]
    Bad {
        /// The header's value.
        header: String,
        /// What is wrong.
        reason: String,
    },
}

/// The bodies bucket of one prefix, opened (or created) on first use.
#[derive(Clone)]
pub struct Bodies {
    js: jetstream::Context,
    bucket: String,
    replicas: usize,
    store: Arc<OnceCell<object_store::ObjectStore>>,
}

impl std::fmt::Debug for Bodies {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Bodies").field("bucket", &self.bucket).finish_non_exhaustive()
    }
}

impl std::fmt::Debug for BodyRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {} {:016x}", self.key, self.size, self.hash)
    }
}

/// What a message's `ll-body` header says of its body.
#[derive(Clone, PartialEq, Eq)]
pub struct BodyRef {
    /// Object key in the bodies bucket.
    pub key: String,
    /// Bytes.
    pub size: usize,
    /// xxh3-64 of the bytes.
    pub hash: u64,
}

impl BodyRef {
    /// The header value.
    pub fn header(&self) -> String {
        format!("{self:?}")
    }

    /// Read a header value.
    pub fn parse(header: &str) -> Result<Self, BodyError> {
        let bad = |reason: &str| BodyError::Bad { header: header.to_string(), reason: reason.to_string() };
        let mut parts = header.split(' ');
        let (Some(key), Some(size), Some(hash), None) = (parts.next(), parts.next(), parts.next(), parts.next()) else {
            return Err(bad("expected `key size hash`"));
        };
        if key.is_empty() || !key.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-') {
            return Err(bad("the key is not a body key"));
        }
        let size: usize = size.parse().map_err(|_| bad("the size is not a number"))?;
        if size > MAX_BODY_BYTES {
            return Err(BodyError::TooLarge(size));
        }
        let hash = u64::from_str_radix(hash, 16).map_err(|_| bad("the hash is not hexadecimal"))?;
        Ok(Self { key: key.to_string(), size, hash })
    }
}

impl Bodies {
    /// The bodies bucket of `prefix` on `client`'s server (created with `replicas`
    /// copies if it does not exist).
    pub fn new(client: async_nats::Client, prefix: &str, replicas: usize) -> Self {
        Self {
            js: jetstream::new(client),
            bucket: crate::buckets::bodies_bucket(prefix),
            replicas,
            store: Arc::new(OnceCell::new()),
        }
    }

    async fn store(&self) -> Result<&object_store::ObjectStore, BodyError> {
        self.store
            .get_or_try_init(|| async {
                let fail = |reason: String| BodyError::Bucket { bucket: self.bucket.clone(), reason };
                match self.js.get_object_store(&self.bucket).await {
                    Ok(store) => Ok(store),
                    Err(_) => {
                        let config = object_store::Config {
                            bucket: self.bucket.clone(),
                            description: Some("LooseLeaf message bodies too large for one message (ADR 30)".into()),
                            max_age: BODY_TTL,
                            num_replicas: self.replicas,
                            ..Default::default()
                        };
                        match self.js.create_object_store(config).await {
                            Ok(store) => Ok(store),
                            // another service created it between our get and create
                            Err(create) => self
                                .js
                                .get_object_store(&self.bucket)
                                .await
                                .map_err(|e| fail(format!("create failed ({create}), get failed ({e})"))),
                        }
                    }
                }
            })
            .await
    }

    /// Store `payload` as a body; returns what the message's header says of it.
    pub async fn put(&self, payload: &[u8]) -> Result<BodyRef, BodyError> {
        if payload.len() > MAX_BODY_BYTES {
            return Err(BodyError::TooLarge(payload.len()));
        }
        let body = BodyRef {
            key: uuid::Uuid::new_v4().to_string(),
            size: payload.len(),
            hash: xxhash_rust::xxh3::xxh3_64(payload),
        };
        let mut reader = payload;
        self.store()
            .await?
            .put(body.key.as_str(), &mut reader)
            .await
            .map_err(|e| BodyError::Put { size: payload.len(), reason: e.to_string() })?;
        Ok(body)
    }

    /// Read the body a header names, checking its size and hash.
    pub async fn get(&self, header: &str) -> Result<Vec<u8>, BodyError> {
        let body = BodyRef::parse(header)?;
        let fail = |reason: String| BodyError::Get { key: body.key.clone(), reason };
        let store = self.store().await?;
        let mut bytes = Vec::with_capacity(body.size);
        let read = async {
            let mut object = store.get(&body.key).await.map_err(|e| fail(e.to_string()))?;
            // one byte more than named, so that a longer object is noticed without reading it all
            (&mut object).take(body.size as u64 + 1).read_to_end(&mut bytes).await.map_err(|e| fail(e.to_string()))
        };
        // a body deleted while it is read leaves the read waiting for chunks that
        // will never come: bounded, as for a body that expired
        let patience = GET_PATIENCE + Duration::from_secs((body.size >> 20) as u64);
        tokio::time::timeout(patience, read)
            .await
            .map_err(|_| fail(format!("not read within {patience:?} (deleted while read?)")))??;
        if bytes.len() != body.size || xxhash_rust::xxh3::xxh3_64(&bytes) != body.hash {
            return Err(BodyError::Bad {
                header: header.to_string(),
                reason: format!("the stored body ({} bytes) is not the one named", bytes.len()),
            });
        }
        Ok(bytes)
    }

    /// Delete a body nobody else will read (a reply, once its asker read it).
    pub async fn delete(&self, header: &str) {
        let Ok(body) = BodyRef::parse(header) else { return };
        let deleted = match self.store().await {
            Ok(store) => store.delete(&body.key).await.map_err(|e| e.to_string()),
            Err(e) => Err(e.to_string()),
        };
        if let Err(error) = deleted {
            // it expires with the bucket's max age anyway
            tracing::debug!(key = %body.key, %error, "could not delete a read message body");
        }
    }
}

#[cfg(test)]
mod tests {

    use super::*;
    use crate::checkpoint::{Manifest, VarEntry};
    use crate::local_nats::{LocalNats, NatsUser};
    use crate::messages::{ManifestGetV2, ManifestV2, Reply};
    use crate::permissions::Role;
    use crate::subjects::StoreVerb;
    use crate::Bus;

    const PREFIX: &str = "bodies-test";

    /// A manifest of 50,000 names, a few MiB encoded, travels from the store to a
    /// host under their NATS users and permissions, on a server that refuses any
    /// message over 512 KiB; the asker deletes the reply's body once read.
    #[tokio::test]
    async fn an_answer_larger_than_a_message_travels_as_a_body_and_is_deleted_once_read() {
        let dir = tempfile::tempdir().unwrap();
        let (store, host) = (NatsUser::service(Role::Store, PREFIX), NatsUser::service(Role::GpuHost, PREFIX));
        let users = [store.clone(), host.clone()];
        let nats = match LocalNats::start_with_users(&crate::locate::nats_server(None), &dir.path().join("n"), &users) {
            Ok(n) => n,
            Err(e) => panic!("nats-server (run scripts/setup): {e}"),
        };
        let store_bus = Bus::connect(&nats.url_for(&store), PREFIX, "store").await.unwrap();
        let host_bus = Bus::connect(&nats.url_for(&host), PREFIX, "host").await.unwrap();
        assert_eq!(host_bus.client().server_info().max_payload, BUS_MESSAGE_MAX_BYTES);

        let session = uuid::Uuid::now_v7();
        let mut manifest = Manifest::empty(session);
        for i in 0..50_000 {
            let var = VarEntry { version: session, oid: Some(format!("{i:032x}")), module: None, global_reads: vec![] };
            manifest.variables.insert(format!("v{i}"), var);
        }
        let mut gets =
            store_bus.subscribe::<ManifestGetV2>(store_bus.subjects().store(StoreVerb::ManifestGet)).await.unwrap();
        store_bus.flush().await.unwrap();
        let answer = ManifestV2 { manifest: manifest.clone() };
        let server = tokio::spawn(async move {
            let get = gets.next().await.unwrap().unwrap();
            store_bus.respond(get.reply, &Reply::Ok(answer)).await.unwrap();
            store_bus
        });
        let subject = host_bus.subjects().store(StoreVerb::ManifestGet);
        let get = ManifestGetV2 { session, at_least: None };
        let got: ManifestV2 = host_bus.request(subject, &get, std::time::Duration::from_secs(20)).await.unwrap();
        assert_eq!(got.manifest, manifest);
        assert!(crate::codec::encode_bincode(&got).unwrap().len() > 2 * BUS_MESSAGE_MAX_BYTES);

        // the reply's body is gone once read
        let bodies = host_bus.jetstream().get_object_store(crate::buckets::bodies_bucket(PREFIX)).await.unwrap();
        let mut left = usize::MAX;
        for _ in 0..50 {
            left = futures::StreamExt::count(bodies.list().await.unwrap()).await;
            if left == 0 {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
        assert_eq!(left, 0, "the answer's body was kept after it was read");
        drop(server.await.unwrap());
    }

    #[test]
    fn a_body_header_round_trips_and_bad_ones_are_named() {
        let body = BodyRef { key: uuid::Uuid::nil().to_string(), size: 300_000, hash: 0xabc };
        assert_eq!(BodyRef::parse(&body.header()).unwrap(), body);
        for bad in ["", "k", "k 1", "k x 1", "k 1 zz", "k 1 1 1", "../etc 1 1", &format!("k {} 1", MAX_BODY_BYTES + 1)]
        {
            assert!(BodyRef::parse(bad).is_err(), "{bad:?} was accepted");
        }
    }
}
