//! Why a maintainer tool did nothing: the caller's input refused (exit 2), or the files could not be
//! read or written (exit 1).

use std::path::PathBuf;

use domain::catalog::{LookupError, ReleasedError};

/// What went wrong; [`XtaskError::is_refusal`] says which exit code it gets. Nothing was written.
#[derive(Debug, thiserror::Error)]
pub enum XtaskError {
    /// The catalog has no such type or version.
    #[error(transparent)]
    Lookup(#[from] LookupError),
    /// The type's current version has no schema in the catalog (the code is half changed).
    #[error(
        "{event_type} is at version {version} (its aggregate's CURRENT_VERSIONS) but the catalog has \
         no schema for it yet: add that first"
    )]
    CurrentNotInCatalog {
        /// The event type.
        event_type: String,
        /// Its current version.
        version: i32,
    },
    /// A folder that should exist does not.
    #[error("{} is not a directory ({what})", path.display())]
    NotADirectory {
        /// The path given or derived.
        path: PathBuf,
        /// What it should have been.
        what: &'static str,
    },
    /// No `domain/` folder (with `schemas/` and `fixtures/`) above the current directory.
    #[error(
        "no domain/ folder with schemas/ and fixtures/ in {} or above it; pass --dir DOMAIN_DIR",
        start.display()
    )]
    NoDomainDir {
        /// Where the search started.
        start: PathBuf,
    },
    /// The current version's fixture is missing or is not the envelope it should be.
    #[error("{}: {why}", path.display())]
    BadSource {
        /// The fixture.
        path: PathBuf,
        /// What is wrong with it.
        why: String,
    },
    /// `bench-table`: the bench document or the README is not what it should be.
    #[error("{}: {why}", path.display())]
    BadBench {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        why: String,
    },
    /// `bench-table --check`: the README's table is not the one the bench document gives.
    #[error("{} has a stale benchmark table: run `cargo xtask bench-table` to regenerate it from {}", readme.display(), bench.display())]
    StaleBenchTable {
        /// The README.
        readme: PathBuf,
        /// The bench document.
        bench: PathBuf,
    },
    /// `new-version` never overwrites.
    #[error(
        "{} already exist{}; nothing was written (new-version never overwrites: delete them to \
         scaffold again)",
        paths.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(" and "),
        if paths.len() == 1 { "s" } else { "" }
    )]
    Exists {
        /// The files in the way.
        paths: Vec<PathBuf>,
    },
    /// `write-schema` would change a released version's committed schema.
    #[error(
        "{event_type} v{version} is released ({}): its schema may never change, and {} differs from \
         this build's; nothing was written. Revert the change to the schema and publish a new \
         version instead: cargo xtask new-version {event_type}",
        released.display(),
        file.display()
    )]
    Released {
        /// The event type.
        event_type: String,
        /// The released version.
        version: i32,
        /// Its committed schema.
        file: PathBuf,
        /// The list that says it is released.
        released: PathBuf,
    },
    /// The list of released versions is broken.
    #[error("{} is not a list of released versions", path.display())]
    BadReleased {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        source: ReleasedError,
    },
    /// The working directory cannot be told.
    #[error("cannot tell the current directory")]
    CurrentDir(#[source] std::io::Error),
    /// A file or folder could not be read.
    #[error("cannot read {}", path.display())]
    Read {
        /// What was read.
        path: PathBuf,
        /// Why not.
        source: std::io::Error,
    },
    /// A file could not be written.
    #[error("cannot write {}", path.display())]
    Write {
        /// What was written.
        path: PathBuf,
        /// Why not.
        source: std::io::Error,
    },
}

impl XtaskError {
    /// True when the caller's input was refused (exit 2): repeating it will not help. Otherwise the
    /// file system failed (exit 1).
    pub fn is_refusal(&self) -> bool {
        !matches!(
            self,
            Self::BadReleased { .. } | Self::CurrentDir(_) | Self::Read { .. } | Self::Write { .. }
        )
    }
}
