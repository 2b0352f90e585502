//! Edits: debounced per cell, each planned into a speculative recipe when it
//! changed, marked for preparation if the speculator admits it (evicting what it
//! must).

use std::collections::BTreeMap;
use std::sync::Arc;

use actix::prelude::*;
use schemas::bus::Rejected;
use schemas::checkpoint::Manifest;
use schemas::messages::{Device, EditV1, EvictV1, PreparedWorker, RecipeKind};
use schemas::subjects::HostVerb;
use schemas::Envelope;
use tracing::Instrument;
use uuid::Uuid;

use super::plan::{code_hash, planned, recipe, For};
use super::Planner;
use crate::analysis;
use crate::recipe::derive;
use crate::speculator::Eviction;
use crate::state;

impl Planner {
    pub(super) fn send_evictions(&mut self, evictions: Vec<Eviction>, ctx: &mut Context<Self>) {
        for e in evictions {
            tracing::info!(session = %e.session, cell = %e.cell_id, host = %e.at.host, worker = %e.at.worker, reason = e.reason, "evicting a prepared worker");
            let bus = self.bus.clone();
            let msg = EvictV1 { session: e.session, worker: e.at.worker.clone(), reason: e.reason.to_string() };
            let subject = bus.subjects().host_command(&e.at.host, HostVerb::Evict);
            ctx.spawn(
                async move {
                    if let Err(err) = bus.publish(subject, &msg).await {
                        tracing::warn!(error = %err, "could not send an eviction");
                    }
                }
                .into_actor(self),
            );
        }
    }

    /// Plan the newest edit of a cell once its debounce timer fires.
    fn plan_edit(&mut self, key: (Uuid, String), ctx: &mut Context<Self>) {
        let Some((edit, span)) = self.pending_edits.remove(&key) else { return };
        let _entered = span.enter(); // the preparation continues the newest edit's trace
        let (manifest, st) = self
            .manifests
            .get(&edit.session)
            .cloned()
            .unwrap_or_else(|| (Arc::new(Manifest::empty(edit.session)), Arc::new(state::SessionState::default())));
        let analysis = analysis::analyze(&edit.code);
        // planned since its last run (a run forgets the fingerprint)
        let planned_since_run = matches!(self.speculative.get(&key), Some((_, Some(_))));
        if analysis.syntax_error && planned_since_run {
            // Half-typed text (an open bracket, a dangling operator): its conservative
            // closure is the whole session, gigabytes restored for a moment's text.
            // The cell's preparation for its last text that parsed stays.
            tracing::debug!(session = %edit.session, cell = %edit.cell_id, "an edit that does not parse is not planned");
            return;
        }
        // What the last run knew (function summaries included); edits change nothing stored.
        let d = derive(&analysis, &edit.code, &manifest, &st, edit.options.all_gpu, Uuid::nil(), &edit.cell_id);
        self.edit_demand(edit.session, &edit.cell_id, &d, &manifest);
        let fp = d.fingerprint();
        let revision = match self.speculative.get(&key) {
            Some((_, old)) if *old == Some(fp) => return,
            Some((rev, _)) => rev + 1,
            None => 1,
        };
        self.speculative.insert(key, (revision, Some(fp)));
        let speculate = if d.device == Device::Gpu && edit.options.speculate && d.pinned.is_none() {
            let now = self.now();
            let admission = self.speculator.admit(edit.session, &edit.cell_id, now);
            if let Some(why) = admission.refused {
                tracing::debug!(session = %edit.session, cell = %edit.cell_id, why, "not preparing");
            }
            self.send_evictions(admission.evict, ctx);
            admission.admit
        } else {
            false
        };
        let target = For {
            session: edit.session,
            cell_id: edit.cell_id,
            kind: RecipeKind::Speculative,
            exec_id: Uuid::nil(),
            code: edit.code,
            run_unix_ms: 0,
            options: edit.options,
            user_expressions: BTreeMap::new(),
        };
        let planned = planned(target.session, Uuid::nil(), &target.cell_id, &d);
        // the host that holds the cell's worker updates it; others leave the recipe
        let holder = self.speculator.held_on(target.session, &target.cell_id);
        let at = holder.map(|host| PreparedWorker { host, worker: String::new() });
        let mut r = recipe(target, revision, manifest.revision, &d, at);
        r.speculate = speculate;
        let bus = self.bus.clone();
        ctx.spawn(
            async move {
                // for the cell's badge (informational: a lost one costs nothing)
                if let Err(e) = bus.publish(bus.subjects().event(r.session), &planned).await {
                    tracing::debug!(error = %e, "could not publish an edit's plan");
                }
                if let Err(e) = bus.publish(bus.subjects().recipe(r.session), &r).await {
                    tracing::warn!(error = %e, "could not publish a speculative recipe");
                }
            }
            .instrument(span.clone())
            .into_actor(self),
        );
    }
}

impl StreamHandler<Result<Envelope<EditV1>, Rejected>> for Planner {
    fn handle(&mut self, item: Result<Envelope<EditV1>, Rejected>, ctx: &mut Self::Context) {
        let Ok(env) = item else { return };
        let span = env.span("planner.edit");
        let edit = env.msg;
        let key = (edit.session, edit.cell_id.clone());
        if self.pending_edits.get(&key).is_some_and(|(p, _)| p.seq > edit.seq) {
            return; // arrived out of order
        }
        // A blank cell needs no worker (an editor may send one as a cell is added).
        if edit.code.trim().is_empty() {
            return;
        }
        // The text that just ran (an editor's last edit, sent as Run was pressed):
        // a worker prepared for it would wait for a second Run no one asked for.
        match self.ran_code.get(&key) {
            Some(ran) if *ran == code_hash(&edit.code) => return,
            Some(_) => {
                self.ran_code.remove(&key);
            }
            None => {}
        }
        // Trailing-edge debounce: the first edit starts the timer, later ones replace
        // the text it will plan, so typing yields a recipe at most once per interval.
        if self.pending_edits.insert(key.clone(), (edit, span)).is_none() {
            ctx.run_later(self.debounce, move |act, ctx| act.plan_edit(key, ctx));
        }
    }
}
