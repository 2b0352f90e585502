//! The current messages, one per arrow in DESIGN.md section 3.
//!
//! Each struct is frozen once shipped: a change is a new `…V2` struct, a new
//! `VERSION`, and an upgrade from the old one in `decode_version`. The old version
//! then moves to [`frozen`], in a file of its own that holds copies of every type it
//! encodes (never a live type, whose edits would silently change its bytes), and a
//! golden-bytes test pins its encoding. Never use serde's `skip_serializing_if`
//! here: bincode cannot skip fields.
//!
//! The messages live in files by what they are about, and every one is
//! re-exported here, so `messages::X` names it wherever it is defined:
//!
//! - `run`: frontend -> planner: edits and runs, with the session options.
//! - `recipe`: planner -> hosts: a cell's recipe (closures, device, worker).
//! - `events`: a session's events for its clients, and the enums they carry.
//! - `output`: a cell's outputs, and the output types that are no notebook output.
//! - `control`: frontend -> hosts: session close and idle, interrupts, input replies.
//! - `host`: a host's status (slots, zygotes, workers), its bids, evictions.
//! - `query`: frontend -> a session's CPU worker: completion, inspection, comms.
//! - `store`: manifests, chunk plans, commits, settling, deletion, collection.
//! - here: the `wire!` macro every file uses, and the reply envelope ([`Reply`],
//!   [`ErrorCode`], [`DoneV1`]) shared by every request.

use serde::{Deserialize, Serialize};

use crate::codec::WireMessage;

pub mod frozen;
pub use frozen::{
    ChunkPlanV1, CommitV1, HostStatusV1, ManifestGetV1, OutputV1, RecipeV1, RecipeV2, RunV1, RunV2, SessionEventV1,
};

macro_rules! wire {
    ($ty:ty, $name:literal, $version:literal) => {
        impl WireMessage for $ty {
            const TYPE: &'static str = $name;
            const VERSION: u16 = $version;
        }
    };
    // The current version, which also reads a frozen older one through its `upgrade`.
    ($ty:ty, $name:literal, $version:literal, upgrades $old:ident from $old_version:literal) => {
        impl WireMessage for $ty {
            const TYPE: &'static str = $name;
            const VERSION: u16 = $version;

            fn decode_version(version: u16, payload: &[u8]) -> Result<Self, crate::codec::CodecError> {
                match version {
                    $version => crate::codec::decode_bincode(payload),
                    $old_version => crate::codec::decode_bincode::<$old>(payload).map($old::upgrade),
                    _ => Err(crate::codec::CodecError::UnsupportedVersion { ty: Self::TYPE, version }),
                }
            }
        }
    };
    // Two versions back: the oldest upgrades to the older, which upgrades to the current.
    ($ty:ty, $name:literal, $version:literal, upgrades $old:ident from $old_version:literal,
     $older:ident from $older_version:literal) => {
        impl WireMessage for $ty {
            const TYPE: &'static str = $name;
            const VERSION: u16 = $version;

            fn decode_version(version: u16, payload: &[u8]) -> Result<Self, crate::codec::CodecError> {
                match version {
                    $version => crate::codec::decode_bincode(payload),
                    $old_version => crate::codec::decode_bincode::<$old>(payload).map($old::upgrade),
                    $older_version => crate::codec::decode_bincode::<$older>(payload).map(|m| m.upgrade().upgrade()),
                    _ => Err(crate::codec::CodecError::UnsupportedVersion { ty: Self::TYPE, version }),
                }
            }
        }
    };
}

mod control;
mod events;
mod host;
mod output;
mod query;
mod recipe;
mod run;
mod store;

pub use control::{InputReplyV1, InterruptV1, SessionCloseV1, SessionIdleV1, INTERRUPTED_BEFORE_START, NO_STDIN};
pub use events::{
    CellStatus, EventKind, Prepare, PreparedClass, PreparedOutcome, SessionEventV2, SlotUse, StartPhases,
};
pub use host::{BidV1, EvictV1, GpuDemandV1, HostStatusV2, SlotStatus, WorkerState, WorkerStatus, ZygoteStatus};
pub use output::{
    cell_message_json, cell_messages_json, CellMessage, CellMessageError, CommToClient, OutputBody, OutputV2,
    MAX_OUTPUT_PIECES, OUTPUT_PART_BYTES,
};
pub use query::{CommAnswerV2, CommV1, QueryAnswerV1, QueryKind, QueryV1};
pub use recipe::{ClosureVar, Device, PinnedWorker, PreparedWorker, RecipeKind, RecipeV3};
pub use run::{EditV1, RunV3, SessionOptions};
pub use store::{
    ChunkPlanV2, ChunkPlannedV1, CommitV2, CommittedV1, ForkV1, GcDoneV1, GcV1, ManifestGetV2, ManifestV2, RevertTo,
    RevertV1, SessionDeleteV1, SettleV1, StateCheckV1, StateCheckedV1, StateMovedV1, StorePressureV1,
};

/// A typed error in a reply.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum ErrorCode {
    /// The request did not decode or was invalid.
    BadRequest,
    /// The thing asked for does not exist.
    NotFound,
    /// Someone else committed first (optimistic concurrency).
    Conflict,
    /// A quota would be exceeded.
    QuotaExceeded,
    /// Storage failed.
    Storage,
    /// Anything else.
    Internal,
}

/// The one reply envelope for request/reply.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Reply<T> {
    /// Success.
    Ok(T),
    /// A typed error.
    Err {
        /// What kind of error.
        code: ErrorCode,
        /// Human-readable detail.
        message: String,
    },
}

impl<T: WireMessage> WireMessage for Reply<T> {
    const TYPE: &'static str = "reply";
    const VERSION: u16 = T::VERSION;
}

/// An empty successful reply.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DoneV1 {}
wire!(DoneV1, "done", 1);

#[cfg(test)]
mod tests;
