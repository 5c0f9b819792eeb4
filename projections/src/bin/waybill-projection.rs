//! `waybill-projection <name> …`: runs a read model of `projections/src/models/` — the same commands
//! as every projection binary (`run`, `rebuild`, `redrive`, `parked …`, `held …`) plus `show`,
//! `expect` and `check`. `waybill-projection list` names them.

use std::process::ExitCode;

fn main() -> ExitCode {
    let mut args = std::env::args().skip(1);
    let name = args.next();
    match name.as_deref() {
        None | Some("-h" | "--help" | "help") => {
            println!(
                "waybill-projection NAME COMMAND: runs the read model NAME (see `waybill-projection NAME --help`)\n\n\
                 Read models in this build (projections/src/models/):"
            );
            list();
            ExitCode::SUCCESS
        }
        Some("list") => {
            list();
            ExitCode::SUCCESS
        }
        Some(name) => match projections::registry::model(name) {
            Some(model) => {
                let rest: Vec<String> = std::iter::once(format!("waybill-projection {name}"))
                    .chain(args)
                    .collect();
                tokio::runtime::Builder::new_multi_thread()
                    .enable_all()
                    .build()
                    .map_or(ExitCode::FAILURE, |runtime| {
                        runtime.block_on(model.main(rest))
                    })
            }
            None => {
                eprintln!(
                    "error: no read model {name:?} in this build; these are: {}",
                    projections::registry::MODELS
                        .iter()
                        .map(|m| m.name())
                        .collect::<Vec<_>>()
                        .join(", ")
                );
                ExitCode::from(2)
            }
        },
    }
}

fn list() {
    for model in projections::registry::MODELS {
        println!(
            "  {:<16} {} (reads {})",
            model.name(),
            model.about(),
            model.aggregates().join(", ")
        );
    }
}
