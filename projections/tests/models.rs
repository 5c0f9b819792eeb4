//! The read models of `projections/src/models/` over the real `waybill-projection` binary: fed by
//! the real command path and the relay, each ends equal to its own fold of the event store (`check`),
//! and to figures worked out here by hand; the model of two aggregate types reads orders and
//! customers, whichever comes first.

mod common;

use std::time::Duration;

use common::*;
use domain::{CustomerCommand, CustomerId, CustomerKey, Note, RegisterCustomer};
use serde_json::{Value, json};
use sqlx::PgPool;
use store::{CommandContext, EventStore};

async fn register(store: &EventStore, handle: &str, name: &str) {
    let customer_id = CustomerId::parse(handle).expect("handle");
    let command = CustomerCommand::Register(RegisterCustomer {
        name: Note::required("name", name).expect("name"),
        customer_id: customer_id.clone(),
    });
    store
        .execute(
            CustomerKey::of(&customer_id),
            &command,
            &CommandContext::default(),
        )
        .await
        .expect("register");
}

async fn relay_all(h: &Harness) {
    let config = relay::RelayConfig {
        stream: relay::StreamSettings {
            name: STREAM.into(),
            subject_prefix: PREFIX.into(),
            ..relay::StreamSettings::default()
        },
        ..relay::RelayConfig::default()
    };
    relay::Relay::connect(&h.url, &h.nats.url(), config)
        .await
        .expect("relay")
        .drain()
        .await
        .expect("drain");
}

async fn output(h: &Harness, name: &str, args: &[&str]) -> (i32, String) {
    let output = tokio::time::timeout(Duration::from_secs(60), model(h, name, args).output())
        .await
        .expect("in time")
        .expect("runs");
    (
        output.status.code().unwrap_or(-1),
        format!(
            "{}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        ),
    )
}

async fn show(h: &Harness, name: &str) -> Value {
    let (code, out) = output(h, name, &["show"]).await;
    assert_eq!(code, 0, "{out}");
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"))
}

#[sqlx::test(migrator = "store::MIGRATOR")]
async fn each_model_ends_equal_to_its_fold_of_the_store(pool: PgPool) {
    let h = Harness::new(&pool).await;
    let store = EventStore::new(pool.clone());
    // Before any consumer exists: the first run catches up from the store.
    let paid = testkit::place_order(&store, "alice", &["MUG:2:500"]).await;
    testkit::pay_order(&store, paid).await;
    register(&store, "alice", "Alice").await;
    let refunded = testkit::place_order(&store, "bob", &["TEA:1:300"]).await;
    testkit::pay_order(&store, refunded).await;
    testkit::cancel_order(&store, refunded).await;
    relay_all(&h).await;
    for name in ["revenue", "customers"] {
        let (code, out) = output(&h, name, &["run", "--once", "--json"]).await;
        assert_eq!(code, 0, "{name}: {out}");
    }
    // Then from the stream: the consumers exist now.
    let unpaid = testkit::place_order(&store, "carol", &["MUG:1:500"]).await;
    register(&store, "bob", "Bob").await;
    let _ = unpaid;
    relay_all(&h).await;
    for name in ["revenue", "customers"] {
        let (code, out) = output(&h, name, &["run", "--once", "--json"]).await;
        assert_eq!(code, 0, "{name}: {out}");
        let (code, out) = output(&h, name, &["check"]).await;
        assert_eq!(code, 0, "{name} equals its fold: {out}");
    }

    let today = chrono::Utc::now().date_naive().to_string();
    assert_eq!(
        show(&h, "revenue").await,
        json!([{"currency": "EUR", "day": today, "paid_cents": 1300, "refunded_cents": 300, "net_cents": 1000}])
    );
    assert_eq!(
        show(&h, "customers").await,
        json!([
            {"customer_id": "alice", "name": "Alice", "orders": 1, "paid_orders": 1, "paid_cents": 1000},
            {"customer_id": "bob", "name": "Bob", "orders": 1, "paid_orders": 0, "paid_cents": 0},
            {"customer_id": "carol", "name": null, "orders": 1, "paid_orders": 0, "paid_cents": 0},
        ])
    );
}

#[sqlx::test(migrator = "store::MIGRATOR")]
async fn check_fails_naming_where_the_read_model_differs(pool: PgPool) {
    let h = Harness::new(&pool).await;
    let store = EventStore::new(pool.clone());
    let order = testkit::place_order(&store, "alice", &["MUG:2:500"]).await;
    testkit::pay_order(&store, order).await;
    relay_all(&h).await;
    let (code, out) = output(&h, "revenue", &["run", "--once"]).await;
    assert_eq!(code, 0, "{out}");
    sqlx::query("UPDATE revenue.revenue SET paid_cents = paid_cents + 1")
        .execute(&pool)
        .await
        .expect("tamper");
    let (code, out) = output(&h, "revenue", &["check"]).await;
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains("the fold says 1000, the read model 1001"),
        "{out}"
    );
}

#[tokio::test]
async fn an_unknown_model_is_refused_and_list_names_them() {
    let listed = tokio::process::Command::new(PROJECTION)
        .arg("list")
        .output()
        .await
        .expect("runs");
    let listed = String::from_utf8_lossy(&listed.stdout).into_owned();
    assert!(
        listed.contains("revenue") && listed.contains("customers"),
        "{listed}"
    );
    let unknown = tokio::process::Command::new(PROJECTION)
        .args(["nosuch", "run"])
        .output()
        .await
        .expect("runs");
    assert_eq!(unknown.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&unknown.stderr).contains("no read model \"nosuch\""));
}
