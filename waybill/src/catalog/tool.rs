//! `waybill schema` and its subcommands: the whole catalog, one payload schema (`show`, optionally
//! written as its committed file), what changed between two versions (`diff`), and the scaffold of a
//! type's next version (`new-version`).
//!
//! Everything is read from this build's catalog (`domain::catalog`) and versions
//! (`domain::event::CURRENT_VERSIONS`); the only files touched are the ones named on the command line
//! or found under the workspace's `domain/` folder. A bad type, version or folder is refused (exit 2).

use std::collections::BTreeSet;
use std::fmt;
use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::Context;
use domain::catalog::payload_schemas;
use serde_json::{Value, json};

use super::diff;
use crate::cli::{SchemaArgs, SchemaCommand, SchemaDiffArgs, SchemaNewVersionArgs, SchemaShowArgs};

/// The file, in a schemas folder, that marks which versions are released (published): their schema
/// may never change again.
pub const RELEASED_FILE: &str = "released.json";

/// Runs `waybill schema …`; `json` is the global `--json`.
pub fn run(args: SchemaArgs, json: bool) -> anyhow::Result<()> {
    match args.command {
        None => {
            let document = if args.asyncapi {
                super::asyncapi(&args.stream, &args.subject_prefix)
            } else {
                super::schemas()
            };
            println!(
                "{}",
                serde_json::to_string_pretty(&document).context("encoding the catalog")?
            );
            Ok(())
        }
        Some(SchemaCommand::Show(args)) => show(args, json),
        Some(SchemaCommand::Diff(args)) => diff_command(args, json),
        Some(SchemaCommand::NewVersion(args)) => new_version(args, json),
    }
}

/// Why a `waybill schema` subcommand refused its input (exit 2; nothing was written).
#[derive(Debug)]
pub enum SchemaError {
    /// The event type is not in the catalog.
    UnknownType {
        event_type: String,
        known: Vec<String>,
    },
    /// The type is known, the version is not.
    UnknownVersion {
        event_type: String,
        version: i32,
        known: Vec<i32>,
    },
    /// The type's current version has no schema in this build's catalog.
    CurrentNotInCatalog { event_type: String, version: i32 },
    /// A folder that should exist does not.
    NotADirectory { path: PathBuf, what: &'static str },
    /// No `domain/` folder (with `schemas/` and `fixtures/`) above the current directory.
    NoDomainDir { start: PathBuf },
    /// The file `new-version` copies from is missing or is not the envelope it should be.
    BadSource { path: PathBuf, why: String },
    /// `new-version` never overwrites.
    Exists { paths: Vec<PathBuf> },
    /// `show --write` would change a released version's committed schema.
    Released {
        event_type: String,
        version: i32,
        file: PathBuf,
        released: PathBuf,
    },
}

impl fmt::Display for SchemaError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::UnknownType { event_type, known } => write!(
                f,
                "unknown event type {event_type:?}; the catalog has {}",
                known.join(", ")
            ),
            Self::UnknownVersion {
                event_type,
                version,
                known,
            } => {
                let known: Vec<String> = known.iter().map(i32::to_string).collect();
                write!(
                    f,
                    "{event_type} has no version {version} in the catalog; its versions are {}",
                    known.join(", ")
                )
            }
            Self::CurrentNotInCatalog {
                event_type,
                version,
            } => write!(
                f,
                "{event_type} is at version {version} (CURRENT_VERSIONS in domain/src/event.rs) but the \
                 catalog (domain/src/catalog.rs) has no schema for it yet: add that first"
            ),
            Self::NotADirectory { path, what } => {
                write!(f, "{} is not a directory ({what})", path.display())
            }
            Self::NoDomainDir { start } => write!(
                f,
                "no domain/ folder with schemas/ and fixtures/ in {} or above it; pass --dir DOMAIN_DIR",
                start.display()
            ),
            Self::BadSource { path, why } => write!(f, "{}: {why}", path.display()),
            Self::Exists { paths } => {
                let paths: Vec<String> = paths.iter().map(|p| p.display().to_string()).collect();
                write!(
                    f,
                    "{} already exist{}; nothing was written (new-version never overwrites: delete \
                     them to scaffold again)",
                    paths.join(" and "),
                    if paths.len() == 1 { "s" } else { "" }
                )
            }
            Self::Released {
                event_type,
                version,
                file,
                released,
            } => write!(
                f,
                "{event_type} v{version} is released ({}): its schema may never change, and {} differs \
                 from this build's; nothing was written. Revert the change to the schema and publish a \
                 new version instead: waybill schema new-version {event_type}",
                released.display(),
                file.display()
            ),
        }
    }
}

impl std::error::Error for SchemaError {}

fn refused(error: SchemaError) -> anyhow::Error {
    ops::Refused::new(error).into()
}

/// The committed file name of a payload schema: `<type>.v<N>.schema.json`.
pub fn schema_file_name(event_type: &str, version: i32) -> String {
    format!("{event_type}.v{version}.schema.json")
}

/// The golden fixture's file name: `<type>.v<N>.json`.
fn fixture_file_name(event_type: &str, version: i32) -> String {
    format!("{event_type}.v{version}.json")
}

/// A schema exactly as it is committed under `domain/schemas/`: pretty JSON (two-space indent, keys
/// in order, as serde_json writes them) and a final newline.
pub fn committed_text(schema: &Value) -> String {
    let mut text = serde_json::to_string_pretty(schema)
        .expect("a serde_json::Value always serialises (its keys are strings)");
    text.push('\n');
    text
}

/// The catalog's schema of `event_type` at `version`, by default the type's current version.
pub fn schema(event_type: &str, version: Option<i32>) -> Result<(i32, Value), SchemaError> {
    let all = payload_schemas();
    let versions: Vec<i32> = all
        .iter()
        .filter(|s| s.event_type == event_type)
        .map(|s| s.event_version)
        .collect();
    let Some(version) = version.or_else(|| domain::event::current_version(event_type)) else {
        return Err(unknown_type(event_type));
    };
    if versions.is_empty() {
        return Err(unknown_type(event_type));
    }
    all.into_iter()
        .find(|s| s.event_type == event_type && s.event_version == version)
        .map(|s| (version, s.schema))
        .ok_or_else(|| SchemaError::UnknownVersion {
            event_type: event_type.to_owned(),
            version,
            known: versions,
        })
}

fn unknown_type(event_type: &str) -> SchemaError {
    let mut known: Vec<String> = Vec::new();
    for entry in payload_schemas() {
        if !known.iter().any(|k| k == entry.event_type) {
            known.push(entry.event_type.to_owned());
        }
    }
    SchemaError::UnknownType {
        event_type: event_type.to_owned(),
        known,
    }
}

/// The `(type, version)`s a schemas folder's `released.json` lists; `None` when it has none.
pub fn released(schemas_dir: &Path) -> anyhow::Result<Option<BTreeSet<(String, i32)>>> {
    let path = schemas_dir.join(RELEASED_FILE);
    let text = match std::fs::read_to_string(&path) {
        Ok(text) => text,
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(error) => {
            return Err(error).with_context(|| format!("cannot read {}", path.display()));
        }
    };
    parse_released(&text)
        .map(Some)
        .with_context(|| format!("{} is not a list of released versions", path.display()))
}

/// `{"released": {"<type>": [<version>, …], …}}` (other top-level keys, such as `$comment`, are
/// ignored).
fn parse_released(text: &str) -> anyhow::Result<BTreeSet<(String, i32)>> {
    let document: Value = serde_json::from_str(text).context("not JSON")?;
    let types = document["released"]
        .as_object()
        .context(r#"expected {"released": {"<type>": [<version>, …]}}"#)?;
    let mut found = BTreeSet::new();
    for (event_type, versions) in types {
        let versions = versions
            .as_array()
            .with_context(|| format!("the versions of {event_type} are not a list"))?;
        for version in versions {
            let version = version
                .as_i64()
                .and_then(|v| i32::try_from(v).ok())
                .with_context(|| format!("{event_type}: {version} is not a version number"))?;
            found.insert((event_type.clone(), version));
        }
    }
    Ok(found)
}

/// `waybill schema show`.
fn show(args: SchemaShowArgs, json: bool) -> anyhow::Result<()> {
    let (version, schema) = schema(&args.event_type, args.version).map_err(refused)?;
    let text = committed_text(&schema);
    let Some(dir) = args.write else {
        print!("{text}");
        return Ok(());
    };
    if !dir.is_dir() {
        return Err(refused(SchemaError::NotADirectory {
            path: dir,
            what: "--write takes the folder of the schema files, e.g. domain/schemas",
        }));
    }
    let path = dir.join(schema_file_name(&args.event_type, version));
    // Regenerating an unreleased version's file is the point of --write; rewriting a released one
    // with a different schema would make the committed copy agree with a change that must not be made.
    if let Some(released) = released(&dir)?
        && released.contains(&(args.event_type.clone(), version))
        && let Ok(existing) = std::fs::read_to_string(&path)
        && serde_json::from_str::<Value>(&existing).ok().as_ref() != Some(&schema)
    {
        return Err(refused(SchemaError::Released {
            event_type: args.event_type,
            version,
            file: path,
            released: dir.join(RELEASED_FILE),
        }));
    }
    std::fs::write(&path, text).with_context(|| format!("cannot write {}", path.display()))?;
    if json {
        println!(
            "{}",
            json!({"event_type": args.event_type, "version": version, "path": path})
        );
    } else {
        println!("{}", path.display());
    }
    Ok(())
}

/// `waybill schema diff`.
fn diff_command(args: SchemaDiffArgs, json: bool) -> anyhow::Result<()> {
    let (from, old) = schema(&args.event_type, Some(args.from)).map_err(refused)?;
    let (to, new) = schema(&args.event_type, Some(args.to)).map_err(refused)?;
    let changes = diff::diff(&old, &new);
    if json {
        println!(
            "{}",
            json!({"event_type": args.event_type, "from": from, "to": to, "changes": changes})
        );
    } else {
        print!("{}", diff::render(&args.event_type, from, to, &changes));
    }
    Ok(())
}

/// The workspace's `domain/` folder: the first `domain/` with `schemas/` and `fixtures/` in `start`
/// or above it.
pub fn find_domain_dir(start: &Path) -> Option<PathBuf> {
    start
        .ancestors()
        .map(|dir| dir.join("domain"))
        .find(|dir| dir.join("schemas").is_dir() && dir.join("fixtures").is_dir())
}

/// `order.placed` → `OrderPlaced`, the payload struct's name in `domain/src/event.rs`.
fn struct_name(event_type: &str) -> String {
    event_type
        .split(['.', '_'])
        .map(|word| {
            let mut chars = word.chars();
            chars.next().map_or_else(String::new, |first| {
                first.to_uppercase().chain(chars).collect()
            })
        })
        .collect()
}

/// The next version's fixture: `current` (the text of the current version's fixture) with its
/// `event_version` replaced in place, so the hand-made layout survives; pretty JSON should the text
/// not allow that (the result is checked by parsing it back).
fn bumped_fixture(current: &str, envelope: &Value, next: i32) -> String {
    let mut expected = envelope.clone();
    expected["event_version"] = json!(next);
    let key = "\"event_version\"";
    let edited = current.find(key).and_then(|at| {
        let rest = &current[at + key.len()..];
        let after_colon = rest.trim_start().strip_prefix(':')?;
        let digits_at = current.len() - after_colon.trim_start().len();
        let digits = current[digits_at..]
            .bytes()
            .take_while(u8::is_ascii_digit)
            .count();
        (digits > 0).then(|| {
            format!(
                "{}{next}{}",
                &current[..digits_at],
                &current[digits_at + digits..]
            )
        })
    });
    match edited {
        Some(text) if serde_json::from_str::<Value>(&text).ok().as_ref() == Some(&expected) => text,
        _ => committed_text(&expected),
    }
}

/// What `new-version` wrote and what is left to do.
#[derive(Debug)]
struct Scaffold {
    created: Vec<PathBuf>,
    steps: Vec<String>,
    note: Option<String>,
}

/// `waybill schema new-version`.
fn new_version(args: SchemaNewVersionArgs, json: bool) -> anyhow::Result<()> {
    let dir = match args.dir {
        Some(dir) => dir,
        None => {
            let here = std::env::current_dir().context("cannot tell the current directory")?;
            find_domain_dir(&here)
                .ok_or_else(|| refused(SchemaError::NoDomainDir { start: here }))?
        }
    };
    let event_type = args.event_type;
    let current = domain::event::current_version(&event_type)
        .ok_or_else(|| refused(unknown_type(&event_type)))?;
    let scaffold = scaffold(&dir, &event_type, current)?;
    let next = current + 1;
    if json {
        println!(
            "{}",
            json!({
                "event_type": event_type,
                "from": current,
                "to": next,
                "created": scaffold.created,
                "steps": scaffold.steps,
                "note": scaffold.note,
            })
        );
        return Ok(());
    }
    for path in &scaffold.created {
        println!("created {}", path.display());
    }
    println!(
        "\n{event_type} v{next} is scaffolded from v{current}, not done. What is left, by hand:"
    );
    for (n, step) in scaffold.steps.iter().enumerate() {
        println!("  {}. {step}", n + 1);
    }
    if let Some(note) = scaffold.note {
        println!("\nnote: {note}");
    }
    Ok(())
}

/// Writes `event_type` v`current + 1`'s schema and fixture under `dir` (a `domain/` folder), both or
/// neither, and returns them with the checklist.
fn scaffold(dir: &Path, event_type: &str, current: i32) -> anyhow::Result<Scaffold> {
    let next = current + 1;
    let (schemas, fixtures) = (dir.join("schemas"), dir.join("fixtures"));
    for (path, what) in [
        (&schemas, "the domain folder's schemas/"),
        (&fixtures, "the domain folder's fixtures/"),
    ] {
        if !path.is_dir() {
            return Err(refused(SchemaError::NotADirectory {
                path: path.clone(),
                what,
            }));
        }
    }
    let mut schema = domain::catalog::payload_schema(event_type, current).ok_or_else(|| {
        refused(SchemaError::CurrentNotInCatalog {
            event_type: event_type.to_owned(),
            version: current,
        })
    })?;
    schema["title"] = json!(format!("{event_type} v{next}"));

    let source = fixtures.join(fixture_file_name(event_type, current));
    let bad_source = |why: String| {
        refused(SchemaError::BadSource {
            path: source.clone(),
            why,
        })
    };
    let text = std::fs::read_to_string(&source)
        .map_err(|e| bad_source(format!("cannot read the current version's fixture: {e}")))?;
    let envelope: Value = serde_json::from_str(&text)
        .map_err(|e| bad_source(format!("the current version's fixture is not JSON: {e}")))?;
    if envelope["event_type"] != event_type || envelope["event_version"] != current {
        return Err(bad_source(format!(
            "expected an envelope of {event_type} v{current}, found event_type {} and event_version {}",
            envelope["event_type"], envelope["event_version"]
        )));
    }

    let targets = [
        (
            schemas.join(schema_file_name(event_type, next)),
            committed_text(&schema),
        ),
        (
            fixtures.join(fixture_file_name(event_type, next)),
            bumped_fixture(&text, &envelope, next),
        ),
    ];
    let existing: Vec<PathBuf> = targets
        .iter()
        .filter(|(path, _)| path.exists())
        .map(|(path, _)| path.clone())
        .collect();
    if !existing.is_empty() {
        return Err(refused(SchemaError::Exists { paths: existing }));
    }
    let mut created = Vec::new();
    for (path, content) in &targets {
        if let Err(error) = create_new(path, content) {
            // Both files or neither: a half scaffold would make the next attempt refuse.
            for done in &created {
                let _ = std::fs::remove_file(done);
            }
            return Err(error);
        }
        created.push(path.clone());
    }

    let note = match released(&schemas)? {
        Some(released) if !released.contains(&(event_type.to_owned(), current)) => Some(format!(
            "{event_type} v{current} is not marked released in {}: an unreleased version may still \
             change in place, without a v{next}",
            schemas.join(RELEASED_FILE).display()
        )),
        _ => None,
    };
    Ok(Scaffold {
        created,
        steps: checklist(event_type, current),
        note,
    })
}

/// Creates `path` with `content`; an existing file is refused, never replaced (even one that
/// appeared since the check).
fn create_new(path: &Path, content: &str) -> anyhow::Result<()> {
    let file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(path);
    let mut file = match file {
        Ok(file) => file,
        Err(error) if error.kind() == std::io::ErrorKind::AlreadyExists => {
            return Err(refused(SchemaError::Exists {
                paths: vec![path.to_owned()],
            }));
        }
        Err(error) => {
            return Err(error).with_context(|| format!("cannot create {}", path.display()));
        }
    };
    file.write_all(content.as_bytes())
        .with_context(|| format!("cannot write {}", path.display()))
}

/// The steps after the scaffold, each naming the file to change (paths from the workspace root).
fn checklist(event_type: &str, current: i32) -> Vec<String> {
    let next = current + 1;
    let payload = struct_name(event_type);
    vec![
        format!(
            "domain/src/event.rs: change the payload struct {payload} to v{next}'s shape (new fields, \
             changed types), and set each new field in its constructor (from_command, for \
             order.placed: from the command, or a default)."
        ),
        format!(
            "domain/src/event.rs: bump {event_type} from {current} to {next} in CURRENT_VERSIONS."
        ),
        format!(
            "domain/src/upcast.rs: add the step (\"{event_type}\", {current}) → {next} in \
             Upcasters::orders() with with_named_step, deciding what older events get for each new \
             or changed field (every older version then travels through it), and a downcaster \
             {next} → {current} (with_downcast) so writers can hold back during a rollout."
        ),
        format!(
            "domain/src/catalog.rs: add the {event_type} v{next} schema (title \"{event_type} \
             v{next}\") to payload_schemas(), then regenerate its committed file from it: waybill \
             schema show {event_type} --version {next} --write domain/schemas"
        ),
        format!(
            "domain/fixtures/{}: give its payload v{next}'s fields (current fixtures must re-encode \
             exactly).",
            fixture_file_name(event_type, next)
        ),
        "A new field without a default needs a value from whoever issues the command: the command \
         in domain/src/order.rs, the CLI in waybill/src/cli.rs, the HTTP body in waybill/src/http.rs \
         and the OpenAPI document in waybill/src/openapi.rs."
            .to_owned(),
        format!(
            "Once v{next} is published, add {next} to \"{event_type}\" in \
             domain/schemas/{RELEASED_FILE}: from then on its schema may never change. Until then it \
             may, and `--write` regenerates its file."
        ),
        format!(
            "Check: cargo test -p domain --test schemas --test fixtures; waybill schema diff \
             {event_type} {current} {next}"
        ),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn show_prints_one_schema_as_committed() {
        let (version, schema) = schema("order.placed", Some(2)).expect("order.placed v2");
        assert_eq!(version, 2);
        assert_eq!(schema["title"], "order.placed v2");
        let text = committed_text(&schema);
        assert!(text.ends_with("}\n") && !text.ends_with("\n\n"), "{text}");
        assert!(text.starts_with("{\n  \"$schema\": "), "{text}");
        let committed = std::fs::read_to_string(
            Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../domain/schemas")
                .join(schema_file_name("order.placed", 2)),
        )
        .expect("the committed v2 schema");
        assert_eq!(text, committed, "byte for byte");
    }

    #[test]
    fn show_defaults_to_the_current_version() {
        let current = domain::event::current_version("order.paid").expect("order.paid");
        let (version, _) = schema("order.paid", None).expect("order.paid's current version");
        assert_eq!(version, current);
    }

    #[test]
    fn unknown_types_and_versions_are_named() {
        let error = schema("order.teleported", Some(1)).expect_err("unknown type");
        let text = error.to_string();
        assert!(
            text.contains("\"order.teleported\"") && text.contains("order.placed"),
            "{text}"
        );
        let error = schema("order.paid", Some(99)).expect_err("unknown version");
        assert_eq!(
            error.to_string(),
            "order.paid has no version 99 in the catalog; its versions are 1"
        );
        let error = schema("order.teleported", None).expect_err("unknown type, no version");
        assert!(matches!(error, SchemaError::UnknownType { .. }), "{error}");
    }

    #[test]
    fn released_json_is_read_and_checked() {
        let found = parse_released(
            r#"{"$comment": "x", "released": {"order.placed": [1, 2], "order.paid": [1]}}"#,
        )
        .expect("parses");
        assert_eq!(
            found,
            BTreeSet::from([
                ("order.paid".to_owned(), 1),
                ("order.placed".to_owned(), 1),
                ("order.placed".to_owned(), 2),
            ])
        );
        assert!(parse_released(r#"{"order.placed": [1]}"#).is_err());
        assert!(parse_released(r#"{"released": {"order.placed": ["1"]}}"#).is_err());
        let committed = released(&Path::new(env!("CARGO_MANIFEST_DIR")).join("../domain/schemas"))
            .expect("readable")
            .expect("domain/schemas/released.json exists");
        assert!(committed.contains(&("order.placed".to_owned(), 2)));
    }

    #[test]
    fn the_fixture_keeps_its_layout_with_the_version_bumped() {
        let text = "{\n  \"event_type\": \"x\",\n  \"event_version\": 2,\n  \"payload\": { \"a\": 1 }\n}\n";
        let envelope: Value = serde_json::from_str(text).expect("JSON");
        assert_eq!(
            bumped_fixture(text, &envelope, 3),
            "{\n  \"event_type\": \"x\",\n  \"event_version\": 3,\n  \"payload\": { \"a\": 1 }\n}\n"
        );
        // A version written in a way the in-place edit does not handle still comes out right.
        let odd = "{\"event_type\": \"x\", \"event_version\": 2.0}";
        let envelope: Value = serde_json::from_str(odd).expect("JSON");
        let bumped: Value = serde_json::from_str(&bumped_fixture(odd, &envelope, 3)).expect("JSON");
        assert_eq!(bumped["event_version"], 3);
    }

    #[test]
    fn the_checklist_names_every_file_to_change() {
        assert_eq!(struct_name("order.placed"), "OrderPlaced");
        assert_eq!(struct_name("order.line_added"), "OrderLineAdded");
        let steps = checklist("order.placed", 3).join("\n");
        for expected in [
            "domain/src/event.rs",
            "OrderPlaced",
            "CURRENT_VERSIONS",
            "domain/src/upcast.rs",
            "(\"order.placed\", 3) → 4",
            "Upcasters::orders()",
            "domain/src/catalog.rs",
            "waybill schema show order.placed --version 4 --write domain/schemas",
            "domain/fixtures/order.placed.v4.json",
            "domain/src/order.rs",
            "waybill/src/cli.rs",
            "waybill/src/http.rs",
            "waybill/src/openapi.rs",
            "domain/schemas/released.json",
        ] {
            assert!(
                steps.contains(expected),
                "{expected:?} missing from:\n{steps}"
            );
        }
    }

    #[test]
    fn the_domain_folder_is_found_from_anywhere_in_the_workspace() {
        let crate_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
        let found = find_domain_dir(&crate_dir.join("src")).expect("found from waybill/src");
        assert_eq!(
            found.canonicalize().expect("exists"),
            crate_dir.join("../domain").canonicalize().expect("exists")
        );
        let empty = tempfile::tempdir().expect("temp dir");
        assert_eq!(find_domain_dir(empty.path()), None);
    }
}
