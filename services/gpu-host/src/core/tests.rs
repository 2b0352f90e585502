//! The host's decisions, one input at a time: each test feeds the core inputs
//! on a test clock and asserts the commands it returns.

use std::cell::Cell;
use std::collections::HashSet;
use std::rc::Rc;
use std::time::{Duration, Instant};

use schemas::clock::Clock;
use schemas::messages::{
    Device, EventKind, PinnedWorker, Prepare, PreparedClass, PreparedOutcome, PreparedWorker as PreparedAt, RecipeKind,
    RecipeV3, SlotUse, WorkerState,
};
use uuid::Uuid;

use super::prepared::Phase;
use super::runs::RunState;
use super::*;
use crate::host::slots::SlotState;

/// A clock the test moves.
#[derive(Clone)]
struct TestClock(Rc<Cell<Instant>>);

impl Clock for TestClock {
    fn now(&self) -> Instant {
        self.0.get()
    }
}

impl TestClock {
    fn advance(&self, d: Duration) {
        self.0.set(self.0.get() + d);
    }
}

/// What the world says: dead workers, and this host's placement.
#[derive(Default)]
struct World {
    dead: HashSet<String>,
    placement: (f64, f64),
}

impl Facts for World {
    fn alive(&self, worker: &str) -> bool {
        !self.dead.contains(worker)
    }
    fn placement(&self, _: &RecipeV3) -> (f64, f64) {
        self.placement
    }
}

/// A host under test.
struct Host {
    core: HostCore<TestClock>,
    clock: TestClock,
    world: World,
}

const S: Uuid = Uuid::from_u128(0x5e55);
const S2: Uuid = Uuid::from_u128(0x5e56);

fn gpus(n: u32) -> Vec<Gpu> {
    (0..n).map(|index| Gpu { index, name: "virtual".into(), memory_bytes: 0 }).collect()
}

fn host_with(n: u32, policy: Policy) -> Host {
    let clock = TestClock(Rc::new(Cell::new(Instant::now())));
    Host { core: HostCore::new("h1", gpus(n), policy, clock.clone()), clock, world: World::default() }
}

fn host(n: u32) -> Host {
    host_with(n, Policy::default())
}

/// A host whose prepared workers hold their slots (the rule before staging, kept
/// for validation runs): what eviction and slot hand-over are tested on.
fn host_holding(n: u32) -> Host {
    host_with(n, Policy { prepare_holds_slot: true, keep_warm: false })
}

fn recipe(kind: RecipeKind, session: Uuid, cell: &str, exec: u128) -> RecipeV3 {
    let exec_id = if kind == RecipeKind::Run { Uuid::from_u128(exec) } else { Uuid::nil() };
    gpu_recipe(session, cell, kind, exec_id, 1)
}

fn run(session: Uuid, cell: &str, exec: u128) -> RecipeV3 {
    recipe(RecipeKind::Run, session, cell, exec)
}

fn edit(session: Uuid, cell: &str, revision: u64) -> RecipeV3 {
    RecipeV3 { revision, ..recipe(RecipeKind::Speculative, session, cell, 0) }
}

fn cpu_run(session: Uuid, cell: &str, exec: u128) -> RecipeV3 {
    RecipeV3 { device: Device::Cpu, ..run(session, cell, exec) }
}

fn exec(n: u128) -> Uuid {
    Uuid::from_u128(n)
}

fn worker(id: &str) -> WorkerRef {
    WorkerRef { id: id.into(), pid: 100 }
}

/// Execution `n` ended on worker `id` (None: lost), holding `unsavable`.
fn executed(n: u128, id: Option<&str>, unsavable: &[&str], cuda_used: bool) -> Input {
    let unsavable = unsavable.iter().map(|u| u.to_string()).collect();
    Input::Executed { exec_id: exec(n), worker: id.map(worker), unsavable, cuda_used }
}

impl Host {
    fn on(&mut self, input: Input) -> Vec<Command> {
        self.core.on(input, &self.world)
    }

    /// The one claim among `cmds`.
    fn claim_in(cmds: &[Command]) -> (Ticket, ClaimKey, Duration) {
        let claims: Vec<_> = cmds
            .iter()
            .filter_map(|c| match c {
                Command::Claim { ticket, key, delay, .. } => Some((*ticket, key.clone(), *delay)),
                _ => None,
            })
            .collect();
        assert_eq!(claims.len(), 1, "one claim expected in {cmds:?}");
        claims[0].clone()
    }

    /// Deliver a run recipe and settle its claim with `claim`.
    fn run_settled(&mut self, r: RecipeV3, claim: Claim) -> Vec<Command> {
        let cmds = self.on(Input::Recipe(r));
        let (ticket, _, _) = Self::claim_in(&cmds);
        self.on(Input::Claimed { ticket, claim })
    }

    /// Prepare `cell` of `session`: edit, claim won, prepared as worker `id`
    /// (on a slot only if the host's policy says so). Returns the commands of
    /// the last step.
    fn prepare(&mut self, session: Uuid, cell: &str, id: &str) -> Vec<Command> {
        let cmds = self.on(Input::Recipe(edit(session, cell, 1)));
        let (ticket, _, _) = Self::claim_in(&cmds);
        let cmds = self.on(Input::Claimed { ticket, claim: Claim::Won });
        assert!(prepares(&cmds).is_some(), "won preparation prepares: {cmds:?}");
        self.on(Input::Prepared { key: (session, cell.into()), result: Ok((worker(id), 50.0)) })
    }

    fn slot(&self, i: u32) -> SlotState {
        self.core.slots().state(i).cloned().expect("a slot")
    }
}

fn executes(cmds: &[Command]) -> Option<(Uuid, Target, Option<PrepKey>)> {
    cmds.iter().find_map(|c| match c {
        Command::Execute { recipe, target, prepared } => Some((recipe.exec_id, target.clone(), prepared.clone())),
        _ => None,
    })
}

fn prepares(cmds: &[Command]) -> Option<(u64, Vec<u32>, Option<WorkerId>)> {
    cmds.iter().find_map(|c| match c {
        Command::Prepare { recipe, slots, worker, .. } => Some((recipe.revision, slots.clone(), worker.clone())),
        _ => None,
    })
}

fn stopped(cmds: &[Command]) -> Vec<&str> {
    cmds.iter()
        .filter_map(|c| match c {
            Command::StopWorker { worker } => Some(worker.as_str()),
            _ => None,
        })
        .collect()
}

fn events(cmds: &[Command]) -> Vec<&EventKind> {
    cmds.iter()
        .filter_map(|c| match c {
            Command::Event { kind, .. } => Some(kind),
            _ => None,
        })
        .collect()
}

fn ended(cmds: &[Command]) -> Vec<PreparedOutcome> {
    events(cmds)
        .into_iter()
        .filter_map(|e| match e {
            EventKind::PreparedEnded { outcome, .. } => Some(*outcome),
            _ => None,
        })
        .collect()
}

fn released(cmds: &[Command]) -> Vec<(u32, SlotUse)> {
    events(cmds)
        .into_iter()
        .filter_map(|e| match e {
            EventKind::SlotReleased { slot, reason, .. } => Some((*slot, *reason)),
            _ => None,
        })
        .collect()
}

fn after(cmds: &[Command]) -> Option<(Duration, &Input)> {
    cmds.iter().find_map(|c| match c {
        Command::After { delay, input } => Some((*delay, input.as_ref())),
        _ => None,
    })
}

fn no_claim(cmds: &[Command]) -> bool {
    !cmds.iter().any(|c| matches!(c, Command::Claim { .. }))
}

// ---------------------------------------------------------------- claims

#[test]
fn a_gpu_run_with_a_free_slot_is_claimed_with_its_slot_reserved() {
    let mut h = host(1);
    let cmds = h.on(Input::Recipe(run(S, "c", 1)));
    let (_, key, delay) = Host::claim_in(&cmds);
    assert_eq!(key, ClaimKey::Run(exec(1)));
    assert_eq!(delay, Duration::ZERO, "no competitor has room: at once");
    assert_eq!(h.slot(0), SlotState::Claiming(Some(exec(1))));
    assert!(executes(&cmds).is_none());
}

#[test]
fn a_won_run_executes_on_a_fresh_worker_holding_its_slot() {
    let mut h = host(1);
    let cmds = h.run_settled(run(S, "c", 1), Claim::Won);
    assert_eq!(executes(&cmds), Some((exec(1), Target::Fresh { slots: vec![0] }, None)));
    assert_eq!(h.slot(0), SlotState::Busy { exec: exec(1), session: S });
    assert!(cmds.iter().any(|c| matches!(c, Command::Bid(b) if b.won && b.exec_id == exec(1))));
    assert_eq!(h.core.running(), 1);
}

#[test]
fn a_lost_run_frees_its_slot_and_is_remembered_as_gone() {
    let mut h = host(1);
    let cmds = h.run_settled(run(S, "c", 1), Claim::Lost);
    assert!(executes(&cmds).is_none());
    assert_eq!(h.slot(0), SlotState::Free);
    assert_eq!(h.core.run_state(exec(1)), Some(&RunState::Gone));
    assert!(h.on(Input::Recipe(run(S, "c", 1))).is_empty(), "a copy of it is dropped");
}

#[test]
fn a_failed_claim_is_routed_again_after_the_retry_delay() {
    let mut h = host(1);
    let cmds = h.run_settled(run(S, "c", 1), Claim::Failed);
    let (delay, input) = after(&cmds).expect("a retry");
    assert_eq!(delay, CLAIM_RETRY);
    assert!(matches!(input, Input::Retry(r) if r.exec_id == exec(1)));
    assert_eq!(h.slot(0), SlotState::Free, "the slot is not held while waiting to retry");
    let cmds = h.on(Input::Retry(run(S, "c", 1)));
    assert_eq!(Host::claim_in(&cmds).1, ClaimKey::Run(exec(1)), "the retry claims again");
}

#[test]
fn a_run_whose_claim_keeps_failing_is_given_up_once_its_arrival_is_old() {
    let mut h = host(1);
    let cmds = h.on(Input::Recipe(run(S, "c", 1)));
    let (ticket, _, _) = Host::claim_in(&cmds);
    h.clock.advance(ARRIVAL_MEMORY + Duration::from_secs(1));
    let cmds = h.on(Input::Claimed { ticket, claim: Claim::Failed });
    assert!(after(&cmds).is_none(), "no retry: the frontend has given up on it");
    assert_eq!(h.core.run_state(exec(1)), Some(&RunState::Gone));
}

#[test]
fn a_copy_of_a_run_heard_before_is_dropped() {
    let mut h = host(2);
    assert!(!h.on(Input::Recipe(run(S, "c", 1))).is_empty());
    assert!(h.on(Input::Recipe(run(S, "c", 1))).is_empty(), "taken once (ADR 46)");
    assert_eq!(h.slot(1), SlotState::Free, "the copy reserved nothing");
}

#[test]
fn with_a_competitor_that_has_room_the_claim_waits_its_delay() {
    let mut h = host(1);
    h.on(Input::PeerStatus { host: "h2".into(), free_slots: 1 });
    let (_, _, delay) = Host::claim_in(&h.on(Input::Recipe(run(S, "c", 1))));
    assert!(delay >= Duration::from_millis(2), "{delay:?}");
}

#[test]
fn a_peer_not_heard_lately_is_no_competitor() {
    let mut h = host(1);
    h.on(Input::PeerStatus { host: "h2".into(), free_slots: 4 });
    h.clock.advance(peers::PEER_STALE + Duration::from_secs(1));
    let (_, _, delay) = Host::claim_in(&h.on(Input::Recipe(run(S, "c", 1))));
    assert_eq!(delay, Duration::ZERO);
}

#[test]
fn a_better_placed_host_waits_less_for_the_same_recipe() {
    let delay_with = |placement: (f64, f64)| {
        let mut h = host(1);
        h.world.placement = placement;
        h.on(Input::PeerStatus { host: "h2".into(), free_slots: 1 });
        Host::claim_in(&h.on(Input::Recipe(run(S, "c", 1)))).2
    };
    assert!(delay_with((1.0, 1.0)) < delay_with((0.0, 0.0)));
}

#[test]
fn a_multi_gpu_run_is_not_for_a_host_with_fewer_slots() {
    let mut h = host(1);
    let cmds = h.on(Input::Recipe(RecipeV3 { gpus: 2, ..run(S, "c", 1) }));
    assert!(no_claim(&cmds), "{cmds:?}");
    assert_eq!(h.core.run_state(exec(1)), Some(&RunState::Gone));
}

#[test]
fn a_multi_gpu_run_takes_its_slots_together() {
    let mut h = host(3);
    let cmds = h.run_settled(RecipeV3 { gpus: 2, ..run(S, "c", 1) }, Claim::Won);
    assert_eq!(executes(&cmds).map(|e| e.1), Some(Target::Fresh { slots: vec![0, 1] }));
    assert_eq!(h.slot(2), SlotState::Free);
}

// ---------------------------------------------------------------- slot pressure

#[test]
fn a_run_finding_no_free_slot_waits_and_claims_once_one_frees() {
    let mut h = host(1);
    h.run_settled(run(S, "a", 1), Claim::Won);
    let cmds = h.on(Input::Recipe(run(S2, "b", 2)));
    assert!(no_claim(&cmds), "it waits unclaimed: another host may take it");
    assert_eq!(h.core.run_state(exec(2)), Some(&RunState::Pending));
    let cmds = h.on(executed(1, Some("w1"), &[], true));
    assert_eq!(released(&cmds), vec![(0, SlotUse::Cell)]);
    assert_eq!(stopped(&cmds), vec!["w1"], "nothing to keep it for");
    assert_eq!(Host::claim_in(&cmds).1, ClaimKey::Run(exec(2)));
}

#[test]
fn waiting_runs_claim_in_the_order_they_arrived() {
    let mut h = host(1);
    h.run_settled(run(S, "a", 1), Claim::Won);
    h.on(Input::Recipe(run(S2, "b", 2)));
    h.on(Input::Recipe(run(S2, "c", 3)));
    let cmds = h.on(executed(1, None, &[], false));
    assert_eq!(Host::claim_in(&cmds).1, ClaimKey::Run(exec(2)));
    assert_eq!(h.core.run_state(exec(3)), Some(&RunState::Pending));
}

#[test]
fn a_multi_gpu_run_at_the_head_is_not_overtaken_by_one_slot_runs() {
    let mut h = host(2);
    h.run_settled(run(S, "a", 1), Claim::Won);
    h.run_settled(run(S, "b", 2), Claim::Won);
    h.on(Input::Recipe(RecipeV3 { gpus: 2, ..run(S2, "big", 3) }));
    h.on(Input::Recipe(run(S2, "small", 4)));
    let cmds = h.on(executed(1, None, &[], false));
    assert!(no_claim(&cmds), "one slot free: the two-slot run waits at the head");
    let cmds = h.on(executed(2, None, &[], false));
    assert_eq!(Host::claim_in(&cmds).1, ClaimKey::Run(exec(3)));
}

#[test]
fn a_run_evicts_an_idle_prepared_worker_only_once_it_won() {
    let mut h = host_holding(1);
    h.prepare(S, "p", "wp");
    let cmds = h.on(Input::Recipe(run(S2, "c", 1)));
    let (ticket, key, _) = Host::claim_in(&cmds);
    assert_eq!(key, ClaimKey::Run(exec(1)));
    assert!(stopped(&cmds).is_empty(), "nothing evicted before the claim is won");
    let cmds = h.on(Input::Claimed { ticket, claim: Claim::Won });
    assert_eq!(stopped(&cmds), vec!["wp"]);
    assert_eq!(ended(&cmds), vec![PreparedOutcome::EvictedForRun]);
    assert_eq!(executes(&cmds).map(|e| e.1), Some(Target::Fresh { slots: vec![0] }));
}

#[test]
fn a_run_that_lost_its_claim_evicts_nothing() {
    let mut h = host_holding(1);
    h.prepare(S, "p", "wp");
    let cmds = h.run_settled(run(S2, "c", 1), Claim::Lost);
    assert!(stopped(&cmds).is_empty());
    assert!(matches!(h.slot(0), SlotState::Prepared { .. }));
}

#[test]
fn a_won_run_with_no_slot_to_free_waits_and_runs_when_one_frees() {
    let mut h = host(1);
    h.run_settled(run(S, "a", 1), Claim::Won);
    let cmds = h.on(Input::Retry(run(S2, "b", 2)));
    assert_eq!(h.core.run_state(exec(2)), Some(&RunState::Pending), "{cmds:?}");
    // claimed elsewhere first (as a run on a prepared worker that died would be)
    let mut h = host(1);
    h.run_settled(run(S, "a", 1), Claim::Won);
    h.prepare(S2, "b", "wb");
    h.world.dead.insert("wb".into());
    let cmds = h.run_settled(run(S2, "b", 2), Claim::Won);
    assert_eq!(ended(&cmds), vec![PreparedOutcome::Lost], "the dead worker ends");
    assert_eq!(h.core.run_state(exec(2)), Some(&RunState::Won), "claimed, waiting for a slot");
    let cmds = h.on(executed(1, None, &[], false));
    assert_eq!(executes(&cmds).map(|e| e.1), Some(Target::Fresh { slots: vec![0] }));
}

#[test]
fn warm_workers_are_given_up_before_speculative_ones() {
    let mut h = host_with(2, Policy { keep_warm: true, prepare_holds_slot: true });
    h.prepare(S, "p", "wp");
    h.run_settled(run(S2, "w", 1), Claim::Won);
    let cmds = h.on(executed(1, Some("ww"), &[], true));
    assert!(events(&cmds).iter().any(|e| matches!(e, EventKind::Ready { class: PreparedClass::Warm, .. })));
    let cmds = h.run_settled(run(S2, "x", 2), Claim::Won);
    assert_eq!(stopped(&cmds), vec!["ww"], "the warm one goes first");
}

// ---------------------------------------------------------------- preparation

#[test]
fn an_admitted_edit_is_claimed_without_a_slot_whatever_its_closure_holds() {
    // staged preparation (ADR 70): no slot while the user types, GPU-resident
    // closure or not; the run binds one
    let mut h = host(1);
    let cmds = h.on(Input::Recipe(edit(S, "c", 1)));
    let (ticket, key, _) = Host::claim_in(&cmds);
    assert_eq!(key, ClaimKey::Prepare { session: S, cell_id: "c".into(), revision: 1 });
    assert_eq!(h.slot(0), SlotState::Free);
    let cmds = h.on(Input::Claimed { ticket, claim: Claim::Won });
    assert_eq!(prepares(&cmds), Some((1, vec![], None)), "prepared with no slot");
    assert!(events(&cmds).iter().any(|e| matches!(e, EventKind::Preparing { slot: None, .. })));
    assert_eq!(h.slot(0), SlotState::Free);
}

#[test]
fn a_multi_gpu_cell_is_prepared_on_its_slots() {
    let mut h = host(2);
    let cmds = h.on(Input::Recipe(RecipeV3 { gpus: 2, ..edit(S, "c", 1) }));
    let (ticket, _, _) = Host::claim_in(&cmds);
    assert_eq!((h.slot(0), h.slot(1)), (SlotState::Claiming(None), SlotState::Claiming(None)));
    let cmds = h.on(Input::Claimed { ticket, claim: Claim::Won });
    assert_eq!(prepares(&cmds), Some((1, vec![0, 1], None)));
}

#[test]
fn a_host_that_prepares_with_slots_holds_one_while_claiming() {
    let mut h = host_holding(1);
    let cmds = h.on(Input::Recipe(edit(S, "c", 1)));
    assert_eq!(Host::claim_in(&cmds).1, ClaimKey::Prepare { session: S, cell_id: "c".into(), revision: 1 });
    assert_eq!(h.slot(0), SlotState::Claiming(None));
}

#[test]
fn a_won_preparation_prepares_its_worker_and_says_so() {
    let mut h = host_holding(1);
    let (ticket, _, _) = Host::claim_in(&h.on(Input::Recipe(edit(S, "c", 1))));
    let cmds = h.on(Input::Claimed { ticket, claim: Claim::Won });
    assert_eq!(prepares(&cmds), Some((1, vec![0], None)));
    assert!(events(&cmds).iter().any(|e| matches!(e, EventKind::Preparing { revision: 1, slot: Some(0), .. })));
    assert!(h.core.is_preparing(S, "c"));
}

#[test]
fn a_lost_preparation_frees_its_slot_and_prepares_nothing() {
    let mut h = host_holding(1);
    let (ticket, _, _) = Host::claim_in(&h.on(Input::Recipe(edit(S, "c", 1))));
    let cmds = h.on(Input::Claimed { ticket, claim: Claim::Lost });
    assert!(prepares(&cmds).is_none());
    assert_eq!(h.slot(0), SlotState::Free);
}

#[test]
fn a_prepared_worker_says_it_is_ready() {
    let mut h = host_holding(1);
    let cmds = h.prepare(S, "c", "w1");
    assert!(events(&cmds).iter().any(|e| matches!(e, EventKind::Ready { worker, revision: 1, .. } if worker == "w1")));
    assert_eq!(h.core.prepared_worker(&(S, "c".into())).map(|p| p.0), Some("w1"));
}

#[test]
fn a_run_arriving_while_its_worker_prepares_runs_there_once_prepared() {
    let mut h = host_holding(1);
    let (ticket, _, _) = Host::claim_in(&h.on(Input::Recipe(edit(S, "c", 1))));
    h.on(Input::Claimed { ticket, claim: Claim::Won });
    let cmds = h.on(Input::Recipe(run(S, "c", 7)));
    let (ticket, key, delay) = Host::claim_in(&cmds);
    assert_eq!((key, delay), (ClaimKey::Run(exec(7)), Duration::ZERO), "the preparing host claims at once");
    let cmds = h.on(Input::Claimed { ticket, claim: Claim::Won });
    assert!(executes(&cmds).is_none(), "not before it is prepared");
    assert_eq!(h.core.run_state(exec(7)), Some(&RunState::OnPreparing((S, "c".into()))));
    let cmds = h.on(Input::Prepared { key: (S, "c".into()), result: Ok((worker("w1"), 80.0)) });
    let target = Target::Existing { worker: "w1".into(), prepare: Prepare::Speculative, slots: vec![0] };
    assert_eq!(executes(&cmds), Some((exec(7), target, Some((S, "c".into())))));
    assert_eq!(ended(&cmds), vec![PreparedOutcome::Used]);
    // the preparation is on the session's record as any other: Ready, with its cost
    let ready = events(&cmds).into_iter().find(|e| matches!(e, EventKind::Ready { .. }));
    assert!(
        matches!(&ready, Some(EventKind::Ready { worker, prepare_ms, .. }) if worker == "w1" && *prepare_ms == 80.0),
        "{ready:?}"
    );
}

#[test]
fn a_run_on_a_ready_prepared_worker_runs_there_on_its_slot() {
    let mut h = host_holding(1);
    h.prepare(S, "c", "w1");
    let cmds = h.run_settled(run(S, "c", 7), Claim::Won);
    let target = Target::Existing { worker: "w1".into(), prepare: Prepare::Speculative, slots: vec![0] };
    assert_eq!(executes(&cmds).map(|e| e.1), Some(target));
    assert_eq!(h.slot(0), SlotState::Busy { exec: exec(7), session: S });
}

#[test]
fn a_worker_prepared_without_a_slot_takes_a_free_one_at_run() {
    let mut h = host(1);
    h.prepare(S, "c", "w1");
    assert_eq!(h.slot(0), SlotState::Free, "no GPU time while the user types");
    let cmds = h.run_settled(run(S, "c", 7), Claim::Won);
    let target = Target::Existing { worker: "w1".into(), prepare: Prepare::Speculative, slots: vec![0] };
    assert_eq!(executes(&cmds).map(|e| e.1), Some(target));
}

#[test]
fn a_run_on_a_slotless_prepared_worker_waits_with_it_for_a_slot() {
    let mut h = host(1);
    h.prepare(S, "c", "w1");
    h.run_settled(run(S2, "x", 1), Claim::Won);
    let cmds = h.run_settled(run(S, "c", 7), Claim::Won);
    assert!(executes(&cmds).is_none());
    assert_eq!(h.core.run_state(exec(7)), Some(&RunState::ForPrepared((S, "c".into()))));
    let renew = h.on(Input::Tick);
    assert!(renew.iter().any(|c| matches!(c, Command::Renew { keys } if keys.contains(&ClaimKey::Run(exec(7))))));
    let cmds = h.on(executed(1, None, &[], false));
    let target = Target::Existing { worker: "w1".into(), prepare: Prepare::Speculative, slots: vec![0] };
    assert_eq!(executes(&cmds).map(|e| e.1), Some(target));
}

#[test]
fn a_newer_revision_while_preparing_is_applied_in_place_next() {
    let mut h = host_holding(1);
    let (ticket, _, _) = Host::claim_in(&h.on(Input::Recipe(edit(S, "c", 1))));
    h.on(Input::Claimed { ticket, claim: Claim::Won });
    let cmds = h.on(Input::Recipe(edit(S, "c", 2)));
    assert_eq!(Host::claim_in(&cmds).1, ClaimKey::Prepare { session: S, cell_id: "c".into(), revision: 2 });
    assert!(prepares(&cmds).is_none(), "it waits for the preparation under way");
    let cmds = h.on(Input::Prepared { key: (S, "c".into()), result: Ok((worker("w1"), 80.0)) });
    assert_eq!(prepares(&cmds), Some((2, vec![0], Some("w1".into()))), "in place, on the same worker");
}

#[test]
fn a_newer_revision_updates_a_ready_worker_in_place() {
    let mut h = host_holding(1);
    h.prepare(S, "c", "w1");
    let cmds = h.on(Input::Recipe(edit(S, "c", 2)));
    assert_eq!(prepares(&cmds), Some((2, vec![0], Some("w1".into()))));
}

#[test]
fn an_older_or_equal_revision_changes_nothing() {
    let mut h = host_holding(1);
    h.prepare(S, "c", "w1");
    assert!(h.on(Input::Recipe(edit(S, "c", 1))).is_empty());
}

#[test]
fn a_revision_arriving_while_claiming_is_applied_once_won() {
    let mut h = host_holding(1);
    let (ticket, _, _) = Host::claim_in(&h.on(Input::Recipe(edit(S, "c", 1))));
    let cmds = h.on(Input::Recipe(edit(S, "c", 3)));
    assert_eq!(Host::claim_in(&cmds).1, ClaimKey::Prepare { session: S, cell_id: "c".into(), revision: 3 });
    let cmds = h.on(Input::Claimed { ticket, claim: Claim::Won });
    assert_eq!(prepares(&cmds).map(|p| p.0), Some(1));
    let cmds = h.on(Input::Prepared { key: (S, "c".into()), result: Ok((worker("w1"), 80.0)) });
    assert_eq!(prepares(&cmds).map(|p| p.0), Some(3));
}

#[test]
fn an_edit_the_budget_did_not_admit_prepares_nothing() {
    let mut h = host(1);
    assert!(h.on(Input::Recipe(RecipeV3 { speculate: false, ..edit(S, "c", 1) })).is_empty());
}

#[test]
fn an_edit_for_another_hosts_prepared_worker_is_left_to_it() {
    let mut h = host(1);
    let r = RecipeV3 { prepared: Some(PreparedAt { host: "h2".into(), worker: "w9".into() }), ..edit(S, "c", 2) };
    assert!(h.on(Input::Recipe(r)).is_empty());
}

#[test]
fn a_run_since_the_edit_arrived_supersedes_its_preparation() {
    let mut h = host(2);
    let (ticket, _, _) = Host::claim_in(&h.on(Input::Recipe(edit(S, "c", 1))));
    h.run_settled(run(S, "c", 7), Claim::Won);
    // the edit's claim settles after the cell's run arrived
    let cmds = h.on(Input::Claimed { ticket, claim: Claim::Won });
    assert!(prepares(&cmds).is_none(), "the cell already ran: no worker idles for it: {cmds:?}");
}

#[test]
fn a_cell_that_became_a_cpu_cell_cancels_its_prepared_worker() {
    let mut h = host_holding(1);
    h.prepare(S, "c", "w1");
    let cmds = h.on(Input::Recipe(RecipeV3 { device: Device::Cpu, ..edit(S, "c", 2) }));
    assert_eq!(stopped(&cmds), vec!["w1"]);
    assert_eq!(ended(&cmds), vec![PreparedOutcome::Superseded]);
    assert_eq!(released(&cmds), vec![(0, SlotUse::Speculation)]);
}

#[test]
fn an_edit_finding_no_slot_waits_briefly_then_is_dropped() {
    let mut h = host_holding(1);
    h.run_settled(run(S2, "x", 1), Claim::Won);
    assert!(no_claim(&h.on(Input::Recipe(edit(S, "c", 1)))));
    // a slot frees within SPEC_WAIT: the edit is tried again
    let cmds = h.on(executed(1, None, &[], false));
    assert!(cmds.iter().any(|c| matches!(c, Command::Claim { key: ClaimKey::Prepare { .. }, .. })), "{cmds:?}");
    // later than SPEC_WAIT: stale, dropped
    let mut h = host_holding(1);
    h.run_settled(run(S2, "x", 1), Claim::Won);
    h.on(Input::Recipe(edit(S, "c", 1)));
    h.clock.advance(SPEC_WAIT + Duration::from_secs(1));
    let cmds = h.on(executed(1, None, &[], false));
    assert!(!cmds.iter().any(|c| matches!(c, Command::Claim { .. })));
}

#[test]
fn a_failed_preparation_runs_its_claimed_run_cold() {
    let mut h = host_holding(1);
    let (ticket, _, _) = Host::claim_in(&h.on(Input::Recipe(edit(S, "c", 1))));
    h.on(Input::Claimed { ticket, claim: Claim::Won });
    h.run_settled(run(S, "c", 7), Claim::Won);
    let cmds = h.on(Input::Prepared { key: (S, "c".into()), result: Err("fork failed".into()) });
    assert_eq!(ended(&cmds), vec![PreparedOutcome::Lost]);
    assert_eq!(executes(&cmds).map(|e| e.1), Some(Target::Fresh { slots: vec![0] }));
}

#[test]
fn a_prepared_worker_that_died_is_ended_on_the_next_tick() {
    let mut h = host_holding(1);
    h.prepare(S, "c", "w1");
    h.world.dead.insert("w1".into());
    let cmds = h.on(Input::Tick);
    assert_eq!(ended(&cmds), vec![PreparedOutcome::Lost]);
    assert_eq!(h.slot(0), SlotState::Free);
}

#[test]
fn a_run_for_a_prepared_worker_that_died_runs_on_a_fresh_one() {
    let mut h = host_holding(1);
    h.prepare(S, "c", "w1");
    h.world.dead.insert("w1".into());
    let cmds = h.run_settled(run(S, "c", 7), Claim::Won);
    assert_eq!(ended(&cmds), vec![PreparedOutcome::Lost]);
    assert_eq!(executes(&cmds).map(|e| e.1), Some(Target::Fresh { slots: vec![0] }), "nothing is lost");
}

#[test]
fn evicting_a_ready_worker_stops_it_and_frees_its_slot() {
    let mut h = host_holding(1);
    h.prepare(S, "c", "w1");
    let cmds = h.on(Input::Evict { worker: "w1".into() });
    assert_eq!((stopped(&cmds), ended(&cmds)), (vec!["w1"], vec![PreparedOutcome::Evicted]));
    assert_eq!(h.slot(0), SlotState::Free);
}

#[test]
fn evicting_a_worker_being_updated_stops_it_once_prepared() {
    let mut h = host_holding(1);
    h.prepare(S, "c", "w1");
    h.on(Input::Recipe(edit(S, "c", 2)));
    assert!(h.on(Input::Evict { worker: "w1".into() }).is_empty(), "not mid-preparation");
    let cmds = h.on(Input::Prepared { key: (S, "c".into()), result: Ok((worker("w1"), 10.0)) });
    assert_eq!(ended(&cmds), vec![PreparedOutcome::Evicted]);
}

#[test]
fn eviction_after_a_run_claimed_the_worker_is_too_late() {
    let mut h = host(1);
    h.prepare(S, "c", "w1");
    h.run_settled(run(S2, "x", 1), Claim::Won);
    h.run_settled(run(S, "c", 7), Claim::Won);
    assert!(h.on(Input::Evict { worker: "w1".into() }).is_empty());
}

#[test]
fn a_run_naming_another_hosts_prepared_worker_waits_for_that_host_first() {
    let mut h = host(1);
    let r = RecipeV3 { prepared: Some(PreparedAt { host: "h2".into(), worker: "w9".into() }), ..run(S, "c", 7) };
    let cmds = h.on(Input::Recipe(r));
    assert!(no_claim(&cmds));
    let (delay, input) = after(&cmds).expect("a fallback");
    assert_eq!(delay, PREPARED_FALLBACK);
    assert!(matches!(input, Input::Retry(r) if r.prepared.is_none()));
}

#[test]
fn a_run_naming_a_host_that_said_it_is_full_is_competed_for_at_once() {
    let mut h = host(1);
    h.on(Input::PeerStatus { host: "h2".into(), free_slots: 0 });
    let r = RecipeV3 { prepared: Some(PreparedAt { host: "h2".into(), worker: "w9".into() }), ..run(S, "c", 7) };
    let cmds = h.on(Input::Recipe(r));
    assert!(after(&cmds).is_none(), "no waiting for a host with no room: {cmds:?}");
    assert_eq!(Host::claim_in(&cmds).1, ClaimKey::Run(exec(7)));
}

#[test]
fn a_full_host_leaves_the_run_of_its_prepared_worker_to_a_host_with_room() {
    let mut h = host(1);
    h.prepare(S, "c", "w1");
    h.run_settled(run(S2, "x", 1), Claim::Won);
    h.on(Input::PeerStatus { host: "h2".into(), free_slots: 1 });
    let cmds = h.on(Input::Recipe(run(S, "c", 7)));
    assert!(no_claim(&cmds), "no claim at once for a run it cannot start: {cmds:?}");
    assert_eq!(h.core.run_state(exec(7)), Some(&RunState::Pending));
    // with no room anywhere else it takes the run, to start on its worker
    let mut h = host(1);
    h.prepare(S, "c", "w1");
    h.run_settled(run(S2, "x", 1), Claim::Won);
    h.on(Input::PeerStatus { host: "h2".into(), free_slots: 0 });
    let cmds = h.on(Input::Recipe(run(S, "c", 7)));
    assert_eq!(Host::claim_in(&cmds), (Host::claim_in(&cmds).0, ClaimKey::Run(exec(7)), Duration::ZERO));
    // with no room anywhere, runs already waiting here go first
    let mut h = host(1);
    h.prepare(S, "c", "w1");
    h.run_settled(run(S2, "x", 1), Claim::Won);
    h.on(Input::Recipe(run(S2, "y", 2)));
    assert_eq!(h.core.run_state(exec(2)), Some(&RunState::Pending));
    let cmds = h.on(Input::Recipe(run(S, "c", 7)));
    assert!(no_claim(&cmds), "not ahead of y: {cmds:?}");
    let cmds = h.on(executed(1, None, &[], false));
    assert_eq!(Host::claim_in(&cmds).1, ClaimKey::Run(exec(2)), "the freed slot goes to y first");
    // a worker prepared on its slot has its room, whatever the peers have
    let mut h = host_holding(1);
    h.prepare(S, "c", "w1");
    h.on(Input::PeerStatus { host: "h2".into(), free_slots: 1 });
    let cmds = h.on(Input::Recipe(run(S, "c", 7)));
    assert_eq!(Host::claim_in(&cmds).2, Duration::ZERO, "its own slot: claimed at once");
}

// ---------------------------------------------------------------- after a cell

#[test]
fn a_worker_holding_unsavable_gpu_state_is_kept_with_its_slot() {
    let mut h = host(1);
    h.run_settled(run(S, "c", 1), Claim::Won);
    let cmds = h.on(executed(1, Some("w1"), &["m"], true));
    assert!(stopped(&cmds).is_empty() && released(&cmds).is_empty());
    assert_eq!(h.slot(0), SlotState::Pinned { worker: "w1".into(), session: S });
    assert!(h.core.keeps("w1"));
    assert!(cmds.iter().any(|c| matches!(c, Command::Enter { worker, state: WorkerState::Kept } if worker == "w1")));
}

#[test]
fn a_worker_holding_unsavable_cpu_state_is_kept_but_its_slot_freed() {
    let mut h = host(1);
    h.run_settled(run(S, "c", 1), Claim::Won);
    let cmds = h.on(executed(1, Some("w1"), &["f"], false));
    assert_eq!(released(&cmds), vec![(0, SlotUse::Cell)]);
    assert!(h.core.keeps("w1"));
}

#[test]
fn a_cell_pinned_to_a_kept_worker_runs_there_with_lent_slots() {
    let mut h = host(1);
    h.run_settled(run(S, "a", 1), Claim::Won);
    h.on(executed(1, Some("w1"), &["f"], false));
    let pinned = PinnedWorker { host: "h1".into(), worker: "w1".into(), names: vec!["f".into()] };
    let cmds = h.run_settled(RecipeV3 { pinned: Some(pinned), ..run(S, "b", 2) }, Claim::Won);
    let target = Target::Existing { worker: "w1".into(), prepare: Prepare::Pinned, slots: vec![0] };
    assert_eq!(executes(&cmds).map(|e| e.1), Some(target));
    // it used CUDA on the lent slot: the slot stays with it
    h.on(executed(2, Some("w1"), &["f"], true));
    assert_eq!(h.slot(0), SlotState::Pinned { worker: "w1".into(), session: S });
}

#[test]
fn a_kept_worker_with_nothing_unsavable_left_is_stopped() {
    let mut h = host(1);
    h.run_settled(run(S, "a", 1), Claim::Won);
    h.on(executed(1, Some("w1"), &["m"], true));
    let pinned = PinnedWorker { host: "h1".into(), worker: "w1".into(), names: vec!["m".into()] };
    h.run_settled(RecipeV3 { pinned: Some(pinned), ..run(S, "b", 2) }, Claim::Won);
    let cmds = h.on(executed(2, Some("w1"), &[], true));
    assert_eq!(stopped(&cmds), vec!["w1"]);
    assert_eq!(released(&cmds), vec![(0, SlotUse::UnsavableState)]);
    assert!(!h.core.keeps("w1"));
}

#[test]
fn a_pinned_run_whose_worker_is_gone_and_needs_none_of_it_runs_as_any_other() {
    let mut h = host(1);
    let pinned = PinnedWorker { host: "h1".into(), worker: "gone".into(), names: vec![] };
    let cmds = h.run_settled(RecipeV3 { pinned: Some(pinned), ..run(S, "b", 2) }, Claim::Won);
    assert_eq!(executes(&cmds).map(|e| e.1), Some(Target::Fresh { slots: vec![0] }));
}

#[test]
fn a_pinned_run_whose_worker_is_gone_and_needs_it_fails_on_a_fresh_worker() {
    let mut h = host(1);
    let pinned = PinnedWorker { host: "h1".into(), worker: "gone".into(), names: vec!["m".into()] };
    let cmds = h.run_settled(RecipeV3 { pinned: Some(pinned), ..run(S, "b", 2) }, Claim::Won);
    assert_eq!(executes(&cmds).map(|e| e.1), Some(Target::Fresh { slots: vec![] }), "it fails naming m");
}

#[test]
fn a_run_pinned_to_another_host_is_not_this_hosts() {
    let mut h = host(1);
    let pinned = PinnedWorker { host: "h2".into(), worker: "w9".into(), names: vec!["m".into()] };
    assert!(no_claim(&h.on(Input::Recipe(RecipeV3 { pinned: Some(pinned), ..run(S, "b", 2) }))));
}

#[test]
fn a_cpu_run_claims_the_sessions_cpu_worker_and_keeps_it() {
    let mut h = host(1);
    let cmds = h.on(Input::Recipe(cpu_run(S, "c", 1)));
    let (ticket, key, _) = Host::claim_in(&cmds);
    assert_eq!(key, ClaimKey::Cpu(S));
    let cmds = h.on(Input::Claimed { ticket, claim: Claim::Won });
    let (ticket, key, _) = Host::claim_in(&cmds);
    assert_eq!(key, ClaimKey::Run(exec(1)), "the run is claimed too");
    let cmds = h.on(Input::Claimed { ticket, claim: Claim::Won });
    assert_eq!(executes(&cmds).map(|e| e.1), Some(Target::Fresh { slots: vec![] }));
    h.on(executed(1, Some("cpu1"), &[], false));
    assert_eq!(h.core.cpu_sessions(), vec![S]);
    let cmds = h.run_settled(cpu_run(S, "d", 2), Claim::Won);
    let target = Target::Existing { worker: "cpu1".into(), prepare: Prepare::Persistent, slots: vec![] };
    assert_eq!(executes(&cmds).map(|e| e.1), Some(target));
}

#[test]
fn a_cpu_run_whose_worker_lives_on_a_lost_host_is_claimed_on_a_tick() {
    let mut h = host(1);
    h.on(Input::PeerStatus { host: "h2".into(), free_slots: 0 });
    let (ticket, _, _) = Host::claim_in(&h.on(Input::Recipe(cpu_run(S, "c", 1))));
    h.on(Input::Claimed { ticket, claim: Claim::Lost });
    assert_eq!(h.core.run_state(exec(1)), Some(&RunState::ForCpuHost));
    assert!(no_claim(&h.on(Input::Tick)), "h2 is alive");
    h.clock.advance(peers::PEER_STALE + Duration::from_secs(1));
    let cmds = h.on(Input::Tick);
    let claim = cmds.iter().find_map(|c| match c {
        Command::Claim { key, live, .. } => Some((key.clone(), live.clone())),
        _ => None,
    });
    let (key, live) = claim.expect("claimed again");
    assert_eq!(key, ClaimKey::Cpu(S));
    assert_eq!(live, Some(HashSet::from(["h1".to_string()])), "h2 is not among the live hosts");
}

#[test]
fn a_cpu_claim_lost_to_another_host_stops_this_hosts_cpu_worker() {
    let mut h = host(1);
    let (ticket, _, _) = Host::claim_in(&h.on(Input::Recipe(cpu_run(S, "c", 1))));
    let (ticket, _, _) = Host::claim_in(&h.on(Input::Claimed { ticket, claim: Claim::Won }));
    h.on(Input::Claimed { ticket, claim: Claim::Won });
    h.on(executed(1, Some("cpu1"), &[], false));
    let cmds = h.on(Input::ClaimsLost(vec![ClaimKey::Cpu(S)]));
    assert_eq!(stopped(&cmds), vec!["cpu1"]);
    assert!(h.core.cpu_sessions().is_empty());
}

#[test]
fn a_worker_kept_warm_holds_its_slot_and_serves_a_rerun() {
    let mut h = host_with(1, Policy { keep_warm: true, prepare_holds_slot: false });
    h.run_settled(run(S, "c", 1), Claim::Won);
    let cmds = h.on(executed(1, Some("w1"), &[], true));
    assert_eq!(released(&cmds), vec![(0, SlotUse::Cell)], "the cell's slot time ends");
    assert!(matches!(h.slot(0), SlotState::Prepared { .. }));
    let cmds = h.run_settled(run(S, "c", 2), Claim::Won);
    let target = Target::Existing { worker: "w1".into(), prepare: Prepare::Warm, slots: vec![0] };
    assert_eq!(executes(&cmds).map(|e| e.1), Some(target));
}

#[test]
fn a_lost_worker_frees_its_slot() {
    let mut h = host(1);
    h.run_settled(run(S, "c", 1), Claim::Won);
    let cmds = h.on(executed(1, None, &[], false));
    assert!(stopped(&cmds).is_empty(), "already gone");
    assert_eq!(h.slot(0), SlotState::Free);
    assert_eq!(h.core.running(), 0);
}

// ---------------------------------------------------------------- sessions

#[test]
fn interrupting_a_run_waiting_unclaimed_drops_it() {
    let mut h = host(1);
    h.run_settled(run(S2, "a", 1), Claim::Won);
    h.on(Input::Recipe(run(S, "c", 2)));
    let cmds = h.on(Input::Interrupt { session: S, exec_id: exec(2) });
    assert!(cmds.iter().any(|c| matches!(c, Command::Interrupt { exec_id } if *exec_id == exec(2))));
    let cmds = h.on(executed(1, None, &[], false));
    assert!(no_claim(&cmds), "it never starts");
}

#[test]
fn interrupting_a_claimed_run_waiting_for_a_slot_fails_it_now() {
    let mut h = host(1);
    h.run_settled(run(S, "a", 1), Claim::Won);
    h.prepare(S2, "b", "wb");
    h.world.dead.insert("wb".into());
    h.run_settled(run(S2, "b", 2), Claim::Won);
    assert_eq!(h.core.run_state(exec(2)), Some(&RunState::Won));
    let cmds = h.on(Input::Interrupt { session: S2, exec_id: exec(2) });
    assert!(cmds
        .iter()
        .any(|c| matches!(c, Command::Event { exec_id, kind: EventKind::Failed { .. }, .. } if *exec_id == exec(2))));
    let cmds = h.on(executed(1, None, &[], false));
    assert!(executes(&cmds).is_none());
}

#[test]
fn closing_a_session_kills_its_cells_and_ends_its_workers() {
    let mut h = host_holding(2);
    h.prepare(S, "p", "wp");
    h.run_settled(cpu_run(S, "c", 9), Claim::Won);
    let (ticket, _, _) = Host::claim_in(&h.on(Input::Recipe(cpu_run(S, "k", 1))));
    let (ticket, _, _) = Host::claim_in(&h.on(Input::Claimed { ticket, claim: Claim::Won }));
    h.on(Input::Claimed { ticket, claim: Claim::Won });
    h.on(executed(1, Some("cpu1"), &[], false));
    let cmds = h.on(Input::SessionClosed { session: S });
    assert!(cmds.iter().any(|c| matches!(c, Command::KillCells { session } if *session == S)));
    let mut stops = stopped(&cmds);
    stops.sort();
    assert_eq!(stops, vec!["cpu1", "wp"]);
    assert_eq!(ended(&cmds), vec![PreparedOutcome::SessionClosed]);
    assert!(cmds.iter().any(|c| matches!(c, Command::Release { key: ClaimKey::Cpu(s) } if *s == S)));
    assert!(cmds.iter().any(|c| matches!(c, Command::ReleaseUid { session } if *session == S)));
}

#[test]
fn an_idle_session_stops_its_kept_workers_but_not_its_prepared_ones() {
    let mut h = host_holding(2);
    h.prepare(S, "p", "wp");
    h.run_settled(run(S, "a", 1), Claim::Won);
    h.on(executed(1, Some("w1"), &["m"], true));
    let cmds = h.on(Input::SessionIdle { session: S });
    assert_eq!(stopped(&cmds), vec!["w1"]);
    assert_eq!(released(&cmds), vec![(1, SlotUse::UnsavableState)]);
    assert!(ended(&cmds).is_empty());
}

#[test]
fn a_tick_renews_every_claim_this_host_holds() {
    let mut h = host(2);
    h.run_settled(run(S, "a", 1), Claim::Won);
    h.on(Input::Recipe(run(S2, "b", 2)));
    let cmds = h.on(Input::Tick);
    let keys = cmds.iter().find_map(|c| match c {
        Command::Renew { keys } => Some(keys.clone()),
        _ => None,
    });
    assert_eq!(keys, Some(vec![ClaimKey::Run(exec(1))]), "the run it holds; not one it is still claiming");
    assert!(cmds.iter().any(|c| matches!(c, Command::PublishStatus)));
}

#[test]
fn a_stopping_host_takes_nothing_new() {
    let mut h = host(1);
    h.on(Input::Stopping);
    assert!(h.on(Input::Recipe(run(S, "c", 1))).is_empty());
    assert!(h.on(Input::Recipe(edit(S, "d", 1))).is_empty());
}

#[test]
fn a_stopping_host_ends_the_prepared_workers_no_run_claimed() {
    let mut h = host(2);
    h.prepare(S, "idle", "w1");
    h.prepare(S2, "taken", "w2");
    h.run_settled(run(S2, "taken", 7), Claim::Won);
    let cmds = h.on(Input::Stopping);
    assert_eq!(ended(&cmds), vec![PreparedOutcome::Evicted], "the planner hears of the idle one");
    assert_eq!(stopped(&cmds), vec!["w1"], "the worker running its cell is left to finish");
    assert!(h.core.prepared_worker(&(S, "idle".into())).is_none());
}

#[test]
fn a_cordoned_host_runs_only_the_cells_of_the_workers_it_holds() {
    let mut h = host(2);
    h.prepare(S, "c", "w1");
    h.on(Input::Cordon(true));
    assert!(h.on(Input::Recipe(edit(S2, "d", 1))).is_empty(), "no new preparation");
    assert!(h.on(Input::Recipe(run(S2, "x", 1))).is_empty(), "no cold run");
    assert!(!h.core.holds_nothing(), "its prepared worker");
    let cmds = h.run_settled(run(S, "c", 7), Claim::Won);
    let target = Target::Existing { worker: "w1".into(), prepare: Prepare::Speculative, slots: vec![0] };
    assert_eq!(executes(&cmds).map(|e| e.1), Some(target), "the prepared worker's run");
    h.on(executed(7, None, &[], false));
    assert!(h.core.holds_nothing(), "released once its cell is saved");
    h.on(Input::Cordon(false));
    assert!(!no_claim(&h.on(Input::Recipe(run(S2, "x", 2)))), "uncordoned, it takes work again");
}

#[test]
fn a_stopped_host_stops_every_worker_it_keeps_or_prepared() {
    let mut h = host_holding(2);
    h.prepare(S, "p", "wp");
    h.run_settled(run(S, "a", 1), Claim::Won);
    h.on(executed(1, Some("w1"), &["m"], true));
    let cmds = h.on(Input::Stopped);
    let mut stops = stopped(&cmds);
    stops.sort();
    assert_eq!(stops, vec!["w1", "wp"]);
}

#[test]
fn a_prepared_worker_phase_is_what_the_host_still_has_to_do() {
    let mut h = host_holding(1);
    h.prepare(S, "c", "w1");
    assert!(matches!(h.core.prepared_worker(&(S, "c".into())).map(|p| p.2.clone()), Some(Phase::Ready)));
    h.on(Input::Recipe(edit(S, "c", 2)));
    assert!(matches!(h.core.prepared_worker(&(S, "c".into())).map(|p| p.2.clone()), Some(Phase::Preparing { .. })));
}
