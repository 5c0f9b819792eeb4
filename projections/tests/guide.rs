//! `docs/guides/add-a-projection.md` stays true: its Rust snippets are the worked example's code, word
//! for word, and its commands work against real servers — `list` names the model, `run --listen`
//! serves `GET /state`, and `check` says the model equals its fold of the event store.

mod common;

use std::time::Duration;

use common::*;
use sqlx::PgPool;

const GUIDE: &str = include_str!("../../docs/guides/add-a-projection.md");
const EXAMPLE: &str = include_str!("../src/models/revenue.rs");

/// The fenced blocks of `language` in `markdown`.
fn blocks<'a>(markdown: &'a str, language: &str) -> Vec<&'a str> {
    let fence = format!("```{language}\n");
    markdown
        .split(fence.as_str())
        .skip(1)
        .filter_map(|rest| rest.split("```").next())
        .collect()
}

#[test]
fn the_guides_snippets_are_the_examples_code() {
    let snippets = blocks(GUIDE, "rust");
    assert!(
        snippets.len() >= 2,
        "the guide shows the model and its registration"
    );
    for snippet in snippets {
        assert!(
            EXAMPLE.contains(snippet.trim_end()),
            "docs/guides/add-a-projection.md shows code that projections/src/models/revenue.rs does not hold:\n{snippet}"
        );
    }
    let commands = blocks(GUIDE, "sh").concat();
    for command in [
        "waybill-projection list",
        "waybill-projection revenue run --listen",
        "/state",
        "waybill-projection revenue check",
        "cargo test -p projections --test models",
    ] {
        assert!(commands.contains(command), "the guide runs {command:?}");
    }
}

#[sqlx::test(migrator = "store::MIGRATOR")]
async fn the_guides_commands_work(pool: PgPool) {
    let listed = tokio::process::Command::new(PROJECTION)
        .arg("list")
        .output()
        .await
        .expect("list");
    assert!(String::from_utf8_lossy(&listed.stdout).contains("revenue"));

    let h = Harness::new(&pool).await;
    let store = store::EventStore::new(pool.clone());
    let order = testkit::place_order(&store, "alice", &["MUG:1:700"]).await;
    testkit::pay_order(&store, order).await;
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

    let port = testkit::free_port().expect("port");
    let mut running = model(
        &h,
        "revenue",
        &["run", "--listen", &format!("127.0.0.1:{port}")],
    )
    .spawn()
    .expect("run");
    let client = reqwest::Client::new();
    let mut state = None;
    for _ in 0..200 {
        if let Ok(response) = client
            .get(format!("http://127.0.0.1:{port}/state"))
            .send()
            .await
            && response.status().is_success()
        {
            let body: serde_json::Value = response.json().await.expect("json");
            if body.as_array().is_some_and(|rows| !rows.is_empty()) {
                state = Some(body);
                break;
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let _ = running.start_kill();
    let state = state.expect("GET /state answers with the applied order");
    assert_eq!(state[0]["paid_cents"], 700, "{state}");

    let checked = model(&h, "revenue", &["check"])
        .output()
        .await
        .expect("check");
    assert_eq!(
        checked.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&checked.stdout)
    );
}
