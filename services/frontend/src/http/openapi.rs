//! What the API says about itself, without a token: whether it answers (health),
//! and its OpenAPI description, derived from every handler.

use axum::extract::State;
use axum::Json;

// `paths(...)` below names each handler's `#[utoipa::path]` struct (`__path_<fn>`):
// imported here, unqualified, so that no operation gets a module-path tag
use super::cpu_worker::{__path_comm, __path_complete, __path_inspect};
use super::runs::{__path_edit, __path_input, __path_interrupt, __path_run};
use super::sessions::{
    __path_checkout_session, __path_create_session, __path_delete_session, __path_detach_session, __path_fork_session,
    __path_list_discards, __path_list_sessions, __path_resume_session, __path_summary, __path_undo_session,
};
use super::state::AppState;
use super::streams::{__path_dashboard, __path_events};
use super::usage::__path_usage;
use crate::api::{ApiErrorBody, Health};

/// Whether the frontend answers (no token needed: for probes).
#[utoipa::path(get, path = "/v1/health", security(()), responses((status = 200, body = Health)))]
pub(super) async fn health(State(state): State<AppState>) -> Json<Health> {
    let sessions = state.sessions.read().unwrap_or_else(|e| e.into_inner()).len();
    Json(Health { status: "ok".into(), sessions })
}

/// The API's OpenAPI description, derived from the handlers and the client
/// crate's types (`docs/api.md` explains it in words).
#[derive(utoipa::OpenApi)]
#[openapi(
    info(title = "LooseLeaf frontend API", version = "1", description = "Sessions, edits, runs and their event stream"),
    paths(health, openapi_json, create_session, list_sessions, list_discards, usage, summary, delete_session, detach_session, resume_session, undo_session, checkout_session, fork_session, edit, run, interrupt, input, complete, inspect, comm, events, dashboard),
    components(schemas(ApiErrorBody)),
    modifiers(&Errors),
    security(("bearer" = []))
)]
pub struct ApiDoc;

/// Every error an operation may answer, with the JSON body all errors share, and
/// the bearer scheme.
struct Errors;

impl utoipa::Modify for Errors {
    fn modify(&self, api: &mut utoipa::openapi::OpenApi) {
        use utoipa::openapi::{security, ContentBuilder, Ref, ResponseBuilder};
        let components = api.components.get_or_insert_with(Default::default);
        let bearer = security::HttpBuilder::new().scheme(security::HttpAuthScheme::Bearer).build();
        components.add_security_scheme("bearer", security::SecurityScheme::Http(bearer));
        let errors = [
            ("400", "the request is malformed (the message names what)"),
            ("401", "no token, or not a token of this API (nor of the JupyterHub it serves, which then adds `login`)"),
            ("403", "a browser origin not allowed, another user's usage asked by one who is not an admin, or a JupyterHub token without this service's access scope"),
            ("404", "no such session (or another user's)"),
            ("408", "the body did not arrive in time"),
            ("409", "the session is not in the state asked (resume of one in use, detach of one going away, undo with a cell running or nothing to undo)"),
            ("410", "the session is closing"),
            ("413", "the body is larger than the limit"),
            ("415", "the body is not JSON"),
            ("421", "a Host this API does not answer"),
            ("429", "a limit (sessions per user, queued runs) is reached"),
            ("500", "the frontend could not do it (it says why)"),
            ("503", "a service it needs (NATS, the store, the JupyterHub it serves) did not answer in time"),
        ];
        for item in api.paths.paths.values_mut() {
            let operations = [&mut item.get, &mut item.put, &mut item.post, &mut item.delete];
            for op in operations.into_iter().flatten() {
                for (code, why) in errors {
                    let body = ContentBuilder::new().schema(Some(Ref::from_schema_name("ApiErrorBody"))).build();
                    let response = ResponseBuilder::new().description(why).content("application/json", body).build();
                    op.responses.responses.entry(code.to_string()).or_insert(response.into());
                }
            }
        }
    }
}

/// This API's OpenAPI description (no token needed).
#[utoipa::path(get, path = "/v1/openapi.json", security(()), responses((status = 200, description = "OpenAPI 3.1", content_type = "application/json")))]
pub(super) async fn openapi_json() -> Json<utoipa::openapi::OpenApi> {
    use utoipa::OpenApi as _;
    Json(ApiDoc::openapi())
}
