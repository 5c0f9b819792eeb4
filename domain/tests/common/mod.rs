//! What the domain's integration tests share: the golden fixtures under `domain/fixtures/`.

use std::path::PathBuf;

use domain::EventEnvelope;

/// Every fixture as `(file name, envelope)`, in name order so failures read the same on every run.
pub(crate) fn fixtures() -> Vec<(String, EventEnvelope)> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fixtures");
    let mut found = Vec::new();
    for entry in std::fs::read_dir(&dir).expect("fixtures folder exists") {
        let path = entry.expect("readable entry").path();
        if path.extension().is_some_and(|e| e == "json") {
            let name = path
                .file_name()
                .expect("file name")
                .to_string_lossy()
                .into_owned();
            let bytes = std::fs::read(&path).expect("readable fixture");
            let envelope = EventEnvelope::from_json(&bytes)
                .unwrap_or_else(|e| panic!("domain/fixtures/{name} is not an envelope: {e}"));
            found.push((name, envelope));
        }
    }
    found.sort_by(|a, b| a.0.cmp(&b.0));
    assert!(!found.is_empty(), "domain/fixtures/ holds no fixture");
    found
}
