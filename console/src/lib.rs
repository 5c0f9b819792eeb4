//! The console (`waybill-console`, a service of the read side): the pipeline live in a browser —
//! commands, events, outbox, relays, stream, projections — every order's events as stored and as
//! upcast, and the event catalog. Pages are maud templates rendered on the server (readable before,
//! and without, the script); the script refreshes the overview from `/console/api/overview` every two
//! seconds and draws its charts. All assets are compiled into the binary. It reads through sessions
//! that cannot write; state-changing actions exist only when it has an operator token, and then
//! require it.

mod actions;
mod assets;
mod catalog;
mod database;
mod html;
mod lists;
mod models;
mod order;
mod overview;
mod pipeline;
mod prometheus;
mod readside;
mod relays;
mod stream;
mod upstream;

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::Duration;

use axum::extract::{DefaultBodyLimit, State};
use axum::http::StatusCode;
use axum::routing::{get, post};
use axum::{Json, Router};
use sqlx::PgPool;
use tokio::sync::Mutex;

pub use actions::ProjectionApi;
pub use database::{Database, DatabaseError};
use pipeline::{EventCounter, History, Snapshot};
pub use relays::metrics_url;
use stream::StreamSource;
pub use upstream::Endpoint;

/// How often the pipeline is sampled while someone watches.
const SAMPLE_EVERY: Duration = Duration::from_secs(2);

/// Sampling stops this long after the console was last viewed: counting events exactly is not free,
/// and nobody needs the charts of an unwatched console.
const WATCH_FOR: Duration = Duration::from_secs(15 * 60);

/// How the console is set up.
#[derive(Debug, Clone)]
pub struct ConsoleConfig {
    /// The NATS server, if the stream should be shown (the console works without it).
    pub nats: Option<ops::NatsConnection>,
    /// The JetStream stream the relays publish to, read for its state and each order's copies.
    pub stream: String,
    /// The subject prefix (an order's messages are on `<prefix>.order.<id>`).
    pub subject_prefix: String,
    /// The operator token; without one, nothing in the console changes state.
    pub operator_token: Option<ops::OperatorToken>,
    /// The relays' metrics endpoints, scraped with each sample for the counters only the relays
    /// keep (duplicate PubAcks, fenced publishes).
    pub relay_metrics: Vec<Endpoint>,
    /// The projections' operator APIs, which the console's redrive, discard and release call.
    pub projection_apis: Vec<ProjectionApi>,
}

/// The console's shared state.
#[derive(Debug)]
struct Console {
    /// Sessions that cannot write (`default_transaction_read_only`): every page and sample.
    pool: PgPool,
    /// The one session of the operator actions' writes, there only with an operator token.
    writes: Option<PgPool>,
    stream: StreamSource,
    token: Option<ops::OperatorToken>,
    history: Mutex<History>,
    events: EventCounter,
    relay_metrics: Vec<Endpoint>,
    projection_apis: Vec<ProjectionApi>,
    /// When a page or the overview API was last requested (Unix milliseconds).
    last_view: AtomicI64,
}

type Shared = Arc<Console>;

impl Console {
    /// Whether state-changing actions exist.
    fn operator(&self) -> bool {
        self.token.is_some()
    }

    /// Whether the console can act in projection `name` (actions on, and its operator API known).
    fn acts_in(&self, name: &str) -> bool {
        self.operator() && self.projection_apis.iter().any(|api| api.name == name)
    }

    fn viewed(&self) {
        self.last_view
            .store(chrono::Utc::now().timestamp_millis(), Ordering::Relaxed);
    }

    fn watched(&self) -> bool {
        let since = chrono::Utc::now().timestamp_millis() - self.last_view.load(Ordering::Relaxed);
        since < i64::try_from(WATCH_FOR.as_millis()).unwrap_or(i64::MAX)
    }

    /// The latest snapshot, taken now if the last one is older than a sampling period. Concurrent
    /// viewers share one reading (the history's lock is held while it is taken).
    async fn snapshot(&self) -> (Snapshot, pipeline::Series) {
        self.viewed();
        let mut history = self.history.lock().await;
        let fresh = history.latest().is_some_and(|s| {
            (chrono::Utc::now() - s.taken_at).num_milliseconds()
                < i64::try_from(SAMPLE_EVERY.as_millis()).unwrap_or(i64::MAX)
        });
        let snapshot = match (fresh, history.latest()) {
            (true, Some(latest)) => latest.clone(),
            _ => {
                let taken =
                    Snapshot::take(&self.pool, &self.events, &self.stream, &self.relay_metrics)
                        .await;
                history.push(taken)
            }
        };
        (snapshot, history.series())
    }
}

/// The console's routes, all under `/console` (and `/` sends a browser there). Spawns the sampler
/// and (with NATS) the connection to NATS, so it must be called inside the Tokio runtime.
pub fn router(database: Database, config: ConsoleConfig) -> Router {
    let console = Arc::new(Console {
        pool: database.reads,
        // Without a token no action exists, so neither does a session that could write.
        writes: database.writes.filter(|_| config.operator_token.is_some()),
        stream: StreamSource::start(config.nats, config.stream, config.subject_prefix),
        token: config.operator_token,
        history: Mutex::new(History::default()),
        events: EventCounter::default(),
        relay_metrics: config.relay_metrics,
        projection_apis: config.projection_apis,
        last_view: AtomicI64::new(i64::MIN / 2),
    });
    tokio::spawn(sample(Arc::downgrade(&console)));
    Router::new()
        .route(
            "/",
            get(|| async { axum::response::Redirect::to("/console") }),
        )
        .route("/health", get(health))
        .route("/console", get(overview::page))
        .route("/console/", get(overview::page))
        .route("/console/orders", get(order::find))
        .route("/console/orders/{id}", get(order::page))
        .route("/console/catalog", get(catalog::page))
        .route("/console/outbox/dead", get(lists::dead))
        .route("/console/projections/{name}/parked", get(lists::parked))
        .route("/console/projections/{name}/held", get(lists::held))
        .route("/console/projections/{name}/document", get(models::page))
        .route("/console/assets/{file}", get(assets::serve))
        .route("/console/charts/{file}", get(overview::chart_image))
        .route("/console/api/overview", get(overview::api))
        .route("/console/api/orders/{id}", get(order::api))
        .route("/console/api/catalog", get(catalog::api))
        .route("/console/api/projections/{name}/document", get(models::api))
        .route(
            "/console/api/outbox/dead/replay",
            post(actions::replay_dead),
        )
        .route(
            "/console/api/projections/{name}/redrive",
            post(actions::redrive),
        )
        .route(
            "/console/api/projections/{name}/parked/{id}/discard",
            post(actions::discard),
        )
        .route(
            "/console/api/projections/{name}/held/{order}/release",
            post(actions::release),
        )
        .layer(DefaultBodyLimit::max(4 * 1024))
        .with_state(console)
}

/// `GET /health`: 200 while the database answers, else 503.
async fn health(State(console): State<Shared>) -> (StatusCode, Json<serde_json::Value>) {
    let database = sqlx::query("SELECT 1").execute(&console.pool).await.is_ok();
    let status = if database {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (status, Json(serde_json::json!({"database": database})))
}

/// Samples the pipeline every [`SAMPLE_EVERY`] while the console is watched, so the charts have the
/// last minutes even between page loads; ends when the router is dropped.
async fn sample(console: std::sync::Weak<Console>) {
    let mut tick = tokio::time::interval(SAMPLE_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let Some(console) = console.upgrade() else {
            return;
        };
        if !console.watched() {
            continue;
        }
        let taken = Snapshot::take(
            &console.pool,
            &console.events,
            &console.stream,
            &console.relay_metrics,
        )
        .await;
        tracing::debug!(
            events = ?taken.events.stored,
            stream_available = taken.stream.available,
            "console sampled the pipeline"
        );
        console.history.lock().await.push(taken);
    }
}
