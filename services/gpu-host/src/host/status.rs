//! What a host says about itself on `host.{hid}.status`, on every change and
//! every tick.

use actix::prelude::*;
use schemas::messages::{HostStatusV2, ZygoteStatus};
use schemas::unix_ms;

use super::Host;

impl Host {
    pub(super) fn status(&self) -> HostStatusV2 {
        let zygotes = match self.env.zygotes.try_lock() {
            Ok(cache) => cache
                .zygotes()
                .map(|z| ZygoteStatus {
                    id: z.id.clone(),
                    packages: z.packages.clone(),
                    cuda_unsafe: z.cuda_unsafe.clone(),
                    pid: z.pid,
                })
                .collect(),
            // a fork holds the cache: report the zygotes as last seen
            Err(_) => self.last_zygotes.clone(),
        };
        HostStatusV2 {
            host: self.env.host_id.clone(),
            slots: self.core.slots().status(|session, cell| self.core.is_preparing(session, cell)),
            real_gpus: self.real_gpus,
            zygotes,
            cpu_sessions: self.core.cpu_sessions(),
            workers: self.env.lifecycle.snapshot(),
            cache_bytes: self.env.chunks.cached_bytes(),
            forks: self.env.forks.load(std::sync::atomic::Ordering::Relaxed),
            unix_ms: unix_ms(),
        }
    }

    pub(super) fn publish_status(&mut self, ctx: &mut Context<Self>) {
        let bus = self.env.bus.clone();
        let status = self.status();
        self.last_zygotes = status.zygotes.clone();
        let slots = &schemas::metrics::metrics().slots;
        for (state, n) in self.core.slots().occupancy() {
            slots.get_or_create(&[("state", state)]).set(n);
        }
        self.background(
            async move {
                if let Err(e) = bus.publish(bus.subjects().host_status(&status.host), &status).await {
                    tracing::warn!(error = %e, "could not publish host status");
                }
            },
            ctx,
        );
    }
}
