//! Where the tools work: the workspace's `domain/` folder, found from the current directory upwards
//! (or given with `--dir`), and paths as a maintainer reads them, from the workspace root.

use std::path::{Path, PathBuf};

use crate::XtaskError;

/// The first `domain/` with `schemas/` and `fixtures/` in `start` or above it.
pub fn find_domain_dir(start: &Path) -> Option<PathBuf> {
    start
        .ancestors()
        .map(|dir| dir.join("domain"))
        .find(|dir| dir.join("schemas").is_dir() && dir.join("fixtures").is_dir())
}

/// `--dir`, or else the domain folder found from the current directory.
pub fn domain_dir(given: Option<PathBuf>) -> Result<PathBuf, XtaskError> {
    if let Some(dir) = given {
        return Ok(dir);
    }
    let here = std::env::current_dir().map_err(XtaskError::CurrentDir)?;
    find_domain_dir(&here).ok_or(XtaskError::NoDomainDir { start: here })
}

/// `dir`'s `sub` folder, which must exist (`what` says what it is for, in the refusal).
pub fn sub_dir(dir: &Path, sub: &str, what: &'static str) -> Result<PathBuf, XtaskError> {
    let path = dir.join(sub);
    if path.is_dir() {
        Ok(path)
    } else {
        Err(XtaskError::NotADirectory { path, what })
    }
}

/// `path` (inside the domain folder `domain_dir`) as the workspace root sees it, e.g.
/// `domain/src/event.rs`, wherever the workspace is.
pub fn from_root(domain_dir: &Path, path: &Path) -> String {
    let root = domain_dir.parent().unwrap_or(Path::new(""));
    path.strip_prefix(root)
        .unwrap_or(path)
        .display()
        .to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_domain_folder_is_found_from_anywhere_in_the_workspace() {
        let crate_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
        let found = find_domain_dir(&crate_dir.join("src")).expect("found from xtask/src");
        assert_eq!(
            found.canonicalize().expect("exists"),
            crate_dir.join("../domain").canonicalize().expect("exists")
        );
        let empty = tempfile::tempdir().expect("temp dir");
        assert_eq!(find_domain_dir(empty.path()), None);
    }

    #[test]
    fn paths_are_shown_from_the_workspace_root() {
        let dir = Path::new("/somewhere/ws/domain");
        assert_eq!(
            from_root(dir, &dir.join("src/event.rs")),
            "domain/src/event.rs"
        );
    }
}
