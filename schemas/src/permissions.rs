//! What each service may publish and subscribe to on NATS: least privilege per
//! role, rendered into nats-server's configuration by `looseleaf up` (ADR 27).
//!
//! Each list names exactly the subjects the service uses (see `subjects`), the
//! JetStream API of the streams and buckets it uses (and no others: a planner
//! cannot read the claims, a host cannot read session records), its own reply
//! inbox (`_INBOX_{user}`: no service reads another's answers), and the service
//! API (`$SRV`). A service that answers requests may publish to their reply
//! subjects only (`allow_responses`).

use crate::buckets;
use crate::subjects::{HostVerb, StoreVerb, Subjects};

/// A service's role on the bus.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// Serves the HTTP API: sends edits and runs, follows events and outputs.
    Frontend,
    /// Turns edits and runs into recipes.
    Planner,
    /// The checkpoint-store gateway: answers manifest gets, plans, commits.
    Store,
    /// Runs cells on its slots.
    GpuHost,
}

/// What one NATS user may do.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Permissions {
    /// Subjects it may publish to.
    pub publish: Vec<String>,
    /// Subjects it may subscribe to.
    pub subscribe: Vec<String>,
}

/// The inbox prefix of `user`'s requests (the client is told to use it; only that
/// user may subscribe under it).
pub fn inbox_prefix(user: &str) -> String {
    format!("_INBOX_{}", user.replace(['.', '*', '>', ' '], "_"))
}

/// The JetStream API subjects for using stream `stream`: info, create (get or
/// create at start), reading messages, and consumers (watches, replays). Not
/// delete, purge or update.
fn jetstream_on(stream: &str) -> Vec<String> {
    [
        format!("$JS.API.STREAM.INFO.{stream}"),
        format!("$JS.API.STREAM.CREATE.{stream}"),
        format!("$JS.API.STREAM.MSG.GET.{stream}"),
        format!("$JS.API.DIRECT.GET.{stream}"),
        format!("$JS.API.DIRECT.GET.{stream}.>"),
        format!("$JS.API.CONSUMER.CREATE.{stream}"),
        format!("$JS.API.CONSUMER.CREATE.{stream}.>"),
        format!("$JS.API.CONSUMER.INFO.{stream}.>"),
        format!("$JS.API.CONSUMER.DELETE.{stream}.>"),
        format!("$JS.API.CONSUMER.MSG.NEXT.{stream}.>"),
        format!("$JS.ACK.{stream}.>"),
        format!("$JS.FC.{stream}.>"),
    ]
    .into()
}

/// A key-value bucket: its stream's API and writing its keys.
fn bucket(name: &str) -> Vec<String> {
    let mut p = jetstream_on(&format!("KV_{name}"));
    p.push(format!("$KV.{name}.>"));
    p
}

/// The message-bodies bucket (ADR 30): every service sends and receives bodies,
/// and deletes the bodies of replies it read (a purge of the bucket's stream).
fn bodies(prefix: &str) -> Vec<String> {
    let name = buckets::bodies_bucket(prefix);
    let mut p = jetstream_on(&format!("OBJ_{name}"));
    p.push(format!("$JS.API.STREAM.PURGE.OBJ_{name}"));
    p.push(format!("$O.{name}.>"));
    p
}

impl Role {
    /// The NATS user name of the role.
    pub fn user(self) -> &'static str {
        match self {
            Role::Frontend => "frontend",
            Role::Planner => "planner",
            Role::Store => "store",
            Role::GpuHost => "gpu-host",
        }
    }

    /// What the role may do under subject prefix `prefix`.
    pub fn permissions(self, prefix: &str) -> Permissions {
        let s = Subjects::new(prefix);
        // every service: round trips through the server, `$JS.API.INFO`, its inbox, `$SRV`
        let mut publish = vec![format!("{prefix}.v1.sync.>")];
        let mut subscribe = vec![format!("{}.>", inbox_prefix(self.user())), "$SRV.>".into()];
        publish.extend(bodies(prefix));
        match self {
            Role::Frontend => {
                publish.extend([
                    s.all_edits(),
                    s.all_runs(),
                    s.all_closes(),
                    s.all_idles(),
                    s.host_command("*", HostVerb::Interrupt),
                    s.host_command("*", HostVerb::Input),
                    s.host_command("*", HostVerb::Query),
                    s.host_command("*", HostVerb::Comm),
                    s.store(StoreVerb::Settle),
                    s.store(StoreVerb::SessionDelete),
                    // what a resumed session holds, and whether all of it is there
                    s.store(StoreVerb::ManifestGet),
                    s.store(StoreVerb::Check),
                    // undo, checkout and fork
                    s.store(StoreVerb::Revert),
                    s.store(StoreVerb::Fork),
                    "$JS.API.INFO".into(),
                ]);
                publish.extend(bucket(&buckets::sessions_bucket(prefix)));
                publish.extend(bucket(&buckets::usage_bucket(prefix)));
                publish.extend(bucket(&buckets::claims_bucket(prefix)));
                publish.extend(jetstream_on(&s.events_stream()));
                publish.extend(jetstream_on(&s.outputs_stream()));
                subscribe.extend([s.all_events(), s.all_outputs(), s.all_host_status(), s.store_pressure()]);
            }
            Role::Planner => {
                publish.extend([
                    s.all_recipes(),
                    s.all_events(),
                    s.host_command("*", HostVerb::Evict),
                    s.store(StoreVerb::ManifestGet),
                    "$JS.API.INFO".into(),
                ]);
                publish.extend(bucket(&buckets::planner_bucket(prefix)));
                subscribe.extend([s.all_edits(), s.all_runs(), s.all_closes(), s.all_events(), s.all_host_status()]);
            }
            Role::Store => {
                subscribe.push(format!("{prefix}.v1.store.>"));
                publish.push(s.store_pressure());
            }
            Role::GpuHost => {
                publish.extend([
                    s.all_events(),
                    s.all_outputs(),
                    s.all_host_status(),
                    s.all_host_bids(),
                    s.store(StoreVerb::ManifestGet),
                    s.store(StoreVerb::ChunkPlan),
                    s.store(StoreVerb::Commit),
                    "$JS.API.INFO".into(),
                ]);
                publish.extend(bucket(&buckets::claims_bucket(prefix)));
                subscribe.extend([
                    s.all_recipes(),
                    s.all_closes(),
                    s.all_idles(),
                    s.all_host_status(),
                    s.host_command("*", HostVerb::Interrupt),
                    s.host_command("*", HostVerb::Input),
                    s.host_command("*", HostVerb::Evict),
                    s.host_command("*", HostVerb::Query),
                    s.host_command("*", HostVerb::Comm),
                ]);
            }
        }
        Permissions { publish, subscribe }
    }
}

/// The `permissions` block of a nats-server user: what is listed, and replies to
/// requests the user received (`allow_responses`: the store's answers, `$SRV`).
pub fn render(p: &Permissions) -> String {
    let list = |subjects: &[String]| subjects.iter().map(|s| format!("\"{s}\"")).collect::<Vec<_>>().join(", ");
    format!(
        "permissions: {{ publish: {{ allow: [{}] }}, subscribe: {{ allow: [{}] }}, allow_responses: true }}",
        list(&p.publish),
        list(&p.subscribe)
    )
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use futures::StreamExt as _;

    use super::*;
    use crate::local_nats::{LocalNats, NatsUser};

    const PREFIX: &str = "perm";

    /// A fresh connection as `user` (after a refused publish or subscribe the
    /// server's error may cost a connection its later messages: each check gets
    /// its own).
    async fn as_user(nats: &LocalNats, user: &NatsUser) -> async_nats::Client {
        let url = nats.url_for(user);
        crate::nats::NatsOptions::url(url).connect("test").await.unwrap()
    }

    /// Whether `who` publishing on `subject` reaches a subscriber allowed everything
    /// (tried a few times, each on a fresh connection: a delivery lost to the
    /// test server's start-up must not read as a refusal; a refusal is every time).
    async fn reaches(nats: &LocalNats, watcher: &async_nats::Client, who: &NatsUser, subject: String) -> bool {
        for _ in 0..5 {
            let who = as_user(nats, who).await;
            let mut sub = watcher.subscribe(subject.clone()).await.unwrap();
            watcher.flush().await.unwrap();
            who.publish(subject.clone(), "x".into()).await.unwrap();
            let _ = who.flush().await;
            if tokio::time::timeout(Duration::from_millis(400), sub.next()).await.is_ok() {
                return true;
            }
        }
        false
    }

    /// Whether a subscription of `who` on `subject` gets what the operator publishes.
    async fn hears(nats: &LocalNats, operator: &async_nats::Client, who: &NatsUser, subject: String) -> bool {
        let who = as_user(nats, who).await;
        let Ok(mut sub) = who.subscribe(subject.clone()).await else { return false };
        let _ = who.flush().await;
        tokio::time::sleep(Duration::from_millis(100)).await; // a refused subscribe is answered async
        operator.publish(subject, "x".into()).await.unwrap();
        operator.flush().await.unwrap();
        tokio::time::timeout(Duration::from_millis(500), sub.next()).await.is_ok_and(|m| m.is_some())
    }

    /// Each service is refused what its role does not use: a host cannot send runs,
    /// read edits or delete sessions; the frontend cannot commit; the store cannot
    /// send events or read outputs; no one reads another's answers; the planner
    /// cannot read the claims. (What each role does use is exercised end to end
    /// by every `looseleaf run` test, whose services run under these permissions.)
    #[tokio::test]
    async fn each_service_is_refused_what_its_role_does_not_use() {
        let dir = tempfile::tempdir().unwrap();
        let [frontend, planner, store, host] =
            [Role::Frontend, Role::Planner, Role::Store, Role::GpuHost].map(|r| NatsUser::service(r, PREFIX));
        let operator = NatsUser::new("operator");
        let users = [frontend.clone(), planner.clone(), store.clone(), host.clone(), operator.clone()];
        let nats = match LocalNats::start_with_users(&crate::locate::nats_server(None), &dir.path().join("n"), &users) {
            Ok(n) => n,
            Err(e) => panic!("nats-server (run scripts/setup): {e}"),
        };
        let op = as_user(&nats, &operator).await;
        let s = Subjects::new(PREFIX);
        let sid = uuid::Uuid::now_v7();

        assert!(!reaches(&nats, &op, &host, s.run(sid)).await, "a host cannot send runs");
        assert!(!reaches(&nats, &op, &frontend, s.store(StoreVerb::Commit)).await, "the frontend cannot commit");
        assert!(!reaches(&nats, &op, &host, s.store(StoreVerb::SessionDelete)).await, "a host cannot delete sessions");
        assert!(!reaches(&nats, &op, &host, s.store(StoreVerb::Revert)).await, "a host cannot move a session's state");
        assert!(!reaches(&nats, &op, &planner, s.store(StoreVerb::Fork)).await, "the planner cannot fork sessions");
        assert!(!reaches(&nats, &op, &store, s.event(sid)).await, "the store sends no events");
        assert!(!reaches(&nats, &op, &planner, s.store(StoreVerb::Commit)).await, "the planner cannot commit");
        assert!(!hears(&nats, &op, &host, s.edit(sid)).await, "a host cannot read edits (users' code)");
        // a host learns claims from the claims bucket and its own subjects (ADR 57)
        assert!(!hears(&nats, &op, &host, s.event(sid)).await, "a host decodes no session's events");
        let input = s.host_command("h1", HostVerb::Input);
        assert!(hears(&nats, &op, &host, input.clone()).await, "a host hears the input meant for it");
        assert!(reaches(&nats, &op, &frontend, input).await, "the frontend sends it");
        assert!(!hears(&nats, &op, &store, s.output(sid, sid)).await, "the store cannot read outputs");
        let others_inbox = format!("{}.x", inbox_prefix("frontend"));
        assert!(!hears(&nats, &op, &planner, others_inbox).await, "nor another's answers");
        let js = async_nats::jetstream::new(as_user(&nats, &planner).await);
        assert!(js.get_key_value(buckets::claims_bucket(PREFIX)).await.is_err(), "the planner cannot read claims");
    }
}
