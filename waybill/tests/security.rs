//! Secure by default, over the real binary and a real PostgreSQL: TLS to PostgreSQL by `sslmode`,
//! least-privilege roles that let each process do its job and nothing more, and no secret printed by
//! `--help` or by a failed login.

use sqlx::PgPool;
use testkit::login::denied;
use testkit::{Login, Run};
use uuid::Uuid;

async fn waybill(envs: &[(&str, &str)], args: &[&str]) -> Run {
    let output = tokio::process::Command::new(env!("CARGO_BIN_EXE_waybill"))
        .args(args)
        .envs(envs.iter().copied())
        .env("RUST_LOG", "warn")
        .output()
        .await
        .expect("waybill runs");
    Run::from(output)
}

fn with_parameter(url: &str, parameter: &str) -> String {
    let separator = if url.contains('?') { '&' } else { '?' };
    format!("{url}{separator}{parameter}")
}

#[sqlx::test(migrator = "store::MIGRATOR")]
async fn sslmode_require_encrypts_and_the_commands_work(pool: PgPool) {
    let url = with_parameter(&testkit::database_url(&pool).await, "sslmode=require");
    let migrate = waybill(&[("DATABASE_URL", &url)], &["migrate"]).await;
    assert_eq!(migrate.code, 0, "{}", migrate.stderr);
    let place = waybill(
        &[("DATABASE_URL", &url)],
        &[
            "place",
            "--customer",
            "alice",
            "--currency",
            "EUR",
            "--line",
            "MUG:1:100",
            "--json",
        ],
    )
    .await;
    assert_eq!(place.code, 0, "{}", place.stderr);

    // The same options the binaries use give an encrypted session.
    let tls = ops::database::connect(&url, "tls-check", 1)
        .await
        .expect("connect");
    let encrypted: bool =
        sqlx::query_scalar("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()")
            .fetch_one(&tls)
            .await
            .expect("pg_stat_ssl");
    assert!(encrypted, "sslmode=require must encrypt");

    // verify-ca honours sslrootcert: a CA that did not sign the server's certificate is refused.
    let dir = tempfile::TempDir::with_prefix("waybill-ca-")
        .expect("temp dir")
        .keep();
    testkit::secure_nats::self_signed_ca(&dir, "stranger");
    let stranger = with_parameter(
        &url.replace("sslmode=require", "sslmode=verify-ca"),
        &format!("sslrootcert={}", dir.join("ca.pem").display()),
    );
    let refused = waybill(
        &[("DATABASE_URL", &stranger)],
        &["show", &Uuid::now_v7().to_string()],
    )
    .await;
    assert_eq!(refused.code, 1, "{}", refused.stderr);
    assert!(refused.stderr.contains("certificate"), "{}", refused.stderr);
    let _ = std::fs::remove_dir_all(&dir);
    // …and the CA that did sign it is accepted (this machine's server uses the snakeoil certificate).
    let server_cert = "/etc/ssl/certs/ssl-cert-snakeoil.pem";
    if std::path::Path::new(server_cert).exists() {
        let trusted = with_parameter(
            &url.replace("sslmode=require", "sslmode=verify-ca"),
            &format!("sslrootcert={server_cert}"),
        );
        let run = waybill(
            &[("DATABASE_URL", &trusted)],
            &["show", &Uuid::now_v7().to_string()],
        )
        .await;
        assert_eq!(run.code, 2, "verified, then: unknown order: {}", run.stderr);
    }
}

#[sqlx::test(migrator = "store::MIGRATOR")]
async fn each_role_can_do_its_job_and_nothing_more(pool: PgPool) {
    let url = testkit::database_url(&pool).await;
    let first = waybill(&[("DATABASE_URL", &url)], &["roles", "create", "--json"]).await;
    assert_eq!(first.code, 0, "{}", first.stderr);
    let again = waybill(&[("DATABASE_URL", &url)], &["roles", "create"]).await;
    assert_eq!(again.code, 0, "idempotent: {}", again.stderr);

    // The command side places an order through the real binary.
    let app = Login::create(&pool, "waybill_app").await;
    let place = waybill(
        &[("DATABASE_URL", &app.url)],
        &[
            "place",
            "--customer",
            "alice",
            "--currency",
            "EUR",
            "--line",
            "MUG:1:100",
        ],
    )
    .await;
    assert_eq!(place.code, 0, "waybill_app can place: {}", place.stderr);
    let as_app = &app.pool;
    assert!(denied(as_app, "UPDATE outbox SET attempts = 0").await);
    assert!(denied(as_app, "DELETE FROM command_idempotency").await);

    // The relay reads and settles the outbox, and nothing of events.
    let relay = Login::create(&pool, "waybill_relay").await;
    let as_relay = &relay.pool;
    let unsent: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox WHERE status = 'pending'")
        .fetch_one(as_relay)
        .await
        .expect("the relay reads the outbox");
    assert_eq!(unsent, 1);
    sqlx::query("UPDATE outbox SET status = 'sent', stream_seq = 1")
        .execute(as_relay)
        .await
        .expect("the relay settles");
    sqlx::query("SELECT waybill_end_stale_claims(interval '1 hour')")
        .execute(as_relay)
        .await
        .expect("the relay may end stalled claims");
    assert!(denied(as_relay, "UPDATE events SET payload = '{}'").await);
    assert!(denied(as_relay, "SELECT count(*) FROM events").await);

    // A projection keeps to its own schema.
    let projection = Login::create(&pool, "waybill_projection").await;
    let as_projection = &projection.pool;
    sqlx::query("CREATE SCHEMA IF NOT EXISTS test_projection")
        .execute(as_projection)
        .await
        .expect("a projection creates its own schema");
    sqlx::query("CREATE TABLE test_projection.state (k int)")
        .execute(as_projection)
        .await
        .expect("and its tables");
    // It reads the event store's history (a first start and a rebuild catch up from it), and
    // changes none of it.
    let history: i64 = sqlx::query_scalar("SELECT count(*) FROM events")
        .fetch_one(as_projection)
        .await
        .expect("a projection reads events");
    assert_eq!(history, 1);
    assert!(denied(as_projection, "UPDATE events SET payload = '{}'").await);
    assert!(denied(as_projection, "DELETE FROM events").await);
    assert!(
        denied(
            as_projection,
            "INSERT INTO events (event_id, event_type, event_version, aggregate_type, aggregate_id, \
             aggregate_version, occurred_at, payload) SELECT gen_random_uuid(), event_type, \
             event_version, aggregate_type, aggregate_id, aggregate_version + 1, occurred_at, \
             payload FROM events"
        )
        .await
    );
    assert!(denied(as_projection, "SELECT count(*) FROM outbox").await);
    assert!(denied(as_projection, "SELECT count(*) FROM command_idempotency").await);

    for login in [app, relay, projection] {
        login.drop(&pool).await;
    }
}

#[tokio::test]
async fn secrets_are_never_printed() {
    let secret_url = "postgres://nobody:Pg-Secret-1@127.0.0.1:5432/nowhere?password=Pg-Secret-2";
    let nats_url = "nats://relay:Nats-Secret-3@127.0.0.1:4222";
    let envs = [
        ("DATABASE_URL", secret_url),
        ("NATS_URL", nats_url),
        ("NATS_PASSWORD", "Nats-Secret-4"),
    ];
    for args in [
        &["--help"][..],
        &["demo", "--help"],
        &["services", "--help"],
        &["show", "--help"],
    ] {
        let run = waybill(&envs, args).await;
        let printed = format!("{}{}", run.stdout, run.stderr);
        assert!(
            !printed.contains("Secret"),
            "{args:?} printed a secret:\n{printed}"
        );
    }
    let failed = waybill(&envs, &["show", &Uuid::now_v7().to_string()]).await;
    assert_eq!(failed.code, 1);
    let printed = format!("{}{}", failed.stdout, failed.stderr);
    assert!(printed.contains("PostgreSQL"), "{printed}");
    assert!(
        !printed.contains("Secret"),
        "a failed login printed a secret:\n{printed}"
    );
}
