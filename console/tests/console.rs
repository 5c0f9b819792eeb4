//! The console against the real pipeline: orders written through the event store and a legacy
//! `order.placed` v1 written straight into `events`, relayed by the relay into a private nats-server,
//! applied by the three projections' runners, then `waybill-console` rendered by headless Chromium
//! and compared with the database. Also: actions need the operator token, the console says when
//! NATS is unreachable, hostile stored text is escaped, a real `waybill-relay`'s own counters are
//! scraped from its /metrics (an unreachable one is shown as such), and the console answers only on
//! its own address.

mod common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use common::Console;
use domain::{CancelOrder, Note, OrderCommand, ShipOrder};
use serde_json::{Value, json};
use sqlx::PgPool;
use store::{CommandContext, EventStore};
use uuid::Uuid;

const STREAM: &str = "CONSOLE_EVENTS";
const PREFIX: &str = "console.events";

/// The order lifecycles the issue asks for.
const LIFECYCLES: usize = 137;

/// Places, pays, and ships or cancels `count` orders through the event store.
async fn lifecycles(store: &EventStore, count: usize) {
    for i in 0..count {
        let customer = format!("customer-{}", i % 17);
        let id = testkit::place_order(store, &customer, &["MUG-BLUE:2:1250", "TEA:1:500"]).await;
        testkit::pay_order(store, id).await;
        let last = if i % 4 == 0 {
            OrderCommand::Cancel(CancelOrder {
                reason: Note::parse("changed my mind").expect("note"),
            })
        } else {
            OrderCommand::Ship(ShipOrder {
                carrier: Note::parse("DHL").expect("note"),
                tracking_number: Note::parse(&format!("T{i}")).expect("note"),
            })
        };
        store
            .execute(id, &last, &CommandContext::default())
            .await
            .expect("ship or cancel");
    }
}

/// Writes a legacy `order.placed` v1 straight into `events` (with its outbox row, in one statement,
/// as an import from the old system would), bypassing the domain; returns the order id.
async fn legacy_order(pool: &PgPool) -> Uuid {
    let order = Uuid::now_v7();
    let envelope = testkit::legacy_placed(order);
    store::append(
        pool,
        order,
        0,
        &[envelope],
        &store::AppendOptions::default(),
    )
    .await
    .expect("legacy row");
    order
}

/// Relays every outbox row into the stream, then lets each projection apply everything.
async fn relay_and_project(url: &str, nats: &str) {
    testkit::relay_everything(url, nats, STREAM, PREFIX).await;
    common::project_all(url, nats, (STREAM, PREFIX)).await;
}

/// Debian's Chromium, if installed. Without it the browser checks are skipped loudly — but not under
/// CI, where a missing browser is a failure.
fn chromium() -> Option<PathBuf> {
    let found = ["chromium", "chromium-browser"]
        .iter()
        .find_map(|name| testkit::find_binary(name));
    if found.is_none() {
        assert!(
            std::env::var_os("CI").is_none(),
            "chromium is not installed, and CI is set: the console must be tested in a real browser \
             (apt-get install -y chromium)"
        );
        eprintln!(
            "\n!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!\n\
             !!! SKIPPING THE BROWSER CHECKS: chromium is not installed (apt-get install chromium) !!!\n\
             !!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!\n"
        );
    }
    found
}

/// Runs headless Chromium with `args` on `url` and returns its standard output.
async fn browse(chromium: &Path, url: &str, args: &[&str]) -> String {
    let profile = tempfile::TempDir::with_prefix("waybill-chromium-").expect("profile dir");
    let run = tokio::process::Command::new(chromium)
        .args([
            "--headless=new",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--no-first-run",
            "--virtual-time-budget=5000",
        ])
        .arg(format!("--user-data-dir={}", profile.path().display()))
        .args(args)
        .arg(url)
        .kill_on_drop(true)
        .output();
    let output = tokio::time::timeout(Duration::from_secs(90), run)
        .await
        .expect("chromium finishes within 90 s")
        .expect("chromium runs");
    assert!(
        output.status.success(),
        "chromium failed on {url}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8(output.stdout).expect("the DOM is UTF-8")
}

/// The text inside the element carrying `data-testid="{id}"` (tags stripped, entities of the
/// serializer undone), searching from `from`.
fn text_of(dom: &str, id: &str) -> String {
    let marker = format!("data-testid=\"{id}\"");
    let start = dom
        .find(&marker)
        .unwrap_or_else(|| panic!("no element {id} in the DOM:\n{dom}"));
    let open_end = start + dom[start..].find('>').expect("tag end") + 1;
    let tag_start = dom[..start].rfind('<').expect("tag start");
    let tag: String = dom[tag_start + 1..]
        .chars()
        .take_while(|c| c.is_ascii_alphanumeric())
        .collect();
    let close = format!("</{tag}>");
    let end = open_end + dom[open_end..].find(&close).expect("closing tag");
    let mut text = String::new();
    let mut in_tag = false;
    for c in dom[open_end..end].chars() {
        match c {
            '<' => in_tag = true,
            '>' => in_tag = false,
            c if !in_tag => text.push(c),
            _ => {}
        }
    }
    text.replace("&lt;", "<")
        .replace("&gt;", ">")
        .replace("&nbsp;", "\u{a0}")
        .replace("&amp;", "&")
        .trim()
        .to_owned()
}

fn grouped(n: i64) -> String {
    let digits = n.to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

async fn overview(service: &Console) -> Value {
    service.json("/console/api/overview").await
}

#[sqlx::test(migrator = "store::MIGRATOR")]
async fn chromium_shows_the_pipeline_and_the_legacy_order_as_stored(pool: PgPool) {
    let nats = testkit::NatsServer::start().expect("nats-server");
    let url = testkit::database_url(&pool).await;
    let store = EventStore::new(pool.clone());
    lifecycles(&store, LIFECYCLES).await;
    let legacy = legacy_order(&pool).await;
    // A customer of its own: a projection of orders alone is not behind the store by its event.
    let customer = domain::CustomerId::parse("customer-1").expect("a handle");
    let register = domain::CustomerCommand::Register(domain::RegisterCustomer {
        customer_id: customer.clone(),
        name: Note::parse("Customer One").expect("a name"),
    });
    store
        .execute(
            domain::CustomerKey::of(&customer),
            &register,
            &CommandContext::default(),
        )
        .await
        .expect("register");
    relay_and_project(&url, &nats.url()).await;

    let stored: i64 = sqlx::query_scalar("SELECT count(*) FROM events")
        .fetch_one(&pool)
        .await
        .expect("count");
    assert_eq!(
        stored,
        i64::try_from(LIFECYCLES).expect("a small count") * 3 + 1 + 1
    );
    let of_orders = stored - 1;
    let legacy_payload: String = sqlx::query_scalar(
        "SELECT payload::text FROM events WHERE aggregate_id = $1 AND aggregate_version = 1",
    )
    .bind(legacy)
    .fetch_one(&pool)
    .await
    .expect("legacy payload");

    let service = Console::start_with(
        &pool,
        &[
            "--nats-url",
            &nats.url(),
            "--stream",
            STREAM,
            "--subject-prefix",
            PREFIX,
        ],
    )
    .await;

    // The JSON the page is refreshed from agrees with the database and the stream (the console
    // connects to NATS in the background: wait for it).
    let mut api = overview(&service).await;
    for _ in 0..100 {
        if api["snapshot"]["stream"]["available"] == true {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        api = overview(&service).await;
    }
    let snapshot = &api["snapshot"];
    assert_eq!(snapshot["stream"]["available"], true, "{snapshot:#}");
    assert_eq!(snapshot["events"]["stored"], stored);
    assert_eq!(snapshot["stream"]["messages"], stored);
    assert_eq!(snapshot["outbox"]["pending"], 0);
    assert_eq!(snapshot["outbox"]["dead"], 0);
    // Every projection of the registry, the read models of projections/src/models/ included.
    let names = projections::registry::names();
    assert!(
        names.contains(&"revenue") && names.contains(&"customers"),
        "{names:?}"
    );
    assert_eq!(
        snapshot["projections"].as_array().map(Vec::len),
        Some(names.len()),
        "{snapshot:#}"
    );
    assert_eq!(snapshot["events"]["by_type"]["customer"], 1, "{snapshot:#}");
    assert_eq!(
        snapshot["events"]["by_type"]["order"], of_orders,
        "{snapshot:#}"
    );
    for (i, name) in names.iter().enumerate() {
        let projection = &snapshot["projections"][i];
        assert_eq!(projection["name"], *name);
        assert_eq!(projection["found"], true, "{projection:#}");
        let reads = projections::registry::aggregates(name).expect("its types");
        let of_its_types = if reads.contains(&"customer") {
            stored
        } else {
            of_orders
        };
        assert_eq!(projection["applied"], of_its_types, "{projection:#}");
        assert_eq!(projection["behind_stream"], 0, "{projection:#}");
        assert_eq!(projection["behind_store"], 0, "{projection:#}");
        let about = projections::registry::model(name).map(|model| model.about());
        assert_eq!(projection["about"].as_str(), about, "{projection:#}");
    }
    // Each read model's document, as the console reads it, is what the model says it must be: its
    // own fold of the event store.
    for model in projections::registry::MODELS {
        let answer = service
            .json(&format!(
                "/console/api/projections/{}/document",
                model.name()
            ))
            .await;
        let expected = model.expected(&url).await.expect("the model's fold");
        assert_eq!(answer["about"], model.about(), "{answer:#}");
        assert_eq!(answer["document"], expected, "{}: {answer:#}", model.name());
        assert_ne!(expected, json!([]), "{}: a fold of nothing", model.name());
    }
    assert_eq!(
        service
            .status("/console/api/projections/inventory/document")
            .await,
        404,
        "a built-in projection has no document here"
    );
    assert_eq!(
        service.status("/console/projections/nope/document").await,
        404
    );
    let timeline: Value = service
        .client
        .get(format!("{}/console/api/orders/{legacy}", service.base))
        .send()
        .await
        .expect("timeline answers")
        .json()
        .await
        .expect("timeline is JSON");
    let event = &timeline["events"][0];
    assert_eq!(event["event_type"], "order.placed");
    assert_eq!(event["stored_version"], 1);
    assert_eq!(event["stored_payload"], legacy_payload.as_str());
    assert_eq!(event["upcast_payload"]["customer_id"], "legacy");
    assert_eq!(event["upcast_chain"][0]["from"], 1);
    assert_eq!(event["stream_sequence_source"], "stream");
    assert_eq!(timeline["folded"]["total_cents"], 4200);

    // The charts: images the server draws, a legend entry per series of the API (read first: the
    // series only gain names as samples come, so the image drawn after has each of them). The
    // backlog has a point from the first sample; throughput needs two.
    for chart in ["throughput", "backlog"] {
        let api = overview(&service).await;
        let series = api["series"][chart]
            .as_object()
            .expect("the chart's series");
        if chart == "backlog" {
            assert!(series.contains_key("outbox"), "{chart}: {api:#}");
        }
        let response = service
            .client
            .get(format!("{}/console/charts/{chart}.svg", service.base))
            .send()
            .await
            .expect("the chart answers");
        assert_eq!(response.status(), 200);
        assert_eq!(
            response.headers()["content-type"],
            "image/svg+xml",
            "{chart}"
        );
        let image = response.text().await.expect("the chart's text");
        assert!(
            image.contains(&format!("<title>{chart} chart</title>")),
            "{image}"
        );
        for name in series.keys() {
            assert!(
                image.contains(&format!(">{name}</text>")),
                "{chart}: {image}"
            );
        }
    }
    assert_eq!(service.status("/console/charts/nope.svg").await, 404);

    let Some(chromium) = chromium() else {
        return;
    };

    // The pipeline as the browser renders it.
    let dom = browse(
        &chromium,
        &format!("{}/console", service.base),
        &["--dump-dom"],
    )
    .await;
    for (i, name) in projections::registry::names().iter().enumerate() {
        let section = text_of(&dom, &format!("projection-{name}"));
        assert!(section.starts_with(name), "{section}");
        let applied = snapshot["projections"][i]["applied"]
            .as_i64()
            .expect("a count");
        assert!(
            section.contains(&format!("applied{}", grouped(applied))),
            "{section}"
        );
        // The "not found" note is in the page for the script, hidden while the schema exists.
        let note = format!("data-unless=\"snapshot.projections.{i}.found\" hidden=\"\"");
        assert!(
            dom.contains(&note),
            "{name}'s 'not found' note is shown:\n{dom}"
        );
    }
    for model in projections::registry::MODELS {
        let section = text_of(&dom, &format!("projection-{}", model.name()));
        assert!(section.contains(model.about()), "{section}");
        assert!(
            dom.contains(&format!(
                "href=\"/console/projections/{}/document\"",
                model.name()
            )),
            "{dom}"
        );
        // Its document page: the model's document, pretty-printed.
        let page = browse(
            &chromium,
            &format!(
                "{}/console/projections/{}/document",
                service.base,
                model.name()
            ),
            &["--dump-dom"],
        )
        .await;
        let expected = model.expected(&url).await.expect("the model's fold");
        assert_eq!(
            text_of(&page, "document"),
            serde_json::to_string_pretty(&expected).expect("JSON"),
            "{page}"
        );
    }
    assert_eq!(text_of(&dom, "events-stored"), grouped(stored), "{dom}");
    for chart in ["throughput", "backlog"] {
        assert!(
            dom.contains(&format!("src=\"/console/charts/{chart}.svg")),
            "{chart}:\n{dom}"
        );
    }
    assert!(
        dom.contains("data-unless=\"snapshot.stream.available\" hidden=\"\""),
        "the stream shows as unavailable:\n{dom}"
    );

    // The legacy order's timeline: its type, its stored version 1 and its stored payload.
    let order_url = format!("{}/console/orders/{legacy}", service.base);
    let dom = browse(&chromium, &order_url, &["--dump-dom"]).await;
    assert_eq!(text_of(&dom, "event-type"), "order.placed");
    assert_eq!(text_of(&dom, "stored-version"), "1");
    assert_eq!(text_of(&dom, "stored-payload"), legacy_payload);
    assert!(dom.contains("order_placed_v1_to_v2"), "{dom}");
    for name in projections::registry::names() {
        assert!(dom.contains(&format!("{name}: applied")), "{name}:\n{dom}");
    }
    assert!(text_of(&dom, "folded").contains("\"total_cents\": 4200"));

    // Screenshots: always taken (the page must render), kept for the README when asked.
    let shots = tempfile::TempDir::with_prefix("waybill-shots-").expect("dir");
    let keep = std::env::var_os("WAYBILL_CONSOLE_SCREENSHOTS").is_some();
    let docs = Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs");
    for (page, file) in [
        (format!("{}/console", service.base), "console.png"),
        (order_url, "console-order.png"),
        (
            format!("{}/console/catalog", service.base),
            "console-catalog.png",
        ),
    ] {
        let path = shots.path().join(file);
        browse(
            &chromium,
            &page,
            &[
                &format!("--screenshot={}", path.display()),
                "--window-size=1280,900",
                "--hide-scrollbars",
            ],
        )
        .await;
        let size = std::fs::metadata(&path).expect("screenshot written").len();
        assert!(size > 10_000, "{file} is only {size} bytes");
        if keep {
            std::fs::create_dir_all(&docs).expect("docs dir");
            std::fs::copy(&path, docs.join(file)).expect("keep the screenshot");
        }
    }
}

#[sqlx::test(migrator = "store::MIGRATOR")]
async fn actions_need_the_operator_token(pool: PgPool) {
    let store = EventStore::new(pool.clone());
    let order = testkit::place_order(&store, "alice", &["MUG:1:100"]).await;
    sqlx::query("UPDATE outbox SET status = 'dead', dead_at = now(), dead_reason = 'test' WHERE aggregate_id = $1")
        .bind(order.as_uuid())
        .execute(&pool)
        .await
        .expect("a dead row");
    let reader = Console::start_with(&pool, &["--nats-url", "nats://127.0.0.1:1"]).await;
    let refused = reader.replay_all(Some("Bearer anything-at-all-1234")).await;
    assert_eq!(refused.status(), 403);
    let page = reader
        .client
        .get(format!("{}/console/outbox/dead", reader.base))
        .send()
        .await
        .expect("page")
        .text()
        .await
        .expect("text");
    assert!(
        !page.contains("data-replay"),
        "buttons without a token:\n{page}"
    );
    assert!(
        page.contains(&format!("/console/orders/{}", order.as_uuid())),
        "{page}"
    );
    drop(reader);

    let token = "correct-horse-battery-staple";
    let operator = Console::start_with(
        &pool,
        &[
            "--nats-url",
            "nats://127.0.0.1:1",
            "--operator-token",
            token,
        ],
    )
    .await;
    assert_eq!(operator.replay_with_the_token_only(token).await, 1);
    let dead: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox WHERE status = 'dead'")
        .fetch_one(&pool)
        .await
        .expect("count");
    assert_eq!(dead, 0);
}

#[sqlx::test(migrator = "store::MIGRATOR")]
async fn without_nats_the_console_says_so(pool: PgPool) {
    testkit::place_order(&EventStore::new(pool.clone()), "alice", &["MUG:1:100"]).await;
    let port = testkit::free_port().expect("port");
    let service =
        Console::start_with(&pool, &["--nats-url", &format!("nats://127.0.0.1:{port}")]).await;
    let api = overview(&service).await;
    let snapshot = &api["snapshot"];
    assert_eq!(snapshot["stream"]["available"], false);
    assert!(
        snapshot["stream"]["reason"]
            .as_str()
            .is_some_and(|r| r.contains("NATS")),
        "{snapshot:#}"
    );
    assert_eq!(snapshot["events"]["stored"], 1);
    for projection in snapshot["projections"].as_array().expect("projections") {
        assert_eq!(projection["found"], false, "{projection:#}");
    }
    let page = service
        .client
        .get(format!("{}/console", service.base))
        .send()
        .await
        .expect("page")
        .text()
        .await
        .expect("text");
    // Both variants of each note are rendered (the script toggles them), so the text alone proves
    // nothing: the element holding it must be the one left visible.
    for i in 0..3 {
        let missing = format!("<div data-unless=\"snapshot.projections.{i}.found\">");
        assert!(
            page.contains(&missing),
            "projection {i}'s 'not found' note is hidden:\n{page}"
        );
    }
    assert!(
        page.contains("<div data-unless=\"snapshot.stream.available\"><p class=\"error\"><strong>unavailable</strong>"),
        "the stream's 'unavailable' note is hidden:\n{page}"
    );
    // Without --relay-metrics the relays' own counters are explained, with the flag that shows them.
    assert_eq!(snapshot["relay"]["metrics"]["configured"], 0);
    assert_eq!(snapshot["relay"]["metrics"]["duplicate_acks"], Value::Null);
    assert!(page.contains("data-testid=\"relay-metrics-off\""), "{page}");
    assert!(page.contains("--relay-metrics"), "{page}");
}

#[sqlx::test(migrator = "store::MIGRATOR")]
async fn hostile_stored_text_is_escaped(pool: PgPool) {
    let order = Uuid::now_v7();
    sqlx::query(
        "INSERT INTO events (event_id, event_type, event_version, aggregate_type, aggregate_id,
                             aggregate_version, occurred_at, payload)
         VALUES ($1, '<script>alert(1)</script>', 1, 'order', $2, 1, now(), $3)",
    )
    .bind(Uuid::now_v7())
    .bind(order)
    .bind(json!({"x": "<img src=x onerror=alert(2)>\u{1}", "big": "y".repeat(100_000)}))
    .execute(&pool)
    .await
    .expect("hostile row");
    let service = Console::start_with(&pool, &["--nats-url", "nats://127.0.0.1:1"]).await;
    let response = service
        .client
        .get(format!("{}/console/orders/{order}", service.base))
        .send()
        .await
        .expect("page");
    assert_eq!(response.status(), 200);
    let csp = response
        .headers()
        .get("content-security-policy")
        .expect("a content security policy")
        .to_str()
        .expect("ascii")
        .to_owned();
    assert!(csp.contains("script-src 'self'"), "{csp}");
    let page = response.text().await.expect("text");
    assert!(!page.contains("<script>alert"), "{page}");
    assert!(!page.contains("<img src=x"), "unescaped payload");
    assert!(page.contains("&lt;script&gt;alert(1)&lt;/script&gt;"));
    assert!(
        page.contains("more bytes not shown"),
        "a huge payload is capped"
    );
    assert!(page.len() < 90_000, "the page is {} bytes", page.len());
    assert!(
        page.contains("unknown event type"),
        "the upcast error is shown"
    );
}

#[sqlx::test(migrator = "store::MIGRATOR")]
async fn the_relays_counters_are_scraped_from_their_metrics(pool: PgPool) {
    let nats = testkit::NatsServer::start().expect("nats-server");
    let url = testkit::database_url(&pool).await;
    let store = EventStore::new(pool.clone());
    lifecycles(&store, 4).await;
    relay_and_project(&url, &nats.url()).await;
    // Every row again, as a relay that lost its marks would: the stream already holds each event, so
    // the real relay below gets a duplicate PubAck (or a fenced refusal) for every one — counts that
    // only that process knows.
    let again =
        sqlx::query("UPDATE outbox SET status = 'pending', sent_at = NULL, next_run_at = now()")
            .execute(&pool)
            .await
            .expect("rows pending again")
            .rows_affected();
    assert_eq!(again, 12);

    let ports = testkit::free_ports(2).expect("ports");
    let (metrics_port, dead_port) = (ports[0], ports[1]);
    let _relay = tokio::process::Command::new(common::workspace_binary("waybill-relay"))
        .args([
            "run",
            "--metrics-listen",
            &format!("127.0.0.1:{metrics_port}"),
        ])
        .args(["--database-url", &url, "--nats-url", &nats.url()])
        .args(["--stream", STREAM, "--subject-prefix", PREFIX])
        .env("RUST_LOG", "warn")
        .kill_on_drop(true)
        .spawn()
        .expect("waybill-relay starts");
    let relay_url = format!("http://127.0.0.1:{metrics_port}/metrics");
    let dead_url = format!("http://127.0.0.1:{dead_port}/metrics");
    let service = Console::start_with(
        &pool,
        &[
            "--nats-url",
            &nats.url(),
            "--stream",
            STREAM,
            "--subject-prefix",
            PREFIX,
            "--relay-metrics",
            &relay_url,
            "--relay-metrics",
            &dead_url,
        ],
    )
    .await;

    // The console samples at most every 2 s: wait for a sample taken after the relay re-sent it all.
    let mut api = overview(&service).await;
    for _ in 0..100 {
        let scraped = &api["snapshot"]["relay"]["metrics"]["relays"][0];
        let counted = scraped["duplicate_acks"].as_u64().unwrap_or(0)
            + scraped["fenced"].as_u64().unwrap_or(0);
        if counted == again {
            break;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
        api = overview(&service).await;
    }
    let metrics = &api["snapshot"]["relay"]["metrics"];
    let relay = &metrics["relays"][0];
    assert_eq!(relay["url"], relay_url.as_str(), "{metrics:#}");
    assert_eq!(relay["reachable"], true, "{metrics:#}");
    assert_eq!(relay["exported"], true, "{metrics:#}");
    assert_eq!(relay["error"], Value::Null, "{metrics:#}");
    // A polling relay exports whether it stands by for a WAL relay's slot; nobody reads one here.
    assert_eq!(relay["standing_by"], false, "{metrics:#}");
    let (duplicates, fenced) = (
        relay["duplicate_acks"].as_u64().expect("a count"),
        relay["fenced"].as_u64().expect("a count"),
    );
    assert_eq!(duplicates + fenced, again, "{metrics:#}");
    let dead = &metrics["relays"][1];
    assert_eq!(dead["url"], dead_url.as_str());
    assert_eq!(dead["reachable"], false, "{metrics:#}");
    assert!(
        dead["error"]
            .as_str()
            .is_some_and(|e| e.contains("connect")),
        "{metrics:#}"
    );
    assert_eq!(dead["duplicate_acks"], Value::Null);
    // The totals are over the relays that answered.
    assert_eq!(metrics["configured"], 2);
    assert_eq!(metrics["reachable"], 1);
    assert_eq!(metrics["unreachable"], 1);
    assert_eq!(metrics["duplicate_acks"], duplicates);
    assert_eq!(metrics["fenced"], fenced);
    assert_eq!(
        api["snapshot"]["outbox"]["pending"], 0,
        "the relay settled them"
    );

    // The page shows both, and the rest of the pipeline as usual.
    let page = service
        .client
        .get(format!("{}/console", service.base))
        .send()
        .await
        .expect("page");
    assert_eq!(page.status(), 200);
    let page = page.text().await.expect("text");
    assert!(
        page.contains(&relay_url) && page.contains(&dead_url),
        "{page}"
    );
    assert!(
        !page.contains("data-testid=\"relay-metrics-off\""),
        "{page}"
    );
    assert!(page.contains("data-testid=\"events-stored\""), "{page}");

    let Some(chromium) = chromium() else {
        return;
    };
    let dom = browse(
        &chromium,
        &format!("{}/console", service.base),
        &["--dump-dom"],
    )
    .await;
    let totals = text_of(&dom, "relay-metrics");
    assert!(
        totals.contains(&format!("duplicate PubAcks{duplicates}"))
            && totals.contains(&format!("fenced publishes{fenced}"))
            && totals.contains("answering1 of 2"),
        "{totals}"
    );
    let first = text_of(&dom, "relay-metrics-0");
    assert!(
        first.contains(&format!("duplicates {duplicates} · fenced {fenced}")),
        "{first}"
    );
    assert!(
        dom.contains("data-unless=\"snapshot.relay.metrics.relays.0.reachable\" hidden=\"\""),
        "the reachable relay shows as unreachable:\n{dom}"
    );
    assert!(
        dom.contains("data-when=\"snapshot.relay.metrics.relays.0.standing_by\" hidden=\"\""),
        "a relay that claims shows as standing by:\n{dom}"
    );
    let second = text_of(&dom, "relay-metrics-1");
    assert!(second.contains("unreachable: cannot connect"), "{second}");
    assert_eq!(text_of(&dom, "events-stored"), "12", "{dom}");
}

/// The console's redrive, discard and release call the projection's own operator API (the service
/// does not link the projections) with the console's token: refused without the token, a clear 502
/// when the projection refuses that token or does not answer, 409 for a projection whose API it was
/// not given; and the parked list shows the buttons only when it can act.
#[sqlx::test(migrator = "store::MIGRATOR")]
async fn projection_actions_go_through_the_projections_operator_api(pool: PgPool) {
    const TOKEN: &str = "console-and-projection-token";
    let nats = testkit::NatsServer::start().expect("nats-server");
    let url = testkit::database_url(&pool).await;
    let store = EventStore::new(pool.clone());
    lifecycles(&store, 2).await;
    relay_and_project(&url, &nats.url()).await;

    let inventory = |token: &str| {
        let port = testkit::free_port().expect("port");
        let child = tokio::process::Command::new(common::workspace_binary("waybill-inventory"))
            .args(["run", "--listen", &format!("127.0.0.1:{port}")])
            .args(["--database-url", &url, "--nats-url", &nats.url()])
            .args(["--stream", STREAM, "--subject-prefix", PREFIX])
            .env("RUST_LOG", "warn")
            .env("WAYBILL_OPERATOR_TOKEN", token)
            .kill_on_drop(true)
            .spawn()
            .expect("waybill-inventory starts");
        (child, format!("inventory=http://127.0.0.1:{port}"))
    };
    let (_inventory, api) = inventory(TOKEN);
    // Garbage on an order's subject: the running inventory parks it.
    let client = async_nats::connect(nats.url()).await.expect("nats");
    let jetstream = async_nats::jetstream::new(client);
    let mut headers = async_nats::HeaderMap::new();
    headers.insert("Nats-Msg-Id", "console-garbage-1");
    jetstream
        .publish_with_headers(
            format!("{PREFIX}.order.{}", Uuid::now_v7()),
            headers,
            "not an event".into(),
        )
        .await
        .expect("publish")
        .await
        .expect("ack");
    testkit::wait_until(Duration::from_secs(60), "the garbage parked", || async {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM inventory.parked")
            .fetch_one(&pool)
            .await
            .is_ok_and(|n| n == 1)
    })
    .await;
    let parked: i64 = sqlx::query_scalar("SELECT id FROM inventory.parked")
        .fetch_one(&pool)
        .await
        .expect("parked id");

    let service = Console::start_with(
        &pool,
        &[
            "--nats-url",
            &nats.url(),
            "--stream",
            STREAM,
            "--subject-prefix",
            PREFIX,
            "--operator-token",
            TOKEN,
            "--projection-api",
            &api,
        ],
    )
    .await;
    let post = |path: &str, token: Option<&str>, body: Option<Value>| {
        let mut request = service
            .client
            .post(format!("{}/console/api/projections/{path}", service.base));
        if let Some(token) = token {
            request = request.bearer_auth(token);
        }
        if let Some(body) = body {
            request = request.json(&body);
        }
        async move {
            let response = request.send().await.expect("answers");
            let status = response.status().as_u16();
            (
                status,
                response.json::<Value>().await.unwrap_or(Value::Null),
            )
        }
    };
    let page = |path: String| {
        let request = service
            .client
            .get(format!("{}/console/projections/{path}", service.base));
        async move {
            request
                .send()
                .await
                .expect("page")
                .text()
                .await
                .expect("text")
        }
    };

    let shown = page("inventory/parked".into()).await;
    assert!(
        shown.contains(&format!(
            "data-action=\"/console/api/projections/inventory/parked/{parked}/discard\""
        )),
        "a discard button for the parked message:\n{shown}"
    );
    assert!(
        shown.contains("data-action=\"/console/api/projections/inventory/redrive\""),
        "{shown}"
    );
    let elsewhere = page("points/parked".into()).await;
    assert!(
        !elsewhere.contains("data-action") && elsewhere.contains("--projection-api points="),
        "no buttons where the console cannot act, and how to enable them:\n{elsewhere}"
    );

    let (status, body) = post("inventory/redrive", None, None).await;
    assert_eq!(status, 401, "{body}");
    let (status, body) = post("points/redrive", Some(TOKEN), None).await;
    assert_eq!(status, 409, "no operator API given for points: {body}");
    let (status, body) = post("nope/redrive", Some(TOKEN), None).await;
    assert_eq!(status, 404, "{body}");

    let (status, body) = post("inventory/redrive", Some(TOKEN), None).await;
    assert_eq!(status, 400, "a redrive says who and why: {body}");
    let (status, redriven) = post(
        "inventory/redrive",
        Some(TOKEN),
        Some(json!({"by": "ops", "reason": "after the upgrade"})),
    )
    .await;
    assert_eq!(status, 200, "{redriven}");
    assert_eq!(redriven["redriven"][0]["id"], parked, "{redriven}");
    assert_eq!(redriven["redriven"][0]["outcome"], "parked", "{redriven}");

    let discard = format!("inventory/parked/{parked}/discard");
    let (status, body) = post(&discard, Some(TOKEN), Some(json!({"by": "ops"}))).await;
    assert_eq!(status, 400, "a discard needs a reason: {body}");
    let (status, done) = post(
        &discard,
        Some(TOKEN),
        Some(json!({"by": "ops", "reason": "garbage, never an event"})),
    )
    .await;
    assert_eq!(status, 200, "{done}");
    assert_eq!(done["discarded"], parked, "{done}");
    let (status, body) = post(
        &discard,
        Some(TOKEN),
        Some(json!({"by": "ops", "reason": "again"})),
    )
    .await;
    assert_eq!(
        status, 409,
        "the projection's refusal comes through: {body}"
    );
    let logged: Vec<(String, String, String)> =
        sqlx::query_as("SELECT actor, action, reason FROM inventory.operator_log ORDER BY id")
            .fetch_all(&pool)
            .await
            .expect("log");
    assert_eq!(
        logged,
        vec![
            ("ops".into(), "redrive".into(), "after the upgrade".into()),
            (
                "ops".into(),
                "parked discard".into(),
                "garbage, never an event".into()
            )
        ]
    );
    let (status, body) = post(
        &format!("inventory/held/{}/release", Uuid::now_v7()),
        Some(TOKEN),
        Some(json!({"by": "ops", "reason": "nothing is held"})),
    )
    .await;
    assert_eq!(status, 409, "{body}");

    // What an order's page says of a version a release skipped (recorded as the projection records
    // it): skipped, not applied, though the checkpoint is past it.
    let (order, version): (Uuid, i64) = sqlx::query_as(
        "SELECT aggregate_id, max(version) FROM inventory.checkpoints GROUP BY aggregate_id LIMIT 1",
    )
    .fetch_one(&pool)
    .await
    .expect("an applied order");
    sqlx::query(
        "INSERT INTO inventory.operator_log (actor, action, target, reason, detail)
         VALUES ('ops', 'held release', $1, 'lost in transit', jsonb_build_object('skipped_versions', jsonb_build_array($2::int8, $2::int8)))",
    )
    .bind(order.to_string())
    .bind(version)
    .execute(&pool)
    .await
    .expect("a release's record");
    let timeline: Value = service
        .client
        .get(format!("{}/console/api/orders/{order}", service.base))
        .send()
        .await
        .expect("answers")
        .json()
        .await
        .expect("json");
    let events = timeline["events"].as_array().expect("events");
    let marks = |v: i64| {
        events
            .iter()
            .find(|e| e["aggregate_version"] == v)
            .map(|e| e["projections"][0].clone())
            .unwrap_or(Value::Null)
    };
    assert_eq!(marks(version)[1], "skipped", "{timeline:#}");
    assert_eq!(marks(1)[1], "applied", "{timeline:#}");
    drop(service);

    // A projection with another token, and one that does not answer: a 502 that says which.
    let (_other, other_api) = inventory("another-token-entirely");
    let dead_port = testkit::free_port().expect("port");
    for (api, expected) in [
        (other_api.as_str(), "refused the console's operator token"),
        (
            &*format!("inventory=http://127.0.0.1:{dead_port}"),
            "did not answer",
        ),
    ] {
        let service = Console::start_with(
            &pool,
            &[
                "--nats-url",
                &nats.url(),
                "--operator-token",
                TOKEN,
                "--projection-api",
                api,
            ],
        )
        .await;
        let mut answer = (0, Value::Null);
        // The other projection may still be starting: until it listens, it "does not answer".
        for _ in 0..200 {
            answer = {
                let response = service
                    .client
                    .post(format!(
                        "{}/console/api/projections/inventory/redrive",
                        service.base
                    ))
                    .bearer_auth(TOKEN)
                    .json(&json!({"by": "ops", "reason": "test"}))
                    .send()
                    .await
                    .expect("answers");
                (
                    response.status().as_u16(),
                    response.json::<Value>().await.unwrap_or(Value::Null),
                )
            };
            if answer.1["detail"]
                .as_str()
                .is_some_and(|d| d.contains(expected))
            {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert_eq!(answer.0, 502, "{api}: {}", answer.1);
        assert!(
            answer.1["detail"]
                .as_str()
                .is_some_and(|d| d.contains(expected)),
            "{api}: {}",
            answer.1
        );
    }
}

/// The console answers only on its own address, loopback unless told otherwise: the order service
/// serves no console (not even with the flags that used to put it on the API's address), and the
/// console serves no order API.
#[sqlx::test(migrator = "store::MIGRATOR")]
async fn the_console_answers_only_on_its_own_address(pool: PgPool) {
    let store = EventStore::new(pool.clone());
    let order = testkit::place_order(&store, "ines", &["MUG:1:100"]).await;
    let id = order.as_uuid();
    let console = Console::start_with(&pool, &["--nats-url", "nats://127.0.0.1:1"]).await;
    assert_eq!(console.status("/console").await, 200);
    assert_eq!(console.status(&format!("/console/orders/{id}")).await, 200);
    assert_eq!(
        console.status(&format!("/orders/{id}")).await,
        404,
        "no order API on the console's address"
    );
    let root = console
        .client
        .get(format!("{}/", console.base))
        .send()
        .await
        .expect("answers");
    assert_eq!(root.url().path(), "/console", "/ leads to the pipeline");

    // The order service, started as the README says, has no /console on its API.
    let ports = testkit::free_ports(2).expect("ports");
    let url = testkit::database_url(&pool).await;
    let _serve = tokio::process::Command::new(common::workspace_binary("waybill"))
        .args(["serve", "--listen", &format!("127.0.0.1:{}", ports[0])])
        .args(["--metrics-listen", &format!("127.0.0.1:{}", ports[1])])
        .env("DATABASE_URL", &url)
        .env("RUST_LOG", "warn")
        .kill_on_drop(true)
        .spawn()
        .expect("waybill serve starts");
    let api = format!("http://127.0.0.1:{}", ports[0]);
    testkit::wait_until(Duration::from_secs(30), "waybill serve answers", || {
        let request = console.client.get(format!("{api}/orders/{id}")).send();
        async move { request.await.is_ok_and(|r| r.status() == 200) }
    })
    .await;
    for path in [
        "/console",
        "/console/api/overview",
        &format!("/console/orders/{id}"),
    ] {
        let status = console
            .client
            .get(format!("{api}{path}"))
            .send()
            .await
            .expect("answers")
            .status();
        assert_eq!(status, 404, "{path} on the order service's API");
    }
    let refused = tokio::process::Command::new(common::workspace_binary("waybill"))
        .args(["serve", "--console-listen", "127.0.0.1:1"])
        .output()
        .await
        .expect("runs");
    assert_eq!(
        refused.status.code(),
        Some(2),
        "the order service has no console flags any more"
    );

    // Loopback by default, and said so.
    let help = tokio::process::Command::new(env!("CARGO_BIN_EXE_waybill-console"))
        .args(["run", "--help"])
        .output()
        .await
        .expect("runs");
    let help = String::from_utf8_lossy(&help.stdout);
    assert!(help.contains("[default: 127.0.0.1:8090]"), "{help}");
}

/// A projection split into partitions that two instances share through leases: the console lists
/// each partition's consumer (split by the server: `inventory-s<K>of2`), how far behind it is, and
/// the instance holding it; the projection's "behind stream" is their sum.
#[sqlx::test(migrator = "store::MIGRATOR")]
async fn partitions_and_the_instances_holding_them_are_shown(pool: PgPool) {
    let nats = testkit::NatsServer::start().expect("nats-server");
    let url = testkit::database_url(&pool).await;
    let store = EventStore::new(pool.clone());
    lifecycles(&store, 8).await;
    let js = async_nats::jetstream::new(async_nats::connect(nats.url()).await.expect("connect"));
    let settings = relay::StreamSettings {
        name: STREAM.into(),
        subject_prefix: PREFIX.into(),
        ..relay::StreamSettings::default()
    };
    let split = relay::StreamLimits {
        partitions: Some(2),
        ..relay::StreamLimits::default()
    };
    relay::ensure_stream_with(&js, &settings, &split, false)
        .await
        .expect("a stream split into 2 partitions");
    testkit::relay_everything(&url, &nats.url(), STREAM, PREFIX).await;

    let shared = projections::RunnerConfig {
        stream: STREAM.into(),
        subject_prefix: PREFIX.into(),
        partitions: projections::Partitions::new(2, &[]).expect("layout"),
        share: true,
        lease_time: Duration::from_secs(2),
        ..projections::RunnerConfig::default()
    };
    let mut instances = Vec::new();
    let mut running = Vec::new();
    for _ in 0..2 {
        let runner = std::sync::Arc::new(
            projections::Runner::connect(projections::Inventory, &url, &nats.url(), shared.clone())
                .await
                .expect("runner"),
        );
        instances.push(runner.clone());
        running.push(tokio::spawn(async move {
            runner.run(std::future::pending(), false, |_| {}).await
        }));
    }
    testkit::wait_until(
        Duration::from_secs(30),
        "each instance to hold one partition",
        || {
            let held = instances.iter().all(|i| i.owned_partitions().len() == 1);
            async move { held }
        },
    )
    .await;

    let service = Console::start_with(
        &pool,
        &[
            "--nats-url",
            &nats.url(),
            "--stream",
            STREAM,
            "--subject-prefix",
            PREFIX,
        ],
    )
    .await;
    let holders: Vec<String> = instances.iter().map(|i| i.instance().to_owned()).collect();
    let mut shown = Value::Null;
    for _ in 0..150 {
        let api = overview(&service).await;
        let projections = api["snapshot"]["projections"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        shown = projections
            .into_iter()
            .find(|p| p["name"] == "inventory")
            .unwrap_or(Value::Null);
        let settled = shown["behind_stream"] == 0
            && shown["partitions"]
                .as_array()
                .is_some_and(|p| p.len() == 2 && p.iter().all(|p| p["owner"].is_string()));
        if settled {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let partitions = shown["partitions"].as_array().expect("partitions");
    assert_eq!(partitions.len(), 2, "{shown:#}");
    for (k, partition) in partitions.iter().enumerate() {
        assert_eq!(partition["partition"], format!("{k}of2"), "{shown:#}");
        assert_eq!(partition["split_by_server"], true, "{shown:#}");
        assert_eq!(partition["consumer"]["name"], format!("inventory-s{k}of2"));
        let owner = partition["owner"].as_str().expect("a holder");
        assert!(
            holders.iter().any(|h| h == owner),
            "{owner} among {holders:?}"
        );
    }
    assert_ne!(partitions[0]["owner"], partitions[1]["owner"], "one each");
    assert_eq!(shown["behind_stream"], 0, "{shown:#}");
    let page = service
        .client
        .get(format!("{}/console", service.base))
        .send()
        .await
        .expect("the page")
        .text()
        .await
        .expect("its text");
    assert!(
        page.contains("partition-inventory-s0of2") && page.contains("split by the server"),
        "{page}"
    );
    for task in running {
        task.abort();
    }
}
