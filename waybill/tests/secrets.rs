//! No binary prints a password, whatever characters it holds: every waybill binary, run for real
//! with database and NATS URLs whose passwords hold `,` `#` `/` `?` `@` `:` `&` or percent escapes
//! (and a key/value connection string with a quoted password), pointing at a closed port — in its
//! errors (text and `--json`), its logs (text and JSON lines, at debug level) and every `--help` page.

use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;

use futures::StreamExt;
use sqlx::PgPool;
use testkit::Run;
use uuid::Uuid;

/// The characters that have cut a password short somewhere, each between two markers: whatever part
/// of a password leaks, one of its markers does.
const AWKWARD: &[&str] = &[",", "#", "/", "?", "@", ":", "&", "%40", "%23", "%2F"];

/// The binaries of the workspace, all built next to this test's own.
fn binary(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_waybill")).with_file_name(name)
}

const BINARIES: &[&str] = &[
    "waybill",
    "waybill-relay",
    "waybill-inventory",
    "waybill-points",
    "waybill-search",
    "waybill-lab",
];

/// A password with `separator` between two markers numbered `n`.
fn password(n: usize, separator: &str) -> String {
    format!("Leak{n}L{separator}Leak{n}R")
}

/// The markers that must never be printed.
fn markers(n: usize) -> [String; 2] {
    [format!("Leak{n}L"), format!("Leak{n}R")]
}

/// Environment variables for a run.
type Envs = Vec<(&'static str, String)>;

async fn run(program: &str, args: &[&str], envs: &[(&str, String)]) -> Run {
    let output = tokio::process::Command::new(binary(program))
        .args(args)
        .envs(envs.iter().map(|(k, v)| (*k, v.as_str())))
        .env("RUST_LOG", "debug")
        .env("WAYBILL_OPERATOR", "test")
        .kill_on_drop(true)
        .output()
        .await
        .unwrap_or_else(|e| panic!("{program} runs: {e}"));
    Run::from(output)
}

fn assert_hidden(what: &str, run: &Run, markers: &[String]) {
    let printed = format!("{}{}", run.stdout, run.stderr);
    for marker in markers {
        assert!(
            !printed.contains(marker.as_str()),
            "{what} printed (part of) a password ({marker}):\n{printed}"
        );
    }
}

#[sqlx::test(migrator = "store::MIGRATOR")]
async fn no_binary_prints_a_password_whatever_its_characters(pool: PgPool) {
    testkit::build_workspace_binaries(env!("CARGO_MANIFEST_DIR"));
    let closed = testkit::free_port().expect("a free port");
    // A database that answers, for the runs that must get as far as NATS.
    let database = testkit::database_url(&pool).await;
    let order = Uuid::now_v7().to_string();

    let mut runs: Vec<Pin<Box<dyn Future<Output = ()> + '_>>> = Vec::new();
    for (n, separator) in AWKWARD.iter().enumerate() {
        let secret = password(n, separator);
        let db_url = format!("postgres://waybill:{secret}@127.0.0.1:{closed}/waybill");
        let nats_url = format!("nats://relay:{secret}@127.0.0.1:{closed}");
        // Every other run logs JSON lines.
        let log_format = if n % 2 == 0 { "text" } else { "json" };
        let bad_database = vec![
            ("DATABASE_URL", db_url.clone()),
            ("NATS_URL", nats_url.clone()),
            ("WAYBILL_LOG_FORMAT", log_format.to_owned()),
        ];
        let bad_nats = vec![
            ("DATABASE_URL", database.clone()),
            ("NATS_URL", nats_url.clone()),
            ("WAYBILL_LOG_FORMAT", log_format.to_owned()),
        ];
        let cases: Vec<(&str, Vec<&str>, &Envs)> = vec![
            ("waybill", vec!["migrate"], &bad_database),
            ("waybill", vec!["--json", "migrate"], &bad_database),
            ("waybill", vec!["show", &order], &bad_database),
            ("waybill", vec!["--json", "outbox", "status"], &bad_database),
            ("waybill-relay", vec!["run", "--once"], &bad_database),
            ("waybill-relay", vec!["--json", "status"], &bad_database),
            ("waybill-relay", vec!["provision"], &bad_nats),
            ("waybill-relay", vec!["--json", "provision"], &bad_nats),
            ("waybill-inventory", vec!["run", "--once"], &bad_database),
            ("waybill-points", vec!["--json", "run", "--once"], &bad_nats),
            ("waybill-search", vec!["run", "--once"], &bad_nats),
            (
                "waybill-inventory",
                vec!["--json", "parked", "list"],
                &bad_database,
            ),
        ];
        for (program, args, envs) in cases {
            let envs = envs.clone();
            let markers = markers(n);
            let what = format!("{program} {args:?} with {separator:?} in the password");
            runs.push(Box::pin(async move {
                let done = run(program, &args, &envs).await;
                assert_ne!(done.code, 0, "{what} cannot have succeeded");
                assert_hidden(&what, &done, &markers);
                if args.contains(&"--json") {
                    let error = done.json();
                    assert!(error["error"]["message"].is_string(), "{what}: {error}");
                }
            }));
        }
        // A NATS list whose first server's password holds the separator.
        let list = format!("{nats_url},nats://127.0.0.1:{closed}");
        let envs = vec![("DATABASE_URL", database.clone()), ("NATS_URL", list)];
        let markers = markers(n);
        runs.push(Box::pin(async move {
            let done = run("waybill-inventory", &["run", "--once"], &envs).await;
            assert_hidden("a NATS server list", &done, &markers);
        }));
    }
    // Most runs wait out a pool's 10 s for the closed port: many at a time.
    futures::stream::iter(runs)
        .buffer_unordered(64)
        .collect::<Vec<()>>()
        .await;
}

#[tokio::test]
async fn a_key_value_connection_string_keeps_its_quoted_password() {
    let closed = testkit::free_port().expect("a free port");
    let url = format!(r"host=127.0.0.1 port={closed} user=u password='Leak0L x\' Leak0R' dbname=w");
    for args in [&["migrate"][..], &["--json", "migrate"]] {
        let done = run("waybill", args, &[("DATABASE_URL", url.clone())]).await;
        assert_eq!(done.code, 1, "{}{}", done.stdout, done.stderr);
        assert_hidden("a key/value DATABASE_URL", &done, &markers(0));
        let printed = format!("{}{}", done.stdout, done.stderr);
        assert!(printed.contains("must be a URL"), "{printed}");
    }
}

#[tokio::test]
async fn no_help_page_of_any_binary_shows_an_environment_value() {
    testkit::build_workspace_binaries(env!("CARGO_MANIFEST_DIR"));
    for program in BINARIES {
        // Every page: the binary's, each subcommand's and each of theirs.
        let mut pages: Vec<Vec<String>> = vec![vec![]];
        let mut at = 0;
        while at < pages.len() {
            let path = pages[at].clone();
            at += 1;
            let mut args = path.clone();
            args.push("--help".into());
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            let help = run(program, &args, &[]).await;
            assert_eq!(help.code, 0, "{program} {args:?}: {}", help.stderr);
            if path.len() < 2 {
                for command in subcommands(&help.stdout) {
                    let mut deeper = path.clone();
                    deeper.push(command);
                    pages.push(deeper);
                }
            }
            // Now with every variable the page names set to a URL holding a password.
            let secret = password(99, "#");
            let value = format!("http://u:{secret}@127.0.0.1:1/x");
            let envs: Vec<(&str, String)> = env_names(&help.stdout)
                .into_iter()
                .map(|name| (name, value.clone()))
                .collect();
            assert!(
                path.is_empty() || !envs.is_empty() || !help.stdout.contains("[env:"),
                "{program} {args:?}: variables not found in\n{}",
                help.stdout
            );
            let with_secrets = run(program, &args, &envs).await;
            assert_eq!(with_secrets.code, 0, "{program} {args:?}");
            assert_hidden(&format!("{program} {args:?}"), &with_secrets, &markers(99));
        }
        assert!(pages.len() > 1, "{program} has subcommands");
    }
}

/// The subcommands a help page lists under "Commands:" (not `help`).
fn subcommands(help: &str) -> Vec<String> {
    help.lines()
        .skip_while(|line| !line.starts_with("Commands:"))
        .skip(1)
        .take_while(|line| line.starts_with("  "))
        .filter(|line| !line.starts_with("   "))
        .filter_map(|line| line.split_whitespace().next())
        .filter(|name| *name != "help")
        .map(str::to_owned)
        .collect()
}

/// The environment variables a help page names (`[env: NAME]`), each once.
fn env_names(help: &str) -> Vec<&'static str> {
    let mut names: Vec<&'static str> = help
        .split("[env:")
        .skip(1)
        .filter_map(|rest| {
            let name = rest
                .trim_start()
                .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .next()?;
            (!name.is_empty()).then(|| &*Box::leak(name.to_owned().into_boxed_str()))
        })
        .collect();
    names.sort_unstable();
    names.dedup();
    names
}
