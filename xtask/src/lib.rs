//! The maintainer tools of the waybill workspace, run as `cargo xtask <command>` (the alias is in
//! `.cargo/config.toml`): the scaffold of an event type's next version with the checklist of what is
//! left (`new-version`), and a payload version's committed schema written from the catalog
//! (`write-schema`), and the README's benchmark table rendered from `docs/bench.json` (`bench-table`). Never installed and linked by no binary that is: the production CLI reads the
//! catalog, it does not generate code. `guide` reads the edits that
//! `docs/guides/new-event-version.md` shows, so that a test can carry the guide out.

pub mod bench_table;
pub mod checklist;
pub mod error;
pub mod guide;
pub mod scaffold;
pub mod schema_file;
pub mod source;
pub mod workspace;

pub use error::XtaskError;
