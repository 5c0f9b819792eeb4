//! Keeping secrets out of what is printed: the password in a URL's user info, secret query parameters
//! and key/value connection-string settings (`password='…'`), and every secret the process was given
//! (remembered when its command line is read), wherever they appear in a text.
//!
//! A password may hold any character, and users paste them unencoded: `postgres://u:pa,ss@h/db`
//! (`,` is legal in user info), `nats://u:p#ss@h`, `postgres://u:12/ss@h/db`. The URL parser the
//! clients use (the `url` crate, under sqlx and async-nats) refuses some of these and misreads others
//! (the last one as host `u`, port 12, path `/ss@h/db`), so what is hidden is decided by a rule that
//! is never narrower than any reading: the user info runs from `://` to the LAST `@` of the URL, and
//! everything after its first `:` is the password. A URL with an `@` in its query
//! (`?application_name=a@b`) is then shown with more hidden than needed, never less. The parser's
//! reading of the password (percent-decoded, as the client will send it) is remembered too, so a
//! message that quotes it in that form is caught by value.

use std::ops::Range;
use std::sync::RwLock;

/// What a secret is replaced with.
const MASK: &str = "***";

/// Parameters whose values are secrets, in a URL's query or a key/value connection string.
const SECRET_PARAMETERS: &[&str] = &[
    "password",
    "sslpassword",
    "passwd",
    "token",
    "pass",
    "secret",
];

/// Remembered secrets shorter than this are not hunted for by value: a one-letter password would
/// turn every such letter of a message into `***`. Where they stand in a URL or a parameter they are
/// hidden all the same.
const SHORTEST_REMEMBERED: usize = 4;

/// The secrets this process was given, longest first (so a secret that contains another is replaced
/// whole).
static REMEMBERED: RwLock<Vec<String>> = RwLock::new(Vec::new());

/// `value` — a URL, a comma-separated list of them, or a key/value connection string
/// (`host=h password='x y'`) — with every password and secret parameter replaced by `***`. The whole
/// of `value` is taken as configuration, so a password may hold white space or quotes.
pub fn redact_url(value: &str) -> String {
    redact_remembered(&mask(value, &found(value, Bounds::Whole)))
}

/// `text`, a message that may quote URLs or connection strings, with every password, secret
/// parameter and remembered secret replaced by `***`. In running text a URL ends at white space or a
/// quote; the configured URLs' passwords are caught by value wherever they appear.
pub fn redact_text(text: &str) -> String {
    redact_remembered(&mask(text, &found(text, Bounds::Words)))
}

/// Remembers `secret` (a password or token given on the command line or in the environment), so that
/// [`redact_text`] hides it wherever it appears.
pub fn remember_secret(secret: &str) {
    let mut forms = vec![secret.to_owned()];
    // As a JSON string writes it (log lines in JSON, `--json` output): quotes and backslashes escaped.
    if let Ok(quoted) = serde_json::to_string(secret) {
        forms.push(quoted[1..quoted.len() - 1].to_owned());
    }
    let mut remembered = REMEMBERED
        .write()
        .unwrap_or_else(|poison| poison.into_inner());
    for form in forms {
        if form.chars().count() >= SHORTEST_REMEMBERED && !remembered.contains(&form) {
            remembered.push(form);
        }
    }
    remembered.sort_by_key(|secret| std::cmp::Reverse(secret.len()));
}

/// Remembers every secret in `value` (a URL, a list of them or a connection string): each password as
/// written and as the client decodes it, each secret parameter's value.
pub fn remember_secrets_in(value: &str) {
    for secret in found(value, Bounds::Whole) {
        for form in secret.forms {
            remember_secret(&form);
        }
    }
}

/// How far a URL or a parameter's value may reach.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Bounds {
    /// The text is one configured value: it reaches to the end (or to the next URL of a list).
    Whole,
    /// Running text: a URL or a value also ends at white space or a quote.
    Words,
}

/// A secret found in a text: where it stands, and the forms it may take elsewhere.
#[derive(Debug)]
struct Found {
    span: Range<usize>,
    forms: Vec<String>,
}

fn found(text: &str, bounds: Bounds) -> Vec<Found> {
    let mut found: Vec<Found> = urls(text, bounds)
        .into_iter()
        .filter_map(|url| password(text, url))
        .collect();
    found.extend(parameters(text, bounds));
    found
}

/// `text` with every span of `found` replaced by the mask (overlapping spans merged).
fn mask(text: &str, found: &[Found]) -> String {
    let mut spans: Vec<Range<usize>> = found.iter().map(|f| f.span.clone()).collect();
    spans.sort_by_key(|span| span.start);
    let mut out = String::with_capacity(text.len());
    let mut at = 0;
    for span in spans {
        if span.end <= at {
            continue;
        }
        let start = span.start.max(at);
        out.push_str(&text[at..start]);
        out.push_str(MASK);
        at = span.end;
    }
    out.push_str(&text[at..]);
    out
}

fn redact_remembered(text: &str) -> String {
    let remembered = REMEMBERED
        .read()
        .unwrap_or_else(|poison| poison.into_inner());
    let mut out = text.to_owned();
    for secret in remembered.iter() {
        if out.contains(secret.as_str()) {
            out = out.replace(secret.as_str(), MASK);
        }
    }
    out
}

/// Where each URL of `text` stands: from its scheme to the next URL's scheme, and in running text
/// also to the first white space or quote.
fn urls(text: &str, bounds: Bounds) -> Vec<Range<usize>> {
    let starts: Vec<(usize, usize)> = text
        .match_indices("://")
        .filter_map(|(separator, _)| {
            let scheme = text[..separator]
                .char_indices()
                .rev()
                .take_while(|&(_, c)| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.'))
                .last()?
                .0;
            let first = text[scheme..].chars().next()?;
            first
                .is_ascii_alphabetic()
                .then_some((scheme, separator + 3))
        })
        .collect();
    starts
        .iter()
        .enumerate()
        .map(|(i, &(start, authority))| {
            let next = starts.get(i + 1).map_or(text.len(), |&(next, _)| next);
            let end = match bounds {
                Bounds::Whole => next,
                Bounds::Words => text[authority..next]
                    .find(|c: char| c.is_whitespace() || matches!(c, '"' | '\'' | '<' | '>' | '`'))
                    .map_or(next, |i| authority + i),
            };
            start..end
        })
        .collect()
}

/// The password of the URL at `url` in `text`: after the first `:` of the user info, which ends at
/// the URL's last `@` (see the module's comment for why the last).
fn password(text: &str, url: Range<usize>) -> Option<Found> {
    let whole = &text[url.clone()];
    let authority = whole.find("://")? + 3;
    let rest = &whole[authority..];
    let at = rest.rfind('@')?;
    let colon = rest[..at].find(':')?;
    let span = url.start + authority + colon + 1..url.start + authority + at;
    let written = &text[span.clone()];
    let mut forms = vec![written.to_owned(), percent_decoded(written)];
    // How the client will read it, when its parser takes this URL at all.
    if let Some(parsed) = url::Url::parse(whole.trim_end_matches([',', ';', ' ']))
        .ok()
        .and_then(|u| u.password().map(percent_decoded))
    {
        forms.push(parsed);
    }
    forms.dedup();
    Some(Found { span, forms })
}

fn percent_decoded(text: &str) -> String {
    percent_encoding::percent_decode_str(text)
        .decode_utf8_lossy()
        .into_owned()
}

/// Every secret parameter's value in `text`: `password=…` after `?` or `&` (a URL's query, up to the
/// next `&`), or at the start or after white space (a key/value connection string: up to unescaped
/// white space, or quoted in `'…'` with `\'` and `\\` escapes, as libpq reads it).
fn parameters(text: &str, bounds: Bounds) -> Vec<Found> {
    let lower = text.to_ascii_lowercase();
    let mut found = Vec::new();
    for name in SECRET_PARAMETERS {
        for (at, _) in lower.match_indices(name) {
            let before = text[..at].chars().next_back();
            let in_query = matches!(before, Some('?' | '&'));
            if !(in_query || before.is_none_or(|c| c.is_whitespace() || c == ';')) {
                continue;
            }
            // `name = value`: libpq allows white space around the `=`.
            let after_name = &text[at + name.len()..];
            let Some(after_equals) = after_name.trim_start().strip_prefix('=') else {
                continue;
            };
            let value = after_equals.trim_start();
            let start = text.len() - value.len();
            let (length, form) = if in_query {
                query_value(value, bounds)
            } else {
                connection_string_value(value)
            };
            if length == 0 {
                continue;
            }
            let mut forms = vec![form.clone()];
            if in_query {
                forms.push(percent_decoded(&form));
            }
            found.push(Found {
                span: start..start + length,
                forms,
            });
        }
    }
    found
}

/// A query parameter's value: up to the next `&` (a `#` is taken as part of it: an unencoded one in
/// a password must not cut it short), in running text also to white space or a quote.
fn query_value(value: &str, bounds: Bounds) -> (usize, String) {
    let end = value
        .find(|c: char| {
            c == '&'
                || (bounds == Bounds::Words
                    && (c.is_whitespace() || matches!(c, '"' | '\'' | '<' | '>' | '`')))
        })
        .unwrap_or(value.len());
    (end, value[..end].to_owned())
}

/// A libpq key/value setting's value: quoted (`'x y'`, `\'` and `\\` escaped) or up to unescaped
/// white space. Returns its length as written, quotes included, and its unescaped text.
fn connection_string_value(value: &str) -> (usize, String) {
    let (quoted, body) = match value.strip_prefix('\'') {
        Some(body) => (true, body),
        None => (false, value),
    };
    let mut text = String::new();
    let mut chars = body.char_indices();
    let mut end = body.len();
    while let Some((i, c)) = chars.next() {
        match c {
            '\\' => match chars.next() {
                Some((_, escaped)) => text.push(escaped),
                None => text.push(c),
            },
            '\'' if quoted => {
                end = i + 1;
                break;
            }
            c if !quoted && c.is_whitespace() => {
                end = i;
                break;
            }
            c => text.push(c),
        }
    }
    (end + usize::from(quoted), text)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Passwords with every character that has cut a password short somewhere.
    const AWKWARD: &[&str] = &[
        "pa,ss", "pa#ss", "pa/ss", "pa?ss", "pa@ss", "pa:ss", "12/ss", "p%40ss", "p%23s", "a b",
        "x&y=z", "ü-pw",
    ];

    #[test]
    fn passwords_in_user_info_are_hidden() {
        assert_eq!(
            redact_url("postgres://u:secret@h:5432/db"),
            "postgres://u:***@h:5432/db"
        );
        assert_eq!(redact_url("nats://tok@h:4222"), "nats://tok@h:4222");
        assert_eq!(redact_url("postgres://h:5432/db"), "postgres://h:5432/db");
    }

    #[test]
    fn a_password_of_any_characters_is_hidden_whole() {
        for password in AWKWARD {
            for scheme in ["postgres", "nats", "tls"] {
                let url = format!("{scheme}://user:{password}@127.0.0.1:1/db?sslmode=disable");
                let shown = redact_url(&url);
                assert_eq!(
                    shown,
                    format!("{scheme}://user:***@127.0.0.1:1/db?sslmode=disable"),
                    "{url}"
                );
                let message = format!("cannot connect to {url}: refused");
                let shown = redact_text(&message);
                if !password.contains(' ') {
                    assert_eq!(
                        shown,
                        format!(
                            "cannot connect to {scheme}://user:***@127.0.0.1:1/db?sslmode=disable: refused"
                        ),
                        "{message}"
                    );
                }
            }
        }
    }

    #[test]
    fn secret_parameters_are_hidden_wherever_they_stand() {
        let shown = redact_text(
            "cannot connect to postgres://h/db?user=u&password=s3cret&sslmode=require: refused",
        );
        assert_eq!(
            shown,
            "cannot connect to postgres://h/db?user=u&password=***&sslmode=require: refused"
        );
        assert!(!redact_text("x?PASSWORD=abc").contains("abc"));
        assert_eq!(
            redact_url("a://u:p@h/?sslpassword=k&token=t"),
            "a://u:***@h/?sslpassword=***&token=***"
        );
        assert_eq!(
            redact_url("postgres://h/db?password=a#b&sslmode=disable"),
            "postgres://h/db?password=***&sslmode=disable",
            "an unencoded # is part of the value"
        );
    }

    #[test]
    fn key_value_connection_strings_are_hidden_quoted_or_not() {
        assert_eq!(
            redact_url(r"host=h password='x y\' \\z' user=u"),
            "host=h password=*** user=u"
        );
        assert_eq!(
            redact_url("host=h password = plain user=u"),
            "host=h password = *** user=u"
        );
        assert_eq!(
            redact_text(r"at host=h password=a\ b port=1: refused"),
            "at host=h password=*** port=1: refused"
        );
        // A name that only ends like a secret one is not a secret.
        assert_eq!(redact_url("host=h bypass=1"), "host=h bypass=1");
    }

    #[test]
    fn several_urls_in_one_message_are_all_redacted() {
        let shown = redact_text("from nats://a:one@h1 to nats://b:two@h2/x");
        assert_eq!(shown, "from nats://a:***@h1 to nats://b:***@h2/x");
        let list = redact_url("nats://a:o,ne@h1:4222,nats://b:t#wo@h2:4222");
        assert_eq!(list, "nats://a:***@h1:4222,nats://b:***@h2:4222");
    }

    #[test]
    fn an_at_sign_after_the_host_hides_more_never_less() {
        assert_eq!(
            redact_url("postgres://h:5432/db?application_name=a@b"),
            "postgres://h:***@b"
        );
        assert_eq!(
            redact_url("postgres://h/db?application_name=a@b"),
            "postgres://h/db?application_name=a@b",
            "nothing after a colon: nothing to hide"
        );
    }

    #[test]
    fn remembered_secrets_are_hidden_in_any_text() {
        remember_secrets_in("postgres://u:Rem%2Cembered-1@h/db");
        remember_secret("tok\"en-Remembered-2");
        remember_secret("abc");
        let shown = redact_text(
            "Rem,embered-1 and Rem%2Cembered-1, {\"t\":\"tok\\\"en-Remembered-2\"} abc",
        );
        assert_eq!(shown, "*** and ***, {\"t\":\"***\"} abc", "{shown}");
    }
}
