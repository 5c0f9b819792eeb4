//! Keeping secrets out of what is printed: passwords in URLs (`user:password@host`) and in query
//! parameters (`?password=…`, `sslpassword=…`, `token=…`), wherever they appear in a text.

/// Query parameters whose values are secrets.
const SECRET_PARAMETERS: &[&str] = &["password", "sslpassword", "token", "pass", "secret"];

/// `text` with every password in a URL's user info and every secret query parameter replaced by `***`.
/// Works on whole messages too (an error that quotes a URL).
pub fn redact_url(text: &str) -> String {
    redact_parameters(&redact_userinfo(text))
}

fn redact_userinfo(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find("://") {
        let (head, tail) = rest.split_at(at + 3);
        out.push_str(head);
        // The authority ends at the first '/', '?', '#', white space or ',' (a list of server URLs,
        // as NATS_URL may be).
        let end = tail
            .find(|c: char| matches!(c, '/' | '?' | '#' | ',') || c.is_whitespace())
            .unwrap_or(tail.len());
        let authority = &tail[..end];
        match authority.rsplit_once('@') {
            Some((userinfo, host)) => {
                let user = userinfo.split_once(':').map_or(userinfo, |(user, _)| user);
                out.push_str(user);
                if userinfo.contains(':') {
                    out.push_str(":***");
                }
                out.push('@');
                out.push_str(host);
            }
            None => out.push_str(authority),
        }
        rest = &tail[end..];
    }
    out.push_str(rest);
    out
}

fn redact_parameters(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    loop {
        let lower = rest.to_ascii_lowercase();
        let found = SECRET_PARAMETERS
            .iter()
            .filter_map(|name| {
                let needle = format!("{name}=");
                lower.match_indices(&needle).find_map(|(at, _)| {
                    let before = lower[..at].chars().last();
                    matches!(before, Some('?' | '&' | ' ') | None).then_some((at, needle.len()))
                })
            })
            .min();
        let Some((at, len)) = found else {
            out.push_str(rest);
            return out;
        };
        out.push_str(&rest[..at + len]);
        out.push_str("***");
        let value = &rest[at + len..];
        let end = value
            .find(|c: char| c == '&' || c == '#' || c == '"' || c == '\'' || c.is_whitespace())
            .unwrap_or(value.len());
        rest = &value[end..];
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
    fn secret_parameters_are_hidden_wherever_they_stand() {
        let shown = redact_url(
            "cannot connect to postgres://h/db?user=u&password=s3cret&sslmode=require: refused",
        );
        assert_eq!(
            shown,
            "cannot connect to postgres://h/db?user=u&password=***&sslmode=require: refused"
        );
        assert!(!redact_url("x?PASSWORD=abc").contains("abc"));
        assert_eq!(
            redact_url("a://u:p@h/?sslpassword=k&token=t"),
            "a://u:***@h/?sslpassword=***&token=***"
        );
    }

    #[test]
    fn several_urls_in_one_message_are_all_redacted() {
        let shown = redact_url("from nats://a:one@h1 to nats://b:two@h2/x");
        assert!(!shown.contains("one") && !shown.contains("two"), "{shown}");
    }
}
