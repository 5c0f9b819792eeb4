//! The operator token that guards state-changing HTTP actions (the console's, a projection's operator
//! API): without a token the actions do not exist (403); with one, a request must carry
//! `Authorization: Bearer <token>` (compared in constant time) or it is answered 401. A bearer header is
//! never sent by a browser on its own, so a page elsewhere cannot make a viewer's browser act (no
//! cookies, no CSRF).

use axum::http::{HeaderMap, StatusCode, header};

/// Shortest token accepted: long enough not to be guessed over HTTP.
pub const MIN_TOKEN_CHARS: usize = 16;

/// The operator token, kept as bytes for the constant-time comparison and never printed.
#[derive(Clone)]
pub struct OperatorToken(Vec<u8>);

impl std::fmt::Debug for OperatorToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("OperatorToken(***)")
    }
}

impl OperatorToken {
    /// Reads a token given on the command line or in the environment (a clap `value_parser`):
    /// surrounding blanks are dropped, and a token shorter than [`MIN_TOKEN_CHARS`] is refused.
    pub fn parse(text: &str) -> Result<Self, String> {
        let text = text.trim();
        // What an HTTP header can carry as it is: anything else could never be sent or compared.
        if !text.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(
                "an operator token may hold only visible ASCII characters (no spaces, no accents)"
                    .to_owned(),
            );
        }
        if text.chars().count() < MIN_TOKEN_CHARS {
            return Err(format!(
                "an operator token needs at least {MIN_TOKEN_CHARS} characters"
            ));
        }
        Ok(Self(text.as_bytes().to_vec()))
    }

    /// The header value that carries this token, for a service that calls another on the operator's
    /// behalf. Never logged.
    pub fn bearer(&self) -> String {
        format!("Bearer {}", String::from_utf8_lossy(&self.0))
    }

    /// Whether `headers` carry `Authorization: Bearer <this token>`. The comparison takes the same
    /// time wherever the first difference is, so response times do not reveal the token.
    pub fn admits(&self, headers: &HeaderMap) -> bool {
        let Some(given) = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            // The scheme is case-insensitive (RFC 9110, section 11.1); the token is not.
            .and_then(|v| v.split_once(' '))
            .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("Bearer"))
            .map(|(_, token)| token)
        else {
            return false;
        };
        constant_time_eq(given.trim().as_bytes(), &self.0)
    }
}

/// Why an action was not admitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Denied {
    /// The service has no operator token: it changes nothing over HTTP.
    Disabled,
    /// The request did not carry the token.
    Unauthorized,
}

impl Denied {
    /// 403 or 401.
    pub fn status(self) -> StatusCode {
        match self {
            Self::Disabled => StatusCode::FORBIDDEN,
            Self::Unauthorized => StatusCode::UNAUTHORIZED,
        }
    }

    /// A short name for the problem's type.
    pub fn kind(self) -> &'static str {
        match self {
            Self::Disabled => "actions-disabled",
            Self::Unauthorized => "operator-token-required",
        }
    }

    /// What to do about it.
    pub fn detail(self) -> &'static str {
        match self {
            Self::Disabled => {
                "this service was started without an operator token (--operator-token or \
                 WAYBILL_OPERATOR_TOKEN), so it changes nothing over HTTP"
            }
            Self::Unauthorized => "send the operator token as Authorization: Bearer <token>",
        }
    }
}

/// Admits a request to a state-changing action, or says why not.
pub fn authorize(token: Option<&OperatorToken>, headers: &HeaderMap) -> Result<(), Denied> {
    match token {
        None => Err(Denied::Disabled),
        Some(token) if token.admits(headers) => Ok(()),
        Some(_) => Err(Denied::Unauthorized),
    }
}

/// Equality whose time depends only on the lengths.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    let mut difference = a.len() ^ b.len();
    for i in 0..a.len().max(b.len()) {
        let x = a.get(i).copied().unwrap_or(0);
        let y = b.get(i).copied().unwrap_or(0);
        difference |= usize::from(x ^ y);
    }
    std::hint::black_box(difference) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with(value: &str) -> HeaderMap {
        let mut headers = HeaderMap::new();
        headers.insert(header::AUTHORIZATION, value.parse().expect("header"));
        headers
    }

    #[test]
    fn only_the_exact_bearer_token_is_admitted() {
        let token = OperatorToken::parse(" s3cret-s3cret-s3cret ").expect("token");
        assert!(token.admits(&with("Bearer s3cret-s3cret-s3cret")));
        assert!(token.admits(&with("bearer s3cret-s3cret-s3cret")));
        assert!(!token.admits(&with("Bearer s3cret-s3cret-s3cre")));
        assert!(!token.admits(&with("Bearer s3cret-s3cret-s3cret2")));
        assert!(!token.admits(&with("Basic s3cret-s3cret-s3cret")));
        assert!(!token.admits(&HeaderMap::new()));
        assert_eq!(format!("{token:?}"), "OperatorToken(***)");
        assert!(token.admits(&with(&token.bearer())));
    }

    #[test]
    fn short_tokens_and_tokens_a_header_cannot_carry_are_refused() {
        assert!(OperatorToken::parse("short").is_err());
        assert!(OperatorToken::parse("               x").is_err());
        assert!(OperatorToken::parse("pässwort-pässwort-1").is_err());
        assert!(OperatorToken::parse("two words and more text").is_err());
        assert!(OperatorToken::parse("control\u{7}character-token").is_err());
    }

    #[test]
    fn without_a_token_nothing_is_admitted() {
        let request = with("Bearer anything-at-all-here");
        assert_eq!(authorize(None, &request), Err(Denied::Disabled));
        let token = OperatorToken::parse("the-right-token-123").expect("token");
        assert_eq!(authorize(Some(&token), &request), Err(Denied::Unauthorized));
        assert_eq!(
            authorize(Some(&token), &with("Bearer the-right-token-123")),
            Ok(())
        );
    }
}
