//! HTML building blocks of the console: escaping, the page frame, and small formatters. Everything the
//! database or the stream holds is attacker-controlled (payloads, reasons, subjects), so every value
//! goes through [`esc`] and nothing is ever spliced into a script or an attribute unescaped.

use std::fmt::Write as _;

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};

/// At most this much of one stored text is shown; the rest is summarized by its size (a 10 MB
/// payload must not become a 10 MB page).
pub const SHOWN_BYTES: usize = 16 * 1024;

/// Escapes text for an HTML text node or a quoted attribute. Control characters other than tab and
/// newline (NUL included) become U+FFFD: browsers would drop or mangle them, and they are never
/// legitimate in anything the console shows.
pub fn esc(text: &str) -> String {
    let mut out = String::with_capacity(text.len() + text.len() / 8);
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            '\t' | '\n' => out.push(c),
            c if c.is_control() => out.push('\u{FFFD}'),
            c => out.push(c),
        }
    }
    out
}

/// Escapes at most [`SHOWN_BYTES`] of `text`, saying how much was left out.
pub fn esc_capped(text: &str) -> String {
    if text.len() <= SHOWN_BYTES {
        return esc(text);
    }
    let mut cut = SHOWN_BYTES;
    while !text.is_char_boundary(cut) {
        cut -= 1;
    }
    format!(
        "{}\n… ({} more bytes not shown; {} bytes in all)",
        esc(&text[..cut]),
        text.len() - cut,
        text.len()
    )
}

/// Bytes that should be text (a parked body): lossy UTF-8, then escaped and capped.
pub fn esc_bytes(bytes: &[u8]) -> String {
    esc_capped(&String::from_utf8_lossy(bytes))
}

/// Pretty JSON, escaped and capped.
pub fn json_block(value: &serde_json::Value) -> String {
    esc_capped(&serde_json::to_string_pretty(value).unwrap_or_else(|e| e.to_string()))
}

/// A count with thin separators, as people read large numbers.
pub fn count(n: i64) -> String {
    let digits = n.unsigned_abs().to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    if n < 0 { format!("-{out}") } else { out }
}

/// An age in seconds, as `4.2 s`, `3 min 5 s` or `2 h 10 min`.
pub fn age(seconds: f64) -> String {
    if seconds < 60.0 {
        format!("{seconds:.1} s")
    } else if seconds < 3600.0 {
        format!(
            "{} min {} s",
            (seconds / 60.0) as u64,
            (seconds % 60.0) as u64
        )
    } else {
        format!(
            "{} h {} min",
            (seconds / 3600.0) as u64,
            ((seconds % 3600.0) / 60.0) as u64
        )
    }
}

/// Which top-level page is shown (highlighted in the navigation).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Section {
    Overview,
    Order,
    Catalog,
    Lists,
}

/// A whole page: the frame, the navigation (with the order search), and `body`. `operator` says
/// whether state-changing actions exist on this service, for the script.
pub fn page(title: &str, section: Section, operator: bool, body: &str) -> String {
    let mut out = String::with_capacity(body.len() + 2048);
    let current = |s: Section| {
        if s == section {
            " aria-current=\"page\""
        } else {
            ""
        }
    };
    let _ = write!(
        out,
        "<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\
         <meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\
         <title>{title} · waybill console</title>\
         <link rel=\"stylesheet\" href=\"/console/assets/console.css\">\
         <script defer src=\"/console/assets/console.js\"></script></head>\
         <body data-operator=\"{operator}\">\
         <a class=\"skip\" href=\"#main\">Skip to content</a>\
         <header><nav aria-label=\"console\"><span class=\"brand\">waybill console</span>\
         <a href=\"/console\"{o}>Pipeline</a>\
         <a href=\"/console/outbox/dead\"{l}>Dead rows</a>\
         <a href=\"/console/catalog\"{c}>Catalog</a>\
         <form class=\"find\" action=\"/console/orders\" method=\"get\" role=\"search\">\
         <label for=\"find-order\">Order</label>\
         <input id=\"find-order\" name=\"id\" placeholder=\"order id (press /)\" autocomplete=\"off\" \
         spellcheck=\"false\" size=\"38\"><button type=\"submit\">Show</button></form>\
         </nav></header><main id=\"main\" tabindex=\"-1\">{body}</main>\
         <footer>Keys: <kbd>/</kbd> find an order · <kbd>g</kbd> then <kbd>p</kbd> pipeline, \
         <kbd>c</kbd> catalog, <kbd>d</kbd> dead rows. Assets are served by this binary; nothing \
         is loaded from elsewhere.</footer></body></html>",
        title = esc(title),
        operator = if operator { "on" } else { "off" },
        o = current(Section::Overview),
        l = current(Section::Lists),
        c = current(Section::Catalog),
    );
    out
}

/// An HTML response. Pages carry a strict content security policy: only this service's own script
/// and style, so even an escaping bug could not load or run anything from elsewhere.
pub fn respond(status: StatusCode, html: String) -> Response {
    let mut response = (status, html).into_response();
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/html; charset=utf-8"),
    );
    headers.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(
            "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; \
             connect-src 'self'; form-action 'self'; base-uri 'none'; frame-ancestors 'none'",
        ),
    );
    headers.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    response
}

/// A page that only says what went wrong.
pub fn error_page(status: StatusCode, title: &str, detail: &str, operator: bool) -> Response {
    let body = format!(
        "<h1>{}</h1><p class=\"error\">{}</p><p><a href=\"/console\">Back to the pipeline</a></p>",
        esc(title),
        esc(detail)
    );
    respond(status, page(title, Section::Lists, operator, &body))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn markup_nul_and_quotes_are_neutralized() {
        assert_eq!(
            esc("<script>\"x\"&'y'\0</script>"),
            "&lt;script&gt;&quot;x&quot;&amp;&#39;y&#39;\u{FFFD}&lt;/script&gt;"
        );
    }

    #[test]
    fn long_text_is_capped_on_a_character_boundary() {
        let text = "é".repeat(SHOWN_BYTES);
        let shown = esc_capped(&text);
        assert!(shown.len() < text.len());
        assert!(
            shown.contains("more bytes not shown"),
            "{}",
            &shown[shown.len() - 80..]
        );
    }

    #[test]
    fn counts_are_grouped() {
        assert_eq!(count(0), "0");
        assert_eq!(count(1234567), "1,234,567");
        assert_eq!(count(-1000), "-1,000");
    }
}
