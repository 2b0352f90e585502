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
        match self {
            Role::Frontend => {
                publish.extend([
                    s.all_edits(),
                    s.all_runs(),
                    s.all_closes(),
                    s.all_idles(),
                    s.all_interrupts(),
                    s.store(StoreVerb::Settle),
                    s.store(StoreVerb::SessionDelete),
                    "$JS.API.INFO".into(),
                ]);
                publish.extend(bucket(&buckets::sessions_bucket(prefix)));
                publish.extend(bucket(&buckets::claims_bucket(prefix)));
                publish.extend(jetstream_on(&s.events_stream()));
                publish.extend(jetstream_on(&s.outputs_stream()));
                subscribe.extend([s.all_events(), s.all_outputs(), s.all_host_status()]);
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
                    s.all_interrupts(),
                    s.all_events(),
                    s.all_host_status(),
                    s.host_command("*", HostVerb::Evict),
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
    use std::path::Path;
    use std::time::Duration;

    use futures::StreamExt as _;

    use super::*;
    use crate::local_nats::{self, LocalNats, NatsUser};

    const PREFIX: &str = "perm";

    async fn as_user(nats: &LocalNats, user: &NatsUser) -> async_nats::Client {
        let url = nats.url_for(user);
        crate::bus::connect_with_login(&url, async_nats::ConnectOptions::new()).await.unwrap()
    }

    /// Whether `who` publishing on `subject` reaches a subscriber allowed everything.
    async fn reaches(watcher: &async_nats::Client, who: &async_nats::Client, subject: String) -> bool {
        let mut sub = watcher.subscribe(subject.clone()).await.unwrap();
        watcher.flush().await.unwrap();
        who.publish(subject, "x".into()).await.unwrap();
        let _ = who.flush().await;
        tokio::time::timeout(Duration::from_millis(500), sub.next()).await.is_ok()
    }

    /// Whether a subscription of `who` on `subject` gets what the operator publishes.
    async fn hears(operator: &async_nats::Client, who: &async_nats::Client, subject: String) -> bool {
        let Ok(mut sub) = who.subscribe(subject.clone()).await else { return false };
        let _ = who.flush().await;
        tokio::time::sleep(Duration::from_millis(100)).await; // a refused subscribe is answered async
        operator.publish(subject, "x".into()).await.unwrap();
        operator.flush().await.unwrap();
        tokio::time::timeout(Duration::from_millis(500), sub.next()).await.is_ok_and(|m| m.is_some())
    }

    /// Each service reaches exactly what its role uses: a host cannot send runs,
    /// read edits or delete sessions; the frontend cannot commit; the planner
    /// cannot read the claims; requests and their answers work for each.
    #[tokio::test]
    async fn each_service_reaches_only_what_its_role_uses() {
        let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        let dir = tempfile::tempdir().unwrap();
        let roles = [Role::Frontend, Role::Planner, Role::Store, Role::GpuHost];
        let mut users: Vec<NatsUser> = roles.iter().map(|r| NatsUser::service(*r, PREFIX)).collect();
        users.push(NatsUser::new("operator"));
        let nats = match LocalNats::start_with_users(&local_nats::binary(None, &repo), &dir.path().join("n"), &users) {
            Ok(n) => n,
            Err(e) => panic!("nats-server (run scripts/setup): {e}"),
        };
        let [frontend, planner, store, host, operator] = [0, 1, 2, 3, 4].map(|i| users[i].clone());
        let (frontend, planner, store, host, operator) = (
            as_user(&nats, &frontend).await,
            as_user(&nats, &planner).await,
            as_user(&nats, &store).await,
            as_user(&nats, &host).await,
            as_user(&nats, &operator).await,
        );
        let s = Subjects::new(PREFIX);
        let sid = uuid::Uuid::now_v7();

        assert!(reaches(&operator, &frontend, s.run(sid)).await, "the frontend sends runs");
        assert!(!reaches(&operator, &host, s.run(sid)).await, "a host cannot send runs");
        assert!(!reaches(&operator, &frontend, s.store(StoreVerb::Commit)).await, "the frontend cannot commit");
        assert!(reaches(&operator, &host, s.store(StoreVerb::Commit)).await, "a host commits");
        assert!(!reaches(&operator, &host, s.store(StoreVerb::SessionDelete)).await, "a host cannot delete sessions");
        assert!(!reaches(&operator, &store, s.event(sid)).await, "the store sends no events");
        assert!(hears(&operator, &planner, s.edit(sid)).await, "the planner reads edits");
        assert!(!hears(&operator, &host, s.edit(sid)).await, "a host cannot read edits (users' code)");
        assert!(!hears(&operator, &store, s.output(sid, sid)).await, "the store cannot read outputs");
        assert!(!hears(&operator, &planner, format!("{}.x", inbox_prefix("frontend"))).await, "nor another's answers");

        // a request of the host, answered by the store, comes back to the host's inbox
        let mut requests = store.subscribe(s.store(StoreVerb::ManifestGet)).await.unwrap();
        store.flush().await.unwrap();
        let answer = tokio::spawn(async move {
            let req = requests.next().await.unwrap();
            store.publish(req.reply.unwrap(), "answer".into()).await.unwrap();
            store.flush().await.unwrap();
        });
        let reply = host.request(s.store(StoreVerb::ManifestGet), "q".into()).await.unwrap();
        assert_eq!(&reply.payload[..], b"answer");
        answer.await.unwrap();

        // JetStream: the frontend makes and reads its buckets; the planner cannot read the claims
        let claims = buckets::claims(&async_nats::jetstream::new(frontend.clone()), PREFIX).await.unwrap();
        claims.put("run-x", "host-0".into()).await.unwrap();
        assert!(buckets::claims(&async_nats::jetstream::new(host.clone()), PREFIX).await.is_ok(), "hosts claim");
        let js = async_nats::jetstream::new(planner.clone());
        assert!(js.get_key_value(buckets::claims_bucket(PREFIX)).await.is_err(), "the planner cannot read claims");
        assert!(buckets::planner(&js, PREFIX).await.is_ok(), "the planner keeps its state");
    }
}
