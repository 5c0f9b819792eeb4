//! How every binary reads its command line: `--help` never shows an environment variable's value
//! (a URL with a password in `DATABASE_URL`, `WAYBILL_PROJECTION_APIS` or any variable added later),
//! and the secrets the process was given are remembered, so that nothing it prints repeats them
//! ([`crate::redact_text`]).

use clap::{ArgMatches, Command, FromArgMatches, Parser};

/// Parses the process's arguments as `C` (exiting with clap's message and code 2 on a bad one, or
/// after printing `--help` or `--version`).
pub fn parse<C: Parser>() -> C {
    parse_command(C::command())
}

/// [`parse`] with a command built (or renamed) by the caller.
pub fn parse_command<C: FromArgMatches>(command: Command) -> C {
    parse_command_from(command, std::env::args_os())
}

/// [`parse_command`] of `args` (the program's name first) rather than the process's own: for a
/// program that hands its arguments on (`waybill-projection <name> …`).
pub fn parse_command_from<C: FromArgMatches>(
    command: Command,
    args: impl IntoIterator<Item = impl Into<std::ffi::OsString> + Clone>,
) -> C {
    let mut command = hide_env_values(command);
    let matches = command
        .try_get_matches_from_mut(args)
        .unwrap_or_else(|error| exit(error));
    remember_secrets(&command, &matches);
    C::from_arg_matches(&matches).unwrap_or_else(|error| exit(error.format(&mut command)))
}

/// Prints clap's error (or the help or version it was asked for) and exits with its code. A value
/// clap rejects is quoted in its message as it was given (a URL with a password, say): redacted.
fn exit(error: clap::Error) -> ! {
    use std::io::IsTerminal;
    let rendered = error.render();
    let terminal = if error.use_stderr() {
        std::io::stderr().is_terminal()
    } else {
        std::io::stdout().is_terminal()
    };
    let rendered = if terminal {
        rendered.ansi().to_string()
    } else {
        rendered.to_string()
    };
    let shown = crate::redact_text(&rendered);
    if error.use_stderr() {
        eprint!("{shown}");
    } else {
        print!("{shown}");
    }
    std::process::exit(error.exit_code())
}

/// `command` with every argument's environment value hidden in `--help`, in every subcommand.
pub fn hide_env_values(command: Command) -> Command {
    command
        .mut_args(|arg| arg.hide_env_values(true))
        .mut_subcommands(hide_env_values)
}

/// Remembers every secret the arguments hold: the passwords in any value that is a URL or a
/// connection string, and the whole value of an argument named for a secret (`--nats-password`,
/// `--nats-token`, `--operator-token`).
fn remember_secrets(command: &Command, matches: &ArgMatches) {
    for id in matches.ids() {
        let Ok(Some(values)) = matches.try_get_raw(id.as_str()) else {
            continue;
        };
        let secret = is_secret_name(id.as_str());
        for value in values {
            let value = value.to_string_lossy();
            if secret {
                crate::redact::remember_secret(&value);
            } else {
                crate::redact::remember_secrets_in(&value);
            }
        }
    }
    if let Some((name, sub_matches)) = matches.subcommand()
        && let Some(sub_command) = command.find_subcommand(name)
    {
        remember_secrets(sub_command, sub_matches);
    }
}

fn is_secret_name(id: &str) -> bool {
    let id = id.to_ascii_lowercase();
    ["password", "token", "secret"]
        .iter()
        .any(|word| id.contains(word))
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[derive(Debug, Parser)]
    struct Example {
        #[arg(long, env = "OPS_TEST_EXAMPLE_URL")]
        url: Option<String>,
        #[command(subcommand)]
        command: Option<Sub>,
    }

    #[derive(Debug, clap::Subcommand)]
    enum Sub {
        Go {
            #[arg(long, env = "OPS_TEST_EXAMPLE_TOKEN")]
            token: Option<String>,
        },
    }

    #[test]
    fn help_shows_no_environment_value_in_any_subcommand() {
        let mut command = hide_env_values(Example::command());
        command.build();
        let mut all = vec![command.clone()];
        all.extend(command.get_subcommands().cloned());
        for command in all {
            for arg in command
                .get_arguments()
                .filter(|arg| arg.get_env().is_some())
            {
                assert!(
                    arg.is_hide_env_values_set(),
                    "{} shows its value",
                    arg.get_id()
                );
            }
        }
    }
}
