//! The bus contract of LooseLeaf: every message type, every subject, the checkpoint
//! format shared by the store and the hosts, the codec and a typed bus client.
//!
//! No service depends on another service's crate; they all depend on this one
//! (DESIGN.md section 3, CONVENTIONS.md "The bus").
//!
//! - [`subjects`]: subject functions, each with its grammar.
//! - [`codec`]: bincode 2 with the message type and version in NATS headers.
//! - [`bus`]: publish / request / subscribe-and-decode with W3C trace context.
//! - [`messages`]: the messages for every arrow in DESIGN.md section 3 (and, in
//!   `messages::frozen`, the versions they replaced).
//! - [`checkpoint`]: manifests, deltas, chunks and the object-store layout.
//! - [`clock`]: where "now" comes from (the system's, or the simulator's).
//! - [`buckets`]: JetStream KV buckets and streams.
//! - [`telemetry`]: tracing setup and trace-context propagation.
//! - [`service`]: the skeleton every service runs in (flags, `$SRV`, drain).
//! - [`local_nats`]: a local nats-server for `looseleaf up` and the tests.

pub mod allocator;
pub mod bodies;
pub mod buckets;
pub mod bus;
pub mod checkpoint;
pub mod clock;
pub mod codec;
pub mod health;
pub mod local_nats;
pub mod locate;
pub mod membership;
pub mod messages;
pub mod metrics;
pub mod nats;
pub mod permissions;
pub mod service;
pub mod subjects;
pub mod telemetry;

pub use bus::{Bus, BusError, Envelope};
pub use codec::{CodecError, WireMessage};
pub use subjects::Subjects;

/// Milliseconds since the Unix epoch, the clock that events and reports share.
pub fn unix_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

#[cfg(feature = "object-store")]
pub mod objects;
