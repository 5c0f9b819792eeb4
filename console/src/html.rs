//! The console's HTML frame and building blocks: the page template every page is rendered in, the
//! response headers, and the formatters. Pages are maud templates, so every value spliced into one is
//! escaped by construction; what this module adds is [`Text`], which also neutralizes control
//! characters and caps long texts — everything the database or the stream holds is
//! attacker-controlled (payloads, reasons, subjects).

use std::fmt::Write as _;

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use maud::{DOCTYPE, Markup, Render, html};

/// At most this much of one stored text is shown; the rest is summarized by its size (a 10 MB
/// payload must not become a 10 MB page).
pub(crate) const SHOWN_BYTES: usize = 16 * 1024;

/// Stored text as the console shows it: control characters other than tab and newline (NUL
/// included) become U+FFFD — browsers would drop or mangle them, and they are never legitimate in
/// anything the console shows — and, when capped, at most [`SHOWN_BYTES`] with the size of the rest.
/// Rendered through maud's escaper like every other value.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Text<'a> {
    text: &'a str,
    capped: bool,
}

/// `text`, cleaned of control characters.
pub(crate) fn text(text: &str) -> Text<'_> {
    Text {
        text,
        capped: false,
    }
}

/// `text`, cleaned and capped at [`SHOWN_BYTES`].
pub(crate) fn capped(text: &str) -> Text<'_> {
    Text { text, capped: true }
}

impl Render for Text<'_> {
    fn render_to(&self, buffer: &mut String) {
        let mut shown = self.text;
        if self.capped && shown.len() > SHOWN_BYTES {
            let mut cut = SHOWN_BYTES;
            while !shown.is_char_boundary(cut) {
                cut -= 1;
            }
            shown = &shown[..cut];
        }
        let mut escaper = maud::Escaper::new(buffer);
        for c in shown.chars() {
            let c = match c {
                '\t' | '\n' => c,
                c if c.is_control() => '\u{FFFD}',
                c => c,
            };
            let _ = escaper.write_char(c);
        }
        if shown.len() < self.text.len() {
            let _ = write!(
                escaper,
                "\n… ({} more bytes not shown; {} bytes in all)",
                self.text.len() - shown.len(),
                self.text.len()
            );
        }
    }
}

/// Pretty JSON, cleaned and capped.
pub(crate) fn json_block(value: &serde_json::Value) -> Markup {
    let pretty = serde_json::to_string_pretty(value).unwrap_or_else(|e| e.to_string());
    html! { (capped(&pretty)) }
}

/// A count with thin separators, as people read large numbers.
pub(crate) fn count(n: i64) -> String {
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
#[allow(
    clippy::cast_possible_truncation,
    clippy::cast_sign_loss,
    reason = "whole minutes and hours of an age of at least a minute: positive, and `as` from f64 saturates"
)]
pub(crate) fn age(seconds: f64) -> String {
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
pub(crate) enum Section {
    Overview,
    Order,
    Catalog,
    Lists,
}

/// A whole page: the frame, the navigation (with the order search), and `body`. `operator` says
/// whether state-changing actions exist on this console, for the script.
pub(crate) fn page(title: &str, section: Section, operator: bool, body: Markup) -> Markup {
    let current = |s: Section| (s == section).then_some("page");
    html! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                meta name="viewport" content="width=device-width, initial-scale=1";
                title { (text(title)) " · waybill console" }
                link rel="stylesheet" href="/console/assets/console.css";
                script defer src="/console/assets/console.js" {}
            }
            body data-operator=(if operator { "on" } else { "off" }) {
                a.skip href="#main" { "Skip to content" }
                header {
                    nav aria-label="console" {
                        span.brand { "waybill console" }
                        a href="/console" aria-current=[current(Section::Overview)] { "Pipeline" }
                        a href="/console/outbox/dead" aria-current=[current(Section::Lists)] { "Dead rows" }
                        a href="/console/catalog" aria-current=[current(Section::Catalog)] { "Catalog" }
                        form.find action="/console/orders" method="get" role="search" {
                            label for="find-order" { "Order" }
                            input #find-order name="id" placeholder="order id (press /)"
                                autocomplete="off" spellcheck="false" size="38";
                            button type="submit" { "Show" }
                        }
                    }
                }
                main #main tabindex="-1" { (body) }
                footer {
                    "Keys: " kbd { "/" } " find an order · " kbd { "g" } " then " kbd { "p" }
                    " pipeline, " kbd { "c" } " catalog, " kbd { "d" } " dead rows. Assets are served by \
                     this binary; nothing is loaded from elsewhere."
                }
            }
        }
    }
}

/// An HTML response. Pages carry a strict content security policy: only this service's own script
/// and style, so even an escaping bug could not load or run anything from elsewhere.
pub(crate) fn respond(status: StatusCode, page: Markup) -> Response {
    let mut response = (status, page.into_string()).into_response();
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
pub(crate) fn error_page(
    status: StatusCode,
    title: &str,
    detail: &str,
    operator: bool,
) -> Response {
    let body = html! {
        h1 { (text(title)) }
        p.error { (text(detail)) }
        p { a href="/console" { "Back to the pipeline" } }
    };
    respond(status, page(title, Section::Lists, operator, body))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shown(t: Text<'_>) -> String {
        html! { (t) }.into_string()
    }

    #[test]
    fn markup_nul_and_quotes_are_neutralized() {
        assert_eq!(
            shown(text("<script>\"x\"&'y'\0</script>")),
            "&lt;script&gt;&quot;x&quot;&amp;'y'\u{FFFD}&lt;/script&gt;"
        );
    }

    #[test]
    fn long_text_is_capped_on_a_character_boundary() {
        let long = "é".repeat(SHOWN_BYTES);
        let out = shown(capped(&long));
        assert!(out.len() < long.len());
        assert!(
            out.ends_with(&format!(
                "more bytes not shown; {} bytes in all)",
                long.len()
            )),
            "{}",
            &out[out.len() - 80..]
        );
        assert_eq!(shown(capped("short")), "short");
    }

    #[test]
    fn counts_are_grouped() {
        assert_eq!(count(0), "0");
        assert_eq!(count(1234567), "1,234,567");
        assert_eq!(count(-1000), "-1,000");
    }

    #[test]
    fn the_frame_escapes_its_title_and_marks_the_current_section() {
        let page = page("<b>x</b>", Section::Catalog, true, html! { p { "body" } }).into_string();
        assert!(page.starts_with("<!DOCTYPE html>"), "{page}");
        assert!(page.contains("<title>&lt;b&gt;x&lt;/b&gt; · waybill console</title>"));
        assert!(page.contains("<a href=\"/console/catalog\" aria-current=\"page\">Catalog</a>"));
        assert!(page.contains("<a href=\"/console\">Pipeline</a>"));
        assert!(page.contains("data-operator=\"on\""));
    }
}
