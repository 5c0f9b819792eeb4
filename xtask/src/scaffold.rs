//! `cargo xtask new-version`: the next version of an event type (of any aggregate) scaffolded from
//! its current one — the schema file (retitled) and the golden fixture (its `event_version` bumped,
//! its layout kept), both or neither, never overwriting — with the checklist of what is left.

use std::io::Write;
use std::path::{Path, PathBuf};

use domain::aggregate::aggregate_of_event;
use domain::catalog::{
    LookupError, RELEASED_FILE, committed_text, find_schema, fixture_file_name, schema_file_name,
};
use serde_json::{Value, json};

use crate::XtaskError;
use crate::schema_file::released;
use crate::workspace::sub_dir;

/// What `new-version` wrote and what is left to do.
#[derive(Debug)]
pub struct Scaffold {
    /// The event type.
    pub event_type: String,
    /// Its current version, copied from.
    pub from: i32,
    /// The version scaffolded.
    pub to: i32,
    /// The files written.
    pub created: Vec<PathBuf>,
    /// What is left by hand, in order.
    pub steps: Vec<String>,
    /// Something worth knowing first (the current version is not released yet).
    pub note: Option<String>,
}

/// Writes `event_type`'s next version's schema and fixture under `domain_dir` (a `domain/` folder)
/// and returns them with the checklist.
pub fn new_version(domain_dir: &Path, event_type: &str) -> Result<Scaffold, XtaskError> {
    let current = find_schema(event_type, None).map_err(|error| match error {
        LookupError::UnknownVersion {
            event_type,
            version,
            ..
        } => XtaskError::CurrentNotInCatalog {
            event_type,
            version,
        },
        other => other.into(),
    })?;
    let aggregate = aggregate_of_event(event_type)
        .expect("a type with a current version belongs to an aggregate");
    let (from, to) = (current.event_version, current.event_version + 1);
    let schemas = sub_dir(domain_dir, "schemas", "the domain folder's schemas/")?;
    let fixtures = sub_dir(domain_dir, "fixtures", "the domain folder's fixtures/")?;
    let mut schema = current.schema;
    schema["title"] = json!(format!("{event_type} v{to}"));

    let source = fixtures.join(fixture_file_name(event_type, from));
    let bad_source = |why: String| XtaskError::BadSource {
        path: source.clone(),
        why,
    };
    let text = std::fs::read_to_string(&source)
        .map_err(|e| bad_source(format!("cannot read the current version's fixture: {e}")))?;
    let envelope: Value = serde_json::from_str(&text)
        .map_err(|e| bad_source(format!("the current version's fixture is not JSON: {e}")))?;
    if envelope["event_type"] != event_type || envelope["event_version"] != from {
        return Err(bad_source(format!(
            "expected an envelope of {event_type} v{from}, found event_type {} and event_version {}",
            envelope["event_type"], envelope["event_version"]
        )));
    }
    // Read before anything is written: a source that cannot be read leaves no half scaffold.
    let steps = crate::checklist::steps(domain_dir, aggregate.name, event_type, from)?;

    let targets = [
        (
            schemas.join(schema_file_name(event_type, to)),
            committed_text(&schema),
        ),
        (
            fixtures.join(fixture_file_name(event_type, to)),
            bumped_fixture(&text, &envelope, to),
        ),
    ];
    let existing: Vec<PathBuf> = targets
        .iter()
        .filter(|(path, _)| path.exists())
        .map(|(path, _)| path.clone())
        .collect();
    if !existing.is_empty() {
        return Err(XtaskError::Exists { paths: existing });
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
        Some(released) if !released.contains(&(event_type.to_owned(), from)) => Some(format!(
            "{event_type} v{from} is not marked released in {}: an unreleased version may still \
             change in place, without a v{to}",
            schemas.join(RELEASED_FILE).display()
        )),
        _ => None,
    };
    Ok(Scaffold {
        event_type: event_type.to_owned(),
        from,
        to,
        created,
        steps,
        note,
    })
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

/// Creates `path` with `content`; an existing file is refused, never replaced (even one that
/// appeared since the check).
fn create_new(path: &Path, content: &str) -> Result<(), XtaskError> {
    let write = |source| XtaskError::Write {
        path: path.to_owned(),
        source,
    };
    let file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(path);
    let mut file = match file {
        Ok(file) => file,
        Err(error) if error.kind() == std::io::ErrorKind::AlreadyExists => {
            return Err(XtaskError::Exists {
                paths: vec![path.to_owned()],
            });
        }
        Err(error) => return Err(write(error)),
    };
    file.write_all(content.as_bytes()).map_err(write)
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
