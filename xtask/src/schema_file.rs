//! `cargo xtask write-schema`: a payload version's committed schema file
//! (`domain/schemas/<type>.v<N>.schema.json`) written from this build's catalog, never changing a
//! released one; and the list of released versions (`domain/schemas/released.json`).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use domain::catalog::{
    RELEASED_FILE, committed_text, find_schema, parse_released, schema_file_name,
};
use serde_json::Value;

use crate::XtaskError;
use crate::workspace::sub_dir;

/// The `(type, version)`s a schemas folder's `released.json` lists; `None` when it has none.
pub fn released(schemas_dir: &Path) -> Result<Option<BTreeSet<(String, i32)>>, XtaskError> {
    let path = schemas_dir.join(RELEASED_FILE);
    let text = match std::fs::read_to_string(&path) {
        Ok(text) => text,
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(source) => return Err(XtaskError::Read { path, source }),
    };
    parse_released(&text)
        .map(Some)
        .map_err(|source| XtaskError::BadReleased { path, source })
}

/// What `write-schema` wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Written {
    /// The event type.
    pub event_type: String,
    /// The version written.
    pub version: i32,
    /// The file.
    pub path: PathBuf,
}

/// Writes `event_type` v`version` (default: its current version) from the catalog into
/// `domain_dir/schemas/`, exactly as committed files are laid out. Regenerating an unreleased
/// version's file is the point; a released one's is rewritten only when its bytes change and its
/// schema does not.
pub fn write_schema(
    domain_dir: &Path,
    event_type: &str,
    version: Option<i32>,
) -> Result<Written, XtaskError> {
    let found = find_schema(event_type, version)?;
    let schemas = sub_dir(domain_dir, "schemas", "the domain folder's schemas/")?;
    let path = schemas.join(schema_file_name(event_type, found.event_version));
    // Rewriting a released version with a different schema would make the committed copy agree
    // with a change that must not be made.
    if let Some(released) = released(&schemas)?
        && released.contains(&(event_type.to_owned(), found.event_version))
        && let Ok(existing) = std::fs::read_to_string(&path)
        && serde_json::from_str::<Value>(&existing).ok().as_ref() != Some(&found.schema)
    {
        return Err(XtaskError::Released {
            event_type: event_type.to_owned(),
            version: found.event_version,
            file: path,
            released: schemas.join(RELEASED_FILE),
        });
    }
    std::fs::write(&path, committed_text(&found.schema)).map_err(|source| XtaskError::Write {
        path: path.clone(),
        source,
    })?;
    Ok(Written {
        event_type: event_type.to_owned(),
        version: found.event_version,
        path,
    })
}
