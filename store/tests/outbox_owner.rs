//! `store::outbox` is the outbox's one owner: no other non-test source file of the workspace spells
//! SQL that names its tables or their columns (the chaos verdict excepted: it keeps its own SQL as an
//! independent oracle), and no relay or store code tells a failure apart by the text of its error.
//!
//! The scan reads every `.rs` file outside `target/`, `tests/` directories and the migrations, and
//! fails naming each file and line that spells such SQL.

use std::path::{Path, PathBuf};

/// Where the outbox's statements may live, relative to the workspace root.
const OWNER: &str = "store/src/outbox";

/// The owner's files (DESIGN: few, so the statements stay findable).
const OWNER_FILES_AT_MOST: usize = 3;

/// Kept apart on purpose: the chaos verdict's SQL is an oracle independent of the code it judges.
const EXEMPT: [&str; 1] = ["lab/src/chaos/verdict.rs"];

/// The tables the owner owns.
const TABLES: [&str; 2] = [store::outbox::TABLE, store::outbox::JOURNAL_TABLE];

/// SQL words after which a table name is SQL, not prose (`GRANT … ON outbox`, `VACUUM ANALYZE outbox`).
const BEFORE_TABLE: [&str; 10] = [
    "from", "join", "update", "into", "table", "truncate", "analyze", "vacuum", "on", "only",
];

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("store sits in the workspace")
        .to_path_buf()
}

/// Every `.rs` file under `dir` that is not a test, a build output or a migration.
fn sources(dir: &Path, found: &mut Vec<PathBuf>) {
    let entries = std::fs::read_dir(dir).unwrap_or_else(|e| panic!("reading {dir:?}: {e}"));
    for entry in entries {
        let path = entry.expect("a directory entry").path();
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if path.is_dir() {
            if !matches!(name, "target" | "tests" | "migrations" | "node_modules")
                && !name.starts_with('.')
            {
                sources(&path, found);
            }
        } else if name.ends_with(".rs") {
            found.push(path);
        }
    }
}

fn is_ident(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

/// The words (identifiers) of `line` with where each starts.
fn words(line: &str) -> Vec<(usize, &str)> {
    let mut words = Vec::new();
    let mut start = None;
    for (i, c) in line.char_indices().chain([(line.len(), ' ')]) {
        match (start, is_ident(c)) {
            (None, true) => start = Some(i),
            (Some(s), false) => {
                words.push((s, &line[s..i]));
                start = None;
            }
            _ => {}
        }
    }
    words
}

/// Why `line` spells outbox SQL, if it does: a table after a SQL word (through a list:
/// `ON events, outbox`), a table as a quoted name (`'outbox'::regclass`), or `outbox.<column>`.
fn outbox_sql(line: &str) -> Option<String> {
    let words = words(line);
    for (index, &(at, word)) in words.iter().enumerate() {
        if !TABLES.contains(&word) {
            continue;
        }
        let before = &line[..at];
        let after = &line[at + word.len()..];
        // `snapshot.outbox.pending`, `s.outbox`: a Rust path or a JSON key, not a table.
        if before.ends_with('.') {
            continue;
        }
        if let Some(column) = after.strip_prefix('.') {
            let column: String = column.chars().take_while(|c| is_ident(*c)).collect();
            let columns: &[&str] = if word == store::outbox::TABLE {
                &store::outbox::COLUMNS
            } else {
                &store::outbox::JOURNAL_COLUMNS
            };
            if columns.contains(&column.as_str()) {
                return Some(format!("{word}.{column}"));
            }
        }
        if before.ends_with('\'') && after.starts_with('\'') {
            return Some(format!("'{word}'"));
        }
        // Walk back over a list of names (`events, outbox_inflight, outbox`) to the word before it.
        let mut i = index;
        while i > 0 {
            let (previous_at, previous) = words[i - 1];
            let between = line[previous_at + previous.len()..words[i].0].trim();
            if between == "," {
                i -= 1;
                continue;
            }
            if between.is_empty() && BEFORE_TABLE.contains(&previous.to_ascii_lowercase().as_str())
            {
                return Some(format!("{previous} {word}"));
            }
            break;
        }
    }
    None
}

#[test]
fn the_scan_finds_outbox_sql_and_only_sql() {
    for sql in [
        "SELECT count(*) FROM outbox WHERE status = 'sent'",
        "    LEFT JOIN outbox p",
        "UPDATE outbox o SET status = 'sent'",
        "INSERT INTO outbox_inflight (claim_id) VALUES ($1)",
        "delete from outbox where id = $1",
        "GRANT SELECT ON events, outbox, outbox_inflight TO waybill_console",
        "TRUNCATE outbox, outbox_inflight",
        "VACUUM ANALYZE outbox",
        "WHERE relid = 'outbox'::regclass",
        "COMMENT: see outbox.divergence",
        "ORDER BY outbox.id",
    ] {
        assert!(outbox_sql(sql).is_some(), "not found in {sql:?}");
    }
    for prose in [
        "/// The event's outbox row, as the relay left it.",
        "(f.row(\"pending\", \"snapshot.outbox.pending\", Format::Count))",
        "let outbox = outbox.as_ref().and_then(|o| o.stream_seq);",
        "outbox.join(\", \"),",
        "reads the backlog of the outbox and of the projections",
        "FROM baseline_outbox WHERE status = 'sent'",
        "waybill outbox dead replay",
    ] {
        assert_eq!(outbox_sql(prose), None, "{prose:?}");
    }
}

#[test]
fn only_store_outbox_spells_outbox_sql() {
    let root = workspace();
    let mut files = Vec::new();
    sources(&root, &mut files);
    let relative = |path: &Path| {
        path.strip_prefix(&root)
            .expect("under the root")
            .to_string_lossy()
            .replace('\\', "/")
    };
    let mut owner_files = Vec::new();
    let mut elsewhere = Vec::new();
    for path in &files {
        let name = relative(path);
        let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("reading {name}: {e}"));
        let hits: Vec<String> = text
            .lines()
            .enumerate()
            .filter_map(|(n, line)| outbox_sql(line).map(|why| format!("{name}:{}: {why}", n + 1)))
            .collect();
        if name == format!("{OWNER}.rs") || name.starts_with(&format!("{OWNER}/")) {
            owner_files.push(name);
        } else if !EXEMPT.contains(&name.as_str()) {
            elsewhere.extend(hits);
        }
    }
    assert!(
        files.len() > 100,
        "the scan read only {} files from {root:?}",
        files.len()
    );
    assert!(
        !owner_files.is_empty() && owner_files.len() <= OWNER_FILES_AT_MOST,
        "the outbox's owner is {owner_files:?}: expected 1 to {OWNER_FILES_AT_MOST} files"
    );
    assert!(
        elsewhere.is_empty(),
        "outbox SQL outside {OWNER} (call store::outbox instead):\n{}",
        elsewhere.join("\n")
    );
}

/// A fence refusal, a divergence or a database conflict is told by its type (an error kind, a
/// SQLSTATE, a constraint name), never by reading the words of its message.
#[test]
fn no_relay_or_store_code_matches_an_errors_text() {
    let root = workspace();
    let mut files = Vec::new();
    for crate_dir in ["relay/src", "store/src"] {
        sources(&root.join(crate_dir), &mut files);
    }
    let patterns = [
        "to_string().contains(",
        "message().contains(",
        "error_chain(&error).contains(",
        "to_string().starts_with(",
        "message().starts_with(",
        "last_error LIKE",
    ];
    let found: Vec<String> = files
        .iter()
        .flat_map(|path| {
            let text = std::fs::read_to_string(path).expect("readable");
            let name = path
                .strip_prefix(&root)
                .expect("under the root")
                .display()
                .to_string();
            text.lines()
                .enumerate()
                .filter(|(_, line)| patterns.iter().any(|p| line.contains(p)))
                .map(|(n, line)| format!("{name}:{}: {}", n + 1, line.trim()))
                .collect::<Vec<_>>()
        })
        .collect();
    assert!(files.len() > 20, "read only {} files", files.len());
    assert!(
        found.is_empty(),
        "errors matched by their text:\n{}",
        found.join("\n")
    );
}
